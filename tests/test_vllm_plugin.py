"""msa_jit.integrations.vllm_plugin.register(): when it patches what, one log line, never raises."""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
import vllm_standins as vs

from msa_jit.integrations import engine, vllm_plugin
from msa_jit import env

ROOT = Path(__file__).resolve().parents[1]
needs_engine = pytest.mark.skipif(not vs.engine_files_present(),
                                  reason=vs.ENGINE_SKIP_REASON)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (env.VLLM_PLUGIN, env.VLLM_SM100):
        monkeypatch.delenv(name, raising=False)


def _register(caplog) -> str:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=vllm_plugin.LOG.name):
        line = vllm_plugin.register()
    records = [r for r in caplog.records if r.name == vllm_plugin.LOG.name]
    assert [r.getMessage() for r in records] == [line], "register() must log exactly one line"
    assert "\n" not in line and line.startswith("msa-jit vLLM plugin:")
    return line


def _untouched(ns) -> bool:
    originals = [getattr(ns.engine_msa, n) for n in vllm_plugin.REBOUND_NAMES]
    return ([getattr(ns.msa, n) for n in vllm_plugin.REBOUND_NAMES] == originals
            and not hasattr(ns.common.select_main_backend_and_impl_cls, "__msa_jit_original__"))


def test_without_vllm_it_logs_one_line_and_returns(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    assert _register(caplog) == "msa-jit vLLM plugin: vLLM is not installed; nothing patched"


def test_entry_point_is_declared_and_loads():
    ep_table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    value = ep_table["vllm.general_plugins"]["msa_jit"]
    assert value == "msa_jit.integrations.vllm_plugin:register"
    ep = importlib.metadata.EntryPoint(name="msa_jit", value=value, group="vllm.general_plugins")
    assert ep.load() is vllm_plugin.register


@needs_engine
def test_sm90_patches_names_and_selector(monkeypatch, caplog):
    ns = vs.install(monkeypatch, capability=(9, 0))
    original = ns.common.select_main_backend_and_impl_cls
    line = _register(caplog)
    assert "SM90 through msa-jit" in line and "select_main_backend_and_impl_cls" in line
    for name in vllm_plugin.REBOUND_NAMES:
        assert getattr(ns.msa, name) is getattr(engine, name), name
    wrapped = ns.common.select_main_backend_and_impl_cls
    assert wrapped.__msa_jit_original__ is original
    # idempotent: one more line, nothing wrapped twice
    assert "already applied" in _register(caplog)
    assert ns.common.select_main_backend_and_impl_cls is wrapped
    # vLLM's own module is untouched (only its importer's names are rebound)
    assert ns.engine_msa.supports_cutlass_sparse_decode is not engine.supports_cutlass_sparse_decode


@needs_engine
@pytest.mark.parametrize("bound_original", [True, False])
def test_model_module_imported_before_register(monkeypatch, caplog, bound_original):
    """model.py does `from ...common.sparse_attention import select_main_backend_and_impl_cls`."""
    ns = vs.install(monkeypatch, capability=(9, 0))
    model = ModuleType(vllm_plugin.MODEL_MODULE)
    other = object()
    model.select_main_backend_and_impl_cls = ns.common.select_main_backend_and_impl_cls if bound_original else other
    monkeypatch.setitem(sys.modules, vllm_plugin.MODEL_MODULE, model)
    line = _register(caplog)
    if bound_original:
        assert model.select_main_backend_and_impl_cls is ns.common.select_main_backend_and_impl_cls
        assert f"{vllm_plugin.MODEL_MODULE}.select_main_backend_and_impl_cls" in line
    else:  # someone else's function: not ours to replace
        assert model.select_main_backend_and_impl_cls is other


@needs_engine
def test_sm100_needs_the_opt_in(monkeypatch, caplog):
    ns = vs.install(monkeypatch, capability=(10, 0))
    line = _register(caplog)
    assert "fmha_sm100 path kept" in line and env.VLLM_SM100 in line and _untouched(ns)
    monkeypatch.setenv(env.VLLM_SM100, "1")
    line = _register(caplog)
    assert "SM100 through msa-jit" in line and "prefill stays on fmha_sm100" in line
    assert ns.msa.msa_cutlass_sparse_decode is engine.msa_cutlass_sparse_decode
    # the engine already picks its MSA backend on 10.x: the selector is left alone
    assert not hasattr(ns.common.select_main_backend_and_impl_cls, "__msa_jit_original__")


@needs_engine
@pytest.mark.parametrize("capability,expect", [((8, 0), "compute capability 8.0 is below 9.0"),
                                               ((12, 0), "compute capability 12.0: arch"),
                                               ((10, 3), "compute capability 10.3: arch"),
                                               (None, "not a CUDA platform")])
def test_other_devices_are_left_alone(monkeypatch, caplog, capability, expect):
    ns = vs.install(monkeypatch, capability=capability)
    assert expect in _register(caplog) and _untouched(ns)
    assert caplog.records[-1].levelno == logging.INFO


@needs_engine
def test_an_opt_in_for_a_blackwell_msa_jit_does_not_build_for_is_a_warning(monkeypatch, caplog):
    """A B300 (10.3) with MSA_JIT_VLLM_SM100=1: sm_100a code does not run there, so nothing is patched
    (the first decode would have failed: no build for sm_103a), and the refused opt-in is a WARNING."""
    ns = vs.install(monkeypatch, capability=(10, 3))
    monkeypatch.setenv(env.VLLM_SM100, "1")
    line = _register(caplog)
    assert "compute capability 10.3" in line and "sm_100a" in line and "nothing patched" in line and _untouched(ns)
    assert caplog.records[-1].levelno == logging.WARNING


@needs_engine
def test_an_engine_module_that_cannot_be_imported_is_a_warning(monkeypatch, caplog):
    """The vLLM it knows on a GPU it serves, but the MiniMax-M3 module fails to import: a broken install a
    deployment should see (INFO lines reach no handler while vLLM loads its plugins)."""
    ns = vs.install(monkeypatch, capability=(9, 0))
    real_import = vllm_plugin.importlib.import_module

    def failing(name, *a, **k):
        if name == vllm_plugin.MSA_MODULE:
            raise ImportError("no module named flash_mla")
        return real_import(name, *a, **k)

    monkeypatch.setattr(vllm_plugin.importlib, "import_module", failing)
    line = _register(caplog)
    assert "cannot be imported (no module named flash_mla); nothing patched" in line and _untouched(ns)
    assert caplog.records[-1].levelno == logging.WARNING


@needs_engine
def test_unknown_vllm_version(monkeypatch, caplog):
    """Logged as a WARNING (a deployment runs vLLM unpatched: it should see why), not INFO."""
    ns = vs.install(monkeypatch, version="0.34.0")
    line = _register(caplog)
    assert "vLLM 0.34.0 is not a version this plugin knows (0.33.0)" in line and _untouched(ns)
    assert caplog.records[-1].levelno == logging.WARNING


@needs_engine
def test_log_levels(monkeypatch, caplog):
    """INFO when patched, off or on another device; WARNING when the installed vLLM lacks a name."""
    ns = vs.install(monkeypatch, capability=(9, 0))
    monkeypatch.setenv(env.VLLM_PLUGIN, "0")
    _register(caplog)
    assert caplog.records[-1].levelno == logging.INFO
    monkeypatch.delenv(env.VLLM_PLUGIN)
    monkeypatch.delattr(ns.msa, "prepare_decode_metadata")
    assert "lacks" in _register(caplog) and caplog.records[-1].levelno == logging.WARNING
    ns = vs.install(monkeypatch, capability=(9, 0))
    assert "through msa-jit" in _register(caplog) and caplog.records[-1].levelno == logging.INFO


@needs_engine
def test_a_cuda_platform_without_a_capability_is_not_called_non_cuda(monkeypatch, caplog):
    """vLLM's CUDA platform reports no capability when it sees no device (NVML): the line says
    that, not "not a CUDA platform"."""
    ns = vs.install(monkeypatch, capability=(9, 0))
    monkeypatch.setattr(ns.platform, "get_device_capability", lambda device_id=0: None)
    line = _register(caplog)
    assert "not a CUDA platform" not in line and "CUDA platform that reports no compute capability" in line
    assert _untouched(ns)


class _RaisingFinder:
    """A sys.meta_path finder whose lookup of vllm raises `exc` (a vLLM whose import exits)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise self.exc
        return None


def _vllm_import_raises(monkeypatch, exc: BaseException) -> None:
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_RaisingFinder(exc), *sys.meta_path])


@pytest.mark.parametrize("exc", [SystemExit(3), SystemExit("vllm: cannot start")])
def test_a_vllm_import_that_exits_does_not_leave_register(monkeypatch, caplog, exc):
    """SystemExit is no Exception: it used to propagate out of register() and end the process
    vLLM was loading plugins in. Now it is the one WARNING line of a failure."""
    _vllm_import_raises(monkeypatch, exc)
    line = _register(caplog)
    assert line.startswith("msa-jit vLLM plugin: not applied (SystemExit: ") and "vLLM runs unchanged" in line
    assert caplog.records[-1].levelno == logging.WARNING


def test_a_keyboard_interrupt_still_interrupts(monkeypatch):
    _vllm_import_raises(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        vllm_plugin.register()


@needs_engine
@pytest.mark.parametrize("version,known", [("0.33.0+cu126", True), ("0.33.0+cu129.abc", True),
                                           ("0.33.0rc1", False), ("0.33.1.dev3+g1234abc", False),
                                           ("0.33", False), (None, False)])
def test_a_local_build_label_is_the_same_release(monkeypatch, caplog, version, known):
    """vLLM's CUDA-variant wheels carry a local label (`0.33.0+cu126`): the same 0.33.0 source.
    Pre-releases, dev builds and other releases are not 0.33.0."""
    ns = vs.install(monkeypatch, capability=(9, 0), version=version)
    line = _register(caplog)
    if known:
        assert "through msa-jit" in line and not _untouched(ns)
    else:
        assert f"vLLM {version} is not a version this plugin knows (0.33.0)" in line and _untouched(ns)


@needs_engine
@pytest.mark.parametrize("value,expect", [("0", "off (MSA_JIT_VLLM_PLUGIN=0)"),
                                          ("perhaps", "not applied (ValueError: MSA_JIT_VLLM_PLUGIN=")])
def test_env_var_turns_it_off(monkeypatch, caplog, value, expect):
    ns = vs.install(monkeypatch)
    monkeypatch.setenv(env.VLLM_PLUGIN, value)
    assert expect in _register(caplog) and _untouched(ns)


@needs_engine
def test_missing_engine_module(monkeypatch, caplog):
    vs.install(monkeypatch)
    monkeypatch.setitem(sys.modules, vllm_plugin.MSA_MODULE, None)
    assert "cannot be imported" in _register(caplog)


@needs_engine
def test_a_failure_patches_nothing(monkeypatch, caplog):
    ns = vs.install(monkeypatch)

    def boom(*a, **k):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(vllm_plugin, "make_impl_cls", boom)
    line = _register(caplog)
    assert "not applied (RuntimeError: kaboom)" in line and _untouched(ns)
    assert caplog.records[-1].levelno == logging.WARNING


@needs_engine
def test_selector_routes(monkeypatch, caplog):
    """On SM90: fp8 + "cutlass" and NVFP4 go to the MSA backends with msa-jit's impl;
    everything else gets the engine's own answer (and its own errors)."""
    import engine_cases as ec

    ns = vs.install(monkeypatch, capability=(9, 0))
    _register(caplog)
    sel = ns.common.select_main_backend_and_impl_cls
    common, msa = ns.common, ns.msa

    def pick(dtype: str, backend: str = "cutlass", topk: int = 16):
        ns.config.vllm_config = ec.vllm_config(num_q_heads=16, decode_backend=backend, kv_cache_dtype=dtype)
        return sel(topk_blocks=topk, kv_cache_dtype=dtype, num_kv_heads=1)

    b, impl = pick("fp8")
    assert issubclass(b, msa.MiniMaxM3SparseMSABackend) and b.get_builder_cls() is msa.MiniMaxM3SparseMSAMetadataBuilder
    # the kernel needs each (page, head) block contiguous: LBHNC, not vLLM's default LBNHC
    assert b.supported_kv_cache_layouts() == (vs.KVCacheLayout.LBHNC,)
    assert msa.MiniMaxM3SparseMSABackend.supported_kv_cache_layouts() is None
    assert issubclass(impl, msa.MiniMaxM3SparseMSAImpl)
    assert issubclass(impl, vllm_plugin.MsaJitPrefillMixin) and impl.__name__ == "MsaJitSparseMSAImpl"
    assert pick("fp8_e4m3")[0] is b
    assert pick("nvfp4", "triton") == (msa.MiniMaxM3SparseMSANvfp4Backend, impl)
    triton = (common.MiniMaxM3SparseBackend, common.MiniMaxM3SparseTritonImpl)
    assert pick("fp8", "triton") == triton
    assert pick("auto") == triton and pick("fp8_e5m2") == triton
    assert pick("fp8", topk=12) == triton  # the engine's MSA top-k counts are 4/8/16/32
    with pytest.raises(ValueError, match="only the 'nvfp4' NVFP4 KV cache dtype"):
        pick("nvfp4_4over6")
    ns.config.vllm_config = None  # no current config: the engine's default backend ("triton")
    assert sel(topk_blocks=16, kv_cache_dtype="fp8", num_kv_heads=1) == triton


def test_mixed_step_puts_the_metadata_back_when_the_decode_raises():
    """A mixed step swaps a decode-only view into the forward context's metadata dict for the decode
    part; it must be put back whatever the decode does, an exception included."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    @dataclasses.dataclass
    class Metadata:
        num_actual_tokens: int = 5
        num_decode_tokens: int = 2
        num_decodes: int = 2
        num_prefills: int = 1
        num_prefill_tokens: int = 3
        prefill: object = "p"

    class FailingEngine:
        def forward(self, layer, query, kv_cache, output, *, query_fp8=None):
            raise RuntimeError("decode failed")

    md = Metadata()
    ctx = SimpleNamespace(attn_metadata={"layer0": md})
    impl = type("Impl", (vllm_plugin.MsaJitPrefillMixin, FailingEngine),
                {"_msa": SimpleNamespace(get_forward_context=lambda: ctx), "_common": None})()
    with pytest.raises(RuntimeError, match="decode failed"):
        impl.forward(SimpleNamespace(layer_name="layer0"), torch.empty(0), torch.empty(0), torch.empty(0))
    assert ctx.attn_metadata["layer0"] is md


# ----------------------------------------------------------------------------- scales after loading
# vLLM 0.33's DummyModelLoader value for a 1-element float32 buffer on a GPU worker
# (tests/test_nvfp4_vllm_writer.py derives it from the generator).
DUMMY_SCALE = -7.4558414e-4
SCALE_BUFFERS = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")


def _set_default_quant_scales(layer, register_buffer: bool = False) -> None:
    """Stand-in for vLLM 0.33.0's `set_default_quant_scales`
    (vllm/model_executor/layers/attention/attention.py), written after its definition."""
    import torch

    for name in SCALE_BUFFERS:
        if register_buffer:
            layer.register_buffer(name, torch.tensor(1.0, dtype=torch.float32))
        else:
            getattr(layer, name).fill_(1.0)
    layer._q_scale_float = layer._k_scale_float = layer._v_scale_float = layer._prob_scale_float = 1.0
    layer._k_scale_cpu = torch.tensor(1.0, dtype=torch.float32)
    layer._v_scale_cpu = torch.tensor(1.0, dtype=torch.float32)


def _model_module(monkeypatch, with_method: bool = False) -> ModuleType:
    """Stand-in for model.py: its sparse attention layer as far as scales go (the buffers its
    __init__ registers, the selector it calls) and the set_default_quant_scales it imports."""
    import torch

    model = ModuleType(vllm_plugin.MODEL_MODULE)

    class MiniMaxM3SparseAttention(torch.nn.Module):
        def __init__(self, kv_cache_dtype: str) -> None:
            super().__init__()
            model.set_default_quant_scales(self, register_buffer=True)
            self.attn_backend, self.impl_cls = model.select_main_backend_and_impl_cls(
                topk_blocks=16, kv_cache_dtype=kv_cache_dtype, num_kv_heads=1)

    if with_method:
        MiniMaxM3SparseAttention.process_weights_after_loading = lambda self, act_dtype: None
    model.MiniMaxM3SparseAttention = MiniMaxM3SparseAttention
    model.set_default_quant_scales = _set_default_quant_scales
    monkeypatch.setitem(sys.modules, vllm_plugin.MODEL_MODULE, model)
    return model


def _load_dummy_weights(layer) -> None:
    """What vLLM's loader does to the layer's scales under load_format="dummy": every persistent
    buffer filled (initialize_single_dummy_weight), then, on an attention layer that has one,
    process_weights_after_loading (model_loader/utils.py, is_deferred_attention_layer)."""
    import torch

    for name, buf in layer.named_buffers(recurse=False):
        buf.fill_(DUMMY_SCALE)
    if callable(getattr(layer, "process_weights_after_loading", None)):
        layer.process_weights_after_loading(torch.bfloat16)


@needs_engine
@pytest.mark.parametrize("kv_cache_dtype,backend,served", [("nvfp4", "triton", True), ("fp8", "cutlass", True),
                                                            ("fp8", "triton", False)])
def test_served_layers_get_their_scales_back_after_loading(monkeypatch, caplog, kv_cache_dtype, backend, served):
    """A layer the plugin routes to msa-jit ends loading with its scale buffers at 1.0 (what a
    checkpoint leaves; the NVFP4 insert and msa-jit read _k_scale / _v_scale, and a dummy load
    left them at -7.5e-4). A layer the engine keeps is left as the engine has it."""
    import engine_cases as ec

    ns = vs.install(monkeypatch, capability=(9, 0))
    model = _model_module(monkeypatch)
    _register(caplog)
    model.select_main_backend_and_impl_cls = ns.common.select_main_backend_and_impl_cls  # model.py's import
    ns.config.vllm_config = ec.vllm_config(num_q_heads=16, decode_backend=backend, kv_cache_dtype=kv_cache_dtype)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=vllm_plugin.LOG.name):
        layer = model.MiniMaxM3SparseAttention(kv_cache_dtype)
        model.MiniMaxM3SparseAttention(kv_cache_dtype)  # the second layer finds the method in place
    assert issubclass(layer.impl_cls, vllm_plugin.MsaJitPrefillMixin) is served
    _load_dummy_weights(layer)
    want = 1.0 if served else DUMMY_SCALE
    for name in SCALE_BUFFERS:
        assert getattr(layer, name).item() == pytest.approx(want, rel=1e-7), name
    if served:
        assert layer._k_scale_float == layer._v_scale_float == 1.0
        assert model.MiniMaxM3SparseAttention.process_weights_after_loading.__msa_jit_scale_reset__
    added = [r.getMessage() for r in caplog.records if "process_weights_after_loading added" in r.getMessage()]
    assert len(added) == served  # once, for the class


def test_an_existing_post_load_step_is_kept(monkeypatch):
    model = _model_module(monkeypatch, with_method=True)
    own = model.MiniMaxM3SparseAttention.process_weights_after_loading
    assert vllm_plugin.add_scale_reset(model.MiniMaxM3SparseAttention, model.set_default_quant_scales) is False
    assert model.MiniMaxM3SparseAttention.process_weights_after_loading is own


@needs_engine
def test_the_engines_layer_needs_the_reset():
    """vLLM 0.33.0's model.py, as written: the layer registers its scale buffers at 1.0 with
    set_default_quant_scales, gives _k_scale / _v_scale to the fused insert for NVFP4, and has
    no post-load step of its own (add_scale_reset would keep one)."""
    import ast

    import engine_cases as ec

    tree = ast.parse(ec.MODEL_PY.read_text())
    assert any(isinstance(n, ast.ImportFrom) and n.module == "vllm.model_executor.layers.attention.attention"
               and vllm_plugin.SCALE_RESET in [a.name for a in n.names] for n in tree.body)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == vllm_plugin.LAYER_CLASS)
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    assert "process_weights_after_loading" not in methods
    calls = [ast.unparse(n) for n in ast.walk(methods["__init__"]) if isinstance(n, ast.Call)]
    assert "set_default_quant_scales(self, register_buffer=True)" in calls
    forward = ast.unparse(methods["forward"])
    assert "kv_k_scale=self._k_scale if self.use_nvfp4_kv else None" in forward
    assert "kv_v_scale=self._v_scale if self.use_nvfp4_kv else None" in forward


@needs_engine
def test_the_line_is_said_again_when_vllm_logging_was_not_configured(monkeypatch, caplog):
    """vLLM's LLM() loads plugins (in its EngineArgs) before it configures the "vllm" logger, so
    register()'s INFO line reaches no handler there; the patched selector, called when the first
    layer is built, says it once more (and only once). Where logging is configured, it does not."""
    ns = vs.install(monkeypatch, capability=(9, 0))
    monkeypatch.setattr(vllm_plugin, "_PENDING_LINE", [])
    monkeypatch.setattr(vllm_plugin, "_logging_configured", lambda: False)
    line = _register(caplog)
    assert "through msa-jit" in line
    selector = ns.common.select_main_backend_and_impl_cls
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=vllm_plugin.LOG.name):
        for _ in range(2):
            selector(topk_blocks=16, kv_cache_dtype="fp8_e5m2", num_kv_heads=4)  # the engine's own choice
    said = [r.getMessage() for r in caplog.records if r.name == vllm_plugin.LOG.name]
    assert said == [line]


def test_logging_configured_follows_the_logger_tree(monkeypatch):
    """A handler on LOG's ancestors up to the first that does not propagate counts; none: not configured."""
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "handlers", [])
    monkeypatch.setattr(vllm_logger, "propagate", False)
    monkeypatch.setattr(vllm_plugin.LOG, "handlers", [])
    monkeypatch.setattr(logging.getLogger("vllm.plugins"), "handlers", [])
    assert not vllm_plugin._logging_configured()
    monkeypatch.setattr(vllm_logger, "handlers", [logging.NullHandler()])
    assert vllm_plugin._logging_configured()
