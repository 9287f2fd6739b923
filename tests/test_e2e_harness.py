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
    assert s["device_span_ms_per_step"] is None and s["top_host_ops"] == []
    host = plan.profile_summary(kernels, steps=2, wall_s=0.05, device_span_s=0.03,
                                host_ops=[("cudaGraphLaunch", 0.001), ("aten::copy_", 0.0002), ("cudaGraphLaunch", 0.001)])
    assert host["device_span_ms_per_step"] == 15.0
    assert host["top_host_ops"] == [{"name": "cudaGraphLaunch", "self_ms_per_step": 1.0},
                                    {"name": "aten::copy_", "self_ms_per_step": 0.1}]
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


def _run(outputs):
    return {"correctness": {"prompt_lens": [3] * len(outputs), "outputs": outputs}}


def test_compare_runs_verdicts_and_pooled_figures():
    ref = _run([_side([5, 6, 7], [[[5, -0.1]], [[6, -0.2], [8, -2.0]], [[7, -0.5], [4, -0.52]]])])
    assert plan.compare_runs(ref, ref)["verdict"] == "identical"
    assert plan.compare_runs(ref, _run([_side([5, 6, 4], None)]))["verdict"] == "agree_until_near_tie"
    assert plan.compare_runs(ref, _run([_side([5, 8, 7], None)]))["verdict"] == "diverged"
    assert plan.compare_runs(ref, _run([]))["verdict"] == "missing"
    assert plan.compare_runs(ref, None) is None
    # max and median over the agreeing steps of all prompts together, not per prompt
    two = _run([_side([5, 6], [[[5, -0.1]], [[6, -0.2]]]), _side([1, 2, 3], [[[1, -1.0]], [[2, -1.0]], [[3, -1.0]]])])
    other = _run([_side([5, 6], [[[5, -0.4]], [[6, -0.5]]]), _side([1, 2, 3], [[[1, -1.01]], [[2, -1.0]], [[3, -1.02]]])])
    c = plan.compare_runs(two, other)
    assert c["dlogprob_steps"] == 5 and c["max_abs_dlogprob"] == pytest.approx(0.3)
    assert c["median_abs_dlogprob"] == pytest.approx(0.02)  # per-prompt medians would give 0.3 and 0.01
    assert "within_spread" not in c


def test_judge_spread_against_the_control():
    base = [_side([1, 2, 3, 4], [[[t, -0.5]] for t in (1, 2, 3, 4)])]

    def shifted(*d):
        return _run([_side([1, 2, 3, 4], [[[t, -0.5 - x]] for t, x in zip((1, 2, 3, 4), d)])])

    control = plan.compare_runs(_run(base), shifted(0.1, 0.3, 0.5, 0.2))  # max 0.5, median 0.25
    inside = plan.judge_spread(plan.compare_runs(_run(base), shifted(0.2, 0.4, 0.1, 0.3)), control, "c")
    assert inside["within_spread"] and inside["spread"]["control_max_abs_dlogprob"] == pytest.approx(0.5)
    assert inside["spread"]["control"] == "c" and inside["max_abs_dlogprob"] == pytest.approx(0.4)
    # past the control's max, or its median, fails
    assert not plan.judge_spread(plan.compare_runs(_run(base), shifted(0, 0, 0, 0.6)), control, "c")["within_spread"]
    assert not plan.judge_spread(plan.compare_runs(_run(base), shifted(0.3, 0.3, 0.3, 0.3)), control,
                                 "c")["within_spread"]
    # a control that agrees exactly: the floor (one bf16 step of the logits) is what is allowed
    exact = plan.compare_runs(_run(base), _run(base))
    assert plan.judge_spread(plan.compare_runs(_run(base), shifted(0.06, 0, 0, 0)), exact, "c")["within_spread"]
    assert not plan.judge_spread(plan.compare_runs(_run(base), shifted(0.07, 0, 0, 0)), exact, "c")["within_spread"]
    # parting at the first step of every prompt is outside any spread; no control: not judged
    first = plan.compare_runs(_run(base), _run([_side([9, 2, 3, 4], [[[9, -0.1]]] * 4)]))
    assert first["dlogprob_steps"] == 0 and plan.judge_spread(first, control, "c")["within_spread"] is False
    assert plan.judge_spread(inside, None, "c")["within_spread"] is None
    assert plan.judge_spread(inside, {"verdict": "missing", "prompts": []}, "c")["within_spread"] is None
    assert plan.judge_spread(None, control, "c") is None


