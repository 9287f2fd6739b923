"""SASS digests of every kernel build the planner can pick, to show a refactor leaves them byte-identical.

    python bench/sass_digests.py make OUT.json [--dump DIR]     # MSA_JIT_CACHE_DIR picks the cache
    python bench/sass_digests.py compare BEFORE.json AFTER.json  # exit 1 on any difference or missing row

`make` expands the minimax-m3 preset (head layouts x query dtypes x KV formats) for sm_90a and sm_100a
through `plannable_configs` (what an unpinned planner picks), plus every union build a pin can take
(marked opt_in, as a pin is); compiles each build (or takes it from the cache) and
hashes each kernel's `nvdisasm -c -hex` SASS (encodings, so control codes too). Normalized away: only
the kernel's symbol / section name and the per-cubin numbering of branch labels and internal
subroutines. Rows are keyed by the config dict (never the cache key); a kernel's role comes from its
SASS (split_merge: no MMA instruction, else decode; #n by digest where a build has two).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import itertools
import json
import os
import pkgutil
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's msa_jit, whatever is installed

SCOPES = ("default", "opt_in")
PREFERRED = ("jit.compiler", "jit.registry", "compiler", "tools.warmup", "warmup", "geometry")  # then every other module
EM_CUDA = 190


def local_module(name: str) -> Any:
    """Module `name` if it and its parents are this checkout's, else None (an editable install's
    finder maps a module this checkout lacks to the installed checkout)."""
    parts = name.split(".")
    try:
        for i in range(1, len(parts) + 1):
            spec = importlib.util.find_spec(".".join(parts[:i]))
            if spec is None or not spec.origin or not Path(spec.origin).resolve().is_relative_to(ROOT):
                return None
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a module that does not import here holds nothing we need
        return None


@functools.lru_cache(maxsize=None)
def lookup(name: str) -> Any:
    """`name` from the first of this checkout's msa_jit modules that defines it."""
    import msa_jit

    def candidates() -> Iterator[str]:
        yield from (f"msa_jit.{n}" for n in PREFERRED)
        yield from sorted(m.name for m in pkgutil.walk_packages(msa_jit.__path__, "msa_jit.")
                          if not m.name.endswith("__main__"))  # importing it runs the command

    for mod in candidates():
        m = local_module(mod)
        if m is not None and hasattr(m, name):
            return getattr(m, name)
    raise ImportError(f"no msa_jit module of {ROOT} defines {name}")


def extract_cubins(path: Path) -> list[bytes]:
    """Every 64-bit CUDA ELF image embedded in an exported shared object."""
    data, out, i = path.read_bytes(), [], 1
    while (i := data.find(b"\x7fELF", i)) >= 0:
        if data[i + 4] != 2 or struct.unpack_from("<H", data, i + 0x12)[0] != EM_CUDA:
            i += 4
            continue
        phoff, shoff = struct.unpack_from("<QQ", data, i + 0x20)
        phsize, phnum, shsize, shnum = struct.unpack_from("<HHHH", data, i + 0x36)
        end = max(64, shoff + shsize * shnum, phoff + phsize * phnum)
        for k in range(shnum):
            typ, = struct.unpack_from("<I", data, i + shoff + k * shsize + 4)
            off, size = struct.unpack_from("<QQ", data, i + shoff + k * shsize + 0x18)
            end = max(end, off + size) if typ != 8 else end  # SHT_NOBITS takes no bytes
        out.append(data[i : i + end])
        i += end
    return out


def nvdisasm() -> str:
    """The nvidia-cuda-nvdisasm wheel's nvdisasm, else one on PATH."""
    for entry in sys.path:
        for flavor in ("cu13", "cu12"):
            p = Path(entry or ".") / "nvidia" / flavor / "bin" / "nvdisasm"
            if p.is_file():
                return str(p)
    found = shutil.which("nvdisasm")
    if not found:
        raise FileNotFoundError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    return found


HEADER = re.compile(r"^//-+ \.text\.(\S+) -+$", re.M)
INSTRUCTION = re.compile(r"^/\*[0-9a-f]+\*/ ", re.M)
MMA = re.compile(r"^/\*[0-9a-f]+\*/ (?:@!?U?P\w+ )?[A-Z0-9]*MMA\b", re.M)


