"""CPU backend: Numba kernels (``kernels.py``) behind the backend protocol
(``_backends.Backend``).

Every topology, per-arc term (sigma, delay penalty), k2 boundary and row layout
(``node_rows``: packed or pruned logits rows) runs on the generic kernels over a table of
arc kinds (``kind_table``); the plain regular loss keeps its own row and gradient passes
(``REGULAR_KERNELS``) and shares the generic lattice pass (``REGULAR_LATTICE``).
The lattice tools of every topology (``occupancy``, ``viterbi``: per-kind occupations, and
the max-plus sweep with the best incoming kind of every node) run the loss's generic
passes.

Importing this module imports Numba (that is how ``_backends`` detects it); the kernels
compile on first use and are cached on disk (``_config.CACHE``).

Memory: the forward pass of a loss that needs a gradient allocates one buffer the size
of the logits and fills it with ``exp(logits - rowmax)``; the backward pass turns that
buffer into the gradient in place and hands it to autograd (one exp and one multiply per
element in total). Everything else is O(B*T*(U+1)). The buffer is handed over once: a
second backward of the same graph (``retain_graph=True``) recomputes the exps from the
saved logits with the same code, so it returns a bit-identical gradient; the saved
logits are never modified.

With ``inplace_grad=True`` the logits buffer itself takes the exps and then the gradient:
no allocation at all, but the logits are gone after the forward pass (and a second
backward cannot recompute them: it raises).

Where the buffer comes from (see docs/benchmarks.md, "Page faults"): a fresh gradient
buffer touched in 4 KiB pages costs as much in page faults as the exp pass itself. So
(1) it is a NumPy allocation, which asks the kernel for transparent huge pages
(``madvise(MADV_HUGEPAGE)``) when large, and (2) the last large buffer is kept and handed
out again once nothing references it any more (autograd and the joiner's backward have
dropped it, the user kept no ``.grad``): a training loop then reuses one buffer instead
of faulting a new one in every step. That buffer stays allocated between calls, like a
block of PyTorch's CUDA caching allocator; ``rnnt_lattice.empty_cache()`` releases it and
``RNNT_LATTICE_CACHE_GRAD=0`` turns the reuse off (``_config``).

Threads: the buffer is checked and claimed under a lock, so two threads are never handed
the same one; the kernels release the GIL. How the parallel kernels behave under threads
and in forked children is ``_config``'s business (docs/api.md, "Reliability").
"""
from __future__ import annotations

import functools
import os
import sys
import threading
from typing import NamedTuple

import numpy as np
import torch

from .. import torch_backend
from .._types import Lattice, LossOptions
from ..reference import Ends
from ..topology import Topology, regular
from . import _config, kernels

__all__ = ["loss_forward", "loss_backward", "occupancy", "viterbi", "lattice_of_weights",
           "window_dp", "simple_rescue", "simple_rescue_backward", "empty_cache"]

NAME = "numba"
NATIVE_LOW_PRECISION = False      # float16/bfloat16 logits are promoted to float32 first
NATIVE_INT32_IDS = False          # ids and lengths are converted to int64 first

# The simple losses' log-domain rescue of the few nodes beyond the float64 matmul's range
# (``pruned``): the PyTorch backend's host loop over those nodes serves the CPU.
simple_rescue = torch_backend.simple_rescue
simple_rescue_backward = torch_backend.simple_rescue_backward

_REGULAR = regular()


class _RegularLattice(NamedTuple):
    """The regular kernels' lattice, ``(B, T, U+1)`` node tensors (no end frame)."""

    alpha: torch.Tensor
    beta: torch.Tensor
    log_like: torch.Tensor       # (B,)
    gamma_blank: torch.Tensor
    gamma_label: torch.Tensor


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().numpy()


