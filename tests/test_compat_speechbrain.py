"""``rnnt_lattice.compat.speechbrain``: SpeechBrain's ``transducer_loss`` conventions
(relative lengths rounded to frames and labels, the value ``-log P / T_b`` per sequence,
reductions "mean" / "sum" / "none") and its ``TransducerLoss`` (absolute lengths), against
the brute-force float64 oracle; the gradient is the exact gradient of the returned value
(SpeechBrain's is not: the documented fix), and the documented errors."""
from __future__ import annotations

import math

import pytest
import torch

from support.cases import TINY, Case, loss_and_grad, make_inputs, rel_err, upstream_weights
from support.oracle import batch_grad
from rnnt_lattice.compat import speechbrain as sb

TOL = {torch.float64: 1e-10, torch.float32: 4 * 2.0**-23 * 8}


def relative(lengths, size, offset=0.0):
    """SpeechBrain's relative lengths ``(length + offset) / size`` in ``[0, 1]``
    (``|offset| < 0.5``: the rounding SpeechBrain applies brings back ``length``)."""
    return ((lengths.double() + offset) / max(size, 1)).clamp(0, 1)


@pytest.mark.parametrize("case", [c for c in TINY if c.blank >= 0], ids=lambda c: c.name)
def test_value_per_frame_and_its_gradient(case):
    """loss_b = -log P_b / T_b, and the gradient is that of this value (the oracle's
    gradient of -log P_b divided by T_b), with signed per-sequence upstream weights."""
    logits, targets, tl, ul, blank = make_inputs(case)
    B, T, U, V = case.shape
    w = upstream_weights(case.B)
    want_loss, want_grad = batch_grad(logits, targets, tl, ul, blank, True)
    frames = tl.double()
    for offset in (-0.3, 0.3):                     # round(), not truncation
        loss, grad = loss_and_grad(sb.transducer_loss, logits, targets, relative(tl, T, offset),
                                   relative(ul, U, offset), blank, "none", weights=w)
        assert loss.shape == (case.B,) and loss.dtype == torch.float64
        assert rel_err(loss, want_loss / frames) <= TOL[torch.float64]
        assert rel_err(grad, want_grad * (w / frames)[:, None, None, None]) <= TOL[torch.float64]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions_and_module(reduction, dtype):
    """"mean" averages the per-frame values over the batch, "sum" adds them (scalars),
    "none" keeps (B,); TransducerLoss takes absolute lengths and agrees."""
    case = Case("reduce", (4, 3, 2), (2, 3, 1), 5, 0, T=5)
    logits, targets, tl, ul, blank = make_inputs(case, seed=1)
    logits = logits.to(dtype)
    B, T, U, V = case.shape
    want_loss, want_grad = batch_grad(logits, targets, tl, ul, blank, True)
    batch_scale = 1.0 / case.B if reduction == "mean" else 1.0
    per_frame = want_loss / tl.double()
    want = per_frame if reduction == "none" else per_frame.sum() * batch_scale
    scale = batch_scale / tl.double()              # d value / d (-log P_b)
    for fn, lens in ((lambda *a: sb.transducer_loss(*a, blank, reduction),
                      (relative(tl, T), relative(ul, U))),
                     (sb.TransducerLoss(blank, reduction), (tl.int(), ul.int()))):
        loss, grad = loss_and_grad(fn, logits, targets.int(), *lens)
        assert loss.dtype == dtype and loss.shape == ((case.B,) if reduction == "none" else ())
        assert rel_err(loss, want) <= TOL[dtype]
        assert rel_err(grad, want_grad * scale[:, None, None, None]) <= TOL[dtype]


def test_speechbrain_gradient_convention_is_fixed():
    """SpeechBrain back-propagates the gradient of sum_b -log P_b whatever it returns; here
    the gradient of "mean" is that of mean_b(-log P_b / T_b), T_b * B times smaller."""
    case = Case("fix", (4, 2), (2, 1), 5, 0)
    logits, targets, tl, ul, blank = make_inputs(case, seed=2)
    _, grad = loss_and_grad(sb.transducer_loss, logits, targets, relative(tl, 4),
                            relative(ul, 2), blank)
    _, nll_grad = batch_grad(logits, targets, tl, ul, blank, True)
    ratio = nll_grad.flatten(1).norm(dim=1) / grad.flatten(1).norm(dim=1)
    assert torch.allclose(ratio, tl.double() * case.B)


