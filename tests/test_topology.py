"""Every topology (math.md section 9) through the one generic reference recursion, against
the independent path-enumerating oracle: losses and gradients in float64 for every option
(fused / log-prob, FastEmit, clamp, sigma, delay penalty, k2 boundary), closed forms with
uniform probabilities, NeMo's TDT test vector, infeasible lengths, NaN rules, per-kind
occupations, the max-plus pointers and a gradcheck."""
from __future__ import annotations

import math

import pytest
import torch

import rnnt_lattice
from rnnt_lattice import reference, topology
from rnnt_lattice._rules import scale_upstream
from rnnt_lattice._types import Ends
from rnnt_lattice.topology import check_topology
from support.cases import Case, rel_err, upstream_weights
from support.oracle import (alignments, topology_batch_grad, topology_best_path, topology_occupations,
                    topology_paths)
from support.cases import TOPOLOGY as TOPOLOGY_CASES
from support.topologies import OPTIONS, TOPOLOGIES, make_topo_inputs

# Relative to the largest loss / gradient entry (at least 1): float64 carries only the
# rounding of a few hundred operations; float32 inputs (the lattice still in float64) the
# row sums' and gradient's rounding.
TOL = {torch.float64: 1e-10, torch.float32: 4 * 2.0**-23 * 8}


def generic(logits, targets, tl, ul, topo, blank, fused=True, clamp=-1.0, fastemit_lambda=0.0,
            sigma=0.0, delay_penalty=0.0, boundary=None):
    return reference.costs_and_grad(logits, targets, tl, ul, topo, blank, fused, clamp,
                                    fastemit_lambda, sigma, delay_penalty, boundary)


@pytest.mark.parametrize("opt", list(OPTIONS))
@pytest.mark.parametrize("topo_name", list(TOPOLOGIES))
@pytest.mark.parametrize("case", TOPOLOGY_CASES, ids=lambda c: c.name)
def test_matches_enumeration(case, topo_name, opt):
    kw = dict(OPTIONS[opt])
    fused = kw.pop("fused", True)
    logits, targets, tl, ul, topo, blank, bnd = make_topo_inputs(
        case, topo_name, fused=fused, boundary=kw.pop("boundary", False))
    want_loss, want_grad = topology_batch_grad(logits, targets, tl, ul, topo, blank, fused,
                                               boundary=bnd, **kw)
    loss, grad = generic(logits, targets, tl, ul, topo, blank, fused, boundary=bnd, **kw)
    assert loss.dtype == torch.float64 and grad.shape == logits.shape
    assert rel_err(loss, want_loss) <= TOL[torch.float64]
    w = upstream_weights(case.B)[:, None, None, None]
    assert rel_err(scale_upstream(grad, w), want_grad * w) <= TOL[torch.float64]
    assert not torch.isnan(grad).any(), "NaN padding leaked into the gradient"
    # Honesty: the cases hold finite and infinite losses, and gradients that are not all 0.
    assert (grad != 0).any() or not torch.isfinite(want_loss).any()


@pytest.mark.parametrize("topo_name", list(TOPOLOGIES))
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logprob"])
def test_float32_inputs(topo_name, fused):
    case = Case("f32", (4, 3, 5), (2, 3, 1), 6, 0, T=5, U=3)
    logits, targets, tl, ul, topo, blank, _ = make_topo_inputs(case, topo_name, torch.float32,
                                                               seed=3, fused=fused)
    want_loss, want_grad = topology_batch_grad(logits, targets, tl, ul, topo, blank, fused,
                                               fastemit_lambda=0.1, sigma=0.05)
    loss, grad = generic(logits, targets, tl, ul, topo, blank, fused, fastemit_lambda=0.1, sigma=0.05)
    assert loss.dtype == torch.float32 and grad.dtype == torch.float32
    assert rel_err(loss, want_loss) <= TOL[torch.float32]
    assert rel_err(grad, want_grad) <= TOL[torch.float32]


