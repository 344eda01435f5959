"""Numba kernels of the CPU backend for every topology (math.md section 9): NumPy arrays in,
NumPy arrays out, driven by a table of arc kinds.

Three passes, as in docs/math.md:

1. ``row_pass`` — over the logits rows ``(N, V)``, parallel over lattice rows ``(b, t)``:
   per node the row max ``m``, ``exp(x - m)`` (stored in the gradient buffer when a
   gradient is wanted), ``1 / sum`` of each softmax group (tokens; TDT's durations), and
   the weight of every arc kind leaving the node.
2. ``lattice`` — per sequence (parallel over the batch): alpha, beta, log P and the per-kind
   occupations ``gamma``, all in float64, row by row.
3. ``grad_rows`` — over the buffer again: turns the stored exps into the gradient with one
   multiply per element (clamp and FastEmit fused), scaled by the upstream gradient.

``viterbi`` is ``lattice``'s alpha sweep in the max-plus semiring, node by node, recording
the best incoming kind of every node for the alignment's backtrack. The plain regular loss runs its own passes 1 and 3 (``regular``) and this
pass 2; the fast math they share is ``fastmath``.

Compilation: the kernels are ``@pjit`` (``_config.ParallelKernel``): each is compiled
once, without ``parallel=True``, and runs the iterations ``c0 <= p < c1`` of its outer
``prange`` loop (independent iterations: sequences, ranges of frames, rows) that it is
given; ``_config`` runs a call's iterations as chunks on Numba's threads, or in the calling
thread (``RNNT_LATTICE_NUMBA_PARALLEL=0``, forked children, a single chunk). The helpers
are ``@njit(**JIT)`` and get compiled into each kernel. Each kernel is compiled once per
logits dtype (ids arrive as int64); ``rnnt-lattice warmup`` compiles them all ahead
(docs/benchmarks.md, "First use").

The arc kinds are the ``(N_FIELDS, K)`` int64 table of :func:`kind_table`, one row per
field of ``topology.ArcKind``, one column per kind:

    DT, DU           kind k leaves node (t, u) and lands on (t + dt, u + du)
    CLASS_ID         the token class it reads: a fixed id (``reads`` "blank" or "class"),
                     or -1 for the label y[u] (``reads`` "label")
    DURATION         index of the duration softmax group it also reads (TDT), -1 for none
    PLUS_NEXT_BLANK  1: also reads the blank of node (t, u+1) (k2 "constrained")
    FASTEMIT         1: the gradient of its class read carries the FastEmit factor (1 + lambda)
    DELAY            1: + delay_penalty * ((t1 - 1)/2 - t) on its weight
    MAY_END          1: may land on the end frame t1 (only at the end node (t1, u1))

The logits are rows ``(N, V)``, ``V = V_tok + n_durations``, and node (b, t, u) reads row
``node_rows[b, t, u]`` (-1: no row, every arc of the node is -inf). The padded layout
``(B, T, U+1, V)`` is the identity map over ``(B*T*(U+1), V)``. Each sequence has a start
(t0, u0) and an end (t1, u1) (k2's boundary; by default (0, 0) and (T_b, U_b)); the rows
of the region ``t0 <= t < t1, u0 <= u <= u1`` are read, every other row is padding.
The kind table is read once per row (b, t), never per node or per element.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import njit, prange

from ..topology import Topology
from ._config import JIT, frame_at, pjit
from .fastmath import (NEG_INF, clip, exp64, exp_nonpos, exp_store, exp_sum, lae, log64,
                       nan_max, row_max, scale_row)

DT, DU, CLASS_ID, DURATION, PLUS_NEXT_BLANK, FASTEMIT, DELAY, MAY_END = range(8)
N_FIELDS = 8


@functools.lru_cache(maxsize=64)
def kind_table(topo: Topology, blank: int) -> np.ndarray:
    """The arc kinds of ``topo`` as the ``(N_FIELDS, K)`` int64 table the kernels read, one
    row per ``ArcKind`` field (``DT`` ...): the class each kind reads resolved to a token id
    (-1: the label y[u]). Read-only: it is shared by every call with this topology and
    blank."""
    rows = []
    for k in topo.kinds:
        cls = blank if k.reads == "blank" else (k.class_id if k.reads == "class" else -1)
        rows.append((k.dt, k.du, cls, k.duration, int(k.plus_next_blank), int(k.fastemit),
                     int(k.delay), int(k.may_end)))
    table = np.ascontiguousarray(np.array(rows, dtype=np.int64).T.reshape(N_FIELDS, -1))
    table.setflags(write=False)
    return table


# --------------------------------------------------------------------------- arc spans
@njit(**JIT)
def _is_arc(kinds, k, t, u, t1, u1):
    """Whether kind k leaving region node (t, u) is an arc (math.md 9.1, ``arc_mask``):
    it lands on ``u + du <= u1`` and ``t + dt < t1``, or exactly on the end node for a
    kind that may end."""
    lt = t + kinds[DT, k]
    lu = u + kinds[DU, k]
    if lu > u1:
        return False
    if lt < t1:
        return True
    return kinds[MAY_END, k] != 0 and lt == t1 and lu == u1


@njit(**JIT)
def _class_slots(kinds):
    """The distinct classes the kinds read, once each: ``(cls, slot)``, ``cls`` (n,) the
    class of each slot (-1: the label y[u]) and ``slot`` (K,) the slot of each kind. A node
    reads its n <= K slots once, however many kinds share them (TDT: 9 kinds, 2 slots)."""
    K = kinds.shape[1]
    cls = np.empty(K, dtype=np.int64)
    slot = np.empty(K, dtype=np.int64)
    n = 0
    for k in range(K):
        c = kinds[CLASS_ID, k]
        j = 0
        while j < n and cls[j] != c:
            j += 1
        if j == n:
            cls[n] = c
            n += 1
        slot[k] = j
    return cls[:n], slot


@njit(**JIT)
def _sizes(node_rows, kinds, V, n_durations):
    """What the per-row kernels size their work by: ``(B, T, U1)`` of the lattice, K kinds,
    ``V_tok`` token classes, the class slots ``(cls, slot)`` (``_class_slots``) and their
    number ``nc``, and ``nd``: the duration group's size, at least 1 (scratch rows)."""
    B, T, U1 = node_rows.shape
    cls, slot = _class_slots(kinds)
    return B, T, U1, kinds.shape[1], V - n_durations, cls, slot, cls.shape[0], max(n_durations, 1)


