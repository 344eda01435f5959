"""Numba kernels of the CPU backend. NumPy arrays in, NumPy arrays out.

Three passes, as in docs/math.md:

1. ``row_pass`` — over the ``(B, T, U+1, V)`` logits, parallel over rows ``(b, t)``:
   per node the row max ``m``, ``exp(logits - m)`` (stored in the gradient buffer when a
   gradient is wanted), ``1 / sum``, and the blank/label log-probs ``b(t,u)``, ``e(t,u)``.
2. ``lattice`` — per sequence (parallel over the batch): alpha, beta, log P and the arc
   occupations ``gamma_blank``, ``gamma_label``, all in float64.
3. ``grad_rows`` — over the buffer again: turns the stored exps into the gradient with one
   multiply per element (clamp and FastEmit fused), scaled by the upstream gradient.

The same three passes for any topology (``kind_row_pass``, ``kind_lattice``,
``kind_grad_rows``, section "any topology" below) are driven by a table of arc kinds and
read logits rows ``(N, V)`` through a node -> row map (padded, packed or pruned layouts);
the regular kernels above are kept for the plain regular loss (see ``cpu/__init__``).
``kind_viterbi`` is ``kind_lattice``'s alpha sweep in the max-plus semiring (the same arc
rule, ``_alpha_source``), recording the best incoming kind of every node for the
alignment's backtrack.

One exp per logit element in total. The exp of float32 rows is a polynomial that LLVM
vectorises (``math.exp`` is a scalar libm call in Numba without SVML, ~6x slower).

Compilation: the prange kernels are ``@pjit`` (``_config.ParallelKernel``): each is
compiled as a parallel and a serial variant with separate cache files, and every call
picks one (the serial one under ``RNNT_LATTICE_NUMBA_PARALLEL=0`` and in forked children).
The helpers are ``@njit(**JIT)`` and get compiled into both. Each kernel is compiled once
per logits dtype (ids arrive as int64); ``rnnt-lattice warmup`` compiles them all ahead
(docs/benchmarks.md, "First use").
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._config import FASTMATH, JIT, pjit

NEG_INF = -np.inf


# --------------------------------------------------------------------------- exp
def exp_nonpos(x):
    """exp(x) for x <= 0 (NaN in -> NaN out). Python stub; see the Numba overload."""
    return math.exp(x)


# No "reassoc" here: it would fold the two-part ln 2 subtraction below into one and lose
# the exactness it exists for (~1e-14 relative error at x ~ -700 in float64). The caller's
# reduction keeps its own flags.
@overload(exp_nonpos, jit_options=dict(fastmath=FASTMATH - {"reassoc"}))
def _exp_nonpos_impl(x):
    if x == types.float32:
        # exp(x) = 2^n * exp(r),  n = round(x / ln 2),  r = x - n ln 2 in [-ln2/2, ln2/2].
        # exp(r) by the Cephes expf minimax polynomial (relative error < 1.2e-7 over the
        # range: float32 rounding), 2^n by adding n to the exponent bits. Below -87
        # exp(x) < 2^-125 is flushed to 0 (it cannot move a row sum that is >= 1), which
        # also keeps 2^n a normal number and makes exp(-inf) exactly 0.
        def impl(x):
            n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
            r = x - n * np.float32(0.693359375)          # ln 2 split into hi + lo parts so
            r = r + n * np.float32(2.12194440e-4)        # that n * ln2_hi is exact
            p = np.float32(1.9875691500e-4)
            p = p * r + np.float32(1.3981999507e-3)
            p = p * r + np.float32(8.3334519073e-3)
            p = p * r + np.float32(4.1665795894e-2)
            p = p * r + np.float32(1.6666665459e-1)
            p = p * r + np.float32(5.0000001201e-1)
            p = p * r * r + r + np.float32(1.0)
            # NaN x: p is NaN and int32(n) is 0 or INT_MIN, whose shift by 23 is 0: stays NaN.
            bits = np.int32(np.float32(p).view(np.int32) + (np.int32(n) << np.int32(23)))
            y = np.int32(bits).view(np.float32)
            return np.float32(0.0) if x < np.float32(-87.0) else y
        return impl
    if x == types.float64:
        # The same scheme in float64 with the Cephes exp rational approximation on
        # |r| <= ln2/2: exp(r) = 1 + 2 r P(r^2) / (Q(r^2) - r P(r^2)), relative error
        # < 2.2e-16 (float64 rounding). Below -708, exp(x) < 2^-1021 is flushed to 0 (it
        # cannot move a row sum that is >= 1) and 2^n stays a normal number.
        def impl(x):
            n = np.floor(x * 1.4426950408889634 + 0.5)
            r = x - n * 6.93145751953125e-1
            r = r - n * 1.42860682030941723212e-6
            rr = r * r
            p = ((1.26177193074810590878e-4 * rr + 3.02994407707441961300e-2) * rr
                 + 9.99999999999999999910e-1) * r
            q = (((3.00198505138664455042e-6 * rr + 2.52448340349684104192e-3) * rr
                  + 2.27265548208155028766e-1) * rr + 2.00000000000000000009e0)
            e = 1.0 + 2.0 * p / (q - p)
            bits = np.int64(np.float64(e).view(np.int64) + (np.int64(n) << np.int64(52)))
            y = np.int64(bits).view(np.float64)
            return 0.0 if x < -708.0 else y
        return impl


def cast_like(arr, x):
    """x converted to the element type of ``arr``. Python stub; see the Numba overload."""
    return arr.dtype.type(x)


@overload(cast_like)
def _cast_like_impl(arr, x):
    dtype = arr.dtype
    def impl(arr, x):
        return dtype(x)
    return impl


# --------------------------------------------------------------------------- row helpers
# Two habits keep every row loop below vectorised (16 float32 lanes with AVX-512):
# - loop over a *slice* with ``range(len)`` starting at 0: Numba then knows the index is
#   non-negative and emits plain vector loads; ``range(v0, v1)`` on the whole row makes it
#   keep negative-index wraparound, which LLVM turns into gathers (7x slower);
# - reductions LLVM can vectorise under IEEE semantics (integer max, float sums with
#   ``reassoc``); a float max would need "no NaNs", which would fold our NaN checks away.

def max_key(row):
    """Order-preserving integer keys of a float row. Python stub; see the overload."""
    raise NotImplementedError


def key_to_float(row, k):
    """The float of ``row``'s dtype whose key is ``k``. Python stub; see the overload."""
    raise NotImplementedError


def _key_types(dtype):
    # (int type, float type, sign shift, magnitude mask, key of -inf), see ``max_key``.
    if dtype == types.float32:
        return (np.int32, np.float32, np.int32(31), np.int32(0x7FFFFFFF),
                np.int32(-0x7F800000 - 1))
    return (np.int64, np.float64, np.int64(63), np.int64(0x7FFFFFFFFFFFFFFF),
            np.int64(-0x7FF0000000000000 - 1))


