"""GPU check of a build's split-KV path at every split factor, against the float64 reference.

    python3 bench/split_check.py --dir .kv-variants --variants s19p_f_c2_cm f_c2 [--out $OUT]

bench/kv_format_ab.py's check forces 1 split and the planner's many; this one forces each of
2, 3, 4, 6, 8 and 16 splits (every factor `choose_num_splits` gives for 16 top-k blocks; 2 for an
fp8 cache since row 83) at both geometries, so a merge that takes some factors one way and the rest
another (the cluster merge of docs/performance.md row 79: 2, 4, 8 and 16 in the launch at G = 16,
3 and 6 through the merge kernel; all in the launch at G = 8) is checked both ways. Each case: padded rows
(kv_len 0) or adversarial top-k / block tables, launched 3 times on one plan with fresh, poisoned
outputs (bench/variants.py's `_launch_checked`); the 3 outputs bitwise identical.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_format_ab import GEOMS, VARIANTS, _so  # noqa: E402
from kv_format_ab import _q_dtype as q_dtype_of  # noqa: E402
from variants import _launch_checked, _planner_for_splits  # noqa: E402

from msa_jit.jit import loader  # noqa: E402
from msa_jit.tools.bench.measure import environment, invocation  # noqa: E402
from msa_jit.testing import LSE_ATOL, make_case  # noqa: E402

SPLITS = (2, 3, 4, 6, 8, 16)
CASES = ((1, 1, False, False), (2, 4, True, False), (5, 1, False, True), (3, 2, True, True))  # batch, qlen, padded, adversarial


def check(fn, name: str, hq: int, hkv: int) -> list[dict]:
    kv, q_dtype = VARIANTS[name][0], getattr(torch, q_dtype_of(name))
    rows = []
    for splits in SPLITS:
        for i, (batch, qlen, padded, adversarial) in enumerate(CASES):
            planner = _planner_for_splits(batch * qlen * hkv, 16, splits, kv)
            if planner is None:
                continue
            case = make_case(batch, qlen, hq, hkv, q_dtype=q_dtype, seed=splits * 100 + i, device="cuda",
                             padded=padded, adversarial=adversarial, transposed_topk=i % 2 == 1,
                             kv_dtype="nvfp4" if kv == "nvfp4" else "fp8")
            plan = planner.prepare(*case.prepare_args(), **case.prepare_kwargs())
            worst, problems, same = _launch_checked(fn, case, plan, kv, LSE_ATOL)
            # a topk row listing a block twice is outside the contract (the reference counts it once, a
            # kernel may count it twice: msa_jit.testing.Case.has_duplicates): only the launches' agreement
            # counts there (2026-12-05 T0900 compared them: 72 "failures", the shipped build's as well)
            if case.has_duplicates:
                problems = []
            if not same:
                problems = problems + ["the 3 launches differ"]
            rows.append(dict(variant=name, geometry=f"{hq}/{hkv}", splits=plan.splits(kv), batch=batch, qlen=qlen,
                             padded=padded, adversarial=adversarial, duplicates=case.has_duplicates, rel_l2=worst,
                             problems=problems))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".kv-variants")
    ap.add_argument("--variants", nargs="+", required=True, choices=sorted(VARIANTS), metavar="NAME")
    ap.add_argument("--out", help="a folder for split-check.json")
    a = ap.parse_args()
    rows = []
    for name in a.variants:
        for hq, hkv in GEOMS:
            rows += check(loader.load_artifact(_so(Path(a.dir), name, hq, hkv))[0], name, hq, hkv)
    bad = [r for r in rows if r["problems"]]
    print(f"split check: {len(rows)} cases, {len(bad)} failed, worst rel L2 {max(r['rel_l2'] for r in rows):.2e}")
    if a.out:
        result = {"environment": environment(), "command": invocation(), "rows": rows}
        (Path(a.out) / "split-check.json").write_text(json.dumps(result, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
