"""Who owns a file in a shared folder, and a lock file that works across processes and hosts (NFS included).

Used by the stage cache (pipeline/runner.py) so that jobs sharing a `cache_dir` -- a joblib sweep on one machine,
SLURM jobs on a shared filesystem -- compute each entry once and never delete each other's work in progress.

Ownership. A process is named by `HOST_ID` (the host name plus a short hash of the kernel's boot id and the pid
namespace, so that two containers or two boots of one machine are not taken for one another) and its pid. On
this host a pid can be asked whether it still runs (and whether it is the same process: its start time is
recorded too); another host's processes cannot be asked, so their files are judged by age.

The lock. `<folder>/.lock-<key>` is created with O_CREAT | O_EXCL (atomic on local filesystems and on NFS v3+)
and holds JSON: host, host_id, pid, the process's start time, when the lock was taken and a random token. While
held, a thread touches the file every `heartbeat_s` seconds (its mtime is the heartbeat). A lock is stale when
its owner is on this host and its process is gone, or when its heartbeat is older than `stale_after_s` by this
host's clock, or when this waiter has watched it not change for `stale_after_s` (which needs no clock agreement
between hosts). A stale lock is broken under a second O_EXCL file (`.lock-<key>.break`) after checking that it
is still the very file judged stale, so two waiters never both break it, nor break a fresh lock taken meanwhile.
Waiters poll; the caller re-reads the cache once it holds the lock, so a job that waited loads the entry the
holder stored instead of computing it again.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import psutil


def _host_id() -> str:
    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    except OSError:
        pass
    try:
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        pass
    return f"{parts[0]}~{hashlib.sha256('|'.join(parts).encode()).hexdigest()[:8]}"


HOST = socket.gethostname()
HOST_ID = _host_id()


def _process_start(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def pid_alive(pid: int, started: float | None = None) -> bool:
    """Whether process `pid` of this host still runs (a zombie does not; with `started`, the same process)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(proc.create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False
    except (psutil.AccessDenied, OSError):
        return True  # it exists, and is not ours to look at


def owner_suffix() -> str:
    """`<pid>@<host id>`: appended to the names of this process's temporary files and folders."""
    return f"{os.getpid()}@{HOST_ID}"


def parse_owner(name: str) -> tuple[int, str] | None:
    """The (pid, host id) a name made with `owner_suffix` carries, or None for a name without one."""
    head, sep, host_id = name.rpartition("@")
    if not sep:
        return None
    pid = head.rsplit("-", 1)[-1]
    return (int(pid), host_id) if pid.isdigit() else None


def owner_is_gone(name: str, mtime: float, foreign_after_s: float, now: float | None = None) -> bool:
    """Whether a temporary file named with `owner_suffix` may be removed: one of a dead process of this host,
    or one older than `foreign_after_s` (another host's, or a name without an owner). This process's own are
    writes in flight (another thread's), removed by the writer itself when it fails."""
    now = time.time() if now is None else now
    owner = parse_owner(name)
    if owner is not None and owner[1] == HOST_ID:
        return owner[0] != os.getpid() and not pid_alive(owner[0])
    return now - mtime > foreign_after_s


def remove_orphans(paths, foreign_after_s: float) -> int:
    """Remove the temporary files and folders among `paths` whose owner is gone (owner_is_gone: a dead process
    of this host, or older than `foreign_after_s`) -> how many were removed. A path that vanished meanwhile is
    skipped."""
    removed = 0
    for path in paths:
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            continue
        if owner_is_gone(path.name, mtime, foreign_after_s):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            removed += 1
    return removed


@dataclass
class LockInfo:
    host: str
    host_id: str
    pid: int
    started: float | None     # the owner process's start time (tells a reused pid apart)
    acquired: float           # when the lock was taken (time.time() of the owner)
    token: str

    @classmethod
    def mine(cls) -> "LockInfo":
        return cls(HOST, HOST_ID, os.getpid(), _process_start(os.getpid()), time.time(), uuid.uuid4().hex)

    @classmethod
    def parse(cls, raw: bytes) -> "LockInfo | None":
        try:
            d = json.loads(raw)
            return cls(str(d["host"]), str(d["host_id"]), int(d["pid"]), d.get("started"), float(d["acquired"]),
                       str(d["token"]))
        except (ValueError, KeyError, TypeError):
            return None  # empty (its creator died between create and write) or foreign: judged by age

    def describe(self) -> str:
        when = time.strftime("%H:%M:%S", time.localtime(self.acquired))
        return f"pid {self.pid} on {self.host} (since {when})"


def stale_reason(holder: LockInfo | None, mtime: float, stale_after_s: float) -> str | None:
    """Why a lock file is stale (its owner on this host is gone, or its heartbeat is older than
    `stale_after_s` by this host's clock), or None."""
    if holder is not None and holder.host_id == HOST_ID and not pid_alive(holder.pid, holder.started):
        return f"process {holder.pid} on this host is gone"
    age = time.time() - mtime
    if age > stale_after_s:
        return f"its heartbeat is {age:.0f} s old (limit {stale_after_s:g} s)"
    return None


def break_lock(path: Path, raw: bytes, mtime_ns: int, stale_after_s: float) -> bool:
    """Remove the lock file at `path` if it is still the one judged stale (same bytes, same mtime), under the
    guard `<path>.break`; False when another process is breaking it, or it changed hands (or beat) meanwhile."""
    guard = path.with_name(path.name + ".break")
    try:
        fd = os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        with contextlib.suppress(OSError):  # a breaker that died holding the guard: breaking takes ms
            if time.time() - os.stat(guard).st_mtime > stale_after_s:
                os.unlink(guard)
        return False
    try:
        try:
            if path.read_bytes() != raw or os.stat(path).st_mtime_ns != mtime_ns:
                return False
        except FileNotFoundError:
            return False
        os.unlink(path)
        return True
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(guard)


def remove_if_stale(path: Path, stale_after_s: float) -> str | None:
    """Break the lock file at `path` if it is stale (a crash's leftover): the reason, or None (kept)."""
    try:
        st = os.stat(path)
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    reason = stale_reason(LockInfo.parse(raw), st.st_mtime, stale_after_s)
    return reason if reason is not None and break_lock(path, raw, st.st_mtime_ns, stale_after_s) else None


class FileLock:
    """An O_EXCL lock file with a heartbeat. `with FileLock(path, what, log): ...` blocks until held."""

    def __init__(self, path: str | Path, what: str = "", log: Callable[[str], None] = print,
                 heartbeat_s: float = 10.0, stale_after_s: float = 120.0, poll_s: float = 0.5,
                 log_every_s: float = 60.0):
        if stale_after_s <= 2 * heartbeat_s:
            raise ValueError(f"stale_after_s ({stale_after_s}) must exceed twice heartbeat_s ({heartbeat_s})")
        self.path, self.what, self.log = Path(path), what or str(path), log
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.poll_s, self.log_every_s = poll_s, log_every_s
        self.info: LockInfo | None = None
        self.waited_s = 0.0
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------ acquire / release

    def acquire(self) -> "FileLock":
        start = time.monotonic()
        seen, seen_since, said_at = None, 0.0, None
        while not self._try_create():
            try:
                st = os.stat(self.path)
                raw = self.path.read_bytes()
            except FileNotFoundError:
                continue  # released (or broken) between our attempt and the look: try again at once
            holder = LockInfo.parse(raw)
            now = time.monotonic()
            if (raw, st.st_mtime_ns) != seen:
                seen, seen_since = (raw, st.st_mtime_ns), now
            reason = self._stale_reason(holder, st.st_mtime, now - seen_since)
            if reason is not None:
                if self._break(raw, st.st_mtime_ns):
                    who = holder.describe() if holder else "an unknown owner"
                    self.log(f"cache: took over the lock of {who} on {self.what}: {reason}")
                continue
            if said_at is None or now - said_at >= self.log_every_s:
                who = holder.describe() if holder else "another job"
                self.log(f"cache: waiting for {who} computing {self.what} "
                         f"({'waited ' + format(now - start, '.0f') + ' s; ' if said_at else ''}lock {self.path})")
                said_at = now
            time.sleep(self.poll_s)
        self.waited_s = time.monotonic() - start
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, name=f"lock-heartbeat {self.path.name}", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.info is not None and self._holds():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.info = None

    def __enter__(self) -> "FileLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    # ------------------------------------------------------------------------------------------ internals

    def _try_create(self) -> bool:
        info = LockInfo.mine()
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, json.dumps(asdict(info)).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        self.info = info
        return True

    def _stale_reason(self, holder: LockInfo | None, mtime: float, unchanged_s: float) -> str | None:
        reason = stale_reason(holder, mtime, self.stale_after_s)
        if reason is None and unchanged_s > self.stale_after_s:
            reason = f"its heartbeat has not moved for {unchanged_s:.0f} s (limit {self.stale_after_s:g} s)"
        return reason

    def _break(self, raw: bytes, mtime_ns: int) -> bool:
        if break_lock(self.path, raw, mtime_ns, self.stale_after_s):
            return True
        time.sleep(self.poll_s)
        return False

    def _holds(self) -> bool:
        try:
            current = LockInfo.parse(self.path.read_bytes())
        except FileNotFoundError:
            return False
        return current is not None and self.info is not None and current.token == self.info.token

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            if not self._holds():
                if not self.lost:
                    self.lost = True
                    self.log(f"cache: warning: the lock on {self.what} was taken over by another job "
                             f"(this job's heartbeat was late); both may compute it, the entry stays whole")
                continue
            with contextlib.suppress(OSError):
                os.utime(self.path)


__all__ = ["FileLock", "LockInfo", "stale_reason", "break_lock", "remove_if_stale", "HOST", "HOST_ID", "pid_alive",
           "owner_suffix", "parse_owner", "owner_is_gone", "remove_orphans"]
