"""``rnnt_loss_pruned``: the loss of the lattice restricted to per-frame windows of label
positions, on window logits ``(B, T, R, V)`` (docs/math.md sections 7 and 9), against the
path-enumerating oracle with the paths that leave a window removed, and against the full
loss when the windows cover everything. Losses and gradients, ragged NaN-poisoned batches,
signed upstream weights, every ``rnnt_type``, FastEmit, clamp, delay penalty, boundary."""
from __future__ import annotations

import warnings

import pytest
import torch

import rnnt_lattice
from support import backends
from support import cases
from support.cases import Case, rel_err, upstream_weights
from support.oracle import topology_batch_grad
from support.topologies import make_topo_inputs

CASES = cases.WINDOWS

OPTIONS = {
    "plain": dict(),
    "fastemit_clamp": dict(fastemit_lambda=0.5, clamp=0.05),
    "delay_boundary": dict(delay_penalty=0.3, boundary=True),
}
RNNT_TYPES = {"regular": "regular", "modified": "modified", "constrained": "constrained",
              "one_sym": "one_sym_per_frame"}
BACKENDS = backends.CPU


def windows(B, T, U, R, seed):
    """Random monotone windows ``(B, T, R)``: starts non-decreasing, steps <= R - 1, within
    ``[0, U + 1 - R]``, first start 0 (k2's constraints)."""
    g = torch.Generator().manual_seed(seed)
    top = U + 1 - R
    s = torch.zeros(B, T, dtype=torch.int64)
    for t in range(1, T):
        s[:, t] = (s[:, t - 1] + torch.randint(0, R, (B,), generator=g)).clamp(max=top)
    return s[..., None] + torch.arange(R)


def gather_windows(x, ranges):
    B, T, R = ranges.shape
    return torch.gather(x, 2, ranges[..., None].expand(B, T, R, x.shape[-1]))


