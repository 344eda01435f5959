"""``rnnt_lattice.compat.warprnnt_numba``: warprnnt-numba's ``RNNTLossNumba``,
``RNNTLossNumbaAtomicLock`` and ``rnnt_loss`` (NeMo's loss published on its own) against the
brute-force float64 oracle: raw logits, int32 ids, costs in the dtype of ``acts`` (where
NeMo's are float32), ``'sum'``/``'mean'`` of shape (1,), ``'mean'`` = sum / B, FastEmit's
scaled cost, the clamp; and its ``numba_utils``."""
from __future__ import annotations

import doctest
import os

import pytest
import torch

from support.cases import TINY, Case, loss_and_grad, make_inputs, rel_err, upstream_weights
from support.oracle import batch_grad
from rnnt_lattice.compat import nemo
from rnnt_lattice.compat import warprnnt_numba as wn

TOL = {torch.float64: 1e-10, torch.float32: 4 * 2.0**-23 * 8}
LOSSES = {"function": lambda **kw: (lambda *a: wn.rnnt_loss(*a, **kw)),
          "module": lambda **kw: wn.RNNTLossNumba(**kw),
          "atomic_lock": lambda **kw: wn.RNNTLossNumbaAtomicLock(**kw)}


def numba_inputs(case, dtype=torch.float32, seed=0):
    """A case's inputs as warprnnt-numba's users pass them: ``dtype`` acts, int32 ids."""
    acts, labels, act_lens, label_lens, blank = make_inputs(case, seed=seed)
    return (acts.to(dtype), labels.to(torch.int32), act_lens.to(torch.int32),
            label_lens.to(torch.int32), blank)


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", [c for c in TINY if c.blank >= 0], ids=lambda c: c.name)
def test_matches_brute_force(case, dtype, loss):
    acts, labels, act_lens, label_lens, blank = numba_inputs(case, dtype)
    w = upstream_weights(case.B)
    want_loss, want_grad = batch_grad(acts, labels, act_lens, label_lens, blank, True)
    fn = LOSSES[loss](blank=blank, reduction="none")
    got, grad = loss_and_grad(fn, acts, labels, act_lens, label_lens, weights=w)
    assert got.shape == (case.B,) and got.dtype == dtype and grad.dtype == dtype
    assert rel_err(got, want_loss) <= TOL[dtype]
    assert rel_err(grad, want_grad * w[:, None, None, None]) <= TOL[dtype]


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("reduction", ["none", None, "sum", "mean"])
def test_reductions_and_defaults(reduction, loss):
    """'sum' and 'mean' come back with shape (1,), 'mean' divides the sum (and so the
    gradient) by B; the defaults are blank=0 and reduction='mean'."""
    case = Case("reduce", (4, 3, 2), (2, 3, 1), 5, 0)
    acts, labels, act_lens, label_lens, blank = numba_inputs(case, torch.float64, seed=1)
    want_loss, want_grad = batch_grad(acts, labels, act_lens, label_lens, blank, True)
    scale = 1.0 / case.B if reduction == "mean" else 1.0
    got, grad = loss_and_grad(LOSSES[loss](reduction=reduction), acts, labels, act_lens,
                              label_lens)
    per_sequence = reduction in ("none", None)
    assert got.shape == ((case.B,) if per_sequence else (1,))
    want = want_loss if per_sequence else (want_loss.sum() * scale).reshape(1)
    assert rel_err(got, want) <= TOL[torch.float64]
    assert rel_err(grad, want_grad * scale) <= TOL[torch.float64]
    default = LOSSES[loss]()(acts, labels, act_lens, label_lens)
    assert rel_err(default, want_loss.mean().reshape(1)) <= TOL[torch.float64]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_costs_in_the_dtype_of_acts_where_nemo_returns_float32(dtype):
    """The one difference from compat.nemo's RNNTLossNumba: warprnnt-numba's cost buffer has
    the dtype of ``acts``. FastEmit and clamp give NeMo's values: the cost scaled by
    ``1 + lambda``, the FastEmit gradient, each sequence's gradient clipped."""
    case = Case("fe", (4, 3), (2, 3), 5, 0)
    acts, labels, act_lens, label_lens, blank = numba_inputs(case, dtype, seed=2)
    kw = dict(blank=blank, reduction="none", fastemit_lambda=0.5, clamp=0.1)
    got, grad = loss_and_grad(wn.RNNTLossNumba(**kw), acts, labels, act_lens, label_lens)
    ref, ref_grad = loss_and_grad(nemo.RNNTLossNumba(**kw), acts, labels, act_lens, label_lens)
    assert got.dtype == dtype and ref.dtype == torch.float32
    assert torch.equal(got.float(), ref) and torch.equal(grad, ref_grad)
    want_loss, want_grad = batch_grad(acts, labels, act_lens, label_lens, blank, True,
                                      clamp=0.1, fastemit_lambda=0.5)
    assert rel_err(got, 1.5 * want_loss) <= TOL[dtype]
    assert rel_err(grad, want_grad) <= TOL[dtype]
    assert grad.abs().max() <= 0.1
    fn = wn.rnnt_loss(acts, labels, act_lens, label_lens, blank, "none", 0.5, 0.1)
    assert fn.dtype == dtype and torch.equal(fn, got)


