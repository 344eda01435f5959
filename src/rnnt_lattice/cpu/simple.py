"""The simple losses' Numba kernels (``pruned.simple``; ``cpu.simple_rows``,
``cpu.arc_terms`` and their backward prepare the arrays):

- the rows (``simple_rows_forward``, ``simple_rows_backward``; ``torch_backend.simple_rows``
  is the reference and has the definitions): per row of am or lm, its flags, its maximum,
  ``exp(x - max)`` in float64 and the entries its arcs read, in one pass where the
  reference makes a dozen over ``(B, T, V)`` tensors, four of them float64;
- the arc terms (``arc_terms_forward``, ``arc_terms_backward``; ``pruned.simple._ArcTerms``
  has the formulas, ``torch_backend.arc_terms`` is the reference): per node element-wise
  work over ``(B, T, U+1)`` that the reference spends some 70 PyTorch operations on, each
  a pass over a plane (and, at the small shapes of a CPU batch, mostly their dispatch).
  Without fast-math flags (``pjit(strict=True)``): the same operations in the same order
  as the reference, no reassociation of ``(am + lm) - lse``, whose terms may be far
  larger than the result."""
from __future__ import annotations

import math

import numpy as np
from numba import prange

from ._config import pjit
from .fastmath import exp64, row_max

NEG_INF = -np.inf

# The flags of a node that the backward reads (the forward's ``code``), as the Triton
# kernels' (``gpu.kernels.ARC_FIN`` ...).
ARC_FIN = 1      # lse is not -inf: the node's b and e read their entries
ARC_LIVE = 2     # lse came from the mass (not on a bad row)
ARC_RESC = 4     # lse came from the rescue (not on a bad row)


@pjit(strict=True)
def arc_terms_forward(
    # the chunk: the sequences c0 <= b < c1 (``_config.ParallelKernel``)
    c0, c1,
    # the normaliser's parts (``_types.ArcParts``): float64 but for the columns (the
    # inputs' dtype); the smoothing's terms (empty arrays without ``mix``)
    mass, lse_r, rescued, am_cols, lm_cols, am_shift, lm_shift, am_bad, lm_bad, P, Q, R, S,
    # the smoothing: on or off, its scales
    mix, c, s_am, s_lm,
    # outputs: b', e' (B, T, U+1) float64, the flags (B, T, U+1) int8
    b_out, e_out, code,
):
    """The arc log-probs of every node, one sequence per thread::

        lse = log mass + am_shift(t) + lm_shift(u)    live: mass > 0, not rescued
            = lse_rescued (rescued),  -inf (no mass),  NaN on a bad row
        b   = am(t, blank) + lm(u, blank) - lse,   e = am(t, y_u) + lm(u, y_u) - lse  (u < U)
              (-inf where lse is -inf; e -inf at u = U)
        mix: b' = (c b + (Q(u) + s_lm lm(u, blank))) + (P(t) + s_am am(t, blank))
             e' = ((c e + (S(u) + s_lm lm(u, y_u))) + s_am am(t, y_u)) + R(t)      (u < U)

    and ``code``: ``ARC_FIN | ARC_LIVE | ARC_RESC`` for :func:`arc_terms_backward`."""
    B, T, U1 = mass.shape
    U = U1 - 1
    for b in prange(c0, c1):
        for t in range(T):
            a_sh = am_shift[b, t]
            a_bad = am_bad[b, t]
            a_blank = np.float64(am_cols[b, t, 0])
            p_t = 0.0
            r_t = 0.0
            if mix:
                p_t = P[b, t] + s_am * a_blank
                r_t = R[b, t]
            for u in range(U1):
                m = mass[b, t, u]
                resc = rescued[b, t, u]
                live = m > 0.0 and not resc
                if resc:
                    lse = lse_r[b, t, u]
                elif live:
                    lse = (math.log(m) + a_sh) + lm_shift[b, u]
                else:
                    lse = NEG_INF
                bad = a_bad or lm_bad[b, u]
                if bad:
                    lse = np.nan
                fin = lse != NEG_INF
                l_blank = np.float64(lm_cols[b, u, 0])
                bb = (a_blank + l_blank) - lse if fin else NEG_INF
                ee = NEG_INF
                if u < U:
                    a_lab = np.float64(am_cols[b, t, u + 1])
                    l_lab = np.float64(lm_cols[b, u, 1])
                    ee = (a_lab + l_lab) - lse if fin else NEG_INF
                    if mix:
                        ee = ((ee * c + (S[b, u] + s_lm * l_lab)) + s_am * a_lab) + r_t
                if mix:
                    bb = (bb * c + (Q[b, u] + s_lm * l_blank)) + p_t
                b_out[b, t, u] = bb
                e_out[b, t, u] = ee
                code[b, t, u] = ((ARC_FIN if fin else 0) + (ARC_LIVE if live and not bad else 0)
                                 + (ARC_RESC if resc and not bad else 0))


