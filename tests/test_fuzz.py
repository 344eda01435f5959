"""Property-based fuzzing of the losses across backends (hypothesis).

Every drawn call either raises a ``ValueError`` naming the bad argument, on every backend
alike, or all backends agree: the per-sequence losses (values, and which are NaN / +inf)
and the gradients (values, and which entries are NaN), within a tolerance tied to the
dtype. The draws cover shapes (B = 0, V = 1, U = 0, T = 0 included), dtypes, ragged
lengths, targets, blank (negative ids too), the three reductions, clamp, FastEmit,
zero_infinity, log-prob mode, signed and zero upstream gradients, NaN / -NaN / +-inf
logits anywhere (padding included), all -inf rows and classes, strided (non-contiguous)
logits and targets, in-place gradients and second backward passes. The rules they check
are docs/math.md section 8, and padding's (never read: a gradient of exactly 0).

``rnnt_loss`` (the regular lattice) is drawn by ``loss_calls``; every other lattice
(k2's modified and constrained with delay penalty and boundary, one_sym_per_frame, TDT,
multi-blank in NeMo's and ESPnet's layouts) by ``topology_calls``, through its public
function; and the fused losses, which take a joiner and its inputs, are held to the same
loss on the joiner's materialised logits (``fused_calls``: random joiners and tiles, the
Triton backend's kernel path for ``rnnt_lattice.Joiner``).

Budget: a fixed seed and a bounded number of examples in CI (about 1000 draws for the CPU
backends, 100 for the interpreted Triton backend; about a minute on two cores);
``pytest --slow tests/test_fuzz.py`` explores many more with a random seed (the profiles
are in conftest.py). A failure prints the shrunk example and a
``@reproduce_failure`` blob.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import rnnt_lattice
from rnnt_lattice._layout import node_mask
from support import backends
from support import fused as fused_support

hypothesis = pytest.importorskip("hypothesis")

# The Triton interpreter evaluates with NumPy, which warns on exp/log of -inf, inf - inf
# and NaN in lanes the kernels then mask or propagate on purpose.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")]
from hypothesis import assume, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# The backends compared, in one place. The Triton backend runs on CPU tensors only under
# the interpreter (TRITON_INTERPRET=1, set by conftest.py before triton is first imported);
# it takes part when the Triton backend is usable (installed, >= gpu.MIN_TRITON).
# RNNT_LATTICE_FUZZ_BACKENDS overrides the list.
_DEFAULT_BACKENDS = "numba,torch" + (
    ",triton" if backends.HAS_TRITON
    and os.environ.get("TRITON_INTERPRET") == "1" else "")
BACKENDS = tuple(b for b in os.environ.get("RNNT_LATTICE_FUZZ_BACKENDS", _DEFAULT_BACKENDS).split(",")
                 if b)

# Relative tolerance per dtype of the logits, relative to max(1, the largest magnitude):
# float64 runs in float64 throughout; float32 rows are summed in float32 by one backend and
# in float64 by the other; half types are computed in float32 and rounded back.
TOL = {torch.float64: 1e-9, torch.float32: 2.0**-23 * 64, torch.float16: 2.0**-10 * 8,
       torch.bfloat16: 2.0**-7 * 8}

NAN, INF = float("nan"), float("inf")
NEG_NAN = math.copysign(NAN, -1.0)          # sign bit set, like inf - inf on x86
SPECIALS = [NAN, NEG_NAN, INF, -INF]


@st.composite
def loss_calls(draw):
    """Valid arguments of one ``rnnt_loss`` call plus the upstream gradient."""
    dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.float32, torch.float16,
                                  torch.bfloat16]))
    # Sizes: mostly non-empty; B = 0, T = 0 and T_b = 0 (no path) now and then.
    B = draw(st.sampled_from([1, 2, 3, 1, 2, 3, 2, 3, 0]))
    T = draw(st.sampled_from([1, 2, 3, 4, 5, 2, 3, 4, 5, 0]))
    U = draw(st.integers(0, 4))
    V = draw(st.sampled_from([1, 2, 3, 5, 8, 19, 40]))
    blank = draw(st.integers(-V, V - 1))
    blank_id = blank % V
    others = [v for v in range(V) if v != blank_id]
    T_lens = [draw(st.sampled_from([T, T, max(T - 1, 0), max(T - 2, 0), 0])) for _ in range(B)]
    U_lens = draw(st.lists(st.integers(0, U if others else 0), min_size=B, max_size=B))
    fused = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.5, 1.0, 4.0, 30.0]))
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64)
    if not fused and draw(st.booleans()):
        x = torch.log_softmax(x, -1)                 # realistic log-probs (else any values)
    targets = torch.full((B, U), -7, dtype=torch.int64)       # padding: garbage ids
    for b in range(B):
        for u in range(U_lens[b]):
            targets[b, u] = draw(st.sampled_from(others))
    _special_values(draw, x, T_lens, U_lens)
    x, targets = _layouts(draw, x.to(dtype), targets)
    upstream, kwargs = _reduction_and_options(draw, B)
    kwargs.update(blank=blank, fused_log_softmax=fused)
    _maybe_inplace(draw, x, kwargs)
    return (x, targets, torch.tensor(T_lens, dtype=torch.int64),
            torch.tensor(U_lens, dtype=torch.int64), kwargs, upstream)


def _special_values(draw, x, T_lens, U_lens) -> None:
    """Special values in ``x`` (float64, in place): single entries (mostly inside a
    lattice, else anywhere: padding), whole rows of -inf, whole classes of -inf."""
    B, T, U1, V = x.shape
    n_special = draw(st.sampled_from([0, 1, 2, 3, 1, 2])) if x.numel() else 0
    for _ in range(n_special):
        kind = draw(st.sampled_from(["entry", "entry", "entry", "entry", "row", "class"]))
        value = draw(st.sampled_from(SPECIALS))
        b = draw(st.integers(0, B - 1))
        if T_lens[b] > 0 and draw(st.integers(0, 4)) > 0:
            t, u = draw(st.integers(0, T_lens[b] - 1)), draw(st.integers(0, U_lens[b]))
        else:
            t, u = draw(st.integers(0, T - 1)), draw(st.integers(0, U1 - 1))
        if kind == "entry":
            x[b, t, u, draw(st.integers(0, V - 1))] = value
        elif kind == "row":
            x[b, t, u, :] = -INF
        else:
            x[b, :, :, draw(st.integers(0, V - 1))] = -INF


def _layouts(draw, x, targets):
    """Strides: contiguous, frames and label positions swapped in memory, or a slice of a
    wider vocabulary; targets int64 or int32, contiguous or not."""
    B, T, U1, V = x.shape
    layout = draw(st.sampled_from(["contiguous", "contiguous", "transposed", "sliced"]))
    if layout == "transposed":
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "sliced":
        wide = torch.full((B, T, U1, V + 3), NAN, dtype=x.dtype)
        wide[..., 1:V + 1] = x
        x = wide[..., 1:V + 1]
    if draw(st.booleans()):
        targets = targets.to(torch.int32)
    if U1 > 1 and draw(st.booleans()):
        targets = torch.stack([targets, targets], -1)[..., 0]    # non-contiguous, same values
    return x, targets


def _reduction_and_options(draw, B):
    """The upstream gradient (signed, zero on some sequences) of a drawn reduction, and the
    options every loss takes."""
    reduction = draw(st.sampled_from(["none", "sum", "mean"]))
    if reduction == "none":
        upstream = torch.tensor([draw(st.sampled_from([0.0, 0.0, 1.0, -0.5, 2.5])) for _ in range(B)],
                                dtype=torch.float64)
    else:
        upstream = torch.tensor(draw(st.sampled_from([1.0, -2.0, 0.0])), dtype=torch.float64)
    kwargs = dict(
        clamp=draw(st.sampled_from([-1.0, -1.0, 0.0, 0.05, 0.5, 2.0])),
        reduction=reduction,
        fastemit_lambda=draw(st.sampled_from([0.0, 0.0, 0.01, 0.5, -0.3])),
        zero_infinity=draw(st.booleans()),
    )
    return upstream, kwargs


def _maybe_inplace(draw, x, kwargs) -> None:
    if x.is_contiguous() and x.dtype in (torch.float32, torch.float64) and draw(st.booleans()):
        kwargs["inplace_grad"] = True                 # the gradient is written over the logits


def _run(loss, backend, x, targets, tl, ul, kwargs, upstream):
    """(output, gradient w.r.t. the logits) of one call of ``loss``; the upstream gradient
    is applied with backward(), so a 0 weights a sequence exactly as ``loss[mask].sum()``
    does. Without ``inplace_grad``, a second backward of the same graph (which recomputes
    what the first one was handed) must give the same gradient, bit for bit."""
    xx = x.detach().clone().requires_grad_()
    out = loss(xx, targets, tl, ul, backend=backend, **kwargs)
    up = upstream.to(out.dtype)
    if kwargs.get("inplace_grad"):
        out.backward(up)
        return out.detach(), xx.grad
    (first,) = torch.autograd.grad(out, xx, up, retain_graph=True)
    (second,) = torch.autograd.grad(out, xx, up)
    assert torch.equal(first.nan_to_num(), second.nan_to_num()) and torch.equal(
        first.isnan(), second.isnan()), f"{backend}: a second backward differs from the first"
    return out.detach(), first


def _assert_agree(name, got, want, dtype):
    """Same NaN and +-inf pattern, finite entries within the dtype's tolerance."""
    got, want = got.to(torch.float64), want.to(torch.float64)
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    for what, f in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        a, b = f(got), f(want)
        assert torch.equal(a, b), (f"{name}: {what} pattern differs at "
                                   f"{(a ^ b).nonzero()[:5].tolist()}: {got[a ^ b][:5]} vs {want[a ^ b][:5]}")
    finite = torch.isfinite(want)
    if finite.any():
        scale = max(1.0, want[finite].abs().max().item())
        err = (got[finite] - want[finite]).abs().max().item() / scale
        assert err <= TOL[dtype], f"{name}: relative error {err:.3g} > {TOL[dtype]:.3g}"


