"""NeMo's numba RNN-T, TDT and multi-blank losses on rnnt_lattice's kernels. A script
switches by changing its import,

    from nemo.collections.asr.parts.numba.rnnt_loss import RNNTLossNumba, TDTLossNumba
    from rnnt_lattice.compat.nemo import RNNTLossNumba, TDTLossNumba

and a NeMo config switches without any change: after :func:`install`, NeMo's own
``nemo.collections.asr.losses.rnnt.RNNTLoss`` builds these classes for
``loss_name="warprnnt_numba"`` (and ``"default"``), ``"tdt"`` and ``"multiblank_rnnt"``.

Same names, argument names and order, defaults and return values as
``nemo/collections/asr/parts/numba/rnnt_loss/rnnt_pytorch.py`` (NeMo 3.0;
docs/variants.md B):

- ``acts`` are the joiner's raw logits ``(B, T, U+1, V)`` (TDT: ``(B, T, U+1, V_tok + D)``,
  the ``D = len(durations)`` duration logits last); ``labels`` ``(B, U)``, ``act_lens`` and
  ``label_lens`` ``(B,)``, all three int64 (the RNN-T and multi-blank losses also take
  int32, as ESPnet's copy of them does);
- the reported cost is NeMo's ``(1 + fastemit_lambda) * (-log P)``; the gradient is the
  FastEmit gradient (label arcs scaled by ``1 + fastemit_lambda``), not the gradient of
  that value;
- ``reduction``: ``'sum'`` and ``'mean'`` (the sum divided by ``B``; NeMo's docstring says
  "divided by the target lengths", its code divides by ``B``) return shape ``(1,)``;
  ``None`` or ``'none'`` return ``(B,)``. Modules read ``reduction`` (and every other
  attribute) at each call, so ``RNNTLoss`` may set ``module.reduction = None`` between calls;
- costs are float32 for the RNN-T loss whatever the dtype of ``acts`` (NeMo's cost
  buffer), and in the dtype of ``acts`` for TDT and multi-blank;
- ``clamp > 0`` clips the gradient w.r.t. the logits to ``[-clamp, clamp]``; the module
  constructors turn ``clamp <= 0`` into ``0.0`` (off), the functions reject ``clamp < 0``.

Differences from NeMo, all deliberate (docs/migrating.md lists them with the reasons):

- TDT and multi-blank run on CPU too (NeMo raises ``ValueError``/``NotImplementedError``);
- the reported cost is ``(1 + fastemit_lambda)``-scaled on every device and also without a
  gradient (NeMo's CPU RNN-T reports the unscaled value when ``acts`` needs no gradient);
- ``clamp`` clips each sequence's gradient before the upstream gradient is applied, on CPU
  as NeMo's GPU kernels do (NeMo's CPU path clips after it, so there the threshold moves
  with ``'mean'``'s ``1/B`` and any loss scaling);
- a sequence with no alignment costs ``+inf`` with a zero gradient (NeMo's GPU kernels use
  a finite sentinel, -10000 for log 0, and report a large finite cost);
- the functions ``tdt_loss`` and ``multiblank_rnnt_loss`` work (NeMo's pass too few
  arguments to their autograd Functions, and its ``tdt_loss`` takes one log-softmax over the
  tokens and durations together) and take ``sigma`` (and ``omega``) as trailing arguments;
- a ``reduction`` other than ``'sum'``, ``'mean'``, ``'none'`` or ``None`` raises
  ``ValueError`` (NeMo silently returns the per-sequence costs for any other value);
- TDT ``durations`` must be strictly ascending (NeMo's kernels assume it and silently give
  wrong values otherwise) but need not hold 1 among their first two (NeMo's backward pass
  needs it, from reading); ``big_blank_durations`` may come in any order, as in NeMo;
- ``omega``'s draw comes from torch's CPU generator (``torch.manual_seed``), NeMo's from
  Python's ``random``;
- the RNN-T and multi-blank losses take int32 labels and lengths too (ESPnet's copy of
  NeMo's module, ``espnet2.asr.transducer.rnnt_multi_blank``, requires int32 lengths and its
  models pass int32 labels: an ESPnet model switches by its import alone); other dtypes
  (for TDT anything but int64) raise an error that is both a ``ValueError`` (this
  library's convention) and the ``TypeError`` NeMo raises; ``acts``
  need not be contiguous nor exactly ``(max T_b, max U_b + 1)`` in its middle dimensions
  (padding beyond the lengths is never read);
- a second backward through the same graph (``retain_graph=True``) works (NeMo's backward
  scales its saved gradient in place, and autograd refuses the second one), and nothing is
  printed (NeMo's CPU loss prints when its forward and backward likelihoods differ).
"""
from __future__ import annotations

