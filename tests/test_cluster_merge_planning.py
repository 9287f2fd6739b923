"""The cluster split merge's place in planning: config rules and keys, the planner's choice and
pins, warmup's builds, the op boundary and the kernel option it maps to (CPU; the kernel itself:
tests/test_cluster_merge.py, on the GPU tests/test_cluster_merge_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_case

import msa_jit
from msa_jit import SparseDecodePlanner
from msa_jit.jit import compiler, registry
from msa_jit.geometry import SparseDecodeConfig, check_config
from msa_jit.planner import choose_split_merge
from msa_jit.integrations.torch_op import sparse_decode_op

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _prepare(planner: SparseDecodePlanner, batch: int, qlen: int = 1, hq: int = 64, hkv: int = 4):
    bt = torch.zeros(batch, 16, dtype=torch.int32, device=DEV)
    sl = torch.full((batch,), 1000, dtype=torch.int32, device=DEV)
    return planner.prepare(bt, sl, None, qlen, num_q_heads=hq, num_kv_heads=hkv, page_size=128, topk_blocks=16)


def test_choose_split_merge_rule():
    pick = lambda splits, ctas=2, kernel="token", arch="sm_90a", on=True: choose_split_merge(splits, ctas, kernel, arch, on)
    assert pick(16) == "cluster" and pick(4) == "cluster" and pick(3) == "cluster"
    assert pick(16, on=False) == "kernel"  # pinned off (or a split grid above one CTA per SM)
    assert pick(1) == "kernel"  # nothing to merge: the plain build
    assert pick(16, ctas=3) == "kernel"  # its receive buffer does not fit at 3 CTAs per SM
    assert pick(16, kernel="union") == "kernel"
    assert pick(16, arch="sm_100a") == "kernel" and pick(16, arch=None) == "kernel"


def test_check_config_cluster_rules():
    ok = SparseDecodeConfig(64, 4, split_merge="cluster")
    assert check_config(ok) is None and check_config(SparseDecodeConfig(8, 1, kv_dtype="nvfp4", split_merge="cluster")) is None
    assert "ctas_per_sm=2" in check_config(SparseDecodeConfig(64, 4, ctas_per_sm=3, split_merge="cluster"))
    assert "token kernel" in check_config(SparseDecodeConfig(64, 4, kernel="union", ctas_per_sm=2, split_merge="cluster"))
    assert "sm_90a" in check_config(SparseDecodeConfig(64, 4, arch="sm_100a", split_merge="cluster"))
    assert "split_merge must be" in check_config(SparseDecodeConfig(64, 4, split_merge="dsmem"))
    assert "split_merge=cluster" in ok.describe() and "split_merge" not in SparseDecodeConfig(64, 4).describe()
    # its own artifact: the field is in the cache key
    assert compiler.cache_key(ok) != compiler.cache_key(SparseDecodeConfig(64, 4))
    # the fp8 cluster build splits P V by head dims (msa_jit/kernels/token_dims.py); NVFP4's and other
    # page sizes' keep the token kernel's key split
    assert registry.kernel_family(ok) == "token_dims"
    assert registry.kernel_family(SparseDecodeConfig(8, 1, kv_dtype="nvfp4", split_merge="cluster")) == "token"
    assert registry.kernel_family(SparseDecodeConfig(64, 4, page_size=64, split_merge="cluster")) == "token"
    assert registry.kernel_family(SparseDecodeConfig(64, 4)) == "token"


def test_planner_picks_cluster_by_default_and_not_when_pinned_off():
    plan = _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a", split_merge="kernel"), 1)
    assert (plan.launch().num_splits, plan.launch().ctas_per_sm, plan.launch().split_merge) == (16, 2, "kernel")
    assert plan.config(torch.bfloat16).split_merge == "kernel"
    plan = _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a"), 1)
    assert (plan.launch().num_splits, plan.launch().ctas_per_sm, plan.launch().split_merge, plan.launch("nvfp4").split_merge) == (16, 2, "cluster", "cluster")
    for q in (torch.bfloat16, torch.float8_e4m3fn):
        for fmt in ("float8_e4m3fn", "nvfp4"):
            cfg = plan.config(q, fmt)
            assert cfg.split_merge == "cluster" and check_config(cfg) is None
    assert "split_merge=cluster" in repr(plan)
    # one split: nothing to merge; a 3-CTA step shape: its receive buffer does not fit
    assert _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a"), 64).launch().split_merge == "kernel"
    assert _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a", ctas_per_sm=3), 1).launch().split_merge == "kernel"
    # 64/4 B=16 (64 rows): fp8 in 2 splits = 128 CTAs, one per SM, merged in the cluster; NVFP4 in
    # 4 splits = 256 CTAs, 3 per SM (NVFP4 takes 3 at any grid above one CTA per SM), so the merge kernel
    plan = _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a"), 16)
    assert (plan.launch().num_splits, plan.launch().ctas_per_sm, plan.launch().split_merge) == (2, 2, "cluster")
    assert (plan.launch("nvfp4").num_splits, plan.launch("nvfp4").ctas_per_sm, plan.launch("nvfp4").split_merge) == (4, 3, "kernel")
    # the edge of the cluster zone: T*Hkv = 66 (16/2 B=33) in 2 splits is 132 CTAs, exactly one per SM
    plan = _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a"), 33, hq=16, hkv=2)
    assert (plan.launch().num_splits, plan.launch().ctas_per_sm, plan.launch().split_merge) == (2, 2, "cluster")
    # 64/4 B=4 (16 rows): fp8 in 4 splits = 64 CTAs of 4 blocks merged in the cluster; NVFP4 in 16
    # splits = 256 CTAs, 3 per SM, the merge kernel
    plan = _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a"), 4)
    assert (plan.launch().num_splits, plan.launch().ctas_per_sm, plan.launch().split_merge) == (4, 2, "cluster")
    assert (plan.launch("nvfp4").num_splits, plan.launch("nvfp4").ctas_per_sm, plan.launch("nvfp4").split_merge) == (16, 3, "kernel")
    # 64/4 B=8 (32 rows): 4 splits = 128 CTAs; 64/4 B=9 (36 rows): 2 splits = 72 CTAs, both in the cluster
    for batch, splits in ((8, 4), (9, 2)):
        plan = _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a"), batch)
        assert (plan.launch().num_splits, plan.launch().ctas_per_sm, plan.launch().split_merge) == (splits, 2, "cluster"), batch
    # a 2-CTA pin at a grid above one CTA per SM keeps the merge kernel, which measured faster there
    # there (64/4 B=4, 8/1 B=16: NVFP4's 256-CTA grids); fp8 splits there into one wave, in the cluster;
    # a split_merge pin still takes the cluster
    for batch, hq, hkv in ((4, 64, 4), (16, 8, 1)):
        plan = _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a", ctas_per_sm=2), batch, hq=hq, hkv=hkv)
        assert plan.launch().ctas_per_sm == 2 and plan.launch("nvfp4").num_splits > 1 and batch * hkv * plan.launch("nvfp4").num_splits > 132
        assert (plan.launch().num_splits, plan.launch().split_merge, plan.launch("nvfp4").split_merge) == (4, "cluster", "kernel"), (batch, hq, hkv)
    plan = _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a", ctas_per_sm=2, split_merge="cluster"), 16)
    assert (plan.launch().split_merge, plan.launch("nvfp4").split_merge) == ("cluster", "cluster")
    # at one CTA per SM the 2-CTA pin takes it (8/1 B=8: 8 x 16 = 128 CTAs)
    assert _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a", ctas_per_sm=2), 8, hq=8, hkv=1).launch().split_merge == "cluster"


def test_split_merge_pins():
    assert _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a", split_merge="cluster"), 1).launch().split_merge == "cluster"
    # a pin still needs a build that can: sm_100a and the union kernel keep the merge kernel
    assert _prepare(SparseDecodePlanner(num_sms=132, arch="sm_100a", split_merge="cluster"), 1).launch().split_merge == "kernel"
    # (an NVFP4 cache is the token kernel's: 2 tokens x 4 heads x 16 splits = 128 CTAs, 2 per SM)
    plan = _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a", kernel="union", split_merge="cluster"), 1, qlen=2)
    assert (plan.launch().kernel, plan.launch().num_splits, plan.launch("nvfp4").ctas_per_sm) == ("union", 16, 2)
    assert plan.launch().split_merge == "kernel" and plan.launch("nvfp4").split_merge == "cluster"
    assert _prepare(SparseDecodePlanner(num_sms=132, arch="sm_90a", split_merge="kernel"), 1).launch().split_merge == "kernel"
    with pytest.raises(ValueError, match="split_merge must be"):
        SparseDecodePlanner(split_merge="dsmem")


def test_warmup_builds_cluster_only_where_the_planner_may_pick_it():
    base = SparseDecodeConfig(64, 4, arch="sm_90a")
    got = [(c.ctas_per_sm, c.split_merge) for c in registry.plannable_configs(base) if c.kernel == "token"]
    assert got == [(2, "kernel"), (3, "kernel"), (2, "cluster")]
    nv = registry.plannable_configs(SparseDecodeConfig(8, 1, kv_dtype="nvfp4", arch="sm_90a"))
    assert [(c.ctas_per_sm, c.split_merge) for c in nv] == [(2, "kernel"), (3, "kernel"), (2, "cluster")]
    assert {c.split_merge for c in registry.plannable_configs(SparseDecodeConfig(64, 4, arch="sm_100a"))} == {"kernel"}
    # a cluster config given to a warmup still yields the plain builds first, and the union's never cluster
    got = registry.plannable_configs(SparseDecodeConfig(64, 4, arch="sm_90a", split_merge="cluster"))
    assert [(c.kernel, c.ctas_per_sm, c.split_merge) for c in got] == [
        ("token", 2, "kernel"), ("token", 3, "kernel"), ("union", 2, "kernel"), ("token", 2, "cluster")]
    assert all(check_config(c) is None for c in got)


def test_op_launches_the_cluster_build(launched_configs):
    """The plan's split_merge crosses the op boundary (eager API and custom op) and picks the build."""
    events = launched_configs
    c = make_case(1, 1, 16, 1, q_dtype=torch.bfloat16, seed=3)
    cluster = SparseDecodePlanner(num_sms=132, arch="sm_90a", split_merge="cluster").prepare(
        *c.prepare_args(), **c.prepare_kwargs())
    plain = SparseDecodePlanner(num_sms=132, arch="sm_90a", split_merge="kernel").prepare(*c.prepare_args(), **c.prepare_kwargs())
    assert cluster.launch().num_splits == plain.launch().num_splits == 16
    msa_jit.sparse_decode(c.query, c.kv_cache, c.topk, c.new_out(), cluster, backend="kernel", **c.scales())
    sparse_decode_op(c.query, c.kv_cache, c.topk, c.new_out(), plain, backend="kernel", **c.scales())
    sparse_decode_op(c.query, c.kv_cache, c.topk, c.new_out(), cluster, backend="kernel", **c.scales())
    assert [cfg.split_merge for cfg in events] == ["cluster", "kernel", "cluster"]
    assert events[0] == events[2] == cluster.config(torch.bfloat16)


