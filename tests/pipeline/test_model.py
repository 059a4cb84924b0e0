import pytest

from pipeline.config import ModelConfig
from pipeline.errors import UserError
from pipeline.model import load_model, model_spec


def test_tiny_spec(tiny):
    s = tiny.spec
    assert (s.n_layers, s.n_q_heads, s.n_kv_heads, s.head_dim) == (2, 4, 2, 16)
    assert s.rope_pairing == "rotate_half" and s.rope_theta == 10000.0
    assert len(s.model_sha256) == 64 and len(s.tokenizer_sha256) == 64


def test_tiny_model_is_deterministic(tiny):
    again = load_model(ModelConfig(name="tiny", source="tiny"))
    assert again.spec.model_sha256 == tiny.spec.model_sha256
    from pipeline.config import TinyModelConfig
    other = load_model(ModelConfig(name="tiny", source="tiny", tiny=TinyModelConfig(seed=1)))
    assert other.spec.model_sha256 != tiny.spec.model_sha256


def test_unsupported_architecture_is_refused_by_name(tiny):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(UserError, match=r"GPT2LMHeadModel.*model_type='gpt2'.*not supported.*supported architectures: "
                                        r"LlamaForCausalLM \(model_type llama\), MistralForCausalLM.*Qwen2ForCausalLM.*"
                                        r"Gemma3ForCausalLM \(model_type gemma3_text\)"):
        model_spec("gpt2", gpt2, tiny.tokenizer, "x")


def test_llama3_without_weights_explains_where_it_looked(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(UserError, match=r"no local weights.*model.path="):
        load_model(ModelConfig(name="llama3", source="hub", path="meta-llama/Meta-Llama-3-8B"))


def test_local_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"has no config.json with weight files"):
        load_model(ModelConfig(name="x", source="local", path=str(tmp_path)))


def test_bad_source_and_dtype():
    with pytest.raises(UserError, match=r"model.source must be one of .* got 'ftp'"):
        load_model(ModelConfig(source="ftp"))
    with pytest.raises(UserError, match=r"model.dtype must be one of .* got 'int3'"):
        load_model(ModelConfig(dtype="int3"))


def test_model_device_is_honoured_or_refused_by_name(monkeypatch):
    import torch
    from pipeline.errors import UserError
    from pipeline.model import resolve_device

    assert resolve_device("cpu") == "cpu"
    with pytest.raises(UserError, match=r"model.device must be one of .*'cpu', 'cuda', 'cuda:N', 'auto'.*got 'gpu'"):
        resolve_device("gpu")
    with pytest.raises(UserError, match=r"got 'cuda:x'"):
        resolve_device("cuda:x")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    for name in ("cuda", "cuda:0"):
        with pytest.raises(UserError, match=rf"model.device='{name}': no CUDA GPU is visible"):
            resolve_device(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda") == "cuda:0" and resolve_device("cuda:1") == "cuda:1"
    assert resolve_device("auto") == "auto"
    with pytest.raises(UserError, match=r"GPU index 2 out of range, 2 visible \(allowed cuda:0 .. cuda:1\)"):
        resolve_device("cuda:2")


def test_the_tiny_model_is_loaded_in_the_dtype_asked_for():
    import torch
    from pipeline.config import ModelConfig
    from pipeline.model import load_model

    lm = load_model(ModelConfig(name="tiny", source="tiny", dtype="bfloat16"))
    assert {p.dtype for p in lm.model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in lm.model.parameters()} == {"cpu"}


# llama3-shape: Llama-3's configuration, few layers, random weights (pipeline/shapes.py)

def _llama3_shape_cfg(*overrides: str) -> ModelConfig:
    """conf/model/llama3-shape.yaml through the schema, as Hydra composes model=llama3-shape (with overrides)."""
    from omegaconf import OmegaConf

    from pipeline.config import CONF_DIR
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF_DIR / "model" / "llama3-shape.yaml"),
                             OmegaConf.from_dotlist(list(overrides)))
    return OmegaConf.to_object(merged)


