"""A/B of a variant of the kernels against this checkout, FlashInfer timed beside both (project tooling).

A kernel change whose gain is a few percent is decided by timing both trees on one GPU, interleaved
(base, variant, base, variant, ...), each run `msa-jit bench --compare flashinfer` on the same grid:
FlashInfer, timed in every process on the same steps, is the anchor that takes out what differs
between processes. Both trees check every row's output against the float64 reference.

    python bench/tree_ab.py prepare l2 --patch bench/variants/l2-evict-first.patch   # here: .variant-l2/
    VARIANT=l2[,other] AB_GRID="--heads 64/4,16/1 --batch 4,16,128,256 --decode-query-len 1,4" \\
        bash bench/device_run.sh tree_ab                                              # GPU host: $OUT/tree_ab.tar.gz
    python bench/tree_ab.py report tree_ab.tar.gz [--json bench/results/<name>-ab-h100.json]

`prepare NAME` writes `.variant-NAME/` (git-ignored): this checkout's tracked files at HEAD (or
`--ref`), `--patch` applied, and its own warmed cache in `.variant-NAME/.artifacts` (its sources differ,
so do its cache keys). Carry `.variant-NAME` beside .gpu-bundle, .artifacts and .fi-bundle.
Several variants share one call's base runs (VARIANT=a,b: base, a, b, base, a, b). `report` reads the
runs and prints, per variant and point, both trees' per-layer time (mean over rounds, each
round's figure), FlashInfer's in each, the variant's time over the base's, and the same ratio with
each tree's time taken relative to FlashInfer in its own process; `--json` keeps it as data.

Variants (`bench/variants/*.patch`) are experiments, never part of the package: a variant that wins
is made part of msa-jit by an ordinary change.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BASE = "base"  # the run name of this checkout's tree in the device step and the archive
RUN_NAME = re.compile(r"^(?P<tree>[\w.-]+)-(?P<round>\d+)$")


def variant_dir(name: str, root: Path = ROOT) -> Path:
    if not re.fullmatch(r"[\w.-]+", name) or name == BASE:
        raise ValueError(f"variant name {name!r}: letters, digits, '_', '.', '-', and not {BASE!r}")
    return root / f".variant-{name}"


def prepare(name: str, *, patch: Path | None, ref: str, root: Path = ROOT, warm: bool = True,
            jobs: int | None = None) -> Path:
    """`.variant-NAME/`: the tracked files of `ref` with `patch` applied, and (warm) its warmed cache."""
    dest = variant_dir(name, root)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    archive = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", ref], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tmp, filter="data")
    if patch is not None:
        # outside any repository (the checkout around tmp would make git apply skip its ignored paths)
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp.parent)}
        run = subprocess.run(["git", "apply", "--whitespace=nowarn", str(Path(patch).resolve())], cwd=tmp,
                             capture_output=True, text=True, env=env)
        if run.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"{patch} does not apply to {ref}:\n{run.stderr.strip()}")
    if warm:
        cmd = [sys.executable, str(tmp / "bench" / "warm_device_cache.py"), "--cache-dir", str(tmp / ".artifacts")]
        if jobs:
            cmd += ["--jobs", str(jobs)]
        if subprocess.run(cmd, cwd=tmp).returncode != 0:
            raise RuntimeError(f"warming the variant's cache failed (its tree is left in {tmp})")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def read_runs(archive: Path) -> tuple[dict[str, dict[int, dict]], str]:
    """{tree: {round: bench result}} of a tree_ab archive, and the GPU line the step recorded."""
    runs: dict[str, dict[int, dict]] = {}
    gpu = ""
    with tarfile.open(archive) as tar:
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if not m.isfile():
                continue
            if parts[-1] == "gpu.txt":
                gpu = tar.extractfile(m).read().decode().strip()
            elif len(parts) >= 2 and parts[-1].startswith("bench-") and parts[-1].endswith(".json"):
                name = RUN_NAME.match(parts[-2])
                if name:
                    result = json.loads(tar.extractfile(m).read())
                    runs.setdefault(name["tree"], {})[int(name["round"])] = result
    return runs, gpu


def _key(row: dict) -> tuple:
    return (row["geometry"], row["batch"], row["qlen"], row["shared_blocks"], row["q_dtype"], row["kv_dtype"])


def variants_of(runs: dict[str, dict[int, dict]]) -> list[str]:
    """The variant trees of a tree_ab archive's runs, each to be compared with the base."""
    variants = sorted(t for t in runs if t != BASE)
    if BASE not in runs or not variants:
        raise ValueError(f"expected runs of {BASE!r} and at least one variant, got {sorted(runs)}")
    return variants


