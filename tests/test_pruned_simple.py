"""Pruned RNN-T, first half: the simple and smoothed losses against the full-joiner loss
and a naive 4-D formula, and the windows (k2's rule against a loop transcription of its
spec, the exact DP against enumeration and against k2's coverage)."""
from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import rnnt_lattice
from rnnt_lattice import topology, torch_backend
from support import backends
from support import cases
from support.cases import Case, rel_err, upstream_weights

TOL = 1e-9
RNNT_TYPES = topology.K2_TYPES                    # k2's lattices

# (B, T, U, V) padded sizes with ragged lengths; T_b = 0, U_b = 0, T_b < U_b included.
CASES = cases.SIMPLE
CASE_IDS = [c.name for c in CASES]


def make_simple(case: Case, seed=0, dtype=torch.float64, poison=True, scale=1.0):
    """``(lm (B, U+1, V), am (B, T, V), targets, T_b, U_b, blank)``; rows past the lengths
    NaN (``poison``), targets past them garbage."""
    g = torch.Generator().manual_seed(seed)
    B, T, U, V = case.shape
    blank = case.blank % V
    am = scale * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    lm = scale * torch.randn(B, U + 1, V, generator=g, dtype=torch.float64)
    others = torch.tensor([v for v in range(V) if v != blank], dtype=torch.int64)
    targets = others[torch.randint(len(others), (B, U), generator=g)]
    T_b = torch.tensor(case.T_lens, dtype=torch.int64)
    U_b = torch.tensor(case.U_lens, dtype=torch.int64)
    if poison:
        am = am.masked_fill((torch.arange(T)[None, :] >= T_b[:, None])[..., None], float("nan"))
        lm = lm.masked_fill((torch.arange(U + 1)[None, :] > U_b[:, None])[..., None], float("nan"))
        targets = targets.masked_fill(torch.arange(U)[None, :] >= U_b[:, None], -7)
    return lm.to(dtype), am.to(dtype), targets, T_b, U_b, case.blank


def _grads(loss_fn, lm, am, up):
    lm = lm.detach().clone().requires_grad_(True)
    am = am.detach().clone().requires_grad_(True)
    costs = loss_fn(lm, am)
    torch.autograd.backward(costs, up)
    return costs.detach(), lm.grad, am.grad


def _full(lm, am):
    return am[:, :, None] + lm[:, None]


# --------------------------------------------------------------------------- simple loss
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
@pytest.mark.parametrize("delay_penalty", [0.0, 0.3])
def test_simple_equals_full_joiner(case, rnnt_type, delay_penalty):
    """Values and gradients w.r.t. am and lm equal rnnt_loss on am + lm (NaN padding)."""
    lm, am, targets, T_b, U_b, blank = make_simple(case)
    up = upstream_weights(case.B)
    kw = dict(rnnt_type=rnnt_type, delay_penalty=delay_penalty, reduction="none")
    got = _grads(lambda l, a: rnnt_lattice.rnnt_loss_simple(l, a, targets, T_b, U_b, blank=blank, **kw),
                 lm, am, up)
    want = _grads(lambda l, a: rnnt_lattice.rnnt_loss(_full(l, a), targets, T_b, U_b, blank,
                                                      backend="torch", **kw), lm, am, up)
    for g, w in zip(got, want):
        assert rel_err(g, w) < TOL
    # Padding gets exactly zero gradient, NaN or not.
    assert torch.isfinite(got[1]).all() and torch.isfinite(got[2]).all()
    assert (got[2][torch.isnan(am)] == 0).all() and (got[1][torch.isnan(lm)] == 0).all()


@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
def test_simple_boundary_equals_full_joiner(rnnt_type):
    case = Case("boundary", (6, 5, 7), (3, 2, 4), 6, 0, T=8, U=5)
    lm, am, targets, T_b, U_b, blank = make_simple(case, seed=3)
    boundary = torch.tensor([[0, 0, 3, 6], [1, 1, 2, 5], [1, 2, 3, 6]])
    up = upstream_weights(case.B)
    kw = dict(rnnt_type=rnnt_type, delay_penalty=0.2, reduction="none", boundary=boundary)
    got = _grads(lambda l, a: rnnt_lattice.rnnt_loss_simple(l, a, targets, T_b, U_b, blank=blank, **kw),
                 lm, am, up)
    want = _grads(lambda l, a: rnnt_lattice.rnnt_loss(_full(l, a), targets, T_b, U_b, blank,
                                                      backend="torch", **kw), lm, am, up)
    assert torch.isfinite(got[0]).all()
    for g, w in zip(got, want):
        assert rel_err(g, w) < TOL


@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
def test_occupations_equal_full_lattice(rnnt_type):
    case = CASES[-1]
    lm, am, targets, T_b, U_b, blank = make_simple(case, seed=1)
    loss, occ = rnnt_lattice.rnnt_loss_simple(lm, am, targets, T_b, U_b, blank=blank,
                                              rnnt_type=rnnt_type, return_occupations=True)
    gamma_blank, gamma_label = occ
    ref = rnnt_lattice.occupancy(_full(lm, am), targets, T_b, U_b, blank, rnnt_type=rnnt_type,
                                 backend="torch")
    assert rel_err(gamma_blank, ref.gamma[:, 0]) < TOL
    assert rel_err(gamma_label, ref.gamma[:, 1]) < TOL
    assert occ.rnnt_type == rnnt_type and torch.equal(occ.logit_lengths, T_b)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_reductions_and_zero_infinity(reduction):
    case = CASES[4]                                     # T_b = 0: +inf
    lm, am, targets, T_b, U_b, blank = make_simple(case)
    for zi in (False, True):
        got = rnnt_lattice.rnnt_loss_simple(lm, am, targets, T_b, U_b, blank=blank,
                                            reduction=reduction, zero_infinity=zi)
        want = rnnt_lattice.rnnt_loss(_full(lm, am), targets, T_b, U_b, blank, backend="torch",
                                      reduction=reduction, zero_infinity=zi)
        assert rel_err(got, want) < TOL
    empty = rnnt_lattice.rnnt_loss_simple(lm[:0], am[:0], targets[:0], T_b[:0], U_b[:0],
                                          blank=blank, reduction=reduction)
    assert empty.shape == ((0,) if reduction == "none" else ())


def test_float32_and_upstream_zero_with_nan():
    case = CASES[-1]
    lm, am, targets, T_b, U_b, blank = make_simple(case, seed=2)
    got = rnnt_lattice.rnnt_loss_simple(lm.float(), am.float(), targets, T_b, U_b, blank=blank,
                                        reduction="none")
    want = rnnt_lattice.rnnt_loss_simple(lm, am, targets, T_b, U_b, blank=blank, reduction="none")
    assert got.dtype == torch.float32 and rel_err(got, want) < 1e-5
    # A NaN inside sequence 0's lattice: its loss is NaN, the others are exact; an upstream
    # gradient of 0 on it gives an exactly zero gradient everywhere.
    am_nan = am.clone()
    am_nan[0, 1, 3] = float("nan")
    am_nan.requires_grad_(True)
    lm_ = lm.clone().requires_grad_(True)
    costs = rnnt_lattice.rnnt_loss_simple(lm_, am_nan, targets, T_b, U_b, blank=blank, reduction="none")
    assert torch.isnan(costs[0]) and rel_err(costs[1:], want[1:]) < TOL
    costs[1:].sum().backward()
    assert torch.isfinite(am_nan.grad).all() and torch.isfinite(lm_.grad).all()
    assert (am_nan.grad[0] == 0).all() and (lm_.grad[0] == 0).all()


