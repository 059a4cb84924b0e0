"""Quality per bit, every recipe side by side in one run on the same windows.

Protocol: calibrate on wikitext-2 valid.txt (16 windows x 1024 tokens, seed 0), evaluate on the first 16
consecutive non-overlapping 1024-token windows of test.txt. Every quantized recipe is evaluated under 4
perturbation seeds (relative noise 1e-5 on the K/V entering the cache, stages.evaluate.Perturbation); the
perplexity ratio to fp16 on the same windows is printed with a 95% bootstrap interval over windows and seeds.
Beside our recipes: the formats serving engines ship (PEERS, docs/peer-formats.md), each with the best calibrated
recipe at equal or fewer bits and whether their intervals are apart.

python -m bench.quality --json PATH [--n-samples 16 --seq-len 1024 --eval-n-samples 16]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import wikitext_dir, write_json
from pipeline.app import run_pipeline
from pipeline.config import DataConfig, EvalConfig, RunConfig, load_model_config, load_recipe, recipe_names
from stages.evaluate import table
from stages.hooks import model_device
from stages.recipe import is_exportable_recipe

CALIBRATED = ["kvquant-4b", "kvquant-4b-1pct", "kvquant-3b", "kvquant-3b-1pct", "kvquant-2b", "kvquant-2b-1pct"]
# what serving engines ship, needing no calibration (docs/peer-formats.md): vLLM 0.32's cache dtypes re-implemented,
# transformers' QuantizedCache run as the library
PEERS = ["vllm-int8-per-token-head", "vllm-fp8-per-token-head", "vllm-int4-per-token-head", "vllm-turboquant-k8v4",
         "vllm-turboquant-4bit-nc", "vllm-turboquant-k3v4-nc", "vllm-turboquant-3bit-nc", "hf-hqq-4", "hf-hqq-2"]
OURS = ["fp16", "fp8-e4m3", "int4-token", "kivi-4", "kivi-2"] + CALIBRATED
RECIPES = OURS + PEERS


def pareto_report(recipes: dict[str, dict]) -> list[str]:
    """For each kvquant-*-1pct recipe: the recipes that dominate it (fewer or equal bits and a lower perplexity
    ratio), and those that dominate it with non-overlapping 95% intervals."""
    lines = []
    for name, r in recipes.items():
        if not (name.startswith("kvquant-") and name.endswith("-1pct")):
            continue
        dominators = [o for o, s in recipes.items() if o != name and s["avg_bits"] <= r["avg_bits"]
                      and s["ppl_ratio"] < r["ppl_ratio"]]
        clear = [o for o in dominators if recipes[o]["ppl_ratio_ci95"][1] < r["ppl_ratio_ci95"][0]]
        verdict = "on the frontier" if not dominators else "dominated by " + ", ".join(dominators) + (
            f" (intervals apart: {', '.join(clear) or 'none'})")
        lines.append(f"{name}: {verdict}")
    return lines


def peer_report(recipes: dict[str, dict], peers: list[str] = PEERS, calibrated: list[str] = CALIBRATED) -> list[str]:
    """For each peer format: the best calibrated recipe at equal or fewer average bits, and whether it beats the
    peer with non-overlapping 95% intervals."""
    lines = []
    for peer in (n for n in peers if n in recipes):
        r = recipes[peer]
        ours = {n: recipes[n] for n in calibrated if n in recipes and recipes[n]["avg_bits"] <= r["avg_bits"]}
        if not ours:
            lines.append(f"{peer} ({r['avg_bits']:.3f} bits): no calibrated recipe at <= its bits in this run")
            continue
        best = min(ours, key=lambda n: ours[n]["ppl_ratio"])
        (b_lo, b_hi), (p_lo, p_hi) = ours[best]["ppl_ratio_ci95"], r["ppl_ratio_ci95"]
        verdict = ("ours better, intervals apart" if b_hi < p_lo else "peer better, intervals apart" if p_hi < b_lo
                   else "intervals overlap")
        lines.append(f"{peer} ({r['avg_bits']:.3f} bits) ppl/fp16 {r['ppl_ratio']:.4f} [{p_lo:.4f}, {p_hi:.4f}] vs "
                     f"{best} ({ours[best]['avg_bits']:.3f} bits) {ours[best]['ppl_ratio']:.4f} [{b_lo:.4f}, "
                     f"{b_hi:.4f}]: {verdict}")
    return lines


def kmeans_report(stage_meta: dict) -> list[str]:
    """The codebook fits compared, weighted SSE summed over layers (stages.codebooks' report): the served codebook
    (optimal on the 2048-bin histogram) against Lloyd on all points; then like for like on the same subsample:
    binned optimum, exact optimum on the raw points, and Lloyd's best and worst of its inits, as ratios to exact."""
    lines = []
    for stage, meta in ((k, v) for k, v in stage_meta.items() if k.startswith("codebooks")):
        for key, rows in meta["sse"].items():
            if not all("sse_lloyd" in r for r in rows):  # fitted without codebooks.lloyd_check
                continue
            binned, lloyd = sum(r["sse_binned"] for r in rows), sum(r.get("sse_lloyd", float("nan")) for r in rows)
            line = f"{stage} {key}: all points binned/Lloyd {binned / lloyd:.4f}"
            if all("sub_exact" in r for r in rows):
                exact = sum(r["sub_exact"] for r in rows)
                sub_b = sum(r["sub_binned"] for r in rows)
                inits = [sum(r["sub_lloyd"][i] for r in rows) for i in range(len(rows[0]["sub_lloyd"]))]
                line += (f"; subsample ({rows[0]['sub_points']} points/layer) binned/exact {sub_b / exact:.4f}, "
                         f"Lloyd/exact best {min(inits) / exact:.4f} worst {max(inits) / exact:.4f} "
                         f"of {len(inits)} inits")
            lines.append(line)
    return lines


TARGETS = {"kvquant-4b-1pct": 1.01, "kvquant-3b-1pct": 1.04, "kvquant-2b-1pct": 1.25}


def target_report(recipes: dict[str, dict]) -> list[str]:
    """The quality targets (ppl ratio to fp16), judged on the interval's midpoint, the interval printed."""
    lines = []
    for name, target in TARGETS.items():
        if name in recipes:
            lo, hi = recipes[name]["ppl_ratio_ci95"]
            mid = (lo + hi) / 2
            lines.append(f"{name}: ppl/fp16 {recipes[name]['ppl_ratio']:.4f}, 95% interval [{lo:.4f}, {hi:.4f}], "
                         f"midpoint {mid:.4f} vs target {target:.2f}: {'met' if mid <= target else 'NOT met'}")
    return lines


def add_protocol_args(ap: argparse.ArgumentParser) -> None:
    """The data protocol's knobs, shared by the benchmarks that follow it (bench.ablation)."""
    ap.add_argument("--n-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--eval-n-samples", type=int, default=16)
    ap.add_argument("--cache-dir", default=".kvcalib_cache")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dev", action="store_true",
                    help="development split: calibrate on the first half of valid.txt, evaluate on its second half "
                         "(test.txt untouched; for choosing a method before it is measured on the protocol)")
    ap.add_argument("--codebook-weighting", default=None, help="codebooks.weighting: fisher | fisher-scale2 | query-scale2")
    ap.add_argument("--qnorm", action="store_true", help="codebooks.qnorm=true (KVQuant's Q-Norm on every codebook)")
    ap.add_argument("--lloyd-check", action="store_true",
                    help="codebooks.lloyd_check=true: compare every fitted codebook with Lloyd's k-means and the "
                         "exact optimum on a subsample (printed; costs more than the fit)")
    ap.add_argument("--perturb-seeds", type=int, default=4,
                    help="evaluate each quantized recipe under seeds 1..N of the cache-input perturbation (0: once, "
                         "unperturbed; the interval then covers the windows only)")
    ap.add_argument("--perturb-scale", type=float, default=1e-5)
    ap.add_argument("--model", default="smollm2", help="conf/model/NAME.yaml (smollm2, gemma3, ...)")


