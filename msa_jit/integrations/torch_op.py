"""`torch.ops.msa_jit.sparse_decode`: the sparse decode op as a PyTorch custom op.

Use `sparse_decode_op(query, kv_cache, topk, out, plan, ...)` (same arguments as
`msa_jit.sparse_decode`) inside code that `torch.compile(fullgraph=True)` traces or that
`torch.library.opcheck` checks; eager callers may call `msa_jit.sparse_decode` directly
(a few microseconds less dispatch).

How the plan crosses the op boundary (why not a registry id):

* A custom op's schema takes tensors, scalars, strings and lists of them, not a Python
  object, so the plan is unpacked: every tensor the op reads (`block_table`, `seq_lens`,
  `kv_lens`) or writes (`out`, `lse`, the plan's split-KV workspace) is an explicit argument,
  and the plan's shape scalars, with the launch choice of the call's cache format (`kernel`,
  `ctas_per_sm`, `num_splits`, `split_merge`), are int and str arguments. The compiler then sees every data dependency: a `prepare` (its
  in-place refresh of `kv_lens`) or an engine op that writes `block_table` earlier in the
  same graph is ordered before the kernel, functionalization knows what is written, and
  CUDA-graph capture (inductor's cudagraph trees) knows every address the replay touches.
* A registry int would hide those reads and writes (a compiled graph could reorder or drop
  them, and functionalization would not copy back what the kernel wrote), and dynamo would
  bake the id into the graph as a constant, so each plan would need its own graph. With
  tensors, one compiled graph serves every plan of the same shape (dynamo guards on the
  plan's int attributes, which are the plan-cache key anyway).
* `lse` is optional in the Python API but always a tensor in the op: when the caller passes
  none, the plan's `lse_scratch` goes in its place. The kernel always writes an lse (its
  calling convention takes one), so this costs nothing and keeps one op with a fixed
  mutation signature (the alternative, two ops with and without lse, doubles the surface).
* The workspace is a `Tensor[]` declared mutated: every tensor field of the plan other than
  the inputs above (today `partial_o`, `partial_lse`), found from the
  dataclass fields, so a workspace added to the plan later is passed without editing this
  file. Declaring it mutated is required: the kernel writes it (the counters are reset to
  zero by the kernel itself before it returns).

The real implementation rebuilds a lightweight `SparseDecodePlan` from these arguments and
calls `msa_jit.op.sparse_decode` (validation + dispatch); its `config(q_dtype)` equals the
original plan's. Compiled kernels are cached in this module per config (geometry, arch and
occupancy), so the rebuilt plans share them. The fake (meta) implementation returns None and
allocates nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable

import torch

from ..geometry import HEAD_DIM, device_arch
from ..kernels.constants import FP8_KV, NVFP4_KV
from ..nvfp4 import is_nvfp4_kv_layout
from ..op import sparse_decode
from ..plan import LaunchChoice, SparseDecodePlan
from ..validation import check_backend, check_scale, check_tensor

__all__ = ["OP_NAME", "WORKSPACE_FIELDS", "op_args", "sparse_decode_op"]

OP_NAME = "msa_jit::sparse_decode"

# Plan tensors passed as read-only inputs / not passed (qo_offset is not read by the op;
# lse_scratch travels as `lse`). Every other tensor field of the plan is workspace.
_INPUT_FIELDS = ("block_table", "seq_lens", "kv_lens", "unit_scale")
_NOT_PASSED = ("qo_offset", "lse_scratch")


def _tensor_fields(cls: type) -> tuple[str, ...]:
    return tuple(
        f.name for f in dataclasses.fields(cls)
        if f.init and f.type in ("torch.Tensor", torch.Tensor)
    )


WORKSPACE_FIELDS: tuple[str, ...] = tuple(
    n for n in _tensor_fields(SparseDecodePlan) if n not in _INPUT_FIELDS + _NOT_PASSED
)
# the plan's constructor arguments, read once (dataclasses.fields per call costs ~3 us)
_PLAN_INIT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SparseDecodePlan) if f.init)

# (Hq, Hkv, page, topk_blocks, arch, kv format, its launch choice) -> {(q dtype, kv dtype): kernel},
# shared by the rebuilt plans: every SparseDecodeConfig field but the two dtypes (the op keys those per
# call), so a plan gets the build its config names; and the split counts, because a cluster build is kept
# only where the GPU holds a cluster of that many CTAs (SparseDecodePlan.resolve_kernel: a plan of 16
# splits must not reuse the build a plan of 2 resolved, nor the reverse).
_KERNELS: dict[tuple[Any, ...], dict[torch.dtype, Callable[..., Any]]] = {}


@functools.lru_cache(maxsize=None)
def _cuda_arch(index: int) -> str:
    return device_arch(torch.device("cuda", index))


def _arch_of(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


def _rebuild_plan(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    unit_scale: torch.Tensor,
    lse: torch.Tensor,
    workspace: list[torch.Tensor],
    ints: dict[str, Any],
) -> SparseDecodePlan:
    """A SparseDecodePlan around the op's arguments (no allocation)."""
    device = seq_lens.device
    arch = _arch_of(device)
    kkey = (ints["num_q_heads"], ints["num_kv_heads"], ints["page_size"], ints["topk_blocks"], arch,
            ints["kv_format"], ints["launch"])
    values: dict[str, Any] = dict(
        ints,
        head_dim=HEAD_DIM,
        batch=int(seq_lens.shape[0]),
        block_table_stride=int(block_table.stride(0)),
        device=device,
        kv_lens=kv_lens,
        qo_offset=kv_lens,  # not read by the op
        lse_scratch=lse,
        unit_scale=unit_scale,
        block_table=block_table,
        seq_lens=seq_lens,
        arch=arch,
        kernels=_KERNELS.setdefault(kkey, {}),
        # the call's cache format only: the op reads the launch of the format it is given
        launches={ints["kv_format"]: ints["launch"]},
    )
    if len(workspace) != len(WORKSPACE_FIELDS):
        raise ValueError(
            f"workspace: expected {len(WORKSPACE_FIELDS)} tensors {WORKSPACE_FIELDS}, got {len(workspace)}"
        )
    values.update(zip(WORKSPACE_FIELDS, workspace))
    return SparseDecodePlan(**{n: values[n] for n in _PLAN_INIT_FIELDS if n in values})


