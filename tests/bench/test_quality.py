from bench.quality import RECIPES, library_recipes_served
from pipeline.config import load_recipe


def test_default_list_drops_only_the_library_caches_the_library_refuses(capsys):
    """Gemma 3 has sliding-window layers, which transformers' QuantizedCache refuses: its hf-* peers are dropped,
    each with a printed reason; SmolLM2 (all full attention) keeps the whole list."""
    library = [n for n in RECIPES if load_recipe(n).engine.library]
    assert library  # the peers exist, so the filter has something to drop
    assert library_recipes_served(list(RECIPES), "smollm2") == list(RECIPES)
    kept = library_recipes_served(list(RECIPES), "gemma3")
    assert kept == [n for n in RECIPES if n not in library]
    out = capsys.readouterr().out
    assert all(f"{n}: not run -- transformers' QuantizedCache refuses" in out for n in library)
    assert "15 of 18 in gemma3" in out


def test_evaluation_cost_is_the_stage_wall_over_units_times_one_plain_forward(tiny, tiny_windows):
    """The ratio bench.quality prints: the evaluate stage's wall over (units x one plain forward, timed in the
    same run); a stage read from the cache has no wall, and so no ratio."""
    from types import SimpleNamespace

    from bench.quality import evaluation_cost, plain_forward_s

    assert plain_forward_s(tiny.model, tiny_windows.eval[:1]) > 0
    for status, wall in (("computed", 12.0), ("cached", 0.1)):
        out = {"runner": SimpleNamespace(records=[SimpleNamespace(name="evaluate", status=status, wall_s=wall)]),
               "model": tiny, "windows": tiny_windows, "summary": {"evaluation": {"units": 6}}}
        cost = evaluation_cost(out)
        assert cost["eval_units"] == 6 and cost["eval_forward_s"] > 0
        if status == "computed":
            assert cost["eval_wall_s"] == 12.0
            assert cost["eval_cost_ratio"] == 12.0 / (6 * cost["eval_forward_s"])
        else:
            assert cost["eval_wall_s"] is None and cost["eval_cost_ratio"] is None
    # the evaluation as the run's stages (issue 50): the reference, each recipe's, the table -- their walls summed
    parts = [SimpleNamespace(name=n, status="computed", wall_s=w) for n, w in
             (("traces", 5.0), ("evaluate-reference", 2.0), ("evaluate-recipe-fp16", 1.0),
              ("evaluate-recipe-kivi-2", 6.0), ("evaluate", 0.5), ("sensitivity", 9.0))]
    out = {"runner": SimpleNamespace(records=parts), "model": tiny, "windows": tiny_windows,
           "summary": {"evaluation": {"units": 6}}}
    assert evaluation_cost(out)["eval_wall_s"] == 9.5
    parts[3].status = "cached"  # one recipe read from the cache: the wall is not the evaluation's
    assert evaluation_cost(out)["eval_wall_s"] is None
