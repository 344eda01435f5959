"""warp-transducer's ``warprnnt_pytorch`` on rnnt_lattice's kernels: a user switches by
changing one import,

    from warprnnt_pytorch import RNNTLoss, rnnt_loss                    # before
    from rnnt_lattice.compat.warp_transducer import RNNTLoss, rnnt_loss  # after

Same names, argument names and order, defaults, shapes and return values as HawkAaron's
warp-transducer (master, docs/variants.md C.4): ``acts`` ``(B, T, U+1, V)`` raw
logits, float32 or float64, on CPU or CUDA (warp-transducer takes raw logits on both: its
CPU path applies ``log_softmax`` in Python, its GPU kernel fuses it; here it is always
fused); ``labels`` ``(B, U)``, ``act_lens`` and ``label_lens`` ``(B,)``, all three int32;
``blank=0``; ``reduction="mean"``. The loss has the acts' dtype: ``(B,)`` for ``"none"``,
shape ``(1,)`` for ``"sum"`` and ``"mean"`` (the sum over the batch divided by ``B``, not by
the target lengths the peer's docstring mentions).

FastEmit (Yu et al. 2021) comes from the ESPnet fork (b-flo/warp-transducer
``espnet_v1.1``): ``fastemit_lambda`` scales the label arcs' gradient by ``1 +
fastemit_lambda``; the loss stays the plain ``-log P``. Here it defaults to 0 (master has
no FastEmit; the fork's default is 0.001) and is keyword-only in ``RNNTLoss`` (the fork's
positional order is ``RNNTLoss(blank, fastemit_lambda, reduction)``: pass it by name; a
number where ``reduction`` belongs is a ``ValueError``). ``rnnt_loss`` keeps the fork's
order: ``fastemit_lambda`` after ``reduction``.

ESPnet's transducer models import ``warprnnt_pytorch`` themselves and stop with "warp-rnnt
was not installed" without it: :func:`install` makes that import resolve to this module
(one line, no ESPnet edit; a real warp-transducer is kept unless ``replace=True``).

Differences from warp-transducer, all deliberate:
- an unknown ``reduction`` is a ``ValueError`` (warp-transducer silently returns the
  per-sequence losses);
- other ``acts`` dtypes are a ``ValueError`` (warp-transducer prints "unsupported data type"
  and returns zero losses), and int64 ids a ``ValueError`` (warp-transducer: ``TypeError``);
- a label equal to the blank or outside ``[0, V)`` is a ``ValueError`` on CPU (the CPU
  kernel overwrites the blank's gradient with the label's, HawkAaron#93; out-of-range ids
  are read out of bounds);
- the gradient is exact on CPU and GPU alike, and a second backward (``retain_graph``)
  gives the same gradient (warp-transducer scales its saved gradient in place);
- padded sizes may exceed the longest sequence (warp-transducer demands ``T == max
  act_lens`` and ``U == max label_lens + 1``) and any strides are accepted.
"""
from __future__ import annotations

import torch

from .. import functional
from .._validate import Names
from ._install import scoped

__all__ = ["rnnt_loss", "RNNTLoss", "install", "uninstall", "installed"]

_REDUCTIONS = ("none", "mean", "sum")

# The messages name the tensors as warp-transducer's signature does.
NAMES = Names("acts", "labels", "act_lens", "label_lens")


def _check_reduction(reduction) -> None:
    if reduction not in _REDUCTIONS:
        hint = (" (the ESPnet fork's positional order RNNTLoss(blank, fastemit_lambda, "
                "reduction) is not supported: pass fastemit_lambda= by name)"
                if isinstance(reduction, (int, float)) and not isinstance(reduction, bool) else "")
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}{hint}")


def rnnt_loss(acts: torch.Tensor, labels: torch.Tensor, act_lens: torch.Tensor,
              label_lens: torch.Tensor, blank: int = 0, reduction: str = "mean",
              fastemit_lambda: float = 0.0) -> torch.Tensor:
    """warp-transducer's ``rnnt_loss``: the RNN-T loss ``-log P(y|x)`` of raw logits.

    Example::

        >>> import torch
        >>> from rnnt_lattice.compat.warp_transducer import rnnt_loss
        >>> acts = torch.randn(2, 5, 3, 4, requires_grad=True)              # (B, T, U+1, V)
        >>> labels = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
        >>> act_lens, label_lens = torch.tensor([5, 4], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32)
        >>> loss = rnnt_loss(acts, labels, act_lens, label_lens)          # shape (1,)
        >>> loss.backward()

    Args:
        acts: ``(B, T, U+1, V)`` float32 or float64 joiner output (raw logits).
        labels: ``(B, U)`` int32 label ids, zero-padded.
        act_lens: ``(B,)`` int32 frames ``T_b``.
        label_lens: ``(B,)`` int32 labels ``U_b``.
        blank: the blank id.
        reduction: ``"none"`` -> ``(B,)``; ``"sum"`` or ``"mean"`` (sum / B) -> ``(1,)``.
        fastemit_lambda: FastEmit's lambda (the ESPnet fork's option; 0 here by default).

    Returns:
        The loss, in the dtype of ``acts``.
    """
    _check_reduction(reduction)
    if not isinstance(acts, torch.Tensor) or acts.dtype not in (torch.float32, torch.float64):
        raise ValueError("acts must be a float32 or float64 tensor (as warp-transducer), got "
                         + (f"{acts.dtype} acts of shape {tuple(acts.shape)}"
                            if isinstance(acts, torch.Tensor) else type(acts).__name__))
    for name, x in (("labels", labels), ("act_lens", act_lens), ("label_lens", label_lens)):
        if isinstance(x, torch.Tensor) and x.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 (as warp-transducer), got {x.dtype} of shape "
                             f"{tuple(x.shape)}")
    costs = functional.rnnt_costs_named(NAMES, acts, labels, act_lens, label_lens, blank,
                                        fastemit_lambda=fastemit_lambda)
    if reduction == "none":
        return costs
    total = costs.sum()
    if reduction == "mean" and costs.shape[0] > 0:      # an empty batch: 0, not 0/0
        total = total / costs.shape[0]
    return total.reshape(1)


