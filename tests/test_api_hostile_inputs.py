"""The public API's answers to mistaken input beyond the op's own validation (tests/test_validation.py): the
float64 reference's arguments, the planner's pins, a plan's fixed step shape and format names, and the
reference backend reading the lengths its plan was prepared with."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import msa_jit
from msa_jit import SparseDecodePlanner, sparse_decode, sparse_decode_reference
from msa_jit.plan import LaunchChoice
from msa_jit.testing import make_case

HQ, HKV, PAGE, K = 16, 1, 64, 4


def _case(seed: int = 0, batch: int = 2, qlen: int = 1):
    return make_case(batch, qlen, HQ, HKV, q_dtype=torch.bfloat16, seed=seed, device="cpu",
                     ctx_lens=[200, 150][:batch], page_size=PAGE, topk_blocks=K)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("name, value, exc, words", [
    ("sm_scale", math.nan, ValueError, "sm_scale"), ("k_scale", -1.0, ValueError, "k_scale"),
    ("q_scale", math.inf, ValueError, "q_scale"), ("v_scale", 0.0, ValueError, "v_scale"),
    ("sm_scale", "x", TypeError, "sm_scale"), ("k_scale", torch.tensor([1.0, 2.0]), TypeError, "k_scale"),
    ("v_scale", True, TypeError, "v_scale"),
])
def test_reference_names_a_bad_scale(name, value, exc, words):
    c = _case()
    scales = {**c.scales(), name: value}
    with pytest.raises(exc, match=words):
        sparse_decode_reference(*c.reference_args(), **scales)


def test_reference_names_bad_tensors_and_lengths():
    c = _case()
    q, kv, topk, bt, sl, qlen = c.reference_args()
    s = c.scales()
    with pytest.raises(TypeError, match="query: expected a torch.Tensor"):
        sparse_decode_reference([1, 2], kv, topk, bt, sl, qlen, **s)
    with pytest.raises(ValueError, match=r"seq_lens: expected a 1-D tensor"):
        sparse_decode_reference(q, kv, topk, bt, sl[:1].reshape(()), qlen, **s)
    with pytest.raises(ValueError, match=r"seq_lens: expected a 1-D tensor"):
        sparse_decode_reference(q, kv, topk, bt, sl[:, None], qlen, **s)
    with pytest.raises(TypeError, match="seq_lens: expected an integer dtype"):
        sparse_decode_reference(q, kv, topk, bt, sl.double() - 0.1, qlen, **s)  # never truncated in silence
    with pytest.raises(TypeError, match="topk: expected an integer dtype"):
        sparse_decode_reference(q, kv, topk.float(), bt, sl, qlen, **s)
    with pytest.raises(ValueError, match=r"decode_query_len: expected an int in >= 1, got 0"):
        sparse_decode_reference(q, kv, topk, bt, sl, 0, **s)
    for bad in (1.7, "1", np.int64(1)):
        with pytest.raises(TypeError, match="decode_query_len: expected a Python int"):
            sparse_decode_reference(q, kv, topk, bt, sl, bad, **s)
    with pytest.raises(TypeError, match=r"numpy.int64 \(pass int\(value\)\)"):
        msa_jit.prepare(c.block_table, c.seq_lens, c.seq_lens, np.int64(1), num_q_heads=HQ, num_kv_heads=HKV,
                        page_size=PAGE, topk_blocks=K)
    # int64 index tensors stay accepted: the reference is the contract, any integer dtype
    out64, _ = sparse_decode_reference(q, kv, topk.long(), bt.long(), sl.long(), qlen, **s)
    out32, _ = sparse_decode_reference(q, kv, topk, bt, sl, qlen, **s)
    assert torch.equal(out64, out32)


def test_reference_backend_reads_the_lengths_its_plan_was_prepared_with():
    """A seq_lens changed in place after prepare reaches neither backend: both read the plan's kv_lens."""
    c = _case(seed=1)
    plan = SparseDecodePlanner(arch="sm_90a").prepare(*c.prepare_args(), **c.prepare_kwargs())
    want, _ = sparse_decode_reference(*c.reference_args(), **c.scales())
    c.seq_lens[0] = 70  # after prepare: not this step's lengths
    out = c.new_out()
    sparse_decode(c.query, c.kv_cache, c.topk, out, plan, backend="reference", **c.scales())
    assert _rel(out, want) < 1e-2


def test_planner_refuses_pins_that_are_not_what_they_look_like():
    for bad in (2.0, True, "2"):
        with pytest.raises(ValueError, match="ctas_per_sm must be None or one of"):
            SparseDecodePlanner(ctas_per_sm=bad)
    with pytest.raises(ValueError, match="ctas_per_sm must be None or one of"):
        SparseDecodePlanner(kernel="union", ctas_per_sm=True)
    with pytest.raises(TypeError, match="drafts_share_blocks must be True or False"):
        SparseDecodePlanner(drafts_share_blocks="no")
    # pins a CPU planner (no arch) cannot check against a build are still checked for what they are
    for pin, words in ((LaunchChoice(kernel="bogus"), "kernel must be one of"),
                       (LaunchChoice(split_merge="zzz"), "split_merge must be one of"),
                       (LaunchChoice(ctas_per_sm=7), "ctas_per_sm must be one of"),
                       (LaunchChoice(ctas_per_sm=2.0), "ctas_per_sm must be one of")):
        with pytest.raises(ValueError, match=words):
            SparseDecodePlanner(launches={"float8_e4m3fn": pin})
    SparseDecodePlanner(launches={"float8_e4m3fn": LaunchChoice(kernel="union", ctas_per_sm=1)})


def test_a_plans_step_shape_is_fixed_and_its_formats_answer_to_both_names():
    c = _case()
    plan = SparseDecodePlanner(arch="sm_90a").prepare(*c.prepare_args(), **c.prepare_kwargs())
    for name, value in (("qlen", 2), ("num_kv_heads", 2), ("batch", 1), ("kv_lens", torch.zeros(2))):
        with pytest.raises(AttributeError, match=f"SparseDecodePlan.{name} is fixed"):
            setattr(plan, name, value)
    assert plan.qlen == 1 and plan.num_kv_heads == HKV
    assert plan.launch("fp8") == plan.launch("float8_e4m3fn") == plan.launch()
    assert plan.config(torch.bfloat16, "fp8") == plan.config(torch.bfloat16, "float8_e4m3fn")
    assert plan.launch("nvfp4") == plan.launch("nvfp4")
    with pytest.raises(ValueError, match=r"kv_dtype: expected one of .*'fp8'.*got 'fp4'"):
        plan.launch("fp4")
    with pytest.raises(ValueError, match="kv_dtype"):
        plan.config(torch.bfloat16, torch.float8_e4m3fn)
