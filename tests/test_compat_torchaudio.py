"""``rnnt_lattice.compat.torchaudio``: torchaudio's ``rnnt_loss`` / ``RNNTLoss`` conventions
(int32 ids, float32/float16 logits, the loss in the logits' dtype, reductions, clamp,
``fused_log_softmax``) checked against the brute-force float64 oracle; TorchScript of a
caller (function and module, through save/load) and ``torch.compile`` of a caller against
eager; the documented differences (ValueError, out-of-range targets, empty batch)."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from support.cases import TINY, Case, loss_and_grad, make_inputs, rel_err, upstream_weights
from support.oracle import batch_grad
from rnnt_lattice.compat import torchaudio as ta

# The lattice runs in float64 for float32 logits (a few eps of rounding remain); float16
# logits are computed in float32 and the loss / gradient rounded to float16.
TOL = {torch.float32: 4 * 2.0**-23 * 8, torch.float16: 2.0**-10 * 4}


def int32_inputs(case, dtype=torch.float32, seed=0):
    """A case's inputs in torchaudio's dtypes: ``dtype`` logits, int32 ids and lengths."""
    logits, targets, tl, ul, blank = make_inputs(case, seed=seed)
    return (logits.to(dtype), targets.to(torch.int32), tl.to(torch.int32), ul.to(torch.int32),
            blank)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", TINY, ids=lambda c: c.name)
def test_matches_brute_force(case, dtype):
    logits, targets, tl, ul, blank = int32_inputs(case, dtype)
    w = upstream_weights(case.B)
    want_loss, want_grad = batch_grad(logits, targets, tl, ul, blank, True)
    loss, grad = loss_and_grad(ta.rnnt_loss, logits, targets, tl, ul, blank, weights=w,
                               reduction="none")
    assert loss.shape == (case.B,) and loss.dtype == dtype and grad.dtype == dtype
    assert rel_err(loss, want_loss) <= TOL[dtype]
    assert rel_err(grad, want_grad * w[:, None, None, None]) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_reductions_shapes_and_dtypes(reduction, dtype):
    """"none" -> (B,), "sum" -> a scalar, "mean" -> sum / B, all in the logits' dtype (the
    float16 loss is torchaudio's choice, not the top-level rnnt_loss's float32)."""
    case = Case("reduce", (4, 3, 2), (2, 3, 1), 5, 0)
    logits, targets, tl, ul, blank = int32_inputs(case, dtype, seed=1)
    want_loss, want_grad = batch_grad(logits, targets, tl, ul, blank, True)
    scale = 1.0 / case.B if reduction == "mean" else 1.0
    for fn in (ta.rnnt_loss, lambda *a, **kw: ta.RNNTLoss(blank, reduction=reduction)(*a)):
        loss, grad = loss_and_grad(fn, logits, targets, tl, ul, blank=blank, reduction=reduction)
        assert loss.dtype == dtype and grad.dtype == dtype
        assert loss.shape == ((case.B,) if reduction == "none" else ())
        want = want_loss if reduction == "none" else want_loss.sum() * scale
        assert rel_err(loss, want) <= TOL[dtype]
        assert rel_err(grad, want_grad * scale) <= TOL[dtype]


def test_defaults():
    """blank=-1 (the last class), clamp off, reduction "mean", fused log-softmax."""
    case = Case("defaults", (3, 2), (2, 1), 4, -1)
    logits, targets, tl, ul, _ = int32_inputs(case, seed=2)
    want_loss, want_grad = batch_grad(logits, targets, tl, ul, case.V - 1, True)
    for fn in (ta.rnnt_loss, ta.RNNTLoss()):
        loss, grad = loss_and_grad(fn, logits, targets, tl, ul)
        assert loss.shape == ()
        assert rel_err(loss, want_loss.mean()) <= TOL[torch.float32]
        assert rel_err(grad, want_grad / case.B) <= TOL[torch.float32]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logprob"])
@pytest.mark.parametrize("clamp", [-1.0, 0.05])
def test_clamp_and_fused_log_softmax(clamp, fused):
    """clamp clips the per-sequence gradient before the upstream factor; with
    fused_log_softmax=False the logits are log-probabilities (gradient w.r.t. them)."""
    case = Case("clamp", (4, 3), (2, 3), 6, 2)
    logits, targets, tl, ul, blank = int32_inputs(case, seed=3)
    logits = logits * 2 if fused else torch.log_softmax(2 * logits.double(), -1).float()
    w = upstream_weights(case.B)
    want_loss, want_grad = batch_grad(logits, targets, tl, ul, blank, fused, clamp)
    loss, grad = loss_and_grad(ta.rnnt_loss, logits, targets, tl, ul, blank, clamp,
                               "none", fused, weights=w)
    assert rel_err(loss, want_loss) <= TOL[torch.float32]
    assert rel_err(grad, want_grad * w[:, None, None, None]) <= TOL[torch.float32]
    if clamp > 0:
        assert (grad.abs() <= clamp * w.abs().max() * (1 + 1e-6)).all()


def _round_trip(scripted):
    buf = io.BytesIO()
    torch.jit.save(scripted, buf)
    buf.seek(0)
    return torch.jit.load(buf)


def _caller(logits: torch.Tensor, targets: torch.Tensor, logit_lengths: torch.Tensor,
            target_lengths: torch.Tensor):
    return ta.rnnt_loss(logits, targets, logit_lengths, target_lengths, blank=0, clamp=0.4,
                        reduction="sum")


# Recent torch deprecates TorchScript (it warns); torchaudio's users script all the same.
@pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_torchscript_caller_and_module(dtype):
    """A caller of rnnt_loss and RNNTLoss compile with torch.jit.script, survive save/load,
    and give eager's loss and gradient (autograd through the registered op)."""
    case = Case("script", (4, 3, 2), (2, 3, 1), 5, 0)
    logits, targets, tl, ul, _ = int32_inputs(case, dtype, seed=4)
    module = ta.RNNTLoss(blank=0, clamp=0.4, reduction="sum")
    torch.jit.script(ta.RNNTLoss(blank=np.int64(0), clamp=1))    # an int clamp: a float here
    for eager, scripted in ((_caller, _round_trip(torch.jit.script(_caller))),
                            (module, _round_trip(torch.jit.script(module)))):
        want_loss, want_grad = loss_and_grad(eager, logits, targets, tl, ul)
        for _ in range(2):                   # the profiling executor optimises on a rerun
            loss, grad = loss_and_grad(scripted, logits, targets, tl, ul)
            assert loss.dtype == dtype and grad.dtype == dtype
            assert torch.equal(loss, want_loss) and torch.equal(grad, want_grad)
        with torch.no_grad():
            assert torch.equal(scripted(logits, targets, tl, ul), want_loss)


