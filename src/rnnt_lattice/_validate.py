"""Argument checks shared by every public entry point.

Every failure is a ``ValueError`` that names the argument and the shapes or values
involved. Checks that need to read tensor *values* (length ranges, target ids) run only
for CPU tensors: on CUDA they would force a host synchronisation on the hot path, so
there the kernels treat out-of-range values as documented in ``rnnt_loss``. Under
``torch.compile`` they are skipped too (reading a tensor value would break the graph).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

_REDUCTIONS = ("none", "sum", "mean")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Checked:
    """Normalised arguments: int64 contiguous targets/lengths, a non-negative blank id."""

    logits: torch.Tensor          # (B, T, U+1, V) or rows (N, V), as given (``prepare`` converts)
    targets: torch.Tensor         # (B, U), int64 (int32 kept with int64_ids=False), contiguous
    logit_lengths: torch.Tensor   # (B,), idem
    target_lengths: torch.Tensor  # (B,), idem
    blank: int                    # in [0, V)


def _shape(x: torch.Tensor) -> str:
    return str(tuple(x.shape))


def check_lattice_args(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int,
    *,
    int64_ids: bool = True,
    n_tokens: int | None = None,
    grid: tuple[int, int, int] | None = None,
    allow_blank_targets: bool = False,
) -> Checked:
    """Validate the lattice inputs and return them normalised (see :class:`Checked`).
    ``int64_ids=False`` keeps int32 ids and lengths as they are (contiguous): for a backend
    whose kernels read either, which saves a conversion per tensor on every call.
    ``n_tokens``: only the first ``n_tokens`` classes of the last axis are tokens (TDT: the
    durations follow); the blank and the target ids must lie among them. ``grid``:
    ``(B, T, U+1)`` of a node -> row layout whose logits are rows ``(N, V)`` (packed or
    pruned); the shapes are checked against the grid. ``allow_blank_targets``: a target equal
    to the blank is an ordinary label (k2's semantics), not a ValueError."""
    check_logits_rank(logits, rows=grid is not None)
    for name, x in (("targets", targets), ("logit_lengths", logit_lengths),
                    ("target_lengths", target_lengths)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if targets.dim() != 2:
        raise ValueError(
            f"targets must have 2 dims (B, U), got {targets.dim()} dims with shape {_shape(targets)}")
    for name, x in (("logit_lengths", logit_lengths), ("target_lengths", target_lengths)):
        if x.dim() != 1:
            raise ValueError(f"{name} must have 1 dim (B,), got shape {_shape(x)}")

    if logits.dtype not in _FLOATS:
        raise ValueError(
            f"logits must be float16, bfloat16, float32 or float64, got {logits.dtype}")
    for name, x in (("targets", targets), ("logit_lengths", logit_lengths),
                    ("target_lengths", target_lengths)):
        if x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {x.dtype}")

    B, T, U1, V = logits.shape if grid is None else (*grid, logits.shape[1])
    for name, x in (("targets", targets), ("logit_lengths", logit_lengths),
                    ("target_lengths", target_lengths)):
        if x.shape[0] != B:
            raise ValueError(
                f"batch sizes differ: logits {_shape(logits)} has B={B} but {name} has shape {_shape(x)}")
    if targets.shape[1] != U1 - 1:
        raise ValueError(
            f"targets {_shape(targets)} must have U = U+1 - 1 = {U1 - 1} columns to match logits "
            f"{_shape(logits)}" + ("" if grid is None else f" with the lattice grid (B, T, U+1) = {grid}"))
    if V < 1:
        raise ValueError(f"logits {_shape(logits)} must have a vocabulary V >= 1")

    for name, x in (("targets", targets), ("logit_lengths", logit_lengths),
                    ("target_lengths", target_lengths)):
        if x.device != logits.device:
            raise ValueError(
                f"tensors on different devices: logits on {logits.device}, {name} on {x.device}")

    blank = check_int("blank", blank)
    Vt = V if n_tokens is None else n_tokens
    what = "V" if n_tokens is None else "V_tok"
    if not -Vt <= blank < Vt:
        raise ValueError(f"blank={blank} is outside [-{what}, {what}) = [{-Vt}, {Vt}) for logits "
                         f"{_shape(logits)}")
    blank = blank % Vt

    if int64_ids:
        targets, logit_lengths, target_lengths = (
            x.to(torch.int64) for x in (targets, logit_lengths, target_lengths))
    targets, logit_lengths, target_lengths = (
        x.contiguous() for x in (targets, logit_lengths, target_lengths))

    # Under torch.compile the value checks are skipped: reading a value is a graph break.
    if logits.device.type == "cpu" and not torch.compiler.is_compiling():
        _check_values(logits, targets, logit_lengths, target_lengths, blank, Vt, (B, T, U1),
                      allow_blank_targets)

    return Checked(logits, targets, logit_lengths, target_lengths, blank)


def check_logits_rank(logits, *, rows: bool = False) -> int:
    """``V``, the size of the last axis of ``logits``: a tensor of 4 dims ``(B, T, U+1, V)``,
    or with ``rows`` of 2 dims ``(N, V)`` (the rows of a packed or pruned layout)."""
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if rows and logits.dim() != 2:
        raise ValueError(f"logits must have 2 dims (N, V) (rows of a packed or pruned layout), "
                         f"got {logits.dim()} dims with shape {_shape(logits)}")
    if not rows and logits.dim() != 4:
        raise ValueError(
            f"logits must have 4 dims (B, T, U+1, V), got {logits.dim()} dims with shape {_shape(logits)}")
    return logits.shape[-1]


def check_class_targets(targets: torch.Tensor, target_lengths: torch.Tensor, topology) -> None:
    """CPU value check (as ``_check_values``): no label may be a class that an arc kind of
    ``topology`` reads as a fixed class (multi-blank's big blanks): a label cannot be a
    blank. ``targets`` and ``target_lengths`` are already checked (``check_lattice_args``)."""
    fixed = {k.class_id: k.name for k in topology.kinds if k.reads == "class"}
    U = targets.shape[1]
    if (not fixed or U == 0 or targets.shape[0] == 0 or targets.device.type != "cpu"
            or torch.compiler.is_compiling()):
        return
    valid = torch.arange(U)[None, :] < target_lengths[:, None]
    classes = torch.tensor(sorted(fixed), dtype=targets.dtype)
    bad = valid & torch.isin(targets, classes)
    if bool(bad.any()):
        b, u = (int(i) for i in bad.nonzero()[0])
        c = int(targets[b, u])
        raise ValueError(f"targets[{b}, {u}] = {c} is the class of the arc kind {fixed[c]!r} of "
                         f"topology {topology.name!r}: a label cannot be a blank")


def _check_values(logits, targets, logit_lengths, target_lengths, blank, V, grid,
                  allow_blank_targets=False) -> None:
    B, T, U1 = grid
    U = U1 - 1
    if B == 0:
        return
    for name, x, hi, dim in (("logit_lengths", logit_lengths, T, "T"),
                             ("target_lengths", target_lengths, U, "U")):
        lo_v, hi_v = int(x.min()), int(x.max())
        if lo_v < 0:
            b = int(torch.argmin(x))
            raise ValueError(f"{name} must be >= 0, got {name}[{b}] = {lo_v}")
        if hi_v > hi:
            b = int(torch.argmax(x))
            raise ValueError(
                f"{name}[{b}] = {hi_v} exceeds the padded size {dim} = {hi} of logits {_shape(logits)}")
    if U > 0:
        valid = torch.arange(U, device=targets.device)[None, :] < target_lengths[:, None]
        bad = valid & ((targets < 0) | (targets >= V))
        if bool(bad.any()):
            b, u = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"targets[{b}, {u}] = {int(targets[b, u])} is outside [0, V) = [0, {V})")
        bad = valid & (targets == blank)
        if not allow_blank_targets and bool(bad.any()):
            b, u = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"targets[{b}, {u}] equals the blank id {blank}: a label cannot be the blank")


