"""``rnnt_lattice.compat.optimized_transducer``: optimized_transducer 1.4's
``transducer_loss`` / ``TransducerLoss`` on packed rows ``(sum_b T_b (U_b+1), V)`` against
the brute-force float64 oracle (regular and ``one_sym_per_frame`` lattices, raw logits and
log-probs), its reductions (a 0-dim sum or sum / B), the gradient written over the logits
buffer with ``from_log_softmax=False`` (and autograd refusing any other use of it), a
working ``nn.Module``, and its dtype and argument rules."""
from __future__ import annotations

import doctest
import math

import numpy as np
import pytest
import torch

import rnnt_lattice.compat.optimized_transducer as optimized_transducer
from rnnt_lattice import topology
from support import cases
from support.cases import Case, make_inputs, rel_err
from support.oracle import topology_batch_grad

CASES = cases.PACKED
TOL = 4 * 2.0**-23          # float32 outputs of a float64 lattice: a few float32 roundings


def packed(x: torch.Tensor, tl, ul) -> torch.Tensor:
    """optimized_transducer's layout, built independently: sequence after sequence, frame
    after frame, the ``U_b + 1`` label positions of each frame."""
    V = x.shape[-1]
    return torch.cat([x[b, :T, :U + 1].reshape(-1, V) for b, (T, U) in enumerate(zip(tl.tolist(), ul.tolist()))])


def inputs(case: Case, seed: int = 0, log_probs: bool = False):
    """float32 padded scores (log-probs with ``log_probs``) ``(B, T, U+1, V)`` with NaN
    padding, int32 targets ``(B, max U_b)`` (out of range past each length), int32 lengths."""
    logits, targets, tl, ul, blank = make_inputs(case, seed=seed)
    if log_probs:
        logits = torch.log_softmax(logits, -1)
    U = int(ul.max())
    return (logits.float(), targets[:, :U].to(torch.int32), tl.to(torch.int32), ul.to(torch.int32),
            blank % case.V)


def oracle(x, targets, tl, ul, blank, fused, topo=None):
    return topology_batch_grad(x.double(), targets.to(torch.int64), tl, ul, topo or topology.regular(),
                               blank, fused)


