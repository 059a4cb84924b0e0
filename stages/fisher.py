"""Diagonal Fisher information of the cached K and V (KVQuant, Hooper et al. 2024, sec. 3.3 and App. C).

F = (dL/dA)^2 per element, L the causal-LM cross-entropy (summed over tokens, labels = input ids) and A the
k_proj / v_proj output (pre-RoPE keys, values); the gradient is the total one, through every later layer. KVQuant keeps the squared gradient per token and element;
we keep it for exactly the reservoir rows of the traces stage, so Fisher and activations align element by
element. One window's graph at a time bounds memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from stages.base import StageResult, check_finite
from stages.hooks import attention_layers, forward_hooks


@dataclass
class FisherConfig:
    """Fisher has no options: it runs whenever a recipe needs calibrated codebooks, and how the codebooks use its
    weights is chosen by codebooks.weighting (stages/codebooks.py). The dataclass stays, empty, for the one stage
    signature fit(inputs, cfg, progress); `fisher.<key>=...` is refused as an unknown key."""


@dataclass
class Inputs:
    model: torch.nn.Module
    spec: object                  # pipeline.model.ModelSpec
    windows: torch.Tensor         # [N, T] calibration token ids (the windows the traces stage saw)
    res_sample: torch.Tensor      # [S] the traces reservoir's rows: sample index
    res_pos: torch.Tensor         # [S] and position


def fit(inputs: Inputs, cfg: FisherConfig | None = None, progress: Callable[[int], None] | None = None) -> StageResult:
    """-> fisher_k, fisher_v [S, n_layers, H_kv, D] for the reservoir rows."""
    model, spec, windows, res_sample, res_pos = (inputs.model, inputs.spec, inputs.windows, inputs.res_sample,
                                                 inputs.res_pos)
    n_rows = res_sample.numel()
    shape = (n_rows, spec.n_layers, spec.n_kv_heads, spec.head_dim)
    fisher_k, fisher_v = torch.zeros(shape), torch.zeros(shape)
    leaves: dict[tuple[str, int], torch.Tensor] = {}

    def make(kind: str, layer: int):
        def hook(_m, _inp, out):
            # out + 0, with the zero a leaf: dL/d(zero) = dL/d(out) through every path -- this layer's attention
            # and every later layer's K and V, which read this layer's output through the residual stream
            zero = torch.zeros_like(out, requires_grad=True)
            leaves[(kind, layer)] = zero
            return out + zero
        return hook

    attns = attention_layers(model)
    hooks = [(a.k_proj, make("k", i), False) for i, a in enumerate(attns)]
    hooks += [(a.v_proj, make("v", i), False) for i, a in enumerate(attns)]
    device = next(model.parameters()).device
    total_loss = 0.0
    with forward_hooks(hooks), torch.enable_grad():
        for s in range(windows.shape[0]):
            rows = (res_sample == s).nonzero().flatten()
            if rows.numel() == 0:
                if progress:
                    progress(1)
                continue
            leaves.clear()
            ids = windows[s : s + 1].to(device)
            out = model(ids, labels=ids, use_cache=False)
            loss = out.loss * (ids.shape[1] - 1)  # summed cross-entropy: gradients do not shrink with T
            check_finite(loss.detach(), f"the LM loss of calibration sample {s}")
            keys = [("k", i) for i in range(spec.n_layers)] + [("v", i) for i in range(spec.n_layers)]
            grads = torch.autograd.grad(loss, [leaves[k] for k in keys])
            pos = res_pos[rows]
            for (kind, layer), g in zip(keys, grads):
                sq = g[0, pos].float().square().view(-1, spec.n_kv_heads, spec.head_dim)  # [rows, H, D]
                (fisher_k if kind == "k" else fisher_v)[rows, layer] = sq
            total_loss += float(loss.detach())
            if progress:
                progress(1)
    check_finite(fisher_k, "Fisher of keys")
    check_finite(fisher_v, "Fisher of values")
    return StageResult({"fisher_k": fisher_k, "fisher_v": fisher_v},
                       {"rows": n_rows, "mean_token_nll": total_loss / max(1, windows.numel() - windows.shape[0])})
