"""k2's and fast_rnnt's RNN-T API on rnnt_lattice's kernels: an icefall recipe switches by
changing its import,

    import k2                                 # or: import fast_rnnt
    import rnnt_lattice.compat.k2 as k2       #     import rnnt_lattice.compat.k2 as fast_rnnt

One module serves both (docs/variants.md A): the names, argument names and
order, defaults, shapes, dtypes and reductions of fast_rnnt 1.3 and of k2's
``rnnt_loss.py`` / ``mutual_information.py`` (k2 master @a741ae8, 2025-07):

- losses: ``rnnt_loss``, ``rnnt_loss_simple``, ``rnnt_loss_smoothed``, ``rnnt_loss_pruned``
  (also k2's ``use_hat_loss=True``, the HAT loss);
- the lattice inputs ``(px, py)``: ``get_rnnt_logprobs``, ``get_rnnt_logprobs_joint``,
  ``get_rnnt_logprobs_pruned``, ``get_rnnt_logprobs_smoothed``;
- the recursion: ``mutual_information_recursion`` and ``joint_mutual_information_recursion``;
- pruning: ``get_rnnt_prune_ranges``, ``get_rnnt_prune_ranges_deprecated``,
  ``do_rnnt_pruning``; and ``with_cuda`` (k2 reads it as a bool, fast_rnnt calls it).

k2's vocabulary: ``symbols`` ``(B, S)``, ``termination_symbol`` (the blank), ``boundary``
``(B, 4)`` ``[begin_symbol, begin_frame, end_symbol, end_frame]`` (the lengths: without it
every sequence spans ``S`` symbols and ``T`` frames), ``px`` ``(B, S, T+1)`` for
``"regular"`` (``(B, S, T)`` otherwise) the label arcs' log-weights with ``px[b, s, t]`` the
arc leaving frame ``t``, symbol position ``s``, and ``py`` ``(B, S+1, T)`` the blank arcs'.
``return_grad=True`` returns ``(loss, (px_grad, py_grad))``, the occupations of those arcs
(the derivatives of the log-likelihood w.r.t. ``px``/``py``), in ``px``'s layout and dtype.

Every recursion runs on the library's lattice kernels (Numba on CPU, Triton on CUDA) in
float64; the losses without ``return_grad`` use the fused kernels of
:func:`rnnt_lattice.rnnt_loss`, :func:`rnnt_lattice.rnnt_loss_pruned`,
:func:`rnnt_lattice.rnnt_loss_simple` and :func:`rnnt_lattice.rnnt_loss_smoothed`; the
others build ``(px, py)`` as k2 does and run :func:`rnnt_lattice.lattice_loss` on them
(autograd through the ``(px, py)`` construction), with each node's normaliser and the
entries it reads in float64 (:class:`_ReadLogProbs`; the simple joiner's pieces in
float64), so that a confident row keeps its digits there too (math.md 4.1); ``px`` and
``py`` come back in the inputs' dtype; HAT's (``use_hat_loss``) too.

Where k2 and fast_rnnt differ, both are accepted where it is unambiguous:
``get_rnnt_logprobs_joint`` takes ``boundary, rnnt_type`` (fast_rnnt) or ``rnnt_type,
boundary`` (k2) positionally, told apart by type; ``rnnt_loss_pruned``'s ninth parameter is
``return_grad`` in fast_rnnt and ``use_hat_loss`` in k2, so both are keyword-only here (a
ninth positional argument is a ValueError); ``rnnt_loss`` has fast_rnnt's ``return_grad``;
``S = 0`` is accepted (k2; fast_rnnt asserts); ``get_rnnt_prune_ranges_deprecated`` is k2's.
fast_rnnt 1.0's ``modified: bool`` (1.2's ``rnnt_type``) is accepted by keyword and in its
position, by every function that had it (``_rnnt_type``).

As in k2, a label equal to ``termination_symbol`` before ``boundary[:, 2]`` is an ordinary
label: its arc reads the blank's entry (``allow_blank_targets=True`` of the library's losses).

Differences from k2, all deliberate (docs/migrating.md lists them with their reasons):
- ``symbols[b, s]`` for ``s >= boundary[b, 2]`` are never read nor checked (k2 gathers
  them: out-of-range padding crashes there); their ``px`` rows are ``-inf``;
- bad arguments raise ``ValueError`` naming them and their shapes (k2 asserts);
- a negative ``delay_penalty`` is a ``ValueError`` (k2 silently ignores it);
- sequences without a path (``T_b < S_b`` for modified/constrained) give ``+inf`` losses
  with zero gradient (k2 asserts on the whole batch);
- ``get_rnnt_prune_ranges`` warns through ``warnings.warn`` when it raises ``s_range`` and
  is silent when it caps it at ``S + 1`` (k2 prints both); a batch of empty symbol
  sequences works (k2 fails its ``s_range >= 2`` assertion); the deprecated variant follows
  the same window-size rules (k2's keeps a window that gives ``inf`` losses);
- recursions are exact float64 lattices for float32 inputs too; gradients of impossible
  sequences are 0 (k2's CPU backward may give 1s);
- HAT's label term uses ``logsigmoid(-x_blank)`` (k2: ``logsigmoid(x) - x``, the same
  value, which cancels for very negative blank logits).
"""
from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence

import torch

import rnnt_lattice as _lib          # the public API only, the value-check rule and the
from rnnt_lattice._ops import reduce_costs          # the losses' reduction
from rnnt_lattice._rules import assert_rules, with_bad_rows   # the device check's asserts, NaN rows
from rnnt_lattice._validate import (check_flag, check_float, check_int,   # the rules of ints,
                                    check_values_held, may_read_values)   # flags, floats, values
from rnnt_lattice import reference                  # the rows' normaliser and gradient
from rnnt_lattice.topology import K2_TYPES, by_name

__all__ = ["rnnt_loss", "rnnt_loss_simple", "rnnt_loss_smoothed", "rnnt_loss_pruned",
           "get_rnnt_logprobs", "get_rnnt_logprobs_joint", "get_rnnt_logprobs_pruned",
           "get_rnnt_logprobs_smoothed", "mutual_information_recursion",
           "joint_mutual_information_recursion", "get_rnnt_prune_ranges",
           "get_rnnt_prune_ranges_deprecated", "do_rnnt_pruning", "with_cuda"]

NEG_INF = float("-inf")
_REDUCTIONS = ("none", "mean", "sum")


class _WithCuda:
    """Whether this module runs on CUDA tensors (torch built with CUDA, Triton installed):
    truthy for k2's ``k2.with_cuda`` and callable for fast_rnnt's ``with_cuda()``."""

    def __bool__(self) -> bool:
        return torch.backends.cuda.is_built() and importlib.util.find_spec("triton") is not None

    def __call__(self) -> bool:
        return bool(self)

    def __repr__(self) -> str:
        return repr(bool(self))


with_cuda = _WithCuda()


# ---------------------------------------------------------------------------------------
# Argument checks: ValueError naming the argument and its shape (k2 asserts)
# ---------------------------------------------------------------------------------------

def _tensor(name: str, x, dims: str) -> torch.Size:
    """``x.shape``, after checking that ``x`` is a tensor of the rank ``dims`` spells."""
    n = dims.count(",") + 1
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {dims}, got {type(x).__name__}")
    if x.dim() != n:
        raise ValueError(f"{name} must have {n} dims {dims}, got shape {tuple(x.shape)}")
    return x.shape


