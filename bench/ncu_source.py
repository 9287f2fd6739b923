"""Summarize an Nsight Compute source page (SASS with per-instruction counters) as text.

    ncu -i rep.ncu-rep --page source --csv --print-source sass | gzip > src.csv.gz
    python3 bench/ncu_source.py src.csv.gz [--top 30] [--around QGMMA --before 30 --after 120]

Prints the warp stall samples by reason, shared-memory wavefronts (and the excess over ideal),
the instructions with the most samples (their top three reasons), the samples between
synchronization landmarks (barriers, warpgroup arrive / wait, mbarrier waits, votes), and with
--around the instructions near the first match of a pattern, each with its samples.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re

LANDMARKS = ("WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR", "BAR.SYNC", "BAR.ARV", "SYNCS.PHASECHK", "VOTE.ALL", "VOTE.ANY",
             "EXIT", "HGMMA", "RET")
SAMPLES = "Warp Stall Sampling (All Samples)"


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def load(path: str) -> tuple[list[str], list[dict[str, str]]]:
    """(header, rows) of the CSV (gzip or plain); row 0 of the file names the kernel."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    return rows[1], [dict(zip(rows[1], r)) for r in rows[2:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--min-segment", type=int, default=60, help="print segments with at least this many samples")
    ap.add_argument("--around")
    ap.add_argument("--before", type=int, default=10)
    ap.add_argument("--after", type=int, default=60)
    a = ap.parse_args()
    hdr, data = load(a.csv)
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    by_reason: collections.Counter = collections.Counter()
    for r in data:
        for s in stalls:
            by_reason[s] += _num(r[s])
    total = sum(by_reason.values())
    print(f"{a.csv}: {total:.0f} samples")
    for s, v in by_reason.most_common(10):
        print(f"  {s:22s} {v:7.0f} {100 * v / total:5.1f}%")
    wf = sum(_num(r["L1 Wavefronts Shared"]) for r in data)
    ideal = sum(_num(r["L1 Wavefronts Shared Ideal"]) for r in data)
    print(f"  shared wavefronts {wf:.0f}, ideal {ideal:.0f}")

    def line(r: dict[str, str]) -> str:
        top = sorted(((s[6:], int(_num(r[s]))) for s in stalls if _num(r[s]) > 0), key=lambda kv: -kv[1])[:3]
        return f"  {r['Address'][-5:]} {int(_num(r[SAMPLES])):5d}  {r['Source'].strip()[:64]:64s} {dict(top)}"

    print("instructions with the most samples (address, samples, SASS, top reasons):")
    for r in sorted(data, key=lambda r: -_num(r[SAMPLES]))[:a.top]:
        print(line(r))
    print("samples between landmarks (first .. last address, samples, share, first instruction):")
    marks = [i for i, r in enumerate(data) if any(k in r["Source"] for k in LANDMARKS)] + [len(data)]
    prev = 0
    for m in marks:
        n = sum(_num(r[SAMPLES]) for r in data[prev:m])
        if n >= a.min_segment:
            print(f"  [{data[prev]['Address'][-5:]}..{data[m - 1]['Address'][-5:]}] {n:5.0f} {100 * n / total:5.1f}%  "
                  f"{data[prev]['Source'].strip()[:50]}")
        prev = m
    if a.around:
        hits = [i for i, r in enumerate(data) if re.search(a.around, r["Source"])]
        if hits:
            print(f"around the first {a.around!r}:")
            for r in data[max(0, hits[0] - a.before): hits[0] + a.after]:
                print(line(r))


if __name__ == "__main__":
    main()
