"""What only a GPU showed once, checked on the CPU (issue: the GPU path on a real GPU).

- Triton's launch-time rule on globals: at every launch, each module global a kernel used
  is compared with its value now (``!=``); a global that is not equal to itself (a NaN
  constexpr) failed every kernel's second launch on the GPU, while the interpreter and the
  sm_90 compiles passed.
- CUDA's limit on a device-side assert's message (under 255 characters; the CPU takes any).
- PyTorch's AMP recipe (forward under autocast, ``backward()`` outside): CUDA's autocast
  runs ``sum`` in float32 where the CPU's does not, so the recipe broke on CUDA alone. Its
  CUDA policy is emulated here for the ops that differ.
- Bad labels and lengths on the device path (the CUDA default, no host synchronisation):
  the sequence's loss is NaN and a device-side assert names the argument and the rule;
  ``set_input_checks("host")`` gives the CPU's ValueError. The device path runs here on
  CPU tensors, its kernel under the Triton interpreter (conftest sets it).
"""
from __future__ import annotations

import ast
import contextlib
import functools
import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

import rnnt_lattice
from rnnt_lattice import _rules, _validate
from rnnt_lattice.compat import k2 as fast_rnnt
from rnnt_lattice.compat import nemo, speechbrain, transformers, warp_transducer
from rnnt_lattice.compat import torchaudio as ta
import rnnt_lattice.compat.warp_rnnt as warp_rnnt
import rnnt_lattice.compat.warp_rnnt._C as warp_rnnt_C

from support.backends import NO_TRITON, need_triton

TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])

SRC = pathlib.Path(rnnt_lattice.__file__).resolve().parent

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# --------------------------------------------------------------------------- Triton globals
GLOBALS_SCRIPT = r"""
import importlib, pathlib, sys
import triton
import rnnt_lattice
src = pathlib.Path(rnnt_lattice.__file__).resolve().parent
n, bad = 0, []
for path in sorted(src.rglob("*.py")):
    if "triton.jit" not in path.read_text():
        continue
    name = ".".join(("rnnt_lattice",) + path.relative_to(src).with_suffix("").parts)
    module = importlib.import_module(name.removesuffix(".__init__"))
    for attr, fn in vars(module).items():
        if not isinstance(fn, triton.runtime.JITFunction):
            continue
        n += 1
        fn.cache_key                    # Triton's DependenciesFinder: fills used_global_vals
        absent = object()
        for (var, _), (val, scope) in fn.used_global_vals.items():
            # JITFunction.run's check at every launch, word for word
            if scope.get(var, absent) != val:
                bad.append(f"{name}.{attr} uses global {var} = {val!r}")
print("checked", n)
print("\n".join(bad))
sys.exit(1 if bad else 0)
"""


def test_triton_globals_equal_themselves():
    """Every ``@triton.jit`` function of the package passes Triton's launch-time check of
    the module globals it uses (transitively, through the functions it calls): each must
    compare equal to its own value. The compiled kernels are needed (the interpreter has no
    such check), so this runs in a subprocess without ``TRITON_INTERPRET``."""
    need_triton()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", GLOBALS_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert int(out.stdout.split()[1]) >= 5, out.stdout          # the kernels were found


# --------------------------------------------------------------------------- device asserts
# How each compat module names the targets and lengths (its peer's argument names): the
# device-side messages name them so too.
COMPAT_NAMES = {"compat.nemo": nemo.NAMES, "compat.warp_transducer": warp_transducer.NAMES,
                "compat.warp_rnnt": warp_rnnt.NAMES,
                "compat.warp_rnnt compact": warp_rnnt.COMPACT_NAMES,
                "compat.warp_rnnt._C": warp_rnnt_C.NAMES,
                "compat.warp_rnnt._C compact": warp_rnnt_C.COMPACT_NAMES,
                "compat.speechbrain": speechbrain.FUNCTION_NAMES,
                "compat.speechbrain module": speechbrain.MODULE_NAMES,
                "compat.transformers tdt": transformers.TDT_NAMES}


@pytest.mark.parametrize("names", ["ours"] + list(COMPAT_NAMES))
def test_device_messages_fit_cuda(names):
    """Each device-side message is under CUDA's 255 characters and names its argument, as
    the library names it and as each compat module does (its peer's names)."""
    words = () if names == "ours" else COMPAT_NAMES[names].words()
    for rule in _rules.DEVICE_MESSAGES:
        msg = _rules.device_message(rule, *words)
        assert len(msg.encode()) < 255, (rule, len(msg))
        assert msg.startswith("rnnt_lattice: ") and "{" not in msg, msg
    for rule in _validate.DEVICE_RULES:
        named = {"lengths": words[1:] or ("logit_lengths", "target_lengths"),
                 "targets": words[:1] or ("targets",), "boundary": ("boundary",)}[rule]
        for name in named:
            assert f"{name}[b" in _rules.device_message(rule, *words), (rule, name)


def test_device_asserts_go_through_one_helper():
    """No call of ``torch._assert_async`` in the package but the one in
    ``_rules.device_assert`` (whose messages the test above measures), and every
    ``device_assert`` call names a rule of ``DEVICE_MESSAGES``."""
    calls, rules = [], []
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "_assert_async":
                calls.append(str(path.relative_to(SRC)))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "device_assert" and len(node.args) == 2
                    and isinstance(node.args[1], ast.Constant)):
                rules.append(node.args[1].value)
    assert calls == ["_rules.py"], calls
    assert rules and set(rules) <= set(_rules.DEVICE_MESSAGES), rules


