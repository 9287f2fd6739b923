"""msa_jit.testing.compare_with_reference: the check `msa-jit selftest` relies on can fail."""

import torch

import msa_jit
from msa_jit.testing import compare_with_reference, make_case


def _reference_run(case):
    out, lse = case.new_out(), case.new_lse()
    plan = msa_jit.SparseDecodePlanner().prepare(*case.prepare_args(), **case.prepare_kwargs())
    msa_jit.sparse_decode(case.query, case.kv_cache, case.topk, out, plan, lse=lse,
                          backend="reference", **case.scales())
    return out, lse


def test_accepts_a_correct_output():
    case = make_case(3, 2, 16, 1, q_dtype=torch.bfloat16, seed=1, padded=True)
    out, lse = _reference_run(case)
    err, problems = compare_with_reference(case, out, lse)
    assert problems == [] and err < 5e-3


def test_rejects_poison_wrong_values_and_wrong_lse():
    case = make_case(3, 2, 16, 1, q_dtype=torch.bfloat16, seed=2, padded=True)
    out, lse = _reference_run(case)
    bad = out.clone()
    bad[0, 0, 0] = float("nan")
    assert any("NaN" in p for p in compare_with_reference(case, bad, lse)[1])
    assert any("L2" in p for p in compare_with_reference(case, out * 1.1, lse)[1])
    assert any("lse" in p for p in compare_with_reference(case, out, lse + 0.01)[1])
