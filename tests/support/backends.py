"""The backends under test, in one place. The Triton backend runs on CPU tensors only
under the interpreter (``TRITON_INTERPRET=1``, set by ``conftest.py`` before triton is
first imported); its parameters skip themselves where triton is not installed."""
from __future__ import annotations

import importlib.util
import os

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
NO_TRITON = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the interpreter runs it on CPU)")
TRITON = pytest.param("triton", marks=NO_TRITON)

CPU = ["numba", "torch"]               # the native backends of CPU tensors
ALL = ["numba", "torch", TRITON]       # every backend
KERNELS = ["numba", TRITON]            # the kernel backends (the torch backend is the reference)


def names() -> tuple[str, ...]:
    """The backend names that run here (for tests that pick backends inside the test, like
    the fuzz tests): Triton only where it is installed and interpreted."""
    return tuple(CPU) + (("triton",) if HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1" else ())
