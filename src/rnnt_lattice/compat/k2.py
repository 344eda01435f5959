"""k2 / fast_rnnt's RNN-T API on rnnt_lattice's kernels: an icefall recipe switches by
changing its import,

    import fast_rnnt                          # or: import k2
    import rnnt_lattice.compat.k2 as fast_rnnt

Same names, argument order, defaults, shapes and return values as fast_rnnt 1.x
(``../shared/docs/variants.md`` A): ``rnnt_loss``, ``rnnt_loss_simple``,
``rnnt_loss_smoothed``, ``get_rnnt_prune_ranges``, ``do_rnnt_pruning`` and
``rnnt_loss_pruned``, with ``symbols`` ``(B, S)``, ``termination_symbol`` (the blank),
``boundary`` ``(B, 4)`` ``[begin_symbol, begin_frame, end_symbol, end_frame]`` (the only way
to give lengths, as in k2: without it every sequence is ``S`` symbols over ``T`` frames),
``rnnt_type``, ``delay_penalty``, ``reduction`` and ``return_grad``.

``return_grad=True`` returns ``(loss, (px_grad, py_grad))``: the arc occupations in k2's
layout, ``px_grad`` ``(B, S, T+1)`` for ``"regular"`` (``(B, S, T)`` otherwise) with
``px_grad[b, s, t]`` the occupation of the label arc leaving ``(t, s)``, and ``py_grad``
``(B, S+1, T)`` that of the blank arc (the derivatives of the log-likelihood w.r.t. k2's
``px``/``py``).

Differences from k2, all deliberate:
- a negative ``delay_penalty`` is a ``ValueError`` (k2 silently ignores it);
- ``get_rnnt_prune_ranges`` warns through ``warnings.warn`` (k2 prints), and a batch whose
  symbols are all empty works (k2 fails its ``R >= 2`` assertion);
- bad arguments raise ``ValueError`` naming them (k2 asserts);
- losses are exact in float64 lattices, for float32 inputs too.
"""
from __future__ import annotations

import torch

from .. import functional, pruned
from ..reference import Ends, arc_weights, kind_log_probs, lattice_dtype

__all__ = ["rnnt_loss", "rnnt_loss_simple", "rnnt_loss_smoothed", "get_rnnt_prune_ranges",
           "do_rnnt_pruning", "rnnt_loss_pruned"]


