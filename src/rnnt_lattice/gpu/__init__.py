"""GPU backend: Triton kernels (``kernels``) behind the backend protocol
(``_backends.Backend``).

Importing this module imports Triton (that is how ``_backends`` detects it). It runs on
CUDA tensors, and on CPU tensors through the Triton interpreter, which is how the tests
run it: ``TRITON_INTERPRET=1`` must be set before this module is first imported (Triton
reads it when the kernels are decorated).

No host synchronisation, CUDA-graph capturable: nothing here reads a tensor value on the
host (no ``.item()``, ``.tolist()``, ``bool(tensor)``, no host-side max of the lengths),
creates a tensor from Python values, or writes a Python number into a device tensor. Grid
sizes come from tensor shapes only, options are plain kernel arguments, and the upstream
gradient is read through its stride (the gradient of a mean is an expanded scalar: no copy).
The value checks of labels and lengths run on the device on CUDA (``input_check``, called
by ``_validate.device_value_check``); whatever the values, the kernels clamp the ends to
the grid and never read outside a tensor.

Launches and allocations of a loss's forward+backward, for every topology: the row pass,
the lattice (alpha and beta in parallel programs; the alpha programs also write the
costs), the gradient's per-node coefficients (in the forward, when a gradient will be
needed), the gradient pass — four kernels — and three allocations: one float64 workspace
for the lattice state (``_Layout``: the kernels get its pointer and the offsets of its
parts, no view per part), the costs, and the gradient (none with ``inplace_grad=True``).
The regular topology goes through the same kernels (kinds blank and label).

Memory: the forward pass keeps ``(K + 1 + NC) x B*T*(U+1) + 2 x B*(T+1)*(U+1) + B`` float64
values (lse, the K per-kind arc log-probs, the NC coefficient columns of the gradient (3
for the regular loss), alpha, beta over the frames and the end frame, log P; plus
``B*T*(U+1)`` each for TDT's duration normaliser and for the blank log-probs that k2's
constrained label arcs add) besides the logits; the backward pass writes the gradient in
one pass over the logits, with the upstream gradient and clamp fused.

The lattice tools (``occupancy``, ``viterbi``) run the loss's row and lattice passes, then
the occupation kernel, or the lattice pass in the max-plus semiring with the best incoming
kind of every node: one recursion for the losses and the tools, with the same
no-synchronisation guarantee.

Layouts: padded logits ``(B, T, U+1, V)``, or 2-D rows ``(N, V)`` with a ``node_rows``
map ``(B, T, U+1)`` (packed sequences, pruned windows; ``loss_forward``), or a fused tile's
box. The passes over V launch programs over the rows they read (``_Rows``): ``B*T*(U+1)``
padded rows, the ``N`` rows of a map (``B*T*R`` for pruned windows; the map is inverted to
``row_nodes (N,)`` on the device, and the nodes without a row are filled first), a tile's
``B*(t1-t0)*(u1-u0)`` rows; never the whole grid per tile.

Compilation: shape integers are not specialised (``kernels``, ``do_not_specialize``), the
row alignment is the constexpr ``V_ALIGN`` (``_v_align``; rows that start anywhere are read
from their aligned span, ``SPAN``: ``_span``), ``BLOCK_U`` has three buckets
(``_block_u``) and the workspace parts are 16-byte aligned: a training run with varying
T and U compiles a handful of variants per vocabulary (benchmarks/compile_variants.py).

Precision: the lattice is float64 for every input dtype (``kernels``); float16, bfloat16
and float32 logits are read in their own dtype and the passes over V compute in float32
(float64 for float64 logits); the gradient is written in the dtype of the logits, the costs
are float32 (float64 for float64 logits).
"""
from __future__ import annotations

import contextlib
import functools
import math
import re
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

# The oldest Triton the kernels are tested with: 3.5.1 (torch 2.9.1: the suite, through
# the interpreter and the sm_75/80/90 compiles), 3.6 (torch 2.11, on an H100 and an H200)
# and 3.9. Triton 3.1 and 3.2 (torch 2.5, 2.6) compile none of the loss's kernels (a
# constexpr tuple indexed in a kernel, ``tl.gather``).
MIN_TRITON = (3, 5)