def protocol_config(names: list[str], args: argparse.Namespace) -> RunConfig:
    """The protocol's run config: every recipe in `names` evaluated side by side; export, runtime check and the
    drift analysis off (benchmarks measure quality per bit; `python -m pipeline run` does the rest)."""
    unknown = [n for n in names if n not in recipe_names()]
    if unknown:
        raise SystemExit(f"--recipes: unknown {unknown}; allowed: {recipe_names()}")
    path = wikitext_dir() / "valid.txt" if args.dev else wikitext_dir()  # a file is split in two halves
    cfg = RunConfig(
        model=load_model_config(getattr(args, "model", "smollm2")),
        data=DataConfig(name="wikitext-2-dev" if args.dev else "wikitext-2", source="local", path=str(path),
                        n_samples=args.n_samples, seq_len=args.seq_len, seed=0, eval_n_samples=args.eval_n_samples,
                        eval_seq_len=args.seq_len),
        quant=load_recipe(next((n for n in names if is_exportable_recipe(load_recipe(n))), "fp16")),
        cache_dir=args.cache_dir,
        eval=EvalConfig(recipes=names, perturb_seeds=list(range(1, args.perturb_seeds + 1)),
                        perturb_scale=args.perturb_scale))
    if args.codebook_weighting:
        cfg.codebooks.weighting = args.codebook_weighting
    cfg.codebooks.qnorm = bool(getattr(args, "qnorm", False))
    cfg.codebooks.lloyd_check = bool(getattr(args, "lloyd_check", False))
    cfg.export.enabled = cfg.check.enabled = False
    cfg.sensitivity.enabled = cfg.probes.enabled = cfg.gate.enabled = False
    return cfg