# The interpreted Triton backend takes about 0.35 s a call where the CPU backends take a few
# milliseconds (its lattice pass, one interpreted program per sequence and direction walking
# the diagonals): it is held to the same properties on a sixth of the CPU backends' draws.
FAST = tuple(b for b in BACKENDS if b != "triton")
INTERPRETED = tuple(b for b in BACKENDS if b == "triton")


def _agree(call, backends, loss=rnnt_lattice.rnnt_loss):
    """Every backend of ``backends`` against the last one: losses and gradients (values,
    NaN and inf patterns), then the rules of math.md section 8 on each one's gradient, and
    padding's (entries past a sequence's ``T_b`` frames or ``U_b + 1`` positions are never
    read: exactly 0)."""
    x, targets, tl, ul, kwargs, upstream = call
    note(f"{loss.__name__}: x {tuple(x.shape)} {x.dtype} strides {x.stride()}; lengths "
         f"{tl.tolist()} {ul.tolist()}; targets {targets.tolist()}; {kwargs}; upstream "
         f"{upstream.tolist()}")
    results = {b: _run(loss, b, x, targets, tl, ul, kwargs, upstream) for b in backends}
    ref_name = backends[-1]
    ref_out, ref_grad = results[ref_name]
    for name, (out, grad) in results.items():
        assert out.dtype == ref_out.dtype and grad.dtype == x.dtype
        _assert_agree(f"{name} vs {ref_name} loss", out, ref_out, x.dtype)
        _assert_agree(f"{name} vs {ref_name} gradient", grad, ref_grad, x.dtype)
    # Rules that hold on every backend (math.md section 8), checked on each.
    costs = loss(x, targets, tl, ul, backend=ref_name,
                 **dict(kwargs, reduction="none", inplace_grad=False))
    B, T, U1, _ = x.shape
    ups = upstream.expand(B) if upstream.dim() == 0 else upstream
    padding = ~node_mask(tl, ul, T, U1)
    for name, (_, grad) in results.items():
        assert (grad[padding] == 0).all(), f"{name}: padding's gradient not exactly 0"
        for b in range(B):
            g = grad[b]
            if ups[b] == 0 or torch.isinf(costs[b]):
                assert torch.equal(g, torch.zeros_like(g)), f"{name}, sequence {b}: gradient not exactly 0"
            elif torch.isnan(costs[b]):
                assert torch.isnan(g).any(), f"{name}, sequence {b}: NaN loss but no NaN in its gradient"
            else:
                assert torch.isfinite(g).all(), f"{name}, sequence {b}: finite loss but non-finite gradient"
    if kwargs["reduction"] == "mean" and B == 0:
        assert ref_out.item() == 0.0


