"""What this host has and whether msa-jit can serve kernels on it (`msa-jit doctor`'s library).

`collect()` gathers the report as a JSON-able dict, `render(report)` words it. Every probe
catches its own errors and reports them, so neither raises. It never imports the DSL
compiler (`cutlass`), never compiles, and changes nothing on disk: the cache is resolved as a
process would resolve it but without creating anything (`resolve(create=False)`), and preset
readiness reads each entry's meta.json and artifact sizes without a lookup (which would
refresh the entry's last-used time, the LRU prune's clock, and remove a corrupt entry).
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from .. import env

SM100_POLICY = (
    "On compute capability 10.x (B200/GB200) the token kernel (mma.sync) is compiled for sm_100a; "
    "it is compiled and SASS-checked here, not yet run on such a GPU."
)
UNION_POLICY = (
    "On sm_90a the union kernel (one CTA per request's token tile, each shared block read once) "
    "serves fp8-cache steps where one tile holds a request's draft (decode_query_len 2..64/G: 2-4 at "
    "G = 16, 2-8 at G = 8) and its grid is one full wave at 2 CTAs per SM, where it is no slower even "
    "when draft tokens share no blocks. SparseDecodePlanner(drafts_share_blocks=True) gives it every "
    "qlen >= 2 step whose grid has at least one CTA per SM (faster where drafts share most blocks, up "
    "to 1.5x slower where they share none); kernel='token' / 'union' pins one."
)
CLUSTER_MERGE_POLICY = (
    "On sm_90a a step whose KV splits are served at 2 CTAs per SM merges them inside the decode "
    "launch (one thread-block cluster per token and KV head, no merge kernel) unless a planner pins "
    "split_merge='kernel', and unless the GPU "
    "cannot hold the clusters (a plan's first call asks the driver): 2.6-9.1% faster per layer on "
    "an H100 where it is picked, one launch per op call."
)


def _build_suffix(row: dict[str, Any]) -> str:
    """' union' / ' cluster merge' after a preset row of a non-default build ('' for older reports)."""
    from ..geometry import build_suffix

    return build_suffix(row.get("kernel", "token"), row.get("split_merge", "kernel"))


def _probe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C / SIGTERM stop the report, they are no probe's result
        raise
    except BaseException as e:  # never raise: report instead
        return {"error": f"{type(e).__name__}: {e}"}


def _version(*dists: str) -> str | None:
    for d in dists:
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            continue
    return None


def probe_gpu() -> dict[str, Any]:
    """CUDA devices seen by torch: name, compute capability, arch string."""
    import torch

    from ..geometry import arch_problem, device_arch

    if not torch.cuda.is_available():
        return {"available": False, "torch_cuda": torch.version.cuda,
                "message": "no CUDA GPU: torch.cuda.is_available() is False"
                           + ("" if torch.version.cuda else " (this torch is a CPU-only build)")}
    devices = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        arch = device_arch(i)
        devices.append({"index": i, "name": torch.cuda.get_device_name(i),
                        "capability": f"{major}.{minor}", "arch": arch, "arch_problem": arch_problem(arch)})
    return {"available": True, "torch_cuda": torch.version.cuda, "devices": devices}


def probe_driver() -> dict[str, Any]:
    """NVIDIA driver version: nvidia-smi, else /proc/driver/nvidia/version, else torch."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            p = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            if p.returncode == 0 and p.stdout.strip():
                return {"version": p.stdout.strip().splitlines()[0], "source": smi}
        except (OSError, subprocess.SubprocessError):
            pass
    proc = Path("/proc/driver/nvidia/version")
    if proc.is_file():
        return {"version": proc.read_text().splitlines()[0].strip(), "source": str(proc)}
    try:
        import torch

        v = torch._C._cuda_getDriverVersion()  # CUDA builds only
        return {"version": f"CUDA driver API {v // 1000}.{(v % 1000) // 10}", "source": "torch"}
    except Exception:
        return {"version": None, "source": None, "message": "no NVIDIA driver found (no nvidia-smi, no /proc/driver/nvidia)"}


