"""GPU backend: Triton kernels (``kernels.py``) behind the loss protocol of ``_ops``.

Importing this module imports Triton (that is how ``_backends`` detects it). It runs on
CUDA tensors, and on CPU tensors through the Triton interpreter, which is how the tests
run it: ``TRITON_INTERPRET=1`` must be set before this module is first imported (Triton
reads it when the kernels are decorated).

No host synchronisation, CUDA-graph capturable: nothing here reads a tensor value on the
host (no ``.item()``, ``.tolist()``, ``bool(tensor)``, no host-side max of the lengths),
creates a tensor from Python values, or writes a Python number into a device tensor. Grid
sizes come from tensor shapes only, options are plain kernel arguments, and the upstream
gradient is read through its stride (the gradient of a mean is an expanded scalar: no copy).
The value checks of ``_validate`` (lengths in range, target ids) run for CPU inputs only;
on CUDA, out-of-range lengths or targets are undefined behaviour.

Launches and allocations of ``rnnt_loss`` forward+backward: the row pass, the lattice
(alpha and beta in parallel programs; the alpha programs also write the costs), the
gradient pass — three kernels — and three allocations: one float64 workspace for the
lattice state, the costs, and the gradient (none with ``inplace_grad=True``).

Memory: the forward pass keeps ``6 x B*T*(U+1)`` float64 values (lse, b, e, alpha, beta,
and log P) besides the logits; the backward pass writes the gradient in one pass over the
logits, with the upstream gradient, clamp and FastEmit fused.

Precision: the lattice is float64 for every input dtype (``kernels``); float16, bfloat16
and float32 logits are read in their own dtype and the passes over V compute in float32
(float64 for float64 logits); the gradient is written in the dtype of the logits, the costs
are float32 (float64 for float64 logits).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from .._types import Lattice, LossOptions
from . import kernels

__all__ = ["loss_forward", "loss_backward", "compute_lattice", "viterbi"]

# The kernels read float16/bfloat16 logits and int32 ids/lengths directly: the public layer
# need not convert them (each conversion would be a launch of its own).
NATIVE_LOW_PRECISION = True
NATIVE_INT32_IDS = True

# Decorated as interpreted functions iff TRITON_INTERPRET=1 was set at import.
INTERPRETED = not isinstance(kernels._row_kernel, triton.runtime.JITFunction)

# Tile sizes (powers of two). Tests lower them to exercise several blocks on tiny lattices.
BLOCK_U = 256      # lanes of the alpha/beta wavefront (label positions per block)
BLOCK_V = 1024     # chunk of the vocabulary per step of the row and gradient passes
ROW_TILE = 4096    # logits per program and step of the V passes: ROWS = ROW_TILE // BLOCK_V
               # nodes per program, so a small V still gives each program enough bytes
BLOCK_NODES = 512  # lattice nodes per program of the occupation kernel
NUM_WARPS_LATTICE = 4

LATTICE_DTYPE = torch.float64


def _pow2(n: int, cap: int) -> int:
    return max(1, min(cap, triton.next_power_of_2(max(int(n), 1))))


def _acc(dtype: torch.dtype):
    """Triton compute dtype of the passes over V for logits of ``dtype``."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def _tiles(V: int, elem_bytes: int):
    """``(ROWS, BLOCK_V, num_warps)`` of the V passes: a chunk of up to ``BLOCK_V``
    classes, and as many rows per program as fit ``ROW_TILE`` elements."""
    block_v = _pow2(V, BLOCK_V)
    rows = max(1, ROW_TILE // block_v)
    tile = rows * block_v
    num_warps = 8 if tile * elem_bytes >= 16384 else 4
    return rows, block_v, num_warps


def _f64_parts(x: float) -> tuple[float, float, float]:
    """``x`` as three float32 values whose float64 sum is ``x`` (``kernels._f64``)."""
    hi = float(np.float32(x))
    mid = float(np.float32(x - hi))
    lo = float(np.float32(x - hi - mid))
    return hi, mid, lo


def check_device(logits: torch.Tensor) -> None:
    """ValueError unless the kernels can run on ``logits``' device."""
    dev = logits.device
    if dev.type == "cpu" and not INTERPRETED:
        raise ValueError(
            "backend='triton' got logits on cpu: the Triton kernels run on CUDA tensors, or on "
            "CPU tensors only under the Triton interpreter (set TRITON_INTERPRET=1 before "
            "rnnt_lattice's Triton backend is first imported). Use backend='numba' on CPU.")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"backend='triton' runs on CUDA tensors, got logits on {dev}")


