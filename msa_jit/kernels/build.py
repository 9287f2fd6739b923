"""How an artifact is made: the kernel object of a config, then trace, export and link.

This is the part of `msa_jit.jit.compiler` that shapes an artifact's bytes, kept inside the
hashed kernel sources (every file of this package is in every cache key, like
convention.py beside it): mapping a `SparseDecodeConfig` onto a kernel class's constructor,
tracing against the convention's fake arguments with its compile options, exporting under
its name and linking with its flags against the DSL runtime. Edit any step and every cache
key changes (tests/test_convention.py). What stays in the compiler is policy: which class
serves a config, the cache, the choice of the host's C compiler (`linker`; it only links
the DSL's object against the DSL runtime).

Importing this module imports nothing heavy: `cutlass` only inside `build`.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

from . import convention


def make_kernel(cls: type, config: Any, kernel_options: dict[str, Any] | None = None) -> Any:
    """`cls` constructed for `config` at its occupancy (`cls.occupancy_options`) and arch
    (`cls.arch_options`), plus `kernel_options` (experiments only). The one place the config's
    `topk_blocks` becomes the kernel classes' `topk`. A config's split_merge other than the
    default goes to the class as its `split_merge` option (the token kernel's)."""
    merge = {} if config.split_merge == "kernel" else {"split_merge": config.split_merge}
    return cls(
        num_q_heads=config.num_q_heads,
        num_kv_heads=config.num_kv_heads,
        page_size=config.page_size,
        topk=config.topk_blocks,
        q_dtype=config.q_dtype,
        kv_dtype=config.kv_dtype,
        **{**cls.occupancy_options(config.ctas_per_sm, config.q_dtype, config.kv_dtype),
           **cls.arch_options(config.arch, config.kv_dtype), **merge, **(kernel_options or {})},
    )


def build(kernel: Any, config: Any, out_dir: str | os.PathLike, linker: str) -> dict[str, float]:
    """Trace `kernel` for `config.arch` against the convention's fake arguments, export it and
    link out_dir/ARTIFACT_NAME: `linker LINK_FLAGS -o <artifact> <object> <DSL runtime libraries>`.
    Returns the compile and total seconds. Needs the DSL, not a GPU."""
    import cutlass.cute as cute

    out_dir = Path(out_dir)
    t0 = time.perf_counter()
    compiled = cute.compile(kernel, *convention.fake_arguments(config),
                            options=f"{convention.COMPILE_OPTIONS} --gpu-arch {config.arch}")
    t_compile = time.perf_counter() - t0
    obj = out_dir / f"{convention.EXPORT_NAME}.o"
    compiled.export_to_c(str(obj), function_name=convention.EXPORT_NAME)
    libs = cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)
    so = out_dir / convention.ARTIFACT_NAME
    proc = subprocess.run([linker, *convention.LINK_FLAGS, "-o", str(so), str(obj), *libs],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"linking {so.name} failed:\n{proc.stderr}")
    obj.unlink()
    return {"compile_s": t_compile, "total_s": time.perf_counter() - t0}
