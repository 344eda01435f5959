"""Argument checks shared by every public entry point.

Every failure is a ``ValueError`` that names the argument and the shapes or values
involved. Checks that need to read tensor *values* (length ranges, target ids, windows,
boundaries) run on the host only where :func:`may_read_values` says so: by default for
CPU tensors, outside ``torch.compile``. On CUDA a host read would synchronise the hot path,
so there the lengths, targets and boundary are checked on the device instead
(:func:`device_value_check`): one kernel writes whether each rule holds and which
sequences break one, a bad sequence's loss becomes NaN, and a device-side assert per
rule (:func:`device_assert`) names the argument and the rule, as PyTorch's own kernels do
for an index out of range. The windows (:func:`check_window_args`,
:func:`check_pruning_args`) take the same course with torch operations, and so does
``pack_logits`` while traced. :func:`set_input_checks` chooses where the checks run.
"""
from __future__ import annotations

import functools
import operator
import os
import re
from dataclasses import dataclass

import numpy as np
import torch

from ._memo import memo
from ._rules import assert_rules, device_assert
from ._types import LossOptions
from .topology import K2_TYPES, by_name, check_topology

_REDUCTIONS = ("none", "sum", "mean")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTS = (torch.int32, torch.int64)


# --------------------------------------------------------------------------- where values are checked
INPUT_CHECKS = ("auto", "host", "device")
_input_checks = {"mode": None}          # None: not yet read from RNNT_LATTICE_INPUT_CHECKS


def _check_mode(mode, where: str) -> str:
    if mode not in INPUT_CHECKS:
        raise ValueError(f"{where} must be one of {INPUT_CHECKS}, got {mode!r}")
    return mode


def input_checks() -> str:
    """The mode :func:`set_input_checks` set (first use: ``RNNT_LATTICE_INPUT_CHECKS``, else
    ``"auto"``)."""
    if _input_checks["mode"] is None:
        _input_checks["mode"] = _check_mode(os.environ.get("RNNT_LATTICE_INPUT_CHECKS", "auto"),
                                            "RNNT_LATTICE_INPUT_CHECKS")
    return _input_checks["mode"]


def set_input_checks(mode: str) -> str:
    """Where the value checks of the lengths, targets and boundary run; returns the mode
    in effect before.

    - ``"auto"`` (the default): on the host for CPU tensors (a ``ValueError`` naming the
      argument, the value and the rule), on the device for CUDA tensors (no host
      synchronisation: a bad sequence's loss is NaN and a device-side assert names the
      argument and the rule; the CUDA error surfaces at the next synchronisation).
    - ``"host"``: on the host everywhere, the CPU's ``ValueError`` on CUDA too, at the cost
      of one synchronisation per call: for debugging a device-side assert.
    - ``"device"``: on the device wherever the Triton kernels run (CUDA tensors, or CPU
      tensors under the Triton interpreter; elsewhere on the host).

    The environment variable ``RNNT_LATTICE_INPUT_CHECKS`` sets the mode a process starts
    with, for code that cannot call this function (a framework that calls the loss)."""
    before = input_checks()
    _input_checks["mode"] = _check_mode(mode, "mode")
    return before


_device_checks_on: dict = {}     # device type -> whether the device check's kernel runs there


def _device_checks_run_on(device: torch.device) -> bool:
    """Whether :func:`device_value_check`'s kernel runs on ``device``: CUDA with Triton, or
    the CPU under the Triton interpreter (decided once per device type)."""
    runs = _device_checks_on.get(device.type)
    if runs is None:
        runs = False
        if device.type in ("cuda", "cpu"):
            try:
                from . import gpu
                runs = device.type == "cuda" or gpu.INTERPRETED
            except ImportError:
                pass
        _device_checks_on[device.type] = runs
    return runs


