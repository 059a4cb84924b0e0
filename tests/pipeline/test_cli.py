"""The command line as a user runs it (subprocesses), on the tiny model and on the embedded model."""
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline.errors as errors
from pipeline.errors import EXIT_CHECK_FAILED, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_USER
from tests.pipeline.test_user_path import own_model  # noqa: F401 -- a fixture: the user's own Llama folder

ROOT = Path(__file__).resolve().parents[2]
# the CLI's mechanics on one fixed recipe (not the default, which may change: a 16-token sink and a 128-row window
# would leave nothing encoded in 32-token windows)
TINY = ["model=tiny", "quant=kvquant-4b-1pct", "data.n_samples=2", "data.seq_len=32", "data.eval_n_samples=1", "data.eval_seq_len=32",
        "tracking.enabled=false", "traces.reservoir_size=16", "probes.lengths=[64]"]


def _run(args, tmp_path, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_help_lists_subcommands(tmp_path):
    out = _run(["--help"], tmp_path)
    assert out.returncode == 0 and all(c in out.stdout for c in ("run", "check", "show"))


def test_tiny_run_then_cached_run(tmp_path):
    first = _run(["run", *TINY], tmp_path)
    assert first.returncode == 0, first.stderr
    results = Path(first.stdout.strip().splitlines()[-1].removeprefix("results: "))
    summary = json.loads((results / "summary.json").read_text())
    assert summary["model"]["n_kv_heads"] == 2 and summary["stages"][0]["status"] == "computed"
    assert "peak_rss_mb" in first.stdout and "traces" in first.stdout
    second = _run(["run", *TINY], tmp_path)
    assert second.returncode == 0 and "reused cache entry" in second.stdout


@pytest.mark.parametrize("override,pattern", [
    ("model=nope", "unknown model model=nope (no conf/model/nope.yaml); model options: gemma3, llama3,"),
    ("model.bogus=1", "unknown key model.bogus; valid keys of model: name, source, embedded, path,"),
    ("data.seq_len=1", "data.seq_len must be >= 2 tokens, got 1"),
    ("data.n_samples=0", "data.n_samples must be >= 1, got 0"),
    ("data=local", "data.path"),
    ("quant.value.format=fp16", "quant.value.axis for format fp16 must be one of ('tensor',), got 'token'"),
    ("codebooks.weighting=mse", "codebooks.weighting must be one of ('fisher-scale2', 'fisher', 'query-scale2'), got 'mse'"),
    ("quant.key.bits=5", "quant.key.bits must be one of (2, 3, 4, 8), got 5"),       # an invalid recipe
    ("eval.recipes=[nope]", "unknown recipe eval.recipes[0]=nope (no conf/quant/nope.yaml); `kvcalib run --help` "
                            "lists the recipes"),
    ("fisher.enabled=false", "unknown key fisher.enabled; valid keys of fisher: recompute"),  # the field that did nothing
    ("+fisher.enabled=false", "unknown key fisher.enabled; valid keys of fisher: recompute (`+key=value` cannot add"),
    ("+model.bogus=1", "unknown key model.bogus; valid keys of model: name, source, embedded, path,"),
])
def test_bad_input_is_a_clear_error_and_leaves_nothing(tmp_path, override, pattern):
    """Refused before Hydra creates a run folder: what the command line's text shows (pipeline/preflight.py), and
    what only the composed config shows (pipeline.config.validate_run, run on it before Hydra starts)."""
    out = _run(["run", *TINY, override], tmp_path)
    assert out.returncode == EXIT_USER, out.stderr[-2000:]
    assert pattern in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "outputs").exists() and not (tmp_path / ".kvcalib_cache").exists()


# Each refusal of `run` as a user meets it: the command line alone, tracking on (so that a run that got as far as
# MLflow would leave mlruns.db), the message naming the key or option, the nearest names and the valid ones.
# light: refused from the command line's text (pipeline/preflight.py), without importing torch or MLflow.
HEAVY = ("torch", "transformers", "mlflow")
WATCH_IMPORTS = ("import atexit\natexit.register(lambda: print('heavy modules:', [m for m in "
                 f"{HEAVY!r} if m in sys.modules], file=sys.stderr))")
