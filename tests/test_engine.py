"""msa_jit.engine: the seed API by name and signature, support checks, a run vs the reference."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import FP8, make_case

from msa_jit import engine, sparse_decode_reference
from msa_jit.engine import (
    MSACutlassDecodeMetadata,
    MSACutlassDecodePlanCache,
    msa_cutlass_sparse_decode,
    prepare_decode_metadata,
    should_prepare_decode_metadata,
    supports_cutlass_sparse_decode,
)

SEEDS = Path(__file__).resolve().parents[1].parent / "shared" / "seeds"
Param = tuple[str, str, Any]  # (name, kind, default source or None)

_GEOM = ("num_q_heads", "num_kv_heads", "page_size", "topk_blocks")
_K = "KEYWORD_ONLY"
_P = "POSITIONAL_OR_KEYWORD"
_PREP = [("block_table", _P, None), ("seq_lens", _P, None), ("seq_lens_cpu", _P, None),
         ("decode_query_len", _P, None)] + [(n, _K, None) for n in _GEOM]
# Fallback when the seed document is absent; checked against it when it is present.
EXPECTED: dict[str, list[Param]] = {
    "MSACutlassDecodePlanCache.prepare": [("self", _P, None)] + _PREP,
    "prepare_decode_metadata": _PREP + [("plan_cache", _K, "None")],
    "should_prepare_decode_metadata": [("batch_size", _P, None), ("decode_query_len", _P, None)]
    + [(n, _K, None) for n in ("decode_backend", "num_q_heads", "num_kv_heads", "kv_cache_dtype",
                               "page_size", "topk_blocks")],
    "supports_cutlass_sparse_decode": [(n, _K, None) for n in (
        "decode_backend", "num_q_heads", "num_kv_heads", "kv_cache_dtype", "page_size", "topk_blocks")],
    "msa_cutlass_sparse_decode": [(n, _P, None) for n in (
        "query_fp8", "kv_cache", "topk", "output", "metadata")]
    + [(n, _K, None) for n in ("scale", "q_scale_float", "k_scale_float", "v_scale_float")],
}


def _seed_text() -> str | None:
    files = sorted(SEEDS.glob("*.txt")) if SEEDS.is_dir() else []
    for f in files:
        text = f.read_text(errors="replace")
        if "msa_cutlass_sparse_decode" in text:
            return text
    return None


def _ast_params(fn: ast.FunctionDef) -> list[Param]:
    a = fn.args
    out: list[Param] = []
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    for i, arg in enumerate(pos):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else _P
        out.append((arg.arg, kind, defaults[i]))
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", None))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, _K, None if d is None else ast.unparse(d)))
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", None))
    return out


def parse_seed(text: str) -> dict[str, list[Param]]:
    """Public `def` signatures of the seed's source listings (methods as Class.name)."""
    classes = [(m.start(), m.group(1)) for m in re.finditer(r"^class (\w+)", text, re.M)]
    out: dict[str, list[Param]] = {}
    for m in re.finditer(r"^([ \t]*)def (\w+)\(", text, re.M):
        indent, name = m.group(1), m.group(2)
        if name.startswith("_"):
            continue
        depth, i = 0, m.end() - 1
        for j in range(i, len(text)):
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            if depth == 0:
                break
        fn = ast.parse(f"def {name}{text[i:j + 1]}: pass").body[0]
        assert isinstance(fn, ast.FunctionDef)
        if indent:
            owner = [c for pos, c in classes if pos < m.start()][-1]
            name = f"{owner}.{name}"
        out.setdefault(name, _ast_params(fn))
    return out


def _ours(qualname: str) -> list[Param]:
    obj: Any = engine
    for part in qualname.split("."):
        obj = getattr(obj, part)
    sig = inspect.signature(obj)
    return [(p.name, p.kind.name, None if p.default is inspect.Parameter.empty else repr(p.default))
            for p in sig.parameters.values()]


def _expected() -> dict[str, list[Param]]:
    text = _seed_text()
    return EXPECTED if text is None else parse_seed(text)


def test_seed_document_parses_to_the_fallback():
    text = _seed_text()
    if text is None:
        pytest.skip(f"seed document not found under {SEEDS}: using the hardcoded signatures")
    assert parse_seed(text) == EXPECTED
    for cls in re.findall(r"^class (\w+)", text, re.M):
        assert hasattr(engine, cls), cls
    assert "MSACutlassDecodeMetadata(" in text and hasattr(engine, "MSACutlassDecodeMetadata")


@pytest.mark.parametrize("qualname", sorted(EXPECTED))
def test_signature_matches_seed(qualname):
    expected = _expected()
    assert qualname in expected
    assert _ours(qualname) == expected[qualname]


def test_dataclasses_match_seed():
    text = _seed_text() or ""
    cache = MSACutlassDecodePlanCache()  # `plans` is init=False, as in the engine
    assert dataclasses.is_dataclass(cache) and cache.plans == {}
    plans = {f.name: f for f in dataclasses.fields(MSACutlassDecodePlanCache)}["plans"]
    assert plans.init is False
    if text:
        assert re.search(r"plans: dict\[.*\] = field\(init=False, default_factory=dict\)", text)
        kws = re.findall(r"MSACutlassDecodeMetadata\(\s*(\w+)=\w+,\s*(\w+)=", text)
        assert kws == [("plan", "page_table")]
    assert list(inspect.signature(MSACutlassDecodeMetadata).parameters) == ["plan", "page_table"]


# ----------------------------------------------------------------------------- support checks
_OK = dict(decode_backend="cutlass", num_q_heads=64, num_kv_heads=4, kv_cache_dtype="fp8",
           page_size=128, topk_blocks=16)


