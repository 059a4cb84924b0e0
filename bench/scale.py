"""Scale: per-stage wall time and peak RSS of the pipeline on Llama-3 shapes, a per-layer cost model, and the
predicted wall and memory of Llama-3-8B and Llama-3-70B.

The pipeline runs on `model=llama3-shape` (pipeline/shapes.py: the real configuration, random bf16 weights) at
--layers (default 1 and 2) with the 8B preset, and at --layers-70b (default 1) with the 70B preset (hidden 8192,
64/8 heads, intermediate 28672; --layers-70b '' skips it), each in a fresh process (its own peak RSS) with a fresh
stage cache (every stage computed). Text: wikitext-2 (KVCALIB_WIKITEXT) as in bench.quality. Each stage's wall and
peak RSS come from the runner's records (pipeline/runner.py: wall_s, peak_rss_mb sampled every 20 ms while the stage
runs);
`load` is the model build (random init here: time and memory grow with the parameters, as a real load's do; its
speed does not: a real 8B / 70B load reads 16 / 141 GB of files), `rest` the run's wall outside the load and the
stages (tokenizing, windows, export, report).

The cost model, per stage, fitted on the 8B-shaped runs (least squares on y = a + b * n_layers):
- peak RSS = base + W_fixed + n_layers * W_layer + A_fixed + n_layers * A_layer. base: the process before the model
  loads (measured); W: the weights in bf16 = parameters x 2 bytes, exact from the preset (fixed: embeddings +
  lm_head + final norm, 2 x vocab x hidden + hidden; per layer: attention + MLP + 2 norms); A: the rest,
  activations and stage state (A_fixed = a - base - W_fixed, A_layer = b - W_layer, floored at 0).
- wall = a + b * n_layers.
For 70B, nothing per layer is measured at 70B's depth (unless --layers-70b names two depths: then 70B is fitted
like 8B), so its per-layer costs are the 8B fit scaled, by the kind of stage:
- model stages (traces, fisher, evaluate, sensitivity, probes, prefix_tokens: a forward / backward through every
  layer; load: drawing the weights): per-layer wall x layer-parameter ratio (3.92: matmul FLOPs), per-layer
  activations x hidden ratio (2: [T, hidden] and [T, intermediate]; the K/V-sized part, 8 KV heads x 128, does not
  grow, so this errs high), fixed wall x fixed-parameter ratio (2: the lm_head);
- K/V stages (key_scales, outliers, codebooks, smooth; rest: the artifact): they read the per-layer K/V statistics
  and reservoir, [S, H_kv, D] per layer, the same for 8B and 70B: ratio 1.
Weights are exact either way. The measured 70B-shaped layer anchors the fixed part (prediction = measured at 1 layer
+ 79 scaled layers), and the 8B-only prediction of that 1-layer run is printed beside the measurement as a check.
Per GPU with device_map (accelerate, layers split evenly over G GPUs): the host's base stays on the host; a GPU holds
ceil(L / G) layers (weights + A_layer), plus the embedding or lm_head and, on the last one, A_fixed (full-vocabulary
logits); G is the fewest 80 GiB GPUs on which the stage fits. CPU-measured activations stand in for GPU ones
(same dtype; no CUDA allocator overhead, no GPU measurement): a model, not a measurement.

python -m bench.scale [--json PATH] [--seq-len 8192] [--n-samples 2] [--eval-seq-len 8192] [--eval-n-samples 1]
                      [--layers 1,2] [--layers-70b 1] [--probes] [--sensitivity]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASE_PRESET = "llama3-8b"
TARGETS = {"llama3-8b": 32, "llama3-70b": 80}   # preset -> the real depth predicted
GPU_MB = 80 * 1024                                # one 80 GiB GPU (H100 / A100 80 GB)
MAX_GPUS = 64
RECIPES = ["fp16", "kvquant-4b-1pct"]
LOAD, REST = "load", "rest"                       # the model build; the run's wall outside it and the stages
# steps that run (or build) the model: their per-layer cost grows with the layer's size; the others work on K/V
MODEL_STAGES = ("traces", "fisher", "evaluate", "sensitivity", "probes", "prefix_tokens", LOAD)
MB = 2 ** 20


# ---- shapes (pipeline/shapes.py presets: one definition of each model)

def layer_params(p: dict) -> int:
    """One decoder layer: q, k, v, o projections, gate / up / down MLP, two RMSNorms."""
    h, d = p["hidden_size"], p["head_dim"]
    attn = h * p["n_q_heads"] * d * 2 + h * p["n_kv_heads"] * d * 2
    return attn + 3 * h * p["intermediate_size"] + 2 * h


def fixed_params(p: dict) -> int:
    """Embeddings + untied lm_head + final norm."""
    return (1 if p["tie_word_embeddings"] else 2) * p["vocab_size"] * p["hidden_size"] + p["hidden_size"]


def weight_mb(n_params: int, bytes_per_param: int = 2) -> float:
    return n_params * bytes_per_param / MB


# ---- the cost model

def fit_linear(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b * x over (x, y) points -> (a, b); needs two distinct x."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        raise ValueError(f"a per-layer fit needs runs at two or more distinct n_layers, got {sorted(set(xs))}")
    n = len(points)
    mx, my = sum(xs) / n, sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def fit_stages(measured: list[dict], preset: str = BASE_PRESET) -> dict[str, dict]:
    """Per stage: {"wall": (a, b), "rss": (a, b)} from the measured rows of `preset` (y = a + b * n_layers)."""
    by_stage: dict[str, list[dict]] = {}
    for row in measured:
        if row.get("preset", BASE_PRESET) == preset:
            by_stage.setdefault(row["stage"], []).append(row)
    return {stage: {"wall": fit_linear([(r["n_layers"], r["wall_s"]) for r in rows]),
                    "rss": fit_linear([(r["n_layers"], r["peak_rss_mb"]) for r in rows])}
            for stage, rows in by_stage.items()}


def gpu_peak(g: int, n_layers: int, w_layer: float, a_layer: float, w_embed: float, w_head: float,
             a_fixed: float) -> float:
    """Per-GPU peak MB of a stage over g GPUs with device_map: layers split evenly (ceil(n_layers / g) on the fullest),
    the embedding on the first GPU, the lm_head and the full-vocabulary activations (a_fixed) on the last."""
    per_layer = math.ceil(n_layers / g) * (w_layer + a_layer)
    return per_layer + w_embed + w_head + a_fixed if g == 1 else per_layer + max(w_embed, w_head + a_fixed)


def gpu_layout(n_layers: int, w_layer: float, a_layer: float, w_embed: float, w_head: float, a_fixed: float,
               gpu_mb: float = GPU_MB) -> tuple[int, float]:
    """(G, per-GPU peak MB) for the fewest GPUs of gpu_mb on which the stage fits; MAX_GPUS and its peak when none
    does."""
    for g in range(1, MAX_GPUS + 1):
        peak = gpu_peak(g, n_layers, w_layer, a_layer, w_embed, w_head, a_fixed)
        if peak <= gpu_mb or g == MAX_GPUS:
            return g, peak
    raise AssertionError("unreachable")


def is_model_stage(stage: str) -> bool:
    return stage.split("-")[0] in MODEL_STAGES


def predict(fits: dict[str, dict], base_rss_mb: float, target: str, n_layers: int, presets: dict,
            anchor: dict[str, dict] | None = None, gpu_mb: float = GPU_MB, fit_preset: str = BASE_PRESET) -> dict:
    """Predicted wall, peak RSS and per-GPU peak of each stage and of the run for `target` at `n_layers`.
    fits: fit_stages on the `fit_preset` runs (scaled to `target` when it differs); anchor: {stage: {"n_layers",
    "wall_s", "peak_rss_mb"}} measured on `target` itself (a short run), which then replaces the scaled fixed part."""
    base, tgt = presets[fit_preset], presets[target]
    r_hidden = tgt["hidden_size"] / base["hidden_size"]
    r_layer = layer_params(tgt) / layer_params(base)
    r_fixed = fixed_params(tgt) / fixed_params(base)
    w_fixed_b, w_layer_b = weight_mb(fixed_params(base)), weight_mb(layer_params(base))
    w_fixed, w_layer = weight_mb(fixed_params(tgt)), weight_mb(layer_params(tgt))
    w_head = weight_mb(tgt["vocab_size"] * tgt["hidden_size"] + tgt["hidden_size"])
    w_embed = w_fixed - w_head
    stages = {}
    for stage, f in fits.items():
        (wa, wb), (ra, rb) = f["wall"], f["rss"]
        model = is_model_stage(stage)
        a_layer = max(rb - w_layer_b, 0.0) * (r_hidden if model else 1.0)
        a_fixed = max(ra - base_rss_mb - w_fixed_b, 0.0)
        wall_layer = max(wb, 0.0) * (r_layer if model else 1.0)
        wall = wa * (r_fixed if model else 1.0) + n_layers * wall_layer
        rss = base_rss_mb + w_fixed + a_fixed + n_layers * (w_layer + a_layer)
        if anchor and stage in anchor:  # measured on the target's shapes at anchor n_layers: extrapolate from there
            m = anchor[stage]
            wall = m["wall_s"] + (n_layers - m["n_layers"]) * wall_layer
            rss = m["peak_rss_mb"] + (n_layers - m["n_layers"]) * (w_layer + a_layer)
            a_fixed = max(m["peak_rss_mb"] - base_rss_mb - w_fixed - m["n_layers"] * (w_layer + a_layer), 0.0)
        n_gpus, _ = gpu_layout(n_layers, w_layer, a_layer, w_embed, w_head, a_fixed, gpu_mb)
        stages[stage] = {"wall_s": wall, "peak_rss_mb": rss, "n_gpus": n_gpus, "activation_fixed_mb": a_fixed,
                         "activation_layer_mb": a_layer}
    # one run, one device_map: the GPUs the hungriest stage needs; every stage's per-GPU peak on that layout
    run_gpus = max(st["n_gpus"] for st in stages.values())
    for st in stages.values():
        st["peak_gpu_mb"] = gpu_peak(run_gpus, n_layers, w_layer, st["activation_layer_mb"], w_embed, w_head,
                                     st["activation_fixed_mb"])
    weights = w_fixed + n_layers * w_layer
    return {"n_layers": n_layers, "wall_s": sum(s["wall_s"] for s in stages.values()),
            "peak_rss_mb": max(s["peak_rss_mb"] for s in stages.values()),
            "peak_gpu_mb": max(s["peak_gpu_mb"] for s in stages.values()), "n_gpus": run_gpus,
            "weights_mb": weights, "params": fixed_params(tgt) + n_layers * layer_params(tgt),
            "scaled_from": fit_preset if target != fit_preset else None,
            "ratios": {"hidden": r_hidden, "layer_params": r_layer, "fixed_params": r_fixed},
            "anchored": sorted(anchor) if anchor else [], "stages": stages}


# ---- measuring

def run_config(args: argparse.Namespace, preset: str, n_layers: int, cache_dir: str):
    from bench.common import wikitext_dir
    from pipeline.config import (DataConfig, EvalConfig, ModelConfig, RunConfig, ShapeModelConfig, TracesConfig,
                                 load_recipe)
    cfg = RunConfig(
        model=ModelConfig(name="llama3-shape", source="shape", dtype="bfloat16",
                          shape=ShapeModelConfig(preset=preset, n_layers=n_layers)),
        data=DataConfig(name="wikitext-2", source="local", path=str(wikitext_dir()), n_samples=args.n_samples,
                        seq_len=args.seq_len, seed=0, eval_n_samples=args.eval_n_samples,
                        eval_seq_len=args.eval_seq_len),
        quant=load_recipe("kvquant-4b-1pct"), eval=EvalConfig(recipes=list(RECIPES)),
        traces=TracesConfig(reservoir_size=args.reservoir), cache_dir=cache_dir)
    cfg.tracking.enabled = False
    cfg.check.enabled = args.check
    cfg.sensitivity.enabled, cfg.probes.enabled, cfg.gate.enabled = args.sensitivity, args.probes, False
    cfg.sensitivity.seq_len = 0   # the map on the whole window: what is scaled is the window's length
    if args.probes:
        cfg.probes.lengths = [args.eval_seq_len]
    return cfg


def worker(args: argparse.Namespace) -> None:
    """One measured run in this process: the process before the model (base), `load` (the model build: wall, and the
    process's peak RSS when it returns -- nothing before it held more), the runner's stage records, and `rest` (the
    run's wall outside the load and the stages: windows, export, report; its RSS is the process's when the run
    returns, as they hold little beyond the model and the results)."""
    import psutil

    from pipeline import app
    from pipeline.runner import peak_rss_mb

    load: dict = {}
    build = app.load_model

    def timed_load(cfg):  # the one pipeline step outside the runner's records that matters for scale
        t = time.perf_counter()
        lm = build(cfg)
        load.update(stage=LOAD, wall_s=time.perf_counter() - t, peak_rss_mb=peak_rss_mb(), status="computed")
        return lm

    app.load_model = timed_load  # this process only: it exits after the run
    with tempfile.TemporaryDirectory(prefix="kvcalib-scale-") as tmp:
        cfg = run_config(args, args.worker_preset, args.worker_layers, str(Path(tmp) / "cache"))
        base = psutil.Process().memory_info().rss / MB
        start = time.perf_counter()
        out = app.run_pipeline(cfg, Path(tmp) / "run", log=lambda *a: None, show_progress=False)
        total = time.perf_counter() - start
        end_rss = psutil.Process().memory_info().rss / MB
    records = out["runner"].records
    rows = [load] + [{"stage": r.name, "wall_s": r.wall_s, "peak_rss_mb": r.peak_rss_mb, "status": r.status}
                     for r in records]
    rows.append({"stage": REST, "wall_s": total - sum(r["wall_s"] for r in rows), "peak_rss_mb": end_rss,
                 "status": "computed"})
    Path(args.worker_out).write_text(json.dumps({"base_rss_mb": base, "wall_s": total,
                                                 "run_peak_rss_mb": out["summary"]["peak_rss_mb"], "rows": rows}))


def measure(args: argparse.Namespace, preset: str, n_layers: int) -> dict:
    """bench.scale --worker in a fresh process (its peak RSS is this run's alone)."""
    with tempfile.TemporaryDirectory(prefix="kvcalib-scale-out-") as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, "-m", "bench.scale", *settings_argv(args), "--worker-preset", preset,
               "--worker-layers", str(n_layers), "--worker-out", str(out)]
        print(f"measuring {preset} at n_layers={n_layers} ...", flush=True)
        subprocess.run(cmd, check=True, cwd=Path(__file__).resolve().parents[1])
        res = json.loads(out.read_text())
    for row in res["rows"]:
        row.update(n_layers=n_layers, preset=preset)
    print(f"  done in {res['wall_s']:.0f} s", flush=True)
    return res


def settings_argv(args: argparse.Namespace) -> list[str]:
    out = ["--seq-len", str(args.seq_len), "--n-samples", str(args.n_samples), "--eval-seq-len",
           str(args.eval_seq_len), "--eval-n-samples", str(args.eval_n_samples), "--reservoir", str(args.reservoir)]
    return out + [f"--{k}" for k in ("probes", "sensitivity", "check") if getattr(args, k)]


def parse_layers(text: str, flag: str, at_least: int) -> list[int]:
    try:
        layers = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"{flag} must be comma-separated integers, e.g. 1,2; got {text!r}")
    if len(layers) < at_least or (layers and layers[0] < 1):
        raise SystemExit(f"{flag} needs {at_least} or more distinct n_layers >= 1, got {text!r}")
    return layers


