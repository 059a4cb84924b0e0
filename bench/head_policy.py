"""Precision per KV head, measured before it is built (issue 52): would choosing per head beat choosing per layer?

The per-layer policy (stages.layer_policy) gives every KV head of a layer the same option. This benchmark measures a
choice per (layer, KV head) on the same footing, evaluation only (an artifact holds one option per layer):

1. each option's isolated KL per (layer, KV head) on the policy's calibration windows: only that head of that layer
   quantized, everything else as the per-layer sensitivity serves it (stages.sensitivity, whose per-layer figures
   the run reads from its cache);
2. the policy's own greedy (layer_policy.choose) over layers x heads, each head weighted by its share of the cached
   elements and costed at its layer's bits under the option (a layer's codes, scales and outliers are per head;
   its static tensors are split evenly), beside the per-layer choice at the same budget and option set;
3. both choices evaluated on the evaluation windows through one path: a query head attends to its own KV head's
   rows only, so a layer whose heads hold different options computes each option's served attention
   (stages.evaluate.quantized_attention, the cache as served) and takes each query head's output from its KV
   head's option. The bits are the ledger's, each option's share of a layer counted as its share of the heads.

Gemma 3 has one KV head per layer: there per head is per layer. SmolLM2 has 3 (9 query heads).

python -m bench.head_policy --model smollm2 --dev --seq-len 8192 --eval-n-samples 2 --mixed-options A,B,... \
    --budgets 2.45 --cache-dir /tmp/lc-cache --json PATH
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from bench.common import write_json
from bench.long_context import long_config
from bench.quality import add_protocol_args
from exporters.checksums import sha256_file, sha256_json
from exporters.codec import CachePolicy
from exporters.files import atomic_write_json
from exporters.ledger import Ledger
from pipeline.app import model_identity, stage_graph, target_of
from pipeline.config import validate_run
from pipeline.data import build_windows
from pipeline.model import load_model
from pipeline.runner import Runner
from stages import evaluate, layer_policy
from stages.base import Context
from stages.evaluate import _WindowMetrics, bucket_means, ppl_ratio_interval, quantized_attention
from stages.hooks import attention_override, layer_windows, model_device, replayed_layers, rope_tables
from stages.recipe import recipe_policy
from stages.sensitivity import isolate, record_layer_outputs


def query_heads(kv_heads: list[int], group: int) -> list[int]:
    """The query heads that read the given KV heads (grouped-query attention: query head i reads KV head i // group,
    torch SDPA's enable_gqa and transformers' repeat_kv)."""
    return [kv * group + g for kv in kv_heads for g in range(group)]


def mix_heads(outs: dict[int, torch.Tensor], heads: list[int], group: int) -> torch.Tensor:
    """outs {option: attention output [B, T, H_q, D] with the whole layer on that option}, heads [H_kv]: each KV
    head's option -> each query head's output taken from its KV head's option."""
    first = outs[heads[0]]
    if len(outs) == 1:
        return first
    out = first.clone()
    for j, o in outs.items():
        sel = query_heads([h for h, c in enumerate(heads) if c == j], group)
        out[:, :, sel] = o[:, :, sel]
    return out


class SharedLedger(Ledger):
    """A Ledger that counts what it is told times `share`: a layer's whole K/V under one option, of which that
    option serves `share` of the heads."""

    def __init__(self):
        super().__init__()
        self.share = 1.0

    def add(self, kind, e, p, rows_q, rows_full, per_row) -> None:
        one = Ledger()
        one.add(kind, e, p, rows_q, rows_full, per_row)
        self.bits += self.share * one.bits
        self.elements += self.share * one.elements
        self.outliers[kind] += self.share * one.outliers[kind]
        self.encoded[kind] += self.share * one.encoded[kind]


