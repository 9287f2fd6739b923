"""A small PTX interpreter for the tests: msa_jit/kernels/ptx.py's inline asm run as written, on the CPU.

Registers hold 32-bit words as numpy uint32 arrays (one lane per element), so one text runs on
scalars or on 100k inputs at once; an .f32 instruction reads its operands as float32 bit patterns.
Only the instructions msa_jit/kernels/ptx.py's tested helpers use are modelled; any other one fails.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np

PTX_PY = Path(__file__).resolve().parents[1] / "msa_jit" / "kernels" / "ptx.py"
_M32 = 0xFFFFFFFF
_F32, _F64, _U32 = np.float32, np.float64, np.uint32
_TINY = np.finfo(_F32).tiny


def ptx_of(function: str) -> tuple[str, str]:
    """(asm text, constraints) of the `_asm(...)` in msa_jit/kernels/ptx.py's `function`, read from the source
    (no DSL import): what the tests run is what the kernels emit. The text must be a literal."""
    tree = ast.parse(PTX_PY.read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function]
    (call,) = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "_asm"]
    return ast.literal_eval(call.args[2]), ast.literal_eval(call.args[3])


def _ftz(v):
    """.ftz: denormal float32 inputs and results flushed to zero of the same sign."""
    v = np.asarray(v, dtype=_F32)
    return np.where(np.abs(v) < _TINY, np.copysign(_F32(0.0), v), v).astype(_F32)


def _round_down(exact):
    """float64 -> the float32 at or below it (.rm)."""
    r = exact.astype(_F32)
    return np.where(r.astype(_F64) > exact, np.nextafter(r, _F32(-np.inf)), r).astype(_F32)


def _lop3(a, b, c, lut: int):
    """Bit i: LUT bit (a_i << 2 | b_i << 1 | c_i), PTX's 0xF0 / 0xCC / 0xAA encoding."""
    r = np.zeros_like(a)
    for idx in range(8):
        if (lut >> idx) & 1:
            r |= (a if idx & 4 else ~a) & (b if idx & 2 else ~b) & (c if idx & 1 else ~c)
    return r


def _prmt(a, b, sel: int):
    """Byte k: byte (sel >> 4k) & 7 of {b:a}, its sign replicated when bit 3 is set (default mode)."""
    src = [(a >> _U32(8 * i)) & _U32(0xFF) for i in range(4)] + [(b >> _U32(8 * i)) & _U32(0xFF) for i in range(4)]
    r = np.zeros_like(a)
    for k in range(4):
        n = (sel >> (4 * k)) & 15
        byte = src[n & 7]
        if n & 8:
            byte = np.where(byte & _U32(0x80), _U32(0xFF), _U32(0))
        r |= byte.astype(_U32) << _U32(8 * k)
    return r


def _as_words(v):
    if isinstance(v, np.ndarray):
        return v.view(_U32) if v.dtype == _F32 else v.astype(_U32)
    return np.asarray(int(v) & _M32, dtype=_U32)


def run_ptx(text: str, constraints: str, *inputs):
    """The outputs ($0 ..) of the PTX `text` on `inputs` (the operands after the outputs): Python ints
    (32-bit words) give a list of ints, numpy arrays (uint32 words, or float32 values taken as their
    bits) a list of uint32 arrays. Models shl / shr / and / lop3 (any LUT) / prmt (default mode) / add.s32
    / mov.b32 and the f32 max / add (rn, rm) / sub / fma, all .ftz; fma rounds through float64 (exact
    product, the sum rounded twice: can differ from one rounding in the last bit, rarely)."""
    n_out = sum(c.startswith("=") for c in constraints.split(","))
    scalar = all(isinstance(v, int) for v in inputs)
    regs = {f"${n_out + i}": _as_words(v) for i, v in enumerate(inputs)}

    def word(x: str):
        if x in regs:
            return regs[x]
        if x.startswith("0f"):  # a float32 literal's bits
            return np.asarray(int(x[2:], 16), dtype=_U32)
        return np.asarray(int(x, 0) & _M32, dtype=_U32)

    def f32(x: str):
        return _ftz(word(x).view(_F32))

    def imm(x: str) -> int:
        if not re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", x):
            raise AssertionError(f"{x!r}: an immediate expected")
        return int(x, 0)

    for stmt in text.split(";"):
        stmt = stmt.strip().strip("{}").strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        dst, *src = [a.strip() for a in rest.split(",")]
        if op == "shl.b32":
            s, a = imm(src[1]), word(src[0])
            r = (a.astype(np.uint64) << np.uint64(s) & _M32).astype(_U32) if s < 32 else np.zeros_like(a)
        elif op in ("shr.u32", "shr.b32"):
            s, a = imm(src[1]), word(src[0])
            r = a >> _U32(s) if s < 32 else np.zeros_like(a)
        elif op == "and.b32":
            r = word(src[0]) & word(src[1])
        elif op == "lop3.b32":
            r = _lop3(word(src[0]), word(src[1]), word(src[2]), imm(src[3]))
        elif op == "prmt.b32":
            r = _prmt(*np.broadcast_arrays(word(src[0]), word(src[1])), imm(src[2]))
        elif op == "add.s32":
            r = ((word(src[0]).astype(np.uint64) + word(src[1]).astype(np.uint64)) & _M32).astype(_U32)
        elif op == "mov.b32":
            r = np.array(word(src[0]), copy=True)
        elif op == "max.ftz.f32":
            r = _ftz(np.maximum(f32(src[0]), f32(src[1])))
        elif op in ("add.rm.ftz.f32", "add.rn.ftz.f32", "add.ftz.f32", "sub.ftz.f32"):
            b = f32(src[1]).astype(_F64)
            exact = f32(src[0]).astype(_F64) + (-b if op.startswith("sub") else b)
            r = _ftz(_round_down(exact) if ".rm" in op else exact.astype(_F32))
        elif op == "fma.rn.ftz.f32":
            a, b, c = (f32(s).astype(_F64) for s in src)
            r = _ftz((a * b + c).astype(_F32))
        else:
            raise AssertionError(f"msa_jit/kernels/ptx.py: {op} is not modelled here ({stmt!r}): extend run_ptx")
        r = np.asarray(r)
        regs[dst] = r.view(_U32) if r.dtype == _F32 else r.astype(_U32)
    outs = [regs[f"${i}"] for i in range(n_out)]
    return [int(o) for o in outs] if scalar else outs
