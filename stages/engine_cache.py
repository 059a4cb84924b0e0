"""A serving library's own quantized KV cache, run as that library inside the evaluation (evaluation only: kvcalib
neither re-implements nor exports these formats).

transformers' `QuantizedCache` (`cache_implementation="quantized"` in `generate`) with the `hqq` backend: a
KIVI-like cache. Its layer objects (transformers.cache_utils.QuantizedLayer) quantize the prompt and return it
unquantized to the prompt's own attention; on every later step they return [dequantized history, full-precision
residual rows, the new row]; when the residual reaches `residual_length` rows, the whole returned cache (history
dequantized, residual and new row) is quantized again by the backend and the residual emptied.

`engine_attention` is an attention function (stages.hooks) that serves one evaluation window exactly as decoding it
one token at a time through that library does: per layer, a fresh layer object of the library receives the
window's K/V through its own `update()`, and query t attends to exactly what `update()` returns for row t when the
rows come one at a time (token 0 is the one-token prompt). Rows between two flushes go in one chunk: between
flushes the library returns the same dequantized history to every step, so a chunk's queries, masked causally,
see what one-token steps would (update_steps). The rest of the model runs over the whole window at once, which equals
sequential decoding because position t depends only on positions <= t;
tests/stages/test_engine_cache.py checks the logits against model.forward with the library's QuantizedCache, one
token at a time.

Bits are those of the cache's final state at the end of the window, as stored when served in fp16: codes at
`nbits`, one fp16 scale and one fp16 zero per quantization group (the backend's own grouping), residual rows at 16
bits -- over every cached element of every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from exporters.codec import FULL_PRECISION_BITS, SCALE_BITS
from stages.base import InputError

LIBRARIES = ("transformers",)
BACKENDS = ("hqq",)


@dataclass
class EngineCacheConfig:
    """A recipe's `engine:` block. library "" means the recipe is one of kvcalib's own formats."""
    library: str = ""               # transformers
    backend: str = "hqq"            # hqq (transformers.QuantizedCache backend)
    nbits: int = 4
    axis_key: int = 0               # the library's defaults; see docs/peer-formats.md for what they group
    axis_value: int = 0
    q_group_size: int = 64
    residual_length: int = 128

    def validate(self, where: str = "quant.engine") -> None:
        if self.library not in LIBRARIES:
            raise InputError(f"{where}.library must be one of {LIBRARIES}, got {self.library!r}")
        if self.backend not in BACKENDS:
            raise InputError(f"{where}.backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("nbits", "q_group_size", "residual_length"):
            if getattr(self, name) < 1:
                raise InputError(f"{where}.{name} must be >= 1, got {getattr(self, name)}")

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def supports(layer_types) -> bool:
    """Whether the library's cache serves a model with these layer types (ModelSpec.layer_types; () = all full):
    transformers' QuantizedCache refuses any model with sliding-window layers (Gemma 3, Mistral with a window)."""
    return "sliding" not in layer_types


def check_model(recipe: str, model: str, layer_types) -> None:
    """Refuse, before any stage runs, a library cache the library itself would refuse for this model."""
    if not supports(layer_types):
        raise InputError(f"recipe {recipe}: transformers' QuantizedCache serves only models whose layers are all "
                         f"full attention, and model {model} has sliding-window layers "
                         f"({sum(t == 'sliding' for t in layer_types)} of {len(layer_types)}); transformers refuses "
                         f"it too -- drop {recipe} from eval.recipes for this model")


def quantized_cache(engine: dict, model_config):
    """The library's own cache object for one sequence (a fresh one per evaluation window)."""
    from transformers.cache_utils import QuantizedCache
    return QuantizedCache(backend=engine["backend"], config=model_config, nbits=engine["nbits"],
                          axis_key=engine["axis_key"], axis_value=engine["axis_value"],
                          q_group_size=engine["q_group_size"], residual_length=engine["residual_length"])


def _state_bits(layer, engine: dict) -> tuple[int, int]:
    """(bits, elements) of one layer's K and V as the cache holds them now."""
    bits = elements = 0
    for quantized, residual in ((layer._quantized_keys, layer.keys), (layer._quantized_values, layer.values)):
        codes_meta = quantized[1]
        n_q = 1
        for s in codes_meta["shape"]:
            n_q *= int(s)
        n_groups = int(codes_meta["scale"].numel())
        n_r = int(residual.numel()) if residual is not None and residual.dim() == 4 else 0
        bits += n_q * engine["nbits"] + n_groups * 2 * SCALE_BITS + n_r * FULL_PRECISION_BITS
        elements += n_q + n_r
    return bits, elements


def _residual_rows(layer) -> int:
    return layer.keys.shape[-2] if layer.is_initialized and layer.keys.dim() == 4 else 0


def update_steps(layer, t: int) -> list[tuple[int, int]]:
    """The (start, stop) row chunks to hand the layer's update() so that it returns, for every row, what one-token
    steps would: token 0 alone (the one-token prompt), then up to the row before the residual window fills (no
    flush inside a chunk, so every query of the chunk sees the same quantized history, the residual rows and the
    chunk's own rows up to itself), then the one row whose update() flushes -- and so on. Called once per layer,
    before any update (the plan follows the library's rule: flush when residual + new rows >= residual_length)."""
    steps, start, residual, limit = [(0, 1)], 1, 0, layer.residual_length
    while start < t:
        n = min(max(limit - 1 - residual, 0), t - start)
        if n:
            steps.append((start, start + n))
            start, residual = start + n, residual + n
        if start < t:  # this row's update() flushes the cache
            steps.append((start, start + 1))
            start, residual = start + 1, 0
    return steps


def engine_attention(engine: dict, model_config, ledger=None, perturb=None):
    """An attention function (see stages.hooks) serving the window through the library's cache: per layer the
    rows go through the library's update() in the chunks of update_steps, and each query attends to what update()
    returned for it (causally within its chunk)."""
    cache = quantized_cache(engine, model_config)

    def attn(module, query, key, value, mask, scaling):
        import torch.nn.functional as F

        layer = cache.layers[module.layer_idx]
        if perturb is not None:
            key, value = perturb(key), perturb(value)
        t = key.shape[2]
        if query.shape[2] != t or layer.is_initialized:
            raise InputError(f"engine_attention serves one whole window per cache: {query.shape[2]} queries for "
                             f"{t} keys (initialized: {layer.is_initialized})")
        outs = []
        for start, stop in update_steps(layer, t):
            residual_before = _residual_rows(layer)
            k_ret, v_ret = layer.update(key[:, :, start:stop].contiguous(), value[:, :, start:stop].contiguous())
            if start and stop - start > 1 and residual_before + stop - start >= layer.residual_length:
                raise AssertionError("update_steps planned a flush inside a chunk")  # the plan's own invariant
            n, total = stop - start, k_ret.shape[2]
            causal = torch.arange(total, device=key.device)[None] <= (total - n + torch.arange(n, device=key.device))[:, None]
            outs.append(F.scaled_dot_product_attention(query[:, :, start:stop], k_ret.to(query.dtype),
                                                       v_ret.to(query.dtype), attn_mask=causal, scale=scaling,
                                                       enable_gqa=True))
        if ledger is not None:
            bits, elements = _state_bits(layer, engine)
            ledger.bits += bits
            ledger.elements += elements
        return torch.cat(outs, 2).transpose(1, 2).contiguous()

    return attn
