"""Encode / decode of every supported KV-cache format: the single definition of the cache ABI.

Evaluation, the runtime check's oracle and the transformers Cache all call this module. Tensors are one
layer's cache, `[B, H_kv, T, D]`. Equations (b = bits, L = 2^b levels):

- fp16:     stored as is.
- uniform (asymmetric min-max; KIVI, Liu et al. 2024):
    axis="token":   per (token, head) over D channels;  axis="channel": per (head, channel) over groups of
    `group_size` tokens (KIVI keys).  scale = (max - min) / (L - 1), code = round((x - min) / scale),
    x^ = code * scale + min.  A constant group (max == min) has scale 0 and decodes exactly to min.
- nuq (KVQuant, Hooper et al. 2024 sec. 3.3-3.4): a codebook of L sorted levels in [-1, 1].
    axis="channel" (keys): static zero / range per (head, channel) from calibration.
    axis="token" (values): per (token, head), zero = (max + min) / 2 and range = (max - min) / 2 of the inliers.
    xn = (x - zero) / range (0 where range == 0), code = nearest level of clamp(xn, -1, 1) (a tie between
    two levels goes to the lower one),
    x^ = level[code] * range + zero.
- sparse outliers (dense-and-sparse): entries outside [lower, upper] are stored exactly (fp16 value + index)
    and the dense part sees them as inliers clamped to the bound. Keys: static per-channel bounds from
    calibration. Values: per token over all KV heads, bounds at the f/2 and 1 - f/2 quantiles of that token.
- fp8 (e4m3 / e5m2): x^ = float8(x / s) * s with s per tensor (scalar) or per head ([H]), s = amax / fp8_max.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

FORMATS = ("fp16", "uniform", "nuq", "fp8")
AXES = {"fp16": ("tensor",), "uniform": ("token", "channel"), "nuq": ("token", "channel"), "fp8": ("tensor", "head")}
ALLOWED_BITS = (2, 3, 4, 8)
FP8 = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
MAX_OUTLIER_FRACTION = 0.1
# TensorPolicy's calibrated tensors (what calibration fills in and the artifact stores), in artifact order
CALIBRATED_FIELDS = ("codebook", "zero", "range", "lower", "upper", "fp8_scale")


class CodecError(ValueError):
    """A policy or its calibrated tensors are invalid; the message names the field and what was given."""


@dataclass
class TensorPolicy:
    """How one layer's K or V is stored; the calibrated tensors ride along (shapes in comments)."""
    format: str = "fp16"
    bits: int = 16
    axis: str = "tensor"
    group_size: int = 0                     # uniform/channel: tokens per group
    outlier_fraction: float = 0.0
    fp8_dtype: str = "e4m3"
    codebook: torch.Tensor | None = None    # [L] sorted, in [-1, 1]               (nuq)
    zero: torch.Tensor | None = None        # [H, D]                               (nuq, axis=channel)
    range: torch.Tensor | None = None       # [H, D]                               (nuq, axis=channel)
    lower: torch.Tensor | None = None       # [H, D] static outlier bounds          (axis=channel, f > 0)
    upper: torch.Tensor | None = None       # [H, D]
    fp8_scale: torch.Tensor | None = None   # [] or [H]                            (fp8)

    def validate_config(self, where: str = "policy") -> None:
        """The configured fields alone (no calibrated tensors): what a recipe can be refused for before any stage."""
        if self.format not in FORMATS:
            raise CodecError(f"{where}.format must be one of {FORMATS}, got {self.format!r}")
        if self.axis not in AXES[self.format]:
            raise CodecError(f"{where}.axis for format {self.format} must be one of {AXES[self.format]}, got {self.axis!r}")
        if self.format in ("uniform", "nuq") and self.bits not in ALLOWED_BITS:
            raise CodecError(f"{where}.bits must be one of {ALLOWED_BITS}, got {self.bits}")
        if not 0.0 <= self.outlier_fraction <= MAX_OUTLIER_FRACTION:
            raise CodecError(f"{where}.outlier_fraction must be in [0, {MAX_OUTLIER_FRACTION}], got {self.outlier_fraction}")
        if self.format == "fp8" and self.fp8_dtype not in FP8:
            raise CodecError(f"{where}.fp8_dtype must be one of {tuple(FP8)}, got {self.fp8_dtype!r}")
        if self.format == "uniform" and self.axis == "channel" and self.group_size < 1:
            raise CodecError(f"{where}.group_size must be >= 1 for per-channel uniform, got {self.group_size}")

    def validate(self, where: str = "policy") -> None:
        self.validate_config(where)
        if self.format == "nuq":
            if self.codebook is None or self.codebook.numel() != 2 ** self.bits:
                got = None if self.codebook is None else self.codebook.numel()
                raise CodecError(f"{where}.codebook must hold 2^bits = {2 ** self.bits} levels, got {got}")
            if not torch.isfinite(self.codebook).all() or (self.codebook.diff() <= 0).any():
                raise CodecError(f"{where}.codebook must be finite and strictly increasing")
            if self.axis == "channel" and (self.zero is None or self.range is None):
                raise CodecError(f"{where}: nuq with axis=channel needs calibrated zero and range")
        if self.axis == "channel" and self.outlier_fraction > 0 and (self.lower is None or self.upper is None):
            raise CodecError(f"{where}: channel outliers need calibrated lower and upper bounds")
        if self.format == "fp8" and self.fp8_scale is None:
            raise CodecError(f"{where}: fp8 needs a calibrated fp8_scale")

    def calibrated(self) -> dict[str, torch.Tensor]:
        """The calibrated tensors this policy holds, by field name, in CALIBRATED_FIELDS order."""
        return {name: t for name in CALIBRATED_FIELDS if (t := getattr(self, name)) is not None}

    @property
    def is_full_precision(self) -> bool:
        return self.format == "fp16"


