"""The bench without a GPU: grid, steps and byte accounting, the floor probe (Triton interpreter),
the per-layer arithmetic end to end with the GPU timing replaced, tables, plot, regression check
and the CLI's no-GPU paths."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
import re
import signal

import numpy as np
import pytest
import torch

from msa_jit import SparseDecodePlanner, cli
from msa_jit.tools import bench
from msa_jit.tools.bench import measure, readers, report, timing
from msa_jit.tools.bench.steps import FP8_KV, NVFP4_KV
from msa_jit.nvfp4 import dequantize_kv_nvfp4, nvfp4_kv_cache_shape


def _result(date, us, copy=4.2):
    points = [dict(geometry="64/4", q_dtype="bfloat16", batch=b, qlen=1, shared_blocks=0, num_splits=1,
                   us=t, us_p10=t, us_p90=t, kv_bytes=1 << 20, logical_bytes=1 << 20, tbps=1.0,
                   logical_tbps=1.0, pct_of_copy=25.0) for b, t in zip((1, 64), us)]
    return {"environment": {"device": "test", "date": date}, "copy_tbps": copy, "points": points}


def _row(spec: bench.RowSpec, marginal: float, copy_bw: float = 4.2e12, floor: float | None = None) -> dict:
    """A per_layer row as measure_row writes it, with a chosen marginal (and floor)."""
    hkv = bench.GEOMETRIES[spec.geometry][1]
    blocks = spec.batch * hkv * (16 + (spec.qlen - 1) * (16 - spec.shared_blocks if spec.shared_blocks else 12))
    kv = blocks * bench.block_bytes(spec.kv_dtype)
    logical = spec.batch * spec.qlen * hkv * 16 * bench.block_bytes(spec.kv_dtype)
    one = marginal + 4.0
    r = {"geometry": spec.geometry, "batch": spec.batch, "qlen": spec.qlen, "shared_blocks": spec.shared_blocks,
         "q_dtype": "bfloat16", "kv_dtype": spec.kv_dtype, "layers": 4, "ctas_per_sm": 2, "num_splits": 1,
         "kv_bytes": kv, "logical_bytes": logical, "one_layer_us": one, "all_layers_us": one + 3 * marginal,
         "marginal_us": marginal, "marginal_tbps": kv / (marginal * 1e-6) / 1e12,
         "one_layer_pct_of_copy": round(100 * kv / (one * 1e-6) / copy_bw, 1),
         "marginal_pct_of_copy": round(100 * kv / (marginal * 1e-6) / copy_bw, 1),
         "marginal_logical_pct_of_copy": round(100 * logical / (marginal * 1e-6) / copy_bw, 1)}
    if spec.floor:
        f = floor if floor is not None else 0.9 * marginal
        r.update(floor_one_layer_us=f + 4, floor_marginal_us=f, floor_programs=spec.batch * spec.qlen * hkv * 16,
                 floor_pdl=True, ratio_to_floor=round(marginal / f, 3))
    return r


def _grid_result(marginal=None, floor=None, host=None, date="2026-12-04T00:00:00+00:00") -> dict:
    """A full-grid result file: marginal(spec) -> µs (default: bytes at 90% of copy + 2 µs)."""
    copy_bw = 4.2e12

    def default(spec):
        r = _row(spec, 1.0)
        return r["kv_bytes"] / (0.9 * copy_bw) * 1e6 + 2.0

    marginal = marginal or default
    rows = [_row(s, marginal(s), copy_bw, floor(s) if floor else None) for s in bench.grid_rows()]
    bench.add_speedups(rows)
    points = [dict(geometry=r["geometry"], q_dtype="bfloat16", batch=r["batch"], qlen=r["qlen"],
                   shared_blocks=r["shared_blocks"], num_splits=1, us=r["one_layer_us"], us_p10=r["one_layer_us"],
                   us_p90=r["one_layer_us"], kv_bytes=r["kv_bytes"], logical_bytes=r["logical_bytes"], tbps=1.0,
                   logical_tbps=1.0, pct_of_copy=r["one_layer_pct_of_copy"], ctas_per_sm=2, kv_dtype=r["kv_dtype"])
              for r in rows]
    return {"environment": {"device": "NVIDIA H200", "date": date}, "copy_tbps": copy_bw / 1e12,
            "read_2g": {"tbps": 4.3, "pct_of_copy": 102.4}, "per_layer": rows, "points": points,
            "grid": {"geometries": list(bench.GRID_GEOMETRIES), "batches": list(bench.GRID_BATCHES),
                     "qlens": list(bench.GRID_QLENS)},
            "host": host or {"op_call_cpu_us": 7.5, "prepare_cpu_us": 9.0, "torch_add_us": 3.0,
                             "op_call_vs_torch_add": 2.5, "prepare_vs_torch_add": 3.0, "calls": 3000}}


def _main(argv: list[str]) -> tuple[int, str]:
    """rc and what `msa-jit` wrote to stdout and stderr together (errors go to stderr)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli.main(argv)
    return rc, out.getvalue()


# ---------------------------------------------------------------- baseline comparison


