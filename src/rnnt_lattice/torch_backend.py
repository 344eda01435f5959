"""The pure-PyTorch backend: the :class:`rnnt_lattice._backends.Backend` protocol on the
readable vectorised recursion of :mod:`rnnt_lattice.reference`. It runs on any device
(``backend="torch"``, and ``"auto"`` on devices other than CPU and CUDA).

Everything is computed by ``reference``: the arc log-probs and weights of any topology
(``kind_log_probs``, ``arc_weights``), the lattice in the log or the max-plus semiring
(``lattice``, ``sweep_alpha``) and the fused gradient (``grad``). The loss's
forward pass computes the per-sequence gradient too; the backward pass only applies the
upstream factor. Reading values on the host is allowed here (this backend makes no
CUDA-graph promise); the window DP and the simple losses' log-domain rescue are loops of
vectorised operations.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._layout import row_sequences
from ._rules import scale_upstream, with_bad_rows
from ._types import ArcParts, Ends, Lattice, LossOptions, Smoothing
from .reference import (arc_weights, costs_and_grad_unchecked, grad, kind_log_probs, lattice,
                        lattice_dtype, read_entry, sweep_alpha, terms_weights)
from .topology import Topology

NAME = "torch"
INPLACE_WRITES_IN = "backward"    # the gradient is computed in the forward pass, written later
NATIVE_LOW_PRECISION = False      # float16/bfloat16 logits are promoted to float32 first
NATIVE_INT32_IDS = False          # ids and lengths are converted to int64 first
ZEROES_INFINITE_COSTS = False     # the caller zeroes the upstream gradient of infinite costs
CHECKS_RECOMPUTED_TILES = False   # the fused losses compare a recomputed tile's row sums

NEG_INF = float("-inf")


# --------------------------------------------------------------------------- loss
def loss_forward(logits, targets, logit_lengths, target_lengths, opts: LossOptions, need_grad,
                 boundary=None, node_rows=None, nan_rows=None):
    """Costs, and (when wanted) the per-sequence gradient, computed here by the generic
    recursion and saved for the backward pass, which only applies the upstream factor."""
    costs, grad = costs_and_grad_unchecked(
        logits, targets, logit_lengths, target_lengths, opts.topology, opts.blank,
        opts.log_softmax, opts.clamp, opts.fastemit_lambda, opts.sigma, opts.delay_penalty, boundary,
        need_grad, node_rows)
    costs = with_bad_rows(costs, nan_rows)
    if not need_grad:
        return costs, (), None
    # Rows of a node_rows layout: the sequence each row belongs to (B: no node reads it).
    row_seq = None if node_rows is None else row_sequences(node_rows, logits.shape[0])
    return costs, (grad,) + ((logits,) if opts.inplace_grad else ()), row_seq


def loss_backward(saved, state, upstream, opts: LossOptions):
    """``upstream[b] * grad_b`` (exactly 0 where ``upstream[b] == 0``), into the logits'
    storage with ``opts.inplace_grad``."""
    grad, *into = saved
    if grad.dim() == 2:
        # Rows of a node_rows layout: a row's sequence is where its node sits; rows no
        # node reads carry a zero gradient, and any upstream factor keeps them 0.
        up = torch.cat([upstream.to(grad.dtype), upstream.new_zeros(1, dtype=grad.dtype)])
        up = up[state][:, None]
    else:
        up = upstream.to(grad.dtype)[:, None, None, None]
    if into:
        return scale_upstream(grad, up, out=into[0])
    return scale_upstream(grad, up)


# --------------------------------------------------------------------------- tiles
@dataclass
class _Tiles:
    """The fused joiner and loss's state (``tile_forward`` ... ``tile_backward``): the
    per-node results of ``reference.kind_log_probs`` gathered tile by tile, then the
    lattice."""

    lse: torch.Tensor                  # (B, T, U+1), lattice dtype
    lse_dur: torch.Tensor | None       # (B, T, U+1), TDT only
    lp: torch.Tensor                   # (B, K, T, U+1)
    targets: torch.Tensor              # (B, U) int64
    ends: Ends
    blank: int
    dtype: torch.dtype                 # the rows' (the costs')
    lat: Lattice | None = None         # after tile_lattice


def tile_forward(rows, tile, targets, logit_lengths, target_lengths, opts: LossOptions,
                 boundary, state):
    """``reference.kind_log_probs`` of one tile's rows ``(n, V)`` read through
    ``tile.node_rows``; the box of its results copied into the whole lattice's."""
    topo = opts.topology
    B, T, U1 = tile.node_rows.shape
    if state is None:
        ends = Ends.of(logit_lengths, target_lengths, boundary)   # checked: prepare_call
        blank = opts.blank
        ldt = lattice_dtype(rows.device)
        full = lambda *shape: torch.empty(shape, dtype=ldt, device=rows.device)  # noqa: E731
        state = _Tiles(full(B, T, U1), full(B, T, U1) if topo.n_durations else None,
                       full(B, topo.K, T, U1), targets.to(torch.int64), ends, blank, rows.dtype)
    lse, lse_dur, lp = kind_log_probs(rows, state.targets, topo, state.blank, opts.log_softmax,
                                      state.ends, node_rows=tile.node_rows)
    t, u = tile.box
    state.lse[:, t, u] = lse[:, t, u]
    if lse_dur is not None:
        state.lse_dur[:, t, u] = lse_dur[:, t, u]
    state.lp[:, :, t, u] = lp[:, :, t, u]
    return state


