import math
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from exporters.codec import CachePolicy, TensorPolicy
from exporters.rope import apply_rope
from stages.prefix_tokens import PrefixConfig
from stages import evaluate, prefix_tokens
from stages.hooks import rope_tables

BOS = 1

# Two samples, two layers, top-K = 4 per (sample, layer), ratios sorted as the traces store them.
# Sample 0 holds token 5 at position 0, 7 at 3, 9 at 4, 11 at 6; sample 1 holds 8 at 0, 7 at 2, 3 at 5, 9 at 7, 4 at 9.
RATIO = torch.tensor([[[100.0, 80.0, 70.0, 2.0], [200.0, 66.0, 2.0, 1.0]],
                      [[90.0, 65.0, 64.0, 1.0], [300.0, 70.0, 1.0, 1.0]]])
TOKEN = torch.tensor([[[5, 7, 9, 11], [5, 9, 11, 7]],
                      [[8, 7, 3, 4], [8, 9, 3, 4]]])
POS = torch.tensor([[[0, 3, 4, 6], [0, 4, 6, 3]],
                    [[0, 2, 5, 9], [0, 7, 5, 9]]])


def _discover(**kw):
    return prefix_tokens.discover(RATIO, TOKEN, POS, BOS, PrefixConfig(**kw))


def test_discovery_rule_by_hand():
    # outliers (ratio > 64; 64 itself is not): layer 0 counts 3 and 2 -> mean 2.5; layer 1 counts 2 and 2 -> 2.
    # n = ceil(2.5) = 3. Frequencies outside position 0: token 9 x3, token 7 x2 (5 and 8 only at position 0).
    ids, meta = _discover()
    assert meta["n_found"] == 3 and meta["mean_outliers_per_layer"] == [2.5, 2.0] and meta["outlier_layer"] == 0
    assert meta["frequency"] == {"9": 3, "7": 2}
    assert ids == [9, 7, BOS] and meta["n_used"] == 2  # fewer distinct outlier tokens than n: those there are


def test_the_cap_truncates_the_discovered_count():
    ids, meta = _discover(max_tokens=1)
    assert ids == [9, BOS] and meta["n_found"] == 3 and meta["n_used"] == 1


def test_explicit_count_and_bos_only_prefix():
    assert _discover(n_tokens=1)[0] == [9, BOS]
    assert _discover(n_tokens=0)[0] == [BOS]  # IntactKV's [BOS] pivot


def test_ties_go_to_the_smaller_id_and_a_higher_eta_finds_fewer():
    ids, meta = _discover(eta=75.0)  # outliers: 100, 80 | 200 | 90 | 300 -> counts 2,1 and 1,1 -> n = ceil(1.5) = 2
    assert meta["n_found"] == 2 and ids == [7, BOS]


def test_saturated_top_k_is_reported():
    ratio = torch.full((1, 1, 4), 100.0)
    _, meta = prefix_tokens.discover(ratio, torch.tensor([[[3, 4, 5, 6]]]), torch.tensor([[[0, 1, 2, 3]]]), BOS,
                                     PrefixConfig(max_tokens=4))
    assert meta["saturated"] == 1 and meta["n_found"] == 4


@pytest.mark.parametrize("eta", [1.0, 0.5, -3.0])
def test_eta_at_most_one_is_refused(eta):
    with pytest.raises(ValueError, match=rf"prefix.eta must be > 1 \(a ratio to the median\), got {eta}"):
        _discover(eta=eta)


def test_a_tokenizer_without_bos_is_refused():
    with pytest.raises(ValueError, match=r"the tokenizer has no BOS token \(bos_token_id is None\)"):
        prefix_tokens.discover(RATIO, TOKEN, POS, None, PrefixConfig())


def test_a_prefix_longer_than_the_cap_is_refused():
    with pytest.raises(ValueError, match="prefix.n_tokens=3 asks for a prefix longer than the cap prefix.max_tokens=2"):
        _discover(n_tokens=3, max_tokens=2)