def head_attention(policies: list[CachePolicy], choice: list[list[int]], rope: dict, group: int,
                   ledger: SharedLedger | None, windows: list[int | None] | None):
    """An attention function (stages.hooks) serving layer i's KV head h under policies[choice[i][h]]."""
    attns = [quantized_attention(p, rope, ledger, None, windows) for p in policies]

    def attn(module, query, key, value, mask, scaling):
        heads = choice[module.layer_idx]
        outs = {}
        for j in sorted(set(heads)):
            if ledger is not None:
                ledger.share = heads.count(j) / len(heads)
            outs[j] = attns[j](module, query, key, value, mask, scaling)
        return mix_heads(outs, heads, group)
    return attn


def head_hidden(model: torch.nn.Module, ids: torch.Tensor, policies: list[CachePolicy], choice: list[list[int]],
                ledger: SharedLedger | None = None) -> torch.Tensor:
    """ids [1, T] -> final hidden states [T, hidden] with each layer's KV heads served under their options (the
    per-head counterpart of stages.evaluate.policy_hidden; the policies share sinks and recent rows)."""
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    attn = head_attention(policies, choice, rope_tables(model, ids), group, ledger, layer_windows(model.config))
    with attention_override(model, attn):
        return model.model(ids, use_cache=False).last_hidden_state[0]


def head_sensitivity(model: torch.nn.Module, windows: torch.Tensor, policy: CachePolicy,
                     progress=None) -> torch.Tensor:
    """-> [n_layers, n_kv_heads] mean KL(reference || quantized) of the next-token distribution with only that KV
    head of that layer under `policy` (the rest as stages.sensitivity's isolate serves it: fp16 rows), over the
    windows [N, T] -- stages.sensitivity's measurement, one head at a time."""
    cfg = model.config
    n_layers, n_kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    group = cfg.num_attention_heads // n_kv
    device = model_device(model)
    policy = policy.to(device)
    kl = torch.zeros(n_layers, n_kv, dtype=torch.float64)
    with torch.no_grad():
        for w in range(windows.shape[0]):
            ids = windows[w : w + 1].to(device)
            rope = rope_tables(model, ids)
            ref = torch.log_softmax(model(ids, use_cache=False).logits[0].float(), -1)
            ref_p = ref.exp()
            recorded = record_layer_outputs(model, ids, policy, rope)
            fp = quantized_attention(isolate(policy, None, "kv"), rope, None)
            for layer in range(n_layers):
                quant = quantized_attention(isolate(policy, layer, "kv"), rope, None)
                for h in range(n_kv):
                    heads = [1 if i == h else 0 for i in range(n_kv)]

                    def attn(module, query, key, value, mask, scaling, heads=heads, layer=layer, quant=quant):
                        if module.layer_idx != layer:
                            return fp(module, query, key, value, mask, scaling)
                        outs = {0: fp(module, query, key, value, mask, scaling),
                                1: quant(module, query, key, value, mask, scaling)}
                        return mix_heads(outs, heads, group)

                    with attention_override(model, attn), \
                            replayed_layers(model.model.layers, recorded or [], layer if recorded else 0):
                        logp = torch.log_softmax(model(ids, use_cache=False).logits[0].float(), -1)
                    kl[layer, h] += float((ref_p * (ref - logp)).sum(-1).double().mean())
                if progress:
                    progress(layer)
    return (kl / windows.shape[0]).float()


def per_head_options(options: list[layer_policy.Option], elements: torch.Tensor, n_kv: int):
    """Per-layer options with per-head KL -> (options over layers x heads, weights [L * H]): each head costs its
    layer's bits under the option and holds 1 / n_kv of the layer's elements."""
    weights = (elements / elements.sum()).repeat_interleave(n_kv) / n_kv
    flat = [layer_policy.Option(o.name, torch.as_tensor(o.bits, dtype=torch.float64).repeat_interleave(n_kv),
                                o.kl.flatten()) for o in options]
    return flat, weights


