"""vLLM 0.33's own MiniMax-M3 attention code, unmodified, with msa_jit.integrations.vllm_plugin applied.

The real vLLM files (the vLLM 0.33.0 release's: tests/vllm_files.py) run on the stand-ins of
tests/vllm_standins.py (which names every stand-in): model.py's impl choice and construction and
its `_allocate_query_fp8` (tests/engine_cases.py, by ast), `MiniMaxM3SparseMSAMetadataBuilder.build` and
`MiniMaxM3SparseMSAImpl.forward` on a real step, fp8 and NVFP4 caches, checked against a
float64 oracle. CPU: the op's float64 reference backend (engine._device_capability reports
9.0). GPU (`-m gpu`, an SM90 device): the same code with CUDA tensors and the compiled kernel.
And the same step through that forward's other decode branch, vLLM's own Triton decode kernel
(common/ops/sparse_attn.py, run by the Triton interpreter): what the engine means by the arguments
msa-jit is given.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from types import SimpleNamespace

import pytest
import torch
import engine_cases as ec
import vllm_standins as vs

from msa_jit import SparseDecodePlan, env
from msa_jit.integrations import engine, vllm_plugin

pytestmark = pytest.mark.skipif(not vs.engine_files_present(),
                                reason=vs.ENGINE_SKIP_REASON)

LAYER = "model.layers.3.self_attn.attn"
TOL = 1e-2


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    if request.param == "cuda" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the plugin's SM90 path needs a compute capability 9.x GPU")
    return request.param


def _capability(device: str) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability()) if device == "cuda" else (9, 0)  # type: ignore[return-value]


@pytest.fixture
def vllm(monkeypatch, device):
    """Stand-ins + the real engine files, then register() as vLLM would call it."""
    for name in (env.VLLM_PLUGIN, env.VLLM_SM100, "VLLM_MINIMAX_M3_MSA_CUTLASS_MIN_BATCH"):
        monkeypatch.delenv(name, raising=False)
    if device == "cpu":
        monkeypatch.setattr(engine, "_device_capability", lambda: (9, 0))
    ns = vs.install(monkeypatch, capability=_capability(device))
    ns.line = vllm_plugin.register()
    assert "through msa-jit" in ns.line, ns.line
    return ns


def _engine_step(ns, step: ec.Step, device: str, *, decode_backend: str = "cutlass",
                 kv_cache_dtype: str | None = None, kv_cache: torch.Tensor | None = None,
                 wiring: ec.ModelWiring | None = None) -> SimpleNamespace:
    """One layer of one step as vLLM runs it: model wiring, builder.build, impl.forward.

    kv_cache_dtype: vLLM's --kv-cache-dtype, by default the step's ("fp8" or "nvfp4")."""
    hq, hkv, T = step.num_q_heads, step.num_kv_heads, step.num_tokens
    kv_cache_dtype = step.kv_dtype if kv_cache_dtype is None else kv_cache_dtype
    cfg = ec.vllm_config(num_q_heads=hq, decode_backend=decode_backend, kv_cache_dtype=kv_cache_dtype,
                         decode_qlen=step.decode_qlen)
    ns.config.vllm_config = cfg
    wiring = wiring or ec.ModelWiring.parse()
    attn = wiring.layer_namespace(num_heads=hq, num_kv_heads=hkv, kv_cache_dtype=kv_cache_dtype)
    backend, impl_cls = wiring.select(ns.common.select_main_backend_and_impl_cls, attn, cfg)
    impl = wiring.make_impl(impl_cls, attn, cfg)
    attn.impl = impl
    spec = SimpleNamespace(num_kv_heads=hkv, block_size=ec.PAGE)
    builder = backend.get_builder_cls()(spec, [LAYER], cfg, torch.device(device))
    cm = vs.CommonAttentionMetadata(
        query_start_loc=step.query_start_loc, query_start_loc_cpu=step.query_start_loc_cpu,
        seq_lens=step.seq_lens, num_reqs=len(step.query_lens), num_actual_tokens=T,
        max_query_len=max(step.query_lens), max_seq_len=max(step.seq_lens_list),
        block_table_tensor=step.block_table,
        slot_mapping=torch.zeros(T, dtype=torch.int64, device=device),
        seq_lens_cpu_upper_bound=step.seq_lens_cpu,
    )
    md = builder.build(0, cm)
    ns.forward_context.attn_metadata = {LAYER: md}
    # vLLM's Attention layer keeps the scales twice: floats and 0-dim float32 device tensors
    # (the NVFP4 path reads the tensors)
    layer = SimpleNamespace(
        layer_name=LAYER, topk_indices_buffer=step.topk_buffer, _q_scale_float=step.q_scale,
        _k_scale_float=step.k_scale, _v_scale_float=step.v_scale,
        _k_scale=torch.tensor(step.k_scale, dtype=torch.float32, device=device),
        _v_scale=torch.tensor(step.v_scale, dtype=torch.float32, device=device),
    )
    # The model's buffers: T + 2 rows (padding past num_actual_tokens must stay untouched).
    rows = T + 2
    qkv = torch.empty(rows, 1, device=device)
    query_fp8 = wiring.allocate_query_fp8(attn, qkv)
    query = torch.full((rows, hq * ec.D), float("nan"), dtype=torch.bfloat16, device=device)
    if query_fp8 is not None:  # the fused insert then writes only the fp8 query
        query_fp8.zero_()
        query_fp8[:T] = step.query_fp8
    else:
        query[:T] = step.query_bf16
    output = torch.full((rows, hq * ec.D), float("nan"), dtype=torch.bfloat16, device=device)
    ret = impl.forward(layer, query, step.kv_u8 if kv_cache is None else kv_cache, output,
                       query_fp8=query_fp8)
    assert ret is output
    return SimpleNamespace(backend=backend, impl=impl, builder=builder, md=md, output=output,
                           query=query, query_fp8=query_fp8, layer=layer)


def _check_output(step: ec.Step, output: torch.Tensor) -> float:
    T = step.num_tokens
    err = ec.relative_error(output[:T].view(T, step.num_q_heads, ec.D), step.expected())
    assert err < TOL, err
    assert torch.isnan(output[T:]).all(), "rows past num_actual_tokens were written"
    return err


@pytest.mark.parametrize("num_decodes,qlen,hq,hkv", [(3, 1, 16, 1), (2, 3, 32, 2), (5, 1, 64, 4)])
def test_decode_step_runs_msa_jit_inside_the_engine(vllm, device, num_decodes, qlen, hq, hkv):
    step = ec.make_step(num_decodes=num_decodes, decode_qlen=qlen, prefills=[], num_q_heads=hq,
                        num_kv_heads=hkv, seed=100 + num_decodes * qlen, device=device)
    r = _engine_step(vllm, step, device)
    assert issubclass(r.backend, vllm.msa.MiniMaxM3SparseMSABackend)
    assert r.backend.supported_kv_cache_layouts() == (vs.KVCacheLayout.LBHNC,)
    assert isinstance(r.impl, vllm.msa.MiniMaxM3SparseMSAImpl) and r.impl.use_cutlass_decode
    assert r.query_fp8 is not None and r.query_fp8.dtype == torch.float8_e4m3fn
    assert torch.isnan(r.query).all(), "the bf16 query must not be needed for decode"
    d = r.md.decode
    assert isinstance(d, vllm.msa.MiniMaxM3SparseMSADecodeMetadata)
    assert isinstance(d.msa_cutlass, engine.MSACutlassDecodeMetadata)  # batch < 16: no floor
    assert isinstance(d.msa_cutlass.plan, SparseDecodePlan)
    assert d.msa_cutlass.plan.batch == num_decodes and d.msa_cutlass.plan.qlen == qlen
    assert r.builder.msa_cutlass_plan_cache.plans, "the builder's own plan cache holds the plan"
    _check_output(step, r.output)
    assert not vllm.kernels.prefill_calls


def test_engine_batch_floor_env_is_honoured(vllm, device, monkeypatch):
    monkeypatch.setenv("VLLM_MINIMAX_M3_MSA_CUTLASS_MIN_BATCH", "16")
    step = ec.make_step(num_decodes=3, decode_qlen=1, prefills=[], num_q_heads=16, num_kv_heads=1,
                        seed=7, device=device)
    with pytest.raises(AssertionError, match="Triton decode ran"):  # 3 < 16: the engine's fallback
        _engine_step(vllm, step, device)


def _triton_prefill_hook(step: ec.Step):
    """The Triton prefill stand-in's answer, from the arguments the impl passed."""

    def hook(call):
        q, cu, ctx = call["q"], call["cu_seqlens_q"].cpu().tolist(), call["prefix_lens"].cpu().tolist()
        rows, pos = [], []
        for r in range(len(cu) - 1):
            for j in range(cu[r + 1] - cu[r]):
                rows.append(r)
                pos.append(ctx[r] + j)
        assert q.dtype == torch.bfloat16 and call["kv_cache"].dtype == torch.float8_e4m3fn
        ref = ec.oracle(q, call["kv_cache"], call["topk_idx"].transpose(0, 1), call["block_table"],
                        rows, pos, sm_scale=call["sm_scale"], q_scale=1.0,
                        k_scale=float(call["k_scale"]), v_scale=float(call["v_scale"]))
        call["output"].copy_(ref.to(torch.bfloat16))

    return hook