def _float(name: str, x: torch.Tensor, ref: tuple | None = None, half: bool = True):
    """``x`` floating (``half``: float16/bfloat16 too), and of the dtype and device of
    ``ref``, a ``(name, tensor)`` pair checked before it."""
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)[0 if half else 2:]
    if x.dtype not in dtypes:
        raise ValueError(f"{name} must be {', '.join(str(d) for d in dtypes)}, got {x.dtype}")
    if ref is not None and (x.dtype != ref[1].dtype or x.device != ref[1].device):
        raise ValueError(f"{name} ({x.dtype} on {x.device}) must have the dtype and device of "
                         f"{ref[0]} ({ref[1].dtype} on {ref[1].device})")


def _blank(termination_symbol, C: int) -> int:
    termination_symbol = check_int("termination_symbol", termination_symbol)
    if not -C <= termination_symbol < C:
        raise ValueError(f"termination_symbol={termination_symbol} is outside [-C, C) = "
                         f"[{-C}, {C}) for C = {C} classes")
    return termination_symbol % C


def _boundary(boundary, B: int, S: int, T: int, device) -> torch.Tensor | None:
    """k2's ``boundary`` as int64, checked (values where the host reads them,
    ``rnnt_lattice.set_input_checks``; on the device the library's check covers it): every row
    ``0 <= begin_symbol <= end_symbol <= S`` and ``0 <= begin_frame <= end_frame <= T``."""
    if boundary is None:
        return None
    if tuple(_tensor("boundary", boundary, "(B, 4)")) != (B, 4):
        raise ValueError(f"boundary must have shape (B, 4) = ({B}, 4) [begin_symbol, "
                         f"begin_frame, end_symbol, end_frame], got {tuple(boundary.shape)}")
    if boundary.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"boundary must be int64 (or int32), got {boundary.dtype}")
    if boundary.device != device:
        raise ValueError(f"boundary is on {boundary.device}, the inputs on {device}")
    boundary = boundary.to(torch.int64)
    if B and may_read_values(boundary):
        s0, t0, s1, t1 = boundary.unbind(1)
        ok = (s0 >= 0) & (s0 <= s1) & (s1 <= S) & (t0 >= 0) & (t0 <= t1) & (t1 <= T)
        if not bool(ok.all()):
            b = int((~ok).nonzero()[0, 0])
            raise ValueError(f"boundary[{b}] = {boundary[b].tolist()} must satisfy 0 <= "
                             f"begin_symbol <= end_symbol <= S = {S} and 0 <= begin_frame <= "
                             f"end_frame <= T = {T}")
    return boundary


def _ends(boundary, B: int, S: int, T: int, device):
    """``(end_frame, end_symbol)`` ``(B,)`` int64: the lengths the library's losses take."""
    if boundary is None:
        return (torch.full((B,), T, dtype=torch.int64, device=device),
                torch.full((B,), S, dtype=torch.int64, device=device))
    return boundary[:, 3], boundary[:, 2]


def _symbols_and_boundary(symbols, boundary, B: int, S: int, T: int, C: int, device,
                          own: bool = True):
    """``(y, boundary, checks)``: ``symbols`` ``(B, S)`` and k2's ``boundary`` checked,
    the shapes of both before the values of either (a ``symbols`` of another S is named as
    such, not as a boundary beyond S), as :func:`_symbols` and :func:`_boundary` return
    them (``own``: as :func:`_symbols` takes it)."""
    if tuple(_tensor("symbols", symbols, "(B, S)")) != (B, S):
        raise ValueError(f"symbols must have shape (B, S) = ({B}, {S}), got {tuple(symbols.shape)}")
    if symbols.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"symbols must be int64 (or int32), got {symbols.dtype}")
    if symbols.device != device:
        raise ValueError(f"symbols is on {symbols.device}, the inputs on {device}")
    boundary = _boundary(boundary, B, S, T, device)
    y, checks = _symbols(symbols, B, S, C, boundary, device, own)
    return y, boundary, checks


def _symbols(symbols, B: int, S: int, C: int, boundary, device, own: bool = True):
    """``(y, checks)``: ``symbols`` ``(B, S)``, its shape, dtype and device checked
    (:func:`_symbols_and_boundary`), checked: ids in ``[0, C)`` before each ``end_symbol``
    (on the host, ``rnnt_lattice.set_input_checks``, a ValueError); ``y`` int64 with the
    entries past ``end_symbol`` (never read) replaced by 0. Where no value is read on the
    host, the ids kept in ``[0, C)`` before the ``(px, py)`` paths gather by them, and
    ``checks`` the rule ``(("symbols", bad),)``, ``bad (B,)`` True for a bad sequence, for
    the caller to assert once its host rules have passed (``_rules.assert_rules``: the
    device-side assert, NaN rows); else ``()``. ``own`` False: not there, for the calls
    whose library loss checks the ids itself."""
    valid = _read_symbols(boundary, B, S, device)
    if not symbols.numel() or symbols.device.type == "meta":
        return torch.where(valid, symbols.to(torch.int64), 0), ()
    host = may_read_values(symbols)
    if host or own:
        bad = valid & ((symbols < 0) | (symbols >= C))
    if host:
        if bool(bad.any()):
            b, s = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"symbols[{b}, {s}] = {int(symbols[b, s])} must be in [0, C) = "
                             f"[0, {C}) (entries past boundary[:, 2] are not read)")
    elif own:
        return (torch.where(valid, symbols.to(torch.int64).clamp(0, C - 1), 0),
                (("symbols", bad.any(1)),))
    return torch.where(valid, symbols.to(torch.int64), 0), ()


def _read_symbols(boundary, B: int, S: int, device) -> torch.Tensor:
    """``(B, S)`` bool: the symbols k2's recursion reads, ``s < end_symbol``."""
    s = torch.arange(S, device=device)[None, :]
    return s < (S if boundary is None else boundary[:, 2:3])


