"""The kill points (pipeline/faults.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import faults

ROOT = Path(__file__).resolve().parents[2]
_PROGRAM = ("from pipeline import faults\n"
            "faults.point('a'); print('after a', flush=True)\n"
            "faults.point('b'); print('after b1', flush=True)\n"
            "faults.point('b'); print('after b2', flush=True)\n")


def _program(kill_at: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != faults.ENV}
    if kill_at is not None:
        env[faults.ENV] = kill_at
    return subprocess.run([sys.executable, "-c", _PROGRAM], env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=60)


def test_points_are_no_ops_unless_named(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    faults.point("anything")
    monkeypatch.setenv(faults.ENV, "some.other.point")
    faults.point("anything")
    out = _program(None)
    assert out.returncode == 0 and out.stdout.split("\n")[:3] == ["after a", "after b1", "after b2"]


@pytest.mark.parametrize("kill_at,last", [("a", None), ("b", "after a"), ("b@2", "after b1"), ("x, b@2", "after b1")])
def test_a_named_point_kills_its_process_with_sigkill(kill_at, last):
    out = _program(kill_at)
    assert out.returncode == -9, out.stderr  # SIGKILL: no exception, no cleanup
    said = out.stdout.splitlines()
    assert (said[-1] if said else None) == last
    assert f"faults: killing process" in out.stderr
