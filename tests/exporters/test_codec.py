import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dataclasses

from exporters import codec
from exporters.codec import (CALIBRATED_FIELDS, FORMATS, CodecError, Encoded, Format, TensorPolicy, check_exportable, decode,
                             encode, encoded_bits, export_refusal, fake_quant, fp8_scale_from_amax, pack_codes,
                             static_bits, stored_bits, token_outlier_bounds, unpack_codes)


def t4(rows):  # [T, D] -> [1, 1, T, D]
    return torch.tensor(rows, dtype=torch.float32)[None, None]


def test_uniform_per_token_is_exact_on_its_grid():
    x = t4([[0.0, 1.0, 2.0, 3.0], [10.0, 10.5, 11.0, 11.5]])
    p = TensorPolicy(format="uniform", bits=2, axis="token")
    e = encode(x, p)
    assert e.codes.flatten().tolist() == [0, 1, 2, 3] * 2
    assert e.scale.flatten().tolist() == [1.0, 0.5] and e.zero.flatten().tolist() == [0.0, 10.0]
    assert torch.equal(decode(e, p), x)


def test_uniform_rounds_to_nearest_level():
    x = t4([[0.0, 0.9, 1.6, 3.0]])
    y, _ = fake_quant(x, TensorPolicy(format="uniform", bits=2, axis="token"))
    assert y.flatten().tolist() == [0.0, 1.0, 2.0, 3.0]


def test_uniform_per_channel_groups_of_tokens():
    # two channels, three tokens, groups of 2 tokens: group 0 = tokens 0-1, group 1 = token 2 alone
    x = t4([[0.0, 5.0], [3.0, 5.0], [7.0, -1.0]])
    p = TensorPolicy(format="uniform", bits=2, axis="channel", group_size=2)
    e = encode(x, p)
    assert e.scale.shape == (1, 1, 2, 2)
    assert e.scale[0, 0].tolist() == [[1.0, 0.0], [0.0, 0.0]]  # channel 1 constant in group 0; group 1 one token
    assert torch.equal(decode(e, p), x)


def test_constant_rows_and_channels_encode_exactly():
    x = torch.full((1, 2, 5, 4), 3.25)
    for p in (TensorPolicy(format="uniform", bits=4, axis="token"),
              TensorPolicy(format="uniform", bits=2, axis="channel", group_size=4),
              TensorPolicy(format="nuq", bits=2, axis="token", codebook=torch.tensor([-1.0, -0.3, 0.3, 1.0])),
              TensorPolicy(format="nuq", bits=2, axis="channel", codebook=torch.tensor([-1.0, -0.3, 0.3, 1.0]),
                           zero=torch.full((2, 4), 3.25), range=torch.zeros(2, 4))):
        y, _ = fake_quant(x, p)
        assert torch.equal(y, x), p.format + "/" + p.axis


def test_nuq_per_channel_hand_checked():
    book = torch.tensor([-1.0, -0.5, 0.5, 1.0])
    p = TensorPolicy(format="nuq", bits=2, axis="channel", codebook=book, zero=torch.tensor([[1.0, 0.0]]),
                     range=torch.tensor([[2.0, 4.0]]))
    # channel 0: xn = (x - 1) / 2 ; channel 1: xn = x / 4
    x = t4([[2.0, -1.0], [-5.0, 3.2]])  # xn: [0.5, -0.25], [-3 -> clamp -1, 0.8]
    e = encode(x, p)
    assert e.codes.flatten().tolist() == [2, 1, 0, 3]  # -0.25 is nearer -0.5 than 0.5
    assert decode(e, p).flatten().tolist() == [2.0, -2.0, -1.0, 4.0]


def test_nuq_per_token_uses_midpoint_and_half_range():
    book = torch.tensor([-1.0, -0.5, 0.5, 1.0])
    x = t4([[0.0, 1.0, 3.0, 4.0]])  # zero = 2, range = 2: xn = -1, -0.5, 0.5, 1
    y, e = fake_quant(x, TensorPolicy(format="nuq", bits=2, axis="token", codebook=book))
    assert torch.equal(y, x) and e.zero.item() == 2.0 and e.scale.item() == 2.0


