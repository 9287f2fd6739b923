"""`msa-jit bench` with vLLM 0.33's Triton decode as a peer, from that one file (no vLLM package).

The bench's `vllm` peer (msa_jit/tools/bench/peers.py, VllmTritonPeer) loads
`vllm/models/minimax_m3/common/ops/sparse_attn.py` from an installed vLLM. The GPU host has no
package index and a 64 MiB carry per call, and vLLM's trimmed tree is ~39 MB: it would need a call
of its own before every bench. The decode file is all the peer runs, so this script gives the bench
that file, byte-identical to the 0.33.0 wheel's (tests/vllm_files.py resolves it and checks its
RECORD digest; on the host, $MSA_JIT_TEST_ENGINE_DIR names the carried copy), inside a stand-in
`vllm` package that holds only what the file imports:

- `vllm.platforms.current_platform.is_arch_support_pdl()`: vLLM's CUDA rule (vllm/platforms/cuda.py,
  the current device's capability major >= 9), the one switch the file reads;
- `vllm.triton_utils`: `triton` and `tl`, as vLLM re-exports them.

The peer's version in the result says it ran this way. Then the bench runs with the given arguments:

    MSA_JIT_TEST_ENGINE_DIR=.engine-src python bench/peers/vllm_decode_file.py bench --compare flashinfer,vllm ...

Where a real vLLM is importable this script refuses (use `msa-jit bench` itself).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # the checkout's msa_jit, also without PYTHONPATH
    sys.path.insert(0, str(ROOT))
DECODE_FILE = "common/ops/sparse_attn.py"  # its name in tests/vllm_files.py's ENGINE_FILES
VERSION_NOTE = "(its Triton decode file alone, in bench/peers/vllm_decode_file.py's stand-in package)"

PLATFORMS = '''"""Stand-in for vllm.platforms: the one call vLLM's Triton decode file makes (bench/peers/vllm_decode_file.py)."""
import torch


class _CudaPlatform:
    @classmethod
    def is_arch_support_pdl(cls) -> bool:
        # vllm/platforms/cuda.py (0.33.0): the current device's capability major >= 9
        try:
            major, _ = torch.cuda.get_device_capability(torch.cuda.current_device())
        except Exception:
            return False
        return major >= 9


current_platform = _CudaPlatform()
'''
TRITON_UTILS = '''"""Stand-in for vllm.triton_utils: triton and tl, as vLLM re-exports them (bench/peers/vllm_decode_file.py)."""
import triton
import triton.language as tl
'''


def make_package(decode_file: Path, dest: Path, version: str) -> Path:
    """A `vllm` package under `dest` holding the decode file at its wheel path and the two stand-ins;
    returns `dest` (to put on sys.path)."""
    from msa_jit.tools.bench.peers import VLLM_DECODE_FILE

    pkg = dest / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version + ' ' + VERSION_NOTE!r}\n")
    (pkg / "platforms").mkdir()
    (pkg / "platforms" / "__init__.py").write_text(PLATFORMS)
    (pkg / "triton_utils").mkdir()
    (pkg / "triton_utils" / "__init__.py").write_text(TRITON_UTILS)
    target = pkg.joinpath(*VLLM_DECODE_FILE)
    target.parent.mkdir(parents=True)
    shutil.copyfile(decode_file, target)
    return dest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if importlib.util.find_spec("vllm") is not None:
        print("vllm is importable here: run `msa-jit bench --compare vllm` itself", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT / "tests"))
    import vllm_files  # resolves vLLM 0.33.0's files and checks their digests

    if vllm_files.FILES is None:
        print(f"vLLM's decode file: {vllm_files.SKIP_REASON}", file=sys.stderr)
        return 2
    sys.path.remove(str(ROOT / "tests"))
    site = make_package(vllm_files.FILES[DECODE_FILE], Path(tempfile.mkdtemp(prefix="msa-jit-vllm-file-")),
                        vllm_files.VERSION)
    sys.path.insert(0, str(site))
    from msa_jit.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
