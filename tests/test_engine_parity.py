"""msa_jit.integrations.engine against vLLM 0.33.0's real files (by ast, nothing imported from them):

* every name `sparse_attention_msa.py` imports from `msa_cutlass_sparse_decode` exists in
  msa_jit.integrations.engine (and is what msa_jit.integrations.vllm_plugin rebinds), with the engine module's parameters
  (names, kinds, defaults) and dataclass fields;
* every call of those names in `sparse_attention_msa.py` (positional count, keyword names)
  binds to msa_jit.integrations.engine's signature.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from typing import Any

import pytest
import vllm_standins as vs

from msa_jit.integrations import engine, vllm_plugin

CALLER = vs.engine_file("sparse_attention_msa.py")
MODULE = vs.engine_file("msa_cutlass_sparse_decode.py")
MODULE_NAME = "vllm.models.minimax_m3.nvidia.msa_cutlass_sparse_decode"

pytestmark = pytest.mark.skipif(not vs.engine_files_present(), reason=vs.ENGINE_SKIP_REASON)

Param = tuple[str, str, Any]


def _imported_names() -> list[str]:
    tree = ast.parse(CALLER.read_text())
    return [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == MODULE_NAME
            for a in n.names]


def _ast_params(fn: ast.FunctionDef) -> list[Param]:
    a = fn.args
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    out: list[Param] = [(arg.arg, "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD",
                         defaults[i]) for i, arg in enumerate(pos)]
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", None))
    out += [(arg.arg, "KEYWORD_ONLY", None if d is None else ast.unparse(d))
            for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", None))
    return out


def _our_params(obj: Any) -> list[Param]:
    return [(p.name, p.kind.name, None if p.default is inspect.Parameter.empty else repr(p.default))
            for p in inspect.signature(obj).parameters.values()]


def _engine_defs() -> dict[str, ast.AST]:
    """Top-level defs and classes of the engine's module, methods as Class.name."""
    out: dict[str, ast.AST] = {}
    for node in ast.parse(MODULE.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        if isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef):
                    out[f"{node.name}.{sub.name}"] = sub
    return out


def _dataclass_fields(cls_node: ast.ClassDef) -> list[tuple[str, bool]]:
    """(name, init) of the annotated fields of an engine dataclass."""
    out = []
    for stmt in cls_node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            init = not (isinstance(stmt.value, ast.Call) and any(
                k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
                for k in stmt.value.keywords))
            out.append((stmt.target.id, init))
    return out


def test_the_caller_imports_the_names_the_plugin_rebinds():
    names = _imported_names()
    assert len(names) == 8, names
    assert sorted(names) == sorted(vllm_plugin.REBOUND_NAMES)
    missing = [n for n in names if not hasattr(engine, n)]
    assert missing == [], f"unbound names: {missing}"


def test_every_imported_name_has_the_engines_signature():
    defs = _engine_defs()
    checked = 0
    for name in _imported_names():
        node = defs[name]
        ours = getattr(engine, name)
        if isinstance(node, ast.FunctionDef):
            assert _our_params(ours) == _ast_params(node), name
            checked += 1
        else:
            assert isinstance(node, ast.ClassDef) and dataclasses.is_dataclass(ours), name
            public = [(f.name, f.init) for f in dataclasses.fields(ours) if not f.name.startswith("_")]
            assert public == _dataclass_fields(node), name
            for method in [k for k in defs if k.startswith(f"{name}.") and not k.split(".")[1].startswith("_")]:
                assert _our_params(getattr(ours, method.split(".")[1])) == _ast_params(defs[method]), method
                checked += 1
    assert checked == 7  # 6 functions + MSACutlassDecodePlanCache.prepare


def _calls() -> list[tuple[str, int, list[str], int]]:
    """(name, positional count, keyword names, line) of every call of an imported name."""
    names = set(_imported_names())
    out = []
    for node in ast.walk(ast.parse(CALLER.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
            assert not any(isinstance(a, ast.Starred) for a in node.args), node.lineno
            assert all(k.arg is not None for k in node.keywords), node.lineno  # no **kwargs
            out.append((node.func.id, len(node.args), [k.arg for k in node.keywords], node.lineno))
    return out


def test_every_call_site_binds():
    calls = _calls()
    called = {c[0] for c in calls}
    # the calls vLLM 0.33 makes: all but the metadata class (used as an annotation only)
    assert called == set(vllm_plugin.REBOUND_NAMES) - {"MSACutlassDecodeMetadata"}, called
    unbound = []
    for name, npos, kws, line in calls:
        try:
            inspect.signature(getattr(engine, name)).bind(*range(npos), **{k: None for k in kws})
        except TypeError as e:
            unbound.append(f"line {line}: {name}({npos} positional, {kws}): {e}")
    assert unbound == [], unbound
    # the keyword call sites that grew since the seed, by name
    kw = {name: set(kws) for name, _, kws, _ in calls}
    assert "min_batch_size" in kw["should_prepare_decode_metadata"]
    assert {"k_scale", "v_scale"} <= kw["msa_cutlass_sparse_decode"]
