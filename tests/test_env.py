"""Tests of msa_jit.env: every MSA_JIT_* variable read live, its defaults, syntax and description
(CPU only; split out of test_cache.py, see docs/cache.md §8)."""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path

import pytest

from msa_jit import env

pytestmark = pytest.mark.usefixtures("isolated_env")  # tests/conftest.py


def test_env_defaults():
    assert env.cache_dir() is None
    assert env.no_compile() is False
    assert env.cache_max_bytes() == 2 * 1024**3
    assert env.lock_timeout_s() == 600.0
    assert env.target_arch() is None
    assert env.log_level() == logging.WARNING


@pytest.mark.parametrize("fn,var,default", [(env.no_compile, "MSA_JIT_NO_COMPILE", False),
                                            (env.vllm_sm100, "MSA_JIT_VLLM_SM100", False)])
def test_env_booleans(monkeypatch, fn, var, default):
    for v in ("1", "true", "TRUE", "yes", "on", " On ", "y", "t"):
        monkeypatch.setenv(var, v)
        assert fn() is True, v
    for v in ("0", "false", "No", "off", "n", "f"):
        monkeypatch.setenv(var, v)
        assert fn() is False, v
    for v in ("", "  "):  # set but empty: as if unset
        monkeypatch.setenv(var, v)
        assert fn() is default, v
    for v in ("2", "maybe", "ture", "1.0"):
        monkeypatch.setenv(var, v)
        with pytest.raises(ValueError, match=var):
            fn()


def test_env_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MSA_JIT_CACHE_DIR", str(tmp_path / "x"))
    assert env.cache_dir() == tmp_path / "x"
    monkeypatch.setenv("MSA_JIT_CACHE_DIR", "~/jit")
    assert env.cache_dir() == Path(os.path.expanduser("~/jit"))
    monkeypatch.setenv("MSA_JIT_CACHE_DIR", "rel")
    assert env.cache_dir() == Path(os.getcwd()) / "rel"
    monkeypatch.setenv("MSA_JIT_CACHE_DIR", "")
    assert env.cache_dir() is None


def test_env_cache_max_bytes(monkeypatch):
    cases = {"0": 0, "1234": 1234, "2G": 2 * 1024**3, "2GiB": 2 * 1024**3, "2gb": 2 * 1024**3,
             "512M": 512 * 1024**2, "1.5K": 1536, " 10 k ": 10240, "7b": 7, "1T": 1024**4}
    for v, want in cases.items():
        monkeypatch.setenv("MSA_JIT_CACHE_MAX_BYTES", v)
        assert env.cache_max_bytes() == want, v
    for v in ("-1", "lots", "1X", "ib", "1 2", "nan", "1e9"):
        monkeypatch.setenv("MSA_JIT_CACHE_MAX_BYTES", v)
        with pytest.raises(ValueError, match="MSA_JIT_CACHE_MAX_BYTES"):
            env.cache_max_bytes()


def test_env_lock_timeout(monkeypatch):
    for v, want in {"0": 0.0, "1.5": 1.5, "600": 600.0, "inf": math.inf}.items():
        monkeypatch.setenv("MSA_JIT_LOCK_TIMEOUT", v)
        assert env.lock_timeout_s() == want
    for v in ("-1", "soon", "nan", "10s"):
        monkeypatch.setenv("MSA_JIT_LOCK_TIMEOUT", v)
        with pytest.raises(ValueError, match="MSA_JIT_LOCK_TIMEOUT"):
            env.lock_timeout_s()


def test_env_target_arch(monkeypatch):
    for v, want in {"sm_100a": "sm_100a", "SM_100A": "sm_100a", "sm100a": "sm_100a", "100a": "sm_100a",
                    "10.0a": "sm_100a", "sm_90a": "sm_90a", "9.0a": "sm_90a"}.items():
        monkeypatch.setenv("MSA_JIT_ARCH", v)
        assert env.target_arch() == want, v
    # spellings of arches msa-jit does not build for (geometry.DEFAULT_ARCHES) are refused too
    for v in ("hopper", "sm_", "sm_100x", "1", "9.0", "sm_90", "sm_103f", "sm_80"):
        monkeypatch.setenv("MSA_JIT_ARCH", v)
        with pytest.raises(ValueError, match="MSA_JIT_ARCH"):
            env.target_arch()


def test_env_log_level(monkeypatch):
    for v, want in {"debug": logging.DEBUG, "INFO": logging.INFO, "warn": logging.WARNING,
                    "error": logging.ERROR, "critical": logging.CRITICAL, "15": 15}.items():
        monkeypatch.setenv("MSA_JIT_LOG_LEVEL", v)
        assert env.log_level() == want
    for v in ("loud", "-3", "1.5"):
        monkeypatch.setenv("MSA_JIT_LOG_LEVEL", v)
        with pytest.raises(ValueError, match="MSA_JIT_LOG_LEVEL"):
            env.log_level()


