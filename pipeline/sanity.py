"""Is the model worth measuring at all? One definition of "the model predicts at chance", said plainly wherever the
figures it puts in doubt are printed: the run's output, report.md, summary.json (summary["sanity"]), `kvcalib show
ARTIFACT` and `kvcalib recommend RUN_DIR` all print `warnings` of the same two numbers -- the reference's (fp16)
perplexity on the evaluation windows and the model's vocabulary size.

The model predicts at chance when ppl >= V / CHANCE_DIVISOR (V: the vocabulary size, the logits' width). Why a
quarter of V: perplexity V is a uniform guess over the vocabulary, which is what random weights or an uninitialised
head compute (the tests' tiny random Llama: 47,000 to 50,000 on 49,152 tokens); V / 4 is a model that gains less than
log2(4) = 2 bits per token over that guess. A model that learned nothing but how often each token occurs gains
more than twice that: a unigram count of the embedded calibration half (add-one smoothed) scores 1,208 on the
embedded evaluation half with SmolLM2's 49,152-token vocabulary -- 5.3 bits under uniform, ten times under the
bound 12,288 -- and trained models score tens (SmolLM2 23.7 on 49,152 tokens, Gemma 3 270M 48.6 on 262,144:
docs/ablations.md, docs/gemma3.md). So the bound trips on a model that has learned nothing and on none that has
learned anything (a wrong tokenizer, which makes a model confidently wrong, lands above V and trips it too). A
top-1 accuracy would say the same, but the evaluation has none: its top1 is a recipe's agreement with the
reference, 1.0 for the reference itself.

The inputs may come from a file of someone else's (a manifest, a run's summary.json): anything that is not a
number yields no warning, never an exception.
"""
from __future__ import annotations

import math

CHANCE_DIVISOR = 4   # at chance: perplexity >= vocabulary / 4, i.e. less than 2 bits per token over a uniform guess


def _number(value) -> float | None:
    """A JSON number as a float (an integer beyond a float: infinite, with its sign); None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def reference_ppl(recipes) -> float | None:
    """The reference's (fp16) perplexity of an evaluation's rows {recipe: figures}: the fp16 row's ppl, else any
    row's ppl / ppl_ratio -- exactly the reference's, as stages.evaluate takes both from the same mean NLL (so a run
    whose eval.recipes leaves fp16 out is judged too). None when no row holds these as numbers."""
    if not isinstance(recipes, dict):
        return None
    fp16 = recipes.get("fp16")
    if isinstance(fp16, dict) and _number(fp16.get("ppl")) is not None:
        return _number(fp16.get("ppl"))
    for row in recipes.values():
        if isinstance(row, dict):
            ppl, ratio = _number(row.get("ppl")), _number(row.get("ppl_ratio"))
            if ppl is not None and ratio is not None and ratio > 0:
                return ppl / ratio
    return None


def predicts_at_chance(ppl: float, vocab_size: int) -> bool:
    """The reference perplexity `ppl` on a `vocab_size`-token vocabulary is that of a guess at chance (module
    docstring: ppl >= vocab_size / CHANCE_DIVISOR). NaN never is."""
    return ppl >= vocab_size / CHANCE_DIVISOR


def warnings(recipes, vocab_size) -> list[str]:
    """The sanity warnings of an evaluation ({recipe: figures}, as summary["evaluation"]["recipes"] and a manifest's
    `evaluation` hold it) of a model with `vocab_size` tokens: [] when the model is sane or a figure is missing."""
    ppl, v = reference_ppl(recipes), _number(vocab_size)
    if ppl is None or v is None or not v >= 1 or not predicts_at_chance(ppl, v):
        return []
    return [f"the model predicts at chance: fp16 perplexity {ppl:,.0f} on a {v:,.0f}-token vocabulary (at least a "
            f"quarter of it, {v / CHANCE_DIVISOR:,.0f}: less than 2 bits per token better than a uniform guess); a "
            f"random or wrong checkpoint, an uninitialised head? every figure below compares noise with noise"]


def run_warnings(summary: dict) -> list[str]:
    """The warnings of a run's summary (summary.json): its evaluation and its model's vocabulary size."""
    evaluation, model = summary.get("evaluation"), summary.get("model")
    if not isinstance(evaluation, dict) or not isinstance(model, dict):
        return []
    return warnings(evaluation.get("recipes"), model.get("vocab_size"))


__all__ = ["CHANCE_DIVISOR", "reference_ppl", "predicts_at_chance", "warnings", "run_warnings"]
