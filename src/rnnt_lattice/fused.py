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
    backward  for each tile:  x = joiner(...) again, with autograd (RNG and autocast replayed)
                              g = upstream[b] * d cost_b / d x  (gradient pass, over x itself)
                              torch.autograd.grad(x, [enc, pred, *params], g), accumulated

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
from typing import Callable, Optional

import torch

from . import _backends
from ._layout import Tile, tile_node_rows, tile_plan
from ._ops import reduce_costs, without_infinite
from ._types import LossOptions
from ._validate import (check_boundary, check_class_targets, check_durations, check_float,
                        check_fused_args, check_int, check_joiner_output,
                        check_multiblank_blank_id, check_reduction, check_tile)
from .topology import Topology, by_name, multiblank, regular, tdt

__all__ = ["fused_rnnt_loss", "fused_tdt_loss", "fused_multiblank_rnnt_loss", "DEFAULT_TILE"]

# One tile's logits by default, per device type, and at least DEFAULT_MIN_ROWS rows.
# CPU: 4 MiB (1k rows at V = 1000 in float32): the step's peak memory beyond the lattice is
# a few times the tile (the joiner's activations, glibc's heap). The row floor keeps the
# joiner's matrix products long enough to run at full speed at larger V: at V = 2000,
# H = 1024 the 4 MiB tile (524 rows) took 1.39x the full pipeline's time, 1024 rows (8 MiB)
# 1.29x, at 1/11 of its memory (docs/benchmarks.md, "Fused joiner and loss"). Elsewhere
# (CUDA): fewer, larger tiles, so that the launches of a tile's joiner and passes stay
# small beside its work (not yet measured on a GPU).
DEFAULT_TILE = {"cpu": "4MiB", "other": "256MiB"}
DEFAULT_MIN_ROWS = 1024


def default_tile(device: torch.device) -> str:
    """The byte budget of ``tile=None`` on ``device`` (:data:`DEFAULT_TILE`)."""
    return DEFAULT_TILE.get(device.type, DEFAULT_TILE["other"])


@dataclass(frozen=True)
class _Call:
    """What the Function needs besides its tensor inputs (enc, pred, the parameters)."""

    joiner: Callable
    targets: torch.Tensor
    logit_lengths: torch.Tensor
    target_lengths: torch.Tensor
    boundary: Optional[torch.Tensor]
    blank: int
    topology: Callable[[tuple], Topology]   # of the logits' shape (multi-blank: V - 1)
    frames_only: bool                       # whole-frame tiles (``_frames_only``)
    opts: LossOptions                       # blank and topology set from the first tile
    backend: str
    rows: Optional[int]                     # rows per tile, or
    nbytes: Optional[int]                   # a byte budget of one tile's logits,
    min_rows: int                           # with at least these rows (the default tile)
    allow_blank_targets: bool


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


def _fork_rng(device: torch.device):
    """Restore the RNG states on exit (CPU, and ``device`` if CUDA)."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def _autocast_of(device: torch.device) -> dict:
    """``{device_type: torch.autocast kwargs}`` in effect now, for CPU and ``device``."""
    return {d: dict(enabled=torch.is_autocast_enabled(d), dtype=torch.get_autocast_dtype(d),
                    cache_enabled=torch.is_autocast_cache_enabled())
            for d in dict.fromkeys(("cpu", device.type))}


def _autocast(kwargs: dict) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for d, kw in kwargs.items():
        stack.enter_context(torch.autocast(d, **kw))
    return stack


def _no_autocast(device: torch.device) -> contextlib.ExitStack:
    """The backends' own passes run outside autocast (the lattice is float64)."""
    return _autocast({d: dict(enabled=False) for d in dict.fromkeys(("cpu", device.type))})


