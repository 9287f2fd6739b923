"""Input checks of the public API (`prepare`, `sparse_decode`).

Every failure raises ValueError (bad value / shape / layout / device) or TypeError (bad type /
dtype) whose message starts with the argument's name and says what was expected and what
came. Checks read tensor metadata and the values of the CPU copy `seq_lens_cpu` only: no
device->host sync, no device allocation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from .arguments import _dt, _fmt_shape, check_dim, check_dtype, check_int, check_scale, check_tensor
from .geometry import MAX_QLEN, MIN_QLEN, geometry_problems
from .kernels.constants import FP8_KV, NVFP4_KV

if TYPE_CHECKING:  # pragma: no cover
    from .plan import SparseDecodePlan

__all__ = [
    "BACKENDS",
    "check_backend",
    "check_int",
    "check_outputs_own_memory",
    "check_scale",
    "check_kv_scale",
    "kv_cache_format",
    "validate_geometry",
    "validate_kernel_layout",
    "validate_prepare",
    "validate_prepare_tensors",
    "validate_seq_lens_cpu",
    "validate_sparse_decode",
]

BACKENDS = ("auto", "kernel", "reference")
Q_TORCH_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
KV_TORCH_DTYPES = (torch.float8_e4m3fn, torch.uint8)
PLAN_DEVICE_TYPES = ("cpu", "cuda")  # where a plan can live (the reference runs on CPU, the kernel on CUDA)


def check_last_dim_contiguous(name: str, x: torch.Tensor) -> None:
    """ValueError unless the innermost stride is 1 (a size-1 innermost dim is accepted)."""
    if x.dim() and x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected the last dim to be contiguous (stride 1), got strides {list(x.stride())}"
        )


def check_device(name: str, x: torch.Tensor, device: torch.device, what: str) -> None:
    """ValueError unless x lives on `device`."""
    if x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} ({what}), got {x.device}")


def check_kv_scale(name: str, value: Any, plan: "SparseDecodePlan", backend: str) -> tuple[float, Any]:
    """A global K / V scale as (python float, device tensor or None).

    A python float (or a 1-element CPU tensor) -> (float, None). A one-element float32 tensor
    on the plan's CUDA device (vLLM's NVFP4 layer._k_scale / _v_scale, 0-dim or [1]) ->
    (1.0, that tensor as [1]) for the kernel, which reads it on the device (no sync, graph
    safe); the reference backend reads its value instead.
    """
    if type(value) is float and 0.0 < value < math.inf:
        return value, None
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        if value.numel() != 1 or value.dtype != torch.float32:
            raise TypeError(f"{name}: expected a python float or a one-element float32 tensor, got a "
                            f"{value.dtype} tensor of shape {_fmt_shape(value)}")
        if value.device != plan.device:
            raise ValueError(f"{name}: expected a tensor on {plan.device} (the plan's device), got {value.device}")
        if backend == "reference":
            return check_scale(name, float(value)), None
        return 1.0, value if value.dim() == 1 else value.reshape(1)
    return check_scale(name, value), None


def kv_cache_format(kv_cache: torch.Tensor, num_kv_heads: int, page_size: int, head_dim: int) -> str:
    """FP8_KV or NVFP4_KV by the cache's dtype and shape; TypeError / ValueError naming both layouts."""
    nvfp4_row = head_dim // 2 + head_dim // 16
    fp8 = (num_kv_heads, page_size, 2 * head_dim)
    nvfp4 = (2 * num_kv_heads, page_size, nvfp4_row)
    layouts = (f"fp8 [num_pages, {fp8[0]}, {page_size}, {fp8[2]}] (float8_e4m3fn or uint8) or NVFP4 "
               f"[num_pages, {nvfp4[0]}, {page_size}, {nvfp4_row}] (uint8) for Hkv={num_kv_heads}, "
               f"page_size={page_size} from the plan")
    check_dtype("kv_cache", kv_cache, KV_TORCH_DTYPES)
    if kv_cache.dim() == 4 and kv_cache.shape[0] >= 1:
        if tuple(kv_cache.shape[1:]) == fp8:
            return FP8_KV
        if tuple(kv_cache.shape[1:]) == nvfp4:
            if kv_cache.dtype != torch.uint8:
                raise TypeError(f"kv_cache: the NVFP4 layout [num_pages, {nvfp4[0]}, {page_size}, {nvfp4_row}] "
                                f"is uint8 storage, got {kv_cache.dtype}")
            return NVFP4_KV
    raise ValueError(f"kv_cache: expected {layouts}, got shape {_fmt_shape(kv_cache)} ({kv_cache.dtype})")