def tracing(x) -> bool:
    """Whether a call on ``x`` is being traced rather than run: TorchDynamo traces
    (``torch.compiler.is_compiling()``), or ``x`` is a fake tensor. In torch 2.7 and 2.8
    (2.9.1 too, by the README's table) TorchDynamo runs the Python kernel of a
    ``CompositeImplicitAutograd`` op (the torchaudio compat module's) on fake tensors with
    ``is_compiling()`` False: such a call has no values to read and no kernels to run (it
    takes the custom op, as while tracing). ``torch.jit.trace`` traces too: its shapes are
    traced tensors, and the custom op is what its graph can record."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return True
    if type(x) is torch.Tensor or not isinstance(x, torch.Tensor):
        return False                                    # the eager path: one type check
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(x)


_functorch = getattr(torch._C, "_functorch", None)
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def check_untransformed(*named) -> None:
    """``NotImplementedError`` inside a ``torch.func`` transform (vmap, grad, ...), naming
    the first tensor ``(name, x)`` of ``named`` that is the transform's (vmap's batched
    tensors, grad's) where there is one: the kernels read a tensor's memory, which such a
    tensor does not have, and inside a transform PyTorch refuses every autograd Function
    that does not define its transforms' rules (ours: their backward is a kernel, not
    operations a transform could batch or differentiate). Outside a transform this is
    one call. Never called while tracing (TorchDynamo would break the graph on it)."""
    if not _transforms_active():
        return
    which = "the call"
    for name, x in named:
        if (isinstance(x, torch.Tensor) and _functorch is not None
                and _functorch.is_functorch_wrapped_tensor(x)):
            which = f"{name} is a tensor of one, and the call"
            break
    raise NotImplementedError(
        f"rnnt_lattice does not run inside torch.func transforms (vmap, grad, jacrev, ...): "
        f"{which} runs inside one. Its kernels read the tensors' memory and its autograd "
        "Functions define no transform rules. The losses are batched over B already: call "
        "them on the whole batch (reduction='none' gives one loss per sequence), and take "
        "gradients with loss.backward() or torch.autograd.grad")


def check_unbatched_upstream(grad: torch.Tensor) -> None:
    """``NotImplementedError`` for a batched upstream gradient in a kernel's backward:
    ``autograd.grad(..., is_grads_batched=True)`` and ``jacobian(..., vectorize=True)`` run
    the backward on a batched tensor (vmap's older form, which no transform flag shows),
    whose memory the kernels cannot read (it failed with "Batching rule not implemented
    for aten::detach")."""
    batched = getattr(_functorch, "is_legacy_batchedtensor", None)
    if batched is not None and batched(grad):
        raise NotImplementedError(
            "rnnt_lattice's kernels cannot run a batched backward (autograd.grad's "
            "is_grads_batched=True, jacobian's vectorize=True): the upstream gradient is a "
            "batched tensor, whose memory they cannot read. Take one gradient per vector "
            "(a loop); the losses on logits batch it with backend='torch'")


def check_site(x: torch.Tensor) -> str | None:
    """Where the value checks of a call on ``x``'s device run: ``"host"``, ``"device"``, or
    None (not at all: while ``torch.compile`` traces, where there are no values, or on the
    meta device). The one rule of every value check (``set_input_checks``)."""
    device = x.device
    if device.type == "meta" or tracing(x):
        return None
    mode = _input_checks["mode"] or input_checks()
    if mode == "host":
        return "host"
    if (mode == "device" or device.type == "cuda") and _device_checks_run_on(device):
        return "device"
    return "host"


def may_read_values(x: torch.Tensor) -> bool:
    """Whether a check may read the values of ``x`` (and of the tensors beside it) on the
    host (:func:`check_site`)."""
    return check_site(x) == "host"


# The rules of the device check, in the order of the flags its kernel writes: one assert
# each (a launch on CUDA), so the rules are few and each message names its arguments.
DEVICE_RULES = ("lengths", "targets", "boundary")


@functools.lru_cache(maxsize=1)
def _input_check():
    """``gpu.input_check``, imported on first use (Triton loads with it)."""
    from .gpu import input_check
    return input_check


def device_value_check(targets, logit_lengths, target_lengths, *, T: int, U: int, V: int,
                       blank: int | None, classes: tuple = (), boundary=None,
                       names: Names | None = None) -> torch.Tensor:
    """The value checks on the device, without a host synchronisation: one kernel
    (``gpu.input_check``) decides, for every sequence ``b``, the rules of
    :data:`DEVICE_RULES` -- ``0 <= logit_lengths[b] <= T`` and ``0 <= target_lengths[b] <=
    U``; ``targets[b, u]`` in ``[0, V)`` for ``u < target_lengths[b]`` and not the ``blank``
    (None: allowed) nor one of ``classes`` (multi-blank's big blanks); k2's ``boundary``
    within the lengths -- then one :func:`device_assert` per rule that can fail. Returns
    ``(B,)`` float32: NaN for a sequence that breaks a rule, 0 otherwise, for the caller
    to add to its costs (the loss of a bad sequence is NaN, never a plausible value).
    ``targets`` None: lengths (and boundary) only; ``names``: how the asserts name the
    arguments (:class:`Names`; None: as ours)."""
    ok, nan_rows = _input_check()(targets, logit_lengths, target_lengths, boundary, T=T, U=U,
                                  V=V, blank=blank, classes=classes)
    applies = (True, targets is not None and U > 0, boundary is not None)
    words = (names or OURS).words()
    for i, rule in enumerate(DEVICE_RULES):
        if applies[i]:                 # a rule that cannot fail costs no assert launch
            device_assert(ok[i], rule, words)
    return nan_rows


@dataclass(frozen=True)
class Checked:
    """A call's arguments after :func:`check_call`: what the backends read, and trust."""

    logits: torch.Tensor          # (B, T, U+1, V) or rows (N, V): contiguous, half types promoted
                                  # unless the backend reads them (a LogitsSpec for the fused losses)
    targets: torch.Tensor         # (B, U), int64 (int32 kept with int64_ids=False), contiguous
    logit_lengths: torch.Tensor   # (B,), idem
    target_lengths: torch.Tensor  # (B,), idem
    blank: int                    # in [0, V_tok)
    boundary: torch.Tensor | None = None   # (B, 4) int64 on the logits' device, or None
    nan_rows: torch.Tensor | None = None   # (B,) float32, NaN for a sequence the device check
                                  # found bad (added to its cost); None: checked on the host
    grid: tuple | None = None     # (B, T, U+1) of a packed layout (T read from the lengths)
    traced: bool = False          # traced, not run: no values, no backend (the custom op's)


def check_tensors(*named, prefix: str = "", error: type = ValueError) -> None:
    """Each ``(name, x)`` of ``named`` a tensor; else ``error`` (a ValueError, or a peer's
    exception type that is one) naming the first that is not, ``prefix`` before the name."""
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise error(f"{prefix}{name} must be a torch.Tensor, got {type(x).__name__}")


def _shape(x) -> str:
    """``"(2, 5, 4, 6)"``: written one size at a time, which TorchDynamo can trace where the
    sizes are symbolic (``torch.compile(dynamic=True)``; ``str`` of a tuple it cannot), so
    that a compiled call's error still names the shapes."""
    sizes = [f"{n}" for n in x.shape]
    return "(" + ", ".join(sizes) + ("," if len(sizes) == 1 else "") + ")"


@dataclass(frozen=True)
class LogitsSpec:
    """Logits known by their shape, dtype and device only: the fused losses' ``(B, T,
    U+1, V)`` logits, which never exist whole. ``check_lattice_args`` takes it in place of
    a tensor (it reads nothing else of the logits)."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device

    def dim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class Names:
    """How an entry point's messages name the call's tensors: by the caller's own argument
    names (NeMo's and warp-transducer's ``acts``, ``labels``, ``act_lens``, ``label_lens``,
    so that a message names what the user passed) and, for logits known by their shape only
    (the fused losses), the words for them and the ``(name, tensor)`` whose shape sets the
    batch size ``B``, the padded frames ``T`` and label positions ``U+1`` (by default the
    logits themselves). :data:`OURS` names them as :func:`rnnt_lattice.rnnt_loss` does."""

    logits: str = "logits"
    targets: str = "targets"
    logit_lengths: str = "logit_lengths"
    target_lengths: str = "target_lengths"
    blank: str = "blank"
    spec: str | None = None      # the fused losses: "the joiner's logits (B, T, U+1, V) = ..."
    B: tuple | None = None
    T: tuple | None = None
    U: tuple | None = None

    def shaped(self, logits) -> str:
        """The logits in a message: ``"acts (2, 5, 4, 6)"``."""
        return self.spec or f"{self.logits} {_shape(logits)}"

    def source(self, which: str, logits) -> tuple:
        """``(name, tensor)`` whose shape sets ``which`` (``"B"``, ``"T"`` or ``"U"``)."""
        return getattr(self, which) or (self.logits, logits)

    def lengths(self) -> tuple:
        return self.logit_lengths, self.target_lengths

    def words(self) -> tuple:
        """The targets' and the lengths' names, as ``_rules.device_message`` takes them."""
        return self.targets, self.logit_lengths, self.target_lengths

    def joined(self) -> str:
        """The five argument names in one string, as the custom op's schema takes them (it
        has no list of strings; the op runs on logits, never on a :attr:`spec`)."""
        return "\n".join((self.logits, self.targets, self.logit_lengths, self.target_lengths,
                          self.blank))

    @staticmethod
    def split(joined: str) -> "Names":
        """The :class:`Names` of :meth:`joined`'s string."""
        return _split_names(joined)


OURS = Names()


@memo(maxsize=64)
def _split_names(joined: str) -> Names:
    return Names(*joined.split("\n"))


def check_lattice_args(
    logits,
    targets: torch.Tensor,
    logit_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int,
    *,
    int64_ids: bool = True,
    n_tokens: int | None = None,
    grid: tuple[int, int, int] | None = None,
    allow_blank_targets: bool = False,
    names: Names = OURS,
    site: str | None = "unknown",
) -> tuple:
    """Validate the lattice inputs and return them normalised: ``(targets, logit_lengths,
    target_lengths, blank)`` as :class:`Checked` holds them (:func:`check_call`'s part).
    ``int64_ids=False`` keeps int32 ids and lengths as they are (contiguous): for a backend
    whose kernels read either, which saves a conversion per tensor on every call.
    ``n_tokens``: only the first ``n_tokens`` classes of the last axis are tokens (TDT: the
    durations follow); the blank and the target ids must lie among them. ``grid``:
    ``(B, T, U+1)`` of a node -> row layout whose logits are rows ``(N, V)`` (packed or
    pruned); the shapes are checked against the grid. ``allow_blank_targets``: a target equal
    to the blank is an ordinary label (k2's semantics), not a ValueError. ``site``: the
    caller's :func:`check_site` of the logits, if it has it. ``logits`` may be
    a :class:`LogitsSpec` (shapes only), ``names`` says how messages name the tensors. The
    rank of ``logits`` is the caller's check (``check_logits_rank``, before it reads the
    logits' device)."""
    named = ((names.targets, targets), (names.logit_lengths, logit_lengths),
             (names.target_lengths, target_lengths))
    check_tensors(*named)
    if targets.dim() != 2:
        raise ValueError(f"{names.targets} must have 2 dims (B, U), got {targets.dim()} dims "
                         f"with shape {_shape(targets)}")
    for name, x in named[1:]:
        if x.dim() != 1:
            raise ValueError(f"{name} must have 1 dim (B,), got shape {_shape(x)}")

    if logits.dtype not in _FLOATS:
        raise ValueError(f"{names.logits} must be float16, bfloat16, float32 or float64, got "
                         f"{logits.dtype}")
    for name, x in named:
        if x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {x.dtype}")

    B, T, U1, V = logits.shape if grid is None else (*grid, logits.shape[1])
    for name, x in named:
        if x.shape[0] != B:
            src, t = names.source("B", logits)
            raise ValueError(
                f"batch sizes differ: {src} {_shape(t)} has B={B} but {name} has shape {_shape(x)}")
    if targets.shape[1] != U1 - 1:
        src, t = names.source("U", logits)
        raise ValueError(
            f"{names.targets} {_shape(targets)} must have U = {U1 - 1} columns, one fewer than "
            f"the U+1 = {U1} label positions of {src} {_shape(t)}"
            + ("" if grid is None else f" with the lattice grid (B, T, U+1) = {grid}"))
    if V < 1:
        raise ValueError(f"{names.shaped(logits)} must have a vocabulary V >= 1")
    if n_tokens is not None and n_tokens < 1:
        raise ValueError(f"{names.shaped(logits)} must hold V_tok >= 1 token classes before "
                         f"the {V - n_tokens} durations in the last axis")

    for name, x in named:
        if x.device != logits.device:
            raise ValueError(f"tensors on different devices: {names.source('B', logits)[0]} on "
                             f"{logits.device}, {name} on {x.device}")

    blank = check_int(names.blank, blank)
    Vt = V if n_tokens is None else n_tokens
    what = "V" if n_tokens is None else "V_tok"
    if not -Vt <= blank < Vt:
        raise ValueError(f"{names.blank}={blank} is outside [-{what}, {what}) = [{-Vt}, {Vt}) for "
                         f"{names.shaped(logits)}" + ("" if n_tokens is None else
                         f": its last axis holds V_tok = {Vt} tokens, then {V - Vt} "
                         f"durations; check the blank and the durations"))
    blank = blank % Vt

    if int64_ids:
        targets, logit_lengths, target_lengths = (
            x.long() for x in (targets, logit_lengths, target_lengths))
    targets, logit_lengths, target_lengths = (
        x.contiguous() for x in (targets, logit_lengths, target_lengths))

    if site == "unknown":
        site = check_site(logits)
    if B and site == "host":
        check_lengths(logit_lengths, target_lengths, T, U1 - 1, names.source("T", logits),
                      names.source("U", logits), names.lengths())
        check_targets(targets, target_lengths, blank, Vt, allow_blank_targets, what=what,
                      name=names.targets, of=names.spec)

    return targets, logit_lengths, target_lengths, blank


def check_logits_rank(logits, *, rows: bool = False, name: str = "logits") -> int:
    """``V``, the size of the last axis of ``logits``: a tensor of 4 dims ``(B, T, U+1, V)``,
    or with ``rows`` of 2 dims ``(N, V)`` (the rows of a packed or pruned layout). ``name``:
    the caller's name for it."""
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if logits.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {logits.layout} "
                         f"with shape {_shape(logits)}")
    if rows and logits.dim() != 2:
        raise ValueError(f"{name} must have 2 dims (N, V) (rows of a packed or pruned layout), "
                         f"got {logits.dim()} dims with shape {_shape(logits)}")
    if not rows and logits.dim() != 4:
        raise ValueError(f"{name} must have 4 dims (B, T, U+1, V), got {logits.dim()} dims "
                         f"with shape {_shape(logits)}")
    return logits.shape[-1]


