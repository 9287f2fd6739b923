"""The docs say what the committed results and the code say: the README's performance table and
docs/performance.md's tables are generated from bench/results/*.json, docs/vllm.md's real-engine
tables are bench/results/vllm-e2e-h100.json's figures, the README's quickstart runs as written, its
links resolve, and every Markdown table keeps its cells."""

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
README_RESULT = "bench/results/h100.json"  # the run beside FlashInfer


def _readme_table_module():
    """bench/readme_table.py (project tooling, outside the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "bench" / "readme_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(gpu: str) -> dict:
    return json.loads((ROOT / "bench" / "results" / f"{gpu}.json").read_text())


def test_readme_names_its_result_file():
    readme = README.read_text()
    m = re.search(r"Raw data:\s*`(bench/results/[^`]+\.json)`", readme)
    assert m and m.group(1) == README_RESULT, "README must name the result file its table comes from"
    assert "![" in readme and "(bench/results/h100.png)" in readme, "README must show the result's plot"


def test_readme_table_is_the_generated_one():
    """The README's table is `bench/readme_table.py bench/results/h100.json`, exactly."""
    table = _readme_table_module().readme_table(json.loads((ROOT / README_RESULT).read_text()))
    assert table in README.read_text()


def test_readme_table_cells_are_the_results():
    """Each cell is the result's per-layer time, % of copy, FlashInfer's time and the speed-up
    (independent of the generator)."""
    result = json.loads((ROOT / README_RESULT).read_text())
    rows = {(r["geometry"], r["qlen"], r["batch"]): r for r in result["per_layer"]
            if r["kv_dtype"] == "float8_e4m3fn" and not r.get("shared_blocks")}  # the table's rows: fp8, none shared
    found = re.findall(r"^\| (\d+/\d+) \| (\d+) \| (\d+) \| ([\d.]+) µs \| (\d+)% \| ([\d.]+) µs \| ([\d.]+)x \|",
                       README.read_text(), re.M)
    assert len(found) == len(_readme_table_module().README_POINTS)
    for geo, qlen, batch, us, pct, fi, speedup in found:
        r = rows[(geo, int(qlen), int(batch))]
        assert abs(float(us) - r["marginal_us"]) < 0.06 and abs(int(pct) - r["marginal_pct_of_copy"]) <= 0.5
        assert abs(float(fi) - r["flashinfer_marginal_us"]) < 0.06
        assert abs(float(speedup) - r["speedup_vs_flashinfer"]) < 0.006


@pytest.mark.parametrize("gpu", RESULT_GPUS)
def test_performance_doc_holds_the_generated_tables(gpu):
    """docs/performance.md's full tables of each GPU are `msa-jit bench --table bench/results/<gpu>.json`."""
    from msa_jit.tools.bench import result_tables

    assert result_tables(_result(gpu)) in PERFORMANCE.read_text(), (
        f"docs/performance.md: paste the output of `msa-jit bench --table bench/results/{gpu}.json`")


def test_performance_doc_plan_table_is_the_peer_result():
    """docs/performance.md's speed-up over FlashInfer by plan and by grid (NVFP4's over FlashInfer's fp8
    too), and its room over FlashInfer by batch, are `bench/peer_report.py`'s, from the README's peer result."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("peer_report", ROOT / "bench" / "peer_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = json.loads((ROOT / README_RESULT).read_text())
    for table in (module.plan_table(result), module.grid_table(result), module.nvfp4_grid_table(result),
                  module.room_table(result)):
        assert table in PERFORMANCE.read_text(), (
            f"docs/performance.md: paste the tables of `python bench/peer_report.py {README_RESULT}`")


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


# ----------------------------------------------------------------------------- the real-engine figures
VLLM_DOC = ROOT / "docs" / "vllm.md"
E2E_RESULT = ROOT / "bench" / "results" / "vllm-e2e-h100.json"  # bench/e2e/combine_results.py's file


def _doc_table(text: str, header_start: str) -> list[list[str]]:
    """The cells of the Markdown table whose header row starts with `header_start`."""
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_vllm_doc_speed_table_is_the_results():
    """docs/vllm.md's CUDA-graph step times are the committed result's medians (to 0.01 ms)."""
    result = json.loads(E2E_RESULT.read_text())
    step = {(r["mode"], r["batch"], r["context"]): r["step_ms"] for r in result["speed_table"]
            if r["graphs"] == "graph" and r["ok"]}
    rows = _doc_table(VLLM_DOC.read_text(), "| batch x context | vLLM alone")
    assert len(rows) == 4
    for where, *cells in rows:
        batch, context = (int(x.rstrip("K")) for x in where.split(" x "))
        for mode, cell in zip(("triton_fp8", "msa_fp8_engine_triton", "msa_fp8", "msa_nvfp4"), cells):
            got = step.get((mode, batch, context * 1024))
            assert (cell == "—") if got is None else abs(float(cell) - got) < 0.006, (where, mode, cell, got)


def test_vllm_doc_agreement_table_is_the_results():
    """docs/vllm.md's greedy-agreement rows are the committed result's (both graph settings)."""
    agreement = json.loads(E2E_RESULT.read_text())["agreement"]
    rows = _doc_table(VLLM_DOC.read_text(), "| pair | what differs")
    assert len(rows) == 3
    for pair, _, steps, max_, median in rows:
        other, ref = (x.strip(" `") for x in pair.split(" vs "))
        for graphs in ("eager", "graph"):
            a = agreement[f"{other} vs {ref} ({graphs})"]
            assert " / ".join(map(str, a["agree_steps"])) == steps, (pair, graphs)
            assert abs(a["max_abs_dlogprob"] - float(max_)) < 0.006 and abs(a["median_abs_dlogprob"] - float(median)) < 6e-4
    judged = agreement["msa_fp8 vs msa_fp8_engine_triton (eager)"]
    assert judged["within_spread"] and agreement["msa_fp8 vs msa_fp8_engine_triton (graph)"]["within_spread"]


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
