"""warprnnt-numba's RNN-T loss on rnnt_lattice's kernels. A script switches by changing its
import,

    from warprnnt_numba import RNNTLossNumba
    from rnnt_lattice.compat.warprnnt_numba import RNNTLossNumba

(and likewise ``from warprnnt_numba.rnnt_loss.rnnt_pytorch import rnnt_loss``, ``from
warprnnt_numba.rnnt_loss.rnnt_atomic_locks import RNNTLossNumbaAtomicLock`` and ``from
warprnnt_numba import numba_utils``: each name comes from this module).

warprnnt-numba (0.4.1) is NeMo's numba RNN-T loss published on its own, so this module is
:class:`rnnt_lattice.compat.nemo.RNNTLossNumba` with warprnnt-numba's conventions where the
two differ:

- the costs come back in the dtype of ``acts`` (NeMo's: float32);
- ``RNNTLossNumbaAtomicLock``, the variant with another CUDA kernel schedule, is the same
  loss and the same class here.

Everything else is NeMo's (docs/migrating.md, "warprnnt-numba"): ``acts`` are the joiner's
raw logits ``(B, T, U+1, V)``; ``labels`` ``(B, U)``, ``act_lens`` and ``label_lens``
``(B,)`` int32, as warprnnt-numba requires (int64 is accepted too); the reported cost is
``(1 + fastemit_lambda) * (-log P)`` with the FastEmit gradient; ``'sum'`` and ``'mean'``
(the sum divided by ``B``) return shape ``(1,)``, ``None`` or ``'none'`` shape ``(B,)``;
``clamp > 0`` clips the gradient w.r.t. the logits to ``[-clamp, clamp]``. The deliberate
differences are NeMo's: every one of :mod:`rnnt_lattice.compat.nemo`'s applies, among them a
label equal to the blank is a ``ValueError`` (warprnnt-numba's README example passes the blank
as a first "BOS" label, which its kernels read as an emission of the blank's class), an
unknown ``reduction`` is a ``ValueError``, ``clamp`` acts on each sequence's gradient before
the upstream gradient on CPU too, and ``acts`` may be padded past the longest sequence.
"""
from __future__ import annotations

import torch

from .. import nemo as _nemo
from ..._validate import check_float
from . import numba_utils
from .numba_utils import __NUMBA_MINIMUM_VERSION__

__all__ = ["rnnt_loss", "RNNTLossNumba", "RNNTLossNumbaAtomicLock", "numba_utils",
           "__NUMBA_MINIMUM_VERSION__"]


def rnnt_loss(acts, labels, act_lens, label_lens, blank=0, reduction='mean',
              fastemit_lambda: float = 0.0, clamp: float = 0.0):
    """warprnnt-numba's functional RNN-T loss (``warprnnt_numba.rnnt_loss.rnnt_pytorch``):
    ``acts`` ``(B, T, U+1, V)`` raw logits, ``labels`` ``(B, U)``, ``act_lens`` and
    ``label_lens`` ``(B,)``, int32 or int64. Returns the ``(1 + fastemit_lambda)``-scaled
    costs in the dtype of ``acts``: ``(B,)``, or ``(1,)`` for ``'sum'``/``'mean'``
    (``'mean'`` = sum / B). ``clamp`` must be ``>= 0`` (``0``: off)."""
    return _nemo._rnnt(acts, labels, act_lens, label_lens, blank, reduction,
                       check_float("fastemit_lambda", fastemit_lambda),
                       _nemo._check_clamp(clamp), cost_dtype=None)


class RNNTLossNumba(_nemo.RNNTLossNumba):
    """warprnnt-numba's ``RNNTLossNumba(blank=0, reduction='mean', fastemit_lambda=0.0,
    clamp=-1)``.

    Example::

        >>> import torch
        >>> from rnnt_lattice.compat.warprnnt_numba import RNNTLossNumba
        >>> loss_fn = RNNTLossNumba(blank=4, reduction='none', fastemit_lambda=0.0, clamp=0.0)
        >>> acts = torch.randn(2, 8, 5, 5, dtype=torch.float64, requires_grad=True)
        >>> labels = torch.tensor([[1, 1, 3, 0], [2, 2, 3, 1]], dtype=torch.int32)
        >>> cost = loss_fn(acts, labels, torch.tensor([5, 8], dtype=torch.int32),
        ...                torch.tensor([3, 4], dtype=torch.int32))
        >>> tuple(cost.shape), cost.dtype
        ((2,), torch.float64)
        >>> cost.sum().backward()
        >>> bool(acts.grad[0, 5:].eq(0).all())        # past act_lens[0] = 5: no gradient
        True

    Forward args: ``acts`` ``(B, T, U+1, V)`` raw logits, ``labels`` ``(B, U)``,
    ``act_lens``/``label_lens`` ``(B,)``, int32 or int64. Returns the
    ``(1 + fastemit_lambda)``-scaled costs in the dtype of ``acts``: ``(B,)``, or ``(1,)``
    for ``'sum'``/``'mean'``.
    """

    _cost_dtype = None        # the dtype of acts (warprnnt-numba's cost buffer)


class RNNTLossNumbaAtomicLock(RNNTLossNumba):
    """warprnnt-numba's ``RNNTLossNumbaAtomicLock(blank=0, reduction='mean',
    fastemit_lambda=0.0, clamp=-1)``: the same loss as :class:`RNNTLossNumba` (the peer's
    variant differs only in how its CUDA kernels are scheduled), with the same arguments and
    return values."""
