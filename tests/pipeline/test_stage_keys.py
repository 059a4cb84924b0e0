"""Cache keys that cannot go stale: the runner computes a stage's key from its whole config (stages.base.key_view),
so changing any field of any stage's config changes that stage's key and the keys of every stage that reads it,
unless the field's dataclass declares it in KEY_EXCLUDED. Walked over the graph of a run that holds every
declared stage (pipeline.app.DECLARATIONS), field by field; then the two-run example of issue 30 end to end."""
import copy
import dataclasses
from pathlib import Path

import pytest

from pipeline.app import DECLARATIONS, run_pipeline, stage_graph
from pipeline.config import (DataConfig, EvalConfig, LayerPolicyConfig, ModelConfig, RunConfig, load_recipe,
                             recipes_of, validate_run)
from pipeline.runner import Runner

# a run whose graph holds every declared stage: calibrated, smoothed and prefix recipes, the mixed policy, the
# drift map and the probes
RECIPES = ["fp16", "kivi-2", "kvquant-3b-1pct+smooth+prefix", "kvquant-2b-1pct", "kvquant-3b-1pct"]


def _cfg() -> RunConfig:
    return RunConfig(quant=load_recipe("kvquant-4b-1pct"), eval=EvalConfig(recipes=RECIPES),
                     data=DataConfig(long_n_samples=1),  # the long-context evaluation
                     layer_policy=LayerPolicyConfig(enabled=True, budget=3.0,
                                                    options=["kvquant-2b-1pct", "kvquant-3b-1pct", "kvquant-4b-1pct"]))


def _keys(tmp_path, graph) -> dict[str, str]:
    return Runner(tmp_path / "cache", "model", "data", log=lambda _m: None, show_progress=False).keys_of(graph)


def _dependents(graph, name: str) -> set[str]:
    out, grew = {name}, True
    while grew:
        grew = False
        for s in graph:
            if s.name not in out and out & set(s.deps):
                out.add(s.name)
                grew = True
    return out


def _leaves(obj, path=()):
    """(path, value, excluded) for every leaf field of a (nested) dataclass config; lists are leaves."""
    excluded = getattr(type(obj), "KEY_EXCLUDED", {})
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, path + (f.name,))
        else:
            yield path + (f.name,), value, f.name in excluded


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 1.5 + 0.25
    if isinstance(value, str):
        return value + "-changed"
    if isinstance(value, list):
        return value[:-1] if len(value) > 1 else value + value + [0]
    raise AssertionError(f"no change defined for {type(value).__name__}")


def _set(obj, path, value):
    for name in path[:-1]:
        obj = getattr(obj, name)
    object.__setattr__(obj, path[-1], value)  # frozen configs (CalibGroup) too: this is a copy


def test_the_graph_holds_every_declared_stage():
    graph = stage_graph(_cfg(), validate_run(_cfg()))
    declared = {s.declaration.name for s in graph}
    assert declared == {d.name for d in DECLARATIONS}, {d.name for d in DECLARATIONS} - declared
    assert len({s.name for s in graph}) == len(graph)


def test_every_config_field_is_in_its_stage_key_and_its_dependents_keys(tmp_path):
    """Each bound stage's config, each leaf field changed in turn (the rest of the graph as it was)."""
    graph = stage_graph(_cfg(), validate_run(_cfg()))
    base = _keys(tmp_path, graph)
    checked = excluded_seen = 0
    for i, stage in enumerate(graph):
        for path, value, excluded in _leaves(stage.config):
            config = copy.deepcopy(stage.config)
            _set(config, path, _changed(value))
            changed = graph[:i] + [dataclasses.replace(stage, config=config)] + graph[i + 1:]
            keys = _keys(tmp_path, changed)
            moved = {n for n in keys if keys[n] != base[n]}
            where = f"{stage.name}: {'.'.join(path)}"
            if excluded:
                assert not moved, f"{where} is declared KEY_EXCLUDED but changed the keys of {sorted(moved)}"
                excluded_seen += 1
            else:
                assert moved == _dependents(graph, stage.name), f"{where}: keys changed {sorted(moved)}"
            checked += 1
    assert checked > 100 and excluded_seen >= 4  # fisher.recompute, eval / sensitivity / probes / layer_policy.enabled