def test_config_maps_to_the_kernel_option():
    """The config's split_merge is the kernel class's option (msa_jit/kernels/build.py make_kernel), so the
    cached artifact is the build the option names."""
    pytest.importorskip("cutlass")
    assert compiler.make_kernel(SparseDecodeConfig(64, 4, split_merge="cluster")).cluster_merge is not None
    assert compiler.make_kernel(SparseDecodeConfig(64, 4)).cluster_merge is None
    assert compiler.make_kernel(SparseDecodeConfig(8, 1, kv_dtype="nvfp4", split_merge="cluster")).cluster_merge is not None


class _FakeDriverLib:
    """A stand-in for libcuda (infrastructure only): records the calls of
    cluster_fit.max_active_clusters and answers `clusters` (or an error code from the query)."""

    def __init__(self, clusters: int, query_error: int = 0):
        self.clusters, self.query_error, self.calls, self.attrs, self.config = clusters, query_error, [], {}, None

    def _call(self, name, out=None, value=None):
        self.calls.append(name)
        if out is not None:
            out._obj.value = value
        return 0

    def cuInit(self, flags):
        return self._call("init")

    def cuDeviceGet(self, dev, index):
        return self._call("device", dev, index)

    def cuDevicePrimaryCtxRetain(self, ctx, dev):
        return self._call("retain", ctx, 0x1000)

    def cuCtxPushCurrent_v2(self, ctx):
        return self._call("push")

    def cuCtxPopCurrent_v2(self, ctx):
        return self._call("pop")

    def cuDevicePrimaryCtxRelease_v2(self, dev):
        return self._call("release")

    def cuModuleLoadData(self, module, image):
        return self._call("load", module, 0x2000)

    def cuModuleGetFunction(self, fn, module, name):
        self.name = name
        return self._call("function", fn, 0x3000)

    def cuFuncSetAttribute(self, fn, attr, value):
        self.attrs[attr] = value
        return self._call("attr")

    def cuOccupancyMaxActiveClusters(self, count, fn, config):
        self.calls.append("query")
        c = config._obj
        a = c.attrs[0]
        self.config = (c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.sharedMemBytes, c.numAttrs, a.id,
                       a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z)
        count._obj.value = self.clusters
        return self.query_error

    def cuModuleUnload(self, module):
        return self._call("unload")


