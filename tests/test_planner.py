"""Planner: prologue correctness, plan caching with stable addresses, split choice, op dispatch."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import dataclasses

import pytest
import torch
from helpers import FP8, make_case
from hypothesis import given, settings
from hypothesis import strategies as st

import msa_jit
from msa_jit import SparseDecodePlan, SparseDecodePlanner, sparse_decode, sparse_decode_reference
from msa_jit.planner import choose_ctas_per_sm, choose_num_splits

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _prologue():
    from msa_jit import prologue

    if DEV == "cpu" and not prologue.kernel_is_interpreted():
        pytest.skip("the Triton prologue needs CUDA or TRITON_INTERPRET=1 (set by conftest)")
    return prologue


def _expected(seq_lens: list[int], qlen: int) -> tuple[list[int], list[int]]:
    qo = [s - qlen + j for s in seq_lens for j in range(qlen)]
    return [max(p + 1, 0) for p in qo], qo


# ----------------------------------------------------------------------------- prologue
@pytest.mark.parametrize("batch,qlen", [(1, 1), (3, 4), (7, 32), (300, 1), (45, 3)])
def test_prologue_triton_matches_torch(batch, qlen):
    prologue = _prologue()
    g = torch.Generator().manual_seed(batch * 100 + qlen)
    seq = torch.randint(0, 5000, (batch,), generator=g, dtype=torch.int32)
    seq[0] = 0  # padded request: negative positions
    if batch > 1:
        seq[1] = min(qlen - 1, 1)
    seq_d = seq.to(DEV)
    T = batch * qlen
    kv_a = torch.full((T,), -99, dtype=torch.int32, device=DEV)
    qo_a = torch.full((T,), -99, dtype=torch.int32, device=DEV)
    kv_b, qo_b = kv_a.clone(), qo_a.clone()
    ptrs = (kv_a.data_ptr(), qo_a.data_ptr())
    prologue.refresh_plan_tensors(seq_d, kv_a, qo_a, qlen)
    prologue.refresh_plan_tensors_torch(seq_d, kv_b, qo_b, qlen)
    assert (kv_a.data_ptr(), qo_a.data_ptr()) == ptrs
    assert torch.equal(kv_a, kv_b) and torch.equal(qo_a, qo_b)
    exp_kv, exp_qo = _expected(seq.tolist(), qlen)
    assert kv_a.cpu().tolist() == exp_kv and qo_a.cpu().tolist() == exp_qo


@pytest.mark.parametrize("batch,qlen", [(128, 1), (64, 4), (129, 1), (1, 256), (383, 1)])
def test_prologue_writes_exactly_its_rows(batch, qlen):
    """Row counts at and around multiples of the prologue's rows per program, into buffers that go on
    past T: every row is written, and nothing after the last."""
    prologue = _prologue()
    g = torch.Generator().manual_seed(batch + qlen)
    seq = torch.randint(0, 5000, (batch,), generator=g, dtype=torch.int32)
    seq[0] = 0
    T, pad = batch * qlen, prologue.BLOCK_ROWS
    kv = torch.full((T + pad,), -99, dtype=torch.int32, device=DEV)
    qo = torch.full((T + pad,), -99, dtype=torch.int32, device=DEV)
    prologue.refresh_plan_tensors(seq.to(DEV), kv[:T], qo[:T], qlen)
    exp_kv, exp_qo = _expected(seq.tolist(), qlen)
    assert kv[:T].cpu().tolist() == exp_kv and qo[:T].cpu().tolist() == exp_qo
    assert (kv[T:] == -99).all() and (qo[T:] == -99).all()


def test_the_public_prologue_refuses_buffers_that_do_not_fit_seq_lens():
    """refresh_plan_tensors is public: a kv_lens longer than seq_lens x qlen would have the kernel read
    past seq_lens (on a GPU, out of bounds); an int64 seq_lens would be read as int32 pairs."""
    prologue = _prologue()
    seq = torch.tensor([5, 9], dtype=torch.int32)
    kv, qo = torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    for fn in (prologue.refresh_plan_tensors, prologue.refresh_plan_tensors_torch):
        with pytest.raises(ValueError, match=r"kv_lens / qo_offset: expected 2 rows"):
            fn(seq, kv, qo, 1)
        with pytest.raises(TypeError, match="seq_lens: expected dtype int32"):
            fn(seq.long(), kv, qo, 2)
        with pytest.raises(ValueError, match="qlen: expected an int >= 1"):
            fn(seq, kv, qo, 0)
        with pytest.raises(ValueError, match="kv_lens: expected a contiguous 1-D tensor"):
            fn(seq, torch.zeros(8, dtype=torch.int32)[::2], qo, 2)
    prologue.refresh_plan_tensors_torch(seq, kv, qo, 2)
    assert kv.tolist() == [4, 5, 8, 9]


def test_prepare_runs_the_triton_prologue(monkeypatch):
    prologue = _prologue()

    def boom(*a, **k):
        raise AssertionError("torch fallback used although the Triton prologue can run")

    if DEV == "cpu":  # on CUDA the torch formula runs once, to verify the bound launch
        monkeypatch.setattr(prologue, "refresh_plan_tensors_torch", boom)
    c = _case(batch=5, qlen=3, seed=4)
    p = SparseDecodePlanner().prepare(*c.prepare_args(), **c.prepare_kwargs())
    if DEV == "cuda":  # the bound launch, replayed from a CUDA graph outside a caller's capture
        assert p.refresh.__name__ == "graphed" and p.refresh.bound.__name__ == "bound"
    exp_kv, exp_qo = _expected(c.seq_lens_cpu.tolist(), c.qlen)
    assert p.kv_lens.cpu().tolist() == exp_kv and p.qo_offset.cpu().tolist() == exp_qo


@pytest.mark.gpu
def test_bound_refresh_takes_the_direct_launch_and_stays_correct():
    """On CUDA the plan's refresh is the bound CompiledKernel launch (not the fallback), it
    follows the live seq_lens values, and a seq_lens with another 16-byte alignment than the
    one the kernel was specialized for still gets the right answer (plain launch)."""
    from msa_jit import prologue

    qlen, batch = 3, 37
    seq = torch.randint(0, 5000, (batch,), dtype=torch.int32, device="cuda")
    kv = torch.empty(batch * qlen, dtype=torch.int32, device="cuda")
    qo = torch.empty_like(kv)
    assert prologue.bind_refresh(seq, kv, qo, qlen, graphs=False).__name__ == "bound"
    refresh = prologue.bind_refresh(seq, kv, qo, qlen)  # that launch, replayed from a CUDA graph
    assert refresh.__name__ == "graphed" and refresh.bound.__name__ == "bound"
    for _ in range(3):
        seq.random_(0, 5000)
        refresh(seq)
        exp_kv, exp_qo = _expected(seq.cpu().tolist(), qlen)
        assert kv.cpu().tolist() == exp_kv and qo.cpu().tolist() == exp_qo
    buf = torch.randint(0, 5000, (batch + 1,), dtype=torch.int32, device="cuda")
    odd = buf[1:]  # 4-byte offset: not 16-byte aligned
    refresh(odd)
    exp_kv, exp_qo = _expected(odd.cpu().tolist(), qlen)
    assert kv.cpu().tolist() == exp_kv and qo.cpu().tolist() == exp_qo


def test_cached_prepare_still_validates():
    """The cached-step fast path re-checks the tensors, and odd-typed ints miss it (full checks)."""
    planner = SparseDecodePlanner()
    c = _case(batch=4, qlen=2, seed=11)
    plan = planner.prepare(*c.prepare_args(), **c.prepare_kwargs())
    args = list(c.prepare_args())
    with pytest.raises(TypeError, match="seq_lens"):
        planner.prepare(args[0], args[1].to(torch.int64), *args[2:], **c.prepare_kwargs())
    with pytest.raises(ValueError, match="block_table"):
        planner.prepare(args[0][:, :1].expand(4, 8).t().contiguous().t(), *args[1:], **c.prepare_kwargs())
    kw = dict(c.prepare_kwargs(), num_q_heads=float(c.prepare_kwargs()["num_q_heads"]))
    with pytest.raises(TypeError, match="num_q_heads"):
        planner.prepare(*args, **kw)
    with pytest.raises(TypeError, match="decode_query_len"):
        planner.prepare(*args[:3], True, **c.prepare_kwargs())
    assert planner.prepare(*c.prepare_args(), **c.prepare_kwargs()) is plan


# ----------------------------------------------------------------------------- caching
def _case(batch=3, qlen=2, seed=0, **kw):
    kw.setdefault("ctx_lens", None)
    return make_case(batch, qlen, 4, 2, q_dtype=torch.bfloat16, seed=seed, device=DEV,
                     page_size=64, topk_blocks=4, **kw)


def test_same_key_same_plan_and_addresses():
    planner = SparseDecodePlanner()
    c = _case()
    p1 = planner.prepare(*c.prepare_args(), **c.prepare_kwargs())
    ptrs = [t.data_ptr() for t in (p1.kv_lens, p1.qo_offset, p1.partial_o, p1.partial_lse, p1.lse_scratch)]
    exp_kv, exp_qo = _expected(c.seq_lens_cpu.tolist(), c.qlen)
    assert p1.kv_lens.cpu().tolist() == exp_kv and p1.qo_offset.cpu().tolist() == exp_qo

    # next step: same shapes, longer contexts, a new block_table tensor with the same stride
    seq2 = c.seq_lens + 1
    bt2 = c.block_table.clone()
    p2 = planner.prepare(bt2, seq2, None, c.qlen, **c.prepare_kwargs())
    assert p2 is p1
    assert ptrs == [t.data_ptr() for t in (p2.kv_lens, p2.qo_offset, p2.partial_o, p2.partial_lse, p2.lse_scratch)]
    assert p2.block_table is bt2 and p2.seq_lens is seq2
    exp_kv, exp_qo = _expected(seq2.cpu().tolist(), c.qlen)
    assert p2.kv_lens.cpu().tolist() == exp_kv and p2.qo_offset.cpu().tolist() == exp_qo
    assert len(planner.plans) == 1


def test_plan_fields_and_workspace_shapes():
    planner = SparseDecodePlanner(num_sms=8)
    c = _case(batch=2, qlen=3)
    p = planner.prepare(*c.prepare_args(), **c.prepare_kwargs())
    T, G = 6, 2
    assert (p.batch, p.qlen, p.num_tokens, p.group_size) == (2, 3, T, G)
    assert (p.num_q_heads, p.num_kv_heads, p.page_size, p.topk_blocks, p.head_dim) == (4, 2, 64, 4, 128)
    assert p.block_table_stride == c.block_table.stride(0)
    assert p.launch().num_splits == choose_num_splits(T * 2, 4, 8) == p.launch("float8_e4m3fn").num_splits
    assert p.launch("nvfp4").num_splits == choose_num_splits(T * 2, 4, 8, "nvfp4") == p.launch("nvfp4").num_splits
    S = max(p.launch().num_splits, p.launch("nvfp4").num_splits)  # one workspace serves both cache formats
    assert p.kv_lens.dtype == p.qo_offset.dtype == torch.int32 and p.kv_lens.shape == (T,)
    rows = T * 2 * S if S > 1 else 1  # a workspace only where some format splits
    assert p.partial_o.shape == (rows, G, 128) and p.partial_o.dtype == torch.float32
    assert p.partial_lse.shape == (rows, G) and p.partial_lse.dtype == torch.float32
    assert p.lse_scratch.shape == (T, 4) and p.lse_scratch.dtype == torch.float32
    assert p.key in planner.plans and planner.plans[p.key] is p


def test_an_unsplit_plan_holds_no_split_workspace():
    """Neither format splits (64/4 B=256 on 132 SMs): one row, not T*Hkv (an engine keeps a plan per
    CUDA-graph batch size); a split plan keeps T*Hkv*S rows."""
    planner = SparseDecodePlanner(num_sms=132, arch="sm_90a")
    big = planner.prepare(*make_case(256, 1, 64, 4, q_dtype=torch.bfloat16, seed=1).prepare_args(),
                          num_q_heads=64, num_kv_heads=4, page_size=128, topk_blocks=16)
    assert big.launch().num_splits == big.launch("nvfp4").num_splits == 1
    assert big.partial_o.shape == (1, 16, 128) and big.partial_lse.shape == (1, 16)
    small = planner.prepare(*make_case(2, 1, 64, 4, q_dtype=torch.bfloat16, seed=1).prepare_args(),
                            num_q_heads=64, num_kv_heads=4, page_size=128, topk_blocks=16)
    assert small.launch().num_splits == 8 and small.partial_o.shape == (2 * 4 * 16, 16, 128)  # NVFP4's 16


def test_different_keys_different_plans():
    planner = SparseDecodePlanner()
    c = _case(batch=3, qlen=2)
    base = planner.prepare(*c.prepare_args(), **c.prepare_kwargs())
    others = []
    c2 = _case(batch=4, qlen=2, seed=1)
    others.append(planner.prepare(*c2.prepare_args(), **c2.prepare_kwargs()))
    c3 = _case(batch=3, qlen=3, seed=2)
    others.append(planner.prepare(*c3.prepare_args(), **c3.prepare_kwargs()))
    wide = torch.zeros(3, c.block_table.shape[1] + 8, dtype=torch.int32, device=DEV)
    wide[:, : c.block_table.shape[1]] = c.block_table
    others.append(planner.prepare(wide[:, : c.block_table.shape[1]], c.seq_lens, c.seq_lens_cpu, 2,
                                  **c.prepare_kwargs()))
    kw = dict(c.prepare_kwargs(), topk_blocks=5)
    others.append(planner.prepare(*c.prepare_args(), **kw))
    kw = dict(c.prepare_kwargs(), num_q_heads=8)
    others.append(planner.prepare(*c.prepare_args(), **kw))
    assert len({id(p) for p in [base, *others]}) == 6
    assert len(planner.plans) == 6
    assert planner.prepare(*c.prepare_args(), **c.prepare_kwargs()) is base


def test_module_level_prepare_uses_default_planner():
    from msa_jit.planner import default_planner

    c = _case(batch=2, qlen=1, seed=9)
    p = msa_jit.prepare(*c.prepare_args(), **c.prepare_kwargs())
    assert default_planner().plans[p.key] is p
    assert msa_jit.prepare(*c.prepare_args(), **c.prepare_kwargs()) is p


# ----------------------------------------------------------------------------- splits
KV_FORMATS = ("float8_e4m3fn", "nvfp4")


def _two_waves(rows: int, topk: int, sms: int) -> int:
    """The union kernel's rule, and the token kernel's below its fill thresholds: ~2 waves, normalized."""
    raw = min(topk, -(-2 * sms // rows))
    return -(-topk // -(-topk // raw))


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 100_000), topk=st.integers(1, 32), sms=st.integers(1, 200),
       kv=st.sampled_from(KV_FORMATS), kernel=st.sampled_from(("token", "union")), cluster=st.booleans())
def test_choose_num_splits_properties(rows, topk, sms, kv, kernel, cluster):
    from msa_jit.geometry import MAX_CLUSTER_SPLITS
    from msa_jit.planner import CLUSTER_WAVE_FORMATS, ONE_SPLIT_FILL

    s = choose_num_splits(rows, topk, sms, kv, kernel, cluster)
    assert isinstance(s, int) and 1 <= s <= topk
    if rows >= sms:
        assert s == 1
    per = -(-topk // s)
    assert (s - 1) * per < topk  # no empty split for a full row
    # monotone: more rows never asks for more splits
    assert choose_num_splits(rows + 1, topk, sms, kv, kernel, cluster) <= s
    if rows >= sms:
        return
    wave = None
    if kernel == "token" and cluster and kv in CLUSTER_WAVE_FORMATS:
        # one wave merged in the cluster: the largest power of two with rows * p <= sms, capped, normalized,
        # taken when it stays a power of two (its rows then fit the cluster merge at every G <= 16)
        p = max(p for p in (1, 2, 4, 8, 16, 32, 64, 128) if rows * p <= sms)
        wave = -(-topk // -(-topk // min(p, topk, MAX_CLUSTER_SPLITS)))
        wave = wave if wave & (wave - 1) == 0 else None
    if kernel == "token" and rows > ONE_SPLIT_FILL[kv] * sms:
        assert s == 1  # T*Hkv fills most SMs: one CTA streams all of its (token, head)'s blocks
    elif wave is not None:
        assert s == wave and rows * s <= sms  # at most one CTA per SM: the cluster merge's grid
    else:
        assert s == _two_waves(rows, topk, sms)  # a small grid: enough work for ~2 waves


def test_choose_num_splits_examples():
    assert choose_num_splits(1, 16, 132) == 16
    assert choose_num_splits(4, 16, 132) == 16
    # fp8 with the cluster merge: one wave of power-of-two splits
    assert choose_num_splits(7, 16, 132) == 16      # 112 CTAs: 8 splits would leave 56
    # fewer, longer splits while >= SPLIT_MIN_CTAS CTAs of <= SPLIT_MAX_BLOCKS blocks (plan-sweep-h100.json)
    assert choose_num_splits(8, 16, 132) == 8 == choose_num_splits(15, 16, 132)  # 64 CTAs of 2 blocks
    assert choose_num_splits(16, 16, 132) == 4 == choose_num_splits(33, 16, 132)  # 64 CTAs of 4, 132 CTAs
    assert choose_num_splits(32, 16, 132) == 4      # not 2: 64 CTAs of 8 blocks were slower
    assert choose_num_splits(34, 16, 132) == 2 == choose_num_splits(66, 16, 132)  # 132 CTAs: one per SM
    # a topk that is no power of two: one wave only where it normalizes to a power of two (its rows fit the
    # cluster merge at every G), else the two-wave rule
    assert choose_num_splits(17, 12, 132) == 4      # 4 wanted -> 3 slots per split -> 4 splits (68 CTAs)
    assert choose_num_splits(12, 12, 132) == 12     # 8 wanted -> 6 splits, not a power of two: two waves
    assert choose_num_splits(1, 32, 132) == 16      # at most MAX_CLUSTER_SPLITS (a cluster of 16 CTAs)
    assert choose_num_splits(1, 24, 132) == 24      # 16 -> 12 splits of 2 slots, no power of two: two waves
    assert choose_num_splits(67, 16, 132) == 1      # fp8 above half the SMs: unsplit
    assert choose_num_splits(132, 16, 132) == 1
    assert choose_num_splits(10_000, 16, 132) == 1
    # NVFP4: two waves up to 0.7 of the SMs, then unsplit
    assert choose_num_splits(64, 16, 132, "nvfp4") == 4
    assert choose_num_splits(88, 16, 132, "nvfp4") == 3    # 3 splits of 6, 6, 4
    assert choose_num_splits(93, 16, 132, "nvfp4") == 1
    # the union kernel's grid keeps the two-wave rule
    assert choose_num_splits(100, 16, 132, kernel="union") == 3
    # where 2 splits cannot merge in the cluster the two-wave rule holds up to half the SMs (2 splits merged by
    # the merge kernel were 0.94-1.19x the two-wave plan); unsplit above half either way
    assert choose_num_splits(16, 16, 132, cluster_merge=False) == 16
    assert choose_num_splits(32, 16, 132, cluster_merge=False) == 8  # 9 wanted -> 2 slots per split -> 8 splits
    assert choose_num_splits(48, 16, 132, cluster_merge=False) == 6
    assert choose_num_splits(64, 16, 132, cluster_merge=False) == 4
    assert choose_num_splits(67, 16, 132, cluster_merge=False) == 1
    for rows in (4, 200):  # checked before any early answer
        with pytest.raises(ValueError, match="kv_dtype"):
            choose_num_splits(rows, 16, 132, "fp8")
        with pytest.raises(ValueError, match="kernel"):
            choose_num_splits(rows, 16, 132, kernel="unoin")


@pytest.mark.parametrize("T,fp8,nvfp4", [(12, (2, "cluster"), (6, "kernel")), (22, (1, "kernel"), (3, "kernel")),
                                         (2, (8, "cluster"), (16, "cluster"))])
def test_plan_takes_each_formats_split_count(T, fp8, nvfp4):
    """64/4 on 132 SMs: T*Hkv = 48 / 88 / 8 split per cache format, each with its own merge."""
    planner = SparseDecodePlanner(num_sms=132, arch="sm_90a")
    c = make_case(T, 1, 64, 4, q_dtype=torch.bfloat16, seed=3)
    p = planner.prepare(*c.prepare_args(), **c.prepare_kwargs())
    assert (p.launch().num_splits, p.launch().split_merge) == fp8
    assert (p.launch("nvfp4").num_splits, p.launch("nvfp4").split_merge) == nvfp4
    assert p.partial_o.shape[0] == T * 4 * max(fp8[0], nvfp4[0])


@pytest.mark.parametrize("how", ["split_merge=kernel", "sm_100a", "ctas_per_sm=3"])
def test_two_splits_only_where_they_merge_in_the_cluster(how):
    """64/4 B=12 (T*Hkv = 48) on 132 SMs: fp8 takes 2 splits merged in the cluster by default; where the
    cluster merge cannot serve (pinned off, an arch without it, the 3-CTA build) the two-wave
    rule's 6 splits."""
    c = make_case(12, 1, 64, 4, q_dtype=torch.bfloat16, seed=5)
    default = SparseDecodePlanner(num_sms=132, arch="sm_90a").prepare(*c.prepare_args(), **c.prepare_kwargs())
    assert (default.launch().num_splits, default.launch().split_merge) == (2, "cluster")
    kw = {"split_merge=kernel": dict(split_merge="kernel"), "sm_100a": dict(arch="sm_100a"),
          "ctas_per_sm=3": dict(ctas_per_sm=3)}[how]
    p = SparseDecodePlanner(**{"num_sms": 132, "arch": "sm_90a", **kw}).prepare(*c.prepare_args(), **c.prepare_kwargs())
    assert (p.launch().num_splits, p.launch().split_merge) == (6, "kernel")