import dataclasses
import importlib

import torch

from .. import functional
from .._validate import Names, check_durations, check_float, check_int, check_tensors
from ._install import scoped

__all__ = ["rnnt_loss", "tdt_loss", "multiblank_rnnt_loss", "RNNTLossNumba", "TDTLossNumba",
           "MultiblankRNNTLossNumba", "install", "uninstall", "installed"]


class _IdDtypeError(ValueError, TypeError):
    """A ValueError, as every argument error of this library, that is also the TypeError
    NeMo raises for labels or lengths of another dtype."""


REDUCTIONS = ("sum", "mean", "none", None)

# The dtypes of labels and lengths each loss takes: NeMo's int64, and for the RNN-T and
# multi-blank losses also the int32 of ESPnet's copy of NeMo's module
# (espnet2.asr.transducer.rnnt_multi_blank, whose certify_inputs requires int32 lengths and
# whose models pass int32 labels), so that an ESPnet model switches by its import alone.
NEMO_IDS = (torch.int64,)
ESPNET_IDS = (torch.int64, torch.int32)

# The messages name the tensors as NeMo's signatures do.
NAMES = Names("acts", "labels", "act_lens", "label_lens")


def _check_call(labels, act_lens, label_lens, reduction, ids: tuple) -> None:
    """NeMo's ``certify_inputs`` dtype rule (labels and both lengths of a dtype in ``ids``),
    and the reduction, read at each call."""
    _check_reduction(reduction)
    named = (("labels", labels), ("act_lens", act_lens), ("label_lens", label_lens))
    check_tensors(*named)
    for name, x in named:
        if x.dtype not in ids:
            want = " or ".join(str(d) for d in ids)
            raise _IdDtypeError(f"{name} must be {want}, got {x.dtype} with shape "
                                f"{tuple(x.shape)}")


def _check_reduction(reduction) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of 'sum', 'mean', 'none' or None, got {reduction!r}")


def _check_clamp(clamp) -> float:
    """The functions' rule: NeMo's autograd Functions reject a negative clamp."""
    clamp = check_float("clamp", clamp)
    if clamp < 0:
        raise ValueError(f"clamp must be 0.0 (off) or a positive float, got {clamp}")
    return clamp


def _module_clamp(clamp) -> float:
    """The modules' rule: NeMo stores ``float(clamp) if clamp > 0 else 0.0``."""
    clamp = check_float("clamp", clamp)
    return clamp if clamp > 0 else 0.0


def _tdt_blank(blank, acts=None, durations=None) -> int:
    """TDT's blank: NeMo's ``num_classes``, the last token, a class id ``>= 0`` (NeMo's
    kernels index by it). A negative one is refused: ``-1`` would always be the last token,
    so a ``durations`` list of the wrong length, which moves the boundary between the
    tokens and the durations in ``acts``, would go unnoticed (a finite, wrong loss). With
    ``acts`` and ``durations`` (a call): below ``V_tok``, the tokens before the durations
    (the library's message would offer negative blanks, which this module refuses)."""
    blank = check_int("blank", blank)
    if blank < 0:
        raise ValueError(f"blank must be the last token's id, num_classes >= 0 (NeMo's "
                         f"TDT layout), got {blank}")
    if isinstance(acts, torch.Tensor) and acts.dim() and isinstance(durations, (list, tuple)):
        v_tok = acts.shape[-1] - len(durations)
        if blank >= v_tok:
            raise ValueError(f"blank={blank} is outside [0, V_tok) = [0, {v_tok}) for acts "
                             f"{tuple(acts.shape)}: its last axis holds V_tok = {v_tok} "
                             f"tokens, then {len(durations)} durations; check the blank and "
                             f"the durations")
    return blank