def test_max_active_clusters_asks_the_driver_with_the_kernels_launch(monkeypatch):
    from msa_jit.jit import cluster_fit

    monkeypatch.setattr(cluster_fit.sass, "extract_cubins", lambda path: [b"cubin"])
    monkeypatch.setattr(cluster_fit, "decode_kernel_name", lambda cubin: "decode")
    lib = _FakeDriverLib(clusters=12)
    assert cluster_fit.max_active_clusters("x.so", 16, 160, 107592, 3, lib=lib) == 12
    # cuda.h: 8 = MAX_DYNAMIC_SHARED_SIZE_BYTES, 14 = NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 4 = CLUSTER_DIMENSION
    assert lib.attrs == {8: 107592, 14: 1} and lib.name == b"decode"
    assert lib.config == (1, 1, 16, 160, 107592, 1, 4, 1, 1, 16)
    assert lib.calls[-3:] == ["unload", "pop", "release"] and lib.calls[:2] == ["init", "device"]
    # a failing query raises, and the module and the context are still given back
    lib = _FakeDriverLib(clusters=0, query_error=1)
    with pytest.raises(RuntimeError, match="cuOccupancyMaxActiveClusters failed: CUDA driver error 1"):
        cluster_fit.max_active_clusters("x.so", 16, 160, 107592, 0, lib=lib)
    assert lib.calls[-3:] == ["unload", "pop", "release"]


