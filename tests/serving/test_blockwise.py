"""The block-wise attention (serving/blockwise.py) on the tiny model: equal to the oracle on real K/V within
the runtime check's tolerance, equal to the materializing cache through generate(), never building a decoded
copy of the history, and never copying the stored rows (the cache's pages: exporters.layout.PagedRows)."""
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from exporters.codec import CachePolicy, TensorPolicy, decode, encode
from exporters.layout import PagedBlock, join, load, slice_rows, store
from pipeline.check import eval_ids
from pipeline.config import load_recipe
from runtime_check import reference
from runtime_check.check import RTOL, check_case, compare, record
from serving import blockwise
from serving.blockwise import generate
from serving.cache import HELD_KINDS, ArtifactCache, ArtifactLayer, from_layer
from stages import recipe as recipe_stage
from stages.base import InputError
from stages.hooks import attention_override, eager_attention

BLOCK = 7  # smaller than the cached rows, not a divisor of them: several blocks, boundaries inside encoded rows


def _policy(tiny, calib, name: str) -> CachePolicy:
    """A recipe's policy on the tiny model, its residual window and KIVI groups shrunk to the test's contexts;
    "value-groups": int4-token with per-channel VALUE groups of 4 (and a residual of 6, no multiple of them)."""
    q = load_recipe("int4-token" if name == "value-groups" else name)
    if name == "value-groups":
        q.name, q.value.axis, q.value.group_size, q.residual, q.n_sink = name, "channel", 4, 6, 1
        recipe_stage.validate_recipe(q)
    pol = recipe_stage.build_policy(q, tiny.spec.n_layers, calib["smooth" if q.smooth else "plain"])
    if name.startswith("kivi"):
        layers = [(replace(k, group_size=4), v) for k, v in pol.layers]
        pol = replace(pol, layers=layers, residual=8)
    return pol


RECIPES = ["fp16", "fp8-e4m3", "kivi-2", "kvquant-4b-1pct", "int4-token+smooth", "kvquant-3b-1pct+smooth"]


def _nuq(bits: int, axis: str, d: int) -> TensorPolicy:
    g = torch.Generator().manual_seed(bits)
    book = torch.sort(torch.rand(2 ** bits, generator=g) * 2 - 1).values
    if axis == "token":
        return TensorPolicy(format="nuq", bits=bits, axis="token", codebook=book, outlier_fraction=0.05)
    return TensorPolicy(format="nuq", bits=bits, axis="channel", codebook=book, zero=0.1 * torch.randn(3, d, generator=g),
                        range=1 + torch.rand(3, d, generator=g), lower=-torch.ones(3, d), upper=torch.ones(3, d),
                        outlier_fraction=0.05)


@pytest.mark.parametrize("bits,axis,d,smooth", [(4, "channel", 16, True), (2, "channel", 14, True),
                                                (8, "channel", 16, False), (4, "token", 16, False),
                                                (2, "token", 10, False), (3, "channel", 16, True)])
def test_the_readers_byte_tables_decode_as_the_codec(bits, axis, d, smooth):
    """nuq rows read through a table of every byte's levels (range, zero and lambda folded in for per-channel
    keys) equal exporters.codec.decode of the same bytes (x lambda), outliers included; bit widths that do not
    divide a byte (3) take the codec's path."""
    p = _nuq(bits, axis, d)
    x = 1.5 * torch.randn(2, 3, 23, d, generator=torch.Generator().manual_seed(1))
    rows = store(encode(x, p), p, start=5)
    assert rows.tensors["outlier_value"].numel() > 5
    lam = 0.5 + torch.rand(3, d, generator=torch.Generator().manual_seed(2)) if smooth else None
    inp = blockwise.DecodeInputs(q=torch.zeros(2, 3, d), scaling=1.0, key_policy=p, value_policy=p, key_rope="post",
                                 rotary=None, k_block=rows, v_block=rows, smooth=lam)
    reader = blockwise._Reader(inp)
    assert (reader.k_table is None) == (bits == 3)
    want = decode(load(rows, p), p)
    assert torch.equal(reader.values(rows), want)
    assert torch.equal(reader.keys(rows), want if lam is None else want * lam[None, :, None, :])
    part = slice_rows(rows, 4, 17, p)
    assert torch.equal(reader.values(part), want[:, :, 4:17])