def test_a_cap_beyond_what_the_traces_keep_is_refused():
    with pytest.raises(ValueError, match=r"prefix.max_tokens must be in \[0, traces.down_top_k=4\].*got 5"):
        _discover(max_tokens=5)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _check_injection(lm, window):
    ids = torch.tensor([window[5].item(), window[9].item(), lm.spec.bos_token_id])
    kv = prefix_tokens.prefix_kv(lm.model, lm.spec, ids)
    n_layers, h, p, d = kv["k_post"].shape
    assert (n_layers, h, p, d) == (lm.spec.n_layers, lm.spec.n_kv_heads, 3, lm.spec.head_dim)
    rope = rope_tables(lm.model, ids[None])
    assert _rel(apply_rope(kv["k_pre"], rope["cos"], rope["sin"]), kv["k_post"]) < 1e-5
    cache = DynamicCache()
    for layer in range(n_layers):
        cache.update(kv["k_post"][layer][None], kv["v"][layer][None], layer)
    with torch.no_grad():
        injected = lm.model(window[None], cache=cache, use_cache=True).logits[0]
        joint = lm.model(torch.cat([ids, window])[None], use_cache=False).logits[0, p:]
        plain = lm.model(window[None], use_cache=False).logits[0]
    assert _rel(injected, joint) < 1e-5
    assert _rel(plain, joint) > 1e-3  # the prefix does change the computation: the check can fail


def test_injected_prefix_kv_equals_running_the_prefix_tiny(tiny, tiny_windows):
    _check_injection(tiny, tiny_windows.eval[0, :32])


@pytest.mark.slow
def test_injected_prefix_kv_equals_running_the_prefix_embedded(smollm2, tiny_windows):
    _check_injection(smollm2, tiny_windows.eval[0, :64])  # tiny_windows: the embedded tokenizer's ids


def test_evaluation_serves_windows_after_the_prefix(tiny, tiny_windows):
    w = tiny_windows.eval  # [2, 48]
    n_layers = tiny.spec.n_layers
    fp16, int2 = TensorPolicy(format="fp16", bits=16), TensorPolicy(format="uniform", bits=2, axis="token")
    ids = torch.tensor([w[0, 3].item(), BOS])
    pol = lambda name, p, **kw: CachePolicy(name=name, layers=[(p, p)] * n_layers, **kw)  # noqa: E731
    policies = [pol("fp16", fp16), pol("fp16+prefix", fp16, prefix_ids=ids, prefix_len=2),
                pol("codec+prefix", fp16, prefix_ids=ids, prefix_len=2, smooth=torch.ones(n_layers, 2, 16)),
                pol("int2+prefix", int2, prefix_ids=ids, prefix_len=2, n_sink=1)]
    r = evaluate.fit(evaluate.Inputs(tiny.model, tiny.spec, w, policies)).meta["recipes"]
    assert r["fp16+prefix"]["kl"] > 1e-4                      # the prefix's own context effect, against plain fp16
    assert r["fp16+prefix"]["avg_bits"] == 16
    assert abs(r["codec+prefix"]["kl"] - r["fp16+prefix"]["kl"]) < 1e-4   # fp16 codec path: rounding only
    # ledger: the 2 prefix rows (which replace the 1 sink row) at 16 bits, 48 rows at int2 (2 + 32/16 bits)
    assert r["int2+prefix"]["avg_bits"] == pytest.approx((2 * 16 + 48 * 4) / 50)
    with torch.no_grad():  # the fp16+prefix row is exactly the model run on prefix + window
        logp = torch.log_softmax(tiny.model(torch.cat([ids[None].expand(2, -1), w], 1)).logits[:, 2:], -1)
    nll = -logp[:, :-1].gather(2, w[:, 1:, None]).sum()
    assert math.isclose(r["fp16+prefix"]["ppl"], math.exp(float(nll) / (2 * 47)), rel_tol=1e-5)