def tile_lattice(state: _Tiles, opts: LossOptions, need_grad: bool):
    """The lattice (``reference.arc_weights``, ``reference.lattice``) once over every node:
    costs ``-log P`` (B,) in the rows' dtype."""
    w = arc_weights(state.lp, opts.topology, state.ends, opts.sigma, opts.delay_penalty)
    lat = lattice(w, opts.topology, state.ends)
    if need_grad:
        state.lat = lat
    return (-lat.log_like).to(state.dtype)


def tile_backward(rows, tile, state: _Tiles, upstream, opts: LossOptions, out):
    """``reference.grad`` of one tile's rows, times the upstream gradient of each row's
    sequence, into ``out`` (n, V) (which may be ``rows``)."""
    g = grad(rows, state.lse, state.lse_dur, state.lat, state.targets, opts.topology,
             state.blank, opts.log_softmax, state.ends, opts.clamp, opts.fastemit_lambda,
             node_rows=tile.node_rows)
    up = torch.cat([upstream.to(g.dtype), upstream.new_zeros(1, dtype=g.dtype)])
    return scale_upstream(g, up[row_sequences(tile.node_rows, rows.shape[0])][:, None], out=out)


# --------------------------------------------------------------------------- lattice tools
def _weights(logits, targets, logit_lengths, target_lengths, opts: LossOptions, boundary):
    """``(w, ends, topo)``: the arc weights ``(B, K, T, U+1)`` in the lattice dtype (``-inf``
    off the arcs) and the start/end nodes, exactly as the loss builds them."""
    topo = opts.topology
    ends = Ends.of(logit_lengths, target_lengths, boundary)   # checked: prepare_call
    _, _, lp = kind_log_probs(logits, targets, topo, opts.blank, opts.log_softmax, ends)
    w = arc_weights(lp, topo, ends, opts.sigma, opts.delay_penalty)
    return w, ends, topo


def occupancy(logits, targets, logit_lengths, target_lengths, opts: LossOptions,
              boundary=None) -> Lattice:
    """The :class:`rnnt_lattice._types.Lattice` of any topology, without gradient work."""
    with torch.no_grad():
        w, ends, topo = _weights(logits, targets, logit_lengths, target_lengths, opts, boundary)
        return lattice(w, topo, ends)


def viterbi(logits, targets, logit_lengths, target_lengths, opts: LossOptions, boundary=None):
    """The max-plus sweep: ``(alpha_max, best_kind, log_prob)``, node tensors ``(B, T+1,
    U+1)`` (``best_kind`` int8: the kind of the best arc into each node, -1 where none) and
    ``log_prob (B,)`` (-inf without a complete path, NaN for NaN logits on the lattice)."""
    with torch.no_grad():
        w, ends, topo = _weights(logits, targets, logit_lengths, target_lengths, opts, boundary)
        alpha_max, best_kind = sweep_alpha(w, topo, ends, max_plus=True)
        bidx = torch.arange(w.shape[0], device=w.device)
        log_prob = torch.where(ends.t1 > ends.t0, alpha_max[bidx, ends.t1, ends.u1], NEG_INF)
        nan_seq = torch.isnan(w).flatten(1).any(1)
        return alpha_max, best_kind, torch.where(nan_seq, float("nan"), log_prob)


