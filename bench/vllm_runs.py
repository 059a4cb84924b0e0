"""The vLLM processes bench.vllm_serve starts (bench/vllm_worker.py in .venv-vllm) and what both of its benchmarks
(the fp8 checkpoint's, and the packed checkpoint's in bench/vllm_packed.py) share."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_PYTHON = os.environ.get("KVCALIB_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))


def reference_view(checkpoint: Path, into: Path) -> Path:
    """The checkpoint's weights without its KV scheme (config.json without quantization_config; every other
    file linked): the model a user serves with kv_cache_dtype="auto", or "fp8" without calibrated scales."""
    from exporters.compressed_tensors import INDEX_FILE, SCALES_FILE

    into.mkdir(parents=True)
    for p in checkpoint.iterdir():
        if p.is_file() and p.name not in ("config.json", INDEX_FILE, SCALES_FILE):
            os.symlink(p.resolve(), into / p.name)
    config = json.loads((checkpoint / "config.json").read_text())
    config.pop("quantization_config", None)
    (into / "config.json").write_text(json.dumps(config, indent=1))
    index = json.loads((checkpoint / INDEX_FILE).read_text())  # without the scales: vLLM would refuse them
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != SCALES_FILE}
    (into / INDEX_FILE).write_text(json.dumps(index, indent=1))
    return into

def require_vllm(python: str, bench: str) -> None:
    """Exit naming the missing vLLM environment (a benchmark's first check)."""
    if not Path(python).is_file():
        raise SystemExit(f"{bench}: no vLLM environment at {python} (bash scripts/install-vllm.sh creates .venv-vllm)")


def run_vllm(python: str, model_dir: Path, run: dict, job: dict, work: Path, log) -> dict:
    job_path, out_path = work / f"{run['name']}.job.json", work / f"{run['name']}.out.json"
    job_path.write_text(json.dumps({**job, "runs": [run]}))
    log_path = work / f"{run['name']}.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        proc = subprocess.run([python, "-m", "bench.vllm_worker", "--checkpoint", str(model_dir), "--job",
                               str(job_path), "--out", str(out_path)], cwd=str(ROOT), stdout=logf,
                              stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0 or not out_path.is_file():
        tail = log_path.read_text()[-3000:]
        raise SystemExit(f"vLLM run {run['name']} failed (exit {proc.returncode}); its log ends:\n{tail}")
    result = json.loads(out_path.read_text())
    out = result["runs"][0] | {"wall_s": time.perf_counter() - t0, "vllm_version": result["vllm_version"]}
    log(f"  vllm {run['name']:<22} load {out['load_s']:6.1f} s" + (f"  score {out['score_s']:6.1f} s"
                                                                      if "score_s" in out else "")
        + f"  (process {out['wall_s']:.1f} s)")
    return out

def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def verify_at_end(ckpt: Path, log, agree: str) -> bool:
    """The folder checked whole once more after the engine ran (exporters.compressed_tensors.verify_checkpoint):
    True and `agree` logged, or False and the reason logged (the benchmark then exits non-zero)."""
    from exporters.compressed_tensors import verify_checkpoint

    try:
        verify_checkpoint(ckpt)
    except Exception as exc:  # noqa: BLE001 -- reported and fails the benchmark
        log(f"\nverify_checkpoint FAILED: {type(exc).__name__}: {exc}")
        return False
    log(f"\nverify_checkpoint: the folder matches kvcalib/checkpoint.json; {agree}")
    return True