def test_mixed_step_prefill_through_the_engines_triton_prefill(vllm, device):
    step = ec.make_step(num_decodes=2, decode_qlen=1, prefills=[(0, 5), (300, 9)], num_q_heads=16,
                        num_kv_heads=1, seed=21, device=device)
    vllm.kernels.prefill_hook = _triton_prefill_hook(step)
    r = _engine_step(vllm, step, device)
    (call,) = vllm.kernels.prefill_calls
    nd = step.num_decodes
    assert call["topk_idx"].shape == (1, step.num_tokens - nd, 16)
    # the prefill query is the fp8 one dequantized (the fused insert wrote nothing else)
    torch.testing.assert_close(call["q"].float().cpu(), step.query_bf16[nd:].view(-1, 16, ec.D).float().cpu(),
                               rtol=1e-2, atol=1e-2)
    _check_output(step, r.output)
    assert vllm.forward_context.attn_metadata[LAYER] is r.md, "the decode-only view was not restored"


@pytest.mark.parametrize("hq,hkv", [(16, 1), (64, 4)])
def test_mixed_step_prefill_through_msa_jit(vllm, device, monkeypatch, hq, hkv):
    """The NVFP4 prefill path (msa_sparse_prefill), on an fp8 cache: full chunks and a padded
    last one (on the GPU the real chunk of 256 tokens, on a CPU 16 to keep the reference quick)."""
    if device == "cpu":
        monkeypatch.setattr(vllm_plugin.MsaJitPrefillMixin, "prefill_chunk_tokens", 16)
        prefills = [(0, 20), (1000, 6), (5, 11)]  # 37 tokens: 16 + 16 + 5
    else:
        prefills = [(0, 200), (1000, 60), (5, 40)]  # 300 tokens: 256 + 44
    step = ec.make_step(num_decodes=3, decode_qlen=1, prefills=prefills, num_q_heads=hq,
                        num_kv_heads=hkv, seed=22 + hq, device=device)
    monkeypatch.setattr(vllm_plugin.MsaJitPrefillMixin, "fp8_prefill", "msa_jit")
    r = _engine_step(vllm, step, device)
    assert not vllm.kernels.prefill_calls
    _check_output(step, r.output)