def check_triton_version(version: str) -> None:
    """ImportError, naming the versions and the way out, for a Triton older than
    :data:`MIN_TRITON` (importing this module runs it: ``backend="auto"`` then falls back
    to the PyTorch backend with a warning that says why, ``backend="triton"`` is a
    ValueError that says it)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found and tuple(map(int, found.groups())) < MIN_TRITON:
        raise ImportError(
            f"rnnt_lattice's Triton kernels need Triton >= {'.'.join(map(str, MIN_TRITON))} "
            f"(torch >= 2.9 installs it); found triton {version} with torch "
            f"{torch.__version__}. Upgrade torch (and triton), or pass backend='torch'")


check_triton_version(triton.__version__)

from .. import torch_backend  # noqa: E402
from .._layout import row_nodes  # noqa: E402
from .._types import ArcParts, Lattice, LossOptions, Smoothing  # noqa: E402
from .._rules import device_assert, recompute_rtol  # noqa: E402
from ..topology import Topology  # noqa: E402
from . import kernels  # noqa: E402
from ._launch import launch  # noqa: E402

__all__ = ["loss_forward", "loss_backward", "tile_forward", "tile_lattice", "tile_backward",
           "occupancy", "viterbi", "lattice_of_terms", "window_dp", "k2_starts",
           "simple_rescue", "simple_rescue_backward", "simple_rows", "simple_rows_backward",
           "arc_terms", "arc_terms_backward", "rows_select", "rows_sum", "input_check",
           "empty_cache"]

NAME = "triton"

# The kernels read float16/bfloat16 logits and int32 ids/lengths directly: the public layer
# need not convert them (each conversion would be a launch of its own).
NATIVE_LOW_PRECISION = True
NATIVE_INT32_IDS = True
# The gradient pass zeroes the rows of every sequence whose cost is infinite in the costs'
# dtype: the caller passes the upstream gradient as it is (no isinf and masked_fill).
ZEROES_INFINITE_COSTS = True
# In fused mode the gradient pass of a recomputed tile checks its rows against the forward's
# normalisers (``kernels._grad_kernel``'s ``CHECK``): no row sums of the caller's, which
# read each tile twice more.
CHECKS_RECOMPUTED_TILES = True

# Decorated as interpreted functions iff TRITON_INTERPRET=1 was set at import.
INTERPRETED = not isinstance(kernels._row_kernel, triton.runtime.JITFunction)

# Tile sizes (powers of two). Tests lower them to exercise several blocks on tiny lattices.
BLOCK_U = 256      # lanes of the alpha/beta wavefront (label positions per block)
BLOCK_U_SMALL = 64 # the lanes for U + 1 <= 64, twice that up to 128 (``_block_u``)
# The passes over V: (logits per program and step, the most classes per step), each with
# NUM_WARPS_V warps: ROWS = tile // BLOCK_V nodes per program, BLOCK_V = min(V, cap); "span":
# the row pass over rows read from their aligned span (``_span``; the row tile where a
# test's or a sweep's table has no such entry). Chosen on an H100 (docs/benchmarks.md,
# "GPU"; benchmarks/results/gpu/h100-tiles-passes.log): the row pass with 4 rows of 128
# classes and 4 warps read the logits at s5 in 0.454 ms (78% of the copy bandwidth) where
# 16 rows took 0.530, 8 rows 0.467 and 2 rows 0.927 (8 warps over 4 rows: 0.990); at big
# 1.54 ms against 1.95, at V = 5000 0.60 against 0.71, at s3 0.046 against 0.060. The
# gradient pass keeps 4 rows of 256: 4 rows of 128 were as fast for the regular loss
# (within 1% at s5, big and V = 5000) but 11% slower for multi-blank's at s5 and big
# (h100-175fa4a-passes_ours.log). TDT's rows from their span: 16 rows of 128 took
# 0.637 ms at s5, 8 rows 0.691.
# The gradient pass over such rows by their whole 16-byte groups (``grad_span``, with
# SPAN_GRAD): 8 rows of 128, the fewest instructions a row of the tiles compiled for sm_90
# (benchmarks/row_sass.py; not timed).
V_PASS_TILES = {"row": (512, 128), "grad": (1024, 256), "span": (2048, 128),
                "grad_span": (1024, 128)}
# Rows whose loads cannot be vectorised (``_tiles``): one row of up to 256 classes a program.
NARROW_TILES = {"row": (256, 256), "grad": (256, 256)}
# The row and gradient passes read such rows from their 16-byte aligned span instead
# (``_span``), with vector loads and V_PASS_TILES; False: NARROW_TILES and a load per
# element (the A/B of benchmarks/gpu_passes.py --sweep).
SPAN_ROWS = True
# The gradient pass over such rows by their whole 16-byte groups (``kernels._grad_kernel``
# with SPAN: vector loads and stores from the row's first 16-byte boundary, its first and
# last few entries an entry a load; tile ``grad_span``). Compiled for sm_90
# (benchmarks/row_sass.py), TDT's loop on 8 rows of 128 is as the aligned rows': 25.8
# instructions a warp per 32 classes against 29.5 an entry a load. Timed on an H200
# (benchmarks/results/gpu/h200-0fd8b8d-switches-*.log, three runs each way, the same to
# 0.3%): TDT's gradient pass at s5 0.617 ms against 0.787 an entry a load, at big 2.63
# against 3.85 (the step 5.32 against 7.05 ms with the other two switches). The span's first
# version (each row read from the 16-byte boundary below its start, stored an entry at a
# time) had taken 1.10 ms at s5 (h200-aefffe7-tdt_sweep.log). False: an entry a load.
SPAN_GRAD = True
# The row pass issues each chunk's load before it reduces the one before
# (``kernels._group_lse``'s PREFETCH; the same sums in the same order either way).
ROW_PREFETCH = True
# The same for rows read from their aligned span (``_span``: TDT's, odd V). Timed before
# the reductions once a row (ROW_LANES), when it lost (0.634 ms against 0.621 at s5 on an
# H200); with them, the span's loop is mostly its loads: 128 registers and no load in
# flight while a chunk is reduced on TDT's 16 rows of 128 (Triton 3.6, sm_90). Off until a
# GPU times it (``gpu_session.sh row_early``); the same sums in the same order either way.
SPAN_PREFETCH = False
# The row pass loads the entries that do not need the token group's log-normaliser (the
# blank's, the label's, the fixed classes', the duration group) before the group's loop
# rather than after it (``kernels._row_kernel``'s EARLY; the same results, bit for bit):
# after the loop, a program waits for two dependent loads (the target, then its entry)
# with nothing in flight. Off until a GPU times it (``gpu_session.sh row_early``).
ROW_EARLY = False
# The gradient pass writes TDT's duration group after the token group's loop rather than
# before it (``kernels._grad_kernel``'s DUR_LAST; the same results, bit for bit): before
# it, the group's copies of the rows' values (its [ROWS, BLOCK_DUR] layout, the span's
# edges' too) stay live through the loop, 96 registers a thread on 8 rows of 128 against
# 68 after it (sm_90, Triton 3.6, the GPU machines'), so 5 programs a multiprocessor against
# 7 (the regular loss's: 64 registers, 8); Triton 3.9: 94 against 82, 5 programs either
# way. Off until a GPU times it (``gpu_session.sh row_early``).
GRAD_DURATIONS_LAST = False
# The row pass folds each chunk into a running max and sum per thread's 16 bytes of entries
# and reduces across the row once (``kernels._lse_step``'s LANES), instead of two cross-lane
# reductions and a float64 exp a chunk. On an H200 (h200-0fd8b8d-switches-*.log): the row
# pass at s5 0.370 ms against 0.421 (regular), TDT 0.523 against 0.621, multi-blank 0.391
# against 0.438; at big 1.47 against 1.57 (docs/benchmarks.md, "The row pass's reductions
# once a row"). False: the reductions every chunk.
ROW_LANES = True
NUM_WARPS_V = 4
BLOCK_NODES = 512  # lattice nodes per program of the occupation kernel (lattice tools)
# Nodes per program of the simple losses' rescue (``simple_rescue``): one vector load of
# their marks, and nothing more where none is set (the usual case).
RESCUE_BLOCK_NODES = 256
# Marks read a vector load at a time by the rescue's backward in a fixed order
# (``_simple_rescue_rows_kernel``, under torch.use_deterministic_algorithms): a program per
# row of a side, its U+1 or T nodes' marks.
RESCUE_ROWS_BLOCK_K = 1024
RESCUE_BLOCK_V = 1024          # classes a chunk of the rescue's logsumexp and gradient
# Lanes of the lattice kernel's wavefront per thread (``_lattice_warps``): with one, each
# thread's loads of a diagonal all issue before the first is used (sm_90 SASS: TDT's nine
# kinds in 62 registers; two lanes a thread took 126 and interleaved loads with the max).
LATTICE_LANES = 1
# The lattice pass with the recursion's state in registers (``kernels._lattice_kernel``'s
# ONCHIP: the last diagonals' alpha / beta held by the lanes, a lane's neighbour read by a
# gather, each diagonal's weights loaded while the one before is combined), where one block
# of lanes holds a diagonal (U + 1 <= BLOCK_U; longer label sequences keep the workspace).
# On an H200 (h200-0fd8b8d-switches-*.log): at s5 0.231 ms against 0.327 (regular), TDT
# 0.425 against 0.582, multi-blank 0.319 against 0.435; at big 0.239 against 0.334
# (docs/benchmarks.md, "The lattice's state in registers"). False: the workspace pass.
LATTICE_ONCHIP = True

LATTICE_DTYPE = torch.float64

WINDOW_DP_MAX_S = 8192   # window starts one program of the window DP holds in its lanes
# k2's window rule (``k2_starts``): the most starts of a sequence (more take the PyTorch
# reference), the elements of one tile of scores (frames x starts: 1024 float64s, 88
# registers a thread on sm_90 at 128 starts; 4096 took 255), the frames of one block of
# its scans.
K2_MAX_STARTS = 8192
K2_TILE = 1024
K2_SCAN = 1024
ARC_TILE = 512           # nodes a program of the simple losses' arc terms (``_arc_tiles``)
ARC_MAX_BLOCK_U = 128    # label positions per chunk of those programs
ARC_WARPS = 8            # 2 nodes a thread: 76 and 118 registers on sm_90 (4 warps: 106, 141)
ARC_COLS = (32, 32)      # blocks of frames x label positions a step of their column sums
ROWS_TILE = 2048         # entries a program of the simple losses' row kernels (``_rows_tiles``)
ROWS_MAX_BLOCK_V = 1024  # classes a chunk of them
ROWS_BLOCK_J = 128       # entries read a chunk
ROWS_SUM_BLOCK_D = 1024  # columns a program of ``rows_sum``
ROWS_SUM_BLOCK_M = 1024  # indices a step of ``rows_sum``'s scan
ROWS_SUM_CHUNK = 16       # rows a step of ``rows_sum``'s sum (unrolled)


def empty_cache() -> None:
    """Nothing of this backend's own to release (PyTorch's caching allocator holds the
    buffers: ``torch.cuda.empty_cache``)."""


def _pow2(n: int, cap: int) -> int:
    """The least power of two >= n, at most ``cap`` (plain integers: Triton's
    ``next_power_of_2`` is a constexpr function, slow on the host)."""
    return max(1, min(cap, 1 << (max(int(n), 1) - 1).bit_length()))


def _acc(dtype: torch.dtype):
    """Triton compute dtype of the passes over V for logits of ``dtype``."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def _v_align(V: int, n_durations: int = 0) -> int:
    """``kernels``' ``V_ALIGN``: the largest power of two up to 16 that divides both the
    logits' row length ``V`` and the token group's ``V - n_durations`` -- rows start at
    multiples of it and the masks over a row change at multiples of it, so that the loads
    of a row can be vectorised; the lengths themselves are not specialised."""
    return math.gcd(math.gcd(int(V), int(V) - int(n_durations)), 16) or 16


def _span(V_tok: int, n_durations: int, dtype: torch.dtype) -> int:
    """``kernels``' ``SPAN`` of the row and gradient passes: for rows whose loads cannot be
    vectorised (``_v_align`` below 4), the entries in 16 bytes of ``dtype``, the alignment
    from which ``kernels._group_lse`` and ``kernels._grad_kernel`` read each row's token
    group; 0 for aligned rows (or with :data:`SPAN_ROWS` off)."""
    if not SPAN_ROWS or _v_align(V_tok + n_durations, n_durations) >= 4:
        return 0
    return 16 // dtype.itemsize


