"""The runtime check as the pipeline runs it (pipeline/check.py) on tiny-model artifacts: it passes for every
recipe and records a failure in the manifest; `python -m pipeline check` and `run` exit with the codes of
pipeline/errors.py."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from exporters.native import load_artifact
from pipeline.check import result_path, run_check
from pipeline.check_config import CheckConfig
from pipeline.config import load_recipe, recipe_names
from pipeline.errors import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USER, RuntimeCheckError, UserError
from serving import triton_attention
from stages.recipe import is_exportable_recipe

ROOT = Path(__file__).resolve().parents[2]


def quiet(_msg):
    pass


def manifest_of(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


@pytest.mark.parametrize("recipe", [n for n in recipe_names() if is_exportable_recipe(load_recipe(n))])
def test_check_passes_for_every_recipe(tiny, make_artifact, recipe):
    path = make_artifact(recipe)
    q = load_recipe(recipe)
    # > KIVI's 128 residual + one 32-token group, and past the sinks and recent window of the long-context recipes:
    # every path runs, encoded rows included
    cfg = CheckConfig(contexts=[max(170, q.n_sink + q.residual + 40)], batches=[2])
    result = run_check(path, tiny, cfg, log=quiet)
    assert result["status"] == "passed", result
    assert result["max_rel_err"] < 1e-5 and result["interpreter"] == (not torch.cuda.is_available())
    written = manifest_of(path)["runtime_check"]
    assert written["status"] == "passed" and written["tolerance"]["rtol"] == result["tolerance"]["rtol"]
    assert {"max_abs_err", "max_rel_err", "reason", "device", "triton", "contexts", "batches"} <= set(written)
    load_artifact(path, tiny.spec)  # the updated manifest still loads strictly


def test_a_disagreeing_kernel_is_a_recorded_failure(tiny, make_artifact):
    path = make_artifact("kvquant-3b-1pct")

    def scaled(inp):
        return triton_attention.decode_attention(inp) * 1.01

    result = run_check(path, tiny, CheckConfig(contexts=[64], batches=[2]), kernel=scaled, log=quiet)
    assert result["status"] == "failed" and "error" not in result
    assert result["max_rel_err"] > 10 * result["tolerance"]["rtol"], result["max_rel_err"]
    assert manifest_of(path)["runtime_check"]["status"] == "failed"


def test_a_kernel_that_raises_is_a_recorded_failure(tiny, make_artifact):
    path = make_artifact("int4-token")

    def broken(inp):
        raise ValueError("no such format")

    result = run_check(path, tiny, CheckConfig(contexts=[16], batches=[1]), kernel=broken, log=quiet)
    assert result["status"] == "failed" and "ValueError: no such format" in result["error"]
    assert manifest_of(path)["runtime_check"]["error"] == result["error"]


def test_bad_contexts_and_batches_are_refused_before_the_model_loads(tmp_path):
    """No model_bundle is given: a refusal that needed the model would fail differently (no artifact exists)."""
    for cfg, pattern in [(CheckConfig(contexts=[]), "must be non-empty"),
                         (CheckConfig(contexts=[0]), r"each context must be in \[1\]"),
                         (CheckConfig(batches=[0]), "each batch size must be >= 1, got 0")]:
        if torch.cuda.is_available():
            cfg.gpu_contexts = cfg.contexts
        with pytest.raises(UserError, match=pattern):
            run_check(tmp_path / "missing", cfg=cfg, log=quiet)


def _cli(args, cwd):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pipeline", "check", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_cli_check_passes_and_refuses_a_tampered_codebook(tmp_path, tiny, make_artifact, forge):
    """`python -m pipeline check DIR [contexts=..] [batches=..]`: EXIT_OK when it passes; a codebook whose levels
    were permuted in the file (checksums and digest re-made so only the content is wrong) is refused by the strict
    loader (EXIT_USER)."""
    path = make_artifact("kvquant-4b-1pct")
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    # a tiny (random) model is judged on only when the user names it; this artifact was exported without a check,
    # so it claims no canary: judged on the limits alone only when allowed
    tiny_args = ["model.source=tiny", "allow_unclaimed=true"]
    out = _cli([str(path), "contexts=[40,170]", "check.batches=[2]", *tiny_args], tmp_path)
    assert out.returncode == EXIT_OK, out.stderr[-2000:]
    assert "runtime check passed" in out.stdout and "context    170 batch 2" in out.stdout
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before  # checking never modifies the artifact
    written = json.loads(result_path(path).read_text())  # the record beside it: ARTIFACT.check.json
    assert result_path(path) == path.parent / f"{path.name}.check.json"
    assert written["contexts"] == [40, 170] and written["batches"] == [2] and written["status"] == "passed"
    elsewhere = tmp_path / "records" / "check.json"
    elsewhere.parent.mkdir()
    out = _cli([str(path), "contexts=[40]", "batches=[1]", *tiny_args, "--out", str(elsewhere)], tmp_path)
    assert out.returncode == EXIT_OK and json.loads(elsewhere.read_text())["contexts"] == [40]
    with pytest.raises(UserError, match=r"each context must be in \[1, 4095\]"):
        run_check(path, tiny, CheckConfig(contexts=[4096]), log=quiet)

    def permute(tensors):
        tensors["layers.0.key.codebook"] = tensors["layers.0.key.codebook"].flip(0).contiguous()

    forge(path, edit_tensors=permute)
    out = _cli([str(path), "contexts=[32]", "batches=[1]", *tiny_args], tmp_path)
    assert out.returncode == EXIT_USER and "codebook must be finite and strictly increasing" in out.stderr


def test_check_main_exits_check_failed_when_the_kernel_disagrees(make_artifact, monkeypatch, capsys):
    """`python -m pipeline check` (main, in-process so the kernel can be made wrong): EXIT_CHECK_FAILED."""
    from pipeline.check import main

    path = make_artifact("int4-token")
    real = triton_attention.decode_attention
    monkeypatch.setattr(triton_attention, "decode_attention", lambda inp, **kw: real(inp, **kw) * 1.01)
    assert main([str(path), "contexts=[16]", "gpu_contexts=[16]", "batches=[1]", "model.source=tiny",
                 "allow_unclaimed=true"]) == EXIT_CHECK_FAILED
    assert "runtime check FAILED" in capsys.readouterr().out
    assert json.loads(result_path(path).read_text())["status"] == "failed"
    assert manifest_of(path)["runtime_check"] is None  # the artifact as exported
    assert main([str(path), "contexts=[0]", "gpu_contexts=[0]"]) == EXIT_USER
    assert main([str(path), "bogus=1"]) == EXIT_USER


def _disagreeing(real):
    return lambda inp, **kw: real(inp, **kw) * 1.01


def _raising(real):
    def kernel(inp, **kw):
        raise ValueError("no such format")
    return kernel


@pytest.mark.parametrize("faulty, cause", [
    (_disagreeing, r"max_rel_err (?P<rel>\S+) beyond rtol (?P<rtol>\S+) \(max_abs_err (?P<abs>\S+)\)"),
    (_raising, r"context 16, batch 1, triton kernel: layer 0: ValueError: no such format")])
def test_a_failed_check_fails_the_run(tmp_path, monkeypatch, faulty, cause):
    """run_pipeline runs the check after export; a kernel that disagrees with the oracle or raises is written to the
    manifest and the summary, then raised as a RuntimeCheckError naming the cause the manifest records."""
    from omegaconf import OmegaConf

    from pipeline.app import run_pipeline
    from pipeline.config import RunConfig, to_typed

    cfg = to_typed(OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.from_dotlist([
        "model.name=tiny", "model.source=tiny", "data.n_samples=1", "data.seq_len=16", "data.eval_n_samples=1",
        "data.eval_seq_len=16", "traces.reservoir_size=16", "eval.enabled=false", "tracking.enabled=false",
        "sensitivity.enabled=false", "probes.enabled=false", "gate.enabled=false", "check.contexts=[16]",
        "check.batches=[1]", f"cache_dir={tmp_path / 'cache'}", "quant.name=int4-token", "quant.key.format=uniform",
        "quant.key.bits=4", "quant.key.axis=token", "quant.value.format=uniform", "quant.value.bits=4",
        "quant.value.axis=token"])))
    monkeypatch.setattr(triton_attention, "decode_attention", faulty(triton_attention.decode_attention))
    with pytest.raises(RuntimeCheckError) as raised:
        run_pipeline(cfg, tmp_path / "run", log=quiet, show_progress=False)
    recorded = manifest_of(tmp_path / "run" / "artifact")["runtime_check"]
    assert recorded["status"] == "failed" and raised.value.result == recorded
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["runtime_check"] == recorded
    message, artifact = str(raised.value), re.escape(str((tmp_path / "run" / "artifact").resolve()))
    found = re.fullmatch(f"runtime check failed for {artifact}: {cause}; see runtime_check in its manifest.json",
                         message)
    assert found, message
    if "error" in recorded:
        assert f": {recorded['error']}; see" in message
    else:
        assert recorded["max_rel_err"] > 10 * recorded["tolerance"]["rtol"]
        assert float(found["rel"]) == pytest.approx(recorded["max_rel_err"], rel=1e-3)
        assert float(found["rtol"]) == recorded["tolerance"]["rtol"]
        assert float(found["abs"]) == pytest.approx(recorded["max_abs_err"], rel=1e-3)


def test_a_failed_check_under_run_exits_as_check_does(tmp_path, monkeypatch, capsys):
    """`python -m pipeline run` maps a RuntimeCheckError to EXIT_CHECK_FAILED, the code `check` exits with --
    not EXIT_USER, which bad input gets (a RuntimeCheckError is no ValueError)."""
    from omegaconf import OmegaConf

    import pipeline.app
    from pipeline.cli import run_from_dictconfig
    from pipeline.config import RunConfig

    result = {"status": "failed", "max_abs_err": 1.0, "max_rel_err": 0.5, "tolerance": {"rtol": 2e-4}}

    def failing(cfg, run_dir, **kw):
        raise RuntimeCheckError(run_dir / "artifact", result)

    monkeypatch.setattr(pipeline.app, "run_pipeline", failing)
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.from_dotlist([
        "model.name=tiny", "model.source=tiny", "tracking.enabled=false"]))
    assert not issubclass(RuntimeCheckError, ValueError)
    assert run_from_dictconfig(cfg, tmp_path / "run") == EXIT_CHECK_FAILED
    assert "runtime check failed" in capsys.readouterr().err


def _strict_json(raw: str):
    """JSON as the standard defines it: NaN and Infinity, which Python's json writes and reads, are refused."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(raw, parse_constant=refuse)