def test_every_run_config_field_a_stage_reads_moves_a_key(tmp_path):
    """From the user's side: a field of a stage's section of RunConfig (traces, fisher, smooth, prefix,
    codebooks, eval, layer_policy, sensitivity, probes, quant), changed in the run config, changes the key of at
    least one stage (and then its dependents'), unless its dataclass excludes it. This is the check that failed
    on the old wiring, where the evaluate stage was keyed on {"recipes": ...} alone."""
    cfg = _cfg()
    base_graph = stage_graph(cfg, validate_run(cfg))
    base = _keys(tmp_path, base_graph)
    sections = ("traces", "fisher", "smooth", "prefix", "codebooks", "eval", "layer_policy", "sensitivity", "probes",
                "quant")
    allowed = {("codebooks", "weighting"): "query-scale2", ("fisher", "recompute"): "never",
               ("eval", "recipes"): RECIPES[:-1], ("quant", "key_rope"): "post", ("quant", "name"): "renamed",
               ("layer_policy", "full_context_options"): ["kvquant-3b-1pct", "kvquant-4b-1pct"]}
    for section in sections:
        for path, value, excluded in _leaves(getattr(cfg, section), (section,)):
            if path[-1] == "library" or path[:2] == ("quant", "engine"):
                continue  # library caches: refused for a calibrated recipe (validate_run), covered by the graph test
            changed = copy.deepcopy(cfg)
            _set(changed, path, allowed.get(path, _changed(value)))
            if path[-1] == "enabled":  # a switch: the stage leaves the graph (and the gate needs the evaluation)
                changed.gate.enabled = changed.eval.enabled
                changed.layer_policy.enabled = changed.layer_policy.enabled and changed.eval.enabled
                changed.data.long_n_samples = changed.data.long_n_samples if changed.eval.enabled else 0
                names = {s.name for s in stage_graph(changed, validate_run(changed))}
                assert names < {s.name for s in base_graph}, f"{'.'.join(path)}=false left the graph as it was"
                continue
            if path == ("quant", "name"):
                changed.quant.name = "kvquant-4b-1pct-renamed"
            # a changed recipe field need not be valid for keying: the graph is built without the validation
            graph = stage_graph(changed, validate_run(changed) if path[0] != "quant" else recipes_of(changed))
            keys = _keys(tmp_path, graph)
            moved = {n for n in set(keys) | set(base) if keys.get(n) != base.get(n)}
            if excluded:
                assert not moved, f"{'.'.join(path)} is declared KEY_EXCLUDED but moved {sorted(moved)}"
            else:
                assert moved, f"{'.'.join(path)} changed and no stage key moved"


def test_a_changed_evaluation_is_recomputed_not_served_from_the_cache(tmp_path):
    """Issue 30's two runs in one folder: the second asks for perturbation seeds; it must recompute the
    evaluation (and report the seeds), not reuse the first run's entry."""
    def run(**eval_kw):
        cfg = RunConfig(model=ModelConfig(name="tiny", source="tiny"),
                        data=DataConfig(n_samples=2, seq_len=32, eval_n_samples=2, eval_seq_len=32),
                        quant=load_recipe("kvquant-4b-1pct"), eval=EvalConfig(recipes=["fp16"], **eval_kw),
                        cache_dir=str(tmp_path / "cache"))
        cfg.traces.reservoir_size = 64
        cfg.codebooks.lloyd_check = False
        cfg.export.enabled = cfg.check.enabled = False
        cfg.sensitivity.enabled = cfg.probes.enabled = cfg.gate.enabled = False
        logs = []
        out = run_pipeline(cfg, tmp_path / f"run{len(eval_kw)}", log=logs.append, show_progress=False)
        return out, logs

    first, _ = run()
    second, logs = run(perturb_seeds=[1, 2], perturb_scale=0.01)
    status = {r.name: r.status for r in second["runner"].records}
    assert status["traces"] == "cached" and status["evaluate"] == "computed", logs
    a = first["summary"]["evaluation"]["recipes"]["kvquant-4b-1pct"]
    b = second["summary"]["evaluation"]["recipes"]["kvquant-4b-1pct"]
    assert "ppl_seeds" not in a and len(b["ppl_seeds"]) == 2
    assert b["ppl"] != a["ppl"]
    assert second["summary"]["evaluation"]["perturb_seeds"] == [1, 2]


def test_stage_names_are_the_declared_names_with_their_suffix_only():
    """One instance per calibration group or option carries a suffix; the single drift map and probes do not."""
    names = [s.name for s in stage_graph(_cfg(), validate_run(_cfg()))]
    assert "sensitivity" in names and "probes" in names and "sensitivity-calib-kvquant-2b-1pct" in names
    assert not [n for n in names if n.endswith("-")], names
