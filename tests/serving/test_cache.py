import math
from dataclasses import replace

import pytest
import torch

from exporters.codec import CachePolicy, CodecError, TensorPolicy, decode, encode, fake_quant, static_bits
from exporters.layout import PAGE, PagedBlock, join, load, n_outliers, pages_of, store
from exporters.ledger import predict_bytes
from exporters.rope import apply_rope
from serving.blockwise import generate
from serving.cache import HELD_KINDS, ArtifactCache, check_batch
from stages.hooks import rope_tables


def kvquant_policy(n_layers, h, d, residual=0, bits=4):
    """Keys nuq per channel with 1% static-bound outliers, values nuq per token with 1%: the key bounds lie about
    the 0.5% / 99.5% quantiles of N(0, 1) (+-2.58; the tests' rows are standard normal), each channel its own, so
    the declared fraction is what the rows hold -- as calibration makes it (the cache bounds what a layer holds
    beyond it: serving.cache.OUTLIER_MARGIN)."""
    g = torch.Generator().manual_seed(1)
    lower, upper = -torch.rand(h, d, generator=g) * 0.3 - 2.45, torch.rand(h, d, generator=g) * 0.3 + 2.45
    book = torch.linspace(-1, 1, 2 ** bits)
    k = TensorPolicy(format="nuq", bits=bits, axis="channel", outlier_fraction=0.01, codebook=book,
                     zero=(upper + lower) / 2, range=(upper - lower) / 2, lower=lower, upper=upper)
    v = TensorPolicy(format="nuq", bits=bits, axis="token", outlier_fraction=0.01, codebook=book)
    return CachePolicy("kvq", [(k, v)] * n_layers, key_rope="pre", n_sink=1, residual=residual)


