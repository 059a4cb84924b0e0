import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy, QuantizationType

from exporters import compressed_tensors as ct


@pytest.mark.parametrize("axis,strategy", [("tensor", QuantizationStrategy.TENSOR),
                                           ("head", QuantizationStrategy.ATTN_HEAD)])
def test_the_kv_scheme_parses_as_compressed_tensors_does(axis, strategy):
    qc = QuantizationConfig.model_validate(ct.quantization_config(axis))  # the package's own classes, as vLLM uses
    scheme = qc.kv_cache_scheme
    assert scheme.num_bits == 8 and scheme.type == QuantizationType.FLOAT and scheme.strategy == strategy
    assert scheme.symmetric and not scheme.dynamic and qc.quant_method == "compressed-tensors"


def test_scale_tensors_are_named_as_vllm_maps_them():
    k = [torch.tensor(0.5), torch.tensor(0.25)]
    v = [torch.tensor(0.125), torch.tensor(2.0)]
    out = ct.kv_scale_tensors(k, v)
    assert list(out) == ["model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale",
                         "model.layers.1.self_attn.k_scale", "model.layers.1.self_attn.v_scale"]
    assert all(t.dtype == torch.float32 and t.shape == () for t in out.values())
    assert out["model.layers.1.self_attn.v_scale"].item() == 2.0


def test_uncalibrated_or_bad_scales_are_refused():
    with pytest.raises(ValueError, match="every k_scale / v_scale is 1.0"):
        ct.kv_scale_tensors([torch.tensor(1.0)], [torch.tensor(1.0)])
    with pytest.raises(ValueError, match="layer 0 v_scale: scales must be finite and positive"):
        ct.kv_scale_tensors([torch.tensor(0.5)], [torch.tensor(0.0)])
    with pytest.raises(ValueError, match="fp8 scale axis must be one of"):
        ct.quantization_config("channel")


def test_the_index_lists_the_scales_and_refuses_a_clash():
    scales = ct.kv_scale_tensors([torch.tensor(0.5)], [torch.tensor(0.25)])
    index = ct.merged_index({"model.embed_tokens.weight": "model.safetensors"}, 1000, scales)
    assert index["weight_map"] == {"model.embed_tokens.weight": "model.safetensors",
                                   "model.layers.0.self_attn.k_scale": ct.SCALES_FILE,
                                   "model.layers.0.self_attn.v_scale": ct.SCALES_FILE}
    assert index["metadata"]["total_size"] == 1008
    with pytest.raises(ct.CheckpointError, match="already hold KV-cache scales"):
        ct.merged_index({"model.layers.0.self_attn.k_scale": "model.safetensors"}, 4, scales)


def test_the_config_gets_the_scheme_and_architectures_and_refuses_a_quantized_source():
    out = ct.checkpoint_config({"model_type": "llama", "_name_or_path": "/x"}, "LlamaForCausalLM")
    assert out["architectures"] == ["LlamaForCausalLM"] and "_name_or_path" not in out
    assert out["quantization_config"] == ct.quantization_config("tensor")
    with pytest.raises(ct.CheckpointError, match="config.json quantization_config: the source model is already "
                                                  "quantized \\(quant_method 'gptq'\\)"):
        ct.checkpoint_config({"quantization_config": {"quant_method": "gptq"}}, "LlamaForCausalLM")


# ---- nothing unrecorded under a recorded subfolder (issue 68, item 5) --------------------------------------------

@pytest.fixture
def checkpoint(tmp_path, make_artifact, tiny):
    from pipeline.export import write_vllm_checkpoint

    return write_vllm_checkpoint(tmp_path / "ckpt", make_artifact("fp8-e4m3"), tiny)


@pytest.mark.parametrize("make,named", [
    (lambda ckpt: (ckpt / ct.ARTIFACT_DIR / "extra.safetensors").write_bytes(b"x"), "'kvcalib/extra.safetensors'"),
    (lambda ckpt: (ckpt / ct.ARTIFACT_DIR / "old").mkdir(), "'kvcalib/old/'"),
    (lambda ckpt: ((ckpt / ct.ARTIFACT_DIR / "old").mkdir(), (ckpt / ct.ARTIFACT_DIR / "old" / "manifest.json")
                   .write_text("{}")), "'kvcalib/old/'"),
    (lambda ckpt: (ckpt / ct.ARTIFACT_DIR / "link.json").symlink_to("/etc/hostname"), "'kvcalib/link.json'"),
], ids=["file", "empty-folder", "folder-with-a-manifest", "symbolic-link"])
def test_an_unrecorded_entry_in_a_recorded_subfolder_is_refused_naming_it(checkpoint, make, named):
    """Before: anything beside the artifact under kvcalib/ was accepted (only the top level was compared with the
    record), so a second manifest or a stray file there went unverified into the served folder."""
    ct.verify_checkpoint(checkpoint)
    make(checkpoint)
    with pytest.raises(ct.CheckpointError, match=rf"kvcalib/checkpoint.json does not list \[{named}\] under its "
                                                  rf"recorded folder\(s\) \['kvcalib'\]"):
        ct.verify_checkpoint(checkpoint)


def test_a_recorded_file_in_a_deeper_folder_and_its_folders_are_allowed(checkpoint):
    """A folder the record's paths run through (a shard in a subfolder) is allowed; a file beside it there is not."""
    import json

    deeper = checkpoint / "extra" / "deeper"
    deeper.mkdir(parents=True)
    (deeper / "notes.txt").write_text("recorded")
    (checkpoint / ct.ARTIFACT_DIR / ct.RECORD_FILE).write_text(json.dumps(ct.file_record(checkpoint)))
    ct.verify_checkpoint(checkpoint)
    (checkpoint / "extra" / "stray.bin").write_bytes(b"x")
    with pytest.raises(ct.CheckpointError, match=r"does not list \['extra/stray.bin'\] under its recorded "
                                                  r"folder\(s\) \['extra', 'extra/deeper', 'kvcalib'\]"):
        ct.verify_checkpoint(checkpoint)