def check_backend(backend: Any) -> str:
    """ValueError unless backend is one of BACKENDS."""
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected one of {BACKENDS}, got {type(backend).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    return backend


def validate_geometry(
    *, num_q_heads: Any, num_kv_heads: Any, page_size: Any, topk_blocks: Any
) -> None:
    """Raise for a head / page / topk geometry the kernel design cannot serve."""
    for name, val in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads),
                      ("page_size", page_size), ("topk_blocks", topk_blocks)):
        check_int(name, val)
    problems = geometry_problems(
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, page_size=page_size, topk_blocks=topk_blocks
    )
    if problems:
        name, reason = problems[0]
        raise ValueError(f"{name}: unsupported geometry: {reason}")


def validate_prepare(
    block_table: Any,
    seq_lens: Any,
    seq_lens_cpu: Any,
    decode_query_len: Any,
    *,
    num_q_heads: Any,
    num_kv_heads: Any,
    page_size: Any,
    topk_blocks: Any,
) -> None:
    """Checks of `SparseDecodePlanner.prepare` (metadata only; seq_lens_cpu values are not read)."""
    check_tensor("block_table", block_table)
    check_tensor("seq_lens", seq_lens)
    if seq_lens_cpu is not None:
        check_tensor("seq_lens_cpu", seq_lens_cpu)
    check_int("decode_query_len", decode_query_len, MIN_QLEN, MAX_QLEN)
    validate_geometry(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                      page_size=page_size, topk_blocks=topk_blocks)
    validate_prepare_tensors(block_table, seq_lens, seq_lens_cpu)
    # checked when a plan is built only: the plan key holds the device, so a cached step has it
    if seq_lens.device.type not in PLAN_DEVICE_TYPES:
        raise ValueError(
            f"seq_lens: expected a tensor on a CPU or CUDA device (block_table's, like it), got {seq_lens.device}"
            + (" (a meta tensor has no data: the op could not run on it)" if seq_lens.device.type == "meta" else "")
        )


def _prepare_tensors_ok(block_table: Any, seq_lens: Any, seq_lens_cpu: Any) -> bool:
    """True when every check of validate_prepare_tensors passes (a few attribute reads, no
    message building); False says nothing: the full checks then find what is wrong, if anything."""
    _T = torch.Tensor
    if type(seq_lens) is not _T or type(block_table) is not _T:
        return False
    if seq_lens.dtype != torch.int32 or seq_lens.dim() != 1 or not seq_lens.is_contiguous():
        return False
    batch = seq_lens.shape[0]
    bt_shape = block_table.shape
    if (block_table.dtype != torch.int32 or len(bt_shape) != 2 or batch < 1 or bt_shape[0] != batch
            or bt_shape[1] < 1 or (bt_shape[1] > 1 and block_table.stride(1) != 1)
            or block_table.device != seq_lens.device):
        return False
    if seq_lens_cpu is None:
        return True
    return (type(seq_lens_cpu) is _T and seq_lens_cpu.device.type == "cpu"
            and seq_lens_cpu.dtype in (torch.int32, torch.int64) and seq_lens_cpu.shape == (batch,))


