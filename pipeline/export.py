"""Artifact export at the end of a run: the native artifact (always) and, for a recipe vLLM serves by itself (fp8
e4m3 per tensor), a complete vLLM checkpoint folder (exporters/compressed_tensors.py). `pipeline export-vllm`
writes that folder too, and the packed kind for a recipe the kvcalib vLLM plugin serves (exporters/vllm_slots.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import torch

import pipeline
from pipeline import faults
from exporters import compressed_tensors as ct
from exporters import vllm_slots
from exporters.codec import CachePolicy
from exporters.files import write_synced
from exporters.manifest import TENSOR_FILE, build_manifest
from exporters.native import MANIFEST_FILE, install_folder, load_artifact, write_artifact
from exporters.checksums import sha256_file
from pipeline.model import WEIGHT_SUFFIXES

CHECKPOINT_DIR = "vllm-checkpoint"


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
    leftovers = [p for name in ("artifact", CHECKPOINT_DIR) for pattern in (f".{name}.tmp-*", f".{name}.old-*")
                 for p in Path(run_dir).glob(pattern)]
    for p in leftovers:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return leftovers


def export(run_dir: Path, policy: CachePolicy, spec, provenance: dict, evaluation: dict,
           prefix: dict | None = None, overwrite: bool = False) -> dict:
    """The native artifact under run_dir/artifact. The vLLM checkpoint is written after the runtime check and
    the gate have updated the manifest (pipeline/app.py, write_vllm_checkpoint), so its copy carries both."""
    # the KL per span of positions (stages.evaluate kl_buckets) is a diagnostic kept in summary.json; the
    # manifest's evaluation rows keep their schema (docs/manifest.md)
    evaluation = {name: {k: v for k, v in row.items() if k != "kl_buckets"} for name, row in evaluation.items()}
    manifest, tensors = build_manifest(policy, spec, provenance, evaluation, prefix=prefix, creator=creator())
    remove_interrupted_exports(run_dir)
    faults.point("export.before_write")
    artifact = write_artifact(run_dir / "artifact", manifest, tensors, overwrite=overwrite)
    faults.point("export.after_write")
    out = {"artifact_dir": str(artifact.resolve()),
           "manifest": {"sha256": sha256_file(artifact / "manifest.json"), "format_version": manifest["format_version"]}}
    return out


def servable(policy: CachePolicy) -> bool:
    """Whether vLLM serves the policy by itself, as an fp8 checkpoint: what a run writes at its end
    (pipeline/app.py). A packed checkpoint (the kvcalib vLLM plugin's) is written by `pipeline export-vllm` only."""
    try:
        ct.scales_of(policy)
        return True
    except ct.CheckpointError:
        return False


def vllm_kind_of_recipe(q) -> str | None:
    """How vLLM would serve a recipe (a conf/quant QuantConfig), judged from its fields alone: "fp8" (vLLM's own
    fp8 cache), "packed" (the kvcalib vLLM plugin), or None. The policy is built with placeholder calibration
    tensors (one layer, one head): what exporters.compressed_tensors.checkpoint_kind decides never depends on
    calibrated values, only on formats, axes, windows and the recipe's other fields."""
    from stages.recipe import build_policy, is_exportable_recipe

    if not is_exportable_recipe(q):
        return None
    ones = torch.ones(1, 1, 2)
    calib = {"k_absmax": ones, "v_absmax": ones, "zero": 0 * ones, "range": ones, "lower": -ones, "upper": ones,
             "smooth": ones, "prefix_ids": torch.tensor([1])}
    for bits in (2, 3, 4, 8):
        calib[f"k_codebook_{bits}"] = calib[f"v_codebook_{bits}"] = torch.linspace(-1, 1, 2 ** bits)[None]
    try:
        return ct.checkpoint_kind(build_policy(q, 1, calib))
    except ct.CheckpointError:
        return None
    except Exception:  # noqa: BLE001 -- a recipe whose placeholder policy cannot be built is simply not suggested
        return None


def nearest_vllm_recipes(recipe: str, n: int = 3) -> list[tuple[str, str]]:
    """The recipes of conf/quant closest to `recipe` that vLLM serves, as (name, kind): those with the same key and
    value bits first, then the recipe's base (its name before any "+": the same recipe without windows, smoothing
    or rotation), then by name similarity -- what `export-vllm` suggests when it refuses a recipe."""
    import difflib

    from pipeline.config import load_recipe, recipe_names

    def bits(q) -> tuple[int, int]:
        return q.key.bits, q.value.bits

    try:
        wanted = bits(load_recipe(recipe))
    except Exception:  # noqa: BLE001 -- a recipe name not in conf/quant (a mixed policy): by name alone
        wanted = None
    scored = []
    for name in recipe_names():
        q = load_recipe(name)
        kind = vllm_kind_of_recipe(q)
        if kind is None or name == recipe:
            continue
        similarity = difflib.SequenceMatcher(None, recipe, name).ratio()
        same_base = name == recipe.split("+")[0]  # the recipe without its windows / smoothing / rotation
        scored.append(((bits(q) != wanted, not same_base, -similarity), name, kind))
    return [(name, kind) for _, name, kind in sorted(scored)[:n]]


def _link_or_copy(src: Path, dst: Path) -> None:
    """A weight shard into the checkpoint: a hard link where the file system allows (no second copy of a 16 GB
    model), else a copy. Never a symbolic link: the checkpoint must not break when the source folder moves."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _source_weights(source_dir: Path, tmp: Path) -> tuple[dict[str, str], int]:
    """A Hugging Face folder's safetensors shards linked into tmp, its other files (tokenizer, generation config)
    copied; -> (weight_map, total_size) from its index, or from the single shard's header."""
    shards = sorted(source_dir.glob("*.safetensors"))
    index_path = source_dir / ct.INDEX_FILE
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        weight_map = dict(index["weight_map"])
        shards = sorted({source_dir / f for f in weight_map.values()})
        total = int(index.get("metadata", {}).get("total_size", 0)) or sum(p.stat().st_size for p in shards)
    else:
        weight_map = {name: p.name for p in shards for name in ct.tensor_names(p)}
        total = sum(p.stat().st_size for p in shards)
    for p in shards:
        _link_or_copy(p, tmp / p.name)
    for p in sorted(source_dir.iterdir()):
        if (p.is_file() and p.suffix not in WEIGHT_SUFFIXES and not p.name.startswith(".")
                and p.name not in ("config.json", ct.INDEX_FILE) and not p.name.endswith(".index.json")):
            shutil.copy2(p, tmp / p.name)
    return weight_map, total


def _saved_weights(lm, tmp: Path, shard_bytes: int = 4 << 30) -> tuple[dict[str, str], int]:
    """The loaded model's weights (a GGUF model dequantized, a random tiny model) written as safetensors shards of
    at most shard_bytes, with its config and tokenizer; -> (weight_map, total_size). Written from the state dict
    (transformers refuses save_pretrained on a GGUF-loaded model): a tied output head is left out, as
    save_pretrained leaves it, since config.json says tie_word_embeddings."""
    from safetensors.torch import save

    model = lm.model
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
        if out_emb is not None and out_emb.weight.data_ptr() == in_emb.weight.data_ptr():
            tied = out_emb.weight.data_ptr()
            state = {k: v for k, v in state.items() if not (k.startswith("lm_head.") and v.data_ptr() == tied)}
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t.detach().contiguous()
        size += n
    weight_map = {}
    for i, group in enumerate(groups):
        name = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        write_synced(tmp / name, save(group, metadata={"format": "pt"}))
        weight_map |= {k: name for k in group}
    total = sum(t.numel() * t.element_size() for t in state.values())
    config = model.config.to_diff_dict()  # what differs from the class defaults, as save_pretrained writes it
    config.pop("quantization_config", None)  # the GGUF loader's own marker; the weights are saved dequantized
    config["architectures"] = [type(model).__name__]
    config["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    write_synced(tmp / "config.json", json.dumps(config, indent=1, default=str).encode())
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(tmp))
    lm.tokenizer.save_pretrained(str(tmp))
    return weight_map, total


def write_vllm_checkpoint(directory: Path, artifact_dir: Path, lm, source_dir: Path | None = None,
                          overwrite: bool = False) -> Path:
    """A folder vLLM serves as is (exporters/compressed_tensors.py), of the kind the artifact's recipe takes
    (ct.checkpoint_kind): the model's weights (source_dir's safetensors shards linked, or the loaded model saved),
    tokenizer, config.json with `architectures`, model.safetensors.index.json, and the artifact itself under
    kvcalib/ with every file's sha256. fp8 (`LLM(model=DIR, kv_cache_dtype="fp8")`): config.json with the
    compressed-tensors KV scheme and the artifact's scales in kv_cache_scales.safetensors listed in the index.
    packed (the kvcalib vLLM plugin, `kv_cache_dtype="auto"`): config.json without quantization_config, no scales
    file, the index the weights' weight_map as is. Built in a temporary sibling, checked whole by
    verify_checkpoint, then put in place; a refused recipe or model writes nothing."""
    final = Path(directory)
    if final.exists() and not overwrite:
        raise ct.CheckpointError(f"checkpoint folder {str(final)!r} already exists; pass overwrite=True "
                                 f"(export.overwrite=true, or --overwrite) to replace it")
    artifact = load_artifact(artifact_dir, lm.spec)
    kind = ct.checkpoint_kind(artifact.policy)
    if kind == "fp8":
        tensors = ct.kv_scale_tensors(*ct.scales_of(artifact.policy))
    else:
        try:  # the plugin's slot for this model's heads (int16 outlier indices)
            vllm_slots.layout(artifact.policy, lm.spec.n_kv_heads, lm.spec.head_dim)
        except ValueError as exc:
            raise ct.CheckpointError(f"recipe {artifact.policy.name!r} is not servable by the kvcalib vLLM plugin "
                                     f"on this model: {exc}") from exc
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        from_source = source_dir is not None and any(Path(source_dir).glob("*.safetensors"))
        if from_source:
            weight_map, total = _source_weights(Path(source_dir), tmp)
            config = json.loads((Path(source_dir) / "config.json").read_text())
        else:
            weight_map, total = _saved_weights(lm, tmp)
            config = json.loads((tmp / "config.json").read_text())
        faults.point("export.vllm_weights_written")
        if kind == "fp8":
            config = ct.checkpoint_config(config, lm.spec.architecture)
            index = ct.merged_index(weight_map, total, tensors)
            from safetensors.torch import save
            write_synced(tmp / ct.SCALES_FILE, save(tensors, metadata={"format": "pt"}))
        else:
            config = ct.packed_config(config, lm.spec.architecture)
            index = ct.weights_index(weight_map, total)
        write_synced(tmp / ct.INDEX_FILE, json.dumps(index, indent=1).encode())
        write_synced(tmp / "config.json", json.dumps(config, indent=1, default=str).encode())
        (tmp / ct.ARTIFACT_DIR).mkdir()
        for name in (MANIFEST_FILE, TENSOR_FILE):
            shutil.copyfile(Path(artifact_dir) / name, tmp / ct.ARTIFACT_DIR / name)
        record = ct.file_record(tmp)
        write_synced(tmp / ct.ARTIFACT_DIR / ct.RECORD_FILE, json.dumps(record, indent=1).encode())
        ct.verify_checkpoint(tmp, lm.spec, hash_files=False)  # the record was just hashed from these files
        install_folder(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
