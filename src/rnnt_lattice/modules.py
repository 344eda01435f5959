"""Thin ``nn.Module`` wrappers over :mod:`rnnt_lattice.functional`."""
from __future__ import annotations

import inspect

import torch

from ._validate import check_tile
from .functional import check_options, multiblank_rnnt_loss, rnnt_loss, tdt_loss
from .fused import fused_multiblank_rnnt_loss, fused_rnnt_loss, fused_tdt_loss

__all__ = ["RNNTLoss", "TDTLoss", "MultiblankRNNTLoss", "FusedRNNTLoss", "FusedTDTLoss",
           "FusedMultiblankRNNTLoss"]


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
                 rnnt_type: str = "regular", delay_penalty: float = 0.0, packed: bool = False,
                 allow_blank_targets: bool = False):
        super().__init__()
        check_options(blank=blank, clamp=clamp, reduction=reduction, fastemit_lambda=fastemit_lambda,
                      backend=backend, rnnt_type=rnnt_type, delay_penalty=delay_penalty,
                      fused_log_softmax=fused_log_softmax, zero_infinity=zero_infinity,
                      inplace_grad=inplace_grad, packed=packed,
                      allow_blank_targets=allow_blank_targets)
        self.packed = packed
        self.allow_blank_targets = allow_blank_targets
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
                         boundary=boundary, packed=self.packed,
                         allow_blank_targets=self.allow_blank_targets)

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


def _keyword_options(fn) -> frozenset:
    """The keyword-only parameters of ``fn`` (the options a module fixes at construction)."""
    return frozenset(n for n, p in inspect.signature(fn).parameters.items()
                     if p.kind is inspect.Parameter.KEYWORD_ONLY)


class _FusedKeywordLoss(torch.nn.Module):
    """A module holding the joiner (a submodule: its parameters are this module's, so an
    optimiser, ``.to()`` and DDP see them) whose forward calls ``_fn(self.joiner, enc, pred,
    targets, logit_lengths, target_lengths, **options)`` with the options fixed at
    construction."""

    _fn = None

    def __init__(self, joiner, **options):
        super().__init__()
        if not callable(joiner):
            raise ValueError(f"joiner must be callable (an nn.Module, typically), got "
                             f"{type(joiner).__name__}")
        known = _keyword_options(type(self)._fn)
        for name in options:
            if name not in known:
                raise TypeError(f"{type(self).__name__} got an unexpected option {name!r}: "
                                f"{type(self)._fn.__name__} takes {', '.join(sorted(known))}")
        check_options(**options)              # at construction, not at the first call
        if options.get("tile") is not None:
            check_tile(options["tile"])
        self.joiner = joiner
        self.options = options

    def forward(self, enc, pred, targets, logit_lengths, target_lengths, **call_options):
        """``enc (B, T, H_enc)``, ``pred (B, U+1, H_pred)``, ``targets (B, U)``,
        ``logit_lengths (B,)``, ``target_lengths (B,)``; ``call_options`` (e.g. ``boundary``)
        join the fixed ones for this call."""
        return type(self)._fn(self.joiner, enc, pred, targets, logit_lengths, target_lengths,
                              **self.options, **call_options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


class FusedRNNTLoss(_FusedKeywordLoss):
    """Module form of :func:`rnnt_lattice.fused_rnnt_loss`: the joiner and the loss fused
    by tiles, the joiner held as a submodule.

    Example::

        >>> import torch, rnnt_lattice
        >>> class Joiner(torch.nn.Module):
        ...     def __init__(self, H, V):
        ...         super().__init__()
        ...         self.out = torch.nn.Linear(H, V)
        ...     def forward(self, e, p):                # (B, t, 1, H), (B, 1, u, H)
        ...         return self.out(torch.tanh(e + p))  # (B, t, u, V)
        >>> criterion = rnnt_lattice.FusedRNNTLoss(Joiner(8, 6), blank=0, reduction="sum")
        >>> enc = torch.randn(2, 5, 8, requires_grad=True)        # (B, T, H)
        >>> pred = torch.randn(2, 3, 8, requires_grad=True)       # (B, U+1, H)
        >>> loss = criterion(enc, pred, torch.tensor([[1, 2], [3, 0]]), torch.tensor([5, 4]),
        ...                  torch.tensor([2, 1]))
        >>> loss.backward()
        >>> criterion.joiner.out.weight.grad.shape
        torch.Size([6, 8])

    Args: ``joiner``, then the keyword options of :func:`rnnt_lattice.fused_rnnt_loss`
    (``blank``, ``tile``, ``reduction``, ...), fixed at construction and checked there.
    """

    _fn = staticmethod(fused_rnnt_loss)

    def __init__(self, joiner, *, blank: int, **options):
        super().__init__(joiner, blank=blank, **options)


class FusedTDTLoss(_FusedKeywordLoss):
    """Module form of :func:`rnnt_lattice.fused_tdt_loss` (``joiner``, then its keyword
    options: ``blank``, ``durations``, ``tile``, ...).

    Example::

        >>> import torch, rnnt_lattice
        >>> joiner = lambda e, p: torch.tanh(e + p)              # V = 7: 4 tokens, 3 durations
        >>> criterion = rnnt_lattice.FusedTDTLoss(joiner, blank=3, durations=[0, 1, 2])
        >>> enc, pred = torch.randn(1, 4, 7, requires_grad=True), torch.randn(1, 2, 7)
        >>> criterion(enc, pred, torch.tensor([[1]]), torch.tensor([4]), torch.tensor([1])).backward()
    """

    _fn = staticmethod(fused_tdt_loss)

    def __init__(self, joiner, *, blank: int, durations, **options):
        check_options(durations=durations)
        super().__init__(joiner, blank=blank, durations=list(durations), **options)


class FusedMultiblankRNNTLoss(_FusedKeywordLoss):
    """Module form of :func:`rnnt_lattice.fused_multiblank_rnnt_loss` (``joiner``, then its
    keyword options: ``blank``, ``big_blank_durations``, ``tile``, ...).

    Example::

        >>> import torch, rnnt_lattice
        >>> joiner = lambda e, p: e + p                          # V = 6: blank 5, big blanks 3, 4
        >>> criterion = rnnt_lattice.FusedMultiblankRNNTLoss(joiner, blank=5, big_blank_durations=[2, 3])
        >>> enc, pred = torch.randn(1, 6, 6, requires_grad=True), torch.randn(1, 3, 6)
        >>> criterion(enc, pred, torch.tensor([[1, 2]]), torch.tensor([6]), torch.tensor([2])).backward()
    """

    _fn = staticmethod(fused_multiblank_rnnt_loss)

    def __init__(self, joiner, *, blank: int, big_blank_durations, **options):
        check_options(big_blank_durations=big_blank_durations)
        super().__init__(joiner, blank=blank, big_blank_durations=list(big_blank_durations),
                         **options)
