"""The simple-joiner losses of pruned RNN-T (math.md section 7; k2/fast_rnnt semantics,
docs/variants.md A.5), and the recursion on caller-given arc weights.

The simple loss never builds the ``(B, T, U+1, V)`` tensor: its normaliser is one batched
matmul per sequence,

    lse(t,u) = log( exp(am(t) - am_max(t)) . exp(lm(u) - lm_max(u)) ) + am_max(t) + lm_max(u)

(the maxima and the matmul in the input dtype, the log and everything after it in float64),
so memory is ``O(B T U + B (T + U) V)``. The arc log-probs ``b(t,u) = am(t,blank) +
lm(u,blank) - lse(t,u)`` and ``e(t,u) = am(t,y_u) + lm(u,y_u) - lse(t,u)`` then feed the
one recursion over arc weights (any topology of k2: ``regular``, ``modified``,
``constrained``; delay penalty; boundary): the backend's ``lattice_of_terms`` (Numba's
``kernels.lattice`` on CPU, Triton's ``_lattice_kernel`` and ``_gamma_kernel`` on CUDA,
the reference's recursion on ``backend="torch"``). Four small autograd Functions carry
the gradient: the recursion's (``_LatticeNLL``: ``d(-log P)/dw = -gamma``, mapped onto
``b`` and ``e``), the arc log-probs' (``_ArcTerms``: ``lse``, ``b``, ``e`` and the
smoothing's per-node sums), the normaliser's (``_JointMass``: the masses and the entries
read, with one in-place gradient buffer per input) and the smoothing's per-row terms
(``_Mix``); only k2's unigram (``_unigram``) is plain autograd. :func:`lattice_loss`
offers that recursion on arc weights the caller computes (k2's
``mutual_information_recursion``, HAT; ``rnnt_lattice.compat.k2`` builds on it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from .. import _backends
from .._ops import eager_under_compile, output_costs, reduce_costs, refuse_double_backward
from .._rules import with_bad_rows
from .._types import ArcParts, Ends, Smoothing
from .._validate import (check_boundary, check_flag, check_float, check_reduction,
                         check_simple_args, check_site, check_unbatched_upstream,
                         check_weight_args, device_value_check)
from ..reference import lattice_dtype

__all__ = ["rnnt_loss_simple", "rnnt_loss_smoothed", "lattice_loss", "ArcOccupations"]

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ArcOccupations:
    """Arc occupations of the simple lattice, with what :func:`prune_ranges` needs to
    read them. Unpacks as the pair ``(gamma_blank, gamma_label)`` (k2's ``(py_grad,
    px_grad)``, transposed to ``(B, T, U+1)``)::

        loss, (gamma_blank, gamma_label) = rnnt_loss_simple(..., return_occupations=True)

    Attributes:
        gamma_blank: ``(B, T, U+1)`` float64, occupation of the blank arc leaving ``(t, u)``.
        gamma_label: ``(B, T, U+1)`` float64, occupation of the label arc leaving ``(t, u)``
            (``(t,u) -> (t,u+1)`` for ``regular``, ``(t+1,u+1)`` otherwise); 0 at ``u = U_b``.
        logit_lengths, target_lengths: ``(B,)`` int64, as given to the loss.
        boundary: ``(B, 4)`` int64 or None, as given to the loss.
        rnnt_type: the lattice's topology name.
    """

    gamma_blank: torch.Tensor
    gamma_label: torch.Tensor
    logit_lengths: torch.Tensor
    target_lengths: torch.Tensor
    boundary: torch.Tensor | None
    rnnt_type: str

    def __iter__(self):
        yield self.gamma_blank
        yield self.gamma_label

    @property
    def node(self) -> torch.Tensor:
        """``(B, T, U+1)``: occ(t,u), the total occupation of the arcs leaving ``(t, u)``."""
        return self.gamma_blank + self.gamma_label


# ---------------------------------------------------------------------------------------
# The simple joiner's arc log-probs
# ---------------------------------------------------------------------------------------

class _JointMass(torch.autograd.Function):
    """The simple joiner's normaliser sums and the entries its arcs read, with a hand-written
    backward that makes one gradient buffer per input and updates it in place.

    Forward, from the backend's rows (``impl.simple_rows``: ``am_ok``, the shifts, the bad
    rows, ``ea = exp(am - am_shift)`` in the lattice dtype ``ldt`` on the rows ``am_ok``, 0
    on the others, and the entries read; ``el`` likewise; float64 because an exp of a
    float32 row, rounded to float32, would underflow 580 nats sooner and lose float64
    accuracy)::

        mass  (B, T, U+1) = ea @ el^T                 (the joint mass of node (t, u))
        am_uni (B, T)     = ea @ uni                  (smoothed loss only; else empty)
        am_cols = am[b, t, am_idx[b, t, j]],  lm_cols = lm[b, u, lm_idx[b, u, j]]  (0 off ok; ldt)

    ``mass`` is exact while it is above ``V * MASS_MIN`` (of its dtype). Below, the products
    ``ea(t,v) el(u,v)`` have left the float range (the classes where am and lm peak differ,
    by more than ~650 nats in all): those nodes (``rescued``) get their lse from the log
    domain, ``lse_rescued = logsumexp_v (am(t,v) + lm(u,v))``, over their two rows only
    (``_rescue``: on the host for CPU tensors, a Triton kernel on CUDA), and their mass is
    not used. The rows' ok, shift and bad flags come out too (not differentiable).

    Backward (``d ea / d am = ea``; for a rescued node ``p(v) = exp(am + lm - lse)``)::

        d am = ea * (g_mass @ el + g_am_uni uni^T) + scatter(am_idx, g_am_cols)
               + sum_{rescued u} g_lse p,                                        0 off ok
        d lm = el * (g_mass^T @ ea) + scatter(lm_idx, g_lm_cols) + sum_{rescued t} g_lse p
        d uni = g_am_uni^T ea

    (the products in ``torch.bmm``, the rest in ``impl.simple_rows_backward``, in place)
    against autograd's chain of where, sub, exp, matmul and gather, each with its own
    buffer of the inputs' size in the backward."""

    @staticmethod
    def forward(ctx, am, lm, frames, positions, am_idx, lm_idx, uni, ldt, impl):
        am_ok, am_shift, am_bad, ea, am_cols = impl.simple_rows(am, frames, am_idx)
        lm_ok, lm_shift, lm_bad, el, lm_cols = impl.simple_rows(lm, positions, lm_idx)
        mass = torch.bmm(ea, el.transpose(1, 2))                                         # (B, T, U+1)
        am_uni = torch.matmul(ea, uni.to(ldt)) if uni is not None else ea.new_empty(0)  # (B, T)
        rescued, lse_rescued = _rescue(impl, am, lm, am_ok, lm_ok, mass)
        ctx.save_for_backward(ea, el, am_ok, lm_ok, am_idx, lm_idx, uni, am, lm, rescued,
                              lse_rescued)
        ctx.impl = impl
        ctx.set_materialize_grads(False)    # None, not a zero tensor, for an unused output
        stats = (am_ok, am_shift, am_bad, lm_ok, lm_shift, lm_bad)
        ctx.mark_non_differentiable(rescued, *stats)
        if uni is None:
            ctx.mark_non_differentiable(am_uni)
        return (mass, am_uni, am_cols, lm_cols, lse_rescued, rescued) + stats

    @staticmethod
    def backward(ctx, g_mass, g_am_uni, g_am_cols, g_lm_cols, g_rescued, *_g):
        ea, el, am_ok, lm_ok, am_idx, lm_idx, uni, am, lm, rescued, lse = ctx.saved_tensors
        B, T, V = ea.shape
        grad_am = grad_lm = grad_uni = None
        if g_mass is None:
            g_mass = ea.new_zeros(B, T, el.shape[1])
        g_mass = g_mass.to(ea.dtype)
        if uni is None:
            g_am_uni = None
        if ctx.needs_input_grad[0]:
            grad_am = torch.bmm(g_mass, el)                                              # (B, T, V)
            ctx.impl.simple_rows_backward(grad_am, ea, am_ok, g_am_uni, uni, am_idx, g_am_cols)
        if ctx.needs_input_grad[1]:
            grad_lm = torch.bmm(g_mass.transpose(1, 2), ea)                             # (B, U+1, V)
            ctx.impl.simple_rows_backward(grad_lm, el, lm_ok, None, None, lm_idx, g_lm_cols)
        if g_rescued is not None and (grad_am is not None or grad_lm is not None):
            # rescued nodes lie on ok rows only: the rows' zeros stay zeros
            ctx.impl.simple_rescue_backward(am, lm, rescued, lse, g_rescued, grad_am, grad_lm)
        if grad_am is not None:
            grad_am = grad_am.to(am.dtype)
        if grad_lm is not None:
            grad_lm = grad_lm.to(lm.dtype)
        if g_am_uni is not None and ctx.needs_input_grad[6]:
            grad_uni = torch.matmul(g_am_uni.to(ea.dtype).reshape(1, -1), ea.view(-1, V))[0]
            grad_uni = grad_uni.to(uni.dtype)
        return grad_am, grad_lm, None, None, None, None, grad_uni, None, None


