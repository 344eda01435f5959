"""Which logits row each lattice node reads: the node -> row map of every layout (math.md
section 9).

Padded logits ``(B, T, U+1, V)`` are their own rows ``(B T (U+1), V)`` with the identity
map. The other layouts hand the kernels rows ``(N, V)`` and ``node_rows (B, T, U+1)``
int64, the row node ``(b, t, u)`` reads, ``-1`` for a node without one (every arc leaving
it weighs ``-inf``); every row is read by at most one node (the gradient passes write
each row once, from its node):

* packed (``packed=True``, optimized_transducer's and warp-rnnt's layout): the nodes of
  each lattice, sequence after sequence, frame after frame (:func:`packed_node_rows`);
* pruned windows ``(B, T, R, V)`` of ``rnnt_loss_pruned``: node ``(t, ranges[b, t, k])``
  reads window row ``k`` of frame ``t`` (:func:`pruned_node_rows`).

The backends' kernels read any map; this module only builds and inverts them.
"""
from __future__ import annotations

import torch

from ._validate import check_packed_args, check_packed_sizes, check_window_args


def node_mask(logit_lengths, target_lengths, T: int, U1: int) -> torch.Tensor:
    """(B, T, U+1) bool: True on the nodes ``t < T_b, u <= U_b`` of each sequence, the
    nodes that read logits (packed rows are these, in row-major order)."""
    t = torch.arange(T, device=logit_lengths.device)
    u = torch.arange(U1, device=logit_lengths.device)
    return (t[None, :, None] < logit_lengths[:, None, None]) & (u[None, None, :] <= target_lengths[:, None, None])


def rows_view(logits, node_rows):
    """The logits as rows ``(N, V)`` and the node -> row map ``(B, T, U+1)`` int64 (``-1``:
    the node reads no row). Padded logits ``(B, T, U+1, V)`` are their own rows with the
    identity map; with ``node_rows`` the logits already are rows."""
    if node_rows is None:
        B, T, U1, V = logits.shape
        return logits.reshape(B * T * U1, V), torch.arange(B * T * U1, device=logits.device).view(B, T, U1)
    return logits, node_rows


def row_nodes(node_rows: torch.Tensor, N: int) -> torch.Tensor:
    """Inverse of the node -> row map: ``(N,)`` int64, the flat node ``(b T + t)(U+1) + u``
    that reads each row, ``-1`` for a row no node reads. No host synchronisation."""
    flat = node_rows.reshape(-1)
    nodes = torch.arange(flat.numel(), device=flat.device)
    out = torch.full((N + 1,), -1, dtype=torch.int64, device=flat.device)
    out.scatter_(0, torch.where(flat >= 0, flat, N), nodes)   # slot N takes the rowless nodes
    return out[:N]


def row_sequences(node_rows: torch.Tensor, N: int) -> torch.Tensor:
    """``(N,)`` int64: the sequence whose node reads each row, ``B`` for a row no node reads."""
    B, T, U1 = node_rows.shape
    nodes = row_nodes(node_rows, N)
    return torch.where(nodes >= 0, nodes // (T * U1), B)


def packed_node_rows(logits, targets, logit_lengths, target_lengths) -> torch.Tensor:
    """The node -> row map ``(B, T, U+1)`` int64 of packed logits ``(sum_b T_b (U_b+1), V)``
    (row ``offset_b + t (U_b+1) + u``; ``-1`` off each lattice), with ``T = max_b T_b`` and
    ``U = targets.shape[1]``. Reads ``max T_b`` and the row count on the host (one sync on
    CUDA); ValueError unless the row count equals ``logits.shape[0]``."""
    check_packed_args(logits, targets, logit_lengths, target_lengths)
    dev = logits.device
    T_b, U_b = logit_lengths.to(dev, torch.int64), target_lengths.to(dev, torch.int64)
    B, U = targets.shape
    sizes = T_b * (U_b + 1)                                               # rows per sequence
    # The one host read: the grid's T, the row count and the lengths' range.
    T, N, lo, hi = (torch.stack([T_b.max(), sizes.sum(), torch.minimum(T_b.min(), U_b.min()),
                                 U_b.max()]).tolist() if B else (0, 0, 0, 0))
    check_packed_sizes(logits, T_b, U_b, U, N, lo, hi)
    offsets = torch.cumsum(sizes, 0) - sizes                              # (B,)
    t = torch.arange(T, device=dev)[None, :, None]
    u = torch.arange(U + 1, device=dev)[None, None, :]
    rows = offsets[:, None, None] + t * (U_b[:, None, None] + 1) + u       # (B, T, U+1)
    return torch.where(node_mask(T_b, U_b, T, U + 1), rows, -1)


def pack(logits: torch.Tensor, logit_lengths: torch.Tensor,
         target_lengths: torch.Tensor) -> torch.Tensor:
    """Padded logits ``(B, T, U+1, V)`` -> the packed rows ``(sum_b T_b (U_b+1), V)``
    (``rnnt_lattice.pack_logits``, which checks the arguments)."""
    B, T, U1, V = logits.shape
    valid = node_mask(logit_lengths.to(logits.device), target_lengths.to(logits.device), T, U1)
    return logits[valid]                     # boolean indexing keeps (b, t, u) row-major order


def pruned_node_rows(logits, targets, ranges) -> torch.Tensor:
    """The node -> row map ``(B, T, U+1)`` int64 of window logits ``(B, T, R, V)`` viewed
    as rows ``(B T R, V)``: node ``(t, ranges[b, t, k])`` reads row ``(b T + t) R + k``;
    ``-1`` outside the windows. No host synchronisation (the value checks run on CPU only)."""
    ranges = check_window_args(logits, targets, ranges)
    B, T, R, V = logits.shape
    U = targets.shape[1]
    rows = torch.arange(B * T * R, device=logits.device).view(B, T, R)
    node_rows = torch.full((B, T, U + 1), -1, dtype=torch.int64, device=logits.device)
    return node_rows.scatter_(2, ranges, rows)