def test_the_half_by_half_rotation_is_apply_rope():
    from exporters.rope import apply_rope, rope_cos_sin

    x = torch.randn(2, 3, 9, 16, generator=torch.Generator().manual_seed(3))
    cos, sin = rope_cos_sin(torch.arange(100, 109), 16, 10000.0)
    assert blockwise._repeated_halves(cos, sin)
    torch.testing.assert_close(blockwise._rotate(x, cos, sin), apply_rope(x, cos, sin), rtol=1e-6, atol=1e-6)
    odd = torch.randn(9, 16)  # halves that differ: the reader takes apply_rope
    assert not blockwise._repeated_halves(odd, odd) and not blockwise._repeated_halves(cos[:, :15], sin[:, :15])


def test_the_shared_rope_table_is_the_rotary_modules_own(tiny):
    """rope_at's slices of one table equal the rotary module's tables computed at that start, bit for bit,
    before and after the table grows."""
    from exporters.rope import rotary_tables

    rotary = tiny.model.model.rotary_emb
    for start, n in ((0, 7), (4090, 9), (5000, 2048), (12, 1)):
        cos, sin = blockwise.rope_at(rotary, start, n, torch.device("cpu"))
        ref_cos, ref_sin = rotary_tables(rotary, start, n, torch.float32)
        assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0]), (start, n)
    from serving.rope_tables import _ROPE

    assert _ROPE[rotary][1].shape[0] >= 7048


def _oracle_cases(tiny, calib, name, context=40, batch=2):
    pol = _policy(tiny, calib, name)
    return record(tiny, pol, eval_ids(tiny.tokenizer, batch, context + 1))


@pytest.mark.parametrize("name", RECIPES)
def test_blockwise_decode_equals_the_oracle(tiny, calib, name):
    """Every layer, real K/V of text: block-wise decode attention == reference.decode_attention over the same
    stored cache within the runtime check's bound, and at float32-rounding level."""
    for inp in _oracle_cases(tiny, calib, name):
        n_enc = inp.k_block.shape[2] if inp.k_block is not None else 0
        assert n_enc > 2 * BLOCK and n_enc % BLOCK  # several blocks of encoded rows, a partial last one
        got = blockwise.decode_attention(inp, block=BLOCK)
        ref = reference.decode_attention(inp)
        res = compare(got, ref)
        assert res["ok"] and res["max_rel_err"] < RTOL / 20, res
        # one block holding everything gives the same answer: the merge, not the blocking, is what is checked
        assert compare(blockwise.decode_attention(inp, block=1024), ref)["ok"]


@pytest.mark.parametrize("name", ["kvquant-3b-1pct+smooth", "value-groups"])
def test_blockwise_passes_the_runtime_check(tiny, calib, name):
    """As the runtime check runs it: check_case with the block-wise attention as the kernel (value-groups: the
    cache flushes whole value groups, and both readers slice values on their group boundaries)."""
    pol = _policy(tiny, calib, name)
    timing = {"kernel_s": 0.0, "oracle_s": 0.0}
    case = check_case(tiny, pol, eval_ids(tiny.tokenizer, 2, 49), None,
                      lambda inp: blockwise.decode_attention(inp, block=BLOCK), timing)
    assert case["ok"] and case["max_rel_err"] < 1e-5


@pytest.mark.parametrize("fault", ["outlier offsets restart per block", "RoPE from the block's first position",
                                   "last row of every slice dropped"])
