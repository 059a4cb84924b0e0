"""The codec's newest vLLM formats (docs/peer-formats.md): UltraQuant's `ultra_fp4` / `ultra_fp4_rot` on rows computed
by hand (FP4 levels, the power-of-two scale and its snap, the tie rule, zero groups, the bits per element, the refusal
to export), `decode_rotated`, the Hadamard butterfly the int4 and UltraQuant rotations now use, and the int4 format's
fp16 overflow stored as vLLM stores it. bench/vllm_formats_check.py compares the same code with vLLM's own."""
import pytest
import torch

from exporters import manifest as mf
from exporters import rotation
from exporters.codec import (CachePolicy, CodecError, TensorPolicy, check_exportable, export_refusal, decode,
                             decode_rotated, encode, encoded_bits, rht_scale_and_zero, stored_bits, ultra_scales)
from pipeline.config import load_recipe
from stages import recipe

V4 = TensorPolicy(format="ultra_fp4", bits=4, axis="token")
K4 = TensorPolicy(format="ultra_fp4_rot", bits=4, axis="token")


def row(values, d=32):
    """One (token, head) row [1, 1, 1, d], zero-padded."""
    return torch.tensor(list(values) + [0.0] * (d - len(values)))[None, None, None]


def flat(t):
    return t.flatten().tolist()


# ---- ultra_fp4: FP4 codes, UE8M0 scales -------------------------------------------------------------------

def test_fp4_codes_and_their_values_by_hand():
    # amax 6: s_raw = 0.156 * 6 = 0.936, log2 = -0.095, floor(-0.095 + 0.5) = 0: s = 1, byte 127, x / s = x
    x = row([6.0, -6.0, 2.5, 5.0, -5.0, 1.1, 3.4, 0.0, -0.0])
    e = encode(x, V4)
    assert e.scale.dtype == torch.uint8 and flat(e.scale) == [127]
    # bit patterns: sign in bit 3, magnitude index in bits 0-2 of (0, .5, 1, 1.5, 2, 3, 4, 6)
    assert flat(e.codes)[:9] == [7, 15, 4, 6, 15, 2, 5, 0, 0]
    # 2.5 and 5 are ties (midpoints of 2|3 and 4|6): they go to the lower level; -5 too, which is -6
    assert flat(decode(e, V4))[:9] == [6.0, -6.0, 2.0, 4.0, -6.0, 1.0, 3.0, 0.0, 0.0]


def test_a_tie_goes_to_the_lower_level_toward_zero_above_it_and_away_below():
    e = encode(row([6.0, 0.25, -0.25, 0.75, -0.75, 1.75, -1.25]), V4)
    assert flat(decode(e, V4))[:7] == [6.0, 0.0, -0.5, 0.5, -1.0, 1.5, -1.5]


def test_the_scale_is_a_power_of_two_and_the_amax_saturates():
    # amax 1: 0.156 -> log2 -2.68 -> floor(-2.18) = -3: s = 1/8 (byte 124), 1 / s = 8 clips to the top level 6
    e = encode(torch.ones(1, 1, 1, 32), V4)
    assert flat(e.scale) == [124] and set(flat(e.codes)) == {7}
    assert set(flat(decode(e, V4))) == {0.75}
    assert flat(ultra_scales(torch.tensor([0, 124, 127, 130], dtype=torch.uint8))) == [0.0, 0.125, 1.0, 8.0]


def test_the_log2_snap_rounds_half_up():
    # s_raw = 0.156 * amax on either side of 2^-0.5 (0.7071): e = -1 below, 0 from there on
    below, above = 0.70 / 0.156, 0.72 / 0.156
    assert flat(encode(row([below]), V4).scale) == [126] and flat(encode(row([above]), V4).scale) == [127]


