"""``rnnt_lattice.compat.k2``: fast_rnnt's names, argument conventions and return values on
our kernels. The occupations ``return_grad`` gives are checked against autograd through an
independent loop implementation of k2's recursion on its own ``px``/``py`` layout
(variants.md A), so the layout conversion cannot hide a transposition or an off-by-one."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import rnnt_lattice
from rnnt_lattice.compat import k2

NEG_INF = -math.inf


def _lae(a, b):
    if float(a) == NEG_INF and float(b) == NEG_INF:
        return a.detach()               # no path: gradient 0 (logaddexp's would be NaN)
    return torch.logaddexp(a, b)


def k2_recursion(px, py, regular: bool, start=(0, 0), end=None):
    """k2's ``mutual_information_recursion`` for one sequence, as a Python loop with
    autograd (float64): ``p[s0, t0] = 0``; regular ``p[s,t] = lae(p[s-1,t] + px[s-1,t],
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


def k2_px_py(logits, symbols, blank, rnnt_type, delay_penalty=0.0, boundary=None):
    """k2's ``get_rnnt_logprobs`` layout from full logits ``(B, T, S+1, C)``."""
    B, T, S1, C = logits.shape
    S = S1 - 1
    logp = torch.log_softmax(logits, -1)
    py = logp[..., blank].transpose(1, 2)                                   # (B, S+1, T)
    px = torch.gather(logp[:, :, :S], 3, symbols[:, None, :, None].expand(B, T, S, 1))
    px = px[..., 0].transpose(1, 2)                                         # (B, S, T)
    if rnnt_type == "regular":
        px = torch.cat([px, px.new_full((B, S, 1), NEG_INF)], 2)            # (B, S, T+1)
    if rnnt_type == "regular" and boundary is not None:
        # k2's fix_for_boundary: no label arc on the end frame (it plays the virtual frame T).
        px = px.clone()
        for b in range(B):
            px[b, :, int(boundary[b, 3])] = NEG_INF
    if rnnt_type == "constrained":
        px = px + py[:, 1:, :]
    if delay_penalty > 0:
        T_b = boundary[:, 3] if boundary is not None else torch.full((B,), T)
        t = torch.arange(px.shape[2], dtype=px.dtype)
        px = px + delay_penalty * ((T_b[:, None, None].to(px.dtype) - 1) / 2 - t)
    return px, py


@pytest.mark.parametrize("rnnt_type", ["regular", "modified", "constrained"])
@pytest.mark.parametrize("with_boundary", [False, True])
def test_rnnt_loss_and_return_grad_match_k2_recursion(rnnt_type, with_boundary):
    g = torch.Generator().manual_seed(3)
    B, T, S, C, blank = 2, 5, 3, 6, 0
    logits = torch.randn(B, T, S + 1, C, generator=g, dtype=torch.float64)
    symbols = torch.randint(1, C, (B, S), generator=g)
    boundary = torch.tensor([[0, 0, 3, 5], [1, 1, 2, 4]]) if with_boundary else None
    x = logits.clone().requires_grad_()
    loss, (px_grad, py_grad) = k2.rnnt_loss(x, symbols, blank, boundary=boundary,
                                            rnnt_type=rnnt_type, delay_penalty=0.2,
                                            reduction="none", return_grad=True)
    assert px_grad.shape == (B, S, T + 1 if rnnt_type == "regular" else T)
    assert py_grad.shape == (B, S + 1, T)
    px, py = k2_px_py(logits, symbols, blank, rnnt_type, 0.2, boundary)
    px.requires_grad_()
    py.requires_grad_()
    for b in range(B):
        start, end = ((0, 0), None) if boundary is None else \
            ((int(boundary[b, 0]), int(boundary[b, 1])), (int(boundary[b, 2]), int(boundary[b, 3])))
        ll = k2_recursion(px[b], py[b], rnnt_type == "regular", start, end)
        gx, gy = torch.autograd.grad(ll, (px, py))
        assert abs(float(loss[b].detach()) + float(ll)) <= 1e-10 * max(1.0, abs(float(ll)))
        torch.testing.assert_close(px_grad[b], gx[b], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(py_grad[b], gy[b], rtol=1e-9, atol=1e-12)
    loss.sum().backward()                       # the loss is differentiable, as k2's
    assert torch.isfinite(x.grad).all()


def test_simple_pruned_pipeline_as_icefall_calls_it():
    """simple loss (return_grad) -> get_rnnt_prune_ranges -> do_rnnt_pruning -> joiner ->
    rnnt_loss_pruned; with s_range = S + 1 the pruned loss is the full loss."""
    g = torch.Generator().manual_seed(5)
    B, T, S, C, D, blank = 2, 6, 3, 7, 4, 0
    am = torch.randn(B, T, C, generator=g, dtype=torch.float64)
    lm = torch.randn(B, S + 1, C, generator=g, dtype=torch.float64)
    symbols = torch.randint(1, C, (B, S), generator=g)
    simple, (px_grad, py_grad) = k2.rnnt_loss_simple(lm, am, symbols, blank, return_grad=True,
                                                     reduction="sum")
    full = k2.rnnt_loss(am[:, :, None] + lm[:, None], symbols, blank, reduction="sum")
    assert abs(float(simple) - float(full)) <= 1e-10 * abs(float(full))
    smoothed = k2.rnnt_loss_smoothed(lm, am, symbols, blank, lm_only_scale=0.0,
                                     am_only_scale=0.0, reduction="sum")
    assert abs(float(smoothed) - float(full)) <= 1e-8 * abs(float(full))
    for s_range, exact in ((S + 1, True), (2, False)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ranges = k2.get_rnnt_prune_ranges(px_grad, py_grad, None, s_range)
        R = ranges.shape[-1]
        ours = rnnt_lattice.prune_ranges((py_grad.transpose(1, 2), torch.nn.functional.pad(
            px_grad[:, :, :T], (0, 0, 0, 1)).transpose(1, 2)), s_range, method="k2",
            logit_lengths=torch.full((B,), T), target_lengths=torch.full((B,), S),
            rnnt_type="regular")
        assert torch.equal(ranges, ours.ranges)
        enc = torch.randn(B, T, D, generator=g, dtype=torch.float64)
        dec = torch.randn(B, S + 1, D, generator=g, dtype=torch.float64)
        am_p, lm_p = k2.do_rnnt_pruning(enc, dec, ranges)
        assert am_p.shape == (B, T, R, D) and lm_p.shape == (B, T, R, D)
        proj = torch.randn(D, C, generator=g, dtype=torch.float64)
        logits = torch.tanh(am_p + lm_p) @ proj                               # (B, T, R, C)
        pruned, (pxg, pyg) = k2.rnnt_loss_pruned(logits, symbols, ranges, blank,
                                                 reduction="none", return_grad=True)
        assert pxg.shape == (B, S, T + 1) and pyg.shape == (B, S + 1, T)
        if exact:
            full_logits = torch.tanh(enc[:, :, None] + dec[:, None]) @ proj
            want = k2.rnnt_loss(full_logits, symbols, blank, reduction="none")
            torch.testing.assert_close(pruned, want, rtol=1e-10, atol=1e-10)
        else:
            # every label is emitted once: the label occupations of a label sum to 1
            assert torch.isfinite(pruned).all()
            torch.testing.assert_close(pxg.sum(2), torch.ones(B, S, dtype=pxg.dtype))


def test_k2_layout_errors():
    with pytest.raises(ValueError, match=r"px_grad .* must be \(B, S, T\+1\)"):
        k2.get_rnnt_prune_ranges(torch.zeros(2, 3, 9), torch.zeros(2, 4, 6), None, 2)
