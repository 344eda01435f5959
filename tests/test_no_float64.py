"""A device without float64 (Apple's MPS), simulated on the CPU: every public function on the
pure-PyTorch backend runs with its lattice in float32 and makes no float64 tensor, and gives
the float64 lattice's values to float32 rounding.

MPS refuses float64 tensors ("Cannot convert a MPS Tensor to float64 dtype"), so there the
lattice runs in float32 (``reference.lattice_dtype``) and ``backend="auto"`` is the
pure-PyTorch backend (``_backends.AUTO``). No Mac runs CI: here the CPU is made that device
(``"cpu"`` added to ``reference.DEVICES_WITHOUT_FLOAT64``, ``AUTO`` emptied, the Numba and
Triton backends unloadable) and a dispatch mode refuses every op that would make a float64
tensor, as MPS does. The oracle is the same call on the CPU as it is (the default backend,
a float64 lattice). What else MPS lacks (an op without an MPS kernel) is not simulated."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rnnt_lattice import _backends, reference
from support.cases import rel_err
from support.public_calls import CASES

# float32 lattices against float64 ones, relative to max(1, the largest value): the sums of
# a few dozen float32 roundings at these sizes, times the logits' magnitude where a case's
# logits are far from 1 (a float32 log-weight of 500 is rounded by 3e-5: ``MAGNITUDE``)
TOL = 2.0 ** -23 * 64


class RefuseFloat64(TorchDispatchMode):
    """Raises TypeError for any op that asks for a float64 tensor or returns one (MPS's
    rule), naming the op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("dtype") == torch.float64:
            raise TypeError(f"{func} asked for float64")
        out = func(*args, **kwargs)
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.dtype == torch.float64:
                raise TypeError(f"{func} made a float64 tensor")
        return out


def _without_float64(monkeypatch):
    """The CPU as a device without float64, from now to the end of the test."""
    monkeypatch.setattr(reference, "DEVICES_WITHOUT_FLOAT64", frozenset({"mps", "cpu"}))
    monkeypatch.setattr(_backends, "AUTO", {})
    load = _backends.load

    def torch_only(name):
        if name != "torch":
            raise ImportError(f"the {name!r} backend does not run on this device")
        return load(name)
    monkeypatch.setattr(_backends, "load", torch_only)


MAGNITUDE = {"rnnt_loss_simple, rows 500x apart (rescue)": 500.0}


@pytest.mark.parametrize("name", list(CASES))
def test_runs_without_float64_and_agrees(name, monkeypatch):
    """The call on a device without float64 (simulated) makes no float64 tensor, returns
    float32 where the CPU returns float64 (the lattice's outputs), and agrees with the CPU's
    float64 lattice to float32 rounding: values and gradients, ragged lengths, NaN padding,
    signed per-sequence upstream gradients; integer outputs (alignments, windows) equal."""
    want = CASES[name](contextlib.nullcontext)
    _without_float64(monkeypatch)
    got = CASES[name](RefuseFloat64)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, (i, g.shape, w.shape)
        if not w.is_floating_point():
            assert torch.equal(g, w), (i, g, w)
            continue
        assert g.dtype == (torch.float32 if w.dtype == torch.float64 else w.dtype), (i, g.dtype)
        assert rel_err(g, w) <= TOL * MAGNITUDE.get(name, 1.0), (i, rel_err(g, w))


def test_the_simulated_device_refuses_float64(monkeypatch):
    """The simulation can fail: a float64 tensor made under it raises, the Numba backend is
    not loaded, and the lattice dtype is float32 (else the tests above would prove nothing)."""
    _without_float64(monkeypatch)
    assert reference.lattice_dtype(torch.device("cpu")) == torch.float32
    assert _backends.resolve("auto", torch.device("cpu")) is _backends.load("torch")
    with pytest.raises(ImportError):
        _backends.load("numba")
    with RefuseFloat64():
        with pytest.raises(TypeError, match="float64"):
            torch.zeros(2).double()
        with pytest.raises(TypeError, match="float64"):
            torch.zeros(2, dtype=torch.float64)


@pytest.mark.parametrize("has_fp64", [True, False])
def test_an_intel_gpu_is_asked_whether_it_has_float64(has_fp64, monkeypatch):
    """XPUs differ (the Arc A-series has no float64, newer ones have): the lattice dtype
    follows the device's ``has_fp64`` (``torch.xpu.get_device_properties``, stubbed here:
    no XPU runs CI), asked once per device; MPS never has float64, CPU and CUDA always."""
    asked = []

    class Props:
        pass

    def properties(index=None):
        asked.append(index)
        props = Props()
        props.has_fp64 = has_fp64
        return props
    monkeypatch.setattr(torch.xpu, "get_device_properties", properties)
    monkeypatch.setattr(torch.xpu, "current_device", lambda: 1)
    reference._xpu_has_float64.cache_clear()
    want = torch.float64 if has_fp64 else torch.float32
    try:
        assert reference.lattice_dtype(torch.device("xpu", 1)) == want
        assert reference.lattice_dtype(torch.device("xpu")) == want     # the current one
        assert asked == [1]
    finally:
        reference._xpu_has_float64.cache_clear()
    assert reference.lattice_dtype(torch.device("mps")) == torch.float32
    assert reference.lattice_dtype(torch.device("cpu")) == torch.float64
    assert reference.lattice_dtype(torch.device("cuda", 0)) == torch.float64