def rotated_values(d: int, seed: int = 4) -> TensorPolicy:
    """Values rotated and clipped (the exported kind), under signs of their own (not the seeded rht_signs)."""
    signs = torch.randint(0, 2, (d & -d,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1
    return TensorPolicy(format="uniform", bits=2, axis="token", rotation="hadamard", clip="mse",
                        rotation_signs=signs)


def test_fp16_artifact_cache_generates_like_the_model(tiny):
    ids = torch.randint(0, 40000, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = tiny.model.generate(ids, max_new_tokens=8, do_sample=False)
    pol = CachePolicy("fp16", [(TensorPolicy(), TensorPolicy())] * tiny.spec.n_layers, key_rope="pre", n_sink=1)
    out, cache = generate(tiny.model, pol, ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, ref) and cache.get_seq_length() == 24 + 7


def test_cache_matches_the_evaluation_path(tiny):
    """Keys the cache serves == the evaluation's codec path: pre-RoPE keys fake-quantized, then rotated."""
    spec = tiny.spec
    pol = kvquant_policy(spec.n_layers, spec.n_kv_heads, spec.head_dim)
    ids = torch.randint(0, 40000, (1, 20), generator=torch.Generator().manual_seed(3))
    pre = {}
    h = tiny.model.model.layers[1].self_attn.k_proj.register_forward_hook(lambda m, a, o: pre.__setitem__("k", o))
    cache = ArtifactCache(pol, tiny.model)
    with torch.no_grad():
        tiny.model(ids, cache=cache)
    h.remove()
    keys, _ = cache.layers[1].materialize()
    k_pre = pre["k"].view(1, 20, spec.n_kv_heads, spec.head_dim).transpose(1, 2)
    expected = k_pre.clone()
    expected[:, :, 1:], _ = fake_quant(k_pre[:, :, 1:], pol.layers[1][0])
    rope = rope_tables(tiny.model, ids)
    expected = apply_rope(expected, rope["cos"], rope["sin"])
    # sink row stored fp16 post-RoPE; the rest decoded: agreement to fp16 storage and RoPE round-trip precision
    assert torch.allclose(keys, expected, atol=2e-3, rtol=1e-3)


def test_measured_bytes_follow_the_ledger(tiny):
    spec = tiny.spec
    for residual, policy in ((0, kvquant_policy(spec.n_layers, spec.n_kv_heads, spec.head_dim)),
                             (8, CachePolicy("kivi", [(TensorPolicy(format="uniform", bits=2, axis="channel", group_size=4),
                                                       TensorPolicy(format="uniform", bits=2, axis="token"))] * spec.n_layers,
                                             residual=8))):
        ids = torch.randint(0, 40000, (1, 50), generator=torch.Generator().manual_seed(0))
        cache = ArtifactCache(policy, tiny.model)
        with torch.no_grad():
            tiny.model(ids, cache=cache)
            for step in range(5):  # decode steps exercise the flush rule
                tiny.model(ids[:, :1], cache=cache)
        t = 55
        measured = cache.nbytes()
        def frac(block):
            return block.tensors["outlier_value"].numel() / (spec.n_kv_heads * spec.head_dim * block.shape[2])

        outl = [(frac(layer.k_block), frac(layer.v_block)) if policy.layers[0][0].outlier_fraction else (None, None)
                for layer in cache.layers]
        predicted = predict_bytes(policy, t, spec.n_kv_heads, spec.head_dim, expected=outl)
        assert measured == pytest.approx(predicted, rel=1e-9), residual
        assert cache.stats["outliers_clamped"] == 0  # bounds honest for the declared fraction: nothing clamped


def test_rotated_values_store_the_codecs_bytes_and_follow_the_ledger(tiny):
    """Rotated, clipped values: every flushed value row is stored as the codec encodes its fp16 copy (rotation
    with the policy's signs, then the clip; the CPU encoder takes neither, so the codec runs); the sink and
    residual rows stay as given (un-rotated fp16); bytes held == the ledger, the signs counted once per layer."""
    spec = tiny.spec
    h, d = spec.n_kv_heads, spec.head_dim
    pk = kvquant_policy(spec.n_layers, h, d).layers[0][0]
    pv = rotated_values(d)
    policy = CachePolicy("rotclipv", [(pk, pv)] * spec.n_layers, key_rope="pre", n_sink=2, residual=5)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, h, 40, d, generator=g), torch.randn(1, h, 40, d, generator=g)
    steps = [(torch.randn(1, h, 1, d, generator=g), torch.randn(1, h, 1, d, generator=g)) for _ in range(6)]
    cache = _filled(policy, tiny.model, k, v, steps)
    v_all = torch.cat([v, *(sv for _, sv in steps)], 2).half()                      # [1, H, 46, D]
    layer = cache.layers[0]
    want = store(encode(v_all[:, :, 2:41].float(), pv), pv, 2)                       # rows 2..40: flushed
    got = join(pages_of(layer.v_block))
    assert got.start == 2 and got.shape[2] == 39 and set(got.tensors) == set(want.tensors)
    for name, t in want.tensors.items():
        assert torch.equal(got.tensors[name].view(torch.uint8), t.view(torch.uint8)), name
    assert torch.equal(layer.sink[1], v_all[:, :, :2]) and torch.equal(layer.recent[1], v_all[:, :, 41:])
    _, v_served = layer.materialize()
    assert torch.equal(v_served[:, :, 2:41], decode(load(want, pv), pv))           # decoded rows un-rotated
    k_frac = layer.k_block.tensors["outlier_value"].numel() / (h * d * 39)   # every layer was fed the same rows
    predicted = predict_bytes(policy, 46, h, d, expected=[(k_frac, None)] * spec.n_layers)
    assert cache.nbytes() == pytest.approx(predicted, rel=1e-9)
    assert static_bits(pv) == 32 * (d & -d)
    assert cache.accounting()["static"] == spec.n_layers * (static_bits(pk) + static_bits(pv)) // 8


def test_rotated_values_are_encoded_ahead_in_one_codec_call_per_window_with_the_same_bytes(tiny, monkeypatch):
    """The codec encodes a rotated layer's flushed value rows together with the residual rows after them and keeps
    those bytes for the next flushes: 12 single-token steps with a residual window of 5 call it twice per layer,
    not 12; the prefill is encoded a page at a time (pages of 8: its first 8 flushed rows, then the last 5 with the
    5 rows ahead), never whole; every stored value page is byte for byte the codec's encoding of its rows alone; a
    batch edit takes what was encoded ahead with its sequences (the steps after it store the bytes of the
    reordered rows)."""
    import serving.cache as cache_module

    spec = tiny.spec
    h, d = spec.n_kv_heads, spec.head_dim
    pv = rotated_values(d)
    policy = CachePolicy("rotclipv", [(kvquant_policy(1, h, d).layers[0][0], pv)] * spec.n_layers, key_rope="pre",
                         n_sink=2, residual=5)
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(2, h, 20, d, generator=g), torch.randn(2, h, 20, d, generator=g)
    steps = [(torch.randn(2, h, 1, d, generator=g), torch.randn(2, h, 1, d, generator=g)) for _ in range(12)]
    calls = []
    real = cache_module.encode
    monkeypatch.setattr(cache_module, "encode", lambda x, p, where="tensor": calls.append((where, x.shape[2]))
                        or real(x, p, where))
    cache = ArtifactCache(policy, tiny.model, page=8)
    layer = cache.layers[0]
    layer.update(k, v)
    for sk, sv in steps:
        layer.update(sk, sv)
    value_calls = [n for where, n in calls if where.endswith("values")]
    assert value_calls == [8, 10, 6, 6]         # the prefill's 13 flushed rows: 8, then 5 + 5 ahead; 1 + 5 twice
    assert max(value_calls) <= layer.page + policy.residual
    v_all = torch.cat([v, *(sv for _, sv in steps)], 2).half()
    flushed = layer.v_block.shape[2]
    want = store(encode(v_all[:, :, 2:2 + flushed].float(), pv), pv, 2)
    got = join(pages_of(layer.v_block))
    for name, t in want.tensors.items():
        assert torch.equal(got.tensors[name].view(torch.uint8), t.view(torch.uint8)), name
    assert layer.reserved_bytes() >= layer._v_ahead.nbytes > 0
    idx = torch.tensor([1, 1])
    ahead = layer._v_ahead
    layer.batch_select_indices(idx)
    assert layer._v_ahead.shape == (2, *ahead.shape[1:]) and layer._v_ahead.start == ahead.start
    for name, t in ahead.tensors.items():
        assert torch.equal(layer._v_ahead.tensors[name].view(torch.uint8), t[idx].view(torch.uint8)), name
    for sk, sv in steps[:3]:
        layer.update(sk[idx], sv[idx])
    v_new = torch.cat([v_all[idx], *(sv[idx].half() for _, sv in steps[:3])], 2)
    got = join(pages_of(layer.v_block))
    want = store(encode(v_new[:, :, 2:2 + got.shape[2]].float(), pv), pv, 2)
    for name, t in want.tensors.items():
        assert torch.equal(got.tensors[name].view(torch.uint8), t.view(torch.uint8)), name


@pytest.mark.parametrize("side, p, field", [
    ("keys", TensorPolicy(format="uniform", bits=2, axis="token", rotation="hadamard"), "rotation"),
    ("keys", TensorPolicy(format="uniform", bits=2, axis="token", clip="mse"), "clip"),
    ("values", TensorPolicy(format="nuq", bits=2, axis="token", rotation="hadamard",
                            codebook=torch.linspace(-1, 1, 4)), "rotation"),
    ("values", TensorPolicy(format="nuq", bits=2, axis="token", clip="mse", codebook=torch.linspace(-1, 1, 4)),
     "clip"),
    ("values", TensorPolicy(format="uniform", bits=2, axis="token", rotation="hadamard", outlier_fraction=0.01),
     "rotation"),
])
def test_the_cache_refuses_rotations_and_clips_it_does_not_serve(side, p, field):
    """A rotation or clip is served on uniform per-token values only (a rotation without sparse outliers): key
    rotation, the nuq variants and a rotation with outliers are refused by name before any model is read."""
    plain = TensorPolicy()
    layer = (p, plain) if side == "keys" else (plain, p)
    policy = CachePolicy("rotated", [(plain, plain), layer])
    with pytest.raises(CodecError, match=rf"ArtifactCache: layer 1 {side}\.{field}: {field} \w+ is evaluation-only "
                                         rf"on {side} of format {p.format}"):
        ArtifactCache(policy, model=None)


def test_refusals(tiny):
    with pytest.raises(ValueError, match=r"equal-length rows \(no padding\); got lengths \[3, 2\]"):
        check_batch(torch.tensor([[1, 1, 1], [0, 1, 1]]))
    pol = CachePolicy("fp16", [(TensorPolicy(), TensorPolicy())] * tiny.spec.n_layers)
    cache = ArtifactCache(pol, tiny.model)
    too_long = tiny.spec.max_positions + 1
    with pytest.raises(ValueError, match=f"would hold {too_long} tokens, more than the model's"):
        cache.layers[0].update(torch.zeros(1, 2, too_long, 16), torch.zeros(1, 2, too_long, 16))


def _filled(policy, model, k, v, steps=(), page=PAGE):
    """An ArtifactCache fed K/V [B, H, T, D] per layer directly (as the attention layers hand them over), then
    each (k, v) of `steps` as further updates."""
    cache = ArtifactCache(policy, model, page=page)
    for layer in cache.layers:
        layer.update(k, v)
        for sk, sv in steps:
            layer.update(sk, sv)
    return cache


def _stored(layer):
    """Everything a layer stores, by name."""
    out = {"cumulative_length": layer.cumulative_length}
    for name in ("sink", "recent"):
        pair = getattr(layer, name)
        if pair is not None:
            out[f"{name}.k"], out[f"{name}.v"] = pair
    for name in ("k_block", "v_block"):
        block = getattr(layer, name)
        if block is not None:
            out[f"{name}.shape"] = block.shape
            out.update({f"{name}.{k}": t for k, t in block.tensors.items()})
    return out


def _same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x,
                                                      y.view(torch.uint8) if y.element_size() == 1 else y), name
        else:
            assert x == y, name


def _policies(spec, which):
    h, d = spec.n_kv_heads, spec.head_dim
    return {
        "kvquant-outliers": kvquant_policy(spec.n_layers, h, d, residual=3),
        "kivi-groups": CachePolicy("kivi", [(TensorPolicy(format="uniform", bits=2, axis="channel", group_size=4),
                                             TensorPolicy(format="uniform", bits=2, axis="token"))] * spec.n_layers,
                                   n_sink=2, residual=8),
        "fp8-head": CachePolicy("fp8", [(TensorPolicy(format="fp8", bits=8, axis="head", fp8_scale=torch.full((h,), 0.01)),
                                         TensorPolicy(format="fp8", bits=8, axis="head", fp8_scale=torch.full((h,), 0.02)))]
                                * spec.n_layers, n_sink=1),
        "int3-token-outliers": CachePolicy("int3", [(TensorPolicy(format="uniform", bits=3, axis="token",
                                                                  outlier_fraction=0.05),
                                                     TensorPolicy())] * spec.n_layers, n_sink=1, residual=2),
        "rotclipv": CachePolicy("rotclipv", [(kvquant_policy(1, h, d).layers[0][0], rotated_values(d))]
                                * spec.n_layers, key_rope="pre", n_sink=2, residual=3),
    }[which]


@pytest.mark.parametrize("page", [PAGE, 5])
@pytest.mark.parametrize("which", ["kvquant-outliers", "kivi-groups", "fp8-head", "rotclipv"])
def test_reorder_moves_every_stored_row_with_its_sequence(tiny, which, page):
    """reorder_cache(idx) (beam search) == the cache that was fed the batch x[idx]: codes, scales, zero-points,
    sparse outliers, fp8 bytes, fp16 sink and residual rows all follow their sequence, and the next updates
    continue it alike -- in one page or in many (page=5: KIVI's groups of 4 round it to 8)."""
    spec = tiny.spec
    h, d = spec.n_kv_heads, spec.head_dim
    policy = _policies(spec, which)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, h, 23, d, generator=g), torch.randn(3, h, 23, d, generator=g)
    idx = torch.tensor([2, 0, 0])  # a reordering with a repeat, as beam search makes them
    cache = _filled(policy, tiny.model, k, v, page=page)
    before = [layer.materialize() for layer in cache.layers]
    cache.reorder_cache(idx)
    expected = _filled(policy, tiny.model, k[idx], v[idx], page=page)
    if which == "kvquant-outliers":
        assert expected.layers[0].k_block.tensors["outlier_value"].numel() > 0  # the outlier path is exercised
    for got, want, (bk, bv) in zip(cache.layers, expected.layers, before):
        _same(_stored(got), _stored(want))
        mk, mv = got.materialize()
        assert torch.equal(mk, bk[idx]) and torch.equal(mv, bv[idx])
    steps = [(torch.randn(3, h, n, d, generator=g), torch.randn(3, h, n, d, generator=g)) for n in (1, 1, 5)]
    for sk, sv in steps:  # decoding goes on from the reordered rows, flushes included
        for layer in cache.layers:
            layer.update(sk, sv)
    for got, want in zip(cache.layers, _filled(policy, tiny.model, k[idx], v[idx], steps, page=page).layers):
        _same(_stored(got), _stored(want))
        assert [p.shape for p in pages_of(got.k_block)] == [p.shape for p in pages_of(want.k_block)]
    cache.batch_select_indices(torch.tensor([1]))  # the generation API's other batch edits take the same path
    cache.batch_repeat_interleave(2)
    assert cache.layers[0].materialize()[0].shape[0] == 2
    assert torch.equal(cache.layers[0].materialize()[0][1], cache.layers[0].materialize()[0][0])