# ----------------------------------------------------------------------------- occupancy
@settings(max_examples=200, deadline=None)
@given(grid=st.integers(1, 100_000), sms=st.integers(1, 200))
def test_choose_ctas_per_sm_properties(grid, sms):
    n = choose_ctas_per_sm(grid, sms, (2, 3))
    assert n == (3 if sms < grid <= 3 * sms else 2)
    assert choose_ctas_per_sm(grid, sms, (2,)) == 2  # a kernel built for 2 only never gets 3


def test_choose_ctas_per_sm_examples():
    # H200 (132 SMs): batch 1 (64 CTAs) 2; one-wave grids (256 CTAs: 64/4 B=4/16/64, 8/1 B=256;
    # 320 / 384) 3; from 1.3 waves at 3 per SM on (512, 1024 CTAs) 2
    assert [choose_ctas_per_sm(g, 132, (2, 3)) for g in (64, 132, 256, 320, 396, 397, 512, 1024)] == \
        [2, 2, 3, 3, 3, 2, 2, 2]


@pytest.mark.parametrize("batch,splits,ctas", [(1, 16, 2), (4, 4, 2), (8, 4, 2), (16, 2, 2), (22, 1, 2), (64, 1, 3), (80, 1, 3),
                                               (128, 1, 2), (256, 1, 2)])