def test_launch_structs_match_cuda_h():
    import ctypes

    from msa_jit.jit.cluster_fit import LaunchAttribute, LaunchConfig

    # cuda.h: CUlaunchAttribute {id; pad to 8; 64-byte value union}, CUlaunchConfig {7 x uint, stream, attrs, numAttrs}
    assert (ctypes.sizeof(LaunchAttribute), LaunchAttribute.value.offset) == (72, 8)
    assert (ctypes.sizeof(LaunchConfig), LaunchConfig.hStream.offset, LaunchConfig.attrs.offset,
            LaunchConfig.numAttrs.offset) == (56, 32, 40, 48)


def test_cluster_launch_fits_asks_once_and_keeps_the_cluster_when_it_cannot_tell(monkeypatch):
    from types import SimpleNamespace

    from msa_jit.jit import cluster_fit

    asked = []
    answer = {"n": 0}

    def fake_max(path, size, threads, smem, device):
        asked.append((size, threads, smem, device))
        if answer["n"] is None:
            raise RuntimeError("no driver")
        return answer["n"]

    extra = {"threads": 160, "smem_bytes": 107592}
    entry = SimpleNamespace(key="k1", meta={"extra": extra}, artifact_path=lambda name: f"/a/{name}")
    monkeypatch.setattr(compiler, "ensure_compiled", lambda cfg: (entry, False))
    monkeypatch.setattr(cluster_fit, "max_active_clusters", fake_max)
    monkeypatch.setattr(compiler, "_CLUSTER_FITS", {})
    cfg = SparseDecodeConfig(64, 4, split_merge="cluster")
    assert compiler.cluster_launch_fits(cfg, 16, 0) is False  # the driver says none fit
    assert compiler.cluster_launch_fits(cfg, 16, 0) is False and asked == [(16, 160, 107592, 0)]  # cached
    answer["n"] = 9
    assert compiler.cluster_launch_fits(cfg, 8, 0) is True and compiler.cluster_launch_fits(cfg, 16, 1) is True
    answer["n"] = None  # cannot tell (no driver bindings, a driver error): the launch decides, as before
    assert compiler.cluster_launch_fits(cfg, 4, 0) is True
    entry.meta = {"extra": {}}  # an artifact without its launch figures (another geometry's)
    assert compiler.cluster_launch_fits(SparseDecodeConfig(8, 1, split_merge="cluster"), 16, 0) is True
    looked_up = []
    monkeypatch.setattr(compiler, "ensure_compiled", lambda cfg: looked_up.append(cfg) or (entry, False))
    assert compiler.cluster_launch_fits(cfg, 16, 0) is False and looked_up == []  # a known answer: no disk lookup


