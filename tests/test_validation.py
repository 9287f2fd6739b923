"""Malformed inputs to prepare / sparse_decode: a ValueError or TypeError naming the argument,
and nothing written to out / lse."""

from __future__ import annotations

import functools
import math
import re

import numpy as np
import pytest
import torch
from helpers import FP8, make_case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from msa_jit import SparseDecodePlanner, sparse_decode, supports
from msa_jit.geometry import SparseDecodeConfig, check_config
from msa_jit.validation import _prepare_tensors_ok, kernel_call_ok, validate_prepare_tensors

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# base geometry: batch 2, qlen 2 (T = 4), Hq 4, Hkv 2 (G = 2), page 64, topk 4
B, QLEN, T, HQ, HKV, PAGE, K = 2, 2, 4, 4, 2, 64, 4


@functools.lru_cache(maxsize=None)
def base():
    c = make_case(B, QLEN, HQ, HKV, q_dtype=torch.bfloat16, seed=0, device="cpu",
                  ctx_lens=[70, 130], page_size=PAGE, topk_blocks=K)
    plan = SparseDecodePlanner().prepare(*c.prepare_args(), **c.prepare_kwargs())
    return c, plan


def _bad_dtype(data, allowed, pool=(torch.float32, torch.float16, torch.int64, torch.int32,
                                    torch.int16, torch.uint8, torch.bfloat16, torch.float64)):
    return data.draw(st.sampled_from([d for d in pool if d not in allowed]))


def _other_int(data, good, lo=0, hi=40):
    return data.draw(st.integers(lo, hi).filter(lambda v: v != good))


def _noncontig_last(shape, dtype):
    """A tensor of `shape` whose innermost stride is 2 or 3."""
    step = 2 + (sum(shape) % 2)
    return torch.zeros(*shape[:-1], shape[-1] * step, dtype=dtype)[..., ::step]


# ----------------------------------------------------------------------------- prepare
PREPARE_FIELDS = ("block_table", "seq_lens", "seq_lens_cpu", "decode_query_len",
                  "num_q_heads", "num_kv_heads", "page_size", "topk_blocks")


def _prepare_base():
    c, _ = base()
    return dict(block_table=c.block_table, seq_lens=c.seq_lens, seq_lens_cpu=c.seq_lens_cpu,
                decode_query_len=QLEN, num_q_heads=HQ, num_kv_heads=HKV, page_size=PAGE, topk_blocks=K)


def _call_prepare(planner, a):
    return planner.prepare(a["block_table"], a["seq_lens"], a["seq_lens_cpu"], a["decode_query_len"],
                           num_q_heads=a["num_q_heads"], num_kv_heads=a["num_kv_heads"],
                           page_size=a["page_size"], topk_blocks=a["topk_blocks"])


def _p_block_table(data, a):
    bt = a["block_table"]
    kind = data.draw(st.sampled_from(["dtype", "rows", "ndim", "stride", "type", "empty"]))
    if kind == "dtype":
        return dict(block_table=bt.to(_bad_dtype(data, (torch.int32,)))), TypeError
    if kind == "rows":
        return dict(block_table=torch.zeros(_other_int(data, B, 0, 6), bt.shape[1], dtype=torch.int32)), ValueError
    if kind == "ndim":
        return dict(block_table=data.draw(st.sampled_from([bt.reshape(-1), bt[None], bt[..., None]]))), ValueError
    if kind == "stride":
        return dict(block_table=_noncontig_last(tuple(bt.shape), torch.int32)), ValueError
    if kind == "empty":
        return dict(block_table=torch.zeros(B, 0, dtype=torch.int32)), ValueError
    return dict(block_table=bt.tolist()), TypeError


def _p_seq_lens(data, a):
    sl = a["seq_lens"]
    kind = data.draw(st.sampled_from(["dtype", "ndim", "noncontig", "batch", "empty", "type"]))
    if kind == "dtype":
        return dict(seq_lens=sl.to(_bad_dtype(data, (torch.int32,)))), TypeError
    if kind == "ndim":
        return dict(seq_lens=data.draw(st.sampled_from([sl[None], sl[:, None], sl[0]]))), ValueError
    if kind == "noncontig":
        return dict(seq_lens=torch.zeros(2 * B, dtype=torch.int32)[::2]), ValueError
    if kind == "batch":
        n = _other_int(data, B, 1, 6)
        return dict(seq_lens=torch.full((n,), 70, dtype=torch.int32),
                    seq_lens_cpu=torch.full((n,), 70, dtype=torch.int32)), ValueError
    if kind == "empty":
        return dict(seq_lens=torch.zeros(0, dtype=torch.int32)), ValueError
    return dict(seq_lens=sl.tolist()), TypeError


def _p_seq_lens_cpu(data, a):
    s = a["seq_lens_cpu"]
    kind = data.draw(st.sampled_from(["dtype", "shape", "type", "negative"]))
    if kind == "dtype":
        return dict(seq_lens_cpu=s.to(_bad_dtype(data, (torch.int32, torch.int64)))), TypeError
    if kind == "shape":
        n = _other_int(data, B, 0, 6)
        return dict(seq_lens_cpu=torch.full((n,), 10, dtype=torch.int32)), ValueError
    if kind == "negative":  # value check on first build (fresh planner)
        return dict(seq_lens_cpu=torch.tensor([-data.draw(st.integers(1, 100)), 5], dtype=torch.int32)), ValueError
    return dict(seq_lens_cpu=s.tolist()), TypeError


