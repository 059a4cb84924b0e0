"""The fused CPU decode kernel (serving/cpu_attention.py): equal to the oracle within the runtime check's bound
on every exported format (nuq and uniform, token and channel axes and value groups, 2/3/4/8 bits, fp8 per tensor
and per head, fp16, sparse outliers, SmoothAttention, pre- and post-RoPE keys, sink and residual rows), over many
pages with work-item and tile boundaries inside encoded rows, rotated clipped values (the encoded rows' value sum
un-rotated apart from the fp16 rows'); planted faults fail the comparison; without the library the serving path
falls back to the block-wise torch attention and says why once."""
from dataclasses import replace

import pytest
import torch

from exporters.codec import CachePolicy, TensorPolicy
from exporters.errors import InputError
from pipeline.check import eval_ids
from runtime_check import reference
from runtime_check.check import RTOL, check_case, compare
from serving import blockwise, cpu_attention
from serving.cache import ArtifactCache, from_layer
from stages.hooks import attention_override, eager_attention

from tests.serving.test_blockwise import RECIPES, _policy

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason=f"the CPU kernel is not built: {cpu_attention.status()['reason']} "
                                       f"(python -m serving.cpu_attention build)")


def _paged_inputs(tiny, pol, page: int, context: int = 45, batch: int = 2):
    """DecodeInputs of every layer after prefilling `context` tokens and storing the next, over pages of `page`
    rows (the serving cache's own layout: the last page open)."""
    cache = ArtifactCache(pol, tiny.model, page=page)
    ids = eval_ids(tiny.tokenizer, batch, context + 1)
    queries = {}

    def capture(module, query, key, value, mask, scaling):
        queries[module.layer_idx] = (query[:, :, -1].float(), float(scaling))
        return eager_attention(query, key, value, mask, scaling)

    with torch.no_grad():
        tiny.model(ids[:, :-1], cache=cache)
        with attention_override(tiny.model, capture):
            tiny.model(ids[:, -1:], cache=cache)
    return [from_layer(layer, *queries[i], tiny.model.model.rotary_emb) for i, layer in enumerate(cache.layers)]


ROTCLIPV = "kvquant-2b+sink16+recent32+rotclipv"


@pytest.mark.parametrize("name", [*RECIPES, "value-groups", "kvquant-2b-1pct", "kvquant-3b-1pct+rotk", "int2-token",
                                  ROTCLIPV])
@pytest.mark.parametrize("chunk", [5, 512])
def test_the_cpu_kernel_equals_the_oracle(tiny, calib, name, chunk):
    """Every layer of real K/V: pages of 8 rows (several, the last open), items of `chunk` rows (5: item and tile
    boundaries inside pages and inside per-channel groups; 512: one item per page), a residual window of 3."""
    pol = _policy(tiny, calib, name)
    if name.endswith("+rotk"):  # the rotation is evaluation-only: the same keys without it
        pol = replace(pol, layers=[(replace(k, rotation="none", rotation_signs=None), v) for k, v in pol.layers])
    pol = replace(pol, residual=3) if pol.residual == 0 else pol
    if name == ROTCLIPV:  # 16 sinks + 32 recent rows would leave none of the 45 tokens encoded
        pol = replace(pol, n_sink=2, residual=3)
    for inp in _paged_inputs(tiny, pol, page=8):
        if inp.k_block is not None:
            assert len(inp.k_block.pages) >= 3
        ref = reference.decode_attention(inp)
        res = compare(cpu_attention.decode_attention(inp, chunk=chunk), ref)
        assert res["ok"] and res["max_rel_err"] < RTOL / 20, (name, res)