def test_beam_search_through_the_cache(tiny):
    """generate(num_beams=2) through an fp16 ArtifactCache gives the tokens of the model's own DynamicCache; a
    quantized cache runs beam search too."""
    # seed, beams and length where the beams do swap: ignoring reorder_cache changes these tokens
    ids = torch.randint(0, 40000, (2, 20), generator=torch.Generator().manual_seed(2))
    kw = {"max_new_tokens": 12, "do_sample": False, "num_beams": 3}
    ref = tiny.model.generate(ids, **kw)
    pol = CachePolicy("fp16", [(TensorPolicy(), TensorPolicy())] * tiny.spec.n_layers, key_rope="pre", n_sink=1)
    out, cache = generate(tiny.model, pol, ids, **kw)
    assert torch.equal(out, ref)
    spec = tiny.spec
    quant, qcache = generate(tiny.model, kvquant_policy(spec.n_layers, spec.n_kv_heads, spec.head_dim, residual=4),
                             ids, **kw)
    assert quant.shape == ref.shape and qcache.layers[0].materialize()[0].shape[0] == 2 * 3  # batch x beams


def test_reset_empties_the_cache_for_reuse(tiny):
    spec = tiny.spec
    pol = kvquant_policy(spec.n_layers, spec.n_kv_heads, spec.head_dim, residual=4)
    ids = torch.randint(0, 40000, (1, 20), generator=torch.Generator().manual_seed(1))
    fresh = ArtifactCache(pol, tiny.model)
    first = tiny.model.generate(ids, cache=fresh, max_new_tokens=6, do_sample=False)
    empty_bytes = ArtifactCache(pol, tiny.model).nbytes()  # the static tensors only
    assert fresh.get_seq_length() > 0 and fresh.nbytes() > empty_bytes
    fresh.reset()
    assert fresh.get_seq_length() == 0 and fresh.nbytes() == empty_bytes
    assert all(layer.sink is None and layer.recent is None and layer.k_block is None for layer in fresh.layers)
    assert fresh.layers[0].policy is pol  # the policy stays
    again = tiny.model.generate(ids, cache=fresh, max_new_tokens=6, do_sample=False)
    assert torch.equal(again, first)


