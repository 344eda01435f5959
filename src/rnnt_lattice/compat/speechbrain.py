"""SpeechBrain's transducer loss on rnnt_lattice's kernels: a recipe switches by changing
one import (or one line of its hparams YAML),

    from speechbrain.nnet.losses import transducer_loss               # before
    from rnnt_lattice.compat.speechbrain import transducer_loss       # after

    compute_cost: !name:rnnt_lattice.compat.speechbrain.transducer_loss

Same names, argument order, defaults, value convention and reductions as SpeechBrain
(``speechbrain.nnet.losses.transducer_loss`` and the class
``speechbrain.integrations.numba.transducer_loss.TransducerLoss``,
docs/variants.md C.5):

- ``logits`` ``(B, T, U+1, V)`` are raw logits (SpeechBrain applies ``log_softmax`` itself;
  log-probs work too, ``log_softmax`` leaving them unchanged);
- ``transducer_loss`` takes **relative** lengths in ``[0, 1]``: ``T_b = round(input_lens[b]
  * T)`` and ``U_b = round(target_lens[b] * U)`` (``targets`` ``(B, U)``), as SpeechBrain
  computes them; ``TransducerLoss`` takes absolute lengths;
- the value of sequence ``b`` is ``-log P(y_b|x_b) / T_b``, the negative log-likelihood per
  frame (SpeechBrain's kernel normalises by the number of frames);
- ``reduction``: ``"mean"`` (over the batch), ``"sum"`` or ``"none"`` (``(B,)``).

Differences from SpeechBrain, all deliberate:
- **the gradient is the exact gradient of the returned value.** SpeechBrain returns
  ``-log P / T_b`` but back-propagates the gradient of ``-log P`` (not divided by
  ``T_b``), and for ``"mean"`` the gradient of the *sum* over the batch (not divided by
  ``B``, SpeechBrain issue #875): its updates are ``T_b`` (``"mean"``: ``B T_b``) times
  larger than its loss says. Here the loss and its gradient agree, so a recipe tuned on
  SpeechBrain sees gradients smaller by those factors (scale the learning rate, or
  the loss, accordingly);
- CPU and CUDA tensors both work (SpeechBrain: CUDA only);
- bad arguments raise ``ValueError`` naming them (SpeechBrain: ``Exception`` for an unknown
  reduction, including the ``"batchmean"`` its docstring lists), relative lengths that round
  to more frames or labels than the padded size, or to fewer than 0, included (on CUDA a
  device-side assert, like every value check);
- a sequence with ``T_b = 0`` (or no alignment) gives ``+inf`` with a zero gradient.
"""
from __future__ import annotations

import torch

from .. import functional
from .._validate import Names, may_read_values

__all__ = ["transducer_loss", "TransducerLoss"]

_REDUCTIONS = ("mean", "sum", "none")

# The messages name the tensors as SpeechBrain's signatures do. The function's relative
# lengths become the frame and label counts the loss checks (on the device, where the host
# did not read the relative ones): named as what they are.
FUNCTION_NAMES = Names("logits", "targets", "round(input_lens * T)", "round(target_lens * U)",
                       blank="blank_index")
MODULE_NAMES = Names("logits", "labels", "T", "U")