def call(logits, targets, ranges, tl, ul, blank, rnnt_type, backend="auto", **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)      # the reference fallback notice
        return rnnt_lattice.rnnt_loss_pruned(logits, targets, ranges, tl, ul, blank=blank,
                                             rnnt_type=rnnt_type, reduction="none",
                                             backend=backend, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt", OPTIONS)
@pytest.mark.parametrize("topo_name", RNNT_TYPES)
@pytest.mark.parametrize("R", [1, 2, 3])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_pruned_matches_enumeration(case, R, topo_name, opt, backend):
    kw = dict(OPTIONS[opt])
    logits, targets, tl, ul, topo, blank, bnd = make_topo_inputs(
        case, topo_name, boundary=kw.pop("boundary", False))
    if bnd is not None:
        kw["boundary"] = bnd
    B, T, U1, V = logits.shape
    if R > U1:
        pytest.skip("R > U + 1")
    ranges = windows(B, T, U1 - 1, R, seed=R)
    allowed = torch.zeros(B, T, U1, dtype=torch.bool).scatter_(2, ranges, True)
    want_loss, want_grad = topology_batch_grad(logits, targets, tl, ul, topo, blank, True,
                                               allowed=allowed, **kw)
    win = gather_windows(logits, ranges).requires_grad_()
    costs = call(win, targets, ranges, tl, ul, blank, RNNT_TYPES[topo_name], backend, **kw)
    w = upstream_weights(B)
    (costs * w).sum().backward()
    assert rel_err(costs, want_loss) <= 1e-10
    want = gather_windows(want_grad * w[:, None, None, None], ranges)
    torch.testing.assert_close(win.grad, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rnnt_type", ["regular", "modified", "constrained"])
def test_full_windows_equal_the_full_loss(rnnt_type, backend):
    """``R = U + 1`` and windows starting at 0: the pruned loss is the full loss."""
    case = Case("big", (9, 6, 7), (4, 2, 5), 11, 0, T=9, U=5)
    logits, targets, tl, ul, _, blank, _ = make_topo_inputs(case, "regular")
    B, T, U1, V = logits.shape
    ranges = torch.arange(U1).expand(B, T, U1).contiguous()
    full = logits.clone().requires_grad_()
    win = logits.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        want = rnnt_lattice.rnnt_loss(full, targets, tl, ul, blank, reduction="none",
                                      rnnt_type=rnnt_type, backend=backend, fastemit_lambda=0.2)
    got = call(win, targets, ranges, tl, ul, blank, rnnt_type, backend, fastemit_lambda=0.2)
    w = upstream_weights(B)
    (want * w).sum().backward()
    (got * w).sum().backward()
    assert rel_err(got, want.detach()) <= 1e-12
    torch.testing.assert_close(win.grad, full.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", [None] + BACKENDS)
def test_inplace_grad_on_the_window_logits(backend):
    """``inplace_grad=True``: the same losses and gradient, written over the window logits
    themselves; strided window logits are refused, as ``rnnt_loss`` refuses them (the
    reshape to rows copied them, and the gradient was written over the copy)."""
    case = Case("big", (9, 6, 7), (4, 2, 5), 11, 0, T=9, U=5)
    logits, targets, tl, ul, _, blank, _ = make_topo_inputs(case, "regular")
    ranges = windows(3, 9, 5, 3, seed=4)
    x = gather_windows(logits, ranges).float()
    kw = {} if backend is None else {"backend": backend}
    w = upstream_weights(3).float()
    grads = []
    for inplace in (False, True):
        leaf = x.clone().requires_grad_()
        costs = call(leaf, targets, ranges, tl, ul, blank, "regular", **kw, inplace_grad=inplace)
        (costs * w).sum().backward()
        grads.append((costs.detach(), leaf.grad, leaf))
    assert torch.equal(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-6, atol=1e-7)
    assert grads[1][1].data_ptr() == grads[1][2].data_ptr()
    strided = x.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    with pytest.raises(ValueError, match="inplace_grad=True needs contiguous logits"):
        call(strided, targets, ranges, tl, ul, blank, "regular", **kw, inplace_grad=True)


def test_windows_without_a_path_give_inf_and_zero_gradient():
    """R = 1 in the regular topology holds no path once U_b >= 1 (k2 raises R to 2)."""
    logits = torch.randn(2, 4, 1, 5, dtype=torch.float64, requires_grad=True)
    targets, tl, ul = torch.tensor([[1, 2], [3, 4]]), torch.tensor([4, 4]), torch.tensor([2, 0])
    ranges = torch.zeros(2, 4, 1, dtype=torch.int64)
    costs = call(logits, targets, ranges, tl, ul, 0, "regular", "torch")
    assert costs[0] == float("inf") and torch.isfinite(costs[1])
    costs[1].backward()
    assert (logits.grad[0] == 0).all()
    zi = rnnt_lattice.rnnt_loss_pruned(logits, targets, ranges, tl, ul, blank=0,
                                       reduction="none", zero_infinity=True, backend="torch")
    assert zi[0] == 0


@pytest.mark.parametrize("ranges, match", [
    (torch.zeros(2, 4, 3, dtype=torch.int64), r"strictly increasing"),
    (torch.arange(3).expand(2, 4, 3) + 2, r"in \[0, U\] = \[0, 3\]"),
    (torch.zeros(2, 4, 2, dtype=torch.int64), r"ranges must have shape \(B, T, R\) = \(2, 4, 3\)"),
    (torch.zeros(2, 4, 3), r"ranges must be int32 or int64"),
])
def test_bad_ranges(ranges, match):
    logits = torch.randn(2, 4, 3, 5)
    with pytest.raises(ValueError, match=match):
        rnnt_lattice.rnnt_loss_pruned(logits, torch.ones(2, 3, dtype=torch.int64), ranges,
                                      torch.tensor([4, 4]), torch.tensor([3, 3]), blank=0)


@pytest.mark.parametrize("backend", ["torch", "numba", "triton"])
def test_empty_window_is_refused(backend):
    """R = 0 (logits (B, T, 0, V)): one ValueError on every backend (it was an IndexError on
    one and +inf on the others)."""
    with pytest.raises(ValueError, match=r"window R >= 1"):
        rnnt_lattice.rnnt_loss_pruned(torch.randn(1, 4, 0, 5), torch.tensor([[1, 2]]),
                                      torch.zeros(1, 4, 0, dtype=torch.int64), torch.tensor([4]),
                                      torch.tensor([2]), blank=0, backend=backend)
