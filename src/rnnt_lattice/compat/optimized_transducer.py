"""optimized_transducer's API on rnnt_lattice's kernels: a recipe switches by changing its
import,

    import optimized_transducer
    import rnnt_lattice.compat.optimized_transducer as optimized_transducer

Same names, argument names and order, defaults, dtypes, shapes and return values as
optimized_transducer 1.4 (docs/variants.md C.2): ``transducer_loss`` and
``TransducerLoss``. The logits are packed rows ``(sum_b T_b (U_b+1), V)``, float32 and
contiguous, row ``offset_b + t (U_b+1) + u`` holding node ``(t, u)`` of sequence ``b``
(:func:`rnnt_lattice.pack_logits` builds them from ``(B, T, U+1, V)``); ``targets``
``(B, max_b U_b)`` and the lengths ``(B,)`` are int32. The result is a 0-dim tensor:
``"mean"`` is the sum over the batch divided by ``B``, ``"sum"`` the sum.

``from_log_softmax=False`` fuses the log-softmax and, as in optimized_transducer, writes
the gradient over the logits buffer (:func:`rnnt_lattice.rnnt_loss` with
``inplace_grad=True``): no gradient-sized allocation. The logits' values are gone once the
loss is computed, and ``logits.grad`` (or the gradient flowing into the joiner) shares their
memory. Unlike optimized_transducer, the overwrite bumps the logits' version counter, so
autograd refuses any other use of them (an op that saved them for its backward, a second
backward) instead of silently reading the gradient as logits. ``from_log_softmax=True``
takes log-probs and leaves them alone.

Differences from optimized_transducer 1.4, all deliberate:
- ``TransducerLoss`` is a working ``nn.Module`` (its ``__init__`` never calls
  ``super().__init__()``, so calling it raises ``AttributeError: ... '_backward_hooks'``);
- ``one_sym_per_frame=True`` with ``T_b < U_b + 1`` and any ``T_b = 0`` give ``+inf`` with
  a zero gradient (it raises "total scores ... are not equal" for the first and crashes the
  process for the second);
- a label equal to ``blank`` is a ``ValueError`` (on CPU, as everywhere in this library):
  optimized_transducer silently drops that label arc's gradient;
- the sums over paths are exact (its log-sum-exp drops terms below ``FLT_EPSILON``), in a
  float64 lattice;
- bad arguments raise ``ValueError`` naming them (it raises ``RuntimeError`` from C++ and
  ``AssertionError`` for ``reduction``).
"""
from __future__ import annotations

import torch

from .. import rnnt_loss as lattice_rnnt_loss
from .._ops import eager_under_compile
from .._validate import check_flag, check_int, check_tensors, check_values_held

__all__ = ["transducer_loss", "TransducerLoss"]

_REDUCTIONS = ("mean", "sum")