@overload(max_key)
def _max_key_impl(row):
    # IEEE floats compare like sign-magnitude integers: flipping the magnitude bits of the
    # negative ones gives two's-complement integers in the same order (the map is its own
    # inverse), NaNs included: -NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN. The keys
    # below the key of -inf are the negative NaNs (what inf - inf gives on x86); the
    # caller flips them bitwise (``~k``) to the top, among the positive NaNs, so that every
    # NaN wins an integer max (math.md section 8). No wrapping arithmetic: Numba's integer
    # ops are "no signed wrap" and LLVM may fold an overflowing one into anything.
    ity, _, sh, mask, kneg = _key_types(row.dtype)

    def impl(row):
        return row.view(ity), sh, mask, kneg
    return impl


@overload(key_to_float)
def _key_to_float_impl(row, k):
    ity, fty, sh, mask, _ = _key_types(row.dtype)

    def impl(row, k):
        return ity(ity(k) ^ ((ity(k) >> sh) & mask)).view(fty)
    return impl


@njit(**JIT)
def _row_max(row):
    """max_v row[v] for a non-empty row, as an integer max over the keys of ``max_key``
    (vectorises without any fast-math assumption). Any NaN, of either sign, wins: the row
    max is NaN exactly when the row holds a NaN."""
    bits, sh, mask, kneg = max_key(row)
    m = bits[0] ^ ((bits[0] >> sh) & mask)
    for v in range(bits.shape[0]):
        k = bits[v] ^ ((bits[v] >> sh) & mask)
        k = ~k if k < kneg else k                     # a negative NaN: to the top
        m = k if k > m else m
    return key_to_float(row, m)


# Row sums: float32 partial sums over blocks of _SUM_BLOCK elements (16-wide AVX-512
# lanes), float64 across blocks. A float64 accumulator throughout would halve the vector
# width; 256 float32 terms in [0, 1] lose < 256 * 2^-24 relative.
_SUM_BLOCK = 256


@njit(**JIT)
def _exp_sum(row, m):
    """sum_v exp(row[v] - m)."""
    s = 0.0
    for v0 in range(0, row.shape[0], _SUM_BLOCK):
        seg = row[v0:v0 + _SUM_BLOCK]
        part = cast_like(row, 0.0)
        for k in range(seg.shape[0]):
            part += exp_nonpos(seg[k] - m)
        s += part
    return s


@njit(**JIT)
def _exp_store(row, m, out):
    """out[v] = exp(row[v] - m); returns the sum. ``out`` may be ``row`` itself."""
    s = 0.0
    for v0 in range(0, row.shape[0], _SUM_BLOCK):
        seg = row[v0:v0 + _SUM_BLOCK]
        oseg = out[v0:v0 + _SUM_BLOCK]
        part = cast_like(row, 0.0)
        for k in range(seg.shape[0]):
            e = exp_nonpos(seg[k] - m)
            oseg[k] = e
            part += e
        s += part
    return s


@njit(**JIT)
def _lae(a, b):
    """log(exp(a) + exp(b)); -inf if both are -inf; NaN propagates."""
    if a == NEG_INF:
        return b
    if b == NEG_INF:
        return a
    if a > b:
        return a + math.log1p(math.exp(b - a))
    return b + math.log1p(math.exp(a - b))


@njit(**JIT)
def _clip(g, clamp):
    if clamp > 0.0:
        return min(max(g, -clamp), clamp)
    return g


def spread_stride(n: int) -> int:
    """A stride coprime to ``n`` near n / golden ratio. prange hands each thread one
    contiguous block of iterations; visiting rows (b, t) in the order ``i * stride mod n``
    gives every thread a similar mix of long and short (ragged, padded) sequences."""
    if n <= 2:
        return 1
    p = max(1, int(n * 0.6180339887498949)) | 1
    while math.gcd(p, n) != 1:
        p += 2
    return p


@njit(**JIT)
def _spread_row(i, spread, B, T):
    """The row ``(b, t)`` that prange iteration ``i`` visits (see ``spread_stride``)."""
    bt = (i * spread) % (B * T)
    b = bt // T
    return b, bt - b * T


# --------------------------------------------------------------------------- pass 1
@pjit
def row_pass(logits, targets, logit_lengths, target_lengths, blank, fused, store, spread,
             buf, shift, inv_sum, lpb, lpl):
    """Row statistics and arc log-probs (math.md section 1).

    Args:
        logits: (B, T, U+1, V) float32/float64, C-contiguous.
        targets: (B, U) int64. logit_lengths, target_lengths: (B,) int64.
        blank: blank id in [0, V). fused: logits are raw scores (else log-probs).
        store: write exp(logits - m) into ``buf`` (and zeros into its padding rows); ``buf``
            may be ``logits`` itself (in-place mode).
        spread: an int coprime to B*T (see ``spread_stride``).
        buf: (B, T, U+1, V) like logits (unused unless ``store``).
    Outputs (B, T, U+1), written on every node (padding: shift 0, inv_sum 0, arcs -inf):
        shift: row max m (dtype of logits); inv_sum: 1 / sum_v exp(logits - m) (float64);
        lpb, lpl: b(t,u), e(t,u) in float64, -inf off the lattice (padding, and e at
            u = U_b); b on the last frame's nodes u < U_b is never read (no arc there).
    NaN and infinities (math.md section 8), decided per row on the row max: all -inf ->
    dead row (arcs -inf, inv_sum 0); NaN or +inf -> NaN arcs (inv_sum NaN, exps stored as 0);
    in log-prob mode a +inf arc entry is read as NaN.
    """
    B, T, U1, V = logits.shape
    for i in prange(B * T):
        b, t = _spread_row(i, spread, B, T)
        T_b = logit_lengths[b]
        U_b = target_lengths[b]
        for u in range(U1):
            shift[b, t, u] = 0.0
            inv_sum[b, t, u] = 0.0
            lpb[b, t, u] = NEG_INF
            lpl[b, t, u] = NEG_INF
            if t >= T_b or u > U_b:                  # padding: never read, gradient 0
                if store:
                    buf[b, t, u, :] = 0.0
                continue
            row = logits[b, t, u]
            # Read the two arc logits first: in in-place mode buf is logits and the exps
            # below overwrite the row.
            x_blank = np.float64(row[blank])
            x_label = np.float64(row[targets[b, u]]) if u < U_b else NEG_INF
            lse = 0.0                                 # log-prob mode: rows are normalised
            if fused:
                m = _row_max(row)
                if m == NEG_INF:                      # every class masked: no arc leaves
                    if store:
                        buf[b, t, u, :] = 0.0
                    continue
                if not m < np.inf:                    # a NaN or +inf in the row: its softmax
                    shift[b, t, u] = m                # is undefined, both arcs are NaN
                    inv_sum[b, t, u] = np.nan         # (math.md section 8)
                    lpb[b, t, u] = np.nan
                    if u < U_b:
                        lpl[b, t, u] = np.nan
                    if store:
                        buf[b, t, u, :] = 0.0
                    continue
                if store:
                    s = _exp_store(row, m, buf[b, t, u])
                else:
                    s = _exp_sum(row, m)
                shift[b, t, u] = m
                inv_sum[b, t, u] = 1.0 / s
                lse = np.float64(m) + math.log(s)
            else:                                     # a log-prob of +inf is invalid: NaN
                x_blank = np.nan if x_blank == np.inf else x_blank
                x_label = np.nan if x_label == np.inf else x_label
            lpb[b, t, u] = x_blank - lse
            if u < U_b:
                lpl[b, t, u] = x_label - lse


