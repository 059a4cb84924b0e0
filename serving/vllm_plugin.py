"""The kvcalib vLLM plugin's entry point (pyproject.toml: `vllm.general_plugins` kvcalib = this module's register).

vLLM calls register() in every process it starts (vllm/plugins/__init__.py load_general_plugins) once our package
is installed in its environment (scripts/install-vllm.sh). It points vLLM's CPU_ATTN backend at
serving.vllm_backend.KvcalibCPUBackend, which serves a packed kvcalib checkpoint folder from its slots and
every other model exactly as vLLM's own CPU attention. Nothing is imported here until vLLM asks for the backend;
`VLLM_PLUGINS` (vLLM's allow-list) or KVCALIB_VLLM_PLUGIN=0 leaves vLLM untouched.

It also turns prefix caching off for a packed folder whose recipe keeps a recent window (docs/vllm.md, "The recent
window"): where vLLM makes its config (VllmConfig.__post_init__ calls the platform's check_and_update_config, in
the process that builds the engine's config -- `vllm serve`'s API server, or the one calling LLM(...)), before the
config reaches the engine core, whose scheduler reads it.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

BACKEND = "serving.vllm_backend.KvcalibCPUBackend"


def recent_window(model: str | None) -> int:
    """The recent window (cache.residual) of a packed kvcalib checkpoint folder's recipe, 0 for anything else (the
    manifest read as JSON; the folder is verified whole when the first attention layer is built)."""
    folder = Path(str(model or ""))
    manifest = folder / "kvcalib" / "manifest.json"
    if not folder.is_dir() or (folder / "manifest.json").exists() or not manifest.is_file():
        return 0
    try:
        return int(json.loads(manifest.read_text())["cache"].get("residual") or 0)
    except (ValueError, KeyError, TypeError, AttributeError):
        return 0   # a damaged manifest: refused, naming it, when the layers are built


def _no_prefix_caching_for_a_window(platform_cls) -> None:
    original = platform_cls.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        mc, cache = getattr(vllm_config, "model_config", None), getattr(vllm_config, "cache_config", None)
        window = recent_window(getattr(mc, "model", None))
        if window and cache is not None and cache.enable_prefix_caching:
            cache.enable_prefix_caching = False
            logging.getLogger("vllm").warning(
                "kvcalib vLLM plugin: prefix caching turned off for %s: its recipe keeps a recent window of %d fp16 "
                "rows, which a cached block does not hold (docs/vllm.md, 'The recent window')", mc.model, window)

    platform_cls.check_and_update_config = classmethod(check_and_update_config)


def register() -> None:
    if os.environ.get("KVCALIB_VLLM_PLUGIN", "1") == "0":
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if not current_platform.is_cpu():   # on CUDA vLLM picks its own backends; the plugin serves the CPU engine
        return
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    cls = type(current_platform)
    if not getattr(cls, "_kvcalib_window_check", False):   # once per process (register may run again)
        _no_prefix_caching_for_a_window(cls)
        cls._kvcalib_window_check = True