@pytest.mark.parametrize("where, bad", [("kernel", "inf"), ("oracle", "nan")])
def test_a_non_finite_output_is_a_failed_check_written_as_json(tiny, make_artifact, monkeypatch, where, bad):
    """A kernel or oracle output holding inf / NaN fails the check: `check` exits EXIT_CHECK_FAILED (not EXIT_USER:
    the artifact is fine), and the record stays strict JSON -- the case has no figures, `error` says why."""
    from pipeline.check import main
    from runtime_check import reference

    module = triton_attention if where == "kernel" else reference
    real = module.decode_attention

    def poisoned(inp, **kw):
        out = real(inp, **kw).clone()
        out[0, 0, 0] = float(bad)
        return out

    monkeypatch.setattr(module, "decode_attention", poisoned)
    path = make_artifact("int4-token")
    assert main([str(path), "contexts=[16]", "gpu_contexts=[16]", "batches=[1]", "model.source=tiny",
                 "allow_unclaimed=true"]) == EXIT_CHECK_FAILED
    recorded = _strict_json(result_path(path).read_text())
    n = tiny.spec.n_q_heads * tiny.spec.head_dim
    assert recorded["error"] == (f"context 16, batch 1, triton kernel: layer 0: the {where}'s output holds 1 "
                                 f"non-finite values "
                                 f"(NaN or inf) of {n}")
    assert recorded["status"] == "failed" and recorded["cases"] == [] and recorded["max_rel_err"] is None
    load_artifact(path, tiny.spec)


