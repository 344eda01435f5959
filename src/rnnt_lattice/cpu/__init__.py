"""CPU backend: Numba kernels behind the backend protocol (``_backends.Backend``).

The modules, by concept:

- ``kernels``: the generic passes (row pass, lattice, gradient rows; the max-plus
  ``viterbi``), driven by a table of arc kinds (``kernels.kind_table``). Every topology,
  per-arc term (sigma, delay penalty), k2 boundary and row layout (``node_rows``: packed
  or pruned logits rows) runs on them, and so do the lattice tools (``occupancy``,
  ``viterbi``).
- ``regular``: the regular fast path, its own row and gradient passes for the plain
  regular loss, with the generic lattice pass in between (``uses_regular_fast_path``).
- ``fastmath``: the exp, log, row max and row sums the kernels share.
- ``windows``: the window DP of the pruned losses' window choice.
- ``_config``: Numba settings, how the kernels are compiled and run on threads, the row order.

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
block of PyTorch's CUDA caching allocator. The O(B*T*(U+1)) arrays of a call (row
statistics, arc weights, alpha, beta, occupations: a few MB at training shapes, which
glibc hands back to the system when they are freed) come from one kept block as well
(``_Workspaces``: at most three, as a training loop alternates two), and so do
``do_rnnt_pruning``'s rows of lm (``rows_select``: tens of MB a step, which glibc maps
afresh every time). ``rnnt_lattice.empty_cache()`` releases them and
``RNNT_LATTICE_CACHE_GRAD=0`` turns the reuse off (``_config``).

Threads: the buffer is checked and claimed under a lock, so two threads are never handed
the same one; the kernels release the GIL. How the parallel kernels behave under threads
and in forked children is ``_config``'s business (docs/api.md, "Reliability").
"""
from __future__ import annotations

import math
import os
import sys
import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .. import torch_backend
from .._rules import with_bad_rows
from .._types import Lattice, LossOptions
from ..reference import Ends, terms_weights
from ..topology import Topology
from . import _config, kernels, regular, simple, windows

__all__ = ["loss_forward", "loss_backward", "tile_forward", "tile_lattice", "tile_backward",
           "occupancy", "viterbi", "lattice_of_terms", "window_dp", "k2_starts", "simple_rescue",
           "simple_rescue_backward", "simple_rows", "simple_rows_backward", "arc_terms",
           "arc_terms_backward", "rows_select", "rows_sum", "empty_cache"]

NAME = "numba"
NATIVE_LOW_PRECISION = False      # float16/bfloat16 logits are promoted to float32 first
NATIVE_INT32_IDS = True           # int32 ids and lengths are converted here, in NumPy (``_ids``)
ZEROES_INFINITE_COSTS = True      # loss_backward and tile_backward zero the upstream gradient
                                  # of the sequences whose cost is infinite (``_upstream``)
CHECKS_RECOMPUTED_TILES = False   # the fused losses compare a recomputed tile's row sums

# The simple losses' log-domain rescue of the few nodes beyond the float64 matmul's range
# (``pruned``): the PyTorch backend's host loop over those nodes serves the CPU.
simple_rescue = torch_backend.simple_rescue
simple_rescue_backward = torch_backend.simple_rescue_backward
# The backward of do_rnnt_pruning's rows of lm: index_add_ adds in order on the CPU.
rows_sum = torch_backend.rows_sum


def _np(x: torch.Tensor) -> np.ndarray:
    # detach() is a PyTorch operation of its own: only where numpy() needs it.
    return x.detach().numpy() if x.requires_grad else x.numpy()


def _ids(x: torch.Tensor) -> np.ndarray:
    """Ids or lengths as the kernels read them: a contiguous int64 array (a view when they
    are int64 already; int32 ones, torchaudio's convention, converted in NumPy)."""
    return np.ascontiguousarray(_np(x), dtype=np.int64)


# The logits' dtypes the kernels read (half types are promoted before), as NumPy's: small
# conversions are made in NumPy, a fraction of a PyTorch operation's cost on tiny arrays.
_NP_FLOATS = {torch.float32: np.float32, torch.float64: np.float64}


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
        n = math.prod(shape)
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


def _new_arrays(specs) -> list:
    """Uninitialised arrays ``[(shape, dtype), ...]``, each allocated anew."""
    return [np.empty(shape, dtype=dtype) for shape, dtype in specs]