def renumber(text: str, pattern: str, template: str) -> str:
    """Number the matches of `pattern` (its group 1 a number) by first appearance."""
    seen: dict[str, int] = {}
    return re.sub(pattern, lambda m: template.format(seen.setdefault(m.group(1), len(seen))), text)


def kernels(cubin: bytes) -> list[tuple[str, str]]:
    """(role, normalized SASS) of each kernel in one cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        proc = subprocess.run([nvdisasm(), "-c", "-hex", f.name], capture_output=True, text=True, check=True)
    marks = list(HEADER.finditer(proc.stdout))
    out = []
    for k, m in enumerate(marks):
        body = proc.stdout[m.start() : marks[k + 1].start() if k + 1 < len(marks) else None]
        body = body.split("//--------------------- SYMBOLS")[0].replace(m.group(1), "FUNC")
        body = renumber(body, r"\.L_x_(\d+)\b", ".L_{}")
        body = renumber(body, r"\$__internal_(\d+)_\$", "$__internal_{}_$")
        norm = "\n".join(" ".join(line.split()) for line in body.splitlines() if line.strip()) + "\n"
        if re.search(r"msa_jit|cutlass|_object_at_", norm):
            raise RuntimeError(f"a name survived normalization in {m.group(1)[:80]}")
        out.append(("decode" if MMA.search(norm) else "split_merge", norm))
    return out


def artifact_dir(config: Any, tmp: str) -> Path:
    """The directory of config's artifact: the cache's entry, else a fresh build in `tmp`."""
    try:
        ensure = lookup("ensure_compiled")
    except ImportError:
        out = Path(tempfile.mkdtemp(dir=tmp))
        lookup("compile_sparse_decode")(config, out)
        return out
    return Path(ensure(config)[0].path)


def configs(scope: str, preset: str) -> list[Any]:
    """`default`: every config an unpinned planner may pick for `preset`; `opt_in`: the union builds only
    a pin takes (its 1-CTA build)."""
    plannable, union = lookup("plannable_configs"), lookup("union_configs")
    heads, q_dtypes, kv_dtypes = lookup("PRESETS")[preset]
    out: list[Any] = []
    for (hq, hkv), q, kv, arch in itertools.product(heads, q_dtypes, kv_dtypes, lookup("DEFAULT_ARCHES")):
        base = lookup("SparseDecodeConfig")(hq, hkv, q_dtype=q, kv_dtype=kv, arch=arch)
        planned = plannable(base)
        picked = planned if scope == "default" else [c for c in union(base) if c not in planned]
        out += [c for c in picked if c not in out]
    return out


def digest(config: Any, scope: str, where: Path) -> tuple[dict[str, Any], list[str]]:
    """The row of one build (its kernels sorted by role, then digest) and each kernel's normalized SASS."""
    found = sorted((role, hashlib.sha256(norm.encode()).hexdigest(), norm)
                   for so in sorted(where.glob("*.so")) for cubin in extract_cubins(so) for role, norm in kernels(cubin))
    row: dict[str, Any] = {**dataclasses.asdict(config), "opt_in": scope != "default", "kernels": []}
    for role, sha, norm in found:
        if sum(r == role for r, _s, _n in found) > 1:
            role += f"#{sum(k['role'].startswith(role + '#') for k in row['kernels']) + 1}"
        row["kernels"].append({"role": role, "instructions": len(INSTRUCTION.findall(norm)), "sha256": sha})
    return row, [norm for _r, _s, norm in found]


