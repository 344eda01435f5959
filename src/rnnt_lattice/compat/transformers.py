"""Hugging Face transformers' Parakeet TDT and RNN-T losses on rnnt_lattice's kernels. A
training script switches with one line, before or after its models are built:

    import rnnt_lattice.compat.transformers
    rnnt_lattice.compat.transformers.install()

:func:`install` replaces the two entries of ``transformers.loss.loss_utils.LOSS_MAPPING``
that ``ParakeetForTDT`` and ``ParakeetForRNNT`` read through ``self.loss_function`` (at each
forward, so models built before the call switch too), and the public functions of
``transformers.loss.loss_tdt`` and ``loss_rnnt`` (``tdt_loss``, ``ParakeetForTDTLoss``,
``rnnt_loss``, ``ParakeetForRNNTLoss``). A model whose loss was set per model
(``model.loss_function = ...``) keeps it; a ``from transformers.loss.loss_tdt import
tdt_loss`` executed before :func:`install` keeps transformers' function (Python binds the
name at import).

Same signatures, defaults, reductions and return dtypes as transformers 5.x
(``transformers/loss/loss_tdt.py``, ``loss_rnnt.py``):

- TDT: ``token_logits`` ``(B, T, U+1, V)`` (blank included) and ``duration_logits``
  ``(B, T, U+1, D)``, each with its own log-softmax; ``sigma`` subtracted from every arc's
  token log-prob; ``reduction="mean"`` by default (the released Parakeet TDT checkpoints'
  ``rnnt_reduction``);
- RNN-T: ``logits`` ``(B, T, U+1, V)``; ``reduction="mean_volume"`` by default;
- reductions (NeMo's names): ``"mean_volume"`` = sum of the losses / sum of the target
  lengths; ``"mean_batch"`` = mean over the batch; ``"mean"`` = mean over the batch of
  loss / target length; ``"sum"``; ``"none"`` -> ``(B,)``. Every other value is a
  ``ValueError``. The loss is float32 (transformers casts the logits to float32; float64
  logits are computed in float64 here and the loss cast to float32).

The model passes ``token_logits`` and ``duration_logits`` as two slices of its joint's one
output: when they are the two adjacent halves of one tensor, that tensor is read in place
(no copy, no float32 copy of float32 logits). Otherwise they are concatenated. Label
lengths are the ones given (``ParakeetForTDT`` counts ``labels != pad_token_id``,
``ParakeetForRNNT`` counts ``labels != blank_token_id``); labels beyond them are never read.

Differences from transformers, all deliberate:

- the RNN-T loss needs no torchaudio, and neither loss fetches anything at run time;
- the loss is exact in a float64 lattice (transformers' TDT lattice is float32), and its
  gradient is the library's fused one, not autograd through an anti-diagonal loop;
- the TDT blank must be the last token (Parakeet's ``blank_token_id = vocab_size - 1``),
  and a label equal to the blank within the label lengths, or outside ``[0, V)``, is a
  ``ValueError`` naming it (transformers reads a blank label as a label);
- a sequence with no alignment costs ``+inf`` with a zero gradient (never NaN).

The fused opt-in, :func:`fuse`, goes further: a fused model's training forward (``labels``
given) computes its loss with :func:`rnnt_lattice.fused_tdt_loss` /
:func:`rnnt_lattice.fused_rnnt_loss`, the model's own ``joint`` as the joiner, so the
``(B, T, U+1, V)`` joint output is never built (Parakeet's V = 8193 + 5 durations: at B =
16, 30 s of audio and 100 tokens that tensor alone is about 20 GB in float32). A joint of
Parakeet's form, ``head(act(encoder + decoder))`` with a Linear ``head`` and ReLU or tanh,
runs as an ``rnnt_lattice.Joiner`` sharing the head's weights: on CUDA the kernel path
(the logits computed block by block in registers, never in memory). Then
``outputs.logits`` is ``None``; without ``labels`` (inference, ``generate``) the model's own
forward runs unchanged.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import types

import torch

import rnnt_lattice
from .. import functional
from .._validate import Names, check_durations, check_int, check_tensors
from ._install import scoped

__all__ = ["tdt_loss", "rnnt_loss", "ParakeetForTDTLoss", "ParakeetForRNNTLoss", "install",
           "uninstall", "installed", "fuse", "unfuse", "is_fused"]

REDUCTIONS = ("mean_volume", "mean_batch", "mean", "sum", "none")

# The messages name the blank as transformers does; the TDT loss reads the token and
# duration logits as one tensor, (B, T, U+1, V + D), and names it so.
RNNT_NAMES = Names(blank="blank_token_id")
TDT_NAMES = Names(logits="the joined token_logits and duration_logits", blank="blank_token_id")


def _check_tdt_blank(blank_token_id, token_logits) -> int:
    """TDT's ``blank_token_id``: the last token of ``token_logits`` (``V - 1`` or ``-1``)."""
    blank = check_int("blank_token_id", blank_token_id)
    V = token_logits.shape[-1]
    if blank not in (V - 1, -1):
        raise ValueError(f"blank_token_id={blank} must be the last token of token_logits "
                         f"{tuple(token_logits.shape)}, V - 1 = {V - 1} (the TDT layout; "
                         f"Parakeet's blank_token_id = vocab_size - 1)")
    return blank


