"""Steps of bench/peers/make_flashinfer_bundle.sh (project tooling, not shipped): cut out of the
flashinfer-python wheel what its Hopper sparse decode (`flashinfer.msa_ops.msa_sparse_decode_attention`
on SM90, bf16 query, fp8 cache) needs on the GPU host, and build its Cake decode programs here.

  trace    --root WHEEL_TREE --out LIST   the wheel's files that `import flashinfer.msa_ops` and the SM90
                                          decode call path read, the packages the GPU host lacks hidden
  prebuild --root WHEEL_TREE --aot DIR    build every Cake decode program for sm_90a with FlashInfer's
                                          own JIT (its ninja file, its nvcc flags) and put each .so where
                                          FlashInfer looks for a prebuilt module: DIR/<uri>/<uri>.so
  verify   --root BUNDLE_TREE             the cut tree imports on its own (same hidden packages,
                                          FLASHINFER_DISABLE_JIT=1) and holds a prebuilt .so for every
                                          decode route, under the name FlashInfer computes for it

Each step runs FlashInfer in a child interpreter whose sys.path starts with the tree, so this
process never imports it. Why prebuilding works: FlashInfer's nvcc JIT spec loads
`flashinfer/data/aot/<uri>/<uri>.so` before it considers building (`JitSpecNvcc.try_load`), and a
Cake program's uri is its name, the target and a digest of its two sources and compile flags
(`flashinfer.jit.cake_hopper_msa.get_hopper_msa_uri`), so the sources travel too (a few hundred KB).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Top-level packages FlashInfer imports only where present and the GPU host does not have (the
# CuTe DSL compiler, cuda-python, cuDNN's frontend, ...): hidden while tracing and verifying, so
# that the traced chain is the host's.
HIDDEN = ("cutlass", "nvidia_cutlass_dsl", "cuda", "cuda_tile", "cudnn", "tabulate", "einops", "click",
          "nccl4py", "nccl_extensions", "flashinfer_cubin", "flashinfer_jit_cache")

# Modules the SM90 decode path imports inside functions, at its first call (the trace imports them
# up front: it cannot make the call without a GPU).
CALL_PATH = ("flashinfer.msa_ops", "flashinfer.msa_ops.sparse_decode", "flashinfer.msa_ops._sm90_dispatch",
             "flashinfer.msa_ops.cake_hopper_sm90", "flashinfer.jit.cake_hopper_msa", "flashinfer.jit.core",
             "flashinfer.jit.env", "flashinfer.jit.cpp_ext", "flashinfer.utils", "flashinfer.api_logging",
             "flashinfer.trace.template", "flashinfer.fi_trace", "tvm_ffi.stream")

_CHILD_PRELUDE = r"""
import importlib.abc, json, os, sys
HIDDEN = set(json.loads(os.environ["FI_BUNDLE_HIDDEN"]))
class _Hide(importlib.abc.MetaPathFinder):
    # wraps the path finder: a hidden top-level name is not found, as on a host without it
    def __init__(self, inner): self.inner = inner
    def find_spec(self, name, path=None, target=None):
        return None if name.split(".")[0] in HIDDEN else self.inner.find_spec(name, path, target)
    def invalidate_caches(self): self.inner.invalidate_caches()
sys.meta_path[:] = [_Hide(f) if getattr(f, "__name__", "") == "PathFinder" else f for f in sys.meta_path]
for _n in [n for n in sys.modules if n.split(".")[0] in HIDDEN]:  # imported by a .pth file at start-up
    del sys.modules[_n]
"""

_TRACE = _CHILD_PRELUDE + r"""
import importlib
root = os.path.realpath(os.environ["FI_BUNDLE_ROOT"]) + os.sep
opened = set()
def _audit(event, args):
    if event == "open" and isinstance(args[0], str) and os.path.realpath(args[0]).startswith(root):
        opened.add(os.path.realpath(args[0]))
sys.addaudithook(_audit)
for name in json.loads(os.environ["FI_BUNDLE_CALL_PATH"]):
    importlib.import_module(name)
