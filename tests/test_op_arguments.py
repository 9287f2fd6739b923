"""sparse_decode's scalar and output-memory arguments, beyond test_validation's malformed-input
fuzzing (whose mutations include both): each form of a bad scale named, out / lse sharing memory
with themselves or another argument refused before anything is written, views of one buffer
that share no byte accepted, and the overlap tests against brute force."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_validation import HQ, T, _op_base, _same_bits, _snapshot, base

from msa_jit import sparse_decode

# each form of a bad scale once (test_torch_op walks them too)
BAD_SCALAR_EXAMPLES = [
    (0, ValueError), (-1.0, ValueError), (math.nan, ValueError), (math.inf, ValueError),
    (10 ** 400, ValueError), (-(10 ** 400), ValueError), (np.float32("nan"), ValueError),
    (np.float64(-2.0), ValueError), (np.int64(0), ValueError), (torch.tensor(-1.0), ValueError),
    (torch.tensor([math.inf]), ValueError), (torch.tensor(0, dtype=torch.int32), ValueError),
    (True, TypeError), (False, TypeError), (np.bool_(True), TypeError), (torch.tensor(True), TypeError),
    (1 + 0j, TypeError), (1j, TypeError), (np.complex128(2.0), TypeError), (torch.tensor(1 + 1j), TypeError),
    (torch.tensor([0.5 + 0j]), TypeError), ("1.0", TypeError), (None, TypeError), ([1.0], TypeError),
    (torch.tensor([1.0, 2.0]), TypeError), (np.array([1.0, 2.0]), TypeError),
]


def test_every_bad_scalar_is_a_named_value_or_type_error():
    """Each form of a bad scale (python / numpy / tensor; out of range, bool, complex, an int past
    float's range) for each scale: the named TypeError / ValueError, never OverflowError or
    torch's RuntimeError, and out / lse untouched."""
    for name in ("sm_scale", "q_scale", "k_scale", "v_scale"):
        for value, exc in BAD_SCALAR_EXAMPLES:
            a = _op_base()
            a[name] = value
            out0, lse0 = _snapshot(a["out"]), _snapshot(a["lse"])
            with pytest.raises((ValueError, TypeError)) as ei:
                sparse_decode(**a)
            assert type(ei.value) is exc and str(ei.value).startswith(f"{name}: "), (name, value, ei.value)
            assert _same_bits(out0, a["out"]) and _same_bits(lse0, a["lse"])


@pytest.mark.parametrize("which", ["out", "lse"])
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_outputs_sharing_memory_are_refused_before_anything_is_written(which, backend):
    """An expand()ed out / lse (torch.zeros(1, Hq).expand(T, Hq)) used to pass validation; the
    reference then wrote out and raised torch's RuntimeError on lse. Now: the named ValueError,
    out untouched (NaN-poisoned first)."""
    a = _op_base()
    a["backend"] = backend
    if which == "out":
        a["out"] = torch.full((1, HQ, 128), math.nan, dtype=torch.bfloat16).expand(T, HQ, 128)
    else:
        a["lse"] = torch.full((1, HQ), math.nan).expand(T, HQ)
    out0, lse0 = _snapshot(a["out"]), _snapshot(a["lse"])
    with pytest.raises(ValueError, match=rf"^{which}: has zero stride .*expand\(\)ed\?.*own memory"):
        sparse_decode(**a)
    assert _same_bits(out0, a["out"]) and _same_bits(lse0, a["lse"])
    a = _op_base()
    a["out"] = a["query"]  # the full alias
    with pytest.raises(ValueError, match="^out: overlaps the memory of query"):
        sparse_decode(**a)


def test_outputs_may_share_a_buffer_without_overlapping():
    """Views of one buffer that interleave without a common byte are accepted (the check looks at
    the elements' runs, not only their bounding ranges): query and out side by side in one
    [T, Hq, 256] buffer; out and lse sharing each token's row of another; each gives the result
    of separate tensors. Moved by one float, lse overlaps out and is refused."""
    c, plan = base()
    want_out, want_lse = c.new_out(), c.new_lse()
    sparse_decode(c.query, c.kv_cache, c.topk, want_out, plan, lse=want_lse, backend="reference", **c.scales())
    qo = torch.full((T, HQ, 256), math.nan, dtype=torch.bfloat16)
    qo[..., :128] = c.query
    query = qo[..., :128]
    rows = torch.full((T, HQ * 128 + 2 * HQ), math.nan, dtype=torch.bfloat16)  # out, then lse, per token
    out = rows[:, : HQ * 128].view(T, HQ, 128)
    lse = rows[:, HQ * 128:].view(torch.float32)
    for o in (qo[..., 128:], out):
        sparse_decode(query, c.kv_cache, c.topk, o, plan, lse=lse, backend="reference", **c.scales())
        assert torch.equal(o, want_out) and torch.equal(lse, want_lse)
    lse_on_out = rows[:, HQ * 128 - 2: HQ * 128 + 2 * HQ - 2].view(torch.float32)
    with pytest.raises(ValueError, match="^lse: overlaps the memory of out"):
        sparse_decode(query, c.kv_cache, c.topk, out, plan, lse=lse_on_out, backend="reference", **c.scales())


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_overlap_checks_agree_with_the_byte_sets(data):
    """validation's overlap tests against the sets of bytes two strided views of one buffer touch."""
    from msa_jit.validation import _overlap, _shares_elements

    buf = torch.zeros(256, dtype=torch.float32)

    def view():
        ndim = data.draw(st.integers(1, 3))
        shape = [data.draw(st.integers(1, 4)) for _ in range(ndim)]
        stride = [data.draw(st.integers(0, 12)) for _ in range(ndim)]
        off = data.draw(st.integers(0, 40))
        return buf.as_strided(shape, stride, off)

    def byte_set(x):
        idx = torch.zeros(1, dtype=torch.int64)
        for n, st_ in zip(x.shape, x.stride()):
            idx = (idx[:, None] + torch.arange(n) * st_).reshape(-1)
        offs = (x.data_ptr() + idx * 4).tolist()
        return [o + b for o in offs for b in range(4)]

    x, y = view(), view()
    bx, by = byte_set(x), byte_set(y)
    assert _overlap(x, y) == bool(set(bx) & set(by)), (x.shape, x.stride(), y.shape, y.stride())
    assert _shares_elements(x) == (len(set(bx)) < len(bx)), (x.shape, x.stride())