def _check_tdt_logits(token_logits, duration_logits, durations: tuple) -> None:
    """Token logits ``(B, T, U+1, V)`` and duration logits ``(B, T, U+1, D)``, ``D`` the
    number of durations, on one device: joined, any other ``D`` would shift the boundary
    between tokens and durations (a silently different loss, or a misleading message)."""
    for name, x, last in (("token_logits", token_logits, "V"),
                          ("duration_logits", duration_logits, "D")):
        if x.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (B, T, U+1, {last}), got shape "
                             f"{tuple(x.shape)}")
    if token_logits.shape[:-1] != duration_logits.shape[:-1]:
        raise ValueError(f"token_logits {tuple(token_logits.shape)} and duration_logits "
                         f"{tuple(duration_logits.shape)} must share (B, T, U+1)")
    if duration_logits.shape[-1] != len(durations):
        raise ValueError(f"duration_logits {tuple(duration_logits.shape)} must have D = "
                         f"len(durations) = {len(durations)} columns, one per duration of "
                         f"{list(durations)}")
    if token_logits.device != duration_logits.device:
        raise ValueError(f"tensors on different devices: token_logits on "
                         f"{token_logits.device}, duration_logits on {duration_logits.device}")


def _check_reduction(reduction) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(repr(r) for r in REDUCTIONS)} "
                         f"(transformers' Parakeet reductions), got {reduction!r}")


def _reduce(losses: torch.Tensor, target_lengths: torch.Tensor, reduction: str) -> torch.Tensor:
    """Per-sequence losses ``(B,)`` -> transformers' (NeMo's) reduction, float32."""
    losses = losses.float()
    lengths = target_lengths.to(losses.device).float()
    if losses.shape[0] == 0 and reduction != "none":
        return losses.sum()            # an empty batch: 0, as this library's means (not 0/0)
    if reduction == "mean_volume":
        return losses.sum() / lengths.sum()
    if reduction == "mean_batch":
        return losses.mean()
    if reduction == "mean":
        return (losses / lengths).mean()
    if reduction == "sum":
        return losses.sum()
    return losses


def _float(x: torch.Tensor) -> torch.Tensor:
    """float32 and float64 logits as they are; any other dtype cast to float32 (as
    transformers' ``.float()``)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _check_floating(*named) -> None:
    """Logits ``(name, tensor)`` of a floating dtype: transformers' ``.float()`` turns bool
    and integer tensors into numbers and drops a complex one's imaginary part, but none of
    them is a joint's output."""
    for name, x in named:
        if not x.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating tensor (the joint's output), got "
                             f"{x.dtype} of shape {tuple(x.shape)}")


