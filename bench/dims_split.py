"""Row 89's retired layouts of the dims-split kernel (kernels/sparse_decode_dims.py), for the bench only.

`DimsLayoutKernel` subclasses the shipped `SparseDecodeTokenDimsKernel` (P V split by head dims, the
fp8 cluster build since session 33) and lays a stage down another way:

  pad_rows=0   the block as it lies (one bulk copy): the 4 lanes that share an n-tile column read
               one bank in 4 rows 1 KiB apart, 4-way conflicts on every V load
  pad_rows=4   every 4 rows (1 KiB, 32 bulk copies) 32 bytes after the previous 4: conflict-free,
               but one lane issues 32 copies per block (slower at 8/1, row 89)

Both take their keys in the key split's order. The shipped layout is 4 copies of 32 rows 32 bytes
apart, lane c's keys of a k-step in group c (`pad_rows=32` here builds the shipped kernel).
Variants: kv_format_ab.py f_c2_cm_dims (0), f_c2_cm_dims_pad (4), f_c2_cm_dims_pad32 (32). The files
kv-format-ab-2026-12-06T1024 / T1027 timed an earlier, uncommitted form of layouts 0 and 4 (the same
layouts and math; their address arithmetic compiled differently), T1036 the shipped one.
"""

# no `from __future__ import annotations`: the DSL reads evaluated annotations
from msa_jit.jit.compiler import kernels_package

kernels_package()
from msa_jit.kernels.token_dims import GROUP_PAD, SparseDecodeTokenDimsKernel  # noqa: E402


class DimsLayoutKernel(SparseDecodeTokenDimsKernel):
    """The shipped dims-split kernel with a retired stage layout (see the module docstring)."""

    def __init__(self, *, pv_split: str = "dims", pad_rows: int = 32, **options):
        super().__init__(**options)
        if pv_split != "dims" or pad_rows not in (0, 4, 32):
            raise ValueError(f"pv_split {pv_split!r} / pad_rows {pad_rows}: 'dims' and 0, 4 or 32")
        self.pad_rows = pad_rows
        if pad_rows != 32:
            self.set_stage_layout(pad_rows or self.page, GROUP_PAD if pad_rows else 0)

    def key_of(self, wp, sub, c, i):
        if self.pad_rows == 32:
            return SparseDecodeTokenDimsKernel.key_of(self, wp, sub, c, i)
        return 32 * wp + 16 * sub + 4 * c + i  # the key split's order