# A node's float64 mass is exact (relative error below 2^-60) while it is at least
# V * MASS_MIN: each of its V products then carries an absolute error of at most 2^-1074
# (the subnormal spacing). Below, the node is recomputed in the log domain (``_rescue``).
# In a float32 lattice (a device without float64, ``lattice_dtype``) the same bound is
# 2^-100: products then err by at most 2^-149 each, 2^-49 of the mass, far below float32's
# own rounding (2^-1000 would round to 0 there and rescue nothing).
MASS_MIN = {torch.float64: 2.0 ** -1000, torch.float32: 2.0 ** -100}


def _rescue(impl, am, lm, am_ok, lm_ok, mass):
    """``(rescued (B, T, U+1) bool, lse_rescued (B, T, U+1))``, lse in the lattice dtype
    (float64 where the device has it): the nodes of ``ok`` rows whose ``mass`` is below ``V
    * MASS_MIN``, and their exact lse, ``logsumexp_v (am(t,v) + lm(u,v))`` (``-inf``
    elsewhere), from the backend's ``simple_rescue`` (CPU: only those nodes, found on the
    host; CUDA: a Triton kernel whose programs, 256 nodes each, return at once where none
    of theirs is marked: no host synchronisation). (Never traced: the simple losses run
    eagerly under ``torch.compile``.)"""
    V = am.shape[2]
    need = (mass < V * MASS_MIN[mass.dtype]) & am_ok[:, :, None] & lm_ok[:, None, :]
    return need, impl.simple_rescue(am, lm, need)


def _unigram(lm: torch.Tensor) -> torch.Tensor:
    """k2's unigram ``(V,)``: the mean over every row of lm, padding included, of its
    softmax, plus ``tiny``."""
    return torch.softmax(lm, -1).mean((0, 1)) + torch.finfo(lm.dtype).tiny