def validate_prepare_tensors(block_table: Any, seq_lens: Any, seq_lens_cpu: Any) -> None:
    """The tensor part of `validate_prepare` (the planner's cached-step path runs only this)."""
    if _prepare_tensors_ok(block_table, seq_lens, seq_lens_cpu):
        return
    check_tensor("block_table", block_table)
    check_tensor("seq_lens", seq_lens)
    if seq_lens_cpu is not None:
        check_tensor("seq_lens_cpu", seq_lens_cpu)
    check_dtype("seq_lens", seq_lens, (torch.int32,))
    check_dim("seq_lens", seq_lens, 1, "[batch]")
    if seq_lens.shape[0] < 1:
        raise ValueError("seq_lens: expected at least one request (batch >= 1), got shape [0]")
    if not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens: expected a contiguous tensor, got strides {list(seq_lens.stride())}")
    batch = seq_lens.shape[0]

    check_dtype("block_table", block_table, (torch.int32,))
    check_dim("block_table", block_table, 2, "[batch, max_blocks]")
    if block_table.shape[0] != batch:
        raise ValueError(
            f"block_table / seq_lens: expected {batch} block_table rows (one per request of seq_lens), got shape "
            f"{_fmt_shape(block_table)}"
        )
    if block_table.shape[1] < 1:
        raise ValueError(f"block_table: expected at least one column, got shape {_fmt_shape(block_table)}")
    check_last_dim_contiguous("block_table", block_table)
    check_device("block_table", block_table, seq_lens.device, "the device of seq_lens")

    if seq_lens_cpu is not None:
        if seq_lens_cpu.device.type != "cpu":
            raise ValueError(f"seq_lens_cpu: expected a CPU tensor, got {seq_lens_cpu.device}")
        check_dtype("seq_lens_cpu", seq_lens_cpu, (torch.int32, torch.int64))
        if tuple(seq_lens_cpu.shape) != (batch,):
            raise ValueError(
                f"seq_lens_cpu: expected shape [{batch}] like seq_lens, got {_fmt_shape(seq_lens_cpu)}"
            )


def validate_seq_lens_cpu(seq_lens_cpu: torch.Tensor, block_table: torch.Tensor, page_size: int,
                          name: str = "seq_lens_cpu") -> None:
    """Value checks on the CPU copy (every prepare): 0 <= seq_len <= max_blocks * page_size.

    One scan: up to 16 lengths through a Python list (~1-3 us), more with one aminmax (~3 us).
    `name` is the argument the error names (a CPU plan's seq_lens is checked alike).
    """
    n = seq_lens_cpu.shape[0]
    if n == 0:
        return
    if n <= 16:
        values = seq_lens_cpu.tolist()
        lo, hi = min(values), max(values)
    else:
        lo_t, hi_t = torch.aminmax(seq_lens_cpu)
        lo, hi = lo_t.item(), hi_t.item()
    if lo < 0:
        raise ValueError(f"{name}: expected lengths >= 0, got a minimum of {lo}")
    cap = block_table.shape[1] * page_size
    if hi > cap:
        raise ValueError(
            f"block_table: {block_table.shape[1]} columns x page_size {page_size} = {cap} tokens "
            f"cannot hold the longest request ({name} max {hi})"
        )


def validate_seq_lens_values(seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor | None,
                             block_table: torch.Tensor, page_size: int) -> None:
    """A CPU plan's seq_lens, whose values cost no sync to read: equal to seq_lens_cpu where that is
    given (whose ranges prepare has checked), else the same range checks (the reference reads seq_lens)."""
    if seq_lens_cpu is None:
        validate_seq_lens_cpu(seq_lens, block_table, page_size, name="seq_lens")
    elif not torch.equal(seq_lens.to(torch.int64), seq_lens_cpu.to(torch.int64)):
        raise ValueError(f"seq_lens_cpu: expected the values of seq_lens (its CPU copy), got "
                         f"{seq_lens_cpu.tolist()[:8]} against {seq_lens.tolist()[:8]} (first 8)")


