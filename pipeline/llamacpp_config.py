"""`llamacpp.*`, the run's llama.cpp evaluation settings (pipeline/llamacpp.py runs it), and the checks that need
nothing loaded: kept apart from pipeline/llamacpp.py so that pipeline/config.py can compose and validate it without
importing the model loader (which imports pipeline/config.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "llamacpp_worker.py"
INSTALL_HINT = "bash scripts/install-llamacpp.sh creates .venv-llamacpp"
# bits per element of llama.cpp's cache types (ggml block layouts: 32 elements per block with a 16-bit scale, and a
# 16-bit minimum for the _1 types; iq4_nl: 4-bit indices into a fixed non-uniform table, one 16-bit scale)
LLAMACPP_BITS = {"f16": 16.0, "q8_0": 8.5, "q5_1": 6.0, "q5_0": 5.5, "q4_1": 5.0, "q4_0": 4.5, "iq4_nl": 4.5}


@dataclass
class LlamaCppConfig:
    """`llamacpp.*`: llama.cpp's own KV cache types evaluated on the run's windows (off while `types` is empty)."""
    types: list[str] = field(default_factory=list)  # e.g. [q8_0, q4_0, q8_0/q4_0]; f16 (the reference) is added
    python: str = ""          # the llama.cpp environment's python; "" -> $KVCALIB_LLAMACPP_PYTHON or .venv-llamacpp
    gguf: str = ""            # the model's GGUF file; "" -> the embedded models' own (a GGUF-sourced model's file)
    threads: int = 0          # 0 -> torch's intra-op thread count
    attn_rot: bool = True     # llama.cpp's default: K and V Hadamard-rotated before a quantized cache stores them


def llamacpp_bits(name: str, field_name: str = "llamacpp.types") -> float:
    """A cache type ("q4_0", or "K/V" such as "q8_0/q4_0") -> average bits per element of K and V."""
    parts = name.split("/")
    if len(parts) not in (1, 2) or any(p not in LLAMACPP_BITS for p in parts):
        raise UserError(f"{field_name}: unknown cache type {name!r}; allowed: {', '.join(LLAMACPP_BITS)} or a K/V "
                        f"pair such as q8_0/q4_0")
    k, v = (parts * 2)[:2]
    return (LLAMACPP_BITS[k] + LLAMACPP_BITS[v]) / 2


def with_reference(types: list[str]) -> list[str]:
    """The types as given, checked, with f16 (the reference every ratio is to) first."""
    for t in types:
        llamacpp_bits(t)
    return list(types) if "f16" in types else ["f16", *types]


def default_python() -> str:
    return os.environ.get("KVCALIB_LLAMACPP_PYTHON", str(ROOT / ".venv-llamacpp" / "bin" / "python"))


def resolve_python(python: str) -> str:
    python = python or default_python()
    if not Path(python).exists():
        raise UserError(f"llamacpp.python: no llama.cpp environment at {python} ({INSTALL_HINT}, or set "
                        f"llamacpp.python / KVCALIB_LLAMACPP_PYTHON); or llamacpp.types=[] for none")
    return python


def validate(cfg: LlamaCppConfig, model_cfg) -> None:
    """Before anything loads: the types, the environment, the threads and where the GGUF comes from."""
    with_reference(list(cfg.types))
    resolve_python(cfg.python)
    if cfg.threads < 0:
        raise UserError(f"llamacpp.threads must be >= 0 (0: torch's thread count), got {cfg.threads}")
    if cfg.gguf:
        if not Path(cfg.gguf).expanduser().is_file():
            raise UserError(f"llamacpp.gguf: no file at {cfg.gguf}")
    elif model_cfg.source not in ("embedded", "gguf"):
        raise no_gguf(model_cfg)


def no_gguf(model_cfg) -> UserError:
    return UserError(f"llamacpp.gguf: model.source={model_cfg.source!r} has no GGUF file of its own; give "
                     f"llamacpp.gguf=/path/to/MODEL.gguf (the same weights, e.g. converted by llama.cpp's "
                     f"convert_hf_to_gguf.py), or llamacpp.types=[] for none")