def check_call(logits, targets, logit_lengths, target_lengths, blank, topology, *,
               traced: bool = False, int64_ids: bool = True, native_low_precision: bool = False,
               node_rows: torch.Tensor | None = None, packed: bool = False, boundary=None,
               allow_blank_targets: bool = False, names: Names = OURS,
               inplace_grad: bool = False, device_rules: tuple = ()) -> Checked:
    """Every check of one call on logits, in one place, into the :class:`Checked` plan
    that the backend runs without checking again (``_backends.prepare_call`` calls it once
    per call of every entry point on logits).

    In order: a ``torch.func`` transform (:func:`check_untransformed`), unless the call is
    traced (``traced``: TorchDynamo traces it, or the logits are fake tensors,
    :func:`tracing`; then ids become int64, half types are promoted and ``inplace_grad`` is
    off, as the custom op reads them); the layout (``packed``: the rows, and the lengths
    read once on the host for the grid's ``T`` and the row count; ``node_rows``: a given
    node -> row map ``(B, T, U+1)``, the logits its rows ``(N, V)``); the shapes, dtypes,
    devices (TDT: a token before the durations) and, where :func:`check_site` says
    ``"host"``, the values of :func:`check_lattice_args`; the ``topology`` against V and
    the blank (``topology.check_topology``, entered once); the targets
    against its fixed classes; k2's ``boundary``; ``inplace_grad``'s rule, on the logits as
    given; last, once no host rule can raise, the caller's own rules checked on the device
    (``device_rules``, ``_rules.assert_rules``) and, where the site is ``"device"``, the
    same value rules on the device (:func:`device_value_check`, no host synchronisation).
    The logits come back contiguous,
    float16/bfloat16 promoted to float32 unless ``native_low_precision`` (the backend reads
    them; autograd casts the gradient back); ``int64_ids=False`` keeps int32 ids. A
    :class:`LogitsSpec` stands for logits known by shape only (the fused losses), and
    ``names`` says how the messages name the caller's tensors; ``device_rules``: the
    ``(rule, bad (B,))`` pairs of the caller's own check on the device (the pruned loss's
    windows, :func:`check_window_args`), asserted here and their NaN rows joined to this
    one's."""
    if type(allow_blank_targets) is not bool:                 # (the usual call: no call)
        allow_blank_targets = check_flag("allow_blank_targets", allow_blank_targets)
    traced = traced or tracing(logits)
    if traced:
        int64_ids, native_low_precision, inplace_grad = True, False, False
    else:
        check_untransformed((names.logits, logits), (names.targets, targets),
                            (names.logit_lengths, logit_lengths),
                            (names.target_lengths, target_lengths), ("boundary", boundary),
                            ("node_rows", node_rows))
    grid = None if node_rows is None else tuple(node_rows.shape)
    if packed:
        check_packed_args(logits, targets, logit_lengths, target_lengths, names)
    elif not isinstance(logits, LogitsSpec):
        check_logits_rank(logits, rows=grid is not None, name=names.logits)
    V = logits.shape[-1]
    n_tokens = V - topology.n_durations if topology.n_durations else None  # TDT: the tokens
    site = check_site(logits)
    if packed:
        grid = _packed_grid(logits, targets, logit_lengths, target_lengths, names)
    targets, logit_lengths, target_lengths, blank = check_lattice_args(
        logits, targets, logit_lengths, target_lengths, blank, int64_ids=int64_ids,
        n_tokens=n_tokens, grid=grid, allow_blank_targets=allow_blank_targets, names=names,
        site=site)
    x = logits
    dtype = x.dtype
    if dtype in (torch.float16, torch.bfloat16) and not native_low_precision:
        dtype = torch.float32
    if isinstance(x, LogitsSpec):
        x = LogitsSpec(x.shape, dtype, x.device)
    elif dtype != x.dtype or not x.is_contiguous():
        x = x.to(dtype).contiguous()
    B, T, U1 = grid if grid is not None else x.shape[:3]
    blank = _check_topology(topology, V, blank)
    check_class_targets(targets, target_lengths, topology, site, name=names.targets)
    boundary = check_boundary(boundary, B, x.device, logit_lengths, target_lengths, names)
    if inplace_grad:
        # On what the user passed: any copy (dtype, layout) would defeat it.
        check_inplace(logits, native_low_precision, names.logits)
    # Last, once no rule of the host can raise: an assert queued for a call that then raises
    # on the host would still fire, on a CUDA device for good.
    nan_rows = assert_rules(*device_rules) if device_rules else None
    if B and site == "device":
        # The host checks above were skipped (no values read): the same rules on the device.
        bad = device_value_check(
            targets, logit_lengths, target_lengths, T=T, U=U1 - 1,
            V=V if n_tokens is None else n_tokens,
            blank=None if allow_blank_targets else blank, classes=_fixed_classes(topology),
            boundary=boundary, names=names)
        nan_rows = bad if nan_rows is None else nan_rows + bad      # NaN where either is
    return Checked(x, targets, logit_lengths, target_lengths, blank, boundary,
                   nan_rows, grid if packed else None, traced)


# Per-call work that depends only on hashable options, done once per value.
@memo(maxsize=256)
def _check_topology(topology, V: int, blank: int) -> int:
    return check_topology(topology, V, blank)


@memo(maxsize=256)
def _fixed_classes(topology) -> tuple:
    """The classes an arc kind of ``topology`` reads as fixed (multi-blank's big blanks)."""
    return tuple(sorted({k.class_id for k in topology.kinds if k.reads == "class"}))