def validate_sparse_decode(
    query: Any,
    kv_cache: Any,
    topk: Any,
    out: Any,
    plan: "SparseDecodePlan",
    lse: Any,
    backend: Any,
) -> tuple[str, str]:
    """Checks of `sparse_decode` tensors against each other and against the plan.

    Returns (the resolved backend: "kernel" or "reference", "auto" being kernel on CUDA; the
    cache format: FP8_KV or NVFP4_KV, told apart by kv_cache's shape).
    """
    from .plan import SparseDecodePlan

    if type(plan) is SparseDecodePlan and plan.is_cuda and (backend == "auto" or backend == "kernel"):
        fmt = kernel_call_ok(query, kv_cache, topk, out, plan, lse)
        if fmt:  # every check below would pass (one pass: 4.2 us on a host where these took 7-8)
            check_outputs_own_memory(query, kv_cache, topk, out, lse)  # but this one
            return "kernel", fmt

    check_tensor("query", query)
    check_tensor("kv_cache", kv_cache)
    check_tensor("topk", topk)
    check_tensor("out", out)
    if lse is not None:
        check_tensor("lse", lse)
    if not isinstance(plan, SparseDecodePlan):
        raise TypeError(f"plan: expected a SparseDecodePlan (from prepare()), got {type(plan).__name__}")
    check_backend(backend)

    T, hq, hkv, K = plan.num_tokens, plan.num_q_heads, plan.num_kv_heads, plan.topk_blocks
    dev = plan.device

    check_dtype("query", query, Q_TORCH_DTYPES)
    check_dim("query", query, 3, "[T, Hq, head_dim]")
    if tuple(query.shape) != (T, hq, plan.head_dim):
        raise ValueError(
            f"query: expected shape [{T}, {hq}, {plan.head_dim}] ([batch*qlen, Hq, head_dim] with "
            f"batch={plan.batch}, qlen={plan.qlen} from the plan), got {_fmt_shape(query)}"
        )
    check_last_dim_contiguous("query", query)
    check_device("query", query, dev, "the plan's device")

    kv_dtype = kv_cache_format(kv_cache, hkv, plan.page_size, plan.head_dim)
    if not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache: expected a contiguous tensor, got strides {list(kv_cache.stride())}")
    check_device("kv_cache", kv_cache, dev, "the plan's device")

    check_dtype("topk", topk, (torch.int32,))
    check_dim("topk", topk, 3, "[T, Hkv, topk] (a [Hkv, T, topk] buffer is passed as buf.transpose(0, 1))")
    if tuple(topk.shape) != (T, hkv, K):
        raise ValueError(
            f"topk: expected shape [{T}, {hkv}, {K}] ([T, Hkv, topk_blocks] of the plan; pass a "
            f"[Hkv, T, topk] buffer as buf.transpose(0, 1)), got {_fmt_shape(topk)}"
        )
    check_last_dim_contiguous("topk", topk)
    check_device("topk", topk, dev, "the plan's device")

    check_dtype("out", out, (torch.bfloat16,))
    if tuple(out.shape) != tuple(query.shape):
        raise ValueError(f"out: expected shape {_fmt_shape(query)} like query, got {_fmt_shape(out)}")
    check_last_dim_contiguous("out", out)
    check_device("out", out, dev, "the plan's device")

    if lse is not None:
        check_dtype("lse", lse, (torch.float32,))
        if tuple(lse.shape) != (T, hq):
            raise ValueError(f"lse: expected shape [{T}, {hq}] ([T, Hq]), got {_fmt_shape(lse)}")
        check_last_dim_contiguous("lse", lse)
        check_device("lse", lse, dev, "the plan's device")

    check_outputs_own_memory(query, kv_cache, topk, out, lse)

    if backend == "auto":
        backend = "kernel" if dev.type == "cuda" else "reference"
    if backend == "kernel":
        if dev.type != "cuda":
            raise ValueError(f"backend: 'kernel' needs CUDA tensors, the plan's tensors are on {dev}")
        validate_kernel_layout(query, kv_cache, out, lse)
    return backend, kv_dtype


