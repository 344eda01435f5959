"""The joiner and the loss in one pass over V (docs/math.md section 12): the kernels of
``rnnt_lattice.Joiner``'s kernel path and their launches.

The joiner is ``x(t,u) = W act(e(t) + p(u)) + b`` on projected inputs ``e (B, T, H)`` and
``p (B, U+1, H)``, ``W (V, H)``, ``b (V,)``, ``act`` tanh or ReLU. Nodes are taken in
chunks (``_layout.tile_plan``: whole frames of every sequence, or runs of label positions
of one frame), and for each chunk:

forward   ``_joint_row_kernel``, ``BLOCK_N`` nodes per program:
            1. ``h = act(e + p)`` of its nodes, once, into the chunk's ``h`` rows (the
               operand dtype: what the dot products read);
            2. for each block of ``BLOCK_V`` classes: ``z = h W_blk^T + b_blk`` (``tl.dot``
               over H in steps of ``BLOCK_H``, accumulated in float32, float64 for float64),
               folded into an online log-sum-exp (the max's ties counted apart:
               ``kernels._lse_chunk``), and the entries the arc kinds read (the blank,
               ``y[u]``, fixed classes) picked out; TDT's durations in one more block;
            3. the lattice state of its nodes (``lse``, arc log-probs: ``kernels._row_state``,
               the row pass's own writer) and, for a gradient, the entries read (the
               workspace's ``x``).
          The logits exist one ``[BLOCK_N, BLOCK_V]`` block at a time, in registers. Then the
          backend's lattice and coefficient passes, unchanged (``gpu.tile_lattice``).
backward  ``_joint_grad_kernel``: ``h`` again (into the chunk's ``h`` rows), ``z`` block by
          block as in the forward, and ``dz = upstream[b] * d cost_b / d z`` from the
          gradient pass's formula (``kernels._token_grad`` & co., clamp and FastEmit
          included; the entries the arcs read formed in float64 from ``x``) written into the
          chunk's ``dz`` rows (the operand
          dtype); per program the column sums of its ``dz`` (``db``'s share). Then the
          chunk's joiner gradients, as matrix products on whole chunks (cuBLAS):

              dh = dz W                      (n, H)
              dW += dz^T h,  db += sum_rows dz
              da = dh * act'(a)              (``_joint_act_grad_kernel``: act' from h)
              dP[b,u] += sum_t da,  dE[b,t] += sum_u da   (partial sums, added in order)

          The chunks run in order and every sum has a fixed order: two runs give the same
          bits. The ``dz`` rows of a chunk are what a chunk holds besides ``h`` and ``dh``:
          the logits themselves are never in memory, forward or backward.

With :data:`CUBLAS_PRODUCTS` (off until a GPU times it) a chunk's logits are made by
cuBLAS instead and written once: ``_joint_hidden_kernel`` writes the chunk's ``h``,
``torch.addmm`` its logits ``z`` (the operands' dtype), and the backend's own passes over V
read them (``gpu.tile_forward``; in the backward ``gpu.tile_backward`` writes ``dz`` over
the recomputed ``z``); the joiner's gradients follow as above. One chunk of logits is in
memory at a time, forward and backward.

Why the backward writes ``dz`` (docs/math.md section 12, docs/benchmarks.md): ``dh`` sums
over V and ``dW`` over the nodes, each with H = 512-640 free columns; holding either sum in
registers (``BLOCK x H`` float32) does not fit beside the ``z`` block without recomputing
``z`` once per slice of H (7-9 matrix products per step instead of 4).

Precision: operands in the dtype of the call (bfloat16/float16 under autocast, float32, or
float64), products accumulated in float32 (float64 for float64); float32 uses TF32 in the
dot products exactly where ``torch.backends.cuda.matmul.allow_tf32`` lets PyTorch's own
matrix products use it. The lattice is float64, as everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import _layout
from .._types import LossOptions
from . import (INTERPRETED, _State, _Tiles, _acc, _costs_dtype, _device, _f64_cached, _kernel_kinds,
               _nonempty, _or, _prepare, _pow2, check_device, tile_backward, tile_forward,
               tile_lattice)
from . import _layout as _ws_layout
from .kernels import (NEG_INF, _class_entry_of, _class_reads, _duration_grad,
                      _duration_terms, _ends, _entries, _f64, _grad_out, _grad_rows,
                      _grad_terms, _lse_chunk, _lse_finish, _node_coords, _row_node,
                      _row_plane_at, _row_state, _token_grad)
from ._launch import launch

__all__ = ["ACTIVATIONS", "JointState", "act_grad", "forward", "backward", "takes"]

# The activations the kernels know (``ACT``).
ACTIVATIONS = {"tanh": 0, "relu": 1}

# Blocks of the two passes: nodes x classes per program, H per dot step, warps, pipeline
# stages, and a cap on registers a thread (``maxnreg``). 128 nodes x 64 classes over 8 warps
# capped at 128 registers: two programs share a multiprocessor, so that one's epilogue (the
# log-sum-exp, the gradient's formula and its stores) runs while the other's products do.
# Chosen on an H200 (benchmarks/joint_tiles.py at j1, H = 512, bf16;
# benchmarks/results/gpu/h200-0fd8b8d-joint_tiles.log): the step took 19.69 ms (row pass
# 5.28, gradient pass 6.73) against 21.86 (5.85, 8.16) with the blocks before it, 128 x 128
# over 16 warps with no cap, which one program held with the whole register file (chosen
# on an H100, h100-tiles-jt_*.log); 128 x 128 on 8 warps capped at 128: 20.02 ms (the
# fastest row pass, 5.17, but 160 bytes of spills), 64 x 128 on 4 warps capped at 168
# (three programs): 19.96; every other choice 21.6-26.8 ms. Compiled for sm_90 (Triton 3.6,
# results/joint/sm90-triton36-occupancy.md): 128 registers, 72 KiB of shared memory, no
# spill in bf16 at j1; TDT at j4 (V = 8198, H = 640) spills 16 bytes (row) and 96
# (gradient), not timed yet.
#
# The loop over the blocks of classes and its loop over H as one loop (``tl.range``'s
# ``flatten``), so that the pipeline loads the next block's first steps of h and W while the
# block before folds its logits, was timed on an H200 with the blocks before
# (h200-0fd8b8d-joint_tiles.log): 22.30 ms flattened in the row pass, 22.62 in both, against
# 21.86 nested. It lost, and is gone (docs/benchmarks.md, "A third H200 session").
TILES = {"row": dict(BLOCK_N=128, BLOCK_V=64, BLOCK_H=64, num_warps=8, num_stages=3,
                     maxnreg=128),
         "grad": dict(BLOCK_N=128, BLOCK_V=64, BLOCK_H=64, num_warps=8, num_stages=3,
                      maxnreg=128)}
# Wider operands, by their size in bytes, over TILES (``maxnreg=None``: no cap). float32:
# 128 x 128 over 16 warps, 32 of H per step in three pipeline stages (three of [128, 64]
# float32 blocks of h and W need more shared memory than sm_90 has; on an H200,
# benchmarks/results/gpu/h200-65ccde2-joint_tiles_tf32.log, the TF32 step took 38.1 ms
# against 42.5 with 64 of H in two stages; with Triton 3.6 for sm_90 the spills fell to
# 0-64 bytes from 8-120). The half types' capped blocks are not timed with float32 operands
# (joint_tiles.py --precision tf32), so float32 keeps its timed ones. float64 (the exactness
# checks) in smaller blocks (the float32 blocks spilled 136-536 bytes a thread).
WIDE = {4: dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=32, num_warps=16, num_stages=3,
                maxnreg=None),
        8: dict(BLOCK_N=64, BLOCK_V=64, BLOCK_H=16, num_warps=4, num_stages=2, maxnreg=None)}
# A pass's entries that are Triton's launch options rather than constexprs: warps, pipeline
# stages, and the cap on registers a thread (``maxnreg``, ptxas' ``.maxnreg``; None: no
# cap), which decides how many programs share a multiprocessor (its 65536 registers).
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")
# The act-grad pass: label positions and H per program (it runs over the chunk's frames),
# the next frame's loads issued before this frame's sums (``PREFETCH``), warps. Untimed: on
# an H200 at j1 in bf16 the pass took 1.38 ms of the 19.7 ms step, about 47% of the copy
# bandwidth for the 2.7 GB it moves. Compiled for sm_90 (Triton 3.6), its frame loop holds
# the sum over label positions across warps (5 barriers and 20 shuffles a frame), and
# without ``PREFETCH`` no load is in flight while it runs (docs/benchmarks.md, "The
# joiner's act-grad pass: loads ahead of its sums"); ``joint_tiles.py --act-grad`` times
# the choices of ``joint_tiles.ACT_GRAD_CANDIDATES`` on a GPU.
ACT_GRAD = dict(BLOCK_U=32, BLOCK_H=64, PREFETCH=False, num_warps=4)

# The chunk's logits by cuBLAS (off until a GPU times it): per chunk, ``h`` by
# ``_joint_hidden_kernel``, ``z = h W^T + b`` by ``torch.addmm`` into one chunk of logits in
# the operands' dtype, and the backend's own V passes on it (``gpu.tile_forward``,
# ``gpu.tile_backward``, the gradient written over ``z``), in place of the two passes that
# make each block of logits in registers. The products then run at cuBLAS's rate: on an
# H200 at j1 in bf16 the kernel path's two cuBLAS products took 3.5 ms a step together,
# its row and gradient passes, one product each plus their epilogues, 5.28 and 6.73 ms; the
# V passes read a chunk's bf16 logits (2.6 GB a step) once forward and read and write them
# once backward. The logits of one chunk are in memory (the ``tile``'s budget, as the dz of
# the backward already is); the loss is that of the logits rounded to the operands' dtype,
# as the full pipeline's. Every dtype takes it (``takes``): float32 with IEEE products and
# float64 too, whose products are cuBLAS's either way.
CUBLAS_PRODUCTS = False
# Its hidden pass's blocks: rows and columns of H a program, warps (Triton 3.6, sm_90, H =
# 512: 44 registers in bf16, 72 in fp32, 146 in fp64, no stack).
HIDDEN = dict(BLOCK_N=16, BLOCK_H=128, num_warps=4)

_JOINT_SHAPES = ("n_rows", "n_nodes", "T", "U1", "blank", "dz_stride", "upstream_stride", "box_t0",
                 "box_u0", "box_T", "box_U1", "o_lse", "o_dur", "o_nb", "o_lp", "o_ll",
                 "o_reads", "o_x")


# --------------------------------------------------------------------------- kernels
@triton.jit
def _act(a, ACT: tl.constexpr):
    """``act(a)``: tanh as ``1 - 2 / (exp(2a) + 1)`` (exact at both ends: ``exp`` overflows
    to inf, giving 1, or underflows to 0, giving -1; absolute error of the order of the
    dtype's epsilon near 0, the dot products' own rounding) or ReLU (NaN stays NaN, as
    ``torch.relu``)."""
    if ACT == 0:
        return 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
    return tl.where(a < 0.0, 0.0, a)


@triton.jit
def _act_grad(h, ACT: tl.constexpr):
    """``act'(a)`` from ``h = act(a)``: ``1 - h^2`` (tanh), ``[h > 0]`` (ReLU)."""
    if ACT == 0:
        return 1.0 - h * h
    return tl.where(h > 0.0, 1.0, 0.0).to(h.dtype)


