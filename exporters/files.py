"""Durable and atomic file writes: the one place that writes, flushes and fsyncs a file. The artifact writer
(exporters/native.py), the stage cache (pipeline/runner.py) and every file the pipeline writes (summary.json,
report.md, CSV, PNG plots) go through here, so a reader -- or a rerun after a crash -- sees the old file or the
new one, never a torn one.

`write_synced` writes a new file and fsyncs it (for files inside a temporary folder that is renamed into place
as a whole); `atomic_write_bytes` replaces one file:

The bytes go to a unique temporary file in the destination's folder (same filesystem, so the rename is atomic;
the name starts with a dot and says `.tmp`), are flushed and fsynced, and the file is renamed over the
destination with os.replace; the folder is fsynced too (best effort), so the rename survives a power cut.
A process killed mid-write leaves at most that dot-file behind, never a partial destination.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def _umask() -> int:
    try:  # Linux >= 4.7 reports it without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


_FILE_MODE = 0o666 & ~_umask()  # what open() would have given the file (mkstemp makes it 0600)


def fsync_dir(directory: str | Path) -> None:
    """Make a rename inside `directory` durable (best effort: some filesystems refuse directory fsync)."""
    try:
        fd = os.open(str(directory), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_fsync(f, data: bytes) -> None:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


def write_synced(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` (created or truncated) and fsync it: on disk before a later rename shows it."""
    path = Path(path)
    with open(path, "wb") as f:
        _write_fsync(f, data)
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            _write_fsync(f, data)
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    return atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str | Path, obj: Any, indent: int | None = 1) -> Path:
    """JSON (values JSON does not know are written as str, as everywhere in the pipeline)."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, default=str))


__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_write_json", "fsync_dir", "write_synced"]
