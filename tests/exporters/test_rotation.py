"""exporters/rotation.py (Hadamard matrices, vLLM's RHT signs) and exporters/lloyd_max.py (TurboQuant's levels),
against hand-computed matrices and the level tables of the spec written from vLLM 0.32's source."""
import math

import pytest
import torch

from exporters import lloyd_max, rotation

# vLLM int4_per_token_head's signs for D = 64 (torch 2.13.0+cpu), as the spec lists them
SIGNS_64 = "+-++----+--++-+-++--+++-+-+--++-+---++-++-+-++---------+-------+"

# Lloyd-Max levels x sqrt(D), positive half (the spec's table, vLLM's algorithm run in float64)
NORMALIZED_LEVELS = {3: [0.244984, 0.755646, 1.343180, 2.150350],
                     4: [0.128428, 0.388138, 0.656880, 0.942448, 1.256258, 1.617882, 2.068447, 2.730922]}
# the spec's fp32 centroids, printed to 9 significant digits (enough to identify a float32)
CENTROIDS_D128_4BIT = [-0.241381705, -0.182826623, -0.143001899, -0.111038528, -0.0833014399, -0.0580605306,
                       -0.0343068577, -0.011351509, 0.011351509, 0.0343068577, 0.0580605306, 0.0833014399,
                       0.111038528, 0.143001899, 0.182826623, 0.241381705]
CENTROIDS_D64_3BIT = [-0.268793702, -0.167897508, -0.0944556892, -0.0306229498, 0.0306229498, 0.0944556892,
                      0.167897508, 0.268793702]
MIDPOINTS_D64_3BIT = [-0.218345612, -0.131176591, -0.0625393167, 0.0, 0.0625393167, 0.131176591, 0.218345612]


def test_sylvester_hadamard_of_size_4():
    assert rotation.hadamard(4).tolist() == [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]


@pytest.mark.parametrize("b", [1, 2, 8, 64, 128])
def test_hadamard_rows_are_orthogonal_and_the_normalized_one_is_its_own_inverse(b):
    h = rotation.hadamard(b)
    assert torch.equal(h @ h.T, b * torch.eye(b))
    n = rotation.hadamard_orthonormal(b)
    assert torch.equal(n, n.T)
    assert torch.allclose(n @ n, torch.eye(b), atol=1e-6)


def test_hadamard_needs_a_power_of_two():
    with pytest.raises(ValueError, match="power-of-two size, got 12"):
        rotation.hadamard(12)


def test_largest_power_of_two_divisor():
    assert [rotation.largest_power_of_two_divisor(d) for d in (1, 12, 64, 96, 128, 7)] == [1, 4, 64, 32, 128, 1]


def test_signs_are_vllms_and_a_prefix_of_each_other():
    s64 = rotation.rht_signs(64)
    assert "".join("+" if v > 0 else "-" for v in s64.tolist()) == SIGNS_64
    assert torch.equal(rotation.rht_signs(128)[:64], s64)
    assert torch.equal(s64[:16], rotation.rht_signs(16))
    assert set(rotation.rht_signs(128).tolist()) == {-1.0, 1.0}