def run_protocol(names: list[str], args: argparse.Namespace, cfg: RunConfig | None = None) -> dict:
    """Every recipe in `names` side by side in one pipeline run on the protocol's windows -> run_pipeline's dict."""
    cfg = cfg or protocol_config(names, args)
    with tempfile.TemporaryDirectory() as tmp:
        return run_pipeline(cfg, Path(tmp), log=print, show_progress=False)


def library_recipes_served(names: list[str], model: str) -> list[str]:
    """The default recipe list without the library caches the library refuses for this model (transformers'
    QuantizedCache on sliding-window layers: stages.engine_cache.supports), each dropped with a line saying why;
    an explicit --recipes is passed through, and the pipeline refuses it by name."""
    from transformers import AutoConfig

    from pipeline.model import source_directory
    from stages.engine_cache import supports
    from stages.hooks import layer_windows
    folder = source_directory(load_model_config(model))
    if folder is None or not (folder / "config.json").is_file():
        return names
    types = ["full" if w is None else "sliding" for w in layer_windows(AutoConfig.from_pretrained(folder))]
    if supports(types):
        return names
    dropped = [n for n in names if load_recipe(n).engine.library]
    for n in dropped:
        print(f"{n}: not run -- transformers' QuantizedCache refuses models with sliding-window layers "
              f"({types.count('sliding')} of {len(types)} in {model})")
    return [n for n in names if n not in dropped]


def plain_forward_s(model: torch.nn.Module, ids: torch.Tensor, repeats: int = 3) -> float:
    """The median wall time of one plain full-precision forward (the model's own attention, logits of every
    position) of ids [1, T], after one warm-up: what one evaluated unit costs at the least."""
    times = []
    with torch.no_grad():
        for i in range(repeats + 1):
            start = time.perf_counter()
            model(ids, use_cache=False).logits
            if i:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def is_evaluation_stage(name: str) -> bool:
    """The run's evaluation stages (stages/evaluate.py): the reference, each recipe's, the table."""
    return name in ("evaluate", "evaluate-reference") or name.startswith("evaluate-recipe-")


def evaluation_cost(out: dict) -> dict:
    """eval_wall_s (the evaluation's stages -- the reference, every recipe's, the table --, None when any came from
    the stage cache), eval_units (recipe x seed x window forwards) and eval_forward_s (plain_forward_s on the first
    evaluation window, timed now, in this run)."""
    records = [r for r in out["runner"].records if is_evaluation_stage(r.name)]
    lm, ev = out["model"], out["summary"]["evaluation"]
    forward = plain_forward_s(lm.model, out["windows"].eval[:1].to(model_device(lm.model)))
    wall = sum(r.wall_s for r in records) if all(r.status == "computed" for r in records) else None
    return {"eval_wall_s": wall, "eval_units": ev["units"], "eval_forward_s": forward,
            "eval_cost_ratio": None if wall is None else wall / (ev["units"] * forward)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_protocol_args(ap)
    ap.add_argument("--recipes", default=",".join(RECIPES))
    args = ap.parse_args()
    start = time.perf_counter()
    names = args.recipes.split(",")
    if args.recipes == ap.get_default("recipes"):
        names = library_recipes_served(names, args.model)
    out = run_protocol(names, args)
    summary = out["summary"]
    recipes = summary["evaluation"]["recipes"]
    print()
    print(table(recipes))
    print(f"calibration wall (traces + fisher + key scales + outliers + codebooks): {summary['calib_wall_s']:.1f} s")
    for r in out["runner"].records:
        print(f"  {r.name:<28} {r.status:<9} {r.wall_s:7.1f} s")
    for line in pareto_report(recipes) + target_report(recipes) + peer_report(recipes):
        print(line)
    for line in kmeans_report(summary["stage_meta"]):
        print(line)
    cost = evaluation_cost(out)
    if cost["eval_wall_s"] is None:
        print(f"evaluation: from the stage cache (no wall time); one plain forward {cost['eval_forward_s']:.3f} s")
    else:
        print(f"evaluation: {cost['eval_wall_s']:.1f} s for {cost['eval_units']} recipe x seed x window forwards; one "
              f"plain forward of a window {cost['eval_forward_s']:.3f} s; wall / (units x forward) "
              f"{cost['eval_cost_ratio']:.3f}")
    print(f"bench.quality wall: {time.perf_counter() - start:.1f} s")
    keys = ("ppl", "kl", "top1", "avg_bits", "ppl_ratio", "ppl_ratio_ci95", "ppl_seeds")
    ev = summary["evaluation"]
    write_json(args.json, {"recipes": {n: {k: recipes[n][k] for k in keys if k in recipes[n]} for n in names},
                           "windows": ev["windows"], "seq_len": ev["seq_len"], "perturb_seeds": ev["perturb_seeds"],
                           "perturb_scale": ev["perturb_scale"], "calib_wall_s": summary["calib_wall_s"],
                           "wall_s": time.perf_counter() - start, **cost})


if __name__ == "__main__":
    main()
