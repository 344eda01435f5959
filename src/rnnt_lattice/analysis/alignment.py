"""The best (Viterbi) alignment: the loss's recursion in the max-plus semiring, then one
backtracking pass written once, in torch, for every backend."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ._common import prepare

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Alignment:
    """The most probable path through each lattice.

    Attributes:
        emit_frames: ``(B, U)`` int64, the frame at which label ``y[u]`` is emitted
            (non-decreasing in ``u``); ``-1`` for ``u >= U_b`` and for sequences with no
            path (or NaN logits on their lattice).
        log_prob: ``(B,)`` log-probability of the best path (``-inf`` when there is none,
            NaN for NaN logits); always ``<=`` the log-likelihood, which sums over all paths.
        frame_labels: ``B`` lists of ``T_b`` lists: ``frame_labels[b][t]`` holds the label
            ids emitted at frame ``t`` in order (empty list: only the blank). Empty lists
            for a sequence with no path. Python lists, built on first access (for CUDA
            tensors that access copies to the host; the tensor fields never do).
        logit_lengths, target_lengths: ``(B,)`` int64.
        targets: ``(B, U)`` int64, the label ids the lattice was built with.
    """

    emit_frames: torch.Tensor
    log_prob: torch.Tensor
    logit_lengths: torch.Tensor
    target_lengths: torch.Tensor
    targets: torch.Tensor

    @cached_property
    def frame_labels(self) -> list:
        return _frame_labels(self.emit_frames.cpu(), self.targets.cpu(),
                             self.logit_lengths.cpu(), self.target_lengths.cpu(),
                             (self.log_prob > NEG_INF).cpu())

    def path(self, b: int) -> list[tuple[int, int]]:
        """Nodes ``(t, u)`` visited by sequence ``b``'s path, from ``(0, 0)`` to
        ``(T_b-1, U_b)`` (empty if no path): ``T_b + U_b`` nodes."""
        T_b, U_b = int(self.logit_lengths[b]), int(self.target_lengths[b])
        frames = self.emit_frames[b, :U_b].tolist()
        if T_b == 0 or (U_b > 0 and frames[0] < 0) or not self.log_prob[b] > NEG_INF:
            return []
        nodes, u = [], 0
        for t in range(T_b):
            nodes.append((t, u))
            while u < U_b and frames[u] == t:
                u += 1
                nodes.append((t, u))
        return nodes


def backtrack(alpha_max, lpb, lpl, logit_lengths, target_lengths):
    """Best path from max-plus alpha, vectorised over the batch.

    Starting at ``(T_b-1, U_b)`` (the final blank is the last arc), each step moves to the
    predecessor that achieved the max in

        alpha_max(t,u) = max(alpha_max(t-1,u) + b(t-1,u), alpha_max(t,u-1) + e(t,u-1))

    Tie rule: an exact tie goes to the blank predecessor ``(t-1,u)``, i.e. the label is
    placed at the earlier frame (on equal scores the earliest emission wins).

    Args:
        alpha_max, lpb, lpl: ``(B, T, U+1)`` from a backend's ``viterbi``.
        logit_lengths, target_lengths: ``(B,)`` int64.

    Returns:
        ``(emit_frames (B, U) int64, log_prob (B,))``.
    """
    B, T, U1 = alpha_max.shape
    dev = alpha_max.device
    bidx = torch.arange(B, device=dev)
    Tl, Ul = logit_lengths.to(dev), target_lengths.to(dev)
    emit = torch.full((B, max(U1 - 1, 0)), -1, dtype=torch.int64, device=dev)
    if B == 0 or T == 0:
        return emit, torch.full((B,), NEG_INF, dtype=alpha_max.dtype, device=dev)
    t = (Tl - 1).clamp(min=0)
    u = Ul.clone()
    log_prob = alpha_max[bidx, t, u] + lpb[bidx, t, u]
    log_prob = torch.where(Tl > 0, log_prob, NEG_INF)
    ok = log_prob > NEG_INF                              # False for -inf and NaN
    log_prob = torch.where(torch.isnan(log_prob) | ok, log_prob, NEG_INF)
    # Every path has T_b - 1 + U_b arcs before the final blank; the padded sizes bound that
    # without reading the lengths on the host (no device synchronisation). Finished
    # sequences stand still.
    for _ in range(T - 1 + U1 - 1):
        active = ok & ((t > 0) | (u > 0))
        tm1, um1 = (t - 1).clamp(min=0), (u - 1).clamp(min=0)
        from_blank = torch.where(t > 0, alpha_max[bidx, tm1, u] + lpb[bidx, tm1, u], NEG_INF)
        from_label = torch.where(u > 0, alpha_max[bidx, t, um1] + lpl[bidx, t, um1], NEG_INF)
        take_label = active & (u > 0) & ((t == 0) | (from_label > from_blank))
        take_blank = active & ~take_label
        if U1 > 1:
            # label y[u-1] is emitted at frame t
            col = um1.clamp(max=U1 - 2)
            emit[bidx, col] = torch.where(take_label, t, emit[bidx, col])
        u = torch.where(take_label, um1, u)
        t = torch.where(take_blank, tm1, t)
    return emit, log_prob


def best_alignment(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int = -1,
    fused_log_softmax: bool = True,
    *,
    backend: str = "auto",
) -> Alignment:
    r"""The most probable (Viterbi) alignment of each sequence.

    The forward recursion of the loss in the max-plus semiring (same code, ``max`` in place
    of ``logaddexp``), then a backtracking pass (ties: see :func:`backtrack`)::

        alpha_max(t,u) = max(alpha_max(t-1,u) + b(t-1,u), alpha_max(t,u-1) + e(t,u-1))
        log_prob       = alpha_max(T_b-1,U_b) + b(T_b-1,U_b)

    Example::

        >>> import torch, rnnt_lattice
        >>> logits = torch.randn(1, 5, 3, 4)                       # (B, T, U+1, V)
        >>> ali = rnnt_lattice.best_alignment(logits, torch.tensor([[2, 3]]),
        ...                                   torch.tensor([5]), torch.tensor([2]), blank=0)
        >>> ali.emit_frames.shape, len(ali.frame_labels[0])        # (B, U), T_b frames
        (torch.Size([1, 2]), 5)
        >>> sum(len(x) for x in ali.frame_labels[0])
        2

    Arguments and backends are those of :func:`rnnt_lattice.rnnt_loss`.

    Returns:
        :class:`Alignment`.
    """
    chk, impl = prepare(logits, targets, logit_lengths, target_lengths, blank, backend)
    with torch.no_grad():
        alpha_max, lpb, lpl = impl.viterbi(chk.logits, chk.targets, chk.logit_lengths,
                                           chk.target_lengths, chk.blank, bool(fused_log_softmax))
        emit, log_prob = backtrack(alpha_max, lpb, lpl, chk.logit_lengths, chk.target_lengths)
    return Alignment(emit, log_prob, chk.logit_lengths, chk.target_lengths, chk.targets)


def _frame_labels(emit, targets, logit_lengths, target_lengths, ok) -> list:
    out = []
    for b in range(emit.shape[0]):
        T_b, U_b = int(logit_lengths[b]), int(target_lengths[b])
        frames = [[] for _ in range(T_b)]
        if bool(ok[b]):
            for u, t in enumerate(emit[b, :U_b].tolist()):
                frames[t].append(int(targets[b, u]))
        out.append(frames)
    return out