def _mode_run(mode, graphs, tokens, deltas):
    """A mode result whose one prompt decodes `tokens`, log-probs -0.5 - deltas[i]."""
    return {"mode": mode, "graphs": graphs, "correctness": {"prompt_lens": [3], "outputs": [
        _side(tokens, [[[t, -0.5 - d]] for t, d in zip(tokens, deltas)])]}}


def test_agreement_judges_msa_jit_against_vllms_own_spread():
    toks = [1, 2, 3, 4]
    results = {
        "triton_fp8-eager": _mode_run("triton_fp8", "eager", toks, [0, 0, 0, 0]),
        "msa_fp8_engine_triton-eager": _mode_run("msa_fp8_engine_triton", "eager", toks, [0.2, 0.4, 0.1, 0.3]),
        "msa_fp8-eager": _mode_run("msa_fp8", "eager", toks, [0.25, 0.45, 0.15, 0.35]),  # 0.05 from the control mode
        "msa_mtp-eager": _mode_run("msa_mtp", "eager", [1, 2, 9, 9], [0.9, 0.25, 0, 0]),  # 0.65 from msa_fp8
        "triton_fp8-graph": _mode_run("triton_fp8", "graph", toks, [0, 0, 0, 0]),
        "msa_fp8-graph": _mode_run("msa_fp8", "graph", toks, [0.25, 0.45, 0.15, 0.35]),
        "msa_mtp-graph": _mode_run("msa_mtp", "graph", [1, 9, 9, 9], [0.9, 0, 0, 0]),
    }
    a = plan.agreement(results)
    ctl = a["msa_fp8_engine_triton vs triton_fp8 (eager)"]
    assert "within_spread" not in ctl and ctl["max_abs_dlogprob"] == pytest.approx(0.4)
    pair = a["msa_fp8 vs msa_fp8_engine_triton (eager)"]
    assert pair["within_spread"] and pair["spread"]["control"] == "msa_fp8_engine_triton vs triton_fp8 (eager)"
    assert pair["spread"]["control_median_abs_dlogprob"] == pytest.approx(0.25)
    assert "within_spread" not in a["msa_fp8 vs triton_fp8 (eager)"]  # kernel and query format at once
    mtp = a["msa_mtp vs msa_fp8 (eager)"]
    assert mtp["agree_steps"] == [2] and mtp["within_spread"] is False  # 0.65 > the control's 0.4
    # graph against eager: judged against vLLM alone's (identical here: the floor), MTP reported only
    assert a["msa_fp8: graph vs eager"]["within_spread"] and a["msa_fp8: graph vs eager"]["verdict"] == "identical"
    assert "within_spread" not in a["triton_fp8: graph vs eager"]  # the control itself
    assert "within_spread" not in a["msa_mtp: graph vs eager"]
    # no control in the graph setting (msa_fp8_engine_triton did not run there): not judged
    assert a["msa_mtp vs msa_fp8 (graph)"]["within_spread"] is None


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


OUTPUT = """\
===== msa_nvfp4-eager: python run_vllm_e2e.py child --mode msa_nvfp4 (budget 95s)
(MainProcess pid=1409) INFO 12-07 10:15:36 [cuda.py:508] Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN']
(MainProcess pid=1409) INFO 12-07 10:15:36 [flash_attn.py:1122] Using FlashAttention version 3
(MainProcess pid=1409) INFO 12-07 10:15:36 [sparse_attention_msa.py:232] MiniMax M3 MSA sparse decode selected CUTLASS
(MainProcess pid=1409) INFO 12-07 10:15:37 [unquantized.py:530] nothing selected here
[e2e msa_nvfp4/eager] engine done at 33.7s: Using a line that is not vLLM's
"""


