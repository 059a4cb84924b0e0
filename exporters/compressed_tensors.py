"""FP8 KV-cache scales in the layout vLLM and SGLang load (llm-compressor / compressed-tensors convention).

`config.json` gets `quantization_config = {quant_method: "compressed-tensors", format, config_groups: {},
kv_cache_scheme: {num_bits: 8, type: "float", strategy: "tensor" | "attn_head", symmetric: true, dynamic: false}}`
and the tensors `model.layers.N.self_attn.k_scale` / `v_scale` (float32; shape [] per tensor, [n_kv_heads] per
head) go into a safetensors file beside the model's weights. scale = amax / 448 (E4M3): a runtime stores
fp8(x / scale) and multiplies back. Scales come from calibration, never defaults: an all-zero amax gives 1.0
only for a channel that never fired, and an all-one scale set is refused (the silent-default failure users
report for other tools).
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file

SCALES_FILE = "kv_cache_scales.safetensors"
STRATEGIES = {"tensor": "tensor", "head": "attn_head"}


def kv_scale_tensors(k_scales: list[torch.Tensor], v_scales: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for i, (k, v) in enumerate(zip(k_scales, v_scales)):
        for name, s in (("k_scale", k), ("v_scale", v)):
            s = s.detach().float().reshape(-1) if s.dim() else s.detach().float().reshape(())
            if not torch.isfinite(s).all() or (s <= 0).any():
                raise ValueError(f"layer {i} {name}: scales must be finite and positive, got {s.tolist()}")
            out[f"model.layers.{i}.self_attn.{name}"] = s.contiguous()
    if all(bool((t == 1).all()) for t in out.values()):
        raise ValueError("every k_scale / v_scale is 1.0: refusing to export uncalibrated default scales")
    return out


def quantization_config(axis: str) -> dict:
    if axis not in STRATEGIES:
        raise ValueError(f"fp8 scale axis must be one of {tuple(STRATEGIES)}, got {axis!r}")
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {},
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": STRATEGIES[axis], "symmetric": True,
                                "dynamic": False}}


def write(directory: str | Path, model_config: dict, k_scales: list[torch.Tensor], v_scales: list[torch.Tensor],
          axis: str, overwrite: bool = False) -> Path:
    """Writes config.json (the model's config plus quantization_config) and kv_cache_scales.safetensors."""
    final = Path(directory)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{str(final)!r} already exists; pass overwrite=True to replace it")
    tensors = kv_scale_tensors(k_scales, v_scales)
    config = dict(model_config)
    config["quantization_config"] = quantization_config(axis)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, str(tmp / SCALES_FILE))
        (tmp / "config.json").write_text(json.dumps(config, indent=1, default=str))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
