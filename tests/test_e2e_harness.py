"""bench/e2e (MiniMax-M3 through msa-jit inside a real vLLM, on the GPU host) without vLLM or a GPU:
the tiny model's config, the mode table and the engine arguments it builds, the speed grid, the
child command lines, the result schema, the agreement figures, the profiler's kernel categories,
and device_run.sh's shape. The slow test runs the whole harness (parent, one child per mode, the
summary file) against a fake `vllm` (tests/e2e_fake_vllm) on the CPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
E2E = ROOT / "bench" / "e2e"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


plan = _load("e2e_plan", E2E / "e2e_plan.py")


# ----------------------------------------------------------------------------- the tiny model
def test_tiny_config_has_m3_attention_geometry_and_a_dense_first_layer():
    cfg = plan.load_config()
    assert plan.check_config(cfg) == []
    tc = plan.text_config(cfg)
    assert (tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]) == (64, 4, 128)
    sc = tc["sparse_attention_config"]
    assert (sc["sparse_topk_blocks"], sc["sparse_block_size"]) == (16, 128)
    assert tc["num_hidden_layers"] == 8 and plan.dense_layers(cfg) == [0]  # as M3: leading dense layer(s)
    assert tc["num_mtp_modules"] == 1  # MTP speculative decoding needs the draft module


def test_check_config_names_each_departure():
    cfg = plan.load_config()
    bad = json.loads(json.dumps(cfg))
    tc = plan.text_config(bad)
    tc["num_key_value_heads"] = 8
    tc["sparse_attention_config"]["sparse_topk_blocks"] = 8
    tc["moe_layer_freq"] = [0, 1]
    bad["architectures"] = ["MiniMaxM3SparseForConditionalGeneration"]
    problems = plan.check_config(bad)
    for what in ("num_key_value_heads", "sparse_topk_blocks", "moe_layer_freq", "architectures"):
        assert any(what in p for p in problems), (what, problems)


def test_all_sparse_config_keeps_the_geometry_without_dense_layers():
    cfg = plan.load_config()
    allsparse = plan.all_sparse_config(cfg)
    assert plan.dense_layers(allsparse) == [] and plan.check_config(allsparse) == []
    assert plan.dense_layers(cfg) == [0]  # the original is untouched


# ----------------------------------------------------------------------------- modes and engine arguments
def test_mode_table_engine_arguments():
    cfg = plan.load_config()
    kw = {name: {g: plan.llm_kwargs(m, g, "/m", cfg) for g in plan.GRAPHS} for name, m in plan.MODES.items()}
    for name, by_graph in kw.items():
        for g, k in by_graph.items():
            json.dumps(k)  # recorded in the result
            assert k["model"] == "/m" and k["load_format"] == "dummy" and k["skip_tokenizer_init"]
            assert k["enforce_eager"] is (g == "eager")
            assert ("compilation_config" in k) is (g == "graph")
    # vLLM alone: the engine's default decode backend, no knob; the plugin switched off
    assert "attention_config" not in kw["triton_fp8"]["eager"] and kw["triton_fp8"]["eager"]["kv_cache_dtype"] == "fp8"
    assert plan.mode_env(plan.MODES["triton_fp8"]) == {"MSA_JIT_VLLM_PLUGIN": "0"}
    # the engine's own knob, passed as vLLM 0.33's AttentionConfig field
    assert kw["msa_fp8"]["eager"]["attention_config"] == {"minimax_m3_msa_decode_backend": "cutlass"}
    assert plan.mode_env(plan.MODES["msa_fp8"]) == {"MSA_JIT_VLLM_PLUGIN": "1"}
    # the engine-decode control: the plugin's path, the CUTLASS floor above every batch, no hook
    ctl = plan.MODES["msa_fp8_engine_triton"]
    assert plan.mode_env(ctl) == {"MSA_JIT_VLLM_PLUGIN": "1", "VLLM_MINIMAX_M3_MSA_CUTLASS_MIN_BATCH": "1000000"}
    assert not ctl.msa and int(dict(ctl.env)["VLLM_MINIMAX_M3_MSA_CUTLASS_MIN_BATCH"]) > plan.MAX_NUM_SEQS
    # NVFP4: no knob needed; the dense layer keeps a bf16 cache (vLLM's kv_cache_dtype_skip_layers)
    nv = kw["msa_nvfp4"]["eager"]
    assert nv["kv_cache_dtype"] == "nvfp4" and nv["kv_cache_dtype_skip_layers"] == ["0"] and "attention_config" not in nv
    assert "kv_cache_dtype_skip_layers" not in kw["msa_nvfp4_allsparse"]["eager"]
    assert plan.MODES["msa_nvfp4_allsparse"].fallback_for == "msa_nvfp4"
    # MTP: 3 draft tokens, verification steps of 4 query tokens; graphs captured up to 64 x 4 tokens
    mtp = kw["msa_mtp"]
    assert mtp["eager"]["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    assert mtp["graph"]["compilation_config"] == {"max_cudagraph_capture_size": 256}
    assert kw["msa_fp8"]["graph"]["compilation_config"] == {"max_cudagraph_capture_size": 64}
    assert [m.name for m in plan.MODES.values() if m.msa] == ["msa_fp8", "msa_nvfp4", "msa_nvfp4_allsparse", "msa_mtp"]
    with pytest.raises(ValueError, match="graphs"):
        plan.llm_kwargs(plan.MODES["msa_fp8"], "cuda", "/m", cfg)


def test_schedule_and_selection():
    modes = plan.selected_modes(None)
    assert [m.name for m in modes] == list(plan.DEFAULT_MODES)
    runs = plan.schedule(modes, ["eager", "graph"])
    names = [(m.name, g) for m, g in runs]
    assert names[:5] == [("triton_fp8", "eager"), ("msa_fp8", "eager"), ("msa_fp8_engine_triton", "eager"),
                         ("msa_nvfp4", "eager"), ("msa_mtp", "eager")]
    assert names[-2:] == [("msa_nvfp4_allsparse", "eager"), ("msa_nvfp4_allsparse", "graph")]  # fallbacks last
    with pytest.raises(ValueError, match="unknown mode"):
        plan.selected_modes(["msa_fp16"])


def test_child_command_line_round_trips():
    pts = [(1, 4096), (64, 8192)]
    argv = plan.child_argv("/py", "/s.py", plan.MODES["msa_mtp"], "graph", "/o.json", "/m", 123.4, pts,
                           profile=False)
    assert argv[:3] == ["/py", "/s.py", "child"]
    assert argv[argv.index("--mode") + 1] == "msa_mtp" and argv[argv.index("--graphs") + 1] == "graph"
    assert argv[argv.index("--deadline-s") + 1] == "123" and "--no-profile" in argv
    assert plan.parse_points(argv[argv.index("--points") + 1]) == pts and plan.parse_points("") == []
    argv = plan.child_argv("/py", "/s.py", plan.MODES["msa_fp8"], "graph", "/o.json", "/m", 60, pts,
                           profile_points=[(8, 16384), (1, 32768)])
    assert plan.parse_points(argv[argv.index("--profile-points") + 1]) == [(8, 16384), (1, 32768)]
    assert "--profile-points" not in plan.child_argv("/py", "/s.py", plan.MODES["msa_fp8"], "graph", "/o.json",
                                                     "/m", 60, pts)


# ----------------------------------------------------------------------------- speed grid and timing
def test_speed_grid_respects_the_engine_limits_and_runs_core_points_first():
    pts = plan.speed_points()
    assert pts[:len(plan.CORE_POINTS)] == list(plan.CORE_POINTS) and len(set(pts)) == len(pts)
    assert {b for b, _ in pts} == set(plan.SPEED_BATCHES) and {c for _, c in pts} == set(plan.SPEED_CONTEXTS)
    for b, c in pts:
        assert b * c <= plan.MAX_POINT_TOKENS and c + 64 <= plan.MAX_MODEL_LEN and b <= plan.MAX_NUM_SEQS
    assert plan.PROFILE_POINT in pts
    # every request still decodes after the last prefill chunk, for DECODE_STEPS steps (x 4 tokens with MTP)
    assert plan.point_max_tokens(64, 8192) == (32 + 1 + plan.DECODE_STEPS + 4)
    assert plan.point_max_tokens(1, 4096, spec_tokens=3) == 4 * (1 + 1 + plan.DECODE_STEPS + 4)


def test_decode_step_times_keep_only_steps_with_every_request_decoding():
    steps = [{"s": 1.0, "started": 0, "finished": 0}, {"s": 0.5, "started": 1, "finished": 0},
             {"s": 0.2, "started": 2, "finished": 0}, {"s": 0.01, "started": 2, "finished": 0},
             {"s": 0.02, "started": 2, "finished": 0}, {"s": 0.03, "started": 2, "finished": 1}]
    assert plan.decode_step_times(steps, 2) == [0.01, 0.02]
    s = plan.summarize_times([0.010, 0.012, 0.011, 0.050])
    assert s["n"] == 4 and s["median_ms"] == 11.5 and s["min_ms"] == 10.0 and s["p90_ms"] == 50.0
    assert plan.summarize_times([])["median_ms"] is None


def test_prompt_ids_are_deterministic_and_in_vocab():
    a = plan.prompt_ids([5, 3000], 4096)
    assert a == plan.prompt_ids([5, 3000], 4096) and a != plan.prompt_ids([5, 3000], 4096, seed=1)
    assert [len(x) for x in a] == [5, 3000] and all(1 <= t < 4095 for x in a for t in x)
    assert len(set(a[1])) > 2000  # not a short cycle


# ----------------------------------------------------------------------------- profiler and agreement
MSA_KERNEL = ("kernel_cutlass_kernel_msa_jitkernelstokenSparseDecodeMmaKernel_object_at__tensorptrbf16gmem"
              "align16o8128div161281")


def test_profile_summary_categories_and_shares():
    kernels = [(MSA_KERNEL, 0.002), ("kernel_cutlass_kernel_msa_jitkernelssplit_mergeSplitMergeKernel", 0.001),
               ("_decode_index_score_kernel", 0.003), ("flash_fwd_splitkv_kernel", 0.002),
               ("sm90_xmma_gemm_bf16bf16_bf16f32", 0.004), ("fused_moe_kernel", 0.004), ("elementwise", 0.004)]
    s = plan.profile_summary(kernels, steps=2, wall_s=0.05)
    cats = s["categories_ms_per_step"]
    assert cats["msa_decode"] == 1.5 and cats["indexer"] == 1.5 and cats["dense_attention"] == 1.0
    assert cats["gemm"] == 2.0 and cats["moe"] == 2.0 and cats["other"] == 2.0
    assert s["device_ms_per_step"] == 10.0 and s["wall_ms_per_step"] == 25.0
    assert s["sparse_decode_share_of_device"] == 0.15 and s["sparse_decode_share_of_wall"] == 0.06
    triton = plan.profile_summary([("_gqa_sparse_decode_kernel", 0.001), ("_merge_topk_attn_out_kernel", 0.001),
                                   ("x", 0.002)], steps=1, wall_s=0.01)
    assert triton["sparse_decode_share_of_device"] == 0.5


def _side(tokens, top):
    """A correctness output: tokens and, per step, [[token, logprob], ...] (`top` per step)."""
    return {"token_ids": tokens, "logprobs": top}


def test_compare_greedy_identical_near_tie_and_divergence():
    ref = _side([5, 6, 7], [[[5, -0.1], [9, -3.0]], [[6, -0.2], [8, -2.0]], [[7, -0.5], [4, -0.52]]])
    same = _side([5, 6, 7], [[[5, -0.11], [9, -3.0]], [[6, -0.19], [8, -2.0]], [[7, -0.5], [4, -0.52]]])
    c = plan.compare_greedy(ref, same)
    assert c["identical"] and c["agree_steps"] == 3 and c["divergence"] is None
    assert abs(c["max_abs_dlogprob"] - 0.01) < 1e-9
    tie = _side([5, 6, 4], [[[5, -0.11]], [[6, -0.19]], [[4, -0.5]]])
    c = plan.compare_greedy(ref, tie)  # the reference's gap between 7 and 4 is 0.02: a near-tie
    assert c["agree_steps"] == 2 and c["divergence"]["gap"] == pytest.approx(0.02) and c["divergence"]["near_tie"]
    far = _side([5, 8, 7], [[[5, -0.1]], [[8, -0.1]], [[7, -0.1]]])
    c = plan.compare_greedy(ref, far)  # 6 vs 8: a gap of 1.8 nats is no near-tie
    assert c["agree_steps"] == 1 and not c["divergence"]["near_tie"]
    c = plan.compare_greedy(ref, _side([5, 6, 7], None))  # no log-probs on the other side (e.g. MTP)
    assert c["identical"] and c["max_abs_dlogprob"] is None


def test_compare_runs_verdicts():
    def run(outputs):
        return {"correctness": {"prompt_lens": [3], "outputs": outputs}}

    ref = run([_side([5, 6, 7], [[[5, -0.1]], [[6, -0.2], [8, -2.0]], [[7, -0.5], [4, -0.52]]])])
    assert plan.compare_runs(ref, ref)["verdict"] == "identical"
    assert plan.compare_runs(ref, run([_side([5, 6, 4], None)]))["verdict"] == "agree_until_near_tie"
    assert plan.compare_runs(ref, run([_side([5, 8, 7], None)]))["verdict"] == "diverged"
    assert plan.compare_runs(ref, run([]))["verdict"] == "missing"
    assert plan.compare_runs(ref, None) is None
    close = run([_side([5, 6, 7], [[[5, -0.1]], [[6, -0.3], [8, -2.0]], [[7, -0.5], [4, -0.52]]])])
    c = plan.compare_runs(ref, close, (0.25, 0.05))
    assert c["within_tolerance"] and c["max_abs_dlogprob"] == pytest.approx(0.1)
    assert not plan.compare_runs(ref, close, (0.05, 0.05))["within_tolerance"]
    assert "within_tolerance" not in plan.compare_runs(ref, close)


# ----------------------------------------------------------------------------- results
def test_result_schema_and_summary():
    cfg = plan.load_config()
    m = plan.MODES["msa_fp8"]
    r = plan.new_mode_result(m, "eager", plan.llm_kwargs(m, "eager", "/m", cfg), {"MSA_JIT_NO_COMPILE": "1"})
    assert plan.check_mode_result(r) == []
    r["speed"].append({"batch": 1, "context": 4096, "ok": True, "step": {"median_ms": 3.0}, "tokens_per_step": 1.0})
    r["correctness"] = {"prompt_lens": [3], "outputs": [_side([1, 2], None)]}
    assert plan.check_mode_result(r) == []
    bad = dict(r, schema="other", graphs="cuda", ok=True, error="x")
    assert len(plan.check_mode_result(bad)) == 3
    t = plan.new_mode_result(plan.MODES["triton_fp8"], "eager", {}, {})
    t["correctness"] = r["correctness"]
    s = plan.summary({"msa_fp8-eager": r, "triton_fp8-eager": t}, {"date": "d", "command": "c"})
    assert s["schema"] == plan.SUMMARY_SCHEMA and s["date"] == "d"
    assert s["agreement"]["msa_fp8 vs triton_fp8 (eager)"]["verdict"] == "identical"
    assert s["speed_table"] == [{"mode": "msa_fp8", "graphs": "eager", "batch": 1, "context": 4096, "step_ms": 3.0,
                                 "tokens_per_step": 1.0, "ok": True}]
    json.dumps(s)


# ----------------------------------------------------------------------------- device_run.sh
def test_device_run_script_parses_and_sets_the_no_compile_host_up():
    script = (E2E / "device_run.sh").read_text()
    subprocess.run(["bash", "-n", str(E2E / "device_run.sh")], check=True)
    for needle in ("MSA_JIT_NO_COMPILE=1", "MSA_JIT_DSL_RUNTIME=", "MSA_JIT_DSL_VERSION", "VLLM_ENABLE_V1_MULTIPROCESSING=0",
                   "--no-deps --no-index --no-build-isolation", "--target \"$PLUG\"", ".e2e/a", ".e2e/b",
                   "bench/e2e/run_vllm_e2e.py run --out"):
        assert needle in script, needle
    subprocess.run(["bash", "-n", str(E2E / "prepare.sh")], check=True)


def test_device_run_status_reports_missing_pieces(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    p = subprocess.run(["bash", str(E2E / "device_run.sh"), "frobnicate"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "usage" in p.stderr


# ----------------------------------------------------------------------------- the whole harness, fake vLLM
@pytest.mark.slow
def test_harness_end_to_end_on_a_fake_vllm(tmp_path):
    """Parent -> one child per mode -> summary, against tests/e2e_fake_vllm: every phase runs and is
    recorded, the msa-jit modes' hook check compares the (CPU reference) decode with msa_jit.reference,
    a mode that fails keeps the others, and the summary holds agreement and speed figures."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "e2e_fake_vllm")]),
           "MSA_JIT_CACHE_DIR": str(tmp_path / "cache"), "MSA_JIT_NO_COMPILE": "1"}
    env.pop("TRITON_INTERPRET", None)
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(E2E / "run_vllm_e2e.py"), "run", "--out", str(out), "--work",
                        str(tmp_path / "work"), "--modes", "triton_fp8,msa_fp8,msa_nvfp4,msa_mtp",
                        "--points", "1x4096,32x8192", "--deadline-s", "300", "--min-run-s", "10", "--tag", "t"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads((out / "vllm-e2e-t.json").read_text())
    assert (out / "vllm-e2e-t.log").exists()
    assert s["schema"] == plan.SUMMARY_SCHEMA and s["config_problems"] == []
    assert isinstance(s["preflight"]["entry_points"], list) and s["preflight"]["kernels"]["needed"] == 14
    for key in ("triton_fp8-eager", "msa_fp8-eager", "msa_nvfp4-eager", "msa_mtp-eager"):
        r = s["results"][key]
        assert plan.check_mode_result(r) == [], (key, plan.check_mode_result(r))
        assert r["ok"], (key, r["error"], r.get("traceback"))
        assert all(r["expect_log"].values()), r["expect_log"]
        assert [p_["ok"] for p_ in r["speed"]] == [True, True]
        # the fake model's attention scales, as a dummy load leaves them, put back to 1.0
        assert r["reinit"]["params"][0]["target_scales"] == {"layers": 1, "before": [[pytest.approx(-7.4558414e-4), 4]]}
    assert s["results"]["msa_mtp-eager"]["speed"][0]["tokens_per_step"] == 4.0
    assert s["results"]["msa_fp8-eager"]["gemma_norm"].startswith("vLLM's GemmaRMSNorm.forward_native")
    for key in ("msa_fp8-eager", "msa_nvfp4-eager"):
        hc = s["results"][key]["hook_check"]
        assert hc["ok"] and hc["rel_err"] < 1e-2 and hc["cache"]["finite"], hc
        assert hc["nvfp4"] is (key == "msa_nvfp4-eager")
        assert hc["k_scale"] > 0 and hc["v_scale"] > 0
    assert s["results"]["triton_fp8-eager"]["hook_check"] is None
    prof = s["results"]["msa_fp8-eager"]["profile"]  # 32x8192 is the profiled point (no CUDA kernels here)
    assert (prof["batch"], prof["context"], prof["steps"]) == (32, 8192, plan.PROFILE_STEPS) and prof["all_requests_decoding"]
    agree = s["agreement"]["msa_fp8 vs triton_fp8 (eager)"]
    assert agree["verdict"] == "identical" and agree["max_abs_dlogprob"] == pytest.approx(0.001)
    assert agree["within_tolerance"]
    assert s["agreement"]["msa_mtp vs msa_fp8 (eager)"]["verdict"] == "identical"
    assert len(s["speed_table"]) == 8