def test_the_kernel_runs_on_each_layers_device(monkeypatch):
    """Under a device_map each layer's inputs are on its own GPU (emulated: tests/virtual_devices.py): the Triton
    kernel is launched there, not on the first GPU for every layer; inputs on the CPU of a GPU machine (a model on
    the CPU) go to the GPU, and without one the interpreter runs on the CPU."""
    from types import SimpleNamespace

    from pipeline.check import triton_kernel
    from tests.virtual_devices import VirtualDevices

    seen = []
    monkeypatch.setattr(triton_attention, "decode_attention", lambda inp, **kw: seen.append(kw["device"]))
    with VirtualDevices() as mode:
        for device in ("cuda:1", "cuda:0"):
            triton_kernel(native=True)(SimpleNamespace(q=mode.place(torch.zeros(1, 2, 4), device)))
    triton_kernel(native=True)(SimpleNamespace(q=torch.zeros(1, 2, 4)))
    triton_kernel(native=False)(SimpleNamespace(q=torch.zeros(1, 2, 4)))
    assert seen == [torch.device("cuda:1"), torch.device("cuda:0"), torch.device("cuda"), torch.device("cpu")]


def test_a_random_model_the_artifact_names_is_not_followed_unasked(make_artifact, capsys):
    """An artifact's model.source is a suggestion: a random model built from its settings (a stranger's artifact could
    name a random twin of any shape and tokenizer) is refused before anything loads, naming what to pass."""
    from pipeline.check import main

    path = make_artifact("int4-token")
    assert main([str(path), "contexts=[16]", "batches=[1]"]) == EXIT_USER
    err = capsys.readouterr().err
    assert "which check does not follow unasked" in err and "model.path=FOLDER" in err


