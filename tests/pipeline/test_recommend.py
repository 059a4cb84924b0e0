"""pipeline/recommend.py on hand-made summaries: the cheapest vLLM format within the gate per platform, the serve
line on the run's own model folder, the run's own recipe as a row, the rows that need another run, each note once."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import EXIT_USER, UserError
from pipeline.recommend import USAGE, format_recommendation, recommend, recommend_main
from stages.evaluate import BITS_NOTE

ROOT = Path(__file__).resolve().parents[2]
MODEL = "/models/my-llama"


def row(bits, ratio):
    return {"avg_bits": bits, "ppl_ratio": ratio, "ppl_ratio_ci95": [ratio - 0.01, ratio + 0.01]}


def source(kind="local", path=MODEL, revision=None, config="llama3"):
    return {"kind": kind, "path": path, "revision": revision, "config": config,
            "settings": {"name": config, "source": kind, "path": path}}


# the run: a SmoothAttention recipe (no vLLM cache holds it) on the user's Llama folder; its fp8 checkpoint written (an fp8 run's would be)
SUMMARY = {
    "recipe": "kvquant-3b-1pct+smooth",
    "model": {"name": "my-llama", "source": source()},
    "artifact_dir": "/runs/x/artifact",
    "vllm_checkpoint_dir": "/runs/x/vllm-checkpoint",
    "drift": {"gate": {"thresholds": {"max_ppl_ratio": 1.05}}},
    "evaluation": {"windows": 8, "seq_len": 1024, "recipes": {
        "kvquant-3b-1pct+smooth": row(5.94, 1.006),
        "fp16": row(16.0, 1.0), "fp8-e4m3": row(8.0, 1.008), "vllm-cpu-fp8": row(8.0, 1.034),
        "vllm-int8-per-token-head": row(8.5, 1.001), "vllm-int4-per-token-head": row(4.5, 1.049),
        "vllm-turboquant-3bit-nc": row(5.06, 1.26), "kivi-2": row(3.0, 1.2)}},
}
NO_CHECKPOINT = {k: v for k, v in SUMMARY.items() if k != "vllm_checkpoint_dir"}


def by_name(rec):
    return {r["recipe"]: r for r in rec["rows"]}


def notes_of(text):
    """{number: note text} of the numbered notes under the table."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^\((\d+)\) (.*)$", text, re.M)}


def test_cpu_picks_the_fp8_checkpoint_as_vllm_cpu_serves_it():
    rec = recommend(SUMMARY, "cpu")
    assert rec["pick"]["recipe"] == "vllm-cpu-fp8"
    assert rec["command"] == "vllm serve /runs/x/vllm-checkpoint --kv-cache-dtype fp8"
    assert "kivi-2" not in by_name(rec)  # neither a vLLM format nor the run's recipe
    text = format_recommendation(rec)
    assert "GPU only: vLLM-cpu 0.32 accepts it but its CPU attention, made for auto, fp8, fp8_e4m3, fp8_e5m2" in text
    assert "vllm serve /runs/x/vllm-checkpoint --kv-cache-dtype fp8" in text


def test_gpu_picks_the_cheapest_within_the_gate_served_from_the_models_own_folder():
    rec = recommend(SUMMARY, "gpu")
    assert rec["pick"]["recipe"] == "vllm-int4-per-token-head"  # 4.5 bits, 1.049 <= 1.05
    assert rec["command"] == f"vllm serve {MODEL} --kv-cache-dtype int4_per_token_head"
    assert recommend(SUMMARY, "gpu", max_ppl_ratio=1.01)["pick"]["recipe"] == "fp8-e4m3"
    text = format_recommendation(rec)
    assert f"model: {MODEL})" in text and "<MODEL_DIR>" not in text


def test_a_hub_model_is_served_by_its_id_at_the_recorded_revision():
    summary = {**SUMMARY, "model": {"name": "org/m", "source": source("hub", "org/m", revision="abc123")}}
    assert recommend(summary, "gpu")["command"] == ("vllm serve org/m --revision abc123 "
                                                    "--kv-cache-dtype int4_per_token_head")


