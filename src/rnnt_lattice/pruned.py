"""Pruned RNN-T, first half: the simple-joiner loss and the choice of windows (math.md
sections 7 and 10; k2/fast_rnnt semantics, ../shared/docs/variants.md A).

Pruned RNN-T (Kuang et al. 2022) trains in two passes. The *simple* joiner
``logits(t,u,v) = am(t,v) + lm(u,v)`` gives a cheap lattice whose occupations say, per
frame, which R label positions hold the alignments; the full joiner is then evaluated
only on those windows:

    loss_simple, occ = rnnt_loss_simple(lm, am, ..., return_occupations=True)
    win = prune_ranges(occ, R)                       # ranges (B, T, R'), covered (B,)
    am_p, lm_p = do_rnnt_pruning(am_enc, lm_pred, win.ranges)    # (B, T, R', D) each
    loss_pruned = rnnt_loss_pruned(joiner(am_p, lm_p), targets, win.ranges, ...)  # (B, T, R', V)

The simple loss never builds the ``(B, T, U+1, V)`` tensor: its normaliser is one batched
matmul per sequence,

    lse(t,u) = log( exp(am(t) - am_max(t)) . exp(lm(u) - lm_max(u)) ) + am_max(t) + lm_max(u)

(the maxima and the matmul in the input dtype, the log and everything after it in float64),
so memory is ``O(B T U + B (T + U) V)``. The arc log-probs ``b(t,u) = am(t,blank) +
lm(u,blank) - lse(t,u)`` and ``e(t,u) = am(t,y_u) + lm(u,y_u) - lse(t,u)`` then feed the
one generic recursion over arc weights (any topology of k2: ``regular``, ``modified``,
``constrained``; delay penalty; boundary), run by the backend's lattice kernel (Numba's
``kernels.lattice`` on CPU, Triton's ``_lattice_kernel`` on CUDA) or by
:mod:`rnnt_lattice.reference` (``backend=``). Two small autograd Functions carry the
gradient: the recursion's (``_LatticeNLL``: ``d(-log P)/dw = -gamma``, mapped onto ``b`` and
``e``) and the normaliser's (``_JointMass``: the masses and the entries read, with one
in-place gradient buffer per input); the float64 glue between them is plain autograd.
:func:`lattice_loss` offers that recursion on arc weights the caller computes (k2's
``mutual_information_recursion``, HAT; ``rnnt_lattice.compat.k2`` builds on it).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from . import _backends
from . import topology as _topology
from ._validate import check_boundary, check_float, check_int, check_reduction
from .analysis.coverage import best_window_starts
from .reference import Ends, arc_weights, lattice_dtype

__all__ = ["rnnt_loss_simple", "rnnt_loss_smoothed", "lattice_loss", "ArcOccupations",
           "prune_ranges", "PruneRanges", "do_rnnt_pruning"]

NEG_INF = float("-inf")
RNNT_TYPES = ("regular", "modified", "constrained")     # k2's rnnt_type values
METHODS = ("exact", "k2")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


@dataclass(frozen=True)
class PruneRanges:
    """Pruning windows.

    Attributes:
        ranges: ``(B, T, R)`` int64, ``ranges[b, t, k] = s_begin(t) + k``: the label positions
            the full joiner evaluates at frame t (k2's ``ranges``; every entry ``<= U``).
        covered: ``(B,)`` float64, share of each sequence's occupancy mass (occ(t,u), the
            total occupation leaving a node) inside its windows; 1 for a sequence without mass.
    """

    ranges: torch.Tensor
    covered: torch.Tensor

    @property
    def window(self) -> int:
        """R, the window size used (it may differ from the one asked for)."""
        return int(self.ranges.shape[-1])

    @property
    def s_begin(self) -> torch.Tensor:
        """``(B, T)`` int64: the first label position of each frame's window."""
        return self.ranges[..., 0]


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------

def _shape(x) -> str:
    return str(tuple(x.shape))