def test_harness_profiles_the_points_asked_for_on_a_fake_vllm(tmp_path):
    """--profile-points: every point named runs under torch.profiler; the mode result's `profile` is the
    first one's, each later one keeps its own in its speed entry."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "e2e_fake_vllm")]),
           "MSA_JIT_CACHE_DIR": str(tmp_path / "cache"), "MSA_JIT_NO_COMPILE": "1"}
    env.pop("TRITON_INTERPRET", None)
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(E2E / "run_vllm_e2e.py"), "run", "--out", str(out), "--work",
                        str(tmp_path / "work"), "--modes", "msa_fp8", "--points", "1x4096,8x4096,32x8192",
                        "--profile-points", "1x4096,32x8192", "--deadline-s", "200", "--min-run-s", "10",
                        "--tag", "t"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads((out / "vllm-e2e-t.json").read_text())["results"]["msa_fp8-eager"]
    assert plan.check_mode_result(r) == [] and r["ok"], (r["error"], r.get("traceback"))
    assert (r["profile"]["batch"], r["profile"]["context"], r["profile"]["steps"]) == (1, 4096, plan.PROFILE_STEPS)
    assert ["profile" in pt for pt in r["speed"]] == [False, False, True]
    assert r["speed"][2]["profile"]["steps"] == plan.PROFILE_STEPS
    # the fake engine's steps run no layer: every counted name of its MSA module (imported by the hook) 0
    assert all(pt["calls_per_step"] == {"msa_cutlass_sparse_decode": 0} for pt in r["speed"]), r["speed"]


def test_decode_calls_are_counted_per_step():
    """hook_probes.CallCounter counts the MSA module's names while entered (those it lacks left out) and
    puts them back; calls_per_step is the median over the steps where every request decodes."""
    import types

    probes = _load("hook_probes", E2E / "hook_probes.py")
    msa = types.SimpleNamespace(msa_cutlass_sparse_decode=lambda *a, **k: "decoded",
                                prepare_decode_metadata=lambda *a, **k: "md")
    real = msa.msa_cutlass_sparse_decode
    with probes.CallCounter(msa) as counter:
        assert counter.snapshot() == {"prepare_decode_metadata": 0, "msa_cutlass_sparse_decode": 0}
        assert msa.prepare_decode_metadata() == "md" and msa.msa_cutlass_sparse_decode(1, x=2) == "decoded"
        msa.msa_cutlass_sparse_decode()
        assert counter.snapshot() == {"prepare_decode_metadata": 1, "msa_cutlass_sparse_decode": 2}
    assert msa.msa_cutlass_sparse_decode is real
    with probes.CallCounter(None) as counter:
        assert counter.snapshot() is None
    step = lambda started, finished, calls: {"s": 0.001, "started": started, "finished": finished, "calls": calls}
    steps = [step(1, 0, {"d": 9}), step(2, 0, {"d": 7}), step(2, 0, {"d": 0}), step(2, 0, {"d": 0}), step(2, 1, {"d": 7})]
    assert plan.calls_per_step(steps, 2) == {"d": 0}  # the prefill step and the one a request finished in left out
    assert plan.calls_per_step([step(2, 0, None)] * 3, 2) is None


def test_mtp_layers_renamed_after_the_target(monkeypatch):
    """vLLM 0.33's MTP names its layers model.layers.<idx>, the tiny text-only target's layer 0 is
    model.layers.0 too (vLLM: "Duplicate layer name"): the harness moves them past the target's."""
    import types

    runner = _load("run_vllm_e2e_mtp", E2E / "run_vllm_e2e.py")
    seen = []

    class Layer:
        def __init__(self, vllm_config, prefix):
            seen.append(prefix)

    mtp = types.ModuleType("vllm.models.minimax_m3.nvidia.mtp")
    mtp.MiniMaxM3MultiTokenPredictorLayer = Layer
    for name in ("vllm", "vllm.models", "vllm.models.minimax_m3", "vllm.models.minimax_m3.nvidia"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, mtp.__name__, mtp)
    monkeypatch.setattr(sys.modules["vllm.models.minimax_m3.nvidia"], "mtp", mtp, raising=False)
    cfg = types.SimpleNamespace(speculative_config=types.SimpleNamespace(
        draft_model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(num_hidden_layers=8))))
    assert "renamed" in runner._mtp_layer_offset()
    Layer(cfg, "model.layers.0")
    Layer(cfg, "layers.1")
    assert seen == ["model.layers.8", "layers.9"]
    assert runner._mtp_layer_offset() == "already patched"