def transducer_loss(logits: torch.Tensor, targets: torch.Tensor, input_lens: torch.Tensor,
                    target_lens: torch.Tensor, blank_index: int,
                    reduction: str = "mean") -> torch.Tensor:
    """``speechbrain.nnet.losses.transducer_loss``: the transducer loss per frame,
    ``-log P(y|x) / T_b``, with relative lengths.

    Example::

        >>> import torch
        >>> from rnnt_lattice.compat.speechbrain import transducer_loss
        >>> logits = torch.randn(2, 10, 4, 6, requires_grad=True)          # (B, T, U+1, V)
        >>> targets = torch.tensor([[1, 2, 3], [4, 5, 0]])
        >>> wav_lens, tokens_lens = torch.tensor([1.0, 0.8]), torch.tensor([1.0, 2 / 3])
        >>> loss = transducer_loss(logits, targets, wav_lens, tokens_lens, blank_index=0)
        >>> loss.backward()

    Args:
        logits: ``(B, T, U+1, V)`` joiner output (raw logits).
        targets: ``(B, U)`` int label ids, without blanks.
        input_lens: ``(B,)`` relative frame counts in ``[0, 1]`` (``T_b / T``).
        target_lens: ``(B,)`` relative label counts in ``[0, 1]`` (``U_b / U``).
        blank_index: the blank id.
        reduction: ``"mean"`` (over the batch), ``"sum"`` or ``"none"`` (``(B,)``).

    Returns:
        ``-log P / T_b`` reduced as asked: a scalar, or ``(B,)`` for ``"none"``.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 4 \
            or not isinstance(targets, torch.Tensor) or targets.dim() != 2:
        raise ValueError("logits must be a (B, T, U+1, V) tensor and targets a (B, U) tensor, got "
                         f"{_describe(logits)} and {_describe(targets)}")
    T_b = _absolute("input_lens", input_lens, logits.shape[1])
    U_b = _absolute("target_lens", target_lens, targets.shape[1])
    return _per_frame(logits, targets, T_b, U_b, blank_index, reduction, FUNCTION_NAMES)


class TransducerLoss(torch.nn.Module):
    """``speechbrain.integrations.numba.transducer_loss.TransducerLoss``: the loss per frame
    ``-log P / T_b`` with **absolute** lengths, on CPU or CUDA.

    Example::

        >>> import torch
        >>> from rnnt_lattice.compat.speechbrain import TransducerLoss
        >>> criterion = TransducerLoss(blank=0)
        >>> logits = torch.randn(1, 2, 3, 5, requires_grad=True)          # (B, T, U+1, V)
        >>> loss = criterion(logits, torch.tensor([[1, 2]]), torch.tensor([2]), torch.tensor([2]))
        >>> loss.backward()

    Args: ``blank=0``, ``reduction="mean"`` (as :func:`transducer_loss`). Forward args:
    ``logits (B, T, U+1, V)``, ``labels (B, U)``, ``T (B,)`` frames and ``U (B,)`` labels
    per sequence.
    """

    def __init__(self, blank: int = 0, reduction: str = "mean"):
        super().__init__()
        self.blank = blank
        self.reduction = reduction

    def forward(self, logits, labels, T, U):
        return _per_frame(logits, labels, T, U, self.blank, self.reduction, MODULE_NAMES)

    def extra_repr(self) -> str:
        return f"blank={self.blank}, reduction={self.reduction!r}"


def _describe(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _absolute(name: str, rel: torch.Tensor, size: int) -> torch.Tensor:
    """SpeechBrain's ``(rel * size).round().int()``; on CPU, a count outside ``[0, size]``
    (a relative length off ``[0, 1]`` by more than the rounding: absolute lengths passed by
    mistake, too) is a ``ValueError`` (on CUDA the loss's device-side assert, naming the
    counts ``round(input_lens * T)``). An integer or bool tensor is taken as SpeechBrain
    takes it (its 0s and 1s are relative lengths)."""
    if not isinstance(rel, torch.Tensor) or rel.is_complex():
        raise ValueError(f"{name} must be a tensor of relative lengths in [0, 1], got "
                         + (str(rel.dtype) if isinstance(rel, torch.Tensor) else type(rel).__name__))
    if not rel.is_floating_point():
        rel = rel.to(torch.float32)
    counts = (rel * size).round()
    if rel.numel() and may_read_values(rel):
        bad = ~((counts >= 0) & (counts <= size))          # NaN included
        if bool(bad.any()):
            b = int(bad.reshape(-1).nonzero()[0, 0])
            raise ValueError(f"{name} must be relative lengths in [0, 1] (length / padded size "
                             f"{size}), got {name}[{b}] = {float(rel.reshape(-1)[b])}")
    return counts.int()


def _per_frame(logits, targets, T_b, U_b, blank, reduction, names: Names) -> torch.Tensor:
    """``-log P / T_b`` per sequence, reduced; its gradient is autograd's, so exact."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    costs = functional.rnnt_costs_named(names, logits, targets, T_b, U_b, blank)
    # T_b = 0 has no alignment: +inf / 1 keeps +inf and a zero gradient (0 would give NaN).
    costs = costs / T_b.to(device=costs.device, dtype=costs.dtype).clamp(min=1)
    if reduction == "none":
        return costs
    if reduction == "sum" or costs.shape[0] == 0:
        return costs.sum()                  # an empty batch: "mean" is 0, not 0/0
    return costs.mean()
