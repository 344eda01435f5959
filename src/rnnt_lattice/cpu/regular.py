"""The regular fast path of the CPU backend: the plain regular RNN-T loss (one blank, no
per-arc term, padded ``(B, T, U+1, V)`` logits, no boundary) with its own row and gradient
passes. ``cpu.uses_regular_fast_path`` chooses it; the generic kernels (``kernels``) give
the same numbers, slower on this lattice (docs/benchmarks.md, "CPU kernels after the
restructuring").

1. ``regular_row_pass`` — over the logits, parallel over rows ``(b, t)``: per node the row
   max, ``exp(logits - m)`` (stored in the gradient buffer when a gradient is wanted),
   ``1 / sum``, and the two arc weights ``b(t,u)``, ``e(t,u)`` written straight into the
   generic lattice's layout ``w (B, 2, T, U+1)`` (kind 0 the blank, kind 1 the label:
   ``topology.regular()``).
2. The lattice is the generic one, ``kernels.lattice``, on those weights.
3. ``regular_grad_rows`` — over the buffer again: turns the stored exps into the gradient
   with one multiply per element (clamp and FastEmit fused), scaled by the upstream
   gradient.

What the generic passes spend on top of these: per node, the bookkeeping over the kind
table (class slots, spans, the read classes' exps kept aside in ``e_read``).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ._config import JIT, frame_at, pjit
from .fastmath import NEG_INF, clip, exp_store, exp_sum, row_max, scale_row

# The kinds of ``topology.regular()``, in its order: the plane of each in ``w`` and ``gamma``.
BLANK, LABEL = 0, 1


@pjit
def regular_row_pass(
    # the chunk: the ranges of frames c0 <= p < c1 (``_config.ParallelKernel``)
    c0, c1,
    # data
    logits, targets, logit_lengths, target_lengths,
    # arc kinds: the blank reads class ``blank``, the label y[u]
    blank,
    # flags
    fused, store,
    # schedule: the ranges of frames (``_config.frame_ranges`` over every node)
    bounds,
    # outputs
    buf, shift, inv_sum, w, nan_row,
):
    """Row statistics and arc weights of the regular lattice (math.md sections 1 and 9).

    Args:
        logits: (B, T, U+1, V) float32/float64, C-contiguous.
        targets: (B, U) int64. logit_lengths, target_lengths: (B,) int64.
        blank: blank id in [0, V). fused: logits are raw scores (else log-probs).
        store: write exp(logits - m) into ``buf`` (and zeros into its padding rows); ``buf``
            may be ``logits`` itself (in-place mode).
        bounds: contiguous ranges of frames in memory order (``_config.frame_ranges``
            over the region t < T_b, u <= U_b of each sequence, a row at every node); the call
            runs the ranges ``c0 <= p < c1`` (``_config.ParallelKernel``: a chunk of them a
            thread).
        buf: (B, T, U+1, V) like logits (unused unless ``store``).
    Outputs, written on every node (padding: shift 0, inv_sum 0, weights -inf):
        shift (B, T, U+1), dtype of logits: row max m.
        inv_sum (B, T, U+1) float64: 1 / sum_v exp(logits - m).
        w (B, 2, T, U+1) float64: the weights of ``kernels.lattice``, -inf off the arcs:
            w[b, BLANK] = b(t,u) for t < T_b - 1, and the final blank from (T_b - 1, U_b);
            w[b, LABEL] = e(t,u) for t < T_b, u < U_b.
        nan_row (B, T) uint8: 1 where an arc weight of the row (b, t) is NaN.
    NaN and infinities (math.md section 8), decided per row on the row max: all -inf ->
    dead row (arcs -inf, inv_sum 0); NaN or +inf -> NaN arcs (inv_sum NaN, exps stored as 0);
    in log-prob mode a +inf arc entry is read as NaN.
    """
    B, T, U1, V = logits.shape
    for p in prange(c0, c1):
        for i in range(bounds[p], bounds[p + 1]):
            b, t = frame_at(i, 0, T)
            T_b = logit_lengths[b]
            U_b = target_lengths[b]
            bad = 0
            for u in range(U1):
                shift[b, t, u] = 0.0
                inv_sum[b, t, u] = 0.0
                w[b, BLANK, t, u] = NEG_INF
                w[b, LABEL, t, u] = NEG_INF
                if t >= T_b or u > U_b:                  # padding: never read, gradient 0
                    if store:
                        buf[b, t, u, :] = 0.0
                    continue
                # 1. The two arc entries, read first: in in-place mode buf is logits and the
                # exps below overwrite the row.
                row = logits[b, t, u]
                x_blank = np.float64(row[blank])
                x_label = np.float64(row[targets[b, u]]) if u < U_b else NEG_INF
                # 2. The row's log-normaliser (fused mode), the exps stored on the way.
                lse = 0.0                                 # log-prob mode: rows are normalised
                if fused:
                    m = row_max(row)
                    if m == NEG_INF:                      # every class masked: no arc leaves
                        if store:
                            buf[b, t, u, :] = 0.0
                        continue
                    if not m < np.inf:                    # a NaN or +inf in the row: its softmax
                        shift[b, t, u] = m                # is undefined, both arcs are NaN
                        inv_sum[b, t, u] = np.nan         # (math.md section 8)
                        lse = np.nan
                        if store:
                            buf[b, t, u, :] = 0.0
                    else:
                        if store:
                            s = exp_store(row, m, buf[b, t, u])
                        else:
                            s = exp_sum(row, m)
                        shift[b, t, u] = m
                        inv_sum[b, t, u] = 1.0 / s
                        lse = np.float64(m) + math.log(s)
                else:                                     # a log-prob of +inf is invalid: NaN
                    x_blank = np.nan if x_blank == np.inf else x_blank
                    x_label = np.nan if x_label == np.inf else x_label
                # 3. The arc weights: a blank leaves every node but those of the last frame
                # below U_b (only the final blank ends a path); a label leaves u < U_b.
                if t < T_b - 1 or u == U_b:
                    x = x_blank - lse
                    w[b, BLANK, t, u] = x
                    bad |= x != x
                if u < U_b:
                    y = x_label - lse
                    w[b, LABEL, t, u] = y
                    bad |= y != y
            nan_row[b, t] = bad


@njit(**JIT)
def _finish_row(row, blank, y, has_label, gb, gl, inv_s, w, clamp, fused):
    """Turn one row of exp(logits - m) into w * clip(d loss / d logits) in place.

    fused:   d/dz_v = p_v (gb + gl) - [v=blank] gb - [v=y] gl,   p_v = row[v] * inv_s
    log-prob: d/dlogp_v = -[v=blank] gb - [v=y] gl   (row holds zeros on entry)
    gl already carries the FastEmit factor (1 + lambda). A label that is the blank
    (``allow_blank_targets``) reads the blank arc's class: its occupation joins gb, so
    that one entry gets both subtractions (two writes would keep only the last).
    """
    if has_label and y == blank:
        gb, gl, has_label = gb + gl, 0.0, False      # p_v (gb + gl) unchanged, one read
    if fused:
        c = (gb + gl) * inv_s
        e_blank = np.float64(row[blank])
        e_label = np.float64(row[y]) if has_label else 0.0
        scale_row(row, c, w, clamp)
        # The two arc entries in float64: p * (gb + gl) - gb cancels when p ~ 1.
        row[blank] = clip(e_blank * c - gb, clamp) * w
        if has_label:
            row[y] = clip(e_label * c - gl, clamp) * w
    else:
        row[blank] = clip(-gb, clamp) * w
        if has_label:
            row[y] = clip(-gl, clamp) * w


@pjit
def regular_grad_rows(
    # the chunk: the ranges of frames c0 <= p < c1 (``_config.ParallelKernel``)
    c0, c1,
    # data: dst (B, T, U+1, V) is the output
    src, dst, targets, logit_lengths, target_lengths,
    # arc kinds: the blank reads class ``blank``, the label y[u]
    blank,
    # the forward pass's results
    shift, inv_sum, gamma,
    # options
    fastemit_scale, clamp, upstream,
    # flags
    fused, from_logits,
    # schedule: the ranges of frames (``_config.frame_ranges`` over every node)
    bounds,
):
    """Write ``upstream[b] * clip(d loss_b / d logits)`` into ``dst`` (B, T, U+1, V).

    fused and not from_logits: ``dst`` holds the exps that ``regular_row_pass`` stored
        (src is dst); padding rows are already 0.
    fused and from_logits: the exps are recomputed from ``src`` = logits with the same
        code and shifts as ``regular_row_pass`` (bit-identical result), padding rows zeroed.
    log-prob mode: ``dst`` comes in zero-filled; two entries per node are written.
    ``gamma`` (B, 2, T, U+1): the occupations of ``kernels.lattice``; the label's gets the
    FastEmit factor ``fastemit_scale`` = 1 + lambda. A sequence whose upstream gradient
    is 0 gets exactly 0, even where its gradient is NaN (math.md section 8).
    """
    B, T, U1, V = dst.shape
    for p in prange(c0, c1):
        for i in range(bounds[p], bounds[p + 1]):
            b, t = frame_at(i, 0, T)
            T_b = logit_lengths[b]
            U_b = target_lengths[b]
            w = upstream[b]
            if w == 0.0:
                # A select, not a product: 0 * NaN or 0 * inf would be NaN, and a sequence
                # masked out by a zero upstream gradient must not poison the weights.
                dst[b, t] = 0.0
                continue
            for u in range(U1):
                if t >= T_b or u > U_b:
                    if fused and from_logits:
                        dst[b, t, u, :] = 0.0
                    continue
                row = dst[b, t, u]
                if fused and from_logits:
                    if not inv_sum[b, t, u] > 0.0:        # all -inf (0) or NaN row (see the row
                        row[:] = 0.0                      # pass): the stored buffer holds zeros
                    else:
                        exp_store(src[b, t, u], shift[b, t, u], row)
                has_label = u < U_b
                y = targets[b, u] if has_label else 0
                _finish_row(row, blank, y, has_label, gamma[b, BLANK, t, u],
                            gamma[b, LABEL, t, u] * fastemit_scale, inv_sum[b, t, u], w, clamp,
                            fused)
