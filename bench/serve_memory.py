"""Serving memory, latency and quality at declared contexts and batches: what the artifact saves at runtime.

python -m bench.serve_memory --artifact DIR --json PATH          (the embedded model, contexts 1k-32k, batch 1, 4)
python -m bench.serve_memory --model tiny --recipe int4-token --contexts 64,128 --batches 1,2 --steps 4 \
    --quality-contexts 64 --passkey-lengths 128 --json /tmp/x.json    (a smoke run: tiny model, no artifact)

Three caches on the same windows of wikitext-2 test.txt, all through the model's forward, for each model dtype of
--dtypes (default float32 and bfloat16: two references, each the model with its own DynamicCache; every ratio is
within one dtype):
- fp16:        transformers' DynamicCache in the model's dtype (float32: its bytes are twice an fp16 cache's;
               `cache_mb_at_fp16` counts them at 2 bytes per element; bfloat16: 2 bytes, as an fp16 cache) -- `dtype`
               in the JSON;
- artifact:    serving.cache.ArtifactCache(attention="blockwise"): single-token steps through the fused CPU
               kernel (serving/cpu_attention.py; `kernel` in the row says which ran, or why the block-wise torch
               path did), new rows encoded by its encoder, prefill chunks attending to their own rows in full
               precision and to the history block by block (serving/blockwise.py);
- materialize: the same cache with attention="materialize" (every row decoded at every step: the old path).

A batch-B row prefills one window at batch 1 and repeats its stored rows to the batch (Cache.batch_repeat_interleave:
every row copied into each sequence's storage), then decodes B sequences -- memory and decode time are those of B
sequences, prefill_s that of one window plus the repeat (`prefill_batch` in the row); --full-batch-prefill prefills
B different windows instead (a 2-core CPU needs minutes per 16k window).

Per (context, batch, cache) row, each in a fresh process (`--row`), so that no allocator state of another row is
counted or reused: load the model, return freed heap pages to the OS (glibc malloc_trim) and read the resident
set size (RSS) -- the baseline, the model's weights included (`weights_mb` reports them apart) -- then prefill the
context in chunks of --chunk tokens, trim again, and decode --steps tokens of the real continuation
(teacher-forced, so every cache decodes the same tokens). RSS is sampled every --sample-ms in a thread during
prefill and during decode (psutil): the sampled peak sees every temporary an op holds for longer than the interval,
torch's CPU allocator included (its memory is ordinary heap memory, which tracemalloc cannot see and which torch
keeps no CPU statistics of). peak_mb_above_weights = decode-time peak RSS - baseline. The cache's own accounting
(ArtifactCache.accounting): packed codes (or fp8 / fp16 encoded rows), scales / zero-points, sparse outliers,
sink rows, residual rows, static tensors (their sum: cache_mb, the bytes held), the page capacity allocated but
holding nothing yet (reserved_capacity_mb: the unused rows of the last --page-row page of each layer's K and V,
unused outlier slots; stored rows are never copied when rows are appended), and the largest live temporary: for
the block-wise attention its largest block working set as it counts it, for materialize one layer's decoded K
and V (float32), for fp16 none.
prefill_s is the prefill wall time; decode_ms_per_token the median step; both also as ratios to the fp16 row
of the same dtype, context and batch, measured in the same invocation. step_read_mb: what one decode step reads of
the cache (step_bytes: DynamicCache's attention reads K and V and its update's torch.cat reads them again to copy
them; the artifact's attention reads the stored bytes and the RoPE table rows once, its update copies nothing).

Quality (in the parent process, batch 1, --quality-prompts windows per context of --quality-contexts): the
continuation's perplexity (teacher-forced next-token NLL of --continuation tokens after the context) and the
per-step greedy agreement (the artifact's argmax == the fp16 cache's argmax, same context at every step);
passkey retrieval (stages/probes.py prompts, needle at 5 depths per --passkey-lengths, 8 greedy tokens) as hits.

A context beyond the model's max_position_embeddings is run with the model's limit -- and the artifact's binding of
it -- raised for that row (RoPE
extrapolates; memory and time are still those of that many rows, quality is not claimed): `beyond_positions`.
An artifact's shared prefix, if it has one, is not served here (as bench/serve.py).

JSON: {"rows": [{"context", "batch", "cache", "peak_mb_above_weights", "prefill_s", "decode_ms_per_token", ...}],
"agreement_per_step_4k": float | null, "passkey": {"fp16": int, "artifact": int}, "quality": {...}, "setup": {...}}
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager, nullcontext

import torch
from transformers import DynamicCache

from bench.common import wikitext_dir, write_json
from serving.cache import BLOCK, PAGE, cache_kwargs

CACHES = ("fp16", "artifact", "materialize")
MB = 2 ** 20


# ---- memory --------------------------------------------------------------------------------------------------

def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def trim() -> None:
    """Return freed heap pages to the OS (glibc), so that RSS measures what is live; a no-op elsewhere."""
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """Samples the process RSS every `interval` seconds in a thread while the block runs; .peak in bytes."""

    def __init__(self, interval: float):
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            self._stop.wait(self.interval)

    def __enter__(self):
        self.peak = rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


# ---- model, policy, data ---------------------------------------------------------------------------------------

def load(args):
    """(model bundle, CachePolicy) from --model and --artifact or --recipe (a calibration-free recipe only)."""
    from pipeline.config import ModelConfig
    from pipeline.model import load_model

    cfg = ModelConfig(name="tiny", source="tiny") if args.model == "tiny" else ModelConfig()
    cfg.dtype = args.dtype
    lm = load_model(cfg)
    if args.artifact:
        from exporters.native import load_artifact

        policy = load_artifact(args.artifact, lm.spec).policy  # strict: refuses an artifact of another model
    else:
        from pipeline.config import load_recipe
        from stages import recipe as recipe_stage

        policy = recipe_stage.build_policy(load_recipe(args.recipe), lm.spec.n_layers, {})
    return lm, policy


_IDS: dict[int, torch.Tensor] = {}


def text_ids(tokenizer, need: int) -> torch.Tensor:
    """At least `need` tokens of test.txt from its start when it has them (only the characters they need are
    tokenized: a prefix of ~8 characters per token, else the whole text)."""
    from pipeline.data import read_text, tokenize

    if need not in _IDS:
        text = read_text(wikitext_dir() / "test.txt", "text")
        ids = tokenize(tokenizer, text[:8 * need + 1024])
        _IDS[need] = ids if ids.numel() >= need else tokenize(tokenizer, text)
    return _IDS[need]


def windows(tokenizer, batch: int, length: int, offset: int = 0) -> torch.Tensor:
    """[batch, length] consecutive windows of test.txt from `offset` (repeated if the text is too short)."""
    need = offset + batch * length
    ids = text_ids(tokenizer, need)
    if ids.numel() < need:
        ids = ids.repeat(-(-need // ids.numel()))
    return ids[offset:need].view(batch, length)


def make_cache(kind: str, model, policy, block: int, page: int):
    from serving.cache import ArtifactCache

    if kind == "fp16":
        return DynamicCache(config=model.config)
    limit = int(model.config.max_position_embeddings)
    if policy.model is not None and policy.model["max_positions"] < limit:  # positions_for raised the model's limit:
        # the artifact's binding states the model's own, so the row raises it there too (serving.cache.bind)
        policy = dataclasses.replace(policy, model={**policy.model, "max_positions": limit})
    return ArtifactCache(policy, model, attention="blockwise" if kind == "artifact" else "materialize", block=block,
                         page=page)


def served(kind: str, model, cache):
    if kind != "artifact":
        return nullcontext()
    from serving.blockwise import serving

    return serving(model, cache)


@contextmanager
def positions_for(model, n: int):
    """The model's position limit raised to n for the block if needed (yields whether it was)."""
    previous = int(model.config.max_position_embeddings)
    model.config.max_position_embeddings = max(previous, n)
    try:
        yield n > previous
    finally:
        model.config.max_position_embeddings = previous


