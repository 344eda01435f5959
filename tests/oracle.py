"""Independent float64 oracles for the tests: brute-force enumeration of every alignment.

Nothing here shares code with the library. A path through the lattice of one sequence
(frames ``T_b``, labels ``U_b``) is an interleaving of ``T_b - 1`` blanks and ``U_b``
labels followed by the final blank at ``(T_b-1, U_b)``; there are ``C(T_b-1+U_b, U_b)`` of
them, so keep the lattices tiny (``T_b + U_b <= ~10``).

The loss is ``-log sum_paths exp(sum of the path's arc log-probs)``, built from
``torch.log_softmax`` (fused mode) in float64, and its gradient comes from autograd: no
alpha, beta, occupation or fused-gradient formula of math.md is used. FastEmit, which is a
gradient *rule* rather than the gradient of a loss, is applied where it is defined: on the
gradient w.r.t. the label log-probs (scaled by ``1 + lambda``), then pulled back through
``log_softmax`` by autograd.
"""
from __future__ import annotations

import itertools
import math

import torch


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
    U = U1 - 1
    z = logits.detach().to(torch.float64).requires_grad_()
    logp = torch.log_softmax(z, dim=-1) if fused else z
    if T == 0:
        return math.inf, torch.zeros_like(z)
    scores, _ = path_log_probs(logp, y, blank, T, U)
    log_p = torch.logsumexp(scores, 0)
    if log_p.item() == -math.inf:
        return math.inf, torch.zeros_like(z)
    # Gradient of -log P w.r.t. the log-probs, then the FastEmit rule on the label entries.
    (g_logp,) = torch.autograd.grad(-log_p, logp, retain_graph=True)
    if fastemit_lambda:
        scale = torch.ones_like(g_logp)
        for u in range(U):
            scale[:, u, int(y[u])] = 1.0 + fastemit_lambda
        g_logp = g_logp * scale
    (g,) = torch.autograd.grad(logp, z, g_logp) if fused else (g_logp,)
    if clamp > 0:
        g = g.clamp(-clamp, clamp)
    return -log_p.item(), g


def batch_grad(logits, targets, logit_lengths, target_lengths, blank: int, fused: bool,
               clamp: float = -1.0, fastemit_lambda: float = 0.0):
    """Per-sequence losses ``(B,)`` and gradients ``(B, T, U+1, V)`` (zero in padding), float64."""
    B, T, U1, V = logits.shape
    blank = blank % V
    losses = torch.empty(B, dtype=torch.float64)
    grad = torch.zeros(logits.shape, dtype=torch.float64)
    for b in range(B):
        T_b, U_b = int(logit_lengths[b]), int(target_lengths[b])
        loss, g = sequence_grad(logits[b, :T_b, :U_b + 1], targets[b, :U_b], blank, fused,
                                clamp, fastemit_lambda)
        losses[b] = loss
        grad[b, :T_b, :U_b + 1] = g
    return losses, grad


def occupations(logits, y, blank: int, fused: bool):
    """Arc occupations of one sequence by enumeration: ``(gamma_blank, gamma_label)``, each
    ``(T_b, U_b+1)``: the probability that a path takes that arc."""
    T, U1, V = logits.shape
    logp = torch.log_softmax(logits.to(torch.float64), -1) if fused else logits.to(torch.float64)
    scores, paths = path_log_probs(logp, y, blank, T, U1 - 1)
    post = torch.softmax(scores, 0)
    gb = torch.zeros(T, U1, dtype=torch.float64)
    gl = torch.zeros(T, U1, dtype=torch.float64)
    for w, arcs in zip(post, paths):
        for t, u, is_label in arcs:
            (gl if is_label else gb)[t, u] += w
    return gb, gl
