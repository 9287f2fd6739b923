"""bench/tree_ab.py without a GPU: a variant tree made from a commit and a patch, and the A/B report of a
device step's archive (bench results made up here: the report's arithmetic is what is tested)."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("tree_ab", ROOT / "bench" / "tree_ab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_prepare_applies_the_patch_to_the_commit_and_leaves_nothing_when_it_does_not_apply(tmp_path):
    tool = _tool()
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "kernel.py").write_text("HINT = None\n")
    (repo / ".gitignore").write_text(".variant-*/\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "base")
    (repo / "pkg" / "kernel.py").write_text("HINT = 'evict_first'\n")
    patch = tmp_path / "hint.patch"
    patch.write_text("what the variant changes\n\n" + subprocess.run(
        ["git", "-C", str(repo), "diff"], capture_output=True, text=True, check=True).stdout)
    _git(repo, "checkout", "--", ".")
    dest = tool.prepare("hint", patch=patch, ref="HEAD", root=repo, warm=False)
    assert dest == repo / ".variant-hint"
    assert (dest / "pkg" / "kernel.py").read_text() == "HINT = 'evict_first'\n"
    assert (repo / "pkg" / "kernel.py").read_text() == "HINT = None\n"  # the checkout itself untouched
    # a patch that no longer applies: an error naming it, no half-made variant, the old one kept
    (repo / "pkg" / "kernel.py").write_text("HINT = 0\n")
    _git(repo, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qam", "moved on")
    with pytest.raises(RuntimeError, match="does not apply"):
        tool.prepare("hint", patch=patch, ref="HEAD", root=repo, warm=False)
    assert not (repo / ".variant-hint.tmp").exists()
    assert (dest / "pkg" / "kernel.py").read_text() == "HINT = 'evict_first'\n"
    with pytest.raises(ValueError, match="variant name"):
        tool.variant_dir("base", repo)


def _row(geometry, batch, qlen, us, fi_us, **extra):
    return {"geometry": geometry, "batch": batch, "qlen": qlen, "shared_blocks": 0, "q_dtype": "bfloat16",
            "kv_dtype": "float8_e4m3fn", "kernel": "token", "num_splits": 1, "ctas_per_sm": 2,
            "split_merge": "kernel", "marginal_us": us, "flashinfer_marginal_us": fi_us,
            "marginal_pct_of_copy": 90.0, **extra}


def _archive(path: Path, runs: dict[str, list[dict]]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        def add(name, data: bytes):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        add("tree_ab/gpu.txt", b"NVIDIA H100 80GB HBM3, 580.1\n")
        for run, rows in runs.items():
            add(f"tree_ab/{run}/bench-x.json", json.dumps({"environment": {"device": "H100"},
                                                           "per_layer": rows}).encode())
            add(f"tree_ab/{run}.log", b"")


def test_report_compares_the_points_every_run_reached(tmp_path, capsys):
    tool = _tool()
    archive = tmp_path / "tree_ab.tar.gz"
    # FlashInfer 10% slower in the variant's second process: relative to it the variant gains a further 10%
    _archive(archive, {
        "base-1": [_row("64/4", 128, 1, 100.0, 95.0), _row("16/1", 4, 1, 10.0, 10.0)],
        "l2-1": [_row("64/4", 128, 1, 96.0, 95.0), _row("16/1", 4, 1, 10.0, 10.0)],
        "base-2": [_row("64/4", 128, 1, 100.0, 95.0), _row("16/1", 4, 1, 10.0, 10.0)],
        "l2-2": [_row("64/4", 128, 1, 96.0, 95.0 * 1.1)],  # cut short before 16/1
    })
    runs, gpu = tool.read_runs(archive)
    assert tool.variants_of(runs) == ["l2"]
    cmp = tool.compare(runs, "l2")
    assert gpu.startswith("NVIDIA H100") and cmp["variant"] == "l2" and cmp["rounds"] == {"base": 2, "l2": 2}
    [row] = cmp["rows"]
    assert (row["geometry"], row["batch"], row["qlen"]) == ("64/4", 128, 1)
    assert row["variant_over_base"] == 0.96
    vs = ((96 / 95 + 96 / 104.5) / 2) / (100 / 95)
    assert row["variant_over_base_vs_flashinfer"] == round(vs, 4)
    assert row["base"] == [[100.0, 95.0, 90.0], [100.0, 95.0, 90.0]]
    out_json = tmp_path / "ab.json"
    assert tool.main(["report", str(archive), "--json", str(out_json), "--what", "evict_first"]) == 0
    printed = capsys.readouterr().out
    assert "| 64/4 B=128 q1 | token/S1/C2/kernel | 100.00 | 96.00 |" in printed and "geomean l2 / base: 0.96" in printed
    saved = json.loads(out_json.read_text())
    assert saved["what"] == "evict_first" and saved["comparisons"][0]["geomean_variant_over_base"] == 0.96


def test_two_variants_share_the_base_runs(tmp_path, capsys):
    tool = _tool()
    archive = tmp_path / "tree_ab.tar.gz"
    _archive(archive, {"base-1": [_row("8/1", 1, 1, 5.0, 6.0)], "half-1": [_row("8/1", 1, 1, 4.0, 6.0)],
                       "l2-1": [_row("8/1", 1, 1, 5.5, 6.0)]})
    runs, _ = tool.read_runs(archive)
    assert tool.variants_of(runs) == ["half", "l2"]
    assert [tool.compare(runs, v)["geomean_variant_over_base"] for v in ("half", "l2")] == [0.8, 1.1]
    assert tool.main(["report", str(archive)]) == 0
    printed = capsys.readouterr().out
    assert "half against base:" in printed and "l2 against base:" in printed
    with pytest.raises(ValueError, match="no runs of the variant 'other'"):
        tool.compare(runs, "other")


def test_report_of_an_archive_without_both_trees_is_an_error(tmp_path, capsys):
    tool = _tool()
    archive = tmp_path / "tree_ab.tar.gz"
    _archive(archive, {"base-1": [_row("8/1", 1, 1, 5.0, 6.0)]})
    assert tool.main(["report", str(archive)]) == 1
    assert "expected runs of 'base' and at least one variant" in capsys.readouterr().err
