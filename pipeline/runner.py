"""The stage graph runner: content-hash cache, atomic cache writes, per-entry locks, progress, wall time, peak RSS.

Stages are declared in their modules (stages.base.Declaration); a graph is a list of declared stages bound to
their configs. A stage's cache key hashes its declared name and version, its WHOLE config (stages.base.key_view;
a field is left out only by its dataclass's KEY_EXCLUDED declaration), its inputs' keys, the model identity, the
data identity and the code identity (`code_identity`: sources and library versions); fit receives exactly the
config the key was computed from. Entries are
`<cache_dir>/<stage>/<key>/{tensors.safetensors, meta.json}`, written into a temporary folder
(`.tmp-<key>-<random>-<pid>@<host id>`, files fsynced) and renamed, so a run killed midway never leaves an entry
that looks whole; an entry whose tensor checksum does not match is logged as damaged and recomputed.

Several jobs may share one cache_dir at once (a joblib sweep, SLURM jobs on NFS): an entry is computed under
its lock `<cache_dir>/<stage>/.lock-<key>` (pipeline/locks.py), so a second job asking for it waits (and says
so), then loads what the first stored instead of computing it again. A job removes only temporaries of a dead
process on this host, or older than `FOREIGN_TMP_AGE_S` (another host's), never a live job's write in progress
(its own failed writes it removes itself).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil
import torch
from safetensors.torch import load_file, save
from tqdm import tqdm

from exporters.checksums import sha256_file, sha256_json
from exporters.files import atomic_write_json, fsync_dir, write_synced
from pipeline import faults
from pipeline.locks import FileLock, owner_suffix, remove_if_stale, remove_orphans
from stages.base import Bound, Context, StageResult, key_view

@dataclass
class StageRecord:
    name: str
    key: str
    status: str                        # "computed" | "cached"
    wall_s: float
    peak_rss_mb: float
    config_sha256: str = ""
    waited_s: float = 0.0              # time spent waiting for another job computing the same entry
    others_cpu: float = 0.0            # share of the machine's CPUs other processes took meanwhile (Usage)


# a run whose blocks shared the machine beyond this (other processes' CPU seconds / (wall x CPUs)) ran on a busy
# machine: its timings say little about this machine's speed; a step this many times slower than its record for the
# same inputs (and BUSY_MIN_EXTRA_S longer) says the same from the other side
BUSY_SHARE = 0.25
BUSY_SLOWER = 2.0
BUSY_MIN_EXTRA_S = 5.0
SHARE_MIN_WALL_S = 0.5   # a block shorter than this prints no share: a few scheduler ticks are not a figure


def _busy_cpu_s(t) -> float:
    """Busy CPU seconds of a psutil.cpu_times() (system-wide: everything but idle and iowait)."""
    return sum(v for k, v in t._asdict().items() if k not in ("idle", "iowait", "guest", "guest_nice"))


def _own_cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


class Usage:
    """What a block of the run cost and with whom it shared the machine: wall seconds, the peak resident set size of
    this process (sampled every 20 ms), and the share of the machine's CPUs other processes took meanwhile
    (system-wide busy CPU seconds minus this process's own, over wall x CPUs). A figure timed while others took half
    the CPUs is not this machine's speed; the run says so (Runner.busy_note)."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._proc = psutil.Process()
        self.wall_s = self.others_cpu = 0.0

    def __enter__(self):
        self.peak = self._proc.memory_info().rss
        self._t0, self._sys0, self._own0 = time.perf_counter(), _busy_cpu_s(psutil.cpu_times()), _own_cpu_s(self._proc)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
        self.wall_s = time.perf_counter() - self._t0
        others = (_busy_cpu_s(psutil.cpu_times()) - self._sys0) - (_own_cpu_s(self._proc) - self._own0)
        cpus = psutil.cpu_count() or 1
        self.others_cpu = min(1.0, max(0.0, others / (self.wall_s * cpus))) if self.wall_s > 0 else 0.0


# libraries whose upgrade can change a stage's numbers: kernels (torch), model code and GGUF dequantization
# (transformers, gguf), tokenization (tokenizers), k-means and reductions (scikit-learn, numpy), the tensor file
# format (safetensors)
RESULT_LIBRARIES = ("torch", "transformers", "safetensors", "tokenizers", "gguf", "numpy", "scikit-learn")


def code_identity() -> str:
    """sha256 over everything besides config, inputs, model and data that computes stage results: the sources of
    the stages, of the format they call (exporters/), of the wiring that chooses their inputs (pipeline/app.py,
    pipeline/analysis.py) and of model loading (pipeline/model.py: dtype, the tiny model's construction), and the
    installed versions of RESULT_LIBRARIES. An edit or an upgrade invalidates every entry, so a cache hit never
    returns what other code computed. (The calibration and evaluation windows are covered by the data identity,
    pipeline/data.py's token ids; the weights, dtype and device by the model identity, pipeline/app.py.)"""
    root = Path(__file__).resolve().parent.parent
    files = sorted(p for pkg in ("stages", "exporters") for p in (root / pkg).rglob("*.py"))
    files += [root / "pipeline" / name for name in ("app.py", "analysis.py", "model.py")]
    versions = {}
    for lib in RESULT_LIBRARIES:
        try:
            versions[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            versions[lib] = None
    # torch's intra-op thread count changes how its float32 reductions are split, so a figure's last bits (a KL
    # measured at 1 and 2 threads: 9.353874702e-06 vs 9.353876976e-06): an entry computed at another count is
    # another result -- and stages.evaluate.combine refuses parts whose references differ beyond 1e-9
    return sha256_json({"sources": {str(p.relative_to(root)): sha256_file(p) for p in files},
                        "libraries": versions, "torch_threads": torch.get_num_threads()})


def cache_key(stage: Bound, dep_keys: list[str], model_id: str, data_id: str, code_id: str = "") -> str:
    """The entry's key: the stage's declared name and version, its instance name, the whole config it is fitted
    with (stages.base.key_view: every field but the ones its dataclass declares in KEY_EXCLUDED), its inputs'
    keys, the model, data and code identities."""
    return sha256_json({"stage": stage.declaration.name, "name": stage.name, "version": stage.declaration.version,
                        "config": key_view(stage.config), "deps": dep_keys, "model": model_id, "data": data_id,
                        "code": code_id})[:32]


FOREIGN_TMP_AGE_S = 6 * 3600  # another host's temporary folder older than this is a crash's leftover


class StageCache:
    """`<root>/<stage>/<key>/` entries; see the module docstring. `log` hears about damaged entries and locks."""

    def __init__(self, root: Path, log: Callable[[str], None] = print, heartbeat_s: float = 10.0,
                 stale_after_s: float = 120.0, poll_s: float = 0.5):
        self.root = Path(root)
        self.log = log
        self._reported: set[tuple[str, str]] = set()
        self.lock_options = {"heartbeat_s": heartbeat_s, "stale_after_s": stale_after_s, "poll_s": poll_s}

    def _dir(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def lock(self, stage: str, key: str) -> FileLock:
        """The entry's lock (a context manager that blocks until held)."""
        folder = self.root / stage
        folder.mkdir(parents=True, exist_ok=True)
        return FileLock(folder / f".lock-{key}", f"cache entry {stage} {key[:12]}", log=self.log, **self.lock_options)

    def load(self, stage: str, key: str) -> StageResult | None:
        """The entry, or None when there is none; a damaged one (checksum, unreadable) is logged and skipped."""
        d = self._dir(stage, key)
        meta_path, tensor_path = d / "meta.json", d / "tensors.safetensors"
        if not d.exists():
            return None
        why = self._damage(d)
        if why is None:
            try:
                record = json.loads(meta_path.read_text())
                return StageResult(tensors=load_file(str(tensor_path)), meta=record["meta"])
            except (OSError, ValueError, KeyError) as exc:
                why = f"unreadable: {type(exc).__name__}: {exc}"
        if why == "missing":  # removed between the look and the read (replaced by another job)
            return None
        if (stage, key) not in self._reported:
            self._reported.add((stage, key))
            self.log(f"cache: entry {stage} {key[:12]} is damaged ({why}); it is recomputed")
        return None

    @staticmethod
    def _damage(d: Path) -> str | None:
        """None when the entry at `d` is whole, else what is wrong with it."""
        meta_path, tensor_path = d / "meta.json", d / "tensors.safetensors"
        if not d.exists():
            return "missing"
        if not meta_path.is_file() or not tensor_path.is_file():
            return f"files missing: has {sorted(p.name for p in d.iterdir())}"
        try:
            record = json.loads(meta_path.read_text())
            expected = record["tensors_sha256"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"meta.json unreadable: {type(exc).__name__}"
        if expected != sha256_file(tensor_path):
            return "tensors.safetensors does not match its sha256 in meta.json"
        return None

    def whole(self, stage: str, key: str) -> bool:
        return self._damage(self._dir(stage, key)) is None

    def store(self, stage: str, key: str, result: StageResult) -> None:
        final = self._dir(stage, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{key}-{uuid.uuid4().hex[:8]}-{owner_suffix()}"
        trash = final.parent / f".tmp-{key}-{uuid.uuid4().hex[:8]}-{owner_suffix()}"
        tmp.mkdir()
        try:
            tensors = {k: v.detach().contiguous().cpu() for k, v in result.tensors.items()}
            raw = save(tensors)
            write_synced(tmp / "tensors.safetensors", raw)  # both files on disk before the rename shows them
            faults.point(f"cache.{stage}.saved")
            record = {"stage": stage, "key": key, "meta": result.meta, "tensors_sha256": hashlib.sha256(raw).hexdigest()}
            write_synced(tmp / "meta.json", json.dumps(record, indent=1, default=str).encode())
            faults.point(f"cache.{stage}.before_rename")
            if final.exists() and self._damage(final) not in (None, "missing"):
                # a damaged entry under the same key: moved aside (one rename), then replaced
                try:
                    os.rename(final, trash)
                except FileNotFoundError:
                    pass
            try:
                os.rename(tmp, final)
            except OSError:  # a whole entry is there already (another job's, without our lock): keep it
                if self._damage(final) is not None:
                    raise
            fsync_dir(final.parent)
            faults.point(f"cache.{stage}.stored")
        finally:
            for leftover in (tmp, trash):
                if leftover.exists():
                    shutil.rmtree(leftover, ignore_errors=True)

    TIMINGS_FILE = ".timings.json"   # beside the <stage>/<key> entries, never read as one (a file, not a folder)
    TIMINGS_KEPT = 1000               # the most recent records kept: a hint, not a history

    def _timings(self) -> dict:
        try:
            records = json.loads((self.root / self.TIMINGS_FILE).read_text())
            return records if isinstance(records, dict) else {}
        except (OSError, ValueError):
            return {}

    @staticmethod
    def _timing_key(step: str, inputs: str) -> str:
        return sha256_json({"step": step, "inputs": inputs})[:32]

    def timing(self, step: str, inputs: str) -> dict | None:
        """The wall time recorded for `step` on the same inputs by an earlier run (Runner.step), or None (none, or
        a record that does not read as one: it is only a hint)."""
        record = self._timings().get(self._timing_key(step, inputs))
        if isinstance(record, dict) and isinstance(record.get("wall_s"), (int, float)) and record["wall_s"] > 0:
            return record
        return None

    def store_timing(self, step: str, inputs: str, wall_s: float, others_cpu: float) -> None:
        """Record a step's wall time for its inputs when the machine was quiet (other processes under BUSY_SHARE):
        the fastest such time is kept, so a busy run never becomes the reference. One JSON file replaced whole
        (two jobs writing at once may lose one record: a hint, never a result)."""
        if others_cpu >= BUSY_SHARE:
            return
        before = self.timing(step, inputs)
        if before is not None and before["wall_s"] <= wall_s:
            return
        records = self._timings()
        records.pop(self._timing_key(step, inputs), None)
        records[self._timing_key(step, inputs)] = {"step": step, "wall_s": round(wall_s, 3),
                                                    "date": time.strftime("%Y-%m-%d %H:%M"),
                                                    "cpus": psutil.cpu_count()}
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.root / self.TIMINGS_FILE, dict(list(records.items())[-self.TIMINGS_KEPT:]))

    def clean_temporaries(self) -> int:
        """Remove what interrupted writes left: temporary folders of a dead process on this host or older than
        FOREIGN_TMP_AGE_S (another host's, or named before owners were recorded), and stale lock files (a
        process killed between storing an entry and releasing its lock); never a live job's write or lock,
        this process's included. -> how many were removed."""
        if not self.root.exists():
            return 0
        removed = remove_orphans(self.root.glob("*/.tmp-*"), FOREIGN_TMP_AGE_S)
        for p in self.root.glob("*/.lock-*"):
            if not p.name.endswith(".break") and remove_if_stale(p, self.lock_options["stale_after_s"]):
                removed += 1
        return removed


class Runner:
    def __init__(self, cache_dir: str | Path, model_id: str, data_id: str, log: Callable[[str], None] = print,
                 show_progress: bool = True, **lock_options):
        self.cache = StageCache(Path(cache_dir), log=log, **lock_options)
        self.model_id, self.data_id = model_id, data_id
        self.log, self.show_progress = log, show_progress
        self.records: list[StageRecord] = []
        self.steps: list[StageRecord] = []         # timed parts that are not cached stages (Runner.step)
        self._step_after: list[int] = []           # each step's place: the number of stages run before it
        self.slower: list[tuple[str, float, dict]] = []  # (step, wall now, its record for the same inputs)
        self.keys: dict[str, str] = {}
        self.code_id = code_identity()

    def keys_of(self, stages: list[Bound]) -> dict[str, str]:
        """Every stage's cache key, computed as run() computes it, without running anything."""
        keys: dict[str, str] = {}
        for stage in stages:
            missing = [d for d in stage.deps if d not in keys]
            if missing:
                raise ValueError(f"stage {stage.name!r} depends on {missing}, which are not before it in "
                                 f"{[s.name for s in stages]}")
            keys[stage.name] = cache_key(stage, [keys[d] for d in stage.deps], self.model_id, self.data_id,
                                         self.code_id)
        return keys

    def run(self, stages: list[Bound], ctx: Context | None = None) -> dict[str, StageResult]:
        """Run the declared stages in order (a stage's inputs before it), each fitted with ctx, its inputs and
        the config its key was computed from."""
        removed = self.cache.clean_temporaries()
        if removed:
            self.log(f"removed {removed} unfinished cache entr{'y' if removed == 1 else 'ies'} or stale lock"
                     f"{'' if removed == 1 else 's'} from an interrupted run")
        keys = self.keys_of(stages)
        results: dict[str, StageResult] = {}
        for stage in stages:
            key = self.keys[stage.name] = keys[stage.name]
            waited = 0.0
            with Usage() as rss:
                inputs = {d: results[d] for d in stage.deps}
                result, status = self.cache.load(stage.name, key), "cached"
                if result is None:
                    with self.cache.lock(stage.name, key) as lock:  # another job may be computing it
                        waited = lock.waited_s
                        result = self.cache.load(stage.name, key)  # stored while we looked or waited?
                        if result is None:
                            result, status = self._compute(stage, ctx, inputs), "computed"
                            self.cache.store(stage.name, key, result)
            wall = rss.wall_s
            self.records.append(StageRecord(stage.name, key, status, wall, rss.peak / 2**20,
                                            sha256_json(key_view(stage.config)), waited, rss.others_cpu))
            by = ""
            if status == "cached" and waited:
                by = f", computed by another job while this one waited {waited:.1f} s"
            self.log(f"stage {stage.name}: {'reused cache entry' if status == 'cached' else 'computed'} "
                     f"{key[:12]} ({wall:.1f} s{by})")
            results[stage.name] = result
        return results

    def _compute(self, stage: Bound, ctx: Context | None, inputs: dict[str, StageResult]) -> StageResult:
        point = f"stage.{stage.name}.progress"
        decl = stage.declaration
        with tqdm(total=decl.units(ctx, stage.config), desc=stage.name, disable=not self.show_progress,
                  leave=False) as bar:
            def progress(n: int = 1) -> None:
                bar.update(n)
                faults.point(point)

            return decl.fit(ctx, inputs, stage.config, progress)

    @contextmanager
    def step(self, name: str, inputs: str | None = None):
        """Time a part of the run that is not a cached stage (the model's load, the export, the runtime check, the
        canary): listed in the stage table with status "ran". inputs: a digest of everything the step's time
        depends on; its wall time is recorded under it in the cache folder (StageCache.TIMINGS_FILE), and a later
        step of the same inputs that takes far longer is named in busy_note."""
        with Usage() as use:
            yield
        self.add_step(name, use, inputs)

    def add_step(self, name: str, use: Usage, inputs: str | None = None) -> None:
        """Record a step measured by `use` (a block timed before the runner existed: the model's load)."""
        self.steps.append(StageRecord(name, inputs or "", "ran", use.wall_s, use.peak / 2**20, "", 0.0,
                                      use.others_cpu))
        self._step_after.append(len(self.records))  # listed where it ran: after the stages run before it
        if inputs:
            before = self.cache.timing(name, inputs)
            if before is not None:
                self.slower.append((name, use.wall_s, before))
            self.cache.store_timing(name, inputs, use.wall_s, use.others_cpu)

    def table(self) -> str:
        """The stages and steps of the run: status, wall seconds, peak RSS and other processes' share of the CPUs."""
        rows = self._in_order()
        width = max([28, *(len(r.name) for r in rows)])  # evaluate-recipe-<name> can be long
        lines = [f"{'stage':<{width}} {'status':<9} {'wall_s':>8} {'peak_rss_mb':>12} {'others_cpu':>10}",
                 "-" * (width + 43)]
        for r in rows:  # a share over less than SHARE_MIN_WALL_S is noise, not a figure
            share = f"{r.others_cpu:.0%}" if r.wall_s >= SHARE_MIN_WALL_S else "-"
            lines.append(f"{r.name:<{width}} {r.status:<9} {r.wall_s:>8.1f} {r.peak_rss_mb:>12.0f} {share:>10}")
        return "\n".join(lines)

    def _in_order(self) -> list[StageRecord]:
        """Stages and steps in the order they ran (a step after the stages run before it)."""
        rows, steps = [], list(zip(self.steps, self._step_after))
        for i, record in enumerate(self.records + [None]):
            rows += [step for step, after in steps if after == i]
            if record is not None:
                rows.append(record)
        return rows

    def busy_note(self) -> str | None:
        """busy_line over this run's stages and steps and its steps' records (the line, or None)."""
        return busy_line([(r.wall_s, r.others_cpu) for r in self.records + self.steps], self.slower)


def busy_line(blocks: list[tuple[float, float]], slower: list[tuple[str, float, dict]] = ()) -> str | None:
    """A line when timings are not the machine's: other processes took more than BUSY_SHARE of the CPUs over the
    timed blocks ((wall_s, others_cpu) each, weighted by wall time), or a step took BUSY_SLOWER x its recorded
    time for the same inputs ((step, wall now, its record): Runner.slower). None when neither."""
    wall = sum(w for w, _ in blocks)
    share = sum(w * o for w, o in blocks) / wall if wall > 0 else 0.0
    slow = [(n, now, before) for n, now, before in slower
            if now >= BUSY_SLOWER * before["wall_s"] and now - before["wall_s"] >= BUSY_MIN_EXTRA_S]
    if share < BUSY_SHARE and not slow:
        return None
    cpus = psutil.cpu_count() or 1
    why = [f"other processes took {share:.0%} of the {cpus} CPUs meanwhile"] if share >= BUSY_SHARE else []
    why += [f"{n} took {now:.1f} s, {now / before['wall_s']:.1f}x its {before['wall_s']:.1f} s on "
            f"{before['date']} for the same inputs" for n, now, before in slow]
    return ("the machine was busy: " + "; ".join(why) + " -- these times are not this machine's speed "
            "(`top` shows who else runs)")


def peak_rss_mb() -> float:
    """Peak RSS of the whole process so far (ru_maxrss is in KiB on Linux)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


__all__ = ["StageRecord", "StageCache", "Runner", "Usage", "busy_line", "cache_key", "peak_rss_mb", "BUSY_SHARE"]
