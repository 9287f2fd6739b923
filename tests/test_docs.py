"""The docs say what the committed results and the code say: the README's performance table and
docs/performance.md's tables are generated from bench/results/*.json, the README's quickstart
runs as written, its links resolve, and every Markdown table keeps its cells."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PERFORMANCE = ROOT / "docs" / "performance.md"
RESULT_GPUS = ("h200", "h100")  # bench/results/<gpu>.json, in docs/performance.md's order

# ----------------------------------------------------------------------------- the README's table
# The points of the README's one performance table: (Hq/Hkv, KV cache, qlen, batch, shared blocks).
README_POINTS = (
    *(("64/4", "float8_e4m3fn", 1, b, 0) for b in (1, 4, 16, 64, 256)),
    *(("64/4", "nvfp4", 1, b, 0) for b in (1, 16, 256)),
    *(("8/1", "float8_e4m3fn", 1, b, 0) for b in (1, 16, 256)),
    ("64/4", "float8_e4m3fn", 4, 64, 0),
    ("64/4", "float8_e4m3fn", 4, 64, 12),
)
# Other decode kernels timed in the same run, by the key of a per-layer row's `peers` dict
# (per-layer µs); a result without them shows "—".
PEERS = (("vLLM Triton", "vllm_triton"), ("FlashInfer", "flashinfer"))
KV_SHORT = {"float8_e4m3fn": "fp8", "nvfp4": "NVFP4"}


def _kv_of(row: dict) -> str:
    return row.get("kv_dtype", "float8_e4m3fn")


def readme_perf_table(result: dict) -> str:
    """The README's performance table of a bench result: per layer, msa-jit and its peers."""
    rows = {(r["geometry"], _kv_of(r), r["qlen"], r["batch"], r["shared_blocks"]): r for r in result["per_layer"]}
    out = ["| Hq/Hkv | KV cache | qlen | batch | blocks shared | msa-jit | % of copy | "
           + " | ".join(name for name, _ in PEERS) + " |",
           "|" + "---|" * (7 + len(PEERS))]
    for geo, kv, qlen, batch, shared in README_POINTS:
        r = rows[(geo, kv, qlen, batch, shared)]
        peers = r.get("peers") or {}
        cells = [f"{peers[key]:.1f} µs" if peers.get(key) is not None else "—" for _, key in PEERS]
        out.append(f"| {geo} | {KV_SHORT[kv]} | {qlen} | {batch} | {f'{shared}/16' if qlen > 1 else '—'} | "
                   f"{r['marginal_us']:.1f} µs | {r['marginal_pct_of_copy']:.0f}% | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _result(gpu: str) -> dict:
    return json.loads((ROOT / "bench" / "results" / f"{gpu}.json").read_text())


def test_readme_names_its_result_file():
    readme = README.read_text()
    m = re.search(r"Raw data:\s*`(bench/results/[^`]+\.json)`", readme)
    assert m and m.group(1) == "bench/results/h200.json", "README must name the result file its table comes from"
    assert "![" in readme and "(bench/results/h200.png)" in readme, "README must show the result's plot"


def test_readme_table_is_the_generated_one():
    """The README's table is `readme_perf_table` of bench/results/h200.json, exactly."""
    assert readme_perf_table(_result("h200")) in README.read_text()


def test_readme_table_cells_are_the_results():
    """Each msa-jit cell is the result's per-layer time and % of copy (independent of the generator)."""
    result = _result("h200")
    rows = {(r["geometry"], KV_SHORT[_kv_of(r)], r["qlen"], r["batch"], r["shared_blocks"]): r
            for r in result["per_layer"]}
    found = re.findall(r"^\| (\d+/\d+) \| (fp8|NVFP4) \| (\d+) \| (\d+) \| (—|\d+/16) \| ([\d.]+) µs \| (\d+)% \|",
                       README.read_text(), re.M)
    assert len(found) == len(README_POINTS)
    for geo, kv, qlen, batch, shared, us, pct in found:
        r = rows[(geo, kv, int(qlen), int(batch), 0 if shared == "—" else int(shared.split("/")[0]))]
        assert abs(float(us) - r["marginal_us"]) < 0.06 and abs(int(pct) - r["marginal_pct_of_copy"]) <= 0.5


@pytest.mark.parametrize("gpu", RESULT_GPUS)
def test_performance_doc_holds_the_generated_tables(gpu):
    """docs/performance.md's full tables of each GPU are `msa-jit bench --table bench/results/<gpu>.json`."""
    from msa_jit.tools.bench import readme_table

    assert readme_table(_result(gpu)) in PERFORMANCE.read_text(), (
        f"docs/performance.md: paste the output of `msa-jit bench --table bench/results/{gpu}.json`")


# ----------------------------------------------------------------------------- the quickstart
def _quickstart() -> str:
    readme = README.read_text()
    section = readme[readme.index("\n## Quickstart"):]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "README: no python block in the Quickstart section"
    return m.group(1)


@pytest.mark.slow
def test_readme_quickstart_runs_as_written_on_a_cpu(tmp_path):
    """The Quickstart's code, exactly as written, in a fresh process without a GPU."""
    script = tmp_path / "quickstart.py"
    script.write_text(_quickstart())
    env = {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rel. error" in proc.stdout, proc.stdout


# ----------------------------------------------------------------------------- links and tables
def _markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_relative_links_resolve():
    """Every relative Markdown link and image of the README and docs/ names a file of the repository."""
    bad = []
    for path in _markdown_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (path.parent / target.split("#")[0]).exists():
                bad.append(f"{path.relative_to(ROOT)}: {target}")
    assert not bad, "\n".join(bad)


def _cell_count(row: str) -> int:
    """Cells of a Markdown table row as GitHub splits it: every unescaped `|`, inside code spans too."""
    return len(re.split(r"(?<!\\)\|", row.strip())) - 2


def test_every_markdown_table_row_has_its_headers_cell_count():
    """A `|` left unescaped in a cell (a code span does not protect it) splits the row, and GitHub
    drops the cells past the header's count, with their text."""
    bad = []
    for path in _markdown_files():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines[:-1]):
            if not (line.startswith("|") and re.fullmatch(r"\|[-:| ]+\|", lines[i + 1].strip())):
                continue
            want = _cell_count(line)
            for j in range(i + 2, len(lines)):
                if not lines[j].startswith("|"):
                    break
                if _cell_count(lines[j]) != want:
                    bad.append(f"{path.relative_to(ROOT)}:{j + 1}: {_cell_count(lines[j])} cells, header {want}")
    assert not bad, "\n".join(bad)