@pytest.mark.skipif(len(FAST) < 2, reason="fewer than two CPU backends to compare")
@settings(max_examples=2 * settings.default.max_examples)     # milliseconds a draw
@given(call=loss_calls())
def test_backends_agree(call):
    _agree(call, FAST)


@pytest.mark.skipif(not INTERPRETED or not FAST, reason="needs triton under TRITON_INTERPRET=1")
@settings(max_examples=max(20, settings.default.max_examples // 5))    # ~1.5 s a draw
@given(call=loss_calls())
def test_triton_agrees(call):
    _agree(call, INTERPRETED + FAST[-1:])


# ----------------------------------------------------------------- the other topologies
# The same agreement and rules for every lattice besides the regular one (math.md section
# 9), through their public functions: k2's modified and constrained lattices and
# optimized_transducer's one_sym_per_frame (with k2's delay penalty and boundary), TDT
# (durations with and without 0, sigma) and multi-blank (NeMo's layout, blank last, and
# ESPnet's, blank after the big blanks), with NaN-poisoned padding besides the specials.

TDT_DURATIONS = ([0, 1, 2], [1, 2], [0, 1], [1], [0, 2, 3], [2, 4], [0, 1, 2, 3, 4])
BIG_BLANKS = ([2], [2, 4], [3, 2], [4, 8])


@st.composite
def topology_calls(draw):
    """``(loss, call)``: one of the public losses of the other topologies and valid
    arguments for it, as :func:`loss_calls` draws them."""
    dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.float32, torch.float16,
                                  torch.bfloat16]))
    name = draw(st.sampled_from(["modified", "constrained", "one_sym_per_frame", "regular",
                                 "tdt", "tdt", "multiblank", "multiblank"]))
    B = draw(st.sampled_from([1, 2, 3, 1, 2, 3, 0]))
    T = draw(st.sampled_from([1, 2, 3, 4, 5, 6, 0]))
    U = draw(st.integers(0, 4))
    kwargs = {}
    if name == "tdt":
        loss, fused = rnnt_lattice.tdt_loss, True
        durations = draw(st.sampled_from(TDT_DURATIONS))
        V_tok = draw(st.sampled_from([2, 3, 5]))
        V = V_tok + len(durations)
        blank = draw(st.sampled_from([V_tok - 1, -1]))
        labels = list(range(V_tok - 1))
        kwargs.update(durations=durations, sigma=draw(st.sampled_from([0.0, 0.05, 1.0])))
    elif name == "multiblank":
        loss, fused = rnnt_lattice.multiblank_rnnt_loss, True
        big = draw(st.sampled_from(BIG_BLANKS))
        n_labels = draw(st.sampled_from([1, 2, 4]))
        V = n_labels + len(big) + 1
        if draw(st.booleans()):                       # ESPnet: big blanks, blank, labels
            blank, labels = len(big), list(range(len(big) + 1, V))
        else:                                         # NeMo: labels, big blanks, blank
            blank, labels = draw(st.sampled_from([V - 1, -1])), list(range(n_labels))
        kwargs.update(big_blank_durations=big, sigma=draw(st.sampled_from([0.0, 0.05, 1.0])))
    else:
        loss, fused = rnnt_lattice.rnnt_loss, draw(st.booleans())
        V = draw(st.sampled_from([2, 3, 5, 8]))
        blank = draw(st.integers(-V, V - 1))
        labels = [v for v in range(V) if v != blank % V]
        kwargs.update(rnnt_type=name, fused_log_softmax=fused,
                      delay_penalty=draw(st.sampled_from([0.0, 0.0, 0.25, 2.0])))
    T_lens = [draw(st.sampled_from([T, T, max(T - 1, 0), max(T - 3, 0), 0])) for _ in range(B)]
    U_lens = draw(st.lists(st.integers(0, U), min_size=B, max_size=B))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = draw(st.sampled_from([0.5, 1.0, 4.0, 30.0])) * torch.randn(B, T, U + 1, V, generator=g,
                                                                   dtype=torch.float64)
    if not fused and draw(st.booleans()):
        x = torch.log_softmax(x, -1)
    targets = torch.full((B, U), -7, dtype=torch.int64)
    for b in range(B):
        for u in range(U_lens[b]):
            targets[b, u] = draw(st.sampled_from(labels))
        x[b, T_lens[b]:] = NAN                        # padding: never read
        x[b, :, U_lens[b] + 1:] = NAN
    if name in ("regular", "modified", "constrained") and B and draw(st.booleans()):
        # k2's boundary: [begin_symbol, begin_frame, end_symbol, end_frame] within the lengths
        kwargs["boundary"] = torch.tensor(
            [[draw(st.integers(0, U_lens[b])), draw(st.integers(0, T_lens[b])), U_lens[b], T_lens[b]]
             for b in range(B)])
    _special_values(draw, x, T_lens, U_lens)
    x, targets = _layouts(draw, x.to(dtype), targets)
    upstream, options = _reduction_and_options(draw, B)
    kwargs.update(options, blank=blank)
    _maybe_inplace(draw, x, kwargs)
    return loss, (x, targets, torch.tensor(T_lens, dtype=torch.int64),
                  torch.tensor(U_lens, dtype=torch.int64), kwargs, upstream)