def _simple_terms(impl, lm, am, targets, blank, frames, positions, smooth):
    """The simple joiner's arc log-probs ``(b, e)`` ``(B, T, U+1)`` in the lattice dtype
    (``e`` is ``-inf`` at ``u = U``), smoothed with the scales ``smooth = (s_lm, s_am)``
    unless it is None (:func:`rnnt_loss_smoothed`), differentiable w.r.t. ``am`` and
    ``lm``. ``frames (B, T)`` / ``positions (B, U+1)``: the rows read (the others are
    padding)."""
    B, T, V = am.shape
    U1 = lm.shape[1]
    ldt = lattice_dtype(am.device)
    # The entries the arcs read: classes [blank, y_0 .. y_{U-1}] of every am row, [blank,
    # y_u] of lm row u (y_U: a placeholder, never used).
    safe_targets = targets.clamp(0, V - 1)                                  # padding may hold anything
    cols = torch.nn.functional.pad(safe_targets, (1, 0), value=blank)       # (B, U+1)
    am_idx = cols[:, None, :].expand(B, T, U1)
    lm_idx = torch.stack((cols.new_full((B, U1), blank), cols.roll(-1, 1)), -1)   # (B, U+1, 2)
    x = lm if lm.dtype in (torch.float32, torch.float64) else lm.float()
    uni = _unigram(x).to(am.dtype) if smooth is not None else None
    (mass, am_uni, am_cols, lm_cols, lse_rescued, rescued, am_ok, am_shift, am_bad, lm_ok,
     lm_shift, lm_bad) = _JointMass.apply(am, lm, frames, positions, am_idx, lm_idx, uni, ldt,
                                          impl)
    shifts = (am_shift, lm_shift, am_bad, lm_bad)
    if smooth is None:
        return _ArcTerms.apply(mass, lse_rescued, rescued, am_cols, lm_cols, shifts, None, impl)
    mix, terms = _mix(lm, am_ok, lm_ok, shifts[0], am_uni, uni, safe_targets, blank, *smooth,
                      ldt)
    return _ArcTerms.apply(mass, lse_rescued, rescued, am_cols, lm_cols, shifts, mix, impl,
                           *terms)


def _mix(lm, am_ok, lm_ok, am_shift, am_uni, uni, y, blank, s_lm, s_am, ldt):
    """The smoothed loss's terms (:func:`rnnt_loss_smoothed`) that are neither per node nor
    an entry of am or lm: ``(Smoothing(c, s_am', s_lm'), (P (B, T), Q (B, U+1), R (B, T),
    S (B, U)))`` with ``c = 1 - s_lm - s_am`` and the scales' zeros replaced by 1e-20 (k2:
    ``0 * -inf`` would be NaN) in ``s_lm', s_am'``; the terms from :class:`_Mix`."""
    c = 1.0 - s_lm - s_am
    s_lm = s_lm if s_lm != 0.0 else 1e-20
    s_am = s_am if s_am != 0.0 else 1e-20
    terms = _Mix.apply(lm, am_uni, uni, am_ok, lm_ok, am_shift, y, blank, s_lm, s_am, ldt)
    return Smoothing(c, s_am, s_lm), terms


class _Mix(torch.autograd.Function):
    """The terms P, Q, R, S of the smoothed arc log-probs (``_ArcTerms`` adds the entries:
    ``s_am' b_am = s_am' am(t, blank) + P`` and so on), as one node of the graph with a
    hand-written backward (autograd's took some 28 operations, each a kernel on a GPU).
    With ``lm_s = lm`` on the rows read (``lm_ok``) and 0 elsewhere, ``am_uni' = am_uni``
    on ``am_ok`` and 1 elsewhere (rows off ``am_ok`` have no mass, ``ea = 0``: log 1
    instead of log 0, whose gradient would put 0/0 into uni's)::

        an(t) = log am_uni'(t) + am_shift(t)          (am_only_norm: log sum_v e^am uni)
        ln(u) = logsumexp_v lm_s(u, v)                (lm_only_norm)
        P = s_am (log uni(blank) - an),   Q = -s_lm ln,   R = -s_am an,
        S(u) = Q(u) + s_am log uni(y_u)               (u < U)

    Backward, from ``G_P .. G_S`` (None: 0)::

        d am_uni = -s_am (G_P + G_R) / am_uni'        (0 off am_ok)
        d lm     = softmax(lm_s) g_ln,   g_ln = -s_lm (G_Q + [G_S, 0])   (0 off lm_ok)
        d uni    = s_am (e_blank sum G_P + sum_{b,u} e_{y_u} G_S(b, u)) / uni

    (uni's gradient also gets ``_JointMass``'s, by autograd). ``lm (B, U+1, V)``, ``uni
    (V,)`` in lm's dtype; ``am_uni, am_shift (B, T)`` and the terms in ``ldt``."""

    @staticmethod
    def forward(ctx, lm, am_uni, uni, am_ok, lm_ok, am_shift, y, blank, s_lm, s_am, ldt):
        U = y.shape[1]
        lm_s = torch.where(lm_ok[..., None], lm, 0.0)                           # (B, U+1, V)
        am_uni = torch.where(am_ok, am_uni, 1.0)
        an = torch.log(am_uni.to(ldt)).add_(am_shift)                          # (B, T)
        log_uni = torch.log(uni).to(ldt)
        R = an.mul_(-s_am)
        P = torch.add(R, log_uni[blank], alpha=s_am)
        # In ldt: rounded to lm's dtype, an lm around 1e4 moved every arc weight by 5e-4
        # (the ulp of the normaliser), and gamma with them, am's gradient too.
        Q = torch.logsumexp(lm_s.to(ldt), -1).mul_(-s_lm)                     # (B, U+1)
        S = torch.add(Q[:, :U], log_uni[y], alpha=s_am)
        ctx.save_for_backward(lm_s, am_uni, uni, am_ok, lm_ok, y)
        ctx.blank, ctx.s_lm, ctx.s_am = blank, s_lm, s_am
        ctx.set_materialize_grads(False)
        return P, Q, R, S

    @staticmethod
    @once_differentiable
    def backward(ctx, g_P, g_Q, g_R, g_S):
        lm_s, am_uni, uni, am_ok, lm_ok, y = ctx.saved_tensors
        s_lm, s_am = ctx.s_lm, ctx.s_am
        U = y.shape[1]
        grad_lm = grad_am_uni = grad_uni = None
        if (g_P is not None or g_R is not None) and ctx.needs_input_grad[1]:
            g_an = g_P if g_R is None else (g_R if g_P is None else g_P + g_R)
            # The scale first: am_uni may be subnormal (am and lm peaking at classes far
            # apart) and s_am 1e-20 (a zero scale), where g / am_uni alone overflows.
            grad_am_uni = torch.where(am_ok, g_an * -s_am / am_uni, 0.0).to(am_uni.dtype)
        if (g_Q is not None or g_S is not None) and ctx.needs_input_grad[0]:
            g_ln = torch.zeros(lm_ok.shape, dtype=lm_s.dtype, device=lm_s.device) \
                if g_Q is None else g_Q.to(lm_s.dtype, copy=True)
            if g_S is not None:
                g_ln[:, :U] += g_S.to(lm_s.dtype)
            g_ln = torch.where(lm_ok, g_ln, 0.0).mul_(-s_lm)
            grad_lm = torch.softmax(lm_s, -1).mul_(g_ln[..., None])
        if (g_P is not None or g_S is not None) and ctx.needs_input_grad[2]:
            ldt = (g_P if g_P is not None else g_S).dtype
            g_log_uni = torch.zeros(uni.shape, dtype=ldt, device=uni.device)
            if g_S is not None:
                g_log_uni.index_add_(0, y.reshape(-1), g_S.reshape(-1))
            if g_P is not None:
                g_log_uni[ctx.blank] += g_P.sum()
            grad_uni = g_log_uni.mul_(s_am).to(uni.dtype).div_(uni)
        return (grad_lm, grad_am_uni, grad_uni) + (None,) * 8


