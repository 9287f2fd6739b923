"""Per-layer cost (`msa_jit.tools.bench.per_layer`) of both kernel builds at the points where the
planner picks 3 CTAs per SM, interleaved in one process: does the 3-CTA build also win when an
engine runs several layers in one graph?

    python3 bench/per_layer_ab.py --out $OUT      # GPU host, with the warmed cache (both builds)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

POINTS = (("64/4", 4), ("64/4", 16), ("8/1", 16), ("64/4", 64), ("8/1", 256), ("64/4", 80))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    from msa_jit.tools.bench import copy_bandwidth, environment, per_layer

    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s", flush=True)
    rows = []
    for rnd in range(a.rounds):
        for pinned in (2, None):  # None: the planner's choice (3 at these points)
            for r in per_layer(copy_bw, points=POINTS, ctas_per_sm=pinned, log=lambda *_: None):
                r.update(round=rnd, pinned=pinned)
                rows.append(r)
                print(f"{r['geometry']:>5} B={r['batch']:<4} {r['ctas_per_sm']}/SM one layer {r['one_layer_us']:7.2f} us"
                      f"  per extra layer {r['marginal_us']:7.2f} us ({r['marginal_pct_of_copy']}%)", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"per-layer-ab-{time.strftime('%Y-%m-%dT%H%M', time.gmtime())}.json"
    path.write_text(json.dumps({"environment": environment(), "command": " ".join(sys.argv),
                                "copy_tbps": round(copy_bw / 1e12, 4), "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
