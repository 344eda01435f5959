"""The Triton backend's kernels for every topology (math.md section 9), run on CPU tensors
through the Triton interpreter, against the float64 generic reference
(``reference.costs_and_grad``): losses and gradients for every topology x option
(sigma, delay penalty, k2 boundary, FastEmit, clamp, log-prob mode, in-place gradient) on
ragged lattices with NaN-poisoned padding and signed upstream gradients; impossible
alignments; one frame and no labels; float16 logits; the ``node_rows`` layouts (packed
rows and pruned windows), built here by gathering rows of the padded logits.

The backend protocol is called directly (``gpu.loss_forward`` / ``gpu.loss_backward``):
the same calls that the public layer makes. Lattices are tiny and the tile sizes lowered
(``BLOCK_U = 2`` or 4, ``BLOCK_V = 4``, eight rows per program) so that every kernel still spans
several blocks; durations reach 4 (TDT) and 8 (multi-blank) on one case each, so that a
diagonal reads several earlier ones.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from support.backends import HAS_TRITON, TRITON_MISSING  # noqa: E402

if not HAS_TRITON:
    pytest.skip(f"needs the Triton backend: {TRITON_MISSING}", allow_module_level=True)

import rnnt_lattice  # noqa: E402
from rnnt_lattice import _layout, gpu, reference, topology  # noqa: E402
from rnnt_lattice._types import LossOptions  # noqa: E402
from support.cases import Case, rel_err, upstream_weights  # noqa: E402
from support.topologies import TOPOLOGIES, make_topo_inputs  # noqa: E402

if not gpu.INTERPRETED:                                             # pragma: no cover
    raise RuntimeError("rnnt_lattice.gpu was imported before TRITON_INTERPRET=1 was set")

# NumPy warns on exp/log of -inf in lanes that the kernels then mask out.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(gpu, "BLOCK_U", 4)          # one lane block per diagonal (see below)
    # 8 rows per program: 6 programs on RAGGED
    monkeypatch.setattr(gpu, "V_PASS_TILES", {"row": (32, 4), "grad": (32, 4)})


# Ragged (T_b, U_b); padded one frame and one label position beyond the longest.
RAGGED = Case("ragged", (5, 3), (2, 1), 6, 0, T=6, U=3)

OPTIONS = {
    "plain": dict(),
    "fastemit_clamp": dict(fastemit_lambda=0.4, clamp=0.05),
    "logprob": dict(fused=False, fastemit_lambda=0.25, clamp=0.2),
    "boundary": dict(boundary=True, sigma=0.1, delay_penalty=0.3),
    "logprob_boundary": dict(fused=False, boundary=True, delay_penalty=0.2),
}

TOL = {torch.float64: 1e-12, torch.float32: 8 * 2.0**-23 * 8}


def inputs(case, topo_name, opts, seed=0):
    return make_topo_inputs(case, topo_name, seed=seed, fused=opts.get("fused", True),
                            boundary=opts.get("boundary", False))


def loss_options(topo, blank, opts, **extra) -> LossOptions:
    return LossOptions(blank, opts.get("fused", True), opts.get("clamp", -1.0),
                       opts.get("fastemit_lambda", 0.0), topology=topo,
                       sigma=opts.get("sigma", 0.0), delay_penalty=opts.get("delay_penalty", 0.0),
                       **extra)


def triton_costs_grad(logits, targets, tl, ul, topo, blank, opts, upstream, *, boundary=None,
                      node_rows=None, inplace=False):
    """The backend protocol: forward (costs) and backward (``upstream[b] * grad_b``)."""
    lo = loss_options(topo, blank, opts, inplace_grad=inplace)
    x = logits.clone()
    costs, saved, state = gpu.loss_forward(x, targets, tl, ul, lo, True, boundary=boundary,
                                           node_rows=node_rows)
    grad = gpu.loss_backward(saved, state, upstream, lo)
    if inplace:
        assert grad.data_ptr() == x.data_ptr()
    return costs, grad


def reference_costs_grad(logits, targets, tl, ul, topo, blank, opts, upstream, boundary=None):
    """float64 reference on the numbers the kernels see, times the upstream gradient
    (exactly 0 where it is 0)."""
    costs, grad = reference.costs_and_grad(
        logits.double(), targets, tl, ul, topo, blank, opts.get("fused", True),
        opts.get("clamp", -1.0), opts.get("fastemit_lambda", 0.0), opts.get("sigma", 0.0),
        opts.get("delay_penalty", 0.0), boundary)
    up = upstream.double()[:, None, None, None]
    return costs, torch.where(up == 0, 0.0, grad * up)


def check(costs, grad, ref_costs, ref_grad, dtype, pad=None):
    assert torch.equal(torch.isinf(costs), torch.isinf(ref_costs)), (costs, ref_costs)
    tol = TOL[dtype]
    assert rel_err(costs, ref_costs) <= tol, (costs, ref_costs)
    assert rel_err(grad, ref_grad) <= tol
    if pad is not None:
        assert (grad[pad] == 0).all()


# --------------------------------------------------------------------------- every topology x option
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("topo_name", TOPOLOGIES)
def test_loss_and_gradient(topo_name, option, monkeypatch):
    """float64 logits for every topology x option (agreement to float64 rounding), and the
    same numbers in float32 for the plain set. Lanes of two label positions for the plain
    and boundary sets: a diagonal then spans several lane blocks (the interpreter pays for
    each, so the other sets run one block per diagonal)."""
    opts = OPTIONS[option]
    if option in ("plain", "boundary"):
        monkeypatch.setattr(gpu, "BLOCK_U", 2)
    logits, targets, tl, ul, topo, blank, bnd = inputs(RAGGED, topo_name, opts)
    up = upstream_weights(logits.shape[0])
    ref = reference_costs_grad(logits, targets, tl, ul, topo, blank, opts, up, bnd)
    got = triton_costs_grad(logits, targets, tl, ul, topo, blank, opts, up, boundary=bnd)
    region = reference.Ends.of(tl, ul, bnd).region(logits.shape[1], logits.shape[2])
    check(*got, *ref, torch.float64, pad=~region)
    assert got[0].dtype == torch.float64 and got[1].dtype == torch.float64
    if option == "plain":
        x32 = logits.float()
        ref = reference_costs_grad(x32, targets, tl, ul, topo, blank, opts, up, bnd)
        costs, grad = triton_costs_grad(x32, targets, tl.int(), ul.int(), topo, blank, opts,
                                        up.float(), boundary=bnd)
        assert costs.dtype == torch.float32 and grad.dtype == torch.float32
        check(costs, grad, *ref, torch.float32, pad=~region)


@pytest.mark.parametrize("option", ["plain", "logprob_boundary"])
@pytest.mark.parametrize("topo_name", TOPOLOGIES)
def test_lattice_state_in_registers(topo_name, option, monkeypatch):
    """``gpu.LATTICE_ONCHIP`` (on by default): the lattice pass with the last
    diagonals' alpha and beta held by the lanes (U + 1 = 4 lanes: one block a diagonal),
    each diagonal's weights loaded while the one before is combined. The costs and
    gradients of the pass through the workspace bit for bit, and the float64 reference's;
    float32 logits too (plain); in log-prob mode also with a +inf log-prob, whose +inf
    alpha and beta meet the -inf weight of every kind that is not an arc there (the end
    frame, past the last label): -inf, not NaN, as through the workspace."""
    opts = OPTIONS[option]
    logits, targets, tl, ul, topo, blank, bnd = inputs(RAGGED, topo_name, opts)
    up = upstream_weights(logits.shape[0])
    ref = reference_costs_grad(logits, targets, tl, ul, topo, blank, opts, up, bnd)
    region = reference.Ends.of(tl, ul, bnd).region(logits.shape[1], logits.shape[2])
    xs = (logits, logits.float()) if option == "plain" else (logits, logits.clone())
    if option != "plain":
        xs[1][0, 1, 0, :] = float("inf")             # every kind's log-prob at node (1, 0)
    for i, x in enumerate(xs):
        got = {}
        for on in (False, True):
            monkeypatch.setattr(gpu, "LATTICE_ONCHIP", on)
            assert gpu._onchip(logits.shape[2], topo)["ONCHIP"] == on
            got[on] = triton_costs_grad(x, targets, tl, ul, topo, blank, opts,
                                        up.to(x.dtype), boundary=bnd)
        for a, b in zip(got[True], got[False]):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        if option != "plain" and i == 1:
            continue                                 # no reference value for a +inf log-prob
        if x.dtype == torch.float64:
            check(*got[True], *ref, torch.float64, pad=~region)
        else:
            check(*got[True], *reference_costs_grad(x, targets, tl, ul, topo, blank, opts, up,
                                                    bnd), torch.float32, pad=~region)


@pytest.mark.parametrize("U1", [8, 16, 17])
@pytest.mark.parametrize("topo_name", ["regular", "tdt012", "multiblank"])
def test_lattice_lane_blocks_filled(topo_name, U1, monkeypatch):
    """The lattice pass's three lane blocks (``gpu._block_u``: ``BLOCK_U_SMALL`` lanes, twice
    that, ``BLOCK_U``; here 4, 8 and 16 for the interpreter's sake, 64, 128 and 256 as
    launched) filled to their last lane: U + 1 = 8 and 16 take the state in registers
    (``gpu.LATTICE_ONCHIP``, the default), whose neighbour gather and ring then reach the
    block's edge (the first block, filled: ``test_lattice_state_in_registers``); 17 takes
    the workspace pass. Costs and gradients against the float64
    reference (the longest sequence fills the block, the other is shorter), and bit for bit
    the workspace pass's."""
    monkeypatch.setattr(gpu, "BLOCK_U", 16)
    monkeypatch.setattr(gpu, "BLOCK_U_SMALL", 4)
    opts = OPTIONS["plain"]
    case = Case(f"u{U1}", (3, 2), (U1 - 1, max(U1 - 3, 0)), 5, 0, T=3, U=U1 - 1)
    logits, targets, tl, ul, topo, blank, bnd = inputs(case, topo_name, opts)
    assert logits.shape[2] == U1 and gpu.LATTICE_ONCHIP
    assert gpu._block_u(U1) == {8: 8, 16: 16, 17: 16}[U1]
    assert gpu._onchip(U1, topo)["ONCHIP"] == (U1 <= 16)
    up = upstream_weights(logits.shape[0])
    got = triton_costs_grad(logits, targets, tl, ul, topo, blank, opts, up)
    ref = reference_costs_grad(logits, targets, tl, ul, topo, blank, opts, up)
    region = reference.Ends.of(tl, ul, None).region(logits.shape[1], logits.shape[2])
    assert torch.isfinite(ref[0]).all()
    check(*got, *ref, torch.float64, pad=~region)
    if U1 <= 16:
        monkeypatch.setattr(gpu, "LATTICE_ONCHIP", False)
        for a, b in zip(got, triton_costs_grad(logits, targets, tl, ul, topo, blank, opts, up)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# V = 8: rows 16-byte aligned in float64 (RAGGED's V = 6 reads its rows from their span)
ALIGNED = Case("aligned", (5, 3), (2, 1), 8, 0, T=6, U=3)


@pytest.mark.parametrize("topo_name, case", [("constrained", RAGGED), ("tdt012", RAGGED),
                                             ("multiblank", RAGGED), ("multiblank", ALIGNED)],
                         ids=["constrained", "tdt012", "multiblank", "multiblank_aligned"])
def test_inplace_and_strided_upstream(topo_name, case):
    """``inplace_grad``: the gradient lands in the logits' storage and equals the
    out-of-place one (TDT: rows read from their span, which holds the row before's last
    entries; multi-blank: the fixed classes' columns written first, then read as
    gradients by the token group's step and not stored); an expanded scalar upstream
    gradient (stride 0) and a zero one."""
    opts = dict(fastemit_lambda=0.3, clamp=0.1, sigma=0.05)
    logits, targets, tl, ul, topo, blank, _ = inputs(case, topo_name, opts)
    assert (gpu._v_align(logits.shape[-1]) >= 4) == (case is ALIGNED)
    for up in (torch.tensor(0.7, dtype=torch.float64).expand(2),
               torch.tensor([0.0, -1.25], dtype=torch.float64)):
        ref = reference_costs_grad(logits, targets, tl, ul, topo, blank, opts, up)
        check(*triton_costs_grad(logits, targets, tl, ul, topo, blank, opts, up, inplace=True),
              *ref, torch.float64)


# The gradient pass's rows: (case, gpu.SPAN_GRAD). V_tok = 13: the rows start at every
# residue mod 16 bytes in float32 and bfloat16 (TDT's rows of 13 + durations too), and each
# holds several whole 16-byte groups between its first and last few entries; V_tok = 12:
# rows 16-byte aligned in float32 but for TDT's.
ROW_MODES = {
    "odd_interior": (Case("odd", (5, 3), (2, 1), 13, 0, T=6, U=3), True),
    "odd_per_entry": (Case("odd", (5, 3), (2, 1), 13, 0, T=6, U=3), False),
    "aligned": (Case("aligned", (5, 3), (2, 1), 12, 0, T=6, U=3), True),
}
# (dtype, tolerance on the costs and the gradient relative to their scale): the gradient is
# written in the logits' dtype.
ROW_DTYPES = {"float32": (torch.float32, 2e-6), "bfloat16": (torch.bfloat16, 2.0 ** -7)}


@pytest.mark.parametrize("dtype", ROW_DTYPES)
@pytest.mark.parametrize("mode", ROW_MODES)
@pytest.mark.parametrize("topo_name", ["multiblank", "multiblank_mid", "tdt012", "tdt13",
                                       "constrained"])
def test_gradient_pass_rows(topo_name, mode, dtype, monkeypatch):
    """The gradient pass over rows that start anywhere, both ways (``gpu.SPAN_GRAD``: the
    row's whole 16-byte groups with vector loads and stores and its first and last few
    entries apart, or an entry a load on NARROW_TILES), and over aligned rows, in place and
    not, against the float64 reference on the same (rounded) logits: TDT's duration group
    after the token group, multi-blank's fixed classes (the big blanks, the last columns
    of the token group but the blank: the chunks that may hold them store an entry at a
    time; or the blank in the middle and a big blank at class 8, the first of a chunk
    where the row starts on a 16-byte boundary), chunks of 4 classes (BLOCK_V) against
    groups of 4 (float32) and 8 (bfloat16) entries."""
    case, grad_span = ROW_MODES[mode]
    monkeypatch.setattr(gpu, "SPAN_GRAD", grad_span)
    monkeypatch.setitem(TOPOLOGIES, "multiblank_mid",
                        lambda V_tok, blank: (topology.multiblank(9, [2, 3]), 9))
    dt, tol = ROW_DTYPES[dtype]
    opts = dict(fastemit_lambda=0.3, clamp=0.5)
    logits, targets, tl, ul, topo, blank, _ = inputs(case, topo_name, opts)
    x = logits.to(dt)
    aligned = gpu._v_align(x.shape[-1], topo.n_durations) >= 4
    assert aligned == (case.V == 12 and not topo.n_durations), mode
    up = upstream_weights(logits.shape[0])
    ref_costs, ref_grad = reference_costs_grad(x, targets, tl, ul, topo, blank, opts, up)
    region = reference.Ends.of(tl, ul).region(x.shape[1], x.shape[2])
    for inplace in (False, True):
        costs, grad = triton_costs_grad(x, targets, tl.int(), ul.int(), topo, blank, opts,
                                        up.float(), inplace=inplace)
        assert grad.dtype == dt
        assert rel_err(costs, ref_costs) <= tol and rel_err(grad, ref_grad) <= tol, inplace
        assert (grad[~region] == 0).all()


@pytest.mark.parametrize("topo_name, mode, dtype", [
    ("tdt012", "odd_interior", "float32"), ("tdt012", "odd_interior", "bfloat16"),
    ("multiblank", "aligned", "float32"), ("regular", "odd_interior", "float32"),
    ("regular", "odd_interior", "bfloat16"), ("multiblank", "odd_interior", "bfloat16")])
def test_v_pass_switches_change_nothing(topo_name, mode, dtype, monkeypatch):
    """The V passes' switches that are off until a GPU times them, all on and all off: the
    row pass's entries read before the token group's loop (``gpu.ROW_EARLY``), the span's
    chunks loaded ahead (``gpu.SPAN_PREFETCH``) and the gradient pass's duration group
    after the token group's loop (``gpu.GRAD_DURATIONS_LAST``; TDT also in place): costs
    and gradients bit for bit the same (the same sums in the same order), and the float64
    reference's. Rows of every start residue (TDT's with durations, odd V) and aligned
    ones, chunks of 4 classes against groups of 4 (float32) and 8 (bfloat16: the span's
    head reaches past its first chunk), multi-blank's fixed classes, and a node whose
    token group is all -inf (dead; its duration group still read)."""
    case = ROW_MODES[mode][0]
    dt, tol = ROW_DTYPES[dtype]
    opts = dict(fastemit_lambda=0.3, clamp=0.5)
    logits, targets, tl, ul, topo, blank, _ = inputs(case, topo_name, opts)
    V_tok = logits.shape[-1] - topo.n_durations
    logits[0, 1, 1, :V_tok] = float("-inf")
    x = logits.to(dt)
    up = upstream_weights(logits.shape[0])
    got = {}
    for on in (False, True):
        for name in ("ROW_EARLY", "SPAN_PREFETCH", "GRAD_DURATIONS_LAST"):
            monkeypatch.setattr(gpu, name, on)
        for inplace in (False, True) if topo.n_durations else (False,):
            got[on, inplace] = triton_costs_grad(x, targets, tl.int(), ul.int(), topo, blank,
                                                 opts, up.float(), inplace=inplace)
    base = got[False, False]
    for key, (costs, grad) in got.items():
        assert torch.equal(costs, base[0]) and torch.equal(grad, base[1]), key
    ref_costs, ref_grad = reference_costs_grad(x, targets, tl, ul, topo, blank, opts, up)
    assert torch.isfinite(base[0]).all()
    assert rel_err(base[0], ref_costs) <= tol and rel_err(base[1], ref_grad) <= tol
    assert (base[1][0, 1, 1] == 0).all()


LONG_STEPS = {
    # (topology, blank, T_b, U_b): big blanks of 8 frames, TDT durations up to 4
    "multiblank_2_4_8": (lambda: topology.multiblank(5, [2, 4, 8]), 5, (9, 6), (1, 2)),
    "tdt_0_to_4": (lambda: topology.tdt([0, 1, 2, 3, 4]), 5, (5, 4), (2, 1)),
}


@pytest.mark.parametrize("name", LONG_STEPS)
def test_long_steps(name, monkeypatch):
    """Kinds that skip several anti-diagonals: a diagonal reads up to 8 earlier ones, in
    several lane blocks."""
    monkeypatch.setattr(gpu, "BLOCK_U", 2)
    make, blank, T_b, U_b = LONG_STEPS[name]
    topo = make()
    g = torch.Generator().manual_seed(4)
    B, T, U1 = 2, max(T_b), max(U_b) + 1
    logits = torch.randn(B, T, U1, 6 + topo.n_durations, generator=g, dtype=torch.float64)
    tl, ul = torch.tensor(T_b), torch.tensor(U_b)
    logits = logits.masked_fill(~_layout.node_mask(tl, ul, T, U1)[..., None], float("nan"))
    targets = torch.randint(0, 3, (B, U1 - 1), generator=g)
    opts = dict(fastemit_lambda=0.2, sigma=0.03)
    up = upstream_weights(B)
    ref = reference_costs_grad(logits, targets, tl, ul, topo, blank, opts, up)
    check(*triton_costs_grad(logits, targets, tl, ul, topo, blank, opts, up), *ref, torch.float64)


# --------------------------------------------------------------------------- edge cases
EDGES = {
    # name: (T_lens, U_lens), per topology the reference decides which are impossible
    "t1_u0": ((1, 1), (0, 1)),
    "u0": ((3, 2), (0, 0)),
    "impossible": ((2, 1), (3, 2)),          # more labels than some topologies can emit
    "no_frames": ((0, 3), (1, 1)),
}


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("topo_name", ["regular", "modified", "one_sym", "multiblank", "tdt13"])
def test_edge_lengths(topo_name, edge):
    """T = 1, U = 0, impossible alignments (+inf, zero gradient), T_b = 0."""
    T_lens, U_lens = EDGES[edge]
    case = Case(edge, T_lens, U_lens, 5, 0, T=max(T_lens) + 1, U=max(U_lens) + 1)
    logits, targets, tl, ul, topo, blank, _ = inputs(case, topo_name, {})
    up = upstream_weights(2)
    ref = reference_costs_grad(logits, targets, tl, ul, topo, blank, {}, up)
    costs, grad = triton_costs_grad(logits, targets, tl, ul, topo, blank, {}, up)
    check(costs, grad, *ref, torch.float64)
    assert torch.isfinite(grad).all()
    assert (grad[torch.isinf(costs)] == 0).all()


@pytest.mark.parametrize("onchip", [True, False], ids=["state_in_registers", "workspace"])
def test_nan_rules_off_every_path(monkeypatch, onchip):
    """math.md 8.1 where alpha alone would not carry the NaN to the end. ``modified`` with
    (T_b, U_b) = (4, 2): node (3, 0) cannot reach the end (two labels, one frame left), so
    the blank arc (2, 0) -> (3, 0) lies on no complete path; its NaN (log-prob mode) still
    makes log P NaN (the alpha program's NaN flag: raised by a NaN weight in the workspace
    pass, by a NaN alpha at a node of the region with the state in registers). Node (3, 0)
    itself has no arc at all: a NaN row there (fused) changes nothing, and its gradient row
    is 0, not 0 * NaN. Both lattice passes (``gpu.LATTICE_ONCHIP``)."""
    monkeypatch.setattr(gpu, "LATTICE_ONCHIP", onchip)
    topo, blank = topology.modified(), 0
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 4, 3, 5, generator=g, dtype=torch.float64)
    targets = torch.tensor([[2, 1]])
    tl, ul = torch.tensor([4]), torch.tensor([2])
    up = torch.tensor([1.0], dtype=torch.float64)
    x = torch.log_softmax(logits, -1)
    x[0, 2, 0, blank] = float("nan")
    ref = reference_costs_grad(x, targets, tl, ul, topo, blank, dict(fused=False), up)
    costs, grad = triton_costs_grad(x, targets, tl, ul, topo, blank, dict(fused=False), up)
    assert torch.isnan(ref[0]).all() and torch.isnan(costs).all()
    assert torch.equal(torch.isnan(grad), torch.isnan(ref[1])) and torch.isnan(grad).any()
    x = logits.clone()
    x[0, 3, 0, :] = float("nan")
    ref = reference_costs_grad(x, targets, tl, ul, topo, blank, {}, up)
    costs, grad = triton_costs_grad(x, targets, tl, ul, topo, blank, {}, up)
    assert torch.isfinite(ref[0]).all()
    check(costs, grad, *ref, torch.float64)
    assert (grad[0, 3, 0] == 0).all()