def _check_simple_args(lm, am, targets, logit_lengths, target_lengths, blank, rnnt_type,
                       allow_blank_targets=False):
    """Shapes, dtypes, devices and (CPU only, as everywhere) values of the simple losses'
    arguments. Returns ``(targets, logit_lengths, target_lengths, blank)`` normalised
    (int64, blank in ``[0, V)``). ``allow_blank_targets``: a target may be the blank."""
    for name, x in (("lm", lm), ("am", am), ("targets", targets),
                    ("logit_lengths", logit_lengths), ("target_lengths", target_lengths)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if lm.dim() != 3:
        raise ValueError(f"lm must have 3 dims (B, U+1, V), got shape {_shape(lm)}")
    if am.dim() != 3:
        raise ValueError(f"am must have 3 dims (B, T, V), got shape {_shape(am)}")
    for name, x in (("lm", lm), ("am", am)):
        if x.dtype not in _FLOATS:
            raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if lm.dtype != am.dtype:
        raise ValueError(f"lm and am must have one dtype, got {lm.dtype} and {am.dtype}")
    B, T, V = am.shape
    U1 = lm.shape[1]
    if lm.shape[0] != B or lm.shape[2] != V:
        raise ValueError(f"lm {_shape(lm)} must be (B, U+1, V) with am's B = {B} and V = {V} "
                         f"(am {_shape(am)})")
    if U1 < 1:
        raise ValueError(f"lm {_shape(lm)} must have U+1 >= 1 label positions")
    if V < 1:
        raise ValueError(f"am {_shape(am)} must have a vocabulary V >= 1")
    if targets.dim() != 2 or tuple(targets.shape) != (B, U1 - 1):
        raise ValueError(f"targets must have shape (B, U) = ({B}, {U1 - 1}) to match lm "
                         f"{_shape(lm)}, got {_shape(targets)}")
    for name, x in (("logit_lengths", logit_lengths), ("target_lengths", target_lengths)):
        if x.dim() != 1 or x.shape[0] != B:
            raise ValueError(f"{name} must have shape (B,) = ({B},), got {_shape(x)}")
    for name, x in (("targets", targets), ("logit_lengths", logit_lengths),
                    ("target_lengths", target_lengths)):
        if x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {x.dtype}")
    for name, x in (("lm", lm), ("targets", targets), ("logit_lengths", logit_lengths),
                    ("target_lengths", target_lengths)):
        if x.device != am.device:
            raise ValueError(f"tensors on different devices: am on {am.device}, {name} on {x.device}")
    blank = check_int("blank", blank)
    if not -V <= blank < V:
        raise ValueError(f"blank={blank} is outside [-V, V) = [{-V}, {V}) for am {_shape(am)}")
    blank %= V
    if rnnt_type not in RNNT_TYPES:
        raise ValueError(f"rnnt_type must be one of {RNNT_TYPES}, got {rnnt_type!r}")
    targets, logit_lengths, target_lengths = (
        x.to(torch.int64).contiguous() for x in (targets, logit_lengths, target_lengths))
    if am.device.type == "cpu" and B and not torch.compiler.is_compiling():
        _check_lengths(logit_lengths, target_lengths, T, U1 - 1, f"am {_shape(am)}", f"lm {_shape(lm)}")
        U = U1 - 1
        if U:
            valid = torch.arange(U)[None, :] < target_lengths[:, None]
            bad = valid & ((targets < 0) | (targets >= V))
            if not allow_blank_targets:
                bad |= valid & (targets == blank)
            if bool(bad.any()):
                b, u = (int(i) for i in bad.nonzero()[0])
                raise ValueError(f"targets[{b}, {u}] = {int(targets[b, u])} must be in [0, V) = "
                                 f"[0, {V})" + ("" if allow_blank_targets else
                                                f" and differ from the blank {blank}"))
    return targets, logit_lengths, target_lengths, blank


def _check_lengths(logit_lengths, target_lengths, T, U, t_src, u_src):
    for name, x, hi, what in (("logit_lengths", logit_lengths, T, f"T = {T} of {t_src}"),
                              ("target_lengths", target_lengths, U, f"U = {U} of {u_src}")):
        if x.numel() == 0:
            continue
        if int(x.min()) < 0:
            b = int(torch.argmin(x))
            raise ValueError(f"{name} must be >= 0, got {name}[{b}] = {int(x[b])}")
        if int(x.max()) > hi:
            b = int(torch.argmax(x))
            raise ValueError(f"{name}[{b}] = {int(x[b])} exceeds the padded size {what}")


# ---------------------------------------------------------------------------------------
# The simple joiner's arc log-probs
# ---------------------------------------------------------------------------------------

def _row_stats(x: torch.Tensor, keep: torch.Tensor):
    """For rows ``x (B, N, V)``: ``(ok, shift, bad)``. ``ok (B, N)`` marks the rows inside
    ``keep`` (the others are padding) that hold no NaN or ``+inf``: only those reach the
    matmul (it mixes rows over V only, but its backward mixes every t with every u of a
    sequence, so a NaN must not enter it); ``shift (B, N)`` the row max, 0 where it is not
    finite (a row of only ``-inf`` then gives ``exp = 0``: a dead row, lse ``-inf``);
    ``bad`` marks the rows whose max is NaN or ``+inf`` (math.md 8.1: their lse is NaN)."""
    row_max = x.detach().amax(-1)                                           # V >= 1
    bad = keep & (torch.isnan(row_max) | (row_max == float("inf")))
    ok = keep & ~bad
    shift = torch.where(ok & (row_max != NEG_INF), row_max, 0.0)
    return ok, shift, bad


class _JointMass(torch.autograd.Function):
    """The simple joiner's normaliser sums and the entries its arcs read, with a hand-written
    backward that makes one gradient buffer per input and updates it in place.

    Forward, in the lattice dtype ``ldt`` (float64: an exp of a float32 row, rounded to
    float32, would underflow 580 nats sooner and lose float64 accuracy), with
    ``ea = exp(am - am_shift)`` on the rows ``am_ok`` (0 on the others) and ``el``
    likewise::

        mass  (B, T, U+1) = ea @ el^T                 (the joint mass of node (t, u))
        am_uni (B, T)     = ea @ uni                  (smoothed loss only; else empty)
        am_cols = am[b, t, am_idx[b, t, j]],  lm_cols = lm[b, u, lm_idx[b, u, j]]  (0 off ok)

    ``mass`` is exact while it is above ``V * MASS_MIN``. Below, the products
    ``ea(t,v) el(u,v)`` have left the float range (the classes where am and lm peak differ,
    by more than ~650 nats in all): those nodes (``rescued``) get their lse from the log
    domain, ``lse_rescued = logsumexp_v (am(t,v) + lm(u,v))``, over their two rows only
    (``_rescue``: on the host for CPU tensors, a Triton kernel on CUDA), and their mass is
    not used.

    Backward (``d ea / d am = ea``; for a rescued node ``p(v) = exp(am + lm - lse)``)::

        d am = ea * (g_mass @ el + g_am_uni uni^T) + scatter(am_idx, g_am_cols)
               + sum_{rescued u} g_lse p,                                        0 off ok
        d lm = el * (g_mass^T @ ea) + scatter(lm_idx, g_lm_cols) + sum_{rescued t} g_lse p
        d uni = g_am_uni^T ea

    against autograd's chain of where, sub, exp, matmul and gather, each with its own
    buffer of the inputs' size in the backward."""

    @staticmethod
    def forward(ctx, am, lm, am_ok, lm_ok, am_shift, lm_shift, am_idx, lm_idx, uni, ldt, impl):
        # (B, T, V) and (B, U+1, V), contiguous in ldt whatever the inputs' strides
        ea = am.to(ldt, memory_format=torch.contiguous_format, copy=True)
        ea.masked_fill_(~am_ok[..., None], NEG_INF).sub_(am_shift.to(ldt)[..., None]).exp_()
        el = lm.to(ldt, memory_format=torch.contiguous_format, copy=True)
        el.masked_fill_(~lm_ok[..., None], NEG_INF).sub_(lm_shift.to(ldt)[..., None]).exp_()
        mass = torch.bmm(ea, el.transpose(1, 2))                                         # (B, T, U+1)
        am_uni = torch.matmul(ea, uni.to(ldt)) if uni is not None else ea.new_empty(0)  # (B, T)
        am_cols = torch.gather(am, 2, am_idx).masked_fill_(~am_ok[..., None], 0.0)
        lm_cols = torch.gather(lm, 2, lm_idx).masked_fill_(~lm_ok[..., None], 0.0)
        rescued, lse_rescued = _rescue(impl, am, lm, am_ok, lm_ok, mass)
        ctx.save_for_backward(ea, el, am_ok, lm_ok, am_idx, lm_idx, uni, am, lm, rescued,
                              lse_rescued)
        ctx.impl = impl
        ctx.mark_non_differentiable(rescued)
        if uni is None:
            ctx.mark_non_differentiable(am_uni)
        return mass, am_uni, am_cols, lm_cols, lse_rescued, rescued

    @staticmethod
    def backward(ctx, g_mass, g_am_uni, g_am_cols, g_lm_cols, g_rescued, _g):
        ea, el, am_ok, lm_ok, am_idx, lm_idx, uni, am, lm, rescued, lse = ctx.saved_tensors
        B, T, V = ea.shape
        grad_am = grad_lm = grad_uni = None
        if g_mass is None:
            g_mass = ea.new_zeros(B, T, el.shape[1])
        g_mass = g_mass.to(ea.dtype)
        if ctx.needs_input_grad[0]:
            grad_am = torch.bmm(g_mass, el)                                              # (B, T, V)
            if uni is not None and g_am_uni is not None:
                grad_am.view(-1, V).addr_(g_am_uni.to(ea.dtype).reshape(-1), uni.to(ea.dtype))
            grad_am.mul_(ea)
            if g_am_cols is not None:
                grad_am.scatter_add_(2, am_idx, g_am_cols.to(ea.dtype))
        if ctx.needs_input_grad[1]:
            grad_lm = torch.bmm(g_mass.transpose(1, 2), ea).mul_(el)                    # (B, U+1, V)
            if g_lm_cols is not None:
                grad_lm.scatter_add_(2, lm_idx, g_lm_cols.to(el.dtype))
        if g_rescued is not None and (grad_am is not None or grad_lm is not None):
            ctx.impl.simple_rescue_backward(am, lm, rescued, lse, g_rescued, grad_am, grad_lm)
        if grad_am is not None:
            grad_am = grad_am.masked_fill_(~am_ok[..., None], 0.0).to(am.dtype)
        if grad_lm is not None:
            grad_lm = grad_lm.masked_fill_(~lm_ok[..., None], 0.0).to(lm.dtype)
        if uni is not None and g_am_uni is not None and ctx.needs_input_grad[8]:
            grad_uni = torch.matmul(g_am_uni.to(ea.dtype).reshape(1, -1), ea.view(-1, V))[0]
            grad_uni = grad_uni.to(uni.dtype)
        return grad_am, grad_lm, None, None, None, None, None, None, grad_uni, None, None


# A node's float64 mass is exact (relative error below 2^-60) while it is at least
# V * MASS_MIN: each of its V products then carries an absolute error of at most 2^-1074
# (the subnormal spacing). Below, the node is recomputed in the log domain (``_rescue``).
MASS_MIN = 2.0 ** -1000


def _rescue(impl, am, lm, am_ok, lm_ok, mass):
    """``(rescued (B, T, U+1) bool, lse_rescued (B, T, U+1) float64)``: the nodes of ``ok``
    rows whose ``mass`` is below ``V * MASS_MIN``, and their exact lse, ``logsumexp_v
    (am(t,v) + lm(u,v))`` in float64 (``-inf`` elsewhere), from the backend's
    ``simple_rescue`` (CPU: only those nodes, found on the host; CUDA: a Triton kernel, one
    program per node, which returns at once for the others: no host synchronisation).
    While compiling nothing is rescued: such a node has no mass, lse ``-inf``."""
    V = am.shape[2]
    need = (mass < V * MASS_MIN) & am_ok[:, :, None] & lm_ok[:, None, :]
    if torch.compiler.is_compiling():
        return torch.zeros_like(need), torch.full_like(mass, NEG_INF, dtype=torch.float64)
    return need, impl.simple_rescue(am, lm, need)


def _unigram(lm: torch.Tensor) -> torch.Tensor:
    """k2's unigram ``(V,)``: the mean over every row of lm, padding included, of its
    softmax, plus ``tiny``."""
    return torch.softmax(lm, -1).mean((0, 1)) + torch.finfo(lm.dtype).tiny


def _simple_terms(impl, lm, am, targets, blank, frames, positions, smooth: bool):
    """The simple joiner's ``(lse, b, e, parts)``: ``lse, b, e`` ``(B, T, U+1)`` in the
    lattice dtype (``e`` is ``-inf`` at ``u = U``), differentiable w.r.t. ``am`` and ``lm``;
    ``parts`` what the smoothed terms need (:func:`_smoothed`). ``frames (B, T)`` /
    ``positions (B, U+1)``: the rows read (the others are padding)."""
    B, T, V = am.shape
    U1 = lm.shape[1]
    U = U1 - 1
    ldt = lattice_dtype(am.device)
    am_ok, am_shift, am_bad = _row_stats(am, frames)                        # (B, T)
    lm_ok, lm_shift, lm_bad = _row_stats(lm, positions)                     # (B, U+1)
    # The entries the arcs read: classes [blank, y_0 .. y_{U-1}] of every am row, [blank,
    # y_u] of lm row u (y_U: a placeholder, never used).
    safe_targets = targets.clamp(0, V - 1)                                  # padding may hold anything
    cols = torch.nn.functional.pad(safe_targets, (1, 0), value=blank)       # (B, U+1)
    am_idx = cols[:, None, :].expand(B, T, U1)
    lm_idx = torch.stack((cols.new_full((B, U1), blank), cols.roll(-1, 1)), -1)   # (B, U+1, 2)
    x = lm if lm.dtype in (torch.float32, torch.float64) else lm.float()
    uni = _unigram(x).to(am.dtype) if smooth else None
    mass, am_uni, am_cols, lm_cols, lse_rescued, rescued = _JointMass.apply(
        am, lm, am_ok, lm_ok, am_shift, lm_shift, am_idx, lm_idx, uni, ldt, impl)
    pos = (mass > 0) & ~rescued                    # 0: a dead node (or one without mass on GPU)
    lse = torch.log(torch.where(pos, mass, 1.0)) + am_shift.to(ldt)[..., None] + lm_shift.to(ldt)[:, None, :]
    lse = torch.where(pos, lse, NEG_INF)
    lse = torch.where(rescued, lse_rescued.to(ldt), lse)
    bad = am_bad[:, :, None] | lm_bad[:, None, :]
    lse = torch.where(bad, float("nan"), lse)                               # (B, T, U+1)

    am_cols, lm_cols = am_cols.to(ldt), lm_cols.to(ldt)
    reads = _Reads(am_cols[..., 0], am_cols[..., 1:], lm_cols[..., 0], lm_cols[:, :U, 1])
    b = _read(reads.am_blank[:, :, None] + reads.lm_blank[:, None, :], lse)
    e = _read(reads.am_label + reads.lm_label[:, None, :], lse[..., :U])
    e = torch.nn.functional.pad(e, (0, 1), value=NEG_INF)                  # no label arc at u = U
    return lse, b, e, (am_ok, lm_ok, am_shift, am_uni, uni, reads)


@dataclass(frozen=True)
class _Reads:
    """The input entries the arcs read (lattice dtype): ``am_blank (B, T)``, ``am_label
    (B, T, U)`` = am(t, y_u), ``lm_blank (B, U+1)``, ``lm_label (B, U)`` = lm(u, y_u)."""
    am_blank: torch.Tensor
    am_label: torch.Tensor
    lm_blank: torch.Tensor
    lm_label: torch.Tensor


def _read(entry, lse):
    """``entry - lse``, ``-inf`` on dead rows (``lse = -inf``), as reference._read."""
    return torch.where(lse == NEG_INF, NEG_INF, entry - lse)


def _kind_log_probs(b, e, topo, ends: Ends):
    """``lp (B, K, T, U+1)`` from the blank / label log-probs, as
    ``reference.kind_log_probs``: the kind's class log-prob, plus ``b(t, u+1)`` for
    ``plus_next_blank`` (k2's constrained), ``-inf`` outside the region or where
    ``u + du > u1``."""
    B, T, U1 = b.shape
    region = ends.region(T, U1)
    u = torch.arange(U1, device=b.device)[None, None, :]
    lps = []
    for k in topo.kinds:
        lp = b if k.reads == "blank" else e
        if k.plus_next_blank:
            lp = lp + torch.nn.functional.pad(b[..., 1:], (0, 1), value=NEG_INF)   # b(t, u+1)
        valid = region & (u + k.du <= ends.u1[:, None, None])
        lps.append(torch.where(valid, lp, NEG_INF))
    return torch.stack(lps, 1)


# ---------------------------------------------------------------------------------------
# The recursion as an autograd Function of the arc weights
# ---------------------------------------------------------------------------------------

class _LatticeNLL(torch.autograd.Function):
    """``-log P (B,)`` of the lattice whose arcs read the blank / label log-probs ``b, e``
    ``(B, T, U+1)``, and the per-kind occupations ``gamma (B, K, T, U+1)`` (not
    differentiable). The arc weights ``w`` (:func:`_kind_log_probs`, ``arc_weights``: the
    delay penalty, ``-inf`` off the arcs) are built here without a graph and run through
    ``lattice`` (the backend's ``lattice_of_weights``).

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
            w = arc_weights(_kind_log_probs(b, e, topo, ends), topo, ends, 0.0, delay_penalty)
            log_like, gamma = lattice(w, topo, ends)
        ctx.topo = topo
        ctx.save_for_backward(gamma)
        ctx.mark_non_differentiable(gamma)
        return -log_like, gamma

    @staticmethod
    def backward(ctx, grad_costs, _grad_gamma):
        (gamma,) = ctx.saved_tensors
        up = grad_costs.to(gamma.dtype)[:, None, None]
        grad_b = torch.zeros_like(gamma[:, 0])
        grad_e = torch.zeros_like(gamma[:, 0])
        for k, kind in enumerate(ctx.topo.kinds):
            g = torch.where(up == 0, 0.0, -gamma[:, k] * up)                 # (B, T, U+1)
            if kind.reads == "blank":
                grad_b += g
            else:
                grad_e += g
            if kind.plus_next_blank:
                grad_b[..., 1:] += g[..., :-1]                               # it read b(t, u+1)
        return grad_b, grad_e, None, None, None, None


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
    logit_lengths, target_lengths = _check_weight_args(blank_weights, label_weights,
                                                       logit_lengths, target_lengths, rnnt_type)
    B, T, U1 = blank_weights.shape
    dev = blank_weights.device
    boundary = check_boundary(boundary, B, dev, logit_lengths, target_lengths)
    ends = Ends.of(logit_lengths, target_lengths, boundary)
    if boundary is not None and dev.type == "cpu":
        ends.check(T, U1)
    out_dtype = blank_weights.dtype if blank_weights.dtype in (torch.float32, torch.float64) \
        else torch.float32
    ldt = lattice_dtype(dev)
    costs, gamma = _LatticeNLL.apply(blank_weights.to(ldt), label_weights.to(ldt),
                                     getattr(_topology, rnnt_type)(), ends, delay_penalty,
                                     _backends.resolve(backend, dev).lattice_of_weights)
    costs = _output_costs(costs, out_dtype)
    if not return_occupations:
        return costs
    return costs, ArcOccupations(gamma[:, 0], gamma[:, 1], logit_lengths, target_lengths,
                                 boundary, rnnt_type)


def _check_weight_args(blank_weights, label_weights, logit_lengths, target_lengths, rnnt_type):
    """:func:`lattice_loss`'s checks; returns the lengths as int64."""
    named = (("blank_weights", blank_weights), ("label_weights", label_weights),
             ("logit_lengths", logit_lengths), ("target_lengths", target_lengths))
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    for name, x in named[:2]:
        if x.dim() != 3 or x.shape[2] < 1:
            raise ValueError(f"{name} must have 3 dims (B, T, U+1), got shape {_shape(x)}")
        if x.dtype not in _FLOATS:
            raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if label_weights.shape != blank_weights.shape or label_weights.dtype != blank_weights.dtype:
        raise ValueError(f"blank_weights and label_weights must have one shape (B, T, U+1) and "
                         f"dtype, got {blank_weights.dtype} {_shape(blank_weights)} and "
                         f"{label_weights.dtype} {_shape(label_weights)}")
    B, T, U1 = blank_weights.shape
    for name, x in named[1:]:
        if x.device != blank_weights.device:
            raise ValueError(f"tensors on different devices: blank_weights on "
                             f"{blank_weights.device}, {name} on {x.device}")
    for name, x in named[2:]:
        if x.dim() != 1 or x.shape[0] != B or x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an int32/int64 tensor of shape (B,) = ({B},), got "
                             f"{x.dtype} {_shape(x)}")
    if rnnt_type not in RNNT_TYPES:
        raise ValueError(f"rnnt_type must be one of {RNNT_TYPES}, got {rnnt_type!r}")
    logit_lengths, target_lengths = (x.to(torch.int64).contiguous()
                                     for x in (logit_lengths, target_lengths))
    if blank_weights.device.type == "cpu" and B and not torch.compiler.is_compiling():
        what = f"blank_weights {_shape(blank_weights)}"
        _check_lengths(logit_lengths, target_lengths, T, U1 - 1, what, what)
    return logit_lengths, target_lengths


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
    log-linearly, with LM-only and AM-only log-probs (variants.md A)::

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


