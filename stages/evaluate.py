"""Quality of quantized caches against the full-precision reference, on evaluation windows only.

What is evaluated is what serving/cache.py serves when the window is decoded one token at a time, both
reading exporters/served_rows.py (LayerRows) for which rows are sink, encoded and residual at every step: K and V
rounded to fp16 as the cache receives them; the sink rows (the first max(n_sink, prefix) positions) kept so;
every other row through exporters.codec (encode -> decode) exactly as the cache stores it; and the residual
buffer read as decode sees it -- query t reads in fp16 the rows the cache still holds unflushed at step t
(LayerRows.encoded_end: rows flush in whole units of K's and V's groups) and older rows quantized (a mask
choosing between the two score matrices and the two value sets). A policy with a prefix (PrefixQuant /
IntactKV) serves every window after its prefix ids: positions shift by P, the P prefix rows are the first sink
rows (and counted at 16 bits), and metrics are taken on the window's own positions.

Metrics per policy: perplexity, KL(reference || quantized) of next-token distributions, top-1 agreement,
average bits per cached element from the ledger (exporters.ledger.Ledger: codes, scales, zero-points, sparse
values + indices + row counts, full-precision sink and residual rows at 16 bits, per-layer static tensors once
per sequence), the measured sparse-outlier fraction over the tensors that store outliers, and the perplexity
ratio to fp16 on the same windows with a 95% interval (ppl_ratio_interval): over windows and, with
EvalConfig.perturb_seeds, over perturbations of the cache's input.

In a run the evaluation is three stages, so that each recipe's figures are cached on their own (a new `quant`
evaluates only itself): evaluate-reference (the full-precision model's final hidden states on every window, shared
by every recipe), evaluate-recipe-<name> (one recipe against that reference: fit with ref_hidden) and evaluate (the
recipes' figures put together, combine: what the run's summary, the gate and the report read). Every figure of a
recipe depends on that recipe, the reference and the windows alone, so the three stages give exactly what fit
gives for all recipes at once (tests/stages/test_evaluate.py).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from exporters import figures
from exporters.codec import FULL_PRECISION_BITS, CachePolicy, fake_quant
from exporters.ledger import Ledger
from exporters.rope import apply_rope, invert_rope
from exporters.served_rows import layer_rows, visible_from
from stages.base import Context, Declaration, StageResult, eval_units
from stages.engine_cache import engine_attention
from stages.recipe import QuantConfig, inputs_of, recipe_policy
from stages.hooks import (attend, attention_override, attention_scores, layer_rope, layer_windows, lm_logits,
                          logit_rows, model_device, rope_tables, sdpa_attention)


@dataclass
class EvalConfig:
    enabled: bool = True
    # evaluated beside the run's own recipe, on the same windows, each recipe cached on its own (another list
    # evaluates only the recipes it adds). The default is what a user weighs the run's recipe against: fp16 (the
    # reference), fp8-e4m3 (the 8-bit cache vLLM and llm-compressor ship, and our vLLM export) and
    # vllm-int4-per-token-head (the calibration-free 4-bit cache vLLM ships, at the run's bits). Any recipe of
    # conf/quant adds a row: eval.recipes=[fp16,fp8-e4m3,vllm-int4-per-token-head,kivi-4,kivi-2]; the vllm-*
    # rows are what `pipeline recommend` chooses a vLLM --kv-cache-dtype from (docs/eval-cost.md)
    recipes: list[str] = field(default_factory=lambda: ["fp16", "fp8-e4m3", "vllm-int4-per-token-head"])
    # each quantized recipe is evaluated once per seed with the cache's input perturbed (Perturbation);
    # empty: once, unperturbed (the interval then covers the choice of windows only)
    perturb_seeds: list[int] = field(default_factory=list)
    perturb_scale: float = 1e-5

    # not in the cache key: with enabled=false the evaluate stage is not in the graph at all
    KEY_EXCLUDED: ClassVar[dict[str, str]] = {"enabled": "whether the stage runs, not what it computes"}


@dataclass
class Inputs:
    model: torch.nn.Module
    spec: object                  # pipeline.model.ModelSpec
    windows: torch.Tensor         # [M, T] evaluation token ids
    policies: list[CachePolicy]


QUERY_CHUNK = 1024  # beyond this many positions a forward's attention runs in chunks of queries (long_forward)


@dataclass(frozen=True)
class Perturbation:
    """Relative noise on the K/V entering the cache (every row after the sinks, before the fp16 rounding the
    cache applies): x * (1 + scale * u), u uniform in [-1, 1], drawn from `generator` layer by layer. It stands
    for the activations another machine computes (float32 accumulation order), to which a quantized cache's
    perplexity is chaotic: a code at a rounding boundary flips."""
    scale: float
    generator: torch.Generator

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        u = torch.rand(x.shape, generator=self.generator, dtype=torch.float64).to(x.device) * 2 - 1
        return (x.double() * (1 + self.scale * u)).to(x.dtype)


def long_forward(t: int) -> bool:
    """Does a forward of t positions run its attention in chunks of QUERY_CHUNK queries, each over the band of rows
    its queries can see (the causal prefix; on a sliding layer only the window's), with the mask transformers
    builds for it in attention_override's "serving" mode (None on a causal layer, boolean on a sliding one) -- never a
    [T, T] float mask, 4 GB at 32k? Up to QUERY_CHUNK positions a forward keeps one pass over every row (the 1k
    tables unchanged bit for bit)."""
    return t > QUERY_CHUNK


def _chunk_mask(mask: torch.Tensor | None, q_pos: torch.Tensor, t: int, lo: int = 0,
                window: int | None = None) -> torch.Tensor:
    """The model's mask rows for this chunk (columns lo..t-1, already sliced by the caller), or the causal mask --
    banded to the window on a sliding layer -- at the chunk's absolute positions q_pos [T_q, 1] over rows lo..t-1."""
    if mask is not None:
        return mask
    cols = torch.arange(lo, t, device=q_pos.device)[None]
    allowed = q_pos >= cols
    if window is not None:
        allowed = allowed & (cols > q_pos - window)
    return allowed[None, None]


def _chunk_bounds(t_q: int, t: int, c: int, n: int, window: int | None) -> tuple[torch.Tensor, int, int]:
    """Chunk [c, c + n) of t_q queries over t rows (the queries the last t_q positions) -> (its positions [n, 1],
    the first row it can read, the row after its last query's)."""
    first = t - t_q + c
    seen = first + n  # causal: no query of this chunk reads a row past its last one
    return torch.arange(first, seen)[:, None], visible_from(first, window), seen


def _mask_rows(mask: torch.Tensor | None, c: int, n: int, lo: int, seen: int) -> torch.Tensor | None:
    """The chunk's part of the model's mask (queries c..c+n-1, rows lo..seen-1), as a boolean (True: read)."""
    if mask is None:
        return None
    part = mask[:, :, c : c + n, lo:seen]
    return part if part.dtype == torch.bool else part > torch.finfo(part.dtype).min


def chunked_attention(query, key, value, mask, scaling, window: int | None = None) -> torch.Tensor:
    """Attention of query [B, H_q, T_q, D] over key / value [B, H_kv, T, D] (the queries the last T_q positions) in
    chunks of QUERY_CHUNK queries, each one SDPA call over the rows its queries can see (visible_from of its first
    query .. its last query's position): what sdpa_attention computes over every row under the model's mask (or the causal one,
    banded to `window` on a sliding layer, when mask is None), summed in SDPA's order per chunk (tests: equal to
    1e-5), without the rows no query of the chunk reads. In the tensors' own dtype. -> [B, T_q, H_q, D]"""
    t_q, t = query.shape[2], key.shape[2]
    outs = []
    for c in range(0, t_q, QUERY_CHUNK):
        q = query[:, :, c : c + QUERY_CHUNK]
        q_pos, lo, seen = _chunk_bounds(t_q, t, c, q.shape[2], window)
        allowed = _chunk_mask(_mask_rows(mask, c, q.shape[2], lo, seen), q_pos.to(key.device), seen, lo, window)
        outs.append(sdpa_attention(q, key[:, :, lo:seen], value[:, :, lo:seen], allowed, scaling))
    return torch.cat(outs, dim=1)


def _residual_materialized(query, k16, v16, k_hat, v_hat, mask, scaling, rows) -> torch.Tensor:
    """The residual buffer as decode reads it, up to QUERY_CHUNK queries: query q reads in fp16 the rows its cache
    has not encoded yet (LayerRows.encoded_end(q + 1) onwards) and the older rows encoded -- two score matrices
    [T_q, T], a mask choosing between them, one softmax, two value sets. -> [B, T_q, H_q, D]"""
    t_q, t = query.shape[2], k16.shape[2]
    q_pos = torch.arange(t - t_q, t, device=k16.device)[:, None]
    near = torch.arange(t, device=k16.device)[None] >= rows.encoded_end(q_pos + 1)  # [T_q, T]
    chunk_mask = _chunk_mask(mask, q_pos, t, window=rows.window)
    scores = torch.where(near, attention_scores(query, k16, chunk_mask, scaling),
                         attention_scores(query, k_hat, chunk_mask, scaling))
    probs = torch.softmax(scores, dim=-1)
    return attend(probs * near, v16, query.dtype) + attend(probs * ~near, v_hat, query.dtype)


def _residual_fused(query, k16, v16, k_hat, v_hat, mask, scaling, rows) -> torch.Tensor:
    """The same attention at long context, in chunks of QUERY_CHUNK queries, each one fused SDPA call over the
    rows its queries can see: the encoded rows [band, seen) and the fp16 rows [lo, seen) side by side, a boolean
    mask giving query q the encoded rows before encoded_end(q + 1) and the fp16 rows from there on (band: the first
    row the chunk's first query can read, 0 on a global layer; lo: the first query's encoded_end, or the band's
    start if later; it never decreases). The same softmax over the same scores as _residual_materialized, summed in
    SDPA's order (tests/stages/test_evaluate.py: equal to 1e-5), without [T_q, T] matrices in memory."""
    t_q, t = query.shape[2], k16.shape[2]
    outs = []
    for c in range(0, t_q, QUERY_CHUNK):
        q = query[:, :, c : c + QUERY_CHUNK]
        q_pos, band, seen = _chunk_bounds(t_q, t, c, q.shape[2], rows.window)
        q_pos = q_pos.to(k16.device)
        allowed = _chunk_mask(_mask_rows(mask, c, q.shape[2], band, seen), q_pos, seen, band, rows.window)
        first = rows.encoded_end(q_pos + 1)  # [chunk, 1]: the first row query q reads in fp16
        lo = max(int(first[0]), band)
        cols = torch.arange(band, seen, device=k16.device)[None]
        both = torch.cat([allowed & (cols < first), allowed[..., lo - band:] & (cols[:, lo - band:] >= first)], -1)
        keys = torch.cat([k_hat[:, :, band:seen], k16[:, :, lo:seen]], 2)
        values = torch.cat([v_hat[:, :, band:seen], v16[:, :, lo:seen]], 2)
        outs.append(sdpa_attention(q.float(), keys, values, both, scaling).to(query.dtype))
    return torch.cat(outs, dim=1)


def _served_rows(x: torch.Tensor) -> torch.Tensor:
    """K/V as the serving cache receives them: rounded to fp16 (sink and residual rows are stored so, and the
    codec encodes from them), computed on in float32."""
    return x.to(torch.float16).float()


def quantized_attention(policy: CachePolicy, rope: dict, ledger: Ledger | None,
                        perturb: Perturbation | None = None, windows: list[int | None] | None = None):
    """An attention function (see stages.hooks) that reads the cache exactly as serving/cache.py serves it
    when the tokens are decoded one at a time: K/V rounded to fp16; the sink rows (max(n_sink, prefix)) kept so;
    every other row through the codec (pre-RoPE recipes: RoPE inverted at the row's position first, then
    re-applied after decoding, in exporters/rope.py's float32 convention; smoothed keys divided by lambda before
    encoding and multiplied after); and the residual buffer -- query t reads in fp16 exactly the rows the cache
    still holds unflushed when t is decoded (exporters.served_rows.LayerRows.encoded_end). The served K/V stay
    float32 and the attention is computed in float32, as the block-wise reader and the oracle read the cache;
    only its output returns in the model's dtype. A sliding layer's window is the model's own mask; `windows`
    (stages.hooks.layer_windows of the model's config; None: all global) tells the ledger which rows such a layer
    holds when served (exporters.served_rows: the last window's rows, not every row of the evaluation window).

    policy and rope may be anywhere (policies are stored on CPU): each layer's calibrated tensors, lambda and RoPE
    table are moved once to the device its keys arrive on, that layer's own (under a device_map, its GPU)."""
    placed: dict[tuple[int, torch.device], tuple] = {}

    def layer_state(layer: int, device: torch.device) -> tuple:
        """(pk, pv, lambda [1, H, 1, D] or None, (cos, sin) [1, T, D]) of one layer, on `device`."""
        if (layer, device) not in placed:
            pk, pv = policy.layers[layer]
            lam = None if policy.smooth is None else policy.smooth[layer].float().to(device)[None, :, None, :]
            placed[layer, device] = (pk.to(device), pv.to(device), lam,
                                     tuple(x.to(device) for x in layer_rope(rope, layer)))
        return placed[layer, device]

    def attn(module, query, key, value, mask, scaling):
        layer = module.layer_idx
        pk, pv, lam, table = layer_state(layer, key.device)
        rows = layer_rows(policy, layer, windows[layer] if windows else None)
        b, h, t, d = key.shape
        s = rows.sink_end(t)
        k_in, v_in = key.float(), value.float()
        if perturb is not None:
            k_in = torch.cat([k_in[:, :, :s], perturb(k_in[:, :, s:])], 2)
            v_in = torch.cat([v_in[:, :, :s], perturb(v_in[:, :, s:])], 2)
        k16, v16 = _served_rows(k_in), _served_rows(v_in)             # post-RoPE keys, values [B, H, T, D]
        k_src = k16[:, :, s:]
        cos, sin = (x[:, s:t] for x in table)  # this layer's table (local / global RoPE)
        if policy.key_rope == "pre":
            k_src = invert_rope(k_src, cos, sin)
        if lam is not None:
            k_src = k_src / lam  # the cache stores K / lambda (rope pairs share lambda, so RoPE commutes)
        k_q, ek = fake_quant(k_src, pk, f"layer {layer} keys")
        v_q, ev = fake_quant(v16[:, :, s:], pv, f"layer {layer} values")
        if lam is not None:
            k_q = k_q * lam
        if policy.key_rope == "pre":
            k_q = apply_rope(k_q, cos, sin)
        k_hat = torch.cat([k16[:, :, :s], k_q], 2)  # float32, as the cache's readers decode them (any model dtype)
        v_hat = torch.cat([v16[:, :, :s], v_q], 2)
        if ledger is not None:
            held = rows.held(t)
            for kind, e, p in (("k", ek, pk), ("v", ev, pv)):
                ledger.add(kind, e, p, rows_q=held.n_encoded, rows_full=held.n_full_precision, per_row=b * h * d)
        if not rows.holds_back:  # every row past the sinks is read encoded from the step it arrives
            if long_forward(query.shape[2]):
                return chunked_attention(query.float(), k_hat, v_hat, mask, scaling, rows.window).to(query.dtype)
            return sdpa_attention(query.float(), k_hat, v_hat, mask, scaling).to(query.dtype)
        t_q = query.shape[2]
        if not long_forward(t_q):
            return _residual_materialized(query, k16, v16, k_hat, v_hat, mask, scaling, rows)
        return _residual_fused(query, k16, v16, k_hat, v_hat, mask, scaling, rows)

    return attn


def _served(ids: torch.Tensor, policy: CachePolicy) -> tuple[torch.Tensor, int]:
    """ids [1, T] -> (prefix + ids [1, P + T], P). Metrics are taken on the window's own T positions; the
    reference they compare with is the plain window, so a prefix's own context effect shows in KL."""
    if policy.prefix_ids is None or policy.prefix_ids.numel() == 0:
        return ids, 0
    return torch.cat([policy.prefix_ids.to(ids)[None], ids], dim=1), int(policy.prefix_ids.numel())


def policy_hidden(model: torch.nn.Module, ids: torch.Tensor, policy: CachePolicy, ledger: Ledger | None = None,
                  perturb: Perturbation | None = None) -> torch.Tensor:
    """ids [1, T] -> the final hidden states [T, hidden] on the window's own positions with the cache served
    under `policy` (after its prefix, if it has one); the head is applied chunk by chunk by the caller. The
    policy's calibrated tensors follow each layer to its own device (quantized_attention)."""
    run_ids, p = _served(ids, policy)  # [1, P + T]: the window after the policy's prefix (P >= 0)
    if policy.is_full_precision:
        return full_precision_hidden(model, run_ids)[p:]
    mask = "eager"
    if policy.engine is not None:  # a library's own cache, served through that library
        attn = engine_attention(policy.engine, model.config, ledger, perturb)
    else:
        attn = quantized_attention(policy, rope_tables(model, run_ids), ledger, perturb, layer_windows(model.config))
        mask = long_mask(run_ids.shape[1])
    with attention_override(model, attn, mask=mask):
        return model.model(run_ids, use_cache=False).last_hidden_state[0, p:]


def long_mask(t: int) -> str:
    """attention_override's mask mode for a forward of t positions through chunked_attention / _residual_fused:
    "serving" for a long one (no [T, T] float mask built), else "eager" (long_forward)."""
    return "serving" if long_forward(t) else "eager"


def full_precision_hidden(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """ids [1, T] -> the full-precision model's final hidden states [T, hidden]: the model's own attention, or for
    a long forward (long_forward) the same attention in chunks of queries over the rows each can see
    (chunked_attention, in the model's dtype), which on Gemma 3 at 32k skips the 15 sliding layers' [T, T] products
    and the causal half of the global ones (tests/stages/test_gemma3.py: equal to the model's own)."""
    t = ids.shape[1]
    if not long_forward(t):
        return model.model(ids, use_cache=False).last_hidden_state[0]
    windows = layer_windows(model.config)

    def attn(module, query, key, value, mask, scaling):
        return chunked_attention(query, key, value, mask, scaling, windows[module.layer_idx])

    with attention_override(model, attn, mask="serving"):
        return model.model(ids, use_cache=False).last_hidden_state[0]


def policy_logprobs(model: torch.nn.Module, ids: torch.Tensor, policy: CachePolicy, ledger: Ledger | None = None,
                    perturb: Perturbation | None = None) -> torch.Tensor:
    """ids [1, T] -> next-token log-probabilities [T, V] (float32) on the window's own positions with the cache
    served under `policy`. All T x V at once: for short windows and tests; fit takes them chunk by chunk."""
    return torch.log_softmax(lm_logits(model, policy_hidden(model, ids, policy, ledger, perturb)), -1)


def greedy_tokens(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Final hidden states [T, hidden] -> the head's argmax at each position [T], chunk by chunk (logit_rows): never
    the [T, V] logits at once (34 GB at Gemma 3's 262k vocabulary and 32k positions)."""
    step = logit_rows(model.config.vocab_size)
    return torch.cat([lm_logits(model, hidden[c : c + step]).argmax(-1) for c in range(0, hidden.shape[0], step)])


REF_HOLD_BYTES = 2 ** 32  # the reference's log-probabilities of one window are kept across policies up to this


class _WindowMetrics:
    """Next-token metrics of one window against the reference, over chunks of positions (stages.hooks.logit_rows):
    never more than a chunk of float32 full-vocabulary log-probabilities per side. The reference's chunks -- its
    log-probabilities and their exponentials, the probabilities KL weighs by -- are computed once and held when
    the whole window's fit in REF_HOLD_BYTES, else recomputed per policy; then the reference's own NLL and argmax
    come from the first policy's pass over them (no pass of their own: at Gemma 3's 32k one head pass over the
    window is about a minute and a half here)."""

    def __init__(self, model: torch.nn.Module, ref_hidden: torch.Tensor, targets: torch.Tensor):
        self.model, self.ref_hidden, self.targets = model, ref_hidden, targets
        t, vocab = ref_hidden.shape[0], model.config.vocab_size
        self.step = logit_rows(vocab)
        self.held = [] if 2 * t * vocab * 4 <= REF_HOLD_BYTES else None
        self._top: torch.Tensor | None = None  # [T], where the head computes (under a device_map: not the ids')
        self._nll_sum: float | None = None
        if self.held is not None:
            self._reference_pass(None)

    def _reference_pass(self, hidden: torch.Tensor | None) -> tuple[float, float, int, list]:
        """One pass over the reference's chunks (held ones from the first), recording its NLL and argmax where not
        known yet, and with `hidden` a policy's -> (its NLL, KL, top-1 agreements, KL rows)."""
        first = self._top is None
        tops, ref_nll, nll, kl, top1, rows = [], 0.0, 0.0, 0.0, 0, []
        for i, c in enumerate(range(0, self.ref_hidden.shape[0], self.step)):
            ref, ref_p = self._ref(i, c, fresh=first)
            if first:
                top = ref.argmax(-1)
                tops.append(top)
                ref_nll += self._nll(ref, c)
            else:
                top = self._top[c : c + self.step]
            if hidden is None:
                continue
            logp = torch.log_softmax(lm_logits(self.model, hidden[c : c + self.step]), -1)
            nll += self._nll(logp, c)
            terms = ref_p * (ref - logp)
            kl += float(terms.sum())
            rows.append(terms.sum(-1).double())  # where the head computes: summed there, read as floats at the end
            top1 += int((logp.argmax(-1) == top).sum())
        if first:
            self._top, self._nll_sum = torch.cat(tops), ref_nll
        return nll, kl, top1, rows

    @property
    def ref_top(self) -> torch.Tensor:
        if self._top is None:
            self._reference_pass(None)
        return self._top

    @property
    def ref_nll(self) -> float:
        if self._nll_sum is None:
            self._reference_pass(None)
        return self._nll_sum

    def _ref(self, i: int, c: int, fresh: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (log-probabilities, probabilities) of the reference on chunk i (positions c ...)."""
        if not fresh and self.held is not None:
            return self.held[i]
        ref = torch.log_softmax(lm_logits(self.model, self.ref_hidden[c : c + self.step]), -1)
        pair = (ref, ref.exp())
        if fresh and self.held is not None:
            self.held.append(pair)
        return pair

    def _nll(self, logp: torch.Tensor, c: int) -> float:
        tgt = self.targets[c : c + self.step].to(logp.device)  # the last position predicts nothing
        return -float(logp[: tgt.numel()].gather(1, tgt[:, None]).sum())

    def of(self, hidden: torch.Tensor | None) -> tuple[float, float, int, torch.Tensor]:
        """hidden [T, hidden] of a policy (None: the reference itself) -> (summed NLL, summed KL(ref || policy),
        top-1 agreements, KL per position [T] float64)."""
        if hidden is None:
            t = self.ref_top.numel()
            return self.ref_nll, 0.0, int(t), torch.zeros(t, dtype=torch.float64, device=self.ref_top.device)
        nll, kl, top1, rows = self._reference_pass(hidden)
        return nll, kl, top1, torch.cat(rows)


KL_BUCKETS = 8  # the window's positions in this many equal spans: is the error growing along the window?


def bucket_means(per_position: torch.Tensor, n: int = KL_BUCKETS) -> list[float]:
    """per_position [T] -> the mean of each of n consecutive, nearly equal spans of positions (torch.tensor_split)."""
    return [float(x.mean()) for x in torch.tensor_split(per_position, n)]


def ppl_ratio_interval(nll: torch.Tensor, ref_nll: torch.Tensor, n_tokens: int, n_boot: int = 2000,
                       seed: int = 0) -> tuple[float, float, float]:
    """Perplexity ratio to the reference on the same windows, with a 95% percentile-bootstrap interval.

    nll [S, W]: summed NLL of each evaluation window under each perturbation seed (S = 1: unperturbed);
    ref_nll [W]: the reference's on the same windows; n_tokens: predicted tokens per window. Each bootstrap
    replicate resamples windows (paired: the same windows for recipe and reference) and, independently, seeds,
    so the interval covers both the choice of text and the rounding chaos of a quantized cache.
    -> (ratio, lo, hi), ratio = exp(mean NLL - mean reference NLL) per token."""
    nll, ref_nll = nll.double(), ref_nll.double()
    s, w = nll.shape
    ratio = math.exp(float(nll.mean() - ref_nll.mean()) / n_tokens)
    gen = torch.Generator().manual_seed(seed)
    wi = torch.randint(0, w, (n_boot, w), generator=gen)
    si = torch.randint(0, s, (n_boot, s), generator=gen)
    per_window = nll[si].mean(1)                                   # [B, W]: seed-resampled mean per window
    diff = per_window.gather(1, wi).mean(1) - ref_nll[wi].mean(1)  # [B]
    lo, hi = torch.quantile(diff / n_tokens, torch.tensor([0.025, 0.975], dtype=torch.float64)).exp().tolist()
    return ratio, lo, hi


def reference_hidden(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """ids [1, T] -> the full-precision model's final hidden states [T, hidden] (the model's own attention): what
    every recipe's metrics compare with (_WindowMetrics applies the head chunk by chunk); full_precision_hidden."""
    return full_precision_hidden(model, ids)


def fit(inputs: Inputs, cfg: EvalConfig | None = None, progress: Callable[[int], None] | None = None,
        ref_hidden: torch.Tensor | None = None) -> StageResult:
    """-> meta["recipes"][name]: ppl, kl, top1, avg_bits, outlier fractions, ppl_ratio, ppl_ratio_ci95, kl_buckets
    (mean KL per position in KL_BUCKETS equal spans of the window) and ppl_seeds with perturbations; meta["units"]: the recipe x seed x window forwards evaluated (fp16's are the
    reference's own, one per window); tensors window_nll.<name> [S, W] and window_nll.reference [W] (summed NLL per
    window, S perturbation seeds, 1 without). ref_hidden [W, T, hidden]: the reference's final hidden states on
    these windows, computed before (the evaluate-reference stage); None: computed here, once per window."""
    cfg = cfg or EvalConfig()
    model, spec, windows, policies = inputs.model, inputs.spec, inputs.windows, inputs.policies
    seeds = list(cfg.perturb_seeds) or [None]
    n_win, t = windows.shape
    if ref_hidden is not None and tuple(ref_hidden.shape[:2]) != (n_win, t):
        raise ValueError(f"evaluation: the reference's hidden states are for {tuple(ref_hidden.shape[:2])} windows x "
                         f"positions, the windows are {(n_win, t)}")
    stats = {p.name: {"kl": 0.0, "top1": 0, "tokens": 0, "ledger": Ledger(),
                      "kl_positions": None,
                      "nll": torch.zeros(1 if p.is_full_precision else len(seeds), n_win, dtype=torch.float64)}
             for p in policies}
    ref_nll = torch.zeros(n_win, dtype=torch.float64)
    device = model_device(model)
    kv_elements = spec.n_layers * spec.n_kv_heads * spec.head_dim
    with torch.no_grad():
        for w in range(n_win):
            ids = windows[w : w + 1].to(device)
            hidden = (reference_hidden(model, ids) if ref_hidden is None
                      else ref_hidden[w].to(model.lm_head.weight.device))
            metrics = _WindowMetrics(model, hidden, ids[0, 1:])
            for policy in policies:
                st = stats[policy.name]
                runs = [None] if policy.is_full_precision else seeds
                for i, seed in enumerate(runs):
                    perturb = None if seed is None else Perturbation(
                        cfg.perturb_scale, torch.Generator().manual_seed(1_000_003 * seed + w))
                    if policy.is_full_precision and policy.prefix_ids is None:
                        hidden = None  # the reference itself
                    else:
                        hidden = policy_hidden(model, ids, policy, st["ledger"], perturb)
                    if policy.is_full_precision:
                        n_rows = ids.shape[1] + (0 if policy.prefix_ids is None else int(policy.prefix_ids.numel()))
                        st["ledger"].bits += FULL_PRECISION_BITS * 2 * n_rows * kv_elements
                        st["ledger"].elements += 2 * n_rows * kv_elements
                    nll, kl, top1, kl_rows = metrics.of(hidden)
                    st["nll"][i, w], st["kl"], st["top1"] = nll, st["kl"] + kl, st["top1"] + top1
                    st["kl_positions"] = kl_rows if st["kl_positions"] is None else st["kl_positions"] + kl_rows
                    st["tokens"] += ids.shape[1]
            ref_nll[w] = metrics.ref_nll  # known after the first policy's pass (or its own pass, if none)
            if progress:
                progress(1)
    n_tokens = t - 1
    recipes, tensors = {}, {"window_nll.reference": ref_nll}
    for name, st in stats.items():
        led, nll = st["ledger"], st["nll"]
        ratio, lo, hi = ppl_ratio_interval(nll, ref_nll, n_tokens)
        recipes[name] = {
            "ppl": math.exp(float(nll.mean()) / n_tokens), "kl": figures.kl(f"{name}/kl", st["kl"] / st["tokens"]),
            "top1": figures.fraction(f"{name}/top1", st["top1"] / st["tokens"]), "avg_bits": led.avg_bits,
            "outlier_fraction_k": led.outlier_fraction("k"), "outlier_fraction_v": led.outlier_fraction("v"),
            "ppl_ratio": ratio, "ppl_ratio_ci95": [lo, hi],
            "kl_buckets": [figures.kl(f"{name}/kl_buckets", x)
                           for x in bucket_means(st["kl_positions"] / (st["tokens"] // t))],
        }
        if nll.shape[0] > 1:
            recipes[name]["ppl_seeds"] = [math.exp(float(x) / n_tokens) for x in nll.mean(1)]
        tensors[f"window_nll.{name}"] = nll
    units = sum((1 if p.is_full_precision else len(seeds)) * n_win for p in policies)
    return StageResult(tensors, _meta(recipes, n_win, t, units, cfg))


def _meta(recipes: dict[str, dict], n_win: int, t: int, units: int, cfg: EvalConfig) -> dict:
    """The evaluation's meta: every recipe's figures, the windows and the perturbations they were taken under."""
    return {"recipes": recipes, "windows": int(n_win), "seq_len": int(t), "units": int(units),
            "perturb_seeds": list(cfg.perturb_seeds), "perturb_scale": cfg.perturb_scale if cfg.perturb_seeds else 0.0}


def combine(parts: list[StageResult], cfg: EvalConfig) -> StageResult:
    """Recipes evaluated one by one against the same reference (fit with ref_hidden, one recipe each) -> the result
    fit gives for all of them at once: their figures in the parts' order, their window NLLs, units summed."""
    first = parts[0]
    ref_nll = first.tensors["window_nll.reference"]
    recipes, tensors, units = {}, {"window_nll.reference": ref_nll}, 0
    for part in parts:
        assert (part.meta["windows"], part.meta["seq_len"]) == (first.meta["windows"], first.meta["seq_len"])
        # the same reference, recomputed from the same hidden states in another process (a cached part): its
        # float32 head and sums may differ in the last bits (measured: 4e-11 relative at 8192 tokens), never more
        assert torch.allclose(part.tensors["window_nll.reference"], ref_nll, rtol=1e-9, atol=0.0), (
            "recipes evaluated on other references")
        recipes.update(part.meta["recipes"])
        tensors.update({k: v for k, v in part.tensors.items() if k != "window_nll.reference"})
        units += part.meta["units"]
    return StageResult(tensors, _meta(recipes, first.meta["windows"], first.meta["seq_len"], units, cfg))


BITS_NOTE = ("avg_bits: the cache's bytes x 8 per cached K/V element, averaged over the evaluation window (codes, "
             "scales, outliers, and the sink / recent rows a recipe keeps at 16 bits): a \"4b\" recipe with 16 sink + "
             "128 recent rows shows ~6 bits on 1k-token windows, nearer 4 on long ones")   # the one explanation


# A 95% interval (ppl_ratio_interval) needs at least this many windows to be one. Its percentile bootstrap resamples
# W windows W times; the replicate made of one window W times, the most extreme, has probability (1/W)^W -- 25% at
# W = 2, 3.7% at W = 3, above the 2.5% each tail cuts off, so there the interval's ends are the most extreme single
# window's own ratios (two windows of one ratio: [1.0006, 1.0006]), a range of samples, not an
# interval; at W = 4, 0.39%.
MIN_INTERVAL_WINDOWS = 4


def interval_note(n_windows) -> str:
    """What follows an interval computed from n_windows windows (None: not known): "" from MIN_INTERVAL_WINDOWS
    on, else why it is not an interval, " (2 windows: not an interval)"."""
    if isinstance(n_windows, int) and not isinstance(n_windows, bool) and n_windows < MIN_INTERVAL_WINDOWS:
        return f" ({n_windows} window{'' if n_windows == 1 else 's'}: not an interval)"
    return ""


def interval_text(ci, n_windows=None) -> str:
    """A ppl-ratio 95% interval [lo, hi] as the tables print it ("-" without one), followed by interval_note. The one
    wording of it: the evaluation table, llama.cpp's, recommend's and `show <run id>`'s."""
    return f"[{ci[0]:.4f}, {ci[1]:.4f}]{interval_note(n_windows)}" if ci else "-"


def table(recipes: dict[str, dict], reference: str = "fp16", n_windows: int | None = None) -> str:
    """The comparison table, sorted by average bits; ppl/fp16 is the ratio on the same windows with its 95%
    interval when the evaluation computed one (n_windows: the evaluation's windows, interval_text); BITS_NOTE
    under it."""
    ref_ppl = recipes.get(reference, {}).get("ppl")
    width = max([22, *(len(n) + 1 for n in recipes)])
    note = interval_note(n_windows)  # after each interval, the column's header over the numbers
    head = (f"{'recipe':<{width}} {'avg_bits':>8} {'ppl':>9} {'ppl/fp16':>9} {'95% interval':>17}{'':{len(note)}} "
            f"{'KL':>8} {'top1':>7} {'sparse K/V %':>13}")
    lines = [head, "-" * len(head)]
    for name, r in sorted(recipes.items(), key=lambda kv: -kv[1]["avg_bits"]):
        if "ppl_ratio" in r:
            ratio = f"{r['ppl_ratio']:9.4f}"
            interval = f"{interval_text(r['ppl_ratio_ci95']):>17}{note}"
        else:
            ratio = f"{r['ppl'] / ref_ppl:9.4f}" if ref_ppl else f"{'-':>9}"
            interval = f"{'-':>17}{'':{len(note)}}"
        sparse = f"{100 * r['outlier_fraction_k']:.2f}/{100 * r['outlier_fraction_v']:.2f}"
        lines.append(f"{name:<{width}} {r['avg_bits']:>8.3f} {r['ppl']:>9.3f} {ratio} {interval} "
                     f"{r['kl']:>8.4f} {r['top1']:>7.4f} {sparse:>13}")
    return "\n".join(lines + [BITS_NOTE])


# The run's evaluation as stages (pipeline.app.stage_graph): REFERENCE once, RECIPE once per recipe (each keyed
# on its recipe, the calibration it reads and the reference: a cache entry of its own), STAGE putting them together.


@dataclass
class ReferenceJob:
    """The evaluate-reference stage's config: none. The reference's hidden states depend on the model, the
    evaluation windows and the code alone, which the runner's identities key."""


def _fit_reference(ctx: Context, inputs: dict, job: ReferenceJob, progress) -> StageResult:
    """-> tensors["hidden"] [W, T, hidden]: reference_hidden of every evaluation window (on the CPU: a few MB per
    window, 2.4 at SmolLM2's 1024 x 576 in float32)."""
    device, rows = model_device(ctx.model), []
    n_win, t = ctx.eval.shape
    with torch.no_grad():
        for w in range(n_win):
            rows.append(reference_hidden(ctx.model, ctx.eval[w : w + 1].to(device)).cpu())
            progress(1)
    return StageResult({"hidden": torch.stack(rows)}, {"windows": int(n_win), "seq_len": int(t)})


REFERENCE = Declaration("evaluate-reference", ReferenceJob, _fit_reference, units=eval_units)


@dataclass
class RecipeJob:
    """An evaluate-recipe-<name> stage's config: the recipe, whole (a recipe file edited under the same name
    changes the key), and the evaluation's knobs as they apply to it (recipe_job)."""
    eval: EvalConfig
    recipe: QuantConfig


def recipe_job(cfg: EvalConfig, q: QuantConfig) -> RecipeJob:
    """The job of one recipe: the whole EvalConfig (every knob it has or gains enters the key) with its list of
    recipes narrowed to this one -- the other recipes of the list change nothing this one computes, so a new
    `quant` or another eval.recipes leaves this entry valid."""
    return RecipeJob(dataclasses.replace(cfg, recipes=[q.name]), q)


def _fit_recipe(ctx: Context, inputs: dict, job: RecipeJob, progress) -> StageResult:
    policy = recipe_policy(job.recipe, ctx.spec.n_layers, inputs)
    return fit(Inputs(ctx.model, ctx.spec, ctx.eval, [policy]), job.eval, progress,
               ref_hidden=inputs[REFERENCE.name].tensors["hidden"])


RECIPE = Declaration("evaluate-recipe", RecipeJob, _fit_recipe,
                     inputs=lambda job: [REFERENCE.name, *inputs_of([job.recipe])],
                     suffix=lambda job: job.recipe.name, units=eval_units)


def recipe_stage(q: QuantConfig) -> str:
    """The name of recipe q's evaluate-recipe stage in a run's graph (Declaration.__call__'s naming)."""
    return f"{RECIPE.name}-{q.name}"


@dataclass
class EvaluateJob:
    """The evaluate stage's config: the evaluation's knobs and every recipe it puts together, whole."""
    eval: EvalConfig
    recipes: list[QuantConfig]


def _fit_stage(ctx: Context, inputs: dict, job: EvaluateJob, progress) -> StageResult:
    return combine([inputs[recipe_stage(q)] for q in job.recipes], job.eval)


STAGE = Declaration("evaluate", EvaluateJob, _fit_stage, inputs=lambda job: [recipe_stage(q) for q in job.recipes])
