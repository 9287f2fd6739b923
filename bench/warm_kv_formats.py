"""Warm every kernel a device run loads, for BOTH cache formats (here, no GPU needed).

    python bench/warm_kv_formats.py --cache-dir .artifacts           # before bash bench/h200_run.sh
    python bench/warm_kv_formats.py --list                           # the configs, nothing compiled

`msa-jit warmup` builds the fp8-cache kernels; `msa-jit bench`, the GPU tests and the sanitizer
runs also load the NVFP4 ones, and the device runs with MSA_JIT_NO_COMPILE=1 (a missing
artifact fails the row). Every MiniMax-M3 geometry x query dtype x occupancy
(`msa_jit.tools.warmup.warmup_configs`), each with kv_dtype "float8_e4m3fn" and "nvfp4", the union
kernel's two builds per geometry and query dtype, and the cluster split merge's build per geometry,
query dtype and cache format.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

if __name__ == "__main__":  # the checkout's msa_jit, also without PYTHONPATH
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from msa_jit.jit import compiler, registry  # noqa: E402
from msa_jit.tools import warmup  # noqa: E402
from msa_jit.geometry import KV_DTYPES, MINIMAX_M3_GEOMETRIES, Q_DTYPES  # noqa: E402


def configs(arch: str) -> list:
    """Every config of both cache formats for `arch`, fp8 first, then the union kernel's builds
    (fp8 cache; tests/test_union_gpu.py and the sanitizers pin it, whatever MSA_JIT_ENABLE_SM90_UNION),
    then the cluster split merge's (both formats; tests/test_cluster_merge_gpu.py pins it, whatever
    MSA_JIT_ENABLE_CLUSTER_MERGE)."""
    base = [c for c in warmup.warmup_configs(MINIMAX_M3_GEOMETRIES, Q_DTYPES, [arch])
            if c.kernel == "token" and c.split_merge == "kernel"]
    out = [replace(c, kv_dtype=kv) for kv in KV_DTYPES for c in base]
    for c in base:
        out += [u for u in registry.union_configs(c) if u not in out]
    for c in list(out):
        if c.kernel == "token":
            out += [m for m in registry.cluster_merge_configs(c) if m not in out]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default=".artifacts")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--list", action="store_true", help="print the configs and exit")
    a = ap.parse_args(argv)
    cfgs = configs(a.arch)
    if a.list:
        for c in cfgs:
            print(f"{c.num_q_heads}/{c.num_kv_heads} q={c.q_dtype} kv={c.kv_dtype} {c.arch} {c.ctas_per_sm}/SM {c.kernel}"
                  + (" cluster merge" if c.split_merge == "cluster" else ""))
        return 0
    rows = warmup.run_warmup(cfgs, jobs=a.jobs, cache_dir=a.cache_dir)
    print(warmup.summary(rows))
    failed = [r for r in rows if r.status == "failed"]
    for r in failed:
        print(f"FAILED {r.config}: {r.error}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
