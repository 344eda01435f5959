"""torch.compile(fullgraph=True) of a model that calls rnnt_loss, on CPU.

Under compilation ``rnnt_loss`` routes through the custom op
``rnnt_lattice::rnnt_costs_and_grad`` (``_ops.py``), with the Numba kernels behind it;
``fullgraph=True`` makes any graph break an error. Forward and backward are compared with
the same model run eagerly.
"""
import os
import subprocess
import sys

import pytest
import torch

import rnnt_lattice
from rnnt_lattice._types import LossOptions
from rnnt_lattice import _ops, _validate


class Joiner(torch.nn.Module):
    """A minimal transducer head: ``logits = Linear(tanh(enc[t] + pred[u]))`` and its loss."""

    def __init__(self, hidden: int, vocab: int, **loss_options):
        super().__init__()
        self.out = torch.nn.Linear(hidden, vocab)
        self.loss = rnnt_lattice.RNNTLoss(blank=0, **loss_options)

    def forward(self, enc, pred, targets, logit_lengths, target_lengths):
        h = torch.tanh(enc[:, :, None, :] + pred[:, None, :, :])        # (B, T, U+1, H)
        return self.loss(self.out(h), targets, logit_lengths, target_lengths)


def make_inputs(B=3, T=6, U=3, H=8, V=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    enc = torch.randn(B, T, H, generator=g, requires_grad=True)
    pred = torch.randn(B, U + 1, H, generator=g, requires_grad=True)
    targets = torch.randint(1, V, (B, U), generator=g, dtype=torch.int32)
    logit_lengths = torch.tensor([T, T - 2, 2][:B], dtype=torch.int32)
    target_lengths = torch.tensor([U, 1, 0][:B], dtype=torch.int32)
    return enc, pred, targets, logit_lengths, target_lengths


def loss_and_grads(model, inputs):
    enc, pred = (x.detach().clone().requires_grad_() for x in inputs[:2])
    model.zero_grad()
    loss = model(enc, pred, *inputs[2:])
    loss.backward()
    return loss.detach(), [enc.grad, pred.grad] + [p.grad.clone() for p in model.parameters()]


OPTIONS = {
    "mean_fastemit_clamp": dict(reduction="mean", fastemit_lambda=0.2, clamp=0.3),
}


@pytest.fixture
def no_compile_cache():
    """Compile from scratch: the on-disk FX-graph / AOT-autograd caches key on the traced
    graph, not on the Python source of the op's registered backward, so a cached graph
    could hide a change to it."""
    import contextlib
    import importlib
    with contextlib.ExitStack() as stack:
        # Private configs: patch each switch only where this torch has it (older versions
        # have no autograd cache, a newer one may rename a switch), so the test does not
        # depend on the torch version.
        for module, key in (("torch._inductor.config", "fx_graph_cache"),
                            ("torch._functorch.config", "enable_autograd_cache")):
            try:
                config = importlib.import_module(module)
            except ImportError:
                continue
            if hasattr(config, key):
                stack.enter_context(config.patch(**{key: False}))
        yield


@pytest.mark.parametrize("option", OPTIONS)
def test_compile_fullgraph_matches_eager(option, no_compile_cache):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Joiner(8, 7, **OPTIONS[option])
    inputs = make_inputs()
    loss_eager, grads_eager = loss_and_grads(model, inputs)
    compiled = torch.compile(model, fullgraph=True)
    loss_c, grads_c = loss_and_grads(compiled, inputs)
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(loss_c, loss_eager, rtol=64 * eps, atol=0)
    for g_c, g_e in zip(grads_c, grads_eager):
        torch.testing.assert_close(g_c, g_e, rtol=64 * eps, atol=64 * eps * float(g_e.abs().max()))
    # A second call reuses the compiled graph (no recompilation for the same shapes).
    loss_c2, _ = loss_and_grads(compiled, inputs)
    assert torch.equal(loss_c2, loss_c)
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_custom_op(backend):
    """torch.library.opcheck (schema, fake implementation, autograd registration agree with
    the real kernel), and the op's costs and upstream-scaled gradient equal the eager path."""
    _, _, targets, logit_lengths, target_lengths = make_inputs(B=3, T=4, U=2, V=5)
    logits = torch.randn(3, 4, 3, 5, dtype=torch.float64, requires_grad=True)
    args = (targets.long(), logit_lengths.long(), target_lengths.long(), 0, 0.4, True, 0.25,
            backend)
    torch.library.opcheck(_ops._costs_and_grad,
                          (logits, *args, True, "regular", [], 0.0, 0.0, None, None, False,
                           _validate.OURS.joined()),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))
    weights = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    costs = _ops.rnnt_costs_traced(logits, *args[:3], LossOptions(0, True, 0.4, 0.25), backend)
    (grad,) = torch.autograd.grad((costs * weights).sum(), logits)
    eager = rnnt_lattice.rnnt_loss(logits, targets, logit_lengths, target_lengths, 0, 0.4, "none",
                                   fastemit_lambda=0.25, backend=backend)
    (grad_eager,) = torch.autograd.grad((eager * weights).sum(), logits)
    eps = torch.finfo(torch.float64).eps
    torch.testing.assert_close(costs, eager, rtol=64 * eps, atol=0)
    torch.testing.assert_close(grad, grad_eager, rtol=64 * eps, atol=64 * eps)