def test_planted_faults_fail_the_comparison(tiny, calib, monkeypatch, fault):
    """The comparison has teeth: each mistake a block-wise reader could make fails it on some layer."""
    inputs = _oracle_cases(tiny, calib, "kvquant-4b-1pct")
    if fault == "outlier offsets restart per block":
        monkeypatch.setattr(blockwise, "n_outliers", lambda rows: 0)
    elif fault == "RoPE from the block's first position":
        real = blockwise.rope_at
        monkeypatch.setattr(blockwise, "rope_at", lambda rotary, start, n, device: real(rotary, 0, n, device))
    else:
        real = blockwise.slice_rows
        monkeypatch.setattr(blockwise, "slice_rows", lambda block, a, b, p, off: real(block, a, max(a + 1, b - 1), p, off))
    results = [compare(blockwise.decode_attention(inp, block=BLOCK), reference.decode_attention(inp)) for inp in inputs]
    assert not all(r["ok"] for r in results), fault


def _greedy(tiny, pol, ids, n=10, **kw):
    out, cache = generate(tiny.model, pol, ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          return_dict_in_generate=True, output_logits=True, **kw)
    return out.sequences, torch.stack(out.logits, 1), cache


@pytest.mark.parametrize("name", ["fp16", "kivi-2", "kvquant-4b-1pct", "kvquant-3b-1pct+smooth", "value-groups"])
def test_generate_blockwise_equals_materialize(tiny, calib, name):
    """Greedy generation: attention="blockwise" reading the stored form (prefill "stored": the chunk's own rows
    as stored too) gives the tokens and, to float32 rounding, the logits of the materializing cache."""
    pol = _policy(tiny, calib, name) if name in ("kivi-2", "value-groups") else replace(_policy(tiny, calib, name),
                                                                                        residual=4)
    ids = eval_ids(tiny.tokenizer, 2, 30)
    ref_tokens, ref_logits, _ = _greedy(tiny, pol, ids, attention="materialize")
    tokens, logits, cache = _greedy(tiny, pol, ids, attention="blockwise", block=BLOCK, prefill="stored")
    assert torch.equal(tokens, ref_tokens)
    assert torch.allclose(logits, ref_logits, rtol=1e-4, atol=1e-4 * float(ref_logits.abs().max()))
    assert cache.stats["largest_decode_temporary_bytes"] > 0


@pytest.mark.parametrize("attention", ["blockwise", "materialize"])
def test_generate_serves_a_prefix_policy_after_its_prefix(tiny, attention):
    """generate() with a policy that has a prefix continues the prompt after the prefix, as the evaluation serves
    it: an fp16 policy gives the model's own greedy tokens and, to the fp16 rounding of K and V, its logits for
    prefix + prompt (the prefix cut off again) -- not those of the prompt alone."""
    ids = eval_ids(tiny.tokenizer, 2, 20)
    prefix = torch.tensor([tiny.spec.bos_token_id, 17, 23])
    pol = CachePolicy("fp16+prefix", [(TensorPolicy(), TensorPolicy())] * tiny.spec.n_layers, key_rope="pre",
                      n_sink=1, prefix_ids=prefix, prefix_len=3)
    kw = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "return_dict_in_generate": True,
          "output_logits": True}
    want = tiny.model.generate(torch.cat([prefix[None].expand(2, -1), ids], 1), **kw)
    alone = tiny.model.generate(ids, **kw)
    got, cache = generate(tiny.model, pol, ids, attention=attention, block=BLOCK, **kw)
    assert torch.equal(got.sequences, want.sequences[:, 3:]) and cache.get_seq_length() == 3 + 20 + 7
    logits, want_logits, alone_logits = (torch.stack(x.logits, 1) for x in (got, want, alone))
    assert torch.allclose(logits, want_logits, atol=2e-3, rtol=1e-3)
    assert (logits - alone_logits).abs().max() > 100 * (logits - want_logits).abs().max()


