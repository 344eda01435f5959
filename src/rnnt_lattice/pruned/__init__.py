"""Pruned RNN-T (Kuang et al. 2022; math.md sections 7 and 10; k2/fast_rnnt semantics,
docs/variants.md A.5-A.6), in two passes. The *simple* joiner ``logits(t,u,v) =
am(t,v) + lm(u,v)`` gives a cheap lattice whose occupations say, per frame, which R label
positions hold the alignments; the full joiner is then evaluated only on those windows:

    loss_simple, occ = rnnt_loss_simple(lm, am, ..., return_occupations=True)   # simple
    win = prune_ranges(occ, R)                       # windows: ranges (B, T, R'), covered (B,)
    am_p, lm_p = do_rnnt_pruning(am_enc, lm_pred, win.ranges)    # (B, T, R', D) each
    loss_pruned = rnnt_loss_pruned(joiner(am_p, lm_p), targets, win.ranges, ...)  # loss

* :mod:`.simple` — ``rnnt_loss_simple``, ``rnnt_loss_smoothed``, ``lattice_loss``;
* :mod:`.windows` — ``prune_ranges`` (k2's rule or the exact window DP), ``do_rnnt_pruning``;
* :mod:`.loss` — ``rnnt_loss_pruned`` on the window logits ``(B, T, R, V)``.
"""
from .loss import rnnt_loss_pruned
from .simple import ArcOccupations, lattice_loss, rnnt_loss_simple, rnnt_loss_smoothed
from .windows import PruneRanges, do_rnnt_pruning, prune_ranges

__all__ = ["rnnt_loss_simple", "rnnt_loss_smoothed", "lattice_loss", "ArcOccupations",
           "prune_ranges", "PruneRanges", "do_rnnt_pruning", "rnnt_loss_pruned"]