def test_float16_logits():
    """float16 logits are read as they are (the lattice is float64): the gradient, written
    in float16, agrees to its rounding; the costs are float32."""
    for topo_name in ("tdt012", "multiblank"):
        logits, targets, tl, ul, topo, blank, _ = inputs(RAGGED, topo_name, {})
        x16 = logits.half()
        up = upstream_weights(2)
        ref_costs, ref_grad = reference_costs_grad(x16, targets, tl, ul, topo, blank, {}, up)
        costs, grad = triton_costs_grad(x16, targets, tl, ul, topo, blank, {}, up.float())
        assert costs.dtype == torch.float32 and grad.dtype == torch.float16
        assert rel_err(costs, ref_costs) <= 1e-6
        assert rel_err(grad, ref_grad) <= 2 * torch.finfo(torch.float16).eps


# --------------------------------------------------------------------------- node_rows layouts
def packed(logits, tl, ul):
    """Packed rows ``(sum_b T_b (U_b+1), V)``, row ``offset_b + t (U_b+1) + u``, and the
    ``(B, T, U+1)`` map (-1 off each lattice)."""
    B, T, U1, _ = logits.shape
    mask = _layout.node_mask(tl, ul, T, U1)
    node_rows = torch.full((B, T, U1), -1, dtype=torch.int64)
    node_rows[mask] = torch.arange(int(mask.sum()))          # row-major (b, t, u) order
    return logits[mask].contiguous(), node_rows, mask


