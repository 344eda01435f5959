"""Vectorised pure-PyTorch transducer lattice: the readable reference and the any-device fallback.

One recursion for every topology (``docs/math.md`` section 9): a topology is a tuple of arc
kinds (``rnnt_lattice.topology``); kind k leaves node ``(t, u)``, lands on
``(t + dt_k, u + du_k)`` and has log-weight ``w_k(t, u)``. With ``dt_k + du_k >= 1`` the
cells of one anti-diagonal ``d = t + u`` depend only on earlier diagonals, so everything is
vectorised over the batch and one diagonal at a time:

    alpha(start) = 0
    alpha(n)     = lae over kinds k of  alpha(n - delta_k) + w_k(n - delta_k)
    beta(end)    = 0
    beta(n)      = lae over kinds k of  w_k(n) + beta(n + delta_k)
    log P        = beta(start)
    gamma_k(n)   = exp( alpha(n) + w_k(n) + beta(n + delta_k) - log P )

where ``lae`` is ``torch.logaddexp`` (``max`` in the max-plus semiring). The grid of node
tensors is ``(B, T+1, U+1)``: frame ``T_b`` is the virtual end frame (math.md section 9.1),
it reads no logits. Per-kind tensors over source nodes are ``(B, K, T, U+1)``.

The PyTorch backend (``torch_backend``, ``rnnt_loss(..., backend="torch")``) runs on it,
and the tests use it as the oracle for large lattices.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ._layout import row_nodes, rows_view
from ._types import Ends, Lattice
from .topology import Topology, check_topology

NEG_INF = float("-inf")


# Device types without float64 (Apple's MPS): the torch backend's lattice runs in float32
# there, and nothing on that path may make a float64 tensor on the device (every such
# tensor takes its dtype from :func:`lattice_dtype`). tests/test_no_float64.py checks it on
# the CPU, with "cpu" added here and every float64 op refused. An Intel GPU (XPU) is asked
# (:func:`_xpu_has_float64`): the Arc A-series has none.
DEVICES_WITHOUT_FLOAT64 = frozenset({"mps"})


def lattice_dtype(device: torch.device) -> torch.dtype:
    """The dtype the recursion runs in: float64 wherever the device has it
    (:data:`DEVICES_WITHOUT_FLOAT64`, an XPU without it: float32)."""
    if device.type in DEVICES_WITHOUT_FLOAT64:
        return torch.float32
    if device.type == "xpu":
        index = device.index if device.index is not None else torch.xpu.current_device()
        if not _xpu_has_float64(index):
            return torch.float32
    return torch.float64


@functools.lru_cache(maxsize=None)
def _xpu_has_float64(index: int) -> bool:
    """Whether XPU ``index`` computes in float64: its properties' ``has_fp64`` (False on the
    Arc A-series, whose float64 kernels raise "Required aspect fp64 is not supported on the
    device"); True where torch does not say."""
    return bool(getattr(torch.xpu.get_device_properties(index), "has_fp64", True))


def cumsum_last(x: torch.Tensor) -> torch.Tensor:
    """``x.cumsum(-1)``, except for a floating ``x`` under
    ``torch.use_deterministic_algorithms(True)``: CUDA has no deterministic kernel for a
    floating cumsum (torch raises ``RuntimeError`` there; a warning with ``warn_only``), so
    then the sums are a scan of elementwise adds, the same on every device::

        s_0 = x;   s_{k+1}[..., i] = s_k[..., i] + s_k[..., i - 2^k]   (i >= 2^k)

    for ``ceil(log2 n)`` steps (each entry a sum of the same terms as the cumsum's, in
    another order: rounded differently, by as little)."""
    if not (x.is_floating_point() and torch.are_deterministic_algorithms_enabled()):
        return x.cumsum(-1)
    n, d = x.shape[-1], 1
    while d < n:
        x = torch.cat([x[..., :d], x[..., d:] + x[..., :-d]], -1)
        d *= 2
    return x


# ---------------------------------------------------------------------------------------
# Start and end nodes, arc masks
# ---------------------------------------------------------------------------------------

def arc_mask(topo: Topology, ends: Ends, T: int, U1: int) -> torch.Tensor:
    """(B, K, T, U+1) bool: the arcs of each lattice (math.md section 9.1). Kind k leaves
    ``(t, u)`` in the region and lands on ``(t+dt, u+du)`` with ``u + du <= u1`` and either
    ``t + dt < t1`` or, for a ``may_end`` kind, exactly the end node ``(t1, u1)``. (A landing
    on another node of the end frame is a dead end: it is no arc, so log-prob mode never
    reads its entry.)"""
    region = ends.region(T, U1)
    t = torch.arange(T, device=region.device)[None, :, None]
    u = torch.arange(U1, device=region.device)[None, None, :]
    t1, u1 = ends.t1[:, None, None], ends.u1[:, None, None]
    masks = []
    for k in topo.kinds:
        lt, lu = t + k.dt, u + k.du
        lands = (lt < t1) & (lu <= u1)
        if k.may_end:
            lands = lands | ((lt == t1) & (lu == u1))
        masks.append(region & lands)
    return torch.stack(masks, 1)


