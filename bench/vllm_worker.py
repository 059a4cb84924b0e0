"""The vLLM side of bench.vllm_serve, run inside .venv-vllm (scripts/install-vllm.sh): vLLM itself serves the
checkpoint folder, and this process reports what it held and computed. Imports only vLLM, torch and the
standard library, so the kvcalib environment and vLLM's pins never meet.

    .venv-vllm/bin/python -m bench.vllm_worker --checkpoint DIR --job job.json --out result.json

job.json: {"runs": [{"name", "kv_cache_dtype", "dtype"[, "kv_cache_memory_bytes", "max_num_seqs",
"max_num_batched_tokens" (smaller than a prompt: its prefill in chunks)]}], "windows": [[ids...]...],
"prompts": [[ids...]...], "max_new_tokens": N, "scales_only": bool[, "decode": {"prompt", "new_tokens", "repeats"}]
[, "prefix_caching": bool (the prompts' greedy run again, from the prefix cache), "again": N (that many more
times: greedy_again a list of N)]
[, "passkeys": [{"prompt", "answer"}] (greedy answers)] [decode's "batch": requests decoded together]}. result.json, per run: the k/v scales every attention layer holds
(`_k_scale_float` / `_v_scale_float`: what vLLM's CPU attention reads), the summed NLL of each window from
prompt logprobs (positions 1..T-1, as stages/evaluate.py scores a window), greedy continuations of each prompt,
and the wall time of loading and of scoring.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model in this process: its layers readable
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")            # GiB of KV cache (the windows need far less)
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

LAYER = re.compile(r"layers\.(\d+)\.")


def held_scales(model) -> list[dict]:
    """Every vLLM Attention layer's scales, in layer order: {"layer", "name", "k_scale", "v_scale"}."""
    from vllm.model_executor.layers.attention.attention import Attention

    out = []
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            m = LAYER.search(name)
            out.append({"layer": int(m.group(1)) if m else -1, "name": name,
                        "k_scale": float(module._k_scale_float), "v_scale": float(module._v_scale_float),
                        "k_scale_tensor": [float(x) for x in module._k_scale.detach().float().reshape(-1)],
                        "v_scale_tensor": [float(x) for x in module._v_scale.detach().float().reshape(-1)]})
    return sorted(out, key=lambda r: r["layer"])


def window_nll(llm, windows: list[list[int]]) -> list[float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if not windows:
        return []
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], params, use_tqdm=False)
    nll = []
    for w, out in zip(windows, outs):
        total = 0.0
        for pos in range(1, len(w)):
            total -= out.prompt_logprobs[pos][w[pos]].logprob
        nll.append(total)
    return nll


def greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if not prompts:
        return []
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def plugin_state():
    """serving.vllm_backend when the kvcalib plugin is installed here (else None)."""
    try:
        from serving import vllm_backend
    except ImportError:
        return None
    return vllm_backend


class _Profile:
    """cProfile around the decode steps alone when the job names a file (decode "profile": PATH + suffix), else
    nothing: a step is `with prof.on(is_decode):` ... and the stats are dumped (marshal) at the end."""

    def __init__(self, path: str | None) -> None:
        import cProfile

        self.path, self.prof = path, cProfile.Profile() if path else None

    def step(self, engine, timed: bool):
        if self.prof is None or not timed:
            return engine.step()
        self.prof.enable()
        try:
            return engine.step()
        finally:
            self.prof.disable()

    def dump(self) -> None:
        if self.prof is not None:
            self.prof.dump_stats(self.path)