def test_log_lines_read_from_a_childs_output():
    """Where the child's log handler saw nothing, the parent takes vLLM's lines from the output."""
    lines = plan.selection_lines(OUTPUT)
    assert lines == ["INFO [cuda.py:508] Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN']",
                     "INFO [flash_attn.py:1122] Using FlashAttention version 3",
                     "INFO [sparse_attention_msa.py:232] MiniMax M3 MSA sparse decode selected CUTLASS"]
    assert len(plan.selection_lines(OUTPUT, limit=2)) == 2
    r = plan.log_from_output({"log_lines": []}, OUTPUT, plan.MODES["msa_nvfp4"])
    assert r["log_lines"] == lines and r["log_lines_from"] == "process output"
    assert r["expect_log"] == {"msa-jit vLLM plugin: MiniMax-M3 decode on SM90": False,
                               "MSA sparse decode selected CUTLASS": True}
    runner = (E2E / "run_vllm_e2e.py").read_text()  # the parent falls back on it where the tap saw none
    assert 'if not results[key].get("log_lines"):' in runner and "plan.log_from_output(results[key]" in runner


# ----------------------------------------------------------------------------- combining calls
def _summary(tag, date, results):
    return {"schema": plan.SUMMARY_SCHEMA, "date": date, "nvidia_smi": "H100",
            "command": f"python bench/e2e/run_vllm_e2e.py run --out /o --tag {tag}", "versions": {"vllm": "0.33.0"},
            "preflight": {}, "model_config": {"m": 1}, "config_problems": [], "results": results}


def _result(mode, graphs, deltas, ok=True, **extra):
    r = {**_mode_run(mode, graphs, [1, 2, 3, 4], deltas), "ok": ok, "error": None if ok else "stopped",
         "log_lines": [], "speed": [{"batch": 1, "context": 4096, "ok": True, "step": {"median_ms": 2.0}}],
         "profile": None, "traceback": "Traceback ...", "versions": {"vllm": "0.33.0"}}
    r.update(extra)
    return r


def test_combine_results_across_calls(tmp_path):
    combine = _load("combine_results", E2E / "combine_results.py")
    eager = _summary("h100-eager", "2026-01-01T10:00:00", {
        "triton_fp8-eager": _result("triton_fp8", "eager", [0] * 4, ok=False, correctness=None),
        "msa_fp8-eager": _result("msa_fp8", "eager", [0.1] * 4),
        "msa_nvfp4-eager": _result("msa_nvfp4", "eager", [0.3] * 4)})
    graph = _summary("h100-graph", "2026-01-01T11:00:00", {
        "triton_fp8-eager": _result("triton_fp8", "eager", [0] * 4),
        "msa_fp8-eager": _result("msa_fp8", "eager", [0.1] * 4),
        "msa_nvfp4-graph": _result("msa_nvfp4", "graph", [0.3] * 4),
        "triton_fp8-graph": _result("triton_fp8", "graph", [0] * 4)})
    for name, s in (("a.json", eager), ("b.json", graph)):
        (tmp_path / name).write_text(json.dumps(s))
    (tmp_path / "a.log").write_text("===== msa_fp8-eager: child\n(MainProcess pid=1) INFO 01-01 10:00:01 "
                                   "[sparse_attention_msa.py:232] MiniMax M3 MSA sparse decode selected CUTLASS\n")
    out = tmp_path / "out.json"
    combine.main(["--out", str(out), "--call", str(tmp_path / "b.json"), "--call", str(tmp_path / "a.json"),
                  "device=DEADLINE_S=1 bash bench/e2e/device_run.sh run"])
    c = json.loads(out.read_text())
    assert c["schema"] == combine.SCHEMA and [x["name"] for x in c["calls"]] == ["h100-eager", "h100-graph"]
    assert c["calls"][0]["device_command"] == "DEADLINE_S=1 bash bench/e2e/device_run.sh run"
    # a run made twice: taken from the call where it finished, the other compared with it
    assert c["results_from"]["triton_fp8-eager"] == "h100-graph" and c["results_from"]["msa_fp8-eager"] == "h100-graph"
    assert c["repeats"]["msa_fp8-eager: h100-eager vs h100-graph"]["verdict"] == "identical"
    assert c["repeats"]["triton_fp8-eager: h100-eager vs h100-graph"] == {"verdict": "missing", "error": "stopped"}
    # pairs across calls: NVFP4 with graphs (second call) against NVFP4 eager (first call)
    assert c["agreement"]["msa_nvfp4: graph vs eager"]["within_spread"]
    assert c["agreement"]["msa_fp8 vs triton_fp8 (eager)"]["max_abs_dlogprob"] == pytest.approx(0.1)
    # trimmed: no traceback, the call's versions not repeated; log lines read from the call's log
    r = c["calls"][0]["results"]["msa_fp8-eager"]
    assert "traceback" not in r and "versions" not in r and r["log_lines_from"] == "process output"
    assert r["expect_log"]["MSA sparse decode selected CUTLASS"] and c["calls"][0]["log"] == "a.log"
    assert len(c["speed_table"]) == 7 and {row["call"] for row in c["speed_table"]} == {"h100-eager", "h100-graph"}
    # the per-step log-probs go when the file would be too big; the token ids stay
    calls = [combine.read_call(tmp_path / "a.json", None, None), combine.read_call(tmp_path / "b.json", None, None)]
    small = json.loads(combine.combined_text(calls, max_bytes=1000))
    kept = json.loads(combine.combined_text(calls))
    assert not small["logprobs_kept"] and kept["logprobs_kept"]
    outs = small["calls"][0]["results"]["msa_fp8-eager"]["correctness"]["outputs"]
    assert outs[0]["token_ids"] == [1, 2, 3, 4] and "logprobs" not in outs[0]
    assert small["agreement"] == kept["agreement"]  # computed before trimming


