"""What the vLLM end-to-end run does, as data: modes, model configs, engine arguments, the speed
grid, the child command lines, the result schema and the agreement figures.

Pure Python (json, math, statistics): no vLLM, torch or GPU, so tests/test_e2e_harness.py checks it
on any machine. `run_vllm_e2e.py` beside it (which imports this as `plan`) runs these plans inside a real `vllm.LLM` on the GPU host.

A mode is one engine configuration; each runs in its own process (vLLM's engine state is
process-global), once per graph setting ("eager": enforce_eager=True; "graph": vLLM's default
torch.compile + CUDA graphs, MiniMax-M3 taking breakable graphs with its sparse attention eager).
"""

from __future__ import annotations

import copy
import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / "tiny_m3"
SCHEMA = "msa-jit-vllm-e2e/1"
SUMMARY_SCHEMA = "msa-jit-vllm-e2e-summary/1"
GRAPHS = ("eager", "graph")

# The geometry the kernels see (MiniMax-M3 at TP=1): every tiny config must keep it.
REAL_GEOMETRY = {
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "sparse_topk_blocks": 16,
    "sparse_block_size": 128,
    "sparse_index_dim": 128,
    "sparse_num_index_heads": 4,
}

# Engine settings every mode shares (offline, dummy weights, no tokenizer).
MAX_MODEL_LEN = 32768 + 512
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 16384
GPU_MEMORY_UTILIZATION = 0.85
MTP_TOKENS = 3
CUTLASS_KNOB = {"minimax_m3_msa_decode_backend": "cutlass"}

# Correctness: one prompt longer than 16 blocks x 128 = 2048 tokens (so the top-k block selection
# drops blocks), one just over it, two short ones; one mixed batch, greedy, top-5 logprobs per step.
CORRECTNESS_PROMPT_LENS = (4096, 2200, 300, 17)
CORRECTNESS_MAX_TOKENS = 48
CORRECTNESS_LOGPROBS = 5
PROMPT_SEED = 0
VOCAB_LOW = 1  # token ids drawn from [VOCAB_LOW, vocab_size - 1)

# Speed: batch x context, capped so one point's prefill stays under MAX_POINT_TOKENS tokens; the
# CORE_POINTS (one per batch, the profiled one among them) run first, so a run cut short by its
# time share still covers every batch.
SPEED_BATCHES = (1, 8, 32, 64)
SPEED_CONTEXTS = (4096, 8192, 16384, 32768)
MAX_POINT_TOKENS = 512 * 1024
CORE_POINTS = ((1, 32768), (8, 16384), (32, 8192), (64, 8192))
DECODE_STEPS = 16  # pure decode steps timed per point (all requests decoding, none finished)
PROFILE_POINT = (32, 8192)  # (batch, context) of the torch.profiler pass
PROFILE_STEPS = 4

# Weights: vLLM's dummy values are +-1e-3, which leaves every logit within ~0.02 of the others
# (every greedy step a near-tie). Each float matrix is redrawn N(0, 1/fan_in) from a generator
# seeded by its name (so every mode and process gets the same model), the LM head gain-scaled so
# greedy steps are clear, and the per-head q norm's Gemma weight set so (1 + w) sharpens scores.
REINIT = {"seed": 0, "lm_head_gain": 4.0, "embed_std": 1.0, "q_norm_scale": 2.0}

