"""The op's fast path (msa_jit/op.py): the exported function's own argument checks plus the few
the op makes in Python reject every malformed input before anything is launched, errors still
name the argument (the full validation runs when the call fails), and the arguments are those
of the checked path (msa_jit/kernels/convention.py).

On a machine without CUDA the real exported function runs here on stand-in CUDA tensors
(`fake_cuda`: a CPU tensor's DLPack export with its device field set to CUDA), so its argument
checks run as they do on the GPU; a call that passes them fails at the CUDA driver (there is
none), which the stand-in records as a launch. The GPU tests at the end repeat the main cases
on the device with the warmed MiniMax-M3 kernels.
"""

from __future__ import annotations

import ctypes
import math
import re

import pytest
import torch
from helpers import FP8, make_case
from hypothesis import given
from hypothesis import strategies as st
from test_validation import (B, HKV, HQ, K, OP_MUTATIONS, PAGE, QLEN, SETTINGS, T, _same_bits, _snapshot)

from msa_jit import SparseDecodePlanner, op, sparse_decode
from msa_jit.kernels import convention

HAS_CUDA = torch.cuda.is_available()
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="stand-in CUDA tensors would be launched for real on a GPU")
conv = convention


# ----------------------------------------------------------------------------- stand-ins
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLTensorHead(ctypes.Structure):  # DLTensor's first fields: data, device
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
KDL_CUDA = 2


def fake_cuda(x: torch.Tensor, index: int = 0):
    """Stand-in for a CUDA tensor: x's DLPack export (same data pointer, shape, strides, dtype)
    claiming to live on cuda:index, as a TVM-FFI tensor. Only for argument checks: never launch."""
    import tvm_ffi

    capsule = torch.utils.dlpack.to_dlpack(x)
    head = _DLTensorHead.from_address(_capsule_pointer(capsule, b"dltensor"))
    head.device.device_type, head.device.device_id = KDL_CUDA, index
    return tvm_ffi.from_dlpack(capsule)


def _as_fake_cuda(a):
    import tvm_ffi

    if isinstance(a, torch.Tensor):
        return fake_cuda(a)
    if isinstance(a, tvm_ffi.Tensor):  # the plan's own tensors, wrapped once (CPU here)
        return fake_cuda(torch.from_dlpack(a))
    return a


class StandInKernel:
    """The real exported function called on stand-in CUDA tensors. `launched`: calls that passed
    every argument check (the driver then failed: no GPU); `rejected`: the function's own
    ValueError / TypeError (nothing launched)."""

    def __init__(self, fn):
        self.fn, self.launched, self.rejected = fn, 0, []

    def __call__(self, *args):
        try:
            self.fn(*[_as_fake_cuda(a) for a in args])
        except (ValueError, TypeError) as e:
            self.rejected.append(e)
            raise
        except RuntimeError as e:
            assert "cuda" in str(e).lower(), e  # the launch reached the (absent) driver
            self.launched += 1
            raise


class Recorder:
    """Stand-in kernel that records its arguments (argument-order checks)."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(query dtype, cache format) -> the real exported function for the test_validation geometry
    (Hq 4, Hkv 2, page 64, topk 4; sm_90a, 2 CTAs per SM), compiled here."""
    pytest.importorskip("cutlass")
    from msa_jit.jit.compiler import compile_sparse_decode
    from msa_jit.geometry import SparseDecodeConfig
    from msa_jit.jit.loader import load_artifact

    fns = {}
    for q, kv in (("bfloat16", "float8_e4m3fn"), ("float8_e4m3fn", "float8_e4m3fn"), ("bfloat16", "nvfp4")):
        cfg = SparseDecodeConfig(num_q_heads=HQ, num_kv_heads=HKV, page_size=PAGE, topk_blocks=K, q_dtype=q,
                                 kv_dtype=kv, arch="sm_90a", ctas_per_sm=2)
        d = tmp_path_factory.mktemp(f"{q}-{kv}")
        compile_sparse_decode(cfg, d)
        fns[(q, kv)] = load_artifact(d / conv.ARTIFACT_NAME)[0]
    return fns