# --------------------------------------------------------------------------- pass 2
@njit(**JIT)
def _max2(a, b):
    """max(a, b) for the max-plus semiring; NaN propagates (like ``_lae``)."""
    if a > b:
        return a
    if b >= a:
        return b
    return a + b                                      # one of them is NaN


@njit(**JIT)
def _alpha_node(lpb, lpl, b, t, u, alpha, max_plus):
    """One cell of the forward recursion (t + u > 0):

        alpha(t,u) = (+)(alpha(t-1,u) + b(t-1,u), alpha(t,u-1) + e(t,u-1))

    with (+) = ``lae`` (sum over paths) or, for ``max_plus``, ``max`` (the Viterbi score):
    the one recursion behind both the loss and ``best_alignment``.
    """
    a = NEG_INF
    if t > 0:
        a = alpha[b, t - 1, u] + lpb[b, t - 1, u]
    if u > 0:
        x = alpha[b, t, u - 1] + lpl[b, t, u - 1]
        a = _max2(a, x) if max_plus else _lae(a, x)
    alpha[b, t, u] = a


@njit(**JIT)
def _beta_node(lpb, lpl, b, t, u, T_b, U_b, beta):
    """One cell of the backward recursion:

        beta(t,u) = lae(beta(t+1,u) + b(t,u), beta(t,u+1) + e(t,u)),  beta(T_b-1,U_b) = b(T_b-1,U_b)
    """
    if t == T_b - 1:
        z = lpb[b, t, u] if u == U_b else NEG_INF    # only the final blank ends a path
    else:
        z = beta[b, t + 1, u] + lpb[b, t, u]
    if u < U_b:
        z = _lae(z, beta[b, t, u + 1] + lpl[b, t, u])
    beta[b, t, u] = z


@njit(**JIT)
def _alpha_sweep(lpb, lpl, b, T_b, U_b, alpha, max_plus):
    """alpha of sequence ``b`` (T_b >= 1), rows in order (t outer, u inner)."""
    alpha[b, 0, 0] = 0.0
    for t in range(T_b):
        for u in range(U_b + 1):
            if t > 0 or u > 0:
                _alpha_node(lpb, lpl, b, t, u, alpha, max_plus)


@pjit
def viterbi_alpha(lpb, lpl, logit_lengths, target_lengths, alpha):
    """Max-plus alpha (B, T, U+1), one sequence per thread; ``alpha`` comes in filled
    with -inf and only each sequence's nodes are written (see ``_alpha_sweep``)."""
    B = lpb.shape[0]
    for b in prange(B):
        if logit_lengths[b] > 0:
            _alpha_sweep(lpb, lpl, b, logit_lengths[b], target_lengths[b], alpha, True)


@pjit
def regular_weights(lpb, lpl, logit_lengths, target_lengths, w, nan_row):
    """The standard lattice's arc weights in the generic layout, for ``kind_lattice``
    (the regular loss's pass 2): ``w[b, 0] = b(t, u)`` on the blank arcs (``t < T_b - 1``,
    or the final blank from ``(T_b - 1, U_b)``), ``w[b, 1] = e(t, u)`` on the label arcs
    (``t < T_b, u < U_b``), -inf elsewhere; ``nan_row[b, t]`` = 1 where an arc of frame t
    weighs NaN (math.md 8.1: its sequence is NaN). lpb, lpl (B, T, U+1) from ``row_pass``;
    w (B, 2, T, U+1) float64, nan_row (B, T) uint8."""
    B, T, U1 = lpb.shape
    for i in prange(B * T):
        b = i // T
        t = i - b * T
        T_b = logit_lengths[b]
        U_b = target_lengths[b]
        bad = 0
        for u in range(U1):
            x = NEG_INF
            if t < T_b - 1 or (t == T_b - 1 and u == U_b):
                x = lpb[b, t, u]
            w[b, 0, t, u] = x
            y = NEG_INF
            if t < T_b and u < U_b:
                y = lpl[b, t, u]
            w[b, 1, t, u] = y
            if x != x or y != y:
                bad = 1
        nan_row[b, t] = bad


@pjit
def lattice(lpb, lpl, logit_lengths, target_lengths, alpha, beta, log_like, gamma_blank, gamma_label):
    """Forward/backward recursion and occupations, one sequence per thread (math.md 2-3).

        alpha(t,u) = lae(alpha(t-1,u) + b(t-1,u), alpha(t,u-1) + e(t,u-1))
        beta(t,u)  = lae(beta(t+1,u) + b(t,u),    beta(t,u+1) + e(t,u)),  beta(T_b-1,U_b) = b(T_b-1,U_b)
        gamma_blank(t,u) = exp(alpha(t,u) + b(t,u) + beta(t+1,u) - log P)
        gamma_label(t,u) = exp(alpha(t,u) + e(t,u) + beta(t,u+1) - log P)

    alpha/beta must come in filled with -inf and the gammas with 0: only the nodes of each
    sequence's lattice are written. Rows are swept in order (t outer, u inner), which
    respects both dependencies; parallelism is over the batch.
    """
    B = lpb.shape[0]
    for b in prange(B):
        T_b = logit_lengths[b]
        U_b = target_lengths[b]
        if T_b == 0:                                  # no frame, no path
            log_like[b] = NEG_INF
            continue
        # alpha (rows ascending) and beta (rows descending) in one loop: the two are
        # independent, and each is a chain of dependent logaddexps (latency-bound), so
        # interleaving them lets the CPU overlap the two chains.
        alpha[b, 0, 0] = 0.0
        for i in range(T_b):
            for j in range(U_b + 1):
                if i > 0 or j > 0:
                    _alpha_node(lpb, lpl, b, i, j, alpha, False)
                _beta_node(lpb, lpl, b, T_b - 1 - i, U_b - j, T_b, U_b, beta)
        ll = beta[b, 0, 0]
        log_like[b] = ll
        if ll == NEG_INF:                             # impossible: no occupation, no gradient
            continue
        if ll != ll:                                  # NaN: every arc's occupation is NaN
            for t in range(T_b):
                if t < T_b - 1:
                    gamma_blank[b, t, :U_b + 1] = np.nan
                gamma_label[b, t, :U_b] = np.nan
            gamma_blank[b, T_b - 1, U_b] = np.nan
            continue
        # Occupations row by row, over slices so that the loops vectorise (see the row
        # helpers); the exponents are <= 0 up to rounding (occupations are <= 1).
        for t in range(T_b):
            a_row = alpha[b, t, :U_b + 1]
            if t < T_b - 1:
                pb, nb, gb = lpb[b, t, :U_b + 1], beta[b, t + 1, :U_b + 1], gamma_blank[b, t, :U_b + 1]
                for u in range(U_b + 1):
                    gb[u] = exp_nonpos(a_row[u] + pb[u] + nb[u] - ll)
            else:                                     # only the final blank leaves the last frame:
                gamma_blank[b, t, U_b] = exp_nonpos(a_row[U_b] + lpb[b, t, U_b] - ll)  # beta(T_b, U_b) = 0
            pl, nl, gl = lpl[b, t, :U_b], beta[b, t, 1:U_b + 1], gamma_label[b, t, :U_b]
            for u in range(U_b):
                gl[u] = exp_nonpos(a_row[u] + pl[u] + nl[u] - ll)


