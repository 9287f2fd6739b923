"""Peers of the op in `msa-jit bench --compare flashinfer,vllm`: other sparse decodes, timed exactly as
msa-jit is, on the same steps.

- `flashinfer`: FlashInfer's `flashinfer.msa_ops.msa_sparse_decode_attention` (>= 0.7.4), whose SM90
  route runs its nvcc-built Cake Hopper programs: bf16 query, fp8 cache, topk 16, GQA group <= 16,
  no LSE. It takes the fp8 cache as is (K and V: the two halves of one allocation), q2k indices as a
  contiguous [Hkv, T, 16] int32 (logical blocks, mapped through the block table by the kernel), the
  block table and the sequence lengths. k_scale folds into its softmax scale; v_scale is its
  `v_global_scale`, an extra `out.mul_` after the kernel when it is not 1.
- `vllm`: vLLM 0.33's Triton `minimax_m3_sparse_attn_decode` (vllm/models/minimax_m3/common/ops/
  sparse_attn.py), the decode of its MiniMax-M3 sparse attention: split-K kernel + merge kernel, the
  topk as vLLM passes it ([T, Hkv, K] seen as [Hkv, T, K]), k/v scales as [1] device tensors. The
  module is loaded from the installed vllm package's file under a private name: importing it as
  `vllm.models.minimax_m3...` would run the model package's __init__ (the whole model); its own
  imports (`vllm.platforms`, `vllm.triton_utils`) are vLLM's.

Every peer row is the engine's way, as msa-jit's: L layers, each with its own cache, topk and
query, in one CUDA graph, L2 flushed before each replay (`timing.time_graph`); a peer has no
prologue. Figures per peer: `<peer>_one_layer_us`, `<peer>_marginal_us`, `speedup_vs_<peer>` =
peer marginal / msa-jit marginal (> 1: msa-jit faster), `one_layer_speedup_vs_<peer>`; the eager
call's CPU cost (`timing.interleaved_issue_us`, all implementations in turn): `msa_call_cpu_us`,
`<peer>_call_cpu_us`, `call_cpu_speedup_vs_<peer>`; and the check that the outputs agree:
`<peer>_rel_l2` against msa-jit's output, `msa_ref_rel_l2` / `<peer>_ref_rel_l2` against the
float64 reference (`msa_jit.reference`) on small steps. A peer that cannot run a row says why
(`<peer>_skipped`, `<peer>_error`); the bench goes on.
"""

from __future__ import annotations

import importlib.util
import math
import os
import statistics
import sys
from typing import Any, Callable, Iterable

from ...geometry import HEAD_DIM, KV_DTYPE_SHORT, MAX_GROUP_SIZE
from .steps import FP8_KV
from .timing import interleaved_issue_us, time_graph

AGREE_TOL = 1e-2  # relative L2 between two outputs (bf16 out, fp8 cache): rounding sits far below
REF_MAX_TOKENS = 8  # steps of at most this many query tokens are also checked against the float64 reference
ISSUE_CALLS, ISSUE_ROUNDS = 100, 5  # the eager-call CPU figure of each row (timing.issue_us)
FLASHINFER_MIN = (0, 7, 4)  # its SM90 decode route
VLLM_DECODE_FILE = ("models", "minimax_m3", "common", "ops", "sparse_attn.py")
# top-level module -> its pip name, for import errors
PIP_NAMES = {"pynvml": "nvidia-ml-py", "tvm_ffi": "apache-tvm-ffi", "flashinfer": "flashinfer-python",
             "yaml": "pyyaml", "zmq": "pyzmq", "google": "protobuf", "cv2": "opencv-python-headless"}
INSTALL = {
    "flashinfer": "pip install flashinfer-python==0.7.4; on the GPU host build .fi-bundle with "
                  "bench/peers/make_flashinfer_bundle.sh, carry it and `source .fi-bundle/setup.sh`",
    "vllm": "pip install vllm==0.33.0; on a host without a package index carry a vLLM bundle (bench/e2e/README.md) "
            "and put its /tmp/site on PYTHONPATH",
}


