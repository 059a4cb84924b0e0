"""Quality where the cache is the problem: long evaluation windows, below 4 bits, with sinks and a recent window.

Protocol: calibrate on wikitext-2 valid.txt (16 windows x 1024 tokens, seed 0, as bench.quality), evaluate on the
first --eval-n-samples consecutive non-overlapping windows of --seq-len tokens of test.txt (--dev: calibrate on
the first half of valid.txt, evaluate on its second half). Bits are the ledger's over the served window (sinks,
recent rows, scales, outliers, static tensors once per sequence), so a 256-row fp16 window costs 16 * 256 / T bits
per element more at T tokens. Per recipe: perplexity ratio to fp16 on the same windows with its 95% bootstrap
interval, KL, top-1, KL per eighth of the window (does the error grow along it?), and passkey retrieval at each
--passkey-lengths with the key at each --passkey-depths (stages.probes, teacher-forced greedy). --budgets adds the
per-layer policy (stages.layer_policy) over --mixed-options at each average-bits budget (the options' bits as the
ledger predicts them over the evaluation window; an option is evaluated alone only if --recipes names it), evaluated
on the same windows.

python -m bench.long_context --model smollm2 --json PATH [--seq-len 8192 --eval-n-samples 8 --dev]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.common import write_json
from bench.quality import add_protocol_args, peer_report, protocol_config
from pipeline.app import run_pipeline, target_of
from pipeline.config import load_recipe, recipes_of
from stages import layer_policy, probes
from stages.evaluate import table
from stages.recipe import recipe_policy

WINDOWED = ["kvquant-3b-1pct+sink16+recent128", "kvquant-2b-1pct+sink16+recent128", "kvquant-2b+sink16+recent128"]
# what engines ship (docs/peer-formats.md), KIVI with its own 128-row residual window
DEFAULT_PEERS = ["fp8-e4m3", "vllm-int4-per-token-head", "vllm-turboquant-4bit-nc", "vllm-turboquant-k3v4-nc",
                 "vllm-turboquant-3bit-nc", "kivi-4", "kivi-2"]
# every recipe the verdicts treat as a peer (what users would otherwise pick), named in --recipes or by default
PEERS = DEFAULT_PEERS + ["vllm-turboquant-k8v4", "oscar-style-int2", "oscar-style-int2-noclip"]
RECIPES = ["fp16", "kvquant-2b-1pct"] + WINDOWED + DEFAULT_PEERS
# the per-layer policy's options (chosen on the dev split, docs/long-context.md): keys and values at 4 / 3 / 2 bits,
# or split, with 1% outliers, and 2 bits without; all with the same windows
MIXED_OPTIONS = [f"kvquant-{b}-1pct+sink16+recent128" for b in ("4b", "3b", "2b", "k4v3", "k3v4", "k3v2", "k2v3")] + [
    "kvquant-2b+sink16+recent128"]
# (bits over the window at most, ppl ratio midpoint at most): issue 33's at 4.5 bits, issue 52's below
TARGETS = [(4.5, 1.005), (3.5, 1.01), (3.0, 1.03), (2.5, 1.08)]
PASSKEY_LENGTHS = {"smollm2": [1024, 2048, 4096, 8192], "gemma3": [1024, 2048, 4096, 8192, 16384, 32768]}


def long_config(names: list[str], args: argparse.Namespace, budget: float | None = None):
    """bench.quality's protocol with long evaluation windows: calibration windows of --calib-seq-len, evaluation
    windows of --seq-len; with `budget`, the per-layer policy over --mixed-options at that many bits."""
    cfg = protocol_config(names, args)
    cfg.data.seq_len, cfg.data.eval_seq_len = args.calib_seq_len, args.seq_len
    if budget is not None:  # cfg.quant and eval.recipes as without: the evaluate stage's key is the same
        cfg.layer_policy.enabled, cfg.layer_policy.budget = True, budget
        cfg.layer_policy.options = args.mixed_options.split(",")
        cfg.layer_policy.full_context_options = [n for n in args.full_context_options.split(",") if n]
        # the options are calibrated, their sensitivity measured and their bits predicted by the ledger at the
        # evaluation window; only the rows --recipes names are evaluated alone
        cfg.layer_policy.evaluate_options = False
    return cfg


def passkey_by_length(cells: dict[str, int]) -> dict[str, float]:
    """{"LENGTH@DEPTH": 0|1} -> {"LENGTH": fraction of depths retrieved}."""
    by: dict[str, list[int]] = {}
    for key, ok in cells.items():
        by.setdefault(key.split("@")[0], []).append(ok)
    return {n: sum(v) / len(v) for n, v in sorted(by.items(), key=lambda kv: int(kv[0]))}


def run_passkey(out: dict, names: list[str], args: argparse.Namespace, mixed: dict) -> dict[str, dict]:
    """Passkey cells of fp16 and every recipe in `names` (stages.probes on policies resolved from the run's stage
    results; library caches and prefix recipes are not probed, with a line saying so)."""
    lm, results = out["model"], out["results"]
    lengths = [n for n in map(int, args.passkey_lengths.split(",")) if n <= args.seq_len]
    cfg = probes.ProbeConfig(lengths=lengths, depths=[float(d) for d in args.passkey_depths.split(",")])
    policies = []
    for name in names:
        if name == "fp16":  # probes.fit runs the reference itself
            continue
        if name in mixed:
            policies.append(mixed[name])
            continue
        q = load_recipe(name)
        if q.engine.library or q.prefix:
            print(f"passkey: {name} not probed (stages.probes serves kvcalib's own cache without a prefix)")
            continue
        policies.append(recipe_policy(q, lm.spec.n_layers, results))
    prompts = probes.make_prompts(lm.tokenizer, cfg)
    start = time.perf_counter()
    meta = probes.fit(probes.Inputs(lm.model, lm.spec, prompts, policies), cfg).meta
    print(f"passkey: {len(prompts)} prompts x {len(policies) + 1} policies in {time.perf_counter() - start:.1f} s")
    return meta["cells"]


def target_report(recipes: dict[str, dict], ours: list[str]) -> list[str]:
    """For each (bits, ratio) target: the best of our recipes at no more bits, judged on its interval's midpoint."""
    lines = []
    for bits, target in TARGETS:
        fit = {n: recipes[n] for n in ours if n in recipes and recipes[n]["avg_bits"] <= bits}
        if not fit:
            lines.append(f"<= {bits} bits: no recipe of ours at so few bits in this run")
            continue
        best = min(fit, key=lambda n: sum(fit[n]["ppl_ratio_ci95"]))
        lo, hi = fit[best]["ppl_ratio_ci95"]
        mid = (lo + hi) / 2
        lines.append(f"<= {bits} bits: best {best} ({fit[best]['avg_bits']:.3f} bits) ppl/fp16 "
                     f"{fit[best]['ppl_ratio']:.4f} [{lo:.4f}, {hi:.4f}], midpoint {mid:.4f} vs target {target}: "
                     f"{'met' if mid <= target else 'NOT met'}")
    return lines


