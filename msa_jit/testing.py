"""Random valid (and adversarial) inputs for the sparse decode op: tests, `msa-jit selftest`.

`make_case(...)` follows the operator contract (docs/contract.md): request-major tokens, fp8 KV cache
[P, Hkv, page, 256] (or, with kv_dtype="nvfp4", an NVFP4 cache [P, 2*Hkv, page, 72] written by
msa_jit.nvfp4 from bf16 K/V) with a random permutation of physical pages, ascending unique topk
rows padded with -1 that always hold the block of the current position.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import torch

from .geometry import HEAD_DIM
from .kernels.constants import NVFP4_V_SCALE_TILE
from .nvfp4 import quantize_kv_nvfp4

FP8 = torch.float8_e4m3fn
CASE_KV_DTYPES = ("fp8", "nvfp4")  # make_case's short names of the cache formats


@dataclass
class Case:
    """One step's inputs. Tensors live on `device`; `seq_lens_cpu` on the CPU.

    query [T, Hq, 128] (bf16 or fp8), kv_cache [P, Hkv, page, 256] fp8 (contiguous) or, when
    kv_dtype == "nvfp4", uint8 [P, 2*Hkv, page, 72] (contiguous; k_scale / v_scale are then its
    global scales), topk [T, Hkv, K] int32 (a transposed view of a [Hkv, T, K] buffer when
    transposed_topk), block_table [B, max_blocks] int32 (row stride > max_blocks when
    adversarial), seq_lens [B] int32 (counts the qlen new tokens).
    has_duplicates: a topk row lists a block twice (outside the contract; the reference uses
    set semantics, a kernel may count it twice: compare only when False).
    k_unquantized / v_unquantized: NVFP4 cases only, the bf16 [P, Hkv, page, 128] K/V the
    cache was quantized from, on the CPU (for `error_vs_unquantized`).
    """

    query: torch.Tensor
    kv_cache: torch.Tensor
    topk: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    batch: int
    qlen: int
    num_q_heads: int
    num_kv_heads: int
    page_size: int
    topk_blocks: int
    sm_scale: float
    q_scale: float
    k_scale: float
    v_scale: float
    adversarial: bool = False
    transposed_topk: bool = False
    has_duplicates: bool = False
    kv_dtype: str = "fp8"
    k_unquantized: torch.Tensor | None = None
    v_unquantized: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.batch * self.qlen

    @property
    def device(self) -> torch.device:
        return self.query.device

    def prepare_args(self) -> tuple[Any, ...]:
        """Positional args of prepare(): (block_table, seq_lens, seq_lens_cpu, qlen)."""
        return (self.block_table, self.seq_lens, self.seq_lens_cpu, self.qlen)

    def prepare_kwargs(self) -> dict[str, int]:
        return dict(num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
                    page_size=self.page_size, topk_blocks=self.topk_blocks)

    def scales(self, *, scale_tensors: bool = False) -> dict[str, Any]:
        """Keyword scales of the op / reference: python floats; with scale_tensors, k_scale and
        v_scale as 0-dim float32 tensors on the case's device (how vLLM passes NVFP4's global
        scales: its `_k_scale` / `_v_scale` buffers). Both forms are the same numbers."""
        kv: tuple[Any, Any] = (self.k_scale, self.v_scale)
        if scale_tensors:
            kv = tuple(torch.tensor(x, dtype=torch.float32, device=self.device) for x in kv)
        return dict(sm_scale=self.sm_scale, q_scale=self.q_scale, k_scale=kv[0], v_scale=kv[1])

    def unquantized_kv_cache(self) -> torch.Tensor:
        """NVFP4 cases: the bf16 K/V before quantization as a float cache [P, Hkv, page, 256]
        on the CPU (what sparse_decode_reference takes with k_scale = v_scale = 1)."""
        if self.k_unquantized is None or self.v_unquantized is None:
            raise ValueError(f"case: a {self.kv_dtype} case keeps no unquantized K/V")
        return torch.cat((self.k_unquantized, self.v_unquantized), dim=-1)

    def reference_args(self) -> tuple[Any, ...]:
        """Positional args of sparse_decode_reference()."""
        return (self.query, self.kv_cache, self.topk, self.block_table, self.seq_lens, self.qlen)

    def new_out(self) -> torch.Tensor:
        """A [T, Hq, 128] bf16 output poisoned with NaN."""
        return torch.full((self.num_tokens, self.num_q_heads, HEAD_DIM), float("nan"),
                          dtype=torch.bfloat16, device=self.device)

    def new_lse(self) -> torch.Tensor:
        """A [T, Hq] fp32 lse poisoned with NaN."""
        return torch.full((self.num_tokens, self.num_q_heads), float("nan"),
                          dtype=torch.float32, device=self.device)


def _nonzero_normal(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Standard normal values with |x| >= 0.02 (never rounds to zero in fp8 e4m3)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    return torch.where(x >= 0, 1.0, -1.0) * x.abs().clamp_min(0.02)


def _realistic_kv(shape: tuple[int, int, int, int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 K, V [P, Hkv, page, 128], a stand-in for a model's K/V (not measured from one).

    K: per (head, channel) a mean ~ N(0, 0.5) and a scale ~ exp(N(0, 0.3)), with 4 outlier
    channels per head scaled 5..10x (the large norm weights a post-norm K shows), times a
    per-token factor exp(N(0, 0.1)). V: N(0, 1) times a per-(head, channel) exp(N(0, 0.3)).
    """
    P, hkv, page, D = shape
    ch = (1, hkv, 1, D)
    k_std = torch.exp(0.3 * torch.randn(ch, generator=gen))
    outliers = torch.rand(ch, generator=gen).argsort(dim=-1) < 4
    k_std = torch.where(outliers, k_std * (5 + 5 * torch.rand(ch, generator=gen)), k_std)
    k_mean = 0.5 * torch.randn(ch, generator=gen)
    token = torch.exp(0.1 * torch.randn((P, hkv, page, 1), generator=gen))
    k = (torch.randn(shape, generator=gen) + k_mean) * k_std * token
    v = torch.randn(shape, generator=gen) * torch.exp(0.3 * torch.randn(ch, generator=gen))
    return k.to(torch.bfloat16), v.to(torch.bfloat16)


