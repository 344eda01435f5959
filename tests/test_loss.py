"""rnnt_loss against the brute-force oracle (tiny lattices) and the pure-PyTorch reference
(larger ones), for every CPU backend: losses and gradients, ragged lengths with
NaN-poisoned padding, signed per-sequence upstream gradients, blank first/last/middle,
T=1, U=0, clamp, FastEmit, reductions, dtypes, non-contiguous inputs, U > 1024."""
from __future__ import annotations

import math

import pytest
import torch

import rnnt_lattice
from rnnt_lattice._types import LossOptions
from support import backends
from support.cases import TINY, Case, make_inputs, rel_err, upstream_weights
from support.oracle import batch_grad, topology_batch_grad
from support.topologies import CONFIDENT, confident, make_topo_inputs

BACKENDS = backends.CPU

# Relative tolerance per dtype of the logits: errors are measured against the float64
# oracle on the same (rounded) input values, relative to the largest loss / gradient.
# float32: the lattice runs in float64, so only the float32 row sums and the gradient's
# rounding remain (a few eps); half types are computed in float32 and rounded back.
TOL = {torch.float64: 1e-10, torch.float32: 4 * 2.0**-23 * 8, torch.float16: 2.0**-10 * 4,
       torch.bfloat16: 2.0**-7 * 4}




def run(backend, logits, targets, logit_lengths, target_lengths, blank, weights=None, **kw):
    """Losses (B,) and the gradient of sum(weights * losses) w.r.t. the logits."""
    x = logits.detach().clone().requires_grad_()
    costs = rnnt_lattice.rnnt_loss(x, targets, logit_lengths, target_lengths, blank,
                                   reduction="none", backend=backend, **kw)
    w = torch.ones(len(costs)) if weights is None else weights
    (costs * w.to(costs.dtype)).sum().backward()
    return costs.detach(), x.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logprob"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", TINY, ids=lambda c: c.name)
def test_matches_brute_force(case, dtype, fused, backend):
    logits, targets, tl, ul, blank = make_inputs(case, dtype)
    if not fused:    # log-prob mode takes log-probabilities (NaN padding kept)
        logits = torch.log_softmax(logits.double(), -1).to(dtype)
    w = upstream_weights(case.B)
    want_loss, want_grad = batch_grad(logits, targets, tl, ul, blank, fused)
    loss, grad = run(backend, logits, targets, tl, ul, blank, w, fused_log_softmax=fused)
    assert loss.dtype == dtype and grad.dtype == dtype
    assert rel_err(loss, want_loss) <= TOL[dtype]
    assert rel_err(grad, want_grad * w[:, None, None, None]) <= TOL[dtype]
    assert not torch.isnan(grad).any(), "NaN padding leaked into the gradient"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logprob"])
@pytest.mark.parametrize("clamp", [-1.0, 0.05, 0.3])
@pytest.mark.parametrize("fastemit_lambda", [0.0, 0.01, 0.5])
def test_clamp_and_fastemit(fastemit_lambda, clamp, fused, backend):
    case = Case("clamp_fe", (4, 3, 2), (2, 3, 1), 6, 2)
    logits, targets, tl, ul, blank = make_inputs(case, seed=3, scale=2.0)
    if not fused:
        logits = torch.log_softmax(logits, -1)
    w = upstream_weights(case.B)
    want_loss, want_grad = batch_grad(logits, targets, tl, ul, blank, fused, clamp, fastemit_lambda)
    loss, grad = run(backend, logits, targets, tl, ul, blank, w, fused_log_softmax=fused,
                     clamp=clamp, fastemit_lambda=fastemit_lambda)
    # The reported loss is the plain -log P whatever lambda is (math.md section 6).
    assert rel_err(loss, want_loss) <= TOL[torch.float64]
    assert rel_err(grad, want_grad * w[:, None, None, None]) <= TOL[torch.float64]
    if clamp > 0:
        assert (grad.abs() <= clamp * w.abs().max() + 1e-12).all()


