"""The stage graph runner: content-hash cache, atomic cache writes, progress, wall time and peak RSS.

A stage's cache key hashes its name and version, its config, its inputs' keys, the model identity and the
data identity. Entries are `<cache_dir>/<stage>/<key>/{tensors.safetensors, meta.json}`, written into a
temporary folder and renamed, so a run killed midway never leaves an entry that looks whole; a leftover
temporary folder is ignored and removed, and an entry whose tensor checksum does not match is recomputed.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, Callable

import psutil
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from exporters.checksums import sha256_file, sha256_json
from stages.base import StageResult

StageFn = Callable[[dict[str, StageResult], Callable[[int], None]], StageResult]


@dataclass
class Stage:
    name: str
    fn: StageFn                        # (inputs by stage name, progress callback) -> StageResult
    config: Any = None                 # a dataclass or JSON-able value: part of the cache key
    deps: list[str] = field(default_factory=list)
    version: int = 1                   # bump when the stage's code changes its output
    units: int = 1                     # progress-bar total
    cache: bool = True


@dataclass
class StageRecord:
    name: str
    key: str
    status: str                        # "computed" | "cached"
    wall_s: float
    peak_rss_mb: float
    config_sha256: str = ""


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


def _jsonable(config: Any) -> Any:
    return asdict(config) if is_dataclass(config) else config


def code_identity() -> str:
    """sha256 over the sources of the code that computes stage results -- the stages, the format they call, and
    the wiring that chooses their inputs (pipeline/app.py, pipeline/analysis.py): an edit invalidates every
    entry, so a cache hit never returns what an older version of the code computed."""
    root = Path(__file__).resolve().parent.parent
    files = sorted(p for pkg in ("stages", "exporters") for p in (root / pkg).rglob("*.py"))
    files += [root / "pipeline" / "app.py", root / "pipeline" / "analysis.py"]
    return sha256_json({str(p.relative_to(root)): sha256_file(p) for p in files})


def cache_key(stage: Stage, dep_keys: list[str], model_id: str, data_id: str, code_id: str = "") -> str:
    return sha256_json({"stage": stage.name, "version": stage.version, "config": _jsonable(stage.config),
                        "deps": dep_keys, "model": model_id, "data": data_id, "code": code_id})[:32]


class StageCache:
    def __init__(self, root: Path):
        self.root = Path(root)

    def _dir(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def load(self, stage: str, key: str) -> StageResult | None:
        d = self._dir(stage, key)
        meta_path, tensor_path = d / "meta.json", d / "tensors.safetensors"
        if not meta_path.is_file() or not tensor_path.is_file():
            return None
        try:
            record = json.loads(meta_path.read_text())
            if record.get("tensors_sha256") != sha256_file(tensor_path):
                return None
            return StageResult(tensors=load_file(str(tensor_path)), meta=record["meta"])
        except (OSError, ValueError, KeyError):
            return None

    def store(self, stage: str, key: str, result: StageResult) -> None:
        final = self._dir(stage, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{key}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            tensors = {k: v.detach().contiguous().cpu() for k, v in result.tensors.items()}
            save_file(tensors, str(tmp / "tensors.safetensors"))
            record = {"stage": stage, "key": key, "meta": result.meta,
                      "tensors_sha256": sha256_file(tmp / "tensors.safetensors")}
            (tmp / "meta.json").write_text(json.dumps(record, indent=1, default=str))
            if final.exists():  # a stale or corrupt entry under the same key: replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def clean_temporaries(self) -> int:
        stale = list(self.root.glob("*/.tmp-*")) if self.root.exists() else []
        for p in stale:
            shutil.rmtree(p, ignore_errors=True)
        return len(stale)


class Runner:
    def __init__(self, cache_dir: str | Path, model_id: str, data_id: str, log: Callable[[str], None] = print,
                 show_progress: bool = True):
        self.cache = StageCache(Path(cache_dir))
        self.model_id, self.data_id = model_id, data_id
        self.log, self.show_progress = log, show_progress
        self.records: list[StageRecord] = []
        self.keys: dict[str, str] = {}
        self.code_id = code_identity()

    def run(self, stages: list[Stage], given: dict[str, StageResult] | None = None) -> dict[str, StageResult]:
        """Run stages in order; `given` are results of an earlier call on this runner that stages may depend on."""
        removed = self.cache.clean_temporaries()
        if removed:
            self.log(f"removed {removed} unfinished cache entr{'y' if removed == 1 else 'ies'} from an interrupted run")
        names = [s.name for s in stages]
        results: dict[str, StageResult] = dict(given or {})
        for stage in stages:
            missing = [d for d in stage.deps if d not in results]
            if missing:
                raise ValueError(f"stage {stage.name!r} depends on {missing}, which are not before it in {names}")
            key = cache_key(stage, [self.keys[d] for d in stage.deps], self.model_id, self.data_id, self.code_id)
            self.keys[stage.name] = key
            start = time.perf_counter()
            with _RssSampler() as rss:
                result = self.cache.load(stage.name, key) if stage.cache else None
                status = "cached" if result is not None else "computed"
                if result is None:
                    result = self._compute(stage, {d: results[d] for d in stage.deps})
                    if stage.cache:
                        self.cache.store(stage.name, key, result)
            wall = time.perf_counter() - start
            self.records.append(StageRecord(stage.name, key, status, wall, rss.peak / 2**20,
                                            sha256_json(_jsonable(stage.config))))
            self.log(f"stage {stage.name}: {'reused cache entry' if status == 'cached' else 'computed'} "
                     f"{key[:12]} ({wall:.1f} s)")
            results[stage.name] = result
        return {name: res for name, res in results.items() if name in names}

    def _compute(self, stage: Stage, inputs: dict[str, StageResult]) -> StageResult:
        with tqdm(total=stage.units, desc=stage.name, disable=not self.show_progress, leave=False) as bar:
            return stage.fn(inputs, bar.update)

    def table(self) -> str:
        lines = [f"{'stage':<28} {'status':<9} {'wall_s':>8} {'peak_rss_mb':>12}", "-" * 60]
        lines += [f"{r.name:<28} {r.status:<9} {r.wall_s:>8.1f} {r.peak_rss_mb:>12.0f}" for r in self.records]
        return "\n".join(lines)


def peak_rss_mb() -> float:
    """Peak RSS of the whole process so far (ru_maxrss is in KiB on Linux)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


__all__ = ["Stage", "StageRecord", "StageCache", "Runner", "cache_key", "peak_rss_mb"]
