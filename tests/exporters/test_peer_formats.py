"""The evaluation-only formats of exporters/codec.py (vLLM 0.32's own KV caches, docs/peer-formats.md): encode /
decode on tiny rows with hand-computed answers, the rounding rules, the size model against the spec's table, and
the refusal to export them."""
import math

import pytest
import torch

from exporters import manifest as mf
from exporters.codec import (CachePolicy, CodecError, TensorPolicy, check_exportable, export_refusal, decode, encode,
                             encoded_bits, fake_quant, rht_scale_and_zero, stored_bits, turbo_codebook)
from exporters.rotation import hadamard_orthonormal, rht, rht_inverse

INT8 = TensorPolicy(format="int_sym", bits=8, axis="token")
INT4_SYM = TensorPolicy(format="int_sym", bits=4, axis="token")
FP8_TOKEN = TensorPolicy(format="fp8", bits=8, axis="token")
FP8_RAW = TensorPolicy(format="fp8", bits=8, axis="unscaled")
RHT4 = TensorPolicy(format="rht_int", bits=4, axis="token")
MSE3 = TensorPolicy(format="turbo_mse", bits=3, axis="token")
MSE3_NC = TensorPolicy(format="turbo_mse", bits=3, axis="token", norm_correction=True)
MSE4_NC = TensorPolicy(format="turbo_mse", bits=4, axis="token", norm_correction=True)
TV3 = TensorPolicy(format="turbo_uniform", bits=3, axis="token")
TV4 = TensorPolicy(format="turbo_uniform", bits=4, axis="token")
PEER = [INT8, INT4_SYM, FP8_TOKEN, FP8_RAW, RHT4, MSE3, MSE3_NC, MSE4_NC, TV3, TV4]


def t4(rows):  # [T, D] -> [1, 1, T, D]
    return torch.tensor(rows, dtype=torch.float32)[None, None]


def flat(t):
    return t.flatten().tolist()


# ---- int_sym (vLLM int8_per_token_head) -------------------------------------------------------------------

def test_int8_rounds_half_away_from_zero():
    # amax 127: scale exactly 1, so x * (1/s) is x; torch.round would give 2, -2, 0, -0, -126 on the ties
    x = t4([[127.0, 2.5, -2.5, 0.5, -0.5, 1.49, -126.5, 0.0]])
    e = encode(x, INT8)
    assert e.codes.dtype == torch.int8 and flat(e.codes) == [127, 3, -3, 1, -1, 1, -127, 0]
    assert e.scale.dtype == torch.float32 and flat(e.scale) == [1.0]
    assert flat(decode(e, INT8)) == [127.0, 3.0, -3.0, 1.0, -1.0, 1.0, -127.0, 0.0]


def test_int8_scale_is_amax_over_127_in_fp32():
    x = t4([[63.5, 0.25, -0.75, 10.0]])            # s = 0.5 exactly: codes 127, 0.5 -> 1, -1.5 -> -2, 20
    e = encode(x, INT8)
    assert flat(e.scale) == [0.5] and flat(e.codes) == [127, 1, -2, 20]
    assert flat(decode(e, INT8)) == [63.5, 0.5, -1.0, 10.0]


def test_int4_symmetric_uses_qmax_7():
    e = encode(t4([[7.0, 3.5, -3.5, -0.5]]), INT4_SYM)
    assert flat(e.scale) == [1.0] and flat(e.codes) == [7, 4, -4, -1]


# ---- fp8 per (token, head) and unscaled ---------------------------------------------------------------------

def test_fp8_per_token_scale_and_rounding():
    x = t4([[896.0, 3.0, -0.6, 0.0], [448.0, 1.0, -0.3, 0.0]])   # s = 2 and 1
    e = encode(x, FP8_TOKEN)
    assert flat(e.scale) == [2.0, 1.0] and e.dense.dtype == torch.float8_e4m3fn
    # e4m3 has 3 mantissa bits: 0.3 lies between 0.28125 and 0.3125 and goes to the nearer one
    assert flat(decode(e, FP8_TOKEN)) == [896.0, 3.0, -0.625, 0.0, 448.0, 1.0, -0.3125, 0.0]


def test_fp8_unscaled_casts_directly_and_saturates():
    x = t4([[1000.0, -1000.0, 0.3, 448.0]])
    e = encode(x, FP8_RAW)
    assert e.scale is None and flat(decode(e, FP8_RAW)) == [448.0, -448.0, 0.3125, 448.0]


