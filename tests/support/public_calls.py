"""The public calls as a case table: each case makes its inputs (ragged lengths, NaN padding,
signed per-sequence upstream gradients), runs the calls under ``on()`` (a context factory:
``contextlib.nullcontext`` for an oracle, a dispatch mode or a device's simulation for a
test) and returns the tensors to compare: losses and gradients, and integer outputs
(alignments, windows). ``test_no_float64.py`` and ``test_deterministic.py`` run it."""
from __future__ import annotations

import torch

import rnnt_lattice
from rnnt_lattice.compat import k2
from support import cases
from support.cases import upstream_weights


def _grads(out, leaves, weights=None):
    """``[out, d sum(w * out) / d leaf ...]``, ``w`` the signed per-sequence weights of a
    ``(B,)`` output (1 for a scalar)."""
    w = torch.ones(()) if weights is None else weights.to(out.dtype)
    return [out, *torch.autograd.grad((out * w).sum(), leaves)]


def _logits(name="ragged_blank0", V=None, extra=0):
    """A case's float32 logits (NaN padding, garbage targets past the lengths), with
    ``extra`` more columns (TDT's durations, multi-blank's big blanks)."""
    case = cases.CASES[name]
    x, y, T_b, U_b, blank = cases.make_inputs(case, torch.float32)
    if extra:
        x = torch.cat([x, torch.randn(*x.shape[:-1], extra, generator=torch.Generator().manual_seed(1))
                       .masked_fill(x[..., :1].isnan(), float("nan"))], -1)
    return x.requires_grad_(), y, T_b, U_b, blank % case.V


def _simple(scale=1.0):
    """``(lm (B, U+1, V), am (B, T, V), targets, T_b, U_b)`` float32, NaN rows past the
    lengths; ``scale`` 500: logits far enough apart for the log-domain rescue."""
    g = torch.Generator().manual_seed(0)
    B, T, U, V = 3, 6, 4, 5
    T_b, U_b = torch.tensor([6, 3, 5]), torch.tensor([4, 1, 0])
    am = scale * torch.randn(B, T, V, generator=g)
    lm = scale * torch.randn(B, U + 1, V, generator=g)
    am = am.masked_fill((torch.arange(T)[None, :] >= T_b[:, None])[..., None], float("nan"))
    lm = lm.masked_fill((torch.arange(U + 1)[None, :] > U_b[:, None])[..., None], float("nan"))
    y = torch.randint(1, V, (B, U), generator=g)
    return lm.requires_grad_(), am.requires_grad_(), y, T_b, U_b


def _boundary(T_b, U_b):
    return torch.stack([torch.zeros_like(T_b), torch.zeros_like(T_b), U_b, T_b], 1)


def _loss(on, **kw):
    x, y, T_b, U_b, blank = _logits()
    w = upstream_weights(3)
    with on():
        if not kw.pop("fused_log_softmax", True):
            return _grads(rnnt_lattice.rnnt_loss(x.log_softmax(-1), y, T_b, U_b, blank,
                                                 fused_log_softmax=False, reduction="none",
                                                 **kw), [x], w)
        return _grads(rnnt_lattice.rnnt_loss(x, y, T_b, U_b, blank, reduction="none", **kw),
                      [x], w)


def _tdt(on):
    x, y, T_b, U_b, _ = _logits(extra=3)
    y = torch.where(y == 5, 1, y)                  # class 5: the blank (the last token)
    w = upstream_weights(3)
    with on():
        return _grads(rnnt_lattice.tdt_loss(x, y, T_b, U_b, blank=5, durations=[0, 1, 2],
                                            reduction="none", sigma=0.05), [x], w)


def _multiblank(on):
    x, y, T_b, U_b, _ = _logits(extra=2)
    y = torch.where(y == 5, 1, y)                  # classes 5 and 6: the big blanks, 7 the blank
    w = upstream_weights(3)
    with on():
        return _grads(rnnt_lattice.multiblank_rnnt_loss(x, y, T_b, U_b, blank=7,
                                                        big_blank_durations=[2, 3],
                                                        reduction="none"), [x], w)


def _packed(on):
    x, y, T_b, U_b, blank = _logits("ragged_tight")
    w = upstream_weights(3)
    with on():
        rows = rnnt_lattice.pack_logits(x, T_b, U_b)
        return _grads(rnnt_lattice.rnnt_loss(rows, y, T_b, U_b, blank, packed=True,
                                             reduction="none"), [x], w)


def _tools(on):
    x, y, T_b, U_b, blank = _logits()
    x = x.detach()
    with on():
        occ = rnnt_lattice.occupancy(x, y, T_b, U_b, blank)
        best = rnnt_lattice.best_alignment(x, y, T_b, U_b, blank)
        cover = rnnt_lattice.prune_coverage(occ, 3)
        return [occ.gamma, occ.log_likelihood, best.log_prob, best.emit_frames,
                cover.per_sequence]


def _simple_losses(on, scale=1.0, smoothed=False):
    lm, am, y, T_b, U_b = _simple(scale)
    w = upstream_weights(3)
    with on():
        if smoothed:
            loss = rnnt_lattice.rnnt_loss_smoothed(lm, am, y, T_b, U_b, blank=0, reduction="none")
        else:
            loss = rnnt_lattice.rnnt_loss_simple(lm, am, y, T_b, U_b, blank=0, reduction="none")
        return _grads(loss, [lm, am], w)