def _synthetic(fmt: dict, d: int = 16, h_kv: int = 2, g: int = 3, n: int = 37, b: int = 2, seed: int = 0,
               page: int = 8):
    """A cache of random rows under a hand-made policy (codebooks, static ranges, bounds; rotation signs drawn
    from fmt["signs"], a seed, when given) in pages of 8."""
    from exporters.codec import encode
    from exporters.layout import PagedRows, store
    from serving.inputs import DecodeInputs

    gen = torch.Generator().manual_seed(seed)

    def side(spec):
        p = TensorPolicy(**spec)
        if p.format == "nuq":
            p.codebook = torch.sort(torch.rand(2 ** p.bits, generator=gen) * 2 - 1).values
            if p.axis == "channel":
                p.zero, p.range = 0.1 * torch.randn(h_kv, d, generator=gen), 1 + torch.rand(h_kv, d, generator=gen)
        if p.outlier_fraction and p.axis == "channel":
            p.lower, p.upper = -torch.ones(h_kv, d) * 1.5, torch.ones(h_kv, d) * 1.5
        if p.format == "fp8":
            p.fp8_scale = (torch.rand(h_kv, generator=gen) + 0.5) / 100 if p.axis == "head" else torch.tensor(0.01)
        if p.rotation == "hadamard" and "signs" in fmt:  # signs of their own (a seed), not the seeded rht_signs
            signs = torch.Generator().manual_seed(fmt["signs"])
            p.rotation_signs = torch.randint(0, 2, (d & -d,), generator=signs).float() * 2 - 1
        return p

    pk, pv = side(fmt["key"]), side(fmt["value"])
    k, v = torch.randn(b, h_kv, n, d, generator=gen), torch.randn(b, h_kv, n, d, generator=gen)
    rows = PagedRows(pk, page), PagedRows(pv, page)
    a = 0
    while a < n:
        m = min(n - a, rows[0].room())
        for r, p, x in zip(rows, (pk, pv), (k, v)):
            r.write(store(encode(x[:, :, a:a + m], p), p, 1 + a))
        a += m
    sink = tuple(torch.randn(b, h_kv, 1, d, generator=gen).half() for _ in range(2))
    recent = tuple(torch.randn(b, h_kv, 2, d, generator=gen).half() for _ in range(2))
    from tests.serving.test_triton_attention import rotary

    return DecodeInputs(q=torch.randn(b, h_kv * g, d, generator=gen) * 2, scaling=d ** -0.5, key_policy=pk,
                        value_policy=pv, key_rope=fmt.get("rope", "pre"), rotary=rotary(d, fmt.get("rope_kind", "default")), sink=sink,
                        k_block=rows[0].view(), v_block=rows[1].view(), recent=recent,
                        smooth=(torch.rand(h_kv, d, generator=gen) + 0.5) if fmt.get("smooth") else None)


FORMATS = {
    "nuq3-channel+outliers/uniform8-token": dict(key=dict(format="nuq", bits=3, axis="channel", outlier_fraction=0.05),
                                                 value=dict(format="uniform", bits=8, axis="token")),
    "nuq8-channel/nuq2-token+outliers": dict(key=dict(format="nuq", bits=8, axis="channel"),
                                             value=dict(format="nuq", bits=2, axis="token", outlier_fraction=0.05)),
    "uniform3-group/uniform2-group+smooth": dict(key=dict(format="uniform", bits=3, axis="channel", group_size=4),
                                                 value=dict(format="uniform", bits=2, axis="channel", group_size=4),
                                                 smooth=True),
    "fp8-head/fp8-tensor-e5m2": dict(key=dict(format="fp8", bits=8, axis="head"),
                                     value=dict(format="fp8", bits=8, axis="tensor", fp8_dtype="e5m2")),
    "nuq4-channel+outliers/nuq4-token+outliers yarn": dict(
        key=dict(format="nuq", bits=4, axis="channel", outlier_fraction=0.05),
        value=dict(format="nuq", bits=4, axis="token", outlier_fraction=0.05), rope_kind="yarn"),
    "fp16/nuq4-token post-rope": dict(key=dict(format="fp16", bits=16, axis="tensor"),
                                      value=dict(format="nuq", bits=4, axis="token"), rope="post"),
    "nuq3-channel+outliers/uniform2-token rotated clipped": dict(
        key=dict(format="nuq", bits=3, axis="channel", outlier_fraction=0.05),
        value=dict(format="uniform", bits=2, axis="token", rotation="hadamard", clip="mse")),
}
ROTATED = FORMATS["nuq3-channel+outliers/uniform2-token rotated clipped"]


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("chunk", [3, 16, 512])
@pytest.mark.parametrize("d", [16, 64])
def test_every_stored_format_on_synthetic_rows(name, chunk, d):
    """Formats and widths no recipe of the tiny model stores (3- and 8-bit codes straddling / filling bytes, fp8
    e5m2 and per head, per-channel groups on both sides), 37 rows in pages of 8 from position 1, items of
    `chunk` rows: the kernel equals the oracle. head_dim 64: the AVX-512 paths (2- and 4-bit rows unpacked 32 codes
    at a time through the codebook register, 16-lane dots); 16: the code-by-code unpacking."""
    inp = _synthetic(FORMATS[name], d=d)
    ref = reference.decode_attention(inp)
    res = compare(cpu_attention.decode_attention(inp, chunk=chunk), ref)
    assert res["ok"] and res["max_rel_err"] < RTOL / 20, res


