"""Where the error lands: per-layer sensitivity and the layer x position error map.

For each layer i, quantize only layer i's cache under the recipe (all other layers full precision) -- keys
alone, values alone, and both -- and measure, against the full-precision reference on evaluation windows:
KL(reference || quantized) of the next-token distribution, top-1 agreement and the change in mean NLL.
With keys and values both quantized, the layer x position map records, per position bucket, the cosine
similarity of layer i's attention output (o_proj input) and the next-token KL.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from exporters.codec import CachePolicy, TensorPolicy
from stages.base import Context, Declaration, InputError, StageResult
from stages.evaluate import quantized_attention
from stages.layer_policy import Target, target_inputs, target_policy
from stages.hooks import (attention_layers, attention_override, forward_hooks, model_device, replayed_layers,
                          rope_tables)

@dataclass
class SensitivityConfig:
    enabled: bool = True
    n_windows: int = 1
    # the map is taken on the first seq_len positions of each window (0: the whole window): one isolated forward
    # and one full-vocabulary head per layer make the map the dearest diagnostic, about 30 forwards of a 30-layer
    # model; 384 positions cost a third of 1024's (buckets 0-128 and 128-384; docs/eval-cost.md)
    seq_len: int = 384
    buckets: list[int] = field(default_factory=lambda: [0, 128, 512, 2048])
    variants: list[str] = field(default_factory=lambda: ["kv"])  # add "k", "v" for the per-tensor split

    # not in the cache key: with enabled=false the stage is not in the graph at all
    KEY_EXCLUDED: ClassVar[dict[str, str]] = {"enabled": "whether the stage runs, not what it computes"}


def validate(cfg: SensitivityConfig) -> None:
    """The map's window, before any stage runs: the message names the field, the allowed values and the value."""
    if cfg.seq_len != 0 and cfg.seq_len < 2:
        raise InputError(f"sensitivity.seq_len must be 0 (the whole window) or >= 2 positions, got {cfg.seq_len}")


@dataclass
class Inputs:
    model: torch.nn.Module
    spec: object                  # pipeline.model.ModelSpec
    windows: torch.Tensor         # [N, T] token ids (the first cfg.n_windows are used, up to cfg.seq_len positions)
    policy: CachePolicy


VARIANTS = ("k", "v", "kv")  # the order of the first axis of the kl / top1 / nll_delta tensors
FP16 = TensorPolicy()


def isolate(policy: CachePolicy, layer: int | None, variant: str) -> CachePolicy:
    """The recipe's policy on one layer (keys, values or both); full precision elsewhere (layer None: everywhere,
    the forward every isolated one equals up to its layer)."""
    layers = [(FP16, FP16)] * len(policy.layers)
    if layer is not None:
        pk, pv = policy.layers[layer]
        layers[layer] = (pk if "k" in variant else FP16, pv if "v" in variant else FP16)
    return CachePolicy(name=f"{policy.name}@{layer}:{variant}", layers=layers, key_rope=policy.key_rope,
                       n_sink=policy.n_sink, residual=policy.residual, smooth=policy.smooth)


REPLAY_BUDGET_BYTES = 2 ** 31  # the recorded layer outputs of one window are held up to this


def record_layer_outputs(model: torch.nn.Module, ids: torch.Tensor, policy: CachePolicy, rope: dict) -> list | None:
    """Every decoder layer's output in a forward with the whole cache in full precision, as isolate serves it
    (K/V through the served rows, fp16) -- what layers before an isolated one compute -- or None when they would
    not fit in REPLAY_BUDGET_BYTES (each isolated forward is then computed whole)."""
    layers = model.model.layers
    hidden, t = model.config.hidden_size, ids.shape[1]
    if len(layers) * t * hidden * next(model.parameters()).element_size() > REPLAY_BUDGET_BYTES:
        return None
    outputs: list = [None] * len(layers)

    def keep(i):
        def hook(_m, _inp, out):
            outputs[i] = out
        return hook

    with forward_hooks([(layer, keep(i), False) for i, layer in enumerate(layers)]), \
            attention_override(model, quantized_attention(isolate(policy, None, "kv"), rope, None)):
        model.model(ids, use_cache=False)
    return outputs if all(isinstance(o, torch.Tensor) for o in outputs) else None


def bucket_index(t: int, edges: list[int]) -> torch.Tensor:
    """Position -> bucket: [edges[j], edges[j+1]) with the last bucket open-ended."""
    pos = torch.arange(t)
    return torch.bucketize(pos, torch.tensor(edges[1:]), right=True)


