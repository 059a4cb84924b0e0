"""llama.cpp's own perplexity on our evaluation windows, for each of its KV cache types, run inside .venv-llamacpp
(scripts/install-llamacpp.sh). Imports only llama_cpp (llama-cpp-python's bindings, their low-level C API), numpy
and the standard library, so the kvcalib environment and llama.cpp's build never meet.

    .venv-llamacpp/bin/python pipeline/llamacpp_worker.py --gguf MODEL.gguf --tokens TOKENS.npy \
        --types f16,q8_0,q4_0,q8_0/q4_0 --threads 2 --json OUT.json

TOKENS.npy: an integer array [n_windows, seq_len] (np.save; read with allow_pickle=False), the windows' ids exactly
as fed: nothing is added, so a BOS the model needs is already the first id. A type is one cache type for K and V
(`q8_0`) or a `K/V` pair (`q8_0/q4_0`). Per type, one context (n_ctx = seq_len, flash attention on: llama.cpp
refuses a quantized V cache without it, and f16 gets the same attention path so the ratios compare caches only;
nothing offloaded); per window, the memory cleared and the ids decoded in batches with logits for positions
0..T-2. Each batch's logits are scored as they come, a few rows at a time in float64 (Gemma 3's 262144-entry
vocabulary makes the whole [T, vocab] matrix gigabytes): the summed NLL of ids 1..T-1, as stages/evaluate.py scores
a window, and the argmax at each scored position (for top-1 agreement with f16).

llama.cpp (the version 0.3.36 vendors) rotates K and V by a Hadamard matrix before storing them in a quantized
cache (head sizes divisible by 64: SmolLM2's 64, Gemma 3's 256), so its q4_0 is a rotated q4_0; `--attn-rot off`
(its LLAMA_ATTN_ROT_DISABLE) measures plain blockwise quantization instead. f16 is never rotated.

OUT.json: {"llama_cpp_version", "gguf", "seq_len", "n_windows", "threads", "attn_rot", "results": {type: {"type_k",
"type_v", "sum_nll": [per window], "n_tokens": [per window], "argmax": [[T-1 ids] per window], "seconds"}}},
rewritten atomically after each type. Bad input exits 2 with the field, the allowed values and what was given.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

import numpy as np

KV_TYPES = ("f16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")  # llama.cpp's CPU cache types (--cache-type-k)
N_BATCH = 512
SCORE_ELEMENTS = 1 << 25  # logits scored per step (rows x vocab): 256 MiB of float64


class InputError(ValueError):
    """An argument or input file the worker refuses; main() prints it and exits 2."""


def parse_types(spec: str) -> dict[str, tuple[str, str]]:
    """"f16,q8_0/q4_0" -> {"f16": ("f16", "f16"), "q8_0/q4_0": ("q8_0", "q4_0")}, in the order given."""
    out: dict[str, tuple[str, str]] = {}
    for item in spec.split(","):
        item = item.strip()
        parts = item.split("/")
        if len(parts) > 2 or not all(parts):
            raise InputError(f"--types: {item!r} is not a cache type or a K/V pair; give NAME or K/V with NAME "
                             f"one of {', '.join(KV_TYPES)} (got --types {spec!r})")
        for name in parts:
            if name not in KV_TYPES:
                raise InputError(f"--types: unknown cache type {name!r}; allowed: {', '.join(KV_TYPES)} "
                                 f"(or a K/V pair such as q8_0/q4_0); got --types {spec!r}")
        if item in out:
            raise InputError(f"--types: {item!r} is given twice (got --types {spec!r})")
        out[item] = (parts[0], parts[-1])
    return out


def load_tokens(path: str) -> np.ndarray:
    """TOKENS.npy -> int32 [n_windows, seq_len], or an InputError naming what is wrong."""
    try:
        tokens = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InputError(f"--tokens: cannot read {path} as a .npy array ({exc})") from exc
    if tokens.ndim != 2 or tokens.dtype.kind not in "iu":
        raise InputError(f"--tokens: expected a 2-D integer array [n_windows, seq_len], got a {tokens.ndim}-D "
                         f"{tokens.dtype} array of shape {tokens.shape} from {path}")
    if tokens.shape[0] < 1 or tokens.shape[1] < 2:
        raise InputError(f"--tokens: need at least 1 window of at least 2 ids, got shape {tokens.shape} from {path}")
    return tokens.astype(np.int64)


def _quiet_logs(llama_cpp):
    """Route llama.cpp's log to stderr, warnings and errors only (its info lines are hundreds per context)."""
    last = [0]

    @llama_cpp.llama_log_callback
    def log(level, text, _user):
        level = last[0] if level == 5 else level  # 5: GGML_LOG_LEVEL_CONT, continues the previous line
        last[0] = level
        if level in (3, 4):                        # ggml.h: GGML_LOG_LEVEL_WARN = 3, ERROR = 4
            sys.stderr.write(text.decode("utf-8", "replace"))
    llama_cpp.llama_log_set(log, ctypes.c_void_p(0))
    return log  # the caller keeps it alive: llama.cpp holds only the function pointer