def test_full_precision_prefill(tiny, calib):
    """prefill="full": the prompt attends to its own rows as computed (the first logits are the model's own,
    whatever the recipe), and the decode steps then read the stored form."""
    ids = eval_ids(tiny.tokenizer, 2, 30)
    with torch.no_grad():
        own = tiny.model(ids).logits[:, -1]
    pol = replace(_policy(tiny, calib, "kvquant-4b-1pct"), residual=4)
    tokens, logits, _ = _greedy(tiny, pol, ids, n=2, block=BLOCK)
    assert torch.allclose(logits[:, 0], own, atol=1e-5, rtol=1e-5)
    stored_tokens, stored_logits, _ = _greedy(tiny, pol, ids, n=2, block=BLOCK, prefill="stored")
    assert not torch.allclose(logits[:, 0], stored_logits[:, 0], atol=1e-5)  # the two prefills differ
    fp16 = CachePolicy("fp16", [(TensorPolicy(), TensorPolicy())] * tiny.spec.n_layers, key_rope="pre", n_sink=1)
    assert torch.equal(_greedy(tiny, fp16, ids, n=8, block=BLOCK)[0],
                       tiny.model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False))


def test_the_triton_kernel_is_the_single_token_path_of_the_same_function(tiny, calib):
    """kernel=True (on CUDA the default; here Triton's interpreter): a decode step through the kernel gives the
    logits of the torch block-wise path."""
    pol = replace(_policy(tiny, calib, "kvquant-3b-1pct"), residual=3)
    ids = eval_ids(tiny.tokenizer, 2, 40)
    logits = []
    for kernel in (False, True):
        cache = ArtifactCache(pol, tiny.model, attention="blockwise", block=BLOCK)
        with torch.no_grad(), blockwise.serving(tiny.model, cache, kernel=kernel):
            tiny.model(ids[:, :-1], cache=cache)
            logits.append(tiny.model(ids[:, -1:], cache=cache).logits)
    assert torch.allclose(logits[1], logits[0], rtol=1e-4, atol=1e-4 * float(logits[0].abs().max()))


def test_chunked_prefill_reads_the_history_from_the_stored_form(tiny, calib):
    """A second prefill chunk (T_q > 1 with history) and the decode steps after it: under prefill="stored" the
    logits of the materializing cache; a beam search reorders the stored rows the attention reads."""
    pol = replace(_policy(tiny, calib, "kvquant-4b-1pct"), residual=3)
    ids = eval_ids(tiny.tokenizer, 2, 40)
    chunks = [ids[:, :17], ids[:, 17:33], ids[:, 33:34], ids[:, 34:35], ids[:, 35:40]]

    def run(cache):
        with torch.no_grad():
            return [tiny.model(c, cache=cache).logits for c in chunks]

    ref = run(ArtifactCache(pol, tiny.model))
    cache = ArtifactCache(pol, tiny.model, attention="blockwise", block=BLOCK, prefill="stored")
    with blockwise.serving(tiny.model, cache):
        got = run(cache)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
    beams = dict(max_new_tokens=6, do_sample=False, num_beams=3)
    out, _ = generate(tiny.model, pol, ids[:, :20], attention="materialize", **beams)
    assert torch.equal(generate(tiny.model, pol, ids[:, :20], block=BLOCK, prefill="stored", **beams)[0], out)


class _LargestRows(TorchDispatchMode):
    """Every float32 tensor an op creates whose last axis is head_dim: the largest element count seen."""

    def __init__(self, head_dim):
        super().__init__()
        self.head_dim, self.largest = head_dim, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() >= 3 and t.shape[-1] == self.head_dim:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("name", ["kvquant-4b-1pct", "kivi-2"])