def _check_reduction(reduction) -> str:
    """k2's reductions; checked before anything is computed (a host rule: before any device
    assert of the call)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    return reduction


def _reduce(costs: torch.Tensor, reduction) -> torch.Tensor:
    return reduce_costs(costs, _check_reduction(reduction), False)  # the losses' rule (empty mean: 0)


def _k2_empty(costs: torch.Tensor, boundary, S: int, T: int) -> torch.Tensor:
    """``costs (B,)`` with 0 for the sequences whose start node is their end node (a
    ``boundary`` with ``begin == end`` on both axes; without one, ``S = T = 0``): k2's
    recursion gives them its one empty path, log-probability 0, where the library's losses
    give a lattice without frames ``+inf``. Their gradient is 0 either way. A NaN stays (the
    device check's, for a sequence it found bad)."""
    if boundary is None:
        if S or T:
            return costs
        empty = torch.ones_like(costs, dtype=torch.bool)
    else:
        empty = (boundary[:, 0] == boundary[:, 2]) & (boundary[:, 1] == boundary[:, 3])
    return torch.where(empty & ~torch.isnan(costs),
                       torch.zeros((), dtype=costs.dtype, device=costs.device), costs)


def _number(name: str, x) -> float:
    if isinstance(x, (str, bytes, bool)):        # float() would take "0.5" and True
        raise ValueError(f"{name} must be a number, got {x!r}")
    try:
        value = float(x)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be a number, got {x!r}") from None
    if value != value or value in (math.inf, -math.inf):   # (not math.isfinite: TorchDynamo
        raise ValueError(f"{name} must be finite, got {value}")   # traces symbolic floats)
    return value


def _delay_penalty(delay_penalty) -> float:
    value = _number("delay_penalty", delay_penalty)
    if value < 0:
        raise ValueError(f"delay_penalty must be >= 0, got {value} (k2 silently ignores a "
                         "negative one)")
    return value


# ---------------------------------------------------------------------------------------
# Layouts: k2's (px, py) <-> the library's occupations (B, T, S+1)
# ---------------------------------------------------------------------------------------

def _to_k2(gamma_blank, gamma_label, T: int, regular: bool, dtype):
    """Occupations ``(B, T', S+1)`` (``T' >= T`` frames) -> k2's ``(px_grad, py_grad)``:
    ``(B, S, T+1)`` (regular; frame ``T`` holds no label arc of an RNN-T lattice) or
    ``(B, S, T)``, and ``(B, S+1, T)``, in ``dtype``."""
    S = gamma_label.shape[2] - 1
    T1 = T + 1 if regular else T
    px = gamma_label[:, :T1, :S]
    if px.shape[1] < T1:           # zero frames appended (torch's pad refuses S = 0 columns)
        px = torch.cat([px, px.new_zeros((px.shape[0], T1 - px.shape[1], S))], dim=1)
    py = gamma_blank[:, :T]
    return px.transpose(1, 2).to(dtype).contiguous(), py.transpose(1, 2).to(dtype).contiguous()


def _from_k2(px_grad: torch.Tensor, py_grad: torch.Tensor):
    """k2's ``(px_grad, py_grad)`` -> ``(gamma_blank, gamma_label)`` ``(B, T, S+1)`` and
    whether the lattice is regular (k2 infers it from ``px_grad.shape[-1] == T + 1``)."""
    _tensor("px_grad", px_grad, "(B, S, T+1)")
    B, S1, T = _tensor("py_grad", py_grad, "(B, S+1, T)")
    for name, x in (("px_grad", px_grad), ("py_grad", py_grad)):
        if not x.is_floating_point():
            raise ValueError(f"{name} must be floating point (the occupations return_grad "
                             f"gives), got {x.dtype}")
    if px_grad.shape[:2] != (B, S1 - 1) or px_grad.shape[2] not in (T, T + 1):
        raise ValueError(f"px_grad {tuple(px_grad.shape)} must be (B, S, T+1) (regular) or "
                         f"(B, S, T) to match py_grad {tuple(py_grad.shape)} = (B, S+1, T)")
    regular = px_grad.shape[2] == T + 1
    gamma_label = torch.nn.functional.pad(px_grad[:, :, :T], (0, 0, 0, 1)).transpose(1, 2)
    return py_grad.transpose(1, 2), gamma_label, regular


# ---------------------------------------------------------------------------------------
# The recursion
# ---------------------------------------------------------------------------------------

def mutual_information_recursion(px: torch.Tensor, py: torch.Tensor,
                                 boundary: torch.Tensor | None = None,
                                 return_grad: bool = False):
    """k2's general recursion over given arc weights: ``px`` ``(B, S, T+1)`` (or ``(B, S,
    T)``, the "modified" lattice), ``py`` ``(B, S+1, T)``, float32 or float64 (one dtype)::

        p[b, s_begin, t_begin] = 0
        p[b, s, t] = lae(p[b, s-1, t] + px[b, s-1, t], p[b, s, t-1] + py[b, s, t-1])    # regular
        p[b, s, t] = lae(p[b, s-1, t-1] + px[b, s-1, t-1], p[b, s, t-1] + py[b, s, t-1])  # modified
        returns p[b, s_end, t_end]                                          (B,), px's dtype

    (out-of-range terms ``-inf``). ``boundary`` ``(B, 4)`` int64 ``[s_begin, t_begin, s_end,
    t_end]`` (default ``[0, 0, S, T]``); indices into ``px``/``py`` are absolute. Unlike the
    RNN-T functions' ``px``, ``px[:, :, t_end]`` may be finite here: label arcs on the last
    frame. With ``return_grad`` also ``(px_grad, py_grad)``, the derivatives of the result
    w.r.t. ``px`` and ``py`` (the arcs' occupations). Differentiable w.r.t. both.

    It is :func:`rnnt_lattice.lattice_loss` on a lattice one frame longer: node ``(t, s)``
    of p is lattice node ``(t, u = s)``, ``px``/``py`` are the label/blank arc weights, frame
    ``t_end`` keeps its label arcs (regular) and ends with a blank of weight 0 from
    ``(t_end, s_end)`` into the end node ``(t_end + 1, s_end)``.
    """
    B, S, T1 = _tensor("px", px, "(B, S, T+1)")
    _float("px", px, half=False)
    _tensor("py", py, "(B, S+1, T)")
    _float("py", py, ("px", px), half=False)
    T = py.shape[2]
    if tuple(py.shape) != (B, S + 1, T) or T1 not in (T, T + 1):
        raise ValueError(f"px {tuple(px.shape)} must be (B, S, T+1) or (B, S, T) and py "
                         f"{tuple(py.shape)} (B, S+1, T)")
    boundary = _boundary(boundary, B, S, T, px.device)
    return _recursion(px, py, boundary, T1 == T + 1, check_flag("return_grad", return_grad))


def _recursion(px, py, boundary, regular: bool, return_grad: bool):
    """:func:`mutual_information_recursion` on checked arguments."""
    B, S, T1 = px.shape
    T = py.shape[2]
    t_end, s_end = _ends(boundary, B, S, T, px.device)
    last = torch.arange(T + 1, device=px.device)[None, :, None] == t_end[:, None, None]
    w_blank = torch.nn.functional.pad(py.transpose(1, 2), (0, 0, 0, 1))        # (B, T+1, S+1)
    w_blank = torch.where(last, 0.0, w_blank)          # the blank into the end node weighs 0
    w_label = torch.nn.functional.pad(px.transpose(1, 2), (0, 1, 0, T + 1 - T1), value=NEG_INF)
    if not regular:
        w_label = torch.where(last, NEG_INF, w_label)  # a label from t_end would overshoot
    ends = None if boundary is None else torch.stack(
        (boundary[:, 0], boundary[:, 1], s_end, t_end + 1), 1)
    out = _lib.lattice_loss(w_blank, w_label, t_end + 1, s_end, boundary=ends,
                            rnnt_type="regular" if regular else "modified",
                            return_occupations=return_grad)
    if not return_grad:
        return 0.0 - out                           # (an empty path: +0, not -0)
    costs, occ = out
    gamma_blank = torch.where(last, 0.0, occ.gamma_blank)    # py[:, :, t_end] is never read
    return 0.0 - costs, _to_k2(gamma_blank, occ.gamma_label, T, regular, px.dtype)


def joint_mutual_information_recursion(px: Sequence[torch.Tensor], py: Sequence[torch.Tensor],
                                       boundary: torch.Tensor | None = None) -> torch.Tensor:
    """k2's recursion on ``sum(px)``, ``sum(py)`` reported per term: ``(N, B)`` with
    ``out[n, b] = sum(occupation * px[n]) + sum(occupation * py[n])`` over sequence b's arcs,
    where the occupations are those of the summed lattice; ``out.sum(0)`` is
    :func:`mutual_information_recursion` of the sums, the difference (log of a sum minus
    the expected sum of logs) being added to term 0. The gradient w.r.t. ``px[n]`` is the
    occupation (a constant), as in k2. ``px``, ``py``: equal-length sequences of tensors of
    one shape each, as :func:`mutual_information_recursion`."""
    for name, xs in (("px", px), ("py", py)):
        if isinstance(xs, torch.Tensor) or not isinstance(xs, Sequence) or not xs:
            raise ValueError(f"{name} must be a non-empty sequence of tensors, got "
                             f"{type(xs).__name__}")
    if len(px) != len(py):
        raise ValueError(f"px and py must hold as many tensors, got {len(px)} and {len(py)}")
    for name, xs in (("px", px), ("py", py)):
        for n, x in enumerate(xs):
            _tensor(f"{name}[{n}]", x, "(B, S, T+1)" if name == "px" else "(B, S+1, T)")
            # one dtype and device for every term (torch.stack would promote a mix)
            _float(f"{name}[{n}]", x, None if name == "px" and n == 0 else ("px[0]", px[0]),
                   half=False)
            if x.shape != xs[0].shape:
                raise ValueError(f"{name}[{n}] {tuple(x.shape)} must have the shape of "
                                 f"{name}[0] {tuple(xs[0].shape)}")
    with torch.no_grad():
        scores, grads = mutual_information_recursion(torch.stack(tuple(px)).sum(0),
                                                     torch.stack(tuple(py)).sum(0),
                                                     boundary, return_grad=True)

    def expected(grad, x):
        # a -inf weight has occupation 0: a select, not 0 * -inf
        return torch.where(grad != 0, grad * x, 0.0).sum((1, 2))             # (B,)

    prods = torch.stack([expected(grads[0], x) + expected(grads[1], y) for x, y in zip(px, py)])
    offset = scores - prods.detach().sum(0)
    return torch.cat([prods[:1] + offset, prods[1:]])                      # (N, B)


def _px_py_loss(px, py, nan_rows, boundary, delay_penalty, reduction, return_grad,
                dtype=None):
    """The RNN-T losses computed from ``(px, py)`` as k2 does: the delay penalty on ``px``,
    the recursion, the reduction. ``nan_rows``: NaN on the losses of the sequences the
    device check found bad (their ``(px, py)`` are NaN too, but an empty lattice reads
    none of them). ``dtype``: the loss's and the occupations' (the logits'; ``px``'s by
    default), where ``px`` and ``py`` were formed in float64 (:class:`_ReadLogProbs`)."""
    delay_penalty = _delay_penalty(delay_penalty)
    B, S, T1 = px.shape
    T = py.shape[2]
    if delay_penalty > 0:
        t_end = _ends(boundary, B, S, T, px.device)[0].to(px.dtype)
        t = torch.arange(T1, device=px.device, dtype=px.dtype)
        px = px + delay_penalty * ((t_end[:, None, None] - 1) / 2 - t)    # earlier labels gain
    out = _recursion(px, py, boundary, T1 == T + 1, return_grad)
    scores, grads = out if return_grad else (out, None)
    loss = _reduce(with_bad_rows(0.0 - scores, nan_rows), reduction)        # (0 - x: an empty path's 0 is +0, not -0)
    if dtype is not None:
        loss = loss.to(dtype)
        grads = None if grads is None else tuple(g.to(dtype) for g in grads)
    return (loss, grads) if return_grad else loss


# ---------------------------------------------------------------------------------------
# The lattice inputs (px, py)
# ---------------------------------------------------------------------------------------

def _finish(px, py, boundary, rnnt_type, symbols_read, nan_rows=None):
    """k2's last steps on ``px (B, S, T)``, ``py (B, S+1, T)``: ``-inf`` for the symbols
    not read; regular: the empty frame ``T`` and no label on ``end_frame`` (k2's
    ``fix_for_boundary``); constrained: the forced blank folded into the label arc.
    ``nan_rows`` ``(B,)``: NaN in every entry of a sequence the device check found bad, so
    that any loss of it is NaN, never a plausible value."""
    if nan_rows is not None:
        px, py = (x + nan_rows.to(x.dtype)[:, None, None] for x in (px, py))
    px = torch.where(symbols_read[:, :, None], px, NEG_INF)
    if rnnt_type == "regular":
        px = torch.nn.functional.pad(px, (0, 1), value=NEG_INF)            # (B, S, T+1)
        if boundary is not None:
            t = torch.arange(px.shape[2], device=px.device)
            px = torch.where(t == boundary[:, 3, None, None], NEG_INF, px)
    elif rnnt_type == "constrained":
        px = px + py[:, 1:, :]
    return px, py


def _rnnt_type(rnnt_type, modified):
    """The ``rnnt_type`` of a call, from fast_rnnt 1.0's ``modified`` (a bool, by keyword
    or in ``rnnt_type``'s place: 1.0 had ``boundary, modified`` where 1.2 has ``boundary,
    rnnt_type``) where it is given: True is ``"modified"``, False ``"regular"``."""
    if isinstance(rnnt_type, bool):
        if modified is not None:
            raise ValueError(f"modified={modified!r} and a bool rnnt_type ({rnnt_type!r}): "
                             f"pass one of them")
        modified, rnnt_type = rnnt_type, "regular"
    if modified is None:
        return rnnt_type
    if not isinstance(modified, bool):
        raise ValueError(f"modified must be a bool (fast_rnnt 1.0), got {modified!r}")
    if rnnt_type != "regular":
        raise ValueError(f"modified={modified} (fast_rnnt 1.0) and rnnt_type={rnnt_type!r}: "
                         f"pass one of them")
    return "modified" if modified else "regular"


def _positions(boundary, rnnt_type):
    """``(boundary, rnnt_type)`` of a call whose two positional slots may hold them in
    either order (``boundary, rnnt_type`` or ``boundary, modified`` in one library or
    version, ``rnnt_type, boundary`` in another): a string or a bool is the ``rnnt_type``,
    a tensor the ``boundary``; a slot left at the other order's default is dropped."""
    if (isinstance(boundary, (str, bool)) and isinstance(rnnt_type, (str, bool))
            and not (isinstance(rnnt_type, str) and rnnt_type == "regular")):
        # Both slots hold an rnnt_type, neither at its default: one would be dropped.
        raise ValueError(f"two rnnt_type values, {boundary!r} and {rnnt_type!r}: these two "
                         f"positions take a boundary (a tensor or None) and an rnnt_type, in "
                         f"either order (fast_rnnt: boundary, rnnt_type; k2: rnnt_type, "
                         f"boundary)")
    if isinstance(boundary, (str, bool)) or isinstance(rnnt_type, torch.Tensor):
        boundary, rnnt_type = rnnt_type, boundary
    if isinstance(boundary, (str, bool)):           # the default rnnt_type of the other order
        boundary = None
    return boundary, "regular" if rnnt_type is None else rnnt_type


def _v10(rnnt_type, modified, delay_penalty, reduction):
    """``(rnnt_type, delay_penalty, reduction)`` of a loss called the fast_rnnt 1.0 way:
    ``modified`` as :func:`_rnnt_type`, and 1.0's positional ``reduction`` (a string where
    1.2 has ``delay_penalty``) after a positional ``modified``."""
    if isinstance(rnnt_type, bool) and isinstance(delay_penalty, str):
        delay_penalty, reduction = 0.0, delay_penalty
    return _rnnt_type(rnnt_type, modified), delay_penalty, reduction


def _simple_args(lm, am, symbols, termination_symbol, rnnt_type, boundary, own: bool = True):
    """Checks of the simple joiner's inputs: ``(B, S, T, C, blank, y, boundary, checks)``,
    ``y`` the symbols with the unread ones replaced by 0 (``own``, ``checks``: as
    :func:`_symbols`, for the caller to assert after its own host rules)."""
    B, T, C = _tensor("am", am, "(B, T, C)")
    _float("am", am)
    if _tensor("lm", lm, "(B, S+1, C)")[0] != B or lm.shape[2] != C or lm.shape[1] < 1:
        raise ValueError(f"lm {tuple(lm.shape)} must be (B, S+1, C) with am's B = {B} and "
                         f"C = {C} (am {tuple(am.shape)})")
    _float("lm", lm, ("am", am))
    S = lm.shape[1] - 1
    by_name(rnnt_type, K2_TYPES)
    y, boundary, checks = _symbols_and_boundary(symbols, boundary, B, S, T, C, am.device, own)
    return B, S, T, C, _blank(termination_symbol, C), y, boundary, checks


def _simple_parts(lm, am, y, blank):
    """The simple joiner's pieces: ``norm (B, S+1, T)`` = log sum_c exp(am(t,c) + lm(s,c))
    (k2's shifted matmul, ``+ tiny``), the shifted exps, and the entries the arcs read; in
    float64 (``am`` and ``lm`` are ``(B, T, C)`` and ``(B, S+1, C)``): a confident node's
    ``1 + rest`` in float32 rounded ``rest`` away (math.md 4.1), and the gradients of the
    entries read and of the normaliser, which cancel there, meet in float64. (In float32 on
    a device without float64: ``reference.lattice_dtype``.)"""
    ldt = reference.lattice_dtype(am.device)
    am, lm = am.to(ldt), lm.to(ldt)
    S = y.shape[1]
    am_max = am.amax(2, keepdim=True)                                          # (B, T, 1)
    lm_max = lm.amax(2, keepdim=True)                                          # (B, S+1, 1)
    am_probs, lm_probs = (am - am_max).exp(), (lm - lm_max).exp()
    norm = (torch.matmul(lm_probs, am_probs.transpose(1, 2)) + torch.finfo(am.dtype).tiny).log()
    norm = norm + lm_max + am_max.transpose(1, 2)                             # (B, S+1, T)
    px_am = torch.gather(am.transpose(1, 2), 1, y[:, :, None].expand(-1, -1, am.shape[1]))
    px_lm = torch.gather(lm[:, :S], 2, y[:, :, None])                         # (B, S, 1)
    py_am, py_lm = am[:, None, :, blank], lm[:, :, blank, None]     # (B, 1, T), (B, S+1, 1)
    return norm, (am_max, lm_max, am_probs, lm_probs), (px_am, px_lm, py_am, py_lm)


def get_rnnt_logprobs(lm: torch.Tensor, am: torch.Tensor, symbols: torch.Tensor,
                      termination_symbol: int, rnnt_type: str = "regular",
                      boundary: torch.Tensor | None = None, *, modified: bool | None = None):
    """k2's ``(px, py)`` of the simple joiner ``logits(t, s, c) = am(t, c) + lm(s, c)``:
    ``lm`` ``(B, S+1, C)``, ``am`` ``(B, T, C)``, ``symbols`` ``(B, S)``::

        px[b, s, t] = am(t, y_s) + lm(s, y_s) - norm(s, t)     (B, S, T+1) regular, else (B, S, T)
        py[b, s, t] = am(t, blank) + lm(s, blank) - norm(s, t)   (B, S+1, T)

    with ``px[:, :, T] = -inf`` (and ``px[b, :, end_frame]``) for ``regular``, ``px += py[:,
    1:]`` for ``constrained``, and ``-inf`` for the symbols past ``end_symbol``. k2's and
    fast_rnnt 1.2's order ``rnnt_type, boundary`` and fast_rnnt 1.0's ``boundary,
    modified`` are both accepted positionally, told apart by type."""
    boundary, rnnt_type = _positions(boundary, rnnt_type)
    rnnt_type = _rnnt_type(rnnt_type, modified)
    B, S, T, C, blank, y, boundary, checks = _simple_args(lm, am, symbols, termination_symbol,
                                                          rnnt_type, boundary)
    nan_rows = assert_rules(*checks)
    norm, _, (px_am, px_lm, py_am, py_lm) = _simple_parts(lm, am, y, blank)
    px, py = _finish(px_am + px_lm - norm[:, :S], py_am + py_lm - norm, boundary, rnnt_type,
                     _read_symbols(boundary, B, S, am.device), nan_rows)
    return px.to(am.dtype), py.to(am.dtype)


def get_rnnt_logprobs_smoothed(lm: torch.Tensor, am: torch.Tensor, symbols: torch.Tensor,
                               termination_symbol: int, lm_only_scale: float = 0.1,
                               am_only_scale: float = 0.1, boundary: torch.Tensor | None = None,
                               rnnt_type: str = "regular", *, modified: bool | None = None):
    """k2's smoothed ``(px, py)``: :func:`get_rnnt_logprobs`'s, log-linearly interpolated
    with LM-only and AM-only log-probs (docs/variants.md A.5; a scale of 0 becomes 1e-20)::

        uni(c)   = mean over b and all S+1 positions of softmax(lm(b, s))(c) + tiny
        px_lm    = lm(s, y_s) - logsumexp_c lm(s, c)
        px_am    = am(t, y_s) + log uni(y_s) - log sum_c exp(am(t, c)) uni(c)
        px'      = (1 - s_lm - s_am) px + s_lm px_lm + s_am px_am   (s_lm = lm_only_scale, ...)

    (``py`` likewise with the blank)."""
    rnnt_type = _rnnt_type(rnnt_type, modified)
    B, S, T, C, blank, y, boundary, checks = _simple_args(lm, am, symbols, termination_symbol,
                                                          rnnt_type, boundary)
    lm_only_scale, am_only_scale = (check_float(name, x, finite=True) for name, x in (
        ("lm_only_scale", lm_only_scale), ("am_only_scale", am_only_scale)))  # each in [0, 1]
    nan_rows = assert_rules(*checks)
    norm, (am_max, lm_max, am_probs, lm_probs), (px_am, px_lm, py_am, py_lm) = \
        _simple_parts(lm, am, y, blank)
    tiny = torch.finfo(lm_probs.dtype).tiny
    lm_sum = lm_probs.sum(2, keepdim=True)                                     # (B, S+1, 1)
    unigram = (lm_probs / lm_sum).mean((0, 1)) + tiny                          # (C,)
    am_norm = (torch.matmul(am_probs, unigram).log() + am_max[..., 0])[:, None, :]   # (B, 1, T)
    lm_norm = lm_sum.log() + lm_max                                            # (B, S+1, 1)
    log_uni = unigram.log()
    px = px_am + px_lm - norm[:, :S]
    py = py_am + py_lm - norm
    px_amonly = px_am + log_uni[y][:, :, None] - am_norm
    py_amonly = py_am + log_uni[blank] - am_norm
    px_lmonly, py_lmonly = px_lm - lm_norm[:, :S], py_lm - lm_norm
    combined = 1.0 - lm_only_scale - am_only_scale
    s_lm = lm_only_scale if lm_only_scale != 0 else 1e-20       # k2: 0 * -inf would be NaN
    s_am = am_only_scale if am_only_scale != 0 else 1e-20
    px = combined * px + s_lm * px_lmonly + s_am * px_amonly
    py = combined * py + s_lm * py_lmonly + s_am * py_amonly
    px, py = _finish(px, py, boundary, rnnt_type, _read_symbols(boundary, B, S, am.device),
                     nan_rows)
    return px.to(am.dtype), py.to(am.dtype)


class _ReadLogProbs(torch.autograd.Function):
    """The log-probs of two classes of each row of ``x (..., C)``, ``x_c - lse`` in the
    lattice dtype: the label ``label (...)`` (int64 class ids) and the blank (an int), with
    the reference backend's row normaliser and gradient (``reference._row_lse``: the max's
    ties counted apart from the rest; ``reference._group_grad``: the bulk in ``x``'s dtype,
    the two read entries formed in the lattice dtype, since they cancel near ``p = 1``;
    math.md 4.1). From ``g_l``, ``g_b``::

        d x_v = [v = label] g_l + [v = blank] g_b - (g_l + g_b) p_v,   p_v = exp(x_v - lse)

    (the group gradient of the reads ``-g``). k2 takes ``torch.logsumexp`` in the inputs'
    dtype, where a confident row's ``1 + rest`` rounded ``rest`` away."""

    @staticmethod
    def forward(ctx, x, label, blank: int):
        x = x.detach()
        lse = reference._row_lse(x, True)                                      # (...)
        x_l = torch.gather(x, -1, label[..., None])[..., 0]
        ctx.save_for_backward(x, lse, label)
        ctx.blank = blank
        ctx.set_materialize_grads(False)
        return x_l.to(lse.dtype) - lse, x[..., blank].to(lse.dtype) - lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_l, g_b):
        x, lse, label = ctx.saved_tensors
        zeros = torch.zeros(lse.shape, dtype=lse.dtype, device=lse.device)
        g = torch.stack([zeros if v is None else v.to(lse.dtype) for v in (g_l, g_b)], -1)
        cls = torch.stack([label, torch.full_like(label, ctx.blank)], -1)
        C = x.shape[-1]
        grad = reference._group_grad(x.reshape(-1, C), lse.reshape(-1), cls.reshape(-1, 2),
                                     (0.0 - g).reshape(-1, 2))
        return grad.view(x.shape), None, None


