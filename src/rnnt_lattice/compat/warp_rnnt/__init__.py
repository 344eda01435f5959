"""warp-rnnt's API on rnnt_lattice's kernels: a recipe switches by changing its import,

    import warp_rnnt                          # or: from warp_rnnt import rnnt_loss
    import rnnt_lattice.compat.warp_rnnt as warp_rnnt

Same names, argument names and order, defaults, dtypes, shapes and return values as
warp-rnnt 0.7.0 (``pytorch_binding/warp_rnnt/__init__.py``, docs/variants.md
C.3): ``rnnt_loss``, the autograd Functions ``RNNTLoss`` and ``RNNTLossCompact``, and the
extension module ``_C`` (``import rnnt_lattice.compat.warp_rnnt._C as core``).

``rnnt_loss`` takes **log-probs** (``log_softmax`` already applied; this library's
``fused_log_softmax=False``): ``log_probs`` ``(N, T, U+1, V)`` float32 with labels
``(N, U)``, or with ``compact=True`` the packed rows ``(sum_b T_b (U_b+1), V)`` (any
floating dtype, computed in float32 as warp-rnnt does) with the labels concatenated,
``(sum_b U_b,)``. Labels and lengths are int32. It returns the costs ``(N,)`` for
``reduction="none"``, **the default** (warp-rnnt 0.7.0's signature and README; not "mean"),
else a 0-dim tensor. Its gradient w.r.t. the log-probs is ``-gamma_blank`` at the blank,
``-(1 + fastemit_lambda) gamma_label`` at the label and 0 elsewhere, for every layout.

Differences from warp-rnnt 0.7.0, all deliberate:
- it runs on the CPU too (warp-rnnt is CUDA only);
- the gradient is exact (float64 lattice): warp-rnnt, when its forward and backward
  log-likelihoods differ by more than 1e-3 relative, prints a warning from the kernel,
  zeroes that sample's gradient and reports the mean of the two as its cost;
- ``-inf`` log-probs (masked classes) are exact: warp-rnnt's ``log_sum_exp(-inf, -inf)``
  is NaN; a sequence with no path (``T_b = 0``) costs ``+inf`` with a zero gradient;
- ``gather=True`` gives the same values and gradient as ``gather=False`` and reads only
  each node's blank and label log-prob, without building warp-rnnt's ``(N, T, U+1, 2)``
  index and gathered copy; padding labels need not be valid ids;
- a label equal to ``blank`` is a ``ValueError`` (on CUDA a device-side assert, as
  everywhere in this library; ``_C.rnnt_loss_compact`` reads its labels on the host):
  warp-rnnt's non-gathered kernel overwrites that node's blank gradient with the label's,
  and the compact one drops the label's;
- bad arguments raise ``ValueError`` naming them (warp-rnnt asserts; the checks it makes in
  C++ are also ``RuntimeError`` here, as there); any strides are accepted (warp-rnnt needs
  contiguous tensors); an empty batch's ``"mean"`` is 0, not NaN.
"""
from __future__ import annotations

import torch

from ..._ops import eager_under_compile
from ..._validate import Names
from . import _C
from ._C import (ANY_FLOAT, ArgumentError, check_blank, check_tensors, gathered_targets,
                 log_probs_loss, padded_labels)

__all__ = ["rnnt_loss", "RNNTLoss", "RNNTLossCompact"]

_NAMES = ("log_probs", "labels", "frames_lengths", "labels_lengths")
NAMES = Names(*_NAMES)
# compact=True: the labels come concatenated, (sum_b U_b,); the loss reads them padded.
COMPACT_NAMES = Names("log_probs", "labels (padded to (N, U))",
                      "frames_lengths", "labels_lengths")