@triton.jit
def _joint_hidden(enc_ptr, pred_ptr, h_ptr, rows, e_row, p_row, live, n_k, H,
                  ACT: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """``h = act(e(t) + p(u))`` of the nodes of a program, 0 on the rows not ``live``,
    written in ``n_k`` columns (H, or 0 for nothing) of the chunk's rows ``rows`` of
    ``h (n, H)``, in its dtype; then a barrier, so that every thread of the program reads
    them back (``_joint_logits``)."""
    kk = tl.arange(0, BLOCK_H)
    on = rows >= 0
    for k0 in range(0, n_k, BLOCK_H):
        k = k0 + kk
        m = live[:, None] & (k[None, :] < H)
        a = (tl.load(enc_ptr + e_row[:, None] + k[None, :], mask=m, other=0.0).to(ACC)
             + tl.load(pred_ptr + p_row[:, None] + k[None, :], mask=m, other=0.0).to(ACC))
        h = tl.where(m, _act(a, ACT), 0.0)
        tl.store(h_ptr + rows[:, None] * H + k[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=on[:, None] & (k[None, :] < H))
    tl.debug_barrier()


@triton.jit
def _joint_logits(h_ptr, w_ptr, bias_ptr, rows, v, v_ok, n_k, H,
                  HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
                  DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """The logits block ``z = h W[v]^T + b[v]`` ``[BLOCK_N, BLOCK_V]`` (ACC) of the chunk's
    rows ``rows`` (-1: none) and classes ``v`` (``v_ok``: the classes that exist), the
    product over ``n_k`` columns of H (0: none, ``z = b``) in steps of ``BLOCK_H``.
    ``DOT_F32``: the operands widened to float32 first (bfloat16 under the Triton
    interpreter, whose ``tl.dot`` multiplies bfloat16's raw bits: NumPy has no bfloat16);
    the products of bfloat16 values are exact in float32 either way."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], ACC)
    kk = tl.arange(0, BLOCK_H)
    on = rows >= 0
    for k0 in range(0, n_k, BLOCK_H):
        k = k0 + kk
        km = k < H
        h = tl.load(h_ptr + rows[:, None] * H + k[None, :], mask=on[:, None] & km[None, :],
                    other=0.0)
        w = tl.load(w_ptr + v[:, None] * H + k[None, :], mask=v_ok[:, None] & km[None, :],
                    other=0.0)
        if DOT_F32:
            acc = tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                         input_precision=PRECISION)
        else:
            acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION, out_dtype=ACC)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + v, mask=v_ok, other=0.0).to(ACC)[None, :]
    return acc


@triton.jit
def _joint_nodes(r, n_rows, T, U1, box_t0, box_u0, box_T, box_U1, H):
    """The nodes of the chunk's rows ``r`` (its box, ``kernels.BOX``): ``(rows, node, b, t,
    u, e_row, p_row)`` -- ``rows`` r, -1 past the chunk; the offsets of ``e(t)`` and
    ``p(u)`` in ``enc (B, T, H)`` and ``pred (B, U+1, H)`` (int64)."""
    node, inside = _row_node(r, r < n_rows, r, T, U1, box_t0, box_u0, box_T, box_U1, 2)
    b, t, u = _node_coords(node, T, U1)
    rows = tl.where(inside, r, -1)
    return rows, node, inside, b, t, u, (b * T + t) * H, (b * U1 + u) * H


@triton.jit(do_not_specialize=_JOINT_SHAPES)
def _joint_row_kernel(
    # data ptrs
    enc_ptr, pred_ptr, w_ptr, bias_ptr, h_ptr, targets_ptr, logit_lengths_ptr,
    target_lengths_ptr, boundary_ptr, ws_ptr,
    # shapes: the chunk's rows (its box of the grid), the grid; the workspace parts written
    n_rows, n_nodes, T, U1, V_tok, H, blank, box_t0, box_u0, box_T, box_U1, o_lse,
    o_dur, o_nb, o_lp, o_x,
    # arc kinds
    K: tl.constexpr, KP: tl.constexpr, DT: tl.constexpr, DU: tl.constexpr, READS: tl.constexpr,
    CLASS_ID: tl.constexpr, DURATION: tl.constexpr, PLUS_NEXT_BLANK: tl.constexpr,
    FASTEMIT: tl.constexpr, DELAY: tl.constexpr, MAY_END: tl.constexpr,
    N_DURATIONS: tl.constexpr, HAS_PLUS_NEXT_BLANK: tl.constexpr, N_CLS: tl.constexpr,
    CLS_COL: tl.constexpr,
    # flags
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, FUSED: tl.constexpr, ENTRIES: tl.constexpr,
    BOUNDARY: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DUR: tl.constexpr, WIDE: tl.constexpr,
):
    """The row pass of ``BLOCK_N`` nodes of a chunk without their logits (module
    docstring): the token group's log-normaliser over the logits blocks ``z = h W^T + b``,

        lse(t,u) = logsumexp_{v < V_tok} z(t,u,v)          (online, kernels._lse_chunk)

    TDT's ``lse_dur`` over its ``N_DURATIONS`` columns, and every kind's arc log-prob from
    the entries it reads, written by ``kernels._row_state`` exactly as ``_row_kernel``
    writes them; with ``ENTRIES`` (fused, for a gradient) those entries too (the blank's,
    the label's, each fixed class kind's: the workspace's ``x``), from which the gradient
    pass forms theirs in float64. A program whose nodes are all padding computes nothing.

    The max's ties are counted in the sums (``_lse_chunk``), not summed in float32: a
    confident row's ``1 + rest`` rounded ``rest`` away (math.md 4.1)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)    # [BLOCK_N], int64
    rows, node, inside, b, t, u, e_row, p_row = _joint_nodes(r, n_rows, T, U1, box_t0,
                                                              box_u0, box_T, box_U1, H)
    t0, u0, t1, u1 = _ends(boundary_ptr, logit_lengths_ptr, target_lengths_ptr, b, inside,
                           T, U1, BOUNDARY)
    valid = inside & (t >= t0) & (t < t1) & (u >= u0) & (u <= u1)
    busy = tl.max(valid.to(tl.int32), axis=0) > 0
    n_k = tl.where(busy, H, 0)
    # 1. h, once
    _joint_hidden(enc_ptr, pred_ptr, h_ptr, rows, e_row, p_row, valid, n_k, H, ACT, ACC,
                  BLOCK_N, BLOCK_H)
    # 2. the token group: online log-sum-exp and the entries the kinds read
    has_label = valid & (u < u1)
    y = tl.load(targets_ptr + b * (U1 - 1) + u, mask=has_label, other=-1)
    y = tl.where(has_label & (y >= 0) & (y < V_tok), y, -1)
    offs = tl.arange(0, BLOCK_V)
    kidx = tl.arange(0, KP)
    m = tl.full([BLOCK_N], NEG_INF, ACC)
    s = tl.zeros([BLOCK_N], tl.float64)
    x_blank = tl.zeros([BLOCK_N], ACC)
    x_label = tl.zeros([BLOCK_N], ACC)
    x_cls = tl.zeros([BLOCK_N, KP], ACC)
    for v0 in range(0, tl.where(busy, V_tok, 0), BLOCK_V):
        v = v0 + offs
        z = _joint_logits(h_ptr, w_ptr, bias_ptr, rows, v, v < V_tok, n_k, H, HAS_BIAS,
                          PRECISION, ACC, DOT_F32, BLOCK_N, BLOCK_V, BLOCK_H)
        z = tl.where(v[None, :] < V_tok, z, NEG_INF)
        if FUSED:
            m, s = _lse_chunk(m, s, z, 2)         # (the max's ties: see _lse_chunk)
        if (v0 <= blank) & (blank < v0 + BLOCK_V):
            x_blank = tl.sum(tl.where(v[None, :] == blank, z, 0.0), axis=1)
        x_label += tl.sum(tl.where(v[None, :] == y[:, None], z, 0.0), axis=1)
        for k in tl.static_range(K):
            if READS[k] == 2:
                if (v0 <= CLASS_ID[k]) & (CLASS_ID[k] < v0 + BLOCK_V):
                    xk = tl.sum(tl.where(v[None, :] == CLASS_ID[k], z, 0.0), axis=1)
                    x_cls = tl.where(kidx[None, :] == k, xk[:, None], x_cls)
    if FUSED:
        lse = _lse_finish(m, s)
    else:
        lse = tl.zeros([BLOCK_N], tl.float64)   # log-prob mode: the logits are log-probs
    # 3. TDT's duration group: one block of its N_DURATIONS columns after the tokens
    x_dur = tl.zeros([BLOCK_N, BLOCK_DUR], ACC)
    if N_DURATIONS > 0:
        d = tl.arange(0, BLOCK_DUR)
        zd = _joint_logits(h_ptr, w_ptr, bias_ptr, rows, V_tok + d, d < N_DURATIONS, n_k, H,
                           HAS_BIAS, PRECISION, ACC, DOT_F32, BLOCK_N, BLOCK_DUR, BLOCK_H)
        zd = tl.where(d[None, :] < N_DURATIONS, zd, NEG_INF)
        if FUSED:
            md, sd = _lse_chunk(tl.full([BLOCK_N], NEG_INF, ACC), tl.zeros([BLOCK_N], tl.float64),
                                zd, 2)
            lse_dur = _lse_finish(md, sd)
        else:
            lse_dur = tl.zeros([BLOCK_N], tl.float64)
        x_dur = zd
    else:
        lse_dur = lse
    live = valid & (lse != NEG_INF)          # NaN rows stay live: NaN flows on
    if ENTRIES:
        # the entries the arcs read, for the gradient pass (the workspace's ``x``)
        x_at = ws_ptr + o_x + node
        tl.store(x_at, x_blank.to(tl.float64), mask=inside)
        tl.store(x_at + n_nodes, x_label.to(tl.float64), mask=inside)
        for k in tl.static_range(K):
            if READS[k] == 2:
                xk = tl.sum(tl.where(kidx[None, :] == k, x_cls, 0.0), axis=1)
                tl.store(x_at + (CLS_COL[k] - 1) * n_nodes, xk.to(tl.float64), mask=inside)
        didx = tl.arange(0, BLOCK_DUR)
        for i in tl.static_range(N_DURATIONS):        # TDT's durations, a column at a time
            xi = tl.sum(tl.where(didx[None, :] == i, x_dur, 0.0), axis=1)
            tl.store(x_at + (2 + N_CLS + i) * n_nodes, xi.to(tl.float64), mask=inside)
    at, plane = _row_plane_at(node, b, t, u, T, U1, WIDE)
    _row_state(ws_ptr, node, inside, valid, live, valid & (lse_dur != NEG_INF), live & (u < u1),
               b, at, plane, u, u1, T, U1, lse, lse_dur,
               x_blank.to(tl.float64), x_label.to(tl.float64),
               x_cls.to(tl.float64), x_dur.to(tl.float64), o_lse, o_dur, o_nb, o_lp, K, KP,
               DU, READS, DURATION, N_DURATIONS, HAS_PLUS_NEXT_BLANK, FUSED)


@triton.jit(do_not_specialize=_JOINT_SHAPES)
def _joint_grad_kernel(
    # data ptrs
    enc_ptr, pred_ptr, w_ptr, bias_ptr, h_ptr, dz_ptr, db_ptr, targets_ptr,
    logit_lengths_ptr, target_lengths_ptr, boundary_ptr, ws_ptr, upstream_ptr,
    # shapes and strides: the chunk's rows (its box), the grid; the workspace parts read
    n_rows, n_nodes, T, U1, V_tok, H, blank, dz_stride, upstream_stride, box_t0,
    box_u0, box_T, box_U1, o_lse, o_dur, o_ll, o_reads, o_x,
    # options: clamp, a float64 in three float32 parts
    clamp_hi, clamp_mid, clamp_lo,
    # arc kinds
    K: tl.constexpr, READS: tl.constexpr, CLASS_ID: tl.constexpr,
    DURATION: tl.constexpr, N_DURATIONS: tl.constexpr, N_CLS: tl.constexpr,
    CLS_COL: tl.constexpr, DUR_COL: tl.constexpr, CLS_FIRST: tl.constexpr,
    # flags
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, FUSED: tl.constexpr, CLAMP: tl.constexpr,
    BOUNDARY: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_DUR: tl.constexpr,
):
    """``dz = upstream[b] * clip(d cost_b / d z)`` of ``BLOCK_N`` rows of a chunk, with
    ``z = h W^T + b`` recomputed block by block in registers (as ``_joint_row_kernel``
    computes it) and the gradient pass's formula (math.md 9.2, ``_grad_kernel``):

        dz(v) = p_g(v) S_g - sum_{reads of class v} s_k gamma_k,   p_g(v) = exp(z_v - lse_g)

    clamp on the token group. In fused mode the entries the arcs read (the blank's, the
    label's, the fixed classes', TDT's durations) are formed in float64, as the gradient
    pass forms them (``kernels._entries``, ``_class_entry_of``, ``_duration_step``), from
    the forward's entries (the workspace's ``x``: the values its ``lse`` and the lattice
    saw, whatever bits this pass's products give): near ``p = 1`` (a confident model)
    ``p S - gamma`` cancels, and float32 kept only the rounding of ``p``. Writes ``h`` (0
    on rows without a path), ``dz`` (0 on
    padding, impossible sequences and a zero upstream gradient; NaN on a NaN sequence's
    rows) and the program's column sums of ``dz`` into ``db_ptr[program]``."""
    pid = tl.program_id(0)
    r = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)                 # [BLOCK_N], int64
    rows, node, inside, b, t, u, e_row, p_row = _joint_nodes(r, n_rows, T, U1, box_t0,
                                                              box_u0, box_T, box_U1, H)
    # COSTS32 off: the Function zeroes the upstream gradient of infinite costs itself.
    keep, nan_row, write, w_up, reads, mass, no_mass, gb_a, gl_a = _grad_terms(
        ws_ptr, logit_lengths_ptr, target_lengths_ptr, boundary_ptr, upstream_ptr, node,
        inside, n_nodes, T, U1, upstream_stride, o_ll, o_reads, BOUNDARY, ACC, False)
    clamp = _f64(clamp_hi, clamp_mid, clamp_lo).to(ACC)
    y, live, lse_hi, lse_lo = _grad_rows(ws_ptr, targets_ptr, logit_lengths_ptr,
                                         target_lengths_ptr, boundary_ptr, node, inside, keep,
                                         mass, T, U1, o_lse, BOUNDARY, ACC)
    x_at = ws_ptr + o_x + node
    if FUSED:
        # the blank's and the label's entries, in float64 from the forward's logits
        rb, rl = _entries(tl.load(x_at, mask=live, other=NEG_INF),
                          tl.load(x_at + n_nodes, mask=live & (y >= 0), other=NEG_INF),
                          ws_ptr, node, reads, keep, live, y, blank, n_nodes, o_lse, ACC)
    else:
        rb, rl = gb_a, gl_a
    # 1. h of every row of the chunk (the product dW = dz^T h reads them all)
    _joint_hidden(enc_ptr, pred_ptr, h_ptr, rows, e_row, p_row, keep, H, H, ACT, ACC, BLOCK_N,
                  BLOCK_H)
    busy = tl.max(live.to(tl.int32), axis=0) > 0
    n_k = tl.where(busy, H, 0)
    V = V_tok + N_DURATIONS
    on = rows >= 0
    # Rows of dz start at multiples of 16 entries (the buffer's row stride is): vector stores.
    dz_row = tl.multiple_of(tl.where(on, rows, 0) * dz_stride, 16)
    # 2. the token group, block by block
    offs = tl.arange(0, BLOCK_V)
    for v0 in range(0, V_tok, BLOCK_V):
        v = v0 + offs
        z = _joint_logits(h_ptr, w_ptr, bias_ptr, rows, v, v < V_tok, n_k, H, HAS_BIAS,
                          PRECISION, ACC, DOT_F32, BLOCK_N, BLOCK_V, BLOCK_H)
        if FUSED:
            x = tl.where(live[:, None] & (v[None, :] < V_tok), z, NEG_INF)
        else:
            x = tl.zeros([BLOCK_N, BLOCK_V], ACC)
        g = _token_grad(x, v[None, :], lse_hi, lse_lo, mass, no_mass, rb, rl, blank, y,
                        FUSED, FUSED)
        g = _grad_out(g, nan_row[:, None], clamp, write[:, None], w_up[:, None], FUSED, CLAMP)
        g = tl.where(v[None, :] < V_tok, g, 0.0)
        out = v < V_tok
        for k in tl.static_range(K):
            if READS[k] == 2:                 # the fixed classes' columns are step 3's
                out = out & (v != CLASS_ID[k])
        tl.store(dz_ptr + dz_row[:, None] + v[None, :], g.to(dz_ptr.dtype.element_ty),
                 mask=on[:, None] & out[None, :])
        tl.store(db_ptr + pid.to(tl.int64) * V + v, tl.sum(g, axis=0), mask=out)
    # 3. The fixed classes' columns, each class once (whichever kinds read it): in fused
    # mode their entries in float64 from the forward's logits (``kernels._class_entry_of``,
    # as the gradient pass's step 1), after the loop (inside it or before it, the
    # multi-blank pass spilled 176-280 bytes a thread on sm_90, Triton 3.6)
    for k in tl.static_range(K):
        if CLS_FIRST[k]:
            if FUSED:
                xk = tl.load(x_at + (CLS_COL[k] - 1) * n_nodes, mask=live, other=NEG_INF)
                ek = _class_entry_of(xk, ws_ptr, node, reads, keep, live, y, blank,
                                     CLASS_ID[k], n_nodes, o_lse, K, READS, CLASS_ID,
                                     CLS_COL)[0].to(ACC)
            else:
                ek = -_class_reads(CLASS_ID[k], gb_a, gl_a, y, blank, reads, keep, n_nodes, K,
                                   READS, CLASS_ID, CLS_COL, ACC)
            ek = _grad_out(ek, nan_row, clamp, write, w_up, FUSED, CLAMP)
            ek = tl.where(on & (CLASS_ID[k] < V_tok), ek, 0.0)
            # (a vector mask: the interpreter refuses a vector & scalar one)
            tl.store(dz_ptr + dz_row + CLASS_ID[k], ek.to(dz_ptr.dtype.element_ty),
                     mask=on & (rows * 0 + V_tok > CLASS_ID[k]))
            tl.store(db_ptr + pid.to(tl.int64) * V + CLASS_ID[k], tl.sum(ek, axis=0),
                     mask=V_tok > CLASS_ID[k])
    # 4. TDT's duration group
    if N_DURATIONS > 0:
        d = tl.arange(0, BLOCK_DUR)
        g_dur, s_dur, live_d, d_hi, d_lo = _duration_terms(
            ws_ptr, node, reads, keep, n_nodes, o_dur, K, DURATION, N_CLS, DUR_COL, ACC,
            BLOCK_DUR, FUSED)
        zd = _joint_logits(h_ptr, w_ptr, bias_ptr, rows, V_tok + d, d < N_DURATIONS, n_k, H,
                           HAS_BIAS, PRECISION, ACC, DOT_F32, BLOCK_N, BLOCK_DUR, BLOCK_H)
        if FUSED:
            x = tl.where(live_d[:, None] & (d[None, :] < N_DURATIONS), zd, NEG_INF)
        else:
            x = tl.zeros([BLOCK_N, BLOCK_DUR], ACC)
        g = _duration_grad(x, d_hi, d_lo, s_dur, g_dur, nan_row, write, w_up, FUSED)
        if FUSED:
            # Each duration's entry again in float64, from the forward's (``x``), in place
            # of its ACC one (``_duration_grad`` of float64 terms, as
            # ``kernels._duration_step`` forms them: a confident model's duration has ``q``
            # near 1, where ``q S_dur - gamma`` cancels, math.md 4.1), a column at a time:
            # Triton 3.6 does not compile this pass with a [BLOCK_N, BLOCK_DUR] float64
            # block, nor with these columns put in a block of zeros
            # (``TritonGPURemoveLayoutConversions``).
            lse_d = tl.load(ws_ptr + o_dur + node, mask=live_d, other=0.0)
            for i in tl.static_range(N_DURATIONS):
                xi = tl.load(x_at + (2 + N_CLS + i) * n_nodes, mask=live_d, other=NEG_INF)
                gi = tl.zeros_like(lse_d)
                for k in tl.static_range(K):
                    if DURATION[k] == i:
                        gi += tl.load(reads + DUR_COL[k] * n_nodes, mask=keep, other=0.0)
                ei = _duration_grad(xi[:, None], lse_d,
                                    tl.zeros_like(lse_d), s_dur, gi[:, None], nan_row, write,
                                    w_up, FUSED)
                g = tl.where(d[None, :] == i, ei.to(ACC), g)
        g = tl.where(d[None, :] < N_DURATIONS, g, 0.0)
        tl.store(dz_ptr + dz_row[:, None] + V_tok + d[None, :], g.to(dz_ptr.dtype.element_ty),
                 mask=on[:, None] & (d[None, :] < N_DURATIONS))
        tl.store(db_ptr + pid.to(tl.int64) * V + V_tok + d, tl.sum(g, axis=0),
                 mask=d < N_DURATIONS)


@triton.jit(do_not_specialize=("frames", "labels", "u0", "U1"))
def _joint_act_grad_kernel(
    # data ptrs: dh, h (n, H) of the chunk (rows (b, t, u) of its box); dP (B, U+1, H)
    # accumulated here; dE's partial sums (n_ublocks, B, frames, H)
    dh_ptr, h_ptr, dp_ptr, de_ptr,
    # shapes: the chunk's frames and label positions, its first label position; the grid's
    frames, labels, u0, U1, H,
    # flags
    ACT: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_H: tl.constexpr, PREFETCH: tl.constexpr,
):
    """``da = dh * act'(a)`` of ``BLOCK_U`` label positions of one sequence of a chunk, every
    frame of it, ``BLOCK_H`` of H (``act'`` from ``h``, ``_act_grad``), summed two ways:
    over the frames into ``dP[b, u0 + u]`` (added to what earlier chunks left there: the
    program owns those entries) and over its label positions into its partial sums of
    ``dE`` (the caller adds the blocks of label positions, in order). ``PREFETCH``: frame
    ``t + 1``'s ``dh`` and ``h`` are loaded before frame ``t``'s sums, so that a program has
    loads in flight while its warps exchange them (the same values, the same sums)."""
    b = tl.program_id(0).to(tl.int64)
    ub = tl.program_id(1)
    u = ub * BLOCK_U + tl.arange(0, BLOCK_U)
    k = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = (u < labels)[:, None] & (k < H)[None, :]
    p_acc = tl.zeros([BLOCK_U, BLOCK_H], dp_ptr.dtype.element_ty)
    if PREFETCH:
        # frame 0's entries (the frame's condition as a vector: a scalar one is a Python
        # bool in the interpreter)
        at = (((b * frames) * labels + u) * H)[:, None] + k[None, :]
        first = m & (tl.zeros_like(u) < frames)[:, None]
        dh_next = tl.load(dh_ptr + at, mask=first, other=0.0)
        h_next = tl.load(h_ptr + at, mask=first, other=0.0)
    for t in range(0, frames):
        rows = (b * frames + t) * labels + u                  # the chunk's rows (b, t, u)
        if PREFETCH:
            dh = dh_next.to(p_acc.dtype)
            h = h_next.to(p_acc.dtype)
            at = ((rows + labels) * H)[:, None] + k[None, :]  # frame t + 1's
            more = m & ((tl.zeros_like(u) + (t + 1)) < frames)[:, None]
            dh_next = tl.load(dh_ptr + at, mask=more, other=0.0)
            h_next = tl.load(h_ptr + at, mask=more, other=0.0)
        else:
            at = rows[:, None] * H + k[None, :]
            dh = tl.load(dh_ptr + at, mask=m, other=0.0).to(p_acc.dtype)
            h = tl.load(h_ptr + at, mask=m, other=0.0).to(p_acc.dtype)
        da = dh * _act_grad(h, ACT)
        p_acc += da
        tl.store(de_ptr + ((ub * tl.num_programs(0) + b) * frames + t) * H + k,
                 tl.sum(da, axis=0), mask=k < H)
    at = dp_ptr + ((b * U1 + u0 + u) * H)[:, None] + k[None, :]
    tl.store(at, tl.load(at, mask=m, other=0.0) + p_acc, mask=m)


@triton.jit(do_not_specialize=_JOINT_SHAPES)
def _joint_hidden_kernel(
    # data ptrs: e (B, T, H), p (B, U+1, H); the chunk's h (n, H), written
    enc_ptr, pred_ptr, h_ptr, logit_lengths_ptr, target_lengths_ptr, boundary_ptr,
    # shapes: the chunk's rows (its box of the grid), the grid
    n_rows, T, U1, H, box_t0, box_u0, box_T, box_U1,
    # flags
    ACT: tl.constexpr, BOUNDARY: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``h = act(e(t) + p(u))`` of ``BLOCK_N`` rows of a chunk (:data:`CUBLAS_PRODUCTS`),
    the same values as the row and gradient passes make (``_joint_hidden``), and 0 on the
    rows outside their sequence's lattice, so that padding (NaN in ``e`` or ``p`` past the
    lengths included) reaches neither the logits' products nor ``dW``."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows, node, inside, b, t, u, e_row, p_row = _joint_nodes(r, n_rows, T, U1, box_t0,
                                                              box_u0, box_T, box_U1, H)
    t0, u0, t1, u1 = _ends(boundary_ptr, logit_lengths_ptr, target_lengths_ptr, b, inside,
                           T, U1, BOUNDARY)
    valid = inside & (t >= t0) & (t < t1) & (u >= u0) & (u <= u1)
    _joint_hidden(enc_ptr, pred_ptr, h_ptr, rows, e_row, p_row, valid, H, H, ACT, ACC,
                  BLOCK_N, BLOCK_H)


# --------------------------------------------------------------------------- host
# float32 operands whose products would be IEEE float32 (TF32 off, PyTorch's default) take
# the tile path, whose products are cuBLAS's: on an H100 at j1 (32, 400, 100, 1024), H = 512,
# the gradient pass with its IEEE product took 109.8 ms a step against 27.1 and 25.4 ms for
# cuBLAS's two products of the same size (benchmarks/results/gpu/
# h100-tiles-jt_tf32-ieee-backward.log), so the kernel path's IEEE step (the row and
# gradient passes, and those two products) takes at least 162 ms plus the row pass, where
# the tile path took 161.8 ms there before the V passes were reworked (issue 34's table)
# at about the same memory (0.72 GiB against 0.65). True: the kernel path for them too
# (benchmarks/joint_tiles.py times the kernel path at every precision with it).
IEEE_FLOAT32 = False


def takes(dtype: torch.dtype) -> bool:
    """Whether compiled kernels (a GPU) take operands of ``dtype``: bfloat16 and float16;
    float32 where its products are TF32 (:func:`_precision`), or with :data:`IEEE_FLOAT32`;
    not float64 (Triton 3.6 does not compile the float64 gradient kernel for sm_80 or sm_90,
    in its ``TritonGPURemoveLayoutConversions`` pass). The others take the tile path. With
    :data:`CUBLAS_PRODUCTS` every dtype: the products are cuBLAS's."""
    if dtype in (torch.float16, torch.bfloat16) or CUBLAS_PRODUCTS:
        return True
    return dtype == torch.float32 and (IEEE_FLOAT32 or _precision(dtype) == "tf32")


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for operands of ``dtype``: TF32 for float32 where
    PyTorch's own matrix products use it (``torch.backends.cuda.matmul.allow_tf32``), so
    that the kernels round as the joiner's ``Linear`` and the backward's ``torch.mm`` do;
    IEEE otherwise."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _dot_f32(dtype: torch.dtype) -> bool:
    """``DOT_F32``: bfloat16 operands under the Triton interpreter (``_joint_logits``)."""
    return dtype == torch.bfloat16 and INTERPRETED


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of operands of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tiles(which: str, dtype: torch.dtype) -> dict:
    """The blocks of pass ``which`` for operands of ``dtype`` (:data:`TILES`, :data:`WIDE`)."""
    return dict(TILES[which], **WIDE.get(dtype.itemsize, {}))


def launch_options(tile: dict) -> dict:
    """The entries of a pass's ``tile`` (:func:`_tiles`) that are Triton's launch options,
    not the kernel's constexprs: :data:`LAUNCH_OPTIONS`."""
    return {k: v for k, v in tile.items() if k in LAUNCH_OPTIONS and v is not None}


def block_constants(tile: dict) -> dict:
    """The entries of a pass's ``tile`` that are the kernel's constexprs (the blocks)."""
    return {k: v for k, v in tile.items() if k not in LAUNCH_OPTIONS}


def _block_dur(n_durations: int) -> int:
    """The duration block: a power of two, at least 16 (``tl.dot``'s smallest side)."""
    return max(16, _pow2(n_durations, 1 << 30))


@dataclass
class JointState:
    """What the backward needs of a forward: the lattice state of every node (``gpu``'s
    tile state: the workspace, ids, lengths, boundary), the chunks, the operands' dtype,
    the activation, and whether the chunks' logits are cuBLAS's (:data:`CUBLAS_PRODUCTS`
    as the forward found it: the backward takes the same path, whose workspace the forward
    wrote)."""

    tiles: _Tiles
    plan: list                 # chunks (t0, t1, u0, u1), in order
    dtype: torch.dtype         # of the operands e, p, W, b
    act: int                   # ACTIVATIONS
    cublas: bool = False       # CUBLAS_PRODUCTS


def _chunk_rows(plan, B: int) -> int:
    return max(B * (t1 - t0) * (u1 - u0) for t0, t1, u0, u1 in plan)


def forward(e, p, w, bias, act: str, targets, logit_lengths, target_lengths,
            opts: LossOptions, boundary, need_grad: bool, rows: int):
    """Costs ``-log P`` ``(B,)`` of the logits ``W act(e(t) + p(u)) + b`` and the state of
    the backward: ``e (B, T, H)``, ``p (B, U+1, H)``, ``w (V, H)``, ``bias (V,)`` or None, all
    of the operands' dtype (contiguous); ``rows``: nodes per chunk (``_layout.tile_plan``).
    The row pass per chunk (``_joint_row_kernel``), then the backend's lattice pass and,
    with ``need_grad``, the gradient's coefficients (``gpu.tile_lattice``). No host
    synchronisation: every size comes from the shapes."""
    check_device(e)
    B, T, H = e.shape
    U1 = p.shape[1]
    topo = opts.topology
    n_dur = topo.n_durations
    V_tok = w.shape[0] - n_dur
    _, targets, logit_lengths, target_lengths = _prepare(e[:0], targets, logit_lengths,
                                                         target_lengths)
    boundary = None if boundary is None else boundary.to(torch.int64).contiguous()
    cublas = CUBLAS_PRODUCTS
    # the read entries, for the gradient pass (the chunks by cuBLAS keep their logits)
    entries = need_grad and opts.log_softmax and not cublas
    st = _State.new(_ws_layout(B, T, U1, topo, need_grad, entries), e.device)
    tiles = _Tiles(st, targets, logit_lengths, target_lengths, boundary, e.dtype)
    plan = _layout.tile_plan(B, T, U1, rows, False)
    state = JointState(tiles, plan, e.dtype, ACTIVATIONS[act], cublas)
    if plan and cublas:
        n_max = _chunk_rows(plan, B)
        h = torch.empty((n_max, H), dtype=e.dtype, device=e.device)
        z = torch.empty((n_max, w.shape[0]), dtype=e.dtype, device=e.device)
        for box in plan:
            _, rows = _cublas_logits(e, p, w, bias, tiles, box, state.act, h, z)
            tile_forward(rows, _layout.tile_node_rows(B, T, U1, *box, e.device), None, None,
                         None, opts, None, tiles)
    elif plan:
        tile = _tiles("row", e.dtype)
        lay = st.lay
        h = torch.empty((_chunk_rows(plan, B), H), dtype=e.dtype, device=e.device)
        for t0, t1, u0, u1 in plan:
            n = B * (t1 - t0) * (u1 - u0)
            with _device(e):
                launch(_joint_row_kernel, (triton.cdiv(n, tile["BLOCK_N"]),),
                    e, p, w, _or(bias, w), h, _nonempty(targets, logit_lengths), logit_lengths,
                    target_lengths, _or(boundary, logit_lengths), st.ws,
                    n, B * T * U1, T, U1, V_tok, H, opts.blank, t0, u0, t1 - t0, u1 - u0,
                    *lay.offsets("o_lse", "o_dur", "o_nb", "o_lp", "o_x"),
                    **_kernel_kinds(topo, "joint_row"),
                    ACT=state.act, HAS_BIAS=bias is not None, FUSED=opts.log_softmax,
                    ENTRIES=entries,
                    BOUNDARY=boundary is not None, ACC=_acc(e.dtype),
                    PRECISION=_precision(e.dtype), DOT_F32=_dot_f32(e.dtype),
                    BLOCK_DUR=_block_dur(n_dur), WIDE=U1 > T + 1, **tile)
    costs = tile_lattice(tiles, opts, need_grad) if plan else torch.full(
        (B,), float("inf"), dtype=_costs_dtype(e.dtype), device=e.device)
    return costs, state


def backward(state: JointState, e, p, w, bias, upstream, opts: LossOptions):
    """``(dE (B, T, H), dP (B, U+1, H), dW (V, H), db (V,) or None)`` of ``sum_b upstream[b]
    cost_b``, float32 (float64 for float64 operands), chunk by chunk in the forward's order
    (module docstring): ``_joint_grad_kernel`` writes the chunk's ``dz`` and ``h``, then
    ``dh = dz W`` and ``dW += dz^T h`` (``torch.mm``, outside autocast), ``db`` from the
    programs' column sums, and ``_joint_act_grad_kernel`` takes ``dh`` through the
    activation into ``dE`` and ``dP``. ``upstream`` ``(B,)`` is read through its stride."""
    tiles, plan = state.tiles, state.plan
    st = tiles.st
    lay = st.lay
    B, T, H = e.shape
    U1 = p.shape[1]
    V = w.shape[0]
    topo = opts.topology
    n_dur = topo.n_durations
    acc = _acc_dtype(state.dtype)
    dev = e.device
    d_enc = torch.zeros((B, T, H), dtype=acc, device=dev)
    d_pred = torch.zeros((B, U1, H), dtype=acc, device=dev)
    d_w = torch.zeros((V, H), dtype=acc, device=dev)
    d_b = torch.zeros((V,), dtype=acc, device=dev)
    if not plan:
        return d_enc, d_pred, d_w, d_b
    n_max = _chunk_rows(plan, B)
    h = torch.empty((n_max, H), dtype=state.dtype, device=dev)
    dh = torch.empty((n_max, H), dtype=state.dtype, device=dev)
    if state.cublas:
        z = torch.empty((n_max, V), dtype=state.dtype, device=dev)
        for box in plan:
            rows_h, rows_z = _cublas_logits(e, p, w, bias, tiles, box, state.act, h, z)
            # dz = upstream[b] d cost_b / d z, over z (the backend's gradient pass)
            tile_backward(rows_z, _layout.tile_node_rows(B, T, U1, *box, dev), tiles, upstream,
                          opts, rows_z)
            rows_dh = dh[:len(rows_z)]
            _joiner_grads(rows_z, rows_h, rows_dh, w, d_w, state.dtype)
            d_b += rows_z.sum(0, dtype=acc)
            act_grad(rows_dh, rows_h, d_enc, d_pred, box, state.act)
        return d_enc, d_pred, d_w, None if bias is None else d_b
    tile = _tiles("grad", state.dtype)
    progs_max = triton.cdiv(n_max, tile["BLOCK_N"])
    # dz's rows start at multiples of 16 entries (vector stores; the products read the view)
    dz = torch.empty((n_max, -(-V // 16) * 16), dtype=state.dtype, device=dev)
    col_sums = torch.empty((progs_max, V), dtype=acc, device=dev)
    kinds = _kernel_kinds(topo, "joint_grad")
    for t0, t1, u0, u1 in plan:
        frames, labels = t1 - t0, u1 - u0
        n = B * frames * labels
        progs = triton.cdiv(n, tile["BLOCK_N"])
        with _device(e):
            launch(_joint_grad_kernel, (progs,),
                e, p, w, _or(bias, w), h, dz, col_sums, _nonempty(tiles.targets, tiles.logit_lengths),
                tiles.logit_lengths, tiles.target_lengths, _or(tiles.boundary, tiles.logit_lengths),
                st.ws, upstream,
                n, B * T * U1, T, U1, V - n_dur, H, opts.blank, dz.stride(0), upstream.stride(0), t0, u0,
                frames, labels, *lay.offsets("o_lse", "o_dur", "o_ll", "o_reads", "o_x"),
                *_f64_cached(opts.clamp), **kinds,
                ACT=state.act, HAS_BIAS=bias is not None, FUSED=opts.log_softmax,
                CLAMP=opts.clamp > 0, BOUNDARY=tiles.boundary is not None, ACC=_acc(state.dtype),
                PRECISION=_precision(state.dtype), DOT_F32=_dot_f32(state.dtype),
                BLOCK_DUR=_block_dur(n_dur), **tile)
        rows_dz, rows_h, rows_dh = dz[:n, :V], h[:n], dh[:n]
        _joiner_grads(rows_dz, rows_h, rows_dh, w, d_w, state.dtype)
        d_b += col_sums[:progs].sum(0)
        act_grad(rows_dh, rows_h, d_enc, d_pred, (t0, t1, u0, u1), state.act)
    return d_enc, d_pred, d_w, None if bias is None else d_b


def _joiner_grads(dz, h, dh, w, d_w, dtype: torch.dtype) -> None:
    """A chunk's ``dh = dz W`` (into ``dh``, the operands' dtype) and ``dW += dz^T h``
    (``d_w`` float32, float64 for float64 operands): two products (cuBLAS)."""
    torch.mm(dz, w, out=dh)
    if dtype == d_w.dtype:
        d_w.addmm_(dz.t(), h)
    else:                                       # half operands: their product, added in float32
        d_w += torch.mm(dz.t(), h)


def _cublas_logits(e, p, w, bias, tiles: _Tiles, box, act: int, h, z) -> tuple:
    """``(h, z)``: a chunk's rows of ``h = act(e + p)`` (``_joint_hidden_kernel``, 0 outside
    the lattice) and of its logits ``z = h W^T + b`` (``torch.addmm``, the operands' dtype),
    as views of the buffers ``h (n_max, H)`` and ``z (n_max, V)``; ``box = (t0, t1, u0,
    u1)``, the chunk's rows in order (b, t, u) (:data:`CUBLAS_PRODUCTS`)."""
    t0, t1, u0, u1 = box
    B, T, H = e.shape
    U1 = p.shape[1]
    n = B * (t1 - t0) * (u1 - u0)
    rows_h, rows_z = h[:n], z[:n]
    blocks = block_constants(HIDDEN)
    with _device(e):
        launch(_joint_hidden_kernel, (triton.cdiv(n, blocks["BLOCK_N"]),),
               e, p, rows_h, tiles.logit_lengths, tiles.target_lengths,
               _or(tiles.boundary, tiles.logit_lengths), n, T, U1, H, t0, u0, t1 - t0, u1 - u0,
               ACT=act, BOUNDARY=tiles.boundary is not None, ACC=_acc(e.dtype), **blocks,
               **launch_options(HIDDEN))
    if bias is None:
        torch.mm(rows_h, w.t(), out=rows_z)
    else:
        torch.addmm(bias, rows_h, w.t(), out=rows_z)
    return rows_h, rows_z


def act_grad(dh, h, d_enc, d_pred, box, act: int, blocks=None):
    """A chunk's ``da = dh * act'(a)`` summed into ``d_enc (B, T, H)`` (over its label
    positions) and ``d_pred (B, U+1, H)`` (over its frames), both float32 (float64):
    ``_joint_act_grad_kernel`` with ``blocks`` (:data:`ACT_GRAD` by default), then its
    blocks of label positions' partial sums of ``dE`` added in order. ``dh``, ``h``
    ``(n, H)``: the chunk's rows (b, t, u) of ``box = (t0, t1, u0, u1)``."""
    blocks = ACT_GRAD if blocks is None else blocks
    t0, t1, u0, u1 = box
    B, U1, H = d_pred.shape
    frames, labels = t1 - t0, u1 - u0
    ublocks = triton.cdiv(labels, blocks["BLOCK_U"])
    de_part = torch.empty((ublocks, B, frames, H), dtype=d_enc.dtype, device=d_enc.device)
    with _device(d_enc):
        launch(_joint_act_grad_kernel, (B, ublocks, triton.cdiv(H, blocks["BLOCK_H"])),
               dh, h, d_pred, de_part, frames, labels, u0, U1, H, ACT=act,
               **block_constants(blocks), **launch_options(blocks))
    d_enc[:, t0:t1] += de_part.sum(0)
