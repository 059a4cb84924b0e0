"""Every stage with the model in bfloat16: catches dtype mixing (fp32 state fed bf16 activations, bf16 tensors into
fp32 buffers) on CPU, the part of device correctness a CPU-only machine can check. The whole pipeline runs on the
tiny Llama in bfloat16 with a calibrated recipe (traces, Fisher, key scales, outliers, codebooks, SmoothAttention
and prefix tokens through kvquant+smooth+prefix), the evaluation, sensitivity, probes, export and the runtime check."""
import pytest
import torch

from pipeline.app import run_pipeline
from pipeline.config import DataConfig, ModelConfig, RunConfig, load_recipe
from stages.evaluate import EvalConfig


def _run(tmp_path, dtype: str, recipe: str):
    cfg = RunConfig(model=ModelConfig(name="tiny", source="tiny", dtype=dtype),
                    data=DataConfig(n_samples=2, seq_len=64, eval_n_samples=1, eval_seq_len=64),
                    quant=load_recipe(recipe), eval=EvalConfig(recipes=["fp16", "fp8-e4m3", "kivi-4"]),
                    cache_dir=str(tmp_path / "cache"))
    cfg.traces.reservoir_size = 128
    cfg.sensitivity.variants = ["kv"]
    cfg.gate.enabled = False
    return run_pipeline(cfg, tmp_path / dtype, log=lambda _m: None, show_progress=False)


@pytest.mark.parametrize("recipe", ["kvquant-4b-1pct", "kvquant-3b-1pct+smooth+prefix"])
def test_every_stage_runs_with_the_model_in_bfloat16(tmp_path, recipe):
    out = _run(tmp_path, "bfloat16", recipe)
    assert {p.dtype for p in out["model"].model.parameters()} == {torch.bfloat16}
    recipes = out["summary"]["evaluation"]["recipes"]
    for name, r in recipes.items():
        assert torch.isfinite(torch.tensor(r["ppl"])), name
    # bf16 activations, fp32 statistics: the quantized recipes stay close to the bf16 reference
    assert recipes[recipe]["ppl_ratio"] < 1.5
    assert out["summary"]["runtime_check"]["status"] == "passed"