class RNNTLoss(torch.autograd.Function):
    """warp-rnnt's autograd Function: ``RNNTLoss.apply(log_probs, labels, frames_lengths,
    labels_lengths, blank=0, fastemit_lambda=0.0)`` -> costs ``(N,)``, through
    :func:`_C.rnnt_loss` (``blank=-1``: gathered log-probs ``(N, T, U+1, 2)``)."""

    @staticmethod
    def forward(ctx, log_probs, labels, frames_lengths, labels_lengths, blank=0,
                fastemit_lambda=0.0):
        costs, grads = _C.rnnt_loss(log_probs, labels, frames_lengths, labels_lengths, blank,
                                    fastemit_lambda)
        ctx.save_for_backward(grads)
        return costs

    @staticmethod
    def backward(ctx, grad_costs):
        (grads,) = ctx.saved_tensors
        return (grads * grad_costs.view(-1, 1, 1, 1).to(grads),) + (None,) * 5


class RNNTLossCompact(torch.autograd.Function):
    """warp-rnnt's autograd Function for the compact layout: ``RNNTLossCompact.apply(
    log_probs (STU, V), labels (SU,), frames_lengths, labels_lengths, blank=0,
    fastemit_lambda=0.0, enable_grad=True)`` -> costs ``(N,)``, through
    :func:`_C.rnnt_loss_compact` and :func:`_C.rnnt_loss_compact_backward`."""

    @staticmethod
    def forward(ctx, log_probs, labels, frames_lengths, labels_lengths, blank=0,
                fastemit_lambda=0.0, enable_grad=True):
        costs, grads, loc = _C.rnnt_loss_compact(log_probs, labels, frames_lengths,
                                                 labels_lengths, blank, fastemit_lambda,
                                                 enable_grad)
        if enable_grad:
            cumlen = torch.cumsum(frames_lengths * (labels_lengths + 1), dim=0, dtype=torch.int32)
            ctx.V, ctx.blank = log_probs.shape[-1], blank
            ctx.save_for_backward(grads, loc, cumlen)
        return costs

    @staticmethod
    def backward(ctx, grad_costs):
        grads, loc, cumlen = ctx.saved_tensors
        grad = _C.rnnt_loss_compact_backward(grad_costs.contiguous(), grads, cumlen, loc, ctx.V,
                                             ctx.blank)
        return (grad,) + (None,) * 6


def _check_options(average_frames, reduction, blank, gather, compact) -> None:
    if average_frames is not None and not isinstance(average_frames, bool):
        raise ArgumentError(f"average_frames must be a bool or None, got {average_frames!r}")
    if reduction is not None and reduction not in ("none", "mean", "sum"):
        raise ArgumentError(f"Unknown reduction method: {reduction!r}, expected to be one of "
                            f"['mean', 'sum', 'none'] (or None)")
    if isinstance(blank, bool) or not isinstance(blank, int):
        raise ArgumentError(f"blank must be an int, got {blank!r}")
    for name, flag in (("gather", gather), ("compact", compact)):
        if not isinstance(flag, bool):
            raise ArgumentError(f"{name} must be a bool, got {flag!r}")


