"""torchaudio's RNN-T loss on rnnt_lattice's kernels: a torchaudio user switches by changing
one import,

    from torchaudio.functional import rnnt_loss        # before
    from torchaudio.transforms import RNNTLoss
    from rnnt_lattice.compat.torchaudio import rnnt_loss, RNNTLoss     # after

Same names, argument names and order, defaults, accepted dtypes, return shapes and dtypes
and reduction semantics as ``torchaudio.functional.rnnt_loss`` and
``torchaudio.transforms.RNNTLoss`` (torchaudio 2.9): ``logits`` ``(B, T, U+1, V)`` float32
or float16 (the loss comes back in the logits' dtype), ``targets`` ``(B, U)``,
``logit_lengths`` and ``target_lengths`` ``(B,)``, all three int32; ``blank=-1`` (the last
class), ``clamp=-1`` (off), ``reduction="mean"`` (sum / B), ``fused_log_softmax=True``.

Both are TorchScript-compatible, like torchaudio's: ``torch.jit.script`` compiles a caller
(and ``torch.jit.save`` / ``torch.jit.load`` round-trip it, this module being imported
before the load), through the registered op ``rnnt_lattice::torchaudio_rnnt_loss``. The op
is composite: its kernel is :func:`rnnt_lattice.rnnt_loss` itself, so eager calls, scripted
and traced callers and ``torch.compile`` run the same code, with the library's own autograd
(the upstream gradient fused into the gradient write, no saved gradient to rescale).

Code that calls torchaudio itself (a framework, a recipe) switches without an edit through
:func:`install`, which replaces ``torchaudio.functional.rnnt_loss`` and
``torchaudio.transforms.RNNTLoss`` (the import-order rule: a ``from torchaudio.functional
import rnnt_loss`` executed before :func:`install` keeps torchaudio's function).

Differences from torchaudio, all deliberate:
- bad arguments raise ``ValueError`` naming them (torchaudio raises ``RuntimeError``);
- a target id outside ``[0, V)`` or equal to the blank is a ``ValueError`` on CPU
  (torchaudio reads out of bounds: a silent wrong loss);
- padded sizes may exceed the longest sequence (torchaudio demands ``T == max
  logit_lengths`` and ``U == max target_lengths``), any strides are accepted (torchaudio
  demands contiguous logits), and ``T_b = 0`` gives an infinite loss with a zero gradient;
- ``reduction="mean"`` of an empty batch is 0 (torchaudio fails).
"""
from __future__ import annotations

import torch
from torch import Tensor

import rnnt_lattice
from .._validate import check_flag, check_float, check_int, check_tensors
from ._install import scoped

__all__ = ["rnnt_loss", "RNNTLoss", "install", "uninstall", "installed"]

# The op the TorchScript-compatible wrapper calls: registered once, at import (kept alive
# by this module-level Library).
_LIB = torch.library.Library("rnnt_lattice", "FRAGMENT")
_LIB.define("torchaudio_rnnt_loss(Tensor logits, Tensor targets, Tensor logit_lengths, "
            "Tensor target_lengths, int blank, float clamp, bool fused_log_softmax) -> Tensor")

_LOGIT_DTYPES = (torch.float32, torch.float16)


def _check_dtypes(logits, targets, logit_lengths, target_lengths) -> None:
    """torchaudio's dtypes: float32/float16 logits, int32 ids and lengths. The op's kernel
    checks them (TorchScript callers), and so does :func:`rnnt_loss` before the op: under
    torch.compile the kernel runs on fake tensors, where a ValueError came out as
    TorchDynamo's TorchRuntimeError."""
    if logits.dtype not in _LOGIT_DTYPES:
        raise ValueError(f"logits must be float32 or float16 (as torchaudio), got {logits.dtype} "
                         f"logits of shape {tuple(logits.shape)}; rnnt_lattice.rnnt_loss also "
                         f"takes float64 and bfloat16")
    for name, x in (("targets", targets), ("logit_lengths", logit_lengths),
                    ("target_lengths", target_lengths)):
        if x.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 (as torchaudio), got {x.dtype} of shape "
                             f"{tuple(x.shape)}; rnnt_lattice.rnnt_loss also takes int64")


