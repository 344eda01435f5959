"""warp-rnnt's extension module ``warp_rnnt._C`` on rnnt_lattice's kernels, for code (and
warp-rnnt's own tests) that calls it directly::

    import warp_rnnt._C as core
    import rnnt_lattice.compat.warp_rnnt._C as core

Its three functions, with warp-rnnt 0.7.0's argument names, defaults, shapes and checks
(``pytorch_binding/binding.cpp``): ``rnnt_loss`` and ``rnnt_loss_compact`` compute the
costs and the per-sequence gradient w.r.t. the log-probs eagerly (as the kernels do),
``rnnt_loss_compact_backward`` scatters a compact gradient back to ``(STU, V)``. Inputs
are float32 log-probs (``log_softmax`` already applied), int32 labels and lengths, all
contiguous, on the CPU or a GPU (warp-rnnt: CUDA only). Gradients are exact: no
forward/backward mismatch, so no sample's gradient is ever zeroed.

Argument errors are ``ArgumentError``: a ``ValueError`` (this library's rule) that is also
the ``RuntimeError`` warp-rnnt's ``TORCH_CHECK`` raises, with its wording
(``"xs must be contiguous"``, ``"ys must be a Int tensor"``, ...).

Names: ``xs`` log-probs, ``ys`` labels, ``xn`` frames per sequence ``T_b``, ``yn`` labels
per sequence ``U_b``; ``STU = sum_b T_b (U_b+1)``, ``SU = sum_b U_b``.
"""
from __future__ import annotations

import torch

from ... import functional
from ..._ops import eager_under_compile
from ..._rules import device_assert
from ..._validate import Names, check_int, check_site, check_values_held
from ..._validate import check_tensors as check_types

__all__ = ["rnnt_loss", "rnnt_loss_compact", "rnnt_loss_compact_backward"]

_FLOAT = ("a Float tensor", (torch.float32,))
_INT = ("a Int tensor", (torch.int32,))
ANY_FLOAT = ("a floating-point tensor", (torch.float16, torch.bfloat16, torch.float32,
                                         torch.float64))


NAMES = Names("xs", "ys", "xn", "yn")
# The compact layout's labels come concatenated, (SU,); the loss reads them padded, (N, U).
COMPACT_NAMES = Names("xs", "ys (padded to (N, U))", "xn", "yn")


def log_probs_loss(names: Names, log_probs, targets, frames_lengths, labels_lengths, blank,
                   fastemit_lambda: float = 0.0, packed: bool = False) -> torch.Tensor:
    """Per-sequence costs ``(N,)`` of log-probs (``rnnt_loss(..., fused_log_softmax=False,
    reduction="none")``), the messages naming the tensors by ``names``, warp-rnnt's."""
    return functional.rnnt_costs_named(names, log_probs, targets, frames_lengths,
                                       labels_lengths, blank, fused=False,
                                       fastemit_lambda=fastemit_lambda, packed=packed)


class ArgumentError(ValueError, RuntimeError):
    """A bad argument: a ``ValueError`` naming it, and the ``RuntimeError`` warp-rnnt raises."""


def check_tensors(names, tensors, kinds, dims, *, contiguous: bool) -> None:
    """warp-rnnt's checks in its order: contiguity, dtypes, then dimensions. ``kinds``:
    ``(what, dtypes)`` per tensor; ``dims``: the number of dims of each."""
    check_types(*zip(names, tensors), error=ArgumentError)
    if contiguous:
        for name, x in zip(names, tensors):
            if not x.is_contiguous():
                raise ArgumentError(f"{name} must be contiguous, got shape {tuple(x.shape)} "
                                    f"with strides {x.stride()}")
    for name, x, (what, dtypes) in zip(names, tensors, kinds):
        if x.dtype not in dtypes:
            raise ArgumentError(f"{name} must be {what} ({', '.join(map(str, dtypes))}), got "
                                f"{x.dtype} of shape {tuple(x.shape)}")
    for name, x, dim in zip(names, tensors, dims):
        if x.dim() != dim:
            raise ArgumentError(f"{name} must have {dim} dimensions, got shape {tuple(x.shape)}")