@torch.library.custom_op(OP_NAME, mutates_args=("out", "lse", "workspace"))
def _sparse_decode_custom(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    topk: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    unit_scale: torch.Tensor,
    workspace: list[torch.Tensor],
    num_q_heads: int,
    num_kv_heads: int,
    page_size: int,
    topk_blocks: int,
    qlen: int,
    kv_format: str,
    kernel: str,
    ctas_per_sm: int,
    num_splits: int,
    split_merge: str,
    sm_scale: float,
    q_scale: float,
    k_scale: float,
    v_scale: float,
    k_scale_tensor: torch.Tensor | None,
    v_scale_tensor: torch.Tensor | None,
    backend: str,
) -> None:
    """Real implementation: rebuild the plan, run `msa_jit.op.sparse_decode` (writes out, lse, workspace)."""
    plan = _rebuild_plan(
        block_table, seq_lens, kv_lens, unit_scale, lse, workspace,
        dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, page_size=page_size,
             topk_blocks=topk_blocks, qlen=qlen, kv_format=kv_format,
             launch=LaunchChoice(kernel, ctas_per_sm, num_splits, split_merge)),
    )
    sparse_decode(
        query, kv_cache, topk, out, plan,
        sm_scale=sm_scale, q_scale=q_scale,
        k_scale=k_scale if k_scale_tensor is None else k_scale_tensor,
        v_scale=v_scale if v_scale_tensor is None else v_scale_tensor,
        lse=lse, backend=backend,
    )


@_sparse_decode_custom.register_fake
def _sparse_decode_fake(*args: Any, **kwargs: Any) -> None:
    """Meta implementation (the custom op's arguments, as above): everything is written in place,
    nothing is returned or allocated."""
    return None


