"""Lattice tools: occupancy, best alignment, prune coverage and the plot module.

Oracle: a float64 brute-force enumeration of every alignment path of tiny lattices (written
here, independent of the library), and the pure-PyTorch backend for larger ones.
"""
from __future__ import annotations

import itertools
import math
import re
import struct

import numpy as np
import pytest
import torch

import rnnt_lattice
from rnnt_lattice.analysis.alignment import backtrack_arcs
from support import backends, cases
from support.sync import RecordOps, syncing

BACKENDS = backends.CPU

CASES = {c.name: c for c in cases.TOOLS}


def _case(name, dtype=torch.float64, seed=0, poison=True):
    case = CASES[name]
    tl, ul, blank = list(case.T_lens), list(case.U_lens), case.blank
    _, T, U, V = case.shape
    g = torch.Generator().manual_seed(seed)
    B = len(tl)
    logits = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64) * 2
    blank_id = blank % V
    labels = [v for v in range(V) if v != blank_id]
    targets = torch.tensor(labels)[torch.randint(0, len(labels), (B, U), generator=g)]
    tl, ul = torch.tensor(tl), torch.tensor(ul)
    if poison:
        # NaN in every padded logit and garbage in padded targets: must never be read.
        t = torch.arange(T)[None, :, None]
        u = torch.arange(U + 1)[None, None, :]
        pad = (t >= tl[:, None, None]) | (u > ul[:, None, None])
        logits = torch.where(pad[..., None], float("nan"), logits)
        targets = torch.where(torch.arange(U)[None] >= ul[:, None], -7, targets)
    return logits.to(dtype), targets, tl, ul, blank


# --------------------------------------------------------------------------- brute force
def _paths(T_b, U_b):
    """Every path as a list of arcs ("b"/"l", t, u), the final blank included."""
    for label_slots in itertools.combinations(range(T_b - 1 + U_b), U_b):
        arcs, t, u = [], 0, 0
        for i in range(T_b - 1 + U_b):
            if i in label_slots:
                arcs.append(("l", t, u))
                u += 1
            else:
                arcs.append(("b", t, u))
                t += 1
        arcs.append(("b", t, u))
        yield arcs


def brute_force(logits, targets, T_b, U_b, blank, fused=True):
    """log P, best path (log-prob, emit frames) and node occupancy (T_b, U_b+1), float64."""
    x = logits[:T_b, : U_b + 1].double()
    lp = torch.log_softmax(x, -1) if fused else x
    scores, paths = [], []
    for arcs in _paths(T_b, U_b):
        s = sum(float(lp[t, u, blank if k == "b" else targets[u]]) for k, t, u in arcs)
        scores.append(s)
        paths.append(arcs)
    log_p = torch.logsumexp(torch.tensor(scores, dtype=torch.float64), 0).item()
    best = max(range(len(scores)), key=lambda i: scores[i])
    emit = [t for k, t, u in paths[best] if k == "l"]
    occ = torch.zeros(T_b, U_b + 1, dtype=torch.float64)
    for s, arcs in zip(scores, paths):
        for _, t, u in arcs:
            occ[t, u] += math.exp(s - log_p)
    second = sorted(scores)[-2] if len(scores) > 1 else -math.inf
    return log_p, scores[best], emit, occ, scores[best] - second


def _tol(dtype):
    return {torch.float64: 1e-10, torch.float32: 1e-5}[dtype]