class _ArcTerms(torch.autograd.Function):
    """The arc log-probs ``(b', e')`` ``(B, T, U+1)`` of the simple and smoothed losses from
    the normaliser's parts (``_JointMass``), as one node of the graph with a hand-written
    backward, both computed by the backend (``impl.arc_terms``, ``impl.arc_terms_backward``:
    the PyTorch operations of ``torch_backend`` on CPU, which took some 64 operations a
    call, each a kernel on a GPU; on CUDA ``gpu.arc_terms``, one launch forward and two
    backward). With ``as, ls, am_bad, lm_bad = shifts``::

        lse(t,u) = log mass(t,u) + as(t) + ls(u)    (mass > 0 and not rescued: ``live``)
                 = lse_rescued(t,u)                  (rescued)
                 = -inf (no mass),  NaN where a row is bad (NaN or +inf)
        b(t,u)   = am(t, blank) + lm(u, blank) - lse(t,u)
        e(t,u)   = am(t, y_u) + lm(u, y_u) - lse(t,u)      (u < U; -inf at u = U)
                   (b and e -inf where lse is -inf: a dead node: ``reference.read_entry``)

    smoothed (``mix``: a :class:`Smoothing` ``(c, s_am, s_lm)``, and the terms P, Q, R, S
    of :func:`_mix`)::

        b' = c b + s_lm lm(u, blank) + Q(u) + s_am am(t, blank) + P(t)
        e' = c e + s_lm lm(u, y_u) + S(u) + s_am am(t, y_u) + R(t)           (u < U)

    else ``b' = b, e' = e``. Backward, from ``G_b, G_e`` (the gradients of b', e'), ``g = c
    G`` on the nodes where lse is not -inf (0 elsewhere; c = 1 without a mix)::

        d P = sum_u G_b,  d Q = sum_t G_b,  d R = sum_u G_e,  d S = sum_t G_e
        d am(t, blank) = sum_u g_b + s_am d P,   d lm(u, blank) = sum_t g_b + s_lm d Q
        d am(t, y_u)   = g_e + s_am G_e,         d lm(u, y_u)   = sum_t g_e + s_lm d S
        d lse          = -(g_b + g_e);  d mass = d lse / mass (live, not bad);
        d lse_rescued  = d lse (rescued, not bad)

    ``am_cols (B, T, U+1)`` = ``[am(t, blank), am(t, y_0) ..]`` and ``lm_cols (B, U+1, 2)``
    = ``[lm(u, blank), lm(u, y_u)]`` in the lattice dtype (``simple_rows``), and so their
    gradients, which ``_JointMass`` adds to the normaliser's in that dtype."""

    @staticmethod
    def forward(ctx, mass, lse_rescued, rescued, am_cols, lm_cols, shifts, mix, impl, *mix_terms):
        parts = ArcParts(mass, lse_rescued, rescued, am_cols, lm_cols, *shifts, *mix_terms)
        b, e, saved = impl.arc_terms(parts, mix)
        ctx.mix, ctx.impl = mix, impl
        ctx.dtypes = am_cols.dtype, lm_cols.dtype
        ctx.set_materialize_grads(False)    # None, not a zero tensor, for an unused output
        ctx.save_for_backward(*saved)
        return b, e

    @staticmethod
    def backward(ctx, g_b2, g_e2):
        g_mass, g_resc, g_am, g_lm, mix_grads = ctx.impl.arc_terms_backward(
            ctx.saved_tensors, g_b2, g_e2, ctx.mix, ctx.dtypes)
        return (g_mass, g_resc, None, g_am, g_lm, None, None, None) + tuple(mix_grads)


