"""bench/peer_report.py: its summary of a peer bench result says what the rows say."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("peer_report", ROOT / "bench" / "peer_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(geo, batch, qlen, us, fi_us=None, *, kv="float8_e4m3fn", splits=1, merge="none", kernel="token",
         shared=0, pct=50.0):
    row = {"geometry": geo, "batch": batch, "qlen": qlen, "shared_blocks": shared, "q_dtype": "bfloat16",
           "kv_dtype": kv, "kernel": kernel, "num_splits": splits, "split_merge": merge, "marginal_us": us,
           "marginal_pct_of_copy": pct, "kv_bytes": 4 << 20, "msa_call_cpu_us": 8.0}
    if fi_us is not None:
        row.update(flashinfer_marginal_us=fi_us, speedup_vs_flashinfer=round(fi_us / us, 3),
                   flashinfer_call_cpu_us=36.0)
    return row


RESULT = {
    "environment": {"device": "test GPU", "date": "d", "command": "c"},
    "copy_tbps": 3.0,
    "read_2g": {"tbps": 3.0},
    "per_layer": [
        _row("64/4", 1, 1, 5.0, 7.0, splits=16, merge="cluster"),
        _row("64/4", 4, 1, 10.0, 9.0, splits=4, merge="cluster"),
        _row("64/4", 64, 1, 50.0, 50.0),
        _row("64/4", 64, 4, 60.0, 90.0, kernel="union", shared=12),
        _row("64/4", 64, 1, 40.0, kv="nvfp4"),
        _row("64/4", 4, 1, 10.0, kv="nvfp4"),  # below the bandwidth end: not in the NVFP4 line
    ],
}


def test_plan_table_groups_by_the_planners_choice(report):
    table = report.plan_table(RESULT).splitlines()
    assert table[2:] == ["| one split (token kernel) | 1 | 1.000 (1.000-1.000) | 0 |",
                         "| 16 splits, cluster merge | 1 | 1.400 (1.400-1.400) | 0 |",
                         "| 4 splits, cluster merge | 1 | 0.900 (0.900-0.900) | 1 |"]


def test_grid_table_groups_by_the_grid_and_its_plan(report):
    result = {**RESULT, "per_layer": RESULT["per_layer"] + [
        _row("16/1", 16, 1, 9.5, 9.0, splits=4, merge="cluster"),  # T·Hkv 16, like 64/4 B=4: one group
        _row("8/1", 64, 1, 30.0, 33.0, splits=1) | {"ctas_per_sm": 3},  # T·Hkv 64 at 3 per SM: its own
        _row("16/1", 64, 1, 33.0, 33.0, splits=1)]}  # the same T·Hkv at 2 per SM
    table = report.grid_table(result).splitlines()
    s16 = [0.9, 9.0 / 9.5]
    assert table[2:] == [
        "| 4 | 16 splits, cluster merge | 2 | 1 | 1.400 (1.400-1.400) | 0 |",
        f"| 16 | 4 splits, cluster merge | 2 | 2 | {math.sqrt(s16[0] * s16[1]):.3f} ({min(s16):.3f}-{max(s16):.3f}) | 2 |",
        "| 64 | one split (token kernel) | 2 | 1 | 1.000 (1.000-1.000) | 0 |",
        "| 64 | one split (token kernel) | 3 | 1 | 1.100 (1.100-1.100) | 0 |",
        "| 256 | one split (token kernel) | 2 | 1 | 1.000 (1.000-1.000) | 0 |",
    ]
    assert report.grid_table(result) in report.peer_report(result)


def test_nvfp4_grid_table_is_against_flashinfers_fp8_at_the_bandwidth_end(report):
    result = {**RESULT, "per_layer": RESULT["per_layer"] + [
        _row("16/1", 64, 1, 20.0, 30.0),  # FlashInfer's fp8 time at this point: 30 us
        _row("16/1", 64, 1, 25.0, kv="nvfp4", splits=4) | {"ctas_per_sm": 3},
        _row("16/1", 128, 1, 25.0, kv="nvfp4")]}  # no fp8 row beside it: left out
    table = report.nvfp4_grid_table(result).splitlines()
    assert table[0].endswith("| over FlashInfer's fp8, geomean (min-max) | below 1.3x |")
    # 16/1 B=64 (T·Hkv 64): 30 / 25; 64/4 B=64 (T·Hkv 256): 50 / 40; 64/4 B=4 is below the bandwidth end
    assert table[2:] == ["| 64 | 4 splits, merge kernel | 3 | 1 | 1.200 (1.200-1.200) | 1 |",
                         "| 256 | one split (token kernel) | 2 | 1 | 1.250 (1.250-1.250) | 1 |"]
    assert report.nvfp4_grid_table(result, target=1.21).splitlines()[-1].endswith("| 0 |")


def test_report_sections(report):
    text = report.peer_report(RESULT)
    gm = math.exp((math.log(1.4) + math.log(0.9) + math.log(1.0)) / 3)
    assert f"3 points, geomean {gm:.3f}x FlashInfer, least 0.900x (64/4 B=4 q1), slower at 1." in text
    # FlashInfer's bandwidth at B=64: 4 MiB in 50 µs over a 3 TB/s copy
    assert f"| 64/4 B=64 q1 | 50.0 | 50% | 50.0 | {100 * (4 << 20) / 50e-6 / 3e12:.0f}% |" in text
    assert "| 64/4 B=64 q4 sh12 | union kernel | 60.0 | 90.0 | 1.50x |" in text
    # NVFP4 beside FlashInfer's fp8 of the same point (B=64 only): 50 / 40
    assert "geomean 1.250x (1.250-1.250), 1 points" in text
    assert "msa-jit 8.0, FlashInfer 36.0" in text
    # the read ceiling's room over FlashInfer at B=1: 4 MiB read at 3 TB/s against FlashInfer's 7 µs
    assert f"| B=1 | {7e-6 * 3e12 / (4 << 20):.2f}x | {7e-6 * 3e12 / (4 << 20):.2f}x | 0 of 1 |" in text


def test_a_result_without_flashinfer_is_refused(report):
    with pytest.raises(SystemExit, match="--compare flashinfer"):
        report.peer_report({"per_layer": [_row("64/4", 1, 1, 5.0)]})
