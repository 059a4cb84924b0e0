"""Serving from an artifact in a fresh process: greedy token agreement, passkey retrieval, cache bytes.

python -m bench.serve --artifact DIR --json PATH [--attention blockwise|materialize]

The artifact's cache is served as a runtime would: block-wise (serving/blockwise.py, the default: the stored
form read one block at a time, no decoded copy of the history; prompts attend to their own rows in full precision),
or --attention materialize (every row decoded at every step for the model's own attention: the old path).

- token agreement: 8 prompts of 512 tokens of wikitext-2 test.txt (after the 16 x 1024 evaluation windows),
  128 greedy new tokens with the artifact's cache vs a full-precision DynamicCache; the fraction of positions
  whose token is equal (free-running: compounds, since the texts part at the first difference), and the same
  fraction when the artifact cache decodes along the fp16 tokens (forced: the per-step agreement);
- passkey: a 5-digit number planted at depths 10/30/50/70/90 % of ~1k / 2k / 4k tokens of filler;
- cache bytes at 1k / 4k / 8k tokens of test.txt: measured (sum of the cache's tensors' nbytes), predicted by
  the ledger from the manifest, and a full-precision cache counted at fp16 (2 bytes per element).
"""
from __future__ import annotations

import argparse
import random
import time
from contextlib import nullcontext

import torch
from transformers import DynamicCache

from bench.common import wikitext_dir, write_json
from exporters.ledger import expected_outliers, layer_windows, predict_bytes
from exporters.native import load_artifact
from pipeline.config import ModelConfig
from pipeline.data import read_text, tokenize
from pipeline.model import load_model
from serving.blockwise import generate
from serving.cache import ArtifactCache, cache_kwargs
from stages.probes import passkey_prompt

def greedy(model, prompt: torch.Tensor, n: int, policy=None, attention: str = "blockwise") -> torch.Tensor:
    """n greedy new tokens (exactly n: EOS cannot end one run early) through model.generate: with a full-precision
    DynamicCache (policy None) or the artifact's cache served with `attention` (serving.blockwise.generate)."""
    kw = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": n, "min_new_tokens": n, "do_sample": False}
    with torch.no_grad():
        if policy is None:
            out = model.generate(prompt, **cache_kwargs(model, DynamicCache(config=model.config)), **kw)
        else:
            out, _ = generate(model, policy, prompt, attention=attention, **kw)
    return out[0, prompt.shape[1]:]


def served(model, cache):
    """The block-wise attention installed for a block-wise cache; nothing for another cache."""
    if isinstance(cache, ArtifactCache) and cache.attention == "blockwise":
        from serving.blockwise import serving

        return serving(model, cache)
    return nullcontext()


def forced(model, prompt: torch.Tensor, ref: torch.Tensor, cache) -> torch.Tensor:
    """Decode along the reference tokens (one token per step through the cache): the greedy choice at every step
    given the same context as the reference. -> [len(ref)] token ids."""
    with torch.no_grad(), served(model, cache):
        preds = [model(prompt, cache=cache, use_cache=True).logits[0, -1].argmax()]
        for t in ref[:-1]:
            preds.append(model(t.view(1, 1), cache=cache, use_cache=True).logits[0, -1].argmax())
    return torch.stack(preds)