# ---------------------------------------------------------------------------------------
# The recursion as an autograd Function of the arc weights
# ---------------------------------------------------------------------------------------

class _LatticeNLL(torch.autograd.Function):
    """``-log P (B,)`` of the lattice whose arcs read the blank / label log-probs ``b, e``
    ``(B, T, U+1)``, and the per-kind occupations ``gamma (B, K, T, U+1)`` (not
    differentiable), from ``lattice`` (the backend's ``lattice_of_terms``: the arc weights
    of ``reference.terms_weights``, the delay penalty, ``-inf`` off the arcs, without a
    graph).

    Backward: ``d(-log P)/dw_k = -gamma_k`` times the upstream gradient, exactly 0 where the
    upstream is 0 (a select, math.md 8.1) and for sequences without a path (their gamma is
    0); NaN sequences get NaN. Each kind's weight is its class's log-prob (plus a constant),
    plus ``b(t, u+1)`` for ``plus_next_blank``, so

        d/db(t,u) = sum_{k reads blank} G_k(t,u) + sum_{k plus_next_blank} G_k(t,u-1)
        d/de(t,u) = sum_{k reads label} G_k(t,u),       G_k = d(-log P)/dw_k,

    one pass over ``gamma`` instead of autograd through the masks and the stack."""

    @staticmethod
    def forward(ctx, b, e, topo, ends, delay_penalty, lattice):
        with torch.no_grad():
            log_like, gamma = lattice(b, e, topo, ends, delay_penalty)
        ctx.topo = topo
        ctx.save_for_backward(gamma)
        ctx.mark_non_differentiable(gamma)
        ctx.set_materialize_grads(False)    # no zero tensor the size of gamma for its grad
        return -log_like, gamma

    @staticmethod
    def backward(ctx, grad_costs, _grad_gamma):
        # gamma was saved without a graph: a gradient asked with create_graph=True would
        # come back constant, and a gradient penalty would be silently 0.
        refuse_double_backward("the lattice losses (lattice_loss, rnnt_loss_simple, "
                               "rnnt_loss_smoothed)")
        if grad_costs is None:
            return None, None, None, None, None, None
        check_unbatched_upstream(grad_costs)
        (gamma,) = ctx.saved_tensors
        up = grad_costs.to(gamma.dtype)[:, None, None, None]
        g = torch.where(up == 0, 0.0, gamma * -up)                          # G_k (B, K, T, U+1)
        kinds = ctx.topo.kinds
        grad_b, grad_e = (_sum_kinds(g, [k for k, kind in enumerate(kinds) if kind.reads == key])
                          for key in ("blank", "label"))
        nb = [k for k, kind in enumerate(kinds) if kind.plus_next_blank]
        if nb:
            grad_b = grad_b.clone()                  # a view of g: g's planes are read below
            for k in nb:
                grad_b[..., 1:] += g[:, k, :, :-1]                           # it read b(t, u+1)
        return grad_b, grad_e, None, None, None, None


def _sum_kinds(g: torch.Tensor, ks: list) -> torch.Tensor:
    """``sum_{k in ks} g[:, k]`` ``(B, T, U+1)``: a view for one kind, zeros for none."""
    if len(ks) == 1:
        return g[:, ks[0]]
    if not ks:
        return torch.zeros_like(g[:, 0])
    return g[:, ks].sum(1)


# ---------------------------------------------------------------------------------------
# Public losses
# ---------------------------------------------------------------------------------------