def check_class_targets(targets: torch.Tensor, target_lengths: torch.Tensor, topology,
                        site: str | None = "unknown", *, name: str = "targets") -> None:
    """Value check (where :func:`may_read_values`; ``site``: the caller's
    :func:`check_site`): no label may be a class that an arc kind of ``topology`` reads as a
    fixed class (multi-blank's big blanks): a label cannot be a blank. ``targets`` and
    ``target_lengths`` are already checked (``check_lattice_args``)."""
    U = targets.shape[1]
    if not _fixed_classes(topology) or U == 0 or targets.shape[0] == 0:
        return
    if (check_site(targets) if site == "unknown" else site) != "host":
        return
    fixed = {k.class_id: k.name for k in topology.kinds if k.reads == "class"}
    y = _host_values(targets)
    bad = (np.arange(U) < _host_values(target_lengths)[:, None]) & np.isin(y, sorted(fixed))
    if bad.any():
        b, u = (int(i) for i in np.argwhere(bad)[0])
        c = int(y[b, u])
        raise ValueError(f"{name}[{b}, {u}] = {c} is the class of the arc kind {fixed[c]!r} of "
                         f"topology {topology.name!r}: a label cannot be a blank")


def _host_values(x: torch.Tensor):
    """The values of ``x`` as a NumPy array on the host: a view for a CPU tensor, one copy
    (one synchronisation) for a device tensor. The value checks compute on these: on a few
    hundred ids, NumPy's operations cost a fraction of PyTorch's dispatch, and a check runs
    in every call on the host path."""
    return (x.detach() if x.requires_grad else x).cpu().numpy()


def check_lengths(logit_lengths, target_lengths, T: int, U: int, t_src, u_src,
                  names: tuple = ("logit_lengths", "target_lengths")) -> None:
    """Value check: ``0 <= T_b <= T`` and ``0 <= U_b <= U``, the padded sizes of the tensors
    ``t_src`` and ``u_src``, each ``(name, tensor)`` (named in the message: formatted only
    on an error, so that a passing check costs no string work); ``names``: the caller's
    names of the two lengths. Call it where :func:`may_read_values`."""
    for name, x, hi, dim, (src, tensor) in ((names[0], logit_lengths, T, "T", t_src),
                                            (names[1], target_lengths, U, "U", u_src)):
        if x.numel() == 0:
            continue
        if x.numel() <= 128:          # a batch's few lengths: Python ints beat two reductions
            v = x.tolist()
            lo_v, hi_v = min(v), max(v)
        else:
            v = _host_values(x)
            lo_v, hi_v = int(v.min()), int(v.max())
        if lo_v < 0:
            b = int(np.argmin(v))
            raise ValueError(f"{name} must be >= 0, got {name}[{b}] = {lo_v}")
        if hi_v > hi:
            b = int(np.argmax(v))
            raise ValueError(f"{name}[{b}] = {hi_v} exceeds the padded size {dim} = {hi} of "
                             f"{src} {_shape(tensor)}")


def check_targets(targets, target_lengths, blank: int, V: int, allow_blank_targets: bool,
                  joint: bool = False, what: str = "V", name: str = "targets",
                  of: str | None = None) -> None:
    """Value check: every target before its length in ``[0, V)`` and, unless
    ``allow_blank_targets``, not the blank (``what``: the bound's name in the message,
    ``"V_tok"`` for TDT's token classes; ``name``: the caller's name of the targets;
    ``of``: the logits that set V where the call has none, the fused losses' joiner's).
    ``joint``: one message for both rules (the simple losses'). The lengths are already
    checked (``0 <= U_b <= U``)."""
    U = targets.shape[1]
    if U == 0 or targets.shape[0] == 0:
        return
    y, n = _host_values(targets), _host_values(target_lengths)
    valid = np.arange(U) < n[:, None]
    out = (y < 0) | (y >= V)
    blank_at = None if allow_blank_targets else y == blank
    bad = out if blank_at is None else out | blank_at
    bad &= valid
    if not np.count_nonzero(bad):                 # (cheaper than any() on a few ids)
        return
    b, u = (int(i) for i in np.argwhere(bad)[0])
    if joint:
        raise ValueError(f"{name}[{b}, {u}] = {int(y[b, u])} must be in [0, V) = "
                         f"[0, {V})" + ("" if allow_blank_targets else
                                        f" and differ from the blank {blank}"))
    out &= valid
    if out.any():
        b, u = (int(i) for i in np.argwhere(out)[0])
        raise ValueError(f"{name}[{b}, {u}] = {int(y[b, u])} is outside [0, {what}) = [0, {V})"
                         + ("" if what == "V" else " (TDT: the token classes before the durations)")
                         + ("" if of is None else f"; {what} of {of}"))
    raise ValueError(
        f"{name}[{b}, {u}] equals the blank id {blank}: a label cannot be the blank")


def check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def check_flag(name: str, value) -> bool:
    """``value`` as a bool: a Python or NumPy bool. Anything else is a ValueError naming it:
    ``bool()`` would read the string ``"False"`` as True, and None or 0 as False."""
    if type(value) is bool:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise ValueError(f"{name} must be a bool, got {value!r}")


