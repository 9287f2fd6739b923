"""Fake vLLM MSA module (bench/e2e harness test): the decode function the plugin rebinds, here
msa_jit.integrations.engine's, looked up by the fake engine at every call (as vLLM's forward does)."""

from msa_jit.integrations.engine import msa_cutlass_sparse_decode  # noqa: F401