@pytest.mark.parametrize("topo_name", list(TOPOLOGIES))
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logprob"])
def test_masked_classes(topo_name, fused):
    """-inf entries (masked classes, arc reads included) are legal: those arcs are impossible."""
    case = Case("masked", (5, 4, 3), (3, 2, 2), 6, 0, T=5, U=3)
    logits, targets, tl, ul, topo, blank, _ = make_topo_inputs(case, topo_name, seed=17, fused=fused)
    g = torch.Generator().manual_seed(17)
    x = logits.masked_fill(torch.rand(logits.shape, generator=g) < 0.15, -math.inf)
    x[..., 1] = torch.where(torch.isnan(x[..., 1]), x[..., 1], 0.0)   # no row is all -inf
    x[..., -1] = torch.where(torch.isnan(x[..., -1]), x[..., -1], -0.5)
    want_loss, want_grad = topology_batch_grad(x, targets, tl, ul, topo, blank, fused,
                                               fastemit_lambda=0.2, sigma=0.05)
    loss, grad = generic(x, targets, tl, ul, topo, blank, fused, fastemit_lambda=0.2, sigma=0.05)
    assert rel_err(loss, want_loss) <= TOL[torch.float64]
    assert rel_err(grad, want_grad) <= TOL[torch.float64]
    assert not torch.isnan(grad).any()


def test_boundary_is_checked():
    case = Case("bad", (3, 2), (2, 1), 5, 0)
    logits, targets, tl, ul, topo, blank, _ = make_topo_inputs(case, "regular")
    for row in ([0, 2, 1, 1], [2, 0, 1, 2], [0, 0, 3, 2], [0, 0, 1, 4]):
        bnd = torch.tensor([[0, 0, 2, 3], row])
        with pytest.raises(ValueError, match="sequence 1"):
            generic(logits, targets, tl, ul, topo, blank, boundary=bnd)


def test_enumerator_matches_closed_form_regular_paths():
    """The generic enumerator with regular() walks exactly the regular alignments."""
    for T in range(1, 5):
        for U in range(0, 4):
            want = sorted([(t, u, int(lab)) for t, u, lab in p] for p in alignments(T, U))
            got = sorted(topology_paths(topology.regular(), (0, 0), (T, U)))
            assert got == want


@pytest.mark.parametrize("topo_name,T,U", [
    ("modified", 2, 3), ("constrained", 1, 2), ("one_sym", 3, 3), ("one_sym", 1, 1),
    ("tdt13", 2, 2), ("regular", 0, 0), ("multiblank", 0, 2)])
def test_infeasible_lengths(topo_name, T, U):
    """No path: +inf and an exactly zero gradient, next to a feasible sequence."""
    case = Case("infeasible", (T, 6), (U, 1), 6, 0)
    logits, targets, tl, ul, topo, blank, _ = make_topo_inputs(case, topo_name)
    loss, grad = generic(logits, targets, tl, ul, topo, blank, fastemit_lambda=0.3)
    assert loss[0] == math.inf and (grad[0] == 0).all()
    assert torch.isfinite(loss[1]) and (grad[1] != 0).any()


@pytest.mark.parametrize("topo_name", list(TOPOLOGIES))
def test_occupations_match_enumeration(topo_name):
    case = Case("occ", (4, 3), (2, 3), 6, 0, T=5, U=3)
    logits, targets, tl, ul, topo, blank, _ = make_topo_inputs(case, topo_name, seed=5)
    ends = Ends.of(tl, ul)
    _, _, lp = reference.kind_log_probs(logits, targets, topo, blank, True, ends)
    lat = reference.lattice(reference.arc_weights(lp, topo, ends, 0.05, 0.1), topo, ends)
    for b in range(case.B):
        want = topology_occupations(logits[b], targets[b], topo, blank, True, (0, 0),
                                    (int(tl[b]), int(ul[b])), 0.05, 0.1)
        torch.testing.assert_close(lat.gamma[b], want, rtol=0, atol=1e-12)
        # alpha(end) and beta(start) are both log P (the free self-check)
        assert lat.alpha[b, tl[b], ul[b]].item() == pytest.approx(lat.log_like[b].item(), abs=1e-12)
    assert (lat.gamma[:, :, :, 4:] == 0).all() and (lat.alpha[:, 6:] == -math.inf).all()


