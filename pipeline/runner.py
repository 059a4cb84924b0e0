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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil
import torch
from safetensors.torch import load_file, save
from tqdm import tqdm

from exporters.checksums import sha256_file, sha256_json
from exporters.files import fsync_dir, write_synced
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


class _RssSampler:
    """Peak resident set size of this process while the block runs (sampled every 20 ms)."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._proc = psutil.Process()

    def __enter__(self):
        self.peak = self._proc.memory_info().rss
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
            start = time.perf_counter()
            waited = 0.0
            with _RssSampler() as rss:
                inputs = {d: results[d] for d in stage.deps}
                result, status = self.cache.load(stage.name, key), "cached"
                if result is None:
                    with self.cache.lock(stage.name, key) as lock:  # another job may be computing it
                        waited = lock.waited_s
                        result = self.cache.load(stage.name, key)  # stored while we looked or waited?
                        if result is None:
                            result, status = self._compute(stage, ctx, inputs), "computed"
                            self.cache.store(stage.name, key, result)
            wall = time.perf_counter() - start
            self.records.append(StageRecord(stage.name, key, status, wall, rss.peak / 2**20,
                                            sha256_json(key_view(stage.config)), waited))
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

    def table(self) -> str:
        width = max([28, *(len(r.name) for r in self.records)])  # evaluate-recipe-<name> can be long
        lines = [f"{'stage':<{width}} {'status':<9} {'wall_s':>8} {'peak_rss_mb':>12}", "-" * (width + 32)]
        lines += [f"{r.name:<{width}} {r.status:<9} {r.wall_s:>8.1f} {r.peak_rss_mb:>12.0f}" for r in self.records]
        return "\n".join(lines)


def peak_rss_mb() -> float:
    """Peak RSS of the whole process so far (ru_maxrss is in KiB on Linux)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


__all__ = ["StageRecord", "StageCache", "Runner", "cache_key", "peak_rss_mb"]
