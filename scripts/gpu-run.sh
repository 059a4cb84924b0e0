#!/usr/bin/env bash
# Run ON the GPU machine, from the repository root the device tool copied (docs/gpu.md):
#   run(command="bash scripts/gpu-run.sh", carry=[".gpu-wheels"], timeout_s=600)
# Installs the wheels scripts/gpu-wheels.sh fetched (outside the machine's own site-packages, no index, no
# dependencies: the machine has the rest) and runs the smoke script; gpu_smoke.json, gpu_smoke.log and the console
# output land in $OUT, which comes back. Extra arguments go to bench.gpu_smoke (e.g. --budget-s 300).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-smoke}
PY=${PYTHON:-python3}
DEPS=/tmp/kvcalib-deps
mkdir -p "$OUT"
if compgen -G ".gpu-wheels/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$DEPS" .gpu-wheels/*.whl \
    || echo "gpu-run: installing the carried wheels failed; the smoke script's imports part says what is missing"
else
  echo "gpu-run: no .gpu-wheels/*.whl here: run scripts/gpu-wheels.sh before the call and carry .gpu-wheels"
fi
export PYTHONPATH="$DEPS:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader 2>&1 | head -2
"$PY" -m bench.gpu_smoke --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_smoke.console"