def _kernel_plan(exported=None, *, batch=B, qlen=QLEN, seed=0, kernel=None):
    """A CPU plan that takes the kernel path: is_cuda set, the stand-in kernels in plan.kernels."""
    c = make_case(batch, qlen, HQ, HKV, q_dtype=torch.bfloat16, seed=seed, device="cpu",
                  ctx_lens=[70, 130, 30][:batch], page_size=PAGE, topk_blocks=K)
    plan = SparseDecodePlanner(arch="sm_90a", ctas_per_sm=2).prepare(*c.prepare_args(), **c.prepare_kwargs())
    plan.is_cuda = True  # stand-in: the fast path only runs on CUDA plans
    dtypes = {"bfloat16": torch.bfloat16, "float8_e4m3fn": FP8}
    if exported is not None:
        for (q, kv), fn in exported.items():
            plan.kernels[(dtypes[q], kv)] = StandInKernel(fn)
    if kernel is not None:
        for q in dtypes.values():
            for kv in ("float8_e4m3fn", "nvfp4"):
                plan.kernels[(q, kv)] = kernel
    plan.kernel_tensors()
    return c, plan


def _op_args(c, plan):
    return dict(query=c.query, kv_cache=c.kv_cache, topk=c.topk, out=c.new_out(), plan=plan,
                lse=c.new_lse(), backend="kernel", **c.scales())


def _launches(plan):
    return sum(k.launched for k in set(plan.kernels.values()) if isinstance(k, StandInKernel))


def _call(a):
    a = dict(a)
    args = (a.pop("query"), a.pop("kv_cache"), a.pop("topk"), a.pop("out"), a.pop("plan"))
    sparse_decode(*args, **a)


# ----------------------------------------------------------------------------- CPU: real wrapper
@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("variant", ["bf16", "fp8_query", "u8_cache", "transposed_topk", "nvfp4"])
def test_valid_calls_take_the_fast_path_and_pass_the_wrapper(exported, variant, with_lse, monkeypatch):
    c, plan = _kernel_plan(exported)
    a = _op_args(c, plan)
    if variant == "fp8_query":
        a["query"] = c.query.to(FP8)
    if variant == "u8_cache":
        a["kv_cache"] = c.kv_cache.view(torch.uint8)
    if variant == "transposed_topk":
        a["topk"] = c.topk.transpose(0, 1).contiguous().transpose(0, 1)
    if variant == "nvfp4":
        n = make_case(B, QLEN, HQ, HKV, q_dtype=torch.bfloat16, seed=0, device="cpu", ctx_lens=[70, 130],
                      page_size=PAGE, topk_blocks=K, kv_dtype="nvfp4")
        a["kv_cache"] = n.kv_cache
    if not with_lse:
        a["lse"] = None
    checked = []
    monkeypatch.setattr(op, "_checked_sparse_decode", lambda *x, **k: checked.append(1))
    with pytest.raises(RuntimeError, match="(?i)cuda"):
        _call(a)  # passed every argument check, then reached the (absent) driver
    assert _launches(plan) == 1 and not checked
    assert not any(k.rejected for k in plan.kernels.values())


# "kernel" is a valid backend on this plan; a compact out / lse overlapping another argument passes
# the exported function's checks (the fast path leaves it to the checked path, op.py says why:
# test_outputs_sharing_memory_are_refused_on_the_checked_path below)
MUTATED = [n for n in OP_MUTATIONS if n not in ("backend", "out ", "lse ")]


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("name", MUTATED)
@SETTINGS
@given(data=st.data())
def test_malformed_calls_are_named_and_never_launched(exported, name, data):
    """Every malformed input of test_validation, on a kernel-path plan: the named error of the
    full validation, out / lse untouched, and no call passed the exported function's checks."""
    c, plan = _kernel_plan(exported)
    a = _op_args(c, plan)
    change, exc = OP_MUTATIONS[name](data, dict(a))
    plans = [plan]
    if name == "query ":  # a plan of another batch: give it the kernels too
        change = dict(plan=_kernel_plan(exported, batch=3, qlen=1, seed=1)[1])
        plans.append(change["plan"])
    a.update(change)
    if data.draw(st.booleans(), label="drop lse") and name != "lse":
        a["lse"] = None
    out0, lse0 = _snapshot(a["out"]), _snapshot(a["lse"])
    with pytest.raises((ValueError, TypeError)) as ei:
        _call(a)
    assert str(ei.value).startswith(name.strip() + ": "), str(ei.value)  # names it first
    assert isinstance(ei.value, exc), f"{type(ei.value).__name__}: {ei.value}"
    assert _same_bits(out0, a["out"]) and _same_bits(lse0, a["lse"])
    assert sum(map(_launches, plans)) == 0, f"{name}: a malformed call passed the exported function's checks"