def test_a_model_without_a_folder_is_named_so_with_how_to_get_one_once():
    summary = {**SUMMARY, "model": {"name": "smollm2", "source": source("embedded", "", config="smollm2")}}
    rec = recommend(summary, "gpu")
    assert rec["command"] == "vllm serve <MODEL_DIR> --kv-cache-dtype int4_per_token_head"
    text = format_recommendation(rec)
    (n, note), = [(n, t) for n, t in notes_of(text).items() if t.startswith("<MODEL_DIR>")]
    assert "smollm2 has no Hugging Face folder (model.source=embedded)" in note
    assert "export-vllm" in note and "model.source=local model.path=DIR" in note
    assert f"model: <MODEL_DIR> ({n})" in text and text.count("has no Hugging Face folder") == 1


def test_the_runs_own_recipe_is_a_row_served_in_python_when_vllm_cannot_hold_it():
    """A SmoothAttention recipe, which no vLLM cache holds: its row says so and how to serve it
    in Python, and it is not the vLLM pick although it is the cheapest within the gate on a CPU."""
    rec = recommend(SUMMARY, "cpu")
    own = by_name(rec)["kvquant-3b-1pct+smooth"]
    assert own["own"] and own["within_gate"] and not own["platform_ok"] and own["command"] is None
    assert rec["python"] is own and rec["pick"]["recipe"] == "vllm-cpu-fp8"
    text = format_recommendation(rec)
    n = re.search(r"kvquant-3b-1pct\+smooth +- \(Python\) +5\.940 +1\.0060 .*this run's artifact \((\d+)\)",
                  text).group(1)
    note = notes_of(text)[int(n)]
    assert "no vLLM cache holds it" in note and "kvquant-3b-1pct (packed)" in note  # the nearest recipe vLLM serves
    assert "from serving import load_artifact, generate; artifact = load_artifact('/runs/x/artifact')" in note
    assert f"# model: AutoModelForCausalLM.from_pretrained('{MODEL}')" in note
    assert (f"cheaper within the gate in Python (no vLLM path on this platform): this run's artifact "
            f"kvquant-3b-1pct+smooth (5.94 bits) ({n})") in text


def test_a_packed_recipe_competes_on_cpu_through_the_plugin_with_its_export_line():
    summary = {**SUMMARY, "recipe": "kvquant-4b",
               "evaluation": {**SUMMARY["evaluation"], "recipes": {**SUMMARY["evaluation"]["recipes"],
                                                                   "kvquant-4b": row(4.3, 1.02)}}}
    cpu = recommend(summary, "cpu")
    assert cpu["pick"]["recipe"] == "kvquant-4b" and cpu["pick"]["kv_cache_dtype"] == "auto, plugin"
    assert cpu["pick"]["prepare"] == "kvcalib export-vllm /runs/x/artifact /runs/x/vllm-packed"
    assert cpu["command"] == "vllm serve /runs/x/vllm-packed --kv-cache-dtype auto"
    text = format_recommendation(cpu)
    assert ("cheapest within the gate: kvquant-4b (4.30 bits)\n  kvcalib export-vllm /runs/x/artifact "
            "/runs/x/vllm-packed\n  vllm serve /runs/x/vllm-packed --kv-cache-dtype auto") in text
    gpu = recommend(summary, "gpu")  # the plugin registers nothing on CUDA
    assert not by_name(gpu)["kvquant-4b"]["platform_ok"] and gpu["pick"]["recipe"] == "vllm-int4-per-token-head"
    text = format_recommendation(gpu)
    assert "the plugin registers nothing on CUDA" in text and "cheaper within the gate in Python" in text
    assert f"AutoModelForCausalLM.from_pretrained('{MODEL}')" in text


