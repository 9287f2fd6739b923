"""MiniMax-M3 decode through msa-jit inside a real vLLM 0.33.0 engine, end to end.

    python bench/e2e/run_vllm_e2e.py run --out DIR [--modes a,b] [--graphs eager,graph] [--deadline-s S]
    python bench/e2e/run_vllm_e2e.py child --mode M --graphs G --out-json F ...   (one engine; run starts these)

`run` starts one process per (mode, graphs) (`plan.MODES`; vLLM's engine state is process-global,
the engine runs in-process with VLLM_ENABLE_V1_MULTIPROCESSING=0), gives each a share of the time
left, and writes DIR/vllm-e2e-<tag>.json (`plan.summary`: device, versions, date, command, every
mode's result, the agreement figures, the speed table) and DIR/vllm-e2e-<tag>.log (every process's
output). A run that fails or runs out of time keeps what it finished: each child writes its result
after every phase, its error and traceback included. `bench/e2e/device_run.sh` sets up the GPU host
and calls `run`; the tiny model is `bench/e2e/tiny_m3/config.json` (dummy weights, no tokenizer).

A child's phases: engine start (vLLM's log lines that say what it selected); weights redrawn
(`plan.REINIT`, the same model in every mode) and the attention layers' scale buffers put back to
1.0 (`e2e_weights`: what the dummy load left is recorded); correctness (a mixed batch of prompts, greedy, top-5
log-probs per step); for msa-jit modes the hook check (one sparse layer's decode output against
`msa_jit.reference` on the engine's own cache, query, top-k and block table); the speed grid
(per-step wall time of pure decode steps, `plan.speed_points`); torch.profiler over a few decode
steps (device time by kernel category, the sparse decode's share).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_plan as plan  # noqa: E402  (beside this file)
import e2e_weights as weights  # noqa: E402
import hook_probes as probes  # noqa: E402


class _Stop(BaseException):
    """SIGTERM from the parent's deadline: save what is done."""


# ============================================================================ child
class _LogTap(logging.Handler):
    """Keeps vLLM's log lines that say what was selected (plan.LOG_PATTERNS), at most `limit`."""

    def __init__(self, limit: int = 300) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.limit = limit

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001
            return
        if len(self.lines) < self.limit and any(p in msg for p in plan.LOG_PATTERNS):
            self.lines.append(f"{record.levelname} {record.name}: {msg[:600]}")


def _versions() -> dict[str, Any]:
    import importlib.metadata as md

    out: dict[str, Any] = {"python": sys.version.split()[0]}
    for dist in ("vllm", "torch", "triton", "transformers", "apache-tvm-ffi", "flashinfer-python", "msa-jit"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    try:
        import torch

        out["cuda"] = torch.version.cuda
    except Exception:  # noqa: BLE001
        pass
    try:
        from msa_jit.jit import compiler

        out["cutlass_dsl"] = compiler.dsl_version()
        out["tvm_ffi_abi"] = compiler.tvm_ffi_abi()
        out["msa_jit_file"] = str(Path(compiler.__file__).parent)
    except Exception as e:  # noqa: BLE001
        out["msa_jit_error"] = f"{type(e).__name__}: {e}"
    for name in ("MSA_JIT_COMMIT",):
        if os.environ.get(name):
            out[name.lower()] = os.environ[name]
    return out


def _logprob_rows(logprobs: Any) -> list[list[list[float]]] | None:
    """vLLM's per-step {token: Logprob} dicts -> [[[token, logprob], ...] per step]."""
    if not logprobs:
        return None
    rows = []
    for step in logprobs:
        rows.append([[int(t), float(getattr(lp, "logprob", lp))] for t, lp in (step or {}).items()])
    return rows


def _correctness(llm: Any, vocab: int, spec_tokens: int, watch: bool = False) -> dict[str, Any]:
    """Greedy tokens and log-probs of the mixed batch; with `watch` (an msa-jit fp8 mode), every
    sparse layer of the first decode steps also compared per token with vLLM's Triton decode."""
    import importlib

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    msa = importlib.import_module(probes.MSA_MODULE) if watch else None
    real = msa.msa_cutlass_sparse_decode if msa else None
    watched: list[dict[str, Any]] = []
    if msa is not None:
        msa.msa_cutlass_sparse_decode, watched = probes.first_step_watch(msa, plan.WATCHED_DECODE_CALLS)

    ids = plan.prompt_ids(plan.CORRECTNESS_PROMPT_LENS, vocab)
    sp = SamplingParams(temperature=0.0, max_tokens=plan.CORRECTNESS_MAX_TOKENS, ignore_eos=True,
                        detokenize=False, logprobs=plan.CORRECTNESS_LOGPROBS)
    t0 = time.perf_counter()
    note = None
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], sp, use_tqdm=False)
    except Exception as e:  # noqa: BLE001 - e.g. log-probs refused with speculative decoding: tokens only
        note = f"with logprobs: {type(e).__name__}: {str(e)[:300]}; rerun without"
        sp = SamplingParams(temperature=0.0, max_tokens=plan.CORRECTNESS_MAX_TOKENS, ignore_eos=True,
                            detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], sp, use_tqdm=False)
    finally:
        if msa is not None:
            msa.msa_cutlass_sparse_decode = real
    wall = time.perf_counter() - t0
    return {"prompt_lens": list(plan.CORRECTNESS_PROMPT_LENS), "max_tokens": plan.CORRECTNESS_MAX_TOKENS,
            "wall_s": round(wall, 3), "spec_tokens": spec_tokens, "note": note, "first_steps_vs_triton": watched,
            "outputs": [{"token_ids": list(o.outputs[0].token_ids),
                         "logprobs": _logprob_rows(o.outputs[0].logprobs)} for o in outs]}


