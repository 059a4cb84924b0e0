import math
from pathlib import Path

import pytest
import torch

from exporters.codec import CodecError
from pipeline.config import load_recipe
from stages.recipe import QuantConfig, TensorQuantConfig
from stages.traces import TracesConfig
from stages import codebooks, fisher, key_scales, outliers, recipe, traces
from stages.calibration_rows import CalibrationRows
from stages.base import NonFiniteError


def _scales(keys, pos, fraction=0.0, n_sink=1):
    return key_scales.fit(CalibrationRows(keys, keys, pos, n_sink), key_scales.KeyScalesConfig(outlier_fraction=fraction))


def _codebooks(keys, values, w, pos, scales, bits, cfg=None):
    rows = CalibrationRows(keys, values, pos, 1, fisher_k=w, fisher_v=w)
    return codebooks.fit(codebooks.Inputs(rows, scales, 0.0, bits), cfg or codebooks.CodebookConfig())


def _rows(values):  # list over reservoir rows of [L=1, H=1, D] -> [S, 1, 1, D]
    return torch.tensor(values, dtype=torch.float32)[:, None, None, :]


def test_key_scales_minmax_and_sink_exclusion():
    keys = _rows([[100.0, -100.0], [1.0, 2.0], [3.0, -2.0], [-1.0, 0.0]])
    pos = torch.tensor([0, 5, 9, 3])  # row 0 is the sink (position 0): excluded
    r = _scales(keys, pos).tensors
    assert r["lower"].flatten().tolist() == [-1.0, -2.0] and r["upper"].flatten().tolist() == [3.0, 2.0]
    assert r["zero"].flatten().tolist() == [1.0, 0.0] and r["range"].flatten().tolist() == [2.0, 2.0]


def test_key_scales_percentiles():
    keys = _rows([[float(i)] for i in range(101)])  # 0..100
    r = _scales(keys, torch.arange(1, 102), 0.1).tensors
    assert r["lower"].item() == pytest.approx(5.0) and r["upper"].item() == pytest.approx(95.0)


def test_key_scales_constant_channel_and_bad_input():
    keys = _rows([[2.0, 1.0], [2.0, 3.0]])
    r = _scales(keys, torch.tensor([4, 5]))
    assert r.tensors["range"].flatten().tolist() == [0.0, 1.0] and r.meta["constant_channels"] == 1
    with pytest.raises(ValueError, match=r"outlier_fraction must be in \[0, 0.1\], got 0.5"):
        _scales(keys, torch.tensor([4, 5]), 0.5)
    bad = keys.clone()
    bad[1, 0, 0, 1] = float("inf")
    with pytest.raises(NonFiniteError, match="calibration keys of layer 0"):
        _scales(bad, torch.tensor([4, 5]))


def test_outliers_report_the_calibration_fraction():
    keys = _rows([[0.0], [1.0], [2.0], [50.0]])
    rows = CalibrationRows(keys, keys, torch.tensor([1, 2, 3, 4]), 1)
    r = outliers.fit(outliers.Inputs(rows, torch.tensor([[[0.0]]]), torch.tensor([[[2.0]]])),
                     outliers.OutliersConfig(fraction=0.01))
    assert r.meta["calib_fraction_k"] == 0.25 and r.meta["configured_fraction"] == 0.01