def lattice_loss(
    blank_weights: torch.Tensor,
    label_weights: torch.Tensor,
    logit_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    *,
    rnnt_type: str = "regular",
    delay_penalty: float = 0.0,
    boundary: torch.Tensor | None = None,
    return_occupations: bool = False,
    backend: str = "auto",
):
    r"""Per-sequence ``-log P`` of the transducer lattice whose arcs carry log-weights the
    caller computed, with its exact gradient w.r.t. both weight tensors: the recursion of
    :func:`rnnt_lattice.rnnt_loss` for weights that do not come from one softmax per node
    (HAT's sigmoid blank, an external LM, k2's ``mutual_information_recursion``).

    ``blank_weights[b, t, u]`` is the log-weight ``w_b(t,u)`` of the blank arc ``(t,u) ->
    (t+1,u)``, ``label_weights[b, t, u]`` the log-weight ``w_e(t,u)`` of the label arc
    leaving ``(t,u)``, to ``(t,u+1)`` (``regular``) or ``(t+1,u+1)`` (``modified``;
    ``constrained``: that arc carries ``w_e(t,u) + w_b(t,u+1)``); math.md sections 2 and 9
    with ``b = w_b``, ``e = w_e``. For ``regular``::

        alpha(t,u) = lae(alpha(t-1,u) + w_b(t-1,u), alpha(t,u-1) + w_e(t,u-1))
        loss_b     = -(alpha(T_b-1,U_b) + w_b(T_b-1,U_b))
        d loss_b / d w_b(t,u) = -gamma_blank(t,u),   d loss_b / d w_e(t,u) = -gamma_label(t,u)

    The weights need not be normalised (any reals, ``-inf`` for a missing arc). k2's delay
    penalty adds ``delay_penalty ((T_b - 1)/2 - t)`` to the label arcs, as in
    :func:`rnnt_loss_simple`. The recursion runs in float64 on the backend's lattice
    kernel, the one :func:`rnnt_loss_simple` uses.

    Example (log-probs gathered by hand give :func:`rnnt_lattice.rnnt_loss`)::

        >>> import torch, rnnt_lattice
        >>> logp = torch.randn(2, 6, 4, 5, dtype=torch.float64).log_softmax(-1)   # (B, T, U+1, V)
        >>> targets, T_b, U_b = torch.tensor([[1, 2, 3], [4, 1, 0]]), torch.tensor([6, 4]), torch.tensor([3, 2])
        >>> label_ids = torch.nn.functional.pad(targets, (0, 1))[:, None, :, None].expand(2, 6, 4, 1)
        >>> w_b = logp[..., 0].requires_grad_()                                 # blank = 0
        >>> w_e = logp.gather(3, label_ids)[..., 0].requires_grad_()            # (B, T, U+1)
        >>> loss = rnnt_lattice.lattice_loss(w_b, w_e, T_b, U_b)                # (B,)
        >>> loss.sum().backward()                                               # -gamma
        >>> ref = rnnt_lattice.rnnt_loss(logp, targets, T_b, U_b, blank=0, reduction="none",
        ...                              fused_log_softmax=False)
        >>> bool(torch.allclose(loss.detach(), ref))
        True

    Args:
        blank_weights, label_weights: ``(B, T, U+1)``, one float dtype (float16/bfloat16 are
            computed in float32). Entries of no arc (padding ``t >= T_b`` or ``u > U_b``,
            the label at ``u = U_b``, arcs into the end frame ``T_b`` other than into
            ``(T_b, U_b)``) are never read: gradient 0, NaN allowed.
        logit_lengths, target_lengths: ``(B,)`` int32/int64, ``T_b`` and ``U_b``.
        rnnt_type: ``"regular"``, ``"modified"`` or ``"constrained"`` (k2's lattices).
        delay_penalty: k2's ``lambda >= 0``; the loss is that of the penalised lattice.
        boundary: k2's ``(B, 4)`` int ``[begin_symbol, begin_frame, end_symbol, end_frame]``,
            within the lengths.
        return_occupations: also return the arc occupations.
        backend: ``"auto"``, ``"numba"``, ``"triton"`` or ``"torch"``, as
            :func:`rnnt_loss_simple`.

    Returns:
        ``(B,)`` losses in the weights' dtype (float32 for half inputs; ``+inf`` where no
        path exists), or with ``return_occupations=True`` the pair ``(loss,
        ArcOccupations)``.
    """
    _backends.check_name(backend)
    delay_penalty = check_float("delay_penalty", delay_penalty, minimum=0.0, finite=True)
    return_occupations = check_flag("return_occupations", return_occupations)
    logit_lengths, target_lengths, topo = check_weight_args(
        blank_weights, label_weights, logit_lengths, target_lengths, rnnt_type)
    dev = blank_weights.device
    # Within the lengths, themselves within (T, U): every start and end node is on the grid.
    boundary = check_boundary(boundary, blank_weights.shape[0], dev, logit_lengths, target_lengths)
    B, T, U1 = blank_weights.shape
    impl = _backends.resolve(backend, dev)          # a host rule: before the device's asserts
    nan_rows = None
    if B and check_site(blank_weights) == "device":
        nan_rows = device_value_check(None, logit_lengths, target_lengths, T=T, U=U1 - 1, V=0,
                                      blank=None, boundary=boundary)
    ends = Ends.of(logit_lengths, target_lengths, boundary)
    out_dtype = blank_weights.dtype if blank_weights.dtype in (torch.float32, torch.float64) \
        else torch.float32
    ldt = lattice_dtype(dev)
    costs, gamma = _LatticeNLL.apply(blank_weights.to(ldt), label_weights.to(ldt),
                                     topo, ends, delay_penalty, impl.lattice_of_terms)
    costs = with_bad_rows(output_costs(costs, out_dtype), nan_rows)
    if not return_occupations:
        return costs
    return costs, ArcOccupations(gamma[:, 0], gamma[:, 1], logit_lengths, target_lengths,
                                 boundary, rnnt_type)