# --------------------------------------------------------------------------- pass 3
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
        if clamp > 0.0:
            # p_v (gb + gl) >= 0, so only the upper bound can bind off the two arcs.
            # A select, not min(): Numba's min is NaN-aware and does not vectorise.
            c32 = cast_like(row, c)
            hi = cast_like(row, clamp)
            w32 = cast_like(row, w)
            for v in range(row.shape[0]):
                g = row[v] * c32
                row[v] = (hi if g > hi else g) * w32
        else:
            cw = cast_like(row, c * w)
            for v in range(row.shape[0]):
                row[v] = row[v] * cw
        # The two arc entries in float64: p * (gb + gl) - gb cancels when p ~ 1.
        row[blank] = _clip(e_blank * c - gb, clamp) * w
        if has_label:
            row[y] = _clip(e_label * c - gl, clamp) * w
    else:
        row[blank] = _clip(-gb, clamp) * w
        if has_label:
            row[y] = _clip(-gl, clamp) * w


@pjit
def grad_rows(src, dst, from_logits, targets, logit_lengths, target_lengths, blank, fused, spread,
              shift, inv_sum, gamma_blank, gamma_label, upstream, clamp):
    """Write ``upstream[b] * clip(d loss_b / d logits)`` into ``dst`` (B, T, U+1, V).

    fused and not from_logits: ``dst`` holds the exps that ``row_pass`` stored (src is
        dst); padding rows are already 0.
    fused and from_logits: the exps are recomputed from ``src`` = logits with the same
        code and shifts as ``row_pass`` (bit-identical result), padding rows zeroed.
    log-prob mode: ``dst`` comes in zero-filled; two entries per node are written.
    ``gamma_label`` must already include the FastEmit factor (1 + lambda).
    A sequence whose upstream gradient is 0 gets exactly 0, even where its gradient is NaN
    (math.md section 8).
    """
    B, T, U1, V = dst.shape
    for i in prange(B * T):
        b, t = _spread_row(i, spread, B, T)
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
                if not inv_sum[b, t, u] > 0.0:        # all -inf (0) or NaN row (see row_pass):
                    row[:] = 0.0                      # the stored buffer holds zeros there
                else:
                    _exp_store(src[b, t, u], shift[b, t, u], row)
            has_label = u < U_b
            y = targets[b, u] if has_label else 0
            _finish_row(row, blank, y, has_label, gamma_blank[b, t, u], gamma_label[b, t, u],
                        inv_sum[b, t, u], w, clamp, fused)


# =========================================================================== any topology
# The same three passes for every transducer topology (math.md section 9), driven by a
# table of arc kinds ``kinds (N_FIELDS, K)`` int64 (``kind_table`` in ``cpu/__init__``):
#
#   DT, DU    kind k leaves node (t, u) and lands on (t + dt, u + du)
#   CLS       token class it reads: a fixed id (blank, big blank), or -1 for the label y[u]
#   DUR       index of the duration softmax group it also reads (TDT), -1 for none
#   PNB       1: also reads the blank of node (t, u+1) (k2 "constrained")
#   FE        1: the gradient of its class read carries the FastEmit factor (1 + lambda)
#   DELAY     1: + delay_penalty * ((t1 - 1)/2 - t) on its weight
#   END       1: may land on the end frame t1 (only at the end node (t1, u1))
#
# The logits are rows ``(N, V)``, ``V = V_tok + n_dur``, and node (b, t, u) reads row
# ``node_rows[b, t, u]`` (-1: no row, every arc of the node is -inf). The padded layout
# ``(B, T, U+1, V)`` is the identity map over ``(B*T*(U+1), V)``. Each sequence has a start
# (t0, u0) and an end (t1, u1) (k2's boundary; by default (0, 0) and (T_b, U_b)); the rows
# of the region ``t0 <= t < t1, u0 <= u <= u1`` are read, every other row is padding.
# The per-node work is a loop over the K kinds; the loops over V do not look at the table.
DT, DU, CLS, DUR, PNB, FE, DELAY, END = range(8)
N_FIELDS = 8


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
    return kinds[END, k] != 0 and lt == t1 and lu == u1


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
        c = kinds[CLS, k]
        j = 0
        while j < n and cls[j] != c:
            j += 1
        if j == n:
            cls[n] = c
            n += 1
        slot[k] = j
    return cls[:n], slot


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
        elif lt == t1 and kinds[END, k] != 0:
            lo[k] = max(h, u0)
        else:
            lo[k] = h + 1
        hi[k] = h


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
    (the same float ops as ``_exp_store``). Loops over the nodes, not over the n ~ 5
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
def _read_entries(row, cls, slo, shi, u, y, V_tok, n_dur, has_pnb, blank, xc, xd):
    """The entries node u reads, in float64: ``xc[j]`` of each class slot whose span holds
    u (class -1: the label ``y``), ``xd`` the durations; returns the blank's entry
    (-inf unless ``has_pnb``)."""
    for j in range(cls.shape[0]):
        if u >= slo[j] and u <= shi[j]:
            c = cls[j]
            xc[j] = np.float64(row[y if c < 0 else c])
    for j in range(n_dur):
        xd[j] = np.float64(row[V_tok + j])
    return np.float64(row[blank]) if has_pnb else NEG_INF


