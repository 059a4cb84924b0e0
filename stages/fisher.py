"""Diagonal Fisher information of the cached K and V (KVQuant, Hooper et al. 2024, sec. 3.3 and App. C).

F = (dL/dA)^2 per element, L the causal-LM cross-entropy (summed over tokens, labels = input ids) and A the
pre-RoPE keys (stages.hooks.key_module: k_proj, or the key norm after it) and values (v_proj output); the gradient
is the total one, through every later layer. KVQuant keeps the squared gradient per token and element;
we keep it for exactly the reservoir rows of the traces stage, so Fisher and activations align element by
element. One window's graph at a time bounds memory, and the loss is taken over chunks of positions
(stages.hooks.logit_rows): the full-vocabulary logits of a long window are never held at once (8192 positions x
Llama-3's 128256 float32 logits would be 4.2 GB, twice over with their gradient).
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator

import torch
import torch.utils.checkpoint

from stages.base import Context, Declaration, calib_units, InputError, StageResult, check_finite
from stages.hooks import (attention_layers, forward_hooks, head_rows, key_module, lm_logits, logit_rows, model_device,
                          patched_forwards)
from stages.prefix_tokens import prepend


RECOMPUTE = ("auto", "always", "never")
RECOMPUTE_AUTO_TOKENS = 4096  # "auto" recomputes layers for windows at least this long


@dataclass
class FisherConfig:
    """Fisher runs whenever a recipe needs calibrated codebooks; how the codebooks use its weights is chosen by
    codebooks.weighting (stages/codebooks.py). recompute: keep only each decoder layer's input during the forward
    and recompute the layer in the backward (activation checkpointing; torch.utils.checkpoint, non-reentrant):
    the gradients are the same, the memory of the saved activations drops from every layer's graph (about 1.3 GB
    per Llama-3-8B layer at 8192 positions in bfloat16) to one layer's graph plus a [T, hidden] input per layer,
    for one more forward. "auto": for windows of RECOMPUTE_AUTO_TOKENS positions or more."""
    recompute: str = "auto"

    # not in the cache key: checkpointing recomputes the same forward, the gradients agree to float rounding
    # (tests/stages/test_calibration_stages.py::test_fisher_with_layers_recomputed_equals_fisher_with_layers_held)
    KEY_EXCLUDED: ClassVar[dict[str, str]] = {"recompute": "activation checkpointing changes memory, not results"}


@dataclass
class Inputs:
    model: torch.nn.Module
    spec: object                  # pipeline.model.ModelSpec
    windows: torch.Tensor         # [N, T] calibration token ids (the windows the traces stage saw)
    res_sample: torch.Tensor      # [S] the traces reservoir's rows: sample index
    res_pos: torch.Tensor         # [S] and position


def summed_loss_grad(model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed next-token cross-entropy of final hidden states [1, T, hidden] against targets [T - 1] (the
    window's ids shifted by one; summed, so gradients do not shrink with T) and its gradient with respect to the
    hidden states, taken chunk by chunk of positions: one chunk of float32 logits at a time."""
    grad = torch.zeros_like(hidden)
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    step = logit_rows(model.config.vocab_size)
    for c in range(0, targets.numel(), step):
        tgt = targets[c : c + step]
        part = hidden[0, c : c + tgt.numel()].detach().requires_grad_(True)  # this chunk's positions only
        loss = torch.nn.functional.cross_entropy(lm_logits(model, part), tgt, reduction="sum")
        grad[0, c : c + tgt.numel()] = torch.autograd.grad(loss, part)[0]
        total += loss.detach().double()
    return total, grad


@contextmanager
def recomputed_layers(layers, enabled: bool) -> Iterator[None]:
    """Within the block each decoder layer's forward runs under torch.utils.checkpoint (non-reentrant): its
    activations are recomputed in the backward instead of held (hooks inside the layer run again then)."""
    if not enabled:
        yield
        return
    with patched_forwards(layers, lambda _i, forward: functools.partial(torch.utils.checkpoint.checkpoint, forward,
                                                                         use_reentrant=False)):
        yield