def check_int(name: str, value) -> int:
    """``value`` as a Python int: anything ``operator.index`` accepts (Python and NumPy
    integers, a 0-d integer tensor), but not a bool."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    if isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be an int, got a {value.dtype} tensor of shape {_shape(value)}")
    raise ValueError(f"{name} must be an int, got {value!r}")


INF = float("inf")

# The valid range of every float option, inclusive (docs/api.md, "Options"). Inside it
# every backend computes the same numbers, up to float rounding, with the same inf/NaN
# pattern (tests/test_validation.py::test_float_options_agree_at_the_range_edges); far
# outside it the float64 lattice overflows (e.g. ``delay_penalty=1e100``) and the kernels
# disagree (-inf on one, NaN on another), or the option means nothing (a negative
# ``sigma`` rewards every arc: the loss goes negative). ``clamp <= 0`` means no clipping.
FLOAT_RANGES = {
    "clamp": (-INF, INF),
    "fastemit_lambda": (-1.0, 1e3),
    "delay_penalty": (0.0, 1e3),
    "sigma": (0.0, 1e3),
    "omega": (0.0, 1.0),
    "lm_only_scale": (0.0, 1.0),
    "am_only_scale": (0.0, 1.0),
}


def loss_options(fused: bool, inplace_grad: bool, topology, clamp, fastemit_lambda, sigma,
                 delay_penalty) -> LossOptions:
    """The losses' float options checked (:func:`check_float`) into one :class:`LossOptions`
    (its ``blank`` is set by the call's check). With plain numbers (the usual call), one
    object per value, built and checked once."""
    if (type(clamp) in _PLAIN and type(fastemit_lambda) in _PLAIN and type(sigma) in _PLAIN
            and type(delay_penalty) in _PLAIN):
        return _cached_options(fused, inplace_grad, topology, clamp, fastemit_lambda, sigma,
                               delay_penalty)
    return _options(fused, inplace_grad, topology, clamp, fastemit_lambda, sigma, delay_penalty)


def _options(fused, inplace_grad, topology, clamp, fastemit_lambda, sigma, delay_penalty):
    return LossOptions(0, fused, check_float("clamp", clamp),
                       check_float("fastemit_lambda", fastemit_lambda, finite=True),
                       inplace_grad, topology=topology,
                       sigma=check_float("sigma", sigma, finite=True),
                       delay_penalty=check_float("delay_penalty", delay_penalty, minimum=0.0,
                                                 finite=True))


_PLAIN = (float, int)
_cached_options = memo(maxsize=256)(_options)


@memo(maxsize=256)
def with_blank(opts: LossOptions, blank: int) -> LossOptions:
    """``opts`` with the call's checked ``blank`` (:func:`check_call` resolves a negative
    one), once per value. Every field is named rather than ``dataclasses.replace``d:
    TorchDynamo before torch 2.9 cannot trace ``replace`` (a compiled loss whose blank is not
    0 failed there with ``fullgraph=True``); tests/test_backends.py holds this equal to
    ``replace`` for every field."""
    if opts.blank == blank:
        return opts
    return LossOptions(blank, opts.log_softmax, opts.clamp, opts.fastemit_lambda,
                       opts.inplace_grad, opts.topology, opts.sigma, opts.delay_penalty)


def check_float(name: str, value, *, minimum: float | None = None, finite: bool = False) -> float:
    """``value`` as a Python float: a number, not NaN, ``>= minimum`` and finite if asked,
    and inside ``FLOAT_RANGES[name]`` for the options listed there."""
    if type(value) in _PLAIN:                  # the usual call: checked once per value
        return _checked_float(name, value, minimum, finite)
    return _check_float(name, value, minimum, finite)


@memo(maxsize=256)
def _checked_float(name: str, value, minimum, finite: bool) -> float:
    return _check_float(name, value, minimum, finite)


def _check_float(name: str, value, minimum, finite: bool) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number, got a tensor of shape {_shape(value)}")
        value = value.detach()           # (an option is a number: no gradient flows to it)
    if isinstance(value, (str, bytes, bool)):
        # float() would take "0.1" (a config's unparsed string) and True as numbers.
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        value = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if value != value:
        raise ValueError(f"{name} must not be NaN")
    lo, hi = FLOAT_RANGES.get(name, (-INF, INF))
    # (The messages are formatted only when raised: torch.compile(dynamic=True) traces this
    # with symbolic floats, which a format spec such as ``:g`` does not take.)
    if (finite or lo > -INF or hi < INF) and value in (INF, -INF):
        raise ValueError(f"{name} must be finite{_valid_range(lo, hi)}, got {value}")
    for bound in (lo, minimum):
        if bound is not None and value < bound:
            raise ValueError(f"{name} must be >= {bound:g}{_valid_range(lo, hi)}, got {value}")
    if value > hi:
        raise ValueError(f"{name} must be <= {hi:g}{_valid_range(lo, hi)}, got {value}")
    return value


def _valid_range(lo: float, hi: float) -> str:
    return "" if (lo, hi) == (-INF, INF) else f" (valid range [{lo:g}, {hi:g}])"


def check_durations(name: str, durations, *, minimum: int, ascending: bool,
                    need_positive: bool = True) -> tuple[int, ...]:
    """Distinct frame counts ``>= minimum``, as a tuple of ints (anything ``operator.index``
    accepts: Python, NumPy or 0-d tensor integers). ``ascending``: they must also be strictly
    ascending (TDT's ``durations``: the duration softmax group is read in that order);
    multi-blank's ``big_blank_durations`` may come in any order (NeMo accepts any, the big
    blank of ``big_blank_durations[i]`` being class ``blank - 1 - i``)."""
    if isinstance(durations, torch.Tensor):
        durations = durations.tolist()
    try:
        out = tuple(durations)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of ints, got {durations!r}") from None
    if not out:
        raise ValueError(f"{name} must not be empty")
    ints = []
    for d in out:
        try:
            if isinstance(d, bool):
                raise TypeError
            ints.append(operator.index(d))
        except TypeError:
            raise ValueError(f"{name} must hold ints, got {d!r} in {list(out)}") from None
    out = tuple(ints)
    if any(d < minimum for d in out):
        raise ValueError(f"{name} must all be >= {minimum}, got {list(out)}")
    if ascending and any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"{name} must be strictly ascending, got {list(out)}")
    if len(set(out)) != len(out):
        raise ValueError(f"{name} must be distinct, got {list(out)}")
    if need_positive and max(out) < 1:
        raise ValueError(f"{name} needs a duration >= 1 (a blank must advance), got {list(out)}")
    return out


def check_boundary(boundary, B: int, device: torch.device, logit_lengths: torch.Tensor,
                   target_lengths: torch.Tensor, names: Names = OURS) -> torch.Tensor | None:
    """k2's ``boundary`` ``(B, 4)`` ``[begin_symbol, begin_frame, end_symbol, end_frame]``:
    int64, on the logits' device. Value checks (CPU only, like every value check): for each
    sequence ``0 <= begin_symbol <= end_symbol <= U_b`` and
    ``0 <= begin_frame <= end_frame <= T_b``."""
    if boundary is None:
        return None
    if not isinstance(boundary, torch.Tensor):
        raise ValueError(f"boundary must be a torch.Tensor or None, got {type(boundary).__name__}")
    if boundary.dim() != 2 or tuple(boundary.shape) != (B, 4):
        raise ValueError(f"boundary must have shape (B, 4) = ({B}, 4) "
                         f"[begin_symbol, begin_frame, end_symbol, end_frame], got {_shape(boundary)}")
    if boundary.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"boundary must be int32 or int64, got {boundary.dtype}")
    if boundary.device != device:
        raise ValueError(f"tensors on different devices: {names.source('B', None)[0]} on "
                         f"{device}, boundary on {boundary.device}")
    boundary = boundary.to(torch.int64).contiguous()
    if may_read_values(boundary) and B:
        s0, f0, s1, f1 = boundary.unbind(1)
        T_name, U_name = names.lengths()
        for ok, what in (((s0 >= 0) & (s0 <= s1) & (s1 <= target_lengths),
                          f"0 <= begin_symbol <= end_symbol <= {U_name}[b]"),
                         ((f0 >= 0) & (f0 <= f1) & (f1 <= logit_lengths),
                          f"0 <= begin_frame <= end_frame <= {T_name}[b]")):
            if not bool(ok.all()):
                b = int((~ok).nonzero()[0, 0])
                raise ValueError(f"boundary[{b}] = {boundary[b].tolist()} must satisfy {what} "
                                 f"({T_name}[{b}] = {int(logit_lengths[b])}, "
                                 f"{U_name}[{b}] = {int(target_lengths[b])})")
    return boundary


# --------------------------------------------------------------------------- layouts
def check_packed_args(logits, targets, logit_lengths, target_lengths,
                      names: Names = OURS) -> None:
    """``packed=True``: rows ``(N, V)``, lengths ``(B,)`` int and targets ``(B, U)``, on a
    device with values (the layout is built from the lengths; :func:`check_call`)."""
    T_name, U_name = names.lengths()
    check_tensors((T_name, logit_lengths), (U_name, target_lengths), (names.targets, targets))
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"packed=True: {names.logits} must be rows (sum_b T_b (U_b+1), V), got "
                         + (f"shape {tuple(logits.shape)}" if isinstance(logits, torch.Tensor)
                            else type(logits).__name__))
    if logits.layout != torch.strided:
        raise ValueError(f"packed=True: {names.logits} must be a dense (strided) tensor, got "
                         f"layout {logits.layout} with shape {_shape(logits)}")
    if (logit_lengths.dim() != 1 or target_lengths.shape != logit_lengths.shape
            or targets.dim() != 2 or targets.shape[0] != logit_lengths.shape[0]):
        raise ValueError(f"packed=True: need {T_name} (B,), {U_name} (B,) and {names.targets} "
                         f"(B, U), got {tuple(logit_lengths.shape)}, {tuple(target_lengths.shape)} "
                         f"and {tuple(targets.shape)}")
    if logit_lengths.dtype not in _INTS or target_lengths.dtype not in _INTS:
        raise ValueError(f"{T_name} and {U_name} must be int32 or int64, got "
                         f"{logit_lengths.dtype} and {target_lengths.dtype}")
    check_values_held("packed=True reads the lengths' values (the row layout depends on them)",
                      (names.logits, logits), (T_name, logit_lengths), (U_name, target_lengths))


def check_values_held(reads: str, *named, error: type = ValueError) -> None:
    """A call that reads values on the host (a layout, a shape that depends on them):
    ``error`` naming the first of the ``(name, tensor)`` pairs on the meta device (shapes
    only), whose read would be torch's RuntimeError or NotImplementedError. ``reads``:
    what the call reads and why."""
    for name, x in named:
        if x.device.type == "meta":
            raise error(f"{reads}: {name} is on the meta device, which holds none")


def _packed_grid(logits, targets, logit_lengths, target_lengths, names: Names = OURS) -> tuple:
    """``packed=True``: the grid ``(B, T, U+1)`` of the packed rows, ``T = max_b T_b``, from
    the one host read of the lengths (a synchronisation on CUDA), which also checks them:
    ``>= 0``, ``U_b <= U``, and ``sum_b T_b (U_b+1)`` rows, as many as ``logits`` has."""
    B, U = targets.shape
    if not B:
        T, N, lo, hi = 0, 0, 0, 0
    else:
        T_b = logit_lengths.to(torch.int64)
        U_b = target_lengths.to(torch.int64)
        T, N, lo, hi = torch.stack([T_b.max(), (T_b * (U_b + 1)).sum(),
                                    torch.minimum(T_b.min(), U_b.min()), U_b.max()]).tolist()
    T_name, U_name = names.lengths()
    if lo < 0 or hi > U:
        raise ValueError(f"packed=True: lengths must be >= 0 and {U_name} <= U = {U}, got "
                         f"{T_name} {logit_lengths.tolist()} and {U_name} "
                         f"{target_lengths.tolist()}")
    if N != logits.shape[0]:
        raise ValueError(f"packed=True: {names.logits} {tuple(logits.shape)} must have sum_b T_b "
                         f"(U_b+1) = {N} rows for {T_name} {logit_lengths.tolist()} and "
                         f"{U_name} {target_lengths.tolist()}")
    return B, T, U + 1


def check_pack_logits_args(logits, logit_lengths, target_lengths) -> None:
    """``pack_logits``: padded logits ``(B, T, U+1, V)`` and int32/int64 lengths ``(B,)``
    with ``0 <= T_b <= T`` and ``0 <= U_b <= U``, read on the host, on CUDA too: the packed
    rows' count is their values, which the packing reads anyway (and which the meta device
    does not have), and a length past the padding would pack fewer rows than it says, a
    negative one none, without a word. While traced, the same rule is an assert in the
    graph (``"pack_lengths"``), which raises when the graph runs."""
    check_tensors(("logits", logits), ("logit_lengths", logit_lengths),
                  ("target_lengths", target_lengths), prefix="pack_logits: ")
    if logits.dim() != 4:
        raise ValueError(f"pack_logits: logits must be (B, T, U+1, V), got shape {_shape(logits)}")
    B, T, U1, _ = logits.shape
    if tuple(logit_lengths.shape) != (B,) or tuple(target_lengths.shape) != (B,):
        raise ValueError(f"pack_logits: logit_lengths and target_lengths must be (B,) = ({B},), got "
                         f"{_shape(logit_lengths)} and {_shape(target_lengths)}")
    for name, x in (("logit_lengths", logit_lengths), ("target_lengths", target_lengths)):
        if x.dtype not in _INTS:
            raise ValueError(f"pack_logits: {name} must be int32 or int64, got {x.dtype}")
    check_values_held("pack_logits reads the lengths' values (the packed rows' count is theirs)",
                      ("logits", logits), ("logit_lengths", logit_lengths),
                      ("target_lengths", target_lengths))
    if not tracing(logits):
        where = ("logits", logits)
        check_lengths(logit_lengths, target_lengths, T, U1 - 1, where, where)
    elif B:
        # Traced (torch.compile, fullgraph too): the same rule as an assert in the graph, which
        # raises when the graph runs (the packing would keep fewer rows than the lengths say).
        device_assert(((logit_lengths >= 0) & (logit_lengths <= T) & (target_lengths >= 0)
                       & (target_lengths <= U1 - 1)).all(), "pack_lengths")


def check_window_args(logits, targets, ranges) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``rnnt_loss_pruned``'s window logits ``(B, T, R, V)`` and ``ranges (B, T, R)``:
    strictly increasing label positions in ``[0, U]``, on the host where
    :func:`check_site` says so (a ValueError naming ``b, t``), else on the device or in the
    traced graph, no synchronisation). Returns ``(ranges, bad)``: ``ranges`` int64, within
    ``[0, U]`` whatever the values (the node -> row map is scattered by them: nothing is
    written outside it), and ``bad (B,)`` bool, True for a sequence whose windows break the
    rule (None: checked on the host), for the caller to pass to :func:`check_call` as the
    rule ``"ranges"``, which asserts it after the call's host rules."""
    check_tensors(("logits", logits), ("targets", targets), ("ranges", ranges))
    if logits.layout != torch.strided:
        raise ValueError(f"logits must be a dense (strided) tensor, got layout {logits.layout} "
                         f"with shape {_shape(logits)}")
    if logits.dim() != 4:
        raise ValueError(f"logits must be the window logits (B, T, R, V), got shape {tuple(logits.shape)}")
    B, T, R, V = logits.shape
    if R < 1:
        raise ValueError(f"logits {tuple(logits.shape)} must have a window R >= 1 (ranges "
                         f"{tuple(ranges.shape)}): an empty window holds no path")
    if tuple(ranges.shape) != (B, T, R):
        raise ValueError(f"ranges must have shape (B, T, R) = {(B, T, R)} to match logits "
                         f"{tuple(logits.shape)}, got {tuple(ranges.shape)}")
    if ranges.dtype not in _INTS:
        raise ValueError(f"ranges must be int32 or int64, got {ranges.dtype}")
    if targets.dim() != 2:
        raise ValueError(f"targets must have 2 dims (B, U), got shape {tuple(targets.shape)}")
    if ranges.device != logits.device:
        raise ValueError(f"tensors on different devices: logits on {logits.device}, ranges on "
                         f"{ranges.device}")
    U = targets.shape[1]
    ranges = ranges.to(torch.int64)
    if not ranges.numel():
        return ranges, None
    # Each row's position less the previous row's (the first row: its position + 1): all
    # >= 1 iff the positions are strictly increasing from 0 on; the last is then the largest.
    steps = torch.cat([ranges[..., :1] + 1, ranges[..., 1:] - ranges[..., :-1]], -1)
    site = check_site(ranges)
    if site == "host":
        bad = (steps < 1) | (ranges > U)
        if bool(bad.any()):
            b, t, k = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"ranges[{b}, {t}] = {ranges[b, t].tolist()} must be strictly "
                             f"increasing label positions in [0, U] = [0, {U}]")
        return ranges, None
    bad = (steps.amin((1, 2)) < 1) | (ranges[..., -1].amax(1) > U)        # (B,)
    return ranges.clamp(0, U), bad


