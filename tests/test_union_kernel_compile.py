"""The shipped sm_90a union kernel (msa_jit/kernels/union.py) on the CPU: its builds compile
through the union family (SparseDecodeConfig.kernel "union") to one decode kernel plus the shipped
split merge, with fp8 and f16 warpgroup MMAs, TMA copies and no local memory; the constructor's
constraints raise, and every geometry `geometry.union_problems` accepts fits."""

from __future__ import annotations

import re

import pytest

from helpers import compile_without_warnings

from msa_jit.jit import sass
from msa_jit.jit.registry import kernel_family
from msa_jit.geometry import SparseDecodeConfig


def _cls():
    from msa_jit.kernels.union import SparseDecodeUnionKernel

    return SparseDecodeUnionKernel


# both query dtypes at both occupancies, over G 16 and 8 and a 3-D TMA view (Hkv 1): the default run
# compiles each query dtype x occupancy once, over all three head layouts; the other four are the `sweep`
@pytest.mark.slow  # compiles 4 kernels (8 with the sweep)
@pytest.mark.parametrize("heads,q_dtype,ctas", [
    ((64, 4), "bfloat16", 1), ((8, 1), "float8_e4m3fn", 1), ((64, 4), "bfloat16", 2), ((16, 1), "float8_e4m3fn", 2),
    *[pytest.param(*p, marks=pytest.mark.sweep) for p in (
        ((64, 4), "float8_e4m3fn", 1), ((8, 1), "bfloat16", 2), ((8, 1), "float8_e4m3fn", 2), ((16, 1), "bfloat16", 1))]])