def test_planner_picks_occupancy_per_step_shape(batch, splits, ctas):
    bt = torch.zeros(batch, 8, dtype=torch.int32, device=DEV)
    sl = torch.full((batch,), 1000, dtype=torch.int32, device=DEV)
    planner = SparseDecodePlanner(num_sms=132, arch="sm_90a")
    plan = planner.prepare(bt, sl, None, 1, num_q_heads=64, num_kv_heads=4, page_size=128, topk_blocks=16)
    assert (plan.launch().num_splits, plan.launch().ctas_per_sm) == (splits, ctas)
    if DEV == "cpu":
        assert plan.config(torch.bfloat16).ctas_per_sm == ctas
    # pinned: every shape gets the pinned occupancy
    pinned = SparseDecodePlanner(num_sms=132, arch="sm_90a", ctas_per_sm=2)
    plan = pinned.prepare(bt, sl, None, 1, num_q_heads=64, num_kv_heads=4, page_size=128, topk_blocks=16)
    assert plan.launch().ctas_per_sm == 2


def test_pinned_occupancy_is_checked(monkeypatch):
    with pytest.raises(ValueError, match="ctas_per_sm"):
        SparseDecodePlanner(ctas_per_sm=4)
    if DEV != "cpu":
        pytest.skip("CPU plans name their arch")
    c = _case()  # T*Hkv = 12 CTAs: one wave at 3 per SM on 8 SMs
    assert SparseDecodePlanner(arch="sm_100a", num_sms=8).prepare(*c.prepare_args(), **c.prepare_kwargs()).launch().ctas_per_sm == 3
    from msa_jit.jit import registry

    # a registry whose token kernel is built for 2 CTAs per SM only: the planner picks 2, a pinned 3 is refused
    monkeypatch.setitem(registry.KERNEL_REGISTRY, "token",
                        dataclasses.replace(registry.KERNEL_REGISTRY["token"], occupancies=(2,)))
    assert SparseDecodePlanner(arch="sm_100a", num_sms=8).prepare(*c.prepare_args(), **c.prepare_kwargs()).launch().ctas_per_sm == 2
    with pytest.raises(ValueError, match="built for"):
        SparseDecodePlanner(arch="sm_100a", ctas_per_sm=3).prepare(*c.prepare_args(), **c.prepare_kwargs())