# ---------------------------------------------------------------------------------------
# Arc log-probs and weights
# ---------------------------------------------------------------------------------------

def _row_lse(x: torch.Tensor, log_softmax: bool) -> torch.Tensor:
    """Log-normaliser of each row of one softmax group (math.md 8.1), in the lattice dtype:
    NaN if the row max is NaN or +inf; 0 in log-prob mode.

    Computed as ``m + log(ties + rest)`` with ``m`` the row's max (one of its entries),
    ``ties`` the number of entries equal to it and ``rest`` the sum of ``exp(x_v - m)``
    over the others: the sums are those of the shifted row, so they do not depend on a
    common offset of the row, and the float64 ``m + log(..)`` keeps the offset's digits
    that a float32 ``lse`` would round away (a row around 1e3 in float32: 6e-5 of every
    log-prob and of the gradient). The ties are counted, not summed: a float32 sum ``1 +
    rest`` rounds a confident row's ``rest`` (below 2^-24 it read ``log p_max = 0``)."""
    ldt = lattice_dtype(x.device)
    if not log_softmax:
        return torch.zeros(x.shape[:-1], dtype=ldt, device=x.device)
    row_max = x.amax(dim=-1)                                               # NaN if any NaN
    shift = torch.where(torch.isfinite(row_max), row_max, 0.0)            # all -inf: lse -inf
    d = x - shift[..., None]
    tie = d == 0
    rest = torch.where(tie, 0.0, torch.exp(d)).sum(
        -1, dtype=torch.promote_types(x.dtype, torch.float32))
    lse = shift.to(ldt) + torch.log(tie.sum(-1).to(ldt) + rest.to(ldt))
    return torch.where(torch.isnan(row_max) | (row_max == float("inf")), float("nan"), lse)


def read_entry(entry: torch.Tensor, lse: torch.Tensor, log_softmax: bool) -> torch.Tensor:
    """Log-prob ``entry - lse`` of one class per row, in ``lse``'s dtype; a dead row (all
    -inf, ``lse = -inf``) has ``-inf`` arcs, and in log-prob mode a ``+inf`` entry reads as
    NaN."""
    entry = entry.to(lse.dtype)
    if not log_softmax:
        entry = torch.where(entry == float("inf"), float("nan"), entry)
    return torch.where(lse == NEG_INF, NEG_INF, entry - lse)


