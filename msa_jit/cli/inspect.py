"""`msa-jit inspect`: compile (if needed) and summarize each kernel's resources and SASS.

Registers, shared memory (what the launch really uses: the decode kernel's dynamic Storage
struct plus the static part), MMA opcodes and local-memory instructions per compiled kernel
(`msa_jit.jit.sass`); exit 1 on more local-memory instructions than a build's accepted count
(`registry.accepted_local_ops`: a spill) or on a failed build. Without geometry flags it
inspects the `minimax-m3` preset (what the main-job warmup built). Without nvdisasm (the
nvidia-cuda-nvdisasm wheel, a CUDA toolkit, or Triton's copy) it shows registers and shared
memory only and says so: the LDL/STL and MMA columns need the SASS.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from ..geometry import build_suffix
from .common import add_geometry_arguments, add_json_argument, emit_json, format_table, interrupted, \
    json_path_problem, text_stream, warm_geometry_flags

HELP = "compile (if needed) and summarize kernels: registers, shared memory, spills, MMA"
DEFAULT_PRESET = "minimax-m3"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The geometry flags (default: the minimax-m3 preset), and --json [FILE] for the per-kernel rows."""
    add_geometry_arguments(p, default_preset=DEFAULT_PRESET)
    add_json_argument(p, "the per-kernel rows")


def short_kernel_name(name: str) -> str:
    """The kernels module of a DSL kernel symbol: 'kernel_cutlass_kernel_msa_jitkernelssplit_merge
    SplitMergeKernel_object_at_...' -> 'split_merge' (a method other than `kernel` is appended)."""
    m = re.match(r"kernel_cutlass_(\w+?)_msa_jitkernels([a-z0-9_]+?)[A-Z]\w*?_object_at", name)
    if m:
        return m.group(2) if m.group(1) == "kernel" else f"{m.group(2)}.{m.group(1)}"
    return name if len(name) <= 40 else name[:37] + "..."


def _dynamic_smem(config, kernel: str, memo: dict) -> int | None:
    """Dynamic shared memory of `kernel` of config's artifact: the decode kernel's Storage struct,
    0 for the others (the split merge); None when it cannot be computed (no DSL here)."""
    from ..jit import compiler, registry

    if short_kernel_name(kernel) != registry.KERNEL_REGISTRY[registry.kernel_family(config)].module:
        return 0
    if config not in memo:
        try:
            memo[config] = compiler.dynamic_smem_bytes(config)
        except Exception:  # the DSL is not importable on this host
            memo[config] = None
    return memo[config]


def _first_line(error: str | None) -> str:
    """An error's first line for the table (the whole text is in the JSON)."""
    lines = [line.strip() for line in (error or "").splitlines() if line.strip()]
    return (lines[0] + (" ..." if len(lines) > 1 else "")) if lines else ""


def _occupancy(o: dict[str, Any]) -> str:
    """The CTAs/SM cell: '2', '2 union', '2 cluster merge'."""
    return f"{o['ctas_per_sm']}{build_suffix(o['config_kernel'], o['split_merge'])}"


def _smem(o: dict[str, Any]) -> str:
    return "?" if o["smem"] is None else str(o["smem"])


