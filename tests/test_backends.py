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


def test_numba_kernels_read_int64_ids_only():
    """The Numba backend takes int32 ids and lengths (torchaudio's convention) and converts
    them in NumPy (``cpu._ids``): no kernel may get an int32 array, which would compile a
    second specialisation of it at run time (seconds, on a user's first int32 call). Every
    entry point that reads ids, with int32 ones, then no kernel signature holds int32."""
    import torch

    import rnnt_lattice
    from rnnt_lattice.cpu import _config, kernels, regular

    i32 = dict(dtype=torch.int32)
    y = torch.tensor([[1, 2, 3], [4, 1, 0]], **i32)
    tl, ul = torch.tensor([5, 4], **i32), torch.tensor([3, 2], **i32)
    x = torch.randn(2, 5, 4, 6, requires_grad=True)
    boundary = torch.tensor([[0, 0, 3, 5], [0, 1, 2, 4]], **i32)
    kw = dict(blank=0, backend="numba")
    for extra in ({}, dict(rnnt_type="modified"), dict(boundary=boundary), dict(packed=False)):
        rnnt_lattice.rnnt_loss(x, y, tl, ul, **kw, **extra).backward()
    xt = torch.randn(2, 5, 4, 8, requires_grad=True)
    rnnt_lattice.tdt_loss(xt, y, tl, ul, blank=5, durations=[0, 1], backend="numba").backward()
    y_mb = torch.tensor([[1, 2, 3], [3, 1, 0]], **i32)     # class 4 is the big blank
    rnnt_lattice.multiblank_rnnt_loss(x, y_mb, tl, ul, blank=5, big_blank_durations=[2],
                                      backend="numba").backward()
    rnnt_lattice.occupancy(x, y, tl, ul, **kw)
    rnnt_lattice.best_alignment(x, y, tl, ul, **kw)
    ranges = torch.arange(2).expand(2, 5, 2).contiguous()
    rnnt_lattice.rnnt_loss_pruned(torch.randn(2, 5, 2, 6, requires_grad=True), y, ranges,
                                  tl, ul, **kw).backward()
    found = [(name, str(sig)) for mod in (kernels, regular) for name, f in vars(mod).items()
             if isinstance(f, _config.ParallelKernel)
             for var in (f.parallel, f.serial) for sig in var.signatures
             if any("int32" in str(a) for a in sig)]
    assert not found, found