@pytest.mark.parametrize("entry", ["rnnt_loss", "torchaudio", "inplace_half"])
def test_fake_tensors_take_the_custom_op(entry):
    """Fake tensors outside TorchDynamo (what torch 2.7-2.9 hand the torchaudio op's Python
    kernel while compiling): the call checks their shapes, runs no kernel and reads no value
    (the custom op's fake implementation gives the shapes), and its options take the traced
    path's values (``inplace_grad`` off, half logits promoted: the gradient comes back in
    the logits' dtype, the costs in float32)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from rnnt_lattice.compat import torchaudio as ta
    with FakeTensorMode():
        dtype = torch.float16 if entry == "inplace_half" else torch.float32
        x = torch.randn(2, 5, 3, 7, dtype=dtype, requires_grad=True)
        y = torch.tensor([[1, 2], [2, 1]], dtype=torch.int32)
        tl, ul = torch.tensor([5, 4], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32)
        if entry == "torchaudio":
            loss = ta.rnnt_loss(x, y, tl, ul, blank=0, reduction="none")
        else:
            loss = rnnt_lattice.rnnt_loss(x, y, tl, ul, blank=0, reduction="none",
                                          inplace_grad=entry == "inplace_half")
        (grad,) = torch.autograd.grad(loss.sum(), x)
        with pytest.raises(ValueError, match="batch sizes differ"):
            rnnt_lattice.rnnt_loss(x, y[:1], tl, ul, blank=0)
    from torch._subclasses.fake_tensor import is_fake
    assert is_fake(loss) and is_fake(grad)
    assert loss.shape == (2,) and grad.shape == x.shape and grad.dtype == dtype
    assert loss.dtype == (dtype if entry == "torchaudio" else torch.float32)


def test_traced_pruned_loss_ignores_inplace_grad():
    """Traced (fake tensors, as while compiling), ``inplace_grad`` has no effect on any loss:
    the pruned loss takes strided window logits as the others do (its eager refusal of
    them, which the reshape to rows would copy, ran while tracing too)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.randn(2, 4, 2, 8)[..., :5].requires_grad_()           # strided windows
        y, tl, ul = torch.tensor([[1, 2], [3, 4]]), torch.tensor([4, 4]), torch.tensor([2, 2])
        ranges = torch.tensor([0, 1]).expand(2, 4, 2).contiguous()
        loss = rnnt_lattice.rnnt_loss_pruned(x, y, ranges, tl, ul, blank=0, inplace_grad=True)
    assert loss.shape == ()