# ---- rht_int (vLLM int4_per_token_head) --------------------------------------------------------------------

def test_rht_int4_by_hand():
    # chosen so that y = H_4 (d * x) = [-3, 12, 0, 3.5] with signs d = +-++: s = 15 / 15 = 1, zp = 3,
    # codes = y + 3 = [0, 15, 3, 6.5 -> 7] (half away; half-to-even would give 6)
    x = t4([[3.125, 4.625, 1.375, -2.875]])
    assert flat(rht(x)) == [-3.0, 12.0, 0.0, 3.5]
    e = encode(x, RHT4)
    assert flat(e.codes) == [0, 15, 3, 7]
    assert e.scale.dtype == torch.float32 and flat(e.scale.view(torch.int32)) == [0x3F800000 | 3]
    s, zp = rht_scale_and_zero(e.scale)
    assert flat(s) == [1.0] and flat(zp) == [3.0]
    # y^ = codes - 3 = [-3, 12, 0, 4] -> x^ = d * (H_4 y^) / 4
    assert flat(decode(e, RHT4)) == [3.25, 4.75, 1.25, -2.75]


def test_rht_int4_zero_point_rides_in_the_scales_low_bits():
    x = (torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(3)) * 3).half().float()
    e = encode(x, RHT4)
    y = rht(x).half().float()
    mn, mx = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
    s = ((mx - mn) / 15).clamp_min(1e-6)
    zp = torch.where(-mn / s >= 0, -mn / s + 0.5, -mn / s - 0.5).trunc().clamp(0, 15)
    stored = e.scale.view(torch.int32)
    assert torch.equal(stored & 0xF, zp.to(torch.int32))
    assert torch.equal(stored & ~0xF, s.view(torch.int32) & ~0xF)
    assert not torch.equal(stored & 0xF, s.view(torch.int32) & 0xF)   # the low bits did change somewhere
    truncated, _ = rht_scale_and_zero(e.scale)
    assert torch.equal(decode(e, RHT4), rht_inverse(truncated * (e.codes.float() - zp)))
    assert ((decode(e, RHT4) - x).norm() / x.norm()) < 0.15


def test_rht_int4_rounds_the_rotated_row_to_fp16():
    x = t4([[0.1, 0.2, 0.3, 0.4001]])
    y = rht(x)
    assert not torch.equal(y, y.half().float())   # the rotation leaves non-fp16 values ...
    e = encode(x, RHT4)
    s, zp = rht_scale_and_zero(e.scale)
    yq = y.half().float()                          # ... and the codes are those of the fp16 copy
    s_full = ((yq.amax() - yq.amin()) / 15).clamp_min(1e-6)
    assert torch.equal(s.view(torch.int32), s_full.view(torch.int32).reshape(1, 1, 1, 1) & ~0xF)


# ---- turbo_mse (TurboQuant keys) ---------------------------------------------------------------------------

def test_turbo_mse_by_hand_for_d4():
    # x = [2, 0, 0, 0]: |x| = 2, u = (H/2) [1, 0, 0, 0] = [0.5] * 4, which lies between the 3-bit levels
    # 0.7556 / sqrt(4) and 1.3432 / sqrt(4) but below their midpoint 0.5247: code 5 everywhere
    levels, mids = turbo_codebook(3, 4)
    assert abs(float(levels[5]) * 2 - 0.755646) < 1e-5 and float(mids[5]) > 0.5
    x = t4([[2.0, 0.0, 0.0, 0.0]])
    e = encode(x, MSE3_NC)
    assert flat(e.codes) == [5, 5, 5, 5] and e.scale.dtype == torch.float16 and flat(e.scale) == [2.0]
    # norm correction: v = [0.5] * 4 (unit norm), x^ = (H/2) (2 v) = [2, 0, 0, 0] exactly
    assert torch.allclose(decode(e, MSE3_NC), x, atol=1e-6)
    # without it: x^ = (H/2) (2 * c5 * [1, 1, 1, 1]) = [4 c5, 0, 0, 0]
    assert torch.allclose(decode(encode(x, MSE3), MSE3), t4([[4 * float(levels[5]), 0.0, 0.0, 0.0]]), atol=1e-6)


