"""Artifact export at the end of a run: the native artifact (always) and, for fp8 recipes, the
compressed-tensors layout vLLM / SGLang load."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pipeline
from pipeline import faults
from exporters import compressed_tensors
from exporters.codec import CachePolicy
from exporters.manifest import build_manifest
from exporters.native import write_artifact
from exporters.checksums import sha256_file


def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def creator() -> dict:
    return {"package": "kvcalib", "version": pipeline.__version__, "git_sha": git_sha()}


def remove_interrupted_exports(run_dir: Path) -> list[Path]:
    """The temporary siblings an export killed midway leaves in its run dir (exporters/native.py and
    exporters/compressed_tensors.py write `.<name>.tmp-*` and move the replaced folder to `.<name>.old-*`).
    They are never read; a rerun into the same run dir (a run dir belongs to one run at a time) removes them."""
    leftovers = [p for name in ("artifact", "compressed-tensors") for pattern in (f".{name}.tmp-*", f".{name}.old-*")
                 for p in Path(run_dir).glob(pattern)]
    for p in leftovers:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return leftovers


def export(run_dir: Path, policy: CachePolicy, spec, provenance: dict, evaluation: dict, model_config: dict,
           prefix: dict | None = None, overwrite: bool = False) -> dict:
    manifest, tensors = build_manifest(policy, spec, provenance, evaluation, prefix=prefix, creator=creator())
    remove_interrupted_exports(run_dir)
    faults.point("export.before_write")
    artifact = write_artifact(run_dir / "artifact", manifest, tensors, overwrite=overwrite)
    faults.point("export.after_write")
    out = {"artifact_dir": str(artifact.resolve()),
           "manifest": {"sha256": sha256_file(artifact / "manifest.json"), "format_version": manifest["format_version"]}}
    k0, v0 = policy.layers[0]
    if k0.format == "fp8" and v0.format == "fp8" and k0.axis == v0.axis:
        ct = compressed_tensors.write(run_dir / "compressed-tensors", model_config,
                                      [k.fp8_scale for k, _ in policy.layers], [v.fp8_scale for _, v in policy.layers],
                                      axis=k0.axis, overwrite=overwrite)
        out["compressed_tensors_dir"] = str(ct.resolve())
    return out