def test_codebooks_fit_the_normalized_inliers():
    gen = torch.Generator().manual_seed(0)
    s, d = 400, 8
    keys = torch.randn(s, 1, 1, d, generator=gen) * 3 + 1
    values = torch.randn(s, 1, 1, d, generator=gen)
    pos = torch.arange(s) + 1
    scales = _scales(keys, pos).tensors
    w = torch.ones(s, 1, 1, d)
    r = _codebooks(keys, values, w, pos, scales, [2, 3], codebooks.CodebookConfig(n_bins=256, lloyd_check=True))
    k2, v3 = r.tensors["k_codebook_2"], r.tensors["v_codebook_3"]
    assert k2.shape == (1, 4) and v3.shape == (1, 8)
    assert (k2.abs() <= 1).all() and (k2.diff() > 0).all()
    # Gaussian keys normalized by min/max concentrate near 0: the levels are not uniform
    assert k2[0, 1] - k2[0, 0] > k2[0, 2] - k2[0, 1]
    rep = r.meta["sse"]["k2"][0]
    assert rep["sse_binned"] <= rep["sse_lloyd"] * (1 + 1e-6)
    # like for like on the same subsample: the raw optimum is never beaten, by binning or by any Lloyd init
    assert rep["sub_points"] == rep["points"] < 50_000  # a subsample of all the points is all of them
    assert rep["sub_binned"] == pytest.approx(rep["sse_binned"], rel=1e-9)
    assert rep["sub_exact"] <= rep["sub_binned"] * (1 + 1e-9)
    assert len(rep["sub_lloyd"]) == 3 and all(rep["sub_exact"] <= s * (1 + 1e-9) for s in rep["sub_lloyd"])
    with pytest.raises(ValueError, match=r"codebooks.bits must be in \(2, 3, 4\)"):
        _codebooks(keys, values, w, pos, scales, [5])


def test_codebook_weighting_counts_the_scale():
    """Channel 0 (range 1) spreads over [-1, -0.2]; channel 1 (range 100) sits at 0.2 / 0.6 / 1.0 normalized.
    Fisher alone gives channel 0 two of the four levels; Fisher x range^2 (an error in channel 1 costs 10^4 times
    more on the cached value) gives channel 1's three points a level each."""
    ch0, ch1 = [-1.0, -0.8, -0.6, -0.4, -0.2], [0.2, 0.6, 1.0]
    keys = _rows([[ch0[i % 5], 100 * ch1[i % 3]] for i in range(15)])
    values = _rows([[float(i), float(-i)] for i in range(15)])
    scales = {"zero": torch.zeros(1, 1, 2), "range": torch.tensor([[[1.0, 100.0]]])}
    scales["lower"], scales["upper"] = -scales["range"], scales["range"]
    w, pos = torch.ones(15, 1, 1, 2), torch.arange(15) + 1
    books = {}
    for weighting in ("fisher", "fisher-scale2"):
        cfg = codebooks.CodebookConfig(n_bins=1024, lloyd_check=False, weighting=weighting)
        books[weighting] = _codebooks(keys, values, w, pos, scales, [2], cfg).tensors["k_codebook_2"][0]
    assert int((books["fisher"] < 0).sum()) == 2
    assert int((books["fisher-scale2"] < 0).sum()) == 1
    assert books["fisher-scale2"][1:].tolist() == pytest.approx(ch1, abs=0.01)
    with pytest.raises(ValueError, match=r"codebooks.weighting must be one of .*got 'mse'"):
        _codebooks(keys, values, w, pos, scales, [2], codebooks.CodebookConfig(weighting="mse"))


def test_query_key_weights_average_the_group_and_the_rope_pair():
    q = torch.tensor([[[1.0, 2.0, 3.0, 6.0], [3.0, 2.0, 1.0, 2.0]]])  # [L=1, H_q=2, D=4], one key head
    w = codebooks.query_key_weights(q, 1, "rotate_half")
    # head mean [2, 2, 2, 4]; pairs (0, 2) and (1, 3): [2, 3, 2, 3]
    assert w.tolist() == [[[2.0, 3.0, 2.0, 3.0]]]
    with pytest.raises(ValueError, match="RoPE pairing must be one of"):
        codebooks.query_key_weights(q, 1, "interleaved")


