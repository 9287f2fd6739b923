"""The peers of `msa-jit bench --compare` on a GPU, without msa-jit's own kernels: is each importable (or
why not), do its outputs on a few bench steps match msa-jit's float64 reference, does it capture in a
graph, and its time there. A first check of a host's bundles before the grid run spends its minutes.

  python bench/peers/smoke.py [--peers flashinfer,vllm] [--iters 20]

Steps are the bench's (`msa_jit.tools.bench.steps.make_step`, 16K-token context) with k_scale 0.7 and v_scale
1.3, so that FlashInfer's scale folding (softmax scale, the extra multiply) and vLLM's scale tensors run
too. Each output is poisoned with NaN first. Exit 1 if a peer that is available disagrees or fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's msa_jit

from msa_jit.tools.bench import peers  # noqa: E402
from msa_jit.tools.bench.steps import GEOMETRIES, make_step  # noqa: E402
from msa_jit.tools.bench.timing import time_graph  # noqa: E402
from msa_jit.reference import sparse_decode_reference  # noqa: E402

# (geometry, batch, qlen): every geometry, q 1..8, both FlashInfer head folds, split and one-split plans
SHAPES = (("64/4", 1, 1), ("64/4", 4, 2), ("32/2", 8, 1), ("16/1", 2, 4), ("8/1", 1, 8), ("8/1", 16, 1),
          ("64/4", 128, 1), ("16/1", 64, 4))
SM = 128 ** -0.5


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", default="flashinfer,vllm")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args(argv)
    try:
        ps = peers.make_peers(peers.parse_compare(a.peers))
    except ValueError as e:
        print(f"smoke.py: {e}", file=sys.stderr)
        return 2
    for p in ps:
        t0 = time.perf_counter()
        why = p.available()
        print(f"{p.name}: {'version ' + str(p.version) if why is None else 'NOT AVAILABLE: ' + why} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    live = [p for p in ps if p.available() is None]
    if not live:
        print("smoke: no peer available")
        return 1
    bad = 0
    for geo, batch, qlen in SHAPES:
        hq, hkv = GEOMETRIES[geo]
        step = make_step(hq, hkv, batch, qlen, "bfloat16")
        step["k_scale"], step["v_scale"] = 0.7, 1.3
        T = batch * qlen
        ref = None
        if T <= peers.REF_MAX_TOKENS:
            ref, _ = sparse_decode_reference(step["query"], step["kv_cache"], step["topk"], step["block_table"],
                                             step["seq_lens"], qlen, sm_scale=SM, k_scale=0.7, v_scale=1.3)
        outs = {}
        line = f"{geo:>5} B={batch:<3} q{qlen}:"
        for p in live:
            try:
                args = p.inputs(step, hq, hkv, qlen, SM)
                p.out(args).fill_(float("nan"))
                p.run(args)
                torch.cuda.synchronize()
                us = statistics.median(time_graph(lambda: p.run(args), iters=a.iters))
            except Exception as e:  # noqa: BLE001 - reported, the next peer and shape still run
                bad += 1
                line += f" | {p.name} FAILED {type(e).__name__}: {str(e)[:300]}"
                continue
            out = p.out(args)
            outs[p.name] = out
            err = peers.rel_l2(out, ref) if ref is not None else float("nan")
            ok = ref is None or err <= peers.AGREE_TOL
            bad += not ok
            line += f" | {p.name} {us:7.2f} us" + (f" ref {err:.2e}{'' if ok else ' DISAGREES'}" if ref is not None else "")
        names = list(outs)
        for i, n in enumerate(names[1:], 1):  # peers against each other where no reference was computed
            err = peers.rel_l2(outs[n], outs[names[0]])
            ok = err <= peers.AGREE_TOL
            bad += not ok
            line += f" | {n} vs {names[0]} {err:.2e}{'' if ok else ' DISAGREES'}"
        print(line, flush=True)
        del step, outs
        torch.cuda.empty_cache()
    print(f"smoke: {len(live)} of {len(ps)} peers available, {bad} failure(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