REFUSALS = [
    (["foo=1"], ["unknown key foo; valid keys of the config: model, data, quant, traces,"], True),
    (["model.pth=x"], ["unknown key model.pth; did you mean model.path? valid keys of model: name, source, "
                       "embedded, path, gguf_file,"], True),
    (["data.n_sample=4"], ["unknown key data.n_sample; did you mean data.n_samples", "valid keys of data: name, "
                           "source, path,"], True),
    (["quant.key.bitz=4"], ["unknown key quant.key.bitz; did you mean quant.key.bits? valid keys of quant.key: "
                            "format, bits, axis,"], True),
    (["model=llama"], ["unknown model model=llama (no conf/model/llama.yaml); did you mean llama3? model options: "
                       "gemma3, llama3, llama3-shape, smollm2, tiny, tiny-gemma3"], True),
    (["data=lokal"], ["unknown data data=lokal (no conf/data/lokal.yaml); did you mean local? data options: "
                      "embedded, hub, local"], True),
    (["quant=kvquant-4b+sink16+recent12"],
     ["unknown recipe quant=kvquant-4b+sink16+recent12 (no conf/quant/kvquant-4b+sink16+recent12.yaml); did you "
      "mean kvquant-4b+sink16+recent128 or ", "(near but evaluation-only, for eval.recipes=[...]: kvquant-2b+sink16+recent32+",
      "`kvcalib run --help` lists the recipes a run exports"], False),   # which recipes export: exporters.codec (torch)
    (["eval.recipes=[fp16,kvquant-4b-1pt]"], ["unknown recipe eval.recipes[1]=kvquant-4b-1pt (no "
                                              "conf/quant/kvquant-4b-1pt.yaml); did you mean kvquant-4b-1pct"], True),
    (["-m", "quant=kvquant-4b,kvquant-4bb"], ["unknown recipe quant=kvquant-4bb", "did you mean kvquant-4b"], False),
    (["model=llama3", "model.path={tmp}/no-such-model"], ["model.path: no such folder {tmp}/no-such-model "
                                                          "(model.source=hub: "], True),
    (["model.source=local", "model.path={tmp}/no-such-model"], ["model.path: no such folder {tmp}/no-such-model "
                                                                "(model.source=local: "], True),
    (["data=local"], ["data.path: empty; data.source=local reads data.path=FILE_OR_FOLDER"], True),
    (["data=local", "data.path={tmp}/no-such-text"], ["data.path: no such file or folder {tmp}/no-such-text"], True),
    # what only the composed config shows: validate_run on it, before Hydra starts (each job of a sweep)
    (["data.seq_len=1"], ["data.seq_len must be >= 2 tokens, got 1"], False),
    (["-m", "data.n_samples=2,0"], ["sweep job data.n_samples=0: data.n_samples must be >= 1, got 0"], False),
]


@pytest.mark.parametrize("args,messages,light", REFUSALS, ids=[" ".join(a) for a, _, _ in REFUSALS])
def test_a_refused_run_leaves_no_run_folder_and_no_mlflow_run(tmp_path, args, messages, light):
    tmp = tmp_path.resolve()
    out = _run_planted(WATCH_IMPORTS, ["run", *(a.format(tmp=tmp) for a in args)], tmp)
    assert out.returncode == EXIT_USER, out.stderr[-2000:]
    for message in messages:
        assert message.format(tmp=tmp) in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "hub was not reachable" not in out.stderr
    assert not (tmp / "outputs").exists() and not (tmp / "multirun").exists() and not (tmp / "mlruns.db").exists()
    if light:
        assert "heavy modules: []" in out.stderr, out.stderr[-2000:]


def test_a_misspelled_recipe_is_answered_with_exportable_recipes_first(tmp_path):
    """The nearest names offered for quant= are recipes a run can export; the evaluation-only ones near the word
    are named apart. Of the rotated recipes only the rotated, clipped values (+rotclipv) export; key and nuq
    rotations (+rot, +rotk, +rotv) do not."""
    out = _run(["run", "quant=kvquant-4b+rot+sink16"], tmp_path)
    assert out.returncode == EXIT_USER
    message = out.stderr.strip().splitlines()[-1]

    def evaluation_only_rotation(name):
        return "+rot" in name.replace("+rotclipv", "")

    offered = message.split("did you mean ")[1].split("?")[0].split(" or ")
    assert offered and not any(map(evaluation_only_rotation, offered)), message
    assert "kvquant-4b+rot" in message.split("near but evaluation-only")[1].split(")")[0], message