def _hook_check(llm: Any, vocab: int) -> dict[str, Any]:
    """Wrap the decode function vLLM's MSA impl calls (the name the plugin rebound), run a short
    generate, and on the third decode call (a middle sparse layer of the first decode step) compare the output with msa_jit.reference
    (float64 on the CPU, the same query / cache / top-k / block table / scales); on the fourth, whether the
    decode runs in order on the engine's stream (`hook_probes.stream_order_probe`)."""
    import importlib

    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from msa_jit.reference import sparse_decode_reference

    msa = importlib.import_module(probes.MSA_MODULE)
    real = msa.msa_cutlass_sparse_decode
    want_call = 3  # a middle sparse layer of the first decode step
    state: dict[str, Any] = {"calls": 0, "result": None, "stream": None}

    def hooked(query_fp8, kv_cache, topk, output, metadata, *, scale, q_scale_float, k_scale_float,
               v_scale_float, k_scale=None, v_scale=None):
        def call() -> None:
            real(query_fp8, kv_cache, topk, output, metadata, scale=scale, q_scale_float=q_scale_float,
                 k_scale_float=k_scale_float, v_scale_float=v_scale_float, k_scale=k_scale, v_scale=v_scale)

        state["calls"] += 1
        if state["calls"] == want_call + 1 and state["stream"] is None:
            state["stream"] = probes.stream_order_probe(call, output)
            return
        call()
        if state["calls"] != want_call or state["result"] is not None:
            return
        try:
            _sync()
            p = metadata.plan
            nvfp4 = kv_cache.dtype == torch.uint8 and kv_cache.shape[-1] == 72
            fmt = "nvfp4" if nvfp4 else "float8_e4m3fn"
            ks = k_scale if nvfp4 else k_scale_float
            vs = v_scale if nvfp4 else v_scale_float
            ref, _ = sparse_decode_reference(query_fp8, kv_cache, topk, p.block_table[:p.batch], p.seq_lens[:p.batch],
                                             p.qlen, sm_scale=scale, q_scale=q_scale_float, k_scale=ks, v_scale=vs)
            stats = _cache_stats(kv_cache, topk, p, nvfp4, ks, vs)
            got = output.detach().to("cpu", torch.float64)
            err = (got - ref).norm().item() / max(ref.norm().item(), 1e-30)
            state["result"] = {
                "call": want_call, "tokens": int(query_fp8.shape[0]), "batch": int(p.batch), "qlen": int(p.qlen),
                "seq_lens": [int(x) for x in p.seq_lens[:p.batch].tolist()], "kv_cache": list(kv_cache.shape),
                "kv_dtype": str(kv_cache.dtype), "kv_strides": list(kv_cache.stride()), "nvfp4": nvfp4,
                "query_dtype": str(query_fp8.dtype), "kernel": p.launch(fmt).kernel, "splits": int(p.launch(fmt).num_splits),
                "rel_err": err, "max_abs_err": (got - ref).abs().max().item(),
                "ref_rms": ref.pow(2).mean().sqrt().item(), "finite": bool(torch.isfinite(got).all()),
                "k_scale": float(ks), "v_scale": float(vs),  # the global / per-tensor scales the op got
                "tolerance": plan.HOOK_MAX_REL_ERR, "ok": bool(torch.isfinite(got).all()) and err <= plan.HOOK_MAX_REL_ERR,
                "cache": stats,
            }
        except Exception as e:  # noqa: BLE001
            state["result"] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            return
        if not state["result"]["nvfp4"]:
            state["result"]["engine_triton"] = probes.against_engine_triton(
                msa, query_fp8, kv_cache, topk, output, metadata.plan, scale, q_scale_float, k_scale_float,
                v_scale_float)

    msa.msa_cutlass_sparse_decode = hooked
    try:
        ids = plan.prompt_ids(plan.CORRECTNESS_PROMPT_LENS, vocab, seed=plan.PROMPT_SEED + 7)
        sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, detokenize=False)
        llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], sp, use_tqdm=False)
    finally:
        msa.msa_cutlass_sparse_decode = real
    result = state["result"] or {"ok": False, "error": f"the decode function was called {state['calls']} times"}
    result["stream_order"] = state["stream"]
    return result


