"""The bench's bookkeeping (no GPU): regression check, baseline choice, the plot."""

import json

from msa_jit import bench


def _result(date, us, copy=4.2):
    points = [dict(geometry="64/4", q_dtype="bfloat16", batch=b, qlen=1, shared_blocks=0, num_splits=1,
                   us=t, us_p10=t, us_p90=t, kv_bytes=1 << 20, logical_bytes=1 << 20, tbps=1.0,
                   logical_tbps=1.0, pct_of_copy=25.0) for b, t in zip((1, 64), us)]
    return {"environment": {"device": "test", "date": date}, "copy_tbps": copy, "points": points}


def test_regressions_flags_only_points_slower_than_the_slack():
    old = _result("2026-01-01T00:00:00", [10.0, 100.0])
    new = _result("2026-01-02T00:00:00", [10.4, 120.0])
    out = bench.regressions(new, old)
    assert len(out) == 1 and "120.0" in out[0]
    assert bench.regressions(old, old) == []


def test_latest_result_picks_the_newest_recorded_date(tmp_path):
    for name, date in (("bench-a.json", "2026-01-03T00:00:00"), ("bench-b.json", "2026-01-01T00:00:00")):
        (tmp_path / name).write_text(json.dumps(_result(date, [1.0, 2.0])))
    (tmp_path / "bench-broken.json").write_text("{")
    assert bench.latest_result(tmp_path).name == "bench-a.json"
    assert bench.latest_result(tmp_path / "missing") is None


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "p.png"
    bench.plot(_result("2026-01-01T00:00:00", [10.0, 100.0]), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_per_call_us_syncs_where_asked(monkeypatch):
    events = []
    monkeypatch.setattr(bench, "_sync", lambda: events.append("sync"))
    call = lambda: events.append("call")  # noqa: E731
    for sync, want in (("none", ["call", "sync", "call", "call"]),
                       ("each", ["call", "sync", "call", "sync", "call", "sync"]),
                       ("end", ["call", "sync", "call", "call", "sync"])):
        events.clear()
        assert bench.per_call_us(call, 2, warmup=1, sync=sync) >= 0
        assert events == want, sync