def _plan(call: _Call, joiner_args, B: int, T: int, U1: int, frames_only: bool) -> list:
    """The tiles ``(t0, t1, u0, u1)``. A byte budget needs V and the logits' element size:
    the joiner is called once on one node for them (no_grad, RNG state restored)."""
    rows = call.rows
    if rows is None:
        if B * T == 0:
            return []
        enc, pred = joiner_args
        with torch.no_grad(), _fork_rng(enc.device):
            x = call.joiner(enc[:1, :1, None], pred[:1, None, :1])
        check_joiner_output(x, (1, 1, 1, None), (1, 1, 1, enc.shape[2]),
                            (1, 1, 1, pred.shape[2]))
        rows = max(1, call.min_rows, call.nbytes // (x.shape[-1] * x.element_size()))
    return tile_plan(B, T, U1, rows, frames_only)


def _frames_only(topology: Topology) -> bool:
    """Kinds that add ``b(t, u+1)`` read the next label position's row: whole frames."""
    return any(k.plus_next_blank for k in topology.kinds)


class _FusedLoss(torch.autograd.Function):
    """Per-sequence costs ``-log P`` (B,) of the joiner's logits, tile by tile; the
    gradients w.r.t. ``enc``, ``pred`` and ``params`` (the joiner's parameters that
    require grad) by recomputing each tile (module docstring)."""

    @staticmethod
    def forward(ctx, call: _Call, enc, pred, *params):
        B, T, _ = enc.shape
        U1 = pred.shape[1]
        dev = enc.device
        need_grad = any(ctx.needs_input_grad[1:])
        plan = _plan(call, (enc, pred), B, T, U1, call.frames_only)
        ctx.rng = _Rng(dev)
        ctx.amp = _autocast_of(dev)
        impl = state = opts = dtype = None
        V = None
        bnd = None
        with torch.no_grad():
            for box in plan:
                t0, t1, u0, u1 = box
                tile = tile_node_rows(B, T, U1, *box, dev)
                e, p = enc[:, t0:t1, None], pred[:, None, u0:u1]
                x = call.joiner(e, p)
                check_joiner_output(x, (B, t1 - t0, u1 - u0, V), tuple(e.shape), tuple(p.shape))
                if impl is None:                  # the first tile: V, the checks, the backend
                    V = x.shape[-1]
                    impl, chk, opts = _first_tile(call, x, tile)
                    targets, lt, ul = chk.targets, chk.logit_lengths, chk.target_lengths
                    bnd = check_boundary(call.boundary, B, dev, lt, ul)
                    rows = chk.logits
                    dtype = rows.dtype
                else:
                    rows = x.reshape(-1, V).to(dtype).contiguous()
                with _no_autocast(dev):
                    state = impl.tile_forward(rows, tile, targets, lt, ul, opts, bnd, state)
                del x, rows
        if impl is None:                          # no tile: no frame, or no sequence
            costs = torch.full((B,), float("inf"), device=dev,
                               dtype=torch.float64 if enc.dtype == torch.float64 else torch.float32)
        else:
            with _no_autocast(dev):
                costs = impl.tile_lattice(state, opts, need_grad)
        if need_grad:
            ctx.save_for_backward(enc, pred, *params)
            ctx.call, ctx.plan, ctx.impl, ctx.state, ctx.opts = call, plan, impl, state, opts
            ctx.V, ctx.dtype = V, dtype
            ctx.infinite = torch.isinf(costs)
        return costs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_costs):
        enc, pred, *params = ctx.saved_tensors
        wants = ctx.needs_input_grad[1:]
        grad_enc = torch.zeros_like(enc) if wants[0] else None
        grad_pred = torch.zeros_like(pred) if wants[1] else None
        grad_params = [None] * len(params)
        if ctx.impl is None:
            return (None, grad_enc, grad_pred, *grad_params)
        upstream = without_infinite(grad_costs, ctx.infinite)
        enc_d, pred_d = enc.detach(), pred.detach()
        B, T, _ = enc.shape
        U1 = pred.shape[1]
        trained = [i for i, w in enumerate(wants[2:]) if w]
        spare = None                              # a gradient buffer, when x cannot take it
        with ctx.rng.replay():
            for box in ctx.plan:
                t0, t1, u0, u1 = box
                e = enc_d[:, t0:t1].requires_grad_(wants[0])
                p = pred_d[:, u0:u1].requires_grad_(wants[1])
                saved = set()

                def pack(t):
                    saved.add(t.untyped_storage().data_ptr())
                    return t

                with torch.enable_grad(), _autocast(ctx.amp), \
                        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    x = ctx.call.joiner(e[:, :, None], p[:, None])
                check_joiner_output(x, (B, t1 - t0, u1 - u0, ctx.V), (B, t1 - t0, 1, enc.shape[2]),
                                    (B, 1, u1 - u0, pred.shape[2]))
                inputs = ([e] if wants[0] else []) + ([p] if wants[1] else []) + \
                    [params[i] for i in trained]
                if box is ctx.plan[0]:
                    _check_leaves(x, inputs)
                rows = x.detach().reshape(-1, ctx.V)
                # The gradient goes over the recomputed logits unless the joiner's graph
                # saved them (its last op's backward reads its output: tanh, exp, ...).
                own = rows.dtype != ctx.dtype or not rows.is_contiguous()
                rows = rows.to(ctx.dtype).contiguous()
                if own or x.untyped_storage().data_ptr() not in saved:
                    out = rows
                else:
                    if spare is None or spare.shape != rows.shape:
                        spare = torch.empty_like(rows)
                    out = spare
                tile = tile_node_rows(B, T, U1, *box, enc.device)
                with _no_autocast(enc.device):
                    g = ctx.impl.tile_backward(rows, tile, ctx.state, upstream, ctx.opts, out)
                grads = torch.autograd.grad(x, inputs, g.view(x.shape).to(x.dtype),
                                            allow_unused=True)
                del x, rows, g
                grads = list(grads)
                if wants[0]:
                    grad_enc[:, t0:t1] += grads.pop(0)
                if wants[1]:
                    grad_pred[:, u0:u1] += grads.pop(0)
                for i, gi in zip(trained, grads):
                    if gi is not None:
                        grad_params[i] = gi if grad_params[i] is None else grad_params[i].add_(gi)
        return (None, grad_enc, grad_pred, *grad_params)


