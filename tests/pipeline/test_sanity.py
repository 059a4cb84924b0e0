"""pipeline/sanity.py: "the model predicts at chance" on hand-checkable numbers, and a real run on a random model
folder saying so in its output, its report and summary.json, `show ARTIFACT` and `recommend RUN_DIR`."""
import json
from pathlib import Path

import pytest

from pipeline.sanity import CHANCE_DIVISOR, predicts_at_chance, reference_ppl, run_warnings, warnings
from tests.pipeline.test_user_path import after, kvcalib, own_model  # noqa: F401  (own_model: the fixture)

V = 49152   # SmolLM2's vocabulary, and the tiny random models'


def test_a_trained_models_perplexity_is_not_chance_a_random_ones_is():
    assert CHANCE_DIVISOR == 4 and V / CHANCE_DIVISOR == 12288
    assert not predicts_at_chance(25.0, V)       # SmolLM2-like
    assert not predicts_at_chance(48.6, 262144)  # Gemma 3 270M
    assert not predicts_at_chance(12287.9, V) and predicts_at_chance(12288.0, V)   # the bound, exactly
    assert predicts_at_chance(50701.0, V)        # the user's random Qwen2-shaped folder
    assert not predicts_at_chance(float("nan"), V)
    assert warnings({"fp16": {"ppl": 25.0}}, V) == []


def test_the_warning_names_the_symptom_with_the_numbers():
    (text,) = warnings({"fp16": {"ppl": 50701.2}, "kvquant-4b": {"ppl": 50702.0, "ppl_ratio": 1.0}}, V)
    assert text.startswith("the model predicts at chance: fp16 perplexity 50,701 on a 49,152-token vocabulary "
                           "(at least a quarter of it, 12,288: ")
    assert "a random or wrong checkpoint, an uninitialised head?" in text and text.endswith("noise with noise")


def test_without_an_fp16_row_the_reference_is_any_rows_ppl_over_its_ratio():
    assert reference_ppl({"kvquant-4b": {"ppl": 30.0, "ppl_ratio": 1.5}}) == 20.0
    assert warnings({"kvquant-4b": {"ppl": 30000.0, "ppl_ratio": 1.5}}, V) != []   # 20,000 >= 12,288
    assert warnings({"kvquant-4b": {"ppl": 15000.0, "ppl_ratio": 1.5}}, V) == []   # 10,000 < 12,288


@pytest.mark.parametrize("recipes,vocab", [
    ({"fp16": {"ppl": "50701"}}, V), ({"fp16": {"ppl": None}}, V), ({"fp16": {"ppl": True}}, V), ({"fp16": 3}, V),
    ([], V), (None, V), ({"x": {"ppl": 9e9, "ppl_ratio": 0.0}}, V), ({"fp16": {"ppl": 9e9}}, "49152"),
    ({"fp16": {"ppl": 9e9}}, 0), ({"fp16": {"ppl": 9e9}}, None), ({"fp16": {"ppl": 9e9}}, float("nan")),
])
def test_figures_that_are_not_numbers_warn_of_nothing(recipes, vocab):
    """A manifest's or summary.json's fields may be anything a stranger wrote: no warning, never an exception."""
    assert warnings(recipes, vocab) == []


def test_a_perplexity_beyond_a_float_is_at_chance():
    assert "fp16 perplexity inf" in warnings({"fp16": {"ppl": 10 ** 400}}, V)[0]
    assert run_warnings({"model": {"vocab_size": V}, "evaluation": {"recipes": {"fp16": {"ppl": 24.0}}}}) == []
    assert run_warnings({"model": "x", "evaluation": {"recipes": {"fp16": {"ppl": 9e9}}}}) == []


# ---- a real run on a random model folder -----------------------------------------------------------------------

QUICK = ["preset=quick", "tracking.enabled=false", "model.dtype=float32", "model.device=cpu", "data.seq_len=128",
         "data.eval_seq_len=128", "traces.reservoir_size=64", "check.enabled=false", "sensitivity.enabled=false",
         "probes.enabled=false"]


@pytest.fixture(scope="module")
def random_run(own_model, tmp_path_factory):  # noqa: F811  (the fixture imported above)
    """`kvcalib run model=llama3 model.path=<a random LlamaForCausalLM saved with save_pretrained> preset=quick`,
    made small: (its stdout, the run folder)."""
    cwd = tmp_path_factory.mktemp("random-run")
    run = kvcalib(["run", "model=llama3", f"model.path={own_model}", *QUICK], cwd)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout, Path(after("results:", run.stdout))


def test_a_random_models_run_says_it_predicts_at_chance_everywhere(random_run, tmp_path):
    stdout, run_dir = random_run
    summary = json.loads((run_dir / "summary.json").read_text())
    (warning,) = summary["sanity"]["warnings"]
    ppl, vocab = summary["evaluation"]["recipes"]["fp16"]["ppl"], summary["model"]["vocab_size"]
    assert vocab == V and ppl > V / CHANCE_DIVISOR     # random weights: about V
    assert warning.startswith(f"the model predicts at chance: fp16 perplexity {ppl:,.0f} on a 49,152-token vocabulary")
    # the run's output: above the evaluation table and the gate's verdict it puts in doubt
    lines = stdout.splitlines()
    at = lines.index(f"warning: {warning}")
    assert at < next(i for i, line in enumerate(lines) if line.startswith("recipe "))
    assert at < next(i for i, line in enumerate(lines) if line.startswith("drift gate:"))
    # the report, above its tables
    report = (run_dir / "report.md").read_text()
    assert f"**Warning:** {warning}" in report and report.index(warning) < report.index("## Quality per bit")
    # show ARTIFACT: from the manifest alone (its fp16 row and its model's vocab_size)
    manifest = json.loads((run_dir / "artifact" / "manifest.json").read_text())
    assert manifest["model"]["vocab_size"] == V
    show = kvcalib(["show", str(run_dir / "artifact")], tmp_path)
    assert show.returncode == 0, show.stderr[-2000:]
    assert f"warning    {warning}" in show.stdout.splitlines()
    # recommend RUN_DIR: first, above the table and the serve line
    recommend = kvcalib(["recommend", str(run_dir)], tmp_path)
    assert recommend.returncode == 0, recommend.stderr[-2000:]
    assert recommend.stdout.splitlines()[0] == f"warning: {warning}"
    assert "vllm serve" in recommend.stdout


def test_two_evaluation_windows_make_no_interval(random_run, tmp_path):
    """preset=quick evaluates 2 windows: each interval printed is said not to be one (stages.evaluate)."""
    stdout, run_dir = random_run
    fp16 = next(line for line in stdout.splitlines() if line.startswith("fp16 "))
    assert "(2 windows: not an interval)" in fp16
    recommend = kvcalib(["recommend", str(run_dir)], tmp_path)
    assert "(2 windows: not an interval)" in next(line for line in recommend.stdout.splitlines()
                                                   if line.startswith("fp16 "))