@dataclass
class CachePolicy:
    name: str
    layers: list[tuple[TensorPolicy, TensorPolicy]]   # (key, value) per layer
    key_rope: str = "post"                            # keys quantized before or after RoPE
    n_sink: int = 0                                   # first positions kept in full precision
    residual: int = 0                                 # most recent positions kept in full precision
    smooth: torch.Tensor | None = None                # [L, H_kv, D] SmoothAttention lambda (K / lambda stored)
    prefix_len: int = 0                               # first positions are the prefix, kept in full precision
    prefix_ids: torch.Tensor | None = None            # [P] token ids every sequence is served after
    extra: dict = field(default_factory=dict)

    @property
    def is_full_precision(self) -> bool:
        return all(k.is_full_precision and v.is_full_precision for k, v in self.layers) and self.smooth is None


@dataclass
class Encoded:
    """One layer's K or V in the stored form (codes unpacked, one per uint8; see pack_codes for bytes)."""
    shape: tuple[int, int, int, int]                      # [B, H, T, D]
    codes: torch.Tensor | None = None                     # [B, H, T, D] uint8
    dense: torch.Tensor | None = None                     # [B, H, T, D] fp16 (format fp16) or float8 (fp8)
    scale: torch.Tensor | None = None                     # uniform: [B,H,T,1] (token) | [B,H,n_groups,D] (channel)
    zero: torch.Tensor | None = None                      # same shape as scale (uniform min / nuq zero)
    outlier_index: torch.Tensor | None = None             # [n, 4] int64 (b, h, t, d)
    outlier_value: torch.Tensor | None = None             # [n] fp16
    meta: dict = field(default_factory=dict)

    @property
    def n_outliers(self) -> int:
        return 0 if self.outlier_value is None else int(self.outlier_value.numel())


