"""`msa-jit` with a fake compile, for tests/test_warmup_processes.py (never the real compiler).

The module-level code replaces `msa_jit.jit.compiler.compile_sparse_decode`. multiprocessing's
spawn start method imports the parent's main script (as `__mp_main__`) in every child before
it runs anything, so the warm-up's worker processes build with the fake too: everything else
(the cache, the locks, the pool, the signals) is the real code. Environment:

    FAKE_MARKS   a directory: the fake build creates `<pid>-<Hq>-<Hkv>-<ctas_per_sm>` in it
                 when it starts (tests learn the worker pids and which builds started)
    FAKE_SLEEP   seconds the build sleeps before writing its artifact (default 0)
    FAKE_SIZE    artifact bytes (default 4096)
    FAKE_CRASH   `<Hq>-<Hkv>-<ctas_per_sm>`: the build of that config SIGKILLs its own process

Usage: `python tests/warmup_driver.py warmup --heads 8/1 ...` (any msa-jit command line), or
`python tests/warmup_driver.py run_warmup HQ/HKV...`: `warmup.run_warmup(..., allow_ephemeral=True)`
of those geometries (bf16, sm_100a: the token kernel's two occupancies only), printing one JSON line: the cache root and, per row, its
status and whether its artifact exists at that moment.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from msa_jit.kernels import convention
from msa_jit.jit import compiler  # noqa: E402


def fake_compile(config, out_dir, kernel_options=None, kernel_class=None) -> dict:
    marks = os.environ.get("FAKE_MARKS")
    if marks:
        Path(marks, f"{os.getpid()}-{config.num_q_heads}-{config.num_kv_heads}-{config.ctas_per_sm}").touch()
    if os.environ.get("FAKE_CRASH") == f"{config.num_q_heads}-{config.num_kv_heads}-{config.ctas_per_sm}":
        os.kill(os.getpid(), 9)
    time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
    name = convention.ARTIFACT_NAME
    (Path(out_dir) / name).write_bytes(os.urandom(int(os.environ.get("FAKE_SIZE", "4096"))))
    return {"artifacts": [name], "extra": {"fake": True}}


compiler.compile_sparse_decode = fake_compile


def run_warmup(heads: list[str]) -> int:
    from msa_jit.jit import cache
    from msa_jit.tools import warmup

    pairs = [tuple(int(x) for x in h.split("/")) for h in heads]
    rows = warmup.run_warmup(warmup.warmup_configs(pairs, ["bfloat16"], ["sm_100a"]), quiet=True,
                             allow_ephemeral=True)
    print(json.dumps({
        "root": str(cache.default_cache().root), "ephemeral": cache.default_cache().ephemeral,
        "rows": [{"status": r.status, "artifact": r.artifact, "error": r.error,
                  "exists": bool(r.artifact) and os.path.exists(r.artifact)} for r in rows],
    }))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["run_warmup"]:
        sys.exit(run_warmup(sys.argv[2:]))
    from msa_jit.cli import main

    sys.exit(main(sys.argv[1:]))