# Agreement: a divergence is a near-tie when the reference's own log-prob gap between its token
# and the other run's token is within NEAR_TIE_FACTOR x the largest |delta log-prob| seen on the
# agreeing steps before it (the noise both runs showed), and at least NEAR_TIE_FLOOR nats.
NEAR_TIE_FACTOR = 2.0
NEAR_TIE_FLOOR = 0.05
# Agreement against the engine's own spread. On this dummy-weight model a greedy continuation is
# no fine test of a decode kernel: a per-layer difference of ~2e-3 relative (what msa-jit and
# vLLM's Triton decode show on the same tensors, `first_steps_vs_triton`) grows through the layers
# and the redrawn LM head into log-prob differences of tenths of a nat and, at the next close call,
# a different token. vLLM's own two fp8 decode paths show it: SPREAD_CONTROL, the same Triton
# kernel fed the bf16 query (vLLM alone) or the fp8 query of the fused insert (the plugin's path),
# part within a few steps. A fixed tolerance in nats would be a statement about the model, not the
# kernel: the few hundredths that 2e-3 per layer suggests would fail vLLM against itself. So a pair
# is judged against what the engine itself varies by: "within_spread" when its max and median
# |delta log-prob| over the agreeing steps are at most the control pair's (in the same graph
# setting), or SPREAD_FLOOR where the control's are smaller. The tight tests of the decode are the
# per-layer ones (hook_check, first_steps_vs_triton); this one asks that msa-jit move the model's
# output no more than vLLM's own choice of query format does.
SPREAD_CONTROL = ("triton_fp8", "msa_fp8_engine_triton")
# One bf16 rounding step of a logit between 8 and 16, where the redrawn model's logits sit (every
# log-prob gap between two tokens of a step comes in multiples of 1/16): two runs whose logits
# differ by one rounding cannot be told apart, so a control that agrees exactly (graph against
# eager) does not demand bit-equal log-probs.
SPREAD_FLOOR = 0.0625
# Sparse-layer decode calls of the correctness generate compared per token with vLLM's Triton decode
# (msa-jit fp8 modes): the first two decode steps of the 7 sparse layers, the plan's first step
# (plan build, kernel load) included.
WATCHED_DECODE_CALLS = 14
# The hooked layer's output against msa_jit.reference (float64, same fp8/NVFP4 inputs): bf16
# output rounding and fp32 accumulation, far under the fp8 / NVFP4 quantization itself.
HOOK_MAX_REL_ERR = 2e-2


@dataclass(frozen=True)
class Mode:
    """One engine configuration."""

    name: str
    what: str
    kv_cache_dtype: str
    plugin: bool  # MSA_JIT_VLLM_PLUGIN=1 (else 0: vLLM alone)
    attention_config: dict[str, Any] = field(default_factory=dict)
    speculative_tokens: int = 0  # MTP draft tokens (0: no speculative decoding)
    skip_dense_layers: bool = False  # kv_cache_dtype_skip_layers = the dense layers (bf16 cache there)
    all_sparse: bool = False  # the config with every layer sparse (no dense layer)
    expect_log: tuple[str, ...] = ()  # substrings vLLM's log must show
    fallback_for: str | None = None  # run only where that mode failed (or when named)
    env: tuple[tuple[str, str], ...] = ()  # extra environment of the mode's process
    engine_decode: bool = False  # decode through vLLM's own kernel although the plugin is on

    @property
    def msa(self) -> bool:
        return self.plugin and not self.engine_decode and (self.kv_cache_dtype.startswith("nvfp4") or
                                self.attention_config.get("minimax_m3_msa_decode_backend") == "cutlass")


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("triton_fp8", "vLLM alone: its Triton sparse decode, fp8 cache (plugin off)", "fp8", plugin=False,
         expect_log=("MiniMax M3 sparse attention selected Triton",)),
    Mode("msa_fp8", "msa-jit through the plugin, fp8 cache, the engine's cutlass knob", "fp8", plugin=True,
         attention_config=dict(CUTLASS_KNOB),
         expect_log=("msa-jit vLLM plugin: MiniMax-M3 decode on SM90", "MSA sparse decode selected CUTLASS")),
    Mode("msa_fp8_engine_triton", "the plugin's engine path (vLLM's MSA backend: the fused insert's fp8 query, "
         "msa-jit's prefill) with decode through vLLM's own Triton kernel: the CUTLASS floor above every batch, "
         "so the decode kernel is the only difference from msa_fp8", "fp8", plugin=True,
         attention_config=dict(CUTLASS_KNOB), env=(("VLLM_MINIMAX_M3_MSA_CUTLASS_MIN_BATCH", "1000000"),), engine_decode=True,
         expect_log=("msa-jit vLLM plugin: MiniMax-M3 decode on SM90",)),
    Mode("msa_nvfp4", "msa-jit, NVFP4 cache on the sparse layers; the dense layers kept bf16 "
         "(kv_cache_dtype_skip_layers), which FA3 serves on SM90", "nvfp4", plugin=True, skip_dense_layers=True,
         expect_log=("msa-jit vLLM plugin: MiniMax-M3 decode on SM90", "MSA sparse decode selected CUTLASS")),
    Mode("msa_nvfp4_allsparse", "msa-jit, NVFP4 cache, every layer sparse (no dense layer to serve): "
         "the NVFP4 decode path alone, where msa_nvfp4 cannot start", "nvfp4", plugin=True, all_sparse=True,
         expect_log=("MSA sparse decode selected CUTLASS",), fallback_for="msa_nvfp4"),
    Mode("msa_mtp", f"msa-jit, fp8 cache, MTP speculative decoding ({MTP_TOKENS} draft tokens: "
         f"verification steps of {MTP_TOKENS + 1} query tokens)", "fp8", plugin=True,
         attention_config=dict(CUTLASS_KNOB), speculative_tokens=MTP_TOKENS,
         expect_log=("MSA sparse decode selected CUTLASS",)),
)}
DEFAULT_MODES = ("triton_fp8", "msa_fp8", "msa_fp8_engine_triton", "msa_nvfp4", "msa_nvfp4_allsparse", "msa_mtp")
# (reference, other, judged) pairs the summary compares in each graph setting. A judged pair gets
# "within_spread" against SPREAD_CONTROL; the others are reported, not judged, for want of a
# control that isolates what they change:
# - msa_fp8 against msa_fp8_engine_triton (judged): the same engine path, only the decode kernel
#   differs: the pair that asks about msa-jit.
# - msa_mtp against msa_fp8 (judged): the same arithmetic per verified token, in steps of 4 query
#   tokens instead of 1 (other batch shapes, other roundings).
# - msa_fp8 against triton_fp8: the kernel and the query format at once, each measured by a pair of
#   its own (the first above and the control).
# - the control itself; NVFP4 against fp8: a change of format (4-bit values), whose deviation is the
#   format's.
COMPARISONS = (
    ("msa_fp8_engine_triton", "msa_fp8", True),
    ("triton_fp8", "msa_fp8_engine_triton", False),
    ("triton_fp8", "msa_fp8", False),
    ("msa_fp8", "msa_mtp", True),
    ("msa_fp8", "msa_nvfp4", False),
    ("msa_fp8", "msa_nvfp4_allsparse", False),
    ("triton_fp8", "msa_nvfp4", False),
)
# A mode with CUDA graphs against itself eager is judged against vLLM alone's graph-against-eager
# (GRAPH_CONTROL): what capture changes in the engine by itself (batch padding to a captured size,
# torch.compile's fusions). MTP modes are reported only: vLLM alone was not run with MTP, whose
# graphs capture verification steps of 4 tokens, so no run shows what capture does to those.
GRAPH_CONTROL = "triton_fp8"