# ints past any range (also past int64 and float) and int-like values of other types, for every int argument
_OUT_OF_RANGE_INTS = st.integers(min_value=2 ** 63) | st.integers(max_value=-(2 ** 63))
_NOT_INTS = st.sampled_from([np.int64(4), np.bool_(True), 4 + 0j, math.nan])


def _p_qlen(data, a):
    v = data.draw(st.one_of(st.integers(-40, 0), st.integers(33, 10_000), _OUT_OF_RANGE_INTS, _NOT_INTS,
                            st.sampled_from([1.0, 2.5, "2", None, True, torch.tensor(2)])))
    exc = ValueError if isinstance(v, int) and not isinstance(v, bool) else TypeError
    return dict(decode_query_len=v), exc


def _p_num_q_heads(data, a):
    v = data.draw(st.one_of(st.integers(-4, 0), st.integers(0, 40).map(lambda x: 2 * x + 1),
                            st.integers(17, 60).map(lambda x: 2 * x), _OUT_OF_RANGE_INTS, _NOT_INTS,
                            st.sampled_from([4.0, "4", None])))
    return dict(num_q_heads=v), (ValueError if isinstance(v, int) else TypeError)


def _p_num_kv_heads(data, a):
    v = data.draw(st.one_of(st.integers(-4, 0), st.just(3), st.integers(5, 64), _OUT_OF_RANGE_INTS, _NOT_INTS,
                            st.sampled_from([2.0, False])))
    return dict(num_kv_heads=v), (ValueError if type(v) is int else TypeError)


def _p_page_size(data, a):
    v = data.draw(st.one_of(st.integers(-10, 1000).filter(lambda x: x not in (64, 128)), _OUT_OF_RANGE_INTS,
                            _NOT_INTS, st.sampled_from([64.0, "128", None])))
    return dict(page_size=v), (ValueError if isinstance(v, int) else TypeError)


def _p_topk_blocks(data, a):
    v = data.draw(st.one_of(st.integers(-10, 0), st.integers(33, 500), _OUT_OF_RANGE_INTS, _NOT_INTS,
                            st.sampled_from([16.0, "16", True])))
    return dict(topk_blocks=v), (ValueError if type(v) is int else TypeError)


def _p_capacity(data, a):
    """block_table too narrow for the longest request (checked on first build)."""
    cols = a["block_table"].shape[1]
    n = data.draw(st.integers(cols * PAGE + 1, cols * PAGE + 5000))
    return dict(seq_lens_cpu=torch.tensor([n, 5], dtype=torch.int32)), ValueError


PREPARE_MUTATIONS = {
    "block_table": _p_block_table,
    "seq_lens": _p_seq_lens,
    "seq_lens_cpu": _p_seq_lens_cpu,
    "decode_query_len": _p_qlen,
    "num_q_heads": _p_num_q_heads,
    "num_kv_heads": _p_num_kv_heads,
    "page_size": _p_page_size,
    "topk_blocks": _p_topk_blocks,
    "block_table ": _p_capacity,  # trailing space: a second entry naming block_table
}


def _named_first(message: str, name: str) -> bool:
    """The error starts with the argument's name ("name: ..."), or with the names of a rule
    between arguments that includes it ("block_table / seq_lens: ...")."""
    head, sep, _ = message.partition(": ")
    return bool(sep) and name in head.split(" / ")


def test_prepare_accepts_the_base_case():
    p = _call_prepare(SparseDecodePlanner(), _prepare_base())
    assert p.kv_lens.tolist() == [69, 70, 129, 130]


@pytest.mark.parametrize("name", list(PREPARE_MUTATIONS))
@SETTINGS
@given(data=st.data())
def test_prepare_rejects_malformed(name, data):
    a = _prepare_base()
    change, exc = PREPARE_MUTATIONS[name](data, a)
    a.update(change)
    planner = SparseDecodePlanner()
    with pytest.raises((ValueError, TypeError)) as ei:
        _call_prepare(planner, a)
    assert _named_first(str(ei.value), name.strip()), str(ei.value)
    assert isinstance(ei.value, exc), f"{type(ei.value).__name__}: {ei.value}"
    assert not planner.plans
    # the cached step's one-pass check (fast paths below) never accepts what the full checks reject
    try:
        validate_prepare_tensors(a["block_table"], a["seq_lens"], a["seq_lens_cpu"])
    except (ValueError, TypeError):
        assert not _prepare_tensors_ok(a["block_table"], a["seq_lens"], a["seq_lens_cpu"])


@pytest.mark.parametrize("name", [n for n in PREPARE_MUTATIONS if n in ("block_table", "seq_lens", "seq_lens_cpu")])
@SETTINGS
@given(data=st.data())
def test_cached_prepare_rejects_malformed(name, data):
    """The same tensors against a planner that already holds the base step's plan: the cached
    step's one-pass check never lets a malformed tensor through, and errors name it."""
    a = _prepare_base()
    planner = SparseDecodePlanner()
    plan = _call_prepare(planner, a)
    change, exc = PREPARE_MUTATIONS[name](data, a)
    if _is_negative(change):
        return  # a value check, made when a plan is built (this planner has built it)
    a.update(change)
    with pytest.raises((ValueError, TypeError)) as ei:
        _call_prepare(planner, a)
    assert _named_first(str(ei.value), name.strip()), str(ei.value)
    assert isinstance(ei.value, exc), f"{type(ei.value).__name__}: {ei.value}"
    assert list(planner.plans.values()) == [plan]


