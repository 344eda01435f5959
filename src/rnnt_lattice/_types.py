"""Small containers passed between the backends and the public layer."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .topology import Topology, by_name, regular

_REGULAR_KINDS = by_name("regular").kinds     # the arcs the regular fast path computes


@dataclass
class Lattice:
    """Forward/backward variables and per-kind arc occupations of a batch of lattices of one
    topology (docs/math.md sections 2-3 and 9). Node tensors are ``(B, T+1, U+1)`` (frame
    ``T`` holds the end nodes), ``-inf`` outside each sequence's nodes ``t0 <= t <= t1,
    u0 <= u <= u1``; ``gamma`` is ``(B, K, T, U+1)`` over source nodes, 0 off the arcs."""

    alpha: torch.Tensor        # (B, T+1, U+1)  log-sum of paths from the start to (t,u)
    beta: torch.Tensor         # (B, T+1, U+1)  log-sum of paths from (t,u) to the end
    log_like: torch.Tensor     # (B,)  log P = beta(start); -inf without a path, NaN for a NaN arc
    gamma: torch.Tensor        # (B, K, T, U+1) occupation of kind k's arc leaving (t,u)


@dataclass(frozen=True)
class LossOptions:
    """Everything a backend needs to know about one loss call besides its tensors.

    One object travels from the public layer through the autograd Function and the custom
    op to the backend's ``loss_forward`` / ``loss_backward``: never positional tuples.
    """

    blank: int                      # in [0, V_tok)
    log_softmax: bool = True        # True: logits are raw scores (the log-softmax is applied
                                    # inside the loss, fused); False: they are log-probs
    clamp: float = -1.0             # > 0: clip the per-sequence gradient to [-clamp, clamp]
    fastemit_lambda: float = 0.0    # FastEmit: label arcs' gradient x (1 + lambda)
    inplace_grad: bool = False      # write the gradient over the logits
    topology: Topology = field(default_factory=regular)   # the lattice (math.md 1-6, 9)
    sigma: float = 0.0              # subtracted once per arc (NeMo's logit under-normalisation)
    delay_penalty: float = 0.0      # k2's delay penalty on label arcs (math.md section 9)

    def without_inplace(self) -> "LossOptions":
        return replace(self, inplace_grad=False)

    @property
    def regular(self) -> bool:
        """The plain RNN-T lattice with no per-arc term: what a backend's regular fast path
        (the Numba ``regular_`` kernels) may compute instead of its general recursion. The
        lattice is recognised by its arcs, the kinds of ``topology.regular()`` in their order
        (the fast path's planes), never by its name: a tuple compare, whose items are the
        very same objects for the topologies of ``by_name``."""
        return (self.sigma == 0.0 and self.delay_penalty == 0.0
                and self.topology.kinds == _REGULAR_KINDS)


@dataclass(frozen=True)
class Ends:
    """Per-sequence start node ``(t0, u0)`` and end node ``(t1, u1)``, each ``(B,)`` int64.

    Without a boundary: ``(0, 0)`` and ``(T_b, U_b)``. k2's ``boundary`` row
    ``[begin_symbol, begin_frame, end_symbol, end_frame]`` gives ``(begin_frame,
    begin_symbol)`` and ``(end_frame, end_symbol)``. The logits read are the rows of the
    region ``t0 <= t < t1, u0 <= u <= u1``; everything else is padding (never read,
    gradient 0). ``t1`` plays ``T_b`` everywhere, the delay penalty included.
    """

    t0: torch.Tensor
    u0: torch.Tensor
    t1: torch.Tensor
    u1: torch.Tensor
    custom_start: bool = False   # False: every start is (0, 0), known without a device sync

    @staticmethod
    def of(logit_lengths, target_lengths, boundary=None) -> "Ends":
        if boundary is None:
            zero = torch.zeros_like(logit_lengths)
            return Ends(zero, zero, logit_lengths, target_lengths)
        boundary = boundary.to(device=logit_lengths.device, dtype=torch.int64)
        return Ends(boundary[:, 1], boundary[:, 0], boundary[:, 3], boundary[:, 2], True)

    def check(self, T: int, U1: int) -> None:
        """ValueError unless ``0 <= t0 <= t1 <= T`` and ``0 <= u0 <= u1 <= U`` for every
        sequence, as k2 checks its boundary (one device sync: the reference's entry points
        call it, the recursion does not)."""
        if self.t0.device.type == "meta":
            return                            # no values to read: shapes only
        ok = ((self.t0 >= 0) & (self.t0 <= self.t1) & (self.t1 <= T)
              & (self.u0 >= 0) & (self.u0 <= self.u1) & (self.u1 <= U1 - 1))
        if not bool(ok.all()):
            b = int((~ok).nonzero()[0, 0])
            raise ValueError(f"sequence {b}: start ({int(self.t0[b])}, {int(self.u0[b])}) and end "
                             f"({int(self.t1[b])}, {int(self.u1[b])}) must satisfy 0 <= t0 <= t1 "
                             f"<= T = {T} and 0 <= u0 <= u1 <= U = {U1 - 1} (boundary rows are "
                             "[begin_symbol, begin_frame, end_symbol, end_frame])")

    def region(self, T: int, U1: int) -> torch.Tensor:
        """(B, T, U+1) bool: the nodes whose logits are read, ``t0 <= t < t1, u0 <= u <= u1``."""
        t = torch.arange(T, device=self.t0.device)[None, :, None]
        u = torch.arange(U1, device=self.t0.device)[None, None, :]
        return ((t >= self.t0[:, None, None]) & (t < self.t1[:, None, None])
                & (u >= self.u0[:, None, None]) & (u <= self.u1[:, None, None]))


@dataclass(frozen=True)
class Smoothing:
    """The scales of the smoothed simple loss (``rnnt_loss_smoothed``): ``c = 1 - s_lm -
    s_am``, and ``s_am``, ``s_lm`` with a zero replaced by 1e-20 (k2's, so that ``0 *
    -inf`` is not NaN)."""

    c: float
    s_am: float
    s_lm: float


@dataclass(frozen=True)
class ArcParts:
    """What the simple losses' arc log-probs are made of (``pruned.simple._ArcTerms``; the
    backends' ``arc_terms``). Float64 unless said.

    mass, lse_rescued: ``(B, T, U+1)``, the joint mass of each node and the log-domain lse
        of the rescued nodes (-inf elsewhere); rescued: ``(B, T, U+1)`` bool.
    am_cols: ``(B, T, U+1)`` ``[am(t, blank), am(t, y_0), .., am(t, y_{U-1})]`` and lm_cols:
        ``(B, U+1, 2)`` ``[lm(u, blank), lm(u, y_u)]``, in the inputs' dtype.
    am_shift ``(B, T)``, lm_shift ``(B, U+1)``: the rows' shifts; am_bad, lm_bad: the same
        shapes, bool: the rows that hold NaN or +inf.
    P, R ``(B, T)``, Q ``(B, U+1)``, S ``(B, U)``: the smoothing's per-row terms, None
        for the simple loss."""

    mass: torch.Tensor
    lse_rescued: torch.Tensor
    rescued: torch.Tensor
    am_cols: torch.Tensor
    lm_cols: torch.Tensor
    am_shift: torch.Tensor
    lm_shift: torch.Tensor
    am_bad: torch.Tensor
    lm_bad: torch.Tensor
    P: torch.Tensor | None = None
    Q: torch.Tensor | None = None
    R: torch.Tensor | None = None
    S: torch.Tensor | None = None
