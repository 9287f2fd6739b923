"""The user tools behind the msa-jit command, usable from Python: warmup, doctor, selftest and the
bench (timing the op on this GPU)."""