def lattice_of_terms(b: torch.Tensor, e: torch.Tensor, topo: Topology, ends: Ends,
                     delay_penalty: float = 0.0):
    """``(log_like (B,), gamma (B, K, T, U+1))`` of k2's lattice whose arcs read the blank
    and label log-weights ``b, e (B, T, U+1)`` float64 (``reference.terms_weights``)."""
    lat = lattice(terms_weights(b, e, topo, ends, delay_penalty), topo, ends)
    return lat.log_like, lat.gamma


# --------------------------------------------------------------------------- window choice
def window_dp(mass: torch.Tensor, max_step: int):
    """``(total (B,), starts (B, T) int64)`` of the window DP (math.md section 10) on
    prepared ``mass (B, T, S)`` (-inf where a start is not allowed), as a loop over frames
    of vectorised PyTorch operations: the readable reference of the Numba and Triton
    kernels. Ties: the lowest starts. Where no finite path exists the starts are still in
    ``[0, S)``."""
    B, T, S = mass.shape
    dev = mass.device
    s_idx = torch.arange(S, device=dev)
    W = max_step + 1
    f = mass[:, 0]
    arg = torch.zeros((B, T, S), dtype=torch.int64, device=dev)             # best s' per (t, s)
    for t in range(1, T):
        # sliding max of f over s' in [s - max_step, s]: pad max_step on the left with -inf.
        padded = torch.nn.functional.pad(f, (W - 1, 0), value=NEG_INF)
        win = padded.unfold(-1, W, 1)                                          # (B, S, W)
        best, k = win.max(-1)                       # ties: the lowest start (first max)
        # All -inf (no finite path): k = 0, the padding; the lowest real start instead.
        arg[:, t] = (s_idx[None, :] - (W - 1) + k).clamp(min=0)
        f = mass[:, t] + best
    starts = torch.empty((B, T), dtype=torch.int64, device=dev)
    total, s = f.max(-1)
    starts[:, T - 1] = s
    bidx = torch.arange(B, device=dev)
    for t in range(T - 1, 0, -1):
        s = arg[bidx, t, s]
        starts[:, t - 1] = s
    return total, starts


def k2_starts(gamma_blank: torch.Tensor, gamma_label: torch.Tensor, t_end: torch.Tensor,
              u_end: torch.Tensor, R: int, R_e: int) -> torch.Tensor:
    """k2's window starts ``s_begin (B, T)`` int64 (fast_rnnt's ``get_rnnt_prune_ranges``
    steps 3-5, docs/variants.md A.6, on our layout: ``py_grad[b, u, t] = gamma_blank[b, t,
    u]``, ``px_grad[b, u, t] = gamma_label[b, t, u]``) from the occupations ``(B, T, U+1)``,
    the end frames and symbols ``t_end, u_end (B,)``, the window R (``R <= U+1``) and the
    largest step plus one ``R_e``: per frame the first maximum over the starts s of

        sum_{k < R} gamma_blank(t, s + k) - gamma_label(t, s - 1)       (0 at s = 0)

    (the sum term by term, k = 0, 1, ..., in the occupations' dtype: k2's own order, so that
    float32 occupations give its very sums), ``max(u_end - R + 1, 0)`` from frame
    ``t_end - 1`` on, then k2's repair (``k2_adjust``). The readable reference of the Triton
    kernel; the Numba backend runs it too."""
    B, T, U1 = gamma_blank.shape
    n = U1 - R + 1                                                   # candidate starts
    # Window sums added up term by term in k2's order (its sum over a strided window axis
    # adds k = 0, 1, ... in turn): a difference of cumulative sums would cancel (the windows
    # that hold a frame's mass differ by edges of ~1e-9 against sums of ~0.5), and a
    # reduction over the innermost axis may add in another order.
    blk_sum = gamma_blank[..., :n].clone()                            # (B, T, n)
    for k in range(1, R):
        blk_sum += gamma_blank[..., k:k + n]
    label_in = torch.nn.functional.pad(gamma_label, (1, 0))[..., :n]   # gamma_label(t, s-1); 0: s = 0
    s_begin = torch.argmax(blk_sum - label_in, -1)                   # (B, T), first max
    t = torch.arange(T, device=gamma_blank.device)[None, :]
    tail = (u_end - R + 1).clamp(min=0)[:, None]                     # (B, 1)
    s_begin = torch.where(t < t_end[:, None] - 1, s_begin, tail)
    return k2_adjust(s_begin, R_e)