def test_torch_compile_caller():
    """torch.compile(fullgraph=True) traces through the op (to the library's own compiled
    path) and matches eager, forward and backward."""
    case = Case("compile", (4, 2), (2, 1), 5, 0)
    logits, targets, tl, ul, _ = int32_inputs(case, seed=5)
    compiled = torch.compile(_caller, backend="aot_eager", fullgraph=True)
    want_loss, want_grad = loss_and_grad(_caller, logits, targets, tl, ul)
    loss, grad = loss_and_grad(compiled, logits, targets, tl, ul)
    assert rel_err(loss, want_loss) <= TOL[torch.float32]
    assert rel_err(grad, want_grad) <= TOL[torch.float32]
    # A dtype torchaudio refuses is the eager call's ValueError (the op's kernel checked it
    # on fake tensors, which TorchDynamo reported as a TorchRuntimeError).
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="logits must be float32 or float16"):
        torch.compile(_caller, backend="aot_eager")(logits.double(), targets, tl, ul)
    with pytest.raises(ValueError, match="targets must be int32"):
        torch.compile(_caller, backend="aot_eager")(logits, targets.long(), tl, ul)
    torch._dynamo.reset()


def test_torchaudio_dtypes_only():
    """torchaudio's accepted dtypes, with ValueError naming the argument (torchaudio raises
    RuntimeError); the top-level rnnt_loss is the way to float64 or int64."""
    case = Case("dtypes", (3,), (2,), 4, 0)
    logits, targets, tl, ul, blank = int32_inputs(case)
    with pytest.raises(ValueError, match="logits must be float32 or float16"):
        ta.rnnt_loss(logits.double(), targets, tl, ul, blank)
    with pytest.raises(ValueError, match="logits must be float32 or float16"):
        ta.rnnt_loss(logits.bfloat16(), targets, tl, ul, blank)
    for i, name in enumerate(("targets", "logit_lengths", "target_lengths")):
        args = [targets, tl, ul]
        args[i] = args[i].long()
        with pytest.raises(ValueError, match=f"{name} must be int32"):
            ta.rnnt_loss(logits, *args, blank)
    with pytest.raises(ValueError, match='reduction should be one of "none", "mean", or "sum"'):
        ta.rnnt_loss(logits, targets, tl, ul, blank, reduction="batchmean")