def test_sparse_channel_outliers_are_kept_exactly():
    book = torch.tensor([-1.0, 1.0])
    p = TensorPolicy(format="nuq", bits=2, axis="channel", codebook=torch.tensor([-1.0, -0.3, 0.3, 1.0]),
                     zero=torch.zeros(1, 1), range=torch.ones(1, 1), outlier_fraction=0.01,
                     lower=torch.full((1, 1), -1.0), upper=torch.ones(1, 1))
    x = t4([[0.3], [50.0], [-1.0], [-7.5]])
    y, e = fake_quant(x, p)
    assert e.n_outliers == 2 and e.outlier_index[:, 2].tolist() == [1, 3]
    assert y.flatten().tolist() == pytest.approx([0.3, 50.0, -1.0, -7.5])
    del book


def test_token_outlier_rule_over_all_heads():
    x = torch.zeros(1, 2, 1, 100)
    x[0, 0, 0, :] = torch.linspace(-1, 1, 100)
    x[0, 1, 0, :] = torch.linspace(-1, 1, 100)
    x[0, 1, 0, 7] = 300.0  # one huge value in head 1
    lo, hi = token_outlier_bounds(x, 0.01)
    assert lo.shape == (1, 1, 1, 1) and hi.item() < 300.0
    book = torch.linspace(-1, 1, 16)
    y, e = fake_quant(x, TensorPolicy(format="nuq", bits=4, axis="token", codebook=book, outlier_fraction=0.01))
    assert y[0, 1, 0, 7].item() == 300.0
    assert 1 <= e.n_outliers <= 4  # 1% of 200 entries -> about 2 (one per tail)
    assert (y - x).abs().max() < 0.2


def test_fp8_per_tensor_and_per_head():
    x = torch.randn(1, 3, 16, 8, generator=torch.Generator().manual_seed(0)) * torch.tensor([1.0, 10.0, 100.0])[None, :, None, None]
    amax = x.abs().amax()
    p = TensorPolicy(format="fp8", bits=8, axis="tensor", fp8_scale=fp8_scale_from_amax(amax))
    y, e = fake_quant(x, p)
    assert e.dense.dtype == torch.float8_e4m3fn
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal spacing 2^-9 x scale
    scale = p.fp8_scale
    assert ((y - x).abs() <= x.abs() * 2 ** -4 + scale * 2 ** -10 + 1e-7).all()
    # a head 1e5 x smaller than the largest falls into fp8's subnormal range under one per-tensor scale
    x[0, 0] *= 1e-4
    amax = x.abs().amax()
    y, _ = fake_quant(x, TensorPolicy(format="fp8", bits=8, axis="tensor", fp8_scale=fp8_scale_from_amax(amax)))
    head = TensorPolicy(format="fp8", bits=8, axis="head", fp8_scale=fp8_scale_from_amax(x.abs().amax((0, 2, 3))))
    yh, _ = fake_quant(x, head)
    rel = lambda a: ((a - x)[0, 0].abs() / x[0, 0].abs()).median()
    assert rel(yh) < 2 ** -4 < rel(y)  # the small head gets its own scale


def test_fp8_toward_zero_is_vllm_cpus_cast_by_hand():
    # e4m3 near 1: 1, 1.125, 1.25; near 3.5: 3.5, 3.75; smallest subnormal 2^-9, next 2^-8
    y = t4([[1.06, 1.124, 1.126, -1.06, 3.5, 448.0, 0.0039, 0.0019, -0.0039]])
    one = torch.tensor(1.0)
    nearest = TensorPolicy(format="fp8", bits=8, axis="tensor", fp8_scale=one)
    toward = dataclasses.replace(nearest, fp8_rounding="toward_zero")
    assert fake_quant(y, toward)[0].flatten().tolist() == [1.0, 1.0, 1.125, -1.0, 3.5, 448.0, 2 ** -9, 0.0, -2 ** -9]
    assert fake_quant(y, nearest)[0].flatten().tolist() == [1.0, 1.125, 1.125, -1.0, 3.5, 448.0, 2 ** -8, 2 ** -9,
                                                           -2 ** -8]
    # never away from zero, never more than one code from the nearest
    x = torch.randn(1, 2, 64, 32, generator=torch.Generator().manual_seed(3)) * 5
    yt, yn = fake_quant(x, toward)[0], fake_quant(x, nearest)[0]
    assert (yt.abs() <= x.abs()).all() and (yt.abs() <= yn.abs()).all() and (yt * x >= 0).all()


