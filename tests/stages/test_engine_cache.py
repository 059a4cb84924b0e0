"""A library's own quantized cache in the evaluation (stages/engine_cache.py): the logits the evaluation computes
are those of decoding the window one token at a time through transformers' QuantizedCache (hqq and quanto
backends)."""
import pytest
import torch

from exporters.codec import CachePolicy, CodecError, TensorPolicy
from exporters.ledger import Ledger
from pipeline.config import load_recipe
from stages import evaluate, recipe
from stages.base import InputError
from stages.engine_cache import EngineCacheConfig, quantized_cache, update_steps

# scripts/install.sh installs the peers extra: a missing backend fails, never skips
import hqq  # noqa: F401
import optimum.quanto  # noqa: F401

# the tiny model: 2 layers, 2 KV heads, head_dim 16 -> hqq's default axis-0 grouping needs groups of <= 32 rows, and
# quanto's axis-0 groups must divide the 32 entries of one token (16: one group per token and head)
ENGINE = {"library": "transformers", "backend": "hqq", "nbits": 4, "axis_key": 0, "axis_value": 0,
          "q_group_size": 16, "residual_length": 8}
BACKEND_NBITS = [("hqq", 4), ("hqq", 2), ("quanto", 4), ("quanto", 2)]


def _policy(engine, n_layers):
    return CachePolicy(engine["backend"], layers=[(TensorPolicy(), TensorPolicy())] * n_layers, engine=engine)


def _decoded(model, ids, engine):
    """Next-token log-probabilities of decoding ids [1, T] one token at a time through the library's cache."""
    cache = quantized_cache(engine, model.config)
    out = []
    with torch.no_grad():
        for t in range(ids.shape[1]):
            out.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[0, -1].float())
    return torch.log_softmax(torch.stack(out), -1)


@pytest.mark.parametrize("backend, nbits", BACKEND_NBITS)
def test_evaluation_is_the_library_decoding_token_by_token(tiny, tiny_windows, backend, nbits):
    engine = {**ENGINE, "backend": backend, "nbits": nbits}
    ids = tiny_windows.eval[:1, :40]
    with torch.no_grad():
        got = evaluate.policy_logprobs(tiny.model, ids, _policy(engine, tiny.spec.n_layers))
        exact = torch.log_softmax(tiny.model(ids, use_cache=False).logits[0].float(), -1)
    want = _decoded(tiny.model, ids, engine)
    assert (got - want).abs().max() < 1e-4
    assert (got - exact).abs().max() > 1e-3  # the cache really was quantized (token 0 alone is exact)
    assert (got[:1] - exact[:1]).abs().max() < 1e-5


@pytest.mark.parametrize("backend, nbits, avg_bits", [("hqq", 4, 7.75), ("quanto", 4, 7.75), ("quanto", 2, 6.1)])
def test_bits_are_the_final_state_of_the_cache(tiny, tiny_windows, backend, nbits, avg_bits):
    """40 tokens, residual_length 8: flushes at steps 8, 16, 24, 32 -> 33 rows quantized, 7 in full precision.
    Per layer and tensor: 33 rows x 32 elements at nbits + 66 groups x (fp16 scale + zero) + 7 x 32 x 16 bits; 66
    groups for both backends: hqq's 16-entry columns of the flattened cache, quanto's 16 channels of one token and
    head (its float shift is the zero)."""
    led = Ledger()
    engine = {**ENGINE, "backend": backend, "nbits": nbits}
    with torch.no_grad():
        evaluate.policy_logprobs(tiny.model, tiny_windows.eval[:1, :40], _policy(engine, tiny.spec.n_layers), led)
    per_tensor_bits = 33 * 32 * nbits + 66 * 32 + 7 * 32 * 16
    assert led.elements == 4 * 40 * 32
    assert led.bits == 4 * per_tensor_bits  # 2 layers x (K, V)
    assert led.bits / led.elements == pytest.approx(avg_bits)


def test_quanto_groups_are_one_scale_and_one_shift_per_token_and_head(tiny):
    """What the quanto bit count reads, checked on the library's own state: a flush of 9 rows (2 heads, head_dim 16,
    q_group_size 16) holds 18 groups, each one float scale and one float shift, no integer zero-point."""
    layer = quantized_cache({**ENGINE, "backend": "quanto"}, tiny.model.config).layers[0]
    k, v = torch.randn(2, 1, 2, 9, 16, dtype=torch.float16)
    for start, stop in ((0, 1), (1, 8), (8, 9)):
        layer.update(k[:, :, start:stop], v[:, :, start:stop])
    q = layer._quantized_keys
    assert tuple(q.shape) == (1, 2, 9, 16) and layer.keys.numel() == 0  # the flush at row 8 quantized every row
    assert q._scale.numel() == q._shift.numel() == 18
    assert q._scale.dtype == q._shift.dtype == torch.float16  # served in fp16: 16 bits each