def _softmax_mass(x: torch.Tensor, lse: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``p * total`` of rows ``x`` ``(N, n)``: ``p = exp(x - lse)`` under each row's
    lattice-dtype log-normaliser ``lse`` ``(N,)``, ``total`` ``(N,)`` in ``x``'s dtype; 0 on
    a row without mass (``lse = -inf``) and on a row no arc reads (``total = 0``).

    With ``lse = hi + lo``, ``hi`` in ``x``'s dtype (clamped to its range: a float16 row at
    its max has ``lse`` beyond it), this is ``exp(x - hi) * (total exp(-lo))``: ``x - hi``
    rounds relative to the difference, not to ``lse``, so a common offset of the row costs
    no digits, and ``exp(-lo)`` joins the per-row factor (no second pass over the row)."""
    big = torch.finfo(x.dtype).max
    hi = lse.clamp(-big, big).to(x.dtype)
    lo = torch.where(torch.isinf(lse), 0.0, lse - hi.to(lse.dtype))
    scale = (total.to(lse.dtype) * torch.exp(-lo)).to(x.dtype)
    p = torch.exp(x - hi[:, None]) * scale[:, None]
    return torch.where((torch.isneginf(lse) | (total == 0))[:, None], 0.0, p)


def _group_grad(x: torch.Tensor, lse: torch.Tensor | None, cls: torch.Tensor,
                read: torch.Tensor) -> torch.Tensor:
    """One softmax group's gradient rows ``(N, n)`` in ``x``'s dtype:

        d loss / d x_v = p_v S - sum_{reads r of class v} g_r,    S = sum_r g_r

    for the reads ``r`` of each row: class ``cls (N, R)``, occupation ``read (N, R)`` (lattice
    dtype). ``lse`` ``(N,)``: the group's log-normaliser; None in log-prob mode (``p`` taken
    as 0). The bulk ``p_v S`` is computed in ``x``'s dtype (:func:`_softmax_mass`); the
    entries the reads hit are then formed in the lattice dtype, ``p`` from ``x_v - lse``
    there, and written over it: near ``p = 1`` (a confident row) ``p S - g`` cancels, and in
    float32 it kept only the rounding of ``p`` and of ``S``."""
    if lse is None:
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device).scatter_add_(
            1, cls, (0.0 - read).to(x.dtype))
    total = read.sum(1)                                                    # S (N,)
    out = _softmax_mass(x, lse, total.to(x.dtype))
    # every read's class gets p S minus all the reads of that class (a class read twice:
    # both writes are the same value)
    hits = (read[:, None, :] * (cls[:, :, None] == cls[:, None, :])).sum(-1)   # (N, R)
    p = torch.exp(torch.gather(x, 1, cls).to(lse.dtype) - lse[:, None])
    mass = torch.where((torch.isneginf(lse) | (total == 0))[:, None], 0.0, p * total[:, None])
    return out.scatter_(1, cls, (mass - hits).to(x.dtype))


def kind_log_probs(logits, targets, topo: Topology, blank: int, log_softmax: bool, ends: Ends,
                   node_rows: torch.Tensor | None = None):
    """The log-prob part of every arc kind's weight at every source node.

    Args:
        logits: ``(B, T, U+1, V)`` with ``V = V_tok + n_durations``: raw scores (``log_softmax=True``)
            or log-probabilities (both groups already normalised). With ``node_rows``:
            rows ``(N, V)`` of a packed or pruned layout.
        targets: ``(B, U)`` int64. ``blank``: a token id in ``[0, V_tok)``.
        node_rows: ``(B, T, U+1)`` int64, the row node ``(b, t, u)`` reads (``-1``: none,
            so every arc leaving it is ``-inf``), or None for padded logits.

    Returns:
        ``(lse, lse_dur, lp)``: the token group's row log-normaliser per node
        ``(B, T, U+1)`` (0 in log-prob mode; ``-inf`` for a node without a row), the
        duration group's (``None`` without durations) and ``lp`` ``(B, K, T, U+1)``: the
        kind's class log-prob (blank, ``y[u]`` or ``class_id``), plus its duration
        log-prob, plus ``b(t, u+1)`` for ``plus_next_blank``; ``-inf`` where the source
        node is outside the region or ``u + du > u1``. The end-frame rule of ``arc_mask``
        is not applied here (``lattice`` applies it). All three are in the lattice dtype
        (``lattice_dtype``): a log-prob is the float64 difference of its entry and ``lse``.
    """
    x, rows = rows_view(logits, node_rows)
    B, T, U1 = rows.shape
    V = x.shape[-1]
    V_tok = topo.token_classes(V)
    has_row = rows >= 0
    r = rows.clamp(min=0)                                                  # (B, T, U+1)

    def per_node(row_values):
        """(N,) per row -> (B, T, U+1) per node, -inf for a node without a row."""
        return torch.where(has_row, row_values[r], NEG_INF)

    lse = per_node(_row_lse(x[:, :V_tok], log_softmax))                          # (B, T, U+1)
    lse_dur = per_node(_row_lse(x[:, V_tok:], log_softmax)) if topo.n_durations else None

    cache = {}

    def token(key):
        """Token log-prob per node (B, T, U+1) of "blank", "label" (y[u]) or a class id."""
        if key not in cache:
            if key == "label":
                safe_targets = targets.clamp(0, V_tok - 1)                 # padding may hold anything
                cls = torch.nn.functional.pad(safe_targets, (0, 1), value=0)   # (B, U+1); none at U
                entry = x[r, cls[:, None, :].expand(B, T, U1)]
                entry = torch.where(torch.arange(U1, device=x.device) < U1 - 1, entry, NEG_INF)
            else:
                entry = x[:, blank if key == "blank" else key][r]
            cache[key] = read_entry(entry, lse, log_softmax)
        return cache[key]

    duration = (lambda i: read_entry(x[:, V_tok + i][r], lse_dur, log_softmax)) if topo.n_durations else None
    return lse, lse_dur, stack_kinds(topo, ends, token, duration)


def stack_kinds(topo: Topology, ends: Ends, token, duration=None) -> torch.Tensor:
    """``lp (B, K, T, U+1)``: every kind's log-prob at its source nodes, from the per-node
    log-probs ``token(key)`` ``(B, T, U+1)`` of the class it reads (``key``: ``"blank"``,
    ``"label"`` or a class id) and, for TDT, ``duration(i)`` of duration index ``i``: the
    class's, plus the duration's, plus ``b(t, u+1)`` for ``plus_next_blank``; ``-inf``
    where the source node is outside the region or ``u + du > u1``. Shared by the logits'
    lattice (:func:`kind_log_probs`) and the simple joiner's (``pruned.simple``)."""
    blank = token("blank")
    B, T, U1 = blank.shape
    region = ends.region(T, U1)
    u = torch.arange(U1, device=blank.device)[None, None, :]
    lps = []
    for k in topo.kinds:
        lp = token(k.class_id if k.reads == "class" else k.reads)
        if k.duration >= 0:
            lp = lp + duration(k.duration)
        if k.plus_next_blank:
            lp = lp + torch.nn.functional.pad(blank[..., 1:], (0, 1), value=NEG_INF)   # b(t, u+1)
        valid = region & (u + k.du <= ends.u1[:, None, None])
        lps.append(torch.where(valid, lp, NEG_INF))
    return torch.stack(lps, 1)