def test_clamp_binds_both_bounds():
    """The clamp must clip the positive side too (one popular CUDA kernel loses it)."""
    case = Case("peaked", (3,), (1,), 4, 0)
    logits, targets, tl, ul, blank = make_inputs(case, poison=False)
    logits[0, :, :, 3] = 6.0                    # a class that is neither blank nor label
    targets[0, 0] = 1
    for backend in BACKENDS:
        _, g = run(backend, logits, targets, tl, ul, blank)
        assert g.max() > 0.5 and g.min() < -0.5
        _, gc = run(backend, logits, targets, tl, ul, blank, clamp=0.25)
        assert gc.max().item() == pytest.approx(0.25) and gc.min().item() == pytest.approx(-0.25)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_reductions(reduction, backend):
    case = TINY[1]
    logits, targets, tl, ul, blank = make_inputs(case)
    want_loss, want_grad = batch_grad(logits, targets, tl, ul, blank, True)
    x = logits.clone().requires_grad_()
    out = rnnt_lattice.rnnt_loss(x, targets, tl, ul, blank, reduction=reduction, backend=backend)
    up = {"none": upstream_weights(case.B), "sum": torch.tensor(-1.5, dtype=torch.float64),
          "mean": torch.tensor(2.5, dtype=torch.float64)}[reduction]
    out.backward(up)
    if reduction == "none":
        want, scale = want_loss, up[:, None, None, None]
    elif reduction == "sum":
        want, scale = want_loss.sum(), up
    else:
        want, scale = want_loss.mean(), up / case.B
    assert out.shape == want.shape
    assert rel_err(out, want) <= TOL[torch.float64]
    assert rel_err(x.grad, want_grad * scale) <= TOL[torch.float64]