def test_codebook_weighting_by_the_queries():
    """Keys: channel 0 spreads over [-1, -0.2], channel 1 sits at 0.2 / 0.6 / 1.0 (both range 1; channels 2 and 3
    constant, left out). With uniform Fisher channel 0 gets two of the four levels; when the queries that read
    channel 1 (and its RoPE partner 3) carry 10^4 times the energy, query-scale2 gives channel 1's three points a
    level each. Values keep the Fisher weighting: their codebook is the same under both."""
    ch0, ch1 = [-1.0, -0.8, -0.6, -0.4, -0.2], [0.2, 0.6, 1.0]
    keys = _rows([[ch0[i % 5], ch1[i % 3], 0.0, 0.0] for i in range(15)])
    values = _rows([[float(i), float(-i), 1.0, 2.0] for i in range(15)])
    rng = torch.tensor([[[1.0, 1.0, 0.0, 0.0]]])
    scales = {"zero": torch.zeros(1, 1, 4), "range": rng, "lower": -rng, "upper": rng}
    w, pos = torch.ones(15, 1, 1, 4), torch.arange(15) + 1
    qw = codebooks.query_key_weights(torch.tensor([[[1.0, 1e4, 1.0, 1e4]]]), 1, "rotate_half")
    cfg = {m: codebooks.CodebookConfig(n_bins=1024, lloyd_check=False, weighting=m) for m in ("fisher", "query-scale2")}
    rows = CalibrationRows(keys, values, pos, 1, fisher_k=w, fisher_v=w)
    fisher = codebooks.fit(codebooks.Inputs(rows, scales, 0.0, [2]), cfg["fisher"]).tensors
    query = codebooks.fit(codebooks.Inputs(rows, scales, 0.0, [2], qw), cfg["query-scale2"]).tensors
    assert int((fisher["k_codebook_2"][0] < 0).sum()) == 2
    assert query["k_codebook_2"][0][1:].tolist() == pytest.approx(ch1, abs=0.01)
    assert torch.equal(fisher["v_codebook_2"], query["v_codebook_2"])
    with pytest.raises(ValueError, match="query-scale2 needs the key query weights"):
        codebooks.fit(codebooks.Inputs(rows, scales, 0.0, [2]), cfg["query-scale2"])


@pytest.fixture(scope="module")
def tiny3():
    from pipeline.config import ModelConfig, TinyModelConfig
    from pipeline.model import load_model
    return load_model(ModelConfig(name="tiny", source="tiny", tiny=TinyModelConfig(n_layers=3, seed=1)))


def test_fisher_is_the_total_gradient_in_every_layer(tiny3, tiny_windows):
    """Every layer's Fisher equals the squared gradient of the un-hooked model's summed LM loss w.r.t. that
    layer's k_proj / v_proj output -- through every later layer, not only this layer's own attention."""
    spec, model = tiny3.spec, tiny3.model
    windows = tiny_windows.calib[:2]
    res_sample, res_pos = torch.tensor([0, 1, 1, 0]), torch.tensor([3, 0, 10, 40])
    r = fisher.fit(fisher.Inputs(model, spec, windows, res_sample, res_pos))
    assert r.tensors["fisher_k"].shape == (4, 3, spec.n_kv_heads, spec.head_dim)
    grads = {}
    frozen = [q for q in model.parameters() if not q.requires_grad]
    for q in frozen:  # the reference graph: plain autograd over the whole model
        q.requires_grad_(True)
    for s in range(2):
        outs = {}

        def keep(kind, layer):
            def hook(_m, _a, o):
                o.retain_grad()
                outs[(kind, layer)] = o
            return hook

        attns = [layer.self_attn for layer in model.model.layers]
        handles = [a.k_proj.register_forward_hook(keep("k", i)) for i, a in enumerate(attns)]
        handles += [a.v_proj.register_forward_hook(keep("v", i)) for i, a in enumerate(attns)]
        with torch.enable_grad():
            ids = windows[s : s + 1]
            out = model(ids, labels=ids, use_cache=False)
            (out.loss * (ids.shape[1] - 1)).backward()
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
        grads[s] = {key: o.grad[0].view(-1, spec.n_kv_heads, spec.head_dim).square() for key, o in outs.items()}
    for q in frozen:
        q.requires_grad_(False)
    for row, (s, pos) in enumerate(zip(res_sample.tolist(), res_pos.tolist())):
        for layer in range(3):
            for kind in ("k", "v"):
                got = r.tensors[f"fisher_{kind}"][row, layer]
                want = grads[s][(kind, layer)][pos]
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-12), (row, layer, kind)
                assert want.sum() > 0
    # the earlier layers' gradients differ from their own-attention-only part: the test can tell the two apart
    assert r.tensors["fisher_k"][:, 0].sum() > 0