class _Workspaces:
    """Blocks kept for the O(B*T*(U+1)) arrays of a loss call: the row statistics, arc
    weights, alpha, beta and occupations (``_row_specs``, ``_lattice_specs``): 60 bytes a
    node for the regular loss, about 200 for TDT's 9 arc kinds; and for
    ``do_rnnt_pruning``'s rows of lm (:func:`rows_select`).

    Allocated anew in every call, these arrays are fresh pages: glibc gives blocks beyond
    its mmap threshold back to the system when freed, and returns the top of its heap once
    more than twice that is free, so a call whose arrays total a few MB faults every 4 KiB
    page of them in again (docs/benchmarks.md, "Page faults"). So a call claims one block
    and carves all its arrays from it (:meth:`arrays`, 64-byte aligned); the block is free
    again once no array carved from it is alive, which a reference count tells, as for
    ``_BufferCache`` (views of views keep the block alive: NumPy's ``base`` is the block).

    In a training loop the previous step's graph holds its block until the loss is
    rebound, after the next forward: two blocks alternate. At most :data:`SLOTS` are kept
    (a free block that is too small is replaced); with all of them busy, or below
    :data:`MIN_BYTES` (allocations glibc serves from its heap), a call allocates as before.
    Claim and check happen under one lock, as in ``_BufferCache``."""

    MIN_BYTES = 256 << 10
    SLOTS = 3
    ALIGN = 64

    def __init__(self):
        self.blocks: list = []
        self.lock = threading.Lock()

    def arrays(self, specs) -> list:
        """Uninitialised C-contiguous arrays ``[(shape, dtype), ...]``, from one block."""
        offsets, total = [], 0
        for shape, dtype in specs:
            offsets.append(total)
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
            total += -(-nbytes // self.ALIGN) * self.ALIGN
        if not self.keeps(total):
            return _new_arrays(specs)
        with self.lock:
            block = self._claim(total + self.ALIGN)
            start = -block.ctypes.data % self.ALIGN
            # The views exist before the lock is released: the block is busy for others.
            return [np.ndarray(shape, dtype=dtype, buffer=block, offset=start + off)
                    for (shape, dtype), off in zip(specs, offsets)]

    def keeps(self, nbytes: int) -> bool:
        """Whether a claim of ``nbytes`` comes from the kept blocks (else it is allocated
        anew): the reuse on (``RNNT_LATTICE_CACHE_GRAD``) and at least :data:`MIN_BYTES`."""
        return _config.CACHE_GRAD and nbytes >= self.MIN_BYTES

    def _claim(self, nbytes: int) -> np.ndarray:
        """The smallest free block of at least ``nbytes`` (under the lock): a kept one, a
        new one in a free slot or in place of the smallest free block, else an untracked
        one."""
        blocks = self.blocks
        # getrefcount sees the list's reference and its own argument: 2 means nobody else.
        free = [i for i in range(len(blocks)) if sys.getrefcount(blocks[i]) == 2]
        fits = [i for i in free if blocks[i].size >= nbytes]
        if fits:
            return blocks[min(fits, key=lambda i: blocks[i].size)]
        block = np.empty(nbytes, dtype=np.uint8)
        if len(blocks) < self.SLOTS:
            blocks.append(block)
        elif free:
            blocks[min(free, key=lambda i: blocks[i].size)] = block
        return block

    def clear(self) -> None:
        with self.lock:
            self.blocks = []

    def _after_fork_in_child(self) -> None:
        self.lock = threading.Lock()    # another thread of the parent may have held it


_buffers = _BufferCache()
_workspaces = _Workspaces()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_buffers._after_fork_in_child)
    os.register_at_fork(after_in_child=_workspaces._after_fork_in_child)


def empty_cache() -> None:
    """Release the kept gradient buffer and workspaces (their memory returns once no
    tensor or array uses them)."""
    _buffers.clear()
    _workspaces.clear()


def rows_select(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, index)`` ``(N, D)`` (``torch_backend.rows_select``: the reference)
    written into a kept workspace block: ``do_rnnt_pruning``'s rows of lm, ``(B, T, R, Dl)``
    a step (64 MB at B=16, T=200, R=5, Dl=1000). PyTorch allocates such a tensor from glibc,
    which maps blocks beyond 32 MB afresh and unmaps them when freed, so a new one faults
    in every page in every step (docs/benchmarks.md, "Page faults"). The block is free
    again once the tensor and every view of it are gone (``_Workspaces``); carved as bytes,
    so every dtype takes it. Where no block is kept (the reuse off, or under
    ``_Workspaces.MIN_BYTES``), ``index_select`` itself."""
    n, D = index.shape[0], x.shape[1]
    nbytes = n * D * x.element_size()
    if not _workspaces.keeps(nbytes):
        return torch_backend.rows_select(x, index)
    (raw,) = _workspaces.arrays([((nbytes,), np.uint8)])
    out = torch.from_numpy(raw).view(x.dtype).view(n, D)
    return torch.index_select(x, 0, index, out=out)


def _empty_like(x: torch.Tensor) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor like ``x``, from the buffer cache."""
    return _buffers.empty(tuple(x.shape), _NP_FLOATS.get(x.dtype) or _np(x[:0]).dtype)


def _zeros_like(x: torch.Tensor) -> torch.Tensor:
    out = _empty_like(x)
    _np(out).fill(0)
    return out


# --------------------------------------------------------------------------- loss
INPLACE_WRITES_IN = "forward"     # in-place mode stores the exps in the logits right away