def test_pinned_launches_are_taken_as_given_and_checked():
    """SparseDecodePlanner(launches=...): a cache format's whole launch pinned at every step shape (a plan
    A/B), the workspace sized for its splits; builds that cannot serve the geometry are refused at the
    first prepare, malformed pins and pins mixed with the other pins at construction."""
    from msa_jit.plan import LaunchChoice

    bt = torch.zeros(4, 128, dtype=torch.int32)
    sl = torch.full((4,), 16384, dtype=torch.int32)
    kw = dict(num_q_heads=64, num_kv_heads=4, page_size=128, topk_blocks=16)
    own = SparseDecodePlanner(num_sms=132, arch="sm_90a").prepare(bt, sl, None, 1, **kw)
    for pin in (LaunchChoice("token", 3, 16, "kernel"), LaunchChoice("token", 2, 1, "cluster"),
                LaunchChoice("union", 1, 2, "kernel")):
        plan = SparseDecodePlanner(num_sms=132, arch="sm_90a", launches={"float8_e4m3fn": pin}).prepare(bt, sl, None, 1, **kw)
        assert plan.launch() == pin and plan.launch("nvfp4") == own.launch("nvfp4")
        S = max(pin.num_splits, own.launch("nvfp4").num_splits)
        assert plan.partial_o.shape == (4 * 4 * S, 16, 128) and plan.partial_lse.shape == (4 * 4 * S, 16)
        assert plan.config(torch.bfloat16).kernel == pin.kernel and plan.config(torch.bfloat16).split_merge == pin.split_merge
    nvfp4 = LaunchChoice("token", 2, 8, "cluster")
    plan = SparseDecodePlanner(num_sms=132, arch="sm_90a", launches={"nvfp4": nvfp4}).prepare(bt, sl, None, 1, **kw)
    assert plan.launch("nvfp4") == nvfp4 and plan.launch() == own.launch()
    for pin, match in ((LaunchChoice("token", 3, 4, "cluster"), "ctas_per_sm=2"),
                       (LaunchChoice("token", 2, 17, "kernel"), "num_splits=17 > topk_blocks=16"),
                       (LaunchChoice("union", 2, 1, "kernel"), "union kernel")):
        fmt = "nvfp4" if pin.kernel == "union" else "float8_e4m3fn"  # the union reads an fp8 cache only
        with pytest.raises(ValueError, match=match):
            SparseDecodePlanner(num_sms=132, arch="sm_90a", launches={fmt: pin}).prepare(bt, sl, None, 1, **kw)
    for bad, match in (({"fp8": LaunchChoice()}, "cache format 'fp8'"), ({"nvfp4": (2, 1)}, "expected a LaunchChoice"),
                       ({"nvfp4": LaunchChoice(num_splits=0)}, "num_splits must be an int >= 1")):
        with pytest.raises(ValueError, match=match):
            SparseDecodePlanner(launches=bad)
    with pytest.raises(ValueError, match="without kernel=, ctas_per_sm= or split_merge="):
        SparseDecodePlanner(split_merge="kernel", launches={"nvfp4": LaunchChoice()})