@pytest.mark.skipif(len(FAST) < 2, reason="fewer than two CPU backends to compare")
@settings(max_examples=settings.default.max_examples)
@given(drawn=topology_calls())
def test_topologies_backends_agree(drawn):
    loss, call = drawn
    _agree(call, FAST, loss)


@pytest.mark.skipif(not INTERPRETED or not FAST, reason="needs triton under TRITON_INTERPRET=1")
@settings(max_examples=max(10, settings.default.max_examples // 12))
@given(drawn=topology_calls())
def test_topologies_triton_agrees(drawn):
    loss, call = drawn
    _agree(call, INTERPRETED + FAST[-1:], loss)


# ------------------------------------------------------------------------- the fused losses
# The fused losses (the joiner run tile by tile, or the kernel path of rnnt_lattice.Joiner)
# against the same loss on the joiner's materialised logits, on the same backend: the loss
# and the gradients of enc, pred and every parameter, for every topology and option, random
# tiles, ragged lengths with garbage padding in enc and pred.


class _Joint(torch.nn.Module):
    """A joiner the kernels do not know (the tile path on every backend)."""

    def __init__(self, enc_dim, pred_dim, hidden, vocab, activation, bias):
        super().__init__()
        self.enc = torch.nn.Linear(enc_dim, hidden) if enc_dim else torch.nn.Identity()
        self.pred = torch.nn.Linear(pred_dim, hidden) if pred_dim else torch.nn.Identity()
        self.act = {"tanh": torch.tanh, "relu": torch.relu}[activation]
        self.out = torch.nn.Linear(hidden, vocab, bias=bias)

    def forward(self, e, p):
        return self.out(self.act(self.enc(e) + self.pred(p)))


FUSED = {rnnt_lattice.rnnt_loss: rnnt_lattice.fused_rnnt_loss,
         rnnt_lattice.tdt_loss: rnnt_lattice.fused_tdt_loss,
         rnnt_lattice.multiblank_rnnt_loss: rnnt_lattice.fused_multiblank_rnnt_loss}


@st.composite
def fused_calls(draw, kernel_joiner=False):
    """``(loss, joiner, enc, pred, targets, tl, ul, kwargs, upstream, tile)``: a topology's
    loss as :func:`topology_calls` draws it, its logits from a drawn joiner (an
    ``rnnt_lattice.Joiner`` or not, when ``kernel_joiner``) on enc and pred."""
    loss, (x, targets, tl, ul, kwargs, upstream) = draw(topology_calls())
    B, T, U1, V = x.shape
    assume(B > 0 and T > 0 and x.dtype in (torch.float64, torch.float32))
    for k in ("inplace_grad", "fused_log_softmax"):
        kwargs.pop(k, None)
    if kwargs.get("rnnt_type") is not None and draw(st.booleans()):
        kwargs["fused_log_softmax"] = False           # the joiner's output read as log-probs
    enc_dim, pred_dim = draw(st.sampled_from([(3, 2), (8, 8), (None, None)]))
    hidden = draw(st.sampled_from([4, 8]))
    if enc_dim is None:
        enc_dim = pred_dim = hidden
        projections = (None, None)
    else:
        projections = (enc_dim, pred_dim)
    activation, bias = draw(st.sampled_from(["tanh", "relu"])), draw(st.booleans())
    torch.manual_seed(draw(st.integers(0, 2**31 - 1)))
    if kernel_joiner and draw(st.integers(0, 3)):
        joiner = rnnt_lattice.Joiner(*projections, hidden, V, activation, bias=bias)
    else:
        joiner = _Joint(*projections, hidden, V, activation, bias)
    scale = draw(st.sampled_from([0.5, 2.0, 8.0]))
    enc = scale * torch.randn(B, T, enc_dim, dtype=torch.float64)
    pred = scale * torch.randn(B, U1, pred_dim, dtype=torch.float64)
    for b in range(B):                                # padding: garbage, never read
        enc[b, tl[b]:] = 1e3
        pred[b, ul[b] + 1:] = -1e3
    joiner = joiner.to(x.dtype)
    enc, pred = enc.to(x.dtype).requires_grad_(), pred.to(x.dtype).requires_grad_()
    tile = draw(st.sampled_from([None, 1, 2, 3, 5, 8, 13]))
    return loss, joiner, enc, pred, targets, tl, ul, kwargs, upstream, tile


def _fused_equals_full(call, backend):
    loss, joiner, enc, pred, targets, tl, ul, kwargs, upstream, tile = call
    note(f"{loss.__name__} with {type(joiner).__name__} on {backend}: enc {tuple(enc.shape)} pred "
         f"{tuple(pred.shape)} {enc.dtype}; lengths {tl.tolist()} {ul.tolist()}; targets "
         f"{targets.tolist()}; {kwargs}; upstream {upstream.tolist()}; tile {tile}")
    full = fused_support.run(lambda: loss(joiner(enc[:, :, None], pred[:, None]), targets, tl, ul,
                                          backend=backend, **kwargs), joiner, enc, pred, upstream)
    fused = fused_support.run(lambda: FUSED[loss](joiner, enc, pred, targets, tl, ul, tile=tile,
                                                  backend=backend, **kwargs),
                              joiner, enc, pred, upstream)
    fused_support.assert_same(full, fused, {torch.float64: 1e-10, torch.float32: 2e-5}[enc.dtype])


@pytest.mark.parametrize("backend", FAST)
@settings(max_examples=max(20, settings.default.max_examples // 3))
@given(call=fused_calls())
def test_fused_losses_equal_the_loss_of_their_logits(backend, call):
    _fused_equals_full(call, backend)


@pytest.mark.skipif(not INTERPRETED, reason="needs triton under TRITON_INTERPRET=1")
@settings(max_examples=max(6, settings.default.max_examples // 50))
@given(call=fused_calls(kernel_joiner=True))
def test_fused_losses_equal_the_loss_of_their_logits_triton(call):
    """The kernel path (three draws in four take a Joiner) and the tile path."""
    _fused_equals_full(call, "triton")


BAD_CASES = {
    # name: (edit of the arguments, words the message must hold)
    "fastemit_inf": (lambda a, k: k.update(fastemit_lambda=INF), ["fastemit_lambda", "finite"]),
    "fastemit_neg_inf": (lambda a, k: k.update(fastemit_lambda=-INF), ["fastemit_lambda", "finite"]),
    "fastemit_nan": (lambda a, k: k.update(fastemit_lambda=NAN), ["fastemit_lambda", "NaN"]),
    "clamp_nan": (lambda a, k: k.update(clamp=NAN), ["clamp", "NaN"]),
    "blank_tensor": (lambda a, k: k.update(blank=torch.tensor([0, 1])), ["blank", "(2,)"]),
    "blank_range": (lambda a, k: k.update(blank=a["x"].shape[-1]), ["blank="]),
    "blank_float": (lambda a, k: k.update(blank=0.0), ["blank"]),
    "reduction": (lambda a, k: k.update(reduction="avg"), ["reduction", "'avg'"]),
    "bool_targets": (lambda a, k: a.update(targets=a["targets"].bool()), ["targets", "torch.bool"]),
    "bool_lengths": (lambda a, k: a.update(tl=a["tl"].bool()), ["logit_lengths", "torch.bool"]),
    "float_target_lengths": (lambda a, k: a.update(ul=a["ul"].double()), ["target_lengths"]),
    "int_logits": (lambda a, k: a.update(x=a["x"].long()), ["logits", "torch.int64"]),
    "long_logit_lengths": (lambda a, k: a.update(tl=a["tl"] + a["x"].shape[1] + 1), ["logit_lengths"]),
    "negative_target_lengths": (lambda a, k: a.update(ul=a["ul"] - a["x"].shape[2] - 1), ["target_lengths"]),
}


@settings(max_examples=max(20, settings.default.max_examples // 6))
@given(call=loss_calls(), bad=st.sampled_from(sorted(BAD_CASES)))
def test_bad_arguments_are_named(call, bad):
    x, targets, tl, ul, kwargs, _ = call
    assume(x.shape[0] > 0 or bad in ("fastemit_inf", "fastemit_neg_inf", "fastemit_nan",
                                      "clamp_nan", "blank_tensor", "blank_range", "blank_float",
                                      "reduction", "bool_targets", "bool_lengths",
                                      "float_target_lengths", "int_logits"))
    args = dict(x=x, targets=targets, tl=tl, ul=ul)
    edit, words = BAD_CASES[bad]
    edit(args, kwargs)
    for backend in BACKENDS:
        with pytest.raises(ValueError) as err:
            rnnt_lattice.rnnt_loss(args["x"], args["targets"], args["tl"], args["ul"],
                                   backend=backend, **kwargs)
        for w in words:
            assert w in str(err.value), f"{backend}, {bad}: {w!r} not in: {err.value}"


# --------------------------------------------------------------------------- pinned examples
# The rules of math.md section 8 on hand-made inputs, one per rule, on every backend.

def _inputs(dtype=torch.float64, fused=True):
    """Two sequences, V = 6, blank 0; sequence 1 is shorter (NaN padding)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 3, 6, generator=g, dtype=torch.float64)
    if not fused:
        x = torch.log_softmax(x, -1)
    x[1, 3:] = NAN
    x[1, :, 2:] = NAN
    targets = torch.tensor([[1, 2], [3, -7]])
    return x.to(dtype), targets, torch.tensor([4, 3]), torch.tensor([2, 1])


def _loss_grad(backend, x, targets, tl, ul, upstream, **kw):
    xx = x.detach().clone().requires_grad_()
    costs = rnnt_lattice.rnnt_loss(xx, targets, tl, ul, blank=0, reduction="none",
                                   backend=backend, **kw)
    costs.backward(upstream.to(costs.dtype))
    return costs.detach(), xx.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logprob"])
@pytest.mark.parametrize("clamp", [-1.0, 0.1])
def test_zero_upstream_gives_exactly_zero_gradient(backend, fused, clamp):
    """The usual masking ``loss[isfinite(loss)].sum()`` must leave the weights finite: a
    NaN sequence whose upstream gradient is 0 gets exactly 0, not 0 * NaN."""
    x, targets, tl, ul = _inputs(fused=fused)
    x[1, 1, 0, 1] = NAN                              # sequence 1: NaN loss
    x[1, 1, 0, 0] = INF if fused else NAN            # and a +inf logit (fused mode)
    xx = x.clone().requires_grad_()
    costs = rnnt_lattice.rnnt_loss(xx, targets, tl, ul, blank=0, reduction="none",
                                   backend=backend, clamp=clamp, fused_log_softmax=fused)
    assert math.isfinite(costs[0].item()) and math.isnan(costs[1].item())
    costs[torch.isfinite(costs)].sum().backward()
    assert torch.isfinite(xx.grad).all()
    assert torch.equal(xx.grad[1], torch.zeros_like(xx.grad[1]))
    assert xx.grad[0].abs().sum() > 0
    # With a non-zero upstream gradient the NaN sequence's gradient is NaN on its rows.
    _, g = _loss_grad(backend, x, targets, tl, ul, torch.tensor([1.0, 2.0]), clamp=clamp,
                      fused_log_softmax=fused)
    assert torch.isnan(g[1]).any() and torch.isfinite(g[0]).all()
    assert not torch.isnan(g[1, 3:]).any() and not torch.isnan(g[1, :, 2:]).any()   # padding: 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_negative_nan_is_seen(backend, dtype):
    """``inf - inf`` is a NaN with the sign bit set on x86: it must poison the sequence like
    any NaN, also in a row whose other entries are all -inf (a "dead" row otherwise)."""
    for fill_row in (False, True):
        x, targets, tl, ul = _inputs(dtype)
        if fill_row:
            x[0, 1, 1, :] = -INF
        x[0, 1, 1, 4] = NEG_NAN                      # sign bit set on every platform
        assert torch.signbit(x[0, 1, 1, 4]) and torch.isnan(x[0, 1, 1, 4])
        costs, g = _loss_grad(backend, x, targets, tl, ul, torch.tensor([1.0, 1.0]))
        assert math.isnan(costs[0].item()), f"fill_row={fill_row}: loss {costs[0].item()}"
        assert torch.isnan(g[0, :4, :3]).all()       # every row of sequence 0's lattice
        assert math.isfinite(costs[1].item()) and torch.isfinite(g[1]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", [0, 1, 5], ids=["blank", "label", "other"])
def test_plus_inf_logit_makes_the_sequence_nan(backend, cls):
    """A +inf logit: that row's softmax is undefined (inf - inf), so the sequence's loss is
    NaN whichever class holds it (math.md section 8), and the other sequence is exact."""
    x, targets, tl, ul = _inputs()
    want0, _ = _loss_grad("torch", x, targets, tl, ul, torch.tensor([1.0, 1.0]))
    x[0, 2, 0, cls] = INF                            # targets[0, 0] = 1
    costs, g = _loss_grad(backend, x, targets, tl, ul, torch.tensor([1.0, 1.0]))
    assert math.isnan(costs[0].item())
    assert torch.isnan(g[0]).all()                   # sequence 0 has no padding
    assert costs[1].item() == pytest.approx(want0[1].item(), rel=1e-12)
    assert torch.isfinite(g[1]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_log_prob_mode_reads_only_arc_entries(backend):
    """Log-prob mode reads the blank and label entries of the lattice's arcs only: a NaN
    elsewhere changes nothing; +inf on an arc (log p > 0 is impossible) reads as NaN."""
    x, targets, tl, ul = _inputs(fused=False)
    ones = torch.tensor([1.0, 1.0])
    want, want_g = _loss_grad(backend, x, targets, tl, ul, ones, fused_log_softmax=False)
    y = x.clone()
    y[0, :, :, 4] = NAN                              # never an arc of sequence 0
    y[0, 3, 0, 0] = NAN                              # blank out of the last frame, u < U_b
    costs, g = _loss_grad(backend, y, targets, tl, ul, ones, fused_log_softmax=False)
    assert torch.equal(costs, want) and torch.equal(g, want_g)
    y = x.clone()
    y[0, 1, 0, 1] = INF                              # the label arc of (1, 0)
    costs, g = _loss_grad(backend, y, targets, tl, ul, ones, fused_log_softmax=False)
    assert math.isnan(costs[0].item()) and costs[1] == want[1]


def test_row_max_sees_every_nan():
    """The integer-key row max of the Numba kernels: equal to the float max, and NaN as
    soon as the row holds a NaN of either sign (property-based, both float widths)."""
    pytest.importorskip("numba")
    import numpy as np

    from rnnt_lattice.cpu import fastmath

    floats = {np.float32: st.floats(width=32, allow_nan=True, allow_infinity=True),
              np.float64: st.floats(allow_nan=True, allow_infinity=True)}

    for dt, elems in floats.items():
        values = st.lists(st.one_of(elems, st.sampled_from([NAN, NEG_NAN, INF, -INF, -0.0])),
                          min_size=1, max_size=40)

        @settings(max_examples=max(50, settings.default.max_examples // 5))
        @given(values)
        def check(v):
            row = np.array(v, dtype=dt)
            m = fastmath.row_max(row)
            if np.isnan(row).any():
                assert np.isnan(m), (row, m)
            else:
                assert m == row.max(), (row, m)
        check()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["eager", "custom_op"])
def test_cost_overflowing_float32_has_zero_gradient(backend, path):
    """A float32 loss that overflows to +inf (logits near 3.4e38; the float64 lattice is
    finite) has a zero gradient, like every infinite loss (math.md 8.1), on every backend
    and through the torch.compile custom op; with zero_infinity it is 0."""
    from rnnt_lattice import _ops
    from rnnt_lattice._types import LossOptions
    x = torch.zeros(2, 4, 2, 5)
    x[0, :, :, 3] = 3.0e38                       # sequence 0: the label 1 is 3e38 below class 3
    targets, tl, ul = torch.tensor([[1], [2]]), torch.tensor([4, 4]), torch.tensor([1, 1])
    for zero_infinity in (False, True):
        leaf = x.clone().requires_grad_()
        if path == "eager":
            costs = rnnt_lattice.rnnt_loss(leaf, targets, tl, ul, blank=0, reduction="none",
                                           zero_infinity=zero_infinity, backend=backend)
        else:
            costs = _ops.rnnt_costs_traced(leaf, targets, tl, ul, LossOptions(0, True), backend)
            costs = torch.where(torch.isinf(costs), 0.0, costs) if zero_infinity else costs
        costs.sum().backward()
        assert costs[0].item() == (0.0 if zero_infinity else INF) and torch.isfinite(costs[1])
        assert torch.equal(leaf.grad[0], torch.zeros_like(leaf.grad[0]))
        assert leaf.grad[1].abs().sum() > 0
    assert torch.isfinite(rnnt_lattice.rnnt_loss(x.double(), targets, tl, ul, blank=0,
                                                 reduction="none", backend=backend)).all()