def _report(costs: torch.Tensor, fastemit_lambda: float, dtype: torch.dtype,
            reduction) -> torch.Tensor:
    """Per-sequence costs ``(B,)`` -> NeMo's reported value: ``(1 + lambda) * cost`` whose
    gradient stays that of ``cost`` (the FastEmit gradient), reduced to ``(1,)`` for
    ``'sum'``/``'mean'`` and cast to NeMo's cost dtype."""
    if fastemit_lambda:
        # Only the value is scaled. +-inf and NaN costs are left as they are (lambda * inf
        # would turn +inf into NaN for a negative lambda).
        extra = costs.detach() * fastemit_lambda
        costs = costs + torch.where(torch.isfinite(costs), extra, torch.zeros_like(extra))
    if reduction in ("sum", "mean"):
        B = costs.shape[0]
        costs = costs.sum().unsqueeze(-1)                                   # (1,)
        if reduction == "mean" and B > 0:
            costs = costs / B
    # Reduced first, in the computed dtype: 'mean''s 1/B reaches a float64 gradient exactly.
    return costs.to(dtype)


# --------------------------------------------------------------------------- the losses

def _rnnt(acts, labels, act_lens, label_lens, blank, reduction, fastemit_lambda, clamp,
          cost_dtype=torch.float32):
    """The RNN-T loss of both NeMo's module and warprnnt-numba's copy of it
    (``compat.warprnnt_numba``), which differ in the costs' dtype: NeMo's float32 buffer,
    or (``cost_dtype=None``) warprnnt-numba's buffer in the dtype of ``acts``."""
    _check_call(labels, act_lens, label_lens, reduction, ESPNET_IDS)
    costs = functional.rnnt_costs_named(NAMES, acts, labels, act_lens, label_lens, blank,
                                        clamp=clamp, fastemit_lambda=fastemit_lambda)
    return _report(costs, fastemit_lambda, cost_dtype or acts.dtype, reduction)


def _tdt(acts, labels, act_lens, label_lens, blank, durations, reduction, fastemit_lambda,
         clamp, sigma, omega):
    _check_call(labels, act_lens, label_lens, reduction, NEMO_IDS)
    blank = _tdt_blank(blank, acts, durations)
    costs = functional.tdt_loss_named(NAMES, acts, labels, act_lens, label_lens, blank=blank,
                                      durations=durations, sigma=sigma, omega=omega,
                                      reduction="none", fastemit_lambda=fastemit_lambda,
                                      clamp=clamp, zero_infinity=False, backend="auto",
                                      inplace_grad=False, packed=False)
    return _report(costs, fastemit_lambda, acts.dtype, reduction)


def _multiblank(acts, labels, act_lens, label_lens, blank, big_blank_durations, reduction,
                fastemit_lambda, clamp, sigma):
    _check_call(labels, act_lens, label_lens, reduction, ESPNET_IDS)
    costs = functional.multiblank_rnnt_loss_named(
        NAMES, acts, labels, act_lens, label_lens, blank=blank,
        big_blank_durations=big_blank_durations, sigma=sigma, reduction="none",
        fastemit_lambda=fastemit_lambda, clamp=clamp, zero_infinity=False, backend="auto",
        inplace_grad=False, packed=False)
    return _report(costs, fastemit_lambda, acts.dtype, reduction)