def _is_negative(change):
    s = change.get("seq_lens_cpu")
    return isinstance(s, torch.Tensor) and s.dtype in (torch.int32, torch.int64) and bool((s < 0).any())


# ----------------------------------------------------------------------------- sparse_decode
def _op_base():
    c, plan = base()
    return dict(query=c.query, kv_cache=c.kv_cache, topk=c.topk, out=c.new_out(), plan=plan,
                lse=c.new_lse(), backend="reference", **c.scales())


def _s_query(data, a):
    q = a["query"]
    kind = data.draw(st.sampled_from(["dtype", "T", "heads", "dim", "ndim", "stride", "type"]))
    if kind == "dtype":
        return dict(query=q.to(_bad_dtype(data, (torch.bfloat16, FP8)))), TypeError
    if kind == "T":
        return dict(query=torch.zeros(_other_int(data, T, 0, 12), HQ, 128, dtype=torch.bfloat16)), ValueError
    if kind == "heads":
        return dict(query=torch.zeros(T, _other_int(data, HQ, 0, 20), 128, dtype=torch.bfloat16)), ValueError
    if kind == "dim":
        return dict(query=torch.zeros(T, HQ, _other_int(data, 128, 0, 300), dtype=torch.bfloat16)), ValueError
    if kind == "ndim":
        return dict(query=data.draw(st.sampled_from([q.reshape(T, -1), q[None], q.reshape(-1)]))), ValueError
    if kind == "stride":
        return dict(query=_noncontig_last((T, HQ, 128), torch.bfloat16)), ValueError
    return dict(query=q.tolist()), TypeError


def _s_kv_cache(data, a):
    kv = a["kv_cache"]
    P = kv.shape[0]
    kind = data.draw(st.sampled_from(["dtype", "heads", "page", "row", "ndim", "noncontig", "type"]))
    if kind == "dtype":
        return dict(kv_cache=torch.zeros(kv.shape, dtype=_bad_dtype(data, (FP8, torch.uint8)))), TypeError
    shape = [P, HKV, PAGE, 256]
    if kind in ("heads", "page", "row"):
        i = {"heads": 1, "page": 2, "row": 3}[kind]
        shape[i] = _other_int(data, shape[i], 0, 300)
        return dict(kv_cache=torch.zeros(shape, dtype=torch.uint8)), ValueError
    if kind == "ndim":
        return dict(kv_cache=kv.reshape(P, HKV, -1)), ValueError
    if kind == "noncontig":
        wide = torch.zeros(P, HKV, PAGE, 512, dtype=torch.uint8)
        return dict(kv_cache=data.draw(st.sampled_from([wide[..., :256], wide[..., 256:]]))), ValueError
    return dict(kv_cache=None), TypeError


def _s_topk(data, a):
    kind = data.draw(st.sampled_from(["dtype", "T", "heads", "width", "hkv_t_shape", "stride", "type"]))
    if kind == "dtype":
        return dict(topk=a["topk"].to(_bad_dtype(data, (torch.int32,)))), TypeError
    shape = [T, HKV, K]
    if kind in ("T", "heads", "width"):
        i = {"T": 0, "heads": 1, "width": 2}[kind]
        shape[i] = _other_int(data, shape[i], 0, 40)
        return dict(topk=torch.zeros(shape, dtype=torch.int32)), ValueError
    if kind == "hkv_t_shape":  # a [Hkv, T, K] buffer passed without the transpose
        return dict(topk=torch.zeros(HKV, T, K, dtype=torch.int32)), ValueError
    if kind == "stride":
        return dict(topk=_noncontig_last((T, HKV, K), torch.int32)), ValueError
    return dict(topk=a["topk"].numpy()), TypeError