def test_device_assert_raises_its_message_on_cpu():
    _rules.device_assert(torch.tensor(1.0), "targets")
    with pytest.raises(RuntimeError, match=r"targets\[b, u\]"):
        _rules.device_assert(torch.tensor(0.0), "targets")


# --------------------------------------------------------------------------- AMP recipe
class CudaAutocastPolicy(TorchFunctionMode):
    """CUDA autocast's float32 rule for the reductions it lists and the CPU's does not
    (``sum``, ``prod``, ``cumsum``: run in float32 from half inputs), applied while CPU
    autocast is on, so that the CPU sees what CUDA runs."""

    FP32 = {torch.sum, torch.Tensor.sum, torch.prod, torch.Tensor.prod, torch.cumsum,
            torch.Tensor.cumsum}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in self.FP32 and torch.is_autocast_enabled("cpu") and args
                and isinstance(args[0], torch.Tensor)
                and args[0].dtype in (torch.float16, torch.bfloat16)):
            args = (args[0].float(),) + tuple(args[1:])
        return func(*args, **kwargs)


class Joiner(torch.nn.Module):
    def __init__(self, H, V):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.a = torch.nn.Linear(H, H)
        self.o = torch.nn.Linear(H, V)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / H ** 0.5)

    def forward(self, e, p):
        return self.o(torch.tanh(self.a(e) + p)) * 2.0


FUSED = {
    "rnnt": ("fused_rnnt_loss", 0, 0, {}),
    "tdt": ("fused_tdt_loss", 3, 0, dict(durations=[0, 1, 2], sigma=0.05)),
    "multiblank": ("fused_multiblank_rnnt_loss", 0, 2, dict(big_blank_durations=[2, 3])),
}


def kernel_joiner(H, V):
    """``rnnt_lattice.Joiner`` with :class:`Joiner`'s weights (``out(tanh(a(e) + p))``):
    the fused losses' kernel path on the Triton backend."""
    theirs = Joiner(H, V)
    ours = rnnt_lattice.Joiner(H, None, H, V)
    with torch.no_grad():
        for dst, src in zip(ours.parameters(), theirs.parameters()):
            dst.copy_(src)
    return ours


@pytest.mark.parametrize("backend, joiner", [
    ("auto", "module"), pytest.param("triton", "module", marks=NO_TRITON),
    pytest.param("triton", "kernel", marks=NO_TRITON)])
@pytest.mark.parametrize("kind", list(FUSED))
def test_fused_amp_recipe(kind, backend, joiner):
    """Forward under ``torch.autocast`` (bfloat16), ``backward()`` outside the block, with
    CUDA's float32 policy for reductions (:class:`CudaAutocastPolicy`): the gradients
    equal those of ``backward()`` inside the block. The Triton backend reads the bfloat16
    logits natively, as on CUDA (the default CPU backend promotes them to float32); with
    ``rnnt_lattice.Joiner`` it takes the kernel path, whose operands keep the forward's
    autocast dtype in the backward."""
    name, n_dur, n_big, kw = FUSED[kind]
    B, T, U, H, V = 2, 6, 3, 8, 9
    joiner = (Joiner if joiner == "module" else kernel_joiner)(H, V + n_dur)
    g = torch.Generator().manual_seed(1)
    enc = torch.randn(B, T, H, generator=g)
    pred = torch.randn(B, U + 1, H, generator=g)
    blank = 0 if kind == "rnnt" else V - 1
    y = torch.randint(1, V - 1 - n_big, (B, U), generator=g)
    tl, ul = torch.tensor([6, 4]), torch.tensor([3, 2])

    def grads(inside):
        joiner.zero_grad()
        e, p = enc.clone().requires_grad_(), pred.clone().requires_grad_()
        with CudaAutocastPolicy():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                costs = getattr(rnnt_lattice, name)(joiner, e, p, y, tl, ul, blank=blank,
                                                    tile=5, reduction="none", backend=backend,
                                                    **kw)
                loss = (costs * torch.tensor([1.0, -0.5])).sum()
                if inside:
                    loss.backward()
            if not inside:
                loss.backward()
        return [costs.detach(), e.grad, p.grad] + [q.grad.clone() for q in joiner.parameters()]

    for got, want in zip(grads(False), grads(True)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# --------------------------------------------------------------------------- bad inputs
B, T, U, V = 3, 6, 3, 7


def _batch():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, T, U + 1, V, generator=g)
    y = torch.randint(1, V - 2, (B, U), generator=g, dtype=torch.int32)
    return x, y, torch.tensor([6, 5, 4], dtype=torch.int32), torch.tensor([3, 2, 3], dtype=torch.int32)