def _device(x: torch.Tensor):
    """Launch on ``x``'s GPU: Triton launches on the *current* CUDA device, which need not
    be the one holding the tensors (no synchronisation involved)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


# --------------------------------------------------------------------------- state
@dataclass
class _State:
    """The float64 lattice state of a batch: views of one workspace allocation."""
    lse: torch.Tensor        # (B, T, U+1)
    lpb: torch.Tensor        # (B, T, U+1)
    lpl: torch.Tensor        # (B, T, U+1)
    alpha: torch.Tensor      # (B, T, U+1), unwritten off the lattice unless filled
    beta: torch.Tensor       # (B, T, U+1), idem
    log_like: torch.Tensor   # (B,)
    workspace: torch.Tensor  # the allocation behind all of them

    @classmethod
    def new(cls, B: int, T: int, U1: int, device, fill_padding: bool = False) -> "_State":
        ws = torch.empty(5 * B * T * U1 + B, dtype=LATTICE_DTYPE, device=device)
        if fill_padding:
            ws.fill_(float("-inf"))              # alpha/beta of padding, for users to see
        return cls.of(ws, B, T, U1)

    @classmethod
    def of(cls, ws: torch.Tensor, B: int, T: int, U1: int) -> "_State":
        n = 5 * B * T * U1                       # few Python-level ops: this is host time
        return cls(*ws[:n].view(5, B, T, U1).unbind(0), ws[n:], ws)


# --------------------------------------------------------------------------- passes
def _forward(logits, targets, logit_lengths, target_lengths, blank: int, fused: bool, *,
             beta: bool, max_semiring: bool = False, fill_padding: bool = False):
    """Passes 1-2: ``(state, costs)``; costs ``(B,)`` = -log P in the costs' dtype."""
    B, T, U1, V = logits.shape
    st = _State.new(B, T, U1, logits.device, fill_padding)
    costs = torch.empty((B,), dtype=_costs_dtype(logits.dtype), device=logits.device)
    n_nodes = B * T * U1
    with _device(logits):
        if n_nodes:
            rows, block_v, num_warps = _tiles(V, logits.element_size())
            kernels._row_kernel[(triton.cdiv(n_nodes, rows),)](
                logits, _nonempty(targets, logit_lengths), logit_lengths, target_lengths,
                st.lse, st.lpb, st.lpl,
                n_nodes, T, U1, V, blank,
                FUSED=fused, ACC=_acc(logits.dtype), ROWS=rows, BLOCK_V=block_v,
                num_warps=num_warps)
        if B:
            # T = 0: the kernel writes log P = -inf and cost +inf without touching a node.
            kernels._lattice_kernel[(B, 2 if beta else 1)](
                st.lpb, st.lpl, logit_lengths, target_lengths,
                st.alpha, st.beta, st.log_like, costs, T, U1,
                MAX_SEMIRING=max_semiring, BLOCK_U=_pow2(U1, BLOCK_U),
                # num_stages=1: no software pipelining, so no load is issued ahead of the
                # barrier that makes the previous diagonal visible.
                num_warps=NUM_WARPS_LATTICE, num_stages=1)
    return st, costs


def _gradient(dst, logits, targets, logit_lengths, target_lengths, st: _State,
              opts: LossOptions, upstream: torch.Tensor):
    """Pass 3: ``dst = upstream[b] * clip(d loss_b / d logits)``; ``dst`` may be ``logits``.
    ``upstream`` is any ``(B,)`` tensor (strides included)."""
    B, T, U1, V = logits.shape
    n_nodes = B * T * U1
    if n_nodes == 0:
        return dst
    rows, block_v, num_warps = _tiles(V, logits.element_size())
    with _device(logits):
        kernels._grad_kernel[(triton.cdiv(n_nodes, rows),)](
            logits, dst, _nonempty(targets, logit_lengths), logit_lengths, target_lengths,
            st.lse, st.alpha, st.beta, st.lpb, st.lpl, st.log_like, upstream,
            n_nodes, T, U1, V, opts.blank, upstream.stride(0),
            *_f64_parts(opts.clamp), *_f64_parts(1.0 + opts.fastemit_lambda),
            FUSED=opts.fused, CLAMP=opts.clamp > 0, ACC=_acc(logits.dtype), ROWS=rows,
            BLOCK_V=block_v, num_warps=num_warps)
    return dst


