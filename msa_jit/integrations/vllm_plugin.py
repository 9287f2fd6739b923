"""vLLM plugin: MiniMax-M3's sparse decode through msa-jit on Hopper (and on Blackwell when asked).

Entry point `msa_jit = "msa_jit.integrations.vllm_plugin:register"` in the group `vllm.general_plugins`
(pyproject.toml): vLLM calls `register()` in every process (API server, engine core, workers)
before it builds a model. `register()` is cheap, idempotent, never raises, and logs one line
(logger `vllm.plugins.msa_jit`, so vLLM's own log shows it) saying what it did or why not.

What it patches (vLLM 0.33.0 only, local build labels such as `0.33.0+cu126` included), module
globals before any model is built, and one method while the model is built:

1. `vllm.models.minimax_m3.nvidia.sparse_attention_msa`: the eight names it imported from
   `msa_cutlass_sparse_decode` are rebound to `msa_jit.integrations.engine`'s (same signatures), so the
   engine's own `MiniMaxM3SparseMSAMetadataBuilder.build` and `MiniMaxM3SparseMSAImpl.forward`
   plan and run decode through msa-jit: its support check accepts 9.x / 10.x, no batch floor
   unless `VLLM_MINIMAX_M3_MSA_CUTLASS_MIN_BATCH` sets one, and `use_cutlass_decode` is True, so
   the model allocates and writes the fp8 query (`_allocate_query_fp8`).
2. On SM90 only: `select_main_backend_and_impl_cls` (in `...common.sparse_attention`, and in
   `...nvidia.model` if that is already imported, since it imports the function by name). The
   engine picks its Triton backend off 10.x and refuses NVFP4 there; the wrapper returns
   `MsaJitSparseMSABackend` (the engine's MSA backend asking for the block-contiguous LBHNC
   cache layout; for NVFP4 the engine's `MiniMaxM3SparseMSANvfp4Backend`, which asks for it
   itself) with `MsaJitSparseMSAImpl`, the engine's MSA impl whose prefill avoids fmha_sm100
   (Blackwell only): fp8 caches through the engine's Triton prefill (`minimax_m3_sparse_attn`,
   what its Triton impl runs), NVFP4 through `msa_jit.integrations.engine.msa_sparse_prefill`. Everything
   else (bf16 or e5m2 caches, fp8 without the opt-in, other top-k) gets the engine's own choice.
3. On SM90, the first time the selector routes a layer to msa-jit (NVFP4, or fp8 with the opt-in):
   `MiniMaxM3SparseAttention.process_weights_after_loading` in `...nvidia.model`, which vLLM
   0.33 lacks (`add_scale_reset`): after loading, the layer's quantization scale buffers go back
   to 1.0 through vLLM's own `set_default_quant_scales(layer, register_buffer=False)`, as vLLM's
   `Attention` does when no quantization weights load. Nothing loads them for this layer (its
   `load_weights` cannot reach buffers), so a checkpoint leaves 1.0 anyway; but
   `load_format="dummy"` fills every buffer with uniform(-1e-3, 1e-3) values (-7.4558414e-4 on a
   GPU), which the NVFP4 insert divides by, msa-jit multiplies by (a negative scale: NaN), and the
   engine's Triton fp8 prefill multiplies K and V by.

Opt-in exactly as the engine's: an fp8 cache takes this path with
`--attention-config '{"minimax_m3_msa_decode_backend": "cutlass"}'`; NVFP4 always does.
`MSA_JIT_VLLM_PLUGIN=0` turns the plugin off; on 10.x it does nothing unless
`MSA_JIT_VLLM_SM100=1` (then only step 1: the engine's fmha_sm100 prefill stays).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import sys
from types import ModuleType
from typing import Any, Callable, ClassVar

import torch

from . import engine
from .. import env

__all__ = ["KNOWN_VLLM_VERSIONS", "REBOUND_NAMES", "MsaJitPrefillMixin", "add_scale_reset", "make_backend_cls",
           "make_impl_cls", "register", "wrap_selector"]

LOG = logging.getLogger("vllm.plugins.msa_jit")

KNOWN_VLLM_VERSIONS = ("0.33.0",)
MSA_MODULE = "vllm.models.minimax_m3.nvidia.sparse_attention_msa"
COMMON_MODULE = "vllm.models.minimax_m3.common.sparse_attention"
MODEL_MODULE = "vllm.models.minimax_m3.nvidia.model"
SELECTOR = "select_main_backend_and_impl_cls"
LAYER_CLASS = "MiniMaxM3SparseAttention"  # model.py's sparse attention layer (it calls SELECTOR)
SCALE_RESET = "set_default_quant_scales"  # vLLM's function, as model.py imports it
# Every name sparse_attention_msa.py imports from vllm.models.minimax_m3.nvidia.
# msa_cutlass_sparse_decode (tests/test_engine_parity.py checks this list against the real file).
REBOUND_NAMES = (
    "MSACutlassDecodeMetadata",
    "MSACutlassDecodePlanCache",
    "is_nvfp4_kv_cache",
    "msa_cutlass_sparse_decode",
    "nvfp4_kv_cache_views",
    "prepare_decode_metadata",
    "should_prepare_decode_metadata",
    "supports_cutlass_sparse_decode",
)
# The engine's MSA top-k block counts (select_main_backend_and_impl_cls's use_msa).
_MSA_TOPK_BLOCKS = (4, 8, 16, 32)
_APPLIED = "_msa_jit_plugin_applied"  # set on the patched sparse_attention_msa module
_PREFIX = "msa-jit vLLM plugin:"
_WARNED: set[str] = set()  # modules whose missing scale-reset target was already logged
# register()'s line when vLLM's logging was not configured yet (vLLM's LLM() loads plugins in its
# EngineArgs, before it configures the "vllm" logger: an INFO line then reaches no handler), said
# again by the patched selector when the first layer is built: (level, line) or None.
_PENDING_LINE: list[tuple[int, str]] = []


class MsaJitPrefillMixin:
    """`forward` of the engine's `MiniMaxM3SparseMSAImpl` without its Blackwell-only prefill.

    Decode tokens run through the engine's own forward (unmodified, with the msa-jit names
    rebound); prefill tokens run here. `make_impl_cls` puts this in front of the engine's class.
    """

    _msa: ClassVar[ModuleType]
    _common: ClassVar[ModuleType]
    # Prefill of an fp8 / bf16 cache: "triton" (the engine's minimax_m3_sparse_attn) or
    # "msa_jit" (msa_sparse_prefill, the NVFP4 path; tests use it on fp8).
    fp8_prefill: ClassVar[str] = "triton"
    prefill_chunk_tokens: ClassVar[int] = engine.PREFILL_CHUNK_TOKENS

    def forward(self, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor,
                *, query_fp8: torch.Tensor | None = None) -> torch.Tensor:
        attn_metadata = self._msa.get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            return output  # profiling run; caches unbound
        main_md = attn_metadata[layer.layer_name]
        if main_md.num_prefills == 0:
            return super().forward(layer, query, kv_cache, output, query_fp8=query_fp8)  # type: ignore[misc]
        if main_md.num_decodes > 0:
            # The engine's forward on a decode-only view of this layer's metadata (the dict
            # entry is swapped for the call and restored, whatever happens).
            attn_metadata[layer.layer_name] = dataclasses.replace(
                main_md, num_actual_tokens=main_md.num_decode_tokens, num_prefills=0,
                num_prefill_tokens=0, prefill=None,
            )
            try:
                super().forward(layer, query, kv_cache, output, query_fp8=query_fp8)  # type: ignore[misc]
            finally:
                attn_metadata[layer.layer_name] = main_md
        self._prefill(layer, main_md, query, kv_cache, output, query_fp8)
        return output

    def _prefill(self, layer: Any, md: Any, query: torch.Tensor, kv_cache: torch.Tensor,
                 output: torch.Tensor, query_fp8: torch.Tensor | None) -> None:
        """Prefill tokens [nd:num_actual_tokens] of `md` into `output`."""
        p = md.prefill
        nd, n = md.num_decode_tokens, md.num_actual_tokens
        heads, hd = self.num_heads, self.head_size  # type: ignore[attr-defined]
        q = query[:n].view(-1, heads, hd)
        out = output[:n].view(-1, heads, hd)
        # With use_cutlass_decode the fused insert wrote only query_fp8 (model.py).
        q_fp8 = None if query_fp8 is None else query_fp8[:n].view(-1, heads, hd)
        q_scale_float = getattr(layer, "_q_scale_float", 1.0)
        topk = layer.topk_indices_buffer  # [tokens, Hkv, K], token-major
        use_fp8_kv, use_nvfp4 = self.use_fp8_kv, self.use_nvfp4_kv  # type: ignore[attr-defined]
        k_scale = getattr(layer, "_k_scale", None) if use_fp8_kv else None
        v_scale = getattr(layer, "_v_scale", None) if use_fp8_kv else None
        if use_fp8_kv and not use_nvfp4:
            kv_cache = kv_cache.view(self.kv_cache_fp8_dtype)  # type: ignore[attr-defined]
        if use_nvfp4 or self.fp8_prefill == "msa_jit":
            engine.msa_sparse_prefill(
                q[nd:] if q_fp8 is None else q_fp8[nd:], kv_cache, topk[nd:n], out[nd:],
                block_table=p.block_table, cu_seqlens_q=p.cu_seqlens_q, context_lens=p.context_lens,
                page_size=self.block_size, scale=self.scale,  # type: ignore[attr-defined]
                q_scale_float=1.0 if q_fp8 is None else q_scale_float,
                k_scale_float=getattr(layer, "_k_scale_float", 1.0),
                v_scale_float=getattr(layer, "_v_scale_float", 1.0),
                k_scale=k_scale if use_nvfp4 else None, v_scale=v_scale if use_nvfp4 else None,
                chunk_tokens=self.prefill_chunk_tokens,
            )
            return
        # As MiniMaxM3SparseTritonImpl.forward runs it, on the dequantized query.
        qp = q[nd:] if q_fp8 is None else self._msa._dequantize_query(q_fp8[nd:], q_scale_float, q[nd:])
        self._common.minimax_m3_sparse_attn(
            qp, kv_cache, topk[:n].transpose(0, 1)[:, nd:n, :], p.block_table, p.cu_seqlens_q,
            p.seq_lens, p.context_lens, p.max_query_len, self.num_kv_heads,  # type: ignore[attr-defined]
            self.scale, out[nd:], k_scale=k_scale, v_scale=v_scale,  # type: ignore[attr-defined]
        )


def make_impl_cls(msa: ModuleType, common: ModuleType) -> type:
    """`MsaJitSparseMSAImpl`: MsaJitPrefillMixin in front of `msa.MiniMaxM3SparseMSAImpl`."""
    return type("MsaJitSparseMSAImpl", (MsaJitPrefillMixin, msa.MiniMaxM3SparseMSAImpl), {
        "_msa": msa,
        "_common": common,
        "__module__": __name__,
        "__doc__": "vLLM's MiniMaxM3SparseMSAImpl with decode through msa-jit and an SM90 prefill.",
    })


def make_backend_cls(msa: ModuleType) -> type:
    """`MsaJitSparseMSABackend`: `msa.MiniMaxM3SparseMSABackend` that asks for the LBHNC layout.

    The kernel reads each (page, KV head) block as one contiguous run (as the engine's NVFP4
    backend asks too). Unasked, a Hopper worker whose other backends express no preference gets
    vLLM's default LBNHC, whose per-layer view interleaves the heads of a token.
    """
    layouts = (msa.KVCacheLayout.LBHNC,)

    def supported_kv_cache_layouts(cls: type) -> tuple[Any, ...]:
        return layouts

    return type("MsaJitSparseMSABackend", (msa.MiniMaxM3SparseMSABackend,), {
        "supported_kv_cache_layouts": classmethod(supported_kv_cache_layouts),
        "__module__": __name__,
        "__doc__": "vLLM's MiniMaxM3SparseMSABackend on the block-contiguous LBHNC layout.",
    })


def add_scale_reset(layer_cls: type, set_default_quant_scales: Callable[..., None]) -> bool:
    """Give `layer_cls` the post-load step of vLLM's `Attention` when it has none: a
    `process_weights_after_loading(act_dtype)` that calls `set_default_quant_scales(self,
    register_buffer=False)` (the scale buffers filled with 1.0, their host copies 1.0). vLLM's
    loader calls it on every attention layer that has one, after the weights are loaded.
    Returns whether it was added (False: the class already has such a method)."""
    if callable(getattr(layer_cls, "process_weights_after_loading", None)):
        return False

    def process_weights_after_loading(self: Any, act_dtype: torch.dtype) -> None:
        set_default_quant_scales(self, register_buffer=False)

    process_weights_after_loading.__msa_jit_scale_reset__ = True  # type: ignore[attr-defined]
    layer_cls.process_weights_after_loading = process_weights_after_loading  # type: ignore[attr-defined]
    return True


def _reset_scales_after_loading() -> None:
    """`add_scale_reset` on model.py's layer class, found when its layers are being built (the
    selector runs inside the layer's __init__, so the module is imported by then)."""
    model = sys.modules.get(MODEL_MODULE)
    layer_cls, reset = getattr(model, LAYER_CLASS, None), getattr(model, SCALE_RESET, None)
    if not isinstance(layer_cls, type) or not callable(reset):
        if MODEL_MODULE not in _WARNED:
            _WARNED.add(MODEL_MODULE)
            LOG.warning(f"{_PREFIX} {MODEL_MODULE} has no {LAYER_CLASS} / {SCALE_RESET}: its scale buffers "
                        "keep whatever loading left in them (a dummy load: random values)")
        return
    if add_scale_reset(layer_cls, reset):
        LOG.info(f"{_PREFIX} {LAYER_CLASS}.process_weights_after_loading added: its k/v/q scale "
                 "buffers are 1.0 after loading, as vLLM's Attention leaves them")