def _costs(logits, targets, logit_lengths, target_lengths, blank, clamp, fused_log_softmax):
    """The op's kernel: per-sequence costs ``(B,)`` in the logits' dtype, differentiable
    w.r.t. ``logits`` through :func:`rnnt_lattice.rnnt_loss` (registered
    CompositeImplicitAutograd: autograd records what the public function does)."""
    _check_dtypes(logits, targets, logit_lengths, target_lengths)
    costs = rnnt_lattice.rnnt_loss(logits, targets, logit_lengths, target_lengths, blank, clamp,
                                   "none", fused_log_softmax)
    return costs.to(logits.dtype)        # float16 logits: a float16 loss, as torchaudio


_LIB.impl("torchaudio_rnnt_loss", _costs, "CompositeImplicitAutograd")


def _check_reduction(reduction: str) -> None:
    """torchaudio's three reductions (TorchScript compiles this one too)."""
    if reduction not in ["none", "mean", "sum"]:
        raise ValueError('reduction should be one of "none", "mean", or "sum"')


@torch.jit.unused
def _check_options(tensors, blank, clamp, fused_log_softmax) -> None:
    """What the op's schema would otherwise take or cast in silence, checked in Python (not
    in TorchScript, whose types are checked at compile time): the tensors (the schema's
    error is a ``RuntimeError`` naming no argument), ``blank`` an int (the dispatcher casts
    ``True`` to 1), ``clamp`` a number, and ``fused_log_softmax`` a bool (the dispatcher
    casts ``None`` to False: raw logits read as log-probs, a finite, wrong loss)."""
    check_tensors(*tensors)
    if not -2 ** 63 <= check_int("blank", blank) < 2 ** 63:   # (the schema's cast error)
        raise ValueError(f"blank must be a class id of the logits (an int64), got {blank}")
    check_float("clamp", clamp)
    check_flag("fused_log_softmax", fused_log_softmax)      # (NumPy's bool too, as the schema)


def rnnt_loss(
    logits: Tensor,
    targets: Tensor,
    logit_lengths: Tensor,
    target_lengths: Tensor,
    blank: int = -1,
    clamp: float = -1,
    reduction: str = "mean",
    fused_log_softmax: bool = True,
):
    """``torchaudio.functional.rnnt_loss``: the RNN-T loss ``-log P(y|x)`` (Graves 2012).

    Example::

        >>> import torch
        >>> from rnnt_lattice.compat.torchaudio import rnnt_loss
        >>> logits = torch.randn(2, 5, 3, 4, requires_grad=True)          # (B, T, U+1, V)
        >>> targets = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
        >>> lengths = torch.tensor([5, 4], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32)
        >>> loss = rnnt_loss(logits, targets, *lengths, blank=0)
        >>> loss.backward()
        >>> scripted = torch.jit.script(rnnt_loss)                        # TorchScript, as torchaudio

    Args:
        logits: ``(B, T, U+1, V)`` joiner output, float32 or float16.
        targets: ``(B, U)`` int32 label ids, zero-padded.
        logit_lengths: ``(B,)`` int32 frames ``T_b`` of each sequence.
        target_lengths: ``(B,)`` int32 labels ``U_b`` of each sequence.
        blank: the blank id; negative counts from the end (``-1``: ``V - 1``).
        clamp: if ``> 0``, every element of the per-sequence gradient is clipped to
            ``[-clamp, clamp]`` before the upstream gradient is applied.
        reduction: ``"none"`` -> ``(B,)``, ``"mean"`` (sum / B) or ``"sum"`` -> a scalar.
        fused_log_softmax: ``False`` when ``logits`` already are log-probabilities.

    Returns:
        The loss in the logits' dtype: ``(B,)`` for ``"none"``, otherwise a scalar.
    """
    _check_reduction(reduction)
    if not torch.jit.is_scripting():
        _check_options((("logits", logits), ("targets", targets),
                        ("logit_lengths", logit_lengths), ("target_lengths", target_lengths)),
                       blank, clamp, fused_log_softmax)
        _check_dtypes(logits, targets, logit_lengths, target_lengths)
    costs = torch.ops.rnnt_lattice.torchaudio_rnnt_loss(
        logits, targets, logit_lengths, target_lengths, blank, float(clamp), fused_log_softmax)
    if reduction == "sum" or (reduction == "mean" and costs.numel() == 0):
        return costs.sum()                # an empty batch: "mean" is 0, not 0/0
    if reduction == "mean":
        return costs.mean()
    return costs


