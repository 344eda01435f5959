"""The one autograd Function of the loss, and the same loss as a ``torch.library`` custom
op for ``torch.compile``; both drive any backend through the same two calls of the
backend protocol (``_backends.Backend``): ``loss_forward`` -> ``(costs (B,), saved
tensors, state)`` and ``loss_backward(saved, state, upstream (B,), opts)`` -> the
gradient, shaped like the logits.

Layouts (math.md section 9): with ``node_rows=None`` the logits are padded ``(B, T, U+1,
V)``. Otherwise they are rows ``(N, V)`` and ``node_rows`` ``(B, T, U+1)`` int64 says which
row each node reads (``-1``: none, every arc leaving the node is ``-inf``); every row is
read by exactly one node (the gradient passes write each row once, from its node; a row no
node read would keep whatever the buffer held). Packed logits (``packed=True``) and the
pruned windows of ``rnnt_loss_pruned`` are such layouts by construction (``_layout``:
``packed_node_rows``, ``pruned_node_rows``); the gradient comes back in the same rows.

``saved`` goes through ``ctx.save_for_backward`` (autograd's version checks apply), ``state``
is anything else the backend keeps. ``loss_backward`` returns ``upstream[b] * clip(d loss_b
/ d logits)`` (exactly 0 where ``upstream[b] == 0``, math.md 8.1), written over the logits
when ``opts.inplace_grad``.

``inplace_grad`` is handled here, once: the backend overwrites the logits in the phase it
declares (Numba stores its exps there in the forward pass; the others write the gradient
in the backward pass), and this Function bumps the logits' version counter right then, so
that autograd refuses, rather than silently misuses, any other use of the overwritten
logits (another node that saved them, or a second backward), and it hands autograd a new
tensor over the logits' memory, not the leaf itself.

The custom op (``torch.compile`` cannot trace through Numba or a Triton launch; the op is
opaque to the tracer, which sees only its fake implementation) returns ``(costs, grad)``:
the per-sequence gradient with upstream 1, from the same two calls, and its registered
backward scales it by the upstream gradient. Eager calls use the Function instead, which
fuses the upstream factor into the gradient write and lets the Numba backend hand its
buffer over without a copy.
"""
# (No ``from __future__ import annotations`` here: the custom op's schema is inferred from
# its annotations, which torch 2.4 reads as objects, not strings.)
import functools
from typing import List, Optional

import torch

from . import _backends, _validate
from ._layout import row_sequences
from ._rules import scale_upstream
from ._types import LossOptions
from .topology import from_spec, to_spec

__all__ = ["run", "rnnt_costs", "rnnt_costs_traced", "output_costs", "reduce_costs",
           "refuse_double_backward", "eager_under_compile", "graph_break", "traced_width_only"]


# --------------------------------------------------------------------------- eager
class _RNNTLoss(torch.autograd.Function):
    """Per-sequence costs ``-log P`` (B,) with the fused gradient of math.md 4-6."""

    @staticmethod
    def forward(ctx, logits, targets, logit_lengths, target_lengths, boundary, node_rows, impl,
                opts: LossOptions, nan_rows=None):
        # rnnt_costs applies this Function only where a graph is built: the gradient is
        # needed (without a graph it calls the backend's forward alone).
        # The device check's NaN rows join the costs in the backend (the Triton lattice pass
        # adds them as it writes the costs): no operation of their own, no autograd node.
        costs, saved, state = impl.loss_forward(logits, targets, logit_lengths, target_lengths,
                                                opts, True, boundary, node_rows, nan_rows)
        if opts.inplace_grad and impl.INPLACE_WRITES_IN == "forward":
            torch.autograd.graph.increment_version(logits)
        ctx.save_for_backward(*saved)
        ctx.impl, ctx.state, ctx.opts = impl, state, opts
        ctx.logits = logits if opts.inplace_grad else None
        ctx.infinite = None if impl.ZEROES_INFINITE_COSTS else torch.isinf(costs)
        return costs

    @staticmethod
    def backward(ctx, grad_costs):
        # Grad mode is off past this line (a backward that would build a graph raises): no
        # once_differentiable wrapper is needed to keep the kernels' gradient out of one.
        refuse_double_backward("rnnt_loss")
        if ctx.impl.NAME != "torch":              # (the torch backend's operations batch)
            _validate.check_unbatched_upstream(grad_costs)
        saved = ctx.saved_tensors                 # version checks happen here
        opts: LossOptions = ctx.opts
        if opts.inplace_grad:
            # The gradient is written over the logits now (a backend that stored its exps
            # there in the forward scales them now): bumped again, so that a node that
            # saved the logits after the forward is refused too, not given the gradient.
            torch.autograd.graph.increment_version(ctx.logits)
        grad = ctx.impl.loss_backward(saved, ctx.state, without_infinite(grad_costs, ctx.infinite),
                                      opts)
        if opts.inplace_grad:
            grad = grad.detach()                  # a new tensor over the same memory
        return grad, None, None, None, None, None, None, None, None


