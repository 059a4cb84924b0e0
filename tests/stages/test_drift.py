import pytest
import torch

from exporters.codec import CachePolicy, TensorPolicy
from stages.gate import GateConfig
from stages.probes import ProbeConfig
from stages.sensitivity import SensitivityConfig
from stages import gate, layer_policy, probes, sensitivity

INT2 = TensorPolicy(format="uniform", bits=2, axis="token")
FP16 = TensorPolicy()


def test_bucket_index():
    assert sensitivity.bucket_index(6, [0, 2, 5]).tolist() == [0, 0, 1, 1, 1, 2]


def test_isolate_quantizes_one_layer_only():
    p = CachePolicy("int2", [(INT2, INT2)] * 3, n_sink=1)
    iso = sensitivity.isolate(p, 1, "k")
    assert [(k.format, v.format) for k, v in iso.layers] == [("fp16", "fp16"), ("uniform", "fp16"), ("fp16", "fp16")]
    assert iso.n_sink == 1


def test_sensitivity_on_tiny_model(tiny, tiny_windows):
    p = CachePolicy("int2", [(INT2, INT2)] * tiny.spec.n_layers)
    r = sensitivity.fit(sensitivity.Inputs(tiny.model, tiny.spec, tiny_windows.eval, p), SensitivityConfig(n_windows=1, buckets=[0, 16, 32]))
    t = r.tensors
    assert t["kl"].shape == (3, 2) and t["map_cos"].shape == (2, 3)
    assert (t["kl"] >= -1e-6).all() and (t["map_cos"] <= 1 + 1e-5).all()
    # quantizing K and V of a layer costs at least as much as nothing: strictly positive KL
    assert (t["kl"][2] > 0).all()


def test_sensitivity_replaying_the_layers_before_the_isolated_one_equals_computing_them(tiny, tiny_windows,
                                                                                       monkeypatch):
    """Layers before the isolated one are replayed from one recorded full-precision forward: every figure equals
    the one computed with every layer run (REPLAY_BUDGET_BYTES 0 turns the replay off)."""
    p = CachePolicy("int2", [(INT2, INT2)] * tiny.spec.n_layers, n_sink=1, key_rope="pre")
    cfg = SensitivityConfig(n_windows=1, buckets=[0, 16, 32], variants=["k", "v", "kv"])
    inputs = sensitivity.Inputs(tiny.model, tiny.spec, tiny_windows.eval, p)
    replayed = sensitivity.fit(inputs, cfg).tensors
    monkeypatch.setattr(sensitivity, "REPLAY_BUDGET_BYTES", 0)
    assert sensitivity.record_layer_outputs(tiny.model, tiny_windows.eval[:1], p, {}) is None
    computed = sensitivity.fit(inputs, cfg).tensors
    assert replayed.keys() == computed.keys()
    for name in computed:
        assert torch.equal(replayed[name], computed[name]), name
    assert (computed["kl"][2] > 0).all()  # the isolated layers did quantize


def test_greedy_allocation_hand_checked():
    # layer 0 is sensitive, layer 1 is not: under a budget between the options, layer 1 goes down first
    opts = [layer_policy.Option("4b", 4.0, torch.tensor([0.0, 0.0])),
            layer_policy.Option("2b", 2.0, torch.tensor([1.0, 0.1]))]
    assert layer_policy.choose(opts, budget=3.0) == [0, 1]
    assert layer_policy.choose(opts, budget=4.0) == [0, 0]
    assert layer_policy.choose(opts, budget=2.0) == [1, 1]
    with pytest.raises(ValueError, match="below the cheapest option"):
        layer_policy.choose(opts, budget=1.0)


def test_assemble_mixes_layers_and_refuses_other_families():
    a = CachePolicy("a", [(INT2, INT2)] * 2, key_rope="pre", n_sink=1)
    b = CachePolicy("b", [(FP16, FP16)] * 2, key_rope="pre", n_sink=1)
    mixed = layer_policy.assemble([a, b], [1, 0], "mixed")
    assert mixed.layers[0][0].format == "fp16" and mixed.layers[1][0].format == "uniform"
    with pytest.raises(ValueError, match="must share key_rope"):
        layer_policy.assemble([a, CachePolicy("c", [(FP16, FP16)] * 2, key_rope="post")], [0, 1], "x")


def test_gate_names_the_offending_cell():
    cfg = GateConfig(max_ppl_ratio=1.05, max_cell_kl=0.05, min_cell_cos=0.95, min_passkey_ratio=1.0)
    evaluation = {"fp16": {"ppl": 10.0, "ppl_ratio": 1.0}, "r": {"ppl": 10.2, "ppl_ratio": 1.02}}
    sens = {"bucket_edges": [0, 128, 512], "map_kl": [[0.01, 0.02, 0.01], [0.01, 0.09, 0.01]],
            "map_cos": [[0.99, 0.99, 0.99], [0.99, 0.99, 0.99]]}
    out = gate.check(cfg, "r", evaluation, sens, {"fp16": 1.0, "r": 1.0})
    assert not out["passed"] and out["failures"] == ["layer 1 positions 128-512: KL 0.0900 > max_cell_kl 0.05"]
    ok = gate.check(cfg, "r", evaluation, None, {"fp16": 0.8, "r": 0.8})
    assert ok["passed"]
    bad = gate.check(cfg, "r", {"r": {"ppl": 11.0, "ppl_ratio": 1.1}}, None, {"fp16": 1.0, "r": 0.6})
    assert len(bad["failures"]) == 2 and "perplexity ratio 1.1000" in bad["failures"][0]
    with pytest.raises(ValueError, match="has no ppl_ratio to fp16"):  # never skipped silently
        gate.check(cfg, "r", {"r": {"ppl": 11.0}}, None, None)


def test_passkey_prompt_plants_the_needle(tiny):
    prompt, answer = probes.passkey_prompt(tiny.tokenizer, 300, 0.5, 12345)
    text = tiny.tokenizer.decode(prompt)
    assert "The pass key is 12345" in text and text.endswith("The pass key is")
    assert abs(len(prompt) + len(answer) - 300) < 40 and "12345" in tiny.tokenizer.decode(answer)
    assert 0.3 < text.index("12345") / len(text) < 0.7


def test_probes_on_tiny_model(tiny):
    cfg = ProbeConfig(lengths=[96], depths=[0.5])
    prompts = probes.make_prompts(tiny.tokenizer, cfg)
    r = probes.fit(probes.Inputs(tiny.model, tiny.spec, prompts, [CachePolicy("int2", [(INT2, INT2)] * tiny.spec.n_layers)]), cfg)
    assert set(r.meta["accuracy"]) == {"fp16", "int2"} and r.meta["cells"]["fp16"].keys() == {"96@0.5"}