class _BufferCache:
    """One reusable NumPy array for gradient buffers (see the module docstring).

    ``torch.from_numpy`` makes the tensor's storage hold a reference to the array (through
    the view handed out), so the array is free exactly when its reference count is back
    to the cache's own one: no tensor, view or NumPy alias of it is alive anywhere.

    The check and the claim (the view handed out, which holds a reference to the array)
    happen under one lock: a second caller, in any thread, sees the array busy.
    """

    MIN_BYTES = 4 << 20          # smaller buffers fault in little time: not worth keeping

    def __init__(self):
        self.array = None
        self.lock = threading.Lock()

    def empty(self, shape, dtype: np.dtype) -> torch.Tensor:
        n = int(np.prod(shape))
        nbytes = n * np.dtype(dtype).itemsize
        if not _config.CACHE_GRAD or nbytes < self.MIN_BYTES:
            return torch.from_numpy(np.empty(shape, dtype=dtype))
        with self.lock:
            # getrefcount sees the attribute and its own argument: 2 means nobody else.
            if self.array is not None and (self.array.dtype != dtype or self.array.size < n
                                           or sys.getrefcount(self.array) > 2):
                self.array = None                    # busy or unfit: its users keep it alive
            if self.array is None:
                self.array = np.empty(n, dtype=dtype)
            return torch.from_numpy(self.array[:n].reshape(shape))   # claimed: refcount 3

    def clear(self) -> None:
        with self.lock:
            self.array = None

    def _after_fork_in_child(self) -> None:
        self.lock = threading.Lock()    # another thread of the parent may have held it


_buffers = _BufferCache()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_buffers._after_fork_in_child)


def empty_cache() -> None:
    """Release the kept gradient buffer (its memory returns once no tensor uses it)."""
    _buffers.clear()


