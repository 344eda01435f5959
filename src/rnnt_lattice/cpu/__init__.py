"""CPU backend: Numba kernels (``kernels.py``) behind the loss protocol of ``_ops``.

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

import os
import sys
import threading

import numpy as np
import torch

from .._types import Lattice, LossOptions
from . import _config, kernels

__all__ = ["loss_forward", "loss_backward", "compute_lattice", "viterbi", "empty_cache"]


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
    alpha = np.full((B, T, U1), -np.inf)
    beta = np.full((B, T, U1), -np.inf)
    log_like = np.empty(B)
    gamma_blank = np.zeros((B, T, U1))
    gamma_label = np.zeros((B, T, U1))
    kernels.lattice(lpb, lpl, tl, ul, alpha, beta, log_like, gamma_blank, gamma_label)
    return buf, shift, inv_sum, Lattice(*(torch.from_numpy(a) for a in
                                          (alpha, beta, log_like, gamma_blank, gamma_label)))


def _gradient(dst, src, from_logits, targets, logit_lengths, target_lengths, blank, fused,
              shift, inv_sum, lat: Lattice, fastemit_lambda, clamp, upstream: np.ndarray):
    # FastEmit (math.md section 6): label arcs get (1 + lambda) times their gradient.
    gamma_label = lat.gamma_label.numpy()
    if fastemit_lambda != 0.0:
        gamma_label = gamma_label * (1.0 + fastemit_lambda)
    B, T = dst.shape[:2]
    kernels.grad_rows(_np(src), _np(dst), from_logits, _np(targets), _np(logit_lengths),
                      _np(target_lengths), blank, fused, kernels.spread_stride(B * T), shift, inv_sum,
                      lat.gamma_blank.numpy(), gamma_label, upstream, float(clamp))
    return dst


# --------------------------------------------------------------------------- loss
INPLACE_WRITES_IN = "forward"     # in-place mode stores the exps in the logits right away


class _State:
    """What the backward pass needs besides saved tensors. ``buf`` (the forward's exp
    buffer, or the logits themselves in place) is handed over once."""

    def __init__(self, buf, shift, inv_sum, lat: Lattice, inplace: bool):
        self.buf, self.shift, self.inv_sum, self.lat, self.inplace = buf, shift, inv_sum, lat, inplace


def supports(opts: LossOptions, boundary=None, node_rows=None) -> bool:
    """The kernels compute the regular RNN-T lattice (math.md 1-6) without per-arc terms,
    on padded logits."""
    return opts.regular and boundary is None and node_rows is None


def loss_forward(logits, targets, logit_lengths, target_lengths, opts: LossOptions, need_grad,
                 boundary=None, node_rows=None):
    """Passes 1-2 (``_ops`` protocol): ``(costs, saved, state)``. With a gradient wanted in
    fused mode the exps are stored in a buffer (the logits themselves with
    ``opts.inplace_grad``: each row is read completely before its exps overwrite it)."""
    inplace = need_grad and opts.inplace_grad
    buf, shift, inv_sum, lat = _forward(logits, targets, logit_lengths, target_lengths,
                                        opts.blank, opts.fused, store=need_grad and opts.fused,
                                        into=logits if inplace else None)
    costs = (-lat.log_like).to(logits.dtype)
    if not need_grad:
        return costs, (), None
    # In-place mode keeps no logits (they are overwritten); its buffer is the logits.
    saved = (targets, logit_lengths, target_lengths) + (() if inplace else (logits,))
    return costs, saved, _State(logits if inplace else buf, shift, inv_sum, lat, inplace)


def loss_backward(saved, st: _State, upstream, opts: LossOptions):
    """Pass 3 (``_ops`` protocol): the gradient, upstream factor fused, into the forward's
    buffer (handed over: no reference stays here, so autograd adopts it without a copy);
    a second backward recomputes the exps from the saved logits with the same code."""
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
    up = upstream.detach().to(torch.float64).contiguous().numpy()
    _gradient(dst, dst if logits is None else logits, from_logits, targets, logit_lengths,
              target_lengths, opts.blank, opts.fused, st.shift, st.inv_sum, st.lat,
              opts.fastemit_lambda, opts.clamp, up)
    return dst


def compute_lattice(logits, targets, logit_lengths, target_lengths, blank, fused) -> Lattice:
    """The lattice (alpha, beta, occupations) without any gradient work."""
    with torch.no_grad():
        return _forward(logits.contiguous(), targets, logit_lengths, target_lengths, blank, fused,
                        store=False)[3]


def viterbi(logits, targets, logit_lengths, target_lengths, blank, fused):
    """Max-plus forward pass: ``(alpha_max, lpb, lpl)``, each ``(B, T, U+1)`` float64.

    The arc log-probs come from the same ``row_pass`` as the loss (no exps stored) and
    alpha from the same recursion in the max-plus semiring (``kernels.viterbi_alpha``);
    the backtracking is shared by every backend (``rnnt_lattice.analysis.alignment``).
    """
    with torch.no_grad():
        logits = logits.contiguous()
        _, _, lpb, lpl = _row_pass(logits, targets, logit_lengths, target_lengths, blank, fused)
        alpha = np.full(lpb.shape, -np.inf)
        kernels.viterbi_alpha(lpb, lpl, _np(logit_lengths), _np(target_lengths), alpha)
        return torch.from_numpy(alpha), torch.from_numpy(lpb), torch.from_numpy(lpl)