def test_turbo_mse_ties_go_to_the_upper_level():
    # x = [1, 1, 1, 1]: u = (H/2) [0.5] * 4 = [1, 0, 0, 0]; 0 is the middle midpoint exactly, so code 4 (not 3)
    e = encode(t4([[1.0, 1.0, 1.0, 1.0]]), MSE3)
    assert flat(e.codes) == [7, 4, 4, 4]


def test_turbo_mse_norm_correction_keeps_the_key_norm():
    x = (torch.randn(2, 3, 7, 64, generator=torch.Generator().manual_seed(4)) * 2).half().float()
    for p in (MSE3_NC, MSE4_NC):
        e = encode(x, p)
        norm = x.norm(dim=-1)
        assert torch.allclose(decode(e, p).norm(dim=-1), e.scale.float()[..., 0], rtol=1e-5)   # |x^| = fp16(|x|)
        assert torch.allclose(decode(e, p).norm(dim=-1), norm, rtol=2 ** -11)
    plain = decode(encode(x, MSE3), MSE3).norm(dim=-1)
    assert (plain / x.norm(dim=-1) - 1).abs().max() > 1e-3    # without nc the norm drifts


def test_turbo_mse_quantizes_in_the_rotated_domain():
    x = torch.randn(1, 1, 3, 8, generator=torch.Generator().manual_seed(5))
    e = encode(x, MSE4_NC)
    u = (x / (x.norm(dim=-1, keepdim=True) + 1e-8)) @ hadamard_orthonormal(8)
    _, mids = turbo_codebook(4, 8)
    assert torch.equal(e.codes.long(), torch.bucketize(u, mids, right=True))


def test_turbo_mse_needs_a_power_of_two_head_dim():
    with pytest.raises(CodecError, match=r"layer 2 keys: format turbo_mse needs a power-of-two head_dim .* got D=12"):
        encode(torch.ones(1, 1, 2, 12), MSE3_NC, "layer 2 keys")


# ---- turbo_uniform (TurboQuant values) ---------------------------------------------------------------------

def test_turbo_uniform_rounds_half_up():
    x = t4([[0.0, 7.0, 3.5, 1.5, 2.5, 0.49, 6.5, 7.0]])      # s = 7 / 7 = 1
    e = encode(x, TV3)
    assert flat(e.codes) == [0, 7, 4, 2, 3, 0, 7, 7]        # 2.5 -> 3 and 6.5 -> 7, where half-to-even goes down
    assert e.scale.dtype == torch.float16 and flat(e.scale) == [1.0] and flat(e.zero) == [0.0]
    assert flat(decode(e, TV3)) == [0.0, 7.0, 4.0, 2.0, 3.0, 0.0, 7.0, 7.0]


def test_turbo_uniform_codes_with_fp32_scale_and_decodes_with_fp16():
    e = encode(t4([[0.0, 1.0, 0.5, 0.25]]), TV4)            # s = 1/15 in fp32: 1.0 -> code 15 exactly
    assert flat(e.codes)[1] == 15
    assert flat(e.scale) == [0.066650390625]                # fp16(1/15)
    assert flat(decode(e, TV4))[1] == 15 * 0.066650390625   # 0.99975586, not 1


# ---- shared edge cases and the size model -------------------------------------------------------------------

@pytest.mark.parametrize("p", PEER, ids=lambda p: f"{p.format}-{p.axis}-{p.bits}{'-nc' if p.norm_correction else ''}")
def test_constant_and_zero_rows_decode_without_nan(p):
    x = t4([[0.0] * 8, [0.1] * 8, [-3.0] * 8])
    y, _ = fake_quant(x, p)
    assert torch.isfinite(y).all()
    assert flat(y[0, 0, 0]) == [0.0] * 8
    if p.format in ("rht_int", "turbo_mse"):
        # a rotation spreads a constant row unevenly over the levels (TurboQuant's even maps it onto one axis,
        # beyond its Gaussian levels): not exact, only bounded
        assert ((y[0, 0, 1:] - x[0, 0, 1:]).norm(dim=-1) < x[0, 0, 1:].norm(dim=-1)).all()
    else:
        assert torch.allclose(y[0, 0, 1:], x[0, 0, 1:], rtol=0.02, atol=1e-3), y