# ----------------------------------------------------------------------------- model config
def load_config(model_dir: Path | str = MODEL_DIR) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


def dense_layers(config: dict[str, Any]) -> list[int]:
    """Layer ids vLLM builds as dense attention: sparse_attention_freq[i] == 0 (vLLM 0.33's
    `_sparse_attention_layer_ids`: every other id is a sparse layer)."""
    tc = text_config(config)
    freq = (tc.get("sparse_attention_config") or {}).get("sparse_attention_freq")
    if freq is None:
        return list(range(tc["num_hidden_layers"]))
    return [i for i, f in enumerate(freq) if f == 0]


def check_config(config: dict[str, Any]) -> list[str]:
    """Every way `config` departs from what the harness needs (empty: fine): vLLM's nested
    minimax_m3_vl layout with the text-only architecture, MiniMax-M3's attention geometry
    (REAL_GEOMETRY), per-layer lists as long as the layer count, partial RoPE over half the head."""
    problems = []
    if config.get("model_type") != "minimax_m3_vl" or "text_config" not in config:
        problems.append("model_type must be minimax_m3_vl with a text_config (vLLM 0.33's MiniMaxM3Config)")
    if config.get("architectures") != ["MiniMaxM3SparseForCausalLM"]:
        problems.append("architectures must be ['MiniMaxM3SparseForCausalLM'] (the text-only model)")
    if config.get("vision_config") is not None:
        problems.append("vision_config must be null (no vision tower)")
    tc = text_config(config)
    sc = tc.get("sparse_attention_config") or {}
    for key, want in REAL_GEOMETRY.items():
        got = sc.get(key) if key.startswith("sparse_") else tc.get(key)
        if got != want:
            problems.append(f"{key} = {got!r}, MiniMax-M3 has {want}")
    n = tc.get("num_hidden_layers")
    for where, key in (("text_config", "moe_layer_freq"), ("sparse_attention_config", "sparse_attention_freq"),
                       ("sparse_attention_config", "sparse_disable_index_value")):
        values = (tc if where == "text_config" else sc).get(key)
        if not isinstance(values, list) or len(values) != n:
            problems.append(f"{key} must list all {n} layers, got {values!r}")
    if tc.get("partial_rotary_factor") != 0.5:
        problems.append("partial_rotary_factor must be 0.5 (RoPE over 64 of the 128 dims)")
    if tc.get("hidden_act") != "swigluoai":
        problems.append("hidden_act must be swigluoai (vLLM's M3 code raises on anything else)")
    if tc.get("max_position_embeddings", 0) < MAX_MODEL_LEN:
        problems.append(f"max_position_embeddings must cover max_model_len {MAX_MODEL_LEN}")
    return problems