def test_residual_must_be_a_multiple_of_the_group():
    q = load_recipe("kivi-2")
    q.residual = 100
    with pytest.raises(CodecError, match=r"quant.residual=100 must be a multiple of the key group size quant.key.group_size=32"):
        recipe.build_policy(q, 1, {})


def test_bits_outside_the_allowed_set():
    q = QuantConfig(name="x", key=TensorQuantConfig(format="uniform", bits=5, axis="token"))
    with pytest.raises(CodecError, match=r"quant.key.bits must be one of \(2, 3, 4, 8\), got 5"):
        recipe.build_policy(q, 1, {})


RECIPE_FILES = sorted((Path(__file__).resolve().parents[2] / "conf" / "quant").glob("*.yaml"))


def test_the_recipe_folder_is_found():
    """The parametrized test below runs on a real folder (an empty glob would leave it nothing to check)."""
    stems = {p.stem for p in RECIPE_FILES}
    assert {"fp16", "fp8-e4m3", "int4-token", "kivi-2", "kvquant-3b-1pct", "kvquant-4b-1pct+rot"} <= stems, stems


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.stem)
def test_every_recipe_file_loads(path):
    """Every conf/quant/*.yaml loads as a QuantConfig, is named as its file and passes the recipe's own checks."""
    q = load_recipe(path.stem)
    assert q.name == path.stem
    recipe.validate_recipe(q)


def test_an_unknown_recipe_is_refused_by_name():
    with pytest.raises(ValueError, match="quant recipe must be one of"):
        load_recipe("int7")


def test_q_norm_keeps_the_mean_and_spread_of_the_points():
    """Points 0, 1, 2, 3 with levels {0.5, 2.5}: Q(x) = 0.5, 0.5, 2.5, 2.5 has the points' mean 1.5 but std
    1.155 (sample) against 1.291; Q-Norm scales the levels about the mean by 1.291 / 1.155 = sqrt(5/4)."""
    x = torch.tensor([0.0, 1.0, 2.0, 3.0])
    levels, shift, scale = codebooks.q_norm(x, torch.tensor([0.5, 2.5]))
    assert scale == pytest.approx(math.sqrt(5 / 4))
    assert levels.tolist() == pytest.approx([1.5 - math.sqrt(5 / 4), 1.5 + math.sqrt(5 / 4)])
    q = codebooks.nearest_levels(x, levels)
    assert float(q.mean()) == pytest.approx(1.5) and float(q.std()) == pytest.approx(float(x.std()))
    same, _, unit = codebooks.q_norm(torch.ones(5), torch.tensor([0.0, 1.0]))   # no spread: unchanged
    assert unit == 1.0 and same.tolist() == [0.0, 1.0]


def test_codebooks_with_q_norm_stay_sorted_and_report_the_map():
    gen = torch.Generator().manual_seed(0)
    s, d = 400, 8
    keys, values = torch.randn(s, 1, 1, d, generator=gen) * 3 + 1, torch.randn(s, 1, 1, d, generator=gen)
    pos = torch.arange(s) + 1
    scales = _scales(keys, pos).tensors
    w = torch.ones(s, 1, 1, d)
    cfg = codebooks.CodebookConfig(n_bins=256, lloyd_check=False)
    plain = _codebooks(keys, values, w, pos, scales, [2], cfg)
    normed = _codebooks(keys, values, w, pos, scales, [2], codebooks.CodebookConfig(n_bins=256, lloyd_check=False,
                                                                                   qnorm=True))
    k_plain, k_norm = plain.tensors["k_codebook_2"][0], normed.tensors["k_codebook_2"][0]
    rep = normed.meta["sse"]["k2"][0]
    assert (k_norm.diff() > 0).all() and rep["qnorm_scale"] > 1          # quantizing shrank the spread
    assert k_norm.tolist() == pytest.approx((k_plain * rep["qnorm_scale"] + rep["qnorm_shift"]).tolist(), abs=1e-6)
    assert rep["sse_qnorm"] >= rep["sse_binned"]                         # k-means was the MSE optimum


