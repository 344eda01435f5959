"""``rnnt_lattice.compat.warp_transducer``: warprnnt_pytorch's ``rnnt_loss`` / ``RNNTLoss``
conventions (raw logits, int32 ids, the loss in the acts' dtype, "none" -> (B,), "sum" and
"mean" -> shape (1,), "mean" = sum / B for the loss and its gradient, blank=0) and the ESPnet
fork's FastEmit, against the brute-force float64 oracle; the documented fixes of its
defects (unknown reduction, label == blank, repeated backward, dtypes)."""
from __future__ import annotations

import pytest
import torch

from support.cases import TINY, Case, loss_and_grad, make_inputs, rel_err, upstream_weights
from support.oracle import batch_grad
from rnnt_lattice.compat import warp_transducer as wt

TOL = {torch.float64: 1e-10, torch.float32: 4 * 2.0**-23 * 8}


def warp_inputs(case, dtype=torch.float32, seed=0):
    """A case's inputs in warp-transducer's dtypes: ``dtype`` acts, int32 ids and lengths."""
    acts, labels, act_lens, label_lens, blank = make_inputs(case, seed=seed)
    return (acts.to(dtype), labels.to(torch.int32), act_lens.to(torch.int32),
            label_lens.to(torch.int32), blank)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", [c for c in TINY if c.blank >= 0], ids=lambda c: c.name)
def test_matches_brute_force(case, dtype):
    acts, labels, act_lens, label_lens, blank = warp_inputs(case, dtype)
    w = upstream_weights(case.B)
    want_loss, want_grad = batch_grad(acts, labels, act_lens, label_lens, blank, True)
    loss, grad = loss_and_grad(wt.rnnt_loss, acts, labels, act_lens, label_lens, blank, "none",
                               weights=w)
    assert loss.shape == (case.B,) and loss.dtype == dtype and grad.dtype == dtype
    assert rel_err(loss, want_loss) <= TOL[dtype]
    assert rel_err(grad, want_grad * w[:, None, None, None]) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_reductions(reduction, dtype):
    """"sum" and "mean" come back with shape (1,), "mean" divides the sum (and so the
    gradient) by B, not by the target lengths; the defaults are blank=0, reduction="mean"."""
    case = Case("reduce", (4, 3, 2), (2, 3, 1), 5, 0)
    acts, labels, act_lens, label_lens, blank = warp_inputs(case, dtype, seed=1)
    want_loss, want_grad = batch_grad(acts, labels, act_lens, label_lens, blank, True)
    scale = 1.0 / case.B if reduction == "mean" else 1.0
    for fn in (lambda *a: wt.rnnt_loss(*a, reduction=reduction), wt.RNNTLoss(reduction=reduction)):
        loss, grad = loss_and_grad(fn, acts, labels, act_lens, label_lens)
        assert loss.dtype == dtype
        assert loss.shape == ((case.B,) if reduction == "none" else (1,))
        want = want_loss if reduction == "none" else (want_loss.sum() * scale).reshape(1)
        assert rel_err(loss, want) <= TOL[dtype]
        assert rel_err(grad, want_grad * scale) <= TOL[dtype]
    default = wt.rnnt_loss(acts, labels, act_lens, label_lens)
    assert default.shape == (1,) and rel_err(default, want_loss.mean().reshape(1)) <= TOL[dtype]


@pytest.mark.parametrize("fastemit_lambda", [0.001, 0.5])
def test_fastemit(fastemit_lambda):
    """The ESPnet fork's FastEmit: the loss stays -log P, the label arcs' gradient is
    scaled by 1 + lambda; keyword in RNNTLoss, the 7th positional of rnnt_loss (fork order)."""
    case = Case("fastemit", (4, 3), (2, 3), 6, 2)
    acts, labels, act_lens, label_lens, blank = warp_inputs(case, torch.float64, seed=2)
    w = upstream_weights(case.B)
    want_loss, want_grad = batch_grad(acts, labels, act_lens, label_lens, blank, True,
                                      fastemit_lambda=fastemit_lambda)
    for fn in (lambda *a: wt.rnnt_loss(*a, blank, "none", fastemit_lambda),
               wt.RNNTLoss(blank, "none", fastemit_lambda=fastemit_lambda)):
        loss, grad = loss_and_grad(fn, acts, labels, act_lens, label_lens, weights=w)
        assert rel_err(loss, want_loss) <= TOL[torch.float64]
        assert rel_err(grad, want_grad * w[:, None, None, None]) <= TOL[torch.float64]