def test_what_the_cache_cannot_do_is_refused_by_name(tiny):
    pol = CachePolicy("fp16", [(TensorPolicy(), TensorPolicy())] * tiny.spec.n_layers, n_sink=1)
    cache = ArtifactCache(pol, tiny.model)
    with torch.no_grad():
        tiny.model(torch.randint(0, 40000, (1, 8)), cache=cache)
    with pytest.raises(NotImplementedError, match=r"ArtifactCache\.offload: not implemented"):
        cache.offload(0)
    with pytest.raises(NotImplementedError, match=r"ArtifactCache\.prefetch: not implemented"):
        cache.prefetch(0)
    with pytest.raises(NotImplementedError, match=r"ArtifactCache\.crop\(-2\): not implemented"):
        cache.crop(-2)
    cache.crop(0)  # what generation calls between steps: nothing to remove
    assert cache.get_seq_length() == 8 and not cache.is_croppable


@pytest.mark.parametrize("p", [TensorPolicy(format="turbo_mse", bits=3, axis="token", norm_correction=True),
                               TensorPolicy(format="fp8", bits=8, axis="token")])
def test_the_cache_refuses_evaluation_only_formats(p):
    """vLLM's formats (exporters.codec.EXPORT_AXES) have no stored layout here: refused before any model is read."""
    policy = CachePolicy("vllm-like", [(TensorPolicy(), TensorPolicy()), (TensorPolicy(), p)])
    with pytest.raises(CodecError, match=rf"ArtifactCache: layer 1 values: format {p.format} with axis token is "
                                         r"evaluation-only"):
        ArtifactCache(policy, model=None)


