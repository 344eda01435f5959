"""Triton kernels of the GPU backend (docs/math.md, sections 1-6 and 9).

The loss of every topology (regular, k2 modified/constrained,
one_sym_per_frame, multi-blank, TDT; sigma, delay penalty, k2 boundary, node_rows) runs in
three passes, as in the CPU backend, driven by the arc kinds of ``rnnt_lattice.topology``
given as compile-time constant tuples (section "any topology" below):

1. ``_row_kernel`` — ``ROWS`` rows of the logits per program, each a lattice node
   ``(b, t, u)`` (programs run over the rows, ``LAYOUT``): the token
   group's log-normaliser ``lse(t,u)`` over V_tok in chunks of ``BLOCK_V`` (any V; one exp
   per element), TDT's duration group normaliser, and every kind's arc log-prob, float64.
2. ``_lattice_kernel`` — two programs per sequence, alpha and beta at the same time
   (they only read the arc log-probs), each swept along the anti-diagonals ``d = t + u``.
   A kind steps ``dt + du >= 1`` diagonals, so a diagonal depends only on earlier ones
   (up to the longest duration): the lanes of a program cover the label positions of a
   diagonal in blocks of ``BLOCK_U`` (any U), with a barrier between diagonals, and read
   the earlier diagonals back from the float64 workspace. The alpha program writes the
   costs.
3. ``_reads_kernel`` — once per node, after the lattice: the occupations of every arc
   that reads the node's row, summed per class read (the gradient's coefficients, FastEmit
   included), float64; then ``_grad_kernel`` — ``ROWS`` rows per program, a stream over V:
   the fused gradient rows, written once, with clamp and the upstream gradient fused.

The lattice tools (``occupancy``, ``best_alignment``; the backend's ``occupancy`` and
``viterbi``) run the same passes 1-2:
``_lattice_kernel`` with ``MAX_SEMIRING`` is the Viterbi sweep, which also records
the best incoming arc kind of every node (so a backtrack only follows pointers), and
``_gamma_kernel`` writes the per-kind occupations with the gradient's formula
(``_arc_occupation``). One recursion, for the losses and the tools.

Precision. The lattice — ``lse``, ``b``, ``e``, alpha, beta, ``log P`` and the occupations
— is float64 for every input dtype, as on the CPU: it is O(B*T*(U+1)) work against the
O(B*T*(U+1)*V) passes over the logits, and a float32 lattice carries an absolute error of
order ``eps32 * (T+U)`` into every occupation, hence into the gradient. The passes over V
read the logits in their own dtype and compute in ``ACC`` (float32; float64 for float64
logits): the exps of a chunk are summed in ACC (a tree reduction) and the chunk sums in
float64; the gradient rows use ``lse`` split into an ACC pair ``hi + lo`` so that
``logits - lse`` keeps the float64 normaliser's accuracy.

Offsets into the logits are int64 (a batch of logits easily passes 2**31 elements).
Nothing here reads a tensor value on the host: every length is loaded inside a kernel,
grid sizes come from tensor shapes only, and options are plain kernel arguments.

Padding (``t >= T_b`` or ``u > U_b``) is never loaded: every load of logits is masked by
the node's validity, so NaN-poisoned padding cannot leak into a result, and its gradient
is written as exactly 0. Lattice cells of padding are never read either, so the loss path
leaves alpha/beta of padding unwritten (the lattice tools fill them with -inf).
"""
from __future__ import annotations

import triton
import triton.language as tl

# A global read inside a kernel must be a constexpr, and equal to itself: at every launch
# Triton compares each global a kernel used with its value now (``!=``), so a NaN global
# fails the second launch ("Global variable NAN has changed since we compiled this
# kernel"). NaN is written as ``POS_INF + NEG_INF`` instead (tests/test_device_checks.py
# checks every kernel's globals by Triton's own rule).
NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))
# The exps a float32 block sum counts as the max's ties (``_lse_chunk``'s ``TIES`` = 2): 1
# and the four floats below it, for a GPU's ``exp`` (``ex2.approx.f32``, within 2^-22 of
# its value) need not give 1 for 0.
ONE_ULPS = tl.constexpr(1.0 - 2.0 ** -22)


# --------------------------------------------------------------------------- helpers
@triton.jit
def _f64(hi, mid, lo):
    """A float64 option passed as three float32 kernel arguments (``gpu._f64_parts``):
    Triton passes a Python float as float32 (the interpreter too), and three float32
    parts carry the 53 bits of a double exactly."""
    # A float64 zero first: compiled, the float32 parts are promoted exactly; interpreted,
    # the arguments arrive as Python floats, which have no ``.to``.
    zero = tl.zeros([], tl.float64)
    return ((zero + hi) + mid) + lo