# The bad inputs, each on sequence 1, with the rule whose message names it.
BAD = {
    "label >= V": ("targets", lambda y, tl, ul: y[1, 0].fill_(V)),
    "label < 0": ("targets", lambda y, tl, ul: y[1, 1].fill_(-1)),
    "label = blank": ("targets", lambda y, tl, ul: y[1, 0].fill_(0)),
    "logit_lengths > T": ("lengths", lambda y, tl, ul: tl[1].fill_(T + 1)),
    "logit_lengths < 0": ("lengths", lambda y, tl, ul: tl[1].fill_(-1)),
    "target_lengths > U": ("lengths", lambda y, tl, ul: ul[1].fill_(U + 1)),
    "target_lengths < 0": ("lengths", lambda y, tl, ul: ul[1].fill_(-2)),
}


def _bad(what):
    x, y, tl, ul = _batch()
    rule, edit = BAD[what]
    edit(y, tl, ul)
    return x, y, tl, ul, rule


class _Asserts:
    """``torch._assert_async`` recorded instead of raised: the rules that failed, so that
    the NaN the device check writes can be seen (on CUDA the assert ends the process's
    CUDA context at the next synchronisation)."""

    def __init__(self, monkeypatch):
        self.failed = []
        monkeypatch.setattr(torch, "_assert_async", self)

    def __call__(self, ok, msg=""):
        if not bool(ok):
            self.failed.append(msg)


def _losses(x, y, tl, ul):
    """Every loss on logits with these labels and lengths, (B,) each, on the CUDA default
    backend (Triton, here under the interpreter)."""
    kw = dict(reduction="none", backend="triton")
    n_dur = 2
    xt = torch.cat([x, x[..., :n_dur]], -1)
    ranges = torch.arange(U + 1).expand(B, T, U + 1).contiguous()
    return {
        "rnnt_loss": rnnt_lattice.rnnt_loss(x, y, tl, ul, blank=0, **kw),
        "modified": rnnt_lattice.rnnt_loss(x, y, tl, ul, blank=0, rnnt_type="modified", **kw),
        "tdt_loss": rnnt_lattice.tdt_loss(xt, y, tl, ul, blank=V - 1, durations=[0, 1], **kw),
        "multiblank": rnnt_lattice.multiblank_rnnt_loss(x, y, tl, ul, blank=V - 1,
                                                        big_blank_durations=[2], **kw),
        "rnnt_loss_pruned": rnnt_lattice.rnnt_loss_pruned(x, y, ranges, tl, ul, blank=0, **kw),
        "occupancy": -rnnt_lattice.occupancy(x, y, tl, ul, blank=0,
                                             backend="triton").log_likelihood,
    }


@functools.cache
def _good_losses():
    """``_losses`` of the good batch on the device path, once for the parametrised test
    below (each call is some 1.5 s of interpreted kernels)."""
    before = _validate.set_input_checks("device")
    try:
        return _losses(*_batch())
    finally:
        _validate.set_input_checks(before)


@pytest.mark.parametrize("what", list(BAD))
@NO_TRITON
def test_bad_input_is_nan_on_its_sequence(device_checks, monkeypatch, what):
    """On the device path, a bad label or length makes that sequence's loss NaN (never a
    finite, plausible value) and leaves the others' as they were, for every loss; each
    call fails the rule that names the argument (the asserts recorded, not raised)."""
    good = _good_losses()
    x, y, tl, ul, rule = _bad(what)
    asserts = _Asserts(monkeypatch)
    bad = _losses(x, y, tl, ul)
    for name, costs in bad.items():
        if name in ("tdt_loss", "multiblank") and what == "label = blank":
            continue              # label 0 is no blank there (their blank is V - 1)
        nan = torch.isnan(costs)
        assert nan.tolist() == [False, True, False], (name, costs)
        torch.testing.assert_close(costs[~nan], good[name][~nan].to(costs.dtype))
    message = _rules.device_message(rule)
    assert message in asserts.failed and len(asserts.failed) >= len(bad) - 2, asserts.failed


@pytest.mark.parametrize("backend", ["numba", "torch", pytest.param("triton", marks=NO_TRITON)])
def test_every_backend_adds_the_nan_rows(device_checks, monkeypatch, backend):
    """The device check's NaN rows reach the costs through every backend's ``loss_forward``
    (the Triton lattice pass adds them as it writes the costs, the others after): the bad
    sequence's loss is NaN and the others' are as without the check; the gradient of the
    good sequences is unchanged."""
    x, y, tl, ul = _batch()
    good = rnnt_lattice.rnnt_loss(x, y, tl, ul, blank=0, reduction="none", backend=backend)
    x, y, tl, ul, _ = _bad("label >= V")
    _Asserts(monkeypatch)
    leaf = x.clone().requires_grad_()
    costs = rnnt_lattice.rnnt_loss(leaf, y, tl, ul, blank=0, reduction="none", backend=backend)
    assert torch.isnan(costs).tolist() == [False, True, False], costs
    torch.testing.assert_close(costs[[0, 2]], good[[0, 2]])
    (costs[[0, 2]] * torch.tensor([1.0, -0.5])).sum().backward()
    assert torch.isfinite(leaf.grad[[0, 2]]).all() and not leaf.grad[1].any()