@njit(**JIT)
def _arc_spans(kinds, t, u0, t1, u1, lo, hi):
    """Where each kind is an arc on region frame ``t0 <= t < t1`` (``_is_arc``, one test per
    kind per frame instead of per node): kind k on the nodes ``lo[k] <= u <= hi[k]`` (empty
    when lo > hi): ``u0 .. u1 - du`` when it lands before t1, only ``u1 - du`` when it may
    end and lands on t1. Every span ends at u1 - 1 or u1, so a union of spans is a span."""
    for k in range(kinds.shape[1]):
        lt = t + kinds[DT, k]
        h = u1 - kinds[DU, k]
        if lt < t1:
            lo[k] = u0
        elif lt == t1 and kinds[MAY_END, k] != 0:
            lo[k] = max(h, u0)
        else:
            lo[k] = h + 1
        hi[k] = h


@njit(**JIT)
def _frame_spans(kinds, slot, t, u0, t1, u1, lo, hi, slo, shi):
    """Where each kind (``lo``, ``hi``: ``_arc_spans``) and each class slot (``slo``,
    ``shi``: the union of its kinds' spans) is an arc on region frame t."""
    _arc_spans(kinds, t, u0, t1, u1, lo, hi)
    for j in range(slo.shape[0]):
        slo[j], shi[j] = _union_spans(kinds, slot, j, 0, lo, hi)


@njit(**JIT)
def _union_spans(kinds, slot, j, field, lo, hi):
    """(lo, hi) of the union of the spans of the kinds in slot ``j`` (``j < 0``: the kinds
    whose ``field`` is set); (0, -1) when there are none."""
    a = 1 << 40
    z = -1
    for k in range(kinds.shape[1]):
        sel = slot[k] == j if j >= 0 else kinds[field, k] != 0
        if sel and lo[k] <= hi[k]:
            a = min(a, lo[k])
            z = max(z, hi[k])
    if z < 0:
        return 0, -1
    return a, z


@njit(**JIT)
def _read_lp(entry, lse):
    """Log-prob of one entry of a softmax group whose row log-normaliser is ``lse`` (0 in
    log-prob mode, where a +inf entry was already turned into NaN); a dead row (all -inf,
    ``lse = -inf``) gives -inf."""
    if lse == NEG_INF:
        return NEG_INF
    return entry - lse


@njit(**JIT)
def _duration_stats(dx, dex, d_row, n, store, buf, V_tok, shift_d, inv_sum_d, lpd):
    """The duration group (fused mode) of every node u of a row with ``d_row[u] >= 0``,
    from its entries ``dx[:n, u]``: shift_d[u] = m, inv_sum_d[u] = 1 / sum exp(x - m),
    lpd[j, u] = x_j - lse, and the exps into row ``d_row[u]`` of ``buf`` when ``store``
    (the same float ops as ``exp_store``). Loops over the nodes, not over the n ~ 5
    entries of one node, so that they vectorise. A dead group (all -inf): m = -inf,
    inv_sum 0, lpd -inf; a NaN or +inf in it: inv_sum and lpd NaN (math.md 8.1); both
    store zeros."""
    U1 = d_row.shape[0]
    m_row = dx[0].copy()
    for j in range(1, n):
        x_row = dx[j]
        for u in range(U1):
            m, x = m_row[u], x_row[u]
            m_row[u] = x if (m == m and not x <= m) else m     # a NaN wins and stays
    s_row = np.zeros(U1)
    for j in range(n):
        x_row = dx[j]
        e_row = dex[j]
        for u in range(U1):
            e = exp_nonpos(x_row[u] - m_row[u])
            e_row[u] = e
            s_row[u] += e
    for u in range(U1):
        r = d_row[u]
        if r < 0:
            continue
        m = m_row[u]
        shift_d[u] = m
        live = m > NEG_INF and m < np.inf
        if live:
            inv_sum_d[u] = 1.0 / s_row[u]
            lse = np.float64(m) + math.log(s_row[u])
        else:
            inv_sum_d[u] = 0.0 if m == NEG_INF else np.nan
            lse = NEG_INF if m == NEG_INF else np.nan
        for j in range(n):
            lpd[j, u] = _read_lp(np.float64(dx[j, u]), lse)
            if store:
                buf[r, V_tok + j] = dex[j, u] if live else 0.0


@njit(**JIT)
def _read_entries(row, cls, slo, shi, u, y, V_tok, n_durations, has_plus_next_blank, blank, xc,
                  xd):
    """The entries node u reads: ``xc[j, u]`` that of each class slot j whose span holds u
    (class -1: the label ``y``), in the row's dtype (the log-probs are formed a slot at a
    time along its span: ``_class_lps``), ``xd`` the durations in float64; returns the
    blank's entry in float64 (-inf unless ``has_plus_next_blank``)."""
    for j in range(cls.shape[0]):
        if u >= slo[j] and u <= shi[j]:
            c = cls[j]
            xc[j, u] = row[y if c < 0 else c]
    for j in range(n_durations):
        xd[j] = np.float64(row[V_tok + j])
    return np.float64(row[blank]) if has_plus_next_blank else NEG_INF


@njit(**JIT)
def _gather_entries(rows, node_rows, y, cls, slo, shi, xc):
    """Out of place, after the frame's nodes were streamed (their rows are still in the
    cache): ``xc[j, u]`` = the entry of class slot j (class -1: the label ``y[u]``) of each
    node with a row along the slot's span ``slo[j] <= u <= shi[j]``, a slot at a time (read
    per node, a loop over the slots with a span test each, the multi-blank row pass took
    6-11% longer at s3 and s4)."""
    for j in range(cls.shape[0]):
        c = cls[j]
        for u in range(slo[j], shi[j] + 1):
            r = node_rows[u]
            if r >= 0:
                xc[j, u] = rows[r, (y[u] if u < y.shape[0] else 0) if c < 0 else c]


