"""Independent float64 oracles for the tests: brute-force enumeration of every alignment.

Nothing here shares code with the library but the description of a topology (the arc-kind
dataclasses of ``rnnt_lattice.topology``: which arcs exist and what they read). The
enumerator ``topology_paths`` walks every complete path of any topology; the regular
functions below delegate to it, and ``alignments`` (the closed-form regular path set) is
kept as a cross-check of the enumerator. A regular path through the lattice of one sequence
(frames ``T_b``, labels ``U_b``) is an interleaving of ``T_b - 1`` blanks and ``U_b``
labels followed by the final blank at ``(T_b-1, U_b)``; there are ``C(T_b-1+U_b, U_b)`` of
them, so keep the lattices tiny (``T_b + U_b <= ~10``).

The loss is ``-log sum_paths exp(sum of the path's arc log-probs)``, built from
``torch.log_softmax`` (fused mode) in float64, and its gradient comes from autograd: no
alpha, beta, occupation or fused-gradient formula of math.md is used. FastEmit, which is a
gradient *rule* rather than the gradient of a loss, is applied where it is defined: on the
gradient w.r.t. the label log-probs (scaled by ``1 + lambda``), then pulled back through
``log_softmax`` by autograd. For other topologies the same holds per arc kind: a kind's
weight is its class read (scaled by FastEmit on ``fastemit`` kinds), plus its duration
log-prob (TDT, a second ``log_softmax`` group), plus ``b(t, u+1)`` (constrained), minus
sigma, plus the delay penalty, and clamp clips the token group only.
"""
from __future__ import annotations

import itertools
import math

import torch

# The topology dataclasses are a description (which arcs exist, what they read), not an
# algorithm: the enumerator below uses them, and nothing of the reference's recursion.
from rnnt_lattice.topology import Topology, regular


def alignments(T: int, U: int):
    """Every path of a (T, U) lattice as a list of arcs ``(t, u, is_label)``, final blank included."""
    if T == 0:
        return
    for label_slots in itertools.combinations(range(T - 1 + U), U):
        t = u = 0
        arcs = []
        slots = set(label_slots)
        for i in range(T - 1 + U):
            if i in slots:
                arcs.append((t, u, True))
                u += 1
            else:
                arcs.append((t, u, False))
                t += 1
        arcs.append((t, u, False))                  # the final blank at (T-1, U)
        yield arcs


def path_log_probs(logp: torch.Tensor, y, blank: int, T: int, U: int) -> tuple[torch.Tensor, list]:
    """(n_paths,) log-probability of every path given log-probs ``logp`` (T, U+1, V)."""
    paths = list(alignments(T, U))
    scores = []
    for arcs in paths:
        s = logp.new_zeros(())
        for t, u, is_label in arcs:
            s = s + logp[t, u, int(y[u]) if is_label else blank]
        scores.append(s)
    return (torch.stack(scores) if scores else logp.new_zeros((0,))), paths


def sequence_grad(logits: torch.Tensor, y, blank: int, fused: bool, clamp: float = -1.0,
                  fastemit_lambda: float = 0.0) -> tuple[float, torch.Tensor]:
    """Loss ``-log P`` and its per-sequence gradient (FastEmit rule, clamp) for one
    sequence whose logits ``(T_b, U_b+1, V)`` are already cut to its valid lattice."""
    T, U1, V = logits.shape
    return topology_sequence_grad(logits, y, regular(), blank, fused, (0, 0), (T, U1 - 1),
                                  clamp, fastemit_lambda)


def batch_grad(logits, targets, logit_lengths, target_lengths, blank: int, fused: bool,
               clamp: float = -1.0, fastemit_lambda: float = 0.0):
    """Per-sequence losses ``(B,)`` and gradients ``(B, T, U+1, V)`` (zero in padding), float64."""
    return topology_batch_grad(logits, targets, logit_lengths, target_lengths, regular(), blank,
                               fused, clamp, fastemit_lambda)


def occupations(logits, y, blank: int, fused: bool):
    """Arc occupations of one sequence by enumeration: ``(gamma_blank, gamma_label)``, each
    ``(T_b, U_b+1)``: the probability that a path takes that arc."""
    T, U1, V = logits.shape
    gamma = topology_occupations(logits, y, regular(), blank, fused, (0, 0), (T, U1 - 1))
    return gamma[0], gamma[1]


# ---------------------------------------------------------------------------------------
# Any topology (math.md section 9): enumerate the paths over its arc kinds
# ---------------------------------------------------------------------------------------