def _entry_points(x, y, tl, ul):
    """Every public entry point that takes labels or lengths, on the default backend, and
    the compat modules, each a thunk."""
    H = 4
    joiner = Joiner(H, V)
    g = torch.Generator().manual_seed(3)
    enc, pred = torch.randn(B, T, H, generator=g), torch.randn(B, U + 1, H, generator=g)
    am, lm = torch.randn(B, T, V, generator=g), torch.randn(B, U + 1, V, generator=g)
    ranges = torch.arange(U + 1).expand(B, T, U + 1).contiguous()
    occ = (torch.rand(B, T, U + 1, generator=g), torch.rand(B, T, U + 1, generator=g))
    return {
        "rnnt_loss": lambda: rnnt_lattice.rnnt_loss(x, y, tl, ul, blank=0),
        "RNNTLoss": lambda: rnnt_lattice.RNNTLoss(blank=0)(x, y, tl, ul),
        "tdt_loss": lambda: rnnt_lattice.tdt_loss(torch.cat([x, x[..., :2]], -1), y, tl, ul,
                                                  blank=V - 1, durations=[0, 1]),
        "rnnt_loss_pruned": lambda: rnnt_lattice.rnnt_loss_pruned(x, y, ranges, tl, ul, blank=0),
        "fused_rnnt_loss": lambda: rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, y, tl, ul,
                                                                blank=0),
        "rnnt_loss_simple": lambda: rnnt_lattice.rnnt_loss_simple(lm, am, y, tl, ul, blank=0),
        "rnnt_loss_smoothed": lambda: rnnt_lattice.rnnt_loss_smoothed(lm, am, y, tl, ul, blank=0),
        "lattice_loss": lambda: rnnt_lattice.lattice_loss(occ[0], occ[1], tl, ul),
        "prune_ranges": lambda: rnnt_lattice.prune_ranges(occ, 2, logit_lengths=tl,
                                                          target_lengths=ul),
        "occupancy": lambda: rnnt_lattice.occupancy(x, y, tl, ul, blank=0),
        "best_alignment": lambda: rnnt_lattice.best_alignment(x, y, tl, ul, blank=0),
        "compat.torchaudio": lambda: ta.rnnt_loss(x, y, tl, ul, blank=0),
        "compat.k2": lambda: fast_rnnt.rnnt_loss_simple(
            lm, am, y.long(), 0, boundary=torch.stack([torch.zeros_like(ul), torch.zeros_like(tl),
                                                       ul, tl], 1).long()),
        "compat.nemo": lambda: nemo.RNNTLossNumba(blank=0)(x, y.long(), tl.long(), ul.long()),
        "compat.warp_transducer": lambda: warp_transducer.rnnt_loss(x, y, tl, ul, blank=0),
        "compat.warp_rnnt": lambda: warp_rnnt.rnnt_loss(x.log_softmax(-1), y, tl, ul, blank=0),
    }


# Which rules each entry point checks: all of them take lengths; these take no labels.
LENGTHS_ONLY = {"lattice_loss", "prune_ranges"}
BLANK_ALLOWED = {"tdt_loss", "compat.k2"}   # label 0 is no blank there


@pytest.mark.parametrize("what", ["label >= V", "logit_lengths > T", "target_lengths < 0",
                                  "label = blank"])
@NO_TRITON
def test_every_entry_point_asserts_on_the_device(device_checks, what):
    """Every public entry point that takes labels or lengths (losses, pruned, fused,
    lattice tools, compat), on the default backend: on the device path the bad input
    raises the device-side assert that names the argument and the rule (on the CPU the
    assert raises at once)."""
    x, y, tl, ul, rule = _bad(what)
    checked = 0
    for name, call in _entry_points(x, y, tl, ul).items():
        if rule == "targets" and name in LENGTHS_ONLY:
            continue
        if what == "label = blank" and name in BLANK_ALLOWED:
            continue
        if name == "compat.k2" and rule != "targets":
            continue              # k2 takes a boundary, not lengths
        with pytest.raises(RuntimeError) as err:
            call()
        words = COMPAT_NAMES[name].words() if name in COMPAT_NAMES else ()
        assert str(err.value) == _rules.device_message(rule, *words), (name, str(err.value))
        checked += 1
    assert checked >= 12


@NO_TRITON
def test_host_rules_raise_before_the_device_check(device_checks, monkeypatch):
    """A call that a host rule refuses queues no device check: the device's value rules
    come last in ``check_call``, so a bad label beside a refused ``inplace_grad`` (logits
    that would be copied) gives the ValueError alone. Queued first, the label's assert
    would fire all the same, on CUDA at the next synchronisation, for good."""
    x, y, tl, ul, _ = _bad("label >= V")
    launched = []
    check = _validate._input_check()
    monkeypatch.setattr(_validate, "_input_check",
                        lambda: lambda *a, **k: launched.append(1) or check(*a, **k))
    asserts = _Asserts(monkeypatch)
    strided = x.transpose(1, 2).contiguous().transpose(1, 2)        # (B, T, U+1, V), strided
    with pytest.raises(ValueError, match="inplace_grad=True needs contiguous logits"):
        rnnt_lattice.rnnt_loss(strided.requires_grad_(), y, tl, ul, blank=0, inplace_grad=True)
    assert launched == [] and asserts.failed == []
    # The same call without the host's refusal: the check runs, its rule fails (recorded).
    rnnt_lattice.rnnt_loss(x.clone().requires_grad_(), y, tl, ul, blank=0, inplace_grad=True)
    assert launched == [1] and asserts.failed == [_rules.device_message("targets")]


