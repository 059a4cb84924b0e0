"""Model instrumentation without editing model code: forward hooks on the projections, and an attention
function registered with transformers' AttentionInterface that calls whatever the active stage installs.
Registration happens on the first `attention_override` (importing this module changes nothing in transformers).

The attention function receives post-RoPE queries and keys [B, H, T, D]; a hook on key_module / query_module
(k_proj / q_proj, or the q/k norm after them where the attention has one: Gemma 3) sees the keys and queries
just before RoPE. Local (sliding-window) and global layers may rotate with different tables: model_rotaries,
rope_tables / layer_rope give each layer its own; layer_windows each layer's window.
"""
from __future__ import annotations

import functools
import json
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from exporters.errors import InputError
from exporters.rope import layer_rotaries, rotary_tables

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
                 mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
                 local_size: int | None = None, **kwargs) -> torch.Tensor | None:
    """The mask of the serving attention: None when every query sees exactly the positions up to its own (causal,
    no padding, no local window) -- the attention applies that rule by position and never holds a [T_q, T_k]
    mask -- else transformers' boolean [B, 1, T_q, T_k] mask (True: attended). mask_function None: causal.
    (transformers is imported here and in register_attention, not at the top: importing the stages' configs --
    what validating a command line needs -- stays light.)"""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = causal_mask_function if mask_function is None else mask_function
    if mask_function is causal_mask_function and local_size is None and (attention_mask is None
                                                                        or bool(attention_mask.all())):
        return None
    if attention_mask is not None:
        attention_mask = attention_mask.bool()
    kwargs.pop("allow_is_causal_skip", None)  # always materialized (transformers passes it for sliding masks)
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                     local_size, allow_is_causal_skip=False, **kwargs)


MASKS = {"eager": ATTN_NAME, "serving": SERVE_NAME}


def register_attention() -> None:
    """Register the dispatching attention with transformers under ATTN_NAME (eager additive float masks) and
    SERVE_NAME (serving_mask); idempotent."""
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask

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


@contextmanager
def patched_forwards(layers, wrap: Callable[[int, Callable], Callable]) -> Iterator[None]:
    """Within the block layer i's forward is wrap(i, its forward as it is now); on exit each layer's forward is
    what it was before -- a forward set on the layer object by someone else (accelerate's device-alignment hook
    under a device_map) put back, the class's own where there was none."""
    saved = [layer.__dict__.get("forward") for layer in layers]
    for i, layer in enumerate(layers):
        layer.forward = wrap(i, layer.forward)
    try:
        yield
    finally:
        for layer, own in zip(layers, saved):
            if own is None:
                del layer.forward
            else:
                layer.forward = own


@contextmanager
def replayed_layers(layers, outputs: list[torch.Tensor], upto: int) -> Iterator[None]:
    """Within the block decoder layers 0 .. upto-1 return outputs[i] (what a recorded forward's layer i returned)
    instead of computing: a forward that differs from a recorded one only from layer `upto` on computes only from
    there, with the same results (each layer's output depends on its input and its own attention alone). The
    decoder layers of the supported models return their hidden states as one tensor, which is what is replayed."""
    with patched_forwards(layers[:upto], lambda i, _forward: functools.partial(_replay, outputs[i])):
        yield