def uses_regular_fast_path(opts: LossOptions, boundary, node_rows) -> bool:
    """Whether a loss runs the regular fast path (``regular``: its own row and gradient
    passes, the generic lattice pass) instead of the generic kernels: the plain regular
    loss (``opts.regular``: no sigma, no delay penalty) on padded logits without a k2
    boundary. Both give the same numbers; the fast path skips the generic passes'
    bookkeeping over the kind table and measured faster on the standard loss
    (docs/benchmarks.md, "CPU kernels after the restructuring")."""
    return opts.regular and boundary is None and node_rows is None


def _ends(logit_lengths, target_lengths, boundary, T: int, U1: int):
    """``(t0, u0, t1, u1)`` (B,) int64 arrays: start and end node of each lattice
    (``reference.Ends``: k2's boundary rows ``[begin_symbol, begin_frame, end_symbol,
    end_frame]``, as ``_backends.prepare_call`` checked them)."""
    if boundary is None:
        tl, ul = _ids(logit_lengths), _ids(target_lengths)
        zero = np.zeros_like(tl)
        return zero, zero, tl, ul
    ends = Ends.of(logit_lengths, target_lengths, boundary)
    return tuple(_ids(x) for x in (ends.t0, ends.u0, ends.t1, ends.u1))


def _node_rows(node_rows, B: int, T: int, U1: int, out=None) -> np.ndarray:
    """(B, T, U+1) int64 row of each node: the given map, or the identity of the padded
    layout ``(B, T, U+1, V)`` viewed as ``(B*T*(U+1), V)`` (into ``out`` when given)."""
    if node_rows is None:
        if out is None:
            return np.arange(B * T * U1, dtype=np.int64).reshape(B, T, U1)
        out.reshape(-1)[:] = np.arange(B * T * U1, dtype=np.int64)
        return out
    return np.ascontiguousarray(_np(node_rows).astype(np.int64, copy=False))


@dataclass
class _State:
    """What the backward pass needs besides saved tensors. ``buf`` (the forward's exp
    buffer, or the logits themselves in place, shaped like the logits) is handed over
    once. ``node_rows`` is None on the regular fast path."""

    buf: Optional[torch.Tensor]
    inplace: bool
    shape: tuple
    stats: tuple                  # the row pass's statistics, as its gradient pass reads them
    gamma: np.ndarray             # (B, K, T, U+1) per-kind occupations
    log_like: np.ndarray          # (B,)
    ends: tuple                   # (t0, u0, t1, u1), each (B,) int64
    kinds: np.ndarray             # kernels.kind_table
    blank: int
    n_durations: int
    bounds: np.ndarray            # the row pass's ranges of frames, the gradient pass's too
    node_rows: Optional[np.ndarray] = None
    infinite: Optional[np.ndarray] = None   # (B,) bool: the cost is infinite in its dtype


def _upstream(upstream: torch.Tensor, infinite) -> np.ndarray:
    """The upstream gradient (B,) as a float64 array, 0 for the sequences whose cost is
    infinite in the costs' dtype (math.md 8.1: also where the float64 lattice was finite
    and only the cast overflowed); the gradient pass then writes exact zeros there."""
    up = np.ascontiguousarray(_np(upstream), dtype=np.float64)
    return (np.where(infinite, 0.0, up) if infinite is not None and np.count_nonzero(infinite)
            else up)


def _frame_ranges(ends, node_rows, f0: int, f1: int, shape=None) -> np.ndarray:
    """The ranges of frames ``f0 <= t < f1`` that the row kernels run, one a thread
    (``_config.frame_ranges``, ``row_parts``): ``ends`` the lattices' ``(t0s, u0s, t1s,
    u1s)``, ``node_rows`` (B, T, U+1), or None where every node has a row (the regular
    kernels' padded logits, ``shape`` their ``(T, U+1)``)."""
    if node_rows is None:
        T, U1 = shape
        node_rows = _EVERY_NODE
    else:
        _, T, U1 = node_rows.shape
    return _config.frame_ranges(_config.row_parts(), *ends, node_rows, T, U1, f0, f1)


_EVERY_NODE = np.empty((0, 0, 0), dtype=np.int64)    # frame_ranges' node_rows: a row a node


def _lattice_specs(B: int, K: int, T: int, U1: int) -> list:
    """``(shape, dtype)`` of the arrays pass 2 writes besides log P: alpha, beta, gamma."""
    return [((B, T + 1, U1), np.float64)] * 2 + [((B, K, T, U1), np.float64)]


def _lattice(w, nan_row, kinds, ends, out=None):
    """Pass 2 (``kernels.lattice``): ``(alpha, beta, log_like, gamma)``; alpha, beta and
    gamma are ``out`` (``_lattice_specs``, uninitialised) when given, else new arrays."""
    B, K, T, U1 = w.shape
    alpha, beta, gamma = out if out is not None else _new_arrays(_lattice_specs(B, K, T, U1))
    alpha.fill(-np.inf)
    beta.fill(-np.inf)
    gamma.fill(0.0)
    log_like = np.empty(B)
    kernels.lattice(B, w, nan_row, *ends, kinds, alpha, beta, log_like, gamma)
    return alpha, beta, log_like, gamma