def _pruned(on, method):
    """The pruned pipeline: the simple loss's occupations, windows, the pruned loss."""
    lm, am, y, T_b, U_b = _simple()
    w = upstream_weights(3)
    with on():
        simple, occ = rnnt_lattice.rnnt_loss_simple(lm, am, y, T_b, U_b, blank=0,
                                                    reduction="none", return_occupations=True)
        win = rnnt_lattice.prune_ranges(occ, 2, method=method, logit_lengths=T_b,
                                        target_lengths=U_b)
        am_p, lm_p = rnnt_lattice.do_rnnt_pruning(am, lm, win.ranges)
        pruned = rnnt_lattice.rnnt_loss_pruned(am_p + lm_p, y, win.ranges, T_b, U_b, blank=0,
                                               reduction="none")
        return [win.ranges, *_grads(simple + pruned, [lm, am], w)]


def _lattice_loss(on):
    g = torch.Generator().manual_seed(0)
    b, e = (torch.randn(3, 5, 4, generator=g).requires_grad_() for _ in range(2))
    w = upstream_weights(3)
    with on():
        return _grads(rnnt_lattice.lattice_loss(b, e, torch.tensor([5, 2, 4]),
                                                torch.tensor([3, 1, 0])), [b, e], w)


def _fused(on):
    torch.manual_seed(0)
    joiner = rnnt_lattice.Joiner(4, 3, 8, 6)
    g = torch.Generator().manual_seed(0)
    enc = torch.randn(3, 5, 4, generator=g, requires_grad=True)
    pred = torch.randn(3, 4, 3, generator=g, requires_grad=True)
    y = torch.randint(1, 6, (3, 3), generator=g)
    T_b, U_b, w = torch.tensor([5, 2, 4]), torch.tensor([3, 1, 0]), upstream_weights(3)
    with on():
        loss = rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, y, T_b, U_b, blank=0, tile=4,
                                            reduction="none")
        return _grads(loss, [enc, pred, *joiner.parameters()], w)


def _k2_simple(on, smoothed=False):
    lm, am, y, T_b, U_b = _simple()
    boundary, w = _boundary(T_b, U_b), upstream_weights(3)
    with on():
        if smoothed:
            px, py = k2.get_rnnt_logprobs_smoothed(lm, am, y, 0, 0.1, 0.2, boundary)
            loss = k2.rnnt_loss_smoothed(lm, am, y, 0, 0.1, 0.2, boundary, reduction="none")
        else:
            px, py = k2.get_rnnt_logprobs(lm, am, y, 0, boundary=boundary)
            loss = k2.rnnt_loss_simple(lm, am, y, 0, boundary, reduction="none")
        return [px, py, *_grads(loss, [lm, am], w)]


def _k2_pruned(on, hat):
    lm, am, y, T_b, U_b = _simple()
    # windows of 2 along each sequence's labels: positions t // 2, inside [0, U_b]
    start = torch.minimum(torch.arange(6)[None, :] // 2, (U_b[:, None] - 1).clamp(min=0))
    ranges = (start[..., None] + torch.arange(2)).contiguous()
    boundary, w = _boundary(T_b, U_b), upstream_weights(3)
    with on():
        am_p, lm_p = k2.do_rnnt_pruning(am, lm, ranges)
        loss = k2.rnnt_loss_pruned(am_p + lm_p, y, ranges, 0, boundary, reduction="none",
                                   use_hat_loss=hat)
        return _grads(loss, [lm, am], w)


CASES = {
    "rnnt_loss": lambda on: _loss(on),
    "rnnt_loss log-prob mode": lambda on: _loss(on, fused_log_softmax=False),
    "rnnt_loss clamp, FastEmit": lambda on: _loss(on, clamp=0.3, fastemit_lambda=0.01),
    "rnnt_loss modified, delay penalty": lambda on: _loss(on, rnnt_type="modified",
                                                          delay_penalty=0.2),
    "rnnt_loss constrained, boundary": lambda on: _loss(
        on, rnnt_type="constrained", boundary=torch.tensor([[0, 0, 2, 4], [0, 0, 1, 2],
                                                            [0, 0, 0, 3]])),
    "rnnt_loss zero_infinity": lambda on: _loss(on, rnnt_type="modified", zero_infinity=True),
    "tdt_loss": _tdt,
    "multiblank_rnnt_loss": _multiblank,
    "packed": _packed,
    "occupancy, best_alignment, prune_coverage": _tools,
    "rnnt_loss_simple": lambda on: _simple_losses(on),
    "rnnt_loss_simple, rows 500x apart (rescue)": lambda on: _simple_losses(on, 500.0),
    "rnnt_loss_smoothed": lambda on: _simple_losses(on, smoothed=True),
    "pruned pipeline, exact windows": lambda on: _pruned(on, "exact"),
    "pruned pipeline, k2's windows": lambda on: _pruned(on, "k2"),
    "lattice_loss": _lattice_loss,
    "fused_rnnt_loss, Joiner": _fused,
    "compat.k2 simple": lambda on: _k2_simple(on),
    "compat.k2 smoothed": lambda on: _k2_simple(on, smoothed=True),
    "compat.k2 pruned": lambda on: _k2_pruned(on, False),
    "compat.k2 pruned, HAT": lambda on: _k2_pruned(on, True),
}