@pytest.mark.parametrize("typo,says", [
    ("kvqant-4b", "unknown recipe quant=kvqant-4b (no conf/quant/kvqant-4b.yaml); did you mean kvquant-4b or "),
    ("zzzz", "unknown recipe quant=zzzz (no conf/quant/zzzz.yaml); `kvcalib run --help` lists the recipes a run "
             "exports"),
])
def test_a_recipe_typo_is_answered_by_the_suggestion_and_where_the_list_is(tmp_path, typo, says):
    """Before: the suggestion (did you mean kvquant-4b?) was followed by every recipe a run exports (54) on one
    line. Now the suggestion alone, and where the list is: `run --help`, which lists each recipe, a family to a
    line. A group of few options (model=, data=, layer_policy=) is still listed in the message."""
    out = _run(["run", f"quant={typo}"], tmp_path)
    err = out.stderr.strip()
    assert out.returncode == EXIT_USER and "\n" not in err and says in err, err
    assert err.endswith("`kvcalib run --help` lists the recipes a run exports") and len(err) < 400, err
    assert "kvquant-4b-1pct+sink16+recent32" not in err   # not the list
    listed = _run(["run", "--help"], tmp_path).stdout
    assert "    kvquant-4b   kvquant-4b, kvquant-4b+rot, kvquant-4b+sink16+recent128*, " in listed, listed
    assert "kvquant-4b-1pct+sink16+recent32" in listed and "    vllm         vllm-cpu-fp8, " in listed
    few = _run(["run", "layer_policy=long-4b"], tmp_path).stderr.strip()
    assert few.endswith("layer_policy options: long-2.5b, long-3.5b, long-3.5b-sliding, long-3b, long-3b-sliding"), few


@pytest.mark.parametrize("command", ["run", "check", "show", "export-vllm", "recommend"])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_command_has_help(tmp_path, command, flag):
    """`<command> --help`: its usage, arguments and an example, exit 0, before anything loads: no torch, no MLflow,
    no tracking store created."""
    out = _run_planted(WATCH_IMPORTS, [command, flag], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"usage: python -m pipeline {command} "), out.stdout[:200]
    assert "example: python -m pipeline " in out.stdout
    assert "heavy modules: []" in out.stderr, out.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["planted.py"]


def test_run_help_lists_groups_keys_and_options(tmp_path):
    out = _run(["run", "--help"], tmp_path)
    assert out.returncode == 0
    assert "  model=         gemma3, llama3, llama3-shape, smollm2*, tiny, tiny-gemma3" in out.stdout
    assert "  data.          name, source, path," in out.stdout and "  quant.         name, key.*, value.*," in out.stdout
    assert "model=llama3 model.path=DIR" in out.stdout and "-m, --multirun" in out.stdout


def test_check_and_export_vllm_help_name_the_model_overrides(tmp_path):
    for command in ("check", "export-vllm"):
        out = _run([command, "--help"], tmp_path)
        assert out.returncode == 0 and "model.<field>=VALUE" in out.stdout and "model.path=" in out.stdout


def test_recommend_help_names_its_options(tmp_path):
    out = _run(["recommend", "--help"], tmp_path)
    assert out.returncode == 0
    assert all(o in out.stdout for o in ("--engine vllm|llama.cpp", "--platform cpu|gpu", "--max-ppl-ratio"))


def test_recipe_with_only_keys_quantized(tmp_path):
    """nuq keys beside full-precision values: only the key bit-width gets a codebook (a 16-bit one cannot exist)."""
    out = _run(["run", *TINY, "quant.name=nuq4-keys-only", "quant.value.format=fp16", "quant.value.bits=16", "quant.value.axis=tensor",
                "quant.value.outlier_fraction=0", "export.enabled=false", "check.enabled=false"], tmp_path)
    assert out.returncode == 0, out.stderr
    summary = json.loads((Path(out.stdout.strip().splitlines()[-1].removeprefix("results: ")) / "summary.json").read_text())
    row = summary["evaluation"]["recipes"]["nuq4-keys-only"]
    assert 4 < row["avg_bits"] < 16  # keys encoded at 4 bits (+ scales), values at 16
    books = [m for name, m in summary["stage_meta"].items() if name.startswith("codebooks-")]
    assert len(books) == 1 and set(books[0]["sse"]) == {"k4", "v4"}  # one bit-width fitted, no 16-bit codebook