def all_sparse_config(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with every layer a sparse attention layer (MLPs unchanged)."""
    out = copy.deepcopy(config)
    tc = text_config(out)
    n = tc["num_hidden_layers"]
    sc = tc["sparse_attention_config"]
    sc["sparse_attention_freq"] = [1] * n
    sc["sparse_disable_index_value"] = [1] * n
    return out


# ----------------------------------------------------------------------------- engine arguments
def llm_kwargs(mode: Mode, graphs: str, model_dir: str, config: dict[str, Any]) -> dict[str, Any]:
    """The `vllm.LLM(**kwargs)` of `mode` (JSON-serializable; recorded in the result)."""
    if graphs not in GRAPHS:
        raise ValueError(f"graphs must be one of {GRAPHS}, got {graphs!r}")
    kw: dict[str, Any] = dict(
        model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
        max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION, enable_prefix_caching=False,
        enforce_eager=graphs == "eager", kv_cache_dtype=mode.kv_cache_dtype,
    )
    if mode.attention_config:
        kw["attention_config"] = dict(mode.attention_config)
    if mode.skip_dense_layers:
        kw["kv_cache_dtype_skip_layers"] = [str(i) for i in dense_layers(config)]
    if mode.speculative_tokens:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": mode.speculative_tokens}
    if graphs == "graph":
        # capture up to the largest decode batch (times the verified tokens with MTP), no further
        kw["compilation_config"] = {"max_cudagraph_capture_size": MAX_NUM_SEQS * (1 + mode.speculative_tokens)}
    return kw


def mode_env(mode: Mode) -> dict[str, str]:
    """Environment variables of `mode`'s process, beyond device_run.sh's."""
    return {"MSA_JIT_VLLM_PLUGIN": "1" if mode.plugin else "0", **dict(mode.env)}


# ----------------------------------------------------------------------------- speed grid
def speed_points(batches: Iterable[int] = SPEED_BATCHES, contexts: Iterable[int] = SPEED_CONTEXTS,
                 max_tokens: int = MAX_POINT_TOKENS, max_model_len: int = MAX_MODEL_LEN,
                 max_num_seqs: int = MAX_NUM_SEQS, core: Iterable[tuple[int, int]] = CORE_POINTS) -> list[tuple[int, int]]:
    """(batch, context) points within the engine's limits and the prefill cap: those of `core`
    first (in its order), then the others, batch-major."""
    grid = [(b, c) for b in batches for c in contexts
            if b * c <= max_tokens and c + 64 <= max_model_len and b <= max_num_seqs]
    first = [p for p in core if p in grid]
    return first + [p for p in grid if p not in first]


def point_max_tokens(batch: int, context: int, spec_tokens: int = 0,
                     budget: int = MAX_NUM_BATCHED_TOKENS, decode_steps: int = DECODE_STEPS) -> int:
    """max_tokens per request so that, after the last request's prefill (chunked over
    ceil(batch * context / budget) steps, during which the first ones already decode),
    `decode_steps` steps still find every request decoding."""
    skew = math.ceil(batch * context / budget) + 1
    return (skew + decode_steps + 4) * (1 + spec_tokens)


def prompt_ids(lengths: Sequence[int], vocab_size: int, seed: int = PROMPT_SEED) -> list[list[int]]:
    """Deterministic pseudo-random token ids (no torch: a 64-bit LCG), one list per length."""
    state = (seed * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
    span = vocab_size - 1 - VOCAB_LOW
    out = []
    for n in lengths:
        ids = []
        for _ in range(n):
            state = (state * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
            ids.append(VOCAB_LOW + (state >> 33) % span)
        out.append(ids)
    return out


def decode_steps(steps: Sequence[dict[str, Any]], batch: int) -> list[dict[str, Any]]:
    """The steps where all `batch` requests were decoding: after the step in which the last one got
    its first output token, before the first one finished. `steps`: per engine step {"s": seconds,
    "started": requests with an output token so far, "finished": requests done, ...}."""
    return [cur for prev, cur in zip(steps, steps[1:]) if prev["started"] >= batch and cur["finished"] == 0]


def decode_step_times(steps: Sequence[dict[str, Any]], batch: int) -> list[float]:
    """Seconds of the `decode_steps`."""
    return [st["s"] for st in decode_steps(steps, batch)]


def calls_per_step(steps: Sequence[dict[str, Any]], batch: int) -> dict[str, float] | None:
    """Median calls per decode step of each name counted in the steps' "calls" ({name: calls}), None
    without counts: 0 for a per-layer name where the step replays a FULL CUDA graph, the number of
    sparse layers where they run in eager breaks."""
    counted = [st["calls"] for st in decode_steps(steps, batch) if st.get("calls") is not None]
    if not counted:
        return None
    return {k: statistics.median(c.get(k, 0) for c in counted) for k in counted[0]}


def summarize_times(seconds: Sequence[float]) -> dict[str, Any]:
    """{n, median_ms, p10_ms, p90_ms, min_ms} of step times (None values without steps)."""
    if not seconds:
        return {"n": 0, "median_ms": None, "p10_ms": None, "p90_ms": None, "min_ms": None}
    ms = sorted(1e3 * s for s in seconds)

    def pct(p: float) -> float:
        return ms[min(len(ms) - 1, max(0, round(p * (len(ms) - 1))))]

    return {"n": len(ms), "median_ms": round(statistics.median(ms), 4), "p10_ms": round(pct(0.1), 4),
            "p90_ms": round(pct(0.9), 4), "min_ms": round(ms[0], 4)}


# ----------------------------------------------------------------------------- profiler
KERNEL_CATEGORIES = (
    # (category, substrings of the kernel name; the first category that matches wins)
    ("msa_decode", ("msa_jit",)),  # msa-jit's kernels: kernel_cutlass_kernel_msa_jitkernels...
    ("triton_sparse_decode", ("_gqa_sparse_decode_kernel", "_merge_topk_attn_out_kernel")),
    ("sparse_prefill", ("_gqa_sparse_fwd_kernel",)),
    ("indexer", ("index_score", "topk_index", "index_block_score", "build_k2q")),
    ("dense_attention", ("flash", "fmha", "FlashAttn")),
    ("moe", ("moe", "expert", "topk_softmax", "grouped_topk")),
    ("gemm", ("gemm", "sm90_xmma", "nvjet", "cutlass", "Gemm", "matmul")),
)


def kernel_category(name: str) -> str:
    for cat, keys in KERNEL_CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other"


def profile_summary(kernels: Iterable[tuple[str, float]], steps: int, wall_s: float, *,
                    device_span_s: float | None = None,
                    host_ops: Iterable[tuple[str, float]] = ()) -> dict[str, Any]:
    """Per-step device milliseconds by category from (kernel name, device seconds) pairs of
    `steps` engine steps that took `wall_s` in all; the MSA decode's share of the device time and
    of the wall time ("msa_decode", else the Triton sparse decode of vLLM alone).

    device_span_s: first kernel start to last kernel end (its excess over the kernels' sum is where
    the GPU waited: on the host, or between kernels); host_ops: (host op name, self seconds) of the
    profiled host events, summed per name (the 15 largest per step: where a step's host time goes
    when the device is not the difference)."""
    by_cat: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for name, s in kernels:
        by_cat[kernel_category(name)] = by_cat.get(kernel_category(name), 0.0) + s
        by_name[name] = by_name.get(name, 0.0) + s
    host: dict[str, float] = {}
    for name, s in host_ops:
        host[name] = host.get(name, 0.0) + s
    device = sum(by_cat.values())
    decode = by_cat.get("msa_decode", 0.0) or by_cat.get("triton_sparse_decode", 0.0)
    per = max(steps, 1)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    return {
        "steps": steps,
        "wall_ms_per_step": round(1e3 * wall_s / per, 4),
        "device_ms_per_step": round(1e3 * device / per, 4),
        "categories_ms_per_step": {k: round(1e3 * v / per, 4) for k, v in sorted(by_cat.items())},
        "sparse_decode_share_of_device": round(decode / device, 4) if device else None,
        "sparse_decode_share_of_wall": round(decode / wall_s, 4) if wall_s else None,
        "top_kernels": [{"name": n[:160], "category": kernel_category(n), "ms_per_step": round(1e3 * s / per, 4)}
                        for n, s in top],
        "device_span_ms_per_step": None if device_span_s is None else round(1e3 * device_span_s / per, 4),
        "top_host_ops": [{"name": n[:160], "self_ms_per_step": round(1e3 * s / per, 4)}
                         for n, s in sorted(host.items(), key=lambda kv: -kv[1])[:15]],
    }


# ----------------------------------------------------------------------------- agreement
def agreeing_deltas(ref: dict[str, Any], other: dict[str, Any]) -> tuple[int, list[float]]:
    """(steps the two greedy continuations agree on from the start, the other's log-prob of the
    shared token minus the reference's on each of those steps where both have it). Each side:
    {"token_ids": [...], "logprobs": [[[token, logprob], ...] per step] or None}."""
    a, b = ref["token_ids"], other["token_ids"]
    n = min(len(a), len(b))
    agree = next((i for i in range(n) if a[i] != b[i]), n)
    la, lb = ref.get("logprobs"), other.get("logprobs")
    deltas = []
    if la and lb:
        for i in range(min(agree, len(la), len(lb))):
            pa, pb = dict(map(tuple, la[i])), dict(map(tuple, lb[i]))
            if a[i] in pa and a[i] in pb:
                deltas.append(pb[a[i]] - pa[a[i]])
    return agree, deltas


def compare_greedy(ref: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Agreement of one prompt's greedy continuations (sides as in agreeing_deltas): the steps
    they agree on, |delta log-prob| on those, and at the first divergence `gap`, the reference's
    log-prob of its token minus that of the other's token (None when outside the reference's
    top-k): a near-tie when gap <= max(NEAR_TIE_FLOOR, NEAR_TIE_FACTOR x the largest |delta|
    before it)."""
    a, b = ref["token_ids"], other["token_ids"]
    n = min(len(a), len(b))
    agree, deltas = agreeing_deltas(ref, other)
    la = ref.get("logprobs")
    absd = [abs(d) for d in deltas]
    out: dict[str, Any] = {
        "steps": n, "agree_steps": agree, "identical": agree == n and len(a) == len(b),
        "max_abs_dlogprob": round(max(absd), 6) if absd else None,
        "median_abs_dlogprob": round(statistics.median(absd), 6) if absd else None,
        "mean_dlogprob": round(statistics.fmean(deltas), 6) if deltas else None,
        "divergence": None,
    }
    if agree < n:
        gap = None
        if la and agree < len(la):
            pa = dict(map(tuple, la[agree]))
            if a[agree] in pa and b[agree] in pa:
                gap = round(pa[a[agree]] - pa[b[agree]], 6)
        threshold = max(NEAR_TIE_FLOOR, NEAR_TIE_FACTOR * (max(absd) if absd else 0.0))
        out["divergence"] = {"step": agree, "ref_token": a[agree], "other_token": b[agree], "gap": gap,
                             "near_tie_threshold": round(threshold, 6),
                             "near_tie": gap is not None and gap <= threshold}
    return out


def compare_runs(ref: dict[str, Any] | None, other: dict[str, Any] | None) -> dict[str, Any] | None:
    """compare_greedy of every prompt of two mode results' "correctness" sections; the verdict
    ("identical", "agree_until_near_tie": every divergence a near-tie, "diverged" or "missing");
    max and median |delta log-prob| over the agreeing steps of all prompts together, and how many
    steps they are (`dlogprob_steps`)."""
    if not ref or not other:
        return None
    ca, cb = ref.get("correctness") or {}, other.get("correctness") or {}
    oa, ob = ca.get("outputs"), cb.get("outputs")
    if not oa or not ob or len(oa) != len(ob):
        return {"verdict": "missing", "prompts": []}
    per = [compare_greedy(x, y) for x, y in zip(oa, ob)]
    if all(p["identical"] for p in per):
        verdict = "identical"
    elif all(p["divergence"] is None or p["divergence"]["near_tie"] for p in per):
        verdict = "agree_until_near_tie"
    else:
        verdict = "diverged"
    absd = [abs(d) for x, y in zip(oa, ob) for d in agreeing_deltas(x, y)[1]]
    return {"verdict": verdict, "prompt_lens": ca.get("prompt_lens"),
            "max_abs_dlogprob": round(max(absd), 6) if absd else None,
            "median_abs_dlogprob": round(statistics.median(absd), 6) if absd else None,
            "dlogprob_steps": len(absd), "agree_steps": [p["agree_steps"] for p in per], "prompts": per}


def judge_spread(pair: dict[str, Any] | None, control: dict[str, Any] | None, control_name: str,
                 floor: float = SPREAD_FLOOR) -> dict[str, Any] | None:
    """`pair` (a compare_runs result) with "spread" (the control's figures) and "within_spread":
    True when the pair's max and median |delta log-prob| are each at most max(the control's,
    `floor`); False also when the pair's runs part at the first step of every prompt; None (not
    judged) without a control that has log-probs, or with agreeing steps that have none."""
    if pair is None:
        return None
    out = dict(pair)
    usable = control is not None and control.get("verdict") != "missing" and control.get("dlogprob_steps")
    out["spread"] = {"control": control_name, "floor": floor,
                     "control_max_abs_dlogprob": control.get("max_abs_dlogprob") if usable else None,
                     "control_median_abs_dlogprob": control.get("median_abs_dlogprob") if usable else None}
    if not usable or pair.get("verdict") == "missing":
        out["within_spread"] = None
    elif not pair.get("dlogprob_steps"):  # agreeing steps without log-probs: nothing to weigh
        out["within_spread"] = False if not any(p["agree_steps"] for p in pair["prompts"]) else None
    else:
        out["within_spread"] = (pair["max_abs_dlogprob"] <= max(control["max_abs_dlogprob"], floor)
                                and pair["median_abs_dlogprob"] <= max(control["median_abs_dlogprob"], floor))
    return out


def agreement(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The agreement of COMPARISONS per graph setting and of each mode with CUDA graphs against
    itself eager, from mode results keyed by run_key; judged pairs against their control."""
    out: dict[str, Any] = {}
    for graphs in GRAPHS:
        control = compare_runs(results.get(run_key(SPREAD_CONTROL[0], graphs)),
                               results.get(run_key(SPREAD_CONTROL[1], graphs)))
        control_name = f"{SPREAD_CONTROL[1]} vs {SPREAD_CONTROL[0]} ({graphs})"
        for ref, other, judged in COMPARISONS:
            pair = compare_runs(results.get(run_key(ref, graphs)), results.get(run_key(other, graphs)))
            if pair is not None:
                out[f"{other} vs {ref} ({graphs})"] = judge_spread(pair, control, control_name) if judged else pair
    graph_control = compare_runs(results.get(run_key(GRAPH_CONTROL, "eager")),
                                 results.get(run_key(GRAPH_CONTROL, "graph")))
    for name, mode in MODES.items():
        pair = compare_runs(results.get(run_key(name, "eager")), results.get(run_key(name, "graph")))
        if pair is not None:
            judged = not mode.speculative_tokens and name != GRAPH_CONTROL
            out[f"{name}: graph vs eager"] = (judge_spread(pair, graph_control, f"{GRAPH_CONTROL}: graph vs eager")
                                              if judged else pair)
    return out


# ----------------------------------------------------------------------------- results
MODE_KEYS = {  # key -> type(s) of a mode result (None allowed where the phase did not run)
    "schema": str, "mode": str, "graphs": str, "ok": bool, "error": (str, type(None)),
    "what": str, "llm_kwargs": dict, "env": dict, "versions": dict, "device": (str, type(None)),
    "phases": list, "log_lines": list, "engine_start_s": (float, type(None)),
    "correctness": (dict, type(None)), "hook_check": (dict, type(None)), "speed": list,
    "profile": (dict, type(None)), "wall_s": (float, type(None)),
}


def new_mode_result(mode: Mode, graphs: str, kwargs: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    return {"schema": SCHEMA, "mode": mode.name, "graphs": graphs, "ok": False, "error": None,
            "what": mode.what, "llm_kwargs": kwargs, "env": env, "versions": {}, "device": None,
            "phases": [], "log_lines": [], "engine_start_s": None, "correctness": None, "hook_check": None,
            "speed": [], "profile": None, "wall_s": None}


def check_mode_result(result: dict[str, Any]) -> list[str]:
    """Schema problems of a mode result (empty: valid)."""
    problems = [f"missing key {k!r}" for k in MODE_KEYS if k not in result]
    problems += [f"{k}: {type(result[k]).__name__}" for k, t in MODE_KEYS.items()
                 if k in result and not isinstance(result[k], t)]
    if result.get("schema") != SCHEMA:
        problems.append(f"schema {result.get('schema')!r} != {SCHEMA!r}")
    if result.get("graphs") not in GRAPHS:
        problems.append(f"graphs {result.get('graphs')!r}")
    for p in result.get("speed") or []:
        for k in ("batch", "context", "ok", "step"):
            if k not in p:
                problems.append(f"speed point without {k!r}")
    if result.get("ok") and result.get("error"):
        problems.append("ok with an error")
    return problems


def run_key(mode: str, graphs: str) -> str:
    return f"{mode}-{graphs}"


def summary(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The combined result: meta (device, versions, date, command), every mode result, the
    agreement (`agreement`) and one speed table row per (mode, point)."""
    table = []
    for key, r in sorted(results.items()):
        for p in r.get("speed") or []:
            table.append({"mode": r["mode"], "graphs": r["graphs"], "batch": p["batch"], "context": p["context"],
                          "step_ms": (p.get("step") or {}).get("median_ms"),
                          "tokens_per_step": p.get("tokens_per_step"), "ok": p["ok"]})
    return {"schema": SUMMARY_SCHEMA, **meta,
            "runs": {k: {"ok": r.get("ok"), "error": r.get("error"), "phases": r.get("phases")}
                     for k, r in sorted(results.items())},
            "agreement": agreement(results), "speed_table": table, "results": results}


# ----------------------------------------------------------------------------- vLLM's log
# Substrings of vLLM's log messages that say what was selected: the child keeps those it sees
# through a handler on the "vllm" logger. Inside vLLM 0.33's engine on the GPU host that handler
# has received none (the output holds the lines, its list stayed empty; the cause is not known), so
# where it has none the parent reads them from the child's output (log_from_output), where each
# line reads "(MainProcess pid=N) LEVEL MM-DD hh:mm:ss [file.py:line] message".
LOG_PATTERNS = ("msa-jit", "MiniMax M3", "attention backend", "Using ", "block size", "KV cache",
                "kv cache", "speculative", "CUDA graph", "cudagraph", "skip", "nvfp4", "NVFP4", "Error", "error",
                "WARNING", "Traceback")
_OUTPUT_LOG_LINE = re.compile(r"^(?:\(\w+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                              r"\d\d-\d\d \d\d:\d\d:\d\d (\[[^\]]*\]) (.*)$")


def selection_lines(text: str, limit: int = 300) -> list[str]:
    """vLLM's log lines in a process's output whose message matches LOG_PATTERNS, as
    "LEVEL [file.py:line] message" (at most 600 characters of it), at most `limit`."""
    out = []
    for line in text.splitlines():
        m = _OUTPUT_LOG_LINE.match(line)
        if m and any(p in m.group(3) for p in LOG_PATTERNS):
            out.append(f"{m.group(1)} {m.group(2)} {m.group(3)[:600]}")
            if len(out) >= limit:
                break
    return out


def log_from_output(result: dict[str, Any], text: str, mode: Mode) -> dict[str, Any]:
    """`result`'s log_lines and expect_log from the process output `text` (log_lines_from says so)."""
    result["log_lines"] = selection_lines(text)
    result["log_lines_from"] = "process output"
    result["expect_log"] = {s: any(s in line for line in result["log_lines"]) for s in mode.expect_log}
    return result


# ----------------------------------------------------------------------------- processes
def selected_modes(names: Sequence[str] | None) -> list[Mode]:
    """Modes by name (default DEFAULT_MODES), in the order given; unknown names raise."""
    names = list(names or DEFAULT_MODES)
    unknown = [n for n in names if n not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    return [MODES[n] for n in names]


def child_argv(python: str, script: str, mode: Mode, graphs: str, out_json: str, model_dir: str,
               deadline_s: float, points: Sequence[tuple[int, int]], profile: bool = True,
               profile_points: Sequence[tuple[int, int]] = ()) -> list[str]:
    """Command line of the process that runs one (mode, graphs); profile_points: the points run under
    torch.profiler (none given: PROFILE_POINT)."""
    argv = [python, script, "child", "--mode", mode.name, "--graphs", graphs, "--out-json", out_json,
            "--model-dir", model_dir, "--deadline-s", f"{deadline_s:.0f}",
            "--points", ",".join(f"{b}x{c}" for b, c in points)]
    if not profile:
        argv.append("--no-profile")
    elif profile_points:
        argv += ["--profile-points", ",".join(f"{b}x{c}" for b, c in profile_points)]
    return argv


def parse_points(text: str) -> list[tuple[int, int]]:
    """'1x4096,8x32768' -> [(1, 4096), (8, 32768)]; '' -> []."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        b, _, c = part.partition("x")
        out.append((int(b), int(c)))
    return out


def schedule(modes: Sequence[Mode], graph_settings: Sequence[str]) -> list[tuple[Mode, str]]:
    """The (mode, graphs) runs in order: every mode's run for the first graph setting, then the
    next setting's; fallback modes (run only where the mode they stand in for failed) last."""
    runs = [(m, g) for g in graph_settings for m in modes if m.fallback_for is None]
    runs += [(m, g) for g in graph_settings for m in modes if m.fallback_for is not None]
    return runs