def test_within_the_gate_but_needs_another_run_says_so_with_the_exact_command():
    """Without the run's checkpoint a CPU host can serve only fp16 today; vLLM-cpu's fp8 is within the gate after
    an fp8-e4m3 run with the run's own overrides (its quant ones dropped, the model ones kept)."""
    overrides = ["model=llama3", f"model.path={MODEL}", "data.n_samples=4", "quant=kvquant-3b-1pct+smooth",
                 "hydra.run.dir=/somewhere"]
    rec = recommend(NO_CHECKPOINT, "cpu", overrides=overrides)
    assert rec["pick"]["recipe"] == "fp16" and rec["command"] == f"vllm serve {MODEL} --kv-cache-dtype auto"
    assert [r["recipe"] for r in rec["later"]] == ["vllm-cpu-fp8"]
    assert by_name(rec)["vllm-cpu-fp8"]["needs"] == "run" and by_name(rec)["fp8-e4m3"]["needs"] == "run"
    text = format_recommendation(rec)
    command = f"kvcalib run quant=fp8-e4m3 model=llama3 model.path={MODEL} data.n_samples=4"
    (n, note), = [(n, t) for n, t in notes_of(text).items() if "an fp8-e4m3 run writes" in t]
    assert f"`{command}`" in note and text.count(command) == 1
    assert f"cheaper within the gate after another run: vllm-cpu-fp8 (8.00 bits) ({n})" in text
    assert re.search(rf"vllm-cpu-fp8 .* within gate; needs another run \({n}\)", text)


def test_the_rerun_command_comes_from_the_recorded_model_without_overrides(tmp_path):
    rec = recommend(NO_CHECKPOINT, "cpu")
    assert f"`kvcalib run quant=fp8-e4m3 model=llama3 model.path={MODEL}`" in format_recommendation(rec)
    elsewhere = tmp_path / "elsewhere"  # the folder moved: it must exist (a missing one is refused, by name)
    elsewhere.mkdir()
    moved = recommend(NO_CHECKPOINT, "cpu", model=[f"model.path={elsewhere}"])
    assert moved["command"] == f"vllm serve {elsewhere} --kv-cache-dtype auto"
    assert f"`kvcalib run quant=fp8-e4m3 model=llama3 model.path={elsewhere}`" in format_recommendation(moved)
    with pytest.raises(UserError, match="model.path: no such folder /nowhere"):
        recommend(NO_CHECKPOINT, "cpu", model=["model.path=/nowhere"])


def test_an_fp8_run_without_its_checkpoint_is_served_after_export_vllm_not_another_run():
    summary = {**NO_CHECKPOINT, "recipe": "fp8-e4m3"}
    rec = recommend(summary, "cpu")
    assert by_name(rec)["fp8-e4m3"]["own"] and rec["pick"]["recipe"] == "vllm-cpu-fp8"
    assert rec["pick"]["prepare"] == "kvcalib export-vllm /runs/x/artifact /runs/x/vllm-checkpoint"
    assert rec["command"] == "vllm serve /runs/x/vllm-checkpoint --kv-cache-dtype fp8" and not rec["later"]


def test_each_explanation_is_printed_once_as_a_numbered_note():
    text = format_recommendation(recommend(NO_CHECKPOINT, "cpu"))
    notes = notes_of(text)
    assert sorted(notes) == list(range(1, len(notes) + 1))
    assert all(text.count(note) == 1 for note in notes.values())
    gpu_only = next(n for n, t in notes.items() if t.startswith("GPU only"))
    assert text.count(f"GPU only ({gpu_only})") == 3  # int8, int4 and turboquant-3bit refer to it
    assert text.count(BITS_NOTE) == 1 and "~6 bits on 1k-token windows" in BITS_NOTE


def test_a_mixed_policy_is_the_runs_own_row():
    mixed = row(5.0, 1.01)
    summary = {**SUMMARY, "mixed": {"layer_policy": {}, "recipe": mixed},
               "evaluation": {**SUMMARY["evaluation"], "recipes": {**SUMMARY["evaluation"]["recipes"],
                                                                   "mixed-5b": mixed}}}
    own = [r for r in recommend(summary, "cpu")["rows"] if r["own"]]
    assert [(r["recipe"], r["kv_cache_dtype"]) for r in own] == [("mixed-5b", "- (Python)")]
    # a layer_policy run's options (fp16 windows, per-layer bits, rotated values): the plugin's packed folder
    summary["mixed"]["layer_policy"] = {"options": ["kvquant-4b-1pct+sink16+recent32",
                                                    "kvquant-2b+sink16+recent32+rotclipv"]}
    own = [r for r in recommend(summary, "cpu")["rows"] if r["own"]]
    assert [(r["recipe"], r["kv_cache_dtype"], r["platform_ok"]) for r in own] == [("mixed-5b", "auto, plugin", True)]


