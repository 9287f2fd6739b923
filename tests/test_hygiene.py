"""Repository hygiene: the tracked tree holds the product, not a development diary.

Fails on diary references in any tracked text file (a development session's number, a row of a
work log, an issue number: they mean nothing to a reader of the repository), on logs (`*.log`, `gpu-logs/`,
`docs/logs/`), on dated files (`bench-2026-12-06T0929.json`), and on anything under
`bench/results/` that is not one of the current reference results below. A new bench result
replaces the file of its GPU; the figures and the reasoning behind the design are in
docs/performance.md, the history is in git.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The result files the repository keeps (the README's and docs/performance.md's figures). Add a
# file here when a new kind of reference result is committed.
ALLOWED_RESULTS = frozenset({
    "bench/results/h100.json",
    "bench/results/h100.png",
    "bench/results/h200.json",
    "bench/results/h200.png",
    # the kernels' SASS before and after the package's restructuring (bench/sass_digests.py)
    "bench/results/sass-digests-before.json",
    "bench/results/sass-digests-after.json",
    # MiniMax-M3 inside a real vLLM engine on an H100: bench/e2e/combine_results.py's file of the
    # device calls that made it (each call's own summary and log stay out of the repository)
    "bench/results/vllm-e2e-h100.json",
    # the cluster merge traced per split count against the loop it replaced, FlashInfer beside both (H100)
    "bench/results/cluster-merge-ab-h100.json",
    # every plan of today's builds beside FlashInfer where it was ahead (bench/plan_ab.py, H100)
    "bench/results/plan-ab-h100.json",
    # the 4-CTA build at T·Hkv = 512 beside today's builds and FlashInfer (bench/plan_ab.py, H100; the build
    # itself is not part of msa-jit: docs/performance.md says why)
    "bench/results/four-cta-ab-h100.json",
    # every split count of today's builds at T·Hkv = 4-32 beside FlashInfer (bench/plan_ab.py, H100)
    "bench/results/plan-sweep-h100.json",
    # the two bench/variants against the shipped kernels, FlashInfer in every process (bench/tree_ab.py, H100)
    "bench/results/variants-ab-h100.json",
})

# Text files not scanned for diary references: the result files (data written by `msa-jit bench`,
# whose target rows carry the issue they belong to). This file is scanned too: its examples of what the
# patterns find are put together when the tests run.
NOT_SCANNED = ALLOWED_RESULTS

DIARY = {
    "session reference": re.compile(r"\bsessions? \d+", re.IGNORECASE),
    # "row" or "rows" and a log's row number or range; not a tensor's row 0-3, a figure with a decimal
    # point or a size in bytes or warps
    "diary row reference": re.compile(r"\brows? (?![0-3]\b)\d+\b(?![.,]\d)(?!\s*(?:[KMG]i?B|bytes?|warps?)\b)",
                                      re.IGNORECASE),
    # "#" and a number; not an HTML entity, a URL's fragment or TVM-FFI's "on argument #5"
    "issue number": re.compile(r"(?<![\w&#/])(?<!argument )#\d+\b"),
}
DATED_NAME = re.compile(r"(?<!\d)20\d\d-[01]\d-[0-3]\d")


def diary_matches(text: str) -> list[tuple[str, str]]:
    """(kind, matched text) of every diary reference in `text`."""
    return [(kind, m.group(0)) for kind, rx in DIARY.items() for m in rx.finditer(text)]


def path_problem(path: str) -> str | None:
    """Why a tracked path (relative, '/'-separated) does not belong in the repository, or None."""
    parts = path.split("/")
    if path.endswith(".log"):
        return "a log file"
    if "gpu-logs" in parts[:-1] or path.startswith("docs/logs/"):
        return "a log folder"
    if path.startswith("bench/results/") and path not in ALLOWED_RESULTS:
        return "a result file outside ALLOWED_RESULTS"
    if DATED_NAME.search(parts[-1]):
        return "a dated file (a result or a log)"
    return None


def tracked_files() -> list[str]:
    """The tracked paths of this checkout, or a skip with the reason."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: no tracked tree to check")
    top = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode != 0:
        pytest.skip(f"{ROOT} is not a git checkout (an sdist or an installed copy): no tracked tree to check")
    if Path(top.stdout.strip()).resolve() != ROOT:
        pytest.skip(f"{ROOT} is not the root of its git checkout ({top.stdout.strip()})")
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file (or one deleted from the working tree)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def problems(paths: list[str], root: Path = ROOT) -> list[str]:
    """One line per problem of the given paths (relative to `root`): `path: why` or
    `path:line: kind 'text'`."""
    out = []
    for rel in paths:
        why = path_problem(rel)
        if why:
            out.append(f"{rel}: {why}")
            continue
        if rel in NOT_SCANNED:
            continue
        text = text_of(root / rel)
        if text is None:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            out += [f"{rel}:{i}: {kind} {hit!r}" for kind, hit in diary_matches(line)]
    return out


