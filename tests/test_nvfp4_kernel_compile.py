"""The NVFP4 kernel builds, here without a GPU: every MiniMax-M3 geometry x query dtype x occupancy
for sm_90a and sm_100a (four by default, all with `-m sweep`), with the instructions its data path
promises, no spills beyond the accepted ones and no warning from msa_jit while compiling (its
correctness runs on the H200: tests/test_kernel_gpu.py)."""

from __future__ import annotations

import collections
import tempfile
from pathlib import Path

import pytest

from msa_jit.jit import compiler, registry, sass
from msa_jit.geometry import DEFAULT_ARCHES, MINIMAX_M3_GEOMETRIES, SparseDecodeConfig

from helpers import compile_without_warnings
from ptx_model import ptx_of, run_ptx

pytestmark = pytest.mark.slow


def _ops(text: str) -> collections.Counter:
    base = collections.Counter()
    for op, n in sass.opcode_counts(text).items():
        base[op.split(".")[0]] += n
    return base


def _nvfp4_builds(arch: str) -> list[SparseDecodeConfig]:
    """Every build the planner may pick for an NVFP4 cache on `arch`: each MiniMax-M3 geometry x
    query dtype x occupancy (and sm_90a's cluster-merge build of each)."""
    return [cfg for (hq, hkv) in MINIMAX_M3_GEOMETRIES for q_dtype in ("bfloat16", "float8_e4m3fn")
            for cfg in registry.plannable_configs(SparseDecodeConfig(
                num_q_heads=hq, num_kv_heads=hkv, q_dtype=q_dtype, kv_dtype="nvfp4", arch=arch))]


# The default run compiles four: sm_90a's 3-per-SM build (128 registers) and cluster-merge build (two
# decode kernels), sm_100a's 3-per-SM bf16-query build (its accepted local memory) and a 2-per-SM
# fp8-query one: both arches' conversions, both occupancies, both query dtypes. The rest is the `sweep`.
_DEFAULT_NVFP4_BUILDS = {("sm_90a", 64, 4, "bfloat16", 3, "kernel"), ("sm_90a", 64, 4, "bfloat16", 2, "cluster"),
                         ("sm_100a", 64, 4, "bfloat16", 3, "kernel"), ("sm_100a", 16, 1, "float8_e4m3fn", 2, "kernel")}


def _nvfp4_param(cfg: SparseDecodeConfig):
    key = (cfg.arch, cfg.num_q_heads, cfg.num_kv_heads, cfg.q_dtype, cfg.ctas_per_sm, cfg.split_merge)
    name = (f"{cfg.arch}-{cfg.num_q_heads}/{cfg.num_kv_heads}-{cfg.q_dtype}-{cfg.ctas_per_sm}perSM"
            + ("-cluster" if cfg.split_merge == "cluster" else ""))
    return pytest.param(cfg, id=name, marks=() if key in _DEFAULT_NVFP4_BUILDS else pytest.mark.sweep)


@pytest.mark.parametrize("arch", DEFAULT_ARCHES)
def test_every_geometry_has_nvfp4_builds(arch):
    """4 geometries x 2 query dtypes x 2 occupancies, and sm_90a's cluster-merge build of each, all of
    the token kernel (each compiled by test_nvfp4_build_compiles_to_its_data_path)."""
    builds = _nvfp4_builds(arch)
    seen = {(c.num_q_heads, c.num_kv_heads, c.q_dtype, c.ctas_per_sm, c.split_merge) for c in builds}
    assert len(seen) == len(builds) == (24 if arch == "sm_90a" else 16)
    assert {(c.num_q_heads, c.num_kv_heads) for c in builds} == set(MINIMAX_M3_GEOMETRIES)
    assert all(registry.kernel_family(c) == "token" for c in builds)
    keys = {(c.arch, c.num_q_heads, c.num_kv_heads, c.q_dtype, c.ctas_per_sm, c.split_merge) for c in builds}
    assert {k for k in _DEFAULT_NVFP4_BUILDS if k[0] == arch} <= keys  # the default run's builds are plannable


