"""The RNN-T loss as a ``torch.library`` custom op, so that ``torch.compile`` traces it.

``torch.compile(model, fullgraph=True)`` cannot trace through Numba or a Triton launch; a
custom op is opaque to the tracer instead: it sees only the op's fake (meta)
implementation, which gives the output shapes and dtypes. ``rnnt_loss`` routes through
this op only while compiling; eager calls use the backends' own autograd Functions, which
avoid one pass over the gradient (the upstream factor is fused into the gradient write,
and the Numba backend hands its buffer over without a copy).

The op's forward returns ``(costs, grad)``: the per-sequence costs ``(B,)`` and the
per-sequence gradient ``(B, T, U+1, V)`` before the upstream factor (empty when no
gradient is needed), from the backend's ``costs_and_grad``. Its registered backward
scales the saved gradient by the upstream gradient of each sequence.
"""
from __future__ import annotations

import torch

from . import _backends

__all__ = ["rnnt_costs"]


@torch.library.custom_op("rnnt_lattice::rnnt_costs_and_grad", mutates_args=())
def _costs_and_grad(
    logits: torch.Tensor,          # (B, T, U+1, V) float32/float64, contiguous
    targets: torch.Tensor,         # (B, U) int64
    logit_lengths: torch.Tensor,   # (B,) int64
    target_lengths: torch.Tensor,  # (B,) int64
    blank: int,
    clamp: float,
    fused: bool,
    fastemit_lambda: float,
    backend: str,
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    impl = _backends.resolve(backend, logits.device)
    costs, grad = impl.costs_and_grad(logits, targets, logit_lengths, target_lengths, blank,
                                      clamp, fused, fastemit_lambda, need_grad)
    if grad is None:
        grad = logits.new_empty((0,))
    return costs, grad


@_costs_and_grad.register_fake
def _(logits, targets, logit_lengths, target_lengths, blank, clamp, fused, fastemit_lambda,
      backend, need_grad):
    costs = logits.new_empty((logits.shape[0],))
    grad = torch.empty_like(logits) if need_grad else logits.new_empty((0,))
    return costs, grad


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])


def _backward(ctx, grad_costs, _grad_of_grad):
    (grad,) = ctx.saved_tensors
    # d loss / d logits = upstream[b] * (per-sequence gradient of sequence b); an upstream
    # of exactly 0 gives exactly 0, even where the gradient is NaN (math.md section 8).
    from .reference import scale_upstream
    return (scale_upstream(grad, grad_costs.to(grad.dtype)[:, None, None, None]),
            None, None, None, None, None, None, None, None, None)


_costs_and_grad.register_autograd(_backward, setup_context=_setup_context)


def rnnt_costs(logits, targets, logit_lengths, target_lengths, blank: int, clamp: float,
               fused: bool, fastemit_lambda: float, backend: str) -> torch.Tensor:
    """(B,) per-sequence costs through the custom op, differentiable w.r.t. ``logits``."""
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    costs, _ = _costs_and_grad(logits, targets, logit_lengths, target_lengths, blank, clamp,
                               fused, fastemit_lambda, backend, need_grad)
    return costs
