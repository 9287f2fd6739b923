"""bench/plan_ab.py without a GPU: the points it takes from a bench result, the plans it enumerates (only
valid ones, the planner's own choice among them), `--list` and its artifact check, the result JSON
with the GPU replaced by a fake runner, and its deadline; for the fp8 and the NVFP4 cache."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from msa_jit.geometry import check_config
from msa_jit.jit import registry
from msa_jit.plan import LaunchChoice

ROOT = Path(__file__).resolve().parents[1]
H100 = ROOT / "bench" / "results" / "h100.json"
FP8, NVFP4 = "float8_e4m3fn", "nvfp4"
SOURCE_KEYS = ("marginal_us", "flashinfer_marginal_us", "speedup_vs_flashinfer", "kernel", "ctas_per_sm", "num_splits",
               "split_merge")


@pytest.fixture(scope="module")
def pa():
    spec = importlib.util.spec_from_file_location("plan_ab", ROOT / "bench" / "plan_ab.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["plan_ab"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_points_parse_and_bad_ones_say_the_form(pa):
    p = pa.Point.parse("64/4:B4:q1")
    assert (p.geometry, p.batch, p.qlen, p.shared_blocks, p.label) == ("64/4", 4, 1, 0, "64/4:B4:q1")
    assert pa.Point.parse("8/1:b2:Q8:SH12") == pa.Point("8/1", 2, 8, 12)
    assert pa.Point.parse(pa.Point("8/1", 2, 8, 12).label) == pa.Point("8/1", 2, 8, 12)
    for bad in ("64/4:B4", "12/3:B4:q1", "64/4:B0:q1", "64/4:B4:q33", "64/4:B4:q1:x3", "64/4:B4:B8:q1", "64/4:Bx:q1"):
        with pytest.raises(ValueError, match="point"):
            pa.Point.parse(bad)


def test_default_points_are_the_h100_rows_flashinfer_wins_worst_first(pa):
    result = json.loads(H100.read_text())
    rows = pa.losing_rows(result)
    assert len(rows) == sum(r.get("speedup_vs_flashinfer", 2) < 1 for r in result["per_layer"]) > 0
    assert {r.get("kv_dtype", FP8) for r in rows} == {FP8}
    assert [r["speedup_vs_flashinfer"] for r in rows] == sorted(r["speedup_vs_flashinfer"] for r in rows)
    points, sources, grid = pa.select_points(pa.parse_args([]))
    assert len(points) == len(rows) and points[0] == pa.point_of(rows[0])
    assert grid["layers"] == 4 and grid["iters"] == 20
    assert sources[points[0]] == {k: rows[0][k] for k in SOURCE_KEYS} and sources[points[0]]["flashinfer_marginal_us"]
    given, sources, _ = pa.select_points(pa.parse_args(["--points", "64/4:B4:q1,64/4:B4:q1,8/1:B1:q1"]))
    assert given == [pa.Point("64/4", 4, 1), pa.Point("8/1", 1, 1)] and set(sources) == set(given)


def test_plans_are_valid_builds_and_include_the_planners_choice(pa):
    points, _, _ = pa.select_points(pa.parse_args([]))
    for p in points:
        plans = pa.enumerate_plans(p)
        assert len(plans) == len(set(plans)) == 25  # token: 5 splits x (C2, C3, C2 cluster); union: 2 x 5
        assert all(check_config(pa.config_of(p, c, "sm_90a")) is None for c in plans)
        assert pa.planner_choice(p) in plans, p.label
    plans = pa.enumerate_plans(pa.Point("64/4", 4, 1))
    assert {c.split_merge for c in plans if c.ctas_per_sm == 3} == {"kernel"}  # the cluster build is 2 per SM only
    assert {c.kernel for c in plans if c.split_merge == "cluster"} == {"token"}
    assert sorted({c.num_splits for c in plans}) == [1, 2, 4, 8, 16]
    assert LaunchChoice("union", 1, 16, "kernel") in plans and LaunchChoice("token", 2, 1, "cluster") in plans
    # where the cluster build and the union kernel do not exist, the merge kernel's token plans only
    sm100 = pa.enumerate_plans(pa.Point("64/4", 4, 1), arch="sm_100a")
    assert {(c.kernel, c.split_merge) for c in sm100} == {("token", "kernel")} and len(sm100) == 10
    assert pa.enumerate_plans(pa.Point("8/1", 2, 8), splits=(2, 32), kernels=("token",)) == [
        LaunchChoice("token", 2, 2, "kernel"), LaunchChoice("token", 2, 2, "cluster"), LaunchChoice("token", 3, 2, "kernel")]


def test_list_names_every_plan_and_its_artifact_and_fails_on_a_missing_one(pa, tmp_path, capsys, monkeypatch):
    argv = ["--list", "--points", "64/4:B4:q1,16/1:B4:q8", "--cache-dir", str(tmp_path / "empty")]
    assert pa.main(argv) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    src = pa.select_points(pa.parse_args(argv))[1][pa.Point("64/4", 4, 1)]
    assert lines[0].startswith(f"64/4:B4:q1  T*Hkv=16  source: msa-jit {src['marginal_us']} us, flashinfer "
                               f"{src['flashinfer_marginal_us']} us, x{src['speedup_vs_flashinfer']}")
    assert lines[1].split()[:3] == ["planner", "=", "token/C2/S4/cluster"] and "token_dims" in lines[1]
    assert sum(line.startswith("  ") and " key " in line for line in lines) == 50  # 25 a point: the planner and 24
    assert "token/C2/S4/cluster " not in "\n".join(lines[2:26])  # the planner's own is listed once
    assert "MISSING" in out and "50 plans at 2 points need 10 artifacts: 10 missing" in out
    assert "warm_device_cache.py" in out
    monkeypatch.setattr(pa, "_cached", lambda cfg, cache: (f"{abs(hash(cfg)):012x}", True))
    assert pa.main(argv) == 0
    assert "need 10 artifacts: all in" in capsys.readouterr().out


def _source(tmp_path) -> Path:
    """A bench result of both caches: an NVFP4 row has FlashInfer's fp8 time over its own
    (speedup_vs_flashinfer_fp8), no speedup_vs_flashinfer."""
    def row(point, kv, **fields):
        geometry, b, q = point
        return {"geometry": geometry, "batch": b, "qlen": q, "shared_blocks": 0, "q_dtype": "bfloat16", "kv_dtype": kv,
                "layers": 4, "kernel": "token", "ctas_per_sm": 2, "num_splits": 4, "split_merge": "kernel", **fields}

    per_layer = [
        row(("64/4", 4, 1), FP8, marginal_us=9.0, flashinfer_marginal_us=9.5, speedup_vs_flashinfer=1.056),
        row(("64/4", 4, 1), NVFP4, marginal_us=8.0, flashinfer_skipped="no NVFP4 cache on its SM90 route",
            speedup_vs_fp8=1.125, speedup_vs_flashinfer_fp8=1.188, ctas_per_sm=3, num_splits=16),
        row(("16/1", 4, 8), FP8, marginal_us=12.1, flashinfer_marginal_us=10.9, speedup_vs_flashinfer=0.9),
        row(("16/1", 4, 8), NVFP4, marginal_us=11.47, speedup_vs_fp8=1.055, speedup_vs_flashinfer_fp8=0.95),
        row(("8/1", 1, 1), NVFP4, marginal_us=5.0, speedup_vs_flashinfer_fp8=1.4),  # at the target
        row(("64/4", 1, 1), NVFP4, marginal_us=5.0),  # FlashInfer's fp8 failed there: no figure
        {**row(("32/2", 4, 1), NVFP4, marginal_us=9.0, speedup_vs_flashinfer_fp8=0.5), "q_dtype": "float8_e4m3fn"},
    ]
    path = tmp_path / "source.json"
    path.write_text(json.dumps({"grid": {"layers": 4, "iters": 20}, "per_layer": per_layer}))
    return path


def test_nvfp4_points_are_the_nvfp4_rows_below_their_fp8_flashinfer_figure(pa, tmp_path):
    result = json.loads(_source(tmp_path).read_text())
    assert [pa.point_of(r).label for r in pa.losing_rows(result)] == ["16/1:B4:q8"]  # fp8 rows only
    below_1 = pa.losing_rows(result, kv_dtype=NVFP4)
    assert [(pa.point_of(r).label, r["kv_dtype"]) for r in below_1] == [("16/1:B4:q8", NVFP4)]
    target = pa.losing_rows(result, 1.3, NVFP4)  # short of 1.3x FlashInfer's fp8, worst first
    assert [pa.point_of(r).label for r in target] == ["16/1:B4:q8", "64/4:B4:q1"]
    assert {r["kv_dtype"] for r in target} == {NVFP4}
    points, sources, _ = pa.select_points(pa.parse_args(["--from", str(tmp_path / "source.json"), "--kv-dtype", "nvfp4",
                                                         "--below", "1.3"]))
    assert points == [pa.Point("16/1", 4, 8), pa.Point("64/4", 4, 1)]
    # the NVFP4 row's own figures; FlashInfer's are its fp8 cache's (time from the point's fp8 row)
    assert sources[pa.Point("64/4", 4, 1)] == {"marginal_us": 8.0, "flashinfer_marginal_us": 9.5,
                                               "speedup_vs_flashinfer": 1.188, "kernel": "token", "ctas_per_sm": 3,
                                               "num_splits": 16, "split_merge": "kernel", "speedup_vs_fp8": 1.125}
    fp8_points, fp8_sources, _ = pa.select_points(pa.parse_args(["--from", str(tmp_path / "source.json")]))
    assert fp8_points == [pa.Point("16/1", 4, 8)] and fp8_sources[fp8_points[0]]["marginal_us"] == 12.1
    assert pa.parse_args([]).kv_dtype == FP8 and pa.parse_args(["--kv-dtype", "nvfp4"]).kv_dtype == NVFP4
    with pytest.raises(SystemExit):
        pa.parse_args(["--kv-dtype", "bf16"])
    # the H100 result's NVFP4 rows, if it has them
    h100 = json.loads(H100.read_text())
    rows = pa.losing_rows(h100, 1.3, NVFP4)
    assert {r["kv_dtype"] for r in rows} <= {NVFP4}
    assert len(rows) == sum(r.get("kv_dtype") == NVFP4 and r.get("speedup_vs_flashinfer_fp8", 2) < 1.3
                            for r in h100["per_layer"])


def test_nvfp4_plans_are_the_token_kernels_and_include_the_planners_choice(pa):
    for p in [pa.Point(g, b, q) for g in pa.GEOMETRIES for b in (1, 4, 16, 64) for q in (1, 8)]:
        plans = pa.enumerate_plans(p, kv_dtype=NVFP4)
        # no union kernel (it reads no NVFP4 cache): 5 splits x (C2, C3, C2 cluster)
        assert len(plans) == len(set(plans)) == 15 and {c.kernel for c in plans} == {"token"}, p.label
        assert all(pa.config_of(p, c, "sm_90a", NVFP4).kv_dtype == NVFP4 for c in plans)
        assert all(check_config(pa.config_of(p, c, "sm_90a", NVFP4)) is None for c in plans)
        assert pa.planner_choice(p, kv_dtype=NVFP4) in plans, p.label
    plans = pa.enumerate_plans(pa.Point("64/4", 4, 1), kv_dtype=NVFP4)
    assert {(c.ctas_per_sm, c.split_merge) for c in plans} == {(2, "kernel"), (3, "kernel"), (2, "cluster")}
    assert sorted({c.num_splits for c in plans}) == [1, 2, 4, 8, 16]
    # the NVFP4 cluster build is the token kernel's own, not the fp8 cache's dims-split one
    cluster = LaunchChoice("token", 2, 8, "cluster")
    assert registry.kernel_family(pa.config_of(pa.Point("64/4", 4, 1), cluster, "sm_90a", NVFP4)) == "token"
    assert registry.kernel_family(pa.config_of(pa.Point("64/4", 4, 1), cluster, "sm_90a")) == "token_dims"
    sm100 = pa.enumerate_plans(pa.Point("64/4", 4, 1), arch="sm_100a", kv_dtype=NVFP4)
    assert {(c.kernel, c.split_merge) for c in sm100} == {("token", "kernel")} and len(sm100) == 10


def test_nvfp4_planner_choice_is_the_planners_nvfp4_launch(pa):
    import torch

    from msa_jit import SparseDecodePlanner

    differs = 0
    for label in ("64/4:B4:q1", "16/1:B16:q2", "8/1:B4:q8", "32/2:B64:q1", "64/4:B1:q1"):
        p = pa.Point.parse(label)
        hq, hkv = pa.GEOMETRIES[p.geometry]
        plan = SparseDecodePlanner(num_sms=132, arch="sm_90a").prepare(
            torch.zeros(p.batch, 128, dtype=torch.int32), torch.full((p.batch,), 16384, dtype=torch.int32), None,
            p.qlen, num_q_heads=hq, num_kv_heads=hkv, page_size=128, topk_blocks=16)
        assert pa.planner_choice(p, kv_dtype=NVFP4) == plan.launch(NVFP4), label
        assert pa.planner_choice(p) == plan.launch(FP8), label
        differs += plan.launch(NVFP4) != plan.launch(FP8)
    assert differs  # e.g. 64/4 B=4 q1: fp8 token/C2/S4/cluster, NVFP4 token/C3/S16/kernel


def test_nvfp4_list_names_the_token_builds_of_the_nvfp4_cache(pa, tmp_path, capsys, monkeypatch):
    argv = ["--list", "--kv-dtype", "nvfp4", "--from", str(_source(tmp_path)), "--below", "1.3",
            "--cache-dir", str(tmp_path / "empty")]
    assert pa.main(argv) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "16/1:B4:q8  T*Hkv=32  source: msa-jit 11.47 us, flashinfer fp8 10.9 us, x0.95"
    assert lines[16].startswith("64/4:B4:q1  T*Hkv=16  source: msa-jit 8.0 us, flashinfer fp8 9.5 us, x1.188")
    assert lines[17].split()[:3] == ["planner", "=", "token/C3/S16/kernel"]
    assert sum(line.startswith("  ") and " key " in line for line in lines) == 30  # 15 a point
    assert "union" not in out and "token_dims" not in out
    assert "30 plans at 2 points need 6 artifacts: 6 missing" in out
    assert all("nvfp4" in line for line in lines if line.startswith("  missing: "))
    monkeypatch.setattr(pa, "_cached", lambda cfg, cache: (f"{abs(hash(cfg)):012x}", True))
    assert pa.main(argv) == 0


class FakeRunner:
    """The GPU replaced: each plan's per-layer time a function of its launch; union C1 has no artifact,
    and 8 splits merged in the cluster give a wrong output; FlashInfer skips an NVFP4 cache."""

    arch = "sm_90a"

    def __init__(self, pa, clock=None, kv_dtype=FP8):
        self.pa, self.clock, self.calls, self.kv_dtype = pa, clock, [], kv_dtype

    def peers(self):
        return {"flashinfer": {"available": True, "reason": None, "version": "0.7.4"}}

    def setup(self, point):
        return point

    def time_plan(self, point, launch):
        c = launch or self.pa.planner_choice(point, kv_dtype=self.kv_dtype)
        self.calls.append((point.label, self.pa.plan_name(launch)))
        if self.clock:
            self.clock.t += 1.0
        if c.kernel == "union" and c.ctas_per_sm == 1:
            raise RuntimeError("ArtifactMissingError: no artifact")
        if launch is not None and (c.num_splits, c.split_merge) == (8, "cluster"):
            return {"ran": asdict(c), "all_rows_written": True, "ref_rel_l2": 0.5, "error": "wrong output"}
        us = 10.0 + abs(c.num_splits - 2) * 0.25 + (c.ctas_per_sm == 3) * 0.1 + (c.kernel == "union") * 1.0
        if launch is None:
            us += 0.2 * sum(1 for _, name in self.calls if name == "planner") - 0.2  # the repeat: 0.2 us slower
        return {"ran": asdict(c), "all_rows_written": True, "ref_rel_l2": 1e-3, "one_layer_us": us + 4,
                "marginal_us": round(us, 2)}

    def flashinfer(self, point, planner_row):
        if self.kv_dtype != FP8:
            return {"skipped": "no nvfp4 cache on FlashInfer's SM90 route"}
        return {"marginal_us": 10.3, "one_layer_us": 14.0, "rel_l2": 1e-3, "agrees": True}

    def teardown(self, point):
        pass


def test_result_json_per_point_and_best_plan(pa, tmp_path):
    points = [pa.Point("64/4", 4, 1), pa.Point("16/1", 4, 8)]
    path = tmp_path / "plan_ab.json"
    result = pa.run_points(points, FakeRunner(pa), plans_of=pa.enumerate_plans, sources={points[0]: {"marginal_us": 9.5}},
                           clock=pa.Clock(None), header={"environment": {"device": "fake"}, "settings": {}},
                           json_path=str(path), log=lambda _: None)
    assert json.loads(path.read_text()) == result and "incomplete" not in result
    assert set(result) == {"environment", "settings", "peers", "points", "summary", "wall_s"}
    e = result["points"][0]
    assert {"point", "geometry", "batch", "qlen", "shared_blocks", "q_dtype", "kv_dtype", "source", "flashinfer",
            "plans", "best", "planner_speedup_vs_flashinfer", "complete"} <= set(e)
    assert e["complete"] and e["source"] == {"marginal_us": 9.5} and e["flashinfer"]["marginal_us"] == 10.3
    own = e["plans"][0]
    # the planner (64/4 B=4 q1: 4 splits in the cluster) timed first and last: their mean and spread
    assert own["name"] == "planner" and own["ran"] == asdict(LaunchChoice("token", 2, 4, "cluster"))
    assert own["runs"] == [10.5, 10.7] and own["marginal_us"] == 10.6 and own["spread_pct"] == pytest.approx(1.89, abs=0.01)
    assert own["speedup_vs_flashinfer"] == round(10.3 / 10.6, 3) and own["gain_vs_planner"] == 1.0
    names = [p["name"] for p in e["plans"]]
    assert len(names) == 25 and "token/C2/S4/cluster" not in names  # the planner's own launch is not timed twice
    failed = {p["name"]: p["error"] for p in e["plans"] if "error" in p}
    # the union's 1-CTA build missing, and the fake's 8 splits in the cluster (not the planner's plan here)
    assert set(failed) == {f"union/C1/S{s}/kernel" for s in (1, 2, 4, 8, 16)} | {"token/C2/S8/cluster"}
    best = e["best"]
    assert best["name"] == "token/C2/S2/kernel" and best["marginal_us"] == 10.0
    assert best["speedup_vs_flashinfer"] == 1.03 and best["gain_vs_planner"] == 1.06
    e2 = result["points"][1]
    # 16/1 B=4 q8 the planner runs in 4 splits; 8 in the cluster gave a wrong output: never the best
    assert "token/C2/S8/cluster" in {p["name"] for p in e2["plans"] if "error" in p}
    s = result["summary"]
    assert s["points_done"] == s["points_complete"] == 2 and s["closed"] == ["64/4:B4:q1", "16/1:B4:q8"]
    assert s["best_plans"] == {"64/4:B4:q1": "token/C2/S2/kernel", "16/1:B4:q8": "token/C2/S2/kernel"}
    text = pa.table(result)
    assert "64/4:B4:q1" in text and "token/C2/S2/kernel" in text and "closed at 2 of 2 points" in text


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_deadline_keeps_what_was_done(pa, tmp_path):
    """Every fake plan costs 1 s: a 20 s deadline stops inside the first point, which is kept (partial)."""
    now = FakeClock()
    clock = pa.Clock(20.0, now=now)
    runner = FakeRunner(pa, clock=now)
    points = [pa.Point("64/4", 4, 1), pa.Point("32/2", 8, 1)]
    result = pa.run_points(points, runner, plans_of=pa.enumerate_plans, sources={}, clock=clock, header={},
                           json_path=str(tmp_path / "r.json"), log=lambda _: None)
    assert result["incomplete"] and len(result["points"]) == 1
    e = result["points"][0]
    assert not e["complete"] and e["best"] and len(e["plans"]) < 25
    assert now.t <= 20.0 and result["summary"]["points_complete"] == 0
    assert "(partial)" in pa.table(result) and "INCOMPLETE" in pa.table(result)
    assert json.loads((tmp_path / "r.json").read_text())["incomplete"]


def test_a_point_whose_steps_fail_is_recorded_and_the_next_runs(pa):
    class Broken(FakeRunner):
        def setup(self, point):
            if point.batch == 4:
                raise RuntimeError("CUDA out of memory")
            return point

    result = pa.run_points([pa.Point("64/4", 4, 1), pa.Point("8/1", 2, 8)], Broken(pa), plans_of=pa.enumerate_plans,
                           sources={}, clock=pa.Clock(None), header={}, json_path=None, log=lambda _: None)
    assert "out of memory" in result["points"][0]["error"] and result["points"][1]["complete"]
    assert result["summary"]["points_done"] == 1 and "FAILED" in pa.table(result)


def test_gpu_runner_checks_each_plan_on_a_poisoned_output_before_timing(pa, monkeypatch):
    """GpuRunner's plumbing on CPU tensors (the op's reference backend; the graph timing replaced): a
    pinned plan runs as pinned, its figure is (t(L) - t(1)) / (L - 1), and an output that is wrong or
    left unwritten is an error and never timed."""
    from msa_jit.tools.bench import measure, steps

    runner = object.__new__(pa.GpuRunner)
    runner.device, runner.layers, runner.iters, runner.ref_requests, runner.fi = "cpu", 3, 5, 2, None
    timed = []

    def layer_times(planner, steps_, hq, hkv, qlen, layer, num_layers, iters):
        timed.append((planner.launches, len(steps_), num_layers, iters))
        return [10.0] * iters, 30.0

    monkeypatch.setattr(measure, "layer_times", layer_times)
    ctx = runner.setup(pa.Point("8/1", 3, 2))
    assert len(ctx.steps) == 3 and ctx.ref_rows == 4 and tuple(ctx.ref.shape) == (4, 8, 128)
    pin = LaunchChoice("union", 1, 4, "kernel")
    row = runner.time_plan(ctx, pin)
    assert row["ran"] == asdict(pin) and row["all_rows_written"] and row["ref_rel_l2"] < 1e-2
    assert (row["one_layer_us"], row["marginal_us"]) == (10.0, 10.0)
    assert timed == [({"float8_e4m3fn": pin}, 3, 3, 5)] and ctx.planner_plan is None
    own = runner.time_plan(ctx, None)
    assert own["ran"] == asdict(ctx.planner_plan.launch()) and "error" not in own
    assert runner.flashinfer(ctx, own) == {"skipped": "--no-flashinfer"}
    decode = steps.decode
    monkeypatch.setattr(steps, "decode", lambda step, plan: (decode(step, plan), step["out"].mul_(2)))
    row = runner.time_plan(ctx, LaunchChoice("token", 2, 2, "cluster"))
    assert row["error"].startswith("wrong output: rel L2") and "marginal_us" not in row
    monkeypatch.setattr(steps, "decode", lambda step, plan: step["out"][:1].zero_())
    row = runner.time_plan(ctx, LaunchChoice("token", 2, 2, "kernel"))
    assert row["error"] == "wrong output: rows left unwritten (NaN)" and not row["all_rows_written"]
    assert len(timed) == 2
    runner.teardown(ctx)
    assert ctx.steps == []


def test_nvfp4_result_json_without_flashinfer(pa, tmp_path, monkeypatch, capsys):
    """An NVFP4 run: FlashInfer skipped at every point, so no speed-up over it anywhere; the best plan
    and its gain over the planner still come out, and the table and summary say so."""
    points = [pa.Point("64/4", 4, 1), pa.Point("16/1", 4, 8)]
    path = tmp_path / "plan_ab.json"
    result = pa.run_points(points, FakeRunner(pa, kv_dtype=NVFP4),
                           plans_of=lambda p: pa.enumerate_plans(p, kv_dtype=NVFP4), sources={}, clock=pa.Clock(None),
                           header={}, json_path=str(path), log=lambda _: None)
    assert json.loads(path.read_text()) == result and "incomplete" not in result
    e = result["points"][0]
    assert e["kv_dtype"] == NVFP4 and e["complete"] and e["flashinfer"] == {
        "skipped": "no nvfp4 cache on FlashInfer's SM90 route"}
    own = e["plans"][0]
    # 64/4 B=4 q1: the planner's NVFP4 launch (16 splits, 3 per SM), timed first and last
    assert own["ran"] == asdict(LaunchChoice("token", 3, 16, "kernel")) and own["runs"] == [13.6, 13.8]
    assert len(e["plans"]) == 15 and {p["name"].split("/")[0] for p in e["plans"][1:]} == {"token"}
    assert all(p["speedup_vs_flashinfer"] is None for p in e["plans"]) and e["planner_speedup_vs_flashinfer"] is None
    assert e["best"]["name"] == "token/C2/S2/kernel" and e["best"]["gain_vs_planner"] == 1.37
    assert e["best"]["speedup_vs_flashinfer"] is None
    s = result["summary"]
    assert s["geomean_planner_speedup_vs_flashinfer"] is None and s["geomean_best_speedup_vs_flashinfer"] is None
    assert s["closed"] == [] and s["points_done"] == 2 and s["geomean_best_gain_vs_planner"] > 1
    text = pa.table(result)
    assert "token/C2/S2/kernel" in text and "closed at 0 of 2 points" in text and "xNone" not in text
    assert "FlashInfer skipped: no nvfp4 cache on FlashInfer's SM90 route" in text

    class Broken(FakeRunner):
        def setup(self, point):
            raise RuntimeError("CUDA out of memory")

    failed = pa.run_points(points[:1], Broken(pa, kv_dtype=NVFP4), plans_of=lambda p: [], sources={},
                           clock=pa.Clock(None), header={}, json_path=None, log=lambda _: None)
    assert failed["points"][0]["kv_dtype"] == NVFP4 and "FAILED" in pa.table(failed)

    # main: the runner gets the cache, the settings record it
    made = []
    monkeypatch.setattr(pa, "GpuRunner", lambda **kw: made.append(kw) or FakeRunner(pa, kv_dtype=kw["kv_dtype"]))
    out = tmp_path / "main.json"
    assert pa.main(["--kv-dtype", "nvfp4", "--points", "64/4:B4:q1", "--kernels", "token", "--splits", "2,16",
                    "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    assert made[0]["kv_dtype"] == NVFP4 and written["settings"]["kv_dtype"] == NVFP4
    assert [p["kv_dtype"] for p in written["points"]] == [NVFP4] and len(written["points"][0]["plans"]) == 6
    assert "FlashInfer skipped" in capsys.readouterr().out


def test_gpu_runner_times_the_nvfp4_cache_and_skips_flashinfer(pa, monkeypatch):
    """GpuRunner's plumbing for the NVFP4 cache on CPU tensors: NVFP4 steps, a pin of the NVFP4 launch
    run as pinned and checked against the reference, the planner's NVFP4 launch recorded, FlashInfer
    skipped with the reason."""
    from msa_jit.tools.bench import measure

    runner = object.__new__(pa.GpuRunner)
    runner.device, runner.layers, runner.iters, runner.ref_requests = "cpu", 3, 5, 2
    runner.kv_dtype, runner.fi = NVFP4, object()  # FlashInfer is not even asked
    timed = []

    def layer_times(planner, steps_, hq, hkv, qlen, layer, num_layers, iters):
        timed.append(planner.launches)
        return [10.0] * iters, 30.0

    monkeypatch.setattr(measure, "layer_times", layer_times)
    ctx = runner.setup(pa.Point("8/1", 3, 2))
    step = ctx.steps[0]
    assert step["kv_dtype"] == NVFP4 and str(step["kv_cache"].dtype) == "torch.uint8"
    assert step["kv_cache"].shape[-1] == 72  # NVFP4's [P, 2*Hkv, page, 72] layout
    pin = LaunchChoice("token", 3, 4, "kernel")
    row = runner.time_plan(ctx, pin)
    assert row["ran"] == asdict(pin) and row["all_rows_written"] and row["ref_rel_l2"] < 1e-2
    assert row["marginal_us"] == 10.0 and timed == [{NVFP4: pin}]
    own = runner.time_plan(ctx, None)
    assert own["ran"] == asdict(ctx.planner_plan.launch(NVFP4)) and "error" not in own
    assert runner.flashinfer(ctx, own)["skipped"].startswith("no nvfp4 cache on FlashInfer's SM90 route")
    runner.teardown(ctx)