@pytest.mark.parametrize("spread", [0.0, 1000.0], ids=["plain", "rescued"])
def test_compiled_pruned_pipeline_runs_the_simple_losses_eagerly(spread, no_compile_cache):
    """A compiled training step of k2's pruned recipe (the smoothed and simple losses,
    ``prune_ranges``, ``do_rnnt_pruning``, the pruned loss, ``lattice_loss``): the simple
    losses and ``lattice_loss`` run eagerly inside it (a graph break: their backends are
    opaque to TorchDynamo, which failed on them), ``prune_ranges`` too (its host read of
    the window's size), so losses and gradients equal the eager
    step's bit for bit, the log-domain rescue of logits 1000 nats apart included."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    B, T, U, V = 2, 6, 3, 7
    am = torch.randn(B, T, V, generator=g)
    am[0, :, 1] += spread
    lm = torch.randn(B, U + 1, V, generator=g)
    y = torch.randint(1, V, (B, U), generator=g)
    tl, ul = torch.tensor([6, 5]), torch.tensor([3, 2])

    def step(lm, am):
        s, occ = rnnt_lattice.rnnt_loss_smoothed(lm, am, y, tl, ul, blank=0, lm_only_scale=0.2,
                                                 am_only_scale=0.1, return_occupations=True)
        s2 = rnnt_lattice.rnnt_loss_simple(lm, am, y, tl, ul, blank=0)
        win = rnnt_lattice.prune_ranges(occ, 2, method="k2")
        am_p, lm_p = rnnt_lattice.do_rnnt_pruning(am, lm, win.ranges)
        p = rnnt_lattice.rnnt_loss_pruned(am_p + lm_p, y, win.ranges, tl, ul, blank=0)
        w = rnnt_lattice.lattice_loss(am[..., :U + 1].double(), lm[:, None, :, 0].double()
                                      .expand(B, T, U + 1), tl, ul).sum()
        return s + s2 + p + w

    def run(fn):
        a, l_ = am.clone().requires_grad_(), lm.clone().requires_grad_()
        loss = fn(l_, a)
        loss.backward()
        return loss.detach(), a.grad, l_.grad

    compiled, eager = run(torch.compile(step)), run(step)      # compiled first (its wrapper made then)
    for name, c, e in zip(("loss", "am.grad", "lm.grad"), compiled, eager):
        assert torch.isfinite(e).all() and torch.equal(c, e), name
    torch._dynamo.reset()



def test_packed_logits_compile_with_a_graph_break(no_compile_cache):
    """``packed=True`` under ``torch.compile``: the row map is built from the lengths read on
    the host, so the call runs eagerly inside the compiled function (a graph break), for
    ``rnnt_loss``, ``tdt_loss`` and warp-rnnt's ``compact=True``, which packs too (without
    the eager wrapper TorchDynamo broke the graph at a data-dependent guard of that read,
    fatal with ``fullgraph=True``: the test below). The losses and gradients equal the
    eager ones bit for bit, compiled first (the wrapper made while tracing: a frame that
    TorchDynamo skipped there once recursed into itself)."""
    import rnnt_lattice.compat.warp_rnnt as warp_rnnt
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    V, T_b, U_b = 6, torch.tensor([5, 3], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32)
    rows = int((T_b * (U_b + 1)).sum())
    x = torch.randn(rows, V, generator=g, dtype=torch.float64)
    y = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    flat = torch.tensor([1, 2, 3], dtype=torch.int32)

    def losses(x):
        lp = x.float().log_softmax(-1)
        return (rnnt_lattice.rnnt_loss(x, y, T_b, U_b, blank=0, packed=True, reduction="sum")
                + rnnt_lattice.tdt_loss(x, y.clamp(max=2), T_b, U_b, blank=3, durations=[0, 1],
                                       packed=True)
                + warp_rnnt.rnnt_loss(lp, flat, T_b, U_b, blank=0, compact=True).sum())

    def run(fn):
        leaf = x.clone().requires_grad_()
        loss = fn(leaf)
        loss.backward()
        return loss.detach(), leaf.grad

    compiled, eager = run(torch.compile(losses, backend="eager")), run(losses)
    for name, c, e in zip(("loss", "grad"), compiled, eager):
        assert torch.isfinite(e).all() and torch.equal(c, e), name
    torch._dynamo.reset()


def _fused_call():
    g = torch.Generator().manual_seed(0)
    enc, pred = torch.randn(2, 4, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    y, tl, ul = torch.tensor([[1, 2], [2, 0]]), torch.tensor([4, 3]), torch.tensor([2, 1])
    head = torch.nn.Linear(5, 4)
    return lambda: rnnt_lattice.fused_rnnt_loss(lambda e, p: head(torch.tanh(e + p)), enc, pred,
                                                 y, tl, ul, blank=0)


def _pruned_calls():
    g = torch.Generator().manual_seed(0)
    B, T, U, V = 2, 6, 3, 7
    am, lm = torch.randn(B, T, V, generator=g), torch.randn(B, U + 1, V, generator=g)
    y, tl, ul = torch.randint(1, V, (B, U), generator=g), torch.tensor([6, 5]), torch.tensor([3, 2])
    _, occ = rnnt_lattice.rnnt_loss_smoothed(lm, am, y, tl, ul, blank=0, lm_only_scale=0.2,
                                             am_only_scale=0.1, return_occupations=True)
    return {
        "simple": lambda: rnnt_lattice.rnnt_loss_simple(lm, am, y, tl, ul, blank=0),
        "prune_ranges": lambda: rnnt_lattice.prune_ranges(occ, 2, method="k2").ranges,
        "lattice_loss": lambda: rnnt_lattice.lattice_loss(
            am[..., :U + 1].double(), lm[:, None, :, 0].double().expand(B, T, U + 1), tl, ul),
        "occupancy": lambda: rnnt_lattice.occupancy(lm[:, None].expand(B, T, U + 1, V), y, tl,
                                                    ul, blank=0).log_likelihood,
        "best_alignment": lambda: rnnt_lattice.best_alignment(
            lm[:, None].expand(B, T, U + 1, V), y, tl, ul, blank=0).log_prob,
    }


def _layout_calls():
    """Calls whose arguments are read on the host by their own layout or option."""
    from rnnt_lattice.compat import optimized_transducer
    import rnnt_lattice.compat.warp_rnnt as warp_rnnt
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(5 * 3 + 3 * 2, 6, generator=g)
    y, T_b, U_b = (torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
                   torch.tensor([5, 3], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32))
    xd = torch.randn(2, 5, 3, 6 + 2, generator=g)
    return {
        # (omega = 1: the regular loss every call, so that both runs compute the same loss.)
        "tdt_omega": lambda: rnnt_lattice.tdt_loss(xd, y, T_b, U_b, blank=5, durations=[0, 1],
                                                   omega=1.0),
        "optimized_transducer": lambda: optimized_transducer.transducer_loss(
            rows.clone(), y, T_b, U_b, blank=0, from_log_softmax=False),
        "warp_rnnt_compact": lambda: warp_rnnt.rnnt_loss(
            rows.log_softmax(-1), torch.tensor([1, 2, 3], dtype=torch.int32), T_b, U_b,
            blank=0, compact=True),
    }


def _packed_call():
    x = torch.randn(5 * 3 + 3 * 2, 6)
    T_b, U_b = torch.tensor([5, 3]), torch.tensor([2, 1])
    return lambda: rnnt_lattice.rnnt_loss(x, torch.tensor([[1, 2], [3, 0]]), T_b, U_b, blank=0,
                                          packed=True)


def _labels(V):
    """Targets (2, 3) whose ids are labels of every loss below (1..V-3: not a blank, big
    blank or duration column), the lengths for logits (2, 5, 4, ...)."""
    return (torch.tensor([[1, 2, 1], [2, 1, 2]]), torch.tensor([5, 4]), torch.tensor([3, 2]))


def _rnnt(x, y, tl, ul):
    return rnnt_lattice.rnnt_loss(x, y, tl, ul, blank=0, reduction="none")


def _multiblank(x, y, tl, ul):
    return rnnt_lattice.multiblank_rnnt_loss(x, y, tl, ul, blank=x.shape[-1] - 1,
                                             big_blank_durations=[2], reduction="none")


def _tdt(x, y, tl, ul):
    return rnnt_lattice.tdt_loss(x, y, tl, ul, blank=-1, durations=[0, 1], reduction="none")


def _nemo(x, y, tl, ul):
    from rnnt_lattice.compat.nemo import RNNTLossNumba
    return RNNTLossNumba(blank=0, reduction="none")(x, y, tl, ul)


def _k2(x, y, tl, ul):
    from rnnt_lattice.compat.k2 import rnnt_loss
    boundary = torch.stack([torch.zeros_like(tl), torch.zeros_like(tl), ul, tl], 1)
    return rnnt_loss(x, y, termination_symbol=0, boundary=boundary, reduction="none")


# (entry, V, the bad value written at targets[1, 1], what the message says (eager, compiled)
# or None (a good call)): the value rules a traced call cannot apply, applied when the op
# runs.
COMPILED_VALUES = [
    (_rnnt, 6, 106, "targets[1, 1] = 106 is outside [0, V) = [0, 6)"),
    (_rnnt, 6, -3, "targets[1, 1] = -3 is outside [0, V) = [0, 6)"),
    (_rnnt, 6, 0, "targets[1, 1] equals the blank id 0"),
    (_multiblank, 6, 4, "targets[1, 1] = 4 is the class of the arc kind 'big_blank_2'"),
    (_tdt, 7, 5, "targets[1, 1] = 5 is outside [0, V_tok) = [0, 5)"),
    (_nemo, 6, 9, "labels[1, 1] = 9 is outside [0, V) = [0, 6)"),
    (_nemo, 6, 0, "labels[1, 1] equals the blank id 0"),
    # (k2's module checks its symbols itself on the host; compiled, the library's loss
    # checks them when the op runs, as its targets.)
    (_k2, 6, 9, ("symbols[1, 1] = 9 must be in [0, C) = [0, 6)",
                 "targets[1, 1] = 9 is outside [0, V) = [0, 6)")),
    (_k2, 6, 0, None),                    # k2: a label may equal the termination symbol
]


@pytest.mark.parametrize("entry, V, bad, says", COMPILED_VALUES,
                         ids=[f"{e.__name__[1:]}-{b}" for e, _, b, _ in COMPILED_VALUES])
def test_a_compiled_call_refuses_what_an_eager_call_refuses(entry, V, bad, says):
    """Tracing has no values, so the custom op prepares the call again when it runs
    (``_backends.prepare_call`` on the real tensors): a target outside the classes, equal to
    the blank or to a big blank is the eager call's ValueError, in the caller's names, where
    the op once checked the lengths only (a finite loss from ids read out of bounds)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 4, V, generator=g, dtype=torch.float64, requires_grad=True)
    y, tl, ul = _labels(V)
    compiled = torch.compile(entry, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, y, tl, ul), entry(x, y, tl, ul))
    y[1, 1] = bad
    if says is None:
        assert torch.isfinite(compiled(x, y, tl, ul)).all()
    else:
        for fn, message in zip((entry, compiled), says if isinstance(says, tuple) else (says,) * 2):
            with pytest.raises(ValueError) as info:
                fn(x, y, tl, ul)
            assert message in str(info.value)
    torch._dynamo.reset()