def test_the_default_recipe_is_served_by_the_plugin_on_a_cpu():
    """The default recipe (fp16 sink and recent rows) is a packed folder the kvcalib vLLM plugin serves in
    vLLM-cpu: its own row on a CPU says export-vllm then `vllm serve ... --kv-cache-dtype auto`; on a GPU, Python."""
    summary = {**SUMMARY, "recipe": "kvquant-4b+sink16+recent128", "vllm_checkpoint_dir": None,
               "evaluation": {**SUMMARY["evaluation"], "recipes": {
                   **{k: v for k, v in SUMMARY["evaluation"]["recipes"].items() if k != "kvquant-3b-1pct+smooth"},
                   "kvquant-4b+sink16+recent128": row(5.94, 1.006)}}}
    cpu = by_name(recommend(summary, "cpu"))["kvquant-4b+sink16+recent128"]
    assert cpu["own"] and cpu["kv_cache_dtype"] == "auto, plugin" and cpu["platform_ok"]
    assert cpu["command"].endswith("--kv-cache-dtype auto") and "export-vllm" in cpu["prepare"]
    gpu = by_name(recommend(summary, "gpu"))["kvquant-4b+sink16+recent128"]
    assert not gpu["platform_ok"]


def test_bad_input_is_refused_by_name(tmp_path):
    with pytest.raises(UserError, match=r"--platform must be one of \('cpu', 'gpu'\), got 'tpu'"):
        recommend(SUMMARY, "tpu")
    with pytest.raises(UserError, match="the run has no evaluation"):
        recommend({"evaluation": {}}, "cpu")
    (tmp_path / "summary.json").write_text(json.dumps(SUMMARY))
    with pytest.raises(UserError, match="--max-ppl-ratio must be a number .* got 'x'"):
        recommend_main([str(tmp_path), "--max-ppl-ratio", "x"])
    ok = subprocess.run([sys.executable, "-m", "pipeline", "recommend", str(tmp_path), "--platform", "gpu"],
                        capture_output=True, text=True, cwd=str(ROOT))
    assert ok.returncode == 0 and "int4_per_token_head" in ok.stdout, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "pipeline", "recommend", str(tmp_path / "nope")],
                         capture_output=True, text=True, cwd=str(ROOT))
    assert bad.returncode == EXIT_USER and "has no summary.json" in bad.stderr


def test_the_run_folder_gives_the_overrides_and_the_options_parse_both_ways(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps(NO_CHECKPOINT))
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text(f"- model=llama3\n- model.path={MODEL}\n- data.seed=3\n")
    text = recommend_main([str(tmp_path), "--platform=cpu", "--max-ppl-ratio", "1.04"])
    assert "gate: ppl ratio <= 1.04" in text
    assert f"`kvcalib run quant=fp8-e4m3 model=llama3 model.path={MODEL} data.seed=3`" in text


def test_help_documents_every_option():
    for option in ("--platform cpu|gpu", "--engine vllm|llama.cpp", "--max-ppl-ratio R", "model.<field>=VALUE"):
        assert option in USAGE
    assert recommend_main(["--help"]).startswith("usage: python -m pipeline recommend RUN_DIR [--engine")


def test_the_long_context_evaluation_decides_when_the_run_has_one():
    """int4 per token-head is within the gate on short windows but over it at 8k: the long figures decide."""
    long = {"windows": 8, "seq_len": 8192, "recipes": {
        "fp16": row(16.0, 1.0), "fp8-e4m3": row(8.0, 1.004), "vllm-int4-per-token-head": row(4.5, 1.06)}}
    rec = recommend({**SUMMARY, "evaluation_long": long}, "gpu")
    assert rec["pick"]["recipe"] == "fp8-e4m3" and (rec["windows"], rec["seq_len"]) == (8, 8192)
    assert "evaluated in this run on 8 windows x 8192 tokens" in format_recommendation(rec)
    assert recommend(SUMMARY, "gpu")["pick"]["recipe"] == "vllm-int4-per-token-head"