def arc_weights(lp: torch.Tensor, topo: Topology, ends: Ends, sigma: float = 0.0,
                delay_penalty: float = 0.0) -> torch.Tensor:
    """Arc weights ``w (B, K, T, U+1)``: ``lp`` plus the per-arc terms, ``-inf`` off the arcs
    of ``arc_mask``. Every arc gets ``-sigma`` (NeMo's logit under-normalisation); ``delay``
    kinds get ``delay_penalty * ((t1 - 1)/2 - t)`` with ``t1`` the end frame (k2: earlier
    labels get a bonus). Both are constants: they change the weights, not the softmax."""
    B, K, T, U1 = lp.shape
    w = lp
    if sigma:
        w = w - sigma
    if delay_penalty:
        t = torch.arange(T, device=lp.device, dtype=lp.dtype)
        penalty = delay_penalty * ((ends.t1.to(lp.dtype)[:, None] - 1) / 2 - t[None, :])   # (B, T)
        # Per kind from the topology (Python flags): no tensor built from Python values
        # on the device (a host -> device copy, a synchronisation on CUDA).
        zero = torch.zeros_like(penalty)
        w = w + torch.stack([penalty if k.delay else zero for k in topo.kinds], 1)[..., None]
    return torch.where(arc_mask(topo, ends, T, U1), w, NEG_INF)


def terms_weights(b: torch.Tensor, e: torch.Tensor, topo: Topology, ends: Ends,
                  delay_penalty: float = 0.0) -> torch.Tensor:
    """Arc weights ``w (B, K, T, U+1)`` of k2's lattices (kinds that read the blank or the
    label) whose arcs read the blank and label log-weights ``b, e (B, T, U+1)``: each
    kind's ``b`` or ``e``, plus ``b(t, u+1)`` for ``plus_next_blank``, plus the delay
    penalty, ``-inf`` off the arcs (:func:`stack_kinds`, :func:`arc_weights`). The weights
    of ``pruned.simple``'s lattices (the backends' ``lattice_of_terms``). A ``+inf`` log-weight
    reads as NaN (math.md 8.1), as the kernels' recursions read it: the log-sum of a path
    through it would be ``+inf``, a cost of ``-inf``."""
    lp = stack_kinds(topo, ends, lambda key: b if key == "blank" else e)
    lp = torch.where(lp == float("inf"), float("nan"), lp)
    return arc_weights(lp, topo, ends, 0.0, delay_penalty)


# ---------------------------------------------------------------------------------------
# The recursion
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Diagonal:
    """Flat indices for one anti-diagonal ``d = t + u`` of the ``(T+1, U+1)`` node grid.
    Node ``(t, u)`` is ``t (U+1) + u``; weight ``(k, t, u)`` is ``(k T + t)(U+1) + u``; the
    last index of each flat buffer is a ``-inf`` sentinel for arcs that leave the grid."""

    nodes: torch.Tensor        # (n,)    the diagonal's nodes
    src_nodes: torch.Tensor    # (K n,)  alpha: node each kind's incoming arc leaves from
    src_w: torch.Tensor        # (K n,)  alpha: that arc's weight
    dst_nodes: torch.Tensor    # (K n,)  beta: node each kind's outgoing arc lands on
    out_w: torch.Tensor        # (K n,)  beta: that arc's weight


class _Diagonals:
    """The anti-diagonals of a schedule, in order, each a :class:`_Diagonal` of views into
    five flat index tensors: a few tensors per shape, where one tensor object per diagonal
    and field (about 1 KB each) held hundreds of MB in the cache for T in the tens of
    thousands, and took ~0.25 ms a diagonal to build."""

    def __init__(self, offsets: list, K: int, flat: tuple):
        self.offsets, self.K, self.flat = offsets, K, flat   # flat: _Diagonal's fields

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, d: int) -> _Diagonal:
        a, b = self.offsets[d], self.offsets[d + 1]
        K = self.K
        nodes, *per_kind = self.flat
        return _Diagonal(nodes[a:b], *(x[K * a:K * b] for x in per_kind))

    def __iter__(self):
        return (self[d] for d in range(len(self)))

    def __reversed__(self):
        return (self[d] for d in reversed(range(len(self))))