def test_union_build_compiles_to_fp8_warpgroup_mmas(tmp_path, heads, q_dtype, ctas):
    cfg = SparseDecodeConfig(num_q_heads=heads[0], num_kv_heads=heads[1], q_dtype=q_dtype, arch="sm_90a",
                             kernel="union", ctas_per_sm=ctas)
    assert kernel_family(cfg) == "union"
    compile_without_warnings(cfg, tmp_path)
    (cubin,) = sass.extract_cubins(tmp_path / "sparse_decode.so")
    names = sorted(r.name for r in sass.kernel_resources(cubin))
    assert len(names) == 2 and sum("merge" in n.lower() for n in names) == 1  # with splits: the shipped merge
    text = "\n".join(body for name, body in sass.split_functions(sass.disassemble(cubin)).items()
                     if "merge" not in name.lower())
    counts = sass.opcode_counts(text)
    chains = 2 if q_dtype == "bfloat16" else 1
    wgs = 2 if ctas == 1 else 1
    # S's chains twice per MMA warpgroup (block wg's before the loop, the next block's in it), P V once
    assert counts["QGMMA.64"] == 2 * 4 * chains * wgs and counts["HGMMA.64"] == 8 * wgs
    # P V runs under the next S: S's wait lets one group (P V) be outstanding, and ptxas did not serialize
    # the wgmmas (C7514 would put a wait after each of the 8 HGMMAs)
    assert text.count("WARPGROUP.DEPBAR.LE gsb0, 0x1") == 2 * wgs
    assert text.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") <= 3 * wgs
    if ctas == 2:
        _assert_v_converter(text, q_dtype)
    else:
        assert "USETMAXREG" not in text
    assert sum(n for op, n in counts.items() if op.startswith("UTMALDG")) >= 2
    # a TMA cute.copy elects its lane with a full-warp elect.sync (NVIDIA/cutlass#2365): no divergent paths
    assert "BRA.DIV" not in text and "WARPSYNC" not in text
    assert "LDL" not in text and "STL" not in text
    cls = _cls()
    kernel = cls(num_q_heads=heads[0], num_kv_heads=heads[1], q_dtype=q_dtype,
                 **cls.occupancy_options(ctas, q_dtype))
    assert (kernel.ctas_per_sm, kernel.tile_tokens, kernel.threads) == (ctas, 64 // (heads[0] // heads[1]), 256)
    assert kernel.empty_arrivals == 128 * (1 if ctas == 1 else 2)  # 2 CTAs per SM: the converter reads V
    assert kernel.storage_type().size_in_bytes() + 1024 <= 228 * 1024 // ctas  # 1 KiB reserved per CTA


def _assert_v_converter(text: str, q_dtype: str) -> None:
    """The 2-CTA builds: V converted by a second warpgroup. The MMA warpgroup takes the registers
    the converter gives back (setmaxnreg; the two sum to 256 per thread: 2 CTAs x 256 threads share 64 Ki),
    issues S's chains as one group (a bf16 query's lo chain, A from registers, right behind the hi chain:
    nothing to hide it behind), and neither loads nor stores V; the converter does V's 8 shared loads and
    f16 stores and no MMA."""
    ops = [line.split(";")[0].split("*/")[-1].strip() for line in text.splitlines() if "*/" in line]
    regs = (208, 48) if q_dtype == "bfloat16" else (192, 64)
    alloc = [i for i, op in enumerate(ops) if op.startswith("USETMAXREG.TRY_ALLOC.CTAPOOL")]
    dealloc = [i for i, op in enumerate(ops) if op.startswith("USETMAXREG.DEALLOC.CTAPOOL")]
    assert len(alloc) == 1 and ops[alloc[0]].endswith(hex(regs[0])), ops[alloc[0]]
    assert len(dealloc) == 1 and ops[dealloc[0]].endswith(hex(regs[1])), ops[dealloc[0]]
    mma, conv = ops[alloc[0]:dealloc[0]], ops[dealloc[0]:]
    chains = 2 if q_dtype == "bfloat16" else 1
    qgmma = [i for i, op in enumerate(mma) if op.startswith("QGMMA")]
    assert len(qgmma) == 2 * 4 * chains and sum(op.startswith("HGMMA") for op in mma) == 8
    for group in (qgmma[:4 * chains], qgmma[4 * chains:]):  # one commit group each: only its last QGMMA ends it
        assert [mma[i].endswith("gsb0") for i in group] == [False] * (4 * chains - 1) + [True]
        assert not any(op.startswith("WARPGROUP.DEPBAR") for op in mma[group[0]:group[-1]])
    if chains == 2:  # the lo chain: A from registers, accumulating into S's registers
        assert all(re.match(r"QGMMA\S* (R\d+), R\d+, gdesc\[[^]]+\], \1\b", mma[i]) for i in qgmma[4:8])
    assert not any(op.startswith(("LDS.128", "STS.128")) for op in mma)
    assert sum(op.startswith("LDS.128") for op in conv) == 8 and sum(op.startswith("STS.128") for op in conv) >= 8
    assert not any(op.startswith(("QGMMA", "HGMMA")) for op in conv)


def test_union_constraints_raise():
    cls = _cls()
    assert cls.occupancy_options(1, "bfloat16") == {}
    assert cls.occupancy_options(2, "float8_e4m3fn") == {"warpgroups": 1, "v_converter": True}
    assert cls.occupancy_options(2, "bfloat16") == {"warpgroups": 1, "v_converter": True, "q_lo_regs": True}
    with pytest.raises(ValueError, match="CTAs per SM"):
        cls.occupancy_options(3, "bfloat16")
    assert cls.arch_options("sm_90a", "float8_e4m3fn") == {}
    with pytest.raises(ValueError, match="sm_90a"):
        cls.arch_options("sm_100a", "float8_e4m3fn")
    for options, match in (({"kv_dtype": "nvfp4"}, "fp8 cache"), ({"warpgroups": 1}, "fp8 query"),
                           ({"stages": 3}, "even stage count"),
                           ({"q_lo_regs": True, "q_dtype": "float8_e4m3fn"}, "bf16 query"),
                           ({"q_lo_regs": True}, "needs v_converter"), ({"v_converter": True}, "v_converter needs"),
                           # the lo chain behind V's loads without the converter: retired, slower
                           ({"q_lo_regs": True, "warpgroups": 1}, "q_lo_regs needs v_converter"),
                           ({"page_size": 64}, "page_size"), ({"warpgroups": 3}, "warpgroups")):
        with pytest.raises(ValueError, match=match):
            cls(num_q_heads=64, num_kv_heads=4, **options)
    with pytest.raises(ValueError, match="divide 64"):
        cls(num_q_heads=48, num_kv_heads=16)  # G = 3
    with pytest.raises(ValueError, match="divide 64"):
        cls(num_q_heads=8, num_kv_heads=8)  # G = 1: 64 tokens per tile, a 32-bit token mask
    with pytest.raises(ValueError, match="shared memory"):
        cls(num_q_heads=8, num_kv_heads=4, topk=32)  # G = 2: 32 tokens x 32 slots of union lists


def test_every_geometry_the_planner_may_give_the_union_kernel_fits():
    """geometry.union_problems (what the planner and check_config use, without the DSL) accepts only
    geometries whose every union build the constructor takes, and G 4 shows why it stops there."""
    from msa_jit.geometry import MAX_GROUP_SIZE, MAX_TOPK, UNION_CTAS_PER_SM, union_problems

    cls = _cls()
    for g in range(1, MAX_GROUP_SIZE + 1):
        accepted = not union_problems(num_q_heads=4 * g, num_kv_heads=4, page_size=128,
                                      kv_dtype="float8_e4m3fn", arch="sm_90a")
        for topk in (1, 16, MAX_TOPK):
            for q_dtype in ("bfloat16", "float8_e4m3fn"):
                for ctas in UNION_CTAS_PER_SM:
                    try:
                        cls(num_q_heads=4 * g, num_kv_heads=4, topk=topk, q_dtype=q_dtype,
                            **cls.occupancy_options(ctas, q_dtype))
                        fits = True
                    except ValueError:
                        fits = False
                    assert fits or not accepted, (g, topk, q_dtype, ctas)
        assert accepted == (g in (8, 16)), g
    with pytest.raises(ValueError, match="shared memory"):  # G 4: an fp8 query at 2 CTAs per SM, topk 32
        cls(num_q_heads=16, num_kv_heads=4, topk=32, q_dtype="float8_e4m3fn", **cls.occupancy_options(2, "float8_e4m3fn"))
