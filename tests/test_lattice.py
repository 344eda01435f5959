"""The lattice itself (alpha, beta, log P, occupations) of every CPU backend: math.md
sections 2-3 against enumeration, and the occupation invariants."""
from __future__ import annotations

import math

import pytest
import torch

from rnnt_lattice import _backends
from rnnt_lattice._types import LossOptions
from support import backends
from support.cases import TINY, Case, make_inputs
from support.oracle import occupations

BACKENDS = backends.CPU


def lattice_of(backend, logits, targets, tl, ul, blank, fused=True):
    """The backend's ``occupancy`` of the regular lattice: alpha, beta ``(B, T+1, U+1)``
    (frame T_b holds the end node), gamma ``(B, 2, T, U+1)`` (blank, label)."""
    impl = _backends.resolve(backend, logits.device)
    return impl.occupancy(logits, targets, tl, ul, LossOptions(blank % logits.shape[-1], fused))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", TINY, ids=lambda c: c.name)
def test_occupations_match_enumeration(case, backend):
    logits, targets, tl, ul, blank = make_inputs(case)
    lat = lattice_of(backend, logits, targets, tl, ul, blank)
    for b in range(case.B):
        T_b, U_b = int(tl[b]), int(ul[b])
        gb, gl = occupations(logits[b, :T_b, :U_b + 1], targets[b, :U_b], blank % case.V, True)
        torch.testing.assert_close(lat.gamma[b, 0, :T_b, :U_b + 1], gb, rtol=0, atol=1e-12)
        torch.testing.assert_close(lat.gamma[b, 1, :T_b, :U_b + 1], gl, rtol=0, atol=1e-12)
        # Padding: zero occupation, -inf alpha/beta (the end frame T_b holds only the end node).
        assert (lat.gamma[b, :, T_b:] == 0).all() and (lat.gamma[b, :, :, U_b + 1:] == 0).all()
        assert (lat.alpha[b, T_b + 1:] == -math.inf).all() and (lat.alpha[b, T_b, :U_b] == -math.inf).all()
        assert (lat.beta[b, :, U_b + 1:] == -math.inf).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_invariants_and_self_check(backend):
    """For each frame sum_u gamma_blank = 1; for each label sum_t gamma_label = 1; occ in
    [0, 1]; log P from alpha equals log P from beta (math.md sections 2-3)."""
    case = Case("inv", (30, 17, 25, 1), (9, 12, 0, 4), 11, 4, T=31, U=13)
    logits, targets, tl, ul, blank = make_inputs(case, scale=2.0)
    lat = lattice_of(backend, logits, targets, tl, ul, blank)
    gamma_blank, gamma_label = lat.gamma[:, 0], lat.gamma[:, 1]
    occ = gamma_blank + gamma_label
    assert ((occ >= 0) & (occ <= 1 + 1e-12)).all()
    for b in range(case.B):
        T_b, U_b = int(tl[b]), int(ul[b])
        torch.testing.assert_close(gamma_blank[b, :T_b].sum(1), torch.ones(T_b, dtype=torch.float64))
        torch.testing.assert_close(gamma_label[b, :T_b, :U_b].sum(0), torch.ones(U_b, dtype=torch.float64))
        # alpha(T_b-1, U_b) + b(T_b-1, U_b) = beta(0, 0) = log P
        lp = torch.log_softmax(logits[b, T_b - 1, U_b], -1)[blank % case.V]
        assert (lat.alpha[b, T_b - 1, U_b] + lp).item() == pytest.approx(lat.log_like[b].item(), abs=1e-10)
        assert lat.beta[b, 0, 0].item() == pytest.approx(lat.log_like[b].item(), abs=1e-12)
        assert lat.alpha[b, T_b, U_b].item() == pytest.approx(lat.log_like[b].item(), abs=1e-10)
        # node occupancy = exp(alpha + beta - log P)
        node = torch.exp(lat.alpha[b, :T_b, :U_b + 1] + lat.beta[b, :T_b, :U_b + 1] - lat.log_like[b])
        torch.testing.assert_close(node, occ[b, :T_b, :U_b + 1])


def test_backends_agree_on_the_lattice():
    case = Case("agree", (40, 33), (20, 7), 50, 0)
    logits, targets, tl, ul, blank = make_inputs(case, torch.float32, scale=3.0)
    a = lattice_of("numba", logits, targets, tl, ul, blank)
    r = lattice_of("torch", logits.double(), targets, tl, ul, blank)
    for f in ("alpha", "beta", "log_like", "gamma"):
        torch.testing.assert_close(getattr(a, f), getattr(r, f), rtol=1e-6, atol=1e-6, msg=f)


def test_the_reference_schedule_is_a_few_flat_tensors():
    """The torch backend's anti-diagonal schedule (cached per shape) holds its indices in a
    few flat tensors, each diagonal a view of them: one tensor per diagonal and field kept
    about 290 MB per cached shape at T = 50000 and took ~0.25 ms a diagonal to build. Every
    node is on exactly one diagonal, t ascending within it, and every kind's incoming arc
    leaves the node ``(t - dt, u - du)``."""
    from rnnt_lattice import reference
    T, U1, steps = 7, 4, ((1, 0), (0, 1), (2, 1))
    diagonals, _ = reference._schedule(T, U1, steps, torch.device("cpu"))
    assert len(diagonals) == T + U1
    base = {f: getattr(diagonals[0], f).untyped_storage().data_ptr()
            for f in ("nodes", "src_nodes", "src_w", "dst_nodes", "out_w")}
    seen = []
    for d, diag in enumerate(diagonals):
        for f, ptr in base.items():
            assert getattr(diag, f).untyped_storage().data_ptr() == ptr        # a view
        t, u = diag.nodes // U1, diag.nodes % U1
        assert (t + u == d).all() and (t.diff() > 0).all()
        seen += diag.nodes.tolist()
        n = diag.nodes.numel()
        for k, (dt, du) in enumerate(steps):
            src = diag.src_nodes[k * n:(k + 1) * n]
            ok = (t - dt >= 0) & (u - du >= 0) & (t - dt < T)
            assert torch.equal(src, torch.where(ok, (t - dt) * U1 + u - du, (T + 1) * U1))
    assert sorted(seen) == list(range((T + 1) * U1))
