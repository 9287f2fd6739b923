"""The custom op `torch.ops.msa_jit.sparse_decode`: opcheck, torch.compile(fullgraph) vs eager."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import FP8, Case, make_case

import msa_jit
from msa_jit import SparseDecodePlanner, sparse_decode_reference
from msa_jit.testing import compare_with_reference
from msa_jit.integrations.torch_op import WORKSPACE_FIELDS, op_args, sparse_decode_op

OP = torch.ops.msa_jit.sparse_decode.default


def _case(q_dtype: torch.dtype, seed: int, device: str = "cpu", **kw) -> Case:
    kw.setdefault("batch", 2)
    kw.setdefault("qlen", 2)
    b, q = kw.pop("batch"), kw.pop("qlen")
    return make_case(b, q, 16, 1, q_dtype=q_dtype, seed=seed, device=device, **kw)


def _plan(c: Case, planner: SparseDecodePlanner | None = None) -> msa_jit.SparseDecodePlan:
    return (planner or SparseDecodePlanner()).prepare(*c.prepare_args(), **c.prepare_kwargs())


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30))


def test_schema_declares_every_write():
    args = {a.name: a for a in OP._schema.arguments}
    for name in ("out", "lse", "workspace"):
        assert args[name].alias_info is not None and args[name].alias_info.is_write, name
    for name in ("query", "kv_cache", "topk", "block_table", "seq_lens", "kv_lens"):
        assert args[name].alias_info is None, name
    assert OP._schema.returns == []
    assert "partial_o" in WORKSPACE_FIELDS and "partial_lse" in WORKSPACE_FIELDS


@pytest.mark.parametrize("with_lse", [True, False])
def test_op_matches_eager_api_and_reference(with_lse):
    c = _case(FP8, seed=3)
    plan = _plan(c)
    out, lse = c.new_out(), (c.new_lse() if with_lse else None)
    sparse_decode_op(c.query, c.kv_cache, c.topk, out, plan, lse=lse, backend="reference", **c.scales())
    out_e, lse_e = c.new_out(), c.new_lse()
    msa_jit.sparse_decode(c.query, c.kv_cache, c.topk, out_e, plan, lse=lse_e,
                          backend="reference", **c.scales())
    assert torch.equal(out, out_e)
    if with_lse:
        assert torch.equal(lse, lse_e)
    o64, _ = sparse_decode_reference(*c.reference_args(), **c.scales())
    assert _rel(out, o64) < 1e-2


def test_op_validates_like_the_api():
    c = _case(torch.bfloat16, seed=4)
    plan = _plan(c)
    with pytest.raises(ValueError, match="^query: "):
        sparse_decode_op(c.query[:-1], c.kv_cache, c.topk, c.new_out()[:-1], plan, **c.scales())
    with pytest.raises(ValueError, match="^sm_scale: "):
        sparse_decode_op(c.query, c.kv_cache, c.topk, c.new_out(), plan, sm_scale=-1.0)


def test_opcheck_reference_cpu():
    # fp8 tensors cannot go through opcheck's schema check on CPU (allclose has no fp8 CPU
    # kernel): query bf16, kv_cache as its uint8 storage (which the contract allows).
    c = _case(torch.bfloat16, seed=5)
    plan = _plan(c)
    args = op_args(c.query, c.kv_cache.view(torch.uint8), c.topk, c.new_out(), plan,
                   lse=c.new_lse(), backend="reference", **c.scales())
    torch.library.opcheck(OP, args)


def test_opcheck_reference_cpu_fp8_query():
    c = _case(FP8, seed=9, transposed_topk=True)
    plan = _plan(c)
    args = op_args(c.query, c.kv_cache, c.topk, c.new_out(), plan, backend="reference", **c.scales())
    torch.library.opcheck(OP, args, test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def _step(q, kv, tk, o, plan, lse, scales):
    sparse_decode_op(q, kv, tk, o, plan, lse=lse, backend="reference", **scales)
    return o.float().sum(dim=-1) + lse  # something downstream of both writes


def test_compile_fullgraph_matches_eager_cpu():
    c = _case(FP8, seed=6, transposed_topk=True, padded=True)
    plan = _plan(c)
    scales = c.scales()
    out_e, lse_e = c.new_out(), c.new_lse()
    res_e = _step(c.query, c.kv_cache, c.topk, out_e, plan, lse_e, scales)

    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True, backend="aot_eager")
    out_c, lse_c = c.new_out(), c.new_lse()
    res_c = compiled(c.query, c.kv_cache, c.topk, out_c, plan, lse_c, scales)
    assert torch.equal(out_c, out_e) and torch.equal(lse_c, lse_e)
    assert torch.equal(res_c, res_e)

    # a second plan of the same shape reuses the graph (plan tensors are graph inputs)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    plan2 = _plan(c)
    out_2 = c.new_out()
    compiled(c.query, c.kv_cache, c.topk, out_2, plan2, c.new_lse(), scales)
    assert torch.equal(out_2, out_e)
    assert counters["stats"]["unique_graphs"] == graphs



def _fake_kernel_path(monkeypatch, launches: list | None = None) -> list[tuple[str, object]]:
    """The kernel path on CPU, infrastructure faked, op code real: rebuilt plans get arch sm_90a (as a
    CUDA device would give them), validation (run in full for the reference backend) answers
    "kernel", and the resolver `compiler.get_sparse_decode_kernel` returns a stand-in kernel that
    records the config it was built for. Returns the list of ("asked" | "launched", config); each
    launch's (config, arguments) also goes to `launches` when given."""
    from msa_jit.jit import compiler
    from msa_jit import op
    from msa_jit.integrations import torch_op

    events: list[tuple[str, object]] = []

    def resolve(cfg):
        events.append(("asked", cfg))

        def launch(*args):
            events.append(("launched", cfg))
            if launches is not None:
                launches.append((cfg, args))
        return launch

    real_validate = op.validate_sparse_decode
    monkeypatch.setattr(compiler, "get_sparse_decode_kernel", resolve)
    monkeypatch.setattr(torch_op, "_arch_of", lambda device: "sm_90a")
    monkeypatch.setattr(torch_op, "_KERNELS", {})
    monkeypatch.setattr(op, "validate_sparse_decode", lambda *a: ("kernel", real_validate(*a[:-1], "reference")[1]))
    return events