def test_regressions_flags_only_points_slower_than_the_slack():
    old = _result("2026-01-01T00:00:00", [10.0, 100.0])
    new = _result("2026-01-02T00:00:00", [10.4, 120.0])
    out = bench.regressions(new, old)
    assert len(out) == 1 and "120.0" in out[0]
    assert bench.regressions(old, old) == []


def test_regressions_compare_like_with_like_across_file_formats():
    """An old file (fp8 points, per_layer rows without kv_dtype / q_dtype / qlen / shared_blocks)
    compares with a new file's fp8 rows only; per-layer rows compare on marginal_us."""
    old = _result("2026-01-01T00:00:00", [10.0, 100.0])
    old["per_layer"] = [{"geometry": "64/4", "batch": 64, "qlen": 1, "layers": 4, "marginal_us": 37.6}]
    new = _grid_result(marginal=lambda s: 37.6 * 1.2 if (s.geometry, s.batch, s.kv_dtype) == ("64/4", 64, FP8_KV)
                       else 500.0)
    for p in new["points"]:
        p["us"] = 10.0 if p["batch"] == 1 else 100.0  # every step as before, NVFP4 ones included
    new["points"][0]["us"] = 100.0  # ... but for 64/4 q1 B=1 fp8
    lines = bench.regressions(new, old)
    assert len(lines) == 2, lines
    assert any(line.startswith("layer ('64/4', 'bfloat16', 'float8_e4m3fn', 64, 1, 0)") for line in lines)
    assert any(line.startswith("step ('64/4', 'bfloat16', 'float8_e4m3fn', 1, 1, 0)") for line in lines)
    cmp = bench.compare_with_baseline(new, old)
    assert {c["key"][2] for c in cmp} == {FP8_KV}  # NVFP4 rows have nothing to compare with
    assert len([c for c in cmp if c["kind"] == "step"]) == 2


def test_latest_result_picks_the_newest_recorded_date(tmp_path):
    for name, date in (("bench-a.json", "2026-01-03T00:00:00"), ("bench-b.json", "2026-01-01T00:00:00")):
        (tmp_path / name).write_text(json.dumps(_result(date, [1.0, 2.0])))
    (tmp_path / "bench-broken.json").write_text("{")
    (tmp_path / "bench-nodate.json").write_text('{"environment": {}}')  # another JSON: skipped too
    (tmp_path / "bench-list.json").write_text('{"environment": []}')
    assert bench.latest_result(tmp_path).name == "bench-a.json"
    assert bench.latest_result(tmp_path / "missing") is None


def test_latest_result_compares_only_the_same_gpu(tmp_path):
    for name, date, device in (("bench-h100.json", "2026-01-03T00:00:00", "NVIDIA H100 80GB HBM3"),
                               ("bench-h200.json", "2026-01-01T00:00:00", "NVIDIA H200")):
        result = _result(date, [1.0, 2.0])
        result["environment"]["device"] = device
        (tmp_path / name).write_text(json.dumps(result))
    assert bench.latest_result(tmp_path).name == "bench-h100.json"
    assert bench.latest_result(tmp_path, "NVIDIA H200").name == "bench-h200.json"
    assert bench.latest_result(tmp_path, "NVIDIA B200") is None


def test_plot_writes_a_png_for_old_and_new_files(tmp_path):
    for name, result in (("old.png", _result("2026-01-01T00:00:00", [10.0, 100.0])), ("new.png", _grid_result())):
        bench.plot(result, tmp_path / name)
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- host timing


def test_per_call_us_syncs_where_asked(monkeypatch):
    events = []
    monkeypatch.setattr(timing, "_sync", lambda: events.append("sync"))
    call = lambda: events.append("call")  # noqa: E731
    for sync, want in (("none", ["call", "sync", "call", "call"]),
                       ("each", ["call", "sync", "call", "sync", "call", "sync"]),
                       ("end", ["call", "sync", "call", "call", "sync"])):
        events.clear()
        assert bench.per_call_us(call, 2, warmup=1, sync=sync) >= 0
        assert events == want, sync
    with pytest.raises(ValueError, match="sync"):
        bench.per_call_us(call, 1, sync="never")


def test_interleaved_per_call_us_takes_the_fns_in_turn(monkeypatch):
    events = []
    monkeypatch.setattr(timing, "_sync", lambda: events.append("sync"))
    fns = {"a": lambda: events.append("a"), "b": lambda: events.append("b")}
    us = bench.interleaved_per_call_us(fns, 2, rounds=2, warmup=1)
    assert set(us) == {"a", "b"} and all(v >= 0 for v in us.values())
    calls = [e for e in events if e != "sync"]
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 2  # warm-up, then round 1, round 2


# ---------------------------------------------------------------- the grid


