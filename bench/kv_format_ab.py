"""Kernel builds of both cache formats, per layer, in one process: build here, time on the GPU host.

    python bench/kv_format_ab.py build --dir .kv-variants          # here (no GPU): compile the variants
    python3 bench/kv_format_ab.py run --dir .kv-variants --out $OUT # GPU host: JSON (device, date, command)

A variant is (cache format, constructor options of the portable kernel). Every variant is timed
on the same steps, interleaved over rounds, as the engine runs the op (one prologue, then L
layers in one CUDA graph, L2 flushed; marginal = (t(L) - t(1)) / (L - 1), msa_jit.tools.bench's
time_graph). The NVFP4 steps hold random NVFP4 bytes (valid codes, block scales in
[2**-3, 2**0)) of the same pages as the fp8 steps: the timing does not depend on the values, and
building a quantized 300 MB cache would cost more than the whole run. Percent of copy is
counted on each format's bytes (32 KiB / 18 KiB per (page, KV head) block).

VARIANTS lists what was measured (bench/results/kv-format-ab-*.json); `s_chains` existed only in
commit 753f3e2 (measured 1-3% slower, dropped) and `producer` only in d3185b1 (slower, T1511):
check that commit out to rebuild those variants (and 6484cc9 for `late_release`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

# this checkout's msa_jit and kernels/, not the checkout an editable install points at (a `pip install -e`
# in another clone, as CI's does, repoints it: session 25 built another clone's kernels that way)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

Q8 = "float8_e4m3fn"  # an option "q_dtype": Q8 marks a variant built and timed with an fp8 query
C3 = {"q_frags": "smem", "smem_reads": "staged", "ctas_per_sm": 3, "softmax": "lean"}
# the 2-CTA union builds' options, for the checkout variants of later sessions
VARIANTS_QREG_BASE = {
    "f_union_k8_w1_qreg": {"union_fp8": True, "warpgroups": 1, "q_lo_regs": True},
    "q8_union_w1": {"union_fp8": True, "warpgroups": 1, "q_dtype": "float8_e4m3fn"},
    "f_union_k8_w1_qreg_ahead8": {"union_fp8": True, "warpgroups": 1, "q_lo_regs": True, "v_ahead": 8},
    "q8_union_w1_ahead8": {"union_fp8": True, "warpgroups": 1, "q_dtype": "float8_e4m3fn", "v_ahead": 8},
}
VARIANTS = {  # name -> (kv dtype, kernel options)
    "n_c2": ("nvfp4", {}),
    "n_c2_sc2": ("nvfp4", {"s_chains": 2}),
    "n_c3s3": ("nvfp4", dict(C3, stages=3)),  # the NVFP4 3-CTA build since e4513cb
    "n_c3s3_sc2": ("nvfp4", dict(C3, stages=3, s_chains=2)),
    "f_c2": ("float8_e4m3fn", {}),
    "q8_c2": ("float8_e4m3fn", {"q_dtype": Q8}),  # the 2-CTA build with an fp8 query (vLLM's call)
    # the split merge inside the decode launch (split_merge="cluster", kernels/cluster_merge.py; row 79)
    "f_c2_cm": ("float8_e4m3fn", {"split_merge": "cluster"}),
    "n_c2_cm": ("nvfp4", {"split_merge": "cluster"}),
    "q8_c2_cm": ("float8_e4m3fn", {"split_merge": "cluster", "q_dtype": Q8}),
    "f_c2_sc2": ("float8_e4m3fn", {"s_chains": 2}),
    "f_c3": ("float8_e4m3fn", dict(C3, stages=2)),  # the fp8 3-CTA build
    # no producer warp (lane 0 of consumer warp 0 issues each copy), its registers for fatter or more
    # CTAs: kernel option producer="lane", only in commit d3185b1 (all slower, T1511)
    "n_c3s3_lane": ("nvfp4", dict(C3, stages=3, producer="lane")),
    "n_c3_fat_lane": ("nvfp4", dict(ctas_per_sm=3, stages=3, producer="lane")),
    "n_c4s2_lane": ("nvfp4", dict(C3, ctas_per_sm=4, stages=2, producer="lane")),
    # the split merge with / without an early launch_dependents (none until 2026-12-04; T1519 ran
    # f_c2 / f_c3 / n_c3s3 with it, *_nomt without; since, the 2-CTA build's merge triggers)
    "f_c2_nomt": ("float8_e4m3fn", {"merge_trigger": False}),
    "f_c3_nomt": ("float8_e4m3fn", dict(C3, stages=2, merge_trigger=False)),
    "n_c3s3_nomt": ("nvfp4", dict(C3, stages=3, merge_trigger=False)),
    "f_c3_mt": ("float8_e4m3fn", dict(C3, stages=2, merge_trigger=True)),
    "n_c3s3_mt": ("nvfp4", dict(C3, stages=3, merge_trigger=True)),
    # the 3-CTA build's merge triggering after its stores: merge_trigger="end", only in commit c7d4d86
    # (T1544: as slow as the early trigger at 256 CTAs)
    "f_c3_mtend": ("float8_e4m3fn", dict(C3, stages=2, merge_trigger="end")),
    "n_c3s3_mtend": ("nvfp4", dict(C3, stages=3, merge_trigger="end")),
    # the kernels of an older checkout, built there (`old_*`: before af5a8b2's convention, so the
    # fp8 query and cache reach them as uint8 views), to tell a code change from the machine
    "old_f_c2": ("float8_e4m3fn", {}),
    "old_n_c3s3": ("nvfp4", dict(C3, stages=3)),
    # the planner's builds of a checkout of f6bef28 (before session 10's named-barrier release and
    # fp8 K reads per k-step pair), built there under the names f_c2 / f_c3 / n_c3s3 and copied here
    "base_f_c2": ("float8_e4m3fn", {"checkout": "f6bef28"}),
    "base_f_c3": ("float8_e4m3fn", dict(C3, stages=2, checkout="f6bef28")),
    "base_n_c3s3": ("nvfp4", dict(C3, stages=3, checkout="f6bef28")),
    # the builds of d56929f (session 10's shipped kernels, before the FFMA softmax), copied here
    "s10_f_c2": ("float8_e4m3fn", {"checkout": "d56929f"}),
    "s10_f_c3": ("float8_e4m3fn", dict(C3, stages=2, checkout="d56929f")),
    "s10_n_c2": ("nvfp4", {"checkout": "d56929f"}),
    "s10_n_c3s3": ("nvfp4", dict(C3, stages=3, checkout="d56929f")),
    # the release of a stage before session 10 (sync_warp, lane 0 arrives), same build otherwise
    "f_c3_relwarp": ("float8_e4m3fn", dict(C3, stages=2, release="warp")),
    "n_c3s3_relwarp": ("nvfp4", dict(C3, stages=3, release="warp")),
    # a batch-1 build: 1 CTA per SM, 8 consumer warps of 16 keys (half the math per warp on the
    # one-block critical path of a split CTA)
    "f_w8": ("float8_e4m3fn", {"consumer_warps": 8, "ctas_per_sm": 1}),
    "n_w8": ("nvfp4", {"consumer_warps": 8, "ctas_per_sm": 1}),
    # the union probes of rows 54-55 (bench/union_kernel.py on mma.sync: f_union / n_union;
    # bench/union_wgmma.py and union_wgmma_ring.py on wgmma with converted K: f_union_wg*, f_union_cv*,
    # f_union_ring*, f_union_direct) were retired in session 16, when the fp8-K union kernel shipped
    # (kernels/sparse_decode_union_sm90.py): their sources and variants are at commit d3bf0ed
    # the staged build releasing a stage after its last MMA (kernel option late_release, only in
    # commit 6484cc9; T1702: no gain)
    "n_c3s3_late": ("nvfp4", dict(C3, stages=3, late_release=True)),
    "f_c3_late": ("float8_e4m3fn", dict(C3, stages=2, late_release=True)),
    # 2 CTAs per SM of 8 consumer warps (16 keys each per block): 16 consumer warps per SM against
    # the 3-CTA build's 12, for the latency-bound NVFP4 loop (session 12)
    "n_c2w8s4": ("nvfp4", dict(C3, ctas_per_sm=2, consumer_warps=8, stages=4)),
    "n_c2w8s5": ("nvfp4", dict(C3, ctas_per_sm=2, consumer_warps=8, stages=5)),
    "f_c2w8s3": ("float8_e4m3fn", dict(C3, ctas_per_sm=2, consumer_warps=8, stages=3)),
    # the 2-CTA NVFP4 build (the planner's at batch 1) with the 3-CTA build's softmax / reads
    "n_c2_lean": ("nvfp4", {"softmax": "lean"}),
    "n_c2_staged": ("nvfp4", {"smem_reads": "staged"}),
    "n_c2_lean_staged": ("nvfp4", {"softmax": "lean", "smem_reads": "staged"}),
    "n_c2_qsmem_lean": ("nvfp4", {"softmax": "lean", "q_frags": "smem"}),
    # session 11's NVFP4 builds (before the V-row order of kernels' swap_quads)
    "s11_n_c3s3": ("nvfp4", dict(C3, stages=3, checkout="5ef6e85")),
    "s11_n_c2": ("nvfp4", {"checkout": "5ef6e85"}),
    # branch wip/prmt-e2m1 (f7ed3d3, not yet measured): e2m1 codes placed as f16 bits by byte
    # permutes instead of cvt.rn.f16x2.e4m3x2 (performance.md, session 12's next steps)
    "prmt_n_c3s3": ("nvfp4", dict(C3, stages=3, checkout="f7ed3d3")),
    "prmt_n_c2": ("nvfp4", {"checkout": "f7ed3d3"}),
    # the stream alone and the math alone of the NVFP4 3-CTA build (kernel_probes.py)
    "n_c3s3_nocopy": ("nvfp4", dict(C3, stages=3, probe="no_copy")),
    "n_c3s3_nomath": ("nvfp4", dict(C3, stages=3, probe="no_math")),
    # batch 1: the 2-CTA builds' stream alone and math alone, fp8 against NVFP4 (#18 "no slower")
    "f_c2_nomath": ("float8_e4m3fn", {"probe": "no_math"}),
    # session 25: row 65's decomposition of the default small-batch build (the cluster merge since session 21),
    # and both builds' chain + bytes alone (probe="stream": no math, no epilogue); with `run --floor` beside #19's floor probe
    "f_c2_cm_nomath": ("float8_e4m3fn", {"split_merge": "cluster", "probe": "no_math"}),
    "f_c2_cm_nocopy": ("float8_e4m3fn", {"split_merge": "cluster", "probe": "no_copy"}),
    "f_c2_cm_stream": ("float8_e4m3fn", {"split_merge": "cluster", "probe": "stream"}),
    "f_c2_stream": ("float8_e4m3fn", {"probe": "stream"}),
    # the cluster build's epilogue cut short after its reduction / after its pushes and the merging CTA's wait
    "f_c2_cm_reduce": ("float8_e4m3fn", {"split_merge": "cluster", "probe": "no_math", "epilogue_part": "reduce"}),
    "f_c2_cm_push": ("float8_e4m3fn", {"split_merge": "cluster", "probe": "no_math", "epilogue_part": "push"}),
    "f_c2_cm_bars": ("float8_e4m3fn", {"split_merge": "cluster", "probe": "no_math", "epilogue_part": "bars"}),
    # the same integer work straight-line or in a loop after the stream: is cold instruction fetch on the critical path?
    "f_c2_cm_alu_unrolled": ("float8_e4m3fn", {"split_merge": "cluster", "probe": "stream", "epilogue_part": "alu_unrolled"}),
    "f_c2_cm_alu_loop": ("float8_e4m3fn", {"split_merge": "cluster", "probe": "stream", "epilogue_part": "alu_loop"}),
    # row 50's 8 consumer warps of 16 keys (1 CTA per SM) again, now with the cluster merge: half the math and
    # conversions per warp, two warps per scheduler
    "f_w8_cm": ("float8_e4m3fn", {"consumer_warps": 8, "ctas_per_sm": 1, "split_merge": "cluster"}),
    "f_w8_cm_nomath": ("float8_e4m3fn", {"consumer_warps": 8, "ctas_per_sm": 1, "split_merge": "cluster",
                                         "probe": "no_math"}),
    "n_c2_nomath": ("nvfp4", {"probe": "no_math"}),
    # session 33 (row 89, bench/dims_split.py): P V split by head dims (no 4-warp reduction of O), V rows as they
    # lie (4-way bank conflicts) or every 4 rows 32 bytes apart (32 bulk copies per block)
    "f_c2_cm_dims": ("float8_e4m3fn", {"split_merge": "cluster", "pv_split": "dims", "pad_rows": 0}),
    "f_c2_cm_dims_pad": ("float8_e4m3fn", {"split_merge": "cluster", "pv_split": "dims", "pad_rows": 4}),
    "q8_c2_cm_dims_pad": ("float8_e4m3fn", {"split_merge": "cluster", "pv_split": "dims", "pad_rows": 4,
                                            "q_dtype": Q8}),
    # the same with 4 copies of 32 rows 32 bytes apart, each lane's keys of a k-step in 4 groups
    "f_c2_cm_dims_pad32": ("float8_e4m3fn", {"split_merge": "cluster", "pv_split": "dims", "pad_rows": 32}),
    "f_c2_cm_dims_s3": ("float8_e4m3fn", {"split_merge": "cluster", "pv_split": "dims", "pad_rows": 32, "stages": 3}),
    "q8_c2_cm_dims_pad32": ("float8_e4m3fn", {"split_merge": "cluster", "pv_split": "dims", "pad_rows": 32,
                                              "q_dtype": Q8}),
    "f_c2_nocopy": ("float8_e4m3fn", {"probe": "no_copy"}),
    "n_c2_nocopy": ("nvfp4", {"probe": "no_copy"}),
    # the same loop's math alone at 1 and 2 CTAs per SM (4 and 8 consumer warps per SM against 12)
    "n_c1s3_nocopy": ("nvfp4", dict(C3, stages=3, ctas_per_sm=1, probe="no_copy")),
    "n_c2s3_nocopy": ("nvfp4", dict(C3, stages=3, ctas_per_sm=2, probe="no_copy")),
    # the math alone without (parts of) the e2m1 conversion (kernel_probes.py convert=...; row 61)
    "n_c3s3_nocopy_conv0": ("nvfp4", dict(C3, stages=3, probe="no_copy", convert="none")),
    "n_c3s3_nocopy_nocvt": ("nvfp4", dict(C3, stages=3, probe="no_copy", convert="no_cvt")),
    "n_c3s3_nocopy_noscale": ("nvfp4", dict(C3, stages=3, probe="no_copy", convert="no_scale")),
    "n_c3s3_conv0": ("nvfp4", dict(C3, stages=3, convert="none")),
    # the union kernel with S on fp8 wgmma straight from TMA-laid K tiles (bench/union_fp8.py): a bf16
    # query split into two e4m3 halves, and (q8_*) an fp8 query (vLLM's call) beside the shipped
    # fp8-query builds; with timing probes (V left unconverted / no MMAs)
    "f_union_k8": ("float8_e4m3fn", {"union_fp8": True}),
    "f_union_k8_noconv": ("float8_e4m3fn", {"union_fp8": True, "convert": False}),  # wrong results
    # ... with V converted by a third warpgroup (setmaxnreg) instead of each MMA warpgroup
    "f_union_k8_cv": ("float8_e4m3fn", {"union_fp8": True, "v_converter": True, "checkout": "c8f3b16"}),
    # one MMA warpgroup, 2 stages and V in two 64-key halves per CTA: 2 CTAs per SM with a bf16 query
    # (its V in two 64-key halves: the kernel option v_halves, retired in session 17, its builds at ffc4ff4)
    "f_union_k8_w1": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "v_halves": True, "checkout": "ffc4ff4"}),
    # built for bench/union_trace.py --events fp8 only (its stamps overwrite the plan's partials)
    "f_union_k8_trace": ("float8_e4m3fn", {"union_fp8": True, "trace": True}),
    # the 2-CTA builds traced (bench/union_trace.py --warpgroups 1)
    "f_union_k8_w1_trace": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "v_halves": True, "trace": True,
                                             "checkout": "ffc4ff4"}),
    "q8_union_w1_trace": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "trace": True, "q_dtype": Q8}),
    "q8_f_c2": ("float8_e4m3fn", {"q_dtype": Q8}),
    "q8_f_c3": ("float8_e4m3fn", dict(C3, stages=2, q_dtype=Q8)),
    "q8_union": ("float8_e4m3fn", {"union_fp8": True, "q_dtype": Q8}),
    "q8_union_cv": ("float8_e4m3fn", {"union_fp8": True, "v_converter": True, "q_dtype": Q8, "checkout": "c8f3b16"}),
    # one MMA warpgroup and 2 stages per CTA, 2 CTAs per SM: one wave at the spec-decode point
    "q8_union_w1": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_dtype": Q8}),
    # the 2-CTA union builds of session 16 (7d847e8), before a warp skipped the softmax of the rows
    # whose token did not select the block (row 71), copied here from that checkout's build
    "s16_f_union_k8_w1": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "v_halves": True,
                                           "checkout": "7d847e8"}),
    "s16_q8_union_w1": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_dtype": Q8, "checkout": "7d847e8"}),
    # ... and with the warp skip of row 71 alone (59db2ff), before row 72's softmax
    "s17a_f_union_k8_w1": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "v_halves": True,
                                            "checkout": "59db2ff"}),
    "s17a_q8_union_w1": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_dtype": Q8, "checkout": "59db2ff"}),
    # ... and with row 72's softmax (ac1fc60), before row 73's second V half in the K stage (bf16 query)
    "s17b_f_union_k8_w1": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "v_halves": True,
                                            "checkout": "ac1fc60"}),
    # the bf16 2-CTA build with Q's lo tile in registers and a whole V tile (row 74), and its V-unconverted probe
    "f_union_k8_w1_qreg": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_lo_regs": True}),
    # session 25: S's lo chain issued after r of V's 8 converted rows (bench/union_fp8.py lo_at, retired when
    # session 27 shipped r = 0 as row 84: the shipped f_union_k8_w1_qreg's SASS is lo 0's), not beside the hi chain
    **{f"f_union_k8_w1_qreg_lo{r}": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_lo_regs": True,
                                                       "lo_at": r, "checkout": "8871a82"}) for r in (0, 4, 8)},
    "f_union_k8_w1_qreg_lo8_trace": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_lo_regs": True,
                                                       "lo_at": 8, "trace": True, "checkout": "8871a82"}),
    # the bf16 2-CTA build before row 84 (S's lo chain beside the hi chain), for an A/B against the shipped one
    "s26_f_union_k8_w1_qreg": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_lo_regs": True,
                                                 "checkout": "8871a82", "as": "f_union_k8_w1_qreg"}),
    # session 27 (row 85's candidate): n of every 16 P elements' 2**x on the FMA pipe (bench/union_fp8.py ex2_poly)
    **{f"f_union_k8_w1_qreg_ex2p{n}": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_lo_regs": True,
                                                         "ex2_poly": n}) for n in (2, 3, 4, 6)},
    "q8_union_w1_ex2p3": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_dtype": Q8, "ex2_poly": 3}),
    # session 30 (row 86, shipped): V converted by a second warpgroup of the 2-CTA build (v_converter; setmaxnreg
    # 208 / 48 with a bf16 query, 192 / 64 with an fp8 one), handed over by mbarriers, so the MMA warpgroup runs S and the softmax while it converts
    "f_union_k8_w1_qreg_cv": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_lo_regs": True,
                                               "v_converter": True}),
    "q8_union_w1_cv": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_dtype": Q8, "v_converter": True}),
    "f_union_k8_w1_qreg_cv_trace": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_lo_regs": True,
                                                     "v_converter": True, "trace": True}),
    "f_union_k8_w1_qreg_trace": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_lo_regs": True,
                                                  "trace": True}),
    # (rows 84-85: the lo chain behind V's loads; a checkout of 5986f3e since session 31, below)
    "f_union_k8_w1_qreg_noconv": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_lo_regs": True,
                                                   "convert": False}),
    # session 18: the 2-CTA union builds before Q's loads moved ahead of the union build (58c756b)
    "s18a_f_union_k8_w1_qreg": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_lo_regs": True,
                                                 "checkout": "58c756b"}),
    "s18a_q8_union_w1": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_dtype": Q8, "checkout": "58c756b"}),
    # session 18: Q's loads ahead of the union build, without and with V's loads 8 rows ahead (c8f3b16's probe)
    **{f"s18b_{n}": ("float8_e4m3fn", dict(VARIANTS_QREG_BASE[n], checkout="c8f3b16")) for n in VARIANTS_QREG_BASE},
    # ... and with P V left running while the next block's stage is waited for and its S issued (branch
    # wip/pv-overlap, 0f5e99e; built there, copied here)
    **{f"s18c_{n}": ("float8_e4m3fn", dict(VARIANTS_QREG_BASE[n], checkout="0f5e99e"))
       for n in ("f_union_k8_w1_qreg", "q8_union_w1", "f_union_k8_w1_qreg_ahead8", "q8_union_w1_ahead8")},
    "s18c_f_union_k8_w1_qreg_trace": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_lo_regs": True,
                                                       "trace": True, "checkout": "0f5e99e"}),
    "s18c_q8_union_w1_trace": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "trace": True, "q_dtype": Q8,
                                                "checkout": "0f5e99e"}),
    # the whole of session 18's candidate (branch wip/union-s18, b251ec4): Q first, P V overlap, V's loads ahead
    **{f"s18d_{n}": ("float8_e4m3fn", dict(VARIANTS_QREG_BASE[n], checkout="b251ec4"))
       for n in ("f_union_k8_w1_qreg", "q8_union_w1")},
    "s18d_f_union_k8_w1_qreg_trace": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_lo_regs": True,
                                                       "trace": True, "checkout": "b251ec4"}),
    "s18d_q8_union_w1_trace": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "trace": True, "q_dtype": Q8,
                                                "checkout": "b251ec4"}),
    # V's shared loads issued rows ahead of their conversion (union_fp8.py v_ahead; exact)
    **{f"f_union_k8_w1_qreg_ahead{n}": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_lo_regs": True,
                                                          "v_ahead": n}) for n in (1, 2, 8)},
    **{f"q8_union_w1_ahead{n}": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_dtype": Q8, "v_ahead": n})
       for n in (2, 8)},
    # V's conversion by the integer bit trick, or half each way (union_fp8.py v_cvt, retired: row 75; exact)
    "f_union_k8_w1_qreg_trick": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_lo_regs": True,
                                                  "v_cvt": "trick", "checkout": "34bf61e"}),
    "f_union_k8_w1_qreg_mixed": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_lo_regs": True,
                                                  "v_cvt": "mixed", "checkout": "34bf61e"}),
    "q8_union_w1_mixed": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_dtype": Q8, "v_cvt": "mixed",
                                           "checkout": "34bf61e"}),
    # without the lo tile's QGMMA chain (wrong results): what the second K read costs beside V's conversion
    "f_union_k8_w1_qreg_nolo": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_lo_regs": True,
                                                 "lo_chain": False}),
    "f_union_k8_w1_qreg_nolo_noconv": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "q_lo_regs": True,
                                                        "lo_chain": False, "convert": False}),
    # the 2-CTA builds with V left unconverted: the stream and MMA side alone (wrong results)
    "f_union_k8_w1_noconv": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "v_halves": True,
                                              "convert": False, "checkout": "ffc4ff4"}),
    "q8_union_w1_noconv": ("float8_e4m3fn", {"union_fp8": True, "warpgroups": 1, "convert": False, "q_dtype": Q8}),
    "q8_union_noconv": ("float8_e4m3fn", {"union_fp8": True, "convert": False, "q_dtype": Q8}),  # wrong results
    "q8_union_nomma": ("float8_e4m3fn", {"union_fp8": True, "mma": False, "q_dtype": Q8}),  # wrong results
    # the split merge inside the decode launch (branch wip/push-merge, acaabd9: split_merge="cluster",
    # kernels/cluster_merge.py; row 79), built there as f_c2_cm / n_c2_cm / q8_c2_cm
    "s19p_f_c2_cm": ("float8_e4m3fn", {"split_merge": "cluster", "checkout": "acaabd9"}),
    "s19p_n_c2_cm": ("nvfp4", {"split_merge": "cluster", "checkout": "acaabd9"}),
    "s19p_q8_c2_cm": ("float8_e4m3fn", {"split_merge": "cluster", "q_dtype": Q8, "checkout": "acaabd9"}),
}
# session 25's epilogue (row 82) against session 24's kernels (unchanged from 972f876 to a09cf24): the planner's
# small-batch builds, built in a checkout of a09cf24 and copied here as s24_*
VARIANTS.update({f"s24_{n}": (VARIANTS[n][0], dict(VARIANTS[n][1], checkout="a09cf24"))
                 for n in ("f_c2_cm", "f_c3", "n_c2_cm", "n_c3s3", "q8_c2_cm")})
# row 84's bf16 2-CTA path without the V converter (S's lo chain behind V's loads) left the kernel in session 31
# (q_lo_regs needs v_converter since): its builds, the baseline of rows 85-86's A/Bs, come from a checkout of
# 5986f3e, the last commit with it
VARIANTS.update({n: (kv, dict(opt, checkout="5986f3e")) for n, (kv, opt) in VARIANTS.items()
                 if opt.get("q_lo_regs") and not opt.get("v_converter") and "checkout" not in opt})
GEOMS = [(64, 4), (8, 1)]
POINTS = [("64/4", 256, 1), ("64/4", 64, 1), ("8/1", 256, 1), ("64/4", 16, 1), ("64/4", 1, 1), ("64/4", 64, 4),
          ("64/4", 4, 1), ("8/1", 1, 1), ("8/1", 16, 1)]


def _uint8_convention(fn):
    """An artifact of the calling convention before af5a8b2: fp8 query and cache as uint8."""
    import torch

    def call(query, kv_cache, *rest):
        fp8 = torch.float8_e4m3fn
        return fn(query.view(torch.uint8) if query.dtype == fp8 else query,
                  kv_cache.view(torch.uint8) if kv_cache.dtype == fp8 else kv_cache, *rest)

    return call


def _q_dtype(name: str) -> str:
    """The query dtype variant `name` is built and timed with."""
    return VARIANTS[name][1].get("q_dtype", "bfloat16")


def _so(root: Path, name: str, hq: int, hkv: int) -> Path:
    return root / name / f"{hq}x{hkv}" / "sparse_decode.so"


def build(a: argparse.Namespace) -> int:
    from msa_jit.jit import sass
    from msa_jit.jit.compiler import compile_sparse_decode
    from msa_jit.geometry import SparseDecodeConfig

    for name in a.variants or VARIANTS:
        kv, opt = VARIANTS[name]
        if "checkout" in opt:  # built by that checkout's own kv_format_ab.py, copied here
            print(f"{name}: build {opt.get('as', name)} in a checkout of {opt['checkout']} and copy it to "
                  f"{Path(a.dir) / name}")
            continue
        for hq, hkv in GEOMS:
            so = _so(Path(a.dir), name, hq, hkv)
            so.parent.mkdir(parents=True, exist_ok=True)
            kopt = {k: v for k, v in opt.items() if k != "q_dtype"}
            cfg = SparseDecodeConfig(num_q_heads=hq, num_kv_heads=hkv, kv_dtype=kv, q_dtype=_q_dtype(name),
                                     arch=a.arch)
            compile_sparse_decode(cfg, so.parent, kernel_options=kopt, kernel_class=_variants()._kernel_class(kopt))
            r = [x for x in sass.summarize(so) if "merge" not in x["kernel"].lower()][0]
            print(f"{name} {hq}/{hkv}: {r['registers']} registers, {r['local_ops']} local ops", flush=True)
    return 0


def random_nvfp4_like(kv):
    """Random NVFP4 bytes [P, 2*Hkv, page, 72] for the pages of an fp8 cache [P, Hkv, page, 256]."""
    import torch

    pages, hkv, page, _ = kv.shape
    c = torch.randint(0, 256, (pages, 2 * hkv, page * 72), dtype=torch.uint8, device=kv.device)
    c[..., page * 64:] = torch.randint(0x30, 0x40, (pages, 2 * hkv, page * 8), dtype=torch.uint8, device=kv.device)
    return c.view(pages, 2 * hkv, page, 72)


def check(fn, hq: int, hkv: int, kv: str, qd: str = "bfloat16", union: bool = False) -> tuple[float, list[str]]:
    """(worst rel L2, problems) of one loaded variant against the float64 reference: the small
    cases of bench/variants.py's check (one split and split-KV, padded rows, qlen > 1, each
    launched 3 times on one plan with fresh, poisoned outputs) in its cache format; a union
    kernel's LSE to msa_jit.testing.UNION_LSE_ATOL."""
    from msa_jit.testing import UNION_LSE_ATOL

    rows = _variants()._check(fn, hq, hkv, qd, kv, UNION_LSE_ATOL if union else None)
    problems = [f"B={r['batch']} qlen={r['qlen']} splits={r['num_splits']}: {p}" for r in rows for p in r["problems"]]
    return max(r["rel_l2"] for r in rows), problems