def test_prefill_only_step(vllm, device, monkeypatch):
    step = ec.make_step(num_decodes=0, decode_qlen=1, prefills=[(130, 7)], num_q_heads=16,
                        num_kv_heads=1, seed=23, device=device)
    monkeypatch.setattr(vllm_plugin.MsaJitPrefillMixin, "fp8_prefill", "msa_jit")
    r = _engine_step(vllm, step, device)
    assert r.md.decode is None
    _check_output(step, r.output)


@pytest.mark.parametrize("kv_cache_dtype,decode_backend", [("auto", "cutlass"), ("fp8", "triton"),
                                                           ("fp8_e5m2", "cutlass")])
def test_other_configs_keep_the_engines_choice(vllm, device, kv_cache_dtype, decode_backend):
    cfg = ec.vllm_config(num_q_heads=16, decode_backend=decode_backend, kv_cache_dtype=kv_cache_dtype)
    vllm.config.vllm_config = cfg
    wiring = ec.ModelWiring.parse()
    attn = wiring.layer_namespace(num_heads=16, num_kv_heads=1, kv_cache_dtype=kv_cache_dtype)
    backend, impl_cls = wiring.select(vllm.common.select_main_backend_and_impl_cls, attn, cfg)
    assert (backend, impl_cls) == (vllm.common.MiniMaxM3SparseBackend, vllm.common.MiniMaxM3SparseTritonImpl)
    attn.impl = wiring.make_impl(impl_cls, attn, cfg)
    assert wiring.allocate_query_fp8(attn, torch.empty(4, 1, device=device)) is None