def refuse_double_backward(what: str) -> None:
    """RuntimeError when a backward is asked to build a graph (``create_graph=True``, the
    engine then runs the backward with grad mode on): the gradient is computed by kernels,
    not by differentiable operations, and would come back without a graph, so that a
    gradient penalty would silently train without its penalty."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{what} does not support double backward (create_graph=True): its gradient is "
            "computed by kernels and cannot be differentiated again")


def without_infinite(upstream: torch.Tensor, infinite) -> torch.Tensor:
    """The upstream gradient with 0 for the sequences whose cost is infinite in the output
    dtype: an infinite loss has a zero gradient (math.md 8.1), also where the float64 lattice
    was finite and only the cast overflowed (a float32 cost beyond 3.4e38). The backends see
    an upstream of exactly 0 there, which gives an exactly zero gradient. ``infinite`` None:
    the backend does it itself (``ZEROES_INFINITE_COSTS``)."""
    return upstream if infinite is None else upstream.masked_fill(infinite, 0.0)


def rnnt_costs(impl, logits, targets, logit_lengths, target_lengths, opts: LossOptions,
               boundary=None, node_rows=None, nan_rows=None) -> torch.Tensor:
    """(B,) per-sequence costs through ``impl`` with the gradient attached (eager), NaN
    where ``nan_rows`` (the device check's, ``_rules.with_bad_rows``) says so. Where no
    graph is built (``torch.no_grad``, ``torch.inference_mode``, logits without grad), the
    backend's forward alone, with no gradient work: inside the Function
    ``ctx.needs_input_grad`` does not see the grad mode (it is True under ``no_grad`` for
    logits that require grad), and ``inplace_grad`` would overwrite the logits of a
    validation step with nothing to gain."""
    if not (logits.requires_grad and torch.is_grad_enabled()):
        with torch.no_grad():
            costs, _, _ = impl.loss_forward(logits, targets, logit_lengths, target_lengths,
                                            opts.without_inplace(), False, boundary, node_rows,
                                            nan_rows)
        return costs
    return _RNNTLoss.apply(logits, targets, logit_lengths, target_lengths, boundary, node_rows,
                           impl, opts, nan_rows)


def run(prep, backend: str, reduction: str, zero_infinity: bool) -> torch.Tensor:
    """A prepared call (``_backends.prepare_call``) run to its loss: the autograd Function
    (eager), or the custom op while ``torch.compile`` traces (``prep.impl`` None; the backend
    is resolved when the op runs), the device check's NaN rows added by the backend, then
    ``zero_infinity`` and the reduction. Nothing is checked again."""
    chk, opts = prep.chk, prep.opts
    if prep.impl is None:
        # The op checks the values, and adds its own NaN rows, when it runs; the caller's own
        # (the pruned windows', an assert and NaN rows in the traced graph) are added here.
        costs = rnnt_costs_traced(chk.logits, chk.targets, chk.logit_lengths, chk.target_lengths,
                                  opts, backend, prep.boundary, prep.node_rows,
                                  allow_blank_targets=prep.allow_blank_targets, names=prep.names)
        if prep.nan_rows is not None:
            costs = costs + prep.nan_rows                     # (_rules.with_bad_rows' rule)
    else:
        costs = rnnt_costs(prep.impl, chk.logits, chk.targets, chk.logit_lengths,
                           chk.target_lengths, opts, prep.boundary, prep.node_rows,
                           prep.nan_rows)
    return reduce_costs(costs, reduction, zero_infinity)


# --------------------------------------------------------------------------- traced
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
    topology: str,
    durations: List[int],
    sigma: float,
    delay_penalty: float,
    boundary: Optional[torch.Tensor],
    node_rows: Optional[torch.Tensor],
    allow_blank_targets: bool,
    names: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    # A custom op's schema takes primitives: the options are rebuilt here (the topology
    # from its name and durations, topology.from_spec; the messages' names from their
    # joined string, Names.split).
    opts = LossOptions(blank, fused, clamp, fastemit_lambda,
                       topology=from_spec(topology, blank, tuple(durations)), sigma=sigma,
                       delay_penalty=delay_penalty)
    # The values exist now: the call is prepared again, on them, as an eager call is
    # (_backends.prepare_call: the backend resolved, check_call's every rule, host or device),
    # so that a compiled call refuses what an eager one refuses. Tracing could check only
    # the shapes, dtypes and options; what it returned is what this reads, so the tensors
    # come back as they are.
    prep = _backends.prepare_call(logits, targets, logit_lengths, target_lengths, blank,
                                  backend, opts, boundary=boundary, node_rows=node_rows,
                                  allow_blank_targets=allow_blank_targets,
                                  names=_validate.Names.split(names))
    impl, chk, opts = prep.impl, prep.chk, prep.opts
    logits, targets, logit_lengths, target_lengths = (
        chk.logits, chk.targets, chk.logit_lengths, chk.target_lengths)
    boundary, nan_rows = chk.boundary, chk.nan_rows
    with torch.no_grad():
        costs, saved, state = impl.loss_forward(logits, targets, logit_lengths, target_lengths,
                                                opts, need_grad, boundary, node_rows, nan_rows)
        if not need_grad:
            return costs, logits.new_empty((0,))
        ones = torch.ones(costs.shape[0], dtype=costs.dtype, device=costs.device)
        grad = impl.loss_backward(saved, state, ones, opts)
    return costs, grad


@_costs_and_grad.register_fake
def _(logits, targets, logit_lengths, target_lengths, blank, clamp, fused, fastemit_lambda,
      backend, need_grad, topology, durations, sigma, delay_penalty, boundary, node_rows,
      allow_blank_targets, names):
    B = logits.shape[0] if node_rows is None else node_rows.shape[0]    # rows (N, V): B from the map
    costs = logits.new_empty((B,))
    grad = torch.empty_like(logits) if need_grad else logits.new_empty((0,))
    return costs, grad


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1], torch.isinf(output[0]))
    node_rows = inputs[15]
    # The sequence of each row of a node_rows layout (B for a row no node reads).
    ctx.row_seq = None if node_rows is None else row_sequences(node_rows, inputs[0].shape[0])


def _backward(ctx, grad_costs, _grad_of_grad):
    grad, infinite = ctx.saved_tensors
    # d loss / d logits = upstream[b] * (per-sequence gradient of sequence b).
    up = without_infinite(grad_costs, infinite).to(grad.dtype)
    if ctx.row_seq is not None:                    # rows of a node_rows layout
        up = torch.cat([up, up.new_zeros(1)])[ctx.row_seq][:, None]
    else:
        up = up[:, None, None, None]
    return (scale_upstream(grad, up),) + (None,) * 17


_costs_and_grad.register_autograd(_backward, setup_context=_setup_context)


def rnnt_costs_traced(logits, targets, logit_lengths, target_lengths, opts: LossOptions,
                      backend: str, boundary=None, node_rows=None, *,
                      allow_blank_targets: bool = False,
                      names: _validate.Names = _validate.OURS) -> torch.Tensor:
    """(B,) per-sequence costs through the custom op, differentiable w.r.t. ``logits``;
    ``allow_blank_targets`` and ``names`` as :func:`_backends.prepare_call` takes them (the
    op prepares the call again when it runs, on the values)."""
    # torch.jit.trace bakes the flag into its graph as a constant: the graph computes the
    # gradient whatever the grad mode of its later calls (and its check run, without grad,
    # records the same graph).
    need_grad = torch.jit.is_tracing() or (torch.is_grad_enabled() and logits.requires_grad)
    name, durations = to_spec(opts.topology)
    costs, _ = _costs_and_grad(logits, targets, logit_lengths, target_lengths, opts.blank,
                               opts.clamp, opts.log_softmax, opts.fastemit_lambda, backend, need_grad,
                               name, list(durations), opts.sigma, opts.delay_penalty, boundary,
                               node_rows, allow_blank_targets, names.joined())
    return costs


def traced_width_only(loss: torch.Tensor, logits) -> torch.Tensor:
    """The loss of a ``torch.jit.trace`` graph traced with a negative blank, NaN when a
    later call's logits have another V than the traced call's: the graph keeps the blank
    resolved against the traced V, and another V would silently give another loss. (An
    assert is not recorded by the tracer, which keeps only what the outputs depend on.)"""
    V = logits.shape[-1]                       # a traced size: the graph reads each call's
    return torch.where(V == int(V), loss, float("nan"))


# --------------------------------------------------------------------------- costs out
def output_costs(costs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float64 costs in the output ``dtype``, where a cost that overflows there (finite in
    float64, ``+inf`` in float32) gets a zero gradient like any infinite loss (math.md 8.1;
    the Function above applies the same rule through ``without_infinite``)."""
    out = costs.to(dtype)
    return torch.where(torch.isinf(out), out.detach(), out)


def reduce_costs(costs: torch.Tensor, reduction: str, zero_infinity: bool) -> torch.Tensor:
    """Every loss's last step: ``zero_infinity`` (infinite costs, and their gradients, become
    0: ``torch.where``'s gradient is 0 for the replaced entries, with no host sync and no
    NaN), then ``"none"`` (B,), ``"sum"`` or ``"mean"`` (sum / B; 0 for an empty batch, like
    ``"sum"``, not 0/0)."""
    if zero_infinity:
        costs = torch.where(torch.isinf(costs), torch.zeros_like(costs), costs)
    if reduction == "none":
        return costs
    if reduction == "sum" or costs.shape[0] == 0:
        return costs.sum()
    return costs.mean()


def eager_under_compile(fn, reason: str):
    """``fn`` behind ``torch.compiler.disable``: run eagerly inside a compiled function (a
    graph break around it), for the calls whose backends' kernels and host work TorchDynamo
    cannot trace. ``torch.compile(..., fullgraph=True)``, which allows no graph break,
    fails with ``reason`` in its message (torch 2.8 and later; before, without it). Eager
    calls call ``fn`` itself; the wrapper is made at the first call that TorchDynamo
    traces: decorating at import, or at an eager call, would import torch._dynamo (and
    Triton) with rnnt_lattice (about a second)."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if not torch.compiler.is_compiling():
            if torch.jit.is_tracing():
                raise RuntimeError(
                    f"torch.jit.trace cannot record this call, which runs eagerly ({reason}): "
                    f"call it outside the traced function")
            return fn(*args, **kwargs)
        if disabled is None:
            # (No try/except here: TorchDynamo cannot break a graph inside a try block, and
            # would run this frame untraced, which calls fn traced, which calls this.)
            graph_break(reason)
            disabled = (torch.compiler.disable(fn, reason=reason) if DYNAMO_TAKES_REASONS
                        else torch.compiler.disable(fn))
        return disabled(*args, **kwargs)
    return call


def graph_break(reason: str) -> None:
    """A graph break that says why (``fullgraph=True`` raises it with ``reason``); called
    while TorchDynamo traces, so torch._dynamo is already imported."""
    import torch._dynamo
    if _TORCH >= (2, 7):
        torch._dynamo.graph_break(msg=reason)
    else:
        torch._dynamo.graph_break()


# torch._dynamo.graph_break takes a message from torch 2.7 on, torch.compiler.disable a reason
# from 2.8 on (read from the version: their signatures need torch._dynamo imported, about a
# second). fullgraph=True names the reason from 2.8 on, and on 2.7 at a call's first trace.
_TORCH = tuple(int(n) for n in torch.__version__.split(".")[:2])
DYNAMO_TAKES_REASONS = _TORCH >= (2, 8)
