"""The fused joiner and loss (math.md section 11): the exact transducer loss of
``logits = joiner(enc[:, :, None], pred[:, None])`` and its gradients w.r.t. ``enc``,
``pred`` and the joiner's parameters, without ever holding the ``(B, T, U+1, V)`` logits.

The lattice is cut into tiles, boxes of frames ``[t0, t1)`` and label positions ``[u0,
u1)`` of every sequence (``_layout.tile_plan``; each tile is one more node -> row layout,
``_layout.tile_node_rows``), and the loss runs on the backends' own passes (``Backend``:
``tile_forward``, ``tile_lattice``, ``tile_backward``):

    forward   for each tile:  x = joiner(enc[:, t0:t1, None], pred[:, None, u0:u1])  (no_grad)
                              row pass on x: lse, arc weights w of the tile's nodes; x dropped
              the lattice once over every node: alpha, beta, log P, occupations gamma
    backward  once:           the joiner on one node with autograd, and a zero gradient through
                              it to the leaves it reaches that the Function does not own
                              (FSDP2's gathered parameters): their hooks see the backward begin
              for each tile:  x = joiner(...) again, with autograd (RNG and autocast replayed),
                              g = upstream[b] * d cost_b / d x  (gradient pass, over x itself)
                              x checked to be the forward's (determinism): in the GPU's
                              gradient pass (fused mode), else its row sums against the
                              forward's
                              torch.autograd.grad(x, [enc, pred, *params], g), accumulated
                              (other leaves the joiner reached: torch.autograd.backward)

With an ``rnnt_lattice.Joiner`` (``out(act(enc_proj(enc) + pred_proj(pred)))``) on the
Triton backend there are no tiles of logits at all: the kernel path (``_JointLoss``, the
kernels of ``gpu/joint.py``, math.md section 12) computes the logits block by block in
registers, forward and backward; the projections stay autograd's. On a GPU it takes half
operands (autocast) and float32 with TF32 products; float32 with IEEE products and float64
keep the tile path (``_kernel_path``).

The gradient pass needs only the occupations and the row statistics of the forward, so
the result is that of ``rnnt_loss`` on the materialised logits, to float rounding: this is
activation checkpointing made exact for the loss (torch.utils.checkpoint's RNG replay,
so that dropout in the joiner draws the same masks twice). Memory: the float64 lattice,
O(B T (U+1) K), plus one tile of logits and of the joiner's activations, never the
``(B, T, U+1, V)`` logits or their gradient. Time: the joiner runs forward twice (about
4/3 of a full pipeline's joiner flops), the passes over the logits are those of
``rnnt_loss``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable

import torch

from . import _backends
from ._layout import tile_node_rows, tile_plan
from ._ops import eager_under_compile, reduce_costs, refuse_double_backward, without_infinite
from .joiner import Joiner
from ._rules import device_assert, recompute_rtol, with_bad_rows
from ._validate import (LogitsSpec, Names, check_durations, check_flag, check_float,
                        check_fused_args, check_int, check_joiner_output,
                        check_multiblank_blank_id, check_reduction, check_tile,
                        check_unbatched_upstream, loss_options)
from .topology import Topology, by_name, multiblank, tdt

__all__ = ["fused_rnnt_loss", "fused_tdt_loss", "fused_multiblank_rnnt_loss", "DEFAULT_TILE"]

# One tile's logits by default, per device type, and at least DEFAULT_MIN_ROWS rows.
# CPU: 4 MiB (1k rows at V = 1000 in float32): the step's peak memory beyond the lattice is
# a few times the tile (the joiner's activations, glibc's heap). The row floor keeps the
# joiner's matrix products long enough to run at full speed at larger V: at V = 2000,
# H = 1024 the 4 MiB tile (524 rows) took 1.39x the full pipeline's time, 1024 rows (8 MiB)
# 1.29x, at 1/11 of its memory (docs/benchmarks.md, "Fused joiner and loss"). Elsewhere
# (CUDA): fewer, larger tiles, so that the host's work a tile (the joiner's calls and the
# passes' launches, 1.1-1.5 ms forward and backward on an H200) stays small beside the
# tile's GPU work. At (32, 400, 100, 1024), H = 512, bf16 on an H200
# (benchmarks/results/gpu/h200-0fd8b8d-cuda-fused-j1-bf16-*.md): 24.6 ms a step with
# 256 MiB, 26.2 with 128 MiB, 58.7 with 64, 85.2 with 32, 222 with 16 (a tile that fits
# the L2 gains nothing); the peak memory 783, 530, 404, 334 and 220 MiB.
DEFAULT_TILE = {"cpu": "4MiB", "other": "256MiB"}
DEFAULT_MIN_ROWS = 1024


def default_tile(device: torch.device) -> str:
    """The byte budget of ``tile=None`` on ``device`` (:data:`DEFAULT_TILE`)."""
    return DEFAULT_TILE.get(device.type, DEFAULT_TILE["other"])


@dataclass(frozen=True)
class _Call:
    """What the Function needs besides its tensor inputs (enc, pred, the parameters): the
    joiner, the call as ``_backends.prepare_call`` checked it, and the tile plan."""

    joiner: Callable
    prep: _backends.Prepared            # impl, checked ids and lengths, opts, boundary
    plan: list                          # the tiles (t0, t1, u0, u1)
    V: int
    dtype: torch.dtype                  # of the rows the backend reads
    inputs: frozenset                   # storages of enc, pred and the parameters
    grad_mode: bool = True              # torch.is_grad_enabled() at the call: the Function's
                                        # ctx.needs_input_grad does not see it (True under
                                        # no_grad for inputs that require grad)


class _Rng:
    """The RNG states before the forward's first joiner call (CPU, and the device's), and
    their replay around the backward's joiner calls (torch.utils.checkpoint's rule): the
    tiles run in the same order, so each draws what it drew in the forward."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.dev = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def replay(self):
        with _fork_rng(self.device):
            torch.set_rng_state(self.cpu)
            if self.dev is not None:
                torch.cuda.set_rng_state(self.dev, self.device)
            yield