def test_decode_never_builds_a_decoded_copy_of_the_history(tiny, calib, monkeypatch, name):
    """A decode step in blockwise mode creates no float32 tensor of head_dim rows larger than one block of
    [B, H_kv, BLOCK, D] (the materializing cache's step, probed alike, creates [B, H_kv, T, D]) and never calls
    materialize."""
    spec = tiny.spec
    pol = _policy(tiny, calib, name)
    ids = eval_ids(tiny.tokenizer, 2, 241)
    b, t = ids.shape[0], ids.shape[1]
    bound = b * spec.n_kv_heads * 16 * spec.head_dim  # block 16: a multiple of the KIVI group of 4

    def step(cache):
        with torch.no_grad():
            tiny.model(ids[:, :-1], cache=cache)
            probe = _LargestRows(spec.head_dim)
            with probe:
                tiny.model(ids[:, -1:], cache=cache)
        return probe.largest

    full = step(ArtifactCache(pol, tiny.model))
    assert full >= b * spec.n_kv_heads * t * spec.head_dim  # the probe sees a decoded history when there is one

    def refuse(self):
        raise AssertionError("materialize called in blockwise mode")

    monkeypatch.setattr(ArtifactLayer, "materialize", refuse)
    cache = ArtifactCache(pol, tiny.model, attention="blockwise", block=16)
    with blockwise.serving(tiny.model, cache, kernel=False):  # the torch path (the CPU kernel: test_cpu_attention)
        largest = step(cache)
    assert 0 < largest <= bound < full // 10
    acc = cache.accounting()
    assert 0 < acc["largest_decode_temporary_bytes"] <= 3 * 4 * bound  # K, V of a block (+ small terms)
    assert sum(acc[k] for k in HELD_KINDS) == cache.nbytes()


def test_a_blockwise_cache_refuses_the_models_own_attention(tiny):
    pol = CachePolicy("fp16", [(TensorPolicy(), TensorPolicy())] * tiny.spec.n_layers)
    cache = ArtifactCache(pol, tiny.model, attention="blockwise")
    with pytest.raises(InputError, match="updated outside its attention"):
        with torch.no_grad():
            tiny.model(torch.randint(0, 1000, (1, 5)), cache=cache)
    assert cache.get_seq_length() == 0  # refused before anything was stored
    with pytest.raises(InputError, match="attention must be one of"):
        ArtifactCache(pol, tiny.model, attention="fused")
    with pytest.raises(InputError, match="needs ArtifactCache"):
        with blockwise.serving(tiny.model, ArtifactCache(pol, tiny.model)):
            pass


class _LargestStored(TorchDispatchMode):
    """The largest tensor of a stored dtype (uint8 codes, int16 outlier counts / indices, fp16 rows or outlier
    values) any op creates or writes, in bytes -- a concatenation of the stored history would be one."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype in (torch.uint8, torch.int16, torch.float16):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def _page_tensors(layer):
    """{(K or V, page start, tensor name): data_ptr} of every stored page (the open page's views start at its
    buffers), but the open page's outlier lists, which may move to a larger buffer on overflow."""
    out = {}
    for side, rows in (("k", layer.k_rows), ("v", layer.v_rows)):
        for page in rows.pages():
            is_open = rows.open is not None and page.start == rows.open.start
            out.update({(side, page.start, name): t.data_ptr() for name, t in page.tensors.items()
                        if not (is_open and name in ("outlier_index", "outlier_value"))})
    return out


