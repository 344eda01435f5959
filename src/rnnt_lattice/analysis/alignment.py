"""The best (Viterbi) alignment: the loss's recursion in the max-plus semiring, which also
records the best arc kind into every node (the backend protocol's ``viterbi``; the torch
backend runs the reference's ``sweep_alpha(max_plus=True)``), then one
backtracking pass over those pointers, written once, in torch, for every backend and
topology."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch

from .._ops import eager_under_compile
from .._types import Ends
from ..topology import Topology, regular
from ._common import kind_field, request, viterbi

NEG_INF = float("-inf")


class Arc(NamedTuple):
    """One arc of a best path: it leaves node ``(t, u)``, is of kind ``kind`` (its name in
    the topology) and advances ``duration`` frames (its ``dt``: TDT's duration, a big
    blank's length; 0 for a regular label arc)."""

    t: int
    u: int
    kind: str
    duration: int


@dataclass(frozen=True)
class Alignment:
    """The most probable path through each lattice.

    Attributes:
        emit_frames: ``(B, U)`` int64, the frame at which label ``y[u]`` is emitted (the
            source frame of its label arc; non-decreasing in ``u``); ``-1`` for labels no
            arc emits (``u >= U_b``, and ``u < u0`` with a boundary) and for sequences with
            no path (or NaN logits on their lattice).
        log_prob: ``(B,)`` log-probability of the best path (``-inf`` when there is none,
            NaN for NaN logits); always ``<=`` the log-likelihood, which sums over all
            paths. With ``sigma`` / ``delay_penalty`` the score of the weighted lattice.
        frame_labels: ``B`` lists of ``T_b`` lists: ``frame_labels[b][t]`` holds the label
            ids emitted at frame ``t`` in order (empty list: only the blank). Empty lists
            for a sequence with no path. Python lists, built on first access (for CUDA
            tensors that access copies to the host; the tensor fields never do).
        logit_lengths, target_lengths: ``(B,)`` (int64, or int32 as given).
        targets: ``(B, U)``, the label ids the lattice was built with (int64, or int32 as
            given).
        arc_frames, arc_positions: ``(B, L)`` int64 with ``L = T + U``: the source node
            ``(t, u)`` of each arc of the path, in path order (from the start node to the
            arc that lands on the end node); ``-1`` past ``n_arcs``.
        arc_kinds: ``(B, L)`` int64, the index of each arc's kind in ``topology.kinds``
            (``-1`` past ``n_arcs``).
        n_arcs: ``(B,)`` int64, the number of arcs of the path (0 without a path).
        label_durations: ``(B, U)`` int64, the frames advanced by the arc that emits label
            ``u`` (TDT: the duration predicted with the label); ``-1`` where no arc emits.
        topology: the :class:`rnnt_lattice.topology.Topology` of the lattice.
        arc_durations: (property) ``(B, L)`` int64, frames advanced by each arc (``-1``
            padding).
        arcs: (lazy) ``B`` lists of :class:`Arc` ``(t, u, kind name, duration)``.
    """

    emit_frames: torch.Tensor
    log_prob: torch.Tensor
    logit_lengths: torch.Tensor
    target_lengths: torch.Tensor
    targets: torch.Tensor
    # None: built from emit_frames (a regular alignment, __post_init__); tensors for every
    # reader
    arc_frames: torch.Tensor = None  # type: ignore[assignment]
    arc_positions: torch.Tensor = None  # type: ignore[assignment]
    arc_kinds: torch.Tensor = None  # type: ignore[assignment]
    n_arcs: torch.Tensor = None  # type: ignore[assignment]
    label_durations: torch.Tensor = None  # type: ignore[assignment]
    topology: Topology = field(default_factory=regular)

    def __post_init__(self):
        if self.arc_kinds is None:     # a regular alignment given by its emission frames
            T = max(int(self.logit_lengths.max()) if self.logit_lengths.numel() else 0, 0)
            fields = _regular_arcs(self.emit_frames, self.logit_lengths, self.target_lengths,
                                   self.log_prob > NEG_INF, T)
            for name, value in zip(("arc_frames", "arc_positions", "arc_kinds", "n_arcs",
                                    "label_durations"), fields):
                object.__setattr__(self, name, value)

    @property
    def arc_durations(self) -> torch.Tensor:
        dt = kind_field(self.topology, "dt", self.arc_kinds.device)
        return torch.where(self.arc_kinds >= 0, dt[self.arc_kinds.clamp(min=0)], -1)

    @cached_property
    def frame_labels(self) -> list:
        return _frame_labels(self.emit_frames.cpu(), self.targets.cpu(),
                             self.logit_lengths.cpu(), self.target_lengths.cpu(),
                             (self.log_prob > NEG_INF).cpu())

    @cached_property
    def arcs(self) -> list:
        kinds = self.topology.kinds
        out = []
        for t_row, u_row, k_row, n in zip(self.arc_frames.tolist(), self.arc_positions.tolist(),
                                          self.arc_kinds.tolist(), self.n_arcs.tolist()):
            out.append([Arc(t, u, kinds[k].name, kinds[k].dt)
                        for t, u, k in zip(t_row[:n], u_row[:n], k_row[:n])])
        return out

    def path(self, b: int) -> list[tuple[int, int]]:
        """Nodes ``(t, u)`` that sequence ``b``'s path leaves, in order: the source node of
        each arc, from the start node on; the end node (on the virtual end frame) is not
        listed. Regular topology: ``T_b + U_b`` nodes from ``(0, 0)`` to ``(T_b-1, U_b)``.
        Empty without a path."""
        n = int(self.n_arcs[b])
        return list(zip(self.arc_frames[b, :n].tolist(), self.arc_positions[b, :n].tolist()))


def _regular_arcs(emit, logit_lengths, target_lengths, ok, T: int):
    """The arc tensors of regular paths given by their emission frames (vectorised, no
    host sync): label ``u`` is arc ``emit[u] + u``; the blank leaving frame ``t`` is arc
    ``t + c_t`` from ``(t, c_t)``, ``c_t`` the number of labels emitted at frames ``<= t``."""
    B, U = emit.shape
    dev = emit.device
    Tl, Ul = logit_lengths.to(dev), target_lengths.to(dev)
    T = max(T, 0)
    L = T + U
    ok = ok.to(dev) & (Tl > 0)
    u_idx = torch.arange(U, device=dev)[None, :]
    is_lab = ok[:, None] & (u_idx < Ul[:, None]) & (emit >= 0)
    t_idx = torch.arange(T, device=dev)[None, :]
    is_blank = ok[:, None] & (t_idx < Tl[:, None])
    counts = ((emit[:, None, :] <= t_idx[:, :, None]) & is_lab[:, None, :]).sum(-1)    # (B, T)
    frames = torch.full((B, L + 1), -1, dtype=torch.int64, device=dev)
    pos, kinds = frames.clone(), frames.clone()
    lab_at = torch.where(is_lab, emit + u_idx, L)
    blank_at = torch.where(is_blank, t_idx + counts, L)
    for at, f, p, k in ((lab_at, emit, u_idx.expand(B, U), 1),
                        (blank_at, t_idx.expand(B, T), counts, 0)):
        frames.scatter_(1, at, f)
        pos.scatter_(1, at, p)
        kinds.scatter_(1, at, torch.full_like(at, k))
    n = torch.where(ok, Tl + Ul, 0)
    keep = torch.arange(L, device=dev)[None, :] < n[:, None]
    frames, pos, kinds = (torch.where(keep, x[:, :L], -1) for x in (frames, pos, kinds))
    label_durations = torch.where(is_lab, 0, -1)
    return frames, pos, kinds, n, label_durations


def backtrack_arcs(best_kind, topo: Topology, ends, log_prob):
    """Best path of every sequence from the max-plus pointers of ``reference.sweep_alpha``,
    vectorised over the batch (no host sync): from the end node, follow the kind of the
    best arc into the current node back to its source, until the start node.

    Tie rule: the sweep keeps the first kind of ``topo.kinds`` on an exact tie of the
    incoming scores (regular: the blank predecessor, i.e. the earliest emission; TDT: the
    label kinds before the blanks, shorter durations first).

    Returns:
        ``(arc_frames, arc_positions, arc_kinds (B, L), n_arcs (B,), emit_frames,
        label_durations (B, U))`` as :class:`Alignment` holds them, ``L = T + U``.
    """
    B, T1, U1 = best_kind.shape
    T, U = T1 - 1, U1 - 1
    dev = best_kind.device
    L = T + U
    bidx = torch.arange(B, device=dev)
    dts, dus = kind_field(topo, "dt", dev), kind_field(topo, "du", dev)
    t, u = ends.t1.to(dev).clone(), ends.u1.to(dev).clone()
    t0, u0 = ends.t0.to(dev), ends.u0.to(dev)
    ok = (log_prob > NEG_INF) & (ends.t1.to(dev) > t0)
    rev = torch.full((3, B, max(L, 1)), -1, dtype=torch.int64, device=dev)
    n = torch.zeros(B, dtype=torch.int64, device=dev)
    for i in range(L):                  # every arc advances t + u: at most L arcs
        k = best_kind[bidx, t, u].long()
        active = ok & ((t != t0) | (u != u0)) & (k >= 0)
        kc = k.clamp(min=0)
        st, su = t - dts[kc], u - dus[kc]
        rev[0, :, i] = torch.where(active, st, -1)
        rev[1, :, i] = torch.where(active, su, -1)
        rev[2, :, i] = torch.where(active, kc, -1)
        n = n + active
        t, u = torch.where(active, st, t), torch.where(active, su, u)
    rev = rev[:, :, :L]
    j = torch.arange(L, device=dev)[None, :]
    keep = j < n[:, None]
    src = (n[:, None] - 1 - j).clamp(min=0)
    arc_t, arc_u, arc_k = (torch.where(keep, x.gather(1, src), -1) for x in rev)
    # label arcs: label y[u] is emitted from (t, u)
    is_lab = keep & (dus[arc_k.clamp(min=0)] == 1)
    at = torch.where(is_lab, arc_u, U)
    emit = torch.full((B, U + 1), -1, dtype=torch.int64, device=dev)
    emit.scatter_(1, at, torch.where(is_lab, arc_t, -1))
    dur = torch.full((B, U + 1), -1, dtype=torch.int64, device=dev)
    dur.scatter_(1, at, torch.where(is_lab, dts[arc_k.clamp(min=0)], -1))
    return arc_t, arc_u, arc_k, n, emit[:, :U], dur[:, :U]


def best_alignment(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int = -1,
    fused_log_softmax: bool = True,
    *,
    backend: str = "auto",
    rnnt_type: str = "regular",
    topology: Topology | None = None,
    sigma: float = 0.0,
    delay_penalty: float = 0.0,
    boundary: torch.Tensor | None = None,
) -> Alignment:
    r"""The most probable (Viterbi) alignment of each sequence.

    The forward recursion of the loss in the max-plus semiring (same code, ``max`` in place
    of ``logaddexp``), then a backtracking pass::

        alpha_max(n) = max over kinds k of alpha_max(n - delta_k) + w_k(n - delta_k)
        log_prob     = alpha_max(end node)

    (regular: ``alpha_max(t,u) = max(alpha_max(t-1,u) + b(t-1,u), alpha_max(t,u-1) +
    e(t,u-1))``, ``log_prob = alpha_max(T_b-1,U_b) + b(T_b-1,U_b)``).

    The lattice is chosen as in :func:`rnnt_lattice.occupancy` (``rnnt_type`` or
    ``topology=``, ``sigma``, ``delay_penalty``, ``boundary``). Every lattice runs on the
    backend's max-plus sweep, which keeps the kind of the best arc into each node, and
    :func:`backtrack_arcs` follows those pointers from the end node (ties: the kind listed
    first in ``topology.kinds``; regular: the blank predecessor, the earliest emission).

    Example::

        >>> import torch, rnnt_lattice
        >>> logits = torch.randn(1, 5, 3, 4)                       # (B, T, U+1, V)
        >>> ali = rnnt_lattice.best_alignment(logits, torch.tensor([[2, 3]]),
        ...                                   torch.tensor([5]), torch.tensor([2]), blank=0)
        >>> ali.emit_frames.shape, len(ali.frame_labels[0])        # (B, U), T_b frames
        (torch.Size([1, 2]), 5)
        >>> sum(len(x) for x in ali.frame_labels[0])
        2
        >>> from rnnt_lattice import topology
        >>> x = torch.randn(1, 5, 3, 4 + 3)                        # 4 tokens (blank last), 3 durations
        >>> ali = rnnt_lattice.best_alignment(x, torch.tensor([[1, 2]]), torch.tensor([5]),
        ...                                   torch.tensor([2]), blank=-1,
        ...                                   topology=topology.tdt([0, 1, 2]), backend="torch")
        >>> sum(a.duration for a in ali.arcs[0])                   # the durations cover T_b
        5
        >>> ali.label_durations.shape                              # (B, U): each label's duration
        torch.Size([1, 2])

    Arguments and backends are those of :func:`rnnt_lattice.occupancy`.

    Returns:
        :class:`Alignment`.
    """
    req = request(logits, targets, logit_lengths, target_lengths, blank, fused_log_softmax,
                  backend, rnnt_type, topology, sigma, delay_penalty, boundary)
    chk = req.chk
    _, best_kind, log_prob = viterbi(req)
    ends = Ends.of(chk.logit_lengths, chk.target_lengths, req.boundary)
    with torch.no_grad():
        arc_t, arc_u, arc_k, n, emit, dur = backtrack_arcs(best_kind, req.topo, ends, log_prob)
    return Alignment(emit, log_prob, chk.logit_lengths, chk.target_lengths, chk.targets,
                     arc_t, arc_u, arc_k, n, dur, topology=req.topo)


def _frame_labels(emit, targets, logit_lengths, target_lengths, ok) -> list:
    out = []
    for b in range(emit.shape[0]):
        T_b, U_b = int(logit_lengths[b]), int(target_lengths[b])
        frames = [[] for _ in range(T_b)]
        if bool(ok[b]):
            for u, t in enumerate(emit[b, :U_b].tolist()):
                if 0 <= t < T_b:          # -1: not emitted (before a boundary's start)
                    frames[t].append(int(targets[b, u]))
        out.append(frames)
    return out


# Under torch.compile the tool runs eagerly (a graph break), as occupancy does.
best_alignment = eager_under_compile(
    best_alignment, "rnnt_lattice's best_alignment runs its kernels eagerly, a graph break; "
    "compile without fullgraph=True")