FUSED = {   # head_dim 64 pages the fused path takes (decode_attention.c run_column), and two it leaves
    "nuq4-channel/nuq4-token": dict(key=dict(format="nuq", bits=4, axis="channel"),
                                    value=dict(format="nuq", bits=4, axis="token")),
    "nuq2+outliers/nuq3+outliers": dict(key=dict(format="nuq", bits=2, axis="channel", outlier_fraction=0.05),
                                        value=dict(format="nuq", bits=3, axis="token", outlier_fraction=0.05)),
    "nuq3+outliers/nuq2 smooth": dict(key=dict(format="nuq", bits=3, axis="channel", outlier_fraction=0.05),
                                      value=dict(format="nuq", bits=2, axis="token"), smooth=True),
    "uniform4-token/uniform2-token": dict(key=dict(format="uniform", bits=4, axis="token"),
                                          value=dict(format="uniform", bits=2, axis="token", outlier_fraction=0.05)),
    "nuq4+outliers/uniform2 rotated clipped": dict(
        key=dict(format="nuq", bits=4, axis="channel", outlier_fraction=0.05),
        value=dict(format="uniform", bits=2, axis="token", rotation="hadamard", clip="mse")),
    "uniform3-group (general path)": dict(key=dict(format="uniform", bits=3, axis="channel", group_size=4),
                                          value=dict(format="nuq", bits=4, axis="token")),
    "nuq8 (general path)": dict(key=dict(format="nuq", bits=8, axis="channel"),
                                value=dict(format="nuq", bits=4, axis="token", outlier_fraction=0.05)),
}


@pytest.mark.parametrize("name", list(FUSED))
@pytest.mark.parametrize("shape", [(2, 3, 5), (3, 3, 512), (9, 2, 16), (1, 17, 512)])
def test_the_fused_path_is_the_general_path_bit_for_bit(name, shape):
    """head_dim 64: the fused path (every kv head of a run in one work item, key rows kept in registers) returns
    the very bits of the general path (kvcalib_set_fast(0)) -- outliers on either side, smoothing, per-token keys,
    rotated values, runs of 5 / 16 / 512 rows across pages of 8, 1 to 3 sequences, 2 to 17 query heads per kv head,
    9 kv heads (past FAST_MAX_H: the general path) -- and equals the oracle."""
    h_kv, b, chunk = shape
    g = 17 if b == 1 else 3   # 17 > FAST_MAX_G: the general path
    inp = _synthetic(FUSED[name], d=64, h_kv=h_kv, g=g, b=b, n=61)
    try:
        cpu_attention.fused_path(False)
        general = cpu_attention.decode_attention(inp, chunk=chunk)
    finally:
        cpu_attention.fused_path(True)
    fused = cpu_attention.decode_attention(inp, chunk=chunk)
    assert torch.equal(fused, general), (fused - general).abs().max()
    res = compare(fused, reference.decode_attention(inp))
    assert res["ok"] and res["max_rel_err"] < RTOL / 20, res


