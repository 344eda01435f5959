"""How much occupancy mass monotone windows of R label positions per frame hold.

Pruned RNN-T (Kuang et al. 2022; math.md section 7) evaluates the full joiner only on a
window ``[s(t), s(t) + R)`` of label positions per frame, with ``s`` non-decreasing and
steps ``s(t+1) - s(t) <= R - 1`` (consecutive windows overlap, so a path can stay inside
them). :func:`prune_coverage` says, for every R, how much of the occupancy mass the best
such windows keep: a number to choose R with.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._validate import check_int
from ..pruned.windows import best_window_starts
from ..reference import cumsum_last
from .occupancy import Occupancy

NEG_INF = float("-inf")


@dataclass(frozen=True)
class PruneCoverage:
    """Coverage of occupancy mass by the best monotone windows.

    Attributes:
        window: ``(R_max,)`` int64, the window sizes ``1..max_window``.
        per_sequence: ``(B, R_max)`` share of sequence ``b``'s node-occupancy mass inside
            its best windows of size R (1 for a sequence without mass; NaN for a sequence
            whose occupations are NaN, e.g. NaN logits inside its lattice).
        total: ``(R_max,)`` the same share over the whole batch (mass-weighted:
            covered mass of all sequences / their total mass; 1 when no sequence has mass,
            e.g. none has a path: nothing is left uncovered, which says nothing of a
            window's quality, so check ``occ.log_likelihood`` first; NaN when a sequence's
            share is NaN).
        s_begin: ``(B, T)`` int64, the optimal window starts for ``R = max_window``.
    """

    window: torch.Tensor
    per_sequence: torch.Tensor
    total: torch.Tensor
    s_begin: torch.Tensor

    def rows(self) -> list[tuple[int, float]]:
        """``[(R, total share), ...]``, e.g. for a CSV or markdown table."""
        return [(int(r), float(c)) for r, c in zip(self.window, self.total)]


def prune_coverage(occ: Occupancy, max_window: int = 8) -> PruneCoverage:
    r"""Share of occupancy mass held by the best monotone per-frame windows of R label
    positions, for R = 1..max_window.

    For each sequence and R the windows ``[s(t), s(t) + R)`` are chosen to maximise the
    covered node occupancy ``sum_t sum_{s(t) <= u < s(t)+R} occ.node(t,u)`` under the
    constraints of pruned RNN-T: ``s`` non-decreasing, ``s(t+1) - s(t) <= R - 1``, and each
    window inside the lattice (``0 <= s(t) <= max(0, U_b + 1 - R)``). This is an exact
    dynamic program over frames (not a per-frame argmax made monotone afterwards), so the
    share is non-decreasing in R and equals 1 once ``R >= U_b + 1``. Frames past ``T_b``
    carry no mass and do not constrain the windows. The windows of
    :func:`rnnt_lattice.prune_ranges` obey more (k2's pinned first and last windows, steps
    of one label for ``modified``/``constrained``): these shares are an upper bound of their
    ``covered``, equal to it where those rules cost no mass.

    Example::

        >>> import torch, rnnt_lattice
        >>> logits = torch.randn(2, 8, 5, 6)                       # (B, T, U+1, V)
        >>> targets = torch.randint(1, 6, (2, 4))
        >>> occ = rnnt_lattice.occupancy(logits, targets, torch.tensor([8, 6]),
        ...                              torch.tensor([4, 3]), blank=0)
        >>> cov = rnnt_lattice.prune_coverage(occ, max_window=5)
        >>> cov.total.shape, float(cov.total[-1])                  # (R_max,), all mass at R = U+1
        (torch.Size([5]), 1.0)

    Args:
        occ: from :func:`rnnt_lattice.occupancy`.
        max_window: largest window size (>= 1).

    Returns:
        :class:`PruneCoverage`.
    """
    if not isinstance(occ, Occupancy):
        raise ValueError(f"occ must be the Occupancy of rnnt_lattice.occupancy, got "
                         f"{type(occ).__name__}")
    max_window = check_int("max_window", max_window)     # (a tensor: named by its shape)
    if max_window < 1:
        raise ValueError(f"max_window must be an int >= 1, got {max_window}")
    node = occ.node                                                          # (B, T, U+1)
    B, T, U1 = node.shape
    dev, dt = node.device, node.dtype
    Ul = occ.target_lengths.to(dev)
    mass_b = node.sum((1, 2))                                                 # (B,)
    per_seq = torch.ones((B, max_window), dtype=dt, device=dev)
    covered = torch.zeros((B, max_window), dtype=dt, device=dev)
    s_begin = torch.zeros((B, T), dtype=torch.int64, device=dev)
    cum = torch.nn.functional.pad(cumsum_last(node), (1, 0))                 # (B, T, U+2)
    for R in range(1, max_window + 1):
        if B == 0 or T == 0:
            break
        S = max(U1 - R + 1, 1)                                                # candidate starts
        stop = torch.clamp(torch.arange(S, device=dev) + R, max=U1)
        mass = cum[..., stop] - cum[..., :S]                                  # (B, T, S) window sums
        n_starts = torch.clamp(Ul + 2 - R, min=1)                             # s <= max(0, U_b+1-R)
        best, starts = best_window_starts(mass, n_starts, R - 1)
        covered[:, R - 1] = best
        if R == max_window:
            s_begin = starts
    has_mass = mass_b > 0
    per_seq = torch.where(has_mass[:, None], covered / torch.where(has_mass, mass_b, 1.0)[:, None],
                          per_seq).clamp(max=1.0)
    total_mass = mass_b.sum()
    some = total_mass > 0                                  # (a select: no host read)
    total = torch.where(some, covered.sum(0) / torch.where(some, total_mass, 1.0), 1.0)
    total = total.clamp(max=1.0)
    # A window of R >= U_b + 1 holds the whole column: exactly 1, not 1 - rounding.
    whole = torch.arange(1, max_window + 1, device=dev)[None, :] >= (Ul + 1)[:, None]   # (B, R_max)
    per_seq = torch.where(whole, 1.0, per_seq)
    if B > 0:
        total = torch.where(whole.all(0), 1.0, total)
    # NaN occupations (NaN logits in a lattice) fail both `> 0` tests above, which would read
    # them as "no mass": a NaN share instead, for the sequence and the batch, as
    # PruneRanges.covered gives them.
    nan_b = torch.isnan(mass_b)                                               # (B,)
    per_seq = per_seq.masked_fill(nan_b[:, None], float("nan"))
    total = torch.where(nan_b.any(), float("nan"), total)
    window = torch.arange(1, max_window + 1, dtype=torch.int64)
    return PruneCoverage(window, per_seq, total, s_begin)