def test_one_cluster_that_fits_is_enough(monkeypatch):
    """cluster_launch_fits: a GPU that can hold one cluster at a time can launch the cluster build."""
    from types import SimpleNamespace

    from msa_jit.jit import cluster_fit

    entry = SimpleNamespace(key="k1", meta={"extra": {"threads": 160, "smem_bytes": 107592}},
                            artifact_path=lambda name: f"/a/{name}")
    monkeypatch.setattr(compiler, "ensure_compiled", lambda cfg: (entry, False))
    monkeypatch.setattr(cluster_fit, "max_active_clusters", lambda *a: 1)
    monkeypatch.setattr(compiler, "_CLUSTER_FITS", {})
    assert compiler.cluster_launch_fits(SparseDecodeConfig(64, 4, split_merge="cluster"), 16, 0) is True


def test_decode_kernel_name_and_the_one_cubin(monkeypatch):
    """decode_kernel_name: the cubin's kernel that is not the split merge, wherever it is listed, and
    an error where there is none; max_active_clusters asks nothing of an artifact whose cubin is
    ambiguous (several cubins)."""
    from msa_jit.jit import cluster_fit, sass

    def kernels(*names):
        return lambda cubin: [sass.KernelResources(n, 64, 0, 90) for n in names]

    monkeypatch.setattr(cluster_fit.sass, "kernel_resources", kernels("kernel_SplitMergeKernel_0", "kernel_SparseDecodeMma_1"))
    assert cluster_fit.decode_kernel_name(b"cubin") == "kernel_SparseDecodeMma_1"
    monkeypatch.setattr(cluster_fit.sass, "kernel_resources", kernels("kernel_SplitMergeKernel_0"))
    with pytest.raises(ValueError, match="no decode kernel"):
        cluster_fit.decode_kernel_name(b"cubin")
    monkeypatch.setattr(cluster_fit.sass, "kernel_resources", kernels("kernel_SparseDecodeMma_1"))
    monkeypatch.setattr(cluster_fit.sass, "extract_cubins", lambda path: [b"cubin-a", b"cubin-b"])
    lib = _FakeDriverLib(clusters=3)
    with pytest.raises(ValueError):
        cluster_fit.max_active_clusters("x.so", 16, 160, 107592, 0, lib=lib)
    assert lib.calls == []


