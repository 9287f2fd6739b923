"""Constructor options of the portable kernel and the bench's probes (bench/variants.py A/Bs them).

Here, without a GPU: bad options fail with a clear error, and the compiled SASS has what
each option promises (registers for 3 CTAs per SM, the PDL instructions, a probe's missing
stage, an unchanged default). Probes and retired options live in bench/kernel_probes.py,
never in the shipped kernel sources.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from msa_jit.jit import sass
from msa_jit.jit.compiler import compile_sparse_decode
from msa_jit.geometry import SparseDecodeConfig

pytestmark = pytest.mark.slow
BENCH = Path(__file__).resolve().parents[1] / "bench"
import msa_jit.kernels

KERNELS_DIR = Path(msa_jit.kernels.__file__).parent


def _kernel_class():
    from msa_jit.kernels.token import SparseDecodeTokenKernel

    return SparseDecodeTokenKernel


def _probe_class():
    sys.path.insert(0, str(BENCH))
    from kernel_probes import ProbeMmaKernel

    return ProbeMmaKernel


def _probe_options():
    """bench/variants.py's names of the options only the probe subclass has (one list for both)."""
    sys.path.insert(0, str(BENCH))
    from variants import PROBE_OPTIONS

    return PROBE_OPTIONS


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"q_frags": "global"}, "q_frags"),
        ({"softmax": "fast"}, "softmax"),
        ({"smem_reads": "lazy"}, "smem_reads"),
        ({"ctas_per_sm": 4}, "ctas_per_sm"),
        ({"consumer_warps": 16, "page_size": 256}, "16-byte output stores"),  # 4 output elements per thread
    ],
)
def test_bad_options_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        _kernel_class()(num_q_heads=64, num_kv_heads=4, **bad)


@pytest.mark.parametrize("bad, match", [({"probe": "no_store"}, "probe"), ({"v_loads": "v2"}, "v_loads"),
                                        ({"release": "fence"}, "release")])
def test_bad_probe_options_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        _probe_class()(num_q_heads=64, num_kv_heads=4, **bad)


@pytest.mark.parametrize("option", ["probe", "pdl", "prefetch_bt", "v_loads", "convert", "out_stores"])
def test_shipped_kernel_has_no_probe_or_retired_option(option):
    with pytest.raises(TypeError, match=option):
        _kernel_class()(num_q_heads=64, num_kv_heads=4, **{option: None})


def test_shipped_kernel_sources_hold_no_probe_code():
    # the probes' instructions and names appear only in bench/kernel_probes.py
    for path in sorted(KERNELS_DIR.glob("*.py")):
        text = path.read_text()
        for word in ("globaltimer", "%smid", "prefetch.global", "no_math", "no_copy", "bittrick", "probe="):
            assert word not in text, f"{path.name} contains {word!r}"
        ast.parse(text)


def _main_kernel(tmp_path, options, hq=64, hkv=4, q_dtype="bfloat16", ctas_per_sm=2, arch="sm_90a",
                 kv_dtype="float8_e4m3fn"):
    """(resources, SASS text) of the decode kernel (not the split merge); options with a probe
    or retired option build bench/kernel_probes.py's subclass."""
    cfg = SparseDecodeConfig(num_q_heads=hq, num_kv_heads=hkv, q_dtype=q_dtype, arch=arch, ctas_per_sm=ctas_per_sm,
                             kv_dtype=kv_dtype)
    tmp_path.mkdir(parents=True, exist_ok=True)
    cls = _probe_class() if options and set(options) & _probe_options() else None
    compile_sparse_decode(cfg, tmp_path, kernel_options=options, kernel_class=cls)
    (cubin,) = sass.extract_cubins(tmp_path / "sparse_decode.so")
    res = [r for r in sass.kernel_resources(cubin) if "merge" not in r.name.lower()]
    funcs = sass.split_functions(sass.disassemble(cubin))
    text = "".join(body for name, body in funcs.items() if "merge" not in name.lower())
    merge = "".join(body for name, body in funcs.items() if "merge" in name.lower())
    return res[0], text, merge


@pytest.mark.parametrize("hq, hkv, q_dtype, arch", [(64, 4, "bfloat16", "sm_90a"), (8, 1, "bfloat16", "sm_90a"),
                                                     (64, 4, "float8_e4m3fn", "sm_90a"), (64, 4, "bfloat16", "sm_100a")])
