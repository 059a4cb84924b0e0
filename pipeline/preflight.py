"""What a `run` command line gets wrong that its text alone shows, refused before Hydra starts: before a run folder
(outputs/) or an MLflow run exists, and fast -- this module imports the standard library, OmegaConf and Hydra's
override parser, never torch, transformers or MLflow (pipeline/cli.py calls it first; `run --help` reads it too).

- schema(): the run's config keys, read from the dataclasses' source (RunConfig in pipeline/config.py and the stage
  configs it composes) without importing their modules, which import torch; tests/pipeline/test_preflight.py
  holds it equal to the dataclasses themselves.
- group_options(): the options of a config group, conf/<group>/*.yaml (what Hydra composes `model=NAME` from).
- check_run_overrides(): each override's key against the schema and each group option against conf/, a
  misspelling answered with the nearest names (difflib) and the valid ones -- for quant=, the nearest recipes a
  run can export first; and the model folder (and data file) a run would read, a missing one called missing.
- job_overrides(): one override list per job (the sweep's product under -m), for pipeline/cli.py to compose and
  validate (pipeline.config.validate_run) before Hydra runs anything.
"""
from __future__ import annotations

import ast
import difflib
import functools
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from pipeline.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "conf"
SCHEMA_ROOT = (ROOT / "pipeline" / "config.py", "RunConfig")
NO_DEFAULT = object()   # a field without a literal default (MISSING, or a factory that is not a literal)


# ------------------------------------------------------------------------------------------------ the schema

@dataclass(frozen=True)
class Key:
    """One key of the schema: its annotation as written, its default when a literal, and the keys under it when
    its type is a dataclass (None for a value)."""
    annotation: str
    default: object = NO_DEFAULT
    children: dict[str, "Key"] | None = None


@functools.lru_cache(maxsize=None)
def schema() -> dict[str, Key]:
    """RunConfig's keys, nested as its dataclasses nest (model -> ModelConfig -> tiny -> TinyModelConfig ...)."""
    path, name = SCHEMA_ROOT
    found = _find_class(path, name)
    assert found is not None, f"no class {name} in {path}"
    return _fields(*found)


@functools.lru_cache(maxsize=None)
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _module_file(dotted: str) -> Path | None:
    """Our own module's file (third-party classes are never config nodes)."""
    path = ROOT.joinpath(*dotted.split(".")).with_suffix(".py")
    return path if path.is_file() else None


def _find_class(path: Path, name: str) -> tuple[Path, ast.ClassDef] | None:
    """Class `name` as module `path` sees it: defined there, or imported by `from MODULE import name`."""
    tree = _parsed(path)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return path, node
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                target = _module_file(node.module)
                if (alias.asname or alias.name) == name and target is not None:
                    return _find_class(target, alias.name)
    return None


