"""The union kernel's place in planning: config rules, the planner's choice and pins, warmup's
builds, and the op boundary (CPU; the kernel itself: tests/test_kernel_options.py, GPU tests in
tests/test_kernel_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_case

import msa_jit
from msa_jit import SparseDecodePlanner
from msa_jit.jit import compiler, registry
from msa_jit.geometry import SparseDecodeConfig, check_config
from msa_jit.planner import choose_kernel, choose_num_splits, choose_union_ctas_per_sm, union_grid_ctas
from msa_jit.integrations.torch_op import sparse_decode_op

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _tables(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(batch, 16, dtype=torch.int32, device=DEV),
            torch.full((batch,), 1000, dtype=torch.int32, device=DEV))


def _prepare(planner: SparseDecodePlanner, batch: int, qlen: int, hq: int = 64, hkv: int = 4, page: int = 128):
    bt, sl = _tables(batch)
    return planner.prepare(bt, sl, None, qlen, num_q_heads=hq, num_kv_heads=hkv, page_size=page, topk_blocks=16)


def test_union_grid_counts_token_tiles():
    # a CTA serves 64 // G tokens of one request and KV head
    assert union_grid_ctas(64, 4, 64, 4) == 64 * 4 * 1  # G 16: tiles of 4 tokens
    assert union_grid_ctas(64, 8, 64, 4) == 64 * 4 * 2
    assert union_grid_ctas(64, 4, 8, 1) == 64  # G 8: tiles of 8 tokens
    assert union_grid_ctas(3, 9, 8, 1) == 3 * 2
    assert union_grid_ctas(5, 1, 16, 1) == 5


def test_choose_kernel_rule():
    pick = lambda b, q, hq=64, hkv=4, page=128, arch="sm_90a", share=True: choose_kernel(b, q, hq, hkv, page, arch,
                                                                                          132, share)
    assert pick(64, 4) == "union"  # the spec-decode point: 256 CTAs, no split for either kernel
    assert pick(64, 1) == "token"  # qlen 1: nothing to share
    assert pick(16, 4) == "token"  # 64 CTAs: less than a wave, the token kernel splits
    assert pick(33, 4) == "union" and pick(32, 4) == "token"  # 132 CTAs on 132 SMs
    assert pick(64, 4, hq=8, hkv=1) == "token"  # 64 CTAs (8-token tiles)
    assert pick(256, 4, hq=8, hkv=1) == "union"
    assert pick(64, 4, page=64) == "token"  # no 64-token pages
    assert pick(64, 4, arch="sm_100a") == "token" and pick(64, 4, arch=None) == "token"
    assert pick(64, 4, hq=48, hkv=16) == "token" and pick(64, 4, hq=16, hkv=4) == "token"  # G 3, G 4


def test_choose_kernel_default_rule_takes_one_full_wave_of_one_tile_drafts():
    """By default the union only where one tile holds a request's draft (qlen <= 64 // G) and its grid
    is one wave at 2 CTAs per SM filled to UNION_WAVE_FILL (251-264 CTAs on 132 SMs): where
    tests/fixtures/union-waves/ has it no slower than the token kernel with no block shared."""
    rule = lambda b, q, hq=64, hkv=4, sms=132: choose_kernel(b, q, hq, hkv, 128, "sm_90a", sms)
    assert [rule(64, q) for q in (1, 2, 3, 4, 5, 8)] == ["token", "union", "union", "union", "token", "token"]
    # 64/4: B * 4 CTAs at qlen <= 4; one wave is 264
    assert [rule(b, 4) for b in (33, 56, 62, 63, 66, 67, 128, 256)] == ["token"] * 3 + ["union"] * 2 + ["token"] * 3
    # 8/1 (G 8): B CTAs up to qlen 8
    assert [rule(b, 8, 8, 1) for b in (132, 250, 251, 264, 265, 512)] == ["token", "token", "union", "union", "token", "token"]
    assert rule(256, 9, 8, 1) == "token" and rule(256, 4, 16, 1) == "union" and rule(256, 8, 16, 1) == "token"
    assert rule(64, 4, sms=128) == "union" and rule(64, 4, sms=148) == "token"  # the wave is the GPU's
    # drafts that share blocks: wherever its grid fills the GPU once, drafts of several tiles too
    on = lambda b, q, hq=64, hkv=4: choose_kernel(b, q, hq, hkv, 128, "sm_90a", 132, drafts_share_blocks=True)
    assert on(64, 8) == on(256, 4) == on(33, 4) == on(256, 16, 8, 1) == "union" and on(32, 4) == "token"


def test_choose_union_ctas_per_sm():
    # the 2-CTA build won at every measured grid (H200, 2026-12-05 T0205)
    assert [choose_union_ctas_per_sm(g, 132) for g in (64, 132, 133, 256, 264, 265, 1024)] == [2] * 7


def test_check_config_union_rules():
    ok = SparseDecodeConfig(64, 4, kernel="union", ctas_per_sm=1)
    assert check_config(ok) is None and check_config(SparseDecodeConfig(8, 1, kernel="union", ctas_per_sm=2)) is None
    assert "fp8 cache" in check_config(SparseDecodeConfig(64, 4, kernel="union", ctas_per_sm=1, kv_dtype="nvfp4"))
    assert "sm_90a" in check_config(SparseDecodeConfig(64, 4, kernel="union", ctas_per_sm=1, arch="sm_100a"))
    assert "page_size" in check_config(SparseDecodeConfig(64, 4, kernel="union", ctas_per_sm=1, page_size=64))
    assert "group size" in check_config(SparseDecodeConfig(48, 16, kernel="union", ctas_per_sm=1))
    assert "group size" in check_config(SparseDecodeConfig(16, 4, kernel="union", ctas_per_sm=1))
    assert "(1, 2)" in check_config(SparseDecodeConfig(64, 4, kernel="union", ctas_per_sm=3))
    assert "(2, 3)" in check_config(SparseDecodeConfig(64, 4, ctas_per_sm=1))  # the token kernel has no 1
    assert "kernel must be" in check_config(SparseDecodeConfig(64, 4, kernel="tile"))
    assert "kernel=union" in ok.describe() and "kernel=" not in SparseDecodeConfig(64, 4).describe()
    # the kernel is in the cache key
    assert compiler.cache_key(ok) != compiler.cache_key(SparseDecodeConfig(64, 4, ctas_per_sm=2, kernel="token"))
    assert registry.kernel_family(ok) == "union"
    assert registry.supported_ctas_per_sm("sm_90a", "union") == (1, 2)


def test_planner_picks_union_by_its_arguments():
    plan = _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a", kernel="token"), 64, 4)
    assert plan.launch().kernel == "token" and plan.config(torch.bfloat16).kernel == "token"
    # the default: drafts of one tile
    assert _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a"), 64, 4).launch().kernel == "union"
    assert _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a"), 64, 8).launch().kernel == "token"
    sharing = SparseDecodePlanner(num_sms=132, arch="sm_90a", drafts_share_blocks=True)
    assert _prepare(sharing, 64, 8).launch().kernel == "union"
    plan = _prepare(sharing, 64, 4)
    assert (plan.launch().kernel, plan.launch().num_splits, plan.launch().ctas_per_sm) == ("union", 1, 2)
    cfg = plan.config(torch.bfloat16)
    assert (cfg.kernel, cfg.ctas_per_sm) == ("union", 2) and check_config(cfg) is None
    nv = plan.config(torch.bfloat16, "nvfp4")  # an NVFP4 cache keeps the token kernel
    assert nv.kernel == "token" and nv.ctas_per_sm == plan.launch("nvfp4").ctas_per_sm and check_config(nv) is None
    assert "kernel=union" in repr(plan)
    # small grids and qlen 1 keep the token kernel; a pinned occupancy pins the token kernel's build
    assert _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a"), 4, 4).launch().kernel == "token"
    assert _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a"), 256, 1).launch().kernel == "token"
    assert _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a", ctas_per_sm=2), 64, 4).launch().kernel == "token"
    assert _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a"), 64, 4, page=64).launch().kernel == "token"
    assert _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a"), 512, 4).launch().ctas_per_sm == 2  # 2048 CTAs


def test_union_pin_serves_every_step_shape():
    pinned = SparseDecodePlanner(num_sms=132, arch="sm_90a", kernel="union")
    plan = _prepare(pinned, 1, 1)  # 4 CTAs per split: the splits follow the union's grid
    assert (plan.launch().kernel, plan.launch().num_splits, plan.launch().ctas_per_sm) == ("union", 16, 2)
    assert plan.partial_o.shape[0] == 1 * 4 * 16
    plan = _prepare(pinned, 2, 8)  # 16 CTAs per split (two 4-token tiles)
    assert plan.launch().kernel == "union" and plan.launch().num_splits == 16
    # an NVFP4 cache is the token kernel's: its split count follows the token grid (B=4 qlen 4: T*Hkv = 64),
    # not the union's (16 CTAs per split)
    plan = _prepare(pinned, 4, 4)
    assert (plan.launch().kernel, plan.launch().num_splits) == ("union", 16)
    assert plan.launch("nvfp4").num_splits == choose_num_splits(64, 16, 132, "nvfp4") != 16
    plan = _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a", kernel="union", ctas_per_sm=2), 64, 4)
    assert (plan.launch().ctas_per_sm, plan.config(torch.bfloat16, "nvfp4").ctas_per_sm) == (2, 2)
    plan = _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a", kernel="union", ctas_per_sm=1), 64, 4)
    assert plan.launch().ctas_per_sm == 1 and plan.launch("nvfp4").ctas_per_sm in (2, 3)  # 1 is no token build: the planner's
    with pytest.raises(ValueError, match="page_size"):
        _prepare(pinned, 4, 2, page=64)
    with pytest.raises(ValueError, match="group size"):
        _prepare(pinned, 4, 2, hq=48, hkv=16)
    with pytest.raises(ValueError, match="sm_90a"):
        _prepare(SparseDecodePlanner(arch="sm_100a", kernel="union"), 4, 2)
    with pytest.raises(ValueError, match="for the union kernel"):
        SparseDecodePlanner(kernel="union", ctas_per_sm=3)
    with pytest.raises(ValueError, match="kernel must be"):
        SparseDecodePlanner(kernel="mma")
    # the token pin wins over drafts_share_blocks
    assert _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a", kernel="token", drafts_share_blocks=True),
                    64, 4).launch().kernel == "token"


def test_warmup_builds_union_only_where_the_planner_may_pick_it():
    base = SparseDecodeConfig(64, 4, arch="sm_90a")
    # the planner's rule, at its occupancy only (a 1-CTA pin compiles on first use); then the cluster builds
    got = [(c.kernel, c.ctas_per_sm, c.split_merge) for c in registry.plannable_configs(base)]
    assert got == [("token", 2, "kernel"), ("token", 3, "kernel"), ("union", 2, "kernel"), ("token", 2, "cluster")]
    for cfg in (SparseDecodeConfig(64, 4, arch="sm_100a"), SparseDecodeConfig(64, 4, kv_dtype="nvfp4"),
                SparseDecodeConfig(64, 4, page_size=64)):
        assert {c.kernel for c in registry.plannable_configs(cfg)} == {"token"}


def test_op_launches_the_union_build(launched_configs):
    """The plan's kernel crosses the op boundary (eager API and custom op) and picks the build."""
    events = launched_configs
    c = make_case(2, 4, 16, 1, q_dtype=torch.bfloat16, seed=3)
    union = SparseDecodePlanner(arch="sm_90a", kernel="union").prepare(*c.prepare_args(), **c.prepare_kwargs())
    token = SparseDecodePlanner(arch="sm_90a").prepare(*c.prepare_args(), **c.prepare_kwargs())
    msa_jit.sparse_decode(c.query, c.kv_cache, c.topk, c.new_out(), union, backend="kernel", **c.scales())
    sparse_decode_op(c.query, c.kv_cache, c.topk, c.new_out(), token, backend="kernel", **c.scales())
    sparse_decode_op(c.query, c.kv_cache, c.topk, c.new_out(), union, backend="kernel", **c.scales())
    assert [cfg.kernel for cfg in events] == ["union", "token", "union"]
    assert events[0] == events[2] == union.config(torch.bfloat16)
    u = events[0]  # what the union build is, written out (not only the plan's own word for it)
    assert (u.num_q_heads, u.num_kv_heads, u.q_dtype, u.kv_dtype, u.arch, u.ctas_per_sm) == (
        16, 1, "bfloat16", "float8_e4m3fn", "sm_90a", 2)