def check_blank(blank, V: int, gathered_ok: bool) -> None:
    """``blank`` in ``[0, V)``; ``-1`` also where it means "already gathered" (``gathered_ok``)."""
    if isinstance(blank, bool) or not isinstance(blank, int):
        raise ArgumentError(f"blank must be an int, got {blank!r}")
    if not (0 <= blank < V or (gathered_ok and blank == -1)):
        raise ArgumentError(f"blank={blank} must be in [0, V) = [0, {V})"
                            + (" or -1 (log-probs already gathered, V = 2)" if gathered_ok else ""))


def gathered_targets(xs: torch.Tensor, ys: torch.Tensor, name: str = "xs") -> torch.Tensor:
    """``blank=-1``: ``xs`` ``(N, T, U+1, 2)`` holds ``[blank, label]`` log-probs per node
    (warp-rnnt's gathered layout), which is the loss of 2 classes with blank 0 and every
    label 1."""
    if xs.shape[-1] != 2:
        raise ArgumentError(f"{name} {tuple(xs.shape)} must have values only for blank and "
                            f"label (V = 2) with blank=-1")
    return torch.ones_like(ys)


def padded_labels(ys: torch.Tensor, yn: torch.Tensor, names=("ys", "yn")) -> torch.Tensor:
    """Concatenated labels ``(SU,)`` -> ``(B, max_b U_b)`` (zeros past each ``U_b``). One
    host read (``max U_b`` and ``SU``), as warp-rnnt's compact layout needs too."""
    B = yn.shape[0]
    check_values_held("the compact layout reads the labels' lengths (the padded labels' width)",
                      (names[1], yn), error=ArgumentError)
    U, SU, lo = torch.stack([yn.max(), yn.sum(), yn.min()]).tolist() if B else (0, 0, 0)
    if lo < 0:
        raise ArgumentError(f"{names[1]} must be >= 0, got {yn.tolist()}")
    if ys.numel() != SU:
        raise ArgumentError(f"{names[0]} shape must be equal to (sum({names[1]}), ) = ({SU},), "
                            f"got {tuple(ys.shape)}")
    valid = torch.arange(U, device=yn.device)[None, :] < yn[:, None]        # (B, U)
    out = ys.new_zeros((B, U))
    out[valid] = ys
    return out


def _costs_and_grads(xs, targets, xn, yn, blank, fastemit_lambda, packed):
    """Per-sequence costs ``(N,)`` and their gradient w.r.t. ``xs`` (upstream 1), eagerly."""
    x = xs.detach().requires_grad_()
    with torch.enable_grad():
        costs = log_probs_loss(COMPACT_NAMES if packed else NAMES, x, targets, xn, yn, blank,
                               fastemit_lambda, packed)
        (grads,) = torch.autograd.grad(costs.sum(), x)
    return costs.detach(), grads


def rnnt_loss(xs: torch.Tensor, ys: torch.Tensor, xn: torch.Tensor, yn: torch.Tensor,
              blank: int = 0, fastemit_lambda: float = 0.0):
    """``(costs (N,), grads (N, T, U+1, V))``: the costs ``-log P`` of log-probs ``xs``
    ``(N, T, U+1, V)`` with labels ``ys`` ``(N, U)``, and their gradient w.r.t. ``xs``
    (``-gamma_blank`` at the blank, ``-(1 + fastemit_lambda) gamma_label`` at the label,
    0 elsewhere and in padding). ``blank=-1``: ``xs`` is gathered, ``(N, T, U+1, 2)`` with
    ``[blank, label]`` per node (what ``rnnt_loss(gather=True)`` builds in warp-rnnt)."""
    names = ("xs", "ys", "xn", "yn")
    check_tensors(names, (xs, ys, xn, yn), (_FLOAT, _INT, _INT, _INT), (4, 2, 1, 1),
                  contiguous=True)
    N, T, U1, V = xs.shape
    if xn.numel() != N or yn.numel() != N:
        raise ArgumentError(f"xn {tuple(xn.shape)} and yn {tuple(yn.shape)} shape must be "
                            f"equal (N,) = ({N},) for xs {tuple(xs.shape)}")
    if U1 != ys.shape[1] + 1:
        raise ArgumentError(f"ys shape (N, U-1) {tuple(ys.shape)} mismatched with xs "
                            f"(N, T, U, V) {tuple(xs.shape)}")
    check_blank(blank, V, gathered_ok=True)
    targets = gathered_targets(xs, ys) if blank == -1 else ys
    return _costs_and_grads(xs, targets, xn, yn, max(blank, 0), fastemit_lambda, packed=False)


