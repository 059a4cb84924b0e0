"""The vLLM checkpoint folder (pipeline/export.py write_vllm_checkpoint, exporters/compressed_tensors.py): complete,
loadable by transformers, verified whole, refused with nothing written, and its weights linked from a source."""
import json
import os
import subprocess
import sys

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy, QuantizationType
from safetensors.torch import load_file

from exporters import compressed_tensors as ct
from exporters.checksums import sha256_file
from exporters.manifest import ChecksumError
from exporters.native import load_artifact
from pipeline.errors import EXIT_USER
from pipeline.export import write_vllm_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def resign(folder):
    """Rewrite kvcalib/checkpoint.json for the folder as it now is: a forger keeping the record valid, so the
    check under test is the one left to refuse the edit."""
    (folder / ct.ARTIFACT_DIR / ct.RECORD_FILE).write_text(json.dumps(ct.file_record(folder)))


@pytest.fixture
def checkpoint(tmp_path, make_artifact, tiny):
    art = make_artifact("fp8-e4m3")
    return write_vllm_checkpoint(tmp_path / "ckpt", art, tiny), art


def test_the_checkpoint_is_complete_and_verifies(checkpoint, tiny):
    ckpt, art = checkpoint
    names = {p.name for p in ckpt.iterdir()}
    assert {"config.json", "model.safetensors", ct.INDEX_FILE, ct.SCALES_FILE, "tokenizer.json",
            "tokenizer_config.json", ct.ARTIFACT_DIR} <= names
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    scheme = QuantizationConfig.model_validate(config["quantization_config"]).kv_cache_scheme  # as vLLM parses it
    assert scheme.num_bits == 8 and scheme.type == QuantizationType.FLOAT
    assert scheme.strategy == QuantizationStrategy.TENSOR and scheme.symmetric and not scheme.dynamic
    index = json.loads((ckpt / ct.INDEX_FILE).read_text())["weight_map"]
    scales = load_file(str(ckpt / ct.SCALES_FILE))
    policy = load_artifact(art).policy
    for i, (k, v) in enumerate(policy.layers):
        for which, p in (("k_scale", k), ("v_scale", v)):
            name = f"model.layers.{i}.self_attn.{which}"
            assert index[name] == ct.SCALES_FILE
            assert scales[name].dtype == torch.float32 and scales[name].shape == () and torch.equal(scales[name], p.fp8_scale.float())
    weights = load_file(str(ckpt / "model.safetensors"))
    state = tiny.model.state_dict()
    assert set(weights) == set(state) - {"lm_head.weight"}  # tied: config.json says tie_word_embeddings
    assert all(torch.equal(weights[n], state[n]) for n in weights)
    assert {n for n, f in index.items() if f == "model.safetensors"} == set(weights)
    # the strict loader takes the folder as it takes an artifact
    loaded = load_artifact(ckpt, tiny.spec)
    assert loaded.manifest["recipe"] == "fp8-e4m3"


def test_transformers_loads_the_weights_back(checkpoint, tiny):
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt, _ = checkpoint
    config = AutoConfig.from_pretrained(str(ckpt))
    delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), config=config, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 50, 700, 3000, 12]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, tiny.model(ids).logits)
    # as is, the compressed-tensors scheme in config.json: transformers loads it and leaves the cache unquantized
    as_is = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(as_is(ids).logits, tiny.model(ids).logits)


def test_a_scale_left_out_of_the_index_is_refused(checkpoint):
    ckpt, _ = checkpoint
    path = ckpt / ct.INDEX_FILE
    index = json.loads(path.read_text())
    del index["weight_map"]["model.layers.1.self_attn.v_scale"]
    path.write_text(json.dumps(index))
    with pytest.raises(ChecksumError, match="model.safetensors.index.json: sha256 differs"):
        ct.verify_checkpoint(ckpt)
    resign(ckpt)
    with pytest.raises(ct.CheckpointError, match=r"weight_map\['model.layers.1.self_attn.v_scale'\].*1.0 default"):
        ct.verify_checkpoint(ckpt)