def test_llama3_without_weights_is_a_short_message(tmp_path):
    out = _run(["run", "model=llama3"], tmp_path)
    assert out.returncode == EXIT_USER and "model.path=" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_embedded_model_end_to_end(tmp_path):
    out = _run(["run", "data.n_samples=2", "data.seq_len=128", "data.eval_n_samples=1", "data.eval_seq_len=128",
                "tracking.enabled=false", "probes.lengths=[128]", "sensitivity.variants=[kv]", "traces.reservoir_size=256",
                "check.contexts=[64]", "check.batches=[1]"], tmp_path, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    results = Path(out.stdout.strip().splitlines()[-1].removeprefix("results: "))
    summary = json.loads((results / "summary.json").read_text())
    assert summary["model"]["n_layers"] == 30 and summary["model"]["n_kv_heads"] == 3
    assert summary["stage_meta"]["traces"]["n_tokens"] == 256


def _table(text: str) -> list[str]:
    """The exit-code table's lines: the header `| code | name | meaning |` and the rows under it."""
    lines = text.splitlines()
    start = lines.index("| code | name | meaning |")
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def test_exit_codes_are_one_table():
    """pipeline/errors.py's docstring and README.md hold the same table, and it is the module's constants."""
    doc, readme = _table(errors.__doc__), _table((ROOT / "README.md").read_text())
    assert doc == readme
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in doc[2:]]
    table = {name.strip("`"): int(code) for code, name, _ in rows}
    constants = {name: getattr(errors, name) for name in dir(errors) if name.startswith("EXIT_")}
    assert table == constants and len(set(table.values())) == len(table)
    assert constants["EXIT_INTERNAL"] not in (constants["EXIT_USER"], constants["EXIT_CHECK_FAILED"])


