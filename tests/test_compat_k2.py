"""``rnnt_lattice.compat.k2`` (k2 and fast_rnnt) against independent references: a
Python-loop transcription of k2's recursion with autograd, on its own ``px``/``py`` layout
(docs/variants.md A.1), with ``px``/``py`` read from naive 4-D log-prob tensors (``log_softmax``
of the full logits; the smoothed and HAT formulas written out). So a layout conversion,
a transposition or an off-by-one at the boundary cannot hide. Every case has ragged
boundaries; symbols past ``boundary[:, 2]`` are padded with the blank (icefall) or with
out-of-range garbage, and some labels inside equal ``termination_symbol``."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import pytest
import torch

import rnnt_lattice
from rnnt_lattice.compat import k2

NEG_INF = -math.inf
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}    # relative; the lattices run in float64


def _lae(a, b):
    if float(a.detach()) == NEG_INF and float(b.detach()) == NEG_INF:
        return a.detach()               # no path: gradient 0 (logaddexp's would be NaN)
    return torch.logaddexp(a, b)


def k2_recursion(px, py, regular: bool, start=(0, 0), end=None):
    """k2's ``mutual_information_recursion`` for one sequence, as a Python loop with
    autograd: ``p[s0, t0] = 0``; regular ``p[s,t] = lae(p[s-1,t] + px[s-1,t],
    p[s,t-1] + py[s,t-1])``, else ``lae(p[s-1,t-1] + px[s-1,t-1], p[s,t-1] + py[s,t-1])``;
    returns ``p[s1, t1]``. ``px`` ``(S, T+1)`` or ``(S, T)``, ``py`` ``(S+1, T)``."""
    S1, T = py.shape
    s0, t0 = start
    s1, t1 = end if end is not None else (S1 - 1, T)
    neg = px.new_tensor(NEG_INF)
    p = {}
    for s in range(s0, s1 + 1):
        for t in range(t0, t1 + 1):
            if (s, t) == (s0, t0):
                p[s, t] = px.new_tensor(0.0)
                continue
            a = neg
            if s > s0:
                if regular:
                    a = p[s - 1, t] + px[s - 1, t]
                elif t > t0:
                    a = p[s - 1, t - 1] + px[s - 1, t - 1]
            b = p[s, t - 1] + py[s, t - 1] if t > t0 else neg
            p[s, t] = _lae(a, b)
    return p[s1, t1]


def ref_px_py(logp, symbols, blank, rnnt_type, boundary):
    """k2's ``(px, py)`` read from node log-probs ``logp`` ``(B, T, S+1, C)``, or from a
    pair ``(blank log-probs, label log-probs)`` of such tensors where a label's entry is not
    the blank's even for the blank's class (HAT)."""
    logp_blank, logp_label = logp if isinstance(logp, tuple) else (logp, logp)
    B, T, S1, C = logp_blank.shape
    S = S1 - 1
    py = logp_blank[..., blank].transpose(1, 2)                             # (B, S+1, T)
    y = symbols.clamp(0, C - 1)                     # entries past the end: read nowhere
    px = torch.gather(logp_label[:, :, :S], 3, y[:, None, :, None].expand(B, T, S, 1))
    px = px[..., 0].transpose(1, 2)                                         # (B, S, T)
    if rnnt_type == "regular":
        px = torch.cat([px, px.new_full((B, S, 1), NEG_INF)], 2)            # (B, S, T+1)
        if boundary is not None:    # no label on the end frame (k2's fix_for_boundary)
            t = torch.arange(T + 1)
            px = torch.where(t == boundary[:, 3, None, None], NEG_INF, px)
    if rnnt_type == "constrained":
        px = px + py[:, 1:, :]
    return px, py


def ref_scores(px, py, boundary, delay_penalty, regular):
    """``(B,)`` log-likelihoods by the loop, with k2's delay penalty on ``px``."""
    B, S, T1 = px.shape
    T = py.shape[2]
    out = []
    for b in range(B):
        start, end = ((0, 0), (S, T)) if boundary is None else \
            ((int(boundary[b, 0]), int(boundary[b, 1])), (int(boundary[b, 2]), int(boundary[b, 3])))
        t_end = end[1]
        pen = delay_penalty * ((t_end - 1) / 2 - torch.arange(T1, dtype=px.dtype))
        out.append(k2_recursion(px[b] + pen, py[b], regular, start, end))
    return torch.stack(out)


def hat_log_probs(logits):
    """HAT's node log-probs (blank's, labels'): a Bernoulli blank (class 0), then a softmax
    over the other classes; k2 reads a label's entry the same way for class 0 too."""
    x0 = logits[..., :1]
    labels = logits - torch.logsumexp(logits[..., 1:], -1, keepdim=True) + torch.nn.functional.logsigmoid(-x0)
    return torch.nn.functional.logsigmoid(x0).expand(logits.shape), labels


def smoothed_log_probs(lm, am, s_lm, s_am):
    """k2's smoothed node log-probs written out on ``(B, T, S+1, C)`` tensors
    (docs/variants.md A.5)."""
    uni = torch.softmax(lm, -1).mean((0, 1)) + torch.finfo(lm.dtype).tiny
    full = torch.log_softmax(am[:, :, None] + lm[:, None], -1)
    lm_only = torch.log_softmax(lm, -1)[:, None]
    am_only = (am + uni.log() - torch.logsumexp(am + uni.log(), -1, keepdim=True))[:, :, None]
    return (1 - s_lm - s_am) * full + s_lm * lm_only + s_am * am_only


def window_log_probs(logits, ranges, S, hat):
    """Node log-probs ``(B, T, S+1, C)`` of window logits ``(B, T, R, C)`` (HAT: the pair of
    ``hat_log_probs``); -inf outside the windows."""
    B, T, R, C = logits.shape
    full = logits.new_full((B, T, S + 1, C), NEG_INF)
    index = ranges[..., None].expand(B, T, R, C)
    if hat:
        return tuple(full.scatter(2, index, lp) for lp in hat_log_probs(logits))
    return full.scatter(2, index, torch.log_softmax(logits, -1))


# ---------------------------------------------------------------------------------------
# The case table
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class K2Case:
    name: str
    rnnt_type: str
    boundary: tuple | None      # rows [begin_symbol, begin_frame, end_symbol, end_frame]
    padding: str                # symbols past end_symbol: "blank" (icefall), "garbage", "none"
    blank_label: bool           # some labels inside equal termination_symbol
    blank: int