@pytest.mark.parametrize("which", ["kvquant-outliers", "kivi-groups", "fp8-head", "int3-token-outliers", "rotclipv"])
def test_pages_hold_the_bytes_of_one_block(tiny, which):
    """Rows stored in pages of 8 (prefill and decode steps crossing page boundaries) are, joined, byte for byte
    the one block of a cache whose page holds everything; each page is the block `store` gives for its rows
    alone (its own outlier counts and t-major list); bytes held, the accounting and the decoded rows agree."""
    spec = tiny.spec
    h, d = spec.n_kv_heads, spec.head_dim
    policy = _policies(spec, which)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, h, 29, d, generator=g), torch.randn(2, h, 29, d, generator=g)
    steps = [(torch.randn(2, h, n, d, generator=g), torch.randn(2, h, n, d, generator=g)) for n in (1,) * 9 + (6,)]
    paged, whole = (_filled(policy, tiny.model, k, v, steps, page=p) for p in (8, 64))
    for a, b in zip(paged.layers, whole.layers):
        kb, vb = a.k_block, a.v_block
        assert isinstance(kb, PagedBlock) and len(kb.pages) >= 4 and len(whole.layers[0].k_block.pages) == 1
        assert [p.shape[2] for p in kb.pages[:-1]] == [8] * (len(kb.pages) - 1)  # full pages but the last
        assert [p.start for p in kb.pages] == [p.start for p in vb.pages]
        _same(_stored(a), _stored(b))
        for page in kb.pages:
            assert torch.equal(decode(load(page, a.pk), a.pk), decode(load(join(kb.pages), a.pk), a.pk)[
                :, :, page.start - kb.start:page.start - kb.start + page.shape[2]])
            if "outlier_count" in page.tensors:
                assert int(page.tensors["outlier_count"].sum()) == page.tensors["outlier_value"].numel()
        for x, y in zip(a.materialize(), b.materialize()):
            assert torch.equal(x, y)
    if which in ("kvquant-outliers", "int3-token-outliers"):
        assert paged.layers[0].k_block.tensors["outlier_value"].numel() > 10
    assert paged.nbytes() == whole.nbytes()
    acc = paged.accounting()
    assert acc["outliers_clamped"] == whole.stats["outliers_clamped"] == 0
    assert sum(acc[kind] for kind in HELD_KINDS) == paged.nbytes()
    open_page = paged.layers[0].k_rows.open  # a last page not yet full: its unused rows are reserved, not held
    assert acc["reserved_capacity_bytes"] >= 0 and (open_page is None or acc["reserved_capacity_bytes"] > 0)


def _storage_bytes(layer) -> int:
    """Bytes of every storage the layer's stored tensors live in (sink, residual, pages, value rows encoded ahead),
    each storage once."""
    held = [t for pair in (layer.sink, layer.recent) if pair is not None for t in pair]
    held += [t for rows in (layer.k_rows, layer.v_rows) for page in rows.pages() for t in page.tensors.values()]
    held += [] if layer._v_ahead is None else list(layer._v_ahead.tensors.values())
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_cache_keeps_its_own_rows_not_the_prefill(tiny, dtype):
    """After a long prefill the cache holds its sink and residual rows as copies of their own: the storages it
    keeps alive are exactly the bytes it accounts for (nbytes, less the static tensors, plus the pages' reserved
    capacity), never the whole prefill chunk its first rows were cut from (fp16 model: the model's own K/V)."""
    spec = tiny.spec
    h, d, t = spec.n_kv_heads, spec.head_dim, 300
    token = TensorPolicy(format="uniform", bits=4, axis="token")
    policy = CachePolicy("int4", [(token, token)] * spec.n_layers, n_sink=1, residual=4)
    cache = ArtifactCache(policy, tiny.model)
    g = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        k, v = (torch.randn(1, h, t, d, generator=g).to(dtype) for _ in range(2))
        layer.update(k, v)
        assert layer.sink[0].shape[2] == 1 and layer.recent[0].shape[2] == 4
        static = sum(static_bits(p) for p in (layer.pk, layer.pv)) // 8
        assert _storage_bytes(layer) == layer.nbytes() - static + layer.reserved_bytes()
        assert layer.sink[0].untyped_storage().nbytes() == h * d * 2  # one fp16 row, not the chunk's 300
    acc = cache.accounting()
    assert acc["sink"] == spec.n_layers * 2 * h * d * 2  # one fp16 row of K and of V per layer


def test_rows_encoded_ahead_are_their_own_copy_counted_as_reserved(tiny, monkeypatch):
    """A long prefill of a rotated layer (the codec encodes its values) is encoded a page at a time -- no codec call
    takes more than a page plus the residual window -- and the value rows encoded ahead of their flush are a copy of
    their own: the storages the layer keeps alive are exactly the bytes it accounts for (nbytes less the static
    tensors, plus reserved_bytes, which counts the rows ahead), never the codec's output of the whole prefill; the
    stored bytes are the codec's encoding of the rows alone, as before."""
    import serving.cache as cache_module

    spec = tiny.spec
    h, d, t = spec.n_kv_heads, spec.head_dim, 300
    pv = rotated_values(d)
    token = TensorPolicy(format="uniform", bits=4, axis="token")
    policy = CachePolicy("rotv", [(token, pv)] * spec.n_layers, n_sink=1, residual=6)
    calls = []
    real = cache_module.encode
    monkeypatch.setattr(cache_module, "encode", lambda x, p, where="tensor": calls.append((where, x.shape[2]))
                        or real(x, p, where))
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(1, h, t, d, generator=g), torch.randn(1, h, t, d, generator=g)
    cache = ArtifactCache(policy, tiny.model, page=64)
    layer = cache.layers[0]
    layer.update(k, v)
    value_calls = [n for where, n in calls if where.endswith("values")]
    assert sum(value_calls) == t - 1 and max(value_calls) <= layer.page + policy.residual, value_calls
    ahead = layer._v_ahead
    assert ahead.shape[2] == policy.residual and ahead.start == t - policy.residual
    assert cache_module._storage_bytes(ahead) == ahead.nbytes        # a copy of its own rows, nothing more
    static = sum(static_bits(p) for p in (layer.pk, layer.pv)) // 8
    assert _storage_bytes(layer) == layer.nbytes() - static + layer.reserved_bytes()
    assert layer.reserved_bytes() >= ahead.nbytes
    layer.update(torch.randn(1, h, 1, d, generator=g), torch.randn(1, h, 1, d, generator=g))  # a flush from there
    assert _storage_bytes(layer) == layer.nbytes() - static + layer.reserved_bytes()
    v_all = torch.cat([v, layer.recent[1][:, :, -1:].float()], 2).half()
    want = store(encode(v_all[:, :, 1:1 + layer.v_rows.rows].float(), pv), pv, 1)
    got = join(pages_of(layer.v_block))
    for name, x in want.tensors.items():
        assert torch.equal(got.tensors[name].view(torch.uint8), x.view(torch.uint8)), name