def _smoothed(b, e, lm, parts, targets, blank, s_lm, s_am, lse_dtype):
    """Interpolated ``(b', e')`` (see :func:`rnnt_loss_smoothed`)."""
    am_ok, lm_ok, am_shift, am_uni, uni, reads = parts
    B, T, U = reads.am_label.shape
    V = lm.shape[2]
    lm_s = torch.where(lm_ok[..., None], lm, 0.0)                                # (B, U+1, V)
    # Rows off am_ok have no mass (ea = 0 there): log 1 instead of log 0, whose backward
    # would put 0/0 into uni's gradient (their arcs are off the lattice or NaN anyway).
    am_uni = torch.where(am_ok, am_uni, 1.0)
    am_only_norm = torch.log(am_uni.to(lse_dtype)) + am_shift.to(lse_dtype)      # (B, T)
    log_uni = torch.log(uni).to(lse_dtype)
    lm_only_norm = torch.logsumexp(lm_s, -1).to(lse_dtype)                      # (B, U+1)
    safe_targets = targets.clamp(0, V - 1)
    b_lm = reads.lm_blank - lm_only_norm                                         # (B, U+1)
    e_lm = reads.lm_label - lm_only_norm[:, :U]                                  # (B, U)
    b_am = reads.am_blank + log_uni[blank] - am_only_norm                        # (B, T)
    e_am = reads.am_label + log_uni[safe_targets][:, None, :] - am_only_norm[..., None]   # (B, T, U)
    combined = 1.0 - s_lm - s_am
    s_lm = s_lm if s_lm != 0.0 else 1e-20          # k2: 0 * -inf would be NaN
    s_am = s_am if s_am != 0.0 else 1e-20
    b2 = combined * b + s_lm * b_lm[:, None, :] + s_am * b_am[:, :, None]
    e_mix = combined * e[..., :U] + s_lm * e_lm[:, None, :] + s_am * e_am        # (B, T, U)
    e2 = torch.nn.functional.pad(e_mix, (0, 1), value=NEG_INF)                   # no label arc at u = U
    return b2, e2


