import json

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy, QuantizationType
from safetensors.torch import load_file

from exporters import compressed_tensors as ct


@pytest.mark.parametrize("axis,shape,strategy", [("tensor", (), QuantizationStrategy.TENSOR),
                                                 ("head", (3,), QuantizationStrategy.ATTN_HEAD)])
def test_layout_vllm_loads(tmp_path, axis, shape, strategy):
    n_layers = 4
    k = [torch.rand(shape) + 0.1 for _ in range(n_layers)]
    v = [torch.rand(shape) + 0.1 for _ in range(n_layers)]
    out = ct.write(tmp_path / "ct", {"model_type": "llama", "num_hidden_layers": n_layers}, k, v, axis)
    config = json.loads((out / "config.json").read_text())
    # parsed by the compressed-tensors package's own classes, as vLLM does
    qc = QuantizationConfig.model_validate(config["quantization_config"])
    scheme = qc.kv_cache_scheme
    assert scheme.num_bits == 8 and scheme.type == QuantizationType.FLOAT and scheme.strategy == strategy
    assert scheme.symmetric and not scheme.dynamic
    assert config["model_type"] == "llama"
    tensors = load_file(str(out / ct.SCALES_FILE))
    assert sorted(tensors) == sorted(f"model.layers.{i}.self_attn.{n}" for i in range(n_layers) for n in ("k_scale", "v_scale"))
    for i in range(n_layers):
        t = tensors[f"model.layers.{i}.self_attn.k_scale"]
        assert t.dtype == torch.float32 and tuple(t.shape) == shape and torch.equal(t, k[i].float())


def test_uncalibrated_or_bad_scales_are_refused(tmp_path):
    with pytest.raises(ValueError, match="every k_scale / v_scale is 1.0"):
        ct.write(tmp_path / "a", {}, [torch.tensor(1.0)], [torch.tensor(1.0)], "tensor")
    with pytest.raises(ValueError, match="layer 0 v_scale: scales must be finite and positive"):
        ct.write(tmp_path / "b", {}, [torch.tensor(0.5)], [torch.tensor(0.0)], "tensor")
    with pytest.raises(ValueError, match="fp8 scale axis must be one of"):
        ct.write(tmp_path / "c", {}, [torch.tensor(0.5)], [torch.tensor(0.5)], "channel")
    assert not any(tmp_path.iterdir())
