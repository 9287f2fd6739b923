"""The README's one performance table, from a bench result file (project tooling, not shipped).

    python bench/readme_table.py bench/results/h100.json     # paste the output into README.md

Per layer, bf16 query, fp8 cache, no block shared: msa-jit's time and % of copy, and each peer timed
in the same run (`msa-jit bench --compare ...`): its time and msa-jit's speed-up over it. A peer the
run did not time shows "—". tests/test_docs.py checks that the README holds exactly this table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# (Hq/Hkv, qlen, batch): small batches, the bandwidth-bound end, and draft tokens (qlen 4)
README_POINTS = (
    *(("64/4", 1, b) for b in (1, 4, 16, 64, 256)),
    *(("16/1", 1, b) for b in (1, 16, 256)),
    *(("8/1", 1, b) for b in (1, 16, 256)),
    *(("64/4", 4, b) for b in (4, 64)),
    *(("16/1", 4, b) for b in (4, 64)),
)
PEERS = (("FlashInfer", "flashinfer"), ("vLLM Triton", "vllm"))


def readme_table(result: dict) -> str:
    rows = {(r["geometry"], r["qlen"], r["batch"]): r for r in result["per_layer"]
            if r.get("kv_dtype", "float8_e4m3fn") == "float8_e4m3fn" and not r.get("shared_blocks")
            and r.get("q_dtype", "bfloat16") == "bfloat16"}
    out = ["| Hq/Hkv | qlen | batch | msa-jit | % of copy | "
           + " | ".join(f"{name} | msa-jit speed-up" for name, _ in PEERS) + " |",
           "|" + "---|" * (5 + 2 * len(PEERS))]
    for geo, qlen, batch in README_POINTS:
        r = rows[(geo, qlen, batch)]
        cells = []
        for _, key in PEERS:
            t, s = r.get(f"{key}_marginal_us"), r.get(f"speedup_vs_{key}")
            cells += [f"{t:.1f} µs" if t is not None else "—", f"{s:.2f}x" if s is not None else "—"]
        out.append(f"| {geo} | {qlen} | {batch} | {r['marginal_us']:.1f} µs | {r['marginal_pct_of_copy']:.0f}% | "
                   + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    print(readme_table(json.loads(Path(sys.argv[1]).read_text())))