# --------------------------------------------------------------------------- occupancy
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_occupancy_matches_brute_force_and_invariants(name, backend):
    logits, targets, tl, ul, blank = _case(name)
    occ = rnnt_lattice.occupancy(logits, targets, tl, ul, blank=blank, backend=backend)
    B, T, U1 = occ.node.shape
    V = logits.shape[-1]
    assert occ.gamma_blank.shape == occ.gamma_label.shape == (B, T, U1)
    for b in range(B):
        T_b, U_b = int(tl[b]), int(ul[b])
        log_p, _, _, node_bf, _ = brute_force(logits[b], targets[b], T_b, U_b, blank % V)
        assert occ.log_likelihood[b].item() == pytest.approx(log_p, abs=1e-10)
        torch.testing.assert_close(occ.node[b, :T_b, : U_b + 1], node_bf, atol=1e-10, rtol=0)
        # math.md section 3 invariants
        torch.testing.assert_close(occ.gamma_blank[b, :T_b].sum(-1),
                                   torch.ones(T_b, dtype=torch.float64), atol=1e-10, rtol=0)
        torch.testing.assert_close(occ.gamma_label[b, :, :U_b].sum(0),
                                   torch.ones(U_b, dtype=torch.float64), atol=1e-10, rtol=0)
        assert (occ.gamma_label[b, :, U_b] == 0).all()
    assert ((occ.node >= 0) & (occ.node <= 1 + 1e-12)).all()
    torch.testing.assert_close(occ.node, occ.gamma_blank + occ.gamma_label)
    pad = ~rnnt_lattice._layout.node_mask(tl, ul, T, U1)
    for x in (occ.node, occ.gamma_blank, occ.gamma_label):
        assert (x[pad] == 0).all() and not torch.isnan(x).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_occupancy_log_prob_mode_and_float32(backend):
    logits, targets, tl, ul, blank = _case("ragged_batch", poison=False)
    lp = torch.log_softmax(logits, -1)
    ref = rnnt_lattice.occupancy(logits, targets, tl, ul, blank=blank, backend="torch")
    occ = rnnt_lattice.occupancy(lp, targets, tl, ul, blank, False, backend=backend)
    torch.testing.assert_close(occ.node, ref.node, atol=1e-10, rtol=0)
    occ32 = rnnt_lattice.occupancy(logits.float(), targets, tl, ul, blank=blank, backend=backend)
    torch.testing.assert_close(occ32.node, ref.node, atol=_tol(torch.float32) * 10, rtol=0)
    torch.testing.assert_close(occ32.log_likelihood, ref.log_likelihood, atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_impossible_sequence_has_no_mass_and_no_path(backend):
    logits, targets, tl, ul, blank = _case("ragged_batch")
    tl = tl.clone()
    tl[1] = 0                                                 # no frame: no path
    occ = rnnt_lattice.occupancy(logits, targets, tl, ul, blank=blank, backend=backend)
    assert occ.log_likelihood[1] == float("-inf")
    assert (occ.node[1] == 0).all()
    ali = rnnt_lattice.best_alignment(logits, targets, tl, ul, blank=blank, backend=backend)
    assert ali.log_prob[1] == float("-inf")
    assert (ali.emit_frames[1] == -1).all()
    assert ali.frame_labels[1] == [] and ali.path(1) == []
    assert torch.isfinite(ali.log_prob[[0, 2]]).all()


# --------------------------------------------------------------------------- alignment
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_alignment_matches_brute_force(name, backend, seed):
    logits, targets, tl, ul, blank = _case(name, seed=seed)
    V = logits.shape[-1]
    ali = rnnt_lattice.best_alignment(logits, targets, tl, ul, blank=blank, backend=backend)
    occ = rnnt_lattice.occupancy(logits, targets, tl, ul, blank=blank, backend=backend)
    B, U = targets.shape
    assert ali.emit_frames.shape == (B, U) and ali.emit_frames.dtype == torch.int64
    for b in range(B):
        T_b, U_b = int(tl[b]), int(ul[b])
        _, best, emit, _, margin = brute_force(logits[b], targets[b], T_b, U_b, blank % V)
        assert ali.log_prob[b].item() == pytest.approx(best, abs=1e-10)
        assert ali.log_prob[b] <= occ.log_likelihood[b] + 1e-12
        if margin > 1e-9:                                       # unique best path
            assert ali.emit_frames[b, :U_b].tolist() == emit
        frames = ali.emit_frames[b, :U_b]
        assert (frames[1:] >= frames[:-1]).all() and ((frames >= 0) & (frames < T_b)).all()
        assert (ali.emit_frames[b, U_b:] == -1).all()
        # frame_labels: T_b lists whose concatenation is the target sequence
        assert len(ali.frame_labels[b]) == T_b
        assert sum(ali.frame_labels[b], []) == targets[b, :U_b].tolist()
        path = ali.path(b)
        assert path[0] == (0, 0) and path[-1] == (T_b - 1, U_b) and len(path) == T_b + U_b
        # the path's log-prob, re-summed along its nodes, is log_prob
        lp = torch.log_softmax(logits[b].double(), -1)
        s = sum(float(lp[t, u, targets[b, u]]) if (t2, u2) == (t, u + 1) else float(lp[t, u, blank])
                for (t, u), (t2, u2) in zip(path, path[1:]))
        s += float(lp[T_b - 1, U_b, blank])
        assert s == pytest.approx(best, abs=1e-10)


def test_backtrack_tie_goes_to_blank_predecessor():
    # All arcs equally likely: every path ties, the rule picks the earliest emissions.
    T, U, V = 4, 2, 3
    logits = torch.zeros(1, T, U + 1, V, dtype=torch.float64)
    for backend in BACKENDS:
        ali = rnnt_lattice.best_alignment(logits, torch.tensor([[1, 2]]), torch.tensor([T]),
                                          torch.tensor([U]), blank=0, backend=backend)
        assert ali.emit_frames.tolist() == [[0, 0]]
        assert ali.log_prob.item() == pytest.approx((T + U) * math.log(1 / 3))


def test_viterbi_torch_and_numba_agree_on_larger_lattices():
    g = torch.Generator().manual_seed(3)
    B, T, U, V = 4, 40, 12, 9
    # float64: the torch backend takes log_softmax in the input dtype, numba in float64.
    logits = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64)
    targets = torch.randint(1, V, (B, U), generator=g)
    tl, ul = torch.tensor([40, 33, 7, 1]), torch.tensor([12, 5, 12, 3])
    from rnnt_lattice import cpu, torch_backend
    from rnnt_lattice._types import Ends, LossOptions
    ends = Ends.of(tl, ul)
    opts = LossOptions(0, True)
    ref = torch_backend.viterbi(logits, targets, tl, ul, opts)
    got = cpu.viterbi(logits, targets, tl, ul, opts)
    assert ref[0].dtype == got[0].dtype == torch.float64
    torch.testing.assert_close(got[0], ref[0], atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(got[2], ref[2], atol=1e-9, rtol=1e-9)
    assert torch.equal(got[1], ref[1])
    paths = [backtrack_arcs(x[1], rnnt_lattice.topology.regular(), ends, x[2]) for x in (ref, got)]
    assert all(torch.equal(a, b) for a, b in zip(*paths))
    ali = rnnt_lattice.best_alignment(logits, targets, tl, ul, blank=0, backend="numba")
    ali_t = rnnt_lattice.best_alignment(logits, targets, tl, ul, blank=0, backend="torch")
    assert torch.equal(ali.emit_frames, ali_t.emit_frames)
    torch.testing.assert_close(ali.log_prob, ali_t.log_prob, atol=1e-6, rtol=0)


def test_numba_loss_unchanged_by_semiring_switch():
    # The loss still equals the torch reference (the lae path of the shared sweep).
    logits, targets, tl, ul, blank = _case("ragged_batch", poison=False)
    a = rnnt_lattice.rnnt_loss(logits, targets, tl, ul, blank, reduction="none", backend="numba")
    b = rnnt_lattice.rnnt_loss(logits, targets, tl, ul, blank, reduction="none", backend="torch")
    torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("bad", ["targets_shape", "blank"])
def test_lattice_tools_validate_arguments(bad):
    logits, targets, tl, ul, blank = _case("ragged_batch", poison=False)
    if bad == "targets_shape":
        targets = targets[:, :-1]
    else:
        blank = 99
    for fn in (rnnt_lattice.occupancy, rnnt_lattice.best_alignment):
        with pytest.raises(ValueError, match="targets" if bad == "targets_shape" else "blank"):
            fn(logits, targets, tl, ul, blank=blank)


# --------------------------------------------------------------------------- coverage
def _coverage_brute(node, U_b, R):
    """Max covered mass over all monotone window-start sequences (enumeration)."""
    T = node.shape[0]
    n_starts = max(0, U_b + 1 - R) + 1
    best = -math.inf
    for s in itertools.product(range(n_starts), repeat=T):
        if any(not 0 <= s[t + 1] - s[t] <= R - 1 for t in range(T - 1)):
            continue
        best = max(best, sum(float(node[t, s[t]: s[t] + R].sum()) for t in range(T)))
    return best


@pytest.mark.parametrize("backend", BACKENDS)
def test_prune_coverage_monotone_reaches_one_and_matches_enumeration(backend):
    logits, targets, tl, ul, blank = _case("ragged_batch", seed=5)
    occ = rnnt_lattice.occupancy(logits, targets, tl, ul, blank=blank, backend=backend)
    R_max = int(ul.max()) + 2
    cov = rnnt_lattice.prune_coverage(occ, max_window=R_max)
    assert cov.window.tolist() == list(range(1, R_max + 1))
    assert cov.per_sequence.shape == (3, R_max) and cov.total.shape == (R_max,)
    assert (cov.total[1:] >= cov.total[:-1] - 1e-12).all()
    assert (cov.per_sequence[:, 1:] >= cov.per_sequence[:, :-1] - 1e-12).all()
    assert ((cov.total > 0) & (cov.total <= 1)).all()
    for b in range(3):
        T_b, U_b = int(tl[b]), int(ul[b])
        assert cov.per_sequence[b, U_b:].tolist() == pytest.approx([1.0] * (R_max - U_b))
        node = occ.node[b, :T_b, : U_b + 1]
        for R in range(1, U_b + 2):
            expect = _coverage_brute(node, U_b, R) / float(node.sum())
            assert cov.per_sequence[b, R - 1].item() == pytest.approx(expect, abs=1e-12)
    assert cov.total[-1].item() == pytest.approx(1.0)
    # the returned window starts satisfy the pruned RNN-T constraints
    steps = cov.s_begin[:, 1:] - cov.s_begin[:, :-1]
    assert ((steps >= 0) & (steps <= R_max - 1)).all()
    assert cov.rows()[0][0] == 1 and len(cov.rows()) == R_max


@pytest.mark.parametrize("backend", BACKENDS)
def test_prune_coverage_of_a_nan_sequence_is_nan(backend):
    """NaN logits inside one sequence's lattice make its occupations NaN: its share and the
    batch's are NaN (as ``PruneRanges.covered``), never a full coverage; the other
    sequences' shares are as without it."""
    logits, targets, tl, ul, blank = _case("ragged_batch", seed=5)
    clean = rnnt_lattice.prune_coverage(
        rnnt_lattice.occupancy(logits, targets, tl, ul, blank=blank, backend=backend), 3)
    poisoned = logits.clone()
    poisoned[1, 0, 0, blank] = float("nan")
    cov = rnnt_lattice.prune_coverage(
        rnnt_lattice.occupancy(poisoned, targets, tl, ul, blank=blank, backend=backend), 3)
    assert torch.isnan(cov.per_sequence[1]).all() and torch.isnan(cov.total).all()
    keep = [0, 2]
    assert torch.equal(cov.per_sequence[keep], clean.per_sequence[keep])


def test_prune_coverage_reads_no_value_on_the_host():
    """``prune_coverage`` on occupations computes without a host read: no synchronisation
    on CUDA, and shapes on the meta device (its batch share was chosen by ``if total > 0``:
    torch's RuntimeError there)."""
    logits, targets, tl, ul, blank = _case("ragged_batch", seed=5)
    occ = rnnt_lattice.occupancy(logits, targets, tl, ul, blank=blank)
    with RecordOps() as rec:
        cov = rnnt_lattice.prune_coverage(occ, 3)
    # (lift_fresh: the Numba window DP's results come back through torch.from_numpy)
    reads = [op for op in syncing(rec.ops) if "lift_fresh" not in op]
    assert reads == [], reads
    meta = rnnt_lattice.occupancy(logits.to("meta"), targets.to("meta"), tl.to("meta"),
                                  ul.to("meta"), blank=blank)
    on_meta = rnnt_lattice.prune_coverage(meta, 3)
    assert on_meta.total.shape == cov.total.shape and on_meta.total.device.type == "meta"


@pytest.mark.parametrize("bad, words", [
    (0, "max_window must be an int >= 1, got 0"), (-1, "got -1"), (2.5, "must be an int, got 2.5"),
    (True, "must be an int, got True"),
    (torch.zeros(2, 5, 3, dtype=torch.long), "got a torch.int64 tensor of shape (2, 5, 3)"),
    ("occ", "occ must be the Occupancy of rnnt_lattice.occupancy, got Tensor"),
])
def test_prune_coverage_rejects_bad_window(bad, words):
    """A bad window or occupancy names itself (a tensor by its shape: its repr was the
    message, whole)."""
    logits, targets, tl, ul, blank = _case("single_3x2")
    occ = rnnt_lattice.occupancy(logits, targets, tl, ul, blank=blank)
    with pytest.raises(ValueError) as err:
        if isinstance(bad, str):
            rnnt_lattice.prune_coverage(occ.node)
        else:
            rnnt_lattice.prune_coverage(occ, max_window=bad)
    assert words in str(err.value), str(err.value)


def test_prune_coverage_takes_integer_like_windows():
    """As for ``blank``: NumPy integers and 0-d integer tensors are ints."""
    import numpy as np
    logits, targets, tl, ul, blank = _case("single_3x2")
    occ = rnnt_lattice.occupancy(logits, targets, tl, ul, blank=blank)
    want = rnnt_lattice.prune_coverage(occ, max_window=3)
    for R in (np.int64(3), torch.tensor(3)):
        got = rnnt_lattice.prune_coverage(occ, max_window=R)
        assert torch.equal(got.per_sequence, want.per_sequence) and torch.equal(got.s_begin, want.s_begin)


# --------------------------------------------------------------------------- plot
def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_plot_occupancy_saves_png_and_svg(tmp_path):
    pytest.importorskip("matplotlib")
    from rnnt_lattice.plot import plot_occupancy, save
    logits, targets, tl, ul, blank = _case("ragged_batch")
    occ = rnnt_lattice.occupancy(logits, targets, tl, ul, blank=blank)
    ali = rnnt_lattice.best_alignment(logits, targets, tl, ul, blank=blank)
    fig, ax = plot_occupancy(occ, 0, ali, labels=["a", "b", "c"], title="t", figsize=(5, 3), dpi=80)
    assert ax.get_xlabel() == "frame t" and ax.get_ylabel() == "label position u"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["∅", "a", "b", "c"]
    (line,) = ax.get_lines()                                   # the best path
    assert list(zip(line.get_xdata(), line.get_ydata())) == ali.path(0)
    save(fig, tmp_path / "o.png")
    save(fig, tmp_path / "o.svg")
    assert _png_size(tmp_path / "o.png") == (400, 240)
    assert "<svg" in (tmp_path / "o.svg").read_text()[:1000]
    with pytest.raises(ValueError, match="labels"):
        plot_occupancy(occ, 0, ali, labels=["a"])
    with pytest.raises(ValueError, match="index"):
        plot_occupancy(occ, 5)
    with pytest.raises(ValueError, match=".png or .svg"):
        save(fig, tmp_path / "o.jpg")
    # (AttributeErrors and matplotlib's own messages before)
    with pytest.raises(ValueError, match=r"fig must be a matplotlib Figure \(plot_occupancy returns"):
        save((fig, ax), tmp_path / "o.png")
    for dpi, message in (("100", "dpi must be a number, got '100'"), (float("nan"), "dpi must not be NaN"),
                         (0, "dpi must be > 0, got 0")):
        with pytest.raises(ValueError, match=re.escape(message)):
            save(fig, tmp_path / "o.png", dpi=dpi)
    with pytest.raises(ValueError, match="ax must be a matplotlib Axes or None, got str"):
        plot_occupancy(occ, 0, ali, ax="abc")
    with pytest.raises(ValueError, match="labels must be a sequence of U_b = 3 strings or None, got int"):
        plot_occupancy(occ, 0, ali, labels=3)
    plot_occupancy(occ, 0, ali, labels=np.array(["a", "b", "c"]))    # (an array of labels)
    save(fig, tmp_path / "o.png", dpi="figure")                       # (matplotlib's value)


@pytest.mark.parametrize("args, message", [
    (("ali", 0), "occ must be an rnnt_lattice.Occupancy"),
    (("occ", 0, "occ"), "alignment must be an rnnt_lattice.Alignment"),
    (("occ", 1.0, "ali"), "index must be an int, got 1.0"),
    (("occ", 0, "shorter"), r"alignment is not of occ's batch: sequence 0 has \(T_b, U_b\)"),
    (("occ", 0, "first"), "alignment is not of occ's batch: B = 1 there"),
    (("occ", 2, "ali"), r"sequence 2 has no frames \(T_b = 0\)"),
], ids=["occ_type", "alignment_type", "index_float", "other_lengths", "other_batch", "T0"])
def test_plot_occupancy_refuses_what_it_cannot_draw(args, message):
    """Another object, an alignment of another batch, a float index, or a sequence without
    frames: a ValueError saying which (not an AttributeError, a silent wrong picture, or
    matplotlib's warnings about an empty axis)."""
    pytest.importorskip("matplotlib")
    from rnnt_lattice.plot import plot_occupancy
    logits, targets, tl, ul, blank = _case("ragged_batch", poison=False)
    tl = tl.clone()
    tl[2] = 0
    made = {"occ": rnnt_lattice.occupancy(logits, targets, tl, ul, blank=blank),
            "ali": rnnt_lattice.best_alignment(logits, targets, tl, ul, blank=blank),
            "shorter": rnnt_lattice.best_alignment(logits, targets, (tl - 1).clamp(min=0), ul,
                                                   blank=blank),
            "first": rnnt_lattice.best_alignment(logits[:1], targets[:1], tl[:1], ul[:1],
                                                 blank=blank)}
    with pytest.raises(ValueError, match=message):
        plot_occupancy(*(made.get(a, a) if isinstance(a, str) else a for a in args))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_are_computed_in_float32(dtype):
    logits, targets, tl, ul, blank = _case("ragged_batch", poison=False)
    ref = rnnt_lattice.occupancy(logits.to(dtype).double(), targets, tl, ul, blank=blank)
    occ = rnnt_lattice.occupancy(logits.to(dtype), targets, tl, ul, blank=blank)
    torch.testing.assert_close(occ.node, ref.node, atol=1e-5, rtol=0)
    ali = rnnt_lattice.best_alignment(logits.to(dtype), targets, tl, ul, blank=blank)
    assert torch.isfinite(ali.log_prob).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_logits_poison_only_their_sequence(backend):
    logits, targets, tl, ul, blank = _case("ragged_batch")
    logits = logits.clone()
    logits[0, 1, 1, 2] = float("nan")                          # inside sequence 0's lattice
    ali = rnnt_lattice.best_alignment(logits, targets, tl, ul, blank=blank, backend=backend)
    assert torch.isnan(ali.log_prob[0]) and (ali.emit_frames[0] == -1).all()
    assert ali.frame_labels[0] == [[] for _ in range(int(tl[0]))]
    ref = rnnt_lattice.best_alignment(logits[1:], targets[1:], tl[1:], ul[1:], blank=blank,
                                      backend=backend)
    assert torch.equal(ali.emit_frames[1:], ref.emit_frames)
    torch.testing.assert_close(ali.log_prob[1:], ref.log_prob)
