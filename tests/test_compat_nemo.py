"""``rnnt_lattice.compat.nemo``: NeMo's numba RNN-T / TDT / multi-blank classes and functions
against the independent path-enumerating oracle (NeMo's documented semantics, docs/variants.md B:
the ``(1 + lambda)``-scaled reported cost with the FastEmit gradient, ``'mean'`` = sum / B
with shape ``(1,)``, per-sequence clamp, int64 ids (int32 too where ESPnet's copy takes
them), big blanks in any order, omega), and ``install()`` against a small stand-in for
``nemo.collections.asr.losses.rnnt`` injected into ``sys.modules`` (the suite never needs
NeMo; the real one is checked by ``benchmarks/check_nemo_install.py``)."""
from __future__ import annotations

import dataclasses
import doctest
import importlib.abc
import importlib.util
import math
import subprocess
import sys
import types

import pytest
import torch

from rnnt_lattice import topology
from rnnt_lattice.compat import nemo
from support.cases import upstream_weights
from support.oracle import topology_batch_grad

T_LENS, U_LENS = (5, 3, 4), (2, 1, 0)          # ragged; T = max T_b, U + 1 = max U_b + 1


def _inputs(n_classes: int, n_labels: int, n_extra: int = 0, seed: int = 0):
    """NeMo-shaped float64 inputs: ``acts (B, T, U+1, n_classes + n_extra)`` (NaN in the
    padding), ``labels (B, U)`` int64 ids in ``[0, n_labels)`` (garbage past each length),
    and int64 lengths."""
    g = torch.Generator().manual_seed(seed)
    B, T, U = len(T_LENS), max(T_LENS), max(U_LENS)
    acts = torch.randn(B, T, U + 1, n_classes + n_extra, generator=g, dtype=torch.float64)
    T_b, U_b = torch.tensor(T_LENS), torch.tensor(U_LENS)
    pad = ((torch.arange(T)[None, :, None] >= T_b[:, None, None])
           | (torch.arange(U + 1)[None, None, :] > U_b[:, None, None]))
    acts = acts.masked_fill(pad[..., None], float("nan"))
    labels = torch.randint(n_labels, (B, U), generator=g)
    labels = labels.masked_fill(torch.arange(U)[None, :] >= U_b[:, None], 10**6)
    return acts, labels, T_b, U_b


# name -> (module factory, acts, topology for the oracle, blank, sigma)
def _variant(name: str, fastemit_lambda=0.0, clamp=-1, reduction="sum"):
    if name == "rnnt":
        acts, labels, T_b, U_b = _inputs(6, 6)
        blank = 0
        labels = labels.masked_fill(labels == blank, 1)
        return (nemo.RNNTLossNumba(blank, reduction, fastemit_lambda, clamp),
                (acts, labels, T_b, U_b), topology.regular(), blank, 0.0)
    if name == "tdt":
        durations = [0, 1, 2]
        acts, labels, T_b, U_b = _inputs(4, 3, n_extra=len(durations), seed=1)
        return (nemo.TDTLossNumba(3, durations, reduction, fastemit_lambda, clamp, sigma=0.05),
                (acts, labels, T_b, U_b), topology.tdt(durations), 3, 0.05)
    big = [4, 2]                                     # unsorted: big blank of 4 is class 5
    acts, labels, T_b, U_b = _inputs(7, 4, seed=2)
    return (nemo.MultiblankRNNTLossNumba(6, big, reduction, fastemit_lambda, clamp, sigma=0.1),
            (acts, labels, T_b, U_b), topology.multiblank(6, big), 6, 0.1)


def _oracle(args, topo, blank, sigma, fastemit_lambda=0.0, clamp=-1.0):
    """Per-sequence ``(-log P (B,), gradient (B, T, U+1, V))`` by path enumeration."""
    return topology_batch_grad(*args, topo, blank, True, clamp, fastemit_lambda, sigma)