def get_rnnt_logprobs_joint(logits: torch.Tensor, symbols: torch.Tensor, termination_symbol: int,
                            boundary: torch.Tensor | None = None, rnnt_type: str = "regular", *,
                            modified: bool | None = None):
    """k2's ``(px, py)`` of full joiner logits ``(B, T, S+1, C)``::

        px[b, s, t] = logits(t, s, y_s) - logsumexp_c logits(t, s, c)     (B, S, T+1) / (B, S, T)
        py[b, s, t] = logits(t, s, blank) - logsumexp_c logits(t, s, c)   (B, S+1, T)

    finished as :func:`get_rnnt_logprobs`. fast_rnnt's order ``boundary, rnnt_type`` (1.0:
    ``boundary, modified``) and k2's ``rnnt_type, boundary`` are both accepted positionally,
    told apart by type."""
    boundary, rnnt_type = _positions(boundary, rnnt_type)
    px, py, _ = _joint_px_py(logits, symbols, termination_symbol, boundary,
                             _rnnt_type(rnnt_type, modified))
    return px.to(logits.dtype), py.to(logits.dtype)


def _joint_px_py(logits, symbols, termination_symbol, boundary, rnnt_type):
    """:func:`get_rnnt_logprobs_joint`'s ``(px, py, nan_rows)``: ``nan_rows`` as
    :func:`_pruned_px_py`'s."""
    B, T, S1, C = _tensor("logits", logits, "(B, T, S+1, C)")
    _float("logits", logits)
    S = S1 - 1
    by_name(rnnt_type, K2_TYPES)
    y, boundary, checks = _symbols_and_boundary(symbols, boundary, B, S, T, C, logits.device)
    blank = _blank(termination_symbol, C)
    nan_rows = assert_rules(*checks)
    # (float64, exact on confident rows: _ReadLogProbs; position S reads no label)
    y_row = torch.nn.functional.pad(y, (0, 1), value=blank)[:, None, :].expand(B, T, S1)
    label_w, blank_w = _ReadLogProbs.apply(logits, y_row.contiguous(), blank)  # (B, T, S+1)
    px = label_w[:, :, :S].transpose(1, 2)                                     # (B, S, T)
    py = blank_w.transpose(1, 2)                                               # (B, S+1, T)
    return (*_finish(px, py, boundary, rnnt_type, _read_symbols(boundary, B, S, logits.device),
                     nan_rows), nan_rows)


