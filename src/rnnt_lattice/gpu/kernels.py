"""Triton kernels of the GPU backend (docs/math.md, sections 1-6).

Three passes, as in the CPU backend:

1. ``_row_kernel`` — ``ROWS`` lattice nodes ``(b, t, u)`` per program: the row
   log-normaliser ``lse(t,u) = logsumexp_v logits(t,u,v)`` over V in chunks of ``BLOCK_V``
   (any V; one exp per element), and the arc log-probs ``b(t,u)``, ``e(t,u)``.
2. ``_lattice_kernel`` — two programs per sequence, alpha and beta at the same time (they
   only read ``b`` and ``e``), each swept along the anti-diagonals ``d = t + u``. Cells on
   one diagonal depend only on the previous one, so the lanes of a program cover the label
   positions of a diagonal in blocks of ``BLOCK_U`` (any U), with a barrier between
   diagonals. ``MAX_SEMIRING`` switches the same sweep to max-plus (Viterbi); there is no
   second recursion.
3. ``_grad_kernel`` — ``ROWS`` nodes per program: the arc occupations (``_occupations``)
   and the fused gradient rows, written once, with clamp, FastEmit and the upstream
   gradient fused. ``_gamma_kernel`` writes the same occupations for ``compute_lattice``.

Precision. The lattice — ``lse``, ``b``, ``e``, alpha, beta, ``log P`` and the occupations
— is float64 for every input dtype, as on the CPU: it is O(B*T*(U+1)) work against the
O(B*T*(U+1)*V) passes over the logits, and a float32 lattice carries an absolute error of
order ``eps32 * (T+U)`` into every occupation, hence into the gradient. The passes over V
read the logits in their own dtype and compute in ``ACC`` (float32; float64 for float64
logits): the exps of a chunk are summed in ACC (a tree reduction) and the chunk sums in
float64; the gradient rows use ``lse`` split into an ACC pair ``hi + lo`` so that
``logits - lse`` keeps the float64 normaliser's accuracy.

Offsets into the logits are int64 (a batch of logits easily passes 2**31 elements).
Nothing here reads a tensor value on the host: every length is loaded inside a kernel,
grid sizes come from tensor shapes only, and options are plain kernel arguments.

Padding (``t >= T_b`` or ``u > U_b``) is never loaded: every load of logits is masked by
the node's validity, so NaN-poisoned padding cannot leak into a result, and its gradient
is written as exactly 0. Lattice cells of padding are never read either, so the loss path
leaves alpha/beta of padding unwritten (``compute_lattice`` fills them with -inf).
"""
from __future__ import annotations

import triton
import triton.language as tl

# A global read inside a kernel must be a constexpr.
NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))
NAN = tl.constexpr(float("nan"))


