"""Every constant that shapes generated code or the cache layouts the kernels read: one definition each.

The kernels import these, and so do the host side (geometry limits, the NVFP4 layout, validation),
so a change here changes every cache key (this file is hashed with the rest of the package).
"""

from __future__ import annotations

import math

HEAD_DIM = 128  # values per head of Q, K, V and O (MiniMax-M3's)
LN2 = math.log(2.0)

# The cache formats (SparseDecodeConfig.kv_dtype)
FP8_KV = "float8_e4m3fn"  # [P, Hkv, page, 256] uint8: a token row is K (128 B) then V (128 B)
NVFP4_KV = "nvfp4"  # [P, 2*Hkv, page, NVFP4_ROW_BYTES] uint8 (msa_jit.nvfp4 documents the layout)
KV_DTYPES = (FP8_KV, NVFP4_KV)
FP8_ROW_BYTES = 2 * HEAD_DIM  # one token row of an fp8 page
E4M3_MAX = 448.0  # the largest finite e4m3 value

# The NVFP4 slot: page * 64 bytes of e2m1 codes (token n's 128 values at [64n, 64n + 64)), then
# page * 8 e4m3 block scales (K: row-major; V: the writer's swizzle of NVFP4_V_SCALE_TILE tokens)
NVFP4_GROUP_SIZE = 16  # elements per e4m3 block scale
NVFP4_CODE_BYTES = HEAD_DIM // 2  # packed e2m1 codes of one token row
NVFP4_SCALE_BYTES = HEAD_DIM // NVFP4_GROUP_SIZE  # block scales of one token row
NVFP4_ROW_BYTES = NVFP4_CODE_BYTES + NVFP4_SCALE_BYTES  # 72
NVFP4_V_SCALE_TILE = 4  # tokens per V-scale swizzle tile

# Limits of the kernels' design
MAX_TOPK = 32  # selected blocks per token and KV head (the kernels' slot loops and masks)
MAX_GROUP_SIZE = 16  # query heads per KV head (one MMA's rows at most)
UNION_ROWS = 64  # MMA rows of a union CTA: its tile's tokens x the group's G query heads
# the most splits a cluster merges: the cluster merge's receive buffer rows, and the largest cluster
# the DSL launches; a power of two up to it puts ceil(G / splits) * splits <= 16 rows in each merging
# CTA for every G <= MAX_GROUP_SIZE
MAX_CLUSTER_SPLITS = 16
