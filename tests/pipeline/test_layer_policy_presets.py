"""layer_policy=long-3b / long-3.5b / long-2.5b and the -sliding siblings (conf/layer_policy/) as a user meets them:
composed from the command line, on a model folder of their own, the run exports the mixed per-layer policy, its
runtime check passes, and `check` passes on the artifact again."""
import json
from pathlib import Path

import pytest

from pipeline.config import load_recipe

from tests.pipeline.test_user_path import SMALL, after, kvcalib, own_model  # noqa: F401 (the fixture)


@pytest.mark.parametrize("name, budget, recent", [("long-3b", 2.95, 128), ("long-3.5b", 3.45, 128),
                                                  ("long-2.5b", 2.45, 32), ("long-3b-sliding", 2.75, 32),
                                                  ("long-3.5b-sliding", 3.2, 32)])
def test_the_presets_compose_and_validate(name, budget, recent):
    from hydra import compose, initialize_config_dir

    from pipeline.config import register_configs, to_typed, validate_run
    from pipeline.preflight import CONF_DIR
    from stages.recipe import is_exportable_recipe

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = to_typed(compose(config_name="config", overrides=[f"layer_policy={name}", "model=tiny"]))
    lp = cfg.layer_policy
    assert (lp.enabled, lp.budget, lp.seq_len) == (True, budget, 8192)
    assert len(lp.options) == (11 if name == "long-2.5b" else 8)   # long-2.5b: three with rotated, clipped values
    assert any(n.endswith("+rotclipv") for n in lp.options) == (name == "long-2.5b")
    assert {f"kvquant-k3v2-1pct+sink16+recent{recent}", f"kvquant-2b+sink16+recent{recent}"} <= set(lp.options)
    # the full-context layers' options (long-3.5b-sliding: none with both sides at 2 bits) are some of the options
    assert set(lp.full_context_options) <= set(lp.options)
    assert not any(n.startswith("kvquant-2b") for n in lp.full_context_options)
    assert bool(lp.full_context_options) == (name == "long-3.5b-sliding")
    validate_run(cfg)
    recipes = [load_recipe(n) for n in lp.options]
    assert all(is_exportable_recipe(q) for q in recipes)
    # one family: the policy assembles layers of options that share the RoPE stage, sinks and recent rows
    assert {(q.key_rope, q.n_sink, q.residual) for q in recipes} == {("pre", 16, recent)}


def test_a_user_runs_the_preset_on_their_model_and_gets_a_checked_mixed_artifact(own_model, tmp_path):  # noqa: F811
    # the budget counted at 4096 tokens (at 8192 the options differ less in the test's 2-layer model's bits)
    run = kvcalib(["run", "model=llama3", f"model.path={own_model}", "layer_policy=long-3b",
                   "layer_policy.seq_len=4096", "layer_policy.budget=4.0", f"tracking.uri=sqlite:///{tmp_path}/m.db",
                   *SMALL], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    artifact = Path(after("check it again (never modifies it):  kvcalib check", run.stdout))
    artifact = artifact if artifact.is_absolute() else tmp_path / artifact
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["runtime_check"]["status"] == "passed"
    summary = json.loads((artifact.parent / "summary.json").read_text())
    lp = summary["mixed"]["layer_policy"]
    # within the budget as stages.layer_policy.choose accepts it: its float sum of bits may exceed 4.0 by 1e-12
    assert lp["seq_len"] == 4096 and lp["predicted_avg_bits"] <= 4.0 + 1e-12, lp["predicted_avg_bits"]
    # the artifact holds, layer by layer, the option the policy chose: keys and values at its bits
    for layer, option in zip(manifest["layers"], lp["choice"]):
        q = load_recipe(option)
        assert (layer["key"]["bits"], layer["value"]["bits"]) == (q.key.bits, q.value.bits), option
    check = kvcalib(["check", str(artifact)], tmp_path)
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
