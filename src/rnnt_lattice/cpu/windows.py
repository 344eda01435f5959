"""The window DP of the pruned losses' window choice (math.md section 10), a Numba kernel:
``pruned.windows.best_window_starts`` prepares the mass, ``cpu.window_dp`` runs it."""
from __future__ import annotations

import numpy as np
from numba import prange

from ._config import pjit


@pjit
def window_dp(
    # the chunk: the sequences c0 <= b < c1 (``_config.ParallelKernel``)
    c0, c1,
    # data
    mass,
    # options
    max_step,
    # outputs (arg: scratch)
    total, starts, arg,
):
    """The dynamic program of math.md section 10 (``pruned.windows.best_window_starts``
    prepares ``mass`` and documents it), one sequence per thread:

        f(0, s) = mass(0, s)
        f(t, s) = mass(t, s) + max_{max(s - max_step, 0) <= s' <= s} f(t-1, s')

    then ``total[b] = max_s f(T-1, s)`` and the argmax path backwards through ``arg``.
    Ties go to the lowest start (strictly greater replaces). Where every candidate is -inf
    the lowest one is kept, so the starts stay in ``[0, S)`` even without a finite path.

    Args: mass (B, T, S) float64 (-inf: start not allowed), T >= 1, S >= 1; outputs total
    (B,) float64, starts (B, T) int64; arg (B, T, S) int64 scratch (the best s' of each
    (t, s))."""
    B, T, S = mass.shape
    for b in prange(c0, c1):
        f = np.empty(S)
        g = np.empty(S)
        for s in range(S):
            f[s] = mass[b, 0, s]
        for t in range(1, T):
            for s in range(S):
                lo = max(s - max_step, 0)
                best = f[lo]
                k = lo
                for sp in range(lo + 1, s + 1):
                    if f[sp] > best:
                        best = f[sp]
                        k = sp
                g[s] = mass[b, t, s] + best
                arg[b, t, s] = k
            for s in range(S):
                f[s] = g[s]
        best = f[0]
        k = 0
        for s in range(1, S):
            if f[s] > best:
                best = f[s]
                k = s
        total[b] = best
        starts[b, T - 1] = k
        for t in range(T - 1, 0, -1):
            k = arg[b, t, k]
            starts[b, t - 1] = k