def check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


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


def check_float(name: str, value, *, minimum: float | None = None, finite: bool = False) -> float:
    """``value`` as a Python float: a number, not NaN, ``>= minimum`` and finite if asked,
    and inside ``FLOAT_RANGES[name]`` for the options listed there."""
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"{name} must be a number, got a tensor of shape {_shape(value)}")
    try:
        value = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if value != value:
        raise ValueError(f"{name} must not be NaN")
    lo, hi = FLOAT_RANGES.get(name, (-INF, INF))
    where = "" if (lo, hi) == (-INF, INF) else f" (valid range [{lo:g}, {hi:g}])"
    if (finite or lo > -INF or hi < INF) and value in (INF, -INF):
        raise ValueError(f"{name} must be finite{where}, got {value}")
    for bound in (lo, minimum):
        if bound is not None and value < bound:
            raise ValueError(f"{name} must be >= {bound:g}{where}, got {value}")
    if value > hi:
        raise ValueError(f"{name} must be <= {hi:g}{where}, got {value}")
    return value


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
                   target_lengths: torch.Tensor) -> torch.Tensor | None:
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
        raise ValueError(f"tensors on different devices: logits on {device}, boundary on "
                         f"{boundary.device}")
    boundary = boundary.to(torch.int64).contiguous()
    if boundary.device.type == "cpu" and B and not torch.compiler.is_compiling():
        s0, f0, s1, f1 = boundary.unbind(1)
        for ok, what in (((s0 >= 0) & (s0 <= s1) & (s1 <= target_lengths),
                          "0 <= begin_symbol <= end_symbol <= target_lengths[b]"),
                         ((f0 >= 0) & (f0 <= f1) & (f1 <= logit_lengths),
                          "0 <= begin_frame <= end_frame <= logit_lengths[b]")):
            if not bool(ok.all()):
                b = int((~ok).nonzero()[0, 0])
                raise ValueError(f"boundary[{b}] = {boundary[b].tolist()} must satisfy {what} "
                                 f"(logit_lengths[{b}] = {int(logit_lengths[b])}, "
                                 f"target_lengths[{b}] = {int(target_lengths[b])})")
    return boundary