def _replay(output: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return output


def model_device(model: torch.nn.Module) -> torch.device:
    """Where a model's activations start (its input embedding): the device a stage feeds ids to. Under accelerate's
    device_map a model spans GPUs, so what a hook receives is on that layer's device: stages allocate running state
    on the activations' device and move results to CPU when they return."""
    return model.get_input_embeddings().weight.device


LOGIT_BUDGET_BYTES = 256 * 2 ** 20  # one chunk of float32 full-vocabulary logits (evaluation, Fisher's loss)


def logit_rows(vocab_size: int) -> int:
    """Positions per chunk of full-vocabulary float32 logits: 1365 at SmolLM2's 49152, 523 at Llama-3's 128256."""
    return max(1, LOGIT_BUDGET_BYTES // (4 * vocab_size))


def lm_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The model's head on final hidden states [..., hidden] -> float32 logits [..., V], with the final logit
    soft-capping of the models that have one (what model(...).logits computes, for any slice of positions)."""
    logits = model.lm_head(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


def key_module(attn: torch.nn.Module) -> torch.nn.Module:
    """The module whose output is the layer's pre-RoPE keys: the keys just before RoPE, so the key norm where the
    attention has one (Gemma 3's k_norm), else k_proj. Its output: see head_rows."""
    norm = getattr(attn, "k_norm", None)
    return attn.k_proj if norm is None else norm


def query_module(attn: torch.nn.Module) -> torch.nn.Module:
    """The module whose output is the layer's pre-RoPE queries: q_norm where there is one, else q_proj."""
    norm = getattr(attn, "q_norm", None)
    return attn.q_proj if norm is None else norm


def head_rows(out: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """A key_module / query_module output (or its gradient) as rows [B, T, H, D]: a projection's [B, T, H*D], or a
    per-head norm's [B, H, T, D] (Gemma 3 normalizes after the head transpose; the norm shares the layout of its
    input, so the supported models' 4-D outputs are all [B, H, T, D])."""
    if out.dim() == 3:
        return out.view(out.shape[0], out.shape[1], n_heads, head_dim)
    if out.dim() == 4 and out.shape[1] == n_heads and out.shape[3] == head_dim:
        return out.transpose(1, 2)
    raise ValueError(f"head_rows: expected [B, T, {n_heads}*{head_dim}] or [B, {n_heads}, T, {head_dim}], "
                     f"got {tuple(out.shape)}")


LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}  # transformers' names -> the manifest's


def layer_windows(config) -> list[int | None]:
    """Per layer, the window a local layer attends within -- the query's own position and the window - 1 before
    it, as transformers' sliding mask -- or None for a global layer: from config.layer_types where the config has
    them (Gemma 3, Qwen 2), else the config's sliding_window for every layer (Mistral), else all global. A layer
    type other than full / sliding attention is refused by name."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return [int(window) if window else None] * n
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != n:
        raise ValueError(f"config.layer_types: allowed {sorted(LAYER_TYPES)} for each of {n} layers, got {list(types)}")
    if "sliding_attention" in types and not window:
        raise ValueError(f"config.layer_types has sliding_attention layers but sliding_window is {window!r}")
    return [int(window) if t == "sliding_attention" else None for t in types]


def config_binding(config) -> dict:
    """What a manifest written for this model binds it to (exporters.manifest.model_binding of its `model` field),
    from the transformers config alone: n_layers, n_q_heads, n_kv_heads, head_dim, rope {theta, scaling (the rope
    parameters beyond theta, as JSON gives them back), pairing, and local {theta, scaling} for a model with sliding
    layers}, attention {layer_types ("full" | "sliding" per layer), sliding_window} for such a model, and
    max_positions. The one definition: pipeline.model.model_spec builds the manifest's fields from it, a serving
    cache compares an artifact's binding with it. Raises InputError for a config without RoPE (rope_theta missing)
    and ValueError (layer_windows) for layer types it does not know."""
    windows = layer_windows(config)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    local: dict = {}
    if set(rope) & set(LAYER_TYPES):  # one set of RoPE parameters per layer type (Gemma 3)
        rope, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    theta = float(rope.pop("rope_theta", getattr(config, "rope_theta", 0.0)) or 0.0)
    local_theta = float(local.pop("rope_theta", 0.0) or 0.0)
    if theta <= 0 or (local and local_theta <= 0):
        raise InputError("no rotary embedding (rope_theta missing); only RoPE models are handled")
    sliding = [w for w in windows if w is not None]
    if sliding and not local:  # one RoPE for every layer (Mistral's sliding window)
        local_theta, local = theta, dict(rope)
    as_json = lambda x: json.loads(json.dumps(x, sort_keys=True))  # noqa: E731  (what a manifest reads back)
    n_q = config.num_attention_heads
    out = {"n_layers": config.num_hidden_layers, "n_q_heads": n_q,
           "n_kv_heads": getattr(config, "num_key_value_heads", None) or n_q,
           "head_dim": getattr(config, "head_dim", None) or config.hidden_size // n_q,
           "rope": {"theta": theta, "scaling": as_json(rope), "pairing": "rotate_half"},
           "max_positions": int(config.max_position_embeddings)}
    if sliding:
        out["attention"] = {"layer_types": ["full" if w is None else "sliding" for w in windows],
                            "sliding_window": max(sliding)}
        out["rope"]["local"] = {"theta": local_theta, "scaling": as_json(local)}
    return out


def model_rotaries(model: torch.nn.Module) -> list:
    """The rotary module each decoder layer applies (exporters.rope.layer_rotaries): the model's one module for
    every layer, or, where local (sliding) and global layers rotate differently (Gemma 3), that layer type's."""
    c = model.config
    return layer_rotaries(model.model.rotary_emb, getattr(c, "layer_types", None), c.num_hidden_layers)


def rope_tables(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    """RoPE tables at positions 0..T-1 of ids [B, T], float32 whatever the model's dtype (exporters/rope.py's
    convention, the tables the serving cache and its readers rotate stored keys with):
    {"layers": [(cos, sin) [1, T, D] per layer]} (layers sharing a rotary module share the tensors), plus
    {"cos", "sin"} when every layer uses the same table. Read a layer's with layer_rope."""
    tables: dict = {}
    layers = []
    for rotary in model_rotaries(model):
        if rotary not in tables:
            cos, sin = rotary_tables(rotary, 0, ids.shape[1])
            tables[rotary] = (cos.to(ids.device), sin.to(ids.device))
        layers.append(tables[rotary])
    out: dict = {"layers": layers}
    if len(tables) == 1:
        out["cos"], out["sin"] = layers[0]
    return out


def layer_rope(rope: dict, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [1, T, D] of one layer from rope_tables' result."""
    return rope["layers"][layer] if "layers" in rope else (rope["cos"], rope["sin"])


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
