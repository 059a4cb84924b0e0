"""Crash and determinism proofs on real tiny pipeline runs (subprocesses, as a user runs them).

- Determinism: two runs of one config and seed, each with a fresh cache, export bit-identical tensors and
  manifests that differ only in `MANIFEST_MAY_DIFFER`; their summaries differ only in timings, memory and paths.
- Crashes: a run is killed with SIGKILL at one of `POINTS` (pipeline/faults.py: inside stages, between a cache
  entry's tensor save and its rename, around the artifact export, during MLflow logging, before summary.json),
  then rerun with the same command (same cache, same run dir, so `export.overwrite=true` as a user would pass)
  and must end with the uninterrupted run's artifact, bit for bit: the rerun reads no damaged cache entry,
  leaves every entry whole and no temporary or lock behind, and the killed attempt's MLflow run is not FINISHED
  (the rerun marks it KILLED: its process is gone). `pytest -s` prints the table.

To keep this within minutes on two cores, the uninterrupted run is shared, each crash scenario starts from a
cache holding the baseline's entries of the stages before the one it kills (a later stage's kill point would
otherwise pay for every earlier stage), scenarios run two at a time, and the MLflow store of each scenario is a
copy of the baseline's (a fresh sqlite store spends seconds on schema migrations).
"""
import concurrent.futures
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model=tiny", "quant=kvquant-4b-1pct", "data.n_samples=2", "data.seq_len=32", "data.eval_n_samples=1", "data.eval_seq_len=32",
        "traces.reservoir_size=16", "probes.lengths=[64]", "sensitivity.variants=[kv]", "eval.recipes=[fp16]",
        "check.enabled=false"]
# every point is reached by the TINY run (kvquant-4b-1pct: one calibration group f0.01-s1-pre); ten run by
# default (one per kind of place), all of them with KVCALIB_CRASH_POINTS=all
POINTS = [
    "stage.traces.progress",                        # after the first unit of the first stage
    "cache.codebooks-f0.01-s1-pre.before_rename",   # an entry complete in its temporary folder, not renamed
    "cache.sensitivity.stored",                     # an entry in place, its lock not yet released
    "mlflow.started",                               # the MLflow run exists, nothing logged in it
    "export.before_write",
    "export.after_write",                           # artifact in place, nothing else exported
    "export.before_update_manifest",                # the gate verdict not yet in the manifest
    "summary.before_write",
    "mlflow.metrics_logged",                        # metrics and tags logged, artifacts not yet
    "mlflow.before_end",                            # everything logged, the run not yet FINISHED
]
MORE_POINTS = [
    "cache.fisher.saved",                           # an entry's tensors written, its meta.json not yet
    "stage.evaluate.progress",
    "report.before_write",
    "mlflow.params_logged",
    "mlflow.artifacts_logged",
]
if os.environ.get("KVCALIB_CRASH_POINTS") == "all":
    POINTS += MORE_POINTS
# what two identical runs may write differently into the manifest: the export time, and the manifest's digest
# of its own text (exporters/manifest.py DIGEST_FIELD), which covers that time
MANIFEST_MAY_DIFFER = {"created", "manifest_digest"}
# ... and into summary.json: wall times, memory, lock waits, and the paths of the run dir's files
SUMMARY_MAY_DIFFER = {"wall_s", "calib_wall_s", "peak_rss_mb", "artifact_dir", "vllm_checkpoint_dir", "report",
                      "manifest.sha256", "stages[].wall_s", "stages[].peak_rss_mb", "stages[].waited_s",
                      "stages[].others_cpu", "steps[].wall_s", "steps[].peak_rss_mb", "steps[].others_cpu", "busy"}


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "KVCALIB_"))}
    return {**env, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **extra}


def _run(cwd: Path, args: list[str], timeout: float = 900, **env: str) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "pipeline", "run", *TINY, f"hydra.run.dir={cwd / 'run'}", *args],
                          cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=timeout)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _strip(tree, drop: set[str], prefix: str = ""):
    """`tree` without the dotted paths in `drop` (`stages[].wall_s`: that key in every item of a list)."""
    if isinstance(tree, dict):
        return {k: _strip(v, drop, f"{prefix}{k}.") for k, v in tree.items() if f"{prefix}{k}" not in drop}
    if isinstance(tree, list):
        return [_strip(v, drop, f"{prefix[:-1]}[].") for v in tree]
    return tree