@njit(**JIT)
def _class_lps(xc, lse_u, slo, shi, fused, lpc):
    """``lpc[j, u] = _read_lp(xc[j, u], lse_u[u])`` along each class slot's span ``slo[j]
    <= u <= shi[j]`` (the other entries stay -inf), in loops over the nodes that
    vectorise; in log-prob mode a +inf entry is read as NaN (math.md 8.1)."""
    for j in range(xc.shape[0]):
        a = slo[j]
        n = shi[j] - a + 1
        if n <= 0:
            continue
        x_row = xc[j, a:a + n]
        l_row = lse_u[a:a + n]
        o_row = lpc[j, a:a + n]
        for u in range(n):
            x = np.float64(x_row[u])
            if not fused:
                x = np.nan if x == np.inf else x
            o_row[u] = _read_lp(x, l_row[u])


# --------------------------------------------------------------------------- pass 1
@pjit
def row_pass(
    # the chunk: the ranges of frames c0 <= p < c1 (``_config.ParallelKernel``)
    c0, c1,
    # data
    rows, node_rows, targets, t0s, u0s, t1s, u1s,
    # arc kinds
    kinds, blank, n_durations,
    # options: the per-arc terms
    sigma, delay_penalty,
    # flags
    fused, store,
    # schedule: the ranges of frames (``_config.frame_ranges``), the window of frames
    bounds, f0, f1,
    # outputs
    buf, shift, inv_sum, shift_d, inv_sum_d, e_read, w, nan_row,
):
    """Pass 1 for any topology: row statistics and the arc weights (math.md 1 and 9).

    Args:
        rows: (N, V) float32/float64 logits rows (``V = V_tok + n_durations``), C-contiguous.
        node_rows: (B, T, U+1) int64, the row of each node or -1.
        targets: (B, U) int64. t0s, u0s, t1s, u1s: (B,) int64 start and end of each lattice.
        kinds: (N_FIELDS, K) int64 arc-kind table. blank: blank id in [0, V_tok).
        n_durations: size of the duration group (TDT), 0 otherwise.
        sigma, delay_penalty: the per-arc terms.
        fused: raw scores (else log-probs). store: write exp(x - m) of each group into
            ``buf`` (N, V) (zeros in padding rows); ``buf`` may be ``rows`` (in-place mode).
        bounds: contiguous ranges of frames in memory order (``_config.frame_ranges``
            over the frames ``f0 <= t < f1`` of every sequence: a fused tile's; else 0 and
            T, every frame, each of whose nodes gets its outputs); the call runs the ranges
            ``c0 <= p < c1`` (``_config.ParallelKernel``: a chunk of them a thread).
    Outputs, written on every node:
        shift, shift_d (B, T, U+1) dtype of rows: token / duration group row max.
        inv_sum, inv_sum_d (B, T, U+1) float64: 1 / sum exp(x - m) of each group.
        e_read (B, T, U+1, E) dtype of rows, E > the number of class slots
            (``_class_slots``), written when ``store``: the stored exp of each slot's class
            (the label's: any entry where no label arc leaves), and in column n_slots the
            blank's when a kind is ``plus_next_blank``: ``grad_rows`` reads them.
        w (B, K, T, U+1) float64: arc weights (``reference.arc_weights``), -inf off the arcs:

            w_k(t,u) = x[class_id_k] - lse + [duration_k] (x[V_tok + duration_k] - lse_d)
                       + [plus_next_blank_k] b(t, u+1) - sigma
                       + [delay_k] delay_penalty ((t1-1)/2 - t)

        nan_row (B, T) uint8: 1 where an arc weight of the row (b, t) is NaN.
    Only arc entries are read before the row is overwritten (in-place mode); in log-prob
    mode only arc entries are read at all, a +inf one as NaN (math.md 8.1).

    Per row (b, t): a loop over the nodes, the group statistics (and in place or in
    log-prob mode the entries each node reads); then loops along each class slot's span of
    nodes (``_class_slots``, ``_frame_spans``), the entries out of place and the log-prob
    of each class read; the duration group's; then over the kinds, the weights along each
    kind's span of nodes (``_arc_spans``). Out of place, the entries are read after the
    exps, from the rows they just streamed into the cache (read before, an entry far from
    the row's start waits a full memory latency: TDT's and multi-blank's blanks are the
    last tokens; measured 15-20% of this pass at V = 512).
    """
    B, T, U1, K, V_tok, cls, slot, nc, nd = _sizes(node_rows, kinds, rows.shape[1], n_durations)
    has_plus_next_blank = False
    for k in range(K):
        if kinds[PLUS_NEXT_BLANK, k] != 0:
            has_plus_next_blank = True
    read_first = not fused or (store and buf.ctypes.data == rows.ctypes.data)
    for p in prange(c0, c1):
        for i in range(bounds[p], bounds[p + 1]):
            b, t = frame_at(i, f0, f1)
            t0, u0, t1, u1 = t0s[b], u0s[b], t1s[b], u1s[b]
            in_t = t >= t0 and t < t1
            delay_term = delay_penalty * ((t1 - 1) / 2.0 - t)
            # 1. Scratch of the row: spans (int) and per-node log-probs (float64).
            ispan = np.empty(2 * K + 2 * nc, dtype=np.int64)
            lo, hi = ispan[:K], ispan[K:2 * K]
            slo, shi = ispan[2 * K:2 * K + nc], ispan[2 * K + nc:]
            U2 = U1 + 1
            fscr = np.empty((nc + nd + 2) * U2 + nd)
            lpc = fscr[:nc * U2].reshape(nc, U2)          # log-prob of each slot's class
            lpd = fscr[nc * U2:(nc + nd) * U2].reshape(nd, U2)   # ... of each duration
            blank_lp = fscr[(nc + nd) * U2:(nc + nd + 1) * U2]   # b(t, u) (plus_next_blank)
            lse_u = fscr[(nc + nd + 1) * U2:(nc + nd + 2) * U2]  # the token group's lse
            xd = fscr[(nc + nd + 2) * U2:]
            xc = np.empty((nc, U2), dtype=rows.dtype)     # the entry of each slot's class
            lpc[:, :] = NEG_INF
            lpd[:, :] = 0.0
            blank_lp[:] = NEG_INF
            lse_u[:] = NEG_INF                            # (a node without a row: no arc)
            # The duration group of every node of the row (fused): entries, exps, row index.
            nu_d = U1 if fused and n_durations > 0 else 0
            dx = np.empty((nd, nu_d), dtype=rows.dtype)
            dex = np.empty((nd, nu_d), dtype=rows.dtype)
            d_row = np.full(nu_d, -1, dtype=np.int64)
            # 2. Where each kind, and each class slot, is an arc on this frame.
            if in_t:
                _frame_spans(kinds, slot, t, u0, t1, u1, lo, hi, slo, shi)
            else:
                for k in range(K):
                    lo[k], hi[k] = 0, -1
            # 3. The nodes: group statistics, exps stored, log-probs of the classes read.
            for u in range(U1):
                shift[b, t, u] = 0.0
                shift_d[b, t, u] = 0.0
                inv_sum[b, t, u] = 0.0
                inv_sum_d[b, t, u] = 0.0
                r = node_rows[b, t, u]
                if r < 0:
                    continue
                if not (in_t and u >= u0 and u <= u1):   # padding: never read, gradient 0
                    if store:
                        buf[r, :] = 0.0
                    continue
                row = rows[r]
                out = buf[r] if store else row            # (never written unless store)
                y = targets[b, u] if u < targets.shape[1] else 0
                # In place the exps overwrite the row: read the arc entries first. Otherwise
                # the classes' after the frame's nodes (``_gather_entries``), from the rows they
                # streamed into the cache: a read far ahead of that stream waits a full memory
                # latency.
                x_blank = NEG_INF
                if read_first:
                    x_blank = _read_entries(row, cls, slo, shi, u, y, V_tok, n_durations,
                                            has_plus_next_blank, blank, xc, xd)
                lse = 0.0                                 # log-prob mode: rows are normalised
                lse_d = 0.0
                if fused:
                    # The token group inline (as a call, the exp loop runs ~30% slower).
                    seg = row[:V_tok]
                    m = row_max(seg)
                    shift[b, t, u] = m
                    if m == NEG_INF:                      # every class masked: no arc leaves
                        lse = NEG_INF
                        if store:
                            out[:V_tok] = 0.0
                    elif not m < np.inf:                  # a NaN or +inf: its softmax is
                        lse = np.nan                      # undefined, the arcs are NaN
                        inv_sum[b, t, u] = np.nan
                        if store:
                            out[:V_tok] = 0.0
                    else:
                        if store:
                            s = exp_store(seg, m, out[:V_tok])
                        else:
                            s = exp_sum(seg, m)
                        inv_sum[b, t, u] = 1.0 / s
                        lse = np.float64(m) + math.log(s)
                    if not read_first and has_plus_next_blank:
                        x_blank = np.float64(row[blank])
                    if store:                             # the exps the gradient pass reads
                        for j in range(nc):
                            c = cls[j]
                            if c < 0:
                                c = y if y >= 0 and y < V_tok else 0   # (no label read: any)
                            e_read[b, t, u, j] = out[c]
                        if has_plus_next_blank:
                            e_read[b, t, u, nc] = out[blank]
                    if n_durations > 0:                   # (its statistics: step 4)
                        d_row[u] = r
                        for j in range(n_durations):
                            dx[j, u] = row[V_tok + j]
                else:                                     # a log-prob of +inf is invalid: NaN
                    if x_blank == np.inf:
                        x_blank = np.nan
                    for j in range(n_durations):
                        if xd[j] == np.inf:
                            xd[j] = np.nan
                blank_lp[u] = _read_lp(x_blank, lse)
                lse_u[u] = lse
                if not fused:
                    for j in range(n_durations):
                        lpd[j, u] = _read_lp(xd[j], lse_d)
            # 4. The log-probs of the classes read, slot by slot along its span; the duration
            # group of the row's nodes; both in loops over the nodes.
            if in_t:
                if not read_first:
                    _gather_entries(rows, node_rows[b, t], targets[b], cls, slo, shi, xc)
                _class_lps(xc, lse_u, slo, shi, fused, lpc)
            if fused and n_durations > 0:
                _duration_stats(dx, dex, d_row, n_durations, store, buf, V_tok, shift_d[b, t],
                                inv_sum_d[b, t], lpd)
            # 5. The weights, kind by kind along its span (a node without a row: -inf).
            bad = 0
            for k in range(K):
                w[b, k, t, :] = NEG_INF
                n = hi[k] - lo[k] + 1
                if n <= 0:
                    continue
                a = lo[k]
                d = kinds[DURATION, k]
                delay = kinds[DELAY, k] != 0
                plus_next_blank = kinds[PLUS_NEXT_BLANK, k] != 0
                c_row = lpc[slot[k], a:a + n]
                d_row = lpd[max(d, 0), a:a + n]
                nb_row = blank_lp[a + 1:a + 1 + n]
                r_row = node_rows[b, t, a:a + n]
                w_row = w[b, k, t, a:a + n]
                for u in range(n):
                    x = c_row[u]
                    if d >= 0:
                        x += d_row[u]
                    x -= sigma
                    if delay:
                        x += delay_term
                    if plus_next_blank:
                        x += nb_row[u]
                    x = x if r_row[u] >= 0 else NEG_INF
                    w_row[u] = x
                    bad |= x != x
            nan_row[b, t] = bad


