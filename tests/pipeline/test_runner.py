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


def test_usage_counts_what_other_processes_take():
    """A block that sleeps while another process spins: the spinner's CPU seconds are the others' (it is waited for
    only after the block, so its time is never this process's children's)."""
    import time

    import psutil

    from pipeline.runner import Usage

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # the interpreter started
        with Usage() as use:
            time.sleep(1.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert 1.4 < use.wall_s < 5
    assert use.others_cpu * (psutil.cpu_count() or 1) >= 0.6  # at least ~one CPU taken by someone else
    assert use.peak > 0


def test_busy_line_names_the_share_and_the_slower_step():
    from pipeline.runner import busy_line

    assert busy_line([(10.0, 0.1), (30.0, 0.2)]) is None  # 17.5% of the CPUs: quiet enough
    line = busy_line([(10.0, 0.1), (30.0, 0.6)])  # 47.5%
    assert line.startswith("the machine was busy: other processes took 48% of the")
    record = {"wall_s": 40.0, "date": "2026-12-07 10:00"}
    assert busy_line([(1.0, 0.0)], [("runtime check", 79.0, record)]) is None  # 1.98x: not twice
    assert busy_line([(1.0, 0.0)], [("runtime check", 6.0, {"wall_s": 2.0, "date": "x"})]) is None  # 4 s longer only
    line = busy_line([(1.0, 0.0)], [("runtime check", 120.0, record)])
    assert "runtime check took 120.0 s, 3.0x its 40.0 s on 2026-12-07 10:00 for the same inputs" in line


def test_steps_are_listed_timed_and_compared_with_their_quiet_record(tmp_path):
    from pipeline.runner import Usage

    runner = Runner(tmp_path, "m", "d", log=lambda s: None, show_progress=False)
    runner.run(_graph([], Knob(), Knob()))
    with runner.step("export", "inputs-1"):
        pass
    quiet = Usage()
    quiet.wall_s, quiet.others_cpu, quiet.peak = 3.0, 0.0, 2**20
    runner.add_step("runtime check", quiet, "inputs-1")
    table = runner.table().splitlines()
    assert table[0].split() == ["stage", "status", "wall_s", "peak_rss_mb", "others_cpu"]
    assert [line.split()[0] for line in table[2:]] == ["a", "b", "c", "export", "runtime"]
    assert table[-1].split()[2:] == ["ran", "3.0", "1", "0%"]
    assert table[-2].split()[-1] == "-"  # a share over a block this short is not a figure
    # a step taken before the stages ran is listed first
    first = Runner(tmp_path / "other", "m", "d", log=lambda s: None, show_progress=False)
    first.add_step("load model", quiet)
    first.run(_graph([], Knob(), Knob()))
    assert [line.split()[0] for line in first.table().splitlines()[2:]] == ["load", "a", "b", "c"]
    assert runner.cache.timing("runtime check", "inputs-1")["wall_s"] == 3.0
    # the same inputs again, 4x slower: named; a busy run's time never becomes the record
    later = Runner(tmp_path, "m", "d", log=lambda s: None, show_progress=False)
    slow = Usage()
    slow.wall_s, slow.others_cpu, slow.peak = 12.0, 0.5, 2**20
    later.add_step("runtime check", slow, "inputs-1")
    assert "runtime check took 12.0 s, 4.0x its 3.0 s on" in later.busy_note()
    assert later.cache.timing("runtime check", "inputs-1")["wall_s"] == 3.0
    assert later.cache.timing("runtime check", "inputs-2") is None