def rnnt_loss_simple(
    lm: torch.Tensor,
    am: torch.Tensor,
    targets: torch.Tensor,
    logit_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    *,
    blank: int,
    rnnt_type: str = "regular",
    delay_penalty: float = 0.0,
    boundary: torch.Tensor | None = None,
    reduction: str = "mean",
    zero_infinity: bool = False,
    return_occupations: bool = False,
    backend: str = "auto",
    allow_blank_targets: bool = False,
):
    r"""RNN-T loss of the simple joiner ``logits(t,u,v) = am(t,v) + lm(u,v)`` (k2's
    ``rnnt_loss_simple``), without ever building the ``(B, T, U+1, V)`` logits.

    Equal, in value and gradient, to ``rnnt_loss(am[:, :, None] + lm[:, None], targets,
    logit_lengths, target_lengths, blank, rnnt_type=..., delay_penalty=..., boundary=...)``
    (up to float rounding; the lattice runs in float64). The normaliser of node (t, u) is
    one dot product per node, a batched matmul per sequence::

        lse(t,u) = log( exp(am(t) - am_max(t)) . exp(lm(u) - lm_max(u)) ) + am_max(t) + lm_max(u)
        b(t,u)   = am(t, blank) + lm(u, blank) - lse(t,u)
        e(t,u)   = am(t, y_u)   + lm(u, y_u)   - lse(t,u)

    then the lattice of ``rnnt_type`` (math.md section 9; ``constrained``: the label arc
    carries ``e(t,u) + b(t,u+1)``) with k2's delay penalty on label arcs. Memory is
    ``O(B T U + B (T + U) V)``. The exps and the matmul run in float64 (for float32 inputs
    too), so lse is float64-accurate; a node whose joint mass still leaves float64's range
    (the largest sum ``am(t,v) + lm(u,v)`` lies more than ~650 below ``am_max(t) +
    lm_max(u)``: am and lm peak at different classes) is recomputed in the log domain from
    its two rows, so the loss is finite wherever the full loss on ``am + lm`` is (k2 adds
    ``finfo.tiny`` there instead, and returns a wrong loss). On CPU those nodes are found on
    the host; on CUDA a Triton kernel over all nodes does the rest of the work for the ones
    it finds, with no host synchronisation (without Triton, or under ``torch.compile``,
    such a node has no mass: lse ``-inf``).

    Example::

        >>> import torch, rnnt_lattice
        >>> B, T, U, V = 2, 6, 3, 5
        >>> am = torch.randn(B, T, V, dtype=torch.float64, requires_grad=True)
        >>> lm = torch.randn(B, U + 1, V, dtype=torch.float64, requires_grad=True)
        >>> targets, T_b, U_b = torch.tensor([[1, 2, 3], [4, 1, 0]]), torch.tensor([6, 4]), torch.tensor([3, 2])
        >>> loss, occ = rnnt_lattice.rnnt_loss_simple(lm, am, targets, T_b, U_b, blank=0,
        ...                                           return_occupations=True)
        >>> loss.backward()
        >>> full = rnnt_lattice.rnnt_loss(am.detach()[:, :, None] + lm.detach()[:, None], targets,
        ...                               T_b, U_b, blank=0, backend="torch")
        >>> bool(torch.allclose(loss.detach(), full))
        True
        >>> gamma_blank, gamma_label = occ              # (B, T, U+1) each
        >>> bool(torch.allclose(gamma_blank.sum(2)[0], torch.ones(T, dtype=torch.float64)))
        True

    Args:
        lm: ``(B, U+1, V)`` prediction-network part (k2's ``lm``), float16/bfloat16 (computed
            in float32), float32 or float64. Rows ``u > U_b`` are padding: never read,
            gradient 0, NaN allowed.
        am: ``(B, T, V)`` encoder part, same dtype; rows ``t >= T_b`` are padding likewise.
        targets: ``(B, U)`` int32/int64 label ids; entries past ``target_lengths`` ignored.
        logit_lengths, target_lengths: ``(B,)`` int32/int64, ``T_b`` and ``U_b``.
        blank: the blank id (k2's ``termination_symbol``); negative counts from the end.
        rnnt_type: ``"regular"``, ``"modified"`` or ``"constrained"`` (k2's; the latter two
            need ``T_b >= U_b``, else the loss is ``+inf``).
        delay_penalty: k2's ``lambda`` in ``[0, 1000]``: label arcs get ``lambda ((T_b - 1)/2
            - t)``; the loss is that of the penalised lattice, as in k2. Negative: ValueError
            (k2 silently ignores it).
        boundary: k2's ``(B, 4)`` int ``[begin_symbol, begin_frame, end_symbol, end_frame]``,
            within the lengths.
        reduction: ``"none"`` (B,), ``"sum"`` or ``"mean"`` (sum / B; 0 for B = 0), as
            :func:`rnnt_lattice.rnnt_loss`.
        zero_infinity: infinite losses (no path) and their gradients become 0.
        return_occupations: also return the arc occupations (what :func:`prune_ranges` reads).
        backend: which kernel runs the lattice recursion (the arc log-probs are always
            PyTorch): ``"auto"`` (Numba on CPU, Triton on CUDA, PyTorch elsewhere),
            ``"numba"``, ``"triton"`` or ``"torch"`` (the vectorised reference), as
            :func:`rnnt_lattice.rnnt_loss`.
        allow_blank_targets: a target equal to ``blank`` is an ordinary label (its arc reads
            the blank's entries of ``am`` and ``lm``), as in k2; by default a ``ValueError``
            (CPU inputs), as :func:`rnnt_lattice.rnnt_loss`.

    Returns:
        The loss (the input dtype; float32 for half inputs), or with
        ``return_occupations=True`` the pair ``(loss, ArcOccupations)``; the latter unpacks
        as ``(gamma_blank, gamma_label)``, each ``(B, T, U+1)`` float64 (k2's
        ``(py_grad, px_grad)``).

    NaN or ``+inf`` in a read row of ``am`` or ``lm`` makes that sequence's loss NaN and
    its gradient NaN (the offending rows' own entries get 0); an upstream gradient of
    exactly 0 gives an exactly zero gradient, NaN or not.
    """
    return _simple_loss(lm, am, targets, logit_lengths, target_lengths, blank, rnnt_type,
                        delay_penalty, boundary, reduction, zero_infinity, return_occupations,
                        backend, smooth=None, allow_blank_targets=allow_blank_targets)