class RNNTLoss(torch.nn.Module):
    """``torchaudio.transforms.RNNTLoss``: :func:`rnnt_loss` with its options fixed.

    Example::

        >>> import torch
        >>> from rnnt_lattice.compat.torchaudio import RNNTLoss
        >>> criterion = RNNTLoss(blank=0)
        >>> logits = torch.randn(1, 2, 3, 5, requires_grad=True)          # (B, T, U+1, V)
        >>> loss = criterion(logits, torch.tensor([[1, 2]], dtype=torch.int32),
        ...                  torch.tensor([2], dtype=torch.int32), torch.tensor([2], dtype=torch.int32))
        >>> loss.backward()

    Args: ``blank=-1``, ``clamp=-1.0``, ``reduction="mean"``, ``fused_log_softmax=True``,
    as :func:`rnnt_loss`. Forward args: ``logits (B, T, U+1, V)``, ``targets (B, U)``,
    ``logit_lengths (B,)``, ``target_lengths (B,)``.
    """

    def __init__(self, blank: int = -1, clamp: float = -1.0, reduction: str = "mean",
                 fused_log_softmax: bool = True):
        super().__init__()
        _check_reduction(reduction)
        _check_options((), blank, clamp, fused_log_softmax)
        # Stored as the annotated types, so that torch.jit.script takes the module built
        # with clamp=1 or a NumPy blank (torchaudio stores them as given, and fails there).
        self.blank = int(blank)
        self.clamp = float(clamp)
        self.reduction = reduction
        self.fused_log_softmax = fused_log_softmax

    def forward(self, logits: Tensor, targets: Tensor, logit_lengths: Tensor,
                target_lengths: Tensor):
        return rnnt_loss(logits, targets, logit_lengths, target_lengths, self.blank,
                         self.clamp, self.reduction, self.fused_log_softmax)


# --------------------------------------------------------------------------- install()

# module -> (attribute, ours): where torchaudio defines and exports the loss
_TARGETS = (("torchaudio.functional", "rnnt_loss"),
            ("torchaudio.functional.functional", "rnnt_loss"),
            ("torchaudio.transforms", "RNNTLoss"),
            ("torchaudio.transforms._transforms", "RNNTLoss"))
_saved: list = []          # (module, attribute, torchaudio's object), for uninstall()


def install() -> None:
    """Make code that calls torchaudio compute with this module, without an edit:
    replaces ``torchaudio.functional.rnnt_loss`` by :func:`rnnt_loss` and
    ``torchaudio.transforms.RNNTLoss`` by :class:`RNNTLoss` (and the same names in the
    submodules that define them, ``torchaudio.functional.functional`` and
    ``torchaudio.transforms._transforms``).

    Example::

        import rnnt_lattice.compat.torchaudio
        rnnt_lattice.compat.torchaudio.install()
        import torchaudio
        loss = torchaudio.functional.rnnt_loss(logits, targets, logit_lengths, target_lengths)

    The import-order rule: the replacement is of module attributes, so a call that looks
    the name up at call time (``torchaudio.functional.rnnt_loss(...)``, ``F.rnnt_loss(...)``
    after ``import torchaudio.functional as F``) switches, while a ``from
    torchaudio.functional import rnnt_loss`` executed *before* :func:`install` keeps
    torchaudio's function (Python bound the name at import); the same holds for
    ``RNNTLoss``, and for a ``torchaudio.transforms.RNNTLoss`` built before the call.
    Idempotent; undone by :func:`uninstall`.

    Raises:
        ImportError: torchaudio (``torchaudio.functional``) does not import.
    """
    import importlib

    try:
        importlib.import_module("torchaudio.functional")
        importlib.import_module("torchaudio.transforms")
    except ImportError as err:
        raise ImportError(f"rnnt_lattice.compat.torchaudio.install() needs torchaudio, which "
                          f"does not import: {err}. rnnt_loss and RNNTLoss of "
                          f"rnnt_lattice.compat.torchaudio work without it.") from err
    if _saved:
        return
    ours = {"rnnt_loss": rnnt_loss, "RNNTLoss": RNNTLoss}
    for modname, name in _TARGETS:
        try:
            module = importlib.import_module(modname)
        except ImportError:
            continue
        if hasattr(module, name):
            _saved.append((module, name, getattr(module, name)))
            setattr(module, name, ours[name])


def uninstall() -> None:
    """Undo :func:`install`: torchaudio's ``rnnt_loss`` and ``RNNTLoss`` come back. A
    no-op when not installed."""
    while _saved:
        module, name, value = _saved.pop()
        setattr(module, name, value)


def installed():
    """:func:`install` for a ``with`` block; uninstalls on exit unless it was installed
    before the block."""
    return scoped(_saved, install, uninstall)