def fill(model, cache, ids: torch.Tensor, chunk: int = 1024) -> None:
    with torch.no_grad(), served(model, cache):
        for s in range(0, ids.shape[1], chunk):
            model(ids[:, s : s + chunk], cache=cache, use_cache=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--json", default=None)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--lengths", default="1024,4096,8192")
    ap.add_argument("--passkey-lengths", default="1024,2048,4096")
    ap.add_argument("--agreement", default="both", choices=["greedy", "forced", "both"])
    ap.add_argument("--attention", default="blockwise", choices=["blockwise", "materialize"])
    args = ap.parse_args()
    start = time.perf_counter()
    lm = load_model(ModelConfig())
    art = load_artifact(args.artifact, lm.spec)  # strict: refuses an artifact made for another model
    policy, spec = art.policy, lm.spec
    model, tok = lm.model, lm.tokenizer
    ids = tokenize(tok, read_text(wikitext_dir() / "test.txt", "text"))

    # Free-running greedy agreement is position by position: after the first differing token the two texts part,
    # so it compounds the per-step disagreement. The forced agreement is the per-step one: the artifact's greedy
    # choice at each of the reference's steps, with the reference's context, decoding through the artifact cache.
    agree, agree_forced, first_diff, total = 0, 0, [], 0
    for i in range(args.prompts):
        s = 16 * 1024 + i * 512
        prompt = ids[None, s : s + 512]
        ref = greedy(model, prompt, args.new_tokens)
        if args.agreement in ("greedy", "both"):
            got = greedy(model, prompt, args.new_tokens, policy, args.attention)
            agree += int((ref == got).sum())
            diff = (ref != got).nonzero()
            first_diff.append(int(diff[0]) if diff.numel() else args.new_tokens)
        if args.agreement in ("forced", "both"):
            cache = ArtifactCache(policy, model, attention=args.attention)
            agree_forced += int((forced(model, prompt, ref, cache) == ref).sum())
        total += ref.numel()
    agreement = {}
    if args.agreement in ("greedy", "both"):
        agreement["token_agreement"] = agree / total
        print(f"token agreement over {args.prompts} prompts x {args.new_tokens} free-running greedy tokens: "
              f"{agree / total:.4f} (first differing token at {first_diff})")
    if args.agreement in ("forced", "both"):
        agreement["token_agreement_forced"] = agree_forced / total
        print(f"token agreement over {args.prompts} prompts x {args.new_tokens} steps along the fp16 greedy tokens: "
              f"{agree_forced / total:.4f}")

    rng = random.Random(0)
    hits = {"fp16": 0, "artifact": 0}
    trials = 0
    for n in (int(x) for x in args.passkey_lengths.split(",") if x):
        for depth in (0.1, 0.3, 0.5, 0.7, 0.9):
            key = rng.randint(10000, 99999)
            prompt = torch.tensor([passkey_prompt(tok, n, depth, key)[0]])
            for name, pol in (("fp16", None), ("artifact", policy)):
                text = tok.decode(greedy(model, prompt, 8, pol, args.attention))
                hits[name] += int(str(key) in text)
            trials += 1
        print(f"passkey up to {n} tokens: fp16 {hits['fp16']}/{trials}, artifact {hits['artifact']}/{trials}")
    passkey = {k: v / trials for k, v in hits.items()} if trials else {}

    cache_bytes = {}
    expected = expected_outliers(art.manifest)
    for t in (int(x) for x in args.lengths.split(",") if x):
        cache = ArtifactCache(policy, model, attention=args.attention)
        fill(model, cache, ids[None, :t])
        measured = cache.nbytes()
        predicted = predict_bytes(policy, t, spec.n_kv_heads, spec.head_dim, expected=expected,
                                  windows=layer_windows(art.manifest))
        dyn = DynamicCache(config=model.config)
        fill(model, dyn, ids[None, :t])
        fp16 = sum(layer.keys.numel() * 2 + layer.values.numel() * 2 for layer in dyn.layers)
        cache_bytes[str(t)] = [measured, predicted, fp16]
        print(f"cache bytes at {t} tokens: measured {measured:,} predicted {predicted:,.0f} "
              f"({measured / predicted - 1:+.3%}), fp16 {fp16:,} -> {measured / fp16:.3f} x fp16")
    print(f"wall {time.perf_counter() - start:.0f} s")
    write_json(args.json, {**agreement, "passkey": passkey, "cache_bytes": cache_bytes, "attention": args.attention,
                           "wall_s": time.perf_counter() - start})


if __name__ == "__main__":
    main()