def test_an_all_zero_group_stores_byte_zero_and_codes_plus_zero():
    x = row([3.0] + [0.0] * 31 + [0.0] * 32, d=64)     # group 0 non-zero, group 1 all zero
    e = encode(x, V4)
    assert e.scale.shape == (1, 1, 1, 2) and flat(e.scale)[1] == 0
    assert flat(e.codes)[32:] == [0] * 32 and flat(decode(e, V4))[32:] == [0.0] * 32


# ---- ultra_fp4_rot: the keys, Hadamard-rotated first ----------------------------------------------------------

def test_rotated_keys_by_hand():
    # x = 4 e_0 at D = 64: y = H x / 8 = 0.5 everywhere (the butterfly's float32 1/sqrt(2) six times, within an ulp);
    # 0.156 * 0.5 -> log2 -3.68 -> e = -4: s = 1/16 (byte 123), y / s = 8 clips to 6: y^ = 0.375, x^ = 3 e_0
    x = torch.zeros(1, 1, 1, 64)
    x[..., 0] = 4.0
    e = encode(x, K4)
    assert set(flat(e.scale)) == {123} and set(flat(e.codes)) == {7}
    assert set(flat(decode_rotated(e, K4))) == {0.375}
    want = torch.zeros(64)
    want[0] = 3.0
    assert torch.allclose(decode(e, K4).flatten(), want, atol=1e-6)


def test_rotated_keys_are_the_value_format_of_the_rotated_row():
    x = torch.randn(1, 2, 5, 128, generator=torch.Generator().manual_seed(0)).half().float()
    e, ev = encode(x, K4), encode(rotation.fwht_orthonormal(x), V4)
    assert torch.equal(e.codes, ev.codes) and torch.equal(e.scale, ev.scale)
    assert torch.equal(decode_rotated(e, K4), decode(ev, V4))
    assert torch.equal(decode(e, K4), rotation.fwht_orthonormal(decode_rotated(e, K4)))
    assert ((decode(e, K4) - x).norm() / x.norm()) < 0.2


@pytest.mark.parametrize("p", [V4, K4], ids=lambda p: p.format)
@pytest.mark.parametrize("d", [48, 16])
def test_the_head_dim_must_be_a_power_of_two_of_at_least_32(p, d):
    with pytest.raises(CodecError, match=rf"layer 4 keys: format {p.format} needs a power-of-two head_dim of at least "
                                         rf"32 .* got D={d}"):
        encode(torch.ones(1, 1, 2, d), p, "layer 4 keys")


@pytest.mark.parametrize("p", [V4, K4], ids=lambda p: p.format)
def test_four_and_a_quarter_bits_per_element(p):
    # 4-bit codes and one UE8M0 byte per 32 channels: 4 + 8 / 32 at any D
    for d in (64, 128, 256):
        assert stored_bits(p, 2, 3, 5, d) == 4.25 * 2 * 3 * 5 * d
    x = torch.randn(1, 2, 3, 64, generator=torch.Generator().manual_seed(1))
    assert encoded_bits(encode(x, p), p) == 4.25 * 2 * 3 * 64


@pytest.mark.parametrize("p", [V4, K4], ids=lambda p: p.format)
def test_ultraquant_is_evaluation_only(p):
    assert export_refusal(p, "key") is not None and export_refusal(p, "value") is not None
    with pytest.raises(CodecError, match=rf"layer 1 keys: format {p.format} with axis token is evaluation-only.*"
                                         r"take fp16 \(axis tensor\); uniform .*got format="):
        check_exportable(p, "layer 1 keys", "key")
    with pytest.raises(mf.QuantFieldError, match=rf"layers/1/key/format: the artifact allows format/axis .* got "
                                                  rf"format '{p.format}' with axis 'token'"):
        mf.build_manifest(CachePolicy("uq", [(TensorPolicy(), TensorPolicy()), (p, V4)]), spec=None, provenance={})