@pjit
def kind_row_pass(rows, node_rows, targets, t0s, u0s, t1s, u1s, kinds, blank, n_dur, fused,
                  store, sigma, delay_penalty, spread, buf, shift, inv_sum, shift_d, inv_sum_d,
                  e_read, w, nan_row):
    """Pass 1 for any topology: row statistics and the arc weights (math.md 1 and 9).

    Args:
        rows: (N, V) float32/float64 logits rows (``V = V_tok + n_dur``), C-contiguous.
        node_rows: (B, T, U+1) int64, the row of each node or -1.
        targets: (B, U) int64. t0s, u0s, t1s, u1s: (B,) int64 start and end of each lattice.
        kinds: (N_FIELDS, K) int64 arc-kind table. blank: blank id in [0, V_tok).
        n_dur: size of the duration group (TDT), 0 otherwise. fused: raw scores (else
            log-probs). store: write exp(x - m) of each group into ``buf`` (N, V) (zeros
            in padding rows); ``buf`` may be ``rows`` (in-place mode).
        sigma, delay_penalty: the per-arc terms. spread: see ``spread_stride`` (B*T).
    Outputs, written on every node:
        shift, shift_d (B, T, U+1) dtype of rows: token / duration group row max.
        inv_sum, inv_sum_d (B, T, U+1) float64: 1 / sum exp(x - m) of each group.
        e_read (B, T, U+1, E) dtype of rows, E > the number of class slots
            (``_class_slots``), written when ``store``: the stored exp of each slot's class
            (the label's: any entry where no label arc leaves), and in column n_slots the
            blank's when a kind is ``plus_next_blank``: ``kind_grad_rows`` reads them.
        w (B, K, T, U+1) float64: arc weights (``reference.arc_weights``), -inf off the arcs:

            w_k(t,u) = x[cls_k] - lse + [dur_k] (x[V_tok + dur_k] - lse_d)
                       + [pnb_k] b(t, u+1) - sigma + [delay_k] delay_penalty ((t1-1)/2 - t)

        nan_row (B, T) uint8: 1 where an arc weight of the row (b, t) is NaN.
    Only arc entries are read before the row is overwritten (in-place mode); in log-prob
    mode only arc entries are read at all, a +inf one as NaN (math.md 8.1).

    Per row (b, t), two loops: over the nodes, the group statistics and the log-prob of
    each distinct class read (``_class_slots``) and of each duration; then over the kinds,
    the weights along each kind's span of nodes (``_arc_spans``). The kind table is read
    once per row, never per node or per element. Out of place, the entries are read after
    the exps, from the row they just streamed into the cache (read before, an entry far
    from the row's start waits a full memory latency: TDT's and multi-blank's blanks are
    the last tokens; measured 15-20% of this pass at V = 512).
    """
    B, T, U1 = node_rows.shape
    K = kinds.shape[1]
    V_tok = rows.shape[1] - n_dur
    cls, slot = _class_slots(kinds)
    nc = cls.shape[0]
    nd = max(n_dur, 1)
    has_pnb = False
    for k in range(K):
        if kinds[PNB, k] != 0:
            has_pnb = True
    read_first = not fused or (store and buf.ctypes.data == rows.ctypes.data)
    for i in prange(B * T):
        b, t = _spread_row(i, spread, B, T)
        t0, u0, t1, u1 = t0s[b], u0s[b], t1s[b], u1s[b]
        in_t = t >= t0 and t < t1
        delay_term = delay_penalty * ((t1 - 1) / 2.0 - t)
        # Scratch of the row: spans (int) and per-node log-probs (float64).
        ispan = np.empty(2 * K + 2 * nc, dtype=np.int64)
        lo, hi = ispan[:K], ispan[K:2 * K]
        slo, shi = ispan[2 * K:2 * K + nc], ispan[2 * K + nc:]
        U2 = U1 + 1
        fscr = np.empty((nc + nd + 1) * U2 + nc + nd)
        lpc = fscr[:nc * U2].reshape(nc, U2)          # log-prob of each slot's class
        lpd = fscr[nc * U2:(nc + nd) * U2].reshape(nd, U2)   # ... of each duration
        blank_lp = fscr[(nc + nd) * U2:(nc + nd + 1) * U2]   # b(t, u) (plus_next_blank)
        xc = fscr[(nc + nd + 1) * U2:(nc + nd + 1) * U2 + nc]
        xd = fscr[(nc + nd + 1) * U2 + nc:]
        lpc[:, :] = NEG_INF
        lpd[:, :] = 0.0
        blank_lp[:] = NEG_INF
        # The duration group of every node of the row (fused): entries, exps, row index.
        nu_d = U1 if fused and n_dur > 0 else 0
        dx = np.empty((nd, nu_d), dtype=rows.dtype)
        dex = np.empty((nd, nu_d), dtype=rows.dtype)
        d_row = np.full(nu_d, -1, dtype=np.int64)
        if in_t:
            _arc_spans(kinds, t, u0, t1, u1, lo, hi)
            for j in range(nc):
                slo[j], shi[j] = _union_spans(kinds, slot, j, 0, lo, hi)
        else:
            for k in range(K):
                lo[k], hi[k] = 0, -1
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
            # after the exps, from the row they just streamed into the cache: a read far
            # ahead of that stream waits a full memory latency.
            if read_first:
                x_blank = _read_entries(row, cls, slo, shi, u, y, V_tok, n_dur, has_pnb, blank, xc, xd)
            lse = 0.0                                 # log-prob mode: rows are normalised
            lse_d = 0.0
            if fused:
                # The token group inline (as a call, the exp loop runs ~30% slower).
                seg = row[:V_tok]
                m = _row_max(seg)
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
                        s = _exp_store(seg, m, out[:V_tok])
                    else:
                        s = _exp_sum(seg, m)
                    inv_sum[b, t, u] = 1.0 / s
                    lse = np.float64(m) + math.log(s)
                if not read_first:
                    x_blank = _read_entries(row, cls, slo, shi, u, y, V_tok, n_dur, has_pnb, blank, xc, xd)
                if store:                             # the exps the gradient pass reads
                    for j in range(nc):
                        c = cls[j]
                        if c < 0:
                            c = y if y >= 0 and y < V_tok else 0   # (no label read: any)
                        e_read[b, t, u, j] = out[c]
                    if has_pnb:
                        e_read[b, t, u, nc] = out[blank]
                if n_dur > 0:                         # (its statistics: after the node loop)
                    d_row[u] = r
                    for j in range(n_dur):
                        dx[j, u] = row[V_tok + j]
            else:                                     # a log-prob of +inf is invalid: NaN
                if x_blank == np.inf:
                    x_blank = np.nan
                for j in range(nc):
                    if xc[j] == np.inf:
                        xc[j] = np.nan
                for j in range(n_dur):
                    if xd[j] == np.inf:
                        xd[j] = np.nan
            blank_lp[u] = _read_lp(x_blank, lse)
            for j in range(nc):
                if u >= slo[j] and u <= shi[j]:
                    lpc[j, u] = _read_lp(xc[j], lse)
            if not fused:
                for j in range(n_dur):
                    lpd[j, u] = _read_lp(xd[j], lse_d)
        if fused and n_dur > 0:
            _duration_stats(dx, dex, d_row, n_dur, store, buf, V_tok, shift_d[b, t],
                            inv_sum_d[b, t], lpd)
        # The weights, kind by kind along its span (a node without a row: -inf).
        bad = 0
        for k in range(K):
            w[b, k, t, :] = NEG_INF
            n = hi[k] - lo[k] + 1
            if n <= 0:
                continue
            a = lo[k]
            d = kinds[DUR, k]
            delay = kinds[DELAY, k] != 0
            pnb = kinds[PNB, k] != 0
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
                if pnb:
                    x += nb_row[u]
                x = x if r_row[u] >= 0 else NEG_INF
                w_row[u] = x
                bad |= x != x
        nan_row[b, t] = bad


