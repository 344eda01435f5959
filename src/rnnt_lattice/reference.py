"""Vectorised pure-PyTorch RNN-T lattice: the readable reference and the any-device fallback.

Everything here follows ``docs/math.md`` line by line, vectorised over the batch and over
one anti-diagonal ``t + u = d`` of the lattice at a time (cells on a diagonal depend only on
the previous one). It is used by ``rnnt_loss(..., backend="torch")``, by the tests as the
oracle for large lattices, and wherever no kernel applies.

    alpha(0,0) = 0
    alpha(t,u) = lae( alpha(t-1,u) + b(t-1,u),  alpha(t,u-1) + e(t,u-1) )
    beta(t,u)  = lae( beta(t+1,u) + b(t,u),     beta(t,u+1) + e(t,u) ),   beta(T_b,U_b) = 0
    log P      = beta(0,0)

where ``b`` / ``e`` are the blank / label log-probabilities and ``lae`` is ``torch.logaddexp``.
"""
from __future__ import annotations

import torch

from ._types import Lattice, LossOptions

NEG_INF = float("-inf")


def lattice_dtype(device: torch.device) -> torch.dtype:
    """The dtype the recursion runs in: float64 wherever the device has it."""
    return torch.float32 if device.type == "mps" else torch.float64


def node_mask(logit_lengths, target_lengths, T: int, U1: int) -> torch.Tensor:
    """(B, T, U+1) bool: True on the nodes ``t < T_b, u <= U_b`` of each sequence."""
    t = torch.arange(T, device=logit_lengths.device)
    u = torch.arange(U1, device=logit_lengths.device)
    return (t[None, :, None] < logit_lengths[:, None, None]) & (u[None, None, :] <= target_lengths[:, None, None])


def arc_masks(logit_lengths, target_lengths, T: int, U1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, U+1) bool masks of the nodes with a blank arc (``t < T_b - 1``, or the final
    blank at ``(T_b-1, U_b)``) and of those with a label arc (``t < T_b, u < U_b``)."""
    nodes = node_mask(logit_lengths, target_lengths, T, U1)
    t = torch.arange(T, device=logit_lengths.device)[None, :, None]
    u = torch.arange(U1, device=logit_lengths.device)[None, None, :]
    last_frame = t == (logit_lengths[:, None, None] - 1)
    blank_arcs = nodes & (~last_frame | (u == target_lengths[:, None, None]))
    label_arcs = nodes & (u < target_lengths[:, None, None])
    return blank_arcs, label_arcs


def arc_log_probs(logits, targets, logit_lengths, target_lengths, blank: int, fused: bool,
                  dtype: torch.dtype | None = None):
    """Blank and label log-probabilities of every lattice arc.

    Args:
        logits: ``(B, T, U+1, V)``; raw scores (``fused``) or log-probabilities.
        targets: ``(B, U)`` int64.
        logit_lengths, target_lengths: ``(B,)`` int64.
        dtype: dtype of the row computations (default: that of ``logits``).

    Returns:
        ``(lse, lpb, lpl)``, each ``(B, T, U+1)``: the row log-normaliser (0 in log-prob
        mode), ``b(t,u)`` and ``e(t,u)`` of math.md section 1, ``-inf`` off the lattice
        (padding, and ``e`` in the last valid column). ``b`` is also given on the last
        frame's nodes ``u < U_b``, where no blank arc leaves (``lattice`` ignores it).

    NaN and infinities (math.md section 8): a row whose max is NaN or +inf has NaN arcs
    (and ``lse`` NaN); an all ``-inf`` row has ``-inf`` arcs; in log-prob mode a ``+inf``
    arc entry reads as NaN.
    """
    B, T, U1, V = logits.shape
    x = logits if dtype is None else logits.to(dtype)
    if fused:
        lse = torch.logsumexp(x, dim=-1)                                  # (B, T, U+1)
        row_max = x.amax(dim=-1)                                          # NaN if any NaN
        bad_row = torch.isnan(row_max) | (row_max == float("inf"))
        lse = torch.where(bad_row, float("nan"), lse)
    else:
        lse = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    safe_targets = targets.clamp(0, V - 1)                                # padding may hold anything
    label_x = torch.gather(x[:, :, : U1 - 1, :], 3,
                           safe_targets[:, None, :, None].expand(B, T, U1 - 1, 1)).squeeze(-1)
    label_x = torch.nn.functional.pad(label_x, (0, 1), value=NEG_INF)    # (B, T, U+1)
    blank_x = x[..., blank]
    if not fused:                       # a log-probability of +inf is invalid: read as NaN
        blank_x = torch.where(blank_x == float("inf"), float("nan"), blank_x)
        label_x = torch.where(label_x == float("inf"), float("nan"), label_x)
    lpb = blank_x - lse
    lpl = label_x - lse
    # A row whose logits are all -inf has lse = -inf; its arcs are impossible, not NaN.
    dead_row = lse == NEG_INF
    nodes = node_mask(logit_lengths, target_lengths, T, U1)
    u = torch.arange(U1, device=x.device)
    label_nodes = nodes & (u[None, None, :] < target_lengths[:, None, None])
    lpb = torch.where(nodes & ~dead_row, lpb, NEG_INF)
    lpl = torch.where(label_nodes & ~dead_row, lpl, NEG_INF)
    return lse, lpb, lpl


def _diagonal(d: int, T: int, U1: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (t, u) of the cells with t + u = d inside a (T, U+1) grid."""
    t = torch.arange(max(0, d - U1 + 1), min(d, T - 1) + 1, device=device)
    return t, d - t


