"""A user's first look, timed as they meet it: a model folder of their own (a save_pretrained copy of an embedded
model), then the README's two commands from the command line --

    kvcalib run model=llama3 model.path=DIR preset=quick     (a fresh stage cache, MLflow in its own SQLite store)
    kvcalib check ARTIFACT

-- each a subprocess, timed from outside (wall seconds), with the share of the machine's CPUs other processes took
meanwhile (pipeline.runner.Usage: a figure taken while others held the CPUs is not this machine's and is flagged).
The run's own stage table (what each stage, the runtime check and the canary cost) is printed after the figures.
Targets (issue 69): the quick run <= 180 s and the check <= 60 s on this 2-core machine, alone.

    python -m bench.first_hour [--model smollm2] [--json bench-results/first_hour-69.json]
"""
from __future__ import annotations

import argparse
import copy
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import write_json

ROOT = Path(__file__).resolve().parents[1]
TARGETS_S = {"run": 180.0, "check": 60.0}


def own_copy(model: str, folder: Path) -> Path:
    """The embedded model saved with save_pretrained (weights, config, tokenizer): a folder as a user has one."""
    from pipeline.config import load_model_config
    from pipeline.model import load_model

    lm = load_model(load_model_config(model))
    config = copy.deepcopy(lm.model.config)
    if hasattr(config, "quantization_config"):  # dequantized from the embedded GGUF: plain float weights now
        del config.quantization_config
    plain = type(lm.model)(config)
    plain.load_state_dict(lm.model.state_dict())
    plain.save_pretrained(str(folder))
    lm.tokenizer.save_pretrained(str(folder))
    return folder


def timed(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, object]:
    """`python -m pipeline ARGS` in cwd, with its wall time and other processes' CPU share (Usage: the child is
    waited for inside the block, so its CPU seconds are this process's, never the others')."""
    from pipeline.runner import Usage

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    with Usage() as use:
        done = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, env=env, capture_output=True,
                              text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench.first_hour: `kvcalib {' '.join(args)}` exited {done.returncode}:\n"
                         f"{done.stderr[-3000:]}")
    return done, use


def stage_table(stdout: str) -> list[str]:
    """The run's stage table as it printed it: its header, rule and rows (pipeline.runner.Runner.table)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["stage", "status"])
    rows = lines[start:start + 2]
    for line in lines[start + 2:]:
        if not re.match(r"^\S.*\s(computed|cached|ran)\s+[\d.]+\s+\d+\s+(\d+%|-)$", line):
            break
        rows.append(line)
    return rows


def after(prefix: str, text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(prefix))[len(prefix):].strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="the embedded model copied into the user's folder")
    ap.add_argument("--preset", default="quick", help="the run's preset (the README's first look: quick)")
    ap.add_argument("--extra", nargs="*", default=[], help="more run overrides (tests make the run small)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvcalib-first-hour-") as tmp:
        work = Path(tmp)
        folder = own_copy(args.model, work / f"my-{args.model}")
        run_args = ["run", "model=llama3", f"model.path={folder}", f"preset={args.preset}",
                    f"cache_dir={work / 'cache'}", f"tracking.uri=sqlite:///{work / 'mlruns.db'}", *args.extra]
        run, run_use = timed(run_args, work)
        artifact = Path(after("results:", run.stdout)) / "artifact"
        check, check_use = timed(["check", str(artifact)], work)
        table = stage_table(run.stdout)
        rows = {"run": (run_use, " ".join(run_args)), "check": (check_use, f"check {artifact}")}
        print(f"first look at a save_pretrained copy of {args.model} (kvcalib {' '.join(run_args[:4])} ...):")
        print(f"{'command':<8} {'wall_s':>8} {'target_s':>9} {'met':>4} {'others_cpu':>11}")
        for name, (use, _) in rows.items():
            met = "yes" if use.wall_s <= TARGETS_S[name] else "NO"
            print(f"{name:<8} {use.wall_s:>8.1f} {TARGETS_S[name]:>9.0f} {met:>4} {use.others_cpu:>11.0%}")
        busy = [n for n, (use, _) in rows.items() if use.others_cpu >= 0.25]
        if busy:
            print(f"NOT ALONE: other processes took >= 25% of the CPUs during {', '.join(busy)}: not a figure")
        print(f"check's own line: {after('time:', check.stdout)}")
        print("the run's stage table:")
        print("\n".join(table))
        write_json(args.json, {
            "model": args.model, "preset": args.preset, "cpus": os.cpu_count(),
            "figures": {n: {"command": f"kvcalib {cmd}", "wall_s": round(use.wall_s, 2), "target_s": TARGETS_S[n],
                            "met": use.wall_s <= TARGETS_S[n], "others_cpu": round(use.others_cpu, 3)}
                        for n, (use, cmd) in rows.items()},
            "check_time_line": after("time:", check.stdout), "stage_table": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