def _row_specs(B: int, T: int, U1: int, kinds, dtype, store: bool) -> list:
    """``(shape, dtype)`` of the arrays pass 1 writes (``_row_outputs``)."""
    K = kinds.shape[1]
    n_reads = len(set(kinds[kernels.CLASS_ID].tolist())) + 1 if store else 0
    return ([((B, T, U1), dtype), ((B, T, U1), np.float64)] * 2
            + [((B, T, U1, n_reads) if n_reads else (0, 0, 0, 0), dtype),
               ((B, K, T, U1), np.float64), ((B, T), np.uint8)])


def _row_outputs(arrays):
    """The arrays pass 1 writes (``arrays``: those of ``_row_specs``, uninitialised) as
    ``kernels.row_pass`` takes them: ``((shift, inv_sum, shift_d, inv_sum_d, e_read), w,
    nan_row)``; ``e_read`` is empty unless ``store``. The stored exp of each class a node
    reads (one column per distinct class of the kinds, + the blank of plus_next_blank
    arcs): the gradient pass needs them before it overwrites the row, and reading them
    from the row costs it a memory latency per node."""
    *stats, w, nan_row = arrays
    return tuple(stats), w, nan_row


def _row_pass(rows, targets, ends, node_rows, kinds, blank, n_durations, opts: LossOptions, buf,
              out=None, frames=None, bounds=None):
    """Pass 1 (``kernels.row_pass``) on logits rows ``(N, V)``: ``(stats, w, nan_row)``
    with the arc weights ``w (B, K, T, U+1)``; the exps go into ``buf`` (N, V) unless None
    (it may be ``rows`` itself: in-place mode). ``out``: the arrays to write
    (``_row_outputs``), else new ones. ``frames``: ``(f0, f1)``, only the frames ``f0 <= t
    < f1`` of each sequence are run and written (a fused tile's), else every frame.
    ``bounds``: their ranges (``_frame_ranges``), computed here unless given."""
    B, T, U1 = node_rows.shape
    f0, f1 = (0, T) if frames is None else frames
    x = _np(rows)
    stats, w, nan_row = out if out is not None else _row_outputs(
        _new_arrays(_row_specs(B, T, U1, kinds, x.dtype, buf is not None)))
    if bounds is None:
        bounds = _frame_ranges(ends, node_rows, f0, f1)
    kernels.row_pass(len(bounds) - 1, x, node_rows, _ids(targets), *ends,
                     kinds, blank, n_durations,
                     float(opts.sigma), float(opts.delay_penalty),
                     opts.log_softmax, buf is not None,
                     bounds, f0, f1,
                     np.empty((0, 0), dtype=x.dtype) if buf is None else _np(buf),
                     *stats, w, nan_row)
    return stats, w, nan_row


def _regular_row_specs(B: int, T: int, U1: int, dtype) -> list:
    """``(shape, dtype)`` of the arrays the regular row pass writes: shift, inv_sum, w,
    nan_row."""
    return [((B, T, U1), dtype), ((B, T, U1), np.float64), ((B, 2, T, U1), np.float64),
            ((B, T), np.uint8)]


def _regular_row_pass(logits, targets, logit_lengths, target_lengths, blank, opts: LossOptions,
                      buf, arrays, bounds):
    """Pass 1 of the regular fast path (``regular.regular_row_pass``) on padded logits:
    ``(stats, w, nan_row)`` as :func:`_row_pass` returns them, the stats ``(shift,
    inv_sum)``, written into ``arrays`` (``_regular_row_specs``); the exps go into ``buf``
    unless None (it may be ``logits`` itself)."""
    x = _np(logits)
    shift, inv_sum, w, nan_row = arrays
    regular.regular_row_pass(len(bounds) - 1, x, _ids(targets), _ids(logit_lengths),
                             _ids(target_lengths),
                             blank,
                             opts.log_softmax, buf is not None,
                             bounds,
                             np.empty((0, 0, 0, 0), dtype=x.dtype) if buf is None else _np(buf),
                             shift, inv_sum, w, nan_row)
    return (shift, inv_sum), w, nan_row