@pytest.mark.parametrize("name", ["rnnt", "tdt", "multiblank"])
@pytest.mark.parametrize("fastemit_lambda", [0.0, 0.5])
def test_reported_cost_is_scaled_and_gradient_is_fastemit(name, fastemit_lambda):
    """Reported cost ``(1 + lambda) (-log P)`` per sequence; the gradient (signed upstream
    weights) is the FastEmit rule's, not the gradient of the reported value."""
    module, args, topo, blank, sigma = _variant(name, fastemit_lambda, reduction=None)
    acts = args[0].clone().requires_grad_()
    costs = module(acts, *args[1:])
    want_loss, want_grad = _oracle(args, topo, blank, sigma, fastemit_lambda)
    assert costs.shape == (3,)
    assert costs.dtype == (torch.float32 if name == "rnnt" else torch.float64)
    tol = 1e-6 if name == "rnnt" else 1e-10
    torch.testing.assert_close(costs.double(), (1 + fastemit_lambda) * want_loss, rtol=tol, atol=tol)
    w = upstream_weights(3)
    (costs * w.to(costs.dtype)).sum().backward()
    torch.testing.assert_close(torch.nan_to_num(acts.grad), (w[:, None, None, None] * want_grad),
                               rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["rnnt", "tdt", "multiblank"])
def test_reductions_shapes_and_the_reduction_attribute(name):
    """'sum' and 'mean' (sum / B) give shape (1,), None and 'none' (B,); the module reads
    ``reduction`` at each call (NeMo's RNNTLoss sets it to None around its call) and
    ``blank`` too (NeMo's sampled-softmax path sets it to 0)."""
    module, args, topo, blank, sigma = _variant(name, 0.25, reduction="mean")
    want = (1.25 * _oracle(args, topo, blank, sigma, 0.25)[0])
    tol = dict(rtol=1e-6, atol=1e-6)
    mean = module(*args)
    assert mean.shape == (1,)
    torch.testing.assert_close(mean.double(), want.sum().reshape(1) / 3, **tol)
    for reduction in (None, "none"):
        module.reduction = reduction
        torch.testing.assert_close(module(*args).double(), want, **tol)
    module.reduction = "sum"
    total = module(acts=args[0], labels=args[1], act_lens=args[2], label_lens=args[3])
    assert total.shape == (1,)
    torch.testing.assert_close(total.double(), want.sum().reshape(1), **tol)
    module.reduction = "mean_batch"               # NeMo would silently return (B,)
    with pytest.raises(ValueError, match="reduction"):
        module(*args)
    if name == "rnnt":
        module.reduction, module.blank = None, 5
        acts, labels = args[0], args[1].masked_fill(args[1] == 5, 1)
        other = _oracle((acts, labels, *args[2:]), topo, 5, 0.0, 0.25)[0]
        torch.testing.assert_close(module(acts, labels, *args[2:]).double(), 1.25 * other, **tol)


def test_mean_gradient_and_constructor_checks():
    """'mean' scales the gradient by 1/B; a bad reduction fails at construction too."""
    module, args, topo, blank, sigma = _variant("rnnt", reduction="mean")
    acts = args[0].clone().requires_grad_()
    module(acts, *args[1:]).backward()
    want = _oracle(args, topo, blank, sigma)[1].sum(0) / 3
    torch.testing.assert_close(torch.nan_to_num(acts.grad).sum(0), want, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="reduction"):
        nemo.RNNTLossNumba(reduction="mean_volume")


