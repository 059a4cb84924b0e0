"""Real models' shapes without their weights: `model.source=shape` (conf/model/llama3-shape.yaml).

A preset is a real model's configuration (sizes, heads, RoPE with its scaling, vocabulary, norm epsilon, untied
lm_head); the model is built with `n_layers` decoder layers instead of the real count and random weights, so the
whole pipeline runs on one CPU with the real per-layer shapes (GQA 4:1 or 8:1, head_dim 128, llama3 RoPE
scaling, 128k vocabulary). Quality on random weights is meaningless; shapes, memory and time are not.

The weights are drawn, not loaded: parameters are created empty (no library init, which would draw them a second
time), then filled in `named_modules` order from one `torch.Generator` seeded with `seed`: every Linear and
Embedding weight ~ normal(0, initializer_range), every norm weight 1 (the distribution transformers' Llama
init draws). The weight identity is the hash of that recipe (init, seed, dtype, torch version) -- not of the
parameters, which would take longer to hash than to draw. bench.scale reads the presets for its predictions:
one definition of each model's shape.
"""
from __future__ import annotations

import torch

from exporters.checksums import sha256_json
from pipeline.errors import UserError

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# Meta's published config.json values (Llama-3.1 8B / 70B: the llama3 RoPE scaling to 128k positions; Meta-Llama-3-8B
# has the same shapes with 8192 positions and no scaling). n_layers is the real depth; a run builds
# model.shape.n_layers of them.
PRESETS: dict[str, dict] = {
    "llama3-8b": dict(architecture="LlamaForCausalLM", n_layers=32, hidden_size=4096, intermediate_size=14336,
                      n_q_heads=32, n_kv_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
                      rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072, rms_norm_eps=1e-5,
                      tie_word_embeddings=False),
    "llama3-70b": dict(architecture="LlamaForCausalLM", n_layers=80, hidden_size=8192, intermediate_size=28672,
                       n_q_heads=64, n_kv_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
                       rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072, rms_norm_eps=1e-5,
                       tie_word_embeddings=False),
}
INIT = "normal(0, initializer_range) for Linear/Embedding weights, 1 for norm weights, named_modules order"


def preset(name: str) -> dict:
    if name not in PRESETS:
        raise UserError(f"model.shape.preset must be one of {tuple(PRESETS)}, got {name!r}")
    return PRESETS[name]


def shape_config(name: str, n_layers: int, bos_token_id: int | None = None, eos_token_id: int | None = None):
    """The preset's transformers config with `n_layers` decoder layers."""
    from transformers import LlamaConfig

    p = preset(name)
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or not 1 <= n_layers <= p["n_layers"]:
        raise UserError(f"model.shape.n_layers must be an integer in 1..{p['n_layers']} (the depth of {name}), "
                        f"got {n_layers!r}")
    return LlamaConfig(
        vocab_size=p["vocab_size"], hidden_size=p["hidden_size"], intermediate_size=p["intermediate_size"],
        num_hidden_layers=n_layers, num_attention_heads=p["n_q_heads"], num_key_value_heads=p["n_kv_heads"],
        head_dim=p["head_dim"], max_position_embeddings=p["max_position_embeddings"], rope_theta=p["rope_theta"],
        rope_scaling=dict(p["rope_scaling"]), rms_norm_eps=p["rms_norm_eps"],
        tie_word_embeddings=p["tie_word_embeddings"], bos_token_id=bos_token_id, eos_token_id=eos_token_id,
        architectures=[p["architecture"]])


def random_model(config, seed: int, dtype: torch.dtype) -> tuple[torch.nn.Module, str]:
    """A LlamaForCausalLM of `config` with seeded random weights in `dtype` on the CPU -> (model, weight identity)."""
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    if config.tie_word_embeddings:  # tied weights would need re-tying after the parameters are re-created
        raise UserError("model.source=shape: tied embeddings are not handled (the presets have an untied lm_head)")
    with init_empty_weights():  # parameters on the meta device (no memory, no library init); buffers real
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    buffers = {name: b.clone() for name, b in model.named_buffers()}  # RoPE inv_freq: computed, keep it
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
        gen = torch.Generator().manual_seed(seed)
        std = float(config.initializer_range)
        for name, module in model.named_modules():  # each parameter once, in a fixed order
            for pname, p in module.named_parameters(recurse=False):
                if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and pname == "weight":
                    p.normal_(0.0, std, generator=gen)
                elif "Norm" in type(module).__name__ and pname == "weight":
                    p.fill_(1.0)
                else:
                    raise UserError(f"model.source=shape: no initialisation for parameter {name}.{pname} "
                                    f"({type(module).__name__})")
    identity = sha256_json({"init": INIT, "std": std, "seed": seed, "dtype": str(dtype), "torch": torch.__version__})
    return model, identity


__all__ = ["PRESETS", "preset", "shape_config", "random_model"]
