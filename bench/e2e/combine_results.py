"""One result file from several end-to-end calls: the file the repository keeps
(bench/results/vllm-e2e-<gpu>.json), made from the summaries `run_vllm_e2e.py run` wrote
(vllm-e2e-<tag>.json, each with its log beside it), so that it can be made again from them.

    python bench/e2e/combine_results.py --out bench/results/vllm-e2e-h100.json \\
        --call vllm-e2e-h100-eager.json 'device=DEADLINE_S=500 bash bench/e2e/device_run.sh run ...' \\
        --call vllm-e2e-h100-fp8.json log=other-name.log

Each --call is one summary, then optional `log=PATH` (default: the summary's name with .log, read
when present) and `device=COMMAND` (the device_run.sh command line that made it, recorded as
given). Per call: its name (the run's --tag), command, date, device, versions, preflight, and each
run's result trimmed to what the docs cite (the error without its traceback; vLLM's lines that
say what was selected; per-step top-5 log-probs only while the file stays under MAX_BYTES: the
token ids always stay). Where a run's log_lines are empty (the child's log handler saw nothing)
they are read from the call's log (`plan.log_from_output`).

Across calls: a (mode, graphs) run made by more than one call is taken from the call where it
finished (the latest of those), and the others are compared with it (`repeats`: a rerun decodes
the same tokens or it does not); the agreement (`plan.agreement`) is computed over those runs, so
pairs whose runs came from different calls (NVFP4 with CUDA graphs against NVFP4 eager) are
compared as well; the speed and profile tables list every call's points.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_plan as plan  # noqa: E402  (beside this file)

SCHEMA = "msa-jit-vllm-e2e-combined/1"
MAX_BYTES = 300_000
# vLLM's log lines kept per run: those that say which kernels and backends the engine selected.
KEEP_LOG = ("selected", "attention backend", "FlashAttention version", "msa-jit", "KV cache layout",
            "speculative_config=SpeculativeConfig")
KEEP_LOG_CHARS = 240
NOTES = [
    "versions.msa_jit_commit is the commit bench/e2e/prepare.sh built the carried kernel cache at (its "
    "BUILD.txt); the tree that ran (plugin, harness) travels with each call. The kernels that ran are named "
    "by preflight.kernels.fingerprint.kernel_sources.",
    "agreement: judged pairs carry within_spread, against vLLM's own pair (triton_fp8, msa_fp8_engine_triton) "
    "or, graph vs eager, against triton_fp8's graph vs eager (bench/e2e/e2e_plan.py says why); the others "
    "are reported only.",
]


def call_name(summary: dict[str, Any], path: Path) -> str:
    """The call's --tag (from its command), else the file's stem."""
    argv = shlex.split(summary.get("command") or "")
    return argv[argv.index("--tag") + 1] if "--tag" in argv[:-1] else path.stem


def log_sections(text: str) -> dict[str, str]:
    """A call's log split by the parent's '===== <run key>: ...' headers: run key -> its output."""
    parts = re.split(r"^===== ", text, flags=re.M)
    return {p.split(":", 1)[0]: p for p in parts[1:] if ":" in p}


def trim_result(result: dict[str, Any], call_versions: dict[str, Any], logprobs: bool) -> dict[str, Any]:
    """A mode result cut to what the docs cite (see the module doc)."""
    r = copy.deepcopy(result)
    r.pop("traceback", None)
    if r.get("versions") == call_versions:
        r.pop("versions")
    r["log_lines"] = [line[:KEEP_LOG_CHARS] for line in r.get("log_lines") or []
                      if any(k in line for k in KEEP_LOG)]
    for out in (r.get("correctness") or {}).get("outputs") or []:
        if not logprobs:
            out.pop("logprobs", None)
    return r


def read_call(path: Path, log: Path | None, device_command: str | None) -> dict[str, Any]:
    """One call's summary, with log lines filled in from its log where the run has none."""
    summary = json.loads(path.read_text())
    log = log or path.with_suffix(".log")
    sections = log_sections(log.read_text(errors="replace")) if log.exists() else {}
    for key, r in summary["results"].items():
        if not r.get("log_lines") and key in sections and r.get("mode") in plan.MODES:
            plan.log_from_output(r, sections[key], plan.MODES[r["mode"]])
    return {"name": call_name(summary, path), "summary": summary, "log": log.name if sections else None,
            "device_command": device_command}


def _finished_first(call_index: int, r: dict[str, Any]) -> tuple[bool, int]:
    return bool(r.get("ok")), call_index


