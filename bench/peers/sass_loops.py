"""Instruction mix of each kernel's inner loops: msa-jit's artifacts and FlashInfer's prebuilt programs.

    python bench/peers/sass_loops.py .artifacts/v1/06/0663.../sparse_decode.so     # one msa-jit build
    python bench/peers/sass_loops.py /tmp/fi-site/flashinfer/data/aot/*/*.so        # FlashInfer's Cake programs

For every kernel in the given shared objects: its instruction count and, for each loop (a backward
branch to a label) of at least --min-body instructions, the loop body's length and its most frequent
opcodes. docs/performance.md compares a decode kernel's instructions per 128-key block this way. No
GPU: nvdisasm only (msa_jit.jit.sass finds it). msa-jit's artifacts hold plain cubins; nvcc's fatbins
(FlashInfer's .so) may hold them compressed (zstd or LZ4, the `zstandard` / `lz4` modules).
"""

from __future__ import annotations

import argparse
import re
import struct
import sys
from collections import Counter
from pathlib import Path

if __name__ == "__main__":  # the checkout's msa_jit, also without PYTHONPATH
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from msa_jit.jit import sass  # noqa: E402

FATBIN_MAGIC = b"\x50\xed\x55\xba"  # 0xba55ed50, little-endian
FATBIN_ELF_KIND = 2  # an entry holding a cubin (1 is PTX)
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_INSTRUCTION = re.compile(r"/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")


def _decompress(blob: bytes, size: int) -> bytes:
    """A compressed fatbin entry: zstd (recent nvcc) else LZ4 block."""
    try:
        import zstandard

        return zstandard.ZstdDecompressor().decompress(blob, max_output_size=size)
    except Exception:  # noqa: BLE001 - not zstd, or no module: try LZ4
        import lz4.block

        return lz4.block.decompress(blob, uncompressed_size=size)


def fatbin_cubins(data: bytes) -> list[bytes]:
    """The cubins of every fatbin in `data`. A fatbin: a 16-byte header (magic, version, header size,
    payload size), then entries of a header (kind, version, header size, payload size, ..., at 56 the
    uncompressed size, 0 when stored plain) and a payload."""
    out, off = [], 0
    while (off := data.find(FATBIN_MAGIC, off)) >= 0:
        _, _, header, size = struct.unpack_from("<IHHQ", data, off)
        pos, end = off + header, off + header + size
        while pos + 64 <= end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, pos)
            (plain_size,) = struct.unpack_from("<Q", data, pos + 56)
            blob = data[pos + entry_header: pos + entry_header + payload]
            if kind == FATBIN_ELF_KIND:
                out.append(_decompress(blob, plain_size) if plain_size else blob)
            pos += entry_header + payload
        off = max(end, off + 4)
    return out


def cubins_of(path: Path) -> list[bytes]:
    """Plain embedded cubins (msa-jit's artifacts), else those of the file's fatbins."""
    return sass.extract_cubins(path) or fatbin_cubins(path.read_bytes())


def loops(kernel_sass: str, min_body: int = 100) -> list[tuple[int, Counter]]:
    """(body length, opcode counts) of each loop: a branch back to a label at or before it."""
    labels: dict[str, int] = {}
    body: list[str] = []
    found = []
    for line in kernel_sass.splitlines():
        if m := _LABEL.match(line):
            labels[m.group(1)] = len(body)
            continue
        if not (m := _INSTRUCTION.search(line)):
            continue
        text = m.group(2)
        body.append(text)
        target = _BRANCH_TARGET.search(text)
        if target and target.group(1) in labels and len(body) - labels[target.group(1)] >= min_body:
            span = body[labels[target.group(1)]:]
            found.append((len(span), Counter(t.split()[1] if t.startswith("@") else t.split()[0] for t in span)))
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path, help="shared objects with CUDA kernels")
    ap.add_argument("--min-body", type=int, default=100, help="shortest loop body shown (instructions)")
    ap.add_argument("--top", type=int, default=10, help="opcodes shown per loop")
    args = ap.parse_args(argv)
    for path in args.paths:
        for cubin in cubins_of(path):
            for name, text in sass.split_functions(sass.disassemble(cubin)).items():
                print(f"{path.name}: {name}: {sum(sass.opcode_counts(text).values())} instructions")
                for length, ops in loops(text, args.min_body):
                    top = ", ".join(f"{op} {n}" for op, n in ops.most_common(args.top))
                    print(f"  loop of {length}: {top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