def _check(logits, targets, logit_lengths, target_lengths, blank, from_log_softmax,
           one_sym_per_frame, reduction) -> int:
    """optimized_transducer's argument contract, as ValueErrors naming the argument. The
    rest (lengths against the rows, target ids, devices) is :func:`rnnt_lattice.rnnt_loss`'s."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be 'mean' or 'sum' (optimized_transducer has no "
                         f"'none'; rnnt_lattice.rnnt_loss(..., packed=True, reduction='none') "
                         f"gives per-sequence losses), got {reduction!r}")
    check_flag("from_log_softmax", from_log_softmax)
    check_flag("one_sym_per_frame", one_sym_per_frame)
    tensors = (("logits", logits, 2, torch.float32), ("targets", targets, 2, torch.int32),
               ("logit_lengths", logit_lengths, 1, torch.int32),
               ("target_lengths", target_lengths, 1, torch.int32))
    check_tensors(*((name, x) for name, x, _, _ in tensors))
    for name, x, dim, dtype in tensors:
        if x.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} (as in optimized_transducer), got "
                             f"{x.dtype} of shape {tuple(x.shape)}")
        if x.dim() != dim:
            raise ValueError(f"{name} must have {dim} dims, got shape {tuple(x.shape)}")
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous (as in optimized_transducer: the logits "
                             f"buffer receives the gradient), got shape {tuple(x.shape)} with "
                             f"strides {x.stride()}")
    if target_lengths.shape != logit_lengths.shape:
        raise ValueError(f"logit_lengths {tuple(logit_lengths.shape)} and target_lengths "
                         f"{tuple(target_lengths.shape)} must have the same shape (B,)")
    V = logits.shape[1]
    # an int, a NumPy int or a one-element int tensor, as optimized_transducer's binding takes
    blank = check_int("blank", blank)
    if not 0 <= blank < V:
        raise ValueError(f"blank must be an int in [0, V) = [0, {V}) for logits "
                         f"{tuple(logits.shape)}, got {blank!r}")
    check_values_held("transducer_loss reads the lengths' values (the packed rows' layout "
                      "depends on them)", ("logits", logits), ("logit_lengths", logit_lengths),
                      ("target_lengths", target_lengths))
    if target_lengths.numel():
        U_max = int(target_lengths.max())          # one host read, as optimized_transducer's
        if targets.shape[1] != U_max:
            raise ValueError(f"targets {tuple(targets.shape)} must have max(target_lengths) = "
                             f"{U_max} columns (optimized_transducer's rule)")
    return blank


def transducer_loss(logits: torch.Tensor, targets: torch.Tensor, logit_lengths: torch.Tensor,
                    target_lengths: torch.Tensor, blank: int, from_log_softmax: bool,
                    one_sym_per_frame: bool = False, reduction: str = "mean") -> torch.Tensor:
    """optimized_transducer's ``transducer_loss`` (:func:`rnnt_lattice.rnnt_loss` with
    ``packed=True``).

    Example::

        >>> import torch
        >>> import rnnt_lattice.compat.optimized_transducer as optimized_transducer
        >>> T_b, U_b = torch.tensor([4, 3], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32)
        >>> logits = torch.randn(4 * 3 + 3 * 2, 5, requires_grad=True)   # (sum_b T_b (U_b+1), V)
        >>> targets = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)   # (B, max_b U_b)
        >>> loss = optimized_transducer.transducer_loss(logits, targets, T_b, U_b, blank=0,
        ...                                             from_log_softmax=False)
        >>> loss.backward()

    Args:
        logits: ``(sum_b T_b (U_b+1), V)`` float32, contiguous: raw joiner outputs
            (``from_log_softmax=False``; overwritten by the gradient when they require it)
            or log-probs (``True``).
        targets: ``(B, max_b U_b)`` int32 label ids (exactly ``max(target_lengths)`` columns).
        logit_lengths: ``(B,)`` int32 frames ``T_b``.
        target_lengths: ``(B,)`` int32 labels ``U_b`` (the blank not counted).
        blank: the blank id, ``0 <= blank < V``.
        from_log_softmax: whether ``logits`` already are log-probs.
        one_sym_per_frame: at most one label per frame: a label moves ``(t, u) -> (t+1, u+1)``
            and the final blank from ``(T_b-1, U_b)`` is mandatory (``rnnt_type=
            "one_sym_per_frame"``; needs ``T_b >= U_b + 1``, else ``+inf``).
        reduction: ``"mean"`` (sum / B) or ``"sum"``.

    Returns:
        A 0-dim float32 tensor.
    """
    blank = _check(logits, targets, logit_lengths, target_lengths, blank, from_log_softmax,
                   one_sym_per_frame, reduction)
    return lattice_rnnt_loss(
        logits, targets, logit_lengths, target_lengths, blank, reduction=reduction,
        fused_log_softmax=not from_log_softmax,
        # optimized_transducer's memory saving: the gradient goes into the logits buffer.
        inplace_grad=not from_log_softmax,
        rnnt_type="one_sym_per_frame" if one_sym_per_frame else "regular", packed=True)


# Its layout's checks read the lengths on the host (max(target_lengths), as
# optimized_transducer does), and the packed loss runs eagerly anyway: under torch.compile
# the whole call does (a graph break that says why), where fullgraph=True failed on a
# data-dependent guard.
transducer_loss = eager_under_compile(
    transducer_loss, "optimized_transducer's transducer_loss reads the lengths on the host "
    "(its packed layout): it runs eagerly, a graph break; compile without fullgraph=True")


class TransducerLoss(torch.nn.Module):
    """optimized_transducer's ``TransducerLoss(blank, reduction="mean")``; its ``forward``
    takes ``(logits, targets, logit_lengths, target_lengths, from_log_softmax,
    one_sym_per_frame=False)`` as :func:`transducer_loss` does.

    Example::

        >>> import torch
        >>> import rnnt_lattice.compat.optimized_transducer as optimized_transducer
        >>> criterion = optimized_transducer.TransducerLoss(blank=0, reduction="sum")
        >>> logits = torch.randn(3 * 2, 4, requires_grad=True)            # T = 3, U = 1
        >>> loss = criterion(logits, torch.tensor([[2]], dtype=torch.int32),
        ...                  torch.tensor([3], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
        ...                  from_log_softmax=False)
        >>> loss.backward()
    """

    def __init__(self, blank: int, reduction: str = "mean"):
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        self.blank = blank
        self.reduction = reduction

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, logit_lengths: torch.Tensor,
                target_lengths: torch.Tensor, from_log_softmax: bool,
                one_sym_per_frame: bool = False) -> torch.Tensor:
        return transducer_loss(logits, targets, logit_lengths, target_lengths, self.blank,
                               from_log_softmax, one_sym_per_frame, self.reduction)

    def extra_repr(self) -> str:
        return f"blank={self.blank}, reduction={self.reduction!r}"
