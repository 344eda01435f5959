"""GPU backend: Triton kernels (``kernels.py``) behind a private autograd Function.

Importing this module imports Triton (that is how ``_backends`` detects it). It runs on
CUDA tensors, and on CPU tensors through the Triton interpreter, which is how the tests
run it: ``TRITON_INTERPRET=1`` must be set before this module is first imported (Triton
reads it when the kernels are decorated).

No host synchronisation: nothing here reads a tensor value on the host (no ``.item()``,
``.tolist()``, ``bool(tensor)``, no host-side max of the lengths); grid sizes come from
tensor shapes only. The value checks of ``_validate`` (lengths in range, target ids) run
for CPU inputs only; on CUDA, out-of-range lengths or targets are undefined behaviour.

Memory: the forward pass keeps O(B*T*(U+1)) state (lse, b, e, alpha, beta) and the
logits; the backward pass writes the gradient in one pass over the logits, with the
upstream gradient, clamp and FastEmit fused: one new buffer the size of the logits, or
none with ``inplace_grad=True`` (the gradient is written over the logits).

Precision: float16, bfloat16 and float32 logits are read in their own dtype and every
computation runs in float32 (float64 for float64 logits); the gradient is written in the
dtype of the logits, the costs are float32 (float64 for float64 logits).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .._types import Lattice
from . import kernels

__all__ = ["rnnt_costs", "costs_and_grad", "compute_lattice", "viterbi"]

# The kernels read float16/bfloat16 logits directly: the public layer need not upcast them.
NATIVE_LOW_PRECISION = True

# Decorated as interpreted functions iff TRITON_INTERPRET=1 was set at import.
INTERPRETED = not isinstance(kernels._row_kernel, triton.runtime.JITFunction)

# Tile sizes (powers of two). Tests lower them to exercise several blocks on tiny lattices.
BLOCK_U = 256      # lanes of the alpha/beta wavefront (label positions per block)
BLOCK_V = 1024     # chunk of the vocabulary per step of the row and gradient passes
BLOCK_NODES = 512  # lattice nodes per program of the occupation kernel
NUM_WARPS_LATTICE = 4


def _pow2(n: int, cap: int) -> int:
    return max(1, min(cap, triton.next_power_of_2(max(int(n), 1))))


def _acc(dtype: torch.dtype):
    """(torch, triton) accumulation dtype for logits of ``dtype``."""
    return (torch.float64, tl.float64) if dtype == torch.float64 else (torch.float32, tl.float32)


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


# --------------------------------------------------------------------------- passes
def _arc_log_probs(logits, targets, logit_lengths, target_lengths, blank: int, fused: bool):
    """Pass 1: ``(lse, lpb, lpl)``, each ``(B, T, U+1)`` in the accumulation dtype."""
    B, T, U1, V = logits.shape
    acc, acc_tl = _acc(logits.dtype)
    lse, lpb, lpl = (torch.empty((B, T, U1), dtype=acc, device=logits.device) for _ in range(3))
    n_nodes = B * T * U1
    if n_nodes:
        with _device(logits):
            kernels._row_kernel[(n_nodes,)](
                logits, _nonempty(targets), logit_lengths, target_lengths, lse, lpb, lpl,
                T, U1, V, blank,
                FUSED=fused, ACC=acc_tl, BLOCK_V=_pow2(V, BLOCK_V))
    return lse, lpb, lpl


def _recursion(lpb, lpl, logit_lengths, target_lengths, *, beta: bool, max_semiring: bool = False):
    """Pass 2: ``(alpha, beta or None, log_like)``; alpha/beta ``(B, T, U+1)``, -inf off
    the lattice; log_like ``(B,)``, -inf when no path exists (T_b = 0)."""
    B, T, U1 = lpb.shape
    alpha = torch.full_like(lpb, float("-inf"))
    beta_t = torch.full_like(lpb, float("-inf")) if beta else None
    log_like = torch.full((B,), float("-inf"), dtype=lpb.dtype, device=lpb.device)
    if B and T:
        with _device(lpb):
            kernels._lattice_kernel[(B,)](
                lpb, lpl, logit_lengths, target_lengths, alpha,
                beta_t if beta else alpha, log_like, T, U1,
                MAX_SEMIRING=max_semiring, BETA=beta, BLOCK_U=_pow2(U1, BLOCK_U),
                # num_stages=1: no software pipelining, so no load is issued ahead of the
                # barrier that makes the previous diagonal visible.
                num_warps=NUM_WARPS_LATTICE, num_stages=1)
    return alpha, beta_t, log_like


def _gradient(dst, logits, targets, logit_lengths, target_lengths, blank, fused, clamp,
              fastemit_lambda, lse, alpha, beta, lpb, lpl, log_like, upstream):
    """Pass 3: ``dst = upstream[b] * clip(d loss_b / d logits)``; ``dst`` may be ``logits``."""
    B, T, U1, V = logits.shape
    n_nodes = B * T * U1
    if n_nodes == 0:
        return dst
    acc, acc_tl = _acc(logits.dtype)
    # Filled on the device (fill kernels take the scalar as an argument): torch.tensor([...])
    # would be a host-to-device copy, which synchronises for pageable memory.
    opts = torch.full((2,), clamp, dtype=acc, device=logits.device)
    opts[1] = 1.0 + fastemit_lambda
    with _device(logits):
        kernels._grad_kernel[(n_nodes,)](
            logits, dst, _nonempty(targets), logit_lengths, target_lengths,
            lse, alpha, beta, lpb, lpl, log_like, upstream.to(acc).contiguous(),
            T, U1, V, blank, opts,
            FUSED=fused, CLAMP=clamp > 0, ACC=acc_tl, BLOCK_V=_pow2(V, BLOCK_V))
    return dst


def _prepare(logits, targets, logit_lengths, target_lengths):
    """The layouts the kernels index: contiguous logits, contiguous int64 ids and lengths
    (no-ops for what ``rnnt_loss`` passes)."""
    check_device(logits)
    return (logits.contiguous(),) + tuple(x.to(torch.int64).contiguous()
                                          for x in (targets, logit_lengths, target_lengths))


def _nonempty(x: torch.Tensor) -> torch.Tensor:
    """A kernel argument must have storage; U = 0 gives an empty targets tensor (never read)."""
    return x if x.numel() else torch.zeros(1, dtype=x.dtype, device=x.device)


def _costs_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- autograd
class _TritonRNNT(torch.autograd.Function):
    """Per-sequence costs (B,); the backward pass writes the fused gradient (math.md 4-6)
    scaled by the upstream gradient, in one pass over the logits."""

    @staticmethod
    def forward(ctx, logits, targets, logit_lengths, target_lengths, blank, clamp, fused,
                fastemit_lambda, inplace_grad):
        logits, targets, logit_lengths, target_lengths = _prepare(
            logits, targets, logit_lengths, target_lengths)
        need_grad = ctx.needs_input_grad[0]
        lse, lpb, lpl = _arc_log_probs(logits, targets, logit_lengths, target_lengths, blank, fused)
        # beta is only needed for the occupations: a forward without gradient skips it.
        alpha, beta, log_like = _recursion(lpb, lpl, logit_lengths, target_lengths, beta=need_grad)
        if need_grad:
            ctx.save_for_backward(logits, targets, logit_lengths, target_lengths,
                                  lse, alpha, beta, lpb, lpl, log_like)
            ctx.opts = (blank, fused, clamp, fastemit_lambda, inplace_grad)
        return (-log_like).to(_costs_dtype(logits.dtype))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_costs):
        logits, targets, logit_lengths, target_lengths, lse, alpha, beta, lpb, lpl, log_like = \
            ctx.saved_tensors
        blank, fused, clamp, fastemit_lambda, inplace_grad = ctx.opts
        if inplace_grad:
            # The logits' storage becomes the gradient. Bumping the version counter makes
            # autograd refuse (instead of silently using overwritten values) any later use
            # of these logits saved by another node, or a second backward through this one.
            dst = logits
            torch.autograd.graph.increment_version(logits)
        else:
            dst = torch.empty_like(logits)
        _gradient(dst, logits, targets, logit_lengths, target_lengths, blank, fused, clamp,
                  fastemit_lambda, lse, alpha, beta, lpb, lpl, log_like, grad_costs)
        if inplace_grad:
            dst = dst.detach()     # a new tensor over the same memory, not the leaf itself
        return dst, None, None, None, None, None, None, None, None


def rnnt_costs(logits, targets, logit_lengths, target_lengths, blank, clamp, fused,
               fastemit_lambda, inplace_grad=False):
    """(B,) per-sequence costs ``-log P`` with the (FastEmit/clamped) gradient attached.
    ``inplace_grad``: the backward pass writes the gradient over ``logits``."""
    return _TritonRNNT.apply(logits, targets, logit_lengths, target_lengths, blank, clamp, fused,
                             fastemit_lambda, inplace_grad)


def costs_and_grad(logits, targets, logit_lengths, target_lengths, blank, clamp, fused,
                   fastemit_lambda, need_grad):
    """Costs (B,) and, if ``need_grad``, the per-sequence gradient before the upstream
    factor (for the torch.library custom op); no autograd involved."""
    logits, targets, logit_lengths, target_lengths = _prepare(
        logits, targets, logit_lengths, target_lengths)
    with torch.no_grad():
        lse, lpb, lpl = _arc_log_probs(logits, targets, logit_lengths, target_lengths, blank, fused)
        alpha, beta, log_like = _recursion(lpb, lpl, logit_lengths, target_lengths, beta=need_grad)
        costs = (-log_like).to(_costs_dtype(logits.dtype))
        if not need_grad:
            return costs, None
        ones = torch.ones(logits.shape[0], dtype=lse.dtype, device=logits.device)
        grad = _gradient(torch.empty_like(logits), logits, targets, logit_lengths, target_lengths,
                         blank, fused, clamp, fastemit_lambda, lse, alpha, beta, lpb, lpl,
                         log_like, ones)
        return costs, grad


def compute_lattice(logits, targets, logit_lengths, target_lengths, blank, fused) -> Lattice:
    """The lattice (alpha, beta, occupations) in the accumulation dtype, no gradient work."""
    logits, targets, logit_lengths, target_lengths = _prepare(
        logits, targets, logit_lengths, target_lengths)
    with torch.no_grad():
        _, lpb, lpl = _arc_log_probs(logits, targets, logit_lengths, target_lengths, blank, fused)
        alpha, beta, log_like = _recursion(lpb, lpl, logit_lengths, target_lengths, beta=True)
        gamma_blank = torch.empty_like(alpha)
        gamma_label = torch.empty_like(alpha)
        B, T, U1 = alpha.shape
        n_nodes = B * T * U1
        if n_nodes:
            block = _pow2(n_nodes, BLOCK_NODES)
            with _device(alpha):
                kernels._gamma_kernel[(triton.cdiv(n_nodes, block),)](
                    alpha, beta, lpb, lpl, log_like, logit_lengths, target_lengths,
                    gamma_blank, gamma_label, n_nodes, T, U1, BLOCK=block)
        return Lattice(alpha, beta, log_like, gamma_blank, gamma_label)


def viterbi(logits, targets, logit_lengths, target_lengths, blank, fused):
    """``(alpha_max, lpb, lpl)``, each ``(B, T, U+1)`` in the accumulation dtype: alpha in
    the max-plus semiring (the same wavefront kernel as the loss, ``MAX_SEMIRING=True``)
    and the arc log-probs b, e; -inf off the lattice."""
    logits, targets, logit_lengths, target_lengths = _prepare(
        logits, targets, logit_lengths, target_lengths)
    with torch.no_grad():
        _, lpb, lpl = _arc_log_probs(logits, targets, logit_lengths, target_lengths, blank, fused)
        alpha_max, _, _ = _recursion(lpb, lpl, logit_lengths, target_lengths, beta=False,
                                     max_semiring=True)
        return alpha_max, lpb, lpl
