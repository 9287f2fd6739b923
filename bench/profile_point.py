"""One eager decode step of a bench point, for `ncu` (Nsight Compute) to profile.

    ncu --clock-control none -k regex:kernel_cutlass_kernel -c 1 --section SpeedOfLight \
        --section Occupancy --section WarpStateStats python3 bench/profile_point.py 64/4 64 1
"""

import math
import sys

import torch

from msa_jit import SparseDecodePlanner, sparse_decode
from msa_jit.bench import GEOMETRIES, make_step

geo, batch, qlen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
hq, hkv = GEOMETRIES[geo]
step = make_step(hq, hkv, batch, qlen, "bfloat16")
planner = SparseDecodePlanner()
for _ in range(3):
    plan = planner.prepare(step["block_table"], step["seq_lens"], step["seq_lens_cpu"], qlen,
                           num_q_heads=hq, num_kv_heads=hkv, page_size=128, topk_blocks=16)
    sparse_decode(step["query"], step["kv_cache"], step["topk"], step["out"], plan, sm_scale=1 / math.sqrt(128))
torch.cuda.synchronize()
print("profiled", geo, batch, qlen, "splits", plan.num_splits)
