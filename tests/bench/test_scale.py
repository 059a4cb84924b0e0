"""bench/scale.py: the per-layer cost model on hand-made numbers (fit, scaling to 70B, anchoring, the GPU layout)
and the JSON it writes; no pipeline run (measure() is replaced by made-up runs)."""
import json

import pytest

from bench import scale
from pipeline.shapes import PRESETS

MB = 2 ** 20
P8, P70 = PRESETS["llama3-8b"], PRESETS["llama3-70b"]


def test_parameter_counts_are_the_real_models():
    assert scale.layer_params(P8) == 218_112_000
    assert scale.fixed_params(P8) == 2 * 128256 * 4096 + 4096
    assert scale.fixed_params(P8) + 32 * scale.layer_params(P8) == 8_030_261_248      # Llama-3-8B: 8.03B
    assert scale.fixed_params(P70) + 80 * scale.layer_params(P70) == 70_553_706_496   # Llama-3-70B: 70.55B
    assert abs(scale.layer_params(P70) / scale.layer_params(P8) - 3.92) < 0.01


def test_fit_linear():
    assert scale.fit_linear([(1, 12.0), (2, 17.0)]) == pytest.approx((7.0, 5.0))
    assert scale.fit_linear([(1, 1.0), (2, 3.0), (3, 2.0)]) == pytest.approx((1.0, 0.5))  # least squares
    with pytest.raises(ValueError, match=r"two or more distinct n_layers, got \[2\]"):
        scale.fit_linear([(2, 1.0), (2, 2.0)])


BASE = 500.0                       # the process before the model
A_FIXED = {"fisher": 3000.0, "codebooks-f0.01-s1-pre": 100.0}
A_LAYER = {"fisher": 200.0, "codebooks-f0.01-s1-pre": 40.0}
WALL = {"fisher": (10.0, 5.0), "codebooks-f0.01-s1-pre": (1.0, 0.5)}


def _rss(stage, preset, n_layers):
    """The cost model's own form, for made-up activations: what a measurement would read."""
    return (BASE + scale.weight_mb(scale.fixed_params(preset)) + A_FIXED[stage]
            + n_layers * (scale.weight_mb(scale.layer_params(preset)) + A_LAYER[stage]))


def _rows(n_layers, preset="llama3-8b"):
    return [{"preset": preset, "n_layers": n_layers, "stage": s, "status": "computed",
             "wall_s": WALL[s][0] + WALL[s][1] * n_layers, "peak_rss_mb": _rss(s, PRESETS[preset], n_layers)}
            for s in WALL]


def test_the_8b_prediction_is_the_fitted_line():
    fits = scale.fit_stages(_rows(1) + _rows(2))
    assert fits["fisher"]["wall"] == pytest.approx((10.0, 5.0))
    pred = scale.predict(fits, BASE, "llama3-8b", 32, PRESETS)
    f = pred["stages"]["fisher"]
    assert f["wall_s"] == pytest.approx(10 + 5 * 32)
    assert f["peak_rss_mb"] == pytest.approx(_rss("fisher", P8, 32))
    assert f["activation_fixed_mb"] == pytest.approx(3000.0) and f["activation_layer_mb"] == pytest.approx(200.0)
    assert pred["wall_s"] == pytest.approx(10 + 5 * 32 + 1 + 0.5 * 32)
    assert pred["peak_rss_mb"] == pytest.approx(_rss("fisher", P8, 32))
    assert pred["weights_mb"] == pytest.approx(8_030_261_248 * 2 / MB)
    # one GPU: everything but the host process; 15.0 GiB of weights + 3000 + 32 x 200 MB fits in 80 GiB
    assert f["n_gpus"] == 1 and f["peak_gpu_mb"] == pytest.approx(_rss("fisher", P8, 32) - BASE)