def test_three_ctas_per_sm_fit_in_128_registers(tmp_path, hq, hkv, q_dtype, arch):
    # the build the planner picks for one-wave grids (SparseDecodeConfig.ctas_per_sm = 3); an fp8
    # query scales S in fp32 there instead of its Q fragments
    res, text, _ = _main_kernel(tmp_path, None, hq, hkv, q_dtype, ctas_per_sm=3, arch=arch)
    assert res.registers <= 128  # 15 warps per SM: 4 per scheduler x 32 lanes x 128 = 16K registers
    ops = sass.opcode_counts(text)
    # one loop-carried row sum spills (1 LDL + 1 STL per block, L1-resident): more would be a regression
    assert ops["LDL"] + ops["STL"] <= 6, ops


def test_pdl_by_default_waits_before_reading(tmp_path):
    _, text, merge = _main_kernel(tmp_path / "pdl", {})
    assert "ACQBULK" in text and "ACQBULK" in merge  # griddepcontrol.wait in both kernels
    # the wait comes before the first global load of the decode kernel
    assert text.index("ACQBULK") < text.index("LDG")
    # the mbarrier inits (no global memory) run before the wait, while the prologue may still run
    assert text.index("SYNCS.EXCH.64") < text.index("ACQBULK")
    assert "PREEXIT" in text  # launch_dependents: the merge may be scheduled early
    # the 2-CTA build's merge lets the next kernel (the next layer's decode) be scheduled once its
    # own wait returned; the 3-CTA build's does not (kv-format-ab-2026-12-04T1519.json)
    assert "PREEXIT" in merge and merge.index("ACQBULK") < merge.index("PREEXIT")
    _, _, merge3 = _main_kernel(tmp_path / "c3", None, ctas_per_sm=3)
    assert "ACQBULK" in merge3 and "PREEXIT" not in merge3
    _, text, merge = _main_kernel(tmp_path / "plain", {"pdl": False})
    assert "ACQBULK" not in text and "ACQBULK" not in merge


def test_probes_leave_their_stage_out(tmp_path):
    _, no_math, _ = _main_kernel(tmp_path / "m", {"probe": "no_math"})
    assert "HMMA" not in no_math
    _, no_copy, _ = _main_kernel(tmp_path / "c", {"probe": "no_copy"})
    assert "UBLKCP" not in no_copy and "HMMA" in no_copy
    _, full, _ = _main_kernel(tmp_path / "f", {})
    assert "UBLKCP" in full
    assert "GLOBALTIMER" not in full and "SMID" not in full
    _, trace, _ = _main_kernel(tmp_path / "t", {"probe": "trace"})
    assert "HMMA" in trace and "UBLKCP" in trace  # the full kernel ...
    # ... plus the timer reads and thread 0's two 16-byte trace stores
    assert trace.count("SR_GLOBALTIMERLO") == 7 and "SR_VIRTUALSMID" in trace
    assert sass.opcode_counts(trace)["STG.E.128"] == sass.opcode_counts(full)["STG.E.128"] + 2


def test_block_table_prefetch_only_when_asked(tmp_path):
    _, text, _ = _main_kernel(tmp_path / "on", {"prefetch_bt": True})
    assert "CCTL.E.PF2" in text  # prefetch.global.L2
    assert text.index("CCTL.E.PF2") > text.index("ACQBULK")  # never before the PDL wait
    _, text, _ = _main_kernel(tmp_path / "off", {})
    assert "CCTL.E.PF2" not in text



def test_output_goes_out_in_16_byte_stores(tmp_path):
    _, v4, _ = _main_kernel(tmp_path / "v4", {})
    ops = sass.opcode_counts(v4)
    # 2 x 8 bf16 (num_splits == 1) or 4 x 4 fp32 (split partial) per thread, no 2-byte stores
    assert ops["STG.E.128"] == 6 and "STG.E.U16" not in ops, ops


def test_conversion_probes_leave_their_part_out(tmp_path):
    # kernel_probes.py convert=...: the NVFP4 loop without its conversion, its cvt or its scale
    f2fp, hmul2 = "F2FP.F16.E4M3.UNPACK_B", "HMUL2"
    n = {c: sass.opcode_counts(_main_kernel(tmp_path / c, {"convert": c}, kv_dtype="nvfp4")[1])
         for c in ("full", "none", "no_cvt", "no_scale")}
    assert max(n["full"][f2fp], n["full"]["PRMT"]) >= 128 and n["full"][hmul2] >= 128  # cvt, or byte permutes
    assert n["none"][f2fp] == 0 and n["none"][hmul2] == 0
    assert n["no_cvt"][f2fp] < 32 and n["no_cvt"][hmul2] == n["full"][hmul2]
    assert n["no_scale"][hmul2] == 0 and max(n["no_scale"][f2fp], n["no_scale"]["PRMT"]) >= 128