def _sharing_self(shape, dtype):
    """A tensor of `shape` whose elements share memory: a zero stride (an expand()ed tensor), or
    rows that overlap (as_strided with a token stride of half a row), NaN-poisoned."""
    def make(kind):
        if kind == "zero_stride":
            return torch.full((1, *shape[1:]), math.nan, dtype=dtype).expand(shape)
        row = math.prod(shape[1:])
        base = torch.full((shape[0] * row,), math.nan, dtype=dtype)
        inner = [math.prod(shape[i + 1:]) for i in range(1, len(shape))]
        return base.as_strided(shape, (max(row // 2, 1), *inner))
    return make


def _s_out(data, a):
    kind = data.draw(st.sampled_from(["dtype", "shape", "stride", "type", "zero_stride", "overlapping_rows"]))
    if kind in ("zero_stride", "overlapping_rows"):
        return dict(out=_sharing_self((T, HQ, 128), torch.bfloat16)(kind)), ValueError
    if kind == "dtype":
        dt = _bad_dtype(data, (torch.bfloat16,), pool=(torch.float32, torch.float16, torch.float64))
        return dict(out=torch.full((T, HQ, 128), math.nan, dtype=dt)), TypeError
    if kind == "shape":
        shape = data.draw(st.sampled_from([(T + 1, HQ, 128), (T, HQ + 2, 128), (T, HQ, 64), (T, HQ * 128)]))
        return dict(out=torch.full(shape, math.nan, dtype=torch.bfloat16)), ValueError
    if kind == "stride":
        return dict(out=_noncontig_last((T, HQ, 128), torch.bfloat16).fill_(math.nan)), ValueError
    return dict(out=None), TypeError


def _s_lse(data, a):
    kind = data.draw(st.sampled_from(["dtype", "shape", "stride", "type", "zero_stride", "overlapping_rows"]))
    if kind in ("zero_stride", "overlapping_rows"):
        return dict(lse=_sharing_self((T, HQ), torch.float32)(kind)), ValueError
    if kind == "dtype":
        dt = _bad_dtype(data, (torch.float32,), pool=(torch.bfloat16, torch.float16, torch.float64))
        return dict(lse=torch.full((T, HQ), math.nan, dtype=dt)), TypeError
    if kind == "shape":
        shape = data.draw(st.sampled_from([(T, HQ + 1), (T + 1, HQ), (T, HQ, 1), (T * HQ,)]))
        return dict(lse=torch.full(shape, math.nan)), ValueError
    if kind == "stride":
        return dict(lse=_noncontig_last((T, HQ), torch.float32).fill_(math.nan)), ValueError
    return dict(lse=[0.0] * T), TypeError


def _sharing_with_inputs(name, a, data):
    """out / lse (`name`) overlapping an input of the call or (lse) out: a partial or a full
    alias, made by carving both from one buffer. Returns the changed arguments."""
    out_bytes, lse_bytes = T * HQ * 128 * 2, T * HQ * 4
    other = data.draw(st.sampled_from(["query", "kv_cache", "topk"] + (["out"] if name == "lse" else [])))
    x = a[other]
    need = out_bytes if name == "out" else lse_bytes
    size = x.numel() * x.element_size()
    # where the output starts inside the other tensor's bytes (16-byte steps; the output may run past
    # its end into the buffer's tail)
    at = 16 * data.draw(st.integers(0, size // 16 - 1))
    buf = torch.full((size + need,), 0x7F, dtype=torch.uint8)
    buf[:size] = x.contiguous().view(-1).view(torch.uint8)
    carved = buf[:size].view(x.dtype).view(x.shape)
    mem = buf[at:at + need]
    made = mem.view(torch.bfloat16).view(T, HQ, 128) if name == "out" else mem.view(torch.float32).view(T, HQ)
    return {other: carved, name: made}


def _s_out_shared(data, a):
    return _sharing_with_inputs("out", a, data), ValueError


def _s_lse_shared(data, a):
    return _sharing_with_inputs("lse", a, data), ValueError


def _strategies_of_bad_scalars():
    """(value, the exception it must raise) for scales: every form a scale can come in (python,
    numpy, 0-d / 1-element tensor) with a value out of range (ValueError) or a type that is no
    real number (TypeError: bool is not read as 1.0, complex not as its real part)."""
    vals = st.one_of(st.floats(max_value=0.0), st.sampled_from([math.nan, math.inf]),
                     st.integers(max_value=0), st.integers(min_value=2 ** 1024),
                     st.integers(max_value=-(2 ** 1024)))
    reals = st.floats(max_value=0.0, allow_infinity=False) | st.sampled_from([math.nan, math.inf])
    reals32 = st.floats(-3e38, 0.0) | st.sampled_from([math.nan, math.inf])
    value_errors = st.one_of(
        vals, reals.map(np.float64), reals32.map(np.float32), st.integers(-5, 0).map(np.int64),
        reals.map(lambda v: torch.tensor(v, dtype=torch.float64)), reals32.map(lambda v: torch.tensor([v])),
    )
    type_errors = st.one_of(
        st.sampled_from(["1.0", None, [1.0], torch.tensor([1.0, 2.0]), np.array([1.0, 2.0]), object()]),
        st.booleans(), st.booleans().map(np.bool_), st.booleans().map(torch.tensor),
        st.complex_numbers(), st.complex_numbers(allow_nan=False).map(np.complex128),
        st.complex_numbers(allow_nan=False, allow_infinity=False, max_magnitude=1e30).map(torch.tensor),
    )
    return value_errors.map(lambda v: (v, ValueError)) | type_errors.map(lambda v: (v, TypeError))


BAD_SCALARS = _strategies_of_bad_scalars()


def _scale_mutation(name):
    def mutate(data, a):
        v, exc = data.draw(BAD_SCALARS)
        return {name: v}, exc
    return mutate


def _s_plan(data, a):
    v = data.draw(st.sampled_from([None, "plan", object(), {}, 3]))
    return dict(plan=v), TypeError


def _s_backend(data, a):
    v = data.draw(st.sampled_from(["cuda", "triton", "", "Reference", "kernel", None, 1]))
    return dict(backend=v), (ValueError if isinstance(v, str) else TypeError)


def _s_plan_mismatch(data, a):
    """A plan of another batch / head count: the tensors disagree with it (named: query)."""
    c = make_case(3, 1, HQ, HKV, q_dtype=torch.bfloat16, seed=1, ctx_lens=[10, 20, 30],
                  page_size=PAGE, topk_blocks=K)
    plan = SparseDecodePlanner().prepare(*c.prepare_args(), **c.prepare_kwargs())
    return dict(plan=plan), ValueError


OP_MUTATIONS = {
    "query": _s_query,
    "kv_cache": _s_kv_cache,
    "topk": _s_topk,
    "out": _s_out,
    "lse": _s_lse,
    "out ": _s_out_shared,  # a second entry naming out: sharing memory with another argument
    "lse ": _s_lse_shared,
    "sm_scale": _scale_mutation("sm_scale"),
    "q_scale": _scale_mutation("q_scale"),
    "k_scale": _scale_mutation("k_scale"),
    "v_scale": _scale_mutation("v_scale"),
    "plan": _s_plan,
    "backend": _s_backend,
    "query ": _s_plan_mismatch,
}


def _snapshot(x):
    return x.clone() if isinstance(x, torch.Tensor) else None


def _same_bits(x, y):
    if x is None:
        return True
    def bits(t):
        return t.contiguous().reshape(-1).view(torch.uint8)

    return x.shape == y.shape and x.dtype == y.dtype and torch.equal(bits(x), bits(y))


@pytest.mark.parametrize("name", list(OP_MUTATIONS))
@SETTINGS
@given(data=st.data())
def test_sparse_decode_rejects_malformed(name, data):
    a = _op_base()
    change, exc = OP_MUTATIONS[name](data, a)
    a.update(change)
    if data.draw(st.booleans(), label="drop lse") and name.strip() != "lse":
        a["lse"] = None
    if name in TENSOR_FIELDS:  # the one-pass check (fast paths below) rejects it as well
        assert not _fast_op(a)
    out0, lse0 = _snapshot(a["out"]), _snapshot(a["lse"])
    args = (a.pop("query"), a.pop("kv_cache"), a.pop("topk"), a.pop("out"), a.pop("plan"))
    with pytest.raises((ValueError, TypeError)) as ei:
        sparse_decode(*args, **a)
    assert _named_first(str(ei.value), name.strip()), str(ei.value)
    assert isinstance(ei.value, exc), f"{type(ei.value).__name__}: {ei.value}"
    assert _same_bits(out0, args[3]), "out was written although validation failed"
    assert _same_bits(lse0, a["lse"]), "lse was written although validation failed"


@SETTINGS
@given(transposed=st.booleans(), u8=st.booleans(), with_lse=st.booleans(),
       scale=st.floats(1e-3, 1e3), fp8=st.booleans())
def test_sparse_decode_accepts_valid_variants(transposed, u8, with_lse, scale, fp8):
    c = make_case(B, QLEN, HQ, HKV, q_dtype=FP8 if fp8 else torch.bfloat16, seed=3, device="cpu",
                  ctx_lens=[70, 130], page_size=PAGE, topk_blocks=K, transposed_topk=transposed)
    plan = SparseDecodePlanner().prepare(*c.prepare_args(), **c.prepare_kwargs())
    out = c.new_out()
    lse = c.new_lse() if with_lse else None
    kv = c.kv_cache.view(torch.uint8) if u8 else c.kv_cache
    sparse_decode(c.query, kv, c.topk, out, plan, sm_scale=scale * c.sm_scale, q_scale=c.q_scale,
                  k_scale=c.k_scale, v_scale=c.v_scale, lse=lse, backend="reference")
    assert torch.isfinite(out.float()).all()
    if with_lse:
        assert torch.isfinite(lse).all()


# ----------------------------------------------------------------------------- geometry
@SETTINGS
@given(hq=st.integers(-2, 80), hkv=st.integers(-2, 20), page=st.sampled_from([0, 32, 64, 100, 128, 256]),
       topk=st.integers(-1, 40), qlen=st.integers(-1, 40), batch=st.integers(-1, 3),
       q_dtype=st.sampled_from(["bfloat16", "float8_e4m3fn", "float16", torch.bfloat16, torch.float32]))
def test_supports_agrees_with_rules(hq, hkv, page, topk, qlen, batch, q_dtype):
    r = supports(num_q_heads=hq, num_kv_heads=hkv, page_size=page, topk_blocks=topk,
                 q_dtype=q_dtype, batch=batch, decode_query_len=qlen)
    qname = str(q_dtype).replace("torch.", "")
    ok = (hq >= 1 and hkv >= 1 and hq % hkv == 0 and 1 <= hq // hkv <= 16 and page in (64, 128)
          and 1 <= topk <= 32 and 1 <= qlen <= 32 and batch >= 1 and qname in ("bfloat16", "float8_e4m3fn"))
    assert bool(r) == ok == r.ok
    assert (r.reason == "") == ok
    if ok:
        cfg = SparseDecodeConfig(hq, hkv, page_size=page, topk_blocks=topk, q_dtype=qname)
        assert check_config(cfg) is None and cfg.group_size == hq // hkv
        assert cfg.to_dict()["q_dtype"] == qname


def test_check_config_reasons():
    assert check_config(SparseDecodeConfig(64, 4)) is None
    assert check_config(SparseDecodeConfig(8, 1, q_dtype="float8_e4m3fn", arch="sm_100a")) is None
    for cfg, word in [
        (SparseDecodeConfig(64, 4, head_dim=64), "head_dim"),
        (SparseDecodeConfig(64, 4, page_size=256), "page_size"),
        (SparseDecodeConfig(64, 4, topk_blocks=0), "topk_blocks"),
        (SparseDecodeConfig(64, 3), "multiple"),
        (SparseDecodeConfig(64, 2), "group size"),
        (SparseDecodeConfig(64, 4, q_dtype="float16"), "q_dtype"),
        (SparseDecodeConfig(64, 4, kv_dtype="bfloat16"), "kv_dtype"),
        (SparseDecodeConfig(64, 4, out_dtype="float32"), "out_dtype"),
        (SparseDecodeConfig(64, 4, arch="hopper"), "arch"),
    ]:
        reason = check_config(cfg)
        assert reason is not None and word in reason, (cfg, reason)
    with pytest.raises(ValueError, match="page_size"):
        SparseDecodeConfig(64, 4, page_size=32).validate()
    assert supports(num_q_heads=64, num_kv_heads=4, page_size=128, topk_blocks=16,
                    decode_query_len=33).reason.startswith("decode_query_len")


def test_geometry_bounds_are_inclusive_and_ints_are_ints():
    """The limits themselves are served (topk 32, decode_query_len 32, batch 1, group 16) and the
    next values are not; a bool or a float is no int (ctas_per_sm=True is no 1-CTA union build, 2.0
    would key apart from 2); a dtype name may carry its "torch." prefix."""
    geo = dict(num_q_heads=64, num_kv_heads=4, page_size=128, topk_blocks=32)
    assert supports(**geo, batch=1, decode_query_len=32, q_dtype="torch.bfloat16")
    assert check_config(SparseDecodeConfig(64, 4, topk_blocks=32)) is None
    for bad, says in ((dict(topk_blocks=33), "topk_blocks"), (dict(batch=0), "batch"),
                      (dict(decode_query_len=33), "decode_query_len"), (dict(num_kv_heads=True), "bool"),
                      (dict(q_dtype="torch.float16"), "q_dtype")):
        r = supports(**{**geo, **bad})
        assert not r and says in r.reason, (bad, r)
    for cfg in (SparseDecodeConfig(64, 4, kernel="union", ctas_per_sm=True), SparseDecodeConfig(64, 4, ctas_per_sm=2.0)):
        assert "ctas_per_sm" in (check_config(cfg) or ""), cfg


def test_dtype_names_and_device_arch(monkeypatch):
    """torch_dtype refuses a torch attribute that is no dtype; device_arch adds the "a" from SM90 on
    (the capability is a stand-in: no GPU here)."""
    from msa_jit import geometry

    assert geometry.torch_dtype("torch.float8_e4m3fn") is torch.float8_e4m3fn
    for name in ("cuda", "Tensor", "no_such_dtype"):
        with pytest.raises(ValueError, match="unknown dtype name"):
            geometry.torch_dtype(name)
    for cap, arch in (((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((8, 0), "sm_80"), ((8, 9), "sm_89")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, cap=cap: cap)
        assert geometry.device_arch("cuda:0") == arch


# ----------------------------------------------------------------------------- kernel layouts
def test_kernel_layout_rules():
    """Layouts the compiled kernel assumes (checked only on the kernel path; tested here on CPU)."""
    from msa_jit.validation import validate_kernel_layout

    c, _ = base()
    q, kv, out, lse = c.query, c.kv_cache, c.new_out(), c.new_lse()
    validate_kernel_layout(q, kv, out, lse)
    validate_kernel_layout(q, kv, out, None)
    # a query slice of a fused qkv row is fine: token stride is a multiple of 16, heads dense
    qkv = torch.zeros(T, (HQ + 2 * HKV) * 128, dtype=torch.bfloat16)
    validate_kernel_layout(qkv[:, : HQ * 128].view(T, HQ, 128), kv, out, lse)
    for name, x in _layout_violations(kv):
        args = {"query": q, "kv_cache": kv, "out": out, "lse": lse, name: x}
        with pytest.raises(ValueError, match=rf"^{re.escape(name)}: "):
            validate_kernel_layout(args["query"], args["kv_cache"], args["out"], args["lse"])


def _layout_violations(kv):
    """(argument, tensor) pairs that break only a kernel-layout rule (shapes and dtypes are right)."""
    return [
        ("query", torch.zeros(T, HQ, 256, dtype=torch.bfloat16)[..., :128]),
        ("query", torch.zeros(T, HQ * 128 + 8, dtype=torch.bfloat16)[:, : HQ * 128].view(T, HQ, 128)),
        ("query", torch.zeros(T * HQ * 128 + 1, dtype=torch.bfloat16)[1:].view(T, HQ, 128)),
        ("kv_cache", torch.zeros(kv.numel() + 1, dtype=torch.uint8)[1:].view(kv.shape)),
        ("out", torch.zeros(HQ, T, 128, dtype=torch.bfloat16).transpose(0, 1)),
        ("out", torch.zeros(T * HQ * 128 + 1, dtype=torch.bfloat16)[1:].view(T, HQ, 128)),
        ("lse", torch.zeros(HQ, T).t()),
    ]


# ----------------------------------------------------------------------------- fast paths
# A cached step checks its inputs in one pass of attribute reads (kernel_call_ok,
# _prepare_tensors_ok) and falls back to the full checks, which name the problem, only when
# that pass fails. The pass must therefore never accept what the full checks reject: the
# malformed-input tests above assert that for every mutation of a tensor argument.
TENSOR_FIELDS = ("query", "kv_cache", "topk", "out", "lse", "query ")


def _fast_op(a):
    return kernel_call_ok(a["query"], a["kv_cache"], a["topk"], a["out"], a["plan"], a["lse"])


@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("variant", ["base", "fp8", "u8", "transposed", "qkv_slice"])
def test_fast_op_check_accepts_valid_inputs(variant, with_lse):
    a = _op_base()
    c, _ = base()
    if variant == "fp8":
        a["query"] = c.query.to(FP8)
    if variant == "u8":
        a["kv_cache"] = c.kv_cache.view(torch.uint8)
    if variant == "transposed":
        a["topk"] = c.topk.transpose(0, 1).contiguous().transpose(0, 1)
    if variant == "qkv_slice":
        qkv = torch.zeros(T, (HQ + 2 * HKV) * 128, dtype=torch.bfloat16)
        a["query"] = qkv[:, : HQ * 128].view(T, HQ, 128)
    if not with_lse:
        a["lse"] = None
    assert _fast_op(a)


def test_fast_op_check_rejects_kernel_layout_violations():
    a = _op_base()
    for name, x in _layout_violations(a["kv_cache"]):
        assert not _fast_op(dict(a, **{name: x})), name


def test_fast_prepare_check():
    a = _prepare_base()
    assert _prepare_tensors_ok(a["block_table"], a["seq_lens"], a["seq_lens_cpu"])
    assert _prepare_tensors_ok(a["block_table"], a["seq_lens"], None)



def test_one_set_of_parameter_names():
    """supports, prepare, the planner, the engine adapter and the CLI name the geometry alike."""
    import inspect

    from msa_jit import SparseDecodePlanner, prepare
    from msa_jit.integrations import engine
    from msa_jit.cli import build_parser

    geometry = {"num_q_heads", "num_kv_heads", "page_size", "topk_blocks"}
    for fn in (supports, prepare, SparseDecodePlanner.prepare, engine.prepare_decode_metadata,
               engine.supports_cutlass_sparse_decode, engine.should_prepare_decode_metadata):
        assert geometry <= set(inspect.signature(fn).parameters), fn
    for fn in (supports, prepare, SparseDecodePlanner.prepare, engine.should_prepare_decode_metadata):
        assert "decode_query_len" in inspect.signature(fn).parameters, fn
    args = build_parser().parse_args(["warmup", "--heads", "8/1", "--topk-blocks", "8", "--page-size", "64"])
    assert (args.topk_blocks, args.page_size) == (8, 64)
    assert build_parser().parse_args(["bench", "--decode-query-len", "1,2"]).decode_query_len == ["1,2"]


# ----------------------------------------------------------------------------- arches
@pytest.mark.parametrize("arch, says", [("sm_80", "not one msa-jit builds for"), ("sm_120a", "not one msa-jit"),
                                        ("sm_90", "baseline target"), ("sm_100f", "family target")])
def test_unsupported_arches_are_refused_with_the_list(arch, says, monkeypatch):
    """check_config, supports(arch=), env.parse_arch / MSA_JIT_ARCH and the planner refuse every arch
    but geometry.DEFAULT_ARCHES (the arches msa-jit builds for), listing them."""
    from msa_jit import env
    from msa_jit.geometry import DEFAULT_ARCHES

    listed = ", ".join(DEFAULT_ARCHES)
    reason = check_config(SparseDecodeConfig(64, 4, arch=arch))
    assert reason and says in reason and listed in reason
    r = supports(num_q_heads=64, num_kv_heads=4, page_size=128, topk_blocks=16, arch=arch)
    assert not r and says in r.reason and listed in r.reason
    with pytest.raises(ValueError, match=says):
        env.parse_arch(arch)
    monkeypatch.setenv("MSA_JIT_ARCH", arch)
    with pytest.raises(ValueError, match="MSA_JIT_ARCH"):
        env.target_arch()
    with pytest.raises(ValueError, match="^arch: .*" + says):
        SparseDecodePlanner(arch=arch)
    for ok in DEFAULT_ARCHES:
        assert check_config(SparseDecodeConfig(64, 4, arch=ok)) is None and env.parse_arch(ok) == ok
        assert supports(num_q_heads=64, num_kv_heads=4, page_size=128, topk_blocks=16, arch=ok)


# ----------------------------------------------------------------------------- meta tensors
def test_prepare_refuses_meta_tensors():
    a = _prepare_base()
    a.update(block_table=a["block_table"].to("meta"), seq_lens=a["seq_lens"].to("meta"))
    planner = SparseDecodePlanner()
    with pytest.raises(ValueError, match="^seq_lens: expected a tensor on a CPU or CUDA device.*meta"):
        _call_prepare(planner, a)
    assert not planner.plans


def test_tensors_on_another_device_are_named():
    """A block_table on another device than seq_lens (the cached step's one-pass check included), a
    k_scale / v_scale tensor on another device than the plan, and an fp8 tensor in the NVFP4 layout
    are each named, not left to a kernel or the reference to trip over."""
    cached = SparseDecodePlanner()
    _call_prepare(cached, _prepare_base())
    for planner in (SparseDecodePlanner(), cached):
        a = _prepare_base()
        a.update(block_table=a["block_table"].to("meta"))
        plans = dict(planner.plans)
        with pytest.raises(ValueError, match="^block_table: expected a tensor on cpu"):
            _call_prepare(planner, a)
        assert planner.plans == plans
    for name in ("k_scale", "v_scale"):
        a = _op_base()
        a[name] = torch.ones(1, device="meta")
        with pytest.raises(ValueError, match=f"^{name}: expected a tensor on cpu"):
            sparse_decode(**a)
    c = make_case(2, 1, 16, 1, q_dtype=torch.bfloat16, seed=1, device="cpu", kv_dtype="nvfp4")
    plan = SparseDecodePlanner().prepare(*c.prepare_args(), **c.prepare_kwargs())
    with pytest.raises(TypeError, match="^kv_cache: the NVFP4 layout"):
        sparse_decode(c.query, c.kv_cache.view(FP8), c.topk, c.new_out(), plan, **c.scales())


def test_out_of_range_page_names_block_table():
    c, plan = base()
    bt = c.block_table.clone()
    bt[0, 0] = c.kv_cache.shape[0] + 5  # block 0 is selected by every token of request 0 (its current block)
    planner = SparseDecodePlanner()
    p = planner.prepare(bt, c.seq_lens, c.seq_lens_cpu, QLEN, num_q_heads=HQ, num_kv_heads=HKV, page_size=PAGE,
                        topk_blocks=K)
    out = c.new_out()
    before = out.clone()
    with pytest.raises(ValueError, match=r"^block_table: row 0 maps"):
        sparse_decode(c.query, c.kv_cache, c.topk, out, p, backend="reference", **c.scales())
    assert torch.equal(out.view(torch.int16), before.view(torch.int16))


@pytest.mark.parametrize("batch", [2, 40])  # the list scan and the aminmax scan
def test_cached_plan_still_checks_seq_lens_cpu(batch):
    """A negative or over-capacity seq_lens_cpu raised on the first call and passed on the second."""
    c = make_case(batch, 1, HQ, HKV, q_dtype=torch.bfloat16, seed=1, device="cpu", page_size=PAGE, topk_blocks=K)
    planner = SparseDecodePlanner()
    plan = planner.prepare(*c.prepare_args(), **c.prepare_kwargs())
    cap = c.block_table.shape[1] * PAGE
    for bad, says in (([-3] + [5] * (batch - 1), "seq_lens_cpu: expected lengths >= 0"),
                      ([5] * (batch - 1) + [cap + 1], "block_table: .* cannot hold")):
        slc = torch.tensor(bad, dtype=torch.int32)
        for fresh in (SparseDecodePlanner(), planner):  # first build and the cached step alike
            with pytest.raises(ValueError, match=says):
                fresh.prepare(c.block_table, c.seq_lens, slc, 1, **c.prepare_kwargs())
    assert planner.prepare(*c.prepare_args(), **c.prepare_kwargs()) is plan
    edge = torch.tensor([0] * (batch - 1) + [cap], dtype=torch.int64)  # both bounds are allowed
    assert planner.prepare(c.block_table, edge.to(torch.int32), edge, 1, **c.prepare_kwargs()) is plan


@pytest.mark.parametrize("batch", [2, 40])
def test_a_cpu_plan_checks_seq_lens_itself(batch):
    """On a CPU plan seq_lens' values cost no sync: out-of-range lengths and a seq_lens_cpu that
    is not its copy raise (a CUDA plan checks only seq_lens_cpu), on the first and the cached call."""
    c = make_case(batch, 1, HQ, HKV, q_dtype=torch.bfloat16, seed=2, device="cpu", page_size=PAGE, topk_blocks=K)
    planner = SparseDecodePlanner()
    planner.prepare(*c.prepare_args(), **c.prepare_kwargs())
    cap = c.block_table.shape[1] * PAGE
    for seq, cpu, says in (([-5] + [5] * (batch - 1), None, "^seq_lens: expected lengths >= 0"),
                           ([5] * (batch - 1) + [cap + 1], None, r"^block_table: .* \(seq_lens max"),
                           ([5] * batch, [6] * batch, "^seq_lens_cpu: expected the values of seq_lens")):
        sl = torch.tensor(seq, dtype=torch.int32)
        slc = None if cpu is None else torch.tensor(cpu, dtype=torch.int32)
        for fresh in (SparseDecodePlanner(), planner):
            with pytest.raises(ValueError, match=says):
                fresh.prepare(c.block_table, sl, slc, 1, **c.prepare_kwargs())


def test_huge_batch_is_a_value_error_with_the_bytes(monkeypatch):
    """The plan's workspace is computed before anything is allocated: a batch whose workspace
    exceeds the device's memory is a ValueError naming batch*qlen and the bytes."""
    from msa_jit import planner
    from msa_jit.planner import workspace_bytes

    # a device of 1 GiB (stand-in for the memory query): an unsplit plan's workspace is its lse scratch,
    # T * Hq * 4 bytes, so exceeding this machine's real memory would need a seq_lens of gigabytes
    monkeypatch.setattr(planner, "_memory_bytes", lambda device: 1 << 30)
    batch, qlen = 1 << 20, 32  # T = 2**25 tokens: ~8.6 GB of lse scratch for 64/4
    seq_lens = torch.full((batch,), 64, dtype=torch.int32)
    block_table = torch.zeros(batch, 1, dtype=torch.int32)
    need = workspace_bytes(batch * qlen, 64, 4, 1)
    assert need > 8 << 30
    with pytest.raises(ValueError, match=rf"^seq_lens: batch\*qlen = {batch * qlen} tokens need .* {need} bytes"):
        SparseDecodePlanner().prepare(block_table, seq_lens, None, qlen, num_q_heads=64, num_kv_heads=4,
                                      page_size=128, topk_blocks=16)


def test_workspace_bytes_is_what_a_plan_allocates():
    from msa_jit.planner import workspace_bytes

    c, plan = base()
    tensors = (plan.kv_lens, plan.qo_offset, plan.partial_o, plan.partial_lse, plan.lse_scratch, plan.unit_scale)
    assert workspace_bytes(T, HQ, HKV, max(plan.launch().num_splits, plan.launch("nvfp4").num_splits)) == sum(t.numel() * t.element_size() for t in tensors)


def test_failed_allocation_is_a_value_error(monkeypatch):
    """An allocation that fails below the memory check (another tenant holds the GPU) says the same."""
    from msa_jit import planner as planner_mod

    monkeypatch.setattr(planner_mod, "_memory_bytes", lambda device: None)
    real_empty = torch.empty

    def failing_empty(*shape, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(torch, "empty", failing_empty)
    a = _prepare_base()
    try:
        with pytest.raises(ValueError, match=r"^seq_lens: batch\*qlen = 4 tokens: .* could not be allocated"):
            _call_prepare(SparseDecodePlanner(), a)
    finally:
        monkeypatch.setattr(torch, "empty", real_empty)
