"""Which logits row each lattice node reads: the node -> row map of every layout (math.md
section 9).

Padded logits ``(B, T, U+1, V)`` are their own rows ``(B T (U+1), V)`` with the identity
map. The other layouts hand the kernels rows ``(N, V)`` and ``node_rows (B, T, U+1)``
int64, the row node ``(b, t, u)`` reads, ``-1`` for a node without one (every arc leaving
it weighs ``-inf``); every row is read by exactly one node (the gradient passes write
each row once, from its node; a row no node read would keep whatever the buffer held):

* packed (``packed=True``, optimized_transducer's and warp-rnnt's layout): the nodes of
  each lattice, sequence after sequence, frame after frame (:func:`packed_node_rows`);
* pruned windows ``(B, T, R, V)`` of ``rnnt_loss_pruned``: node ``(t, ranges[b, t, k])``
  reads window row ``k`` of frame ``t`` (:func:`pruned_node_rows`);
* tiles of the fused joiner and loss (``rnnt_lattice.fused``): the nodes of a box of
  frames and label positions read the rows of the joiner's output on that box, every
  other node none (:func:`tile_plan`, :func:`tile_node_rows`).

The backends' kernels read any map; this module only builds and inverts them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


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


def packed_node_rows(logit_lengths, target_lengths, grid: tuple) -> torch.Tensor:
    """The node -> row map ``(B, T, U+1)`` int64 of packed logits ``(sum_b T_b (U_b+1), V)``
    (row ``offset_b + t (U_b+1) + u``; ``-1`` off each lattice) on the lengths' device, for
    the ``grid`` ``(B, T, U+1)`` that ``_validate.check_call`` read from the lengths (and
    checked against the rows). No host read here."""
    B, T, U1 = grid
    T_b, U_b = logit_lengths.to(torch.int64), target_lengths.to(torch.int64)
    sizes = T_b * (U_b + 1)                                               # rows per sequence
    offsets = torch.cumsum(sizes, 0) - sizes                              # (B,)
    t = torch.arange(T, device=T_b.device)[None, :, None]
    u = torch.arange(U1, device=T_b.device)[None, None, :]
    rows = offsets[:, None, None] + t * (U_b[:, None, None] + 1) + u       # (B, T, U+1)
    return torch.where(node_mask(T_b, U_b, T, U1), rows, -1)


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
    ``-1`` outside the windows; ``ranges`` int64, checked by the caller
    (``_validate.check_window_args``). No host synchronisation."""
    B, T, R, V = logits.shape
    U = targets.shape[1]
    rows = torch.arange(B * T * R, device=logits.device).view(B, T, R)
    node_rows = torch.full((B, T, U + 1), -1, dtype=torch.int64, device=logits.device)
    return node_rows.scatter_(2, ranges, rows)


# --------------------------------------------------------------------------- tiles
@dataclass(frozen=True)
class Tile:
    """One tile of the fused joiner and loss (``rnnt_lattice.fused``, math.md section 11):
    frames ``t0 <= t < t1`` and label positions ``u0 <= u < u1`` of every sequence of the
    grid ``(B, T, U+1)``, whose logits are rows ``(B (t1-t0) (u1-u0), V)`` in row-major
    order ``(b, t, u)``. ``node_rows (B, T, U+1)`` int64 is its node -> row map, built on
    first use (a backend that launches over the box never builds it)."""

    t0: int
    t1: int
    u0: int
    u1: int
    grid: tuple              # (B, T, U+1)
    device: torch.device

    @property
    def box(self) -> tuple[slice, slice]:
        """``(frames, label positions)`` of the tile, to index node tensors ``[:, t, u]``."""
        return slice(self.t0, self.t1), slice(self.u0, self.u1)

    @functools.cached_property
    def node_rows(self) -> torch.Tensor:
        """``(B, T, U+1)`` int64: node ``(b, t, u)`` of the box reads row ``(b (t1-t0) + t -
        t0)(u1-u0) + u - u0``, every other node ``-1``."""
        B, T, U1 = self.grid
        node_rows = torch.full((B, T, U1), -1, dtype=torch.int64, device=self.device)
        n = B * (self.t1 - self.t0) * (self.u1 - self.u0)
        node_rows[:, self.box[0], self.box[1]] = torch.arange(n, device=self.device).view(
            B, self.t1 - self.t0, self.u1 - self.u0)
        return node_rows


def tile_plan(B: int, T: int, U1: int, rows: int, frames_only: bool) -> list[tuple]:
    """The tiles ``(t0, t1, u0, u1)`` that cover the grid ``(B, T, U+1)``, each of at most
    ``rows`` nodes (logits rows) where possible, from the shapes alone (no tensor value
    is read: no host synchronisation). Whole frames ``[t0, t1)`` of ``max(1, rows //
    (B (U+1)))`` frames each; when one frame holds more than ``rows`` nodes and
    ``frames_only`` is False, one frame per tile cut into runs of ``max(1, rows // B)``
    label positions. ``frames_only`` (topologies with ``plus_next_blank`` kinds, whose
    arcs read the blank of the next label position): one frame is the smallest tile."""
    if B == 0 or T == 0 or U1 == 0:
        return []
    per_frame = B * U1
    if rows >= per_frame or frames_only:
        f = max(1, rows // per_frame)
        return [(t, min(T, t + f), 0, U1) for t in range(0, T, f)]
    g = max(1, rows // B)
    return [(t, t + 1, u, min(U1, u + g)) for t in range(T) for u in range(0, U1, g)]


def tile_node_rows(B: int, T: int, U1: int, t0: int, t1: int, u0: int, u1: int,
                   device) -> Tile:
    """The :class:`Tile` of frames ``[t0, t1)`` and label positions ``[u0, u1)`` of the grid
    ``(B, T, U+1)`` (its ``node_rows`` map is built on first use)."""
    return Tile(t0, t1, u0, u1, (B, T, U1), torch.device(device))