def test_a_changed_scale_or_an_added_file_is_refused(checkpoint):
    from safetensors.torch import save_file

    ckpt, _ = checkpoint
    scales = load_file(str(ckpt / ct.SCALES_FILE))
    scales["model.layers.0.self_attn.k_scale"] = scales["model.layers.0.self_attn.k_scale"] * 2
    save_file(scales, str(ckpt / ct.SCALES_FILE))
    resign(ckpt)
    with pytest.raises(ct.CheckpointError, match="model.layers.0.self_attn.k_scale: differs from the artifact"):
        ct.verify_checkpoint(ckpt)
    ckpt2 = checkpoint[0]
    (ckpt2 / "extra.safetensors").write_bytes(b"x")
    with pytest.raises(ct.CheckpointError, match=r"files not in kvcalib/checkpoint.json: \['extra.safetensors'\]"):
        ct.verify_checkpoint(ckpt2)


@pytest.mark.parametrize("recipe,message", [
    ("kivi-2", r"as an fp8 checkpoint: cache/residual.*layers/0/key/format: vLLM's scaled cache is fp8; allowed "
               r"'fp8', got 'uniform'.*by the kvcalib vLLM plugin: layers/0/key/axis"),
    ("kvquant-3b-1pct+smooth", r"recipe 'kvquant-3b-1pct\+smooth' is not servable by vLLM: as an fp8 checkpoint: "
                               r"cache/key_rope: vLLM's cache allows 'post', got 'pre'.*by the kvcalib vLLM plugin: "
                               r"cache/smoothing: SmoothAttention scales are not served by the vLLM plugin; allowed null"),
])
def test_a_recipe_vllm_cannot_serve_is_refused_and_nothing_is_written(tmp_path, make_artifact, tiny, recipe, message):
    art = make_artifact(recipe)
    before = set(tmp_path.iterdir())
    with pytest.raises(ct.CheckpointError, match=message):
        write_vllm_checkpoint(tmp_path / "ckpt", art, tiny)
    assert set(tmp_path.iterdir()) == before


def test_scales_of_refuses_per_head_scales(calib, tiny):
    from exporters.codec import CachePolicy, TensorPolicy

    p = TensorPolicy(format="fp8", bits=8, axis="head", fp8_scale=torch.full((2,), 0.1))
    with pytest.raises(ct.CheckpointError, match=r"layers/0/key/axis: allowed 'tensor'.*got 'head'"):
        ct.scales_of(CachePolicy("fp8-head", [(p, p)] * 2))


def test_an_existing_folder_is_kept_unless_overwrite(checkpoint, tiny):
    ckpt, art = checkpoint
    with pytest.raises(ct.CheckpointError, match="already exists; pass overwrite=True"):
        write_vllm_checkpoint(ckpt, art, tiny)
    again = write_vllm_checkpoint(ckpt, art, tiny, overwrite=True)
    ct.verify_checkpoint(again)
    assert not [p for p in ckpt.parent.iterdir() if p.name.startswith(".")]


def test_a_hugging_face_source_is_linked_and_its_index_merged(tmp_path, make_artifact, tiny):
    source = tmp_path / "hf"
    tiny.model.save_pretrained(str(source), max_shard_size="2MB")  # several shards and an index
    tiny.tokenizer.save_pretrained(str(source))
    src_index = json.loads((source / ct.INDEX_FILE).read_text())["weight_map"]
    assert len(set(src_index.values())) > 1
    ckpt = write_vllm_checkpoint(tmp_path / "ckpt", make_artifact("fp8-e4m3"), tiny, source_dir=source)
    for shard in set(src_index.values()):
        assert os.stat(ckpt / shard).st_ino == os.stat(source / shard).st_ino  # a hard link, not a copy
        assert sha256_file(ckpt / shard) == sha256_file(source / shard)
    index = json.loads((ckpt / ct.INDEX_FILE).read_text())["weight_map"]
    assert {k: v for k, v in index.items() if v != ct.SCALES_FILE} == src_index
    assert sum(v == ct.SCALES_FILE for v in index.values()) == 2 * tiny.spec.n_layers
    ct.verify_checkpoint(ckpt, tiny.spec)