@pytest.mark.parametrize("kw, words", [
    (dict(blank=True), "blank must be an int, got True"),
    (dict(blank=1.0), "blank must be an int, got 1.0"),
    (dict(clamp="x"), "clamp must be a number, got 'x'"),
    (dict(clamp=torch.tensor([1.0, 2.0])), r"clamp must be a number, got a tensor of shape \(2,\)"),
    # the op's schema casts None to False: raw logits read as log-probs, a finite, wrong loss
    (dict(fused_log_softmax=None), "fused_log_softmax must be a bool, got None"),
    (dict(blank=2 ** 70), r"blank must be a class id of the logits \(an int64\), got 1180591620717411303424"),
    (dict(logits="list"), "logits must be a torch.Tensor, got list"),
    (dict(targets="numpy"), "targets must be a torch.Tensor, got ndarray"),
], ids=["blank_bool", "blank_float", "clamp_str", "clamp_tensor", "fused_none", "blank_huge",
        "logits_list", "targets_numpy"])
def test_what_the_schema_would_cast_is_checked(kw, words):
    """The op's schema would cast a bool blank and a None flag in silence, and refuse
    non-tensors with a RuntimeError naming no argument: each is a ValueError naming it, in
    the function and (the options) in the module's constructor."""
    case = Case("options", (3,), (2,), 4, 0)
    logits, targets, tl, ul, blank = int32_inputs(case)
    args = dict(logits=logits, targets=targets, logit_lengths=tl, target_lengths=ul, blank=blank)
    for name, how in (("logits", kw.get("logits")), ("targets", kw.get("targets"))):
        if how is not None:
            args[name] = args[name].tolist() if how == "list" else args[name].numpy()
    args.update({k: v for k, v in kw.items() if k not in ("logits", "targets")})
    with pytest.raises(ValueError, match=words):
        ta.rnnt_loss(**args)
    options = {k: v for k, v in kw.items() if k in ("blank", "clamp", "fused_log_softmax")}
    if options:
        with pytest.raises(ValueError, match=words):
            ta.RNNTLoss(**options)


def test_numpy_scalars_are_taken_as_the_schema_takes_them():
    """The op's schema takes NumPy's bool and integers: so do the checks before it."""
    import numpy as np
    case = Case("numpy", (3,), (2,), 4, 0)
    logits, targets, tl, ul, blank = int32_inputs(case)
    want = ta.rnnt_loss(logits, targets, tl, ul, blank)
    got = ta.rnnt_loss(logits, targets, tl, ul, np.int64(blank), fused_log_softmax=np.True_)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fixed_defects():
    """Where torchaudio is silently wrong or fails: an out-of-range target id is a
    ValueError (torchaudio reads out of bounds), an empty batch's mean is 0 (torchaudio
    fails), T_b = 0 gives +inf with a zero gradient, and padding beyond the longest
    sequence is accepted (torchaudio demands T = max T_b)."""
    case = Case("defects", (3, 2), (2, 1), 5, 0, T=5, U=3)
    logits, targets, tl, ul, blank = int32_inputs(case, seed=6)
    bad = targets.clone()
    bad[0, 0] = case.V
    with pytest.raises(ValueError, match=r"targets\[0, 0\]"):
        ta.rnnt_loss(logits, bad, tl, ul, blank)
    empty = ta.rnnt_loss(logits[:0], targets[:0], tl[:0], ul[:0], blank)
    assert empty.shape == () and float(empty) == 0.0
    want_loss, want_grad = batch_grad(logits, targets, tl, ul, blank, True)
    loss, grad = loss_and_grad(ta.rnnt_loss, logits, targets, tl, ul, blank, reduction="none")
    assert rel_err(loss, want_loss) <= TOL[torch.float32]
    tl0 = tl.clone()
    tl0[1] = 0
    loss, grad = loss_and_grad(ta.rnnt_loss, logits, targets, tl0, ul, blank, reduction="none")
    assert loss[1] == float("inf") and torch.all(grad[1] == 0)
    assert rel_err(loss[:1], want_loss[:1]) <= TOL[torch.float32]