def row_labels(xs: torch.Tensor, ys: torch.Tensor, xn: torch.Tensor, yn: torch.Tensor,
               blank: int) -> torch.Tensor:
    """``loc`` ``(STU,)`` int64: the class whose log-prob the label arc of each compact row
    reads, the blank on each frame's last row ``u = U_b`` (which has no label arc)."""
    xn, yn = xn.to(torch.int64), yn.to(torch.int64)
    sizes = xn * (yn + 1)                                                 # rows per sequence
    STU = int(sizes.sum()) if sizes.numel() else 0
    if xs.shape[0] != STU:
        raise ArgumentError(f"xs shape mismatch with (sum(xn*(yn+1)), ) = ({STU},): got "
                            f"{tuple(xs.shape)} for xn {xn.tolist()} and yn {yn.tolist()}")
    seq = torch.repeat_interleave(torch.arange(sizes.numel(), device=xs.device), sizes,
                                  output_size=STU)                        # (STU,)
    u = (torch.arange(STU, device=xs.device) - (torch.cumsum(sizes, 0) - sizes)[seq]) % (yn[seq] + 1)
    has_label = u < yn[seq]
    ids = torch.cat([ys.to(torch.int64), ys.new_full((1,), blank, dtype=torch.int64)])
    return ids[torch.where(has_label, (torch.cumsum(yn, 0) - yn)[seq] + u, ys.numel())]


def rnnt_loss_compact(xs: torch.Tensor, ys: torch.Tensor, xn: torch.Tensor, yn: torch.Tensor,
                      blank: int = 0, fastemit_lambda: float = 0.0, required_grad: bool = True):
    """``(costs (N,), grads (STU, 2), loc (STU,))`` for compact log-probs ``xs`` ``(STU, V)``
    (row ``offset_b + t (U_b+1) + u``) and concatenated labels ``ys`` ``(SU,)``: ``grads``
    is the gradient w.r.t. each row's ``[blank, label]`` log-probs (0 for the label of the
    last row ``u = U_b``), ``loc`` the label class of each row (the blank on the last rows).
    Without ``required_grad`` ``grads`` is empty, ``(0, 2)``."""
    names = ("xs", "ys", "xn", "yn")
    check_tensors(names, (xs, ys, xn, yn), (_FLOAT, _INT, _INT, _INT), (2, 1, 1, 1),
                  contiguous=True)
    if xn.shape != yn.shape:
        raise ArgumentError(f"xn {tuple(xn.shape)} and yn {tuple(yn.shape)} shape must be "
                            f"equal (N,)")
    V = xs.shape[1]
    check_blank(blank, V, gathered_ok=False)
    targets = padded_labels(ys, yn)
    # The labels are read on the host, on a GPU too: this layout reads its lengths there
    # anyway (the rows' count, padded_labels and row_labels), and the loss below sees only
    # each row's [blank, label] pair, so a label outside [0, V) would index out of bounds
    # and one equal to the blank would give a finite loss of another lattice.
    if ys.numel() and ys.device.type != "meta":
        ids = ys.to(torch.int64)
        # One read: the smallest and the largest id, and the first position of the blank
        # (ys.numel() if none).
        at_blank = torch.where(ids == blank, torch.arange(ids.numel(), device=ids.device),
                               ids.numel())
        lo, hi, at = torch.stack([ids.min(), ids.max(), at_blank.min()]).tolist()
        if not 0 <= lo <= hi < V:
            raise ArgumentError(f"ys must hold label ids in [0, V) = [0, {V}), got values in "
                                f"[{lo}, {hi}]")
        if at < ids.numel():
            raise ArgumentError(f"ys[{at}] equals the blank id {blank}: a label cannot be the "
                                f"blank")
    loc = row_labels(xs, ys, xn, yn, blank)
    # The [blank, label] log-probs of every row: the 2-class loss with blank 0, labels 1.
    gathered = torch.stack([xs[:, blank], xs.gather(1, loc[:, None])[:, 0]], 1)   # (STU, 2)
    ones = torch.ones_like(targets)
    if not required_grad:
        with torch.no_grad():
            costs = log_probs_loss(COMPACT_NAMES, gathered, ones, xn, yn, 0, packed=True)
        return costs, xs.new_empty((0, 2)), loc
    costs, grads = _costs_and_grads(gathered, ones, xn, yn, 0, fastemit_lambda, packed=True)
    return costs, grads, loc