def topology_paths(topo: Topology, start, end) -> list:
    """Every complete path from node ``start = (t0, u0)`` to ``end = (t1, u1)``, as a list
    of arcs ``(t, u, k)``. An arc of kind k leaves ``(t, u)`` only if ``t < t1``, lands on
    ``(t + dt, u + du)`` with ``u + du <= u1`` and ``t + dt <= t1``, and may land on the end
    frame ``t1`` only if the kind is ``may_end`` (a path is complete when it reaches the end
    node). A lattice without frames (``t1 <= t0``) has no path."""
    (t0, u0), (t1, u1) = start, end
    if t1 <= t0:
        return []
    paths = []

    def walk(t, u, arcs):
        if (t, u) == (t1, u1):
            paths.append(list(arcs))
            return
        if t >= t1:
            return
        for k, kind in enumerate(topo.kinds):
            nt, nu = t + kind.dt, u + kind.du
            if nu > u1 or nt > t1 or (nt == t1 and not kind.may_end):
                continue
            arcs.append((t, u, k))
            walk(nt, nu, arcs)
            arcs.pop()

    walk(t0, u0, [])
    return paths


class _ScaleGrad(torch.autograd.Function):
    """Identity whose gradient is multiplied by ``scale``: FastEmit as a rule on one read."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def _kind_weights(z, y, topo: Topology, blank: int, fused: bool, t1: int, fastemit_lambda: float,
                  sigma: float, delay_penalty: float):
    """``(K, T, U+1)`` weight of kind k's arc leaving every node, built by autograd-able
    torch ops from ``z (T, U+1, V)`` (float64, finite or -inf wherever a path reads)."""
    T, U1, V = z.shape
    V_tok = V - topo.n_durations
    tok = torch.log_softmax(z[..., :V_tok], -1) if fused else z[..., :V_tok]
    dur = (torch.log_softmax(z[..., V_tok:], -1) if fused else z[..., V_tok:]) if topo.n_durations else None
    neg_inf = torch.full((T, 1), -math.inf, dtype=z.dtype)
    # Labels past the end (padding, possibly garbage ids) are read nowhere on a path.
    ids = [min(max(int(v), 0), V_tok - 1) for v in y[:U1 - 1]]
    label = torch.cat([tok[:, torch.arange(U1 - 1), ids], neg_inf], 1)
    frames = torch.arange(T, dtype=z.dtype)[:, None]
    out = []
    for kind in topo.kinds:
        read = {"blank": tok[..., blank], "label": label}.get(kind.reads)
        if read is None:
            read = tok[..., kind.class_id]
        if kind.fastemit and fastemit_lambda:
            read = _ScaleGrad.apply(read, 1.0 + fastemit_lambda)
        w = read
        if kind.duration >= 0:
            w = w + dur[..., kind.duration]
        if kind.plus_next_blank:
            w = w + torch.cat([tok[:, 1:, blank], neg_inf], 1)
        w = w - sigma
        if kind.delay and delay_penalty:
            w = w + delay_penalty * ((t1 - 1) / 2 - frames)
        out.append(w)
    return torch.stack(out)


def topology_sequence_grad(logits, y, topo: Topology, blank: int, fused: bool, start, end,
                           clamp: float = -1.0, fastemit_lambda: float = 0.0, sigma: float = 0.0,
                           delay_penalty: float = 0.0, allowed=None) -> tuple[float, torch.Tensor]:
    """Loss ``-log P`` and its gradient (FastEmit rule, clamp on the token group) for one
    sequence: ``logits (T, U+1, V)`` holding at least the rows ``t < t1, u <= u1``, labels
    ``y`` (at least ``u1``). Rows outside ``t0 <= t < t1, u0 <= u <= u1`` are never read
    (replaced by zeros) and get gradient 0. Frames ``t`` are absolute (delay penalty).
    ``allowed`` ``(T, U+1)`` bool (pruned windows): only paths whose every arc reads
    allowed rows count, and only allowed rows are read."""
    (t0, u0), (t1, u1) = start, end
    T, U1, V = logits.shape
    V_tok = V - topo.n_durations
    region = torch.zeros(T, U1, dtype=torch.bool)
    region[t0:t1, u0:u1 + 1] = True
    if allowed is not None:
        region &= allowed
    x = torch.where(region[..., None], logits.detach().to(torch.float64), 0.0)
    z = x.requires_grad_()
    paths = topology_paths(topo, start, end)
    if allowed is not None:
        # A window row is all an arc may read: its source node's, and for a
        # plus_next_blank kind (constrained) also the blank of (t, u+1) (k2: py is -inf
        # outside the windows).
        paths = [p for p in paths if all(
            bool(allowed[t, u]) and (not topo.kinds[k].plus_next_blank or bool(allowed[t, u + 1]))
            for t, u, k in p)]
    if not paths:
        return math.inf, torch.zeros_like(x)
    w = _kind_weights(z, y, topo, blank % V_tok, fused, t1, fastemit_lambda, sigma, delay_penalty)
    length = max(len(p) for p in paths)
    flat = w.reshape(-1)
    pad = flat.numel()                                   # index of an appended 0
    idx = torch.tensor([[(k * T + t) * U1 + u for t, u, k in p] + [pad] * (length - len(p))
                        for p in paths])
    scores = torch.cat([flat, flat.new_zeros(1)])[idx].sum(1)
    log_p = torch.logsumexp(scores, 0)
    if log_p.item() == -math.inf:
        return math.inf, torch.zeros_like(x)
    (g,) = torch.autograd.grad(-log_p, z)
    if clamp > 0:
        g = torch.cat([g[..., :V_tok].clamp(-clamp, clamp), g[..., V_tok:]], -1)
    return -log_p.item(), torch.where(region[..., None], g, 0.0)


def topology_batch_grad(logits, targets, logit_lengths, target_lengths, topo: Topology, blank: int,
                        fused: bool, clamp: float = -1.0, fastemit_lambda: float = 0.0,
                        sigma: float = 0.0, delay_penalty: float = 0.0, boundary=None,
                        allowed=None):
    """Per-sequence losses ``(B,)`` and gradients ``(B, T, U+1, V)`` (zero in padding), float64.
    ``boundary`` (B, 4) ``[begin_symbol, begin_frame, end_symbol, end_frame]`` replaces the
    lengths (k2). ``allowed`` ``(B, T, U+1)`` bool: see ``topology_sequence_grad``."""
    B, T, U1, V = logits.shape
    losses = torch.empty(B, dtype=torch.float64)
    grad = torch.zeros(logits.shape, dtype=torch.float64)
    for b in range(B):
        start, end = _ends(b, logit_lengths, target_lengths, boundary)
        loss, g = topology_sequence_grad(logits[b], targets[b], topo, blank, fused, start, end,
                                         clamp, fastemit_lambda, sigma, delay_penalty,
                                         None if allowed is None else allowed[b])
        losses[b] = loss
        grad[b] = g
    return losses, grad


def _ends(b, logit_lengths, target_lengths, boundary):
    if boundary is None:
        return (0, 0), (int(logit_lengths[b]), int(target_lengths[b]))
    s0, t0, s1, t1 = (int(v) for v in boundary[b])
    return (t0, s0), (t1, s1)


def topology_occupations(logits, y, topo: Topology, blank: int, fused: bool, start, end,
                         sigma: float = 0.0, delay_penalty: float = 0.0) -> torch.Tensor:
    """Per-kind arc occupations ``(K, T, U+1)`` of one sequence by enumeration: the
    posterior probability that a path takes kind k's arc leaving (t, u)."""
    T, U1, V = logits.shape
    w = _kind_weights(torch.nan_to_num(logits.to(torch.float64), nan=0.0), y, topo,
                      blank % (V - topo.n_durations), fused, end[0], 0.0, sigma, delay_penalty)
    gamma = torch.zeros(topo.K, T, U1, dtype=torch.float64)
    paths = topology_paths(topo, start, end)
    if not paths:
        return gamma
    scores = torch.stack([sum((w[k, t, u] for t, u, k in p), w.new_zeros(())) for p in paths])
    for post, p in zip(torch.softmax(scores, 0), paths):
        for t, u, k in p:
            gamma[k, t, u] += post
    return gamma


def topology_best_path(logits, y, topo: Topology, blank: int, fused: bool, start, end,
                       sigma: float = 0.0, delay_penalty: float = 0.0):
    """``(score, arcs)`` of the most probable path (``(-inf, [])`` when there is none)."""
    T, U1, V = logits.shape
    w = _kind_weights(torch.nan_to_num(logits.to(torch.float64), nan=0.0), y, topo,
                      blank % (V - topo.n_durations), fused, end[0], 0.0, sigma, delay_penalty)
    best = (-math.inf, [])
    for p in topology_paths(topo, start, end):
        score = sum(w[k, t, u].item() for t, u, k in p)
        if score > best[0]:
            best = (score, p)
    return best