def _refused_calls(monkeypatch):
    """Calls that break a rule checked on the device (a label, a length, a window, a k2
    symbol) and a rule of the host that an entry point checks late (after its own device
    rules were once queued): each must raise the host's ValueError alone."""
    x, y, tl, ul, _ = _bad("logit_lengths > T")
    _, yv, _, _, _ = _bad("label >= V")
    ranges, xw = _windows()
    BAD_WINDOWS["decreasing"](ranges)
    _, yw, tlw, ulw = _batch()
    g = torch.Generator().manual_seed(8)
    lm, am = torch.randn(B, U + 1, V, generator=g), torch.randn(B, T, V, generator=g)
    occ = (torch.rand(B, T, U + 1, generator=g), torch.rand(B, T, U + 1, generator=g))
    symbols = yv.long()                                  # a symbol = C in sequence 1
    good_windows = _windows()[0]
    # A backend that the checks refuse only once the lengths are read (not importable).
    load = rnnt_lattice._backends.load
    monkeypatch.setattr(rnnt_lattice._backends, "load", lambda name: (
        (_ for _ in ()).throw(ImportError("no triton here")) if name == "triton" else load(name)))
    return {
        "rnnt_loss_pruned, blank": lambda: rnnt_lattice.rnnt_loss_pruned(
            xw, yw, ranges, tlw, ulw, blank=V),
        "rnnt_loss_pruned, clamp": lambda: rnnt_lattice.rnnt_loss_pruned(
            xw, yw, ranges, tlw, ulw, blank=0, clamp="x"),
        "rnnt_loss_pruned, inplace_grad": lambda: rnnt_lattice.rnnt_loss_pruned(
            xw.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(), yw, ranges, tlw,
            ulw, blank=0, inplace_grad=True),
        "rnnt_loss_simple, backend": lambda: rnnt_lattice.rnnt_loss_simple(
            lm, am, y, tl, ul, blank=0, backend="triton"),
        "lattice_loss, backend": lambda: rnnt_lattice.lattice_loss(
            occ[0], occ[1], tl, ul, backend="triton"),
        "k2 get_rnnt_logprobs, termination_symbol": lambda: fast_rnnt.get_rnnt_logprobs(
            lm, am, symbols, V),
        "k2 get_rnnt_logprobs_smoothed, lm_only_scale": lambda:
            fast_rnnt.get_rnnt_logprobs_smoothed(lm, am, symbols, 0, lm_only_scale="x"),
        "k2 get_rnnt_logprobs_joint, termination_symbol": lambda:
            fast_rnnt.get_rnnt_logprobs_joint(x, symbols, V),
        "k2 rnnt_loss_pruned, use_hat_loss": lambda: fast_rnnt.rnnt_loss_pruned(
            xw, yw.long(), ranges, 1, use_hat_loss=True),
        "k2 rnnt_loss_pruned symbols, use_hat_loss": lambda: fast_rnnt.rnnt_loss_pruned(
            xw, symbols, good_windows, 1, use_hat_loss=True),
        "k2 rnnt_loss return_grad, delay_penalty": lambda: fast_rnnt.rnnt_loss(
            x, symbols, 0, return_grad=True, delay_penalty=-1.0),
        "k2 rnnt_loss_pruned return_grad, delay_penalty": lambda: fast_rnnt.rnnt_loss_pruned(
            xw, yw.long(), ranges, 0, return_grad=True, delay_penalty="x"),
    }


REFUSED = ("rnnt_loss_pruned, blank", "rnnt_loss_pruned, clamp",
           "rnnt_loss_pruned, inplace_grad", "rnnt_loss_simple, backend",
           "lattice_loss, backend", "k2 get_rnnt_logprobs, termination_symbol",
           "k2 get_rnnt_logprobs_smoothed, lm_only_scale",
           "k2 get_rnnt_logprobs_joint, termination_symbol",
           "k2 rnnt_loss_pruned, use_hat_loss", "k2 rnnt_loss_pruned symbols, use_hat_loss",
           "k2 rnnt_loss return_grad, delay_penalty",
           "k2 rnnt_loss_pruned return_grad, delay_penalty")


@pytest.mark.parametrize("name", REFUSED)
@NO_TRITON
def test_a_call_refused_on_the_host_queues_no_assert(device_checks, monkeypatch, name):
    """Every entry point with device rules of its own (the pruned windows, k2's symbols and
    windows) or a host rule after the device check (a backend that cannot load) queues its
    asserts only once its last host rule has passed: the call with a bad value for the
    device and a refused argument raises the ValueError and fails no assert. (They were
    queued first: the ValueError, then on CUDA at the next synchronisation the assert,
    which ends the process's CUDA context.)"""
    call = _refused_calls(monkeypatch)[name]
    asserts = _Asserts(monkeypatch)
    with pytest.raises(ValueError):
        call()
    assert asserts.failed == [], asserts.failed