def _empty_like(x: torch.Tensor) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor like ``x``, from the buffer cache."""
    return _buffers.empty(tuple(x.shape), _np(x[:0]).dtype)


def _zeros_like(x: torch.Tensor) -> torch.Tensor:
    out = _empty_like(x)
    _np(out).fill(0)
    return out


def _row_pass(logits, targets, logit_lengths, target_lengths, blank, fused, buf=None):
    """Pass 1 (``kernels.row_pass``): ``(shift, inv_sum, lpb, lpl)``, each ``(B, T, U+1)``;
    the exps go into ``buf`` when one is given."""
    B, T, U1, V = logits.shape
    x = _np(logits)
    shift = np.empty((B, T, U1), dtype=x.dtype)
    inv_sum, lpb, lpl = (np.empty((B, T, U1)) for _ in range(3))
    kernels.row_pass(x, _np(targets), _np(logit_lengths), _np(target_lengths), blank, fused,
                     buf is not None, kernels.spread_stride(B * T),
                     np.empty((0, 0, 0, 0), dtype=x.dtype) if buf is None else _np(buf),
                     shift, inv_sum, lpb, lpl)
    return shift, inv_sum, lpb, lpl


def _forward(logits, targets, logit_lengths, target_lengths, blank, fused, store, into=None):
    """Passes 1-2: row statistics (+ exps stored in ``into`` or a new buffer) and the lattice.

    ``into`` may be ``logits`` itself (in-place mode): each row is read completely (max,
    then exp) before its exps overwrite it, so the row pass is safe in place.
    """
    B, T, U1, V = logits.shape
    buf = (_empty_like(logits) if into is None else into) if store else None
    shift, inv_sum, lpb, lpl = _row_pass(logits, targets, logit_lengths, target_lengths, blank,
                                         fused, buf)
    tl, ul = _np(logit_lengths), _np(target_lengths)
    if REGULAR_LATTICE:
        alpha = np.full((B, T, U1), -np.inf)
        beta = np.full((B, T, U1), -np.inf)
        log_like = np.empty(B)
        gamma_blank = np.zeros((B, T, U1))
        gamma_label = np.zeros((B, T, U1))
        kernels.lattice(lpb, lpl, tl, ul, alpha, beta, log_like, gamma_blank, gamma_label)
    else:
        # The generic row-wise pass 2 on the two kinds (faster than the dedicated one), its
        # results in the regular layout: (B, T, U+1), -inf / 0 off each sequence's nodes
        # (the generic lattice's virtual end frame t = T_b is no node here).
        w = np.empty((B, 2, T, U1))
        nan_row = np.empty((B, T), dtype=np.uint8)
        kernels.regular_weights(lpb, lpl, tl, ul, w, nan_row)
        ends = _ends(logit_lengths, target_lengths, None, T, U1)
        alpha, beta, log_like, gamma = _kind_lattice(w, nan_row, kind_table(_REGULAR, 0), ends)
        past = np.arange(T)[None, :, None] >= tl.astype(np.int64)[:, None, None]   # t >= T_b
        alpha = np.where(past, -np.inf, alpha[:, :T])
        beta = np.where(past, -np.inf, beta[:, :T])
        gamma_blank = np.ascontiguousarray(gamma[:, 0])
        gamma_label = np.ascontiguousarray(gamma[:, 1])
    return buf, shift, inv_sum, _RegularLattice(*(torch.from_numpy(a) for a in
                                          (alpha, beta, log_like, gamma_blank, gamma_label)))


# Pass 2 of the regular loss: the dedicated kernel
# (``kernels.lattice``, ``REGULAR_LATTICE = True``) or the generic row-wise one
# (``kernels.kind_lattice`` on ``kernels.regular_weights``), which measured ~2.7x faster at
# s4 (14.7 against 5.4 ms, 1 thread). The tests run both.
REGULAR_LATTICE = False


# --------------------------------------------------------------------------- loss
INPLACE_WRITES_IN = "forward"     # in-place mode stores the exps in the logits right away


@functools.lru_cache(maxsize=64)
def kind_table(topo: Topology, blank: int) -> np.ndarray:
    """The arc kinds of ``topo`` as the ``(N_FIELDS, K)`` int64 table the kernels read
    (``kernels.DT`` ...): the class each kind reads resolved to a token id (-1: the label
    y[u]). Read-only: it is shared by every call with this topology and blank."""
    rows = []
    for k in topo.kinds:
        cls = blank if k.reads == "blank" else (k.class_id if k.reads == "class" else -1)
        rows.append((k.dt, k.du, cls, k.duration, int(k.plus_next_blank), int(k.fastemit),
                     int(k.delay), int(k.may_end)))
    table = np.ascontiguousarray(np.array(rows, dtype=np.int64).T.reshape(kernels.N_FIELDS, -1))
    table.setflags(write=False)
    return table


def _ends(logit_lengths, target_lengths, boundary, T: int, U1: int):
    """``(t0, u0, t1, u1)`` (B,) int64 arrays: start and end node of each lattice
    (``reference.Ends``: k2's boundary rows ``[begin_symbol, begin_frame, end_symbol,
    end_frame]``, checked as k2 checks them)."""
    if boundary is None:
        tl = _np(logit_lengths).astype(np.int64, copy=False)
        ul = _np(target_lengths).astype(np.int64, copy=False)
        zero = np.zeros_like(tl)
        return zero, zero, tl, ul
    ends = Ends.of(logit_lengths, target_lengths, boundary)
    ends.check(T, U1)
    return tuple(np.ascontiguousarray(_np(x.to(torch.int64))) for x in (ends.t0, ends.u0, ends.t1, ends.u1))


def _node_rows(node_rows, B: int, T: int, U1: int) -> np.ndarray:
    """(B, T, U+1) int64 row of each node: the given map, or the identity of the padded
    layout ``(B, T, U+1, V)`` viewed as ``(B*T*(U+1), V)``."""
    if node_rows is None:
        return np.arange(B * T * U1, dtype=np.int64).reshape(B, T, U1)
    return np.ascontiguousarray(_np(node_rows).astype(np.int64, copy=False))


# Two kernel sets compute the loss. The generic one (``kind_row_pass``, ``kind_lattice``,
# ``kind_grad_rows``) runs every topology, per-arc term, boundary and row layout. The plain
# regular loss (no sigma, no delay penalty, no boundary, padded logits) keeps its own
# kernels (``row_pass``, ``lattice``, ``grad_rows``): the generic ones give the same
# numbers but were measured 10-18% slower on it (per-node bookkeeping over the kind table
# in the row and gradient passes; B=8, T=200, U=50, V=1024 float32, serial CPU time), and
# the standard loss must not lose speed. ``REGULAR_KERNELS = False`` sends it through the
# generic ones too (the tests do, to check them on the regular lattice).
REGULAR_KERNELS = True


class _State:
    """What the backward pass needs besides saved tensors. ``buf`` (the forward's exp
    buffer, or the logits themselves in place, shaped like the logits) is handed over once.
    ``lat`` is the regular kernels' ``_RegularLattice``, or None for the generic ones (``gamma``...)."""

    def __init__(self, buf, stats, inplace, shape, lat=None, gamma=None, log_like=None,
                 ends=None, node_rows=None, kinds=None, blank=None, n_dur=0):
        self.buf, self.stats, self.inplace, self.shape = buf, stats, inplace, shape
        self.lat = lat
        self.gamma, self.log_like, self.ends, self.node_rows = gamma, log_like, ends, node_rows
        self.kinds, self.blank, self.n_dur = kinds, blank, n_dur


