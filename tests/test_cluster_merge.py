"""The split merge inside the decode launch (msa_jit/kernels/cluster_merge.py, `split_merge="cluster"`).

Here, without a GPU: every partial row of every split lands in exactly one receive slot of the
CTA that merges it, that CTA expects exactly the bytes its peers push, every split factor the
planner gives a 2-CTA grid merges in a cluster, and the compiled SASS pushes with st.async, waits
on a cluster barrier and an mbarrier, and has no memory fence, no local memory and an unchanged
default build. On the GPU: tests/test_cluster_merge_gpu.py.
"""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import compile_without_warnings

from msa_jit.jit import sass
from msa_jit.geometry import SparseDecodeConfig
from msa_jit.planner import DEFAULT_NUM_SMS, choose_ctas_per_sm, choose_num_splits


def _merge(group):
    from msa_jit.kernels.cluster_merge import ClusterMerge

    return ClusterMerge(group_size=group, max_splits=32, threads=128)


@pytest.mark.parametrize("group", range(1, 17))
def test_every_partial_row_has_one_slot_at_its_merging_rank(group):
    m = _merge(group)
    from msa_jit.kernels.cluster_merge import PART_BYTES, RECV_SLOTS

    for splits in range(2, 33):
        if not m.fits(splits):
            assert -(-group // splits) * splits > RECV_SLOTS or splits > RECV_SLOTS
            continue
        assert splits <= 16  # a cluster holds at most 16 CTAs
        taken: dict[int, set[int]] = {r: set() for r in range(splits)}
        pushed = dict.fromkeys(range(splits), 0)  # bytes by st.async (peers only)
        for row in range(group):
            for split in range(splits):
                rank, slot = m.route(row, split, splits)
                assert rank == row % splits and 0 <= slot < RECV_SLOTS and slot not in taken[rank]
                taken[rank].add(slot)
                if rank != split:
                    pushed[rank] += PART_BYTES + 4
        for rank in range(splits):
            rows = m.rows_merged(rank, splits) if rank < group else 0
            assert rows == len(range(rank, group, splits))
            # merge()'s slot of split s for its j-th row (rank + j * splits) is where push() put it
            for j in range(rows):
                for s in range(splits):
                    assert m.merge_slot(j, s, splits) == m.route(rank + j * splits, s, splits)[1]
            assert taken[rank] == {m.merge_slot(j, s, splits) for j in range(rows) for s in range(splits)}
            assert pushed[rank] == m.peer_bytes(rows, splits)  # merge()'s expect_tx


def test_every_split_factor_of_a_2_cta_grid_merges_in_a_cluster():
    seen = set()
    for group, hkv in ((16, 4), (16, 1), (8, 1)):
        m = _merge(group)
        for batch in range(1, 257):
            for qlen in (1, 2, 4, 8):
                rows_heads = batch * qlen * hkv
                splits = choose_num_splits(rows_heads, 16, DEFAULT_NUM_SMS)
                if splits > 1 and choose_ctas_per_sm(rows_heads * splits, DEFAULT_NUM_SMS, (2, 3)) == 2:
                    assert m.fits(splits), (group, batch, qlen, splits)
                    seen.add((group, splits))
    assert (16, 16) in seen and (8, 16) in seen  # batch 1 at every geometry


def test_the_planners_cluster_bound_is_the_receive_buffers():
    # geometry.MAX_CLUSTER_SPLITS (the planner's one-wave rule) and the kernels' RECV_SLOTS are one bound: every
    # power of two up to it fits the receive buffer at every group size
    from msa_jit.geometry import MAX_CLUSTER_SPLITS, MAX_GROUP_SIZE
    from msa_jit.kernels.cluster_merge import RECV_SLOTS

    assert MAX_CLUSTER_SPLITS == RECV_SLOTS
    for group in range(1, MAX_GROUP_SIZE + 1):
        m = _merge(group)
        assert all(m.fits(1 << b) for b in range(1, MAX_CLUSTER_SPLITS.bit_length())), group


def test_cluster_merge_needs_the_2_cta_build():
    from msa_jit.kernels.token import SparseDecodeTokenKernel

    with pytest.raises(ValueError, match="split_merge"):
        SparseDecodeTokenKernel(num_q_heads=64, num_kv_heads=4, split_merge="dsmem")
    with pytest.raises(ValueError, match="ctas_per_sm <= 2"):
        SparseDecodeTokenKernel(num_q_heads=64, num_kv_heads=4, split_merge="cluster", ctas_per_sm=3)


def _base_opcodes(body: str) -> Counter:
    """Opcode counts without modifiers (STAS.128 and STAS are both STAS)."""
    out: Counter = Counter()
    for op, n in sass.opcode_counts(body).items():
        out[op.split(".")[0]] += n
    return out


def _functions(tmp_path, split_merge, hq, hkv, kv_dtype="float8_e4m3fn"):
    """The shipped build of the config (the fp8 cluster build: msa_jit/kernels/token_dims.py)."""
    cfg = SparseDecodeConfig(num_q_heads=hq, num_kv_heads=hkv, kv_dtype=kv_dtype, arch="sm_90a", split_merge=split_merge)
    tmp_path.mkdir(parents=True, exist_ok=True)
    compile_without_warnings(cfg, tmp_path)
    (cubin,) = sass.extract_cubins(tmp_path / "sparse_decode.so")
    return cubin, sass.split_functions(sass.disassemble(cubin))


@pytest.mark.slow
@pytest.mark.parametrize("hq, hkv, kv_dtype, pushes", [(64, 4, "float8_e4m3fn", 6), (8, 1, "float8_e4m3fn", 3),
                                                      (64, 4, "nvfp4", 5)])
def test_cluster_build_pushes_and_waits_without_fences(tmp_path, hq, hkv, kv_dtype, pushes):
    # pushes: the key split (NVFP4) pushes 4 x 16 bytes of a thread's row + its log2-LSE; the dims split (fp8)
    # 2 x 16 bytes of each of a lane's 2 rows + their log2-LSEs (one row at G = 8)
    cubin, funcs = _functions(tmp_path, "cluster", hq, hkv, kv_dtype)
    decode = {n: b for n, b in funcs.items() if "merge" not in n.lower()}
    # two launch sites of the same decode kernel: in a cluster, or before the merge kernel (a split
    # factor whose rows do not fit the receive buffer), which stays in the artifact
    assert len(decode) == 2 and any("merge" in n.lower() for n in funcs)
    for body in decode.values():
        ops = _base_opcodes(body)
        assert ops["STAS"] == pushes, ops
        assert ops["UCGABAR_ARV"] == 1 and ops["UCGABAR_WAIT"] == 1, ops
        assert ops["MEMBAR"] == 0 and ops["LDL"] + ops["STL"] == 0, ops
        # the arrive right after the setup, the wait before the first push, the merge after it
        assert body.index("UCGABAR_ARV") < body.index("UCGABAR_WAIT") < body.index("STAS")
        assert "SYNCS.ARRIVE.TRANS64 RZ" in body[body.index("STAS"):]  # the merging CTA's expect_tx
    res = [r for r in sass.kernel_resources(cubin) if "merge" not in r.name.lower()]
    assert all(r.registers <= 168 for r in res), res  # 2 CTAs x 160 threads fit 65536 registers


@pytest.mark.slow
def test_default_build_has_no_cluster_code(tmp_path):
    _, funcs = _functions(tmp_path, "kernel", 64, 4)
    decode = [b for n, b in funcs.items() if "merge" not in n.lower()]
    assert len(decode) == 1
    ops = _base_opcodes(decode[0])
    assert ops["STAS"] == 0 and ops["UCGABAR_ARV"] == 0 and ops["UCGABAR_WAIT"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("split_merge", ["kernel", "cluster"])
def test_dynamic_smem_is_what_the_launch_asks_for(split_merge):
    """compiler.dynamic_smem_bytes (`msa-jit inspect`'s smem) counts the cluster merge's receive
    buffer: the traced host code launches the decode kernel with exactly that many bytes."""
    import re

    import cutlass.cute as cute

    from msa_jit.jit.compiler import convention, dynamic_smem_bytes, make_kernel

    cfg = SparseDecodeConfig(64, 4, arch="sm_90a", split_merge=split_merge)
    conv = convention
    compiled = cute.compile(make_kernel(cfg), *conv.fake_arguments(cfg),
                            options=f"{conv.COMPILE_OPTIONS} --gpu-arch {cfg.arch}")
    n = dynamic_smem_bytes(cfg)
    assert re.search(rf"llvm\.mlir\.constant\({n} : i64\)", str(compiled.ir_module)), n
    # 64/4: 3 stages (99328); the cluster build's dims-split kernel: 2 padded stages, P's fragments and the
    # 8264 bytes of its receive buffer (msa_jit/kernels/token_dims.py)
    assert n == {"kernel": 99328, "cluster": 79944}[split_merge]
