"""The Triton decode kernel against the oracle on synthetic stored caches (interpreter on CPU), every format."""
import math
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from exporters.codec import CachePolicy, TensorPolicy, encode, fp8_scale_from_amax
from exporters.layout import store
from runtime_check import reference
from serving.cache import ArtifactCache, from_layer
from serving.inputs import DecodeInputs
from serving.triton_attention import decode_attention

B, H_KV, GROUP = 2, 2, 3


def rotary(d: int, kind: str = "default") -> LlamaRotaryEmbedding:
    scaling = {"default": None,
               "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64},
               "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}[kind]
    cfg = LlamaConfig(hidden_size=d * GROUP * H_KV, num_attention_heads=GROUP * H_KV, num_key_value_heads=H_KV,
                      head_dim=d, max_position_embeddings=1 << 20, rope_theta=10000.0, rope_scaling=scaling)
    return LlamaRotaryEmbedding(cfg)


def calibrated(p: TensorPolicy, x: torch.Tensor) -> TensorPolicy:
    """Fill the static tensors a recipe calibrates, from the data itself (x: [B, H, T, D])."""
    g = torch.Generator().manual_seed(0)
    if p.format == "nuq":
        inner = torch.sort(torch.rand(2 ** p.bits - 2, generator=g) * 1.8 - 0.9).values
        p = replace(p, codebook=torch.cat([torch.tensor([-1.0]), inner, torch.tensor([1.0])]))
    if p.axis == "channel" and p.format == "nuq" or p.outlier_fraction and p.axis == "channel":
        flat = x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[-1])                 # [H, B*T, D]
        f = max(p.outlier_fraction, 1e-3)
        lo, hi = flat.quantile(f / 2, dim=1), flat.quantile(1 - f / 2, dim=1)
        p = replace(p, zero=(hi + lo) / 2, range=(hi - lo) / 2, lower=lo, upper=hi)
    if p.format == "fp8":
        amax = x.abs().amax((0, 2, 3))
        p = replace(p, fp8_scale=fp8_scale_from_amax(amax if p.axis == "head" else amax.max(), p.fp8_dtype))
    p.validate()
    return p


