"""The case builder lives in the package (msa_jit.testing) so `msa-jit selftest` can use it."""

import torch

from msa_jit.testing import FP8, HEAD_DIM, Case, error_vs_unquantized, make_case  # noqa: F401


class GraphInputs:
    """One set of step inputs that a CUDA graph captures, and the cases replayed through it.

    kv: every case's cache concatenated (case i's pages shifted by the pages before it, in its
    block table `block_tables[i]`); block_table / seq_lens / query / topk: the captured tensors,
    holding cases[0]'s values until `load(i)` copies case i's in place."""

    def __init__(self, cases: list[Case]):
        self.cases = cases
        self.kv = torch.cat([c.kv_cache for c in cases])
        shift, self.block_tables = 0, []
        for c in cases:
            self.block_tables.append(c.block_table + shift)
            shift += c.kv_cache.shape[0]
        first = cases[0]
        self.block_table = torch.zeros(first.batch, max(b.shape[1] for b in self.block_tables),
                                       dtype=torch.int32, device=first.seq_lens.device)
        self.seq_lens, self.query = first.seq_lens.clone(), first.query.clone()
        self.topk = first.topk.contiguous().clone()
        self.load(0)

    def load(self, i: int) -> Case:
        """Copy case i's block table, seq_lens, query and topk into the captured tensors; returns it."""
        c, b = self.cases[i], self.block_tables[i]
        self.block_table.zero_()
        self.block_table[:, : b.shape[1]] = b
        self.seq_lens.copy_(c.seq_lens)
        self.query.copy_(c.query)
        self.topk.copy_(c.topk)
        return c

    def replay_each(self, graph: torch.cuda.CUDAGraph, out: torch.Tensor, scales: dict) -> list[tuple[float, bool]]:
        """Replay `graph` once per case, each loaded in place and `out` poisoned with NaN first: per
        case (rel L2 of `out` against its float64 reference with `scales`, the ones baked into the
        captured launch; whether every element of `out` was written)."""
        import msa_jit
        from msa_jit.testing import rel_l2

        results = []
        for i in range(len(self.cases)):
            c = self.load(i)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            cpu = [t.cpu() if isinstance(t, torch.Tensor) else t for t in c.reference_args()]
            ref_out, _ = msa_jit.sparse_decode_reference(*cpu, **scales)
            results.append((rel_l2(out, ref_out), not bool(out.isnan().any())))
        return results


def capture(step) -> torch.cuda.CUDAGraph:
    """`step` run once eagerly (kernels compiled and plans built outside capture), once on a side
    stream (torch's warm-up before a capture), then captured: the CUDA graph to replay."""
    step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph



def compile_without_warnings(config, out_dir) -> dict:
    """compiler.compile_sparse_decode(config, out_dir), failing on any warning raised from msa_jit's own
    files while it traces and builds (a deprecated DSL call, the DSL's optimization warnings, ...): every
    warning is shown here, whatever filters the DSL or pytest installed (the DSL ignores its optimization
    warnings from its first compile on, pytest restores the filters after each test)."""
    import warnings
    from pathlib import Path

    import msa_jit
    from msa_jit.jit import compiler

    import cutlass.cute  # noqa: F401 - the DSL installs its warning filters when imported: ours go on top

    package = Path(msa_jit.__file__).resolve().parent
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = compiler.compile_sparse_decode(config, out_dir)
    ours = [f"{Path(w.filename).resolve().relative_to(package.parent)}:{w.lineno}: {w.category.__name__}: {w.message}"
            for w in caught if Path(w.filename).resolve().is_relative_to(package)]
    assert not ours, f"compiling {config.describe()} {config.arch} warned from msa_jit:\n" + "\n".join(ours)
    return result