def _memory_runs(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(start byte address of each contiguous run of x's elements, bytes per run). x's largest
    contiguous inner block is one run (a row for a last-dim-contiguous tensor, all of it for a
    contiguous one), so this is ~numel / row_length addresses. Metadata only: no read of x."""
    dims = sorted(((n, st) for n, st in zip(x.shape, x.stride()) if n > 1), key=lambda d: d[1])
    run = 1
    while dims and dims[0][1] == run:  # fold the dims that continue the run (stride = elements so far)
        run *= dims.pop(0)[0]
    starts = torch.zeros(1, dtype=torch.int64)
    for n, st in dims:
        starts = (starts[:, None] + torch.arange(n, dtype=torch.int64) * st).reshape(-1)
    size = x.element_size()
    return x.data_ptr() + starts * size, run * size


def _byte_span(x: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses x can touch (its elements' bounding range)."""
    lo = x.data_ptr()
    if x.is_contiguous():
        return lo, lo + x.nbytes
    return lo, lo + (1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()))) * x.element_size()


def _shares_elements(x: torch.Tensor) -> bool:
    """True when two elements of x are one memory location (a zero stride, an as_strided view)."""
    if x.is_contiguous():
        return False
    dims = sorted(((n, st) for n, st in zip(x.shape, x.stride()) if n > 1), key=lambda d: d[1])
    reach = 1  # elements spanned by the dims so far: a stride at least that far never lands inside them
    for n, st in dims:
        if st < reach:
            break
        reach = st * (n - 1) + reach
    else:
        return False
    if any(st == 0 for _, st in dims):
        return True
    starts, width = _memory_runs(x)  # rare (strides interleaving dims): exact, runs of equal width
    starts = starts.sort().values
    return bool((starts[1:] < starts[:-1] + width).any())


def _runs_meet(x: torch.Tensor, y: torch.Tensor) -> bool:
    """True when some byte of x's elements is one of y's, for x, y whose byte spans meet: strided
    views of one buffer may interleave without a common byte, so this tests the runs themselves.
    Sorted by start, a run meets a run of the other tensor starting at or before it iff that
    tensor's largest end so far passes its start."""
    (xs, xw), (ys, yw) = _memory_runs(x), _memory_runs(y)
    starts = torch.cat((xs, ys))
    ends = torch.cat((xs + xw, ys + yw))
    of_x = torch.cat((torch.ones_like(xs, dtype=torch.bool), torch.zeros_like(ys, dtype=torch.bool)))
    order = torch.sort(starts, stable=True).indices
    starts, ends, of_x = starts[order], ends[order], of_x[order]
    none = torch.iinfo(torch.int64).min
    x_end = torch.cummax(torch.where(of_x, ends, none), 0).values
    y_end = torch.cummax(torch.where(of_x, none, ends), 0).values
    return bool(((~of_x) & (x_end > starts)).any() or (of_x & (y_end > starts)).any())


def _overlap(x: torch.Tensor, y: torch.Tensor) -> bool:
    """True when some byte of x's elements is one of y's (x, y on one device, neither empty)."""
    (xl, xh), (yl, yh) = _byte_span(x), _byte_span(y)
    return xl < yh and yl < xh and _runs_meet(x, y)


def check_outputs_own_memory(query: torch.Tensor, kv_cache: torch.Tensor, topk: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor | None) -> None:
    """ValueError naming out / lse when a written tensor shares memory with itself (a zero stride:
    an expand()ed tensor) or with another argument: torch's copy_ would refuse it after out was
    written, a kernel would race on it. Tensors are those validate_sparse_decode has checked (one
    device, shapes of the plan, none empty); query may share its own elements (it is only read).
    The usual call (outputs compact, apart from the inputs) costs a few us: a contiguity test and
    a byte span per tensor, runs compared only where two spans meet."""
    written = (("out", out),) if lse is None else (("out", out), ("lse", lse))
    for name, x in written:
        if _shares_elements(x):
            zero = any(st == 0 and n > 1 for n, st in zip(x.shape, x.stride()))
            why = "has zero stride" if zero else "has elements sharing one memory location"
            raise ValueError(
                f"{name}: {why} (shape {_fmt_shape(x)}, strides {list(x.stride())}"
                f"{'; expand()ed?' if zero else ''}); pass a tensor with its own memory"
            )
    spans = [(name, x, _byte_span(x)) for name, x in (("query", query), ("kv_cache", kv_cache), ("topk", topk))]
    for name, x in written:
        xl, xh = span = _byte_span(x)
        for other, y, (yl, yh) in spans:
            if xl < yh and yl < xh and _runs_meet(x, y):
                does = "writes both" if other == "out" else f"reads {other} while it writes {name}"
                raise ValueError(f"{name}: overlaps the memory of {other} (the op {does}); "
                                 f"pass a tensor of its own")
        spans.append((name, x, span))