def make_inputs(pk: TensorPolicy, pv: TensorPolicy, d: int = 16, n_sink: int = 2, n_q: int = 45, n_rec: int = 5,
                key_rope: str = "pre", smooth: bool = False, start: int | None = None, kind: str = "default",
                seed: int = 0) -> DecodeInputs:
    g = torch.Generator().manual_seed(seed)
    n = max(n_q, 8)  # rows to calibrate on, even when none is encoded
    k = torch.randn(B, H_KV, n, d, generator=g) * 2 + torch.randn(1, H_KV, 1, d, generator=g)  # channel offsets
    v = torch.randn(B, H_KV, n, d, generator=g)
    lam = None
    if smooth:  # equal on the two channels of each RoPE pair, as smooth_attention fits it
        lam = (torch.rand(H_KV, d // 2, generator=g) + 0.5).repeat(1, 2)
    k_stored = k / lam[None, :, None, :] if smooth else k                              # the cache holds K / lambda
    pk, pv = calibrated(pk, k_stored), calibrated(pv, v)
    start = n_sink if start is None else start
    k_block = store(encode(k_stored[:, :, :n_q], pk), pk, start) if n_q else None
    v_block = store(encode(v[:, :, :n_q], pv), pv, start) if n_q else None

    def rows(n):
        return None if n == 0 else (torch.randn(B, H_KV, n, d, generator=g).half(),
                                    torch.randn(B, H_KV, n, d, generator=g).half())

    q = torch.randn(B, H_KV * GROUP, d, generator=g) * 2
    return DecodeInputs(q=q, scaling=d ** -0.5, key_policy=pk, value_policy=pv, key_rope=key_rope,
                        rotary=rotary(d, kind), sink=rows(n_sink), k_block=k_block, v_block=v_block,
                        recent=rows(n_rec), smooth=lam)


def assert_matches(inp: DecodeInputs, **kw) -> None:
    out, ref = decode_attention(inp, **kw), reference.decode_attention(inp)
    assert out.shape == ref.shape == inp.q.shape
    err = (out - ref).abs().max()
    assert err <= 1e-5 * ref.abs().max(), f"max abs err {err:.3e}, output scale {ref.abs().max():.3e}"


FORMATS = {
    "fp16": TensorPolicy(),
    "fp8-e4m3-tensor": TensorPolicy(format="fp8", bits=8, axis="tensor"),
    "fp8-e5m2-head": TensorPolicy(format="fp8", bits=8, axis="head", fp8_dtype="e5m2"),
    "uniform2-token": TensorPolicy(format="uniform", bits=2, axis="token"),
    "uniform3-token": TensorPolicy(format="uniform", bits=3, axis="token"),
    "uniform4-channel-g8": TensorPolicy(format="uniform", bits=4, axis="channel", group_size=8),
    "uniform8-channel-g32": TensorPolicy(format="uniform", bits=8, axis="channel", group_size=32),
    "nuq2-channel-1pct": TensorPolicy(format="nuq", bits=2, axis="channel", outlier_fraction=0.01),
    "nuq3-channel-5pct": TensorPolicy(format="nuq", bits=3, axis="channel", outlier_fraction=0.05),
    "nuq4-channel": TensorPolicy(format="nuq", bits=4, axis="channel"),
    "nuq3-token-2pct": TensorPolicy(format="nuq", bits=3, axis="token", outlier_fraction=0.02),
    "nuq4-token-1pct": TensorPolicy(format="nuq", bits=4, axis="token", outlier_fraction=0.01),
    "uniform4-token-1pct": TensorPolicy(format="uniform", bits=4, axis="token", outlier_fraction=0.01),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_key_format_matches_the_oracle(name):
    key_rope = "post" if FORMATS[name].format == "fp8" else "pre"
    assert_matches(make_inputs(FORMATS[name], FORMATS["nuq3-token-2pct"], key_rope=key_rope))


@pytest.mark.parametrize("name", ["fp16", "fp8-e4m3-tensor", "uniform2-token", "uniform3-token", "nuq2-channel-1pct",
                                  "nuq3-token-2pct", "uniform4-token-1pct"])
def test_every_value_format_matches_the_oracle(name):
    assert_matches(make_inputs(FORMATS["uniform4-channel-g8"], FORMATS[name], key_rope="post"))


# rotated, clipped values (value side only: a key is scored, not summed, and is never served rotated), kept out of
# FORMATS, whose every entry test_every_key_format_matches_the_oracle serves as keys
ROTATED = TensorPolicy(format="uniform", bits=2, axis="token", rotation="hadamard", clip="mse")


def _signs(b: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2, (b,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1


@pytest.mark.parametrize("d", [16, 64])
def test_rotated_values_match_the_oracle(d):
    """Encoded value rows stored rotated, fp16 rows not: the kernel sums the two apart and un-rotates the encoded
    part once; one split and several (the fp16 rows' item first), and the tl.dot path at head_dim 64."""
    inp = make_inputs(FORMATS["nuq3-channel-5pct"], ROTATED, d=d, n_q=40)
    for kw in ({"n_splits": 1, "block_t": 16}, {"n_splits": 3, "block_t": 16}):
        assert_matches(inp, **kw)


def test_rotated_values_only_fp16_rows_and_only_encoded_rows():
    assert_matches(make_inputs(FORMATS["uniform4-channel-g8"], ROTATED, key_rope="post", n_q=0, n_sink=3, n_rec=7))
    assert_matches(make_inputs(FORMATS["uniform4-channel-g8"], ROTATED, key_rope="post", n_sink=0, n_rec=0, start=0))


def test_rotated_values_read_the_policys_signs():
    """Signs that are not the seeded ones (every +1, and a random draw): the kernel equals the oracle, and the same
    stored bytes read with the seeded signs (a kernel that ignored the policy's) do not."""
    from runtime_check.check import compare

    for signs in (torch.ones(16), _signs(16, 7)):
        inp = make_inputs(FORMATS["uniform4-channel-g8"], replace(ROTATED, rotation_signs=signs), key_rope="post")
        assert_matches(inp)
        seeded = replace(inp, value_policy=replace(inp.value_policy, rotation_signs=None))
        assert not compare(decode_attention(seeded), reference.decode_attention(inp))["ok"]


@pytest.mark.parametrize("fault", ["no un-rotation", "fp16 rows un-rotated too"])
def test_rotated_values_planted_faults_fail(monkeypatch, fault):
    """The oracle catches a kernel that forgets to un-rotate the encoded rows' sum, and one that un-rotates the
    fp16 rows as well (a single value sum, un-rotated whole)."""
    from runtime_check.check import compare
    from serving import triton_attention as ta

    inp = make_inputs(FORMATS["uniform4-channel-g8"], ROTATED, key_rope="post")
    ref = reference.decode_attention(inp)
    assert compare(decode_attention(inp), ref)["ok"]
    if fault == "no un-rotation":
        monkeypatch.setattr(ta, "value_unrotation", lambda p, d, device: None)
        out = decode_attention(inp)
    else:
        m = ta.value_unrotation(inp.value_policy, inp.head_dim, torch.device("cpu"))
        monkeypatch.setattr(ta, "value_unrotation", lambda p, d, device: None)
        out = decode_attention(inp) @ m
    assert not compare(out, ref)["ok"], fault


@pytest.mark.parametrize("kind", ["llama3", "yarn"])
def test_scaled_rope_is_the_models(kind):
    """inv_freq and attention_scaling come from the rotary module: Llama-3 and YaRN scaling are honoured."""
    inp = make_inputs(FORMATS["nuq4-channel"], FORMATS["nuq4-token-1pct"], kind=kind, start=300)
    assert_matches(inp)


def test_far_positions_are_reduced_exactly():
    """Keys at ~100k positions: angles of ~1e5 rad are range-reduced before cos/sin."""
    assert_matches(make_inputs(FORMATS["nuq3-channel-5pct"], FORMATS["fp16"], start=100_003, n_q=20))


def test_head_dim_64_uses_the_dot_path_and_both_paths_agree():
    inp = make_inputs(FORMATS["nuq3-channel-5pct"], FORMATS["nuq3-token-2pct"], d=64, n_q=40, smooth=True)
    assert_matches(inp)                      # d/2 >= 16: tl.dot with a padded GQA group
    assert_matches(inp, use_dot=False)       # the broadcast-and-reduce path


def test_splits_tiles_and_smoothing():
    inp = make_inputs(FORMATS["nuq2-channel-1pct"], FORMATS["uniform2-token"], smooth=True, n_q=70)
    for kw in ({"n_splits": 1, "block_t": 16}, {"n_splits": 3, "block_t": 16}, {"n_splits": 2, "block_t": 64}):
        assert_matches(inp, **kw)
    assert_matches(replace(inp, key_rope="post"))


def test_only_full_precision_rows_and_only_encoded_rows():
    assert_matches(make_inputs(FORMATS["nuq4-channel"], FORMATS["nuq4-token-1pct"], n_q=0, n_sink=3, n_rec=7))
    assert_matches(make_inputs(FORMATS["nuq4-channel"], FORMATS["nuq4-token-1pct"], n_sink=0, n_rec=0, start=0))


def test_strided_views_are_read_through_their_strides():
    """The kernel honours strides: the same values in a token-major memory layout give the same output."""
    inp = make_inputs(FORMATS["uniform3-token"], FORMATS["nuq3-token-2pct"])

    def token_major(t):
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    blocks = [replace(blk, tensors={n: token_major(x) if x.dim() == 4 else x for n, x in blk.tensors.items()})
              for blk in (inp.k_block, inp.v_block)]
    strided = replace(inp, k_block=blocks[0], v_block=blocks[1], sink=tuple(map(token_major, inp.sink)),
                      recent=tuple(map(token_major, inp.recent)))
    assert not strided.k_block.tensors["codes"].is_contiguous()
    assert torch.allclose(decode_attention(strided), decode_attention(inp), rtol=0, atol=1e-6)


def test_refusals():
    """The kernel multiplies the decoded keys by lambda before rotating them, as the oracle: any lambda is read
    exactly, even one that differs on the two channels of a RoPE pair (folding it into q would need them equal)."""
    inp = make_inputs(FORMATS["nuq4-channel"], FORMATS["fp16"], smooth=True)
    bad = inp.smooth.clone()
    bad[0, 0] += 1
    assert_matches(replace(inp, smooth=bad))
    odd = make_inputs(FORMATS["fp16"], FORMATS["fp16"], d=12, key_rope="post")
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        decode_attention(odd)


def test_reference_reads_what_the_cache_serves(tiny):
    """The oracle's decoded keys / values are the ArtifactCache's own (materialize), on real tiny-model rows."""
    spec = tiny.spec
    k_pol, v_pol = FORMATS["nuq3-channel-5pct"], FORMATS["nuq3-token-2pct"]
    ids = torch.randint(0, 40000, (2, 50), generator=torch.Generator().manual_seed(0))
    x = torch.randn(1, spec.n_kv_heads, 50, spec.head_dim)
    pk, pv = calibrated(k_pol, x), calibrated(v_pol, x)
    policy = CachePolicy("t", [(pk, pv)] * spec.n_layers, key_rope="pre", n_sink=1, residual=8)
    cache = ArtifactCache(policy, tiny.model)
    with torch.no_grad():
        tiny.model(ids, cache=cache)
    layer = cache.layers[1]
    inp = from_layer(layer, torch.randn(2, spec.n_q_heads, spec.head_dim), spec.head_dim ** -0.5,
                     tiny.model.model.rotary_emb)
    k, v = reference.cached_kv(inp)
    k_c, v_c = layer.materialize()
    assert torch.allclose(k, k_c, atol=1e-6) and torch.equal(v, v_c)
    assert_matches(inp)


@pytest.mark.parametrize("fmt", ["nuq-2", "nuq-4-1pct", "fp8"])
def test_bench_caches_decode_like_the_oracle(fmt):
    """bench/kernel.py's synthetic Llama-3-8B-shaped caches (head_dim 128, GQA 4, Llama-3 RoPE) on a short context."""
    from bench.kernel import make_cache, max_rel_err, stored_bytes

    inp = make_cache(fmt, 1, 40, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert max_rel_err(inp) < 1e-5
    assert stored_bytes(inp) < 40 * 2 * 8 * 128 * 2  # below fp16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip without a GPU")
def test_bench_skips_without_a_gpu(capsys):
    from bench.kernel import main

    assert main(["--json", "/nonexistent/never-written.json"]) == 0
    assert capsys.readouterr().out.startswith("bench.kernel: skipped: no CUDA GPU")


def test_positions_past_the_exact_rope_reduction_are_refused():
    """The range reduction of RoPE angles is exact below 2^16 turns of the fastest frequency (inv_freq 1 here:
    positions up to 65535 * 2 pi = 411768): the last position in range is read exactly, one further is refused."""
    limit = math.floor((2 ** 16 - 1) * 2 * math.pi)
    assert_matches(make_inputs(FORMATS["nuq4-channel"], FORMATS["fp16"], start=limit - 19, n_q=20))
    beyond = make_inputs(FORMATS["nuq4-channel"], FORMATS["fp16"], start=limit - 18, n_q=20)
    with pytest.raises(ValueError, match=rf"key position {limit + 1} .* positions 0\.\.{limit}"):
        decode_attention(beyond)
    decode_attention(replace(beyond, key_rope="post"))  # keys stored post-RoPE: nothing rotated, nothing refused


def test_offsets_past_2_31_elements_are_64_bit():
    """A page whose element offsets pass 2^31 (here row * token stride = 2 * 2^30; in a large batch b * batch stride
    or the scale offsets) is read where it lies. The codes sit 2^31 bytes into a lazily mapped buffer, so an
    offset wrapped to 32 bits reads the untouched (zero) bytes before them instead of faulting."""
    inp = make_inputs(FORMATS["uniform2-token"], FORMATS["fp16"], n_q=3, n_sink=1, n_rec=0, key_rope="post")
    codes = inp.k_block.tensors["codes"]                                  # [B, H, 3, 4] uint8
    b, h, n, w = codes.shape
    buf = torch.empty(2 ** 31 + 2 ** 31 + b * h * w, dtype=torch.uint8)   # virtual: only 3 rows are touched
    far = buf.as_strided(codes.shape, (h * w, w, 2 ** 30, 1), storage_offset=2 ** 31)
    far.copy_(codes)
    k_block = replace(inp.k_block, tensors={**inp.k_block.tensors, "codes": far})
    assert_matches(replace(inp, k_block=k_block))


def test_paged_decode_prepares_each_page_once_in_one_launch(monkeypatch):
    """Decode steps over a cache growing in pages of 8 rows (as ArtifactCache grows it): every step equals the
    oracle, launches the partial kernel once over all pages, and lays out each full page's arguments once across
    the steps -- only the page still being written is laid out again."""
    from collections import Counter

    from exporters.codec import encode as enc
    from exporters.layout import PagedRows
    from serving import pages as pages_mod
    from serving import triton_attention as ta

    g = torch.Generator().manual_seed(0)
    d, n_sink, b = 16, 2, 1
    k = torch.randn(b, H_KV, 26, d, generator=g) * 2 + torch.randn(1, H_KV, 1, d, generator=g)
    v = torch.randn(b, H_KV, 26, d, generator=g)
    pk, pv = calibrated(FORMATS["nuq3-channel-5pct"], k), calibrated(FORMATS["nuq3-token-2pct"], v)
    pages = PagedRows(pk, 8), PagedRows(pv, 8)

    def write(a, z):  # rows a..z-1, a page at most at a time
        while a < z:
            n = min(z - a, pages[0].room())
            for rows, p, x in zip(pages, (pk, pv), (k, v)):
                rows.write(store(enc(x[:, :, a:a + n], p), p, n_sink + a))
            a += n

    laid_out, launches = Counter(), []
    real_side, real_kernel = pages_mod.side_args, ta._decode_partial_kernel

    def side_args(block, *a, **kw):
        laid_out[block.start, block.shape[2]] += 1
        return real_side(block, *a, **kw)

    class Launches:
        def __getitem__(self, grid):
            launches.append(grid)
            return real_kernel[grid]

    monkeypatch.setattr(pages_mod, "side_args", side_args)
    monkeypatch.setattr(ta, "_decode_partial_kernel", Launches())
    sink = tuple(torch.randn(b, H_KV, n_sink, d, generator=g).half() for _ in range(2))
    write(0, 18)                                        # pages at 2 and 10 full, the one at 18 open
    for t in range(18, 24):                             # the open page fills at the 6th step
        write(t, t + 1)
        inp = DecodeInputs(q=torch.randn(b, H_KV * GROUP, d, generator=g) * 2, scaling=d ** -0.5, key_policy=pk,
                           value_policy=pv, key_rope="pre", rotary=rotary(d), sink=sink,
                           k_block=pages[0].view(), v_block=pages[1].view())
        assert len(inp.k_block.pages) == 3
        assert_matches(inp)
    full = {key: n for key, n in laid_out.items() if key[1] == 8}
    assert full == {(2, 8): 2, (10, 8): 2, (18, 8): 2}, laid_out   # K and V of each full page, once
    assert len(launches) == 6, launches                             # one launch per step, all pages in it


def test_kernels_launch_on_the_device_of_their_tensors(monkeypatch):
    """A launch runs under the device guard of its tensors' device (a layer on cuda:1 while cuda:0 is current)."""
    import contextlib

    from serving import triton_attention as ta

    guard = ta._on_device(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert isinstance(ta._on_device(torch.device("cpu")), contextlib.nullcontext)
    seen = []
    monkeypatch.setattr(ta, "_on_device", lambda device: seen.append(device) or contextlib.nullcontext())
    decode_attention(make_inputs(FORMATS["fp16"], FORMATS["fp16"], n_q=4, key_rope="post"))
    assert seen == [torch.device("cpu")]


def test_the_merge_steps_over_the_items_in_blocks():
    """The merge reads a row's partials S_BLOCK at a time, rescaling by the running max: 7 items in blocks of 2,
    an empty item among them, equal the one-pass softmax merge."""
    from serving import triton_attention as ta

    g = torch.Generator().manual_seed(0)
    rows, n, d = 3, 7, 16
    po, pm = torch.randn(rows, n, d, generator=g), torch.randn(rows, n, generator=g) * 4
    pl = torch.rand(rows, n, generator=g) + 0.5
    pm[0, 3], pl[0, 3], po[0, 3] = -1.0e30, 0.0, 0.0          # an item with no rows, as the kernel writes it
    out = torch.empty(rows, d)
    ta._combine_kernel[(rows,)](po, pm, pl, out, out, n, S_BLOCK=2, D=d, SPLIT=0)
    w = torch.exp2(pm - pm.amax(1, keepdim=True))
    total = (w * pl).sum(1, keepdim=True)
    torch.testing.assert_close(out, (w[..., None] * po).sum(1) / total)
    # SPLIT: item 0 (the fp16 rows alone) summed apart from the others, over the same sum
    enc, fp = torch.empty(rows, d), torch.empty(rows, d)
    ta._combine_kernel[(rows,)](po, pm, pl, enc, fp, n, S_BLOCK=2, D=d, SPLIT=1)
    torch.testing.assert_close(fp, w[:, 0, None] * po[:, 0] / total)
    torch.testing.assert_close(enc, (w[:, 1:, None] * po[:, 1:]).sum(1) / total)