# --------------------------------------------------------------------------- pass 2
@njit(**JIT)
def _log_p(x, nan_row, b, t0, t1):
    """log P of sequence b as its sweep left it (``x``), or NaN when any arc weight of its
    frames is NaN (``nan_row``), even off every complete path (math.md 8.1)."""
    for t in range(t0, t1):
        if nan_row[b, t] != 0:
            return np.nan
    return x


@pjit
def lattice(
    # the chunk: the sequences c0 <= b < c1 (``_config.ParallelKernel``)
    c0, c1,
    # data
    w, nan_row, t0s, u0s, t1s, u1s,
    # arc kinds
    kinds,
    # outputs
    alpha, beta, log_like, gamma,
):
    """Pass 2 for any topology: alpha, beta, log P and per-kind occupations, one sequence
    per thread (math.md sections 2, 3 and 9), on the nodes ``t0 <= t <= t1, u0 <= u <= u1``
    (frame t1 is the virtual end frame):

        alpha(t0, u0) = 0,  alpha(t,u) = lae_k  alpha(t - dt_k, u - du_k) + w_k(t - dt_k, u - du_k)
        beta(t1, u1)  = 0,  beta(t,u)  = lae_k  w_k(t,u) + beta(t + dt_k, u + du_k)
        log P = beta(t0, u0)
        gamma_k(t,u)  = exp(alpha(t,u) + w_k(t,u) + beta(t + dt_k, u + du_k) - log P)

    Args: w (B, K, T, U+1) float64 arc weights (-inf off the arcs), nan_row (B, T) from
    ``row_pass``. Outputs: alpha, beta (B, T+1, U+1) float64, filled with -inf on
    entry (only each sequence's nodes are written); log_like (B,); gamma (B, K, T, U+1)
    zero-filled on entry. Every kind has dt >= 0, du in {0, 1}, dt + du >= 1, so rows in
    order (t outer, u inner) respect the alpha dependencies, and in reverse those of beta.
    A NaN arc weight anywhere makes log P NaN and every occupation NaN (math.md 8.1); no
    frame (t1 <= t0) or no path: log P = -inf, occupations 0.

    Row by row (``_row_terms``, ``_row_chain``): the kinds with dt >= 1 read finished rows,
    so their terms are summed for the whole row in loops over u that vectorise; only the
    kinds with dt = 0 (du = 1: a step along the row) leave a serial recursion, carried as
    (max, scaled sum) so that its exps and the log of each node stay off the dependency
    chain. Alpha (rows ascending) and beta (rows descending) alternate row by row. Where
    the arcs leave only part of some frame (the pruned loss's windows of R nodes), each
    row runs over the nodes whose value may be finite: beta's, the frame's nodes with an
    arc (``_frame_arcs``); alpha's, the hull of the nodes the arcs into the row land on
    (``_alpha_span``); the occupations over the nodes with an arc.
    """
    B, K, T, U1 = w.shape
    for b in prange(c0, c1):
        t0, u0, t1, u1 = t0s[b], u0s[b], t1s[b], u1s[b]
        if t1 <= t0:                                  # no frame, no path
            log_like[b] = NEG_INF
            continue
        # 1. alpha (rows ascending) and beta (rows descending), alternating row by row,
        # each row over the nodes where its values may be finite (``_frame_arcs``): the
        # others keep their -inf.
        nu = u1 - u0 + 1
        am, asum, bm, bsum = np.empty(nu), np.empty(nu), np.empty(nu), np.empty(nu)
        w0 = np.empty(nu)                             # the dt = 0 kinds of a row, lae'd
        flo, fhi = _frame_arcs(w, kinds, b, t0, t1, u0, u1)
        full = True                                   # arcs across every frame: whole rows
        for i in range(t1 - t0):
            full = full and flo[i] == u0 and fhi[i] == u1
        for i in range(t1 - t0 + 1):
            t = t0 + i
            a, z = (u0, u1) if full else _alpha_span(kinds, t, t0, t1, u0, u1, flo, fhi)
            if a <= z:
                _row_terms(w, kinds, b, t, t0, t1, a, z - a + 1, u0, u1, alpha, am, asum,
                           False)
                n0 = _row_w0(w, kinds, b, t, t1, a, z - a + 1, w0)
                _row_chain(alpha[b, t, a:z + 1], am, asum, w0, n0, i == 0, False)
            t = t1 - i
            if i == 0:                                # the end frame has no outgoing arc
                beta[b, t, u1] = 0.0
                continue
            a, z = (u0, u1) if full else (flo[t - t0], fhi[t - t0])   # the nodes with an arc
            if a <= z:
                _row_terms(w, kinds, b, t, t0, t1, a, z - a + 1, u0, u1, beta, bm, bsum, True)
                n0 = _row_w0(w, kinds, b, t, t1, a, z - a + 1, w0)
                _row_chain(beta[b, t, a:z + 1], bm, bsum, w0, n0, False, True)
        # 2. log P.
        ll = _log_p(beta[b, t0, u0], nan_row, b, t0, t1)
        log_like[b] = ll
        if ll == NEG_INF:                             # impossible: no occupation, no gradient
            continue
        # 3. The occupations.
        if ll != ll:                                  # NaN: every arc's occupation is NaN
            for k in range(K):
                for t in range(t0, t1):
                    for u in range(u0, u1 + 1):
                        if _is_arc(kinds, k, t, u, t1, u1):
                            gamma[b, k, t, u] = np.nan
            continue
        # Over slices so that the loops vectorise (``exp64``); w is -inf off the arcs, where
        # the exp gives 0. The exponent is <= 0 but for rounding: its terms are <= 0 (but a
        # delay penalty's few) and, near 0, sum to about log P, so rounding moves it by
        # about eps |log P|. Only a |log P| beyond ~1e12 can push it far above 0, where
        # exp64 is not exp: there it is clamped at 0 (an occupation is at most 1); the
        # clamp in every loop cost 7% of a lattice-bound step.
        huge = abs(ll) > 1e12
        for k in range(K):
            dt = kinds[DT, k]
            du = kinds[DU, k]
            for t in range(t0, min(t1, t1 - dt + 1)):
                a = flo[t - t0]                       # (w is -inf off the frame's arcs)
                n = min(fhi[t - t0], u1 - du) - a + 1
                if n <= 0:
                    continue
                a_row = alpha[b, t, a:a + n]
                w_row = w[b, k, t, a:a + n]
                n_row = beta[b, t + dt, a + du:a + du + n]
                g_row = gamma[b, k, t, a:a + n]
                if huge:
                    for u in range(n):
                        z = a_row[u] + w_row[u] + n_row[u] - ll
                        g_row[u] = exp64(0.0 if z > 0.0 else z)
                else:
                    for u in range(n):
                        g_row[u] = exp64(a_row[u] + w_row[u] + n_row[u] - ll)