@pytest.mark.parametrize("cap,ok", [((9, 0), True), ((10, 0), True), ((10, 3), True), ((12, 0), True),
                                    ((8, 0), False), ((8, 9), False), (None, False)])
def test_supports_capability(monkeypatch, cap, ok):
    monkeypatch.setattr(engine, "_device_capability", lambda: cap)
    assert supports_cutlass_sparse_decode(**_OK) is ok


@pytest.mark.parametrize("change,ok", [
    ({}, True), ({"decode_backend": "msa_jit"}, True), ({"decode_backend": "triton"}, False),
    ({"kv_cache_dtype": "fp8_e4m3"}, True), ({"kv_cache_dtype": "auto"}, False),
    ({"kv_cache_dtype": "fp8_e5m2"}, False), ({"num_q_heads": 32, "num_kv_heads": 2}, True),
    ({"num_q_heads": 16, "num_kv_heads": 1}, True), ({"num_q_heads": 8, "num_kv_heads": 1}, True),
    ({"num_q_heads": 64, "num_kv_heads": 3}, False), ({"num_q_heads": 64, "num_kv_heads": 1}, False),
    ({"page_size": 64}, True), ({"page_size": 100}, False), ({"topk_blocks": 8}, True),
    ({"topk_blocks": 0}, False), ({"topk_blocks": 64}, False),
])
def test_supports_geometry(monkeypatch, change, ok):
    monkeypatch.setattr(engine, "_device_capability", lambda: (9, 0))
    assert supports_cutlass_sparse_decode(**{**_OK, **change}) is ok


@pytest.mark.parametrize("batch,qlen,ok", [(1, 1, True), (2, 4, True), (15, 1, True), (16, 1, True),
                                           (512, 32, True), (0, 1, False), (4, 0, False), (4, 33, False),
                                           (2**20, 32, False)])
def test_should_prepare_has_no_batch_floor(monkeypatch, batch, qlen, ok):
    monkeypatch.setattr(engine, "_device_capability", lambda: (10, 0))
    assert should_prepare_decode_metadata(batch, qlen, **_OK) is ok


def test_no_cuda_means_unsupported(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not supports_cutlass_sparse_decode(**_OK)
    assert not should_prepare_decode_metadata(32, 1, **_OK)


# ----------------------------------------------------------------------------- a step
def _run(c, cache=None):
    md = prepare_decode_metadata(c.block_table, c.seq_lens, c.seq_lens_cpu, c.qlen,
                                 plan_cache=cache, **c.prepare_kwargs())
    out = c.new_out()
    msa_cutlass_sparse_decode(c.query, c.kv_cache, c.topk, out, md, scale=c.sm_scale,
                              q_scale_float=c.q_scale, k_scale_float=c.k_scale, v_scale_float=c.v_scale)
    return md, out


def _check(c, out):
    o64, _ = sparse_decode_reference(*c.reference_args(), **c.scales())
    assert not torch.isnan(out).any()
    if o64.norm() == 0:  # every row padded (kv_len 0): the output must be exactly zero
        assert torch.all(out == 0)
        return
    rel = float((out.double().cpu() - o64).norm() / o64.norm())
    assert rel < 1e-2, rel


def test_cpu_step_matches_reference():
    c = make_case(3, 2, 16, 1, q_dtype=FP8, seed=11, padded=True)
    cache = MSACutlassDecodePlanCache()
    md, out = _run(c, cache)
    _check(c, out)
    key = (3, 2, c.block_table.stride(0), 16, 1, 128, 16)
    assert list(cache.plans) == [key] and cache.plans[key] is md.plan
    assert md.page_table.dim() == 1 and torch.equal(md.page_table.view(3, -1), c.block_table)
    md2, out2 = _run(c, cache)  # same key: same plan object (stable addresses)
    assert md2.plan is md.plan and torch.equal(out2, out)


def test_default_cache_is_shared():
    c = make_case(2, 1, 8, 1, q_dtype=torch.bfloat16, seed=12)
    md1, out = _run(c)
    md2, _ = _run(c)
    assert md1.plan is md2.plan
    _check(c, out)


def test_compiled_engine_step_cpu():
    c = make_case(2, 2, 16, 1, q_dtype=FP8, seed=13)
    md, out_e = _run(c, MSACutlassDecodePlanCache())

    def step(q, kv, tk, o):
        msa_cutlass_sparse_decode(q, kv, tk, o, md, scale=c.sm_scale, q_scale_float=c.q_scale,
                                  k_scale_float=c.k_scale, v_scale_float=c.v_scale)
        return o

    torch._dynamo.reset()
    out_c = torch.compile(step, fullgraph=True, backend="aot_eager")(c.query, c.kv_cache, c.topk, c.new_out())
    assert torch.equal(out_c, out_e)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,qlen", [(1, 1), (5, 3), (64, 1)])
def test_gpu_step_and_graph_replay(batch, qlen):
    c = make_case(batch, qlen, 64, 4, q_dtype=FP8, seed=14 + batch, device="cuda", padded=True)
    assert should_prepare_decode_metadata(batch, qlen, **_OK)
    cache = MSACutlassDecodePlanCache()
    _, out = _run(c, cache)
    _check(c, out)
    out_g = c.new_out()

    def step():
        md = cache.prepare(c.block_table, c.seq_lens, c.seq_lens_cpu, c.qlen, **c.prepare_kwargs())
        msa_cutlass_sparse_decode(c.query, c.kv_cache, c.topk, out_g, md, scale=c.sm_scale,
                                  q_scale_float=c.q_scale, k_scale_float=c.k_scale, v_scale_float=c.v_scale)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out_g.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(c, out_g)
    torch.testing.assert_close(out_g, out, rtol=1e-2, atol=1e-3)
