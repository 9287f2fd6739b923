"""msa_jit.integrations.engine: the seed API by name and signature, support checks, fp8 and NVFP4 runs vs the
reference (decode and msa_sparse_prefill), errors naming the layout. vLLM 0.33's own signatures:
tests/test_engine_parity.py; vLLM's own code running it: tests/test_engine_vllm.py."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from typing import Any

import pytest
import torch
import vllm_standins as vs
from helpers import FP8, make_case

import msa_jit
from msa_jit.integrations import engine
from msa_jit import sparse_decode_reference
from msa_jit.integrations.engine import (MSACutlassDecodeMetadata, MSACutlassDecodePlanCache, msa_cutlass_sparse_decode, prepare_decode_metadata, should_prepare_decode_metadata, supports_cutlass_sparse_decode)

Param = tuple[str, str, Any]  # (name, kind, default source or None)

_GEOM = ("num_q_heads", "num_kv_heads", "page_size", "topk_blocks")
_K = "KEYWORD_ONLY"
_P = "POSITIONAL_OR_KEYWORD"
_PREP = [("block_table", _P, None), ("seq_lens", _P, None), ("seq_lens_cpu", _P, None),
         ("decode_query_len", _P, None)] + [(n, _K, None) for n in _GEOM]
# The seed document's API (what the reference engine exposed first): the public signatures of its
# msa_cutlass_sparse_decode module. vLLM 0.33.0's module keeps each as its leading parameters
# (test_seed_signatures_lead_vllm_0_33s); its additions: tests/test_engine_parity.py.
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


def _vllm_module_text() -> str:
    """vLLM 0.33.0's msa_cutlass_sparse_decode.py (tests/vllm_files.py); skips when not available."""
    if not vs.engine_files_present():
        pytest.skip(vs.ENGINE_SKIP_REASON)
    return vs.engine_file("msa_cutlass_sparse_decode.py").read_text()


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
    """Public `def` signatures of a source listing, the seed's or a module's (methods as Class.name)."""
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


def test_seed_signatures_lead_vllm_0_33s():
    """Each seed signature is the leading part of vLLM 0.33.0's, whose additions all have defaults;
    the module's classes are the adapter's."""
    text = _vllm_module_text()
    real = parse_seed(text)
    for qualname, params in EXPECTED.items():
        assert real[qualname][:len(params)] == params, qualname
        assert all(default is not None for _, _, default in real[qualname][len(params):]), qualname
    classes = re.findall(r"^class (\w+)", text, re.M)
    assert classes and all(hasattr(engine, cls) for cls in classes), classes


@pytest.mark.parametrize("qualname", sorted(EXPECTED))
def test_signature_accepts_seed(qualname):
    """The seed's parameters come first, unchanged; what vLLM 0.33 added (tests/test_engine_parity.py)
    follows, each with a default, so every seed call still binds."""
    ours = _ours(qualname)
    assert ours[:len(EXPECTED[qualname])] == EXPECTED[qualname]
    assert all(default is not None for _, _, default in ours[len(EXPECTED[qualname]):])


def test_dataclasses_match_seed():
    cache = MSACutlassDecodePlanCache()  # `plans` is init=False, as in the engine
    assert dataclasses.is_dataclass(cache) and cache.plans == {}
    plans = {f.name: f for f in dataclasses.fields(MSACutlassDecodePlanCache)}["plans"]
    assert plans.init is False
    assert list(inspect.signature(MSACutlassDecodeMetadata).parameters) == ["plan", "page_table"]


def test_dataclasses_are_built_as_vllm_0_33_builds_them():
    text = _vllm_module_text()
    assert re.search(r"plans: dict\[.*\] = field\(init=False, default_factory=dict\)", text)
    kws = re.findall(r"MSACutlassDecodeMetadata\(\s*(\w+)=\w+,\s*(\w+)=", text)
    assert kws == [("plan", "page_table")]


# ----------------------------------------------------------------------------- support checks
_OK = dict(decode_backend="cutlass", num_q_heads=64, num_kv_heads=4, kv_cache_dtype="fp8",
           page_size=128, topk_blocks=16)


