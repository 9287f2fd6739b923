"""The calling convention (msa_jit/kernels/convention.py) is the one description of what an artifact takes.

Everything derived from it must agree with it: the kernels' `__call__` signature, the fake
arguments, the op's argument tuple, the plan-owned tensors, the layout checks of the
validation; and editing any part of it (or the compile / link options it holds) must change
every cache key, so a stale artifact is never loaded against a new convention.
"""

from __future__ import annotations

import inspect
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from helpers import make_case

from msa_jit.kernels import convention
from msa_jit import SparseDecodePlanner
from msa_jit.jit import compiler, registry
from msa_jit.jit.cache import source_fingerprint
from msa_jit.geometry import SparseDecodeConfig, check_config
from msa_jit.validation import kernel_call_ok, validate_kernel_layout, validate_sparse_decode

conv = convention
ROOT = Path(__file__).resolve().parents[1]
import msa_jit.kernels

KERNELS_DIR = Path(msa_jit.kernels.__file__).parent


def test_every_kernel_takes_the_convention_in_order():
    from msa_jit.kernels.base import SparseDecodeKernelBase

    names = list(inspect.signature(SparseDecodeKernelBase.__call__).parameters)
    # self, the arguments in order, then the stream TVM-FFI supplies
    assert names[1:-1] == list(conv.ARGUMENT_NAMES) and names[-1] == "stream"
    for family in registry.KERNEL_REGISTRY:
        cls = compiler._kernel_class(family)
        assert issubclass(cls, SparseDecodeKernelBase)
        assert cls.__call__ is SparseDecodeKernelBase.__call__, f"{family} must not redefine the launch"


def test_every_kernel_takes_the_arguments_as_one_value():
    """The decode kernels take ARGUMENTS as one KernelArguments (fields named and ordered as
    ARGUMENTS), then their own operands: no kernel signature spells the list out again."""
    assert conv.KernelArguments._fields == conv.ARGUMENT_NAMES
    for family in registry.KERNEL_REGISTRY:
        params = list(inspect.signature(compiler._kernel_class(family).kernel).parameters.values())
        assert params[1].annotation is conv.KernelArguments, family
        assert not {p.name for p in params} & set(conv.ARGUMENT_NAMES), family


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
        plan.qlen, plan.launch().num_splits, 0.5, 2.0)
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
    # the link step itself, the export and the config -> constructor mapping (msa_jit/kernels/build.py)
    ("build.py", ('[linker, *convention.LINK_FLAGS, "-o", str(so), str(obj), *libs]',
                  '[linker, *convention.LINK_FLAGS, "-o", str(so), str(obj), *libs, "-lm"]')),
    ("build.py", ("find_runtime_libraries(enable_tvm_ffi=True)", "find_runtime_libraries(enable_tvm_ffi=False)")),
    ("build.py", ("topk=config.topk_blocks,", "topk=2 * config.topk_blocks,")),
    # the constants the host shares with the device code, and each kernel's own source
    ("constants.py", ("UNION_ROWS = 64", "UNION_ROWS = 128")),
    ("constants.py", ("E4M3_MAX = 448.0", "E4M3_MAX = 240.0")),
    ("token.py", ("LAZY_RESCALE = 8.0", "LAZY_RESCALE = 4.0")),
    ("union_ops.py", ("RESCALE_LOG2 = 8.0", "RESCALE_LOG2 = 4.0")),
    ("split_merge.py", ("class SplitMergeKernel:", "class SplitMergeKernel:  # edited")),
])
def test_editing_the_convention_changes_every_cache_key(tmp_path, monkeypatch, file, edit):
    src = KERNELS_DIR
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
        if f.resolve() in hashed:
            continue
        code = "\n".join(line.split("#")[0] for line in f.read_text().splitlines())  # comments may name them
        outside += [f"{f.relative_to(ROOT)}: {s}" for s in ARTIFACT_SHAPING if s in code]
    assert not outside, outside


def test_the_checkout_builds_and_hashes_its_own_kernels():
    """Run from a source checkout, msa_jit.kernels is that checkout's msa_jit/kernels/, and every
    file of it is hashed."""
    import msa_jit.kernels.base as base

    assert Path(base.__file__).resolve().parent == (ROOT / "msa_jit" / "kernels").resolve()
    assert {p.resolve() for p in compiler.kernel_sources()} == {
        p.resolve() for p in (ROOT / "msa_jit" / "kernels").glob("*.py")}


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


def test_the_key_names_the_kernel_family_and_the_toolchain(monkeypatch):
    """The same config served by another kernel family, or built with another CuTe DSL or tvm-ffi
    version, has another cache key: never the other's artifact."""
    cfg = SparseDecodeConfig(8, 1, arch="sm_100a")
    portable = compiler.cache_key(cfg)
    with monkeypatch.context() as m:
        m.setattr(compiler, "kernel_family", lambda config: "token_dims")
        assert compiler.cache_key(cfg) != portable
    for name in ("dsl_version", "tvm_ffi_version"):
        with monkeypatch.context() as m:
            m.setattr(compiler, name, lambda: "0.0.0-other")
            assert compiler.cache_key(cfg) != portable, name
    assert compiler.cache_key(cfg) == portable


