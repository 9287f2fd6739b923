"""Per-step prologue: refresh the plan's kv_lens / qo_offset in place from device seq_lens.

For every token row t < T = B * qlen (r = t // qlen, j = t % qlen):

    qo_offset[t] = seq_lens[r] - qlen + j          (absolute position of the query token)
    kv_lens[t]   = max(qo_offset[t] + 1, 0)        (causal: keys at positions < kv_lens[t])

`refresh_plan_tensors` is one Triton launch: no host sync, no allocation, so it can be
captured in a CUDA graph. On a GPU it first signals programmatic dependent launch
(`griddepcontrol.launch_dependents`), so the decode kernel that follows (launched with PDL)
is scheduled while this one runs; that kernel waits (`griddepcontrol.wait`) for this grid to
complete and its writes to be visible before it reads kv_lens. On CPU tensors it needs
TRITON_INTERPRET=1 set before this module is imported; `refresh_plan_tensors_torch` is the
same computation in PyTorch (CPU fallback and test oracle). Importing this module imports
triton, so the package imports it lazily.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents
except ImportError:  # pragma: no cover - older Triton: no early launch of the next kernel
    gdc_launch_dependents = None

from .arguments import check_dtype, check_tensor  # noqa: E402 - after the optional Triton import above

__all__ = [
    "bind_refresh",
    "check_refresh_arguments",
    "refresh_plan_tensors",
    "refresh_plan_tensors_torch",
    "refresh_plan_tensors_auto",
    "kernel_is_interpreted",
]

BLOCK_ROWS = 128
# CUDA graphs of a plan's bound launch, one per seq_lens address (an engine refreshes one buffer)
MAX_REFRESH_GRAPHS = 4


@triton.jit
def _refresh_plan_kernel(
    seq_lens_ptr,
    kv_lens_ptr,
    qo_offset_ptr,
    num_rows,
    qlen,
    BLOCK: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
):
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = t < num_rows
    r = t // qlen
    j = t - r * qlen
    seq_len = tl.load(seq_lens_ptr + r, mask=mask, other=0)
    pos = seq_len - qlen + j
    tl.store(qo_offset_ptr + t, pos, mask=mask)
    tl.store(kv_lens_ptr + t, tl.maximum(pos + 1, 0), mask=mask)


def kernel_is_interpreted() -> bool:
    """True when the Triton kernel was decorated under TRITON_INTERPRET=1 (runs on CPU tensors)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - very old/new triton
        return False
    return isinstance(_refresh_plan_kernel, InterpretedFunction)


def _launch_dependents(wanted: bool) -> bool:
    """Whether the launch may carry the PDL trigger (a GPU build with a Triton that has it)."""
    return wanted and gdc_launch_dependents is not None and not kernel_is_interpreted()


def check_refresh_arguments(seq_lens: Any, kv_lens: Any, qo_offset: Any, qlen: Any) -> None:
    """ValueError / TypeError naming the argument unless seq_lens is [B] int32 and kv_lens, qo_offset are
    contiguous [B * qlen] int32 on its device: the kernel trusts these (a longer kv_lens would read past
    seq_lens on the GPU). The planner's own calls skip this: it built those tensors for that shape."""
    if isinstance(qlen, bool) or not isinstance(qlen, int) or qlen < 1:
        raise ValueError(f"qlen: expected an int >= 1, got {qlen!r}")
    for name, t in (("seq_lens", seq_lens), ("kv_lens", kv_lens), ("qo_offset", qo_offset)):
        check_tensor(name, t)
        check_dtype(name, t, (torch.int32,))
        if t.dim() != 1 or (name != "seq_lens" and not t.is_contiguous()):
            raise ValueError(f"{name}: expected a contiguous 1-D tensor, got shape {list(t.shape)}")
        if t.device != seq_lens.device:
            raise ValueError(f"{name}: expected a tensor on {seq_lens.device} (seq_lens'), got {t.device}")
    rows = seq_lens.numel() * qlen
    if kv_lens.numel() != rows or qo_offset.numel() != rows:
        raise ValueError(f"kv_lens / qo_offset: expected {rows} rows (seq_lens' {seq_lens.numel()} x qlen {qlen}), "
                         f"got {kv_lens.numel()} / {qo_offset.numel()}")