@pytest.mark.parametrize("name", ["kvquant-4b-1pct", "kivi-2"])
def test_decode_steps_never_copy_the_stored_rows(tiny, calib, monkeypatch, name):
    """Across 50 decode steps through the block-wise attention: no stored tensor already written moves (every full
    page keeps its tensors, the open page its buffers, until it is full), and no step creates a tensor of a
    stored dtype larger than a page's buffer, a block's unpacked codes or the residual rows -- far below the
    stored history, which the old path (one block per layer, concatenated at every flush) copied at every step.
    Probed alike, a reader that joins the pages is seen."""
    spec = tiny.spec
    page = 16
    pol = _policy(tiny, calib, name)
    ids = eval_ids(tiny.tokenizer, 2, 181)
    prompt, steps = 130, 50
    cache = ArtifactCache(pol, tiny.model, attention="blockwise", block=page, page=page)
    largest = 0
    with torch.no_grad(), blockwise.serving(tiny.model, cache):
        tiny.model(ids[:, :prompt], cache=cache)
        for i in range(prompt, prompt + steps):
            seen = [_page_tensors(layer) for layer in cache.layers]
            probe = _LargestStored()
            with probe:
                tiny.model(ids[:, i:i + 1], cache=cache)
            largest = max(largest, probe.largest)
            for old, layer in zip(seen, cache.layers):
                now = _page_tensors(layer)
                moved = [key for key, ptr in old.items() if now.get(key) != ptr]
                assert not moved, (i, moved)  # every stored tensor where it was, the open page's too
    layer = cache.layers[0]
    kb = layer.k_block
    assert isinstance(kb, PagedBlock) and len(layer.k_rows.sealed) >= 8  # many pages, several sealed in the steps
    history = max(blk.nbytes for blk in (join(layer.k_block.pages), join(layer.v_block.pages)))
    b, h, d = ids.shape[0], spec.n_kv_heads, spec.head_dim
    first = (*layer.k_rows.pages()[0].tensors.values(), *layer.v_rows.pages()[0].tensors.values())
    bound = max(max(t.numel() * t.element_size() for t in first),  # a page's buffers
                b * h * page * d,  # a block's unpacked codes (uint8)
                b * h * (pol.residual + 5) * d * 2)  # the fp16 residual rows (KIVI: a group of 4 more)
    assert largest <= bound < history / 2, (largest, bound, history)

    def joined(rows):  # the probe has teeth: a reader that joins the pages creates the whole history
        return property(lambda self: PagedBlock((join(getattr(self, rows).pages()),)))

    monkeypatch.setattr(ArtifactLayer, "k_block", joined("k_rows"))
    monkeypatch.setattr(ArtifactLayer, "v_block", joined("v_rows"))
    probe = _LargestStored()
    with torch.no_grad(), blockwise.serving(tiny.model, cache), probe:
        tiny.model(ids[:, prompt + steps:prompt + steps + 1], cache=cache)
    assert probe.largest >= join(cache.layers[0].k_rows.pages()).tensors["codes"].numel()


@pytest.mark.parametrize("name", ["kvquant-3b-1pct+smooth", "kivi-2"])
def test_every_reader_reads_the_pages(tiny, calib, name):
    """Over a cache stored in many pages: the block-wise attention, the Triton kernel (every page in one launch,
    the items merged) and the oracle (pages joined) agree within the runtime check's bound; a page boundary inside
    a block changes nothing but the blocking."""
    pol = replace(_policy(tiny, calib, name), residual=3)
    cache = ArtifactCache(pol, tiny.model, page=8)
    ids = eval_ids(tiny.tokenizer, 2, 45)
    queries = {}

    def capture(module, query, key, value, mask, scaling):  # as runtime_check.check.record, over a paged cache
        queries[module.layer_idx] = (query[:, :, -1].float(), float(scaling))
        return eager_attention(query, key, value, mask, scaling)

    with torch.no_grad():
        tiny.model(ids[:, :-1], cache=cache)
        with attention_override(tiny.model, capture):
            tiny.model(ids[:, -1:], cache=cache)
    from serving import triton_attention  # sets Triton's interpreter on a machine without a GPU

    for i, layer in enumerate(cache.layers):
        inp = from_layer(layer, *queries[i], tiny.model.model.rotary_emb)
        assert len(inp.k_block.pages) >= 4
        ref = reference.decode_attention(inp)
        for got in (blockwise.decode_attention(inp, block=BLOCK), blockwise.decode_attention(inp, block=1024),
                    triton_attention.decode_attention(inp)):
            res = compare(got, ref)
            assert res["ok"] and res["max_rel_err"] < RTOL / 20, res