def test_the_fused_path_refuses_a_corrupt_outlier_list():
    """A negative stored outlier index in a page the fused path reads: refused (-5), as the general path does."""
    inp = _synthetic(FUSED["nuq2+outliers/nuq3+outliers"], d=64, h_kv=3)
    page = inp.k_block.pages[1]
    page.tensors["outlier_index"][0] = -5
    with pytest.raises(InputError, match="negative outlier"):
        cpu_attention.decode_attention(inp)


def _captured_launch(inp, monkeypatch):
    """decode_attention's one launch, its arguments kept: (args, kwargs, output) -- to call launch again."""
    held = {}
    real = cpu_attention.launch

    def spy(*args, **kwargs):
        held["out"] = real(*args, **kwargs)
        held["args"], held["kwargs"] = list(args), dict(kwargs)
        return held["out"]

    monkeypatch.setattr(cpu_attention, "launch", spy)
    cpu_attention.decode_attention(inp, chunk=5)
    monkeypatch.undo()
    return held


@pytest.mark.parametrize("first", [0, 2, 5])
def test_recent_rows_read_from_a_ring_in_place(monkeypatch, first):
    """The vLLM plugin's recent window read where its ring holds it (row i at (first + i) % ring, wrapping): the
    bits of the same rows handed in order."""
    inp = _synthetic(FUSED["nuq2+outliers/nuq3+outliers"], d=64, h_kv=3)
    held = _captured_launch(inp, monkeypatch)
    k, v = inp.recent
    b, h, n, d = k.shape
    ring = n + 4
    slots = [(first + i) % ring for i in range(n)]
    rk, rv = torch.zeros(b, h, ring, d, dtype=torch.float16), torch.zeros(b, h, ring, d, dtype=torch.float16)
    rk[:, :, slots], rv[:, :, slots] = k, v
    rows = cpu_attention._rows((rk, rv), b, h, d, "ring")
    rows.n, rows.first, rows.ring = n, first, ring
    args = held["args"]
    args[10] = rows   # recent
    out = cpu_attention.launch(*args, **held["kwargs"])
    assert torch.equal(out, held["out"])
    rows.first = ring   # a start outside the ring: refused, nothing read
    with pytest.raises(InputError, match="refused the shapes"):
        cpu_attention.launch(*args, **held["kwargs"])