def _pruned_args(logits, symbols, ranges, termination_symbol, rnnt_type, boundary,
                 own: bool = True):
    """The pruned calls' checks: ``(B, S, T, C, blank, y, boundary, ranges, checks)``
    (``own``, ``checks``: as :func:`_symbols`, for the symbols and the windows)."""
    B, T, R, C = _tensor("logits", logits, "(B, T, R, C)")
    _float("logits", logits)
    if tuple(_tensor("ranges", ranges, "(B, T, R)")) != (B, T, R):
        raise ValueError(f"ranges must have shape (B, T, R) = {(B, T, R)} to match logits "
                         f"{tuple(logits.shape)}, got {tuple(ranges.shape)}")
    if ranges.dtype not in (torch.int32, torch.int64) or ranges.device != logits.device:
        raise ValueError(f"ranges must be int64 on the logits' device, got {ranges.dtype} on "
                         f"{ranges.device}")
    S = _tensor("symbols", symbols, "(B, S)")[1]
    by_name(rnnt_type, K2_TYPES)
    y, boundary, checks = _symbols_and_boundary(symbols, boundary, B, S, T, C, logits.device,
                                                own)
    ranges = ranges.to(torch.int64)
    host = may_read_values(ranges)
    if ranges.numel() and ranges.device.type != "meta" and (host or own):
        bad = (ranges < 0) | (ranges > S)
        bad[..., 1:] |= ranges[..., 1:] <= ranges[..., :-1]
        if host:
            if bool(bad.any()):
                b, t, _ = (int(i) for i in bad.nonzero()[0])
                raise ValueError(f"ranges[{b}, {t}] = {ranges[b, t].tolist()} must be "
                                 f"increasing symbol positions in [0, S] = [0, {S}]")
        else:
            # On the device or traced: the positions kept in [0, S] before the (px, py)
            # paths gather and scatter by them; the rule for the caller to assert.
            ranges, checks = ranges.clamp(0, S), checks + (("ranges", bad.flatten(1).any(1)),)
    return B, S, T, C, _blank(termination_symbol, C), y, boundary, ranges, checks