def refresh_plan_tensors(
    seq_lens: torch.Tensor, kv_lens: torch.Tensor, qo_offset: torch.Tensor, qlen: int,
    launch_dependents: bool = True,
) -> None:
    """Triton: write kv_lens [T] int32 and qo_offset [T] int32 from seq_lens [B] int32, in place.

    T = kv_lens.numel() must equal B * qlen (check_refresh_arguments).
    launch_dependents: signal PDL at the start (ignored under the interpreter).
    """
    check_refresh_arguments(seq_lens, kv_lens, qo_offset, qlen)
    _refresh_plan_tensors(seq_lens, kv_lens, qo_offset, qlen, launch_dependents)


def _refresh_plan_tensors(
    seq_lens: torch.Tensor, kv_lens: torch.Tensor, qo_offset: torch.Tensor, qlen: int,
    launch_dependents: bool = True,
) -> None:
    """`refresh_plan_tensors` without the checks (the planner's plans, every step)."""
    num_rows = kv_lens.numel()
    if num_rows == 0:
        return
    grid = (triton.cdiv(num_rows, BLOCK_ROWS),)
    _refresh_plan_kernel[grid](seq_lens, kv_lens, qo_offset, num_rows, qlen, BLOCK=BLOCK_ROWS,
                               LAUNCH_DEPENDENTS=_launch_dependents(launch_dependents))


def refresh_plan_tensors_torch(
    seq_lens: torch.Tensor, kv_lens: torch.Tensor, qo_offset: torch.Tensor, qlen: int
) -> None:
    """PyTorch version of `refresh_plan_tensors` (same results, the same checks; allocates temporaries)."""
    check_refresh_arguments(seq_lens, kv_lens, qo_offset, qlen)
    _refresh_plan_tensors_torch(seq_lens, kv_lens, qo_offset, qlen)


def _refresh_plan_tensors_torch(
    seq_lens: torch.Tensor, kv_lens: torch.Tensor, qo_offset: torch.Tensor, qlen: int
) -> None:
    num_rows = kv_lens.numel()
    batch = num_rows // qlen
    j = torch.arange(qlen, dtype=torch.int32, device=seq_lens.device)
    pos = (seq_lens[:batch].to(torch.int32).view(batch, 1) - qlen + j).reshape(-1)
    qo_offset.copy_(pos)
    kv_lens.copy_(torch.clamp_min(pos + 1, 0))


def refresh_plan_tensors_auto(
    seq_lens: torch.Tensor, kv_lens: torch.Tensor, qo_offset: torch.Tensor, qlen: int,
    launch_dependents: bool = True,
) -> None:
    """Triton on CUDA (or on CPU under TRITON_INTERPRET=1), the torch path otherwise."""
    if seq_lens.is_cuda or kernel_is_interpreted():
        _refresh_plan_tensors(seq_lens, kv_lens, qo_offset, qlen, launch_dependents)
    else:
        _refresh_plan_tensors_torch(seq_lens, kv_lens, qo_offset, qlen)


def _on_device_of(s: torch.Tensor) -> contextlib.AbstractContextManager:
    """`s`'s GPU made current while a launch runs, when another one is: Triton launches on the
    current device, and a process may serve several GPUs."""
    if s.is_cuda and s.device.index != torch.cuda.current_device():
        return torch.cuda.device(s.device)
    return contextlib.nullcontext()