def _run_planted(patch: str, args, tmp_path):
    """`python -m pipeline ARGS` with PATCH applied first (a planted fault), as a process."""
    script = tmp_path / "planted.py"
    script.write_text(f"import sys\n{patch}\nfrom pipeline.cli import main\nmain(sys.argv[1:])\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)


QUICK = [*(a for a in TINY if not a.startswith("quant=")), "quant=int4-token", "eval.enabled=false", "gate.enabled=false", "check.contexts=[16]",
         "check.gpu_contexts=[16]", "check.batches=[1]"]


def test_a_failed_runtime_check_exits_1_under_run(tmp_path):
    """The kernel made wrong by 1%: the run exports, checks, records the failure and exits EXIT_CHECK_FAILED."""
    patch = ("import serving.triton_attention as t\nreal = t.decode_attention\n"
             "t.decode_attention = lambda inp, **kw: real(inp, **kw) * 1.01")
    out = _run_planted(patch, ["run", *QUICK], tmp_path)
    assert out.returncode == EXIT_CHECK_FAILED, out.stderr[-2000:]
    assert "runtime check failed for" in out.stderr and "Traceback" not in out.stderr
    (manifest,) = tmp_path.glob("outputs/*/*/artifact/manifest.json")
    assert json.loads(manifest.read_text())["runtime_check"]["status"] == "failed"


@pytest.mark.parametrize("raised", ["RuntimeError('planted bug')", "ValueError('planted broken invariant')"])
def test_an_unexpected_error_exits_internal(tmp_path, raised):
    """Neither a user error (2) nor a failed check (1): its own code, with the traceback. A plain ValueError is a
    broken invariant, not bad input (bad input raises InputError / UserError)."""
    patch = f"import pipeline.app\ndef boom(*a, **k):\n    raise {raised}\npipeline.app.run_pipeline = boom"
    out = _run_planted(patch, ["run", *TINY], tmp_path)
    assert out.returncode == EXIT_INTERNAL, out.stderr[-2000:]
    assert "Traceback" in out.stderr and "internal error (a bug, not bad input)" in out.stderr
    assert "planted" in out.stderr


def test_check_and_show_exit_internal_on_a_bug(tmp_path, monkeypatch, capsys):
    import pipeline.check
    from pipeline.cli import main

    def boom(*a, **k):
        raise KeyError("planted")

    monkeypatch.setattr(pipeline.check, "run_check", boom)
    with pytest.raises(SystemExit) as exit_:
        main(["check", str(tmp_path)])
    assert exit_.value.code == EXIT_INTERNAL and "KeyError: 'planted'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # and the strict loader's refusal stays bad input
        main(["show", str(tmp_path)])
    assert exit_.value.code == EXIT_USER


def _console_script(args, cwd):
    """The installed `kvcalib` entry point (pyproject.toml [project.scripts]) beside the interpreter running the
    tests, as a user's shell runs it."""
    script = Path(sys.executable).parent / "kvcalib"
    assert script.is_file(), f"no console script at {script}; reinstall: {sys.executable} -m pip install -e ."
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_kvcalib_console_script_runs_the_same_commands(tmp_path, make_artifact):
    """`kvcalib --help`, `kvcalib check DIR` and a refused `kvcalib run`: what `python -m pipeline` does, with the
    same exit codes, the usage naming the console script."""
    out = _console_script(["--help"], tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("usage: kvcalib <command>"), out.stderr
    assert all(f"\n  {c} " in out.stdout for c in ("run", "check", "show", "export-vllm", "recommend"))
    assert "`kvcalib <command> --help`" in out.stdout
    out = _console_script(["show", "--help"], tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("usage: kvcalib show "), out.stderr
    assert _console_script(["nope"], tmp_path).returncode == EXIT_USER
    path = make_artifact("int4-token")
    out = _console_script(["check", str(path), "contexts=[32]", "batches=[1]", "model.source=tiny",
                           "allow_unclaimed=true"], tmp_path)
    assert out.returncode == 0 and "runtime check passed" in out.stdout, out.stderr[-2000:]
    out = _console_script(["check", str(tmp_path / "missing")], tmp_path)
    assert out.returncode == EXIT_USER and "Traceback" not in out.stderr, out.stderr[-2000:]
    out = _console_script(["run", *TINY, "data.seq_len=1"], tmp_path)
    assert out.returncode == EXIT_USER and "data.seq_len must be >= 2 tokens, got 1" in out.stderr


# ---- paths the system cannot look up; what `show` takes its argument for (issue 68, items 3 and 6) -------------------

def _main(args, capsys):
    """pipeline.cli.main(args) in this process -> (exit code, stdout, stderr)."""
    from pipeline.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(args)
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


LONG = "p" * 5000


@pytest.mark.parametrize("args,named", [
    (["show", LONG], "ARTIFACT"),
    (["check", LONG], "ARTIFACT"),
    (["check", "a/" * 2500, "contexts=[8]"], "ARTIFACT"),
    (["check", "some-artifact", "--out", LONG], "--out"),
    (["export-vllm", LONG, "out"], "ARTIFACT"),
    (["export-vllm", "some-artifact", "out", f"model.path={LONG}"], "model.path"),
    (["recommend", LONG], "RUN_DIR"),
    (["recommend", "--platform", "gpu", "x" * 300], "RUN_DIR"),
    (["run", "model=llama3", f"model.path={LONG}"], "model.path"),
], ids=["show", "check", "check-in-parts", "check-out", "export-vllm", "export-vllm-model-path", "recommend",
        "recommend-component-300", "run-model-path"])
def test_a_path_the_system_cannot_look_up_exits_2_in_one_line(capsys, args, named):
    """Before: OSError ENAMETOOLONG from os.stat / Path.is_dir in the command, exit 5 ("a bug") with a traceback."""
    code, _, err = _main(args, capsys)
    assert code == EXIT_USER and err.count("\n") == 1 and "Traceback" not in err, err[-2000:]
    assert err.startswith(f"error: {named}: ") and "File name too long" in err and len(err) < 600, err


def test_export_vllm_refuses_an_out_path_too_long_before_anything_loads(make_artifact, capsys):
    """Before: the artifact and the model loaded, then Path.exists(OUT) raised OSError: exit 5."""
    code, _, err = _main(["export-vllm", str(make_artifact("fp8-e4m3")), "o" * 5000], capsys)
    assert code == EXIT_USER and err.startswith("error: OUT: ") and err.count("\n") == 1, err[-2000:]


@pytest.mark.parametrize("target,says", [
    ("some/folder/that-does-not-exist", "ARTIFACT: no such folder: some/folder/that-does-not-exist (an artifact "
                                        "folder holds manifest.json"),
    ("./artifact", "ARTIFACT: no such folder: ./artifact"),
    ("~/outputs/artifact", "ARTIFACT: no such folder: ~/outputs/artifact"),
    (".artifact", "ARTIFACT: no such folder: .artifact"),
    ("here/a-file.txt", "ARTIFACT: is not a folder: here/a-file.txt"),
    ("a\x1b[2J/b", "ARTIFACT: no such folder: a\\x1b[2J/b"),
    ("not-a-run-id", "not-a-run-id is neither an artifact folder (no folder of that name here) nor an MLflow run id "
                     "(32 lowercase hexadecimal digits, as `run` prints it: `mlflow: run RUN_ID ...`)"),
    ("0123456789ABCDEF" * 2, "is neither an artifact folder"),
], ids=["missing-folder", "dot-slash", "tilde", "leading-dot", "a-file", "escape", "neither", "upper-case-hex"])
def test_show_tells_a_missing_folder_from_a_run_id_before_mlflow(tmp_path, monkeypatch, capsys, target, says):
    """Before: any argument that was no folder was taken for a run id: MLflow opened (47-50 s), then a message
    about tracking.uri. Now a path or anything unlike a run id is refused at once, MLflow never consulted."""
    import time

    import pipeline.tracking

    def consulted(*_a, **_k):
        raise AssertionError("MLflow consulted")

    monkeypatch.setattr(pipeline.tracking, "show_run", consulted)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "a-file.txt").write_text("x")
    start = time.monotonic()
    code, _, err = _main(["show", target], capsys)
    assert code == EXIT_USER and err.count("\n") == 1 and says in err and "\x1b" not in err, err[-2000:]
    assert time.monotonic() - start < 5


def test_show_takes_a_run_id_to_mlflow(tmp_path, monkeypatch, capsys):
    import pipeline.tracking

    seen = []
    monkeypatch.setattr(pipeline.tracking, "show_run", lambda run_id, uri: seen.append((run_id, uri)) or "the run")
    monkeypatch.chdir(tmp_path)
    run_id = "0123456789abcdef" * 2
    code, out, _ = _main(["show", run_id, "tracking.uri=sqlite:///x.db"], capsys)
    assert code == 0 and out == "the run\n" and seen == [(run_id, "sqlite:///x.db")]


def test_show_of_a_missing_folder_touches_no_mlflow(tmp_path):
    """`show some/folder/that-does-not-exist`, as a user types it: the folder named at once, MLflow never imported
    and no tracking store created (before: taken for a run id, MLflow opened for most of a minute)."""
    out = _run_planted(WATCH_IMPORTS, ["show", "some/folder/that-does-not-exist"], tmp_path)
    assert out.returncode == EXIT_USER and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: ARTIFACT: no such folder: some/folder/that-does-not-exist ("), out.stderr
    assert "heavy modules: []" in out.stderr and not (tmp_path / "mlruns.db").exists()


# ---- Ctrl-C: one line, exit 130, and the same command takes it up again (issue 69) --------------------------------

# a first look at one's own model, cut down to seconds: the stages and the MLflow run a user's run has
OWN = ["preset=quick", "data.seq_len=128", "data.eval_seq_len=128", "traces.reservoir_size=64", "model.dtype=float32",
       "sensitivity.enabled=false", "probes.enabled=false", "check.enabled=false"]


def test_ctrl_c_during_a_run_is_one_line_and_the_same_command_resumes(own_model, tmp_path):
    """A real SIGINT to `python -m pipeline run model=llama3 model.path=DIR ...` once a stage has finished (its line
    on stdout): exit 130, stderr's last line says so with the user's own command line (before: a 110-line
    traceback), the MLflow run is marked KILLED; the same command then finishes, reusing the finished stages."""
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlruns.db'}"
    args = ["run", "model=llama3", f"model.path={own_model}", f"tracking.uri={store}", *OWN]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    finished = None
    for line in proc.stdout:
        if line.startswith("stage "):   # `stage traces: computed KEY (s)`: stored; the next stage is running
            finished = line.split(":")[0].removeprefix("stage ")
            proc.send_signal(signal.SIGINT)
            break
    _, err = proc.communicate(timeout=600)
    assert finished is not None and proc.returncode == EXIT_INTERRUPTED, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == ("interrupted; finished stages are kept: the same command resumes: "
                                            f"python -m pipeline {shlex.join(args)}"), err[-3000:]
    client = MlflowClient(tracking_uri=store)
    (killed,) = client.search_runs([client.get_experiment_by_name("kvcalib").experiment_id])
    assert killed.info.status == "KILLED"

    again = _run(args, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"stage {finished}: reused cache entry" in again.stdout, again.stdout[-3000:]


def test_ctrl_c_during_export_vllm_leaves_no_partial_folder(tmp_path, make_artifact):
    """A real SIGINT while export-vllm writes (the model's weights in its temporary folder, nothing else yet): exit
    130, one line naming the same command, and neither OUT nor its temporary sibling left behind."""
    patch = ("import os, signal\nimport pipeline.faults as f\nreal = f.point\n"
             "def point(name):\n    real(name)\n    if name == 'export.vllm_weights_written':\n"
             "        os.kill(os.getpid(), signal.SIGINT)\nf.point = point")
    args = ["export-vllm", str(make_artifact("kvquant-4b-1pct")), str(tmp_path / "out"), "--unchecked",
            "model.source=tiny"]
    out = _run_planted(patch, args, tmp_path)
    assert out.returncode == EXIT_INTERRUPTED and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "interrupted; no partial OUT folder is left (it is written whole or not at all): the same command exports "
        f"it: python -m pipeline {shlex.join(args)}"), out.stderr
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))]