def _gap_cases(c):
    """Inputs the exported function alone would take (or take differently): the op checks them."""
    import tvm_ffi

    kv = c.kv_cache
    return [
        ("topk", dict(topk=c.topk.view(torch.uint32)), TypeError),  # the function takes uint32 for int32
        ("kv_cache", dict(kv_cache=kv.view(torch.int8)), TypeError),  # ... and int8 for uint8
        ("kv_cache", dict(kv_cache=kv.view(torch.uint8)[:0]), ValueError),  # P is a free symbol there
        ("kv_cache", dict(kv_cache=torch.zeros(kv.shape[0], HKV, PAGE, 128, dtype=torch.bfloat16)), TypeError),
        ("out", dict(out=tvm_ffi.from_dlpack(c.new_out())), TypeError),  # any DLPack producer
        ("lse", dict(lse=tvm_ffi.from_dlpack(c.new_lse())), TypeError),
        ("query", dict(query=tvm_ffi.from_dlpack(c.query)), TypeError),
        ("query", dict(query=c.query.view(torch.int16)), TypeError),
        ("sm_scale", dict(sm_scale=math.nan), ValueError),
        ("v_scale", dict(v_scale=-1.0), ValueError),
    ]


@cpu_only
@pytest.mark.slow
def test_what_the_wrapper_does_not_check_the_op_does(exported):
    c, plan = _kernel_plan(exported)
    for name, change, exc in _gap_cases(c):
        a = dict(_op_args(c, plan), **change)
        out0 = _snapshot(a["out"]) if isinstance(a["out"], torch.Tensor) else None
        with pytest.raises(exc, match=rf"^{re.escape(name)}: "):
            _call(a)
        if out0 is not None:
            assert _same_bits(out0, a["out"])
    assert _launches(plan) == 0


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("which", ["out", "lse"])
def test_a_zero_stride_output_never_reaches_a_launch(exported, which):
    """What op.py's fast path relies on to skip the memory-sharing checks: an expand()ed out / lse
    fails the exported function's own stride checks (no kernel races on one location), and the
    full validation then names it."""
    c, plan = _kernel_plan(exported)
    a = _op_args(c, plan)
    a[which] = (torch.full((1, HQ, 128), math.nan, dtype=torch.bfloat16).expand(T, HQ, 128) if which == "out"
                else torch.full((1, HQ), math.nan).expand(T, HQ))
    out0, lse0 = _snapshot(a["out"]), _snapshot(a["lse"])
    with pytest.raises(ValueError, match=rf"^{which}: has zero stride"):
        _call(a)
    assert _same_bits(out0, a["out"]) and _same_bits(lse0, a["lse"])
    kernel = plan.kernels[(torch.bfloat16, "float8_e4m3fn")]
    assert len(kernel.rejected) == 1 and _launches(plan) == 0


@cpu_only
@pytest.mark.slow
def test_the_wrapper_checks_devices_and_binds_dims_across_tensors(exported):
    """What the fast path leaves to the exported function, shown on it directly: the device index
    and each symbolic dim (T here) must agree across all tensors, the plan's included."""
    c, plan = _kernel_plan(exported)
    fn = exported[("bfloat16", "float8_e4m3fn")]
    args = [_as_fake_cuda(x) for x in conv.call_arguments(plan, c.query, c.kv_cache, c.topk, c.new_out(),
                                                          None, None, None, 1.0, 1.0)]
    with pytest.raises(RuntimeError, match="(?i)cuda"):
        fn(*args)  # all good: reaches the driver
    names = list(conv.ARGUMENT_NAMES)
    for name, bad in [("topk", fake_cuda(c.topk, index=1)),  # another GPU than query's
                      ("kv_lens", fake_cuda(torch.zeros(T + 1, dtype=torch.int32))),  # another T
                      ("out", fake_cuda(torch.zeros(T, HQ, 128, dtype=torch.bfloat16)[:, :, :64])),
                      ("query", fake_cuda(torch.zeros(T * HQ * 128 + 1, dtype=torch.bfloat16)[1:].view(T, HQ, 128)))]:
        bad_args = list(args)
        bad_args[names.index(name)] = bad
        with pytest.raises((ValueError, TypeError), match=name):
            fn(*bad_args)