def _check_not_capturing(device: torch.device) -> None:
    """RuntimeError under CUDA-graph capture: the loss reads and replays the device's RNG
    state (dropout in the joiner draws the same masks twice), which capture forbids."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the fused losses cannot be captured in a CUDA graph: they save and replay the "
            "CUDA RNG state around the joiner's recomputation (as torch.utils.checkpoint does), "
            "which graph capture forbids. Capture rnnt_loss on the materialised logits instead, "
            "or run the fused loss eagerly (docs/api.md, \"The joiner and the loss fused by tiles\")")


def _fork_rng(device: torch.device):
    """Restore the RNG states on exit (CPU, and ``device`` if CUDA)."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def _autocast_of(device: torch.device) -> dict:
    """``{device_type: torch.autocast kwargs}`` in effect now, for CPU and ``device``, with
    autocast's cache of cast weights off. The joiner runs under ``no_grad`` in the forward:
    a cast cached there has no graph, and with ``backward()`` inside the same autocast block
    the recomputation found it in the cache and reached no parameter (torch 2.9: the
    joiner's parameters got no gradient, silently)."""
    return {d: dict(enabled=torch.is_autocast_enabled(d), dtype=torch.get_autocast_dtype(d),
                    cache_enabled=False)
            for d in dict.fromkeys(("cpu", device.type))}


def _autocast(kwargs: dict) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for d, kw in kwargs.items():
        stack.enter_context(torch.autocast(d, **kw))
    return stack


def _no_autocast(device: torch.device) -> contextlib.ExitStack:
    """The backends' own passes run outside autocast (the lattice is float64)."""
    return _autocast({d: dict(enabled=False) for d in dict.fromkeys(("cpu", device.type))})


# Layers whose output at one node depends on other nodes of the batch (their statistics
# are taken over the batch and the positions): a tile would see other statistics than
# the whole lattice, and the recomputation would update running statistics again.
def _batch_coupled(m: torch.nn.Module) -> bool:
    nn = torch.nn.modules
    if isinstance(m, nn.batchnorm._BatchNorm):
        return m.training or m.running_mean is None        # batch statistics in use
    return isinstance(m, (nn.instancenorm._InstanceNorm, torch.nn.GroupNorm,
                          torch.nn.LocalResponseNorm))


def _check_per_node(joiner) -> None:
    """ValueError for a joiner with a layer that couples the nodes (:func:`_batch_coupled`):
    the fused loss needs a joiner that acts on each ``(t, u)`` independently."""
    if not isinstance(joiner, torch.nn.Module):
        return
    for name, m in joiner.named_modules():
        if _batch_coupled(m):
            raise ValueError(
                f"the joiner's layer {name or type(joiner).__name__!r} "
                f"({type(m).__name__}{', in training mode' if m.training else ''}) takes "
                "statistics over the batch and positions: the fused loss runs the joiner tile "
                "by tile, twice, so it needs a joiner that acts on each (t, u) independently "
                "(put the layer in eval mode with running statistics, use LayerNorm, or use "
                "rnnt_loss on the materialised logits)")


def _probe(joiner, enc, pred) -> torch.Tensor:
    """The joiner on one node, for V and the logits' dtype (no_grad, RNG state restored;
    zeros when there is no node, B = 0 or T = 0)."""
    if enc.shape[0] and enc.shape[1]:
        e, p = enc[:1, :1, None], pred[:1, None, :1]
    else:
        e = enc.new_zeros((1, 1, 1, enc.shape[2]))
        p = pred.new_zeros((1, 1, 1, pred.shape[2]))
    with torch.no_grad(), _fork_rng(enc.device), _autocast(_autocast_of(enc.device)):
        x = joiner(e, p)
    check_joiner_output(x, (1, 1, 1, None), tuple(e.shape), tuple(p.shape), enc.device)
    return x


def _frames_only(topology: Topology) -> bool:
    """Kinds that add ``b(t, u+1)`` read the next label position's row: whole frames."""
    return any(k.plus_next_blank for k in topology.kinds)


def _storage(x: torch.Tensor) -> int:
    return x.untyped_storage().data_ptr()


def _storages(tensors):
    """The storages of ``tensors`` that have one (a sharded DTensor parameter has none)."""
    for t in tensors:
        try:
            yield _storage(t)
        except RuntimeError:
            pass