def _first_tile(call: _Call, x: torch.Tensor, tile: Tile):
    """The first tile's logits ``x (B, t1-t0, u1-u0, V)``: the topology (of V), the
    argument checks of ``rnnt_loss`` on its rows (``_backends.prepare`` with the tile's
    layout: shapes, dtypes, devices, lengths and targets), the backend.
    Returns ``(impl, chk, opts)``, ``chk.logits`` the rows the backend reads."""
    V = x.shape[-1]
    topo = call.topology(tuple(x.shape))
    n_tokens = topo.token_classes(V) if topo.n_durations else None
    if n_tokens is not None and n_tokens < 1:
        topo.check(V, call.blank)                 # names the missing token classes
    impl, chk = _backends.prepare(x.reshape(-1, V), call.targets, call.logit_lengths,
                                  call.target_lengths, call.blank, call.backend,
                                  n_tokens=n_tokens, node_rows=tile.node_rows,
                                  allow_blank_targets=call.allow_blank_targets)
    topo.check(V, chk.blank)
    check_class_targets(chk.targets, chk.target_lengths, topo)
    return impl, chk, replace(call.opts, blank=chk.blank, topology=topo)


def _check_leaves(x: torch.Tensor, inputs: list) -> None:
    """RuntimeError if the joiner's graph reaches a tensor that requires grad but is not
    among ``inputs`` (``enc``, ``pred``, the parameters of an ``nn.Module`` joiner): its
    gradient would be lost silently."""
    known = {id(t) for t in inputs}
    seen, stack = set(), [x.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)       # AccumulateGrad nodes hold their leaf
        if var is not None and id(var) not in known:
            raise RuntimeError(
                f"the joiner uses a tensor of shape {tuple(var.shape)} that requires grad but "
                "is not a parameter of the joiner: pass the joiner as an nn.Module holding it "
                "(its parameters are the ones that get gradients)")
        stack.extend(f for f, _ in fn.next_functions)


def _params(joiner) -> tuple:
    """The joiner's parameters that require grad (an ``nn.Module``; none otherwise)."""
    if isinstance(joiner, torch.nn.Module):
        return tuple(p for p in joiner.parameters() if p.requires_grad)
    return ()


def _fused_loss(*args, **kwargs) -> torch.Tensor:
    """:func:`_fused_loss_eager` behind ``torch.compiler.disable``: a graph break under
    ``torch.compile`` (the joiner is called inside the Function). Wrapped on first use:
    decorating at import would import torch._dynamo (and Triton) with rnnt_lattice."""
    global _fused_loss_disabled
    if _fused_loss_disabled is None:
        _fused_loss_disabled = torch.compiler.disable(_fused_loss_eager)
    return _fused_loss_disabled(*args, **kwargs)


