"""Triton kernels of the GPU backend (docs/math.md, sections 1-6).

Three passes, as in the CPU backend:

1. ``_row_kernel`` — one program per lattice node ``(b, t, u)``: the row log-normaliser
   ``lse(t,u) = logsumexp_v logits(t,u,v)`` by an online max/sum over V in chunks of
   ``BLOCK_V`` (any V), and the arc log-probs ``b(t,u)``, ``e(t,u)``.
2. ``_lattice_kernel`` — one program per sequence: alpha (and beta) swept along the
   anti-diagonals ``d = t + u`` of the lattice. Cells on one diagonal depend only on the
   previous one, so the lanes of the program cover the label positions of a diagonal in
   blocks of ``BLOCK_U`` (any U), with a barrier between diagonals. ``MAX_SEMIRING``
   switches the same sweep to max-plus (Viterbi); there is no second recursion.
3. ``_grad_kernel`` — one program per node: the arc occupations (``_occupations``) and the
   fused gradient row, written once, with clamp, FastEmit and the upstream gradient fused.
   ``_gamma_kernel`` writes the same occupations for ``compute_lattice``.

Accumulation is float32 (float64 for float64 logits): ``ACC`` below. Offsets into the
``(B, T, U+1, V)`` logits are int64 (a batch of logits easily passes 2**31 elements).
Nothing here reads a tensor value on the host: every length is loaded inside a kernel, and
grid sizes come from tensor shapes only.

Padding (``t >= T_b`` or ``u > U_b``) is never loaded: every load of logits is masked by
the node's validity, so NaN-poisoned padding cannot leak into a result, and its gradient
is written as exactly 0.
"""
from __future__ import annotations

import triton
import triton.language as tl