def _row_lanes(dtype: torch.dtype, block_v: int) -> int:
    """``kernels._group_lse``'s ``LANES`` for the row pass: the entries of one 16-byte
    load of ``dtype`` (at most the chunk's ``block_v``) with :data:`ROW_LANES`, else 0.
    float64 logits keep the reductions every chunk: their groups' float64 state on the
    span's tile took 242-255 registers a thread on sm_90 (and a stack with Triton 3.6)."""
    if not ROW_LANES or dtype == torch.float64:
        return 0
    return min(16 // dtype.itemsize, block_v)


def _block_u(U1: int) -> int:
    """``BLOCK_U`` of the lattice kernel: three buckets, ``BLOCK_U_SMALL`` lanes up to that
    many label positions, twice that up to twice that, ``BLOCK_U`` beyond (a constexpr per
    power of two of U + 1 would compile up to 9 variants over a training run's label
    lengths). The lanes past U + 1 are masked work on every diagonal: on an H100 at s5 (U +
    1 = 81) the lattice pass took 0.405 ms with 128 lanes and 0.422 with 256 (TDT 1.26 and
    1.37, multi-blank 0.74 and 0.78; docs/benchmarks.md, "GPU")."""
    small = min(BLOCK_U, BLOCK_U_SMALL)
    if U1 <= small:
        return small
    return min(BLOCK_U, 2 * small) if U1 <= 2 * small else BLOCK_U


def _onchip(U1: int, topo: Topology) -> dict:
    """``kernels._lattice_kernel``'s ``ONCHIP`` (:data:`LATTICE_ONCHIP`, where one block of
    lanes holds a diagonal) and ``DEPTH`` (the most diagonals a kind steps, ``dt + du``)."""
    kinds = _kinds(topo)
    return dict(ONCHIP=LATTICE_ONCHIP and U1 <= _block_u(U1),
                DEPTH=max(dt + du for dt, du in zip(kinds["DT"], kinds["DU"])))


def _lattice_warps(block_u: int) -> int:
    """``num_warps`` of the lattice kernel: :data:`LATTICE_LANES` lanes of ``BLOCK_U`` per
    thread (2 warps for 64 lanes, 4 for 128, 8 for 256), at least one warp. On an H100 at
    s5 two lanes a thread made the pass 1.4-1.6x slower (docs/benchmarks.md, "GPU")."""
    return max(1, block_u // (32 * LATTICE_LANES))


def _window_dp_warps(block_s: int) -> int:
    """``num_warps`` of the window DP: about 256 lanes of ``BLOCK_S`` per warp (8 per
    thread), 1 to 16 warps, so that a large S does not spill registers."""
    return max(1, min(16, block_s // 256))


def _tiles(V: int, n_rows: int, which: str, n_durations: int = 0, span: int = 0):
    """``(ROWS, BLOCK_V, num_warps)`` of the V pass ``which`` (``"row"``, ``"grad"``) over
    ``n_rows`` rows of ``V`` token classes (:data:`V_PASS_TILES`): a chunk of up to the
    pass's cap, and as many rows per program as fit its tile (no more than the rows there
    are). Rows whose loads cannot be vectorised (``_v_align`` below 4: TDT's rows of V +
    durations, odd V) take :data:`NARROW_TILES`: each element is then a load of its own,
    with its own address, and 16 rows of 128 took 240-255 registers a thread
    (benchmarks/kernel_resources.py). On an H100, TDT's row pass at s5 took 1.35 ms with one
    row of 256 a program, 1.97 with 4 rows of 128, 2.71 with 16 rows of 128, 3.03 with 16
    rows and 8 warps (docs/benchmarks.md, "GPU"). The row and gradient passes read such
    rows from their aligned span (``span`` > 0, :func:`_span`; the gradient pass with
    :data:`SPAN_GRAD`): vector loads again, and the tiles ``"span"`` (row) and
    ``"grad_span"``."""
    narrow = _v_align(V + n_durations, n_durations) < 4 and not span
    if narrow:
        tile, cap = NARROW_TILES[which]
    else:
        key = ("span" if which == "row" else f"{which}_span") if span else which
        tile, cap = V_PASS_TILES.get(key, V_PASS_TILES[which])
    block_v = _pow2(V, cap)
    rows = min(max(1, tile // block_v), _pow2(n_rows, 1 << 30))
    return rows, block_v, NUM_WARPS_V


F32_MAX = float(np.finfo(np.float32).max)


def _f64_parts(x: float) -> tuple[float, float, float]:
    """``x`` as three float32 values whose float64 sum is ``x`` (``kernels._f64``). Beyond
    float32's range (``|x| > F32_MAX``, infinities included) no float32 parts sum to
    ``x``: ``(±inf, 0, 0)``, the value every float32 computation sees anyway (NaN stays
    NaN). Splitting an infinity naively gives ``(inf, inf - inf, ...) = (inf, nan, nan)``,
    which turned ``clamp=inf`` into NaN gradients."""
    x = float(x)
    if not abs(x) <= F32_MAX:                   # beyond float32, +-inf or NaN
        return (x if x != x else math.copysign(math.inf, x)), 0.0, 0.0
    hi = float(np.float32(x))                   # |x| <= F32_MAX: rounds to a finite float32
    mid = float(np.float32(x - hi))
    lo = float(np.float32(x - hi - mid))
    return hi, mid, lo


def check_device(logits: torch.Tensor) -> None:
    """ValueError unless the kernels can run on ``logits``' device."""
    dev = logits.device
    if dev.type == "cpu" and not INTERPRETED:
        raise ValueError(
            "backend='triton' got logits on cpu: the Triton kernels run on CUDA tensors, or on "
            "CPU tensors only under the Triton interpreter (set TRITON_INTERPRET=1 before "
            "rnnt_lattice's Triton backend is first imported). Use backend='numba' on CPU.")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"backend='triton' runs on CUDA tensors, got logits on {dev}")


def _device(x: torch.Tensor):
    """Launch on ``x``'s GPU: Triton launches on the *current* CUDA device, which need not
    be the one holding the tensors (no synchronisation involved). Held once per backend call
    around all of its launches (the passes below launch under their caller's)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


# --------------------------------------------------------------------------- passes
_INT_IDS = (torch.int32, torch.int64)


def _prepare(logits, targets, logit_lengths, target_lengths):
    """The layouts the kernels index: contiguous logits, contiguous int32 or int64 ids and
    lengths (no-ops for what ``rnnt_loss`` passes)."""
    check_device(logits)
    return (logits.contiguous(),) + tuple(
        (x if x.dtype in _INT_IDS else x.to(torch.int64)).contiguous()
        for x in (targets, logit_lengths, target_lengths))


def _nonempty(targets: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """A kernel argument must have storage; U = 0 gives an empty targets tensor, which is
    never read: pass another integer tensor in its place (no allocation)."""
    return targets if targets.numel() else other


def _costs_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- any topology


@functools.lru_cache(maxsize=64)
def _kinds(topo: Topology) -> dict:
    """The compile-time description of a topology's arc kinds (``kernels``, "any
    topology"): one tuple per field, indexed by kind, plus ``K``, ``KP`` (a power of two
    >= K, the class-read tile), ``N_DURATIONS`` (``Topology.n_durations``),
    ``HAS_PLUS_NEXT_BLANK`` (any kind is), and the columns of the gradient's coefficients
    (``kernels``, pass 3): ``N_CLS`` kinds with a fixed class, ``CLS_COL[k]`` and
    ``DUR_COL[k]`` each kind's column of its class and duration read (-1: none), ``NC``
    columns in all; ``CLS_FIRST[k]``: kind k reads a fixed class that no earlier kind
    reads (the gradient passes count or subtract each fixed class once). The names are the fields of ``topology.ArcKind``. Each kernel takes
    its subset (:data:`_KERNEL_KINDS`). Cached per topology (frozen, hashable); each
    distinct topology compiles its own kernels."""
    kinds = topo.kinds
    n_cls = sum(k.reads == "class" for k in kinds)
    cls_col = tuple(3 + sum(j.reads == "class" for j in kinds[:i]) if k.reads == "class" else -1
                    for i, k in enumerate(kinds))
    n_dur = topo.n_durations
    dur_col = tuple(4 + n_cls + sum(j.duration >= 0 for j in kinds[:i]) if k.duration >= 0
                    else -1 for i, k in enumerate(kinds))
    nc = 3 + n_cls + (1 + sum(k.duration >= 0 for k in kinds) if n_dur else 0)
    cls_first = tuple(k.reads == "class" and all(j.reads != "class" or j.class_id != k.class_id
                                                 for j in kinds[:i])
                      for i, k in enumerate(kinds))
    return dict(
        K=len(kinds), KP=_pow2(len(kinds), 1 << 30),
        DT=tuple(k.dt for k in kinds), DU=tuple(k.du for k in kinds),
        READS=tuple({"blank": 0, "label": 1, "class": 2}[k.reads] for k in kinds),
        CLASS_ID=tuple(k.class_id for k in kinds), DURATION=tuple(k.duration for k in kinds),
        PLUS_NEXT_BLANK=tuple(k.plus_next_blank for k in kinds),
        FASTEMIT=tuple(k.fastemit for k in kinds),
        DELAY=tuple(k.delay for k in kinds), MAY_END=tuple(k.may_end for k in kinds),
        N_DURATIONS=n_dur, HAS_PLUS_NEXT_BLANK=any(k.plus_next_blank for k in kinds),
        N_CLS=n_cls, CLS_COL=cls_col, DUR_COL=dur_col, NC=nc, CLS_FIRST=cls_first,
    )


_LATTICE_KINDS = ("K", "DT", "DU", "READS", "CLASS_ID", "DURATION", "PLUS_NEXT_BLANK",
                  "FASTEMIT", "DELAY", "MAY_END")
_KERNEL_KINDS = {
    "row": _LATTICE_KINDS + ("KP", "N_DURATIONS", "HAS_PLUS_NEXT_BLANK"),
    "lattice": _LATTICE_KINDS,
    "reads": _LATTICE_KINDS + ("N_DURATIONS", "N_CLS", "CLS_COL", "DUR_COL"),
    "grad": ("K", "READS", "CLASS_ID", "DURATION", "N_DURATIONS", "N_CLS", "CLS_COL",
             "DUR_COL", "CLS_FIRST"),
}
# the joiner's passes (``gpu.joint``): its row pass writes the entries its gradient pass reads
_KERNEL_KINDS["joint_row"] = _KERNEL_KINDS["row"] + ("N_CLS", "CLS_COL")
_KERNEL_KINDS["joint_grad"] = _KERNEL_KINDS["grad"]


@functools.lru_cache(maxsize=256)
def _kernel_kinds(topo: Topology, which: str) -> dict:
    kinds = _kinds(topo)
    return {k: kinds[k] for k in _KERNEL_KINDS[which]}


def _skew(T: int, U1: int) -> tuple[int, int, int]:
    """``(s_t, s_u, plane)``: the skewed layout of a sequence's plane of the node arrays
    next_blank, lp, alpha and beta, node ``(t, u)`` at ``t s_t + u s_u`` (``kernels._skew``
    computes the same on the device; the nodes of an anti-diagonal are adjacent)."""
    a = min(U1, T + 1)
    return (a + 1, a, (T + U1) * a) if U1 > T + 1 else (a, a + 1, (T + U1) * a)


@dataclass(frozen=True)
class _Layout:
    """Where each part of the float64 lattice state lies in one workspace (``kernels``,
    "the workspace"): element offsets, each part starting 16-byte aligned (so Triton sees
    one pointer alignment whatever the shapes: one compiled variant), and the total.
    Parts a topology does not use (``lse_dur`` without durations, ``next_blank`` without
    ``plus_next_blank`` kinds, the gradient's ``reads`` without a gradient, the read
    entries ``x`` but on the joiner's kernel path with a gradient) take no room.
    next_blank, lp, alpha and beta are skewed planes (``_skew``). The log P part has one
    cell more, after the B sequences' own: the lattice kernel's -inf cell (``kernels._gather``)."""

    B: int
    T: int
    U1: int
    K: int
    o_lse: int
    o_dur: int
    o_nb: int
    o_lp: int
    o_alpha: int
    o_beta: int
    o_ll: int
    o_reads: int
    o_x: int
    total: int

    def offsets(self, *names) -> tuple:
        return tuple(getattr(self, n) for n in names)


@functools.lru_cache(maxsize=512)
def _layout(B: int, T: int, U1: int, topo: Topology, reads: bool,
            entries: bool = False) -> _Layout:
    """The workspace of a ``(B, T, U+1)`` lattice of ``topo`` (with the gradient's
    coefficients if ``reads``; and with ``entries`` the logits its arcs read, which the
    joiner's kernel path keeps for its gradient: ``gpu.joint``). Cached: a training run
    meets few shapes."""
    kinds = _kinds(topo)
    n = B * T * U1
    plane = _skew(T, U1)[2]
    sizes = (n, n if kinds["N_DURATIONS"] else 0,
             B * plane if kinds["HAS_PLUS_NEXT_BLANK"] else 0, kinds["K"] * B * plane,
             B * plane, B * plane, B + 1, kinds["NC"] * n if reads else 0,
             (2 + kinds["N_CLS"] + kinds["N_DURATIONS"]) * n if reads and entries else 0)
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += size + size % 2
    if plane * kinds["K"] >= 2 ** 31:
        raise ValueError(f"a lattice of (T, U+1) = ({T}, {U1}) with {kinds['K']} arc kinds "
                         f"has too many nodes per sequence for the GPU kernels (2**31 arcs)")
    return _Layout(B, T, U1, kinds["K"], *offsets, max(at, 2))


class _State:
    """The float64 lattice state of a batch: one workspace and its :class:`_Layout`. The
    kernels take the workspace and the offsets; the views are for the lattice tools, which
    hand alpha, beta and log P out."""

    __slots__ = ("ws", "lay")

    def __init__(self, ws: torch.Tensor, lay: _Layout):
        self.ws, self.lay = ws, lay

    @classmethod
    def new(cls, lay: _Layout, device) -> "_State":
        return cls(torch.empty(lay.total, dtype=LATTICE_DTYPE, device=device), lay)

    def part(self, offset: int, shape: tuple) -> torch.Tensor:
        n = math.prod(shape)
        return self.ws[offset:offset + n].view(shape)

    def planes(self, offset: int, lead: tuple, frames: int) -> torch.Tensor:
        """The skewed planes at ``offset`` (``_skew``) as a strided view ``(*lead, frames,
        U+1)``: node ``(t, u)`` of plane ``i`` at ``i plane + t s_t + u s_u``."""
        lay = self.lay
        s_t, s_u, plane = _skew(lay.T, lay.U1)
        strides = [plane]
        for n in reversed(lead[1:]):
            strides.insert(0, strides[0] * n)
        return self.ws.as_strided((*lead, frames, lay.U1), (*strides, s_t, s_u), offset)

    @property
    def alpha(self):       # (B, T+1, U+1)
        return self.planes(self.lay.o_alpha, (self.lay.B,), self.lay.T + 1)

    @property
    def beta(self):        # (B, T+1, U+1)
        return self.planes(self.lay.o_beta, (self.lay.B,), self.lay.T + 1)

    @property
    def log_like(self):    # (B,)
        return self.part(self.lay.o_ll, (self.lay.B,))

    @property
    def lp(self):          # (B, K, T, U+1)
        return self.planes(self.lay.o_lp, (self.lay.B, self.lay.K), self.lay.T)

    @property
    def next_blank(self):  # (B, T, U+1)
        return self.planes(self.lay.o_nb, (self.lay.B,), self.lay.T)


@dataclass(frozen=True)
class _Rows:
    """What the programs of the V passes run over (``kernels._row_node``): ``n`` rows of
    the logits in ``layout`` (``kernels.PADDED``, ``ROW_NODES`` with ``row_nodes (N,)``
    int64, or ``BOX``, a fused tile ``(t0, u0, frames, label positions)``). Programs are
    launched for these rows only, never for the whole grid."""
    n: int
    layout: int
    row_nodes: torch.Tensor | None = None
    box: tuple = (0, 0, 1, 1)


def _rows_of(logits, node_rows) -> _Rows:
    """The rows of padded logits ``(B, T, U+1, V)`` (``node_rows`` None), or of rows ``(N,
    V)`` with the node -> row map ``node_rows (B, T, U+1)``, inverted (``_layout.row_nodes``:
    a scatter, no host synchronisation)."""
    if node_rows is None:
        B, T, U1, _ = logits.shape
        return _Rows(B * T * U1, kernels.PADDED)
    N = logits.shape[0]
    return _Rows(N, kernels.ROW_NODES, row_nodes(node_rows, N))


def _or(x, other):
    """A kernel pointer argument must have storage: an absent (None or empty) tensor is
    replaced by another tensor of the same kind, never read (no allocation)."""
    return x if x is not None and x.numel() else other


@functools.lru_cache(maxsize=256)
def _terms(topo: Topology, sigma: float, delay_penalty: float) -> dict:
    """The per-arc term flags of the lattice kernels (compile-time: off costs nothing)."""
    return dict(SIGMA=sigma != 0.0, DELAY_ON=delay_penalty != 0.0 and any(_kinds(topo)["DELAY"]))


_f64_cached = functools.lru_cache(maxsize=256)(_f64_parts)


def _forward(logits, targets, logit_lengths, target_lengths, opts: LossOptions, *,
             boundary, grid, rows: _Rows, beta: bool, best_kind=None, fill_nodes: bool = False,
             reads: bool = False, nan_rows=None):
    """Passes 1-2 of any topology on the grid ``(B, T, U+1)``: ``(state, costs)``; costs
    ``(B,)`` = -log P (+ ``nan_rows``, the device check's, where given); with ``reads`` (a
    gradient to come) also the gradient's per-node coefficients (``kernels._reads_kernel``).

    ``best_kind``: a ``(B, T+1, U+1)`` int8 tensor filled with -1 switches the lattice
    pass to the max-plus semiring (alpha alone, the best path's score as log P) and
    receives the best incoming kind of every node. ``fill_nodes``: alpha and beta are -inf
    off each sequence's nodes, for the lattice tools to hand out (the loss never reads
    them there)."""
    B, T, U1 = grid
    st = _State.new(_layout(B, T, U1, opts.topology, reads), logits.device)
    if fill_nodes:
        st.alpha.fill_(float("-inf"))
        if beta:
            st.beta.fill_(float("-inf"))
    if rows.layout == kernels.ROW_NODES:
        _fill_rowless(st)
    costs = torch.empty((B,), dtype=_costs_dtype(logits.dtype), device=logits.device)
    _row_pass(logits, targets, logit_lengths, target_lengths, st, opts, boundary=boundary,
              rows=rows)
    _lattice(st, costs, logit_lengths, target_lengths, opts, boundary=boundary, beta=beta,
             best_kind=best_kind, nan_rows=nan_rows)
    if reads:
        _reads(st, logit_lengths, target_lengths, opts, boundary=boundary)
    return st, costs


def _fill_rowless(st: _State) -> None:
    """The row pass's outputs of nodes that read no row (``lse = 0``, -inf arcs), written
    before a pass over the rows of a ``row_nodes`` layout, which writes the others."""
    lay = st.lay
    st.ws[lay.o_lse:lay.o_nb].zero_()                      # lse, lse_dur
    st.ws[lay.o_nb:lay.o_alpha].fill_(float("-inf"))       # next_blank, lp


# Launch plans: the grid, plain arguments and constexprs of each kernel launch depend only
# on the call's shapes, dtypes and options, so they are built once per such key and cached
# (a training run meets few keys): the host's work per call is then a dictionary lookup
# and the launch. The tile constants are part of every key (tests lower them).
@functools.lru_cache(maxsize=1024)
def _row_plan(topo: Topology, log_softmax: bool, blank: int, lay: _Layout, V: int, dtype,
              n_rows: int, layout: int, box: tuple, boundary: bool, tiles: tuple):
    n_dur = topo.n_durations
    span = _span(V - n_dur, n_dur, dtype)
    per, block_v, num_warps = _tiles(V - n_dur, n_rows, "row", n_dur, span)
    args = (n_rows, lay.T, lay.U1, V - n_dur, blank, *box,
            *lay.offsets("o_lse", "o_dur", "o_nb", "o_lp"))
    kw = dict(_kernel_kinds(topo, "row"), FUSED=log_softmax, LAYOUT=layout, ACC=_acc(dtype),
              ROWS=per, BLOCK_V=block_v, BLOCK_DUR=_pow2(n_dur, 1 << 30),
              V_ALIGN=_v_align(V, n_dur), SPAN=span, BOUNDARY=boundary,
              WIDE=lay.U1 > lay.T + 1, PREFETCH=SPAN_PREFETCH if span else ROW_PREFETCH,
              LANES=_row_lanes(dtype, block_v), EARLY=ROW_EARLY, num_warps=num_warps)
    return ((n_rows + per - 1) // per,), args, kw


def _tile_constants() -> tuple:
    """The module's tile constants, as a key of the launch plans (tests change them)."""
    return (tuple(V_PASS_TILES["row"]), tuple(V_PASS_TILES["grad"]),
            tuple(V_PASS_TILES.get("span", ())), tuple(V_PASS_TILES.get("grad_span", ())),
            tuple(NARROW_TILES["row"]), tuple(NARROW_TILES["grad"]), NUM_WARPS_V,
            BLOCK_U, BLOCK_U_SMALL, BLOCK_NODES, LATTICE_LANES, SPAN_ROWS, SPAN_GRAD,
            ROW_PREFETCH, ROW_LANES, LATTICE_ONCHIP, SPAN_PREFETCH, ROW_EARLY,
            GRAD_DURATIONS_LAST)


def _row_pass(logits, targets, logit_lengths, target_lengths, st: _State, opts: LossOptions, *,
              boundary, rows: _Rows):
    """Pass 1 (``kernels._row_kernel``) over the rows ``rows`` into ``st``'s ``lse``,
    ``lse_dur``, ``next_blank`` and ``lp`` at their nodes."""
    if not rows.n:
        return
    grid, args, kw = _row_plan(opts.topology, opts.log_softmax, opts.blank, st.lay,
                               logits.shape[-1], logits.dtype, rows.n, rows.layout, rows.box,
                               boundary is not None, _tile_constants())
    launch(kernels._row_kernel, grid,
        logits, _or(rows.row_nodes, logit_lengths), _nonempty(targets, logit_lengths),
        logit_lengths, target_lengths, _or(boundary, logit_lengths), st.ws, *args, **kw)


@functools.lru_cache(maxsize=1024)
def _lattice_plan(topo: Topology, sigma: float, delay_penalty: float, lay: _Layout, beta: bool,
                  max_semiring: bool, boundary: bool, nan_rows: bool, tiles: tuple):
    args = (lay.T, lay.U1, *lay.offsets("o_nb", "o_lp", "o_alpha", "o_beta", "o_ll"),
            *_f64_parts(sigma), *_f64_parts(delay_penalty))
    kw = dict(_kernel_kinds(topo, "lattice"), **_terms(topo, sigma, delay_penalty),
              MAX_SEMIRING=max_semiring, NAN_ROWS=nan_rows, BLOCK_U=_block_u(lay.U1),
              BOUNDARY=boundary, **_onchip(lay.U1, topo),
              # num_stages=1: no load is issued ahead of the barrier that makes the
              # earlier diagonals visible.
              num_warps=_lattice_warps(_block_u(lay.U1)), num_stages=1)
    return (lay.B, 2 if beta else 1), args, kw


def _lattice(st: _State, costs, logit_lengths, target_lengths, opts: LossOptions, *, boundary,
             beta: bool, best_kind=None, nan_rows=None):
    """Pass 2 (``kernels._lattice_kernel``) on ``st``'s arc log-probs: alpha (and beta),
    log P into ``st``, the costs into ``costs``, plus ``nan_rows`` (B,) where given."""
    if not st.lay.B:
        return
    grid, args, kw = _lattice_plan(opts.topology, opts.sigma, opts.delay_penalty, st.lay, beta,
                                   best_kind is not None, boundary is not None,
                                   nan_rows is not None, _tile_constants())
    # T = 0 or an empty region: log P = -inf and cost +inf without touching a node.
    launch(kernels._lattice_kernel, grid,
        st.ws, logit_lengths, target_lengths, _or(boundary, logit_lengths), costs,
        _or(nan_rows, costs), _or(best_kind, logit_lengths), *args, **kw)


@functools.lru_cache(maxsize=1024)
def _reads_plan(topo: Topology, fastemit_lambda: float, sigma: float, delay_penalty: float,
                lay: _Layout, boundary: bool, tiles: tuple):
    n_nodes = lay.B * lay.T * lay.U1
    block = _pow2(n_nodes, BLOCK_NODES)
    args = (n_nodes, lay.T, lay.U1,
            *lay.offsets("o_nb", "o_lp", "o_alpha", "o_beta", "o_ll", "o_reads"),
            *_f64_parts(1.0 + fastemit_lambda), *_f64_parts(sigma), *_f64_parts(delay_penalty))
    kw = dict(_kernel_kinds(topo, "reads"), **_terms(topo, sigma, delay_penalty),
              BOUNDARY=boundary, BLOCK=block)
    return ((n_nodes + block - 1) // block,), args, kw


def _reads(st: _State, logit_lengths, target_lengths, opts: LossOptions, *, boundary):
    """The gradient's per-node coefficients (``kernels._reads_kernel``) into ``st``'s
    ``reads``, after the lattice pass."""
    if not st.lay.B * st.lay.T * st.lay.U1:
        return
    grid, args, kw = _reads_plan(opts.topology, opts.fastemit_lambda, opts.sigma,
                                 opts.delay_penalty, st.lay, boundary is not None,
                                 _tile_constants())
    launch(kernels._reads_kernel, grid, st.ws, logit_lengths, target_lengths,
           _or(boundary, logit_lengths), *args, **kw)


@functools.lru_cache(maxsize=1024)
def _grad_plan(topo: Topology, log_softmax: bool, clamp: float, blank: int, lay: _Layout, V: int,
               dtype, n_rows: int, layout: int, box: tuple, boundary: bool, tiles: tuple,
               check: float = 0.0):
    n_dur = topo.n_durations
    span = _span(V - n_dur, n_dur, dtype) if SPAN_GRAD else 0
    per, block_v, num_warps = _tiles(V - n_dur, n_rows, "grad", n_dur, span)
    head = (n_rows, lay.B * lay.T * lay.U1, lay.T, lay.U1, V - n_dur, blank)
    tail = (*box, *lay.offsets("o_lse", "o_dur", "o_ll", "o_reads"), *_f64_parts(clamp))
    kw = dict(_kernel_kinds(topo, "grad"), FUSED=log_softmax, CLAMP=clamp > 0,
              BOUNDARY=boundary, LAYOUT=layout, ACC=_acc(dtype), ROWS=per, BLOCK_V=block_v,
              BLOCK_DUR=_pow2(n_dur, 1 << 30), V_ALIGN=_v_align(V, n_dur), SPAN=span,
              COSTS32=_costs_dtype(dtype) == torch.float32, num_warps=num_warps)
    if check:                                      # (absent otherwise: the launch's key as before)
        kw["CHECK"] = check
    if n_dur and GRAD_DURATIONS_LAST:              # (likewise)
        kw["DUR_LAST"] = True
    return ((n_rows + per - 1) // per,), head, tail, kw


def _gradient(dst, logits, targets, logit_lengths, target_lengths, st: _State,
              opts: LossOptions, upstream, *, boundary, rows: _Rows, check=None,
              check_tol: float = 0.0):
    """Pass 3 of any topology over the rows ``rows``: ``dst = upstream[b] * clip(d loss_b /
    d logits)``; ``dst`` may be ``logits``. ``upstream`` is any ``(B,)`` tensor (strides
    included). The coefficients are ``st``'s ``reads`` (``_reads``). ``check`` (fused
    mode): a float32 ``(1,)`` flag set to 1 where a row deviates from the forward's
    normalisers by more than ``check_tol`` (``kernels._grad_kernel``, ``CHECK``)."""
    if rows.n == 0:
        return dst
    grid, head, tail, kw = _grad_plan(opts.topology, opts.log_softmax, opts.clamp, opts.blank,
                                      st.lay, logits.shape[-1], logits.dtype, rows.n,
                                      rows.layout, rows.box, boundary is not None,
                                      _tile_constants(), check_tol if check is not None else 0.0)
    launch(kernels._grad_kernel, grid,
        logits, dst, _or(rows.row_nodes, logit_lengths), _nonempty(targets, logit_lengths),
        logit_lengths, target_lengths, _or(boundary, logit_lengths), st.ws, upstream,
        _or(check, upstream), *head, upstream.stride(0), *tail, **kw)
    return dst


# --------------------------------------------------------------------------- loss
INPLACE_WRITES_IN = "backward"    # the gradient pass writes over the logits


def loss_forward(logits, targets, logit_lengths, target_lengths, opts: LossOptions, need_grad,
                 boundary=None, node_rows=None, nan_rows=None):
    """Passes 1-2 (``_ops`` protocol), and the gradient's coefficients when a gradient is
    needed: costs, and the float64 lattice state saved for the gradient pass. beta is only
    needed for the occupations: without a gradient it is skipped.

    Layouts: ``logits (B, T, U+1, V)`` when ``node_rows`` is None; otherwise 2-D rows
    ``(N, V)`` and ``node_rows (B, T, U+1)`` int64, node ``(b, t, u)`` reading row
    ``node_rows[b, t, u]`` (-1: no row, every arc leaving it is -inf). Every row must be
    read by exactly one node: the gradient pass writes each row once, from its node, and
    rows of nodes off the lattice get 0. ``boundary``: k2's ``(B, 4)`` int64 ``[begin_symbol,
    begin_frame, end_symbol, end_frame]``, read on the device (no validation here).
    ``nan_rows`` (B,) float32, the device check's: the lattice pass adds it to the costs
    it writes (no operation of its own)."""
    logits, targets, logit_lengths, target_lengths = _prepare(
        logits, targets, logit_lengths, target_lengths)
    boundary = None if boundary is None else boundary.to(torch.int64).contiguous()
    grid = tuple(logits.shape[:3]) if node_rows is None else tuple(node_rows.shape)
    rows = _rows_of(logits, None if node_rows is None else node_rows.to(torch.int64))
    with _device(logits):
        st, costs = _forward(logits, targets, logit_lengths, target_lengths, opts,
                             boundary=boundary, grid=grid, rows=rows, beta=need_grad,
                             reads=need_grad, nan_rows=nan_rows)
    if not need_grad:
        return costs, (), None
    extra = tuple(x for x in (boundary, rows.row_nodes) if x is not None)
    state = (boundary is not None, rows.n, rows.layout, st.lay)
    return costs, (logits, targets, logit_lengths, target_lengths, st.ws) + extra, state


def loss_backward(saved, state, upstream, opts: LossOptions):
    """Pass 3 (``_ops`` protocol): the gradient with the upstream factor and clamp fused,
    in one pass over the logits, written over them with ``opts.inplace_grad``.
    ``upstream`` is read through its stride (an expanded scalar is not copied)."""
    logits, targets, logit_lengths, target_lengths, ws, *extra = saved
    has_boundary, n_rows, layout, lay = state
    boundary = extra.pop(0) if has_boundary else None
    rows = _Rows(n_rows, layout, extra.pop(0) if layout == kernels.ROW_NODES else None)
    dst = logits if opts.inplace_grad else torch.empty_like(logits)
    with _device(logits):
        return _gradient(dst, logits, targets, logit_lengths, target_lengths, _State(ws, lay),
                         opts, upstream, boundary=boundary, rows=rows)


# --------------------------------------------------------------------------- tiles
@dataclass
class _Tiles:
    """The fused joiner and loss's state (``tile_forward`` ... ``tile_backward``): the
    lattice state ``st`` of every node, which the row pass of each tile writes at the
    tile's nodes."""

    st: _State
    targets: torch.Tensor          # (B, U), int32 or int64, contiguous
    logit_lengths: torch.Tensor    # (B,)
    target_lengths: torch.Tensor   # (B,)
    boundary: torch.Tensor | None  # (B, 4) int64
    dtype: torch.dtype             # of the rows
    check: torch.Tensor | None = None  # (1,) float32: 1 once a recomputed row deviated


def _box(tile) -> _Rows:
    """The rows of a fused tile: programs over its box only (``kernels.BOX``)."""
    B = tile.grid[0]
    frames, labels = tile.t1 - tile.t0, tile.u1 - tile.u0
    return _Rows(B * frames * labels, kernels.BOX, None, (tile.t0, tile.u0, frames, labels))


def tile_forward(rows, tile, targets, logit_lengths, target_lengths, opts: LossOptions,
                 boundary, state):
    """Pass 1 on one tile's rows ``(n, V)`` (the box ``tile.t0:t1, u0:u1`` of the grid
    ``tile.grid``, rows in row-major order), its programs launched over the box and
    writing straight into the whole lattice's state (the tiles cover the grid). No host
    synchronisation: the box comes from the shapes."""
    check_device(rows)
    B, T, U1 = tile.grid
    if state is None:
        _, targets, logit_lengths, target_lengths = _prepare(rows[:0], targets, logit_lengths,
                                                             target_lengths)
        st = _State.new(_layout(B, T, U1, opts.topology, True), rows.device)
        state = _Tiles(st, targets, logit_lengths, target_lengths,
                       None if boundary is None else boundary.to(torch.int64).contiguous(),
                       rows.dtype)
    with _device(rows):
        _row_pass(rows.contiguous(), state.targets, state.logit_lengths, state.target_lengths,
                  state.st, opts, boundary=state.boundary, rows=_box(tile))
    return state


def tile_lattice(state: _Tiles, opts: LossOptions, need_grad: bool):
    """Pass 2 once over every node (``kernels._lattice_kernel``; beta and the gradient's
    coefficients only for a gradient): costs ``-log P`` (B,), float32 (float64 for float64
    rows)."""
    st = state.st
    costs = torch.empty((st.lay.B,), dtype=_costs_dtype(state.dtype), device=st.ws.device)
    with _device(costs):
        _lattice(st, costs, state.logit_lengths, state.target_lengths, opts,
                 boundary=state.boundary, beta=need_grad)
        if need_grad:
            _reads(st, state.logit_lengths, state.target_lengths, opts, boundary=state.boundary)
    return costs


def tile_backward(rows, tile, state: _Tiles, upstream, opts: LossOptions, out):
    """Pass 3 on one tile (``kernels._grad_kernel`` over the tile's box): ``out (n, V) =
    upstream[b] * d cost_b / d rows``; ``out`` may be ``rows``. ``upstream`` is read
    through its stride. In fused mode (:data:`CHECKS_RECOMPUTED_TILES`) the pass also
    checks the rows against the forward's normalisers: a row beyond its dtype's rounding
    (``_rules.recompute_rtol``) sets the call's flag ``state.check``, and the device
    assert ``"recompute"`` on it follows each tile (two launches a tile)."""
    box = _box(tile)
    check = opts.log_softmax and box.n > 0
    if check and state.check is None:             # one flag a call, 0 until a row deviates
        state.check = torch.zeros((1,), dtype=torch.float32, device=rows.device)
    with _device(rows):
        out = _gradient(out, rows, state.targets, state.logit_lengths, state.target_lengths,
                        state.st, opts, upstream, boundary=state.boundary, rows=box,
                        check=state.check if check else None,
                        check_tol=recompute_rtol(rows.dtype))
    if check:
        device_assert(state.check == 0, "recompute")
    return out


# --------------------------------------------------------------------------- lattice tools
def _tool_args(logits, targets, logit_lengths, target_lengths, boundary):
    """``_prepare``, and the boundary as the kernels read it (int64, contiguous)."""
    logits, targets, logit_lengths, target_lengths = _prepare(
        logits, targets, logit_lengths, target_lengths)
    boundary = None if boundary is None else boundary.to(torch.int64).contiguous()
    return logits, targets, logit_lengths, target_lengths, boundary


def occupancy(logits, targets, logit_lengths, target_lengths, opts: LossOptions,
              boundary=None) -> Lattice:
    """The lattice of any topology (``opts``: topology, blank, fused, sigma, delay
    penalty; k2 ``boundary``) without gradient work: the loss's row and lattice passes,
    then ``_gamma_kernel``. A :class:`rnnt_lattice._types.Lattice` as
    ``reference.lattice`` returns it, float64: alpha, beta ``(B, T+1, U+1)``
    (-inf off each sequence's nodes), log P ``(B,)``, per-kind occupations ``gamma
    (B, K, T, U+1)`` (0 off the arcs). No host synchronisation."""
    logits, targets, logit_lengths, target_lengths, boundary = _tool_args(
        logits, targets, logit_lengths, target_lengths, boundary)
    topo = opts.topology
    with torch.no_grad(), _device(logits):
        st, _ = _forward(logits, targets, logit_lengths, target_lengths, opts,
                         boundary=boundary, grid=tuple(logits.shape[:3]),
                         rows=_rows_of(logits, None), beta=True, fill_nodes=True)
        lay = st.lay
        gamma = torch.empty((lay.B, lay.K, lay.T, lay.U1), dtype=LATTICE_DTYPE,
                            device=logits.device)
        n_nodes = lay.B * lay.T * lay.U1
        if n_nodes:
            block = _pow2(n_nodes, BLOCK_NODES)
            launch(kernels._gamma_kernel, ((n_nodes + block - 1) // block,),
                st.ws, logit_lengths, target_lengths, _or(boundary, logit_lengths), gamma,
                n_nodes, lay.T, lay.U1, *lay.offsets("o_nb", "o_lp", "o_alpha", "o_beta", "o_ll"),
                *_f64_cached(opts.sigma), *_f64_cached(opts.delay_penalty),
                **_kernel_kinds(topo, "lattice"), **_terms(topo, opts.sigma, opts.delay_penalty),
                BOUNDARY=boundary is not None, BLOCK=block)
        # alpha and beta handed out in node order (the workspace's planes are skewed)
        return Lattice(st.alpha.contiguous(), st.beta.contiguous(), st.log_like, gamma)


def _viterbi_state(logits, targets, logit_lengths, target_lengths, opts: LossOptions, boundary):
    """The max-plus lattice pass: ``(state, best_kind)``."""
    logits, targets, logit_lengths, target_lengths, boundary = _tool_args(
        logits, targets, logit_lengths, target_lengths, boundary)
    B, T, U1, _ = logits.shape
    best_kind = torch.full((B, T + 1, U1), -1, dtype=torch.int8, device=logits.device)
    with torch.no_grad(), _device(logits):
        st, _ = _forward(logits, targets, logit_lengths, target_lengths, opts,
                         boundary=boundary, grid=(B, T, U1), rows=_rows_of(logits, None),
                         beta=False, best_kind=best_kind, fill_nodes=True)
    return st, best_kind


def viterbi(logits, targets, logit_lengths, target_lengths, opts: LossOptions, boundary=None):
    """Max-plus sweep of any topology (``_lattice_kernel`` with ``MAX_SEMIRING``):
    ``(alpha_max, best_kind, log_prob)`` as ``reference.sweep_alpha(max_plus=True)`` returns them:
    ``(B, T+1, U+1)`` float64 and int8 (the kind of the best arc into each node, -1
    where none), and ``(B,)`` the best complete path's score (-inf without one, NaN for a
    NaN arc weight). ``analysis.alignment.backtrack_arcs`` follows the pointers. No host
    synchronisation."""
    st, best_kind = _viterbi_state(logits, targets, logit_lengths, target_lengths, opts, boundary)
    return st.alpha.contiguous(), best_kind, st.log_like


# --------------------------------------------------------------------------- arc weights
def lattice_of_terms(b: torch.Tensor, e: torch.Tensor, topo: Topology, ends,
                     delay_penalty: float = 0.0):
    """``(log_like (B,), gamma (B, K, T, U+1))`` float64 of k2's lattice whose arcs read the
    blank and label log-weights ``b, e (B, T, U+1)`` float64, as ``reference.lattice``
    computes them on ``reference.terms_weights``: the simple/smoothed losses of
    ``rnnt_lattice.pruned`` and ``lattice_loss``. Each kind's plane of the workspace takes
    ``b`` or ``e`` (and the next-blank plane ``b``), and the kernels of the logits' lattice
    do the rest -- the arcs (each lattice's corners as k2's boundary), ``b(t, u+1)`` of
    ``plus_next_blank`` kinds and the delay penalty on ``_lattice_kernel``, then

        gamma_k(t,u) = exp(alpha(t,u) + w_k(t,u) + beta(t + dt_k, u + du_k) - log P)

    on ``_gamma_kernel``: 0 off the arcs and for a sequence without a path, NaN on the arcs
    of a NaN sequence (the kernel flags a NaN on any arc). Two Triton launches after a copy
    per kind (and the next-blank plane's) and one fill, no host synchronisation (the masks,
    weights and occupations in PyTorch took some 90 operations a call)."""
    check_device(b)
    B, T, U1 = b.shape
    lay = _layout(B, T, U1, topo, False)
    st = _State.new(lay, b.device)
    lp = st.lp
    for k, kind in enumerate(topo.kinds):
        lp[:, k].copy_(b if kind.reads == "blank" else e)
    kinds = _kernel_kinds(topo, "lattice")
    if _kinds(topo)["HAS_PLUS_NEXT_BLANK"]:
        st.next_blank.copy_(b)                           # the kernels read b(t, u+1) here
    st.ws[lay.o_alpha:lay.o_ll].fill_(float("-inf"))     # alpha and beta, -inf off the nodes
    # The kernels read each lattice's corners as k2's boundary rows [u0, t0, u1, t1].
    corners = torch.stack((ends.u0, ends.t0, ends.u1, ends.t1), 1).to(torch.int64).contiguous()
    costs = torch.empty((B,), dtype=LATTICE_DTYPE, device=b.device)
    gamma = torch.empty((B, lay.K, T, U1), dtype=LATTICE_DTYPE, device=b.device)
    terms = _terms(topo, 0.0, delay_penalty)
    sigma, delay = _f64_cached(0.0), _f64_cached(float(delay_penalty))
    n_nodes = B * T * U1
    if B:
        with _device(b):
            launch(kernels._lattice_kernel, (B, 2),
                st.ws, corners, corners, corners, costs, costs,   # nan_rows_ptr: never read
                corners, T, U1,       # best_kind_ptr: never read (MAX_SEMIRING=False)
                *lay.offsets("o_nb", "o_lp", "o_alpha", "o_beta", "o_ll"), *sigma, *delay,
                **kinds, **terms, MAX_SEMIRING=False, NAN_ROWS=False, BLOCK_U=_block_u(U1),
                BOUNDARY=True, **_onchip(U1, topo),
                num_warps=_lattice_warps(_block_u(U1)), num_stages=1)
            if n_nodes:
                block = _pow2(n_nodes, BLOCK_NODES)
                launch(kernels._gamma_kernel, ((n_nodes + block - 1) // block,),
                    st.ws, corners, corners, corners, gamma, n_nodes, T, U1,
                    *lay.offsets("o_nb", "o_lp", "o_alpha", "o_beta", "o_ll"), *sigma, *delay,
                    **kinds, **terms, BOUNDARY=True, BLOCK=block)
    return st.log_like, gamma


# --------------------------------------------------------------------------- input check
INPUT_CHECK_BLOCK_B = 16    # sequences per step of the input check's one program
INPUT_CHECK_BLOCK_U = 128   # labels per step


def input_check(targets, logit_lengths, target_lengths, boundary, *, T: int, U: int, V: int,
                blank, classes: tuple = ()):
    """``(ok (4 + B,), nan_rows (B,))`` float32, one allocation and a view of it: the rules
    of ``_validate.device_value_check`` decided on the device
    (``kernels._input_check_kernel``, one launch, no host synchronisation): ``ok[i]`` (i < 3)
    1.0 where the rules of flag i (the lengths, the labels, the boundary) hold for every
    sequence, ``nan_rows[b]`` NaN for a sequence that breaks one, else 0. ``targets``
    ``(B, U)`` or None (lengths only), ``blank`` None where a label may be the blank."""
    B = logit_lengths.shape[0]
    out = torch.empty(4 + B, dtype=torch.float32, device=logit_lengths.device)
    # The flags at out[0:3], the rows from 4 (16-byte aligned); the caller reads flag i as
    # out[i] (one view fewer than a slice of the flags).
    nan_rows = out[4:]
    labels = targets is not None and targets.numel() > 0
    grid, kw = _input_check_plan(labels, blank is not None, tuple(classes),
                                 boundary is not None, INPUT_CHECK_BLOCK_B, INPUT_CHECK_BLOCK_U)
    with _device(out):
        launch(kernels._input_check_kernel, grid,
            targets.contiguous() if labels else logit_lengths, logit_lengths.contiguous(),
            target_lengths.contiguous(), logit_lengths if boundary is None else boundary,
            out, nan_rows,
            B, T, U, V, 0 if blank is None else blank, **kw)
    return out, nan_rows


@functools.lru_cache(maxsize=64)
def _input_check_plan(labels: bool, no_blank: bool, classes: tuple, boundary: bool,
                      block_b: int, block_u: int):
    """(The blocks in the key, as the other plans' ``_tile_constants``: a sweep or a test
    that sets them reaches the kernel.)"""
    return (1,), dict(LABELS=labels, NO_BLANK=no_blank, CLASSES=classes, BOUNDARY=boundary,
                      BLOCK_B=block_b, BLOCK_U=block_u)


# --------------------------------------------------------------------------- window choice
def window_dp(mass: torch.Tensor, max_step: int):
    """``(total (B,), starts (B, T) int64)`` of the window DP over ``mass (B, T, S)``
    float64 (``kernels._window_dp_kernel``, one program per sequence, no host
    synchronisation; ``pruned.windows.best_window_starts`` prepares the mass and is the
    interface)."""
    check_device(mass)
    x = mass.to(torch.float64).contiguous()
    B, T, S = x.shape
    if S < 1 or S > WINDOW_DP_MAX_S:
        # No start at all, or more starts than one program's lanes: the PyTorch loop.
        return torch_backend.window_dp(mass, max_step)
    total = torch.empty(B, dtype=torch.float64, device=x.device)
    starts = torch.empty((B, T), dtype=torch.int64, device=x.device)
    if B:
        f = torch.empty((B, S), dtype=torch.float64, device=x.device)
        arg = torch.empty((B, T, S), dtype=torch.int32, device=x.device)
        block_s = _pow2(S, 1 << 16)
        with _device(x):
            launch(kernels._window_dp_kernel, (B,), x, f, arg, total, starts, T, S, int(max_step),
                                            BLOCK_S=block_s, num_warps=_window_dp_warps(block_s))
    return total, starts


def k2_starts(gamma_blank, gamma_label, t_end, u_end, R: int, R_e: int):
    """k2's window starts ``s_begin (B, T)`` int64 (``torch_backend.k2_starts``, the
    reference and its formulas) in one launch, ``kernels._k2_starts_kernel``, one program
    per sequence: some 30 PyTorch operations fewer a call, each a kernel. Occupations of
    two dtypes, or other than float32/float64, and more than ``K2_MAX_STARTS`` starts take
    the reference."""
    check_device(gamma_blank)
    B, T, U1 = gamma_blank.shape
    n = U1 - R + 1
    if (gamma_blank.dtype != gamma_label.dtype or n > K2_MAX_STARTS
            or gamma_blank.dtype not in (torch.float32, torch.float64)):
        return torch_backend.k2_starts(gamma_blank, gamma_label, t_end, u_end, R, R_e)
    gb, gl = (x if x.stride(-1) == 1 else x.contiguous() for x in (gamma_blank, gamma_label))
    out = torch.empty((B, T), dtype=torch.int64, device=gb.device)
    if B and T:
        block_s = _pow2(n, K2_MAX_STARTS)
        with _device(gb):
            launch(kernels._k2_starts_kernel, (B,),
                gb, gl, t_end, u_end, out, T, n, R, R_e, gb.stride(0), gb.stride(1),
                gl.stride(0), gl.stride(1), t_end.stride(0), u_end.stride(0),
                BLOCK_T=max(1, min(_pow2(T, 1 << 30), K2_TILE // block_s)), BLOCK_S=block_s,
                BLOCK_SCAN=_pow2(T, K2_SCAN), num_warps=4)
    return out


# --------------------------------------------------------------------------- simple loss
def _rescue_grid(n_nodes: int) -> tuple:
    return (triton.cdiv(n_nodes, RESCUE_BLOCK_NODES),)


def simple_rescue(am: torch.Tensor, lm: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """``(B, T, U+1)`` float64: ``logsumexp_v am(t,v) + lm(u,v)`` at the nodes ``need``
    marks, -inf elsewhere (``kernels._simple_rescue_kernel``, :data:`RESCUE_BLOCK_NODES`
    nodes a program, which returns at once when none of them is marked; no host
    synchronisation): the simple losses' normaliser of the nodes beyond the float64
    matmul's range (``pruned._rescue``)."""
    check_device(am)
    B, T, V = am.shape
    U1 = lm.shape[1]
    lse = torch.full((B, T, U1), float("-inf"), dtype=torch.float64, device=am.device)
    if lse.numel() and V:
        flags = need.contiguous().view(torch.uint8)            # a view: no copy
        with _device(am):
            launch(kernels._simple_rescue_kernel, _rescue_grid(lse.numel()),
                am, lm, flags, lse, lse, lse, lse, lse.numel(), T, U1, V, *am.stride(),
                *lm.stride(), BACKWARD=False, BLOCK_NODES=RESCUE_BLOCK_NODES,
                BLOCK_V=_pow2(V, RESCUE_BLOCK_V))
    return lse


def simple_rescue_backward(am, lm, need, lse, g, grad_am, grad_lm) -> None:
    """Adds ``g p`` of the nodes ``need`` marks, ``p(v) = exp(am(t,v) + lm(u,v) - lse)``,
    into ``grad_am (B, T, V)`` and ``grad_lm (B, U+1, V)`` (float64, contiguous; either may
    be None: not wanted) with atomics (the backward of :func:`simple_rescue`); under
    ``torch.use_deterministic_algorithms(True)`` in a fixed order instead
    (``kernels._simple_rescue_rows_kernel``, a launch a side wanted)."""
    check_device(am)
    B, T, V = am.shape
    U1 = lm.shape[1]
    if not (lse.numel() and V):
        return
    flags = need.contiguous().view(torch.uint8)                # a view: no copy
    lse, g = lse.contiguous(), g.to(torch.float64).contiguous()
    block_v = _pow2(V, RESCUE_BLOCK_V)
    if torch.are_deterministic_algorithms_enabled():
        for grad, side in ((grad_am, True), (grad_lm, False)):
            if grad is not None:
                n_rows = B * (T if side else U1)
                with _device(am):
                    launch(kernels._simple_rescue_rows_kernel, (n_rows,),
                        am, lm, flags, lse, g, grad, n_rows, T, U1, V, *am.stride(),
                        *lm.stride(), AM=side,
                        BLOCK_K=_pow2(U1 if side else T, RESCUE_ROWS_BLOCK_K), BLOCK_V=block_v)
        return
    # The kernel writes both: a scratch buffer for the one not wanted.
    grad_am = am.new_zeros((B, T, V), dtype=torch.float64) if grad_am is None else grad_am
    grad_lm = lm.new_zeros(lm.shape, dtype=torch.float64) if grad_lm is None else grad_lm
    with _device(am):
        launch(kernels._simple_rescue_kernel, _rescue_grid(lse.numel()),
            am, lm, flags, lse, g, grad_am, grad_lm, lse.numel(), T, U1, V, *am.stride(),
            *lm.stride(), BACKWARD=True, BLOCK_NODES=RESCUE_BLOCK_NODES, BLOCK_V=block_v)


# do_rnnt_pruning's rows of lm: index_select, its output from PyTorch's caching allocator.
rows_select = torch_backend.rows_select


def rows_sum(grad: torch.Tensor, index: torch.Tensor, n_out: int,
             groups: int = 1) -> torch.Tensor:
    """``out[j] = sum_{i: index[i] = j} grad[i]`` ``(n_out, D)`` (``torch_backend.rows_sum``:
    the reference and the arguments), each sum in the order of i and in float32 (float64
    for float64), by ``kernels._rows_sum_kernel``: a program per output row and block of
    columns finds its first and last entry in its group by one scan of the group's indices,
    then adds the rows between them that are its own, in order. No sort: a stable sort of
    the indices took 287 us of the host's time a step at pg1 on an H200 (a radix sort's
    launches). Where ``index_add_`` on CUDA adds with atomics (the sums in any order, and in
    the gradient's dtype: bfloat16 under autocast), and contends: at pg1, 64 000 rows of
    1024 into 3232, 0.43 ms on an H100. No host synchronisation."""
    check_device(grad)
    N, D = grad.shape
    out = torch.empty((n_out, D), dtype=grad.dtype, device=grad.device)
    if not (n_out and D):
        return out
    block_d = _pow2(D, ROWS_SUM_BLOCK_D)
    with _device(grad):
        launch(kernels._rows_sum_kernel, (n_out, triton.cdiv(D, block_d)),
            grad, index.contiguous(), out, D, N // groups, n_out // groups, *grad.stride(),
            ACC=_acc(grad.dtype), BLOCK_D=block_d, BLOCK_M=ROWS_SUM_BLOCK_M,
            CHUNK=ROWS_SUM_CHUNK, num_warps=4)
    return out


def _rows_tiles(V: int, J: int) -> dict:
    """The row kernels' constexprs: ``ROWS`` rows of ``BLOCK_V`` classes a step, entries
    ``BLOCK_J`` at a time."""
    block_v = _pow2(V, ROWS_MAX_BLOCK_V)
    rows = max(1, ROWS_TILE // block_v)
    return dict(ROWS=1 << (rows.bit_length() - 1), BLOCK_V=block_v,         # a power of two
                BLOCK_J=_pow2(J, ROWS_BLOCK_J))


def simple_rows(x: torch.Tensor, keep: torch.Tensor, idx: torch.Tensor):
    """The simple losses' rows ``(ok, shift, bad, ex, cols)`` (``torch_backend.simple_rows``:
    the reference and the definitions) in one launch of ``kernels._simple_rows_kernel``:
    one read of ``x`` for the maximum, one for the exponentials, where the reference's
    dozen operations each read or write a ``(B, N, V)`` tensor (float64 for four of them).
    No host synchronisation."""
    check_device(x)
    B, N, V = x.shape
    J = idx.shape[2]
    dev = x.device
    ok = torch.empty((B, N), dtype=torch.bool, device=dev)
    bad = torch.empty((B, N), dtype=torch.bool, device=dev)
    shift = torch.empty((B, N), dtype=torch.float64, device=dev)
    ex = torch.empty((B, N, V), dtype=torch.float64, device=dev)
    cols = torch.empty((B, N, J), dtype=torch.float64, device=dev)   # (torch_backend's)
    if B * N and V:
        tiles = _rows_tiles(V, J)
        with _device(x):
            launch(kernels._simple_rows_kernel, (triton.cdiv(B * N, tiles["ROWS"]),),
                x, keep.contiguous().view(torch.uint8), idx, ok.view(torch.uint8),
                bad.view(torch.uint8), shift, ex, cols, B * N, N, V, J, *x.stride(),
                *idx.stride(), CONTIG=x.is_contiguous(), **tiles, num_warps=4)
    return ok, shift, bad, ex, cols


def simple_rows_backward(grad, ex, ok, g_uni, uni, idx, g_cols) -> None:
    """The backward of :func:`simple_rows` in place on ``grad (B, N, V)`` float64
    (``torch_backend.simple_rows_backward``: the reference), one launch of
    ``kernels._simple_rows_grad_kernel`` (the entries' gradients added with atomics; under
    ``torch.use_deterministic_algorithms(True)`` one entry of a row at a time, in order:
    ``ORDERED``)."""
    check_device(grad)
    B, N, V = grad.shape
    J = idx.shape[2]
    if not (B * N and V):
        return
    tiles = _rows_tiles(V, J)
    has_uni, has_cols = g_uni is not None, g_cols is not None and J > 0
    g_uni = g_uni.contiguous() if has_uni else grad
    g_cols = g_cols.contiguous() if has_cols else grad
    with _device(grad):
        launch(kernels._simple_rows_grad_kernel, (triton.cdiv(B * N, tiles["ROWS"]),),
            grad, ex, ok.view(torch.uint8), g_uni, uni if has_uni else grad, idx, g_cols,
            B * N, N, V, J, *idx.stride(), UNI=has_uni, COLS=has_cols, **tiles,
            ORDERED=has_cols and torch.are_deterministic_algorithms_enabled(), num_warps=4)


def _arc_tiles(T: int, U1: int) -> tuple[int, int]:
    """``(BLOCK_T, BLOCK_U)`` of the arc terms' programs: the label positions in chunks of
    at most ``ARC_MAX_BLOCK_U``, frames up to ``ARC_TILE`` nodes a chunk."""
    block_u = _pow2(U1, ARC_MAX_BLOCK_U)
    return max(1, min(_pow2(T, 1 << 30), ARC_TILE // block_u)), block_u


def _scales(mix: Smoothing | None) -> tuple:
    """The kernels' ``c, s_am, s_lm`` as float32 parts (``kernels._f64``); 0 without a mix."""
    if mix is None:
        return (0.0,) * 9
    return (*_f64_cached(mix.c), *_f64_cached(mix.s_am), *_f64_cached(mix.s_lm))


def arc_terms(parts: ArcParts, mix: Smoothing | None):
    """The simple losses' arc log-probs ``(b', e', (mass, code))`` in one launch of
    ``kernels._arc_terms_kernel`` (``torch_backend.arc_terms``: the reference; some 40
    PyTorch operations, each a kernel, on CUDA): ``code (B, T, U+1)`` int8, the flags its
    backward reads. No host synchronisation."""
    mass = parts.mass
    check_device(mass)
    B, T, U1 = mass.shape
    if mass.dtype != torch.float64 or not mass.numel():
        return torch_backend.arc_terms(parts, mix)
    flat = [x.contiguous() for x in (mass, parts.lse_rescued.to(torch.float64), parts.am_cols,
                                     parts.lm_cols, parts.am_shift, parts.lm_shift)]
    flags = [x.contiguous().view(torch.uint8) for x in (parts.rescued, parts.am_bad,
                                                          parts.lm_bad)]
    terms = [mass] * 4 if mix is None else [x.contiguous() for x in (parts.P, parts.Q, parts.R,
                                                                       parts.S)]
    b = torch.empty_like(mass)
    e = torch.empty_like(mass)
    code = torch.empty(mass.shape, dtype=torch.int8, device=mass.device)
    block_t, block_u = _arc_tiles(T, U1)
    with _device(mass):
        launch(kernels._arc_terms_kernel, (B, triton.cdiv(T, block_t)),
            flat[0], flat[1], flags[0], flat[2], flat[3], flat[4], flat[5], flags[1], flags[2],
            *terms, b, e, code, T, U1, *_scales(mix), MIX=mix is not None, BLOCK_T=block_t,
            BLOCK_U=block_u, num_warps=ARC_WARPS)
    return b, e, (flat[0], code)


def arc_terms_backward(saved: tuple, g_b, g_e, mix: Smoothing | None, dtypes: tuple):
    """The backward of :func:`arc_terms` (``torch_backend.arc_terms_backward``: the
    reference) in two launches: ``kernels._arc_terms_grad_kernel`` on the tiles of the
    forward (every per-node gradient, the sums over u, each block's sums over t), then
    ``kernels._arc_terms_cols_kernel`` (the blocks' sums added in order: no atomics)."""
    if saved[1].dtype == torch.bool:                 # the reference's forward ran (empty)
        return torch_backend.arc_terms_backward(saved, g_b, g_e, mix, dtypes)
    mass, code = saved
    B, T, U1 = mass.shape
    block_t, block_u = _arc_tiles(T, U1)
    n_tb = triton.cdiv(T, block_t)
    dev = mass.device
    g_mass = torch.empty_like(mass)
    g_resc = torch.empty_like(mass)
    g_am = torch.empty((B, T, U1), dtype=dtypes[0], device=dev)
    g_lm = torch.empty((B, U1, 2), dtype=dtypes[1], device=dev)
    dP, dR = (torch.empty((B, T), dtype=torch.float64, device=dev) for _ in range(2))
    dQ = torch.empty((B, U1), dtype=torch.float64, device=dev)
    dS = torch.empty((B, U1 - 1), dtype=torch.float64, device=dev)
    part = torch.empty((B, n_tb, 4, U1), dtype=torch.float64, device=dev)
    gb = mass if g_b is None else g_b
    ge = mass if g_e is None else g_e
    scales = _scales(mix)
    with _device(mass):
        launch(kernels._arc_terms_grad_kernel, (B, n_tb),
            code, mass, gb, ge, g_mass, g_resc, g_am, dP, dR, part, T, U1, n_tb, *gb.stride(),
            *ge.stride(), *scales[:6], MIX=mix is not None, HAS_GB=g_b is not None,
            HAS_GE=g_e is not None, BLOCK_T=block_t, BLOCK_U=block_u, num_warps=ARC_WARPS)
        launch(kernels._arc_terms_cols_kernel, (B, triton.cdiv(U1, ARC_COLS[1])),
            part, g_lm, dQ, dS, U1, n_tb, *scales[6:], MIX=mix is not None,
            BLOCK_TB=ARC_COLS[0], BLOCK_U=ARC_COLS[1], num_warps=4)
    return g_mass, g_resc, g_am, g_lm, (() if mix is None else (dP, dQ, dR, dS))