def rnnt_loss(acts, labels, act_lens, label_lens, blank=0, reduction='mean',
              fastemit_lambda: float = 0.0, clamp: float = 0.0):
    """NeMo's functional RNN-T loss: ``acts`` ``(B, T, U+1, V)`` raw logits, ``labels``
    ``(B, U)``, ``act_lens``/``label_lens`` ``(B,)``, int64 or int32. Returns the
    ``(1 + fastemit_lambda)``-scaled costs: ``(B,)``, or ``(1,)`` for ``'sum'``/``'mean'``
    (``'mean'`` = sum / B), float32. ``clamp`` must be ``>= 0`` (``0``: off)."""
    return _rnnt(acts, labels, act_lens, label_lens, blank, reduction,
                 check_float("fastemit_lambda", fastemit_lambda), _check_clamp(clamp))


def tdt_loss(acts, labels, act_lens, label_lens, blank, durations=[], reduction='mean',
             fastemit_lambda: float = 0.0, clamp: float = 0.0, sigma: float = 0.0,
             omega: float = 0.0):
    """NeMo's functional TDT loss, working (NeMo's raises): ``acts``
    ``(B, T, U+1, V_tok + D)`` with the ``D = len(durations)`` duration logits last, each
    part with its own log-softmax; ``blank`` is the last token (``V_tok - 1``). ``sigma`` and
    ``omega`` as :class:`TDTLossNumba`. Returns costs as :func:`rnnt_loss`, in the dtype of
    ``acts``."""
    return _tdt(acts, labels, act_lens, label_lens, blank, durations, reduction,
                check_float("fastemit_lambda", fastemit_lambda), _check_clamp(clamp), sigma,
                omega)


def multiblank_rnnt_loss(acts, labels, act_lens, label_lens, blank, big_blank_durations=[],
                         reduction='mean', fastemit_lambda: float = 0.0, clamp: float = 0.0,
                         sigma: float = 0.0):
    """NeMo's functional multi-blank loss, working (NeMo's raises): ``acts``
    ``(B, T, U+1, V)``, one softmax over the labels, the big blanks and the standard blank
    ``blank`` (NeMo's: the last class; ESPnet's: after its big blanks); the big blank of
    ``big_blank_durations[i]`` is class ``blank - 1 - i`` (any order); ``labels``, ``act_lens``, ``label_lens`` as
    :func:`rnnt_loss` (int64 or int32). Returns costs as :func:`rnnt_loss`, in the dtype of
    ``acts``."""
    return _multiblank(acts, labels, act_lens, label_lens, blank, big_blank_durations,
                       reduction, check_float("fastemit_lambda", fastemit_lambda),
                       _check_clamp(clamp), sigma)


class RNNTLossNumba(torch.nn.Module):
    """NeMo's ``RNNTLossNumba(blank=0, reduction='mean', fastemit_lambda=0.0, clamp=-1)``.

    Example::

        >>> import torch
        >>> from rnnt_lattice.compat.nemo import RNNTLossNumba
        >>> loss_fn = RNNTLossNumba(blank=0, reduction='sum', fastemit_lambda=0.001)
        >>> acts = torch.randn(2, 5, 3, 6, requires_grad=True)      # (B, T, U+1, V)
        >>> cost = loss_fn(acts, torch.tensor([[1, 2], [3, 0]]), torch.tensor([5, 4]),
        ...                torch.tensor([2, 1]))
        >>> tuple(cost.shape), cost.dtype
        ((1,), torch.float32)
        >>> cost.backward()

    Forward args: ``acts`` ``(B, T, U+1, V)`` raw logits, ``labels`` ``(B, U)``,
    ``act_lens``/``label_lens`` ``(B,)``, int64 or int32. Returns the
    ``(1 + fastemit_lambda)``-scaled costs, float32: ``(B,)``, or ``(1,)`` for
    ``'sum'``/``'mean'``.
    """

    def __init__(self, blank=0, reduction='mean', fastemit_lambda: float = 0.0,
                 clamp: float = -1):
        super().__init__()
        _check_reduction(reduction)
        check_int("blank", blank)
        check_float("fastemit_lambda", fastemit_lambda)
        self.blank = blank
        self.fastemit_lambda = fastemit_lambda
        self.clamp = _module_clamp(clamp)
        self.reduction = reduction

    # The costs' dtype: NeMo's float32 (None: the dtype of acts, compat.warprnnt_numba's).
    _cost_dtype = torch.float32

    def forward(self, acts, labels, act_lens, label_lens):
        return _rnnt(acts, labels, act_lens, label_lens, self.blank, self.reduction,
                     check_float("fastemit_lambda", self.fastemit_lambda), self.clamp,
                     self._cost_dtype)

    def extra_repr(self) -> str:
        return (f"blank={self.blank}, reduction={self.reduction!r}, "
                f"fastemit_lambda={self.fastemit_lambda}, clamp={self.clamp}")


