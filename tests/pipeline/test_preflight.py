"""pipeline/preflight.py: the schema it reads from the dataclasses' source is the dataclasses' own; its rule for
the recipes a run exports is the stages'; its messages, sweeps and path checks on hand-checkable inputs."""
import dataclasses
import typing

import pytest

from pipeline import preflight
from pipeline.config import RunConfig, load_recipe, register_configs, to_typed
from pipeline.errors import UserError
from stages.recipe import is_exportable_recipe


def _keys_of(cls) -> dict:
    """{name: (nested keys or None, default or NO_DEFAULT)} from the dataclasses themselves."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        nested = _keys_of(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else None
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING and nested is None:
            default = f.default_factory()
        else:
            default = preflight.NO_DEFAULT
        out[f.name] = (nested, default)
    return out


def _keys_read(keys: dict) -> dict:
    return {name: (None if k.children is None else _keys_read(k.children), k.default) for name, k in keys.items()}


def test_the_schema_read_from_source_is_the_dataclasses():
    """Every key in order, which ones are groups of keys, and each literal default -- the whole RunConfig."""
    assert _keys_read(preflight.schema()) == _keys_of(RunConfig)
    assert preflight.schema_key("quant.key.bits").default == 16
    assert preflight.schema_key("check.contexts").default == [64, 200]
    assert preflight.schema_key("model.tiny").children is not None and preflight.schema_key("model.nope") is None


def test_exportable_recipes_are_the_stages_rule():
    """The YAML-level rule (no torch-heavy stage import at the command line) agrees with
    stages.recipe.is_exportable_recipe on every recipe of conf/quant, and both kinds occur."""
    names = preflight.group_options("quant")
    assert set(preflight.exportable_recipes()) == {n for n in names if is_exportable_recipe(load_recipe(n))}
    assert {"kvquant-4b-1pct", "fp8-e4m3", "kivi-2"} <= set(preflight.exportable_recipes())
    assert not {"kvquant-4b+rot", "hf-hqq-4", "vllm-int8-per-token-head"} & set(preflight.exportable_recipes())


def test_unknown_key_message():
    assert preflight.unknown_key_message("data.n_sampel", ["n_samples", "seq_len"]) == (
        "unknown key data.n_sampel; did you mean data.n_samples? valid keys of data: n_samples, seq_len")
    assert preflight.unknown_key_message("zzz", ["model", "data"]) == (
        "unknown key zzz; valid keys of the config: model, data")


def test_a_long_option_list_is_pointed_to_not_printed():
    """A misspelled option: the suggestion, then the options while they are few, or where they are listed (a line of
    74 recipe names buried the suggestion)."""
    assert preflight.listing(["a", "b"], "data options") == "data options: a, b"
    many = [f"r{i}" for i in range(preflight.LISTED_AT_MOST + 1)]
    assert preflight.listing(many, "recipes") == "`kvcalib run --help` lists the recipes"
    assert preflight.unknown_option_message("quant", "kvqant-4b") == (
        "unknown recipe quant=kvqant-4b (no conf/quant/kvqant-4b.yaml); did you mean kvquant-4b or kvquant-3b or "
        "kvquant-2b? (near but evaluation-only, for eval.recipes=[...]: kvquant-4b+rot, kvquant-4b-1pct+rot) "
        "`kvcalib run --help` lists the recipes a run exports")
    assert preflight.unknown_option_message("data", "lokal") == (
        "unknown data data=lokal (no conf/data/lokal.yaml); did you mean local? data options: embedded, hub, local")


def test_to_typed_refuses_an_added_key_with_the_same_message():
    """`+key=value` that reaches the composed config (Hydra adds it): the schema's refusal names the nearest key."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(preflight.CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+data.n_sampels=4"])
    with pytest.raises(UserError, match=r"^unknown key data\.n_sampels; did you mean data\.n_samples"):
        to_typed(cfg)


def test_sweep_jobs_are_the_product_of_each_sweeps_values():
    assert preflight.job_overrides(["quant=a,b", "data.n_samples=1,2", "x=1"], multirun=True) == [
        ["quant=a", "data.n_samples=1", "x=1"], ["quant=a", "data.n_samples=2", "x=1"],
        ["quant=b", "data.n_samples=1", "x=1"], ["quant=b", "data.n_samples=2", "x=1"]]
    assert preflight.job_overrides(["x=1"], multirun=False) == [["x=1"]]
    assert preflight.job_overrides(["quant=a,b"], multirun=False) is None       # Hydra refuses it without -m
    assert preflight.job_overrides(["model=glob(*)"], multirun=True) is None    # Hydra expands it


def test_a_missing_model_folder_is_called_missing(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    preflight.check_model_path("local", str(tmp_path))
    preflight.check_model_path("hub", "meta-llama/Meta-Llama-3-8B")   # a hub id: the loader looks it up
    preflight.check_model_path("embedded", "")
    for source in ("local", "gguf", "hub"):
        with pytest.raises(UserError, match=rf"^model\.path: no such folder {tmp_path}/nope \(model\.source={source}"):
            preflight.check_model_path(source, str(tmp_path / "nope"))
    with pytest.raises(UserError, match=r"^model\.path: .*weights\.bin is a file, not a folder"):
        preflight.check_model_path("local", str(tmp_path / "weights.bin"))
    with pytest.raises(UserError, match=r"^model\.path: empty; model\.source=local needs model\.path=DIR"):
        preflight.check_model_path("local", "")


def test_overrides_checked_against_schema_and_groups():
    preflight.check_run_overrides(["model=tiny", "quant=kvquant-4b-1pct", "data.n_samples=2", "+hydra.job.name=x",
                                   "hydra.run.dir=out", "eval.recipes=[fp16,kivi-2]", "check.contexts=[16]"])
    with pytest.raises(UserError, match=r"^unknown key tracking\.uir; did you mean tracking\.uri\?"):
        preflight.check_run_overrides(["tracking.uir=x"])
    with pytest.raises(UserError, match=r"^unknown recipe layer_policy\.options\[1\]=nope "):
        preflight.check_run_overrides(["layer_policy.options=[kvquant-3b-1pct,nope]"])
    with pytest.raises(UserError, match=r"^malformed override"):
        preflight.check_run_overrides(["quant=[a"])