def _random_ctx_lens(rng: random.Random, batch: int, qlen: int, page: int, topk: int,
                     padded: bool) -> list[int]:
    """Context lengths mixing < page, exact multiples, > topk blocks and in-between."""
    kinds = ["short", "multiple", "long", "mid"]
    rng.shuffle(kinds)
    lens = []
    for i in range(batch):
        kind = kinds[i % len(kinds)]
        if kind == "short":
            n = rng.randint(qlen, page - 1)
        elif kind == "multiple":
            n = page * rng.randint(1, topk + 3)
        elif kind == "long":
            n = rng.randint(topk * page + 1, (topk + 6) * page)
        else:
            n = rng.randint(page, topk * page)
        lens.append(max(n, qlen))
    if padded:
        # padded requests (CUDA-graph filler): some tokens have a negative position
        for i in rng.sample(range(batch), max(1, batch // 4)):
            lens[i] = 0 if i % 2 == 0 or qlen == 1 else rng.randint(0, qlen - 1)
    return lens


def make_case(
    batch: int,
    qlen: int,
    num_q_heads: int,
    num_kv_heads: int,
    *,
    q_dtype: torch.dtype,
    seed: int,
    device: Any = "cpu",
    ctx_lens: list[int] | None = None,
    transposed_topk: bool = False,
    adversarial: bool = False,
    page_size: int = 128,
    topk_blocks: int = 16,
    padded: bool = False,
    kv_dtype: str = "fp8",
) -> Case:
    """Random inputs valid per the contract (see Case).

    kv_dtype: "fp8" (random fp8 values, random k_scale / v_scale) or "nvfp4" (bf16 K/V from
    `_realistic_kv`, quantized on `device` by msa_jit.nvfp4.quantize_kv_nvfp4 with its default
    global scales, which become k_scale / v_scale; page_size must be a multiple of 4).

    ctx_lens: per-request seq_lens (including the qlen new tokens); random when None.
    padded: also make some requests padding (seq_len < qlen, so kv_len == 0 rows).
    adversarial: garbage block-table entries past each request's blocks (out-of-range pages),
    a wider block-table row stride, and topk rows with -1 in the middle, blocks past the
    token's / request's blocks, duplicates, and garbage past nvalid. Never changes the
    contract's answer except for duplicates (see Case.has_duplicates).
    """
    if kv_dtype not in CASE_KV_DTYPES:
        raise ValueError(f"kv_dtype: expected one of {CASE_KV_DTYPES}, got {kv_dtype!r}")
    if kv_dtype == "nvfp4" and page_size % NVFP4_V_SCALE_TILE:
        raise ValueError(f"page_size: an NVFP4 cache needs a multiple of {NVFP4_V_SCALE_TILE}, got {page_size}")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    page, K = page_size, topk_blocks
    T = batch * qlen
    hkv = num_kv_heads
    if ctx_lens is None:
        ctx_lens = _random_ctx_lens(rng, batch, qlen, page, K, padded)
    if len(ctx_lens) != batch:
        raise ValueError("ctx_lens needs one entry per request")
    nblocks = [-(-n // page) for n in ctx_lens]

    # ---- physical pages: a random permutation, plus a few spare pages nobody owns
    P = sum(nblocks) + rng.randint(1, 3)
    perm = torch.randperm(P, generator=gen).tolist()
    max_blocks = max(max(nblocks), 1) + rng.randint(0, 2)
    extra_cols = 3 if adversarial else 0
    storage = torch.zeros(batch, max_blocks + extra_cols, dtype=torch.int32)
    garbage = [-1, -7, P, P + 1000, 2**31 - 1, -(2**31)]
    nxt = 0
    for r in range(batch):
        for b in range(max_blocks + extra_cols):
            if b < nblocks[r]:
                storage[r, b] = perm[nxt]
                nxt += 1
            elif adversarial:
                storage[r, b] = rng.choice(garbage)

    # ---- topk rows
    topk_rows = torch.full((T, hkv, K), -1, dtype=torch.int32)
    has_dup = False
    for t in range(T):
        r, j = divmod(t, qlen)
        pos = ctx_lens[r] - qlen + j
        kv_len = max(pos + 1, 0)
        nvis = -(-kv_len // page)
        nvalid = min(K, nvis)
        for h in range(hkv):
            if nvalid == 0:
                row = [-1] * K
                if adversarial:  # never read: anything goes
                    row = [rng.randint(-3, max_blocks + 3) for _ in range(K)]
                topk_rows[t, h] = torch.tensor(row, dtype=torch.int32)
                continue
            cur = pos // page
            others = rng.sample([b for b in range(nvis) if b != cur], nvalid - 1)
            row = sorted(others + [cur]) + [-1] * (K - nvalid)
            if adversarial:
                cur_slot = row.index(cur)
                for s in range(nvalid):
                    if s == cur_slot or rng.random() < 0.5:
                        continue
                    kind = rng.randrange(4)
                    if kind == 0:
                        row[s] = -1
                    elif kind == 1:  # past the request's blocks, maybe past the table
                        row[s] = rng.choice([nblocks[r] + rng.randint(0, 3), max_blocks + 5, 2**30])
                    elif kind == 2:  # within the request, not visible to this token (if any)
                        if nvis < nblocks[r]:
                            row[s] = rng.randint(nvis, nblocks[r] - 1)
                    else:
                        other = rng.randrange(nvalid)
                        if other != s and row[other] >= 0 and row[other] != row[s]:
                            row[s] = row[other]
                for s in range(nvalid, K):
                    row[s] = rng.randint(-3, max_blocks + 3)
                valid = [b for b in row[:nvalid] if 0 <= b and b * page < kv_len]
                has_dup = has_dup or len(valid) != len(set(valid))
            topk_rows[t, h] = torch.tensor(row, dtype=torch.int32)

    # ---- values
    if kv_dtype == "fp8":
        kv = _nonzero_normal((P, hkv, page, 2 * HEAD_DIM), gen).to(FP8)
    else:
        k_unq, v_unq = _realistic_kv((P, hkv, page, HEAD_DIM), gen)
    if q_dtype == FP8:
        query = _nonzero_normal((T, num_q_heads, HEAD_DIM), gen).to(FP8)
        q_scale = rng.uniform(0.5, 2.0)
    elif q_dtype == torch.bfloat16:
        query = torch.randn((T, num_q_heads, HEAD_DIM), generator=gen).to(torch.bfloat16)
        q_scale = 1.0
    else:
        raise ValueError(f"q_dtype {q_dtype} not supported")

    dev = torch.device(device)
    if transposed_topk:
        buf = torch.empty((hkv, T, K), dtype=torch.int32, device=dev)  # real [Hkv, T, K] storage
        buf.copy_(topk_rows.permute(1, 0, 2))
        topk_t = buf.transpose(0, 1)
    else:
        topk_t = topk_rows.to(dev)
    seq_lens_cpu = torch.tensor(ctx_lens, dtype=torch.int32)
    if kv_dtype == "fp8":
        kv_cache, k_unq, v_unq = kv.to(dev), None, None
        k_scale, v_scale = rng.uniform(0.5, 2.0), rng.uniform(0.5, 2.0)
    else:
        kv_cache, k_scale, v_scale = quantize_kv_nvfp4(k_unq.to(dev), v_unq.to(dev))
    return Case(
        query=query.to(dev),
        kv_cache=kv_cache,
        topk=topk_t,
        block_table=storage.to(dev)[:, :max_blocks],
        seq_lens=seq_lens_cpu.to(dev),
        seq_lens_cpu=seq_lens_cpu,
        batch=batch,
        qlen=qlen,
        num_q_heads=num_q_heads,
        num_kv_heads=hkv,
        page_size=page,
        topk_blocks=K,
        sm_scale=1.0 / math.sqrt(HEAD_DIM),
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        adversarial=adversarial,
        transposed_topk=transposed_topk,
        has_duplicates=has_dup,
        kv_dtype=kv_dtype,
        k_unquantized=k_unq,
        v_unquantized=v_unq,
    )


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64 on the CPU (||got - ref|| where ref is all zero)."""
    den = ref.norm().item()
    return (got.detach().cpu().double() - ref.cpu().double()).norm().item() / (den if den > 0 else 1.0)


def share_slots(case: Case, shared: int) -> None:
    """Speculative decode's draft tokens, in place: token j > 0 of each request selects its current
    block, then the valid blocks among token 0's first `shared` topk slots, then its own other
    blocks, at most its nvalid = min(topk, ceil(kv_len / page)) of them, ascending, -1 after (a row
    as the contract has it: no block twice, the current one included). Every one is visible to
    token j: it sees at least token 0's keys. Rows with kv_len 0 stay as they are."""
    if not shared:
        return
    rows = case.topk.cpu()
    k, page = rows.shape[-1], case.page_size
    seq = case.seq_lens_cpu.tolist()
    for r in range(case.batch):
        t0 = r * case.qlen
        for j in range(1, case.qlen):
            pos = seq[r] - case.qlen + j
            if pos < 0:
                continue
            nvalid = min(k, -(-(pos + 1) // page))
            for h in range(rows.shape[1]):
                common = [b for b in rows[t0, h, :shared].tolist() if b >= 0]
                own = [b for b in rows[t0 + j, h].tolist() if b >= 0]
                row = sorted(list(dict.fromkeys([pos // page] + common + own))[:nvalid])
                rows[t0 + j, h] = torch.tensor(row + [-1] * (k - len(row)), dtype=rows.dtype)
    case.topk.copy_(rows)


# Largest |LSE - reference| a check accepts (natural log). The union kernel's S comes from fp8 warpgroup
# MMAs, a bf16 query split into two e4m3 halves (~8 significant bits, where the token kernel takes Q
# exactly in f16): its LSE error grows with the logits. Measured on the H200 (selftest's grid with the
# union kernel at every qlen >= 2): up to 1.35e-2 with a bf16 query (a float64 model of the
# split alone gave 4.4e-3), against under 2e-3 for the token kernel; output rel L2 2.7e-3 at worst
# (the contract's bound is 1e-2).
LSE_ATOL = 2e-3
UNION_LSE_ATOL = 2e-2
# Largest relative error of one (token, head) output row with visible keys. bf16 output rounding alone
# is ~2e-3 per row; a row the kernel left at zero, or took from a wrong page or scale, is off by ~1.
ROW_TOL = 5e-2


def compare_with_reference(case: Case, out: torch.Tensor, lse: torch.Tensor | None,
                           *, tol: float = 1e-2, row_tol: float = ROW_TOL, lse_atol: float = LSE_ATOL,
                           stats: dict | None = None) -> tuple[float, list[str]]:
    """(relative L2 error of out, problems) against the float64 reference of `case`.

    Problems: NaN left from the poison (not fully written), error above `tol`, a (token, head)
    row with visible keys whose own relative error is above `row_tol` (the whole-tensor error
    lets ~10 wrong rows of 131072 pass), -inf LSE rows that differ, finite LSE off by more than
    `lse_atol`, non-zero rows without visible keys. `stats`, if given, receives "worst_row_rel_l2"
    (the largest of those rows' errors; nan when no row has a visible key).
    """
    from .reference import sparse_decode_reference

    args = [t.cpu() if isinstance(t, torch.Tensor) else t for t in case.reference_args()]
    ref, ref_lse = sparse_decode_reference(*args, **case.scales())
    got = out.detach().cpu().double()
    problems = []
    if got.isnan().any():
        problems.append("output not fully written (NaN poison left)")
    err = rel_l2(got, ref)
    if not err <= tol:
        problems.append(f"relative L2 error {err:.3e} > {tol}")
    empty = torch.isinf(ref_lse)
    seen = ~empty
    worst = math.nan
    if seen.any():
        row_err = ((got - ref).norm(dim=-1)[seen] / ref.norm(dim=-1)[seen].clamp_min(1e-30)).nan_to_num(nan=math.inf)
        worst = row_err.max().item()
        if not worst <= row_tol:
            problems.append(f"{int((row_err > row_tol).sum())} row(s) with relative error above {row_tol} "
                            f"(worst {worst:.3e})")
    if lse is not None:
        lse_c = lse.detach().cpu().double()
        if lse_c.isnan().any():
            problems.append("lse not fully written")
        elif not torch.equal(torch.isinf(lse_c) & (lse_c < 0), empty):
            problems.append("rows with -inf lse differ from the reference")
        elif (~empty).any():
            lerr = (lse_c[~empty] - ref_lse[~empty]).abs().max().item()
            if lerr > lse_atol:
                problems.append(f"lse max abs error {lerr:.3e} > {lse_atol}")
    rows = empty.nonzero()
    if len(rows) and not torch.all(got[rows[:, 0], rows[:, 1]] == 0):
        problems.append("rows with no visible key are not zero")
    if stats is not None:
        stats["worst_row_rel_l2"] = worst
    return err, problems


def error_vs_unquantized(case: Case, out: torch.Tensor) -> float:
    """Relative L2 error of `out` [T, Hq, 128] against the float64 reference computed from the
    case's unquantized bf16 K/V (NVFP4 cases): what choosing the 4-bit cache gives up."""
    from .reference import sparse_decode_reference

    args = [t.cpu() if isinstance(t, torch.Tensor) else t for t in case.reference_args()]
    args[1] = case.unquantized_kv_cache()
    ref, _ = sparse_decode_reference(*args, **dict(case.scales(), k_scale=1.0, v_scale=1.0))
    return rel_l2(out, ref)