@pytest.mark.parametrize("version, abi", [
    ("0.1.11", "0.1"), ("0.1.15.post2", "0.1"), ("0.1.16", "0.1"), ("0.2.0", "0.2"), ("0.10.3rc1", "0.10"),
    ("1.0.0", "1"), ("1.4.2", "1"), ("2.0", "2"), ("unknown", "unknown"), ("dev", "dev"),
])
def test_tvm_ffi_abi_is_the_c_abi_not_the_package_version(version, abi):
    """tvm-ffi 0.X.Y: a bump of X breaks the C ABI, of Y not (its versioning rule while at 0.x);
    semantic versioning from 1.0. vLLM 0.33.0's pin (0.1.11) and msa-jit's (0.1.15.post2) are one ABI."""
    assert compiler.tvm_ffi_abi(version) == abi


def test_vllm_and_msa_jit_tvm_ffi_pins_share_cache_keys(monkeypatch):
    """An artifact warmed beside msa-jit's tvm-ffi pin is found beside vLLM's (and the other way
    round); another 0.X (another C ABI) has other keys."""
    cfg = SparseDecodeConfig(64, 4, arch="sm_90a")
    keys = {}
    for version, abi in (("0.1.11", "0.1"), ("0.1.15.post2", "0.1"), ("0.2.0", "0.2")):
        monkeypatch.setattr(compiler, "tvm_ffi_version", lambda v=version: v)
        keys[version] = compiler.cache_key(cfg)
        assert compiler.fingerprint(cfg)["tvm_ffi_abi"] == abi
    assert keys["0.1.11"] == keys["0.1.15.post2"] != keys["0.2.0"]


def test_toolchain_versions_fall_back_in_order(monkeypatch):
    """dsl_version: the first DSL distribution found (compiler or runtime libs), else
    MSA_JIT_DSL_VERSION, else "unknown"; tvm_ffi_version: the metadata, else tvm_ffi.__version__."""
    import importlib.metadata as md

    found = {"nvidia-cutlass-dsl-libs-cu12": "4.8.1"}

    def version(name):  # stand-in for the installed distributions' metadata
        if name in found:
            return found[name]
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(compiler.md, "version", version)
    monkeypatch.delenv("MSA_JIT_DSL_VERSION", raising=False)
    assert compiler.dsl_version() == "4.8.1"  # not the first name tried
    found.clear()
    assert compiler.dsl_version() == "unknown"
    monkeypatch.setenv("MSA_JIT_DSL_VERSION", "4.7.0")
    assert compiler.dsl_version() == "4.7.0"
    monkeypatch.setitem(sys.modules, "tvm_ffi", SimpleNamespace(__version__="0.1.99"))  # no dist-info (GPU bundle)
    assert compiler.tvm_ffi_version() == "0.1.99"


def test_linker_is_cc_first_and_must_exist(monkeypatch, tmp_path):
    """compiler._linker: $CC when it names a program, else the first of cc / gcc / clang on PATH;
    none at all is an error that says to set CC."""
    tool = tmp_path / "bin" / "my-cc"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    for name in ("gcc", "clang"):
        (tool.parent / name).symlink_to(tool)
    monkeypatch.setenv("PATH", str(tool.parent))
    monkeypatch.setenv("CC", str(tool))
    assert compiler._linker() == str(tool)
    monkeypatch.setenv("CC", str(tmp_path / "absent-cc"))
    assert compiler._linker() == "gcc"  # no cc on this PATH
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="set CC"):
        compiler._linker()


def test_compile_refuses_what_it_cannot_build(tmp_path, monkeypatch):
    """compile_sparse_decode refuses a config check_config refuses, and make_kernel an occupancy
    the serving kernel family has no build for, before a kernel is constructed or traced."""
    reached = []
    stub = SimpleNamespace(make_kernel=lambda *a: reached.append("make_kernel"), build=lambda *a: reached.append("build"))
    monkeypatch.setattr(compiler, "build", stub)
    monkeypatch.setattr(compiler, "_kernel_class", lambda family: reached.append("load"))

    with pytest.raises(ValueError, match="cannot compile .*sm_90"):
        compiler.compile_sparse_decode(SparseDecodeConfig(8, 1, arch="sm_90"), tmp_path)
    monkeypatch.setitem(registry.KERNEL_REGISTRY, "token", replace(registry.KERNEL_REGISTRY["token"], occupancies=(2,)))
    cfg = SparseDecodeConfig(8, 1, arch="sm_90a", ctas_per_sm=3)  # valid, but this registry has no 3-CTA build
    assert check_config(cfg) is None and registry.kernel_family(cfg) == "token"
    with pytest.raises(ValueError, match="token kernel has no build for 3 CTAs per SM"):
        compiler.make_kernel(cfg)
    assert reached == []