def test_plan_merges_by_kernel_where_the_gpu_cannot_hold_the_cluster(launched_configs, monkeypatch, caplog):
    events = launched_configs
    fits = {"answer": False}
    monkeypatch.setattr(compiler, "cluster_launch_fits", lambda cfg, splits, device: fits["answer"])
    c = make_case(1, 1, 16, 1, q_dtype=torch.bfloat16, seed=5)
    plan = SparseDecodePlanner(num_sms=132, arch="sm_90a", split_merge="cluster").prepare(
        *c.prepare_args(), **c.prepare_kwargs())
    assert plan.launch().split_merge == "cluster"
    with caplog.at_level("WARNING", logger="msa_jit"):
        msa_jit.sparse_decode(c.query, c.kv_cache, c.topk, c.new_out(), plan, backend="kernel", **c.scales())
    assert [cfg.split_merge for cfg in events] == ["kernel"] and plan.launch().split_merge == "kernel"
    assert "cannot hold a cluster of 16 CTAs" in caplog.text
    # where it fits, the cluster build is launched
    fits["answer"] = True
    plan = SparseDecodePlanner(num_sms=132, arch="sm_90a", split_merge="cluster").prepare(
        *c.prepare_args(), **c.prepare_kwargs())
    msa_jit.sparse_decode(c.query, c.kv_cache, c.topk, c.new_out(), plan, backend="kernel", **c.scales())
    assert events[-1].split_merge == "cluster" and plan.launch().split_merge == "cluster"


@pytest.mark.slow
def test_cluster_artifact_carries_its_launch_figures(tmp_path):
    """What cluster_launch_fits reads on a host without the compiler: the artifact's decode kernel
    by name, its block size and its dynamic shared memory (the cache entry's `extra`)."""
    pytest.importorskip("cutlass")
    from msa_jit.jit import sass
    from msa_jit.jit.cluster_fit import decode_kernel_name

    cfg = SparseDecodeConfig(64, 4, arch="sm_90a", split_merge="cluster")
    extra = compiler.compile_sparse_decode(cfg, tmp_path)["extra"]
    # the dims-split kernel: 2 stages of 4 padded 32-row groups, P's fragments, the receive buffer
    assert extra["threads"] == 160 and extra["smem_bytes"] == compiler.dynamic_smem_bytes(cfg) == 79944
    (cubin,) = sass.extract_cubins(tmp_path / "sparse_decode.so")
    name = decode_kernel_name(cubin)
    assert "merge" not in name.lower() and "SparseDecodeTokenDimsKernel" in name


def test_selftest_keeps_the_merge_kernel_covered_where_the_cluster_is_the_default():
    """selftest pins the 2-CTA build's merge kernel on exactly the cases whose 2-CTA plan the default
    planner gives the cluster merge (checked against the planner itself), so both merges run."""
    from msa_jit.tools.selftest import grid_cases

    plain = grid_cases("sm_90a", union=False, cluster=False)
    both = grid_cases("sm_90a", union=False, cluster=True, device_sms=132)
    pinned = {c[:5] for c in both if c[7] == "kernel"}
    assert set(plain) <= set(both) and len(both) - len(plain) == len(pinned)
    assert {(c[5], c[6]) for c in both if c[7] == "kernel"} == {("token", 2)}
    takes = set()
    for item in {c[:5] for c in plain}:
        (hq, hkv), _, qlen, batch, num_sms = item
        plan = _prepare(SparseDecodePlanner(num_sms=num_sms or 132, arch="sm_90a", ctas_per_sm=2), batch, qlen, hq, hkv)
        if plan.launch().split_merge == "cluster":
            takes.add(item)
        else:  # the merge kernel runs anyway: nothing to pin
            assert plan.launch().num_splits == 1 or batch * qlen * hkv * plan.launch().num_splits > (num_sms or 132), item
    assert pinned == takes and len(takes) > 8
    assert grid_cases("sm_100a", cluster=True) == grid_cases("sm_100a")  # no cluster merge there