def test_a_format_over_the_gate_on_the_short_windows_is_not_picked_for_its_long_figures():
    """The gate fails a recipe over max_ppl_ratio on either evaluation; recommend judges by the same rule: int4
    per token-head within it at 8k but over it on the 1k windows is not a candidate."""
    short = {**SUMMARY["evaluation"], "recipes": {**SUMMARY["evaluation"]["recipes"],
                                                  "vllm-int4-per-token-head": row(4.5, 1.07)}}
    long = {"windows": 8, "seq_len": 8192, "recipes": {
        "fp16": row(16.0, 1.0), "fp8-e4m3": row(8.0, 1.004), "vllm-int4-per-token-head": row(4.5, 1.02)}}
    rec = recommend({**SUMMARY, "evaluation": short, "evaluation_long": long}, "gpu")
    int4 = by_name(rec)["vllm-int4-per-token-head"]
    assert not int4["within_gate"] and int4["ppl_ratio"] == 1.02 and rec["pick"]["recipe"] == "fp8-e4m3"


def lrow(k, v, bits, ratio, top1=0.95):
    return {"type_k": k, "type_v": v, "avg_bits": bits, "ppl": 20.0 * ratio, "ppl_ratio": ratio,
            "ppl_ratio_ci95": [ratio - 0.005, ratio + 0.005], "top1": top1, "seconds": 1.0}


LLAMACPP = {**SUMMARY, "evaluation_llamacpp": {
    "engine": "llama.cpp", "llama_cpp_version": "0.3.36", "gguf": "m.gguf", "gguf_path": None, "attn_rot": True,
    "windows": 16, "seq_len": 1024, "types": {
        "f16": lrow("f16", "f16", 16.0, 1.0, 1.0), "q8_0": lrow("q8_0", "q8_0", 8.5, 1.001),
        "q8_0/q4_0": lrow("q8_0", "q4_0", 6.5, 1.02), "q4_1": lrow("q4_1", "q4_1", 5.0, 1.034),
        "q4_0": lrow("q4_0", "q4_0", 4.5, 1.052)}}}


def test_llamacpp_picks_the_cheapest_type_within_the_gate_with_its_server_line():
    from pipeline.recommend import format_llamacpp, recommend_llamacpp

    rec = recommend_llamacpp(LLAMACPP)  # the run's gate: 1.05 -> q4_0 (1.052) is over, q4_1 (1.034) within
    assert rec["pick"]["type"] == "q4_1"
    assert rec["command"] == "llama-server -m <m.gguf> -fa on -ctk q4_1 -ctv q4_1"
    assert recommend_llamacpp(LLAMACPP, max_ppl_ratio=1.025)["command"].endswith("-ctk q8_0 -ctv q4_0")
    assert recommend_llamacpp(LLAMACPP, max_ppl_ratio=1.0001)["pick"] is None  # f16 is never "picked"
    text = format_llamacpp(rec)
    assert "q4_0            4.500     1.0520  [1.0470, 1.0570]   0.9500  over gate" in text
    assert "f16            16.000     1.0000" in text and "reference" in text
    assert "bits: per element of the type's block layout" in text
    assert "keep llama.cpp's default f16 cache" in format_llamacpp(recommend_llamacpp(LLAMACPP, 1.0001))


def test_llamacpp_without_its_evaluation_is_refused_naming_the_override(tmp_path):
    from pipeline.recommend import recommend_llamacpp

    with pytest.raises(UserError, match=r"--engine llama.cpp: the run has no llama.cpp evaluation; run it with "
                                        r"llamacpp.types=\["):
        recommend_llamacpp(SUMMARY)
    (tmp_path / "summary.json").write_text(json.dumps(LLAMACPP))
    run = subprocess.run([sys.executable, "-m", "pipeline", "recommend", str(tmp_path), "--engine", "llama.cpp"],
                         capture_output=True, text=True, cwd=str(ROOT))
    assert run.returncode == 0, run.stderr
    assert "llama-server -m <m.gguf> -fa on -ctk q4_1 -ctv q4_1" in run.stdout
    run = subprocess.run([sys.executable, "-m", "pipeline", "recommend", str(tmp_path), "--engine", "sglang"],
                         capture_output=True, text=True, cwd=str(ROOT))
    assert run.returncode == EXIT_USER and "--engine must be one of ('vllm', 'llama.cpp'), got 'sglang'" in run.stderr


# ---- a run folder from elsewhere (issue 68, items 3 and 4) ----------------------------------------------------------

