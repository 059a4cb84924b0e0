"""Model instrumentation without editing model code: forward hooks on the projections, and an attention
function registered with transformers' AttentionInterface that calls whatever the active stage installs.
Registration happens on the first `attention_override` (importing this module changes nothing in transformers).

The attention function receives post-RoPE queries and keys [B, H, T, D]; the k_proj hook sees pre-RoPE keys.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from exporters.rope import rotary_tables
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, eager_mask, sdpa_mask

ATTN_NAME = "kvcalib"
SERVE_NAME = "kvcalib-serve"  # the same dispatch, with serving_mask: None for a causal, unpadded batch
_ACTIVE: list[Callable] = []


def _dispatch(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    fn = _ACTIVE[-1] if _ACTIVE else None
    if fn is None:
        return eager_attention(query, key, value, attention_mask, scaling), None
    return fn(module, query, key, value, attention_mask, scaling), None


_REGISTERED: list[bool] = []


def serving_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function: Callable = causal_mask_function, attention_mask: torch.Tensor | None = None,
                 local_size: int | None = None, **kwargs) -> torch.Tensor | None:
    """The mask of the serving attention: None when every query sees exactly the positions up to its own (causal,
    no padding, no local window) -- the attention applies that rule by position and never holds a [T_q, T_k]
    mask -- else transformers' boolean [B, 1, T_q, T_k] mask (True: attended)."""
    if mask_function is causal_mask_function and local_size is None and (attention_mask is None
                                                                        or bool(attention_mask.all())):
        return None
    if attention_mask is not None:
        attention_mask = attention_mask.bool()
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                     local_size, allow_is_causal_skip=False, **kwargs)


MASKS = {"eager": ATTN_NAME, "serving": SERVE_NAME}


def register_attention() -> None:
    """Register the dispatching attention with transformers under ATTN_NAME (eager additive float masks) and
    SERVE_NAME (serving_mask); idempotent."""
    if not _REGISTERED:
        AttentionInterface.register(ATTN_NAME, _dispatch)
        AttentionMaskInterface.register(ATTN_NAME, eager_mask)
        AttentionInterface.register(SERVE_NAME, _dispatch)
        AttentionMaskInterface.register(SERVE_NAME, serving_mask)
        _REGISTERED.append(True)


@contextmanager
def attention_override(model: torch.nn.Module, fn: Callable, mask: str = "eager") -> Iterator[None]:
    """Within the block every attention layer calls fn(module, q, k, v, mask, scaling) -> [B, T, H_q, D].
    mask: "eager" (transformers' additive float mask [B, 1, T_q, T_k]) or "serving" (serving_mask: None or
    boolean)."""
    if mask not in MASKS:
        raise ValueError(f"attention_override: mask must be one of {sorted(MASKS)}, got {mask!r}")
    register_attention()
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = MASKS[mask]
    _ACTIVE.append(fn)
    try:
        yield
    finally:
        _ACTIVE.pop()
        config._attn_implementation = previous


@contextmanager
def forward_hooks(hooks: list[tuple[torch.nn.Module, Callable, bool]]) -> Iterator[None]:
    """(module, fn, pre) triples: pre=True registers a forward-pre hook (sees inputs), else a forward hook."""
    handles = [m.register_forward_pre_hook(fn) if pre else m.register_forward_hook(fn) for m, fn, pre in hooks]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


def rope_tables(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    """{"cos", "sin"} [1, T, D] of the model's own rotary module at positions 0..T-1 of ids [B, T], in the
    model's dtype (what its attention applies)."""
    cos, sin = rotary_tables(model.model.rotary_emb, 0, ids.shape[1], next(model.parameters()).dtype)
    return {"cos": cos.to(ids.device), "sin": sin.to(ids.device)}


def group_queries(query: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """[B, H_q, T, D] -> [B, H_kv, G, T, D]: query heads grouped under the KV head they read (GQA)."""
    b, hq, t, d = query.shape
    return query.view(b, n_kv_heads, hq // n_kv_heads, t, d)


def attention_scores(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """fp32 logits [B, H_kv, G, T_q, T_k] with the additive mask applied (causal if mask is None)."""
    q = group_queries(query.float(), key.shape[1])
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q, key.float()) * scaling
    if mask is None:
        t_q, t_k = scores.shape[-2:]
        causal = torch.ones(t_q, t_k, dtype=torch.bool, device=scores.device).tril(t_k - t_q)
        return scores.masked_fill(~causal, float("-inf"))
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask[:, :, None], float("-inf"))
    return scores + mask[:, :, None].float()


def attend(probs: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """probs [B, H_kv, G, T_q, T_k] x value [B, H_kv, T_k, D] -> [B, T_q, H_q, D]"""
    out = torch.einsum("bhgqk,bhkd->bhgqd", probs, value.float())
    b, h, g, t, d = out.shape
    return out.reshape(b, h * g, t, d).transpose(1, 2).contiguous().to(dtype)


def sdpa_attention(query, key, value, mask, scaling) -> torch.Tensor:
    """torch SDPA with GQA; causal when no mask is given. -> [B, T_q, H_q, D]"""
    import torch.nn.functional as F

    if mask is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=query.shape[2] > 1, scale=scaling,
                                             enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask.to(query.dtype) if mask.dtype != torch.bool else mask,
                                             scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def eager_attention(query, key, value, mask, scaling) -> torch.Tensor:
    probs = torch.softmax(attention_scores(query, key, mask, scaling), dim=-1)
    return attend(probs, value, query.dtype)