def positions_table(recipes: dict[str, dict]) -> str:
    """KL per eighth of the window, and last / first eighth: does the error grow along the window?"""
    lines = [f"{'recipe':<34} KL per eighth of the window (first ... last)" + " " * 40 + "last/first"]
    for name, r in sorted(recipes.items(), key=lambda kv: -kv[1]["avg_bits"]):
        b = r.get("kl_buckets")
        if not b or name == "fp16":
            continue
        growth = b[-1] / b[0] if b[0] > 0 else float("nan")
        lines.append(f"{name:<34} " + " ".join(f"{x:.4f}" for x in b) + f"   {growth:6.2f}")
    return "\n".join(lines)


def passkey_table(passkey: dict[str, dict]) -> str:
    lengths = sorted({n for v in passkey.values() for n in v}, key=int)
    lines = [f"{'recipe':<34} " + " ".join(f"{n:>6}" for n in lengths) + "   (passkey: fraction of depths retrieved)"]
    for name, by in passkey.items():
        lines.append(f"{name:<34} " + " ".join(f"{by.get(n, float('nan')):>6.2f}" for n in lengths))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_protocol_args(ap)
    ap.set_defaults(seq_len=8192, eval_n_samples=8, perturb_seeds=0)
    ap.add_argument("--calib-seq-len", type=int, default=1024, help="calibration window length (tokens)")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--ours", default=None, help="the recipes the targets and peer verdicts pick from (default: every "
                                                   "recipe of the run but fp16 and the peers)")
    ap.add_argument("--full-context-options", default="",
                    help="comma list, some of --mixed-options: the only ones a full-context layer may take "
                         "(layer_policy.full_context_options; empty: all)")
    ap.add_argument("--budgets", default="", help="comma list of average-bits budgets for the per-layer policy")
    ap.add_argument("--mixed-options", default=",".join(MIXED_OPTIONS))
    ap.add_argument("--passkey-lengths", default=None, help="default: the model's (1k ... 8k; Gemma 3 to 32k)")
    ap.add_argument("--passkey-depths", default="0.1,0.5,0.9")
    ap.add_argument("--passkey-recipes", default=None, help="default: every recipe; '' for none")
    ap.add_argument("--export-dir", default=None,
                    help="export the per-layer policy at each of --export-budgets into DIR/mixed-<budget>b, as "
                         "`pipeline run` with the same config does (artifact, runtime check, canary; every stage cached)")
    ap.add_argument("--export-budgets", default="", help="comma list, each one of --budgets")
    args = ap.parse_args()
    budgets = [float(b) for b in args.budgets.split(",") if b]
    export_budgets = [float(b) for b in args.export_budgets.split(",") if b]
    if args.export_dir and (not export_budgets or not set(export_budgets) <= set(budgets)):
        raise SystemExit(f"--export-budgets must name some of --budgets {args.budgets!r}, got {args.export_budgets!r}")
    args.passkey_lengths = args.passkey_lengths or ",".join(map(str, PASSKEY_LENGTHS.get(args.model, [1024])))
    start = time.perf_counter()
    names = args.recipes.split(",")
    if "fp16" not in names:
        names = ["fp16"] + names
    with tempfile.TemporaryDirectory() as tmp:
        # with budgets, the first budget's run is the main one: the options are calibrated with the recipes (one
        # calibration group, one codebook fit), and every later run reuses all but its own evaluate-mixed stage
        out = run_pipeline(long_config(names, args, budgets[0] if budgets else None), Path(tmp) / "main", log=print,
                           show_progress=False)
        summary = out["summary"]
        recipes = dict(summary["evaluation"]["recipes"])
        ours = [n for n in recipes if n != "fp16" and n not in PEERS] if args.ours is None else [
            n for n in args.ours.split(",") if n in recipes]
        mixed_policies, mixed_meta = {}, {}
        for budget in budgets:
            cfg_b = long_config(names, args, budget)
            m = run_pipeline(cfg_b, Path(tmp) / f"mixed-{budget:g}", log=print, show_progress=False)
            name = m["results"]["evaluate-mixed"].meta["name"]
            recipes[name] = m["results"]["evaluate-mixed"].meta["recipe"]
            mixed_meta[name] = m["results"]["evaluate-mixed"].meta["layer_policy"]
            mixed_policies[name] = layer_policy.target_policy(target_of(cfg_b, recipes_of(cfg_b)),
                                                              m["model"].spec.n_layers, m["results"])
            ours.append(name)
        for budget in export_budgets if args.export_dir else []:  # the same config, export and check on
            cfg_e = long_config(names, args, budget)
            cfg_e.export.enabled = cfg_e.check.enabled = True
            run_dir = Path(args.export_dir) / f"mixed-{budget:g}b"
            exported = run_pipeline(cfg_e, run_dir, log=print, show_progress=False)["summary"]
            print(f"exported {exported['artifact_dir']}: runtime check {exported['runtime_check']['status']}")
        probed = names + list(mixed_policies) if args.passkey_recipes is None else (
            [n for n in args.passkey_recipes.split(",") if n])
        cells = run_passkey(out, probed, args, mixed_policies) if probed else {}
    passkey = {n: passkey_by_length(c) for n, c in cells.items()}
    print()
    print(f"{summary['data']['eval_n_samples']} windows x {args.seq_len} tokens ({summary['data']['description']}); "
          f"calibration {args.n_samples} x {args.calib_seq_len}")
    print(table(recipes))
    print()
    print(positions_table(recipes))
    if passkey:
        print()
        print(passkey_table(passkey))
    for name, lp in mixed_meta.items():
        print(f"{name}: per layer {lp['choice']}")
    print()
    for line in target_report(recipes, ours) + peer_report(recipes, PEERS, ours):
        print(line)
    for r in out["runner"].records:
        print(f"  {r.name:<28} {r.status:<9} {r.wall_s:7.1f} s")
    wall = time.perf_counter() - start
    print(f"bench.long_context wall: {wall:.1f} s")
    keys = ("ppl", "kl", "top1", "avg_bits", "ppl_ratio", "ppl_ratio_ci95", "kl_buckets", "ppl_seeds")
    ev = summary["evaluation"]
    write_json(args.json, {
        "model": args.model, "dev": args.dev, "seq_len": ev["seq_len"], "windows": ev["windows"],
        "calib": {"n_samples": args.n_samples, "seq_len": args.calib_seq_len},
        "data": summary["data"]["description"], "perturb_seeds": ev["perturb_seeds"],
        "recipes": {n: {**{k: r[k] for k in keys if k in r}, "passkey": passkey.get(n), "passkey_cells": cells.get(n)}
                    for n, r in recipes.items()},
        "layer_policy": mixed_meta, "targets": target_report(recipes, ours), "wall_s": wall})


if __name__ == "__main__":
    main()
