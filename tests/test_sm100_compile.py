"""Every MiniMax-M3 geometry x query dtype x KV format x occupancy compiles for sm_100a here (no GPU), without spills.

The token kernel compiled for sm_100a is the Blackwell default (the tcgen05 kernel in experiments/
has not run on hardware), so CI proves it builds for every geometry that engine serves; the default
run compiles some of these builds, this sweep all 32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.sweep]


def test_every_minimax_geometry_compiles_for_sm100a(tmp_path):
    out = tmp_path / "inspect.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MSA_JIT_")}
    proc = subprocess.run(
        [sys.executable, "-m", "msa_jit", "inspect", "--preset", "minimax-m3", "--arch", "sm_100a",
         "--cache-dir", str(tmp_path / "cache"), "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["kernels"]
    main = [r for r in rows if "merge" not in r["kernel"]]
    builds = {(r["geometry"], r["q_dtype"], r["kv_dtype"], r["ctas_per_sm"]) for r in main}
    assert len(builds) == 32, builds  # 64/4, 32/2, 16/1, 8/1 x q bf16, fp8 x kv fp8, nvfp4 x 2 and 3 CTAs per SM
    for r in rows:  # no local memory beyond the 3-per-SM build's accepted loop-carried word
        assert r["sm"] == 100 and r["local_ops"] <= r["accepted_local_ops"], r
        assert r["accepted_local_ops"] == (6 if r["ctas_per_sm"] == 3 else 0), r  # registry.KERNEL_REGISTRY
    for r in main:
        assert r["mma_ops"].get("HMMA", 0) > 0 and r["registers"] <= 255, r
