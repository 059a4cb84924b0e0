"""bench/serve_memory.py on the tiny model (a calibration-free recipe, no artifact): every row in its own process,
the JSON the issue asks for, a batch-B row holding B times the batch-1 cache (one window prefilled, its stored
rows repeated to the batch), and the artifact cache holding fewer bytes than the full-precision one. Text: the
embedded text (conftest.wikitext_env), not ../shared/data/wikitext-2."""
import json

from bench import serve_memory


def test_the_smoke_run_writes_every_row_and_the_batch_holds_its_copies(tmp_path, wikitext_env):
    out = tmp_path / "serve_memory.json"
    serve_memory.main(["--model", "tiny", "--recipe", "int4-token", "--contexts", "48", "--batches", "1,2",
                       "--caches", "fp16,artifact", "--steps", "2", "--chunk", "32", "--quality-contexts", "32",
                       "--quality-prompts", "1", "--continuation", "8", "--passkey-lengths", "", "--json", str(out)])
    res = json.loads(out.read_text())
    both = {(r["dtype"], r["context"], r["batch"], r["cache"]): r for r in res["rows"]}
    assert set(both) == {(t, 48, b, c) for t in ("float32", "bfloat16") for b in (1, 2) for c in ("fp16", "artifact")}
    for t in ("float32", "bfloat16"):   # each dtype's artifact row against its own DynamicCache: fewer bytes read
        art, ref = both[t, 48, 1, "artifact"], both[t, 48, 1, "fp16"]
        assert 0 < art["step_read_mb"] < ref["step_read_mb"] and art["read_ratio_to_fp16"] < 1
        assert ref["update_copy_mb"] == ref["attention_read_mb"] > 0 and art["update_copy_mb"] == 0
    assert both["float32", 48, 1, "artifact"]["kernel"] == serve_memory.kernel_route("artifact")
    rows = {k[1:]: r for k, r in both.items() if k[0] == "float32"}
    for r in rows.values():
        for key in ("peak_mb_above_weights", "prefill_s", "decode_ms_per_token"):
            assert r[key] > 0, (key, r)
        assert r["prefill_batch"] == 1
        assert r["decode_ratio_to_fp16"] > 0
    for cache in ("fp16", "artifact"):  # 48 + 2 rows per sequence, every sequence stored
        one, two = rows[48, 1, cache]["accounting_bytes"], rows[48, 2, cache]["accounting_bytes"]
        assert two["total"] == 2 * one["total"], cache
    art, ref = rows[48, 1, "artifact"], rows[48, 1, "fp16"]
    assert art["cache_mb"] < ref["cache_mb_at_fp16"]
    assert set(res) >= {"rows", "agreement_per_step_4k", "passkey", "quality", "setup"}
    assert 0 <= res["quality"]["32"]["agreement_per_step"] <= 1
    assert res["passkey"] == {"fp16": 0, "artifact": 0} and res["setup"]["passkey_prompts"] == 0


def test_an_artifact_row_beyond_the_models_positions_raises_the_bound_limit_with_it(tiny):
    # SmolLM2's 16k rows run past its 8192 positions (RoPE extrapolates): the artifact's binding records 8192, and
    # serving.cache.bind refuses any other number -- the row raises both or neither
    import dataclasses

    import pytest

    from exporters.manifest import ModelMismatchError
    from pipeline.config import load_recipe
    from stages import recipe as recipe_stage
    from stages.hooks import config_binding

    policy = recipe_stage.build_policy(load_recipe("int4-token"), tiny.spec.n_layers, {})
    policy = dataclasses.replace(policy, model=config_binding(tiny.model.config))
    limit = int(tiny.model.config.max_position_embeddings)
    with serve_memory.positions_for(tiny.model, limit + 100) as beyond:
        assert beyond
        cache = serve_memory.make_cache("artifact", tiny.model, policy, serve_memory.BLOCK, serve_memory.PAGE)
        assert cache.layers[0].max_positions == limit + 100
        from serving.cache import ArtifactCache
        with pytest.raises(ModelMismatchError, match="max_positions"):  # what the row did before
            ArtifactCache(policy, tiny.model)
    assert int(tiny.model.config.max_position_embeddings) == limit and policy.model["max_positions"] == limit