@pytest.mark.parametrize("topo_name", list(TOPOLOGIES))
def test_max_plus_pointers(topo_name):
    """The max-plus sweep's score is the best path's; following its pointers gives that path."""
    case = Case("vit", (5, 4, 2), (3, 2, 2), 6, 0, T=5, U=3)
    logits, targets, tl, ul, topo, blank, _ = make_topo_inputs(case, topo_name, seed=7)
    ali = rnnt_lattice.best_alignment(logits, targets, tl, ul, blank, topology=topo, sigma=0.05,
                                      backend="torch")
    log_prob, paths = ali.log_prob, _paths(ali)
    for b in range(case.B):
        score, path = topology_best_path(logits[b], targets[b], topo, blank, True, (0, 0),
                                         (int(tl[b]), int(ul[b])), sigma=0.05)
        if score == -math.inf:
            assert log_prob[b] == -math.inf and paths[b] == []
            continue
        assert log_prob[b].item() == pytest.approx(score, abs=1e-12)
        assert paths[b] == path


def _paths(ali) -> list:
    """The best path of each sequence as arcs ``(t, u, kind index)`` in path order."""
    return [[(int(ali.arc_frames[b, i]), int(ali.arc_positions[b, i]), int(ali.arc_kinds[b, i]))
             for i in range(int(ali.n_arcs[b]))] for b in range(ali.n_arcs.shape[0])]


def test_max_plus_tie_goes_to_the_first_kind():
    """On an exact tie the first kind (the blank in every builder) wins: with uniform
    probabilities the label is emitted at the earliest frame, as ``lattice.alignment``."""
    logits = torch.zeros(1, 3, 3, 4, dtype=torch.float64)
    tl, ul = torch.tensor([3]), torch.tensor([2])
    topo = topology.regular()
    ali = rnnt_lattice.best_alignment(logits, torch.tensor([[1, 2]]), tl, ul, 0, topology=topo,
                                      backend="torch")
    path = _paths(ali)[0]
    assert path == [(0, 0, 1), (0, 1, 1), (0, 2, 0), (1, 2, 0), (2, 2, 0)]