def test_without_the_plugin_the_engine_refuses_hopper(monkeypatch, device):
    """What register() changes: on SM90 the unpatched engine picks Triton and refuses NVFP4."""
    ns = vs.install(monkeypatch, capability=_capability(device))
    ns.config.vllm_config = ec.vllm_config(num_q_heads=16, decode_backend="cutlass", kv_cache_dtype="fp8")
    sel = ns.common.select_main_backend_and_impl_cls
    assert sel(topk_blocks=16, kv_cache_dtype="fp8", num_kv_heads=1)[1] is ns.common.MiniMaxM3SparseTritonImpl
    with pytest.raises(ValueError, match="NVFP4 KV cache only with the SM100 MSA backend"):
        sel(topk_blocks=16, kv_cache_dtype="nvfp4", num_kv_heads=1)



def test_every_stand_in_is_named(monkeypatch):
    """The issue asks the test to say which names are stand-ins: vllm_standins' docstring lists
    them. Every module install() adds that is not a real engine file, and every name it holds,
    must appear there (a stand-in added later cannot go unlisted)."""
    vs.install(monkeypatch)
    doc = vs.__doc__ or ""
    listed = {line.split()[0] for line in doc.splitlines() if line.startswith("    vllm")}
    unlisted = []
    for name, module in sorted(sys.modules.items()):
        if not (name == "vllm" or name.startswith("vllm.")) or name in vs.REAL_FILES:
            continue
        names = [a for a in vars(module) if not a.startswith("__")]
        if names and not any(t == name or t.startswith(f"{name}.") for t in listed):
            unlisted.append(name)
        unlisted += [f"{name}.{a}" for a in names if a not in doc]
    assert unlisted == [], f"stand-ins not named in tests/vllm_standins.py's docstring: {unlisted}"


# (num_decodes, qlen, prefills on a CPU, prefills on the GPU, Hq, Hkv): on the GPU the prefill
# fills the real 256-token chunk and a padded last one; on a CPU chunks of 16 keep it quick.
NVFP4_STEPS = {
    "decode": (3, 1, [], [], 16, 1),
    "decode-qlen3": (2, 3, [], [], 32, 2),
    "mixed": (2, 1, [(0, 6), (300, 13)], [(0, 200), (3000, 70)], 16, 1),
    "mixed-qlen2": (3, 2, [(1000, 20), (5, 11)], [(1000, 260), (5, 11)], 64, 4),
    "prefill-only": (0, 1, [(130, 7)], [(130, 300)], 16, 1),
}


