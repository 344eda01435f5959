"""Inputs of the simple losses' arc terms (``_types.ArcParts``) with every kind of node, and
the comparison of two backends' outputs: shared by the Triton and Numba kernels' tests."""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def arc_parts(dtype, B=3, T=11, U1=7, mix=True, seed=2):
    """``(ArcParts, Smoothing or None)`` with every kind of node: live, without mass (dead),
    rescued with an lse and without one, on a bad frame row and a bad label row, entries of
    -inf and +inf, a sequence with U = 0 when ``U1 == 1``."""
    from rnnt_lattice._types import ArcParts, Smoothing
    g = torch.Generator().manual_seed(seed)
    f64 = dict(generator=g, dtype=torch.float64)
    mass = torch.rand(B, T, U1, **f64) * 10.0 ** torch.randint(-300, 3, (B, T, U1), generator=g)
    mass[torch.rand(B, T, U1, generator=g) < 0.15] = 0.0                     # no mass
    rescued = torch.rand(B, T, U1, generator=g) < 0.2
    lse_r = torch.where(rescued, torch.randn(B, T, U1, **f64) * 50, NEG_INF)
    lse_r[rescued & (torch.rand(B, T, U1, generator=g) < 0.3)] = NEG_INF     # rescued, dead
    am_cols = torch.randn(B, T, U1, **f64).to(dtype)
    lm_cols = torch.randn(B, U1, 2, **f64).to(dtype)
    am_cols[0, 2, :2] = NEG_INF                                              # masked classes
    lm_cols[1, 0, 1] = NEG_INF
    am_cols[2, 3, 0] = float("inf")
    am_bad = torch.zeros(B, T, dtype=torch.bool)
    lm_bad = torch.zeros(B, U1, dtype=torch.bool)
    am_bad[1, 4] = lm_bad[2, U1 - 1] = True
    shifts = (torch.randn(B, T, **f64) * 30, torch.randn(B, U1, **f64) * 30)
    terms = ()
    if mix:
        terms = (torch.randn(B, T, **f64), torch.randn(B, U1, **f64), torch.randn(B, T, **f64),
                 torch.randn(B, U1 - 1, **f64))
    parts = ArcParts(mass, lse_r, rescued, am_cols, lm_cols, *shifts, am_bad, lm_bad, *terms)
    return parts, (Smoothing(0.65, 0.2, 0.15) if mix else None)


def same(got, want, name):
    """Equal to float64 rounding (the kernels sum in another order), the same -inf, +inf
    and NaN entries."""
    assert got.shape == want.shape and got.dtype == want.dtype, name
    for special in (torch.isnan, torch.isneginf, torch.isposinf):
        assert torch.equal(special(got), special(want)), (name, special)
    ok = torch.isfinite(want)
    tol = 64 * torch.finfo(want.dtype).eps
    torch.testing.assert_close(got[ok], want[ok], rtol=tol, atol=tol, msg=name)