def test_env_read_live_and_describe(monkeypatch):
    monkeypatch.setenv("MSA_JIT_NO_COMPILE", "1")
    assert env.no_compile()
    monkeypatch.setenv("MSA_JIT_NO_COMPILE", "0")
    assert not env.no_compile()
    monkeypatch.setenv("MSA_JIT_ARCH", "garbage!")
    table = env.describe()  # raw values, never raises
    names = [n for n, _v, _d in table]
    assert names == ["MSA_JIT_CACHE_DIR", "MSA_JIT_NO_COMPILE", "MSA_JIT_CACHE_MAX_BYTES", "MSA_JIT_LOCK_TIMEOUT",
                     "MSA_JIT_ARCH", "MSA_JIT_LOG_LEVEL",
                     "MSA_JIT_DSL_VERSION", "MSA_JIT_DSL_RUNTIME",
                     "MSA_JIT_VLLM_PLUGIN", "MSA_JIT_VLLM_SM100"]
    values = {n: v for n, v, _d in table}
    assert values["MSA_JIT_ARCH"] == "garbage!" and values["MSA_JIT_CACHE_DIR"] is None
    assert all(isinstance(d, str) and d for _n, _v, d in table)
    # every variable in the table is documented in the policy file
    policy = (Path(__file__).resolve().parents[1] / "docs" / "cache.md").read_text()
    assert all(n in policy for n in names)



def test_one_size_syntax_for_env_and_cli(monkeypatch):
    """MSA_JIT_CACHE_MAX_BYTES and `cache prune --max-bytes` parse sizes with the same rules."""
    import argparse

    from msa_jit.cli.common import parse_size

    for text, n in (("1P", 1 << 50), ("2GiB", 2 << 30), (".5k", 512), ("7", 7)):
        monkeypatch.setenv("MSA_JIT_CACHE_MAX_BYTES", text)
        assert env.parse_size(text) == parse_size(text) == env.cache_max_bytes() == n
    for bad in ("5iB", "lots", "-1"):
        monkeypatch.setenv("MSA_JIT_CACHE_MAX_BYTES", bad)
        with pytest.raises(ValueError, match="MSA_JIT_CACHE_MAX_BYTES"):
            env.cache_max_bytes()
        with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
            parse_size(bad)


def test_dsl_runtime_is_read_through_env(monkeypatch, tmp_path):
    from msa_jit.jit import loader

    lib = tmp_path / "libcute_dsl_runtime.so"
    lib.write_bytes(b"")
    monkeypatch.setenv("MSA_JIT_DSL_RUNTIME", str(lib))
    assert env.dsl_runtime() == lib and loader.find_runtime_library() == lib
    monkeypatch.setenv("MSA_JIT_DSL_RUNTIME", str(tmp_path / "absent.so"))
    with pytest.raises(FileNotFoundError, match="MSA_JIT_DSL_RUNTIME"):
        loader.find_runtime_library()
    monkeypatch.setenv("MSA_JIT_DSL_RUNTIME", "")
    assert env.dsl_runtime() is None


def test_dsl_runtime_is_found_on_sys_path_cu13_first(monkeypatch, tmp_path):
    """Without MSA_JIT_DSL_RUNTIME: nvidia_cutlass_dsl/cu13/lib before cu12/lib on sys.path (the
    first entry that has one), a directory named like the library is no library, and nothing
    found says what to install or set."""
    from msa_jit.jit import loader

    monkeypatch.delenv("MSA_JIT_DSL_RUNTIME", raising=False)
    site = tmp_path / "site"
    libs = {f: site / "nvidia_cutlass_dsl" / f / "lib" / loader.RUNTIME_LIB for f in ("cu12", "cu13")}
    libs["cu12"].parent.mkdir(parents=True)
    libs["cu12"].write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "empty"), str(site)])
    assert loader.find_runtime_library() == libs["cu12"]
    libs["cu13"].parent.mkdir(parents=True)
    libs["cu13"].write_bytes(b"")
    assert loader.find_runtime_library() == libs["cu13"]
    monkeypatch.setenv("MSA_JIT_DSL_RUNTIME", str(libs["cu13"].parent))  # a directory
    with pytest.raises(FileNotFoundError, match="MSA_JIT_DSL_RUNTIME"):
        loader.find_runtime_library()
    monkeypatch.delenv("MSA_JIT_DSL_RUNTIME")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "empty")])
    with pytest.raises(FileNotFoundError, match="nvidia-cutlass-dsl-libs-cu13.*MSA_JIT_DSL_RUNTIME"):
        loader.find_runtime_library()


def test_blank_values_mean_the_default(monkeypatch):
    """A value of blanks is empty, i.e. the default, for the non-boolean variables too."""
    for var, read, default in ((env.CACHE_MAX_BYTES, env.cache_max_bytes, env.DEFAULT_CACHE_MAX_BYTES),
                               (env.LOCK_TIMEOUT, env.lock_timeout_s, env.DEFAULT_LOCK_TIMEOUT_S),
                               (env.ARCH, env.target_arch, None), (env.LOG_LEVEL, env.log_level, logging.WARNING)):
        monkeypatch.setenv(var, "   ")
        assert read() == default, var
    assert env.problems() == []


def test_log_level_below_zero_is_refused(monkeypatch):
    monkeypatch.setenv(env.LOG_LEVEL, "-1")
    with pytest.raises(ValueError, match=env.LOG_LEVEL):
        env.log_level()
    monkeypatch.setenv(env.LOG_LEVEL, "0")
    assert env.log_level() == 0