def held(kind: str, cache, model) -> dict:
    """The cache's own accounting in bytes: what it holds by kind (their sum is "total"), the page capacity
    allocated but holding nothing yet ("reserved_capacity_bytes", apart from the total: it is in the RSS), and
    the largest live temporary."""
    from serving.cache import HELD_KINDS

    if kind == "fp16":
        held = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        return {"total": sum(t.numel() * t.element_size() for t in held),
                "at_fp16": 2 * sum(t.numel() for t in held), "reserved_capacity_bytes": 0,
                "largest_temporary_bytes": 0}
    acc = cache.accounting()
    out = {k: acc[k] for k in HELD_KINDS} | {"total": cache.nbytes(),
                                             "reserved_capacity_bytes": acc["reserved_capacity_bytes"]}
    assert sum(acc[k] for k in HELD_KINDS) == out["total"], "the accounting's kinds must sum to the bytes held"
    if kind == "artifact":
        out["largest_temporary_bytes"] = acc["largest_decode_temporary_bytes"]
        out["largest_prefill_temporary_bytes"] = acc["largest_prefill_temporary_bytes"]
    else:  # materialize: one layer's every row decoded, K and V, in the model's dtype
        layer = cache.layers[0]
        b = layer._batch()
        h, d = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
        d = getattr(model.config, "head_dim", None) or d
        out["largest_temporary_bytes"] = 2 * b * h * layer.get_seq_length() * d * torch.finfo(layer.dtype).bits // 8
    return out


