"""The backend protocol (``_backends.Backend``): every backend module implements all of it,
so that no caller needs to probe for a capability."""
from __future__ import annotations

import inspect
import re

import pytest

from rnnt_lattice import _backends, _validate
from support.backends import need_triton


def _members():
    hints = set(getattr(_backends.Backend, "__annotations__", {}))
    funcs = {name for name, value in vars(_backends.Backend).items()
             if inspect.isfunction(value) and not name.startswith("_")}
    return hints, funcs


@pytest.mark.parametrize("name", ["numba", "torch", "triton"])
def test_every_backend_implements_the_whole_protocol(name):
    if name == "triton":
        need_triton()
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
             for sig in f.serial.signatures
             if any("int32" in str(a) for a in sig)]
    assert not found, found


@pytest.mark.parametrize("version, refused", [("3.0.0", True), ("3.2.0", True),
                                              ("3.4.0+git1a2b3c", True), ("3.5.1", False),
                                              ("3.6.0", False), ("3.10.0", False),
                                              ("4.0.0", False)])
def test_a_triton_too_old_for_the_kernels_is_refused_by_name(version, refused):
    """Triton 3.1 and 3.2 (torch 2.5, 2.6) compile none of the loss's kernels: the Triton
    backend refuses a Triton older than ``gpu.MIN_TRITON`` when it is imported, with an
    ImportError that names the versions and the way out (compared as numbers: 3.10 is
    newer than 3.5)."""
    need_triton()
    from rnnt_lattice import gpu
    if not refused:
        gpu.check_triton_version(version)
        return
    with pytest.raises(ImportError, match=r"need Triton >= 3\.5 .*found triton " + re.escape(version)):
        gpu.check_triton_version(version)


def test_auto_falls_back_to_torch_and_says_why(monkeypatch):
    """``backend="auto"`` on a device whose backend cannot be imported (no Triton, or one
    too old) runs the PyTorch backend, with one RuntimeWarning that carries the reason."""
    real = _backends.load

    def load(name):
        if name == "triton":
            raise ImportError("rnnt_lattice's Triton kernels need Triton >= 3.5; found 3.2.0")
        return real(name)

    monkeypatch.setattr(_backends, "load", load)
    monkeypatch.setattr(_backends, "_warned_fallback", set())
    import torch
    with pytest.warns(RuntimeWarning, match=r"'triton' backend is not importable .*found 3\.2\.0") as rec:
        impl = _backends.resolve("auto", torch.device("cuda"))
    assert impl.NAME == "torch"
    assert rec[0].filename == __file__                     # the caller's line


def test_with_blank_is_replace_for_every_field():
    """``_validate.with_blank`` names every field of ``LossOptions`` (TorchDynamo before torch
    2.9 cannot trace ``dataclasses.replace``): it must stay ``replace(opts, blank=...)``,
    whatever fields LossOptions gains."""
    import dataclasses

    from rnnt_lattice._types import LossOptions
    from rnnt_lattice.topology import tdt
    names = [f.name for f in dataclasses.fields(LossOptions)]
    # every field away from its default, so that a field left out would show
    values = dict(blank=1, log_softmax=False, clamp=0.5, fastemit_lambda=0.25, inplace_grad=True,
                  topology=tdt([0, 1, 2]), sigma=0.05, delay_penalty=0.125)
    assert sorted(values) == sorted(names), "a new LossOptions field: add it here and to _validate.with_blank"
    opts = LossOptions(**values)
    for f in dataclasses.fields(LossOptions):
        if f.default is not dataclasses.MISSING:
            assert getattr(opts, f.name) != f.default, f.name
    assert _validate.with_blank.__wrapped__(opts, 3) == dataclasses.replace(opts, blank=3)
    assert _validate.with_blank.__wrapped__(opts, 1) is opts
