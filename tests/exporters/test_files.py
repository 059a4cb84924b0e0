"""Durable and atomic file writes (exporters/files.py)."""
import json
import os
import stat
from pathlib import Path

import pytest

from exporters.files import atomic_write_bytes, atomic_write_json, atomic_write_text, write_synced


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


def test_write_synced_creates_or_truncates(tmp_path):
    path = write_synced(tmp_path / "a.bin", b"longer content")
    assert path.read_bytes() == b"longer content"
    write_synced(path, b"short")
    assert path.read_bytes() == b"short"
