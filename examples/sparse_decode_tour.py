# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A tour of MSA block-sparse decode with `msa_jit`
#
# MiniMax-M3's MSA attention lets every decode query token attend, per KV head, only to the
# **top-16 blocks of 128 tokens** of its request's context, chosen by an indexer. This notebook
#
# 1. builds a decode batch that follows the operator contract,
# 2. draws which blocks every token and KV head selected,
# 3. runs the op (the compiled kernel on a GPU, the float64 reference backend on a CPU) and
#    measures its error against the float64 reference,
# 4. plots the benchmark's roofline from the newest result in `bench/results/`.
#
# It runs top to bottom on a CPU-only machine too. The source of truth is
# `examples/sparse_decode_tour.py` (jupytext percent format); the `.ipynb` is generated from it
# (`jupytext --to ipynb --update examples/sparse_decode_tour.py`, which keeps the cell ids) and
# committed without outputs.

# %%
import json
import statistics
import sys
from pathlib import Path

# the repository root (holds msa_jit/, examples/, bench/): the working directory or a parent
ROOT = Path.cwd().resolve()
while not (ROOT / "msa_jit").is_dir() and ROOT != ROOT.parent:
    ROOT = ROOT.parent
for p in (ROOT, ROOT / "examples"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap
import numpy as np
import torch

import msa_jit
from quickstart import errors, random_step

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BACKEND = "kernel" if CUDA else "reference"
print(f"msa_jit {msa_jit.__version__} | torch {torch.__version__} | "
      f"{torch.cuda.get_device_name() if CUDA else 'CPU only'} | backend: {BACKEND}")
if not CUDA:
    print("No GPU: the op runs its float64 reference backend; the kernel needs CUDA.")

# %% [markdown]
# ## 1. A decode batch
#
# Four requests with different context lengths (a short one, a mid one, two long ones),
# `qlen = 4` query tokens per request (1 + 3 speculative tokens), the TP1 geometry of
# MiniMax-M3: 64 query heads over 4 KV heads. Tokens are request-major (`T = B * qlen`); `topk`
# holds **logical** block indices of the request (ascending, padded with -1), the block table
# maps them to physical pages of the fp8 KV cache.

# %%
HQ, HKV, QLEN, PAGE, TOPK = 64, 4, 4, 128, 16
CTX = [300, 2500, 4096, 6000]
step = random_step(len(CTX), QLEN, HQ, HKV, ctx_lens=CTX, device=DEVICE, seed=1)
for name in ("query", "kv_cache", "topk", "block_table", "seq_lens"):
    t = step[name]
    print(f"{name:12s} {str(list(t.shape)):22s} {str(t.dtype):22s}")
print("topk of token 0, KV head 0:", step["topk"][0, 0].tolist())

# %% [markdown]
# ## 2. The sparsity pattern
#
# One panel per request; a row per (query token `j`, KV head `h`), a column per logical block.
# Blue: selected (these are the only KV blocks read); grey: in the token's causal context but
# not selected; white: past the token's context. Short requests select everything they have;
# long ones read 16 of their blocks, always including the block of the current position.

# %%
def selection_map(topk: torch.Tensor, seq_len: int, qlen: int, max_blocks: int) -> np.ndarray:
    """[qlen*Hkv, max_blocks] map: 0 outside the context, 1 visible, 2 selected."""
    tk = topk.cpu()
    hkv = tk.shape[1]
    m = np.zeros((qlen * hkv, max_blocks), dtype=np.int8)
    for j in range(qlen):
        kv_len = max(seq_len - qlen + j + 1, 0)
        nvis = -(-kv_len // PAGE)
        for h in range(hkv):
            row = j * hkv + h
            m[row, :nvis] = 1
            for b in tk[j, h, : min(TOPK, nvis)].tolist():
                if 0 <= b < nvis:
                    m[row, b] = 2
    return m


max_blocks = step["block_table"].shape[1]
cmap = ListedColormap(["white", "0.85", "tab:blue"])
fig, axes = plt.subplots(len(CTX), 1, figsize=(10, 1.2 + 0.9 * len(CTX) * QLEN * HKV / 8), sharex=True)
for r, ax in enumerate(np.atleast_1d(axes)):
    m = selection_map(step["topk"][r * QLEN:(r + 1) * QLEN], CTX[r], QLEN, max_blocks)
    ax.imshow(m, cmap=cmap, vmin=0, vmax=2, aspect="auto", interpolation="nearest")
    ax.set_yticks(range(0, QLEN * HKV, HKV), [f"j={j}" for j in range(QLEN)])
    ax.set_ylabel(f"req {r}\nctx {CTX[r]}", rotation=0, ha="right", va="center")
    ax.set_xticks(np.arange(-0.5, max_blocks, 1), minor=True)
    ax.grid(which="minor", axis="x", color="w", lw=0.3)
axes[-1].set_xlabel("logical block (128 tokens each); rows within a token: KV heads 0..3")
fig.suptitle("Blocks selected per (token, KV head)")
fig.tight_layout()
plt.show()
sel = sum(int((selection_map(step["topk"][r * QLEN:(r + 1) * QLEN], CTX[r], QLEN, max_blocks) == 2).sum())
          for r in range(len(CTX)))
print(f"KV blocks read: {sel} (token, head, block) triples, {step['distinct_blocks']} distinct "
      f"(request, head, block) out of {sum(-(-c // PAGE) for c in CTX) * HKV} in the context")

# %% [markdown]
# ## 3. Run the op and compare with the float64 reference
#
# `prepare` builds (once per shape) and refreshes the plan; `sparse_decode` writes `out`
# `[T, Hq, 128]` bf16 (and optionally the natural-log LSE `[T, Hq]`) in place. The contract's
# bound is a relative L2 error below 1e-2; both query dtypes are checked.

# %%
planner = msa_jit.SparseDecodePlanner()
results = {}
for q_name, q_dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
    s = random_step(len(CTX), QLEN, HQ, HKV, ctx_lens=CTX, q_dtype=q_dtype, device=DEVICE, seed=1)
    plan = planner.prepare(s["block_table"], s["seq_lens"], s["seq_lens_cpu"], QLEN,
                           num_q_heads=HQ, num_kv_heads=HKV, page_size=PAGE, topk_blocks=TOPK)
    scales = dict(sm_scale=s["sm_scale"], q_scale=s["q_scale"], k_scale=s["k_scale"], v_scale=s["v_scale"])
    out = torch.empty(len(CTX) * QLEN, HQ, 128, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.empty(len(CTX) * QLEN, HQ, dtype=torch.float32, device=DEVICE)
    msa_jit.sparse_decode(s["query"], s["kv_cache"], s["topk"], out, plan, lse=lse, backend=BACKEND, **scales)
    ref_out, ref_lse = msa_jit.sparse_decode_reference(
        s["query"], s["kv_cache"], s["topk"], s["block_table"], s["seq_lens"], QLEN, **scales)
    err = errors(out, lse, ref_out, ref_lse)
    per_token = ((out.cpu().double() - ref_out).flatten(1).norm(dim=1)
                 / ref_out.flatten(1).norm(dim=1).clamp_min(1e-30))
    results[q_name] = (err, per_token, s, plan, out, lse, scales)
    print(f"q={q_name:4s} splits={plan.launch().num_splits:2d}  rel L2 {err['rel_l2']:.2e}  "
          f"max abs {err['max_abs']:.2e}  lse max abs {err['lse_max_abs']:.2e}  "
          f"{'OK' if err['rel_l2'] < 1e-2 else 'ABOVE BOUND'}")
    assert err["rel_l2"] < 1e-2

fig, ax = plt.subplots(figsize=(10, 2.6))
width = 0.4
for i, (q_name, (_, per_token, *_rest)) in enumerate(results.items()):
    ax.bar(np.arange(len(per_token)) + (i - 0.5) * width, per_token.numpy(), width, label=f"q {q_name}")
ax.axhline(1e-2, color="k", ls="--", lw=1, label="bound 1e-2")
ax.set_yscale("log")
ax.set_xlabel("token t (request-major)")
ax.set_ylabel("relative L2 error")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# On a GPU, time one step (prologue + kernel) with CUDA events (median). `msa-jit bench`
# measures properly (CUDA-graph replay, L2 flushed); this is a quick look.

# %%
if CUDA:
    _, _, s, plan, out, lse, scales = results["bf16"]

    def run_step():
        p = planner.prepare(s["block_table"], s["seq_lens"], s["seq_lens_cpu"], QLEN,
                            num_q_heads=HQ, num_kv_heads=HKV, page_size=PAGE, topk_blocks=TOPK)
        msa_jit.sparse_decode(s["query"], s["kv_cache"], s["topk"], out, p, **scales)

    for _ in range(5):
        run_step()
    times = []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run_step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    print(f"median step time: {statistics.median(times):.1f} us (eager, CUDA events)")
else:
    print("timing skipped: no GPU (the reference backend's time says nothing about the kernel)")

# %% [markdown]
# ## 4. The roofline
#
# `msa-jit bench` times each point by CUDA-graph replay with L2 flushed, and reports the
# **effective bandwidth**: distinct KV bytes the step must read / step time. Decode attention
# is memory bound, so the ceiling is what the GPU can stream: the device-to-device copy
# bandwidth measured in the same run (dashed). A step also has a fixed cost (launch, prologue,
# latency of the first loads: the batch-1 time below), which dominates while there is little
# to read, so small batches sit far below the ceiling and large ones approach it.

# %%
def newest_result(results_dir: Path):
    """The newest bench result JSON (by its recorded date, then file time), or None."""
    found = []
    for f in results_dir.glob("*.json"):
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and d.get("points") and "copy_tbps" in d:
            found.append(((d.get("environment", {}).get("date", ""), f.stat().st_mtime), f, d))
    return max(found, key=lambda x: x[0])[1:] if found else None


newest = newest_result(ROOT / "bench" / "results")
if newest is None:
    print(f"no benchmark results under {ROOT / 'bench' / 'results'}: run `msa-jit bench --out bench/results` on a GPU")
else:
    path, result = newest
    copy = result["copy_tbps"]
    series = {}
    for p in result["points"]:
        if not p.get("shared_blocks"):
            series.setdefault((p["geometry"], p["qlen"], p["q_dtype"]), []).append((p["batch"], p["tbps"]))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (geo, qlen, qd), pts in sorted(series.items()):
        pts.sort()
        ax.plot([b for b, _ in pts], [t for _, t in pts], marker="o", label=f"Hq/Hkv {geo}, qlen {qlen}, {qd}")
    ax.axhline(copy, color="k", ls="--", label=f"D2D copy {copy:.2f} TB/s (ceiling)")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, copy * 1.1)
    ax.set_xlabel("batch (requests)")
    ax.set_ylabel("effective TB/s")
    env = result.get("environment", {})
    ax.set_title(f"{path.name}: {env.get('device', '?')}, {env.get('date', '?')[:10]}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    plt.show()
    best = max(result["points"], key=lambda p: p["tbps"])
    small = min(result["points"], key=lambda p: (p["batch"], p["qlen"], p["us"]))
    print(f"smallest step: {small['us']:.1f} us ({small['geometry']}, batch {small['batch']}, qlen {small['qlen']})")
    print(f"{path.name}: best {best['tbps']:.2f} TB/s = {100 * best['tbps'] / copy:.0f}% of copy "
          f"({best['geometry']}, batch {best['batch']}, qlen {best['qlen']})")