class TDTLossNumba(torch.nn.Module):
    """NeMo's ``TDTLossNumba(blank, durations=None, reduction='mean', fastemit_lambda=0.0,
    clamp=-1, sigma=0.0, omega=0.0)``, on CPU too.

    Example::

        >>> import torch
        >>> from rnnt_lattice.compat.nemo import TDTLossNumba
        >>> loss_fn = TDTLossNumba(blank=3, durations=[0, 1, 2], reduction='sum', sigma=0.05)
        >>> acts = torch.zeros(1, 3, 2, 4 + 3)                      # 4 tokens, 3 durations
        >>> cost = loss_fn(acts, torch.tensor([[0]]), torch.tensor([3]), torch.tensor([1]))
        >>> round(float(cost), 6)                                   # NeMo's test vector
        4.155739

    Forward args: ``acts`` ``(B, T, U+1, V_tok + D)``: the tokens (``blank`` is the last one,
    NeMo's ``num_classes``) then the ``D = len(durations)`` duration logits, each part with
    its own log-softmax; ``labels``, ``act_lens``, ``label_lens`` as :class:`RNNTLossNumba`.
    ``durations`` strictly ascending; ``sigma`` is subtracted once per arc; with probability
    ``omega`` per call (drawn from torch's CPU generator; NeMo draws from Python's
    ``random``) the cost is the standard RNN-T loss of the token logits, without sigma, and
    the durations' gradient is 0. ``clamp`` and FastEmit act on the token part only. Costs
    in the dtype of ``acts``.
    """

    def __init__(self, blank, durations=None, reduction='mean', fastemit_lambda: float = 0.0,
                 clamp: float = -1, sigma: float = 0.0, omega: float = 0.0):
        super().__init__()
        _check_reduction(reduction)
        _tdt_blank(blank)
        if durations is not None:           # (None: refused at the first forward, as NeMo)
            check_durations("durations", durations, minimum=0, ascending=True)
        for name, value in (("fastemit_lambda", fastemit_lambda), ("sigma", sigma),
                            ("omega", omega)):
            check_float(name, value)
        self.blank = blank
        self.durations = durations if durations is not None else []
        self.fastemit_lambda = fastemit_lambda
        self.clamp = _module_clamp(clamp)
        self.reduction = reduction
        self.sigma = sigma
        self.omega = omega

    def forward(self, acts, labels, act_lens, label_lens):
        return _tdt(acts, labels, act_lens, label_lens, self.blank, self.durations,
                    self.reduction, check_float("fastemit_lambda", self.fastemit_lambda),
                    self.clamp, self.sigma, self.omega)

    def extra_repr(self) -> str:
        return (f"blank={self.blank}, durations={list(self.durations)}, "
                f"reduction={self.reduction!r}, fastemit_lambda={self.fastemit_lambda}, "
                f"clamp={self.clamp}, sigma={self.sigma}, omega={self.omega}")


