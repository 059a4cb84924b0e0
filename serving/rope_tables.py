"""The RoPE tables the readers of the stored cache rotate keys with: one table per rotary module, sliced per block.

Shared by the block-wise torch attention (serving/blockwise.py) and the fused CPU kernel
(serving/cpu_attention.py), below both (neither imports the other for it).
"""
from __future__ import annotations

import weakref

import torch

from exporters.rope import rotary_tables

_ROPE: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def rope_at(rotary: torch.nn.Module, start: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, D] float32 at positions start..start+n-1 on `device`: slices of one table per rotary module
    (positions 0..N-1 from exporters.rope.rotary_tables, N grown as positions come: a quarter beyond the last one
    asked, at least 4096), so that every block, layer and step reads the same table instead of recomputing it.
    Each entry is cos / sin of one product position x inv_freq, so a slice equals the tables computed at `start`.
    Recomputed when inv_freq changes; rotary modules that rescale with the sequence length ("dynamic" rope types)
    compute every call. The table is held beside the cache (positions x D x 8 bytes: 16 MB at 32k, D = 64)."""
    if "dynamic" in str(getattr(rotary, "rope_type", "")):
        cos, sin = rotary_tables(rotary, start, n)  # float32: exporters/rope.py's convention
        return cos[0].to(device), sin[0].to(device)
    key = (rotary.inv_freq.data_ptr(), rotary.inv_freq._version, str(device))
    held = _ROPE.get(rotary)
    end = start + n
    if held is None or held[0] != key or held[1].shape[0] < end:
        cos, sin = rotary_tables(rotary, 0, max(4096, end + end // 4))
        held = _ROPE[rotary] = (key, cos[0].to(device), sin[0].to(device))
    return held[1][start:end], held[2][start:end]


def _repeated_halves(cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the tables [n, D] repeat their frequencies in both halves (every rotary module transformers has)."""
    h = cos.shape[-1] // 2
    return cos.shape[-1] % 2 == 0 and torch.equal(cos[:, :h], cos[:, h:]) and torch.equal(sin[:, :h], sin[:, h:])