# ----------------------------------------------------------------------------- op
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_op_reference_backend_matches_reference(q_dtype, backend):
    if backend == "auto" and DEV == "cuda":
        pytest.skip("auto means the kernel on CUDA")
    c = make_case(3, 2, 8, 2, q_dtype=q_dtype, seed=21, device=DEV, page_size=64, topk_blocks=5,
                  transposed_topk=True, padded=True)
    plan = SparseDecodePlanner().prepare(*c.prepare_args(), **c.prepare_kwargs())
    out, lse = c.new_out(), c.new_lse()
    ptr = out.data_ptr()
    assert sparse_decode(c.query, c.kv_cache, c.topk, out, plan, lse=lse, backend=backend, **c.scales()) is None
    ref_o, ref_l = sparse_decode_reference(*c.reference_args(), **c.scales())
    assert out.data_ptr() == ptr
    assert torch.equal(out.cpu(), ref_o.to(torch.bfloat16))
    assert torch.equal(lse.cpu(), ref_l.to(torch.float32))
    assert not torch.isnan(out).any()
    # without lse: out only; uint8 KV storage accepted
    out2 = c.new_out()
    sparse_decode(c.query, c.kv_cache.view(torch.uint8), c.topk, out2, plan, backend=backend, **c.scales())
    assert torch.equal(out2, out)


