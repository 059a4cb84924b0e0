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
    with pytest.raises(UserError, match=r"GPT2LMHeadModel.*model_type='gpt2'.*not handled"):
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