def test_a_page_table_relative_to_a_base_reads_the_same_rows(monkeypatch):
    """A table whose code and scale addresses are relative to a base (the plugin's, shared by a step's layers) and
    the base handed apart: the bits of the absolute table (the relative addresses alone point 4 MB away)."""
    from serving.pages import N_PAGE, N_SIDE

    inp = _synthetic(FUSED["nuq4-channel/nuq4-token"], d=64, h_kv=3)
    held = _captured_launch(inp, monkeypatch)
    table = held["args"][0].view(-1, N_PAGE)
    byte_f, half_f = torch.zeros(N_PAGE, dtype=torch.int64), torch.zeros(N_PAGE, dtype=torch.int64)
    byte_f[2] = byte_f[2 + N_SIDE] = 1             # the codes' addresses (bytes)
    half_f[2 + N_SIDE + 5] = half_f[2 + N_SIDE + 6] = 1   # the values' per-token scale and zero (fp16 elements)
    base = 4096 * 1001
    rel = (table - byte_f * base - half_f * (base // 2)).contiguous()
    args = held["args"]
    args[0] = rel
    out = cpu_attention.launch(*args, **held["kwargs"], relative=(byte_f, half_f, base))
    assert torch.equal(out, held["out"])


@pytest.mark.parametrize("fused", [True, False])
def test_sequences_of_their_own_pages_in_one_launch(monkeypatch, fused):
    """The vLLM plugin's launch: two sequences' pages in one table, each page's sequence in page_b, each
    sequence's own sink and recent rows: the bits of each sequence launched alone -- on the fused path and on the
    general one."""
    inps = [_synthetic(FUSED["nuq2+outliers/nuq3+outliers"], d=64, h_kv=3, b=1, n=n) for n in (29, 37)]
    # (one seed: the same policies; kept alive: the tables point into their pages)
    held = [_captured_launch(inp, monkeypatch) for inp in inps]
    try:
        cpu_attention.fused_path(fused)
        alone = [cpu_attention.launch(*h["args"], **h["kwargs"]) for h in held]
        (a0, k0), (a1, _) = [(h["args"], h["kwargs"]) for h in held]
        tables = [a[0].view(-1, cpu_attention.N_PAGE)[:a[1]] for a in (a0, a1)]
        table = torch.cat(tables).contiguous()
        page_b = torch.cat([torch.full((t.shape[0],), j, dtype=torch.int64) for j, t in enumerate(tables)])
        both = cpu_attention.launch(table, table.shape[0], torch.cat([a0[2], a1[2]]), *a0[3:9],
                                    cpu_attention._Rows(), cpu_attention._Rows(), *a0[11:14], [], **k0,
                                    page_b=page_b, sinks=[a0[9], a1[9]], recents=[a0[10], a1[10]])
    finally:
        cpu_attention.fused_path(True)
    assert torch.equal(both, torch.cat(alone))


@pytest.mark.parametrize("fault", ["position off by one", "outliers dropped", "lambda dropped", "one page skipped"])
def test_planted_faults_fail_the_comparison(fault):
    """The comparison has teeth: each reading mistake, made on the inputs the kernel is given, fails it."""
    spec = FORMATS["nuq3-channel+outliers/uniform8-token"] | {"smooth": True}
    inp = _synthetic(spec)
    ref = reference.decode_attention(inp)
    assert compare(cpu_attention.decode_attention(inp), ref)["ok"]
    from exporters.layout import PagedBlock, StoredBlock

    def key_pages(fn):
        return PagedBlock(tuple(fn(p) for p in inp.k_block.pages))

    if fault == "position off by one":
        bad = replace(inp, k_block=key_pages(lambda p: StoredBlock(p.start + 1, p.shape, p.tensors)))
    elif fault == "outliers dropped":
        def drop(p):
            t = dict(p.tensors)
            t["outlier_count"] = torch.zeros_like(t["outlier_count"])
            return StoredBlock(p.start, p.shape, t)
        bad = replace(inp, k_block=key_pages(drop))
    elif fault == "lambda dropped":
        bad = replace(inp, smooth=torch.ones_like(inp.smooth))
    else:
        bad = replace(inp, k_block=PagedBlock(inp.k_block.pages[:-1]), v_block=PagedBlock(inp.v_block.pages[:-1]))
    assert not compare(cpu_attention.decode_attention(bad), ref)["ok"], fault


@pytest.mark.parametrize("chunk", [3, 512])
def test_rotated_values_in_blocks_of_8(chunk):
    """head_dim 24: the rotation works on blocks of b = 8 channels (b the largest power of two dividing D), so the
    un-rotation matrix is block-diagonal; signs of the policy's own."""
    inp = _synthetic(ROTATED | {"signs": 5}, d=24)
    assert inp.value_policy.rotation_signs.shape == (8,)
    res = compare(cpu_attention.decode_attention(inp, chunk=chunk), reference.decode_attention(inp))
    assert res["ok"] and res["max_rel_err"] < RTOL / 20, res


@pytest.mark.parametrize("fault", ["no un-rotation", "the seeded signs", "fp16 rows un-rotated too"])
def test_rotated_values_planted_faults_fail(monkeypatch, fault):
    """Rotated values under signs that are not the seeded ones: the kernel equals the oracle; a kernel that forgets
    to un-rotate the encoded rows' sum, un-rotates with the seeded signs instead of the policy's, or un-rotates the
    fp16 rows too (one value sum, un-rotated whole) fails it."""
    from exporters.rotation import rht_signs, unrotation_matrix

    inp = _synthetic(ROTATED | {"signs": 3})
    signs = inp.value_policy.rotation_signs
    assert signs is not None and not torch.equal(signs, rht_signs(16))
    ref = reference.decode_attention(inp)
    assert compare(cpu_attention.decode_attention(inp), ref)["ok"]
    if fault == "no un-rotation":
        monkeypatch.setattr(cpu_attention, "value_unrotation", lambda p, d, device: None)
        out = cpu_attention.decode_attention(inp)
    elif fault == "the seeded signs":
        monkeypatch.setattr(cpu_attention, "value_unrotation", lambda p, d, device: unrotation_matrix(d))
        out = cpu_attention.decode_attention(inp)
    else:
        monkeypatch.setattr(cpu_attention, "value_unrotation", lambda p, d, device: None)
        out = cpu_attention.decode_attention(inp) @ unrotation_matrix(16, signs)
    assert not compare(out, ref)["ok"], fault


def test_the_cpu_kernel_passes_the_runtime_check(tiny, calib):
    """As the runtime check runs it on a CPU: check_case with the CPU kernel."""
    pol = _policy(tiny, calib, "kvquant-3b-1pct+smooth")
    case = check_case(tiny, pol, eval_ids(tiny.tokenizer, 2, 49), None, cpu_attention.decode_attention,
                      {"kernel_s": 0.0, "oracle_s": 0.0})
    assert case["ok"] and case["max_rel_err"] < 1e-5


def test_serving_takes_the_cpu_kernel_for_single_tokens(tiny, calib, monkeypatch):
    """generate() with the block-wise cache on the CPU: single-token steps go through the CPU kernel (counted), and
    the tokens equal those of the block-wise torch path."""
    pol = _policy(tiny, calib, "kvquant-4b-1pct")
    ids = eval_ids(tiny.tokenizer, 2, 30)
    calls = []
    real = cpu_attention.decode_attention
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda inp, **kw: calls.append(1) or real(inp, **kw))
    out, _ = blockwise.generate(tiny.model, pol, ids, max_new_tokens=6, do_sample=False)
    assert len(calls) == 5 * tiny.spec.n_layers     # the first new token comes from the prefill
    monkeypatch.setenv("KVCALIB_CPU_KERNEL", "0")
    monkeypatch.setattr(cpu_attention, "_LIB", {})
    calls.clear()
    ref, _ = blockwise.generate(tiny.model, pol, ids, max_new_tokens=6, do_sample=False)
    assert not calls and torch.equal(out, ref)


def test_without_the_library_the_torch_path_serves_and_says_why_once(tiny, calib, monkeypatch, capsys):
    """No compiler: the kernel is not built, the reason is printed once, and serving falls back to the block-wise
    torch attention (same tokens as the materializing cache)."""
    monkeypatch.setattr(cpu_attention, "_LIB", {})
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("KVCALIB_KERNEL_DIR", str(pytest.importorskip("tempfile").mkdtemp()))
    pol = _policy(tiny, calib, "kvquant-4b-1pct")
    ids = eval_ids(tiny.tokenizer, 1, 20)
    out, _ = blockwise.generate(tiny.model, pol, ids, max_new_tokens=4, do_sample=False)
    ref, _ = blockwise.generate(tiny.model, pol, ids, attention="materialize", max_new_tokens=4, do_sample=False)
    assert torch.equal(out, ref)
    err = capsys.readouterr().err
    assert err.count("the fused CPU decode kernel is not available") == 1 and "/nonexistent/cc" in err
    assert cpu_attention.status()["available"] is False
    monkeypatch.setattr(cpu_attention, "_LIB", {})  # the next test loads the real library again


ENCODED = {
    "nuq4-channel+outliers pre-rope": (dict(format="nuq", bits=4, axis="channel", outlier_fraction=0.05), "pre", False),
    "nuq3-channel+outliers smooth": (dict(format="nuq", bits=3, axis="channel", outlier_fraction=0.05), "pre", True),
    "nuq2-channel": (dict(format="nuq", bits=2, axis="channel"), None, False),
    "nuq8-channel": (dict(format="nuq", bits=8, axis="channel"), "pre", False),
    "nuq4-token+outliers": (dict(format="nuq", bits=4, axis="token", outlier_fraction=0.01), None, False),
    "nuq3-token+outliers pre-rope smooth": (dict(format="nuq", bits=3, axis="token", outlier_fraction=0.05), "pre",
                                            True),
    "uniform2-token": (dict(format="uniform", bits=2, axis="token"), None, False),
    "uniform4-token+outliers": (dict(format="uniform", bits=4, axis="token", outlier_fraction=0.02), None, False),
    "uniform3-group4 pre-rope": (dict(format="uniform", bits=3, axis="channel", group_size=4), "pre", False),
    "uniform8-group2+outliers": (dict(format="uniform", bits=8, axis="channel", group_size=2, outlier_fraction=0.05),
                                 None, False),
}


@pytest.mark.parametrize("name", list(ENCODED))
@pytest.mark.parametrize("n", [1, 8])
def test_the_encoder_stores_the_codecs_bytes(name, n):
    """kvcalib_encode == exporters.layout.store(exporters.codec.encode(...)): every stored tensor equal to the bit,
    on fp16 rows (ties and constant rows included), with inverse RoPE at the rows' positions and lambda."""
    from exporters.codec import encode
    from exporters.layout import store
    from exporters.rope import invert_rope, rotary_tables
    from tests.serving.test_triton_attention import rotary

    spec, rope, smooth = ENCODED[name]
    d, h, b, start = 16, 2, 2, 37
    gen = torch.Generator().manual_seed(n)
    p = TensorPolicy(**spec)
    n = n * p.group_size if p.is_grouped else n   # per-channel groups are encoded whole
    if p.format == "nuq":
        p.codebook = torch.sort(torch.rand(2 ** p.bits, generator=gen) * 2 - 1).values
        if p.axis == "channel":
            p.zero, p.range = 0.1 * torch.randn(h, d, generator=gen), 1 + torch.rand(h, d, generator=gen)
            p.range[0, 3] = 0  # a channel of range 0 encodes to level of 0
    if p.outlier_fraction and p.axis == "channel":
        p.lower, p.upper = -torch.ones(h, d) * 1.2, torch.ones(h, d) * 1.2
    x = torch.randn(b, h, n, d, generator=gen).half()
    x[0, 0, 0] = 0.5                      # a constant row
    x[1, 1, -1, :4] = torch.tensor([0.25, -0.25, 0.75, 1.0]).half()   # exact midpoints of a grid
    rot = rotary(d) if rope else None
    lam = (torch.rand(h, d, generator=gen) + 0.5) if smooth else None
    got = cpu_attention.encode_rows(x, p, start, rot, lam)
    assert got is not None
    xf = x.float()
    if rot is not None:
        cos, sin = rotary_tables(rot, start, n)
        xf = invert_rope(xf, cos[0], sin[0])
    if lam is not None:
        xf = xf / lam[None, :, None, :]
    want = store(encode(xf, p), p, start)
    assert list(got.tensors) == list(want.tensors) and got.start == want.start and got.shape == want.shape
    for key in want.tensors:
        w, g_ = want.tensors[key], got.tensors[key]
        assert g_.dtype == w.dtype and g_.shape == w.shape, key
        assert torch.equal(g_.view(torch.uint8) if g_.dtype == torch.float16 else g_,
                           w.view(torch.uint8) if w.dtype == torch.float16 else w), (key, g_, w)


def test_the_encoder_refuses_what_it_does_not_take():
    """fp16 / fp8 rows and rotated (evaluation-only) policies: None, the codec's torch path stores them."""
    x = torch.randn(1, 2, 3, 16).half()
    assert cpu_attention.encode_rows(x, TensorPolicy(), 0) is None
    assert cpu_attention.encode_rows(x, TensorPolicy(format="fp8", bits=8, axis="tensor",
                                                     fp8_scale=torch.tensor(0.01)), 0) is None
    assert cpu_attention.encode_rows(x, TensorPolicy(format="uniform", bits=4, axis="token", rotation="hadamard"),
                                     0) is None
    # a clip alone too: the encoder does not search a range (it once took such a policy and stored unclipped codes)
    clipped = TensorPolicy(format="uniform", bits=4, axis="token", clip="mse")
    assert cpu_attention.encode_rows(x, clipped, 0) is None
    with pytest.raises(InputError, match="clip mse"):
        cpu_attention.encode_into(x[:, :, :1], clipped, 0, None, 0, None, None, None, None, 0,
                                  torch.zeros(1, dtype=torch.int16))


@pytest.mark.parametrize("fraction", [0.01, 0.02, 0.05, 0.1])
def test_the_encoders_token_bounds_are_torch_quantiles(fraction):
    """Per-token outlier bounds computed in the library (sort, linear interpolation) select exactly the outliers
    codec.token_outlier_bounds (torch.quantile) does, on 64 tokens of 3 heads x 64 channels (192 entries: ranks
    between entries) and of 2 x 16, with repeated values."""
    from exporters.codec import encode
    from exporters.layout import store

    gen = torch.Generator().manual_seed(int(fraction * 1000))
    for h, d in ((3, 64), (2, 16)):
        x = (torch.randn(2, h, 64, d, generator=gen) * 3).half()
        x[:, :, ::5] = x[:, :, ::5].round()          # ties at the bounds
        p = TensorPolicy(format="nuq", bits=4, axis="token", outlier_fraction=fraction,
                         codebook=torch.linspace(-1, 1, 16))
        got, want = cpu_attention.encode_rows(x, p, 0), store(encode(x.float(), p), p, 0)
        for key in want.tensors:
            assert torch.equal(got.tensors[key].view(torch.uint8) if got.tensors[key].dtype == torch.float16
                               else got.tensors[key], want.tensors[key].view(torch.uint8)
                               if want.tensors[key].dtype == torch.float16 else want.tensors[key]), (key, h, d)


@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="x86-64 targets only")
def test_the_library_built_without_avx512_equals_the_oracle(monkeypatch, tmp_path):
    """The scalar paths (2/4-bit codes code by code, the 8-lane dot) as a CPU without AVX-512 runs them: the library
    built for x86-64-v3 (AVX2) equals the oracle on the synthetic formats too (this machine's own build takes the
    AVX-512 paths)."""
    monkeypatch.setenv("KVCALIB_KERNEL_MARCH", "x86-64-v3")
    monkeypatch.setenv("KVCALIB_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_attention, "_LIB", {})
    monkeypatch.setattr(cpu_attention, "_SIDES", {})
    assert cpu_attention.status()["available"], cpu_attention.status()
    assert "-march=x86-64-v3" in (tmp_path / cpu_attention.library_path().with_suffix(".txt").name).read_text()
    for name, spec in FORMATS.items():
        for chunk in (3, 512):
            inp = _synthetic(spec, d=64 if "yarn" in name else 16)
            res = compare(cpu_attention.decode_attention(inp, chunk=chunk), reference.decode_attention(inp))
            assert res["ok"] and res["max_rel_err"] < RTOL / 20, (name, chunk, res)
    monkeypatch.setattr(cpu_attention, "_LIB", {})  # the next test loads this machine's library again
