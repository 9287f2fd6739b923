"""msa_jit.jit.sass without a compiler or nvdisasm: the ELF reading (a hand-made cubin), the opcode
counting of nvdisasm's text, the per-kernel summary `msa-jit inspect` and the spill checks read,
and nvdisasm failing. The real artifacts' SASS: test_compile_cache.py, test_kernel_options.py."""

from __future__ import annotations

import signal
import struct
import textwrap
from collections import Counter

import pytest

from msa_jit.jit import sass


def _cubin(*, abi_version: int, e_flags: int, info: bytes, kernel: str = "decode", smem: int = 1024) -> bytes:
    """A minimal 64-bit CUDA ELF (EM_CUDA = 190): .shstrtab, .strtab, .symtab (the kernel's symbol), .nv.info (`info`),
    .text.<kernel> and a NOBITS .nv.shared.<kernel> of `smem` bytes; section headers last."""
    names = [".shstrtab", ".strtab", ".symtab", ".nv.info", f".text.{kernel}", f".nv.shared.{kernel}"]
    shstrtab = b"\0" + b"".join(n.encode() + b"\0" for n in names)
    strtab = b"\0" + kernel.encode() + b"\0"
    symtab = bytes(24) + struct.pack("<I", 1) + bytes(20)  # symbol 0: null, symbol 1: the kernel
    bodies = [shstrtab, strtab, symtab, info, b"\x00" * 32]
    data, offsets = bytearray(64), []
    for body in bodies:
        offsets.append(len(data))
        data += body
    data += bytes(-len(data) % 8)
    shoff = len(data)
    headers = [bytes(64)]  # section 0: null
    for k, name in enumerate(names):
        name_off = shstrtab.index(name.encode() + b"\0")
        if k < len(bodies):
            headers.append(struct.pack("<IIQQQQIIQQ", name_off, 1, 0, 0, offsets[k], len(bodies[k]), 0, 0, 1, 0))
        else:  # SHT_NOBITS: a size, no bytes in the file
            headers.append(struct.pack("<IIQQQQIIQQ", name_off, 8, 0, 0, shoff, smem, 0, 0, 1, 0))
    data += b"".join(headers)
    ident = b"\x7fELF" + bytes([2, 1, 1, 0x33, abi_version]) + bytes(7)
    data[0:64] = ident + struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, shoff, e_flags, 64, 0, 0, 64,
                                     len(headers), 1)
    return bytes(data)


# .nv.info: an EIFMT_HVAL and an EIFMT_BVAL attribute, an EIFMT_NVAL one, then EIATTR_REGCOUNT (0x2F, SVAL)
# of symbol 1: 96 registers
NV_INFO = (bytes([0x03, 0x1B]) + struct.pack("<H", 0x0404) + bytes([0x02, 0x0A, 0x04, 0x00]) + bytes([0x01, 0x04])
           + bytes([0x04, 0x2F]) + struct.pack("<HII", 8, 1, 96))


def test_cubins_are_found_in_an_artifact_and_read(tmp_path):
    """extract_cubins finds each CUDA ELF inside a host file (not the host's own ELF), whole; and
    kernel_resources reads the registers past other .nv.info attributes, the NOBITS shared memory,
    and the SM number from e_flags: bits 0-7 before ELF ABI version 8, bits 8-15 from it on."""
    sm90 = _cubin(abi_version=7, e_flags=0x5A005A, info=NV_INFO)
    sm100 = _cubin(abi_version=8, e_flags=100 << 8, info=NV_INFO, kernel="decode100", smem=2048)
    host = b"\x7fELF" + bytes([2, 1, 1]) + bytes(11) + struct.pack("<H", 62) + bytes(44)  # x86-64, not EM_CUDA
    so = tmp_path / "sparse_decode.so"
    so.write_bytes(host + b"junk" + sm90 + b"\0" * 13 + sm100 + b"tail")
    assert sass.extract_cubins(so) == [sm90, sm100]
    assert sass.kernel_resources(sm90) == [sass.KernelResources("decode", 96, 1024, 90)]
    assert sass.kernel_resources(sm100) == [sass.KernelResources("decode100", 96, 2048, 100)]


