"""stages/evaluate.py's quantized_attention takes vLLM's formats (conf/quant/vllm-*.yaml) with no special case: the
attention reads the codec's fake-quantized K/V (every row, none kept in full precision) and the ledger counts the
spec's bits per element; TurboQuant's boundary layers read fp16 and count 16 bits."""
from types import SimpleNamespace

import pytest
import torch

from exporters.codec import fake_quant
from exporters.ledger import Ledger
from pipeline.config import load_recipe
from stages import evaluate, recipe
from stages.hooks import sdpa_attention

B, HQ, HKV, T, D = 1, 4, 2, 9, 64


def _qkv(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, HQ, T, D, generator=g), torch.randn(B, HKV, T, D, generator=g) * 3,
            torch.randn(B, HKV, T, D, generator=g))


@pytest.mark.parametrize("name,layer,avg_bits", [
    ("vllm-turboquant-k3v4-nc", 2, (3.25 + 4.5) / 2),    # the spec's 3.875 average at D=64
    ("vllm-turboquant-k3v4-nc", 0, 16.0),                # a boundary layer
    ("vllm-int4-per-token-head", 0, 4.5),
    ("vllm-fp8-per-token-head", 3, 8.5),
    ("vllm-turboquant-k8v4", 3, (8.0 + 4.5) / 2),
])
def test_quantized_attention_reads_the_codec_output(name, layer, avg_bits):
    policy = recipe.build_policy(load_recipe(name), 6, {})
    rope = {"cos": torch.ones(1, T, D), "sin": torch.zeros(1, T, D)}   # post-RoPE keys: never applied
    ledger = Ledger()
    attn = evaluate.quantized_attention(policy, rope, ledger)
    q, k, v = _qkv(layer)
    out = attn(SimpleNamespace(layer_idx=layer), q, k, v, None, D ** -0.5)
    pk, pv = policy.layers[layer]
    k_hat, _ = fake_quant(k.half().float(), pk)
    v_hat, _ = fake_quant(v.half().float(), pv)
    assert torch.allclose(out, sdpa_attention(q, k_hat, v_hat, None, D ** -0.5), atol=1e-6)
    assert ledger.bits / ledger.elements == avg_bits