@NO_TRITON
def test_prune_ranges_warns_before_it_asserts(device_checks, monkeypatch):
    """``prune_ranges``'s window warning (an error under ``-W error``) comes before its
    device check: a call with bad lengths and a window too small, refused by the warning,
    queues no assert; let through, it asserts."""
    _, _, tl, ul = _batch()
    g = torch.Generator().manual_seed(8)
    occ = (torch.rand(B, T, U + 1, generator=g), torch.rand(B, T, U + 1, generator=g))
    tl = tl.clone()
    tl[1] = T + 1                                                   # beyond the occupations
    boundary = torch.stack([0 * tl, 0 * tl, ul, tl], 1)
    calls = {
        "prune_ranges": lambda: rnnt_lattice.prune_ranges(occ, 1, logit_lengths=tl,
                                                          target_lengths=ul),
        # k2's, on (px_grad, py_grad) of the same occupations (its regular px: T+1 frames)
        "k2 get_rnnt_prune_ranges": lambda: fast_rnnt.get_rnnt_prune_ranges(
            torch.nn.functional.pad(occ[1][..., :U].transpose(1, 2), (0, 1)),
            occ[0].transpose(1, 2), boundary, 1),
    }
    asserts = _Asserts(monkeypatch)
    for name, call in calls.items():
        asserts.failed.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(RuntimeWarning, match="cannot reach the end"):
                call()
        assert asserts.failed == [], (name, asserts.failed)
        with pytest.warns(RuntimeWarning, match="cannot reach the end") as record:
            call()
        assert record[0].filename == __file__, (name, record[0].filename)   # the caller's line
        assert asserts.failed, name


@NO_TRITON
def test_k2_empty_lattice_keeps_the_nan_of_a_bad_boundary(device_checks, monkeypatch):
    """compat.k2 gives a sequence whose boundary starts at its end k2's 0, but not one the
    device check found bad: a boundary beyond the lengths stays NaN (it read 0, a finite
    batch loss beside the assert)."""
    g = torch.Generator().manual_seed(9)
    lm, am = torch.randn(2, U + 1, V, generator=g), torch.randn(2, T, V, generator=g)
    symbols = torch.randint(1, V, (2, U), generator=g)
    boundary = torch.tensor([[0, 0, U, T], [U + 2, T + 3, U + 2, T + 3]])   # row 1: begin == end
    asserts = _Asserts(monkeypatch)
    costs = fast_rnnt.rnnt_loss_simple(lm, am, symbols, 0, boundary, reduction="none")
    assert torch.isfinite(costs[0]) and torch.isnan(costs[1]), costs
    assert asserts.failed == [_rules.device_message("lengths")]   # (the lengths read from it)


@NO_TRITON
def test_k2_px_py_paths_keep_the_nan_of_an_empty_lattice(device_checks, monkeypatch):
    """compat.k2's losses computed from ``(px, py)`` (``return_grad``, ``use_hat_loss``):
    a bad symbol in a sequence whose boundary starts at its end is NaN there, as on the
    fused kernels' path. (Its ``(px, py)`` were NaN, but an empty lattice reads none of
    them: the loss read k2's 0.)"""
    g = torch.Generator().manual_seed(13)
    B_, T_, S, C = 2, 4, 2, 5
    x = torch.randn(B_, T_, S + 1, C, generator=g, dtype=torch.float64)
    symbols = torch.tensor([[1, 2], [C + 3, 4]])                  # sequence 1: a bad symbol
    boundary = torch.tensor([[0, 0, 2, 4], [1, 2, 1, 2]])        # sequence 1: start == end
    ranges = torch.tensor([[[0, 1], [0, 1], [1, 2], [1, 2]]] * B_)
    xp = torch.gather(x, 2, ranges[..., None].expand(B_, T_, 2, C))
    calls = {
        "rnnt_loss": lambda **kw: fast_rnnt.rnnt_loss(x, symbols, 0, boundary, reduction="none",
                                                      **kw),
        "rnnt_loss_pruned": lambda **kw: fast_rnnt.rnnt_loss_pruned(
            xp, symbols, ranges, 0, boundary, reduction="none", **kw),
    }
    asserts = _Asserts(monkeypatch)
    for name, call in calls.items():
        ways = [{}, {"return_grad": True}] + ([{"use_hat_loss": True}]
                                              if name == "rnnt_loss_pruned" else [])
        for kw in ways:
            asserts.failed.clear()
            out = call(**kw)
            costs = out[0] if isinstance(out, tuple) else out
            assert torch.isfinite(costs[0]) and torch.isnan(costs[1]), (name, kw, costs)
            # (the fused path's own loss asserts them as its targets)
            assert len(asserts.failed) == 1 and any(w in asserts.failed[0] for w in (
                "symbols[b, s]", "targets[b, u]")), (name, kw, asserts.failed)


@pytest.mark.parametrize("what", list(BAD))
def test_host_checks_name_the_argument(what):
    """The host path (the CPU default, and ``set_input_checks("host")`` on CUDA) raises a
    ValueError naming the argument, for each bad input the device path catches."""
    x, y, tl, ul, rule = _bad(what)
    before = _validate.set_input_checks("host")
    try:
        with pytest.raises(ValueError, match=rule):
            rnnt_lattice.rnnt_loss(x, y, tl, ul, blank=0)
    finally:
        _validate.set_input_checks(before)


