"""Identity hashes: one definition of how files, tensors and configs are fingerprinted."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    with open(path, "rb") as f:
        return sha256_stream(f, chunk)


def sha256_stream(f, chunk: int = 1 << 22) -> str:
    """sha256 of what is left to read in a binary file object, read `chunk` bytes at a time."""
    h = hashlib.sha256()
    while block := f.read(chunk):
        h.update(block)
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements in row-major order, little-endian (the host's order: torch runs little-endian)."""
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""  # reshape: 0-d scalars too


def sha256_bytes(t: torch.Tensor) -> str:
    """The artifact's per-tensor checksum (manifest `tensors.<name>.sha256`): sha256 of exactly the bytes the
    safetensors data section stores for the tensor, nothing else (docs/manifest.md)."""
    return hashlib.sha256(_raw_bytes(t)).hexdigest()


def sha256_tensor(t: torch.Tensor) -> str:
    """An identity fingerprint (model weights, data windows: stage-cache keys): sha256 of "dtype:shape:" + the
    raw bytes, so equal bytes of another dtype or shape differ. Not the manifest's tensor checksum
    (sha256_bytes); kept as is so that existing stage caches stay valid."""
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}:".encode())
    h.update(_raw_bytes(t))
    return h.hexdigest()
