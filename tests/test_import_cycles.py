"""No import circle anywhere in the product code: the module graph of every import statement of exporters/,
stages/, serving/, runtime_check/, pipeline/ and bench/ (function-local ones, `from package import module` and those
under `if TYPE_CHECKING:` too, read by tests/test_layering.py's `imports`) has no strongly connected component of more
than one module and no module importing itself. A type-checking import never runs, but it is a dependency all the
same: a circle through one is a circle a type checker and a reader follow. An import names the module it
loads; a package's __init__.py is a node of its own, reached when it is named (`import stages`, or
`from stages import x` where x is not a module)."""
from pathlib import Path

from tests.test_layering import LEVEL, ROOT, imports, module_name


def import_graph(root: Path = ROOT) -> dict[str, dict[str, list[str]]]:
    """module -> {product module it imports: ["path:line", ...]}."""
    paths = {module_name(p, root): p for package in LEVEL for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, dict[str, list[str]]] = {}
    for name, path in paths.items():
        edges = graph.setdefault(name, {})
        for line, target in imports(path, root):
            if target in paths:
                edges.setdefault(target, []).append(f"{path.relative_to(root)}:{line}")
    return graph


def components(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Tarjan's strongly connected components, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def circles(root: Path = ROOT) -> list[str]:
    """One line per circle: its modules, then every import inside it (where, what)."""
    graph = import_graph(root)
    found = []
    for component in components(graph):
        if len(component) == 1 and component[0] not in graph[component[0]]:
            continue
        inside = [f"{where} imports {w}" for v in component for w, wheres in sorted(graph[v].items())
                  if w in component for where in wheres]
        found.append(f"{' / '.join(component)}: {'; '.join(inside)}")
    return sorted(found)


def test_no_import_circle():
    found = circles()
    assert found == [], "import circles:\n" + "\n".join(found)


def test_the_check_catches_every_kind_of_circle(tmp_path):
    for package in LEVEL:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    files = {
        # two modules: a top-level `from package import module` and a function-local import
        "exporters/a.py": "from exporters import b\n",
        "exporters/b.py": "def f():\n    from exporters.a import X\n",
        # a module importing itself (relative form)
        "stages/self_.py": "from . import self_\n",
        # three modules, one relative import with a level
        "pipeline/p1.py": "import pipeline.p2\n",
        "pipeline/p2.py": "from pipeline.p3 import y\n",
        "pipeline/p3.py": "from .p1 import z\n",
        # a circle closed by an import only for type checking
        "serving/t.py": ("from typing import TYPE_CHECKING\n"
                         "if TYPE_CHECKING:\n    from serving.u import U\n"),
        "serving/u.py": "import torch\nfrom serving.t import T\nfrom exporters.a import X\n",
        # not circles: a chain, an outside library
        "bench/top.py": "from pipeline import p1\nimport typing\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    assert circles(tmp_path) == [
        "exporters.a / exporters.b: exporters/a.py:1 imports exporters.b; exporters/b.py:2 imports exporters.a",
        "pipeline.p1 / pipeline.p2 / pipeline.p3: pipeline/p1.py:1 imports pipeline.p2; "
        "pipeline/p2.py:1 imports pipeline.p3; pipeline/p3.py:1 imports pipeline.p1",
        "serving.t / serving.u: serving/t.py:3 imports serving.u; serving/u.py:2 imports serving.t",
        "stages.self_: stages/self_.py:1 imports stages.self_",
    ]
    (tmp_path / "serving/t.py").write_text("import typing\n")  # the type-checking import gone: no circle
    assert not any(c.startswith("serving.") for c in circles(tmp_path))
