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