def _version_bump_kernel(op: Any) -> Callable[..., Any]:
    """The op's ADInplaceOrView kernel: bump the version counter of every tensor the schema declares
    written (out, lse, each workspace tensor), then run the op below that key.

    What torch.library.custom_op registers there for a mutable op, with the written arguments'
    positions read from the schema once. Some torch releases (2.13) look each argument up again
    through `schema.arguments` on every call, a list of every argument rebuilt per lookup: with
    this op's 27 arguments 150-200 us per call, paid whenever an argument tensor was created outside
    `torch.inference_mode()` (a KV cache, a model buffer), i.e. by eager callers and by compiled
    graphs run outside a CUDA graph, against ~8 us for the op itself."""
    arguments = op._schema.arguments
    written = tuple((i, a.name) for i, a in enumerate(arguments)
                    if a.alias_info is not None and a.alias_info.is_write)
    bump = torch.autograd.graph.increment_version
    below = torch._C._after_ADInplaceOrView_keyset
    tensor = torch.Tensor

    def ad_inplace_or_view(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        n = len(args)
        for i, name in written:
            v = args[i] if i < n else kwargs.get(name)
            if isinstance(v, tensor):
                bump(v)
            elif isinstance(v, (list, tuple)):
                for t in v:
                    if isinstance(t, tensor):
                        bump(t)
        return op.redispatch(keyset & below, *args, **kwargs)

    return ad_inplace_or_view


def _register_version_bump() -> Any:
    """`_version_bump_kernel` in place of custom_op's own ADInplaceOrView kernel; the Library that
    holds it (kept for the process's life: its registration ends with it), or None where this torch
    cannot replace a Python kernel (no `allow_override`, before torch 2.8: custom_op's stays)."""
    op = torch.ops.msa_jit.sparse_decode.default
    lib = torch.library.Library("msa_jit", "FRAGMENT")  # noqa: TOR901 - an impl for our own op
    try:
        with warnings.catch_warnings():
            # the dispatcher's note that a kernel of this key is replaced
            warnings.filterwarnings("ignore", message="Warning only once for all operators", category=UserWarning)
            lib.impl(OP_NAME.split("::")[1], _version_bump_kernel(op), "ADInplaceOrView", with_keyset=True,
                     allow_override=True)
    except Exception:  # noqa: BLE001 - a speed-up only: any torch that refuses it keeps custom_op's kernel
        return None
    return lib


_VERSION_BUMP_LIB = _register_version_bump()


def op_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    topk: torch.Tensor,
    out: torch.Tensor,
    plan: SparseDecodePlan,
    *,
    sm_scale: float,
    q_scale: float = 1.0,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
    lse: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[Any, ...]:
    """Positional arguments of `torch.ops.msa_jit.sparse_decode` for one call (e.g. for opcheck).

    A tensor k_scale / v_scale (a device global scale) travels as its own optional tensor
    argument, the float one as 1.0 beside it. The other scales become the schema's floats here,
    through the op's own check (`check_scale`): a bool, a complex or an int past float's range is
    the op's named TypeError / ValueError, never read as 1.0, cut to its real part or an OverflowError.
    """
    if not isinstance(plan, SparseDecodePlan):  # the op's own check comes after these attribute reads
        raise TypeError(f"plan: expected a SparseDecodePlan (from prepare()), got {type(plan).__name__}")
    # what the schema would refuse with the dispatcher's "Expected a value of type ..." is named here first
    for name, value in (("query", query), ("kv_cache", kv_cache), ("topk", topk), ("out", out)):
        check_tensor(name, value)
    if lse is not None:
        check_tensor("lse", lse)
    backend = check_backend(backend)
    sm, qs = check_scale("sm_scale", sm_scale), check_scale("q_scale", q_scale)
    k_t = k_scale if isinstance(k_scale, torch.Tensor) else None
    v_t = v_scale if isinstance(v_scale, torch.Tensor) else None
    ks = 1.0 if k_t is not None else check_scale("k_scale", k_scale)
    vs = 1.0 if v_t is not None else check_scale("v_scale", v_scale)
    # the call's cache format (an fp8 cache may come as its uint8 storage); a malformed cache is the op's
    # named error either way
    fmt = NVFP4_KV if is_nvfp4_kv_layout(kv_cache) else FP8_KV
    launch = plan.launch(fmt)
    return (
        query, kv_cache, topk, out,
        plan.lse_scratch if lse is None else lse,
        plan.block_table, plan.seq_lens, plan.kv_lens, plan.unit_scale,
        [getattr(plan, n) for n in WORKSPACE_FIELDS],
        plan.num_q_heads, plan.num_kv_heads, plan.page_size, plan.topk_blocks, plan.qlen,
        fmt, launch.kernel, launch.ctas_per_sm, launch.num_splits, launch.split_merge,
        sm, qs, ks, vs, k_t, v_t, backend,
    )


def sparse_decode_op(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    topk: torch.Tensor,
    out: torch.Tensor,
    plan: SparseDecodePlan,
    *,
    sm_scale: float,
    q_scale: float = 1.0,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
    lse: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """`msa_jit.sparse_decode` through the custom op (torch.compile / opcheck friendly).

    query: [T, Hq, 128] bf16 or fp8 e4m3; kv_cache: fp8 [P, Hkv, page, 256] (or uint8) or NVFP4
    uint8 [P, 2*Hkv, page, 72]; topk: [T, Hkv, topk] int32; out: [T, Hq, 128] bf16 written in
    place; lse: optional [T, Hq] fp32 written in place; plan: from `prepare(...)` of this step.
    Scales are python floats; k_scale / v_scale may be one-element fp32 device tensors;
    backend "auto" | "kernel" | "reference".
    """
    torch.ops.msa_jit.sparse_decode(*op_args(
        query, kv_cache, topk, out, plan, sm_scale=sm_scale, q_scale=q_scale,
        k_scale=k_scale, v_scale=v_scale, lse=lse, backend=backend,
    ))
