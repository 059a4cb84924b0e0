"""The command line as a user runs it (subprocesses), on the tiny model and on the embedded model."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import EXIT_USER

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model=tiny", "data.n_samples=2", "data.seq_len=32", "data.eval_n_samples=1", "data.eval_seq_len=32",
        "tracking.enabled=false", "traces.reservoir_size=16", "probes.lengths=[64]"]


def _run(args, tmp_path, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_help_lists_subcommands(tmp_path):
    out = _run(["--help"], tmp_path)
    assert out.returncode == 0 and all(c in out.stdout for c in ("run", "check", "show"))


def test_tiny_run_then_cached_run(tmp_path):
    first = _run(["run", *TINY], tmp_path)
    assert first.returncode == 0, first.stderr
    results = Path(first.stdout.strip().splitlines()[-1].removeprefix("results: "))
    summary = json.loads((results / "summary.json").read_text())
    assert summary["model"]["n_kv_heads"] == 2 and summary["stages"][0]["status"] == "computed"
    assert "peak_rss_mb" in first.stdout and "traces" in first.stdout
    second = _run(["run", *TINY], tmp_path)
    assert second.returncode == 0 and "reused cache entry" in second.stdout


@pytest.mark.parametrize("override,pattern", [
    ("model=nope", "Could not find 'model/nope'"),
    ("model.bogus=1", "Key 'bogus' not in 'ModelConfig'"),
    ("data.seq_len=1", "data.seq_len must be >= 2 tokens, got 1"),
    ("data.n_samples=0", "data.n_samples must be >= 1, got 0"),
    ("data=local", "data.path"),
    ("quant.value.format=fp16", "quant.value.axis for format fp16 must be one of ('tensor',), got 'token'"),
    ("codebooks.weighting=mse", "codebooks.weighting must be one of ('fisher-scale2', 'fisher'), got 'mse'"),
])
def test_bad_input_is_a_clear_error_and_leaves_nothing(tmp_path, override, pattern):
    out = _run(["run", *TINY, override], tmp_path)
    assert out.returncode != 0
    assert pattern in out.stderr + out.stdout
    assert not (tmp_path / ".kvcalib_cache").exists() or not any((tmp_path / ".kvcalib_cache").rglob("*.safetensors"))


def test_recipe_with_only_keys_quantized(tmp_path):
    """nuq keys beside full-precision values: only the key bit-width gets a codebook (a 16-bit one cannot exist)."""
    out = _run(["run", *TINY, "quant.name=nuq4-keys-only", "quant.value.format=fp16", "quant.value.bits=16", "quant.value.axis=tensor",
                "quant.value.outlier_fraction=0", "export.enabled=false", "check.enabled=false"], tmp_path)
    assert out.returncode == 0, out.stderr
    summary = json.loads((Path(out.stdout.strip().splitlines()[-1].removeprefix("results: ")) / "summary.json").read_text())
    row = summary["evaluation"]["recipes"]["nuq4-keys-only"]
    assert 4 < row["avg_bits"] < 16  # keys encoded at 4 bits (+ scales), values at 16
    books = [m for name, m in summary["stage_meta"].items() if name.startswith("codebooks-")]
    assert len(books) == 1 and set(books[0]["sse"]) == {"k4", "v4"}  # one bit-width fitted, no 16-bit codebook


def test_llama3_without_weights_is_a_short_message(tmp_path):
    out = _run(["run", "model=llama3"], tmp_path)
    assert out.returncode == EXIT_USER and "model.path=" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_embedded_model_end_to_end(tmp_path):
    out = _run(["run", "data.n_samples=2", "data.seq_len=128", "data.eval_n_samples=1", "data.eval_seq_len=128",
                "tracking.enabled=false", "probes.lengths=[128]", "sensitivity.variants=[kv]", "traces.reservoir_size=256",
                "check.contexts=[64]", "check.batches=[1]"], tmp_path, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    results = Path(out.stdout.strip().splitlines()[-1].removeprefix("results: "))
    summary = json.loads((results / "summary.json").read_text())
    assert summary["model"]["n_layers"] == 30 and summary["model"]["n_kv_heads"] == 3
    assert summary["stage_meta"]["traces"]["n_tokens"] == 256