@pytest.mark.parametrize("prefill", ["full", "stored"])
def test_the_fused_prefill_equals_the_block_scores(tiny, calib, monkeypatch, prefill):
    """Prefill chunks (the first: own rows only; the second: history from the stored form, then its own rows)
    through torch's fused CPU attention merged by log-sum-exp give the logits of the per-block float32 scores
    (the fused op switched off), to float rounding; single-token steps are the same path either way."""
    pol = replace(_policy(tiny, calib, "kvquant-4b-1pct"), residual=3)
    ids = eval_ids(tiny.tokenizer, 2, 40)
    chunks = [ids[:, :17], ids[:, 17:33], ids[:, 33:34], ids[:, 34:40]]

    def run():
        cache = ArtifactCache(pol, tiny.model, attention="blockwise", block=BLOCK, prefill=prefill)
        with torch.no_grad(), blockwise.serving(tiny.model, cache):
            return [tiny.model(c, cache=cache).logits for c in chunks]

    calls = []
    real = blockwise._fused_op

    def counted(device, head_dim):
        op = real(device, head_dim)
        return None if op is None else (lambda *a, **kw: calls.append(kw.get("is_causal", False)) or op(*a, **kw))

    monkeypatch.setattr(blockwise, "_fused_op", counted)
    fused = run()
    assert any(calls) == (prefill == "full") and not all(calls)  # history blocks fused; own rows only when "full"
    monkeypatch.setattr(blockwise, "_fused_op", lambda device, head_dim: None)
    scores = run()
    for a, b in zip(fused, scores):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


def test_the_serving_mask_is_none_unless_padded():
    """Serving reads `None` as causal by position: given for an unpadded causal batch, never for a padded one."""
    from stages.hooks import serving_mask

    assert serving_mask(2, 5, 9, q_offset=4, attention_mask=torch.ones(2, 9, dtype=torch.long)) is None
    assert serving_mask(1, 1, 9, q_offset=8) is None
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[1, 0] = 0
    mask = serving_mask(2, 5, 9, q_offset=4, attention_mask=pad)
    assert mask.dtype == torch.bool and mask.shape == (2, 1, 5, 9)
    assert not mask[1, 0, :, 0].any() and mask[0, 0, :, 0].all() and not mask[0, 0, 0, 5:].any()