@njit(**JIT)
def _lse_terms(terms, n):
    """lae of ``terms[:n]`` as ``m + log sum_k exp(x_k - m)``: n cheap exps and one log per
    node instead of n - 1 (exp, log1p) pairs. -inf if all are -inf (or n = 0); NaN wins."""
    m = NEG_INF
    for k in range(n):
        x = terms[k]
        if x > m or x != x:
            m = x
        if m != m:
            return m
    if not m > NEG_INF:
        return m
    s = 0.0
    for k in range(n):
        s += exp_nonpos(terms[k] - m)
    return m + math.log(s)


@pjit
def kind_lattice(w, kinds, t0s, u0s, t1s, u1s, nan_row, alpha, beta, log_like, gamma):
    """Pass 2 for any topology: alpha, beta, log P and per-kind occupations, one sequence
    per thread (math.md sections 2, 3 and 9), on the nodes ``t0 <= t <= t1, u0 <= u <= u1``
    (frame t1 is the virtual end frame):

        alpha(t0, u0) = 0,  alpha(t,u) = lae_k  alpha(t - dt_k, u - du_k) + w_k(t - dt_k, u - du_k)
        beta(t1, u1)  = 0,  beta(t,u)  = lae_k  w_k(t,u) + beta(t + dt_k, u + du_k)
        log P = beta(t0, u0)
        gamma_k(t,u)  = exp(alpha(t,u) + w_k(t,u) + beta(t + dt_k, u + du_k) - log P)

    Args: w (B, K, T, U+1) float64 arc weights (-inf off the arcs), nan_row (B, T) from
    ``kind_row_pass``. Outputs: alpha, beta (B, T+1, U+1) float64, filled with -inf on
    entry (only each sequence's nodes are written); log_like (B,); gamma (B, K, T, U+1)
    zero-filled on entry. Every kind has dt >= 0, du in {0, 1}, dt + du >= 1, so rows in
    order (t outer, u inner) respect the alpha dependencies, and in reverse those of beta.
    A NaN arc weight anywhere makes log P NaN and every occupation NaN (math.md 8.1); no
    frame (t1 <= t0) or no path: log P = -inf, occupations 0.

    Row by row (``_row_terms``, ``_row_chain``): the kinds with dt >= 1 read finished rows,
    so their terms are summed for the whole row in loops over u that vectorise; only the
    kinds with dt = 0 (du = 1: a step along the row) leave a serial recursion, carried as
    (max, scaled sum) so that its exps and the log of each node stay off the dependency
    chain. Alpha (rows ascending) and beta (rows descending) alternate row by row.
    """
    B, K, T, U1 = w.shape
    for b in prange(B):
        t0, u0, t1, u1 = t0s[b], u0s[b], t1s[b], u1s[b]
        if t1 <= t0:                                  # no frame, no path
            log_like[b] = NEG_INF
            continue
        nu = u1 - u0 + 1
        am, asum, bm, bsum = np.empty(nu), np.empty(nu), np.empty(nu), np.empty(nu)
        w0 = np.empty(nu)                             # the dt = 0 kinds of a row, lae'd
        for i in range(t1 - t0 + 1):
            t = t0 + i
            _row_terms(w, kinds, b, t, t0, t1, u0, nu, alpha, am, asum, False)
            n0 = _row_w0(w, kinds, b, t, t1, u0, nu, w0)
            _row_chain(alpha[b, t, u0:u0 + nu], am, asum, w0, n0, i == 0, False)
            t = t1 - i
            if i == 0:                                # the end frame has no outgoing arc
                beta[b, t, u1] = 0.0
                continue
            _row_terms(w, kinds, b, t, t0, t1, u0, nu, beta, bm, bsum, True)
            n0 = _row_w0(w, kinds, b, t, t1, u0, nu, w0)
            _row_chain(beta[b, t, u0:u0 + nu], bm, bsum, w0, n0, False, True)
        ll = beta[b, t0, u0]
        for t in range(t0, t1):
            if nan_row[b, t] != 0:
                ll = np.nan
        log_like[b] = ll
        if ll == NEG_INF:                             # impossible: no occupation, no gradient
            continue
        if ll != ll:                                  # NaN: every arc's occupation is NaN
            for k in range(K):
                for t in range(t0, t1):
                    for u in range(u0, u1 + 1):
                        if _is_arc(kinds, k, t, u, t1, u1):
                            gamma[b, k, t, u] = np.nan
            continue
        # Over slices so that the loops vectorise (``_exp64``); w is -inf off the arcs, where
        # the exp gives 0.
        for k in range(K):
            dt = kinds[DT, k]
            du = kinds[DU, k]
            n = nu - du
            for t in range(t0, min(t1, t1 - dt + 1)):
                a_row = alpha[b, t, u0:u0 + n]
                w_row = w[b, k, t, u0:u0 + n]
                n_row = beta[b, t + dt, u0 + du:u0 + du + n]
                g_row = gamma[b, k, t, u0:u0 + n]
                for u in range(n):
                    g_row[u] = _exp64(a_row[u] + w_row[u] + n_row[u] - ll)