@pjit(strict=True)
def arc_terms_backward(
    # the chunk: the sequences c0 <= b < c1 (``_config.ParallelKernel``)
    c0, c1,
    code, mass, g_b, g_e,
    # the smoothing: on or off, its scales
    mix, c, s_am, s_lm,
    # outputs: d mass, d lse_rescued, d am_cols (B, T, U+1); d lm_cols (B, U+1, 2); d P,
    # d R (B, T); d Q (B, U+1); d S (B, U)
    g_mass, g_resc, g_am, g_lm, dP, dR, dQ, dS,
):
    """The backward of :func:`arc_terms_forward`, one sequence per thread (its sums over t
    in the thread: no sharing), from ``G_b, G_e`` (the gradients of b', e') and ``g = c G``
    on the nodes flagged ``ARC_FIN`` (0 elsewhere)::

        d lse = -(g_b + g_e),   d mass = d lse / mass (ARC_LIVE),   d lse_rescued = d lse (ARC_RESC)
        d am(t, y_u) = g_e + s_am G_e        d am(t, blank) = sum_u g_b + s_am d P
        d lm(u, blank) = sum_t g_b + s_lm d Q,   d lm(u, y_u) = sum_t g_e + s_lm d S
        d P = sum_u G_b,  d R = sum_u G_e,  d Q = sum_t G_b,  d S = sum_t G_e

    (``c = 1`` and no ``s`` terms without ``mix``; e's gradient is read for u < U only)."""
    B, T, U1 = mass.shape
    U = U1 - 1
    for b in prange(c0, c1):
        col_gb = np.zeros(U1)
        col_ge = np.zeros(U1)
        col_Gb = np.zeros(U1)
        col_Ge = np.zeros(U1)
        for t in range(T):
            row_gb = 0.0
            row_Gb = 0.0
            row_Ge = 0.0
            for u in range(U1):
                k = code[b, t, u]
                fin = (k & ARC_FIN) != 0
                G_b = g_b[b, t, u]
                G_e = g_e[b, t, u] if u < U else 0.0
                gb = G_b * c if fin else 0.0
                ge = G_e * c if fin and u < U else 0.0
                g_lse = -gb - ge
                g_mass[b, t, u] = g_lse / mass[b, t, u] if (k & ARC_LIVE) != 0 else 0.0
                g_resc[b, t, u] = g_lse if (k & ARC_RESC) != 0 else 0.0
                if u < U:
                    g_am[b, t, u + 1] = ge + s_am * G_e if mix else ge
                row_gb += gb
                row_Gb += G_b
                row_Ge += G_e
                col_gb[u] += gb
                col_ge[u] += ge
                col_Gb[u] += G_b
                col_Ge[u] += G_e
            g_am[b, t, 0] = row_gb + s_am * row_Gb if mix else row_gb
            dP[b, t] = row_Gb
            dR[b, t] = row_Ge
        for u in range(U1):
            g_lm[b, u, 0] = col_gb[u] + s_lm * col_Gb[u] if mix else col_gb[u]
            g_lm[b, u, 1] = (col_ge[u] + s_lm * col_Ge[u] if mix else col_ge[u]) if u < U else 0.0
            dQ[b, u] = col_Gb[u]
            if u < U:
                dS[b, u] = col_Ge[u]


