"""msa-jit: JIT-compiled MSA block-sparse decode attention kernels.

Typical step::

    plan = msa_jit.prepare(block_table, seq_lens, seq_lens_cpu, qlen,
                           num_q_heads=64, num_kv_heads=4, page_size=128, topk_blocks=16)
    msa_jit.sparse_decode(query, kv_cache, topk, out, plan, sm_scale=128 ** -0.5,
                          q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)

Importing the package imports torch only: triton (the prologue) and the kernel compiler are
imported on first use.
"""

from __future__ import annotations

from .geometry import SparseDecodeConfig, SupportResult, supports
from .op import sparse_decode
from .plan import SparseDecodePlan
from .planner import SparseDecodePlanner, prepare
from .reference import sparse_decode_reference


def _version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("msa-jit")
        except PackageNotFoundError:
            return "0.1.0"
    except Exception:  # pragma: no cover
        return "0.1.0"


__version__ = _version()

__all__ = [
    "SparseDecodeConfig",
    "SparseDecodePlan",
    "SparseDecodePlanner",
    "SupportResult",
    "__version__",
    "prepare",
    "sparse_decode",
    "sparse_decode_reference",
    "supports",
]