B, T, S, C = 3, 5, 3, 5
CASES = [
    K2Case("regular_blank_padded", "regular", ((0, 0, 3, 5), (0, 0, 1, 4), (0, 0, 0, 3)), "blank", False, 0),
    K2Case("regular_garbage_padded", "regular", ((0, 0, 2, 5), (0, 0, 3, 3), (0, 0, 1, 2)), "garbage", True, 2),
    K2Case("modified_blank_label", "modified", ((0, 0, 3, 5), (0, 0, 2, 3), (0, 0, 1, 4)), "blank", True, 0),
    K2Case("constrained_offsets", "constrained", ((1, 1, 3, 5), (0, 0, 2, 4), (0, 2, 1, 5)), "garbage", False, 4),
    K2Case("regular_no_boundary", "regular", None, "none", True, 1),
    K2Case("modified_no_boundary", "modified", None, "none", False, 0),
]
FUNCTIONS = ["rnnt_loss", "rnnt_loss_return_grad", "simple", "smoothed", "pruned",
             "pruned_return_grad", "hat"]


def make_case(case: K2Case, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    boundary = None if case.boundary is None else torch.tensor(case.boundary)
    others = torch.tensor([c for c in range(C) if c != case.blank])
    symbols = others[torch.randint(C - 1, (B, S), generator=g)]
    ends = torch.full((B,), S) if boundary is None else boundary[:, 2]
    past = torch.arange(S)[None, :] >= ends[:, None]
    if case.padding != "none":
        pad = torch.tensor([[99, -3, 7]]).expand(B, S) if case.padding == "garbage" else case.blank
        symbols = torch.where(past, pad, symbols)
    if case.blank_label:
        symbols[0, 0] = case.blank
        symbols[1, int(ends[1]) - 1] = case.blank
    am = torch.randn(B, T, C, generator=g, dtype=torch.float64).to(dtype)
    lm = torch.randn(B, S + 1, C, generator=g, dtype=torch.float64).to(dtype)
    logits = torch.randn(B, T, S + 1, C, generator=g, dtype=torch.float64).to(dtype)
    # Windows of R = 3 rows ending at each sequence's last symbol (finite losses).
    s_begin = torch.minimum(torch.tensor([0, 0, 1, 1, 1]), (ends - 2).clamp(min=0)[:, None])
    ranges = s_begin[..., None] + torch.arange(3)
    window = torch.randn(B, T, 3, C, generator=g, dtype=torch.float64).to(dtype)
    return symbols, boundary, am, lm, logits, ranges, window


def inputs(fn, am, lm, logits, window):
    """The tensors ``fn`` differentiates."""
    if fn in ("simple", "smoothed"):
        return lm, am
    return (logits,) if fn.startswith("rnnt_loss") else (window,)


def call(fn, case, xs, symbols, boundary, ranges, reduction="none"):
    """``compat.k2``'s function ``fn`` on ``xs``: the loss, or ``(loss, (px_grad, py_grad))``."""
    kw = dict(boundary=boundary, rnnt_type=case.rnnt_type, delay_penalty=0.1, reduction=reduction)
    if fn == "simple":
        return k2.rnnt_loss_simple(*xs, symbols, case.blank, return_grad=True, **kw)
    if fn == "smoothed":
        return k2.rnnt_loss_smoothed(*xs, symbols, case.blank, 0.2, 0.1, return_grad=True, **kw)
    if fn.startswith("rnnt_loss"):
        return k2.rnnt_loss(*xs, symbols, case.blank, return_grad=fn.endswith("grad"), **kw)
    return k2.rnnt_loss_pruned(*xs, symbols, ranges, case.blank, return_grad=fn.endswith("grad"),
                               use_hat_loss=fn == "hat", **kw)


def ref_log_probs(fn, xs, ranges):
    """The reference's node log-probs ``(B, T, S+1, C)`` of ``fn``'s inputs."""
    if fn == "simple":
        return torch.log_softmax(xs[1][:, :, None] + xs[0][:, None], -1)
    if fn == "smoothed":
        return smoothed_log_probs(xs[0], xs[1], 0.2, 0.1)
    if fn.startswith("rnnt_loss"):
        return torch.log_softmax(xs[0], -1)
    return window_log_probs(xs[0], ranges, S, fn == "hat")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("fn", FUNCTIONS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_losses_match_k2_recursion(case, fn, dtype):
    """Loss (reductions too), gradient w.r.t. the inputs with signed upstream weights, and
    ``return_grad``'s ``(px_grad, py_grad)``, against the loop on the reference ``(px, py)``."""
    symbols, boundary, am, lm, logits, ranges, window = make_case(case, dtype)
    xs = tuple(x.clone().requires_grad_() for x in inputs(fn, am, lm, logits, window))
    if fn == "hat" and case.blank != 0:
        with pytest.raises(ValueError, match="termination_symbol = 0"):
            call(fn, case, xs, symbols, boundary, ranges)
        return
    out = call(fn, case, xs, symbols, boundary, ranges)
    loss, grads = out if isinstance(out, tuple) else (out, None)
    assert loss.shape == (B,) and loss.dtype == dtype
    assert (grads is not None) == (fn in ("simple", "smoothed") or fn.endswith("grad"))

    x_ref = tuple(x.detach().double().requires_grad_() for x in xs)
    px, py = ref_px_py(ref_log_probs(fn, x_ref, ranges), symbols, case.blank, case.rnnt_type,
                       boundary)
    want = -ref_scores(px, py, boundary, 0.1, case.rnnt_type == "regular")
    assert torch.isfinite(want).all()
    tol = TOL[dtype]
    torch.testing.assert_close(loss.double(), want.detach(), rtol=tol, atol=tol)
    for reduction, reduce in (("sum", torch.sum), ("mean", torch.mean)):
        got = call(fn, case, xs, symbols, boundary, ranges, reduction)
        got = got[0] if isinstance(got, tuple) else got
        torch.testing.assert_close(got.double(), reduce(want.detach()), rtol=tol, atol=tol)

    up = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    (loss * up.to(dtype)).sum().backward()
    (want * up).sum().backward()
    for got, ref in zip(xs, x_ref):
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=tol, atol=tol)
    if grads is not None:
        # d log-likelihood / d (px, py), px and py the recursion's inputs: the occupations
        leaves = px.detach().requires_grad_(), py.detach().requires_grad_()
        scores = ref_scores(*leaves, boundary, 0.1, case.rnnt_type == "regular")
        for got, ref, in zip(grads, torch.autograd.grad(scores.sum(), leaves)):
            assert got.shape == ref.shape and got.dtype == dtype
            torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("rnnt_type", ["regular", "modified", "constrained"])
@pytest.mark.parametrize("fn", ["simple", "smoothed"])
def test_simple_losses_of_empty_symbol_sequences(fn, rnnt_type, monkeypatch):
    """S = 0 (a batch of empty transcripts, icefall's first step): the loss is the blanks'
    of every frame, and return_grad's px_grad is (B, 0, T+1) (regular) or (B, 0, T), py_grad
    1 on every frame. On torch 2.9 the regular type failed in torch's pad of px_grad's 0
    columns ("negative output size"; torch 2.13 pads them): here pad keeps torch 2.9's rule
    (fast_rnnt asserts S >= 1 there)."""
    real_pad = torch.nn.functional.pad

    def pad_of_torch_2_9(x, pad, *args, **kw):
        # its constant pad (unless every amount is 0) checks each padded dimension's new
        # size: > 0
        for d, (lo, hi) in enumerate(zip(pad[::2], pad[1::2])):
            if any(pad) and x.shape[-1 - d] + lo + hi <= 0:
                raise RuntimeError("torch 2.9: the padded size of a dimension must be > 0")
        return real_pad(x, pad, *args, **kw)

    monkeypatch.setattr(torch.nn.functional, "pad", pad_of_torch_2_9)
    g = torch.Generator().manual_seed(5)
    T_ = 4
    lm = torch.randn(B, 1, C, generator=g, dtype=torch.float64)
    am = torch.randn(B, T_, C, generator=g, dtype=torch.float64)
    blank = 1
    kw = dict(rnnt_type=rnnt_type, reduction="none", return_grad=True)
    if fn == "simple":
        loss, (px, py) = k2.rnnt_loss_simple(lm, am, torch.zeros(B, 0, dtype=torch.int64), blank, **kw)
    else:
        loss, (px, py) = k2.rnnt_loss_smoothed(lm, am, torch.zeros(B, 0, dtype=torch.int64), blank,
                                               0.2, 0.1, **kw)
    lp = ref_log_probs(fn, (lm, am), None)                      # (B, T, 1, C)
    torch.testing.assert_close(loss, -lp[:, :, 0, blank].sum(1), rtol=1e-12, atol=1e-12)
    assert px.shape == (B, 0, T_ + 1 if rnnt_type == "regular" else T_)
    torch.testing.assert_close(py, torch.ones(B, 1, T_, dtype=torch.float64))


def test_empty_batch_mean_is_zero_on_every_path():
    """B = 0, reduction="mean": 0 through each k2 function, with and without return_grad
    (the return_grad paths reduced by k2's own mean, which gave NaN, as fast_rnnt does)."""
    am, lm = torch.randn(0, 4, C), torch.randn(0, S + 1, C)
    y = torch.zeros(0, S, dtype=torch.int64)
    logits, ranges = torch.randn(0, 4, S + 1, C), torch.zeros(0, 4, 2, dtype=torch.int64)
    for return_grad in (False, True):
        outs = [k2.rnnt_loss(logits, y, 0, return_grad=return_grad),
                k2.rnnt_loss_simple(lm, am, y, 0, return_grad=return_grad),
                k2.rnnt_loss_pruned(torch.randn(0, 4, 2, C), y, ranges, 0,
                                    return_grad=return_grad)]
        for out in outs:
            loss = out[0] if isinstance(out, tuple) else out
            assert loss.shape == () and loss.item() == 0, (return_grad, loss)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_px_py_functions(case):
    """``get_rnnt_logprobs*``: k2's layout and values where k2's recursion reads them (the
    rows of symbols past ``end_symbol`` are ``-inf``: never read, never checked)."""
    symbols, boundary, am, lm, logits, ranges, window = make_case(case, torch.float64)
    ends = torch.full((B,), S) if boundary is None else boundary[:, 2]
    read = (torch.arange(S)[None, :] < ends[:, None])[:, :, None]            # (B, S, 1)
    got = {
        "simple": k2.get_rnnt_logprobs(lm, am, symbols, case.blank, case.rnnt_type, boundary),
        "smoothed": k2.get_rnnt_logprobs_smoothed(lm, am, symbols, case.blank, 0.2, 0.1,
                                                  boundary, case.rnnt_type),
        "rnnt_loss": k2.get_rnnt_logprobs_joint(logits, symbols, case.blank, boundary,
                                                case.rnnt_type),
        "pruned": k2.get_rnnt_logprobs_pruned(window, symbols, ranges, case.blank, boundary,
                                              case.rnnt_type),
    }
    # k2's argument order (rnnt_type, boundary) for the joint one
    k2_order = k2.get_rnnt_logprobs_joint(logits, symbols, case.blank, case.rnnt_type, boundary)
    for x, y in zip(k2_order, got["rnnt_loss"]):
        assert torch.equal(x, y)
    for fn, (px, py) in got.items():
        xs = (lm, am) if fn in ("simple", "smoothed") else (logits if fn == "rnnt_loss" else window,)
        want_px, want_py = ref_px_py(ref_log_probs(fn, xs, ranges), symbols, case.blank,
                                     case.rnnt_type, boundary)
        assert px.shape == want_px.shape and py.shape == want_py.shape
        torch.testing.assert_close(px, torch.where(read, want_px, NEG_INF), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(py, want_py, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("modified", [True, False], ids=["modified", "regular"])
def test_fast_rnnt_1_0_modified(modified):
    """fast_rnnt 1.0's ``modified: bool`` (where 1.2 has ``rnnt_type``), by keyword or in
    its position (with 1.0's positional ``reduction`` after it), gives what ``rnnt_type``
    gives, in every function that had it; with ``rnnt_type`` too, or not a bool, it is a
    ValueError."""
    case = CASES[0]
    symbols, boundary, am, lm, logits, ranges, window = make_case(case, torch.float64)
    t, b = ("modified" if modified else "regular"), case.blank
    calls = {   # name: (the 1.2 call, 1.0's keyword, 1.0's positions)
        "rnnt_loss": lambda **kw: k2.rnnt_loss(logits, symbols, b, boundary, **kw),
        "rnnt_loss_simple": lambda **kw: k2.rnnt_loss_simple(lm, am, symbols, b, boundary, **kw),
        "rnnt_loss_smoothed": lambda **kw: k2.rnnt_loss_smoothed(lm, am, symbols, b, 0.2, 0.1,
                                                                 boundary, **kw),
        "rnnt_loss_pruned": lambda **kw: k2.rnnt_loss_pruned(window, symbols, ranges, b,
                                                             boundary, **kw),
    }
    for name, fn in calls.items():
        want = fn(rnnt_type=t, reduction="sum")
        assert torch.equal(fn(modified=modified, reduction="sum"), want), name
        positional = {"rnnt_loss": lambda: k2.rnnt_loss(logits, symbols, b, boundary, modified, "sum"),
                      "rnnt_loss_simple": lambda: k2.rnnt_loss_simple(lm, am, symbols, b, boundary,
                                                                      modified, "sum"),
                      "rnnt_loss_smoothed": lambda: k2.rnnt_loss_smoothed(
                          lm, am, symbols, b, 0.2, 0.1, boundary, modified, "sum"),
                      "rnnt_loss_pruned": lambda: k2.rnnt_loss_pruned(
                          window, symbols, ranges, b, boundary, modified, "sum")}[name]
        assert torch.equal(positional(), want), name
    px_py = {
        "get_rnnt_logprobs": (k2.get_rnnt_logprobs(lm, am, symbols, b, t, boundary),
                              k2.get_rnnt_logprobs(lm, am, symbols, b, boundary=boundary,
                                                   modified=modified),
                              k2.get_rnnt_logprobs(lm, am, symbols, b, boundary, modified)),
        # 1.0's order with the boundary alone (modified at its default, False)
        "get_rnnt_logprobs, boundary": (
            k2.get_rnnt_logprobs(lm, am, symbols, b, "regular", boundary),
            k2.get_rnnt_logprobs(lm, am, symbols, b, boundary),
            k2.get_rnnt_logprobs(lm, am, symbols, b, boundary, False)),
        "get_rnnt_logprobs_smoothed": (
            k2.get_rnnt_logprobs_smoothed(lm, am, symbols, b, 0.2, 0.1, boundary, t),
            k2.get_rnnt_logprobs_smoothed(lm, am, symbols, b, 0.2, 0.1, boundary,
                                          modified=modified),
            k2.get_rnnt_logprobs_smoothed(lm, am, symbols, b, 0.2, 0.1, boundary, modified)),
        "get_rnnt_logprobs_joint": (
            k2.get_rnnt_logprobs_joint(logits, symbols, b, boundary, t),
            k2.get_rnnt_logprobs_joint(logits, symbols, b, boundary, modified=modified),
            k2.get_rnnt_logprobs_joint(logits, symbols, b, boundary, modified)),
        "get_rnnt_logprobs_pruned": (
            k2.get_rnnt_logprobs_pruned(window, symbols, ranges, b, boundary, t),
            k2.get_rnnt_logprobs_pruned(window, symbols, ranges, b, boundary, modified=modified),
            k2.get_rnnt_logprobs_pruned(window, symbols, ranges, b, boundary, modified)),
    }
    for name, (want, *got) in px_py.items():
        regular = not modified or name.endswith("boundary")
        assert want[0].shape[2] == T + regular, name               # px (B, S, T+1) regular
        for pair in got:
            assert all(torch.equal(x, y) for x, y in zip(pair, want)), name
    with pytest.raises(ValueError, match="modified"):
        k2.rnnt_loss(logits, symbols, b, boundary, rnnt_type="constrained", modified=modified)
    with pytest.raises(ValueError, match="modified must be a bool"):
        k2.rnnt_loss_simple(lm, am, symbols, b, boundary, modified="yes")


# (B, S, T) = (4, 3, 5); rows [s_begin, t_begin, s_end, t_end]: full, empty (start = end),
# no frame (t_begin = t_end: labels only, regular), an offset start.
MI_BOUNDARIES = [None, ((0, 0, 3, 5), (1, 2, 1, 2), (0, 1, 2, 1), (2, 0, 3, 4))]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("regular", [True, False], ids=["regular", "modified"])
@pytest.mark.parametrize("bi", range(len(MI_BOUNDARIES)), ids=["no_boundary", "ragged"])
def test_mutual_information_recursion(bi, regular, dtype):
    """The general recursion, ``px`` finite on the last frame, entries outside each
    boundary NaN (never read): value, ``return_grad``, autograd with signed upstream
    weights, and the per-term split of ``joint_mutual_information_recursion``."""
    g = torch.Generator().manual_seed(11)
    Bm, Sm, Tm = 4, 3, 5
    boundary = None if MI_BOUNDARIES[bi] is None else torch.tensor(MI_BOUNDARIES[bi])
    px = 2 * torch.randn(Bm, Sm, Tm + regular, generator=g, dtype=torch.float64)
    py = 2 * torch.randn(Bm, Sm + 1, Tm, generator=g, dtype=torch.float64)
    if boundary is not None:
        s = torch.arange(Sm + 1)[None, :, None]
        t = torch.arange(Tm + 1)[None, None, :]
        s0, t0, s1, t1 = (boundary[:, i, None, None] for i in range(4))
        inside = (s >= s0) & (t >= t0)
        px = px.masked_fill(~(inside & (s < s1) & (t <= t1))[:, :Sm, :px.shape[2]], math.nan)
        py = py.masked_fill(~(inside & (s <= s1) & (t < t1))[:, :, :Tm], math.nan)
    px, py = px.to(dtype), py.to(dtype)
    xp, xq = px.clone().requires_grad_(), py.clone().requires_grad_()
    got, (gx, gy) = k2.mutual_information_recursion(xp, xq, boundary, return_grad=True)
    assert got.dtype == dtype and gx.dtype == dtype and gx.shape == px.shape and gy.shape == py.shape
    up = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    (got * up.to(dtype)).sum().backward()
    rp, rq = (torch.nan_to_num(x.double(), nan=0.0).requires_grad_() for x in (px, py))
    want = ref_scores(rp, rq, boundary, 0.0, regular)
    if boundary is not None:   # the empty sequence: log 1; modified without a frame: no path
        assert want[1].item() == 0.0 and (want[2].item() == NEG_INF) != regular
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), want.detach(), rtol=tol, atol=tol)
    occ = torch.autograd.grad(want.sum(), (rp, rq), retain_graph=True)
    weighted = torch.autograd.grad((want * up).sum(), (rp, rq))
    for x, returned, o, w in zip((xp, xq), (gx, gy), occ, weighted):
        torch.testing.assert_close(returned.double(), o, rtol=tol, atol=tol)
        torch.testing.assert_close(x.grad.double(), w, rtol=tol, atol=tol)
    # joint: terms (px/2, px/2) and (py/4, 3py/4); term n = sum(occupation * weights_n)
    parts = (xp.detach() / 2, xp.detach() / 2), (py / 4, 3 * py / 4)
    terms = k2.joint_mutual_information_recursion(*parts, boundary)
    assert terms.shape == (2, Bm)
    torch.testing.assert_close(terms.sum(0).double(), want.detach(), rtol=tol, atol=tol)
    term1 = ((occ[0] * torch.nan_to_num(parts[0][1].double())).sum((1, 2))
             + (occ[1] * torch.nan_to_num(parts[1][1].double())).sum((1, 2)))
    finite = torch.isfinite(want)
    torch.testing.assert_close(terms[1].double()[finite], term1[finite], rtol=tol, atol=tol)


def k2_ranges_loop(px_grad, py_grad, boundary, R, deprecated=False):
    """k2's ``get_rnnt_prune_ranges`` (and its deprecated score) as loops (docs/variants.md
    A.6, steps 3-6): per frame the first argmax of the window score, the tail frames' start,
    then the monotone repair."""
    Bx, S_, T1 = px_grad.shape
    T_ = py_grad.shape[2]
    R_e = R if T1 == T_ + 1 else 2
    out = torch.empty(Bx, T_, R, dtype=torch.int64)
    for b in range(Bx):
        s_end, t_end = int(boundary[b, 2]), int(boundary[b, 3])
        starts = []
        for t in range(T_):
            def score(s):
                if deprecated:
                    return sum(float(py_grad[b, k, t]) + (float(px_grad[b, k, t]) if k < S_ else 0.0)
                               for k in range(s, s + R))
                return (sum(float(py_grad[b, k, t]) for k in range(s, s + R))
                        - (float(px_grad[b, s - 1, t]) if s > 0 else 0.0))
            scores = [score(s) for s in range(S_ + 2 - R)]
            starts.append(max(s_end - R + 1, 0) if t >= t_end - 1 else scores.index(max(scores)))
        starts = [min(starts[t:]) for t in range(T_)]
        x = [(R_e - 1) * t - s for t, s in enumerate(starts)]
        x = [max(min(x[t:]), 0) for t in range(T_)]
        for t in range(T_):
            out[b, t] = (R_e - 1) * t - x[t] + torch.arange(R)
    return out


@pytest.mark.parametrize("rnnt_type", ["regular", "modified"])
@pytest.mark.parametrize("deprecated", [False, True], ids=["k2", "deprecated"])
def test_prune_ranges_match_k2_loop(deprecated, rnnt_type):
    g = torch.Generator().manual_seed(2)
    Bp, Tp, Sp, Cp = 3, 8, 5, 6
    am = torch.randn(Bp, Tp, Cp, generator=g, dtype=torch.float64)
    lm = torch.randn(Bp, Sp + 1, Cp, generator=g, dtype=torch.float64)
    symbols = torch.randint(1, Cp, (Bp, Sp), generator=g)
    boundary = torch.tensor([[0, 0, 5, 8], [0, 0, 3, 6], [0, 0, 2, 4]])
    _, (pxg, pyg) = k2.rnnt_loss_simple(lm, am, symbols, 0, boundary, rnnt_type, return_grad=True)
    fn = k2.get_rnnt_prune_ranges_deprecated if deprecated else k2.get_rnnt_prune_ranges
    for R in (2, 3, 4):
        with warnings.catch_warnings():
            warnings.simplefilter("error")          # no window needs raising here
            got = fn(pxg, pyg, boundary, R)
        assert torch.equal(got, k2_ranges_loop(pxg, pyg, boundary, R, deprecated))


def test_prune_ranges_raised_window_warns_at_the_call():
    """A window too small to reach a sequence's end is raised to k2's ``(S_b - 1) // T_b +
    2`` (k2 prints), and the ``RuntimeWarning`` names the caller's line."""
    pxg, pyg = torch.zeros(1, 6, 3), torch.zeros(1, 7, 2)          # regular: S = 6, T = 2
    pyg[0, :, 0] = 1.0
    with pytest.warns(RuntimeWarning, match="R=2 cannot reach") as record:
        ranges = k2.get_rnnt_prune_ranges(pxg, pyg, torch.tensor([[0, 0, 6, 2]]), 2)
    assert ranges.shape == (1, 2, 4) and record[0].filename == __file__   # (6 - 1) // 2 + 2


def test_icefall_pipeline_with_blank_padding():
    """icefall's calls, blank-padded symbols of unequal lengths: smoothed loss with
    ``return_grad`` -> ranges -> ``do_rnnt_pruning`` -> joiner -> pruned loss; with
    ``s_range = S + 1`` the pruned loss is the full loss."""
    g = torch.Generator().manual_seed(5)
    Bi, Ti, Si, Ci, D, blank = 3, 7, 4, 6, 4, 0
    boundary = torch.tensor([[0, 0, 4, 7], [0, 0, 2, 5], [0, 0, 1, 6]])
    symbols = torch.randint(1, Ci, (Bi, Si), generator=g)
    symbols = torch.where(torch.arange(Si)[None, :] < boundary[:, 2:3], symbols, blank)
    am = torch.randn(Bi, Ti, Ci, generator=g, dtype=torch.float64)
    lm = torch.randn(Bi, Si + 1, Ci, generator=g, dtype=torch.float64)
    simple, (px_grad, py_grad) = k2.rnnt_loss_smoothed(
        lm=lm, am=am, symbols=symbols, termination_symbol=blank, lm_only_scale=0.0,
        am_only_scale=0.0, boundary=boundary, reduction="sum", return_grad=True)
    full = k2.rnnt_loss(am[:, :, None] + lm[:, None], symbols, blank, boundary, reduction="sum")
    torch.testing.assert_close(simple, full, rtol=1e-9, atol=0)
    enc = torch.randn(Bi, Ti, D, generator=g, dtype=torch.float64)
    dec = torch.randn(Bi, Si + 1, D, generator=g, dtype=torch.float64)
    proj = torch.randn(D, Ci, generator=g, dtype=torch.float64)
    ranges = k2.get_rnnt_prune_ranges(px_grad=px_grad, py_grad=py_grad, boundary=boundary,
                                      s_range=Si + 1)
    am_p, lm_p = k2.do_rnnt_pruning(am=enc, lm=dec, ranges=ranges)
    assert am_p.shape == (Bi, Ti, Si + 1, D) and lm_p.shape == (Bi, Ti, Si + 1, D)
    pruned = k2.rnnt_loss_pruned(logits=torch.tanh(am_p + lm_p) @ proj, symbols=symbols,
                                 ranges=ranges, termination_symbol=blank, boundary=boundary,
                                 reduction="none")
    want = k2.rnnt_loss(torch.tanh(enc[:, :, None] + dec[:, None]) @ proj, symbols, blank,
                        boundary, reduction="none")
    torch.testing.assert_close(pruned, want, rtol=1e-10, atol=1e-10)


def test_with_cuda_is_a_bool_and_a_function():
    assert isinstance(k2.with_cuda(), bool) and bool(k2.with_cuda) is k2.with_cuda()


_x4, _x3, _s = torch.zeros(2, 5, 4, 3), torch.zeros(2, 5, 3), torch.zeros(2, 3, dtype=torch.int64)
ERRORS = [
    (lambda: k2.rnnt_loss(_x3, _s, 0), r"logits must have 4 dims \(B, T, S\+1, C\), got shape \(2, 5, 3\)"),
    (lambda: k2.rnnt_loss(_x4, _s[0], 0), r"symbols must have 2 dims \(B, S\), got shape \(3,\)"),
    (lambda: k2.rnnt_loss(_x4, _s, 0, return_grad=True, boundary=torch.zeros(2, 3, dtype=torch.int64)),
     r"boundary must have shape \(B, 4\) = \(2, 4\)"),
    (lambda: k2.rnnt_loss(_x4, _s, 0, boundary=torch.tensor([[0, 0, 4, 5], [0, 0, 1, 5]])),
     r"boundary\[0\] = \[0, 0, 4, 5\] must satisfy .* end_symbol <= S = 3"),
    (lambda: k2.rnnt_loss(_x4, _s + 3, 0), r"symbols\[0, 0\] = 3 must be in \[0, C\) = \[0, 3\)"),
    (lambda: k2.rnnt_loss(_x4, _s, 0, delay_penalty=-0.1), "delay_penalty must be >= 0"),
    (lambda: k2.rnnt_loss_simple(_x4[:, 0], _x3[0], _s, 0), r"am must have 3 dims \(B, T, C\), got shape \(5, 3\)"),
    (lambda: k2.rnnt_loss_simple(_x3, _x4, _s, 0), r"am must have 3 dims \(B, T, C\), got shape \(2, 5, 4, 3\)"),
    (lambda: k2.rnnt_loss_smoothed(_x3[:, :4], _x3, _s, 0, rnnt_type="x"), "rnnt_type must be one of"),
    (lambda: k2.rnnt_loss_pruned(_x4, _s, _s, 0), r"ranges must have 3 dims \(B, T, R\), got shape \(2, 3\)"),
    (lambda: k2.rnnt_loss_pruned(_x4, _s, _s, 0, None, "regular", 0.0, "mean", True),
     "ninth is return_grad in fast_rnnt and use_hat_loss in k2"),
    (lambda: k2.mutual_information_recursion(_x3[0], _x3), r"px must have 3 dims \(B, S, T\+1\), got shape \(5, 3\)"),
    (lambda: k2.mutual_information_recursion(_x3, _x4), r"py must have 3 dims \(B, S\+1, T\), got shape \(2, 5, 4, 3\)"),
    (lambda: k2.mutual_information_recursion(_x3, _x3), r"px \(2, 5, 3\) must be \(B, S, T\+1\) or \(B, S, T\)"),
    (lambda: k2.joint_mutual_information_recursion(_x3, _x3), "px must be a non-empty sequence of tensors"),
    (lambda: k2.get_rnnt_prune_ranges(_x3[0], _x3, None, 2), r"px_grad must have 3 dims .* got shape \(5, 3\)"),
    (lambda: k2.get_rnnt_prune_ranges(torch.zeros(2, 3, 9), torch.zeros(2, 4, 6), None, 2),
     r"px_grad \(2, 3, 9\) must be \(B, S, T\+1\)"),
    (lambda: k2.do_rnnt_pruning(_x3[0], _x3, _s), r"am must have 3 dims, got shape \(5, 3\)"),
    # the remaining rules of the arguments, one call each
    (lambda: k2.rnnt_loss(_x4.numpy(), _s, 0), r"logits must be a torch.Tensor \(B, T, S\+1, C\), got ndarray"),
    (lambda: k2.rnnt_loss(_x4.long(), _s, 0), r"logits must be torch.float16, .* got torch.int64"),
    (lambda: k2.rnnt_loss_simple(_x3[:, :4], _x3.double(), _s, 0),
     r"lm \(torch.float32 on cpu\) must have the dtype and device of am \(torch.float64"),
    (lambda: k2.rnnt_loss_simple(_x3[:1, :4], _x3, _s, 0), r"lm \(1, 4, 3\) must be \(B, S\+1, C\) with am's B = 2"),
    (lambda: k2.rnnt_loss(_x4, _s, 3), r"termination_symbol=3 is outside \[-C, C\) = \[-3, 3\)"),
    (lambda: k2.rnnt_loss(_x4, _s, True), "termination_symbol must be an int, got True"),
    (lambda: k2.rnnt_loss(_x4, _s, torch.zeros(2, dtype=torch.int64)),
     r"termination_symbol must be an int, got a torch.int64 tensor of shape \(2,\)"),
    (lambda: k2.rnnt_loss(_x4, _s, 0, boundary=torch.zeros(2, 4)), "boundary must be int64 \\(or int32\\), got torch.float32"),
    (lambda: k2.rnnt_loss(_x4, _s[:, :2], 0), r"symbols must have shape \(B, S\) = \(2, 3\), got \(2, 2\)"),
    (lambda: k2.rnnt_loss(_x4, _s.float(), 0), "symbols must be int64 \\(or int32\\), got torch.float32"),
    (lambda: k2.rnnt_loss(_x4, _s, 0, reduction="avg"), "reduction must be one of .* got 'avg'"),
    (lambda: k2.rnnt_loss(_x4, _s, 0, delay_penalty=float("nan")), "delay_penalty must be finite, got nan"),
    (lambda: k2.rnnt_loss(_x4, _s, 0, delay_penalty="x"), "delay_penalty must be a number, got 'x'"),
    # flags k2 reads by truth value (the string "False" was True, None False)
    (lambda: k2.rnnt_loss(_x4, _s, 0, return_grad="False"), "return_grad must be a bool, got 'False'"),
    (lambda: k2.rnnt_loss_simple(_x3[:, :4], _x3, _s, 0, return_grad=None),
     "return_grad must be a bool, got None"),
    (lambda: k2.rnnt_loss_pruned(_x4, _s, _s[:, None].expand(2, 5, 3), 0, use_hat_loss=2),
     "use_hat_loss must be a bool, got 2"),
    (lambda: k2.mutual_information_recursion(_x3[:, :4], _x3, return_grad="yes"),
     "return_grad must be a bool, got 'yes'"),
    # the smoothed scales' range, as the losses' (it returned px, py)
    (lambda: k2.get_rnnt_logprobs_smoothed(_x3[:, :4], _x3, _s, 0, lm_only_scale=1.5),
     r"lm_only_scale must be <= 1 \(valid range \[0, 1\]\), got 1.5"),
    (lambda: k2.joint_mutual_information_recursion([_x3], [_x3, _x3]), "px and py must hold as many tensors, got 1 and 2"),
    (lambda: k2.joint_mutual_information_recursion([_x3, _x3[:1]], [_x3, _x3]),
     r"px\[1\] \(1, 5, 3\) must have the shape of px\[0\] \(2, 5, 3\)"),
    (lambda: k2.rnnt_loss_pruned(_x4, _s, _s[:, None].expand(2, 5, 3)[:, :4], 0),
     r"ranges must have shape \(B, T, R\) = \(2, 5, 4\) to match logits"),
    (lambda: k2.rnnt_loss_pruned(_x4, _s, torch.zeros(2, 5, 4), 0), "ranges must be int64 on the logits' device, got torch.float32"),
    (lambda: k2.rnnt_loss_pruned(_x4, _s, torch.zeros(2, 5, 4, dtype=torch.int64), 0),
     r"ranges\[0, 0\] = \[0, 0, 0, 0\] must be increasing symbol positions in \[0, S\] = \[0, 3\]"),
    # an S of the logits other than the symbols': named as such, not as a boundary beyond S
    (lambda: k2.rnnt_loss(_x4[:, :, :2], _s, 0, boundary=torch.tensor([[0, 0, 3, 5]] * 2)),
     r"symbols must have shape \(B, S\) = \(2, 1\), got \(2, 3\)"),
    (lambda: k2.rnnt_loss_simple(_x3[:, :2], _x3, _s, 0, boundary=torch.tensor([[0, 0, 3, 5]] * 2)),
     r"symbols must have shape \(B, S\) = \(2, 1\), got \(2, 3\)"),
    # two rnnt_type values in the two slots that take (boundary, rnnt_type) in either order:
    # the second was dropped
    (lambda: k2.get_rnnt_logprobs_joint(_x4, _s, 0, "modified", "constrained"),
     "two rnnt_type values, 'modified' and 'constrained'"),
    (lambda: k2.get_rnnt_logprobs(_x3[:, :4], _x3, _s, 0, True, "constrained"),
     "two rnnt_type values, 'constrained' and True"),
    (lambda: k2.get_rnnt_prune_ranges(_x3[:, :3, :4], _x3[:, :4], None, 0), "s_range must be >= 1"),
    (lambda: k2.get_rnnt_prune_ranges(_x3[:, :3, :4], _x3[:, :4], None, 2.0), "s_range must be an int"),
    (lambda: k2.get_rnnt_prune_ranges(_x3[:, :3, :4].long(), _x3[:, :4].long(), None, 2),
     "px_grad must be floating point"),
    # (torch's RuntimeError of a host read on the meta device)
    (lambda: k2.get_rnnt_prune_ranges(_x3[:, :3, :4].to("meta"), _x3[:, :4].to("meta"), None, 2),
     "get_rnnt_prune_ranges reads the sequences' ends .*: px_grad is on the meta device"),
    # a mix of dtypes among the terms (torch.stack promoted it, and blamed py)
    (lambda: k2.joint_mutual_information_recursion([_x3[:, :3, :4], _x3[:, :3, :4].double()],
                                                   [_x3[:, :4]] * 2),
     r"px\[1\] \(torch.float64 on cpu\) must have the dtype and device of px\[0\] \(torch.float32"),
]


@pytest.mark.parametrize("i", range(len(ERRORS)))
def test_errors_name_the_argument_and_its_shape(i):
    fn, message = ERRORS[i]
    with pytest.raises(ValueError, match=message):
        fn()


def test_a_sequence_whose_start_is_its_end_costs_zero_on_every_path():
    """A boundary with begin == end on both axes (no frames, no symbols): k2's recursion
    gives its one empty path, loss 0, and so does every loss here, whichever way it is
    computed. (The fused kernels' path gave +inf, the library's rule for a lattice without
    frames, and the (px, py) path -0.0: one call, two values by return_grad.) The other
    sequences keep their losses; the empty one's gradient is 0."""
    g = torch.Generator().manual_seed(11)
    B, T, S, C = 2, 4, 2, 5
    x = torch.randn(B, T, S + 1, C, generator=g, dtype=torch.float64)
    lm = torch.randn(B, S + 1, C, generator=g, dtype=torch.float64)
    am = torch.randn(B, T, C, generator=g, dtype=torch.float64)
    sym = torch.tensor([[1, 2], [3, 4]])
    full = torch.tensor([[0, 0, 2, 4], [0, 0, 2, 4]])
    empty = torch.tensor([[0, 0, 2, 4], [1, 2, 1, 2]])          # sequence 1: start == end
    ranges = torch.tensor([[[0, 1], [0, 1], [1, 2], [1, 2]]] * B)
    xp = torch.gather(x, 2, ranges[..., None].expand(B, T, 2, C))
    calls = {
        "rnnt_loss": lambda v, bd, **kw: k2.rnnt_loss(v, sym, 0, bd, reduction="none", **kw),
        "rnnt_loss_pruned": lambda v, bd, **kw: k2.rnnt_loss_pruned(
            v, sym, ranges, 0, bd, reduction="none", **kw),
        "rnnt_loss_simple": lambda v, bd, **kw: k2.rnnt_loss_simple(
            lm, v, sym, 0, bd, reduction="none", **kw),
        "rnnt_loss_smoothed": lambda v, bd, **kw: k2.rnnt_loss_smoothed(
            lm, v, sym, 0, boundary=bd, reduction="none", **kw),
    }
    inputs = {"rnnt_loss": x, "rnnt_loss_pruned": xp}
    for name, call in calls.items():
        v = inputs.get(name, am)
        want = call(v, full)
        ways = [{}, {"return_grad": True}] + ([{"use_hat_loss": True}] if name == "rnnt_loss_pruned" else [])
        for kw in ways:
            leaf = v.clone().requires_grad_()
            out = call(leaf, empty, **kw)
            costs = out[0] if isinstance(out, tuple) else out
            if "use_hat_loss" in kw:
                want0 = call(v, full, use_hat_loss=True)[0]
            else:
                want0 = want[0]
            assert costs[1].item() == 0.0 and not torch.signbit(costs[1]), (name, kw, costs)
            torch.testing.assert_close(costs[0], want0, rtol=1e-12, atol=0)
            costs.sum().backward()
            assert not leaf.grad[1].any(), (name, kw)


def _confident_joint(margin: float, B=2, T=7, S=3, C=40):
    """float32 logits ``(B, T, S+1, C)`` whose rows on one path of the regular lattice favour
    the class it reads by ``margin`` nats (the blank, the label ``u`` at frame ``2u``), the
    symbols and the boundary."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(B, T, S + 1, C, generator=g, dtype=torch.float64)
    y = torch.randint(1, C, (B, S), generator=g)
    x[..., 0] += margin
    for b in range(B):
        for u in range(S):
            x[b, 2 * u, u, 0] -= margin
            x[b, 2 * u, u, y[b, u]] += margin
    bnd = torch.tensor([[0, 0, S, T]] * B)
    return x.float(), y, bnd


@pytest.mark.parametrize("path", ["return_grad", "pruned_return_grad", "joint_mi", "simple_mi",
                                  "smoothed_mi", "hat"])
def test_px_py_paths_keep_confident_digits(path):
    """The ``(px, py)`` paths on a confident float32 batch (20 nats): losses and gradients
    of the library's own losses in float64 on the same rounded values, each gradient within
    float32's rounding of its own (small) scale, and k2's dtypes (float32 losses and
    ``px``/``py``). (The nodes' normalisers were float32, as k2 forms them: at 20 nats ``px``
    read 0, the loss was 0 and the gradient wrong by its whole scale.) HAT (its blank a
    Bernoulli: ``x_0`` +-20 on the path) against itself in float64, which the test above
    holds to k2's formula."""
    w = torch.tensor([1.0, -0.7])
    if path in ("simple_mi", "smoothed_mi"):
        g = torch.Generator().manual_seed(5)
        B, T, S, C = 2, 9, 3, 40
        am = torch.randn(B, T, C, generator=g, dtype=torch.float64)
        lm = 0.1 * torch.randn(B, S + 1, C, generator=g, dtype=torch.float64)
        y = torch.randint(1, C, (B, S), generator=g)
        am[..., 0] += 20.0
        for b in range(B):
            for u in range(S):                  # (modified: a label takes its frame)
                am[b, 2 * u + 1, 0] -= 20.0
                am[b, 2 * u + 1, y[b, u]] += 20.0
        xs = [lm.float(), am.float()]
        bnd = torch.tensor([[0, 0, S, T]] * B)
        kw = dict(lm_only_scale=0.1, am_only_scale=0.1) if path == "smoothed_mi" else {}
        getter = k2.get_rnnt_logprobs_smoothed if kw else k2.get_rnnt_logprobs
        ref = k2.rnnt_loss_smoothed if kw else k2.rnnt_loss_simple

        def got_fn(l_, a_):
            px, py = (getter(l_, a_, y, 0, boundary=bnd, rnnt_type="modified", **kw))
            assert px.dtype == py.dtype == l_.dtype
            return -k2.mutual_information_recursion(px, py, bnd)

        def want_fn(l_, a_):
            return ref(l_, a_, y, 0, boundary=bnd, rnnt_type="modified", reduction="none",
                       **kw)
    else:
        x, y, bnd = _confident_joint(20.0)
        if path == "hat":                   # the Bernoulli blank: x_0 = -20 where a label is
            for u in range(y.shape[1]):
                x[:, 2 * u, u, 0] -= 20.0
        xs = [x]
        S = y.shape[1]
        ranges = torch.arange(S + 1).expand(x.shape[0], x.shape[1], S + 1).contiguous()

        def got_fn(z):
            if path == "return_grad":
                loss, (px_grad, py_grad) = k2.rnnt_loss(z, y, 0, bnd, reduction="none",
                                                         return_grad=True)
            elif path == "hat":
                return k2.rnnt_loss_pruned(z, y, ranges, 0, bnd, reduction="none",
                                           use_hat_loss=True)
            elif path == "pruned_return_grad":
                loss, (px_grad, py_grad) = k2.rnnt_loss_pruned(z, y, ranges, 0, bnd,
                                                                reduction="none",
                                                                return_grad=True)
            else:
                px, py = k2.get_rnnt_logprobs_joint(z, y, 0, bnd)
                assert px.dtype == py.dtype == z.dtype
                return -k2.mutual_information_recursion(px, py, bnd)
            assert loss.dtype == px_grad.dtype == py_grad.dtype == z.dtype
            return loss

        def want_fn(z):
            if path == "hat":
                return got_fn(z)
            return k2.rnnt_loss(z, y, 0, bnd, reduction="none")
    runs = []
    for fn, inputs in ((got_fn, xs), (want_fn, [t.double() for t in xs])):
        zs = [t.detach().clone().requires_grad_() for t in inputs]
        costs = fn(*zs)
        (costs * w.to(costs.dtype)).sum().backward()
        runs.append((costs.detach().double(), [z.grad.double() for z in zs]))
    (got, got_grads), (want, want_grads) = runs
    if path not in ("smoothed_mi",):
        assert want.max() < 1e-4                                     # confident
    assert ((got - want).abs() / want).max() <= 64 * 2.0**-23
    for g_, w_ in zip(got_grads, want_grads):
        assert (g_ - w_).abs().max() / w_.abs().max() <= 64 * 2.0**-23
