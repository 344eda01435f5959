"""The backends under test, in one place. The Triton backend runs on CPU tensors only
under the interpreter (``TRITON_INTERPRET=1``, set by ``conftest.py`` before triton is
first imported); its parameters skip themselves where the Triton backend cannot run (triton
not installed, or older than ``gpu.MIN_TRITON``)."""
from __future__ import annotations

import importlib.util
import os

import pytest


def _triton_missing() -> str | None:
    """Why the Triton backend cannot run here (not installed, or a Triton older than
    ``gpu.MIN_TRITON``: the ImportError of ``rnnt_lattice.gpu``), or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    from rnnt_lattice import _backends
    return _backends._unavailable("triton")


TRITON_MISSING = _triton_missing()
HAS_TRITON = TRITON_MISSING is None
NO_TRITON = pytest.mark.skipif(not HAS_TRITON, reason=f"needs the Triton backend (the interpreter "
                                                      f"runs it on CPU): {TRITON_MISSING}")
TRITON = pytest.param("triton", marks=NO_TRITON)

CPU = ["numba", "torch"]               # the native backends of CPU tensors
ALL = ["numba", "torch", TRITON]       # every backend
KERNELS = ["numba", TRITON]            # the kernel backends (the torch backend is the reference)


def need_triton() -> None:
    """Skip the calling test where the Triton backend cannot run (see ``NO_TRITON``)."""
    if not HAS_TRITON:
        pytest.skip(f"needs the Triton backend: {TRITON_MISSING}")


def names() -> tuple[str, ...]:
    """The backend names that run here (for tests that pick backends inside the test, like
    the fuzz tests): Triton only where it is usable (installed, >= gpu.MIN_TRITON) and
    interpreted."""
    return tuple(CPU) + (("triton",) if HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1" else ())
