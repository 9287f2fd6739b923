"""The calling convention (kernels/convention.py) is the one description of what an artifact takes.

Everything derived from it must agree with it: the kernels' `__call__` signature, the fake
arguments, the op's argument tuple, the plan-owned tensors, the layout checks of the
validation; and editing any part of it (or the compile / link options it holds) must change
every cache key, so a stale artifact is never loaded against a new convention.
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path

import pytest
import torch
from helpers import make_case

from msa_jit import SparseDecodePlanner, compiler
from msa_jit.cache import source_fingerprint
from msa_jit.geometry import SparseDecodeConfig
from msa_jit.validation import kernel_call_ok, validate_kernel_layout, validate_sparse_decode

conv = compiler.convention()
ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_takes_the_convention_in_order():
    from msa_jit.kernels.base import SparseDecodeKernelBase

    names = list(inspect.signature(SparseDecodeKernelBase.__call__).parameters)
    # self, the arguments in order, then the stream TVM-FFI supplies
    assert names[1:-1] == list(conv.ARGUMENT_NAMES) and names[-1] == "stream"
    for family in compiler.KERNEL_REGISTRY:
        cls = compiler._kernel_class(family)
        assert issubclass(cls, SparseDecodeKernelBase)
        assert cls.__call__ is SparseDecodeKernelBase.__call__, f"{family} must not redefine the launch"


def test_fake_arguments_follow_the_description():
    cfg = SparseDecodeConfig(num_q_heads=64, num_kv_heads=4)
    fakes = conv.fake_arguments(cfg)
    assert len(fakes) == len(conv.ARGUMENTS) + 1  # + the environment stream
    for a, fake in zip(conv.ARGUMENTS, fakes):
        if a.kind == "tensor":
            assert len(fake.shape) == len(a.shape), a.name


def test_op_passes_the_arguments_in_convention_order():
    c = make_case(2, 1, 64, 4, q_dtype=torch.bfloat16, seed=1, device="cpu")
    plan = SparseDecodePlanner().prepare(*c.prepare_args(), **c.prepare_kwargs())
    out, lse = c.new_out(), c.new_lse()
    ks = torch.ones(1)
    args = conv.call_arguments(plan, c.query, c.kv_cache, c.topk, out, lse, ks, None, 0.5, 2.0)
    got = dict(zip(conv.ARGUMENT_NAMES, args))
    assert len(args) == len(conv.ARGUMENTS)
    assert got["query"] is c.query and got["topk"] is c.topk and got["out"] is out and got["lse"] is lse
    # torch's fp8 tensors go in as they are; an fp8 cache held as uint8 storage as its fp8 view
    assert c.kv_cache.dtype == torch.float8_e4m3fn and got["kv_cache"] is c.kv_cache
    stored = conv.call_arguments(plan, c.query, c.kv_cache.view(torch.uint8), c.topk, out, lse, ks, None, 0.5, 2.0)
    kv_arg = dict(zip(conv.ARGUMENT_NAMES, stored))["kv_cache"]
    assert kv_arg.dtype == torch.float8_e4m3fn and kv_arg.data_ptr() == c.kv_cache.data_ptr()
    q8 = c.query.to(torch.float8_e4m3fn)
    assert conv.call_arguments(plan, q8, c.kv_cache, c.topk, out, lse, ks, None, 0.5, 2.0)[0] is q8
    assert got["block_table"] is plan.block_table
    # a scale tensor given goes in; one not given is the plan's unit scale
    assert got["k_scale_tensor"] is ks and got["v_scale_tensor"] is plan.kernel_tensors()[4]
    assert (got["qlen"], got["num_splits"], got["qk_scale_log2"], got["v_scale"]) == (
        plan.qlen, plan.num_splits, 0.5, 2.0)
    plan_owned = [a.name for a in conv.ARGUMENTS if a.source == "plan" and a.name != "block_table"]
    assert [n for n in conv.PLAN_TENSORS if n not in ("lse_scratch", "unit_scale")] == plan_owned
    # lse None: the plan's scratch goes in its place
    args = conv.call_arguments(plan, c.query, c.kv_cache, c.topk, out, None, None, None, 0.5, 2.0)
    assert dict(zip(conv.ARGUMENT_NAMES, args))["lse"] is plan.kernel_tensors()[1]


def _violations(a, good):
    """Tensors of the right shape and dtype that break what Argument `a` lets the kernel assume."""
    out = []
    if a.align:
        out.append(torch.zeros(good.numel() + 1, dtype=good.dtype)[1:].view(good.shape))
    if a.layout == "compact":
        flipped = torch.zeros(good.shape[::-1], dtype=good.dtype).permute(*range(good.dim() - 1, -1, -1))
        out.append(flipped)
    if a.layout == "query":
        T, H, D = good.shape
        out.append(torch.zeros(T, H, 2 * D, dtype=good.dtype)[..., :D])  # head stride != D
        out.append(torch.zeros(T, H * D + 8, dtype=good.dtype)[:, : H * D].view(T, H, D))  # token stride % 16
    if a.layout in ("query", "last_contiguous"):
        out.append(torch.zeros(good.shape + (2,), dtype=good.dtype)[..., 0])
    return out


SCALE_TENSORS = ("k_scale_tensor", "v_scale_tensor")  # checked by validation.check_kv_scale (below)


@pytest.mark.parametrize("name", [a.name for a in conv.ARGUMENTS
                                  if a.source == "call" and a.kind == "tensor" and a.name not in SCALE_TENSORS])
def test_validation_rejects_what_the_convention_does_not_allow(name):
    c = make_case(2, 1, 64, 4, q_dtype=torch.bfloat16, seed=2, device="cpu")
    plan = SparseDecodePlanner().prepare(*c.prepare_args(), **c.prepare_kwargs())
    good = dict(query=c.query, kv_cache=c.kv_cache, topk=c.topk, out=c.new_out(), lse=c.new_lse())
    assert kernel_call_ok(good["query"], good["kv_cache"], good["topk"], good["out"], plan, good["lse"])
    (a,) = [a for a in conv.ARGUMENTS if a.name == name]
    bad_tensors = _violations(a, good[name])
    assert bad_tensors, f"{name}: the convention lets the kernel assume nothing about it?"
    for bad in bad_tensors:
        t = dict(good, **{name: bad})
        assert not kernel_call_ok(t["query"], t["kv_cache"], t["topk"], t["out"], plan, t["lse"]), name
        # an API rule (every backend) or a kernel-layout rule (the kernel path) names it
        with pytest.raises(ValueError, match=rf"^{name}: "):  # the message starts with the argument's name
            validate_sparse_decode(t["query"], t["kv_cache"], t["topk"], t["out"], plan, t["lse"], "reference")
            validate_kernel_layout(t["query"], t["kv_cache"], t["out"], t["lse"])


@pytest.mark.parametrize("file,edit", [
    ("convention.py", ('LINK_FLAGS = ("-shared",)', 'LINK_FLAGS = ("-shared", "-Wl,--as-needed")')),
    ("convention.py", ('COMPILE_OPTIONS = "--enable-tvm-ffi"', 'COMPILE_OPTIONS = "--enable-tvm-ffi --opt-level 2"')),
    ("convention.py", ('Argument("out", "tensor", "bfloat16", ("T", "Hq", "D"), "compact", 16)',
                       'Argument("out", "tensor", "bfloat16", ("T", "Hq", "D"), "compact", 8)')),
    ("convention.py", ("cute.sym_int32(divisibility=16)", "cute.sym_int32(divisibility=8)")),
    ("convention.py", ('EXPORT_NAME = "sparse_decode"', 'EXPORT_NAME = "sparse_decode_v2"')),
    # the link step itself, the export and the config -> constructor mapping (kernels/build.py)
    ("build.py", ('[linker, *convention.LINK_FLAGS, "-o", str(so), str(obj), *libs]',
                  '[linker, *convention.LINK_FLAGS, "-o", str(so), str(obj), *libs, "-lm"]')),
    ("build.py", ("find_runtime_libraries(enable_tvm_ffi=True)", "find_runtime_libraries(enable_tvm_ffi=False)")),
    ("build.py", ("topk=config.topk_blocks,", "topk=2 * config.topk_blocks,")),
])
def test_editing_the_convention_changes_every_cache_key(tmp_path, monkeypatch, file, edit):
    src = compiler.kernels_dir()
    copy = tmp_path / "kernels"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__"))
    path = copy / file
    text = path.read_text()
    assert text.count(edit[0]) == 1, edit[0]
    cfg = SparseDecodeConfig(num_q_heads=8, num_kv_heads=1)
    before = compiler.cache_key(cfg)
    assert source_fingerprint(sorted(copy.glob("*.py"))) == compiler._sources_hash()
    path.write_text(text.replace(*edit))
    monkeypatch.setattr(compiler, "kernel_sources", lambda: sorted(copy.glob("*.py")))
    compiler._sources_hash.cache_clear()
    try:
        assert compiler.cache_key(cfg) != before
    finally:
        compiler._sources_hash.cache_clear()


# what shapes an artifact's bytes: tracing, export, the link step, the constructor options
ARTIFACT_SHAPING = ("cute.compile(", "export_to_c(", "find_runtime_libraries(", "LINK_FLAGS",
                    "COMPILE_OPTIONS", "occupancy_options(", "topk=config.topk_blocks")


def test_what_shapes_an_artifact_is_in_the_hashed_sources():
    """The compile / export / link steps and the config -> constructor mapping are written only in
    the kernels package (hashed, kernel_sources), never in msa_jit/ (not hashed): an edit there
    would change the artifact and keep its key."""
    hashed = {p.resolve() for p in compiler.kernel_sources()}
    assert {"convention.py", "build.py"} <= {p.name for p in hashed}
    outside = []
    for f in sorted((ROOT / "msa_jit").rglob("*.py")):
        code = "\n".join(line.split("#")[0] for line in f.read_text().splitlines())  # comments may name them
        outside += [f"{f.relative_to(ROOT)}: {s}" for s in ARTIFACT_SHAPING if s in code]
    assert not outside, outside


def test_the_checkout_builds_and_hashes_its_own_kernels():
    """Run from a source checkout, msa_jit.kernels is that checkout's kernels/, even when an
    editable install of another checkout (a worktree, a CI copy) maps the name elsewhere."""
    import msa_jit.kernels.base as base

    assert compiler.kernels_dir().resolve() == (ROOT / "kernels").resolve()
    assert Path(base.__file__).resolve().parent == (ROOT / "kernels").resolve()
    assert {p.resolve() for p in compiler.kernel_sources()} == {p.resolve() for p in (ROOT / "kernels").glob("*.py")}


def test_scale_tensors_follow_the_description():
    from msa_jit.validation import check_kv_scale

    (a,) = [a for a in conv.ARGUMENTS if a.name == "k_scale_tensor"]
    assert a.shape == ("one",) and a.dtype == "float32"
    c = make_case(1, 1, 8, 1, q_dtype=torch.bfloat16, seed=3, device="cpu")
    plan = SparseDecodePlanner().prepare(*c.prepare_args(), **c.prepare_kwargs())
    assert check_kv_scale("k_scale", 0.5, plan, "kernel") == (0.5, None)
    # a one-element CPU tensor is a host value: read once, like a float
    assert check_kv_scale("k_scale", torch.tensor([0.25]), plan, "kernel") == (0.25, None)
    with pytest.raises(TypeError, match="k_scale"):
        check_kv_scale("k_scale", "1", plan, "kernel")
    with pytest.raises(ValueError, match="v_scale"):
        check_kv_scale("v_scale", -1.0, plan, "kernel")


def test_device_scale_tensors_are_checked_and_shaped_like_the_convention(monkeypatch):
    # a plan on a (fake) CUDA device: a 0-dim or [1] float32 tensor there is passed as [1]; the
    # reference backend reads its value; wrong dtype / size / device name the argument
    from msa_jit.validation import check_kv_scale

    class FakePlan:
        device = torch.device("meta")

    meta0 = torch.empty((), dtype=torch.float32, device="meta")
    v, t = check_kv_scale("k_scale", meta0, FakePlan, "kernel")
    assert v == 1.0 and tuple(t.shape) == (1,)
    v, t = check_kv_scale("k_scale", torch.empty(1, device="meta"), FakePlan, "kernel")
    assert v == 1.0 and tuple(t.shape) == (1,)
    with pytest.raises(TypeError, match="k_scale"):
        check_kv_scale("k_scale", torch.empty(2, device="meta"), FakePlan, "kernel")
    with pytest.raises(TypeError, match="k_scale"):
        check_kv_scale("k_scale", torch.empty(1, dtype=torch.float16, device="meta"), FakePlan, "kernel")

    class OtherPlan:
        device = torch.device("cuda", 1)

    with pytest.raises(ValueError, match="plan's device"):
        check_kv_scale("v_scale", meta0, OtherPlan, "kernel")