def _decode_backend() -> str:
    """vLLM's `attention_config.minimax_m3_msa_decode_backend` of the model being built."""
    try:
        from vllm.config import get_current_vllm_config

        return str(get_current_vllm_config().attention_config.minimax_m3_msa_decode_backend)
    except Exception:  # noqa: BLE001 - no config: the engine's default
        return "triton"


def wrap_selector(original: Callable[..., Any], fp8_backend: type, nvfp4_backend: type,
                  impl_cls: type) -> Callable[..., Any]:
    """`select_main_backend_and_impl_cls` that picks (fp8_backend, impl_cls) for fp8 with the
    "cutlass" decode backend and (nvfp4_backend, impl_cls) for NVFP4 (SM90: the engine's own
    check would say Triton / refuse); `original` decides everything else. Routing a layer to
    msa-jit also gives model.py's layer class its post-load scale reset (`add_scale_reset`)."""

    @functools.wraps(original)
    def select_main_backend_and_impl_cls(*, topk_blocks: int, kv_cache_dtype: str, num_kv_heads: int,
                                         emits_sparse_block_table: bool = False) -> tuple[type, type]:
        while _PENDING_LINE:
            LOG.log(*_PENDING_LINE.pop())
        if topk_blocks in _MSA_TOPK_BLOCKS:
            if kv_cache_dtype == "nvfp4":  # other NVFP4 spellings: the engine's own error
                _reset_scales_after_loading()
                return nvfp4_backend, impl_cls
            if kv_cache_dtype in engine.KV_CACHE_DTYPES and _decode_backend() == "cutlass":
                _reset_scales_after_loading()
                return fp8_backend, impl_cls
        return original(topk_blocks=topk_blocks, kv_cache_dtype=kv_cache_dtype,
                        num_kv_heads=num_kv_heads, emits_sparse_block_table=emits_sparse_block_table)

    select_main_backend_and_impl_cls.__msa_jit_original__ = original  # type: ignore[attr-defined]
    return select_main_backend_and_impl_cls