@pytest.mark.parametrize("planner_kw,ctas", [
    # the planner's choice without the cluster merge (with it: one wave of 4 splits at 2 per SM): 8 splits,
    # 32 CTAs, more than one per SM and one wave at 3
    (dict(num_sms=16, split_merge="kernel"), 3),
    (dict(num_sms=16, ctas_per_sm=2), 2),  # pinned against the choice
    (dict(ctas_per_sm=3), 3),  # pinned where the planner would choose 2 (64 CTAs on 132 SMs)
])
def test_op_and_compiled_op_launch_the_plans_build(monkeypatch, planner_kw, ctas):
    """The op (eager and under torch.compile) launches the occupancy build the plan names, like the
    eager API: the plan's ctas_per_sm crosses the op boundary and keys the op's kernel cache."""
    events = _fake_kernel_path(monkeypatch)
    c = _case(torch.bfloat16, seed=11)
    plan = _plan(c, SparseDecodePlanner(arch="sm_90a", **planner_kw))
    assert plan.launch().ctas_per_sm == ctas
    want = plan.config(torch.bfloat16)
    other = _plan(c, SparseDecodePlanner(arch="sm_90a", ctas_per_sm=5 - ctas))  # same geometry, other build

    msa_jit.sparse_decode(c.query, c.kv_cache, c.topk, c.new_out(), plan, backend="kernel", **c.scales())
    assert events == [("asked", want), ("launched", want)]
    events.clear()
    sparse_decode_op(c.query, c.kv_cache, c.topk, c.new_out(), other, backend="kernel", **c.scales())
    sparse_decode_op(c.query, c.kv_cache, c.topk, c.new_out(), plan, backend="kernel", **c.scales())
    other_cfg = other.config(torch.bfloat16)
    assert other_cfg.ctas_per_sm != want.ctas_per_sm
    assert events == [("asked", other_cfg), ("launched", other_cfg), ("asked", want), ("launched", want)]
    events.clear()

    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, kv, tk, o: sparse_decode_op(q, kv, tk, o, plan, backend="kernel", **c.scales()),
        fullgraph=True, backend="aot_eager",
    )
    compiled(c.query, c.kv_cache, c.topk, c.new_out())
    assert events == [("launched", want)]  # the op's cached build of this plan's config