def test_log_probs_input_and_defaults():
    """SpeechBrain applies log_softmax itself: log-probs give the same value as logits; the
    default reduction is "mean" and TransducerLoss's blank defaults to 0."""
    case = Case("logp", (3, 2), (2, 1), 4, 0)
    logits, targets, tl, ul, blank = make_inputs(case, seed=3)
    rel_T, rel_U = relative(tl, 3), relative(ul, 2)
    a = sb.transducer_loss(logits, targets, rel_T, rel_U, blank)
    b = sb.transducer_loss(torch.log_softmax(logits, -1), targets, rel_T, rel_U, blank)
    c = sb.TransducerLoss()(logits, targets, tl, ul)
    want_loss, _ = batch_grad(logits, targets, tl, ul, blank, True)
    for got in (a, b, c):
        assert got.shape == () and rel_err(got, (want_loss / tl.double()).mean()) <= 1e-12


def test_errors_and_zero_frames():
    """Relative lengths outside [0, 1] and unknown reductions (also "batchmean", which
    SpeechBrain's docstring lists but its code refuses) are ValueErrors naming them; a
    sequence rounded to 0 frames gives +inf with a zero gradient, not NaN."""
    case = Case("errors", (3, 2), (2, 1), 4, 0)
    logits, targets, tl, ul, blank = make_inputs(case, seed=4, poison=False)
    rel_T, rel_U = relative(tl, 3), relative(ul, 2)
    with pytest.raises(ValueError, match=r"input_lens\[0\] = 1.5"):
        sb.transducer_loss(logits, targets, rel_T * 1.5, rel_U, blank)
    with pytest.raises(ValueError, match="target_lens"):
        sb.transducer_loss(logits, targets, rel_T, -rel_U, blank)
    for reduction in ("batchmean", "avg"):
        with pytest.raises(ValueError, match="reduction"):
            sb.transducer_loss(logits, targets, rel_T, rel_U, blank, reduction)
    zero = rel_T.clone()
    zero[1] = 0.1                                  # 0.3 frames: rounds to 0
    loss, grad = loss_and_grad(sb.transducer_loss, logits, targets, zero, rel_U, blank, "none")
    assert loss[1] == math.inf and torch.all(grad[1] == 0) and torch.isfinite(grad).all()
    # integer relative lengths, as SpeechBrain takes them (1: the whole padded size); the
    # absolute lengths they may be by mistake are out of [0, 1]
    full = torch.ones(2, dtype=torch.int64)
    assert torch.equal(sb.transducer_loss(logits, targets, full, full, blank, "none"),
                       sb.transducer_loss(logits, targets, full.float(), full.float(), blank,
                                          "none"))
    with pytest.raises(ValueError, match=r"input_lens\[0\] = 3.0"):
        sb.transducer_loss(logits, targets, tl, rel_U, blank)


def test_messages_name_speechbrains_arguments():
    """The function's messages name ``input_lens`` (as the frame counts made of it),
    ``target_lens`` and ``blank_index``; the module's ``labels``, ``T`` and ``U``: never the
    library's own names."""
    case = Case("names", (3, 2), (2, 1), 4, 0)
    logits, targets, tl, ul, blank = make_inputs(case, seed=4, poison=False)
    rel_T, rel_U = relative(tl, 3), relative(ul, 2)
    with pytest.raises(ValueError, match=r"but round\(input_lens \* T\) has shape \(1,\)"):
        sb.transducer_loss(logits, targets, rel_T[:1], rel_U, blank)
    with pytest.raises(ValueError, match=r"blank_index=9 is outside \[-V, V\) = \[-4, 4\)"):
        sb.transducer_loss(logits, targets, rel_T, rel_U, 9)
    with pytest.raises(ValueError, match=r"^T\[0\] = 4 exceeds the padded size T = 3"):
        sb.TransducerLoss(blank=blank)(logits, targets, tl + 1, ul)
    bad = targets.clone()
    bad[0, 0] = 7
    with pytest.raises(ValueError, match=r"^labels\[0, 0\] = 7 is outside"):
        sb.TransducerLoss(blank=blank)(logits, bad, tl, ul)