def compare(runs: dict[str, dict[int, dict]], variant: str) -> dict[str, Any]:
    """Per point present in every run of the base and `variant`: each round's (msa-jit µs, FlashInfer µs,
    % of copy) per tree, the variant's mean over the base's, the same relative to FlashInfer, and their
    geomeans."""
    if variant not in variants_of(runs):
        raise ValueError(f"no runs of the variant {variant!r} (the archive has {sorted(runs)})")
    per_tree: dict[str, dict[tuple, list]] = {}
    for tree in (BASE, variant):
        for rnd in sorted(runs[tree]):
            for row in runs[tree][rnd].get("per_layer", []):
                per_tree.setdefault(tree, {}).setdefault(_key(row), []).append(row)
    rounds = {t: len(runs[t]) for t in (BASE, variant)}
    rows = []
    for key, base_rows in per_tree.get(BASE, {}).items():
        var_rows = per_tree.get(variant, {}).get(key, [])
        if len(base_rows) != rounds[BASE] or len(var_rows) != rounds[variant]:
            continue  # a run cut short: compare only points every run reached
        fig = {t: [[r["marginal_us"], r.get("flashinfer_marginal_us"), r.get("marginal_pct_of_copy")] for r in rs]
               for t, rs in ((BASE, base_rows), (variant, var_rows))}
        mean = {t: statistics.mean(f[0] for f in fig[t]) for t in fig}
        ratio = mean[variant] / mean[BASE]
        vs_fi = {t: statistics.mean(f[0] / f[1] for f in fig[t]) if all(f[1] for f in fig[t]) else None for t in fig}
        first = base_rows[0]
        rows.append({
            "geometry": key[0], "batch": key[1], "qlen": key[2], "shared_blocks": key[3],
            "q_dtype": key[4], "kv_dtype": key[5],
            "plan": (f"{first['kernel']}/S{first['num_splits']}/C{first['ctas_per_sm']}/"
                     f"{first.get('split_merge', 'kernel')}"),
            BASE: fig[BASE], variant: fig[variant],
            "variant_over_base": round(ratio, 4),
            "variant_over_base_vs_flashinfer": (round(vs_fi[variant] / vs_fi[BASE], 4)
                                                if vs_fi[BASE] and vs_fi[variant] else None),
        })
    rows.sort(key=lambda r: (r["geometry"], r["qlen"], r["batch"], r["shared_blocks"]))

    def gm(name):
        vals = [r[name] for r in rows if r[name]]
        return round(math.exp(statistics.mean(math.log(v) for v in vals)), 4) if vals else None

    return {"variant": variant, "rounds": rounds, "rows": rows,
            "geomean_variant_over_base": gm("variant_over_base"),
            "geomean_variant_over_base_vs_flashinfer": gm("variant_over_base_vs_flashinfer")}


def table(cmp: dict[str, Any]) -> str:
    v = cmp["variant"]
    out = [f"| point | plan | {BASE} µs | {v} µs | FlashInfer µs | {v} / {BASE} | the same, vs FlashInfer "
           f"| runs ({BASE} / {v}) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in cmp["rows"]:
        sh = f" sh{r['shared_blocks']}" if r["shared_blocks"] else ""
        b, x = r[BASE], r[v]
        fi = [f[1] for f in b + x if f[1]]
        vs = r["variant_over_base_vs_flashinfer"]
        cells = [f"{r['geometry']} B={r['batch']} q{r['qlen']}{sh}", r["plan"],
                 f"{statistics.mean(f[0] for f in b):.2f}", f"{statistics.mean(f[0] for f in x):.2f}",
                 f"{statistics.mean(fi):.2f}" if fi else "—", f"{r['variant_over_base']:.3f}",
                 "—" if vs is None else f"{vs:.3f}",
                 " / ".join("/".join(f"{f[0]:.1f}" for f in runs) for runs in (b, x))]
        out.append("| " + " | ".join(cells) + " |")
    out.append(f"\ngeomean {v} / {BASE}: {cmp['geomean_variant_over_base']}; "
               f"relative to FlashInfer in each process: {cmp['geomean_variant_over_base_vs_flashinfer']} "
               f"({len(cmp['rows'])} points, {cmp['rounds'][BASE]} + {cmp['rounds'][v]} runs)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="write .variant-NAME/ (tree, patch, warmed cache)")
    p.add_argument("name")
    p.add_argument("--patch", type=Path)
    p.add_argument("--ref", default="HEAD", help="the commit whose tracked files the variant starts from")
    p.add_argument("--no-warm", action="store_true", help="skip warming the variant's cache")
    p.add_argument("--jobs", type=int)
    r = sub.add_parser("report", help="the A/B table of a device run's tree_ab.tar.gz")
    r.add_argument("archive", type=Path)
    r.add_argument("--json", type=Path, help="also write the comparison as data")
    r.add_argument("--what", default="", help="--json: one sentence saying what the variant changes")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "prepare":
            if a.patch is not None and not a.patch.is_file():
                ap.error(f"--patch {a.patch}: no such file")
            dest = prepare(a.name, patch=a.patch, ref=a.ref, warm=not a.no_warm, jobs=a.jobs)
            print(f"{dest.relative_to(ROOT)}: carry it with .gpu-bundle .artifacts .fi-bundle; "
                  f"VARIANT={a.name} bash bench/device_run.sh tree_ab")
            return 0
        runs, gpu = read_runs(a.archive)
        comparisons = [compare(runs, v) for v in variants_of(runs)]
    except (OSError, ValueError, RuntimeError, subprocess.CalledProcessError, tarfile.TarError) as e:
        print(f"tree_ab: {e}", file=sys.stderr)
        return 1
    print(gpu)
    for cmp in comparisons:
        print(f"\n{cmp['variant']} against {BASE}:")
        print(table(cmp))
    if a.json:
        env = next(iter(runs[BASE].values())).get("environment", {})
        a.json.write_text(json.dumps({"what": a.what, "device": gpu, "environment": env,
                                      "method": "interleaved processes (base, each variant, ...), each `msa-jit "
                                                "bench --compare flashinfer` on the same grid; per point [msa-jit "
                                                "µs, FlashInfer µs, % of copy] per round",
                                      "comparisons": comparisons}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
