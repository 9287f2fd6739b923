"""Host cost of a decode step through vLLM 0.33's own MiniMax-M3 attention code, msa-jit's plugin
path against the same engine path with vLLM's Triton decode, and the step in a CUDA graph.

    python bench/host_path.py [--points 1x32768,8x16384,32x8192,64x8192] [--layers 7] [--steps 50]
                              [--modes msa,msa_op,triton] [--json FILE]

Runs vLLM's unmodified builder and impl (`MiniMaxM3SparseMSAMetadataBuilder.build`,
`MiniMaxM3SparseMSAImpl.forward`) on the stand-ins of tests/vllm_standins.py, with the plugin
applied, for one step of `--layers` sparse layers (MiniMax-M3: 7 of every 8 layers sparse), fp8
cache and query, 64/4 heads, top-16 blocks of 128 tokens, every request `context` tokens long.
It needs vLLM 0.33.0's files (tests/vllm_files.py: $MSA_JIT_TEST_ENGINE_DIR on a host without
network). Modes:

* msa: the plugin's decode (`prepare_decode_metadata` in build, `msa_cutlass_sparse_decode` per layer);
* msa_merge_kernel: the same with the builder's planner pinned to split_merge="kernel" (a split step's
  partials merged by the merge kernel instead of inside the cluster: the A/B of the cluster merge);
* msa_op: the same through `torch.ops.msa_jit.sparse_decode`, the op the adapter calls while
  `torch.compiler.is_compiling()`, here called eagerly (what a compiled graph run outside a
  CUDA graph pays per call);
* triton: the same builder and impl with the plugin's batch floor above the batch
  (VLLM_MINIMAX_M3_MSA_CUTLASS_MIN_BATCH), so decode runs vLLM's Triton kernel, as the e2e
  harness's msa_fp8_engine_triton mode (needs vLLM's common/ops/sparse_attn.py; GPU only).

Per mode and point, on a GPU (each a median over --steps steps, microseconds):

* host_build_us / host_layer_us / host_step_us: CPU time of build, of one layer's forward, of build
  plus every layer (the device idle between steps, so no launch waits for queue space);
* eager_step_us: steps issued back to back, per step (the device's pace when it is the bottleneck);
* sync: whether a step runs under `torch.cuda.set_sync_debug_mode("error")` ("none", or the error);
* graph_device_us: one CUDA-graph replay of every layer's forward (vLLM 0.33 captures uniform
  decode batches of this model in FULL graphs), CUDA events; graph_step_us: build + replay, back
  to back, per step; graph_build_us: build's CPU time beside the graph.

Without a GPU the msa modes still run on CPU tensors for the host numbers, the kernel replaced by
a no-op on the op's fast path (what a CUDA plan with a loaded kernel takes) and the plan's refresh
by a no-op (msa_op: the custom op's body, `msa_jit.sparse_decode` on the rebuilt plan, a no-op);
device numbers are then absent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # the checkout's msa_jit and the engine stand-ins
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import pytest  # noqa: E402  (the stand-ins patch through pytest's MonkeyPatch)
import torch  # noqa: E402

HQ, HKV, D, PAGE, TOPK = 64, 4, 128, 128, 16
DEFAULT_POINTS = ((1, 32768), (8, 16384), (32, 8192), (64, 8192))
MODES = ("msa", "msa_merge_kernel", "msa_op", "triton")
MIN_BATCH_VAR = "VLLM_MINIMAX_M3_MSA_CUTLASS_MIN_BATCH"


def _median_us(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e6, 2)


def make_tensors(batch: int, context: int, device: torch.device, seed: int = 0) -> SimpleNamespace:
    """One pure decode step: `batch` requests of `context` cached tokens plus the new one, each
    token's top-k the last TOPK blocks of its request (all valid), fp8 cache bytes of small values."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    seq = context + 1
    nblk = -(-seq // PAGE)
    pages = batch * nblk + 2
    width = nblk + 2
    bt = torch.zeros(batch, width, dtype=torch.int32)
    bt[:, :nblk] = torch.randperm(pages, generator=g)[: batch * nblk].view(batch, nblk).to(torch.int32)
    first = max(0, nblk - TOPK)
    row = torch.full((TOPK,), -1, dtype=torch.int32)
    row[: nblk - first] = torch.arange(first, nblk, dtype=torch.int32)
    topk = row.expand(batch + 3, HKV, TOPK).contiguous()  # rows past the batch: padding nobody reads
    # e4m3 bytes 0x00-0x3f and 0x80-0xbf, each sign drawn: finite, |x| < 2
    kv = torch.randint(0, 128, (pages, HKV, PAGE, 2 * D), dtype=torch.uint8, device=device)
    kv = (kv & 0x3F) | ((kv & 0x40) << 1)
    qf = torch.randn(batch, HQ * D, generator=g).clamp(-4, 4).to(torch.float8_e4m3fn)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    sl = torch.full((batch,), seq, dtype=torch.int32)
    # copies also on a CPU: the host copies and the "device" tensors never share memory
    return SimpleNamespace(batch=batch, context=context, kv=kv, block_table=bt.to(device, copy=True),
                           topk=topk.to(device, copy=True), query_fp8=qf.to(device, copy=True),
                           seq_lens=sl.to(device, copy=True), seq_lens_cpu=sl,
                           query_start_loc=qsl.to(device, copy=True), query_start_loc_cpu=qsl)


def _load_engine_triton(ns: Any, mp: pytest.MonkeyPatch) -> None:
    """vLLM's own Triton decode (common/ops/sparse_attn.py, compiled for the GPU) behind the impl's
    Triton branch, with programmatic dependent launch as vLLM uses it on SM90."""
    import vllm_standins as vs

    mp.setattr(ns.platform, "is_arch_support_pdl", lambda: True)
    mod = vs.load_file(mp, vs.TRITON_KERNELS, vs.engine_file(vs.TRITON_KERNELS_FILE))
    mp.setattr(ns.msa, "minimax_m3_sparse_attn_decode", mod.minimax_m3_sparse_attn_decode)


def engine_step(mp: pytest.MonkeyPatch, mode: str, t: SimpleNamespace, layers: int,
                device: torch.device) -> SimpleNamespace:
    """vLLM's builder and impl for `mode` on the tensors `t`: .build() (the step's metadata, put into
    the forward context) and .forward(i) (layer i's attention)."""
    import engine_cases as ec
    import vllm_standins as vs
    from msa_jit import env
    from msa_jit.integrations import engine, vllm_plugin

    for name in (env.VLLM_PLUGIN, env.VLLM_SM100, MIN_BATCH_VAR):
        mp.delenv(name, raising=False)
    if mode == "triton":
        mp.setenv(MIN_BATCH_VAR, str(10**9))
    cuda = device.type == "cuda"
    cap = tuple(torch.cuda.get_device_capability(device)) if cuda else (9, 0)
    if not cuda:
        mp.setattr(engine, "_device_capability", lambda: (9, 0))
    ns = vs.install(mp, capability=cap)
    line = vllm_plugin.register()
    if "through msa-jit" not in line:
        raise RuntimeError(line)
    if mode == "triton":
        _load_engine_triton(ns, mp)
    cfg = ec.vllm_config(num_q_heads=HQ, decode_backend="cutlass", kv_cache_dtype="fp8",
                         max_num_batched_tokens=max(4096, t.batch))
    ns.config.vllm_config = cfg
    wiring = ec.ModelWiring.parse(vs.engine_file("model.py"))
    attn = wiring.layer_namespace(num_heads=HQ, num_kv_heads=HKV, kv_cache_dtype="fp8")
    backend, impl_cls = wiring.select(ns.common.select_main_backend_and_impl_cls, attn, cfg)
    impl = wiring.make_impl(impl_cls, attn, cfg)
    attn.impl = impl
    names = [f"model.layers.{i + 1}.self_attn.attn" for i in range(layers)]
    builder = backend.get_builder_cls()(SimpleNamespace(num_kv_heads=HKV, block_size=PAGE), names, cfg, device)
    if mode == "msa_merge_kernel":  # split steps merged by the merge kernel, never in the cluster
        from msa_jit import SparseDecodePlanner

        builder.msa_cutlass_plan_cache._planner = SparseDecodePlanner(split_merge="kernel")
    B = t.batch
    cm = vs.CommonAttentionMetadata(
        query_start_loc=t.query_start_loc, query_start_loc_cpu=t.query_start_loc_cpu, seq_lens=t.seq_lens,
        num_reqs=B, num_actual_tokens=B, max_query_len=1, max_seq_len=t.context + 1,
        block_table_tensor=t.block_table, slot_mapping=torch.zeros(B, dtype=torch.int64, device=device),
        seq_lens_cpu_upper_bound=t.seq_lens_cpu)
    one = dict(dtype=torch.float32, device=device)
    layer_ns = [SimpleNamespace(layer_name=n, topk_indices_buffer=t.topk, _q_scale_float=1.0, _k_scale_float=1.0,
                                _v_scale_float=1.0, _k_scale=torch.ones((), **one), _v_scale=torch.ones((), **one))
                for n in names]
    rows = B + 2
    query_fp8 = wiring.allocate_query_fp8(attn, torch.empty(rows, 1, device=device))
    if query_fp8 is None:
        raise RuntimeError("the impl does not take the fp8 query (use_cutlass_decode False)")
    query_fp8.zero_()
    query_fp8[:B] = t.query_fp8
    query = torch.zeros(rows, HQ * D, dtype=torch.bfloat16, device=device)
    output = torch.zeros(rows, HQ * D, dtype=torch.bfloat16, device=device)

    def build() -> Any:
        md = builder.build(0, cm)
        ns.forward_context.attn_metadata = {n: md for n in names}
        return md

    def forward(i: int) -> None:
        impl.forward(layer_ns[i], query, t.kv, output, query_fp8=query_fp8)

    if mode == "msa_op":  # the adapter's call while compiling, taken eagerly
        from msa_jit.integrations import torch_op

        mp.setattr(engine, "sparse_decode", torch_op.sparse_decode_op)
        if not cuda:  # the op's dispatch and plan rebuild only: its body a no-op
            mp.setattr(torch_op, "sparse_decode", lambda *a, **k: None)
    md = build()
    plan = md.decode.msa_cutlass.plan if md.decode.msa_cutlass is not None else None
    if (plan is None) != (mode == "triton"):
        raise RuntimeError(f"{mode}: the builder {'did not plan' if plan is None else 'planned'} msa-jit's decode")
    if plan is not None and not cuda:  # the GPU fast path's Python, the kernel a no-op
        from msa_jit.kernels import convention
        from msa_jit.kernels.constants import FP8_KV

        plan.is_cuda = True
        plan.kernels[(torch.float8_e4m3fn, FP8_KV)] = lambda *a: None
        plan._ffi_tensors = tuple(getattr(plan, n) for n in convention.PLAN_TENSORS)
        plan.refresh = lambda s: None
    launch = None if plan is None else plan.launch().describe()
    # what lives on the GPU in an engine (tests/test_host_path.py: no value of these is read on the CPU)
    on_device = [t.kv, t.block_table, t.seq_lens, t.topk, t.query_fp8, t.query_start_loc, cm.slot_mapping,
                 query_fp8, query, output, *(x for ln in layer_ns for x in (ln._k_scale, ln._v_scale))]
    if plan is not None:
        on_device += [v for v in vars(plan).values() if isinstance(v, torch.Tensor)]
    return SimpleNamespace(build=build, forward=forward, layers=layers, launch=launch, plan=plan,
                           on_device=on_device)


def _sync_check(step: Callable[[], None]) -> str:
    """'none' when a step runs under torch.cuda.set_sync_debug_mode('error'), else the error."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return "none"
    except RuntimeError as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)


def measure(es: SimpleNamespace, steps: int, device: torch.device) -> dict[str, Any]:
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step() -> None:
        es.build()
        for i in range(es.layers):
            es.forward(i)

    for _ in range(3):  # warm-up: kernels loaded, plans built, the refresh graph captured
        step()
    sync()
    out: dict[str, Any] = {"launch": es.launch}
    b, l, s = [], [], []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        es.build()
        t1 = time.perf_counter()
        es.forward(0)
        t2 = time.perf_counter()
        for i in range(1, es.layers):
            es.forward(i)
        t3 = time.perf_counter()
        b.append(t1 - t0), l.append(t2 - t1), s.append(t3 - t0)
    sync()
    out.update(host_build_us=_median_us(b), host_layer_us=_median_us(l), host_step_us=_median_us(s))
    if not cuda:
        return out
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    out["eager_step_us"] = round((time.perf_counter() - t0) / steps * 1e6, 2)
    out["sync"] = _sync_check(step)
    sync()
    # vLLM 0.33's FULL graph of a uniform decode batch: the layers captured, build outside
    es.build()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(es.layers):
            es.forward(i)
    sync()
    dev, gb = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        es.build()
        gb.append(time.perf_counter() - t0)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        dev.append(e0.elapsed_time(e1) * 1e-3)
    out.update(graph_device_us=_median_us(dev), graph_build_us=_median_us(gb))
    t0 = time.perf_counter()
    for _ in range(steps):
        es.build()
        graph.replay()
    sync()
    out["graph_step_us"] = round((time.perf_counter() - t0) / steps * 1e6, 2)
    return out


def run(points: list[tuple[int, int]], modes: list[str], layers: int, steps: int,
        device: torch.device) -> list[dict[str, Any]]:
    rows = []
    for batch, context in points:
        t = make_tensors(batch, context, device)
        for mode in modes:
            if mode == "triton" and device.type != "cuda":
                continue
            row: dict[str, Any] = {"mode": mode, "batch": batch, "context": context, "layers": layers}
            stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            try:
                # vLLM 0.33 runs its model on a stream of its own
                with pytest.MonkeyPatch.context() as mp, torch.inference_mode(), \
                        (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
                    row.update(measure(engine_step(mp, mode, t, layers, device), steps, device))
            except Exception as e:  # noqa: BLE001 - the other points still run
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default=",".join(f"{b}x{c}" for b, c in DEFAULT_POINTS),
                    help="batch x context, comma-separated (default: %(default)s)")
    ap.add_argument("--modes", default="msa,msa_op,triton", help=f"of {','.join(MODES)} (default %(default)s)")
    ap.add_argument("--layers", type=int, default=7, help="sparse layers per step (default %(default)s)")
    ap.add_argument("--steps", type=int, default=50, help="steps per median (default %(default)s)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",") if p]
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; known: {', '.join(MODES)}")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows = run(points, modes, args.layers, args.steps, device)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                                               else "cpu", "torch": torch.__version__, "rows": rows}, indent=1))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