def kernel_call_ok(query: Any, kv_cache: Any, topk: Any, out: Any, plan: "SparseDecodePlan", lse: Any) -> str:
    """The cache format (FP8_KV or NVFP4_KV) when the tensors pass every check of
    validate_sparse_decode and validate_kernel_layout for `plan` (its device included; not whether
    that device is CUDA) but check_outputs_own_memory: one pass of attribute reads, no message
    building. "" (falsy) says nothing: the full checks then name the problem."""
    _T = torch.Tensor
    if type(query) is not _T or type(kv_cache) is not _T or type(topk) is not _T or type(out) is not _T:
        return ""
    dev = plan.device
    T, hq, hkv, d = plan.num_tokens, plan.num_q_heads, plan.num_kv_heads, plan.head_dim
    if (query.dtype not in Q_TORCH_DTYPES or query.shape != (T, hq, d) or query.device != dev
            or query.stride(2) != 1 or (hq > 1 and query.stride(1) != d) or (T > 1 and query.stride(0) % 16)
            or query.data_ptr() % 16):
        return ""
    kv_shape = kv_cache.shape
    if len(kv_shape) != 4 or kv_shape[0] < 1 or not kv_cache.is_contiguous() or kv_cache.device != dev \
            or kv_cache.data_ptr() % 16:
        return ""
    if kv_cache.dtype in KV_TORCH_DTYPES and kv_shape[1:] == (hkv, plan.page_size, 2 * d):
        fmt = FP8_KV
    elif kv_cache.dtype == torch.uint8 and kv_shape[1:] == (2 * hkv, plan.page_size, d // 2 + d // 16):
        fmt = NVFP4_KV
    else:
        return ""
    if (topk.dtype != torch.int32 or topk.shape != (T, hkv, plan.topk_blocks) or topk.device != dev
            or (plan.topk_blocks > 1 and topk.stride(2) != 1)):
        return ""
    if (out.dtype != torch.bfloat16 or out.shape != (T, hq, d) or not out.is_contiguous() or out.device != dev
            or out.data_ptr() % 16):
        return ""
    if lse is None or (type(lse) is _T and lse.dtype == torch.float32 and lse.shape == (T, hq)
                       and lse.is_contiguous() and lse.device == dev):
        return fmt
    return ""


def validate_kernel_layout(
    query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None
) -> None:
    """Layouts the compiled kernel assumes (msa_jit/kernels/convention.py ARGUMENTS), beyond the API rules.

    query: head stride == head_dim, token stride a multiple of 16 elements, 16-byte aligned;
    kv_cache, out: 16-byte aligned; out, lse: contiguous.
    """
    T, hq, d = query.shape
    if hq > 1 and query.stride(1) != d:
        raise ValueError(
            f"query: the kernel needs the head stride to equal head_dim ({d}), got strides "
            f"{list(query.stride())}; pass query.contiguous()"
        )
    if T > 1 and query.stride(0) % 16:
        raise ValueError(
            f"query: the kernel needs a token stride that is a multiple of 16 elements, got strides "
            f"{list(query.stride())}"
        )
    for name, x in (("query", query), ("kv_cache", kv_cache), ("out", out)):
        if x.data_ptr() % 16:
            raise ValueError(f"{name}: the kernel needs a 16-byte aligned data pointer, got {x.data_ptr():#x}")
    if not out.is_contiguous():
        raise ValueError(f"out: the kernel needs a contiguous tensor, got strides {list(out.stride())}")
    if lse is not None and not lse.is_contiguous():
        raise ValueError(f"lse: the kernel needs a contiguous tensor, got strides {list(lse.stride())}")
