"""bench/peers/sass_loops.py without nvdisasm: its loop finder on SASS text in nvdisasm's form, and its
fatbin reader on fatbins built here (an entry stored plain, one zstd-compressed, a PTX entry skipped)."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sl():
    spec = importlib.util.spec_from_file_location("sass_loops", ROOT / "bench" / "peers" / "sass_loops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sass(lines: list[str]) -> str:
    """nvdisasm -c's layout: labels on their own lines, each instruction after its /*address*/."""
    out, addr = [], 0
    for line in lines:
        if line.endswith(":"):
            out.append(line)
        else:
            out.append(f"        /*{addr:04x}*/                   {line} ;")
            addr += 16
    return "\n".join(out)


def test_loops_are_backward_branches_with_their_opcodes(sl):
    text = _sass(["MOV R1, R2", ".L_x_0:", "HMMA.16816.F32 R4, R8, R12, R4", "@P0 F2FP.F16.E4M3.UNPACK_B R2, R3",
                  "F2FP.F16.E4M3.UNPACK_B R5, R6", "@P1 BRA `(.L_x_0)", ".L_x_1:", "EXIT", "BRA `(.L_x_1)",
                  "@!P2 BRA `(.L_x_9)", ".L_x_9:", "NOP"])
    found = sl.loops(text, min_body=1)
    # the loop at .L_x_0 (4 instructions, the predicate not part of the opcode); .L_x_1's self-loop of two;
    # a forward branch is no loop
    assert [(n, dict(ops)) for n, ops in found] == [
        (4, {"HMMA.16816.F32": 1, "F2FP.F16.E4M3.UNPACK_B": 2, "BRA": 1}), (2, {"EXIT": 1, "BRA": 1})]
    assert [n for n, _ in sl.loops(text, min_body=3)] == [4]


def _fatbin(entries: list[tuple[int, bytes, int]]) -> bytes:
    """A fatbin of (kind, payload, uncompressed size or 0) entries, each behind a 64-byte header."""
    body = b""
    for kind, payload, plain_size in entries:
        header = struct.pack("<HHIQ", kind, 0x101, 64, len(payload)) + bytes(32) + struct.pack("<QQ", 0, plain_size)
        body += header + payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def test_fatbin_cubins_skip_ptx_and_read_every_fatbin(sl):
    plain = b"\x7fELF-plain" * 3
    data = b"\0" * 40 + _fatbin([(1, b"ptx text", 0), (2, plain, 0)]) + b"\0" * 8 + _fatbin([(2, plain[:8], 0)])
    assert sl.fatbin_cubins(data) == [plain, plain[:8]]  # two fatbins, as a .so may hold
    assert sl.fatbin_cubins(b"no fatbin here") == []


def test_fatbin_cubins_compressed(sl):
    zstandard = pytest.importorskip("zstandard")
    packed = b"\x7fELF-packed" * 50
    data = _fatbin([(2, zstandard.ZstdCompressor().compress(packed), len(packed))])
    assert sl.fatbin_cubins(data) == [packed]
