"""One source per constant: the operator's constants are written in geometry.py, the
environment's in env.py, and everywhere else (msa_jit, kernels, bench, tests, examples) imports them.

The check reads literals with ast, so a restated list is found however it is spelled
((64, 4), [64,4], a tuple or a list), while prose that names them (help text, docstrings) is not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from msa_jit.geometry import DEFAULT_ARCHES, MINIMAX_M3_GEOMETRIES

ROOT = Path(__file__).resolve().parents[1]
TREES = ("msa_jit", "bench", "tests", "examples")


def py_files() -> list[Path]:
    return [f for t in TREES for f in sorted((ROOT / t).rglob("*.py")) if "__pycache__" not in f.parts]


def literal_collections(path: Path):
    """Every tuple / list / set display of constants in the file, as a Python value (lists as tuples)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            try:
                value = ast.literal_eval(node)
            except ValueError:
                continue
            yield node.lineno, tuple(tuple(v) if isinstance(v, list) else v for v in value)


def restated(whole: tuple, defined_in: str) -> list[str]:
    """file:line of every literal made of `whole`'s items (any order), outside the file that defines it."""
    out = []
    for f in py_files():
        rel = f.relative_to(ROOT).as_posix()
        if rel == defined_in:
            continue
        for line, value in literal_collections(f):
            if len(value) == len(whole) and all(w in value for w in whole):
                out.append(f"{rel}:{line}")
    return out


@pytest.mark.parametrize("name,whole", [
    ("MINIMAX_M3_GEOMETRIES", MINIMAX_M3_GEOMETRIES),
    ("DEFAULT_ARCHES", DEFAULT_ARCHES),
])
def test_geometry_constants_are_written_once(name, whole):
    assert not restated(tuple(whole), "msa_jit/geometry.py"), f"{name} restated (import it from msa_jit.geometry)"


def test_the_check_finds_a_restated_list(tmp_path, monkeypatch):
    planted = tmp_path / "tests" / "planted.py"
    planted.parent.mkdir()
    planted.write_text("GEOMS = [(64, 4), (32, 2), (16, 1), [8, 1]]\nARCHES = ['sm_100a', 'sm_90a']\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert restated(MINIMAX_M3_GEOMETRIES, "msa_jit/geometry.py") == ["tests/planted.py:1"]
    assert restated(DEFAULT_ARCHES, "msa_jit/geometry.py") == ["tests/planted.py:2"]


def test_msa_jit_variables_are_read_in_env_only():
    """MSA_JIT_* is read through env.py's functions (so doctor lists every variable); the package
    and the bench never read os.environ / os.getenv for one themselves."""
    bad = []
    for f in py_files():
        rel = f.relative_to(ROOT).as_posix()
        if rel == "msa_jit/env.py" or rel.startswith(("tests/", "examples/")):
            continue
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                fn = ast.unparse(node.func)
                reads = fn.endswith(("environ.get", "getenv"))
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                fn, reads = ast.unparse(node.value), ast.unparse(node.value).endswith("environ")
            else:
                continue
            if reads and "MSA_JIT_" in ast.unparse(node):
                bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, bad


def test_one_size_parser():
    """env.parse_size is the one size syntax; the CLI's is a thin argparse wrapper around it."""
    import inspect

    from msa_jit import env
    from msa_jit.cli import common

    assert "env.parse_size(" in inspect.getsource(common.parse_size)
    defs = [f"{f.relative_to(ROOT)}" for f in py_files() if not f.relative_to(ROOT).parts[0] == "tests"
            for n in ast.walk(ast.parse(f.read_text(encoding="utf-8")))
            if isinstance(n, ast.FunctionDef) and "size" in n.name and "parse" in n.name]
    assert sorted(defs) == ["msa_jit/cli/common.py", "msa_jit/env.py"], defs
    assert env.parse_size("2P") == 2 << 50 and common.parse_size("2P") == 2 << 50


# Names that are legitimately one per module: each CLI command's help line.
PER_MODULE_NAMES = {"HELP"}


def module_constants(path: Path) -> set[str]:
    """Upper-case names assigned at a module's top level (not imported)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Name) and t.id.isupper() and not t.id.startswith("_"):
                names.add(t.id)
    return names


def defined_twice(root: Path) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {}
    for f in sorted(root.rglob("*.py")):
        if "__pycache__" in f.parts:
            continue
        for name in module_constants(f) - PER_MODULE_NAMES:
            seen.setdefault(name, []).append(f.relative_to(root.parent).as_posix())
    return {n: fs for n, fs in seen.items() if len(fs) > 1}


def test_every_package_constant_has_one_definition():
    """HEAD_DIM, the cache formats, the NVFP4 layout, the kernels' limits: each assigned in one module
    (msa_jit/kernels/constants.py for what shapes generated code) and imported everywhere else."""
    assert defined_twice(ROOT / "msa_jit") == {}


def test_the_one_definition_check_can_fail(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("HEAD_DIM = 128\nHELP = 'a'\n")
    (pkg / "b.py").write_text("from .a import HEAD_DIM\nHELP = 'b'\n")
    assert defined_twice(pkg) == {}
    (pkg / "c.py").write_text("HEAD_DIM: int = 128\n")
    assert defined_twice(pkg) == {"HEAD_DIM": ["pkg/a.py", "pkg/c.py"]}
