"""The README's performance table is a summary of the committed result file, not hand-typed."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cells(section: str) -> list[tuple[str, str, int, int, float, int]]:
    """(geometry, kv_dtype, qlen, batch, µs, % of copy) of each cell of a `geometry | KV cache |
    qlen | B=1 ... B=256` table in `section`."""
    kv_names = {"fp8": "float8_e4m3fn", "nvfp4": "nvfp4"}
    out = []
    for geo, kv, qlen, cells in re.findall(r"^\| (\d+/\d+) \| (fp8|nvfp4) \| (\d+) \| (\d.+) \|$", section, re.M):
        for batch, cell in zip((1, 4, 16, 64, 256), cells.split(" | ")):
            us, pct = re.match(r"([\d.]+) µs \((\d+)%", cell).groups()
            out.append((geo, kv_names[kv], int(qlen), batch, float(us), int(pct)))
    return out


def test_readme_table_matches_the_committed_bench_result():
    """Every cell of the README's per-layer and per-step tables is the committed result's time
    and % of copy (per layer: the marginal figure; per step: the standalone graph)."""
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"Raw data:\s*`(bench/results/[^`]+\.json)`", readme)
    assert m, "README must name the result file its table comes from"
    result = json.loads((ROOT / m.group(1)).read_text())
    per_layer_text = readme[readme.index("\nPer layer ("):readme.index("\nSpeculative decode (")]
    per_step_text = readme[readme.index("\nPer step ("):]
    per_step_text = per_step_text[:per_step_text.index("\n\n", per_step_text.index("|---"))]
    for text, rows, us_key, pct_key in (
            (per_layer_text, result["per_layer"], "marginal_us", "marginal_pct_of_copy"),
            (per_step_text, result["points"], "us", "pct_of_copy")):
        by_point = {(p["geometry"], p["kv_dtype"], p["qlen"], p["batch"]): p for p in rows if not p["shared_blocks"]}
        cells = _cells(text)
        assert len(cells) >= 30, "no performance rows found in the README"
        for geo, kv, qlen, batch, us, pct in cells:
            p = by_point[(geo, kv, qlen, batch)]
            assert abs(us - p[us_key]) < 0.06, (geo, kv, qlen, batch, us, p[us_key])
            assert abs(pct - p[pct_key]) <= 0.5 + 1e-9, (geo, kv, qlen, batch, pct, p[pct_key])


def test_readme_table_is_the_generated_one():
    """`msa-jit bench --table <result>` prints exactly the README's table."""
    from msa_jit.bench import readme_table

    readme = (ROOT / "README.md").read_text()
    path = re.search(r"Raw data:\s*`(bench/results/[^`]+\.json)`", readme).group(1)
    assert readme_table(json.loads((ROOT / path).read_text())) in readme


def _cell_count(row: str) -> int:
    """Cells of a Markdown table row as GitHub splits it: every unescaped `|`, inside code spans too."""
    return len(re.split(r"(?<!\\)\|", row.strip())) - 2


def test_every_markdown_table_row_has_its_headers_cell_count():
    """A `|` left unescaped in a cell (a code span does not protect it) splits the row, and GitHub
    drops the cells past the header's count: rows 63, 70 and 87 of docs/performance.md lost text so."""
    bad = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
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