def _named(names: Names, targets: str, target_lengths: str) -> Names:
    """``names`` with the labels and their lengths named as the caller's arguments."""
    return dataclasses.replace(names, targets=targets, target_lengths=target_lengths)


def _joined(token_logits: torch.Tensor, duration_logits: torch.Tensor) -> torch.Tensor:
    """``(B, T, U+1, V + D)``: the one tensor whose last axis holds the tokens then the
    durations. When the two are adjacent views of one storage (the Parakeet model's slices
    ``logits[..., :V]`` and ``logits[..., V:]`` of its joint output), that window of their
    base, without a copy (``as_strided`` on the base: autograd sends the gradient to the
    base, as it would through the two views); otherwise, and under ``torch.compile``, their
    concatenation."""
    base = token_logits._base
    V, D = token_logits.shape[-1], duration_logits.shape[-1]
    if torch.compiler.is_compiling():       # TorchDynamo cannot read a storage offset
        base = None
    if (base is not None and duration_logits._base is base
            and token_logits.dtype == duration_logits.dtype
            and token_logits.dim() == duration_logits.dim()
            and token_logits.shape[:-1] == duration_logits.shape[:-1]
            and token_logits.stride() == duration_logits.stride()
            and duration_logits.storage_offset()
            == token_logits.storage_offset() + V * token_logits.stride(-1)
            and base.requires_grad == token_logits.requires_grad == duration_logits.requires_grad):
        shape = (*token_logits.shape[:-1], V + D)
        if (base.is_contiguous() and base.numel() == math.prod(shape)
                and token_logits.storage_offset() == base.storage_offset()
                and token_logits.stride() == torch.empty(shape, device="meta").stride()):
            # The window is all of a contiguous base (the model's case): a view, whose
            # gradient is the incoming one reshaped (as_strided's backward would copy it).
            return base.view(shape)
        return base.as_strided(shape, token_logits.stride(), token_logits.storage_offset())
    return torch.cat([token_logits, duration_logits], dim=-1)