@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4"])
def test_op_launches_the_cache_formats_build_with_its_split_count(monkeypatch, kv_dtype):
    """Through the custom op, a step's cache format picks its own build and split count: on 132 SMs a
    64/4 step at B=12 splits fp8 in 2 and NVFP4 in 6, and at B=128 runs fp8 at 2 CTAs per SM and NVFP4 at
    3, so a swap of the two formats' ints anywhere between the plan and the launch shows."""
    from msa_jit.kernels import convention

    num_splits_at = convention.ARGUMENT_NAMES.index("num_splits")
    launches: list = []
    _fake_kernel_path(monkeypatch, launches)
    fmt = "nvfp4" if kv_dtype == "nvfp4" else "float8_e4m3fn"
    planner = SparseDecodePlanner(num_sms=132, arch="sm_90a")
    plans = []
    for batch in (12, 128):  # 3 pages a request: the same plans as random longer contexts, a smaller cache
        c = make_case(batch, 1, 64, 4, q_dtype=torch.bfloat16, seed=batch, kv_dtype=kv_dtype, page_size=64,
                      ctx_lens=[3 * 64] * batch)
        plan = _plan(c, planner)
        plans.append(plan)
        launches.clear()
        sparse_decode_op(c.query, c.kv_cache, c.topk, c.new_out(), plan, backend="kernel", **c.scales())
        ((cfg, args),) = launches
        assert cfg == plan.config(torch.bfloat16, fmt) and args[num_splits_at] == plan.launch(fmt).num_splits
    assert plans[0].launch().num_splits != plans[0].launch("nvfp4").num_splits
    assert plans[1].launch().ctas_per_sm != plans[1].launch("nvfp4").ctas_per_sm


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, FP8])
def test_opcheck_kernel_gpu(q_dtype):
    c = _case(q_dtype, seed=7, device="cuda", batch=3, qlen=2)
    plan = _plan(c)
    args = op_args(c.query, c.kv_cache.view(torch.uint8), c.topk, c.new_out(), plan,
                   lse=c.new_lse(), backend="kernel", **c.scales())
    # the schema check compares fp8 tensors with allclose, which has no fp8 kernel
    tests = ["test_faketensor", "test_aot_dispatch_dynamic"]
    if q_dtype == torch.bfloat16:
        tests += ["test_schema", "test_autograd_registration"]
    torch.library.opcheck(OP, args, test_utils=tests)