def _version_tuple(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _import_problem(what: str, package: str, e: BaseException) -> str:
    """Why importing `what` failed, with what to install."""
    if isinstance(e, ModuleNotFoundError) and e.name:
        top = e.name.split(".")[0]
        if top == package:
            return f"{package} is not installed ({INSTALL[package]})"
        return f"importing {what} failed: no module named {e.name!r} (pip install {PIP_NAMES.get(top, top)})"
    return f"importing {what} failed: {type(e).__name__}: {e}"


def _gpu_problem() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "needs a CUDA GPU"


def _scale(value: Any, name: str) -> float:
    """A step's k_scale / v_scale as a float (the bench's fp8 steps hold floats)."""
    if isinstance(value, (int, float)):
        return float(value)
    raise TypeError(f"{name}: the peers take a float scale, got {type(value).__name__}")


class Peer:
    """One peer: `available()` (None, or why not: what is missing), `supports(...)` (None, or why this row
    cannot run), `inputs(step, ...)` (its call's arguments from a bench step: pure torch, any device),
    `run(args)` (one call, writing args' preallocated output; graph-capturable once run eagerly)."""

    name = ""
    version: str | None = None

    def __init__(self) -> None:
        self._why: str | None = None
        self._checked = False
        self._fn: Callable[..., Any] | None = None

    def available(self) -> str | None:
        if not self._checked:
            self._why = self._check()
            self._checked = True
        return self._why

    def _check(self) -> str | None:
        raise NotImplementedError

    def supports(self, hq: int, hkv: int, qlen: int, q_dtype: str, kv_dtype: str, topk: int) -> str | None:
        raise NotImplementedError

    def inputs(self, step: dict[str, Any], hq: int, hkv: int, qlen: int, sm_scale: float) -> dict[str, Any]:
        raise NotImplementedError

    def out(self, args: dict[str, Any]) -> Any:
        raise NotImplementedError

    def run(self, args: dict[str, Any]) -> None:
        raise NotImplementedError


class FlashInferPeer(Peer):
    name = "flashinfer"

    def _check(self) -> str | None:
        why = _gpu_problem()
        if why:
            return why
        import torch

        cap = torch.cuda.get_device_capability()
        if cap != (9, 0):
            return f"its MSA decode of an fp8 cache is the SM90 (Hopper) route; this GPU is sm_{cap[0]}{cap[1]}"
        try:
            import flashinfer
            from flashinfer.msa_ops import msa_sparse_decode_attention
        except Exception as e:  # noqa: BLE001 - any import failure is a reason, not a crash
            return _import_problem("flashinfer.msa_ops", "flashinfer", e)
        self.version = str(getattr(flashinfer, "__version__", "?"))
        if _version_tuple(self.version) < FLASHINFER_MIN:
            return (f"flashinfer {self.version} at {flashinfer.__file__}: its SM90 MSA decode needs >= "
                    f"{'.'.join(map(str, FLASHINFER_MIN))} ({INSTALL['flashinfer']})")
        self._fn = msa_sparse_decode_attention
        return None

    def supports(self, hq: int, hkv: int, qlen: int, q_dtype: str, kv_dtype: str, topk: int) -> str | None:
        if kv_dtype != FP8_KV:
            return "no NVFP4 cache on its SM90 route"
        if q_dtype != "bfloat16":
            return "its SM90 route takes a bf16 query"
        if topk != 16:
            return f"its SM90 route takes topk 16, not {topk}"
        if hq // hkv > MAX_GROUP_SIZE:
            return f"GQA group {hq // hkv} > {MAX_GROUP_SIZE}"
        return None

    def inputs(self, step: dict[str, Any], hq: int, hkv: int, qlen: int, sm_scale: float) -> dict[str, Any]:
        import torch

        kv = step["kv_cache"]
        v_scale = _scale(step["v_scale"], "v_scale")
        return {"q": step["query"], "k": kv[..., :HEAD_DIM], "v": kv[..., HEAD_DIM:],
                "q2k_indices": step["topk"].transpose(0, 1).contiguous(),  # [Hkv, T, 16] as the indexer would write it
                "page_table": step["block_table"], "seqused_k": step["seq_lens"], "seqlen_q": qlen,
                "softmax_scale": sm_scale * _scale(step["k_scale"], "k_scale"),
                "v_global_scale": None if v_scale == 1.0 else v_scale,
                "out": torch.empty_like(step["out"])}

    def out(self, args: dict[str, Any]) -> Any:
        return args["out"]

    def run(self, a: dict[str, Any]) -> None:
        self._fn(a["q"], a["k"], a["v"], a["q2k_indices"], page_table=a["page_table"], seqused_k=a["seqused_k"],
                 seqlen_q=a["seqlen_q"], causal=True, softmax_scale=a["softmax_scale"],
                 v_global_scale=a["v_global_scale"], out=a["out"])


class VllmTritonPeer(Peer):
    name = "vllm"
    MODULE = "_msa_jit_peer_vllm_sparse_attn"  # the private name vLLM's decode file is loaded under

    def _check(self) -> str | None:
        why = _gpu_problem()
        if why:
            return why
        try:
            spec = importlib.util.find_spec("vllm")
        except Exception as e:  # noqa: BLE001
            return _import_problem("vllm", "vllm", e)
        if spec is None or not spec.submodule_search_locations:
            return f"vllm is not installed ({INSTALL['vllm']})"
        root = list(spec.submodule_search_locations)[0]
        path = os.path.join(root, *VLLM_DECODE_FILE)
        try:
            import vllm
            import vllm.platforms  # noqa: F401 - the decode file's own imports, checked first for a clear reason
            import vllm.triton_utils  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return _import_problem("vllm.platforms / vllm.triton_utils", "vllm", e)
        self.version = str(getattr(vllm, "__version__", "?"))
        module = sys.modules.get(self.MODULE)
        if module is None:
            if not os.path.isfile(path):
                return f"vllm {self.version} at {root} has no {'/'.join(VLLM_DECODE_FILE)} (vLLM 0.33's MiniMax-M3 decode)"
            file_spec = importlib.util.spec_from_file_location(self.MODULE, path)
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[self.MODULE] = module
            try:
                file_spec.loader.exec_module(module)
            except Exception as e:  # noqa: BLE001
                del sys.modules[self.MODULE]
                return _import_problem(path, "vllm", e)
        fn = getattr(module, "minimax_m3_sparse_attn_decode", None)
        if fn is None:
            return f"{path} has no minimax_m3_sparse_attn_decode (vllm {self.version})"
        self._fn = fn
        return None

    def supports(self, hq: int, hkv: int, qlen: int, q_dtype: str, kv_dtype: str, topk: int) -> str | None:
        if kv_dtype != FP8_KV:
            return "its Triton decode reads an fp8 (or bf16) cache, not NVFP4"
        if q_dtype != "bfloat16":
            return "its Triton decode takes the bf16 query (its partial outputs have the query's dtype)"
        return None

    def inputs(self, step: dict[str, Any], hq: int, hkv: int, qlen: int, sm_scale: float) -> dict[str, Any]:
        import torch

        dev = step["query"].device
        return {"q": step["query"], "kv_cache": step["kv_cache"], "topk_idx": step["topk"].transpose(0, 1),
                "block_table": step["block_table"], "seq_lens": step["seq_lens"], "num_kv_heads": hkv,
                "sm_scale": sm_scale, "output": torch.empty_like(step["out"]), "decode_query_len": qlen,
                "k_scale": torch.tensor([_scale(step["k_scale"], "k_scale")], dtype=torch.float32, device=dev),
                "v_scale": torch.tensor([_scale(step["v_scale"], "v_scale")], dtype=torch.float32, device=dev)}

    def out(self, args: dict[str, Any]) -> Any:
        return args["output"]

    def run(self, a: dict[str, Any]) -> None:
        self._fn(a["q"], a["kv_cache"], a["topk_idx"], a["block_table"], a["seq_lens"], a["num_kv_heads"],
                 a["sm_scale"], a["output"], a["decode_query_len"], k_scale=a["k_scale"], v_scale=a["v_scale"])


PEERS: dict[str, type[Peer]] = {"flashinfer": FlashInferPeer, "vllm": VllmTritonPeer}
NVFP4_SUMMARY_MIN_BATCH = 64  # the summary's NVFP4-against-a-peer's-fp8 figure: bandwidth-bound batches


def parse_compare(text: str) -> tuple[str, ...]:
    """`--compare` names (comma list, order kept, no repeats); ValueError naming the unknown ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in PEERS]
    if bad or not names:
        raise ValueError(f"--compare {text!r}: expected a comma list of {', '.join(PEERS)}"
                         + (f"; unknown {', '.join(map(repr, bad))}" if bad else ""))
    return tuple(dict.fromkeys(names))


def make_peers(names: tuple[str, ...]) -> list[Peer]:
    return [PEERS[n]() for n in names]


def describe(peers: list[Peer]) -> dict[str, Any]:
    """result["peers"]: per peer, whether it ran and why not, its version."""
    return {p.name: {"available": p.available() is None, "reason": p.available(), "version": p.version}
            for p in peers}


def rel_l2(got: Any, ref: Any) -> float:
    """||got - ref|| / ||ref|| in float32 where the tensors live (NaN stays NaN: an unwritten output fails)."""
    ref = ref.float().to(got.device)
    den = float(ref.norm())
    return float((got.float() - ref).norm()) / (den if den > 0 else 1.0)


def _poisoned(t: Any) -> Any:
    return t.fill_(float("nan"))


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


def measure_peers(peers: list[Peer], steps: list[dict[str, Any]], hq: int, hkv: int, qlen: int, q_dtype: str,
                  kv_dtype: str, msa_call: Callable[[], object], msa_row: dict[str, Any], *, iters: int,
                  num_layers: int, sm_scale: float = HEAD_DIM ** -0.5, eager: bool = True,
                  log: Callable[[str], object] = print) -> dict[str, Any]:
    """The peers' fields of one row (see the module docstring). msa_call(): msa-jit's op on steps[0]
    with a prepared plan, writing steps[0]["out"]; msa_row: its row (marginal_us, one_layer_us)."""
    topk = int(steps[0]["topk"].shape[-1])
    fields: dict[str, Any] = {}
    runners: dict[str, Callable[[], object]] = {}
    outs: dict[str, Any] = {}
    for p in peers:
        why = p.available() or p.supports(hq, hkv, qlen, q_dtype, kv_dtype, topk)
        if why:
            fields[f"{p.name}_skipped"] = why
            continue
        try:
            args = [p.inputs(s, hq, hkv, qlen, sm_scale) for s in steps[:num_layers]]
            for a in args:  # eager first: program loads, scratch allocation, Triton compiles stay out of capture
                p.run(a)
            _sync()
            t1s = time_graph(lambda: p.run(args[0]), iters=iters)
            t_all = statistics.median(time_graph(lambda: [p.run(a) for a in args], iters=iters))
        except Exception as e:  # noqa: BLE001 - a peer's failure is recorded, the row goes on
            fields[f"{p.name}_error"] = f"{type(e).__name__}: {e}"[:500]
            log(f"  {p.name} FAILED: {fields[f'{p.name}_error']}")
            continue
        t1 = statistics.median(t1s)
        marginal = (t_all - t1) / (num_layers - 1)
        fields[f"{p.name}_one_layer_us"] = round(t1, 2)
        fields[f"{p.name}_marginal_us"] = round(marginal, 2)
        if msa_row["marginal_us"] > 0 and marginal > 0:
            fields[f"speedup_vs_{p.name}"] = round(marginal / msa_row["marginal_us"], 3)
        if msa_row["one_layer_us"] > 0:
            fields[f"one_layer_speedup_vs_{p.name}"] = round(t1 / msa_row["one_layer_us"], 3)
        runners[p.name] = (lambda p=p, a=args[0]: p.run(a))
        outs[p.name] = p.out(args[0])
    if not runners:
        return fields
    fields.update(check_agreement(steps[0], qlen, msa_call, runners, outs, sm_scale))
    if eager:
        try:
            import torch

            with torch.inference_mode():
                cpu = interleaved_issue_us({"msa": msa_call, **runners}, ISSUE_CALLS, rounds=ISSUE_ROUNDS,
                                           warmup=20)
        except Exception as e:  # noqa: BLE001 - the graph figures still count
            fields["call_cpu_error"] = f"{type(e).__name__}: {e}"[:500]
        else:
            fields["msa_call_cpu_us"] = round(cpu["msa"], 2)
            for name in runners:
                fields[f"{name}_call_cpu_us"] = round(cpu[name], 2)
                fields[f"call_cpu_speedup_vs_{name}"] = round(cpu[name] / cpu["msa"], 3) if cpu["msa"] > 0 else None
    return fields


def check_agreement(step: dict[str, Any], qlen: int, msa_call: Callable[[], object],
                    runners: dict[str, Callable[[], object]], outs: dict[str, Any], sm_scale: float) -> dict[str, Any]:
    """Each output poisoned (NaN), each implementation run once eagerly on step, then compared: every
    peer with msa-jit, and all with the float64 reference when the step has <= REF_MAX_TOKENS tokens."""
    msa_out = step["out"]
    _poisoned(msa_out)
    msa_call()
    for name, run in runners.items():
        _poisoned(outs[name])
        run()
    _sync()
    fields: dict[str, Any] = {}
    for name in runners:
        err = rel_l2(outs[name], msa_out)
        fields[f"{name}_rel_l2"] = float(f"{err:.3g}") if math.isfinite(err) else None
        fields[f"{name}_agrees"] = bool(err <= AGREE_TOL)
    if step["query"].shape[0] <= REF_MAX_TOKENS:
        from ...reference import sparse_decode_reference

        ref, _ = sparse_decode_reference(step["query"], step["kv_cache"], step["topk"], step["block_table"],
                                         step["seq_lens"], qlen, sm_scale=sm_scale, k_scale=step["k_scale"],
                                         v_scale=step["v_scale"])
        for name, out in (("msa", msa_out), *outs.items()):
            err = rel_l2(out.cpu().double(), ref)
            fields[f"{name}_ref_rel_l2"] = float(f"{err:.3g}") if math.isfinite(err) else None
            fields[f"{name}_agrees"] = fields.get(f"{name}_agrees", True) and bool(err <= AGREE_TOL)
    return fields


def disagreements(row: dict[str, Any], names: list[str]) -> list[str]:
    """The implementations whose output did not agree in this row ("msa" for msa-jit against the reference)."""
    return [n for n in ("msa", *names) if row.get(f"{n}_agrees") is False]


def row_text(row: dict[str, Any], names: list[str]) -> str:
    """The peers' part of a bench log line: `| flashinfer 12.30 us x1.06 | vllm skipped`."""
    parts = []
    for n in names:
        if f"{n}_marginal_us" in row:
            ratio = row.get(f"speedup_vs_{n}")
            parts.append(f"{n} {row[f'{n}_marginal_us']:.2f} us x{ratio if ratio is not None else '?'}"
                         + ("" if row.get(f"{n}_agrees", True) else " DISAGREES"))
        elif f"{n}_error" in row:
            parts.append(f"{n} FAILED")
        elif f"{n}_skipped" in row:
            parts.append(f"{n} skipped")
    if row.get("msa_agrees") is False:
        parts.append("msa-jit DISAGREES with the reference")
    return "".join(f" | {p}" for p in parts)


def geomean(values: Iterable[float]) -> float | None:
    """Geometric mean of the values given (falsy ones, a figure not measured, left out), to 3
    places; None when none is left."""
    xs = [v for v in values if v]
    return round(math.exp(statistics.fmean(math.log(v) for v in xs)), 3) if xs else None


def summarize(rows: list[dict[str, Any]], names: list[str]) -> dict[str, dict[str, Any]]:
    """Per peer over the rows it ran: their count, the geomean and the least of `speedup_vs_<peer>`
    (per layer) and of `call_cpu_speedup_vs_<peer>`, and the rows where msa-jit is slower."""
    out: dict[str, dict[str, Any]] = {}
    for n in names:
        sp = [(r, r[f"speedup_vs_{n}"]) for r in rows if r.get(f"speedup_vs_{n}")]
        cpu = [r[f"call_cpu_speedup_vs_{n}"] for r in rows if r.get(f"call_cpu_speedup_vs_{n}")]
        s: dict[str, Any] = {"rows": len(sp)}
        if sp:
            s["geomean_speedup"] = geomean(v for _, v in sp)
            s["min_speedup"] = min(v for _, v in sp)
            s["slower_rows"] = [f"{r['geometry']} B={r['batch']} q{r['qlen']} ({KV_DTYPE_SHORT.get(r['kv_dtype'])}): x{v}"
                                for r, v in sp if v < 1.0]
        if cpu:
            s["geomean_call_cpu_speedup"] = geomean(cpu)
        # msa-jit's NVFP4 cache against the peer's fp8 one (the peers have no NVFP4 on Hopper), at the
        # batches where bandwidth rules
        nv = [r[f"speedup_vs_{n}_fp8"] for r in rows
              if r.get(f"speedup_vs_{n}_fp8") and r["batch"] >= NVFP4_SUMMARY_MIN_BATCH]
        if nv:
            s["nvfp4_vs_fp8"] = {"min_batch": NVFP4_SUMMARY_MIN_BATCH, "rows": len(nv), "min_speedup": min(nv),
                                 "geomean_speedup": geomean(nv)}
        out[n] = s
    return out


def format_summary(result: dict[str, Any]) -> str:
    """The peers' lines printed at the end of a run."""
    lines = []
    for n, info in result.get("peers", {}).items():
        if not info.get("available"):
            lines.append(f"peer {n}: not run: {info.get('reason')}")
            continue
        s = result.get("peer_summary", {}).get(n, {})
        if not s.get("rows"):
            lines.append(f"peer {n} {info.get('version')}: no row ran")
            continue
        lines.append(f"peer {n} {info.get('version')}: {s['rows']} rows, msa-jit per layer x{s['geomean_speedup']} "
                     f"geomean, x{s['min_speedup']} least; eager call CPU x{s.get('geomean_call_cpu_speedup')}")
        lines += [f"  slower than {n}: {r}" for r in s.get("slower_rows", [])]
        if s.get("nvfp4_vs_fp8"):
            v = s["nvfp4_vs_fp8"]
            lines.append(f"  msa-jit NVFP4 against {n}'s fp8, batch >= {v['min_batch']}: {v['rows']} rows, "
                         f"x{v['geomean_speedup']} geomean, x{v['min_speedup']} least")
    return "\n".join(lines)
