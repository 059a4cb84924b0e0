"""Activation traces: per-layer running statistics and a bounded reservoir of K/V rows.

What later stages need (KVQuant, Hooper et al. 2024 sec. 3; QServe, Lin et al. 2024 sec. 4.2; PrefixQuant,
Chen et al. 2024 sec. 4): per-channel pre-/post-RoPE key ranges and moments, value per-token ranges,
per-channel query abs-max and mean square, the down_proj input's per-token maxima (outlier tokens), attention mass on the
first positions (sinks), and a uniform reservoir of pre-RoPE K and V rows with their (sample, position).

Memory is bounded: running statistics are [n_layers, H, D]; the reservoir is fixed-size (Algorithm R with the
slot choice made before each forward, so every layer stores the same token rows); per sample only the
`down_top_k` largest down_proj-input maxima are kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from stages.base import Context, Declaration, calib_units, InputError, StageResult, check_finite
from stages.hooks import (attention_layers, attention_override, attention_scores, forward_hooks, head_rows,
                          key_module, model_device, query_module, sdpa_attention)
from stages.prefix_tokens import prepend


@dataclass
class TracesConfig:
    reservoir_size: int = 4096  # sampled token rows of pre-RoPE K and V kept per layer
    n_first_positions: int = 8  # attention mass received by each of the first positions
    down_top_k: int = 16        # per sample and layer, the largest down_proj-input token maxima kept
    mass_query_stride: int = 8  # attention mass on the first positions is estimated on every k-th query row
    seed: int = 0


@dataclass
class Inputs:
    model: torch.nn.Module
    spec: object                # pipeline.model.ModelSpec (n_layers, n_kv_heads, n_q_heads, head_dim)
    windows: torch.Tensor       # [N, T] token ids


class _Moments:
    """Running min / max / abs-max / sum / sum of squares over tokens, per (layer, head, channel)."""

    def __init__(self, n_layers: int, n_heads: int, head_dim: int, device: torch.device | str = "cpu"):
        shape = (n_layers, n_heads, head_dim)
        self.min = torch.full(shape, float("inf"), device=device)
        self.max = torch.full(shape, float("-inf"), device=device)
        self.sum = torch.zeros(shape, dtype=torch.float64, device=device)
        self.sumsq = torch.zeros(shape, dtype=torch.float64, device=device)
        self.count = 0

    def update(self, layer: int, x: torch.Tensor) -> None:
        # x: [T, H, D]
        self.min[layer] = torch.minimum(self.min[layer], x.amin(0))
        self.max[layer] = torch.maximum(self.max[layer], x.amax(0))
        self.sum[layer] += x.double().sum(0)
        self.sumsq[layer] += x.double().square().sum(0)

    def tensors(self, prefix: str, count: int) -> dict[str, torch.Tensor]:
        mean = self.sum / max(count, 1)
        var = (self.sumsq / max(count, 1) - mean.square()).clamp_min(0)
        return {f"{prefix}_min": self.min, f"{prefix}_max": self.max,
                f"{prefix}_absmax": torch.maximum(self.min.abs(), self.max.abs()),
                f"{prefix}_mean": mean.float(), f"{prefix}_std": var.sqrt().float()}


def reservoir_slots(n_seen: int, n_new: int, size: int, gen: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm R for items n_seen .. n_seen+n_new-1 -> (slots, offsets in the batch); when two items of the
    batch land on one slot only the later survives, as in the sequential algorithm.

    Vectorised, and bit-identical to the per-item loop (item g < size goes to slot g; item g >= size draws
    r = gen.integers(0, g + 1) and is kept when r < size): one gen.integers call with the array of bounds draws
    the same numbers as one call per item and leaves the generator in the same state. Slots come in the order
    of their first write in the batch, each with the offset of its last write (the loop's dict order)."""
    g = np.arange(n_seen, n_seen + n_new, dtype=np.int64)
    r = g.copy()
    drawn = g >= size  # a suffix of the batch: only these items draw, in order
    if drawn.any():
        r[drawn] = gen.integers(0, g[drawn] + 1)
    kept = np.flatnonzero(r < size)                         # offsets of the items that write a slot
    slot_of = r[kept]
    _, first = np.unique(slot_of, return_index=True)        # first write of each slot (the dict's key order)
    _, last_rev = np.unique(slot_of[::-1], return_index=True)
    last = len(slot_of) - 1 - last_rev                      # last write of each slot (the survivor)
    order = np.argsort(first, kind="stable")
    return (torch.from_numpy(slot_of[first[order]].copy()),
            torch.from_numpy(kept[last[order]].astype(np.int64)))


