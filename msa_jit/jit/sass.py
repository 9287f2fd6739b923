"""Read what the compiler made, without a GPU: cubins inside an artifact, registers, SASS.

An exported artifact (.so) embeds the kernel's cubin(s) as ELF images (EM_CUDA). From
each we read the per-kernel register count (EIATTR_REGCOUNT of .nv.info), the static shared
memory, and, through `nvdisasm` (the nvidia-cuda-nvdisasm wheel, a CUDA toolkit, or the copy
Triton's wheel ships), the SASS, so tests can assert the instructions we meant are there and
that nothing spills to local memory.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

EM_CUDA = 190
SHT_NOBITS = 8
ELF64_HEADER_BYTES = 64


@dataclass(frozen=True)
class KernelResources:
    name: str
    registers: int
    static_smem: int
    sm: int


def _elf_end(data: bytes, i: int) -> int:
    e_phoff, e_shoff = struct.unpack_from("<QQ", data, i + 0x20)
    e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", data, i + 0x36)
    end = max(e_shoff + e_shentsize * e_shnum, e_phoff + e_phentsize * e_phnum)
    for k in range(e_shnum):
        off = i + e_shoff + k * e_shentsize
        (typ,) = struct.unpack_from("<I", data, off + 4)
        sh_offset, sh_size = struct.unpack_from("<QQ", data, off + 0x18)
        if typ != SHT_NOBITS:
            end = max(end, sh_offset + sh_size)
    return end


def extract_cubins(path: str | os.PathLike) -> list[bytes]:
    """Every 64-bit CUDA ELF image embedded in a file (an exported .o / .so)."""
    data = Path(path).read_bytes()
    out, i = [], 1
    while (i := data.find(b"\x7fELF", i)) >= 0:
        if data[i + 4] == 2 and struct.unpack_from("<H", data, i + 0x12)[0] == EM_CUDA:
            end = max(_elf_end(data, i), ELF64_HEADER_BYTES)  # a header without sections still moves i on
            out.append(data[i : i + end])
            i += end
        else:
            i += 4
    return out


def _sections(cubin: bytes) -> list[tuple[str, int, bytes]]:
    e_shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    hdrs = []
    for k in range(e_shnum):
        name, typ, _f, _a, off, size = struct.unpack_from("<IIQQQQ", cubin, e_shoff + k * e_shentsize)
        hdrs.append((name, typ, b"" if typ == SHT_NOBITS else cubin[off : off + size], size))
    strtab = hdrs[e_shstrndx][2]
    return [(strtab[n : strtab.index(b"\0", n)].decode(), typ, body, size) for n, typ, body, size in hdrs]


EIATTR_REGCOUNT = 0x2F


def kernel_resources(cubin: bytes) -> list[KernelResources]:
    """Registers (EIATTR_REGCOUNT of .nv.info) and static shared memory of each kernel."""
    e_flags = struct.unpack_from("<I", cubin, 0x30)[0]
    # e_flags holds the SM number: bits 0-7 in the old ABI, bits 8-15 from ELF ABI version 8 (sm_100+)
    sm = (e_flags >> 8) & 0xFF if cubin[8] >= 8 else e_flags & 0xFF
    secs = _sections(cubin)
    strtab = next(body for name, _t, body, _s in secs if name == ".strtab")
    symtab = next(body for name, _t, body, _s in secs if name == ".symtab")
    def _cstr(off: int) -> str:
        return strtab[off : strtab.index(b"\0", off)].decode()

    sym_names = [_cstr(struct.unpack_from("<I", symtab, i)[0]) for i in range(0, len(symtab), 24)]
    regs: dict[str, int] = {}
    for name, _t, body, _s in secs:
        if not name.startswith(".nv.info"):
            continue
        i = 0
        while i + 2 <= len(body):
            fmt, attr = body[i], body[i + 1]
            if fmt == 0x04:  # EIFMT_SVAL: u16 size + payload
                (size,) = struct.unpack_from("<H", body, i + 2)
                if attr == EIATTR_REGCOUNT and size >= 8:
                    sym, count = struct.unpack_from("<II", body, i + 4)
                    regs[sym_names[sym]] = count
                i += 4 + size
            elif fmt == 0x03:  # EIFMT_HVAL: u16
                i += 4
            elif fmt == 0x02:  # EIFMT_BVAL: u8 (padded)
                i += 4
            else:  # EIFMT_NVAL
                i += 2
    smem = {n[len(".nv.shared.") :]: size for n, _t, _b, size in secs if n.startswith(".nv.shared.")}
    return [
        KernelResources(n[len(".text.") :], regs.get(n[len(".text.") :], -1), smem.get(n[len(".text.") :], 0), sm)
        for n, _t, _b, _s in secs
        if n.startswith(".text.")
    ]


NVDISASM_HINT = "pip install nvidia-cuda-nvdisasm (or set CUDA_HOME to a CUDA toolkit)"


def find_nvdisasm() -> str | None:
    """nvdisasm from the nvidia-cuda-nvdisasm wheel, $CUDA_HOME, PATH, else the one Triton's
    wheel ships (triton/backends/nvidia/bin: a core dependency, so `msa-jit inspect` reads SASS
    after the plain install too; it can be older than the wheel's, hence last)."""
    for entry in sys.path:
        for flavor in ("cu13", "cu12"):
            p = Path(entry or ".") / "nvidia" / flavor / "bin" / "nvdisasm"
            if p.is_file():
                return str(p)
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvdisasm").is_file():
            return str(Path(root) / "bin" / "nvdisasm")
    found = shutil.which("nvdisasm")
    if found:
        return found
    for entry in sys.path:
        p = Path(entry or ".") / "triton" / "backends" / "nvidia" / "bin" / "nvdisasm"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def disassemble(cubin: bytes) -> str:
    """nvdisasm's SASS of one cubin; FileNotFoundError (saying how to get it) without nvdisasm."""
    tool = find_nvdisasm()
    if tool is None:
        raise FileNotFoundError(f"nvdisasm not found: {NVDISASM_HINT}")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        proc = subprocess.run([tool, "-c", f.name], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {proc.stderr.strip()}")
    return proc.stdout


_OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)", re.M)


def opcode_counts(sass: str) -> Counter:
    """Count of each opcode (with modifiers, e.g. 'HMMA.16816.F32') in nvdisasm output."""
    return Counter(_OPCODE.findall(sass))


_FUNC = re.compile(r"^\.text\.(\S+):\s*$", re.M)


def split_functions(sass: str) -> dict[str, str]:
    """nvdisasm output of one cubin -> {kernel name: its SASS}."""
    marks = list(_FUNC.finditer(sass))
    return {m.group(1): sass[m.end() : (marks[k + 1].start() if k + 1 < len(marks) else len(sass))] for k, m in enumerate(marks)}


def summarize(path: str | os.PathLike, with_sass: bool = True) -> list[dict]:
    """Per kernel in an artifact: registers, static smem, and the opcodes that matter to us.

    with_sass=False reads only the ELF (no nvdisasm): `local_ops`, `mma_ops` and
    `bulk_copy_ops` are then None.
    """
    rows = []
    for cubin in extract_cubins(path):
        funcs = split_functions(disassemble(cubin)) if with_sass else None
        for res in kernel_resources(cubin):
            row = {"kernel": res.name, "sm": res.sm, "registers": res.registers, "static_smem": res.static_smem,
                   "local_ops": None, "mma_ops": None, "bulk_copy_ops": None}
            if funcs is not None:
                base = Counter()
                for op, n in opcode_counts(funcs.get(res.name, "")).items():
                    base[op.split(".")[0]] += n
                row.update(local_ops=base["LDL"] + base["STL"], mma_ops={k: v for k, v in base.items() if "MMA" in k},
                           bulk_copy_ops=base["UBLKCP"])
            rows.append(row)
    return rows