@NO_TRITON
def test_boundary_on_the_device(device_checks, monkeypatch):
    """k2's boundary beyond the lengths: NaN for that sequence, the boundary's assert."""
    x, y, tl, ul = _batch()
    boundary = torch.stack([torch.zeros_like(ul), torch.zeros_like(tl), ul, tl], 1).long()
    boundary[2, 2] = U + 2
    asserts = _Asserts(monkeypatch)
    costs = rnnt_lattice.rnnt_loss(x, y, tl, ul, blank=0, boundary=boundary, reduction="none",
                                   backend="triton", allow_blank_targets=True)
    assert torch.isnan(costs).tolist() == [False, False, True]
    assert asserts.failed == [_rules.device_message("boundary")]


# Bad windows of sequence 1 (B, T, U = 3, 6, 3; R = 2), each breaking k2's rule: strictly
# increasing label positions in [0, U].
BAD_WINDOWS = {
    "duplicate": lambda r: r[1, 2].copy_(torch.tensor([1, 1])),
    "decreasing": lambda r: r[1, 2].copy_(torch.tensor([2, 1])),
    "past U": lambda r: r[1, 4].copy_(torch.tensor([3, 4])),
    "negative": lambda r: r[1, 0].copy_(torch.tensor([-1, 0])),
}