def check_inplace(logits: torch.Tensor, native_low_precision: bool, name: str = "logits") -> None:
    """``inplace_grad=True`` writes the gradient over ``logits``: refuse inputs that would
    be copied first (the gradient would land in the copy)."""
    dtypes = (torch.float32, torch.float64)
    if native_low_precision:
        dtypes += (torch.float16, torch.bfloat16)
    if logits.dtype not in dtypes:
        raise ValueError(
            f"inplace_grad=True needs {name} of dtype {' or '.join(str(d) for d in dtypes)} with "
            f"this backend (any other dtype is copied first), got {logits.dtype} {name} of shape "
            f"{tuple(logits.shape)}")
    if not logits.is_contiguous():
        raise ValueError(
            f"inplace_grad=True needs contiguous {name} (a non-contiguous tensor is copied "
            f"first), got {name} of shape {tuple(logits.shape)} with strides {logits.stride()}")


# --------------------------------------------------------------------------- topologies
def check_tdt_logits(logits, durations, name: str = "logits") -> None:
    """``tdt_loss``: room for at least one token before the durations in the last axis."""
    if isinstance(logits, torch.Tensor) and logits.dim() in (2, 4) and logits.shape[-1] <= len(durations):
        raise ValueError(f"{name} {_shape(logits)} must hold V_tok >= 1 token classes before "
                         f"the {len(durations)} durations in the last axis")


def check_multiblank_blank(logits, blank: int, durations, packed: bool,
                           name: str = "logits") -> int:
    """``multiblank_rnnt_loss``: the blank is a class with its big blanks, the
    ``len(durations)`` classes just below it, and at least one label besides them (NeMo's
    layout puts the blank last, ESPnet's after the big blanks it inserts at the front of its
    token list). Checked before the topology is built, which places the big blanks below
    the blank, so that each mistake gets its own message. Returns the blank id in
    ``[0, V)``."""
    check_logits_rank(logits, rows=packed, name=name)
    return check_multiblank_blank_id(tuple(logits.shape), blank, durations, name)