def test_resolve_kernel_uses_compiler_and_caches(monkeypatch):
    calls = []

    def fake_get(config):
        calls.append(config)
        return lambda *a: None

    fake = types.ModuleType("msa_jit.jit.compiler")
    fake.get_sparse_decode_kernel = fake_get
    fake.supported_ctas_per_sm = lambda arch: (2, 3)
    monkeypatch.setitem(sys.modules, "msa_jit.jit.compiler", fake)
    c = _case()
    plan = SparseDecodePlanner(arch="sm_100a").prepare(*c.prepare_args(), **c.prepare_kwargs())
    if DEV == "cpu":
        assert plan.arch == "sm_100a"
    f1 = plan.resolve_kernel(torch.bfloat16)
    assert plan.resolve_kernel("bfloat16") is f1
    plan.resolve_kernel(FP8)
    f3 = plan.resolve_kernel(torch.bfloat16, "nvfp4")
    assert f3 is not f1 and plan.resolve_kernel(torch.bfloat16, "nvfp4") is f3
    assert [(cfg.q_dtype, cfg.kv_dtype) for cfg in calls] == [
        ("bfloat16", "float8_e4m3fn"), ("float8_e4m3fn", "float8_e4m3fn"), ("bfloat16", "nvfp4")]
    cfg = calls[0]
    assert (cfg.num_q_heads, cfg.num_kv_heads, cfg.page_size, cfg.topk_blocks, cfg.head_dim) == (4, 2, 64, 4, 128)
    assert set(plan.kernels) == {(torch.bfloat16, "float8_e4m3fn"), (FP8, "float8_e4m3fn"), (torch.bfloat16, "nvfp4")}


def test_resolve_kernel_without_arch_on_cpu():
    if DEV != "cpu":
        pytest.skip("CPU-only behaviour")
    c = _case()
    plan = SparseDecodePlanner().prepare(*c.prepare_args(), **c.prepare_kwargs())
    with pytest.raises(RuntimeError, match="arch"):
        plan.resolve_kernel(torch.bfloat16)


