"""Several jobs sharing one stage cache: per-entry locks (pipeline/locks.py), temporaries owned by host + pid.

Unit tests drive the lock and the cache directly, with other processes standing for other jobs; the last test
runs two real tiny pipelines at once on one cache_dir, as a joblib sweep or two SLURM jobs would.
"""
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from pipeline.locks import HOST, HOST_ID, FileLock, LockInfo
from pipeline.runner import Runner, StageCache, cache_key, code_identity
from stages.base import Declaration, StageResult

ROOT = Path(__file__).resolve().parents[2]
FAST = {"heartbeat_s": 0.1, "stale_after_s": 1.0, "poll_s": 0.05}


def Stage(name, fn, config, deps=()):
    """A stage declared on the spot: fn(inputs, progress) fitted with `config` (its whole value keyed)."""
    return Declaration(name, type(config), lambda ctx, inputs, cfg, progress: fn(inputs, progress),
                       inputs=lambda cfg: list(deps))(config)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "KVCALIB_"))}
    return {**env, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def _dead_pid() -> int:
    """The pid of a process of this host that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _lock_file(path: Path, pid: int, host_id: str = HOST_ID, started: float | None = None) -> bytes:
    raw = json.dumps({"host": HOST if host_id == HOST_ID else "elsewhere", "host_id": host_id, "pid": pid,
                      "started": started, "acquired": time.time(), "token": "t" * 32}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)
    return raw


def test_lock_of_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path):
    path = tmp_path / ".lock-k"
    pid = _dead_pid()
    _lock_file(path, pid)
    logs = []
    start = time.monotonic()
    with FileLock(path, "entry k", log=logs.append, heartbeat_s=10, stale_after_s=300, poll_s=0.05) as lock:
        assert LockInfo.parse(path.read_bytes()).pid == os.getpid()
        assert lock.waited_s < 5  # no heartbeat timeout: the owner is known to be gone
    assert time.monotonic() - start < 5 and not path.exists()
    assert any(f"took over the lock of pid {pid}" in line and "is gone" in line for line in logs), logs


def test_lock_of_another_host_is_taken_over_when_its_heartbeat_stops(tmp_path):
    """Judged by what this waiter sees, not by clocks: the other host's clock runs an hour ahead here."""
    path = tmp_path / ".lock-k"
    _lock_file(path, 1, host_id="elsewhere~00000000")  # pid 1 there says nothing here
    ahead = time.time() + 3600
    os.utime(path, (ahead, ahead))
    logs = []
    start = time.monotonic()
    with FileLock(path, "entry k", log=logs.append, **FAST):
        pass
    assert 0.9 < time.monotonic() - start < 10, "waited for the heartbeat timeout, not longer"
    assert any("waiting for pid 1 on elsewhere" in line for line in logs), logs
    assert any("heartbeat has not moved" in line for line in logs), logs


def test_lock_with_an_old_heartbeat_is_taken_over_without_waiting_it_out(tmp_path):
    path = tmp_path / ".lock-k"
    _lock_file(path, 1, host_id="elsewhere~00000000")
    old = time.time() - 3600
    os.utime(path, (old, old))
    logs = []
    with FileLock(path, "entry k", log=logs.append, heartbeat_s=10, stale_after_s=300, poll_s=0.05) as lock:
        assert lock.waited_s < 5
    assert any("heartbeat is 3600 s old" in line for line in logs), logs


def test_lock_of_another_host_with_a_live_heartbeat_is_waited_on(tmp_path):
    path = tmp_path / ".lock-k"
    _lock_file(path, 1, host_id="elsewhere~00000000")
    stop = threading.Event()

    def beat():  # the other host's heartbeat thread, then its release after 2.5 s
        t0 = time.monotonic()
        while not stop.wait(0.1) and time.monotonic() - t0 < 2.5:
            os.utime(path)
        path.unlink()

    thread = threading.Thread(target=beat)
    thread.start()
    logs = []
    try:
        with FileLock(path, "entry k", log=logs.append, **FAST) as lock:
            assert lock.waited_s > 2.0  # 2.5 x the stale limit: a moving heartbeat is never stale
    finally:
        stop.set()
        thread.join()
    assert not any("took over" in line for line in logs), logs


_HOLDER = textwrap.dedent("""
    import sys, time, torch
    from pipeline.runner import StageCache
    from stages.base import StageResult
    root, key = sys.argv[1], sys.argv[2]
    cache = StageCache(root, heartbeat_s=0.2, stale_after_s=5.0, poll_s=0.05)
    with cache.lock("a", key):
        print("locked", flush=True)
        time.sleep(2.0)
        cache.store("a", key, StageResult({"x": torch.full((4,), 7.0)}, {"by": "holder"}))
    """)


def test_a_job_waits_for_a_live_holder_then_loads_its_entry(tmp_path):
    """Another process (a live pid on this host) holds the entry's lock and computes it: the runner waits,
    says so, and loads the holder's entry instead of computing it."""
    calls = []

    def fn(inputs, progress):
        calls.append("a")
        return StageResult({"x": torch.zeros(4)}, {"by": "waiter"})

    stage = Stage("a", fn, {"k": 1})
    key = cache_key(stage, [], "m", "d", code_identity())
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path), key], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env())
    try:
        assert holder.stdout.readline().strip() == "locked", holder.stderr.read()
        logs = []
        runner = Runner(tmp_path, "m", "d", log=logs.append, show_progress=False, **FAST)
        out = runner.run([stage])
    finally:
        holder.wait(timeout=60)
    assert holder.returncode == 0, holder.stderr.read()
    assert calls == [] and out["a"].meta == {"by": "holder"}
    assert torch.equal(out["a"].tensors["x"], torch.full((4,), 7.0))
    (record,) = runner.records
    assert record.status == "cached" and record.waited_s > 0.5
    assert any(f"waiting for pid {holder.pid} on {HOST}" in line for line in logs), logs
    assert not list(tmp_path.glob("a/.lock-*"))