class MultiblankRNNTLossNumba(torch.nn.Module):
    """NeMo's ``MultiblankRNNTLossNumba(blank, big_blank_durations, reduction='mean',
    fastemit_lambda=0.0, clamp=-1, sigma=0.0)``, on CPU too.

    Example::

        >>> import torch
        >>> from rnnt_lattice.compat.nemo import MultiblankRNNTLossNumba
        >>> loss_fn = MultiblankRNNTLossNumba(blank=6, big_blank_durations=[4, 2], sigma=0.05)
        >>> acts = torch.randn(2, 8, 3, 7, requires_grad=True)      # 4 labels, 2 big blanks, blank
        >>> cost = loss_fn(acts, torch.tensor([[1, 2], [3, 0]]), torch.tensor([8, 5]),
        ...                torch.tensor([2, 1]))
        >>> cost.backward()

    Forward args: ``acts`` ``(B, T, U+1, V)`` with one softmax over every class: the labels,
    the big blanks, and the standard blank ``blank``: NeMo's ``num_classes``, the last class,
    or ESPnet's ``blank_id``, after the big blanks it inserts at the front of its token list;
    the big blank of ``big_blank_durations[i]`` (any order, each ``>= 2``) is class
    ``blank - 1 - i``; ``labels``, ``act_lens``, ``label_lens`` as
    :class:`RNNTLossNumba` (int64 or int32). ``sigma`` is subtracted once per arc. Costs in
    the dtype of ``acts``.
    """

    def __init__(self, blank, big_blank_durations, reduction='mean',
                 fastemit_lambda: float = 0.0, clamp: float = -1, sigma: float = 0.0):
        super().__init__()
        _check_reduction(reduction)
        check_int("blank", blank)
        if big_blank_durations is not None:
            check_durations("big_blank_durations", big_blank_durations, minimum=2,
                            ascending=False)
        for name, value in (("fastemit_lambda", fastemit_lambda), ("sigma", sigma)):
            check_float(name, value)
        self.blank = blank
        self.big_blank_durations = big_blank_durations
        self.fastemit_lambda = fastemit_lambda
        self.clamp = _module_clamp(clamp)
        self.reduction = reduction
        self.sigma = sigma

    def forward(self, acts, labels, act_lens, label_lens):
        if self.big_blank_durations is None:
            raise ValueError("big_blank_durations must be given, e.g. [2, 4, 8] "
                             "(loss_kwargs.big_blank_durations in a NeMo config)")
        return _multiblank(acts, labels, act_lens, label_lens, self.blank,
                           self.big_blank_durations, self.reduction,
                           check_float("fastemit_lambda", self.fastemit_lambda), self.clamp,
                           self.sigma)

    def extra_repr(self) -> str:
        return (f"blank={self.blank}, big_blank_durations={self.big_blank_durations}, "
                f"reduction={self.reduction!r}, fastemit_lambda={self.fastemit_lambda}, "
                f"clamp={self.clamp}, sigma={self.sigma}")


# --------------------------------------------------------------------------- install()

_NEMO_LOSSES = "nemo.collections.asr.losses.rnnt"
# loss_name -> the module-level class name NeMo's resolve_rnnt_loss instantiates for it
# ("default" shares the "warprnnt_numba" entry).
_ROUTES = {"warprnnt_numba": "RNNTLossNumba", "default": "RNNTLossNumba",
           "tdt": "TDTLossNumba", "multiblank_rnnt": "MultiblankRNNTLossNumba"}
_OURS = {"RNNTLossNumba": RNNTLossNumba, "TDTLossNumba": TDTLossNumba,
         "MultiblankRNNTLossNumba": MultiblankRNNTLossNumba}
_MISSING = object()
_saved: dict = {}          # what install() replaced in NeMo's module, for uninstall()