def test_build_maps_the_config_onto_the_constructor():
    """msa_jit/kernels/build.py make_kernel: the config's fields, then the class's occupancy and arch options,
    the split merge option, and last the experiment's kernel_options (which win)."""
    build = compiler.build

    class Kernel:  # stand-in kernel class: records its constructor arguments
        def __init__(self, **kw):
            self.kw = kw

        @staticmethod
        def occupancy_options(n, q_dtype, kv_dtype):
            return {"occupancy": n, "source": "occupancy"}

        @staticmethod
        def arch_options(arch, kv_dtype):
            return {"arch": arch, "source": "arch"}

    cfg = SparseDecodeConfig(64, 4, topk_blocks=8, ctas_per_sm=3, arch="sm_100a", kv_dtype="nvfp4")
    assert build.make_kernel(Kernel, cfg).kw == dict(
        num_q_heads=64, num_kv_heads=4, page_size=128, topk=8, q_dtype="bfloat16", kv_dtype="nvfp4",
        occupancy=3, arch="sm_100a", source="arch")
    kw = build.make_kernel(Kernel, replace(cfg, split_merge="cluster"), {"source": "experiment", "arch": "x"}).kw
    assert (kw["source"], kw["arch"], kw["split_merge"], kw["occupancy"]) == ("experiment", "x", "cluster", 3)


def test_build_traces_for_the_arch_links_and_reports_a_failed_link(tmp_path, monkeypatch):
    """msa_jit/kernels/build.py build, with a stand-in DSL: traced with the convention's options for the
    config's arch, exported under its name, linked by the given linker into ARTIFACT_NAME alone (the
    object file removed); a failing link is an error carrying the linker's output."""
    build = compiler.build
    calls = []

    class Compiled:
        def export_to_c(self, path, function_name):
            calls.append(("export", function_name))
            Path(path).write_bytes(b"object")

    def fake_compile(kernel, *args, options):
        calls.append(("compile", kernel, args, options))
        return Compiled()

    cute = SimpleNamespace(compile=fake_compile,
                           runtime=SimpleNamespace(find_runtime_libraries=lambda enable_tvm_ffi: ["libfake.so"]))
    pkg = ModuleType("cutlass")
    pkg.cute = cute
    monkeypatch.setitem(sys.modules, "cutlass", pkg)
    monkeypatch.setitem(sys.modules, "cutlass.cute", cute)
    monkeypatch.setattr(build.convention, "fake_arguments", lambda cfg: ["fake-args"])
    linker = tmp_path / "ld-ok"
    linker.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && { shift; echo linked > "$1"; }; shift; done\n')
    linker.chmod(0o755)
    cfg = SparseDecodeConfig(8, 1, arch="sm_100a")
    out = tmp_path / "out"
    out.mkdir()
    seconds = build.build("kernel", cfg, out, str(linker))
    assert set(seconds) == {"compile_s", "total_s"} and seconds["total_s"] >= seconds["compile_s"] >= 0
    assert calls[0] == ("compile", "kernel", ("fake-args",), f"{conv.COMPILE_OPTIONS} --gpu-arch sm_100a")
    assert calls[1] == ("export", conv.EXPORT_NAME)
    assert sorted(p.name for p in out.iterdir()) == [conv.ARTIFACT_NAME]
    failing = tmp_path / "ld-fail"
    failing.write_text("#!/bin/sh\necho 'undefined reference to cuda_dialect_init' >&2\nexit 1\n")
    failing.chmod(0o755)
    with pytest.raises(RuntimeError, match=f"linking {conv.ARTIFACT_NAME} failed:\n.*undefined reference"):
        build.build("kernel", cfg, tmp_path / "out", str(failing))


def test_kernel_base_checks_its_geometry_and_sizes_the_cluster_buffer():
    """SparseDecodeKernelBase: the group size and topk ranges (bounds included), the default
    build's occupancy only, and smem_bytes: the storage struct, then with a cluster merge its
    receive buffer at 16-byte alignment."""
    pytest.importorskip("cutlass")
    from msa_jit.kernels.base import SparseDecodeKernelBase
    from msa_jit.kernels.cluster_merge import RECV_BYTES

    ok = dict(num_q_heads=64, num_kv_heads=4, page_size=128, topk=32, q_dtype="float8_e4m3fn")
    k = SparseDecodeKernelBase(**ok)
    assert (k.group, k.topk, k.q_fp8) == (16, 32, True)
    for bad, says in ((dict(num_q_heads=6), "multiple"), (dict(num_q_heads=128), "group size 32"),
                      (dict(topk=33), "topk 33"), (dict(topk=0), "topk 0")):
        with pytest.raises(ValueError, match=says):
            SparseDecodeKernelBase(**{**ok, **bad})
    assert SparseDecodeKernelBase.occupancy_options(2, "bfloat16") == {}
    with pytest.raises(ValueError, match="3 CTAs per SM"):
        SparseDecodeKernelBase.occupancy_options(3, "bfloat16")

    class Sized(SparseDecodeKernelBase):  # a storage struct of 1000 bytes
        def storage_type(self):
            return SimpleNamespace(size_in_bytes=lambda: 1000)

    k = Sized(**ok)
    assert k.smem_bytes() == 1000
    k.cluster_merge = object()
    assert k.smem_bytes() == 1008 + RECV_BYTES