def _pruned_px_py(logits, symbols, ranges, termination_symbol, boundary, rnnt_type, hat: bool):
    """``(px, py, nan_rows)`` of window logits ``(B, T, R, C)``: the window rows' arc
    log-probs scattered to their symbol positions, ``-inf`` outside the windows;
    ``nan_rows`` ``(B,)`` (NaN for a sequence the device check found bad, else 0; None:
    checked on the host) for a loss computed from them (:func:`_px_py_loss`), since an
    empty lattice reads no entry of its NaN ``(px, py)``."""
    B, S, T, C, blank, y, boundary, ranges, checks = _pruned_args(
        logits, symbols, ranges, termination_symbol, rnnt_type, boundary)
    if hat and blank != 0:
        raise ValueError(f"use_hat_loss=True needs termination_symbol = 0 (HAT's blank is the "
                         f"first class), got {termination_symbol}")
    if hat and C < 2:
        raise ValueError(f"use_hat_loss=True needs a label class besides the blank: logits "
                         f"{tuple(logits.shape)} has C = {C}")
    nan_rows = assert_rules(*checks)
    R = ranges.shape[2]
    y_row = torch.nn.functional.pad(y, (0, 1), value=blank)          # position S reads no label
    y_row = torch.gather(y_row, 1, ranges.reshape(B, T * R)).view(B, T, R, 1)
    if hat:
        # HAT: a Bernoulli blank, then a softmax over the other classes, whose log-probs
        # are _ReadLogProbs' (float64, exact on confident rows) of the label and of class 1;
        # a label equal to the blank (k2 reads x_0 there) is x_0 - x_1 + log p(1).
        y = y_row[..., 0]
        lp, lp1 = _ReadLogProbs.apply(logits[..., 1:], (y - 1).clamp(min=0), 0)
        x0 = logits[..., 0]
        ldt = lp.dtype                   # the lattice dtype (reference.lattice_dtype)
        lp = torch.where(y == 0, (x0 - logits[..., 1]).to(ldt) + lp1, lp)
        blank_w = torch.nn.functional.logsigmoid(x0).to(ldt)
        label_w = lp + torch.nn.functional.logsigmoid(-x0).to(ldt)
    else:                                # (float64, exact on confident rows: _ReadLogProbs)
        label_w, blank_w = _ReadLogProbs.apply(logits, y_row[..., 0], blank)
    grid = label_w.new_full((B, T, S + 1), NEG_INF)
    px = grid.scatter(2, ranges, label_w)[:, :, :S].transpose(1, 2)            # (B, S, T)
    py = grid.scatter(2, ranges, blank_w).transpose(1, 2)                      # (B, S+1, T)
    return (*_finish(px, py, boundary, rnnt_type, _read_symbols(boundary, B, S, logits.device),
                     nan_rows), nan_rows)


