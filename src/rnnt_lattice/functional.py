"""Public functions: validate -> pick a backend -> reduce."""
from __future__ import annotations

import torch

from . import _backends, _ops
from ._types import LossOptions
from ._validate import check_float, check_reduction

__all__ = ["rnnt_loss", "empty_cache"]


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
    inplace_grad: bool = False,
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
        reduction: ``"none"`` -> ``(B,)``, ``"sum"``, or ``"mean"`` (sum / B, as torchaudio;
            0 with a zero gradient for an empty batch, B = 0).
        fused_log_softmax: ``True``: ``logits`` are raw scores and log-softmax is fused in.
            ``False``: ``logits`` already are log-probabilities.
        fastemit_lambda: FastEmit regularisation (Yu et al. 2021), a finite number. It changes the
            *gradient*: label arcs get their gradient scaled by ``1 + fastemit_lambda``.
            The returned loss stays the plain ``-log P`` (comparable across lambdas).
        zero_infinity: if ``True``, infinite losses (impossible alignments, e.g.
            ``T_b = 0``) and their gradients are set to 0. Otherwise they give ``+inf``
            with zero gradient. NaN and ``+inf`` logits inside a sequence's lattice make
            that sequence's loss (and gradient) NaN, ``-inf`` logits are masked classes,
            and a sequence whose upstream gradient is 0 gets an exactly zero gradient
            (docs/math.md section 8.1).
        backend: ``"auto"`` (Numba on CPU, Triton on CUDA, PyTorch elsewhere),
            ``"numba"``, ``"torch"`` (the vectorised pure-PyTorch reference) or ``"triton"``
            (CUDA tensors; CPU tensors only under the Triton interpreter, ``TRITON_INTERPRET=1``
            set before the first use).
        inplace_grad: if ``True``, the gradient is written over the logits buffer: no
            gradient-sized allocation, but *the user gives up the logits* (their values are
            gone once the gradient is computed: after the forward pass with Numba, after the
            backward pass otherwise), and ``logits.grad`` (or the gradient flowing into the
            joiner) shares their memory. ``logits`` must be contiguous and float32 or float64
            (also float16/bfloat16 with the Triton backend, which computes them natively),
            else ``ValueError``: any copy would defeat the purpose. Autograd refuses, rather
            than silently misusing, any other use of the overwritten logits (their version
            counter is bumped), including a second backward. No effect when no gradient is
            needed, nor under ``torch.compile`` (the compiled graph owns its buffers).

    Returns:
        The reduced loss (a scalar), or ``(B,)`` per-sequence losses for ``"none"``.

    Raises:
        ValueError: on bad shapes, dtypes, devices, lengths, targets, blank, reduction or
            backend. Checks of tensor *values* (lengths, target ids) run for CPU inputs only,
            to keep the CUDA path free of host synchronisation.

    Notes:
        Under ``torch.compile`` the loss is the custom op ``rnnt_lattice::rnnt_costs_and_grad``
        (``fullgraph=True`` works, on CPU too), float16/bfloat16 logits are upcast to
        float32 first, and the value checks are skipped (see Raises).

        The Numba backend returns, as the gradient, a buffer its forward pass filled with
        ``exp(logits - max)``: one exp per logit element in total. The gradient is an
        ``once_differentiable`` function (no double backward).
    """
    check_reduction(reduction)
    clamp = check_float("clamp", clamp)
    fastemit_lambda = check_float("fastemit_lambda", fastemit_lambda, finite=True)
    compiling = torch.compiler.is_compiling()
    impl, chk = _backends.prepare(logits, targets, logit_lengths, target_lengths, blank, backend,
                                  traced=compiling)
    opts = LossOptions(chk.blank, bool(fused_log_softmax), clamp, fastemit_lambda,
                       bool(inplace_grad))
    if compiling:
        # The traced path: an opaque custom op (see _ops.py); the backend is resolved when
        # the op runs, outside the trace. inplace_grad has no effect there.
        costs = _ops.rnnt_costs_traced(chk.logits, chk.targets, chk.logit_lengths,
                                       chk.target_lengths, opts, backend)
    else:
        if inplace_grad:
            # Checked on what the user passed: any copy (dtype, layout) would defeat it.
            _check_inplace(logits, getattr(impl, "NATIVE_LOW_PRECISION", False))
        costs = _ops.rnnt_costs(impl, chk.logits, chk.targets, chk.logit_lengths,
                                chk.target_lengths, opts)
    if zero_infinity:
        # torch.where's gradient is 0 for the replaced entries: no host sync, no NaN.
        costs = torch.where(torch.isinf(costs), torch.zeros_like(costs), costs)
    if reduction == "none":
        return costs
    if reduction == "sum" or costs.shape[0] == 0:
        return costs.sum()             # an empty batch: "mean" is 0, like "sum", not 0/0
    return costs.mean()


def _check_inplace(logits: torch.Tensor, native_low_precision: bool) -> None:
    """``inplace_grad=True`` writes the gradient over ``logits``: refuse inputs that would
    be copied first (the gradient would land in the copy)."""
    dtypes = (torch.float32, torch.float64)
    if native_low_precision:
        dtypes += (torch.float16, torch.bfloat16)
    if logits.dtype not in dtypes:
        raise ValueError(
            f"inplace_grad=True needs logits of dtype {' or '.join(str(d) for d in dtypes)} with "
            f"this backend (any other dtype is copied first), got {logits.dtype} logits of shape "
            f"{tuple(logits.shape)}")
    if not logits.is_contiguous():
        raise ValueError(
            f"inplace_grad=True needs contiguous logits (a non-contiguous tensor is copied first), "
            f"got logits of shape {tuple(logits.shape)} with strides {logits.stride()}")


def empty_cache() -> None:
    """Release the gradient buffer that the CPU backend keeps for reuse.

    The Numba backend hands the same large gradient buffer out again once nothing uses it
    any more, so a training loop does not pay the page faults of a fresh buffer in every
    step (like PyTorch's CUDA caching allocator). Between steps that buffer stays
    allocated: call this to return it to the system (it is freed as soon as no tensor
    uses it), or set ``RNNT_LATTICE_CACHE_GRAD=0`` before the first call to turn the reuse
    off. Safe to call at any time; a no-op when the CPU backend was never used.
    """
    import sys

    cpu = sys.modules.get(f"{__package__}.cpu")
    if cpu is not None:
        cpu.empty_cache()