def _fp16_inputs(d: int, start: int, n: int = 4):
    """One sequence, one kv head: n fp16 rows stored pre-RoPE from position `start` (inv_freq[0] = 1)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    p = TensorPolicy()
    rows = store(encode(torch.randn(1, 1, n, d), p), p, start)
    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=2 * d, num_attention_heads=2, num_key_value_heads=1,
                                              head_dim=d, max_position_embeddings=1 << 20))
    return blockwise.DecodeInputs(q=torch.randn(1, 2, d), scaling=d ** -0.5, key_policy=p, value_policy=p,
                                  key_rope="pre", rotary=rotary, k_block=rows, v_block=rows)


def test_the_single_token_route():
    """use_kernel: the Triton kernel when asked (kernel=True) or by default on CUDA, the fused CPU kernel by default
    on the CPU (where it is built), for a token that reads every row held, and only for inputs the kernel reads
    exactly -- a head_dim not a power of two, or keys rotated past the exact RoPE range (411768 at inv_freq 1),
    take the torch path on CUDA; kernel=False is always the torch path."""
    from serving import cpu_attention

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    ok, odd, far = _fp16_inputs(16, 100), _fp16_inputs(24, 100), _fp16_inputs(16, 411_766)
    assert blockwise.use_kernel(None, cuda, True, ok) == "triton" == blockwise.use_kernel(True, cpu, True, ok)
    on_cpu = "cpu" if cpu_attention.available() else None
    assert blockwise.use_kernel(None, cpu, True, ok) == on_cpu == blockwise.use_kernel(None, cpu, True, odd)
    assert blockwise.use_kernel(False, cuda, True, ok) is None and blockwise.use_kernel(False, cpu, True, ok) is None
    assert blockwise.use_kernel(None, cuda, False, ok) is None   # a sliding layer holding rows it does not read
    assert blockwise.use_kernel(None, cpu, False, ok) is None
    assert blockwise.use_kernel(None, cuda, True, odd) is None and blockwise.use_kernel(True, cpu, True, odd) is None
    assert blockwise.use_kernel(None, cuda, True, far) is None
    assert blockwise.use_kernel(None, cuda, True, replace(far, key_rope="post")) == "triton"


def test_a_head_dim_the_kernel_cannot_tile_falls_back():
    """head_dim 24 (not a power of two): a decode step with the kernel asked for (as on CUDA by default) takes the
    torch path and gives its logits, instead of the kernel's refusal."""
    from pipeline.config import ModelConfig, TinyModelConfig
    from pipeline.model import load_model

    tiny24 = load_model(ModelConfig(name="tiny-d24", source="tiny", tiny=TinyModelConfig(head_dim=24)))
    assert tiny24.spec.head_dim == 24
    pol = CachePolicy("fp16", [(TensorPolicy(), TensorPolicy())] * tiny24.spec.n_layers, key_rope="pre", n_sink=1,
                      residual=2)
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(0))
    logits = []
    for kernel in (False, True):
        cache = ArtifactCache(pol, tiny24.model, attention="blockwise", block=BLOCK)
        with torch.no_grad(), blockwise.serving(tiny24.model, cache, kernel=kernel):
            tiny24.model(ids[:, :-1], cache=cache)
            logits.append(tiny24.model(ids[:, -1:], cache=cache).logits)
    assert torch.equal(logits[1], logits[0])


def test_prefill_on_cuda_takes_the_fused_attention(tiny, calib, monkeypatch):
    """On CUDA a prefill chunk's history blocks and own rows go through torch's memory-efficient attention (float32;
    head_dim a multiple of 8), never [T_q, n] scores. Its contract -- output and natural log-sum-exp, the latter
    padded to a multiple of 32 queries -- stood in for on the CPU by the CPU fused op with a padded, poisoned
    log-sum-exp: the logits of the per-block scores."""
    assert blockwise._fused_op(torch.device("cuda"), 64) is blockwise._cuda_fused
    assert blockwise._fused_op(torch.device("cuda"), 36) is None
    assert blockwise._fused_op(torch.device("cpu"), 36) is not None

    def efficient(q, k, v, bias, with_lse, dropout_p=0.0, is_causal=False, *, scale=None):
        assert bias is None and with_lse and q.dtype == torch.float32
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=is_causal, scale=scale)
        pad = torch.full((*lse.shape[:-1], -lse.shape[-1] % 32), float("nan"))
        return o, torch.cat([lse, pad], -1), None, None

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", efficient)
    pol = replace(_policy(tiny, calib, "kvquant-4b-1pct"), residual=3)
    ids = eval_ids(tiny.tokenizer, 2, 40)
    chunks = [ids[:, :17], ids[:, 17:33], ids[:, 33:34]]

    def run():
        cache = ArtifactCache(pol, tiny.model, attention="blockwise", block=BLOCK)
        with torch.no_grad(), blockwise.serving(tiny.model, cache):
            return [tiny.model(c, cache=cache).logits for c in chunks]

    monkeypatch.setattr(blockwise, "_fused_op", lambda device, head_dim: blockwise._cuda_fused)
    fused = run()
    monkeypatch.setattr(blockwise, "_fused_op", lambda device, head_dim: None)
    for a, b in zip(fused, run()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
