#!/usr/bin/env bash
# Creates .venv-llmcompressor: llm-compressor (llmcompressor==0.14.0.1), what a vLLM user runs to calibrate FP8
# KV-cache scales, in its own environment beside .venv, for bench/llmcompressor_worker.py (driven by
# `python -m bench.llmcompressor_peer`). llm-compressor pins its own transformers and compressed-tensors
# (==0.19.0, where .venv-vllm has vLLM's), so it shares neither .venv nor .venv-vllm. Idempotent.
#
# torch first, from the CPU build on this disk (llm-compressor allows torch 2.10-2.14; asking pip for it alone could
# resolve a CUDA build of several GB). The worker imports only llm-compressor, transformers, torch, numpy and the
# standard library, so kvcalib itself is not installed here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVCALIB_LLMCOMPRESSOR_VENV:-.venv-llmcompressor}
LLMCOMPRESSOR_VERSION=0.14.0.1
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
stamp="$VENV/.kvcalib-installed"
want=$(sha256sum scripts/install-llmcompressor.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"$VPY" -m pip install -q "torch==2.13.0"
# the torch just installed stays: a resolver that may replace it would pull the CUDA build
"$VPY" -m pip install -q "llmcompressor==$LLMCOMPRESSOR_VERSION" "torch==2.13.0"
# the proof that the environment calibrates: llm-compressor's oneshot and the compressed-tensors scheme import
"$VPY" -c "import llmcompressor, compressed_tensors, torch, transformers
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
print('llmcompressor', llmcompressor.__version__, 'compressed-tensors', compressed_tensors.__version__,
      'transformers', transformers.__version__, 'torch', torch.__version__)"
echo "$want" > "$stamp"