def probe_versions() -> dict[str, Any]:
    """Versions of msa-jit, torch, triton, CuTe DSL, tvm-ffi and Python (metadata, no imports of the DSL)."""
    from .. import __version__
    from ..jit import compiler

    import torch

    return {"msa-jit": __version__, "torch": torch.__version__, "triton": _version("triton"),
            "cute-dsl": _probe(compiler.dsl_version), "tvm-ffi": _version("apache-tvm-ffi"),
            "python": platform.python_version()}


def probe_toolchain() -> dict[str, Any]:
    """DSL compiler importable? Where are libcute_dsl_runtime.so and nvdisasm?"""
    from ..jit import loader, sass

    try:
        spec = importlib.util.find_spec("cutlass")
        compiler = {"importable": spec is not None, "origin": getattr(spec, "origin", None)}
    except Exception as e:
        compiler = {"importable": False, "error": f"{type(e).__name__}: {e}"}
    if "cutlass" not in sys.modules and not compiler["importable"]:
        compiler["message"] = "DSL compiler not installed: this host can only load pre-warmed artifacts"
    runtime = _probe(lambda: {"path": str(loader.find_runtime_library())})
    return {"dsl_compiler": compiler, "runtime_library": runtime, "nvdisasm": _probe(sass.find_nvdisasm)}


def _open_cache(cache_dir: str | None):
    """The cache a process would use, opened without creating anything (no fallback warning: the
    report says it)."""
    import warnings

    from ..jit import cache

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cache.CacheFallbackWarning)
        return cache.open_cache(cache_dir, create=False)


def probe_cache(cache_dir: str | None = None) -> dict[str, Any]:
    """Cache root, state (ok / fallback / ephemeral), entries and size."""
    c = _open_cache(cache_dir)
    state = ("ephemeral (an in-process temporary directory, deleted at exit)" if c.ephemeral
             else "fallback" if c.fallback_reason else "ok" if c.exists else "ok, no cache there yet")
    return {"root": str(c.root), "state": state, "fallback_reason": c.fallback_reason,
            "readonly_roots": [str(r) for r in c.readonly_roots], "entries": len(c.entries()),
            "size_bytes": c.size_bytes() if c.exists else 0, "cap_bytes": _probe(env.cache_max_bytes)}


def _present(c: Any, key: str) -> tuple[bool, str | None, str | None]:
    """(ready, entry dir, problem) of `key` in cache `c`, read without changing anything: its
    meta.json parses and names artifacts of the recorded sizes (no hash: `msa-jit cache verify`)."""
    from ..jit.cache.entry import CorruptEntry, check_artifacts, read_meta

    for root in (c.root, *c.readonly_roots):
        d = c.entry_path(key, root)
        try:
            loaded = read_meta(d, key)
            if loaded is None:
                continue
            check_artifacts(d, loaded[0], loaded[1], hash_check=False)
        except CorruptEntry as e:
            return False, str(d), f"corrupt: {e.reason}"
        except OSError as e:
            return False, str(d), f"{type(e).__name__}: {e}"
        return True, str(d), None
    return False, None, None


def probe_env() -> list[dict[str, Any]]:
    """Every MSA_JIT_* variable: raw value, parsed value (or the parse error), documentation."""
    out = []
    for name, raw, doc in env.describe():
        row: dict[str, Any] = {"name": name, "value": raw, "doc": doc}
        fn = getattr(env, env.PARSERS.get(name, ""), None)
        if fn is not None:
            try:
                val = fn()
                row["parsed"] = str(val) if val is not None and not isinstance(val, (bool, int, float)) else val
            except ValueError as e:
                row["error"] = str(e)
        if name == env.CACHE_DIR and raw and "error" not in row:
            # what the other commands refuse before any work (exit 2); a library process falls back
            from ..jit.cache.location import not_a_directory

            problem = not_a_directory(Path(os.path.abspath(os.path.expanduser(raw))))
            if problem:
                row["error"] = f"{problem}: the other msa-jit commands refuse it, a library process falls back"
        out.append(row)
    return out