@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
def test_gradcheck(rnnt_type):
    case = Case("gc", (4, 3), (2, 1), 4, 0, T=4, U=2)
    lm, am, targets, T_b, U_b, blank = make_simple(case, seed=5, poison=False)
    lm.requires_grad_(True)
    am.requires_grad_(True)
    up = upstream_weights(case.B)

    def f(l, a):
        return rnnt_lattice.rnnt_loss_simple(l, a, targets, T_b, U_b, blank=blank, rnnt_type=rnnt_type,
                                             delay_penalty=0.1, reduction="none") * up

    assert torch.autograd.gradcheck(f, (lm, am))

    def g(l, a):
        return rnnt_lattice.rnnt_loss_smoothed(l, a, targets, T_b, U_b, blank=blank, rnnt_type=rnnt_type,
                                               lm_only_scale=0.2, am_only_scale=0.15, reduction="none")

    assert torch.autograd.gradcheck(g, (lm, am))


# --------------------------------------------------------------------------- smoothed
def _smoothed_naive(lm, am, targets, blank, s_lm, s_am):
    """k2's smoothed log-probs on the full (B, T, U+1, V) tensor, as log-prob-mode logits
    (blank and label entries; everything else -1e9, never read)."""
    B, T, V = am.shape
    U = lm.shape[1] - 1
    y = targets.clamp(0, V - 1)
    lp = torch.log_softmax(_full(lm, am), -1)
    uni = torch.softmax(lm, -1).mean((0, 1)) + torch.finfo(lm.dtype).tiny
    lm_lp = torch.log_softmax(lm, -1)                                          # (B, U+1, V)
    am_lp = am + uni.log() - torch.logsumexp(am + uni.log(), -1, keepdim=True)  # (B, T, V)
    c = 1.0 - s_lm - s_am
    s_lm, s_am = s_lm or 1e-20, s_am or 1e-20
    b = c * lp[..., blank] + s_lm * lm_lp[:, None, :, blank] + s_am * am_lp[:, :, None, blank]
    y4 = y[:, None, :, None].expand(B, T, U, 1)
    e = (c * lp[:, :, :U].gather(3, y4).squeeze(-1)
         + s_lm * lm_lp[:, :U].gather(2, y[..., None]).squeeze(-1)[:, None, :]
         + s_am * am_lp.gather(2, y[:, None, :].expand(B, T, U)))
    out = torch.full((B, T, U + 1, V), -1e9, dtype=lm.dtype)
    blank_hot = torch.nn.functional.one_hot(torch.tensor(blank), V).bool()
    out = torch.where(blank_hot, b[..., None], out)
    label_hot = torch.nn.functional.one_hot(y, V).bool()                       # (B, U, V)
    label_hot = torch.nn.functional.pad(label_hot, (0, 0, 0, 1))[:, None]      # (B, 1, U+1, V)
    e_pad = torch.nn.functional.pad(e, (0, 1), value=-1e9)
    return torch.where(label_hot, e_pad[..., None], out)


@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[5]], ids=["ragged", "U0", "longer"])
@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
@pytest.mark.parametrize("scales", [(0.1, 0.1), (0.0, 0.3), (0.25, 0.0)])
def test_smoothed_matches_naive_formula(case, rnnt_type, scales):
    lm, am, targets, T_b, U_b, blank = make_simple(case, seed=7, poison=False)
    up = upstream_weights(case.B)
    blank_id = blank % case.V
    kw = dict(rnnt_type=rnnt_type, delay_penalty=0.1, reduction="none")
    got = _grads(lambda l, a: rnnt_lattice.rnnt_loss_smoothed(
        l, a, targets, T_b, U_b, blank=blank, lm_only_scale=scales[0], am_only_scale=scales[1], **kw),
        lm, am, up)
    want = _grads(lambda l, a: rnnt_lattice.rnnt_loss(
        _smoothed_naive(l, a, targets, blank_id, *scales), targets, T_b, U_b, blank,
        fused_log_softmax=False, backend="torch", **kw), lm, am, up)
    for g, w in zip(got, want):
        assert rel_err(g, w) < TOL


def test_smoothed_zero_scales_is_simple():
    lm, am, targets, T_b, U_b, blank = make_simple(CASES[5], poison=False)
    a = rnnt_lattice.rnnt_loss_smoothed(lm, am, targets, T_b, U_b, blank=blank, lm_only_scale=0.0,
                                        am_only_scale=0.0, reduction="none")
    b = rnnt_lattice.rnnt_loss_simple(lm, am, targets, T_b, U_b, blank=blank, reduction="none")
    assert rel_err(a, b) < 1e-12