def _rows_mask(mask: torch.Tensor | None, rows: torch.Tensor, t: int) -> torch.Tensor:
    """The causal mask restricted to the chosen query rows (an explicit mask if the model passed one)."""
    if mask is not None:
        return mask[:, :, rows]
    allowed = rows[:, None] >= torch.arange(t, device=rows.device)[None]
    return allowed[None, None]


def fit(inputs: Inputs, cfg: TracesConfig, progress: Callable[[int], None] | None = None) -> StageResult:
    """inputs.windows: [N, T] token ids. One window per forward keeps activation memory at one sequence."""
    model, spec, windows = inputs.model, inputs.spec, inputs.windows
    if cfg.reservoir_size < 1:
        raise InputError(f"traces.reservoir_size must be >= 1, got {cfg.reservoir_size}")
    n_layers, n_kv, n_q, d = spec.n_layers, spec.n_kv_heads, spec.n_q_heads, spec.head_dim
    n_samples, seq_len = windows.shape
    n_first = min(cfg.n_first_positions, seq_len)
    top_k = min(cfg.down_top_k, seq_len)
    size = cfg.reservoir_size
    # running state lives on the activations' device (the model's; under a device_map every layer's hook output
    # is moved to it), results go back to CPU
    dev = model_device(model)
    k_pre, k_post, v_mom = (_Moments(n_layers, n_kv, d, dev) for _ in range(3))
    q_absmax = torch.zeros(n_layers, n_q, d, device=dev)
    q_sumsq = torch.zeros(n_layers, n_q, d, dtype=torch.float64, device=dev)
    v_tok = torch.zeros(4, n_layers, n_kv, dtype=torch.float64, device=dev)  # sum/max absmax, sum/max range
    first_mass = torch.zeros(n_layers, n_q, n_first, dtype=torch.float64, device=dev)
    res_k = torch.zeros(size, n_layers, n_kv, d, device=dev)
    res_v = torch.zeros(size, n_layers, n_kv, d, device=dev)
    res_pos = torch.full((size,), -1, dtype=torch.int64)
    res_sample = torch.full((size,), -1, dtype=torch.int64)
    down_ratio = torch.zeros(n_samples, n_layers, top_k, device=dev)
    down_value = torch.zeros(n_samples, n_layers, top_k, device=dev)
    down_token = torch.zeros(n_samples, n_layers, top_k, dtype=torch.int64, device=dev)
    down_pos = torch.zeros(n_samples, n_layers, top_k, dtype=torch.int64, device=dev)
    down_median = torch.zeros(n_samples, n_layers, device=dev)
    gen = np.random.default_rng(cfg.seed)
    state = {"sample": 0, "writes": [], "ids": None}

    def rows(out: torch.Tensor, n_heads: int) -> torch.Tensor:  # -> [T, H, D] on the state's device
        return head_rows(out, n_heads, d)[0].detach().to(dev, torch.float32)  # [1, T, H*D] or [1, H, T, D]

    def finite(stat: torch.Tensor, where: str) -> None:
        # amax/amin propagate NaN and Inf, so checking the small reduced tensor checks every entry
        check_finite(stat, f"{where} (sample {state['sample']})")

    def make_hooks(layer: int, attn, mlp):
        def on_k(_m, _inp, out):
            x = rows(out, n_kv)
            k_pre.update(layer, x)
            finite(k_pre.max[layer] - k_pre.min[layer], f"layer {layer} pre-RoPE key")
            slots, pos = state["writes"]
            res_k[slots, layer] = x[pos]

        def on_v(_m, _inp, out):
            x = rows(out, n_kv)
            v_mom.update(layer, x)
            finite(v_mom.max[layer] - v_mom.min[layer], f"layer {layer} v_proj output")
            absmax, rng = x.abs().amax(-1), x.amax(-1) - x.amin(-1)  # [T, H]
            v_tok[0, layer] += absmax.double().sum(0)
            v_tok[1, layer] = torch.maximum(v_tok[1, layer], absmax.double().amax(0))
            v_tok[2, layer] += rng.double().sum(0)
            v_tok[3, layer] = torch.maximum(v_tok[3, layer], rng.double().amax(0))
            slots, pos = state["writes"]
            res_v[slots, layer] = x[pos]

        def on_q(_m, _inp, out):
            x = rows(out, n_q)
            q_absmax[layer] = torch.maximum(q_absmax[layer], x.abs().amax(0))
            q_sumsq[layer] += x.double().square().sum(0)
            finite(q_absmax[layer], f"layer {layer} pre-RoPE query")

        def on_down(_m, inp):
            x = inp[0][0].detach().to(dev, torch.float32)  # [T, intermediate]
            token_max = x.abs().amax(-1)  # [T]
            finite(token_max, f"layer {layer} down_proj input")
            median = token_max.median().clamp_min(1e-12)
            val, pos = token_max.topk(top_k)
            s = state["sample"]
            down_median[s, layer] = median
            down_value[s, layer], down_ratio[s, layer], down_pos[s, layer] = val, val / median, pos
            down_token[s, layer] = state["ids"][pos]

        # pre-RoPE keys and queries: just before RoPE, after the key / query norm where there is one
        return [(key_module(attn), on_k, False), (attn.v_proj, on_v, False), (query_module(attn), on_q, False),
                (mlp.down_proj, on_down, True)]

    def traced_attention(module, query, key, value, mask, scaling):
        layer = module.layer_idx
        k_post.update(layer, key[0].transpose(0, 1).to(dev, torch.float32))
        finite(k_post.max[layer] - k_post.min[layer], f"layer {layer} post-RoPE key")
        # attention mass on the first positions, estimated on every `stride`-th query row (all rows: stride 1)
        t = key.shape[2]
        rows_q = torch.arange(t - 1, -1, -cfg.mass_query_stride, device=key.device).flip(0)
        scores = attention_scores(query[:, :, rows_q], key, _rows_mask(mask, rows_q, t), scaling)
        probs = torch.softmax(scores, dim=-1)[0, ..., :n_first]  # [H_kv, G, rows, n_first]
        readers = (rows_q[:, None] >= torch.arange(n_first, device=key.device)[None]).to(torch.float64)
        mass = probs.double().sum(-2) / readers.sum(0).clamp_min(1)  # readers: [rows, n_first]
        first_mass[layer] += mass.reshape(-1, n_first).to(dev)
        return sdpa_attention(query, key, value, mask, scaling)

    layers = model.model.layers
    attns = attention_layers(model)
    hooks = [h for i, layer in enumerate(layers) for h in make_hooks(i, attns[i], layer.mlp)]
    with torch.no_grad(), forward_hooks(hooks), attention_override(model, traced_attention):
        for s in range(n_samples):
            state["sample"], state["ids"] = s, windows[s].to(dev)
            slots, pos = reservoir_slots(s * seq_len, seq_len, size, gen)
            res_pos[slots], res_sample[slots] = pos, s
            state["writes"] = slots.to(dev), pos.to(dev)
            model.model(windows[s : s + 1].to(dev), use_cache=False)  # no lm_head: traces need no logits
            if progress:
                progress(1)

    n_tokens = n_samples * seq_len
    filled = int((res_pos >= 0).sum())
    tensors = {
        **k_pre.tensors("k_pre", n_tokens), **k_post.tensors("k_post", n_tokens), **v_mom.tensors("v", n_tokens),
        "q_absmax": q_absmax, "q_meansq": (q_sumsq / n_tokens).float(),
        "v_token_absmax_mean": (v_tok[0] / n_tokens).float(), "v_token_absmax_max": v_tok[1].float(),
        "v_token_range_mean": (v_tok[2] / n_tokens).float(), "v_token_range_max": v_tok[3].float(),
        "attn_first_mass": (first_mass / n_samples).float(),
        "res_k": res_k[:filled], "res_v": res_v[:filled], "res_pos": res_pos[:filled],
        "res_sample": res_sample[:filled],
        "down_ratio": down_ratio, "down_value": down_value, "down_token": down_token, "down_pos": down_pos,
        "down_median": down_median,
    }
    meta = {"n_tokens": n_tokens, "n_samples": n_samples, "seq_len": seq_len, "reservoir_rows": filled}
    return StageResult(tensors={name: t.cpu() for name, t in tensors.items()}, meta=meta)


def _fit_stage(ctx: Context, inputs: dict, cfg: TracesConfig, progress) -> StageResult:
    return fit(Inputs(ctx.model, ctx.spec, ctx.calib), cfg, progress)


def _fit_prefixed(ctx: Context, inputs: dict, cfg: TracesConfig, progress) -> StageResult:
    """The calibration windows served after the discovered prefix (prefix recipes fit the rows after it)."""
    return fit(Inputs(ctx.model, ctx.spec, prepend(inputs["prefix_tokens"].tensors["ids"], ctx.calib)), cfg, progress)


STAGE = Declaration("traces", TracesConfig, _fit_stage, units=calib_units)
PREFIXED = Declaration("traces-prefix", TracesConfig, _fit_prefixed, inputs=lambda c: ["prefix_tokens"], units=calib_units)