def get_rnnt_logprobs_pruned(logits: torch.Tensor, symbols: torch.Tensor, ranges: torch.Tensor,
                             termination_symbol: int, boundary: torch.Tensor | None = None,
                             rnnt_type: str = "regular", *, modified: bool | None = None):
    """k2's ``(px, py)`` of the pruned joiner: ``logits`` ``(B, T, R, C)`` on the windows
    ``ranges`` ``(B, T, R)`` (row ``k`` of frame ``t`` is symbol position ``ranges[b, t,
    k]``); each window row's log-probs as :func:`get_rnnt_logprobs_joint`, every arc
    outside the windows ``-inf``."""
    px, py, _ = _pruned_px_py(logits, symbols, ranges, termination_symbol, boundary,
                              _rnnt_type(rnnt_type, modified), hat=False)
    return px.to(logits.dtype), py.to(logits.dtype)


# ---------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------

def rnnt_loss(logits: torch.Tensor, symbols: torch.Tensor, termination_symbol: int,
              boundary: torch.Tensor | None = None, rnnt_type: str = "regular",
              delay_penalty: float = 0.0, reduction: str = "mean", return_grad: bool = False, *,
              modified: bool | None = None):
    """k2's ``rnnt_loss``: ``logits`` ``(B, T, S+1, C)``, ``symbols`` ``(B, S)``; the loss
    ``(B,)`` for ``reduction="none"``, else a scalar (``"mean"``: sum / B), of
    :func:`rnnt_lattice.rnnt_loss` (fused kernels). ``return_grad`` (fast_rnnt): also
    ``(px_grad, py_grad)``, then computed as k2 does, from
    :func:`get_rnnt_logprobs_joint`."""
    rnnt_type, delay_penalty, reduction = _v10(rnnt_type, modified, delay_penalty, reduction)
    _check_reduction(reduction)
    delay_penalty = _delay_penalty(delay_penalty)    # (host rules before any device assert)
    B, T, S1, C = _tensor("logits", logits, "(B, T, S+1, C)")
    if check_flag("return_grad", return_grad):
        px, py, nan_rows = _joint_px_py(logits, symbols, termination_symbol,
                                        *_positions(boundary, rnnt_type))
        return _px_py_loss(px, py, nan_rows,
                           boundary if boundary is None else boundary.to(torch.int64),
                           delay_penalty, reduction, True, logits.dtype)
    _float("logits", logits)
    by_name(rnnt_type, K2_TYPES)
    # (own=False: on the device the library's loss checks the symbols, as its targets.)
    _, boundary, _ = _symbols_and_boundary(symbols, boundary, B, S1 - 1, T, C, logits.device,
                                           own=False)
    T_b, S_b = _ends(boundary, B, S1 - 1, T, logits.device)
    costs = _lib.rnnt_loss(logits, symbols, T_b, S_b, _blank(termination_symbol, C),
                           reduction="none", rnnt_type=rnnt_type,
                           delay_penalty=delay_penalty, boundary=boundary,
                           allow_blank_targets=True)
    return _reduce(_k2_empty(costs, boundary, S1 - 1, T), reduction)


def rnnt_loss_simple(lm: torch.Tensor, am: torch.Tensor, symbols: torch.Tensor,
                     termination_symbol: int, boundary: torch.Tensor | None = None,
                     rnnt_type: str = "regular", delay_penalty: float = 0.0,
                     reduction: str = "mean", return_grad: bool = False, *,
                     modified: bool | None = None):
    """k2's ``rnnt_loss_simple``: the joiner ``am + lm`` (``lm`` ``(B, S+1, C)``, ``am``
    ``(B, T, C)``) without building ``(B, T, S+1, C)``: :func:`rnnt_lattice.rnnt_loss_simple`."""
    return _simple_like(_lib.rnnt_loss_simple, lm, am, symbols, termination_symbol, boundary,
                        *_v10(rnnt_type, modified, delay_penalty, reduction), return_grad)


def rnnt_loss_smoothed(lm: torch.Tensor, am: torch.Tensor, symbols: torch.Tensor,
                       termination_symbol: int, lm_only_scale: float = 0.1,
                       am_only_scale: float = 0.1, boundary: torch.Tensor | None = None,
                       rnnt_type: str = "regular", delay_penalty: float = 0.0,
                       reduction: str = "mean", return_grad: bool = False, *,
                       modified: bool | None = None):
    """k2's ``rnnt_loss_smoothed``: :func:`rnnt_lattice.rnnt_loss_smoothed`
    (:func:`get_rnnt_logprobs_smoothed`'s interpolation)."""
    return _simple_like(_lib.rnnt_loss_smoothed, lm, am, symbols, termination_symbol, boundary,
                        *_v10(rnnt_type, modified, delay_penalty, reduction), return_grad,
                        lm_only_scale=lm_only_scale, am_only_scale=am_only_scale)