@njit(**dict(JIT, fastmath=FASTMATH - {"reassoc"}))
def _exp64(x):
    """exp(x) for float64 x <= 0 (NaN in -> NaN out, below -708: 0), as ``exp_nonpos``
    but with a plain polynomial for exp(r): the Taylor series to r^13 on |r| <= ln2/2
    (truncation < 5e-18, relative error ~2.2e-16 in all), no division, so that loops over
    it vectorise (``exp_nonpos``'s float64 rational form stays scalar). No "reassoc": it
    would fold the two-part ln 2."""
    n = np.floor(x * 1.4426950408889634 + 0.5)
    r = x - n * 6.93145751953125e-1
    r = r - n * 1.42860682030941723212e-6
    p = 1.0 / 6227020800.0
    p = p * r + 1.0 / 479001600.0
    p = p * r + 1.0 / 39916800.0
    p = p * r + 1.0 / 3628800.0
    p = p * r + 1.0 / 362880.0
    p = p * r + 1.0 / 40320.0
    p = p * r + 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    bits = np.int64(np.float64(p).view(np.int64) + (np.int64(n) << np.int64(52)))
    y = np.int64(bits).view(np.float64)
    y = 0.0 if x < -708.0 else y
    return y if x == x else x                         # int64(NaN) is undefined: keep NaN


@njit(**JIT)
def _nan_max(m, x):
    """max(m, x) where a NaN wins (and stays)."""
    return x if (x > m or x != x) else m


@njit(**JIT)
def _row_terms(w, kinds, b, t, t0, t1, u0, nu, node, m, s, backward):
    """The arcs of the kinds with dt >= 1 into (alpha: ``backward`` False) or out of
    (beta) the nodes of row t, whose other ends lie in finished rows of ``node``: per node
    j = u - u0 their max ``m[j]`` (-inf: none; NaN wins) and ``s[j] = sum exp(x - m)``
    (``m`` read as 0 where it is -inf, so that s is 0 there)."""
    K = kinds.shape[1]
    for j in range(nu):
        m[j] = NEG_INF
        s[j] = 0.0
    for k in range(K):
        dt = kinds[DT, k]
        du = kinds[DU, k]
        if dt == 0:
            continue
        n = nu - du
        if backward:                                  # w_k(t,u) + beta(t+dt, u+du)
            if t + dt > t1:
                continue
            xa = w[b, k, t, u0:u0 + n]
            xb = node[b, t + dt, u0 + du:u0 + du + n]
            mm = m[0:n]
        else:                                         # alpha(t-dt, u-du) + w_k(t-dt, u-du)
            if t - dt < t0:
                continue
            xa = w[b, k, t - dt, u0:u0 + n]
            xb = node[b, t - dt, u0:u0 + n]
            mm = m[du:du + n]
        for j in range(n):
            mm[j] = _nan_max(mm[j], xa[j] + xb[j])
    for k in range(K):
        dt = kinds[DT, k]
        du = kinds[DU, k]
        if dt == 0:
            continue
        n = nu - du
        if backward:
            if t + dt > t1:
                continue
            xa = w[b, k, t, u0:u0 + n]
            xb = node[b, t + dt, u0 + du:u0 + du + n]
            mm = m[0:n]
            ss = s[0:n]
        else:
            if t - dt < t0:
                continue
            xa = w[b, k, t - dt, u0:u0 + n]
            xb = node[b, t - dt, u0:u0 + n]
            mm = m[du:du + n]
            ss = s[du:du + n]
        for j in range(n):
            mj = mm[j]
            mr = 0.0 if mj == NEG_INF else mj
            ss[j] += _exp64(xa[j] + xb[j] - mr)


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
                w0[j] = _lae(w0[j], x[j])
        n0 += 1
    return n0


@njit(**dict(JIT, error_model="numpy"))
def _log64(x):
    """log(x) for float64 x >= 0 (0: -inf, NaN: NaN; subnormals are not handled: the
    callers' x is 0 or >= 1), as the exponent times ln 2 plus log f, f in [sqrt(1/2),
    sqrt(2)), by log f = 2 atanh(z), z = (f - 1) / (f + 1), |z| <= 0.172: the series to
    z^21 (truncation < 1e-18). A scalar libm call would not vectorise; NumPy's error model
    drops the zero check of the division, which would not either."""
    bits = np.float64(x).view(np.int64)
    e = (bits >> np.int64(52)) - np.int64(1023)
    mant = (bits & np.int64(0x000FFFFFFFFFFFFF)) | np.int64(0x3FF0000000000000)
    f = np.int64(mant).view(np.float64)                # x's mantissa, in [1, 2)
    big = f > 1.4142135623730951
    f = f * 0.5 if big else f
    e = e + 1 if big else e
    z = (f - 1.0) / (f + 1.0)
    zz = z * z
    p = 2.0 / 21.0
    p = p * zz + 2.0 / 19.0
    p = p * zz + 2.0 / 17.0
    p = p * zz + 2.0 / 15.0
    p = p * zz + 2.0 / 13.0
    p = p * zz + 2.0 / 11.0
    p = p * zz + 2.0 / 9.0
    p = p * zz + 2.0 / 7.0
    p = p * zz + 2.0 / 5.0
    p = p * zz + 2.0 / 3.0
    p = p * zz + 2.0
    fe = np.float64(e)
    y = fe * 6.93147180369123816490e-01 + (z * p + fe * 1.90821492927058770002e-10)
    y = NEG_INF if x == 0.0 else y
    return y if x == x else x


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
            M = _nan_max(mj, c)
            e = _exp64(-abs(mj - c))                  # NaN if either is NaN (or both -inf)
            big = mj >= c
            S = (sj if big else Sp) + (Sp if big else sj) * e
            S = 0.0 if M == NEG_INF else S
            m[j] = M
            s[j] = S
            Mp = M
            Sp = S
    for j in range(nu):
        mj = m[j]
        out[j] = mj + _log64(s[j]) if mj > NEG_INF else mj


@njit(**JIT)
def _alpha_source(kinds, k, t, u, t0, u0, t1):
    """``(st, su, ok)``: the source node of kind k's arc into node (t, u), and whether it
    is a region node (``t0 <= st < t1``, ``su >= u0``). The one rule of the alpha sweep in
    both semirings (``kind_lattice``: lae, ``kind_viterbi``: max); ``w`` is -inf off the
    arcs, so landing need not be checked."""
    st = t - kinds[DT, k]
    su = u - kinds[DU, k]
    return st, su, st >= t0 and su >= u0 and st < t1


@pjit
def kind_viterbi(w, kinds, t0s, u0s, t1s, u1s, nan_row, alpha, best_kind, log_prob):
    """The alpha sweep of ``kind_lattice`` in the max-plus semiring, recording the best
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
    sequence is NaN (``nan_row``, as ``kind_lattice``'s log P)."""
    B, K, T, U1 = w.shape
    for b in prange(B):
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
        lp = alpha[b, t1, u1]
        for t in range(t0, t1):
            if nan_row[b, t] != 0:
                lp = np.nan
        log_prob[b] = lp


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