def test_grid_rows_cover_the_issue_grid_in_pairs():
    rows = bench.grid_rows()
    plain = [r for r in rows if not r.shared_blocks]
    assert len(plain) == 3 * 5 * 4 * 2
    assert {(r.geometry, r.batch, r.qlen) for r in plain} == {
        (g, b, q) for g in ("64/4", "16/1", "8/1") for b in (1, 4, 16, 64, 256) for q in (1, 2, 4, 8)}
    for a, b in zip(rows[::2], rows[1::2]):  # fp8 then NVFP4 of the same point, next to each other
        assert a.point == b.point and (a.kv_dtype, b.kv_dtype) == (FP8_KV, NVFP4_KV)
    # what the targets need first: qlen 1 and 4, then the shared rows, then qlen 2 and 8
    order = [("s" if r.shared_blocks else r.qlen) for r in rows]
    assert [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k] == [1, 4, "s", 2, 8]
    assert all(r.floor == (r.batch in (1, 4, 16)) for r in plain)
    shared = [r for r in rows if r.shared_blocks]
    assert {(r.geometry, r.batch, r.qlen) for r in shared} == {
        ("64/4", 1, 4), ("64/4", 16, 4), ("64/4", 64, 4), ("64/4", 64, 2), ("64/4", 64, 8)}
    assert all(r.shared_blocks == 12 and not r.floor for r in shared) and len(shared) == 10
    quick = bench.grid_rows(qlens=bench.QUICK_QLENS, shared_points=bench.QUICK_SHARED_POINTS)
    assert len(quick) == 3 * 5 * 2 * 2 + 2
    assert bench.grid_rows(("8/1",), (1,), (1,), (FP8_KV,), bench.SHARED_POINTS, ()) == [
        bench.RowSpec("8/1", 1, 1, 0, FP8_KV, False)]  # shared points of other geometries are left out
    with pytest.raises(ValueError, match="geometries"):
        bench.grid_rows(geometries=("12/5",))
    with pytest.raises(ValueError, match="kv_dtypes"):
        bench.grid_rows(kv_dtypes=("fp4",))


def test_grid_order_and_speedups_of_neighbours():
    """Per qlen the rows go geometry by geometry, batch by batch; an NVFP4 row's speed-ups are over
    the fp8 row of the same point (a shared-block row over its shared fp8 row), per layer and one
    layer alike; a row with no time gets none."""
    plain = [(r.geometry, r.batch) for r in bench.grid_rows(qlens=(1,), kv_dtypes=(FP8_KV,), shared_points=())]
    assert plain == [(g, b) for g in bench.GRID_GEOMETRIES for b in bench.GRID_BATCHES]
    specs = [bench.RowSpec("64/4", 64, 4, s, kv, False) for s in (0, 12) for kv in (FP8_KV, NVFP4_KV)]
    rows = [_row(spec, m) for spec, m in zip(specs, (10.0, 5.0, 8.0, 2.0))]
    for r, one in zip(rows, (20.0, 16.0, 12.0, 3.0)):
        r["one_layer_us"] = one
    bench.add_speedups(rows)
    assert [r.get("speedup_vs_fp8") for r in rows] == [None, 2.0, None, 4.0]
    assert [r.get("one_layer_speedup_vs_fp8") for r in rows] == [None, 1.25, None, 4.0]
    assert not any(k.endswith("_fp8") and k.startswith("speedup_vs_") and k != "speedup_vs_fp8"
                   for r in rows for k in r)  # no peer timed: no peer column
    # a peer timed on the fp8 row: the NVFP4 row gets the peer's fp8 time over its own
    rows = [_row(spec, m) for spec, m in zip(specs[:2], (10.0, 4.0))]
    rows[0].update(flashinfer_marginal_us=12.0, speedup_vs_flashinfer=1.2, floor_marginal_us=3.0)
    bench.add_speedups(rows)
    assert "speedup_vs_floor_fp8" not in rows[1]
    assert rows[1]["speedup_vs_flashinfer_fp8"] == 3.0 and "speedup_vs_flashinfer_fp8" not in rows[0]
    rows = [_row(spec, 10.0) for spec in specs[:2]]
    rows[1]["marginal_us"] = 0.0  # a row with no time (t(L) == t(1))
    bench.add_speedups(rows)
    assert "speedup_vs_fp8" not in rows[1]


def test_block_bytes_are_one_page_of_one_kv_head_in_each_layout():
    fp8_page = 128 * 256  # [P, Hkv, 128, 256] fp8: one byte per element
    assert bench.block_bytes(FP8_KV) == fp8_page == 32 * 1024
    for hkv in (1, 4):
        assert bench.block_bytes(NVFP4_KV) * hkv == math.prod(nvfp4_kv_cache_shape(1, hkv, 128)) == 18 * 1024 * hkv
    with pytest.raises(ValueError, match="kv_dtype"):
        bench.block_bytes("bfloat16")