@pytest.mark.gpu
def test_compile_inductor_and_cuda_graph_gpu():
    c = _case(FP8, seed=8, device="cuda", batch=4, qlen=2, padded=True)
    planner = SparseDecodePlanner()
    scales = c.scales()

    def step(q, kv, tk, o, lse):
        plan = planner.prepare(*c.prepare_args(), **c.prepare_kwargs())
        sparse_decode_op(q, kv, tk, o, plan, lse=lse, backend="kernel", **scales)

    out_e, lse_e = c.new_out(), c.new_lse()
    step(c.query, c.kv_cache, c.topk, out_e, lse_e)
    assert compare_with_reference(c, out_e, lse_e)[1] == []  # out and lse fully written, both right
    o64, _ = sparse_decode_reference(*c.reference_args(), **scales)
    assert _rel(out_e, o64) < 1e-2

    plan = _plan(c, planner)
    compiled = torch.compile(
        lambda q, kv, tk, o, lse: sparse_decode_op(q, kv, tk, o, plan, lse=lse, backend="kernel", **scales),
        fullgraph=True,
    )
    out_c, lse_c = c.new_out(), c.new_lse()
    compiled(c.query, c.kv_cache, c.topk, out_c, lse_c)
    torch.cuda.synchronize()
    assert _rel(out_c, o64) < 1e-2
    torch.testing.assert_close(out_c, out_e, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(lse_c, lse_e, rtol=1e-5, atol=1e-5)  # -inf rows compare equal; NaN would not

    out_g, lse_g = c.new_out(), c.new_lse()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(c.query, c.kv_cache, c.topk, out_g, lse_g)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(c.query, c.kv_cache, c.topk, out_g, lse_g)
    out_g.fill_(float("nan"))
    lse_g.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out_g, o64) < 1e-2
    torch.testing.assert_close(out_g, out_e, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(lse_g, lse_e, rtol=1e-5, atol=1e-5)  # the replay writes the caller's lse


@pytest.mark.gpu
def test_compiled_op_runs_the_eager_build_gpu(monkeypatch):
    """Under torch.compile(fullgraph=True) the op runs the artifact the eager API runs, for a step
    shape where the planner picks the 3-CTA-per-SM build (T*Hkv = 2 CTAs per SM, one split)."""
    from msa_jit.jit import compiler
    from msa_jit.integrations import torch_op

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    hkv = 4
    c = make_case(2 * num_sms // hkv, 1, 64, hkv, q_dtype=torch.bfloat16, seed=12, device="cuda")
    plan = _plan(c, SparseDecodePlanner())
    assert plan.launch().ctas_per_sm == 3 and plan.launch().num_splits == 1
    asked = []
    real = compiler.get_sparse_decode_kernel
    monkeypatch.setattr(compiler, "get_sparse_decode_kernel", lambda cfg: asked.append(cfg) or real(cfg))
    monkeypatch.setattr(torch_op, "_KERNELS", {})  # the op resolves its kernel afresh
    scales = c.scales()

    out_e, lse_e = c.new_out(), c.new_lse()
    msa_jit.sparse_decode(c.query, c.kv_cache, c.topk, out_e, plan, lse=lse_e, backend="kernel", **scales)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, kv, tk, o, lse: sparse_decode_op(q, kv, tk, o, plan, lse=lse, backend="kernel", **scales),
        fullgraph=True,
    )
    out_c, lse_c = c.new_out(), c.new_lse()
    compiled(c.query, c.kv_cache, c.topk, out_c, lse_c)
    torch.cuda.synchronize()
    want = plan.config(torch.bfloat16)
    assert want.ctas_per_sm == 3 and asked == [want, want]  # eager, then the op: the same config
    # one build gives the same bits on every run (no atomics)
    assert torch.equal(out_c, out_e) and torch.equal(lse_c, lse_e)
    o64, _ = sparse_decode_reference(*c.reference_args(), **scales)
    assert _rel(out_c, o64) < 1e-2


@pytest.mark.parametrize("plan", [None, "metadata"])
def test_a_wrong_plan_type_is_named(plan):
    """Not an AttributeError from reading the plan's tensors: the op's TypeError naming `plan`."""
    c = make_case(1, 1, 16, 1, q_dtype=FP8, seed=71)
    out = c.new_out()
    with pytest.raises(TypeError, match=r"^plan: expected a SparseDecodePlan"):
        sparse_decode_op(c.query, c.kv_cache, c.topk, out, plan, sm_scale=c.sm_scale)
    assert torch.isnan(out).all()


def test_rebuilt_plans_share_kernels_only_within_a_split_count(monkeypatch):
    """The op's rebuilt plans share resolved kernels per build, and per split count: a cluster build is
    kept only where the GPU holds a cluster of the plan's splits (plan.resolve_kernel), so a 16-split
    plan must not reuse what a 2-split plan of the same build resolved (fp8, 64/4: B=12 takes 2 splits
    merged in the cluster on 132 SMs, B=1 16; the build pinned, so both plans name the same one)."""
    from msa_jit.integrations import torch_op

    monkeypatch.setattr(torch_op, "_KERNELS", {})
    planner = SparseDecodePlanner(num_sms=132, arch="sm_90a", ctas_per_sm=2, split_merge="cluster")
    rebuilt, plans = [], []
    for batch in (12, 1, 1):
        c = make_case(batch, 1, 64, 4, q_dtype=torch.bfloat16, seed=batch)
        plan = _plan(c, planner)
        plans.append(plan)
        args = op_args(c.query, c.kv_cache, c.topk, c.new_out(), plan, sm_scale=0.1)
        ints = dict(num_q_heads=plan.num_q_heads, num_kv_heads=plan.num_kv_heads, page_size=plan.page_size,
                    topk_blocks=plan.topk_blocks, qlen=plan.qlen, kv_format="float8_e4m3fn", launch=plan.launch())
        rebuilt.append(torch_op._rebuild_plan(args[5], args[6], args[7], args[8], args[4], args[9], ints))
    assert [p.launch().num_splits for p in rebuilt] == [2, 16, 16]
    assert all(p.config(torch.bfloat16) == plans[0].config(torch.bfloat16) for p in plans)  # one build
    assert rebuilt[0].kernels is not rebuilt[1].kernels  # same build, other split count
    assert rebuilt[1].kernels is rebuilt[2].kernels  # same build and split count: shared
    # a cluster build and the merge kernel's at the same split count are two builds (a GPU that cannot
    # hold the cluster falls back to the second): they do not share either
    ints["launch"] = dataclasses.replace(ints["launch"], split_merge="kernel" if ints["launch"].split_merge == "cluster"
                                         else "cluster")
    other = torch_op._rebuild_plan(args[5], args[6], args[7], args[8], args[4], args[9], ints)
    assert other.kernels is not rebuilt[2].kernels


def test_bad_scalars_through_the_op_are_named():
    """Every bad scale form through the custom op (op_args turns scales into the schema's floats):
    the op's named TypeError / ValueError, not an OverflowError (10**400), torch's RuntimeError (a
    complex tensor) or a silent 1.0 (True) / real part (complex); out untouched."""
    from test_op_arguments import BAD_SCALAR_EXAMPLES

    c = _case(torch.bfloat16, seed=12)
    plan = _plan(c)
    for name in ("sm_scale", "q_scale", "k_scale", "v_scale"):
        for value, exc in BAD_SCALAR_EXAMPLES:
            out, lse = c.new_out(), c.new_lse()
            scales = dict(c.scales(), **{name: value})
            with pytest.raises((ValueError, TypeError)) as ei:
                sparse_decode_op(c.query, c.kv_cache, c.topk, out, plan, lse=lse, backend="reference", **scales)
            assert type(ei.value) is exc and str(ei.value).startswith(f"{name}: "), (name, value, ei.value)
            assert torch.isnan(out.float()).all() and torch.isnan(lse).all()


def test_arguments_the_schema_would_refuse_are_named_before_dispatch():
    """A non-tensor argument or a bad backend through the custom op: the API's named TypeError / ValueError,
    not the dispatcher's "Expected a value of type ..." RuntimeError."""
    c = _case(torch.bfloat16, seed=13)
    plan = _plan(c)
    for change, exc, start in ((dict(query=[1]), TypeError, "query: "), (dict(kv_cache=[1]), TypeError, "kv_cache: "),
                               (dict(lse=[0.0]), TypeError, "lse: "), (dict(backend=None), TypeError, "backend: "),
                               (dict(backend="cuda"), ValueError, "backend: ")):
        args = dict(query=c.query, kv_cache=c.kv_cache, topk=c.topk, out=c.new_out(), plan=plan, lse=None,
                    backend="reference", **c.scales())
        args.update(change)
        with pytest.raises(exc) as ei:
            sparse_decode_op(**args)
        assert str(ei.value).startswith(start), (change, ei.value)


@pytest.mark.parametrize("which", ["out", "lse", "out=query", "lse=out"])
def test_outputs_sharing_memory_through_the_op_are_named(which):
    """An expand()ed lse passed validation, the reference wrote out, then lse.copy_ raised torch's
    RuntimeError; an out aliasing query was taken. Through the custom op as through the API: the
    named ValueError before anything is written."""
    c = _case(torch.bfloat16, seed=13)
    plan = _plan(c)
    T, hq = c.num_tokens, c.num_q_heads
    out, lse, query = c.new_out(), c.new_lse(), c.query.clone()
    if which == "out":
        out = torch.full((1, hq, 128), float("nan"), dtype=torch.bfloat16).expand(T, hq, 128)
    elif which == "lse":
        lse = torch.full((1, hq), float("nan")).expand(T, hq)
    elif which == "out=query":
        out = query
    else:
        lse = out.view(-1)[: 2 * T * hq].view(torch.float32).view(T, hq)
    out0, lse0, q0 = out.clone(), lse.clone(), query.clone()
    name = which.split("=")[0]
    with pytest.raises(ValueError, match=rf"^{name}: (has zero stride|overlaps the memory of)"):
        sparse_decode_op(query, c.kv_cache, c.topk, out, plan, lse=lse, backend="reference", **c.scales())
    for x, x0 in ((out, out0), (lse, lse0), (query, q0)):
        assert torch.equal(x.contiguous().view(torch.uint8), x0.contiguous().view(torch.uint8))


def test_op_dispatch_bumps_every_written_version_without_walking_the_schema(monkeypatch):
    """The op's ADInplaceOrView kernel (reached whenever an argument tensor was created outside
    inference mode): out, lse and each workspace tensor get a new version, as torch's own kernel
    gives them, with the written positions read from the schema once. torch's kernel in some
    releases looks every argument up through `schema.arguments` on each call, which rebuilds the
    list of all 27 per lookup (fill_defaults / zip_schema): 150-200 us per call, against ~8 us for
    the op itself."""
    import torch._library.utils as library_utils
    from msa_jit.integrations import torch_op

    if torch_op._VERSION_BUMP_LIB is None:
        pytest.skip("this torch cannot replace custom_op's ADInplaceOrView kernel (no allow_override)")

    def walked(*args, **kwargs):
        raise AssertionError("the op's dispatch walked the schema's argument list")

    for name in ("fill_defaults", "zip_schema"):
        if hasattr(library_utils, name):
            monkeypatch.setattr(library_utils, name, walked)
    c = _case(torch.bfloat16, seed=21)
    plan = _plan(c)
    out, lse = c.new_out(), c.new_lse()
    assert not out.is_inference() and not c.kv_cache.is_inference()
    workspace = [getattr(plan, n) for n in WORKSPACE_FIELDS]
    before = [t._version for t in (out, lse, *workspace)]
    sparse_decode_op(c.query, c.kv_cache, c.topk, out, plan, lse=lse, backend="reference", **c.scales())
    after = [t._version for t in (out, lse, *workspace)]
    # the kernel's bump, plus the reference's own copy into out and lse
    assert after == [before[0] + 2, before[1] + 2, *(v + 1 for v in before[2:])], (before, after)
    o64, _ = sparse_decode_reference(*c.reference_args(), **c.scales())
    assert _rel(out, o64) < 1e-2
