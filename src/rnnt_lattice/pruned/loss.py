"""The pruned loss (Kuang et al. 2022; math.md sections 7 and 9): the full joiner's loss on
its window logits ``(B, T, R, V)``, through the same Function and kernels as
:func:`rnnt_lattice.rnnt_loss`; the windows are a node -> row layout
(``_layout.pruned_node_rows``)."""
from __future__ import annotations

import torch

from .._layout import pruned_node_rows
from .._validate import check_flag, check_inplace, check_window_args, tracing
from ..functional import logits_loss
from ..topology import by_name

__all__ = ["rnnt_loss_pruned"]


def rnnt_loss_pruned(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ranges: torch.Tensor,
    logit_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    *,
    blank: int,
    clamp: float = -1.0,
    reduction: str = "mean",
    fastemit_lambda: float = 0.0,
    zero_infinity: bool = False,
    backend: str = "auto",
    inplace_grad: bool = False,
    rnnt_type: str = "regular",
    delay_penalty: float = 0.0,
    boundary: torch.Tensor | None = None,
    allow_blank_targets: bool = False,
) -> torch.Tensor:
    r"""Pruned RNN-T loss (Kuang et al. 2022; docs/math.md sections 7 and 9): the loss of
    the full lattice with every arc outside the windows removed, on logits evaluated only
    inside the windows.

    ``logits`` is ``(B, T, R, V)``: row ``k`` of frame ``t`` is node ``(t, ranges[b, t, k])``.
    A node outside its frame's window has no logits, so every arc leaving it weighs
    ``-inf`` (k2's semantics); the recursion, the fused gradient and every option are those
    of :func:`rnnt_loss` (it is the same kernel, reading rows through a node -> row map).
    With ``R = U + 1`` and windows starting at 0 it *is* :func:`rnnt_loss`.

    Example::

        >>> import torch, rnnt_lattice
        >>> B, T, U, V, R = 2, 6, 4, 8, 3
        >>> s_begin = torch.tensor([[0, 0, 1, 1, 2, 2], [0, 1, 1, 2, 2, 2]])     # (B, T)
        >>> ranges = s_begin[..., None] + torch.arange(R)                        # (B, T, R)
        >>> logits = torch.randn(B, T, R, V, requires_grad=True)                 # the joiner on the windows
        >>> targets = torch.randint(1, V, (B, U))
        >>> loss = rnnt_lattice.rnnt_loss_pruned(logits, targets, ranges, torch.tensor([6, 6]),
        ...                                      torch.tensor([4, 4]), blank=0)
        >>> loss.backward()

    Args:
        logits: ``(B, T, R, V)`` the joiner's output on the windows.
        targets: ``(B, U)`` label ids (``U`` sets the lattice's label axis).
        ranges: ``(B, T, R)`` int label positions of each window row, strictly increasing
            along ``R`` and within ``[0, U]`` (k2's ``ranges``, e.g. from ``prune_ranges``).
        logit_lengths, target_lengths, blank, clamp, reduction, fastemit_lambda,
            zero_infinity, backend, inplace_grad, rnnt_type, delay_penalty, boundary,
            allow_blank_targets: as :func:`rnnt_loss`.

    Windows that hold no complete path give ``+inf`` (0 with ``zero_infinity``), as a too
    small ``R`` does in k2.
    """
    # (On the device the windows are checked there: NaN rows for the sequences whose windows
    # break the rule, added to the loss's own, and a device-side assert, queued by check_call
    # once every host rule of the call has passed.)
    ranges, bad_windows = check_window_args(logits, targets, ranges)
    node_rows = pruned_node_rows(logits, targets, ranges)
    B, T, R, V = logits.shape
    if check_flag("inplace_grad", inplace_grad) and not tracing(logits):   # (traced: no effect)
        # On the window logits as given: the reshape to rows would copy strided ones, and the
        # gradient would be written over the copy.
        check_inplace(logits, True)
    return logits_loss(logits.reshape(B * T * R, V), targets, logit_lengths, target_lengths, blank,
                 by_name(rnnt_type), clamp=clamp, reduction=reduction, fused=True,
                 fastemit_lambda=fastemit_lambda, zero_infinity=zero_infinity, backend=backend,
                 inplace_grad=inplace_grad, delay_penalty=delay_penalty, boundary=boundary,
                 node_rows=node_rows, allow_blank_targets=allow_blank_targets,
                 device_rules=(("ranges", bad_windows),))