def rnnt_loss(log_probs: torch.Tensor, labels: torch.Tensor, frames_lengths: torch.Tensor,
              labels_lengths: torch.Tensor, average_frames: bool = False,
              reduction: str = "none", blank: int = 0, gather: bool = False,
              fastemit_lambda: float = 0.0, compact: bool = False) -> torch.Tensor:
    """warp-rnnt's ``rnnt_loss`` (:func:`rnnt_lattice.rnnt_loss` with
    ``fused_log_softmax=False``; ``packed=True`` for ``compact``).

    Example::

        >>> import torch
        >>> import rnnt_lattice.compat.warp_rnnt as warp_rnnt
        >>> N, T, U, V = 2, 6, 3, 5
        >>> logits = torch.randn(N, T, U + 1, V, requires_grad=True)      # (N, T, U+1, V)
        >>> labels = torch.randint(1, V, (N, U), dtype=torch.int32)
        >>> frames_lengths = torch.tensor([6, 4], dtype=torch.int32)
        >>> labels_lengths = torch.tensor([3, 2], dtype=torch.int32)
        >>> costs = warp_rnnt.rnnt_loss(logits.log_softmax(-1), labels, frames_lengths,
        ...                             labels_lengths, blank=0)          # (N,): "none"
        >>> costs.mean().backward()

    Args:
        log_probs: log-probs ``(N, T, U+1, V)`` float32; with ``compact=True`` the rows
            ``(sum_b T_b (U_b+1), V)`` of any floating dtype (row ``offset_b + t (U_b+1) + u``,
            :func:`rnnt_lattice.pack_logits`), computed in float32.
        labels: ``(N, U)`` int32; with ``compact=True`` concatenated, ``(sum_b U_b,)``.
        frames_lengths: ``(N,)`` int32 frames ``T_b``.
        labels_lengths: ``(N,)`` int32 labels ``U_b``.
        average_frames: divide each sequence's cost by its ``T_b`` (before the reduction).
        reduction: ``"none"`` or ``None`` -> ``(N,)``; ``"sum"``; ``"mean"`` (over ``N``).
        blank: the blank id in ``[0, V)``; ``-1`` (not with ``gather`` or ``compact``) says
            ``log_probs`` are already gathered, ``(N, T, U+1, 2)`` holding each node's
            ``[blank, label]`` log-probs.
        gather: warp-rnnt's memory saving; here every call reads only the blank and label
            entries, so it changes nothing (same values and gradient).
        fastemit_lambda: FastEmit (the label arcs' gradient times ``1 + lambda``; the cost
            stays ``-log P``).
        compact: the packed layout above.
    """
    _check_options(average_frames, reduction, blank, gather, compact)
    tensors = (log_probs, labels, frames_lengths, labels_lengths)
    int32 = ("a Int tensor", (torch.int32,))
    if compact:
        check_tensors(_NAMES, tensors, (ANY_FLOAT, int32, int32, int32), (2, 1, 1, 1),
                      contiguous=False)
        check_blank(blank, log_probs.shape[1], gathered_ok=False)
        costs = _compact_costs(log_probs, labels, frames_lengths, labels_lengths, blank,
                               fastemit_lambda)
    else:
        check_tensors(_NAMES, tensors, (("a Float tensor", (torch.float32,)), int32, int32, int32),
                      (4, 2, 1, 1), contiguous=False)
        check_blank(blank, log_probs.shape[-1], gathered_ok=not gather)
        targets = gathered_targets(log_probs, labels, "log_probs") if blank == -1 else labels
        costs = log_probs_loss(NAMES, log_probs, targets, frames_lengths, labels_lengths,
                               max(blank, 0), fastemit_lambda)
    if average_frames:
        costs = costs / frames_lengths.to(log_probs)
    if reduction == "sum" or (reduction == "mean" and costs.shape[0] == 0):
        return costs.sum()
    if reduction == "mean":
        return costs.mean()
    return costs


def _compact_costs(log_probs, labels, frames_lengths, labels_lengths, blank, fastemit_lambda):
    """``compact=True``'s costs ``(N,)``: the labels padded (their count read on the host),
    the packed loss on the rows."""
    targets = padded_labels(labels, labels_lengths, names=_NAMES[1::2])
    return log_probs_loss(COMPACT_NAMES, log_probs.float(), targets, frames_lengths,
                          labels_lengths, blank, fastemit_lambda, packed=True)


# The compact layout reads its lengths on the host (the padded labels' width, the rows'
# count): under torch.compile it runs eagerly (a graph break that says why), where
# fullgraph=True failed on a data-dependent guard.
_compact_costs = eager_under_compile(
    _compact_costs, "warp_rnnt's rnnt_loss with compact=True reads the lengths on the host: "
    "it runs eagerly, a graph break; compile without fullgraph=True")