def test_llama3_shape_config_is_llama3_8b_with_few_layers():
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    from pipeline.shapes import shape_config
    cfg = _llama3_shape_cfg("shape.n_layers=1")
    assert (cfg.source, cfg.dtype, cfg.shape.preset, cfg.shape.n_layers) == ("shape", "bfloat16", "llama3-8b", 1)
    c = shape_config(cfg.shape.preset, cfg.shape.n_layers)
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        4096, 14336, 32, 8, 128)
    assert (c.vocab_size, c.max_position_embeddings, c.rms_norm_eps, c.tie_word_embeddings) == (128256, 131072, 1e-5, False)
    assert c.rope_parameters == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    with init_empty_weights():  # the shapes without a byte of weights
        model = LlamaForCausalLM(c)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert len(model.model.layers) == 1
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (128256, 4096)
    attn = "model.layers.0.self_attn."
    assert shapes[attn + "q_proj.weight"] == (4096, 4096) and shapes[attn + "o_proj.weight"] == (4096, 4096)
    assert shapes[attn + "k_proj.weight"] == shapes[attn + "v_proj.weight"] == (1024, 4096)  # 8 KV heads x 128
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (14336, 4096)
    assert sum(p.numel() for p in model.parameters()) == 2 * 128256 * 4096 + 218_112_000 + 4096  # embeddings, lm_head, one layer, final norm


def test_llama3_shape_presets_and_depth_are_refused_by_name():
    from pipeline.shapes import shape_config
    with pytest.raises(UserError, match=r"model.shape.preset must be one of \('llama3-8b', 'llama3-70b'\), got 'gpt5'"):
        shape_config("gpt5", 1)
    with pytest.raises(UserError, match=r"model.shape.n_layers must be an integer in 1..32 .*llama3-8b.*got 0"):
        shape_config("llama3-8b", 0)
    with pytest.raises(UserError, match=r"model.shape.tokenizer must be 'embedded', got 'llama3'"):
        load_model(_llama3_shape_cfg("shape.tokenizer=llama3"))


def test_random_weights_are_seeded_and_keep_the_rotary_tables():
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from pipeline.shapes import random_model, shape_config
    c = shape_config("llama3-8b", 1)
    c.hidden_size, c.intermediate_size, c.vocab_size = 256, 512, 1000  # the preset's heads / RoPE, shrunk to test fast
    c.num_attention_heads, c.num_key_value_heads = 4, 1  # GQA 4:1 and head_dim 128, as the preset
    a, id_a = random_model(c, seed=0, dtype=torch.bfloat16)
    b, id_b = random_model(c, seed=0, dtype=torch.bfloat16)
    other, id_other = random_model(c, seed=1, dtype=torch.bfloat16)
    assert id_a == id_b != id_other and len(id_a) == 64
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.lm_head.weight, other.lm_head.weight)
    assert a.lm_head.weight.dtype == torch.bfloat16
    assert abs(a.model.embed_tokens.weight.float().std().item() - 0.02) < 1e-3
    assert torch.equal(a.model.norm.weight, torch.ones(256, dtype=torch.bfloat16))
    assert torch.equal(a.model.rotary_emb.inv_freq, LlamaRotaryEmbedding(c).inv_freq)  # llama3-scaled, not garbage
    assert torch.isfinite(a(torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.slow
def test_llama3_shape_loads_one_real_layer():
    lm = load_model(_llama3_shape_cfg("shape.n_layers=1"))
    s = lm.spec
    assert (s.n_layers, s.n_q_heads, s.n_kv_heads, s.head_dim, s.vocab_size, s.max_positions) == (1, 32, 8, 128, 128256, 131072)
    assert s.rope_theta == 500000.0 and '"rope_type": "llama3"' in s.rope_scaling
    assert s.weights == "random (seed 0, preset llama3-8b)" and s.architecture == "LlamaForCausalLM"
    assert next(lm.model.parameters()).dtype.is_floating_point and str(next(lm.model.parameters()).dtype) == "torch.bfloat16"


@pytest.mark.parametrize("source,default,args", [
    ({"kind": "local", "path": "/data/my llama", "config": "llama3", "settings": {}}, None,
     ["model=llama3", "model.path=/data/my llama"]),
    ({"kind": "hub", "path": "org/name", "config": "llama3", "settings": {}}, None,
     ["model=llama3", "model.path=org/name"]),
    ({"kind": "gguf", "path": "/m", "config": "smollm2", "settings": {"gguf_file": "m.gguf"}}, None,
     ["model=smollm2", "model.path=/m", "model.gguf_file=m.gguf"]),
    ({"kind": "embedded", "path": "", "config": "smollm2", "settings": {}}, None, ["model=smollm2"]),
    ({"kind": "tiny", "path": "", "config": "tiny", "settings": {}}, "llama3", ["model=tiny"]),
    (None, "llama3", ["model=llama3"]),
    (None, None, []),
], ids=["local", "hub", "gguf", "embedded", "tiny", "no-source", "nothing"])
def test_model_arguments_load_the_recorded_model_again(source, default, args):
    """model_source's record -> the `run` arguments that load that model again (the re-run commands printed by the
    run's next steps, export-vllm and recommend), unquoted."""
    from pipeline.model import model_arguments

    assert model_arguments(source, default) == args
