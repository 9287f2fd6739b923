"""`msa-jit bench --compare` without a GPU: the peers' inputs against their documented semantics (a
float64 emulation of each, checked against msa-jit's reference on the same step), their availability
messages, the flag, and the row / JSON columns end to end with the GPU timing replaced."""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys

import pytest
import torch

from msa_jit import cli
from msa_jit.tools import bench
from msa_jit.tools.bench import measure, peers
from msa_jit.tools.bench.steps import FP8_KV, NVFP4_KV, make_step
from msa_jit.reference import sparse_decode_reference

PAGE = 128
SM = 128 ** -0.5


def _main(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli.main(argv)
    return rc, out.getvalue()


def _step(hq: int, hkv: int, batch: int, qlen: int, *, ctx: int = 2560, cut: int = 37, pad: bool = True) -> dict:
    """A CPU bench step with the scales, lengths and rows a real engine step can have: k/v scales
    not 1, the last block partly written (seq_lens cut by `cut`), one row's last slot -1."""
    s = make_step(hq, hkv, batch, qlen, "bfloat16", ctx_len=ctx, seed=3, device="cpu")
    s["k_scale"], s["v_scale"] = 0.7, 1.3
    s["seq_lens"] = s["seq_lens"] - cut
    s["seq_lens_cpu"] = s["seq_lens"].clone()
    if pad:
        s["topk"][0, 0, -1] = -1  # ascending, -1 tail-padded: FlashInfer's row format
    return s


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale q K^T) V in float64 for one token's G heads; zeros without keys."""
    if keys.shape[0] == 0:
        return torch.zeros(q.shape[0], values.shape[-1], dtype=torch.float64)
    return torch.softmax(scale * q @ keys.T, dim=-1) @ values


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.float8_e4m3fn).to(torch.float64) if x.dtype == torch.uint8 else x.to(torch.float64)


def flashinfer_semantics(a: dict) -> torch.Tensor:
    """FlashInfer's `msa_sparse_decode_attention` as its docstring and SM90 dispatch state it: query i of a
    request at seqused_k - seqlen_q + i; q2k [Hkv, T, topk] ascending logical blocks, -1 tail-padded,
    mapped through page_table; right-aligned causal; softmax_scale; the output times v_global_scale."""
    q, k, v, q2k = a["q"], a["k"], a["v"], a["q2k_indices"]
    T, hq, _ = q.shape
    hkv, qlen = k.shape[1], a["seqlen_q"]
    g, vs = hq // hkv, a["v_global_scale"] or 1.0
    out = torch.zeros(T, hq, 128, dtype=torch.float64)
    for t in range(T):
        b, i = divmod(t, qlen)
        pos = int(a["seqused_k"][b]) - qlen + i
        for h in range(hkv):
            ks, vals = [], []
            for blk in q2k[h, t].tolist():
                if blk < 0:
                    break
                page = int(a["page_table"][b, blk])
                n = max(min(pos - blk * PAGE + 1, PAGE), 0)
                ks.append(_fp8(k[page, h, :n]))
                vals.append(_fp8(v[page, h, :n]))
            out[t, h * g:(h + 1) * g] = vs * _attend(q[t, h * g:(h + 1) * g].double(), torch.cat(ks), torch.cat(vals),
                                                     a["softmax_scale"])
    return out


