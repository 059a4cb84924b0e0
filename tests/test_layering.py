"""The house's layering, checked on every import statement of the product code (function-local ones and those under
`if TYPE_CHECKING:` too): bench -> pipeline -> runtime_check -> serving -> stages -> exporters. An import may point
down, never up: the check (runtime_check/: the oracle, the check driver) proves the serving runtime (serving/: the
Cache, the block-wise reader, the kernels, the vLLM plugin) and imports it; serving/ never imports the check;
Hydra, OmegaConf and MLflow are imported only by pipeline/ (and bench/, above it). The import reader below
(module_name, imports) is the one tests/test_import_cycles.py builds its module graph from."""
import ast
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
LEVEL = {"exporters": 0, "stages": 1, "serving": 2, "runtime_check": 3, "pipeline": 4, "bench": 5}
SIDE_EFFECT_LIBS = ("hydra", "omegaconf", "mlflow")


def module_name(path: Path, root: Path = ROOT) -> str:
    """exporters/native.py -> exporters.native; stages/__init__.py -> stages."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(dotted: str, root: Path = ROOT) -> bool:
    base = root.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) for every import statement of `path`, function-local ones too. `import a.b` names a.b;
    `from a import b` names a.b where that is a module under `root`, else a; relative imports are resolved
    against the file's package. Imports under `if TYPE_CHECKING:` count as any other."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{module}.{a.name}" if module else a.name
                out.append((node.lineno, sub if a.name != "*" and is_module(sub, root) else module))
    return sorted(set(out))


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for package, level in LEVEL.items():
        for path in sorted((root / package).rglob("*.py")):
            for line, module in imports(path, root):
                top = module.split(".")[0]
                where = f"{path.relative_to(root)}:{line} imports {module}"
                if top in LEVEL and LEVEL[top] > level:
                    bad.append(f"{where} (upward: {package} is below {top})")
                if top in SIDE_EFFECT_LIBS and level < LEVEL["pipeline"]:
                    bad.append(f"{where} ({top} belongs to pipeline/ only)")
    return bad


def test_no_import_points_upward():
    assert violations() == []


def test_the_check_catches_an_upward_import(tmp_path):
    for package in LEVEL:
        (tmp_path / package).mkdir()
    (tmp_path / "stages" / "bad.py").write_text("def f():\n    from pipeline.config import RunConfig\n")
    (tmp_path / "exporters" / "worse.py").write_text("import omegaconf\nfrom stages import traces\n")
    (tmp_path / "runtime_check" / "fine.py").write_text("from serving.cache import C\nfrom exporters import codec\n")
    (tmp_path / "serving" / "kernel.py").write_text("from typing import TYPE_CHECKING\nfrom stages.hooks import attend\n"
                                                    "if TYPE_CHECKING:\n    from runtime_check.check import X\n")
    found = violations(tmp_path)
    assert len(found) == 4, found
    assert any("stages/bad.py:2 imports pipeline.config (upward" in v for v in found)
    assert any("exporters/worse.py:1 imports omegaconf" in v for v in found)
    assert any("serving/kernel.py:4 imports runtime_check.check (upward: serving is below runtime_check)" in v
               for v in found)


def test_every_layer_is_a_package_and_the_entry_points_resolve():
    """The serving runtime lives in serving/ (the vLLM plugin entry point and the C source shipped as package data
    name it there), and runtime_check/ holds the check alone (the oracle, the driver, the quality canary)."""
    import tomllib

    for package in LEVEL:
        assert (ROOT / package / "__init__.py").is_file(), f"{package}/ is a layer of the house but not a package"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for name, target in project["project"]["entry-points"]["vllm.general_plugins"].items():
        module, _, attr = target.partition(":")
        assert module.split(".")[0] == "serving" and is_module(module), f"vllm plugin {name} -> {target}"
        assert f"def {attr}(" in ROOT.joinpath(*module.split(".")).with_suffix(".py").read_text()
    for package, patterns in project["tool"]["setuptools"]["package-data"].items():
        for pattern in patterns:
            assert list((ROOT / package).glob(pattern)), f"package data {package}/{pattern} matches no file"
    assert (ROOT / "serving" / "csrc" / "decode_attention.c").is_file()
    assert {p.stem for p in (ROOT / "runtime_check").glob("*.py")} == {"__init__", "canary", "check", "reference"}


def test_importing_stages_registers_nothing_with_transformers():
    """stages/hooks.py registers its attention function on first use, not as an import side effect."""
    code = ("import stages.hooks, stages.evaluate, runtime_check.check\n"
            "from transformers import AttentionInterface\n"
            "assert 'kvcalib' not in AttentionInterface._global_mapping, 'registered at import'\n"
            "stages.hooks.register_attention()\n"
            "assert 'kvcalib' in AttentionInterface._global_mapping\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=300)
