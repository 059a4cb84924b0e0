import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from pipeline.locks import HOST_ID
from pipeline.runner import RESULT_LIBRARIES, Runner, StageCache, code_identity
from stages.base import Declaration, StageResult


def Stage(name, fn, config, deps=()):
    """A stage declared on the spot: fn(inputs, progress) fitted with `config` (its whole value keyed)."""
    return Declaration(name, type(config), lambda ctx, inputs, cfg, progress: fn(inputs, progress),
                       inputs=lambda cfg: list(deps))(config)


@dataclass
class Knob:
    scale: float = 1.0


def _graph(calls: list[str], a: Knob, b: Knob):
    def stage_a(inputs, progress):
        calls.append("a")
        return StageResult({"x": torch.arange(4.0) * a.scale}, {"n": 4})

    def stage_b(inputs, progress):
        calls.append("b")
        return StageResult({"y": inputs["a"].tensors["x"] + b.scale}, {})

    def stage_c(inputs, progress):
        calls.append("c")
        return StageResult({"z": inputs["a"].tensors["x"] * 2}, {})

    return [Stage("a", stage_a, a), Stage("b", stage_b, b, deps=["a"]), Stage("c", stage_c, Knob(), deps=["a"])]


def test_second_run_reuses_cache_and_says_so(tmp_path):
    calls, logs = [], []
    r1 = Runner(tmp_path, "model", "data", log=logs.append, show_progress=False).run(_graph(calls, Knob(), Knob()))
    assert calls == ["a", "b", "c"]
    runner = Runner(tmp_path, "model", "data", log=logs.append, show_progress=False)
    r2 = runner.run(_graph(calls, Knob(), Knob()))
    assert calls == ["a", "b", "c"]
    assert [r.status for r in runner.records] == ["cached"] * 3
    assert any("reused cache entry" in line for line in logs)
    assert torch.equal(r1["b"].tensors["y"], r2["b"].tensors["y"]) and r2["a"].meta == {"n": 4}


def test_changing_one_knob_reruns_it_and_its_dependents_only(tmp_path):
    calls = []
    Runner(tmp_path, "m", "d", log=lambda s: None, show_progress=False).run(_graph(calls, Knob(), Knob()))
    calls.clear()
    Runner(tmp_path, "m", "d", log=lambda s: None, show_progress=False).run(_graph(calls, Knob(), Knob(2.0)))
    assert calls == ["b"]
    calls.clear()
    Runner(tmp_path, "m", "d", log=lambda s: None, show_progress=False).run(_graph(calls, Knob(3.0), Knob(2.0)))
    assert calls == ["a", "b", "c"]


def test_model_or_data_identity_is_part_of_the_key(tmp_path):
    calls = []
    Runner(tmp_path, "m1", "d", log=lambda s: None, show_progress=False).run(_graph(calls, Knob(), Knob()))
    Runner(tmp_path, "m2", "d", log=lambda s: None, show_progress=False).run(_graph(calls, Knob(), Knob()))
    Runner(tmp_path, "m2", "d2", log=lambda s: None, show_progress=False).run(_graph(calls, Knob(), Knob()))
    assert calls == ["a", "b", "c"] * 3


def test_crash_leftovers_are_never_read(tmp_path):
    calls = []
    runner = Runner(tmp_path, "m", "d", log=lambda s: None, show_progress=False)
    runner.run(_graph(calls, Knob(), Knob()))
    key_a = runner.keys["a"]
    # a run killed while writing leaves a temporary folder named after its pid: the process is gone, so the
    # folder is removed, never read
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = tmp_path / "a" / f".tmp-{key_a}-deadbeef-{dead.pid}@{HOST_ID}"
    leftover.mkdir()
    (leftover / "meta.json").write_text("{")
    # a damaged entry (tensor file truncated) is detected by its checksum, said so, and recomputed
    tensors = tmp_path / "b" / runner.keys["b"] / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:20])
    calls.clear()
    logs = []
    out = Runner(tmp_path, "m", "d", log=logs.append, show_progress=False).run(_graph(calls, Knob(), Knob()))
    assert calls == ["b"] and not leftover.exists()
    assert torch.equal(out["b"].tensors["y"], torch.arange(4.0) + 1.0)
    assert any("removed 1 unfinished cache entry" in line for line in logs), logs
    assert any(f"cache: entry b {runner.keys['b'][:12]} is damaged" in line for line in logs), logs


def test_code_identity_covers_sources_and_library_versions(monkeypatch):
    import importlib.metadata

    import pipeline.runner as runner_mod

    assert {"torch", "transformers", "safetensors"} <= set(RESULT_LIBRARIES)
    before = code_identity()
    real = importlib.metadata.version
    monkeypatch.setattr(runner_mod.importlib.metadata, "version",
                        lambda name: "0.0-upgraded" if name == "torch" else real(name))
    assert code_identity() != before  # a torch upgrade invalidates every entry
    monkeypatch.undo()
    assert code_identity() == before


def test_code_identity_covers_the_thread_count():
    """torch's float32 reductions split by thread count: a figure computed at another count is another result."""
    import torch

    n = torch.get_num_threads()
    before = code_identity()
    try:
        torch.set_num_threads(n + 1)
        assert code_identity() != before
    finally:
        torch.set_num_threads(n)
    assert code_identity() == before


def test_a_stage_and_its_store_are_run_under_the_entry_lock(tmp_path):
    seen = []

    def fn(inputs, progress):
        seen.append(sorted(p.name for p in (tmp_path / "a").glob(".lock-*")))
        return StageResult({"x": torch.zeros(1)}, {})

    runner = Runner(tmp_path, "m", "d", log=lambda s: None, show_progress=False)
    runner.run([Stage("a", fn, {})])
    assert seen == [[f".lock-{runner.keys['a']}"]]  # held while computing
    assert not list((tmp_path / "a").glob(".lock-*"))  # released after the store


def test_store_is_atomic_when_the_write_fails(tmp_path, monkeypatch):
    cache = StageCache(tmp_path)
    import pipeline.runner as runner_mod

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(runner_mod, "write_synced", boom)  # the durable write of the entry's files
    with pytest.raises(OSError, match="disk full"):
        cache.store("a", "k1", StageResult({"x": torch.zeros(2)}, {}))
    assert cache.load("a", "k1") is None
    assert not any((tmp_path / "a").iterdir())