@pytest.mark.parametrize("name", ["rnnt", "tdt", "multiblank"])
def test_clamp_clips_each_sequence_before_the_upstream_gradient(name):
    """``clamp > 0`` clips every sequence's logits gradient (TDT: the token part) before the
    upstream gradient; the modules turn ``clamp <= 0`` into 0.0 (off)."""
    module, args, topo, blank, sigma = _variant(name, 0.5, clamp=0.05, reduction=None)
    assert module.clamp == 0.05 and _variant(name, clamp=-1)[0].clamp == 0.0
    acts = args[0].clone().requires_grad_()
    w = upstream_weights(3)
    (module(acts, *args[1:]) * w.to(acts.dtype if name != "rnnt" else torch.float32)).sum().backward()
    _, want = _oracle(args, topo, blank, sigma, 0.5, clamp=0.05)
    torch.testing.assert_close(torch.nan_to_num(acts.grad), w[:, None, None, None] * want,
                               rtol=0, atol=1e-7)
    unclamped = _oracle(args, topo, blank, sigma, 0.5)[1]
    assert unclamped.abs().max() > 0.05 >= want[..., :4].abs().max()    # clamp did act


def test_functions_match_the_modules_and_reject_a_negative_clamp():
    """NeMo's positional signatures; its tdt_loss / multiblank_rnnt_loss work here, with
    sigma (and omega) as trailing arguments."""
    for name, fn, extra in (("rnnt", nemo.rnnt_loss, ()),
                            ("tdt", nemo.tdt_loss, ([0, 1, 2],)),
                            ("multiblank", nemo.multiblank_rnnt_loss, ([4, 2],))):
        module, args, *_ = _variant(name, 0.1, clamp=0.2, reduction="mean")
        sigma = () if name == "rnnt" else (module.sigma,)
        got = fn(*args, module.blank, *extra, "mean", 0.1, 0.2, *sigma)
        torch.testing.assert_close(got, module(*args), rtol=0, atol=0)
        with pytest.raises(ValueError, match="clamp"):
            fn(*args, module.blank, *extra, "mean", 0.1, -1.0)


def _tdt_call(**kw):
    """NeMo's functional TDT loss on the tdt variant's inputs (4 tokens, blank 3, durations
    [0, 1, 2]), edited by ``kw``."""
    args = _variant("tdt")[1]
    kw = {"blank": 3, "durations": [0, 1, 2], **kw}
    return lambda: nemo.tdt_loss(*args, reduction="none", **kw)


# case -> (call, the words of its ValueError)
OPTION_ERRORS = {
    # blank=-1 is always "the last token": with a durations list one too short, the first
    # duration column was read as the blank token, a finite, wrong loss
    "tdt_negative_blank": (_tdt_call(blank=-1, durations=[0, 1]),
                           "blank must be the last token's id, num_classes >= 0"),
    "tdt_negative_blank_module": (lambda: nemo.TDTLossNumba(blank=-1, durations=[0, 1]),
                                  "blank must be the last token's id, num_classes >= 0"),
    "tdt_durations_short": (_tdt_call(durations=[0, 1]),
                            "the blank must be the last token (4), got 3: the logits' last axis "
                            "holds V_tok = 5 tokens, then 2 durations (7 in all); check the "
                            "blank and the durations"),
    "tdt_durations_long": (_tdt_call(durations=[0, 1, 2, 3]),
                           "blank=3 is outside [0, V_tok) = [0, 3) for acts (3, 5, 3, 7): its "
                           "last axis holds V_tok = 3 tokens, then 4 durations; check the blank "
                           "and the durations"),
    "tdt_sigma_module": (lambda: nemo.TDTLossNumba(blank=3, durations=[0, 1], sigma="x"),
                         "sigma must be a number, got 'x'"),
    "tdt_omega_module": (lambda: nemo.TDTLossNumba(blank=3, durations=[0, 1], omega=2.0),
                         "omega must be <= 1"),
    "tdt_durations_none": (_tdt_call(durations=None), "durations must be a sequence of ints, got None"),
    "tdt_durations_int": (lambda: nemo.TDTLossNumba(blank=3, durations=3),
                          "durations must be a sequence of ints, got 3"),
    "tdt_durations_default": (_tdt_call(durations=[]), "durations must not be empty"),
    "multiblank_durations_none": (lambda: nemo.multiblank_rnnt_loss(
        *_variant("multiblank")[1], 6, None), "big_blank_durations must be a sequence of ints, got None"),
    "multiblank_durations_module": (lambda: nemo.MultiblankRNNTLossNumba(6, [1]),
                                    "big_blank_durations must all be >= 2, got [1]"),
    "clamp_str": (lambda: nemo.RNNTLossNumba(clamp="x"), "clamp must be a number, got 'x'"),
    "clamp_none": (lambda: nemo.RNNTLossNumba(clamp=None), "clamp must be a number, got None"),
    "clamp_str_function": (lambda: nemo.rnnt_loss(*_variant("rnnt")[1], clamp="x"),
                           "clamp must be a number, got 'x'"),
    "fastemit_none": (lambda: nemo.rnnt_loss(*_variant("rnnt")[1], fastemit_lambda=None),
                      "fastemit_lambda must be a number, got None"),
    "fastemit_tensor": (lambda: nemo.RNNTLossNumba(fastemit_lambda=torch.tensor([1.0, 2.0])),
                        "fastemit_lambda must be a number, got a tensor of shape (2,)"),
    "blank_float": (lambda: nemo.RNNTLossNumba(blank=0.5), "blank must be an int, got 0.5"),
}