@pytest.mark.parametrize("option", ["plain", "logprob", "boundary"])
@pytest.mark.parametrize("topo_name", ["regular", "constrained", "multiblank", "tdt012"])
def test_packed_rows(topo_name, option):
    """Packed logits give the padded losses and the padded gradient's rows (the padded
    layout's own agreement is ``test_loss_and_gradient``)."""
    opts = OPTIONS[option]
    logits, targets, tl, ul, topo, blank, bnd = inputs(RAGGED, topo_name, opts)
    up = upstream_weights(2)
    ref_costs, ref_grad = reference_costs_grad(logits, targets, tl, ul, topo, blank, opts, up, bnd)
    rows, node_rows, mask = packed(logits, tl, ul)
    costs, grad = triton_costs_grad(rows, targets, tl, ul, topo, blank, opts, up,
                                    boundary=bnd, node_rows=node_rows)
    assert grad.shape == rows.shape
    check(costs, grad, ref_costs, ref_grad[mask], torch.float64)


def pruned(logits, s_begin, R):
    """Pruned windows: ``(B*T*R, V)`` rows, row ``(b T + t) R + k`` holding node
    ``(t, s_begin[b, t] + k)``, the map, and the padded logits with every node outside
    the windows -inf (the same lattice: a node without a row has -inf arcs)."""
    B, T, U1, V = logits.shape
    ranges = s_begin[..., None] + torch.arange(R)                     # (B, T, R)
    node_rows = torch.full((B, T, U1), -1, dtype=torch.int64)
    rows_id = torch.arange(B * T * R).view(B, T, R)
    node_rows.scatter_(2, ranges, rows_id)
    rows = torch.gather(logits, 2, ranges[..., None].expand(B, T, R, V)).reshape(B * T * R, V)
    inside = node_rows >= 0
    return rows.contiguous(), node_rows, ranges, logits.masked_fill(~inside[..., None], float("-inf"))