def test_committed_e2e_result_is_a_combined_file():
    """bench/results/vllm-e2e-h100.json is combine_results' output: every call with its commands,
    the agreement judged against vLLM's own spread."""
    combine = _load("combine_results", E2E / "combine_results.py")
    c = json.loads((ROOT / "bench" / "results" / "vllm-e2e-h100.json").read_text())
    assert c["schema"] == combine.SCHEMA and len((ROOT / "bench" / "results" / "vllm-e2e-h100.json").read_bytes()) \
        <= combine.MAX_BYTES
    for call in c["calls"]:
        assert call["command"].startswith("python bench/e2e/run_vllm_e2e.py run") and call["device_command"]
        assert call["versions"]["vllm"] == "0.33.0" and not call["config_problems"] and call["model_config_same"]
    judged = [k for k, a in c["agreement"].items() if "within_spread" in a]
    assert "msa_fp8 vs msa_fp8_engine_triton (eager)" in judged and "msa_fp8 vs msa_fp8_engine_triton (graph)" in judged
    for key, run in c["results_from"].items():
        assert key in next(x for x in c["calls"] if x["name"] == run)["results"]


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
                        str(tmp_path / "work"), "--modes", "triton_fp8,msa_fp8,msa_fp8_engine_triton,msa_nvfp4,msa_mtp",
                        "--points", "1x4096,32x8192", "--deadline-s", "300", "--min-run-s", "10", "--tag", "t"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads((out / "vllm-e2e-t.json").read_text())
    assert (out / "vllm-e2e-t.log").exists()
    assert s["schema"] == plan.SUMMARY_SCHEMA and s["config_problems"] == []
    assert isinstance(s["preflight"]["entry_points"], list) and s["preflight"]["kernels"]["needed"] == 14
    for key in ("triton_fp8-eager", "msa_fp8-eager", "msa_fp8_engine_triton-eager", "msa_nvfp4-eager", "msa_mtp-eager"):
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
    assert "within_spread" not in agree  # reported: no control isolates it
    judged = s["agreement"]["msa_fp8 vs msa_fp8_engine_triton (eager)"]
    assert judged["within_spread"] and judged["spread"]["control"] == "msa_fp8_engine_triton vs triton_fp8 (eager)"
    assert s["agreement"]["msa_mtp vs msa_fp8 (eager)"]["verdict"] == "identical"
    assert len(s["speed_table"]) == 10


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
