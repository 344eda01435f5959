"""The Numba helpers the CPU kernels are built from (``cpu.fastmath``): the vectorised exp,
the row max, the row exps stored in place; the gradient buffer's reuse."""
from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")
from rnnt_lattice.cpu import fastmath  # noqa: E402


@numba.njit(cache=False)
def _apply_exp(x, out):
    for i in range(x.shape[0]):
        out[i] = fastmath.exp_nonpos(x[i])


@numba.njit(cache=False)
def _row_maxes(x, out):
    for i in range(x.shape[0]):
        out[i] = fastmath.row_max(x[i])


# Relative error bound of exp_nonpos per dtype (a couple of units in the last place).
EXP_TOL = {np.float32: 2 * np.finfo(np.float32).eps, np.float64: 4 * np.finfo(np.float64).eps}
# Below these, exp is flushed to 0 (it cannot move a row sum that is >= 1).
FLUSH = {np.float32: -87.0, np.float64: -708.0}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_exp_nonpos_accuracy_and_specials(dtype):
    x = np.concatenate([-np.logspace(-12, np.log10(-FLUSH[dtype]), 100_000), [0.0, -0.0]]).astype(dtype)
    out = np.empty_like(x)
    _apply_exp(x, out)
    ref = np.exp(x.astype(np.float64))
    rel = np.abs(out.astype(np.float64) - ref) / ref
    assert rel.max() <= EXP_TOL[dtype], rel.max()
    special = np.array([-np.inf, np.nan, FLUSH[dtype] - 0.5, -1e30], dtype=dtype)
    out = np.empty_like(special)
    _apply_exp(special, out)
    assert out[0] == 0 and np.isnan(out[1]) and out[2] == 0 and out[3] == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_row_max(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 37)).astype(dtype) * 100
    x[1] = -np.inf                               # a fully masked row
    x[2, 5:] = -np.inf
    x[3] = -np.abs(x[3])                         # all negative
    x[4, 7] = -0.0
    x[4, :7] = x[4, 8:] = -1.0
    x[5, 3] = np.inf
    x[6, 9] = np.nan                             # NaN wins: that sequence's loss is NaN
    out = np.empty(8, dtype=dtype)
    _row_maxes(x, out)
    want = x.max(axis=1)
    assert np.array_equal(out, want, equal_nan=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_exp_store_in_place(dtype):
    """``exp_store`` into the row itself (in-place mode, its own loop: through two views
    of one row LLVM runs the scalar loop) writes the same exps as into another buffer, and
    the same sum up to the order of its float32 partial sums."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(1000) * 5).astype(dtype)
    x[[3, 700]] = -np.inf
    m = x.max()
    out = np.empty_like(x)
    want = fastmath.exp_store(x, m, out)
    y = x.copy()
    got = fastmath.exp_store(y, m, y)
    assert np.array_equal(y, out)
    assert abs(got - want) <= fastmath.SUM_BLOCK * np.finfo(dtype).eps * want


@pytest.fixture(scope="module")
def row_loop_vectors():
    return fastmath.row_loop_vectors()


@pytest.mark.parametrize("loop", ["exp_sum", "exp_store", "exp_store_in_place"])
def test_row_exp_loops_are_vectorised(loop, row_loop_vectors):
    """The loops over V that every CPU loss runs (a row's exps and their sum, the
    fastmath helpers the kernels call) are vectorised by LLVM for both row dtypes, as the
    helpers' comments require: float64 rows were once scalar (Python's error model put a
    zero-divisor branch in exp_nonpos's division), and float32 rows ran half their lanes
    (the tie count in int64 lanes beside float32 ones). The vector types of the compiled
    function's LLVM IR (``fastmath.row_loop_vectors``, which ``rnnt-lattice check`` reads
    too): float (double) vectors of at least 4 lanes (2 for double: any SIMD x86-64
    machine), and for float32 rows no 64-bit integer vector. On every Numba the package
    allows (CI's floor run has the oldest): the LLVM of Numba 0.59-0.61 left the loop
    scalar while the tie count was a second select (``fastmath.TIES_AS_FLOATS``)."""
    for dtype, name, lanes in (("float32", "float", 4), ("float64", "double", 2)):
        found = row_loop_vectors[loop, dtype]
        widths = [n for n, t in found if t == name]
        assert widths and max(widths) >= lanes, (dtype, sorted(found))
        if dtype == "float32":
            assert not any(t == "i64" for _, t in found), sorted(found)


def test_kernel_cache_follows_every_kernel_module(tmp_path):
    """Numba keys a cached kernel on its own file only: the cache names carry a hash of
    all the kernel modules, so a change to a helper's module (``fastmath``) compiles the
    kernels of the other modules anew instead of loading them with the old helper."""
    import shutil
    from pathlib import Path

    from rnnt_lattice.cpu import _config, kernels
    here = Path(_config.__file__).parent
    assert len(_config.SOURCES) == 12 and _config.SOURCES == _config.sources_hash(str(here))
    for build in (kernels.row_pass.serial, _config._LAUNCHER, _config.frame_ranges):
        assert build.py_func.__qualname__.endswith("_" + _config.SOURCES)
    for p in here.glob("*.py"):
        shutil.copy(p, tmp_path / p.name)
    assert _config.sources_hash(str(tmp_path)) == _config.SOURCES
    (tmp_path / "__init__.py").write_text("# kernels are not here\n")
    assert _config.sources_hash(str(tmp_path)) == _config.SOURCES
    with open(tmp_path / "fastmath.py", "a") as f:
        f.write("# a change\n")
    assert _config.sources_hash(str(tmp_path)) != _config.SOURCES


# --------------------------------------------------------------------------- buffer reuse
import torch  # noqa: E402

import rnnt_lattice  # noqa: E402
from rnnt_lattice import cpu  # noqa: E402
from support.cases import Case, make_inputs, upstream_weights  # noqa: E402

# 2 * 64 * 33 * 256 float32 = 4.3 MB: above the cache's MIN_BYTES.
BIG = Case("big", (64, 50), (32, 20), 256, 0)


def _step(logits, targets, tl, ul, blank):
    x = logits.clone().requires_grad_()
    rnnt_lattice.rnnt_loss(x, targets, tl, ul, blank, backend="numba").backward()
    return x.grad


def test_gradient_buffer_is_reused_only_when_free():
    logits, targets, tl, ul, blank = make_inputs(BIG, torch.float32, poison=False)
    assert logits.numel() * 4 >= cpu._BufferCache.MIN_BYTES
    rnnt_lattice.empty_cache()
    g1 = _step(logits, targets, tl, ul, blank)
    want = g1.clone()
    g2 = _step(logits, targets, tl, ul, blank)          # g1 still held: a new buffer
    assert g2.data_ptr() != g1.data_ptr()
    assert torch.equal(g1, want) and torch.equal(g2, want)
    ptr = g2.data_ptr()
    del g1, g2
    g3 = _step(logits, targets, tl, ul, blank)          # the kept buffer is free again
    assert g3.data_ptr() == ptr and torch.equal(g3, want)
    del g3
    rnnt_lattice.empty_cache()
    assert cpu._buffers.array is None


def test_gradient_buffer_reused_through_a_joiner():
    """In training the gradient of the logits is consumed by the joiner's backward and
    dropped: the next step reuses the buffer with no user action."""
    logits, targets, tl, ul, blank = make_inputs(BIG, torch.float32, poison=False)
    joiner = torch.nn.Linear(256, 256)
    rnnt_lattice.empty_cache()
    ptrs, grads = [], []
    for _ in range(3):
        joiner.zero_grad()
        out = joiner(logits)
        rnnt_lattice.rnnt_loss(out, targets, tl, ul, blank, backend="numba").backward()
        ptrs.append(cpu._buffers.array.ctypes.data)
        grads.append(joiner.weight.grad.clone())
    assert ptrs[0] == ptrs[1] == ptrs[2]
    assert torch.equal(grads[0], grads[2])


def test_gradient_buffer_reuse_can_be_turned_off(monkeypatch):
    logits, targets, tl, ul, blank = make_inputs(BIG, torch.float32, poison=False)
    monkeypatch.setattr(cpu._config, "CACHE_GRAD", False)
    rnnt_lattice.empty_cache()
    g = _step(logits, targets, tl, ul, blank)
    assert cpu._buffers.array is None and torch.isfinite(g).all()


# --------------------------------------------------------------------------- workspaces
# The calls whose O(B*T*(U+1)) arrays come from ``cpu._workspaces``, through the public
# functions with the default backend: the regular fast path, the generic passes (TDT, with
# a k2 boundary; packed rows), the pruned loss's rows and the fused loss's tiles.
def _ws_regular(x, targets, tl, ul, blank):
    return rnnt_lattice.rnnt_loss(x, targets, tl, ul, blank, reduction="none")


def _ws_tdt(x, targets, tl, ul, blank):
    # the last 3 of the V = 6 classes are the durations; the blank is the last token (2)
    targets = torch.where(targets >= 0, targets % 2, targets)
    return rnnt_lattice.tdt_loss(x, targets, tl, ul, blank=2, durations=[0, 1, 2],
                                 reduction="none", sigma=0.05)


def _ws_constrained_boundary(x, targets, tl, ul, blank):
    boundary = torch.stack([torch.zeros_like(tl), torch.zeros_like(tl), ul, tl], 1)
    return rnnt_lattice.rnnt_loss(x, targets, tl, ul, blank, rnnt_type="constrained",
                                  boundary=boundary, reduction="none")


def _ws_packed(x, targets, tl, ul, blank):
    rows = rnnt_lattice.pack_logits(x, tl, ul)
    return rnnt_lattice.rnnt_loss(rows, targets, tl, ul, blank, packed=True, reduction="none")


def _ws_pruned(x, targets, tl, ul, blank):
    B, T, U1, V = x.shape
    s_begin = torch.clamp(torch.arange(T) // 2, max=U1 - 2)            # windows of 2
    ranges = (s_begin[:, None] + torch.arange(2)).expand(B, T, 2).contiguous()
    rows = torch.gather(x, 2, ranges[..., None].expand(B, T, 2, V))
    return rnnt_lattice.rnnt_loss_pruned(rows, targets, ranges, tl, ul, blank=blank,
                                         reduction="none")


def _ws_fused(x, targets, tl, ul, blank):
    # the "logits" are the encoder output; the joiner adds a prediction of zeros
    B, T, U1, V = x.shape
    enc = x[:, :, 0, :]
    pred = torch.zeros(B, U1, V, dtype=x.dtype)
    return rnnt_lattice.fused_rnnt_loss(lambda e, p: e + p, enc, pred, targets, tl, ul,
                                        blank=blank, reduction="none", tile=7)


def _ws_do_rnnt_pruning(x, targets, tl, ul, blank):
    # k2's recipe: am (B, T, V) and lm (B, U+1, V) from the logits, their windows' rows
    # (do_rnnt_pruning's lm rows: a block of their own, free once the sum is formed)
    B, T, U1, V = x.shape
    s_begin = torch.clamp(torch.arange(T) // 2, max=U1 - 2)            # windows of 2
    ranges = (s_begin[:, None] + torch.arange(2)).expand(B, T, 2).contiguous()
    am_p, lm_p = rnnt_lattice.do_rnnt_pruning(x[:, :, 0], x[:, 0], ranges)
    return rnnt_lattice.rnnt_loss_pruned(am_p + lm_p, targets, ranges, tl, ul, blank=blank,
                                         reduction="none")


WORKSPACE_CALLS = {"regular": _ws_regular, "tdt": _ws_tdt,
                   "constrained_boundary": _ws_constrained_boundary, "packed": _ws_packed,
                   "pruned": _ws_pruned, "fused": _ws_fused,
                   "do_rnnt_pruning": _ws_do_rnnt_pruning}
# Claims a call makes: the fused loss's whole-lattice arrays and tile scratch; the lm rows
# and the pruned loss's arrays; the others one block of arrays.
WORKSPACE_CLAIMS = {"fused": 2, "do_rnnt_pruning": 2}
# B = 3, T = 5, U = 3, V = 6 and B = 2, T = 7, U = 4, V = 6: calls of two sizes
WS_CASES = [Case("ws_a", (5, 3, 4), (3, 1, 2), 6, 0), Case("ws_b", (7, 6), (4, 2), 6, 0)]


@pytest.fixture
def workspaces(monkeypatch):
    """Every call's arrays from the workspaces (the tests' lattices are below MIN_BYTES),
    none kept before and after; ``made`` records, per claim, whether the block was new
    (kept or not) and whether it is kept."""
    monkeypatch.setattr(cpu._Workspaces, "MIN_BYTES", 0)
    rnnt_lattice.empty_cache()
    made = []
    claim = cpu._Workspaces._claim

    def spy(self, nbytes):
        before = [id(b) for b in self.blocks]       # ids only: a reference would be a user
        block = claim(self, nbytes)
        made.append((id(block) not in before, any(b is block for b in self.blocks)))
        return block

    monkeypatch.setattr(cpu._Workspaces, "_claim", spy)
    yield made
    rnnt_lattice.empty_cache()


def _ws_step(call, inputs, weights):
    """Per-sequence losses and the gradient of ``sum(weights * losses)``; the loss tensor is
    returned too, so that its graph (and its workspace block) can be kept alive."""
    logits, targets, tl, ul, blank = inputs
    x = logits.clone().requires_grad_()
    loss = call(x, targets, tl, ul, blank)
    return loss, x, weights.to(loss.dtype)


@pytest.mark.parametrize("name", list(WORKSPACE_CALLS))
def test_workspaces_alternate_in_a_training_loop(name, workspaces, monkeypatch):
    """A training loop binds the next step's loss while the previous graph is alive: the
    first step makes a block per claim (the fused loss claims two, its scratch free after
    the forward; do_rnnt_pruning's rows another, free once the joiner has used them), the
    second at least one more (the first step's graph holds its arrays), every later step
    takes blocks the steps before left free (no new block), and every step's losses and
    gradients are bit for bit those of arrays allocated anew."""
    call = WORKSPACE_CALLS[name]
    inputs = make_inputs(WS_CASES[0], torch.float64, seed=0)
    weights = upstream_weights(3)
    got, loss = [], None
    for _ in range(5):
        loss, x, w = _ws_step(call, inputs, weights)   # the previous loss is bound until here
        (loss * w).sum().backward()
        got.append((loss.detach(), x.grad))
    claims = len(workspaces) // 5
    assert claims == WORKSPACE_CLAIMS.get(name, 1) and len(workspaces) == 5 * claims
    assert all(new for new, _ in workspaces[:claims]), workspaces                # new blocks
    assert any(new for new, _ in workspaces[claims:2 * claims]), workspaces
    assert not any(new for new, _ in workspaces[2 * claims:]), workspaces
    assert all(kept for _, kept in workspaces)
    monkeypatch.setattr(cpu._config, "CACHE_GRAD", False)
    del loss
    loss, x, w = _ws_step(call, inputs, weights)
    (loss * w).sum().backward()
    for l, g in got:
        assert torch.equal(l, loss.detach()) and torch.equal(g, x.grad)


@pytest.mark.parametrize("name", list(WORKSPACE_CALLS))
def test_workspaces_in_use_are_never_handed_out(name, workspaces, monkeypatch):
    """Five graphs alive at once (more than the kept blocks), of two sizes in turn (a small
    call in a large free block, a large one replacing a small free block); each backward,
    in reverse order, gives the gradients of the same call alone with arrays allocated
    anew, bit for bit."""
    call = WORKSPACE_CALLS[name]
    calls = [(make_inputs(WS_CASES[i % 2], torch.float64, seed=i),
              upstream_weights(WS_CASES[i % 2].B))
             for i in range(5)]
    alive = [_ws_step(call, inputs, weights) for inputs, weights in calls]
    # more graphs than kept blocks: the last calls' blocks are not kept
    assert len(cpu._workspaces.blocks) == cpu._Workspaces.SLOTS
    assert not all(kept for _, kept in workspaces) and not workspaces[-1][1]
    got = [None] * len(calls)
    for i in reversed(range(len(calls))):
        loss, x, w = alive[i]
        (loss * w).sum().backward()
        got[i] = (loss.detach(), x.grad)
    del alive, loss, x
    # all free now, one call at a time: each takes a free block that fits, or replaces one
    for (inputs, weights), (l, g) in zip(calls, got):
        loss, x, w = _ws_step(call, inputs, weights)
        (loss * w).sum().backward()
        assert torch.equal(l, loss.detach()) and torch.equal(g, x.grad)
    assert len(cpu._workspaces.blocks) == cpu._Workspaces.SLOTS
    monkeypatch.setattr(cpu._config, "CACHE_GRAD", False)
    for (inputs, weights), (l, g) in zip(calls, got):
        loss, x, w = _ws_step(call, inputs, weights)
        (loss * w).sum().backward()
        assert torch.equal(l, loss.detach()) and torch.equal(g, x.grad)
    rnnt_lattice.empty_cache()
    assert cpu._workspaces.blocks == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_rows_select_reuses_its_block_once_free(dtype):
    """``cpu.rows_select`` (do_rnnt_pruning's rows of lm, 300 KiB and more: a workspace
    block) gives ``index_select``'s values bit for bit in every dtype, from strided rows
    too; its block comes back once the result and its views are gone, never while one is
    alive (a second result elsewhere, the first one unchanged); small results are new
    tensors; ``empty_cache`` releases the block."""
    cpu.empty_cache()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 2 * 512, generator=g).to(dtype)[:, ::2]        # (40, 512), strided
    index = torch.randint(0, 40, (600,), generator=g)
    want = x.index_select(0, index)
    first = cpu.rows_select(x, index)
    assert first.dtype == dtype and torch.equal(first, want)
    ptr = first.data_ptr()
    view = first[3:].view(-1)                            # a view keeps the block busy
    del first
    second = cpu.rows_select(x, index)
    assert second.data_ptr() != ptr and torch.equal(view, want[3:].view(-1))
    assert torch.equal(second, want)
    del view, second                                     # both free: reused
    assert cpu.rows_select(x, index).data_ptr() == ptr
    small = cpu.rows_select(x, index[:4])
    assert torch.equal(small, want[:4]) and small.data_ptr() != ptr
    cpu.empty_cache()
    assert cpu._workspaces.blocks == []


@pytest.mark.parametrize("mix", [False, True], ids=["simple", "smoothed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("U1", [7, 1])
def test_arc_terms_kernels_are_the_reference(mix, dtype, U1):
    """The simple losses' arc log-probs and their backward on the Numba kernels
    (``cpu.arc_terms``, what the CPU runs) against the reference
    (``support.simple_parts.check_arc_terms``); U = 0."""
    from support.simple_parts import check_arc_terms
    check_arc_terms(cpu, dtype, U1, mix)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "transposed"])
def test_simple_rows_kernels_are_the_reference(dtype, contiguous):
    """The simple losses' rows and their backward on the Numba kernels (``cpu.simple_rows``)
    against the reference (``support.simple_parts.check_simple_rows``: the subnormal
    exponentials too, which the vectorised exp flushes and the kernel computes apart)."""
    from support.simple_parts import check_simple_rows
    check_simple_rows(cpu, dtype, contiguous)


# --------------------------------------------------------------------------- lattice spans
def _skip_topology():
    """A topology whose kind of dt = 2 moves u only (label (2, 1)) beside the blank (1, 0)
    and the label (0, 1): its arcs from two frames back may land left of every arc of the
    frame before (``kernels._term_span``'s source u - 1)."""
    from rnnt_lattice.topology import ArcKind, Topology
    return Topology("skip", (ArcKind("blank", 1, 0, "blank", may_end=True),
                             ArcKind("label", 0, 1, "label"),
                             ArcKind("label2", 2, 1, "label")))


@pytest.mark.parametrize("topo_name", ["regular", "modified", "constrained", "multiblank",
                                       "tdt012", "tdt13", "skip"])
@pytest.mark.parametrize("layout", ["dense", "windows", "scattered"])
def test_lattice_rows_over_their_arcs(topo_name, layout):
    """``kernels.lattice`` runs each row of alpha and beta over the nodes where a value may
    be finite (``_frame_arcs``, ``_alpha_span``) and the occupations over the nodes with an
    arc; elsewhere they keep -inf and 0. Against the float64 reference
    (``reference.lattice``) on the same weights, with a k2 boundary on one sequence:
    alpha, beta, log P and the occupations, for arcs on every node of the region (dense),
    on windows of R nodes a frame moving right by 0-2 positions (the pruned loss's layout:
    a complete path exists), and on windows anywhere (scattered: left of the frame
    before's too, so that a du = 1 arc from two frames back lands left of every other)."""
    from rnnt_lattice import reference
    from rnnt_lattice.cpu import kernels
    from rnnt_lattice._types import Ends
    from support.topologies import TOPOLOGIES
    topo, blank = (_skip_topology(), 0) if topo_name == "skip" else TOPOLOGIES[topo_name](6, 0)
    g = torch.Generator().manual_seed(len(topo_name) + 7 * len(layout))
    B, T, U1, R = 3, 14, 10, 3
    K = len(topo.kinds)
    ends = Ends(torch.tensor([0, 0, 2]), torch.tensor([0, 0, 1]), torch.tensor([14, 11, 13]),
                torch.tensor([9, 7, 8]), True)
    w = torch.randn(B, K, T, U1, generator=g, dtype=torch.float64) - 1.0
    w = torch.where(reference.arc_mask(topo, ends, T, U1), w, float("-inf"))
    if layout != "dense":
        keep = torch.zeros(B, T, U1, dtype=torch.bool)
        for b in range(B):
            t0, u0, t1, u1 = (int(x[b]) for x in (ends.t0, ends.u0, ends.t1, ends.u1))
            for t in range(t0, t1):
                if layout == "windows":   # from u0 to u1 - R + 1 in steps of 0..2
                    s = u0 + -(-(t - t0) * (u1 - R + 1 - u0) // (t1 - 1 - t0))
                else:
                    s = int(torch.randint(u0, u1 - R + 2, (1,), generator=g))
                keep[b, t, s:s + R] = True
        w = torch.where(keep[:, None], w, float("-inf"))
    want = reference.lattice(w, topo, ends)
    if layout != "scattered":
        assert torch.isfinite(want.log_like).all()
    kinds = kernels.kind_table(topo, blank)
    nan_row = np.zeros((B, T), dtype=np.uint8)
    np_ends = tuple(np.ascontiguousarray(x.numpy()) for x in (ends.t0, ends.u0, ends.t1, ends.u1))
    alpha, beta, log_like, gamma = cpu._lattice(np.ascontiguousarray(w.numpy()), nan_row, kinds,
                                                np_ends)
    torch.testing.assert_close(torch.from_numpy(log_like), want.log_like, rtol=1e-12, atol=0)
    for got, ref in ((alpha, want.alpha), (beta, want.beta), (gamma, want.gamma)):
        torch.testing.assert_close(torch.from_numpy(got), ref, rtol=1e-11, atol=1e-300)


# --------------------------------------------------------------------------- frame ranges
def _frame_costs(t0s, u0s, t1s, u1s, node_rows, T, U1, f0, f1):
    """Each frame's work in memory order, as ``_config.frame_ranges`` states it: a node with
    a row costs 1 in its sequence's region and ``PAD_COST`` outside it; the frames ``f0 <= t
    < f1`` of each sequence."""
    from rnnt_lattice.cpu._config import PAD_COST
    B = len(t0s)
    t = np.arange(T)[None, :, None]
    u = np.arange(U1)[None, None, :]
    inside = ((t >= t0s[:, None, None]) & (t < t1s[:, None, None])
              & (u >= u0s[:, None, None]) & (u <= u1s[:, None, None]))
    has_row = np.ones((B, T, U1), dtype=bool) if node_rows.shape[0] == 0 else node_rows >= 0
    return (has_row * np.where(inside, 1.0, PAD_COST)).sum(-1)[:, f0:f1].reshape(-1)


def _frame_layouts():
    """``{name: (t0s, u0s, t1s, u1s, node_rows, T, U1, f0, f1)}``: the padded layout (every
    node a row) even and ragged, packed rows (none in the padding), the pruned loss's
    windows of 2 rows a frame, one tile's rows (frames 2-4 of every sequence) over its
    frames and over all, no rows at all."""
    T, U1 = 8, 4
    i64 = lambda *v: np.array(v, dtype=np.int64)             # noqa: E731
    zeros = i64(0, 0, 0, 0)
    none = np.empty((0, 0, 0), dtype=np.int64)
    rag = (zeros, zeros, i64(8, 1, 1, 1), i64(3, 3, 3, 3))    # one long sequence, three short
    t = np.arange(T)[None, :, None]
    u = np.arange(U1)[None, None, :]
    inside = (t < rag[2][:, None, None]) & (u <= rag[3][:, None, None])
    packed = np.where(inside, 1, -1).astype(np.int64)
    windows = np.where(inside & (u >= (t // 3)) & (u < (t // 3) + 2), 1, -1).astype(np.int64)
    tile = np.full((4, T, U1), -1, dtype=np.int64)
    tile[:, 2:5] = 1
    return {"padded": (zeros, zeros, i64(8, 8, 8, 8), i64(3, 3, 3, 3), none, T, U1, 0, T),
            "padded_ragged": (*rag, none, T, U1, 0, T),
            "packed": (*rag, packed, T, U1, 0, T),
            "windows": (*rag, windows, T, U1, 0, T),
            "tile": (*rag, tile, T, U1, 2, 5),
            "tile_all_frames": (*rag, tile, T, U1, 0, T),
            "no_rows": (*rag, np.full((4, T, U1), -1, dtype=np.int64), T, U1, 0, T)}


@pytest.mark.parametrize("parts", [1, 2, 3, 8, 1000])
@pytest.mark.parametrize("layout", list(_frame_layouts()))
def test_frame_ranges_split_the_frames_in_order_by_their_work(layout, parts):
    """``_config.frame_ranges``: min(parts, B W) ranges of the window's W frames a sequence
    in memory order that cover each of them once, each within one frame's work of an even
    share (a split by frame counts misses that on the ragged layouts: the long sequence's
    frames weigh 4 nodes, the padding's 1)."""
    from rnnt_lattice.cpu._config import frame_ranges
    args = _frame_layouts()[layout]
    bounds = frame_ranges(parts, *args)
    cost = _frame_costs(*args)
    n = min(parts, cost.size)
    assert bounds.dtype == np.int64 and bounds.shape == (n + 1,)
    assert bounds[0] == 0 and bounds[-1] == cost.size and (np.diff(bounds) >= 0).all()
    work = [cost[bounds[p]:bounds[p + 1]].sum() for p in range(n)]
    assert max(work) <= cost.sum() / n + cost.max() + 1e-9, (bounds, work)


def test_row_parts_is_the_parallel_launch_thread_count(monkeypatch):
    """A row kernel runs one range of frames a thread: ``row_parts`` is Numba's thread count
    of the calling thread (``numba.set_num_threads``), 1 where the serial variants run."""
    from rnnt_lattice.cpu import _config
    x, y, T_b, U_b, blank = make_inputs(Case("c", (3, 2), (1, 2), 5, 0), torch.float32)
    rnnt_lattice.rnnt_loss(x, y, T_b, U_b, blank)            # the pool is started
    before = numba.get_num_threads()
    try:
        for k in range(1, numba.config.NUMBA_NUM_THREADS + 1):
            numba.set_num_threads(k)
            assert _config.row_parts() == k
    finally:
        numba.set_num_threads(before)
    monkeypatch.setattr(_config, "PARALLEL", False)
    assert _config.row_parts() == 1
    monkeypatch.setattr(_config, "PARALLEL", True)
    monkeypatch.setattr(_config, "FORKED", True)
    assert _config.row_parts() == 1


@pytest.mark.parametrize("name", ["rnnt_loss", "rnnt_loss log-prob mode",
                                  "rnnt_loss clamp, FastEmit", "rnnt_loss constrained, boundary",
                                  "tdt_loss", "multiblank_rnnt_loss", "packed",
                                  "pruned pipeline, k2's windows", "fused_rnnt_loss, Joiner"])
def test_any_split_of_the_frames_gives_the_same_bits(name, monkeypatch):
    """The row and gradient passes give every frame the same work whichever thread takes it
    and however the frames are split (``_config.row_parts`` ranges): the public calls on the
    CPU backend (the regular fast path, the generic kernels, packed rows, windows, the
    fused loss's tiles) give the same bits with 1, 2, 3 and 7 ranges (more ranges than
    threads: the threads take several in turn)."""
    import contextlib
    from rnnt_lattice.cpu import _config
    from support.public_calls import CASES

    def split(k):
        @contextlib.contextmanager
        def on():
            with monkeypatch.context() as m:
                m.setattr(_config, "row_parts", lambda: k)
                yield
        return on

    want = CASES[name](split(1))
    for k in (2, 3, 7):
        got = CASES[name](split(k))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