@pytest.mark.parametrize("name", sorted(NVFP4_STEPS))
def test_nvfp4_step_runs_msa_jit_inside_the_engine(vllm, device, monkeypatch, name):
    """NVFP4 on SM90, for real: the engine's builder plans and its impl decodes through msa-jit
    (no batch floor, no Triton fallback), prefill tokens through msa_sparse_prefill, both on
    the NVFP4 cache with the layer's 0-dim global-scale tensors; output vs the float64 oracle
    on the dequantized cache. On the GPU the compiled NVFP4 kernel serves every plan."""
    num_decodes, qlen, cpu_prefills, gpu_prefills, hq, hkv = NVFP4_STEPS[name]
    if device == "cpu":
        monkeypatch.setattr(vllm_plugin.MsaJitPrefillMixin, "prefill_chunk_tokens", 16)
    prefill_cache = engine.MSACutlassDecodePlanCache()  # msa_sparse_prefill's plans, to inspect them
    monkeypatch.setattr(engine, "_DEFAULT_CACHE", prefill_cache)
    step = ec.make_step(num_decodes=num_decodes, decode_qlen=qlen, num_q_heads=hq, num_kv_heads=hkv,
                        prefills=cpu_prefills if device == "cpu" else gpu_prefills,
                        seed=31 + num_decodes * qlen + hq, device=device, kv_dtype="nvfp4")
    assert step.kv_u8.shape == (step.kv_u8.shape[0], 2 * hkv, ec.PAGE, 72)
    r = _engine_step(vllm, step, device, decode_backend="triton")  # NVFP4 needs no opt-in
    assert r.backend is vllm.msa.MiniMaxM3SparseMSANvfp4Backend
    assert isinstance(r.impl, vllm_plugin.MsaJitPrefillMixin)
    assert r.impl.use_nvfp4_kv and r.impl.use_cutlass_decode
    assert r.query_fp8 is not None and torch.isnan(r.query).all(), "NVFP4 reads only the fp8 query"
    assert r.layer._k_scale.dim() == 0 and r.layer._k_scale.dtype == torch.float32
    plans = list(prefill_cache.plans.values())
    assert bool(plans) == bool(step.num_tokens > num_decodes * qlen), "prefill ran through msa-jit"
    if num_decodes:
        d = r.md.decode.msa_cutlass
        assert isinstance(d, engine.MSACutlassDecodeMetadata)
        assert (d.plan.batch, d.plan.qlen) == (num_decodes, qlen)
        plans.append(d.plan)
    else:
        assert r.md.decode is None
    for plan in plans:  # a CPU plan runs the reference (no kernel); a GPU plan the NVFP4 kernel
        assert list(plan.kernels) == ([] if device == "cpu" else [(torch.float8_e4m3fn, "nvfp4")])
    _check_output(step, r.output)
    assert not vllm.kernels.prefill_calls, "the engine's Triton prefill cannot read NVFP4"


def test_nvfp4_backend_and_query(vllm, device):
    cfg = ec.vllm_config(num_q_heads=16, decode_backend="triton", kv_cache_dtype="nvfp4")
    vllm.config.vllm_config = cfg
    wiring = ec.ModelWiring.parse()
    attn = wiring.layer_namespace(num_heads=16, num_kv_heads=1, kv_cache_dtype="nvfp4")
    backend, impl_cls = wiring.select(vllm.common.select_main_backend_and_impl_cls, attn, cfg)
    assert backend is vllm.msa.MiniMaxM3SparseMSANvfp4Backend
    attn.impl = wiring.make_impl(impl_cls, attn, cfg)
    assert attn.impl.use_nvfp4_kv and attn.impl.use_cutlass_decode
    q = wiring.allocate_query_fp8(attn, torch.empty(4, 1, device=device))
    assert q is not None and q.shape == (4, 16 * ec.D)
    assert math.isclose(attn.impl.scale, ec.D ** -0.5)


def test_nvfp4_slots_are_the_engines_own(monkeypatch):
    """msa_jit's NVFP4 K / V slot views against vLLM's real `nvfp4_kv_cache_slots` (its file, not a
    restatement): same values, same strides, same storage."""
    from msa_jit.nvfp4 import nvfp4_kv_cache_slots

    ns = vs.install(monkeypatch)
    kv = torch.arange(3 * 6 * 4 * 72, dtype=torch.int64).to(torch.uint8).reshape(3, 6, 4, 72)
    for cache in (kv, torch.zeros(3, 6 * 4 * 72 + 40, dtype=torch.uint8)[:, :6 * 4 * 72].view(3, 6, 4, 72)):
        for want, got in zip(ns.engine_msa.nvfp4_kv_cache_slots(cache), nvfp4_kv_cache_slots(cache)):
            assert torch.equal(want, got) and want.stride() == got.stride() and want.data_ptr() == got.data_ptr()


# ----------------------------------------------------------------------------- vLLM's own Triton decode
# (num_decodes, qlen, Hq, Hkv, decode seq_lens): shorter and longer than the 16 selected blocks, a
# request whose new token opens a block, speculative steps whose tokens see different block counts
TRITON_PARITY_STEPS = {
    "qlen1-64/4": (4, 1, 64, 4, [18, 300, 2049, 4097]),
    "qlen3-32/2": (2, 3, 32, 2, [129, 2300]),
}