def score_rows(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
    """logits: [R, V] float32, targets: [R] -> (summed NLL of the targets in float64, argmax [R])."""
    x = logits.astype(np.float64)                  # [R, V], then exp(x - max) in place: one float64 copy
    picked = x[np.arange(len(targets)), targets]   # [R]
    top = x.max(axis=1)
    x -= top[:, None]
    np.exp(x, out=x)
    nll = top + np.log(x.sum(axis=1)) - picked
    return float(nll.sum()), logits.argmax(axis=1)


class Scorer:
    """One llama.cpp context over the loaded model, with one cache type, scoring windows of seq_len ids."""

    def __init__(self, llama_cpp, model, seq_len: int, type_k: str, type_v: str, threads: int):
        self.lib = llama_cpp
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = seq_len
        params.n_batch = params.n_ubatch = min(N_BATCH, seq_len)
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = threads
        params.type_k = getattr(llama_cpp, f"GGML_TYPE_{type_k.upper()}")
        params.type_v = getattr(llama_cpp, f"GGML_TYPE_{type_v.upper()}")
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.offload_kqv = False
        params.op_offload = False
        params.embeddings = False
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp refused a context with K cache {type_k}, V cache {type_v}, "
                               f"n_ctx {seq_len} (its log above says why)")
        self.n_batch = params.n_batch
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self.rows = max(1, SCORE_ELEMENTS // self.n_vocab)
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)

    def window(self, ids: np.ndarray) -> tuple[float, int, list[int]]:
        """ids: [T] -> (summed NLL of ids[1:], T - 1, argmax at positions 0..T-2)."""
        lib, batch, T = self.lib, self.batch, len(ids)
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        total, argmax = 0.0, []
        for start in range(0, T, self.n_batch):
            n = min(self.n_batch, T - start)
            batch.n_tokens = n
            for i in range(n):
                pos = start + i
                batch.token[i] = int(ids[pos])
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = int(pos < T - 1)  # the last id predicts nothing inside the window
            rc = lib.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} at positions {start}..{start + n - 1}")
            scored = min(n, T - 1 - start)    # batch rows with logits, positions start..start+scored-1
            for lo in range(0, scored, self.rows):
                hi = min(scored, lo + self.rows)
                block = np.empty((hi - lo, self.n_vocab), dtype=np.float32)      # [R, V]
                for r in range(lo, hi):
                    ptr = lib.llama_get_logits_ith(self.ctx, r)
                    block[r - lo] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
                nll, top = score_rows(block, ids[start + lo + 1:start + hi + 1])
                total += nll
                argmax.extend(int(t) for t in top)
        return total, T - 1, argmax


def write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> None:
    types = parse_types(args.types)
    if args.threads < 1:
        raise InputError(f"--threads: must be at least 1, got {args.threads}")
    if not os.path.isfile(args.gguf):
        raise InputError(f"--gguf: no file at {args.gguf}")
    tokens = load_tokens(args.tokens)
    # read by llama.cpp when it builds each KV cache (llama-kv-cache.cpp); set both ways so the record is what ran
    os.environ["LLAMA_ATTN_ROT_DISABLE"] = "0" if args.attn_rot == "on" else "1"
    import llama_cpp

    keep_alive = _quiet_logs(llama_cpp)
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(args.gguf.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {args.gguf} (its log above says why)")
    n_windows, seq_len = tokens.shape
    out = {"llama_cpp_version": llama_cpp.__version__, "gguf": os.path.abspath(args.gguf), "seq_len": seq_len,
           "n_windows": n_windows, "threads": args.threads, "attn_rot": args.attn_rot == "on", "results": {}}
    try:
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        if tokens.min() < 0 or tokens.max() >= n_vocab:
            raise InputError(f"--tokens: ids must lie in [0, {n_vocab}) for {os.path.basename(args.gguf)}, got "
                             f"[{tokens.min()}, {tokens.max()}]")
        for name, (type_k, type_v) in types.items():
            t0 = time.perf_counter()
            scorer = Scorer(llama_cpp, model, seq_len, type_k, type_v, args.threads)
            try:
                scored = [scorer.window(w) for w in tokens]
            finally:
                scorer.close()
            out["results"][name] = {"type_k": type_k, "type_v": type_v, "sum_nll": [s[0] for s in scored],
                                    "n_tokens": [s[1] for s in scored], "argmax": [s[2] for s in scored],
                                    "seconds": time.perf_counter() - t0}
            write_json(args.json, out)
    finally:
        llama_cpp.llama_model_free(model)
        llama_cpp.llama_backend_free()
    del keep_alive


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="the model, a GGUF file")
    ap.add_argument("--tokens", required=True, help=".npy integer array [n_windows, seq_len]")
    ap.add_argument("--types", default="f16,q8_0,q4_0",
                    help=f"comma-separated cache types, each NAME or K/V; NAME in {', '.join(KV_TYPES)}")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--attn-rot", choices=("on", "off"), default="on",
                    help="llama.cpp's Hadamard rotation of K and V before a quantized cache stores them (its "
                         "default, for head sizes divisible by 64); off: plain blockwise quantization")
    ap.add_argument("--json", required=True, help="where the results go (rewritten after each type)")
    args = ap.parse_args()
    try:
        run(args)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