def check_multiblank_blank_id(shape: tuple, blank: int, durations, name: str = "logits") -> int:
    """:func:`check_multiblank_blank` for logits of ``shape`` (``V = shape[-1]``), named
    ``name`` in the messages."""
    V = shape[-1]
    if not -V <= blank < V:
        raise ValueError(f"blank={blank} is outside [-V, V) = [{-V}, {V}) for {name} {shape}")
    # The topology's class ids must be plain ints. A non-negative blank is its own id; a
    # negative one counts from V, which torch.compile(dynamic=True) traces as a symbol (and
    # int() keeps it one): indexing a range of V makes it a constant, V specialised (another
    # V recompiles, as the docs say; the batch size stays dynamic).
    blank_id = blank if blank >= 0 else range(V)[blank]
    D = len(durations)
    if blank_id < D:
        raise ValueError(f"blank={blank} leaves no room below it for the {D} big blank(s) of "
                         f"big_blank_durations, classes blank - 1 - i, of {name} {shape} "
                         f"(NeMo's layout: the blank is the last class, V - 1 = {V - 1})")
    if V < D + 2:
        raise ValueError(f"{name} {shape} have no room for the {D} big blank(s) of "
                         f"big_blank_durations, the blank and a label")
    return blank_id


# --------------------------------------------------------------------------- pruned RNN-T
def check_simple_args(lm, am, targets, logit_lengths, target_lengths, blank, rnnt_type,
                      allow_blank_targets=False):
    """Shapes, dtypes, devices and values (where :func:`may_read_values`) of the simple
    losses' arguments. Returns ``(targets, logit_lengths, target_lengths, blank, topo)``
    normalised (int64, blank in ``[0, V)``, the topology of k2's ``rnnt_type``).
    ``allow_blank_targets``: a target may be the blank."""
    named = (("lm", lm), ("am", am), ("targets", targets), ("logit_lengths", logit_lengths),
             ("target_lengths", target_lengths))
    check_tensors(*named)
    check_untransformed(*named)
    if lm.dim() != 3:
        raise ValueError(f"lm must have 3 dims (B, U+1, V), got shape {_shape(lm)}")
    if am.dim() != 3:
        raise ValueError(f"am must have 3 dims (B, T, V), got shape {_shape(am)}")
    for name, x in (("lm", lm), ("am", am)):
        if x.dtype not in _FLOATS:
            raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if lm.dtype != am.dtype:
        raise ValueError(f"lm and am must have one dtype, got {lm.dtype} and {am.dtype}")
    B, T, V = am.shape
    U1 = lm.shape[1]
    if lm.shape[0] != B or lm.shape[2] != V:
        raise ValueError(f"lm {_shape(lm)} must be (B, U+1, V) with am's B = {B} and V = {V} "
                         f"(am {_shape(am)})")
    if U1 < 1:
        raise ValueError(f"lm {_shape(lm)} must have U+1 >= 1 label positions")
    if V < 1:
        raise ValueError(f"am {_shape(am)} must have a vocabulary V >= 1")
    if targets.dim() != 2 or tuple(targets.shape) != (B, U1 - 1):
        raise ValueError(f"targets must have shape (B, U) = ({B}, {U1 - 1}) to match lm "
                         f"{_shape(lm)}, got {_shape(targets)}")
    for name, x in (("logit_lengths", logit_lengths), ("target_lengths", target_lengths)):
        if x.dim() != 1 or x.shape[0] != B:
            raise ValueError(f"{name} must have shape (B,) = ({B},), got {_shape(x)}")
    for name, x in (("targets", targets), ("logit_lengths", logit_lengths),
                    ("target_lengths", target_lengths)):
        if x.dtype not in _INTS:
            raise ValueError(f"{name} must be int32 or int64, got {x.dtype}")
    for name, x in (("lm", lm), ("targets", targets), ("logit_lengths", logit_lengths),
                    ("target_lengths", target_lengths)):
        if x.device != am.device:
            raise ValueError(f"tensors on different devices: am on {am.device}, {name} on {x.device}")
    blank = check_int("blank", blank)
    if not -V <= blank < V:
        raise ValueError(f"blank={blank} is outside [-V, V) = [{-V}, {V}) for am {_shape(am)}")
    blank %= V
    topo = by_name(rnnt_type, K2_TYPES)
    targets, logit_lengths, target_lengths = (
        x.to(torch.int64).contiguous() for x in (targets, logit_lengths, target_lengths))
    if may_read_values(am) and B:
        check_lengths(logit_lengths, target_lengths, T, U1 - 1, ("am", am), ("lm", lm))
        check_targets(targets, target_lengths, blank, V, allow_blank_targets, joint=True)
    return targets, logit_lengths, target_lengths, blank, topo


def check_weight_args(blank_weights, label_weights, logit_lengths, target_lengths, rnnt_type):
    """``lattice_loss``'s checks; returns the lengths as int64 and the topology of k2's
    ``rnnt_type``."""
    named = (("blank_weights", blank_weights), ("label_weights", label_weights),
             ("logit_lengths", logit_lengths), ("target_lengths", target_lengths))
    check_tensors(*named)
    check_untransformed(*named)
    for name, x in named[:2]:
        if x.dim() != 3 or x.shape[2] < 1:
            raise ValueError(f"{name} must have 3 dims (B, T, U+1), got shape {_shape(x)}")
        if x.dtype not in _FLOATS:
            raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if label_weights.shape != blank_weights.shape or label_weights.dtype != blank_weights.dtype:
        raise ValueError(f"blank_weights and label_weights must have one shape (B, T, U+1) and "
                         f"dtype, got {blank_weights.dtype} {_shape(blank_weights)} and "
                         f"{label_weights.dtype} {_shape(label_weights)}")
    B, T, U1 = blank_weights.shape
    for name, x in named[1:]:
        if x.device != blank_weights.device:
            raise ValueError(f"tensors on different devices: blank_weights on "
                             f"{blank_weights.device}, {name} on {x.device}")
    check_lengths_shape(logit_lengths, target_lengths, B)
    topo = by_name(rnnt_type, K2_TYPES)
    logit_lengths, target_lengths = (x.to(torch.int64).contiguous()
                                     for x in (logit_lengths, target_lengths))
    if may_read_values(blank_weights) and B:
        what = ("blank_weights", blank_weights)
        check_lengths(logit_lengths, target_lengths, T, U1 - 1, what, what)
    return logit_lengths, target_lengths, topo


def check_lengths_shape(logit_lengths, target_lengths, B: int, device=None) -> None:
    """Lengths of a lattice given by per-node tensors: int32/int64 ``(B,)``, and on the
    occupations' ``device`` where given."""
    for name, x in (("logit_lengths", logit_lengths), ("target_lengths", target_lengths)):
        if x.dim() != 1 or x.shape[0] != B or x.dtype not in _INTS:
            raise ValueError(f"{name} must be an int32/int64 tensor of shape (B,) = ({B},), got "
                             f"{x.dtype} {_shape(x)}")
        if device is not None and x.device != device:
            raise ValueError(f"tensors on different devices: gamma_blank on {device}, "
                             f"{name} on {x.device}")