def _mtp_layer_offset() -> str:
    """Give vLLM 0.33's MiniMax-M3 MTP layers indices after the target's (as DeepSeek's MTP does).

    vLLM's MiniMaxM3MultiTokenPredictor names its layers f"{prefix}.layers.{idx}" for idx in
    range(num_mtp_modules) (models/minimax_m3/nvidia/mtp.py) and builds each one as a decoder layer
    whose attention registers "<prefix>.self_attn.attn". The real checkpoint is the VL wrapper, whose
    target layers live under "language_model.model.layers.N", so "model.layers.0" is free there;
    this tiny text-only config (MiniMaxM3SparseForCausalLM) puts the target's layer 0 at
    "model.layers.0" too, and vLLM refuses the duplicate name. No config field moves the MTP index,
    so the harness renames the drafter's layers to model.layers.<num_hidden_layers + idx> (dummy
    weights: nothing is loaded by name). Returns what it did."""
    try:
        import vllm.models.minimax_m3.nvidia.mtp as mtp
    except Exception as e:  # noqa: BLE001
        return f"not patched ({type(e).__name__}: {e})"
    cls = mtp.MiniMaxM3MultiTokenPredictorLayer
    if getattr(cls, "_e2e_offset", False):
        return "already patched"
    original = cls.__init__

    def __init__(self, vllm_config, prefix):  # noqa: N807
        n = int(vllm_config.speculative_config.draft_model_config.hf_config.num_hidden_layers)
        m = re.search(r"(\.|^)layers\.(\d+)$", prefix)
        if m is not None:
            prefix = f"{prefix[:m.start(2)]}{n + int(m.group(2))}"
        original(self, vllm_config, prefix)

    cls.__init__ = __init__
    cls._e2e_offset = True
    return "MTP layers renamed to model.layers.<num_hidden_layers + idx>"


def _gemma_norm() -> str:
    """The model's Gemma RMSNorm runs FlashInfer's kernels (the bundle ships their norm module
    prebuilt). Where flashinfer.norm cannot be imported (E2E_NO_FLASHINFER=1 forces this), use
    vLLM's own GemmaRMSNorm.forward_native instead, as the bundle's example does, in every mode
    alike; returns which one runs."""
    reason = "E2E_NO_FLASHINFER=1" if os.environ.get("E2E_NO_FLASHINFER") == "1" else None
    if reason is None:
        try:
            import flashinfer.norm  # noqa: F401

            return "flashinfer"
        except Exception as e:  # noqa: BLE001
            reason = f"flashinfer.norm: {type(e).__name__}: {e}"
    try:
        import vllm.models.minimax_m3.nvidia.model as m3
        from vllm.model_executor.layers.layernorm import GemmaRMSNorm

        m3.MiniMAXGemmaRMSNorm.forward = GemmaRMSNorm.forward_native
    except Exception as e:  # noqa: BLE001 - the engine start will say what is wrong
        return f"flashinfer (the native fallback failed: {type(e).__name__}: {e}; {reason})"
    return f"vLLM's GemmaRMSNorm.forward_native ({reason})"