def loss_forward(logits, targets, logit_lengths, target_lengths, opts: LossOptions, need_grad,
                 boundary=None, node_rows=None, nan_rows=None):
    """Passes 1-2 (``_ops`` protocol): ``(costs, saved, state)``, for any topology.

    ``logits``: ``(B, T, U+1, V)``, or rows ``(N, V)`` with ``node_rows (B, T, U+1)`` int64
    (node (b, t, u) reads row ``node_rows[b, t, u]``, -1: none; every row is read by one
    node). With a gradient wanted on raw scores (log_softmax) the exps are stored in a buffer like the
    logits (the logits themselves with ``opts.inplace_grad``: each row is read completely
    before its exps overwrite it)."""
    inplace = need_grad and opts.inplace_grad
    store = need_grad and opts.log_softmax
    shape = tuple(logits.shape)
    V = shape[-1]
    buf = (logits if inplace else _empty_like(logits)) if store else None
    topo = opts.topology
    blank = opts.blank                            # checked by _backends.prepare_call
    B, T, U1 = shape[:3] if node_rows is None else tuple(node_rows.shape)
    ends = _ends(logit_lengths, target_lengths, boundary, T, U1)
    kinds = kernels.kind_table(topo, blank)
    # Every O(B*T*(U+1)) array of the call from one workspace block (``_Workspaces``).
    dtype = _NP_FLOATS[logits.dtype]
    fast = uses_regular_fast_path(opts, boundary, node_rows)
    row_specs = (_regular_row_specs(B, T, U1, dtype) if fast
                 else _row_specs(B, T, U1, kinds, dtype, buf is not None))
    node_specs = [((B, T, U1), np.int64)] if node_rows is None and not fast else []
    arrays = _workspaces.arrays(row_specs + _lattice_specs(B, kinds.shape[1], T, U1)
                                + node_specs)
    n_row = len(row_specs)
    # The ranges of frames the row kernels run, one a thread: the gradient pass reads the
    # same ones (any split gives the same bits).
    if fast:
        nodes = None
        bounds = _frame_ranges(ends, None, 0, T, (T, U1))
        stats, w, nan_row = _regular_row_pass(logits, targets, logit_lengths, target_lengths,
                                              blank, opts, buf, arrays[:n_row], bounds)
    else:
        nodes = _node_rows(node_rows, B, T, U1, *arrays[n_row + 3:])
        bounds = _frame_ranges(ends, nodes, 0, T)
        stats, w, nan_row = _row_pass(logits.view(-1, V), targets, ends, nodes, kinds, blank,
                                      topo.n_durations, opts,
                                      None if buf is None else buf.view(-1, V),
                                      out=_row_outputs(arrays[:n_row]), bounds=bounds)
    _, _, log_like, gamma = _lattice(w, nan_row, kinds, ends, arrays[n_row:n_row + 3])
    cost_values = (-log_like).astype(dtype)
    costs = with_bad_rows(torch.from_numpy(cost_values), nan_rows)
    if not need_grad:
        return costs, (), None
    # In-place mode keeps no logits (they are overwritten); its buffer is the logits.
    saved = (targets, logit_lengths, target_lengths) + (() if inplace else (logits,))
    state = _State(logits if inplace else buf, inplace, shape, stats, gamma, log_like, ends,
                   kinds, blank, topo.n_durations, bounds, nodes, np.isinf(cost_values))
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
    if st.inplace and not opts.log_softmax:
        dst, from_logits = st.buf, False
        _np(dst).fill(0)
        st.buf = None
    elif not opts.log_softmax:
        dst, from_logits = _zeros_like(logits), False
    elif st.buf is not None:
        dst, from_logits = st.buf, False
        st.buf = None
    else:
        dst, from_logits = _empty_like(logits), True
    src = dst if logits is None else logits
    up = _upstream(upstream, st.infinite)
    fastemit_scale = 1.0 + float(opts.fastemit_lambda)   # FastEmit (math.md section 6)
    if st.node_rows is None:                  # the regular fast path
        shift, inv_sum = st.stats
        regular.regular_grad_rows(len(st.bounds) - 1, _np(src), _np(dst), _ids(targets),
                                  _ids(logit_lengths), _ids(target_lengths),
                                  st.blank,
                                  shift, inv_sum, st.gamma,
                                  fastemit_scale, float(opts.clamp), up,
                                  opts.log_softmax, from_logits,
                                  st.bounds)
        return dst
    V = st.shape[-1]
    T = st.gamma.shape[2]
    kernels.grad_rows(len(st.bounds) - 1, _np(src).reshape(-1, V), _np(dst).reshape(-1, V),
                      st.node_rows, _ids(targets), *st.ends,
                      st.kinds, st.blank, st.n_durations,
                      *st.stats, st.gamma, st.log_like,
                      fastemit_scale, float(opts.clamp), up,
                      opts.log_softmax, from_logits,
                      st.bounds, 0, T)
    return dst


# --------------------------------------------------------------------------- tiles
@dataclass
class _Tiles:
    """The fused joiner and loss's state (``tile_forward`` ... ``tile_backward``): the row
    pass's results of every node, gathered tile by tile into ``acc`` (``_row_outputs``),
    the pass's own outputs of the current tile in ``scratch`` (it writes every node:
    those of the other tiles as rowless), then the lattice's ``gamma`` and ``log_like``."""

    acc: tuple                    # (stats, w, nan_row) of every node
    scratch: Optional[tuple]      # the same arrays, written by each tile's row pass
    targets: torch.Tensor         # (B, U) int64
    ends: tuple                   # (t0, u0, t1, u1), each (B,) int64
    kinds: np.ndarray             # kernels.kind_table
    blank: int
    n_durations: int
    dtype: torch.dtype            # of the rows: the costs' dtype
    lattice_out: Optional[tuple] = None   # alpha, beta, gamma for tile_lattice to write
    gamma: Optional[np.ndarray] = None    # (B, K, T, U+1), after tile_lattice
    log_like: Optional[np.ndarray] = None  # (B,)
    infinite: Optional[np.ndarray] = None  # (B,) bool: the cost is infinite in its dtype