# --------------------------------------------------------------------------- validation
def test_validation_names_the_argument():
    lm, am, targets, T_b, U_b, blank = make_simple(CASES[1])
    call = rnnt_lattice.rnnt_loss_simple
    with pytest.raises(ValueError, match="delay_penalty"):
        call(lm, am, targets, T_b, U_b, blank=blank, delay_penalty=-0.1)
    with pytest.raises(ValueError, match="lm"):
        call(lm[..., :-1], am, targets, T_b, U_b, blank=blank)
    with pytest.raises(ValueError, match="am"):
        call(lm, am[0], targets, T_b, U_b, blank=blank)
    with pytest.raises(ValueError, match="targets"):
        call(lm, am, targets[:, :-1], T_b, U_b, blank=blank)
    with pytest.raises(ValueError, match="logit_lengths"):
        call(lm, am, targets, T_b + 9, U_b, blank=blank)
    with pytest.raises(ValueError, match="rnnt_type"):
        call(lm, am, targets, T_b, U_b, blank=blank, rnnt_type="one_sym_per_frame")
    with pytest.raises(ValueError, match="boundary"):
        call(lm, am, targets, T_b, U_b, blank=blank, boundary=torch.zeros(3, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="boundary"):
        call(lm, am, targets, T_b, U_b, blank=blank,
             boundary=torch.tensor([[0, 0, 2, 9], [0, 0, 1, 2], [0, 0, 0, 3]]))
    with pytest.raises(ValueError, match="reduction"):
        call(lm, am, targets, T_b, U_b, blank=blank, reduction="avg")
    with pytest.raises(ValueError, match="lm_only_scale"):
        rnnt_lattice.rnnt_loss_smoothed(lm, am, targets, T_b, U_b, blank=blank, lm_only_scale=float("nan"))
    _, occ = call(lm, am, targets, T_b, U_b, blank=blank, return_occupations=True)
    with pytest.raises(ValueError, match="R must"):
        rnnt_lattice.prune_ranges(occ, 0)
    with pytest.raises(ValueError, match="method"):
        rnnt_lattice.prune_ranges(occ, 2, method="argmax")
    with pytest.raises(ValueError, match=r"given as a pair \(gamma_blank, gamma_label\) need "
                                         "logit_lengths= and target_lengths="):
        rnnt_lattice.prune_ranges(tuple(occ)[:2], 2)
    with pytest.raises(ValueError, match="ranges"):
        rnnt_lattice.do_rnnt_pruning(am, lm, torch.full((3, 5, 2), 4))


# --------------------------------------------------------------------------- windows
@pytest.mark.parametrize("rnnt_type", ["regular", "modified", "constrained"])
def test_prune_ranges_takes_an_occupancy(rnnt_type):
    """``rnnt_lattice.occupancy``'s result gives the windows of its blank and label
    occupations, its lengths and its type, as the pair with them given by hand; the
    occupancy of another topology is refused by name."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, 4, 5, generator=g, dtype=torch.float64)
    y, T_b, U_b = torch.tensor([[1, 2, 3], [3, 1, 0]]), torch.tensor([7, 5]), torch.tensor([3, 2])
    occ = rnnt_lattice.occupancy(x, y, T_b, U_b, blank=0, rnnt_type=rnnt_type)
    for method in ("exact", "k2"):
        got = rnnt_lattice.prune_ranges(occ, 2, method=method)
        want = rnnt_lattice.prune_ranges((occ.gamma_blank, occ.gamma_label), 2, method=method,
                                         logit_lengths=T_b, target_lengths=U_b,
                                         rnnt_type=rnnt_type)
        assert torch.equal(got.ranges, want.ranges) and torch.equal(got.covered, want.covered)
    tdt = rnnt_lattice.occupancy(torch.randn(2, 7, 4, 8, generator=g), y, T_b, U_b, blank=-1,
                                 topology=rnnt_lattice.topology.tdt([0, 1, 2]))
    with pytest.raises(ValueError, match="of k2's types .* got one of topology 'tdt'"):
        rnnt_lattice.prune_ranges(tdt, 2)


def _k2_loop(gamma_blank, gamma_label, t_end, u_end, R, regular):
    """docs/variants.md A.6, get_rnnt_prune_ranges steps 3-6, one frame at a time (R
    already set)."""
    B, T, U1 = gamma_blank.shape
    out = torch.empty(B, T, R, dtype=torch.int64)
    R_e = R if regular else 2
    for b in range(B):
        s = []
        for t in range(T):
            if t >= int(t_end[b]) - 1:
                s.append(max(int(u_end[b]) - R + 1, 0))
                continue
            scores = [float(gamma_blank[b, t, k:k + R].sum()) - (float(gamma_label[b, t, k - 1]) if k else 0.0)
                      for k in range(U1 - R + 1)]
            s.append(scores.index(max(scores)))                       # the first argmax
        s = [min(s[t:]) for t in range(T)]
        x = [(R_e - 1) * t - s[t] for t in range(T)]
        x = [max(min(x[t:]), 0) for t in range(T)]
        s = [(R_e - 1) * t - x[t] for t in range(T)]
        out[b] = torch.tensor(s)[:, None] + torch.arange(R)
    return out


def _check_constraints(ranges, t_end, u_end, R, regular, end_required=True):
    B, T, Rr = ranges.shape
    assert Rr == R
    assert (ranges == ranges[..., :1] + torch.arange(R)).all()
    s = ranges[..., 0]
    assert (s[:, 0] == 0).all()
    steps = s[:, 1:] - s[:, :-1]
    assert (steps >= 0).all() and (steps <= (R - 1 if regular else 1)).all()
    for b in range(B):
        tb, ub = int(t_end[b]), int(u_end[b])
        if tb >= 1 and end_required:
            assert (s[b, tb - 1:] == max(ub - R + 1, 0)).all(), (b, s[b])


def _lattice(seed, B=4, T=9, U=5, V=6, peaked=0.0, rnnt_type="regular"):
    g = torch.Generator().manual_seed(seed)
    T_b = torch.randint(1, T + 1, (B,), generator=g)
    T_b[0] = T
    U_b = torch.randint(0, U + 1, (B,), generator=g)
    U_b[0] = U
    if rnnt_type != "regular":
        U_b = torch.minimum(U_b, T_b)
    targets = torch.randint(1, V, (B, U), generator=g)
    am = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    lm = torch.randn(B, U + 1, V, generator=g, dtype=torch.float64)
    if peaked:
        am[..., 0] += peaked                               # a blank-heavy, sharp lattice
        lm = lm + peaked * torch.nn.functional.one_hot(
            torch.nn.functional.pad(targets, (0, 1)), V).double()
    _, occ = rnnt_lattice.rnnt_loss_simple(lm, am, targets, T_b, U_b, blank=0, rnnt_type=rnnt_type,
                                           return_occupations=True)
    return occ


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
@pytest.mark.parametrize("R", [2, 3, 5])
def test_k2_rule_matches_loop_and_exact_covers_more(seed, rnnt_type, R):
    occ = _lattice(seed, peaked=4.0 * (seed % 2), rnnt_type=rnnt_type)
    regular = rnnt_type == "regular"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        k2 = rnnt_lattice.prune_ranges(occ, R, method="k2")
        ex = rnnt_lattice.prune_ranges(occ, R, method="exact")
    R_used = k2.window
    want = _k2_loop(occ.gamma_blank, occ.gamma_label, occ.logit_lengths, occ.target_lengths, R_used, regular)
    assert torch.equal(k2.ranges, want)
    feasible = (occ.logit_lengths - 1 >= (occ.target_lengths - R_used + 1).clamp(min=0)).all() or regular
    _check_constraints(k2.ranges, occ.logit_lengths, occ.target_lengths, R_used, regular,
                       end_required=bool(feasible))
    _check_constraints(ex.ranges, occ.logit_lengths, occ.target_lengths, ex.window, regular)
    assert (ex.ranges <= occ.gamma_blank.shape[-1] - 1).all()
    if ex.window == k2.window:
        assert (ex.covered >= k2.covered - 1e-12).all()
    # covered is the share of occ inside the windows
    node = occ.node
    inside = torch.gather(node, 2, ex.ranges).sum((1, 2)) / node.sum((1, 2))
    assert torch.allclose(ex.covered, inside)


def test_k2_rule_hand_example():
    """One path: label at (0,0), blanks at (0,1) (1,1), label at (2,1), blanks (2,2) (3,2)."""
    gb = torch.zeros(1, 4, 3, dtype=torch.float64)
    gl = torch.zeros(1, 4, 3, dtype=torch.float64)
    gl[0, 0, 0] = gb[0, 0, 1] = gb[0, 1, 1] = gl[0, 2, 1] = gb[0, 2, 2] = gb[0, 3, 2] = 1.0
    T_b, U_b = torch.tensor([4]), torch.tensor([2])
    # scores (R = 2): t=0: [1, 0] -> 0; t=1: [1, 1] -> 0 (first); t=2: [0, 1] -> 1; t=3: tail 1.
    for method in ("k2", "exact"):
        win = rnnt_lattice.prune_ranges((gb, gl), 2, method=method, logit_lengths=T_b, target_lengths=U_b)
        assert win.ranges.tolist() == [[[0, 1], [0, 1], [1, 2], [1, 2]]]
        assert float(win.covered[0]) == 1.0
    # An argmax that jumps ahead is repaired: frame 1 asks for 2, frame 2 for 0.
    gb2 = torch.zeros(1, 4, 4, dtype=torch.float64)
    gb2[0, 1, 2:] = 1.0
    gb2[0, 2, :2] = 1.0
    win = rnnt_lattice.prune_ranges((gb2, torch.zeros_like(gb2)), 2, method="k2",
                                    logit_lengths=T_b, target_lengths=torch.tensor([3]))
    # argmax [0, 2, 0], tail 2 -> suffix min [0, 0, 0, 2] -> steps <= 1: [0, 0, 1, 2]
    assert win.s_begin.tolist() == [[0, 0, 1, 2]]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("regular", [True, False])
def test_exact_dp_is_optimal_by_enumeration(seed, regular):
    g = torch.Generator().manual_seed(seed)
    T, U1, R = 5, 5, 2
    node = torch.rand(1, T, U1, generator=g, dtype=torch.float64) ** 4
    T_b = torch.tensor([T - seed % 2])
    U_b = torch.tensor([U1 - 1 - seed % 3])
    node = node * (torch.arange(T)[None, :, None] < T_b).double() * (torch.arange(U1) <= U_b).double()
    win = rnnt_lattice.prune_ranges((node, torch.zeros_like(node)), R, method="exact", logit_lengths=T_b,
                                    target_lengths=U_b, rnnt_type="regular" if regular else "modified")
    last = max(int(U_b) - R + 1, 0)
    step = R - 1 if regular else 1
    best = 0.0
    for s in itertools.product(range(last + 1), repeat=int(T_b)):
        if s[0] != 0 or s[-1] != last or any(not 0 <= b - a <= step for a, b in zip(s, s[1:])):
            continue
        best = max(best, sum(float(node[0, t, s[t]:s[t] + R].sum()) for t in range(int(T_b))))
    assert abs(float(win.covered[0]) * float(node.sum()) - best) < 1e-12


def test_all_targets_empty():
    """S = 0: k2 crashes (R -> S + 1 = 1 < 2); here R' = 1 and every window is [0]."""
    lm, am, targets, T_b, U_b, blank = make_simple(Case("U0", (5, 2), (0, 0), 3, 1))
    loss, occ = rnnt_lattice.rnnt_loss_simple(lm, am, targets, T_b, U_b, blank=blank,
                                              return_occupations=True)
    assert torch.isfinite(loss)
    for method in ("k2", "exact"):
        win = rnnt_lattice.prune_ranges(occ, 4, method=method)
        assert win.ranges.shape == (2, 5, 1) and (win.ranges == 0).all()
        assert (win.covered == 1).all()


def test_R_raised_with_warning():
    occ = _lattice(0, B=2, T=3, U=7)                       # U_b = 7 in T_b = 3 frames: R >= 4
    for method in ("k2", "exact"):
        with pytest.warns(RuntimeWarning, match="R=2"):
            win = rnnt_lattice.prune_ranges(occ, 2, method=method)
        assert win.window == max(int(((occ.target_lengths - 1) // occ.logit_lengths + 2).max()), 2)
        _check_constraints(win.ranges, occ.logit_lengths, occ.target_lengths, win.window, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rnnt_lattice.prune_ranges(occ, 20).window == 8     # capped at U + 1, no warning
    # modified, T_b = U_b: the exact DP needs R >= 2; k2 keeps R = 1 (and misses the end)
    occ = _lattice(1, B=1, T=4, U=4, rnnt_type="modified")
    with pytest.warns(RuntimeWarning):
        assert rnnt_lattice.prune_ranges(occ, 1).window == 2
    assert rnnt_lattice.prune_ranges(occ, 1, method="k2").window == 1


def test_boundary_ranges_use_end_symbol_and_frame():
    case = Case("b", (8, 8), (5, 5), 6, 0)
    lm, am, targets, T_b, U_b, blank = make_simple(case, seed=4)
    boundary = torch.tensor([[0, 0, 5, 8], [0, 0, 3, 6]])
    _, occ = rnnt_lattice.rnnt_loss_simple(lm, am, targets, T_b, U_b, blank=blank, boundary=boundary,
                                           return_occupations=True)
    for method in ("k2", "exact"):
        win = rnnt_lattice.prune_ranges(occ, 3, method=method)
        _check_constraints(win.ranges, boundary[:, 3], boundary[:, 2], 3, True)


def test_do_rnnt_pruning():
    g = torch.Generator().manual_seed(0)
    am, lm = torch.randn(2, 6, 3, generator=g), torch.randn(2, 4, 5, generator=g)
    s = torch.tensor([[0, 0, 1, 1, 2, 2], [0, 1, 1, 2, 2, 2]])
    ranges = s[..., None] + torch.arange(2)
    am_p, lm_p = rnnt_lattice.do_rnnt_pruning(am, lm, ranges)
    assert am_p.shape == (2, 6, 2, 3) and lm_p.shape == (2, 6, 2, 5)
    for b, t, k in itertools.product(range(2), range(6), range(2)):
        assert torch.equal(am_p[b, t, k], am[b, t])
        assert torch.equal(lm_p[b, t, k], lm[b, ranges[b, t, k]])
    # Backward: each lm row gets the sum of the gradients of the window entries that read it.
    lm_ = lm.clone().requires_grad_(True)
    w = torch.randn(2, 6, 2, 5, generator=g, dtype=lm.dtype)
    (rnnt_lattice.do_rnnt_pruning(am, lm_, ranges)[1] * w).sum().backward()
    want = torch.zeros_like(lm)
    for b, t, k in itertools.product(range(2), range(6), range(2)):
        want[b, ranges[b, t, k]] += w[b, t, k]
    assert torch.allclose(lm_.grad, want)


@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
def test_windows_keep_a_path(rnnt_type):
    """The lattice restricted to the windows (arcs leaving nodes outside them -inf, as k2's
    pruned loss) still has a path for both methods: a finite loss >= the full one, equal
    to it when nothing is pruned."""
    g = torch.Generator().manual_seed(2)
    B, T, U, V = 3, 9, 5, 6
    T_b, U_b = torch.tensor([9, 7, 5]), torch.tensor([5, 2, 4])
    am = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    lm = torch.randn(B, U + 1, V, generator=g, dtype=torch.float64)
    targets = torch.randint(1, V, (B, U), generator=g)
    kw = dict(rnnt_type=rnnt_type, reduction="none")
    full, occ = rnnt_lattice.rnnt_loss_simple(lm, am, targets, T_b, U_b, blank=0,
                                              return_occupations=True, **kw)
    logp = torch.log_softmax(_full(lm, am), -1)
    for method, R in itertools.product(("k2", "exact"), (2, 3, U + 1)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            win = rnnt_lattice.prune_ranges(occ, R, method=method)
        inside = torch.zeros(B, T, U + 1, dtype=torch.bool).scatter(2, win.ranges, True)
        pruned = rnnt_lattice.rnnt_loss(logp.masked_fill(~inside[..., None], float("-inf")), targets,
                                        T_b, U_b, 0, fused_log_softmax=False, backend="torch", **kw)
        assert torch.isfinite(pruned).all(), (method, R, win.ranges)
        assert (pruned >= full - 1e-9).all()
        if win.window == U + 1:
            assert rel_err(pruned, full) < TOL
        # The same through the pipeline: the joiner's inputs on the windows, the pruned loss.
        am_p, lm_p = rnnt_lattice.do_rnnt_pruning(am, lm, win.ranges)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)      # pruned rows: the torch backend
            k2_like = rnnt_lattice.rnnt_loss_pruned(am_p + lm_p, targets, win.ranges, T_b, U_b,
                                                    blank=0, **kw)
        assert rel_err(k2_like, pruned) < TOL


@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
def test_masked_classes_and_dead_rows_equal_full_joiner(rnnt_type):
    """-inf entries of am or lm are masked classes; a joint row with no finite entry (a dead
    am row, or disjoint supports) has no arc, as in rnnt_loss."""
    case = CASES[-1]
    lm, am, targets, T_b, U_b, blank = make_simple(case, seed=9)
    blank_id = blank % case.V
    am = am.clone()
    lm = lm.clone()
    am[0, 2, [1, 3]] = float("-inf")                         # masked classes
    lm[1, 1, 4] = float("-inf")
    am[1, 3] = float("-inf")                                 # a dead frame: no path
    y2 = int(targets[2, 2])                                  # node (5, 2) of sequence 2: disjoint
    lm[2, 2, :] = float("-inf")                              # supports (no blank at u = 2 at all)
    lm[2, 2, y2] = 0.0
    am[2, 5, :] = float("-inf")
    am[2, 5, [blank_id, next(v for v in range(case.V) if v not in (blank_id, y2))]] = 0.0
    up = upstream_weights(case.B)
    kw = dict(rnnt_type=rnnt_type, reduction="none")
    got = _grads(lambda l, a: rnnt_lattice.rnnt_loss_simple(l, a, targets, T_b, U_b, blank=blank, **kw),
                 lm, am, up)
    want = _grads(lambda l, a: rnnt_lattice.rnnt_loss(_full(l, a), targets, T_b, U_b, blank,
                                                      backend="torch", **kw), lm, am, up)
    assert torch.isinf(got[0][1]) and torch.isfinite(got[0][0])
    assert torch.isfinite(got[0][2]) == (rnnt_type != "constrained")   # it needs b(t, 2)
    for g, w in zip(got, want):
        assert rel_err(g, w) < TOL


def _disagreeing_peaks(spread: float, dtype):
    """am and lm (B=2, T=6, U=3, V=5) whose rows peak at different classes, each row
    spanning ``spread``: the joint max of a node lies up to ``spread`` below the sum of the
    row maxima, where a product of the rows' exps underflows."""
    g = torch.Generator().manual_seed(2)
    am = spread * torch.rand(2, 6, 5, generator=g, dtype=torch.float64)
    lm = spread * torch.rand(2, 4, 5, generator=g, dtype=torch.float64)
    am[:, :, 1] = spread                                        # am peaks at class 1
    lm[:, :, 2] = spread                                        # lm at class 2
    am[:, :, 2] = lm[:, :, 1] = 0.0
    targets, T_b, U_b = torch.tensor([[1, 2, 3], [4, 1, 2]]), torch.tensor([6, 5]), torch.tensor([3, 2])
    return lm.to(dtype), am.to(dtype), targets, T_b, U_b


@pytest.mark.parametrize("fn", ["simple", "smoothed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spread", [100.0, 400.0, 1000.0, 1e4])
def test_large_logit_spreads_equal_full_joiner(fn, dtype, spread):
    """The normaliser stays exact and finite where the full loss on am + lm is, whatever
    the spread of the logits (float32 underflowed at ~110, float64 at ~650: those nodes
    are recomputed in the log domain). Loss and gradients against the full loss in float64,
    to the output dtype's rounding."""
    lm, am, targets, T_b, U_b = _disagreeing_peaks(spread, dtype)
    kw = dict(lm_only_scale=0.0, am_only_scale=0.0) if fn == "smoothed" else {}
    loss_fn = getattr(rnnt_lattice, f"rnnt_loss_{fn}")
    up = upstream_weights(2)
    got = _grads(lambda l, a: loss_fn(l, a, targets, T_b, U_b, blank=0, reduction="none", **kw),
                 lm, am, up)
    want = _grads(lambda l, a: rnnt_lattice.rnnt_loss(_full(l, a), targets, T_b, U_b, 0,
                                                      backend="torch", reduction="none"),
                  lm.double(), am.double(), up)
    # The output's rounding, plus float64's on sums of logits of size ~spread.
    tol = 8 * torch.finfo(dtype).eps + 16 * spread * torch.finfo(torch.float64).eps
    assert torch.isfinite(got[0]).all()
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol * max(1.0, float(w.abs().max())))


def test_selfcheck_rescue_on_the_default_backend():
    """``rnnt-lattice check``'s rescue check as the full CPU check runs it (random am and
    lm, their peaks 1000 nats apart, the smoothed loss with zero scales, the default
    backend): am's unigram mass is subnormal there, and the smoothing's gradient of it
    must take the scale (1e-20 for a zero one) before dividing by it (divided first, it
    was inf)."""
    from rnnt_lattice import selfcheck
    ctx = selfcheck.Context("cpu", "auto", selfcheck.plan_for("cpu", "default"), "default")
    line = selfcheck.check_simple_rescue(ctx, ctx.plan.tool_shape)
    assert "smoothed grads" in line, line


def test_transposed_am_backward():
    """am as a Conv1d head gives it, ``(B, V, T)`` transposed: the backward of the smoothed
    loss (which reads am's exps as rows) equals that of a contiguous copy."""
    g = torch.Generator().manual_seed(5)
    am_t = torch.randn(2, 5, 6, generator=g).transpose(1, 2)            # (B, T, V), strided
    lm = torch.randn(2, 4, 5, generator=g)
    args = (torch.tensor([[1, 2, 3], [4, 1, 0]]), torch.tensor([6, 5]), torch.tensor([3, 2]))
    grads = []
    for a in (am_t, am_t.contiguous()):
        a = a.detach().clone() if a.is_contiguous() else a.detach().requires_grad_()
        a.requires_grad_()
        l = lm.clone().requires_grad_()
        rnnt_lattice.rnnt_loss_smoothed(l, a, *args, blank=0).backward()
        grads.append((a.grad, l.grad))
    for x, y in zip(*grads):
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize("fn", ["simple", "smoothed"])
def test_cost_overflowing_the_output_dtype_has_zero_gradient(fn):
    """A float32 cost finite in the float64 lattice but beyond float32's range is +inf, and
    like every infinite loss it has a zero gradient (0 with zero_infinity)."""
    lm = torch.zeros(1, 2, 3)
    am = torch.zeros(1, 4, 3)
    am[0, :, 1] = 3.0e38                        # the label 2 is 3e38 below class 1 on every frame
    targets, T_b, U_b = torch.tensor([[2]]), torch.tensor([4]), torch.tensor([1])
    loss_fn = getattr(rnnt_lattice, f"rnnt_loss_{fn}")
    for zero_infinity in (False, True):
        a, l = am.clone().requires_grad_(), lm.clone().requires_grad_()
        cost = loss_fn(l, a, targets, T_b, U_b, blank=0, reduction="sum", zero_infinity=zero_infinity)
        cost.backward()
        assert float(cost.detach()) == (0.0 if zero_infinity else float("inf"))
        assert torch.equal(a.grad, torch.zeros_like(a)) and torch.equal(l.grad, torch.zeros_like(l))
    want = loss_fn(lm.double(), am.double(), targets, T_b, U_b, blank=0)
    assert torch.finfo(torch.float32).max < float(want) < float("inf")


def test_covered_is_nan_for_nan_occupations():
    """prune_ranges' covered share of a sequence whose occupations are NaN is NaN (not 1)."""
    gb = torch.rand(2, 4, 3, dtype=torch.float64)
    gl = torch.rand(2, 4, 3, dtype=torch.float64)
    gb[1] = float("nan")
    win = rnnt_lattice.prune_ranges((gb, gl), 2, logit_lengths=torch.tensor([4, 4]),
                                    target_lengths=torch.tensor([2, 2]))
    assert torch.isfinite(win.covered[0]) and torch.isnan(win.covered[1])


def test_covered_is_computed_on_first_use(monkeypatch):
    """``PruneRanges.covered`` costs nothing until it is read (k2's recipes read only the
    ranges), then once: the share of the occupancy mass inside the windows."""
    from rnnt_lattice.pruned import windows
    calls = []
    real = windows._covered
    monkeypatch.setattr(windows, "_covered", lambda *a: calls.append(1) or real(*a))
    occ = _lattice(2, B=2, T=5, U=4)
    win = rnnt_lattice.prune_ranges(occ, 2, method="k2")
    assert not calls
    node = occ.gamma_blank + occ.gamma_label
    inside = torch.gather(node, 2, win.ranges).sum((1, 2)) / node.sum((1, 2))
    assert torch.allclose(win.covered, inside) and win.covered is win.covered
    assert len(calls) == 1


def test_integer_like_arguments():
    """NumPy integers are ints (anything operator.index takes) for blank and R, and int32
    ranges are ranges, as for rnnt_loss_pruned."""
    import numpy as np
    lm, am, targets, T_b, U_b, blank = make_simple(CASES[-1], seed=1, poison=False)
    loss, occ = rnnt_lattice.rnnt_loss_simple(lm, am, targets, T_b, U_b, blank=np.int64(blank),
                                              return_occupations=True)
    assert torch.equal(loss, rnnt_lattice.rnnt_loss_simple(lm, am, targets, T_b, U_b, blank=blank))
    win = rnnt_lattice.prune_ranges(occ, np.int32(3))
    assert torch.equal(win.ranges, rnnt_lattice.prune_ranges(occ, 3).ranges)
    x, y = torch.randn(lm.shape[0], am.shape[1], 4), torch.randn(lm.shape[0], lm.shape[1], 6)
    for a, b in zip(rnnt_lattice.do_rnnt_pruning(x, y, win.ranges.int()),
                    rnnt_lattice.do_rnnt_pruning(x, y, win.ranges)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_inputs(dtype):
    lm, am, targets, T_b, U_b, blank = make_simple(CASES[-1], seed=4, poison=False)
    lm_, am_ = lm.to(dtype).requires_grad_(True), am.to(dtype).requires_grad_(True)
    loss = rnnt_lattice.rnnt_loss_simple(lm_, am_, targets, T_b, U_b, blank=blank)
    loss.backward()
    loss = loss.detach()
    want = rnnt_lattice.rnnt_loss_simple(lm.to(dtype).double(), am.to(dtype).double(), targets, T_b,
                                         U_b, blank=blank)
    assert loss.dtype == torch.float32 and abs(float(loss) - float(want)) < 1e-4 * max(1.0, float(want))
    assert am_.grad.dtype == dtype and torch.isfinite(am_.grad.float()).all()


def test_exact_windows_of_a_batch_with_an_impossible_sequence():
    """modified, T_b < U_b: that sequence has no path; it does not raise R for the batch,
    and its windows stay valid (start 0, steps <= 1, within [0, U])."""
    gb = torch.rand(2, 6, 6, dtype=torch.float64)
    T_b, U_b = torch.tensor([6, 2]), torch.tensor([5, 5])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        win = rnnt_lattice.prune_ranges((gb, gb), 2, logit_lengths=T_b, target_lengths=U_b,
                                        rnnt_type="modified")
    assert win.window == 2
    s = win.s_begin
    assert (s[:, 0] == 0).all() and (s.diff(dim=1) >= 0).all() and (s.diff(dim=1) <= 1).all()
    assert s[0, -1] == 4 and (win.ranges <= 5).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")       # (the interpreter's masked lanes)
@pytest.mark.parametrize("backend", backends.ALL)
@pytest.mark.parametrize("scales", [None, (0.1, 0.1)], ids=["simple", "smoothed"])
def test_confident_am_keeps_its_digits(scales, backend, margin=20.0):
    """A confident simple joiner: am favours the blank by ``margin`` nats, and its label at
    frame 2u + 1 (k2's modified lattice: a label takes its frame). float32 am and lm give
    the float64 naive formula's losses and gradients on the same rounded values, the
    gradients (themselves ~ e^-margin) within their float32 rounding of their own scale.
    (The entries the arcs read came back in am's dtype: their gradient, ``gamma`` or
    ``s_am gamma`` near 1, was rounded to float32 before ``p`` times it was taken off, and
    the smoothed loss's am gradient was 0.8% of its scale off at 20 nats; math.md 4.1.)"""
    if backend == "triton":
        _kernel_backend(backend)
    B, T, U, V = 2, 12, 4, 40
    lm, am, targets, T_b, U_b, blank = make_simple(Case("confident", (T, T - 2), (U, U - 1), V,
                                                        0, T=T, U=U), seed=5, poison=False)
    am[..., blank] += margin
    for b in range(B):
        for u in range(int(U_b[b])):
            am[b, 2 * u + 1, blank] -= margin
            am[b, 2 * u + 1, targets[b, u]] += margin
    lm, am = lm.float(), am.float()
    up = upstream_weights(B)
    kw = dict(rnnt_type="modified", reduction="none")
    if scales is None:
        got = _grads(lambda l, a: rnnt_lattice.rnnt_loss_simple(
            l, a, targets, T_b, U_b, blank=blank, backend=backend, **kw), lm, am, up.float())
        want = _grads(lambda l, a: rnnt_lattice.rnnt_loss(
            _full(l, a), targets, T_b, U_b, blank, backend="torch", **kw),
            lm.double(), am.double(), up)
    else:
        got = _grads(lambda l, a: rnnt_lattice.rnnt_loss_smoothed(
            l, a, targets, T_b, U_b, blank=blank, lm_only_scale=scales[0],
            am_only_scale=scales[1], backend=backend, **kw), lm, am, up.float())
        want = _grads(lambda l, a: rnnt_lattice.rnnt_loss(
            _smoothed_naive(l, a, targets, blank, *scales), targets, T_b, U_b, blank,
            fused_log_softmax=False, backend="torch", **kw), lm.double(), am.double(), up)
    costs, g_lm, g_am = got
    if scales is None:                                                  # confident
        assert want[0].max() < 1e-3
    assert ((costs.double() - want[0]).abs() / want[0]).max() <= 64 * 2.0**-23
    for name, g, w in (("lm", g_lm, want[1]), ("am", g_am, want[2])):
        assert (g.double() - w).abs().max() / w.abs().max() <= 64 * 2.0**-23, name


@pytest.mark.filterwarnings("ignore::RuntimeWarning")       # (the interpreter's masked lanes)
@pytest.mark.parametrize("backend", backends.ALL)
def test_an_lm_offset_costs_the_smoothed_loss_no_digits(backend):
    """float32 lm rows around 1e4 (a common offset, which no softmax sees) give the smoothed
    loss and both gradients of the float64 naive formula on the same rounded values. (The
    lm-only normaliser was taken in lm's dtype: rounded to its ulp, 5e-4 at 1e4, it moved
    every arc weight, and the gradients were 6e-5 of their scale off.)"""
    if backend == "triton":
        _kernel_backend(backend)
    case = Case("offset", (9, 7), (3, 2), 40, 0, T=9, U=3)
    lm, am, targets, T_b, U_b, blank = make_simple(case, seed=3, poison=False)
    lm, am = (lm + 1e4).float(), am.float()
    up = upstream_weights(case.B)
    kw = dict(rnnt_type="modified", reduction="none")
    got = _grads(lambda l, a: rnnt_lattice.rnnt_loss_smoothed(
        l, a, targets, T_b, U_b, blank=blank, lm_only_scale=0.1, am_only_scale=0.1,
        backend=backend, **kw), lm, am, up.float())
    want = _grads(lambda l, a: rnnt_lattice.rnnt_loss(
        _smoothed_naive(l, a, targets, blank, 0.1, 0.1), targets, T_b, U_b, blank,
        fused_log_softmax=False, backend="torch", **kw), lm.double(), am.double(), up)
    assert ((got[0].double() - want[0]).abs() / want[0]).max() <= 64 * 2.0**-23
    for name, g, w in (("lm", got[1], want[1]), ("am", got[2], want[2])):
        assert (g.double() - w).abs().max() / w.abs().max() <= 64 * 2.0**-23, name


# --------------------------------------------------------------------------- backends
# The lattice of the simple/smoothed losses runs on the backend's kernel (Numba's
# kernels.lattice; Triton's _lattice_kernel, here through the interpreter that
# conftest.py turns on); the arc weights are the same PyTorch code for every backend, so
# the kernels must reproduce backend="torch" to float64 rounding, and in float32 to a few
# ulps of the float32 outputs.
KERNEL_BACKENDS = backends.KERNELS
BACKEND_CASES = CASES + cases.pick("T1_U2")     # one frame: modified has no path
BACKEND_TOL = {torch.float64: 1e-12, torch.float32: 64 * 2.0**-23}
# The interpreter's NumPy warns on -inf - -inf in lanes that the kernel then masks out.
interpreter_lanes = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _kernel_backend(backend):
    if backend == "triton":
        backends.need_triton()
        from rnnt_lattice import gpu
        if not gpu.INTERPRETED:                                         # pragma: no cover
            pytest.skip("rnnt_lattice.gpu was imported before TRITON_INTERPRET=1")
    return backend


def _run(fn, lm, am, targets, T_b, U_b, blank, up, backend, **kw):
    """``(costs, lm.grad, am.grad, gamma_blank, gamma_label)`` of ``fn`` (reduction none)."""
    lm = lm.detach().clone().requires_grad_(True)
    am = am.detach().clone().requires_grad_(True)
    costs, occ = fn(lm, am, targets, T_b, U_b, blank=blank, reduction="none",
                    return_occupations=True, backend=backend, **kw)
    torch.autograd.backward(costs, up.to(costs.dtype))
    return costs.detach(), lm.grad, am.grad, occ.gamma_blank, occ.gamma_label


def _assert_same(got, want, tol):
    for name, g, w in zip(("costs", "lm.grad", "am.grad", "gamma_blank", "gamma_label"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert rel_err(g, w) < tol, (name, rel_err(g, w))


@interpreter_lanes
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("case", BACKEND_CASES, ids=[c.name for c in BACKEND_CASES])
@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_kernel_backends_equal_torch(backend, case, rnnt_type, dtype):
    """Losses, gradients w.r.t. lm and am and occupations of the simple loss: ragged,
    NaN-poisoned padding, T_b = 0, U_b = 0, one frame, delay penalty, signed upstream."""
    _kernel_backend(backend)
    lm, am, targets, T_b, U_b, blank = make_simple(case, seed=11, dtype=dtype)
    up = upstream_weights(case.B)
    kw = dict(rnnt_type=rnnt_type, delay_penalty=0.3)
    want = _run(rnnt_lattice.rnnt_loss_simple, lm, am, targets, T_b, U_b, blank, up, "torch", **kw)
    got = _run(rnnt_lattice.rnnt_loss_simple, lm, am, targets, T_b, U_b, blank, up, backend, **kw)
    _assert_same(got, want, BACKEND_TOL[dtype])
    # Impossible sequences: +inf and an exactly zero gradient; padding: exactly zero.
    inf = torch.isinf(got[0])
    assert (got[1][inf] == 0).all() and (got[2][inf] == 0).all()
    assert (got[2][torch.isnan(am)] == 0).all() and (got[1][torch.isnan(lm)] == 0).all()


@interpreter_lanes
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[5]], ids=["ragged", "U0", "longer"])
@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
def test_kernel_backends_smoothed_equal_torch(backend, case, rnnt_type):
    _kernel_backend(backend)
    lm, am, targets, T_b, U_b, blank = make_simple(case, seed=12, poison=False)
    up = upstream_weights(case.B)
    kw = dict(rnnt_type=rnnt_type, delay_penalty=0.1, lm_only_scale=0.2, am_only_scale=0.15)
    want = _run(rnnt_lattice.rnnt_loss_smoothed, lm, am, targets, T_b, U_b, blank, up, "torch", **kw)
    got = _run(rnnt_lattice.rnnt_loss_smoothed, lm, am, targets, T_b, U_b, blank, up, backend, **kw)
    _assert_same(got, want, BACKEND_TOL[torch.float64])


@interpreter_lanes
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
def test_kernel_backends_boundary(backend, rnnt_type):
    _kernel_backend(backend)
    case = Case("boundary", (6, 5, 7), (3, 2, 4), 6, 0, T=8, U=5)
    lm, am, targets, T_b, U_b, blank = make_simple(case, seed=3)
    boundary = torch.tensor([[0, 0, 3, 6], [1, 1, 2, 5], [1, 2, 3, 6]])
    up = upstream_weights(case.B)
    kw = dict(rnnt_type=rnnt_type, delay_penalty=0.2, boundary=boundary)
    want = _run(rnnt_lattice.rnnt_loss_simple, lm, am, targets, T_b, U_b, blank, up, "torch", **kw)
    got = _run(rnnt_lattice.rnnt_loss_simple, lm, am, targets, T_b, U_b, blank, up, backend, **kw)
    assert torch.isfinite(got[0]).all()
    _assert_same(got, want, BACKEND_TOL[torch.float64])


@interpreter_lanes
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kernel_backends_nan_and_zero_upstream(backend):
    """A NaN inside sequence 0's lattice: NaN loss and occupations, as the reference; an
    upstream gradient of exactly 0 on it gives an exactly zero gradient."""
    _kernel_backend(backend)
    lm, am, targets, T_b, U_b, blank = make_simple(CASES[-1], seed=2)
    am = am.clone()
    am[0, 1, 3] = float("nan")
    for up in (upstream_weights(3), torch.tensor([0.0, 1.5, -0.5], dtype=torch.float64)):
        want = _run(rnnt_lattice.rnnt_loss_simple, lm, am, targets, T_b, U_b, blank, up, "torch")
        got = _run(rnnt_lattice.rnnt_loss_simple, lm, am, targets, T_b, U_b, blank, up, backend)
        assert torch.isnan(got[0][0]) and torch.isfinite(got[0][1:]).all()
        assert torch.isnan(got[3][0]).any() and torch.isfinite(got[3][1:]).all()
        _assert_same(got, want, BACKEND_TOL[torch.float64])
        if up[0] == 0:
            assert (got[1][0] == 0).all() and (got[2][0] == 0).all()
            assert torch.isfinite(got[1]).all() and torch.isfinite(got[2]).all()


@interpreter_lanes
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_kernel_backends_reductions_zero_infinity(backend, reduction, zero_infinity):
    _kernel_backend(backend)
    lm, am, targets, T_b, U_b, blank = make_simple(CASES[4])            # T_b = 0: +inf
    out = {}
    for be in ("torch", backend):
        l_, a_ = lm.clone().requires_grad_(True), am.clone().requires_grad_(True)
        loss = rnnt_lattice.rnnt_loss_simple(l_, a_, targets, T_b, U_b, blank=blank,
                                             reduction=reduction, zero_infinity=zero_infinity,
                                             backend=be)
        loss.sum().backward()
        out[be] = (loss.detach(), l_.grad, a_.grad)
    for g, w in zip(out[backend], out["torch"]):
        assert rel_err(g, w) < BACKEND_TOL[torch.float64]
    assert (out[backend][2][0] == 0).all()                              # the +inf sequence


def test_backend_argument():
    lm, am, targets, T_b, U_b, blank = make_simple(CASES[1])
    with pytest.raises(ValueError, match="backend"):
        rnnt_lattice.rnnt_loss_simple(lm, am, targets, T_b, U_b, blank=blank, backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        rnnt_lattice.rnnt_loss_smoothed(lm, am, targets, T_b, U_b, blank=blank, backend=None)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_smoothed_am_padding_never_read(case):
    """The smoothed loss reads lm's padding (k2's unigram) but never am's: NaN there changes
    nothing, and its gradient is exactly 0."""
    lm, am, targets, T_b, U_b, blank = make_simple(case, seed=3, poison=False)
    pad = (torch.arange(am.shape[1])[None] >= T_b[:, None])[..., None].expand_as(am)
    up = upstream_weights(case.B)
    kw = dict(rnnt_type="constrained", lm_only_scale=0.2, am_only_scale=0.3, reduction="none")
    want = _grads(lambda l, a: rnnt_lattice.rnnt_loss_smoothed(l, a, targets, T_b, U_b, blank=blank, **kw),
                  lm, am, up)
    got = _grads(lambda l, a: rnnt_lattice.rnnt_loss_smoothed(l, a, targets, T_b, U_b, blank=blank, **kw),
                 lm, am.masked_fill(pad, float("nan")), up)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-15
    assert (got[2][pad] == 0).all() and torch.isfinite(got[1]).all()


def _k2_vectorised(gamma_blank, gamma_label, t_end, u_end, R, regular):
    """fast_rnnt's get_rnnt_prune_ranges as written there (as_strided window sums in the
    occupations' dtype, then the repair), on our layout."""
    B, T, U1 = gamma_blank.shape
    py = gamma_blank.transpose(1, 2).contiguous()                          # (B, S+1, T)
    px = gamma_label[:, :, :-1].transpose(1, 2).contiguous()                # (B, S, T)
    st = py.stride()
    blk = torch.as_strided(py, (B, U1 - R + 1, R, T), (st[0], st[1], st[1], st[2])).sum(2)
    px_pad = torch.cat((torch.zeros_like(px[:, :1]), px), 1)
    s_begin = torch.argmax(blk - px_pad[:, :U1 - R + 1], 1)                 # (B, T)
    mask = torch.arange(T)[None] < t_end[:, None] - 1
    s_begin = torch.where(mask, s_begin, (u_end[:, None] - R + 1).clamp(min=0))
    return torch_backend.k2_adjust(s_begin, R if regular else 2)[..., None] + torch.arange(R)


@pytest.mark.parametrize("seed", range(3))
def test_k2_rule_on_float32_occupations_matches_k2_bitwise(seed):
    """Float32 occupations as fast_rnnt makes them: each frame's mass (~0.5) at one label
    position, ~1e-9 elsewhere, so the windows that hold the mass differ by their tiny edges.
    The window sums must be k2's own term-by-term sums: a difference of cumulative sums
    would cancel to noise of eps * 0.5 and pick other windows."""
    g = torch.Generator().manual_seed(seed)
    B, T, U1 = 4, 40, 16
    gb = 10.0 ** (-9 + 3 * torch.rand(B, T, U1, generator=g))
    gl = 10.0 ** (-9 + 3 * torch.rand(B, T, U1, generator=g))
    peak = torch.randint(0, U1, (B, T), generator=g).sort(1).values
    gb.scatter_(2, peak[..., None], 0.5)
    gb, gl = gb.float(), gl.float()
    T_b, U_b = torch.full((B,), T), torch.full((B,), U1 - 1)
    for R in (2, 3, 5):
        got = rnnt_lattice.prune_ranges((gb, gl), R, method="k2", logit_lengths=T_b,
                                        target_lengths=U_b).ranges
        assert torch.equal(got, _k2_vectorised(gb, gl, T_b, U_b, R, True))
