"""bench/gpu_smoke.py's dry run (--cpu): the GPU smoke script's whole path on the CPU with Triton interpreted --
the pipeline on the embedded model, the runtime check, one JSON line. It cannot prove CUDA correctness; it keeps
the script that does ready to run."""
import json

import pytest

from bench import gpu_smoke


@pytest.mark.slow
def test_the_dry_run_prints_one_ok_json_line(capsys, tmp_path):
    assert gpu_smoke.main(["--cpu", "--json", str(tmp_path / "smoke.json")]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert report == json.loads((tmp_path / "smoke.json").read_text())
    assert report["ok"] and report["problems"] == []
    assert report["model_device"] == ["cpu"] and report["stage_result_devices"] == ["cpu"]
    assert report["runtime_check"]["status"] == "passed" and report["runtime_check"]["interpreter"] is True
    assert {"traces", "fisher", "evaluate"} <= set(report["stages"])
    assert set(report["ppl_ratio"]) == {"fp16", "fp8-e4m3", "kivi-4", "kvquant-4b-1pct"}


def test_without_a_gpu_the_gpu_run_says_so_and_fails(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    report = gpu_smoke.run(cpu=False)
    assert not report["ok"] and "no CUDA GPU visible" in report["error"]
