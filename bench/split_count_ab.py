"""Fewer, longer splits at the small-batch split shapes, merged in the cluster: per layer, interleaved.

The planner splits a step until T*Hkv*splits >= 2 waves (TARGET_WAVES): at T*Hkv = 16 that is 16 splits
of one block each (256 CTAs, the 3-CTA build, the merge kernel), at T*Hkv = 64 4 splits of 4 blocks.
The cluster merge (row 79) is taken only where the split grid is at most one CTA per SM, which with
two waves is never the case there. This times, on the same steps, the planner's plan against plans
whose split count is forced (the 2-CTA build, the cluster merge; clusters of 2-8 CTAs), and #19's floor
probe:

    python3 bench/split_count_ab.py --out $OUT [--rounds 5] [--kv fp8 nvfp4] [--set rule]

Each plan's output is compared with the float64 reference first (poisoned before; a plan that
fails is not timed). A config is "S/C/M[/K]": S splits (or "plan": the planner's count), C CTAs per SM
("plan": the planner's build), M the split merge ("cluster", "kernel", or "plan"), K the kernel pinned
("token" or "union"; left out: the planner's choice). The "union" set times the union kernel in 1-8
splits against the token kernel where the union's unsplit grid is a partial wave (docs/open-targets.md
item 1), each point with no block shared and with 12 of 16 (--shared 0 12). "plan" is the
planner of the checkout that runs it: the committed result files predate row 83, which they led to
(docs/performance.md), so there "plan" is the two-wave rule.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's msa_jit, not an editable install's

# Point sets, (geometry, batch, qlen) -> candidate plans. "first" (split-count-ab-2026-12-05T1900-h100.json)
# and "sweep" (T1904): T*Hkv = 4 (batch 1: the planner's 16 splits already merge in the cluster), 16, 32,
# 64 and 128 (the planner: 16 / 8 / 4 / 3 splits, a grid of 256-384 CTAs at 3 per SM, the merge kernel).
# "rule" (T1909-h200): one split or two against the planner's at T*Hkv = 32-128 (96: between the grid's sizes)
T16 = ("plan/plan/plan", "8/2/cluster")
T32 = ("plan/plan/plan", "4/2/cluster", "8/2/cluster")
T64 = ("plan/plan/plan", "2/2/cluster", "4/2/cluster")
T128 = ("plan/plan/plan", "2/2/cluster", "1/plan/plan")
R32 = ("plan/plan/plan", "4/2/kernel", "2/2/cluster", "1/plan/plan")
R64 = ("plan/plan/plan", "2/2/cluster", "2/2/kernel", "1/plan/plan")
R96 = ("plan/plan/plan", "2/2/cluster", "1/plan/plan")
R128 = ("plan/plan/plan", "1/plan/plan", "1/3/plan", "2/2/cluster")
B2 = ("plan/plan/plan", "2/2/cluster", "1/plan/plan")
U = ("plan/plan/plan/token", "1/2/kernel/union")
SETS = {
    "first": {
        ("64/4", 1, 1): ("plan/plan/plan", "8/2/cluster"),
        ("64/4", 4, 1): T16 + ("8/2/kernel", "16/2/kernel"), ("16/1", 16, 1): T16 + ("8/2/kernel",),
        ("8/1", 16, 1): T16 + ("8/2/kernel",), ("64/4", 1, 4): T16,
        ("64/4", 16, 1): ("plan/plan/plan", "2/2/cluster", "2/2/kernel", "4/2/kernel"),
        ("8/1", 64, 1): ("plan/plan/plan", "2/2/cluster", "2/2/kernel"),
    },
    "sweep": {
        ("64/4", 1, 1): ("plan/plan/plan", "8/2/cluster"),
        ("64/4", 4, 1): T16, ("16/1", 16, 1): T16, ("8/1", 16, 1): T16, ("64/4", 1, 4): T16,
        ("64/4", 8, 1): T32, ("64/4", 4, 2): T32, ("16/1", 16, 2): T32, ("8/1", 4, 8): T32,
        ("64/4", 16, 1): T64, ("8/1", 64, 1): T64, ("16/1", 64, 1): T64, ("64/4", 4, 4): T64,
        ("64/4", 16, 2): T128, ("8/1", 16, 8): T128, ("64/4", 4, 8): T128, ("16/1", 64, 2): T128,
    },
    # session 33: with row 89's dims-split cluster build, fewer splits merged in the cluster at T*Hkv = 16-32
    # (row 83 found 8 cluster splits 0.95-1.04x the plan there with the key split)
    "dims": {
        ("64/4", 4, 1): T16 + ("4/2/cluster",), ("16/1", 16, 1): T16 + ("4/2/cluster",),
        ("8/1", 16, 1): T16 + ("4/2/cluster",), ("64/4", 1, 4): T16,
        ("64/4", 8, 1): ("plan/plan/plan", "4/2/cluster", "2/2/cluster"), ("8/1", 32, 1): ("plan/plan/plan", "4/2/cluster"),
    },
    # and between those sizes: T*Hkv = 12, 16 at qlen 2, 24, 32 at 16/1, 36, 40 (the largest power-of-two split count
    # whose grid is at most one CTA per SM, against the planner's and one more or fewer)
    "dims2": {
        ("64/4", 3, 1): T16 + ("4/2/cluster",), ("8/1", 12, 1): T16 + ("4/2/cluster",), ("64/4", 2, 2): T16 + ("4/2/cluster",),
        ("64/4", 6, 1): ("plan/plan/plan", "4/2/cluster"), ("8/1", 24, 1): ("plan/plan/plan", "4/2/cluster"),
        ("16/1", 32, 1): ("plan/plan/plan", "4/2/cluster"), ("64/4", 9, 1): ("plan/plan/plan", "2/2/cluster"),
        ("8/1", 40, 1): ("plan/plan/plan", "2/2/cluster"),
    },
    "rule": {
        ("64/4", 8, 1): R32, ("16/1", 16, 2): R32, ("8/1", 4, 8): R32, ("8/1", 32, 1): R32,
        ("64/4", 16, 1): R64, ("8/1", 64, 1): R64, ("64/4", 4, 4): R64,
        ("64/4", 24, 1): R96, ("8/1", 96, 1): R96, ("16/1", 48, 2): R96,
        ("64/4", 16, 2): R128, ("64/4", 32, 1): R128, ("8/1", 128, 1): R128,
    },
    # "between": where one and two splits take over from the planner's count (T*Hkv = 40-88)
    "between": {("8/1", 40, 1): B2, ("64/4", 12, 1): B2, ("8/1", 56, 1): B2, ("8/1", 72, 1): B2,
                ("64/4", 20, 1): B2, ("8/1", 88, 1): B2},
    # "union": the union's grid (B * Hkv * tiles, one tile = 4 tokens at G = 16, 8 at G = 8) at 0.24-0.73 of a wave
    # of 264 CTAs (2 per SM on 132 SMs; 0.12 at 64/4 B=8), 1.45 and 1.94 waves, split so that grid * S is near whole waves
    "union": {("64/4", 8, 4): U + ("4/2/kernel/union", "8/2/kernel/union"),
              ("64/4", 16, 4): U + ("2/2/kernel/union", "4/2/kernel/union"),
              ("64/4", 33, 4): U + ("2/2/kernel/union",), ("64/4", 33, 2): U + ("2/2/kernel/union",),
              ("64/4", 48, 4): U + ("2/2/kernel/union", "4/2/kernel/union"),
              ("64/4", 96, 4): U + ("2/2/kernel/union",), ("64/4", 128, 4): U,
              ("8/1", 132, 4): U + ("2/2/kernel/union",), ("8/1", 192, 8): U + ("2/2/kernel/union", "4/2/kernel/union")},
}
LAYERS = 4
KV = {"fp8": "float8_e4m3fn", "nvfp4": "nvfp4"}


@contextlib.contextmanager
def forced_splits(splits: int | None):
    """The planner's split count replaced by `splits` while plans are built (None: unchanged)."""
    import msa_jit.planner as planner_mod

    original = planner_mod.choose_num_splits
    if splits is not None:
        planner_mod.choose_num_splits = lambda *_a, **_k: splits
    try:
        yield
    finally:
        planner_mod.choose_num_splits = original


