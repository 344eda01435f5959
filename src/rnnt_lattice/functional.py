"""Public functions: validate -> pick a backend -> reduce."""
from __future__ import annotations

import torch

from . import _backends
from ._validate import check_float, check_lattice_args, check_reduction

__all__ = ["rnnt_loss"]


def rnnt_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int = -1,
    clamp: float = -1.0,
    reduction: str = "mean",
    fused_log_softmax: bool = True,
    *,
    fastemit_lambda: float = 0.0,
    zero_infinity: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    r"""RNN-Transducer loss ``-log P(y|x)`` with its exact gradient.

    A drop-in replacement for ``torchaudio.functional.rnnt_loss``: same positional
    signature, defaults and meaning.

    Example::

        >>> import torch, rnnt_lattice
        >>> B, T, U, V = 2, 10, 4, 8
        >>> logits = torch.randn(B, T, U + 1, V, requires_grad=True)
        >>> targets = torch.randint(1, V, (B, U), dtype=torch.int32)
        >>> logit_lengths = torch.tensor([10, 7], dtype=torch.int32)
        >>> target_lengths = torch.tensor([4, 3], dtype=torch.int32)
        >>> loss = rnnt_lattice.rnnt_loss(logits, targets, logit_lengths, target_lengths, blank=0)
        >>> loss.backward()

    The lattice of sequence ``b`` has frames ``t < T_b = logit_lengths[b]`` and label
    positions ``u <= U_b = target_lengths[b]``; a blank moves ``(t,u) -> (t+1,u)``, the
    label ``y[u]`` moves ``(t,u) -> (t,u+1)``, and every path ends with a blank at
    ``(T_b-1, U_b)``. With ``b``/``e`` the blank/label log-probabilities::

        alpha(t,u) = logaddexp(alpha(t-1,u) + b(t-1,u), alpha(t,u-1) + e(t,u-1))
        loss_b     = -(alpha(T_b-1,U_b) + b(T_b-1,U_b))

    The gradient is fused (no log-softmax tensor is stored):
    ``dloss/dlogits(t,u,v) = p(t,u,v) (gamma_blank + gamma_label) - [v=blank] gamma_blank
    - [v=y_u] gamma_label`` with the arc occupations ``gamma`` (see docs/math.md).

    Args:
        logits: ``(B, T, U+1, V)`` joiner output; float32 or float64 (float16 and bfloat16
            are computed in float32; their gradient comes back in the input dtype and the
            loss in float32). Any strides.
        targets: ``(B, U)`` int32 or int64 label ids; entries past ``target_lengths`` are
            ignored.
        logit_lengths: ``(B,)`` int32 or int64, number of valid frames ``T_b``.
        target_lengths: ``(B,)`` int32 or int64, number of valid labels ``U_b``.
        blank: blank id; negative values count from the end (``-1`` is ``V-1``).
        clamp: if ``> 0``, every element of the per-sequence gradient (w.r.t. logits, or
            w.r.t. log-probs when ``fused_log_softmax=False``) is clipped to
            ``[-clamp, clamp]`` before the upstream gradient is applied.
        reduction: ``"none"`` -> ``(B,)``, ``"sum"``, or ``"mean"`` (sum / B, as torchaudio).
        fused_log_softmax: ``True``: ``logits`` are raw scores and log-softmax is fused in.
            ``False``: ``logits`` already are log-probabilities.
        fastemit_lambda: FastEmit regularisation (Yu et al. 2021). It changes the
            *gradient*: label arcs get their gradient scaled by ``1 + fastemit_lambda``.
            The returned loss stays the plain ``-log P`` (comparable across lambdas).
        zero_infinity: if ``True``, infinite losses (impossible alignments, e.g.
            ``T_b = 0``) and their gradients are set to 0. Otherwise they give ``+inf``
            with zero gradient.
        backend: ``"auto"`` (Numba on CPU, Triton on CUDA, PyTorch elsewhere),
            ``"numba"``, ``"torch"`` (the vectorised pure-PyTorch reference) or ``"triton"``.

    Returns:
        The reduced loss (a scalar), or ``(B,)`` per-sequence losses for ``"none"``.

    Raises:
        ValueError: on bad shapes, dtypes, devices, lengths, targets, blank, reduction or
            backend. Checks of tensor *values* (lengths, target ids) run for CPU inputs only,
            to keep the CUDA path free of host synchronisation.

    Notes:
        The Numba backend returns, as the gradient, a buffer its forward pass filled with
        ``exp(logits - max)``: one exp per logit element in total. The gradient is an
        ``once_differentiable`` function (no double backward).
    """
    check_reduction(reduction)
    clamp = check_float("clamp", clamp)
    fastemit_lambda = check_float("fastemit_lambda", fastemit_lambda)
    chk = check_lattice_args(logits, targets, logit_lengths, target_lengths, blank)
    impl = _backends.resolve(backend, logits.device)

    x = chk.logits
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()                      # autograd casts the gradient back
    costs = impl.rnnt_costs(x.contiguous(), chk.targets, chk.logit_lengths, chk.target_lengths,
                            chk.blank, clamp, bool(fused_log_softmax), fastemit_lambda)
    if zero_infinity:
        # torch.where's gradient is 0 for the replaced entries: no host sync, no NaN.
        costs = torch.where(torch.isinf(costs), torch.zeros_like(costs), costs)
    if reduction == "none":
        return costs
    if reduction == "sum":
        return costs.sum()
    return costs.mean()
