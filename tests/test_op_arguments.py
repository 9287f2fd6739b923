"""sparse_decode's scalar arguments, beyond test_validation's malformed-input fuzzing (whose
mutations draw them too): each form of a bad scale named."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_validation import _op_base, _same_bits, _snapshot

from msa_jit import sparse_decode

# each form of a bad scale once (test_torch_op walks them too)
BAD_SCALAR_EXAMPLES = [
    (0, ValueError), (-1.0, ValueError), (math.nan, ValueError), (math.inf, ValueError),
    (10 ** 400, ValueError), (-(10 ** 400), ValueError), (np.float32("nan"), ValueError),
    (np.float64(-2.0), ValueError), (np.int64(0), ValueError), (torch.tensor(-1.0), ValueError),
    (torch.tensor([math.inf]), ValueError), (torch.tensor(0, dtype=torch.int32), ValueError),
    (True, TypeError), (False, TypeError), (np.bool_(True), TypeError), (torch.tensor(True), TypeError),
    (1 + 0j, TypeError), (1j, TypeError), (np.complex128(2.0), TypeError), (torch.tensor(1 + 1j), TypeError),
    (torch.tensor([0.5 + 0j]), TypeError), ("1.0", TypeError), (None, TypeError), ([1.0], TypeError),
    (torch.tensor([1.0, 2.0]), TypeError), (np.array([1.0, 2.0]), TypeError),
]


def test_every_bad_scalar_is_a_named_value_or_type_error():
    """Each form of a bad scale (python / numpy / tensor; out of range, bool, complex, an int past
    float's range) for each scale: the named TypeError / ValueError, never OverflowError or
    torch's RuntimeError, and out / lse untouched."""
    for name in ("sm_scale", "q_scale", "k_scale", "v_scale"):
        for value, exc in BAD_SCALAR_EXAMPLES:
            a = _op_base()
            a[name] = value
            out0, lse0 = _snapshot(a["out"]), _snapshot(a["lse"])
            with pytest.raises((ValueError, TypeError)) as ei:
                sparse_decode(**a)
            assert type(ei.value) is exc and str(ei.value).startswith(f"{name}: "), (name, value, ei.value)
            assert _same_bits(out0, a["out"]) and _same_bits(lse0, a["lse"])