def run(args: argparse.Namespace) -> int:
    """Handler of `msa-jit inspect`."""
    from ..jit import registry, sass
    from ..tools import warmup

    if json_path_problem(args, "inspect"):
        return 2
    try:  # the artifacts are read before this process exits: a temporary cache will do
        rows = warm_geometry_flags(args, "inspect", allow_ephemeral=True, default_preset=DEFAULT_PRESET)
    except warmup.WarmupInterrupted as e:
        return interrupted("inspect", e)
    if rows is None:
        return 2
    with_sass = sass.find_nvdisasm() is not None
    out: list[dict[str, Any]] = []
    memo: dict = {}
    failed = False
    for r in rows:
        base = {"geometry": r.geometry, "q_dtype": r.q, "kv_dtype": r.kv, "arch": r.config.arch,
                # config_kernel: SparseDecodeConfig.kernel (a row's "kernel" is the DSL kernel's symbol)
                "ctas_per_sm": r.config.ctas_per_sm, "config_kernel": r.config.kernel,
                "split_merge": r.config.split_merge, "accepted_local_ops": registry.accepted_local_ops(r.config),
                "artifact": r.artifact}
        if r.status == "failed" or not r.artifact:
            out.append({**base, "error": r.error})
            failed = True
            continue
        try:
            for k in sass.summarize(r.artifact, with_sass=with_sass):
                dyn = _dynamic_smem(r.config, k["kernel"], memo)
                out.append({**base, **k, "dynamic_smem": dyn, "smem": None if dyn is None else dyn + k["static_smem"]})
        except Exception as e:
            out.append({**base, "error": f"{type(e).__name__}: {e}"})
            failed = True
    # a cluster-merge build holds its decode kernel twice (msa_jit/kernels/base.py: the cluster launch, and the plain
    # launch for one split or clusters the GPU cannot hold): number the copies, or the rows read as a duplicate
    names: dict[tuple[str, str], int] = {}
    for o in out:
        if "kernel" in o:
            k = (o["artifact"], short_kernel_name(o["kernel"]))
            names[k] = names.get(k, 0) + 1
    seen: dict[tuple[str, str], int] = {}

    def label(o: dict[str, Any]) -> str:
        k = (o["artifact"], short_kernel_name(o["kernel"]))
        if names[k] == 1:
            return k[1]
        seen[k] = seen.get(k, 0) + 1
        return f"{k[1]} ({seen[k]})"

    table = format_table(
        ["geometry", "q", "kv", "arch", "CTAs/SM", "kernel", "sm", "regs", "smem", "LDL/STL", "MMA"],
        [[o["geometry"], o["q_dtype"], o["kv_dtype"], o["arch"], _occupancy(o), label(o),
          o["sm"], o["registers"], _smem(o),
          "n/a" if o["local_ops"] is None else
          f"{o['local_ops']}" + (f" (<= {o['accepted_local_ops']} accepted)" if o["accepted_local_ops"] else ""),
          "n/a" if o["mma_ops"] is None else " ".join(f"{k}:{v}" for k, v in sorted(o["mma_ops"].items())) or "-"]
         if "kernel" in o else [o["geometry"], o["q_dtype"], o["kv_dtype"], o["arch"], _occupancy(o), "ERROR",
                                "", "", "", "", _first_line(o["error"])]
         for o in out],
    )
    text = text_stream(args)  # stderr when the JSON is on stdout
    print(table, file=text)
    print("smem: bytes of shared memory per CTA, the launch's dynamic part (the kernel's storage struct,\n"
          "and a cluster merge's receive buffer) plus the static one", file=text)
    if any(n > 1 for n in names.values()):
        print("(1) / (2): a cluster-merge build compiles its decode kernel for two launches, in a cluster and plain\n"
              "(one split, or clusters the GPU cannot hold)", file=text)
    if not with_sass:
        print(f"LDL/STL and MMA need the SASS, and nvdisasm was not found: {sass.NVDISASM_HINT}; "
              "spills were not checked", file=text)
    # a known local-memory use of a build (registry.accepted_local_ops) is not a spill; more is
    spills = [o for o in out if (o.get("local_ops") or 0) > o["accepted_local_ops"]]
    for o in spills:
        print(f"SPILL {o['geometry']} q {o['q_dtype']} kv {o['kv_dtype']} {o['arch']} {o['ctas_per_sm']}/SM "
              f"{short_kernel_name(o['kernel'])}: {o['local_ops']} LDL/STL (accepted: {o['accepted_local_ops']})",
              file=text)
    print(f"{len(out)} kernel(s), {len(spills)} with local-memory ops beyond the accepted"
          f"{'' if with_sass else ' (not checked)'}{', errors above' if failed else ''}", file=text)
    if args.json:
        emit_json(args.json, {"kernels": out})
    return 1 if spills or failed else 0