def test_v4_v_loads_probe_reads_v_in_16_byte_loads(tmp_path):
    _, rotated, _ = _main_kernel(tmp_path / "rot", {})
    _, v4, _ = _main_kernel(tmp_path / "v4", {"v_loads": "v4"})
    assert sass.opcode_counts(v4)["LDS.128"] > sass.opcode_counts(rotated)["LDS.128"]


@pytest.mark.parametrize("ctas_per_sm, shipped", [(2, {}), (3, {}), (2, {"split_merge": "cluster"})],
                         ids=["2perSM", "3perSM", "2perSM-cluster"])
def test_probe_subclass_without_probes_is_the_shipped_kernel(tmp_path, ctas_per_sm, shipped):
    # ProbeMmaKernel mirrors the shipped kernel body: with every probe off its SASS must be the
    # shipped kernel's, else the mirror has drifted and its timings describe another kernel
    def body(options):
        _, text, merge = _main_kernel(tmp_path / str(len(list(tmp_path.iterdir()))), options, ctas_per_sm=ctas_per_sm)
        return re.sub(r"kernel_cutlass_\w+", "K", text + merge)

    assert body({"probe": "full", **shipped}) == body(shipped)


def test_trace_probe_of_the_cluster_merge(tmp_path):
    # the cluster build's timeline (bench/trace_ctas.py --variants trace_cm): the stamps of both of
    # its launch sites, and its pushes and cluster barrier
    _, trace, _ = _main_kernel(tmp_path, {"probe": "trace", "split_merge": "cluster"})
    assert trace.count("SR_GLOBALTIMERLO") == 14 and "STAS" in trace and "UCGABAR_WAIT" in trace


def test_every_consumer_lane_releases_a_stage(tmp_path):
    # racecheck sees a stage's refill ordered after a consumer lane's reads only when that lane
    # arrives itself (bench/results/race-ab-2026-12-04.log, race-2026-12-04-s10.log): the shipped
    # kernel counts every consumer thread, the probe of before session 10 one lane per warp
    from msa_jit.kernels.token import SparseDecodeTokenKernel

    shipped = SparseDecodeTokenKernel(num_q_heads=64, num_kv_heads=4)
    warp = _probe_class()(num_q_heads=64, num_kv_heads=4, release="warp")
    assert (shipped.empty_arrivals, warp.empty_arrivals) == (shipped.consumer_threads, warp.warps)
    _, text, _ = _main_kernel(tmp_path / "warp", {"release": "warp"})
    _, base, _ = _main_kernel(tmp_path / "lanes", {})
    assert sass.opcode_counts(text) != sass.opcode_counts(base)


@pytest.mark.parametrize("options", [{"trace": True}, {"mma": False}, {"convert": False}])
def test_union_fp8_probe_leaves_its_part_out(tmp_path, options):
    # bench/union_fp8.py: the shipped union kernel (tests/test_union_kernel_compile.py) with the bench's
    # probe options through its hooks: trace stamps %globaltimer, mma=False drops every MMA,
    # convert=False V's conversion (F2FP), the rest as shipped
    sys.path.insert(0, str(BENCH))
    from union_fp8 import UnionFp8Kernel

    cfg = SparseDecodeConfig(num_q_heads=64, num_kv_heads=4, q_dtype="float8_e4m3fn", arch="sm_90a")

    def decode_sass(opts, where):
        where.mkdir()
        compile_sparse_decode(cfg, where, kernel_options={"union_fp8": True, **opts}, kernel_class=UnionFp8Kernel)
        (cubin,) = sass.extract_cubins(where / "sparse_decode.so")
        return "\n".join(body for name, body in sass.split_functions(sass.disassemble(cubin)).items()
                         if "merge" not in name.lower())

    def f2fp(counts):
        return sum(n for op, n in counts.items() if op.startswith("F2FP"))

    text = decode_sass(options, tmp_path / "probe")
    counts = sass.opcode_counts(text)
    assert ("GLOBALTIMER" in text) == bool(options.get("trace"))
    # S and V's conversion are inlined twice per MMA warpgroup (the first block's before the loop)
    assert (counts["QGMMA.64"], counts["HGMMA.64"]) == ((0, 0) if options.get("mma") is False else (16, 16))
    if options.get("convert") is False:  # V's 64 F2FP, twice in each of the 2 MMA warpgroups, gone; P's stay
        assert f2fp(sass.opcode_counts(decode_sass({}, tmp_path / "shipped"))) - f2fp(counts) == 2 * 2 * 64
    assert "LDL" not in text and "STL" not in text