@pytest.mark.parametrize("case", sorted(OPTION_ERRORS))
def test_option_errors_name_the_option(case):
    call, words = OPTION_ERRORS[case]
    with pytest.raises(ValueError) as err:
        call()
    assert words in str(err.value), f"{words!r} not in: {err.value}"


@pytest.mark.parametrize("name", ["rnnt", "tdt", "multiblank"])
def test_id_dtypes(name):
    """NeMo's certify_inputs: int64 labels and lengths. The RNN-T and multi-blank losses
    also take int32, as ESPnet's copy of them (``espnet2.asr.transducer.rnnt_multi_blank``)
    does and ESPnet's models pass them (issue 32): the same costs and gradients. Another
    dtype (for TDT int32 too, as in NeMo) is a ValueError naming the argument that is also
    NeMo's TypeError."""
    module, args, *_ = _variant(name, reduction=None)
    refused = [torch.int16, torch.float32] + ([torch.int32] if name == "tdt" else [])
    for i, arg in ((1, "labels"), (2, "act_lens"), (3, "label_lens")):
        for dtype in refused:
            bad = list(args)
            bad[i] = bad[i].to(dtype)
            with pytest.raises(ValueError, match=f"{arg} must be torch.int64") as err:
                module(*bad)
            assert isinstance(err.value, TypeError)
    if name == "tdt":
        return
    results = []
    for ids in (args[1:], [x.int() for x in args[1:]]):
        acts = args[0].clone().requires_grad_()
        costs = module(acts, *ids)
        (grad,) = torch.autograd.grad(costs.sum(), acts)
        results.append((costs, grad))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


def test_espnet_multiblank_call():
    """ESPnet's multi-blank model (``espnet2/asr/espnet_model.py``) builds
    ``MultiblankRNNTLossNumba(blank=..., big_blank_durations=..., sigma=..., reduction="mean",
    fastemit_lambda=...)`` from ``espnet2.asr.transducer.rnnt_multi_blank`` and calls it on
    the joint output with int32 targets and lengths; its token list holds the big blanks
    inserted before the blank (``<blank4>, <blank2>, <blank>``, then the labels). This
    module's class, imported in its place, gives the oracle's costs and gradients there
    (issue 32)."""
    big = [2, 4]
    acts, labels, T_b, U_b = _inputs(7, 4, seed=5)
    labels = labels + 3                                   # labels above the blank, class 2
    module = nemo.MultiblankRNNTLossNumba(blank=2, big_blank_durations=big, sigma=0.05,
                                          reduction="mean", fastemit_lambda=0.0)
    leaf = acts.clone().requires_grad_()
    cost = module(leaf, *(x.int() for x in (labels, T_b, U_b)))
    want_loss, want_grad = _oracle((acts, labels, T_b, U_b), topology.multiblank(2, big), 2, 0.05)
    assert cost.shape == (1,)
    torch.testing.assert_close(cost, want_loss.sum().reshape(1) / 3, rtol=1e-10, atol=1e-10)
    cost.backward()
    torch.testing.assert_close(torch.nan_to_num(leaf.grad), want_grad / 3, rtol=0, atol=1e-10)