def test_scale_buffers_are_put_back_to_one_after_the_dummy_load():
    """vLLM 0.33's dummy load leaves -7.4558414e-4 in the attention layers' scale buffers (MiniMax-M3's
    sparse layer never resets them; the NVFP4 insert, msa-jit and the engine's Triton fp8 path read
    them): the harness puts them back to 1.0, a checkpoint's value, and records what it found."""
    import torch

    runner = _load("e2e_weights", E2E / "e2e_weights.py")
    model = torch.nn.Module()
    model.attn = torch.nn.Module()
    model.attn.inner = torch.nn.Module()  # a layer without scales: not counted
    for name in runner.SCALE_BUFFERS:
        model.attn.register_buffer(name, torch.tensor(-7.4558414e-4))
    model.attn._k_scale_float = 1.0
    model.attn._k_scale_cpu = torch.tensor(-7.4558414e-4)
    model.dense = torch.nn.Module()
    model.dense.register_buffer("_k_scale", torch.tensor(1.0))
    got = runner.reset_scale_buffers(model)
    assert got["layers"] == 2
    assert got["before"] == [[pytest.approx(-7.4558414e-4), 4], [1.0, 1]]
    for layer in (model.attn, model.dense):
        assert all(b.item() == 1.0 for b in layer.buffers(recurse=False))
    assert model.attn._k_scale_float == 1.0 and model.attn._k_scale_cpu.item() == 1.0
    assert runner.reset_scale_buffers(model)["before"] == [[1.0, 5]]
    # the worker entry point resets what it redraws
    worker = type("W", (), {"get_model": lambda self: model, "model_runner": None})()
    for name in runner.SCALE_BUFFERS:
        getattr(model.attn, name).fill_(-7.4558414e-4)
    done = runner.reinit_worker(worker, plan.REINIT)
    assert done["target_scales"]["layers"] == 2 and model.attn._v_scale.item() == 1.0