def test_reorder_keeps_the_values_encoded_ahead(tiny, monkeypatch):
    """Beam search reorders the cache after every step (reorder_cache): the value rows the codec encoded ahead
    follow their sequences, so no row is encoded twice -- 8 steps with a residual window of 3 call the codec twice,
    as without reordering, not at every step -- and the layer then equals one fed the reordered sequences
    directly: every stored byte, the rows encoded ahead and the decoded rows."""
    import serving.cache as cache_module

    spec = tiny.spec
    h, d = spec.n_kv_heads, spec.head_dim
    policy = _policies(spec, "rotclipv")                               # n_sink 2, residual 3
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(3, h, 20, d, generator=g), torch.randn(3, h, 20, d, generator=g)
    steps = [(torch.randn(3, h, 1, d, generator=g), torch.randn(3, h, 1, d, generator=g)) for _ in range(8)]
    beams = [torch.randint(0, 3, (3,), generator=g) for _ in steps]
    calls = []
    real = cache_module.encode
    monkeypatch.setattr(cache_module, "encode", lambda x, p, where="tensor": calls.append((where, x.shape[2]))
                        or real(x, p, where))
    cache = ArtifactCache(policy, tiny.model, page=8)
    layer = cache.layers[0]
    layer.update(k, v)
    calls.clear()
    hk, hv = k, v
    for (sk, sv), idx in zip(steps, beams):
        layer.reorder_cache(idx)
        hk, hv = torch.cat([hk[idx], sk], 2), torch.cat([hv[idx], sv], 2)
        layer.update(sk, sv)
    assert [n for where, n in calls if where.endswith("values")] == [4, 4]    # steps 4 and 8: 1 + 3 ahead
    want = ArtifactCache(policy, tiny.model, page=8).layers[0]
    want.update(hk[:, :, :20], hv[:, :, :20])
    for i in range(len(steps)):
        want.update(hk[:, :, 20 + i:21 + i], hv[:, :, 20 + i:21 + i])
    _same(_stored(layer), _stored(want))
    assert layer._v_ahead.start == want._v_ahead.start
    for name, t in want._v_ahead.tensors.items():
        assert torch.equal(layer._v_ahead.tensors[name].view(torch.uint8), t.view(torch.uint8)), name
    for x, y in zip(layer.materialize(), want.materialize()):
        assert torch.equal(x, y)
    layer.batch_repeat_interleave(2)                                    # the other batch edits take the same path
    assert layer._v_ahead.shape[0] == 6 and torch.equal(layer._v_ahead.tensors["codes"][1],
                                                        layer._v_ahead.tensors["codes"][0])


def test_a_smoothed_layer_on_a_gpu_lays_out_each_page_once(tiny, monkeypatch):
    """On a GPU (emulated on the CPU: tests/virtual_devices.py) the decode inputs of a smoothed layer lie on the
    layer's device, lambda included -- one tensor per layer, made once -- so the Triton kernel's launch
    (triton_attention.prepare: inputs not all on its device are copied there first, inputs_to, then each page
    laid out, kept by page object: serving/pages.py) lays out at a step only the page being written, K's and
    V's, not every page again (a lambda left on the host made it copy the inputs and lay out every page at
    every step)."""
    from serving import pages, triton_attention
    from serving.cache import from_layer
    from serving.inputs import inputs_to
    from tests.virtual_devices import VirtualDevices

    spec = tiny.spec
    h, d = spec.n_kv_heads, spec.head_dim
    g = torch.Generator().manual_seed(6)
    policy = replace(kvquant_policy(spec.n_layers, h, d, residual=2),
                     smooth=0.5 + torch.rand(spec.n_layers, h, d, generator=g))
    laid = []
    real = pages.side_args
    monkeypatch.setattr(pages, "side_args", lambda block, p, smode: laid.append(block.start) or real(block, p, smode))
    gpu = torch.device("cuda", 0)
    per_step, lambdas, on_device = [], [], []
    with VirtualDevices() as mode:
        cache = ArtifactCache(policy, tiny.model, page=8)
        layer = cache.layers[0]
        layer.update(torch.randn(1, h, 40, d, generator=g).to(gpu), torch.randn(1, h, 40, d, generator=g).to(gpu))
        for _ in range(5):
            layer.update(torch.randn(1, h, 1, d, generator=g).to(gpu), torch.randn(1, h, 1, d, generator=g).to(gpu))
            inp = from_layer(layer, torch.randn(1, spec.n_q_heads, d).to(gpu), d ** -0.5, layer.rotary)
            lambdas.append(inp.smooth)
            on_device.append(triton_attention._is_on(inp, gpu))
            if not on_device[-1]:                                       # prepare's first step, then its layouts
                inp = inputs_to(inp, gpu)
            laid.clear()
            for kb, vb in zip(inp.k_block.pages, inp.v_block.pages):
                pages.laid_out(kb, inp.key_policy, pages.side_flags(inp.key_policy)["SMODE"])
                pages.laid_out(vb, inp.value_policy, pages.side_flags(inp.value_policy)["SMODE"])
            per_step.append(len(laid))
        placed = {mode.placement(lam) for lam in lambdas}
        assert not mode.violations, mode.violations
    assert len(inp.k_block.pages) >= 5
    assert per_step[1:] == [2] * 4, per_step                            # the page being written, K and V
    assert all(on_device) and placed == {gpu}                           # nothing to copy over: lambda is there
    assert all(lam is lambdas[0] for lam in lambdas)                    # one tensor per layer, made once
    assert torch.equal(lambdas[0], policy.smooth[0].float())


