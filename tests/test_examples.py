"""examples/: the notebook runs headless top to bottom, quickstart.py runs, the .ipynb has no outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOK = EXAMPLES / "sparse_decode_tour.ipynb"
SOURCE = EXAMPLES / "sparse_decode_tour.py"
QUICKSTART = EXAMPLES / "quickstart.py"
CELL_TIMEOUT_S = 180


def _env(cpu: bool) -> dict[str, str]:
    env = dict(os.environ)
    root = str(EXAMPLES.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["MPLBACKEND"] = env.get("MPLBACKEND") or "Agg"
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def test_committed_notebook_has_no_outputs():
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, "the notebook has no code cells"
    for i, cell in enumerate(code):
        assert cell.get("outputs") == [], f"code cell {i} has outputs: clear them before committing"
        assert cell.get("execution_count") is None, f"code cell {i} has an execution count"


def test_notebook_matches_its_jupytext_source():
    jupytext = pytest.importorskip("jupytext", reason="jupytext (dev tool) is not installed")
    src = jupytext.read(SOURCE)
    nb = jupytext.read(NOTEBOOK)
    pairs = [(c.cell_type, c.source) for c in src.cells]
    assert pairs == [(c.cell_type, c.source) for c in nb.cells], (
        "examples/sparse_decode_tour.ipynb is stale: run "
        "`jupytext --to ipynb --update examples/sparse_decode_tour.py`"
    )


def _execute_notebook(cpu: bool):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = _env(cpu)
    env.pop("MPLBACKEND")  # the kernel's inline backend draws the figures
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", allow_errors=False,
        resources={"metadata": {"path": str(EXAMPLES)}},
    )
    client.execute(env=env)  # raises CellExecutionError naming the failing cell
    return nb


def _text(nb) -> str:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream":
                out.append(o.get("text", ""))
    return "".join(out)


def _images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


@pytest.mark.slow
def test_notebook_runs_headless_on_cpu():
    nb = _execute_notebook(cpu=True)
    text = _text(nb)
    assert "backend: reference" in text
    assert "ABOVE BOUND" not in text and text.count(" OK") >= 2
    assert _images(nb) >= 2  # sparsity map + error bars (+ roofline when a result exists)


@pytest.mark.slow
def test_quickstart_runs_on_cpu():
    proc = subprocess.run(
        [sys.executable, str(QUICKSTART), "--batch", "3", "--qlen", "2", "--max-ctx", "2048"],
        capture_output=True, text=True, timeout=180, env=_env(cpu=True), cwd=str(EXAMPLES.parent),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "REFERENCE backend" in proc.stdout and "-> OK" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_quickstart_takes_iters_on_cpu():
    """--iters is honoured without a GPU too (it once always ran 3 timed steps)."""
    proc = subprocess.run(
        [sys.executable, str(QUICKSTART), "--batch", "2", "--qlen", "1", "--max-ctx", "512", "--iters", "1"],
        capture_output=True, text=True, timeout=180, env=_env(cpu=True), cwd=str(EXAMPLES.parent),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "median of 1)" in proc.stdout, proc.stdout


def _quickstart_usage_error(args: list[str], capsys) -> str:
    """quickstart.py's main(args) in this process (its argument checks run before any work): it must
    exit 2 through argparse, with no other exception; returns its stderr."""
    import runpy

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "path", list(sys.path))  # the script may put the checkout on it
        main = runpy.run_path(str(QUICKSTART), run_name="quickstart")["main"]
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            main(args)
    assert exc.value.code == 2
    return capsys.readouterr().err


# ----------------------------------------------------------------------------- GPU
def _assert_ran_the_kernel(text: str) -> None:
    """The notebook's printed output on a GPU: the kernel backend, checked within bound, and timed."""
    assert "backend: kernel" in text and "median step time" in text, text
    assert "ABOVE BOUND" not in text, text


@pytest.mark.gpu
@pytest.mark.slow
def test_notebook_runs_on_gpu():
    nb = _execute_notebook(cpu=False)
    _assert_ran_the_kernel(_text(nb))


@pytest.mark.gpu
@pytest.mark.slow
def test_notebook_source_runs_on_gpu():
    """The notebook's code, cell by cell in order, as its paired jupytext source run by python: the
    GPU host has no Jupyter stack (Jupyter wheels carried there once: the kernel process died on
    the first cell's reply, ZMQError ENOTSOCK), and test_notebook_matches_its_jupytext_source pins
    the two to each other."""
    env = _env(cpu=False)
    env["MPLBACKEND"] = "Agg"
    proc = subprocess.run([sys.executable, str(SOURCE)], capture_output=True, text=True, timeout=900, env=env,
                          cwd=str(EXAMPLES.parent))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _assert_ran_the_kernel(proc.stdout)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("q_dtype", ["bf16", "fp8"])
def test_quickstart_runs_on_gpu(q_dtype):
    proc = subprocess.run(
        [sys.executable, str(QUICKSTART), "--q-dtype", q_dtype, "--batch", "16", "--iters", "20"],
        capture_output=True, text=True, timeout=900, env=_env(cpu=False), cwd=str(EXAMPLES.parent),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kernel ready" in proc.stdout and "-> OK" in proc.stdout and "TB/s" in proc.stdout


@pytest.mark.parametrize("args,says", [
    (["--iters", "0"], "--iters must be >= 1"),
    (["--heads", "64"], "--heads: expected Hq/Hkv"),
    (["--heads", "64/3"], "--heads 64/3: num_q_heads"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--qlen", "33"], "--qlen must be in 1..32"),
])
def test_quickstart_rejects_bad_arguments(args, says, capsys):
    """A usage error (exit 2, one line), not a traceback from deep inside the step's set-up."""
    err = _quickstart_usage_error(args, capsys)
    assert says in err and "Traceback" not in err, err