def test_70b_scales_model_stages_by_size_and_kv_stages_not():
    fits = scale.fit_stages(_rows(1) + _rows(2))
    pred = scale.predict(fits, BASE, "llama3-70b", 80, PRESETS)
    r_layer = scale.layer_params(P70) / scale.layer_params(P8)
    r_fixed = scale.fixed_params(P70) / scale.fixed_params(P8)
    f, c = pred["stages"]["fisher"], pred["stages"]["codebooks-f0.01-s1-pre"]
    assert f["wall_s"] == pytest.approx(10 * r_fixed + 80 * 5 * r_layer)
    assert f["activation_layer_mb"] == pytest.approx(200.0 * 2)           # x hidden ratio 8192 / 4096
    assert f["peak_rss_mb"] == pytest.approx(BASE + scale.weight_mb(scale.fixed_params(P70)) + 3000
                                             + 80 * (scale.weight_mb(scale.layer_params(P70)) + 400))
    assert c["wall_s"] == pytest.approx(1 + 80 * 0.5) and c["activation_layer_mb"] == pytest.approx(40.0)
    assert pred["scaled_from"] == "llama3-8b" and pred["anchored"] == []
    assert pred["weights_mb"] / 1024 > 80 and pred["n_gpus"] >= 2    # 131 GiB of bf16 weights: not one GPU
    for st in pred["stages"].values():  # one device_map for the run: every stage on the hungriest stage's GPUs
        assert st["n_gpus"] <= pred["n_gpus"] and st["peak_gpu_mb"] <= scale.GPU_MB
    assert pred["peak_gpu_mb"] == max(st["peak_gpu_mb"] for st in pred["stages"].values())


def test_70b_anchored_on_a_measured_layer():
    fits = scale.fit_stages(_rows(1) + _rows(2))
    measured = {"fisher": {"n_layers": 1, "wall_s": 50.0, "peak_rss_mb": 9000.0}}
    pred = scale.predict(fits, BASE, "llama3-70b", 80, PRESETS, anchor=measured)
    r_layer = scale.layer_params(P70) / scale.layer_params(P8)
    f = pred["stages"]["fisher"]
    assert f["wall_s"] == pytest.approx(50 + 79 * 5 * r_layer)
    assert f["peak_rss_mb"] == pytest.approx(9000 + 79 * (scale.weight_mb(scale.layer_params(P70)) + 400))
    assert pred["anchored"] == ["fisher"]


def test_70b_fitted_on_its_own_runs_needs_no_scaling():
    rows = _rows(1, "llama3-70b") + _rows(2, "llama3-70b")
    pred = scale.predict(scale.fit_stages(rows, "llama3-70b"), BASE, "llama3-70b", 80, PRESETS, fit_preset="llama3-70b")
    assert pred["stages"]["fisher"]["wall_s"] == pytest.approx(10 + 5 * 80)
    assert pred["stages"]["fisher"]["peak_rss_mb"] == pytest.approx(_rss("fisher", P70, 80))
    assert pred["scaled_from"] is None


def test_gpu_layout_splits_layers_and_keeps_the_vocabulary_on_the_last_gpu():
    # 10 layers of 10 GiB + 1 GiB activations, embedding 2 GiB, lm_head 2 GiB, 5 GiB of logits
    g, peak = scale.gpu_layout(10, 10240, 1024, 2048, 2048, 5120, gpu_mb=80 * 1024)
    assert g == 2 and peak == pytest.approx(5 * 11264 + 2048 + 5120)
    assert scale.gpu_layout(1, 1024, 0, 1024, 1024, 0, gpu_mb=80 * 1024) == (1, 3072)


def test_main_writes_the_json_the_issue_asks_for(tmp_path, monkeypatch, capsys):
    def fake_measure(args, preset, n_layers):
        rows = [r for r in _rows(n_layers, preset)]
        return {"base_rss_mb": BASE, "wall_s": 1.0, "rows": rows}

    monkeypatch.setattr(scale, "measure", fake_measure)
    out = tmp_path / "scale.json"
    scale.main(["--json", str(out), "--seq-len", "64"])
    res = json.loads(out.read_text())
    assert {(r["preset"], r["n_layers"]) for r in res["measured"]} == {("llama3-8b", 1), ("llama3-8b", 2),
                                                                       ("llama3-70b", 1)}
    for r in res["measured"]:
        assert {"n_layers", "stage", "wall_s", "peak_rss_mb"} <= set(r)
    assert set(res["predicted"]) == {"llama3-8b", "llama3-70b"}
    for p in res["predicted"].values():
        assert {"wall_s", "peak_rss_mb", "peak_gpu_mb"} <= set(p) and all(p[k] > 0 for k in ("wall_s", "peak_rss_mb"))
    assert res["predicted"]["llama3-70b"]["anchored"] and res["settings"]["seq_len"] == 64
    text = capsys.readouterr().out
    assert "MEASURED" in text and "PREDICTED llama3-8b" in text and "PREDICTED llama3-70b" in text
    assert "> host RAM" in text  # 70B's 131 GiB of weights on this machine


def test_layers_need_two_depths():
    with pytest.raises(SystemExit, match=r"--layers needs 2 or more distinct n_layers >= 1, got '2'"):
        scale.main(["--layers", "2"])
    with pytest.raises(SystemExit, match=r"--layers-70b must be comma-separated integers"):
        scale.main(["--layers-70b", "one"])