# A global read inside a kernel must be a constexpr.
NEG_INF = tl.constexpr(float("-inf"))


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
def _occupations(alpha_ptr, beta_ptr, lpb_ptr, lpl_ptr, node, t, u, T_b, U_b, log_like, U1, ok):
    """Arc occupations of math.md section 3 at ``node = (b*T + t)*(U+1) + u`` (scalars or
    vectors); 0 where ``ok`` is false (padding, impossible sequences).

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
    gamma_blank = tl.where(ok, tl.exp(a + lb + nb - ll), 0.0)
    gamma_label = tl.where(ok & (u < U_b), tl.exp(a + le + ne - ll), 0.0)
    return gamma_blank, gamma_label


# --------------------------------------------------------------------------- pass 1
@triton.jit
def _row_kernel(
    # data ptrs
    logits_ptr, targets_ptr, logit_lengths_ptr, target_lengths_ptr,
    lse_ptr, lpb_ptr, lpl_ptr,
    # shapes
    T, U1, V, blank,
    # flags
    FUSED: tl.constexpr, ACC: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """lse, b, e of one node (math.md section 1). Outputs ``(B, T, U+1)`` in ACC:
    padding gets ``lse = 0`` and ``b = e = -inf``; a row whose logits are all -inf (every
    class masked) has ``lse = -inf`` and no arc leaving it."""
    # int64: node * V overflows int32 past 2**31 logits.
    node = tl.program_id(0).to(tl.int64)        # (b*T + t)*(U+1) + u
    u = node % U1
    t = (node // U1) % T
    b = node // (U1 * T)
    T_b = tl.load(logit_lengths_ptr + b)
    U_b = tl.load(target_lengths_ptr + b)
    valid = (t < T_b) & (u <= U_b)
    has_label = valid & (u < U_b)
    row = logits_ptr + node * V
    if FUSED:
        # Online logsumexp, per lane: m = running max, s = sum exp(x - m). A lane whose
        # max is still -inf uses 0 as its shift so that -inf - -inf never appears.
        # Padding rows are not read at all: their chunk limit is 0 (a scalar bound rather
        # than "valid & (v < V)": the interpreter mishandles a scalar & vector mask).
        v_end = tl.where(valid, V, 0)
        offs = tl.arange(0, BLOCK_V)
        m = tl.full([BLOCK_V], NEG_INF, ACC)
        s = tl.zeros([BLOCK_V], ACC)
        for v0 in range(0, V, BLOCK_V):
            x = tl.load(row + v0 + offs, mask=v0 + offs < v_end, other=NEG_INF).to(ACC)
            m_new = tl.maximum(m, x)
            shift = tl.where(m_new == NEG_INF, 0.0, m_new)
            s = s * tl.exp(m - shift) + tl.exp(x - shift)
            m = m_new
        row_max = tl.max(m, axis=0)
        shift = tl.where(row_max == NEG_INF, 0.0, row_max)
        lse = row_max + tl.log(tl.sum(s * tl.exp(m - shift), axis=0))   # -inf if all masked
    else:
        lse = tl.zeros([], ACC)                  # log-prob mode: rows are normalised
    live = valid & (lse > NEG_INF)
    y = tl.load(targets_ptr + b * (U1 - 1) + u, mask=has_label, other=0)
    x_blank = tl.load(row + blank, mask=live, other=0.0).to(ACC)
    x_label = tl.load(row + y, mask=live & has_label, other=0.0).to(ACC)
    tl.store(lse_ptr + node, tl.where(valid, lse, 0.0))
    tl.store(lpb_ptr + node, tl.where(live, x_blank - lse, NEG_INF))
    tl.store(lpl_ptr + node, tl.where(live & has_label, x_label - lse, NEG_INF))


# --------------------------------------------------------------------------- pass 2
@triton.jit
def _lattice_kernel(
    # data ptrs
    lpb_ptr, lpl_ptr, logit_lengths_ptr, target_lengths_ptr,
    alpha_ptr, beta_ptr, log_like_ptr,
    # shapes
    T, U1,
    # flags
    MAX_SEMIRING: tl.constexpr, BETA: tl.constexpr, BLOCK_U: tl.constexpr,
):
    """alpha (and beta) of one sequence b = program id, along anti-diagonals (math.md 2).

        alpha(0,0) = 0
        alpha(t,u) = lae(alpha(t-1,u) + b(t-1,u), alpha(t,u-1) + e(t,u-1))      d = t+u = 1, 2, ...
        beta(T_b-1,U_b) = b(T_b-1,U_b)
        beta(t,u)  = lae(beta(t+1,u) + b(t,u), beta(t,u+1) + e(t,u))            d = T_b+U_b-2, ..., 0
        log P      = alpha(T_b-1,U_b) + b(T_b-1,U_b)

    Diagonal d holds the cells u in [max(0, d-T_b+1), min(d, U_b)], t = d - u; they are
    independent of each other, so BLOCK_U lanes compute them a block at a time. The cells a
    diagonal reads were written by other lanes of this program in the previous diagonal:
    ``tl.debug_barrier()`` (a CTA barrier, which also orders global memory within the
    program) separates the diagonals. ``alpha``/``beta`` come in filled with -inf: only the
    nodes of the lattice are written. With ``MAX_SEMIRING`` lae becomes max (Viterbi).
    """
    b = tl.program_id(0).to(tl.int64)
    T_b = tl.load(logit_lengths_ptr + b)
    U_b = tl.load(target_lengths_ptr + b)
    base = b * T * U1
    offs = tl.arange(0, BLOCK_U)
    n_diag = tl.where(T_b > 0, T_b + U_b, 0)      # T_b = 0: no node, no path

    tl.store(alpha_ptr + base, 0.0, mask=T_b > 0)
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

    final = base + (T_b - 1) * U1 + U_b
    has_path = T_b > 0
    log_like = (tl.load(alpha_ptr + final, mask=has_path, other=NEG_INF)
                + tl.load(lpb_ptr + final, mask=has_path, other=NEG_INF))
    tl.store(log_like_ptr + b, log_like)

    if BETA:
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
    """gamma_blank, gamma_label ``(B, T, U+1)`` of BLOCK nodes (math.md section 3)."""
    node = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = node < n_nodes
    u = node % U1
    t = (node // U1) % T
    b = node // (U1 * T)
    T_b = tl.load(logit_lengths_ptr + b, mask=inside, other=0)
    U_b = tl.load(target_lengths_ptr + b, mask=inside, other=0)
    log_like = tl.load(log_like_ptr + b, mask=inside, other=NEG_INF)
    ok = inside & (t < T_b) & (u <= U_b) & (log_like > NEG_INF)
    gamma_blank, gamma_label = _occupations(alpha_ptr, beta_ptr, lpb_ptr, lpl_ptr, node, t, u,
                                            T_b, U_b, log_like, U1, ok)
    tl.store(gamma_blank_ptr + node, gamma_blank, mask=inside)
    tl.store(gamma_label_ptr + node, gamma_label, mask=inside)


@triton.jit
def _grad_kernel(
    # data ptrs
    logits_ptr, grad_ptr, targets_ptr, logit_lengths_ptr, target_lengths_ptr,
    lse_ptr, alpha_ptr, beta_ptr, lpb_ptr, lpl_ptr, log_like_ptr, upstream_ptr,
    # shapes
    T, U1, V, blank,
    # options: a (2,) ACC tensor [clamp, 1 + fastemit_lambda] (a float argument would be
    # passed as float32, too coarse for float64 logits)
    opts_ptr,
    # flags
    FUSED: tl.constexpr, CLAMP: tl.constexpr, ACC: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One gradient row ``upstream[b] * clip(d loss_b / d logits(t,u,:))`` (math.md 4-6),
    written once. ``grad_ptr`` may equal ``logits_ptr`` (in-place): every chunk is read
    before it is overwritten, by the same program.

        fused:    g_v = p_v (gb + s gl) - [v = blank] gb - [v = y_u] s gl,   p_v = exp(z_v - lse)
        log-prob: g_v =                 - [v = blank] gb - [v = y_u] s gl

    with s = 1 + fastemit_lambda (FastEmit: label arcs only) and gb, gl the occupations.
    Padding and impossible sequences (log P = -inf) get exactly 0.
    """
    node = tl.program_id(0).to(tl.int64)        # (b*T + t)*(U+1) + u
    u = node % U1
    t = (node // U1) % T
    b = node // (U1 * T)
    T_b = tl.load(logit_lengths_ptr + b)
    U_b = tl.load(target_lengths_ptr + b)
    log_like = tl.load(log_like_ptr + b)
    keep = (t < T_b) & (u <= U_b) & (log_like > NEG_INF)
    has_label = keep & (u < U_b)
    gamma_blank, gamma_label = _occupations(alpha_ptr, beta_ptr, lpb_ptr, lpl_ptr, node, t, u,
                                            T_b, U_b, log_like, U1, keep)
    clamp = tl.load(opts_ptr)
    gamma_label = gamma_label * tl.load(opts_ptr + 1)     # FastEmit: label arcs x (1 + lambda)
    y = tl.load(targets_ptr + b * (U1 - 1) + u, mask=has_label, other=-1)
    w = tl.load(upstream_ptr + b).to(ACC)
    lse = tl.load(lse_ptr + node, mask=keep, other=NEG_INF)
    live = keep & (lse > NEG_INF)                # an all -inf row has no mass
    lse = tl.where(live, lse, 0.0)
    row = node * V
    v_read = tl.where(live, V, 0)               # dead and padding rows are not read
    offs = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + offs
        inb = v < V
        if FUSED:
            x = tl.load(logits_ptr + row + v, mask=v < v_read, other=NEG_INF).to(ACC)
            g = tl.exp(x - lse) * (gamma_blank + gamma_label)
        else:
            g = tl.zeros([BLOCK_V], ACC)
        g = g - tl.where(v == blank, gamma_blank, 0.0) - tl.where(v == y, gamma_label, 0.0)
        if CLAMP:                                # both bounds (math.md section 5)
            g = tl.minimum(tl.maximum(g, -clamp), clamp)
        g = tl.where(keep, g * w, 0.0)
        tl.store(grad_ptr + row + v, g.to(grad_ptr.dtype.element_ty), mask=inb)