# msa-jit's builds are arch-specific (sm_90a, sm_100a): a 10.3 or 12.0 GPU runs neither
@pytest.mark.parametrize("cap,ok", [((9, 0), True), ((10, 0), True), ((10, 3), False), ((12, 0), False),
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


def test_should_prepare_takes_exactly_the_largest_output(monkeypatch):
    """The edge of the int32 element count of out: T * Hq == _MAX_QUERY_HEAD_ROWS is taken, one more is not."""
    monkeypatch.setattr(engine, "_device_capability", lambda: (9, 0))
    rows = engine._MAX_QUERY_HEAD_ROWS
    assert rows * 128 <= 2**31 - 1
    edge = {**_OK, "num_q_heads": 1, "num_kv_heads": 1}
    assert should_prepare_decode_metadata(rows, 1, **edge) is True
    assert should_prepare_decode_metadata(rows + 1, 1, **edge) is False


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


@pytest.mark.gpu
def test_gpu_step_under_inference_mode():
    """vLLM's call: the plan built and the op run under torch.inference_mode() (the adapter then
    skips its no-grad guard), bitwise the same as with grad on, and right."""
    c = make_case(4, 2, 64, 4, q_dtype=FP8, seed=31, device="cuda", padded=True)
    _, out_grad = _run(c, MSACutlassDecodePlanCache())
    with torch.inference_mode():
        _, out_inf = _run(c, MSACutlassDecodePlanCache())
    torch.cuda.synchronize()
    _check(c, out_inf)
    assert torch.equal(out_inf.view(torch.int16), out_grad.view(torch.int16))


# ----------------------------------------------------------------------------- vLLM 0.33 additions
@pytest.mark.parametrize("dtype,ok", [("nvfp4", True), ("nvfp4_4over6", True), ("nvfp4_ds_mla", False),
                                      ("fp8", False), ("auto", False), ("bfloat16", False), (None, False)])
def test_is_nvfp4_kv_cache(dtype, ok):
    assert engine.is_nvfp4_kv_cache(dtype) is ok


@pytest.mark.parametrize("backend", ["triton", "cutlass", "msa_jit"])
def test_nvfp4_takes_the_path_whatever_the_backend(monkeypatch, backend):
    monkeypatch.setattr(engine, "_device_capability", lambda: (9, 0))
    assert supports_cutlass_sparse_decode(**{**_OK, "decode_backend": backend, "kv_cache_dtype": "nvfp4"})
    assert not supports_cutlass_sparse_decode(**{**_OK, "decode_backend": "triton"})
    monkeypatch.setattr(engine, "_device_capability", lambda: (8, 9))
    assert not supports_cutlass_sparse_decode(**{**_OK, "kv_cache_dtype": "nvfp4"})


@pytest.mark.parametrize("dtype,batch,floor,ok", [
    ("fp8", 3, None, True), ("fp8", 3, 16, False), ("fp8", 16, 16, True), ("fp8", 1, 0, True),
    ("nvfp4", 3, 16, True),  # NVFP4 has no fallback kernel: the floor does not apply
    ("fp8", 0, None, False), ("nvfp4", 0, None, False),
])
def test_min_batch_size(monkeypatch, dtype, batch, floor, ok):
    monkeypatch.setattr(engine, "_device_capability", lambda: (9, 0))
    kw = {**_OK, "kv_cache_dtype": dtype}
    assert should_prepare_decode_metadata(batch, 1, **kw, min_batch_size=floor) is ok


def test_min_batch_size_type():
    with pytest.raises(TypeError, match="min_batch_size"):
        should_prepare_decode_metadata(4, 1, **_OK, min_batch_size="16")


def _nvfp4_cache(pages: int, hkv: int, page: int = 128) -> torch.Tensor:
    return torch.randint(0, 256, (pages, 2 * hkv, page, 72), dtype=torch.uint8)


def test_nvfp4_views_follow_the_contract():
    """Slot 2h = K of head h, 2h+1 = V; a slot is page*72 flat bytes: data [page, 64] then scales
    [page, 8] (not 72-byte rows)."""
    from msa_jit.nvfp4 import is_nvfp4_kv_layout, nvfp4_kv_cache_slots

    page, hkv, pages = 16, 2, 3
    kv = _nvfp4_cache(pages, hkv, page)
    flat = kv.view(pages, 2 * hkv, page * 72)
    k_data, k_sc, v_data, v_sc = engine.nvfp4_kv_cache_views(kv)
    assert k_data.shape == v_data.shape == (pages, hkv, page, 64)
    assert k_sc.shape == v_sc.shape == (pages, hkv, page, 8)
    for p in range(pages):
        for h in range(hkv):
            for side, (data, sc) in enumerate(((k_data, k_sc), (v_data, v_sc))):
                slot = flat[p, 2 * h + side]
                assert torch.equal(data[p, h].reshape(-1), slot[:page * 64])
                assert torch.equal(sc[p, h].reshape(-1), slot[page * 64:])
    k_slots, v_slots = nvfp4_kv_cache_slots(kv)
    assert torch.equal(k_slots, kv[:, 0::2]) and torch.equal(v_slots, kv[:, 1::2])
    assert is_nvfp4_kv_layout(kv) and engine.kv_cache_layout(kv) == "nvfp4"
    assert not is_nvfp4_kv_layout(kv[:, :3])  # an odd slot count is no K/V pair
    assert not is_nvfp4_kv_layout(torch.zeros(pages, hkv, page, 256, dtype=torch.uint8))  # fp8 storage
    with pytest.raises(ValueError, match=r"expected an NVFP4 cache \[P, 2\*Hkv, page, 72\]"):
        engine.nvfp4_kv_cache_views(kv[:, :3])
    with pytest.raises(TypeError, match="uint8"):
        engine.nvfp4_kv_cache_views(kv.view(torch.int8))


def test_kv_cache_layout_dispatch():
    assert engine.kv_cache_layout(torch.zeros(2, 4, 128, 256, dtype=FP8)) == "fp8"
    assert engine.kv_cache_layout(torch.zeros(2, 4, 128, 256, dtype=torch.uint8)) == "fp8"
    assert engine.kv_cache_layout(_nvfp4_cache(2, 4)) == "nvfp4"
    for bad in (torch.zeros(2, 4, 128, 72, dtype=FP8), torch.zeros(2, 3, 128, 72, dtype=torch.uint8),
                torch.zeros(2, 4, 128, 128, dtype=torch.uint8)):
        with pytest.raises(ValueError, match=r"fp8 layout \[P, Hkv, page_size, 256\].*NVFP4 layout "
                                             r"\[P, 2\*Hkv, page_size, 72\].*got shape"):
            engine.kv_cache_layout(bad)
    with pytest.raises(TypeError, match="kv_cache"):
        engine.kv_cache_layout([1, 2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8])
def test_kv_cache_of_a_dtype_no_layout_has_is_a_type_error_on_both_paths(dtype):
    """A bf16 / int8 cache is a TypeError through the adapter as through msa_jit.sparse_decode."""
    bad = torch.zeros(2, 4, 128, 256, dtype=dtype)
    with pytest.raises(TypeError, match=r"kv_cache: expected the fp8 layout .* got a torch\.\w+ tensor"):
        engine.kv_cache_layout(bad)
    plan = msa_jit.prepare(torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), None, 1,
                           num_q_heads=64, num_kv_heads=4, page_size=128, topk_blocks=16)
    q = torch.zeros(1, 64, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="kv_cache"):
        msa_jit.sparse_decode(q, bad, torch.zeros(1, 4, 16, dtype=torch.int32), torch.empty_like(q), plan,
                              sm_scale=0.1)


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_adapter_runs_without_grad_in_every_mode(monkeypatch, mode):
    """The engine's module wraps both calls in @torch.no_grad(); the adapter enters that guard
    only when grad mode is on (under vLLM's inference_mode it would only cost), so the op and the
    planner see grad disabled in every mode, and the caller's mode is restored after."""
    seen = []
    monkeypatch.setattr(engine, "sparse_decode", lambda *a, **k: seen.append(("op", torch.is_grad_enabled())))
    c = make_case(2, 1, 8, 1, q_dtype=FP8, seed=21)
    cache = MSACutlassDecodePlanCache()
    real_prepare = cache._planner.prepare
    monkeypatch.setattr(cache._planner, "prepare",
                        lambda *a, **k: seen.append(("prepare", torch.is_grad_enabled())) or real_prepare(*a, **k))
    ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    with ctx():
        md = prepare_decode_metadata(c.block_table, c.seq_lens, c.seq_lens_cpu, c.qlen, plan_cache=cache,
                                     **c.prepare_kwargs())
        _decode_call(c, md, c.kv_cache, c.new_out())
        assert torch.is_grad_enabled() is (mode == "grad")
    assert seen == [("prepare", False), ("op", False)]


def _decode_call(c, md, kv, out, **kw):
    msa_cutlass_sparse_decode(c.query, kv, c.topk, out, md, scale=c.sm_scale, q_scale_float=c.q_scale,
                              k_scale_float=c.k_scale, v_scale_float=c.v_scale, **kw)


def _nvfp4_adapter_run(device: str, batch: int, qlen: int, hq: int, hkv: int, seed: int) -> None:
    """msa_cutlass_sparse_decode on an NVFP4 cache (make_case: bf16 K/V through
    msa_jit.nvfp4.quantize_kv_nvfp4) with the global scales as vLLM passes them (0-dim float32
    device tensors; [1] works too), against the float64 reference on the same NVFP4 cache.
    k_scale_float / v_scale_float are what the fp8 path reads: wrong ones here must not matter."""
    # padded only beside other rows: a batch of one padded row has an all-zero reference (0/0 below)
    c = make_case(batch, qlen, hq, hkv, q_dtype=FP8, seed=seed, device=device, padded=batch > 1, kv_dtype="nvfp4")
    md = prepare_decode_metadata(c.block_table, c.seq_lens, c.seq_lens_cpu, c.qlen,
                                 plan_cache=MSACutlassDecodePlanCache(), **c.prepare_kwargs())
    ref, _ = sparse_decode_reference(*c.reference_args(), **c.scales())
    scales = c.scales(scale_tensors=True)
    for shape in ((), (1,)):
        out = c.new_out()
        msa_cutlass_sparse_decode(c.query, c.kv_cache, c.topk, out, md, scale=c.sm_scale,
                                  q_scale_float=c.q_scale, k_scale_float=7.0, v_scale_float=0.125,
                                  k_scale=scales["k_scale"].reshape(shape),
                                  v_scale=scales["v_scale"].reshape(shape))
        assert not torch.isnan(out).any() and ref.norm() > 0
        rel = float((out.double().cpu() - ref).norm() / ref.norm())
        assert rel < 1e-2, (shape, rel)
    # the tensors' values are what the op reads: a V scale twice as large doubles the output
    out2 = c.new_out()
    msa_cutlass_sparse_decode(c.query, c.kv_cache, c.topk, out2, md, scale=c.sm_scale,
                              q_scale_float=c.q_scale, k_scale_float=c.k_scale, v_scale_float=c.v_scale,
                              k_scale=scales["k_scale"], v_scale=scales["v_scale"] * 2)
    rel2 = float((out2.double().cpu() - 2 * ref).norm() / (2 * ref).norm())
    assert rel2 < 1e-2, rel2
    if device != "cuda":
        return
    assert list(md.plan.kernels) == [(FP8, "nvfp4")], "the compiled NVFP4 kernel ran"
    # CUDA graph: the kernel reads the scale tensors on the device at every replay
    ks, vs = scales["k_scale"].clone(), scales["v_scale"].clone()
    out_g = c.new_out()

    def step():
        msa_cutlass_sparse_decode(c.query, c.kv_cache, c.topk, out_g, md, scale=c.sm_scale,
                                  q_scale_float=c.q_scale, k_scale_float=c.k_scale,
                                  v_scale_float=c.v_scale, k_scale=ks, v_scale=vs)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    vs.mul_(2)
    out_g.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    rel_g = float((out_g.double().cpu() - 2 * ref).norm() / (2 * ref).norm())
    assert rel_g < 1e-2, rel_g


@pytest.mark.parametrize("batch,qlen,hq,hkv", [(3, 1, 16, 1), (2, 3, 32, 2)])
def test_nvfp4_call_matches_the_reference(batch, qlen, hq, hkv):
    _nvfp4_adapter_run("cpu", batch, qlen, hq, hkv, seed=41 + qlen)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,qlen,hq,hkv", [(1, 1, 64, 4), (5, 3, 64, 4), (64, 1, 16, 1), (7, 2, 8, 1)])
def test_nvfp4_call_matches_the_reference_gpu(batch, qlen, hq, hkv):
    _nvfp4_adapter_run("cuda", batch, qlen, hq, hkv, seed=48 + batch)


def test_nvfp4_errors_name_the_layout():
    c = make_case(2, 1, 16, 1, q_dtype=FP8, seed=41, kv_dtype="nvfp4")
    md = prepare_decode_metadata(c.block_table, c.seq_lens, c.seq_lens_cpu, c.qlen,
                                 plan_cache=MSACutlassDecodePlanCache(), **c.prepare_kwargs())
    kv, out = c.kv_cache, c.new_out()
    one = torch.tensor(1.0)
    with pytest.raises(TypeError, match=r"^k_scale, v_scale: the NVFP4 layout \[P, 2\*Hkv, page_size, 72\] "
                                        r"\(uint8\) needs its global scales"):
        _decode_call(c, md, kv, out)
    with pytest.raises(TypeError, match=r"^v_scale: the NVFP4 layout .*needs its global scales"):
        _decode_call(c, md, kv, out, k_scale=one)
    with pytest.raises(ValueError, match=r"^kv_cache: expected .*NVFP4 \[num_pages, 2, 128, 72\].*"
                                         r"\(kv_cache recognised as the NVFP4 layout \[P, 2\*Hkv, page_size, 72\] \(uint8\)\)$"):
        _decode_call(c, md, torch.zeros(kv.shape[0], 4, 128, 72, dtype=torch.uint8), out, k_scale=one, v_scale=one)
    with pytest.raises(TypeError, match=r"^k_scale: expected a python float \(or a 1-element CPU tensor\)"
                                        r".*\(kv_cache recognised as the NVFP4 layout .*\)$"):
        _decode_call(c, md, kv, out, k_scale=torch.ones(2), v_scale=one)
    with pytest.raises(ValueError, match=r"^v_scale: expected a finite float > 0.*"
                                         r"\(kv_cache recognised as the NVFP4 layout .*\)$"):
        _decode_call(c, md, kv, out, k_scale=one, v_scale=torch.tensor(0.0))
    assert torch.isnan(out).all(), "nothing may be written on failure"


def test_fp8_errors_name_the_layout():
    c = make_case(2, 1, 16, 1, q_dtype=FP8, seed=42)
    md = prepare_decode_metadata(c.block_table, c.seq_lens, c.seq_lens_cpu, c.qlen,
                                 plan_cache=MSACutlassDecodePlanCache(), **c.prepare_kwargs())
    out = c.new_out()
    kv2 = torch.zeros(c.kv_cache.shape[0], 2, 128, 256, dtype=FP8)  # 2 KV heads, the plan has 1
    with pytest.raises(ValueError, match=r"^kv_cache: expected fp8 \[num_pages, 1, 128, 256\].*got shape "
                                         r"\[\d+, 2, 128, 256\].*\(kv_cache recognised as the fp8 layout .*\)$"):
        _decode_call(c, md, kv2, out)
    assert torch.isnan(out).all()
    # vLLM's default LBNHC layout: the per-layer view interleaves the heads of a token
    lbnhc = torch.zeros(c.kv_cache.shape[0], 128, 2, 256, dtype=FP8).transpose(1, 2)  # [P, 2, 128, 256]
    with pytest.raises(ValueError, match="not contiguous.*LBHNC"):
        _decode_call(c, md, lbnhc, out)
    assert torch.isnan(out).all()
    # the fp8 path ignores the NVFP4 scale tensors, as the engine does
    _decode_call(c, md, c.kv_cache, out, k_scale=torch.full((1,), 100.0), v_scale=None)
    _check(c, out)


# ----------------------------------------------------------------------------- msa_sparse_prefill
@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4"])
def test_oracle_agrees_with_the_reference(kv_dtype):
    """tests/engine_cases.oracle (used for prefill and the engine steps) against msa_jit's float64
    reference; NVFP4: the oracle on the dequantized cache, the reference on the NVFP4 bytes."""
    import engine_cases as ec
    from msa_jit.nvfp4 import dequantize_kv_nvfp4

    c = make_case(3, 2, 16, 1, q_dtype=FP8, seed=43, kv_dtype=kv_dtype)
    rows = [t // c.qlen for t in range(c.num_tokens)]
    pos = [int(c.seq_lens_cpu[t // c.qlen]) - c.qlen + t % c.qlen for t in range(c.num_tokens)]
    ref, _ = sparse_decode_reference(*c.reference_args(), **c.scales())
    kv, ks, vs = c.kv_cache, c.k_scale, c.v_scale
    if kv_dtype == "nvfp4":
        kv, ks, vs = torch.cat(dequantize_kv_nvfp4(kv, ks, vs), dim=-1), 1.0, 1.0
    mine = ec.oracle(c.query, kv, c.topk, c.block_table, rows, pos, sm_scale=c.sm_scale,
                     q_scale=c.q_scale, k_scale=ks, v_scale=vs)
    assert ref.norm() > 0
    torch.testing.assert_close(mine, ref.double(), rtol=1e-9, atol=1e-9)


def _prefill_run(device, prefills, chunk, hq, hkv, q_dtype, seed):
    import engine_cases as ec

    step = ec.make_step(num_decodes=0, decode_qlen=1, prefills=prefills, num_q_heads=hq,
                        num_kv_heads=hkv, seed=seed, device=device)
    T = step.num_tokens
    q = (step.query_fp8 if q_dtype == FP8 else step.query_bf16).view(T, hq, 128)
    out = torch.full((T, hq, 128), float("nan"), dtype=torch.bfloat16, device=device)
    cu = step.query_start_loc
    ctx = (step.seq_lens - (cu[1:] - cu[:-1])).to(torch.int32)
    engine.msa_sparse_prefill(
        q, step.kv_u8.view(FP8), step.topk_buffer[:T], out, block_table=step.block_table,
        cu_seqlens_q=cu, context_lens=ctx, page_size=128, scale=step.sm_scale,
        q_scale_float=step.q_scale if q_dtype == FP8 else 1.0, k_scale_float=step.k_scale,
        v_scale_float=step.v_scale, plan_cache=MSACutlassDecodePlanCache(), chunk_tokens=chunk)
    err = ec.relative_error(out, step.expected())
    assert err < 1e-2, err
    return step


@pytest.mark.parametrize("prefills,chunk,q_dtype", [
    ([(0, 9)], 4, FP8),                      # 4 + 4 + 1 (padded)
    ([(0, 3), (250, 8), (129, 5)], 8, FP8),  # chunks across requests, exact multiple of 8
    ([(0, 5), (1000, 2)], 16, torch.bfloat16),  # one padded chunk
])
def test_prefill_matches_the_oracle_cpu(prefills, chunk, q_dtype):
    _prefill_run("cpu", prefills, chunk, 16, 1, q_dtype, seed=44 + chunk)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(64, 4), (8, 1)])
def test_prefill_matches_the_oracle_gpu(hq, hkv):
    _prefill_run("cuda", [(0, 200), (3000, 70), (5, 33)], engine.PREFILL_CHUNK_TOKENS, hq, hkv, FP8, seed=45)


def test_prefill_reuses_one_plan_and_a_padded_tail_is_zero():
    """Tokens past cu_seqlens_q[-1] (a padded batch) get zeros; one plan serves every chunk."""
    c = make_case(1, 1, 16, 1, q_dtype=FP8, seed=46, ctx_lens=[300])
    n = 6
    q = c.query.expand(n, -1, -1).contiguous()
    topk = c.topk.expand(n, -1, -1).contiguous()
    out = torch.full((n, 16, 128), float("nan"), dtype=torch.bfloat16)
    cache = MSACutlassDecodePlanCache()
    cu = torch.tensor([0, 4], dtype=torch.int32)  # 4 real tokens, 2 of padding
    ctx = torch.tensor([296], dtype=torch.int32)
    engine.msa_sparse_prefill(q, c.kv_cache, topk, out, block_table=c.block_table, cu_seqlens_q=cu,
                              context_lens=ctx, page_size=128, scale=c.sm_scale, q_scale_float=c.q_scale,
                              k_scale_float=c.k_scale, v_scale_float=c.v_scale, plan_cache=cache,
                              chunk_tokens=4)
    assert len(cache.plans) == 1 and list(cache.plans)[0][:2] == (4, 1)
    assert torch.all(out[4:] == 0)
    _check(c, out[3:4])  # token 3 sits at position 299 = the decode token of the case


@pytest.mark.parametrize("change,err,match", [
    ({"chunk_tokens": 0}, ValueError, "chunk_tokens"),
    ({"cu_seqlens_q": torch.tensor([0, 2, 4], dtype=torch.int32)}, ValueError, "cu_seqlens_q"),
    ({"block_table": None}, TypeError, "block_table"),
    # each named as the argument it is, before anything is read or written
    ({"block_table": "int64"}, TypeError, "block_table: expected dtype int32"),
    ({"cu_seqlens_q": torch.tensor([1, 1], dtype=torch.int32)}, ValueError, "cu_seqlens_q: expected offsets from 0"),
    ({"context_lens": torch.tensor([-50], dtype=torch.int32)}, ValueError, "context_lens: expected lengths >= 0"),
    ({"context_lens": torch.tensor([3.0])}, TypeError, "context_lens: expected dtype int32"),
    ({"query": "2-D"}, ValueError, "query: expected a 3-D tensor"),
])
def test_prefill_rejects_bad_input(change, err, match):
    c = make_case(1, 1, 16, 1, q_dtype=FP8, seed=47)
    out = c.new_out()
    kw = dict(block_table=c.block_table, cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
              context_lens=c.seq_lens - 1, page_size=128, scale=c.sm_scale, q_scale_float=1.0,
              k_scale_float=1.0, v_scale_float=1.0)
    kw.update(change)
    query = c.query
    if kw["block_table"] == "int64":
        kw["block_table"] = c.block_table.long()
    if kw.pop("query", None) == "2-D":
        query = c.query[:, 0]
    with pytest.raises(err, match=match):
        engine.msa_sparse_prefill(query, c.kv_cache, c.topk, out, **kw)
    assert torch.isnan(out).all()


def test_prefill_rejects_decreasing_offsets():
    """Offsets that go back would make the tokens of the span between them read as padding (zeros)."""
    c = make_case(1, 1, 16, 1, q_dtype=FP8, seed=47, ctx_lens=[300])
    n = 7
    q, topk = c.query.expand(n, -1, -1).contiguous(), c.topk.expand(n, -1, -1).contiguous()
    out = torch.full((n, 16, 128), float("nan"), dtype=torch.bfloat16)
    bt = c.block_table.expand(2, -1).contiguous()
    with pytest.raises(ValueError, match="cu_seqlens_q: expected non-decreasing offsets"):
        engine.msa_sparse_prefill(q, c.kv_cache, topk, out, block_table=bt,
                                  cu_seqlens_q=torch.tensor([0, 6, 3], dtype=torch.int32),
                                  context_lens=torch.tensor([0, 200], dtype=torch.int32), page_size=128,
                                  scale=c.sm_scale, q_scale_float=1.0, k_scale_float=1.0, v_scale_float=1.0)
    assert torch.isnan(out).all()


def test_prefill_writes_nothing_when_a_later_chunk_fails():
    """A bad page id that only the last chunk's token selects (the reference checks values per
    chunk): the error comes after earlier chunks ran, and `output` must still be untouched."""
    c = make_case(1, 1, 16, 1, q_dtype=FP8, seed=48, ctx_lens=[300])
    n = 5
    q = c.query.expand(n, -1, -1).contiguous()
    topk = torch.full((n, 1, 16), -1, dtype=torch.int32)
    topk[:, 0, 0] = 1  # every token selects block 1 (positions 295..299 are in block 2: causal ok)
    topk[n - 1, 0, 1] = 0  # only the last token also selects block 0, whose page is out of range
    bt = c.block_table.clone()
    bt[0, 0] = 10**6
    out = torch.full((n, 16, 128), float("nan"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_table"):
        engine.msa_sparse_prefill(q, c.kv_cache, topk, out, block_table=bt,
                                  cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                                  context_lens=torch.tensor([295], dtype=torch.int32), page_size=128,
                                  scale=c.sm_scale, q_scale_float=c.q_scale, k_scale_float=c.k_scale,
                                  v_scale_float=c.v_scale, plan_cache=MSACutlassDecodePlanCache(),
                                  chunk_tokens=2)
    assert torch.isnan(out).all(), "rows of the chunks before the failing one were written"


@pytest.mark.parametrize("metadata", [None, "plan", 3])
def test_decode_names_a_wrong_metadata_type(metadata):
    c = make_case(2, 1, 16, 1, q_dtype=FP8, seed=49)
    md = prepare_decode_metadata(c.block_table, c.seq_lens, c.seq_lens_cpu, c.qlen,
                                 plan_cache=MSACutlassDecodePlanCache(), **c.prepare_kwargs())
    bad = md.plan if metadata == "plan" else metadata
    out = c.new_out()
    match = r"^metadata: expected MSACutlassDecodeMetadata" + (r".*wrap a plan" if metadata == "plan" else "")
    with pytest.raises(TypeError, match=match):
        _decode_call(c, bad, c.kv_cache, out)
    assert torch.isnan(out).all()


def test_prefill_padding_rows_read_nothing_on_a_reused_plan():
    """A prefill chunk's padded rows must have seq_len 0 even when an earlier call on the same plan
    cache left real rows there: here the earlier call's pages (>= 100, a larger cache) are out of
    range of this call's cache, so stale seq_lens make the reference fail (on a GPU: a read out of
    bounds)."""
    c = make_case(1, 1, 16, 1, q_dtype=FP8, seed=46, ctx_lens=[300])
    cache = MSACutlassDecodePlanCache()
    kw = dict(page_size=128, scale=c.sm_scale, q_scale_float=c.q_scale, k_scale_float=c.k_scale,
              v_scale_float=c.v_scale, plan_cache=cache, chunk_tokens=4)
    pad = torch.zeros(100, *c.kv_cache.shape[1:], dtype=c.kv_cache.dtype)
    n = 3
    out = torch.full((n, 16, 128), float("nan"), dtype=torch.bfloat16)
    engine.msa_sparse_prefill(c.query.expand(n, -1, -1).contiguous(), torch.cat([pad, c.kv_cache]),
                              c.topk.expand(n, -1, -1).contiguous(), out, block_table=c.block_table + 100,
                              cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                              context_lens=torch.tensor([297], dtype=torch.int32), **kw)
    _check(c, out[2:3])
    out = torch.full((1, 16, 128), float("nan"), dtype=torch.bfloat16)
    engine.msa_sparse_prefill(c.query, c.kv_cache, c.topk, out, block_table=c.block_table,
                              cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
                              context_lens=torch.tensor([299], dtype=torch.int32), **kw)
    _check(c, out)