def evaluate_choices(model, windows: torch.Tensor, ref_hidden: torch.Tensor, policies: list[CachePolicy],
                     choices: dict[str, list[list[int]]]) -> dict[str, dict]:
    """Each choice [L][H] evaluated on the windows [W, T] against the reference's hidden states, the metrics of
    stages.evaluate.fit (ppl, ppl ratio with its 95% interval over windows, KL, top-1, KL per eighth, bits)."""
    n_win, t = windows.shape
    device = model_device(model)
    stats = {n: {"nll": torch.zeros(1, n_win, dtype=torch.float64), "kl": 0.0, "top1": 0, "rows": None,
                 "ledger": SharedLedger()} for n in choices}
    ref_nll = torch.zeros(n_win, dtype=torch.float64)
    with torch.no_grad():
        for w in range(n_win):
            ids = windows[w : w + 1].to(device)
            metrics = _WindowMetrics(model, ref_hidden[w].to(model.lm_head.weight.device), ids[0, 1:])
            ref_nll[w] = metrics.ref_nll
            for name, choice in choices.items():
                st = stats[name]
                start = time.perf_counter()
                nll, kl, top1, rows = metrics.of(head_hidden(model, ids, policies, choice, st["ledger"]))
                st["nll"][0, w], st["kl"], st["top1"] = nll, st["kl"] + kl, st["top1"] + top1
                st["rows"] = rows if st["rows"] is None else st["rows"] + rows
                print(f"  {name}: window {w} ({time.perf_counter() - start:.0f} s)", flush=True)
    out = {"fp16": {"ppl": math.exp(float(ref_nll.mean()) / (t - 1)), "kl": 0.0, "top1": 1.0, "avg_bits": 16.0,
                    "outlier_fraction_k": 0.0, "outlier_fraction_v": 0.0, "ppl_ratio": 1.0,
                    "ppl_ratio_ci95": [1.0, 1.0]}}
    for name, st in stats.items():
        ratio, lo, hi = ppl_ratio_interval(st["nll"], ref_nll, t - 1)
        led = st["ledger"]
        out[name] = {"ppl": math.exp(float(st["nll"].mean()) / (t - 1)), "kl": st["kl"] / (n_win * t),
                     "top1": st["top1"] / (n_win * t), "avg_bits": led.avg_bits,
                     "outlier_fraction_k": led.outlier_fraction("k"), "outlier_fraction_v": led.outlier_fraction("v"),
                     "ppl_ratio": ratio, "ppl_ratio_ci95": [lo, hi],
                     "kl_buckets": bucket_means(st["rows"].cpu() / n_win), "window_nll": st["nll"][0].tolist()}
    return out


