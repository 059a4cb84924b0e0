#!/usr/bin/env bash
# Fetch, here, what the GPU machine lacks for `python -m bench.gpu_smoke` into .gpu-wheels/ (git-ignored), which the
# device tool's `run` carries (carry [".gpu-wheels"]); scripts/gpu-run.sh installs it there. docs/gpu.md.
#
# The GPU machine (Python 3.12, no package registry) has torch, triton, transformers, accelerate, numpy, scikit-learn,
# pyyaml, attrs, typing-extensions, ... but not hydra-core / omegaconf / antlr4 (pipeline/config.py imports them),
# jsonschema (exporters/manifest.py validates every manifest with it), mlflow (not imported: tracking is off),
# gguf or the embedded GGUF (98 MB; too big to send): the embedded tokenizer travels as a saved folder instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEST=.gpu-wheels

# The carried distributions, pinned to the versions this venv tests. tests/bench/test_gpu_smoke.py reads these two
# lists and checks that the pins are the venv's and that every requirement of each is carried or on the GPU machine.
WHEELS=(
  hydra-core==1.3.8
  omegaconf==2.3.1
  jsonschema==4.26.0
  jsonschema-specifications==2025.9.1
  referencing==0.37.0
  rpds-py==2026.9.1
)
# omegaconf 2.3 and hydra-core 1.3 pin antlr4-python3-runtime==4.9.*, of which no version has a wheel: its sdist is
# downloaded and built here (pure Python: the wheel is py3-none-any).
SDISTS=(
  antlr4-python3-runtime==4.9.3
)

rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --dest "$DEST" "${WHEELS[@]}"
SRC=$(mktemp -d)
trap 'rm -rf "$SRC"' EXIT
"$PY" -m pip download -q --no-deps --no-binary=:all: --dest "$SRC" "${SDISTS[@]}"
"$PY" -m pip wheel -q --no-deps --wheel-dir "$DEST" "$SRC"/*
for whl in "$DEST"/*.whl; do  # only what installs on CPython 3.12 x86-64
  case "$(basename "$whl")" in
    *-py3-none-any.whl | *-py2.py3-none-any.whl | *-cp312-cp312-*manylinux*x86_64*.whl) ;;
    *) echo "gpu-wheels: $whl does not install on CPython 3.12 / x86-64" >&2; exit 1 ;;
  esac
done
n=$(ls "$DEST"/*.whl | wc -l)
if [ "$n" -ne $(( ${#WHEELS[@]} + ${#SDISTS[@]} )) ]; then
  echo "gpu-wheels: $n wheels in $DEST, expected $(( ${#WHEELS[@]} + ${#SDISTS[@]} ))" >&2
  exit 1
fi
"$PY" -m bench.gpu_smoke --save-tokenizer "$DEST/tokenizer"
ls -l "$DEST" "$DEST/tokenizer"
echo "gpu-wheels: $(du -sh "$DEST" | cut -f1) in $DEST; the tree that travels beside it:" \
  "$(git ls-files -co --exclude-standard -z | du -ch --files0-from=- 2>/dev/null | tail -1 | cut -f1) (limit 64 MiB in all)"