_INT_IDS = (torch.int32, torch.int64)


def _prepare(logits, targets, logit_lengths, target_lengths):
    """The layouts the kernels index: contiguous logits, contiguous int32 or int64 ids and
    lengths (no-ops for what ``rnnt_loss`` passes)."""
    check_device(logits)
    return (logits.contiguous(),) + tuple(
        (x if x.dtype in _INT_IDS else x.to(torch.int64)).contiguous()
        for x in (targets, logit_lengths, target_lengths))


def _nonempty(targets: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """A kernel argument must have storage; U = 0 gives an empty targets tensor, which is
    never read: pass another integer tensor in its place (no allocation)."""
    return targets if targets.numel() else other


def _costs_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- loss
INPLACE_WRITES_IN = "backward"    # the gradient pass writes over the logits


def supports(opts: LossOptions, boundary=None, node_rows=None) -> bool:
    """The kernels compute the regular RNN-T lattice (math.md 1-6) without per-arc terms,
    on padded logits."""
    return opts.regular and boundary is None and node_rows is None


def loss_forward(logits, targets, logit_lengths, target_lengths, opts: LossOptions, need_grad,
                 boundary=None, node_rows=None):
    """Passes 1-2 (``_ops`` protocol): costs, and the float64 lattice state saved for the
    gradient pass. beta is only needed for the occupations: without a gradient it is
    skipped."""
    logits, targets, logit_lengths, target_lengths = _prepare(
        logits, targets, logit_lengths, target_lengths)
    st, costs = _forward(logits, targets, logit_lengths, target_lengths, opts.blank,
                         opts.fused, beta=need_grad)
    if not need_grad:
        return costs, (), None
    return costs, (logits, targets, logit_lengths, target_lengths, st.workspace), None


def loss_backward(saved, state, upstream, opts: LossOptions):
    """Pass 3 (``_ops`` protocol): the gradient with the upstream factor, clamp and FastEmit
    fused, in one pass over the logits, written over them with ``opts.inplace_grad``.
    ``upstream`` is read through its stride (an expanded scalar is not copied)."""
    logits, targets, logit_lengths, target_lengths, ws = saved
    B, T, U1, _ = logits.shape
    dst = logits if opts.inplace_grad else torch.empty_like(logits)
    return _gradient(dst, logits, targets, logit_lengths, target_lengths,
                     _State.of(ws, B, T, U1), opts, upstream)


def compute_lattice(logits, targets, logit_lengths, target_lengths, blank, fused) -> Lattice:
    """The float64 lattice (alpha, beta, occupations) without any gradient work; -inf off
    the lattice."""
    logits, targets, logit_lengths, target_lengths = _prepare(
        logits, targets, logit_lengths, target_lengths)
    with torch.no_grad():
        st, _ = _forward(logits, targets, logit_lengths, target_lengths, blank, fused,
                         beta=True, fill_padding=True)
        B, T, U1 = st.alpha.shape
        gammas = torch.empty((2, B, T, U1), dtype=LATTICE_DTYPE, device=logits.device)
        n_nodes = B * T * U1
        if n_nodes:
            block = _pow2(n_nodes, BLOCK_NODES)
            with _device(logits):
                kernels._gamma_kernel[(triton.cdiv(n_nodes, block),)](
                    st.alpha, st.beta, st.lpb, st.lpl, st.log_like, logit_lengths,
                    target_lengths, gammas[0], gammas[1], n_nodes, T, U1, BLOCK=block)
        return Lattice(st.alpha, st.beta, st.log_like, gammas[0], gammas[1])


def viterbi(logits, targets, logit_lengths, target_lengths, blank, fused):
    """``(alpha_max, lpb, lpl)``, each ``(B, T, U+1)`` float64: alpha in the max-plus
    semiring (the same wavefront kernel as the loss, ``MAX_SEMIRING=True``) and the arc
    log-probs b, e; -inf off the lattice."""
    logits, targets, logit_lengths, target_lengths = _prepare(
        logits, targets, logit_lengths, target_lengths)
    with torch.no_grad():
        st, _ = _forward(logits, targets, logit_lengths, target_lengths, blank, fused,
                         beta=False, max_semiring=True, fill_padding=True)
        return st.alpha, st.lpb, st.lpl