def _fingerprint(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row sums ``(n,)`` float32 of a tile's rows (into ``out`` when given): the
    forward's and the recomputation's must agree (a deterministic joiner),
    :func:`_check_same`. The dtype is explicit and autocast is off: the forward runs under
    the caller's autocast and the check in the backward outside it, and CUDA's autocast runs
    ``sum`` in float32 (CPU's does not), so an implicit dtype would differ between the two
    passes on CUDA alone."""
    with _no_autocast(rows.device):
        if out is None:
            return rows.sum(-1, dtype=torch.float32)
        return torch.sum(rows, -1, dtype=torch.float32, out=out)


def _fingerprints(plan, B: int, device, sums: bool) -> list:
    """The forward's row sums, one slice per tile of ``plan`` (``(n,)``, n = the tile's
    nodes), all views of one float32 block made before the first tile (None each without
    ``sums``). One block, not one allocation per tile, because these outlive the forward:
    on the CPU, with one small block a tile kept until the backward, glibc's heap mostly
    stopped handing the last tile's freed logits to the next tile, and grew by a tile per
    tile (f2, H = 512: 248-382 MB of resident memory in 10 processes of 10, against 47-59
    MB; docs/benchmarks.md, "The fused step's resident memory")."""
    if not sums:
        return [None] * len(plan)
    sizes = [B * (t1 - t0) * (u1 - u0) for t0, t1, u0, u1 in plan]
    return list(torch.empty(sum(sizes), dtype=torch.float32, device=device).split(sizes))


def _check_same(before: torch.Tensor, after: torch.Tensor, dtype: torch.dtype, V: int) -> None:
    """A device-side assert (``_rules.device_assert``: no host synchronisation on CUDA, a
    RuntimeError at once on the CPU) that the recomputed tile's row sums equal the
    forward's (:func:`_fingerprint`) up to the rounding of the joiner's output ``dtype``
    (``_rules.recompute_rtol``)."""
    rtol = recompute_rtol(dtype)
    device_assert(torch.isclose(after, before, rtol=rtol, atol=rtol * V, equal_nan=True).all(),
                  "recompute")


def _backend_checks(prep) -> bool:
    """Whether the backend's ``tile_backward`` checks the recomputed rows itself (fused
    mode on the Triton backend: against the forward's normalisers, in the gradient pass),
    so that no row sums are taken here."""
    return prep.impl.CHECKS_RECOMPUTED_TILES and prep.opts.log_softmax


def _reached_leaves(x: torch.Tensor) -> list:
    """The leaves that require grad in the graph of ``x`` (its AccumulateGrad nodes)."""
    out, seen, stack = [], set(), [x.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)       # AccumulateGrad nodes hold their leaf
        if var is not None:
            out.append(var)
        stack.extend(f for f, _ in fn.next_functions)
    return out


class _FusedLoss(torch.autograd.Function):
    """Per-sequence costs ``-log P`` (B,) of the joiner's logits, tile by tile; the
    gradients w.r.t. ``enc``, ``pred`` and ``params`` (the joiner's parameters that
    require grad) by recomputing each tile (module docstring). Leaves the recomputed
    joiner reaches that are not among the inputs (FSDP2's unsharded parameters, a
    tensor a closure holds) get their gradients through autograd, as reentrant
    checkpointing gives them, after :func:`_open_backward` (under FSDP2: the same
    gradients, reduced and resharded, whichever backend runs the passes)."""

    @staticmethod
    def forward(ctx, call: _Call, enc, pred, *params):
        B, T, _ = enc.shape
        U1 = pred.shape[1]
        dev = enc.device
        prep = call.prep
        chk, opts = prep.chk, prep.opts
        need_grad = call.grad_mode and any(ctx.needs_input_grad[1:])
        sums = need_grad and not _backend_checks(prep)   # the check's row sums are ours
        ctx.rng = _Rng(dev)
        ctx.amp = _autocast_of(dev)
        state = None
        prints = _fingerprints(call.plan, B, dev, sums)
        with torch.no_grad(), _autocast(ctx.amp):          # (no cast cached: _autocast_of)
            for box, fp in zip(call.plan, prints):
                t0, t1, u0, u1 = box
                tile = tile_node_rows(B, T, U1, *box, dev)
                e, p = enc[:, t0:t1, None], pred[:, None, u0:u1]
                x = call.joiner(e, p)
                check_joiner_output(x, (B, t1 - t0, u1 - u0, call.V), tuple(e.shape),
                                    tuple(p.shape), dev)
                rows = x.reshape(-1, call.V).to(call.dtype).contiguous()
                if _storage(rows) in call.inputs:
                    rows = rows.clone()           # a view of an input: the pass writes over it
                if fp is not None:
                    _fingerprint(rows, out=fp)
                with _no_autocast(dev):
                    state = prep.impl.tile_forward(rows, tile, chk.targets, chk.logit_lengths,
                                                   chk.target_lengths, opts, prep.boundary, state)
                del x, rows
        if state is None:                         # no tile: no frame, or no sequence
            costs = torch.full((B,), float("inf"), device=dev,
                               dtype=torch.float64 if call.dtype == torch.float64 else torch.float32)
        else:
            with _no_autocast(dev):
                costs = prep.impl.tile_lattice(state, opts, need_grad)
        if need_grad:
            ctx.save_for_backward(enc, pred, *params)
            ctx.call, ctx.state, ctx.prints = call, state, prints
            ctx.infinite = None if prep.impl.ZEROES_INFINITE_COSTS else torch.isinf(costs)
        return costs

    @staticmethod
    def backward(ctx, grad_costs):
        refuse_double_backward("the fused loss")
        check_unbatched_upstream(grad_costs)
        return _FusedLoss._backward(ctx, grad_costs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def _backward(ctx, grad_costs):
        enc, pred, *params = ctx.saved_tensors
        call: _Call = ctx.call
        prep = call.prep
        wants = ctx.needs_input_grad[1:]
        grad_enc = torch.zeros_like(enc) if wants[0] else None
        grad_pred = torch.zeros_like(pred) if wants[1] else None
        grad_params = [None] * len(params)
        enc_d, pred_d = enc.detach(), pred.detach()
        trained = {id(params[i]): i for i, w in enumerate(wants[2:]) if w}
        if ctx.state is None:
            # No tile (B = 0 or T = 0): the full pipeline runs its joiner on the empty grid,
            # and every parameter that reaches gets a zero gradient (the kernel path's too;
            # DDP waits for each). So here: the joiner once on that grid, a zero gradient
            # through it (the RNG state left as it was).
            with _fork_rng(enc.device), torch.enable_grad(), _autocast(ctx.amp):
                x = call.joiner(enc_d[:, :, None], pred_d[:, None])
            if x.requires_grad:
                _tile_grads(x, torch.zeros_like(x), None, None, trained, grad_params, params)
            return (None, grad_enc, grad_pred, *grad_params)
        upstream = without_infinite(grad_costs, ctx.infinite)
        B, T, _ = enc.shape
        U1 = pred.shape[1]
        spare = None                              # a gradient buffer, when x cannot take it
        _open_backward(call.joiner, enc_d, pred_d, trained, ctx.amp, call.V)
        with ctx.rng.replay():
            for box, before in zip(call.plan, ctx.prints):
                t0, t1, u0, u1 = box
                e = enc_d[:, t0:t1].requires_grad_(wants[0])
                p = pred_d[:, u0:u1].requires_grad_(wants[1])
                saved = set()

                def pack(t):
                    saved.add(_storage(t))
                    return t

                with torch.enable_grad(), _autocast(ctx.amp), \
                        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    x = call.joiner(e[:, :, None], p[:, None])
                check_joiner_output(x, (B, t1 - t0, u1 - u0, call.V), (B, t1 - t0, 1, enc.shape[2]),
                                    (B, 1, u1 - u0, pred.shape[2]), enc.device)
                rows = _own_version(x).reshape(-1, call.V)
                rows = rows.to(call.dtype).contiguous()
                if before is not None:
                    _check_same(before, _fingerprint(rows), x.dtype, call.V)
                # The gradient goes over the recomputed logits unless the joiner's graph
                # saved them (its last op's backward reads its output: tanh, exp, ...) or
                # they are a view of an input (enc, pred, a parameter).
                if _storage(rows) not in saved and _storage(rows) not in call.inputs:
                    out = rows
                else:
                    if spare is None or spare.shape != rows.shape:
                        spare = torch.empty_like(rows)
                    out = spare
                tile = tile_node_rows(B, T, U1, *box, enc.device)
                with _no_autocast(enc.device):
                    g = prep.impl.tile_backward(rows, tile, ctx.state, upstream, prep.opts, out)
                del rows, out
                g = g.view(x.shape).to(x.dtype)
                ge, gp = _tile_grads(x, g, e if wants[0] else None, p if wants[1] else None,
                                     trained, grad_params, params)
                del x, g
                if ge is not None:
                    grad_enc[:, t0:t1] += ge
                if gp is not None:
                    grad_pred[:, u0:u1] += gp
        return (None, grad_enc, grad_pred, *grad_params)


def _own_version(x: torch.Tensor) -> torch.Tensor:
    """``x``'s memory, shape and strides as a tensor with a version counter of its own (what
    ``x.detach()`` shares with ``x``), for the gradient pass to write over. A torch op
    writing through ``x.detach()`` (the torch backend's) bumps ``x``'s version, and when ``x``
    is a view (a Linear's output on 4-D input is) autograd then rebuilds its ``grad_fn`` and
    drops the hooks registered on it, FSDP2's pre-backward hook among them, while the
    kernels' writes (Numba, Triton) leave them: what the joiner's hooks see would depend on
    the backend (issue 32). The caller writes here only when the joiner's graph saved no
    tensor on ``x``'s storage (``saved``), which is what the version check guards."""
    return torch.empty((0,), dtype=x.dtype, device=x.device).set_(
        x.untyped_storage(), x.storage_offset(), x.shape, x.stride())


def _open_backward(joiner, enc, pred, trained: dict, amp: dict, V: int) -> None:
    """Before the first tile: the joiner once on one node with autograd (the RNG state left as
    it was, the forward's autocast), and a zero gradient taken through it (discarded) to the
    leaves it reaches that are not the Function's inputs: hooks on the joiner's outputs see
    its backward begin once, before any tile is recomputed.

    FSDP2 (``fully_shard`` on the joiner or a submodule of it) is why. Its pre-backward hook
    on a module's output (``FSDPState._pre_backward``) gathers the parameters and enters
    ``PRE_BACKWARD``, where a later call of the module is activation checkpointing's
    recomputation (``FSDPState._pre_forward`` only unshards, registering no hook); its
    post-backward (``FSDPParamGroup.post_backward``: reduce-scatter, reshard) then runs
    once, from FSDP2's callback at the end of the backward. Without this call the first
    tile's recomputation is a new forward to FSDP2, which registers its post-backward hook
    on the tile's inputs; the tile's backward fires the output's hook, then that one: the
    first tile's gradients are reduced, the parameters resharded, and every later tile, a
    recomputation in ``PRE_BACKWARD``, leaves its gradients in gathered parameters that
    nothing reduces or reshards again. The inputs here do not require grad, so FSDP2
    registers no post-backward hook on them. Tensor hooks on the leaves see one zero
    gradient."""
    with _fork_rng(enc.device), torch.enable_grad(), _autocast(amp):
        e, p = enc[:1, :1, None], pred[:1, None, :1]
        x = joiner(e, p)
    check_joiner_output(x, (1, 1, 1, V), tuple(e.shape), tuple(p.shape), enc.device)
    if not x.requires_grad:
        return
    others = [v for v in _reached_leaves(x) if id(v) not in trained]
    if others:
        torch.autograd.grad(x, others, torch.zeros_like(x), allow_unused=True)


def _tile_grads(x, g, e, p, trained: dict, grad_params: list, params):
    """Backpropagate one tile's ``g = d L / d x`` through the recomputed joiner: returns the
    gradients of the tile's ``e`` and ``p`` (None where not wanted or not reached) and adds
    those of the Function's parameters into ``grad_params`` (returned by the Function, so
    that DDP's hooks see each parameter once per step). Any other leaf the joiner reached
    (FSDP2's unsharded parameters, a tensor a closure holds) gets its gradient accumulated
    by autograd (``torch.autograd.backward``), with whatever hooks it carries."""
    reached = _reached_leaves(x)
    known = [v for v in reached if id(v) in trained]
    others = [v for v in reached if id(v) not in trained and v is not e and v is not p]
    mine = [t for t in (e, p) if t is not None]
    if others:
        if known:
            grads = torch.autograd.grad(x, known, g, retain_graph=True, allow_unused=True)
            _add_param_grads(known, grads, trained, grad_params)
        # one pass for e, p and the other leaves, as a plain backward would run it
        for t in mine:
            t.grad = None
        torch.autograd.backward(x, g, inputs=mine + others)
        return (None if e is None else e.grad), (None if p is None else p.grad)
    inputs = mine + known
    if not inputs:
        return None, None
    grads = list(torch.autograd.grad(x, inputs, g, allow_unused=True))
    ge = grads.pop(0) if e is not None else None
    gp = grads.pop(0) if p is not None else None
    _add_param_grads(known, grads, trained, grad_params)
    return ge, gp


def _add_param_grads(known, grads, trained, grad_params) -> None:
    for v, gv in zip(known, grads):
        if gv is not None:
            i = trained[id(v)]
            grad_params[i] = gv if grad_params[i] is None else grad_params[i].add_(gv)


# --------------------------------------------------------------------------- kernel path
def _operand_dtype(e: torch.Tensor, p: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The dtype of the kernel path's operands: the autocast dtype under autocast (as the
    joiner's ``Linear`` would compute in it; float64 is never cast down), else the
    promotion of the projected inputs' and the weight's dtypes."""
    dtype = torch.promote_types(torch.promote_types(e.dtype, p.dtype), w.dtype)
    dev = e.device.type
    if torch.is_autocast_enabled(dev) and dtype != torch.float64:
        return torch.get_autocast_dtype(dev)
    return dtype


def _logits_dtype(joiner: Joiner, enc: torch.Tensor, pred: torch.Tensor) -> torch.dtype:
    """The dtype of a :class:`Joiner`'s logits on ``enc`` and ``pred`` (the probe's
    answer, without a call): the autocast dtype under autocast, else the promotion of the
    inputs' and the parameters' dtypes."""
    dtype = _weight_dtype(joiner.out)
    for proj, x in ((joiner.enc_proj, enc), (joiner.pred_proj, pred)):
        dtype = torch.promote_types(dtype, x.dtype)
        if isinstance(proj, torch.nn.Linear):
            dtype = torch.promote_types(dtype, _weight_dtype(proj))
    dev = enc.device.type
    if torch.is_autocast_enabled(dev) and dtype != torch.float64:
        return torch.get_autocast_dtype(dev)
    return dtype


def _weight_dtype(linear: torch.nn.Linear) -> torch.dtype:
    """The dtype of a Linear's weight, read without evaluating a parametrization of it
    (``torch.nn.utils.parametrize``): spectral norm's takes a step of power iteration at
    each evaluation in training, so the kernel path, which reads the weight once in the
    joiner's call, would take two where the joiner's own call takes one."""
    if torch.nn.utils.parametrize.is_parametrized(linear, "weight"):
        held = linear.parametrizations["weight"]
        return (held.original if hasattr(held, "original") else held.original0).dtype
    return linear.weight.dtype


class _KernelCall:
    """The kernel path of one fused-loss call: ``joiner(enc, pred, _loss=call)`` ->
    ``call(joiner, enc, pred)`` -> per-sequence costs. The joiner is called, not read, so
    that hooks on it act as on any forward (FSDP2 gathers its parameters; DDP sees them
    used). A plain object: FSDP2 and DDP rebuild the dataclasses among forward arguments."""

    __slots__ = ("prep", "rows", "drop", "grad_mode")

    def __init__(self, prep: _backends.Prepared, rows: int, drop: int):
        self.prep = prep              # the checked call
        self.rows = rows              # nodes per chunk
        self.drop = drop              # trailing classes of the joiner not in the loss (TDT's omega)
        self.grad_mode = torch.is_grad_enabled()   # (as _Call's)

    def __call__(self, joiner: Joiner, enc, pred):
        e, p = joiner.enc_proj(enc), joiner.pred_proj(pred)        # (B, T, H), (B, U+1, H)
        w, b = joiner.out.weight, joiner.out.bias                  # (V, H), (V,)
        if self.drop:
            w, b = w[:-self.drop], None if b is None else b[:-self.drop]
        _check_projected(e, p, w, b, enc, pred, self.prep.chk.logits.shape[-1])
        return _JointLoss.apply(self, joiner.activation, e, p, w, b)


def _check_projected(e, p, w, b, enc, pred, V: int) -> None:
    """The kernel path's operands as its kernels index them: ``e`` ``(B, T, H)`` and ``p``
    ``(B, U+1, H)`` of ``enc``'s and ``pred``'s first two sizes, ``w`` ``(V, H)``, ``b``
    ``(V,)``, one H (the joiner's own call would fail on another; the kernels would read
    past rows or frames without a word). A ValueError naming the joiner's parts."""
    ok = (isinstance(e, torch.Tensor) and isinstance(p, torch.Tensor) and e.dim() == 3
          and p.dim() == 3 and w.dim() == 2 and e.shape[:2] == enc.shape[:2]
          and p.shape[:2] == pred.shape[:2] and e.shape[2] == p.shape[2] == w.shape[1]
          and w.shape[0] == V and (b is None or tuple(b.shape) == (V,)))
    if ok and not torch.is_autocast_enabled(e.device.type):
        # The joiner's own out(act(e + p)) outside autocast: a Linear on another dtype fails.
        hidden = torch.promote_types(e.dtype, p.dtype)
        if hidden != w.dtype:
            raise ValueError(f"joiner: act(enc_proj(enc) + pred_proj(pred)) is {hidden} and "
                             f"out.weight {w.dtype}: the joiner's own out would refuse them "
                             f"outside torch.autocast (cast enc and pred, or the joiner)")
    if not ok:
        shape = lambda x: tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__  # noqa: E731
        raise ValueError(
            f"joiner: the kernel path needs enc_proj(enc) (B, T, H) = ({enc.shape[0]}, "
            f"{enc.shape[1]}, H), pred_proj(pred) (B, U+1, H) = ({pred.shape[0]}, "
            f"{pred.shape[1]}, H), out.weight (V, H) = ({V}, H) and out.bias (V,) of one H, "
            f"got {shape(e)}, {shape(p)}, {tuple(w.shape)} and "
            f"{None if b is None else tuple(b.shape)} (V from out.out_features)")


class _JointLoss(torch.autograd.Function):
    """Per-sequence costs ``-log P`` (B,) of the logits ``W act(e + p) + b`` of projected
    inputs ``e (B, T, H)``, ``p (B, U+1, H)``, computed by the Triton kernels without the
    logits (``gpu.joint``, math.md section 12), and their gradients w.r.t. ``e``, ``p``,
    ``W`` and ``b``. The operands take the autocast dtype of the forward (the AMP recipe
    runs the backward outside autocast, in the same dtype); gradients come back in the
    inputs' dtypes."""

    @staticmethod
    def forward(ctx, call: _KernelCall, act: str, e, p, w, b):
        from .gpu import joint
        prep = call.prep
        chk = prep.chk
        dtype = _operand_dtype(e, p, w)
        ops = [None if x is None else x.detach().to(dtype).contiguous() for x in (e, p, w, b)]
        need_grad = call.grad_mode and any(ctx.needs_input_grad[2:])
        with torch.no_grad(), _no_autocast(e.device):
            costs, state = joint.forward(*ops, act, chk.targets, chk.logit_lengths,
                                         chk.target_lengths, prep.opts, prep.boundary,
                                         need_grad, call.rows)
        if need_grad:
            ctx.save_for_backward(*ops[:3], *ops[3:] if b is not None else ())
            ctx.state, ctx.opts = state, prep.opts
            ctx.dtypes = tuple(None if x is None else x.dtype for x in (e, p, w, b))
            ctx.infinite = torch.isinf(costs)
        return costs

    @staticmethod
    def backward(ctx, grad_costs):
        refuse_double_backward("the fused loss")
        check_unbatched_upstream(grad_costs)
        return _JointLoss._backward(ctx, grad_costs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def _backward(ctx, grad_costs):
        from .gpu import joint
        e, p, w, *b = ctx.saved_tensors
        b = b[0] if b else None
        upstream = without_infinite(grad_costs, ctx.infinite)
        with torch.no_grad(), _no_autocast(e.device):
            grads = joint.backward(ctx.state, e, p, w, b, upstream, ctx.opts)
        return (None, None) + tuple(
            None if g is None or not want else g.to(dtype)
            for g, want, dtype in zip(grads, ctx.needs_input_grad[2:], ctx.dtypes))


def _kernel_path(joiner, prep: _backends.Prepared, as_written: bool) -> bool:
    """Whether the call takes the kernel path: a :class:`Joiner` without dropout at work,
    on the Triton backend, whose output layer is not sharded apart from it (the kernels
    read its weights inside the joiner's forward, where FSDP2 has gathered the joiner's
    own parameters but not those of a submodule with ``fully_shard`` of its own), with
    operands the compiled kernels take on a GPU (``gpu.joint.takes``: half, and float32
    with TF32 products; float32 with IEEE products and float64 take the tile path, whose
    products are cuBLAS's); the interpreter runs every dtype, which is how the tests hold
    the kernels to float64's precision. And only a joiner that computes what the kernels
    read (``as_written``: :func:`_as_written`'s answer, or False for any other joiner): a
    hook on its output, a subclass's own forward, an adapter around ``out`` take the tile
    path, which calls the joiner."""
    if not (as_written and prep.impl.NAME == "triton" and joiner.kernel_ready
            and not _sharded_apart(joiner.out)):
        return False
    from .gpu import joint
    return prep.impl.INTERPRETED or joint.takes(prep.chk.logits.dtype)


def _as_written(joiner: Joiner) -> bool:
    """Whether calling ``joiner`` computes what the kernel path reads in its place:
    ``Joiner``'s own ``forward``, ``act`` and ``__call__`` (not a subclass's nor an
    instance's; the activation one the kernels know), ``out`` a Linear that runs as one
    (``weight`` and ``bias`` are all the kernels read: an adapter such as LoRA's, a
    subclass's or an instance's own ``forward`` or ``__call__`` would be skipped),
    ``dropout`` a Dropout, and no hook that would see or change their outputs or
    gradients: none on ``out`` and ``dropout``, no backward hook on the joiner and no
    forward hook but FSDP2's (the kernel path calls the joiner, whose output is then the
    costs, not the logits), no global one. The projections are called
    as modules on both paths: anything goes there."""
    cls, out, drop = type(joiner), joiner.out, joiner.dropout
    nn = torch.nn
    if not (cls.forward is Joiner.forward and cls.act is Joiner.act
            and joiner.activation in ("tanh", "relu")
            and isinstance(out, nn.Linear) and type(out).forward is nn.Linear.forward
            and type(drop).forward is nn.Dropout.forward
            and all(type(m).__call__ is nn.Module.__call__ for m in (joiner, out, drop))
            and not any(name in vars(m) for m in (joiner, out, drop)
                        for name in ("forward", "act", "__call__"))):
        return False
    hooks = nn.modules.module
    if (hooks._global_forward_hooks or hooks._global_forward_pre_hooks
            or hooks._global_backward_hooks or hooks._global_backward_pre_hooks):
        return False
    if any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
           or m._backward_pre_hooks for m in (out, drop)):
        return False
    return (not (joiner._backward_hooks or joiner._backward_pre_hooks)
            and all(_distributed(h) for h in joiner._forward_hooks.values()))


def _distributed(hook) -> bool:
    """Whether a module hook is torch.distributed's own (FSDP2's after its forward)."""
    module = getattr(getattr(hook, "func", hook), "__module__", None)   # (a partial's func)
    return isinstance(module, str) and module.startswith("torch.distributed.")


def _sharded_apart(module: torch.nn.Module) -> bool:
    """Whether FSDP2's ``fully_shard`` was applied to ``module`` itself."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:                           # a torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def _params(joiner) -> tuple:
    """The joiner's parameters that require grad (an ``nn.Module``; none otherwise)."""
    if isinstance(joiner, torch.nn.Module):
        return tuple(p for p in joiner.parameters() if p.requires_grad)
    return ()


def _fused_loss_eager(joiner, enc, pred, targets, logit_lengths, target_lengths, blank,
                      topology, frames_only, params, *, tile, clamp, reduction, fused,
                      fastemit_lambda, zero_infinity, backend, sigma=0.0, delay_penalty=0.0,
                      boundary=None, allow_blank_targets=False, drop=0) -> torch.Tensor:
    """check (``_backends.prepare_call`` on the caller's ``enc``, ``pred`` and lengths,
    with the V of one probe call, or of a :class:`Joiner`'s output layer) -> the kernel
    path (a :class:`Joiner` on the Triton backend: ``_JointLoss``) or the tile plan and
    ``_FusedLoss`` -> zero_infinity -> reduce; shared by the fused losses. ``drop``: the
    joiner's last ``drop`` classes are not the loss's (TDT's omega: the token logits)."""
    check_fused_args(joiner, enc, pred)
    _check_not_capturing(enc.device)
    rows, nbytes = check_tile(default_tile(enc.device) if tile is None else tile)
    check_reduction(reduction)
    _backends.check_name(backend)
    opts = loss_options(check_flag("fused_log_softmax", fused), False, by_name("regular"),
                        clamp, fastemit_lambda, sigma, delay_penalty)
    zero_infinity = check_flag("zero_infinity", zero_infinity)
    _check_per_node(joiner)
    as_written = isinstance(joiner, Joiner) and _as_written(joiner)
    if as_written:                                  # V and dtype without a call
        _check_joiner_widths(joiner, enc, pred)
        V, dtype = joiner.out.out_features - drop, _logits_dtype(joiner, enc, pred)
    else:
        x = _probe(joiner if not drop else _dropping(joiner, drop), enc, pred)
        V, dtype = x.shape[-1], x.dtype
        del x
    B, T, _ = enc.shape
    U1 = pred.shape[1]
    shape = (B, T, U1, V)
    opts = replace(opts, topology=topology(shape))
    names = Names(spec=f"the joiner's logits (B, T, U+1, V) = {shape}", B=("enc", enc),
                  T=("enc", enc), U=("pred", pred))
    prep = _backends.prepare_call(LogitsSpec(shape, dtype, enc.device), targets,
                                  logit_lengths, target_lengths, blank, backend, opts,
                                  boundary=boundary, allow_blank_targets=allow_blank_targets,
                                  names=names)
    if rows is None:
        rows = max(1, DEFAULT_MIN_ROWS if tile is None else 1, nbytes // (V * dtype.itemsize))
    if _kernel_path(joiner, prep, as_written):
        costs = joiner(enc, pred, _loss=_KernelCall(prep, rows, drop))
    else:
        if drop:
            joiner = _dropping(joiner, drop)
        inputs = frozenset(_storages((enc, pred, *params)))
        call = _Call(joiner, prep, tile_plan(B, T, U1, rows, frames_only), V,
                     prep.chk.logits.dtype, inputs, torch.is_grad_enabled())
        costs = _FusedLoss.apply(call, enc, pred, *params)
    return reduce_costs(with_bad_rows(costs, prep.nan_rows), reduction, zero_infinity)


# A graph break under ``torch.compile`` (the joiner is called inside the Function).
_fused_loss = eager_under_compile(
    _fused_loss_eager, "rnnt_lattice's fused losses call the joiner tile by tile inside "
    "their autograd Function: they run eagerly, a graph break; compile without "
    "fullgraph=True")


def _dropping(joiner, drop: int):
    """``joiner`` without its last ``drop`` classes (TDT's omega: the token logits)."""
    return lambda e, p: joiner(e, p)[..., :-drop]


def _check_joiner_widths(joiner: Joiner, enc, pred) -> None:
    """ValueError unless ``enc`` and ``pred`` are as wide as the :class:`Joiner` takes: a
    Linear projection's ``in_features``, the hidden width without one (Identity); another
    module in a projection's place says its own width when it runs."""
    for name, x, proj in (("enc", enc, joiner.enc_proj), ("pred", pred, joiner.pred_proj)):
        if isinstance(proj, torch.nn.Linear):
            want, what = proj.in_features, f"its projection {name}_proj takes (in_features)"
        elif isinstance(proj, torch.nn.Identity):
            want, what = joiner.out.in_features, ("its hidden width (no projection: "
                                                   "out.in_features)")
        else:
            continue
        if x.shape[-1] != want:
            axes = "(B, T, H_enc)" if name == "enc" else "(B, U+1, H_pred)"
            raise ValueError(f"{name} {tuple(x.shape)} has {x.shape[-1]} features (its last "
                             f"axis), the joiner takes {want}, {what}: {name} is {axes}")


def _fixed(topo: Topology) -> tuple:
    """``(topology of the logits' shape, frames_only)`` of a topology known beforehand."""
    return (lambda shape: topo), _frames_only(topo)


def fused_rnnt_loss(
    joiner: Callable,
    enc: torch.Tensor,
    pred: torch.Tensor,
    targets: torch.Tensor,
    logit_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    *,
    blank: int,
    tile=None,
    clamp: float = -1.0,
    reduction: str = "mean",
    fused_log_softmax: bool = True,
    fastemit_lambda: float = 0.0,
    zero_infinity: bool = False,
    backend: str = "auto",
    rnnt_type: str = "regular",
    delay_penalty: float = 0.0,
    boundary: torch.Tensor | None = None,
    allow_blank_targets: bool = False,
) -> torch.Tensor:
    r""":func:`rnnt_loss` of ``joiner(enc[:, :, None], pred[:, None])`` without the
    ``(B, T, U+1, V)`` logits: the joiner runs tile by tile, forward under
    ``torch.no_grad`` and again with autograd in the backward pass (math.md section 11);
    an :class:`rnnt_lattice.Joiner` on the Triton backend takes the kernel path instead,
    the logits computed block by block in registers and never in memory (math.md section
    12, docs/api.md "The joiner the kernels know"; on a GPU with half operands, or float32
    ones with TF32 products). Same loss and gradients (w.r.t.
    ``enc``, ``pred`` and the joiner's parameters) as :func:`rnnt_loss` on the
    materialised logits, to float rounding.

    Example::

        >>> import torch, rnnt_lattice
        >>> B, T, U, H, V = 2, 12, 4, 16, 10
        >>> class Joiner(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.enc, self.pred = torch.nn.Linear(H, H), torch.nn.Linear(H, H)
        ...         self.out = torch.nn.Linear(H, V)
        ...     def forward(self, e, p):                  # (B, t, 1, H), (B, 1, u, H)
        ...         return self.out(torch.tanh(self.enc(e) + self.pred(p)))
        >>> joiner = Joiner()
        >>> enc = torch.randn(B, T, H, requires_grad=True)
        >>> pred = torch.randn(B, U + 1, H, requires_grad=True)
        >>> targets = torch.randint(1, V, (B, U))
        >>> T_b, U_b = torch.tensor([12, 9]), torch.tensor([4, 3])
        >>> loss = rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, T_b, U_b, blank=0,
        ...                                     tile=20)        # 20 logits rows per tile
        >>> loss.backward()                                    # enc.grad, pred.grad, joiner's .grad
        >>> full = rnnt_lattice.rnnt_loss(joiner(enc[:, :, None], pred[:, None]), targets,
        ...                               T_b, U_b, blank=0)
        >>> bool(torch.allclose(loss, full))
        True

    Args:
        joiner: a callable (typically an ``nn.Module``) mapping ``enc[:, t0:t1, None]``
            ``(B, t1-t0, 1, H_enc)`` and ``pred[:, None, u0:u1]`` ``(B, 1, u1-u0, H_pred)``
            to logits ``(B, t1-t0, u1-u0, V)``, acting on each ``(t, u)`` independently:
            a layer that takes statistics over the batch or the positions (BatchNorm in
            training mode, InstanceNorm, GroupNorm) is a ValueError. The parameters of an
            ``nn.Module`` that require grad get their gradients returned by the loss's
            Function (DDP's hooks see each once); any other trainable tensor the joiner
            reaches (FSDP2's unsharded parameters, a tensor held by a closure) gets its
            gradient accumulated by autograd, as reentrant checkpointing gives it. It is
            called once on one node before any tile (to learn V and the logits' dtype;
            no_grad, RNG state restored), then twice per tile (forward, and again in the
            backward pass with the forward's RNG state and autocast: dropout is replayed
            exactly), and once more on one node with autograd when the backward pass
            begins (so that FSDP2 sees one backward of the joiner, whichever backend). The recomputation must give the forward's logits
            (``torch.utils.checkpoint``'s rule: deterministic given the inputs and the RNG
            state); each recomputed tile is checked against the forward's (on the Triton
            backend in fused mode, every row's softmax under the forward's normaliser must
            still sum to one, checked in the gradient pass; elsewhere the rows' sums are
            compared), and a difference beyond rounding is a RuntimeError (a device-side
            assert on CUDA). An output that is a view of ``enc``, ``pred`` or a parameter is copied
            before the passes write over it. Logits that are not floating, of the tile's
            shape, on the device of ``enc`` and ``pred`` (not the meta device, not another
            GPU) are a ValueError naming the joiner.
        enc: ``(B, T, H_enc)`` encoder output. pred: ``(B, U+1, H_pred)`` prediction
            network output. Either may or may not require grad.
        targets, logit_lengths, target_lengths: as :func:`rnnt_loss` (``T = enc.shape[1]``,
            ``U = pred.shape[1] - 1``).
        tile: the size of a tile (the kernel path: of a chunk, whose logits' gradient the
            backward holds): an int, the number of lattice nodes (logits rows) per
            tile, or a byte budget of one tile's logits as a string such as ``"64MiB"`` or
            ``"1GB"`` (units B, KB, MB, GB, KiB, MiB, GiB); None (the default):
            ``"4MiB"`` on CPU, ``"256MiB"`` on other devices (:data:`DEFAULT_TILE`), and
            at least 1024 rows (:data:`DEFAULT_MIN_ROWS`). A smaller tile holds less
            memory and costs time: each tile costs the host its joiner's calls and the
            passes' launches, forward and backward (about 1.1-1.5 ms a tile on an H200),
            and a tile with less GPU work than that leaves the GPU waiting (at
            (32, 400, 100, 1024), H = 512, bf16: 24.6 ms a step with 256 MiB tiles, 26.2
            with 128 MiB, 58.7 with 64 MiB; docs/benchmarks.md).
            Tiles are whole frames, ``max(1, rows // (B (U+1)))`` of them; when one frame
            is larger, one frame cut into runs of ``max(1, rows // B)`` label positions (not for
            ``rnnt_type="constrained"``, whose label arcs read the next position's blank:
            one frame is its smallest tile). The plan comes from the shapes only: no host
            synchronisation.
        blank, clamp, reduction, fused_log_softmax, fastemit_lambda, zero_infinity,
            backend, rnnt_type, delay_penalty, boundary, allow_blank_targets: as
            :func:`rnnt_loss`. (``inplace_grad`` and ``packed`` concern a logits tensor
            the caller holds, which does not exist here: each tile's gradient is always
            written over its recomputed logits where the joiner's graph allows.)

    Under ``torch.autocast`` the joiner runs in the autocast dtype (its bfloat16/float16
    logits are read in float32 by the CPU and torch backends, natively by Triton), the
    loss is float32 and the lattice float64. Under ``torch.compile`` the call is a graph
    break (``torch.compiler.disable``). It cannot be captured in a CUDA graph (it saves and
    replays the CUDA RNG state): a RuntimeError says so. A double backward
    (``create_graph=True``) is a RuntimeError. Every argument is checked before any tile
    runs (``_backends.prepare_call``, messages naming ``enc`` and ``pred``), also with
    ``T = 0`` or ``B = 0``. Memory: the lattice, ``O(B T (U+1) K)`` float64, plus one tile
    of logits and joiner activations (math.md section 11).

    Returns:
        The reduced loss, or ``(B,)`` per-sequence losses for ``"none"`` (float32; float64
        when the logits are float64).
    """
    topo = by_name(rnnt_type)
    return _fused_loss(joiner, enc, pred, targets, logit_lengths, target_lengths, blank,
                       *_fixed(topo), _params(joiner), tile=tile, clamp=clamp,
                       reduction=reduction, fused=fused_log_softmax,
                       fastemit_lambda=fastemit_lambda, zero_infinity=zero_infinity,
                       backend=backend, delay_penalty=delay_penalty, boundary=boundary,
                       allow_blank_targets=allow_blank_targets)


def fused_tdt_loss(
    joiner: Callable,
    enc: torch.Tensor,
    pred: torch.Tensor,
    targets: torch.Tensor,
    logit_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    *,
    blank: int,
    durations,
    tile=None,
    sigma: float = 0.0,
    omega: float = 0.0,
    reduction: str = "mean",
    fastemit_lambda: float = 0.0,
    clamp: float = -1.0,
    zero_infinity: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    r""":func:`tdt_loss` of ``joiner(enc[:, :, None], pred[:, None])`` (logits ``(B, T,
    U+1, V_tok + len(durations))``) tile by tile, as :func:`fused_rnnt_loss`.

    Example::

        >>> import torch, rnnt_lattice
        >>> joiner = lambda e, p: e + p                       # (B, t, 1, V) + (B, 1, u, V)
        >>> enc = torch.randn(2, 6, 5 + 3, requires_grad=True)   # 5 tokens, 3 durations
        >>> pred = torch.randn(2, 3, 5 + 3, requires_grad=True)
        >>> loss = rnnt_lattice.fused_tdt_loss(joiner, enc, pred, torch.tensor([[1, 2], [3, 0]]),
        ...                                    torch.tensor([6, 4]), torch.tensor([2, 1]),
        ...                                    blank=4, durations=[0, 1, 2], tile=7)
        >>> loss.backward()

    Args:
        joiner, enc, pred, tile: as :func:`fused_rnnt_loss`.
        the rest: as :func:`tdt_loss` (``omega``: with that probability the call is the
            regular loss of the token logits).
    """
    durations = check_durations("durations", durations, minimum=0, ascending=True)
    omega = check_float("omega", omega)
    params = _params(joiner)
    if omega > 0.0 and float(torch.rand(())) < omega:
        # NeMo's omega: the standard RNN-T loss of the token logits for this call.
        return _fused_loss(joiner, enc, pred, targets, logit_lengths, target_lengths, blank,
                           *_fixed(by_name("regular")), params, tile=tile, clamp=clamp,
                           reduction=reduction, fused=True, fastemit_lambda=fastemit_lambda,
                           zero_infinity=zero_infinity, backend=backend,
                           drop=len(durations))
    return _fused_loss(joiner, enc, pred, targets, logit_lengths, target_lengths, blank,
                       *_fixed(tdt(durations)), params, tile=tile, clamp=clamp,
                       reduction=reduction, fused=True, fastemit_lambda=fastemit_lambda,
                       zero_infinity=zero_infinity, backend=backend, sigma=sigma)


def fused_multiblank_rnnt_loss(
    joiner: Callable,
    enc: torch.Tensor,
    pred: torch.Tensor,
    targets: torch.Tensor,
    logit_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    *,
    blank: int,
    big_blank_durations,
    tile=None,
    sigma: float = 0.0,
    reduction: str = "mean",
    fastemit_lambda: float = 0.0,
    clamp: float = -1.0,
    zero_infinity: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    r""":func:`multiblank_rnnt_loss` of ``joiner(enc[:, :, None], pred[:, None])`` tile by
    tile, as :func:`fused_rnnt_loss`.

    Example::

        >>> import torch, rnnt_lattice
        >>> joiner = lambda e, p: e + p                       # (B, t, 1, V) + (B, 1, u, V)
        >>> enc = torch.randn(2, 8, 7, requires_grad=True)    # 4 labels, 2 big blanks, blank
        >>> pred = torch.randn(2, 3, 7, requires_grad=True)
        >>> loss = rnnt_lattice.fused_multiblank_rnnt_loss(
        ...     joiner, enc, pred, torch.tensor([[1, 2], [3, 0]]), torch.tensor([8, 5]),
        ...     torch.tensor([2, 1]), blank=6, big_blank_durations=[2, 4], tile=9)
        >>> loss.backward()

    Args:
        joiner, enc, pred, tile: as :func:`fused_rnnt_loss`.
        the rest: as :func:`multiblank_rnnt_loss`.
    """
    durations = check_durations("big_blank_durations", big_blank_durations, minimum=2,
                                ascending=False)
    blank = check_int("blank", blank)

    def topology(shape):                          # the blank's id: known with V
        return multiblank(check_multiblank_blank_id(shape, blank, durations,
                                                    "the joiner's logits"), durations)

    return _fused_loss(joiner, enc, pred, targets, logit_lengths, target_lengths, blank,
                       topology, False, _params(joiner), tile=tile, clamp=clamp, reduction=reduction,
                       fused=True, fastemit_lambda=fastemit_lambda, zero_infinity=zero_infinity,
                       backend=backend, sigma=sigma)