def test_union_ex2_poly_probe_moves_p_exps_to_the_fma_pipe(tmp_path):
    # row 85's candidate (bench/union_fp8.py ex2_poly=n): n of every 16 P elements' 2**x by the polynomial,
    # in the bf16 2-CTA build the planner uses. Its PTX, interpreted on the CPU as written (tests/ptx_model.py),
    # is within 1e-4 of 2**x, exact at integers, and gives +0 where ex2.approx.ftz does (-inf: the masked keys);
    # a wrong shift or a coefficient out of place fails that
    sys.path.insert(0, str(BENCH))
    import numpy as np
    from ptx_model import run_ptx
    from union_fp8 import EX2_POLY3_PTX, UnionFp8Kernel

    def run(text, x):
        (out,) = run_ptx(text, "=f,f", np.asarray(x, dtype=np.float32))
        return out.view(np.float32)

    def worst(text):
        x = np.linspace(-125.0, 8.0, 100_003, dtype=np.float32)
        return np.max(np.abs(run(text, x) / np.exp2(x.astype(np.float64)) - 1.0))

    assert worst(EX2_POLY3_PTX) < 1e-4
    ints = np.arange(-126, 9, dtype=np.float32)
    assert np.array_equal(run(EX2_POLY3_PTX, ints), np.exp2(ints.astype(np.float64)))
    zeros = run(EX2_POLY3_PTX, [-np.inf, -1e30, -200.0, -127.0])
    assert np.array_equal(zeros, np.zeros(4)) and not np.signbit(zeros).any()
    (c3_c2,) = [line for line in EX2_POLY3_PTX.split("\n") if line.startswith("fma.rn.ftz.f32 p, fr, ")]
    c_first, c_second = c3_c2.rstrip(";").split(", ")[2:]
    mutants = [EX2_POLY3_PTX.replace("shl.b32 e, e, 23", "shl.b32 e, e, 22"),
               EX2_POLY3_PTX.replace(c_first, "@").replace(c_second, c_first).replace("@", c_second),
               EX2_POLY3_PTX.replace("add.rm.ftz", "add.rn.ftz")]
    assert all(m != EX2_POLY3_PTX and worst(m) > 1e-3 for m in mutants)

    cfg = SparseDecodeConfig(num_q_heads=64, num_kv_heads=4, q_dtype="bfloat16", arch="sm_90a")

    def counts(opts, where):
        where.mkdir()
        compile_sparse_decode(cfg, where, kernel_options={"union_fp8": True, "warpgroups": 1, "q_lo_regs": True,
                                                          "v_converter": True, **opts}, kernel_class=UnionFp8Kernel)
        (cubin,) = sass.extract_cubins(where / "sparse_decode.so")
        text = "\n".join(body for name, body in sass.split_functions(sass.disassemble(cubin)).items()
                         if "merge" not in name.lower())
        assert "LDL" not in text and "STL" not in text
        return sass.opcode_counts(text)

    base, poly = counts({}, tmp_path / "shipped"), counts({"ex2_poly": 4}, tmp_path / "poly")
    # the softmax is inlined once: 64 P elements per thread, 16 of them by the polynomial (one round-down add each)
    assert base["MUFU.EX2"] - poly["MUFU.EX2"] == 16 and poly["FADD.FTZ.RM"] - base["FADD.FTZ.RM"] == 16


@pytest.mark.parametrize("pad_rows, copies", [(0, 1), (4, 32), (32, 4)], ids=["as-it-lies", "4-rows", "shipped"])
def test_dims_split_layouts_copy_and_load_as_described(tmp_path, pad_rows, copies):
    # bench/dims_split.py's stage layouts of the dims-split kernel (row 89; 32 is the shipped one): the
    # copies per block, one 32-bit shared load per V row and n-tile column (8 k-steps x 4 rows), no spill
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from dims_split import DimsLayoutKernel

    cfg = SparseDecodeConfig(num_q_heads=64, num_kv_heads=4, arch="sm_90a")
    compile_sparse_decode(cfg, tmp_path, kernel_class=DimsLayoutKernel,
                          kernel_options={"split_merge": "cluster", "pv_split": "dims", "pad_rows": pad_rows})
    (cubin,) = sass.extract_cubins(tmp_path / "sparse_decode.so")
    funcs = sass.split_functions(sass.disassemble(cubin))
    decode = [body for name, body in funcs.items() if "merge" not in name.lower()]
    assert len(decode) == 2  # the cluster launch and the plain one
    for body in decode:
        ops = sass.opcode_counts(body)
        assert ops["LDL"] + ops["STL"] == 0 and ops["LDS"] >= 32, ops
        # the producer's loop over blocks is unrolled a few times (under 8): a multiple of the copies per block
        assert ops["UBLKCP.S.G"] % copies == 0 and copies <= ops["UBLKCP.S.G"] < 8 * copies, ops
    assert max(r.registers for r in sass.kernel_resources(cubin)) <= 168  # 2 CTAs x 160 threads