def _windows():
    """Windows ``(B, T, 2)`` of every path of the batch's lengths (k2's shape), and logits
    ``(B, T, 2, V)`` on them."""
    starts = torch.tensor([[0, 0, 1, 1, 2, 2], [0, 0, 1, 1, 1, 1], [0, 1, 2, 2, 2, 2]])
    ranges = starts[..., None] + torch.arange(2)
    g = torch.Generator().manual_seed(5)
    return ranges, torch.randn(B, T, 2, V, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("what", list(BAD_WINDOWS))
@NO_TRITON
def test_bad_windows_on_the_device(device_checks, monkeypatch, what):
    """``rnnt_loss_pruned``'s ranges on the device path (the CUDA default), where no value
    is read on the host: a window that breaks the rule makes its sequence's loss NaN, the
    others' as with good windows, with the ``ranges`` assert; nothing is read or written
    outside the tensors (a position past U was a scatter out of bounds, a duplicate left a
    row of the gradient unwritten, a decreasing pair gave a finite loss)."""
    _, y, tl, ul = _batch()
    ranges, x = _windows()
    good = rnnt_lattice.rnnt_loss_pruned(x, y, ranges, tl, ul, blank=0, reduction="none")
    BAD_WINDOWS[what](ranges)
    asserts = _Asserts(monkeypatch)
    leaf = x.clone().requires_grad_()
    costs = rnnt_lattice.rnnt_loss_pruned(leaf, y, ranges, tl, ul, blank=0, reduction="none")
    assert torch.isnan(costs).tolist() == [False, True, False], costs
    torch.testing.assert_close(costs[[0, 2]], good[[0, 2]], rtol=1e-12, atol=0)
    assert asserts.failed == [_rules.device_message("ranges")]
    assert torch.isfinite(good).all()
    (costs[[0, 2]] * torch.tensor([1.0, -0.5], dtype=costs.dtype)).sum().backward()
    assert torch.isfinite(leaf.grad[[0, 2]]).all()


@NO_TRITON
def test_bad_pruning_ranges_on_the_device(device_checks, monkeypatch):
    """``do_rnnt_pruning`` on the device path: a position outside ``[0, U]`` fails the
    ``pruning_ranges`` assert and is read at the nearest row of its own sequence (it read
    another sequence's row of ``lm``, or out of bounds)."""
    g = torch.Generator().manual_seed(6)
    am, lm = torch.randn(B, T, 2, generator=g), torch.randn(B, U + 1, 4, generator=g)
    ranges, _ = _windows()
    ranges[0, 5, 1], ranges[1, 0, 0] = U + 1, -1
    asserts = _Asserts(monkeypatch)
    _, lm_p = rnnt_lattice.do_rnnt_pruning(am, lm, ranges)
    assert asserts.failed == [_rules.device_message("pruning_ranges")]
    assert torch.equal(lm_p[0, 5, 1], lm[0, U]) and torch.equal(lm_p[1, 0, 0], lm[1, 0])


@NO_TRITON
def test_k2_symbols_and_windows_on_the_device(device_checks, monkeypatch):
    """k2's pure-PyTorch ``(px, py)`` paths on the device path: a symbol outside ``[0, C)``
    and a window that is not strictly increasing in ``[0, S]`` fail the ``symbols`` and
    ``ranges`` asserts, and are kept inside the tensors before any gather or scatter (they
    indexed out of bounds: on CUDA PyTorch's own assert, which names nothing of ours)."""
    _, y, _, _ = _batch()
    ranges, x = _windows()
    g = torch.Generator().manual_seed(7)
    lm, am = torch.randn(B, U + 1, V, generator=g), torch.randn(B, T, V, generator=g)
    symbols = y.long()
    good = fast_rnnt.rnnt_loss_smoothed(lm, am, symbols, 0, return_grad=False,
                                        reduction="none")
    symbols[1, 0] = V
    asserts = _Asserts(monkeypatch)
    px, py = fast_rnnt.get_rnnt_logprobs(lm, am, symbols, 0)
    assert asserts.failed == [_rules.device_message("symbols")]
    assert torch.isnan(py[1]).all() and not torch.isnan(py[[0, 2]]).any()
    # The loss k2 computes from them (here the smoothed one's px, py): NaN for that sequence.
    asserts.failed.clear()
    costs = fast_rnnt.rnnt_loss_smoothed(lm, am, symbols, 0, return_grad=True,
                                         reduction="none")[0]
    assert torch.isnan(costs).tolist() == [False, True, False], costs
    torch.testing.assert_close(costs[[0, 2]], good[[0, 2]])
    good = fast_rnnt.rnnt_loss_pruned(x, y.long(), ranges, 0, reduction="none",
                                      return_grad=True)[0]
    ranges[1, 2] = torch.tensor([2, 4])
    asserts.failed.clear()
    costs = fast_rnnt.rnnt_loss_pruned(x, y.long(), ranges, 0, reduction="none",
                                       return_grad=True)[0]
    assert asserts.failed == [_rules.device_message("ranges")]
    assert torch.isnan(costs).tolist() == [False, True, False], costs
    torch.testing.assert_close(costs[[0, 2]], good[[0, 2]])


def test_traced_windows_keep_their_nan_rows(monkeypatch):
    """Compiled, the pruned loss of a sequence with a bad window is NaN too (the windows'
    NaN rows are made in the graph, beside its assert, and added to the op's costs; they
    were dropped, and until the assert surfaced on CUDA that loss was finite)."""
    _, y, tl, ul = _batch()
    ranges, x = _windows()
    good = rnnt_lattice.rnnt_loss_pruned(x, y, ranges, tl, ul, blank=0, reduction="none")
    ranges[1, 2] = torch.tensor([2, 1])
    rules = []                     # the asserts traced, none raised (as on CUDA until it surfaces)
    monkeypatch.setattr(_rules, "device_assert", lambda ok, rule, names=(): rules.append(rule))
    torch._dynamo.reset()
    costs = torch.compile(lambda r: rnnt_lattice.rnnt_loss_pruned(
        x, y, r, tl, ul, blank=0, reduction="none"), backend="eager", fullgraph=True)(ranges)
    torch._dynamo.reset()
    assert rules == ["ranges"]
    assert torch.isnan(costs).tolist() == [False, True, False], costs
    torch.testing.assert_close(costs[[0, 2]], good[[0, 2]], rtol=1e-12, atol=0)


def test_traced_windows_and_packing_assert():
    """Under ``torch.compile`` (fullgraph) no value is read on the host: the windows' rule,
    ``do_rnnt_pruning``'s and ``pack_logits``' lengths run as asserts in the graph, which
    raise when it runs (each once gave a value: a finite loss, another sequence's rows,
    fewer packed rows than the lengths say)."""
    _, y, tl, ul = _batch()
    ranges, x = _windows()
    g = torch.Generator().manual_seed(6)
    am, lm = torch.randn(B, T, 2, generator=g), torch.randn(B, U + 1, 4, generator=g)
    calls = {
        "ranges": (lambda r: rnnt_lattice.rnnt_loss_pruned(x, y, r, tl, ul, blank=0), ranges,
                   lambda r: r[1, 2].copy_(torch.tensor([2, 1]))),
        "pruning_ranges": (lambda r: rnnt_lattice.do_rnnt_pruning(am, lm, r)[1], ranges,
                           lambda r: r[1, 0, 0].fill_(-1)),
        "pack_lengths": (lambda t: rnnt_lattice.pack_logits(x.new_zeros(B, T, U + 1, V), t, ul),
                         tl, lambda t: t[1].fill_(T + 1)),
    }
    for rule, (fn, arg, edit) in calls.items():
        torch._dynamo.reset()
        # pack_logits' row count depends on the lengths' values: torch 2.13 traces its
        # boolean mask in a full graph as it is; torch 2.8 and 2.9.1 refuse it ("Dynamic
        # shape operator", aten.nonzero) unless Dynamo may capture such shapes (docs/api.md,
        # pack_logits)
        dynamic = rule == "pack_lengths" and TORCH < (2, 13)
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True) if dynamic \
                else contextlib.nullcontext():
            compiled = torch.compile(fn, backend="eager", fullgraph=True)
            torch.testing.assert_close(compiled(arg), fn(arg))
            bad = arg.clone()
            edit(bad)
            with pytest.raises(RuntimeError) as err:
                compiled(bad)
        assert _rules.device_message(rule) in str(err.value), (rule, str(err.value))
    torch._dynamo.reset()


def test_input_check_modes(monkeypatch):
    """``set_input_checks`` returns the mode before; a bad mode is a ValueError; the
    environment variable sets the first mode."""
    before = _validate.set_input_checks("host")
    try:
        assert _validate.set_input_checks("device") == "host"
        assert _validate.check_site(torch.zeros(1, device="meta")) is None
        with pytest.raises(ValueError, match="mode must be one of"):
            _validate.set_input_checks("gpu")
    finally:
        _validate.set_input_checks(before)
    monkeypatch.setitem(_validate._input_checks, "mode", None)
    monkeypatch.setenv("RNNT_LATTICE_INPUT_CHECKS", "host")
    assert _validate.input_checks() == "host"
    monkeypatch.setitem(_validate._input_checks, "mode", None)
    monkeypatch.setenv("RNNT_LATTICE_INPUT_CHECKS", "sometimes")
    with pytest.raises(ValueError, match="RNNT_LATTICE_INPUT_CHECKS"):
        _validate.input_checks()
    assert rnnt_lattice.set_input_checks is _validate.set_input_checks