@pytest.mark.gpu
def test_kernel_backend_passes_calling_convention(monkeypatch):
    """With a fake compiler, check the exact argument list of the kernel call (msa_jit/kernels/convention.py):
    the first call (checked path, which resolves the kernel) and the next (fast path) alike."""
    import math

    from msa_jit.kernels import convention

    conv = convention
    seen = []
    fake = types.ModuleType("msa_jit.jit.compiler")
    fake.get_sparse_decode_kernel = lambda cfg: (lambda *a: seen.append(a))
    fake.supported_ctas_per_sm = lambda arch: (2, 3)
    # the split plan below takes the cluster merge on sm_90a (the default): the stand-in compiler
    # says its cluster fits, as plan.resolve_kernel asks before the first launch
    fake.cluster_launch_fits = lambda cfg, num_splits, device_index: True
    fake.convention = convention
    monkeypatch.setitem(sys.modules, "msa_jit.jit.compiler", fake)
    c = make_case(2, 2, 8, 2, q_dtype=FP8, seed=3, device="cuda", page_size=64, topk_blocks=4)
    plan = SparseDecodePlanner().prepare(*c.prepare_args(), **c.prepare_kwargs())
    out = c.new_out()
    for _ in range(2):
        sparse_decode(c.query, c.kv_cache, c.topk, out, plan, backend="kernel", **c.scales())
    assert len(seen) == 2
    for args in seen:
        a = dict(zip(conv.ARGUMENT_NAMES, args))
        assert len(args) == len(conv.ARGUMENTS)
        # torch's fp8 query and cache go in as they are (no per-call uint8 view)
        assert a["query"] is c.query and a["query"].dtype == FP8
        assert a["kv_cache"] is c.kv_cache and a["kv_cache"].dtype == FP8
        assert a["topk"] is c.topk and a["block_table"] is plan.block_table
        # the plan's own tensors travel as the TVM-FFI views made once per plan (same memory)
        kv_lens, lse_scratch, partial_o, partial_lse, unit = plan.kernel_tensors()
        assert a["kv_lens"] is kv_lens and a["out"] is out and a["lse"] is lse_scratch
        assert a["partial_o"] is partial_o and a["partial_lse"] is partial_lse
        assert a["k_scale_tensor"] is unit and a["v_scale_tensor"] is unit
        assert (a["qlen"], a["num_splits"]) == (plan.qlen, plan.launch().num_splits)
        assert math.isclose(a["qk_scale_log2"], c.sm_scale * c.q_scale * c.k_scale / math.log(2))
        assert a["v_scale"] == c.v_scale


def test_kernel_tensors_alias_the_plan_tensors():
    """The TVM-FFI views handed to the kernel are the plan's memory, so in-place refreshes reach it."""
    pytest.importorskip("tvm_ffi")
    c = _case(batch=3, qlen=2, seed=5)
    plan = SparseDecodePlanner().prepare(*c.prepare_args(), **c.prepare_kwargs())
    views = plan.kernel_tensors()
    assert plan.kernel_tensors() is views  # converted once
    for view, t in zip(views, (plan.kv_lens, plan.lse_scratch, plan.partial_o, plan.partial_lse)):
        back = torch.from_dlpack(view)
        assert back.data_ptr() == t.data_ptr() and back.shape == t.shape and back.dtype == t.dtype
    plan.kv_lens.fill_(1234)
    assert torch.from_dlpack(views[0]).eq(1234).all()


@pytest.mark.gpu
def test_prepare_is_cuda_graph_capturable():
    """A captured prepare() replays the prologue on the live seq_lens: no sync, no allocation."""
    planner = SparseDecodePlanner()
    c = make_case(6, 3, 8, 2, q_dtype=torch.bfloat16, seed=8, device="cuda", page_size=64, topk_blocks=4)
    seq = c.seq_lens.clone()
    plan = planner.prepare(c.block_table, seq, c.seq_lens_cpu, c.qlen, **c.prepare_kwargs())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        planner.prepare(c.block_table, seq, None, c.qlen, **c.prepare_kwargs())
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        assert planner.prepare(c.block_table, seq, None, c.qlen, **c.prepare_kwargs()) is plan
    for bump in (5, 77, -2):
        seq.add_(bump)
        g.replay()
        torch.cuda.synchronize()
        exp_kv, exp_qo = _expected(seq.cpu().tolist(), c.qlen)
        assert plan.kv_lens.cpu().tolist() == exp_kv and plan.qo_offset.cpu().tolist() == exp_qo


def test_import_is_light():
    code = "import sys, msa_jit; bad = [m for m in ('triton', 'cutlass') if m in sys.modules]; print(bad)"
    env = dict(os.environ)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_plan_is_plain_object():
    assert SparseDecodePlan.__eq__ is object.__eq__


@pytest.mark.gpu
@pytest.mark.parametrize("trigger", [True, False])
def test_prologue_signals_dependent_launch(trigger):
    """The bound prologue starts with griddepcontrol.launch_dependents (unless asked not to)."""
    from msa_jit.prologue import bind_refresh

    c = make_case(4, 2, 8, 2, q_dtype=torch.bfloat16, seed=9, device="cuda", page_size=64, topk_blocks=4)
    kv = torch.zeros(8, dtype=torch.int32, device="cuda")
    qo = torch.zeros(8, dtype=torch.int32, device="cuda")
    refresh = bind_refresh(c.seq_lens, kv, qo, 2, launch_dependents=trigger)
    ptx = refresh.compiled.asm["ptx"]
    assert ("griddepcontrol.launch_dependents" in ptx) == trigger
    exp_kv, exp_qo = _expected(c.seq_lens.cpu().tolist(), 2)
    assert kv.cpu().tolist() == exp_kv and qo.cpu().tolist() == exp_qo