def combine(calls: list[dict[str, Any]], logprobs: bool = True) -> dict[str, Any]:
    """The combined result of `calls` (read_call's), oldest first."""
    chosen: dict[str, tuple[int, dict[str, Any]]] = {}
    for i, c in enumerate(calls):
        for key, r in c["summary"]["results"].items():
            if key not in chosen or _finished_first(i, r) >= _finished_first(*chosen[key]):
                chosen[key] = (i, r)
    merged = {key: r for key, (_, r) in sorted(chosen.items())}
    repeats = {}
    for key, (i, r) in sorted(chosen.items()):
        for j, c in enumerate(calls):
            other = c["summary"]["results"].get(key)
            if j != i and other is not None:
                a = plan.compare_runs(r, other)
                repeats[f"{key}: {c['name']} vs {calls[i]['name']}"] = (
                    {"verdict": "missing", "error": other.get("error")} if a is None or a["verdict"] == "missing"
                    else {k: a[k] for k in ("verdict", "agree_steps", "max_abs_dlogprob", "dlogprob_steps")})
    speed, profiles = [], []
    for c in calls:
        for key, r in sorted(c["summary"]["results"].items()):
            for p in r.get("speed") or []:
                st = p.get("step") or {}
                speed.append({"call": c["name"], "mode": r.get("mode"), "graphs": r.get("graphs"), "batch": p["batch"],
                              "context": p["context"], "ok": p["ok"], "step_ms": st.get("median_ms"),
                              "p10_ms": st.get("p10_ms"), "p90_ms": st.get("p90_ms"),
                              "tokens_per_step": p.get("tokens_per_step"), "error": p.get("error")})
            prof = r.get("profile")
            if prof:
                profiles.append({"call": c["name"], "run": key, "batch": prof.get("batch"), "context": prof.get("context"),
                                 **{k: prof.get(k) for k in ("wall_ms_per_step", "device_ms_per_step",
                                                             "categories_ms_per_step", "sparse_decode_share_of_device")}})
    first = calls[0]["summary"]
    out = {
        "schema": SCHEMA,
        "what": "MiniMax-M3 (tiny, dummy weights, the real attention geometry) through msa-jit inside vLLM "
                "0.33.0, made by bench/e2e/combine_results.py from the summaries of the calls below",
        "nvidia_smi": sorted({c["summary"].get("nvidia_smi") for c in calls}, key=str),
        "model_config": first.get("model_config"),
        "logprobs_kept": logprobs,
        "notes": NOTES,
        "calls": [],
        "results_from": {key: calls[i]["name"] for key, (i, _) in sorted(chosen.items())},
        "agreement": plan.agreement(merged),
        "repeats": repeats,
        "speed_table": speed,
        "profiles": profiles,
    }
    for c in calls:
        s = c["summary"]
        out["calls"].append({
            "name": c["name"], "date": s.get("date"), "device_command": c["device_command"], "command": s.get("command"),
            "nvidia_smi": s.get("nvidia_smi"), "versions": s.get("versions"), "preflight": s.get("preflight"),
            "config_problems": s.get("config_problems"), "wall_s": s.get("wall_s"), "log": c["log"],
            "model_config_same": s.get("model_config") == first.get("model_config"),
            "results": {key: trim_result(r, s.get("versions") or {}, logprobs) for key, r in s["results"].items()},
        })
    return out


def combined_text(calls: list[dict[str, Any]], max_bytes: int = MAX_BYTES) -> str:
    """The combined file's text: with the per-step log-probs where it fits in `max_bytes`."""
    text = json.dumps(combine(calls, logprobs=True), indent=1)
    if len(text.encode()) > max_bytes:
        text = json.dumps(combine(calls, logprobs=False), indent=1)
    return text + "\n"


def parse_call(values: list[str]) -> tuple[Path, Path | None, str | None]:
    path, log, device = Path(values[0]), None, None
    for v in values[1:]:
        key, sep, val = v.partition("=")
        if not sep or key not in ("log", "device"):
            raise SystemExit(f"--call {values[0]}: expected log=PATH or device=COMMAND, got {v!r}")
        if key == "log":
            log = Path(val)
        else:
            device = val
    return path, log, device


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the combined result file")
    ap.add_argument("--call", action="append", nargs="+", required=True, metavar="SUMMARY [log=PATH] [device=CMD]",
                    help="one call's vllm-e2e-<tag>.json, oldest first")
    args = ap.parse_args(argv)
    calls = [read_call(*parse_call(v)) for v in args.call]
    calls.sort(key=lambda c: c["summary"].get("date") or "")
    text = combined_text(calls)
    Path(args.out).write_text(text)
    print(f"wrote {args.out}: {len(text.encode()) // 1024} KiB from {', '.join(c['name'] for c in calls)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
