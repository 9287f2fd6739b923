"""bench/peers/vllm_decode_file.py: vLLM 0.33's real Triton decode file in a stand-in package, as the
bench's vllm peer loads it (the GPU host, which cannot carry vLLM beside the bench)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

import vllm_files

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(vllm_files.FILES is None, reason=vllm_files.SKIP_REASON or "no vLLM files")


def _load_script():
    spec = importlib.util.spec_from_file_location("vllm_decode_file", ROOT / "bench" / "peers" / "vllm_decode_file.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stand_in_package_serves_the_real_decode_file(tmp_path, monkeypatch):
    from msa_jit.tools.bench.peers import VLLM_DECODE_FILE, VllmTritonPeer

    script = _load_script()
    decode = vllm_files.FILES[script.DECODE_FILE]
    site = script.make_package(decode, tmp_path / "site", vllm_files.VERSION)
    copied = site.joinpath("vllm", *VLLM_DECODE_FILE)
    assert copied.read_bytes() == decode.read_bytes()  # the release's bytes, not an edit
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(site))
    vllm = importlib.import_module("vllm")
    assert vllm.__version__.startswith("0.33.0 ") and "stand-in" in vllm.__version__  # the result says how it ran
    platforms = importlib.import_module("vllm.platforms")
    assert platforms.current_platform.is_arch_support_pdl() is False  # no CUDA here: vLLM's rule says no PDL
    # the module the peer loads, under the peer's private name
    spec = importlib.util.spec_from_file_location(VllmTritonPeer.MODULE, copied)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, VllmTritonPeer.MODULE, module)
    spec.loader.exec_module(module)
    assert callable(module.minimax_m3_sparse_attn_decode)


def test_refuses_where_vllm_is_importable(monkeypatch, capsys):
    script = _load_script()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else None)
    assert script.main(["bench", "--help"]) == 2
    assert "run `msa-jit bench --compare vllm` itself" in capsys.readouterr().err