@pytest.mark.parametrize("cfg", [_nvfp4_param(c) for arch in DEFAULT_ARCHES for c in _nvfp4_builds(arch)])
def test_nvfp4_build_compiles_to_its_data_path(cfg):
    arch = cfg.arch
    with tempfile.TemporaryDirectory() as d:
        compile_without_warnings(cfg, d)
        (cubin,) = sass.extract_cubins(Path(d) / "sparse_decode.so")
        funcs = sass.split_functions(sass.disassemble(cubin))
        decode = [v for k, v in funcs.items() if "merge" not in k.lower()]
        res = [r for r in sass.kernel_resources(cubin) if "merge" not in r.name.lower()]
    # the counts per decode kernel (a cluster-merge build has two: launched with and without its cluster)
    assert len(decode) == (2 if cfg.split_merge == "cluster" else 1), (cfg, list(funcs))
    for main in decode:
        _check_decode_sass(cfg, arch, main)
    assert all(r.registers <= (128 if cfg.ctas_per_sm == 3 else 255) for r in res), (cfg, res)
    assert all(r.sm == int(arch[3:-1]) for r in res)


def _check_decode_sass(cfg: SparseDecodeConfig, arch: str, main: str) -> None:
    """One decode kernel's SASS: the codes -> f16 (sm_90a: byte permutes, PRMT; sm_100a: cvt, F2FP),
    the block scales in f16 (HMUL2), the MMAs; local memory within what the occupancy accepts."""
    ops = _ops(main)
    conv = ops["F2FP"] if arch == "sm_100a" else ops["PRMT"]
    assert ops["HMMA"] == 64 and ops["HMUL2"] == 128 and conv >= 128, (cfg, ops)
    # sm_100a converts the e2m1 codes in hardware (K and V: 64 + 64 per warp and block, each V code pair
    # converted once for its two n-tile groups); sm_90a places bits (PRMT)
    e2m1 = sass.opcode_counts(main).get("F2FP.F16.E2M1.UNPACK_B", 0)
    assert e2m1 == (128 if arch == "sm_100a" else 0), (cfg, e2m1)
    assert ops["LDL"] + ops["STL"] <= registry.accepted_local_ops(cfg), (cfg, ops)


def test_nvfp4_is_part_of_the_cache_key():
    fp8 = SparseDecodeConfig(num_q_heads=8, num_kv_heads=1)
    nvfp4 = SparseDecodeConfig(num_q_heads=8, num_kv_heads=1, kv_dtype="nvfp4")
    assert compiler.cache_key(fp8) != compiler.cache_key(nvfp4)
    with pytest.raises(ValueError, match="kv_dtype"):
        SparseDecodeConfig(num_q_heads=8, num_kv_heads=1, kv_dtype="int4").validate()


def test_run_ptx_models_the_instructions():
    """The interpreter itself (tests/ptx_model.py), on cases worked by hand from the PTX ISA's definitions."""
    assert run_ptx("shl.b32 $0, $1, 4;", "=r,r", 0xF000000F) == [0xF0]
    assert run_ptx("shr.u32 $0, $1, 3;", "=r,r", 0x80000000) == [0x10000000]
    assert run_ptx("lop3.b32 $0, $1, $2, $3, 0xEC;", "=r,r,r,r", 0b1100, 0b0011, 0b1010) == [0b1011]  # (a & c) | b
    assert run_ptx("lop3.b32 $0, $1, $2, $3, 0xE4;", "=r,r,r,r", 0xAB, 0xCD, 0x0F) == [0xCB]  # (a & c) | (b & ~c)
    assert run_ptx("prmt.b32 $0, $1, $2, 0x1404;", "=r,r,r", 0x44332211, 0x88776655) == [0x22551155]
    assert run_ptx("prmt.b32 $0, $1, 0, 0x3210;", "=r,r", 0x44332211) == [0x44332211]
    assert run_ptx("{\n\t.reg .b32 t;\n\tand.b32 t, $2, 0xFF;\n\tshl.b32 $0, t, 8;\n\tshr.u32 $1, $2, 24;\n\t}",
                   "=r,=r,r", 0xAABBCCDD) == [0xDD00, 0xAA]