@pytest.mark.parametrize("one_sym_per_frame", [False, True], ids=["regular", "one_sym"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("from_log_softmax", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_transducer_loss_matches_oracle(case, from_log_softmax, reduction, one_sym_per_frame):
    """The loss is a 0-dim sum (or sum / B) of ``-log P``; the gradient is w.r.t. the raw
    logits (fused log-softmax) or, with ``from_log_softmax``, w.r.t. the log-probs."""
    x, targets, tl, ul, blank = inputs(case, log_probs=from_log_softmax)
    topo = topology.one_sym_per_frame() if one_sym_per_frame else None
    if one_sym_per_frame:
        tl = torch.maximum(tl, ul + 1)                         # feasible: T_b >= U_b + 1
        x = make_padded(case, tl, ul, from_log_softmax)
    want, want_grad = oracle(x, targets, tl, ul, blank, not from_log_softmax, topo)
    scale = 1.0 / case.B if reduction == "mean" else 1.0
    rows = packed(x, tl, ul).requires_grad_()
    expected_grad = packed(want_grad, tl, ul) * scale * 1.5
    loss = optimized_transducer.transducer_loss(rows, targets, tl, ul, blank, from_log_softmax,
                                                one_sym_per_frame, reduction)
    assert loss.shape == () and loss.dtype == torch.float32
    assert rel_err(loss, want.sum() * scale) <= TOL
    (loss * 1.5).backward()
    assert rel_err(rows.grad, expected_grad) <= TOL


def make_padded(case: Case, tl, ul, log_probs: bool) -> torch.Tensor:
    """Inputs for the lengths ``tl``, ``ul`` (which may exceed ``case``'s frames)."""
    wide = Case(case.name, tuple(tl.tolist()), tuple(ul.tolist()), case.V, case.blank)
    return inputs(wide, log_probs=log_probs)[0]


@pytest.mark.parametrize("from_log_softmax", [False, True])
def test_one_sym_per_frame_without_a_path_is_inf(from_log_softmax):
    """``T_b < U_b + 1`` and ``T_b = 0`` allow no path: ``+inf`` with a zero gradient for that
    sequence, the others exact (optimized_transducer raises for the first, crashes for the
    second)."""
    case = Case("short", (2, 1, 0, 4), (2, 1, 1, 1), 5, 0)
    x, targets, tl, ul, blank = inputs(case, log_probs=from_log_softmax)
    topo = topology.one_sym_per_frame()
    want, want_grad = oracle(x, targets, tl, ul, blank, not from_log_softmax, topo)
    assert want.isinf().tolist() == [True, True, True, False]
    rows = packed(x, tl, ul).requires_grad_()
    loss = optimized_transducer.transducer_loss(rows, targets, tl, ul, blank, from_log_softmax,
                                                one_sym_per_frame=True, reduction="sum")
    assert loss.item() == math.inf
    loss.backward()
    assert rel_err(rows.grad, packed(want_grad, tl, ul)) <= TOL
    assert (rows.grad[:-4 * 2] == 0).all()                   # the infeasible sequences' rows


def test_from_raw_logits_the_gradient_overwrites_the_logits():
    """optimized_transducer's memory saving: with ``from_log_softmax=False`` the gradient is
    written over the logits buffer, which ``logits.grad`` shares; log-probs are left alone, and
    so are logits that need no gradient."""
    x, targets, tl, ul, blank = inputs(CASES[0])
    rows = packed(x, tl, ul)
    expected = rows.clone().requires_grad_()
    loss_ref = optimized_transducer.transducer_loss(expected, targets, tl, ul, blank, False)
    loss_ref.backward()                                    # the reference's buffer is its own

    leaf = rows.clone().requires_grad_()
    loss = optimized_transducer.transducer_loss(leaf, targets, tl, ul, blank, False)
    loss.backward()
    assert torch.equal(leaf.grad, expected.grad)
    assert leaf.grad.data_ptr() == leaf.data_ptr()       # no gradient-sized allocation
    assert torch.equal(leaf.detach(), leaf.grad)         # the logits' values are gone

    lp = torch.log_softmax(rows, -1).requires_grad_()
    before = lp.detach().clone()
    optimized_transducer.transducer_loss(lp, targets, tl, ul, blank, True).backward()
    assert torch.equal(lp.detach(), before) and lp.grad.data_ptr() != lp.data_ptr()

    plain = rows.clone()
    loss_plain = optimized_transducer.transducer_loss(plain, targets, tl, ul, blank, False)
    assert torch.equal(plain, rows) and torch.equal(loss_plain, loss_ref.detach())


def test_overwritten_logits_cannot_be_misused():
    """An op that saved the logits for its own backward would read the gradient in their
    place (silently, in optimized_transducer): autograd refuses it here."""
    x, targets, tl, ul, blank = inputs(CASES[0])
    z = packed(x, tl, ul).requires_grad_()
    logits = torch.exp(z)                                  # exp saves its output
    loss = optimized_transducer.transducer_loss(logits, targets, tl, ul, blank, False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_transducer_loss_module_is_a_working_nn_module():
    """optimized_transducer's ``TransducerLoss.__init__`` skips ``super().__init__()``, so
    calling it fails; this one is a module like any other."""
    x, targets, tl, ul, blank = inputs(CASES[1])
    criterion = optimized_transducer.TransducerLoss(blank, reduction="sum")
    assert isinstance(criterion, torch.nn.Module) and criterion.state_dict() == {}
    assert "blank=4" in repr(criterion) and "reduction='sum'" in repr(criterion)
    rows = packed(x, tl, ul)
    for one_sym in (False, True):
        got = criterion(rows.clone(), targets, tl, ul, False, one_sym)
        want = optimized_transducer.transducer_loss(rows.clone(), targets, tl, ul, blank, False,
                                                    one_sym, "sum")
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="reduction"):
        optimized_transducer.TransducerLoss(0, reduction="none")


def test_dtypes_and_errors_name_the_argument():
    """float32 contiguous logits, int32 targets and lengths (optimized_transducer's contract),
    ``targets.size(1) == max(target_lengths)``, ``0 <= blank < V``, ``"mean"``/``"sum"``."""
    x, targets, tl, ul, blank = inputs(CASES[0])
    rows = packed(x, tl, ul)
    args = dict(logits=rows, targets=targets, logit_lengths=tl, target_lengths=ul, blank=blank,
                from_log_softmax=True)
    for bad, pattern in ((dict(logits=rows.double()), "logits must be torch.float32"),
                         (dict(logits=rows.half()), "logits must be torch.float32"),
                         (dict(targets=targets.long()), "targets must be torch.int32"),
                         (dict(logit_lengths=tl.long()), "logit_lengths must be torch.int32"),
                         (dict(target_lengths=ul.long()), "target_lengths must be torch.int32"),
                         (dict(logits=rows.t().contiguous().t()), "logits must be contiguous"),
                         (dict(reduction="none"), "reduction must be 'mean' or 'sum'"),
                         (dict(blank=-1), r"blank must be an int in \[0, V\)"),
                         (dict(blank=rows.shape[1]), r"blank must be an int in \[0, V\)"),
                         (dict(from_log_softmax=1), "from_log_softmax must be a bool"),
                         (dict(one_sym_per_frame=None), "one_sym_per_frame must be a bool"),
                         (dict(targets=torch.cat([targets, targets[:, :1]], 1)),
                          r"max\(target_lengths\) = 2 columns"),
                         (dict(logits=rows[:-1]), r"rows"),
                         # (torch's RuntimeError of a host read on the meta device)
                         (dict(logits=rows.to("meta"), targets=targets.to("meta"),
                               logit_lengths=tl.to("meta"), target_lengths=ul.to("meta")),
                          "reads the lengths' values .* logits is on the meta device")):
        with pytest.raises(ValueError, match=pattern):
            optimized_transducer.transducer_loss(**(args | bad))
    bad_targets = targets.clone()
    bad_targets[0, 0] = blank
    with pytest.raises(ValueError, match=r"targets\[0, 0\] equals the blank"):
        optimized_transducer.transducer_loss(**(args | dict(targets=bad_targets)))
    with pytest.raises(ValueError, match="blank must be an int, got 1.0"):
        optimized_transducer.transducer_loss(**(args | dict(blank=1.0)))
    # a NumPy int or a one-element int tensor, as optimized_transducer's binding takes them
    want = optimized_transducer.transducer_loss(**args)
    for like in (np.int64(blank), torch.tensor(blank)):
        assert torch.equal(optimized_transducer.transducer_loss(**(args | dict(blank=like))), want)


def test_docstring_examples():
    result = doctest.testmod(optimized_transducer, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