# ----------------------------------------------------------------------------- CPU: stand-in kernels
def test_fast_path_passes_the_convention_arguments():
    """The fast path's positional call and convention.call_arguments (the checked path) agree,
    for every dtype / cache / lse / scale form the fast path takes."""
    rec = Recorder()
    c, plan = _kernel_plan(kernel=rec)
    out, lse = c.new_out(), c.new_lse()
    for query in (c.query, c.query.to(FP8)):
        for kv in (c.kv_cache, c.kv_cache.view(torch.uint8)):
            for l in (None, lse):
                sparse_decode(query, kv, c.topk, out, plan, sm_scale=0.3, q_scale=1.5, k_scale=0.5,
                              v_scale=2.0, lse=l, backend="auto")
                want = conv.call_arguments(plan, query, kv, c.topk, out, l, None, None,
                                           0.3 * 1.5 * 0.5 * op.LOG2E, 2.0)
                got = rec.calls.pop()
                assert len(got) == len(want) == len(conv.ARGUMENTS)
                for name, g, w in zip(conv.ARGUMENT_NAMES, got, want):
                    if isinstance(w, torch.Tensor) and g is not w:  # the uint8 views of fp8 tensors
                        assert (g.dtype, g.shape, g.stride(), g.data_ptr()) == (
                            w.dtype, w.shape, w.stride(), w.data_ptr()), name
                    else:
                        assert g is w or g == w, (name, g, w)


def test_an_nvfp4_cache_goes_to_the_kernel_with_its_own_split_count(monkeypatch):
    """A step whose cache formats split differently (64/4 B=12 on 132 SMs: fp8 in 2, NVFP4 in 6): an
    NVFP4 cache reaches the kernel as uint8 with NVFP4's count, from the fast path and from
    convention.call_arguments (the checked path's) alike."""
    rec = Recorder()
    c = make_case(12, 1, 64, 4, q_dtype=torch.bfloat16, seed=3, device="cpu", kv_dtype="nvfp4")
    plan = SparseDecodePlanner(num_sms=132, arch="sm_90a", ctas_per_sm=2).prepare(*c.prepare_args(),
                                                                                 **c.prepare_kwargs())
    assert (plan.launch().num_splits, plan.launch("nvfp4").num_splits) == (2, 6)
    plan.is_cuda = True  # stand-in: the fast path only runs on CUDA plans
    plan.kernels[(torch.bfloat16, "nvfp4")] = rec
    plan.kernel_tensors()
    monkeypatch.setattr(op, "_checked_sparse_decode", None)  # the call below must take the fast path
    sparse_decode(c.query, c.kv_cache, c.topk, c.new_out(), plan, sm_scale=0.3, k_scale=0.5, v_scale=2.0,
                  backend="kernel")
    checked = conv.call_arguments(plan, c.query, c.kv_cache, c.topk, c.new_out(), None, None, None, 1.0, 2.0)
    kv_at, splits_at = conv.ARGUMENT_NAMES.index("kv_cache"), conv.ARGUMENT_NAMES.index("num_splits")
    for args in (rec.calls.pop(), checked):
        assert args[kv_at] is c.kv_cache and args[splits_at] == plan.launch("nvfp4").num_splits


@pytest.mark.parametrize("name", ["out ", "lse "])
@SETTINGS
@given(data=st.data())
def test_outputs_sharing_memory_are_refused_on_the_checked_path(name, data):
    """out / lse sharing memory with another argument, on a kernel-path plan's checked path (its
    first call: the kernel not resolved yet): the named ValueError before the kernel is resolved
    or called, out / lse untouched. A zero-stride out / lse never passes the exported function
    (test_malformed_calls_are_named_and_never_launched)."""
    rec = Recorder()
    c, plan = _kernel_plan(kernel=rec)
    plan.kernels.clear()
    resolved = []
    plan.resolve_kernel = lambda q, kv: resolved.append(1) or rec
    a = _op_args(c, plan)
    change, exc = OP_MUTATIONS[name](data, dict(a))
    a.update(change)
    out0, lse0 = _snapshot(a["out"]), _snapshot(a["lse"])
    with pytest.raises(exc, match=rf"^{name.strip()}: overlaps the memory of "):
        _call(a)
    assert _same_bits(out0, a["out"]) and _same_bits(lse0, a["lse"])
    assert not resolved and not rec.calls