def test_rht_by_hand_for_d4():
    # d = +-++ ; H_4 (d * x) with x = [1, 2, 3, 4]: d * x = [1, -2, 3, 4]
    y = rotation.rht(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert y.tolist() == [1 - 2 + 3 + 4, 1 + 2 + 3 - 4, 1 - 2 - 3 - 4, 1 + 2 - 3 + 4]
    assert rotation.rht_inverse(y).tolist() == [1.0, 2.0, 3.0, 4.0]


def test_rht_inverts_and_scales_the_norm_by_sqrt_b():
    x = torch.randn(2, 3, 5, 64, generator=torch.Generator().manual_seed(0))
    y = rotation.rht(x)
    assert torch.allclose(y.norm(dim=-1), math.sqrt(64) * x.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(rotation.rht_inverse(y), x, atol=1e-5)


def test_rht_is_block_diagonal_when_d_is_not_a_power_of_two():
    x = torch.randn(3, 12, generator=torch.Generator().manual_seed(1))   # b = 4: three blocks, the same signs
    y = rotation.rht(x)
    for blk in range(3):
        assert torch.allclose(y[:, 4 * blk : 4 * blk + 4], rotation.rht(x[:, 4 * blk : 4 * blk + 4]))
    assert torch.allclose(rotation.rht_inverse(y), x, atol=1e-6)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits", [3, 4])
def test_lloyd_max_levels_match_the_spec_table(bits, d):
    levels, mids = lloyd_max.codebook(bits, d)
    half = NORMALIZED_LEVELS[bits]
    want = torch.tensor([-v for v in reversed(half)] + half)
    assert levels.dtype == torch.float32 and levels.shape == (2 ** bits,)
    assert (levels * math.sqrt(d) - want).abs().max() < 1e-5
    assert torch.equal(mids, (levels[:-1] + levels[1:]) / 2) and mids[2 ** (bits - 1) - 1] == 0


def test_lloyd_max_levels_are_vllms_float32_values():
    assert torch.equal(lloyd_max.codebook(4, 128)[0], torch.tensor(CENTROIDS_D128_4BIT))
    levels, mids = lloyd_max.codebook(3, 64)
    assert torch.equal(levels, torch.tensor(CENTROIDS_D64_3BIT))
    assert torch.equal(mids, torch.tensor(MIDPOINTS_D64_3BIT))


def test_lloyd_max_levels_are_conditional_means_of_their_cells():
    """The fixed point the solver seeks: at 3 bits it converges, each level is the mean of N(0, 1/D) over its cell,
    up to the error of vLLM's 200-interval trapezoid rule (7e-5 = 6e-4 sigma on the outer cells, which span 9 sigma;
    a level from the wrong cell or density would be off by > 0.1 sigma)."""
    levels = lloyd_max.solve(3, 64)
    sigma = 1 / 8
    edges = torch.cat([torch.tensor([-10.5 * sigma]), (levels[:-1] + levels[1:]) / 2, torch.tensor([10.5 * sigma])])
    x = torch.linspace(-10.5 * sigma, 10.5 * sigma, 400_001, dtype=torch.float64)
    w = torch.exp(-x * x / (2 * sigma * sigma))
    cell = torch.bucketize(x, edges[1:-1])
    means = torch.stack([(x * w)[cell == i].sum() / w[cell == i].sum() for i in range(8)])
    assert (means - levels).abs().max() < 1e-3 * sigma


@pytest.mark.parametrize("d", [64, 96])
def test_orthonormal_rht_keeps_norms_and_inverts(d):
    x = torch.randn(3, 2, 5, d, generator=torch.Generator().manual_seed(0))
    y = rotation.rotate_orthonormal(x)
    b = rotation.largest_power_of_two_divisor(d)
    # per Hadamard block the norm is kept (64: one block; 96: three blocks of 32)
    xb, yb = x.view(*x.shape[:-1], d // b, b), y.view(*y.shape[:-1], d // b, b)
    assert torch.allclose(yb.norm(dim=-1), xb.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(rotation.unrotate_orthonormal(y), x, atol=1e-5)


def test_orthonormal_rht_is_the_signed_normalized_sylvester_matrix():
    """y = H_4 (d * x) / 2 on a hand-checkable row: e_0 maps to d_0 * (1, 1, 1, 1) / 2."""
    d = rotation.rht_signs(4)
    y = rotation.rotate_orthonormal(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert y.tolist() == [[float(d[0]) / 2] * 4]


def test_an_outlier_channel_is_spread_over_the_block():
    x = torch.zeros(1, 64)
    x[0, 5] = 8.0
    y = rotation.rotate_orthonormal(x)
    assert torch.allclose(y.abs(), torch.full((1, 64), 1.0))   # 8 / sqrt(64) in every channel


def test_orthonormal_rotation_with_explicit_signs_by_hand():
    """y = H_4 (s * x) / 2: s = [1, 1, -1, 1] (not the seeded +-++), x = [1, 2, 3, 4], s * x = [1, 2, -3, 4];
    the four Sylvester rows give 4, -8, 2, 6, halved. The norm stays sqrt(30)."""
    s, x = torch.tensor([1.0, 1.0, -1.0, 1.0]), torch.tensor([1.0, 2.0, 3.0, 4.0])
    y = rotation.rotate_orthonormal(x, s)
    assert y.tolist() == [2.0, -4.0, 1.0, 3.0] and float(y.square().sum()) == 30.0
    assert rotation.unrotate_orthonormal(y, s).tolist() == [1.0, 2.0, 3.0, 4.0]
    # the seeded signs (+-++, the plan's example): s * x = [1, -2, 3, 4] -> 6, 2, -8, 4, halved
    assert rotation.rotate_orthonormal(x).tolist() == [3.0, 1.0, -4.0, 2.0]
    assert torch.equal(rotation.rotate_orthonormal(x, rotation.rht_signs(4)), rotation.rotate_orthonormal(x))


@pytest.mark.parametrize("d", [4, 64, 96])
def test_signs_none_are_the_seeded_signs_bit_for_bit(d):
    x = torch.randn(2, 3, d, generator=torch.Generator().manual_seed(2))
    b = rotation.largest_power_of_two_divisor(d)
    y = rotation.rotate_orthonormal(x)
    assert torch.equal(y, rotation.rotate_orthonormal(x, rotation.rht_signs(b)))
    assert torch.equal(y, rotation.rht(x) / math.sqrt(b))     # today's definition, unchanged
    assert torch.equal(rotation.unrotate_orthonormal(y), rotation.unrotate_orthonormal(y, rotation.rht_signs(b)))


@pytest.mark.parametrize("d", [4, 64, 96])
def test_the_unrotation_matrix_is_the_butterflys_inverse(d):
    """y @ M == unrotate_orthonormal(y) with the same signs (block-diagonal for 96 = 3 x 32), up to float32
    rounding of a matrix product; M is orthogonal."""
    b = rotation.largest_power_of_two_divisor(d)
    gen = torch.Generator().manual_seed(3)
    signs = 2.0 * torch.randint(0, 2, (b,), generator=gen).float() - 1.0
    y = torch.randn(5, d, generator=gen)
    for s in (signs, None):
        m = rotation.unrotation_matrix(d, s)
        assert m.shape == (d, d) and m.dtype == torch.float32
        assert torch.allclose(y @ m, rotation.unrotate_orthonormal(y, s), atol=1e-6)
        assert torch.allclose(m @ m.T, torch.eye(d), atol=1e-6)
    if d > b:   # off the diagonal blocks: zero
        assert not rotation.unrotation_matrix(d, signs)[:b, b:].any()
    # a wrong sign vector gives another matrix: a kernel holding the seeded signs fails against the policy's
    assert not torch.allclose(rotation.unrotation_matrix(d, -signs), rotation.unrotation_matrix(d, signs))


def test_unrotation_matrix_for_d4_by_hand():
    """s = [1, 1, -1, 1]: M = H_4 * s[None, :] / 2, column 2 negated; the row y = [2, -4, 1, 3] maps back to
    x = [1, 2, 3, 4] (the rotation by hand above)."""
    m = rotation.unrotation_matrix(4, torch.tensor([1.0, 1.0, -1.0, 1.0]))
    assert (2 * m).tolist() == [[1, 1, -1, 1], [1, -1, -1, -1], [1, 1, 1, -1], [1, -1, 1, 1]]
    assert (torch.tensor([2.0, -4.0, 1.0, 3.0]) @ m).tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("shape", [(2,), (8,), (2, 4)])
def test_signs_of_the_wrong_length_or_shape_are_refused(shape):
    x = torch.randn(3, 12)   # b = 4
    with pytest.raises(ValueError, match=rf"signs must be a 1-D tensor of b = 4 entries .* got shape {shape}"
                       .replace("(", r"\(").replace(")", r"\)")):
        rotation.rotate_orthonormal(x, torch.ones(shape))
    with pytest.raises(ValueError, match="signs must be a 1-D tensor of b = 4"):
        rotation.unrotate_orthonormal(x, torch.ones(shape))
    with pytest.raises(ValueError, match="signs must be a 1-D tensor of b = 4"):
        rotation.unrotation_matrix(12, torch.ones(shape))