from flashinfer.msa_ops import msa_sparse_decode_attention  # noqa: F401
files = {os.path.realpath(m.__file__) for m in list(sys.modules.values()) if getattr(m, "__file__", None)}
files = sorted(f[len(root):] for f in files | opened if f.startswith(root) and "__pycache__" not in f)
print(json.dumps(files))
"""

_PREBUILD = r"""
import json, os, shutil, sys, time
from flashinfer.jit.cake_hopper_msa import ROUTES, gen_hopper_msa_module
aot = os.environ["FI_BUNDLE_AOT"]
names = sorted({v for k, v in ROUTES.items() if k.startswith("decode_v5:")})
linked_ok = json.loads(os.environ["FI_BUNDLE_LINKED_OK"])  # .so files whose libcuda.so.1 link was checked
for i, name in enumerate(names, 1):
    spec = gen_hopper_msa_module(name)
    dest = os.path.join(aot, spec.name, spec.name + ".so")
    if dest in linked_ok:
        print(f"[{i}/{len(names)}] {spec.name}: built before", flush=True)
        continue
    if os.path.exists(spec.jit_library_path):  # linked without the driver (an older stub): link again
        os.remove(spec.jit_library_path)
    t0 = time.time()
    spec.build(verbose=False)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    shutil.copyfile(spec.jit_library_path, dest + ".part")
    os.replace(dest + ".part", dest)
    print(f"[{i}/{len(names)}] {spec.name}: {os.path.getsize(dest)} B in {time.time() - t0:.0f} s", flush=True)
"""

_VERIFY = _CHILD_PRELUDE + r"""
import flashinfer
from flashinfer.msa_ops import msa_sparse_decode_attention  # noqa: F401
from flashinfer.msa_ops import cake_hopper_sm90, _sm90_dispatch  # noqa: F401
from flashinfer.jit import env as jit_env
from flashinfer.jit.cake_hopper_msa import ROUTES, get_hopper_msa_uri
routes = {k: v for k, v in ROUTES.items() if k.startswith("decode_v5:")}
missing = [k for k, name in routes.items() if not jit_env.get_aot_artifacts(get_hopper_msa_uri(name))]
print(json.dumps({"version": flashinfer.__version__, "file": flashinfer.__file__, "routes": len(routes),
                  "programs": len(set(routes.values())), "missing": missing}))
"""


def _child(code: str, root: Path, extra_path: list[Path], env: dict[str, str]) -> str:
    """Run `code` in a fresh interpreter whose sys.path starts with root (then extra_path); its stdout."""
    path = [str(root), *map(str, extra_path)]
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                "PYTHONDONTWRITEBYTECODE": "1", "FI_BUNDLE_HIDDEN": json.dumps(HIDDEN),
                "FI_BUNDLE_ROOT": str(root), "FI_BUNDLE_CALL_PATH": json.dumps(CALL_PATH), **env}
    run = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"fi_bundle: the child interpreter failed (rc {run.returncode}):\n{run.stderr[-4000:]}")
    return run.stdout


def _workspace_env(workspace: Path) -> dict[str, str]:
    """FlashInfer's JIT settings for a machine with no GPU: sm_90a named, its workspace in `workspace`."""
    return {"FLASHINFER_WORKSPACE_BASE": str(workspace), "FLASHINFER_CUDA_ARCH_LIST": "9.0a",
            "CUDA_HOME": os.environ.get("CUDA_HOME", "/usr/local/cuda")}


# FlashInfer takes other import paths where the CuTe DSL is importable (a host given the full DSL bundle):
# traced a second time with these visible, when this machine has them, and the two file sets united
DSL = ("cutlass", "nvidia_cutlass_dsl", "cuda")


def trace(root: Path, deps: list[Path], out: Path) -> list[str]:
    files: set[str] = set()
    for hidden in _hidden_sets():
        with tempfile.TemporaryDirectory() as ws:
            env = {**_workspace_env(Path(ws)), "FI_BUNDLE_HIDDEN": json.dumps(hidden)}
            files |= set(json.loads(_child(_TRACE, root, deps, env).strip().splitlines()[-1]))
    out.write_text("".join(f + "\n" for f in sorted(files)))
    return sorted(files)


# Driver entry points a module may call (the Cake bindings: the first three); the stub below defines them
DRIVER_SYMBOLS = ("cuGetErrorName", "cuGetErrorString", "cuTensorMapEncodeTiled", "cuTensorMapEncodeIm2col",
                  "cuGetProcAddress", "cuDriverGetVersion", "cuLaunchKernelEx", "cuFuncSetAttribute",
                  "cuModuleGetFunction", "cuLibraryGetKernel", "cuCtxGetCurrent", "cuDeviceGet",
                  "cuDeviceGetAttribute", "cuPointerGetAttribute", "cuStreamGetCtx")


