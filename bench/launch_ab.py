"""A/B of the prologue's two bound launch paths in one process (CPU us per call, GPU host only).

    python3 bench/launch_ab.py      # prints {"runner": .., "c_launcher": ..} and per-call us
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from msa_jit.bench import per_call_us  # noqa: E402
from msa_jit.prologue import BLOCK_ROWS, _c_launcher, _refresh_plan_kernel  # noqa: E402


def main() -> None:
    seq = torch.full((1,), 16384, dtype=torch.int32, device="cuda")
    kv = torch.zeros(1, dtype=torch.int32, device="cuda")
    qo = torch.zeros(1, dtype=torch.int32, device="cuda")
    grid = (1, 1, 1)
    compiled = _refresh_plan_kernel[grid](seq, kv, qo, 1, 1, BLOCK=BLOCK_ROWS, LAUNCH_DEPENDENTS=True)
    runner = compiled[grid]
    direct = _c_launcher(compiled, grid, 0, runner)
    args = (seq, kv, qo, 1, 1, BLOCK_ROWS, True)
    kv_ptr, qo_ptr = kv.data_ptr(), qo.data_ptr()
    res = {}
    for _ in range(3):  # interleaved rounds
        for name, f in (("runner", runner), ("c_launcher", direct)):
            if f is not None:
                res.setdefault(name, []).append(round(per_call_us(lambda f=f: f(*args), 5000, warmup=200), 2))
                # pointers as ints: the launcher takes them as they are (no pointer-attribute query)
                res.setdefault(name + "_ints", []).append(round(per_call_us(
                    lambda f=f: f(seq.data_ptr(), kv_ptr, qo_ptr, 1, 1, BLOCK_ROWS, True), 5000, warmup=200), 2))
    seq.fill_(100)
    kv.fill_(-1)
    runner(seq.data_ptr(), kv_ptr, qo_ptr, 1, 1, BLOCK_ROWS, True)
    res["ints_result_ok"] = kv.item() == 100 and qo.item() == 99
    torch.cuda.synchronize()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
