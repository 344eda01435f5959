"""Lattice tools on every topology and backend: occupancy and best alignment against the
independent path-enumerating oracle (``tests/oracle.py``: nothing of the reference's
recursion) and, for the kernel backends (Numba; Triton through the interpreter, see
``conftest.py``), against the pure-PyTorch reference; the regular topology through the new
options, TDT durations, and a plot per topology."""
from __future__ import annotations

import math

import warnings

import pytest
import torch

import rnnt_lattice
from rnnt_lattice import topology
from rnnt_lattice.analysis import Arc
from support import backends
from support.oracle import _kind_weights, topology_best_path, topology_occupations, topology_paths
from support.topologies import TOPOLOGIES

# NumPy warns (Triton interpreter) on exp/log of -inf in lanes that the kernels mask out.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

BACKENDS, KERNELS = backends.ALL, backends.KERNELS


@pytest.fixture(autouse=True)
def small_tiles(request, monkeypatch):
    """Triton: tiles small enough that every kernel spans several blocks on these lattices."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "triton":
        from rnnt_lattice import gpu
        monkeypatch.setattr(gpu, "BLOCK_U", 2)
        monkeypatch.setattr(gpu, "V_PASS_TILES", {"row": (32, 4), "grad": (32, 4)})
        monkeypatch.setattr(gpu, "BLOCK_NODES", 16)

# name: (topology, V (all classes, durations included), blank), from the shared topology
# table: 5 tokens (TDT: 4 tokens, blank 3, and 3 durations; multi-blank: 6 classes, big
# blanks 4 (d=2) and 3 (d=3) below the blank 5).
def _entry(name, V_tok):
    topo, blank = TOPOLOGIES[name](V_tok, 0)
    return topo, V_tok + topo.n_durations, blank


TOPOS = {"regular": _entry("regular", 5), "modified": _entry("modified", 5),
         "constrained": _entry("constrained", 5), "one_sym_per_frame": _entry("one_sym", 5),
         "multiblank": _entry("multiblank", 6), "tdt": _entry("tdt012", 4)}
# Ragged batch, padded T = 5, U = 3: (1, 2) has no path for modified / one_sym_per_frame.
TL, UL = [5, 3, 4, 1], [2, 2, 0, 2]
T, U = 5, 3


def _batch(name, seed=0):
    topo, V, blank = TOPOS[name]
    g = torch.Generator().manual_seed(seed)
    B = len(TL)
    logits = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64) * 2
    n_labels = 3                                 # label ids 0..2 (below blanks and big blanks)
    labels = [v for v in range(n_labels + 1) if v != blank][:n_labels]
    targets = torch.tensor(labels)[torch.randint(0, n_labels, (B, U), generator=g)]
    tl, ul = torch.tensor(TL), torch.tensor(UL)
    # NaN in every padded logit and garbage in padded targets: must never be read.
    t = torch.arange(T)[None, :, None]
    u = torch.arange(U + 1)[None, None, :]
    pad = (t >= tl[:, None, None]) | (u > ul[:, None, None])
    logits = torch.where(pad[..., None], float("nan"), logits)
    targets = torch.where(torch.arange(U)[None] >= ul[:, None], -7, targets)
    return topo, logits, targets, tl, ul, blank


def _kw(name):
    topo = TOPOS[name][0]
    if name in ("modified", "constrained", "one_sym_per_frame"):
        return dict(rnnt_type=name)              # the named types go through rnnt_type
    return dict(topology=topo)


def _weights(logits, y, topo, blank, t1, sigma=0.0, delay_penalty=0.0):
    V = logits.shape[-1]
    return _kind_weights(torch.nan_to_num(logits, nan=0.0), y, topo,
                         blank % (V - topo.n_durations), True, t1, 0.0, sigma, delay_penalty)


def _oracle_log_p(logits, y, topo, blank, start, end, sigma=0.0, delay_penalty=0.0):
    w = _weights(logits, y, topo, blank, end[0], sigma, delay_penalty)
    paths = topology_paths(topo, start, end)
    scores = sorted(sum(w[k, t, u].item() for t, u, k in p) for p in paths)
    if not scores:
        return -math.inf, -math.inf, -math.inf
    log_p = torch.logsumexp(torch.tensor(scores, dtype=torch.float64), 0).item()
    return log_p, scores[-1], (scores[-2] if len(scores) > 1 else -math.inf)


def _check_occupancy(occ, topo, logits, targets, tl, ul, blank, starts, ends, **terms):
    B = logits.shape[0]
    K = topo.K
    assert occ.gamma.shape == (B, K, T, U + 1) and occ.kinds == tuple(k.name for k in topo.kinds)
    assert occ.topology == topo
    du = torch.tensor([k.du for k in topo.kinds])
    torch.testing.assert_close(occ.node, occ.gamma.sum(1), atol=1e-12, rtol=0)
    torch.testing.assert_close(occ.gamma_blank, occ.gamma[:, du == 0].sum(1), atol=1e-12, rtol=0)
    torch.testing.assert_close(occ.gamma_label, occ.gamma[:, du == 1].sum(1), atol=1e-12, rtol=0)
    for b in range(B):
        (t0, u0), (t1, u1) = starts[b], ends[b]
        gamma = topology_occupations(logits[b], targets[b], topo, blank, True, (t0, u0), (t1, u1),
                                     **terms)
        torch.testing.assert_close(occ.gamma[b], gamma, atol=1e-10, rtol=0)
        log_p, _, _ = _oracle_log_p(logits[b], targets[b], topo, blank, (t0, u0), (t1, u1), **terms)
        if log_p == -math.inf:
            assert occ.log_likelihood[b] == -math.inf and (occ.gamma[b] == 0).all()
            continue
        assert occ.log_likelihood[b].item() == pytest.approx(log_p, abs=1e-10)
        # every path emits each label once ...
        torch.testing.assert_close(occ.gamma_label[b, :, u0:u1].sum(0),
                                   torch.ones(u1 - u0, dtype=torch.float64), atol=1e-10, rtol=0)
        assert (occ.gamma_label[b, :, u1:] == 0).all()
        # ... and crosses each frame with exactly one arc (t <= f < t + dt)
        cover = torch.zeros(T, dtype=torch.float64)
        for k, kind in enumerate(topo.kinds):
            for dt in range(kind.dt):
                cover[dt:] += occ.gamma[b, k].sum(-1)[: T - dt]
        torch.testing.assert_close(cover[t0:t1], torch.ones(t1 - t0, dtype=torch.float64),
                                   atol=1e-10, rtol=0)
    assert ((occ.node >= 0) & (occ.node <= 1 + 1e-12)).all() and not torch.isnan(occ.gamma).any()


def _same_occupancy(occ, ref):
    """A kernel backend's occupancy equals the reference's (float64 rounding)."""
    assert occ.kinds == ref.kinds and occ.gamma.dtype == ref.gamma.dtype == torch.float64
    for f in ("node", "gamma_blank", "gamma_label", "gamma", "log_likelihood"):
        torch.testing.assert_close(getattr(occ, f), getattr(ref, f), atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(TOPOS))
def test_occupancy_matches_oracle(name, backend):
    topo, logits, targets, tl, ul, blank = _batch(name)
    occ = rnnt_lattice.occupancy(logits, targets, tl, ul, blank=blank, backend=backend, **_kw(name))
    starts = [(0, 0)] * len(TL)
    _check_occupancy(occ, topo, logits, targets, tl, ul, blank, starts, list(zip(TL, UL)))
    if backend != "torch":
        _same_occupancy(occ, rnnt_lattice.occupancy(logits, targets, tl, ul, blank=blank,
                                                    backend="torch", **_kw(name)))
    pad = ~rnnt_lattice._layout.node_mask(tl, ul, T, U + 1)
    assert (occ.node[pad] == 0).all()
    if name in ("modified", "one_sym_per_frame"):
        assert occ.log_likelihood[3] == -math.inf              # (T_b, U_b) = (1, 2): no path
    if name in ("modified", "constrained"):                    # every arc advances one frame
        sums = occ.node.sum(-1)
        for b in range(3):
            torch.testing.assert_close(sums[b, :TL[b]], torch.ones(TL[b], dtype=torch.float64))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(TOPOS))
def test_occupancy_with_per_arc_terms_and_boundary(name, backend):
    topo, logits, targets, tl, ul, blank = _batch(name, seed=3)
    # k2 rows [begin_symbol, begin_frame, end_symbol, end_frame]
    boundary = torch.tensor([[1, 1, 2, 5], [0, 0, 2, 3], [0, 1, 0, 4], [0, 0, 2, 1]])
    terms = dict(sigma=0.1, delay_penalty=0.2)
    kw = dict(blank=blank, boundary=boundary, **terms, **_kw(name))
    occ = rnnt_lattice.occupancy(logits, targets, tl, ul, backend=backend, **kw)
    starts = [(int(r[1]), int(r[0])) for r in boundary]
    ends = [(int(r[3]), int(r[2])) for r in boundary]
    _check_occupancy(occ, topo, logits, targets, tl, ul, blank, starts, ends, **terms)
    if backend != "torch":
        _same_occupancy(occ, rnnt_lattice.occupancy(logits, targets, tl, ul, backend="torch", **kw))


def _check_alignment(ali, occ, topo, logits, targets, tl, ul, blank, **terms):
    B = logits.shape[0]
    L = T + U
    assert ali.emit_frames.shape == (B, U) and ali.label_durations.shape == (B, U)
    assert ali.arc_frames.shape == ali.arc_positions.shape == ali.arc_kinds.shape == (B, L)
    for x in (ali.emit_frames, ali.arc_frames, ali.arc_kinds, ali.n_arcs, ali.label_durations):
        assert x.dtype == torch.int64
    for b in range(B):
        T_b, U_b = int(tl[b]), int(ul[b])
        log_p, best, second = _oracle_log_p(logits[b], targets[b], topo, blank, (0, 0), (T_b, U_b),
                                            **terms)
        if best == -math.inf:
            assert ali.log_prob[b] == -math.inf and ali.arcs[b] == [] and ali.path(b) == []
            assert int(ali.n_arcs[b]) == 0 and (ali.emit_frames[b] == -1).all()
            assert (ali.arc_kinds[b] == -1).all()
            continue
        assert ali.log_prob[b].item() == pytest.approx(best, abs=1e-10)
        assert ali.log_prob[b] <= occ.log_likelihood[b] + 1e-12
        arcs = [(a.t, a.u, [k.name for k in topo.kinds].index(a.kind)) for a in ali.arcs[b]]
        assert arcs in topology_paths(topo, (0, 0), (T_b, U_b))      # a complete path ...
        w = _weights(logits[b], targets[b], topo, blank, T_b, **terms)
        assert sum(w[k, t, u].item() for t, u, k in arcs) == pytest.approx(best, abs=1e-10)
        if best - second > 1e-9:                                      # ... the unique best one
            assert arcs == topology_best_path(logits[b], targets[b], topo, blank, True, (0, 0),
                                              (T_b, U_b), **terms)[1]
        n = len(arcs)
        assert int(ali.n_arcs[b]) == n and (ali.arc_kinds[b, n:] == -1).all()
        assert ali.path(b) == [(t, u) for t, u, _ in arcs]
        assert sum(a.duration for a in ali.arcs[b]) == T_b               # the arcs cover the frames
        assert ali.arc_durations[b, :n].tolist() == [a.duration for a in ali.arcs[b]]
        labels = [a for a in ali.arcs[b] if topo.kinds[[k.name for k in topo.kinds].index(a.kind)].du]
        assert ali.emit_frames[b, :U_b].tolist() == [a.t for a in labels]
        assert [a.u for a in labels] == list(range(U_b))
        assert ali.label_durations[b, :U_b].tolist() == [a.duration for a in labels]
        assert (ali.emit_frames[b, U_b:] == -1).all() and (ali.label_durations[b, U_b:] == -1).all()
        assert sum(ali.frame_labels[b], []) == targets[b, :U_b].tolist()


ARC_FIELDS = ("emit_frames", "arc_frames", "arc_positions", "arc_kinds", "n_arcs",
              "label_durations")


def _same_alignment(ali, ref):
    """A kernel backend's alignment equals the reference's: the best path score to float64
    rounding, the path itself exactly (random logits: ties are improbable; the oracle
    check has made sure that each path found is the unique best one)."""
    assert ali.topology == ref.topology
    torch.testing.assert_close(ali.log_prob, ref.log_prob, atol=1e-12, rtol=0)
    for f in ARC_FIELDS:
        assert torch.equal(getattr(ali, f), getattr(ref, f)), f


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(TOPOS))
def test_best_alignment_matches_oracle(name, seed, backend):
    topo, logits, targets, tl, ul, blank = _batch(name, seed=seed)
    kw = dict(blank=blank, backend=backend, **_kw(name))
    ali = rnnt_lattice.best_alignment(logits, targets, tl, ul, **kw)
    occ = rnnt_lattice.occupancy(logits, targets, tl, ul, **kw)
    assert ali.topology == topo
    _check_alignment(ali, occ, topo, logits, targets, tl, ul, blank)
    if backend != "torch":
        _same_alignment(ali, rnnt_lattice.best_alignment(logits, targets, tl, ul,
                                                         **dict(kw, backend="torch")))


@backends.NO_TRITON
@pytest.mark.parametrize("name", list(TOPOS))
def test_lattice_state_in_registers(name, monkeypatch):
    """``gpu.LATTICE_ONCHIP`` (off until a GPU times it): the lattice pass with the last
    diagonals' alpha and beta held by the lanes, where one block of lanes holds a diagonal
    (U + 1 = 4 here), gives the occupations and the best path (the max-plus sweep and its
    best kinds) of the pass through the workspace, bit for bit, and both agree with the
    oracle."""
    from rnnt_lattice import gpu
    topo, logits, targets, tl, ul, blank = _batch(name)
    kw = dict(blank=blank, backend="triton", **_kw(name))
    got = {}
    for on in (False, True):
        monkeypatch.setattr(gpu, "LATTICE_ONCHIP", on)
        assert gpu._onchip(U + 1, topo)["ONCHIP"] == on
        got[on] = (rnnt_lattice.best_alignment(logits, targets, tl, ul, **kw),
                   rnnt_lattice.occupancy(logits, targets, tl, ul, **kw))
    (ali, occ), (ali0, occ0) = got[True], got[False]
    _check_alignment(ali, occ, topo, logits, targets, tl, ul, blank)
    assert torch.equal(ali.log_prob, ali0.log_prob)
    for f in ARC_FIELDS:
        assert torch.equal(getattr(ali, f), getattr(ali0, f)), f
    for f in ("node", "gamma_blank", "gamma_label", "gamma", "log_likelihood"):
        assert torch.equal(getattr(occ, f), getattr(occ0, f)), f


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["modified", "tdt"])
def test_best_alignment_with_sigma_and_delay_penalty(name, backend):
    topo, logits, targets, tl, ul, blank = _batch(name, seed=4)
    terms = dict(sigma=0.3, delay_penalty=0.5)
    kw = dict(blank=blank, backend=backend, **terms, **_kw(name))
    ali = rnnt_lattice.best_alignment(logits, targets, tl, ul, **kw)
    occ = rnnt_lattice.occupancy(logits, targets, tl, ul, **kw)
    _check_alignment(ali, occ, topo, logits, targets, tl, ul, blank, **terms)
    if backend != "torch":
        _same_alignment(ali, rnnt_lattice.best_alignment(logits, targets, tl, ul,
                                                         **dict(kw, backend="torch")))


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", list(TOPOS))
def test_best_alignment_with_boundary_equals_reference(name, backend):
    """Start and end moved by a k2 boundary, per-arc terms on: the kernels' pointers give
    the reference's path (every sequence has a unique best path on these logits)."""
    _, logits, targets, tl, ul, blank = _batch(name, seed=5)
    boundary = torch.tensor([[1, 1, 2, 5], [0, 0, 2, 3], [0, 1, 0, 4], [0, 0, 2, 1]])
    kw = dict(blank=blank, boundary=boundary, sigma=0.2, delay_penalty=0.3, **_kw(name))
    ali = rnnt_lattice.best_alignment(logits, targets, tl, ul, backend=backend, **kw)
    ref = rnnt_lattice.best_alignment(logits, targets, tl, ul, backend="torch", **kw)
    _same_alignment(ali, ref)
    assert (ali.n_arcs > 0).any()


