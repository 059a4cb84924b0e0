"""How fast and how clean the command line's refusals are, as a user meets them.

    python -m bench.refusals [--repeat N] [--json PATH]

Runs each refused command -- an unknown key, a misspelled recipe, model or data option, a model folder that does
not exist, a value only the composed config refuses, a sweep with one bad job -- and each command's `--help`, as
`python -m pipeline ...` subprocesses, each from a fresh temporary working folder with MLflow tracking on (its
default store, sqlite:///mlruns.db there), and prints one row per command: the exit code, the wall seconds from
process start to exit (the median of --repeat runs), whether an outputs/ (or multirun/) folder or mlruns.db
appeared, and the first line of what it printed. The targets (issue 50): exit code 2 for a refusal (0 for
--help), nothing created, within 3 s. A benchmark, not a test: the times depend on the machine and its load
(tests/pipeline/test_cli.py checks the codes, messages and leftovers).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import write_json

ROOT = Path(__file__).resolve().parent.parent
MISSING_MODEL = "/nonexistent/kvcalib-bench/my-llama"

# (what it shows, the arguments after `python -m pipeline`)
COMMANDS = [
    ("unknown key", ["run", "foo=1"]),
    ("unknown key in a group", ["run", "model.pth=x"]),
    ("misspelled key", ["run", "data.n_sample=4"]),
    ("misspelled recipe", ["run", "quant=kvquant-4b+sink16+recent12"]),
    ("misspelled model", ["run", "model=llama"]),
    ("misspelled data option", ["run", "data=lokal"]),
    ("misspelled comparison recipe", ["run", "eval.recipes=[fp16,kvquant-4b-1pt]"]),
    ("missing model folder (hub)", ["run", "model=llama3", f"model.path={MISSING_MODEL}"]),
    ("missing model folder (local)", ["run", "model.source=local", f"model.path={MISSING_MODEL}"]),
    ("data=local without data.path", ["run", "data=local"]),
    ("value refused by validate_run", ["run", "data.seq_len=1"]),
    ("sweep with one bad job", ["run", "-m", "data.n_samples=2,0"]),
    ("top-level help", ["--help"]),
    *((f"{c} --help", [c, "--help"]) for c in ("run", "check", "show", "export-vllm", "recommend")),
]


def run_once(args: list[str]) -> dict:
    """One command from a fresh working folder: exit code, wall seconds, what it left, its first line."""
    with tempfile.TemporaryDirectory(prefix="kvcalib-refusal-") as tmp:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        env.pop("MLFLOW_TRACKING_URI", None)
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=tmp, env=env, capture_output=True,
                             text=True, timeout=600)
        wall = time.perf_counter() - start
        left = sorted(p.name for p in Path(tmp).iterdir())
    text = (out.stderr if out.returncode else out.stdout).strip()
    return {"code": out.returncode, "wall_s": wall, "outputs": any(n in left for n in ("outputs", "multirun")),
            "mlruns_db": "mlruns.db" in left, "left": left, "first_line": text.splitlines()[0] if text else ""}


def measure(repeat: int) -> list[dict]:
    rows = []
    for what, args in COMMANDS:
        runs = [run_once(args) for _ in range(repeat)]
        row = {"what": what, "command": " ".join(args), **runs[-1],
               "wall_s": statistics.median(r["wall_s"] for r in runs), "wall_s_all": [r["wall_s"] for r in runs]}
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(row: dict) -> str:
    yes = {True: "yes", False: "no"}
    return (f"{row['command'][:52]:<52} {row['code']:>4} {row['wall_s']:>7.2f} {yes[row['outputs']]:>8} "
            f"{yes[row['mlruns_db']]:>9}  {row['first_line'][:110]}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1, help="runs per command; the median wall time is shown")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    print(f"python -m pipeline ... from a fresh temporary folder each (median of {args.repeat}); target: a refusal "
          f"exits 2 within 3 s and leaves nothing\n")
    print(f"{'command':<52} {'exit':>4} {'wall_s':>7} {'outputs/':>8} {'mlruns.db':>9}  message (first line)")
    rows = measure(args.repeat)
    slow = [r["command"] for r in rows if r["wall_s"] > 3.0]
    left = [r["command"] for r in rows if r["outputs"] or r["mlruns_db"]]
    print(f"\nover 3 s: {', '.join(slow) or 'none'}\nleft outputs/ or mlruns.db: {', '.join(left) or 'none'}")
    write_json(args.json, {"python": sys.version.split()[0], "repeat": args.repeat, "rows": rows})


if __name__ == "__main__":
    main()