def fit(inputs: Inputs, cfg: FisherConfig | None = None, progress: Callable[[int], None] | None = None) -> StageResult:
    """-> fisher_k, fisher_v [S, n_layers, H_kv, D] for the reservoir rows."""
    cfg = cfg or FisherConfig()
    model, spec, windows, res_sample, res_pos = (inputs.model, inputs.spec, inputs.windows, inputs.res_sample,
                                                 inputs.res_pos)
    n_rows = res_sample.numel()
    shape = (n_rows, spec.n_layers, spec.n_kv_heads, spec.head_dim)
    fisher_k, fisher_v = torch.zeros(shape), torch.zeros(shape)  # results on CPU; gradients on the model's device
    leaves: dict[tuple[str, int], torch.Tensor] = {}

    def make(kind: str, layer: int):
        def hook(_m, _inp, out):
            # out + 0, with the zero a leaf: dL/d(zero) = dL/d(out) through every path -- this layer's attention
            # and every later layer's K and V, which read this layer's output through the residual stream
            # a layer recomputed in the backward (FisherConfig.recompute) runs this hook again: the same leaf is
            # added, so the replay records the same operations on the same tensors
            zero = leaves.get((kind, layer))
            if zero is None:
                zero = leaves[(kind, layer)] = torch.zeros_like(out, requires_grad=True)
            return out + zero
        return hook

    attns = attention_layers(model)
    hooks = [(key_module(a), make("k", i), False) for i, a in enumerate(attns)]  # pre-RoPE keys (after k_norm)
    hooks += [(a.v_proj, make("v", i), False) for i, a in enumerate(attns)]
    device = model_device(model)
    total_loss = 0.0
    if cfg.recompute not in RECOMPUTE:
        raise InputError(f"fisher.recompute must be one of {RECOMPUTE}, got {cfg.recompute!r}")
    recompute = cfg.recompute == "always" or (cfg.recompute == "auto" and windows.shape[1] >= RECOMPUTE_AUTO_TOKENS)
    with forward_hooks(hooks), torch.enable_grad(), recomputed_layers(model.model.layers, recompute):
        for s in range(windows.shape[0]):
            rows = (res_sample == s).nonzero().flatten()
            if rows.numel() == 0:
                if progress:
                    progress(1)
                continue
            leaves.clear()
            ids = windows[s : s + 1].to(device)
            hidden = model.model(ids, use_cache=False).last_hidden_state  # [1, T, hidden]
            loss, grad_hidden = summed_loss_grad(model, hidden.detach(), ids[0, 1:])
            check_finite(loss, f"the LM loss of calibration sample {s}")
            keys = [("k", i) for i in range(spec.n_layers)] + [("v", i) for i in range(spec.n_layers)]
            grads = torch.autograd.grad(hidden, [leaves[k] for k in keys], grad_outputs=grad_hidden)
            pos = res_pos[rows]
            for (kind, layer), g in zip(keys, grads):
                g = head_rows(g, spec.n_kv_heads, spec.head_dim)  # [1, T, H, D]
                sq = g[0, pos.to(g.device)].float().square()  # [rows, H, D]
                (fisher_k if kind == "k" else fisher_v)[rows, layer] = sq.cpu()
            total_loss += float(loss)
            if progress:
                progress(1)
    check_finite(fisher_k, "Fisher of keys")
    check_finite(fisher_v, "Fisher of values")
    return StageResult({"fisher_k": fisher_k, "fisher_v": fisher_v},
                       {"rows": n_rows, "mean_token_nll": total_loss / max(1, windows.numel() - windows.shape[0])})


def _fit_stage(ctx: Context, inputs: dict, cfg: FisherConfig, progress) -> StageResult:
    tr = inputs["traces"].tensors
    return fit(Inputs(ctx.model, ctx.spec, ctx.calib, tr["res_sample"], tr["res_pos"]), cfg, progress)


def _fit_prefixed(ctx: Context, inputs: dict, cfg: FisherConfig, progress) -> StageResult:
    tr = inputs["traces-prefix"].tensors
    windows = prepend(inputs["prefix_tokens"].tensors["ids"], ctx.calib)
    return fit(Inputs(ctx.model, ctx.spec, windows, tr["res_sample"], tr["res_pos"]), cfg, progress)


STAGE = Declaration("fisher", FisherConfig, _fit_stage, inputs=lambda c: ["traces"], units=calib_units)
PREFIXED = Declaration("fisher-prefix", FisherConfig, _fit_prefixed, inputs=lambda c: ["prefix_tokens", "traces-prefix"],
                       units=calib_units)