def cached_head_sensitivity(cache_dir: Path, key: str, compute) -> torch.Tensor:
    """The per-head KL under cache_dir/head-sensitivity/<key>.json (JSON, written atomically), computed once."""
    path = Path(cache_dir) / "head-sensitivity" / f"{key}.json"
    if path.exists():
        return torch.tensor(json.loads(path.read_text())["kl"])
    kl = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"kl": kl.tolist()})
    return kl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_protocol_args(ap)
    ap.set_defaults(seq_len=8192, eval_n_samples=2, perturb_seeds=0)
    ap.add_argument("--calib-seq-len", type=int, default=1024, help="calibration window length (tokens)")
    ap.add_argument("--mixed-options", required=True, help="comma list: the options, as bench.long_context's")
    ap.add_argument("--full-context-options", default="")
    ap.add_argument("--budgets", required=True, help="comma list of average-bits budgets")
    args = ap.parse_args()
    start = time.perf_counter()
    budgets = [float(b) for b in args.budgets.split(",") if b]
    cfg = long_config(["fp16"], args, budgets[0])
    recipes = validate_run(cfg)
    lm = load_model(cfg.model)
    model, spec = lm.model, lm.spec
    windows = build_windows(cfg.data, lm.tokenizer)
    runner = Runner(cfg.cache_dir, model_identity(lm), windows.data_id, log=print, show_progress=False)
    ctx = Context(model, spec, lm.tokenizer, windows.calib, windows.eval, windows.long)
    # calibration, the reference and each option's per-layer sensitivity: the stages bench.long_context runs
    graph = [b for b in stage_graph(cfg, recipes) if b.name == "evaluate-reference" or not b.name.startswith("evaluate")]
    results = runner.run(graph, ctx)
    keys = {r.name: r.key for r in runner.records}
    target = target_of(cfg, recipes)
    n_layers, n_kv = spec.n_layers, spec.n_kv_heads
    policies = [recipe_policy(q, n_layers, results) for q in target.options]
    t = cfg.layer_policy.seq_len or ctx.eval.shape[1]
    lp = cfg.layer_policy
    calib = ctx.calib[: lp.n_windows]
    here = sha256_file(Path(__file__))
    layer_opts, head_opts, elements = [], [], None
    for q, p in zip(target.options, policies):
        bits, elements = layer_policy.layer_bits(p, spec, t)
        name = f"sensitivity-calib-{q.name}"
        layer_opts.append(layer_policy.Option(q.name, bits, results[name].tensors["kl"][2]))
        s0 = time.perf_counter()
        kl = cached_head_sensitivity(Path(cfg.cache_dir), sha256_json({"stage": keys[name], "code": here})[:32],
                                     lambda p=p: head_sensitivity(model, calib, p))
        print(f"per-head sensitivity {q.name}: {time.perf_counter() - s0:.0f} s; sum over heads / layer's isolated "
              f"KL per layer: {[round(float(a), 2) for a in kl.sum(1) / layer_opts[-1].kl.clamp_min(1e-12)]}",
              flush=True)
        head_opts.append(layer_policy.Option(q.name, bits, kl))
    flat, head_w = per_head_options(head_opts, elements, n_kv)
    allowed = layer_policy.allowed_options([o.name for o in layer_opts], lp, spec.layer_windows())
    choices, report = {}, []
    for budget in budgets:
        by_layer = layer_policy.choose(layer_opts, budget, elements / elements.sum(), allowed)
        by_head = layer_policy.choose(flat, budget, head_w, allowed.repeat_interleave(n_kv, dim=1))
        lay = [[c] * n_kv for c in by_layer]
        hd = [by_head[i * n_kv : (i + 1) * n_kv] for i in range(n_layers)]
        w = elements / elements.sum()
        pred = lambda ch: (float(sum(w[i] / n_kv * layer_opts[c].bits[i] for i in range(n_layers) for c in ch[i])),  # noqa: E731
                           float(sum(head_opts[c].kl[i, h] for i in range(n_layers) for h, c in enumerate(ch[i]))))
        for label, ch in ((f"per-layer-{budget:g}b", lay), (f"per-head-{budget:g}b", hd)):
            choices[label] = ch
            bits_p, kl_p = pred(ch)
            report.append({"name": label, "budget": budget, "predicted_bits": bits_p, "predicted_head_kl_sum": kl_p,
                           "layers_split": sum(len(set(c)) > 1 for c in ch),
                           "choice": [[target.options[c].name for c in heads] for heads in ch]})
            print(f"{label}: predicted {bits_p:.3f} bits, summed isolated head KL {kl_p:.4f}, "
                  f"{report[-1]['layers_split']} layers with heads on different options", flush=True)
    ref_hidden = results[evaluate.REFERENCE.name].tensors["hidden"]
    rows = evaluate_choices(model, ctx.eval, ref_hidden, policies, choices)
    print()
    print(f"{ctx.eval.shape[0]} windows x {ctx.eval.shape[1]} tokens ({windows.description}); calibration "
          f"{args.n_samples} x {args.calib_seq_len}")
    print(evaluate.table({n: r for n, r in rows.items()}))
    for r in report:
        heads = ["/".join(h) if len(set(h)) > 1 else h[0] for h in r["choice"]]
        print(f"{r['name']}: per layer (KV heads in order, / between) {heads}")
    wall = time.perf_counter() - start
    print(f"bench.head_policy wall: {wall:.1f} s")
    write_json(args.json, {"model": args.model, "dev": args.dev, "seq_len": int(ctx.eval.shape[1]),
                           "windows": int(ctx.eval.shape[0]), "data": windows.description,
                           "options": [q.name for q in target.options], "recipes": rows, "choices": report,
                           "wall_s": wall})


if __name__ == "__main__":
    main()