def forward_alpha(lpb: torch.Tensor, lpl: torch.Tensor, max_plus: bool = False) -> torch.Tensor:
    """alpha ``(B, T, U+1)`` swept along anti-diagonals ``d = t + u`` (math.md section 2).

    The semiring switch: ``max_plus=False`` combines the two incoming arcs with ``lae``
    (the forward variable, log-sum over paths); ``max_plus=True`` with ``max`` (the Viterbi
    score, log-probability of the best path into the node). Nodes off the lattice may hold
    finite values (they are never read through a finite arc).
    """
    B, T, U1 = lpb.shape
    dev, dt = lpb.device, lpb.dtype
    combine = torch.maximum if max_plus else torch.logaddexp
    alpha = torch.full((B, T, U1), NEG_INF, dtype=dt, device=dev)
    if T > 0:
        alpha[:, 0, 0] = 0.0
    for d in range(1, T + U1 - 1):
        t, u = _diagonal(d, T, U1, dev)
        tm1, um1 = (t - 1).clamp(min=0), (u - 1).clamp(min=0)
        from_blank = torch.where(t > 0, alpha[:, tm1, u] + lpb[:, tm1, u], NEG_INF)
        from_label = torch.where(u > 0, alpha[:, t, um1] + lpl[:, t, um1], NEG_INF)
        alpha[:, t, u] = combine(from_blank, from_label)
    return alpha


def lattice(lpb: torch.Tensor, lpl: torch.Tensor, logit_lengths, target_lengths) -> Lattice:
    """alpha, beta, log P and arc occupations (math.md sections 2-3) from arc log-probs.

    Args:
        lpb, lpl: ``(B, T, U+1)`` blank / label log-probs, ``-inf`` off the lattice.
        logit_lengths, target_lengths: ``(B,)`` int64.
    """
    B, T, U1 = lpb.shape
    dev, dt = lpb.device, lpb.dtype
    bidx = torch.arange(B, device=dev)
    # Only real arcs are read: no blank leaves the last frame but the final one (in
    # log-prob mode a NaN there must change nothing, math.md section 8.1).
    blank_arcs, label_arcs = arc_masks(logit_lengths, target_lengths, T, U1)
    lpb = torch.where(blank_arcs, lpb, NEG_INF)
    lpl = torch.where(label_arcs, lpl, NEG_INF)

    alpha = forward_alpha(lpb, lpl)

    # beta on a grid extended by one frame and one label position, so that the final
    # blank (T_b-1, U_b) -> (T_b, U_b) lands on a terminal cell with beta = 0.
    beta = torch.full((B, T + 1, U1 + 1), NEG_INF, dtype=dt, device=dev)
    terminal = torch.zeros((B, T + 1, U1 + 1), dtype=torch.bool, device=dev)
    terminal[bidx, logit_lengths, target_lengths] = True
    beta = torch.where(terminal, 0.0, beta)
    for d in range(T + U1 - 2, -1, -1):
        t, u = _diagonal(d, T, U1, dev)
        val = torch.logaddexp(beta[:, t + 1, u] + lpb[:, t, u], beta[:, t, u + 1] + lpl[:, t, u])
        beta[:, t, u] = torch.where(terminal[:, t, u], 0.0, val)

    # log P = beta(0,0); a sequence with no frame has no path at all.
    log_like = torch.where(logit_lengths > 0, beta[:, 0, 0], NEG_INF) if T > 0 else \
        torch.full((B,), NEG_INF, dtype=dt, device=dev)

    # Occupations (math.md section 3) on the arcs of each lattice; an impossible sequence
    # (log P = -inf) has none, a NaN one (log P = NaN) has NaN on every arc.
    possible = (log_like != NEG_INF)[:, None, None]
    ll = torch.where(possible, log_like[:, None, None], 0.0)
    gamma_blank = torch.where(possible & blank_arcs,
                              torch.exp(alpha + lpb + beta[:, 1:, :U1] - ll), 0.0)
    gamma_label = torch.where(possible & label_arcs,
                              torch.exp(alpha + lpl + beta[:, :T, 1:] - ll), 0.0)
    beta_nodes = torch.where(terminal[:, :T, :U1], NEG_INF, beta[:, :T, :U1])
    # The sweep also fills padding cells past T_b (reached by blanks out of the last
    # frame); the Lattice contract is -inf off each sequence's lattice.
    alpha = torch.where(node_mask(logit_lengths, target_lengths, T, U1), alpha, NEG_INF)
    return Lattice(alpha, beta_nodes, log_like, gamma_blank, gamma_label)