def bind_refresh(
    seq_lens: torch.Tensor, kv_lens: torch.Tensor, qo_offset: torch.Tensor, qlen: int,
    launch_dependents: bool = True, graphs: bool = True,
) -> Callable[[torch.Tensor], None]:
    """`refresh(seq_lens)` for one plan's kv_lens / qo_offset, with the launch bound once.

    `JITFunction.__call__` re-binds and re-specializes every argument on every launch (~17 us of
    CPU on the H200 host); for a plan everything but the seq_lens pointer is fixed, so the first
    launch's CompiledKernel is called directly (Triton's `compiled[grid](*args)`, the pointers
    passed as ints). That path is checked once against the PyTorch formula when the plan is built
    (outside graph capture) and dropped for the plain launch if it differs or fails; a seq_lens
    whose 16-byte alignment differs from the one the kernel was specialized for also takes the
    plain launch.
    graphs: outside a caller's CUDA-graph capture, replay the bound launch from a CUDA graph
    captured once per seq_lens address (`replay_from_graphs`): 3-5 us of CPU instead of 10-13.
    launch_dependents: the PDL trigger (see the module docstring); False only for A/B runs.
    """
    num_rows = kv_lens.numel()
    pdl = _launch_dependents(launch_dependents)

    def plain(s: torch.Tensor) -> None:
        with _on_device_of(s):
            refresh_plan_tensors_auto(s, kv_lens, qo_offset, qlen, pdl)

    if num_rows == 0 or not seq_lens.is_cuda or torch.cuda.is_current_stream_capturing():
        return plain
    grid = (triton.cdiv(num_rows, BLOCK_ROWS), 1, 1)  # CompiledKernel's runner reads all three
    try:
        compiled = _refresh_plan_kernel[grid](seq_lens, kv_lens, qo_offset, num_rows, qlen, BLOCK=BLOCK_ROWS,
                                              LAUNCH_DEPENDENTS=pdl)
        runner = compiled[grid]
    except Exception:  # noqa: BLE001 - an older / newer Triton without the CompiledKernel runner
        return plain
    aligned = seq_lens.data_ptr() % 16 == 0
    # pointers as ints: Triton's launcher then skips its data_ptr() call and driver pointer query
    # per tensor (the plan's kv_lens / qo_offset never move; seq_lens is validated by prepare)
    kv_ptr, qo_ptr = kv_lens.data_ptr(), qo_offset.data_ptr()

    def bound(s: torch.Tensor) -> None:
        ptr = s.data_ptr()
        if (ptr % 16 == 0) != aligned:
            _refresh_plan_tensors(s, kv_lens, qo_offset, qlen, pdl)
        else:
            runner(ptr, kv_ptr, qo_ptr, num_rows, qlen, BLOCK_ROWS, pdl)

    want_kv, want_qo = kv_lens.clone(), qo_offset.clone()
    _refresh_plan_tensors_torch(seq_lens, want_kv, want_qo, qlen)
    try:
        kv_lens.fill_(-1)
        bound(seq_lens)
        ok = torch.equal(kv_lens, want_kv) and torch.equal(qo_offset, want_qo)
    except Exception:  # noqa: BLE001
        ok = False
    if not ok:
        plain(seq_lens)
        return plain
    bound.compiled = compiled  # its .asm["ptx"] shows the trigger (tests)
    return replay_from_graphs(bound, aligned) if graphs else bound


def replay_from_graphs(bound: Callable[[torch.Tensor], None], aligned: bool) -> Callable[[torch.Tensor], None]:
    """`bound(seq_lens)` replayed from a CUDA graph captured on the first call per seq_lens address.

    On the GPU host a `CUDAGraph.replay` of the one-kernel graph costs 3-5 us of CPU against
    10-13 us for Triton's launcher (measured); the decode kernel that follows then cannot overlap its launch with
    the prologue (PDL works between kernels, not after a graph: ~0.5 us of GPU per step, not per
    layer). The launch itself runs instead (and is captured into the caller's graph) while the
    current stream is capturing, for a seq_lens of the other 16-byte alignment (whose plain launch
    might compile), off the current device, past MAX_REFRESH_GRAPHS addresses, or once a capture
    failed. A capture never compiles: the kernel was launched when the plan was bound.
    """
    replays: dict[int, Callable[[], None]] = {}
    state = {"failed": False}

    def capture(s: torch.Tensor, ptr: int) -> Callable[[], None] | None:
        if state["failed"] or len(replays) >= MAX_REFRESH_GRAPHS or (ptr % 16 == 0) != aligned:
            return None
        # capture_begin / capture_end on a side stream: unlike torch.cuda.graph() no device sync,
        # gc.collect() or empty_cache() in the middle of an engine's step
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    bound(s)
                finally:
                    graph.capture_end()
        except Exception:  # noqa: BLE001 - e.g. another thread capturing: launch directly from now on
            state["failed"] = True
            return None
        replays[ptr] = graph.replay
        return graph.replay

    def graphed(s: torch.Tensor) -> None:
        if torch.cuda.is_current_stream_capturing():
            bound(s)
            return
        if s.device.index != torch.cuda.current_device():  # another GPU's plan: launched there, not graphed
            with _on_device_of(s):
                bound(s)
            return
        ptr = s.data_ptr()
        replay = replays.get(ptr) or capture(s, ptr)
        if replay is None:
            bound(s)
        else:
            replay()

    graphed.compiled = bound.compiled
    graphed.bound = bound
    graphed.replays = replays  # tests: which addresses have a graph
    return graphed
