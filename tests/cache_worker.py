"""Helper process for tests/test_cache.py (never the real compiler).

Runs ``ArtifactCache(root).get_or_build`` (or ``lookup``) for one key with a
fake build that writes random bytes, and prints one JSON line on stdout:
``{"built", "stats", "path", "sha256", "key", "pid"}`` or, on an error,
``{"error", "type"}`` with exit status 3.

Options let a test synchronise several workers (--ready/--go files), count
builds across processes (--counter: the build appends one line per build),
and kill a worker in the middle of a build (--started file + --sleep).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from msa_jit.jit import cache  # noqa: E402


def _append_line(path: str, text: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--config", required=True, help="JSON object")
    ap.add_argument("--fingerprint", default='{"source": "fake", "dsl": "0"}', help="JSON object")
    ap.add_argument("--describe", default="fake kernel")
    ap.add_argument("--size", type=int, default=4096, help="artifact bytes")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds the build sleeps")
    ap.add_argument("--counter", help="file the build appends one line to")
    ap.add_argument("--started", help="file created when the build starts")
    ap.add_argument("--ready", help="file created once imports are done")
    ap.add_argument("--go", help="wait for this file before starting")
    ap.add_argument("--lookup-only", action="store_true")
    args = ap.parse_args(argv)

    config = json.loads(args.config)
    fingerprint = json.loads(args.fingerprint)
    key = cache.make_key(config, fingerprint)
    c = cache.ArtifactCache(args.root)

    def build(tmp: Path) -> dict:
        if args.counter:
            _append_line(args.counter, str(os.getpid()))
        # a partial artifact first, so that a kill mid-build leaves junk behind
        (tmp / "kernel.so").write_bytes(os.urandom(args.size // 2))
        if args.started:
            Path(args.started).write_text(str(os.getpid()))
        time.sleep(args.sleep)
        (tmp / "kernel.so").write_bytes(os.urandom(args.size))
        return {"artifacts": ["kernel.so"], "extra": {"pid": os.getpid()}}

    if args.ready:
        Path(args.ready).write_text(str(os.getpid()))
    if args.go:
        deadline = time.monotonic() + 60
        while not os.path.exists(args.go):
            if time.monotonic() > deadline:
                print(json.dumps({"error": "timed out waiting for --go", "type": "Timeout"}))
                return 3
            time.sleep(0.005)

    try:
        if args.lookup_only:
            entry = c.lookup(key)
            built = False
        else:
            entry, built = c.get_or_build(
                key, build, config=config, fingerprint=fingerprint, describe=args.describe
            )
    except Exception as e:  # reported to the test
        print(json.dumps({"error": str(e), "type": type(e).__name__, "stats": cache.stats()}))
        return 3
    print(
        json.dumps(
            {
                "key": key,
                "built": built,
                "stats": cache.stats(),
                "path": None if entry is None else str(entry.path),
                "sha256": None if entry is None else entry.meta["artifacts"][0]["sha256"],
                "pid": os.getpid(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