@pytest.mark.skipif(not _ops.DYNAMO_TAKES_REASONS, reason="TorchDynamo's messages take a "
                    "reason from torch 2.8 on")
@pytest.mark.parametrize("call, says", [
    ("packed", "packed=True read the lengths on the host"),
    ("fused", "fused losses call the joiner tile by tile"),
    ("simple", "simple losses (rnnt_loss_simple, rnnt_loss_smoothed) run their kernels eagerly"),
    ("prune_ranges", "prune_ranges reads its window's size on the host"),
    ("lattice_loss", "lattice_loss runs its kernels eagerly"),
    ("occupancy", "occupancy runs its kernels eagerly"),
    ("best_alignment", "best_alignment runs its kernels eagerly"),
    ("tdt_omega", "tdt_loss with omega > 0 draws, per call, which loss"),
    ("optimized_transducer", "optimized_transducer's transducer_loss reads the lengths"),
    ("warp_rnnt_compact", "warp_rnnt's rnnt_loss with compact=True reads the lengths"),
])
def test_fullgraph_says_why_a_call_breaks_the_graph(call, says, no_compile_cache):
    """The calls that run eagerly under ``torch.compile`` (a graph break) make
    ``fullgraph=True``, which allows none, fail with a message that says why and what to
    do, whether or not an earlier compilation made their eager wrapper already: TorchDynamo
    said "Attempted to call function marked as skipped" (``torch.compiler.disable``'s own
    code) or, for packed logits, "Could not guard on data-dependent expression". Without
    ``fullgraph`` they give the eager call's value (``occupancy`` and ``best_alignment``,
    traced, once failed for every input: their preparation left the backend to a custom
    op)."""
    fn = {"packed": _packed_call, "fused": _fused_call}.get(
        call, lambda: {**_pruned_calls(), **_layout_calls()}[call])()
    for _ in range(2):          # the second: the eager wrapper made by the first
        torch._dynamo.reset()
        with pytest.raises(Exception) as info:
            torch.compile(fn, backend="eager", fullgraph=True)()
        assert says in str(info.value) and "compile without fullgraph=True" in str(info.value)
    # Without fullgraph: a graph break, the eager call's value.
    torch.testing.assert_close(torch.compile(fn, backend="eager")(), fn())
    torch._dynamo.reset()


