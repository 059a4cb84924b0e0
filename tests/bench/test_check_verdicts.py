"""bench/check_verdicts.py as CI runs it: `python -m bench.check_verdicts --tiny` builds the tiny model's artifacts
with the pipeline (three recipes: the default's shape, smoothing + prefix with outlier bounds, fp8), re-signs every
gaming case of issue 68 and judges each with `kvcalib check`; every case gets the verdict it must (the command's exit
0 and its JSON), and the command exits 1 when one does not."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MUST = {"honest": [0], "prefix_poison": [1], "canary_switch_off": [1, 2], "random_twin": [2], "huge_random": [2],
        "claim_deleted": [1], "equal_bounds": [0, 1], "subnormal_scale": [2], "subnormal_smoothing": [2]}


def test_every_gaming_case_gets_its_verdict_on_the_tiny_models_artifacts(tmp_path):
    out = tmp_path / "verdicts.json"
    run = subprocess.run([sys.executable, "-m", "bench.check_verdicts", "--tiny", "--check-args", "model.source=tiny",
                          "contexts=[64]", "batches=[1]", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["wrong"] == 0 and len(report["artifacts"]) == 3
    seen = {}
    for entry in report["artifacts"]:
        for row in entry["cases"]:
            if row["applies"]:
                assert row["ok"] and row["exit"] != 5, row
                seen.setdefault(row["case"], set()).add(row["exit"])
    for case, codes in MUST.items():
        assert case in seen and seen[case] <= set(codes), (case, seen.get(case))
    assert "escaped_names" in seen and "\x1b" not in run.stdout
    assert "check_verdicts: " in run.stdout and " 0 with another verdict than required or exit 5" in run.stdout


def test_a_wrong_verdict_makes_the_command_exit_1(tmp_path, monkeypatch):
    """The bench fails when a case gets another verdict: an honest artifact judged as if it must fail."""
    from bench import check_verdicts as cv

    monkeypatch.setattr(cv, "CASES", (cv.Case("honest", (1,), lambda m, t: None),))
    monkeypatch.setattr(cv, "TINY_RECIPES", ("kvquant-4b+sink16+recent128",))
    assert cv.main(["--tiny", "--check-args", "model.source=tiny", "contexts=[16]", "batches=[1]"]) == 1