@pytest.mark.parametrize("call, match", [
    (lambda a: wn.RNNTLossNumba(blank=4)(*a), r"labels\[0, 0\] equals the blank id 4"),
    (lambda a: wn.rnnt_loss(*a, clamp=-1.0), "clamp must be 0.0 .off. or a positive float"),
    (lambda a: wn.rnnt_loss(*a, reduction="mean_batch"), "reduction must be one of"),
    (lambda a: wn.RNNTLossNumba()(a[0], a[1].float(), *a[2:]), "labels must be"),
], ids=["label_is_blank", "negative_clamp", "reduction", "float_labels"])
def test_errors_name_the_argument(call, match):
    """What warprnnt-numba accepts silently (a label equal to the blank, as its README's
    "BOS" example passes; an unknown reduction) or refuses with another error, is a
    ValueError naming warprnnt-numba's argument."""
    acts = torch.randn(1, 3, 3, 5)
    args = (acts, torch.tensor([[4, 1]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
            torch.tensor([2], dtype=torch.int32))
    with pytest.raises(ValueError, match=match):
        call(args)


def test_numba_utils_answer_for_this_module(monkeypatch):
    """The README's check before a CUDA run answers whether the loss runs on CUDA here: it
    needs no Numba CUDA, only a device PyTorch sees."""
    u = wn.numba_utils
    assert wn.__NUMBA_MINIMUM_VERSION__ == u.__NUMBA_MINIMUM_VERSION__ == "0.53.0"
    assert u.numba_cpu_is_supported(wn.__NUMBA_MINIMUM_VERSION__) is True
    for available in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        assert u.numba_cuda_is_supported("0.53.0") is available
    u.skip_numba_cuda_test_if_unsupported("0.53.0")          # available: returns
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(pytest.skip.Exception, match="no CUDA device"):
        u.skip_numba_cuda_test_if_unsupported("0.53.0")
    assert u.is_numba_compat_strict() is True                # warprnnt-numba's default
    with u.with_numba_compat_strictness(False):
        assert u.is_numba_compat_strict() is False
        assert u.numba_cpu_is_supported("0.53.0") and not u.numba_cuda_is_supported("0.53.0")
    assert u.is_numba_compat_strict() is True


def test_numba_utils_has_the_peers_other_names():
    """warprnnt-numba's other public names import and answer as there: the installation
    hint, a class by its dotted path, and a library's version check (ok, message) -- None
    for a library that is not installed, False for one without ``__version__``."""
    import collections
    import operator
    u = wn.numba_utils
    assert "numba" in u.NUMBA_INSTALLATION_MESSAGE
    assert u.import_class_by_path("collections.OrderedDict") is collections.OrderedDict
    assert u.import_class_by_path("os.path") is os.path
    assert u.check_lib_version("torch", "1.0", operator.ge)[0] is True
    assert u.check_lib_version("torch", "1000.0", operator.ge)[0] is False
    assert u.check_lib_version("rnnt_lattice_no_such_lib", "1.0", operator.ge)[0] is None
    assert u.check_lib_version("math", "1.0", operator.ge)[0] is False       # no __version__


def test_docstring_example():
    failed, tried = doctest.testmod(wn, optionflags=doctest.ELLIPSIS)[:2]
    assert tried > 0 and failed == 0