def test_inputs_moved_to_a_device_keep_the_pages_already_there():
    """serving.inputs.inputs_to (what a kernel runs when some input lies elsewhere) keeps every page already on the
    device the same object, so the kernels' layouts (kept by page object) are not made again; a page elsewhere is
    copied over."""
    from exporters.layout import PagedRows
    from serving.inputs import DecodeInputs, block_to, inputs_to
    from tests.virtual_devices import VirtualDevices

    p = TensorPolicy(format="uniform", bits=4, axis="token")
    rows = PagedRows(p, 4)
    x = torch.randn(1, 2, 10, 8, generator=torch.Generator().manual_seed(0))
    for a in range(0, 10, 2):
        rows.write(store(encode(x[:, :, a:a + 2], p), p, a))
    block = rows.view()
    inp = DecodeInputs(q=torch.zeros(1, 2, 8), scaling=1.0, key_policy=p, value_policy=p, key_rope="post",
                       rotary=None, k_block=block, v_block=block, smooth=torch.ones(2, 8))
    moved = inputs_to(inp, "cpu")
    assert moved.k_block is block and all(a is b for a, b in zip(moved.k_block.pages, block.pages))
    with VirtualDevices() as mode:
        there = block_to(block, "cuda:0")
        assert all(a is not b for a, b in zip(there.pages, block.pages))
        assert {mode.placement(t) for pg in there.pages for t in pg.tensors.values()} == {torch.device("cuda", 0)}
        again = block_to(there, "cuda:0")
        assert again is there


def test_outliers_beyond_the_margin_are_clamped_to_their_bound_and_counted(tiny):
    """Key bounds with lower == upper on every channel make every key entry an outlier. The cache holds at most
    (1 + OUTLIER_MARGIN) x the count the declared fraction expects (over >= OUTLIER_FLOOR_ROWS rows): its bytes at
    300 tokens, and after decode steps, stay within the ledger's prediction at (1 + OUTLIER_MARGIN) x the fraction
    (one entry of rounding per layer); the entries kept are those farthest outside their bound, the others decode
    as the codes of the bound (what the codec encodes for a row lying on it) and are counted in
    stats["outliers_clamped"]."""
    from exporters.layout import outlier_coordinates
    from serving.cache import OUTLIER_FLOOR_ROWS, OUTLIER_MARGIN

    spec = tiny.spec
    h, d, t = spec.n_kv_heads, spec.head_dim, 300
    honest = kvquant_policy(spec.n_layers, h, d, residual=8)
    pk, pv = honest.layers[0]
    flat = replace(pk, lower=pk.zero.clone(), upper=pk.zero.clone())   # degenerate: lower == upper everywhere
    policy = replace(honest, layers=[(flat, pv)] * spec.n_layers, key_rope="post")
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(1, h, t, d, generator=g), torch.randn(1, h, t, d, generator=g)
    cache = ArtifactCache(policy, tiny.model)
    for layer in cache.layers:
        layer.update(k, v)

    def within_the_margin(length):
        n_enc = cache.layers[0].k_rows.rows
        cap = math.ceil((1 + OUTLIER_MARGIN) * flat.outlier_fraction * h * d * max(n_enc, OUTLIER_FLOOR_ROWS))
        v_frac = [n_outliers(layer.v_block) / (h * d * n_enc) for layer in cache.layers]    # per-token rule
        predicted = predict_bytes(policy, length, h, d, expected=[((1 + OUTLIER_MARGIN) * flat.outlier_fraction, f)
                                                                  for f in v_frac])
        assert [n_outliers(layer.k_block) for layer in cache.layers] == [cap] * spec.n_layers
        assert predicted <= cache.nbytes() <= predicted + 4 * spec.n_layers   # 4 bytes an outlier: one of ceil
        assert cache.stats["outliers_clamped"] == spec.n_layers * h * d * n_enc - spec.n_layers * cap
        assert cache.accounting()["outliers_clamped"] == cache.stats["outliers_clamped"]

    within_the_margin(t)
    layer = cache.layers[0]
    x = k[:, :, 1:1 + layer.k_rows.rows].half().float()                 # the rows encoded, as stored (fp16)
    beyond = (x - flat.lower[None, :, None, :]).abs()
    kept = torch.zeros_like(x, dtype=torch.bool)
    block = join(pages_of(layer.k_block))
    kept[outlier_coordinates(block)] = True
    assert bool((beyond != 0).all()) and beyond[kept].min() >= beyond[~kept].max()   # the farthest are kept
    decoded = decode(load(block, flat), flat)
    assert torch.equal(decoded[kept], x[kept])                           # kept: exact
    on_bound = flat.lower[None, :, None, :].expand_as(x).contiguous()
    assert torch.equal(decoded[~kept], decode(encode(on_bound, flat), flat)[~kept])   # clamped: the bound's codes
    for _ in range(20):                                                  # decode steps: one row at a time
        sk, sv = torch.randn(1, h, 1, d, generator=g), torch.randn(1, h, 1, d, generator=g)
        for layer in cache.layers:
            layer.update(sk, sv)
    within_the_margin(t + 20)