def rnnt_loss_compact_backward(grad_costs: torch.Tensor, grad_xs: torch.Tensor,
                               cumSum: torch.Tensor, loc: torch.Tensor, V: int,
                               blank: int = 0) -> torch.Tensor:
    """The gradient ``(STU, V)`` w.r.t. compact log-probs: row ``i`` of sequence ``b``
    (``cumSum`` ``(N,)`` = cumulative ``T_b (U_b+1)``) gets ``grad_costs[b] * grad_xs[i]``
    at its blank and its label ``loc[i]``, 0 elsewhere (a label equal to the blank adds
    both, where warp-rnnt keeps the blank's only)."""
    names = ("grad_costs", "grad_xs", "cumSum", "loc")
    check_tensors(names, (grad_costs, grad_xs, cumSum, loc),
                  (_FLOAT, _FLOAT, ("an integer tensor", (torch.int32, torch.int64)),
                   ("a Long tensor", (torch.int64,))), (1, 2, 1, 1), contiguous=False)
    STU = grad_xs.shape[0]
    if grad_xs.shape[1] != 2 or loc.shape[0] != STU:
        raise ArgumentError(f"grad_xs {tuple(grad_xs.shape)} must be (STU, 2) and loc "
                            f"{tuple(loc.shape)} (STU,)")
    if cumSum.shape != grad_costs.shape:
        raise ArgumentError(f"cumSum {tuple(cumSum.shape)} must be (N,) like grad_costs "
                            f"{tuple(grad_costs.shape)}")
    try:
        V = check_int("V", V)
    except ValueError as err:
        raise ArgumentError(str(err)) from None
    if V < 1:
        raise ArgumentError(f"V must be >= 1 (the log-probs' classes), got {V}")
    check_blank(blank, V, gathered_ok=False)
    cum = cumSum.to(torch.int64)
    # A label class outside [0, V) would index out of bounds; a cumSum that is not the
    # cumulative row counts (non-decreasing, ending at STU, the rows of grad_xs) would give
    # rows to the wrong sequence. On the host a message naming them; on the device (the CUDA
    # default, no synchronisation) a device-side assert naming them.
    site = check_site(loc)
    if site is not None:
        loc_ok = ((loc >= 0) & (loc < V)).all()
        ends = torch.cat([cum.new_zeros(1), cum])
        cum_ok = (ends[1:] >= ends[:-1]).all() & (ends[-1] == STU)
    if site == "host":
        if not bool(loc_ok):
            lo, hi = int(loc.min()), int(loc.max())
            raise ArgumentError(f"loc must hold class ids in [0, V) = [0, {V}), got values in "
                                f"[{lo}, {hi}]")
        if not bool(cum_ok):
            raise ArgumentError(f"cumSum must be the cumulative row counts of the sequences, "
                                f"non-decreasing and ending at STU = {STU} (the rows of "
                                f"grad_xs), got {cum.tolist()}")
    elif site == "device":
        device_assert(loc_ok, "compact_loc")
        device_assert(cum_ok, "compact_rows")
    rows = torch.arange(STU, device=grad_xs.device)
    seq = torch.searchsorted(cum, rows, right=True)                       # sequence of each row
    g = grad_xs * torch.cat([grad_costs, grad_costs.new_zeros(1)])[seq][:, None]
    out = grad_xs.new_zeros((STU, V))
    out[:, blank] = g[:, 0]
    return out.index_put_((rows, loc), g[:, 1], accumulate=True)


# The binding's three functions run eagerly under torch.compile (a graph break), as the
# extension's calls are opaque to TorchDynamo: they compute the gradient themselves
# (torch.autograd.grad, the backends' kernels) and read the lengths on the host.
rnnt_loss = eager_under_compile(
    rnnt_loss, "warp_rnnt._C.rnnt_loss runs eagerly (the extension's call), a graph break; "
    "compile without fullgraph=True")
rnnt_loss_compact = eager_under_compile(
    rnnt_loss_compact, "warp_rnnt._C.rnnt_loss_compact runs eagerly (the extension's call), a "
    "graph break; compile without fullgraph=True")
rnnt_loss_compact_backward = eager_under_compile(
    rnnt_loss_compact_backward, "warp_rnnt._C.rnnt_loss_compact_backward runs eagerly (the "
    "extension's call), a graph break; compile without fullgraph=True")
