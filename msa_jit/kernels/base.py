"""What every arch's decode kernel shares: the static geometry and the host-side launch.

`SparseDecodeKernelBase.__call__` is the exported function: it takes the calling convention
of msa_jit/kernels/convention.py (`ARGUMENTS`, in order), launches the subclass's `kernel` on its
`grid` (by default (token, KV head, split)) and, when the top-k blocks are split, the split
merge (msa_jit/kernels/split_merge.py) in the same launch sequence. A subclass provides `kernel` (its
device code, taking the `ARGUMENTS` tensors and scalars as one `convention.KernelArguments`, then its
`kernel_operands`, then its shared-memory struct), `storage_type`, `threads`, and may override `grid`,
`kernel_operands` (host-made operands such as TMA descriptors), `launch_options` and `pdl`.
"""

# no `from __future__ import annotations`: the DSL reads evaluated annotations
import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .cluster_merge import RECV_BYTES
from .constants import MAX_GROUP_SIZE, MAX_TOPK
from .convention import KernelArguments
from .split_merge import SplitMergeKernel


class SparseDecodeKernelBase:
    """Geometry checks and fields shared by the arch kernels; the launch of the convention."""

    # programmatic dependent launch: may the kernels of this launch be scheduled before the
    # previous kernel in the stream has finished (each waits before its first global access)?
    pdl = False
    # with pdl: does the split merge let the next kernel be scheduled once its own wait returned?
    merge_trigger = True
    # a kernels/cluster_merge.ClusterMerge when the splits merge inside the decode launch
    cluster_merge = None

    @staticmethod
    def occupancy_options(ctas_per_sm: int, q_dtype: str, kv_dtype: str = "float8_e4m3fn") -> dict:
        """Constructor options of the build for `ctas_per_sm` CTAs per SM (SparseDecodeConfig)."""
        if ctas_per_sm == 2:
            return {}
        raise ValueError(f"no build for {ctas_per_sm} CTAs per SM")

    @staticmethod
    def arch_options(arch: str, kv_dtype: str) -> dict:
        """Constructor options of the build for a target arch ("sm_90a", "sm_100a", ...)."""
        return {}

    def __init__(self, *, num_q_heads: int, num_kv_heads: int, page_size: int, topk: int, q_dtype: str,
                 kv_dtype: str = "float8_e4m3fn"):
        if num_q_heads % num_kv_heads:
            raise ValueError("num_q_heads must be a multiple of num_kv_heads")
        self.hq = num_q_heads
        self.hkv = num_kv_heads
        self.group = num_q_heads // num_kv_heads
        if not 1 <= self.group <= MAX_GROUP_SIZE:
            raise ValueError(f"group size {self.group} not in 1..{MAX_GROUP_SIZE}")
        if not 1 <= topk <= MAX_TOPK:
            raise ValueError(f"topk {topk} not in 1..{MAX_TOPK}")
        self.page = page_size
        self.topk = topk
        self.q_fp8 = q_dtype == "float8_e4m3fn"
        self.kv_dtype = kv_dtype

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        query: cute.Tensor,  # [T, Hq, 128] bf16, or uint8 holding e4m3
        kv_cache: cute.Tensor,  # [P, Hkv, page, 256] uint8 (fp8), or [P, 2*Hkv, page, 72] (NVFP4)
        topk: cute.Tensor,  # [T, Hkv, topk] int32, any strides
        block_table: cute.Tensor,  # [B, max_blocks] int32
        kv_lens: cute.Tensor,  # [T] int32
        out: cute.Tensor,  # [T, Hq, 128] bf16
        lse: cute.Tensor,  # [T, Hq] fp32
        partial_o: cute.Tensor,  # [T*Hkv*S, G, 128] fp32
        partial_lse: cute.Tensor,  # [T*Hkv*S, G] fp32
        k_scale_tensor: cute.Tensor,  # [1] fp32, multiplied into qk_scale_log2 on the device
        v_scale_tensor: cute.Tensor,  # [1] fp32, multiplied into v_scale on the device
        qlen: Int32,
        num_splits: Int32,
        qk_scale_log2: Float32,
        v_scale: Float32,
        stream: cuda.CUstream,
    ):
        """The exported function: msa_jit/kernels/convention.py ARGUMENTS, in order, then the stream."""
        num_tokens = query.shape[0]
        args = (KernelArguments(query, kv_cache, topk, block_table, kv_lens, out, lse, partial_o, partial_lse,
                                k_scale_tensor, v_scale_tensor, qlen, num_splits, qk_scale_log2, v_scale),
                *self.kernel_operands(kv_cache), self.storage_type())
        options = dict(
            grid=self.grid(num_tokens, qlen, num_splits),
            block=(self.threads, 1, 1),
            stream=stream,
            # explicit carveout, so compiling needs no GPU to query the shared-memory size
            preferred_smem_carveout=100,
            use_pdl=self.pdl,
            **self.launch_options(),
        )
        if cutlass.const_expr(self.cluster_merge is None):
            self.kernel(*args).launch(**options)
            if num_splits > 1:
                self.launch_merge(out, lse, partial_o, partial_lse, num_splits, num_tokens, stream)
        elif num_splits > 1 and self.cluster_merge.fits(num_splits):
            # the splits merge inside the decode launch (msa_jit/kernels/cluster_merge.py): one launch
            self.kernel(*args).launch(cluster=[1, 1, num_splits], **options)
        else:
            self.kernel(*args).launch(**options)
            if num_splits > 1:
                self.launch_merge(out, lse, partial_o, partial_lse, num_splits, num_tokens, stream)

    def launch_merge(self, out, lse, partial_o, partial_lse, num_splits, num_tokens, stream) -> None:
        """The split merge kernel after the decode kernel (traced in __call__)."""
        SplitMergeKernel(num_kv_heads=self.hkv, group_size=self.group, max_splits=self.topk,
                         pdl=self.pdl, trigger=self.merge_trigger).launch(out, lse, partial_o, partial_lse, num_splits,
                                                                          num_tokens, stream)

    def grid(self, num_tokens, qlen, num_splits) -> tuple:
        """The decode kernel's grid (traced in __call__): one CTA per (token, KV head, split)."""
        return (num_tokens, self.hkv, num_splits)

    def kernel_operands(self, kv_cache) -> tuple:
        """Operands the host side makes for the decode kernel, passed after the convention's
        arguments (traced in __call__): none."""
        return ()

    def storage_type(self):
        """The shared-memory struct of the decode kernel (a cute.struct class)."""
        raise NotImplementedError

    def smem_bytes(self) -> int:
        """Dynamic shared memory the decode kernel is launched with: its storage struct, then, with a
        cluster merge, the receive buffer its kernel() allocates after it at 16-byte alignment."""
        size = int(self.storage_type().size_in_bytes())
        if self.cluster_merge is not None:
            size = -(-size // 16) * 16 + RECV_BYTES
        return size

    def launch_options(self) -> dict:
        """Extra launch options of the decode kernel."""
        return {}

    def kernel(self, args, *operands_then_storage):  # pragma: no cover - every arch kernel defines its @cute.kernel
        """The decode kernel: `args` (a KernelArguments), then kernel_operands(), then the storage struct."""
        raise NotImplementedError
