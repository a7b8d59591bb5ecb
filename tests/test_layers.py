"""The project's import graph, read from the source (no module is imported): no import circles, and the
arrows point the way STYLE.md's dependency direction says.

Every ``import x`` and ``from x import y`` of the packages ``turnip``, ``sim``, ``cuda_kernels`` and
``analysis`` counts, at module level or inside a function (a lazy import back up is still a circle). An edge
goes to the deepest project module the name reaches (``from turnip.machine import profile`` -> module
``turnip.machine.profile``, ``from turnip.machine import load_profile`` -> package ``turnip.machine``); a
module's implicit import of its parent packages is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("turnip", "sim", "cuda_kernels", "analysis")
# circles left on purpose: frozenset of their modules -> why (none today)
KNOWN_CIRCLES: dict[frozenset, str] = {}


def module_files(root: Path = ROOT, packages=PACKAGES) -> dict[str, tuple[Path, bool]]:
    """{dotted module name: (file, is a package's ``__init__``)} of every module of ``packages``."""
    out = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            init = parts[-1] == "__init__"
            out[".".join(parts[:-1] if init else parts)] = (f, init)
    return out


def import_graph(mods: dict[str, tuple[Path, bool]], root: Path = ROOT) -> dict[str, dict[str, str]]:
    """{module: {module it imports: "file:line" (under ``root``) of the first such import}}, over the modules
    of ``mods``."""

    def resolve(name: str) -> str | None:  # the deepest module of ``mods`` that ``name`` lies in
        parts = name.split(".")
        while parts and ".".join(parts) not in mods:
            parts.pop()
        return ".".join(parts) or None

    graph: dict[str, dict[str, str]] = {}
    for m, (f, init) in mods.items():
        edges = graph[m] = {}
        pkg = m if init else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [resolve(f"{base}.{a.name}") if a.name != "*" else resolve(base) for a in node.names]
            else:
                continue
            for t in targets:
                if t is not None and t != m:
                    edges.setdefault(t, f"{f.relative_to(root)}:{node.lineno}")
    return graph


def circles(graph: dict[str, dict[str, str]]) -> list[frozenset]:
    """The strongly connected components of more than one module (modules that import each other, directly or
    through others)."""
    reach = {}
    for m in graph:  # every module each one reaches
        seen, todo = set(), [m]
        while todo:
            for t in graph[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        reach[m] = seen
    comps = {frozenset({m} | {t for t in reach[m] if m in reach[t]}) for m in graph}
    return sorted((c for c in comps if len(c) > 1), key=sorted)


def describe(comp: frozenset, graph) -> str:
    return f"{', '.join(sorted(comp))}: " + "; ".join(
        f"{a} -> {b} ({where})" for a in sorted(comp) for b, where in sorted(graph[a].items()) if b in comp
    )


@pytest.fixture(scope="module")
def graph():
    return import_graph(module_files())


def test_the_graph_sees_every_kind_of_import(graph):
    assert "turnip.machine.profile" in graph["sim.engine"]  # module level, from-import of a name
    assert "turnip.calplans" in graph["sim.fit"]  # inside a function
    assert "cuda_kernels.codegen" in graph["cuda_kernels.kernels"]  # from a package, a module of it
    assert "turnip.runtime" in graph["turnip.calibrate"]  # a name of a package's __init__
    assert "numpy" not in graph["sim.engine"] and "turnip" not in graph["sim.engine"]  # only project modules


def test_circles_are_found_and_named(tmp_path):
    for name, text in {"a/__init__.py": "", "a/x.py": "from a import y\n",
                       "a/y.py": "def f():\n    from a.z import g\n", "a/z.py": "import a.x\n",
                       "a/w.py": "from . import x\n"}.items():  # fmt: skip
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    g = import_graph(module_files(tmp_path, ("a",)), tmp_path)
    assert g["a.w"] == {"a.x": "a/w.py:1"} and g["a.y"] == {"a.z": "a/y.py:2"}
    assert circles(g) == [frozenset({"a.x", "a.y", "a.z"})]


def test_no_import_circles(graph):
    found = {c: describe(c, graph) for c in circles(graph) if c not in KNOWN_CIRCLES}
    assert not found, "modules that import each other (move what both need into one of them or a third):\n" + (
        "\n".join(found.values())
    )


def test_known_circles_still_exist(graph):
    gone = set(KNOWN_CIRCLES) - set(circles(graph))
    assert not gone, f"no longer circles, drop them from KNOWN_CIRCLES: {[sorted(c) for c in gone]}"


def test_measuring_and_the_runtime_never_import_sim(graph):
    bad = [f"{m} -> {t} ({where})" for m, edges in graph.items() for t, where in edges.items()
           if (m.startswith("turnip.runtime") or m == "turnip.calibrate") and t.split(".")[0] == "sim"]  # fmt: skip
    assert not bad, "the runtime side imports the simulator (pass the simulating function in from the CLI):\n" + (
        "\n".join(bad)
    )


def test_dependency_direction(graph):
    """STYLE.md: ``cuda_kernels`` never imports ``turnip``; ``sim`` never imports ``turnip.runtime``."""
    bad = [f"{m} -> {t} ({where})" for m, edges in graph.items() for t, where in edges.items()
           if (m.split(".")[0] == "cuda_kernels" and t.split(".")[0] == "turnip")
           or (m.split(".")[0] == "sim" and t.startswith("turnip.runtime"))]  # fmt: skip
    assert not bad, "\n".join(bad)


def test_sim_never_imports_numba():
    """STYLE.md: ``sim`` never imports numba (nor ``cuda_kernels``, which wraps it)."""
    bad = []
    for m, (f, _) in module_files(ROOT, ("sim",)).items():
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])  # fmt: skip
            bad += [f"{m}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in ("numba", "cuda_kernels")]
    assert not bad, "\n".join(bad)
