"""The package's import graph: acyclic, layered as docs/design.md says, and no module over 800 lines.

The graph is read from the source (ast), so it holds every import statement: module level,
inside functions, under `if TYPE_CHECKING`. `from a import b` is an edge to the module a.b
when that is a module, else to a; `import a.b` to a.b. Importing a submodule also runs its
parent package's __init__, but that is not an edge: a package whose __init__ imports its own
submodules would otherwise always be a cycle (Python runs the parent first, then the child).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "msa_jit"
MAX_LINES = 800


def package_modules(src: Path, package: str) -> dict[str, Path]:
    """Module name -> file for every .py of `package` in src/."""
    out: dict[str, Path] = {}
    base = src / package
    for f in sorted(base.rglob("*.py")):
        rel = f.relative_to(base)
        if "__pycache__" in rel.parts:
            continue
        parts = [package, *rel.with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def import_graph(modules: dict[str, Path], package: str) -> dict[str, set[str]]:
    """Module -> the package modules its import statements name (see the module docstring)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = here[: len(here) - (node.level - 1)]
                    prefix = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in modules:  # `import msa_jit.jit.cache.key` -> its longest known prefix
                    t = t.rpartition(".")[0]
                if t.split(".")[0] == package and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None when the graph is acyclic (iterative DFS)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path: list[str] = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(package_modules(ROOT, PACKAGE), PACKAGE)


def test_the_walker_sees_module_and_function_level_cycles(tmp_path):
    """The check can fail: a planted circle through a function-level relative import is found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from .sub import b\n\ndef f():\n    return b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def g():\n    from ..a import f\n    return f\n")
    (pkg / "c.py").write_text("import pkg.sub.b\n")
    g = import_graph(package_modules(tmp_path, "pkg"), "pkg")
    assert g["pkg.a"] == {"pkg.sub.b"} and g["pkg.sub.b"] == {"pkg.a"} and g["pkg.c"] == {"pkg.sub.b"}
    assert find_cycle(g) in (["pkg.a", "pkg.sub.b", "pkg.a"], ["pkg.sub.b", "pkg.a", "pkg.sub.b"])
    (pkg / "sub" / "b.py").write_text("def g():\n    return 1\n")
    assert find_cycle(import_graph(package_modules(tmp_path, "pkg"), "pkg")) is None


def test_no_import_cycle(graph):
    assert len(graph) > 20 and "msa_jit.jit.cache.store" in graph and "msa_jit.cli.warmup" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layers(graph):
    """docs/design.md's layers: the kernels import only each other (so their fingerprint is the whole
    artifact); the cache imports only itself and env (a runtime-only host loads artifacts through it);
    geometry and plan are near the bottom; cli/ is the top (only __main__ imports it)."""
    for name, deps in graph.items():
        if not (name.startswith("msa_jit.cli") or name == "msa_jit.__main__"):
            assert not any(d.startswith("msa_jit.cli") for d in deps), (name, deps)
        if name.startswith("msa_jit.kernels"):
            assert all(d.startswith("msa_jit.kernels") for d in deps), (name, deps)
        if name.startswith("msa_jit.jit.cache"):
            assert all(d.startswith("msa_jit.jit.cache") or d == "msa_jit.env" for d in deps), (name, deps)
        if not name.startswith(("msa_jit.tools", "msa_jit.cli", "msa_jit.__main__")):
            assert not any(d.startswith("msa_jit.tools") for d in deps), (name, deps)
    assert graph["msa_jit.kernels.constants"] == set()
    assert graph["msa_jit.geometry"] <= {"msa_jit.kernels.constants"}
    assert graph["msa_jit.env"] <= {"msa_jit.geometry", "msa_jit.kernels.constants"}
    assert graph["msa_jit.plan"] <= {"msa_jit.geometry", "msa_jit.kernels.constants", "msa_jit.kernels.convention",
                                    "msa_jit.jit.compiler"}


def test_every_module_is_on_the_design_map():
    """docs/design.md's map names every module of the package (by its file name, in its folder's
    block), and nothing it names is missing."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("```", 2)[1]
    missing = []
    for path in package_modules(ROOT, PACKAGE).values():
        # a subpackage's __init__.py is on the map as its folder
        word = f"{path.parent.name}/" if path.name == "__init__.py" and path.parent.name != PACKAGE else path.name
        if not re.search(rf"(?<![\w/]){re.escape(word)}", block):
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"modules missing from docs/design.md's map: {missing}"
    named = set(re.findall(r"\b([a-z_]+\.py)\b", block))
    files = {p.name for p in (ROOT / PACKAGE).rglob("*.py")}
    assert named <= files, f"docs/design.md names files that do not exist: {sorted(named - files)}"


def test_the_map_check_can_fail(tmp_path, monkeypatch):
    """A module the map does not name fails the check."""
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "undocumented_helper.py").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("# map\n```\nmsa_jit/\n  __init__.py\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="undocumented_helper.py"):
        test_every_module_is_on_the_design_map()


def test_no_module_over_800_lines():
    """The package and kernels, and the bench scripts, tests and examples beside them."""
    files = [*package_modules(ROOT, PACKAGE).values(),
             *(f for d in ("bench", "experiments", "tests", "examples") for f in sorted((ROOT / d).rglob("*.py")))]
    long = {str(f.relative_to(ROOT)): n for f in files
            if (n := len(f.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