def _libcuda_stub(where: Path) -> Path:
    """A libcuda.so with the driver's soname, as the CUDA toolkit's lib64/stubs one (absent here): FlashInfer
    links its modules with -lcuda (the Cake bindings call cuTensorMapEncodeTiled), and with the linker's
    --as-needed only a library that defines a used symbol becomes a DT_NEEDED entry. Each module then
    names libcuda.so.1, whose real symbols the host's loader binds."""
    where.mkdir(parents=True, exist_ok=True)
    src = where / "stub.c"
    src.write_text("".join(f"int {name}(void) {{ return 999; }}\n" for name in DRIVER_SYMBOLS))
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", str(src), "-o", str(where / "libcuda.so")],
                   check=True)
    return where


def _needed(so: Path) -> list[str] | None:
    """The DT_NEEDED entries of a shared object (readelf), None without readelf."""
    if not shutil.which("readelf"):
        return None
    text = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].split("]", 1)[0] for line in text.splitlines() if "(NEEDED)" in line]


def _linked_ok(aot: Path) -> list[str]:
    """The prebuilt modules under aot that name the driver (or every one, where readelf is missing)."""
    return [str(so) for so in sorted(aot.glob("*/*.so")) if "libcuda.so.1" in (_needed(so) or ["libcuda.so.1"])]


def prebuild(root: Path, deps: list[Path], aot: Path, workspace: Path, jobs: int) -> None:
    stub = _libcuda_stub(workspace / "libcuda-stub")
    library_path = os.pathsep.join(p for p in (str(stub), os.environ.get("LIBRARY_PATH", "")) if p)
    env = {**_workspace_env(workspace), "FI_BUNDLE_AOT": str(aot), "MAX_JOBS": str(jobs),
           "LIBRARY_PATH": library_path, "FI_BUNDLE_LINKED_OK": json.dumps(_linked_ok(aot) if aot.exists() else [])}
    aot.mkdir(parents=True, exist_ok=True)
    path = [str(root), *map(str, deps), os.environ.get("PYTHONPATH", "")]
    run = subprocess.run([sys.executable, "-c", _PREBUILD],
                         env={**os.environ, **env, "PYTHONPATH": os.pathsep.join(p for p in path if p)})
    if run.returncode:
        raise SystemExit(f"fi_bundle prebuild: failed (rc {run.returncode})")
    unlinked = sorted({str(so) for so in aot.glob("*/*.so")} - set(_linked_ok(aot)))
    if unlinked:
        raise SystemExit(f"fi_bundle prebuild: not linked against libcuda.so.1: {unlinked}")


def _hidden_sets() -> list[tuple[str, ...]]:
    """The host's view (HIDDEN), and the view with the CuTe DSL importable where this machine has it."""
    import importlib.util

    sets = [HIDDEN]
    if importlib.util.find_spec("cutlass") is not None:
        sets.append(tuple(h for h in HIDDEN if h not in DSL))
    return sets


def verify(root: Path, deps: list[Path]) -> dict:
    for hidden in _hidden_sets():
        with tempfile.TemporaryDirectory() as ws:
            env = {**_workspace_env(Path(ws)), "FLASHINFER_DISABLE_JIT": "1", "FI_BUNDLE_HIDDEN": json.dumps(hidden)}
            doc = json.loads(_child(_VERIFY, root, deps, env).strip().splitlines()[-1])
        if not doc["file"].startswith(str(root)):
            raise SystemExit(f"fi_bundle verify: flashinfer was imported from {doc['file']}, not from {root}")
        if doc["missing"]:
            raise SystemExit(f"fi_bundle verify: no prebuilt program for {doc['missing']} (hidden: {hidden})")
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("trace", "prebuild", "verify"):
        s = sub.add_parser(name)
        s.add_argument("--root", type=Path, required=True, help="a tree holding flashinfer/")
        s.add_argument("--deps", type=Path, action="append", default=[],
                       help="a folder of pure-Python dependencies to put on sys.path after the tree")
        if name == "trace":
            s.add_argument("--out", type=Path, required=True)
        if name == "prebuild":
            s.add_argument("--aot", type=Path, required=True)
            s.add_argument("--workspace", type=Path, required=True)
            s.add_argument("--jobs", type=int, default=1)
    a = p.parse_args(argv)
    root = a.root.resolve()
    if a.cmd == "trace":
        files = trace(root, a.deps, a.out)
        print(f"{len(files)} files ({sum((root / f).stat().st_size for f in files)} B) -> {a.out}")
    elif a.cmd == "prebuild":
        prebuild(root, a.deps, a.aot.resolve(), a.workspace.resolve(), a.jobs)
    else:
        print(json.dumps(verify(root, a.deps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
