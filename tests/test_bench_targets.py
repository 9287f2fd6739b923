"""msa_jit.bench.targets / report at their edges: the verdicts the issues are judged by (a goal is met
at equality; "at the floor" only where the floor itself is above the goal; a met target off an H200 is
not counted; T·Hkv = 1024 is "large"; a row exactly REGRESSION_SLACK x its baseline is no regression;
a baseline row without a time is not compared) and the spec-decode row's % of copy on distinct bytes.
Synthetic bench results from tests/test_bench.py's helpers."""

from __future__ import annotations

import json

from test_bench import _FakeGpu, _grid_result

from msa_jit import bench
from msa_jit.bench import report, targets
from msa_jit.bench.steps import FP8_KV, NVFP4_KV

LAT_16_1 = "per layer 16/1 B=1 (fp8 cache, bf16 query, qlen 1)"


def _by_target(result, baseline=None):
    return {t["target"]: t for t in targets.check_targets(result, baseline)}


def _layer(result, geometry, batch, qlen=1, shared=0, kv=FP8_KV):
    return next(r for r in result["per_layer"] if (r["geometry"], r["batch"], r["qlen"], r["shared_blocks"],
                                                    r["kv_dtype"]) == (geometry, batch, qlen, shared, kv))


def test_at_floor_only_where_the_floor_is_above_the_goal():
    result = _grid_result()
    row = _layer(result, "16/1", 1)
    row.update(marginal_us=4.3, floor_marginal_us=3.95, ratio_to_floor=round(4.3 / 3.95, 3))  # goal 4.0 us
    assert _by_target(result)[LAT_16_1]["status"] == targets.NOT_MET
    row.update(floor_marginal_us=4.2, ratio_to_floor=round(4.3 / 4.2, 3))  # the floor itself above the goal
    assert _by_target(result)[LAT_16_1]["status"] == targets.AT_FLOOR


def test_met_at_the_floor_off_an_h200_is_not_counted():
    result = _grid_result()
    _layer(result, "16/1", 1).update(marginal_us=5.0, floor_marginal_us=4.8, ratio_to_floor=1.042)
    assert _by_target(result)[LAT_16_1]["status"] == targets.AT_FLOOR
    result["environment"]["device"] = "NVIDIA H100 80GB HBM3"
    row = _by_target(result)[LAT_16_1]
    assert row["status"] == targets.NOT_COUNTED and "not an H200" in row["measured"]


def test_thkv_1024_is_large():
    result = _grid_result()
    baseline = json.loads(json.dumps(result))
    _layer(result, "64/4", 256)["marginal_us"] *= 1.1  # T·Hkv = 1024
    big = _by_target(result, baseline)[f"T·Hkv >= {targets.LARGE_THKV}: no regression (fp8 and NVFP4, every qlen)"]
    assert big["status"] == targets.NOT_MET and "64/4 B=256 q1" in big["measured"]


def test_goals_are_met_at_equality():
    result = _grid_result()
    baseline = json.loads(json.dumps(result))
    _layer(result, "64/4", 1)["marginal_us"] = 4.5  # <= 4.5 us
    _layer(result, "64/4", 64)["marginal_pct_of_copy"] = 90.0  # >= 90%
    _layer(result, "16/1", 1, kv=NVFP4_KV)["speedup_vs_fp8"] = 1.0  # >= 1.00x
    result["host"]["op_call_cpu_us"] = 8.0  # <= 8 us
    status = _by_target(result)
    assert status["per layer 64/4 B=1 (fp8 cache, bf16 query, qlen 1)"]["status"] == targets.MET
    assert status["per layer T·Hkv = 256: 64/4 B=64 (fp8, qlen 1)"]["status"] == targets.MET
    assert status["NVFP4 batch 1 no slower: 16/1 B=1"]["status"] == targets.MET
    assert status["eager op call (64/4 B=1, CPU issue, GPU held busy)"]["status"] == targets.MET
    for r in baseline["per_layer"]:
        r["marginal_us"] = 100.0
    for r in result["per_layer"]:
        r["marginal_us"] = 105.0  # exactly REGRESSION_SLACK x the baseline
    assert 105.0 / 100.0 == report.REGRESSION_SLACK
    every = "every point: no regression (acceptance: none slower than the previous file)"
    assert _by_target(result, baseline)[every]["status"] == targets.MET
    assert not [x for x in report.regressions(result, baseline) if x.startswith("layer")]


def test_a_baseline_row_without_a_time_is_not_compared():
    result = _grid_result()
    baseline = json.loads(json.dumps(result))
    baseline["per_layer"][0]["marginal_us"] = 0.0
    baseline["per_layer"][1]["marginal_us"] = None
    keys = {c["key"] for c in report.compare_with_baseline(result, baseline) if c["kind"] == "layer"}
    assert report.layer_key(result["per_layer"][0])[1:] not in keys
    assert report.layer_key(result["per_layer"][1])[1:] not in keys
    assert report.layer_key(result["per_layer"][2])[1:] in keys


def test_a_shared_block_rows_pct_of_copy_is_on_distinct_bytes(monkeypatch):
    _FakeGpu(monkeypatch)
    row, _ = bench.measure_row(bench.RowSpec("16/1", 1, 4, 12, FP8_KV, False), 4.0e12, iters=3, num_layers=2)
    assert row["kv_bytes"] < row["logical_bytes"]
    seconds = row["marginal_us"] * 1e-6
    assert row["marginal_pct_of_copy"] == round(100 * row["kv_bytes"] / seconds / 4.0e12, 1)
    assert row["marginal_logical_pct_of_copy"] == round(100 * row["logical_bytes"] / seconds / 4.0e12, 1)
    assert row["marginal_pct_of_copy"] < row["marginal_logical_pct_of_copy"]
