"""CuTe DSL kernel sources, shipped inside the wheel as ``msa_jit.kernels``."""