def fit(inputs: Inputs, cfg: SensitivityConfig, progress: Callable[[int], None] | None = None) -> StageResult:
    model, spec, windows, policy = inputs.model, inputs.spec, inputs.windows, inputs.policy
    n_layers = spec.n_layers
    windows = windows[: cfg.n_windows, : cfg.seq_len or None]
    t = windows.shape[1]
    edges = [e for e in cfg.buckets if e < t]
    n_buckets = len(edges)
    bucket = bucket_index(t, edges)
    counts = torch.bincount(bucket, minlength=n_buckets).double()
    kl = torch.zeros(len(VARIANTS), n_layers, dtype=torch.float64)
    top1 = torch.zeros_like(kl)
    dnll = torch.zeros_like(kl)
    map_cos = torch.zeros(n_layers, n_buckets, dtype=torch.float64)
    map_kl = torch.zeros(n_layers, n_buckets, dtype=torch.float64)
    attn_out: dict[int, torch.Tensor] = {}

    def grab(layer):
        def hook(_m, inp):
            attn_out[layer] = inp[0][0].detach().float()  # [T, H_q * D]
        return hook

    hooks = [(a.o_proj, grab(i), True) for i, a in enumerate(attention_layers(model))]
    device = model_device(model)
    policy = policy.to(device)
    with torch.no_grad(), forward_hooks(hooks):
        for w in range(windows.shape[0]):
            ids = windows[w : w + 1].to(device)
            targets = ids[0, 1:]
            rope = rope_tables(model, ids)
            ref = torch.log_softmax(model(ids, use_cache=False).logits[0].float(), -1)
            ref_out = {i: o.clone() for i, o in attn_out.items()}
            ref_nll = -ref[:-1].gather(1, targets[:, None]).mean()
            ref_top = ref.argmax(-1)
            ref_p = ref.exp()
            recorded = record_layer_outputs(model, ids, policy, rope)  # layers before the isolated one: replayed
            for layer in range(n_layers):
                for v_idx, variant in enumerate(VARIANTS):
                    if variant not in cfg.variants:
                        continue
                    pol = isolate(policy, layer, variant)
                    with attention_override(model, quantized_attention(pol, rope, None)), \
                            replayed_layers(model.model.layers, recorded or [], layer if recorded else 0):
                        logp = torch.log_softmax(model(ids, use_cache=False).logits[0].float(), -1)
                    kl_pos = (ref_p * (ref - logp)).sum(-1).double()  # [T]
                    kl[v_idx, layer] += float(kl_pos.mean())
                    top1[v_idx, layer] += float((logp.argmax(-1) == ref_top).double().mean())
                    dnll[v_idx, layer] += float(-logp[:-1].gather(1, targets[:, None]).mean() - ref_nll)
                    if variant == "kv":
                        cos = torch.nn.functional.cosine_similarity(attn_out[layer], ref_out[layer], dim=-1).double().cpu()
                        kl_pos = kl_pos.cpu()
                        map_cos[layer] += torch.zeros(n_buckets, dtype=torch.float64).index_add(0, bucket, cos) / counts
                        map_kl[layer] += torch.zeros(n_buckets, dtype=torch.float64).index_add(0, bucket, kl_pos) / counts
                if progress:
                    progress(1)
    n = windows.shape[0]
    return StageResult(
        {"kl": (kl / n).float(), "top1": (top1 / n).float(), "nll_delta": (dnll / n).float(),
         "map_cos": (map_cos / n).float(), "map_kl": (map_kl / n).float()},
        {"variants": list(VARIANTS), "bucket_edges": edges, "windows": n, "seq_len": t, "recipe": policy.name})


@dataclass
class SensitivityJob:
    """The sensitivity stage's config: the map's knobs, the policy it maps, the windows (calib: the
    layer_policy's per-option sensitivity, on calibration windows; eval: the drift map of the run's target)."""
    sensitivity: SensitivityConfig
    target: Target
    split: str = "eval"


def _fit_stage(ctx: Context, inputs: dict, job: SensitivityJob, progress) -> StageResult:
    windows = ctx.calib if job.split == "calib" else ctx.eval
    policy = target_policy(job.target, ctx.spec.n_layers, inputs)
    return fit(Inputs(ctx.model, ctx.spec, windows, policy), job.sensitivity, progress)


def _units(ctx: Context, job: SensitivityJob) -> int:
    windows = ctx.calib if job.split == "calib" else ctx.eval
    return ctx.spec.n_layers * min(job.sensitivity.n_windows, windows.shape[0])


STAGE = Declaration("sensitivity", SensitivityJob, _fit_stage, inputs=lambda j: target_inputs(j.target),
                    suffix=lambda j: f"calib-{j.target.recipe.name}" if j.split == "calib" else "", units=_units)
