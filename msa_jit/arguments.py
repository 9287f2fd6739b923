"""Argument checks shared by the runtime and the float64 reference: each names the argument in a
TypeError or ValueError, never fails with an error from deeper down.

A leaf: torch and the standard library only (the reference, also a leaf, uses them, and
msa_jit.validation builds the op's and the planner's checks on them).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = ["check_dim", "check_dtype", "check_int", "check_scale", "check_tensor"]


def _fmt_shape(x: torch.Tensor) -> str:
    return str(list(x.shape))


def _dt(dt: torch.dtype) -> str:
    return str(dt)[len("torch."):]


def check_tensor(name: str, x: Any) -> torch.Tensor:
    """TypeError unless x is a torch.Tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def check_dtype(name: str, x: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    """TypeError unless x.dtype is one of `allowed`."""
    if x.dtype not in allowed:
        exp = " or ".join(_dt(d) for d in allowed)
        raise TypeError(f"{name}: expected dtype {exp}, got {x.dtype}")


def check_dim(name: str, x: torch.Tensor, ndim: int, layout: str) -> None:
    """ValueError unless x has `ndim` dimensions (layout is a human description like [T, Hq, D])."""
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor {layout}, got shape {_fmt_shape(x)}")


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """TypeError unless a Python int (not bool: a numpy integer is named as such, so the message does not read
    "expected an int, got int64"); ValueError unless lo <= value <= hi."""
    if isinstance(value, bool) or not isinstance(value, int):
        what = type(value).__name__
        if isinstance(value, numbers.Integral):
            what = f"{type(value).__module__}.{what} (pass int(value))"
        raise TypeError(f"{name}: expected a Python int, got {what}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}: expected an int in {rng}, got {value}")
    return value


def check_scale(name: str, value: Any) -> float:
    """A finite scale > 0 as a python float: a real number (int, float, numpy scalar) or a
    1-element CPU tensor of a real dtype. Never anything but TypeError / ValueError naming `name`:
    bool and complex values (python, numpy or tensor) are refused, not read as 1.0 or their real
    part; an int too large for a float is a ValueError, not OverflowError."""
    if type(value) is float and 0.0 < value < math.inf:  # the common case, in ~0.1 us (NaN fails too)
        return value
    what = type(value).__name__
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise TypeError(f"{name}: expected a finite float > 0, got {what}")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.device.type != "cpu":
            raise TypeError(
                f"{name}: expected a python float (or a 1-element CPU tensor), got a tensor of shape "
                f"{_fmt_shape(value)} on {value.device}"
            )
        if value.dtype == torch.bool or value.dtype.is_complex:
            raise TypeError(f"{name}: expected a finite float > 0, got a {_dt(value.dtype)} tensor")
    else:
        # numpy scalars / arrays say what they hold by dtype.kind: only f(loat), i(nt), u(int) are
        # scales (not b: numpy's bool, c: complex, O: objects); without a dtype, complex is refused
        kind = getattr(getattr(value, "dtype", None), "kind", None)
        if (kind is not None and kind not in "fiu") or (
                kind is None and isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real)):
            dtype = f" of dtype {value.dtype}" if kind is not None and str(value.dtype) != what else ""
            raise TypeError(f"{name}: expected a finite float > 0, got {what}{dtype}")
        if kind is not None and getattr(value, "size", 1) != 1:
            raise TypeError(f"{name}: expected a finite float > 0, got {what} of {value.size} elements")
    try:
        f = float(value)
    except OverflowError:  # an int (or Fraction...) past float's range: a value out of range
        raise ValueError(f"{name}: expected a finite float > 0, got a value too large for a float ({what})") from None
    except Exception:  # noqa: BLE001 - whatever __float__ raises, the argument is named
        raise TypeError(f"{name}: expected a finite float > 0, got {what}") from None
    if not math.isfinite(f) or f <= 0.0:
        raise ValueError(f"{name}: expected a finite float > 0, got {f!r}")
    return f