def target_arches(gpu: dict[str, Any]) -> list[str]:
    """MSA_JIT_ARCH, else the GPUs' archs that msa-jit builds for, else sm_90a and sm_100a."""
    from ..geometry import DEFAULT_ARCHES

    try:
        forced = env.target_arch()
    except ValueError:
        forced = None
    if forced:
        return [forced]
    archs = sorted({d["arch"] for d in gpu.get("devices", []) if "arch" in d and not d.get("arch_problem")})
    return archs or list(DEFAULT_ARCHES)


def probe_presets(arches: list[str], cache_dir: str | None = None) -> list[dict[str, Any]]:
    """Which MiniMax-M3 preset geometries (head layouts x query dtypes x KV cache formats x
    occupancies) are in the cache for each arch (lookup only)."""
    from ..jit import compiler, registry
    from ..geometry import (KV_DTYPE_SHORT, KV_DTYPES, MINIMAX_M3_GEOMETRIES, Q_DTYPE_SHORT, Q_DTYPES, SparseDecodeConfig)

    c = _open_cache(cache_dir)
    rows = []
    for arch in arches:
        for hq, hkv in MINIMAX_M3_GEOMETRIES:
            for q in Q_DTYPES:
                for kv in KV_DTYPES:
                    base = SparseDecodeConfig(hq, hkv, q_dtype=q, kv_dtype=kv, arch=arch)
                    for cfg in registry.plannable_configs(base):
                        row: dict[str, Any] = {"geometry": f"{hq}/{hkv}", "q_dtype": Q_DTYPE_SHORT[q],
                                               "kv_dtype": KV_DTYPE_SHORT[kv], "arch": arch,
                                               "ctas_per_sm": cfg.ctas_per_sm, "kernel": cfg.kernel,
                                               "split_merge": cfg.split_merge}
                        try:
                            row["ready"], row["path"], problem = _present(c, compiler.cache_key(cfg))
                            if problem:
                                row["error"] = problem
                        except Exception as e:
                            row["ready"], row["error"] = False, f"{type(e).__name__}: {e}"
                        rows.append(row)
    return rows


def probe_policy(arches: list[str]) -> dict[str, Any]:
    """Kernel family chosen for each target arch now, and the SM100 selection policy."""
    from ..geometry import SparseDecodeConfig
    from ..jit import registry

    families = {a: registry.kernel_family(SparseDecodeConfig(16, 1, arch=a)) for a in arches}
    return {"policy": SM100_POLICY, "union_policy": UNION_POLICY, "cluster_merge_policy": CLUSTER_MERGE_POLICY,
            "registered": sorted(registry.KERNEL_REGISTRY), "families": families}


def collect(cache_dir: str | None = None) -> dict[str, Any]:
    """The whole report as a JSON-able dict (each section may be {"error": ...})."""
    gpu = _probe(probe_gpu)
    arches = _probe(lambda: target_arches(gpu if isinstance(gpu, dict) else {}))
    if not isinstance(arches, list):
        from ..geometry import DEFAULT_ARCHES

        arches = list(DEFAULT_ARCHES)
    return {
        "gpu": gpu, "driver": _probe(probe_driver), "versions": _probe(probe_versions),
        "toolchain": _probe(probe_toolchain), "cache": _probe(lambda: probe_cache(cache_dir)),
        "env": _probe(probe_env), "target_arches": arches,
        "presets": _probe(lambda: probe_presets(arches, cache_dir)), "kernel_selection": _probe(lambda: probe_policy(arches)),
    }


def _err(section: Any) -> str | None:
    return section["error"] if isinstance(section, dict) and "error" in section else None