@pytest.fixture
def vllm_triton(monkeypatch):
    """`vllm` on a CPU, with vLLM's own Triton kernels (their file, interpreted) in place of the
    stand-ins."""
    for name in (env.VLLM_PLUGIN, env.VLLM_SM100, "VLLM_MINIMAX_M3_MSA_CUTLASS_MIN_BATCH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(engine, "_device_capability", lambda: (9, 0))
    ns = vs.install(monkeypatch, capability=(9, 0), triton_kernels=True)
    ns.line = vllm_plugin.register()
    assert "through msa-jit" in ns.line, ns.line
    return ns


def _roughen_topk(step: ec.Step, seed: int) -> None:
    """Top-k rows as the engine may also hand them over, in place: within the slots that count
    (s < nvalid = min(K, ceil(kv_len / 128))) some blocks replaced by -1 or by blocks past the
    token's causal range (the current block kept: the indexer always selects it); the slots past
    nvalid filled with visible blocks, which neither side may read. No block twice in the slots
    that count (the engine's indexer never repeats one)."""
    gen = torch.Generator().manual_seed(seed)
    buf = step.topk_buffer
    K = buf.shape[-1]
    rows, pos = step.token_rows_and_pos()
    for t, p in enumerate(pos):
        kv_len = p + 1
        nvis = -(-kv_len // ec.PAGE)
        nvalid = min(K, nvis)
        cur = (kv_len - 1) // ec.PAGE
        for h in range(buf.shape[1]):
            row = buf[t, h]
            for s in range(nvalid):
                if int(row[s]) != cur and torch.rand((), generator=gen) < 0.3:
                    row[s] = -1 if torch.rand((), generator=gen) < 0.5 else \
                        int(torch.randint(nvis, nvis + 40, (), generator=gen))
            row[nvalid:] = torch.randint(0, nvis, (K - nvalid,), generator=gen, dtype=torch.int32)


# numpy's IEEE warnings inside the interpreter (log2(0), -inf - -inf: the kernel's empty chunks), which
# a GPU computes silently
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning",
                            "ignore:invalid value encountered in subtract:RuntimeWarning")
@pytest.mark.parametrize("name", sorted(TRITON_PARITY_STEPS))
def test_decode_means_what_the_engines_triton_decode_means(vllm_triton, monkeypatch, name):
    """One decode step through vLLM's MiniMaxM3SparseMSAImpl.forward twice, on the same fp8 query,
    cache, top-k buffer, block table, seq_lens and layer scales: planned (msa-jit's decode) and
    unplanned (the engine's batch floor set above the batch), where that forward dequantizes the
    query (`_dequantize_query`) and runs vLLM's own Triton split-K decode (its file, interpreted),
    handing it the top-k transposed and the scales as the layer's tensors. msa-jit's answer is the
    engine's: per token within 1e-2 of it and of the float64 oracle (measured: 3.3e-3 and 1.7e-3;
    the engine's kernel is within 2.9e-3 of the oracle). Scales exact in bfloat16 after the fp8
    product, so that Triton's bfloat16 rounding of q, K and V does not blur the comparison."""
    num_decodes, qlen, hq, hkv, seq_lens = TRITON_PARITY_STEPS[name]
    step = ec.make_step(num_decodes=num_decodes, decode_qlen=qlen, prefills=[], num_q_heads=hq,
                        num_kv_heads=hkv, seed=40 + qlen, decode_seq_lens=seq_lens)
    step = dataclasses.replace(step, q_scale=0.5, k_scale=1.25, v_scale=0.75)
    _roughen_topk(step, seed=qlen)
    ours = _engine_step(vllm_triton, step, "cpu")
    assert isinstance(ours.md.decode.msa_cutlass, engine.MSACutlassDecodeMetadata)
    monkeypatch.setenv("VLLM_MINIMAX_M3_MSA_CUTLASS_MIN_BATCH", str(num_decodes + 1))
    theirs = _engine_step(vllm_triton, step, "cpu")
    assert theirs.md.decode.msa_cutlass is None, "the engine's Triton branch was not taken"
    T = step.num_tokens
    want = step.expected()

    def worst(out: torch.Tensor, ref: torch.Tensor) -> float:
        diff = out[:T].view(T, hq, ec.D).double() - ref
        return float((diff.flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).max())

    triton_out = theirs.output[:T].view(T, hq, ec.D).double()
    assert worst(theirs.output, want) < TOL, "the engine's Triton decode vs the oracle"
    assert worst(ours.output, want) < TOL, "msa-jit vs the oracle"
    assert worst(ours.output, triton_out) < TOL, "msa-jit vs the engine's Triton decode"