def test_rotated_rows_and_their_fisher():
    """rows_for with rotate_k / rotate_v: the codec's rotation of each row, and each element's Fisher replaced by
    its row's mean over the Hadamard block."""
    from exporters.rotation import rotate_orthonormal
    from stages.calibration_rows import block_mean, rows_for
    gen = torch.Generator().manual_seed(0)
    tr = {"res_k": torch.randn(6, 2, 1, 8, generator=gen), "res_v": torch.randn(6, 2, 1, 8, generator=gen),
          "res_pos": torch.arange(6)}
    f = {"fisher_k": torch.rand(6, 2, 1, 8, generator=gen), "fisher_v": torch.rand(6, 2, 1, 8, generator=gen)}
    rows = rows_for(tr, "pre", None, torch.float32, 1, fisher=f, rotate_k=True)
    assert torch.equal(rows.keys, rotate_orthonormal(tr["res_k"])) and torch.equal(rows.values, tr["res_v"])
    assert torch.allclose(rows.fisher_k, f["fisher_k"].mean(-1, keepdim=True).expand(6, 2, 1, 8))
    assert torch.equal(rows.fisher_v, f["fisher_v"])
    assert block_mean(torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0, 4.0]])).tolist() == [[2.0, 2.0, 2.0, 2.0, 2.0, 2.0]]
    rows = rows_for(tr, "pre", None, torch.float32, 1, fisher=f, rotate_v=True)
    assert torch.equal(rows.values, rotate_orthonormal(tr["res_v"])) and torch.equal(rows.keys, tr["res_k"])


def test_rotated_recipes_are_evaluation_only():
    q = load_recipe("kvquant-3b-1pct+rot")
    assert q.key.rotation == q.value.rotation == "hadamard"
    assert not recipe.is_exportable_recipe(q)
    with pytest.raises(CodecError, match=r"quant\.key\.rotation: rotation hadamard is evaluation-only"):
        recipe.check_exportable_recipe(q)


@pytest.mark.parametrize("recompute", ["always"])
def test_fisher_with_layers_recomputed_equals_fisher_with_layers_held(tiny, tiny_windows, recompute):
    """Activation checkpointing (fisher.recompute) changes memory, not the gradients."""
    from stages import fisher, traces

    tr = traces.fit(traces.Inputs(tiny.model, tiny.spec, tiny_windows.calib), traces.TracesConfig(reservoir_size=64))
    inputs = fisher.Inputs(tiny.model, tiny.spec, tiny_windows.calib, tr.tensors["res_sample"], tr.tensors["res_pos"])
    held = fisher.fit(inputs, fisher.FisherConfig(recompute="never"))
    again = fisher.fit(inputs, fisher.FisherConfig(recompute=recompute))
    assert held.tensors["fisher_k"].abs().sum() > 0
    for name in ("fisher_k", "fisher_v"):
        torch.testing.assert_close(again.tensors[name], held.tensors[name], rtol=1e-6, atol=0)
    assert again.meta["mean_token_nll"] == pytest.approx(held.meta["mean_token_nll"], rel=1e-9)
    assert "forward" not in vars(tiny.model.model.layers[0])  # the layers' own forward is back


def test_fisher_recompute_is_refused_by_name(tiny, tiny_windows):
    from stages import fisher
    from stages.base import InputError

    inputs = fisher.Inputs(tiny.model, tiny.spec, tiny_windows.calib, torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(InputError, match=r"fisher.recompute must be one of \('auto', 'always', 'never'\), got 'yes'"):
        fisher.fit(inputs, fisher.FisherConfig(recompute="yes"))