def test_an_unbounded_random_model_is_refused_before_it_is_allocated(make_artifact, capsys):
    from pipeline.check import main

    path = make_artifact("int4-token")
    assert main([str(path), "model.source=tiny", "model.tiny.n_layers=1024", "model.tiny.hidden_size=65536",
                 "model.tiny.intermediate_size=262144", "contexts=[16]", "batches=[1]"]) == EXIT_USER
    assert re.search(r"model\.tiny: a random model of 1024 layers, .* takes \d+\.\d GiB; allowed at most 0\.5 of",
                     capsys.readouterr().err)


def test_another_models_weights_are_refused_by_name_unless_a_transfer_is_allowed(make_artifact, capsys):
    """The model loaded is compared with the artifact's record of its weights: another seed of the same shapes is
    another model, refused (exit 2) naming both sha256; allow_other_model=true judges it and says so."""
    from pipeline.check import main

    path = make_artifact("int4-token")
    other = ["model.source=tiny", "model.tiny.seed=1", "contexts=[16]", "batches=[1]"]
    assert main([str(path), *other]) == EXIT_USER
    err = capsys.readouterr().err
    assert "model/sha256: the artifact was calibrated for tiny with weights sha256" in err
    assert "allow_other_model=true" in err
    assert main([str(path), *other, "allow_other_model=true", "allow_unclaimed=true"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "ANOTHER model than calibrated (allow_other_model=true)" in out and "verdict reached on tiny (tiny)" in out
    record = json.loads(result_path(path).read_text())
    assert record["judged_on"]["other_model"] is True and record["status"] == "passed"


def test_a_canary_that_cannot_run_fails_the_check(tiny, make_artifact, monkeypatch):
    """No field of an artifact switches the canary off: one that does not fit the model is a failed check."""
    from runtime_check import canary

    path = make_artifact("int4-token")
    monkeypatch.setattr(canary, "lengths", lambda *a, **k: None)
    result = run_check(path, tiny, CheckConfig(contexts=[16], batches=[1]), write=False, log=quiet)
    assert result["status"] == "failed" and result["error"].startswith("the quality canary cannot run")


def test_strings_of_the_artifact_reach_the_terminal_escaped(make_artifact, forge, capsys):
    from pipeline.check import main

    path = make_artifact("int4-token")

    def rename(m):
        m["model"]["name"] = "evil\x1b[2J\nname"

    forge(path, edit=rename, rebind=True)
    main([str(path), "model.source=tiny", "allow_unclaimed=true", "contexts=[16]", "batches=[1]"])
    captured = capsys.readouterr()
    assert "\x1b" not in captured.out + captured.err and "evil\\x1b[2J\\nname" in captured.out


def test_random_shapes_transformers_refuses_are_the_inputs_refusal(make_artifact, capsys):
    """A hidden size the heads do not divide: transformers' own validation error is an exit 2 naming model.tiny, not
    an internal error (issue 68: the artifact's random model of SmolLM2's 9 heads and 65536 hidden exited 5)."""
    from pipeline.check import main

    path = make_artifact("int4-token")
    assert main([str(path), "model.source=tiny", "model.tiny.n_q_heads=9", "model.tiny.n_kv_heads=3",
                 "model.tiny.hidden_size=100", "contexts=[16]", "batches=[1]"]) == EXIT_USER
    assert "model.tiny: transformers refuses these shapes" in capsys.readouterr().err