def install() -> None:
    """Make NeMo's own ``RNNTLoss(num_classes, loss_name=..., loss_kwargs=...)`` compute
    with this library, for ``loss_name`` ``"warprnnt_numba"``/``"default"``, ``"tdt"`` and
    ``"multiblank_rnnt"`` (NeMo configs unchanged; TDT and multi-blank then train on CPU
    too).

    Example::

        import rnnt_lattice.compat.nemo
        rnnt_lattice.compat.nemo.install()       # before the model (its RNNTLoss) is built
        model = EncDecRNNTModel(cfg)              # loss: {loss_name: tdt, tdt_kwargs: ...}

    It replaces, in ``nemo.collections.asr.losses.rnnt``, the three classes that
    ``resolve_rnnt_loss`` instantiates by :class:`RNNTLossNumba`, :class:`TDTLossNumba` and
    :class:`MultiblankRNNTLossNumba`, and marks those losses available in
    ``RNNT_LOSS_RESOLVER`` (NeMo's numba version check no longer applies; ``force_float32``
    is NeMo's). An ``RNNTLoss`` built before the call keeps its loss. Idempotent (after a
    reload of NeMo's module, which puts NeMo's classes back, it installs again); undone
    by :func:`uninstall`.

    Raises:
        ImportError: NeMo's ASR collection does not import, whatever its import raised
            (a NeMo of another version often fails with AttributeError): the message
            names NeMo and the original error is its ``__cause__``.
        RuntimeError: the NeMo found has no ``RNNT_LOSS_RESOLVER`` with these losses.
    """
    try:
        losses = importlib.import_module(_NEMO_LOSSES)
    except Exception as err:          # noqa: BLE001  a NeMo of another version fails anyhow
        # (AttributeError, TypeError... from its own imports): the promised ImportError
        raise ImportError(f"rnnt_lattice.compat.nemo.install() needs NeMo's ASR collection "
                          f"({_NEMO_LOSSES}), which does not import: {type(err).__name__}: {err}. The classes of "
                          f"rnnt_lattice.compat.nemo work without NeMo.") from err
    if _saved:
        if _saved["module"] is losses and all(getattr(losses, n, None) is c
                                              for n, c in _OURS.items()):
            return
        # NeMo's module was reloaded (importlib.reload writes its own classes and resolver
        # back) or imported anew: what it holds now is NeMo's, saved below for uninstall().
        _saved.clear()
    resolver = getattr(losses, "RNNT_LOSS_RESOLVER", None)
    if not isinstance(resolver, dict) or any(n not in resolver for n in _ROUTES):
        raise RuntimeError(f"{_NEMO_LOSSES} has no RNNT_LOSS_RESOLVER with the losses "
                           f"{sorted(_ROUTES)}: this NeMo version is not supported by install()")
    saved = {"classes": {n: getattr(losses, n, _MISSING) for n in _OURS},
             "configs": {n: resolver[n] for n in _ROUTES}}
    replaced = {}                                  # id(NeMo's config) -> ours: shared entries stay shared
    for name, config in saved["configs"].items():
        if id(config) not in replaced:
            replaced[id(config)] = dataclasses.replace(
                config, is_available=True, lib_name="rnnt_lattice", min_version=None,
                installation_msg="rnnt_lattice.compat.nemo.install()")
        resolver[name] = replaced[id(config)]
    for name, cls in _OURS.items():
        setattr(losses, name, cls)
    _saved.update(saved, module=losses)


def uninstall() -> None:
    """Undo :func:`install`: NeMo's classes and resolver entries come back. A no-op when
    not installed."""
    if not _saved:
        return
    losses = _saved["module"]
    for name, cls in _saved["classes"].items():
        if cls is _MISSING:
            if hasattr(losses, name):
                delattr(losses, name)
        else:
            setattr(losses, name, cls)
    losses.RNNT_LOSS_RESOLVER.update(_saved["configs"])
    _saved.clear()


def installed():
    """:func:`install` for a ``with`` block; uninstalls on exit unless it was installed
    before the block."""
    return scoped(_saved, install, uninstall)
