"""Outlier-token prefix (PrefixQuant, Chen et al. 2024, sec. 4; `utils/stat_utils.py`) and its full-precision
K/V (IntactKV, Liu et al. 2024).

Discovery, from the traces stage's down_proj-input statistics: per sample and layer, a token is an outlier
when its max|x| over channels divided by the sample's median of those maxima exceeds eta. The number of
prefix tokens n = ceil(max over layers of the mean outlier count per sample); the prefix is the n most
frequent outlier token ids (counted over samples and layers; ties to the smaller id), then BOS.

Choices, written down:
- position 0 is left out of the frequency count (as PrefixQuant does): the first token of a window is an
  outlier because of where it stands, not what it is, and BOS takes that role in the prefix; it still counts
  towards n.
- n is truncated to `max_tokens` (the cap); an explicit `n_tokens` above the cap is an error, and so is a cap
  above the traces' top-k (the counts could not see that many). A sample with more outliers in a layer than
  the traces keep (down_top_k) counts as top-k: the meta reports such (sample, layer) pairs as `saturated`.
- when fewer distinct outlier tokens exist than n, the prefix holds the ones there are.
- ids are stored, not strings, with the tokenizer identity (ModelSpec.tokenizer_sha256).

The prefix's K/V come from one full-precision forward of the prefix alone: pre-RoPE K (stages.hooks.key_module),
post-RoPE K and V, each [L, H_kv, P, D] in the model's dtype. Injected as past key values they reproduce
running prefix + window as one sequence (positions continue at P).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from stages.base import Context, Declaration, InputError, StageResult
from stages.hooks import (attention_layers, attention_override, forward_hooks, head_rows, key_module, model_device,
                          sdpa_attention)


@dataclass
class PrefixConfig:
    """The prefix is `n` outlier token ids, then BOS. The discovered n is truncated to max_tokens; an explicit
    n_tokens above max_tokens is an error."""
    eta: float = 64.0           # outlier token: down_proj-input token max / the sample's median > eta
    max_tokens: int = 4         # cap on n (BOS not counted); at most traces.down_top_k
    n_tokens: int = -1          # -1: discover n from the traces; >= 0: use this many outlier tokens


@dataclass
class Inputs:
    model: torch.nn.Module
    spec: object                          # pipeline.model.ModelSpec (bos_token_id, tokenizer_sha256, ...)
    traces: dict[str, torch.Tensor]       # the traces stage's tensors (down_ratio, down_token, down_pos)


def validate(cfg: PrefixConfig, top_k: int) -> None:
    if not cfg.eta > 1:
        raise InputError(f"prefix.eta must be > 1 (a ratio to the median), got {cfg.eta}")
    if not 0 <= cfg.max_tokens <= top_k:
        raise InputError(f"prefix.max_tokens must be in [0, traces.down_top_k={top_k}] (the traces keep the top "
                         f"{top_k} tokens per sample and layer), got {cfg.max_tokens}")
    if cfg.n_tokens < -1:
        raise InputError(f"prefix.n_tokens must be -1 (discover) or >= 0, got {cfg.n_tokens}")
    if cfg.n_tokens > cfg.max_tokens:
        raise InputError(f"prefix.n_tokens={cfg.n_tokens} asks for a prefix longer than the cap "
                         f"prefix.max_tokens={cfg.max_tokens}")


def discover(down_ratio: torch.Tensor, down_token: torch.Tensor, down_pos: torch.Tensor, bos_id: int | None,
             cfg: PrefixConfig) -> tuple[list[int], dict]:
    """down_ratio / down_token / down_pos [N, L, K] (top-K per sample and layer) -> (prefix ids ending in BOS, meta)."""
    top_k = down_ratio.shape[-1]
    validate(cfg, top_k)
    if bos_id is None:
        raise InputError("prefix: the tokenizer has no BOS token (bos_token_id is None), and the prefix ends in "
                         "BOS; use a recipe without quant.prefix for this model")
    outlier = down_ratio > cfg.eta                                    # [N, L, K]
    counts = outlier.sum(-1)                                          # [N, L]
    mean_per_layer = counts.double().mean(0)                          # [L]
    n_found = math.ceil(float(mean_per_layer.max())) if counts.numel() else 0
    n = min(n_found, cfg.max_tokens) if cfg.n_tokens < 0 else cfg.n_tokens
    freq = Counter(down_token[outlier & (down_pos > 0)].tolist())
    ranked = sorted(freq.items(), key=lambda kv: (-kv[1], kv[0]))
    chosen = [tok for tok, _ in ranked[:n]]
    meta = {"eta": cfg.eta, "n_found": n_found, "n_requested": cfg.n_tokens, "n_used": len(chosen),
            "max_tokens": cfg.max_tokens, "mean_outliers_per_layer": [round(float(x), 4) for x in mean_per_layer],
            "outlier_layer": int(mean_per_layer.argmax()) if counts.numel() else -1,
            "frequency": {str(tok): c for tok, c in ranked[: max(n, 8)]},
            "saturated": int((counts == top_k).sum()), "top_k": top_k}
    return chosen + [int(bos_id)], meta


def prefix_kv(model: torch.nn.Module, spec, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """ids [P] -> k_pre, k_post, v [L, H_kv, P, D] from one full-precision forward of the prefix alone."""
    n_layers, p = spec.n_layers, ids.numel()
    k_pre, k_post, v = ([None] * n_layers for _ in range(3))

    def on_k(layer: int):
        def hook(_m, _inp, out):  # [1, P, H*D] (k_proj) or [1, H, P, D] (a per-head key norm) -> [H, P, D]
            k_pre[layer] = head_rows(out, spec.n_kv_heads, spec.head_dim)[0].detach().transpose(0, 1)
        return hook

    def keep(module, query, key, value, mask, scaling):
        k_post[module.layer_idx], v[module.layer_idx] = key[0].detach(), value[0].detach()
        return sdpa_attention(query, key, value, mask, scaling)

    hooks = [(key_module(a), on_k(i), False) for i, a in enumerate(attention_layers(model))]
    device = model_device(model)
    with torch.no_grad(), forward_hooks(hooks), attention_override(model, keep):
        model.model(ids[None].to(device), use_cache=False)
    return {"k_pre": torch.stack(k_pre).cpu(), "k_post": torch.stack(k_post).cpu(), "v": torch.stack(v).cpu()}


def fit(inputs: Inputs, cfg: PrefixConfig) -> StageResult:
    """-> ids [P] and the prefix K/V."""
    model, spec, traces = inputs.model, inputs.spec, inputs.traces
    ids, meta = discover(traces["down_ratio"], traces["down_token"], traces["down_pos"], spec.bos_token_id, cfg)
    ids_t = torch.tensor(ids, dtype=torch.int64)
    meta |= {"ids": ids, "prefix_len": len(ids), "tokenizer_sha256": spec.tokenizer_sha256}
    return StageResult({"ids": ids_t, **prefix_kv(model, spec, ids_t)}, meta)


def prepend(ids: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """ids [P], windows [N, T] -> [N, P + T]: every window served after the prefix."""
    return torch.cat([ids[None].expand(windows.shape[0], -1).to(windows), windows], dim=1)


def _fit_stage(ctx: Context, inputs: dict, cfg: PrefixConfig, progress) -> StageResult:
    return fit(Inputs(ctx.model, ctx.spec, inputs["traces"].tensors), cfg)


STAGE = Declaration("prefix_tokens", PrefixConfig, _fit_stage, inputs=lambda c: ["traces"])