def test_make_indices_follow_the_contract_and_count_bytes():
    for qlen, shared in ((1, 0), (4, 0), (4, 12), (2, 16)):
        idx = bench.make_indices(3, 2, qlen, ctx_len=4096, shared_blocks=shared, seed=5)
        nblk = 4096 // 128
        assert idx.topk.shape == (3 * qlen, 2, 16) and idx.block_table.shape == (3, nblk)
        assert sorted(idx.block_table.flatten().tolist()) == list(range(3 * nblk))
        assert (idx.seq_lens == 4096).all()
        distinct, overlaps = 0, []
        for r in range(3):
            for h in range(2):
                rows = [idx.topk[r * qlen + j, h].tolist() for j in range(qlen)]
                for row in rows:
                    assert row == sorted(set(row)) and row[-1] == nblk - 1 and 0 <= row[0]
                    assert len(set(row) & set(rows[0])) >= (shared if shared else 1)
                overlaps += [len(set(row) & set(rows[0])) for row in rows[1:]]
                distinct += len({b for row in rows for b in row})
        assert idx.distinct_blocks == distinct and idx.logical_blocks == 3 * qlen * 2 * 16
        if shared:  # `shared` blocks in common (the last one included), not one more: more only by chance
            assert min(overlaps) == shared, overlaps
    a, b = bench.make_indices(2, 1, 2, seed=1), bench.make_indices(2, 1, 2, seed=1)
    assert torch.equal(a.topk, b.topk) and torch.equal(a.block_table, b.block_table)
    with pytest.raises(ValueError, match="shared_blocks"):
        bench.make_indices(1, 1, 2, shared_blocks=17)
    with pytest.raises(ValueError, match="ctx_len"):
        bench.make_indices(1, 1, 1, ctx_len=1024)


def test_make_step_builds_both_cache_formats_on_the_same_blocks():
    idx = bench.make_indices(2, 1, 2, ctx_len=4096, seed=3)
    f8 = bench.make_step(16, 1, 2, 2, "bfloat16", indices=idx, seed=3, device="cpu")
    f4 = bench.make_step(16, 1, 2, 2, "bfloat16", indices=idx, seed=3, device="cpu", kv_dtype=NVFP4_KV)
    pages = 2 * 32
    assert f8["kv_cache"].shape == (pages, 1, 128, 256) and f8["kv_cache"].dtype == torch.float8_e4m3fn
    assert f4["kv_cache"].shape == nvfp4_kv_cache_shape(pages, 1, 128) and f4["kv_cache"].dtype == torch.uint8
    assert torch.equal(f8["topk"], f4["topk"]) and torch.equal(f8["query"], f4["query"])
    assert f8["kv_bytes"] == idx.distinct_blocks * 32768 and f4["kv_bytes"] == idx.distinct_blocks * 18432
    assert f4["logical_bytes"] == 2 * 2 * 16 * 18432 and f4["kv_dtype"] == NVFP4_KV
    k, v = dequantize_kv_nvfp4(f4["kv_cache"], f4["k_scale"], f4["v_scale"])
    assert k.abs().max() > 0 and v.abs().max() > 0 and torch.isfinite(k).all() and torch.isfinite(v).all()
    assert f8["kv_cache"].float().abs().max() > 0
    # an NVFP4 cache repeats its quantized pool over the pages
    kv, ks, vs = bench.make_kv_cache(NVFP4_KV, 10, 1, pool_pages=4, device="cpu", seed=9)
    assert torch.equal(kv[5], kv[1]) and not torch.equal(kv[1], kv[2]) and ks > 0 and vs > 0
    with pytest.raises(ValueError, match="indices"):
        bench.make_step(16, 1, 2, 1, "bfloat16", indices=idx, device="cpu")


def test_step_query_dtype_planner_args_and_decode_call(monkeypatch):
    """An fp8-query step has an fp8 query; prepare_args names the step's own top-k; decode passes
    the cache's global scales (an NVFP4 cache is read wrong without them); a context that is no
    whole number of pages is refused."""
    from msa_jit import op
    from msa_jit.tools.bench import steps

    idx = bench.make_indices(2, 1, 2, ctx_len=2048, topk=4, seed=3)
    step = bench.make_step(16, 1, 2, 2, "float8_e4m3fn", indices=idx, topk=4, device="cpu", kv_dtype=NVFP4_KV)
    assert step["query"].dtype == torch.float8_e4m3fn and step["out"].dtype == torch.bfloat16
    args, kw = bench.prepare_args(step, 16, 1, 2)
    assert args[3] == 2 and kw == dict(num_q_heads=16, num_kv_heads=1, page_size=128, topk_blocks=4)
    seen = []
    monkeypatch.setattr(op, "sparse_decode", lambda *a, **k: seen.append(k))
    steps.decode(step, plan="plan")
    assert seen == [dict(sm_scale=128 ** -0.5, k_scale=step["k_scale"], v_scale=step["v_scale"])]
    assert step["k_scale"] != 1.0
    with pytest.raises(ValueError, match="ctx_len"):
        bench.make_indices(1, 1, 1, ctx_len=16 * 128 + 64)


# ---------------------------------------------------------------- the floor probe


def _block_words(step: dict, page: int, h: int) -> np.ndarray:
    """The (page, KV head) block as the contract lays it out: fp8 kv[page, h]; NVFP4 the K slot
    kv[page, 2h] then the V slot kv[page, 2h + 1]."""
    kv = step["kv_cache"].view(torch.uint8)
    if step["kv_dtype"] == FP8_KV:
        raw = kv[page, h].reshape(-1)
    else:
        raw = torch.cat([kv[page, 2 * h].reshape(-1), kv[page, 2 * h + 1].reshape(-1)])
    return raw.contiguous().view(torch.int32).numpy()