def _cli(args, capsys):
    """`python -m pipeline ARGS` in this process -> (exit code, stdout, stderr)."""
    from pipeline.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(args)
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize("text,says", [
    ("{not json", "summary.json: not valid UTF-8 JSON (JSONDecodeError"),
    ("[1, 2]", "summary.json: allowed a JSON object, got list"),
    ('{"x": ' + _deep(100_000) + "}", "summary.json: nests objects and arrays deeper than Python reads"),
    ('{"evaluation": ' + _deep(40) + "}", "summary.json: evaluation" + "/0" * 31 + " nests objects and arrays deeper"),
    ('{"evaluation": "x"}', "summary.json field evaluation: allowed an object or null, got str 'x'"),
    (json.dumps({**SUMMARY, "evaluation": {"recipes": {"fp16": {"avg_bits": "16", "ppl_ratio": 1.0}}}}),
     "summary.json field evaluation/recipes/fp16/avg_bits: allowed a number, got str '16'"),
    (json.dumps({**SUMMARY, "evaluation": {"recipes": {"fp16": {"avg_bits": 16, "ppl_ratio": 10 ** 400}}}}),
     "summary.json field evaluation/recipes/fp16/ppl_ratio: allowed a number, got int 1000"),
    (json.dumps({**SUMMARY, "model": {"source": {"kind": "local"}}}),
     "summary.json field model/source/path: allowed a string, got NoneType None"),
    (json.dumps({**SUMMARY, "mixed": "yes"}), "summary.json field mixed: allowed an object or null, got str 'yes'"),
    (json.dumps({**SUMMARY, "drift": {"gate": {"thresholds": {"max_ppl_ratio": [1]}}}}),
     "summary.json field drift/gate/thresholds/max_ppl_ratio: allowed a number or null, got list [1]"),
    (json.dumps({**SUMMARY, "evaluation_llamacpp": {"types": {"q4_0": {"avg_bits": 4.5, "ppl_ratio": 1.0}}}}),
     "summary.json field evaluation_llamacpp/types/q4_0/type_k: allowed a string, got NoneType None"),
], ids=["not-json", "list", "deep-100000", "deep-40", "evaluation-str", "bits-str", "ratio-huge", "source-no-path",
        "mixed-str", "gate-list", "llamacpp-no-type"])
def test_a_malformed_summary_is_refused_in_one_line_naming_the_file(tmp_path, capsys, text, says):
    """Before: exit 5 (JSONDecodeError, RecursionError, AttributeError, TypeError, KeyError, OverflowError)."""
    (tmp_path / "summary.json").write_text(text)
    code, _, err = _cli(["recommend", str(tmp_path)], capsys)
    assert code == EXIT_USER and "Traceback" not in err and "internal error" not in err, err[-2000:]
    assert err.count("\n") == 1 and says in err, err[-2000:]


def test_a_malformed_overrides_file_is_refused_naming_it(tmp_path, capsys):
    (tmp_path / "summary.json").write_text(json.dumps(NO_CHECKPOINT))
    (tmp_path / ".hydra").mkdir()
    for text, says in (("- a\n  - b: [", "overrides.yaml: not valid UTF-8 YAML"),
                       ("{a: 1}", "overrides.yaml: allowed a list of overrides (key=value strings, as Hydra writes "
                                  "it), got dict {'a': 1}")):
        (tmp_path / ".hydra" / "overrides.yaml").write_text(text)
        code, _, err = _cli(["recommend", str(tmp_path)], capsys)
        assert code == EXIT_USER and says in err and err.count("\n") == 1, err[-2000:]


@pytest.mark.parametrize("run_dir", ["r" * 5000, "r/" * 2500, "x" * 300],
                         ids=["5000", "5000-in-parts", "component-300"])
def test_a_run_dir_the_system_cannot_look_up_is_refused(capsys, run_dir):
    """Before: OSError ENAMETOOLONG from Path.is_file, exit 5."""
    code, _, err = _cli(["recommend", run_dir], capsys)
    assert code == EXIT_USER and err.count("\n") == 1 and "Traceback" not in err, err[-2000:]
    assert err.startswith("error: RUN_DIR: ") and "File name too long" in err and len(err) < 600
    with pytest.raises(UserError, match="RUN_DIR: .*File name too long"):   # the library entry refuses it too
        recommend_main([run_dir])