def test_prefix_recipes_calibrate_on_the_rows_after_the_prefix(tiny):
    """The graph: discovery on the plain traces, a second traces run with the prefix prepended, key stages that
    skip the prefix rows and fit K / lambda for smoothed recipes."""
    from pipeline.app import run_pipeline
    from pipeline.config import DataConfig, ModelConfig, RunConfig, load_recipe
    from stages.evaluate import EvalConfig
    from stages.traces import TracesConfig

    names = ["kvquant-3b-1pct+smooth+prefix", "fp16", "fp16+prefix"]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = RunConfig(model=ModelConfig(name="tiny", source="tiny"),
                        data=DataConfig(n_samples=2, seq_len=32, eval_n_samples=1, eval_seq_len=32),
                        quant=load_recipe(names[0]), eval=EvalConfig(recipes=names), cache_dir=f"{tmp}/cache",
                        traces=TracesConfig(reservoir_size=64), prefix=PrefixConfig(n_tokens=2))
        cfg.export.enabled = cfg.check.enabled = False  # the calibration graph and evaluation are what is tested
        cfg.sensitivity.enabled = cfg.probes.enabled = cfg.gate.enabled = False
        out = run_pipeline(cfg, Path(tmp) / "run", log=lambda _: None, show_progress=False)
    res, meta = out["results"], out["summary"]["stage_meta"]
    ids = res["prefix_tokens"].tensors["ids"]
    p = ids.numel()
    assert ids[-1] == BOS and meta["prefix_tokens"]["tokenizer_sha256"] == tiny.spec.tokenizer_sha256
    t = res["traces-prefix"].tensors
    assert meta["traces-prefix"]["seq_len"] == 32 + p and (t["res_pos"] < p).any()
    keep = t["res_pos"] >= p
    scales = res["key_scales-f0.01-s1-pre-smooth-prefix"]
    assert scales.meta["rows"] == int(keep.sum()) and scales.meta["n_sink"] == p
    smoothed = t["res_k"][keep] / res["smooth"].tensors["smooth"][None]
    expect = torch.quantile(smoothed.flatten(1), 1 - 0.01 / 2, dim=0).view(smoothed.shape[1:])
    assert torch.allclose(scales.tensors["upper"], expect)
    rows = out["summary"]["evaluation"]["recipes"]
    # the prefix's real context effect (1.8e-3 nats here), not the sign of float32 rounding (~1e-9): a prefix
    # that changed nothing would give a KL of either sign, and `> 0` would pass or fail by the CPU
    assert set(rows) == set(names) and rows["fp16+prefix"]["kl"] > 1e-4, rows["fp16+prefix"]["kl"]


@pytest.mark.parametrize("override,pattern", [
    ({"smooth": {"alpha": 2.0}}, r"smooth.alpha must be in \[0, 1\], got 2.0"),
    ({"prefix": {"eta": 1.0}}, r"prefix.eta must be > 1"),
    ({"prefix": {"n_tokens": 5}}, r"prefix.n_tokens=5 asks for a prefix longer than the cap prefix.max_tokens=4"),
])
def test_bad_input_is_refused_by_the_validation_pass(override, pattern):
    """Before anything loads (pipeline.config.validate_run, the first thing run_pipeline does)."""
    from pipeline.config import RunConfig, load_recipe, validate_run
    from stages.smooth_attention import SmoothConfig

    cfg = RunConfig(quant=load_recipe("kvquant-3b-1pct+smooth+prefix"),
                    smooth=SmoothConfig(**override.get("smooth", {})), prefix=PrefixConfig(**override.get("prefix", {})))
    with pytest.raises(ValueError, match=pattern):
        validate_run(cfg)


def test_a_tokenizer_without_bos_is_refused_before_any_stage_runs(tiny, tmp_path, monkeypatch):
    from dataclasses import replace

    import pipeline.app as app
    from pipeline.config import RunConfig, load_recipe
    from pipeline.errors import UserError
    from pipeline.model import LoadedModel

    lm = LoadedModel(tiny.model, tiny.tokenizer, replace(tiny.spec, bos_token_id=None))
    monkeypatch.setattr(app, "load_model", lambda cfg: lm)
    cfg = RunConfig(quant=load_recipe("kvquant-3b-1pct+smooth+prefix"), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(UserError, match=r"tokenizer of model tiny has no BOS token"):
        app.run_pipeline(cfg, tmp_path / "run", log=lambda _: None, show_progress=False)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()
