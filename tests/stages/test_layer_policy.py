"""The per-layer policy's allocation: options that are no chain (keys and values at different bits), layers of
unequal size (sliding windows), and bits predicted by the ledger rather than read from an evaluation."""
import dataclasses

import pytest
import torch

from exporters.codec import CachePolicy, TensorPolicy
from exporters.ledger import predict_bytes
from stages import layer_policy
from stages.layer_policy import Option, choose, layer_bits

INT2 = TensorPolicy(format="uniform", bits=2, axis="token")
INT4 = TensorPolicy(format="uniform", bits=4, axis="token")
FP16 = TensorPolicy()


def test_per_side_options_each_layer_takes_the_split_it_can_afford():
    # keys matter on layer 0, values on layer 1: at 3 bits each layer drops the side it does not need
    opts = [Option("4b", 4.0, torch.tensor([0.0, 0.0])),
            Option("k3v2", 3.0, torch.tensor([0.01, 0.5])),
            Option("k2v3", 3.0, torch.tensor([0.5, 0.01])),
            Option("2b", 2.0, torch.tensor([1.0, 1.0]))]
    assert choose(opts, budget=3.0) == [1, 2]
    assert choose(opts, budget=2.0) == [3, 3]
    assert choose(opts, budget=4.0) == [0, 0]
    # 3.5 bits: one layer moves; both layers' best steps cost 0.01 per 0.5 average bits: the first layer found
    assert choose(opts, budget=3.5) == [1, 0]


def test_a_step_over_an_option_that_saves_nothing_is_never_taken():
    # an option at the same bits but a higher KL is dominated: the allocation goes around it
    opts = [Option("4b", 4.0, torch.tensor([0.0])), Option("worse", 4.0, torch.tensor([0.3])),
            Option("2b", 2.0, torch.tensor([0.1]))]
    assert choose(opts, budget=4.0) == [0]
    assert choose(opts, budget=2.0) == [2]


def test_full_context_layers_take_only_their_options():
    # layer 1 is full context (window None) and looks cheap to cut at 2 bits; held to 4 / 3 bits, the budget is
    # met on the sliding layer 0 instead
    opts = [Option("4b", 4.0, torch.tensor([0.0, 0.0])),
            Option("3b", 3.0, torch.tensor([0.1, 0.2])),
            Option("2b", 2.0, torch.tensor([0.3, 0.2]))]
    free = layer_policy.LayerPolicyConfig(budget=2.5, options=["4b", "3b", "2b"])
    held = dataclasses.replace(free, full_context_options=["4b", "3b"])
    pick = lambda cfg: layer_policy.fit(opts, cfg, windows=[512, None]).meta["choice"]  # noqa: E731
    assert pick(free) == ["3b", "2b"]
    assert pick(held) == ["2b", "3b"]
    allowed = layer_policy.allowed_options(["4b", "3b", "2b"], held, [512, None])
    assert allowed.tolist() == [[True, True], [True, True], [True, False]]
    # below what the held layer can reach: refused with the cheapest allowed bits, the floor named as the reason
    # and the cheapest without it (2.000)
    with pytest.raises(layer_policy.InputError, match=r"budget 2.4 bits .* \(2.500 bits\); layers \[1\] may take only "
                       r"layer_policy.full_context_options, which sets that floor \(without it the cheapest is 2.000"):
        layer_policy.fit(opts, dataclasses.replace(held, budget=2.4), windows=[512, None])
    # a budget below every option: the floor is not the reason, and the message does not say it is
    with pytest.raises(layer_policy.InputError) as refused:
        layer_policy.fit(opts, dataclasses.replace(free, budget=1.5), windows=[512, None])
    assert "full_context_options" not in str(refused.value)
    with pytest.raises(layer_policy.InputError, match=r"full_context_options .* got \['8b'\]"):
        layer_policy.allowed_options(["4b"], dataclasses.replace(held, full_context_options=["8b"]), [None])


def test_a_larger_layer_saves_more_bits_per_step():
    # layer 1 holds 3x the elements of layer 0: its step saves 1.5 average bits for KL 0.3 (0.2 per bit) against
    # layer 0's 0.5 for 0.2 (0.4 per bit)
    opts = [Option("4b", 4.0, torch.tensor([0.0, 0.0])), Option("2b", 2.0, torch.tensor([0.2, 0.3]))]
    assert choose(opts, budget=3.5, weights=torch.tensor([0.25, 0.75])) == [0, 1]
    assert choose(opts, budget=3.5) == [1, 0]  # equal shares: layer 0 is the cheaper step
    with pytest.raises(ValueError, match="below the cheapest option 2b"):
        choose(opts, budget=1.5, weights=torch.tensor([0.25, 0.75]))


def test_layer_bits_are_the_ledgers_prediction(tiny_gemma3):
    spec = tiny_gemma3.spec
    policy = CachePolicy("w", [(INT4, INT2)] * spec.n_layers, key_rope="pre", n_sink=2, residual=4)
    windows = spec.layer_windows()
    assert windows.count(None) == 2 and set(windows) == {None, spec.sliding_window}
    h, d = spec.n_kv_heads, spec.head_dim
    for t in (10, 40, 100):
        bits, elements = layer_bits(policy, spec, t)
        # elements: a sliding layer holds at most its window, a global one every row
        assert elements.tolist() == [2 * h * d * (t if w is None else min(t, w)) for w in windows]
        total = predict_bytes(policy, t, h, d, windows=windows)
        assert float((bits * elements).sum()) / 8 == pytest.approx(total, rel=1e-12)
    fp16 = CachePolicy("fp16", [(FP16, FP16)] * spec.n_layers)
    assert layer_bits(fp16, spec, 40)[0].tolist() == [16.0] * spec.n_layers


def test_options_are_calibrated_but_not_evaluated_when_asked(tiny):
    from pipeline.app import evaluated_recipes, stage_graph
    from pipeline.config import LayerPolicyConfig, RunConfig, recipes_of, load_recipe

    cfg = RunConfig(quant=load_recipe("kvquant-3b-1pct+sink16+recent128"))
    cfg.eval = dataclasses.replace(cfg.eval, recipes=["fp16"])
    options = ["kvquant-3b-1pct+sink16+recent128", "kvquant-k3v2-1pct+sink16+recent128",
               "kvquant-2b-1pct+sink16+recent128"]
    cfg.layer_policy = LayerPolicyConfig(enabled=True, budget=3.0, options=options, evaluate_options=False)
    recipes = recipes_of(cfg)
    names = [s.name for s in stage_graph(cfg, recipes)]
    assert [q.name for q in evaluated_recipes(cfg, recipes)] == ["kvquant-3b-1pct+sink16+recent128", "fp16"]
    assert "evaluate-recipe-kvquant-k3v2-1pct+sink16+recent128" not in names
    assert "sensitivity-calib-kvquant-k3v2-1pct+sink16+recent128" in names and "evaluate-mixed" in names
    cfg.layer_policy.evaluate_options = True
    names = [s.name for s in stage_graph(cfg, recipes_of(cfg))]
    assert "evaluate-recipe-kvquant-k3v2-1pct+sink16+recent128" in names