_fused_loss_disabled = None


def _fused_loss_eager(joiner, enc, pred, targets, logit_lengths, target_lengths, blank,
                      topology, frames_only, params, *, tile, clamp, reduction, fused,
                      fastemit_lambda, zero_infinity, backend, sigma=0.0, delay_penalty=0.0,
                      boundary=None, allow_blank_targets=False) -> torch.Tensor:
    """check -> the Function -> zero_infinity -> reduce; shared by the fused losses."""
    check_fused_args(joiner, enc, pred, targets)
    rows, nbytes = check_tile(default_tile(enc.device) if tile is None else tile)
    check_reduction(reduction)
    _backends.check_name(backend)
    opts = LossOptions(0, bool(fused), check_float("clamp", clamp),
                       check_float("fastemit_lambda", fastemit_lambda, finite=True),
                       sigma=check_float("sigma", sigma, finite=True),
                       delay_penalty=check_float("delay_penalty", delay_penalty, minimum=0.0,
                                                 finite=True))
    call = _Call(joiner, targets, logit_lengths, target_lengths, boundary, blank, topology,
                 frames_only, opts, backend, rows, nbytes,
                 DEFAULT_MIN_ROWS if tile is None else 1, bool(allow_blank_targets))
    costs = _FusedLoss.apply(call, enc, pred, *params)
    return reduce_costs(costs, reduction, zero_infinity)


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
    ``torch.no_grad`` and again with autograd in the backward pass (math.md section 11).
    Same loss and gradients (w.r.t. ``enc``, ``pred`` and the joiner's parameters) as
    :func:`rnnt_loss` on the materialised logits, to float rounding.

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
            to logits ``(B, t1-t0, u1-u0, V)``. The parameters of an ``nn.Module`` that
            require grad get their gradients through autograd as usual (DDP's hooks
            included); a tensor requiring grad that it reaches otherwise is a
            RuntimeError in the backward pass. It is called twice per tile (forward, and
            again in the backward pass with the forward's RNG state and autocast: dropout
            is replayed exactly), and once more on one node when ``tile`` is a byte
            budget (to learn V; no_grad, RNG state restored).
        enc: ``(B, T, H_enc)`` encoder output. pred: ``(B, U+1, H_pred)`` prediction
            network output. Either may or may not require grad.
        targets, logit_lengths, target_lengths: as :func:`rnnt_loss` (``T = enc.shape[1]``,
            ``U = pred.shape[1] - 1``).
        tile: the size of a tile: an int, the number of lattice nodes (logits rows) per
            tile, or a byte budget of one tile's logits as a string such as ``"64MiB"`` or
            ``"1GB"`` (units B, KB, MB, GB, KiB, MiB, GiB); None (the default):
            ``"4MiB"`` on CPU, ``"256MiB"`` on other devices (:data:`DEFAULT_TILE`), and
            at least 1024 rows (:data:`DEFAULT_MIN_ROWS`).
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
    break (``torch.compiler.disable``). Memory: the lattice, ``O(B T (U+1) K)`` float64,
    plus one tile of logits and joiner activations (math.md section 11).

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
        D = len(durations)
        return _fused_loss(lambda e, p: joiner(e, p)[..., :-D], enc, pred, targets,
                           logit_lengths, target_lengths, blank, *_fixed(regular()), params,
                           tile=tile, clamp=clamp, reduction=reduction, fused=True,
                           fastemit_lambda=fastemit_lambda, zero_infinity=zero_infinity,
                           backend=backend)
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

    def topology(shape):                          # the blank is V - 1: known with the logits
        return multiblank(check_multiblank_blank_id(shape, blank, durations), durations)

    return _fused_loss(joiner, enc, pred, targets, logit_lengths, target_lengths, blank,
                       topology, False, _params(joiner), tile=tile, clamp=clamp, reduction=reduction,
                       fused=True, fastemit_lambda=fastemit_lambda, zero_infinity=zero_infinity,
                       backend=backend, sigma=sigma)