def _imported_module(path: Path, name: str) -> Path | None:
    """The file of a module that `path` binds to `name` (`from stages import fisher`, `import stages.fisher as f`)."""
    for node in _parsed(path).body:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return _module_file(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname == name:
                    return _module_file(alias.name)
    return None


def _annotated_class(path: Path, expr: ast.expr) -> tuple[Path, ast.ClassDef] | None:
    """The dataclass an annotation names (X, module.X, "X", X | None, Optional[X]), or None for a value type."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return _annotated_class(path, ast.parse(expr.value, mode="eval").body)
    if isinstance(expr, ast.Name):
        found = _find_class(path, expr.id)
    elif isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
        module = _imported_module(path, expr.value.id)
        found = _find_class(module, expr.attr) if module else None
    elif isinstance(expr, ast.BinOp):
        found = _annotated_class(path, expr.left) or _annotated_class(path, expr.right)
    elif isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Name) and expr.value.id == "Optional":
        found = _annotated_class(path, expr.slice)
    else:
        found = None
    return found if found is not None and _is_dataclass(found[1]) else None


def _is_dataclass(node: ast.ClassDef) -> bool:
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if (isinstance(target, ast.Name) and target.id == "dataclass") or \
                (isinstance(target, ast.Attribute) and target.attr == "dataclass"):
            return True
    return False


def _literal_default(value: ast.expr | None) -> object:
    """`= LITERAL`, `field(default=LITERAL)`, `field(default_factory=lambda: LITERAL)` or `list`/`dict`."""
    if value is None:
        return NO_DEFAULT
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "field":
        for kw in value.keywords:
            if kw.arg == "default":
                return _literal_default(kw.value)
            if kw.arg == "default_factory":
                if isinstance(kw.value, ast.Lambda):
                    return _literal_default(kw.value.body)
                if isinstance(kw.value, ast.Name) and kw.value.id in ("list", "dict"):
                    return [] if kw.value.id == "list" else {}
        return NO_DEFAULT
    try:
        return ast.literal_eval(value)
    except ValueError:
        return NO_DEFAULT


def _fields(path: Path, node: ast.ClassDef) -> dict[str, Key]:
    """A dataclass's fields in declaration order, its dataclass bases' first (as dataclasses.fields orders them);
    ClassVar annotations are not fields."""
    out: dict[str, Key] = {}
    for base in node.bases:
        found = _annotated_class(path, base)
        if found is not None:
            out.update(_fields(*found))
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        annotation = ast.unparse(stmt.annotation).strip("'\"")
        if annotation.split("[")[0].split(".")[-1] in ("ClassVar", "InitVar"):
            continue
        nested = _annotated_class(path, stmt.annotation)
        out[stmt.target.id] = Key(annotation, _literal_default(stmt.value),
                                  _fields(*nested) if nested is not None else None)
    return out


def schema_key(path: str) -> Key | None:
    """The schema's key at a dotted path, or None when there is none."""
    node: dict[str, Key] | None = schema()
    key = None
    for part in path.split("."):
        if node is None or part not in node:
            return None
        key = node[part]
        node = key.children
    return key


# ------------------------------------------------------------------------------------------------ groups

def group_options(group: str) -> list[str]:
    """The options of config group `group`: conf/<group>/<option>.yaml."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def groups() -> list[str]:
    """The config groups: the folders of conf/ that hold options."""
    return sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and group_options(p.name))


@functools.lru_cache(maxsize=None)
def default_options() -> dict[str, str]:
    """The option each group takes when the command line names none: conf/config.yaml's defaults list."""
    from omegaconf import OmegaConf

    out = {}
    for entry in OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml")).get("defaults", []):
        if isinstance(entry, dict):
            out.update({str(k): str(v) for k, v in entry.items()})
    return out


def option_values(group: str, option: str) -> dict:
    """conf/<group>/<option>.yaml as a plain dict (its keys, not the schema's defaults)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{option}.yaml"))


@functools.lru_cache(maxsize=None)
def exportable_recipes() -> tuple[str, ...]:
    """The recipes a run can export as its own quant=: stages.recipe.is_exportable_recipe, the one rule, on every
    conf/quant recipe. Read only when a recipe is misspelled (it imports torch: about a second; the stages import
    transformers only when they register their attention, so not here)."""
    from omegaconf import OmegaConf

    from stages.recipe import QuantConfig, is_exportable_recipe

    def recipe(name: str) -> QuantConfig:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(QuantConfig), option_values("quant", name)))

    return tuple(name for name in group_options("quant") if is_exportable_recipe(recipe(name)))


# ------------------------------------------------------------------------------------------------ messages

def nearest(word: str, options: Iterable[str], n: int = 3) -> list[str]:
    """The options closest to a misspelled word, best first (difflib's ratio, at least 0.6)."""
    return difflib.get_close_matches(word, list(options), n=n, cutoff=0.6)


def unknown_key_message(path: str, valid: Iterable[str]) -> str:
    """`unknown key data.n_sample; did you mean data.n_samples? valid keys of data: name, source, ...`."""
    valid = list(valid)
    parent, _, last = path.rpartition(".")
    prefix = f"{parent}." if parent else ""
    near = nearest(last, valid)
    mean = f"; did you mean {' or '.join(prefix + n for n in near)}?" if near else ";"
    return f"unknown key {path}{mean} valid keys of {parent or 'the config'}: {', '.join(valid)}"


LISTED_AT_MOST = 10             # a refusal lists a group's options up to this many; beyond, it says where they are
RUN_HELP = "kvcalib run --help"  # where every group's options are listed (pipeline/cli.py run_help)


def listing(names: list[str], listed: str) -> str:
    """A group's valid options as a refusal ends: `{listed}: a, b, c` while they are few (LISTED_AT_MOST); a long
    list (the recipes: dozens on one line) is not printed after the suggestion it would bury, but where to read it:
    `kvcalib run --help` lists the {listed}."""
    if len(names) <= LISTED_AT_MOST:
        return f"{listed}: {', '.join(names)}"
    return f"`{RUN_HELP}` lists the {listed}"


def unknown_option_message(group: str, option: str, where: str | None = None) -> str:
    """A group option that is not in conf/<group>/: the nearest names, then the valid ones (listing: a long list
    is pointed to, not printed). For quant= (the recipe the run exports) the nearest exportable recipes come
    first; the evaluation-only ones near the word are named apart (they go in eval.recipes). `where`: the key that
    named it when not `group=` (eval.recipes[0] ...), where every recipe is allowed."""
    options = group_options(group)
    given = where or group
    if group == "quant" and where is None:
        exportable = exportable_recipes()
        near = nearest(option, options, n=len(options))
        first = [n for n in near if n in exportable][:3]
        others = [n for n in near if n not in exportable][:2]
        mean = f"; did you mean {' or '.join(first)}?" if first else ";"
        aside = (f" (near but evaluation-only, for eval.recipes=[...]: {', '.join(others)})" if others else "")
        return (f"unknown recipe {given}={option} (no conf/quant/{option}.yaml){mean}{aside} "
                f"{listing(list(exportable), 'recipes a run exports')}")
    near = nearest(option, options)
    mean = f"; did you mean {' or '.join(near)}?" if near else ";"
    what, listed = ("recipe", "recipes") if group == "quant" else (group, f"{group} options")
    return f"unknown {what} {given}={option} (no conf/{group}/{option}.yaml){mean} {listing(options, listed)}"


# ------------------------------------------------------------------------------------------------ paths

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")   # `org/name` or `name`; a path starts with / . ~
FOLDER_SOURCES = {
    "local": "a Hugging Face model folder: config.json and the weights, as save_pretrained writes them",
    "gguf": "the folder holding model.gguf_file",
    "hub": "a hub id such as meta-llama/Meta-Llama-3-8B, or a downloaded model folder",
}


def check_model_path(source: str, path: str) -> None:
    """The model folder a run would load, refused when missing -- model.source=local or gguf, or hub with a
    model.path that is a path and no hub id -- before anything loads, rather than reported by the loader (a hub
    lookup of a folder says the hub was not reachable)."""
    if source not in FOLDER_SOURCES or (source == "hub" and (not path or HUB_ID.fullmatch(path))):
        return
    if not path:
        raise UserError(f"model.path: empty; model.source={source} needs model.path=DIR ({FOLDER_SOURCES[source]})")
    folder = Path(path).expanduser()
    if not folder.exists():
        raise UserError(f"model.path: no such folder {folder.resolve()} (model.source={source}: "
                        f"{FOLDER_SOURCES[source]})")
    if not folder.is_dir():
        raise UserError(f"model.path: {folder.resolve()} is a file, not a folder (model.source={source}: "
                        f"{FOLDER_SOURCES[source]})")


def check_data_path(source: str, path: str) -> None:
    """The text a run would read (data.source=local), refused when missing, before anything loads."""
    if source != "local":
        return
    what = "a .txt/.jsonl file, or a folder holding data.calib_file and data.eval_file"
    if not path:
        raise UserError(f"data.path: empty; data.source=local reads data.path=FILE_OR_FOLDER ({what})")
    if not Path(path).expanduser().exists():
        raise UserError(f"data.path: no such file or folder {Path(path).expanduser().resolve()} (data.source=local: "
                        f"{what})")


# ------------------------------------------------------------------------------------------------ overrides

def parse_overrides(lines: list[str]) -> list:
    """Hydra's own parse of `key=value` overrides (hydra.core.override_parser); a malformed one -> UserError."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        return OverridesParser.create().parse_overrides(lines)
    except OverrideParseException as exc:
        raise UserError(f"malformed override: {exc}") from None


def _values(override) -> list | None:
    """The values an override gives (each of a discrete sweep's), as Hydra passes them; None for a glob or
    interval sweep (which Hydra expands against what exists)."""
    from hydra.core.override_parser.types import ValueType

    if not override.is_sweep_override():
        return [override.value()]
    if not override.is_discrete_sweep() or override.value_type == ValueType.GLOB_CHOICE_SWEEP:
        return None
    return list(override.sweep_string_iterator())


def _is_hydra_own(override) -> bool:
    key = override.key_or_group
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def check_run_overrides(lines: list[str]) -> None:
    """Refuse (UserError) an override whose key the schema lacks, a group option conf/ lacks (also a recipe named
    in eval.recipes or layer_policy.options), and a model folder or data file the run would read that does not
    exist. Hydra's own keys (hydra.*, hydra/...) and options under a package (@) are Hydra's to judge."""
    overrides = [o for o in parse_overrides(lines) if not _is_hydra_own(o) and o.package is None]
    group_names = groups()
    for o in overrides:
        key = o.key_or_group
        if key in group_names and not o.is_delete():
            for value in _values(o) or []:
                for option in value if isinstance(value, list) else [value]:
                    if str(option) not in group_options(key):
                        raise UserError(unknown_option_message(key, str(option)))
            continue
        if key.split("/")[0] in group_names:
            continue   # a nested group path: Hydra's message names it
        _check_key(key, adding=o.is_add() or o.is_force_add())
        if key in ("eval.recipes", "layer_policy.options"):
            for value in _values(o) or []:
                for i, name in enumerate(value if isinstance(value, list) else []):
                    if str(name) not in group_options("quant"):
                        raise UserError(unknown_option_message("quant", str(name), where=f"{key}[{i}]"))
    _check_paths(overrides)


def _check_key(path: str, adding: bool) -> None:
    node: dict[str, Key] | None = schema()
    parts = path.split(".")
    for i, part in enumerate(parts):
        if node is None:
            return   # below a value (a list's index): Hydra's to judge
        if part not in node:
            added = (" (`+key=value` cannot add a key: the schema is pipeline/config.py)" if adding else "")
            raise UserError(unknown_key_message(".".join(parts[: i + 1]), node) + added)
        node = node[part].children


def _given(overrides: list, key: str, otherwise: str) -> list[str] | None:
    """Every value the command line gives `key` (a sweep's each), [otherwise] when it gives none, None when it
    gives a glob or interval sweep (what it selects is Hydra's to expand)."""
    for o in reversed(overrides):
        if o.key_or_group == key and not o.is_delete():
            values = _values(o)
            return None if values is None else [str(v) for v in values]
    return [otherwise]


def _check_paths(overrides: list) -> None:
    """check_model_path / check_data_path for every combination the command line can compose: each selected
    option's own source and path, unless the command line sets them."""
    for group, check in (("model", check_model_path), ("data", check_data_path)):
        for option in _given(overrides, group, default_options().get(group, "")) or []:
            if option not in group_options(group):
                continue
            own, default = option_values(group, option), schema()[group].children
            # the option's own value, or the schema's default where it sets none or `???` (which OmegaConf's merge
            # onto the schema leaves at the default)
            own = {k: default[k].default if own.get(k, "???") == "???" else own[k] for k in ("source", "path")}
            sources = _given(overrides, f"{group}.source", str(own["source"])) or []
            paths = _given(overrides, f"{group}.path", str(own["path"])) or []
            for source, path in itertools.product(sources, paths):
                check(source, path)


def job_overrides(lines: list[str], multirun: bool) -> list[list[str]] | None:
    """The overrides of each job the command line starts, as Hydra's basic sweeper makes them (the product of
    each sweep's values); None when Hydra alone can tell (a glob or interval sweep, or a sweep without -m, which
    Hydra refuses)."""
    lists = []
    for o in parse_overrides(lines):
        if not o.is_sweep_override():
            lists.append([o.input_line])
            continue
        values = _values(o)
        if values is None or not multirun:
            return None
        lists.append([f"{o.get_key_element()}={v}" for v in values])
    return [list(job) for job in itertools.product(*lists)]


__all__ = ["Key", "schema", "schema_key", "group_options", "groups", "default_options", "exportable_recipes",
           "nearest", "LISTED_AT_MOST", "RUN_HELP", "listing", "unknown_key_message", "unknown_option_message",
           "check_model_path", "check_data_path", "parse_overrides", "check_run_overrides", "job_overrides"]