@pytest.mark.parametrize("policy,pattern", [
    (TensorPolicy(format="ultra_fp4", bits=3, axis="token"), r"bits must be one of \(4,\), got 3 \(format ultra_fp4\)"),
    (TensorPolicy(format="ultra_fp4_rot", bits=4, axis="channel"), r"axis for format ultra_fp4_rot must be one of "
                                                                    r"\('token',\), got 'channel'"),
    (TensorPolicy(format="ultra_fp4", bits=4, axis="token", rotation="hadamard"), r"rotation applies to formats "
                                                                                  r"\('uniform', 'nuq'\) only"),
])
def test_bad_ultraquant_policies_name_the_field(policy, pattern):
    with pytest.raises(CodecError, match=pattern):
        encode(torch.zeros(1, 1, 2, 32), policy, "layer 3 keys")


def test_the_recipe_resolves_with_fp16_boundary_layers():
    q = load_recipe("vllm-ultraquant-4bit")
    assert (q.key.format, q.value.format) == ("ultra_fp4_rot", "ultra_fp4")
    assert (q.key_rope, q.full_precision_layers) == ("post", 2)
    layers = recipe.build_policy(q, 6, {}).layers
    assert [k.format for k, _ in layers] == ["fp16", "fp16", "ultra_fp4_rot", "ultra_fp4_rot", "fp16", "fp16"]
    with pytest.raises(CodecError, match=r"quant\.key: format ultra_fp4_rot with axis token is evaluation-only"):
        recipe.check_exportable_recipe(q)


# ---- decode_rotated ---------------------------------------------------------------------------------------

def test_decode_rotated_is_the_row_vllm_reads():
    rht4 = TensorPolicy(format="rht_int", bits=4, axis="token")
    x = torch.tensor([[[[3.125, 4.625, 1.375, -2.875]]]])      # rotated: [-3, 12, 0, 3.5]; s = 1, zp = 3
    e = encode(x, rht4)
    assert flat(decode_rotated(e, rht4)) == [-3.0, 12.0, 0.0, 4.0]
    with pytest.raises(CodecError, match=r"decode_rotated: format int_sym stores no rotated row; allowed formats "
                                         r"\('rht_int', 'turbo_mse', 'ultra_fp4_rot'\), got 'int_sym'"):
        p = TensorPolicy(format="int_sym", bits=8, axis="token")
        decode_rotated(encode(x, p), p)


# ---- the butterfly and the int4 overflow ----------------------------------------------------------------------

def test_the_butterfly_by_hand():
    # H_4 [1, 2, 3, 4] = [1+2+3+4, 1-2+3-4, 1+2-3-4, 1-2-3+4]
    assert flat(rotation.fwht(torch.tensor([1.0, 2.0, 3.0, 4.0]))) == [10.0, -2.0, -4.0, 0.0]
    assert flat(rotation.fwht_orthonormal(torch.tensor([1.0, 1.0]))) == [1.4142135381698608, 0.0]
    x = torch.randint(-50, 50, (3, 128), generator=torch.Generator().manual_seed(2)).float()
    assert torch.equal(rotation.fwht(x), x @ rotation.hadamard(128))   # integers: exact either way
    with pytest.raises(ValueError, match="power-of-two size, got 12"):
        rotation.fwht(torch.ones(12))


def test_int4_stores_an_fp16_overflow_as_vllm_does():
    # |H_64 (d * x)| reaches 64 * 2e4 > 65504: the fp16 rotated row holds inf, s = inf; vLLM converts the NaN that
    # -min / s gives to an integer before clamping, so the zero point and every code are 0 and the scale is inf
    x = torch.full((1, 1, 1, 64), 2.0e4)
    assert rotation.rht(x).abs().max() > 65504
    p = TensorPolicy(format="rht_int", bits=4, axis="token")
    e = encode(x, p)
    assert flat(e.scale.view(torch.int32)) == [0x7F800000] and set(flat(e.codes)) == {0}
    s, zp = rht_scale_and_zero(e.scale)
    assert flat(s) == [float("inf")] and flat(zp) == [0.0]
