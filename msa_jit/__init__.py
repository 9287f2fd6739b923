"""msa-jit: JIT-compiled MSA block-sparse decode attention kernels.

Typical step::

    plan = msa_jit.prepare(block_table, seq_lens, seq_lens_cpu, qlen,
                           num_q_heads=64, num_kv_heads=4, page_size=128, topk_blocks=16)
    msa_jit.sparse_decode(query, kv_cache, topk, out, plan, sm_scale=128 ** -0.5,
                          q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)

Importing the package imports torch only: triton (the prologue) and the kernel compiler are
imported on first use. It registers the custom op `torch.ops.msa_jit.sparse_decode`
(`msa_jit.integrations.torch_op`; ~9 ms of the ~2 s import, measured).
"""

from __future__ import annotations

import warnings

# torch warns "Failed to initialize NumPy" when it is imported without numpy installed (the
# main-job install has none; msa-jit never uses numpy). Silence that one warning of torch's
# import only; the filter is gone afterwards, and a process that imported torch first sees it.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

from .integrations import torch_op
from .geometry import SparseDecodeConfig, SupportResult, supports  # noqa: E402
from .op import sparse_decode  # noqa: E402
from .plan import SparseDecodePlan  # noqa: E402
from .planner import SparseDecodePlanner, prepare  # noqa: E402
from .reference import sparse_decode_reference  # noqa: E402


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