def test_a_live_jobs_temporaries_are_kept_and_dead_ones_removed(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folder = tmp_path / "a"
        folder.mkdir()
        names = {"live": f".tmp-{'0' * 32}-aaaaaaaa-{live.pid}@{HOST_ID}",
                 "dead": f".tmp-{'1' * 32}-bbbbbbbb-{_dead_pid()}@{HOST_ID}",
                 "mine": f".tmp-{'2' * 32}-cccccccc-{os.getpid()}@{HOST_ID}",
                 "foreign_young": f".tmp-{'3' * 32}-dddddddd-{live.pid}@elsewhere~00000000",
                 "foreign_old": f".tmp-{'4' * 32}-eeeeeeee-12345@elsewhere~00000000",
                 "unowned_young": f".tmp-{'5' * 32}-ffffffff",
                 "unowned_old": f".tmp-{'6' * 32}-99999999"}
        for name in names.values():
            (folder / name).mkdir()
            (folder / name / "tensors.safetensors").write_bytes(b"partial")
        old = time.time() - 7 * 3600
        for which in ("foreign_old", "unowned_old"):
            os.utime(folder / names[which], (old, old))
        locks = {"live": _lock_file(folder / ".lock-live", live.pid),
                 "dead": _lock_file(folder / ".lock-dead", _dead_pid()),
                 "foreign": _lock_file(folder / ".lock-foreign", 1, host_id="elsewhere~00000000")}
        removed = StageCache(tmp_path, log=lambda s: None).clean_temporaries()
        kept = {which for which, name in names.items() if (folder / name).exists()}
        assert kept == {"live", "mine", "foreign_young", "unowned_young"}
        # a lock left by a process killed after its store (nobody waits on it to break it) goes too
        assert {which for which in locks if (folder / f".lock-{which}").exists()} == {"live", "foreign"}
        assert removed == 3 + 1
    finally:
        live.kill()
        live.wait()


def test_store_keeps_a_whole_entry_already_there_and_replaces_a_damaged_one(tmp_path):
    logs = []
    cache = StageCache(tmp_path, log=logs.append)
    cache.store("a", "k", StageResult({"x": torch.ones(2)}, {"first": True}))
    cache.store("a", "k", StageResult({"x": torch.ones(2)}, {"first": False}))  # another job's equal result
    assert cache.load("a", "k").meta == {"first": True}
    tensors = tmp_path / "a" / "k" / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:10])
    assert cache.load("a", "k") is None
    assert any("cache: entry a k is damaged" in line and "sha256" in line for line in logs), logs
    cache.store("a", "k", StageResult({"x": torch.ones(2)}, {"first": False}))
    assert cache.load("a", "k").meta == {"first": False}
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["k"]  # no temporary or moved-aside folder left


# ------------------------------------------------------------------------------------------------ end to end

TINY = ["model=tiny", "quant=kvquant-4b-1pct", "data.n_samples=2", "data.seq_len=32", "data.eval_n_samples=1", "data.eval_seq_len=32",
        "traces.reservoir_size=16", "probes.lengths=[64]", "sensitivity.variants=[kv]", "eval.recipes=[fp16]",
        "check.enabled=false", "tracking.enabled=false"]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_two_pipelines_sharing_one_cache_compute_each_entry_once(tmp_path):
    """Two `python -m pipeline run` processes started together on one cache_dir: both succeed, every cache
    entry is computed by exactly one of them (the other waits and loads it, or finds it), and the artifacts are
    bit-identical."""
    cache = tmp_path / "shared-cache"
    procs, t0 = {}, time.monotonic()
    for name in ("job1", "job2"):
        cwd = tmp_path / name
        cwd.mkdir()
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "run", *TINY, f"cache_dir={cache}", f"hydra.run.dir={cwd / 'run'}"],
            cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = {name: p.communicate(timeout=900) for name, p in procs.items()}
    wall = time.monotonic() - t0
    for name, p in procs.items():
        assert p.returncode == 0, outs[name][1][-3000:]
    summaries = {name: json.loads((tmp_path / name / "run" / "summary.json").read_text()) for name in procs}
    statuses = {name: {(s["name"], s["key"]): s["status"] for s in summary["stages"]}
                for name, summary in summaries.items()}
    assert statuses["job1"].keys() == statuses["job2"].keys()
    lines = []
    for entry in statuses["job1"]:
        pair = sorted(statuses[name][entry] for name in procs)
        lines.append(f"  {entry[0]:<26} job1 {statuses['job1'][entry]:<9} job2 {statuses['job2'][entry]}")
        assert pair == ["cached", "computed"], (entry, pair)
    waited = [line for name in procs for line in outs[name][0].splitlines() if "cache: waiting for" in line]
    print(f"\ntwo pipelines on one cache ({wall:.0f} s wall); waits on another job's lock: {len(waited)}\n"
          + "\n".join(lines))
    digests = {_sha256(tmp_path / name / "run" / "artifact" / "tensors.safetensors") for name in procs}
    assert len(digests) == 1
    assert not list(cache.glob("*/.lock-*")) and not list(cache.glob("*/.tmp-*"))
    for entry in cache.glob("*/*"):
        assert StageCache(cache).whole(entry.parent.name, entry.name), entry