def k2_adjust(s_begin: torch.Tensor, R_e: int) -> torch.Tensor:
    """k2's ``_adjust_pruning_lower_bound`` of starts ``(B, T)``: non-decreasing, ``s[0] =
    0``, steps ``<= R_e - 1``, by two suffix minima::

        s(t) = min_{t' >= t} s_begin(t'),   x(t) = max(min_{t' >= t} (R_e - 1) t' - s(t'), 0)
        result(t) = (R_e - 1) t - x(t)"""
    T = s_begin.shape[1]
    t = torch.arange(T, device=s_begin.device)[None, :]

    def suffix_min(x):
        return torch.flip(torch.cummin(torch.flip(x, (-1,)), -1).values, (-1,))

    s = suffix_min(s_begin)
    x = suffix_min((R_e - 1) * t - s).clamp(min=0)
    return (R_e - 1) * t - x


# --------------------------------------------------------------------------- simple loss
# Rows of the log-domain rescue per chunk: (rows, V) float64 temporaries of ~32 MB at most.
RESCUE_ELEMENTS = 1 << 22


def simple_rescue(am: torch.Tensor, lm: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """``(B, T, U+1)`` in the lattice dtype (float64; ``lattice_dtype``):
    ``logsumexp_v am(t,v) + lm(u,v)`` at the nodes ``need`` marks, -inf elsewhere (the
    simple losses' normaliser of the nodes beyond the matmul's range): only those nodes,
    found on the host, by chunks of rows."""
    B, T, V = am.shape
    ldt = lattice_dtype(am.device)
    lse = torch.full((B, T, lm.shape[1]), NEG_INF, dtype=ldt, device=am.device)
    if need.device.type == "meta" or not bool(need.any()):     # (meta: shapes, no values)
        return lse
    b, t, u = need.nonzero().unbind(1)
    step = max(1, RESCUE_ELEMENTS // max(V, 1))
    for i in range(0, b.shape[0], step):
        j = slice(i, i + step)
        x = am[b[j], t[j]].to(ldt) + lm[b[j], u[j]].to(ldt)                      # (n, V)
        lse[b[j], t[j], u[j]] = torch.logsumexp(x, -1)
    return lse


def simple_rescue_backward(am, lm, need, lse, g, grad_am, grad_lm) -> None:
    """Adds ``g p`` of the nodes ``need`` marks into ``grad_am`` rows t and ``grad_lm`` rows
    u (the lattice dtype, ``lse``'s: :func:`simple_rescue`'s; either may be None), ``p(v) =
    exp(am(t,v) + lm(u,v) - lse)``; dead nodes (lse ``-inf``) add nothing."""
    if need.device.type == "meta" or not bool(need.any()):
        return
    ldt = lse.dtype
    b, t, u = (need & (lse > NEG_INF)).nonzero().unbind(1)
    g = g[b, t, u].to(ldt)
    lse = lse[b, t, u]
    step = max(1, RESCUE_ELEMENTS // max(am.shape[2], 1))
    for i in range(0, b.shape[0], step):
        j = slice(i, i + step)
        x = am[b[j], t[j]].to(ldt) + lm[b[j], u[j]].to(ldt)                      # (n, V)
        p = torch.exp(x - lse[j, None]).mul_(g[j, None])
        if grad_am is not None:
            grad_am.index_put_((b[j], t[j]), p, accumulate=True)
        if grad_lm is not None:
            grad_lm.index_put_((b[j], u[j]), p, accumulate=True)


def simple_rows(x: torch.Tensor, keep: torch.Tensor, idx: torch.Tensor):
    """The simple losses' rows ``x (B, N, V)`` (am: N = T; lm: N = U+1) with ``keep (B, N)``
    the rows read (the others are padding) and ``idx (B, N, J)`` the classes the arcs read
    of each row: ``(ok, shift, bad, ex, cols)``.

    ``ok (B, N)`` marks the kept rows that hold no NaN or ``+inf``: only those reach the
    matmul (it mixes rows over V only, but its backward mixes every t with every u of a
    sequence, so a NaN must not enter it); ``shift (B, N)`` the row max, 0 where it is not
    finite (a row of only ``-inf`` then gives ``ex = 0``: a dead row, lse ``-inf``); ``bad``
    the kept rows whose max is NaN or ``+inf`` (math.md 8.1: their lse is NaN); ``ex (B,
    N, V) = exp(x - shift)`` on the ok rows, 0 on the others; ``cols (B, N, J) = x[b, n,
    idx]`` on the ok rows, 0 on the others. All three in the lattice dtype: ex because an
    exp of a float32 row, rounded to float32, would underflow 580 nats sooner; cols because
    their gradients come back in their dtype, and a confident row's (``p`` near 1) is the
    difference of its read and ``p`` times it (math.md 4.1), which float32 rounds away. The
    readable reference of the Triton kernel; the Numba backend runs it too."""
    ldt = lattice_dtype(x.device)
    row_max = x.detach().amax(-1)                                           # V >= 1
    ok = keep & (row_max < float("inf"))                    # False for NaN and +inf
    bad = keep ^ ok                                         # ok lies inside keep
    shift = torch.where(ok & (row_max > NEG_INF), row_max, 0.0).to(ldt)
    ex = x.detach().to(ldt, memory_format=torch.contiguous_format, copy=True)
    ex.masked_fill_(~ok[..., None], NEG_INF).sub_(shift[..., None]).exp_()
    cols = torch.gather(x.detach(), 2, idx).to(ldt).masked_fill_(~ok[..., None], 0.0)
    return ok, shift, bad, ex, cols


def simple_rows_backward(grad: torch.Tensor, ex: torch.Tensor, ok: torch.Tensor,
                         g_uni: torch.Tensor | None, uni: torch.Tensor | None,
                         idx: torch.Tensor, g_cols: torch.Tensor | None) -> None:
    """The backward of :func:`simple_rows`' ``ex`` and ``cols``, in place on ``grad (B, N,
    V)`` (float64, contiguous; on entry the gradient w.r.t. ``ex`` from the matmul)::

        grad = (grad + g_uni uni^T) ex + scatter(idx, g_cols)   on the ok rows, 0 elsewhere

    (``d ex / d x = ex``; ``g_uni (B, N)`` and ``uni (V,)``: the smoothed loss's ``ex @
    uni``, None for none; ``g_cols (B, N, J)`` the entries' gradient, None for none)."""
    V = grad.shape[2]
    if g_uni is not None:
        grad.view(-1, V).addr_(g_uni.to(grad.dtype).reshape(-1), uni.to(grad.dtype))
    grad.mul_(ex)
    if g_cols is not None:
        grad.scatter_add_(2, idx, g_cols.to(grad.dtype))
    grad.masked_fill_(~ok[..., None], 0.0)


def arc_terms(parts: ArcParts, mix: Smoothing | None):
    """The simple losses' arc log-probs ``(b', e', saved)`` ``(B, T, U+1)`` float64 from
    the normaliser's parts (the formulas: ``pruned.simple._ArcTerms``), and ``saved`` for
    :func:`arc_terms_backward`: ``(mass, fin, live, resc)``, the nodes whose arcs read
    their entries (lse not -inf), whose lse came from the mass, from the rescue (neither
    on a bad row). The readable reference of the Triton kernel; the Numba backend runs it
    too."""
    ldt = parts.mass.dtype
    U = parts.lm_cols.shape[1] - 1
    mass, rescued = parts.mass, parts.rescued
    live = (mass > 0) & ~rescued                # 0: a dead node (or one without mass on GPU)
    lse = torch.log(torch.where(live, mass, 1.0)).add_(parts.am_shift[..., None]).add_(
        parts.lm_shift[:, None, :])
    lse = torch.where(live, lse, NEG_INF)
    lse = torch.where(rescued, parts.lse_rescued.to(ldt), lse)
    bad = parts.am_bad[:, :, None] | parts.lm_bad[:, None, :]
    lse.masked_fill_(bad, float("nan"))                                     # (B, T, U+1)
    a64, l64 = parts.am_cols.to(ldt), parts.lm_cols.to(ldt)
    b = read_entry(a64[..., :1] + l64[:, None, :, 0], lse, True)
    e = torch.full_like(b, NEG_INF)                                         # no label arc at u = U
    e[..., :U] = read_entry(a64[..., 1:] + l64[:, None, :U, 1], lse[..., :U], True)
    saved = (mass, lse != NEG_INF, live & ~bad, rescued & ~bad)
    if mix is None:
        return b, e, saved
    b.mul_(mix.c).add_(torch.add(parts.Q, l64[..., 0], alpha=mix.s_lm)[:, None, :]).add_(
        torch.add(parts.P, a64[..., 0], alpha=mix.s_am)[:, :, None])
    e[..., :U].mul_(mix.c).add_(torch.add(parts.S, l64[:, :U, 1], alpha=mix.s_lm)[:, None, :]
                                ).add_(a64[..., 1:], alpha=mix.s_am).add_(parts.R[:, :, None])
    return b, e, saved


def arc_terms_backward(saved: tuple, g_b: torch.Tensor | None, g_e: torch.Tensor | None,
                       mix: Smoothing | None, dtypes: tuple):
    """The backward of :func:`arc_terms` (the formulas: ``pruned.simple._ArcTerms``) from
    the gradients of ``b', e'`` ``(B, T, U+1)`` (None: zero): ``(d mass, d lse_rescued (B,
    T, U+1), d am_cols (B, T, U+1), d lm_cols (B, U+1, 2), (d P, d Q, d R, d S) or ())``,
    the columns' gradients in ``dtypes = (am_cols', lm_cols')``."""
    mass, fin, live, resc = saved
    U = fin.shape[2] - 1
    g_b2 = torch.zeros_like(mass) if g_b is None else g_b
    g_e2 = (torch.zeros_like(mass) if g_e is None else g_e)[..., :U]
    c = 1.0 if mix is None else mix.c
    gb = torch.where(fin, g_b2 * c if c != 1.0 else g_b2, 0.0)            # d b   (B, T, U+1)
    ge = torch.where(fin[..., :U], g_e2 * c if c != 1.0 else g_e2, 0.0)   # d e   (B, T, U)
    g_lse = -gb
    g_lse[..., :U] -= ge
    g_mass = torch.where(live, g_lse / mass, 0.0)
    g_resc = torch.where(resc, g_lse, 0.0)
    g_am_blank, g_lm_blank, g_lm_label = gb.sum(2), gb.sum(1), ge.sum(1)
    g_am_label, mix_grads = ge, ()
    if mix is not None:
        mix_grads = (g_b2.sum(2), g_b2.sum(1), g_e2.sum(2), g_e2.sum(1))   # P, Q, R, S
        g_am_blank = g_am_blank.add_(mix_grads[0], alpha=mix.s_am)
        g_lm_blank = g_lm_blank.add_(mix_grads[1], alpha=mix.s_lm)
        g_lm_label = g_lm_label.add_(mix_grads[3], alpha=mix.s_lm)
        g_am_label = ge.add_(g_e2, alpha=mix.s_am)
    g_am = torch.cat((g_am_blank[..., None], g_am_label), 2).to(dtypes[0])
    g_lm = torch.stack((g_lm_blank, torch.nn.functional.pad(g_lm_label, (0, 1))), 2)
    return g_mass, g_resc, g_am, g_lm.to(dtypes[1]), mix_grads


# --------------------------------------------------------------------------- pruning
def rows_select(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, index)`` ``(N, D)`` for ``x (n, D)`` and ``index (N,)`` int64 in
    ``[0, n)``: ``do_rnnt_pruning``'s rows of lm (a new tensor; on CUDA from PyTorch's
    caching allocator)."""
    return x.index_select(0, index)


def rows_sum(grad: torch.Tensor, index: torch.Tensor, n_out: int,
             groups: int = 1) -> torch.Tensor:
    """``out (n_out, D)`` with ``out[j] = sum_{i: index[i] = j} grad[i]`` for ``grad (N, D)``
    and ``index (N,)`` int64 in ``[0, n_out)``, each sum in the order of i: the backward of
    ``x.index_select(0, index)`` (``do_rnnt_pruning``'s rows of lm), by ``index_add_``. The
    readable reference of the Triton kernel; the Numba backend runs it too. ``groups``
    divides N and n_out, and the entries of group g, ``i`` in ``[g N/groups, (g+1)
    N/groups)``, lie in ``[g n_out/groups, (g+1) n_out/groups)`` (a sequence's windows
    read its own rows): the Triton kernel scans one group per row; this sum needs no hint."""
    return grad.new_zeros((n_out, grad.shape[1])).index_add_(0, index, grad)


# --------------------------------------------------------------------------- memory
def empty_cache() -> None:
    """Nothing to release: this backend keeps no buffer between calls."""
