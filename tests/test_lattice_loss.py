"""``lattice_loss``: the lattice over arc log-weights the caller gives, against brute-force
path enumeration with autograd (``oracle.topology_paths``), for every backend, topology,
boundary and the delay penalty, with NaN-poisoned entries that are no arc."""
from __future__ import annotations

import math

import pytest
import torch

import rnnt_lattice
from rnnt_lattice import topology
from support import backends
from support.oracle import topology_paths

BACKENDS = backends.ALL
RNNT_TYPES = topology.K2_TYPES                    # k2's lattices
TOL = {dt: 64 * torch.finfo(dt).eps for dt in (torch.float64, torch.float32)}   # lattice in float64

# (T_b, U_b) per sequence, padded to (T, U) = (5, 3); boundary rows [u0, t0, u1, t1] or None.
LENGTHS = ((5, 3), (3, 1), (4, 0), (0, 2))
BOUNDARIES = {None: None, "offsets": ((1, 1, 3, 5), (0, 0, 1, 2), (0, 2, 0, 4), (0, 0, 0, 0))}


def enumerated(w_b, w_e, rnnt_type, start, end, delay_penalty):
    """``-log sum_paths exp(sum of arc weights)`` of one lattice, by enumeration (autograd)."""
    topo = getattr(topology, rnnt_type)()
    t1 = end[0]
    label = w_e + delay_penalty * ((t1 - 1) / 2 - torch.arange(w_e.shape[0], dtype=w_e.dtype))[:, None]
    if rnnt_type == "constrained":
        label = label + torch.nn.functional.pad(w_b[:, 1:], (0, 1), value=-math.inf)
    weights = (w_b, label)
    paths = topology_paths(topo, start, end)
    if not paths:
        return None
    scores = torch.stack([sum((weights[k][t, u] for t, u, k in p), w_b.new_zeros(()))
                          for p in paths])
    return -torch.logsumexp(scores, 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
@pytest.mark.parametrize("bkey", list(BOUNDARIES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_matches_enumeration(dtype, bkey, rnnt_type, backend):
    g = torch.Generator().manual_seed(7)
    B, T, U1 = len(LENGTHS), 5, 4
    T_b = torch.tensor([t for t, _ in LENGTHS])
    U_b = torch.tensor([u for _, u in LENGTHS])
    boundary = None if BOUNDARIES[bkey] is None else torch.tensor(BOUNDARIES[bkey])
    # Unnormalised weights: any reals; NaN wherever no arc reads them.
    w_b = (2 * torch.randn(B, T, U1, generator=g, dtype=torch.float64)).to(dtype)
    w_e = (2 * torch.randn(B, T, U1, generator=g, dtype=torch.float64)).to(dtype)
    t0, u0, t1, u1 = ((T_b * 0, U_b * 0, T_b, U_b) if boundary is None else
                      (boundary[:, 1], boundary[:, 0], boundary[:, 3], boundary[:, 2]))
    t = torch.arange(T)[None, :, None]
    u = torch.arange(U1)[None, None, :]
    off = (t < t0[:, None, None]) | (t >= t1[:, None, None]) | (u < u0[:, None, None]) | (u > u1[:, None, None])
    w_b = w_b.masked_fill(off, math.nan)
    w_e = w_e.masked_fill(off | (u == u1[:, None, None]), math.nan)
    xb, xe = w_b.clone().requires_grad_(), w_e.clone().requires_grad_()
    up = torch.tensor([1.0, -0.5, 2.0, 0.25], dtype=dtype)
    loss, occ = rnnt_lattice.lattice_loss(xb, xe, T_b, U_b, rnnt_type=rnnt_type, delay_penalty=0.3,
                                          boundary=boundary, return_occupations=True,
                                          backend=backend)
    assert loss.dtype == dtype and loss.shape == (B,)
    (loss * up).sum().backward()
    for b in range(B):
        zb = torch.nan_to_num(w_b[b].double(), nan=0.0).requires_grad_()
        ze = torch.nan_to_num(w_e[b].double(), nan=0.0).requires_grad_()
        want = enumerated(zb, ze, rnnt_type, (int(t0[b]), int(u0[b])), (int(t1[b]), int(u1[b])), 0.3)
        if want is None:                   # no path: +inf, zero gradient, no occupation
            assert loss[b].item() == math.inf
            for x in (xb.grad[b], xe.grad[b], occ.gamma_blank[b], occ.gamma_label[b]):
                assert torch.equal(x, torch.zeros_like(x))
            continue
        gb, ge = (torch.zeros_like(z) if d is None else d
                  for z, d in zip((zb, ze), torch.autograd.grad(want, (zb, ze), allow_unused=True)))
        scale = max(1.0, abs(want.item()))
        assert abs(loss[b].item() - want.item()) <= TOL[dtype] * scale
        torch.testing.assert_close(xb.grad[b].double(), up[b].double() * gb, rtol=0, atol=TOL[dtype])
        torch.testing.assert_close(xe.grad[b].double(), up[b].double() * ge, rtol=0, atol=TOL[dtype])
        # d loss / d w = -gamma (the label arc's weight also reads w_b(t, u+1) for constrained)
        torch.testing.assert_close(-occ.gamma_label[b], ge, rtol=0, atol=TOL[dtype])
    assert occ.rnnt_type == rnnt_type


@pytest.mark.parametrize("backend", backends.ALL)
def test_a_plus_inf_weight_reads_as_nan(backend):
    """A ``+inf`` log-weight on an arc of the lattice reads as NaN (math.md 8.1) on every
    backend: loss and gradient NaN. (The torch backend summed it into ``log P = +inf``, a
    cost of ``-inf`` with a zero gradient, where the kernels gave NaN.)"""
    bw = torch.zeros(1, 2, 2, dtype=torch.float64)
    lw = torch.zeros(1, 2, 2, dtype=torch.float64)
    bw[0, 0, 1] = float("inf")
    b, l = bw.clone().requires_grad_(), lw.clone().requires_grad_()
    loss = rnnt_lattice.lattice_loss(b, l, torch.tensor([2]), torch.tensor([1]), backend=backend)
    gb, _ = torch.autograd.grad(loss.sum(), (b, l))
    assert torch.isnan(loss).all() and torch.isnan(gb[0, 0, 1])


def test_rejects_bad_arguments():
    w = torch.zeros(2, 3, 4)
    lengths = torch.tensor([3, 3]), torch.tensor([3, 2])
    with pytest.raises(ValueError, match=r"blank_weights must have 3 dims \(B, T, U\+1\), got shape \(3, 4\)"):
        rnnt_lattice.lattice_loss(w[0], w, *lengths)
    with pytest.raises(ValueError, match=r"one shape .* \(2, 3, 4\) and .* \(2, 3, 3\)"):
        rnnt_lattice.lattice_loss(w, w[..., :3], *lengths)
    with pytest.raises(ValueError, match=r"target_lengths\[0\] = 4 exceeds the padded size U = 3"):
        rnnt_lattice.lattice_loss(w, w, lengths[0], torch.tensor([4, 1]))
    with pytest.raises(ValueError, match="rnnt_type"):
        rnnt_lattice.lattice_loss(w, w, *lengths, rnnt_type="one_sym_per_frame")
    with pytest.raises(ValueError, match="delay_penalty"):
        rnnt_lattice.lattice_loss(w, w, *lengths, delay_penalty=-1.0)



def test_cost_overflowing_float32_has_zero_gradient():
    """Weights near -3.4e38: the float64 lattice is finite, its float32 cost +inf, and like
    every infinite loss it has a zero gradient (math.md 8.1)."""
    w_b = torch.full((2, 4, 2), -3.0e38)
    w_b[1] = -1.0
    w_e = w_b.clone()
    tl, ul = torch.tensor([4, 4]), torch.tensor([1, 1])
    b, e = w_b.clone().requires_grad_(), w_e.clone().requires_grad_()
    loss = rnnt_lattice.lattice_loss(b, e, tl, ul)
    loss.sum().backward()
    assert loss[0] == float("inf") and torch.isfinite(loss[1])
    assert torch.equal(b.grad[0], torch.zeros_like(b.grad[0])) and b.grad[1].abs().sum() > 0
    assert torch.isfinite(rnnt_lattice.lattice_loss(w_b.double(), w_e.double(), tl, ul)).all()


@pytest.mark.parametrize("which", ["lattice_loss", "rnnt_loss_simple", "rnnt_loss_smoothed",
                                   "compat.k2"])
def test_double_backward_is_refused(which):
    """The occupations behind the gradient are saved without a graph: ``create_graph=True``
    (a gradient penalty, a Hessian-vector product) is a RuntimeError, as for ``rnnt_loss``,
    where it gave a constant gradient, so a zero second derivative, silently. A plain
    ``autograd.grad`` still works. (For every entry point on this recursion: k2's
    ``mutual_information_recursion`` too.)"""
    import rnnt_lattice.compat.k2 as k2
    g = torch.Generator().manual_seed(0)
    B, T, U, V = 2, 4, 2, 5
    tl, ul = torch.tensor([4, 3]), torch.tensor([2, 1])
    w_b, w_e = (torch.randn(B, T, U + 1, generator=g, dtype=torch.float64).requires_grad_()
                for _ in range(2))
    lm = torch.randn(B, U + 1, V, generator=g, dtype=torch.float64, requires_grad=True)
    am = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[1, 2], [3, 0]])
    calls = {
        "lattice_loss": (lambda: rnnt_lattice.lattice_loss(w_b, w_e, tl, ul).sum(), (w_b, w_e)),
        "rnnt_loss_simple": (lambda: rnnt_lattice.rnnt_loss_simple(lm, am, targets, tl, ul,
                                                                   blank=0).sum(), (lm, am)),
        "rnnt_loss_smoothed": (lambda: rnnt_lattice.rnnt_loss_smoothed(
            lm, am, targets, tl, ul, blank=0, lm_only_scale=0.25).sum(), (lm, am)),
        "compat.k2": (lambda: -k2.mutual_information_recursion(
            w_e.transpose(1, 2)[:, :U], w_b.transpose(1, 2)).sum(), (w_b, w_e)),
    }
    loss, inputs = calls[which]
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss(), inputs, create_graph=True)
    grads = torch.autograd.grad(loss(), inputs)
    assert all(gr.grad_fn is None and torch.isfinite(gr).all() for gr in grads)


def test_a_batched_backward_says_so():
    """``autograd.grad(..., is_grads_batched=True)`` runs the backward on a batched
    upstream: a NotImplementedError that says so (it was "Batching rule not implemented
    for aten::detach")."""
    g = torch.Generator().manual_seed(0)
    w_b, w_e = (torch.randn(2, 4, 3, generator=g, dtype=torch.float64).requires_grad_()
                for _ in range(2))
    costs = rnnt_lattice.lattice_loss(w_b, w_e, torch.tensor([4, 3]), torch.tensor([2, 1]))
    with pytest.raises(NotImplementedError, match="is_grads_batched"):
        torch.autograd.grad(costs, w_b, torch.eye(2, dtype=torch.float64), is_grads_batched=True)