def render(r: dict[str, Any]) -> str:
    """Human-readable text of a collect() report."""
    out: list[str] = []
    add = out.append
    gpu = r["gpu"]
    add("GPU")
    if _err(gpu):
        add(f"  probe failed: {_err(gpu)}")
    elif not gpu.get("available"):
        add(f"  {gpu['message']}")
    else:
        for d in gpu["devices"]:
            add(f"  [{d['index']}] {d['name']}  compute capability {d['capability']}  arch {d['arch']}"
                + (f"  NOT SUPPORTED: {d['arch_problem']}" if d.get("arch_problem") else ""))
    drv = r["driver"]
    add(f"  driver: {_err(drv) or drv.get('version') or drv.get('message')}"
        + (f" (from {drv['source']})" if isinstance(drv, dict) and drv.get("source") else ""))
    add("Versions")
    v = r["versions"]
    if _err(v):
        add(f"  probe failed: {_err(v)}")
    else:
        for k, val in v.items():
            add(f"  {k:<9} {val if isinstance(val, str) or val is None else _err(val)}")
    add("Toolchain")
    t = r["toolchain"]
    if _err(t):
        add(f"  probe failed: {_err(t)}")
    else:
        dc = t["dsl_compiler"]
        add(f"  DSL compiler (cutlass): {'importable' if dc.get('importable') else 'NOT importable'}"
            + (f" ({dc['origin']})" if dc.get("origin") else "") + (f" - {dc['message']}" if dc.get("message") else ""))
        rt = t["runtime_library"]
        add(f"  libcute_dsl_runtime.so: {_err(rt) or rt['path']}")
        nv = t["nvdisasm"]
        add(f"  nvdisasm: {_err(nv) if isinstance(nv, dict) else (nv or 'not found (pip install nvidia-cuda-nvdisasm)')}")
    add("Cache")
    c = r["cache"]
    if _err(c):
        add(f"  probe failed: {_err(c)}")
    else:
        add(f"  root: {c['root']} ({c['state']})")
        if c["fallback_reason"]:
            add(f"  fallback: {c['fallback_reason']}")
        if c["readonly_roots"]:
            add(f"  read-only roots: {', '.join(c['readonly_roots'])}")
        cap = "invalid (see Environment)" if _err(c["cap_bytes"]) else f"{c['cap_bytes']} bytes"
        add(f"  entries: {c['entries']}, size {c['size_bytes']} bytes, cap {cap}")
    add("Environment")
    if _err(r["env"]):
        add(f"  probe failed: {_err(r['env'])}")
    else:
        for e in r["env"]:
            val = "(unset)" if e["value"] is None else repr(e["value"])
            add(f"  {e['name']}={val}" + (f"  INVALID: {e['error']}" if "error" in e else ""))
            add(f"      {e['doc']}")
    add(f"MiniMax-M3 preset readiness (target arch: {', '.join(r['target_arches'])})")
    p = r["presets"]
    if _err(p):
        add(f"  probe failed: {_err(p)}")
    else:
        for row in p:
            state = "ready" if row["ready"] else ("error: " + row["error"] if "error" in row else "missing")
            add(f"  {row['geometry']:<5} q {row['q_dtype']:<4} kv {row['kv_dtype']:<5} {row['arch']:<8} "
                f"{row['ctas_per_sm']}/SM{_build_suffix(row)} {state}")
        missing = sum(not row["ready"] for row in p)
        add(f"  {len(p) - missing}/{len(p)} ready" + ("; warm the rest with: msa-jit warmup --preset minimax-m3 --arch "
                                                       + ",".join(r["target_arches"]) if missing else ""))
    add("Kernel selection")
    k = r["kernel_selection"]
    if _err(k):
        add(f"  probe failed: {_err(k)}")
    else:
        add(f"  {k['policy']}")
        add(f"  registered kernels: {', '.join(k['registered'])}")
        add(f"  {k['union_policy']}")
        add(f"  {k['cluster_merge_policy']}")
        for arch, fam in k["families"].items():
            add(f"  {arch}: {fam} kernel" + (" (mma.sync)" if fam == "token" else ""))
    return "\n".join(out)
