"""The NVFP4 kernel builds, here without a GPU: every MiniMax-M3 geometry x query dtype x occupancy
for sm_90a and sm_100a, with the instructions its data path promises and no spills beyond the
accepted ones (its correctness runs on the H200: tests/test_kernel_gpu.py)."""

from __future__ import annotations

import collections
import tempfile
from pathlib import Path

import pytest

from msa_jit import compiler, sass
from msa_jit.geometry import DEFAULT_ARCHES, MINIMAX_M3_GEOMETRIES, SparseDecodeConfig

pytestmark = pytest.mark.slow


def _ops(text: str) -> collections.Counter:
    base = collections.Counter()
    for op, n in sass.opcode_counts(text).items():
        base[op.split(".")[0]] += n
    return base


@pytest.mark.parametrize("arch", DEFAULT_ARCHES)
def test_every_geometry_compiles_with_nvfp4(arch):
    seen = set()
    for (hq, hkv) in MINIMAX_M3_GEOMETRIES:
        for q_dtype in ("bfloat16", "float8_e4m3fn"):
            base = SparseDecodeConfig(num_q_heads=hq, num_kv_heads=hkv, q_dtype=q_dtype, kv_dtype="nvfp4", arch=arch)
            for cfg in compiler.plannable_configs(base):
                assert compiler.kernel_family(cfg) == "portable"
                with tempfile.TemporaryDirectory() as d:
                    compiler.compile_sparse_decode(cfg, d)
                    (cubin,) = sass.extract_cubins(Path(d) / "sparse_decode.so")
                    funcs = sass.split_functions(sass.disassemble(cubin))
                    main = "".join(v for k, v in funcs.items() if "merge" not in k.lower())
                    res = [r for r in sass.kernel_resources(cubin) if "merge" not in r.name.lower()]
                ops = _ops(main)
                # the e2m1 -> e4m3 -> f16 path: cvt (F2FP), the block scales in f16 (HMUL2), the MMAs,
                # one 18 KiB bulk copy per block; local memory within what the occupancy accepts
                assert ops["HMMA"] == 64 and ops["HMUL2"] == 128 and ops["F2FP"] >= 128, (cfg, ops)
                assert ops["LDL"] + ops["STL"] <= compiler.accepted_local_ops(cfg), (cfg, ops)
                assert res[0].registers <= (128 if cfg.ctas_per_sm == 3 else 255), (cfg, res)
                assert res[0].sm == int(arch[3:-1])
                seen.add((hq, hkv, q_dtype, cfg.ctas_per_sm))
    assert len(seen) == 16


def test_nvfp4_is_part_of_the_cache_key():
    fp8 = SparseDecodeConfig(num_q_heads=8, num_kv_heads=1)
    nvfp4 = SparseDecodeConfig(num_q_heads=8, num_kv_heads=1, kv_dtype="nvfp4")
    assert compiler.cache_key(fp8) != compiler.cache_key(nvfp4)
    with pytest.raises(ValueError, match="kv_dtype"):
        SparseDecodeConfig(num_q_heads=8, num_kv_heads=1, kv_dtype="int4").validate()


def test_the_umma_kernel_never_serves_nvfp4(monkeypatch):
    monkeypatch.setenv("MSA_JIT_ENABLE_SM100_UMMA", "1")
    assert compiler.kernel_family(SparseDecodeConfig(8, 1, arch="sm_100a")) == "sm100"
    assert compiler.kernel_family(SparseDecodeConfig(8, 1, arch="sm_100a", kv_dtype="nvfp4")) == "portable"


def test_e2m1_to_e4m3_bytes_formula():
    """The integer steps of kernels/ptx.py e2m1x8_to_f16x2x4, modelled here bit for bit (shifts,
    masks, lop3 0xEC = (a & c) | b): every code of every nibble position becomes the e4m3 byte
    whose value is the code's times 2**-6 (then cvt.f16x2.e4m3x2 is exact)."""
    import random

    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

    def e4m3(b):
        sign = -1.0 if b & 0x80 else 1.0
        e, m = (b >> 3) & 15, b & 7
        return sign * (2.0**-6 * m / 8 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8))

    def lop3_ec(a, b, c):
        return (a & c) | b

    rng = random.Random(0)
    words = [rng.getrandbits(32) for _ in range(500)] + [0x0, 0xFFFFFFFF, 0x88888888, 0x77777777, 0x76543210]
    for w in words:
        low = lop3_ec((w << 4) & 0xFFFFFFFF, ((w << 2) & 0xFFFFFFFF) & 0x1C1C1C1C, 0x80808080)
        high = lop3_ec(w, (w >> 2) & 0x1C1C1C1C, 0x80808080)
        for i in range(4):
            for word, nib in ((low, 2 * i), (high, 2 * i + 1)):
                code = (w >> (4 * nib)) & 15
                want = (-1.0 if code & 8 else 1.0) * e2m1[code & 7] * 2.0**-6
                assert e4m3((word >> (8 * i)) & 0xFF) == want, (hex(w), nib)