def test_a_cuda_elf_header_without_sections_is_stepped_over(tmp_path):
    """A malformed image (a CUDA ELF header with no sections and no program headers: its end is 0)
    is taken as its 64-byte header and the search goes on past it, instead of finding it forever."""
    bare = b"\x7fELF" + bytes([2, 1, 1, 0x33, 7]) + bytes(7) + struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, 0, 0,
                                                                          64, 0, 0, 64, 0, 0)
    sm90 = _cubin(abi_version=7, e_flags=0x5A005A, info=NV_INFO)
    so = tmp_path / "odd.so"
    so.write_bytes(b"xx" + bare + sm90)

    def hung(signum, frame):
        raise TimeoutError("extract_cubins did not return")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        assert sass.extract_cubins(so) == [bare, sm90]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


SASS = textwrap.dedent("""\
            .section .text.decode
    .text.decode:
            /*0000*/                   LDC R1, c[0x0][0x28] ;
            /*0010*/              @!P0 STL [R1+0x4], R3 ;
            /*0020*/                   LDL.64 R2, [R1] ;
            /*0030*/               @P1 HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
            /*0040*/             @!UP0 UBLKCP.S.G [UR4], [UR6], UR8 ;
            /*0050*/                   EXIT ;
    .text.merge:
            /*0000*/                   STL [R1], R0 ;
            /*0010*/                   EXIT ;
""")


def test_opcode_counts_include_predicated_instructions():
    """Every instruction counts, negated-predicate (@!P0, @!UP0) ones included: a spill store under
    a predicate is a spill all the same."""
    assert sass.opcode_counts(SASS) == Counter({"LDC": 1, "STL": 2, "LDL.64": 1, "HMMA.16816.F32.BF16": 1,
                                                "UBLKCP.S.G": 1, "EXIT": 2})
    funcs = sass.split_functions(SASS)
    assert list(funcs) == ["decode", "merge"] and "STL [R1], R0" not in funcs["decode"]


def test_summarize_counts_loads_and_stores_to_local_memory(monkeypatch):
    """summarize (what `msa-jit inspect` and the spill checks read): local_ops = LDL + STL of the
    kernel's own SASS, whatever their modifiers; mma_ops and bulk copies by base opcode; no SASS
    read with with_sass=False. extract_cubins / kernel_resources / nvdisasm are stand-ins."""
    monkeypatch.setattr(sass, "extract_cubins", lambda path: [b"cubin"])
    monkeypatch.setattr(sass, "kernel_resources", lambda cubin: [sass.KernelResources("decode", 96, 0, 90),
                                                                 sass.KernelResources("merge", 32, 0, 90)])
    monkeypatch.setattr(sass, "disassemble", lambda cubin: SASS)
    decode, merge = sass.summarize("x.so")
    assert (decode["kernel"], decode["registers"], decode["sm"]) == ("decode", 96, 90)
    assert (decode["local_ops"], decode["mma_ops"], decode["bulk_copy_ops"]) == (2, {"HMMA": 1}, 1)
    assert (merge["local_ops"], merge["mma_ops"], merge["bulk_copy_ops"]) == (1, {}, 0)
    monkeypatch.setattr(sass, "disassemble", lambda cubin: pytest.fail("with_sass=False read SASS"))
    (row, _) = sass.summarize("x.so", with_sass=False)
    assert (row["local_ops"], row["mma_ops"], row["bulk_copy_ops"]) == (None, None, None)


def test_disassemble_reports_nvdisasm_failing_or_missing(tmp_path, monkeypatch):
    """A failing nvdisasm is an error with its message (never empty SASS, which would count no
    spills); no nvdisasm says how to get one."""
    tool = tmp_path / "nvdisasm"
    tool.write_text("#!/bin/sh\necho 'nvdisasm fatal   : not a cubin' >&2\nexit 1\n")
    tool.chmod(0o755)
    monkeypatch.setattr(sass, "find_nvdisasm", lambda: str(tool))
    with pytest.raises(RuntimeError, match="nvdisasm failed: nvdisasm fatal   : not a cubin"):
        sass.disassemble(b"cubin")
    monkeypatch.setattr(sass, "find_nvdisasm", lambda: None)
    with pytest.raises(FileNotFoundError, match="nvidia-cuda-nvdisasm"):
        sass.disassemble(b"cubin")
