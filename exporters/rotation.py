"""Hadamard rotations of a KV row, as three vLLM 0.32 cache formats apply them before quantizing.

- `rht` / `rht_inverse` (vLLM int4_per_token_head, vllm/v1/attention/ops/int4_per_token_head.py:1075-1167): the
  randomized Hadamard transform y = H_b (d * x) with the UNnormalized Sylvester matrix H_b (entries +-1,
  H_b H_b^T = b I, b = the largest power of two dividing D; block-diagonal over D / b blocks when b < D, the
  same signs in every block), inverse x = d * (H_b y) / b.
- `hadamard_orthonormal(d)` (TurboQuant, vllm/v1/attention/backends/turboquant_attn.py:105-120): H_d / sqrt(d),
  symmetric and its own inverse, no signs; d must be a power of two.
- `fwht_orthonormal` (UltraQuant keys, vllm/v1/attention/ops/ultraquant/triton_store.py:166-177): H_d x / sqrt(d)
  as the store kernel computes it, a butterfly that multiplies by fp32(1/sqrt(2)) after every stage.
- `rotate_orthonormal` / `unrotate_orthonormal` (kvcalib's own `rotation: hadamard`): y = H_b (d * x) / sqrt(b)
  per block, with the policy's signs (an artifact stores them) or, without, vLLM's seeded ones;
  `unrotation_matrix` is its inverse as one [D, D] matrix, for kernels that un-rotate a sum of rows once.

Natural (Sylvester) ordering everywhere: H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]. H_b x is computed by the fast
Walsh-Hadamard butterfly in float32, stage widths 1, 2, 4, ... (pair (a, b) -> (a + b, a - b)): that is the order
vLLM's own PyTorch path (`fast_hadamard_transform`, tier 3) adds in, so the float32 result is bit for bit vLLM's,
where a matrix product would round differently in the last bit (and, after the int4 format's cast to fp16, now
and then in a stored code).
"""
from __future__ import annotations

import functools
import math

import torch

RHT_SEED = 0x9E3779B9   # vLLM's seed for the first (and only) RHT round: 0x9E3779B9 + 0 * 0x517CC1B7


def largest_power_of_two_divisor(d: int) -> int:
    if d < 1:
        raise ValueError(f"head_dim must be >= 1, got {d}")
    return d & -d