@triton.jit
def _node_coords(node, T, U1):
    """``(b, t, u)`` of ``node = (b*T + t)*(U+1) + u`` (int64)."""
    u = node % U1
    t = (node // U1) % T
    b = node // (U1 * T)
    return b, t, u


@triton.jit
def _skew(T, U1):
    """``(s_t, s_u, plane)``: the strides of node ``(t, u)`` in one sequence's plane of the
    lattice state's node arrays (alpha and beta ``(T+1, U+1)``; each kind's lp and
    next_blank ``(T, U+1)``), at ``t s_t + u s_u``, and the plane's size (``gpu._skew``
    mirrors it). With ``a = min(U+1, T+1)`` and ``(s_t, s_u) = (a, a+1)`` (or ``(a+1, a)``
    when ``U+1 > T+1``) the offset is ``(t+u) a + u`` (or ``(t+u) a + t``): the nodes of an
    anti-diagonal ``t + u = d`` are adjacent, so that the lattice pass, whose lanes run
    along one diagonal, reads and writes contiguous float64s (one sector per four lanes)
    instead of one sector per lane at a stride of U+1; the plane takes ``(T + U+1) a``
    elements, less than twice the node grid."""
    a = tl.minimum(U1, T + 1)
    wide = (U1 > T + 1).to(tl.int32)
    return a + wide, a + 1 - wide, (T + U1) * a


@triton.jit
def _row_plane_at(node, b, t, u, T, U1, WIDE: tl.constexpr):
    """``(at, plane)`` of the row passes' nodes ``node = (b T + t)(U+1) + u``: their
    offsets in their sequence's planes and the planes' size (:func:`_skew`). ``WIDE``
    (``U+1 > T+1``, or any shape) takes the general formula; otherwise it is
    ``at = t (U+1) + u (U+2) = node - b T (U+1) + u (U+1)``, from values live anyway: the
    general one kept t and the strides live to the end of the row pass, 6-7 more registers
    a thread on sm_90 (one occupancy step of the pass that streams the logits)."""
    if WIDE:
        s_t, s_u, plane = _skew(T, U1)
        at = t * s_t + u * s_u
    else:
        plane = (T + U1) * U1
        at = node - b * T * U1 + u * U1
    return at, plane


# Layouts of the V passes (``LAYOUT``): how the programs' rows map to lattice nodes. The
# programs run over the rows they read (``n_rows`` of them), never over the whole grid.
# (Plain ints for the host side; the kernels compare ``LAYOUT`` with the literals.)
PADDED = 0      # logits (B, T, U+1, V): row r is node r
ROW_NODES = 1   # rows (N, V) and ``row_nodes (N,)``: the node that reads row r, -1: none
BOX = 2         # a fused tile's rows (B (t1-t0) (u1-u0), V), row-major (b, t, u) over the
                # box t0 <= t < t1, u0 <= u < u1 of every sequence


@triton.jit
def _row_node(r, inside, row_nodes_ptr, T, U1, box_t0, box_u0, box_T, box_U1,
              LAYOUT: tl.constexpr):
    """``(node, has_node)`` of rows ``r`` (int64): the flat node ``(b T + t)(U+1) + u``
    that reads each row in ``LAYOUT`` (0 where ``has_node`` is False: a row past
    ``n_rows``, or a row no node reads)."""
    if LAYOUT == 1:
        node = tl.load(row_nodes_ptr + r, mask=inside, other=-1).to(tl.int64)
    elif LAYOUT == 2:
        bu = r % box_U1
        bt = (r // box_U1) % box_T
        bb = r // (box_U1 * box_T)
        node = (bb * T + box_t0 + bt) * U1 + box_u0 + bu
    else:
        node = r
    has = inside & (node >= 0)
    return tl.where(has, node, 0), has


# =========================================================================== any topology
# The loss of every topology (math.md section 9): the same three passes, driven by the arc
# kinds of ``rnnt_lattice.topology`` given as compile-time constants (``gpu._kinds``),
#
# one field of ``topology.ArcKind`` each, under its name:
#
#     K                   number of kinds; KP the next power of two (a tile axis)
#     DT[k], DU[k]        the step of kind k: (t, u) -> (t + DT[k], u + DU[k])
#     READS[k]            token class it reads: 0 the blank, 1 the label y[u], 2 CLASS_ID[k]
#     CLASS_ID[k]         the fixed class of READS[k] == 2 (multi-blank's big blanks)
#     DURATION[k]         TDT duration index whose log-prob it adds (-1: none)
#     PLUS_NEXT_BLANK[k]  also adds b(t, u+1) (k2 constrained)
#     FASTEMIT[k]         FastEmit scales the gradient of its class read
#     DELAY[k]            carries the delay penalty
#     MAY_END[k]          may land on the end frame (only at the end node)
#     N_DURATIONS         the size of TDT's duration group (``Topology.n_durations``)
#     HAS_PLUS_NEXT_BLANK whether any kind is PLUS_NEXT_BLANK
#
# Each is a tuple of Python constants, indexed by the ``tl.static_range`` index of an
# unrolled loop over kinds: every ``if`` on a kind's field is resolved at compile time and
# each topology compiles to straight-line code for its own kinds (no table is read at run
# time, nothing per kind inside the loops over V but the class-read subtraction).
#
# Layout. Node grids are ``(B, T+1, U+1)`` for alpha and beta (frame T holds the end
# nodes ``(T_b, U_b)``), per-kind arc log-probs ``lp (B, K, T, U+1)`` over source nodes.
# ``LAYOUT`` (``_row_node``): the V passes run over the rows of the logits, each mapped to
# the node that reads it: padded logits (row r is node r), 2-D rows ``(N, V)`` with
# ``row_nodes (N,)`` (the inverse of ``node_rows (B, T, U+1)``: packed sequences, pruned
# windows; a node without a row has -inf arcs), or a fused tile's box.
# ``BOUNDARY``: k2's ``(B, 4)`` ``[begin_symbol, begin_frame, end_symbol, end_frame]``
# moves the start to ``(t0, u0)`` and the end to ``(t1, u1)``; without it they are
# ``(0, 0)`` and ``(T_b, U_b)``. Every node outside the region ``t0 <= t < t1,
# u0 <= u <= u1`` is padding: its row is never read and its gradient is 0.


@triton.jit
def _ends(boundary_ptr, logit_lengths_ptr, target_lengths_ptr, b, mask, T, U1,
          BOUNDARY: tl.constexpr):
    """``(t0, u0, t1, u1)`` int64 of sequence(s) ``b``: start and end node, clamped to the
    grid (frames ``0..T``, label positions ``0..U``): out-of-range lengths (undefined
    behaviour on CUDA, where they are not validated) never let a program index another
    sequence's block or past a buffer."""
    if BOUNDARY:
        u0 = tl.load(boundary_ptr + b * 4, mask=mask, other=0).to(tl.int64)
        t0 = tl.load(boundary_ptr + b * 4 + 1, mask=mask, other=0).to(tl.int64)
        u1 = tl.load(boundary_ptr + b * 4 + 2, mask=mask, other=0).to(tl.int64)
        t1 = tl.load(boundary_ptr + b * 4 + 3, mask=mask, other=0).to(tl.int64)
        t0 = tl.minimum(tl.maximum(t0, 0), T)
        u0 = tl.minimum(tl.maximum(u0, 0), U1 - 1)
    else:
        t1 = tl.load(logit_lengths_ptr + b, mask=mask, other=0).to(tl.int64)
        u1 = tl.load(target_lengths_ptr + b, mask=mask, other=0).to(tl.int64)
        t0 = t1 * 0
        u0 = t1 * 0
    t1 = tl.minimum(tl.maximum(t1, 0), T)
    u1 = tl.minimum(tl.maximum(u1, 0), U1 - 1)
    return t0, u0, t1, u1


@triton.jit
def _lands(lt, lu, t1, u1, MAY_END: tl.constexpr):
    """Whether an arc landing on ``(lt, lu)`` is an arc (math.md 9.1): ``lu <= u1`` and
    ``lt < t1``, or, for a ``may_end`` kind, exactly the end node ``(t1, u1)``."""
    if MAY_END:
        return (lu <= u1) & ((lt < t1) | ((lt == t1) & (lu == u1)))
    return (lu <= u1) & (lt < t1)


@triton.jit
def _gather(ptr, off, ok, none, GATHER: tl.constexpr):
    """``ptr[off]`` where ``ok``, -inf elsewhere. ``GATHER``: an unpredicated load from
    ``ptr + off`` where ``ok`` and from ``none`` elsewhere, a cell that holds -inf (the
    lattice kernel's: the cell after log P's). The load's value is then the result, with no
    select after it: on sm_90 a predicated load needs its mask in one of the seven predicate
    registers until it issues, and a select after an unpredicated load needs it until the
    value arrives; with TDT's nine kinds (eighteen loads a diagonal) either way ptxas ran
    out of predicates and consumed the first kinds' values before issuing the other kinds'
    loads, two memory latencies per diagonal. Here a mask is dead once its address is
    chosen, and every load of a diagonal issues before the first use
    (benchmarks/lattice_sass.py counts them). Otherwise (``none`` unused) a masked load
    (node-parallel kernels, whose lanes past the last node have no valid base)."""
    if GATHER:
        return tl.load(tl.where(ok, ptr + off, none))
    return tl.load(ptr + off, mask=ok, other=NEG_INF)


@triton.jit
def _arc_weight(lp_k, nb_b, off, s_u, t, t1, ok, sigma, delay_penalty, none,
                PLUS_NEXT_BLANK: tl.constexpr, DELAY: tl.constexpr, SIGMA: tl.constexpr,
                DELAY_ON: tl.constexpr, GATHER: tl.constexpr):
    """Weight ``w_k(t, u)`` (float64) of kind k's arc leaving ``(t, u)``, -inf where not
    ``ok``: its log-prob (class, plus duration: the row pass; ``lp_k`` the sequence's
    log-probs of kind k, ``off = t s_t + u s_u``, :func:`_skew`), plus ``b(t, u+1)`` for
    ``plus_next_blank`` (``nb_b`` the sequence's next_blank, at ``off + s_u``), minus sigma,
    plus ``delay_penalty ((t1 - 1)/2 - t)`` on delay kinds — the order of
    ``reference.kind_log_probs`` and ``reference.arc_weights``. ``GATHER``: loads as
    :func:`_gather`'s."""
    w = _gather(lp_k, off, ok, none, GATHER)
    if PLUS_NEXT_BLANK:
        w = w + _gather(nb_b, off + s_u, ok, none, GATHER)
    if SIGMA:
        w = w - sigma
    if DELAY_ON:
        if DELAY:
            w = w + delay_penalty * ((t1.to(tl.float64) - 1.0) / 2.0 - t.to(tl.float64))
    if GATHER:
        return w          # -inf off the arcs already: finite terms added to -inf
    return tl.where(ok, w, NEG_INF)


@triton.jit
def _lse_chunk(m, s, x, TIES: tl.constexpr = 1):
    """One chunk ``x [ROWS, BLOCK]`` (ACC) of an online log-normaliser per row: the running
    max ``m`` (ACC) and the float64 sum ``s`` of ``exp(x - m)`` so far become ``m' = max(m,
    max_v x_v)`` and ``s' = s * exp(m - m') + sum_v exp(x_v - m')`` -- one exp per element
    (the rescaling is one exp per row and chunk); the chunk's own sum is an ACC tree
    reduction. A row whose max is still -inf shifts by 0 instead, so that ``-inf - -inf``
    never appears; a NaN or +inf entry turns ``s`` into NaN (math.md 8.1). The entries
    whose exp is 1 (the max's ties) are counted into ``s``, not summed in ACC, where a
    confident row's ``1 + rest`` rounds ``rest`` away (math.md 4.1):

    ``TIES`` = 1: the entries equal to the max counted apart (:func:`_exp_sum`);
    ``TIES`` = 2 (the joiner's row pass, ``gpu.joint``): the chunk's ACC sum ``total`` and
    its sum ``rest`` without the entries whose exp is within 2^-22 of 1 (:data:`ONE_ULPS`:
    the max's, whose exp on a GPU is ``ex2.approx`` of 0), their count ``round(total -
    rest)`` (both sums are below ``BLOCK``, each within ``BLOCK`` of its ulps: far closer
    than 1/2 to the count). Two sums of one exp: with :func:`_exp_sum`'s compare and count
    (or a compare of ``x`` with the max) the joiner's row pass, at its cap of 128
    registers, spilled 72-112 (96-144) bytes a thread on sm_90 (Triton 3.6), with these
    none on the regular loss. (An entry within 2^-22 of the max, which a float32 holds
    only below 4 in magnitude, counts as 1: off by less than ``ex2.approx``'s own error.)"""
    m_new = tl.maximum(m, tl.max(x, axis=1))
    shift = tl.where(m_new == NEG_INF, 0.0, m_new)
    scale = tl.exp((m - shift).to(tl.float64))
    if TIES == 1:
        return m_new, s * scale + _exp_sum(x - shift[:, None], 1)
    e = tl.exp(x - shift[:, None])
    rest = tl.sum(tl.where(e >= ONE_ULPS, 0.0, e), axis=1)
    ones = (tl.sum(e, axis=1) - rest + 0.5).to(tl.int32)       # (NaN: s is NaN by rest)
    return m_new, s * scale + (ones.to(tl.float64) + rest.to(tl.float64))


@triton.jit
def _exp_sum(d, axis: tl.constexpr):
    """``sum exp(d)`` along ``axis`` (``d <= 0``), float64: the entries with ``d = 0``
    (the max, ``exp(0) = 1``) counted, the others summed in ``d``'s dtype. A confident
    row's ``1 + rest`` in float32 rounds ``rest`` (below 2^-24 the max's log-prob read 0,
    and the gradient entries that cancel near ``p = 1`` kept only that rounding)."""
    if d.dtype == tl.float64:                      # (1 + rest in float64 keeps rest)
        return tl.sum(tl.exp(d), axis=axis)
    tie = d == 0.0
    rest = tl.sum(tl.where(tie, 0.0, tl.exp(d)), axis=axis)
    if axis == 1:                # across a row's threads: one more float reduction
        ties = tl.sum(tl.where(tie, 1.0, 0.0), axis=axis)
    else:                        # within a thread (LANES): fewer registers as integers
        ties = tl.sum(tie.to(tl.int32), axis=axis)
    return ties.to(tl.float64) + rest.to(tl.float64)


@triton.jit
def _lse_finish(m, s):
    """The float64 log-normaliser of :func:`_lse_chunk`'s ``(m, s)``: -inf for an all -inf
    row, NaN for a row that held a NaN or +inf."""
    shift = tl.where(m == NEG_INF, 0.0, m)
    return shift.to(tl.float64) + tl.log(s)


@triton.jit
def _lse_step(m, s, x, LANES: tl.constexpr):
    """One chunk ``x [ROWS, BLOCK]`` (ACC) into the running log-normaliser ``(m, s)``.

    ``LANES`` = 0: :func:`_lse_chunk`, ``m`` and ``s`` of shape ``[ROWS]``: the chunk's max
    and sum are reduced across the row's threads at every chunk (two cross-lane reductions
    and a float64 exp a row and chunk: 136 instructions a thread and chunk of 4 float32
    entries on sm_90 with Triton 3.6, most of the row pass's; benchmarks/row_sass.py).

    ``LANES`` > 0: a running max and sum per group of ``LANES`` adjacent entries (one
    thread's vector load: 16 bytes), ``m`` and ``s`` of shape ``[ROWS, BLOCK // LANES]``:
    ``m' = max(m, max_j x_j)``, ``s' = s exp(m - m') + sum_j exp(x_j - m')`` over the
    group's entries j (the ties with the max counted: :func:`_exp_sum`), with the rescaling
    in ACC and the sum kept in float64; nothing crosses threads until :func:`_lse_done`.
    A group whose max is still -inf shifts by 0, and a NaN or +inf entry turns its ``s``
    into NaN, as in :func:`_lse_chunk`."""
    if LANES > 0:
        x3 = tl.reshape(x, [x.shape[0], x.shape[1] // LANES, LANES])
        m_new = tl.maximum(m, tl.max(x3, axis=2))
        shift = tl.where(m_new == NEG_INF, 0.0, m_new)
        s = s * tl.exp(m - shift).to(tl.float64) + _exp_sum(x3 - shift[:, :, None], 2)
        m = m_new
    else:
        m, s = _lse_chunk(m, s, x)
    return m, s


@triton.jit
def _lse_done(m, s, LANES: tl.constexpr):
    """The float64 log-normaliser of :func:`_lse_step`'s ``(m, s)``: with ``LANES`` > 0 the
    groups' ``(m, s)`` reduced once across the row, ``M = max m``, ``S = sum s exp(m - M)``
    (float64 sum), ``lse = M + log S``; -inf for an all -inf row, NaN for a row that held a
    NaN or +inf (a group's NaN ``s``, or ``exp(inf - inf)``)."""
    if LANES > 0:
        top = tl.max(m, axis=1)
        shift = tl.where(top == NEG_INF, 0.0, top)
        total = tl.sum(s * tl.exp(m - shift[:, None]).to(tl.float64), axis=1)
        lse = shift.to(tl.float64) + tl.log(total)
    else:
        lse = _lse_finish(m, s)
    return lse


@triton.jit
def _group_lse(logits_ptr, row, start, n, live, ACC: tl.constexpr, ROWS: tl.constexpr,
               BLOCK: tl.constexpr, ALIGN: tl.constexpr, SPAN: tl.constexpr = 0,
               PREFETCH: tl.constexpr = False, LANES: tl.constexpr = 0):
    """Log-normaliser of the ``n`` entries ``start ..`` of ``ROWS`` rows, float64, in
    chunks of BLOCK (:func:`_lse_chunk`): -inf for an all -inf row, NaN for a row holding a
    NaN or +inf (math.md 8.1: either one turns the row's exp sum into NaN, whatever the
    running max does with it). Rows not ``live`` are not read.

    ``SPAN`` > 0 (rows that start anywhere: TDT's rows of V_tok + durations, odd V): the
    chunks are read from the multiple of ``SPAN`` entries (16 bytes) at or below each
    group's first entry, so that every load is a 16-byte vector load whatever the row's
    alignment, and the entries before the group are selected away in registers; the
    whole ``SPAN``-groups end at or before the group's end, and its last ``< SPAN`` entries
    are one short load of their own. Nothing past the group is read; the entries before
    it lie in the same tensor (the row before, or this row's own).

    ``PREFETCH``: each chunk's load is issued before the previous chunk is reduced (the
    chunk in registers is carried by the loop), so that a program keeps a load in flight
    while its warps reduce; without it the next load waits for the reductions (the loop is
    a chain load -> max -> exp -> sum). The chunks, their order and so the result are the
    same either way. On an H200 at s5 the row pass took 0.422 ms with it and 0.436 without
    (aligned rows: ``gpu.ROW_PREFETCH``); TDT's span took 0.634 with it and 0.621 without
    when each chunk was reduced across the row (``LANES`` = 0;
    benchmarks/results/gpu/h200-200152e-run2-sweep.log), so the span's rows take it only
    with ``gpu.SPAN_PREFETCH``. The span's tail comes first, either way.

    ``LANES`` > 0: the chunks are folded per group of ``LANES`` entries and reduced across
    the row once, at the end (:func:`_lse_step`, :func:`_lse_done`)."""
    offs = tl.arange(0, BLOCK)
    if LANES > 0:
        m = tl.full([ROWS, BLOCK // LANES], NEG_INF, ACC)
        s = tl.zeros([ROWS, BLOCK // LANES], tl.float64)
    else:
        m = tl.full([ROWS], NEG_INF, ACC)
        s = tl.zeros([ROWS], tl.float64)
    if SPAN > 0:
        first = row + start                                   # int64, any alignment
        base = tl.multiple_of(first - first % SPAN, SPAN)     # 16-byte aligned
        head = (first - base).to(tl.int32)                    # [0, SPAN): not the group's
        end = head + tl.where(live, n, 0)                     # the group's end from base
        body = tl.multiple_of(end - end % SPAN, SPAN)         # whole SPAN-groups
        # The last < SPAN entries first (with LANES in chunks of BLOCK: the groups' shape),
        # so that their short load is issued ahead of the body's.
        if LANES > 0:
            for k in tl.static_range(0, SPAN, BLOCK):
                t = body[:, None] + k + offs[None, :]
                tail = tl.load(logits_ptr + base[:, None] + t,
                               mask=(t >= head[:, None]) & (t < end[:, None]),
                               other=NEG_INF).to(ACC)
                m, s = _lse_step(m, s, tail, LANES)
        else:
            t = body[:, None] + tl.arange(0, SPAN)[None, :]
            tail = tl.load(logits_ptr + base[:, None] + t,
                           mask=(t >= head[:, None]) & (t < end[:, None]), other=NEG_INF).to(ACC)
            m, s = _lse_step(m, s, tail, LANES)
        if PREFETCH:
            # As the aligned rows' below: chunk 0 ahead of the loop (all -inf when no row
            # has a whole group, which leaves m and s as they are), each chunk's load issued
            # before the previous one is reduced; the entries before the group are selected
            # away in chunk 0 only (head < SPAN <= BLOCK). The same chunks in the same order.
            x = tl.load(logits_ptr + base[:, None] + offs[None, :],
                        mask=offs[None, :] < body[:, None], other=NEG_INF)
            x = tl.where(offs[None, :] >= head[:, None], x.to(ACC), NEG_INF)
            for v0 in range(BLOCK, tl.max(body, axis=0), BLOCK):
                v = v0 + offs
                x_next = tl.load(logits_ptr + base[:, None] + v[None, :],
                                 mask=v[None, :] < body[:, None], other=NEG_INF).to(ACC)
                if SPAN > BLOCK:                      # (tiny chunks: head may pass chunk 0)
                    x_next = tl.where(v[None, :] >= head[:, None], x_next, NEG_INF)
                m, s = _lse_step(m, s, x, LANES)
                x = x_next
            m, s = _lse_step(m, s, x, LANES)
        else:
            for v0 in range(0, tl.max(body, axis=0), BLOCK):
                v = v0 + offs
                x = tl.load(logits_ptr + base[:, None] + v[None, :],
                            mask=v[None, :] < body[:, None], other=NEG_INF)
                # Widened first: -inf in the logits' dtype would be a bfloat16 constant,
                # which the interpreters of Triton 3.5 and 3.6 cannot make (no get_bf16);
                # same values.
                x = tl.where(v[None, :] >= head[:, None], x.to(ACC), NEG_INF)
                m, s = _lse_step(m, s, x, LANES)
    else:
        v_end = tl.multiple_of(tl.where(live, n, 0), ALIGN)   # ALIGN | n: vector loads
        at = logits_ptr + row[:, None] + start
        if PREFETCH:
            # Chunk 0 ahead of the loop: all -inf when no row is live, which leaves m = -inf
            # and s = 0 as no chunk would.
            x = tl.load(at + offs[None, :], mask=offs[None, :] < v_end[:, None], other=NEG_INF)
            for v0 in range(BLOCK, tl.max(v_end, axis=0), BLOCK):
                v = v0 + offs
                x_next = tl.load(at + v[None, :], mask=v[None, :] < v_end[:, None],
                                 other=NEG_INF)
                m, s = _lse_step(m, s, x.to(ACC), LANES)
                x = x_next
            m, s = _lse_step(m, s, x.to(ACC), LANES)
        else:
            for v0 in range(0, tl.max(v_end, axis=0), BLOCK):     # no chunk when no row is live
                v = v0 + offs
                x = tl.load(at + v[None, :], mask=v[None, :] < v_end[:, None], other=NEG_INF)
                m, s = _lse_step(m, s, x.to(ACC), LANES)
    return _lse_done(m, s, LANES)


@triton.jit
def _read(x, lse, live, FUSED: tl.constexpr):
    """Log-prob ``x - lse`` of one entry per row (``reference._read``): -inf for rows not
    ``live`` (padding, no row, all -inf); in log-prob mode a +inf entry reads as NaN."""
    if not FUSED:
        # inf - inf = NaN (a NaN global would fail Triton's launch-time check of globals).
        x = tl.where(x == POS_INF, x - x, x)
    return tl.where(live, x - lse, NEG_INF)


@triton.jit
def _split(x, ACC: tl.constexpr):
    """A float64 ``x`` as an ACC pair ``hi + lo`` (``x - hi - lo`` keeps its accuracy)."""
    hi = x.to(ACC)
    return hi, (x - hi.to(tl.float64)).to(ACC)


# --------------------------------------------------------------------------- the workspace
# The float64 lattice state of a batch is one workspace (``gpu._Layout``): each kernel gets
# its pointer ``ws_ptr`` and the element offsets of the parts it uses (plain ints, so that
# the host builds no tensor view per part and call):
#
#     o_lse    lse (B, T, U+1)            token group log-normaliser (row pass)
#     o_dur    lse_dur (B, T, U+1)        TDT's duration group log-normaliser
#     o_nb     next_blank (B, T, U+1)     the blank log-prob b(t, u) (plus_next_blank kinds)
#     o_lp     lp (B, K, T, U+1)          per-kind arc log-probs over source nodes
#     o_alpha  alpha (B, T+1, U+1)        frame T holds the end nodes
#     o_beta   beta (B, T+1, U+1)
#     o_ll     log P (B,)
#     o_reads  reads (NC, B T (U+1))      the gradient's per-node coefficients (``_reads_kernel``)
#     o_x      x (2 + N_CLS + N_DURATIONS, B T (U+1))   the logits the arcs read: the blank's,
#                                         the label's, each fixed class kind's, each duration's
#                                         (the joiner's kernel path, whose logits are never in
#                                         memory: ``gpu.joint``)
#
# next_blank, lp, alpha and beta are skewed (``_skew``): sequence b's plane (of kind k) starts
# at ``(b K + k) plane`` (``b plane``), node (t, u) at ``t s_t + u s_u`` in it, so that the
# nodes of one anti-diagonal are adjacent; lse, lse_dur, reads and x are in node order (the V
# passes read them a row at a time).
#
# A part a topology does not use has no room (its offset is never read).
_WS = ("o_lse", "o_dur", "o_nb", "o_lp", "o_alpha", "o_beta", "o_ll", "o_reads", "o_x")


# --------------------------------------------------------------------------- pass 1
# Shape integers are not specialised (``do_not_specialize``): Triton would otherwise compile
# a variant per class of each (equal to 1, divisible by 16, other), up to 3**k variants of
# a kernel over a training run's varying T and U (benchmarks/compile_variants.py). The one
# property of a shape the code generation needs, the alignment of the logits rows (vector
# loads), is the constexpr ``V_ALIGN``.
_SHAPES = ("n_rows", "n_nodes", "T", "U1", "V_tok", "blank")


@triton.jit
def _row_state(ws_ptr, node, inside, valid, live, live_dur, has_label, b, at, plane, u, u1,
               T, U1, lse, lse_dur, x_blank, x_label, x_cls, x_dur, o_lse, o_dur, o_nb, o_lp,
               K: tl.constexpr, KP: tl.constexpr, DU: tl.constexpr, READS: tl.constexpr,
               DURATION: tl.constexpr, N_DURATIONS: tl.constexpr,
               HAS_PLUS_NEXT_BLANK: tl.constexpr, FUSED: tl.constexpr):
    """The row pass's results at nodes ``node`` (the one writer of the lattice state's
    ``lse``, ``lse_dur``, ``lp`` and ``next_blank``, for ``_row_kernel`` and the joiner's
    kernel, ``gpu.joint``), from the entries each kind reads: ``x_blank``, ``x_label`` (of
    ``y[u]``), ``x_cls[:, k]`` (kind k's fixed class) and ``x_dur[:, i]`` (duration index
    i's entry), float64, and the log-normalisers ``lse``, ``lse_dur`` (math.md 9,
    ``kind_log_probs``):

        lp_k(t,u) = [x(t,u,c_k) - lse(t,u)] + [x(t,u,V_tok + DURATION[k]) - lse_dur(t,u)]

    -inf outside the region (``valid``) and where ``u + DU[k] > u1``; the rows not ``live``
    (``live_dur``, ``has_label``) read nothing (:func:`_read`); padding gets ``lse = 0``.
    ``at, plane``: the nodes' offsets in their sequence's planes and the planes' size
    (:func:`_row_plane_at`)."""
    lp_blank = _read(x_blank, lse, live, FUSED)
    lp_label = _read(x_label, lse, has_label, FUSED)
    if N_DURATIONS > 0:
        tl.store(ws_ptr + o_dur + node, tl.where(valid, lse_dur, 0.0), mask=inside)
    kidx = tl.arange(0, KP)
    didx = tl.arange(0, x_dur.shape[1])
    lp_at = ws_ptr + o_lp + (b * K * plane + at)     # kind 0's lp of the nodes
    for k in tl.static_range(K):
        if READS[k] == 0:
            lp = lp_blank
        elif READS[k] == 1:
            lp = lp_label
        else:
            x = tl.sum(tl.where(kidx[None, :] == k, x_cls, 0.0), axis=1)
            lp = _read(x, lse, live, FUSED)
        if DURATION[k] >= 0:
            x = tl.sum(tl.where(didx[None, :] == DURATION[k], x_dur, 0.0), axis=1)
            lp = lp + _read(x, lse_dur, live_dur, FUSED)
        ok = valid & (u + DU[k] <= u1)
        tl.store(lp_at + k * plane, tl.where(ok, lp, NEG_INF), mask=inside)
    tl.store(ws_ptr + o_lse + node, tl.where(valid, lse, 0.0), mask=inside)
    if HAS_PLUS_NEXT_BLANK:
        tl.store(ws_ptr + o_nb + b * plane + at, lp_blank, mask=inside)


@triton.jit
def _row_reads(logits_ptr, targets_ptr, row, b, u, U1, V_tok, blank, valid, live, has_label,
               ACC: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, READS: tl.constexpr,
               CLASS_ID: tl.constexpr, N_DURATIONS: tl.constexpr, FUSED: tl.constexpr,
               ROWS: tl.constexpr, BLOCK_DUR: tl.constexpr):
    """The row pass's entries besides the token group's log-normaliser: the blank's (rows
    ``live``), the label's ``y[u]`` (rows ``has_label``; a label outside ``[0, V_tok)`` is
    never read: the input check NaNs its sequence's loss), the fixed classes' (``x_cls
    [ROWS, KP]``, column k kind k's; rows ``live``), float64; and TDT's duration group over
    the rows ``valid``: its log-normaliser ``lse_dur`` (zeros without durations or in
    log-prob mode) and its entries ``x_dur [ROWS, BLOCK_DUR]`` (column i duration index
    i's) where ``lse_dur`` is not -inf."""
    x_blank = tl.load(logits_ptr + row + blank, mask=live, other=0.0).to(tl.float64)
    y = tl.load(targets_ptr + b * (U1 - 1) + u, mask=has_label, other=0)
    x_label = tl.load(logits_ptr + row + y, mask=has_label & (y >= 0) & (y < V_tok),
                      other=0.0).to(tl.float64)
    kidx = tl.arange(0, KP)
    x_cls = tl.zeros([ROWS, KP], tl.float64)
    for k in tl.static_range(K):
        if READS[k] == 2:
            x = tl.load(logits_ptr + row + CLASS_ID[k], mask=live, other=0.0).to(tl.float64)
            x_cls = tl.where(kidx[None, :] == k, x[:, None], x_cls)
    if N_DURATIONS > 0 and FUSED:
        lse_dur = _group_lse(logits_ptr, row, V_tok, N_DURATIONS, valid, ACC, ROWS, BLOCK_DUR,
                             1)
    else:
        lse_dur = tl.zeros([ROWS], tl.float64)
    didx = tl.arange(0, BLOCK_DUR)
    x_dur = tl.load(logits_ptr + row[:, None] + V_tok + didx[None, :],
                    mask=(valid & (lse_dur != NEG_INF))[:, None]
                    & (didx[None, :] < N_DURATIONS), other=0.0).to(tl.float64)
    return x_blank, x_label, x_cls, lse_dur, x_dur


@triton.jit(do_not_specialize=_SHAPES + _WS + ("box_t0", "box_u0", "box_T", "box_U1"))
def _row_kernel(
    # data ptrs
    logits_ptr, row_nodes_ptr, targets_ptr, logit_lengths_ptr, target_lengths_ptr, boundary_ptr,
    ws_ptr,
    # shapes: the rows, the grid, the box (LAYOUT 2); the workspace parts written
    n_rows, T, U1, V_tok, blank, box_t0, box_u0, box_T, box_U1, o_lse, o_dur, o_nb, o_lp,
    # arc kinds
    K: tl.constexpr, KP: tl.constexpr, DT: tl.constexpr, DU: tl.constexpr, READS: tl.constexpr,
    CLASS_ID: tl.constexpr, DURATION: tl.constexpr, PLUS_NEXT_BLANK: tl.constexpr,
    FASTEMIT: tl.constexpr, DELAY: tl.constexpr, MAY_END: tl.constexpr,
    N_DURATIONS: tl.constexpr, HAS_PLUS_NEXT_BLANK: tl.constexpr,
    # flags
    FUSED: tl.constexpr, BOUNDARY: tl.constexpr, LAYOUT: tl.constexpr, ACC: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_DUR: tl.constexpr, V_ALIGN: tl.constexpr,
    SPAN: tl.constexpr, WIDE: tl.constexpr, PREFETCH: tl.constexpr, LANES: tl.constexpr,
    EARLY: tl.constexpr,
):
    """Row pass of ``ROWS`` rows of the logits, each that of the node ``_row_node`` maps
    it to (``LAYOUT``: programs run over the rows, never over the whole grid): the token
    group's log-normaliser ``lse(t,u)`` over its ``V_tok`` entries in chunks of BLOCK_V (and
    TDT's duration group ``lse_dur`` over its ``N_DURATIONS`` entries in one chunk), then
    every kind's log-prob at the node (math.md 9, ``kind_log_probs``):

        lp_k(t,u) = [x(t,u,c_k) - lse(t,u)] + [x(t,u,V_tok + DURATION[k]) - lse_dur(t,u)]

    with ``c_k`` the blank, ``y[u]`` or ``CLASS_ID[k]``; -inf outside the region and where
    ``u + DU[k] > u1``. ``next_blank (B, T, U+1)`` (only with a ``plus_next_blank`` kind) is
    the blank's log-prob, read by the arc from ``(t, u-1)``. ``SPAN`` > 0: the token group
    is read from its 16-byte aligned span (rows not aligned, :func:`_group_lse`). Outputs
    are float64; padding gets ``lse = 0`` and -inf arcs. Only the nodes of the rows are
    written: with ``row_nodes``, the caller fills the nodes that read no row (``lse = 0``,
    -inf arcs). ``WIDE``: ``U+1 > T+1`` (:func:`_row_plane_at`).

    ``EARLY``: the entries that do not need the token group's ``lse`` (the blank's, the
    label's after its target, the fixed classes', the duration group) are loaded before the
    token group's loop, from every row in the region, so that their latency overlaps the
    loop's instead of following it (a program has no load in flight while it waits for
    them); without it they are read after the loop, from the rows whose token group is not
    all -inf. The rows not ``live`` read as -inf either way (:func:`_read`): the same
    results, bit for bit."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)       # [ROWS], int64
    node, inside = _row_node(r, r < n_rows, row_nodes_ptr, T, U1, box_t0, box_u0, box_T,
                             box_U1, LAYOUT)
    b, t, u = _node_coords(node, T, U1)
    t0, u0, t1, u1 = _ends(boundary_ptr, logit_lengths_ptr, target_lengths_ptr, b, inside,
                           T, U1, BOUNDARY)
    valid = inside & (t >= t0) & (t < t1) & (u >= u0) & (u <= u1)
    # int64: past 2**31 logits. V_ALIGN divides the row length and V_tok (``gpu._v_align``).
    row = tl.multiple_of(r * (V_tok + N_DURATIONS), V_ALIGN)
    if EARLY:
        x_blank, x_label, x_cls, lse_dur, x_dur = _row_reads(
            logits_ptr, targets_ptr, row, b, u, U1, V_tok, blank, valid, valid,
            valid & (u < u1), ACC, K, KP, READS, CLASS_ID, N_DURATIONS, FUSED, ROWS, BLOCK_DUR)
    if FUSED:
        lse = _group_lse(logits_ptr, row, 0, V_tok, valid, ACC, ROWS, BLOCK_V, V_ALIGN, SPAN,
                         PREFETCH, LANES)
    else:
        lse = tl.zeros([ROWS], tl.float64)   # log-prob mode: rows are normalised
    live = valid & (lse != NEG_INF)          # NaN rows stay live: NaN flows on
    has_label = live & (u < u1)
    if not EARLY:
        x_blank, x_label, x_cls, lse_dur, x_dur = _row_reads(
            logits_ptr, targets_ptr, row, b, u, U1, V_tok, blank, valid, live, has_label, ACC,
            K, KP, READS, CLASS_ID, N_DURATIONS, FUSED, ROWS, BLOCK_DUR)
    if N_DURATIONS == 0:
        lse_dur = lse
    live_dur = valid & (lse_dur != NEG_INF)
    at, plane = _row_plane_at(node, b, t, u, T, U1, WIDE)
    _row_state(ws_ptr, node, inside, valid, live, live_dur, has_label, b, at, plane, u, u1, T, U1,
               lse, lse_dur, x_blank, x_label, x_cls, x_dur, o_lse, o_dur, o_nb, o_lp, K, KP,
               DU, READS, DURATION, N_DURATIONS, HAS_PLUS_NEXT_BLANK, FUSED)


# --------------------------------------------------------------------------- pass 2
# ``_exp_nonpos``: Cody-Waite's split of ln 2 (LN2_HI has 32 significant bits, so ``k LN2_HI``
# is exact for the |k| <= 1022 used), the Taylor coefficients 1/n! of exp (n = 0..13), and
# 1.5 * 2**52, whose float64 neighbourhood rounds to integers.
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2_HI = tl.constexpr(6.93147180369123816490e-01)
_LN2_LO = tl.constexpr(1.90821492927058770002e-10)
_ROUND = tl.constexpr(6755399441055744.0)
_ROUND_BITS = tl.constexpr(0x4338000000000000)
_EXP_C = tl.constexpr(tuple(1.0 / f for f in (1, 1, 2, 6, 24, 120, 720, 5040, 40320, 362880,
                                                  3628800, 39916800, 479001600, 6227020800)))


@triton.jit
def _exp_nonpos(x):
    """``exp(x)`` of float64 ``x <= 0`` (``-inf`` and NaN too) in straight-line code, for the
    lattice's log-sum-exp over arc kinds, where every term is ``x_k - max_k x_k``. Within
    about 1 ulp of ``exp`` (tests/test_triton.py::test_exp_nonpos); ``exp(0)`` is 1 exactly.

        x  <- max(x, -708)                 (NaN stays NaN)
        k  =  round(x / ln 2)              (x log2(e) + 1.5 * 2**52: k in its low bits)
        r  =  x - k ln 2                   (|r| <= ln(2) / 2; ln 2 in two parts, exact products)
        exp(x) = 2**k (1 + r + r**2 q(r)),  q(r) = sum_{n=2..13} r**(n-2) / n!

    (truncation below 1e-17 of the sum), ``q`` in Estrin's scheme: pairs of terms, then
    powers r**2, r**4, r**8, six dependent operations where Horner's rule takes thirteen.
    ``2**k`` is built from k's bits (exponent field ``k + 1023``; k >= -1021, a normal
    float). Below -708 it returns ``exp(-708)`` (3.3e-308) instead of a smaller value or 0:
    each caller adds the term to a sum that holds ``exp(0) = 1`` (the max's own term), where
    anything below 2**-53 vanishes in the rounding, and a sum of -inf terms only is discarded
    by the caller. Why not ``tl.exp``: libdevice's float64 exp holds a branch (its slow path
    near the overflow range), across which ptxas does not move instructions, and a longer
    chain; the lattice's diagonal is one warp's dependent chain, with nothing to hide it
    (docs/benchmarks.md, ``benchmarks/lattice_sass.py``)."""
    x = tl.where(x < -708.0, -708.0, x)
    t = x * _LOG2E + _ROUND
    k = t - _ROUND
    r = x - k * _LN2_HI
    r = r - k * _LN2_LO
    r2 = r * r
    r4 = r2 * r2
    q = ((r * _EXP_C[3] + _EXP_C[2]) + (r * _EXP_C[5] + _EXP_C[4]) * r2
         + ((r * _EXP_C[7] + _EXP_C[6]) + (r * _EXP_C[9] + _EXP_C[8]) * r2) * r4
         + ((r * _EXP_C[11] + _EXP_C[10]) + (r * _EXP_C[13] + _EXP_C[12]) * r2) * (r4 * r4))
    p = 1.0 + (r + r2 * q)
    scale = ((t.to(tl.int64, bitcast=True) - _ROUND_BITS + 1023) << 52).to(tl.float64,
                                                                             bitcast=True)
    return p * scale


@triton.jit
def _lse_kinds(xs, K: tl.constexpr, MAX_SEMIRING: tl.constexpr):
    """``(lse_k xs[k], best)`` over a tuple of the K kinds' terms (float64 ``[BLOCK_U]``
    each): the max, then one exp per term, all independent, and one log; in the max-plus
    semiring the max and ``best``, the first kind holding it (strictly greater replaces, so
    the first kind wins a tie and a NaN never wins). -inf terms add nothing and never meet
    as ``-inf - -inf``; a NaN propagates: the max takes a term only where it is greater
    (the same on the GPU and under the interpreter, and no NaN bookkeeping), so a NaN term
    is either the first (then the max) or lands in the sum, which turns NaN; a sum that is
    NaN is never taken for "no arc". The exps are :func:`_exp_nonpos`'s. The caller has
    issued every term's loads before this first reads one (see :func:`_gather`)."""
    mx = xs[0]
    best = tl.zeros(mx.shape, tl.int32)
    if MAX_SEMIRING:
        for k in tl.static_range(1, K):
            best = tl.where(xs[k] > mx, k, best)
            mx = tl.maximum(mx, xs[k], propagate_nan=tl.PropagateNan.ALL)
        return mx, best
    for k in tl.static_range(1, K):
        mx = tl.where(xs[k] > mx, xs[k], mx)
    shift = tl.where(mx == NEG_INF, 0.0, mx)
    s = _exp_nonpos(xs[0] - shift)
    for k in tl.static_range(1, K):
        s += _exp_nonpos(xs[k] - shift)
    return tl.where((mx == NEG_INF) & (s == s), mx, mx + tl.log(s)), best


@triton.jit
def _diag_weights(d, u, t0, u0, t1, u1, s_t, s_u, lp_b, nb_b, plane, sigma, delay_penalty,
                  none, K: tl.constexpr, DT: tl.constexpr, DU: tl.constexpr,
                  PLUS_NEXT_BLANK: tl.constexpr, DELAY: tl.constexpr, MAY_END: tl.constexpr,
                  SIGMA: tl.constexpr, DELAY_ON: tl.constexpr, BETA: tl.constexpr):
    """``ONCHIP``'s weights of diagonal ``d`` (lanes ``u``, nodes ``(d - u, u)``), a tuple
    of K ``[BLOCK_U]``: each kind's arcs into the nodes (alpha) or leaving them (``BETA``),
    -inf off the arcs (loaded unpredicated, as ``_gather``'s)."""
    t = d - u
    on = (u >= tl.maximum(d - t1, u0)) & (u <= tl.minimum(d - t0, u1))
    at = t * s_t + u * s_u
    ws = ()
    for k in tl.static_range(K):
        if BETA:                                         # the arc leaves (t, u)
            st = t
            ok = on & (t < t1) & _lands(t + DT[k], u + DU[k], t1, u1, MAY_END[k])
            src = at
        else:                                            # the arc comes from (st, u - du)
            st = t - DT[k]
            ok = (on & (st >= t0) & (st < t1) & (u - DU[k] >= u0)
                  & _lands(t, u, t1, u1, MAY_END[k]))
            src = at - (DT[k] * s_t + DU[k] * s_u)
        ws = ws + (_arc_weight(lp_b + k * plane, nb_b, src, s_u, st, t1, ok, sigma,
                               delay_penalty, none, PLUS_NEXT_BLANK[k], DELAY[k], SIGMA,
                               DELAY_ON, True),)
    return ws


@triton.jit
def _shift(x, u, BY: tl.constexpr):
    """``x[u - BY]`` at lane u (BY = 1 or -1), -inf where that lane is outside the block: a
    gather across the program's lanes (through shared memory, with its barriers)."""
    BLOCK: tl.constexpr = x.shape[0]
    v = tl.gather(x, tl.minimum(tl.maximum(u - BY, 0), BLOCK - 1), 0)
    return tl.where((u - BY >= 0) & (u - BY < BLOCK), v, NEG_INF)


@triton.jit
def _ring_start(u, lane, DEPTH: tl.constexpr, BY: tl.constexpr):
    """The diagonals' ring before the first diagonal: the start node's 0 at ``lane``, -inf
    on every other lane and on the ``DEPTH - 1`` diagonals before it; and the same shifted
    ``BY`` lanes (:func:`_shift`)."""
    hist = (tl.where(u == lane, 0.0, NEG_INF).to(tl.float64),)
    for j in tl.static_range(DEPTH - 1):
        hist = hist + (tl.full(u.shape, NEG_INF, tl.float64),)
    hist_s = ()
    for j in tl.static_range(DEPTH):
        hist_s = hist_s + (_shift(hist[j], u, BY),)
    return hist, hist_s


@triton.jit
def _push(hist, x, DEPTH: tl.constexpr):
    """``(x, hist[0], ..., hist[DEPTH - 2])``: the diagonals' ring, newest first."""
    out = (x,)
    for j in tl.static_range(DEPTH - 1):
        out = out + (hist[j],)
    return out


@triton.jit(do_not_specialize=_SHAPES + _WS)
def _lattice_kernel(
    # data ptrs
    ws_ptr, logit_lengths_ptr, target_lengths_ptr, boundary_ptr, costs_ptr, nan_rows_ptr,
    best_kind_ptr,
    # shapes; the workspace parts read (lp, next_blank) and written (alpha, beta, log P)
    T, U1, o_nb, o_lp, o_alpha, o_beta, o_ll,
    # options: sigma and delay_penalty, each a float64 in three float32 parts
    sigma_hi, sigma_mid, sigma_lo, delay_hi, delay_mid, delay_lo,
    # arc kinds
    K: tl.constexpr, DT: tl.constexpr, DU: tl.constexpr, READS: tl.constexpr,
    CLASS_ID: tl.constexpr, DURATION: tl.constexpr, PLUS_NEXT_BLANK: tl.constexpr,
    FASTEMIT: tl.constexpr, DELAY: tl.constexpr, MAY_END: tl.constexpr,
    # flags
    SIGMA: tl.constexpr, DELAY_ON: tl.constexpr, BOUNDARY: tl.constexpr,
    MAX_SEMIRING: tl.constexpr, NAN_ROWS: tl.constexpr, BLOCK_U: tl.constexpr,
    ONCHIP: tl.constexpr, DEPTH: tl.constexpr,
):
    """alpha (program ``(b, 0)``) or beta (program ``(b, 1)``) of sequence b for any
    topology, along anti-diagonals ``d = t + u`` of the node grid ``[t0, t1] x [u0, u1]``
    (math.md 9), in float64:

        alpha(t0,u0) = 0
        alpha(t,u)   = lse_k  alpha(t - DT[k], u - DU[k]) + w_k(t - DT[k], u - DU[k])
        beta(t1,u1)  = 0
        beta(t,u)    = lse_k  w_k(t,u) + beta(t + DT[k], u + DU[k])
        log P        = alpha(t1,u1)                              (= beta(t0,u0))

    over the kinds whose arc exists (source in the region, landing by ``_lands``), with
    ``w_k`` from ``_arc_weight``. Kind k steps ``DT[k] + DU[k] >= 1`` diagonals, up to
    the largest duration (TDT, multi-blank): a diagonal reads several earlier ones, all
    complete — the lanes of this program sweep the diagonals in order, BLOCK_U label
    positions at a time, with ``tl.debug_barrier()`` (a CTA barrier, which also orders
    global memory within the program) after each, so alpha/beta of every earlier diagonal
    are read back from the float64 workspace.

    The time of a diagonal is the latency of its dependent steps, so each is short: every
    kind's loads issue before any is used (unpredicated, ``_gather``: one memory latency
    per diagonal, not one per kind), and the log-sum-exp over the K incoming arcs is a max,
    K independent exps and one log (``_lse_kinds``), not K two-term log-add-exps in
    series; offsets inside a sequence are int32 (its base is int64). The state's planes
    are skewed (:func:`_skew`): the nodes of a diagonal, one per lane, are adjacent, so each
    kind's loads of lp and alpha/beta and the stores are contiguous across the lanes. Nodes
    of the end frame other than the end have beta -inf (no arc leaves them).

    NaN (math.md 8.1): a NaN weight on any arc makes log P NaN even when the arc lies on
    no complete path (alpha need not carry it to the end): the alpha program keeps a flag
    of the NaN weights it combines; with ``ONCHIP``, of the nodes of the region whose
    alpha is NaN, which is the same: every arc ends at a node of the region, whose alpha a
    NaN weight makes NaN (its term, then the log-sum-exp; the weights are finite, -inf or
    NaN, a +inf entry reading as NaN), and one test a node takes fewer of a diagonal's
    float64 instructions than one a kind (the workspace pass keeps the test a kind: with
    one a node, Triton 3.9 gave TDT's kernel a stack frame). It writes ``log P``
    (-inf without a path or frame) and the cost ``-log P`` in the costs' dtype, plus
    ``nan_rows[b]`` with ``NAN_ROWS`` (the device input check's float32 row: NaN for a bad
    sequence, else 0; ``log P`` stays as it is, the gradient reads it). ``MAX_SEMIRING``:
    max instead of log-sum-exp (the Viterbi score, ``log P`` the best path's), and the
    alpha program also writes ``best_kind (B, T+1, U+1)`` int8, the kind of the best arc
    into each node (the first kind on an exact tie; -1 where no finite path arrives; the
    start node and nodes off the region are not written), so that a backtrack only follows
    pointers. Launch with grid ``(B, 1)`` for alpha alone.

    ``ONCHIP`` (the grid's U + 1 within ``BLOCK_U``: lane = label position, one block a
    diagonal): the last ``DEPTH`` diagonals (the most a kind steps, ``dt + du``) stay in
    registers, those a lane over read by a gather across the lanes (``_shift``), and each
    diagonal's weights are loaded while the one before is combined; the same sums in the
    same order, so the same alpha and beta wherever log P is not NaN; the gather's
    barriers stand for the one after each diagonal, and alpha and beta are never read back
    from the workspace."""
    b = tl.program_id(0).to(tl.int64)
    t0, u0, t1, u1 = _ends(boundary_ptr, logit_lengths_ptr, target_lengths_ptr, b, b >= 0, T,
                           U1, BOUNDARY)
    t0, u0, t1, u1 = t0.to(tl.int32), u0.to(tl.int32), t1.to(tl.int32), u1.to(tl.int32)
    sigma = _f64(sigma_hi, sigma_mid, sigma_lo)
    delay_penalty = _f64(delay_hi, delay_mid, delay_lo)
    s_t, s_u, plane = _skew(T, U1)
    # This sequence's planes (int64 bases); every offset below is int32, inside one sequence.
    base = b * plane
    lp_b = ws_ptr + o_lp + b * K * plane
    nb_b = ws_ptr + o_nb + base
    offs = tl.arange(0, BLOCK_U)
    has_path = t1 > t0
    d0 = t0 + u0
    d1 = t1 + u1
    n_diag = tl.where(has_path, d1 - d0, 0)
    # The cell after log P's holds -inf (the layout reserves it): off the arcs every load
    # reads it (``_gather``). Each program writes it before its first barrier (the same
    # value from every program, so that none reads it before its own write).
    none = ws_ptr + o_ll + tl.num_programs(0)
    tl.store(none, NEG_INF)

    if tl.program_id(1) == 0:
        alpha_b = ws_ptr + o_alpha + base
        tl.store(alpha_b + t0 * s_t + u0 * s_u, tl.zeros([], tl.float64), mask=has_path)
        tl.debug_barrier()
        nan_arcs = tl.zeros([BLOCK_U], tl.int32)
        if ONCHIP:
            # One block of lanes holds a whole diagonal (lane = u): the last DEPTH
            # diagonals' alpha stay in registers (``hist[j]``: diagonal d - 1 - j; ``hist_s``
            # the same a lane over, for the kinds with du = 1); each diagonal's weights load
            # while the one before is combined, and nothing of the recursion goes through
            # global memory (alpha is stored for the gradient only). A kind that is no arc
            # into a node adds its -inf weight to a source that is -inf (off its diagonal's
            # nodes) or finite, or NaN from a NaN or +inf weight, which makes log P NaN
            # anyway: no select after the sum (the workspace's path gathers -inf there).
            u = offs
            hist, hist_s = _ring_start(u, u0, DEPTH, 1)
            ws = _diag_weights(d0 + 1, u, t0, u0, t1, u1, s_t, s_u, lp_b, nb_b, plane, sigma,
                               delay_penalty, none, K, DT, DU, PLUS_NEXT_BLANK, DELAY, MAY_END,
                               SIGMA, DELAY_ON, False)
            for i in range(0, n_diag):
                d = d0 + 1 + i
                ws_next = _diag_weights(
                    d + 1, u, t0, u0, t1, u1, s_t, s_u, lp_b, nb_b, plane, sigma,
                    delay_penalty, none, K, DT, DU, PLUS_NEXT_BLANK, DELAY, MAY_END, SIGMA,
                    DELAY_ON, False)
                xs = ()
                for k in tl.static_range(K):
                    tl.static_assert(DU[k] <= 1)
                    if DU[k] == 0:
                        a = hist[DT[k] - 1]
                    else:
                        a = hist_s[DT[k]]
                    xs = xs + (a + ws[k],)
                acc, best = _lse_kinds(xs, K, MAX_SEMIRING)
                t = d - u
                on = (u >= tl.maximum(d - t1, u0)) & (u <= tl.minimum(d - t0, u1))
                # the NaN flag a node: a NaN weight into a node makes its alpha NaN (docstring)
                nan_arcs = nan_arcs | ((acc != acc) & on).to(tl.int32)
                tl.store(alpha_b + t * s_t + u * s_u, acc, mask=on)
                if MAX_SEMIRING:
                    best = tl.where(acc > NEG_INF, best, -1)
                    tl.store(best_kind_ptr + b * (T + 1) * U1 + t * U1 + u, best.to(tl.int8),
                             mask=on)
                acc = tl.where(on, acc, NEG_INF)
                hist = _push(hist, acc, DEPTH)
                hist_s = _push(hist_s, _shift(acc, u, 1), DEPTH)
                ws = ws_next
            tl.debug_barrier()
        else:
            for i in range(0, n_diag):
                d = d0 + 1 + i
                u_lo = tl.maximum(d - t1, u0)
                u_hi = tl.minimum(d - t0, u1)
                for ub in range(u_lo, u_hi + 1, BLOCK_U):
                    u = ub + offs
                    t = d - u
                    on = u <= u_hi
                    at = t * s_t + u * s_u           # adjacent along the diagonal (_skew)
                    # Every kind's loads first, then the log-sum-exp (_lse_kinds).
                    xs = ()
                    for k in tl.static_range(K):
                        st = t - DT[k]
                        su = u - DU[k]
                        ok = (on & (st >= t0) & (st < t1) & (su >= u0)
                              & _lands(t, u, t1, u1, MAY_END[k]))
                        src = at - (DT[k] * s_t + DU[k] * s_u)      # the source (st, su)
                        w = _arc_weight(lp_b + k * plane, nb_b, src, s_u, st, t1, ok, sigma,
                                        delay_penalty, none, PLUS_NEXT_BLANK[k], DELAY[k], SIGMA,
                                        DELAY_ON, True)
                        nan_arcs = nan_arcs | (w != w).to(tl.int32)
                        xs = xs + (_gather(alpha_b, src, ok, none, True) + w,)
                    acc, best = _lse_kinds(xs, K, MAX_SEMIRING)
                    tl.store(alpha_b + at, acc, mask=on)
                    if MAX_SEMIRING:                 # best_kind (B, T+1, U+1): node order
                        best = tl.where(acc > NEG_INF, best, -1)
                        tl.store(best_kind_ptr + b * (T + 1) * U1 + t * U1 + u, best.to(tl.int8),
                                 mask=on)
                tl.debug_barrier()
        log_like = tl.load(alpha_b + t1 * s_t + u1 * s_u, mask=has_path, other=NEG_INF)
        log_like = tl.where(tl.max(nan_arcs, axis=0) > 0, POS_INF + NEG_INF, log_like)
        tl.store(ws_ptr + o_ll + b, log_like)
        cost = -log_like
        if NAN_ROWS:
            cost = cost + tl.load(nan_rows_ptr + b).to(tl.float64)
        tl.store(costs_ptr + b, cost.to(costs_ptr.dtype.element_ty))
    else:
        beta_b = ws_ptr + o_beta + base
        tl.store(beta_b + t1 * s_t + u1 * s_u, tl.zeros([], tl.float64), mask=has_path)
        tl.debug_barrier()
        if ONCHIP:
            # As alpha's, mirrored: hist[j] is beta of diagonal d + 1 + j, hist_s its lane
            # u + 1 at lane u.
            u = offs
            hist, hist_s = _ring_start(u, u1, DEPTH, -1)
            ws = _diag_weights(d1 - 1, u, t0, u0, t1, u1, s_t, s_u, lp_b, nb_b, plane, sigma,
                               delay_penalty, none, K, DT, DU, PLUS_NEXT_BLANK, DELAY, MAY_END,
                               SIGMA, DELAY_ON, True)
            for i in range(0, n_diag):
                d = d1 - 1 - i
                ws_next = _diag_weights(
                    d - 1, u, t0, u0, t1, u1, s_t, s_u, lp_b, nb_b, plane, sigma,
                    delay_penalty, none, K, DT, DU, PLUS_NEXT_BLANK, DELAY, MAY_END, SIGMA,
                    DELAY_ON, True)
                xs = ()
                for k in tl.static_range(K):
                    tl.static_assert(DU[k] <= 1)
                    if DU[k] == 0:
                        nb = hist[DT[k] - 1]
                    else:
                        nb = hist_s[DT[k]]
                    xs = xs + (ws[k] + nb,)
                acc, _ = _lse_kinds(xs, K, MAX_SEMIRING)
                t = d - u
                on = (u >= tl.maximum(d - t1, u0)) & (u <= tl.minimum(d - t0, u1))
                tl.store(beta_b + t * s_t + u * s_u, acc, mask=on)
                acc = tl.where(on, acc, NEG_INF)
                hist = _push(hist, acc, DEPTH)
                hist_s = _push(hist_s, _shift(acc, u, -1), DEPTH)
                ws = ws_next
        else:
            for i in range(0, n_diag):
                d = d1 - 1 - i
                u_lo = tl.maximum(d - t1, u0)
                u_hi = tl.minimum(d - t0, u1)
                for ub in range(u_lo, u_hi + 1, BLOCK_U):
                    u = ub + offs
                    t = d - u
                    on = u <= u_hi
                    at = t * s_t + u * s_u           # adjacent along the diagonal (_skew)
                    xs = ()
                    for k in tl.static_range(K):
                        lt = t + DT[k]
                        lu = u + DU[k]
                        ok = on & (t < t1) & _lands(lt, lu, t1, u1, MAY_END[k])
                        w = _arc_weight(lp_b + k * plane, nb_b, at, s_u, t, t1, ok, sigma,
                                        delay_penalty, none, PLUS_NEXT_BLANK[k], DELAY[k], SIGMA,
                                        DELAY_ON, True)
                        dst = at + (DT[k] * s_t + DU[k] * s_u)      # the landing (lt, lu)
                        xs = xs + (w + _gather(beta_b, dst, ok, none, True),)
                    acc, _ = _lse_kinds(xs, K, MAX_SEMIRING)
                    tl.store(beta_b + at, acc, mask=on)
                tl.debug_barrier()


@triton.jit
def _arc_occupation(a, ll, keep, lp_b, nb_b, beta_b, t, u, t1, u1, s_t, s_u, sigma,
                    delay_penalty, DT: tl.constexpr, DU: tl.constexpr,
                    PLUS_NEXT_BLANK: tl.constexpr,
                    DELAY: tl.constexpr, MAY_END: tl.constexpr, SIGMA: tl.constexpr,
                    DELAY_ON: tl.constexpr):
    """Occupation of kind k's arc leaving ``(t, u)`` (math.md 9), float64, given ``a =
    alpha(t, u)``, ``ll = log P`` and the sequences' parts ``lp_b`` (kind k's arc
    log-probs), ``nb_b`` (next_blank) and ``beta_b``, planes of strides ``s_t, s_u``
    (:func:`_skew`):

        gamma_k(t,u) = exp(alpha(t,u) + w_k(t,u) + beta(t + DT, u + DU) - log P)

    0 where not ``keep`` (off the region, no path) or where the arc does not exist; NaN on
    every arc of a NaN sequence (``ll`` NaN); at most 1 (the exponent is <= 0 but for
    rounding, which at ``|log P|`` beyond ~1e15 can be large; NaN kept). The one formula
    of the gradient's coefficients and the lattice tools' occupations."""
    ok = keep & _lands(t + DT, u + DU, t1, u1, MAY_END)
    w = _arc_weight(lp_b, nb_b, t * s_t + u * s_u, s_u, t, t1, ok, sigma, delay_penalty,
                    lp_b, PLUS_NEXT_BLANK, DELAY, SIGMA, DELAY_ON, False)
    nb = tl.load(beta_b + (t + DT) * s_t + (u + DU) * s_u, mask=ok, other=NEG_INF)
    z = a + w + nb - ll
    return tl.where(ok, tl.exp(tl.where(z > 0.0, 0.0, z)), 0.0)


@triton.jit
def _node_state(ws_ptr, logit_lengths_ptr, target_lengths_ptr, boundary_ptr, node, inside, T,
                U1, o_ll, o_alpha, BOUNDARY: tl.constexpr):
    """What every per-node pass after the lattice needs of nodes ``node``: ``(b, t, u, t1,
    u1, keep, ll, a)`` -- the node's sequence and coordinates, its end node, whether it
    lies on a sequence with a path (in the region, log P > -inf), log P (0 where not
    ``keep``) and alpha at the node; t and u int32."""
    b, t, u = _node_coords(node, T, U1)
    t0, u0, t1, u1 = _ends(boundary_ptr, logit_lengths_ptr, target_lengths_ptr, b, inside,
                           T, U1, BOUNDARY)
    log_like = tl.load(ws_ptr + o_ll + b, mask=inside, other=NEG_INF)
    keep = (inside & (t >= t0) & (t < t1) & (u >= u0) & (u <= u1)
            & (log_like != NEG_INF))
    ll = tl.where(keep, log_like, 0.0)
    s_t, s_u, plane = _skew(T, U1)
    a = tl.load(ws_ptr + o_alpha + b * plane + t * s_t + u * s_u, mask=keep, other=NEG_INF)
    return (b, t.to(tl.int32), u.to(tl.int32), t1.to(tl.int32), u1.to(tl.int32), keep, ll,
            log_like, a)


@triton.jit(do_not_specialize=_SHAPES + _WS)
def _gamma_kernel(
    # data ptrs
    ws_ptr, logit_lengths_ptr, target_lengths_ptr, boundary_ptr, gamma_ptr,
    # shapes; the workspace parts read
    n_nodes, T, U1, o_nb, o_lp, o_alpha, o_beta, o_ll,
    # options: sigma and delay_penalty, each a float64 in three float32 parts
    sigma_hi, sigma_mid, sigma_lo, delay_hi, delay_mid, delay_lo,
    # arc kinds
    K: tl.constexpr, DT: tl.constexpr, DU: tl.constexpr, READS: tl.constexpr,
    CLASS_ID: tl.constexpr, DURATION: tl.constexpr, PLUS_NEXT_BLANK: tl.constexpr,
    FASTEMIT: tl.constexpr, DELAY: tl.constexpr, MAY_END: tl.constexpr,
    # flags
    SIGMA: tl.constexpr, DELAY_ON: tl.constexpr, BOUNDARY: tl.constexpr, BLOCK: tl.constexpr,
):
    """Per-kind occupations ``gamma (B, K, T, U+1)`` float64 of ``BLOCK`` nodes (the lattice
    tools; ``reference.lattice``), from the row pass's arc log-probs and the lattice
    pass's alpha, beta and log P (``_arc_occupation``). Every entry is written: 0 off the
    arcs and for sequences without a path, NaN on the arcs of a NaN sequence."""
    node = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)    # [BLOCK], int64
    inside = node < n_nodes
    b, t, u, t1, u1, keep, ll, _, a = _node_state(ws_ptr, logit_lengths_ptr, target_lengths_ptr,
                                                  boundary_ptr, node, inside, T, U1, o_ll,
                                                  o_alpha, BOUNDARY)
    sigma = _f64(sigma_hi, sigma_mid, sigma_lo)
    delay_penalty = _f64(delay_hi, delay_mid, delay_lo)
    TU1 = T.to(tl.int64) * U1
    s_t, s_u, plane = _skew(T, U1)
    beta_b = ws_ptr + o_beta + b * plane
    for k in tl.static_range(K):
        gamma = _arc_occupation(a, ll, keep, ws_ptr + o_lp + (b * K + k) * plane,
                                ws_ptr + o_nb + b * plane, beta_b, t, u, t1, u1, s_t, s_u,
                                sigma, delay_penalty, DT[k], DU[k], PLUS_NEXT_BLANK[k],
                                DELAY[k], MAY_END[k], SIGMA, DELAY_ON)
        tl.store(gamma_ptr + node + (b * (K - 1) + k) * TU1, gamma, mask=inside)


# --------------------------------------------------------------------------- pass 3
# The gradient's per-node coefficients (``_reads_kernel``, after the lattice) and the
# pass over V that applies them (``_grad_kernel``): the float64 occupations are per node,
# the pass over V a lean stream of exps, so that its few registers leave many programs per
# multiprocessor to keep the memory busy (the occupations inside the pass over V once took
# 160-255 registers a thread).
#
# Columns of ``reads (NC, B T (U+1))`` float64 (``gpu._kinds``: ``NC``, ``CLS_COL``,
# ``DUR_COL``): 0 the token group's S (every read of the row, FastEmit-scaled), 1 the
# blank's reads, 2 the label's; then for each kind with a fixed class its scaled read
# (``CLS_COL[k]``), TDT's duration group's S_dur (column ``3 + N_CLS``) and for each kind
# with a duration its (unscaled) read of it (``DUR_COL[k]``).


@triton.jit(do_not_specialize=_SHAPES + _WS)
def _reads_kernel(
    # data ptrs
    ws_ptr, logit_lengths_ptr, target_lengths_ptr, boundary_ptr,
    # shapes; the workspace parts read and written (reads)
    n_nodes, T, U1, o_nb, o_lp, o_alpha, o_beta, o_ll, o_reads,
    # options, each a float64 in three float32 parts: s = 1 + fastemit_lambda, sigma,
    # delay_penalty
    scale_hi, scale_mid, scale_lo, sigma_hi, sigma_mid, sigma_lo, delay_hi, delay_mid, delay_lo,
    # arc kinds
    K: tl.constexpr, DT: tl.constexpr, DU: tl.constexpr, READS: tl.constexpr,
    CLASS_ID: tl.constexpr, DURATION: tl.constexpr, PLUS_NEXT_BLANK: tl.constexpr,
    FASTEMIT: tl.constexpr, DELAY: tl.constexpr, MAY_END: tl.constexpr,
    N_DURATIONS: tl.constexpr, N_CLS: tl.constexpr, CLS_COL: tl.constexpr,
    DUR_COL: tl.constexpr,
    # flags
    SIGMA: tl.constexpr, DELAY_ON: tl.constexpr, BOUNDARY: tl.constexpr, BLOCK: tl.constexpr,
):
    """The coefficients of the gradient of ``BLOCK`` nodes' rows (columns above): the
    occupations of the arcs that read the node's row,

        gamma_k(t,u) = exp(alpha(t,u) + w_k(t,u) + beta(t + DT[k], u + DU[k]) - log P)

    for each kind leaving (t,u), and for a ``plus_next_blank`` kind also the arc leaving
    (t,u-1), which reads this row's blank; each class read scaled by ``s_k`` (``1 +
    fastemit_lambda`` on the class read of a FastEmit kind, 1 otherwise), the duration
    reads not (NeMo TDT). Every column of every node is written: 0 off the arcs and for
    sequences without a path, NaN on the arcs of a NaN sequence."""
    node = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)    # [BLOCK], int64
    inside = node < n_nodes
    b, t, u, t1, u1, keep, ll, _, a = _node_state(ws_ptr, logit_lengths_ptr, target_lengths_ptr,
                                                  boundary_ptr, node, inside, T, U1, o_ll,
                                                  o_alpha, BOUNDARY)
    _, u0, _, _ = _ends(boundary_ptr, logit_lengths_ptr, target_lengths_ptr, b, inside, T, U1,
                        BOUNDARY)
    sigma = _f64(sigma_hi, sigma_mid, sigma_lo)
    delay_penalty = _f64(delay_hi, delay_mid, delay_lo)
    scale = _f64(scale_hi, scale_mid, scale_lo)
    s_t, s_u, plane = _skew(T, U1)
    alpha_b = ws_ptr + o_alpha + b * plane
    beta_b = ws_ptr + o_beta + b * plane
    nb_b = ws_ptr + o_nb + b * plane
    reads = ws_ptr + o_reads + node
    s_tok = tl.zeros([BLOCK], tl.float64)      # S of the token group
    gb = tl.zeros([BLOCK], tl.float64)         # reads of the blank
    gl = tl.zeros([BLOCK], tl.float64)         # reads of y[u]
    s_dur = tl.zeros([BLOCK], tl.float64)      # S of the duration group
    for k in tl.static_range(K):
        lp_b = ws_ptr + o_lp + (b * K + k) * plane
        gamma = _arc_occupation(a, ll, keep, lp_b, nb_b, beta_b, t, u, t1, u1, s_t, s_u, sigma,
                                delay_penalty, DT[k], DU[k], PLUS_NEXT_BLANK[k], DELAY[k],
                                MAY_END[k], SIGMA, DELAY_ON)
        if FASTEMIT[k]:
            sg = gamma * scale                 # FastEmit: this kind's class read x s
        else:
            sg = gamma
        s_tok += sg
        if READS[k] == 0:
            gb += sg
        elif READS[k] == 1:
            gl += sg
        else:
            tl.store(reads + CLS_COL[k] * n_nodes, sg, mask=inside)
        if DURATION[k] >= 0:                   # the duration read: never scaled
            s_dur += gamma
            tl.store(reads + DUR_COL[k] * n_nodes, gamma, mask=inside)
        if PLUS_NEXT_BLANK[k]:
            # Kind k's arc from (t, u-1) lands on (t + DT[k], u) and reads this row's blank.
            okp = keep & (u - 1 >= u0) & _lands(t + DT[k], u, t1, u1, MAY_END[k])
            src = t * s_t + (u - 1) * s_u
            ap = tl.load(alpha_b + src, mask=okp, other=NEG_INF)
            wp = _arc_weight(lp_b, nb_b, src, s_u, t, t1, okp, sigma, delay_penalty, lp_b,
                             PLUS_NEXT_BLANK[k], DELAY[k], SIGMA, DELAY_ON, False)
            nbp = tl.load(beta_b + (t + DT[k]) * s_t + u * s_u, mask=okp, other=NEG_INF)
            zp = ap + wp + nbp - ll                  # (<= 0 but for rounding: occ <= 1)
            gp = tl.where(okp, tl.exp(tl.where(zp > 0.0, 0.0, zp)), 0.0)
            s_tok += gp
            gb += gp
    tl.store(reads, s_tok, mask=inside)
    tl.store(reads + n_nodes, gb, mask=inside)
    tl.store(reads + 2 * n_nodes, gl, mask=inside)
    if N_DURATIONS > 0:
        tl.store(reads + (3 + N_CLS) * n_nodes, s_dur, mask=inside)


@triton.jit
def _grad_terms(ws_ptr, logit_lengths_ptr, target_lengths_ptr, boundary_ptr, upstream_ptr,
                node, inside, n_nodes, T, U1, upstream_stride, o_ll, o_reads,
                BOUNDARY: tl.constexpr, ACC: tl.constexpr, COSTS32: tl.constexpr):
    """What the gradient of the rows of nodes ``node`` needs of the lattice (the gradient
    passes: ``_grad_kernel`` and the joiner's, ``gpu.joint``): ``(keep, nan_row, write,
    w_up, reads, mass, no_mass, gb_a, gl_a)`` -- the rows of sequences with a path inside
    the region (and, ``COSTS32``, a cost finite in float32, the costs' dtype: an infinite
    cost has a zero gradient, math.md 8.1), those of NaN sequences, those written (``keep``
    and a nonzero upstream ``w_up``, ACC), the node's coefficient columns (a pointer), the
    token group's S (``mass``, ACC; ``no_mass`` where it is 0), the blank's and the label's
    reads (ACC)."""
    b, t, u = _node_coords(node, T, U1)
    t0, u0, t1, u1 = _ends(boundary_ptr, logit_lengths_ptr, target_lengths_ptr, b, inside,
                           T, U1, BOUNDARY)
    region = inside & (t >= t0) & (t < t1) & (u >= u0) & (u <= u1)
    log_like = tl.load(ws_ptr + o_ll + b, mask=inside, other=NEG_INF)
    w_up = tl.load(upstream_ptr + b * upstream_stride, mask=inside, other=0.0).to(ACC)
    keep = region & (log_like != NEG_INF)
    if COSTS32:                                # the cost as the caller sees it is +inf
        keep = keep & ((-log_like).to(tl.float32) != POS_INF)
    nan_row = region & (log_like != log_like)  # fused: a NaN sequence's rows are all NaN
    write = keep & (w_up != 0.0)
    reads = ws_ptr + o_reads + node
    s_tok = tl.load(reads, mask=keep, other=0.0)
    mass = s_tok.to(ACC)
    no_mass = s_tok == 0.0
    gb_a = tl.load(reads + n_nodes, mask=keep, other=0.0).to(ACC)
    gl_a = tl.load(reads + 2 * n_nodes, mask=keep, other=0.0).to(ACC)
    return keep, nan_row, write, w_up, reads, mass, no_mass, gb_a, gl_a


@triton.jit
def _grad_rows(ws_ptr, targets_ptr, logit_lengths_ptr, target_lengths_ptr, boundary_ptr,
               node, inside, keep, mass, T, U1, o_lse, BOUNDARY: tl.constexpr,
               ACC: tl.constexpr):
    """The rest of :func:`_grad_terms`: ``(y, live, lse_hi, lse_lo)`` -- the label of the
    nodes (-1: none), the rows whose entries are read (with mass) and ``lse`` as an ACC
    pair. (Apart from it, after the caller's row offsets: one call took 96 registers a
    thread in the TDT gradient pass, these two take 72.)"""
    b, t, u = _node_coords(node, T, U1)
    _, _, _, u1 = _ends(boundary_ptr, logit_lengths_ptr, target_lengths_ptr, b, inside, T, U1,
                        BOUNDARY)
    y = tl.load(targets_ptr + b * (U1 - 1) + u, mask=keep & (u < u1), other=-1)
    y = tl.where(keep & (u < u1), y, -1)
    lse = tl.load(ws_ptr + o_lse + node, mask=keep, other=NEG_INF)
    live = keep & (lse != NEG_INF) & (mass != 0.0)    # rows without mass are not read
    lse_hi, lse_lo = _split(tl.where(live, lse, 0.0), ACC)
    return y, live, lse_hi, lse_lo


@triton.jit
def _token_grad(x, v, lse_hi, lse_lo, mass, no_mass, gb_a, gl_a, blank, y, FUSED: tl.constexpr,
                ENTRIES: tl.constexpr = False):
    """The token group's gradient at the entries ``x [ROWS, BLOCK]`` of classes ``v``
    (``[1, BLOCK]``, or ``[ROWS, BLOCK]`` where each row's entries are other classes; ACC;
    -inf where a row is not read), before NaN, clamp and the upstream factor: ``p(v) S``
    (0 for a row without mass: ``p`` may be NaN there; log-prob mode: none) minus the
    blank's and the label's reads ``gb_a``, ``gl_a`` at their classes; with ``ENTRIES``
    (fused mode) ``gb_a`` and ``gl_a`` are those two classes' entries themselves
    (:func:`_entries`), put in their place."""
    if FUSED:
        g = tl.exp((x - lse_hi[:, None]) - lse_lo[:, None]) * mass[:, None]
        g = tl.where(no_mass[:, None], 0.0, g)
    else:
        g = tl.zeros_like(x)
    if ENTRIES:
        return tl.where(v == blank, gb_a[:, None], tl.where(v == y[:, None], gl_a[:, None], g))
    return (g - tl.where(v == blank, gb_a[:, None], 0.0)
            - tl.where(v == y[:, None], gl_a[:, None], 0.0))


@triton.jit
def _read_entries(logits_ptr, ws_ptr, row, node, reads, keep, live, y, blank, n_nodes, o_lse,
                  ACC: tl.constexpr):
    """The blank's and the label's gradient entries of the rows (fused mode) from the two
    entries of the row in the logits: :func:`_entries`."""
    x_b = tl.load(logits_ptr + row + blank, mask=live, other=NEG_INF).to(tl.float64)
    x_y = tl.load(logits_ptr + row + tl.maximum(y, 0), mask=live & (y >= 0),
                  other=NEG_INF).to(tl.float64)
    return _entries(x_b, x_y, ws_ptr, node, reads, keep, live, y, blank, n_nodes, o_lse, ACC)


@triton.jit
def _entries(x_b, x_y, ws_ptr, node, reads, keep, live, y, blank, n_nodes, o_lse,
             ACC: tl.constexpr):
    """The blank's and the label's gradient entries of the rows (fused mode), formed in
    float64 from the workspace's float64 ``lse``, ``S`` and reads and the rows' entries
    ``x_b``, ``x_y`` (float64; -inf where not ``live``):

        e_blank = p(blank) S - gamma_b - [y = blank] gamma_l
        e_label = p(y) S - gamma_l - [y = blank] gamma_b,      p(c) = exp(x_c - lse)

    (``p S`` taken as 0 on a row not ``live``). Near ``p = 1`` (a confident row: the max
    class, which an arc reads) ``p S - gamma`` cancels: formed in ACC it kept only the
    rounding of ``p`` and ``S`` (a blank 20 nats ahead gave a zero gradient). ACC out."""
    lse = tl.load(ws_ptr + o_lse + node, mask=live, other=0.0)
    s_tok = tl.load(reads, mask=keep, other=0.0)
    gb = tl.load(reads + n_nodes, mask=keep, other=0.0)
    gl = tl.load(reads + 2 * n_nodes, mask=keep, other=0.0)
    both = y == blank
    e_b = tl.where(live, tl.exp(x_b - lse) * s_tok, 0.0) - gb - tl.where(both, gl, 0.0)
    e_l = tl.where(live, tl.exp(x_y - lse) * s_tok, 0.0) - gl - tl.where(both, gb, 0.0)
    return e_b.to(ACC), e_l.to(ACC)


@triton.jit
def _token_grad_store(x, v, out, dst, lse_hi, lse_lo, mass, no_mass, gb_a, gl_a, blank, y,
                      nan_row, clamp, write, w_up, K: tl.constexpr, READS: tl.constexpr,
                      CLASS_ID: tl.constexpr, FUSED: tl.constexpr, CLAMP: tl.constexpr):
    """Step 2 of ``_grad_kernel`` on a block: the token group's gradient at the entries
    ``x`` of classes ``v`` (:func:`_token_grad`, :func:`_grad_out`; fused: ``gb_a`` and
    ``gl_a`` the blank's and the label's entries) stored at ``dst`` where ``out``, except
    the fixed classes' columns (step 1 writes them)."""
    g = _token_grad(x, v, lse_hi, lse_lo, mass, no_mass, gb_a, gl_a, blank, y, FUSED, FUSED)
    g = _grad_out(g, nan_row[:, None], clamp, write[:, None], w_up[:, None], FUSED, CLAMP)
    for k in tl.static_range(K):
        if READS[k] == 2:
            out = out & (v != CLASS_ID[k])
    tl.store(dst, g.to(dst.dtype.element_ty), mask=out)


@triton.jit
def _fixed_reads(c, reads, keep, n_nodes, K: tl.constexpr, READS: tl.constexpr,
                 CLASS_ID: tl.constexpr, CLS_COL: tl.constexpr, ACC: tl.constexpr):
    """The reads of the fixed class ``c`` by the kinds that read it (their scaled
    occupations, coefficient columns ``CLS_COL``) at the nodes, ACC; the blank's and the
    label's reads, where they are that class, are the caller's."""
    cls_reads = tl.zeros(keep.shape, ACC)
    for j in tl.static_range(K):
        if READS[j] == 2:
            if CLASS_ID[j] == c:
                cls_reads += tl.load(reads + CLS_COL[j] * n_nodes, mask=keep,
                                     other=0.0).to(ACC)
    return cls_reads


@triton.jit
def _class_reads(c, gb, gl, y, blank, reads, keep, n_nodes, K: tl.constexpr,
                 READS: tl.constexpr, CLASS_ID: tl.constexpr, CLS_COL: tl.constexpr,
                 DT: tl.constexpr):
    """Every read of the fixed class ``c`` at the nodes, in ``DT``: the kinds that read it
    (:func:`_fixed_reads`), and the blank's and the label's reads ``gb``, ``gl`` (``DT``)
    where the blank or the node's label ``y`` is that class. (Log-prob mode: minus the
    class's gradient entry.)"""
    return (_fixed_reads(c, reads, keep, n_nodes, K, READS, CLASS_ID, CLS_COL, DT)
            + tl.where(blank == c, gb, 0.0) + tl.where(y == c, gl, 0.0))


@triton.jit
def _class_entry(logits_ptr, ws_ptr, row, node, reads, keep, live, y, blank, cls, n_nodes,
                 o_lse, K: tl.constexpr, READS: tl.constexpr, CLASS_ID: tl.constexpr,
                 CLS_COL: tl.constexpr):
    """The gradient entry of the fixed class ``cls`` and its ``p`` (:func:`_class_entry_of`)
    from the row's entry in the logits."""
    x = tl.load(logits_ptr + row + cls, mask=live, other=NEG_INF).to(tl.float64)
    return _class_entry_of(x, ws_ptr, node, reads, keep, live, y, blank, cls, n_nodes, o_lse,
                           K, READS, CLASS_ID, CLS_COL)


@triton.jit
def _class_entry_of(x, ws_ptr, node, reads, keep, live, y, blank, cls, n_nodes, o_lse,
                    K: tl.constexpr, READS: tl.constexpr, CLASS_ID: tl.constexpr,
                    CLS_COL: tl.constexpr):
    """The gradient entry of the fixed class ``cls`` (fused mode, step 1 of
    ``_grad_kernel``; the joiner's gradient pass) and its ``p``, both float64 [ROWS], from
    the rows' entries ``x`` of that class (float64; -inf where not ``live``):

        e_c = p(c) S - sum_{kinds reading c} s_k gamma_k - [blank = c] gamma_b - [y = c] gamma_l

    (``p S`` taken as 0 on a row not ``live``). Formed in float64 from the workspace's
    ``lse``, ``S`` and reads, as :func:`_entries` forms the blank's and the label's: a
    big blank that a confident model's path takes has ``p`` near 1, where ``p S - gamma``
    cancels (math.md 4.1)."""
    lse = tl.load(ws_ptr + o_lse + node, mask=live, other=0.0)
    s_tok = tl.load(reads, mask=keep, other=0.0)
    p = tl.exp(x - lse)
    gb = tl.load(reads + n_nodes, mask=keep, other=0.0)
    gl = tl.load(reads + 2 * n_nodes, mask=keep, other=0.0)
    e = (tl.where(live, p * s_tok, 0.0)
         - _class_reads(cls, gb, gl, y, blank, reads, keep, n_nodes, K, READS, CLASS_ID,
                        CLS_COL, tl.float64))
    return e, p


@triton.jit
def _unfixed_p(x, c, lse_hi, lse_lo, K: tl.constexpr, READS: tl.constexpr,
               CLASS_ID: tl.constexpr):
    """``p(v) = exp(x_v - lse)`` of the entries ``x [ROWS, n]`` of classes ``c`` (ACC;
    -inf where not read: 0), 0 at the fixed classes' columns (step 1 of ``_grad_kernel``
    counts them: in place, step 2 reads gradients there)."""
    p = tl.exp((x - lse_hi[:, None]) - lse_lo[:, None])
    for k in tl.static_range(K):
        if READS[k] == 2:
            p = tl.where(c == CLASS_ID[k], 0.0, p)
    return p


@triton.jit
def _grad_out(g, nan_row, clamp, write, w_up, FUSED: tl.constexpr, CLAMP: tl.constexpr):
    """A token group's gradient as written: NaN on the rows of a NaN sequence (fused
    mode), clamped to ``[-clamp, clamp]`` (both bounds; NaN stays NaN), times the upstream
    gradient on the rows ``write``, exactly 0 elsewhere (a select, not a product). The
    masks are shaped to broadcast against ``g``."""
    if FUSED:
        g = tl.where(nan_row, POS_INF + NEG_INF, g)
    if CLAMP:
        g = tl.minimum(tl.maximum(g, -clamp, propagate_nan=tl.PropagateNan.ALL), clamp,
                       propagate_nan=tl.PropagateNan.ALL)
    return tl.where(write, g * w_up, 0.0)


@triton.jit
def _duration_terms(ws_ptr, node, reads, keep, n_nodes, o_dur, K: tl.constexpr,
                    DURATION: tl.constexpr, N_CLS: tl.constexpr, DUR_COL: tl.constexpr,
                    ACC: tl.constexpr, BLOCK_DUR: tl.constexpr, FUSED: tl.constexpr):
    """TDT's duration group at the nodes: ``(g_dur [ROWS, BLOCK_DUR], s_dur, live_d, d_hi,
    d_lo)`` -- each duration's reads (the occupations of the kinds of that duration, never
    FastEmit-scaled), their sum S_dur (float64), the rows whose duration entries are read
    and ``lse_dur`` as a pair ``d_hi + d_lo``; ``g_dur`` and the pair in ACC (float64: the
    pair is ``lse_dur`` and 0, and :func:`_duration_grad` forms the entries in float64)."""
    didx = tl.arange(0, BLOCK_DUR)
    g_dur = tl.zeros([node.shape[0], BLOCK_DUR], ACC)
    for k in tl.static_range(K):
        if DURATION[k] >= 0:
            gk = tl.load(reads + DUR_COL[k] * n_nodes, mask=keep, other=0.0).to(ACC)
            g_dur += tl.where(didx[None, :] == DURATION[k], gk[:, None], 0.0)
    s_dur = tl.load(reads + (3 + N_CLS) * n_nodes, mask=keep, other=0.0)
    if FUSED:
        lse_d = tl.load(ws_ptr + o_dur + node, mask=keep, other=NEG_INF)
    else:
        lse_d = tl.zeros_like(s_dur)
    live_d = keep & (lse_d != NEG_INF) & (s_dur != 0.0)
    d_hi, d_lo = _split(tl.where(live_d, lse_d, 0.0), ACC)
    return g_dur, s_dur, live_d, d_hi, d_lo


@triton.jit
def _duration_grad(x, d_hi, d_lo, s_dur, g_dur, nan_row, write, w_up, FUSED: tl.constexpr):
    """The duration group's gradient at its entries ``x [ROWS, BLOCK_DUR]`` (ACC, or float64
    with ``d_hi``, ``g_dur`` of :func:`_duration_terms` in float64; -inf where not read):
    ``q(i) S_dur - sum_{kinds of duration i} gamma_k``, NaN on a NaN sequence's rows
    (fused), times the upstream gradient on the rows ``write`` (no clamp: NeMo TDT)."""
    if FUSED:
        g = tl.exp((x - d_hi[:, None]) - d_lo[:, None]) * s_dur.to(x.dtype)[:, None]
        g = tl.where((s_dur == 0.0)[:, None], 0.0, g)
    else:
        g = tl.zeros_like(x)
    g = g - g_dur
    if FUSED:
        g = tl.where(nan_row[:, None], POS_INF + NEG_INF, g)
    return tl.where(write[:, None], g * w_up[:, None], 0.0)


@triton.jit
def _duration_step(logits_ptr, grad_ptr, ws_ptr, row, node, reads, keep, has_row, nan_row,
                   write, w_up, total, V_tok, n_nodes, o_dur, K: tl.constexpr,
                   DURATION: tl.constexpr, N_DURATIONS: tl.constexpr, N_CLS: tl.constexpr,
                   DUR_COL: tl.constexpr, ACC: tl.constexpr, BLOCK_DUR: tl.constexpr,
                   FUSED: tl.constexpr, CHECK: tl.constexpr):
    """TDT's duration group of the rows ``row`` in ``_grad_kernel``: ``grad(i) = q(i) S_dur -
    sum_{kinds of duration i} gamma_k`` (:func:`_duration_terms`, :func:`_duration_grad`),
    read and written at classes ``V_tok ..``, which the token group's steps neither read
    nor write (so that in place it may run before or after them); returns ``total`` with
    the group's deviation term (``CHECK``)."""
    # The entries in float64: a confident model's duration has ``q`` near 1, where ``q S_dur
    # - gamma`` cancels (math.md 4.1); ACC kept only the rounding of ``q``.
    didx = tl.arange(0, BLOCK_DUR)
    g_dur, s_dur, live_d, d_hi, d_lo = _duration_terms(
        ws_ptr, node, reads, keep, n_nodes, o_dur, K, DURATION, N_CLS, DUR_COL, tl.float64,
        BLOCK_DUR, FUSED)
    if FUSED:
        x_dur = tl.load(logits_ptr + row[:, None] + V_tok + didx[None, :],
                        mask=live_d[:, None] & (didx[None, :] < N_DURATIONS),
                        other=NEG_INF).to(tl.float64)
    else:
        x_dur = tl.zeros([row.shape[0], BLOCK_DUR], tl.float64)
    if CHECK > 0:
        # (in ACC: summed from the float64 q, the tile pass took 135 registers a thread on
        # sm_90 against 128; Triton 3.9)
        c_hi, c_lo = _split(d_hi, ACC)
        q = tl.exp((x_dur.to(ACC) - c_hi[:, None]) - c_lo[:, None])
        total += tl.sum(q, axis=1) - tl.where(live_d, 1.0, 0.0)
    # (float64 -> ACC -> the logits' dtype: the interpreter casts float64 to bfloat16 wrong)
    g_d = _duration_grad(x_dur, d_hi, d_lo, s_dur, g_dur, nan_row, write, w_up, FUSED).to(ACC)
    tl.store(grad_ptr + row[:, None] + V_tok + didx[None, :], g_d.to(grad_ptr.dtype.element_ty),
             mask=has_row[:, None] & (didx[None, :] < N_DURATIONS))
    return total


@triton.jit(do_not_specialize=_SHAPES + _WS + ("upstream_stride", "box_t0", "box_u0", "box_T",
                                               "box_U1"))
def _grad_kernel(
    # data ptrs
    logits_ptr, grad_ptr, row_nodes_ptr, targets_ptr, logit_lengths_ptr, target_lengths_ptr,
    boundary_ptr, ws_ptr, upstream_ptr, check_ptr,
    # shapes and strides: the rows, the grid, the box (LAYOUT 2); the workspace parts read
    n_rows, n_nodes, T, U1, V_tok, blank, upstream_stride, box_t0, box_u0, box_T, box_U1,
    o_lse, o_dur, o_ll, o_reads,
    # options: clamp, a float64 in three float32 parts
    clamp_hi, clamp_mid, clamp_lo,
    # arc kinds
    K: tl.constexpr, READS: tl.constexpr, CLASS_ID: tl.constexpr,
    DURATION: tl.constexpr, N_DURATIONS: tl.constexpr, N_CLS: tl.constexpr,
    CLS_COL: tl.constexpr, DUR_COL: tl.constexpr, CLS_FIRST: tl.constexpr,
    # flags
    FUSED: tl.constexpr, CLAMP: tl.constexpr, BOUNDARY: tl.constexpr, LAYOUT: tl.constexpr,
    ACC: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_DUR: tl.constexpr,
    V_ALIGN: tl.constexpr, COSTS32: tl.constexpr, SPAN: tl.constexpr = 0,
    CHECK: tl.constexpr = 0.0, DUR_LAST: tl.constexpr = False,
):
    """Gradient rows ``upstream[b] * clip(d loss_b / d logits(t,u,:))`` of ``ROWS`` rows,
    each that of the node ``_row_node`` maps it to (a row no node reads gets 0), for any
    topology (math.md 9, ``reference.grad``), written once; ``grad_ptr`` may equal
    ``logits_ptr`` (every entry is read before it is overwritten, by the same program, and
    a program reads and writes only its own rows).
    With the coefficients of ``_reads_kernel`` (S_g the sum of a softmax group's reads,
    tokens or TDT durations):

        fused:    grad(v) = p_g(v) S_g - sum_{reads of class v} s_k gamma_k,  p_g(v) = exp(x_v - lse_g)
        log-prob: grad(v) =          - sum_{reads of class v} s_k gamma_k

    since d(x_c - lse_g)/dx_v = [v = c] - p_g(v). A row that no arc reads (``S_g = 0``)
    gets 0 (not ``0 * p``: p may be NaN there). In two steps:

    1. the fixed classes' columns and TDT's duration group (read, then written: in place,
       step 2 reads the fixed classes' entries as gradients and stores none of them; with
       ``DUR_LAST``, ``gpu.GRAD_DURATIONS_LAST``, the duration group comes after step 2's
       loop instead, whose reads and writes never reach it);
    2. the token group in chunks of ``BLOCK_V``: ``p S`` minus the blank's and the label's
       reads, every entry but the fixed classes' columns (``SPAN`` > 0, rows that start
       anywhere: the row's whole 16-byte groups with vector loads and stores, its first
       and last few entries an entry a load).

    Clamp clips the token group only. A NaN sequence (log P NaN) gets NaN on every entry of
    its rows in fused mode, on its arc entries in log-prob mode; padding, rows of
    impossible sequences, sequences whose cost is infinite in the costs' dtype (``COSTS32``:
    float32 costs, where a float64 cost beyond 3.4e38 is +inf: math.md 8.1) and sequences
    whose upstream gradient is exactly 0 get exactly 0 (a select, not a product).

    ``CHECK`` > 0 (fused mode; the fused losses' recomputed tiles, ``gpu.tile_backward``):
    the rows are checked to be the forward's, at no extra read. Each softmax group a row's
    gradient reads sums to one under the forward's normaliser, ``sum_v exp(x_v - lse_g) =
    exp(lse_g(x) - lse_g)``, exactly when the recomputed row has the forward's log-sum-exp;
    a row whose deviation ``(sum_g sum_v p_g(v) - n_g) / (1 + |lse|)``, over the ``n_g``
    groups read (the tokens, and TDT's durations), is not within ``CHECK`` (NaN included)
    sets ``check_ptr[0]`` (float32) to 1. A row read by none or of a NaN sequence (its
    gradient is NaN whatever the row holds) passes. The fixed classes' entries
    count in step 1, before step 2 could have written over them; the loop over V keeps a
    sum per entry of its chunk, reduced across the row once (sm_90, Triton 3.6, a tile's
    float32 rows: the regular loss's take 71 registers a thread against 48 without,
    multi-blank's 80 against 72; a sum per thread's vector load took more). Float64 rows
    reduce every chunk instead, where a sum per entry took more registers and a stack
    (multi-blank's pass: 150 registers against 112 without the check)."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)       # [ROWS], int64
    has_row = r < n_rows
    node, inside = _row_node(r, has_row, row_nodes_ptr, T, U1, box_t0, box_u0, box_T,
                             box_U1, LAYOUT)
    keep, nan_row, write, w_up, reads, mass, no_mass, gb_a, gl_a = _grad_terms(
        ws_ptr, logit_lengths_ptr, target_lengths_ptr, boundary_ptr, upstream_ptr, node,
        inside, n_nodes, T, U1, upstream_stride, o_ll, o_reads, BOUNDARY, ACC, COSTS32)
    row = tl.multiple_of(r * (V_tok + N_DURATIONS), V_ALIGN)
    offs = tl.arange(0, BLOCK_V)
    clamp = _f64(clamp_hi, clamp_mid, clamp_lo).to(ACC)
    y, live, lse_hi, lse_lo = _grad_rows(ws_ptr, targets_ptr, logit_lengths_ptr,
                                         target_lengths_ptr, boundary_ptr, node, inside, keep,
                                         mass, T, U1, o_lse, BOUNDARY, ACC)
    if FUSED:
        # Step 2's blank and label entries, formed in float64 (``_read_entries``). Their
        # logits are read here by other threads than step 2's, which overwrite them in
        # place: the barrier orders every read before any write.
        rb, rl = _read_entries(logits_ptr, ws_ptr, row, node, reads, keep, live, y, blank,
                               n_nodes, o_lse, ACC)
        tl.debug_barrier()
    else:
        rb, rl = gb_a, gl_a
    # 1. The fixed classes' columns: p S minus every read of that class (the kinds that
    # read it, and the blank or the label where they are that class); then TDT's duration
    # group. First: nothing of them stays live through step 2's loop (multi-blank's pass
    # took 80 registers a thread on sm_90 with them after it, 72 now; Triton 3.6). TDT's
    # duration group is the other way round: before the loop, its [ROWS, BLOCK_DUR]
    # layout's copies of the rows' values stay live through the loop for the span's edges
    # after it (96 registers a thread on 8 rows of 128; 68 with DUR_LAST; Triton 3.6).
    total = tl.zeros([ROWS], ACC)                  # CHECK: the softmax groups' sums of p
    for k in tl.static_range(K):
        if READS[k] == 2:
            cls = CLASS_ID[k]
            if FUSED:
                # formed in float64 (``_class_entry``), as step 2's blank and label entries
                e64, pk = _class_entry(logits_ptr, ws_ptr, row, node, reads, keep, live, y,
                                       blank, cls, n_nodes, o_lse, K, READS, CLASS_ID, CLS_COL)
                gk = e64.to(ACC)
                if CHECK > 0:
                    if CLS_FIRST[k]:                           # each class's entry once
                        total += tl.where(live, pk, 0.0).to(ACC)
            else:
                gk = -_class_reads(cls, gb_a, gl_a, y, blank, reads, keep, n_nodes, K, READS,
                                   CLASS_ID, CLS_COL, ACC)
            gk = _grad_out(gk, nan_row, clamp, write, w_up, FUSED, CLAMP)
            # (a vector compare: the interpreter refuses a vector & scalar mask)
            tl.store(grad_ptr + row + cls, gk.to(grad_ptr.dtype.element_ty),
                     mask=has_row & (r * 0 + V_tok > cls))
    if N_DURATIONS > 0 and not DUR_LAST:
        # TDT's duration group (``_duration_step``), here or after the token group's loop
        total = _duration_step(logits_ptr, grad_ptr, ws_ptr, row, node, reads, keep, has_row,
                               nan_row, write, w_up, total, V_tok, n_nodes, o_dur, K, DURATION,
                               N_DURATIONS, N_CLS, DUR_COL, ACC, BLOCK_DUR, FUSED, CHECK)

    # 2. The token group, every entry but the fixed classes' columns (step 1 wrote them: in
    # place, their entries read here are gradients already, and never stored). In chunks
    # of BLOCK_V from the row's first 16-byte boundary ``at`` (class ``a``): with SPAN = 0,
    # ``V_ALIGN`` divides V_tok and the row starts there (a = 0); with SPAN > 0 (rows that
    # start anywhere) the first ``a < SPAN`` classes and the last ``< SPAN`` are an edge of
    # their own (below), so that the loop's masks change at multiples of SPAN too: vector
    # loads and stores either way, and no entry outside the row is read or written.
    if SPAN > 0:
        a = ((SPAN - row % SPAN) % SPAN).to(tl.int32)          # classes before the boundary
        at = tl.multiple_of(row + a, SPAN)                     # 16-byte aligned
        n_w = tl.maximum(tl.where(has_row, V_tok, 0) - a, 0)
        n_w = tl.multiple_of(n_w - n_w % SPAN, SPAN)           # whole SPAN-groups
        n_r = tl.multiple_of(tl.where(live, n_w, 0), SPAN)
    else:
        a = tl.zeros([ROWS], tl.int32)
        at = row
        n_r = tl.multiple_of(tl.where(live, V_tok, 0), V_ALIGN)
        n_w = tl.multiple_of(tl.where(has_row, V_tok, 0), V_ALIGN)
    if CHECK > 0:
        sums = tl.zeros([ROWS, BLOCK_V], ACC)     # a sum per entry of the chunk (float32)
    for v0 in range(0, V_tok, BLOCK_V):
        v = v0 + offs
        if SPAN > 0:
            c = a[:, None] + v[None, :]                        # the classes
        else:
            c = v[None, :]
        if FUSED:
            x = tl.load(logits_ptr + at[:, None] + v[None, :],
                        mask=v[None, :] < n_r[:, None], other=NEG_INF).to(ACC)
        else:
            x = tl.zeros([ROWS, BLOCK_V], ACC)
        # (inline, not ``_token_grad_store``: through it this pass took 58-60 registers
        # a thread on sm_90 with Triton 3.6, its mask made before g or after, 48 inline)
        g = _token_grad(x, c, lse_hi, lse_lo, mass, no_mass, rb, rl, blank, y, FUSED, FUSED)
        g = _grad_out(g, nan_row[:, None], clamp, write[:, None], w_up[:, None], FUSED,
                      CLAMP)
        if CHECK > 0:
            if ACC == tl.float64:       # reduced every chunk: a sum per entry took more
                total += tl.sum(_unfixed_p(x, c, lse_hi, lse_lo, K, READS, CLASS_ID), axis=1)
            else:
                sums += _unfixed_p(x, c, lse_hi, lse_lo, K, READS, CLASS_ID)
        out = v[None, :] < n_w[:, None]
        dst = grad_ptr + at[:, None] + v[None, :]
        if N_CLS > 0:
            # The fixed classes' columns are step 1's: a mask that changes at any entry
            # (stores of an entry each), only in the chunks that may hold one of them
            # (classes v0 + a + [0, BLOCK_V), a < max(SPAN, 1)).
            fixed_here = v0 < 0
            for k in tl.static_range(K):
                if READS[k] == 2:
                    fixed_here = fixed_here | ((CLASS_ID[k] >= v0)
                                               & (CLASS_ID[k] < v0 + BLOCK_V + SPAN))
            if fixed_here:
                for k in tl.static_range(K):
                    if READS[k] == 2:
                        out = out & (c != CLASS_ID[k])
                tl.store(dst, g.to(grad_ptr.dtype.element_ty), mask=out)
            else:
                tl.store(dst, g.to(grad_ptr.dtype.element_ty), mask=out)
        else:
            tl.store(dst, g.to(grad_ptr.dtype.element_ty), mask=out)
    if N_DURATIONS > 0 and DUR_LAST:
        total = _duration_step(logits_ptr, grad_ptr, ws_ptr, row, node, reads, keep, has_row,
                               nan_row, write, w_up, total, V_tok, n_nodes, o_dur, K, DURATION,
                               N_DURATIONS, N_CLS, DUR_COL, ACC, BLOCK_DUR, FUSED, CHECK)
    if SPAN > 0:
        # The edges, an entry a load: the head (classes 0 .. a-1, lanes j < SPAN) and the
        # tail (a + n_w .., lanes j >= SPAN), each fewer than SPAN classes.
        j = tl.arange(0, 2 * SPAN)[None, :]
        c = tl.where(j < SPAN, j, a[:, None] + n_w[:, None] + (j - SPAN))
        on = (c < V_tok) & ((j >= SPAN) | (j < a[:, None])) & has_row[:, None]
        if FUSED:
            x = tl.load(logits_ptr + row[:, None] + c, mask=on & live[:, None],
                        other=NEG_INF).to(ACC)
        else:
            x = tl.zeros([ROWS, 2 * SPAN], ACC)
        _token_grad_store(x, c, on, grad_ptr + row[:, None] + c, lse_hi, lse_lo, mass,
                          no_mass, rb, rl, blank, y, nan_row, clamp, write, w_up,
                          K, READS, CLASS_ID, FUSED, CLAMP)
        if CHECK > 0:
            total += tl.sum(_unfixed_p(x, c, lse_hi, lse_lo, K, READS, CLASS_ID), axis=1)
    if CHECK > 0:
        # (sum_g sum_v p_g(v) - n_g) / (1 + |lse|): the durations' term is in ``total``.
        dev = total + tl.sum(sums, axis=1) - tl.where(live, 1.0, 0.0)
        dev = tl.where(nan_row, 0.0, dev / (1.0 + tl.abs(lse_hi)))     # (lse may be NaN there)
        bad = has_row & ~(tl.abs(dev) <= CHECK)                         # NaN is bad
        # every writer writes the same 1: no atomics needed
        tl.store(check_ptr + r * 0, tl.full([ROWS], 1.0, tl.float32), mask=bad)


# --------------------------------------------------------------------------- input check
@triton.jit(do_not_specialize=("B", "T", "U", "V", "blank"))
def _input_check_kernel(
    # data ptrs
    targets_ptr, logit_lengths_ptr, target_lengths_ptr, boundary_ptr, ok_ptr, nan_ptr,
    # shapes
    B, T, U, V, blank,
    # flags
    LABELS: tl.constexpr, NO_BLANK: tl.constexpr, CLASSES: tl.constexpr,
    BOUNDARY: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_U: tl.constexpr,
):
    """The value checks of ``_validate.device_value_check`` on the device, one program
    over the whole batch (``BLOCK_B`` sequences x ``BLOCK_U`` labels at a time; the batch's
    labels are few beside its logits). For each sequence b:

        rule 0  0 <= T_b <= T                          T_b = logit_lengths[b]
        rule 1  0 <= U_b <= U                          U_b = target_lengths[b]
        rule 2  0 <= y[b, u] < V                       u < min(U_b, U)      (LABELS)
        rule 3  y[b, u] != blank, y[b, u] not in CLASSES   (NO_BLANK: the blank; CLASSES:
                                                       the fixed classes, multi-blank's big blanks)
        rule 4  0 <= begin_symbol <= end_symbol <= U_b,
                0 <= begin_frame <= end_frame <= T_b   (BOUNDARY: k2's (B, 4) rows)

    Writes ``ok[i]`` = 1.0 if the rules of flag i hold for every sequence, else 0.0
    (float32, (3,): the lengths, rules 0-1; the labels, rules 2-3; the boundary, rule 4;
    a rule off holds), and ``nan[b]`` = NaN if sequence b breaks a rule, else 0.0 (float32,
    (B,)). Every load is masked: nothing is read outside the tensors whatever the values.
    Offsets in int64."""
    offs_b = tl.arange(0, BLOCK_B)
    offs_u = tl.arange(0, BLOCK_U)
    bad_any = tl.zeros([BLOCK_B], tl.int32)      # per rule: some sequence broke it
    bad0 = bad_any
    bad1 = bad_any
    bad2 = bad_any
    bad3 = bad_any
    bad4 = bad_any
    for b0 in range(0, B, BLOCK_B):
        b = (b0 + offs_b).to(tl.int64)
        on = b < B
        t_len = tl.load(logit_lengths_ptr + b, mask=on, other=0).to(tl.int64)
        u_len = tl.load(target_lengths_ptr + b, mask=on, other=0).to(tl.int64)
        r0 = on & ((t_len < 0) | (t_len > T))
        r1 = on & ((u_len < 0) | (u_len > U))
        r2 = tl.zeros([BLOCK_B], tl.int32) > 0
        r3 = r2
        r4 = r2
        if LABELS:
            n_lab = tl.minimum(u_len, U)
            for u0 in range(0, U, BLOCK_U):
                u = u0 + offs_u
                live = on[:, None] & (u[None, :] < n_lab[:, None])
                y = tl.load(targets_ptr + b[:, None] * U + u[None, :], mask=live,
                            other=0).to(tl.int64)
                r2 = r2 | (tl.max((live & ((y < 0) | (y >= V))).to(tl.int32), axis=1) > 0)
                if NO_BLANK:
                    r3 = r3 | (tl.max((live & (y == blank)).to(tl.int32), axis=1) > 0)
                for c in tl.static_range(len(CLASSES)):
                    r3 = r3 | (tl.max((live & (y == CLASSES[c])).to(tl.int32), axis=1) > 0)
        if BOUNDARY:
            s0 = tl.load(boundary_ptr + b * 4, mask=on, other=0).to(tl.int64)
            f0 = tl.load(boundary_ptr + b * 4 + 1, mask=on, other=0).to(tl.int64)
            s1 = tl.load(boundary_ptr + b * 4 + 2, mask=on, other=0).to(tl.int64)
            f1 = tl.load(boundary_ptr + b * 4 + 3, mask=on, other=0).to(tl.int64)
            r4 = on & ((s0 < 0) | (s0 > s1) | (s1 > u_len) | (f0 < 0) | (f0 > f1) | (f1 > t_len))
        bad = r0 | r1 | r2 | r3 | r4
        tl.store(nan_ptr + b, tl.where(bad, POS_INF + NEG_INF, 0.0), mask=on)
        bad0 = bad0 | r0.to(tl.int32)
        bad1 = bad1 | r1.to(tl.int32)
        bad2 = bad2 | r2.to(tl.int32)
        bad3 = bad3 | r3.to(tl.int32)
        bad4 = bad4 | r4.to(tl.int32)
    tl.store(ok_ptr + 0, tl.where(tl.max(bad0 | bad1, axis=0) > 0, 0.0, 1.0))
    tl.store(ok_ptr + 1, tl.where(tl.max(bad2 | bad3, axis=0) > 0, 0.0, 1.0))
    tl.store(ok_ptr + 2, tl.where(tl.max(bad4, axis=0) > 0, 0.0, 1.0))


# --------------------------------------------------------------------------- window choice
@triton.jit(do_not_specialize=("T", "S", "max_step"))
def _window_dp_kernel(mass_ptr, f_ptr, arg_ptr, total_ptr, starts_ptr, T, S, max_step,
                      BLOCK_S: tl.constexpr):
    """The window DP of math.md section 10 for sequence ``b = program_id(0)``, as
    ``cpu.kernels.window_dp`` (the same recursion, ties to the lowest start):

        f(0, s) = mass(0, s)
        f(t, s) = mass(t, s) + max_{max(s - max_step, 0) <= s' <= s} f(t-1, s')

    All starts of a frame at once (``BLOCK_S >= S`` lanes); f lives in the row ``f_ptr[b]``
    (S float64) so that the lanes can read their neighbours' values (the shifted reads of
    the sliding maximum), with a barrier between the reads of frame t-1 and the writes of
    frame t. ``arg (B, T, S)`` int32 keeps each (t, s)'s best s'; the backtrack then follows
    it frame by frame. Offsets in int64."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    on = s < S
    row = mass_ptr + b * T * S
    frow = f_ptr + b * S
    f0 = tl.load(row + s, mask=on, other=NEG_INF)
    tl.store(frow + s, f0, mask=on)
    tl.debug_barrier()
    for t in range(1, T):
        lo = tl.maximum(s - max_step, 0)
        best = tl.load(frow + lo, mask=on, other=NEG_INF)
        k = lo
        for j in range(1, max_step + 1):
            sp = lo + j
            ok = on & (sp <= s)
            v = tl.load(frow + sp, mask=ok, other=NEG_INF)
            better = ok & (v > best)
            best = tl.where(better, v, best)
            k = tl.where(better, sp, k)
        g = tl.load(row + t * S + s, mask=on, other=NEG_INF) + best
        tl.store(arg_ptr + (b * T + t) * S + s, k.to(tl.int32), mask=on)
        tl.debug_barrier()                 # every lane has read frame t-1's f
        tl.store(frow + s, g, mask=on)
        tl.debug_barrier()                 # frame t's f is visible to every lane
    f = tl.load(frow + s, mask=on, other=NEG_INF)
    top = tl.max(f, axis=0)
    k = tl.min(tl.where(on & (f == top), s, BLOCK_S), axis=0)
    k = tl.where(k < BLOCK_S, k, 0).to(tl.int64)        # f all NaN: start 0
    tl.store(total_ptr + b, top)
    tl.store(starts_ptr + b * T + T - 1, k)
    for i in range(1, T):
        t = T - i
        k = tl.load(arg_ptr + (b * T + t) * S + k).to(tl.int64)
        tl.store(starts_ptr + b * T + t - 1, k)


@triton.jit
def _min2(a, b):
    return tl.minimum(a, b)


@triton.jit(do_not_specialize=("T", "n", "R", "R_e", "gb_sb", "gb_st", "gl_sb", "gl_st",
                               "te_s", "ue_s"))
def _k2_starts_kernel(gb_ptr, gl_ptr, t_end_ptr, u_end_ptr, starts_ptr, T, n, R, R_e,
                      gb_sb, gb_st, gl_sb, gl_st, te_s, ue_s, BLOCK_T: tl.constexpr,
                      BLOCK_S: tl.constexpr, BLOCK_SCAN: tl.constexpr):
    """k2's window starts of sequence ``b = program_id(0)`` (``torch_backend.k2_starts``,
    the same rule and order of sums). For ``BLOCK_T`` frames at a time, all ``n`` starts in
    the lanes of a ``[BLOCK_T, BLOCK_S]`` tile::

        score(t, s) = sum_{k < R} gamma_blank(t, s + k) - gamma_label(t, s - 1)
        s_begin(t)  = first argmax_s score (NaN counts as the largest, as torch.argmax's),
                      max(u_end - R + 1, 0) for t >= t_end - 1

    the sum term by term in the occupations' dtype; then k2's repair (``k2_adjust``), two
    suffix minima over the frames taken ``BLOCK_SCAN`` frames at a time from the last, each
    block a scan carrying the minimum of the frames after it. One program per sequence, no
    host synchronisation; offsets in int64 (the occupations' strides ``*_sb, *_st``, unit
    along U+1; the ends read through their strides: a boundary's columns)."""
    b = tl.program_id(0).to(tl.int64)
    t_end = tl.load(t_end_ptr + b * te_s).to(tl.int32)
    u_end = tl.load(u_end_ptr + b * ue_s).to(tl.int32)
    tail = tl.maximum(u_end - R + 1, 0)
    s = tl.arange(0, BLOCK_S)
    row = starts_ptr + b * T
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        m = (t < T)[:, None] & (s < n)[None, :]
        blk_at = gb_ptr + b * gb_sb + t[:, None].to(tl.int64) * gb_st + s[None, :]
        blk = tl.load(blk_at, mask=m, other=0.0)
        for k in range(1, R):
            blk += tl.load(blk_at + k, mask=m, other=0.0)
        lab = tl.load(gl_ptr + b * gl_sb + t[:, None].to(tl.int64) * gl_st + s[None, :] - 1,
                      mask=m & (s[None, :] >= 1), other=0.0)
        score = blk - lab
        score = tl.where(score != score, POS_INF, score)
        score = tl.where(m, score, NEG_INF)
        best = tl.argmax(score, axis=1, tie_break_left=True).to(tl.int32)
        tl.store(row + t, tl.where(t < t_end - 1, best, tail).to(tl.int64), mask=t < T)
    tl.debug_barrier()                     # every frame's start is written
    big = 1 << 30
    carry_s = big
    carry_y = big
    for i in range(0, T, BLOCK_SCAN):
        t = T - 1 - i - tl.arange(0, BLOCK_SCAN)            # descending frames
        on = t >= 0
        v = tl.load(row + t, mask=on, other=big).to(tl.int32)
        sm = tl.minimum(tl.associative_scan(v, 0, _min2), carry_s)          # min_{t' >= t}
        y = tl.where(on, (R_e - 1) * t - sm, big)
        ym = tl.minimum(tl.associative_scan(y, 0, _min2), carry_y)
        tl.store(row + t, ((R_e - 1) * t - tl.maximum(ym, 0)).to(tl.int64), mask=on)
        carry_s = tl.minimum(carry_s, tl.min(v, axis=0))
        carry_y = tl.minimum(carry_y, tl.min(y, axis=0))


# --------------------------------------------------------------------------- simple loss
@triton.jit
def _rescue_chunk(a_row, l_row, cols, V, s_av, s_lv):
    """``(on, am(t, cols) + lm(u, cols))`` in float64 of one chunk of a rescued node's
    classes ``cols`` (-inf past V)."""
    on = cols < V
    x = (tl.load(a_row + cols * s_av, mask=on, other=NEG_INF).to(tl.float64)
         + tl.load(l_row + cols * s_lv, mask=on, other=NEG_INF).to(tl.float64))
    return on, x


@triton.jit(do_not_specialize=("n_nodes", "T", "U1", "V", "s_ab", "s_at", "s_lb", "s_lu"))
def _simple_rescue_kernel(
    # data
    am_ptr, lm_ptr, need_ptr, lse_ptr, g_ptr, grad_am_ptr, grad_lm_ptr,
    # shapes: the nodes B T (U+1), the grid
    n_nodes, T, U1, V,
    # strides, in elements: am (B, T, V), lm (B, U+1, V); the gradients are contiguous
    s_ab, s_at, s_av, s_lb, s_lu, s_lv,
    BACKWARD: tl.constexpr, BLOCK_NODES: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """The simple losses' log-domain rescue (``pruned._rescue``) of the nodes ``need``
    marks among the ``BLOCK_NODES`` nodes ``node = (b t) (U+1) + u`` of this program: their
    mass left float64's range in the matmul, so their normaliser is computed from their two
    rows,

        forward:   lse(t,u) = logsumexp_v am(t,v) + lm(u,v)                 (float64)
        backward:  grad_am(t,v) += g p(v),  grad_lm(u,v) += g p(v),  p = exp(am + lm - lse)

    over V in chunks of ``BLOCK_V`` (online max and scaled sum), the gradients added with
    float64 atomics (several nodes share a row). Such nodes are rare (none in a usual
    batch): a program reads its block's marks with one vector load and returns when none is
    set, else takes its marked nodes one after the other. (One program per node took 0.78
    ms a launch at pg1's 1.3 million nodes on an H100, to do nothing.) Offsets in int64."""
    first = tl.program_id(0).to(tl.int64) * BLOCK_NODES
    nodes = first + tl.arange(0, BLOCK_NODES)
    marks = tl.load(need_ptr + nodes, mask=nodes < n_nodes, other=0)
    if tl.max(marks.to(tl.int32), axis=0) != 0:
        v = tl.arange(0, BLOCK_V)
        for i in range(0, BLOCK_NODES):
            node = first + i
            if node < n_nodes:
                if tl.load(need_ptr + node) != 0:
                    bt = node // U1
                    u = node - bt * U1
                    b = bt // T
                    t = bt - b * T
                    a_row = am_ptr + b * s_ab + t * s_at
                    l_row = lm_ptr + b * s_lb + u * s_lu
                    if BACKWARD:
                        lse = tl.load(lse_ptr + node)
                        g = tl.load(g_ptr + node)
                        if lse > NEG_INF:
                            for v0 in range(0, V, BLOCK_V):
                                on, x = _rescue_chunk(a_row, l_row, v0 + v, V, s_av, s_lv)
                                p = tl.where(on, tl.exp(x - lse) * g, 0.0)
                                tl.atomic_add(grad_am_ptr + bt * V + v0 + v, p, mask=on)
                                tl.atomic_add(grad_lm_ptr + (b * U1 + u) * V + v0 + v, p,
                                              mask=on)
                    else:
                        m = tl.full((), NEG_INF, tl.float64)
                        s = tl.zeros((), tl.float64)
                        for v0 in range(0, V, BLOCK_V):
                            _, x = _rescue_chunk(a_row, l_row, v0 + v, V, s_av, s_lv)
                            m_new = tl.maximum(m, tl.max(x, axis=0))
                            ref = tl.where(m_new == NEG_INF, 0.0, m_new)   # all -inf so far
                            s = s * tl.exp(m - ref) + tl.sum(tl.exp(x - ref), axis=0)
                            m = m_new
                        tl.store(lse_ptr + node, tl.where(s > 0.0, m + tl.log(s), NEG_INF))


@triton.jit(do_not_specialize=("n_rows", "T", "U1", "V", "s_ab", "s_at", "s_lb", "s_lu"))
def _simple_rescue_rows_kernel(
    # data: the gradient of one side, grad_am (B, T, V) or grad_lm (B, U+1, V), float64,
    # contiguous
    am_ptr, lm_ptr, need_ptr, lse_ptr, g_ptr, grad_side_ptr,
    # shapes: the rows of the gradient (the grid), the nodes B T (U+1)
    n_rows, T, U1, V,
    # strides, in elements: am (B, T, V), lm (B, U+1, V)
    s_ab, s_at, s_av, s_lb, s_lu, s_lv,
    AM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """The backward of the log-domain rescue (``_simple_rescue_kernel``'s) in a fixed order,
    under ``torch.use_deterministic_algorithms(True)``: a program per row of one side's
    gradient, ``AM``: row ``(b, t)`` of ``grad_am``, its nodes ``u = 0..U`` in order; else
    row ``(b, u)`` of ``grad_lm``, its nodes ``t = 0..T-1`` in order::

        grad(row, v) = (...((grad(row, v) + g_k1 p_k1(v)) + g_k2 p_k2(v)) ...)

    over the row's marked live nodes ``k1 < k2 < ...``, ``p_k(v) = exp(am(t,v) + lm(u,v) -
    lse_k)``: the sum held in registers a chunk of ``BLOCK_V`` classes at a time and
    written once. No atomics: two runs give the same bits, the order of the reference's
    ``index_put_`` on the CPU. A program reads its row's marks ``BLOCK_K`` at a time and
    returns when none is set (two launches, one a side, where the atomic kernel takes
    one). Offsets in int64."""
    row = tl.program_id(0).to(tl.int64)
    if AM:
        b = row // T
        fixed = row - b * T                        # t
        K = U1
        first = row * U1                           # node (b, t, 0)
        step = tl.full((), 1, tl.int64)
    else:
        b = row // U1
        fixed = row - b * U1                       # u
        K = T
        first = b * T * U1 + fixed                 # node (b, 0, u)
        step = tl.full((), 1, tl.int64) * U1
    found = tl.zeros((), tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        marks = tl.load(need_ptr + first + k.to(tl.int64) * step, mask=k < K, other=0)
        found = tl.maximum(found, tl.max(marks.to(tl.int32), axis=0))
    if found != 0:
        out = grad_side_ptr + row * V
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            acc = tl.load(out + cols, mask=cols < V, other=0.0)
            # node k's rows: the fixed one and row k of the other side, a step along it
            node = first
            if AM:
                a_row = am_ptr + b * s_ab + fixed * s_at
                l_row = lm_ptr + b * s_lb
            else:
                a_row = am_ptr + b * s_ab
                l_row = lm_ptr + b * s_lb + fixed * s_lu
            for _ in range(0, K):
                if tl.load(need_ptr + node) != 0:
                    lse = tl.load(lse_ptr + node)
                    if lse > NEG_INF:
                        g = tl.load(g_ptr + node)
                        on, x = _rescue_chunk(a_row, l_row, cols, V, s_av, s_lv)
                        acc += tl.where(on, tl.exp(x - lse) * g, 0.0)
                node += step
                if AM:
                    l_row += s_lu
                else:
                    a_row += s_at
            tl.store(out + cols, acc, mask=cols < V)


# The flags of a node that the arc terms' backward reads (``_arc_terms_kernel``'s ``code``).
ARC_FIN = tl.constexpr(1)      # lse is not -inf: the node's b and e read their entries
ARC_LIVE = tl.constexpr(2)     # lse came from the mass (not on a bad row)
ARC_RESC = tl.constexpr(4)     # lse came from the rescue (not on a bad row)


@triton.jit(do_not_specialize=("T", "U1"))
def _arc_terms_kernel(
    # the normaliser's parts (``_types.ArcParts``), contiguous; bool tensors as uint8
    mass_ptr, lse_r_ptr, resc_ptr, am_cols_ptr, lm_cols_ptr, am_shift_ptr, lm_shift_ptr,
    am_bad_ptr, lm_bad_ptr, P_ptr, Q_ptr, R_ptr, S_ptr,
    # out: b', e' (B, T, U+1) float64, the flags (B, T, U+1) int8
    b_ptr, e_ptr, code_ptr,
    T, U1, c_hi, c_mid, c_lo, sa_hi, sa_mid, sa_lo, sl_hi, sl_mid, sl_lo,
    MIX: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_U: tl.constexpr,
):
    """The simple losses' arc log-probs of frames ``t0 = program_id(1) BLOCK_T ..`` of
    sequence ``b = program_id(0)``, over U+1 in chunks of ``BLOCK_U``
    (``torch_backend.arc_terms`` is the reference, ``pruned.simple._ArcTerms`` has the
    formulas)::

        lse = log mass + am_shift(t) + lm_shift(u)    live: mass > 0, not rescued
            = lse_rescued (rescued),  -inf (no mass),  NaN on a bad row
        b   = am(t, blank) + lm(u, blank) - lse,   e = am(t, y_u) + lm(u, y_u) - lse  (u < U)
              (-inf where lse is -inf; e -inf at u = U)
        MIX: b' = ((c b + (Q(u) + s_lm lm(u, blank))) + (P(t) + s_am am(t, blank)))
             e' = ((c e + (S(u) + s_lm lm(u, y_u))) + s_am am(t, y_u)) + R(t)      (u < U)

    and ``code``: ``ARC_FIN | ARC_LIVE | ARC_RESC`` for the backward
    (``_arc_terms_grad_kernel``). The scales ``c, s_am, s_lm`` come as float32 parts
    (``_f64``). Offsets in int64."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    on_t = t < T
    bt = b * T + t                                                  # (BLOCK_T,)
    a_sh = tl.load(am_shift_ptr + bt, mask=on_t, other=0.0)
    a_bad = tl.load(am_bad_ptr + bt, mask=on_t, other=0) != 0
    a_blank = tl.load(am_cols_ptr + bt * U1, mask=on_t, other=0.0).to(tl.float64)
    if MIX:
        c = _f64(c_hi, c_mid, c_lo)
        s_am = _f64(sa_hi, sa_mid, sa_lo)
        s_lm = _f64(sl_hi, sl_mid, sl_lo)
        p_t = tl.load(P_ptr + bt, mask=on_t, other=0.0) + s_am * a_blank
        r_t = tl.load(R_ptr + bt, mask=on_t, other=0.0)
    for u0 in range(0, U1, BLOCK_U):
        u = u0 + tl.arange(0, BLOCK_U)
        on_u = u < U1
        lab = u < U1 - 1                                            # a label arc: u < U
        m = on_t[:, None] & on_u[None, :]
        node = bt[:, None] * U1 + u[None, :]
        bu = b * U1 + u
        mass = tl.load(mass_ptr + node, mask=m, other=0.0)
        resc = tl.load(resc_ptr + node, mask=m, other=0) != 0
        live = (mass > 0.0) & ~resc
        lse = tl.log(tl.where(live, mass, 1.0)) + a_sh[:, None]
        lse = lse + tl.load(lm_shift_ptr + bu, mask=on_u, other=0.0)[None, :]
        lse = tl.where(live, lse, NEG_INF)
        lse = tl.where(resc, tl.load(lse_r_ptr + node, mask=m & resc, other=NEG_INF), lse)
        bad = a_bad[:, None] | (tl.load(lm_bad_ptr + bu, mask=on_u, other=0) != 0)[None, :]
        lse = tl.where(bad, POS_INF + NEG_INF, lse)                  # NaN
        dead = lse == NEG_INF
        l_blank = tl.load(lm_cols_ptr + bu * 2, mask=on_u, other=0.0).to(tl.float64)
        l_lab = tl.load(lm_cols_ptr + bu * 2 + 1, mask=on_u & lab, other=0.0).to(tl.float64)
        a_lab = tl.load(am_cols_ptr + node + 1, mask=m & lab[None, :], other=0.0)
        a_lab = a_lab.to(tl.float64)
        bb = tl.where(dead, NEG_INF, (a_blank[:, None] + l_blank[None, :]) - lse)
        ee = tl.where(dead, NEG_INF, (a_lab + l_lab[None, :]) - lse)
        if MIX:
            q_u = tl.load(Q_ptr + bu, mask=on_u, other=0.0) + s_lm * l_blank
            s_u = tl.load(S_ptr + b * (U1 - 1) + u, mask=lab, other=0.0) + s_lm * l_lab
            bb = (bb * c + q_u[None, :]) + p_t[:, None]
            ee = ((ee * c + s_u[None, :]) + s_am * a_lab) + r_t[:, None]
        ee = tl.where(lab[None, :], ee, NEG_INF)
        code = (tl.where(lse != NEG_INF, ARC_FIN, 0) + tl.where(live & ~bad, ARC_LIVE, 0)
                + tl.where(resc & ~bad, ARC_RESC, 0))
        tl.store(b_ptr + node, bb, mask=m)
        tl.store(e_ptr + node, ee, mask=m)
        tl.store(code_ptr + node, code.to(tl.int8), mask=m)


@triton.jit(do_not_specialize=("T", "U1", "n_tb", "gb_sb", "gb_st", "gb_su", "ge_sb", "ge_st",
                               "ge_su"))
def _arc_terms_grad_kernel(
    code_ptr, mass_ptr, gb_ptr, ge_ptr,
    # out: d mass, d lse_rescued, d am_cols (B, T, U+1); d P, d R (B, T); the per-block
    # column sums (B, n_tb, 4, U+1) float64
    g_mass_ptr, g_resc_ptr, g_am_ptr, dP_ptr, dR_ptr, part_ptr,
    T, U1, n_tb, gb_sb, gb_st, gb_su, ge_sb, ge_st, ge_su,
    c_hi, c_mid, c_lo, sa_hi, sa_mid, sa_lo,
    MIX: tl.constexpr, HAS_GB: tl.constexpr, HAS_GE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_U: tl.constexpr,
):
    """The backward of ``_arc_terms_kernel`` on its tile (``torch_backend.arc_terms_backward``
    is the reference): from ``G_b, G_e`` (the gradients of b', e', read through their
    strides; absent: 0) and ``g = c G`` on the nodes flagged ``ARC_FIN`` (0 elsewhere)::

        d lse = -(g_b + g_e),   d mass = d lse / mass (ARC_LIVE),   d lse_rescued = d lse (ARC_RESC)
        d am(t, y_u) = g_e + s_am G_e (u < U)       -> d am_cols[t, u+1]
        d am(t, blank) = sum_u g_b + s_am sum_u G_b -> d am_cols[t, 0];  d P = sum_u G_b,
        d R = sum_u G_e

    (the sums over u in the program, chunk after chunk), and its frames' sums over t of
    ``g_b, g_e, G_b, G_e`` into ``part[b, program_id(1)]``, which ``_arc_terms_cols_kernel``
    adds up in block order (no atomics: two runs give the same bits)."""
    b = tl.program_id(0).to(tl.int64)
    tb = tl.program_id(1).to(tl.int64)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    on_t = t < T
    bt = b * T + t
    c = 1.0
    if MIX:
        c = _f64(c_hi, c_mid, c_lo)
        s_am = _f64(sa_hi, sa_mid, sa_lo)
    # The sums over u element by element, reduced after the loop (see _simple_rows_kernel:
    # Triton 3.6 does not compile a loop-carried row sum read twice after the loop).
    acc_gb = tl.zeros([BLOCK_T, BLOCK_U], tl.float64)
    acc_Gb = tl.zeros([BLOCK_T, BLOCK_U], tl.float64)
    acc_Ge = tl.zeros([BLOCK_T, BLOCK_U], tl.float64)
    for u0 in range(0, U1, BLOCK_U):
        u = u0 + tl.arange(0, BLOCK_U)
        on_u = u < U1
        lab = u < U1 - 1
        m = on_t[:, None] & on_u[None, :]
        m_lab = m & lab[None, :]
        node = bt[:, None] * U1 + u[None, :]
        code = tl.load(code_ptr + node, mask=m, other=0).to(tl.int32)
        fin = (code & ARC_FIN) != 0
        if HAS_GB:
            G_b = tl.load(gb_ptr + b * gb_sb + t[:, None] * gb_st + u[None, :] * gb_su, mask=m,
                          other=0.0).to(tl.float64)
        else:
            G_b = tl.zeros([BLOCK_T, BLOCK_U], tl.float64)
        if HAS_GE:
            G_e = tl.load(ge_ptr + b * ge_sb + t[:, None] * ge_st + u[None, :] * ge_su,
                          mask=m_lab, other=0.0).to(tl.float64)
        else:
            G_e = tl.zeros([BLOCK_T, BLOCK_U], tl.float64)
        gb = tl.where(fin, G_b * c, 0.0)                                # d b
        ge = tl.where(fin & lab[None, :], G_e * c, 0.0)                 # d e
        g_lse = -gb - ge
        mass = tl.load(mass_ptr + node, mask=m, other=1.0)
        tl.store(g_mass_ptr + node, tl.where((code & ARC_LIVE) != 0, g_lse / mass, 0.0), mask=m)
        tl.store(g_resc_ptr + node, tl.where((code & ARC_RESC) != 0, g_lse, 0.0), mask=m)
        g_lab = ge
        if MIX:
            g_lab = ge + s_am * G_e
        tl.store(g_am_ptr + node + 1, g_lab.to(g_am_ptr.dtype.element_ty), mask=m_lab)
        acc_gb += gb
        acc_Gb += G_b
        acc_Ge += G_e
        part = part_ptr + ((b * n_tb + tb) * 4) * U1 + u
        tl.store(part, tl.sum(gb, axis=0), mask=on_u)
        tl.store(part + U1, tl.sum(ge, axis=0), mask=on_u)
        tl.store(part + 2 * U1, tl.sum(G_b, axis=0), mask=on_u)
        tl.store(part + 3 * U1, tl.sum(G_e, axis=0), mask=on_u)
    sum_gb = tl.sum(acc_gb, axis=1)
    sum_Gb = tl.sum(acc_Gb, axis=1)
    sum_Ge = tl.sum(acc_Ge, axis=1)
    g_blank = sum_gb
    if MIX:
        g_blank = sum_gb + s_am * sum_Gb
    tl.store(g_am_ptr + bt * U1, g_blank.to(g_am_ptr.dtype.element_ty), mask=on_t)
    tl.store(dP_ptr + bt, sum_Gb, mask=on_t)
    tl.store(dR_ptr + bt, sum_Ge, mask=on_t)


@triton.jit(do_not_specialize=("U1", "n_tb"))
def _arc_terms_cols_kernel(
    part_ptr, g_lm_ptr, dQ_ptr, dS_ptr, U1, n_tb, sl_hi, sl_mid, sl_lo,
    MIX: tl.constexpr, BLOCK_TB: tl.constexpr, BLOCK_U: tl.constexpr,
):
    """The sums over t of ``_arc_terms_grad_kernel``'s blocks of frames, ``BLOCK_TB``
    blocks at a time (a tree sum of the tile's columns, in a fixed order), for the label
    positions ``u = program_id(1) BLOCK_U ..`` of sequence ``b = program_id(0)``::

        d lm(u, blank) = sum_t g_b + s_lm sum_t G_b -> d lm_cols[u, 0];  d Q = sum_t G_b
        d lm(u, y_u) = sum_t g_e + s_lm sum_t G_e   -> d lm_cols[u, 1] (0 at u = U);
        d S = sum_t G_e (u < U)"""
    b = tl.program_id(0).to(tl.int64)
    u = tl.program_id(1) * BLOCK_U + tl.arange(0, BLOCK_U)
    on_u = u < U1
    s_gb = tl.zeros([BLOCK_U], tl.float64)
    s_ge = tl.zeros([BLOCK_U], tl.float64)
    s_Gb = tl.zeros([BLOCK_U], tl.float64)
    s_Ge = tl.zeros([BLOCK_U], tl.float64)
    for tb0 in range(0, n_tb, BLOCK_TB):
        tb = tb0 + tl.arange(0, BLOCK_TB)
        m = (tb < n_tb)[:, None] & on_u[None, :]
        part = part_ptr + ((b * n_tb + tb[:, None]) * 4) * U1 + u[None, :]
        s_gb += tl.sum(tl.load(part, mask=m, other=0.0), axis=0)
        s_ge += tl.sum(tl.load(part + U1, mask=m, other=0.0), axis=0)
        s_Gb += tl.sum(tl.load(part + 2 * U1, mask=m, other=0.0), axis=0)
        s_Ge += tl.sum(tl.load(part + 3 * U1, mask=m, other=0.0), axis=0)
    if MIX:
        s_lm = _f64(sl_hi, sl_mid, sl_lo)
        s_gb = s_gb + s_lm * s_Gb
        s_ge = s_ge + s_lm * s_Ge
        tl.store(dQ_ptr + b * U1 + u, s_Gb, mask=on_u)
        tl.store(dS_ptr + b * (U1 - 1) + u, s_Ge, mask=on_u & (u < U1 - 1))
    row = g_lm_ptr + (b * U1 + u) * 2
    tl.store(row, s_gb.to(g_lm_ptr.dtype.element_ty), mask=on_u)
    tl.store(row + 1, tl.where(u < U1 - 1, s_ge, 0.0).to(g_lm_ptr.dtype.element_ty), mask=on_u)


# --------------------------------------------------------------------------- simple loss: rows
# V is specialised (a model's vocabulary: divisible by 16 or not), so that a row's start
# is known to be aligned and the rows are read and written with vector loads; the row
# counts and the strides of x and idx change with the batch's shape and are not.
@triton.jit(do_not_specialize=("n_rows", "N", "J", "s_xb", "s_xn", "s_xv", "s_ib", "s_in",
                               "s_ij"))
def _simple_rows_kernel(
    x_ptr, keep_ptr, idx_ptr,
    # out: ok, bad (B, N) uint8 (bool tensors' bytes), shift (B, N) float64, ex (B, N, V)
    # float64, cols (B, N, J) float64 (torch_backend.simple_rows)
    row_ok_ptr, row_bad_ptr, shift_ptr, ex_ptr, cols_ptr,
    n_rows, N, V, J, s_xb, s_xn, s_xv, s_ib, s_in, s_ij,
    CONTIG: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """The simple losses' rows ``x (B, N, V)`` (am: N = T, lm: N = U+1), ``ROWS`` rows ``r =
    b N + n`` a program (``torch_backend.simple_rows`` is the reference)::

        ok(r)    = keep(r) and no NaN or +inf in the row;   bad(r) = keep(r) and not ok(r)
        shift(r) = max_v x(r, v) where ok and finite, else 0
        ex(r, v) = exp(x(r, v) - shift(r)) on ok rows, else 0                   (float64)
        cols(r, j) = x(r, idx(r, j)) on ok rows, else 0                  (x's dtype)

    two passes over V in chunks of ``BLOCK_V`` (the maximum, then the exponentials), then
    the entries. x and idx read through their strides (am may be a transposed view; idx an
    expanded one), x at ``r V + v`` when ``CONTIG`` (vector loads); offsets in int64."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    on = r < n_rows
    b = r // N
    n = r - b * N
    if CONTIG:
        base = r * V
        s_xv = 1
    else:
        base = b * s_xb + n * s_xn
    keep = tl.load(keep_ptr + r, mask=on, other=0) != 0
    # The maximum and the NaN flags element by element, reduced after the loop: a row
    # reduction inside the loop, whose result is then read more than once, fails Triton
    # 3.6's compile for CUDA (OptimizeThreadLocality asserts ``loopResult.hasOneUse()``).
    mx_v = tl.full([ROWS, BLOCK_V], NEG_INF, x_ptr.dtype.element_ty)
    nan_v = tl.zeros([ROWS, BLOCK_V], tl.int32)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        m = on[:, None] & (v < V)[None, :]
        x = tl.load(x_ptr + base[:, None] + v[None, :].to(tl.int64) * s_xv, mask=m,
                    other=NEG_INF)
        mx_v = tl.maximum(mx_v, x)
        nan_v = nan_v | (x != x).to(tl.int32)
    mx = tl.max(mx_v, axis=1)
    ok = keep & (tl.max(nan_v, axis=1) == 0) & (mx < POS_INF)
    shift = tl.where(ok & (mx > NEG_INF), mx, 0.0).to(tl.float64)
    tl.store(row_ok_ptr + r, ok.to(tl.uint8), mask=on)
    tl.store(row_bad_ptr + r, (keep & ~ok).to(tl.uint8), mask=on)
    tl.store(shift_ptr + r, shift, mask=on)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        m = on[:, None] & (v < V)[None, :]
        x = tl.load(x_ptr + base[:, None] + v[None, :].to(tl.int64) * s_xv, mask=m & ok[:, None],
                    other=NEG_INF).to(tl.float64)
        ex = tl.where(ok[:, None], tl.exp(x - shift[:, None]), 0.0)
        tl.store(ex_ptr + r[:, None] * V + v[None, :], ex, mask=m)
    for j0 in range(0, J, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        m = on[:, None] & (j < J)[None, :]
        ix = tl.load(idx_ptr + (b * s_ib + n * s_in)[:, None] + j[None, :].to(tl.int64) * s_ij,
                     mask=m, other=0)
        c = tl.load(x_ptr + base[:, None] + ix * s_xv, mask=m & ok[:, None], other=0.0)
        tl.store(cols_ptr + r[:, None] * J + j[None, :], c.to(tl.float64), mask=m)


@triton.jit(do_not_specialize=("n_rows", "N", "J", "s_ib", "s_in", "s_ij"))
def _simple_rows_grad_kernel(
    g_ptr, ex_ptr, row_ok_ptr, g_uni_ptr, uni_ptr, idx_ptr, g_cols_ptr,
    n_rows, N, V, J, s_ib, s_in, s_ij,
    UNI: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_J: tl.constexpr, ORDERED: tl.constexpr,
):
    """The backward of ``_simple_rows_kernel``'s ``ex`` and ``cols``, in place on ``grad (B,
    N, V)`` float64 (``torch_backend.simple_rows_backward`` is the reference), ``ROWS``
    rows a program::

        grad(r, v) = (grad(r, v) + g_uni(r) uni(v)) ex(r, v)      (UNI; else grad ex)
                     + sum_{j: idx(r, j) = v} g_cols(r, j)           (COLS)
                     on ok rows, 0 elsewhere

    the entries' gradients added after the row's products are written (a barrier between):
    with float64 atomics, where a class read twice by one row (a repeated label) gets its
    two terms in either order; ``ORDERED`` (under ``torch.use_deterministic_algorithms``),
    one entry of each row at a time in the order of j, the order of the reference's
    ``scatter_add_`` on the CPU, a barrier after each (the next entry's load sees this
    one's store, whichever thread of the program holds the row): no atomics, two runs give
    the same bits."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    on = r < n_rows
    ok = tl.load(row_ok_ptr + r, mask=on, other=0) != 0
    if UNI:
        g_uni = tl.load(g_uni_ptr + r, mask=on, other=0.0).to(tl.float64)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        m = on[:, None] & (v < V)[None, :]
        at = r[:, None] * V + v[None, :]
        g = tl.load(g_ptr + at, mask=m, other=0.0)
        if UNI:
            g = g + g_uni[:, None] * tl.load(uni_ptr + v, mask=v < V, other=0.0).to(
                tl.float64)[None, :]
        g = g * tl.load(ex_ptr + at, mask=m, other=0.0)
        tl.store(g_ptr + at, tl.where(ok[:, None], g, 0.0), mask=m)
    if COLS:
        tl.debug_barrier()                 # every product is written before the entries add
        b = r // N
        n = r - b * N
        if ORDERED:
            live = on & ok
            ix_at = idx_ptr + b * s_ib + n * s_in          # entry j of each row
            gc_at = g_cols_ptr + r * J
            for j in range(0, J):
                ix = tl.load(ix_at, mask=live, other=0)
                gc = tl.load(gc_at, mask=live, other=0.0)
                at = g_ptr + r * V + ix
                tl.store(at, tl.load(at, mask=live, other=0.0) + gc.to(tl.float64), mask=live)
                tl.debug_barrier()             # entry j is written before entry j+1 reads
                ix_at += s_ij
                gc_at += 1
        else:
            for j0 in range(0, J, BLOCK_J):
                j = j0 + tl.arange(0, BLOCK_J)
                m = (on & ok)[:, None] & (j < J)[None, :]
                ix = tl.load(idx_ptr + (b * s_ib + n * s_in)[:, None] + j[None, :].to(tl.int64)
                             * s_ij, mask=m, other=0)
                gc = tl.load(g_cols_ptr + r[:, None] * J + j[None, :], mask=m, other=0.0)
                tl.atomic_add(g_ptr + r[:, None] * V + ix, gc.to(tl.float64), mask=m)


# --------------------------------------------------------------------------- pruning
@triton.jit(do_not_specialize=("M", "n_per"))
def _rows_sum_kernel(grad_ptr, index_ptr, sums_ptr, D, M, n_per, s_gn, s_gd,
                     ACC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                     CHUNK: tl.constexpr):
    """``out[j, d] = sum_{i: index[i] = j} grad[i, d]`` for ``j = program_id(0)`` and the
    columns ``d = program_id(1) BLOCK_D ..`` (``gpu.rows_sum``), the rows added one after
    the other in the order of i, in ``ACC``, without sorting the indices: the entries are in
    groups of ``M``, and group ``g`` points only into rows ``[g n_per, (g + 1) n_per)``
    (``do_rnnt_pruning``: a sequence's ``T R`` windows into its own ``U + 1`` rows of lm).

    1. The first and last entry of j's group equal to j (``lo``, ``hi``): one vectorised
       scan of the group's M indices, ``BLOCK_M`` at a time.
    2. The entries ``lo .. hi`` in order, ``CHUNK`` per step (unrolled, so the loads of a
       step issue together), each row added where its index is j (an add of 0.0 elsewhere
       leaves the sum's bits as they are: the sum starts at +0.0, so it is never -0.0).

    With k2's windows (starts that do not decrease, ``R`` consecutive positions) the
    entries of j span about the frames whose window covers it times R; any other indices
    are summed as correctly, at most M steps a program. D and the strides are a model's
    widths: specialised; M and n_per are the batch's: not. Offsets in int64."""
    j = tl.program_id(0).to(tl.int64)
    g = j // n_per
    idx_g = index_ptr + g * M
    lo = M.to(tl.int64)
    hi = tl.full([], -1, tl.int64)
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
        hit = tl.load(idx_g + m, mask=m < M, other=-1) == j
        lo = tl.minimum(lo, tl.min(tl.where(hit, m, M), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(hit, m, -1), axis=0))
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    on = d < D
    rows = grad_ptr + g * M * s_gn + d * s_gd
    acc = tl.zeros([BLOCK_D], ACC)
    for m0 in range(lo, hi + 1, CHUNK):
        for c in tl.static_range(CHUNK):
            m = m0 + c
            hit = tl.load(idx_g + m, mask=m <= hi, other=-1) == j
            take = tl.where(hit, on, False)     # (``on & hit``: int32 in the interpreter)
            acc += tl.load(rows + m * s_gn, mask=take, other=0.0).to(ACC)
    tl.store(sums_ptr + j * D + d, acc.to(sums_ptr.dtype.element_ty), mask=on)