# ----------------------------------------------------------------------------- the matchers
# (template, word): each example is the template with the word in it, put together when the test runs
# so that this file, which the tree scan reads too, holds none of what it looks for
DIARY_EXAMPLES = [
    ("as measured in {} 12", "session"), ("{} 3 concluded", "Session"), ("{} 7-10", "sessions"), ("{} 86", "row"),
    ("{} 66-74", "Rows"), ("(docs/performance.md {} 79)", "row"), ("{}19's 80% met", "#"), ("issue {}7", "#"),
    ("see {}123.", "#"),
]


@pytest.mark.parametrize("template,word", DIARY_EXAMPLES)
def test_diary_references_are_found(template, word):
    text = template.format(word)
    assert diary_matches(text), text


# a tensor's rows, figures and sizes beside "row": put together the same way, so that none of them reads as
# a work log's row in this file
TENSOR_ROW_EXAMPLES = [
    ("{} 4t+0:  (a,0)", "row"), ("{} 0 of the file", "row"), ("({0} 0,1 and {0} 2,3)", "rows"),
    ("the worst {} 2.6e-3", "row"), ("4 {} 1 KiB apart", "rows"), ("32 {} 32 bytes apart", "rows"),
    ("{} 16 warp + g", "rows"), ("b0 pairs {0} 0 and 1, b1 {0} 2 and 3", "rows"),
]


@pytest.mark.parametrize("text", [
    "a session cache", "row n of the scale area", "## 1. Where the cache lives",
    "#include <cuda.h>", "color='#1f77b4'", "f'{x:#04x}'", "&#123;", "sessions of the server",
    "the rows of a page", "https://example.org/page#12", "Mismatched out.shape[0] on argument #5",
] + [template.format(word) for template, word in TENSOR_ROW_EXAMPLES])
def test_ordinary_text_is_not_a_diary_reference(text):
    assert not diary_matches(text), diary_matches(text)


def test_path_rules():
    for ok in sorted(ALLOWED_RESULTS) + ["README.md", "docs/performance.md", "tests/fixtures/variants.json",
                                         "msa_jit/logs.py", "bench/h200_run.sh"]:
        assert path_problem(ok) is None, ok
    for bad in ("tests/gpu-logs/h200-tests.txt", "docs/logs/inspect.txt", "bench/race.log", "x/gpu-logs/a.md",
                "bench/results/bench-2026-12-06T0929-h200.json", "bench/results/notes.md",
                "docs/ncu-2026-12-04-pipes.txt"):
        assert path_problem(bad), bad


def test_a_planted_session_reference_is_reported(tmp_path):
    """problems() on a file holding a session reference names the file, the line and the text."""
    reference = "{} 12".format("session")
    (tmp_path / "notes.md").write_text(f"# Notes\n\nThe split merge was tried in {reference}.\n")
    assert problems(["notes.md"], root=tmp_path) == [f"notes.md:3: session reference {reference!r}"]


# ----------------------------------------------------------------------------- the tree
DOCS = ("README.md", "LICENSE", "docs/", "examples/", "bench/results/")


def test_docs_and_examples_hold_no_diary():
    """What a reader meets first (README, docs/, examples/, the results) is clean on its own."""
    bad = problems([p for p in tracked_files() if p.startswith(DOCS)])
    assert not bad, f"{len(bad)} hygiene problem(s):\n" + "\n".join(bad)


def test_tracked_tree_holds_no_diary():
    """Every tracked file: no logs, no stray results, no session / row / issue references."""
    bad = problems(tracked_files())
    assert not bad, f"{len(bad)} hygiene problem(s):\n" + "\n".join(bad)