@pytest.mark.parametrize("topo_name", ["regular", "modified", "constrained", "multiblank", "tdt012"])
def test_pruned_windows(topo_name):
    """Windows of R = 2 label positions: the loss of the padded lattice restricted to the
    windows, and its gradient gathered at the windows; rows of padding nodes get 0."""
    opts = dict(fastemit_lambda=0.2, clamp=0.3, sigma=0.02)
    logits, targets, tl, ul, topo, blank, _ = inputs(RAGGED, topo_name, opts)
    B, T, U1, _ = logits.shape
    R = 2
    s_begin = torch.tensor([[0, 0, 1, 1, 2, 2], [0, 0, 1, 2, 2, 2]])     # monotone, <= U1 - R
    rows, node_rows, ranges, restricted = pruned(logits, s_begin, R)
    up = upstream_weights(B)
    ref_costs, ref_grad = reference_costs_grad(restricted, targets, tl, ul, topo, blank, opts, up)
    costs, grad = triton_costs_grad(rows, targets, tl, ul, topo, blank, opts, up,
                                    node_rows=node_rows)
    want = torch.gather(ref_grad, 2, ranges[..., None].expand(*ranges.shape, ref_grad.shape[-1]))
    check(costs, grad, ref_costs, want.reshape(grad.shape), torch.float64)
    assert torch.isfinite(grad).all()       # NaN padding rows are never read