def decode_rate(llm, prompt: list[int], new_tokens: int, repeats: int, profile: str | None = None) -> dict:
    """Decode tokens per second after `prompt`, timed step by step through the engine (LLMEngine.add_request, then
    step() until done): the steps after the one that emits the first token each decode one token; their wall time
    is the decode time (the prefill steps are reported apart). Best of `repeats` requests, one at a time."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    best = None
    prof = _Profile(profile)
    for r in range(repeats):
        engine.add_request(f"decode-rate-{r}", TokensPrompt(prompt_token_ids=prompt),
                           SamplingParams(max_tokens=1 + new_tokens, temperature=0.0, ignore_eos=True))
        steps, emitted = [], 0
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = prof.step(engine, emitted > 0 and r == repeats - 1)
            dt = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs if o.outputs) if outs else emitted
            steps.append((dt, n > emitted and emitted > 0))   # a step that added a token after the first
            emitted = max(emitted, n)
        decode = [dt for dt, is_decode in steps if is_decode]
        prefill = sum(dt for dt, is_decode in steps if not is_decode)
        row = {"context": len(prompt), "new_tokens": len(decode), "prefill_s": prefill, "decode_s": sum(decode),
               "tokens_per_s": len(decode) / max(sum(decode), 1e-9)}
        if best is None or row["tokens_per_s"] > best["tokens_per_s"]:
            best = row
    prof.dump()
    return best


def decode_rate_batch(llm, prompt, new_tokens: int, batch: int, profile: str | None = None) -> dict:
    """Decode tokens per second of `batch` requests served together -- of `prompt` each, or of prompt[r] (a list of
    prompts: distinct requests, whose blocks no prefix cache shares): the steps after every request has its first
    token each decode one token per request; their wall time is the decode time."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    prompts = prompt if prompt and isinstance(prompt[0], list) else [prompt] * batch
    for r in range(batch):
        engine.add_request(f"decode-batch-{r}", TokensPrompt(prompt_token_ids=prompts[r]),
                           SamplingParams(max_tokens=1 + new_tokens, temperature=0.0, ignore_eos=True))
    counts: dict = {}
    decode_s, prefill_s, decoded = 0.0, 0.0, 0
    prof = _Profile(profile)
    while engine.has_unfinished_requests():
        started = len(counts) == batch and all(c > 0 for c in counts.values())
        t0 = time.perf_counter()
        outs = prof.step(engine, started)
        dt = time.perf_counter() - t0
        before = sum(counts.values())
        for o in outs or []:
            if o.outputs:
                counts[o.request_id] = len(o.outputs[0].token_ids)
        if started:
            decode_s += dt
            decoded += sum(counts.values()) - before
        else:
            prefill_s += dt
    prof.dump()
    return {"context": len(prompts[0]), "batch": batch, "new_tokens": decoded, "prefill_s": prefill_s,
            "decode_s": decode_s, "tokens_per_s": decoded / max(decode_s, 1e-9)}


