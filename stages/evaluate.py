"""Quality of quantized caches against the full-precision reference, on evaluation windows only.

Every cached K and V entry of every layer goes through exporters.codec (encode -> decode) except the declared
sink rows and residual window. The residual window is evaluated as decode sees it: query t reads keys and
values at distance < R in full precision and older ones quantized (a distance mask choosing between the two
score matrices and the two value sets), not by quantizing the window once. A policy with a prefix (PrefixQuant /
IntactKV) serves every window after its prefix ids: positions shift by P, the P prefix rows are kept in full
precision like sink rows (and counted at 16 bits), and metrics are taken on the window's own positions only.

Metrics per policy: perplexity, KL(reference || quantized) of next-token distributions, top-1 agreement,
average bits per cached element from the ledger (codes, scales, zero-points, sparse values + indices + row
counts, full-precision sink and residual rows at 16 bits, per-layer static tensors once per sequence), and
the measured sparse-outlier fraction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from exporters.codec import FULL_PRECISION_BITS, CachePolicy, encoded_bits, fake_quant, static_bits
from exporters.rope import apply_rope
from stages.base import StageResult
from stages.hooks import (attend, attention_override, attention_scores, forward_hooks, pre_rope_key_hooks, rope_tables,
                          sdpa_attention)


@dataclass
class EvalConfig:
    enabled: bool = True
    # evaluated beside the run's own recipe, on the same windows
    recipes: list[str] = field(default_factory=lambda: ["fp16", "fp8-e4m3", "int4-token", "kivi-4", "kivi-2"])


@dataclass
class Inputs:
    model: torch.nn.Module
    spec: object                  # pipeline.model.ModelSpec
    windows: torch.Tensor         # [M, T] evaluation token ids
    policies: list[CachePolicy]


class _Ledger:
    def __init__(self):
        self.bits = 0.0
        self.elements = 0
        self.outliers = {"k": 0, "v": 0}
        self.encoded = {"k": 0, "v": 0}

    def add(self, kind: str, e, p, rows_q: int, rows_full: int, per_row: int) -> None:
        encoded_rows = e.shape[2]
        if encoded_rows:
            self.bits += encoded_bits(e, p) * rows_q / encoded_rows
        self.bits += FULL_PRECISION_BITS * rows_full * per_row + static_bits(p)
        self.elements += (rows_q + rows_full) * per_row
        self.outliers[kind] += e.n_outliers
        self.encoded[kind] += math.prod(e.shape)


QUERY_CHUNK = 1024


def _chunk_mask(mask: torch.Tensor | None, q_pos: torch.Tensor, t: int) -> torch.Tensor:
    """The model's mask rows for this chunk, or the causal mask at the chunk's absolute positions."""
    if mask is not None:
        return mask
    return (q_pos >= torch.arange(t)[None])[None, None]


def quantized_attention(policy: CachePolicy, pre_keys: dict[int, torch.Tensor], rope: dict, ledger: _Ledger | None):
    """An attention function (see stages.hooks) that reads the cache through the codec under `policy`."""
    s_sink, residual = max(policy.n_sink, policy.prefix_len), policy.residual  # prefix rows: full precision

    def attn(module, query, key, value, mask, scaling):
        layer = module.layer_idx
        pk, pv = policy.layers[layer]
        b, h, t, d = key.shape
        k_src = pre_keys[layer] if policy.key_rope == "pre" else key
        lam = policy.smooth[layer].to(key.dtype)[None, :, None, :] if policy.smooth is not None else None
        if lam is not None:
            k_src = k_src / lam  # the cache stores K / lambda (rope pairs share lambda, so RoPE commutes)
        s = min(s_sink, t)
        k_hat, v_hat = k_src.clone(), value.clone()
        k_hat[:, :, s:], ek = fake_quant(k_src[:, :, s:], pk, f"layer {layer} keys")
        v_hat[:, :, s:], ev = fake_quant(value[:, :, s:], pv, f"layer {layer} values")
        if lam is not None:
            k_hat = k_hat * lam
        if policy.key_rope == "pre":
            k_hat = apply_rope(k_hat, rope["cos"], rope["sin"])
        if s and policy.key_rope == "post":
            k_hat[:, :, :s] = key[:, :, :s]
        if ledger is not None:
            r = min(residual, t - s)
            for kind, e, p in (("k", ek, pk), ("v", ev, pv)):
                ledger.add(kind, e, p, rows_q=t - s - r, rows_full=s + r, per_row=b * h * d)
        if residual == 0:
            return sdpa_attention(query, k_hat, v_hat, mask, scaling)
        t_q = query.shape[2]
        outs = []
        for c in range(0, t_q, QUERY_CHUNK):  # query chunks bound the [T_q, T] score matrices at long context
            q = query[:, :, c : c + QUERY_CHUNK]
            m = None if mask is None else mask[:, :, c : c + QUERY_CHUNK]
            q_pos = torch.arange(t - t_q + c, t - t_q + c + q.shape[2])[:, None]
            near = (q_pos - torch.arange(t)[None]) < residual  # [chunk, T]: read in full precision
            scores = torch.where(near, attention_scores(q, key, _chunk_mask(m, q_pos, t), scaling),
                                 attention_scores(q, k_hat, _chunk_mask(m, q_pos, t), scaling))
            probs = torch.softmax(scores, dim=-1)
            outs.append(attend(probs * near, value, query.dtype) + attend(probs * ~near, v_hat, query.dtype))
        return torch.cat(outs, dim=1)

    return attn


def _served(ids: torch.Tensor, policy: CachePolicy) -> tuple[torch.Tensor, int]:
    """ids [1, T] -> (prefix + ids [1, P + T], P). Metrics are taken on the window's own T positions; the
    reference they compare with is the plain window, so a prefix's own context effect shows in KL."""
    if policy.prefix_ids is None or policy.prefix_ids.numel() == 0:
        return ids, 0
    return torch.cat([policy.prefix_ids.to(ids)[None], ids], dim=1), int(policy.prefix_ids.numel())


