"""pipeline/app.py's refusal of evaluation-only formats (vLLM's own caches) as the recipe a run exports: before the
model loads, naming the field, the allowed formats and what was given; as comparison recipes they are fine."""
import pytest

from exporters.codec import CodecError
from pipeline.app import run_pipeline
from pipeline.config import validate_run
from pipeline.config import EvalConfig, LayerPolicyConfig, ModelConfig, RunConfig, load_recipe
from pipeline.errors import UserError, user_errors

NOT_LOADED = ModelConfig(source="local", path="/nonexistent/kvcalib-test-model")  # loading it would fail


def test_a_peer_format_as_the_runs_recipe_is_refused_before_the_model_loads(tmp_path):
    cfg = RunConfig(model=NOT_LOADED, quant=load_recipe("vllm-turboquant-4bit-nc"), cache_dir=str(tmp_path / "c"))
    with pytest.raises(CodecError, match=r"^quant\.key: format turbo_mse with axis token is evaluation-only .*"
                                         r"uniform \(axis token\|channel\).*got format='turbo_mse', axis='token'$"
                       ) as exc:
        run_pipeline(cfg, tmp_path / "run", log=lambda _m: None, show_progress=False)
    assert isinstance(exc.value, user_errors())     # exit code 2, like every refused recipe
    assert not (tmp_path / "c").exists() and not (tmp_path / "run").exists()


def test_the_value_field_is_named_too():
    q = load_recipe("int4-token")
    q.value = load_recipe("vllm-fp8-per-token-head").value
    with pytest.raises(CodecError, match=r"^quant\.value: format fp8 with axis token is evaluation-only .*"
                                         r"fp8 \(axis tensor\|head\)"):
        validate_run(RunConfig(quant=q))


def test_a_peer_format_as_a_layer_policy_option_is_refused():
    cfg = RunConfig(quant=load_recipe("kvquant-4b-1pct"), eval=EvalConfig(recipes=["fp16"]),
                    layer_policy=LayerPolicyConfig(enabled=True, options=["kvquant-3b-1pct", "vllm-int4-per-token-head"]))
    with pytest.raises(CodecError, match=r"^layer_policy\.options\[1\] \(recipe vllm-int4-per-token-head\): quant\.key: "
                                         r"format rht_int with axis token is evaluation-only"):
        validate_run(cfg)


def test_an_evaluation_only_option_is_weighed_when_nothing_is_exported():
    """export.enabled=false: the mixed policy is only evaluated, so its options may be evaluation-only formats (as
    eval.recipes may); the same options with export on are refused by name."""
    opts = ["kvquant-2b+sink16+recent32", "kvquant-2b+sink16+recent32+clipv"]   # the nuq clip: evaluation-only
    cfg = RunConfig(quant=load_recipe("kvquant-4b-1pct"), eval=EvalConfig(recipes=["fp16"]),
                    layer_policy=LayerPolicyConfig(enabled=True, options=opts))
    with pytest.raises(CodecError, match=r"^layer_policy\.options\[1\] \(recipe kvquant-2b\+sink16\+recent32\+clipv\): "
                                         r"quant\.value\.clip: clip mse is evaluation-only"):
        validate_run(cfg)
    cfg.export.enabled = False
    assert [q.name for q in validate_run(cfg)][-2:] == opts


def test_full_context_options_outside_the_options_are_refused_by_name():
    cfg = RunConfig(quant=load_recipe("kvquant-4b-1pct"), eval=EvalConfig(recipes=["fp16"]),
                    layer_policy=LayerPolicyConfig(enabled=True, options=["kvquant-3b-1pct", "kvquant-2b-1pct"],
                                                   full_context_options=["kvquant-3b-1pct", "kvquant-4b-1pct"]))
    with pytest.raises(UserError, match=r"^layer_policy\.full_context_options must each be one of layer_policy\.options "
                                        r"\['kvquant-3b-1pct', 'kvquant-2b-1pct'\], got \['kvquant-4b-1pct'\]"):
        validate_run(cfg)


def test_peer_formats_are_fine_as_comparison_recipes():
    names = ["fp16", "vllm-int8-per-token-head", "vllm-turboquant-k8v4", "vllm-turboquant-3bit-nc"]
    cfg = RunConfig(quant=load_recipe("kvquant-4b-1pct"), eval=EvalConfig(recipes=names))
    assert [q.name for q in validate_run(cfg)] == ["kvquant-4b-1pct", *names]


def test_long_windows_without_the_evaluation_are_refused_naming_both_fields():
    from pipeline.config import DataConfig, GateConfig
    from pipeline.errors import UserError

    cfg = RunConfig(quant=load_recipe("kvquant-4b-1pct"), data=DataConfig(long_n_samples=2),
                    eval=EvalConfig(enabled=False), gate=GateConfig(enabled=False))
    with pytest.raises(UserError, match=r"^data\.long_n_samples=2 needs eval\.enabled=true .* got eval\.enabled=false"):
        validate_run(cfg)
    cfg.data.long_n_samples = 0
    validate_run(cfg)


def test_a_run_with_long_windows_evaluates_every_recipe_and_the_mixed_policy_there(tmp_path):
    """data.long_n_samples > 0: the evaluate-long stage evaluates the run's recipes and its mixed per-layer policy
    on the long windows; the summary carries them and the gate judges them (here with a threshold nothing fails)."""
    from pipeline.config import DataConfig
    cfg = RunConfig(model=ModelConfig(name="tiny", source="tiny"),
                    data=DataConfig(n_samples=2, seq_len=32, eval_n_samples=1, eval_seq_len=32, long_n_samples=1,
                                    long_seq_len=200),
                    quant=load_recipe("kvquant-4b-1pct"), eval=EvalConfig(recipes=["fp16", "kivi-2"]),
                    layer_policy=LayerPolicyConfig(enabled=True, budget=16.0,
                                                   options=["kvquant-2b-1pct", "kvquant-4b-1pct"]),
                    cache_dir=str(tmp_path / "cache"))
    cfg.traces.reservoir_size = 64
    cfg.export.enabled = cfg.check.enabled = False
    cfg.sensitivity.enabled = cfg.probes.enabled = False
    cfg.gate.max_ppl_ratio = 1e9
    out = run_pipeline(cfg, tmp_path / "run", log=lambda _m: None, show_progress=False)
    summary = out["summary"]
    long, short = summary["evaluation_long"], summary["evaluation"]
    assert (long["windows"], long["seq_len"], short["seq_len"]) == (1, 200, 32)
    assert set(long["recipes"]) == {"fp16", "kivi-2", "kvquant-4b-1pct", "kvquant-2b-1pct", "mixed-16b"}
    assert len(long["sha256"]) == 64
    assert long["recipes"]["kivi-2"]["ppl_ratio"] != short["recipes"]["kivi-2"]["ppl_ratio"]
    assert summary["drift"]["gate"]["passed"]
    assert [r.name for r in out["runner"].records][-1] == "evaluate-long"
    report = (tmp_path / "run" / "report.md").read_text()
    assert "## At long context (1 windows x 200 tokens, evaluate-long)" in report