def make_planner(config: str, step, hq: int, hkv: int, qlen: int):
    """(planner, plan) for config "S/C/M", the plan built (and cached) under the forced split count."""
    from msa_jit.tools.bench.steps import prepare_args
    from msa_jit.planner import SparseDecodePlanner

    s, c, m, *k = config.split("/")
    planner = SparseDecodePlanner(ctas_per_sm=None if c == "plan" else int(c), split_merge=None if m == "plan" else m,
                                  kernel=k[0] if k else None)
    args, kw = prepare_args(step, hq, hkv, qlen)
    with forced_splits(None if s == "plan" else int(s)):
        plan = planner.prepare(*args, **kw)
    return planner, plan


def check(planner, step, hq: int, hkv: int, qlen: int) -> float:
    """Relative L2 error of the plan's output against the float64 reference (output poisoned first)."""
    import torch

    from msa_jit.tools.bench.steps import decode, prepare_args
    from msa_jit.reference import sparse_decode_reference
    from msa_jit.testing import rel_l2

    args, kw = prepare_args(step, hq, hkv, qlen)
    step["out"].fill_(float("nan"))
    decode(step, planner.prepare(*args, **kw))
    torch.cuda.synchronize()
    ref, _ = sparse_decode_reference(step["query"], step["kv_cache"], step["topk"], step["block_table"],
                                     step["seq_lens"], qlen, sm_scale=128 ** -0.5, k_scale=step["k_scale"],
                                     v_scale=step["v_scale"])
    return rel_l2(step["out"], ref)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--kv", nargs="+", default=["fp8"], choices=list(KV))
    ap.add_argument("--set", default="rule", choices=list(SETS), help="the points and plans to time")
    ap.add_argument("--shared", nargs="+", type=int, default=[0],
                    help="blocks of 16 each draft token shares with the request's first token (qlen > 1 points)")
    a = ap.parse_args(argv)

    import torch

    from msa_jit.tools.bench import copy_bandwidth, environment
    from msa_jit.tools.bench.measure import _layers_of, measure_floor
    from msa_jit.tools.bench.steps import GEOMETRIES, decode, make_indices, make_step

    bw = copy_bandwidth()
    print(f"copy {bw / 1e12:.3f} TB/s", flush=True)
    rows, checks = [], {}
    points = [(p, configs, sh) for p, configs in SETS[a.set].items() for sh in (a.shared if p[2] > 1 else [0])]
    for (geo, batch, qlen), configs, shared in points:
        hq, hkv = GEOMETRIES[geo]
        indices = [make_indices(batch, hkv, qlen, shared_blocks=shared, seed=i) for i in range(LAYERS)]
        for kv in a.kv:
            steps = [make_step(hq, hkv, batch, qlen, "bfloat16", seed=i, kv_dtype=KV[kv], indices=indices[i])
                     for i in range(LAYERS)]
            plans, timed = {}, []
            for config in configs:
                planner, plan = make_planner(config, steps[0], hq, hkv, qlen)
                plans[config] = (planner, plan)
                err = check(planner, steps[0], hq, hkv, qlen)
                name = f"{config} {geo} B={batch} qlen={qlen}{f' sh{shared}' if shared else ''} {kv}"
                checks[name] = err
                ok = err == err and err < 1e-2
                print(f"check {name}: splits {plan.splits(KV[kv])}, rel L2 {err:.2e} {'ok' if ok else 'FAIL'}",
                      flush=True)
                if ok:
                    timed.append(config)
            res: dict[str, list[float]] = {c: [] for c in timed + ["floor"]}
            for _ in range(a.rounds):  # interleaved: drift hits every plan alike
                for config in timed:
                    t1s, t_all = _layers_of(plans[config][0], steps, hq, hkv, qlen, decode, LAYERS, a.iters)
                    res[config].append((t_all - statistics.median(t1s)) / (LAYERS - 1))
                if kv == "fp8" and a.set != "union":  # the union set compares kernels, not small steps
                    f = measure_floor(plans[timed[0]][0], steps, hq, hkv, qlen, LAYERS, a.iters)
                    res["floor"].append(f["floor_marginal_us"])
            nbytes = steps[0]["kv_bytes"]
            for config, times in res.items():
                if not times:
                    continue
                plan = plans[config][1] if config != "floor" else None
                nv = KV[kv] == "nvfp4"
                m = statistics.median(times)
                row = dict(config=config, geometry=geo, batch=batch, qlen=qlen, shared_blocks=shared, kv_dtype=KV[kv],
                           kernel=plan.kernel if plan and not nv else "token" if plan else None,
                           num_splits=plan.splits(KV[kv]) if plan else None,
                           ctas_per_sm=(plan.nvfp4_ctas_per_sm if nv else plan.ctas_per_sm) if plan else None,
                           split_merge=(plan.nvfp4_split_merge if nv else plan.split_merge) if plan else None,
                           marginal_us=round(m, 2), rounds_us=[round(t, 2) for t in times],
                           marginal_pct_of_copy=round(100 * nbytes / (m * 1e-6) / bw, 1))
                rows.append(row)
                print(json.dumps(row), flush=True)
            del steps
            torch.cuda.empty_cache()
    env = environment()
    gpu = "h200" if "H200" in json.dumps(env) else "h100"
    date = time.strftime("%Y-%m-%dT%H%M", time.gmtime())
    out = {"environment": env, "copy_tbps": round(bw / 1e12, 3), "date": date, "command": " ".join(sys.argv),
           "set": a.set, "checks_rel_l2": checks, "rows": rows}
    path = Path(a.out)
    path.mkdir(parents=True, exist_ok=True)
    name = f"{'union-splits' if a.set == 'union' else 'split-count-ab'}-{date}-{gpu}.json"
    (path / name).write_text(json.dumps(out, indent=1))
    print("wrote", path / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