HOSTILE = "x\x1b[2J\x1b[31mPASSED\nfake line"


def test_every_string_of_the_summary_is_printed_escaped(tmp_path):
    """A recipe name, model name, model path and artifact path holding a terminal escape and a newline: printed
    escaped, and the newline adds no line (before: printed raw)."""
    recipes = {**SUMMARY["evaluation"]["recipes"], HOSTILE: row(4.2, 1.01)}
    summary = {**NO_CHECKPOINT, "recipe": HOSTILE, "artifact_dir": f"/runs/{HOSTILE}/artifact",
               "model": {"name": HOSTILE, "source": source(path=f"/models/{HOSTILE}")},
               "evaluation": {"windows": HOSTILE, "seq_len": 1024, "recipes": recipes}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    plain = tmp_path / "plain"
    plain.mkdir()
    plain_recipes = {**SUMMARY["evaluation"]["recipes"], "my-recipe": row(4.2, 1.01)}
    (plain / "summary.json").write_text(json.dumps({**NO_CHECKPOINT, "recipe": "my-recipe", "evaluation": {
        **summary["evaluation"], "windows": 8, "recipes": plain_recipes}}))
    for platform in ("cpu", "gpu"):
        text = recommend_main([str(tmp_path), "--platform", platform])
        assert "\x1b" not in text and "fake line" not in text.replace("\\nfake line", ""), text
        assert text.count("\n") == recommend_main([str(plain), "--platform", platform]).count("\n")
        escaped = "x\\x1b[2J\\x1b[31mPASSED\\nfake line"
        assert f"on {escaped} windows" in text and f"model: /models/{escaped})" in text
        assert re.search(rf"^{re.escape(escaped)} +- \(Python\)", text, re.M), text


# ---- the model's own sanity, and intervals of too few windows (issue 69) ------------------------------------------

def _with_fp16_ppl(ppl, vocab=49152, windows=8):
    ev = SUMMARY["evaluation"]
    return {**SUMMARY, "model": {**SUMMARY["model"], "vocab_size": vocab},
            "evaluation": {**ev, "windows": windows, "recipes": {**ev["recipes"], "fp16": {**row(16.0, 1.0), "ppl": ppl}}}}


def test_a_run_whose_model_predicts_at_chance_is_said_so_above_the_table(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps(_with_fp16_ppl(50701.0)))
    lines = recommend_main([str(tmp_path)]).splitlines()
    assert lines[0].startswith("warning: the model predicts at chance: fp16 perplexity 50,701 on a 49,152-token "
                               "vocabulary") and lines[1].startswith("vLLM KV-cache formats evaluated")
    (tmp_path / "summary.json").write_text(json.dumps(_with_fp16_ppl(23.7)))   # SmolLM2's
    assert "warning" not in recommend_main([str(tmp_path)])


@pytest.mark.parametrize("edit,message", [
    (lambda s: s["model"].update(vocab_size="49152"),
     r"summary.json field model/vocab_size: allowed an integer >= 1 or null, got str '49152'"),
    (lambda s: s["model"].update(vocab_size=True), r"model/vocab_size: allowed an integer >= 1 or null, got bool"),
    (lambda s: s["evaluation"]["recipes"]["fp16"].update(ppl=[1]),
     r"evaluation/recipes/fp16/ppl: allowed a number or null, got list \[1\]"),
])
def test_the_figures_the_sanity_check_reads_are_checked(tmp_path, edit, message):
    summary = _with_fp16_ppl(50701.0)
    edit(summary)
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(UserError, match=message):
        recommend_main([str(tmp_path)])


def test_an_interval_of_fewer_than_four_windows_is_said_to_be_none():
    few = format_recommendation(recommend(_with_fp16_ppl(23.7, windows=2), "cpu"))
    fp16 = next(line for line in few.splitlines() if line.startswith("fp16 "))
    assert "[0.9900, 1.0100] (2 windows: not an interval)" in fp16
    header = next(line for line in few.splitlines() if line.startswith("recipe "))
    assert header.index("verdict") == fp16.index("within gate")   # the column widens with it
    assert "not an interval" not in format_recommendation(recommend(_with_fp16_ppl(23.7, windows=4), "cpu"))