# --------------------------------------------------------------------------- install()

@pytest.fixture
def fake_torchaudio(monkeypatch):
    """A stand-in for torchaudio's layout: ``rnnt_loss`` defined in
    ``torchaudio.functional.functional`` and exported by ``torchaudio.functional``,
    ``RNNTLoss`` defined in ``torchaudio.transforms._transforms`` and exported by
    ``torchaudio.transforms``."""
    import sys
    import types

    def theirs_loss(*args, **kwargs):
        return "torchaudio's rnnt_loss"

    class TheirRNNTLoss(torch.nn.Module):
        pass

    mods = {n: types.ModuleType(n) for n in (
        "torchaudio", "torchaudio.functional", "torchaudio.functional.functional",
        "torchaudio.transforms", "torchaudio.transforms._transforms")}
    for name, module in mods.items():
        monkeypatch.setitem(sys.modules, name, module)
    mods["torchaudio"].functional = mods["torchaudio.functional"]
    mods["torchaudio"].transforms = mods["torchaudio.transforms"]
    for name in ("torchaudio.functional", "torchaudio.functional.functional"):
        mods[name].rnnt_loss = theirs_loss
    for name in ("torchaudio.transforms", "torchaudio.transforms._transforms"):
        mods[name].RNNTLoss = TheirRNNTLoss
    yield mods, theirs_loss, TheirRNNTLoss
    ta.uninstall()


def test_install_replaces_torchaudio_and_uninstall_restores(fake_torchaudio):
    mods, theirs_loss, TheirRNNTLoss = fake_torchaudio
    from torchaudio.functional import rnnt_loss as bound_before          # the import-order rule
    ta.install()
    ta.install()                                                          # idempotent
    import torchaudio
    assert torchaudio.functional.rnnt_loss is ta.rnnt_loss
    assert mods["torchaudio.functional.functional"].rnnt_loss is ta.rnnt_loss
    assert torchaudio.transforms.RNNTLoss is ta.RNNTLoss
    assert mods["torchaudio.transforms._transforms"].RNNTLoss is ta.RNNTLoss
    assert bound_before is theirs_loss                                    # bound before: theirs
    logits, targets, tl, ul, blank = int32_inputs(TINY[0])
    torch.testing.assert_close(torchaudio.functional.rnnt_loss(logits, targets, tl, ul, blank),
                               ta.rnnt_loss(logits, targets, tl, ul, blank))
    ta.uninstall()
    ta.uninstall()                                                        # a no-op
    assert torchaudio.functional.rnnt_loss is theirs_loss
    assert mods["torchaudio.functional.functional"].rnnt_loss is theirs_loss
    assert torchaudio.transforms.RNNTLoss is TheirRNNTLoss
    assert mods["torchaudio.transforms._transforms"].RNNTLoss is TheirRNNTLoss
    with ta.installed():
        assert torchaudio.transforms.RNNTLoss is ta.RNNTLoss
    assert torchaudio.transforms.RNNTLoss is TheirRNNTLoss


def test_install_without_torchaudio_raises_a_clear_import_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchaudio", None)                 # import -> ImportError
    with pytest.raises(ImportError, match="needs torchaudio"):
        ta.install()