def _output_costs(costs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float64 costs in the output dtype, where a cost that overflows there (finite in
    float64, ``+inf`` in float32) gets a zero gradient like any infinite loss (math.md 8.1;
    the kernel losses apply the same rule in ``_ops``)."""
    out = costs.to(dtype)
    return torch.where(torch.isinf(out), out.detach(), out)


def _simple_loss(lm, am, targets, logit_lengths, target_lengths, blank, rnnt_type,
                 delay_penalty, boundary, reduction, zero_infinity, return_occupations, backend,
                 smooth, allow_blank_targets=False):
    check_reduction(reduction)
    _backends.check_name(backend)
    delay_penalty = check_float("delay_penalty", delay_penalty, minimum=0.0, finite=True)
    targets, logit_lengths, target_lengths, blank = _check_simple_args(
        lm, am, targets, logit_lengths, target_lengths, blank, rnnt_type, allow_blank_targets)
    boundary = check_boundary(boundary, am.shape[0], am.device, logit_lengths, target_lengths)
    out_dtype = am.dtype if am.dtype in (torch.float32, torch.float64) else torch.float32
    if am.dtype != out_dtype:
        am, lm = am.float(), lm.float()
    B, T, V = am.shape
    U1 = lm.shape[1]
    topo = getattr(_topology, rnnt_type)()
    ends = Ends.of(logit_lengths, target_lengths, boundary)
    if boundary is not None and am.device.type == "cpu":
        ends.check(T, U1)
    t = torch.arange(T, device=am.device)[None, :]
    u = torch.arange(U1, device=am.device)[None, :]
    frames = (t >= ends.t0[:, None]) & (t < ends.t1[:, None])                # (B, T) rows read
    positions = (u >= ends.u0[:, None]) & (u <= ends.u1[:, None])            # (B, U+1)

    impl = _backends.resolve(backend, am.device)
    lse, b, e, parts = _simple_terms(impl, lm, am, targets, blank, frames, positions,
                                     smooth is not None)
    if smooth is not None:
        b, e = _smoothed(b, e, lm, parts, targets, blank, smooth[0], smooth[1], lse.dtype)
    costs, gamma = _LatticeNLL.apply(b, e, topo, ends, delay_penalty, impl.lattice_of_weights)
    costs = _output_costs(costs, out_dtype)
    if zero_infinity:
        costs = torch.where(torch.isinf(costs), torch.zeros_like(costs), costs)
    if reduction == "none":
        loss = costs
    elif reduction == "sum" or B == 0:
        loss = costs.sum()
    else:
        loss = costs.mean()
    if not return_occupations:
        return loss
    return loss, ArcOccupations(gamma[:, 0], gamma[:, 1], logit_lengths, target_lengths,
                                boundary, rnnt_type)


# ---------------------------------------------------------------------------------------
# Windows
# ---------------------------------------------------------------------------------------

def prune_ranges(
    occupations,
    R: int,
    *,
    method: str = "exact",
    logit_lengths: torch.Tensor | None = None,
    target_lengths: torch.Tensor | None = None,
    boundary: torch.Tensor | None = None,
    rnnt_type: str | None = None,
) -> PruneRanges:
    r"""Windows of R label positions per frame for the pruned loss (math.md section 10):
    ``ranges[b, t] = s_begin(t) + [0, R)``, with k2's constraints

        s_begin(0) = 0,   0 <= s_begin(t+1) - s_begin(t) <= R_e - 1,
        s_begin(t) = max(U_b - R + 1, 0) for t >= T_b - 1,

    where ``R_e = R`` for ``regular`` and 2 otherwise (one label per frame), and ``T_b``,
    ``U_b`` are the end frame and symbol (the boundary's, if any).

    ``method="exact"`` (default): among all such windows, those covering the most occupancy
    mass ``sum_t sum_{u in window(t)} occ(t,u)`` (a dynamic program over (t, s_begin), O(T U R);
    ties: the lowest starts). Never covers less than k2's choice with the same R.
    ``method="k2"``: fast_rnnt's ``get_rnnt_prune_ranges`` step for step (per-frame argmax of
    ``sum_{k<R} gamma_blank(t, s+k) - gamma_label(t, s-1)``, then the monotone repair;
    variants.md A): the same ranges, up to ties between float scores.

    R: the window the caller asks for. For ``regular`` it is raised, with a warning, to the
    smallest R that lets every sequence reach its end, ``max_b ((U_b - 1) // T_b + 2)``
    (k2's rule; truncating division, sequences without frames left out), and to 2 (k2
    asserts it); for the others ``"exact"`` raises it to ``max_b (U_b - T_b + 2)`` where the
    end is otherwise out of reach (``"k2"`` does not: k2 does not). Then ``R > U`` becomes
    ``U + 1`` (no pruning at all): a batch whose targets are all empty gets R = 1.

    Example::

        >>> import torch, rnnt_lattice
        >>> am, lm = torch.randn(2, 8, 6), torch.randn(2, 5, 6)
        >>> targets, T_b, U_b = torch.tensor([[1, 2, 3, 4], [5, 1, 2, 0]]), torch.tensor([8, 6]), torch.tensor([4, 3])
        >>> _, occ = rnnt_lattice.rnnt_loss_simple(lm, am, targets, T_b, U_b, blank=0,
        ...                                        return_occupations=True)
        >>> win = rnnt_lattice.prune_ranges(occ, 2)
        >>> win.ranges.shape, win.covered.shape
        (torch.Size([2, 8, 2]), torch.Size([2]))
        >>> k2 = rnnt_lattice.prune_ranges(occ, 2, method="k2")
        >>> bool((win.covered >= k2.covered - 1e-12).all())
        True

    Args:
        occupations: an :class:`ArcOccupations` (from ``return_occupations=True``), or a
            pair ``(gamma_blank, gamma_label)`` of ``(B, T, U+1)`` tensors, for which
            ``logit_lengths`` and ``target_lengths`` are required.
        R: int >= 1.
        method: ``"exact"`` or ``"k2"``.
        logit_lengths, target_lengths, boundary, rnnt_type: of the lattice; taken from an
            :class:`ArcOccupations` when not given (``rnnt_type`` defaults to ``"regular"``).

    Returns:
        :class:`PruneRanges` (``ranges (B, T, R')`` int64 with R' the window actually used,
        ``covered (B,)``).
    """
    if isinstance(occupations, ArcOccupations):
        logit_lengths = occupations.logit_lengths if logit_lengths is None else logit_lengths
        target_lengths = occupations.target_lengths if target_lengths is None else target_lengths
        boundary = occupations.boundary if boundary is None else boundary
        rnnt_type = occupations.rnnt_type if rnnt_type is None else rnnt_type
    rnnt_type = "regular" if rnnt_type is None else rnnt_type
    try:
        gamma_blank, gamma_label = occupations
    except (TypeError, ValueError):
        raise ValueError("occupations must be an ArcOccupations or a pair (gamma_blank, "
                         f"gamma_label), got {type(occupations).__name__}") from None
    for name, x in (("gamma_blank", gamma_blank), ("gamma_label", gamma_label),
                    ("logit_lengths", logit_lengths), ("target_lengths", target_lengths)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if gamma_blank.dim() != 3 or gamma_blank.shape != gamma_label.shape:
        raise ValueError(f"gamma_blank and gamma_label must both be (B, T, U+1), got "
                         f"{_shape(gamma_blank)} and {_shape(gamma_label)}")
    if not gamma_blank.is_floating_point() or not gamma_label.is_floating_point():
        raise ValueError(f"gamma_blank and gamma_label must be floating point, got "
                         f"{gamma_blank.dtype} and {gamma_label.dtype}")
    B, T, U1 = gamma_blank.shape
    for name, x in (("logit_lengths", logit_lengths), ("target_lengths", target_lengths)):
        if x.dim() != 1 or x.shape[0] != B or x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an int32/int64 tensor of shape (B,) = ({B},), got "
                             f"{x.dtype} {_shape(x)}")
        if x.device != gamma_blank.device:
            raise ValueError(f"tensors on different devices: gamma_blank on {gamma_blank.device}, "
                             f"{name} on {x.device}")
    R = check_int("R", R)
    if R < 1:
        raise ValueError(f"R must be an int >= 1, got {R!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if rnnt_type not in RNNT_TYPES:
        raise ValueError(f"rnnt_type must be one of {RNNT_TYPES}, got {rnnt_type!r}")
    logit_lengths, target_lengths = logit_lengths.long(), target_lengths.long()
    if gamma_blank.device.type == "cpu" and B:
        _check_lengths(logit_lengths, target_lengths, T, U1 - 1, f"gamma_blank {_shape(gamma_blank)}",
                       f"gamma_blank {_shape(gamma_blank)}")
    boundary = check_boundary(boundary, B, gamma_blank.device, logit_lengths, target_lengths)
    if boundary is None:
        t_end, u_end = logit_lengths, target_lengths
    else:
        t_end, u_end = boundary[:, 3], boundary[:, 2]
    S = U1 - 1
    regular = rnnt_type == "regular"

    R_used = _window_size(R, t_end, u_end, S, regular, method)
    if method == "k2":
        s_begin = _k2_starts(gamma_blank, gamma_label, t_end, u_end, R_used, regular)
    else:
        s_begin = _exact_starts(gamma_blank + gamma_label, t_end, u_end, R_used, regular)
    ranges = s_begin[..., None] + torch.arange(R_used, device=s_begin.device)
    return PruneRanges(ranges, _covered(gamma_blank + gamma_label, ranges))


def _window_size(R: int, t_end, u_end, S: int, regular: bool, method: str) -> int:
    """The window actually used (see :func:`prune_ranges`): the output's shape depends on
    the lengths, so this is the one host read (a single one) of the window choice."""
    has_frames = t_end > 0
    R_min = 1
    if t_end.numel() and (regular or method == "exact"):
        if regular:
            # k2: the smallest R with (R - 1) T_b >= U_b, written (U_b - 1) // T_b + 2 with
            # truncating division (so U_b = 0, T_b = 1 gives 1; the R >= 2 rule follows).
            need = torch.div(u_end - 1, t_end.clamp(min=1), rounding_mode="trunc").add(2)
            counts = has_frames
        else:
            # One label per frame: from 0 to max(U_b - R + 1, 0) in T_b - 1 steps of <= 1.
            # Sequences with T_b < U_b have no path at all: no window helps them.
            need = u_end - t_end + 2
            counts = has_frames & (t_end >= u_end)
        R_min = max(1, int(torch.where(counts, need, 1).max()))
    asked = R
    if R < R_min:
        R = R_min
    if R > S:
        R = S + 1               # every position kept: nothing is pruned
    if regular and R < 2 and S >= 1:
        R = 2                   # a regular window of 1 keeps no label arc (k2 asserts R >= 2)
    if R > asked:
        warnings.warn(f"prune_ranges: R={asked} cannot reach the end of every sequence "
                      f"(rnnt_type {'regular' if regular else 'modified/constrained'}, "
                      f"U = {S}); using R={R}", RuntimeWarning, stacklevel=3)
    return R


def _k2_starts(gamma_blank, gamma_label, t_end, u_end, R: int, regular: bool):
    """fast_rnnt's ``get_rnnt_prune_ranges`` steps 3-5 (variants.md A) on our layout:
    ``py_grad[b, u, t] = gamma_blank[b, t, u]``, ``px_grad[b, u, t] = gamma_label[b, t, u]``."""
    B, T, U1 = gamma_blank.shape
    n = U1 - R + 1                                                   # candidate starts
    # Window sums added up term by term in k2's order (its sum over a strided window axis
    # adds k = 0, 1, ... in turn), so that float32 occupations give k2's very sums: a
    # difference of cumulative sums would cancel (the windows that hold a frame's mass
    # differ by edges of ~1e-9 against sums of ~0.5), and a reduction over the innermost
    # axis may add in another order.
    blk_sum = gamma_blank[..., :n].clone()                            # (B, T, n)
    for k in range(1, R):
        blk_sum += gamma_blank[..., k:k + n]
    label_in = torch.nn.functional.pad(gamma_label, (1, 0))[..., :n]   # gamma_label(t, s - 1), 0 at s = 0
    s_begin = torch.argmax(blk_sum - label_in, -1)                   # (B, T), first max
    t = torch.arange(T, device=gamma_blank.device)[None, :]
    tail = (u_end - R + 1).clamp(min=0)[:, None]                     # (B, 1)
    s_begin = torch.where(t < t_end[:, None] - 1, s_begin, tail)
    return _k2_adjust(s_begin, R if regular else 2)


def _k2_adjust(s_begin, R_e: int):
    """k2's ``_adjust_pruning_lower_bound``: non-decreasing, ``s[0] = 0``, steps ``<= R_e - 1``."""
    T = s_begin.shape[1]
    t = torch.arange(T, device=s_begin.device)[None, :]

    def suffix_min(x):
        return torch.flip(torch.cummin(torch.flip(x, (-1,)), -1).values, (-1,))

    s = suffix_min(s_begin)
    x = suffix_min((R_e - 1) * t - s).clamp(min=0)
    return (R_e - 1) * t - x


def _exact_starts(node, t_end, u_end, R: int, regular: bool):
    """The DP of math.md section 10 (``analysis.coverage.best_window_starts``)."""
    B, T, U1 = node.shape
    n = U1 - R + 1
    mass = torch.nan_to_num(node.to(torch.float64), nan=0.0)
    cum = torch.nn.functional.pad(mass.cumsum(-1), (1, 0))
    starts = torch.arange(n, device=node.device)
    window_mass = cum[..., starts + R] - cum[..., starts]           # (B, T, n)
    last = (u_end - R + 1).clamp(min=0)
    if not regular:
        # Reachable in T_b - 1 steps of <= 1 (only lowers it where the lattice has no path).
        last = torch.minimum(last, (t_end - 1).clamp(min=0))
    _, s_begin = best_window_starts(window_mass, last + 1, R - 1 if regular else 1,
                                    first=torch.zeros_like(last), last=last, n_frames=t_end)
    return s_begin


def _covered(node, ranges):
    """Share of each sequence's occupancy mass inside its windows (1 without mass, NaN for
    NaN occupations)."""
    inside = torch.gather(node, 2, ranges).sum((1, 2))
    total = node.sum((1, 2))
    share = torch.where(total > 0, inside / torch.where(total > 0, total, 1.0), 1.0).clamp(max=1.0)
    return torch.where(torch.isnan(total), total, share)


def do_rnnt_pruning(am: torch.Tensor, lm: torch.Tensor, ranges: torch.Tensor):
    r"""The joiner's inputs on the windows (k2's ``do_rnnt_pruning``): ``(am_pruned,
    lm_pruned)`` with ``am_pruned = am[:, :, None].expand(B, T, R, Da)`` (a view) and
    ``lm_pruned[b, t, k] = lm[b, ranges[b, t, k]]`` ``(B, T, R, Dl)``.

    Example::

        >>> import torch, rnnt_lattice
        >>> am, lm = torch.randn(2, 7, 3), torch.randn(2, 4, 5)      # (B, T, Da), (B, U+1, Dl)
        >>> ranges = torch.tensor([0, 0, 1, 1, 2, 2, 2]).expand(2, 7)[..., None] + torch.arange(2)
        >>> am_p, lm_p = rnnt_lattice.do_rnnt_pruning(am, lm, ranges)
        >>> am_p.shape, lm_p.shape
        (torch.Size([2, 7, 2, 3]), torch.Size([2, 7, 2, 5]))

    Args:
        am: ``(B, T, Da)`` encoder output; lm: ``(B, U+1, Dl)`` prediction-network output.
        ranges: ``(B, T, R)`` int32/int64 label positions in ``[0, U]`` (:func:`prune_ranges`).
    """
    for name, x in (("am", am), ("lm", lm), ("ranges", ranges)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"{name} must have 3 dims, got shape {_shape(x)}")
    B, T, R = ranges.shape
    if ranges.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ranges must be int32 or int64, got {ranges.dtype}")
    ranges = ranges.to(torch.int64)
    if am.shape[0] != B or lm.shape[0] != B or am.shape[1] != T:
        raise ValueError(f"ranges {_shape(ranges)} must be (B, T, R) with am's (B, T) and lm's B: "
                         f"am {_shape(am)}, lm {_shape(lm)}")
    for name, x in (("am", am), ("lm", lm)):
        if x.device != ranges.device:
            raise ValueError(f"tensors on different devices: ranges on {ranges.device}, "
                             f"{name} on {x.device}")
    U1, Dl = lm.shape[1], lm.shape[2]
    if ranges.device.type == "cpu" and ranges.numel() and not torch.compiler.is_compiling():
        lo, hi = int(ranges.min()), int(ranges.max())
        if lo < 0 or hi >= U1:
            raise ValueError(f"ranges must lie in [0, U] = [0, {U1 - 1}] for lm {_shape(lm)}, "
                             f"got values in [{lo}, {hi}]")
    am_pruned = am.unsqueeze(2).expand(B, T, R, am.shape[2])
    # Whole rows of lm, by index_select on (B (U+1), Dl): its backward is an index_add of
    # rows into an lm-sized buffer. (A gather from lm expanded over T would allocate
    # (B, T, U+1, Dl) in its backward; fast_rnnt 1.3's gather along lm's label axis reads one
    # index per element: 4x slower backward, 1.3x slower forward at B=4, T=150, R=5, V=5000.)
    rows = (ranges + torch.arange(B, device=ranges.device)[:, None, None] * U1).reshape(-1)
    lm_pruned = lm.reshape(B * U1, Dl).index_select(0, rows)
    return am_pruned, lm_pruned.view(B, T, R, Dl)