# --------------------------------------------------------------------------- regular
@pytest.mark.parametrize("backend", BACKENDS)
def test_regular_through_the_new_options_is_the_old_result(backend):
    _, logits, targets, tl, ul, blank = _batch("regular", seed=2)
    old_o = rnnt_lattice.occupancy(logits, targets, tl, ul, blank=blank, backend=backend)
    old_a = rnnt_lattice.best_alignment(logits, targets, tl, ul, blank=blank, backend=backend)
    assert old_o.kinds == ("blank", "label")
    assert torch.equal(old_o.gamma, torch.stack([old_o.gamma_blank, old_o.gamma_label], 1))
    for kw in (dict(rnnt_type="regular"), dict(topology=topology.regular()),
               dict(sigma=0.0, delay_penalty=0.0)):
        o = rnnt_lattice.occupancy(logits, targets, tl, ul, blank=blank, backend=backend, **kw)
        a = rnnt_lattice.best_alignment(logits, targets, tl, ul, blank=blank, backend=backend, **kw)
        for f in ("node", "gamma_blank", "gamma_label", "gamma", "log_likelihood"):
            assert torch.equal(getattr(o, f), getattr(old_o, f))
        for f in ("emit_frames", "log_prob", "arc_frames", "arc_positions", "arc_kinds", "n_arcs",
                  "label_durations"):
            assert torch.equal(getattr(a, f), getattr(old_a, f))
    # The generic recursion (a boundary equal to the lengths) agrees with the kernel path,
    # the arcs derived from the emission frames included.
    full = torch.stack([torch.zeros_like(ul), torch.zeros_like(tl), ul, tl], 1)
    o = rnnt_lattice.occupancy(logits, targets, tl, ul, blank=blank, backend="torch", boundary=full)
    a = rnnt_lattice.best_alignment(logits, targets, tl, ul, blank=blank, backend="torch",
                                    boundary=full)
    for f in ("node", "gamma", "log_likelihood"):
        torch.testing.assert_close(getattr(o, f), getattr(old_o, f), atol=1e-10, rtol=0)
    torch.testing.assert_close(a.log_prob, old_a.log_prob, atol=1e-10, rtol=0)
    for f in ("emit_frames", "arc_frames", "arc_positions", "arc_kinds", "n_arcs", "label_durations"):
        assert torch.equal(getattr(a, f), getattr(old_a, f)), f
    assert a.arcs == old_a.arcs and a.arcs[0][-1] == Arc(4, 2, "blank", 1)
    # An Alignment given only its emission frames derives the regular path's arcs from them
    # (``alignment._regular_arcs``): the arcs the backtracking found.
    given = rnnt_lattice.Alignment(old_a.emit_frames, old_a.log_prob, old_a.logit_lengths,
                                   old_a.target_lengths, old_a.targets)
    for f in ("arc_frames", "arc_positions", "arc_kinds", "n_arcs", "label_durations"):
        assert torch.equal(getattr(given, f), getattr(old_a, f)), f
    assert given.arcs == old_a.arcs and given.frame_labels == old_a.frame_labels


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_keep_the_first_kind_on_every_path(backend):
    # All arcs equally likely: every backend's sweep, with or without a boundary, emits early.
    logits = torch.zeros(1, 4, 3, 3, dtype=torch.float64)
    args = (logits, torch.tensor([[1, 2]]), torch.tensor([4]), torch.tensor([2]))
    full = torch.tensor([[0, 0, 2, 4]])
    for kw in (dict(), dict(boundary=full)):
        ali = rnnt_lattice.best_alignment(*args, blank=0, backend=backend, **kw)
        assert ali.emit_frames.tolist() == [[0, 0]]
    # TDT, every arc weighs the same: the best paths have the fewest arcs (3: two labels and
    # a final blank). From the end (4, 2) the first incoming kind is blank_d1 from (3, 2);
    # into (3, 2) label_d1 from (2, 1) and label_d2 from (1, 1) tie (one arc from the start
    # each): label_d1 is listed first; into (2, 1): label_d2 from (0, 0).
    topo = topology.tdt([0, 1, 2])
    x = torch.zeros(1, 4, 3, 3 + 3, dtype=torch.float64)
    y = torch.tensor([[0, 1]])
    ali = rnnt_lattice.best_alignment(x, y, torch.tensor([4]), torch.tensor([2]), blank=-1,
                                      topology=topo, backend=backend)
    assert ali.arcs == [[Arc(0, 0, "label_d2", 2), Arc(2, 1, "label_d1", 1), Arc(3, 2, "blank_d1", 1)]]
    _, best, _ = _oracle_log_p(x[0], y[0], topo, 2, (0, 0), (4, 2))
    assert ali.log_prob.item() == pytest.approx(best) == pytest.approx(6 * math.log(1 / 3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_tdt_alignment_reports_durations(backend):
    topo = topology.tdt([0, 1, 2])
    x = torch.zeros(1, 4, 2, 4 + 3, dtype=torch.float64)     # tokens 0..3 (blank 3), durations
    x[0, 0, 0, 1] = 8.0                                        # label y[0] = 1 at (0, 0) ...
    x[0, 0, 0, 4 + 2] = 8.0                                    # ... with duration 2
    x[0, 2, 1, 3] = 8.0                                        # then a blank at (2, 1) ...
    x[0, 2, 1, 4 + 2] = 8.0                                    # ... of duration 2 to the end
    ali = rnnt_lattice.best_alignment(x, torch.tensor([[1]]), torch.tensor([4]), torch.tensor([1]),
                                      blank=3, topology=topo, backend=backend)
    assert ali.arcs == [[Arc(0, 0, "label_d2", 2), Arc(2, 1, "blank_d2", 2)]]
    assert ali.emit_frames.tolist() == [[0]] and ali.label_durations.tolist() == [[2]]
    assert ali.arc_durations[0, :2].tolist() == [2, 2] and ali.n_arcs.tolist() == [2]
    assert ali.path(0) == [(0, 0), (2, 1)] and ali.frame_labels == [[[1], [], [], []]]


def test_lattice_options_are_validated():
    _, logits, targets, tl, ul, blank = _batch("regular")
    for fn in (rnnt_lattice.occupancy, rnnt_lattice.best_alignment):
        with pytest.raises(ValueError, match="not both"):
            fn(logits, targets, tl, ul, blank=blank, rnnt_type="modified",
               topology=topology.modified())
        with pytest.raises(ValueError, match="rnnt_type"):
            fn(logits, targets, tl, ul, blank=blank, rnnt_type="tdt")
        with pytest.raises(ValueError, match="Topology"):
            fn(logits, targets, tl, ul, blank=blank, topology="tdt")
        with pytest.raises(ValueError, match="backend must be one of"):
            fn(logits, targets, tl, ul, blank=blank, rnnt_type="modified", backend="nosuch")
        with pytest.raises(ValueError, match="delay_penalty"):
            fn(logits, targets, tl, ul, blank=blank, delay_penalty=-1.0)
        with pytest.raises(ValueError, match="blank"):           # TDT: the blank is the last token
            fn(logits, targets % 2, tl, ul, blank=0, topology=topology.tdt([0, 1]), backend="torch")


@pytest.mark.parametrize("backend", ["torch", "numba", backends.TRITON])
def test_multiblank_topology_must_agree_with_blank_and_targets(backend):
    """A multi-blank topology places its big blanks below the blank it was built for: with
    another ``blank=`` it would be another lattice, and a big blank's class is no label.
    Both are ValueErrors, as in multiblank_rnnt_loss (they computed a lattice before)."""
    x = torch.randn(1, 6, 3, 7, generator=torch.Generator().manual_seed(0))
    tl, ul = torch.tensor([6]), torch.tensor([2])
    topo = topology.multiblank(6, [2, 3])
    for fn in (rnnt_lattice.occupancy, rnnt_lattice.best_alignment):
        fn(x, torch.tensor([[1, 2]]), tl, ul, blank=6, topology=topo, backend=backend)   # agrees
        fn(x, torch.tensor([[1, 2]]), tl, ul, blank=-1, topology=topo, backend=backend)
        with pytest.raises(ValueError, match="built for blank=6.*got blank=0"):
            fn(x, torch.tensor([[1, 2]]), tl, ul, blank=0, topology=topo, backend=backend)
        with pytest.raises(ValueError, match=r"targets\[0, 1\] = 4 is the class of the arc kind 'big_blank_3'"):
            fn(x, torch.tensor([[1, 4]]), tl, ul, blank=6, topology=topo, backend=backend)
    with pytest.raises(ValueError, match=r"targets\[0, 0\] = 5 is the class"):
        rnnt_lattice.multiblank_rnnt_loss(x, torch.tensor([[5, 1]]), tl, ul, blank=6,
                                          big_blank_durations=[2, 3], backend=backend)


@pytest.mark.parametrize("backend", ["auto", "numba"])
def test_kernel_backends_run_every_lattice_without_fallback(backend, monkeypatch):
    """Non-regular lattices run on the named backend's kernels (no fallback warning, no
    call into the reference's recursion) and give the reference's occupations."""
    from rnnt_lattice import reference
    _, logits, targets, tl, ul, blank = _batch("modified")
    kw = dict(blank=blank, rnnt_type="modified")
    ref = rnnt_lattice.occupancy(logits, targets, tl, ul, backend="torch", **kw)
    ref_a = rnnt_lattice.best_alignment(logits, targets, tl, ul, backend="torch", **kw)

    def forbidden(*args, **kwargs):
        raise AssertionError("the reference's recursion was called")
    for name in ("lattice", "sweep_alpha", "arc_weights"):
        monkeypatch.setattr(reference, name, forbidden)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        occ = rnnt_lattice.occupancy(logits, targets, tl, ul, backend=backend, **kw)
        ali = rnnt_lattice.best_alignment(logits, targets, tl, ul, backend=backend, **kw)
    _same_occupancy(occ, ref)
    _same_alignment(ali, ref_a)


# --------------------------------------------------------------------------- plot
@pytest.mark.parametrize("name", list(TOPOS))
def test_plot_draws_every_topology(name, tmp_path):
    pytest.importorskip("matplotlib")
    from rnnt_lattice.plot import plot_occupancy, save
    topo, logits, targets, tl, ul, blank = _batch(name)
    kw = dict(blank=blank, backend="torch", **_kw(name))
    occ = rnnt_lattice.occupancy(logits, targets, tl, ul, **kw)
    ali = rnnt_lattice.best_alignment(logits, targets, tl, ul, **kw)
    fig, ax = plot_occupancy(occ, 0, ali, labels=["a", "b"], figsize=(4, 3), dpi=50)
    line = ax.get_lines()[0]
    # the path through the arcs' source nodes, then the last arc into the end frame
    assert list(zip(line.get_xdata(), line.get_ydata())) == ali.path(0)
    assert ax.get_title() == "" and ax.get_xlim() == (-0.5, TL[0] - 0.5)
    save(fig, tmp_path / f"{name}.png")
    assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