@pytest.mark.parametrize("topo_name", ["modified", "constrained", "multiblank", "tdt012"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logprob"])
def test_nan_rules(topo_name, fused):
    """math.md 8.1 for every topology: a NaN read by an arc makes that sequence's loss NaN
    (fused: NaN on every row of its lattice; log-prob: on its arc entries only); other
    sequences and padding are untouched; a NaN entry no arc reads changes nothing."""
    case = Case("nan", (4, 3), (2, 2), 6, 0)
    logits, targets, tl, ul, topo, blank, _ = make_topo_inputs(case, topo_name, seed=9, fused=fused)
    clean_loss, clean_grad = generic(logits, targets, tl, ul, topo, blank, fused)
    x = logits.clone()
    x[0, 1, 1, blank] = float("nan")
    loss, grad = generic(x, targets, tl, ul, topo, blank, fused)
    assert torch.isnan(loss[0]) and loss[1] == clean_loss[1]
    assert torch.equal(grad[1], clean_grad[1])
    rows = grad[0, :4, :3]
    if fused:
        assert torch.isnan(rows).all()
    else:
        assert torch.isnan(rows).any() and not torch.isnan(rows).all()
        # an unread class in log-prob mode changes nothing
        unread = [v for v in range(topo.token_classes(x.shape[-1]))
                  if v != blank and v not in targets[0, :2].tolist()
                  and all(k.class_id != v for k in topo.kinds)][0]
        y = logits.clone()
        y[0, 1, 1, unread] = float("nan")
        loss2, grad2 = generic(y, targets, tl, ul, topo, blank, fused)
        assert torch.equal(loss2, clean_loss) and torch.equal(grad2, clean_grad)
        # nor does the blank of (T_b - 1, 0): it would land on (T_b, 0), a dead end, not an arc
        y = logits.clone()
        y[0, 3, 0, blank] = float("nan")
        loss2, grad2 = generic(y, targets, tl, ul, topo, blank, fused)
        assert torch.equal(loss2, clean_loss) and torch.equal(grad2, clean_grad)


def test_boundary_default_rows_equal_lengths():
    """A boundary of ``[0, 0, U_b, T_b]`` rows is the same lattice as the lengths."""
    case = Case("bnd", (4, 3, 5), (2, 3, 1), 6, 0)
    for name in ("regular", "constrained", "tdt012"):
        logits, targets, tl, ul, topo, blank, _ = make_topo_inputs(case, name, seed=11)
        bnd = torch.stack([torch.zeros_like(ul), torch.zeros_like(tl), ul, tl], 1)
        a = generic(logits, targets, tl, ul, topo, blank, delay_penalty=0.2)
        b = generic(logits, targets, tl, ul, topo, blank, delay_penalty=0.2, boundary=bnd)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("topo_name,kw", [("constrained", dict(delay_penalty=0.3)),
                                          ("tdt012", dict(sigma=0.05))])
def test_gradcheck(topo_name, kw):
    """Finite differences of the generic loss against its analytic gradient (float64)."""
    case = Case("gc", (3, 2), (2, 1), 4, 0)
    logits, targets, tl, ul, topo, blank, _ = make_topo_inputs(case, topo_name, seed=13)
    x = torch.nan_to_num(logits, nan=0.0).requires_grad_()

    class Loss(torch.autograd.Function):
        @staticmethod
        def forward(ctx, z):
            costs, grad = generic(z, targets, tl, ul, topo, blank, **kw)
            ctx.save_for_backward(grad)
            return costs

        @staticmethod
        def backward(ctx, g):
            (grad,) = ctx.saved_tensors
            return grad * g[:, None, None, None]

    assert torch.autograd.gradcheck(Loss.apply, (x,), eps=1e-6, atol=1e-7)


def _kinds_with_class(class_id):
    """A user's topology that reads a fixed class (no blank it was built around)."""
    return topology.Topology("own", (topology.ArcKind("b", 1, 0, "blank", may_end=True),
                                     topology.ArcKind("y", 0, 1, "label"),
                                     topology.ArcKind("c", 2, 0, "class", class_id=class_id)))


_END = dict(may_end=True)
# A topology's rules, each broken once: (id, the call, words its ValueError holds).
TOPOLOGY_BAD = [
    ("stay", lambda: topology.ArcKind("stay", 0, 0, "blank"), "dt + du >= 1, got dt=0, du=0"),
    ("du_2", lambda: topology.ArcKind("x", 1, 2, "blank"), "du in (0, 1)"),
    ("reads", lambda: topology.ArcKind("x", 1, 0, "word"), "reads must be one of"),
    ("class_without_id", lambda: topology.ArcKind("x", 1, 0, "class"), "class_id >= 0 exactly when"),
    ("id_without_class", lambda: topology.ArcKind("x", 1, 0, "blank", class_id=3), "class_id >= 0 exactly when"),
    ("label_stays", lambda: topology.ArcKind("x", 1, 0, "label"), "a label arc advances one label position"),
    ("next_blank_stays", lambda: topology.ArcKind("x", 1, 0, "blank", plus_next_blank=True), "needs du = 1"),
    ("no_kinds", lambda: topology.Topology("t", ()), "'t' has no arc kinds"),
    ("same_names", lambda: topology.Topology("t", (topology.ArcKind("b", 1, 0, "blank", **_END),) * 2),
     "names must be distinct, got ['b', 'b']"),
    ("duration_without_group", lambda: topology.Topology(
        "t", (topology.ArcKind("b", 1, 0, "blank", duration=0, **_END),)), "reads a duration but n_durations is 0"),
    ("duration_outside_group", lambda: topology.Topology(
        "t", (topology.ArcKind("b", 1, 0, "blank", duration=2, **_END),), n_durations=2),
     "must read a duration index in [0, 2)"),
    ("no_end", lambda: topology.Topology("t", (topology.ArcKind("b", 1, 0, "blank"),)),
     "no arc kind may land on the end frame"),
    ("tdt_not_ascending", lambda: topology.tdt([2, 1]), "ascending"),
    ("tdt_empty", lambda: topology.tdt([]), "got []"),
    ("multiblank_ids", lambda: topology.multiblank(1, [2, 3]), "2 big blanks need ids below blank=1"),
    ("multiblank_negative", lambda: topology.multiblank(-1, [2]), "token id >= 0, got -1"),
    ("multiblank_repeated", lambda: topology.multiblank(5, [2, 2]), "distinct and >= 2"),
    # check_topology: a topology against the logits' last axis V and the blank
    ("tdt_no_tokens", lambda: check_topology(topology.tdt([0, 1, 2]), 3, -1),
     "(3) must hold at least one token besides the 3 durations"),
    ("blank_range", lambda: check_topology(topology.regular(), 5, 5), "blank=5 is out of range for 5"),
    ("other_blank", lambda: check_topology(topology.multiblank(6, [2]), 7, 5), "was built for blank=6"),
    ("tdt_blank_not_last", lambda: check_topology(topology.tdt([0, 1, 2]), 8, 0),
     "the blank must be the last token (4), got 0"),
    ("class_outside_tokens", lambda: check_topology(_kinds_with_class(5), 5, 0), "reads class 5"),
    ("class_is_blank", lambda: check_topology(_kinds_with_class(0), 5, 0), "other than the blank 0"),
]


@pytest.mark.parametrize("call, words", [b[1:] for b in TOPOLOGY_BAD], ids=[b[0] for b in TOPOLOGY_BAD])
def test_topology_validation(call, words):
    with pytest.raises(ValueError) as err:
        call()
    assert words in str(err.value), f"{words!r} not in: {err.value}"


def test_topology_rules_pass_what_they_should():
    """The rules' edges on the accepted side: TDT's blank the last token (counted from the
    end too), a user's fixed class among the tokens."""
    assert check_topology(topology.tdt([0, 1, 2]), 8, -1) == 4
    assert check_topology(topology.tdt([0, 1, 2]), 8, 4) == 4
    assert check_topology(_kinds_with_class(4), 5, 0) == 0
    assert check_topology(topology.multiblank(6, [2]), 7, -1) == 6


@pytest.mark.parametrize("topo_name", list(TOPOLOGIES))
@pytest.mark.parametrize("B,T,U", [(0, 2, 1), (0, 0, 0), (2, 0, 1)])
def test_empty_shapes(topo_name, B, T, U):
    """An empty batch gives empty results; a padded size T = 0 gives +inf, gradient 0."""
    topo, blank = TOPOLOGIES[topo_name](5, 4)
    logits = torch.randn(B, T, U + 1, 5 + topo.n_durations, dtype=torch.float64)
    loss, grad = generic(logits, torch.ones(B, U, dtype=torch.int64), torch.full((B,), T),
                         torch.full((B,), U), topo, blank)
    assert loss.shape == (B,) and (loss == math.inf).all() and grad.shape == logits.shape


def test_by_name_is_the_one_name_table():
    """Every name -> topology goes through ``by_name``; ``allowed`` narrows the names (k2's
    three), with the message naming the option; ``to_spec``/``from_spec`` round-trip."""
    for name in topology.RNNT_TYPES:
        topo = topology.by_name(name)
        assert topo.name == name and topo == getattr(topology, name)()
        spec_name, durations = topology.to_spec(topo)
        assert topology.from_spec(spec_name, 0, durations) == topo
    assert topology.K2_TYPES == ("regular", "modified", "constrained")
    with pytest.raises(ValueError, match=r"rnnt_type must be one of \('regular', 'modified', "
                                         r"'constrained'\), got 'one_sym_per_frame'"):
        topology.by_name("one_sym_per_frame", topology.K2_TYPES)
    for topo in (topology.tdt([0, 2]), topology.multiblank(5, [2, 4])):
        spec_name, durations = topology.to_spec(topo)
        assert topology.from_spec(spec_name, 5, durations) == topo


@pytest.mark.parametrize("name", ["regular", "modified", "tdt", "multiblank"])
def test_a_borrowed_name_has_no_spec(name):
    """The custom op carries a topology as ``to_spec``'s (name, durations): a topology
    whose arcs are not what the builder of its name returns has no spec (ValueError),
    rather than becoming that builder's lattice under torch.compile."""
    arcs = topology.constrained().kinds
    if name == "tdt":
        arcs = topology.tdt([0, 1]).kinds[:-1] + (topology.tdt([0, 2]).kinds[-1],)
    impostor = topology.Topology(name, arcs, n_durations=2 if name == "tdt" else 0,
                                 blank=4 if name == "multiblank" else None)
    with pytest.raises(ValueError, match=f"topology '{name}' has no spec"):
        topology.to_spec(impostor)


def test_builders_with_parameters_return_one_object_per_value():
    """``tdt`` and ``multiblank`` run in every loss call: one frozen object per value
    (whatever sequence type the durations come in), so that the backends' caches keyed by
    the topology hit by identity and the arc kinds are checked once."""
    assert topology.tdt([0, 1, 2]) is topology.tdt((0, 1, 2)) is topology.tdt(torch.tensor([0, 1, 2]))
    assert topology.multiblank(6, [2, 4]) is topology.multiblank(6, (2, 4))
    assert topology.multiblank(6, [2, 4]) != topology.multiblank(6, [4, 2])
