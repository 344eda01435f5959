"""``torch.use_deterministic_algorithms(True)`` on CUDA, checked on the CPU: no public call
runs an op that torch refuses there for want of a deterministic CUDA kernel.

On CUDA, under that mode, torch raises ``RuntimeError`` ("cumsum_cuda_kernel does not have a
deterministic implementation") for the ops its documentation lists (a floating ``cumsum``,
``put_``, ``histc``, a weighted ``bincount``, ``median`` with indices, ``scatter_reduce``
with ``"prod"``, ``nll_loss``, and more); on the CPU the same ops run. So a training script
that sets the mode for reproducibility would fail on a GPU only. Here each public call of
the case table (``support/public_calls.py``) runs under the mode and a dispatch mode that
refuses those ops as CUDA would, on the backend CUDA runs by default (Triton, through its
interpreter) and on the pure-PyTorch one, and gives the values of the same call without
the mode. (``prune_ranges(method="exact")``, the default, and ``prune_coverage`` summed
the occupations with ``cumsum``: ``reference.cumsum_last``.)"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rnnt_lattice import _backends, reference
from support import backends
from support.cases import rel_err
from support.determinism import deterministic_algorithms
from support.public_calls import CASES

aten = torch.ops.aten

# The ops torch.use_deterministic_algorithms documents as raising on CUDA, by their aten
# overload packets, with the condition under which they raise (args, kwargs -> bool)
_FLOATING = (lambda a, k: (k.get("dtype") or a[0].dtype).is_floating_point)
REFUSED_ON_CUDA = {
    aten.cumsum: _FLOATING,
    aten.cumsum_: _FLOATING,
    aten.put_: lambda a, k: True,
    aten.put: lambda a, k: True,
    aten.histc: lambda a, k: True,
    aten.bincount: lambda a, k: (len(a) > 1 and a[1] is not None) or k.get("weights") is not None,
    aten.median: lambda a, k: len(a) > 1 or "dim" in k,          # with indices
    aten.nanmedian: lambda a, k: len(a) > 1 or "dim" in k,
    aten.scatter_reduce: lambda a, k: (a[4] if len(a) > 4 else k.get("reduce")) == "prod",
    aten.scatter_reduce_: lambda a, k: (a[4] if len(a) > 4 else k.get("reduce")) == "prod",
    aten.nll_loss_forward: lambda a, k: True,
    aten.nll_loss2d_forward: lambda a, k: True,
    aten._ctc_loss_backward: lambda a, k: True,
    # its backward, with mode "max" (2)
    aten.embedding_bag: lambda a, k: (a[4] if len(a) > 4 else k.get("mode", 0)) == 2,
    aten._embedding_bag: lambda a, k: (a[4] if len(a) > 4 else k.get("mode", 0)) == 2,
}


class RefuseNondeterministicOnCuda(TorchDispatchMode):
    """Raises RuntimeError, as CUDA does under ``torch.use_deterministic_algorithms(True)``,
    for the ops in ``REFUSED_ON_CUDA``, whatever the tensors' device."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        refused = REFUSED_ON_CUDA.get(func.overloadpacket)
        if refused is not None and refused(args, kwargs):
            raise RuntimeError(f"{func} does not have a deterministic implementation on CUDA")
        return func(*args, **kwargs)


@contextlib.contextmanager
def deterministic():
    """``torch.use_deterministic_algorithms(True)`` and the refusing mode, restored after."""
    with deterministic_algorithms(), RefuseNondeterministicOnCuda():
        yield


# float32 values: the same kernels, only the summing order of the windows' occupations
# differs (a scan instead of cumsum)
TOL = 2.0 ** -23 * 16

