"""GPU check of the union kernel's probe builds (bench/union_fp8.py) against the float64 reference.

    python3 bench/union_check.py --dir .kv-variants [--variants f_union_k8 q8_union]

Cases beyond bench/variants.py's: qlen 1..8 (tiles of 4 tokens, a partial last tile), tokens of
a request sharing 12 of their slots with the request's first token, padded rows (kv_len 0),
adversarial topk / block tables (duplicates included: the union serves a block once per token,
the reference's set semantics), each launched 3 times on one plan with fresh, poisoned outputs,
and the 3 outputs bitwise identical. A failing case is located (`locate`): its error by token
position, query head of the group and 16-dim slice, whether its LSE (the S side alone) agrees,
and, where the plan splits, the error of the same case on a plan without splits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from msa_jit import SparseDecodePlanner, sparse_decode  # noqa: E402
from msa_jit.jit import loader  # noqa: E402
from msa_jit.testing import UNION_LSE_ATOL, compare_with_reference, make_case, rel_l2, share_slots  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_format_ab import VARIANTS  # noqa: E402
from kv_format_ab import _q_dtype as q_dtype_of  # noqa: E402

# the union builds whose results are meant to be right; their cache and query dtypes are
# bench/kv_format_ab.py's (one table of variants)
UNION_VARIANTS = ("f_union_k8", "f_union_k8_cv", "f_union_k8_w1", "q8_union", "q8_union_cv", "q8_union_w1")
# any union build kv_format_ab names may be checked, except the timing probes (results wrong by design)
CHECKABLE = sorted(n for n, (_, o) in VARIANTS.items() if o.get("union_fp8") and not o.get("trace")
                   and o.get("convert", True) and o.get("mma", True) and o.get("lo_chain", True))
# (batch, qlen, padded, adversarial, shared slots)
CASES = [(3, 1, False, False, 0), (4, 2, True, False, 12), (5, 3, False, True, 0), (8, 4, True, False, 12),
         (2, 8, False, False, 12), (6, 5, True, True, 8), (1, 4, False, False, 16), (16, 4, False, False, 0)]


def locate(case, out: torch.Tensor, lse: torch.Tensor, hkv: int) -> str:
    """Where `out` is wrong (one line): relative L2 error by token position in the request
    (tile rows), by query head of the KV head's group, by 16-dim slice of the head (V's f16
    tile chunks), rows with NaN left; and the LSE, which depends on the S side alone (Q, K,
    masks, softmax): right LSE with a wrong O points at V's conversion or P V."""
    from msa_jit.reference import sparse_decode_reference

    args = [t.cpu() if isinstance(t, torch.Tensor) else t for t in case.reference_args()]
    ref, ref_lse = sparse_decode_reference(*args, **case.scales())
    got = out.detach().cpu().double()
    group = got.shape[1] // hkv
    tok = torch.arange(got.shape[0]) % case.qlen
    head = torch.arange(got.shape[1]) % group
    fmt = " ".join
    by_tok = fmt(f"{rel_l2(got[tok == j], ref[tok == j]):.1e}" for j in range(case.qlen))
    by_head = fmt(f"{rel_l2(got[:, head == g], ref[:, head == g]):.1e}" for g in range(group))
    by_dims = fmt(f"{rel_l2(got[..., 16 * k:16 * k + 16], ref[..., 16 * k:16 * k + 16]):.1e}" for k in range(8))
    nan_rows = int(got.isnan().any(-1).sum())
    finite = ~torch.isinf(ref_lse)
    lse_c = lse.detach().cpu().double()
    lse_err = (lse_c[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    return (f"by token position [{by_tok}]; by head of the group [{by_head}]; by 16-dim slice [{by_dims}]; "
            f"{nan_rows} (token, head) rows with NaN; LSE max abs error {lse_err:.1e} (S side)")


def check(fn, name: str, hq: int, hkv: int) -> list[str]:
    kv, q_dtype = VARIANTS[name][0], getattr(torch, q_dtype_of(name))
    problems = []
    for i, (batch, qlen, padded, adversarial, shared) in enumerate(CASES):
        case = make_case(batch, qlen, hq, hkv, q_dtype=q_dtype, seed=100 + i, device="cuda", padded=padded,
                         adversarial=adversarial, transposed_topk=i % 2 == 1,
                         kv_dtype="nvfp4" if kv == "nvfp4" else "fp8")
        share_slots(case, shared)
        plan = SparseDecodePlanner().prepare(*case.prepare_args(), **case.prepare_kwargs())
        plan.kernels[(case.query.dtype, kv)] = fn
        outs = []
        worst = 0.0
        failed = False

        def launch(p):
            out, lse = case.new_out(), case.new_lse()
            sparse_decode(case.query, case.kv_cache, case.topk, out, p, lse=lse, backend="kernel",
                          **case.scales(scale_tensors=kv == "nvfp4"))
            torch.cuda.synchronize()
            return out, lse

        for _ in range(3):
            out, lse = launch(plan)
            err, probs = compare_with_reference(case, out, lse, lse_atol=UNION_LSE_ATOL)
            worst = max(worst, err)
            failed = failed or bool(probs)
            problems += [f"{name} {hq}/{hkv} B={batch} qlen={qlen} shared={shared} adv={adversarial}: {p}" for p in probs]
            outs.append(out.view(torch.int16).clone())
        if failed:
            problems.append(f"{name} {hq}/{hkv} B={batch} qlen={qlen}: located: {locate(case, out, lse, hkv)}")
            if plan.num_splits > 1:  # the same case in one split per tile: the split / merge path or the core?
                one = SparseDecodePlanner(num_sms=1).prepare(*case.prepare_args(), **case.prepare_kwargs())
                one.kernels[(case.query.dtype, kv)] = fn
                err1, _ = compare_with_reference(case, *launch(one), lse_atol=UNION_LSE_ATOL)
                problems.append(f"{name} {hq}/{hkv} B={batch} qlen={qlen}: {plan.num_splits} splits; "
                                f"without splits rel L2 {err1:.2e}")
        if not all(torch.equal(outs[0], o) for o in outs[1:]):
            problems.append(f"{name} {hq}/{hkv} B={batch} qlen={qlen}: outputs differ run to run")
        print(f"{name} {hq}/{hkv} B={batch} qlen={qlen} shared={shared} padded={padded} adv={adversarial}: "
              f"worst rel L2 {worst:.2e}", flush=True)
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".kv-variants")
    ap.add_argument("--variants", nargs="+", default=list(UNION_VARIANTS), choices=CHECKABLE)
    a = ap.parse_args()
    problems = []
    for name in a.variants:
        for hq, hkv in ((64, 4), (8, 1)):
            fn = loader.load_artifact(Path(a.dir) / name / f"{hq}x{hkv}" / "sparse_decode.so")[0]
            problems += check(fn, name, hq, hkv)
    print("\n".join(problems) if problems else "union check: all ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