def test_turbo_uniform_constant_row_decodes_to_the_fp16_min():
    e = encode(t4([[0.1, 0.1, 0.1, 0.1]]), TV4)             # scale floored at 1e-8, stored as fp16 0
    assert flat(e.codes) == [0] * 4 and flat(e.scale) == [0.0]
    assert flat(decode(e, TV4)) == [0.0999755859375] * 4


# (policy, bits per element at D=64, at D=128): the spec's table (per K or V element, scales and norms included)
SIZES = [(INT8, 8.5, 8.25), (FP8_TOKEN, 8.5, 8.25), (RHT4, 4.5, 4.25), (FP8_RAW, 8.0, 8.0),
         (MSE4_NC, 4.25, 4.125), (MSE3_NC, 3.25, 3.125), (TV4, 4.5, 4.25), (TV3, 3.5, 3.25)]


@pytest.mark.parametrize("p,at64,at128", SIZES, ids=lambda v: getattr(v, "format", v))
def test_bits_per_element_match_the_spec(p, at64, at128):
    for d, want in ((64, at64), (128, at128)):
        assert stored_bits(p, 2, 3, 5, d) == want * 2 * 3 * 5 * d
        x = torch.randn(1, 2, 3, d, generator=torch.Generator().manual_seed(d))
        assert encoded_bits(encode(x, p), p) == want * 2 * 3 * d


# ---- validation and export refusal --------------------------------------------------------------------------

@pytest.mark.parametrize("policy,pattern", [
    (TensorPolicy(format="int_sym", bits=2, axis="token"), r"bits must be one of \(4, 8\), got 2 \(format int_sym\)"),
    (TensorPolicy(format="rht_int", bits=8, axis="token"), r"bits must be one of \(4,\), got 8"),
    (TensorPolicy(format="turbo_mse", bits=2, axis="token"), r"bits must be one of \(3, 4\), got 2"),
    (TensorPolicy(format="turbo_uniform", bits=3, axis="channel"), r"axis for format turbo_uniform must be one of"),
    (TensorPolicy(format="uniform", bits=4, axis="token", norm_correction=True), r"norm_correction applies to "
                                                                                 r"format turbo_mse only"),
    (TensorPolicy(format="int_sym", bits=8, axis="token", outlier_fraction=0.01), r"format int_sym stores no sparse"),
])
def test_bad_peer_policies_name_the_field(policy, pattern):
    with pytest.raises(CodecError, match=pattern):
        encode(torch.zeros(1, 1, 2, 4), policy, "layer 3 keys")


@pytest.mark.parametrize("p", PEER, ids=lambda p: f"{p.format}-{p.axis}-{p.bits}")
def test_peer_formats_are_not_exportable(p):
    assert export_refusal(p, "key") is not None and export_refusal(p, "value") is not None
    with pytest.raises(CodecError, match=rf"layer 1 keys: format {p.format} with axis {p.axis} is evaluation-only.*"
                                         r"take fp16 \(axis tensor\); uniform \(axis token\|channel\)"):
        check_exportable(p, "layer 1 keys", "key")
    check_exportable(TensorPolicy(format="uniform", bits=4, axis="token"), "fine", "key")


def test_the_manifest_refuses_a_peer_policy():
    policy = CachePolicy("vllm-like", [(TensorPolicy(), TensorPolicy()), (INT8, TV4)])
    with pytest.raises(mf.QuantFieldError, match=r"layers/1/key/format: the artifact allows format/axis .*'fp8': "
                                                  r"\['tensor', 'head'\].* got format 'int_sym' with axis 'token'"):
        mf.build_manifest(policy, spec=None, provenance={})
    layer = {"format": "fp8", "bits": 8, "axis": "token", "group_size": 0, "zero_point": "none", "fp8_dtype": "e4m3",
             "outliers": {"fraction": 0.0, "rule": "none"}, "tensors": {}}
    with pytest.raises(mf.QuantFieldError, match=r"layers/0/key/axis: format fp8 allows \['tensor', 'head'\], got 'token'"):
        mf._check_policy_fields(layer, "layers/0/key", "key")


def test_fake_quant_keeps_the_input_dtype():
    x = torch.randn(1, 2, 3, 16, generator=torch.Generator().manual_seed(6)).half()
    for p in PEER:
        y, _ = fake_quant(x.float(), p)
        assert y.dtype == torch.float32
        assert math.isfinite(float(y.abs().max()))