def test_nvfp4_takes_three_ctas_per_sm_above_one_wave():
    """NVFP4 (latency-bound, 3 stages fit at 3 per SM): 3 per SM for every grid past one CTA per SM,
    2 below; fp8 keeps its one-wave rule; a pinned planner pins both formats (docs/performance.md)."""
    from msa_jit.planner import choose_ctas_per_sm

    assert choose_ctas_per_sm(1024, 132, (2, 3), "nvfp4") == 3
    assert choose_ctas_per_sm(1024, 132, (2, 3)) == 2
    assert choose_ctas_per_sm(256, 132, (2, 3), "nvfp4") == choose_ctas_per_sm(256, 132, (2, 3)) == 3
    assert choose_ctas_per_sm(64, 132, (2, 3), "nvfp4") == 2
    assert choose_ctas_per_sm(1024, 132, (2,), "nvfp4") == 2  # an arch without the 3-CTA build
    c = _case(batch=64, qlen=4, seed=9)
    plan = SparseDecodePlanner(num_sms=16, arch="sm_90a").prepare(*c.prepare_args(), **c.prepare_kwargs())
    assert (plan.launch().ctas_per_sm, plan.launch("nvfp4").ctas_per_sm) == (2, 3)  # 512 CTAs on 16 SMs: 10.7 waves at 3
    assert plan.config(torch.bfloat16, "nvfp4").ctas_per_sm == 3
    assert plan.config(torch.bfloat16).ctas_per_sm == plan.launch().ctas_per_sm
    pinned = SparseDecodePlanner(num_sms=16, arch="sm_90a", ctas_per_sm=2).prepare(*c.prepare_args(), **c.prepare_kwargs())
    assert pinned.config(torch.bfloat16, "nvfp4").ctas_per_sm == pinned.config(torch.bfloat16).ctas_per_sm == 2


def test_nvfp4_three_cta_build_keeps_three_stages():
    from msa_jit.kernels.token import SparseDecodeTokenKernel

    assert SparseDecodeTokenKernel.occupancy_options(3, "bfloat16", "nvfp4")["stages"] == 3
    assert SparseDecodeTokenKernel.occupancy_options(3, "bfloat16")["stages"] == 2
    assert SparseDecodeTokenKernel.occupancy_options(2, "bfloat16", "nvfp4") == {}


@pytest.mark.gpu
def test_refresh_replays_one_graph_per_seq_lens_address():
    """Eager prepare replays the prologue from a CUDA graph captured once per seq_lens address
    (the live values are read at every replay); another address gets its own graph, one of the
    other 16-byte alignment none (its plain launch might compile), and at most
    MAX_REFRESH_GRAPHS addresses are captured."""
    from msa_jit.prologue import MAX_REFRESH_GRAPHS

    c = _case(batch=5, qlen=3, seed=7)
    planner = SparseDecodePlanner()
    args, kw = c.prepare_args(), c.prepare_kwargs()
    p = planner.prepare(*args, **kw)
    seq = c.seq_lens
    assert list(p.refresh.replays) == [seq.data_ptr()]
    for delta in (0, -2, 5):
        seq.add_(delta)
        p.kv_lens.fill_(-9)
        assert planner.prepare(args[0], seq, None, *args[3:], **kw) is p
        exp_kv, exp_qo = _expected(seq.cpu().tolist(), c.qlen)
        assert p.kv_lens.cpu().tolist() == exp_kv and p.qo_offset.cpu().tolist() == exp_qo
    assert len(p.refresh.replays) == 1
    buf = torch.zeros(64, dtype=torch.int32, device="cuda")
    others = [buf[16 * i:16 * i + seq.numel()] for i in range(4)] + [buf[1:1 + seq.numel()]]
    for other in others:
        other.copy_(seq - 1)
        p.kv_lens.fill_(-9)
        planner.prepare(args[0], other, None, *args[3:], **kw)
        exp_kv, exp_qo = _expected(other.cpu().tolist(), c.qlen)
        assert p.kv_lens.cpu().tolist() == exp_kv and p.qo_offset.cpu().tolist() == exp_qo
    assert others[-1].data_ptr() not in p.refresh.replays  # misaligned: plain launch
    assert len(p.refresh.replays) == MAX_REFRESH_GRAPHS


@pytest.mark.gpu
def test_refresh_inside_a_capture_launches_the_kernel():
    """prepare inside the caller's CUDA-graph capture records the prologue kernel itself (no
    graph of ours), so the caller's replays follow seq_lens."""
    c = _case(batch=4, qlen=2, seed=8)
    planner = SparseDecodePlanner()
    args, kw = c.prepare_args(), c.prepare_kwargs()
    p = planner.prepare(*args, **kw)
    seq = c.seq_lens.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(g, stream=side):
            planner.prepare(args[0], seq, None, *args[3:], **kw)
    torch.cuda.current_stream().wait_stream(side)
    assert seq.data_ptr() not in p.refresh.replays
    for delta in (3, -1):
        seq.add_(delta)
        p.kv_lens.fill_(-9)
        g.replay()
        torch.cuda.synchronize()
        exp_kv, exp_qo = _expected(seq.cpu().tolist(), c.qlen)
        assert p.kv_lens.cpu().tolist() == exp_kv and p.qo_offset.cpu().tolist() == exp_qo


@pytest.mark.parametrize("num_sms", [0, -1, "8", 8.0, True])
def test_planner_rejects_a_bad_num_sms(num_sms):
    with pytest.raises(ValueError, match=r"^num_sms must be None or an int >= 1"):
        SparseDecodePlanner(num_sms=num_sms)


def test_a_kernel_is_never_resolved_inside_graph_capture(monkeypatch):
    """The first call of a plan's kernel inside CUDA-graph capture is refused before anything is
    compiled or loaded (a compile takes seconds; capture wants the eager warm-up first)."""
    from msa_jit.jit import compiler

    c = _case()
    plan = SparseDecodePlanner(arch="sm_90a").prepare(*c.prepare_args(), **c.prepare_kwargs())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(compiler, "get_sparse_decode_kernel", lambda cfg: pytest.fail("resolved inside capture"))
    with pytest.raises(RuntimeError, match="inside CUDA-graph capture: run the step once eagerly"):
        plan.resolve_kernel(torch.bfloat16)
    assert plan.kernels == {}
