"""A library's own quantized cache in the evaluation (stages/engine_cache.py): the logits the evaluation computes
are those of decoding the window one token at a time through transformers' QuantizedCache (hqq backend)."""
import pytest
import torch

from exporters.codec import CachePolicy, CodecError, TensorPolicy
from exporters.ledger import Ledger
from pipeline.config import load_recipe
from stages import evaluate, recipe
from stages.engine_cache import EngineCacheConfig, quantized_cache, update_steps

import hqq  # noqa: F401  (scripts/install.sh installs the peers extra: a missing backend fails, never skips)

# the tiny model: 2 layers, 2 KV heads, head_dim 16 -> hqq's default axis-0 grouping needs groups of <= 32 rows
ENGINE = {"library": "transformers", "backend": "hqq", "nbits": 4, "axis_key": 0, "axis_value": 0,
          "q_group_size": 16, "residual_length": 8}


def _policy(engine, n_layers):
    return CachePolicy("hqq", layers=[(TensorPolicy(), TensorPolicy())] * n_layers, engine=engine)


def _decoded(model, ids, engine):
    """Next-token log-probabilities of decoding ids [1, T] one token at a time through the library's cache."""
    cache = quantized_cache(engine, model.config)
    out = []
    with torch.no_grad():
        for t in range(ids.shape[1]):
            out.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[0, -1].float())
    return torch.log_softmax(torch.stack(out), -1)


@pytest.mark.parametrize("nbits", [4, 2])
def test_evaluation_is_the_library_decoding_token_by_token(tiny, tiny_windows, nbits):
    engine = {**ENGINE, "nbits": nbits}
    ids = tiny_windows.eval[:1, :40]
    with torch.no_grad():
        got = evaluate.policy_logprobs(tiny.model, ids, _policy(engine, tiny.spec.n_layers))
        exact = torch.log_softmax(tiny.model(ids, use_cache=False).logits[0].float(), -1)
    want = _decoded(tiny.model, ids, engine)
    assert (got - want).abs().max() < 1e-4
    assert (got - exact).abs().max() > 1e-3  # the cache really was quantized (token 0 alone is exact)
    assert (got[:1] - exact[:1]).abs().max() < 1e-5


def test_bits_are_the_final_state_of_the_cache(tiny, tiny_windows):
    """40 tokens, residual_length 8: flushes at steps 8, 16, 24, 32 -> 33 rows quantized, 7 in full precision.
    Per layer and tensor: 33 rows x 32 elements at 4 bits + 66 groups x (fp16 scale + zero) + 7 x 32 x 16 bits."""
    led = Ledger()
    with torch.no_grad():
        evaluate.policy_logprobs(tiny.model, tiny_windows.eval[:1, :40], _policy(ENGINE, tiny.spec.n_layers), led)
    per_tensor_bits = 33 * 32 * 4 + 66 * 32 + 7 * 32 * 16
    assert led.elements == 4 * 40 * 32
    assert led.bits == 4 * per_tensor_bits  # 2 layers x (K, V)
    assert led.bits / led.elements == pytest.approx(7.75)


def test_hf_recipes_load_and_are_never_exported():
    for name, nbits in (("hf-hqq-4", 4), ("hf-hqq-2", 2)):
        q = load_recipe(name)
        assert (q.engine.library, q.engine.backend, q.engine.nbits) == ("transformers", "hqq", nbits)
        recipe.validate_recipe(q)
        policy = recipe.build_policy(q, 3, {})
        assert policy.engine["nbits"] == nbits and not policy.is_full_precision
        with pytest.raises(CodecError, match=r"quant\.engine.*never exported"):
            recipe.check_exportable_recipe(q)


def test_bad_engine_fields_are_refused_by_name():
    q = load_recipe("hf-hqq-4")
    q.engine.backend = "quanto-typo"
    with pytest.raises(ValueError, match=r"quant\.engine\.backend must be one of \('hqq',\), got 'quanto-typo'"):
        recipe.validate_recipe(q)
    q = load_recipe("hf-hqq-4")
    q.residual = 16
    with pytest.raises(CodecError, match="kvcalib's fields must stay at their defaults"):
        recipe.validate_recipe(q)
    assert EngineCacheConfig().library == ""  # kvcalib's own recipes: no engine


def test_update_steps_flush_where_one_token_steps_would():
    class Layer:
        residual_length = 8
    steps = update_steps(Layer(), 20)
    # token 0 alone; rows 1-7 fill the residual to 7; row 8's update flushes (7 + 1 >= 8); rows 9-15; row 16; 17-19
    assert steps == [(0, 1), (1, 8), (8, 9), (9, 16), (16, 17), (17, 20)]
