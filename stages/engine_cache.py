"""A serving library's own quantized KV cache, run as that library inside the evaluation (evaluation only: kvcalib
neither re-implements nor exports these formats).

transformers' `QuantizedCache` (`cache_implementation="quantized"` in `generate`) with the `hqq` or the `quanto`
(optimum-quanto) backend: a KIVI-like cache. Both backends share transformers' schedule and differ only in how a
flush quantizes. Its layer objects (transformers.cache_utils.QuantizedLayer) quantize the prompt and return it
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

Bits are those of the cache's final state at the end of the window, as stored when served in fp16 (the backends
keep their scales and zeros in the cache's dtype), over every cached element of every layer:
- hqq: codes at `nbits`, one fp16 scale and one fp16 zero per hqq group (read from hqq's meta);
- quanto: codes at `nbits`, one fp16 scale and one fp16 shift per quanto group (the float `_scale` and `_shift`
  of its WeightQBitsTensor, counted by their own sizes: transformers asks MaxOptimizer for float shifts, not uint8
  zero-points, and a tensor that is a single group gets one of each per entry). At axis 0 quanto's groups are
  `q_group_size` consecutive entries of the [B, H, T, D] cache in memory order (q_group_size = head_dim, as the
  defaults give on a 64-wide head: one group per token and head). quanto packs 4 (2-bit) or 2 (4-bit) codes a
  byte down the columns of its grouped codes; the pad of the last byte row (under one byte a column) is not counted;
- the residual rows at 16 bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from exporters.codec import FULL_PRECISION_BITS, SCALE_BITS
from stages.base import InputError

LIBRARIES = ("transformers",)
BACKENDS = ("hqq", "quanto")
# what transformers' layer classes (HQQQuantizedLayer, QuantoQuantizedLayer) accept per backend, refused here first
# so that the message names the recipe field; quanto's codes are qint2 / qint4 only
NBITS = {"hqq": (1, 2, 3, 4, 8), "quanto": (2, 4)}
AXES = {"hqq": (0, 1), "quanto": (0, -1)}


@dataclass
class EngineCacheConfig:
    """A recipe's `engine:` block. library "" means the recipe is one of kvcalib's own formats."""
    library: str = ""               # transformers
    backend: str = "hqq"            # hqq | quanto (transformers.QuantizedCache backend)
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
        if self.nbits not in NBITS[self.backend]:
            raise InputError(f"{where}.nbits must be one of {NBITS[self.backend]} for backend {self.backend!r}, "
                             f"got {self.nbits!r}")
        for name in ("axis_key", "axis_value"):
            if getattr(self, name) not in AXES[self.backend]:
                raise InputError(f"{where}.{name} must be one of {AXES[self.backend]} for backend "
                                 f"{self.backend!r}, got {getattr(self, name)!r}")
        for name in ("q_group_size", "residual_length"):
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


def _quantized_bits(quantized, engine: dict) -> tuple[int, int]:
    """(bits, elements) of one backend-quantized tensor: codes at nbits, scales and zeros / shifts as served in fp16.
    hqq holds (packed codes, meta) with the unpacked shape and one scale and one zero per group in meta; quanto a
    WeightQBitsTensor whose shape is the cache's and whose `_scale` / `_shift` hold one value per group."""
    if engine["backend"] == "quanto":
        n_q = int(quantized.numel())
        shift = quantized._shift
        shift_bits = SCALE_BITS if shift.dtype.is_floating_point else shift.element_size() * 8  # a uint8 zero-point
        return n_q * engine["nbits"] + int(quantized._scale.numel()) * SCALE_BITS + int(shift.numel()) * shift_bits, n_q
    meta = quantized[1]
    n_q = 1
    for s in meta["shape"]:
        n_q *= int(s)
    return n_q * engine["nbits"] + int(meta["scale"].numel()) * 2 * SCALE_BITS, n_q


def _state_bits(layer, engine: dict) -> tuple[int, int]:
    """(bits, elements) of one layer's K and V as the cache holds them now."""
    bits = elements = 0
    for quantized, residual in ((layer._quantized_keys, layer.keys), (layer._quantized_values, layer.values)):
        q_bits, n_q = _quantized_bits(quantized, engine)
        n_r = int(residual.numel()) if residual is not None and residual.dim() == 4 else 0
        bits += q_bits + n_r * FULL_PRECISION_BITS
        elements += n_q + n_r
    return bits, elements


def check_groups(engine: dict, key: torch.Tensor) -> None:
    """quanto splits each quantized tensor into groups of q_group_size: at axis 0 of the entries of one token across
    heads and head_dim (H x D), at axis -1 of one channel across batch and heads (B x H), and fails at the first
    update -- the one-token prompt -- unless q_group_size divides that count; refused here, naming the recipe field
    (quanto's own message names none). hqq's packing rules are left to hqq's own message."""
    if engine["backend"] != "quanto":
        return
    b, h, _, d = key.shape
    for name in ("axis_key", "axis_value"):
        if engine[name] == 0:
            per, what = h * d, f"{h} KV heads x head_dim {d}"
        else:
            per, what = b * h, f"batch {b} x {h} KV heads"
        if per % engine["q_group_size"]:
            allowed = tuple(g for g in range(1, per + 1) if per % g == 0)
            raise InputError(f"quant.engine.q_group_size must divide {per} ({what}: quanto's groups at "
                             f"quant.engine.{name}={engine[name]}), one of {allowed}, got {engine['q_group_size']}")


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
        check_groups(engine, key)
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
