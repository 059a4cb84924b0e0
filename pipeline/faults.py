"""Fault injection for crash tests: named kill points that are no-ops unless a test asks for one.

    KVCALIB_KILL_AT=cache.fisher.saved python -m pipeline run ...     # SIGKILL at the first hit of that point
    KVCALIB_KILL_AT=stage.traces.progress@2 python -m pipeline run ...  # ... at its second hit

`point(name)` sends SIGKILL to its own process when the environment variable names it (several points may be
given, comma-separated; `name@n` fires at the n-th hit, counted per process). SIGKILL is what the kernel's
OOM killer or `kill -9` does: no exception, no finally block, no atexit hook runs, so whatever is on disk at
that moment is what a rerun finds. Standard output and error are flushed first, only so that a test can read
what the process said before it died.

This is a test facility (tests/pipeline/test_crash_and_determinism.py); a run without the variable pays one
dictionary lookup per point. The points, by where they are:

    stage.<stage>.progress       the runner's progress callback, after each unit of work (pipeline/runner.py)
    cache.<stage>.saved          a cache entry's tensors are written in its temporary folder, meta.json not yet
    cache.<stage>.before_rename  the temporary folder is complete, not yet renamed into place
    cache.<stage>.stored         the entry is in place, its lock not yet released
    export.before_write          before the artifact folder is written (pipeline/export.py)
    export.after_write           the artifact folder is in place, nothing else exported yet
    export.vllm_weights_written  the vLLM checkpoint's weights are in its temporary folder, nothing else yet
    export.before_update_manifest  before the gate verdict is written into the manifest (pipeline/app.py)
    report.before_write          plots written, report.md not yet (pipeline/analysis.py)
    summary.before_write         before summary.json is written (pipeline/app.py)
    mlflow.started               the MLflow run exists, no params logged yet (pipeline/tracking.py)
    mlflow.params_logged         params logged; the stages have not run
    mlflow.metrics_logged        metrics and tags logged, artifacts not yet
    mlflow.artifacts_logged      artifacts logged, the run not yet ended
    mlflow.before_end            just before the run is marked FINISHED
"""
from __future__ import annotations

import os
import signal
import sys

ENV = "KVCALIB_KILL_AT"
_hits: dict[str, int] = {}


def _targets(spec: str) -> dict[str, int]:
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, nth = item.partition("@")
        out[name] = int(nth) if nth else 1
    return out


def point(name: str) -> None:
    """SIGKILL this process if $KVCALIB_KILL_AT names this point (at its n-th hit with `name@n`)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    nth = _targets(spec).get(name)
    if nth is None:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == nth:
        print(f"faults: killing process {os.getpid()} at {name}@{nth}", file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["point", "ENV"]