# ---- printing

def measured_table(rows: list[dict]) -> str:
    lines = [f"{'preset':<11} {'n_layers':>8} {'stage':<34} {'wall_s':>9} {'peak_rss_mb':>12}", "-" * 78]
    lines += [f"{r['preset']:<11} {r['n_layers']:>8} {r['stage']:<34} {r['wall_s']:>9.1f} {r['peak_rss_mb']:>12.0f}"
              for r in rows]
    return "\n".join(lines)


def predicted_table(name: str, pred: dict, host_mb: float, gpu_mb: float = GPU_MB) -> str:
    how = (f"per-layer costs scaled from {pred['scaled_from']} (hidden x{pred['ratios']['hidden']:.2f}, layer "
           f"params x{pred['ratios']['layer_params']:.2f})" + (", fixed part anchored on a measured "
           f"{name}-shaped layer" if pred["anchored"] else "") if pred["scaled_from"] else "fitted on measured runs")
    lines = [f"PREDICTED {name} ({pred['n_layers']} layers, {pred['params'] / 1e9:.2f}B params, bf16 weights "
             f"{pred['weights_mb'] / 1024:.1f} GiB; {how})",
             f"per-GPU peaks on the run's {pred['n_gpus']} GPU(s); gpus: the fewest on which the stage alone fits",
             f"{'stage':<34} {'wall_s':>10} {'peak_rss_mb':>12} {'peak_gpu_mb':>12} {'gpus':>5}  flags", "-" * 86]
    for stage, s in pred["stages"].items():
        flags = (["> host RAM"] if s["peak_rss_mb"] > host_mb else []) + (
            [f"> one {gpu_mb / 1024:.0f} GiB GPU"] if s["n_gpus"] > 1 else [])
        lines.append(f"{stage:<34} {s['wall_s']:>10.0f} {s['peak_rss_mb']:>12.0f} {s['peak_gpu_mb']:>12.0f} "
                     f"{s['n_gpus']:>5}  {', '.join(flags)}")
    lines.append(f"{'whole run':<34} {pred['wall_s']:>10.0f} {pred['peak_rss_mb']:>12.0f} {pred['peak_gpu_mb']:>12.0f} "
                 f"{pred['n_gpus']:>5}  {'> host RAM' if pred['peak_rss_mb'] > host_mb else ''}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--seq-len", type=int, default=8192, help="calibration window length (data.seq_len)")
    ap.add_argument("--n-samples", type=int, default=2, help="calibration windows (data.n_samples)")
    ap.add_argument("--eval-seq-len", type=int, default=8192, help="evaluation window length (data.eval_seq_len)")
    ap.add_argument("--eval-n-samples", type=int, default=1, help="evaluation windows (data.eval_n_samples)")
    ap.add_argument("--reservoir", type=int, default=4096, help="traces.reservoir_size")
    ap.add_argument("--layers", default="1,2", help="n_layers of the 8B-shaped runs (two or more distinct)")
    ap.add_argument("--layers-70b", default="1", help="n_layers of the 70B-shaped runs: '' none (70B scaled from the "
                    "8B fit alone), one (the fixed part anchored on it), two or more (70B fitted on its own)")
    ap.add_argument("--probes", action="store_true", help="passkey probes on (at --eval-seq-len)")
    ap.add_argument("--sensitivity", action="store_true", help="the layer x position sensitivity map on")
    ap.add_argument("--check", action="store_true", help="the runtime check (Triton interpreter on CPU) on")
    ap.add_argument("--worker-preset", help=argparse.SUPPRESS)
    ap.add_argument("--worker-layers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_out:
        return worker(args)
    layers = parse_layers(args.layers, "--layers", 2)
    layers_70b = parse_layers(args.layers_70b, "--layers-70b", 0)

    import psutil
    from pipeline.shapes import PRESETS
    host_mb = psutil.virtual_memory().total / MB
    settings = {"seq_len": args.seq_len, "n_samples": args.n_samples, "eval_seq_len": args.eval_seq_len,
                "eval_n_samples": args.eval_n_samples, "reservoir_size": args.reservoir, "recipes": RECIPES,
                "quant": "kvquant-4b-1pct", "dtype": "bfloat16", "layers": layers, "layers_70b": layers_70b,
                "probes": args.probes,
                "sensitivity": args.sensitivity, "check": args.check, "export": True, "torch_threads":
                os.environ.get("OMP_NUM_THREADS", "default"), "cpus": os.cpu_count(), "host_mb": host_mb}
    print("bench.scale settings: " + json.dumps(settings))
    runs = {BASE_PRESET: [measure(args, BASE_PRESET, n) for n in layers],
            "llama3-70b": [measure(args, "llama3-70b", n) for n in layers_70b]}
    measured = [row for preset_runs in runs.values() for run in preset_runs for row in run["rows"]]
    base_rss = min(run["base_rss_mb"] for run in runs[BASE_PRESET])
    fits = fit_stages(measured)
    print()
    print("MEASURED (model=llama3-shape, random bf16 weights; peak RSS of the process while the stage ran)")
    print(measured_table(measured))
    predicted = {}
    for target, depth in TARGETS.items():
        own = runs.get(target, [])
        if target == BASE_PRESET or len(own) >= 2:  # fitted on its own shapes
            predicted[target] = predict(fit_stages(measured, target), base_rss, target, depth, PRESETS,
                                        fit_preset=target)
        else:  # scaled from the 8B fit, anchored on a measured run of its own shapes when there is one
            anchor = {r["stage"]: r for r in own[0]["rows"]} if own else None
            if own:
                check = predict(fits, base_rss, target, own[0]["rows"][0]["n_layers"], PRESETS)
                print(f"\ncheck of the scaling: the {BASE_PRESET} fit scaled to the measured {target} run "
                      f"(predicted vs measured)")
                for stage, st in check["stages"].items():
                    if stage in anchor:
                        m = anchor[stage]
                        print(f"  {stage:<34} wall {st['wall_s']:8.1f} vs {m['wall_s']:8.1f} s   "
                              f"rss {st['peak_rss_mb']:8.0f} vs {m['peak_rss_mb']:8.0f} MB")
            predicted[target] = predict(fits, base_rss, target, depth, PRESETS, anchor)
        print()
        print(predicted_table(target, predicted[target], host_mb))
    print(f"\nflags: '> host RAM' = above this machine's {host_mb / 1024:.1f} GiB; '> one GPU' = needs more than one "
          f"{GPU_MB / 1024:.0f} GiB GPU with device_map (gpus: the fewest that fit). Predictions, not measurements: "
          f"random weights, settings above, CPU wall on this {os.cpu_count()}-CPU machine.")
    from bench.common import write_json
    write_json(args.json, {"measured": [{k: r[k] for k in ("n_layers", "stage", "wall_s", "peak_rss_mb", "preset",
                                                             "status")} for r in measured],
                           "predicted": predicted, "settings": settings, "base_rss_mb": base_rss,
                           "fits": {s: {"wall_a_b": f["wall"], "rss_a_b": f["rss"]} for s, f in fits.items()}})


if __name__ == "__main__":
    main()