def test_big_blank_durations_in_any_order():
    """Listing the big blanks in another order with their classes permuted to match
    (class ``blank - 1 - i`` for ``big_blank_durations[i]``) gives the same costs."""
    acts, labels, T_b, U_b = _inputs(7, 4, seed=3)
    a = nemo.MultiblankRNNTLossNumba(6, [2, 4], reduction=None)(acts, labels, T_b, U_b)
    swapped = acts[..., [0, 1, 2, 3, 5, 4, 6]]
    b = nemo.MultiblankRNNTLossNumba(6, [4, 2], reduction=None)(swapped, labels, T_b, U_b)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
    assert not torch.allclose(a, nemo.MultiblankRNNTLossNumba(6, [4, 2], reduction=None)(
        acts, labels, T_b, U_b))


def test_tdt_omega_samples_the_token_rnnt_loss():
    """omega = 1: the standard RNN-T loss of the token logits (no sigma), zero gradient on
    the durations; 0 < omega < 1: each call is one of the two, both occur."""
    module, args, _, blank, _ = _variant("tdt", reduction=None)
    acts = args[0].clone().requires_grad_()
    module.omega = 1.0
    costs = module(acts, *args[1:])
    tokens = (args[0][..., :4], *args[1:])
    torch.testing.assert_close(costs, _oracle(tokens, topology.regular(), blank, 0.0)[0],
                               rtol=1e-10, atol=0)
    costs.sum().backward()
    assert (acts.grad[..., 4:] == 0).all() and acts.grad[0, :, :, :4].abs().sum() > 0
    tdt = _oracle(args, topology.tdt([0, 1, 2]), blank, 0.05)[0]
    module.omega = 0.5
    torch.manual_seed(0)
    seen = set()
    for _ in range(16):
        c = module(*args)
        seen.add("tdt" if torch.allclose(c, tdt) else "rnnt" if torch.allclose(c, costs) else "?")
    assert seen == {"tdt", "rnnt"}


def test_nemo_tdt_vector_and_infeasible_sequences():
    """NeMo's TDT test case through the class, ``(1 + lambda)``-scaled: ``-log(3w^4 + 6w^3
    + 2w^2)`` with ``w = e^-0.05 / 12``; a sequence without any alignment (no duration 0 and
    T < U + 1) costs +inf with a zero gradient, not NeMo's large finite sentinel value."""
    acts = torch.zeros(1, 3, 2, 7, dtype=torch.float64)
    cost = nemo.TDTLossNumba(3, [0, 1, 2], "sum", fastemit_lambda=0.5, sigma=0.05)(
        acts, torch.tensor([[0]]), torch.tensor([3]), torch.tensor([1]))
    w = math.exp(-0.05) / 12
    assert abs(float(cost) + 1.5 * math.log(3 * w**4 + 6 * w**3 + 2 * w**2)) < 1e-12
    acts = torch.randn(2, 2, 3, 4 + 2, dtype=torch.float64, requires_grad=True)
    costs = nemo.TDTLossNumba(3, [1, 2], None)(acts, torch.tensor([[0, 1], [1, 2]]),
                                               torch.tensor([2, 2]), torch.tensor([2, 1]))
    assert costs[0].item() == math.inf and math.isfinite(costs[1].item())
    costs.sum().backward()
    assert (acts.grad[0] == 0).all() and torch.isfinite(acts.grad).all() and acts.grad[1].abs().sum() > 0


