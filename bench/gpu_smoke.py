"""GPU smoke test: the pipeline on the embedded model with model.device=cuda, the compiled Triton runtime check,
and bench.kernel, in one script under 5 minutes on one GPU; prints one JSON line.

    python -m bench.gpu_smoke [--json PATH]        # on a machine with a CUDA GPU
    python -m bench.gpu_smoke --cpu                # dry run: the same path on the CPU, Triton interpreted

What it proves on a GPU: every stage runs with the model's weights and activations on the GPU (a device mix
raises), the stage results come back on the CPU (the content-addressed cache stores them so), the runtime check's
kernel runs compiled (`interpreter: false`) and matches the oracle within its tolerance, and the decode kernel's
latency against torch SDPA at 4k/16k (bench.kernel). `ok` is false -- and the exit status 1 -- when any of these
does not hold. The dry run (CI) checks the same wiring with small windows; it cannot prove CUDA correctness.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

RECIPE = "kvquant-4b-1pct"
EVAL_RECIPES = ["fp16", "fp8-e4m3", "kivi-4"]
KERNEL_CONTEXTS = "4096,16384"
KERNEL_BATCHES = "1,8"


def smoke_config(device: str, cache_dir: str, small: bool):
    """The run: embedded model and text, a calibrated recipe (traces, Fisher, key scales, outliers, codebooks),
    evaluation beside fp8 and KIVI, sensitivity, probes, export and the runtime check."""
    from pipeline.config import DataConfig, EvalConfig, ModelConfig, RunConfig, load_recipe

    n, t = (2, 128) if small else (8, 1024)
    cfg = RunConfig(model=ModelConfig(device=device),
                    data=DataConfig(n_samples=n, seq_len=t, eval_n_samples=1 if small else 4, eval_seq_len=t),
                    quant=load_recipe(RECIPE), eval=EvalConfig(recipes=list(EVAL_RECIPES)), cache_dir=cache_dir)
    cfg.traces.reservoir_size = 256 if small else 4096
    cfg.probes.lengths = [256] if small else [1024, 2048]
    cfg.probes.depths = [0.5] if small else [0.1, 0.5, 0.9]
    cfg.sensitivity.buckets = [0, 64] if small else [0, 128, 512]
    cfg.gate.enabled = False  # its thresholds judge the full protocol, not a smoke test's few short windows
    if small:
        cfg.check.contexts, cfg.check.batches = [64], [1]
    cfg.tracking.enabled = False
    cfg.export.vllm = False
    return cfg


def result_devices(results: dict) -> set[str]:
    """The device types of every tensor every stage returned (all 'cpu' when stages store results on CPU)."""
    return {t.device.type for r in results.values() for t in r.tensors.values()}


def run(cpu: bool) -> dict:
    import torch

    from pipeline.app import run_pipeline

    gpu = torch.cuda.is_available() and not cpu
    if not cpu and not gpu:
        return {"ok": False, "error": "no CUDA GPU visible (torch.cuda.is_available() is False); use --cpu for the "
                                      "dry run"}
    device = "cuda" if gpu else "cpu"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = run_pipeline(smoke_config(device, str(Path(tmp) / "cache"), small=cpu), Path(tmp) / "run",
                           log=lambda _m: None, show_progress=False)
        summary = out["summary"]
        param_devices = sorted({p.device.type for p in out["model"].model.parameters()})
        stored = sorted(result_devices(out["results"]))
    pipeline_s = time.perf_counter() - started
    check = summary.get("runtime_check", {})
    recipes = summary["evaluation"]["recipes"]
    kernel = run_kernel_bench() if gpu else {"skipped": "no GPU: bench.kernel measures native kernels only"}
    report = {
        "device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
        "model_device": param_devices, "stage_result_devices": stored,
        "stages": {r["name"]: round(r["wall_s"], 1) for r in summary["stages"] if r.get("status") == "computed"},
        "pipeline_s": round(pipeline_s, 1),
        "ppl_ratio": {n: round(r["ppl_ratio"], 4) for n, r in recipes.items()},
        "runtime_check": {k: check.get(k) for k in ("status", "interpreter", "max_rel_err", "tolerance", "device",
                                                   "triton", "contexts", "batches")},
        "kernel": kernel,
    }
    problems = []
    if param_devices != [device]:
        problems.append(f"model parameters on {param_devices}, asked for {device}")
    if stored != ["cpu"]:
        problems.append(f"stage results on {stored}: stages must store results on CPU")
    if check.get("status") != "passed":
        problems.append(f"runtime check {check.get('status')}: {check.get('error', '')}")
    if check.get("interpreter") is not (not gpu):
        problems.append(f"runtime check interpreter={check.get('interpreter')} on {device}")
    if gpu and "error" in kernel:
        problems.append(f"bench.kernel: {kernel['error']}")
    report["ok"], report["problems"] = not problems, problems
    return report


def run_kernel_bench() -> dict:
    """bench.kernel at 4k and 16k, batches 1 and 8, every format: its rows (stdout kept out of the one JSON line)."""
    from bench import kernel

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.json"
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                rc = kernel.main(["--contexts", KERNEL_CONTEXTS, "--batches", KERNEL_BATCHES, "--json", str(path)])
        except Exception as exc:  # reported in the JSON line, the smoke test fails
            return {"error": f"{type(exc).__name__}: {exc}", "output": buf.getvalue()[-2000:]}
        if rc != 0 or not path.is_file():
            return {"error": f"bench.kernel exited {rc}", "output": buf.getvalue()[-2000:]}
        rows = json.loads(path.read_text())["rows"]
    return {"rows": [{k: r[k] for k in ("format", "context", "batch", "ms", "sdpa_ms", "speedup", "max_rel_err")}
                     for r in rows]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU (Triton interpreted, small windows)")
    ap.add_argument("--json", default=None, help="also write the JSON line's object to PATH")
    args = ap.parse_args(argv)
    from pipeline.check import ensure_backend

    if args.cpu:
        import os
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        ensure_backend()
    report = run(args.cpu)
    from bench.common import write_json

    print(json.dumps(report, sort_keys=True))
    with contextlib.redirect_stdout(sys.stderr):
        write_json(args.json, report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