def test_fast_path_declines_what_only_the_checked_path_handles(monkeypatch):
    """Valid inputs the fast path leaves alone: ints and CPU tensors as scales, a kernel not
    resolved yet (tensor subclasses too: on the GPU, below). They go through the checked path
    (once, no launch before it)."""
    rec = Recorder()
    c, plan = _kernel_plan(kernel=rec)
    seen = []
    real = op._checked_sparse_decode
    monkeypatch.setattr(op, "_checked_sparse_decode", lambda *a, **k: (seen.append(1), real(*a, **k)))
    out = c.new_out()
    for kw in (dict(sm_scale=1), dict(sm_scale=0.5, q_scale=2), dict(sm_scale=0.5, k_scale=torch.tensor([0.5])),
               dict(sm_scale=0.5, v_scale=torch.tensor(2.0))):
        sparse_decode(c.query, c.kv_cache, c.topk, out, plan, backend="kernel", **kw)
        assert len(seen) == 1 and len(rec.calls) == 1, kw
        seen.clear()
        rec.calls.clear()
    plan.kernels.clear()  # first call of a plan: the checked path resolves the kernel
    monkeypatch.setattr(plan, "resolve_kernel", lambda q, kv: rec)
    sparse_decode(c.query, c.kv_cache, c.topk, out, plan, sm_scale=0.5)
    assert len(seen) == 1 and len(rec.calls) == 1


def test_scale_views_are_made_once_and_follow_their_tensor(monkeypatch):
    """A 0-dim scale's [1] view is made on its first call and reused; an in-place write shows
    through it, a storage swap (`t.data = ...`) makes a new one; the cache stays bounded."""
    monkeypatch.setattr(op, "_SCALE_VIEWS", {})
    s = torch.tensor(0.5)
    v1 = op._scale_view(s)
    assert op._scale_view(s) is v1 and v1.shape == (1,) and v1.item() == 0.5
    s.fill_(2.0)
    assert op._scale_view(s) is v1 and v1.item() == 2.0
    s.data = torch.tensor(3.0)
    v2 = op._scale_view(s)
    assert v2 is not v1 and v2.item() == 3.0 and op._scale_view(s) is v2
    monkeypatch.setattr(op, "_SCALE_VIEWS_MAX", 4)
    fresh = [torch.tensor(float(i)) for i in range(10)]  # a new tensor per call
    assert [op._scale_view(t).item() for t in fresh] == [float(i) for i in range(10)]
    assert len(op._SCALE_VIEWS) <= 4


def test_a_launch_error_is_raised_once_not_retried():
    """A failure of a valid call (here: the launch) comes back as it is, after the validation found
    nothing: the kernel is not called a second time."""
    calls = []

    def failing(*args):
        calls.append(args)
        raise RuntimeError("CUDA error: launch failed (stand-in)")

    c, plan = _kernel_plan(kernel=failing)
    with pytest.raises(RuntimeError, match="stand-in"):
        sparse_decode(c.query, c.kv_cache, c.topk, c.new_out(), plan, sm_scale=0.5)
    assert len(calls) == 1