@pytest.mark.parametrize("backend", BACKENDS)
def test_impossible_and_zero_infinity(backend):
    """logit_lengths 0 has no path: +inf loss, zero gradient; zero_infinity zeroes the loss."""
    case = Case("empty", (0, 3, 0), (0, 2, 2), 5, 0, T=3)
    logits, targets, tl, ul, blank = make_inputs(case)
    loss, grad = run(backend, logits, targets, tl, ul, blank, upstream_weights(3))
    assert loss[0] == math.inf and loss[2] == math.inf and math.isfinite(loss[1])
    assert torch.equal(grad[0], torch.zeros_like(grad[0])) and torch.equal(grad[2], torch.zeros_like(grad[2]))
    assert grad[1].abs().sum() > 0
    loss_z, grad_z = run(backend, logits, targets, tl, ul, blank, upstream_weights(3), zero_infinity=True)
    assert loss_z[0] == 0 and loss_z[2] == 0 and loss_z[1] == loss[1]
    assert torch.equal(grad_z, grad)
    x = logits.clone().requires_grad_()
    total = rnnt_lattice.rnnt_loss(x, targets, tl, ul, blank, backend=backend, zero_infinity=True)
    total.backward()
    assert math.isfinite(total.item()) and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_classes_and_nan_isolation(backend):
    """-inf logits are legal (masked classes); a NaN inside one sequence's lattice makes that
    sequence's loss NaN and leaves the other sequences exact."""
    case = Case("mask", (3, 4), (2, 2), 6, 0)
    logits, targets, tl, ul, blank = make_inputs(case)
    masked = targets[0, 0].item()
    free = next(v for v in range(1, 6) if v not in targets[:, :2].flatten().tolist())
    logits[:, :, :, free] = -math.inf
    want_loss, want_grad = batch_grad(logits, targets, tl, ul, blank, True)
    loss, grad = run(backend, logits, targets, tl, ul, blank)
    assert rel_err(loss, want_loss) <= TOL[torch.float64]
    assert rel_err(grad, want_grad) <= TOL[torch.float64]
    assert (grad[..., free] == 0).all()
    # A fully masked label column makes that sequence impossible: +inf, zero gradient.
    lg = logits.clone()
    lg[0, :, :, masked] = -math.inf
    loss, grad = run(backend, lg, targets, tl, ul, blank)
    assert loss[0] == math.inf and torch.equal(grad[0], torch.zeros_like(grad[0]))
    assert rel_err(loss[1:], want_loss[1:]) <= TOL[torch.float64]
    # NaN inside sequence 0's lattice.
    lg = logits.clone()
    lg[0, 1, 1, 2] = float("nan")
    costs = rnnt_lattice.rnnt_loss(lg, targets, tl, ul, blank, reduction="none", backend=backend)
    assert math.isnan(costs[0].item())
    assert rel_err(costs[1:], want_loss[1:]) <= TOL[torch.float64]


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck(backend):
    case = Case("gradcheck", (3, 2), (2, 1), 4, 1)
    logits, targets, tl, ul, blank = make_inputs(case, poison=False)
    for fused in (True, False):
        for fe in (0.0,):
            fn = lambda x: rnnt_lattice.rnnt_loss(x, targets, tl, ul, blank, reduction="none",
                                                  fused_log_softmax=fused, backend=backend)
            x = logits.clone() if fused else torch.log_softmax(logits, -1)
            assert torch.autograd.gradcheck(fn, (x.requires_grad_(),), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_retain_graph_and_no_mutation(backend):
    case = TINY[2]
    logits, targets, tl, ul, blank = make_inputs(case)
    x = logits.clone().requires_grad_()
    costs = rnnt_lattice.rnnt_loss(x, targets, tl, ul, blank, reduction="none", backend=backend)
    w = upstream_weights(case.B)
    (costs * w).sum().backward(retain_graph=True)
    g1 = x.grad.clone()
    x.grad = None
    (costs * -w).sum().backward()
    assert torch.equal(x.grad, -g1), "a second backward must give the (negated) same gradient"
    assert torch.equal(torch.isnan(x.detach()), torch.isnan(logits))
    torch.testing.assert_close(x.detach().nan_to_num(), logits.nan_to_num(), rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logprob"])
def test_inplace_grad(fused, backend):
    """inplace_grad=True writes the same gradient over the logits buffer."""
    case = TINY[1]
    logits, targets, tl, ul, blank = make_inputs(case, torch.float32)
    if not fused:
        logits = torch.log_softmax(logits, -1)
    w = upstream_weights(case.B)
    want_loss, want_grad = run(backend, logits, targets, tl, ul, blank, w, fused_log_softmax=fused)
    x = logits.clone().requires_grad_()
    costs = rnnt_lattice.rnnt_loss(x, targets, tl, ul, blank, reduction="none", fused_log_softmax=fused,
                                   backend=backend, inplace_grad=True)
    (costs * w).sum().backward()
    assert torch.equal(costs.detach(), want_loss)
    torch.testing.assert_close(x.grad, want_grad, rtol=0, atol=TOL[torch.float32])
    assert x.grad.data_ptr() == x.data_ptr()


@pytest.mark.parametrize("backend", backends.ALL)
@pytest.mark.parametrize("loss", ["rnnt", "tdt"])
def test_a_common_offset_costs_no_digits(loss, backend):
    """float32 logits around 1e4 lose nothing but their own rounding: the float32 loss and
    gradient match the oracle on the same rounded values as closely as at 0. (A float32
    log-normaliser, rounded at 1e4's ulp of 1e-3, moved every log-prob and gradient entry
    by about that: the torch backend's did, before its float64 ``lse``.)"""
    case = Case("offset", (5, 3), (3, 0), 7, 0)
    topo_name = "regular" if loss == "rnnt" else "tdt012"
    logits, targets, tl, ul, topo, blank, _ = make_topo_inputs(case, topo_name, seed=11)
    w = upstream_weights(case.B)
    for offset in (0.0, 1e4):
        x32 = (logits + offset).to(torch.float32)       # the rounded values: the oracle's input
        want_loss, want_grad = topology_batch_grad(x32.double(), targets, tl, ul, topo, blank,
                                                   True)
        x = x32.clone().requires_grad_()
        if loss == "rnnt":
            costs = rnnt_lattice.rnnt_loss(x, targets, tl, ul, blank, reduction="none",
                                           backend=backend)
        else:
            costs = rnnt_lattice.tdt_loss(x, targets, tl, ul, blank=blank, durations=[0, 1, 2],
                                          reduction="none", backend=backend)
        (costs * w.to(costs.dtype)).sum().backward()
        assert rel_err(costs, want_loss) <= TOL[torch.float32], offset
        assert rel_err(x.grad, want_grad * w[:, None, None, None]) <= TOL[torch.float32], offset


@pytest.mark.parametrize("backend", backends.ALL)
@pytest.mark.parametrize("inplace", [False, True], ids=["grad", "inplace"])
@pytest.mark.parametrize("topo_name, margin", [("regular", 12.0), ("regular", 20.0),
                                               ("multiblank", 20.0), ("tdt012", 20.0)])
def test_confident_rows_keep_their_digits(topo_name, margin, inplace, backend):
    """A confident model: every row of each sequence's best path favours the class (and
    TDT's duration) that the path reads by ``margin`` nats. float32 losses of 1e-5 and the
    gradient (relative to its own scale, itself ~ rest) match the oracle on the same
    rounded values as closely as for an unsure model, whichever softmax group the path
    reads: the blank and labels, multi-blank's big blanks, TDT's durations. (A float32 row
    sum ``1 + rest`` rounded ``rest`` away, and the gradient entries ``p S - gamma``
    cancelled in float32: at 20 nats losses were off by 4-100% and gradients by 3-35% of
    their scale, by backend, and the Triton backend's big-blank and duration entries by
    12%; docs/benchmarks.md, "Confident rows".)"""
    fn_name, extra = CONFIDENT[topo_name]
    case = Case("confident", (7, 5), (3, 2), 40, 0, T=7, U=3)
    x, y, tl, ul, topo, blank, _ = make_topo_inputs(case, topo_name, seed=23)
    x32 = confident(x, y, tl, ul, topo, blank, margin).float()
    w = upstream_weights(case.B)
    want_loss, want_grad = topology_batch_grad(x32.double(), y, tl, ul, topo, blank, True)
    want_grad = want_grad * w[:, None, None, None]
    z = x32.clone().requires_grad_()
    costs = getattr(rnnt_lattice, fn_name)(z, y, tl, ul, blank=blank, reduction="none",
                                           backend=backend, inplace_grad=inplace, **extra)
    (costs * w.to(costs.dtype)).sum().backward()
    grad = z if inplace else z.grad          # (in place: the logits hold the gradient)
    assert want_loss.max() < (1e-3 if margin > 15 else 0.1)      # confident
    assert ((costs.double() - want_loss).abs() / want_loss).max() <= TOL[torch.float32]
    scale = want_grad.abs().max()
    inside = ~torch.isnan(x32)                # (padding: NaN in place, 0 as a gradient)
    err = (torch.where(inside, grad.detach().double(), 0.0) - want_grad).abs().max()
    assert err / scale <= TOL[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_half_precision(dtype, backend):
    case = TINY[1]
    logits, targets, tl, ul, blank = make_inputs(case, dtype)
    w = upstream_weights(case.B)
    want_loss, want_grad = batch_grad(logits.double(), targets, tl, ul, blank, True)
    loss, grad = run(backend, logits, targets, tl, ul, blank, w)
    assert grad.dtype == dtype
    assert rel_err(loss, want_loss) <= TOL[torch.float32]
    assert rel_err(grad, want_grad * w[:, None, None, None]) <= TOL[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_and_int32(backend):
    case = TINY[3]
    logits, targets, tl, ul, blank = make_inputs(case)
    want_loss, want_grad = batch_grad(logits, targets, tl, ul, blank, True)
    # Store (B, V, T, U+1) and permute: a non-contiguous (B, T, U+1, V) view.
    base = logits.permute(0, 3, 1, 2).contiguous().requires_grad_()
    x = base.permute(0, 2, 3, 1)
    assert not x.is_contiguous()
    t32 = torch.stack([targets, targets], -1)[..., 0]   # a non-contiguous view of the targets
    assert not t32.is_contiguous()
    costs = rnnt_lattice.rnnt_loss(x, t32.to(torch.int32), tl.to(torch.int32), ul.to(torch.int32),
                                   blank, reduction="none", backend=backend)
    costs.sum().backward()
    assert rel_err(costs, want_loss) <= TOL[torch.float64]
    assert rel_err(base.grad.permute(0, 2, 3, 1), want_grad) <= TOL[torch.float64]


def test_module_matches_function():
    case = TINY[1]
    logits, targets, tl, ul, blank = make_inputs(case)
    crit = rnnt_lattice.RNNTLoss(blank=blank, reduction="sum", clamp=0.5, fastemit_lambda=0.1)
    assert "fastemit_lambda=0.1" in repr(crit)
    a = crit(logits, targets, tl, ul)
    b = rnnt_lattice.rnnt_loss(logits, targets, tl, ul, blank, 0.5, "sum", fastemit_lambda=0.1)
    assert torch.equal(a, b)
    # every option of the function, fixed at construction (allow_blank_targets was missing)
    import inspect
    options = set(inspect.signature(rnnt_lattice.rnnt_loss).parameters) - set(
        inspect.signature(rnnt_lattice.RNNTLoss.forward).parameters)
    assert options <= set(inspect.signature(rnnt_lattice.RNNTLoss).parameters)
    y = targets.clone()
    y[0, 0] = blank % logits.shape[-1]
    a = rnnt_lattice.RNNTLoss(blank=blank, allow_blank_targets=True)(logits, y, tl, ul)
    assert torch.equal(a, rnnt_lattice.rnnt_loss(logits, y, tl, ul, blank,
                                                 allow_blank_targets=True))


# --------------------------------------------------------------------------- larger lattices
LARGE = [
    # name, (B, T range, U range, V), blank, dtype
    ("b4_t200_u60_v512_f32", (4, (120, 200), (30, 60), 512), 0, torch.float32),
    ("b4_t80_u30_v300_f64", (4, (40, 80), (10, 30), 300), -1, torch.float64),
    ("b3_t50_u20_v1000_f32_blank_mid", (3, (20, 50), (5, 20), 1000), 500, torch.float32),
]


def random_case(B, T_range, U_range, V, blank, seed):
    g = torch.Generator().manual_seed(seed)
    T_lens = tuple(int(v) for v in torch.randint(T_range[0], T_range[1] + 1, (B,), generator=g))
    U_lens = tuple(int(v) for v in torch.randint(U_range[0], U_range[1] + 1, (B,), generator=g))
    return Case("random", T_lens, U_lens, V, blank, T=T_range[1], U=U_range[1])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logprob"])
@pytest.mark.parametrize("name,dims,blank,dtype", LARGE, ids=[c[0] for c in LARGE])
def test_numba_matches_reference(name, dims, blank, dtype, fused):
    """The Numba kernels against the pure-PyTorch dynamic program run in float64 on the
    same input values, with clamp and FastEmit on."""
    case = random_case(*dims, blank, seed=len(name))
    logits, targets, tl, ul, blank = make_inputs(case, dtype, scale=3.0)
    if not fused:
        logits = torch.log_softmax(logits.double(), -1).to(dtype)
    w = upstream_weights(case.B)
    kw = dict(fused_log_softmax=fused, clamp=0.7, fastemit_lambda=0.02)
    want_loss, want_grad = run("torch", logits.double(), targets, tl, ul, blank, w.double(), **kw)
    loss, grad = run("numba", logits, targets, tl, ul, blank, w, **kw)
    assert rel_err(loss, want_loss) <= TOL[dtype]
    assert rel_err(grad, want_grad) <= TOL[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_targets(backend):
    """U > 1024 (no 1024-lane cap anywhere)."""
    case = Case("long_u", (4, 3), (1100, 1030), 6, 0)
    logits, targets, tl, ul, blank = make_inputs(case, scale=0.5)
    want_loss, want_grad = run("torch", logits, targets, tl, ul, blank)
    loss, grad = run(backend, logits, targets, tl, ul, blank)
    assert torch.isfinite(loss).all()
    assert rel_err(loss, want_loss) <= TOL[torch.float64]
    assert rel_err(grad, want_grad) <= TOL[torch.float64]
    # Each label is emitted exactly once: the label occupations of a column sum to 1, so
    # the gradient on the label entries sums to -(1 - sum p) ... checked via the lattice:
    lat = rnnt_lattice._backends.resolve(backend, logits.device).occupancy(
        logits, targets, tl, ul, LossOptions(blank % case.V, True))
    torch.testing.assert_close(lat.gamma[0, 1, :, :1100].sum(0), torch.ones(1100, dtype=torch.float64))


@pytest.mark.parametrize("backend", BACKENDS + [backends.TRITON])
@pytest.mark.parametrize("with_boundary", [False, True], ids=["lengths", "boundary"])
@pytest.mark.parametrize("clamp,fastemit_lambda", [(-1.0, 0.0), (0.2, 0.5)], ids=["plain", "clamp_fe"])
def test_allow_blank_targets(clamp, fastemit_lambda, with_boundary, backend):
    """k2's semantics: a label equal to the blank reads the blank's column, and its
    gradient adds to the blank arc's on that one entry (the regular Numba path, taken
    without a boundary, writes both); by default such a label is a ValueError."""
    case = Case("blank_labels", (4, 3, 2), (3, 2, 1), 5, 1)
    logits, targets, tl, ul, blank = make_inputs(case)
    targets = targets.clone()
    targets[0, :2] = blank
    targets[1, 1] = blank
    boundary = torch.stack([0 * tl, 0 * tl, ul, tl], 1) if with_boundary else None
    with pytest.raises(ValueError, match=r"targets\[0, 0\] equals the blank id 1"):
        rnnt_lattice.rnnt_loss(logits, targets, tl, ul, blank, backend=backend)
    w = upstream_weights(case.B)
    want_loss, want_grad = batch_grad(logits, targets, tl, ul, blank, True, clamp, fastemit_lambda)
    loss, grad = run(backend, logits, targets, tl, ul, blank, w, clamp=clamp,
                     fastemit_lambda=fastemit_lambda, boundary=boundary, allow_blank_targets=True)
    assert rel_err(loss, want_loss) <= TOL[torch.float64]
    assert rel_err(grad, want_grad * w[:, None, None, None]) <= TOL[torch.float64]


def test_allow_blank_targets_simple_and_pruned():
    """The simple/smoothed losses and the pruned loss take the option too: equal to
    ``rnnt_loss`` on the same lattice (the simple joiner ``am + lm``; windows covering
    every label position)."""
    g = torch.Generator().manual_seed(3)
    B, T, U, V, blank = 2, 4, 3, 5, 0
    am = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    lm = torch.randn(B, U + 1, V, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[0, 2, 0], [3, 0, 4]])
    tl, ul = torch.tensor([4, 3]), torch.tensor([3, 2])
    with pytest.raises(ValueError, match="differ from the blank"):
        rnnt_lattice.rnnt_loss_simple(lm, am, targets, tl, ul, blank=blank)
    logits = am[:, :, None] + lm[:, None]
    full = rnnt_lattice.rnnt_loss(logits, targets, tl, ul, blank, reduction="none",
                                  allow_blank_targets=True)
    want_logits = torch.autograd.grad(full.sum(), logits, retain_graph=True)[0]
    want = torch.autograd.grad(full.sum(), (am, lm))
    for fn, kw in ((rnnt_lattice.rnnt_loss_simple, {}),
                   (rnnt_lattice.rnnt_loss_smoothed, dict(lm_only_scale=0.0, am_only_scale=0.0))):
        loss = fn(lm, am, targets, tl, ul, blank=blank, reduction="none",
                  allow_blank_targets=True, **kw)
        assert rel_err(loss, full) <= 1e-9
        for got, ref in zip(torch.autograd.grad(loss.sum(), (am, lm)), want):
            assert rel_err(got, ref) <= 1e-9
    ranges = torch.arange(U + 1).expand(B, T, U + 1)
    x = logits.detach().requires_grad_()
    pruned = rnnt_lattice.rnnt_loss_pruned(x, targets, ranges, tl, ul, blank=blank,
                                           reduction="none", allow_blank_targets=True)
    pruned.sum().backward()
    assert rel_err(pruned, full) <= TOL[torch.float64]
    assert rel_err(x.grad, want_logits) <= TOL[torch.float64]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_inplace_grad_without_a_graph_leaves_the_logits(mode, backend):
    """``inplace_grad=True`` under ``no_grad`` / ``inference_mode`` (a validation step with
    the training module) on logits that require grad: no gradient is needed, the logits
    stay as they are (Numba stored its exps over them: the Function's
    ``needs_input_grad`` does not see the grad mode), the losses are the same."""
    logits, targets, tl, ul, blank = make_inputs(TINY[1], torch.float32)
    want = rnnt_lattice.rnnt_loss(logits, targets, tl, ul, blank, reduction="none",
                                  backend=backend)
    x = logits.clone().requires_grad_()
    with getattr(torch, mode)():
        for loss in (lambda: rnnt_lattice.rnnt_loss(x, targets, tl, ul, blank, reduction="none",
                                                    backend=backend, inplace_grad=True),
                     lambda: rnnt_lattice.RNNTLoss(blank, reduction="none", backend=backend,
                                                   inplace_grad=True)(x, targets, tl, ul)):
            assert torch.equal(loss(), want)
    torch.testing.assert_close(x.detach(), logits, rtol=0, atol=0, equal_nan=True)  # (NaN padding)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_grad_refuses_a_node_that_saved_the_logits_after_the_forward(backend):
    """The backward's write bumps the logits' version too (Numba stored its exps there in
    the forward, a first bump): a node that saved them after the forward and runs its
    backward after the loss's is refused, not handed the gradient's values."""
    logits, targets, tl, ul, blank = make_inputs(TINY[1], torch.float32)
    x = logits.clone().requires_grad_()
    costs = rnnt_lattice.rnnt_loss(x, targets, tl, ul, blank, reduction="none",
                                   backend=backend, inplace_grad=True)
    square = x * x                                         # saves x, as it is now
    costs.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        square.sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batched_backward(backend):
    """``autograd.grad(..., is_grads_batched=True)`` runs the backward under vmap: the
    kernels' backends refuse it with a NotImplementedError that says so (it was
    "Batching rule not implemented for aten::detach"); the torch
    backend's operations batch, and give each vector's gradient."""
    logits, targets, tl, ul, blank = make_inputs(TINY[1], torch.float64)
    x = logits.clone().requires_grad_()
    costs = rnnt_lattice.rnnt_loss(x, targets, tl, ul, blank, reduction="none", backend=backend)
    vectors = torch.eye(costs.shape[0], dtype=costs.dtype)
    if backend == "torch":
        (batched,) = torch.autograd.grad(costs, x, vectors, is_grads_batched=True,
                                         retain_graph=True)
        for b, v in enumerate(vectors):
            (one,) = torch.autograd.grad(costs, x, v, retain_graph=True)
            torch.testing.assert_close(batched[b], one, equal_nan=True)
    else:
        with pytest.raises(NotImplementedError, match="is_grads_batched"):
            torch.autograd.grad(costs, x, vectors, is_grads_batched=True)


@pytest.mark.parametrize("backend", ["auto"] + backends.ALL)
def test_occupations_stay_in_0_1_for_huge_logits(backend):
    """Float64 logits of magnitude 1e17 (legal, finite; the loss ~1e17): the exponent of an
    occupation, ``alpha + w + beta - log P``, is <= 0 but for rounding, which at that
    magnitude reaches hundreds. Every occupation stays in [0, 1] and every gradient entry
    in [-1, 1]: the Numba kernels' exp (valid for x <= 0) gave finite garbage up to 1e55
    and negative occupations, the others inf."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 6, 5, 5, generator=g, dtype=torch.float64) * 1e17
    y = torch.randint(1, 5, (2, 4), generator=g)
    tl, ul = torch.tensor([6, 5]), torch.tensor([4, 3])
    leaf = x.clone().requires_grad_()
    loss = rnnt_lattice.rnnt_loss(leaf, y, tl, ul, blank=0, reduction="sum", backend=backend)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(leaf.grad).all()
    assert leaf.grad.abs().max() <= 1.0 + 1e-12
    occ = rnnt_lattice.occupancy(x, y, tl, ul, blank=0, backend=backend)
    assert occ.gamma.min() >= 0.0 and occ.gamma.max() <= 1.0