# ---- one row (a fresh process) ---------------------------------------------------------------------------------

def prefill(model, cache, ids: torch.Tensor, context: int, chunk: int) -> None:
    """The first `context` tokens of ids into the cache, `chunk` at a time (only the last position's logits)."""
    for s in range(0, context, chunk):
        model(ids[:, s:min(s + chunk, context)], cache=cache, use_cache=True, logits_to_keep=1)


def measure_row(args, context: int, batch: int, kind: str, dtype: str) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    args.dtype = dtype
    lm, policy = load(args)
    model = lm.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    shared = batch > 1 and not args.full_batch_prefill
    ids = windows(lm.tokenizer, 1 if shared else batch, context + args.steps)
    trim()
    base = rss()
    interval = args.sample_ms / 1000
    with positions_for(model, context + args.steps) as beyond, torch.no_grad():
        cache = make_cache(kind, model, policy, args.block, args.page)
        with served(kind, model, cache):
            start = time.perf_counter()
            with PeakRSS(interval) as prefill_peak:
                prefill(model, cache, ids, context, args.chunk)
                if shared:  # one prefill at batch 1, every stored row then repeated to the batch
                    cache.batch_repeat_interleave(batch)
                    ids = ids.repeat(batch, 1)
            prefill_s = time.perf_counter() - start
            trim()
            steps = []
            with PeakRSS(interval) as decode_peak:
                for i in range(args.steps):
                    t0 = time.perf_counter()
                    model(ids[:, context + i:context + i + 1], cache=cache, use_cache=True)
                    steps.append(time.perf_counter() - t0)
    acc = held(kind, cache, model)
    read = step_bytes(kind, cache, acc)
    return {"context": context, "batch": batch, "cache": kind, **read,
            "peak_mb_above_weights": (decode_peak.peak - base) / MB,
            "prefill_peak_mb_above_weights": (prefill_peak.peak - base) / MB,
            "prefill_s": prefill_s, "decode_ms_per_token": 1000 * statistics.median(steps),
            "cache_mb": acc["total"] / MB, "cache_mb_at_fp16": acc.get("at_fp16", acc["total"]) / MB,
            "reserved_capacity_mb": acc["reserved_capacity_bytes"] / MB,
            "largest_temporary_mb": acc["largest_temporary_bytes"] / MB,
            "accounting_bytes": acc, "baseline_rss_mb": base / MB, "weights_mb": weights / MB,
            "beyond_positions": bool(beyond), "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "prefill_batch": 1 if shared else batch, "kernel": kernel_route(kind)}


def step_bytes(kind: str, cache, acc: dict) -> dict:
    """What one decode step reads of the cache, in MB. fp16 (transformers' DynamicCache): its update concatenates
    the new row to every layer's K and V (torch.cat reads the whole cache and writes it anew) and the attention
    reads K and V once -- attention_read_mb = the cache, update_copy_mb = the cache read again by the copy. artifact:
    the attention reads what is stored once (codes, scales / zero-points, outliers, sink and residual rows, the
    static tensors) plus, for pre-RoPE keys, one row of the cos / sin table per encoded position (D / 2 x 2
    float32); the update encodes the new row and copies nothing (update_copy_mb 0). materialize: every row decoded
    into float32 K and V (written, then read by the attention) on top of the stored bytes."""
    if kind == "fp16":
        return {"attention_read_mb": acc["total"] / MB, "update_copy_mb": acc["total"] / MB,
                "step_read_mb": 2 * acc["total"] / MB}
    rope = 0
    for layer in cache.layers:
        if layer.policy.key_rope == "pre" and layer.k_block is not None:
            b, _, n, d = layer.k_block.shape
            rope += n * d * 4            # D / 2 cos and D / 2 sin per position, float32 (shared by the batch)
    stored = acc["total"] + rope
    # materialize: every layer's rows decoded into K and V in the model's dtype (written, then read by its attention)
    extra = 0 if kind == "artifact" else 2 * len(cache.layers) * acc["largest_temporary_bytes"]
    return {"attention_read_mb": (stored + extra) / MB, "update_copy_mb": 0.0, "step_read_mb": (stored + extra) / MB}


def kernel_route(kind: str) -> str:
    """Which attention served the decode steps: the fused CPU kernel or the block-wise torch path (the reason)."""
    if kind != "artifact":
        return "transformers sdpa" if kind == "fp16" else "transformers sdpa over decoded rows"
    from serving import cpu_attention

    st = cpu_attention.status()
    return "fused CPU kernel" if st["available"] else f"block-wise torch ({st['reason']})"


def run_row(args, context: int, batch: int, kind: str, dtype: str) -> dict:
    cmd = [sys.executable, "-m", "bench.serve_memory", "--row", f"{context},{batch},{kind},{dtype}",
           *args.passthrough]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode:
        raise SystemExit(f"row {context},{batch},{kind} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- quality (the parent process) ------------------------------------------------------------------------------

def teacher_forced(model, cache, kind: str, ids: torch.Tensor, context: int, chunk: int) -> torch.Tensor:
    """Logits [T_cont, V] predicting ids[0, context + 1 ...]: prefill the context, then one token per step."""
    out = []
    with torch.no_grad(), served(kind, model, cache):
        for s in range(0, context, chunk):
            logits = model(ids[:, s:min(s + chunk, context)], cache=cache, use_cache=True, logits_to_keep=1).logits
        out.append(logits[0, -1])
        for i in range(context, ids.shape[1] - 1):
            out.append(model(ids[:, i:i + 1], cache=cache, use_cache=True).logits[0, -1])
    return torch.stack(out)


def quality(args, lm, policy) -> dict:
    model = lm.model
    if args.threads:
        torch.set_num_threads(args.threads)
    res = {}
    for context in args.quality_contexts:
        nll = {"fp16": [], "artifact": []}
        agree = total = 0
        for w in range(args.quality_prompts):
            ids = windows(lm.tokenizer, 1, context + args.continuation + 1, offset=w * (context + args.continuation + 1))
            target = ids[0, context:]
            with positions_for(model, ids.shape[1]):
                logits = {kind: teacher_forced(model, make_cache(kind, model, policy, args.block, args.page), kind, ids,
                                               context, args.chunk) for kind in ("fp16", "artifact")}
            for kind, lg in logits.items():
                nll[kind].append(torch.nn.functional.cross_entropy(lg.float(), target, reduction="sum").item())
            agree += int((logits["fp16"].argmax(-1) == logits["artifact"].argmax(-1)).sum())
            total += target.numel()
        res[str(context)] = {"perplexity": {k: float(torch.tensor(sum(v) / total).exp()) for k, v in nll.items()},
                             "agreement_per_step": agree / total, "tokens": total}
    return res


def passkey(args, lm, policy) -> dict:
    from serving.blockwise import generate
    from stages.probes import passkey_prompt

    model, tok = lm.model, lm.tokenizer
    rng = random.Random(0)
    hits = {"fp16": 0, "artifact": 0}
    kw = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    for n in args.passkey_lengths:
        for depth in (0.1, 0.3, 0.5, 0.7, 0.9):
            key = rng.randint(10000, 99999)
            prompt = torch.tensor([passkey_prompt(tok, n, depth, key)[0]])
            mask = torch.ones_like(prompt)
            with torch.no_grad(), positions_for(model, prompt.shape[1] + 8):
                ref = model.generate(prompt, attention_mask=mask, **cache_kwargs(model, DynamicCache(config=model.config)),
                                     **kw)
                got, _ = generate(model, policy, prompt, attention_mask=mask, block=args.block, page=args.page, **kw)
            for name, out in (("fp16", ref), ("artifact", got)):
                hits[name] += int(str(key) in tok.decode(out[0, prompt.shape[1]:]))
    return hits


# ---- the table -------------------------------------------------------------------------------------------------

def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", default=None, help="artifact folder (the embedded model's, unless --model tiny)")
    ap.add_argument("--recipe", default=None, help="without --artifact: a calibration-free recipe (int4-token, kivi-2)")
    ap.add_argument("--model", default="embedded", choices=["embedded", "tiny"])
    ap.add_argument("--dtype", default="float32", help="the model's dtype for quality and passkey")
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="the model dtypes timed: each row runs the model and its DynamicCache in that dtype, and the "
                         "artifact cache beside the same model (ratios within a dtype)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--contexts", type=_ints, default=[1024, 4096, 16384, 32768])
    ap.add_argument("--batches", type=_ints, default=[1, 4])
    ap.add_argument("--caches", default=",".join(CACHES))
    ap.add_argument("--steps", type=int, default=16, help="decode steps per row (median reported)")
    ap.add_argument("--chunk", type=int, default=1024, help="prefill chunk, tokens")
    ap.add_argument("--block", type=int, default=BLOCK, help="positions per block of the block-wise attention")
    ap.add_argument("--page", type=int, default=PAGE, help="encoded rows per page of the artifact cache's storage")
    ap.add_argument("--full-batch-prefill", action="store_true",
                    help="prefill all `batch` windows (default: one window at batch 1, its cache repeated to the batch)")
    ap.add_argument("--sample-ms", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--quality-contexts", type=_ints, default=[4096])
    ap.add_argument("--quality-prompts", type=int, default=4)
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--passkey-lengths", type=_ints, default=[1024, 2048, 4096, 8192])
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not (args.artifact or args.recipe):
        ap.error("give --artifact DIR (or --recipe NAME for a calibration-free recipe)")
    raw = list(sys.argv[1:] if argv is None else argv)
    keep = ("--artifact", "--recipe", "--model", "--steps", "--chunk", "--block", "--page", "--sample-ms",
            "--threads", "--full-batch-prefill")
    flags = ("--full-batch-prefill",)  # no value follows these
    args.passthrough = [x for i, x in enumerate(raw)
                        if x.split("=")[0] in keep or (i and raw[i - 1] in keep and raw[i - 1] not in flags)]
    return args


def main(argv=None) -> None:
    args = parse(argv)
    if args.row:
        context, batch, kind, dtype = args.row.split(",")
        print(json.dumps(measure_row(args, int(context), int(batch), kind, dtype)))
        return
    start = time.perf_counter()
    caches = [c for c in args.caches.split(",") if c]
    unknown = set(caches) - set(CACHES)
    if unknown:
        raise SystemExit(f"--caches: unknown {sorted(unknown)}; choose from {CACHES}")
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = set(dtypes) - {"float32", "bfloat16", "float16"}
    if bad:
        raise SystemExit(f"--dtypes: unknown {sorted(bad)}; choose from float32, bfloat16, float16")
    from serving import cpu_attention

    print(f"decode attention of the artifact cache: {kernel_route('artifact')}"
          + (f" ({cpu_attention.status()['path']})" if cpu_attention.available() else ""), flush=True)
    rows = []
    for dtype in dtypes:
        for context in args.contexts:
            for batch in args.batches:
                by = {}
                for kind in caches:
                    by[kind] = run_row(args, context, batch, kind, dtype)
                    r = by[kind]
                    print(f"{dtype:<8} {context:>6} x{batch} {kind:<11} peak {r['peak_mb_above_weights']:9.1f} MB above "
                          f"the weights (cache {r['cache_mb']:.1f} MB + {r['reserved_capacity_mb']:.2f} MB reserved, "
                          f"largest temporary {r['largest_temporary_mb']:.2f} MB), prefill {r['prefill_s']:.2f} s, "
                          f"decode {r['decode_ms_per_token']:.1f} ms/token, reads {r['step_read_mb']:.1f} MB/step",
                          flush=True)
                if "fp16" in by:
                    ref = by["fp16"]
                    for r in by.values():
                        r["peak_ratio_to_fp16"] = r["peak_mb_above_weights"] / max(ref["peak_mb_above_weights"], 1e-9)
                        r["prefill_ratio_to_fp16"] = r["prefill_s"] / ref["prefill_s"]
                        r["decode_ratio_to_fp16"] = r["decode_ms_per_token"] / ref["decode_ms_per_token"]
                        r["read_ratio_to_fp16"] = r["step_read_mb"] / ref["step_read_mb"]
                    for kind, r in by.items():
                        if kind != "fp16":
                            print(f"{dtype:<8} {context:>6} x{batch} {kind:<11} / {dtype} DynamicCache: decode "
                                  f"{r['decode_ratio_to_fp16']:.3f}, prefill {r['prefill_ratio_to_fp16']:.3f}, peak "
                                  f"{r['peak_ratio_to_fp16']:.3f}, bytes read {r['read_ratio_to_fp16']:.3f}", flush=True)
                rows.extend(by.values())
    lm, policy = load(args)
    q = quality(args, lm, policy) if args.quality_contexts else {}
    for context, r in q.items():
        print(f"quality at {context}: perplexity fp16 {r['perplexity']['fp16']:.3f} artifact "
              f"{r['perplexity']['artifact']:.3f}, per-step greedy agreement {r['agreement_per_step']:.4f} "
              f"over {r['tokens']} tokens")
    keys = passkey(args, lm, policy) if args.passkey_lengths else {"fp16": 0, "artifact": 0}
    print(f"passkey over {5 * len(args.passkey_lengths)} prompts: fp16 {keys['fp16']}, artifact {keys['artifact']}")
    print(f"wall {time.perf_counter() - start:.0f} s")
    write_json(args.json, {
        "rows": rows,
        "agreement_per_step_4k": q["4096"]["agreement_per_step"] if "4096" in q else None,
        "passkey": keys, "quality": q,
        "setup": {"model": args.model, "artifact": args.artifact, "recipe": args.recipe or policy.name,
                  "dtype": args.dtype, "dtypes": dtypes, "kernel": kernel_route("artifact"), "steps": args.steps, "chunk": args.chunk, "block": args.block,
                  "page": args.page,
                  "sample_ms": args.sample_ms, "threads": args.threads or torch.get_num_threads(),
                  "passkey_prompts": 5 * len(args.passkey_lengths),
                  "memory": "RSS sampled in a thread (psutil), each row in a fresh process after malloc_trim"}})


if __name__ == "__main__":
    main()