@pjit
def kind_grad_rows(src, dst, from_logits, node_rows, targets, t0s, u0s, t1s, u1s, kinds, blank,
                   n_dur, fused, spread, shift, inv_sum, shift_d, inv_sum_d, e_read, gamma,
                   log_like, fastemit_scale, upstream, clamp):
    """Pass 3 for any topology: ``dst`` (N, V) = ``upstream[b] * d loss_b / d rows`` (math.md
    4-6 and 9; ``reference.grad_generic``).

    At node n the reads are: each arc kind's class (its occupation scaled by
    ``fastemit_scale`` = 1 + lambda for FastEmit kinds), the blank of a ``plus_next_blank``
    arc leaving (t, u-1), and for TDT each kind's duration. With ``S`` the sum of the
    scaled occupations read in the token group, ``S_d`` that in the duration group:

        d/dx_v          = p_v S - sum_{reads of class v} s gamma      (token group, clamped)
        d/dx_{V_tok+i}  = q_i S_d - sum_{kinds with duration i} gamma  (never clamped)

    Fused: ``dst`` holds the exps of ``kind_row_pass`` (src is dst), or with
    ``from_logits`` they are recomputed from ``src`` with the same shifts (bit-identical);
    ``p_v = exp(x_v - m) inv_sum``, so the bulk is one multiply per element and the few
    read classes are then set in float64 (``p S - s gamma`` cancels when p ~ 1). A NaN
    sequence (log P NaN) gets NaN on every entry of its region rows. Log-prob mode: ``dst``
    comes in zero-filled and only the read entries are written (``p`` taken as 0).
    Padding rows get 0, and so does every row of a sequence whose upstream is exactly 0.

    Per row (b, t) the sums S, S_d and the occupation of each distinct class read
    (``_class_slots``) and each duration are first gathered kind by kind along each kind's
    span of nodes (``_arc_spans``); the node loop then reads them, so the kind table is
    read once per row, never per node or per element. The exps of the read classes come
    from ``e_read`` (``kind_row_pass``), not from the row: read there before the bulk
    multiply, an entry far from the row's start waits a full memory latency.
    """
    B, T, U1 = node_rows.shape
    K = kinds.shape[1]
    V_tok = dst.shape[1] - n_dur
    cls, slot = _class_slots(kinds)
    nc = cls.shape[0]
    nd = max(n_dur, 1)
    for i in prange(B * T):
        b, t = _spread_row(i, spread, B, T)
        t0, u0, t1, u1 = t0s[b], u0s[b], t1s[b], u1s[b]
        wu = upstream[b]
        ll = log_like[b]
        in_t = t >= t0 and t < t1
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
        s_pnb = fscr[(nc + nd + 2) * U2:(nc + nd + 3) * U2]   # blank read by arcs from u-1
        rsub = fscr[(nc + nd + 3) * U2:(nc + nd + 3) * U2 + 2 * K + 2]   # ... their sums
        ev = fscr[(nc + nd + 3) * U2 + 2 * K + 2:]    # ... and their exps
        plo, phi = 0, -1
        if in_t and wu != 0.0:
            _arc_spans(kinds, t, u0, t1, u1, lo, hi)
            for j in range(nc):
                slo[j], shi[j] = _union_spans(kinds, slot, j, 0, lo, hi)
            plo, phi = _union_spans(kinds, slot, -1, PNB, lo, hi)
            for k in range(K):
                n = hi[k] - lo[k] + 1
                if n <= 0:
                    continue
                a = lo[k]
                d = kinds[DUR, k]
                scale = fastemit_scale if kinds[FE, k] != 0 else 1.0
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
                if kinds[PNB, k] != 0:                # the arc from (t, u) reads b(t, u+1)
                    p_row = s_pnb[a + 1:a + 1 + n]
                    sn_row = s_tok[a + 1:a + 1 + n]
                    for u in range(n):
                        p_row[u] += g_row[u]
                        sn_row[u] += g_row[u]
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
            n = 0
            for j in range(nc):
                if u >= slo[j] and u <= shi[j]:
                    c = cls[j]
                    n = _add_read(rcls, rsub, ev, n, targets[b, u] if c < 0 else c, sub[j, u],
                                  e_read[b, t, u, j] if fused else 0.0)
            if u > u0 and u - 1 >= plo and u - 1 <= phi:
                n = _add_read(rcls, rsub, ev, n, blank, s_pnb[u],
                              e_read[b, t, u, nc] if fused else 0.0)
            if not fused:
                for j in range(n):
                    row[rcls[j]] = _clip(-rsub[j], clamp) * wu
                for j in range(n_dur):
                    row[V_tok + j] = -dsub[j, u] * wu
                continue
            tok = row[:V_tok]
            if from_logits:
                if inv_sum[b, t, u] > 0.0:
                    _exp_store(src[r, :V_tok], shift[b, t, u], tok)
                else:                                 # dead or NaN group: stored as zeros
                    tok[:] = 0.0
                if n_dur > 0:
                    if inv_sum_d[b, t, u] > 0.0:
                        _exp_store(src[r, V_tok:], shift_d[b, t, u], row[V_tok:])
                    else:
                        row[V_tok:] = 0.0
            st = s_tok[u]
            if st == 0.0:                             # no arc reads the row (or no path)
                tok[:] = 0.0
            else:
                c = st * inv_sum[b, t, u]             # d/dx_v = exp(x_v - m) * inv_sum * S - ...
                if clamp > 0.0:
                    # p_v S >= 0: only the upper bound can bind off the read classes.
                    # A select, not min(): Numba's min is NaN-aware and does not vectorise.
                    c32 = cast_like(tok, c)
                    hi32 = cast_like(tok, clamp)
                    w32 = cast_like(tok, wu)
                    for v in range(tok.shape[0]):
                        g = tok[v] * c32
                        tok[v] = (hi32 if g > hi32 else g) * w32
                else:
                    cw = cast_like(tok, c * wu)
                    for v in range(tok.shape[0]):
                        tok[v] = tok[v] * cw
                # The read classes in float64: p S - s gamma cancels when p ~ 1.
                for j in range(n):
                    tok[rcls[j]] = _clip(ev[j] * c - rsub[j], clamp) * wu
            if n_dur > 0:                             # d/dx_{V_tok+i} = q_i S_d - gamma_i
                sd = s_dur[u]
                cd = sd * inv_sum_d[b, t, u]
                for j in range(n_dur):
                    q = np.float64(row[V_tok + j]) * cd if sd != 0.0 else 0.0
                    row[V_tok + j] = (q - dsub[j, u]) * wu


# --------------------------------------------------------------------------- window choice
@pjit
def window_dp(mass, max_step, total, starts, arg):
    """The dynamic program of math.md section 10 (``analysis.coverage.best_window_starts``
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
    for b in prange(B):
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
