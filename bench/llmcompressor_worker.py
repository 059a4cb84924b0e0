"""The llm-compressor side of bench.llmcompressor_peer, run inside .venv-llmcompressor
(scripts/install-llmcompressor.sh): llm-compressor itself calibrates FP8 KV-cache scales on our calibration windows
and writes the checkpoint a vLLM user would serve. Imports only llm-compressor (and what it pins: transformers,
compressed-tensors, datasets), torch, numpy and the standard library, so kvcalib's pins and llm-compressor's never
meet.

    .venv-llmcompressor/bin/python -m bench.llmcompressor_worker --model DIR --windows calib.npy \\
        --strategy tensor|attn_head --out OUT_DIR --result result.json [--observer NAME]

--model: a Hugging Face model folder without a KV scheme (bench.vllm_serve.reference_view of our checkpoint: the
same weights). --windows: the calibration token ids, [N, T] integers (.npy, read with allow_pickle=False).

The recipe is what llm-compressor's own KV-cache examples give, with the weight and activation groups left out:
one QuantizationModifier whose only field is kv_cache_scheme (fp8 e4m3: num_bits 8, type float, symmetric, static,
the strategy given). llm-compressor then hooks every attention module's cache update (compressed_tensors'
QuantizedKVCache: post-RoPE keys, as ours) and its observer -- by default "minmax", a moving average of each
batch's min / max with averaging constant 0.01, not the max over all batches -- sets scale = absmax / 448.
Batches are taken in the given order (shuffle_calibration_samples=False): the moving average depends on the
order, and the windows come already shuffled by the seeded draw of pipeline/data.py.

The folder is written the way llm-compressor's examples write it (save_pretrained(save_compressed=True) and the
tokenizer), in a temporary sibling renamed into place. result.json records the k/v scales it wrote, per layer,
with their shape (per tensor: one value; attn_head: one per KV head), and the quantization_config it wrote.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

STRATEGIES = ("tensor", "attn_head")
DEFAULT_OBSERVER = ("minmax (llm-compressor's default for K/V: moving averages of each batch's min and max, "
                    "averaging constant 0.01; scale = max(|min|, |max|) / 448)")
SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


class WorkerError(SystemExit):
    pass


def load_windows(path: Path):
    """[N, T] int64 token ids from a .npy file, never unpickled."""
    import numpy as np

    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise WorkerError(f"--windows {path}: not a readable .npy array without pickles ({exc})") from None
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 2 or arr.dtype.kind not in "iu":
        raise WorkerError(f"--windows {path}: expected a 2-D integer array [windows, tokens] with at least 1 x 2 "
                          f"entries, got dtype {arr.dtype} shape {list(arr.shape)}")
    return arr.astype(np.int64)


def recipe(strategy: str, observer: str | None):
    """A QuantizationModifier that quantizes the KV cache and nothing else (no config_groups, no scheme)."""
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.modifiers.quantization import QuantizationModifier

    args = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy}
    if observer:
        args["observer"] = observer
    return QuantizationModifier(kv_cache_scheme=QuantizationArgs(**args))


def written_scales(folder: Path) -> list[dict]:
    """Every model.layers.N.self_attn.{k,v}_scale in the saved safetensors, in layer order:
    {"layer", "k_scale": [...], "v_scale": [...], "k_shape": [...], "v_shape": [...]}."""
    from safetensors import safe_open

    by_layer: dict[int, dict] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                m = SCALE.match(name)
                if m:
                    t = st.get_tensor(name)
                    row = by_layer.setdefault(int(m.group(1)), {"layer": int(m.group(1))})
                    row[f"{m.group(2)}_scale"] = [float(x) for x in t.float().reshape(-1)]
                    row[f"{m.group(2)}_shape"] = list(t.shape)
                    row[f"{m.group(2)}_file"] = f.name
    return [by_layer[i] for i in sorted(by_layer)]


def calibrate(model_dir: Path, windows, strategy: str, observer: str | None, out: Path, log) -> dict:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    n, t = windows.shape
    ds = Dataset.from_dict({"input_ids": windows.tolist(), "attention_mask": [[1] * t for _ in range(n)]})
    t0 = time.perf_counter()
    oneshot(model=model, tokenizer=tok, dataset=ds, recipe=recipe(strategy, observer), num_calibration_samples=n,
            max_seq_length=t, shuffle_calibration_samples=False)
    calib_s = time.perf_counter() - t0
    log(f"llm-compressor oneshot ({strategy}) on {n} x {t} tokens: {calib_s:.1f} s")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(str(tmp), save_compressed=True)
    tok.save_pretrained(str(tmp))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return {"calibrate_s": calib_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--windows", required=True, type=Path)
    ap.add_argument("--strategy", required=True)
    ap.add_argument("--observer", default=None, help="llm-compressor observer for K/V (default: its own, minmax)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--result", required=True, type=Path)
    args = ap.parse_args(argv)
    log = lambda m: print(m, flush=True)  # noqa: E731

    if args.strategy not in STRATEGIES:
        raise WorkerError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {args.strategy!r}")
    if not (args.model / "config.json").is_file():
        raise WorkerError(f"--model {args.model}: no config.json (a Hugging Face model folder is expected)")
    config = json.loads((args.model / "config.json").read_text())
    if "quantization_config" in config:
        raise WorkerError(f"--model {args.model}: config.json already has a quantization_config "
                          f"({config['quantization_config'].get('quant_method')}); give the weights without a KV "
                          f"scheme (bench.vllm_serve.reference_view)")
    windows = load_windows(args.windows)

    import compressed_tensors
    import llmcompressor
    import transformers

    t0 = time.perf_counter()
    timing = calibrate(args.model, windows, args.strategy, args.observer, args.out.resolve(), log)
    saved = json.loads((args.out / "config.json").read_text())
    qc = saved.get("quantization_config") or {}
    scales = written_scales(args.out)
    if not scales:
        raise WorkerError(f"llm-compressor wrote no model.layers.N.self_attn.k_scale / v_scale into {args.out}")
    shapes = sorted({tuple(s["k_shape"]) for s in scales} | {tuple(s["v_shape"]) for s in scales})
    log(f"wrote {args.out}: {len(scales)} layers of k/v scales, shape(s) {[list(s) for s in shapes]}; "
        f"kv_cache_scheme {json.dumps(qc.get('kv_cache_scheme'))}")
    result = {"llmcompressor_version": llmcompressor.__version__,
              "compressed_tensors_version": compressed_tensors.__version__,
              "transformers_version": transformers.__version__,
              "strategy": args.strategy, "observer": args.observer or DEFAULT_OBSERVER,
              "windows": list(windows.shape), "quantization_config": qc, "scales": scales,
              "wall_s": time.perf_counter() - t0, **timing}
    tmp = args.result.with_name(args.result.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, args.result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