def fit(inputs: Inputs, cfg: EvalConfig | None = None, progress: Callable[[int], None] | None = None) -> StageResult:
    """-> per-policy ppl, kl, top1, avg_bits, outlier fractions on inputs.windows."""
    model, spec, windows, policies = inputs.model, inputs.spec, inputs.windows, inputs.policies
    stats = {p.name: {"nll": 0.0, "kl": 0.0, "top1": 0, "tokens": 0, "ledger": _Ledger()} for p in policies}
    pre_keys, hooks = pre_rope_key_hooks(model, spec.n_kv_heads, spec.head_dim)
    device = next(model.parameters()).device
    with torch.no_grad(), forward_hooks(hooks):
        for w in range(windows.shape[0]):
            ids = windows[w : w + 1].to(device)
            targets = ids[0, 1:]
            rope = rope_tables(model, ids)
            ref = torch.log_softmax(model(ids, use_cache=False).logits[0].float(), -1)  # [T, V]
            ref_top = ref.argmax(-1)
            for policy in policies:
                st = stats[policy.name]
                run_ids, p = _served(ids, policy)  # [1, P + T]: the window after the policy's prefix (P >= 0)
                if policy.is_full_precision:
                    logp = ref if p == 0 else torch.log_softmax(
                        model(run_ids, use_cache=False).logits[0, p:].float(), -1)
                    st["ledger"].bits += 16 * 2 * run_ids.shape[1] * spec.n_layers * spec.n_kv_heads * spec.head_dim
                    st["ledger"].elements += 2 * run_ids.shape[1] * spec.n_layers * spec.n_kv_heads * spec.head_dim
                else:
                    run_rope = rope if p == 0 else rope_tables(model, run_ids)
                    with attention_override(model, quantized_attention(policy, pre_keys, run_rope, st["ledger"])):
                        logp = torch.log_softmax(model(run_ids, use_cache=False).logits[0, p:].float(), -1)
                st["nll"] -= float(logp[:-1].gather(1, targets[:, None]).sum())
                st["kl"] += float((ref.exp() * (ref - logp)).sum())
                st["top1"] += int((logp.argmax(-1) == ref_top).sum())
                st["tokens"] += ids.shape[1]
            if progress:
                progress(1)
    n_pred = windows.shape[0] * (windows.shape[1] - 1)
    recipes = {}
    for name, st in stats.items():
        led = st["ledger"]
        recipes[name] = {
            "ppl": math.exp(st["nll"] / n_pred), "kl": st["kl"] / st["tokens"], "top1": st["top1"] / st["tokens"],
            "avg_bits": led.bits / max(1, led.elements),
            "outlier_fraction_k": led.outliers["k"] / max(1, led.encoded["k"]),
            "outlier_fraction_v": led.outliers["v"] / max(1, led.encoded["v"]),
        }
    return StageResult({}, {"recipes": recipes, "windows": int(windows.shape[0]), "seq_len": int(windows.shape[1])})


def table(recipes: dict[str, dict], reference: str = "fp16") -> str:
    ref_ppl = recipes.get(reference, {}).get("ppl")
    width = max([22, *(len(n) + 1 for n in recipes)])
    head = f"{'recipe':<{width}} {'avg_bits':>8} {'ppl':>9} {'ppl/fp16':>9} {'KL':>8} {'top1':>7} {'sparse K/V %':>13}"
    lines = [head, "-" * len(head)]
    for name, r in sorted(recipes.items(), key=lambda kv: -kv[1]["avg_bits"]):
        ratio = f"{r['ppl'] / ref_ppl:9.4f}" if ref_ppl else f"{'-':>9}"
        sparse = f"{100 * r['outlier_fraction_k']:.2f}/{100 * r['outlier_fraction_v']:.2f}"
        lines.append(f"{name:<{width}} {r['avg_bits']:>8.3f} {r['ppl']:>9.3f} {ratio} {r['kl']:>8.4f} {r['top1']:>7.4f} {sparse:>13}")
    return "\n".join(lines)