# The backends a CUDA user runs: the default (Triton) and the pure-PyTorch one
BACKENDS = [pytest.param("triton", marks=pytest.mark.skipif(
    "triton" not in backends.names(), reason="needs the Triton backend (its interpreter)")),
    "torch"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_deterministic_mode_refuses_nothing(name, backend, monkeypatch):
    """The call under the deterministic mode (CUDA's refusals simulated) runs, and gives the
    values of the same call without it: losses, gradients, alignments and windows."""
    monkeypatch.setattr(_backends, "AUTO", {"cpu": backend})     # CUDA's way, on the CPU
    want = CASES[name](contextlib.nullcontext)
    got = CASES[name](deterministic)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (i, g.shape, w.shape)
        if not w.is_floating_point():
            assert torch.equal(g, w), (i, g, w)
        else:
            assert rel_err(g, w) <= TOL, (i, rel_err(g, w))


def test_the_simulation_refuses_what_cuda_refuses():
    """The simulation can fail: a floating cumsum raises under it, an integer one does not,
    and the deterministic mode is off again after it."""
    x = torch.arange(6.0)
    with deterministic():
        assert torch.are_deterministic_algorithms_enabled()
        with pytest.raises(RuntimeError, match="deterministic"):
            x.cumsum(0)
        assert torch.equal(torch.arange(4).cumsum(0), torch.tensor([0, 1, 3, 6]))
        with pytest.raises(RuntimeError, match="deterministic"):
            torch.bincount(torch.tensor([0, 1, 1]), weights=torch.ones(3))
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 64, 1031])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cumsum_last_scans_in_deterministic_mode(n, dtype):
    """``reference.cumsum_last`` is ``cumsum`` outside the mode (the same bits) and the scan of
    elementwise adds under it: the cumsum to the rounding of ``log2 n`` adds, NaN and inf
    where the cumsum has them; an integer tensor keeps ``cumsum``."""
    g = torch.Generator().manual_seed(n)
    x = torch.rand(3, 2, n, generator=g, dtype=dtype)
    x[0, 0, n // 2] = float("nan")
    x[1, 1, 0] = float("inf")
    want = x.cumsum(-1)
    torch.testing.assert_close(reference.cumsum_last(x), want, rtol=0, atol=0, equal_nan=True)
    with deterministic():
        got = reference.cumsum_last(x)
        ints = reference.cumsum_last(torch.arange(n))
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    ok = want.isfinite()
    eps = torch.finfo(dtype).eps
    assert ((got - want)[ok].abs() <= want[ok].abs() * eps * (n.bit_length() + 1)).all()
    assert torch.equal(ints, torch.arange(n).cumsum(0))


@pytest.mark.skipif("triton" not in backends.names(), reason="needs the Triton backend (its interpreter)")
@pytest.mark.parametrize("name", ["rnnt_loss_simple, rows 500x apart (rescue)",
                                  "rnnt_loss_smoothed", "compat.k2 smoothed"])
def test_the_simple_losses_add_in_order_under_the_mode(name, monkeypatch):
    """The two places where the simple losses' backward adds float64 terms in an order a GPU
    may change between runs (the entries of a class read twice by a row, the log-domain
    rescue's nodes sharing a row) launch their kernels in a fixed order under the mode, and
    with atomics without it: ``_simple_rows_grad_kernel`` with ``ORDERED``, the rescue's
    backward as ``_simple_rescue_rows_kernel`` (a launch a side) instead of
    ``_simple_rescue_kernel(BACKWARD=True)``. (The interpreter runs atomics in order, so the
    values cannot tell the two apart: ``test_triton.py``'s compile for sm_90 finds no atomic
    instruction in the ordered variants, and the values are the reference's there.)"""
    from rnnt_lattice import gpu
    monkeypatch.setattr(_backends, "AUTO", {"cpu": "triton"})
    launched = []
    real = gpu.launch

    def record(kernel, grid, *args, **kw):
        launched.append((kernel.fn.__name__, kw))
        return real(kernel, grid, *args, **kw)

    monkeypatch.setattr(gpu, "launch", record)
    rescue = "rescue" in name
    for mode in (contextlib.nullcontext, deterministic):
        launched.clear()
        CASES[name](mode)
        ordered = mode is deterministic
        rows = [kw["ORDERED"] for k, kw in launched
                if k == "_simple_rows_grad_kernel" and kw["COLS"]]
        assert rows and set(rows) == {ordered}, (mode, rows)
        atomic = [kw for k, kw in launched if k == "_simple_rescue_kernel" and kw["BACKWARD"]]
        sides = sorted(kw["AM"] for k, kw in launched if k == "_simple_rescue_rows_kernel")
        assert not (ordered and atomic) and (ordered or not sides), (mode, atomic, sides)
        if rescue:
            assert len(atomic) == (0 if ordered else 1), (mode, atomic)
            assert sides == ([False, True] if ordered else []), (mode, sides)
