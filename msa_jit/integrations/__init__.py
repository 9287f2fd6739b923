"""How other software calls msa-jit: the torch custom op, the engine adapter (the engine's seed API
by name and signature) and the vLLM plugin."""
