"""Run under `compute-sanitizer --tool memcheck` (and `--tool racecheck`): adversarial topk and block tables.

-1 in the middle of topk rows, indices past the request's blocks, duplicates, garbage past
nvalid, and block-table entries past each request's blocks full of out-of-range pages; both
the single-CTA and the split-KV (merge) paths (16 splits, and 2 for fp8), both query dtypes, both cache formats (NVFP4
with its global scales as device tensors), both occupancy builds, the 2-CTA split merged both
ways (in a cluster: the planner's default on sm_90a; by the merge kernel: pinned); and the union
kernel (fp8 cache, planner pinned to it) at both of its occupancy builds, draft tokens sharing slots.
"""

import sys

import torch

import msa_jit
from helpers import make_case
from msa_jit.geometry import CLUSTER_MERGE_CTAS_PER_SM, CTAS_PER_SM, UNION_CTAS_PER_SM
from msa_jit.testing import share_slots

for kv_dtype in ("fp8", "nvfp4"):
    for q_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        # 1 split, 16 splits, and (T*Hkv = 12 on 30 SMs) fp8's 2 splits merged in a cluster of 2 (NVFP4: 4)
        for num_sms in (1, 100000, 30):
            # both kernel builds the planner picks from (its split merge), and the 2-CTA one's merge kernel
            for ctas_per_sm, split_merge in [(n, None) for n in CTAS_PER_SM] + [(CLUSTER_MERGE_CTAS_PER_SM, "kernel")]:
                case = make_case(3, 4, 16, 1, q_dtype=q_dtype, seed=3, device="cuda", adversarial=True,
                                 padded=True, kv_dtype=kv_dtype)
                out, lse = case.new_out(), case.new_lse()
                planner = msa_jit.SparseDecodePlanner(num_sms=num_sms, ctas_per_sm=ctas_per_sm, split_merge=split_merge)
                plan = planner.prepare(*case.prepare_args(), **case.prepare_kwargs())
                msa_jit.sparse_decode(case.query, case.kv_cache, case.topk, out, plan, lse=lse, backend="kernel",
                                      **case.scales(scale_tensors=kv_dtype == "nvfp4"))
                torch.cuda.synchronize()
                assert not out.isnan().any() and not lse.isnan().any()
                merge = plan.launch("nvfp4").split_merge if kv_dtype == "nvfp4" else plan.launch().split_merge
                splits = plan.launch("nvfp4" if kv_dtype == "nvfp4" else "float8_e4m3fn").num_splits
                print(f"sanitizer case {kv_dtype} q={q_dtype} splits={splits} {ctas_per_sm}/SM"
                      f"{' ' + merge + ' merge' if splits > 1 else ''} ok")
for q_dtype in (torch.bfloat16, torch.float8_e4m3fn):
    for num_sms in (1, 100000):
        for ctas_per_sm in UNION_CTAS_PER_SM:
            # G 16 (4-token tiles) and G 8 (8-token tiles: two tokens per building warp, a partial tile)
            for seed, shared, (hq, hkv), qlen in ((3, 0, (16, 1), 5), (4, 12, (16, 1), 5), (5, 12, (8, 1), 9)):
                case = make_case(3, qlen, hq, hkv, q_dtype=q_dtype, seed=seed, device="cuda", adversarial=True,
                                 padded=True)
                share_slots(case, shared)
                out, lse = case.new_out(), case.new_lse()
                planner = msa_jit.SparseDecodePlanner(num_sms=num_sms, ctas_per_sm=ctas_per_sm, kernel="union")
                plan = planner.prepare(*case.prepare_args(), **case.prepare_kwargs())
                msa_jit.sparse_decode(case.query, case.kv_cache, case.topk, out, plan, lse=lse, backend="kernel",
                                      **case.scales())
                torch.cuda.synchronize()
                assert not out.isnan().any() and not lse.isnan().any()
                print(f"sanitizer case union {hq}/{hkv} q={q_dtype} shared={shared} splits={plan.launch().num_splits} "
                      f"{ctas_per_sm}/SM ok")
sys.exit(0)