@functools.lru_cache(maxsize=16)
def _sylvester(b: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard(b: int) -> torch.Tensor:
    """[b, b] float32 unnormalized Sylvester Hadamard matrix (b a power of two). A fresh copy: callers may edit it."""
    if b < 1 or b & (b - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {b}")
    return _sylvester(b).clone()


def hadamard_orthonormal(d: int) -> torch.Tensor:
    """[d, d] float32 H_d / sqrt(d): TurboQuant's rotation (symmetric, H H = I)."""
    return hadamard(d) / math.sqrt(d)


@functools.lru_cache(maxsize=16)
def _signs(b: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(RHT_SEED)
    return 2.0 * torch.bernoulli(torch.full((b,), 0.5), generator=gen) - 1.0


def rht_signs(b: int) -> torch.Tensor:
    """[b] float32 +-1: vLLM's RHT signs, 2 * bernoulli(0.5) - 1 from a CPU generator seeded RHT_SEED. A prefix of
    the stream: the signs for b are the first b of those for any larger size. Torch's bernoulli stream is what
    defines them; another torch version could in principle draw others (tests pin the first 64)."""
    return _signs(b).clone()


INV_SQRT2 = 0.7071067811865476   # UltraQuant's per-stage factor (float32 0.70710677 once multiplied in)


def fwht(x: torch.Tensor, stage_scale: float | None = None) -> torch.Tensor:
    """x [..., b] float32 (b a power of two) -> H_b x, by the butterfly: at stage width h = 1, 2, 4, ... each pair
    (a, c) h apart becomes (a + c, a - c), each sum and difference rounded to float32 once. stage_scale multiplies
    both after every stage (UltraQuant's 1/sqrt(2), which makes the result orthonormal); None: unnormalized."""
    *lead, b = x.shape
    if b < 1 or b & (b - 1):
        raise ValueError(f"a Walsh-Hadamard butterfly needs a power-of-two size, got {b}")
    h = 1
    while h < b:
        pairs = x.reshape(*lead, b // (2 * h), 2, h)
        a, c = pairs[..., 0, :], pairs[..., 1, :]
        s, t = a + c, a - c
        if stage_scale is not None:
            s, t = s * stage_scale, t * stage_scale
        x = torch.stack((s, t), dim=-2).reshape(*lead, b)
        h *= 2
    return x


def fwht_orthonormal(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (D a power of two) -> H_D x / sqrt(D) float32, rounded as UltraQuant's store kernel rounds it:
    the butterfly with a multiply by float32(1/sqrt(2)) after each of its log2(D) stages (not one 1/sqrt(D) at the
    end, nor a matrix product: both differ in the last bit)."""
    return fwht(x.float(), INV_SQRT2)


def _block_signs(signs: torch.Tensor | None, b: int, device: torch.device) -> torch.Tensor:
    """The [b] float32 signs on `device`: vLLM's seeded ones (rht_signs) when None, else the given ones, which must
    be a 1-D tensor of b entries (b = the largest power of two dividing D)."""
    if signs is None:
        return _signs(b).to(device)
    if signs.dim() != 1 or signs.numel() != b:
        raise ValueError(f"signs must be a 1-D tensor of b = {b} entries (the largest power of two dividing the "
                         f"row's length), got shape {tuple(signs.shape)}")
    return signs.to(device=device, dtype=torch.float32)


def _blocks(x: torch.Tensor, signs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """x [..., D] -> (x viewed [..., D / b, b] float32, signs [b] on x's device, b)."""
    d = x.shape[-1]
    b = largest_power_of_two_divisor(d)
    xb = x.float().reshape(*x.shape[:-1], d // b, b)
    return xb, _block_signs(signs, b, x.device), b


def rht(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> y = H_b (d * x) per block of b, float32 (norm sqrt(b) |x| per block)."""
    return _rht(x, None)


def rht_inverse(y: torch.Tensor) -> torch.Tensor:
    """y [..., D] -> x = d * (H_b y) / b per block, float32: rht_inverse(rht(x)) == x up to float32 rounding."""
    return _rht_inverse(y, None)


def _rht(x: torch.Tensor, signs: torch.Tensor | None) -> torch.Tensor:
    xb, s, _ = _blocks(x, signs)
    return fwht(xb * s).reshape(x.shape)


def _rht_inverse(y: torch.Tensor, signs: torch.Tensor | None) -> torch.Tensor:
    yb, s, b = _blocks(y, signs)
    return (fwht(yb) * s / b).reshape(y.shape)


def rotate_orthonormal(x: torch.Tensor, signs: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] -> y = H_b (d * x) / sqrt(b) per block of b: the randomized Hadamard transform made orthonormal
    (|y| = |x|), the rotation kvcalib's `rotation: hadamard` applies before quantizing (QuaRot-style: outlier
    channels spread over the block). Random signs make an isotropic per-element weight exact in expectation:
    E[(R g)_c^2] = |g_block|^2 / b for any g. signs [b] (+-1, the same in every block): the policy's own
    (TensorPolicy.rotation_signs, stored in the artifact); None: vLLM's seeded rht_signs(b)."""
    b = largest_power_of_two_divisor(x.shape[-1])
    return _rht(x, signs) / math.sqrt(b)


def unrotate_orthonormal(y: torch.Tensor, signs: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of rotate_orthonormal with the same signs: x = d * (H_b y) / sqrt(b) per block, float32."""
    b = largest_power_of_two_divisor(y.shape[-1])
    return _rht_inverse(y, signs) * math.sqrt(b)


def unrotation_matrix(d: int, signs: torch.Tensor | None = None) -> torch.Tensor:
    """[d, d] float32 M with y @ M == unrotate_orthonormal(y, signs) for rows y [..., d], up to float32 rounding
    (a matrix product adds in another order than the butterfly): block-diagonal over the d / b blocks, each
    H_b * signs[None, :] / sqrt(b) (H_b symmetric). A kernel that sums rotated rows weighted by attention
    un-rotates the sum once with it: the un-rotation is linear."""
    b = largest_power_of_two_divisor(d)
    block = hadamard(b) * _block_signs(signs, b, torch.device("cpu"))[None, :] / math.sqrt(b)
    return torch.block_diag(*[block] * (d // b))