def _dense_backend_probe(kv_cache_dtypes: tuple[str, ...]) -> dict[str, Any]:
    """Which of vLLM's attention backends would take a dense MiniMax-M3 layer (head 128, bf16, 64
    heads) with each cache dtype, and why the others refuse: the platform's own selection
    (`get_valid_backends`, whose reasons vLLM prints only when none is valid)."""
    out: dict[str, Any] = {}
    try:
        import torch
        from vllm.platforms import current_platform
        from vllm.v1.attention.selector import AttentionSelectorConfig

        cap = current_platform.get_device_capability()
        for dtype in kv_cache_dtypes:
            cfg = AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16, kv_cache_dtype=dtype, block_size=None)
            valid, invalid = current_platform.get_valid_backends(cap, cfg, num_heads=64)
            out[dtype] = {"valid": [c.backend.name for c in valid],
                          "invalid": {b.name: reasons for b, (_, reasons) in invalid.items()}}
    except Exception as e:  # noqa: BLE001 - a probe: record and go on
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _cache_stats(kv_cache: Any, topk: Any, p: Any, nvfp4: bool, k_scale: Any, v_scale: Any) -> dict[str, Any]:
    """What the engine's own insert wrote, dequantized: RMS and zero fraction of the K and V rows of
    request 0, KV head 0, in the blocks its first token selected (positions < its seq_len). Keys
    leave the per-head RMSNorm (and RoPE) at RMS ~1, values of the redrawn weights too: far off
    (0, NaN) means a broken cache write, which the kernel-vs-reference check cannot see."""
    import torch

    from msa_jit import reference

    seq = int(p.seq_lens[0])
    page = int(kv_cache.shape[2])
    fn = reference._nvfp4_keys_values if nvfp4 else reference._dense_keys_values

    def rms(x: Any) -> float:
        return x.pow(2).mean().sqrt().item() if x.numel() else float("nan")

    # Which top-k entries are live per decode token (KV head 0): the local block alone means the
    # indexer's scores were not finite (its selection falls back to the forced blocks).
    live = [sum(1 for b in row.tolist() if 0 <= b < -(-int(p.seq_lens[min(t // p.qlen, p.batch - 1)]) // page))
            for t, row in enumerate(topk[:, 0].to("cpu"))]
    out: dict[str, Any] = {"live_topk_per_token": live, "topk_token0_head0": [int(b) for b in topk[0, 0].tolist()],
                           "k_scale": float(k_scale), "v_scale": float(v_scale)}
    # The first and the newest key of request 0: the prefill's insert wrote the first, this decode
    # step's insert the newest (the two writers of the engine).
    for name, pos in (("first_key", 0), ("newest_key", seq - 1)):
        pg = p.block_table[0, pos // page].reshape(1).to("cpu", torch.int64)
        k1, v1 = fn(kv_cache, pg, 0, 128, float(k_scale), float(v_scale))
        row = kv_cache[int(pg), 0, pos % page]
        out[name] = {"position": pos, "page": int(pg), "k_rms": rms(k1[pos % page]), "v_rms": rms(v1[pos % page]),
                     "raw_head": [int(x) for x in row.view(torch.uint8)[:16].tolist()]}
    blocks = [int(b) for b in topk[0, 0].tolist() if 0 <= int(b) < -(-seq // page)]
    if not blocks:
        return {**out, "blocks": 0}
    pages = p.block_table[0, torch.tensor(blocks, device=p.block_table.device)].to("cpu", torch.int64)
    kk, vv = fn(kv_cache, pages, 0, 128, float(k_scale), float(v_scale))
    pos = (torch.tensor(blocks)[:, None] * page + torch.arange(page)).reshape(-1)
    kk, vv = kk[pos < seq], vv[pos < seq]
    return {**out, "blocks": len(blocks), "keys": int(kk.shape[0]), "k_rms": rms(kk), "v_rms": rms(vv),
            "k_zero_fraction": (kk == 0).double().mean().item(), "v_zero_fraction": (vv == 0).double().mean().item(),
            "finite": bool(torch.isfinite(kk).all() and torch.isfinite(vv).all())}


def _run_point(llm: Any, batch: int, context: int, vocab: int, spec_tokens: int, seed: int,
               profile_steps: int = 0) -> dict[str, Any]:
    """One speed point: `batch` prompts of `context` tokens through the engine step loop. Timed:
    plan.DECODE_STEPS steps in which all requests decode (plan.decode_step_times); then, with
    profile_steps, that many more under torch.profiler (left out of the timing). Whatever
    happens, no request of this point is left in the engine for the next one."""
    ids = [f"p{seed}-{i}" for i in range(batch)]
    try:  # the MSA module's decode calls counted per step (hook_probes.CallCounter)
        with probes.CallCounter(sys.modules.get(probes.MSA_MODULE)) as counter:
            return _timed_point(llm, ids, context, vocab, spec_tokens, seed, profile_steps, counter)
    except BaseException:
        try:
            llm.llm_engine.abort_request(ids)
        except Exception:  # noqa: BLE001 - already failing: keep the first error
            pass
        raise


def _timed_point(llm: Any, ids: list[str], context: int, vocab: int, spec_tokens: int, seed: int,
                 profile_steps: int, counter: Any) -> dict[str, Any]:
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    batch = len(ids)
    max_tokens = plan.point_max_tokens(batch, context, spec_tokens, decode_steps=plan.DECODE_STEPS + profile_steps)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                        output_kind=RequestOutputKind.DELTA)
    got = {rid: 0 for rid in ids}
    t0 = time.perf_counter()
    for rid, ids in zip(got, plan.prompt_ids([context] * batch, vocab, seed=seed)):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), sp)
    finished: set[str] = set()
    steps: list[dict[str, Any]] = []
    first_token_s = None
    prof, prof_start, prof_wall = None, None, None
    while engine.has_unfinished_requests():
        timed = len(plan.decode_step_times(steps, batch))
        if profile_steps and prof is None and prof_wall is None and timed >= plan.DECODE_STEPS:
            _sync()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(activities=activities)
            prof.__enter__()
            prof_start = (len(steps), time.perf_counter())
        calls0, ts = counter.snapshot(), time.perf_counter()
        outs = engine.step()
        dt, calls = time.perf_counter() - ts, counter.snapshot()
        new_tokens = 0
        for o in outs:
            if o.request_id in got:
                n = len(o.outputs[0].token_ids) if o.outputs else 0
                got[o.request_id] += n
                new_tokens += n
                if o.finished:
                    finished.add(o.request_id)
        started = sum(1 for v in got.values() if v > 0)
        if first_token_s is None and started >= batch:
            first_token_s = time.perf_counter() - t0
        steps.append({"s": dt, "started": started, "finished": len(finished), "new_tokens": new_tokens,
                      "profiled": prof is not None, "calls": calls and {k: calls[k] - calls0[k] for k in calls}})
        if prof is not None and len(steps) - prof_start[0] >= profile_steps:
            _sync()
            prof_wall = time.perf_counter() - prof_start[1]
            prof.__exit__(None, None, None)
            ev = _profile_events(prof)
            result_prof = plan.profile_summary(ev["kernels"], len(steps) - prof_start[0], prof_wall,
                                               device_span_s=ev["device_span_s"], host_ops=ev["host_ops"])
            result_prof["all_requests_decoding"] = len(finished) == 0
            prof = None
        if len(plan.decode_step_times(steps, batch)) >= plan.DECODE_STEPS + profile_steps and prof is None \
                and (not profile_steps or prof_wall is not None):
            left = [rid for rid in got if rid not in finished]
            if left:  # timed (and profiled) enough: the remaining tokens would only cost time
                engine.abort_request(left)
            break
    plain = [st for st in steps if not st["profiled"]]
    decode = plan.decode_step_times(plain, batch)
    idx = [i for i in range(1, len(plain)) if plain[i - 1]["started"] >= batch and plain[i]["finished"] == 0]
    tokens = [plain[i]["new_tokens"] / batch for i in idx]
    point = {"batch": batch, "context": context, "ok": len(decode) >= 3, "max_tokens": max_tokens,
             "engine_steps": len(steps), "prefill_s": round(first_token_s, 3) if first_token_s else None,
             "wall_s": round(time.perf_counter() - t0, 3), "step": plan.summarize_times(decode),
             "tokens_per_step": round(sum(tokens) / len(tokens), 3) if tokens else None,
             "calls_per_step": plan.calls_per_step(plain, batch)}
    if prof_wall is not None:
        point["profile"] = result_prof
    if not point["ok"]:
        point["error"] = f"only {len(decode)} pure decode steps"
    return point


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _profile_events(prof: Any) -> dict[str, Any]:
    """profile_summary's inputs from the profiler's events: (name, seconds) of every device kernel,
    the kernels' span (first start to last end, seconds) and (name, self seconds) of every host event."""
    import torch

    kernels, host, first, last = [], [], None, None
    for e in prof.events():
        tr = e.time_range
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            kernels.append((e.name, (tr.end - tr.start) * 1e-6))
            first = tr.start if first is None else min(first, tr.start)
            last = tr.end if last is None else max(last, tr.end)
        else:
            host.append((e.name, getattr(e, "self_cpu_time_total", 0.0) * 1e-6))
    span = None if first is None else (last - first) * 1e-6
    return {"kernels": kernels, "device_span_s": span, "host_ops": host}


def child(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    deadline = t_start + args.deadline_s
    mode = plan.MODES[args.mode]
    config = plan.load_config(args.model_dir)
    model_dir = args.model_dir
    if mode.all_sparse:
        model_dir = tempfile.mkdtemp(prefix="tiny_m3_allsparse-")
        (Path(model_dir) / "config.json").write_text(json.dumps(plan.all_sparse_config(config), indent=1))
        config = plan.all_sparse_config(config)
    kwargs = plan.llm_kwargs(mode, args.graphs, model_dir, config)
    env_now = {k: v for k, v in sorted(os.environ.items())
               if k.startswith(("MSA_JIT_", "VLLM_", "FLASHINFER_", "CUDA_", "TRITON_")) or k == "PYTHONPATH"}
    result = plan.new_mode_result(mode, args.graphs, kwargs, env_now)
    out = Path(args.out_json)

    def save() -> None:
        result["wall_s"] = round(time.perf_counter() - t_start, 3)
        tmp = out.with_suffix(".part")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(out)

    def phase(name: str) -> None:
        result["phases"].append(name)
        result["log_lines"] = tap.lines
        save()
        print(f"[e2e {mode.name}/{args.graphs}] {name} done at {time.perf_counter() - t_start:.1f}s", flush=True)

    def stop(signum, frame):
        raise _Stop()

    signal.signal(signal.SIGTERM, stop)
    tap = _LogTap()
    try:
        result["versions"] = _versions()
        save()
        import torch
        import vllm  # noqa: F401  (configures vLLM's logging before the tap joins it)

        logging.getLogger("vllm").addHandler(tap)
        if torch.cuda.is_available():
            result["device"] = torch.cuda.get_device_name(0)
            result["capability"] = list(torch.cuda.get_device_capability(0))
        else:
            result["device"] = "cpu"
        from vllm import LLM

        result["gemma_norm"] = _gemma_norm()
        if mode.kv_cache_dtype.startswith("nvfp4"):
            result["dense_backends"] = _dense_backend_probe((mode.kv_cache_dtype, "auto"))
            save()
        if mode.speculative_tokens:
            result["mtp_layer_offset"] = _mtp_layer_offset()
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        result["engine_start_s"] = round(time.perf_counter() - t0, 3)
        result["expect_log"] = {s: any(s in line for line in tap.lines) for s in mode.expect_log}
        phase("engine")
        vocab = plan.text_config(config)["vocab_size"]
        result["reinit"] = {"spec": plan.REINIT, "params": llm.collective_rpc(weights.reinit_worker, args=(plan.REINIT,))}
        phase("reinit")
        result["correctness"] = _correctness(llm, vocab, mode.speculative_tokens,
                                             watch=mode.msa and mode.kv_cache_dtype == "fp8")
        phase("correctness")
        if mode.msa and args.graphs == "eager":
            result["hook_check"] = _hook_check(llm, vocab)
            phase("hook_check")
        points = plan.parse_points(args.points)
        prof_points = [] if args.no_profile else (plan.parse_points(args.profile_points) or [plan.PROFILE_POINT])
        for i, (b, c) in enumerate(points):
            left = deadline - time.perf_counter()
            if left < 20:
                result["speed"].append({"batch": b, "context": c, "ok": False, "step": None,
                                        "error": f"skipped: {left:.0f}s left of the run's share"})
                continue
            try:
                prof_steps = plan.PROFILE_STEPS if (b, c) in prof_points else 0
                p = _run_point(llm, b, c, vocab, mode.speculative_tokens, seed=1000 + i, profile_steps=prof_steps)
                if "profile" in p and result.get("profile") is None:  # the first profiled point; others keep theirs
                    result["profile"] = {"batch": b, "context": c, **p.pop("profile")}
            except _Stop:
                raise
            except Exception as e:  # noqa: BLE001 - one point failing keeps the others
                p = {"batch": b, "context": c, "ok": False, "step": None, "error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc()[-3000:]}
            result["speed"].append(p)
            save()
            print(f"[e2e {mode.name}/{args.graphs}] B={b} ctx={c}: {p.get('step')} tokens/step "
                  f"{p.get('tokens_per_step')}", flush=True)
        phase("speed")
        result["ok"] = True
    except (Exception, _Stop, KeyboardInterrupt) as e:
        result["error"] = "stopped at the run's deadline (SIGTERM)" if isinstance(e, _Stop) else f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-8000:]
        print(result["traceback"], file=sys.stderr, flush=True)
    finally:
        result["log_lines"] = tap.lines
        save()
    # the result is on disk: skip vLLM's teardown at interpreter exit (it can hang past the budget)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result["ok"] else 1)


# ============================================================================ parent
def _meta(argv: list[str]) -> dict[str, Any]:
    meta: dict[str, Any] = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                            "command": shlex.join(["python", "bench/e2e/run_vllm_e2e.py", *argv])}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        meta["nvidia_smi"] = out.stdout.strip()
    except Exception as e:  # noqa: BLE001
        meta["nvidia_smi"] = f"{type(e).__name__}: {e}"
    meta["versions"] = _versions()
    return meta


def _cache_state(key: str) -> dict[str, Any]:
    """What the cache root holds when the preflight misses: the root msa-jit resolved, the
    entries on disk (meta.json files), and the lstat of the first config's entry dir and
    meta.json (a miss with the files present means a lookup problem, not a missing copy)."""
    from msa_jit.jit import cache as mcache

    out: dict[str, Any] = {}
    try:
        c = mcache.default_cache()
        out["root"] = str(c.root)
        out["readonly_roots"] = [str(r) for r in c.readonly_roots]
        out["fallback_reason"] = c.fallback_reason
        v1 = c.root / "v1"
        out["meta_files"] = sorted(str(p.relative_to(c.root)) for p in v1.glob("*/*/meta.json"))[:32]
        out["top"] = sorted(os.listdir(c.root))[:32] if c.root.is_dir() else None
        d = c.entry_path(key)
        for name, p in (("entry_dir", d), ("meta", d / "meta.json")):
            try:
                st = os.lstat(p)
                out[name] = {"path": str(p), "mode": oct(st.st_mode), "uid": st.st_uid, "size": st.st_size}
            except OSError as e:
                out[name] = {"path": str(p), "error": f"{type(e).__name__}: {e}"}
        out["uid"] = os.getuid()
    except Exception as e:  # noqa: BLE001 - a diagnostic: record and go on
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _preflight() -> dict[str, Any]:
    """Before any engine: vLLM imports, the plugin's entry point is visible, and every msa-jit
    kernel the modes need is in the cache (MSA_JIT_NO_COMPILE=1 hosts cannot build one)."""
    import importlib.metadata as md

    out: dict[str, Any] = {}
    try:
        eps = md.entry_points(group="vllm.general_plugins")
        out["entry_points"] = [f"{e.name} = {e.value}" for e in eps]
    except Exception as e:  # noqa: BLE001
        out["entry_points_error"] = f"{type(e).__name__}: {e}"
    try:
        from msa_jit.jit import compiler
        from msa_jit.tools import warmup

        configs = warmup.warmup_configs([(64, 4)], ["bfloat16", "float8_e4m3fn"], ["sm_90a"],
                                        kv_dtypes=["float8_e4m3fn", "nvfp4"])
        from msa_jit.jit import cache as msa_cache

        store = msa_cache.default_cache()
        missing = []
        for cfg in configs:  # look up only: never compile here
            if store.lookup(compiler.cache_key(cfg)) is None:
                missing.append(f"{cfg.describe()}: no entry {compiler.cache_key(cfg)} in {store.root}")
        out["kernels"] = {"needed": len(configs), "missing": missing,
                          "fingerprint": compiler.fingerprint(configs[0])}
        if missing:
            out["kernels"]["cache_state"] = _cache_state(compiler.cache_key(configs[0]))
    except Exception as e:  # noqa: BLE001
        out["kernels_error"] = f"{type(e).__name__}: {e}"
    return out


def run(args: argparse.Namespace, argv: list[str]) -> int:
    t_start = time.monotonic()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tag = args.tag or _dt.datetime.now().strftime("%Y-%m-%dT%H%M")
    summary_path = out_dir / f"vllm-e2e-{tag}.json"
    log_path = out_dir / f"vllm-e2e-{tag}.log"
    modes = plan.selected_modes(args.modes.split(",") if args.modes else None)
    graph_settings = [g for g in args.graphs.split(",") if g]
    points = plan.parse_points(args.points) if args.points is not None else plan.speed_points()
    meta = _meta(argv)
    meta["preflight"] = pf = _preflight()
    k = pf.get("kernels") or {}
    print(f"[e2e] preflight: plugin entry points {[e for e in pf.get('entry_points', []) if 'msa_jit' in e]}; "
          f"msa-jit kernels missing {len(k.get('missing', []))} of {k.get('needed')} "
          f"(fingerprint {k.get('fingerprint')}) {pf.get('kernels_error', '')}", flush=True)
    meta["model_config"] = plan.load_config(args.model_dir)
    meta["config_problems"] = plan.check_config(meta["model_config"])
    results: dict[str, dict[str, Any]] = {}
    runs = plan.schedule(modes, graph_settings)
    log = log_path.open("w")
    log.write(json.dumps(meta["preflight"], indent=1) + "\n")

    def write_summary() -> None:
        meta["wall_s"] = round(time.monotonic() - t_start, 1)
        summary_path.write_text(json.dumps(plan.summary(results, meta), indent=1, default=str))

    write_summary()
    for i, (mode, graphs) in enumerate(runs):
        key = plan.run_key(mode.name, graphs)
        if mode.fallback_for and not args.with_fallbacks:
            target = results.get(plan.run_key(mode.fallback_for, graphs))
            if target is not None and target.get("ok") and target.get("correctness"):
                continue  # the mode it stands in for ran
        left = args.deadline_s - (time.monotonic() - t_start)
        main_left = sum(1 for m, _ in runs[i:] if m.fallback_for is None)
        share = left / main_left if not mode.fallback_for else left  # fallbacks run last, on what is left
        if left < 60:
            results[key] = {**plan.new_mode_result(mode, graphs, {}, {}), "error": f"not run: {left:.0f}s left"}
            continue
        budget = max(60.0, min(left - 10, max(share, args.min_run_s)))
        out_json = work / f"{key}.json"
        argv_child = plan.child_argv(sys.executable, str(Path(__file__).resolve()), mode, graphs, str(out_json),
                                     args.model_dir, budget - 15, points, profile=not args.no_profile,
                                     profile_points=plan.parse_points(args.profile_points or ""))
        env = {**os.environ, **plan.mode_env(mode)}
        log.write(f"\n===== {key}: {shlex.join(argv_child)} (budget {budget:.0f}s)\n")
        log.flush()
        start = log.tell()
        print(f"[e2e] {key}: budget {budget:.0f}s of {left:.0f}s left", flush=True)
        t0 = time.monotonic()
        proc = subprocess.Popen(argv_child, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                rc = proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
        try:
            results[key] = json.loads(out_json.read_text())
        except (OSError, ValueError) as e:
            results[key] = {**plan.new_mode_result(mode, graphs, {}, {}),
                            "error": f"no result (exit {rc}): {type(e).__name__}: {e}"}
        results[key]["exit_code"] = rc
        if not results[key].get("log_lines"):  # the tap saw none: vLLM set its logging up again
            log.flush()
            with log_path.open("rb") as f:
                f.seek(start)
                plan.log_from_output(results[key], f.read().decode(errors="replace"), mode)
        results[key]["run_s"] = round(time.monotonic() - t0, 1)
        r = results[key]
        print(f"[e2e] {key}: exit {rc} in {r['run_s']}s, ok={r.get('ok')} phases={r.get('phases')} "
              f"error={r.get('error')}", flush=True)
        write_summary()
    log.close()
    write_summary()
    _print_table(plan.summary(results, meta))
    print(f"[e2e] wrote {summary_path} and {log_path}", flush=True)
    return 0


def _print_table(s: dict[str, Any]) -> None:
    print("\nrun                          ok     error", flush=True)
    for k, r in s["runs"].items():
        print(f"{k:28s} {str(r['ok']):6s} {(r['error'] or '')[:110]}")
    print("\nagreement                                  verdict               max|dlogprob|  in spread    agree steps")
    for k, a in s["agreement"].items():
        if a:
            print(f"{k:42s} {a['verdict']:21s} {str(a.get('max_abs_dlogprob')):14s} "
                  f"{str(a.get('within_spread', '-')):12s} {a.get('agree_steps')}")
    for k, r in s["results"].items():
        watched = (r.get("correctness") or {}).get("first_steps_vs_triton") or []
        if watched:
            worst = max(((e, w["call"], t) for w in watched for t, e in enumerate(w.get("rel_err_per_token") or [])),
                        default=None)
            errors = [w["error"] for w in watched if w.get("error")]
            print(f"first decode steps of {k} vs vLLM's Triton decode, per token: {len(watched)} calls, worst "
                  f"{worst and f'{worst[0]:.4g} (call {worst[1]}, token {worst[2]})'} {errors[:1]}")
        hc = r.get("hook_check")
        if hc:
            print(f"hook check {k}: ok={hc.get('ok')} rel_err={hc.get('rel_err')} {hc.get('error', '')}")
            so = hc.get("stream_order")
            if so:
                print(f"  decode in order on the engine's stream: {so.get('ordered')} "
                      f"({so.get('rows_written_after_poison')}/{so.get('rows')} rows) {so.get('error', '')}")
            et = hc.get("engine_triton")
            if et:
                print(f"  vs vLLM's own Triton decode on the same tensors: ok={et.get('ok')} rel_err={et.get('rel_err')} "
                      f"{et.get('error', '')}")
        pr = r.get("profile")
        if pr:
            print(f"profile {k} B={pr.get('batch')} ctx={pr.get('context')}: wall {pr.get('wall_ms_per_step')} ms/step, "
                  f"device {pr.get('device_ms_per_step')} ms/step, sparse decode share of device "
                  f"{pr.get('sparse_decode_share_of_device')}, {pr.get('categories_ms_per_step')}")
    cols = sorted(plan.speed_points())
    print("\nmode/graphs                 " + "".join(f"{f'B{b}x{c // 1024}k':>10s}" for b, c in cols))
    rows: dict[str, dict[tuple[int, int], Any]] = {}
    for t in s["speed_table"]:
        rows.setdefault(f"{t['mode']}/{t['graphs']}", {})[(t["batch"], t["context"])] = t["step_ms"]
    for k, row in rows.items():
        print(f"{k:28s}" + "".join(f"{(f'{row[p]:.2f}' if row.get(p) else '-'):>10s}" for p in cols))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="every (mode, graphs) in its own process, then the summary")
    r.add_argument("--out", required=True, help="folder for vllm-e2e-<tag>.json and .log")
    r.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "vllm-e2e-work"))
    r.add_argument("--tag", default=None)
    r.add_argument("--modes", default=None, help=f"comma-separated, default {','.join(plan.DEFAULT_MODES)}")
    r.add_argument("--graphs", default="eager", help="eager, graph or eager,graph")
    r.add_argument("--points", default=None, help="speed points as BxCONTEXT,... (default plan.speed_points())")
    r.add_argument("--deadline-s", type=float, default=540.0, help="seconds for every run together")
    r.add_argument("--min-run-s", type=float, default=90.0)
    r.add_argument("--with-fallbacks", action="store_true", help="run fallback modes even where their target ran")
    r.add_argument("--no-profile", action="store_true")
    r.add_argument("--profile-points", default=None, help="points run under torch.profiler, BxCONTEXT,... "
                   "(default plan.PROFILE_POINT)")
    r.add_argument("--model-dir", default=str(plan.MODEL_DIR))
    c = sub.add_parser("child", help="one (mode, graphs) in this process")
    c.add_argument("--mode", required=True, choices=sorted(plan.MODES))
    c.add_argument("--graphs", required=True, choices=plan.GRAPHS)
    c.add_argument("--out-json", required=True)
    c.add_argument("--model-dir", default=str(plan.MODEL_DIR))
    c.add_argument("--deadline-s", type=float, default=300.0)
    c.add_argument("--points", default="")
    c.add_argument("--no-profile", action="store_true")
    c.add_argument("--profile-points", default="")
    args = ap.parse_args(argv)
    if args.cmd == "child":
        return child(args)
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
