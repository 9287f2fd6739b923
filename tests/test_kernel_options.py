"""Constructor options of the token kernel, and what its builds promise in SASS, without a GPU.

Bad options fail with a clear error naming the option; the compiled SASS has what each build
promises (registers for 3 CTAs per SM, the PDL instructions in their order, 16-byte output
stores, the dims-split cluster build's copies and loads); the shipped sources hold no
instrumentation.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import msa_jit.kernels
from msa_jit.geometry import SparseDecodeConfig
from msa_jit.jit import sass
from msa_jit.jit.compiler import compile_sparse_decode
from msa_jit.kernels.token import SparseDecodeTokenKernel

pytestmark = pytest.mark.slow
KERNELS_DIR = Path(msa_jit.kernels.__file__).parent


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
        SparseDecodeTokenKernel(num_q_heads=64, num_kv_heads=4, **bad)


@pytest.mark.parametrize("option", ["probe", "pdl", "prefetch_bt", "v_loads", "convert", "out_stores"])
def test_shipped_kernel_has_no_probe_or_retired_option(option):
    with pytest.raises(TypeError, match=option):
        SparseDecodeTokenKernel(num_q_heads=64, num_kv_heads=4, **{option: None})


def test_shipped_kernel_sources_hold_no_probe_code():
    """Timers, SM ids, prefetches and probe switches are instrumentation: none ships."""
    for path in sorted(KERNELS_DIR.glob("*.py")):
        text = path.read_text()
        for word in ("globaltimer", "%smid", "prefetch.global", "no_math", "no_copy", "bittrick", "probe="):
            assert word not in text, f"{path.name} contains {word!r}"
        ast.parse(text)


def _decode_and_merge(tmp_path, hq=64, hkv=4, q_dtype="bfloat16", ctas_per_sm=2, arch="sm_90a",
                      kv_dtype="float8_e4m3fn", split_merge="kernel"):
    """(resources of the decode kernel, its SASS text, the split merge's SASS text) of a shipped build."""
    cfg = SparseDecodeConfig(num_q_heads=hq, num_kv_heads=hkv, q_dtype=q_dtype, arch=arch, ctas_per_sm=ctas_per_sm,
                             kv_dtype=kv_dtype, split_merge=split_merge)
    tmp_path.mkdir(parents=True, exist_ok=True)
    compile_sparse_decode(cfg, tmp_path)
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
    res, text, _ = _decode_and_merge(tmp_path, hq, hkv, q_dtype, ctas_per_sm=3, arch=arch)
    assert res.registers <= 128  # 15 warps per SM: 4 per scheduler x 32 lanes x 128 = 16K registers
    ops = sass.opcode_counts(text)
    # one loop-carried row sum spills (1 LDL + 1 STL per block, L1-resident): more would be a regression
    assert ops["LDL"] + ops["STL"] <= 6, ops


def test_pdl_waits_before_reading_and_lets_the_next_kernel_start(tmp_path):
    _, text, merge = _decode_and_merge(tmp_path / "c2")
    assert "ACQBULK" in text and "ACQBULK" in merge  # griddepcontrol.wait in both kernels
    # the wait comes before the first global load of the decode kernel
    assert text.index("ACQBULK") < text.index("LDG")
    # the mbarrier inits (no global memory) run before the wait, while the prologue may still run
    assert text.index("SYNCS.EXCH.64") < text.index("ACQBULK")
    assert "PREEXIT" in text  # launch_dependents: the merge may be scheduled early
    # the 2-CTA build's merge lets the next kernel (the next layer's decode) be scheduled once its own
    # wait returned; the 3-CTA build's does not
    assert "PREEXIT" in merge and merge.index("ACQBULK") < merge.index("PREEXIT")
    _, _, merge3 = _decode_and_merge(tmp_path / "c3", ctas_per_sm=3)
    assert "ACQBULK" in merge3 and "PREEXIT" not in merge3


def test_output_goes_out_in_16_byte_stores(tmp_path):
    _, text, _ = _decode_and_merge(tmp_path)
    ops = sass.opcode_counts(text)
    # 2 x 8 bf16 (num_splits == 1) or 4 x 4 fp32 (split partial) per thread, no 2-byte stores
    assert ops["STG.E.128"] == 6 and "STG.E.U16" not in ops, ops


def test_every_consumer_thread_releases_a_stage():
    # racecheck orders a stage's refill after a consumer's reads only when every reading thread arrives
    # on the stage's empty barrier itself (one lane per warp was reported as a hazard)
    kernel = SparseDecodeTokenKernel(num_q_heads=64, num_kv_heads=4)
    assert kernel.empty_arrivals == kernel.consumer_threads


def test_dims_split_cluster_build_copies_and_loads_as_described(tmp_path):
    # the fp8 cluster build (P V split by head dims): a block's stage is 4 bulk copies of 32 rows, one
    # 32-bit shared load per V row and n-tile column (8 k-steps x 4 rows), no spill
    copies = 4
    cfg = SparseDecodeConfig(num_q_heads=64, num_kv_heads=4, arch="sm_90a", split_merge="cluster")
    compile_sparse_decode(cfg, tmp_path)
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
