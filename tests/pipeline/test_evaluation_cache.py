"""The comparison recipes cached one by one (issue 50): a run with another `quant`, or another eval.recipes list,
evaluates only the recipes whose entry it lacks -- the runner says which it reused -- and its table is what one
evaluation of all its recipes together gives."""
import json

from pipeline.app import run_pipeline
from pipeline.config import DataConfig, EvalConfig, ModelConfig, RunConfig, load_recipe
from stages import evaluate
from stages.recipe import recipe_policy

COMPARED = ["fp16", "int4-token", "fp8-e4m3"]


def _run(tmp_path, quant: str, recipes: list[str]):
    cfg = RunConfig(model=ModelConfig(name="tiny", source="tiny"),
                    data=DataConfig(n_samples=2, seq_len=32, eval_n_samples=2, eval_seq_len=32),
                    quant=load_recipe(quant), eval=EvalConfig(recipes=recipes), cache_dir=str(tmp_path / "cache"))
    cfg.traces.reservoir_size = 64
    cfg.export.enabled = cfg.check.enabled = cfg.tracking.enabled = False
    cfg.sensitivity.enabled = cfg.probes.enabled = cfg.gate.enabled = False
    logs: list[str] = []
    out = run_pipeline(cfg, tmp_path / f"run-{quant}-{len(recipes)}", log=logs.append, show_progress=False)
    status = {r.name: r.status for r in out["runner"].records}
    return out, status, "\n".join(logs)


def test_another_quant_evaluates_only_itself_and_gives_the_table_of_one_evaluation(tmp_path):
    first, status, _ = _run(tmp_path, "kvquant-4b-1pct", COMPARED)
    assert status["evaluate-reference"] == status["evaluate-recipe-kvquant-4b-1pct"] == "computed"
    second, status, logs = _run(tmp_path, "kvquant-3b-1pct", COMPARED)
    for name in COMPARED:  # unchanged recipes: their entries, and the runner's log says so
        assert status[f"evaluate-recipe-{name}"] == "cached"
        assert f"stage evaluate-recipe-{name}: reused cache entry" in logs
    assert status["evaluate-reference"] == "cached" and "stage evaluate-reference: reused cache entry" in logs
    assert status["evaluate-recipe-kvquant-3b-1pct"] == "computed" and "evaluate-recipe-kvquant-4b-1pct" not in status
    assert status["evaluate"] == "computed"  # the table of this run's recipes

    rows = second["summary"]["evaluation"]["recipes"]
    assert list(rows) == ["kvquant-3b-1pct", *COMPARED]  # the run's recipe first, as before
    assert all(rows[n] == first["summary"]["evaluation"]["recipes"][n] for n in COMPARED)
    # the same figures as the four recipes evaluated together, in one pass over the windows
    lm, results = second["model"], second["results"]
    recipes = [load_recipe(n) for n in ["kvquant-3b-1pct", *COMPARED]]
    together = evaluate.fit(evaluate.Inputs(lm.model, lm.spec, second["windows"].eval,
                                            [recipe_policy(q, lm.spec.n_layers, results) for q in recipes]))
    assert json.dumps(second["summary"]["evaluation"]) == json.dumps(together.meta)
    assert rows["kvquant-3b-1pct"]["kl"] != first["summary"]["evaluation"]["recipes"]["kvquant-4b-1pct"]["kl"]


def test_a_longer_comparison_list_evaluates_only_the_recipe_it_adds(tmp_path):
    _run(tmp_path, "kvquant-4b-1pct", COMPARED)
    out, status, logs = _run(tmp_path, "kvquant-4b-1pct", [*COMPARED, "kivi-2"])
    computed = sorted(n for n, s in status.items() if s == "computed")
    assert computed == ["evaluate", "evaluate-recipe-kivi-2"], logs
    assert set(out["summary"]["evaluation"]["recipes"]) == {"kvquant-4b-1pct", *COMPARED, "kivi-2"}


def _composed(overrides: list[str]) -> RunConfig:
    from hydra import compose, initialize_config_dir

    from pipeline.config import CONF_DIR, register_configs, to_typed

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_typed(compose(config_name="config", overrides=overrides))


def test_the_default_run_and_the_quick_preset():
    """The light default (docs/eval-cost.md): the run's recipe against fp16, fp8-e4m3 and vLLM's int4 cache on 4
    windows, 4 calibration windows, the map on 384 positions, one passkey at 2k; preset=quick cuts further, and a
    key given on the command line overrides the preset's."""
    cfg = _composed([])
    assert (cfg.data.n_samples, cfg.data.eval_n_samples, cfg.data.seq_len, cfg.data.eval_seq_len) == (4, 4, 1024, 1024)
    assert cfg.eval.recipes == ["fp16", "fp8-e4m3", "vllm-int4-per-token-head"]
    assert (cfg.sensitivity.enabled, cfg.sensitivity.seq_len, cfg.probes.lengths, cfg.probes.depths) == (
        True, 384, [2048], [0.5])
    assert cfg.gate.enabled and cfg.export.enabled and cfg.check.enabled
    quick = _composed(["preset=quick", "model=tiny"])
    assert (quick.data.n_samples, quick.data.eval_n_samples, quick.eval.recipes) == (2, 2, ["fp16"])
    assert (quick.sensitivity.enabled, quick.sensitivity.seq_len, quick.probes.lengths) == (True, 256, [1024])
    assert quick.gate.enabled and quick.model.source == "tiny"
    assert _composed(["preset=quick", "data.eval_n_samples=3"]).data.eval_n_samples == 3


def test_a_recipe_stage_named_with_a_plus_is_recorded_under_a_name_mlflow_takes():
    """The default recipe's evaluate-recipe stage is `evaluate-recipe-kvquant-4b+sink16+recent128`; MLflow refuses
    `+` in metric and tag names, so the stage's wall time, memory, status and key are recorded with it written `_`
    (pipeline.tracking.metric_name), its exact name in the `stages` tag."""
    from mlflow.utils.validation import _validate_metric_name, _validate_tag_name

    from pipeline.tracking import summary_metrics, summary_tags

    name = "evaluate-recipe-kvquant-4b+sink16+recent128"
    summary = {"recipe": "kvquant-4b+sink16+recent128", "model": {}, "data": {},
               "stages": [{"name": name, "key": "k" * 32, "status": "computed", "wall_s": 2.5, "peak_rss_mb": 9.0}]}
    metrics, tags = summary_metrics(summary), summary_tags(summary)
    assert metrics["stage.evaluate-recipe-kvquant-4b_sink16_recent128.wall_s"] == 2.5
    assert tags["stage.evaluate-recipe-kvquant-4b_sink16_recent128.key"] == "k" * 32 and tags["stages"] == name
    for key in metrics:
        _validate_metric_name(key)
    for key in tags:
        _validate_tag_name(key)
