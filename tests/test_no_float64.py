"""A device without float64 (Apple's MPS), simulated on the CPU: every public function on the
pure-PyTorch backend runs with its lattice in float32 and makes no float64 tensor, and gives
the float64 lattice's values to float32 rounding.

MPS refuses float64 tensors ("Cannot convert a MPS Tensor to float64 dtype"), so there the
lattice runs in float32 (``reference.lattice_dtype``) and ``backend="auto"`` is the
pure-PyTorch backend (``_backends.AUTO``). No Mac runs CI: here the CPU is made that device
(``"cpu"`` added to ``reference.DEVICES_WITHOUT_FLOAT64``, ``AUTO`` emptied, the Numba and
Triton backends unloadable) and a dispatch mode refuses every op that would make a float64
tensor, as MPS does. The oracle is the same call on the CPU as it is (the default backend,
a float64 lattice). What else MPS lacks (an op without an MPS kernel) is not simulated."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import rnnt_lattice
from rnnt_lattice import _backends, reference
from rnnt_lattice.compat import k2
from support import cases
from support.cases import rel_err, upstream_weights

# float32 lattices against float64 ones, relative to max(1, the largest value): the sums of
# a few dozen float32 roundings at these sizes, times the logits' magnitude where a case's
# logits are far from 1 (a float32 log-weight of 500 is rounded by 3e-5: ``MAGNITUDE``)
TOL = 2.0 ** -23 * 64


class RefuseFloat64(TorchDispatchMode):
    """Raises TypeError for any op that asks for a float64 tensor or returns one (MPS's
    rule), naming the op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("dtype") == torch.float64:
            raise TypeError(f"{func} asked for float64")
        out = func(*args, **kwargs)
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.dtype == torch.float64:
                raise TypeError(f"{func} made a float64 tensor")
        return out


def _without_float64(monkeypatch):
    """The CPU as a device without float64, from now to the end of the test."""
    monkeypatch.setattr(reference, "DEVICES_WITHOUT_FLOAT64", frozenset({"mps", "cpu"}))
    monkeypatch.setattr(_backends, "AUTO", {})
    load = _backends.load

    def torch_only(name):
        if name != "torch":
            raise ImportError(f"the {name!r} backend does not run on this device")
        return load(name)
    monkeypatch.setattr(_backends, "load", torch_only)


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


# Each case makes its inputs, then runs under ``on()`` (nothing for the oracle, the
# float64-less device for the test) and returns the tensors to compare.
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


MAGNITUDE = {"rnnt_loss_simple, rows 500x apart (rescue)": 500.0}


@pytest.mark.parametrize("name", list(CASES))
def test_runs_without_float64_and_agrees(name, monkeypatch):
    """The call on a device without float64 (simulated) makes no float64 tensor, returns
    float32 where the CPU returns float64 (the lattice's outputs), and agrees with the CPU's
    float64 lattice to float32 rounding: values and gradients, ragged lengths, NaN padding,
    signed per-sequence upstream gradients; integer outputs (alignments, windows) equal."""
    want = CASES[name](contextlib.nullcontext)
    _without_float64(monkeypatch)
    got = CASES[name](RefuseFloat64)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, (i, g.shape, w.shape)
        if not w.is_floating_point():
            assert torch.equal(g, w), (i, g, w)
            continue
        assert g.dtype == (torch.float32 if w.dtype == torch.float64 else w.dtype), (i, g.dtype)
        assert rel_err(g, w) <= TOL * MAGNITUDE.get(name, 1.0), (i, rel_err(g, w))


def test_the_simulated_device_refuses_float64(monkeypatch):
    """The simulation can fail: a float64 tensor made under it raises, the Numba backend is
    not loaded, and the lattice dtype is float32 (else the tests above would prove nothing)."""
    _without_float64(monkeypatch)
    assert reference.lattice_dtype(torch.device("cpu")) == torch.float32
    assert _backends.resolve("auto", torch.device("cpu")) is _backends.load("torch")
    with pytest.raises(ImportError):
        _backends.load("numba")
    with RefuseFloat64():
        with pytest.raises(TypeError, match="float64"):
            torch.zeros(2).double()
        with pytest.raises(TypeError, match="float64"):
            torch.zeros(2, dtype=torch.float64)


@pytest.mark.parametrize("has_fp64", [True, False])
def test_an_intel_gpu_is_asked_whether_it_has_float64(has_fp64, monkeypatch):
    """XPUs differ (the Arc A-series has no float64, newer ones have): the lattice dtype
    follows the device's ``has_fp64`` (``torch.xpu.get_device_properties``, stubbed here:
    no XPU runs CI), asked once per device; MPS never has float64, CPU and CUDA always."""
    asked = []

    class Props:
        pass

    def properties(index=None):
        asked.append(index)
        props = Props()
        props.has_fp64 = has_fp64
        return props
    monkeypatch.setattr(torch.xpu, "get_device_properties", properties)
    monkeypatch.setattr(torch.xpu, "current_device", lambda: 1)
    reference._xpu_has_float64.cache_clear()
    want = torch.float64 if has_fp64 else torch.float32
    try:
        assert reference.lattice_dtype(torch.device("xpu", 1)) == want
        assert reference.lattice_dtype(torch.device("xpu")) == want     # the current one
        assert asked == [1]
    finally:
        reference._xpu_has_float64.cache_clear()
    assert reference.lattice_dtype(torch.device("mps")) == torch.float32
    assert reference.lattice_dtype(torch.device("cpu")) == torch.float64
    assert reference.lattice_dtype(torch.device("cuda", 0)) == torch.float64
