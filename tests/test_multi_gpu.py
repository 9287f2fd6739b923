"""The op on a GPU other than device 0, and on two GPUs from one process (`pytest -m gpu` on a host
with two or more CUDA GPUs; skipped elsewhere): the kernels are loaded on the tensors' device, the
prologue and the launch run there whatever the current device is, a planner keeps a plan per
device, and the same inputs give the same bits on both (same GPU model, same plan).

vLLM runs one process per GPU with that GPU current; a notebook or a server that places layers on
several GPUs of one process does not, which these tests stand for."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from msa_jit import SparseDecodePlanner, sparse_decode
from msa_jit.integrations.engine import MSACutlassDecodePlanCache, msa_cutlass_sparse_decode
from msa_jit.testing import compare_with_reference, make_case

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]

# batch 1: a split step (the cluster merge on sm_90a); B=16 qlen 4: one split, 3 CTAs per SM
SHAPES = [(1, 1), (16, 4)]


def _run(planner, c, current: int | None):
    """prepare + sparse_decode of case c, with device `current` current (None: as it is); the
    outputs, poisoned before, after the device's work is done."""
    out, lse = c.new_out(), c.new_lse()
    with torch.cuda.device(current) if current is not None else contextlib.nullcontext():
        plan = planner.prepare(*c.prepare_args(), **c.prepare_kwargs())
        sparse_decode(c.query, c.kv_cache, c.topk, out, plan, lse=lse, **c.scales())
    torch.cuda.synchronize(c.device)
    return plan, out, lse


@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4"])
@pytest.mark.parametrize("batch,qlen", SHAPES, ids=["split", "one-split"])
@pytest.mark.parametrize("current", [0, 1], ids=["device0-current", "device1-current"])
def test_the_second_gpu_matches_the_reference(kv_dtype, batch, qlen, current):
    c = make_case(batch, qlen, 64, 4, q_dtype=torch.bfloat16, seed=21, device="cuda:1", kv_dtype=kv_dtype)
    plan, out, lse = _run(SparseDecodePlanner(), c, current)
    assert plan.kv_lens.device == torch.device("cuda:1") and out.device == torch.device("cuda:1")
    err, problems = compare_with_reference(c, out, lse)
    assert not problems, f"cuda:1 with cuda:{current} current: {problems}"


@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4"])
@pytest.mark.parametrize("batch,qlen", SHAPES, ids=["split", "one-split"])
def test_one_planner_serves_both_gpus_in_turn_with_the_same_bits(kv_dtype, batch, qlen):
    """Steps on cuda:0, cuda:1, cuda:0, cuda:1 through one planner (as one engine process placing
    layers on two GPUs): a plan per device, each step's output the reference's, bitwise the same on
    both GPUs (make_case draws the inputs on the CPU from the seed)."""
    planner = SparseDecodePlanner()
    cases = [make_case(batch, qlen, 64, 4, q_dtype=torch.bfloat16, seed=22, device=f"cuda:{d}", kv_dtype=kv_dtype)
             for d in (0, 1)]
    results = [_run(planner, cases[d % 2], None) for d in range(4)]
    assert results[0][0] is not results[1][0]  # a plan per device
    assert results[0][0] is results[2][0] and results[1][0] is results[3][0]  # each reused
    for i, (plan, out, lse) in enumerate(results):
        err, problems = compare_with_reference(cases[i % 2], out, lse)
        assert not problems, f"step {i} on cuda:{i % 2}: {problems}"
    for a, b in ((results[0], results[1]), (results[2], results[3])):
        assert torch.equal(a[1].cpu().view(torch.int16), b[1].cpu().view(torch.int16))
        assert torch.equal(a[2].cpu().nan_to_num(), b[2].cpu().nan_to_num())


@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4"])
def test_the_engine_adapter_on_the_second_gpu(kv_dtype):
    """vLLM's call (prepare once per step, the op per layer) on cuda:1 with cuda:0 current."""
    c = make_case(1, 1, 64, 4, q_dtype=torch.bfloat16, seed=23, device="cuda:1", kv_dtype=kv_dtype)
    s = c.scales(scale_tensors=kv_dtype == "nvfp4")
    device_scales = {k: s[k] for k in ("k_scale", "v_scale")} if kv_dtype == "nvfp4" else {}
    cache = MSACutlassDecodePlanCache()
    with torch.cuda.device(0):
        md = cache.prepare(*c.prepare_args(), **c.prepare_kwargs())
        outs = [torch.full_like(c.new_out(), math.nan) for _ in range(2)]
        for out in outs:  # two layers
            msa_cutlass_sparse_decode(c.query, c.kv_cache, c.topk, out, md, scale=c.sm_scale,
                                      q_scale_float=c.q_scale, k_scale_float=c.k_scale,
                                      v_scale_float=c.v_scale, **device_scales)
    torch.cuda.synchronize(1)
    for out in outs:
        err, problems = compare_with_reference(c, out, None)
        assert not problems, problems