@functools.lru_cache(maxsize=16)
def _schedule(T: int, U1: int, steps: tuple, device: torch.device):
    """Per-diagonal index tensors for kinds with ``(dt, du) = steps[k]`` (:class:`_Diagonals`),
    and the landing node of every weight ``(K T (U+1),)`` (for the occupations). Cached per
    shape: ``(4 K + 2) (T+1)(U+1)`` int64 in all (a few MB for T, U in the hundreds),
    built by a few vectorised operations.

    Diagonal ``d`` holds the nodes ``t + u = d``, ``t`` ascending; its per-kind fields are
    kind-major (``K n`` entries: kind 0's ``n`` nodes, then kind 1's, ...)."""
    K, G, W = len(steps), (T + 1) * U1, len(steps) * T * U1
    dts = torch.tensor([s[0] for s in steps])[:, None]                      # (K, 1)
    dus = torch.tensor([s[1] for s in steps])[:, None]
    ks = torch.arange(K)[:, None]
    t = torch.arange(T + 1).repeat_interleave(U1)                           # every node
    u = torch.arange(U1).repeat(T + 1)
    order = torch.argsort((t + u) * (T + 1) + t)                            # by diagonal, then t
    t, u = t[order], u[order]
    d = t + u
    counts = torch.bincount(d, minlength=T + U1)                           # nodes per diagonal
    ends = torch.cumsum(counts, 0)
    offsets = [0] + ends.tolist()
    first = (ends - counts)[d]                                              # (G,) its diagonal's start
    rank = torch.arange(G) - first                                          # place in the diagonal
    # node i's entry of kind k: after the K n entries of the diagonals before its own, and
    # the n entries of the kinds before k on its own
    at = (K * first + ks * counts[d] + rank).reshape(-1)                   # (K G,)
    st, su = t - dts, u - dus                                               # (K, G)
    ok = (st >= 0) & (su >= 0) & (st < T)
    src_nodes = torch.where(ok, st * U1 + su, G)
    src_w = torch.where(ok, (ks * T + st) * U1 + su, W)
    lt, lu = t + dts, u + dus
    ok = (t < T) & (lt <= T) & (lu < U1)
    dst_nodes = torch.where(ok, lt * U1 + lu, G)
    out_w = torch.where(ok, (ks * T + t) * U1 + u, W)

    def placed(x):
        out = torch.empty(K * G, dtype=torch.int64)
        out[at] = x.reshape(-1)
        return out.to(device)

    flat = ((t * U1 + u).to(device),) + tuple(placed(x) for x in (src_nodes, src_w, dst_nodes,
                                                                  out_w))
    t = torch.arange(T)[None, :, None]
    u = torch.arange(U1)[None, None, :]
    lt, lu = t + dts[:, :, None], u + dus[:, :, None]
    land = torch.where((lt <= T) & (lu < U1), lt * U1 + lu, G).reshape(-1).to(device)
    return _Diagonals(offsets, K, flat), land


