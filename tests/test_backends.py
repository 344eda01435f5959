"""The backend protocol (``_backends.Backend``): every backend module implements all of it,
so that no caller needs to probe for a capability."""
from __future__ import annotations

import inspect

import pytest

from rnnt_lattice import _backends


def _members():
    hints = set(getattr(_backends.Backend, "__annotations__", {}))
    funcs = {name for name, value in vars(_backends.Backend).items()
             if inspect.isfunction(value) and not name.startswith("_")}
    return hints, funcs


@pytest.mark.parametrize("name", ["numba", "torch", "triton"])
def test_every_backend_implements_the_whole_protocol(name):
    if name == "triton":
        pytest.importorskip("triton")
    impl = _backends.load(name)
    hints, funcs = _members()
    assert funcs and hints                                  # the protocol declares both
    missing = sorted(m for m in hints | funcs if not hasattr(impl, m))
    assert not missing, f"backend {name!r} lacks {missing}"
    for m in funcs:
        assert callable(getattr(impl, m)), m
        # the same parameters, in the same order, as the protocol (self aside)
        want = list(inspect.signature(getattr(_backends.Backend, m)).parameters)[1:]
        got = list(inspect.signature(getattr(impl, m)).parameters)
        assert got == want, (name, m, got, want)
    assert impl.NAME == name
    assert impl.INPLACE_WRITES_IN in ("forward", "backward")