def tdt_loss(token_logits: torch.Tensor, duration_logits: torch.Tensor, targets: torch.Tensor,
             logit_lengths: torch.Tensor, target_lengths: torch.Tensor, blank_token_id: int,
             durations: list, sigma: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """transformers' ``tdt_loss``: the TDT loss (Xu et al. 2023) of the token and
    duration logits.

    Example::

        >>> import torch
        >>> from rnnt_lattice.compat.transformers import tdt_loss
        >>> logits = torch.randn(2, 6, 3, 5 + 3, requires_grad=True)   # 5 tokens, 3 durations
        >>> loss = tdt_loss(logits[..., :5], logits[..., 5:], torch.tensor([[1, 2], [3, 0]]),
        ...                 torch.tensor([6, 4]), torch.tensor([2, 1]), blank_token_id=4,
        ...                 durations=[0, 1, 2])
        >>> loss.backward()

    Args:
        token_logits: ``(B, T, U+1, V)`` token logits, the blank last.
        duration_logits: ``(B, T, U+1, D)`` duration logits, ``D = len(durations)``.
        targets: ``(B, U)`` label ids. logit_lengths, target_lengths: ``(B,)``.
        blank_token_id: the blank id (``V - 1``). durations: ascending, e.g. ``[0, 1, 2, 3, 4]``.
        sigma: under-normalisation, subtracted from every arc's token log-prob.
        reduction: ``"mean_volume"``, ``"mean_batch"``, ``"mean"`` (default), ``"sum"`` or
            ``"none"`` (module docstring).

    Returns:
        The float32 loss: a scalar, or ``(B,)`` for ``"none"``.
    """
    return _tdt(token_logits, duration_logits, targets, logit_lengths, target_lengths,
                blank_token_id, durations, sigma, reduction, TDT_NAMES)


def _tdt(token_logits, duration_logits, targets, logit_lengths, target_lengths, blank_token_id,
         durations, sigma, reduction, names: Names) -> torch.Tensor:
    """:func:`tdt_loss`, its messages naming the labels and lengths as ``names`` does."""
    _check_reduction(reduction)
    check_tensors(("token_logits", token_logits), ("duration_logits", duration_logits),
                  (names.targets, targets), ("logit_lengths", logit_lengths),
                  (names.target_lengths, target_lengths))
    _check_floating(("token_logits", token_logits), ("duration_logits", duration_logits))
    durations = check_durations("durations", durations, minimum=0, ascending=True)
    _check_tdt_logits(token_logits, duration_logits, durations)
    blank = _check_tdt_blank(blank_token_id, token_logits)
    device = token_logits.device
    logits = _float(_joined(token_logits, duration_logits))
    target_lengths = target_lengths.to(device)
    losses = functional.tdt_loss_named(
        names, logits, targets.to(device), logit_lengths.to(device), target_lengths,
        blank=blank, durations=durations, sigma=sigma, omega=0.0, reduction="none",
        fastemit_lambda=0.0, clamp=-1.0, zero_infinity=False, backend="auto",
        inplace_grad=False, packed=False)
    return _reduce(losses, target_lengths, reduction)


def rnnt_loss(logits: torch.Tensor, targets: torch.Tensor, logit_lengths: torch.Tensor,
              target_lengths: torch.Tensor, blank_token_id: int,
              reduction: str = "mean_volume") -> torch.Tensor:
    """transformers' ``rnnt_loss``: the RNN-T loss of the joint's logits, without
    torchaudio.

    Example::

        >>> import torch
        >>> from rnnt_lattice.compat.transformers import rnnt_loss
        >>> logits = torch.randn(2, 6, 3, 5, requires_grad=True)       # (B, T, U+1, V)
        >>> loss = rnnt_loss(logits, torch.tensor([[1, 2], [3, 0]]), torch.tensor([6, 4]),
        ...                  torch.tensor([2, 1]), blank_token_id=4)
        >>> loss.backward()

    Args:
        logits: ``(B, T, U+1, V)`` joint token logits. targets: ``(B, U)``.
        logit_lengths, target_lengths: ``(B,)``. blank_token_id: the blank id.
        reduction: ``"mean_volume"`` (default), ``"mean_batch"``, ``"mean"``, ``"sum"`` or
            ``"none"`` (module docstring).

    Returns:
        The float32 loss: a scalar, or ``(B,)`` for ``"none"``.
    """
    return _rnnt(logits, targets, logit_lengths, target_lengths, blank_token_id, reduction,
                 RNNT_NAMES)


def _rnnt(logits, targets, logit_lengths, target_lengths, blank_token_id, reduction,
          names: Names) -> torch.Tensor:
    """:func:`rnnt_loss`, its messages naming the labels and lengths as ``names`` does."""
    _check_reduction(reduction)
    check_tensors(("logits", logits), (names.targets, targets), ("logit_lengths", logit_lengths),
                  (names.target_lengths, target_lengths))
    if logits.dim() != 4:
        raise ValueError(f"logits must have 4 dims (B, T, U+1, V), got shape {tuple(logits.shape)}")
    _check_floating(("logits", logits))
    device = logits.device
    target_lengths = target_lengths.to(device)
    losses = functional.rnnt_costs_named(names, _float(logits), targets.to(device),
                                         logit_lengths.to(device), target_lengths,
                                         blank_token_id)
    return _reduce(losses, target_lengths, reduction)


def _alias(name, value, alias, kwargs):
    """A transformers ``tdt_loss``/``rnnt_loss`` keyword name given to a ``ParakeetFor*Loss``:
    ``(value, the name it was given by)``."""
    if alias in kwargs:
        if value is not None:
            raise ValueError(f"give {name} or {alias}, not both")
        return kwargs.pop(alias), alias
    if value is None:
        raise ValueError(f"{name} (or {alias}) is required")
    return value, name


def ParakeetForTDTLoss(token_logits, duration_logits, labels=None, logit_lengths=None,
                       label_lengths=None, blank_token_id=None, durations=None, sigma=0.0,
                       reduction="mean", **kwargs):
    """transformers' ``ParakeetForTDTLoss`` (``LOSS_MAPPING["ParakeetForTDT"]``), the
    loss ``ParakeetForTDT`` calls: :func:`tdt_loss` under the model's argument names.
    ``tdt_loss``'s names ``targets=`` and ``target_lengths=`` are accepted too; other keyword
    arguments (the model's forward kwargs) are ignored, as in transformers.
    ``token_logits`` ``(B, T, U+1, V)``, ``duration_logits`` ``(B, T, U+1, D)``, ``labels``
    ``(B, U)``, ``logit_lengths``/``label_lengths`` ``(B,)``."""
    labels, y = _alias("labels", labels, "targets", kwargs)
    label_lengths, n = _alias("label_lengths", label_lengths, "target_lengths", kwargs)
    if blank_token_id is None or durations is None or logit_lengths is None:
        raise ValueError("logit_lengths, blank_token_id and durations are required")
    return _tdt(token_logits, duration_logits, labels, logit_lengths, label_lengths,
                blank_token_id, durations, sigma, reduction, _named(TDT_NAMES, y, n))


def ParakeetForRNNTLoss(logits, labels=None, logit_lengths=None, label_lengths=None,
                        blank_token_id=None, reduction="mean_volume", **kwargs):
    """transformers' ``ParakeetForRNNTLoss`` (``LOSS_MAPPING["ParakeetForRNNT"]``), the
    loss ``ParakeetForRNNT`` calls: :func:`rnnt_loss` under the model's argument names
    (``targets=``/``target_lengths=`` accepted too; other keyword arguments ignored).
    ``logits`` ``(B, T, U+1, V)``, ``labels`` ``(B, U)``, ``logit_lengths``/``label_lengths``
    ``(B,)``."""
    labels, y = _alias("labels", labels, "targets", kwargs)
    label_lengths, n = _alias("label_lengths", label_lengths, "target_lengths", kwargs)
    if blank_token_id is None or logit_lengths is None:
        raise ValueError("logit_lengths and blank_token_id are required")
    return _rnnt(logits, labels, logit_lengths, label_lengths, blank_token_id, reduction,
                 _named(RNNT_NAMES, y, n))


# --------------------------------------------------------------------------- install()

_MAPPING = {"ParakeetForTDT": ParakeetForTDTLoss, "ParakeetForRNNT": ParakeetForRNNTLoss}
# module -> {attribute: ours}: the public functions install() replaces where they exist
_ATTRS = {"transformers.loss.loss_tdt": {"tdt_loss": tdt_loss,
                                         "ParakeetForTDTLoss": ParakeetForTDTLoss},
          "transformers.loss.loss_rnnt": {"rnnt_loss": rnnt_loss,
                                          "ParakeetForRNNTLoss": ParakeetForRNNTLoss}}
_MISSING = object()
_saved: dict = {}          # what install() replaced, for uninstall()


def install() -> None:
    """Make transformers' ``ParakeetForTDT`` and ``ParakeetForRNNT`` compute their loss
    with this library: replaces ``LOSS_MAPPING["ParakeetForTDT"]`` and
    ``["ParakeetForRNNT"]`` by :func:`ParakeetForTDTLoss` and :func:`ParakeetForRNNTLoss`,
    and ``tdt_loss``, ``ParakeetForTDTLoss``, ``rnnt_loss``, ``ParakeetForRNNTLoss`` in
    ``transformers.loss.loss_tdt`` / ``loss_rnnt`` by this module's.

    Example::

        import rnnt_lattice.compat.transformers
        rnnt_lattice.compat.transformers.install()
        model = ParakeetForTDT.from_pretrained(...)      # or built before: the same
        loss = model(**inputs, labels=labels).loss      # rnnt_lattice's TDT loss

    Models read ``LOSS_MAPPING`` at each forward, so models built before the call switch
    too, except one whose ``loss_function`` was set per model. Idempotent; undone by
    :func:`uninstall`.

    Raises:
        ImportError: transformers (with ``transformers.loss.loss_utils``) does not import.
    """
    try:
        loss_utils = importlib.import_module("transformers.loss.loss_utils")
    except ImportError as err:
        raise ImportError(f"rnnt_lattice.compat.transformers.install() needs transformers "
                          f"(transformers.loss.loss_utils does not import: {err}). The "
                          f"functions of rnnt_lattice.compat.transformers work without it."
                          ) from err
    if _saved:
        return
    mapping = loss_utils.LOSS_MAPPING
    saved = {"mapping": (mapping, {k: mapping.get(k, _MISSING) for k in _MAPPING}),
             "attrs": []}
    for modname, attrs in _ATTRS.items():
        try:
            module = importlib.import_module(modname)
        except ImportError:                    # a transformers without this loss
            continue
        for name, ours in attrs.items():
            if hasattr(module, name):
                saved["attrs"].append((module, name, getattr(module, name)))
                setattr(module, name, ours)
    mapping.update(_MAPPING)
    _saved.update(saved)


def uninstall() -> None:
    """Undo :func:`install`: transformers' entries and functions come back. A no-op when
    not installed."""
    if not _saved:
        return
    mapping, entries = _saved["mapping"]
    for key, value in entries.items():
        if value is _MISSING:
            mapping.pop(key, None)
        else:
            mapping[key] = value
    for module, name, value in _saved["attrs"]:
        setattr(module, name, value)
    _saved.clear()


def installed():
    """:func:`install` for a ``with`` block; uninstalls on exit unless it was installed
    before the block."""
    return scoped(_saved, install, uninstall)


# --------------------------------------------------------------------------- fuse()

class _JointJoiner(torch.nn.Module):
    """A Parakeet ``joint`` as the fused loss's joiner: ``joiner(enc_tile, pred_tile)`` with
    ``enc_tile`` ``(B, t, 1, H)`` and ``pred_tile`` ``(B, 1, u, H)`` ->
    ``joint(decoder_hidden_states=pred_tile, encoder_hidden_states=enc_tile)`` ``(B, t, u,
    V)`` (TDT: ``V + D``). Parakeet's joint, ``head(act(enc + pred))``, acts on each ``(t,
    u)`` independently, as the fused loss requires. The joint is a submodule, so its
    parameters get their gradients through autograd."""

    def __init__(self, joint: torch.nn.Module):
        super().__init__()
        self.joint = joint

    def forward(self, enc_tile, pred_tile):
        return self.joint(decoder_hidden_states=pred_tile, encoder_hidden_states=enc_tile)


_FUSED = "_rnnt_lattice_fused"           # the attribute marking a fused model: (tile, activation)


def _joint_activation(joint: torch.nn.Module, config) -> str | None:
    """The activation of a joint of Parakeet's form, ``head(act(enc + dec))`` with a Linear
    ``head`` holding every parameter: the first of tanh and ReLU (the config's
    ``hidden_act`` first) whose :class:`rnnt_lattice.Joiner` around the head gives the
    joint's logits on random inputs (one call on the joint's device: at :func:`fuse`, not
    per step); None for any other joint (it keeps the tile path's joiner)."""
    head = getattr(joint, "head", None)
    if not isinstance(head, torch.nn.Linear):
        return None
    if {id(p) for p in joint.parameters()} != {id(p) for p in head.parameters()}:
        return None
    if any(not isinstance(m, (torch.nn.ReLU, torch.nn.Tanh, torch.nn.Identity))
           for m in joint.modules() if m is not joint and m is not head):
        return None                                  # dropout, a norm: the joint's own forward
    named = getattr(config, "hidden_act", None)
    w = head.weight
    if w.device.type == "meta":
        return None
    g = torch.Generator(device="cpu").manual_seed(0)
    e = torch.randn(1, 2, 1, head.in_features, generator=g).to(w)
    d = torch.randn(1, 1, 3, head.in_features, generator=g).to(w)
    with torch.no_grad():
        want = joint(decoder_hidden_states=d, encoder_hidden_states=e)
        if not torch.equal(want, joint(decoder_hidden_states=d, encoder_hidden_states=e)):
            return None                              # random (dropout in its forward)
        for act in sorted(("relu", "tanh"), key=lambda a: a != named):
            got = rnnt_lattice.Joiner.sharing(head, act)(e, d)
            if got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                return act
    return None


def _joiner(model) -> torch.nn.Module:
    """The fused loss's joiner of a fused model: an :class:`rnnt_lattice.Joiner` sharing the
    joint's head when :func:`fuse` found the joint's form and the head's parameters are
    plain tensors (FSDP2's sharded ones are read through the joint's own forward), else
    the joint itself (:class:`_JointJoiner`)."""
    act = getattr(model, _FUSED)[1]
    head = getattr(model.joint, "head", None)
    if act is not None and all(type(p.data) is torch.Tensor for p in head.parameters()):
        return rnnt_lattice.Joiner.sharing(head, act)
    return _JointJoiner(model.joint)


def _fused_forward(self, input_features=None, attention_mask=None, decoder_input_ids=None,
                   decoder_cache=None, use_decoder_cache=None, encoder_outputs=None,
                   labels=None, **kwargs):
    """A fused Parakeet model's forward (:func:`fuse`): with ``labels`` (and no decoder
    cache) the loss of ``joint(encoder, decoder)`` tile by tile and ``logits=None``;
    otherwise the model's own forward."""
    original = type(self).forward.__get__(self)
    if labels is None or decoder_cache is not None or use_decoder_cache:
        return original(input_features=input_features, attention_mask=attention_mask,
                        decoder_input_ids=decoder_input_ids, decoder_cache=decoder_cache,
                        use_decoder_cache=use_decoder_cache, encoder_outputs=encoder_outputs,
                        labels=labels, **kwargs)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    if encoder_outputs is None:
        encoder_outputs = self.get_audio_features(input_features=input_features,
                                                  attention_mask=attention_mask, **kwargs)
    enc = encoder_outputs.pooler_output                     # (B, T, H)
    pred = self.decoder(decoder_input_ids)                  # (B, U+1, H)
    logit_lengths = encoder_outputs.attention_mask.sum(-1)  # (B,)
    config = self.config
    joiner = _joiner(self)
    tile = getattr(self, _FUSED)[0]
    durations = getattr(config, "durations", None)
    if durations is not None:                               # ParakeetForTDT
        label_lengths = (labels != config.pad_token_id).sum(-1)
        reduction = kwargs.get("reduction", "mean")
        _check_reduction(reduction)
        losses = rnnt_lattice.fused_tdt_loss(
            joiner, enc, pred, labels, logit_lengths, label_lengths,
            blank=config.blank_token_id, durations=list(durations),
            sigma=kwargs.get("sigma", 0.0), tile=tile, reduction="none")
    else:                                                   # ParakeetForRNNT
        label_lengths = (labels != config.blank_token_id).sum(-1)
        reduction = kwargs.get("reduction", "mean_volume")
        _check_reduction(reduction)
        losses = rnnt_lattice.fused_rnnt_loss(
            joiner, enc, pred, labels, logit_lengths, label_lengths,
            blank=config.blank_token_id, tile=tile, reduction="none")
    loss = _reduce(losses, label_lengths, reduction)
    output_cls = importlib.import_module(type(self).__module__).ParakeetRNNTOutput
    out = output_cls(loss=loss, logits=None,
                     last_hidden_state=encoder_outputs.last_hidden_state,
                     pooler_output=encoder_outputs.pooler_output,
                     hidden_states=encoder_outputs.hidden_states,
                     attentions=encoder_outputs.attentions, decoder_cache=None)
    if return_dict:
        return out
    # The model's own tuple is to_tuple(): the output's fields in their order, None dropped
    # (transformers 5: last_hidden_state, pooler_output, hidden_states, attentions, loss,
    # logits, decoder_cache). Its logits are a tensor where these are None: None stays in
    # their place, so that code unpacking by position finds every field where the model
    # puts it.
    return tuple(getattr(out, f.name) for f in dataclasses.fields(out)
                 if f.name == "logits" or getattr(out, f.name) is not None)


def fuse(model, *, tile=None):
    """The fused opt-in: ``model`` (a ``ParakeetForTDT`` or ``ParakeetForRNNT``) computes
    its training loss without the ``(B, T, U+1, V)`` joint output.

    Example::

        from rnnt_lattice.compat.transformers import fuse
        model = fuse(ParakeetForTDT.from_pretrained(...))
        out = model(input_features=..., attention_mask=..., decoder_input_ids=...,
                    labels=labels)                # out.loss: the exact TDT loss; out.logits: None
        out.loss.backward()

    With ``labels`` given (and no decoder cache), the forward runs the encoder and the
    decoder as the model does, then :func:`rnnt_lattice.fused_tdt_loss` (``TDT``) or
    :func:`rnnt_lattice.fused_rnnt_loss` (RNN-T) with the model's own ``joint`` as the
    joiner, tile by tile (forward under ``no_grad``, recomputed in the backward pass), and
    the reduction of the model's loss (``reduction=`` and, for TDT, ``sigma=`` forward
    kwargs as with the model's loss; defaults ``"mean"`` for TDT, ``"mean_volume"`` for
    RNN-T). A joint of Parakeet's form, ``head(act(encoder + decoder))`` (a Linear ``head``,
    ReLU or tanh: checked here, once, on random inputs), runs as an
    :class:`rnnt_lattice.Joiner` sharing the head's parameters, which on CUDA takes the
    kernel path (the logits never in memory, docs/math.md section 12); any other joint, or
    a head whose parameters FSDP2 shards, runs through its own forward, tile by tile. The loss and the gradients of every parameter equal those of :func:`install`'s
    loss on the materialised logits, to float rounding. The output's ``logits`` is
    ``None``: the joint output is never built (call ``model.joint`` on a slice if you need
    some of it). A per-model ``loss_function`` is not called. Without ``labels``
    (evaluation, ``generate``) the model's own forward runs, ``logits`` included.

    Args:
        model: a transformers Parakeet transducer model.
        tile: the fused loss's tile (rows, or a byte budget such as ``"64MiB"``); None: its
            default.

    Returns:
        ``model`` itself (its ``forward`` replaced on the instance; :func:`unfuse` restores it).
    """
    if not (hasattr(model, "joint") and hasattr(model, "decoder")
            and hasattr(model, "get_audio_features") and hasattr(model, "config")):
        raise ValueError(f"fuse() takes a transformers ParakeetForTDT or ParakeetForRNNT "
                         f"model, got {type(model).__name__}")
    setattr(model, _FUSED, (tile, _joint_activation(model.joint, model.config)))
    model.forward = types.MethodType(_fused_forward, model)
    return model


def unfuse(model):
    """Undo :func:`fuse`: the model's own forward again. Returns ``model``."""
    if is_fused(model):
        del model.forward
        delattr(model, _FUSED)
    return model


def is_fused(model) -> bool:
    """Whether :func:`fuse` was applied to ``model``."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a transformers Parakeet model (an nn.Module), got "
                         f"{type(model).__name__}")
    return _FUSED in vars(model)
