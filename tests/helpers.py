"""The case builder lives in the package (msa_jit.testing) so `msa-jit selftest` can use it."""

from msa_jit.testing import FP8, HEAD_DIM, Case, error_vs_unquantized, make_case  # noqa: F401
