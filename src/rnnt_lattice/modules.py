"""Thin ``nn.Module`` wrappers over :mod:`rnnt_lattice.functional`."""
from __future__ import annotations

import torch

from .functional import check_options, multiblank_rnnt_loss, rnnt_loss, tdt_loss

__all__ = ["RNNTLoss", "TDTLoss", "MultiblankRNNTLoss"]


class RNNTLoss(torch.nn.Module):
    """Module form of :func:`rnnt_lattice.rnnt_loss`, like ``torchaudio.transforms.RNNTLoss``.

    Example::

        >>> import torch, rnnt_lattice
        >>> criterion = rnnt_lattice.RNNTLoss(blank=0, reduction="sum")
        >>> logits = torch.randn(1, 5, 3, 6, requires_grad=True)    # (B, T, U+1, V)
        >>> loss = criterion(logits, torch.tensor([[1, 2]]), torch.tensor([5]), torch.tensor([2]))
        >>> loss.backward()

    Args: the options of :func:`rnnt_lattice.rnnt_loss`, fixed at construction.
    Forward args: ``logits (B, T, U+1, V)`` (rows ``(sum_b T_b (U_b+1), V)`` with
    ``packed=True``), ``targets (B, U)``, ``logit_lengths (B,)``,
    ``target_lengths (B,)``.
    """

    def __init__(self, blank: int = -1, clamp: float = -1.0, reduction: str = "mean",
                 fused_log_softmax: bool = True, *, fastemit_lambda: float = 0.0,
                 zero_infinity: bool = False, backend: str = "auto", inplace_grad: bool = False,
                 rnnt_type: str = "regular", delay_penalty: float = 0.0, packed: bool = False):
        super().__init__()
        check_options(blank=blank, clamp=clamp, reduction=reduction, fastemit_lambda=fastemit_lambda,
                      backend=backend, rnnt_type=rnnt_type, delay_penalty=delay_penalty)
        self.packed = packed
        self.rnnt_type = rnnt_type
        self.delay_penalty = delay_penalty
        self.blank = blank
        self.clamp = clamp
        self.reduction = reduction
        self.fused_log_softmax = fused_log_softmax
        self.fastemit_lambda = fastemit_lambda
        self.zero_infinity = zero_infinity
        self.backend = backend
        self.inplace_grad = inplace_grad

    def forward(self, logits, targets, logit_lengths, target_lengths, boundary=None):
        return rnnt_loss(logits, targets, logit_lengths, target_lengths, self.blank, self.clamp,
                         self.reduction, self.fused_log_softmax,
                         fastemit_lambda=self.fastemit_lambda, zero_infinity=self.zero_infinity,
                         backend=self.backend, inplace_grad=self.inplace_grad,
                         rnnt_type=self.rnnt_type, delay_penalty=self.delay_penalty,
                         boundary=boundary, packed=self.packed)

    def extra_repr(self) -> str:
        return (f"blank={self.blank}, clamp={self.clamp}, reduction={self.reduction!r}, "
                f"fused_log_softmax={self.fused_log_softmax}, fastemit_lambda={self.fastemit_lambda}, "
                f"zero_infinity={self.zero_infinity}, backend={self.backend!r}, "
                f"inplace_grad={self.inplace_grad}, rnnt_type={self.rnnt_type!r}, "
                f"delay_penalty={self.delay_penalty}, packed={self.packed}")


class _KeywordLoss(torch.nn.Module):
    """A module whose forward calls ``_fn(logits, targets, logit_lengths, target_lengths,
    **options)`` with the options fixed at construction."""

    _fn = None

    def __init__(self, **options):
        super().__init__()
        check_options(**options)              # at construction, not at the first call
        self.options = options

    def forward(self, logits, targets, logit_lengths, target_lengths):
        return type(self)._fn(logits, targets, logit_lengths, target_lengths, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


class TDTLoss(_KeywordLoss):
    """Module form of :func:`rnnt_lattice.tdt_loss` (its keyword options, fixed here).

    Example::

        >>> import torch, rnnt_lattice
        >>> criterion = rnnt_lattice.TDTLoss(blank=3, durations=[0, 1, 2], sigma=0.05, backend="torch")
        >>> loss = criterion(torch.zeros(1, 3, 2, 7), torch.tensor([[0]]), torch.tensor([3]), torch.tensor([1]))
    """

    _fn = staticmethod(tdt_loss)

    def __init__(self, *, blank: int, durations, **options):
        check_options(durations=durations)
        super().__init__(blank=blank, durations=list(durations), **options)


class MultiblankRNNTLoss(_KeywordLoss):
    """Module form of :func:`rnnt_lattice.multiblank_rnnt_loss` (its keyword options).

    Example::

        >>> import torch, rnnt_lattice
        >>> criterion = rnnt_lattice.MultiblankRNNTLoss(blank=6, big_blank_durations=[2, 4], backend="torch")
        >>> loss = criterion(torch.randn(1, 8, 3, 7), torch.tensor([[1, 2]]), torch.tensor([8]), torch.tensor([2]))
    """

    _fn = staticmethod(multiblank_rnnt_loss)

    def __init__(self, *, blank: int, big_blank_durations, **options):
        check_options(big_blank_durations=big_blank_durations)
        super().__init__(blank=blank, big_blank_durations=list(big_blank_durations), **options)
