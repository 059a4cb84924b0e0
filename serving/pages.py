"""The page table both decode kernels read: each stored page of a layer's K and V, laid out once.

One int64 row per page: its first position and rows, then for K and for V the side's N_SIDE fields -- data address
and its 4 strides; scale and zero addresses and their 4 strides (per-token / per-group scales); addresses of the
outlier counts, their exclusive prefix sum, the indices and the values. Addresses are in elements of the tensor
(data_ptr // element size: a reader multiplies back by the element size it knows); unused fields are 0. The
Triton kernel (serving/triton_attention.py) reads the addresses relative to the first page's, the CPU
kernel (serving/cpu_attention.py) as they are. The format and scale-layout codes (FMT_*, SC_*) are those
both kernels branch on. This module imports neither kernel's compiler.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from exporters.codec import FP8, TensorPolicy
from exporters.layout import StoredBlock

FMT_FP16, FMT_FP8, FMT_UNIFORM, FMT_NUQ = 0, 1, 2, 3
# where a row's scale / zero live: none (fp16), per token [B,H,T,1], per channel group [B,H,G,D],
# static per channel [H,D] (nuq keys), one per head or tensor (fp8)
SC_NONE, SC_TOKEN, SC_GROUP, SC_STATIC, SC_HEAD = 0, 1, 2, 3, 4
N_SIDE, N_PAGE = 15, 2 + 2 * 15
_FORMATS = {"fp16": FMT_FP16, "fp8": FMT_FP8, "uniform": FMT_UNIFORM, "nuq": FMT_NUQ}


_LUTS: dict[tuple[str, str], torch.Tensor] = {}


def fp8_lut(fp8_dtype: str, device) -> torch.Tensor:
    """[256] float32: the value of every fp8 byte (the kernel's fp8 decode is lut[byte] * scale). Built once per
    dtype and device: building it is a host-to-device copy."""
    key = (fp8_dtype, str(device))
    if key not in _LUTS:
        dtype = FP8[fp8_dtype][0]
        _LUTS[key] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float().to(device)
    return _LUTS[key]


def strides4(t: torch.Tensor) -> list[int]:
    assert t.dim() == 4, t.shape
    return list(t.stride())


@dataclass
class PageSide:
    """One page's K or V as the kernel reads it: its fields of the page table (N_SIDE) and the tensors they
    address (data, scale, zero, outlier counts, their exclusive prefix sum, indices, values; None: absent). The
    first page's tensors are the launch's pointer arguments, the others are reached by address."""
    fields: list[int]
    tensors: tuple
    outliers: bool


def _addr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr() // t.element_size()


def _flat(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1)
    return t if t.stride() == (1,) else t.contiguous()


def side_args(block: StoredBlock, p: TensorPolicy, smode: int) -> PageSide:
    """Lay out one page of one side (K or V): its stored tensors, their strides and the exclusive prefix sum of its
    outlier counts (computed on the device: no host read). Called once per page (see laid_out)."""
    s = block.tensors
    fmt = _FORMATS[p.format]
    if fmt in (FMT_UNIFORM, FMT_NUQ):
        data = s["codes"]
    elif fmt == FMT_FP8:
        data = s["dense"].view(torch.uint8)  # the same bytes, read through the fp8 table
    else:
        data = s["dense"]
    scale = zero = None
    sc_strides = [0, 0, 0, 0]
    if smode in (SC_TOKEN, SC_GROUP):
        scale, zero = s["scale"], s["zero"]
        if scale.stride() != zero.stride():
            raise ValueError(f"scale and zero must share a layout, got strides {scale.stride()} and {zero.stride()}")
        sc_strides = strides4(scale)
    counts = offsets = index = value = None
    if "outlier_count" in s:
        counts = _flat(s["outlier_count"])                    # [T * B], row t * B + b
        offsets = torch.cumsum(counts, 0) - counts            # int64: each row's first entry in the lists
        index, value = _flat(s["outlier_index"]), _flat(s["outlier_value"])
    tensors = (data, scale, zero, counts, offsets, index, value)
    fields = [_addr(data), *strides4(data), _addr(scale), _addr(zero), *sc_strides,
              *(_addr(t) for t in tensors[3:])]
    return PageSide(fields, tensors, counts is not None)


_LAID_OUT: dict[tuple, tuple[weakref.ref, PageSide]] = {}


def laid_out(block: StoredBlock, p: TensorPolicy, smode: int) -> PageSide:
    """A page's layout, made once: a page the cache holds is immutable (exporters.layout.PagedRows never changes a
    full page, and the page still being written is a new view at every step), so its layout is kept while the
    page object lives and found again by identity. A StoredBlock whose tensors change in place must be a new
    object."""
    key = (id(block), p.format, smode)
    held = _LAID_OUT.get(key)
    if held is not None and held[0]() is block:
        return held[1]
    side = side_args(block, p, smode)
    _LAID_OUT[key] = (weakref.ref(block, lambda _, key=key: _LAID_OUT.pop(key, None)), side)
    return side


def side_flags(p: TensorPolicy) -> dict:
    """The constexpr flags of one side: format, bits, where its scales live, the group of per-channel scales."""
    fmt = _FORMATS[p.format]
    smode, group = SC_NONE, 1
    if fmt == FMT_FP8:
        smode = SC_HEAD
    elif fmt in (FMT_UNIFORM, FMT_NUQ):
        if p.axis == "token":
            smode = SC_TOKEN
        elif p.format == "uniform":
            smode, group = SC_GROUP, p.group_size
        else:
            smode = SC_STATIC
    return {"FMT": fmt, "BITS": max(1, p.bits if fmt in (FMT_UNIFORM, FMT_NUQ) else 8), "SMODE": smode,
            "GROUP": group}