def logit_grad(logits, lse, lat: Lattice, targets, logit_lengths, target_lengths, blank: int,
               fused: bool, clamp: float, fastemit_lambda: float) -> torch.Tensor:
    """Per-sequence gradient of -log P w.r.t. ``logits`` (math.md sections 4-6), before
    the upstream gradient. Shape ``(B, T, U+1, V)``, dtype of ``logits``; padding is 0."""
    B, T, U1, V = logits.shape
    gb = lat.gamma_blank.to(logits.dtype)
    gl = (1.0 + fastemit_lambda) * lat.gamma_label.to(logits.dtype)   # FastEmit: label arcs x (1+lambda)
    if fused:
        # d/dz_v = p_v (gamma_blank + gamma_label) - [v=blank] gamma_blank - [v=y] gamma_label
        p = torch.exp(logits - lse[..., None])
        p = torch.where(torch.isneginf(lse)[..., None], 0.0, p)   # an all -inf row has no mass
        grad = p * (gb + gl)[..., None]
    else:
        # d/dlogp: -gamma on the two arcs leaving the node, 0 elsewhere.
        grad = torch.zeros_like(logits)
    grad[..., blank] -= gb
    safe_targets = targets.clamp(0, V - 1)
    label_idx = torch.nn.functional.pad(safe_targets, (0, 1), value=0)  # (B, U+1); last column has gl = 0
    grad.scatter_add_(3, label_idx[:, None, :, None].expand(B, T, U1, 1), -gl[..., None])
    nodes = node_mask(logit_lengths, target_lengths, T, U1)
    # Padding (possibly NaN-poisoned) and impossible sequences get exactly zero; a NaN
    # sequence keeps its NaN rows (log-prob mode: NaN on its arc entries).
    keep = nodes & (lat.log_like != NEG_INF)[:, None, None]
    grad = torch.where(keep[..., None], grad, 0.0)
    if clamp > 0:
        grad = grad.clamp(-clamp, clamp)
    return grad


# --------------------------------------------------------------------------- loss
INPLACE_WRITES_IN = "backward"    # the gradient is computed in the forward pass, written later


def loss_forward(logits, targets, logit_lengths, target_lengths, opts: LossOptions, need_grad):
    """``_ops`` protocol: costs, and (when wanted) the per-sequence gradient, computed here
    and saved for the backward pass, which only applies the upstream factor."""
    with torch.no_grad():
        ldt = lattice_dtype(logits.device)
        lse, lpb, lpl = arc_log_probs(logits, targets, logit_lengths, target_lengths,
                                      opts.blank, opts.fused)
        lat = lattice(lpb.to(ldt), lpl.to(ldt), logit_lengths, target_lengths)
        costs = (-lat.log_like).to(logits.dtype)
        if not need_grad:
            return costs, (), None
        grad = logit_grad(logits, lse, lat, targets, logit_lengths, target_lengths, opts.blank,
                          opts.fused, opts.clamp, opts.fastemit_lambda)
    return costs, (grad,) + ((logits,) if opts.inplace_grad else ()), None


def loss_backward(saved, state, upstream, opts: LossOptions):
    """``_ops`` protocol: ``upstream[b] * grad_b`` (exactly 0 where ``upstream[b] == 0``),
    into the logits' storage with ``opts.inplace_grad``."""
    from ._ops import scale_upstream
    grad, *into = saved
    up = upstream.to(grad.dtype)[:, None, None, None]
    if into:
        return scale_upstream(grad, up, out=into[0])
    return scale_upstream(grad, up)


def compute_lattice(logits, targets, logit_lengths, target_lengths, blank, fused) -> Lattice:
    """The lattice (alpha, beta, occupations) without any gradient work."""
    with torch.no_grad():
        _, lpb, lpl = arc_log_probs(logits, targets, logit_lengths, target_lengths, blank, fused)
        ldt = lattice_dtype(logits.device)
        return lattice(lpb.to(ldt), lpl.to(ldt), logit_lengths, target_lengths)


def viterbi(logits, targets, logit_lengths, target_lengths, blank, fused):
    """Max-plus forward pass: ``(alpha_max, lpb, lpl)``, each ``(B, T, U+1)`` in the lattice
    dtype. ``alpha_max(t,u)`` is the log-probability of the best path from (0,0) to (t,u);
    ``lpb``/``lpl`` are the arc log-probs (``-inf`` off the lattice). The backtracking is
    shared by every backend (``rnnt_lattice.analysis.alignment``)."""
    with torch.no_grad():
        _, lpb, lpl = arc_log_probs(logits, targets, logit_lengths, target_lengths, blank, fused)
        ldt = lattice_dtype(logits.device)
        lpb, lpl = lpb.to(ldt), lpl.to(ldt)
        alpha_max = forward_alpha(lpb, lpl, max_plus=True)
        B, T, U1 = lpb.shape
        alpha_max = torch.where(node_mask(logit_lengths, target_lengths, T, U1), alpha_max, NEG_INF)
        return alpha_max, lpb, lpl