def make(out_path: Path, preset: str, dump: Path | None) -> int:
    """Compile (or find) every build, write the digest rows to `out_path`."""
    t0, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        for scope in SCOPES:
            todo = configs(scope, preset)  # the scope's flags stay set while its builds compile
            for i, config in enumerate(todo):
                t1 = time.perf_counter()
                row, norms = digest(config, scope, artifact_dir(config, tmp))
                if any({**identity(r), "opt_in": True} == identity(row) and r["kernels"] == row["kernels"] for r in rows):
                    continue  # an opted-in build the defaults already gave
                rows.append(row)
                for k, norm in zip(row["kernels"], norms) if dump else ():
                    dump.mkdir(parents=True, exist_ok=True)
                    (dump / f"{label(row)}-{k['role'].replace('#', '-')}.sass").write_text(norm)
                print(f"[{scope} {i + 1}/{len(todo)}] {label(row)}: {len(norms)} kernel(s) "
                      f"({time.perf_counter() - t1:.1f}s)", file=sys.stderr, flush=True)
    rows.sort(key=lambda r: json.dumps(identity(r), sort_keys=True))
    strays = [m.__file__ for n, m in list(sys.modules.items()) if n.split(".")[0] == "msa_jit"
              and getattr(m, "__file__", None) and not Path(m.__file__).resolve().is_relative_to(ROOT)]
    if strays:
        raise RuntimeError(f"modules of another checkout were imported: {strays[:3]}")
    version = subprocess.run([nvdisasm(), "--version"], capture_output=True, text=True).stdout
    meta = {"nvdisasm": "; ".join(v for v in version.splitlines() if "release" in v or "Build" in v),
            "preset": preset, "seconds": round(time.perf_counter() - t0, 1)}
    try:
        meta["cutlass_dsl"] = lookup("dsl_version")()
    except ImportError:
        pass
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, sort_keys=True) + "\n")
    print(f"{len(rows)} builds, {sum(len(r['kernels']) for r in rows)} kernels in {meta['seconds']}s -> {out_path}",
          file=sys.stderr)
    return 0


def identity(row: dict[str, Any]) -> dict[str, Any]:
    """A row's config (everything but its kernels)."""
    return {k: v for k, v in row.items() if k != "kernels"}


def label(row: dict[str, Any]) -> str:
    """'64-4-bfloat16-nvfp4-sm_90a-2-token-kernel' (+ '-opt_in')."""
    keys = ("num_q_heads", "num_kv_heads", "q_dtype", "kv_dtype", "arch", "ctas_per_sm", "kernel", "split_merge")
    return "-".join(str(row.get(k)) for k in keys) + ("-opt_in" if row.get("opt_in") else "")


def compare(a_path: Path, b_path: Path, retired: tuple[str, ...] = ()) -> int:
    """Print identical / differing / missing rows of two digest files; 1 on any difference, or on a row
    missing from one file unless its label contains one of `retired` (a build the product no longer has)."""
    a, b = (json.loads(p.read_text()) for p in (a_path, b_path))
    for tool in ("nvdisasm", "cutlass_dsl"):
        if a["meta"].get(tool) != b["meta"].get(tool):
            print(f"warning: {tool} differs: {a['meta'].get(tool)} vs {b['meta'].get(tool)}")
    index = [{json.dumps(identity(r), sort_keys=True): r for r in d["rows"]} for d in (a, b)]
    same = differ = missing = 0
    for key in sorted(set(index[0]) | set(index[1])):
        ra, rb = index[0].get(key), index[1].get(key)
        if ra is None or rb is None:
            if any(r in label(ra or rb) for r in retired):
                print(f"retired: {label(ra or rb)}")
                continue
            missing += 1
            print(f"MISSING in {b_path if rb is None else a_path}: {label(ra or rb)}")
        elif ra["kernels"] == rb["kernels"]:
            same += 1
            print(f"identical: {label(ra)} ({', '.join(k['role'] for k in ra['kernels'])})")
        else:
            differ += 1
            print(f"DIFFERS: {label(ra)}")
            for side, r in (("A", ra), ("B", rb)):
                for k in r["kernels"]:
                    print(f"    {side} {k['role']:<14} {k['instructions']:>6} instr {k['sha256'][:16]}")
    print(f"{same} identical, {differ} differing, {missing} missing")
    return 1 if differ or missing else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="compile (or find) every plannable build and write its SASS digests")
    m.add_argument("out", type=Path)
    m.add_argument("--preset", default="minimax-m3")
    m.add_argument("--dump", type=Path, help="also write each kernel's normalized SASS here (for diffing)")
    c = sub.add_parser("compare", help="compare two digest files (exit 1 on any difference)")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--retired", action="append", default=[],
                   help="a label substring of builds the product no longer has (not counted as missing)")
    args = p.parse_args(argv)
    return (make(args.out, args.preset, args.dump) if args.cmd == "make"
            else compare(args.a, args.b, tuple(args.retired)))


if __name__ == "__main__":
    sys.exit(main())