def _capability() -> tuple[int, int] | str:
    """The device's compute capability as vLLM's platform reports it (NVML: no CUDA context in
    the API server), or why there is none: not a CUDA platform, or a CUDA one that reports no
    capability (no device visible to this process, NVML unavailable)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return "not a CUDA platform"
    cap = current_platform.get_device_capability()
    if cap is None:
        return "a CUDA platform that reports no compute capability (no GPU visible to this process?)"
    return (int(cap.major), int(cap.minor))


def _release(version: object) -> str | None:
    """`version` without its local label: vLLM's CUDA-variant wheels are `0.33.0+cu126` etc.,
    the same source as `0.33.0`. Pre-releases and dev builds (`0.33.0rc1`, `0.33.1.dev3+g...`)
    keep what tells them apart, so they stay unknown."""
    return version.split("+", 1)[0] if isinstance(version, str) else None


class _Unserved(str):
    """A line of `_apply` that register() logs as a WARNING: a vLLM this plugin was installed
    with but cannot serve (another version, names it lacks), which a deployment should see."""


def _apply() -> str:
    if not env.vllm_plugin_enabled():
        return f"{_PREFIX} off ({env.VLLM_PLUGIN}=0); nothing patched"
    try:
        import vllm
    except ImportError:
        return f"{_PREFIX} vLLM is not installed; nothing patched"
    version = getattr(vllm, "__version__", None)
    if _release(version) not in KNOWN_VLLM_VERSIONS:
        return _Unserved(f"{_PREFIX} vLLM {version} is not a version this plugin knows "
                         f"({', '.join(KNOWN_VLLM_VERSIONS)}); nothing patched")
    cap = _capability()
    if isinstance(cap, str):
        return f"{_PREFIX} {cap}; nothing patched"
    problem = engine.capability_problem(cap)
    if problem:  # an opt-in for it was asked for and cannot be honoured: a deployment should see that
        line = f"{_PREFIX} {problem}; nothing patched"
        return _Unserved(line) if cap[0] >= 10 and env.vllm_sm100() else line
    if cap[0] == 10 and not env.vllm_sm100():
        return (f"{_PREFIX} compute capability {cap[0]}.{cap[1]}: vLLM's own fmha_sm100 path kept "
                f"({env.VLLM_SM100}=1 routes its decode through msa-jit); nothing patched")
    try:
        msa = importlib.import_module(MSA_MODULE)
        common = importlib.import_module(COMMON_MODULE)
    except ImportError as e:  # the vLLM it knows, on a GPU it serves: a broken install, not a choice
        return _Unserved(f"{_PREFIX} {MSA_MODULE} cannot be imported ({e}); nothing patched")
    applied = getattr(msa, _APPLIED, None)
    if applied:
        return f"{_PREFIX} already applied ({applied})"
    sm90 = cap[0] == 9
    missing = [n for n in REBOUND_NAMES if not hasattr(msa, n)]
    missing += [f"{COMMON_MODULE}.{SELECTOR}"] * (sm90 and not hasattr(common, SELECTOR))
    if missing:
        return _Unserved(f"{_PREFIX} vLLM {version} lacks {', '.join(missing)}; nothing patched")

    # Everything that can fail runs before the first setattr: vLLM is patched fully or not at all.
    patched = [f"{len(REBOUND_NAMES)} names of {MSA_MODULE}"]
    selector_targets: list[ModuleType] = []
    if sm90:
        original = getattr(common, SELECTOR)
        wrapped = wrap_selector(original, make_backend_cls(msa), msa.MiniMaxM3SparseMSANvfp4Backend,
                                make_impl_cls(msa, common))
        selector_targets.append(common)
        model = sys.modules.get(MODEL_MODULE)
        if model is not None and getattr(model, SELECTOR, None) is original:
            selector_targets.append(model)
        patched += [f"{m.__name__}.{SELECTOR}" for m in selector_targets]
    for name in REBOUND_NAMES:
        setattr(msa, name, getattr(engine, name))
    for module in selector_targets:
        setattr(module, SELECTOR, wrapped)
    where = f"SM{cap[0]}{cap[1]}"
    summary = (f"MiniMax-M3 decode on {where} through msa-jit (fp8 KV cache with --attention-config "
               "'{\"minimax_m3_msa_decode_backend\": \"cutlass\"}', NVFP4 always)"
               + ("" if sm90 else ", prefill stays on fmha_sm100"))
    setattr(msa, _APPLIED, summary)
    return f"{_PREFIX} {summary}; patched {'; '.join(patched)}"


def register() -> str:
    """Patch vLLM (see the module doc); returns the one line it logged (a WARNING when vLLM is
    left unpatched for a reason a deployment should see, else INFO). Never raises, but for
    KeyboardInterrupt: an import that calls sys.exit() (SystemExit) is a failure like any other."""
    try:
        line = _apply()
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - a plugin must never take vLLM down
        line = f"{_PREFIX} not applied ({type(e).__name__}: {e}); vLLM runs unchanged"
        LOG.warning(line)
        return line
    level = logging.WARNING if isinstance(line, _Unserved) else logging.INFO
    LOG.log(level, line)
    if not _logging_configured() and str(line) and getattr(sys.modules.get(MSA_MODULE), _APPLIED, None):
        _PENDING_LINE[:] = [(level, str(line))]
    return str(line)


def _logging_configured() -> bool:
    """Whether a record of LOG at INFO reaches a handler now (vLLM configures its "vllm" logger
    after its EngineArgs have loaded the plugins; until then only Python's last-resort handler,
    WARNING and above, prints)."""
    return LOG.hasHandlers()