def _kind_rows(rows, targets, ends, node_rows, kinds, blank, n_dur, opts: LossOptions, buf):
    """Pass 1 (``kernels.kind_row_pass``) on logits rows ``(N, V)``: ``(stats, w, nan_row)``
    with the arc weights ``w (B, K, T, U+1)``; the exps go into ``buf`` (N, V) unless None
    (it may be ``rows`` itself: in-place mode)."""
    B, T, U1 = node_rows.shape
    K = kinds.shape[1]
    x = _np(rows)
    shift, shift_d = (np.empty((B, T, U1), dtype=x.dtype) for _ in range(2))
    inv_sum, inv_sum_d = (np.empty((B, T, U1)) for _ in range(2))
    # The stored exp of each class a node reads (one column per distinct class of the
    # kinds, + the blank of plus_next_blank arcs): the gradient pass needs them before it
    # overwrites the row, and reading them from the row costs it a memory latency per node.
    n_reads = len(set(kinds[kernels.CLS].tolist())) + 1 if buf is not None else 0
    e_read = np.empty((B, T, U1, n_reads) if n_reads else (0, 0, 0, 0), dtype=x.dtype)
    w = np.empty((B, K, T, U1))
    nan_row = np.empty((B, T), dtype=np.uint8)
    t0, u0, t1, u1 = ends
    kernels.kind_row_pass(x, node_rows, _np(targets), t0, u0, t1, u1, kinds, blank, n_dur,
                          opts.fused, buf is not None, float(opts.sigma),
                          float(opts.delay_penalty), kernels.spread_stride(B * T),
                          np.empty((0, 0), dtype=x.dtype) if buf is None else _np(buf),
                          shift, inv_sum, shift_d, inv_sum_d, e_read, w, nan_row)
    return (shift, inv_sum, shift_d, inv_sum_d, e_read), w, nan_row


def _kind_lattice(w, nan_row, kinds, ends):
    """Pass 2 (``kernels.kind_lattice``): ``(alpha, beta, log_like, gamma)``."""
    B, K, T, U1 = w.shape
    alpha = np.full((B, T + 1, U1), -np.inf)
    beta = np.full((B, T + 1, U1), -np.inf)
    log_like = np.empty(B)
    gamma = np.zeros((B, K, T, U1))
    kernels.kind_lattice(w, kinds, *ends, nan_row, alpha, beta, log_like, gamma)
    return alpha, beta, log_like, gamma


def _kind_forward(rows, targets, ends, node_rows, kinds, blank, n_dur, opts: LossOptions, buf):
    """Passes 1-2 (``kernels.kind_row_pass``, ``kernels.kind_lattice``) on logits rows
    ``(N, V)``: ``(stats, gamma, log_like)``; the exps go into ``buf`` (N, V) unless None
    (it may be ``rows`` itself: in-place mode)."""
    stats, w, nan_row = _kind_rows(rows, targets, ends, node_rows, kinds, blank, n_dur, opts, buf)
    _, _, log_like, gamma = _kind_lattice(w, nan_row, kinds, ends)
    return stats, gamma, log_like


def loss_forward(logits, targets, logit_lengths, target_lengths, opts: LossOptions, need_grad,
                 boundary=None, node_rows=None):
    """Passes 1-2 (``_ops`` protocol): ``(costs, saved, state)``, for any topology.

    ``logits``: ``(B, T, U+1, V)``, or rows ``(N, V)`` with ``node_rows (B, T, U+1)`` int64
    (node (b, t, u) reads row ``node_rows[b, t, u]``, -1: none; every row is read by one
    node). With a gradient wanted in fused mode the exps are stored in a buffer like the
    logits (the logits themselves with ``opts.inplace_grad``: each row is read completely
    before its exps overwrite it)."""
    inplace = need_grad and opts.inplace_grad
    store = need_grad and opts.fused
    shape = tuple(logits.shape)
    V = shape[-1]
    buf = (logits if inplace else _empty_like(logits)) if store else None
    if REGULAR_KERNELS and opts.regular and boundary is None and node_rows is None:
        buf, shift, inv_sum, lat = _forward(logits, targets, logit_lengths, target_lengths,
                                            opts.blank, opts.fused, store, into=buf)
        log_like = lat.log_like.numpy()
        state = _State(buf, (shift, inv_sum), inplace, shape, lat=lat)
    else:
        topo = opts.topology or _REGULAR
        blank = topo.check(V, opts.blank)
        B, T, U1 = shape[:3] if node_rows is None else tuple(node_rows.shape)
        nodes = _node_rows(node_rows, B, T, U1)
        ends = _ends(logit_lengths, target_lengths, boundary, T, U1)
        kinds = kind_table(topo, blank)
        stats, gamma, log_like = _kind_forward(logits.view(-1, V), targets, ends, nodes, kinds,
                                               blank, topo.n_durations, opts,
                                               None if buf is None else buf.view(-1, V))
        state = _State(buf, stats, inplace, shape, gamma=gamma, log_like=log_like, ends=ends,
                       node_rows=nodes, kinds=kinds, blank=blank, n_dur=topo.n_durations)
    costs = torch.from_numpy(-log_like).to(logits.dtype)
    if not need_grad:
        return costs, (), None
    # In-place mode keeps no logits (they are overwritten); its buffer is the logits.
    saved = (targets, logit_lengths, target_lengths) + (() if inplace else (logits,))
    if inplace:
        state.buf = logits
    return costs, saved, state