def vllm_semantics(a: dict) -> torch.Tensor:
    """vLLM 0.33's `_gqa_sparse_decode_kernel` read as a loop: kv_len = max(pos + 1, 0), the first
    min(topk, ceil(kv_len / 128)) slots, a slot counts where 0 <= block < that block count, keys below
    kv_len; K * k_scale, V * v_scale (KV_SCALE_MODE 1), sm_scale."""
    q, kv, topk = a["q"], a["kv_cache"], a["topk_idx"]
    T, hq, d = q.shape
    hkv, qlen = a["num_kv_heads"], a["decode_query_len"]
    g, kscale, vscale = hq // hkv, float(a["k_scale"]), float(a["v_scale"])
    out = torch.zeros(T, hq, d, dtype=torch.float64)
    for t in range(T):
        b, i = divmod(t, qlen)
        kv_len = max(int(a["seq_lens"][b]) - qlen + i + 1, 0)
        nblocks = -(-kv_len // PAGE)
        ks, vals = [], []
        for h in range(hkv):
            ks, vals = [], []
            for s in range(min(topk.shape[-1], nblocks)):
                blk = int(topk[h, t, s])
                if not 0 <= blk < nblocks:
                    continue
                page = int(a["block_table"][b, blk])
                n = min(kv_len - blk * PAGE, PAGE)
                ks.append(_fp8(kv[page, h, :n, :d]) * kscale)
                vals.append(_fp8(kv[page, h, :n, d:]) * vscale)
            out[t, h * g:(h + 1) * g] = _attend(q[t, h * g:(h + 1) * g].double(), torch.cat(ks), torch.cat(vals),
                                                a["sm_scale"])
    return out


@pytest.mark.parametrize("geo, batch, qlen", [((16, 1), 2, 2), ((64, 4), 1, 1), ((8, 1), 1, 4), ((32, 2), 2, 1)])
def test_peer_inputs_select_the_tokens_msa_jit_reads(geo, batch, qlen):
    """Each adapter's arguments, run through its peer's own semantics, give msa-jit's float64 reference
    on the same step: the same blocks, pages, causal cut, scales (k folded, v applied) and head groups."""
    hq, hkv = geo
    step = _step(hq, hkv, batch, qlen)
    ref, _ = sparse_decode_reference(step["query"], step["kv_cache"], step["topk"], step["block_table"],
                                     step["seq_lens"], qlen, sm_scale=SM, k_scale=0.7, v_scale=1.3)
    fi = peers.FlashInferPeer().inputs(step, hq, hkv, qlen, SM)
    assert fi["q2k_indices"].is_contiguous() and fi["q2k_indices"].dtype == torch.int32
    assert tuple(fi["q2k_indices"].shape) == (hkv, batch * qlen, 16)
    assert fi["k"].data_ptr() == step["kv_cache"].data_ptr()  # one allocation: no copy of the cache
    assert fi["v"].data_ptr() == step["kv_cache"].data_ptr() + 128 and fi["k"].shape == fi["v"].shape
    assert fi["softmax_scale"] == pytest.approx(SM * 0.7) and fi["v_global_scale"] == 1.3
    assert fi["out"].shape == step["out"].shape and fi["out"].dtype == torch.bfloat16 and fi["out"].is_contiguous()
    assert fi["out"].data_ptr() != step["out"].data_ptr()
    assert torch.allclose(flashinfer_semantics(fi), ref, rtol=0, atol=1e-9)
    vl = peers.VllmTritonPeer().inputs(step, hq, hkv, qlen, SM)
    assert vl["topk_idx"].data_ptr() == step["topk"].data_ptr()  # vLLM's [T, Hkv, K] buffer seen as [Hkv, T, K]
    assert vl["k_scale"].dtype == torch.float32 and vl["k_scale"].numel() == 1
    f32 = float(torch.tensor(0.7, dtype=torch.float32)), float(torch.tensor(1.3, dtype=torch.float32))
    ref32, _ = sparse_decode_reference(step["query"], step["kv_cache"], step["topk"], step["block_table"],
                                       step["seq_lens"], qlen, sm_scale=SM, k_scale=f32[0], v_scale=f32[1])
    assert torch.allclose(vllm_semantics(vl), ref32, rtol=0, atol=1e-9)  # its scales are float32 tensors


def test_a_unit_v_scale_costs_flashinfer_no_extra_multiply():
    step = _step(16, 1, 1, 1)
    step["v_scale"] = 1.0
    assert peers.FlashInferPeer().inputs(step, 16, 1, 1, SM)["v_global_scale"] is None


def test_what_each_peer_cannot_run_is_said():
    fi, vl = peers.FlashInferPeer(), peers.VllmTritonPeer()
    assert "NVFP4" in fi.supports(64, 4, 1, "bfloat16", NVFP4_KV, 16)
    assert "bf16" in fi.supports(64, 4, 1, "float8_e4m3fn", FP8_KV, 16)
    assert "topk 16" in fi.supports(64, 4, 1, "bfloat16", FP8_KV, 8)
    assert fi.supports(8, 1, 8, "bfloat16", FP8_KV, 16) is None
    assert "NVFP4" in vl.supports(64, 4, 1, "bfloat16", NVFP4_KV, 16)
    assert vl.supports(16, 1, 4, "bfloat16", FP8_KV, 16) is None


# ---------------------------------------------------------------- availability


@pytest.fixture
def fake_hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """A folder put first on sys.path; the fake packages written there are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("flashinfer", "vllm", peers.VllmTritonPeer.MODULE):
            del sys.modules[name]


def _write(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_availability_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for cls in (peers.FlashInferPeer, peers.VllmTritonPeer):
        assert cls().available() == "needs a CUDA GPU"


def test_flashinfer_availability_names_what_is_missing(fake_hopper, fake_site, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed
    why = peers.FlashInferPeer().available()
    assert why.startswith("flashinfer is not installed") and "flashinfer-python==0.7.4" in why
    assert ".fi-bundle/setup.sh" in why
    monkeypatch.delitem(sys.modules, "flashinfer")
    _write(fake_site, {"flashinfer/__init__.py": "__version__ = '0.7.4'\n",
                       "flashinfer/msa_ops/__init__.py": "import pynvml_not_here\n"})
    assert peers.FlashInferPeer().available() == (
        "importing flashinfer.msa_ops failed: no module named 'pynvml_not_here' (pip install pynvml_not_here)")
    assert "pip install nvidia-ml-py" in peers._import_problem("x", "flashinfer", ModuleNotFoundError(name="pynvml"))


def test_flashinfer_before_its_sm90_route_is_refused(fake_hopper, fake_site, monkeypatch):
    _write(fake_site, {"flashinfer/__init__.py": "__version__ = '0.7.2.post1'\n",
                       "flashinfer/msa_ops/__init__.py": "def msa_sparse_decode_attention(*a, **k): pass\n"})
    assert ">= 0.7.4" in peers.FlashInferPeer().available()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    assert "sm_100" in peers.FlashInferPeer().available()


def test_vllm_decode_is_loaded_from_the_installed_package_file(fake_hopper, fake_site, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert peers.VllmTritonPeer().available().startswith("vllm is not installed")
    monkeypatch.delitem(sys.modules, "vllm")
    _write(fake_site, {"vllm/__init__.py": "__version__ = '0.33.0'\n", "vllm/platforms/__init__.py": "",
                       "vllm/triton_utils/__init__.py": "import msgspec_not_here\n"})
    assert peers.VllmTritonPeer().available() == (
        "importing vllm.platforms / vllm.triton_utils failed: no module named 'msgspec_not_here' (pip install "
        "msgspec_not_here)")
    assert "(pip install pyzmq)" in peers._import_problem("vllm", "vllm", ModuleNotFoundError(name="zmq.backend"))
    for name in [n for n in sys.modules if n.startswith("vllm")]:
        del sys.modules[name]
    _write(fake_site, {"vllm/triton_utils/__init__.py": ""})
    assert "has no models/minimax_m3/common/ops/sparse_attn.py" in peers.VllmTritonPeer().available()
    # the model package's __init__ (the whole model) never runs: only the decode file is loaded
    _write(fake_site, {"vllm/models/minimax_m3/__init__.py": "raise ImportError('the model is not imported')\n",
                       "vllm/models/minimax_m3/common/ops/sparse_attn.py":
                           "from vllm.platforms import *\ndef minimax_m3_sparse_attn_decode(*a, **k):\n    return 'ran'\n"})
    p = peers.VllmTritonPeer()
    assert p.available() is None and p.version == "0.33.0" and p._fn() == "ran"


# ---------------------------------------------------------------- the flag, the rows, the JSON


def test_compare_flag_parsing():
    assert peers.parse_compare("flashinfer,vllm") == ("flashinfer", "vllm")
    assert peers.parse_compare(" vllm , flashinfer,vllm") == ("vllm", "flashinfer")
    for bad in ("", "flashinfer,triton"):
        with pytest.raises(ValueError, match="flashinfer, vllm"):
            peers.parse_compare(bad)
    rc, out = _main(["bench", "--compare", "flashinfer,sglang"])
    assert rc == 2 and "'sglang'" in out and "nothing was written" not in out


class _FakePeer(peers.Peer):
    """Writes msa-jit's reference output (or zeros: `wrong`); `us` per layer on the fake GPU."""

    def __init__(self, name, us, wrong=False, why=None):
        super().__init__()
        self.name, self.us, self.wrong, self.why, self.version = name, us, wrong, why, "1.0"

    def _check(self):
        return self.why

    def supports(self, hq, hkv, qlen, q_dtype, kv_dtype, topk):
        return None if kv_dtype == FP8_KV else "fp8 only"

    def inputs(self, step, hq, hkv, qlen, sm_scale):
        return {"step": step, "qlen": qlen, "out": torch.empty_like(step["out"])}

    def out(self, args):
        return args["out"]

    def run(self, a):
        _GPU.calls.append(self.name)
        a["out"].copy_(torch.zeros_like(a["out"]) if self.wrong else _reference(a["step"], a["qlen"]))


_REFS: dict = {}


def _reference(step, qlen):
    """msa-jit's float64 reference of a step as bf16 (kept per step: the fakes write it many times)."""
    key = (id(step), step["query"].data_ptr(), qlen)
    if key not in _REFS:
        _REFS[key] = _compute_reference(step, qlen)
    return _REFS[key]


def _compute_reference(step, qlen):
    ref, _ = sparse_decode_reference(step["query"], step["kv_cache"], step["topk"], step["block_table"],
                                     step["seq_lens"], qlen, sm_scale=SM, k_scale=step["k_scale"],
                                     v_scale=step["v_scale"])
    return ref.to(torch.bfloat16)


class _GPU:
    calls: list = []
    US = {"msa": 5.0, "fast": 4.0, "slow": 10.0, "wrong": 6.0}

    @classmethod
    def time_graph(cls, fn, iters=50, **kw):
        cls.calls.clear()
        fn()
        return [3.0 * ("msa" in cls.calls) + sum(cls.US[c] for c in cls.calls)] * iters


@pytest.fixture
def fake_gpu(monkeypatch):
    def decode(step, plan):
        _GPU.calls.append("msa")
        step["out"].copy_(_reference(step, plan.qlen))

    monkeypatch.setattr(measure, "time_graph", _GPU.time_graph)
    monkeypatch.setattr(peers, "time_graph", _GPU.time_graph)
    monkeypatch.setattr(measure, "decode", decode)
    monkeypatch.setattr(measure, "make_step", lambda *a, **k: make_step(*a, **{**k, "device": "cpu"}))
    monkeypatch.setattr(measure, "ceilings", lambda: (4.0e12, 4.2e12, {"graph_us": 3.5, "in_graph_us": 4.0}))
    monkeypatch.setattr(peers, "_sync", lambda: None)
    monkeypatch.setattr(peers, "interleaved_issue_us",
                        lambda fns, n, **kw: {name: {"msa": 8.0, "fast": 12.0}.get(name, 40.0) for name in fns})
    yield
    _REFS.clear()


def test_rows_and_json_carry_each_peers_figures_and_ratios(fake_gpu, tmp_path):
    ps = [_FakePeer("fast", 4.0), _FakePeer("slow", 10.0), _FakePeer("wrong", 6.0, wrong=True),
          _FakePeer("gone", 1.0, why="gone is not installed (pip install gone)")]
    lines: list[str] = []
    result = bench.main(str(tmp_path), baseline="none", log=lines.append, geometries=("16/1",), batches=(1,),
                        qlens=(2,), kv_dtypes=(FP8_KV,), shared_points=(), floor_batches=(), iters=3,
                        num_layers=3, host=False, peers=ps)
    (fp8,) = result["per_layer"]
    assert fp8["marginal_us"] == 5.0 and fp8["one_layer_us"] == 8.0
    assert fp8["fast_marginal_us"] == 4.0 and fp8["fast_one_layer_us"] == 4.0 and fp8["speedup_vs_fast"] == 0.8
    assert fp8["slow_marginal_us"] == 10.0 and fp8["speedup_vs_slow"] == 2.0 and fp8["one_layer_speedup_vs_slow"] == 1.25
    assert fp8["msa_call_cpu_us"] == 8.0 and fp8["call_cpu_speedup_vs_fast"] == 1.5 and fp8["slow_call_cpu_us"] == 40.0
    # the step has 2 tokens: every output is also checked against the float64 reference
    assert fp8["fast_rel_l2"] == 0.0 and fp8["fast_agrees"] and fp8["msa_agrees"] and fp8["msa_ref_rel_l2"] < 1e-2
    assert fp8["wrong_agrees"] is False and fp8["wrong_rel_l2"] == 1.0
    assert fp8["gone_skipped"].startswith("gone is not installed")
    assert [e["error"] for e in result["errors"]] == ["outputs disagree: wrong"]
    assert result["peers"]["gone"] == {"available": False, "reason": "gone is not installed (pip install gone)",
                                       "version": "1.0"}
    assert result["peer_summary"]["slow"] == {"rows": 1, "geomean_speedup": 2.0, "min_speedup": 2.0,
                                              "slower_rows": [], "geomean_call_cpu_speedup": 5.0}
    assert result["peer_summary"]["fast"]["slower_rows"] == ["16/1 B=1 q2 (fp8): x0.8"]
    row_line = next(line for line in lines if "per layer" in line)
    assert "| fast 4.00 us x0.8 | slow 10.00 us x2.0 | wrong 6.00 us x1.2 DISAGREES | gone skipped" in row_line
    assert any(line == "peer gone: not run: gone is not installed (pip install gone)" for line in lines)
    saved = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    assert saved["per_layer"][0]["speedup_vs_slow"] == 2.0 and saved["peer_summary"]["fast"]["min_speedup"] == 0.8
    text = peers.format_summary(saved)
    assert "peer slow 1.0: 1 rows, msa-jit per layer x2.0 geomean, x2.0 least; eager call CPU x5.0" in text
    assert "  slower than fast: 16/1 B=1 q2 (fp8): x0.8" in text and "peer gone: not run:" in text


def test_a_peer_that_fails_on_a_row_is_recorded_and_the_row_goes_on(fake_gpu, tmp_path):
    class Broken(_FakePeer):
        def run(self, a):
            raise RuntimeError("no kernel image is available")

    result = bench.main(str(tmp_path), baseline="none", log=lambda *_: None, geometries=("8/1",), batches=(1,),
                        qlens=(1,), kv_dtypes=(FP8_KV,), shared_points=(), floor_batches=(), iters=3, host=False,
                        peers=[Broken("broken", 1.0), _FakePeer("fast", 4.0)])
    row = result["per_layer"][0]
    assert row["broken_error"] == "RuntimeError: no kernel image is available" and row["speedup_vs_fast"] == 0.8
    assert not result["errors"] and result["peer_summary"]["broken"] == {"rows": 0}


def test_summary_geomean_over_rows():
    rows = [{"geometry": "64/4", "batch": b, "qlen": 1, "kv_dtype": FP8_KV, "speedup_vs_flashinfer": s}
            for b, s in ((1, 1.25), (2, 0.8), (4, 1.6))]
    s = peers.summarize(rows, ["flashinfer", "vllm"])
    assert s["flashinfer"]["geomean_speedup"] == round(math.exp((math.log(1.25) + math.log(0.8) + math.log(1.6)) / 3), 3)
    assert s["flashinfer"]["min_speedup"] == 0.8 and s["vllm"] == {"rows": 0}


def test_summary_nvfp4_against_the_peers_fp8_at_bandwidth_batches():
    """The NVFP4 rows' `speedup_vs_<peer>_fp8` are summarized apart, at batches >= 64 only (where
    bandwidth rules and the smaller cache should show), and printed."""
    rows = [{"geometry": "64/4", "batch": b, "qlen": 1, "kv_dtype": NVFP4_KV, "speedup_vs_flashinfer_fp8": s}
            for b, s in ((16, 0.9), (64, 1.2), (256, 1.5))]
    s = peers.summarize(rows, ["flashinfer"])["flashinfer"]
    assert s["rows"] == 0 and s["nvfp4_vs_fp8"] == {
        "min_batch": 64, "rows": 2, "min_speedup": 1.2,
        "geomean_speedup": round(math.exp((math.log(1.2) + math.log(1.5)) / 2), 3)}
    text = peers.format_summary({"peers": {"flashinfer": {"available": True, "version": "0.7.4"}},
                                 "peer_summary": {"flashinfer": {**s, "rows": 1, "geomean_speedup": 1.0,
                                                                 "min_speedup": 1.0}}})
    assert "msa-jit NVFP4 against flashinfer's fp8, batch >= 64: 2 rows" in text