def test_dynamic_shapes_compile_once(no_compile_cache):
    """``torch.compile(dynamic=True, fullgraph=True)``, the usual setting for batches of
    varying lengths: one compilation serves batches of other sizes, with the eager losses
    and gradients (the regular loss with its float options, TDT with sigma, multi-blank with
    its blank given either way). Dynamo traces
    the float options as symbolic floats there, and the options' check formatted its range
    message (``:g``) on the traced path, which made the whole call Unsupported."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):              # counts compilations, runs the graph as is
        graphs.append(gm)
        return gm.forward

    V = 7

    def losses(x, xd, y, tl, ul):
        # (Multi-blank's topology holds class ids: a blank given from the end, or not, once
        # made them symbols of V, which failed to trace.)
        return (rnnt_lattice.rnnt_loss(x, y, tl, ul, blank=0, fastemit_lambda=0.01, clamp=0.5)
                + rnnt_lattice.tdt_loss(xd, y, tl, ul, blank=V - 1, durations=[0, 1, 2],
                                        sigma=0.05)
                + rnnt_lattice.multiblank_rnnt_loss(x, y, tl, ul, blank=-1,
                                                    big_blank_durations=[2])
                + rnnt_lattice.multiblank_rnnt_loss(x, y, tl, ul, blank=V - 1,
                                                    big_blank_durations=[2]))

    compiled = torch.compile(losses, backend=backend, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for B, T, U in ((2, 5, 3), (3, 8, 4), (4, 6, 2)):
        x = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64)
        xd = torch.randn(B, T, U + 1, V + 3, generator=g, dtype=torch.float64)
        y = torch.randint(1, V - 2, (B, U), generator=g, dtype=torch.int32)  # no big blank
        tl = torch.arange(T, T - B, -1, dtype=torch.int32).clamp(min=1)
        ul = torch.arange(U, U - B, -1, dtype=torch.int32).clamp(min=0)
        results = []
        for fn in (compiled, losses):
            a, b = x.clone().requires_grad_(), xd.clone().requires_grad_()
            loss = fn(a, b, y, tl, ul)
            loss.backward()
            results.append((loss.detach(), a.grad, b.grad))
        for c, e in zip(*results):
            torch.testing.assert_close(c, e, rtol=1e-12, atol=1e-12)
    assert len(graphs) == 1
    # A bad argument's message is still written (TorchDynamo reports the ValueError it
    # raised): the shapes, symbolic here, are formatted one size at a time. (TorchDynamo
    # of torch 2.7 and 2.8 names the exception's class only: "ExceptionVariable(<class
    # 'ValueError'>)"; a message that failed to format would be another exception.)
    bad = torch.compile(lambda x: rnnt_lattice.rnnt_loss(x, y, tl, ul, blank=99),
                        backend=backend, dynamic=True, fullgraph=True)
    with pytest.raises(Exception) as info:
        bad(x)
    text = str(info.value)
    assert (f"blank=99 is outside [-V, V) = [-{V}, {V}) for logits {tuple(x.shape)}" in text
            or "raised exception ExceptionVariable(<class 'ValueError'>)" in text), text
    torch._dynamo.reset()


def test_compat_losses_compile_with_dynamic_shapes(no_compile_cache):
    """The compat modules' losses whose own Python checks the traced path runs, compiled
    with ``dynamic=True, fullgraph=True``: k2's ``rnnt_loss`` (its check of the default
    ``delay_penalty``, which TorchDynamo traced as a symbolic float, called
    ``math.isfinite``) and transformers' Parakeet
    ``tdt_loss`` on the two adjacent slices of one joint output (its in-place join read the
    slices' storage offsets, which TorchDynamo cannot: under compilation it concatenates).
    One compilation for two batch sizes, the eager values and gradients."""
    import rnnt_lattice.compat.k2 as k2
    import rnnt_lattice.compat.transformers as hf
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def losses(x, y, tl, ul):
        boundary = torch.stack([torch.zeros_like(tl), torch.zeros_like(tl), ul, tl], 1)
        return (k2.rnnt_loss(logits=x[..., :7], symbols=y, termination_symbol=0,
                             boundary=boundary, rnnt_type="modified", reduction="sum")
                + hf.tdt_loss(x[..., :7], x[..., 7:], y, tl, ul, 6, [0, 1, 2], sigma=0.05))

    compiled = torch.compile(losses, backend=backend, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for B, T, U in ((2, 5, 3), (3, 8, 4)):
        x = torch.randn(B, T, U + 1, 10, generator=g, dtype=torch.float64)
        y = torch.randint(1, 6, (B, U), generator=g)
        tl, ul = torch.full((B,), T), torch.full((B,), U)
        results = []
        for fn in (compiled, losses):
            leaf = x.clone().requires_grad_()
            loss = fn(leaf, y, tl, ul)
            loss.backward()
            results.append((loss.detach(), leaf.grad))
        for c, e in zip(*results):
            torch.testing.assert_close(c, e, rtol=1e-12, atol=1e-12)
    assert len(graphs) == 1
    torch._dynamo.reset()

# A training step's losses compiled in a fresh process: TorchDynamo warns once per process
# and call site, so a test in a process where another test compiled first could not see it.
QUIET_SCRIPT = """
import warnings
import torch
import rnnt_lattice

g = torch.Generator().manual_seed(0)
B, T, U, V = 2, 5, 3, 7
x = torch.randn(B, T, U + 1, V, generator=g, requires_grad=True)
xd = torch.randn(B, T, U + 1, V + 3, generator=g, requires_grad=True)
# (Labels 1..3: not a blank of any loss below, multi-blank's big blanks being 4 and 5.)
y = torch.randint(1, V - 3, (B, U), generator=g, dtype=torch.int32)
tl, ul = torch.tensor([T, T - 1], dtype=torch.int32), torch.tensor([U, U - 1], dtype=torch.int32)
am, lm = torch.randn(B, T, V, generator=g), torch.randn(B, U + 1, V, generator=g)


def losses(x, xd):                # every option and topology the call path checks
    return (rnnt_lattice.rnnt_loss(x, y, tl, ul, blank=0, reduction="mean", fastemit_lambda=0.1,
                                   clamp=0.5)
            + rnnt_lattice.rnnt_loss(x, y, tl, ul, blank=-1, rnnt_type="modified",
                                     delay_penalty=0.1, reduction="sum")
            + rnnt_lattice.tdt_loss(xd, y, tl, ul, blank=V - 1, durations=[0, 1, 2], sigma=0.05)
            + rnnt_lattice.multiblank_rnnt_loss(x, y, tl, ul, blank=V - 1,
                                                big_blank_durations=[2, 4]))


def pruned(lm, am):               # k2's recipe: the window's size is read on the host
    s, occ = rnnt_lattice.rnnt_loss_smoothed(lm, am, y, tl, ul, blank=0, lm_only_scale=0.2,
                                             am_only_scale=0.1, return_occupations=True)
    win = rnnt_lattice.prune_ranges(occ, 2, method="k2")
    am_p, lm_p = rnnt_lattice.do_rnnt_pruning(am, lm, win.ranges)
    return s + rnnt_lattice.rnnt_loss_pruned(am_p + lm_p, y, win.ranges, tl, ul, blank=0)


def omega(xd):                    # NeMo's omega: the draw runs eagerly, a graph break
    return rnnt_lattice.tdt_loss(xd, y, tl, ul, blank=V - 1, durations=[0, 1, 2], omega=0.5)


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.compile(losses, fullgraph=True)(x, xd).backward()
    torch.compile(pruned)(lm.requires_grad_(), am.requires_grad_()).backward()
    torch.compile(omega)(xd).backward()
for w in caught:
    # (torch's own imports; and TorchDynamo's note on the interpreter, once a compiled
    # function: "Guards may run slower on Python 3.13.0. Consider upgrading to 3.13.1+")
    if not (issubclass(w.category, DeprecationWarning)
            or str(w.message).startswith("Guards may run slower on Python")):
        print("WARNING", w.category.__name__, w.message)
print("DONE")
"""


def test_compiled_steps_warn_nothing():
    """A compiled step of every loss and option the call path checks (fullgraph), and of k2's
    pruned recipe (``prune_ranges`` reads its window's size on the host, a graph break),
    prints no warning and logs no graph break: the per-call caches of the call path are
    bypassed while TorchDynamo traces (``_memo.memo``; ``functools.lru_cache`` alone drew
    six warnings, one per call site), and ``prune_ranges`` runs eagerly under compilation
    (its host read was logged as a graph break with its trace), and so does TDT's draw of
    NeMo's omega (TorchDynamo warned of a graph break at ``Tensor.item()``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", QUIET_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.rstrip().endswith("DONE"), out.stdout + out.stderr[-4000:]
    assert "WARNING" not in out.stdout, out.stdout
    assert "Graph break" not in out.stderr and "lru_cache" not in out.stderr, out.stderr[-4000:]


def test_the_prepared_call_has_no_defaults_for_dynamo():
    """TorchDynamo inlines ``_backends.Prepared``'s ``__init__`` in every traced loss. The
    Dynamo of torch 2.4 to 2.6 cannot hold a default of that ``__init__`` that is an object of ours
    (``names: Names = OURS`` made every ``torch.compile`` of a loss ``Unsupported:
    Unexpected type in sourceless builder``, also where the call passed the field): the
    torch this suite runs on traces it, so the rule is held here as it stands."""
    import dataclasses

    from rnnt_lattice import _backends
    defaults = [f.name for f in dataclasses.fields(_backends.Prepared)
                if f.default is not dataclasses.MISSING
                or f.default_factory is not dataclasses.MISSING]
    assert not defaults, defaults


def test_memo_computes_symbolic_sizes_directly():
    """A trace that TorchDynamo does not run itself (is_compiling() False) may hand a
    memoised function a symbolic size, which no cache can hash: compat.torchaudio's op under
    torch.compile(dynamic=True) on torch 2.9 failed with "unhashable type: non-nested SymInt"
    in the topology's check. It is computed directly; an unhashable plain value still
    raises, and plain values are cached."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from rnnt_lattice._memo import memo
    s = ShapeEnv().create_unbacked_symint()
    f = memo(4)(lambda v, k: v + k)
    assert isinstance(f(s, 1), torch.SymInt) and f.cache_info().currsize == 0
    assert f(2, 1) == 3 and f(2, 1) == 3 and f.cache_info().hits == 1
    with pytest.raises(TypeError, match="unhashable type: 'list'"):
        f([1], 1)


EAGER_SCRIPT = """
import sys
import torch
import rnnt_lattice

g = torch.Generator().manual_seed(0)
B, T, U, V = 2, 6, 3, 7
am, lm = torch.randn(B, T, V, generator=g), torch.randn(B, U + 1, V, generator=g)
y = torch.randint(1, V, (B, U), generator=g)
tl, ul = torch.tensor([6, 5]), torch.tensor([3, 2])
s, occ = rnnt_lattice.rnnt_loss_smoothed(lm.requires_grad_(), am.requires_grad_(), y, tl, ul,
                                         blank=0, return_occupations=True, backend="torch")
win = rnnt_lattice.prune_ranges(occ, 2, method="k2")
w = rnnt_lattice.lattice_loss(am[..., :U + 1].double(), lm[:, None, :, 0].double().expand(B, T, U + 1),
                              tl, ul, backend="torch")
enc, pred = torch.randn(B, T, 4, requires_grad=True), torch.randn(B, U + 1, 4)
f = rnnt_lattice.fused_rnnt_loss(lambda e, p: (e + p).repeat(1, 1, 1, 2)[..., :V], enc, pred, y,
                                 tl, ul, blank=0, backend="torch")
(s + w.sum() + f).backward()
print(sorted(m for m in ("torch._dynamo",) if m in sys.modules))
"""


def test_eager_calls_never_import_dynamo():
    """The calls that run eagerly under ``torch.compile`` (the simple losses,
    ``prune_ranges``, ``lattice_loss``, the fused losses: ``_ops.eager_under_compile``) make
    their ``torch.compiler.disable`` wrapper at the first call that TorchDynamo traces, so an
    eager training step never imports torch._dynamo (about a second, once a process)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", EAGER_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")   # (the shape checks')
@pytest.mark.parametrize("which", ["RNNTLoss", "TDTLoss", "compat.nemo"])
def test_jit_trace(which):
    """``torch.jit.trace`` of a module that calls the loss: the trace records the custom op
    (its shapes are traced tensors: the host checks compared them with NumPy's values and
    raised a TypeError), computing the gradient whatever the grad mode (the flag is a
    constant of the graph); the traced module gives eager's losses and gradients on other
    values and other shapes, and survives ``jit.save`` / ``jit.load``."""
    import io
    import rnnt_lattice.compat.nemo as nemo
    modules = {"RNNTLoss": lambda: rnnt_lattice.RNNTLoss(blank=0, reduction="sum"),
               "TDTLoss": lambda: rnnt_lattice.TDTLoss(blank=4, durations=[0, 1, 2],
                                                      reduction="sum"),
               "compat.nemo": lambda: nemo.RNNTLossNumba(blank=0, reduction="sum")}
    V = 8 if which == "TDTLoss" else 6

    def inputs(B, T, U, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(B, T, U + 1, V, generator=g, requires_grad=True)
        y = torch.randint(1, 4, (B, U), generator=g)
        return x, y, torch.full((B,), T), torch.full((B,), U)

    traced = torch.jit.trace(modules[which](), inputs(2, 5, 3, 0))
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    for module in (traced, loaded):
        for shape in ((2, 5, 3), (3, 7, 2)):
            x, y, tl, ul = inputs(*shape, 1)
            want = modules[which]()(x, y, tl, ul)
            (g_want,) = torch.autograd.grad(want, x)
            got = module(x, y, tl, ul)
            (g_got,) = torch.autograd.grad(got, x)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(g_got, g_want)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_jit_trace_keeps_what_it_cannot_follow_from_being_silent():
    """What a trace cannot follow is not left to a silent value: a negative blank is
    resolved against the traced V, so a later call with another V gives NaN (an assert is
    not recorded by the tracer), where a blank >= 0 serves any V; TDT's omega draw is
    refused (the trace would keep one draw); the calls that run eagerly under
    torch.compile (the lattice tools) say that they cannot be traced."""
    def inputs(V, seed=0):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(2, 5, 4, V, generator=g), torch.randint(1, 4, (2, 3), generator=g),
                torch.tensor([5, 4]), torch.tensor([3, 2]))

    for blank, V_later in ((-1, 8), (0, 8)):
        module = rnnt_lattice.RNNTLoss(blank=blank, reduction="none")
        traced = torch.jit.trace(module, inputs(5))
        got, want = traced(*inputs(V_later, 1)), module(*inputs(V_later, 1))
        if blank < 0:
            assert torch.isnan(got).all() and torch.isfinite(want).all()
        else:
            torch.testing.assert_close(got, want)
        torch.testing.assert_close(traced(*inputs(5, 1)), module(*inputs(5, 1)))
    with pytest.raises(ValueError, match="omega"):
        torch.jit.trace(rnnt_lattice.TDTLoss(blank=3, durations=[0, 1], omega=0.5), inputs(6))
    x, y, tl, ul = inputs(5)
    with pytest.raises(RuntimeError, match="torch.jit.trace cannot record this call.*occupancy"):
        torch.jit.trace(lambda x: rnnt_lattice.occupancy(x, y, tl, ul, blank=0).log_likelihood, (x,))