def test_export_vllm_command(tmp_path, make_artifact):
    """The tiny artifacts are exported unchecked on purpose (--unchecked): the command's kinds are under test here,
    its refusal of an unchecked artifact below; their random model is asked for by name (model.source=tiny)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    good = subprocess.run([sys.executable, "-m", "pipeline", "export-vllm", str(make_artifact("fp8-e4m3")),
                           str(tmp_path / "out"), "--unchecked", "model.source=tiny"], capture_output=True, text=True,
                          env=env, cwd=ROOT)
    assert good.returncode == 0, good.stderr[-2000:]
    assert "vllm serve" in good.stdout and "--kv-cache-dtype fp8" in good.stdout
    assert good.stdout.startswith("unchecked (--unchecked): manifest field runtime_check: null")
    ct.verify_checkpoint(tmp_path / "out")
    bad = subprocess.run([sys.executable, "-m", "pipeline", "export-vllm", str(make_artifact("kivi-2")),
                          str(tmp_path / "out2")], capture_output=True, text=True, env=env, cwd=ROOT)
    assert bad.returncode == EXIT_USER and "CheckpointError" in bad.stderr and "layers/0/key/format" in bad.stderr
    assert not (tmp_path / "out2").exists()
    packed = subprocess.run([sys.executable, "-m", "pipeline", "export-vllm", str(make_artifact("kvquant-4b-1pct")),
                             str(tmp_path / "out3"), "--unchecked", "model.source=tiny"], capture_output=True,
                            text=True, env=env, cwd=ROOT)
    assert packed.returncode == 0, packed.stderr[-2000:]
    assert f"vllm serve {(tmp_path / 'out3').resolve()} --kv-cache-dtype auto\n" in packed.stdout
    assert "kvcalib vLLM plugin installed in vLLM's environment" in packed.stdout and "fp8" not in packed.stdout
    assert not (tmp_path / "out3" / ct.SCALES_FILE).exists()
    ct.verify_checkpoint(tmp_path / "out3")
    usage = subprocess.run([sys.executable, "-m", "pipeline", "export-vllm", str(tmp_path / "out")],
                           capture_output=True, text=True, env=env, cwd=ROOT)
    assert usage.returncode == EXIT_USER and "usage: python -m pipeline export-vllm" in usage.stderr


# ---- the runtime check: an unchecked or failed artifact is not exported as if it had passed (issue 68, item 7) ----

TOLERANCE = {"atol": 1e-5, "rtol": 2e-4, "criterion": "max|kernel - oracle| <= atol + rtol * max|oracle|"}
PASSED = {"status": "passed", "max_abs_err": 1e-6, "max_rel_err": 2e-6, "tolerance": TOLERANCE,
          "reason": "float32 rounding", "device": "cpu", "triton": "3.4.0", "interpreter": True, "contexts": [16],
          "batches": [1], "cases": [{"context": 16, "batch": 1, "max_abs_err": 1e-6, "max_rel_err": 2e-6,
                                     "worst_layer": 0, "ok": True}]}
FAILED = {**PASSED, "status": "failed", "max_abs_err": None, "max_rel_err": None, "cases": [],
          "error": "context 16, batch 1, triton kernel: it failed\x1b[2J"}


def _export(args, capsys):
    """`export-vllm ARGS` in this process (the tiny model asked for on the command line) -> (code, out, err)."""
    from pipeline.export_vllm import main

    code = main([*args, "model.source=tiny"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_an_artifact_never_checked_is_refused_unless_unchecked(tmp_path, make_artifact, capsys):
    """Before: exported with no word (manifest runtime_check null: check.enabled=false, or its run still checking)."""
    art = make_artifact("fp8-e4m3")
    code, _, err = _export([str(art), str(tmp_path / "out")], capsys)
    assert code == EXIT_USER and err.count("\n") == 1 and not (tmp_path / "out").exists()
    assert ("manifest field runtime_check: null, its decode kernels were never checked against the oracle (its run "
            "had check.enabled=false, or is still checking it); export-vllm exports a checked artifact "
            "(runtime_check status 'passed'). Check it first: `kvcalib check ") in err
    assert "--unchecked to export it as it is" in err
    code, out, _ = _export([str(art), str(tmp_path / "out"), "--unchecked"], capsys)
    assert code == 0 and out.startswith("unchecked (--unchecked): manifest field runtime_check: null")
    assert "kvcalib/manifest.json carries it" in out and "vllm serve" in out
    ct.verify_checkpoint(tmp_path / "out")


def test_a_failed_check_is_refused_and_a_passed_one_exported(tmp_path, make_artifact, capsys):
    from exporters.native import update_manifest

    art = make_artifact("fp8-e4m3")
    update_manifest(art, runtime_check=FAILED)
    code, _, err = _export([str(art), str(tmp_path / "out")], capsys)
    assert code == EXIT_USER and ("manifest field runtime_check: status 'failed' (context 16, batch 1, triton kernel: "
                                  "it failed\\x1b[2J); export-vllm exports a checked artifact") in err
    assert "\x1b" not in err and not (tmp_path / "out").exists()
    update_manifest(art, runtime_check=PASSED)
    code, out, err = _export([str(art), str(tmp_path / "out")], capsys)
    assert code == 0 and out.startswith("vllm checkpoint: ") and "unchecked" not in out, err


def test_the_record_check_writes_beside_the_artifact_counts_when_it_is_its(tmp_path, make_artifact, capsys):
    """`kvcalib check ARTIFACT` never modifies the artifact: its record, ARTIFACT.check.json, is the verdict
    export-vllm takes -- bound to the manifest by manifest_digest, so a record of an earlier artifact at the same
    path says nothing."""
    from pipeline.check import result_path

    art = make_artifact("fp8-e4m3")
    digest = json.loads((art / "manifest.json").read_text())["manifest_digest"]
    result_path(art).write_text(json.dumps({**PASSED, "manifest_digest": "0" * 64}))
    code, _, err = _export([str(art), str(tmp_path / "out")], capsys)
    assert code == EXIT_USER and "is the record of another manifest: its manifest_digest '000000" in err
    result_path(art).write_text(json.dumps({**FAILED, "manifest_digest": digest}))
    code, _, err = _export([str(art), str(tmp_path / "out")], capsys)
    assert code == EXIT_USER and f"runtime_check: status 'failed' in {result_path(art)} (the record" in err
    result_path(art).write_text(json.dumps({**PASSED, "manifest_digest": digest}))
    code, out, err = _export([str(art), str(tmp_path / "out")], capsys)
    assert code == 0 and "unchecked" not in out, err
    result_path(art).write_text("[" * 100_000)
    code, _, err = _export([str(art), str(tmp_path / "out2")], capsys)
    assert code == EXIT_USER and "artifact.check.json: nests objects and arrays deeper" in err.replace(
        f"{art.name}.check.json", "artifact.check.json")


def test_a_refused_recipe_is_answered_with_a_run_of_the_artifacts_own_model(tmp_path, make_artifact, forge, capsys):
    """A recipe vLLM cannot serve (smoothing), from a run of the user's own folder: the re-run hint carries the
    model arguments that run had (manifest model.source, as the run's next steps print them), quoted for a shell
    (before: `kvcalib run quant=... ...`, which runs the embedded model)."""
    folder = tmp_path / "my llama"
    source = {"kind": "local", "path": str(folder), "revision": None, "config": "llama3", "settings": {}}
    art = forge(make_artifact("kvquant-3b-1pct+smooth"), lambda m: m["model"].update(source=source), rebind=True)
    code, _, err = _export([str(art), str(tmp_path / "out")], capsys)
    assert code == EXIT_USER and err.count("\n") == 1 and not (tmp_path / "out").exists(), err
    assert f"(kvcalib run model=llama3 'model.path={folder}' quant=kvquant-3b-1pct" in err, err


# ---- the packed kind: a kvquant recipe the kvcalib vLLM plugin serves -----------------------------------------

PACKED = "kvquant-4b-1pct"


@pytest.fixture
def packed(tmp_path, make_artifact, tiny):
    art = make_artifact(PACKED)
    return write_vllm_checkpoint(tmp_path / "packed", art, tiny), art


def test_a_kvquant_recipe_is_a_packed_checkpoint(packed, tiny):
    from exporters import vllm_slots

    ckpt, art = packed
    policy = load_artifact(art).policy
    assert ct.checkpoint_kind(policy) == "packed" and vllm_slots.refusals(policy) == []
    with pytest.raises(ct.CheckpointError, match="not servable as a vLLM fp8 checkpoint"):
        ct.scales_of(policy)
    names = {p.name for p in ckpt.iterdir()}
    assert {"config.json", "model.safetensors", ct.INDEX_FILE, "tokenizer.json", "tokenizer_config.json",
            ct.ARTIFACT_DIR} <= names
    assert ct.SCALES_FILE not in names
    assert {p.name for p in (ckpt / ct.ARTIFACT_DIR).iterdir()} == {"manifest.json", "tensors.safetensors",
                                                                   ct.RECORD_FILE}
    assert sha256_file(ckpt / ct.ARTIFACT_DIR / "tensors.safetensors") == sha256_file(art / "tensors.safetensors")
    config = json.loads((ckpt / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    index = json.loads((ckpt / ct.INDEX_FILE).read_text())["weight_map"]
    weights = load_file(str(ckpt / "model.safetensors"))
    assert index == {n: "model.safetensors" for n in weights}  # the weights' weight_map as is: no scale entry
    assert set(weights) == set(tiny.model.state_dict()) - {"lm_head.weight"}
    record = json.loads((ckpt / ct.ARTIFACT_DIR / ct.RECORD_FILE).read_text())["files"]
    assert ct.SCALES_FILE not in record and "config.json" in record
    assert ct.verify_checkpoint(ckpt, tiny.spec).manifest["recipe"] == PACKED
    assert load_artifact(ckpt, tiny.spec).manifest["recipe"] == PACKED  # the strict loader takes the folder too


def test_transformers_loads_the_packed_folder_as_is(packed, tiny):
    from transformers import AutoModelForCausalLM

    ckpt, _ = packed
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()  # no config edit needed
    ids = torch.tensor([[1, 50, 700, 3000, 12]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, tiny.model(ids).logits)


def test_a_packed_folder_with_a_quantization_config_is_refused(packed):
    ckpt, _ = packed
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = ct.quantization_config("tensor")
    path.write_text(json.dumps(config))
    with pytest.raises(ChecksumError, match="config.json: sha256 differs"):
        ct.verify_checkpoint(ckpt)
    resign(ckpt)
    with pytest.raises(ct.CheckpointError, match=r"config.json quantization_config: a packed checkpoint \(recipe "
                                                  r"'kvquant-4b-1pct'.*has none.*vLLM would apply it"):
        ct.verify_checkpoint(ckpt)


def test_a_packed_folder_with_fp8_scales_is_refused(packed):
    from safetensors.torch import save_file

    ckpt, _ = packed
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5)}, str(ckpt / ct.SCALES_FILE))
    resign(ckpt)
    with pytest.raises(ct.CheckpointError, match=r"kv_cache_scales.safetensors: a packed checkpoint holds no fp8 "
                                                  r"scales, got the file present"):
        ct.verify_checkpoint(ckpt)
    (ckpt / ct.SCALES_FILE).unlink()
    path = ckpt / ct.INDEX_FILE
    index = json.loads(path.read_text())
    index["weight_map"]["model.layers.0.self_attn.k_scale"] = ct.SCALES_FILE
    path.write_text(json.dumps(index))
    resign(ckpt)
    with pytest.raises(ct.CheckpointError, match=r"got the file absent and model.safetensors.index.json entries "
                                                  r"\['model.layers.0.self_attn.k_scale'\]"):
        ct.verify_checkpoint(ckpt)


def test_the_run_still_writes_fp8_checkpoints_only(make_artifact):
    from pipeline.export import servable

    assert servable(load_artifact(make_artifact("fp8-e4m3")).policy)
    assert not servable(load_artifact(make_artifact(PACKED)).policy)  # export-vllm writes it, a run does not


def test_the_packed_config_and_index_carry_no_scheme_and_refuse_a_quantized_source():
    out = ct.packed_config({"model_type": "llama", "_name_or_path": "/x", "quantization_config": None},
                           "LlamaForCausalLM")
    assert out == {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    with pytest.raises(ct.CheckpointError, match=r"config.json quantization_config: the source model is already "
                                                  r"quantized \(quant_method 'gptq'\); the packed vLLM checkpoint"):
        ct.packed_config({"quantization_config": {"quant_method": "gptq"}}, "LlamaForCausalLM")
    index = ct.weights_index({"b.weight": "model-2.safetensors", "a.weight": "model-1.safetensors"}, 1000)
    assert index == {"metadata": {"total_size": 1000},
                     "weight_map": {"a.weight": "model-1.safetensors", "b.weight": "model-2.safetensors"}}
    with pytest.raises(ct.CheckpointError, match="a source shard is named kv_cache_scales.safetensors"):
        ct.weights_index({"a.weight": ct.SCALES_FILE}, 4)


def test_the_artifacts_strings_reach_the_terminal_escaped_in_one_line(tmp_path, make_artifact, forge, capsys):
    """A model name holding a terminal escape and a newline, quoted by the refusal of another model (weights seed
    1): one line, escaped (before: the escape reached the terminal, the newline made a line of its own)."""
    art = forge(make_artifact("fp8-e4m3"), lambda m: m["model"].update(name="tiny\x1b[2J\nserve: fake"), rebind=True)
    code, out, err = _export([str(art), str(tmp_path / "out"), "--unchecked", "model.tiny.seed=1"], capsys)
    assert code == EXIT_USER and err.count("\n") == 1 and "\x1b" not in err, err
    assert "ModelMismatchError: artifact was calibrated for model tiny\\x1b[2J\\nserve: fake with" in err
    assert not (tmp_path / "out").exists()