@njit(**JIT)
def _frame_arcs(w, kinds, b, t0, t1, u0, u1):
    """``(lo, hi)``, each ``(t1 - t0,)``: per region frame t the first and last node u0
    <= u <= u1 with an arc (a weight of some kind that is not -inf; NaN counts), lo > hi
    where there is none. A scan from each end: a few reads a frame where the arcs span
    the frame (the padded layout), the gap where they do not (the pruned loss's windows
    of R nodes)."""
    K = kinds.shape[1]
    n = max(t1 - t0, 0)
    lo = np.full(n, u1 + 1, dtype=np.int64)
    hi = np.full(n, u0 - 1, dtype=np.int64)
    for i in range(n):
        t = t0 + i
        for u in range(u0, u1 + 1):
            if _has_arc(w, K, b, t, u):
                lo[i] = u
                break
        if lo[i] > u1:
            continue
        for u in range(u1, lo[i] - 1, -1):
            if _has_arc(w, K, b, t, u):
                hi[i] = u
                break
    return lo, hi


@njit(**JIT)
def _has_arc(w, K, b, t, u):
    """Whether a weight of node (t, u) is not -inf (an arc; NaN counts)."""
    for k in range(K):
        if not w[b, k, t, u] == NEG_INF:
            return True
    return False