def _simple_like(fn, lm, am, symbols, termination_symbol, boundary, rnnt_type, delay_penalty,
                 reduction, return_grad, **kw):
    """One of the library's simple losses called the k2 way: the lengths from ``boundary``,
    the occupations in k2's layout and dtype."""
    return_grad = check_flag("return_grad", return_grad)
    _check_reduction(reduction)
    delay_penalty = _delay_penalty(delay_penalty)
    # (own=False: on the device the library's simple loss checks the symbols, as its targets.)
    B, S, T, C, blank, _, boundary, _ = _simple_args(lm, am, symbols, termination_symbol,
                                                     rnnt_type, boundary, own=False)
    T_b, S_b = _ends(boundary, B, S, T, am.device)
    out = fn(lm, am, symbols, T_b, S_b, blank=blank, rnnt_type=rnnt_type,
             delay_penalty=delay_penalty, boundary=boundary, reduction="none",
             return_occupations=return_grad, allow_blank_targets=True, **kw)
    costs, occ = out if return_grad else (out, None)
    loss = _reduce(_k2_empty(costs, boundary, S, T), reduction)
    if not return_grad:
        return loss
    return loss, _to_k2(occ.gamma_blank, occ.gamma_label, T, rnnt_type == "regular", am.dtype)


def rnnt_loss_pruned(logits: torch.Tensor, symbols: torch.Tensor, ranges: torch.Tensor,
                     termination_symbol: int, boundary: torch.Tensor | None = None,
                     rnnt_type: str = "regular", delay_penalty: float = 0.0,
                     reduction: str = "mean", *ambiguous, return_grad: bool = False,
                     use_hat_loss: bool = False, modified: bool | None = None):
    """k2's ``rnnt_loss_pruned``: ``logits`` ``(B, T, R, C)`` on the windows ``ranges``
    ``(B, T, R)``: :func:`rnnt_lattice.rnnt_loss_pruned` (fused kernels).

    ``use_hat_loss=True`` (k2): the HAT loss (Variani et al. 2020, arXiv:2003.07705), whose
    blank is a Bernoulli and whose labels a softmax over the other classes; it needs
    ``termination_symbol = 0``::

        py = logsigmoid(x[..., 0])
        px = x[..., y] - logsumexp(x[..., 1:]) + logsigmoid(-x[..., 0])     # x: the logits

    ``return_grad=True`` (fast_rnnt): also ``(px_grad, py_grad)``. Both are keyword-only:
    fast_rnnt's ninth parameter is ``return_grad``, k2's ``use_hat_loss``. With either, the
    loss is computed as k2 does, from ``(px, py)``, with autograd."""
    if ambiguous:
        raise ValueError("rnnt_loss_pruned takes 8 positional arguments: the ninth is "
                         "return_grad in fast_rnnt and use_hat_loss in k2; pass it by keyword")
    rnnt_type, delay_penalty, reduction = _v10(rnnt_type, modified, delay_penalty, reduction)
    _check_reduction(reduction)
    delay_penalty = _delay_penalty(delay_penalty)    # (host rules before any device assert)
    # (k2 reads both by truth value: the string "False" was True, None False)
    use_hat_loss = check_flag("use_hat_loss", use_hat_loss)
    return_grad = check_flag("return_grad", return_grad)
    if use_hat_loss or return_grad:
        px, py, nan_rows = _pruned_px_py(logits, symbols, ranges, termination_symbol, boundary,
                                         rnnt_type, hat=use_hat_loss)
        return _px_py_loss(px, py, nan_rows,
                           boundary if boundary is None else boundary.to(torch.int64),
                           delay_penalty, reduction, return_grad, logits.dtype)
    # (own=False: on the device the library's loss checks the symbols and the windows.)
    B, S, T, C, blank, _, boundary, _, _ = _pruned_args(logits, symbols, ranges,
                                                        termination_symbol, rnnt_type, boundary,
                                                        own=False)
    T_b, S_b = _ends(boundary, B, S, T, logits.device)
    costs = _lib.rnnt_loss_pruned(logits, symbols, ranges, T_b, S_b, blank=blank,
                                  reduction="none", rnnt_type=rnnt_type,
                                  delay_penalty=delay_penalty, boundary=boundary,
                                  allow_blank_targets=True)
    return _reduce(_k2_empty(costs, boundary, S, T), reduction)


# ---------------------------------------------------------------------------------------
# Pruning
# ---------------------------------------------------------------------------------------

def get_rnnt_prune_ranges(px_grad: torch.Tensor, py_grad: torch.Tensor,
                          boundary: torch.Tensor | None, s_range: int) -> torch.Tensor:
    """k2's ``get_rnnt_prune_ranges`` (``rnnt_lattice.prune_ranges(method="k2")``): ``ranges``
    ``(B, T, R')`` int64 from the occupations ``return_grad`` gave. Per frame, the window
    start maximising ``sum_{k<R} py_grad[s+k, t] - px_grad[s-1, t]``, then made monotone.
    ``R'`` may differ from ``s_range`` (read ``ranges.shape[-1]``): raised, with a
    ``RuntimeWarning``, where a sequence's end is out of reach, capped at ``S + 1``."""
    gamma_blank, gamma_label, regular = _from_k2(px_grad, py_grad)
    return _prune(gamma_blank, gamma_label, regular, boundary, s_range)


def get_rnnt_prune_ranges_deprecated(px_grad: torch.Tensor, py_grad: torch.Tensor,
                                     boundary: torch.Tensor | None, s_range: int) -> torch.Tensor:
    """k2's older window choice (kept in k2 for comparison): the start maximising the
    window's total occupation ``sum_{k<R} (px_grad + py_grad)[s+k, t]``, with the window-size
    rules and the monotone repair of :func:`get_rnnt_prune_ranges`."""
    gamma_blank, gamma_label, regular = _from_k2(px_grad, py_grad)
    # k2's score with no label term: the window sum of both occupations.
    return _prune(gamma_blank + gamma_label, torch.zeros_like(gamma_label), regular, boundary,
                  s_range)


def _prune(gamma_blank, gamma_label, regular, boundary, s_range):
    s_range = check_int("s_range", s_range)
    if s_range < 1:
        raise ValueError(f"s_range must be >= 1 (the symbols per frame's window), got {s_range}")
    B, T, S1 = gamma_blank.shape
    boundary = _boundary(boundary, B, S1 - 1, T, gamma_blank.device)
    check_values_held("get_rnnt_prune_ranges reads the sequences' ends (the window's size, the "
                      "ranges' shape)", ("px_grad", gamma_label),
                      *(() if boundary is None else (("boundary", boundary),)))
    T_b, S_b = _ends(boundary, B, S1 - 1, T, gamma_blank.device)
    # (a raised window's warning names the caller's line: _validate.user_stacklevel)
    return _lib.prune_ranges((gamma_blank, gamma_label), s_range, method="k2",
                             logit_lengths=T_b, target_lengths=S_b, boundary=boundary,
                             rnnt_type="regular" if regular else "modified").ranges


def do_rnnt_pruning(am: torch.Tensor, lm: torch.Tensor, ranges: torch.Tensor):
    """k2's ``do_rnnt_pruning``: ``am`` ``(B, T, Da)``, ``lm`` ``(B, S+1, Dl)`` -> the joiner's
    inputs on the windows, ``(am (B, T, R, Da), lm (B, T, R, Dl))``
    (:func:`rnnt_lattice.do_rnnt_pruning`)."""
    return _lib.do_rnnt_pruning(am, lm, ranges)