def test_e2m1_to_f16_bytes_formula():
    """msa_jit/kernels/ptx.py e2m1x8_to_f16x2x4's PTX, run as written (read from the file, interpreted
    by run_ptx): every code of every nibble position lands in the f16x2 half the docstring names,
    with the value code * 2**-14 exactly."""
    import random
    import struct

    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

    def f16(h):
        return struct.unpack("<e", struct.pack("<H", h))[0]

    text, constraints = ptx_of("e2m1x8_to_f16x2x4")
    rng = random.Random(0)
    words = [rng.getrandbits(32) for _ in range(500)] + [0x0, 0xFFFFFFFF, 0x88888888, 0x77777777, 0x76543210]
    for w in words:
        out = run_ptx(text, constraints, w)
        assert len(out) == 4
        pairs = [(0, 2), (4, 6), (1, 3), (5, 7)]  # (low half, high half) codes of each f16x2
        for word, (lo, hi) in zip(out, pairs):
            for half, nib in ((word & 0xFFFF, lo), (word >> 16, hi)):
                code = (w >> (4 * nib)) & 15
                want = (-1.0 if code & 8 else 1.0) * e2m1[code & 7] * 2.0**-14
                assert f16(half) == want, (hex(w), nib)


def test_hardware_e2m1_conversion_is_chosen_by_arch():
    from msa_jit.kernels.token import NVFP4_FOLD, SparseDecodeTokenKernel as K

    assert K.arch_options("sm_100a", "nvfp4") == {"e2m1_cvt": True}
    assert K.arch_options("sm_90a", "nvfp4") == {} and K.arch_options("sm_100a", "float8_e4m3fn") == {}
    for arch, fold, strided in (("sm_90a", NVFP4_FOLD, True), ("sm_100a", 1.0, False)):
        k = compiler.make_kernel(SparseDecodeConfig(64, 4, kv_dtype="nvfp4", arch=arch))
        # the bit trick leaves values * 2**-14 and pairs a word's codes (d, d+2); the cvt neither
        assert (k.kv_fold, k.q_pairs_strided) == (fold, strided)
    with pytest.raises(ValueError, match="e2m1_cvt"):
        K(num_q_heads=64, num_kv_heads=4, e2m1_cvt=True)


def test_e2m1_nibble_pairs_formula():
    """msa_jit/kernels/ptx.py e2m1_nibble_pairs's PTX, run as written (run_ptx), then `cvt.rn.f16x2.e2m1x2`
    per byte (low nibble -> low half): byte i of `even` pairs code 2i of the two rows, of `odd`
    code 2i + 1; nvfp4_v_frags' picks at = [2h, 4 + 2h, 2h + 1, 5 + 2h] of
    the 8 converted bytes (even's, then odd's) are the group's dims 4h .. 4h + 3 in order."""
    import random

    text, constraints = ptx_of("e2m1_nibble_pairs")
    rng = random.Random(1)
    words = [(rng.getrandbits(32), rng.getrandbits(32)) for _ in range(500)] + [(0x76543210, 0xFEDCBA98)]
    for a, b in words:
        even, odd = run_ptx(text, constraints, a, b)
        converted = [((x >> (8 * i)) & 15, (x >> (8 * i + 4)) & 15) for x in (even, odd) for i in range(4)]
        dims = [2 * i for i in range(4)] + [2 * i + 1 for i in range(4)]  # element of each converted byte
        for k, (lo, hi) in enumerate(converted):
            assert (lo, hi) == ((a >> (4 * dims[k])) & 15, (b >> (4 * dims[k])) & 15), (hex(a), hex(b), k)
        for h in (0, 1):
            at = [2 * h, 4 + 2 * h, 2 * h + 1, 5 + 2 * h]
            assert [dims[i] for i in at] == [4 * h + j for j in range(4)]