def rnnt_loss_smoothed(
    lm: torch.Tensor,
    am: torch.Tensor,
    targets: torch.Tensor,
    logit_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    *,
    blank: int,
    lm_only_scale: float = 0.1,
    am_only_scale: float = 0.1,
    rnnt_type: str = "regular",
    delay_penalty: float = 0.0,
    boundary: torch.Tensor | None = None,
    reduction: str = "mean",
    zero_infinity: bool = False,
    return_occupations: bool = False,
    backend: str = "auto",
    allow_blank_targets: bool = False,
):
    r"""k2's ``rnnt_loss_smoothed``: the simple loss with its arc log-probs interpolated,
    log-linearly, with LM-only and AM-only log-probs (docs/variants.md A.5)::

        uni(v)   = mean over all b and all U+1 positions u of softmax(lm(b,u))(v) + tiny
        b_lm(u)  = lm(u, blank) - logsumexp_v lm(u, v)                     (e_lm with y_u)
        b_am(t)  = am(t, blank) + log uni(blank) - log sum_v exp(am(t, v)) uni(v)  (e_am: y_u)
        b'(t,u)  = (1 - s_lm - s_am) b(t,u) + s_lm b_lm(u) + s_am b_am(t)   (e' likewise)

    with ``s_lm = lm_only_scale``, ``s_am = am_only_scale`` (each in ``[0, 1]``), a scale of 0 replaced by
    ``1e-20`` in its own term (so ``0 * -inf`` never makes a NaN; the first factor keeps
    the given scales) and ``tiny = finfo(dtype).tiny``. As in k2, the unigram ``uni``
    averages over *every* row of ``lm``, padding included (and its gradient reaches those
    rows): padding rows of ``lm`` must be finite here. ``constrained``: the label arc
    carries ``e'(t,u) + b'(t,u+1)``. Everything else is :func:`rnnt_loss_simple`.

    Example::

        >>> import torch, rnnt_lattice
        >>> am, lm = torch.randn(1, 5, 4, requires_grad=True), torch.randn(1, 3, 4, requires_grad=True)
        >>> loss = rnnt_lattice.rnnt_loss_smoothed(lm, am, torch.tensor([[1, 2]]), torch.tensor([5]),
        ...                                        torch.tensor([2]), blank=0, lm_only_scale=0.25,
        ...                                        am_only_scale=0.0)
        >>> loss.backward()
    """
    s_lm = check_float("lm_only_scale", lm_only_scale, finite=True)
    s_am = check_float("am_only_scale", am_only_scale, finite=True)
    return _simple_loss(lm, am, targets, logit_lengths, target_lengths, blank, rnnt_type,
                        delay_penalty, boundary, reduction, zero_infinity, return_occupations,
                        backend, smooth=(s_lm, s_am), allow_blank_targets=allow_blank_targets)


def _simple_loss(lm, am, targets, logit_lengths, target_lengths, blank, rnnt_type,
                 delay_penalty, boundary, reduction, zero_infinity, return_occupations, backend,
                 smooth, allow_blank_targets=False):
    check_reduction(reduction)
    _backends.check_name(backend)
    delay_penalty = check_float("delay_penalty", delay_penalty, minimum=0.0, finite=True)
    zero_infinity = check_flag("zero_infinity", zero_infinity)
    return_occupations = check_flag("return_occupations", return_occupations)
    allow_blank_targets = check_flag("allow_blank_targets", allow_blank_targets)
    targets, logit_lengths, target_lengths, blank, topo = check_simple_args(
        lm, am, targets, logit_lengths, target_lengths, blank, rnnt_type, allow_blank_targets)
    # Within the lengths, themselves within (T, U): every start and end node is on the grid.
    boundary = check_boundary(boundary, am.shape[0], am.device, logit_lengths, target_lengths)
    impl = _backends.resolve(backend, am.device)    # a host rule: before the device's asserts
    nan_rows = None
    if am.shape[0] and check_site(am) == "device":
        nan_rows = device_value_check(targets, logit_lengths, target_lengths, T=am.shape[1],
                                      U=lm.shape[1] - 1, V=am.shape[2],
                                      blank=None if allow_blank_targets else blank,
                                      boundary=boundary)
    out_dtype = am.dtype if am.dtype in (torch.float32, torch.float64) else torch.float32
    if am.dtype != out_dtype:
        am, lm = am.float(), lm.float()
    B, T, V = am.shape
    U1 = lm.shape[1]
    ends = Ends.of(logit_lengths, target_lengths, boundary)
    t = torch.arange(T, device=am.device)[None, :]
    u = torch.arange(U1, device=am.device)[None, :]
    frames = (t >= ends.t0[:, None]) & (t < ends.t1[:, None])                # (B, T) rows read
    positions = (u >= ends.u0[:, None]) & (u <= ends.u1[:, None])            # (B, U+1)

    b, e = _simple_terms(impl, lm, am, targets, blank, frames, positions, smooth)
    costs, gamma = _LatticeNLL.apply(b, e, topo, ends, delay_penalty, impl.lattice_of_terms)
    loss = reduce_costs(with_bad_rows(output_costs(costs, out_dtype), nan_rows), reduction,
                        zero_infinity)
    if not return_occupations:
        return loss
    return loss, ArcOccupations(gamma[:, 0], gamma[:, 1], logit_lengths, target_lengths,
                                boundary, rnnt_type)


# The simple losses and the recursion on caller-given weights run eagerly inside a compiled
# function (a graph break around each call): their backends' kernels and host work are
# opaque to TorchDynamo, which failed while tracing them (torch 2.13 on the CPU: "exception
# table entry start instruction has no offset", "'ndarray' object has no attribute
# 'setflags'"). Eager inside, the rescue of far-apart logits runs too.
lattice_loss = eager_under_compile(
    lattice_loss, "rnnt_lattice's lattice_loss runs its kernels eagerly, a graph break; "
    "compile without fullgraph=True")
_simple_loss = eager_under_compile(
    _simple_loss, "rnnt_lattice's simple losses (rnnt_loss_simple, rnnt_loss_smoothed) run "
    "their kernels eagerly, a graph break; compile without fullgraph=True")