@njit(**JIT)
def _alpha_span(kinds, t, t0, t1, u0, u1, flo, fhi):
    """``(a, z)``: the nodes of row t whose alpha may be finite, the hull of the nodes
    the arcs of the frames before it reach (kind k from frame t - dt_k: ``flo + du_k ..
    fhi + du_k``; ``_frame_arcs``), and the start node on t0; a > z: none. Elsewhere no arc
    arrives and alpha stays -inf."""
    a = u0 if t == t0 else u1 + 1
    z = u0 if t == t0 else u0 - 1
    for k in range(kinds.shape[1]):
        src = t - kinds[DT, k]
        if src < t0 or src >= t1:
            continue
        lo, hi = flo[src - t0], fhi[src - t0]
        if lo <= hi:
            du = kinds[DU, k]
            a = min(a, lo + du)
            z = max(z, hi + du)
    return max(a, u0), min(z, u1)


@njit(**JIT)
def _term_span(du, a, nu, r0, u1, backward):
    """``(src, j0, n)``: the nodes ``src .. src + n - 1`` an arc of a kind with ``du``
    leaves, into (alpha) or out of (beta) the nodes ``a + j0 .. `` of the span ``a <= u <
    a + nu`` of a row, within the region's positions ``r0 .. u1``. Beta: the span's nodes
    whose arc lands at most on u1. Alpha: the sources u - du of the span's nodes, from
    a - 1 for du = 1 where that is a region node (>= r0): the span starts where the first
    arc lands, which may leave the node left of it on an earlier frame."""
    if backward:
        return a, 0, min(nu, u1 + 1 - du - a)
    src = max(a - du, r0)
    j0 = src + du - a
    return src, j0, nu - j0


@njit(**JIT)
def _row_terms(w, kinds, b, t, t0, t1, a, nu, r0, u1, node, m, s, backward):
    """The arcs of the kinds with dt >= 1 into (alpha: ``backward`` False) or out of
    (beta) the nodes ``a <= u < a + nu`` of row t (``_term_span``), whose other ends lie
    in finished rows of ``node``: per node j = u - a their max ``m[j]`` (-inf: none; NaN
    wins) and ``s[j] = sum exp(x - m)`` (``m`` read as 0 where it is -inf, so that s is 0
    there). ``r0 .. u1``: the region's positions."""
    K = kinds.shape[1]
    for j in range(nu):
        m[j] = NEG_INF
        s[j] = 0.0
    for k in range(K):
        dt = kinds[DT, k]
        du = kinds[DU, k]
        if dt == 0 or (t + dt > t1 if backward else t - dt < t0):
            continue
        src, j0, n = _term_span(du, a, nu, r0, u1, backward)
        if backward:                                  # w_k(t,u) + beta(t+dt, u+du)
            xa = w[b, k, t, src:src + n]
            xb = node[b, t + dt, src + du:src + du + n]
        else:                                         # alpha(t-dt, u-du) + w_k(t-dt, u-du)
            xa = w[b, k, t - dt, src:src + n]
            xb = node[b, t - dt, src:src + n]
        mm = m[j0:j0 + n]
        for j in range(n):
            mm[j] = nan_max(mm[j], xa[j] + xb[j])
    for k in range(K):
        dt = kinds[DT, k]
        du = kinds[DU, k]
        if dt == 0 or (t + dt > t1 if backward else t - dt < t0):
            continue
        src, j0, n = _term_span(du, a, nu, r0, u1, backward)
        if backward:
            xa = w[b, k, t, src:src + n]
            xb = node[b, t + dt, src + du:src + du + n]
        else:
            xa = w[b, k, t - dt, src:src + n]
            xb = node[b, t - dt, src:src + n]
        mm = m[j0:j0 + n]
        ss = s[j0:j0 + n]
        for j in range(n):
            mj = mm[j]
            mr = 0.0 if mj == NEG_INF else mj
            ss[j] += exp64(xa[j] + xb[j] - mr)


@njit(**JIT)
def _row_w0(w, kinds, b, t, t1, u0, nu, w0):
    """The steps along row t (kinds with dt = 0, which all have du = 1): ``w0[j]`` = lae of
    their weights leaving node u0 + j, for j < nu - 1. Returns 0 if there is none (or t is
    the end frame, which has no arc), else the number of kinds."""
    if t >= t1:
        return 0
    K = kinds.shape[1]
    n0 = 0
    for k in range(K):
        if kinds[DT, k] != 0:
            continue
        x = w[b, k, t, u0:u0 + nu - 1]
        if n0 == 0:
            for j in range(nu - 1):
                w0[j] = x[j]
        else:
            for j in range(nu - 1):
                w0[j] = lae(w0[j], x[j])
        n0 += 1
    return n0


@njit(**JIT)
def _row_chain(out, m, s, w0, n0, start, backward):
    """Row values ``out[j] = lae(m[j] + log s[j], out[j -+ 1] + w0[j - 1 or j])`` (alpha:
    j ascending, the step from j - 1; beta: descending, the step to j + 1), the serial part
    of a row. ``start``: alpha's start node (j = 0) is 0. The recursion carries the node as
    (M, S) with value M + log S, S in [1, K * nu], into ``m``, ``s``: one exp per node, off
    the dependency chain (which is an add and a max per node), and the logs in a loop of
    their own that vectorises."""
    nu = out.shape[0]
    if start:
        m[0] = 0.0
        s[0] = 1.0
    if n0 != 0:
        Mp = NEG_INF
        Sp = 0.0
        for jj in range(nu):
            j = nu - 1 - jj if backward else jj
            mj = m[j]
            sj = s[j]
            if jj == 0:
                c = NEG_INF
            elif backward:
                c = Mp + w0[j]
            else:
                c = Mp + w0[j - 1]
            # One exp: the larger of the two terms is the reference (factor 1).
            M = nan_max(mj, c)
            e = exp64(-abs(mj - c))                  # NaN if either is NaN (or both -inf)
            big = mj >= c
            S = (sj if big else Sp) + (Sp if big else sj) * e
            S = 0.0 if M == NEG_INF else S
            m[j] = M
            s[j] = S
            Mp = M
            Sp = S
    for j in range(nu):
        mj = m[j]
        out[j] = mj + log64(s[j]) if mj > NEG_INF else mj


