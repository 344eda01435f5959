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


def check_arc_terms(impl, dtype, U1: int, mix: bool, absent: bool = True):
    """``impl.arc_terms`` and its backward (a backend: the Triton or the Numba one) against
    ``torch_backend``'s: every kind of node (:func:`arc_parts`), upstream gradients with NaN
    and a plane of a ``(B, K, T, U+1)`` tensor (strided), with ``absent`` also either one
    absent (None)."""
    from rnnt_lattice import torch_backend
    parts, smooth = arc_parts(dtype, U1=U1, mix=mix)
    B, T, _ = parts.mass.shape
    got, want = impl.arc_terms(parts, smooth), torch_backend.arc_terms(parts, smooth)
    assert got[2][1].dtype == torch.int8                       # the kernel ran, not the reference
    for name, x, y in zip(("b", "e"), got, want):
        same(x, y, name)
    g = torch.Generator().manual_seed(3)
    planes = torch.randn(B, 2, T, U1, generator=g, dtype=torch.float64)      # (B, K, T, U+1)
    planes[0, 0, 1, 0] = planes[2, 1, 5, 0] = float("nan")
    dtypes = (parts.am_cols.dtype, parts.lm_cols.dtype)
    ups = [(planes[:, 0], planes[:, 1])]
    if absent:
        ups += [(None, planes[:, 1]), (planes[:, 0], None)]
    for g_b, g_e in ups:
        out = impl.arc_terms_backward(got[2], g_b, g_e, smooth, dtypes)
        ref = torch_backend.arc_terms_backward(want[2], g_b, g_e, smooth, dtypes)
        for name, x, y in zip(("d mass", "d lse_rescued", "d am_cols", "d lm_cols"), out, ref):
            same(x, y, name)
        assert len(out[4]) == len(ref[4]) == (4 if mix else 0)
        for k, (x, y) in enumerate(zip(out[4], ref[4])):
            same(x, y, f"d {'PQRS'[k]}")


def check_simple_rows(impl, dtype, contiguous: bool):
    """``impl.simple_rows`` (ok, shift, bad, the exponentials, the entries read) and its
    backward against ``torch_backend``'s: rows with a NaN, a +inf, only -inf, some -inf
    entries, padding rows holding NaN, x contiguous or transposed (a Conv1d head's), an
    expanded idx with a class read twice (the am rows' [blank, y_0 ..]); the uni term on and
    off, no entries' gradient, NaN in rows that are not ok (zeroed); in float64 a row
    reaching 720 and 740 nats below its maximum, whose exponentials are subnormal numbers:
    within two units of the last place of the reference's, not flushed to zero."""
    from rnnt_lattice import torch_backend
    g = torch.Generator().manual_seed(4)
    B, N, V, J = 3, 7, 11, 5
    x = (30 * torch.randn(B, V, N, generator=g, dtype=torch.float64)).to(dtype).transpose(1, 2)
    x = x.contiguous() if contiguous else x
    x[0, 1, 3] = float("nan")
    x[1, 2, 0] = float("inf")
    x[2, 3] = NEG_INF
    x[0, 4, :5] = NEG_INF
    if dtype == torch.float64:
        x[2, 5, :3] = torch.tensor([0.0, -720.0, -740.0], dtype=dtype)
        x[2, 5, 3:] = -30.0
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, 5:] = False
    x[1, 6] = float("nan")                                            # padding: never read
    cols = torch.randint(0, V, (B, J), generator=g)
    cols[:, 1] = cols[:, 2]                                           # a class read twice
    idx = cols[:, None, :].expand(B, N, J)
    got, want = impl.simple_rows(x, keep, idx), torch_backend.simple_rows(x, keep, idx)
    for name, a, b in zip(("ok", "shift", "bad", "ex", "cols"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if a.is_floating_point():
            same(a, b, name)
        else:
            assert torch.equal(a, b), name
    if dtype == torch.float64:
        sub = want[3][2, 5, 1:3]
        assert (sub > 0).all() and (sub < 2.3e-308).all()             # subnormal numbers
        assert ((got[3][2, 5, 1:3] - sub).abs() <= 2 * 2.0 ** -1074).all()
    ok, ex = want[0], want[3]
    uni = torch.rand(V, generator=g, dtype=torch.float64).to(dtype)
    g_uni = torch.randn(B, N, generator=g, dtype=torch.float64)
    g_cols = torch.randn(B, N, J, generator=g, dtype=torch.float64).to(dtype)
    grad0 = torch.randn(B, N, V, generator=g, dtype=torch.float64)
    grad0[0, 1, 2] = g_uni[1, 2] = float("nan")                       # rows not ok: zeroed
    for g_u, u, g_c in ((g_uni, uni, g_cols), (None, None, g_cols), (g_uni, uni, None)):
        a, b = grad0.clone(), grad0.clone()
        impl.simple_rows_backward(a, ex, ok, g_u, u, idx, g_c)
        torch_backend.simple_rows_backward(b, ex, ok, g_u, u, idx, g_c)
        same(a, b, "grad")