def run_one(checkpoint: str, run: dict, job: dict) -> dict:
    from vllm import LLM

    longest = max([len(w) for w in job.get("windows", [])] + [len(p) + job.get("max_new_tokens", 0)
                                                             for p in job.get("prompts", [])]
                  + [len(p["prompt"]) + len(p["answer"]) for p in job.get("passkeys", [])] + [64])
    decode = job.get("decode")
    if decode:
        longest = max([longest, len(decode["prompt"]) + decode["new_tokens"] + 1]
                      + [len(p) + decode["new_tokens"] + 1 for p in decode.get("batch_prompts", [])])
    kw = {}
    if run.get("kv_cache_memory_bytes"):   # the same cache memory for every configuration: capacities compare
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)   # (the legacy variable would override the argument)
        kw["kv_cache_memory_bytes"] = int(run["kv_cache_memory_bytes"])
    t0 = time.perf_counter()
    if run.get("max_num_seqs"):             # vLLM wants max_num_batched_tokens >= max_num_seqs
        kw["max_num_seqs"] = int(run["max_num_seqs"])
    batched = int(run.get("max_num_batched_tokens") or max(2048, longest + 16))   # smaller: prefills in chunks
    limit = json.loads(open(os.path.join(checkpoint, "config.json")).read()).get("max_position_embeddings")
    llm = LLM(model=checkpoint, kv_cache_dtype=run["kv_cache_dtype"], dtype=run["dtype"], enforce_eager=True,
              max_model_len=min(longest + 16, int(limit or longest + 16)), enable_prefix_caching=bool(job.get("prefix_caching")), seed=0,
              max_num_batched_tokens=batched, **kw)
    out = {"name": run["name"], "kv_cache_dtype": run["kv_cache_dtype"], "dtype": run["dtype"],
           "load_s": time.perf_counter() - t0}
    cc = llm.llm_engine.vllm_config.cache_config
    # vLLM's own figure: blocks it allocated x tokens per block (what its log reports as "KV cache size")
    out["capacity_tokens"] = int(cc.num_gpu_blocks) * int(cc.block_size)
    out["block_size"] = int(cc.block_size)
    out["kv_cache_memory_bytes"] = cc.kv_cache_memory_bytes
    out["prefix_caching"] = bool(cc.enable_prefix_caching)       # as the engine ran (the plugin may turn it off)
    out["max_num_batched_tokens"] = batched
    out["scales"] = llm.apply_model(held_scales)[0]
    plugin = plugin_state()
    if plugin is not None:
        out["held"] = llm.apply_model(plugin.held)[0]
    if not job.get("scales_only"):
        t0 = time.perf_counter()
        out["window_nll"] = window_nll(llm, job["windows"])
        out["score_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        out["greedy"] = greedy(llm, job["prompts"], job["max_new_tokens"])
        if job.get("prefix_caching"):   # the same prompts again: their full blocks now come from the prefix cache
            again = [greedy(llm, job["prompts"], job["max_new_tokens"]) for _ in range(int(job.get("again", 1)))]
            out["greedy_again"] = again if "again" in job else again[0]
        out["greedy_s"] = time.perf_counter() - t0
    if job.get("passkeys") and not job.get("scales_only"):   # greedy answers: the key's tokens, or not
        out["passkeys"] = greedy(llm, [p["prompt"] for p in job["passkeys"]], max(len(p["answer"])
                                                                                for p in job["passkeys"]))
    if decode and not job.get("scales_only"):
        prof = decode.get("profile")   # PATH: cProfile of the decode steps, PATH.<run>.b1 / .b<batch>
        out["decode"] = decode_rate(llm, decode["prompt"], decode["new_tokens"], decode.get("repeats", 2),
                                    prof and f"{prof}.{run['name']}.b1")
        if decode.get("batch", 1) > 1:
            out["decode_batch"] = decode_rate_batch(llm, decode.get("batch_prompts") or decode["prompt"],
                                                    decode["new_tokens"], decode["batch"],
                                                    prof and f"{prof}.{run['name']}.b{decode['batch']}")
    if plugin is not None:
        out["plugin_stats"] = json.loads(json.dumps(plugin.STATS))
    del llm
    gc.collect()
    return out


def probe_cast(seed: int = 0) -> list[dict]:
    """vLLM-cpu's cache write itself (cpu_attn_reshape_and_cache, the op its CPU attention calls) on known K/V,
    its stored bytes read back as fp8 e4m3 and compared, value by value, with exporters.codec's two casts of
    x / scale: the fraction equal to round-to-nearest and to round-toward-zero. The cache layout is the kernel's
    own, so stored and expected values are compared as sorted multisets (every value of one full block)."""
    import torch
    import vllm._custom_ops as ops

    from exporters.codec import fp8_toward_zero

    f8 = torch.float8_e4m3fn
    gen = torch.Generator().manual_seed(seed)
    n, h, d, block = 128, 2, 64, 128
    key = torch.randn(n, h, d, generator=gen) * 3
    value = torch.randn(n, h, d, generator=gen) * 0.05
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        for ks, vs in ((1.0, 1.0), (float(key.abs().max() / 448), float(value.abs().max() / 448))):
            cache = torch.zeros(1, h, 2 * block, d, dtype=torch.uint8)
            k_cache, v_cache = cache.chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key.to(dtype), value.to(dtype), k_cache, v_cache, torch.arange(n), "vec",
                                           ks, vs, "fp8")
            for kind, stored, x, s in (("key", k_cache, key, ks), ("value", v_cache, value, vs)):
                got = stored.contiguous().view(-1).view(f8).float().sort().values
                y = (x.to(dtype).float() / s).clamp(-448, 448).reshape(-1)
                nearest = y.to(f8).float().sort().values
                toward = fp8_toward_zero(y, f8).float().sort().values
                out.append({"dtype": str(dtype).removeprefix("torch."), "kind": kind, "scale": s,
                            "equal_nearest": float((got == nearest).float().mean()),
                            "equal_toward_zero": float((got == toward).float().mean())})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint")
    ap.add_argument("--job")
    ap.add_argument("--out", required=True)
    ap.add_argument("--probe-cast", action="store_true", help="only compare vLLM-cpu's fp8 cache write with "
                    "round-to-nearest and round-toward-zero (no model)")
    args = ap.parse_args()
    if args.probe_cast:
        with open(args.out, "w") as f:
            json.dump({"cast": probe_cast()}, f)
        return
    job = json.loads(open(args.job).read())
    import vllm

    results = {"vllm_version": vllm.__version__, "runs": []}
    for run in job["runs"]:
        results["runs"].append(run_one(args.checkpoint, run, job))
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f)
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