@njit(**JIT)
def _alpha_source(kinds, k, t, u, t0, u0, t1):
    """``(st, su, ok)``: the source node of kind k's arc into node (t, u), and whether it
    is a region node (``t0 <= st < t1``, ``su >= u0``): ``viterbi``'s arc rule, node by
    node (``lattice`` applies the same one row by row, ``_row_terms`` and ``_row_w0``);
    ``w`` is -inf off the arcs, so landing need not be checked."""
    st = t - kinds[DT, k]
    su = u - kinds[DU, k]
    return st, su, st >= t0 and su >= u0 and st < t1


# --------------------------------------------------------------------------- max-plus
@pjit
def viterbi(
    # the chunk: the sequences c0 <= b < c1 (``_config.ParallelKernel``)
    c0, c1,
    # data
    w, nan_row, t0s, u0s, t1s, u1s,
    # arc kinds
    kinds,
    # outputs
    alpha, best_kind, log_prob,
):
    """The alpha sweep of ``lattice`` in the max-plus semiring, recording the best
    arc into each node, one sequence per thread (math.md 9; ``reference.sweep_alpha`` with
    ``max_plus=True``):

        alpha(t0, u0) = 0,  alpha(t,u) = max_k  alpha(t - dt_k, u - du_k) + w_k(t - dt_k, u - du_k)
        best_kind(t,u) = the k attaining the max (the first kind on an exact tie)
        log_prob = alpha(t1, u1)

    so that the best path is read back by following ``best_kind`` from the end node
    (``analysis.alignment.backtrack_arcs``). Outputs: alpha (B, T+1, U+1) float64 filled
    with -inf on entry, best_kind (B, T+1, U+1) int8 filled with -1 on entry (only each
    sequence's nodes are written; -1 also at the start node and where no finite path
    arrives); log_prob (B,): -inf without a path or frame, NaN when an arc weight of the
    sequence is NaN (``nan_row``, as ``lattice``'s log P)."""
    B, K, T, U1 = w.shape
    for b in prange(c0, c1):
        t0, u0, t1, u1 = t0s[b], u0s[b], t1s[b], u1s[b]
        if t1 <= t0:                                  # no frame, no path
            log_prob[b] = NEG_INF
            continue
        alpha[b, t0, u0] = 0.0
        for t in range(t0, t1 + 1):
            for u in range(u0, u1 + 1):
                if t == t0 and u == u0:
                    continue
                # Strictly greater replaces (the first kind wins a tie); NaN propagates
                # into the value and never wins the pointer, as in the reference.
                val = NEG_INF
                arg = -1
                for k in range(K):
                    st, su, ok = _alpha_source(kinds, k, t, u, t0, u0, t1)
                    if ok:
                        x = alpha[b, st, su] + w[b, k, st, su]
                        if x > val:
                            val = x
                            arg = k
                        elif x != x:
                            val = x
                alpha[b, t, u] = val
                best_kind[b, t, u] = arg if val > NEG_INF else -1
        log_prob[b] = _log_p(alpha[b, t1, u1], nan_row, b, t0, t1)


@njit(**JIT)
def _add_read(cls, sub, ev, n, c, g, e):
    """Add occupation ``g`` to the read of class ``c`` (its exp: ``e``) in the node's list
    (merged by class)."""
    for j in range(n):
        if cls[j] == c:
            sub[j] += g
            return n
    cls[n] = c
    sub[n] = g
    ev[n] = e
    return n + 1