class RNNTLoss(torch.nn.Module):
    """warp-transducer's ``RNNTLoss``: :func:`rnnt_loss` with its options fixed.

    Example::

        >>> import torch
        >>> from rnnt_lattice.compat.warp_transducer import RNNTLoss
        >>> criterion = RNNTLoss(blank=0, reduction="sum", fastemit_lambda=0.001)
        >>> acts = torch.randn(1, 2, 3, 5, requires_grad=True)              # (B, T, U+1, V)
        >>> loss = criterion(acts, torch.tensor([[1, 2]], dtype=torch.int32),
        ...                  torch.tensor([2], dtype=torch.int32), torch.tensor([2], dtype=torch.int32))
        >>> loss.backward()

    Args: ``blank=0``, ``reduction="mean"``, keyword-only ``fastemit_lambda=0.0``, as
    :func:`rnnt_loss`. Forward args: ``acts (B, T, U+1, V)``, ``labels (B, U)``,
    ``act_lens (B,)``, ``label_lens (B,)``.
    """

    def __init__(self, blank: int = 0, reduction: str = "mean", *, fastemit_lambda: float = 0.0):
        super().__init__()
        _check_reduction(reduction)
        self.blank = blank
        self.reduction = reduction
        self.fastemit_lambda = fastemit_lambda

    def forward(self, acts, labels, act_lens, label_lens):
        return rnnt_loss(acts, labels, act_lens, label_lens, self.blank, self.reduction,
                         self.fastemit_lambda)

    def extra_repr(self) -> str:
        return f"blank={self.blank}, reduction={self.reduction!r}, fastemit_lambda={self.fastemit_lambda}"


# --------------------------------------------------------------------------- install()

_NAME = "warprnnt_pytorch"
_MISSING = object()
_saved: dict = {}          # the sys.modules entry install() replaced, for uninstall()


def install(replace: bool = False) -> bool:
    """Make ``import warprnnt_pytorch`` resolve to this module, for code that imports
    warp-transducer itself, such as ESPnet's transducer models (``from warprnnt_pytorch
    import RNNTLoss`` when the model is built or its first loss computed):

        import rnnt_lattice.compat.warp_transducer
        rnnt_lattice.compat.warp_transducer.install()    # before the model is built
        model = ESPnetASRModel(...)                       # its RNNTLoss: this module's

    A real warp-transducer that Python can find (installed, or already imported) is not
    shadowed: the call then changes nothing, warns, and returns ``False``; with
    ``replace=True`` this module replaces it all the same. A ``from warprnnt_pytorch import
    RNNTLoss`` executed before the call keeps what it imported. Idempotent; undone by
    :func:`uninstall`.

    Returns:
        Whether ``import warprnnt_pytorch`` now gives this module.
    """
    import importlib.util
    import sys
    import warnings

    this = sys.modules[__name__]
    if sys.modules.get(_NAME) is this:
        return True
    previous = sys.modules.get(_NAME, _MISSING)
    if not replace:
        try:
            real = previous is not _MISSING or importlib.util.find_spec(_NAME) is not None
        except (ImportError, ValueError):        # a broken entry: nothing usable to keep
            real = False
        if real:
            warnings.warn("rnnt_lattice.compat.warp_transducer.install(): a warprnnt_pytorch "
                          "(warp-transducer) is installed and is kept; install(replace=True) "
                          "replaces it", stacklevel=2)
            return False
    _saved["previous"] = previous
    sys.modules[_NAME] = this
    return True


def uninstall() -> None:
    """Undo :func:`install`: ``import warprnnt_pytorch`` finds what it found before (a
    real warp-transducer, or nothing). A no-op when not installed."""
    import sys

    if not _saved:
        return
    previous = _saved.pop("previous")
    if sys.modules.get(_NAME) is sys.modules[__name__]:
        if previous is _MISSING:
            del sys.modules[_NAME]
        else:
            sys.modules[_NAME] = previous


def installed(replace: bool = False):
    """:func:`install` for a ``with`` block; uninstalls on exit unless it was installed
    before the block."""
    return scoped(_saved, lambda: install(replace), uninstall)
