"""The kvcalib vLLM plugin's entry point (pyproject.toml: `vllm.general_plugins` kvcalib = this module's register).

vLLM calls register() in every process it starts (vllm/plugins/__init__.py load_general_plugins) once our package
is installed in its environment (scripts/install-vllm.sh). It points vLLM's CPU_ATTN backend at
serving.vllm_backend.KvcalibCPUBackend, which serves a packed kvcalib checkpoint folder from its slots and
every other model exactly as vLLM's own CPU attention. Nothing is imported here until vLLM asks for the backend;
`VLLM_PLUGINS` (vLLM's allow-list) or KVCALIB_VLLM_PLUGIN=0 leaves vLLM untouched.
"""
from __future__ import annotations

import os

BACKEND = "serving.vllm_backend.KvcalibCPUBackend"


def register() -> None:
    if os.environ.get("KVCALIB_VLLM_PLUGIN", "1") == "0":
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if not current_platform.is_cpu():   # on CUDA vLLM picks its own backends; the plugin serves the CPU engine
        return
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