# --------------------------------------------------------------------------- pass 3
@pjit
def grad_rows(
    # the chunk: the ranges of frames c0 <= p < c1 (``_config.ParallelKernel``)
    c0, c1,
    # data: dst (N, V) is the output
    src, dst, node_rows, targets, t0s, u0s, t1s, u1s,
    # arc kinds
    kinds, blank, n_durations,
    # the forward passes' results
    shift, inv_sum, shift_d, inv_sum_d, e_read, gamma, log_like,
    # options
    fastemit_scale, clamp, upstream,
    # flags
    fused, from_logits,
    # schedule: the ranges of frames (``_config.frame_ranges``), the window of frames
    bounds, f0, f1,
):
    """Pass 3 for any topology: ``dst`` (N, V) = ``upstream[b] * d loss_b / d rows`` (math.md
    4-6 and 9; ``reference.grad``).

    At node n the reads are: each arc kind's class (its occupation scaled by
    ``fastemit_scale`` = 1 + lambda for FastEmit kinds), the blank of a ``plus_next_blank``
    arc leaving (t, u-1), and for TDT each kind's duration. With ``S`` the sum of the
    scaled occupations read in the token group, ``S_d`` that in the duration group:

        d/dx_v          = p_v S - sum_{reads of class v} s gamma      (token group, clamped)
        d/dx_{V_tok+i}  = q_i S_d - sum_{kinds with duration i} gamma  (never clamped)

    Fused: ``dst`` holds the exps of ``row_pass`` (src is dst), or with
    ``from_logits`` they are recomputed from ``src`` with the same shifts (bit-identical);
    ``p_v = exp(x_v - m) inv_sum``, so the bulk is one multiply per element and the few
    read classes are then set in float64 (``p S - s gamma`` cancels when p ~ 1). A NaN
    sequence (log P NaN) gets NaN on every entry of its region rows. Log-prob mode: ``dst``
    comes in zero-filled and only the read entries are written (``p`` taken as 0).
    Padding rows get 0, and so does every row of a sequence whose upstream is exactly 0.
    The frames run are ``f0 <= t < f1`` of each sequence (a fused tile's, else 0 and T),
    cut into the ranges ``bounds`` (``_config.frame_ranges``), of which the call runs ``c0
    <= p < c1`` (``_config.ParallelKernel``: a chunk of them a thread).

    Per row (b, t) the sums S, S_d and the occupation of each distinct class read
    (``_class_slots``) and each duration are first gathered kind by kind along each kind's
    span of nodes (``_arc_spans``); the node loop then reads them. The exps of the read classes come
    from ``e_read`` (``row_pass``), not from the row: read there before the bulk
    multiply, an entry far from the row's start waits a full memory latency.
    """
    B, T, U1, K, V_tok, cls, slot, nc, nd = _sizes(node_rows, kinds, dst.shape[1], n_durations)
    for p in prange(c0, c1):
        for i in range(bounds[p], bounds[p + 1]):
            b, t = frame_at(i, f0, f1)
            t0, u0, t1, u1 = t0s[b], u0s[b], t1s[b], u1s[b]
            wu = upstream[b]
            ll = log_like[b]
            in_t = t >= t0 and t < t1
            # 1. Scratch of the row: spans (int), per-node sums of occupations (float64).
            ispan = np.empty(2 * K + 2 * nc + 2 * K + 2, dtype=np.int64)
            lo, hi = ispan[:K], ispan[K:2 * K]
            slo, shi = ispan[2 * K:2 * K + nc], ispan[2 * K + nc:2 * K + 2 * nc]
            rcls = ispan[2 * K + 2 * nc:]                 # classes read at the node ...
            U2 = U1 + 1
            fscr = np.zeros((nc + nd + 3) * U2 + 2 * (2 * K + 2))
            sub = fscr[:nc * U2].reshape(nc, U2)          # scaled occupation of each slot
            dsub = fscr[nc * U2:(nc + nd) * U2].reshape(nd, U2)   # ... of each duration
            s_tok = fscr[(nc + nd) * U2:(nc + nd + 1) * U2]       # S
            s_dur = fscr[(nc + nd + 1) * U2:(nc + nd + 2) * U2]   # S_d
            s_next_blank = fscr[(nc + nd + 2) * U2:(nc + nd + 3) * U2]   # blank read from u-1
            rsub = fscr[(nc + nd + 3) * U2:(nc + nd + 3) * U2 + 2 * K + 2]   # ... their sums
            ev = fscr[(nc + nd + 3) * U2 + 2 * K + 2:]    # ... and their exps
            # 2. The occupations each node's row is read with, gathered kind by kind.
            plo, phi = 0, -1
            if in_t and wu != 0.0:
                _frame_spans(kinds, slot, t, u0, t1, u1, lo, hi, slo, shi)
                plo, phi = _union_spans(kinds, slot, -1, PLUS_NEXT_BLANK, lo, hi)
                for k in range(K):
                    n = hi[k] - lo[k] + 1
                    if n <= 0:
                        continue
                    a = lo[k]
                    d = kinds[DURATION, k]
                    scale = fastemit_scale if kinds[FASTEMIT, k] != 0 else 1.0
                    g_row = gamma[b, k, t, a:a + n]
                    c_row = sub[slot[k], a:a + n]
                    s_row = s_tok[a:a + n]
                    for u in range(n):
                        sg = g_row[u] * scale
                        c_row[u] += sg
                        s_row[u] += sg
                    if d >= 0:
                        d_row = dsub[d, a:a + n]
                        sd_row = s_dur[a:a + n]
                        for u in range(n):
                            d_row[u] += g_row[u]
                            sd_row[u] += g_row[u]
                    if kinds[PLUS_NEXT_BLANK, k] != 0:    # the arc from (t, u) reads b(t, u+1)
                        p_row = s_next_blank[a + 1:a + 1 + n]
                        sn_row = s_tok[a + 1:a + 1 + n]
                        for u in range(n):
                            p_row[u] += g_row[u]
                            sn_row[u] += g_row[u]
            # 3. The nodes' rows.
            for u in range(U1):
                r = node_rows[b, t, u]
                if r < 0:
                    continue
                row = dst[r]
                if not (in_t and u >= u0 and u <= u1) or wu == 0.0:
                    # A select, not a product: 0 * NaN would be NaN (math.md 8.1).
                    if wu == 0.0 or (fused and from_logits):
                        row[:] = 0.0
                    continue
                if fused and ll != ll:                    # a NaN sequence: NaN everywhere
                    row[:] = np.nan
                    continue
                # 3a. The classes the node reads, merged by class.
                n = 0
                for j in range(nc):
                    if u >= slo[j] and u <= shi[j]:
                        c = cls[j]
                        n = _add_read(rcls, rsub, ev, n, targets[b, u] if c < 0 else c, sub[j, u],
                                      e_read[b, t, u, j] if fused else 0.0)
                if u > u0 and u - 1 >= plo and u - 1 <= phi:
                    n = _add_read(rcls, rsub, ev, n, blank, s_next_blank[u],
                                  e_read[b, t, u, nc] if fused else 0.0)
                if not fused:
                    for j in range(n):
                        row[rcls[j]] = clip(-rsub[j], clamp) * wu
                    for j in range(n_durations):
                        row[V_tok + j] = -dsub[j, u] * wu
                    continue
                # 3b. The exps (recomputed without the stored buffer), then the token group.
                tok = row[:V_tok]
                if from_logits:
                    if inv_sum[b, t, u] > 0.0:
                        exp_store(src[r, :V_tok], shift[b, t, u], tok)
                    else:                                 # dead or NaN group: stored as zeros
                        tok[:] = 0.0
                    if n_durations > 0:
                        if inv_sum_d[b, t, u] > 0.0:
                            exp_store(src[r, V_tok:], shift_d[b, t, u], row[V_tok:])
                        else:
                            row[V_tok:] = 0.0
                st = s_tok[u]
                if st == 0.0:                             # no arc reads the row (or no path)
                    tok[:] = 0.0
                else:
                    c = st * inv_sum[b, t, u]         # d/dx_v = exp(x_v - m) inv_sum S - ...
                    scale_row(tok, c, wu, clamp)
                    # The read classes in float64: p S - s gamma cancels when p ~ 1.
                    for j in range(n):
                        tok[rcls[j]] = clip(ev[j] * c - rsub[j], clamp) * wu
                # 3c. The duration group: d/dx_{V_tok+i} = q_i S_d - gamma_i.
                if n_durations > 0:
                    sd = s_dur[u]
                    cd = sd * inv_sum_d[b, t, u]
                    for j in range(n_durations):
                        q = np.float64(row[V_tok + j]) * cd if sd != 0.0 else 0.0
                        row[V_tok + j] = (q - dsub[j, u]) * wu