def loss_backward(saved, state: _State, upstream, opts: LossOptions):
    """Pass 3 (``_ops`` protocol): the gradient, upstream factor fused, shaped like the
    logits, into the forward's buffer (handed over: no reference stays here, so autograd
    adopts it without a copy); a second backward recomputes the exps from the saved logits
    with the same code, so it returns a bit-identical gradient."""
    st = state
    targets, logit_lengths, target_lengths, *rest = saved
    logits = rest[0] if rest else None
    if st.inplace and st.buf is None:
        raise RuntimeError(
            "rnnt_loss(inplace_grad=True): the logits buffer already holds the gradient of "
            "the first backward; a second backward (retain_graph=True) is not possible")
    if st.inplace and not opts.fused:
        dst, from_logits = st.buf, False
        _np(dst).fill(0)
        st.buf = None
    elif not opts.fused:
        dst, from_logits = _zeros_like(logits), False
    elif st.buf is not None:
        dst, from_logits = st.buf, False
        st.buf = None
    else:
        dst, from_logits = _empty_like(logits), True
    src = dst if logits is None else logits
    up = upstream.detach().to(torch.float64).contiguous().numpy()
    if st.lat is not None:                    # the regular kernels
        shift, inv_sum = st.stats
        # FastEmit (math.md section 6): label arcs get (1 + lambda) times their gradient.
        gamma_label = st.lat.gamma_label.numpy()
        if opts.fastemit_lambda != 0.0:
            gamma_label = gamma_label * (1.0 + opts.fastemit_lambda)
        B, T = dst.shape[:2]
        kernels.grad_rows(_np(src), _np(dst), from_logits, _np(targets), _np(logit_lengths),
                          _np(target_lengths), opts.blank, opts.fused, kernels.spread_stride(B * T),
                          shift, inv_sum, st.lat.gamma_blank.numpy(), gamma_label, up,
                          float(opts.clamp))
        return dst
    V = st.shape[-1]
    B, T = st.node_rows.shape[:2]
    t0, u0, t1, u1 = st.ends
    shift, inv_sum, shift_d, inv_sum_d, e_read = st.stats
    kernels.kind_grad_rows(_np(src).reshape(-1, V), _np(dst).reshape(-1, V), from_logits,
                           st.node_rows, _np(targets), t0, u0, t1, u1, st.kinds, st.blank,
                           st.n_dur, opts.fused, kernels.spread_stride(B * T), shift, inv_sum,
                           shift_d, inv_sum_d, e_read, st.gamma, st.log_like,
                           1.0 + float(opts.fastemit_lambda), up, float(opts.clamp))
    return dst


# --------------------------------------------------------------------------- lattice tools
def _kind_weights(logits, targets, logit_lengths, target_lengths, opts: LossOptions, boundary):
    """Pass 1 of the lattice tools (no gradient work, no exps stored) for any topology:
    ``(w, nan_row, kinds, ends)``."""
    logits = logits.contiguous()
    B, T, U1, V = logits.shape
    topo = opts.topology or _REGULAR
    blank = topo.check(V, opts.blank)
    ends = _ends(logit_lengths, target_lengths, boundary, T, U1)
    kinds = kind_table(topo, blank)
    _, w, nan_row = _kind_rows(logits.view(-1, V), targets, ends, _node_rows(None, B, T, U1),
                               kinds, blank, topo.n_durations, opts, None)
    return w, nan_row, kinds, ends