def tile_forward(rows, tile, targets, logit_lengths, target_lengths, opts: LossOptions,
                 boundary, state):
    """Pass 1 on one tile's rows ``(n, V)`` (``tile.node_rows``: the box's nodes read rows
    0..n-1, every other node none), its exps stored over ``rows`` with log_softmax (the
    caller discards the tile: this is the in-place mode, no buffer), its statistics, arc
    weights and stored exps of the read classes copied into the whole lattice's arrays.
    The pass runs the tile's frames only: the copy reads nothing of the others."""
    B, T, U1 = tile.node_rows.shape
    if state is None:
        topo = opts.topology
        blank = opts.blank
        kinds = kernels.kind_table(topo, blank)
        dtype = _np(rows[:0]).dtype
        # From workspace blocks (``_Workspaces``): acc and the lattice's arrays from one,
        # held until the backward ends; the scratch from another, free after the forward.
        specs = _row_specs(B, T, U1, kinds, dtype, opts.log_softmax)
        n = len(specs)
        arrays = _workspaces.arrays(specs + _lattice_specs(B, kinds.shape[1], T, U1))
        acc = _row_outputs(arrays[:n])
        acc[2].fill(0)                            # nan_row: or-ed over label tiles
        state = _Tiles(acc, _row_outputs(_workspaces.arrays(specs)),
                       targets.to(torch.int64).contiguous(),
                       _ends(logit_lengths, target_lengths, boundary, T, U1), kinds, blank,
                       topo.n_durations, rows.dtype, tuple(arrays[n:]))
    stats, w, nan_row = _row_pass(rows, state.targets, state.ends, _np(tile.node_rows),
                                  state.kinds, state.blank, state.n_durations, opts,
                                  rows if opts.log_softmax else None, out=state.scratch,
                                  frames=(tile.t0, tile.t1))
    t, u = tile.box
    acc_stats, acc_w, acc_nan = state.acc
    for a, x in zip(acc_stats, stats):
        a[:, t, u] = x[:, t, u]                   # (e_read is empty in log-prob mode)
    acc_w[:, :, t, u] = w[:, :, t, u]
    acc_nan[:, t] |= nan_row[:, t]
    return state


def tile_lattice(state: _Tiles, opts: LossOptions, need_grad: bool):
    """Pass 2 once over every node (``kernels.lattice``): costs ``-log P`` (B,) in the
    rows' dtype."""
    state.scratch = None
    _, w, nan_row = state.acc
    _, _, log_like, gamma = _lattice(w, nan_row, state.kinds, state.ends, state.lattice_out)
    state.lattice_out = None
    costs = torch.from_numpy(-log_like).to(state.dtype)
    if need_grad:
        state.gamma, state.log_like = gamma, log_like
        state.infinite = torch.isinf(costs).numpy()
    return costs


def tile_backward(rows, tile, state: _Tiles, upstream, opts: LossOptions, out):
    """Pass 3 on one tile (``kernels.grad_rows`` with the tile's ``node_rows``, over its
    frames): ``out (n, V) = upstream[b] * d cost_b / d rows``, the exps recomputed from
    ``rows`` with the forward's shifts (``out`` may be ``rows``)."""
    V = rows.shape[-1]
    if not opts.log_softmax:
        _np(out).fill(0)                          # log-prob mode writes the read entries only
    node_rows = _np(tile.node_rows)
    bounds = _frame_ranges(state.ends, node_rows, tile.t0, tile.t1)
    kernels.grad_rows(len(bounds) - 1, _np(rows).reshape(-1, V), _np(out).reshape(-1, V),
                      node_rows, _np(state.targets), *state.ends,
                      state.kinds, state.blank, state.n_durations,
                      *state.acc[0], state.gamma, state.log_like,
                      1.0 + float(opts.fastemit_lambda), float(opts.clamp),
                      _upstream(upstream, state.infinite),
                      opts.log_softmax, opts.log_softmax,
                      bounds, tile.t0, tile.t1)
    return out


# --------------------------------------------------------------------------- lattice tools
def _weights(logits, targets, logit_lengths, target_lengths, opts: LossOptions, boundary):
    """Pass 1 of the lattice tools (no gradient work, no exps stored) for any topology:
    ``(w, nan_row, kinds, ends)``."""
    logits = logits.contiguous()
    B, T, U1, V = logits.shape
    topo = opts.topology
    blank = opts.blank                            # checked by _backends.prepare_call
    ends = _ends(logit_lengths, target_lengths, boundary, T, U1)
    kinds = kernels.kind_table(topo, blank)
    _, w, nan_row = _row_pass(logits.view(-1, V), targets, ends, _node_rows(None, B, T, U1),
                              kinds, blank, topo.n_durations, opts, None)
    return w, nan_row, kinds, ends