# --------------------------------------------------------------------------- public layer
@pytest.mark.parametrize("kind", ["modified", "tdt", "multiblank"])
def test_public_functions_run_the_kernels(kind):
    """``backend="triton"`` is accepted for every topology (``gpu.supports``) and matches
    ``backend="torch"``."""
    g = torch.Generator().manual_seed(5)
    B, T, U, V = 2, 4, 2, 6
    tl, ul = torch.tensor([4, 3]), torch.tensor([2, 1])
    targets = torch.randint(0, 3, (B, U), generator=g)
    out = {}
    for backend in ("triton", "torch"):
        g = torch.Generator().manual_seed(6)
        if kind == "tdt":
            x = torch.randn(B, T, U + 1, V + 3, generator=g, dtype=torch.float64).requires_grad_()
            loss = rnnt_lattice.tdt_loss(x, targets, tl, ul, blank=V - 1, durations=[0, 1, 2],
                                         sigma=0.05, backend=backend)
        elif kind == "multiblank":
            x = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64).requires_grad_()
            loss = rnnt_lattice.multiblank_rnnt_loss(x, targets, tl, ul, blank=V - 1,
                                                     big_blank_durations=[2, 3], backend=backend)
        else:
            x = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64).requires_grad_()
            loss = rnnt_lattice.rnnt_loss(x, targets + 1, tl, ul, blank=0, rnnt_type=kind,
                                          delay_penalty=0.1, backend=backend)
        loss.backward()
        out[backend] = (loss.detach(), x.grad)
    assert rel_err(out["triton"][0], out["torch"][0]) <= 1e-12
    assert rel_err(out["triton"][1], out["torch"][1]) <= 1e-12