def _check_input(x: torch.Tensor, where: str) -> None:
    if x.dim() != 4:
        raise CodecError(f"{where}: expected a [B, H, T, D] tensor, got shape {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise CodecError(f"{where}: {int((~torch.isfinite(x)).sum())} non-finite entries in the input")


def token_outlier_bounds(x: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token over all heads: the fraction/2 and 1 - fraction/2 quantiles. -> two [B, 1, T, 1] tensors."""
    b, h, t, d = x.shape
    rows = x.float().permute(0, 2, 1, 3).reshape(b * t, h * d)
    q = torch.tensor([fraction / 2, 1 - fraction / 2], dtype=rows.dtype)
    lo, hi = torch.quantile(rows, q, dim=1)                               # [B*T] each
    return lo.view(b, 1, t, 1), hi.view(b, 1, t, 1)


def _nearest_level(xn: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    mids = (codebook[1:] + codebook[:-1]) / 2
    return torch.bucketize(xn.contiguous(), mids.contiguous()).to(torch.uint8)


def _uniform(x: torch.Tensor, p: TensorPolicy) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    levels = 2 ** p.bits - 1
    if p.axis == "token":
        mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)             # [B, H, T, 1]
        mn, scale = _fp16(mn), _fp16((mx - mn) / levels)
        q = torch.where(scale > 0, (x - mn) / torch.where(scale > 0, scale, 1), 0)
        return q.round().clamp(0, levels).to(torch.uint8), scale, mn
    b, h, t, d = x.shape
    g = p.group_size
    n_groups = -(-t // g)
    pad = n_groups * g - t
    xp = torch.cat([x, x[:, :, -1:].expand(b, h, pad, d)], 2) if pad else x  # repeat the last row: no new range
    grouped = xp.view(b, h, n_groups, g, d)
    mn, mx = grouped.amin(3), grouped.amax(3)                                   # [B, H, G, D]
    mn, scale = _fp16(mn), _fp16((mx - mn) / levels)
    safe = torch.where(scale > 0, scale, 1)
    q = torch.where(scale[:, :, :, None] > 0, (grouped - mn[:, :, :, None]) / safe[:, :, :, None], 0)
    codes = q.round().clamp(0, levels).to(torch.uint8).view(b, h, n_groups * g, d)[:, :, :t]
    return codes, scale, mn


def _fp16(t: torch.Tensor) -> torch.Tensor:
    """Per-token / per-group scales and zero-points are stored in fp16: compute codes with the stored values."""
    return t.to(torch.float16).float()


def _expand_groups(s: torch.Tensor, t: int, g: int) -> torch.Tensor:
    return s.repeat_interleave(g, dim=2)[:, :, :t]


def encode(x: torch.Tensor, p: TensorPolicy, where: str = "tensor") -> Encoded:
    """x: [B, H, T, D] float -> Encoded. Bounds and scales never divide by zero (constant rows encode exactly)."""
    p.validate(where)
    _check_input(x, where)
    x = x.float()
    shape = tuple(x.shape)
    if p.format == "fp16":
        return Encoded(shape, dense=x.to(torch.float16))
    if p.format == "fp8":
        dtype, fmax = FP8[p.fp8_dtype]
        s = _fp8_scale(p, x.shape[1])
        return Encoded(shape, dense=(x / s).clamp(-fmax, fmax).to(dtype))
    inlier, out_idx, out_val = x, None, None
    if p.outlier_fraction > 0:
        if p.axis == "channel":
            lo, hi = p.lower.float()[None, :, None, :], p.upper.float()[None, :, None, :]
        else:
            lo, hi = token_outlier_bounds(x, p.outlier_fraction)
        is_out = (x < lo) | (x > hi)
        out_idx = is_out.nonzero()
        out_val = x[is_out].to(torch.float16)
        inlier = torch.minimum(torch.maximum(x, lo), hi)
    if p.format == "uniform":
        codes, scale, zero = _uniform(inlier, p)
        return Encoded(shape, codes=codes, scale=scale, zero=zero, outlier_index=out_idx, outlier_value=out_val)
    # nuq
    if p.axis == "channel":
        zero, rng = p.zero.float()[None, :, None, :], p.range.float()[None, :, None, :]
    else:
        mn, mx = inlier.amin(-1, keepdim=True), inlier.amax(-1, keepdim=True)
        zero, rng = _fp16((mx + mn) / 2), _fp16((mx - mn) / 2)
    xn = torch.where(rng > 0, (inlier - zero) / torch.where(rng > 0, rng, 1), 0).clamp(-1, 1)
    codes = _nearest_level(xn, p.codebook.float())
    scale = rng if p.axis == "token" else None
    zero_out = zero if p.axis == "token" else None
    return Encoded(shape, codes=codes, scale=scale, zero=zero_out, outlier_index=out_idx, outlier_value=out_val)


def decode(e: Encoded, p: TensorPolicy) -> torch.Tensor:
    """Encoded -> [B, H, T, D] float32."""
    if p.format == "fp16":
        return e.dense.float()
    if p.format == "fp8":
        return e.dense.float() * _fp8_scale(p, e.shape[1])
    t = e.shape[2]
    if p.format == "uniform":
        if p.axis == "token":
            x = e.codes.float() * e.scale + e.zero
        else:
            x = e.codes.float() * _expand_groups(e.scale, t, p.group_size) + _expand_groups(e.zero, t, p.group_size)
    else:
        levels = p.codebook.float()[e.codes.long()]
        if p.axis == "channel":
            x = levels * p.range.float()[None, :, None, :] + p.zero.float()[None, :, None, :]
        else:
            x = levels * e.scale + e.zero
    if e.n_outliers:
        b, h, tt, d = e.outlier_index.unbind(1)
        x = x.index_put((b, h, tt, d), e.outlier_value.float())
    return x


def fake_quant(x: torch.Tensor, p: TensorPolicy, where: str = "tensor") -> tuple[torch.Tensor, Encoded]:
    e = encode(x, p, where)
    return decode(e, p).to(x.dtype), e


def _fp8_scale(p: TensorPolicy, n_heads: int) -> torch.Tensor:
    s = p.fp8_scale.float()
    if p.axis == "head":
        if s.numel() != n_heads:
            raise CodecError(f"fp8_scale per head must have {n_heads} entries, got {s.numel()}")
        return s.view(1, -1, 1, 1)
    return s.reshape(())


def fp8_scale_from_amax(amax: torch.Tensor, fp8_dtype: str = "e4m3") -> torch.Tensor:
    """s = amax / fp8_max (what vLLM and llm-compressor ship); an all-zero amax gives s = 1, never 0."""
    s = amax.float() / FP8[fp8_dtype][1]
    return torch.where(s > 0, s, torch.ones_like(s))


# ---- packing ----------------------------------------------------------------------------------------------

def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Little-endian bit packing along the flattened last axis: element i occupies bits [i*b, (i+1)*b) of the
    byte stream. codes: [..., D] uint8 -> [..., ceil(D*b/8)] uint8."""
    *lead, d = codes.shape
    n_bytes = -(-d * bits // 8)
    if 8 % bits == 0:  # 2, 4, 8 bits: whole codes per byte, element j of a byte at bits [j*b, (j+1)*b)
        per = 8 // bits
        flat = codes.reshape(-1, d)
        if n_bytes * per != d:
            flat = torch.cat([flat, flat.new_zeros(flat.shape[0], n_bytes * per - d)], 1)
        parts = flat.view(-1, n_bytes, per)
        packed = parts[:, :, 0].clone()
        for j in range(1, per):
            packed |= parts[:, :, j] << (bits * j)
        return packed.view(*lead, n_bytes)
    flat = codes.reshape(-1, d).to(torch.int64)
    bit_pos = torch.arange(d) * bits
    out = torch.zeros(flat.shape[0], n_bytes * 8, dtype=torch.int64)
    for k in range(bits):
        out[:, bit_pos + k] = (flat >> k) & 1
    weights = (2 ** torch.arange(8)).view(1, 1, 8)
    packed = (out.view(flat.shape[0], n_bytes, 8) * weights).sum(-1).to(torch.uint8)
    return packed.view(*lead, n_bytes)


def unpack_codes(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    *lead, n_bytes = packed.shape
    if 8 % bits == 0:
        per, mask = 8 // bits, (1 << bits) - 1
        flat = packed.reshape(-1, n_bytes, 1)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
        codes = ((flat >> shifts) & mask).view(-1, n_bytes * per)[:, :d]
        return codes.reshape(*lead, d)
    flat = packed.reshape(-1, n_bytes).to(torch.int64)
    bit_stream = ((flat[:, :, None] >> torch.arange(8)) & 1).view(flat.shape[0], n_bytes * 8)
    bit_pos = torch.arange(d) * bits
    codes = sum(bit_stream[:, bit_pos + k] << k for k in range(bits))
    return codes.to(torch.uint8).view(*lead, d)


# ---- the size model ---------------------------------------------------------------------------------------
# The one definition of how many bits the stored form takes. Evaluation (encoded_bits -> avg_bits), the byte
# ledger (exporters/ledger.py) and the runtime cache (runtime_check/cache.py) all count through it.

FULL_PRECISION_BITS = 16   # fp16 values: format fp16, sink rows, residual rows
FP8_BITS = 8
SPARSE_VALUE_BITS, SPARSE_INDEX_BITS, SPARSE_ROW_COUNT_BITS = 16, 16, 16
SCALE_BITS = 16    # per-token / per-group scales and zero-points (fp16)
STATIC_BITS = 32   # per-layer calibrated tensors, stored float32 in the artifact


def full_precision_bits(b: int, h: int, t: int, d: int) -> int:
    """t rows of [B, H, D] held in fp16."""
    return b * h * t * d * FULL_PRECISION_BITS


def code_row_bits(p: TensorPolicy, d: int) -> int:
    """One (token, head) row of d codes as pack_codes stores it: ceil(d * bits / 8) whole bytes."""
    return 8 * -(-d * p.bits // 8)


def dense_bits(p: TensorPolicy, b: int, h: int, t: int, d: int, n_groups: int | None = None) -> int:
    """t encoded rows of [B, H, D] without the sparse outliers: fp16 / fp8 values, or packed codes plus an fp16
    scale and zero-point per (token, head) (axis token) or per (group, head, channel) (uniform, axis channel).
    n_groups: scale groups of a per-channel uniform tensor; by default ceil(t / group_size), a partial last
    group included (what encode produces; the cache only ever stores whole groups)."""
    if p.format == "fp16":
        return full_precision_bits(b, h, t, d)
    if p.format == "fp8":
        return b * h * t * d * FP8_BITS
    bits = b * h * t * code_row_bits(p, d)
    if p.axis == "token":
        bits += b * h * t * 2 * SCALE_BITS
    elif p.format == "uniform":
        groups = -(-t // p.group_size) if n_groups is None else n_groups
        bits += b * h * groups * d * 2 * SCALE_BITS
    return bits


def sparse_bits(p: TensorPolicy, b: int, t: int, n_outliers: int | float) -> int | float:
    """Sparse outliers of t encoded rows: an fp16 value + a 16-bit index within the token's row of H*D entries
    per outlier, and a 16-bit outlier count per token row. n_outliers may be an expected (fractional) count."""
    if p.format not in ("uniform", "nuq") or p.outlier_fraction <= 0:
        return 0
    return b * t * SPARSE_ROW_COUNT_BITS + n_outliers * (SPARSE_VALUE_BITS + SPARSE_INDEX_BITS)


def stored_bits(p: TensorPolicy, b: int, h: int, t: int, d: int, n_outliers: int | float = 0,
                n_groups: int | None = None) -> int | float:
    """t encoded rows of one layer's K or V ([B, H, t, D]) under p; the per-layer static tensors excluded."""
    return dense_bits(p, b, h, t, d, n_groups) + sparse_bits(p, b, t, n_outliers)


def encoded_bits(e: Encoded, p: TensorPolicy) -> int:
    """Bits this encoded tensor occupies in the stored form (see stored_bits)."""
    b, h, t, d = e.shape
    return stored_bits(p, b, h, t, d, e.n_outliers)


def static_bits(p: TensorPolicy) -> int:
    """Per-layer calibrated tensors a consumer loads once: codebook, static zero/range/bounds, fp8 scales."""
    return sum(t.numel() * STATIC_BITS for t in p.calibrated().values())