def test_docstring_examples():
    result = doctest.testmod(nemo, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_import_loads_no_nemo():
    code = ("import sys, rnnt_lattice.compat.nemo; "
            "sys.exit(any(m == 'nemo' or m.startswith('nemo.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --------------------------------------------------------------------------- install()

@dataclasses.dataclass
class _Config:                     # the fields of NeMo's RNNTLossConfig that resolution reads
    loss_name: str
    lib_name: str
    is_available: bool = False
    installation_msg: str = ""
    min_version: str | None = None
    force_float32: bool = True


class _NeMoOriginal(torch.nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs


@pytest.fixture
def fake_nemo(monkeypatch):
    """A stand-in for ``nemo.collections.asr.losses.rnnt`` as NeMo documents it: a resolver
    table (``"default"`` shares ``"warprnnt_numba"``'s entry; numba unavailable here), the
    module-level classes ``resolve_rnnt_loss`` instantiates, and ``RNNTLoss``'s call
    convention (reduction None around a keyword call, then its own reduction)."""
    rnnt = types.ModuleType("nemo.collections.asr.losses.rnnt")
    numba_cfg = _Config("warprnnt_numba", "numba", min_version="0.53.0")
    rnnt.RNNT_LOSS_RESOLVER = {
        "warprnnt_numba": numba_cfg, "default": numba_cfg,
        "tdt": _Config("tdt", "numba", min_version="0.53.0"),
        "multiblank_rnnt": _Config("multiblank_rnnt", "numba", min_version="0.53.0"),
        "pytorch": _Config("pytorch", "torch", is_available=True)}
    for cls in ("RNNTLossNumba", "TDTLossNumba", "MultiblankRNNTLossNumba"):
        setattr(rnnt, cls, type(cls, (_NeMoOriginal,), {}))
    classes = {"warprnnt_numba": "RNNTLossNumba", "tdt": "TDTLossNumba",
               "multiblank_rnnt": "MultiblankRNNTLossNumba"}

    def resolve_rnnt_loss(loss_name, blank_idx, loss_kwargs=None):
        config = rnnt.RNNT_LOSS_RESOLVER[loss_name]
        if not config.is_available:
            raise ImportError(config.installation_msg)
        if config.min_version is not None:
            raise RuntimeError("numba version check: numba is not installed")
        cls = getattr(rnnt, classes[config.loss_name])
        return cls(blank=blank_idx, reduction="none", **dict(loss_kwargs or {}))

    class RNNTLoss(torch.nn.Module):
        def __init__(self, num_classes, reduction="mean_batch", loss_name="default", loss_kwargs=None):
            super().__init__()
            self._loss = resolve_rnnt_loss(loss_name, num_classes, loss_kwargs)

        def forward(self, log_probs, targets, input_lengths, target_lengths):
            saved, self._loss.reduction = self._loss.reduction, None
            loss = self._loss(acts=log_probs, labels=targets, act_lens=input_lengths,
                              label_lens=target_lengths)
            self._loss.reduction = saved
            return loss.mean()

    rnnt.resolve_rnnt_loss, rnnt.RNNTLoss = resolve_rnnt_loss, RNNTLoss
    parts = ["nemo", "nemo.collections", "nemo.collections.asr", "nemo.collections.asr.losses"]
    for name in parts:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, rnnt.__name__, rnnt)
    yield rnnt
    nemo.uninstall()


def test_install_routes_nemo_losses_to_ours_and_uninstall_restores(fake_nemo):
    originals = dict(fake_nemo.RNNT_LOSS_RESOLVER), fake_nemo.TDTLossNumba
    with pytest.raises(ImportError):
        fake_nemo.RNNTLoss(3, loss_name="tdt", loss_kwargs={"durations": [0, 1, 2]})
    nemo.install()
    nemo.install()                                                      # idempotent
    resolver = fake_nemo.RNNT_LOSS_RESOLVER
    assert resolver["default"] is resolver["warprnnt_numba"] and resolver["tdt"].is_available
    assert resolver["pytorch"] is originals[0]["pytorch"]              # others untouched
    for name, kwargs, variant in (
            ("tdt", dict(durations=[0, 1, 2], sigma=0.05, fastemit_lambda=0.5), "tdt"),
            ("multiblank_rnnt", dict(big_blank_durations=[4, 2], sigma=0.1, fastemit_lambda=0.5),
             "multiblank"),
            ("default", dict(fastemit_lambda=0.5), "rnnt")):
        ours, args, topo, blank, sigma = _variant(variant, 0.5)
        loss = fake_nemo.RNNTLoss(ours.blank, loss_name=name, loss_kwargs=kwargs)
        assert type(loss._loss) is type(ours) and loss._loss.reduction == "none"
        want = 1.5 * _oracle(args, topo, blank, sigma, 0.5)[0]
        torch.testing.assert_close(loss(log_probs=args[0], targets=args[1], input_lengths=args[2],
                                        target_lengths=args[3]).double(), want.mean(),
                                   rtol=1e-6, atol=1e-6)
    nemo.uninstall()
    assert fake_nemo.RNNT_LOSS_RESOLVER == originals[0] and fake_nemo.TDTLossNumba is originals[1]
    assert all(fake_nemo.RNNT_LOSS_RESOLVER[n] is c for n, c in originals[0].items())
    with nemo.installed():
        assert fake_nemo.TDTLossNumba is nemo.TDTLossNumba
    assert fake_nemo.TDTLossNumba is originals[1]


def test_install_again_after_nemo_reloads_its_module(fake_nemo):
    """``importlib.reload`` of NeMo's module writes NeMo's classes and resolver back into
    the same module object: a second ``install()`` installs again (it returned early, and
    NeMo's numba losses were built), and ``uninstall()`` restores what the reload wrote."""
    original_tdt, original_tdt_config = fake_nemo.TDTLossNumba, fake_nemo.RNNT_LOSS_RESOLVER["tdt"]
    nemo.install()
    reloaded_tdt = type("TDTLossNumba", (original_tdt,), {})                   # the reload's
    fake_nemo.TDTLossNumba = reloaded_tdt
    fake_nemo.RNNT_LOSS_RESOLVER["tdt"] = original_tdt_config
    nemo.install()
    assert fake_nemo.TDTLossNumba is nemo.TDTLossNumba
    loss = fake_nemo.RNNTLoss(3, loss_name="tdt", loss_kwargs={"durations": [0, 1, 2]})
    assert type(loss._loss) is nemo.TDTLossNumba
    nemo.uninstall()
    assert fake_nemo.TDTLossNumba is reloaded_tdt
    assert fake_nemo.RNNT_LOSS_RESOLVER["tdt"] is original_tdt_config


class _NemoFailingWith(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A stand-in NeMo whose import raises ``error`` (a version mismatch typically raises
    AttributeError from inside NeMo's own imports)."""

    def __init__(self, error):
        self.error = error

    def find_spec(self, name, path=None, target=None):
        if name == "nemo" or name.startswith("nemo."):
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise self.error


@pytest.mark.parametrize("error", [AttributeError("module 'numpy' has no attribute 'bool8'"),
                                   TypeError("unsupported operand"), RuntimeError("CUDA init")])
def test_install_turns_any_failure_of_importing_nemo_into_an_import_error(monkeypatch, error):
    for name in [m for m in sys.modules if m == "nemo" or m.startswith("nemo.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NemoFailingWith(error)] + sys.meta_path)
    with pytest.raises(ImportError, match="NeMo's ASR collection") as info:
        nemo.install()
    assert info.value.__cause__ is error


def test_install_without_nemo_raises_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "nemo", None)          # import nemo -> ImportError
    with pytest.raises(ImportError, match="NeMo's ASR collection"):
        nemo.install()
    nemo.RNNTLossNumba()                                    # the classes need no NeMo