# exp(d) for d < -708 (a subnormal result, which ``exp64`` flushes to 0): exp(d + SUB_SHIFT)
# times 2^-512, exactly a power of two, rounded once into the subnormal range.
SUB_SHIFT = 512 * math.log(2.0)
SUB_SCALE = 2.0 ** -512


@pjit
def simple_rows_forward(
    # the chunk: the rows c0 <= r < c1 (``_config.ParallelKernel``)
    c0, c1,
    # data: rows x (B, N, V) float32/float64, the rows kept (B, N), the classes read (B, N, J)
    x, keep, idx,
    # outputs: ok, shift, bad (B, N); ex (B, N, V), cols (B, N, J) float64
    ok, shift, bad, ex, cols,
):
    """Per row ``r = (b, n)``, one per prange iteration::

        ok(r)    = keep(r) and no NaN or +inf in the row;   bad(r) = keep(r) and not ok(r)
        shift(r) = max_v x(r, v) where ok and finite, else 0
        ex(r, v) = exp(x(r, v) - shift(r)) on ok rows, else 0             (float64)
        cols(r, j) = x(r, idx(r, j)) on ok rows, else 0

    ``exp64`` (vectorised) where every ``x - shift >= -708``; a row reaching below takes
    the subnormal range too (``SUB_SHIFT``), as the reference's exp does."""
    B, N, V = x.shape
    J = idx.shape[2]
    for r in prange(c0, c1):
        b = r // N
        n = r - b * N
        row = x[b, n]
        out = ex[b, n]
        m = np.float64(row_max(row))                   # NaN exactly when the row holds one
        good = keep[b, n] and m < np.inf                   # False for NaN and +inf
        ok[b, n] = good
        bad[b, n] = keep[b, n] and not good
        s = m if good and m > NEG_INF else 0.0
        shift[b, n] = s
        if not good:
            for v in range(V):
                out[v] = 0.0
            for j in range(J):
                cols[b, n, j] = 0.0
            continue
        lo = np.float64(row[0])
        for v in range(V):
            xv = np.float64(row[v])
            lo = xv if xv < lo else lo
        if lo - s >= -708.0:
            for v in range(V):
                out[v] = exp64(np.float64(row[v]) - s)
        else:
            for v in range(V):
                d = np.float64(row[v]) - s
                out[v] = exp64(d) if d >= -708.0 else exp64(d + SUB_SHIFT) * SUB_SCALE
        for j in range(J):
            cols[b, n, j] = row[idx[b, n, j]]


@pjit
def simple_rows_backward(
    # the chunk: the rows c0 <= r < c1 (``_config.ParallelKernel``)
    c0, c1,
    # in/out: the gradient w.r.t. ex (B, N, V) float64, then w.r.t. x; ex, ok of the forward
    grad, ex, ok,
    # the uni term (float64; empty arrays without), the entries' gradient (float64)
    has_uni, g_uni, uni, idx, has_cols, g_cols,
):
    """The backward of :func:`simple_rows_forward` in place, per row::

        grad(r, v) = (grad(r, v) + g_uni(r) uni(v)) ex(r, v)     (has_uni; else grad ex)
                     + sum_{j: idx(r, j) = v} g_cols(r, j)          (has_cols, j in order)
                     on ok rows, 0 elsewhere"""
    B, N, V = grad.shape
    J = idx.shape[2]
    for r in prange(c0, c1):
        b = r // N
        n = r - b * N
        g = grad[b, n]
        e = ex[b, n]
        if not ok[b, n]:
            for v in range(V):
                g[v] = 0.0
            continue
        if has_uni:
            gu = g_uni[b, n]
            for v in range(V):
                g[v] = (g[v] + gu * uni[v]) * e[v]
        else:
            for v in range(V):
                g[v] = g[v] * e[v]
        if has_cols:
            for j in range(J):
                g[idx[b, n, j]] += g_cols[b, n, j]
