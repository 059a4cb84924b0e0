"""bench.head_policy's evaluation-only precision per KV head: each query head served from its KV head's option, the
bits counted per head, the per-head sensitivity and the greedy's inputs over layers x heads."""
import torch

from bench.head_policy import (SharedLedger, head_hidden, head_sensitivity, mix_heads, per_head_options,
                               query_heads)
from exporters.codec import CachePolicy, TensorPolicy
from exporters.ledger import Ledger
from stages import layer_policy
from stages.evaluate import policy_hidden
from stages.hooks import attention_layers, forward_hooks

INT2 = TensorPolicy(format="uniform", bits=2, axis="token")
INT4 = TensorPolicy(format="uniform", bits=4, axis="token")


def _policy(name, tp, n_layers):
    return CachePolicy(name, [(tp, tp)] * n_layers, n_sink=1, residual=4)


def test_each_query_head_reads_its_kv_heads_option():
    assert query_heads([1], 3) == [3, 4, 5] and query_heads([0, 2], 2) == [0, 1, 4, 5]
    outs = {0: torch.zeros(1, 2, 6, 1), 1: torch.ones(1, 2, 6, 1)}
    mixed = mix_heads(outs, [1, 0, 1], 2)  # KV heads 0 and 2 on option 1: query heads 0, 1, 4, 5
    assert mixed[0, 0, :, 0].tolist() == [1, 1, 0, 0, 1, 1] and torch.equal(mixed[:, 0], mixed[:, 1])
    assert torch.equal(outs[0], torch.zeros(1, 2, 6, 1))  # the options' outputs are not written into
    assert mix_heads({1: outs[1]}, [1, 1, 1], 2) is outs[1]


def test_one_option_per_layer_is_the_per_layer_policy_bit_for_bit(tiny, tiny_windows):
    n, h = tiny.spec.n_layers, tiny.spec.n_kv_heads
    p2, p4 = _policy("int2", INT2, n), _policy("int4", INT4, n)
    ids = tiny_windows.eval[:1]
    assembled = layer_policy.assemble([p2, p4], [0, 1] * (n // 2), "mixed")
    ledger, shared = Ledger(), SharedLedger()
    with torch.no_grad():
        want = policy_hidden(tiny.model, ids, assembled, ledger)
        got = head_hidden(tiny.model, ids, [p2, p4], [[0] * h, [1] * h] * (n // 2), shared)
    assert torch.equal(got, want)
    assert (shared.bits, shared.elements) == (ledger.bits, ledger.elements)


def test_heads_on_two_options_take_each_heads_output_and_half_of_each_layers_bits(tiny, tiny_windows):
    n, h = tiny.spec.n_layers, tiny.spec.n_kv_heads
    group = tiny.model.config.num_attention_heads // h
    p2, p4 = _policy("int2", INT2, n), _policy("int4", INT4, n)
    ids = tiny_windows.eval[:1]
    seen = {}

    def grab(label):
        def hook(_m, inp):
            seen[label] = inp[0][0].detach().view(ids.shape[1], -1, tiny.spec.head_dim)  # [T, H_q, D]
        return hook

    o_proj = attention_layers(tiny.model)[0].o_proj
    runs = {"int2": [[0] * h] * n, "int4": [[1] * h] * n, "mixed": [[0] + [1] * (h - 1)] * n}
    ledgers = {}
    with torch.no_grad():
        for label, choice in runs.items():
            ledgers[label] = SharedLedger()
            with forward_hooks([(o_proj, grab(label), True)]):
                head_hidden(tiny.model, ids, [p2, p4], choice, ledgers[label])
    first, rest = query_heads([0], group), query_heads(list(range(1, h)), group)
    # layer 0 sees the same input in every run: its KV head 0 read at 2 bits, the others at 4
    assert torch.equal(seen["mixed"][:, first], seen["int2"][:, first])
    assert torch.equal(seen["mixed"][:, rest], seen["int4"][:, rest])
    assert not torch.equal(seen["int2"], seen["int4"])
    share = 1 / h
    want = share * ledgers["int2"].bits + (1 - share) * ledgers["int4"].bits
    assert abs(ledgers["mixed"].bits - want) < 1e-6 * want
    assert abs(ledgers["mixed"].elements - ledgers["int2"].elements) < 1e-6 * ledgers["int2"].elements


def test_head_sensitivity_is_zero_at_full_precision_and_positive_per_head_at_two_bits(tiny, tiny_windows):
    n, h = tiny.spec.n_layers, tiny.spec.n_kv_heads
    fp = head_sensitivity(tiny.model, tiny_windows.calib[:1], _policy("fp16", TensorPolicy(), n))
    int2 = head_sensitivity(tiny.model, tiny_windows.calib[:1], _policy("int2", INT2, n))
    assert fp.shape == int2.shape == (n, h)
    assert float(fp.abs().max()) < 1e-2 * float(int2.min())  # fp16 rows only (their rounding): ~nothing
    assert bool((int2 > 0).all())
    # one head of a layer costs less than the whole layer: the layer's isolated KL, both heads at 2 bits
    from stages import sensitivity
    whole = sensitivity.fit(sensitivity.Inputs(tiny.model, tiny.spec, tiny_windows.calib[:1],
                                               _policy("int2", INT2, n)),
                            sensitivity.SensitivityConfig(n_windows=1, seq_len=0, buckets=[0])).tensors["kl"][2]
    assert bool((int2.max(1).values < whole).all())


def test_per_head_options_cost_each_head_its_layers_bits_at_its_share():
    opts = [layer_policy.Option("a", torch.tensor([4.0, 3.0]), torch.tensor([[0.1, 0.2], [0.3, 0.4]])),
            layer_policy.Option("b", torch.tensor([2.0, 2.5]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))]
    flat, w = per_head_options(opts, torch.tensor([300.0, 100.0]), 2)
    assert torch.allclose(w, torch.tensor([0.375, 0.375, 0.125, 0.125], dtype=w.dtype))
    assert flat[0].bits.tolist() == [4.0, 4.0, 3.0, 3.0] and flat[1].kl.tolist() == [1.0, 2.0, 3.0, 4.0]
    # a budget between: the cheapest move per bit saved is head 0 of layer 0 (KL 0.9 for 0.75 bits saved)
    choice = layer_policy.choose(flat, 3.5, w)
    assert choice == [1, 0, 0, 0]