def test_fp8_toward_zero_is_evaluation_only():
    p = TensorPolicy(format="fp8", bits=8, axis="tensor", fp8_rounding="toward_zero", fp8_scale=torch.tensor(1.0))
    assert export_refusal(p, "key") is not None and export_refusal(p, "value") is not None
    with pytest.raises(CodecError, match="fp8_rounding: rounding toward_zero is evaluation-only"):
        check_exportable(p, "layers[0].key", "key")
    with pytest.raises(CodecError, match=r"fp8_rounding must be one of \('nearest', 'toward_zero'\), got 'up'"):
        TensorPolicy(format="fp8", bits=8, fp8_rounding="up").validate_config()
    with pytest.raises(CodecError, match="fp8_rounding applies to format fp8 only"):
        TensorPolicy(format="uniform", bits=4, axis="token", fp8_rounding="toward_zero").validate_config()


def test_fp8_scale_never_zero():
    assert fp8_scale_from_amax(torch.zeros(3)).tolist() == [1.0, 1.0, 1.0]
    assert fp8_scale_from_amax(torch.tensor(448.0)).item() == 1.0


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([2, 3, 4, 8]), d=st.integers(1, 70), rows=st.integers(1, 4), seed=st.integers(0, 999))
def test_pack_unpack_round_trip(bits, d, rows, seed):
    codes = torch.randint(0, 2 ** bits, (rows, d), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (rows, -(-d * bits // 8))
    assert torch.equal(unpack_codes(packed, bits, d), codes)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_matches_a_big_integer_reference(bits):
    """Element i at bits [i*b, (i+1)*b) of a little-endian byte stream, checked against Python integers."""
    codes = torch.randint(0, 2 ** bits, (3, 37), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    n_bytes = -(-37 * bits // 8)
    for row, packed in zip(codes.tolist(), pack_codes(codes, bits).tolist()):
        value = sum(c << (i * bits) for i, c in enumerate(row))
        assert bytes(packed) == value.to_bytes(n_bytes, "little")


def test_pack_layout_is_little_endian():
    assert pack_codes(torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8), 2).tolist() == [[1 | 2 << 2 | 3 << 4]]


def test_ledger_hand_checked():
    x = torch.randn(1, 1, 2, 4)
    p = TensorPolicy(format="uniform", bits=4, axis="token")
    e = encode(x, p)
    assert encoded_bits(e, p) == 8 * 4 + 2 * 2 * 16  # codes + (scale, zero) per token in fp16
    book = TensorPolicy(format="nuq", bits=2, axis="channel", codebook=torch.tensor([-1.0, -0.3, 0.3, 1.0]),
                        zero=torch.zeros(1, 4), range=torch.ones(1, 4))
    assert static_bits(book) == (4 + 4 + 4) * 32  # float32 codebook, zero and range


def test_size_model_counts_whole_bytes_per_row_and_scale_groups():
    # 5 channels at 3 bits: 15 bits of codes, stored as 2 whole bytes per (token, head) row
    p = TensorPolicy(format="uniform", bits=3, axis="token")
    assert stored_bits(p, 1, 2, 3, 5) == 2 * 3 * (16 + 2 * 16)
    # per-channel groups: a partial last group counts by default (encode makes one), whole groups when given
    kivi = TensorPolicy(format="uniform", bits=2, axis="channel", group_size=4)
    assert stored_bits(kivi, 1, 1, 6, 8) == 6 * 16 + 2 * 8 * 2 * 16
    assert stored_bits(kivi, 1, 1, 6, 8, n_groups=1) == 6 * 16 + 1 * 8 * 2 * 16
    e = encode(torch.randn(1, 1, 6, 8), kivi)
    assert encoded_bits(e, kivi) == stored_bits(kivi, 1, 1, 6, 8)
    # outliers: fp16 value + 16-bit index each, a 16-bit count per token row; expected counts may be fractional
    out = TensorPolicy(format="nuq", bits=4, axis="token", outlier_fraction=0.05, codebook=torch.linspace(-1, 1, 16))
    assert stored_bits(out, 2, 1, 3, 8, n_outliers=1.5) == 2 * 3 * (32 + 32) + 2 * 3 * 16 + 1.5 * 32
    assert stored_bits(TensorPolicy(), 2, 3, 4, 5) == 2 * 3 * 4 * 5 * 16


def test_calibrated_fields_are_the_policy_tensors():
    tensor_fields = tuple(f.name for f in dataclasses.fields(TensorPolicy) if "Tensor" in str(f.type))
    assert tensor_fields == CALIBRATED_FIELDS
    p = TensorPolicy(format="fp8", bits=8, axis="tensor", fp8_scale=torch.tensor(0.5))
    assert list(p.calibrated()) == ["fp8_scale"] and TensorPolicy().calibrated() == {}


@pytest.mark.parametrize("policy,pattern", [
    (TensorPolicy(format="uniform", bits=5, axis="token"), r"bits must be one of \(2, 3, 4, 8\), got 5"),
    (TensorPolicy(format="uniform", bits=4, axis="token", outlier_fraction=0.2), r"outlier_fraction must be in \[0, 0.1\], got 0.2"),
    (TensorPolicy(format="int", bits=4), r"format must be one of"),
    (TensorPolicy(format="uniform", bits=4, axis="head"), r"axis for format uniform must be one of"),
    (TensorPolicy(format="fp8", bits=8, axis="tensor"), r"fp8 needs a calibrated fp8_scale"),
    (TensorPolicy(format="nuq", bits=2, axis="token", codebook=torch.tensor([0.0, 0.0, 1.0, 2.0])), r"strictly increasing"),
    (TensorPolicy(format="nuq", bits=3, axis="token", codebook=torch.zeros(4)), r"2\^bits = 8 levels, got 4"),
    (TensorPolicy(format="uniform", bits=2, axis="channel"), r"group_size must be >= 1"),
    (TensorPolicy(format="fp8", bits=4, axis="tensor"), r"bits must be one of \(8,\), got 4 \(format fp8\)"),
    (TensorPolicy(format="fp16", bits=8), r"bits must be one of \(16,\), got 8 \(format fp16\)"),
])
def test_bad_policies_name_the_field(policy, pattern):
    with pytest.raises(CodecError, match=pattern):
        encode(torch.zeros(1, 1, 2, 2), policy, "layer 3 keys")


def test_non_finite_input_is_refused():
    x = torch.zeros(1, 1, 2, 2)
    x[0, 0, 1, 1] = float("nan")
    with pytest.raises(CodecError, match=r"layer 0 keys: 1 non-finite"):
        encode(x, TensorPolicy(format="uniform", bits=4, axis="token"), "layer 0 keys")


def test_ties_go_to_the_lower_level():
    book = torch.tensor([-1.0, -0.5, 0.5, 1.0])
    p = TensorPolicy(format="nuq", bits=2, axis="channel", codebook=book, zero=torch.zeros(1, 1), range=torch.ones(1, 1))
    assert encode(t4([[0.75], [0.0], [-0.75]]), p).codes.flatten().tolist() == [2, 1, 0]


def test_rotation_quantizes_the_rotated_row_and_rotates_back():
    """rotation "hadamard": encode(x) is the unrotated encoding of the rotated row, decode rotates back; an
    outlier channel spread over the block costs less error per token."""
    from exporters import rotation
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 16, 64, generator=gen)
    x[..., 7] *= 30                                                  # one outlier channel
    cb = torch.linspace(-1, 1, 8)
    plain = TensorPolicy(format="nuq", bits=3, axis="token", codebook=cb)
    rot = TensorPolicy(format="nuq", bits=3, axis="token", codebook=cb, rotation="hadamard")
    e_rot, e_ref = encode(x, rot), encode(rotation.rotate_orthonormal(x), plain)
    assert torch.equal(e_rot.codes, e_ref.codes) and torch.equal(e_rot.scale, e_ref.scale)
    assert torch.allclose(decode(e_rot, rot), rotation.unrotate_orthonormal(decode(e_ref, plain)), atol=1e-6)
    err_rot = (fake_quant(x, rot)[0] - x).square().mean()
    err_plain = (fake_quant(x, plain)[0] - x).square().mean()
    assert err_rot < 0.5 * err_plain
    assert encoded_bits(e_rot, rot) == encoded_bits(e_ref, plain)   # rotation costs no stored bits


def test_rotation_is_refused_where_it_does_not_apply_and_where_a_policy_is_exported():
    with pytest.raises(CodecError, match=r"k\.rotation must be one of \('none', 'hadamard'\), got 'givens'"):
        TensorPolicy(format="uniform", bits=4, axis="token", rotation="givens").validate_config("k")
    with pytest.raises(CodecError, match=r"k\.rotation applies to formats \('uniform', 'nuq'\) only, got format fp8"):
        TensorPolicy(format="fp8", bits=8, axis="tensor", rotation="hadamard").validate_config("k")
    p = TensorPolicy(format="uniform", bits=4, axis="token", rotation="hadamard")
    assert export_refusal(p, "key") is not None and export_refusal(p, "value") is None
    with pytest.raises(CodecError, match=r"quant\.key\.rotation: rotation hadamard is evaluation-only on keys of "
                                         r"format uniform .*allowed 'none', got 'hadamard'"):
        check_exportable(p, "quant.key", "key")
    with pytest.raises(CodecError, match=r"rotation hadamard is evaluation-only on a policy of format uniform .* "
                                         r"whose side \(key or value\) is not named"):
        check_exportable(p, "ArtifactCache: layer 0 values")   # a caller that does not name the side: refused
    with pytest.raises(ValueError, match=r"side must be one of \('key', 'value'\) or None, got 'v'"):
        export_refusal(p, "v")


def _clip_by_hand(row: list[float], bits: int) -> list[float]:
    """clip "mse" for one row, written out: every ratio's min-max reconstruction, the least squared error wins
    (the earlier ratio on a tie); scale and zero rounded to fp16 as stored."""
    levels, mn, mx = 2 ** bits - 1, min(row), max(row)
    best = None
    for r in codec.CLIP_RATIOS:
        lo = (mx + mn) / 2 - r * (mx - mn) / 2
        hi = (mx + mn) / 2 + r * (mx - mn) / 2
        lo16 = float(torch.tensor(lo).half())
        sc = float(torch.tensor((hi - lo) / levels).half())
        rec = [min(max(round((v - lo16) / sc), 0), levels) * sc + lo16 for v in row]
        err = sum((a - b) ** 2 for a, b in zip(rec, row))
        if best is None or err < best[0] - 1e-12:
            best = (err, rec)
    return best[1]


def test_clip_shrinks_a_row_range_where_it_lowers_the_error():
    # row 0 sits on its own grid (ratio 1 wins, as without clip); row 1's one large entry would stretch the scale
    # to 10 / 3: shrunk, the seven small entries get finer levels and the large one saturates
    x = t4([[0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0], [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 10.0]])
    plain = TensorPolicy(format="uniform", bits=2, axis="token")
    clip = TensorPolicy(format="uniform", bits=2, axis="token", clip="mse")
    y_plain, y_clip = fake_quant(x, plain)[0], fake_quant(x, clip)[0]
    assert torch.equal(y_clip[..., 0, :], x[..., 0, :])
    assert torch.allclose(y_clip[0, 0, 1], torch.tensor(_clip_by_hand(x[0, 0, 1].tolist(), 2)), atol=1e-5)
    e_clip = encode(x, clip)
    assert e_clip.scale[0, 0, 1, 0] < encode(x, plain).scale[0, 0, 1, 0]
    assert (y_clip - x)[0, 0, 1].square().sum() < (y_plain - x)[0, 0, 1].square().sum()
    assert encoded_bits(e_clip, clip) == encoded_bits(encode(x, plain), plain)   # the stored form is the same


def test_clip_never_does_worse_than_min_max_per_row():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 32, 16, generator=gen) * torch.rand(1, 2, 32, 1, generator=gen) * 4
    x[0, 1, 5, 3] = 40.0
    for bits in (2, 3, 4):
        plain = TensorPolicy(format="uniform", bits=bits, axis="token")
        clip = dataclasses.replace(plain, clip="mse")
        err_plain = (fake_quant(x, plain)[0] - x).square().sum(-1)
        err_clip = (fake_quant(x, clip)[0] - x).square().sum(-1)
        assert (err_clip <= err_plain + 1e-5).all() and (err_clip < err_plain).any()
        for t in (0, 5, 17):
            got = fake_quant(x, clip)[0][0, 1, t]
            assert torch.allclose(got, torch.tensor(_clip_by_hand(x[0, 1, t].tolist(), bits)), atol=1e-4)


def test_clip_on_nuq_rows_searches_the_range_over_the_codebook():
    # the codebook's levels reach +-1 of the range: a row with one large entry reads back better shrunk
    cb = torch.tensor([-1.0, -0.3, 0.3, 1.0])
    x = t4([[0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 10.0], [-1.0, -0.3, 0.3, 1.0, -1.0, -0.3, 0.3, 1.0]])
    plain = TensorPolicy(format="nuq", bits=2, axis="token", codebook=cb)
    clip = dataclasses.replace(plain, clip="mse")
    e = encode(x, clip)
    y_plain, y_clip = fake_quant(x, plain)[0], fake_quant(x, clip)[0]
    assert torch.equal(y_clip[..., 1, :], x[..., 1, :])          # on the codebook: ratio 1, exact
    assert e.scale[0, 0, 0, 0] < encode(x, plain).scale[0, 0, 0, 0]
    err = lambda y: (y - x)[0, 0, 0].square().sum()              # noqa: E731
    assert err(y_clip) < err(y_plain)
    # by hand: every ratio's range about the midpoint 5.0, the least squared error wins
    best = min((float(((cb[((x[0, 0, 0] - 5.0) / (r * 5.0)).clamp(-1, 1)[:, None].sub(cb).abs().argmin(1)]
                        * r * 5.0 + 5.0) - x[0, 0, 0]).square().sum()), i) for i, r in enumerate(codec.CLIP_RATIOS))
    assert abs(float(err(y_clip)) - best[0]) < 1e-3


def test_clip_is_refused_where_it_does_not_apply_and_where_a_policy_is_exported():
    with pytest.raises(CodecError, match=r"k\.clip must be one of \('none', 'mse'\), got 'p99'"):
        TensorPolicy(format="uniform", bits=2, axis="token", clip="p99").validate_config("k")
    with pytest.raises(CodecError, match=r"k\.clip applies to uniform \(axis token\); nuq \(axis token\) only, got format "
                                         r"nuq with axis channel"):
        TensorPolicy(format="nuq", bits=2, axis="channel", clip="mse").validate_config("k")
    with pytest.raises(CodecError, match=r"got format uniform with axis channel"):
        TensorPolicy(format="uniform", bits=2, axis="channel", group_size=4, clip="mse").validate_config("k")
    p = TensorPolicy(format="nuq", bits=2, axis="token", clip="mse", codebook=torch.linspace(-1, 1, 4))
    assert export_refusal(p, "value") is not None
    with pytest.raises(CodecError, match=r"quant\.value\.clip: clip mse is evaluation-only on values of format nuq "
                                         r"with axis token .*allowed 'none', got 'mse'"):
        check_exportable(p, "quant.value", "value")


UNI_V = dict(format="uniform", bits=2, axis="token")


@pytest.mark.parametrize("side,policy,refused", [
    ("value", TensorPolicy(**UNI_V, rotation="hadamard", clip="mse"), None),
    ("value", TensorPolicy(**UNI_V, rotation="hadamard"), None),
    ("value", TensorPolicy(**UNI_V, clip="mse"), None),
    ("value", TensorPolicy(**UNI_V, clip="mse", outlier_fraction=0.01), None),   # the clip takes outliers
    ("key", TensorPolicy(**UNI_V, rotation="hadamard", clip="mse"), r"\.rotation: .* on keys of format uniform"),
    ("key", TensorPolicy(**UNI_V, clip="mse"), r"\.clip: clip mse is evaluation-only on keys of format uniform"),
    ("value", TensorPolicy(**UNI_V, rotation="hadamard", outlier_fraction=0.01),
     r"\.rotation: .* on values of format uniform with axis token and outlier_fraction 0\.01 .*no sparse outliers"),
    ("value", TensorPolicy(format="nuq", bits=3, axis="token", rotation="hadamard"),
     r"\.rotation: .* on values of format nuq with axis token"),
    ("value", TensorPolicy(format="nuq", bits=2, axis="token", clip="mse"), r"\.clip: .* on values of format nuq"),
    ("key", TensorPolicy(format="nuq", bits=3, axis="channel", rotation="hadamard"),
     r"\.rotation: .* on keys of format nuq with axis channel"),
    ("value", TensorPolicy(format="uniform", bits=2, axis="channel", group_size=4, rotation="hadamard"),
     r"\.rotation: .* on values of format uniform with axis channel"),
    (None, TensorPolicy(**UNI_V, rotation="hadamard", clip="mse"),
     r"\.rotation: .* side \(key or value\) is not named"),
    (None, TensorPolicy(**UNI_V, clip="mse"), r"\.clip: .* side \(key or value\) is not named"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_rotation_and_clip_export_on_uniform_values_per_token_only(side, policy, refused):
    """The one export rule: rotation "hadamard" and clip "mse" on the value side, format uniform, axis token, and
    for the rotation no sparse outliers; anything else refused naming the field, the side, format and axis."""
    got = export_refusal(policy, side, "layers/1/v")
    if refused is None:
        assert got is None
        check_exportable(policy, "layers/1/v", side)
    else:
        assert got is not None and got.startswith("layers/1/v.") and got.endswith("got " + repr(
            policy.rotation if ".rotation" in refused else policy.clip))
        with pytest.raises(CodecError, match=refused):
            check_exportable(policy, "layers/1/v", side)


def test_the_policys_rotation_signs_are_the_ones_used():
    """rotation_signs None are vLLM's seeded signs (bit for bit the same codes and values); other signs (all +1) give
    other codes, and decode un-rotates with the policy's own signs: the codes of one read back with the other's
    signs are wrong."""
    from exporters import rotation
    x = torch.randn(1, 2, 6, 16, generator=torch.Generator().manual_seed(5))
    seeded = TensorPolicy(**UNI_V, rotation="hadamard", clip="mse")
    same = dataclasses.replace(seeded, rotation_signs=rotation.rht_signs(16))
    ones = dataclasses.replace(seeded, rotation_signs=torch.ones(16))
    e, e_same, e_ones = encode(x, seeded), encode(x, same), encode(x, ones)
    assert torch.equal(e.codes, e_same.codes) and torch.equal(e.scale, e_same.scale)
    assert torch.equal(decode(e, seeded), decode(e_same, same))
    assert not torch.equal(e.codes, e_ones.codes)
    plain = TensorPolicy(**UNI_V, clip="mse")   # all-+1 signs: the plain orthonormal Hadamard H x / 4
    h = rotation.hadamard_orthonormal(16)
    assert torch.equal(e_ones.codes, encode(x @ h, plain).codes)
    y = decode(e_ones, ones)
    assert torch.allclose(y, decode(encode(x @ h, plain), plain) @ h, atol=1e-6)
    assert not torch.allclose(decode(e_ones, seeded), y, atol=1e-3)
    # the signs are a calibrated tensor: counted once per layer, 32 bits each; rotation costs no bits per row
    assert static_bits(ones) == 16 * 32 and static_bits(seeded) == 0
    assert encoded_bits(e_ones, ones) == encoded_bits(e, seeded)


@pytest.mark.parametrize("signs,message", [
    (torch.ones(2, 4), r"must be a 1-D tensor of a power-of-two length .* got shape \(2, 4\)"),
    (torch.ones(12), r"must be a 1-D tensor of a power-of-two length .* got shape \(12,\)"),
    (torch.tensor([1.0, -1.0, 0.5, 1.0]), r"entries must be exactly \+1 or -1, got 1 of 4 other, first "
                                          r"at \[2\]: 0\.5"),
    (torch.tensor([1.0, 0.0, 1.0, 1.0]), r"got 1 of 4 other, first at \[1\]: 0\.0"),
    (torch.tensor([1.0, 1.0, 1.0, float("nan")]), r"first at \[3\]: nan"),
])
def test_rotation_signs_are_validated(signs, message):
    with pytest.raises(CodecError, match=r"layers/0/value\.rotation_signs .*" + message):
        TensorPolicy(**UNI_V, rotation="hadamard", rotation_signs=signs).validate("layers/0/value")
    TensorPolicy(**UNI_V, rotation="hadamard", rotation_signs=-torch.ones(4)).validate("layers/0/value")


def test_rotation_signs_need_a_rotation_and_rows_of_their_block():
    with pytest.raises(CodecError, match=r"v\.rotation_signs apply to rotation 'hadamard' only; allowed None with "
                                         r"rotation 'none', got a tensor of shape \(4,\)"):
        TensorPolicy(**UNI_V, rotation_signs=torch.ones(4)).validate("v")
    p = TensorPolicy(**UNI_V, rotation="hadamard", rotation_signs=torch.ones(8))
    with pytest.raises(CodecError, match=r"rotation_signs must hold b = 4 entries for rows of 12 channels .* got 8"):
        encode(torch.randn(1, 1, 2, 12), p)


def test_a_format_is_one_registered_row():
    """Registering one Format is all a new format needs: validation, encode / decode, the size model and the
    exportability checks read it (a sign-and-magnitude toy: fp16 values of the sign times 1, per row)."""
    def enc(x, p, where):
        return Encoded(tuple(x.shape), codes=(x >= 0).to(torch.uint8))

    def dec(e, p):
        return e.codes.float() * 2 - 1

    toy = Format("sign", ("token",), (1,), enc, dec, codec._code_dense_bits, lambda p, d: 7)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(FORMATS, "sign", toy)
        p = TensorPolicy(format="sign", bits=1, axis="token")
        x = t4([[0.5, -2.0, 0.0, 3.0]])
        assert decode(encode(x, p), p).flatten().tolist() == [1.0, -1.0, 1.0, 1.0]
        assert stored_bits(p, 1, 1, 3, 4) == 3 * (8 + 7)   # 4 one-bit codes in one whole byte, 7 bits beside
        assert export_refusal(p, "key") is not None and export_refusal(p, "value") is not None
        with pytest.raises(CodecError, match=r"format sign with axis token is evaluation-only"):
            check_exportable(p, "quant.key", "key")
        with pytest.raises(CodecError, match=r"q\.bits must be one of \(1,\), got 2 \(format sign\)"):
            TensorPolicy(format="sign", bits=2, axis="token").validate_config("q")
        with pytest.raises(CodecError, match=r"outlier_fraction: format sign stores no sparse outliers"):
            TensorPolicy(format="sign", bits=1, axis="token", outlier_fraction=0.01).validate_config("q")
    with pytest.raises(CodecError, match=r"format must be one of \('fp16', 'uniform', 'nuq', 'fp8', 'int_sym'"):
        TensorPolicy(format="sign", bits=1, axis="token").validate_config("q")


def test_the_registry_rows():
    """What each row says, by hand: the exported formats and their axes, bits, zero points, groups."""
    exported = {name: f.export_axes for name, f in FORMATS.items() if f.exports}
    assert exported == {"fp16": ("tensor",), "uniform": ("token", "channel"), "nuq": ("token", "channel"),
                        "fp8": ("tensor", "head")}
    assert all(set(f.export_axes) <= set(f.axes) for f in FORMATS.values())
    assert {name: f.bits for name, f in FORMATS.items()} == {
        "fp16": (16,), "uniform": (2, 3, 4, 8), "nuq": (2, 3, 4, 8), "fp8": (8,), "int_sym": (4, 8), "rht_int": (4,),
        "turbo_mse": (3, 4), "turbo_uniform": (3, 4), "ultra_fp4": (4,), "ultra_fp4_rot": (4,)}
    assert codec.formats_where(lambda f: f.outliers) == codec.formats_where(lambda f: f.rotation) == ("uniform", "nuq")
    assert {name: f.zero_point for name, f in FORMATS.items() if f.zero_point != "none"} == {"uniform": "min",
                                                                                         "nuq": "midpoint"}
    assert TensorPolicy(format="uniform", bits=2, axis="channel", group_size=4).is_grouped
    assert not TensorPolicy(format="nuq", bits=2, axis="channel").is_grouped


def test_clip_search_in_chunks_of_rows_gives_the_bytes_of_one_pass(monkeypatch):
    # the search takes every ratio at once over at most CLIP_CHUNK_ELEMENTS row entries: rows are independent,
    # so one row per pass (the serving cache's decode step) and all rows in one pass store the same bytes
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 7, 16, generator=gen) * torch.rand(2, 3, 7, 1, generator=gen) * 4
    x[1, 2, 4, 5] = 30.0
    cb = torch.tensor([-1.0, -0.4, 0.2, 1.0])
    policies = [TensorPolicy(format="uniform", bits=2, axis="token", clip="mse"),
                TensorPolicy(format="uniform", bits=3, axis="token", clip="mse", rotation="hadamard"),
                TensorPolicy(format="nuq", bits=2, axis="token", clip="mse", codebook=cb)]
    whole = [encode(x, p) for p in policies]
    monkeypatch.setattr(codec, "CLIP_CHUNK_ELEMENTS", 16)         # one row of 16 per pass
    for p, w in zip(policies, whole):
        e = encode(x, p)
        for f in ("codes", "scale", "zero"):
            assert getattr(e, f).shape == getattr(w, f).shape and torch.equal(getattr(e, f), getattr(w, f))