# --------------------------------------------------------------------------- helpers
@triton.jit
def _log1p(x):
    """log(1 + x) for x >= 0, accurate for small x (Goldberg's trick: the rounding error
    of 1 + x cancels in log(u) * x / (u - 1)). libdevice's log1p has no interpreter
    implementation, so the CPU tests could not run it."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))


@triton.jit
def _combine(a, b, MAX_SEMIRING: tl.constexpr):
    """The semiring sum: ``lae(a, b)`` (log-sum-exp of two), or ``max(a, b)`` for Viterbi.
    -inf is the zero of both; a NaN propagates."""
    mx = tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
    if MAX_SEMIRING:
        return mx
    mn = tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)
    # lae(a, b) = max + log1p(exp(min - max)); both -inf gives -inf, not NaN.
    return tl.where(mx == NEG_INF, mx, mx + _log1p(tl.exp(mn - mx)))


@triton.jit
def _f64(hi, mid, lo):
    """A float64 option passed as three float32 kernel arguments (``gpu._f64_parts``):
    Triton passes a Python float as float32 (the interpreter too), and three float32
    parts carry the 53 bits of a double exactly."""
    # A float64 zero first: compiled, the float32 parts are promoted exactly; interpreted,
    # the arguments arrive as Python floats, which have no ``.to``.
    zero = tl.zeros([], tl.float64)
    return ((zero + hi) + mid) + lo


@triton.jit
def _node_coords(node, T, U1):
    """``(b, t, u)`` of ``node = (b*T + t)*(U+1) + u`` (int64)."""
    u = node % U1
    t = (node // U1) % T
    b = node // (U1 * T)
    return b, t, u


@triton.jit
def _occupations(alpha_ptr, beta_ptr, lpb_ptr, lpl_ptr, node, t, u, T_b, U_b, log_like, U1, ok):
    """Arc occupations of math.md section 3 at ``node`` (scalars or vectors), float64;
    0 where ``ok`` is false (padding, impossible sequences) and where the arc does not
    exist; NaN for every arc of a NaN sequence (log P = NaN).

        gamma_blank(t,u) = exp(alpha(t,u) + b(t,u) + beta(t+1,u) - log P)
        gamma_label(t,u) = exp(alpha(t,u) + e(t,u) + beta(t,u+1) - log P)

    with ``beta(T_b, U_b) = 0`` past the final blank and ``-inf`` for any other missing cell.
    """
    a = tl.load(alpha_ptr + node, mask=ok, other=NEG_INF)
    lb = tl.load(lpb_ptr + node, mask=ok, other=NEG_INF)
    le = tl.load(lpl_ptr + node, mask=ok, other=NEG_INF)
    last_t = t == T_b - 1
    nb = tl.load(beta_ptr + node + U1, mask=ok & (t < T_b - 1), other=NEG_INF)
    nb = tl.where(last_t & (u == U_b), 0.0, nb)
    ne = tl.load(beta_ptr + node + 1, mask=ok & (u < U_b), other=NEG_INF)
    ll = tl.where(ok, log_like, 0.0)
    # Only real blank arcs: (T_b-1, u < U_b) has none (its b is read but never used, so a
    # NaN there must not reach an occupation; math.md 8.1).
    has_blank = ok & ((t < T_b - 1) | (u == U_b))
    gamma_blank = tl.where(has_blank, tl.exp(a + lb + nb - ll), 0.0)
    gamma_label = tl.where(ok & (u < U_b), tl.exp(a + le + ne - ll), 0.0)
    return gamma_blank, gamma_label


# --------------------------------------------------------------------------- pass 1
@triton.jit
def _row_kernel(
    # data ptrs
    logits_ptr, targets_ptr, logit_lengths_ptr, target_lengths_ptr,
    lse_ptr, lpb_ptr, lpl_ptr,
    # shapes
    n_nodes, T, U1, V, blank,
    # flags
    FUSED: tl.constexpr, ACC: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """lse, b, e of ``ROWS`` nodes (math.md section 1). Outputs ``(B, T, U+1)`` float64:
    padding gets ``lse = 0`` and ``b = e = -inf``; a row whose logits are all -inf (every
    class masked) has ``lse = -inf`` and no arc leaving it; a NaN (either sign) or a +inf
    in a row makes its ``lse``, ``b`` and ``e`` NaN (math.md 8.1): either one turns the
    row's exp sum into NaN, whatever the running max does with it.

    Per chunk of ``BLOCK_V`` classes: the chunk max ``c``, the new running max
    ``m' = max(m, c)``, and ``s' = s * exp(m - m') + sum_v exp(x_v - m')`` — one exp per
    element (the rescaling is one exp per row and chunk). ``s`` is float64; the chunk's own
    sum is an ACC tree reduction. A row whose max is still -inf shifts by 0 instead, so that
    ``-inf - -inf`` never appears.
    """
    # int64: node * V overflows int32 past 2**31 logits.
    node = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)    # [ROWS]
    inside = node < n_nodes
    b, t, u = _node_coords(node, T, U1)
    T_b = tl.load(logit_lengths_ptr + b, mask=inside, other=0)
    U_b = tl.load(target_lengths_ptr + b, mask=inside, other=0)
    valid = inside & (t < T_b) & (u <= U_b)
    has_label = valid & (u < U_b)
    row = node * V
    if FUSED:
        # Padding rows are not read at all: their chunk limit is 0.
        v_end = tl.where(valid, V, 0)
        offs = tl.arange(0, BLOCK_V)
        m = tl.full([ROWS], NEG_INF, ACC)
        s = tl.zeros([ROWS], tl.float64)
        for v0 in range(0, V, BLOCK_V):
            v = v0 + offs
            x = tl.load(logits_ptr + row[:, None] + v[None, :],
                        mask=v[None, :] < v_end[:, None], other=NEG_INF).to(ACC)
            m_new = tl.maximum(m, tl.max(x, axis=1))
            shift = tl.where(m_new == NEG_INF, 0.0, m_new)
            chunk = tl.sum(tl.exp(x - shift[:, None]), axis=1)
            # m = -inf: exp(-inf - shift) = 0 rescales the empty sum; NaN stays NaN.
            s = s * tl.exp((m - shift).to(tl.float64)) + chunk.to(tl.float64)
            m = m_new
        shift = tl.where(m == NEG_INF, 0.0, m)
        lse = shift.to(tl.float64) + tl.log(s)                  # -inf if all masked
    else:
        lse = tl.zeros([ROWS], tl.float64)                       # log-prob mode: rows are normalised
    live = valid & (lse != NEG_INF)                              # NaN rows stay live: NaN flows on
    y = tl.load(targets_ptr + b * (U1 - 1) + u, mask=has_label, other=0)
    x_blank = tl.load(logits_ptr + row + blank, mask=live, other=0.0).to(tl.float64)
    x_label = tl.load(logits_ptr + row + y, mask=live & has_label, other=0.0).to(tl.float64)
    if not FUSED:
        # A log-prob of +inf is impossible: it reads as NaN (math.md 8.1). Fused rows with a
        # +inf already have lse = NaN (inf - inf in their sum).
        x_blank = tl.where(x_blank == POS_INF, NAN, x_blank)
        x_label = tl.where(x_label == POS_INF, NAN, x_label)
    tl.store(lse_ptr + node, tl.where(valid, lse, 0.0), mask=inside)
    tl.store(lpb_ptr + node, tl.where(live, x_blank - lse, NEG_INF), mask=inside)
    tl.store(lpl_ptr + node, tl.where(live & has_label, x_label - lse, NEG_INF), mask=inside)


# --------------------------------------------------------------------------- pass 2
@triton.jit
def _lattice_kernel(
    # data ptrs
    lpb_ptr, lpl_ptr, logit_lengths_ptr, target_lengths_ptr,
    alpha_ptr, beta_ptr, log_like_ptr, costs_ptr,
    # shapes
    T, U1,
    # flags
    MAX_SEMIRING: tl.constexpr, BLOCK_U: tl.constexpr,
):
    """alpha (program ``(b, 0)``) or beta (program ``(b, 1)``) of sequence b, along
    anti-diagonals (math.md 2), in float64:

        alpha(0,0) = 0
        alpha(t,u) = lae(alpha(t-1,u) + b(t-1,u), alpha(t,u-1) + e(t,u-1))      d = t+u = 1, 2, ...
        log P      = alpha(T_b-1,U_b) + b(T_b-1,U_b)
        beta(T_b-1,U_b) = b(T_b-1,U_b)
        beta(t,u)  = lae(beta(t+1,u) + b(t,u), beta(t,u+1) + e(t,u))            d = T_b+U_b-2, ..., 0

    Diagonal d holds the cells u in [max(0, d-T_b+1), min(d, U_b)], t = d - u; they are
    independent of each other, so BLOCK_U lanes compute them a block at a time. The cells a
    diagonal reads were written by other lanes of this program in the previous diagonal:
    ``tl.debug_barrier()`` (a CTA barrier, which also orders global memory within the
    program) separates the diagonals. Only the nodes of the lattice are written. The alpha
    program also writes ``log P`` (float64, ``-inf`` without a path) and the cost
    ``-log P`` in the costs' dtype (no separate negation launch). With ``MAX_SEMIRING``
    lae becomes max (Viterbi). Launch with grid ``(B, 1)`` for alpha alone.
    """
    b = tl.program_id(0).to(tl.int64)
    T_b = tl.load(logit_lengths_ptr + b)
    U_b = tl.load(target_lengths_ptr + b)
    base = b * T * U1
    offs = tl.arange(0, BLOCK_U)
    n_diag = tl.where(T_b > 0, T_b + U_b, 0)      # T_b = 0: no node, no path
    final = base + (T_b - 1) * U1 + U_b
    has_path = T_b > 0

    if tl.program_id(1) == 0:
        tl.store(alpha_ptr + base, tl.zeros([], tl.float64), mask=has_path)
        tl.debug_barrier()
        for d in range(1, n_diag):
            u_lo = tl.maximum(d - T_b + 1, 0)
            u_hi = tl.minimum(d, U_b)
            for u0 in range(u_lo, u_hi + 1, BLOCK_U):
                u = u0 + offs
                t = d - u
                on = u <= u_hi
                node = base + t * U1 + u
                blank_in = on & (t > 0)
                label_in = on & (u > 0)
                from_blank = (tl.load(alpha_ptr + node - U1, mask=blank_in, other=NEG_INF)
                              + tl.load(lpb_ptr + node - U1, mask=blank_in, other=NEG_INF))
                from_label = (tl.load(alpha_ptr + node - 1, mask=label_in, other=NEG_INF)
                              + tl.load(lpl_ptr + node - 1, mask=label_in, other=NEG_INF))
                tl.store(alpha_ptr + node, _combine(from_blank, from_label, MAX_SEMIRING), mask=on)
            tl.debug_barrier()
        log_like = (tl.load(alpha_ptr + final, mask=has_path, other=NEG_INF)
                    + tl.load(lpb_ptr + final, mask=has_path, other=NEG_INF))
        tl.store(log_like_ptr + b, log_like)
        tl.store(costs_ptr + b, (-log_like).to(costs_ptr.dtype.element_ty))
    else:
        tl.store(beta_ptr + final, tl.load(lpb_ptr + final, mask=has_path, other=NEG_INF),
                 mask=has_path)
        tl.debug_barrier()
        for i in range(0, n_diag - 1):
            d = n_diag - 2 - i
            u_lo = tl.maximum(d - T_b + 1, 0)
            u_hi = tl.minimum(d, U_b)
            for u0 in range(u_lo, u_hi + 1, BLOCK_U):
                u = u0 + offs
                t = d - u
                on = u <= u_hi
                node = base + t * U1 + u
                # (T_b-1, U_b) lies on the last diagonal: here t = T_b-1 means u < U_b,
                # whose blank leaves the lattice without ending the path.
                blank_in = on & (t < T_b - 1)
                label_in = on & (u < U_b)
                to_blank = (tl.load(beta_ptr + node + U1, mask=blank_in, other=NEG_INF)
                            + tl.load(lpb_ptr + node, mask=blank_in, other=NEG_INF))
                to_label = (tl.load(beta_ptr + node + 1, mask=label_in, other=NEG_INF)
                            + tl.load(lpl_ptr + node, mask=label_in, other=NEG_INF))
                tl.store(beta_ptr + node, _combine(to_blank, to_label, MAX_SEMIRING), mask=on)
            tl.debug_barrier()


# --------------------------------------------------------------------------- pass 3
@triton.jit
def _gamma_kernel(
    # data ptrs
    alpha_ptr, beta_ptr, lpb_ptr, lpl_ptr, log_like_ptr, logit_lengths_ptr, target_lengths_ptr,
    gamma_blank_ptr, gamma_label_ptr,
    # shapes
    n_nodes, T, U1,
    BLOCK: tl.constexpr,
):
    """gamma_blank, gamma_label ``(B, T, U+1)`` float64 of BLOCK nodes (math.md section 3)."""
    node = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = node < n_nodes
    b, t, u = _node_coords(node, T, U1)
    T_b = tl.load(logit_lengths_ptr + b, mask=inside, other=0)
    U_b = tl.load(target_lengths_ptr + b, mask=inside, other=0)
    log_like = tl.load(log_like_ptr + b, mask=inside, other=NEG_INF)
    ok = inside & (t < T_b) & (u <= U_b) & (log_like != NEG_INF)
    gamma_blank, gamma_label = _occupations(alpha_ptr, beta_ptr, lpb_ptr, lpl_ptr, node, t, u,
                                            T_b, U_b, log_like, U1, ok)
    tl.store(gamma_blank_ptr + node, gamma_blank, mask=inside)
    tl.store(gamma_label_ptr + node, gamma_label, mask=inside)


@triton.jit
def _grad_kernel(
    # data ptrs
    logits_ptr, grad_ptr, targets_ptr, logit_lengths_ptr, target_lengths_ptr,
    lse_ptr, alpha_ptr, beta_ptr, lpb_ptr, lpl_ptr, log_like_ptr, upstream_ptr,
    # shapes and strides
    n_nodes, T, U1, V, blank, upstream_stride,
    # options: clamp and s = 1 + fastemit_lambda, each a float64 in three float32 parts
    clamp_hi, clamp_mid, clamp_lo, scale_hi, scale_mid, scale_lo,
    # flags
    FUSED: tl.constexpr, CLAMP: tl.constexpr, ACC: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Gradient rows ``upstream[b] * clip(d loss_b / d logits(t,u,:))`` (math.md 4-6) of
    ``ROWS`` nodes, written once (NaN and inf: math.md 8.1). ``grad_ptr`` may equal ``logits_ptr`` (in-place): every
    chunk is read before it is overwritten, by the same program.

        fused:    g_v = p_v (gb + s gl) - [v = blank] gb - [v = y_u] s gl,   p_v = exp(z_v - lse)
        log-prob: g_v =                 - [v = blank] gb - [v = y_u] s gl

    with s = 1 + fastemit_lambda (FastEmit: label arcs only) and gb, gl the float64
    occupations. ``z_v - lse`` is computed as ``(z_v - hi) - lo`` with ``lse = hi + lo``
    split into ACC parts, so the float64 normaliser is not rounded before the subtraction.
    Padding, impossible sequences (log P = -inf) and sequences whose upstream gradient is
    exactly 0 get exactly 0 (a select, not a product: 0 * NaN would be NaN).
    ``upstream_stride`` lets the (B,) upstream gradient be an expanded scalar (stride 0, as
    autograd passes the gradient of a mean) without a copy.
    """
    node = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)    # [ROWS]
    inside = node < n_nodes
    b, t, u = _node_coords(node, T, U1)
    T_b = tl.load(logit_lengths_ptr + b, mask=inside, other=0)
    U_b = tl.load(target_lengths_ptr + b, mask=inside, other=0)
    log_like = tl.load(log_like_ptr + b, mask=inside, other=NEG_INF)
    w = tl.load(upstream_ptr + b * upstream_stride, mask=inside, other=0.0).to(ACC)
    keep = inside & (t < T_b) & (u <= U_b) & (log_like != NEG_INF)
    has_label = keep & (u < U_b)
    gamma_blank, gamma_label = _occupations(alpha_ptr, beta_ptr, lpb_ptr, lpl_ptr, node, t, u,
                                            T_b, U_b, log_like, U1, keep)
    gamma_label = gamma_label * _f64(scale_hi, scale_mid, scale_lo)   # FastEmit: label arcs x s
    gb = gamma_blank.to(ACC)
    gl = gamma_label.to(ACC)
    mass = (gamma_blank + gamma_label).to(ACC)
    clamp = _f64(clamp_hi, clamp_mid, clamp_lo).to(ACC)
    y = tl.load(targets_ptr + b * (U1 - 1) + u, mask=has_label, other=-1)
    y = tl.where(has_label, y, -1)
    lse = tl.load(lse_ptr + node, mask=keep, other=NEG_INF)
    live = keep & (lse != NEG_INF)               # an all -inf row has no mass
    lse = tl.where(live, lse, 0.0)
    lse_hi = lse.to(ACC)
    lse_lo = (lse - lse_hi.to(tl.float64)).to(ACC)
    write = keep & (w != 0.0)
    row = node * V
    v_read = tl.where(live, V, 0)               # dead and padding rows are not read
    offs = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + offs
        if FUSED:
            x = tl.load(logits_ptr + row[:, None] + v[None, :],
                        mask=v[None, :] < v_read[:, None], other=NEG_INF).to(ACC)
            g = tl.exp((x - lse_hi[:, None]) - lse_lo[:, None]) * mass[:, None]
        else:
            g = tl.zeros([ROWS, BLOCK_V], ACC)
        g = (g - tl.where(v[None, :] == blank, gb[:, None], 0.0)
             - tl.where(v[None, :] == y[:, None], gl[:, None], 0.0))
        if CLAMP:                                # both bounds (math.md section 5)
            g = tl.minimum(tl.maximum(g, -clamp, propagate_nan=tl.PropagateNan.ALL), clamp,
                           propagate_nan=tl.PropagateNan.ALL)        # NaN stays NaN
        g = tl.where(write[:, None], g * w[:, None], 0.0)
        tl.store(grad_ptr + row[:, None] + v[None, :], g.to(grad_ptr.dtype.element_ty),
                 mask=inside[:, None] & (v[None, :] < V))
