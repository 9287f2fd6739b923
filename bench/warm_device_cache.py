"""Warm every build a device run loads into one cache folder (here, no GPU needed).

    python bench/warm_device_cache.py --cache-dir .artifacts     # then carry .artifacts to the GPU host
    python bench/warm_device_cache.py --list                     # the configs, nothing compiled

The device runs set MSA_JIT_NO_COMPILE=1 (the host has no DSL compiler), so a missing artifact fails
its test. Beyond what `msa-jit warmup` builds (what an unpinned planner may pick), the GPU tests and
the sanitizers pin the union kernel's 1-CTA build: every MiniMax-M3 geometry x query dtype x cache
format x build the planner may pick, plus every union build.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __name__ == "__main__":  # the checkout's msa_jit, also without PYTHONPATH
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from msa_jit.geometry import KV_DTYPES, MINIMAX_M3_GEOMETRIES, Q_DTYPES, SparseDecodeConfig  # noqa: E402
from msa_jit.jit import registry  # noqa: E402
from msa_jit.tools import warmup  # noqa: E402


def configs(arch: str) -> list[SparseDecodeConfig]:
    out: list[SparseDecodeConfig] = []
    for (hq, hkv) in MINIMAX_M3_GEOMETRIES:
        for q in Q_DTYPES:
            for kv in KV_DTYPES:
                base = SparseDecodeConfig(hq, hkv, q_dtype=q, kv_dtype=kv, arch=arch)
                for c in registry.plannable_configs(base) + registry.union_configs(base):
                    if c not in out:
                        out.append(c)
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
            print(c.describe())
        return 0
    rows = warmup.run_warmup(cfgs, jobs=a.jobs, cache_dir=a.cache_dir)
    print(warmup.summary(rows))
    failed = [r for r in rows if r.status == "failed"]
    for r in failed:
        print(f"FAILED {r.config}: {r.error}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