@pytest.mark.parametrize("kv_dtype", [FP8_KV, NVFP4_KV])
def test_floor_probe_reads_each_slots_block(kv_dtype):
    """One program per (token, KV head, slot) reads exactly the block topk -> block table names
    (store_all: each program's XOR), and the timed build writes nothing."""
    qlen, batch, hkv, k = 2, 2, 2, 4
    idx = bench.make_indices(batch, hkv, qlen, ctx_len=2048, topk=k, seed=11)
    step = bench.make_step(32, hkv, batch, qlen, "bfloat16", indices=idx, topk=k, device="cpu", kv_dtype=kv_dtype)
    fn = readers.floor_layer(step, store_all=True)
    assert fn.programs == batch * qlen * hkv * k and fn.pdl is False  # no PDL under the interpreter
    fn()
    want = [np.bitwise_xor.reduce(_block_words(step, int(idx.block_table[t // qlen, idx.topk[t, h, s]]), h))
            for t in range(batch * qlen) for h in range(hkv) for s in range(k)]
    assert step["floor_out"].numpy().tolist() == np.array(want, dtype=np.int32).tolist()
    lean = readers.floor_layer(step)
    lean()
    assert step["floor_out"].shape == (readers.WORDS,) and not step["floor_out"].any()


def test_floor_probe_rejects_what_it_cannot_read():
    idx = bench.make_indices(2, 2, 1, ctx_len=2048, topk=4)
    step = bench.make_step(32, 2, 2, 1, "bfloat16", indices=idx, topk=4, device="cpu")
    for key, bad, msg in (("topk", step["topk"].transpose(0, 1), "topk"),
                          ("topk", step["topk"].long(), "topk"),
                          ("block_table", step["block_table"].t(), "block_table"),
                          ("kv_cache", step["kv_cache"][:, :, :, :128], "kv_cache")):
        with pytest.raises(ValueError, match=msg):
            readers.floor_layer({**step, key: bad})
    with pytest.raises(ValueError, match="kv_cache"):  # a cache whose size is no whole page of this format
        readers.floor_layer({**step, "kv_dtype": NVFP4_KV})
    with pytest.raises(ValueError, match="not a multiple of the block table's 2 requests"):  # 3 tokens, 2 requests
        readers.floor_layer({**step, "topk": step["topk"].repeat(2, 1, 1)[:3].contiguous()})
    with pytest.raises(ValueError, match="nbytes"):  # checked before anything is allocated on the GPU
        readers.read_bandwidth(nbytes=readers.BLOCK_BYTES + 4)


# ---------------------------------------------------------------- measure_row / run_grid, GPU timing faked


class _FakeGpu:
    """time_graph / ceilings stand-ins: a graph costs 3 µs + 5 µs per fp8 layer, 3 µs per NVFP4
    layer and 2 µs per floor launch, found by running the captured fn once on CPU tensors."""

    LAYER_US = {FP8_KV: 5.0, NVFP4_KV: 3.0}

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        real_floor = readers.floor_layer

        def floor_layer(step, **kw):
            fn = real_floor(step, **kw)

            def run():
                self.calls.append("floor")
                fn()
            run.programs, run.pdl = fn.programs, fn.pdl
            return run

        def decode(step, plan):
            assert plan.block_table is not None and plan.qlen == step["topk"].shape[0] // plan.batch
            self.calls.append(step["kv_dtype"])

        monkeypatch.setattr(measure, "time_graph", self.time_graph)
        monkeypatch.setattr(measure, "decode", decode)
        monkeypatch.setattr(readers, "floor_layer", floor_layer)
        monkeypatch.setattr(measure, "make_step", functools.partial(bench.make_step, device="cpu"))
        monkeypatch.setattr(measure, "ceilings", lambda: (4.0e12, 4.2e12, {"graph_us": 3.5, "in_graph_us": 4.0}))
        real_env = measure.environment  # the targets count an H200's figures only
        monkeypatch.setattr(measure, "environment", lambda: {**real_env(), "device": "NVIDIA H200"})

    def time_graph(self, fn, iters=50, **kw):
        self.calls.clear()
        fn()
        us = 3.0 + sum(2.0 if c == "floor" else self.LAYER_US[c] for c in self.calls)
        return [us + 0.01 * (i % 3 - 1) for i in range(iters)]


def test_measure_row_reports_the_marginal_layer_and_its_floor(monkeypatch):
    _FakeGpu(monkeypatch)
    spec = bench.RowSpec("16/1", 1, 1, 0, NVFP4_KV, True)
    row, point = bench.measure_row(spec, 4.0e12, iters=5, num_layers=3)
    assert row["one_layer_us"] == 6.0 and row["all_layers_us"] == 12.0 and row["marginal_us"] == 3.0
    assert row["floor_one_layer_us"] == 5.0 and row["floor_marginal_us"] == 2.0 and row["ratio_to_floor"] == 1.5
    assert row["floor_programs"] == 16 and row["kv_dtype"] == NVFP4_KV and row["layers"] == 3
    assert row["kv_bytes"] == 16 * 18432 == row["logical_bytes"]  # batch 1, qlen 1: 16 distinct blocks
    assert row["marginal_pct_of_copy"] == round(100 * row["kv_bytes"] / 3e-6 / 4.0e12, 1)
    assert point.us == 6.0 and point.kv_dtype == NVFP4_KV and point.pct_of_copy == row["one_layer_pct_of_copy"]
    assert point.us_in_graph is None
    with pytest.raises(ValueError, match="num_layers"):
        bench.measure_row(spec, 4.0e12, num_layers=1)


def test_run_grid_main_and_the_cli_on_its_result(monkeypatch, tmp_path):
    gpu = _FakeGpu(monkeypatch)
    kw = dict(geometries=("16/1",), batches=(1,), qlens=(1,), shared_points=(), iters=3, host=False)
    result = bench.main(str(tmp_path), baseline="none", log=lambda *_: None, **kw)
    assert [(r["kv_dtype"], r["marginal_us"]) for r in result["per_layer"]] == [(FP8_KV, 5.0), (NVFP4_KV, 3.0)]
    assert result["per_layer"][1]["speedup_vs_fp8"] == round(5 / 3, 3) and not result["errors"]
    assert result["read_2g"] == {"tbps": 4.2, "pct_of_copy": 105.0} and len(result["points"]) == 2
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and files[0].endswith(".json") and files[1].endswith(".png")
    path = tmp_path / files[0]
    first = json.loads(path.read_text())
    assert first["per_layer"] == result["per_layer"]
    rc, out = _main(["bench", "--table", str(path)])
    assert rc == 0 and "| 16/1 | nvfp4 | 1 | 3.0 µs (" in out and "1.67x" in out
    # a second run against the first: the same figures, no regression; one failing row is listed
    gpu.LAYER_US = {FP8_KV: 5.0}
    again = bench.main(str(tmp_path), baseline=str(path), log=lambda *_: None, **kw)
    assert again["regressions"] == [] and len(again["errors"]) == 1 and again["errors"][0]["kv_dtype"] == NVFP4_KV
    assert again["baseline"] == str(path)
    # 40% slower than the first run: REGRESSION rows (and exit 1), but not against another GPU's file
    # (the baselines are copies of the first result: a run within the same minute rewrites its file)
    gpu.LAYER_US = {FP8_KV: 7.0, NVFP4_KV: 4.2}
    for name, device in (("same-gpu.json", first["environment"]["device"]), ("h100.json", "NVIDIA H100 80GB HBM3")):
        (tmp_path / name).write_text(json.dumps(dict(first, environment=dict(first["environment"], device=device))))
    slower = bench.main(str(tmp_path), baseline=str(tmp_path / "same-gpu.json"), log=lambda *_: None, **kw)
    assert any("16/1" in line for line in slower["regressions"])
    assert bench.main(str(tmp_path), baseline=str(tmp_path / "h100.json"), log=lambda *_: None, **kw)["regressions"] == []
    # four runs, four result files: a run within the same minute as another keeps its own file
    assert len(list(tmp_path.glob("bench-*.json"))) == 4 and len(list(tmp_path.glob("bench-*.png"))) == 4


def test_sigterm_stops_the_grid_and_keeps_the_rows_done(monkeypatch, tmp_path):
    gpu = _FakeGpu(monkeypatch)
    graphs = []

    def time_graph(fn, iters=50, **kw):
        graphs.append(1)
        if len(graphs) == 5:  # row 1: 2 graphs + 2 floor graphs; the 5th is row 2's first
            os.kill(os.getpid(), signal.SIGTERM)
        return gpu.time_graph(fn, iters)

    monkeypatch.setattr(measure, "time_graph", time_graph)
    result = bench.main(str(tmp_path), baseline="none", log=lambda *_: None, geometries=("16/1",), batches=(1,),
                        qlens=(1,), shared_points=(), iters=3)
    assert result["incomplete"] == {"rows_done": 1, "rows": 2} and "host" not in result
    assert [r["kv_dtype"] for r in result["per_layer"]] == [FP8_KV] and not result["errors"]
    assert len(list(tmp_path.glob("bench-*.json"))) == 1
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone again


def test_a_failing_host_measurement_still_writes_the_grid(monkeypatch, tmp_path):
    _FakeGpu(monkeypatch)

    def broken(**kw):
        raise RuntimeError("no CUDA here")

    monkeypatch.setattr(measure, "host_overheads", broken)
    result = bench.main(str(tmp_path), baseline="none", log=lambda *_: None, geometries=("8/1",), batches=(1,),
                        qlens=(1,), kv_dtypes=(FP8_KV,), shared_points=(), floor_batches=(), iters=3)
    assert [e["host"] for e in result["errors"]] == ["host", "host_b256"] and len(result["per_layer"]) == 1
    assert "host" not in result and len(list(tmp_path.glob("bench-*.json"))) == 1


def test_cli_refuses_unknown_names_before_touching_a_gpu():
    rc, out = _main(["bench", "--kv-dtypes", "fp4"])
    assert rc == 2 and "'fp4'" in out and "nvfp4" in out
    rc, out = _main(["bench", "--geometries", "12/5"])
    assert rc == 2 and "'12/5'" in out


# ---------------------------------------------------------------- README tables


def test_result_tables_shows_per_layer_first_then_shared_then_per_step():
    result = _grid_result(floor=lambda s: 3.0)
    text = bench.result_tables(result)
    layer_at, shared_at, step_at = (text.index("Per layer"), text.index("Speculative decode"), text.index("Per step"))
    assert layer_at < shared_at < step_at
    rows = [line for line in text.splitlines() if line.startswith("| 64/4 | ") or line.startswith("| 16/1 | ")
            or line.startswith("| 8/1 | ")]
    assert len(rows) == 2 * 3 * 2 * 4 + 10  # per-layer and per-step grids, plus the shared rows
    by = {(r["geometry"], r["kv_dtype"], r["qlen"], r["batch"]): r for r in result["per_layer"] if not r["shared_blocks"]}
    r1, r4 = by[("64/4", FP8_KV, 1, 1)], by[("64/4", NVFP4_KV, 1, 1)]
    assert f"| 64/4 | fp8 | 1 | {r1['marginal_us']:.1f} µs ({r1['marginal_pct_of_copy']:.0f}%, floor 3.0) |" in text
    assert (f"| 64/4 | nvfp4 | 1 | {r4['marginal_us']:.1f} µs ({r4['marginal_pct_of_copy']:.0f}%, floor 3.0, "
            f"{r4['speedup_vs_fp8']:.2f}x) |") in text
    r = by[("8/1", NVFP4_KV, 8, 256)]
    assert f"{r['marginal_us']:.1f} µs ({r['marginal_pct_of_copy']:.0f}%, {r['speedup_vs_fp8']:.2f}x) |" in text
    assert ", union)" not in text
    r = by[("64/4", FP8_KV, 4, 64)]
    r["kernel"] = "union"  # a row the union kernel ran
    union_text = bench.result_tables(result)
    assert f"| {r['marginal_us']:.1f} µs ({r['marginal_pct_of_copy']:.0f}%, union) |" in union_text
    assert "union: the union kernel ran" in union_text and "union: the union kernel ran" not in text


def test_result_tables_follows_the_files_grid():
    """A --quick file (qlen 1 and 4 in its `grid`) gets tables of those qlens only, not rows of
    dashes for the qlens it did not run."""
    result = _grid_result()
    quick = {1, 4}
    for key in ("per_layer", "points"):
        result[key] = [r for r in result[key] if r["qlen"] in quick]
    result["grid"]["qlens"] = sorted(quick)
    text = bench.result_tables(result)
    qlens = {int(m) for m in re.findall(r"^\| \d+/\d+ \| (?:fp8|nvfp4) \| (\d+) \| ", text, re.M)}
    assert qlens == quick and "—" not in text, text


def test_result_tables_of_an_old_file_is_its_per_step_table():
    text = bench.result_tables(_result("2026-01-01T00:00:00", [10.0, 100.0]), geometries=("64/4",), batches=(1, 64),
                              qlens=(1,))
    assert text == "| geometry | qlen | B=1 | B=64 |\n|---|---|---|---|\n| 64/4 | 1 | 10.0 µs (25%) | 100.0 µs (25%) |"
    # a real file of that format (tests/fixtures: a bench result from before the per-layer grid):
    # qlen 1 and 4 (its grid), every geometry
    path = os.path.join(os.path.dirname(__file__), "fixtures", "bench-per-step-only.json")
    with open(path, encoding="utf-8") as f:
        rows = re.findall(r"^\| (\d+/\d+) \| (\d) \| ", bench.result_tables(json.load(f)), re.M)
    assert rows == [(g, q) for g in bench.GRID_GEOMETRIES for q in "14"], rows


# ---------------------------------------------------------------- on the GPU (bench/device_run.sh tests)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [FP8_KV, NVFP4_KV])
def test_floor_probe_on_the_gpu(kv_dtype):
    """The compiled probe (with PDL where this Triton has it) reads the same blocks as the
    interpreter's, eagerly and replayed in a graph after a prologue; the timed build writes nothing."""
    qlen, batch, hkv, k = 2, 3, 2, 4
    idx = bench.make_indices(batch, hkv, qlen, ctx_len=2048, topk=k, seed=12)
    step = bench.make_step(32, hkv, batch, qlen, "bfloat16", indices=idx, topk=k, kv_dtype=kv_dtype)
    fn = readers.floor_layer(step, store_all=True)
    assert fn.pdl == readers.pdl_supported()
    fn()
    torch.cuda.synchronize()
    cpu = {key: (v.cpu() if isinstance(v, torch.Tensor) else v) for key, v in step.items()}
    want = [np.bitwise_xor.reduce(_block_words(cpu, int(idx.block_table[t // qlen, idx.topk[t, h, s]]), h))
            for t in range(batch * qlen) for h in range(hkv) for s in range(k)]
    assert step["floor_out"].cpu().numpy().tolist() == np.array(want, dtype=np.int32).tolist()
    planner = SparseDecodePlanner()
    args, kw = bench.prepare_args(step, 32, hkv, qlen)
    lean = readers.floor_layer(step)
    times = bench.time_graph(lambda: (planner.prepare(*args, **kw), lean(), lean()), iters=3, warmup_ms=1)
    assert len(times) == 3 and all(t > 0 for t in times) and not step["floor_out"].any()


@pytest.mark.gpu
def test_measure_row_and_ceilings_on_the_gpu():
    copy_bw, read_bw, tiny = measure.ceilings()
    assert 1e12 < copy_bw < 2e13 and 0.5 * copy_bw < read_bw < 2 * copy_bw and tiny["graph_us"] > 0
    indices = [bench.make_indices(1, 1, 1, seed=i) for i in range(3)]
    rows = {}
    for kv in (FP8_KV, NVFP4_KV):
        row, point = bench.measure_row(bench.RowSpec("8/1", 1, 1, 0, kv, True), copy_bw, iters=10, num_layers=3,
                                       indices=indices)
        assert 0 < row["marginal_us"] < row["one_layer_us"] == point.us and row["floor_marginal_us"] > 0
        assert row["floor_programs"] == 16 and row["kv_bytes"] == 16 * bench.block_bytes(kv)
        rows[kv] = row
    bench.add_speedups(list(rows.values()))
    assert rows[NVFP4_KV]["speedup_vs_fp8"] > 0


@pytest.mark.gpu
def test_host_overheads_on_the_gpu():
    h = bench.host_overheads(calls=50, rounds=1, wall_calls=200)
    for key in ("op_call_cpu_us", "prepare_cpu_us", "engine_call_cpu_us", "engine_prepare_cpu_us", "torch_add_us",
                "op_call_cpu_us_nvfp4", "op_call_cpu_us_nvfp4_0d", "op_call_wall_us", "graph_op_gpu_us"):
        assert h[key] > 0, key
    assert h["op_call_vs_torch_add"] == round(h["op_call_cpu_us"] / h["torch_add_us"], 2)
    assert h["method"] == "issue_held_gpu"


class _HeldStream:
    """Stand-in for torch.cuda's spin kernel and events (infrastructure only, no GPU here): the
    spin lasts `calls_per_kcycle` calls of fn per 1000 cycles, so a short spin ends mid-issue."""

    def __init__(self, calls_per_kcycle: float):
        self.rate, self.calls, self.spin_end, self.spins = calls_per_kcycle, 0, 0.0, []

    def sleep(self, cycles):
        self.spins.append(cycles)
        self.spin_end = self.calls + cycles / 1000 * self.rate

    def event(self):
        stream = self

        class Event:
            def record(self):
                pass

            def query(self):
                return stream.calls >= stream.spin_end
        return Event()


@pytest.mark.parametrize("rate, spins", [(3.0, 1), (1.0, 2), (0.2, 3)])
def test_issue_us_retries_until_the_spin_outlasts_the_issue(monkeypatch, rate, spins):
    """issue_us keeps a figure only when the GPU was still spinning after the last call was
    issued; otherwise it doubles the spin and halves the calls, and after `attempts` it raises."""
    import msa_jit.tools.bench.timing as timing

    held = _HeldStream(rate)
    monkeypatch.setattr(timing, "_sync", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", held.sleep, raising=False)
    monkeypatch.setattr(torch.cuda, "Event", held.event)

    def fn():
        held.calls += 1

    us = timing.issue_us(fn, 200, hold_cycles=100_000, attempts=3)
    assert us > 0 and len(held.spins) == spins and held.spins == [100_000 * 2 ** i for i in range(spins)]


def test_issue_us_raises_when_the_gpu_never_holds(monkeypatch):
    import msa_jit.tools.bench.timing as timing

    held = _HeldStream(0.0)  # the spin is over before the first call
    monkeypatch.setattr(timing, "_sync", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", held.sleep, raising=False)
    monkeypatch.setattr(torch.cuda, "Event", held.event)
    with pytest.raises(RuntimeError, match="waits on the GPU"):
        timing.issue_us(lambda: setattr(held, "calls", held.calls + 1), 50, hold_cycles=1000, attempts=3)
    assert len(held.spins) == 3


@pytest.mark.parametrize("argv,want", [
    (["/venv/bin/msa-jit", "bench", "--out", "/o"], "msa-jit bench --out /o"),
    (["/repo/msa_jit/__main__.py", "bench", "--quick"], "msa-jit bench --quick"),
    (["bench/kv_format_ab.py", "run", "--dir", ".kv-variants"], "python bench/kv_format_ab.py run --dir .kv-variants"),
    (["bench/host_ab.py", "--label", "a b"], "python bench/host_ab.py --label 'a b'"),
])
def test_environment_records_the_command_as_typed(monkeypatch, argv, want):
    """A bench/ script's file named a command that does not exist ('msa-jit run --dir ...' for
    kv_format_ab.py), which could not be rerun from the file."""
    from msa_jit.tools.bench.measure import environment

    monkeypatch.setattr("sys.argv", argv)
    assert environment()["command"] == want