def test_an_error_of_the_call_is_named_by_the_validation():
    """When the exported function rejects an argument, the op's error is the full validation's
    (named, without the function's traceback chained to it)."""
    def rejecting(*args):
        raise ValueError("Mismatched out.shape[0] on argument #5 (stand-in)")

    c, plan = _kernel_plan(kernel=rejecting)
    bad_out = torch.zeros(T + 1, HQ, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^out: ") as ei:
        sparse_decode(c.query, c.kv_cache, c.topk, bad_out, plan, sm_scale=0.5)
    assert ei.value.__context__ is None and not bad_out.any()


# ----------------------------------------------------------------------------- GPU
def _gpu_case(kv_dtype="fp8", q_dtype=torch.bfloat16, batch=3, qlen=2):
    return make_case(batch, qlen, 64, 4, q_dtype=q_dtype, seed=5, device="cuda", kv_dtype=kv_dtype)


def _gpu_mutations(c):
    """(argument, changes, error type) of malformed CUDA calls; each must be named, nothing written."""
    q, kv, tk, T_ = c.query, c.kv_cache, c.topk, c.num_tokens
    dev = q.device
    cases = [
        ("query", dict(query=q.float()), TypeError),
        ("query", dict(query=q.cpu()), ValueError),
        ("query", dict(query=q[:-1]), ValueError),
        ("query", dict(query=torch.zeros(T_, 64, 256, dtype=q.dtype, device=dev)[..., :128]), ValueError),
        ("query", dict(query=torch.zeros(T_ * 64 * 128 + 1, dtype=q.dtype, device=dev)[1:].view(T_, 64, 128)),
         ValueError),
        ("kv_cache", dict(kv_cache=kv.view(torch.int8)), TypeError),
        ("kv_cache", dict(kv_cache=kv[:0]), ValueError),
        ("kv_cache", dict(kv_cache=kv.cpu()), ValueError),
        ("kv_cache", dict(kv_cache=kv[:, :, :64]), ValueError),
        ("topk", dict(topk=tk.view(torch.uint32)), TypeError),
        ("topk", dict(topk=tk.long()), TypeError),
        ("topk", dict(topk=tk[:-1]), ValueError),
        ("topk", dict(topk=tk.cpu()), ValueError),
        ("out", dict(out=torch.zeros(T_, 64, 128, dtype=torch.float16, device=dev)), TypeError),
        ("out", dict(out=torch.zeros(64, T_, 128, dtype=torch.bfloat16, device=dev).transpose(0, 1)), ValueError),
        ("out", dict(out=torch.zeros(T_, 64, 128, dtype=torch.bfloat16)), ValueError),
        ("lse", dict(lse=torch.zeros(T_, 63, device=dev)), ValueError),
        ("lse", dict(lse=torch.zeros(64, T_, device=dev).t()), ValueError),
        ("lse", dict(lse=torch.zeros(T_, 64)), ValueError),
        ("k_scale", dict(k_scale=torch.ones(2, device=dev)), TypeError),
        ("v_scale", dict(v_scale=torch.ones(1, dtype=torch.float16, device=dev)), TypeError),
        ("sm_scale", dict(sm_scale=-0.1), ValueError),
    ]
    if c.kv_dtype == "fp8":
        cases.append(("kv_cache", dict(kv_cache=torch.zeros(kv.shape[0], 4, 128, 128, dtype=torch.bfloat16,
                                                            device=dev)), TypeError))
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4"])
def test_gpu_malformed_calls_are_named_and_write_nothing(kv_dtype):
    c = _gpu_case(kv_dtype)
    plan = SparseDecodePlanner().prepare(*c.prepare_args(), **c.prepare_kwargs())
    good = dict(query=c.query, kv_cache=c.kv_cache, topk=c.topk, out=c.new_out(), lse=c.new_lse(), **c.scales())
    sparse_decode(plan=plan, **good)  # resolves the kernel: every call below takes the fast path first
    for name, change, exc in _gpu_mutations(c):
        a = dict(good, out=torch.full_like(c.new_out(), math.nan), lse=torch.full_like(c.new_lse(), math.nan))
        a.update(change)
        out0, lse0 = _snapshot(a["out"]), _snapshot(a["lse"])
        with pytest.raises(exc, match=rf"^{re.escape(name)}: "):
            sparse_decode(plan=plan, **a)
        torch.cuda.synchronize()
        assert _same_bits(out0, a["out"]) and _same_bits(lse0, a["lse"]), f"{name}: written although rejected"


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_gpu_fast_path_equals_the_checked_path(kv_dtype, q_dtype):
    """Bitwise the same output and lse through both paths, scales as floats and as device tensors
    (0-dim and [1], as vLLM passes NVFP4 global scales)."""
    c = _gpu_case(kv_dtype, q_dtype)
    plan = SparseDecodePlanner().prepare(*c.prepare_args(), **c.prepare_kwargs())
    scale_forms = [c.scales()]
    t = c.scales(scale_tensors=True)
    if isinstance(t.get("k_scale"), torch.Tensor):  # 0-dim, and as [1]
        scale_forms += [t, dict(t, k_scale=t["k_scale"].reshape(1), v_scale=t["v_scale"].reshape(1))]
    for kv in (c.kv_cache, c.kv_cache.view(torch.uint8)):
        for scales in scale_forms:
            outs = []
            for path in (op._checked_sparse_decode, sparse_decode, sparse_decode):
                out, lse = torch.full_like(c.new_out(), math.nan), torch.full_like(c.new_lse(), math.nan)
                path(c.query, kv, c.topk, out, plan, lse=lse, backend="kernel", **scales)
                outs.append((out, lse))
            torch.cuda.synchronize()
            for out, lse in outs[1:]:
                assert _same_bits(outs[0][0], out) and _same_bits(outs[0][1], lse)
            assert not outs[0][0].isnan().any() and not outs[0][1].isnan().any()


@pytest.mark.gpu
def test_gpu_cached_scale_views_follow_writes_and_swaps():
    """0-dim device scales (vLLM's `_k_scale` / `_v_scale`) are viewed once; the fast path still
    sees a new value written in place and a new storage, bitwise as the checked path does."""
    c = _gpu_case("nvfp4")
    plan = SparseDecodePlanner().prepare(*c.prepare_args(), **c.prepare_kwargs())
    t = c.scales(scale_tensors=True)

    def run(path):
        out, lse = torch.full_like(c.new_out(), math.nan), torch.full_like(c.new_lse(), math.nan)
        path(c.query, c.kv_cache, c.topk, out, plan, lse=lse, backend="kernel", **t)
        torch.cuda.synchronize()
        return out, lse

    first = run(sparse_decode)
    t["v_scale"].mul_(2.0)  # in place: the cached view reads it
    second = run(sparse_decode)
    assert not _same_bits(first[0], second[0])
    want = run(op._checked_sparse_decode)
    assert _same_bits(want[0], second[0]) and _same_bits(want[1], second[1])
    t["k_scale"].data = t["k_scale"] * 0.5  # a new storage under the same tensor object
    third = run(sparse_decode)
    want = run(op._checked_sparse_decode)
    assert not _same_bits(second[1], third[1])
    assert _same_bits(want[0], third[0]) and _same_bits(want[1], third[1])


@pytest.mark.gpu
def test_gpu_fast_path_runs_on_the_current_stream():
    """The kernels go to torch's current stream (TVM-FFI takes it from the first CUDA tensor):
    on a side stream held back by a long copy, out stays unwritten until that stream runs."""
    c = _gpu_case()
    plan = SparseDecodePlanner().prepare(*c.prepare_args(), **c.prepare_kwargs())
    sparse_decode(c.query, c.kv_cache, c.topk, c.new_out(), plan, **c.scales())
    ref = c.new_out()
    sparse_decode(c.query, c.kv_cache, c.topk, ref, plan, **c.scales())
    side = torch.cuda.Stream()
    big = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    out = torch.full_like(ref, math.nan)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for _ in range(20):
            big.add_(1)  # ~tens of ms of work queued ahead on the side stream
        sparse_decode(c.query, c.kv_cache, c.topk, out, plan, **c.scales())
    assert out.isnan().all().item()  # read on the default stream: the side stream is still copying
    side.synchronize()
    assert not ref.isnan().any()  # a poison left in both would compare equal
    assert _same_bits(ref, out)


class _Sub(torch.Tensor):
    pass


@pytest.mark.gpu
def test_gpu_declined_calls_give_the_same_result():
    """Ints as scales, CPU tensors as scales and tensor subclasses take the checked path: same bits."""
    c = _gpu_case()
    plan = SparseDecodePlanner().prepare(*c.prepare_args(), **c.prepare_kwargs())
    s = c.scales()
    ref = torch.full_like(c.new_out(), math.nan)
    sparse_decode(c.query, c.kv_cache, c.topk, ref, plan, **s)
    torch.cuda.synchronize()
    assert not ref.isnan().any()  # a poison left in both would compare equal
    # the CPU tensors hold the same numbers (float64: a float32 tensor would round k_scale, and a build that scales S
    # in fp32, as the fp8 cluster build does, then gives other bits for another number)
    f64 = torch.float64
    for change in (dict(q_scale=torch.tensor(s["q_scale"], dtype=f64)),
                   dict(k_scale=torch.tensor([s["k_scale"]], dtype=f64)),
                   dict(out=torch.full_like(ref, math.nan).as_subclass(_Sub)),
                   dict(topk=c.topk.as_subclass(_Sub))):
        a = dict(query=c.query, kv_cache=c.kv_cache, topk=c.topk, out=torch.full_like(ref, math.nan), **s)
        a.update(change)
        sparse_decode(plan=plan, **a)
        torch.cuda.synchronize()
        assert _same_bits(ref, a["out"].as_subclass(torch.Tensor)), change


def _steady_state_counts(step, steps: int = 3) -> tuple[int, int]:
    """(device allocations, segments) torch's caching allocator made over `steps` calls of `step`
    after a first call (kernel load, plan build, scale views), with torch's sync debug mode set to
    raise on any synchronizing call."""
    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    after = torch.cuda.memory_stats()
    torch.cuda.synchronize()
    return tuple(after[k] - before[k] for k in ("allocation.all.allocated", "segment.all.allocated"))


# (batch, qlen, planner pin): batch 1 is a split step (the cluster merge on sm_90a), B=3 qlen 2 the
# one-split grid of the tests above, B=64 qlen 4 the union kernel's spec-decode point
_STEADY_SHAPES = [(1, 1, {}), (3, 2, {}), (64, 4, {"kernel": "union"})]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4"])
@pytest.mark.parametrize("batch,qlen,pin", _STEADY_SHAPES, ids=["split", "one-split", "union"])
def test_gpu_steady_state_steps_allocate_and_sync_nothing(kv_dtype, batch, qlen, pin):
    """One step as the engine runs it (a cached prepare, then the op once per layer, into the same
    out / lse) allocates no device memory and makes no synchronizing call, through the public op
    and through vLLM's adapter: the hot path of the design card's rule. The union kernel serves fp8
    caches only."""
    from msa_jit.integrations.engine import (MSACutlassDecodeMetadata, MSACutlassDecodePlanCache, msa_cutlass_sparse_decode)

    if pin and kv_dtype != "fp8":
        pytest.skip("the union kernel reads fp8 caches only")
    # the probe itself sees an allocation per step and refuses a synchronizing call
    assert _steady_state_counts(lambda: torch.empty(256, device="cuda"))[0] == 3
    with pytest.raises(RuntimeError, match="synchroniz"):
        _steady_state_counts(lambda: torch.ones(1, device="cuda").item())
    c = make_case(batch, qlen, 64, 4, q_dtype=torch.bfloat16, seed=11, device="cuda", kv_dtype=kv_dtype)
    planner = SparseDecodePlanner(**pin)
    out, lse = c.new_out(), c.new_lse()
    scales = c.scales(scale_tensors=kv_dtype == "nvfp4")

    def public_step():
        plan = planner.prepare(*c.prepare_args(), **c.prepare_kwargs())
        for _ in range(2):
            sparse_decode(c.query, c.kv_cache, c.topk, out, plan, lse=lse, **scales)

    # vLLM passes an NVFP4 cache's global scales as device tensors, an fp8 cache's as floats only
    device_scales = {k: scales[k] for k in ("k_scale", "v_scale")} if kv_dtype == "nvfp4" else {}
    cache = MSACutlassDecodePlanCache()
    cache._planner = planner  # the adapter's own planner, pinned as above

    def engine_step():
        md = cache.prepare(*c.prepare_args(), **c.prepare_kwargs())
        assert isinstance(md, MSACutlassDecodeMetadata)
        for _ in range(2):
            msa_cutlass_sparse_decode(c.query, c.kv_cache, c.topk, out, md, scale=c.sm_scale,
                                      q_scale_float=c.q_scale, k_scale_float=c.k_scale,
                                      v_scale_float=c.v_scale, **device_scales)

    for name, step, written in (("sparse_decode", public_step, (out, lse)),
                                ("msa_cutlass_sparse_decode", engine_step, (out,))):
        out.fill_(math.nan)
        lse.fill_(math.nan)
        assert _steady_state_counts(step) == (0, 0), f"{name}: the steady-state step allocated"
        torch.cuda.synchronize()
        assert not any(t.isnan().any() for t in written), f"{name}: not written"