def test_selftest_grid_adds_union_cases_when_enabled():
    from msa_jit.tools.selftest import grid_cases

    plain = grid_cases("sm_90a", union=False)
    assert {c[5] for c in plain} == {"token"} and {c[6] for c in plain} == {2, 3}
    both = grid_cases("sm_90a", union=True)
    union = [c for c in both if c[5] == "union"]
    assert set(plain) <= set(both)
    assert union and all(c[2] >= 2 for c in union) and {c[6] for c in union} == {2}
    # every qlen >= 2 case of every geometry and query dtype, at the union's build a warmup makes
    assert len(union) == sum(1 for c in plain if c[2] >= 2 and c[6] == 2 and c[7] is None)
    assert grid_cases("sm_100a", union=True) == grid_cases("sm_100a", union=False) == grid_cases("sm_100a")
    assert [c for c in grid_cases("sm_90a") if c[5] == "union"] == union


def test_the_default_rule_takes_the_union_only_where_the_measurements_have_it_no_slower():
    """The rule against the committed measurements with no block shared: every point of
    tests/fixtures/union-waves/ (sweeps of both kernels by the union grid's share of a wave) the rule gives the union ran it no
    slower than 1.01x the token kernel in the same run, and every point where the union was more than 1.02x slower stays the token
    kernel's; the H200 default bench of the first rule (every union row of it the rule still takes)
    against the token kernel's previous file likewise."""
    import json
    from pathlib import Path

    fixtures = Path(__file__).resolve().parent / "fixtures"
    waves = sorted((fixtures / "union-waves").glob("*.json"))
    assert waves
    for path in waves:
        doc = json.loads(path.read_text())
        for r in doc["rows"]:
            hq, hkv = (int(x) for x in r["geometry"].split("/"))
            pick = choose_kernel(r["batch"], r["qlen"], hq, hkv, 128, "sm_90a", doc["num_sms"])
            if pick == "union":
                assert r["union_over_token"] <= 1.01, (path.name, r)
            if r["union_over_token"] > 1.02:
                assert pick == "token", (path.name, r)
    runs = json.loads((fixtures / "union-first-rule-h200.json").read_text())
    union, token = runs["union"], runs["token"]
    key = lambda r: (r["geometry"], r["batch"], r["qlen"], r["shared_blocks"], r["q_dtype"], r["kv_dtype"])
    before = {key(r): r["marginal_us"] for r in token["per_layer"]}
    taken = 0
    for r in union["per_layer"]:
        hq, hkv = (int(x) for x in r["geometry"].split("/"))
        if r["kernel"] == "union" and choose_kernel(r["batch"], r["qlen"], hq, hkv, 128, "sm_90a", 132) == "union":
            assert r["marginal_us"] <= before[key(r)], r
            taken += 1
    assert taken == 9  # 64/4 B=64 qlen 2 / 4 (0 and 12 of 16 shared), 16/1 B=256 qlen 2 / 4, 8/1 B=256 qlen 2 / 4 / 8