def occupancy(logits, targets, logit_lengths, target_lengths, opts: LossOptions,
              boundary=None) -> Lattice:
    """The lattice of any topology (``opts``: topology, blank, fused, sigma, delay
    penalty; k2 ``boundary``) without gradient work: the loss's passes 1-2
    (``kernels.kind_row_pass``, ``kernels.kind_lattice``). A
    :class:`rnnt_lattice._types.Lattice` as ``reference.lattice_generic``
    returns it: alpha, beta ``(B, T+1, U+1)`` (-inf off each sequence's nodes), log P
    ``(B,)``, per-kind occupations ``gamma (B, K, T, U+1)`` (0 off the arcs)."""
    with torch.no_grad():
        w, nan_row, kinds, ends = _kind_weights(logits, targets, logit_lengths, target_lengths,
                                                opts, boundary)
        return Lattice(*(torch.from_numpy(a) for a in _kind_lattice(w, nan_row, kinds, ends)))


def viterbi(logits, targets, logit_lengths, target_lengths, opts: LossOptions, boundary=None):
    """Max-plus sweep of any topology (``kernels.kind_viterbi``): ``(alpha_max, best_kind,
    log_prob)`` as ``reference.viterbi_generic`` returns them: ``(B, T+1, U+1)`` float64
    and int8 (the kind of the best arc into each node, -1 where none), and ``(B,)`` the
    score of the best complete path (-inf without one, NaN for a NaN arc weight).
    ``analysis.alignment.backtrack_arcs`` follows the pointers."""
    with torch.no_grad():
        w, nan_row, kinds, ends = _kind_weights(logits, targets, logit_lengths, target_lengths,
                                                opts, boundary)
        B, K, T, U1 = w.shape
        alpha = np.full((B, T + 1, U1), -np.inf)
        best_kind = np.full((B, T + 1, U1), -1, dtype=np.int8)
        log_prob = np.empty(B)
        kernels.kind_viterbi(w, kinds, *ends, nan_row, alpha, best_kind, log_prob)
        return torch.from_numpy(alpha), torch.from_numpy(best_kind), torch.from_numpy(log_prob)


# --------------------------------------------------------------------------- arc weights
def lattice_of_weights(w: torch.Tensor, topo: Topology, ends: Ends):
    """``(log_like (B,), gamma (B, K, T, U+1))`` of precomputed arc weights ``w (B, K, T,
    U+1)`` (``reference.arc_weights``: -inf off the arcs), as ``reference.lattice_generic``
    computes them, on ``kernels.kind_lattice``: the simple/smoothed losses of
    ``rnnt_lattice.pruned``, whose arc log-probs come from a matmul, not from logits rows.
    A NaN weight anywhere makes its sequence NaN (math.md 8.1), as in the reference."""
    x = np.ascontiguousarray(_np(w.to(torch.float64)))
    kinds = kind_table(topo, 0)     # the lattice reads DT, DU and END only, never the class
    t0, u0, t1, u1 = (np.ascontiguousarray(_np(e.to(torch.int64)))
                      for e in (ends.t0, ends.u0, ends.t1, ends.u1))
    nan_row = np.isnan(x).any(axis=(1, 3)).astype(np.uint8)                  # (B, T)
    _, _, log_like, gamma = _kind_lattice(x, nan_row, kinds, (t0, u0, t1, u1))
    return torch.from_numpy(log_like), torch.from_numpy(gamma)


# --------------------------------------------------------------------------- window choice
def window_dp(mass: torch.Tensor, max_step: int):
    """``(total (B,), starts (B, T) int64)`` of the window DP over ``mass (B, T, S)``
    float64 (``kernels.window_dp``; ``analysis.coverage.best_window_starts`` prepares the
    mass and is the interface)."""
    x = np.ascontiguousarray(_np(mass.to(torch.float64)))
    B, T, S = x.shape
    if S < 1:
        return torch_backend.window_dp(mass, max_step)      # no start at all: nothing to run
    total = np.empty(B)
    starts = np.empty((B, T), dtype=np.int64)
    kernels.window_dp(x, int(max_step), total, starts, np.empty((B, T, S), dtype=np.int64))
    return torch.from_numpy(total), torch.from_numpy(starts)