def occupancy(logits, targets, logit_lengths, target_lengths, opts: LossOptions,
              boundary=None) -> Lattice:
    """The lattice of any topology (``opts``: topology, blank, log_softmax, sigma, delay
    penalty; k2 ``boundary``) without gradient work: the loss's passes 1-2
    (``kernels.row_pass``, ``kernels.lattice``). A :class:`rnnt_lattice._types.Lattice`
    as ``reference.lattice`` returns it: alpha, beta ``(B, T+1, U+1)`` (-inf off
    each sequence's nodes), log P ``(B,)``, per-kind occupations ``gamma (B, K, T, U+1)``
    (0 off the arcs)."""
    with torch.no_grad():
        w, nan_row, kinds, ends = _weights(logits, targets, logit_lengths, target_lengths,
                                           opts, boundary)
        return Lattice(*(torch.from_numpy(a) for a in _lattice(w, nan_row, kinds, ends)))


def viterbi(logits, targets, logit_lengths, target_lengths, opts: LossOptions, boundary=None):
    """Max-plus sweep of any topology (``kernels.viterbi``): ``(alpha_max, best_kind,
    log_prob)`` as ``reference.sweep_alpha(max_plus=True)`` returns them: ``(B, T+1,
    U+1)`` float64 and int8 (the kind of the best arc into each node, -1 where none), and ``(B,)`` the
    score of the best complete path (-inf without one, NaN for a NaN arc weight).
    ``analysis.alignment.backtrack_arcs`` follows the pointers."""
    with torch.no_grad():
        w, nan_row, kinds, ends = _weights(logits, targets, logit_lengths, target_lengths,
                                           opts, boundary)
        B, K, T, U1 = w.shape
        alpha = np.full((B, T + 1, U1), -np.inf)
        best_kind = np.full((B, T + 1, U1), -1, dtype=np.int8)
        log_prob = np.empty(B)
        kernels.viterbi(B, w, nan_row, *ends, kinds, alpha, best_kind, log_prob)
        return torch.from_numpy(alpha), torch.from_numpy(best_kind), torch.from_numpy(log_prob)


# --------------------------------------------------------------------------- arc weights
def lattice_of_terms(b: torch.Tensor, e: torch.Tensor, topo: Topology, ends: Ends,
                     delay_penalty: float = 0.0):
    """``(log_like (B,), gamma (B, K, T, U+1))`` of k2's lattice whose arcs read the blank
    and label log-weights ``b, e (B, T, U+1)`` float64, as ``reference.lattice`` computes
    them on ``reference.terms_weights`` (-inf off the arcs), on ``kernels.lattice``: the
    simple/smoothed losses of ``rnnt_lattice.pruned`` and ``lattice_loss``, whose arc
    log-probs come from a matmul or the caller, not from logits rows. A NaN weight anywhere
    makes its sequence NaN (math.md 8.1), as in the reference."""
    w = terms_weights(b, e, topo, ends, delay_penalty)
    x = np.ascontiguousarray(_np(w.to(torch.float64)))
    kinds = kernels.kind_table(topo, 0)   # the lattice reads DT, DU, MAY_END, never the class
    t0, u0, t1, u1 = (_ids(x) for x in (ends.t0, ends.u0, ends.t1, ends.u1))
    nan_row = np.isnan(x).any(axis=(1, 3)).astype(np.uint8)                  # (B, T)
    _, _, log_like, gamma = _lattice(x, nan_row, kinds, (t0, u0, t1, u1))
    return torch.from_numpy(log_like), torch.from_numpy(gamma)


# --------------------------------------------------------------------------- window choice
# k2's rule (prune_ranges(method="k2")): a few vectorised PyTorch operations over the
# occupations, as fast as a loop of Numba's on the CPU.
k2_starts = torch_backend.k2_starts


def simple_rows(x: torch.Tensor, keep: torch.Tensor, idx: torch.Tensor):
    """The simple losses' rows ``(ok, shift, bad, ex, cols)`` (``torch_backend.simple_rows``:
    the reference and the definitions) in one Numba kernel, ``simple.simple_rows_forward``,
    a row per prange iteration."""
    B, N, V = x.shape
    J = idx.shape[2]
    if x.dtype not in (torch.float32, torch.float64) or not (B * N and V):
        return torch_backend.simple_rows(x, keep, idx)
    ok = np.empty((B, N), dtype=np.bool_)
    bad = np.empty((B, N), dtype=np.bool_)
    shift = np.empty((B, N))
    ex = np.empty((B, N, V))
    xa = np.ascontiguousarray(_np(x))
    cols = np.empty((B, N, J))                       # float64 (torch_backend.simple_rows)
    simple.simple_rows_forward(B * N, xa, np.ascontiguousarray(_np(keep)),
                               np.ascontiguousarray(_np(idx)), ok, shift, bad, ex, cols)
    return (torch.from_numpy(ok), torch.from_numpy(shift), torch.from_numpy(bad),
            torch.from_numpy(ex), torch.from_numpy(cols))