def _variants():
    """bench/variants.py (its probe options, kernel-class choice and reference check)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import variants

    return variants


FLOOR = "floor"  # `run --floor`: the row of #19's floor probe (msa_jit.tools.bench.measure.measure_floor)


def run(a: argparse.Namespace) -> int:
    import torch

    from msa_jit import SparseDecodePlanner, sparse_decode
    from msa_jit.jit import loader
    from msa_jit.tools.bench import GEOMETRIES, copy_bandwidth, environment, make_step, time_graph
    from msa_jit.tools.bench.measure import measure_floor

    names = a.variants or list(VARIANTS)
    fns = {(n, g): loader.load_artifact(_so(Path(a.dir), n, *g))[0] for n in names for g in GEOMS}
    for key, fn in fns.items():
        if key[0].startswith("old_"):
            fns[key] = _uint8_convention(fn)
    checks = {}
    for (n, g), fn in list(fns.items()):  # a variant that computes something else is not timed
        worst, problems = check(fn, *g, VARIANTS[n][0], _q_dtype(n), bool(VARIANTS[n][1].get("union_fp8")))
        checks[f"{n} {g[0]}/{g[1]}"] = {"worst_rel_l2": worst, "problems": problems}
        print(f"check {n} {g[0]}/{g[1]}: worst rel L2 {worst:.2e} {'FAIL ' + '; '.join(problems) if problems else 'ok'}",
              flush=True)
        if problems and n not in (a.keep or []):
            names = [m for m in names if m != n]
    bw = copy_bandwidth()
    rows = []
    layers = 4
    points = [(f[0], *map(int, f[1:])) for f in (p.split(":") for p in a.points)] if a.points else POINTS
    for geo, batch, qlen, *rest in points:
        shared = rest[0] if rest else 0
        hq, hkv = GEOMETRIES[geo]
        steps = [make_step(hq, hkv, batch, qlen, "bfloat16", seed=i, shared_blocks=shared) for i in range(layers)]
        for s in steps:
            s["kv_nvfp4"] = random_nvfp4_like(s["kv_cache"])
            s["query_fp8"] = s["query"].to(torch.float8_e4m3fn)
        bt, sl, slc = steps[0]["block_table"], steps[0]["seq_lens"], steps[0]["seq_lens_cpu"]
        kw = dict(num_q_heads=hq, num_kv_heads=hkv, page_size=128, topk_blocks=16)
        planner = SparseDecodePlanner(ctas_per_sm=2)  # the kernels are injected below
        plan = planner.prepare(bt, sl, slc, qlen, **kw)
        one = torch.ones((), device="cuda")

        def graph_of(n, kv, qd):
            def step():
                p = planner.prepare(bt, sl, slc, qlen, **kw)
                for s in steps[:n]:
                    cache = s["kv_nvfp4"] if kv == "nvfp4" else s["kv_cache"]
                    query = s["query_fp8"] if qd == Q8 else s["query"]
                    sparse_decode(query, cache, s["topk"], s["out"], p, sm_scale=1 / math.sqrt(128),
                                  k_scale=one, v_scale=one)
            return step

        res: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        for _ in range(a.rounds):  # interleaved: drift hits every variant alike
            for n in names:
                kv, qd = VARIANTS[n][0], _q_dtype(n)
                plan.kernels[(getattr(torch, qd), kv)] = fns[(n, (hq, hkv))]
                t1 = statistics.median(time_graph(graph_of(1, kv, qd), iters=30))
                tl = statistics.median(time_graph(graph_of(layers, kv, qd), iters=30))
                res[n].append((t1, (tl - t1) / (layers - 1)))
            if a.floor:  # #19's floor probe on the same steps, one prepare and L layers per graph as above
                f = measure_floor(planner, steps, hq, hkv, qlen, layers, 30)
                res.setdefault(FLOOR, []).append((f["floor_one_layer_us"], f["floor_marginal_us"]))
        for n in names + ([FLOOR] if a.floor else []):
            kv = VARIANTS[n][0] if n != FLOOR else "float8_e4m3fn"
            nbytes = steps[0]["kv_bytes"] // (128 * 256) * (128 * (144 if kv == "nvfp4" else 256))
            m = statistics.median(x[1] for x in res[n])
            row = dict(variant=n, q_dtype=_q_dtype(n) if n != FLOOR else None, kv_dtype=kv, geometry=geo, batch=batch,
                       qlen=qlen, shared_blocks=shared, num_splits=plan.splits(kv) if n != FLOOR else None,
                       step_us=round(statistics.median(x[0] for x in res[n]), 2), marginal_us=round(m, 2),
                       marginal_pct_of_copy=round(100 * nbytes / (m * 1e-6) / bw, 1))
            rows.append(row)
            print(json.dumps(row), flush=True)
        del steps
        torch.cuda.empty_cache()
    out = {"environment": environment(), "copy_tbps": round(bw / 1e12, 3),
           "date": time.strftime("%Y-%m-%dT%H%M", time.gmtime()), "command": " ".join(sys.argv),
           "variants": {n: VARIANTS[n] for n in names}, "checks": checks, "rows": rows}
    path = Path(a.out) / f"kv-format-ab-{out['date']}.json"
    path.write_text(json.dumps(out, indent=1))
    print("wrote", path)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--arch", default="sm_90a")
    r = sub.add_parser("run")
    r.add_argument("--out", default=".")
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--keep", nargs="+", help="variants timed even when their check fails (timing probes)")
    r.add_argument("--points", nargs="+", help="GEOMETRY:BATCH:QLEN[:SHARED_BLOCKS] (default: POINTS)")
    r.add_argument("--floor", action="store_true", help="also time #19's floor probe at each point (row 'floor')")
    for p in (b, r):
        p.add_argument("--dir", default=".kv-variants")
        p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS))
    a = ap.parse_args()
    return build(a) if a.cmd == "build" else run(a)


if __name__ == "__main__":
    sys.exit(main())
