"""How many static-bound key outliers a vLLM page must hold: counted on the dev split, for the pool's size.

The vLLM plugin keeps the outliers of keys with static per-channel bounds in one pool per page
(exporters/vllm_slots.py): P = POOL_SLACK x the expected count (fraction x H x D x block_size). This benchmark
runs the model over windows of wikitext-2 valid.txt (the dev split), takes every layer's pre-RoPE keys as the plugin
encodes them (fp16 copies), counts each token's entries beyond the artifact's bounds, and prints, per layer and in
all, what each capacity leaves clamped: the old fixed slot of `--slot-cap` entries per token, and pools of each
`--slacks` x the expected count per page of `--block` tokens (positions below n_sink have no slot). A decision
reads the clamped share beside the bytes per token each costs. `--passkey-lengths` counts, apart, on the passkey
prompts of stages/probes.py (a repeated filler sentence with a needle: no wikitext at all), the retrieval workload.

python -m bench.outlier_pool --artifact RUN/artifact --windows 4 --seq-len 2048 --block 128 --json PATH
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from bench.common import wikitext_dir, write_json


def clamped_slot(counts: torch.Tensor, cap: int) -> int:
    """counts [W, T]: entries beyond a fixed per-token capacity."""
    return int((counts - cap).clamp(min=0).sum())


def clamped_pool(counts: torch.Tensor, block: int, cap: int, n_sink: int) -> int:
    """counts [W, T] (positions below n_sink already zero): entries beyond each page's pool of cap entries."""
    w, t = counts.shape
    pad = (-t) % block
    pages = torch.nn.functional.pad(counts, (0, pad)).view(w, -1, block).sum(-1)
    return int((pages - cap).clamp(min=0).sum())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--slot-cap", type=int, default=16, help="the fixed per-token slot it replaces")
    ap.add_argument("--slacks", default="1.5,2,2.5,3,4")
    ap.add_argument("--passkey-lengths", default="", help="e.g. 2048,4096,8192: the passkey prompts, counted apart")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the model's dtype (vLLM serves SmolLM2 in bfloat16)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    from exporters.native import load_artifact
    from pipeline.config import DataConfig, ModelConfig
    from pipeline.data import consecutive_windows, read_text, tokenize
    from pipeline.model import config_from_source, load_model

    art = load_artifact(args.artifact)
    pol, m = art.policy, art.manifest["model"]
    h, d = m["n_kv_heads"], m["head_dim"]
    source = m.get("source")   # the model the artifact names (a run records it), in the asked dtype
    cfg = (config_from_source(source, [f"model.dtype={args.dtype}"]) if source else
           ModelConfig(name=m["name"], source="embedded", dtype=args.dtype))
    lm = load_model(cfg)
    ids = tokenize(lm.tokenizer, read_text(wikitext_dir() / "valid.txt", DataConfig.text_field))
    texts = {"valid.txt": list(consecutive_windows(ids, args.windows, args.seq_len, what="dev"))}
    if args.passkey_lengths:
        from stages.probes import passkey_prompt
        texts["passkey prompts"] = [torch.tensor(passkey_prompt(lm.tokenizer, int(n), 0.5, 12345 + j)[0])
                                    for j, n in enumerate(args.passkey_lengths.split(","))]
    payload = {"artifact": args.artifact, "dtype": args.dtype, "windows": args.windows, "seq_len": args.seq_len,
               "block": args.block, "slot_cap": args.slot_cap, "texts": {}}
    for what, windows in texts.items():
        payload["texts"][what] = count(lm, pol, h, d, windows, what, args)
    payload["wall_s"] = round(time.perf_counter() - start, 1)
    write_json(args.json, payload)


def count(lm, pol, h: int, d: int, windows: list, what: str, args) -> dict:
    from stages.hooks import attention_layers, head_rows, key_module

    layers = [i for i, (k, _) in enumerate(pol.layers) if k.axis == "channel" and k.outlier_fraction > 0]
    counts = {i: [] for i in layers}
    hooks = []
    for i in layers:
        k = pol.layers[i][0]
        lo, hi = k.lower.float(), k.upper.float()

        def hook(_m, _inp, out, i=i, lo=lo, hi=hi):
            x = head_rows(out, h, d).half().float()                       # [B, T, H, D], the fp16 copies
            counts[i].append(((x < lo) | (x > hi)).flatten(2).sum(-1)[0])  # [T]
        hooks.append(key_module(attention_layers(lm.model)[i]).register_forward_hook(hook))
    with torch.no_grad():
        for w in windows:
            lm.model(w[None])
    for hk in hooks:
        hk.remove()
    slacks = [float(s) for s in args.slacks.split(",") if s]
    rows, total = [], {"outliers": 0, "slot": 0, **{s: 0 for s in slacks}}
    for i in layers:
        c = torch.nn.utils.rnn.pad_sequence(counts[i], batch_first=True).long()   # [W, T], windows of any length
        c[:, :pol.n_sink] = 0
        f = pol.layers[i][0].outlier_fraction
        expected = f * h * d
        stored = torch.cat([x[pol.n_sink:] for x in counts[i]])
        row = {"layer": i, "fraction": f, "expected_per_token": expected,
               "mean_per_token": float(stored.float().mean()), "p99_per_token": float(stored.float().quantile(0.99)), "max_per_token": int(stored.max()),
               "outliers": int(c.sum()), "clamped_slot": clamped_slot(c, args.slot_cap), "clamped_pool": {}}
        for s in slacks:
            cap = min(32767, max(2, math.ceil(s * expected * args.block)))
            row["clamped_pool"][s] = clamped_pool(c, args.block, cap, pol.n_sink)
            total[s] += row["clamped_pool"][s]
        total["outliers"] += row["outliers"]
        total["slot"] += row["clamped_slot"]
        rows.append(row)
    sizes = sorted({len(w) for w in windows})
    print(f"static-bound key outliers on {what} ({len(windows)} of {'/'.join(map(str, sizes))} tokens, model in "
          f"{args.dtype}), {len(layers)} layers of {len(pol.layers)} ({pol.name}); pages of {args.block} tokens")
    head = "layer  f      expected  mean   p99   max   slot<=%d" % args.slot_cap + "".join(
        f"  pool x{s:g}" for s in slacks)
    print(head)
    for r in rows:
        print(f"{r['layer']:5d}  {r['fraction']:.3f}  {r['expected_per_token']:8.2f}  {r['mean_per_token']:5.2f}  "
              f"{r['p99_per_token']:4.0f}  {r['max_per_token']:4d}  {r['clamped_slot']:9d}"
              + "".join(f"  {r['clamped_pool'][s]:8d}" for s in slacks))
    n = max(1, total["outliers"])
    print(f"all    outliers {total['outliers']}: clamped by a slot of {args.slot_cap}: {total['slot']} "
          f"({100 * total['slot'] / n:.2f}%); by a pool of " + ", ".join(
              f"x{s:g}: {total[s]} ({100 * total[s] / n:.2f}%)" for s in slacks))
    ex = rows[0]["expected_per_token"] if rows else 0.0
    print(f"bytes per token on such a layer: slot {4 * args.slot_cap}; pool " + ", ".join(
        f"x{s:g}: {4 + 4 * math.ceil(s * ex * args.block) / args.block:.1f}" for s in slacks))
    return {"layers": rows, "total": {str(k): v for k, v in total.items()}}


if __name__ == "__main__":
    main()
