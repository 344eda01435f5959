"""Thin ``nn.Module`` wrappers over :mod:`rnnt_lattice.functional`."""
from __future__ import annotations

import torch

from .functional import rnnt_loss

__all__ = ["RNNTLoss"]


class RNNTLoss(torch.nn.Module):
    """Module form of :func:`rnnt_lattice.rnnt_loss`, like ``torchaudio.transforms.RNNTLoss``.

    Example::

        >>> import torch, rnnt_lattice
        >>> criterion = rnnt_lattice.RNNTLoss(blank=0, reduction="sum")
        >>> logits = torch.randn(1, 5, 3, 6, requires_grad=True)    # (B, T, U+1, V)
        >>> loss = criterion(logits, torch.tensor([[1, 2]]), torch.tensor([5]), torch.tensor([2]))
        >>> loss.backward()

    Args: the options of :func:`rnnt_lattice.rnnt_loss`, fixed at construction.
    Forward args: ``logits (B, T, U+1, V)``, ``targets (B, U)``, ``logit_lengths (B,)``,
    ``target_lengths (B,)``.
    """

    def __init__(self, blank: int = -1, clamp: float = -1.0, reduction: str = "mean",
                 fused_log_softmax: bool = True, *, fastemit_lambda: float = 0.0,
                 zero_infinity: bool = False, backend: str = "auto", inplace_grad: bool = False):
        super().__init__()
        self.blank = blank
        self.clamp = clamp
        self.reduction = reduction
        self.fused_log_softmax = fused_log_softmax
        self.fastemit_lambda = fastemit_lambda
        self.zero_infinity = zero_infinity
        self.backend = backend
        self.inplace_grad = inplace_grad

    def forward(self, logits, targets, logit_lengths, target_lengths):
        return rnnt_loss(logits, targets, logit_lengths, target_lengths, self.blank, self.clamp,
                         self.reduction, self.fused_log_softmax,
                         fastemit_lambda=self.fastemit_lambda, zero_infinity=self.zero_infinity,
                         backend=self.backend, inplace_grad=self.inplace_grad)

    def extra_repr(self) -> str:
        return (f"blank={self.blank}, clamp={self.clamp}, reduction={self.reduction!r}, "
                f"fused_log_softmax={self.fused_log_softmax}, fastemit_lambda={self.fastemit_lambda}, "
                f"zero_infinity={self.zero_infinity}, backend={self.backend!r}, "
                f"inplace_grad={self.inplace_grad}")
