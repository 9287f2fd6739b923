"""The README's performance table is a summary of the committed result file, not hand-typed."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_table_matches_the_committed_bench_result():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"Raw data:\s*`(bench/results/[^`]+\.json)`", readme)
    assert m, "README must name the result file its table comes from"
    result = json.loads((ROOT / m.group(1)).read_text())
    points = {(p["geometry"], p["qlen"], p["batch"]): p for p in result["points"] if not p["shared_blocks"]}
    rows = re.findall(r"^\| (\d+/\d+) \| (\d+) \| (.+) \|$", readme, re.M)
    assert rows, "no performance rows found in the README"
    for geo, qlen, cells in rows:
        for batch, cell in zip((1, 4, 16, 64, 256), cells.split(" | ")):
            us, pct = re.match(r"([\d.]+) µs \((\d+)%\)", cell).groups()
            p = points[(geo, int(qlen), batch)]
            assert abs(float(us) - p["us"]) < 0.06, (geo, qlen, batch, us, p["us"])
            assert abs(int(pct) - p["pct_of_copy"]) <= 0.5 + 1e-9, (geo, qlen, batch, pct, p["pct_of_copy"])


def test_readme_table_is_the_generated_one():
    """`msa-jit bench --table <result>` prints exactly the README's table."""
    from msa_jit.bench import readme_table

    readme = (ROOT / "README.md").read_text()
    path = re.search(r"Raw data:\s*`(bench/results/[^`]+\.json)`", readme).group(1)
    assert readme_table(json.loads((ROOT / path).read_text())) in readme
