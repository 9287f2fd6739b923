"""One eager decode step of a bench point, for `ncu` (Nsight Compute) to profile.

    ncu --clock-control none -k regex:kernel_cutlass_kernel -c 1 --section SpeedOfLight \
        --section Occupancy --section WarpStateStats python3 bench/profile_point.py 64/4 64 1

Arguments: geometry batch qlen [shared_blocks (consecutive tokens share that many blocks)]
[artifact .so (e.g. .variants/scalar_out/64x4-bfloat16/sparse_decode.so) instead of the cache's,
or "-" for the cache's]. PROFILE_Q=float8_e4m3fn: an fp8 query (default bfloat16).
PROFILE_KV=nvfp4: the same pages as random NVFP4 bytes (the timing does not depend on the values;
bench/kv_format_ab.py), global scales as device tensors.
"""

import math
import os
import sys

import torch

from msa_jit import SparseDecodePlanner, sparse_decode
from msa_jit.tools.bench import GEOMETRIES, make_step

geo, batch, qlen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
shared = int(sys.argv[4]) if len(sys.argv) > 4 else 0
artifact = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] != "-" else None
kv_format = os.environ.get("PROFILE_KV", "float8_e4m3fn")
hq, hkv = GEOMETRIES[geo]
step = make_step(hq, hkv, batch, qlen, os.environ.get("PROFILE_Q", "bfloat16"), shared_blocks=shared)
scales = {}
if kv_format == "nvfp4":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kv_format_ab import random_nvfp4_like

    step["kv_cache"] = random_nvfp4_like(step["kv_cache"])
    one = torch.ones((), device="cuda")
    scales = dict(k_scale=one, v_scale=one)
planner = SparseDecodePlanner()
kernel = None
if artifact:
    from msa_jit.jit.loader import load_artifact

    kernel = load_artifact(artifact)[0]
for _ in range(3):
    plan = planner.prepare(step["block_table"], step["seq_lens"], step["seq_lens_cpu"], qlen,
                           num_q_heads=hq, num_kv_heads=hkv, page_size=128, topk_blocks=16)
    if kernel is not None:
        plan.kernels[(step["query"].dtype, kv_format)] = kernel
    sparse_decode(step["query"], step["kv_cache"], step["topk"], step["out"], plan, sm_scale=1 / math.sqrt(128),
                  **scales)
torch.cuda.synchronize()
print("profiled", geo, batch, qlen, "shared", shared, "splits", plan.num_splits,
      "kv_bytes", step["kv_bytes"], "logical_bytes", step["logical_bytes"])