def check_occupations(occupations, logit_lengths, target_lengths, R, method: str, methods):
    """``prune_ranges``: the occupations ``(gamma_blank, gamma_label)`` ``(B, T, U+1)``, the
    lengths (values where :func:`may_read_values`), ``R >= 1`` and the method. Returns
    ``(gamma_blank, gamma_label, logit_lengths, target_lengths, R)``, the lengths int64."""
    try:
        gamma_blank, gamma_label = occupations
    except (TypeError, ValueError):
        raise ValueError("occupations must be an ArcOccupations, an Occupancy or a pair "
                         f"(gamma_blank, gamma_label), got {type(occupations).__name__}") from None
    if logit_lengths is None or target_lengths is None:
        raise ValueError("occupations given as a pair (gamma_blank, gamma_label) need "
                         "logit_lengths= and target_lengths=")
    check_tensors(("gamma_blank", gamma_blank), ("gamma_label", gamma_label),
                  ("logit_lengths", logit_lengths), ("target_lengths", target_lengths))
    if gamma_blank.dim() != 3 or gamma_blank.shape != gamma_label.shape:
        raise ValueError(f"gamma_blank and gamma_label must both be (B, T, U+1), got "
                         f"{_shape(gamma_blank)} and {_shape(gamma_label)}")
    if not gamma_blank.is_floating_point() or not gamma_label.is_floating_point():
        raise ValueError(f"gamma_blank and gamma_label must be floating point, got "
                         f"{gamma_blank.dtype} and {gamma_label.dtype}")
    B, T, U1 = gamma_blank.shape
    check_lengths_shape(logit_lengths, target_lengths, B, gamma_blank.device)
    R = check_int("R", R)
    if R < 1:
        raise ValueError(f"R must be an int >= 1, got {R!r}")
    if method not in methods:
        raise ValueError(f"method must be one of {methods}, got {method!r}")
    return gamma_blank, gamma_label, logit_lengths.long(), target_lengths.long(), R


def check_occupation_lengths(gamma_blank, logit_lengths, target_lengths) -> None:
    """``prune_ranges``, values (where :func:`may_read_values`): the lengths within the
    occupations' ``(T, U)``."""
    B, T, U1 = gamma_blank.shape
    if may_read_values(gamma_blank) and B:
        what = ("gamma_blank", gamma_blank)
        check_lengths(logit_lengths, target_lengths, T, U1 - 1, what, what)


def check_pruning_args(am, lm, ranges) -> torch.Tensor:
    """``do_rnnt_pruning``: ``am (B, T, Da)``, ``lm (B, U+1, Dl)`` and ``ranges (B, T, R)``
    in ``[0, U]``: on the host where :func:`check_site` says so (a ValueError), else a
    device-side assert. Returns ``ranges`` as int64, within ``[0, U]`` whatever the values
    (a position outside would read another sequence's rows of ``lm``)."""
    named = (("am", am), ("lm", lm), ("ranges", ranges))
    check_tensors(*named)
    for name, x in named:
        if x.dim() != 3:
            raise ValueError(f"{name} must have 3 dims, got shape {_shape(x)}")
    check_untransformed(*named)
    B, T, R = ranges.shape
    if ranges.dtype not in _INTS:
        raise ValueError(f"ranges must be int32 or int64, got {ranges.dtype}")
    ranges = ranges.to(torch.int64)
    if am.shape[0] != B or lm.shape[0] != B or am.shape[1] != T:
        raise ValueError(f"ranges {_shape(ranges)} must be (B, T, R) with am's (B, T) and lm's B: "
                         f"am {_shape(am)}, lm {_shape(lm)}")
    for name, x in (("am", am), ("lm", lm)):
        if x.device != ranges.device:
            raise ValueError(f"tensors on different devices: ranges on {ranges.device}, "
                             f"{name} on {x.device}")
    U1 = lm.shape[1]
    if not ranges.numel():
        return ranges
    site = check_site(ranges)
    if site == "host":
        lo, hi = int(ranges.min()), int(ranges.max())
        if lo < 0 or hi >= U1:
            raise ValueError(f"ranges must lie in [0, U] = [0, {U1 - 1}] for lm {_shape(lm)}, "
                             f"got values in [{lo}, {hi}]")
        return ranges
    # On the device or in the traced graph: the same rule as a device-side assert, and the
    # positions kept in [0, U] (a position outside would read another sequence's rows of lm).
    if ranges.device.type != "meta":
        device_assert(((ranges >= 0) & (ranges < U1)).all(), "pruning_ranges")
    return ranges.clamp(0, U1 - 1)


# --------------------------------------------------------------------------- fused joiner
_BYTE_UNITS = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9,
               "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*(" + "|".join(_BYTE_UNITS) + r")\s*$")


def check_tile(tile) -> tuple[int | None, int | None]:
    """The ``tile`` of the fused losses: ``(rows, None)`` for a positive int (lattice nodes
    = logits rows per tile), ``(None, nbytes)`` for a byte budget of one tile's logits
    written as a string, a number and a unit among B, KB, MB, GB (powers of 1000) and KiB,
    MiB, GiB (powers of 1024): ``"256MiB"``, ``"1.5 GB"``."""
    if isinstance(tile, str):
        m = _BYTES.match(tile)
        if m:
            nbytes = int(float(m.group(1)) * _BYTE_UNITS[m.group(2)])
            if nbytes >= 1:
                return None, nbytes
        raise ValueError(f"tile must be a positive int (rows per tile) or a byte budget such "
                         f"as '256MiB' (units {', '.join(_BYTE_UNITS)}), got {tile!r}")
    try:
        rows = check_int("tile", tile)            # (NumPy's ints too, as every int option)
    except ValueError:
        rows = 0
    if rows < 1:
        raise ValueError(f"tile must be a positive int (rows per tile) or a byte budget such "
                         f"as '256MiB', got {tile!r}")
    return rows, None


def check_fused_args(joiner, enc, pred) -> None:
    """The fused losses' joiner inputs: ``enc (B, T, H_enc)`` and ``pred (B, U+1, H_pred)``
    floating tensors on one device, ``joiner`` callable. The targets, lengths, blank and
    boundary are checked against them by ``_backends.prepare_call`` (messages naming
    ``enc`` and ``pred``), before any tile."""
    if not callable(joiner):
        raise ValueError(f"joiner must be callable (e.g. an nn.Module), got {type(joiner).__name__}")
    for name, x, what in (("enc", enc, "(B, T, H_enc)"), ("pred", pred, "(B, U+1, H_pred)")):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"{name} must have 3 dims {what}, got shape {_shape(x)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got {x.dtype}")
    check_untransformed(("enc", enc), ("pred", pred))
    if enc.shape[0] != pred.shape[0]:
        raise ValueError(f"batch sizes differ: enc {_shape(enc)} and pred {_shape(pred)}")
    if pred.shape[1] < 1:
        raise ValueError(f"pred {_shape(pred)} must have U+1 >= 1 label positions")
    if enc.device != pred.device:
        raise ValueError(f"tensors on different devices: enc on {enc.device}, pred on {pred.device}")
    if enc.device.type == "meta":
        # (The losses on logits take meta tensors, shapes only; the fused ones replay the
        # joiner's RNG and autocast state, which the meta device does not have.)
        raise ValueError("enc and pred are on the meta device (shapes only): the fused losses "
                         "run the joiner on values; give the logits to rnnt_loss for a "
                         "shape-only call")


def check_joiner_output(x, want: tuple, enc_shape: tuple, pred_shape: tuple,
                        device: torch.device) -> None:
    """One tile's joiner output: a floating tensor of shape ``want = (B, t1-t0, u1-u0,
    V)`` (``V`` None on the first tile: any) on ``device``, that of ``enc`` and ``pred``
    (the passes read the logits there: a joiner returning them on the meta device or
    another device would otherwise fail deep inside a backend)."""
    ok = (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() == 4
          and all(w is None or w == n for w, n in zip(want, x.shape)))
    if not ok:
        got = f"shape {_shape(x)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        shape = "(" + ", ".join("V" if w is None else str(w) for w in want) + ")"
        raise ValueError(f"joiner(enc {enc_shape}, pred {pred_shape}) must return floating "
                         f"logits of shape {shape}, got {got}")
    if x.device != device:
        raise ValueError(f"joiner(enc {enc_shape}, pred {pred_shape}) returned logits of shape "
                         f"{_shape(x)} on {x.device}: they must be on the device of enc and "
                         f"pred, {device}")


# --------------------------------------------------------------------------- warnings
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by the function calling this one
    that reports the first frame outside the package: the user's line, however many of the
    package's frames (a compat wrapper, ``eager_under_compile``) lie between. Warning there
    directly, rather than catching and warning again, keeps a warning that is an error
    (``-W error``) in its place among the call's host rules."""
    import sys
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