def _lengths(B: int, T: int, S: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """k2 has no lengths: every sequence spans the padded sizes, ``boundary`` narrows it."""
    return (torch.full((B,), T, dtype=torch.int64, device=device),
            torch.full((B,), S, dtype=torch.int64, device=device))


def _to_k2(gamma_blank: torch.Tensor, gamma_label: torch.Tensor, rnnt_type: str):
    """Our occupations ``(B, T, S+1)`` -> k2's ``(px_grad, py_grad)``."""
    T = gamma_blank.shape[1]
    px = gamma_label[:, :, :-1].transpose(1, 2)                        # (B, S, T)
    if rnnt_type == "regular":
        px = torch.nn.functional.pad(px, (0, 1))                        # (B, S, T+1): no label at T
    return px.contiguous(), gamma_blank.transpose(1, 2).contiguous()    # py: (B, S+1, T)


def _from_k2(px_grad: torch.Tensor, py_grad: torch.Tensor):
    """k2's ``(px_grad, py_grad)`` -> our ``(gamma_blank, gamma_label)`` ``(B, T, S+1)`` and
    whether the lattice is regular (k2 infers it from ``px_grad.shape[-1] == T + 1``)."""
    if px_grad.dim() != 3 or py_grad.dim() != 3:
        raise ValueError(f"px_grad and py_grad must be 3-D, got {tuple(px_grad.shape)} and "
                         f"{tuple(py_grad.shape)}")
    B, S1, T = py_grad.shape
    if px_grad.shape[:2] != (B, S1 - 1) or px_grad.shape[2] not in (T, T + 1):
        raise ValueError(f"px_grad {tuple(px_grad.shape)} must be (B, S, T+1) (regular) or "
                         f"(B, S, T) to match py_grad {tuple(py_grad.shape)} = (B, S+1, T)")
    regular = px_grad.shape[2] == T + 1
    gamma_label = torch.nn.functional.pad(px_grad[:, :, :T], (0, 0, 0, 1)).transpose(1, 2)
    return py_grad.transpose(1, 2), gamma_label, regular


def _occupations(logits, symbols, termination_symbol, boundary, rnnt_type, delay_penalty,
                 node_rows=None, grid=None):
    """Arc occupations ``(gamma_blank, gamma_label)`` ``(B, T, S+1)`` of the (full or
    pruned) lattice, from the one recursion (for ``return_grad``; no gradient)."""
    with torch.no_grad():
        B, T, S1 = grid if grid is not None else logits.shape[:3]
        ll, tl = _lengths(B, T, S1 - 1, logits.device)
        topo = functional._rnnt_topology(rnnt_type)
        from ..topology import regular
        topo = topo or regular()
        ends = Ends.of(ll, tl, boundary)
        V = logits.shape[-1]
        blank = termination_symbol % V
        _, _, lp = kind_log_probs(logits, symbols.to(torch.int64), topo, blank, True, ends,
                                  node_rows=node_rows)
        w = arc_weights(lp.to(lattice_dtype(logits.device)), topo, ends, 0.0, delay_penalty)
        _, gamma = pruned._lattice_of_weights("auto", w.device)(w, topo, ends)
        return gamma[:, 0], gamma[:, 1]


def _with_grad(loss, occ, rnnt_type, return_grad):
    return (loss, _to_k2(*occ, rnnt_type)) if return_grad else loss


def rnnt_loss(logits: torch.Tensor, symbols: torch.Tensor, termination_symbol: int,
              boundary: torch.Tensor | None = None, rnnt_type: str = "regular",
              delay_penalty: float = 0.0, reduction: str = "mean",
              return_grad: bool = False):
    """fast_rnnt's ``rnnt_loss``: ``logits`` ``(B, T, S+1, C)``, ``symbols`` ``(B, S)``.
    Returns the loss (``(B,)`` for ``reduction="none"``), and with ``return_grad`` also
    ``(px_grad, py_grad)``. Computed by :func:`rnnt_lattice.rnnt_loss`."""
    B, T, S1, _ = logits.shape
    ll, tl = _lengths(B, T, S1 - 1, logits.device)
    loss = functional.rnnt_loss(logits, symbols, ll, tl, termination_symbol,
                                reduction=reduction, rnnt_type=rnnt_type,
                                delay_penalty=delay_penalty, boundary=boundary)
    if not return_grad:
        return loss
    occ = _occupations(logits.detach(), symbols, termination_symbol, boundary, rnnt_type,
                       delay_penalty)
    return _with_grad(loss, occ, rnnt_type, True)


def rnnt_loss_simple(lm: torch.Tensor, am: torch.Tensor, symbols: torch.Tensor,
                     termination_symbol: int, boundary: torch.Tensor | None = None,
                     rnnt_type: str = "regular", delay_penalty: float = 0.0,
                     reduction: str = "mean", return_grad: bool = False):
    """fast_rnnt's ``rnnt_loss_simple``: ``lm`` ``(B, S+1, C)``, ``am`` ``(B, T, C)``; the
    joiner ``am + lm`` without building ``(B, T, S+1, C)``
    (:func:`rnnt_lattice.rnnt_loss_simple`)."""
    return _simple_like(pruned.rnnt_loss_simple, lm, am, symbols, termination_symbol,
                        rnnt_type, return_grad, delay_penalty=delay_penalty,
                        boundary=boundary, reduction=reduction)


def rnnt_loss_smoothed(lm: torch.Tensor, am: torch.Tensor, symbols: torch.Tensor,
                       termination_symbol: int, lm_only_scale: float = 0.1,
                       am_only_scale: float = 0.1, boundary: torch.Tensor | None = None,
                       rnnt_type: str = "regular", delay_penalty: float = 0.0,
                       reduction: str = "mean", return_grad: bool = False):
    """fast_rnnt's ``rnnt_loss_smoothed`` (:func:`rnnt_lattice.rnnt_loss_smoothed`)."""
    return _simple_like(pruned.rnnt_loss_smoothed, lm, am, symbols, termination_symbol,
                        rnnt_type, return_grad, lm_only_scale=lm_only_scale,
                        am_only_scale=am_only_scale, delay_penalty=delay_penalty,
                        boundary=boundary, reduction=reduction)


def _simple_like(fn, lm, am, symbols, termination_symbol, rnnt_type, return_grad, **kw):
    """One of our simple losses (``fn``) called the k2 way: full lengths ``(T, S)`` (k2
    takes ragged ones through ``boundary``), occupations in k2's ``(px_grad, py_grad)``
    layout with ``return_grad``."""
    B, T, _ = am.shape
    ll, tl = _lengths(B, T, symbols.shape[1], am.device)
    out = fn(lm, am, symbols, ll, tl, blank=termination_symbol, rnnt_type=rnnt_type,
             return_occupations=return_grad, backend="auto", **kw)
    if not return_grad:
        return out
    loss, occ = out
    return _with_grad(loss, tuple(occ), rnnt_type, True)


def get_rnnt_prune_ranges(px_grad: torch.Tensor, py_grad: torch.Tensor,
                          boundary: torch.Tensor | None, s_range: int) -> torch.Tensor:
    """fast_rnnt's ``get_rnnt_prune_ranges``, reproduced exactly
    (``rnnt_lattice.prune_ranges(method="k2")``): ``ranges`` ``(B, T, R')`` int64, where
    ``R'`` may differ from ``s_range`` (read ``ranges.shape[-1]``)."""
    gamma_blank, gamma_label, regular = _from_k2(px_grad, py_grad)
    B, T, S1 = gamma_blank.shape
    ll, tl = _lengths(B, T, S1 - 1, py_grad.device)
    return pruned.prune_ranges((gamma_blank, gamma_label), s_range, method="k2",
                               logit_lengths=ll, target_lengths=tl, boundary=boundary,
                               rnnt_type="regular" if regular else "modified").ranges


def do_rnnt_pruning(am: torch.Tensor, lm: torch.Tensor, ranges: torch.Tensor):
    """fast_rnnt's ``do_rnnt_pruning``: ``(am (B, T, R, Da), lm (B, T, R, Dl))``."""
    return pruned.do_rnnt_pruning(am, lm, ranges)


def rnnt_loss_pruned(logits: torch.Tensor, symbols: torch.Tensor, ranges: torch.Tensor,
                     termination_symbol: int, boundary: torch.Tensor | None = None,
                     rnnt_type: str = "regular", delay_penalty: float = 0.0,
                     reduction: str = "mean", return_grad: bool = False):
    """fast_rnnt's ``rnnt_loss_pruned``: ``logits`` ``(B, T, R, C)`` on the windows
    ``ranges`` ``(B, T, R)`` (:func:`rnnt_lattice.rnnt_loss_pruned`)."""
    B, T, R, _ = logits.shape
    S = symbols.shape[1]
    ll, tl = _lengths(B, T, S, logits.device)
    loss = functional.rnnt_loss_pruned(logits, symbols, ranges, ll, tl, blank=termination_symbol,
                                       reduction=reduction, rnnt_type=rnnt_type,
                                       delay_penalty=delay_penalty, boundary=boundary)
    if not return_grad:
        return loss
    node_rows = functional.pruned_node_rows(logits, symbols, ranges)
    occ = _occupations(logits.detach().reshape(B * T * R, -1), symbols, termination_symbol,
                       boundary, rnnt_type, delay_penalty, node_rows=node_rows,
                       grid=(B, T, S + 1))
    return _with_grad(loss, occ, rnnt_type, True)
