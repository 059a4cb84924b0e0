"""bench/manifest_mutations.py, small: the pipeline builds a real tiny-model artifact, a seeded campaign of a few
dozen mutations prints its counts and writes them as JSON, the same seed draws the same mutations, and a
mutation judged harmful makes the command exit 1."""
import json
import random

import pytest

from bench import manifest_mutations as mm


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return mm.build_originals(tmp_path_factory.mktemp("mm"), ["kivi-2"], log=lambda _m: None)


def test_the_pipeline_artifact_fills_the_informative_fields(built):
    (o,) = built
    assert o.name == "kivi-2" and o.manifest["recipe"] == "kivi-2"
    assert o.manifest["runtime_check"]["status"] == "passed" and o.manifest["evaluation"]["kivi-2"]
    assert "gate" in o.manifest and o.manifest["calibration"]["data"]["n_samples"] == 2


def test_a_small_campaign_prints_and_writes_its_counts(built, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(mm, "build_originals", lambda *_a, **_k: built)   # built once for the module
    out = tmp_path / "mm.json"
    assert mm.main(["--examples", "60", "--seed", "3", "--recipes", "kivi-2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("mutations tried 60: refused ") and "silent and harmful 0" in printed
    result = json.loads(out.read_text())
    assert result["total"]["tried"] == 60 == sum(result["total"][k] for k in mm.OUTCOMES)
    assert result["total"]["silent"] == 0 and result["seed"] == 3
    assert sum(sum(c.values()) for c in result["per_mode"].values()) == 60
    again = [m.what for _, m in mm.drawn(built, random.Random(3), 60)]
    assert again == [m.what for _, m in mm.drawn(built, random.Random(3), 60)]
    assert again != [m.what for _, m in mm.drawn(built, random.Random(4), 60)]


def test_a_silent_harmful_mutation_fails_the_run(built, monkeypatch, capsys):
    """With the judge told that nothing decodes the same, every accepted mutation is harmful: exit 1, named."""
    monkeypatch.setattr(mm, "build_originals", lambda *_a, **_k: built)
    monkeypatch.setattr(mm, "same", lambda _a, _b: False)
    assert mm.main(["--examples", "60", "--seed", "3", "--recipes", "kivi-2"]) == 1
    captured = capsys.readouterr()
    assert "  SILENT kivi-2 json_resigned: " in captured.out and "FAILED:" in captured.err