@pytest.mark.parametrize("window", [None, 12])
def test_the_layer_holds_what_served_rows_says(window):
    """Fed in uneven chunks, a layer holds at every step exactly the rows exporters.served_rows gives for its
    length: sink, encoded and residual counts and (sliding layers) its first position."""
    from exporters.served_rows import layer_rows
    from serving.cache import ArtifactLayer

    key = TensorPolicy(format="uniform", bits=2, axis="channel", group_size=2)
    value = TensorPolicy(format="uniform", bits=2, axis="channel", group_size=3)
    policy = CachePolicy("groups", [(key, value)], n_sink=2, residual=3)
    layer = ArtifactLayer(0, policy, rope_fn=None, max_positions=1 << 16, window=window, page=6)
    rows = layer_rows(policy, 0, window)
    assert rows.unit == 6 and layer.page == 6
    g = torch.Generator().manual_seed(3)
    t = 0
    for n in [1, 4, 1, 1, 9, 1, 2, 1, 1, 1, 7, 1, 1, 1, 1, 1, 13, 1, 1]:
        layer.update(torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, 4, generator=g))
        t += n
        held = rows.held(t)
        got = (layer.start, 0 if layer.sink is None else layer.sink[0].shape[2], layer.k_rows.rows,
               layer.v_rows.rows, 0 if layer.recent is None else layer.recent[0].shape[2])
        assert got == (held.start, held.n_sink, held.n_encoded, held.n_encoded, held.n_residual), t


def test_a_prefix_policy_is_served_after_its_prefix(tiny):
    """A policy with a prefix: the cache holds the prefix's P rows from the start (get_seq_length() == P, the
    model's first token at position P) as fp16 sink rows -- the artifact's rows when given, else computed from
    the model as the artifact's were -- and again after reset; a prefix for a policy without one is refused."""
    spec = tiny.spec
    ids = torch.tensor([spec.bos_token_id, 17, 23])
    pol = replace(kvquant_policy(spec.n_layers, spec.n_kv_heads, spec.head_dim, residual=2), prefix_ids=ids,
                  prefix_len=3)
    from stages.prefix_tokens import prefix_kv
    shipped = prefix_kv(tiny.model, spec, ids)
    given = ArtifactCache(pol, tiny.model, prefix={"k": shipped["k_post"], "v": shipped["v"]})
    computed = ArtifactCache(pol, tiny.model)
    prompt = torch.randint(0, 40000, (2, 9), generator=torch.Generator().manual_seed(0))
    for cache in (given, computed):
        assert cache.get_seq_length() == 3
        with torch.no_grad():
            tiny.model(prompt, cache=cache)
        layer = cache.layers[1]
        assert cache.get_seq_length() == 12 and layer.sink[0].shape == (2, spec.n_kv_heads, 3, spec.head_dim)
        assert torch.equal(layer.sink[0][1], shipped["k_post"][1].to(torch.float16))
        assert torch.equal(layer.sink[1][0], shipped["v"][1].to(torch.float16))
        cache.reset()
        assert cache.get_seq_length() == 3 and layer.sink is None  # the prefix rows return with the next batch
    token = TensorPolicy(format="uniform", bits=4, axis="token")  # the ledger counts the prefix rows as sinks too
    int4 = CachePolicy("int4+prefix", [(token, token)] * spec.n_layers, n_sink=1, residual=2, prefix_ids=ids,
                       prefix_len=3)
    cache = ArtifactCache(int4, tiny.model)
    with torch.no_grad():
        tiny.model(prompt, cache=cache)
    assert cache.nbytes() == predict_bytes(int4, 12, spec.n_kv_heads, spec.head_dim, batch=2)
    assert cache.accounting()["sink"] == spec.n_layers * 2 * 2 * 3 * spec.n_kv_heads * spec.head_dim * 2
    with pytest.raises(ValueError, match="policy kvq has no prefix"):
        ArtifactCache(kvquant_policy(spec.n_layers, spec.n_kv_heads, spec.head_dim), tiny.model,
                      prefix={"k": shipped["k_post"], "v": shipped["v"]})


def test_cache_kwargs_follows_the_models_argument_name():
    """transformers 5.25 calls the argument `cache`, earlier 5.x `past_key_values`: a wrong name is swallowed by
    **kwargs and the model runs without the cache, so the name is read from the model's own forward."""
    from serving.cache import cache_kwargs

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):
            return past_key_values

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs):
            return cache

    marker = object()
    assert cache_kwargs(Old(), marker) == {"past_key_values": marker}
    assert cache_kwargs(New(), marker) == {"cache": marker}
    assert Old()(None, **cache_kwargs(Old(), marker)) is marker