def test_ctrl_c_during_check_writes_no_record(tmp_path, make_artifact):
    """A real SIGINT while `check` runs (the runtime check done, the canary about to start): exit 130, one line,
    the artifact unchanged and no check record beside it."""
    from pipeline.check import result_path

    art = make_artifact("int4-token")
    before = {p.name: p.read_bytes() for p in art.iterdir()}
    patch = ("import os, signal\nimport pipeline.check as c\nreal = c.quality_canary\n"
             "def canary(*a, **k):\n    os.kill(os.getpid(), signal.SIGINT)\n    return real(*a, **k)\n"
             "c.quality_canary = canary")
    args = ["check", str(art), "contexts=[16]", "batches=[1]", "model.source=tiny", "allow_unclaimed=true"]
    out = _run_planted(patch, args, tmp_path)
    assert out.returncode == EXIT_INTERRUPTED and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "interrupted; the artifact is unchanged and no check record was written: the same command checks it again: "
        f"python -m pipeline {shlex.join(args)}"), out.stderr
    assert "runtime check" in out.stdout   # it was interrupted running, not before
    assert {p.name: p.read_bytes() for p in art.iterdir()} == before and not result_path(art).exists()


@pytest.mark.parametrize("command,module,function,says", [
    ("show", "pipeline.cli", "show_target", "nothing was changed: the same command shows it again"),
    ("recommend", "pipeline.recommend", "read_summary", "nothing was changed: the same command recommends again"),
])
def test_ctrl_c_during_show_or_recommend_is_one_line(tmp_path, command, module, function, says):
    """A real SIGINT as the command reads its argument: exit 130 and one line, no traceback."""
    patch = (f"import os, signal\nimport {module} as m\nreal = m.{function}\n"
             f"def interrupted(*a, **k):\n    os.kill(os.getpid(), signal.SIGINT)\n    return real(*a, **k)\n"
             f"m.{function} = interrupted")
    out = _run_planted(patch, [command, "outputs/some-run"], tmp_path)
    assert out.returncode == EXIT_INTERRUPTED and out.stdout == "", out.stderr[-3000:]
    assert out.stderr == f"interrupted; {says}: python -m pipeline {command} outputs/some-run\n", out.stderr
