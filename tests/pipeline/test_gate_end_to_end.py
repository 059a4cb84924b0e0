"""The drift gate on the embedded model: a deliberately bad recipe fails with the offending cell named, and
kvquant-4b-1pct passes (small windows, so the test stays short)."""
import pytest

from pipeline.app import run_pipeline
from pipeline.config import DataConfig, EvalConfig, RunConfig, load_recipe
from pipeline.errors import GateError


def _cfg(recipe: str, cache_dir) -> RunConfig:
    cfg = RunConfig(data=DataConfig(n_samples=2, seq_len=256, eval_n_samples=1, eval_seq_len=512),
                    quant=load_recipe(recipe), eval=EvalConfig(recipes=["fp16"]), cache_dir=str(cache_dir))
    cfg.traces.reservoir_size = 512
    cfg.probes.enabled = False
    cfg.check.enabled = False
    cfg.sensitivity.variants = ["kv"]
    return cfg


@pytest.mark.slow
def test_gate_fails_int2_per_token_keys_and_passes_kvquant_4b(tmp_path):
    with pytest.raises(GateError, match=r"layer \d+ positions \d+-\d+: (KL|attention cosine)"):
        run_pipeline(_cfg("int2-token", tmp_path / "cache"), tmp_path / "bad", log=lambda s: None, show_progress=False)
    assert (tmp_path / "bad" / "report.md").is_file()  # the evidence is written before the run fails
    out = run_pipeline(_cfg("kvquant-4b-1pct", tmp_path / "cache"), tmp_path / "good", log=lambda s: None,
                       show_progress=False)
    gate = out["summary"]["drift"]["gate"]
    assert gate["passed"], gate["failures"]
