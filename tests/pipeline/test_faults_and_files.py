"""The kill points (pipeline/faults.py) and atomic file writes (pipeline/files.py)."""
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import faults
from pipeline.files import atomic_write_bytes, atomic_write_json, atomic_write_text

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


def test_atomic_writes_replace_whole_files(tmp_path):
    path = tmp_path / "sub" / "summary.json"
    atomic_write_json(path, {"a": 1, "p": Path("x")})
    assert json.loads(path.read_text()) == {"a": 1, "p": "x"}
    atomic_write_text(path, "second")
    assert path.read_text() == "second"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # what a plain open() would give
    assert sorted(p.name for p in path.parent.iterdir()) == ["summary.json"]  # no temporary left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "report.md"
    atomic_write_bytes(path, b"old")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        atomic_write_bytes(path, b"new")
    monkeypatch.undo()
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["report.md"]
