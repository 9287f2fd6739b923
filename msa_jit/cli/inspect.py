"""`msa-jit inspect`: compile (if needed) and summarize each kernel's SASS.

Registers, shared memory, MMA opcodes and local-memory instructions per compiled kernel
(`msa_jit.sass`); exit 1 on more local-memory instructions than a build's accepted count
(`compiler.accepted_local_ops`: a spill) or on a failed build.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from .. import compiler, sass, warmup
from .common import add_geometry_arguments, format_table, interrupted, warm_geometry_flags

HELP = "compile (if needed) and summarize SASS: registers, smem, spills, MMA"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The geometry flags, and --json FILE for the per-kernel rows."""
    add_geometry_arguments(p)
    p.add_argument("--json", metavar="FILE", help="write the per-kernel rows as JSON")


def short_kernel_name(name: str) -> str:
    """The kernels module of a DSL kernel symbol: 'kernel_cutlass_kernel_msa_jitkernelssplit_merge
    SplitMergeKernel_object_at_...' -> 'split_merge' (a method other than `kernel` is appended)."""
    m = re.match(r"kernel_cutlass_(\w+?)_msa_jitkernels([a-z0-9_]+?)[A-Z]\w*?_object_at", name)
    if m:
        return m.group(2) if m.group(1) == "kernel" else f"{m.group(2)}.{m.group(1)}"
    return name if len(name) <= 40 else name[:37] + "..."


def run(args: argparse.Namespace) -> int:
    """Handler of `msa-jit inspect`."""
    try:  # the artifacts are read before this process exits: a temporary cache will do
        rows = warm_geometry_flags(args, "inspect", allow_ephemeral=True)
    except warmup.WarmupInterrupted as e:
        return interrupted("inspect", e)
    if rows is None:
        return 2
    out: list[dict[str, Any]] = []
    failed = False
    for r in rows:
        base = {"geometry": r.geometry, "q_dtype": r.q, "arch": r.config.arch, "ctas_per_sm": r.config.ctas_per_sm,
                "accepted_local_ops": compiler.accepted_local_ops(r.config), "artifact": r.artifact}
        if r.status == "failed" or not r.artifact:
            out.append({**base, "error": r.error})
            failed = True
            continue
        try:
            for k in sass.summarize(r.artifact):
                out.append({**base, **k})
        except Exception as e:
            out.append({**base, "error": f"{type(e).__name__}: {e}"})
            failed = True
    print(format_table(
        ["geometry", "q", "arch", "CTAs/SM", "kernel", "sm", "regs", "smem", "LDL/STL", "MMA"],
        [[o["geometry"], o["q_dtype"], o["arch"], o["ctas_per_sm"], short_kernel_name(o["kernel"]), o["sm"],
          o["registers"], o["static_smem"],
          f"{o['local_ops']}" + (f" (<= {o['accepted_local_ops']} accepted)" if o["accepted_local_ops"] else ""),
          " ".join(f"{k}:{v}" for k, v in sorted(o["mma_ops"].items())) or "-"]
         if "kernel" in o else [o["geometry"], o["q_dtype"], o["arch"], o["ctas_per_sm"], "ERROR", "", "", "", "",
                                o["error"]]
         for o in out],
    ))
    # a known local-memory use of a build (compiler.accepted_local_ops) is not a spill; more is
    spills = [o for o in out if o.get("local_ops", 0) > o["accepted_local_ops"]]
    for o in spills:
        print(f"SPILL {o['geometry']} {o['q_dtype']} {o['arch']} {o['ctas_per_sm']}/SM {o['kernel']}: "
              f"{o['local_ops']} LDL/STL (accepted: {o['accepted_local_ops']})")
    print(f"{len(out)} kernel(s), {len(spills)} with local-memory ops beyond the accepted{', errors above' if failed else ''}")
    if args.json:
        Path(args.json).write_text(json.dumps({"kernels": out}, indent=1) + "\n", encoding="utf-8")
    return 1 if spills or failed else 0