def _steps(topo: Topology) -> tuple:
    return tuple((k.dt, k.du) for k in topo.kinds)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``(B, ...)`` -> ``(n + 1, B)``: node-major (so that every gather of one diagonal is
    contiguous: ``logaddexp`` then takes its vectorised path on every backend, whose
    rounding can differ from the strided one), with a trailing ``-inf`` sentinel row."""
    x = x.reshape(x.shape[0], math.prod(x.shape[1:])).t()                 # B = 0 allowed
    return torch.cat([x, x.new_full((1, x.shape[1]), NEG_INF)], 0)


def _unflat(xf: torch.Tensor, *shape) -> torch.Tensor:
    """Inverse of ``_flat``: ``(n + 1, B)`` -> ``(B, *shape)`` (a copy, contiguous)."""
    return xf[:-1].t().reshape(xf.shape[1], *shape).contiguous()


def sweep_alpha(w: torch.Tensor, topo: Topology, ends: Ends | None = None, max_plus: bool = False):
    """alpha ``(B, T+1, U+1)`` from arc weights ``w (B, K, T, U+1)``, one anti-diagonal at a
    time, and in the max-plus semiring also the best incoming kind per node.

    The semiring switch: ``max_plus=False`` combines the incoming arcs with ``lae`` (the
    forward variable, log-sum over paths); ``max_plus=True`` with ``max`` (the Viterbi score,
    log-probability of the best path into the node). ``ends``: only the start nodes are
    used (default ``(0, 0)``). Kinds are combined in their order; on an exact max-plus tie
    the first kind wins.

    Returns:
        ``alpha``, and for ``max_plus`` ``(alpha, best_kind)`` with ``best_kind (B, T+1, U+1)``
        int8: the kind of the best arc into the node, ``-1`` where none (start node, no
        finite path). A backtrack then only follows pointers (``analysis.alignment``).
    """
    B, K, T, U1 = w.shape
    diagonals, _ = _schedule(T, U1, _steps(topo), w.device)
    G = (T + 1) * U1
    wf = _flat(w)                                                           # (K T (U+1) + 1, B)
    af = torch.full((G + 1, B), NEG_INF, dtype=w.dtype, device=w.device)
    best = torch.full((G + 1, B), -1, dtype=torch.int8, device=w.device) if max_plus else None
    custom_start = ends is not None and ends.custom_start
    if custom_start:
        start = ends.t0 * U1 + ends.u0                                      # (B,)
    for d, diag in enumerate(diagonals):
        n = diag.nodes.numel()
        terms = (af.index_select(0, diag.src_nodes) + wf.index_select(0, diag.src_w)).view(K, n, B)
        if max_plus:
            # Strictly greater replaces: on an exact tie the first kind wins, on any device.
            val, arg = terms[0], torch.zeros((n, B), dtype=torch.int8, device=w.device)
            for k in range(1, K):
                arg = torch.where(terms[k] > val, k, arg).to(torch.int8)
                val = torch.maximum(val, terms[k])
            arg = torch.where(val > NEG_INF, arg, -1).to(torch.int8)
        else:
            val = terms[0]
            for k in range(1, K):
                val = torch.logaddexp(val, terms[k])
        if custom_start:
            is_start = diag.nodes[:, None] == start[None, :]
            val = torch.where(is_start, 0.0, val)
            if max_plus:
                arg = torch.where(is_start, -1, arg).to(torch.int8)
        elif d == 0:
            val = torch.zeros_like(val)
            if max_plus:
                arg = torch.full_like(arg, -1)
        af.index_copy_(0, diag.nodes, val)
        if max_plus:
            best.index_copy_(0, diag.nodes, arg)
    alpha = _unflat(af, T + 1, U1)
    return (alpha, _unflat(best, T + 1, U1)) if max_plus else alpha


def sweep_beta(w: torch.Tensor, topo: Topology, ends: Ends) -> torch.Tensor:
    """beta ``(B, T+1, U+1)`` from arc weights ``w (B, K, T, U+1)`` (``-inf`` off the arcs):
    ``beta(end) = 0``, then one anti-diagonal at a time from the last."""
    B, K, T, U1 = w.shape
    diagonals, _ = _schedule(T, U1, _steps(topo), w.device)
    G = (T + 1) * U1
    wf = _flat(w)                                                           # (K T (U+1) + 1, B)
    bf = torch.full((G + 1, B), NEG_INF, dtype=w.dtype, device=w.device)
    end = ends.t1 * U1 + ends.u1                                            # (B,)
    for diag in reversed(diagonals):
        n = diag.nodes.numel()
        terms = (bf.index_select(0, diag.dst_nodes) + wf.index_select(0, diag.out_w)).view(K, n, B)
        val = terms[0]
        for k in range(1, K):
            val = torch.logaddexp(val, terms[k])
        val = torch.where(diag.nodes[:, None] == end[None, :], 0.0, val)
        bf.index_copy_(0, diag.nodes, val)
    return _unflat(bf, T + 1, U1)


def lattice(w: torch.Tensor, topo: Topology, ends: Ends) -> Lattice:
    """alpha, beta, log P and per-kind occupations (math.md section 9) from arc weights
    ``w (B, K, T, U+1)`` (``arc_weights``: ``-inf`` off the arcs).

    NaN (math.md 8.1): a NaN on any arc makes log P NaN, whether or not the arc lies on a
    complete path, hence every occupation of that sequence NaN. A sequence with no frame
    (``t1 <= t0``) or no path has log P ``-inf`` and no occupation.
    """
    B, K, T, U1 = w.shape
    alpha = sweep_alpha(w, topo, ends)
    beta = sweep_beta(w, topo, ends)
    bidx = torch.arange(B, device=w.device)
    log_like = beta[bidx, ends.t0.clamp(max=T), ends.u0.clamp(max=U1 - 1)]
    log_like = torch.where(ends.t1 > ends.t0, log_like, NEG_INF)
    nan_seq = torch.isnan(w).flatten(1).any(1)
    log_like = torch.where(nan_seq, float("nan"), log_like)

    _, land = _schedule(T, U1, _steps(topo), w.device)
    beta_land = _flat(beta).index_select(0, land).t().reshape(B, K, T, U1)
    possible = (log_like != NEG_INF)[:, None, None, None]
    ll = torch.where(possible, log_like[:, None, None, None], 0.0)
    # (the exponent is <= 0 but for rounding, which at |log P| beyond ~1e15 can be large:
    # an occupation is at most 1; clamp keeps NaN)
    gamma = torch.where(possible & arc_mask(topo, ends, T, U1),
                        torch.exp((alpha[:, None, :T] + w + beta_land - ll).clamp(max=0.0)), 0.0)

    t = torch.arange(T + 1, device=w.device)[None, :, None]
    u = torch.arange(U1, device=w.device)[None, None, :]
    # A sequence without frames (t1 <= t0) has no node at all, as in the kernels.
    nodes = ((t >= ends.t0[:, None, None]) & (t <= ends.t1[:, None, None])
             & (u >= ends.u0[:, None, None]) & (u <= ends.u1[:, None, None])
             & (ends.t1 > ends.t0)[:, None, None])
    return Lattice(torch.where(nodes, alpha, NEG_INF), torch.where(nodes, beta, NEG_INF),
                   log_like, gamma)


# ---------------------------------------------------------------------------------------
# The gradient
# ---------------------------------------------------------------------------------------

def _shift_down_u(x: torch.Tensor) -> torch.Tensor:
    """``y(.., u) = x(.., u-1)``, 0 at u = 0: a quantity of the arc leaving (t, u-1) moved to
    the row (t, u) it also reads (``plus_next_blank``)."""
    return torch.nn.functional.pad(x[..., :-1], (1, 0))


def grad(logits, lse, lse_dur, lat: Lattice, targets, topo: Topology, blank: int,
                 log_softmax: bool, ends: Ends, clamp: float = -1.0, fastemit_lambda: float = 0.0,
                 node_rows: torch.Tensor | None = None):
    """Per-sequence gradient of -log P w.r.t. ``logits`` (math.md sections 4-6 and 9),
    before the upstream gradient. Shape and dtype of ``logits``: ``(B, T, U+1, V)``, or
    the rows ``(N, V)`` of a ``node_rows`` layout (``kind_log_probs``).

    For the softmax group g that node n reads (the tokens; for TDT also the durations):

        d loss / d logits(n, v) = p_g(n, v) S_g(n) - sum_{reads of class v at n} s gamma

    with ``S_g(n)`` the sum of ``s gamma`` over the reads of group g at n: every kind reads
    its class at its source node; a ``plus_next_blank`` kind leaving ``(t, u)`` also reads
    the blank at ``(t, u+1)``; a TDT kind reads its duration. FastEmit: ``s = 1 +
    fastemit_lambda`` on the class read of a ``fastemit`` kind and ``s = 1`` on every other
    read (NeMo TDT: duration gradients get no FastEmit). Log-prob mode: ``p`` is taken as 0
    (the gradient w.r.t. the log-probs). ``clamp > 0`` clips the token group only (NeMo
    TDT: the durations are never clamped). Rows of padding nodes, rows no node reads and
    sequences without a path: 0; a NaN sequence: NaN on every entry of every row of its
    region with log_softmax (raw scores), on its arc entries with log-probs.

    Everything is computed per row: node quantities ``(B, T, U+1)`` are carried to the row
    the node reads through the inverse map ``_layout.row_nodes`` (the identity for padded logits).
    """
    x, rows = rows_view(logits, node_rows)
    B, T, U1 = rows.shape
    N, V = x.shape
    V_tok = topo.token_classes(V)
    row_node = row_nodes(rows, N) if node_rows is not None else torch.arange(N, device=x.device)
    has_node = row_node >= 0
    rn = row_node.clamp(min=0)

    def per_row(node_values, fill=0.0):
        """(B, T, U+1) per node -> (N,) per row; ``fill`` for a row no node reads."""
        return torch.where(has_node, node_values.reshape(-1)[rn], fill)

    # The occupations in the lattice dtype: the entries the arcs read are formed there
    # (``_group_grad``), the bulk ``p S`` in the logits' dtype.
    gamma = lat.gamma
    scaled = [gamma[:, k] * (1.0 + fastemit_lambda) if (k_.fastemit and fastemit_lambda) else gamma[:, k]
              for k, k_ in enumerate(topo.kinds)]
    next_blank = [_shift_down_u(gamma[:, k]) for k, k_ in enumerate(topo.kinds) if k_.plus_next_blank]
    reads = [per_row(g) for g in scaled + next_blank]                     # (N,) each

    # Token group: d/dz_v = p_v * S - [v = class read] * s gamma.
    safe_targets = targets.clamp(0, V_tok - 1)
    label_idx = torch.nn.functional.pad(safe_targets, (0, 1), value=0)     # (B, U+1); no label arc at U
    label_row = per_row(label_idx[:, None, :].expand(B, T, U1), 0)         # (N,)
    fixed = lambda c: torch.full((N,), c, dtype=torch.int64, device=x.device)  # noqa: E731
    classes = [label_row if k.reads == "label" else fixed(blank if k.reads == "blank" else k.class_id)
               for k in topo.kinds] + [fixed(blank)] * len(next_blank)
    tok = _group_grad(x[:, :V_tok], per_row(lse, NEG_INF) if log_softmax else None,
                      torch.stack(classes, 1), torch.stack(reads, 1))

    # Duration group (TDT): d/dz_i = q_i * sum_k gamma_k - sum_{k with duration i} gamma_k.
    if topo.n_durations:
        kinds = [(k.duration, j) for j, k in enumerate(topo.kinds) if k.duration >= 0]
        dur = _group_grad(x[:, V_tok:], per_row(lse_dur, NEG_INF) if log_softmax else None,
                          torch.stack([fixed(i) for i, _ in kinds], 1),
                          torch.stack([per_row(gamma[:, j]) for _, j in kinds], 1))
        grad = torch.cat([tok, dur], -1)
    else:
        grad = tok

    region = ends.region(T, U1)
    keep = per_row(region & (lat.log_like != NEG_INF)[:, None, None], False)
    grad = torch.where(keep[:, None], grad, 0.0)
    if log_softmax:
        nan_rows = per_row(region & torch.isnan(lat.log_like)[:, None, None], False)
        grad = torch.where(nan_rows[:, None], float("nan"), grad)
    if clamp > 0:
        # Beyond the dtype's range a clamp clips nothing (the gradient is bounded); torch
        # would refuse to convert it to the gradient's dtype.
        clamp = min(clamp, torch.finfo(grad.dtype).max)
        if topo.n_durations:
            grad = torch.cat([grad[:, :V_tok].clamp(-clamp, clamp), grad[:, V_tok:]], -1)
        else:
            grad = grad.clamp(-clamp, clamp)
    return grad.reshape(logits.shape)


def costs_and_grad(logits, targets, logit_lengths, target_lengths, topo: Topology,
                           blank: int, log_softmax: bool = True, clamp: float = -1.0,
                           fastemit_lambda: float = 0.0, sigma: float = 0.0,
                           delay_penalty: float = 0.0, boundary=None, need_grad: bool = True,
                           node_rows: torch.Tensor | None = None):
    """Costs ``-log P`` ``(B,)`` (dtype of ``logits``) and, if ``need_grad``, the
    per-sequence gradient ``(B, T, U+1, V)`` before the upstream factor, for any topology.

    ``sigma`` is subtracted once per arc and ``delay_penalty`` added to the delay kinds
    (``arc_weights``); the cost is that of the weighted lattice (k2 and NeMo report it so).
    FastEmit changes the gradient only (math.md section 6). ``boundary``: k2's ``(B, 4)``
    int64 ``[begin_symbol, begin_frame, end_symbol, end_frame]`` (replaces the lengths).
    ``node_rows``: ``logits`` are the rows ``(N, V)`` of a packed or pruned layout
    (``kind_log_probs``); the gradient is ``(N, V)`` too.
    """
    blank = check_topology(topo, logits.shape[-1], blank)
    T, U1 = (logits.shape[1:3] if node_rows is None else node_rows.shape[1:3])
    Ends.of(logit_lengths, target_lengths, boundary).check(T, U1)
    return costs_and_grad_unchecked(logits, targets, logit_lengths, target_lengths, topo, blank,
                                    log_softmax, clamp, fastemit_lambda, sigma, delay_penalty,
                                    boundary, need_grad, node_rows)


def costs_and_grad_unchecked(logits, targets, logit_lengths, target_lengths, topo: Topology,
                             blank: int, log_softmax: bool = True, clamp: float = -1.0,
                             fastemit_lambda: float = 0.0, sigma: float = 0.0,
                             delay_penalty: float = 0.0, boundary=None, need_grad: bool = True,
                             node_rows: torch.Tensor | None = None):
    """:func:`costs_and_grad` on arguments already checked (the torch backend's loss, behind
    ``_backends.prepare_call``): ``blank`` in ``[0, V_tok)``, the boundary within the
    lattice. No check here, so no host synchronisation on CUDA."""
    with torch.no_grad():
        ends = Ends.of(logit_lengths, target_lengths, boundary)
        lse, lse_dur, lp = kind_log_probs(logits, targets, topo, blank, log_softmax, ends,
                                          node_rows=node_rows)
        w = arc_weights(lp, topo, ends, sigma, delay_penalty)
        lat = lattice(w, topo, ends)
        costs = (-lat.log_like).to(logits.dtype)
        if not need_grad:
            return costs, None
        return costs, grad(logits, lse, lse_dur, lat, targets, topo, blank, log_softmax, ends,
                                   clamp, fastemit_lambda, node_rows)
