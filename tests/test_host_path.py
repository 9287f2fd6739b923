"""The per-step host path of vLLM 0.33's MiniMax-M3 attention with the plugin applied (the engine's
own builder and impl, tests/vllm_standins.py), on a CPU: no value of a tensor that lives on the GPU
in an engine is read on the host once a step shape's plan is cached (on a GPU every such read is a
device-to-host sync that stalls the step), and bench/host_path.py, which times that path, runs.

On a CPU the op takes its GPU fast path with the kernel replaced by a no-op (bench/host_path.py
engine_step), so the Python that runs per layer is the one a GPU runs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import vllm_standins as vs
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

pytestmark = pytest.mark.skipif(not vs.engine_files_present(), reason=vs.ENGINE_SKIP_REASON)

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
# Tensor methods that read a tensor's values on the host (each a sync for a CUDA tensor), and the
# conversions that do the same through Python's protocols
VALUE_READS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__",
               "__repr__", "__format__")


def _host_path() -> Any:
    spec = importlib.util.spec_from_file_location("host_path", ROOT / "bench" / "host_path.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _DeviceResults(TorchDispatchMode):
    """Marks every result of an op on a device tensor as a device tensor (its storage joins
    `storages`), as on a GPU; an op whose result is a host value of one (a scalar read,
    torch.equal, nonzero's count) raises."""

    SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
             torch.ops.aten.nonzero.default, torch.ops.aten.is_nonzero.default}

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages = storages

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        inputs = tree_flatten((args, kwargs or {}))[0]
        on_device = any(isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() in self.storages
                        for x in inputs)
        if on_device and func in self.SYNCS:
            raise AssertionError(f"{func} of a device tensor on the per-step path (a host sync on a GPU)")
        out = func(*args, **(kwargs or {}))
        if on_device:
            self.storages.update(y.untyped_storage().data_ptr() for y in tree_flatten(out)[0]
                                 if isinstance(y, torch.Tensor))
        return out


@contextlib.contextmanager
def device_values_refused(monkeypatch: pytest.MonkeyPatch, on_device: list[torch.Tensor]) -> Iterator[None]:
    """While active, reading on the host the values of a tensor that shares storage with one of
    `on_device`, or with a result computed from them (VALUE_READS, `.to("cpu")`, `torch.equal`,
    the scalar reads at the dispatcher), raises AssertionError."""
    storages = {t.untyped_storage().data_ptr() for t in on_device}
    active = [False]

    def on_gpu(x: Any) -> bool:
        return active[0] and isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() in storages

    def refused(name: str, real: Any) -> Any:
        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if on_gpu(self):
                raise AssertionError(f"Tensor.{name} of a device tensor on the per-step path (a host sync on a GPU)")
            return real(self, *args, **kwargs)
        return method

    for name in VALUE_READS:
        monkeypatch.setattr(torch.Tensor, name, refused(name, getattr(torch.Tensor, name)))
    real_to, real_equal = torch.Tensor.to, torch.equal

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        target = kwargs.get("device", args[0] if args else None)
        if on_gpu(self) and (target == "cpu" or target == CPU):
            raise AssertionError("Tensor.to('cpu') of a device tensor on the per-step path")
        return real_to(self, *args, **kwargs)

    def equal(a: Any, b: Any) -> bool:
        if on_gpu(a) or on_gpu(b):
            raise AssertionError("torch.equal of a device tensor on the per-step path")
        return real_equal(a, b)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch, "equal", equal)
    active[0] = True
    try:
        with _DeviceResults(storages):
            yield
    finally:
        active[0] = False


@pytest.mark.parametrize("batch,context", [(1, 5000), (12, 700)])
@pytest.mark.parametrize("mode", ["msa", "msa_op"])
def test_a_cached_decode_step_reads_no_device_value(monkeypatch, batch, context, mode):
    """builder.build (should_prepare / prepare_decode_metadata: validation, the plan lookup, the
    refresh) and every layer's forward (msa_cutlass_sparse_decode, the op's fast path; msa_op:
    through the custom op) read no device value on the host."""
    hp = _host_path()
    t = hp.make_tensors(batch, context, CPU)
    with torch.inference_mode():
        es = hp.engine_step(monkeypatch, mode, t, 3, CPU)
        es.build()  # the plan was built by engine_step: this is a cached step
        with device_values_refused(monkeypatch, es.on_device):
            for _ in range(2):
                es.build()
                for i in range(es.layers):
                    es.forward(i)


def test_the_guard_sees_a_sync(monkeypatch):
    """device_values_refused catches a value read planted in the planner's cached path."""
    from msa_jit import planner

    hp = _host_path()
    t = hp.make_tensors(2, 300, CPU)
    with torch.inference_mode():
        es = hp.engine_step(monkeypatch, "msa", t, 1, CPU)
        real = planner.validate_seq_lens_cpu

        def planted(seq_lens_cpu, block_table, page_size, name="seq_lens_cpu"):
            int(block_table.max())  # what a check of the device block table would cost
            return real(seq_lens_cpu, block_table, page_size, name)

        monkeypatch.setattr(planner, "validate_seq_lens_cpu", planted)
        with device_values_refused(monkeypatch, es.on_device), pytest.raises(AssertionError, match="__int__"):
            es.build()


def test_host_path_bench_runs_on_a_cpu(tmp_path):
    hp = _host_path()
    out = tmp_path / "host.json"
    assert hp.main(["--device", "cpu", "--points", "2x600", "--steps", "3", "--layers", "2",
                    "--modes", "msa,msa_op,triton", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["msa", "msa_op"]  # triton: GPU only
    for r in rows:
        assert r["host_build_us"] > 0 and r["host_layer_us"] > 0 and r["host_step_us"] >= r["host_build_us"]
        assert "num_splits=" in r["launch"] and "graph_device_us" not in r