def _diff_paths(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [p for k in sorted(set(a) | set(b)) for p in _diff_paths(a.get(k), b.get(k), f"{prefix}{k}.")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [p for x, y in zip(a, b) for p in _diff_paths(x, y, f"{prefix[:-1]}[].")]
    return [] if a == b else [prefix[:-1]]


class Baseline:
    def __init__(self, cwd: Path, out: subprocess.CompletedProcess):
        self.cwd, self.out = cwd, out
        self.run_dir = cwd / "run"
        self.summary = json.loads((self.run_dir / "summary.json").read_text())
        self.manifest = json.loads((self.run_dir / "artifact" / "manifest.json").read_text())
        self.tensors_sha256 = _sha256(self.run_dir / "artifact" / "tensors.safetensors")
        self.stages = [(s["name"], s["key"]) for s in self.summary["stages"]]


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    """Two uninterrupted runs started together, each with a fresh cache: the tracked baseline and a twin."""
    root = tmp_path_factory.mktemp("crash")
    t0, cpu0 = time.monotonic(), _children_cpu_s()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(_run, root / "baseline", ["tracking.experiment=baseline"])
        second = pool.submit(_run, root / "twin", ["tracking.enabled=false"])
        runs = {"baseline": first.result(), "twin": second.result()}
    print(f"\ntwo uninterrupted runs: {time.monotonic() - t0:.0f} s wall, {_children_cpu_s() - cpu0:.0f} s CPU")
    for name, out in runs.items():
        assert out.returncode == 0, (name, out.stderr[-3000:])
    return root, Baseline(root / "baseline", runs["baseline"]), Baseline(root / "twin", runs["twin"])


@pytest.mark.slow
def test_same_config_and_seed_give_identical_artifacts(baselines):
    """Separate fresh caches, same config and seed: tensors.safetensors is bit-identical; the manifests are
    equal except `created` (the export time) and `manifest_digest` (which covers it) -- creator.git_sha, the
    stage cache keys, the evaluation, the gate are equal; the summaries are equal except wall times, peak RSS,
    lock waits, the paths of the run's files and the manifest sha256 (the manifest differs in `created`)."""
    _, a, b = baselines
    assert a.tensors_sha256 == b.tensors_sha256
    assert a.manifest["tensor_file"]["sha256"] == b.manifest["tensor_file"]["sha256"] == a.tensors_sha256
    assert set(_diff_paths(a.manifest, b.manifest)) <= MANIFEST_MAY_DIFFER, _diff_paths(a.manifest, b.manifest)
    assert _strip(a.manifest, MANIFEST_MAY_DIFFER) == _strip(b.manifest, MANIFEST_MAY_DIFFER)
    assert _strip(a.summary, SUMMARY_MAY_DIFFER) == _strip(b.summary, SUMMARY_MAY_DIFFER), \
        _diff_paths(a.summary, b.summary)
    assert [s["status"] for s in a.summary["stages"]] == ["computed"] * len(a.stages)
    report = (a.run_dir / "report.md").read_text()
    layer_map = report[report.index("## Layer map"):report.index("## Ledger")]
    assert "nan" not in layer_map and "KL (K+V)" in layer_map and "KL (K only)" not in layer_map  # variants=[kv]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _stage_of(point: str) -> str | None:
    """The stage a kill point sits in (`cache.<stage>.<where>`, `stage.<stage>.progress`), else None."""
    kind, _, rest = point.partition(".")
    return rest[: rest.rindex(".")] if kind in ("cache", "stage") else None


def _seed(cache: Path, base: Baseline, point: str) -> None:
    """The baseline's entries of every stage before the one the point kills (all of them for a later point)."""
    names = [name for name, _ in base.stages]
    stage = _stage_of(point)
    assert stage is None or stage in names, f"{point}: no stage {stage!r} in {names}"
    upto = names.index(stage) if stage else len(names)
    for name, key in base.stages[:upto]:
        shutil.copytree(base.cwd / ".kvcalib_cache" / name / key, cache / name / key)


def _problems_in_cache(cache: Path) -> list[str]:
    from pipeline.runner import StageCache

    found = [f"left behind: {p.relative_to(cache)}" for pattern in ("*/.tmp-*", "*/.lock-*")
             for p in cache.glob(pattern)]
    store = StageCache(cache, log=lambda s: None)
    found += [f"not whole: {p.relative_to(cache)}" for p in cache.glob("*/*")
              if not p.name.startswith(".") and not store.whole(p.parent.name, p.name)]
    return found


def _killed_run_status(db: Path, pid: int) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    exps = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(exps, filter_string=f"tags.kvcalib_pid = '{pid}'")
    return ",".join(r.info.status for r in runs) or "no run"


def _run_status(db: Path, run_id: str) -> str:
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{db}").get_run(run_id).info.status


def _scenario(root: Path, base: Baseline, point: str) -> dict:
    cwd = root / f"kill-{point}"
    cwd.mkdir()
    _seed(cwd / ".kvcalib_cache", base, point)
    shutil.copy(base.cwd / "mlruns.db", cwd / "mlruns.db")
    args = ["tracking.experiment=crash", "export.overwrite=true"]
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "run", *TINY, f"hydra.run.dir={cwd / 'run'}", *args],
                            cwd=cwd, env=_env(KVCALIB_KILL_AT=point), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _, killed_err = proc.communicate(timeout=900)
    rerun = _run(cwd, args)
    row = {"point": point, "killed_rc": proc.returncode, "rerun_rc": rerun.returncode,
           "reached": f"killing process {proc.pid} at {point}@1" in killed_err, "wall_s": time.monotonic() - t0,
           "log": f"--- killed attempt\n{killed_err[-1500:]}\n--- rerun\n{rerun.stdout[-1500:]}\n"
                  f"{rerun.stderr[-1500:]}"}
    artifact = cwd / "run" / "artifact" / "tensors.safetensors"
    row["identical"] = artifact.is_file() and _sha256(artifact) == base.tensors_sha256
    row["damaged_read"] = [line for line in rerun.stdout.splitlines() if "is damaged" in line]
    problems = _problems_in_cache(cwd / ".kvcalib_cache")
    problems += [f"left behind: {p.name}" for p in (cwd / "run").glob(".artifact.*")]
    try:
        if not json.loads((cwd / "run" / "summary.json").read_text())["manifest"]["sha256"]:
            problems.append("summary.json names no manifest")
    except (OSError, ValueError, KeyError) as exc:
        problems.append(f"summary.json: {type(exc).__name__}")
    row["problems"] = problems
    row["mlflow_killed"] = _killed_run_status(cwd / "mlruns.db", proc.pid)
    rerun_ids = [line.split()[2] for line in rerun.stdout.splitlines() if line.startswith("mlflow: run ")]
    row["mlflow_rerun"] = _run_status(cwd / "mlruns.db", rerun_ids[0]) if len(rerun_ids) == 1 else "no run"
    row["ok"] = (row["reached"] and row["killed_rc"] == -9 and row["rerun_rc"] == 0 and row["identical"]
                 and not row["damaged_read"] and not problems and row["mlflow_killed"] not in ("FINISHED", "no run")
                 and row["mlflow_rerun"] == "FINISHED")
    return row


def _scenario_row(root: Path, base: Baseline, point: str) -> dict:
    try:
        return _scenario(root, base, point)
    except Exception as exc:  # reported in the table with the others, not instead of them
        return {"point": point, "killed_rc": "-", "rerun_rc": "-", "identical": False, "mlflow_killed": "-",
                "wall_s": 0.0, "ok": False, "reached": False, "damaged_read": [], "problems": [repr(exc)],
                "log": traceback.format_exc()}


@pytest.mark.slow
def test_killed_runs_rerun_to_the_uninterrupted_artifact(baselines):
    root, base, _ = baselines
    t0, cpu0 = time.monotonic(), _children_cpu_s()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        rows = list(pool.map(lambda p: _scenario_row(root, base, p), POINTS))
    lines = [f"{'kill point':<44} {'killed rc':>9} {'rerun rc':>8} {'artifact identical':>18} "
             f"{'mlflow status of killed run':>27} {'wall_s':>6}", "-" * 118]
    lines += [f"{r['point']:<44} {r['killed_rc']:>9} {r['rerun_rc']:>8} {str(r['identical']):>18} "
              f"{r['mlflow_killed']:>27} {r['wall_s']:>6.0f}" for r in rows]
    print(f"\n{len(rows)} kill points: {time.monotonic() - t0:.0f} s wall (two scenarios at a time), "
          f"{_children_cpu_s() - cpu0:.0f} s CPU in the pipeline processes\n" + "\n".join(lines))
    bad = [r for r in rows if not r["ok"]]
    assert not bad, "\n\n".join(f"{r['point']}: reached={r['reached']} damaged={r['damaged_read']} "
                                f"problems={r['problems']} rerun's MLflow run {r.get('mlflow_rerun')}\n{r['log']}"
                                for r in bad)