def test_fork_positional_order_is_refused():
    """RNNTLoss(blank, fastemit_lambda, reduction) (the fork's order) cannot be mistaken for
    master's RNNTLoss(blank, reduction): a number in the reduction slot is a ValueError
    that names fastemit_lambda, and a third positional a TypeError (keyword-only)."""
    with pytest.raises(ValueError, match="pass fastemit_lambda= by name"):
        wt.RNNTLoss(0, 0.001)
    for args in ((0, 0.001, "mean"), (0, "mean", 0.001)):
        with pytest.raises(TypeError):
            wt.RNNTLoss(*args)


def test_fixed_defects():
    """warp-transducer returns per-sequence losses for an unknown reduction, overwrites the
    blank's gradient when a label equals the blank (CPU), and scales its saved gradient in
    place (a second backward is wrong): here ValueError, ValueError, the same gradient."""
    case = Case("defects", (3, 2), (2, 1), 5, 0)
    acts, labels, act_lens, label_lens, blank = warp_inputs(case, seed=3)
    with pytest.raises(ValueError, match="reduction"):
        wt.rnnt_loss(acts, labels, act_lens, label_lens, reduction="avg")
    bad = labels.clone()
    bad[0, 0] = blank
    with pytest.raises(ValueError, match="blank"):
        wt.rnnt_loss(acts, bad, act_lens, label_lens)
    x = acts.detach().clone().requires_grad_()
    loss = wt.rnnt_loss(x, labels, act_lens, label_lens, reduction="sum")
    (g1,) = torch.autograd.grad(3 * loss, x, retain_graph=True)
    (g2,) = torch.autograd.grad(3 * loss, x)
    assert torch.equal(g1, g2)
    _, want_grad = batch_grad(acts, labels, act_lens, label_lens, blank, True)
    assert rel_err(g1, 3 * want_grad) <= TOL[torch.float32]


def test_warp_dtypes_only():
    """warp-transducer's dtypes, ValueError naming the argument otherwise."""
    case = Case("dtypes", (3,), (2,), 4, 0)
    acts, labels, act_lens, label_lens, blank = warp_inputs(case)
    with pytest.raises(ValueError, match="acts must be a float32 or float64"):
        wt.rnnt_loss(acts.half(), labels, act_lens, label_lens)
    for i, name in enumerate(("labels", "act_lens", "label_lens")):
        args = [labels, act_lens, label_lens]
        args[i] = args[i].long()
        with pytest.raises(ValueError, match=f"{name} must be int32"):
            wt.rnnt_loss(acts, *args)


# --------------------------------------------------------------------------- install()

@pytest.fixture
def no_warp(monkeypatch):
    """No warprnnt_pytorch anywhere: not imported, and not found on the path."""
    import importlib.util
    import sys

    monkeypatch.delitem(sys.modules, "warprnnt_pytorch", raising=False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "warprnnt_pytorch" else real_find_spec(name, *a))
    yield
    wt.uninstall()


def test_install_makes_import_warprnnt_pytorch_resolve_to_the_drop_in(no_warp):
    import sys

    with pytest.raises(ImportError):
        import warprnnt_pytorch  # noqa: F401
    assert wt.install() is True and wt.install() is True                 # idempotent
    from warprnnt_pytorch import RNNTLoss                                 # ESPnet's import
    assert RNNTLoss is wt.RNNTLoss
    # ESPnet's construction and call: RNNTLoss(blank=..., fastemit_lambda=...), "mean"
    acts, labels, act_lens, label_lens, blank = warp_inputs(TINY[0], torch.float64)
    loss = RNNTLoss(blank=blank, fastemit_lambda=0.0)(acts, labels, act_lens, label_lens)
    want, _ = batch_grad(acts, labels, act_lens, label_lens, blank, fused=True)
    torch.testing.assert_close(loss, want.mean().reshape(1), rtol=1e-10, atol=1e-10)
    wt.uninstall()
    assert "warprnnt_pytorch" not in sys.modules
    with pytest.raises(ImportError):
        import warprnnt_pytorch  # noqa: F401,F811
    with wt.installed():
        assert sys.modules["warprnnt_pytorch"] is wt
    assert "warprnnt_pytorch" not in sys.modules


def test_install_keeps_a_real_warp_transducer_unless_asked(no_warp, monkeypatch):
    import sys
    import types

    real = types.ModuleType("warprnnt_pytorch")
    monkeypatch.setitem(sys.modules, "warprnnt_pytorch", real)
    with pytest.warns(UserWarning, match="is kept"):
        assert wt.install() is False
    assert sys.modules["warprnnt_pytorch"] is real
    wt.uninstall()                                                        # nothing to undo
    assert sys.modules["warprnnt_pytorch"] is real
    assert wt.install(replace=True) is True
    assert sys.modules["warprnnt_pytorch"] is wt
    wt.uninstall()
    assert sys.modules["warprnnt_pytorch"] is real