def simple_rows_backward(grad, ex, ok, g_uni, uni, idx, g_cols) -> None:
    """The backward of :func:`simple_rows` in place on ``grad (B, N, V)`` float64
    (``torch_backend.simple_rows_backward``: the reference), ``simple.simple_rows_backward``."""
    B, N, V = grad.shape
    if ex.dtype != torch.float64 or not grad.is_contiguous() or not (B * N and V):
        return torch_backend.simple_rows_backward(grad, ex, ok, g_uni, uni, idx, g_cols)
    none1, none2 = np.empty(0), np.empty((0, 0))
    has_uni, has_cols = g_uni is not None, g_cols is not None
    gu = np.ascontiguousarray(_np(g_uni), dtype=np.float64) if has_uni else none2
    un = np.ascontiguousarray(_np(uni), dtype=np.float64) if has_uni else none1
    gc = (np.ascontiguousarray(_np(g_cols), dtype=np.float64) if has_cols
          else np.empty((0, 0, 0)))
    simple.simple_rows_backward(B * N, _np(grad), np.ascontiguousarray(_np(ex)),
                                np.ascontiguousarray(_np(ok)), has_uni, gu, un,
                                np.ascontiguousarray(_np(idx)), has_cols, gc)


def _scales(mix) -> tuple:
    """``(on, c, s_am, s_lm)`` of the smoothing for the kernels (``c = 1``, no ``s`` off)."""
    return (False, 1.0, 0.0, 0.0) if mix is None else (True, mix.c, mix.s_am, mix.s_lm)


def arc_terms(parts, mix):
    """The simple losses' arc log-probs ``(b', e', (mass, code))`` (``torch_backend.arc_terms``:
    the reference) in one Numba kernel, ``simple.arc_terms_forward``; ``code (B, T, U+1)``
    int8, the flags its backward reads."""
    mass = parts.mass
    if mass.dtype != torch.float64 or not mass.numel():
        return torch_backend.arc_terms(parts, mix)
    B, T, U1 = mass.shape
    a = [np.ascontiguousarray(_np(x)) for x in (
        mass, parts.lse_rescued.to(torch.float64), parts.rescued, parts.am_cols, parts.lm_cols,
        parts.am_shift, parts.lm_shift, parts.am_bad, parts.lm_bad)]
    none = np.empty((0, 0))
    terms = [none] * 4 if mix is None else [np.ascontiguousarray(_np(x)) for x in (
        parts.P, parts.Q, parts.R, parts.S)]
    b, e = np.empty((B, T, U1)), np.empty((B, T, U1))
    code = np.empty((B, T, U1), dtype=np.int8)
    simple.arc_terms_forward(B, *a, *terms, *_scales(mix), b, e, code)
    return torch.from_numpy(b), torch.from_numpy(e), (mass, torch.from_numpy(code))


def arc_terms_backward(saved: tuple, g_b, g_e, mix, dtypes: tuple):
    """The backward of :func:`arc_terms` (``torch_backend.arc_terms_backward``: the
    reference), ``simple.arc_terms_backward``: one sequence per thread, its sums over t
    in the thread."""
    if saved[1].dtype == torch.bool:                 # the reference's forward ran
        return torch_backend.arc_terms_backward(saved, g_b, g_e, mix, dtypes)
    mass, code = saved
    B, T, U1 = mass.shape
    g = [np.zeros((B, T, U1)) if x is None else
         np.ascontiguousarray(_np(x), dtype=np.float64) for x in (g_b, g_e)]
    g_mass, g_resc = np.empty((B, T, U1)), np.empty((B, T, U1))
    g_am = torch.empty((B, T, U1), dtype=dtypes[0])
    g_lm = torch.empty((B, U1, 2), dtype=dtypes[1])
    dP, dR, dQ, dS = np.empty((B, T)), np.empty((B, T)), np.empty((B, U1)), np.empty((B, U1 - 1))
    simple.arc_terms_backward(B, _np(code), np.ascontiguousarray(_np(mass)), *g, *_scales(mix),
                              g_mass, g_resc, g_am.numpy(), g_lm.numpy(), dP, dR, dQ, dS)
    mix_grads = () if mix is None else tuple(torch.from_numpy(x) for x in (dP, dQ, dR, dS))
    return torch.from_numpy(g_mass), torch.from_numpy(g_resc), g_am, g_lm, mix_grads


def window_dp(mass: torch.Tensor, max_step: int):
    """``(total (B,), starts (B, T) int64)`` of the window DP over ``mass (B, T, S)``
    float64 (``windows.window_dp``; ``pruned.windows.best_window_starts`` prepares the
    mass and is the interface)."""
    x = np.ascontiguousarray(_np(mass.to(torch.float64)))
    B, T, S = x.shape
    if S < 1:
        return torch_backend.window_dp(mass, max_step)      # no start at all: nothing to run
    total = np.empty(B)
    starts = np.empty((B, T), dtype=np.int64)
    windows.window_dp(B, x, int(max_step), total, starts, np.empty((B, T, S), dtype=np.int64))
    return torch.from_numpy(total), torch.from_numpy(starts)