def test_hf_recipes_load_and_are_never_exported():
    for name, backend, nbits in (("hf-hqq-4", "hqq", 4), ("hf-hqq-2", "hqq", 2), ("hf-quanto-4", "quanto", 4),
                                 ("hf-quanto-2", "quanto", 2)):
        q = load_recipe(name)
        assert (q.engine.library, q.engine.backend, q.engine.nbits) == ("transformers", backend, nbits)
        assert (q.engine.axis_key, q.engine.axis_value, q.engine.q_group_size, q.engine.residual_length) == \
            (0, 0, 64, 128)  # the library's defaults
        recipe.validate_recipe(q)
        policy = recipe.build_policy(q, 3, {})
        assert policy.engine["nbits"] == nbits and not policy.is_full_precision
        with pytest.raises(CodecError, match=r"quant\.engine.*never exported"):
            recipe.check_exportable_recipe(q)


def test_bad_engine_fields_are_refused_by_name():
    q = load_recipe("hf-hqq-4")
    q.engine.backend = "quanto-typo"
    with pytest.raises(ValueError,
                       match=r"quant\.engine\.backend must be one of \('hqq', 'quanto'\), got 'quanto-typo'"):
        recipe.validate_recipe(q)
    q = load_recipe("hf-hqq-4")
    q.residual = 16
    with pytest.raises(CodecError, match="kvcalib's fields must stay at their defaults"):
        recipe.validate_recipe(q)
    assert EngineCacheConfig().library == ""  # kvcalib's own recipes: no engine


@pytest.mark.parametrize("name, field, value, message", [
    ("hf-quanto-4", "nbits", 3, r"quant\.engine\.nbits must be one of \(2, 4\) for backend 'quanto', got 3"),
    ("hf-quanto-2", "nbits", 8, r"quant\.engine\.nbits must be one of \(2, 4\) for backend 'quanto', got 8"),
    ("hf-hqq-4", "nbits", 5, r"quant\.engine\.nbits must be one of \(1, 2, 3, 4, 8\) for backend 'hqq', got 5"),
    ("hf-quanto-4", "axis_key", 1, r"quant\.engine\.axis_key must be one of \(0, -1\) for backend 'quanto', got 1"),
    ("hf-hqq-4", "axis_value", -1, r"quant\.engine\.axis_value must be one of \(0, 1\) for backend 'hqq', got -1"),
], ids=["quanto-nbits-3", "quanto-nbits-8", "hqq-nbits-5", "quanto-axis-1", "hqq-axis--1"])
def test_what_the_backend_refuses_is_refused_by_name(name, field, value, message):
    """transformers' layer classes accept per backend: quanto 2 or 4 bits at axis 0 or -1, hqq 1, 2, 3, 4 or 8 bits at
    axis 0 or 1; anything else is refused before any stage, naming the recipe field."""
    q = load_recipe(name)
    recipe.validate_recipe(q)  # the recipe as shipped passes
    setattr(q.engine, field, value)
    with pytest.raises(InputError, match=message):
        recipe.validate_recipe(q)


def test_quanto_group_size_must_divide_its_groups(tiny, tiny_windows):
    """quanto's axis-0 groups split the 32 entries of one token (2 KV heads x head_dim 16): 64 cannot, and the
    window is refused naming quant.engine.q_group_size rather than with quanto's own message."""
    engine = {**ENGINE, "backend": "quanto", "q_group_size": 64}
    with pytest.raises(InputError, match=r"quant\.engine\.q_group_size must divide 32 \(2 KV heads x head_dim 16: "
                                         r"quanto's groups at quant\.engine\.axis_key=0\), one of "
                                         r"\(1, 2, 4, 8, 16, 32\), got 64"):
        evaluate.policy_logprobs(tiny.model, tiny_windows.eval[:1, :12], _policy(engine, tiny.spec.n_layers))


def test_update_steps_flush_where_one_token_steps_would():
    class Layer:
        residual_length = 8
    steps = update_steps(Layer(), 20)
    # token 0 alone; rows 1-7 fill the residual to 7; row 8's update flushes (7 + 1 >= 8); rows 9-15; row 16; 17-19
    assert steps == [(0, 1), (1, 8), (8, 9), (9, 16), (16, 17), (17, 20)]
