"""bench/manifest_mutations.py, small: the pipeline builds a real tiny-model artifact and its vLLM checkpoint, a seeded
campaign of a few dozen mutations (all modes, then the new ones alone: poisons, shape lies, file replacements)
prints its counts and writes them as JSON with nothing silent, crashed, hung or exiting 5, the same seed draws the
same mutations, and each kind of finding makes the command exit 1. The judging itself: a blocked call is a hang
after the deadline, any exception but a refusal a crash, and `pipeline show` runs in this process."""
import json
import os
import random

import pytest

from bench import manifest_mutations as mm

NEW_MODES = ("tensor_values_resigned", "shape_lies_resigned", "files")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return mm.build_originals(tmp_path_factory.mktemp("mm"), ["fp8-e4m3"], log=lambda _m: None)


@pytest.fixture
def prebuilt(built, monkeypatch):
    monkeypatch.setattr(mm, "build_originals", lambda *_a, **_k: built)   # built once for the module
    return built


def test_the_pipeline_artifact_fills_the_informative_fields(built):
    (o,) = built
    assert o.name == "fp8-e4m3" and o.manifest["recipe"] == "fp8-e4m3"
    assert o.manifest["runtime_check"]["status"] == "passed" and o.manifest["evaluation"]["fp8-e4m3"]
    assert "gate" in o.manifest and o.manifest["calibration"]["data"]["n_samples"] == 2
    assert o.model is not None and len(o.float_tensors) == 4                 # a scale per layer, K and V
    assert (o.checkpoint / "config.json").is_file() and mm.RECORD in o.checkpoint_files


def test_a_small_campaign_prints_and_writes_its_counts(prebuilt, tmp_path, capsys):
    out = tmp_path / "mm.json"
    assert mm.main(["--examples", "60", "--seed", "3", "--recipes", "fp8-e4m3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("mutations tried 60: refused ")
    assert "silent 0, crashes 0, hangs 0, exit5 0" in printed.splitlines()[0]
    result = json.loads(out.read_text())
    assert result["total"]["tried"] == 60 == sum(result["total"][k] for k in mm.OUTCOMES)
    assert all(result["total"][k] == 0 for k in mm.FINDINGS) and result["seed"] == 3
    assert sum(c["tried"] for c in result["per_mode"].values()) == 60
    again = [m.what for _, m in mm.drawn(prebuilt, random.Random(3), 60)]
    assert again == [m.what for _, m in mm.drawn(prebuilt, random.Random(3), 60)]
    assert again != [m.what for _, m in mm.drawn(prebuilt, random.Random(4), 60)]


def test_a_campaign_of_the_new_modes_finds_nothing(prebuilt, tmp_path, capsys):
    """Poisoned tensors, artifacts for another model and replaced files (both layouts), drawn: every one refused."""
    out = tmp_path / "new.json"
    assert mm.main(["--examples", "60", "--seed", "0", "--recipes", "fp8-e4m3", "--modes", *NEW_MODES,
                    "--json", str(out)]) == 0, capsys.readouterr().out
    result = json.loads(out.read_text())
    assert all(result["total"][k] == 0 for k in mm.FINDINGS), result["findings"]
    assert result["total"]["tried"] == result["total"]["refused"] == 60
    assert all(result["per_mode"][mode]["tried"] >= 10 for mode in NEW_MODES), result["per_mode"]
    drawn = [m for _, m in mm.drawn(prebuilt, random.Random(0), 60, NEW_MODES)]
    assert {m.edit.layout for m in drawn if m.edit} == {"native", "checkpoint"}
    assert {"ArtifactCache: ModelMismatchError", "strict: ModelMismatchError", "TensorValueError",
            "FileKindError"} <= set(result["refused_by"])


def test_a_silent_harmful_mutation_fails_the_run(prebuilt, monkeypatch, capsys):
    """With the judge told that nothing decodes the same, every accepted mutation is harmful: exit 1, named."""
    monkeypatch.setattr(mm, "same", lambda _a, _b: False)
    assert mm.main(["--examples", "60", "--seed", "3", "--recipes", "fp8-e4m3"]) == 1
    captured = capsys.readouterr()
    assert "  SILENT fp8-e4m3 json_resigned: " in captured.out and "FAILED: " in captured.err


def test_show_exiting_5_fails_the_run(prebuilt, monkeypatch, capsys):
    """Every mutation shown through `pipeline show`: an exit status other than 0 or 2 is counted and fails."""
    monkeypatch.setattr(mm, "show_exit", lambda _folder: (5, "error: internal error (a bug, not bad input)"))
    assert mm.main(["--examples", "5", "--seed", "3", "--recipes", "fp8-e4m3"]) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith("mutations tried 5: ") and "exit5 5" in captured.out.splitlines()[0]
    assert "  EXIT5 fp8-e4m3 " in captured.out and "[pipeline show]: exit 5: error: internal error" in captured.out


def test_a_blocked_call_is_a_hang_and_an_exception_a_crash(tmp_path, monkeypatch):
    """attempt: a refusal by its class, a FIFO opened for reading (blocks: no writer) a hang after the deadline,
    anything else a crash named with where it was raised; the deadline is a BaseException, so `except Exception`
    in the code judged does not swallow it."""
    from exporters.manifest import SchemaError

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    monkeypatch.setattr(mm, "DEADLINE_S", 1)

    def swallowing():
        try:
            open(fifo, "rb")
        except Exception:  # noqa: BLE001 -- as a command line's internal-error handler does
            return "swallowed"

    assert mm.attempt(swallowing) == ("hangs", "still running after 1 s")
    outcome, text = mm.attempt(lambda: 1 / 0)
    assert outcome == "crashes" and text.startswith("ZeroDivisionError: division by zero at ")
    assert mm.attempt(lambda: (_ for _ in ()).throw(SchemaError("no"))) == ("refused", "SchemaError")
    assert mm.attempt(lambda: 7) == ("accepted", 7)


def test_show_runs_in_process(built, tmp_path):
    """`pipeline show DIR` through the command line's own entry point: 0 for the artifact, 2 for a folder without
    one, with the refusal as the last line."""
    (o,) = built
    good = tmp_path / "good"
    mm.write_folder(o, mm.Mutation("json_resigned", "none", o.raw_manifest, o.raw_tensors), good)
    assert mm.show_exit(good) == (0, "")
    (tmp_path / "empty").mkdir()
    code, line = mm.show_exit(tmp_path / "empty")
    assert code == 2 and "not an artifact folder" in line
