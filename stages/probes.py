"""Positional probes: passkey retrieval with the needle at several depths of several context lengths.

Teacher-forced greedy check: the prompt followed by the key's tokens runs in one forward; the probe passes when
the argmax at every answer position is the key's next token -- exactly when greedy decoding would emit the key.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from exporters.codec import CachePolicy
from stages.base import Context, Declaration, StageResult
from stages.evaluate import full_precision_hidden, long_mask, quantized_attention
from stages.layer_policy import Target, target_inputs, target_policy
from stages.hooks import attention_override, layer_windows, lm_logits, model_device, rope_tables

@dataclass
class ProbeConfig:
    enabled: bool = True
    # a prompt costs two forwards (fp16 and the recipe's cache): one by default, at twice the evaluation windows'
    # length with the needle in the middle; more by probes.lengths=[1024,2048,4096] probes.depths=[0.1,0.5,0.9]
    # (docs/eval-cost.md)
    lengths: list[int] = field(default_factory=lambda: [2048])
    depths: list[float] = field(default_factory=lambda: [0.5])
    seed: int = 0

    # not in the cache key: with enabled=false the stage is not in the graph at all
    KEY_EXCLUDED: ClassVar[dict[str, str]] = {"enabled": "whether the stage runs, not what it computes"}


@dataclass
class Inputs:
    model: torch.nn.Module
    spec: object                  # pipeline.model.ModelSpec
    prompts: list[dict]           # make_prompts(...)
    policies: list[CachePolicy]


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_prompt(tok, n_tokens: int, depth: float, key: int) -> tuple[list[int], list[int]]:
    """(prompt ids of about n_tokens, the answer's ids) with the needle at `depth` of the filler."""
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    filler, needle = enc(FILLER), enc(f"The pass key is {key}. Remember it. {key} is the pass key. ")
    question, answer = enc("What is the pass key? The pass key is"), enc(f" {key}")
    body = (filler * (n_tokens // len(filler) + 1))[: max(0, n_tokens - len(needle) - len(question) - len(answer))]
    cut = int(len(body) * depth)
    return body[:cut] + needle + body[cut:] + question, answer


def make_prompts(tok, cfg: ProbeConfig) -> list[dict]:
    rng = random.Random(cfg.seed)
    out = []
    for n in cfg.lengths:
        for depth in cfg.depths:
            key = rng.randint(10000, 99999)
            prompt, answer = passkey_prompt(tok, n, depth, key)
            out.append({"length": n, "depth": depth, "key": key, "ids": torch.tensor([prompt + answer]),
                        "answer_from": len(prompt)})
    return out


def fit(inputs: Inputs, cfg: ProbeConfig, progress: Callable[[int], None] | None = None) -> StageResult:
    """-> meta {"accuracy": {policy: float}, "cells": {policy: {"LENGTH@DEPTH": 0|1}}}; fp16 reference included."""
    model, spec, prompts, policies = inputs.model, inputs.spec, inputs.prompts, inputs.policies
    cells: dict[str, dict[str, int]] = {"fp16": {}}
    for p in policies:
        cells[p.name] = {}
    device = model_device(model)
    policies = [p.to(device) for p in policies]
    windows = layer_windows(model.config)
    with torch.no_grad():
        for pr in prompts:
            ids, a = pr["ids"].to(device), pr["answer_from"]
            target = ids[0, a:]
            key = f"{pr['length']}@{pr['depth']:g}"
            rope = rope_tables(model, ids)
            keep = ids.shape[1] - a + 1  # the answer's positions and the one before (the head on those only)
            logits = lm_logits(model, full_precision_hidden(model, ids)[-keep:])
            cells["fp16"][key] = int(torch.equal(logits[:-1].argmax(-1), target))
            for p in policies:
                with attention_override(model, quantized_attention(p, rope, None, windows=windows),
                                        mask=long_mask(ids.shape[1])):
                    hidden = model.model(ids, use_cache=False).last_hidden_state[0]
                logits = lm_logits(model, hidden[-keep:])
                cells[p.name][key] = int(torch.equal(logits[:-1].argmax(-1), target))
            if progress:
                progress(1)
    accuracy = {name: sum(c.values()) / max(1, len(c)) for name, c in cells.items()}
    return StageResult({}, {"accuracy": accuracy, "cells": cells})


@dataclass
class ProbeJob:
    """The probes stage's config: the prompts' knobs and the policy probed (beside fp16)."""
    probes: ProbeConfig
    target: Target


def _fit_stage(ctx: Context, inputs: dict, job: ProbeJob, progress) -> StageResult:
    policy = target_policy(job.target, ctx.spec.n_layers, inputs)
    return fit(Inputs(ctx.model, ctx.spec, make_prompts(ctx.tokenizer, job.probes), [policy]), job.probes, progress)


STAGE = Declaration("probes", ProbeJob, _fit_stage, inputs=lambda j: target_inputs(j.target),
                    units=lambda ctx, j: len(j.probes.lengths) * len(j.probes.depths))
