"""The public losses of every topology — ``rnnt_loss(rnnt_type=..., delay_penalty=...,
boundary=...)``, ``tdt_loss``, ``multiblank_rnnt_loss`` and their modules — against the
independent path-enumerating oracle (losses and gradients through autograd, signed
upstream weights), plus their argument checks, the backend choice (kernels for the regular
lattice and every other one: ``auto`` uses the kernels), NeMo's omega, in-place gradients and ``torch.compile``."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import rnnt_lattice
from support import backends
from support import cases
from support.cases import upstream_weights
from support.oracle import topology_batch_grad
from support.topologies import make_topo_inputs

CASES = cases.VARIANTS

# topology name in test_topology -> how the public API spells it
PUBLIC = {
    "regular": ("rnnt_loss", dict(rnnt_type="regular")),
    "modified": ("rnnt_loss", dict(rnnt_type="modified")),
    "constrained": ("rnnt_loss", dict(rnnt_type="constrained")),
    "one_sym": ("rnnt_loss", dict(rnnt_type="one_sym_per_frame")),
    "multiblank": ("multiblank_rnnt_loss", dict(big_blank_durations=[2, 3])),
    "tdt012": ("tdt_loss", dict(durations=[0, 1, 2])),
    "tdt13": ("tdt_loss", dict(durations=[1, 3])),
}

OPTIONS = {
    "plain": dict(),
    "fastemit_clamp": dict(fastemit_lambda=0.5, clamp=0.05),
    "sigma": dict(sigma=0.05),                       # tdt / multi-blank only
    "delay_boundary": dict(delay_penalty=0.3, boundary=True),   # rnnt_loss only
}

TOL = 1e-10


def _applies(fn_name, opt):
    if opt == "sigma":
        return fn_name != "rnnt_loss"
    if opt == "delay_boundary":
        return fn_name == "rnnt_loss"
    return True


def _public_case(case, topo_name, opt):
    """``(fn_name, extra, kw, (logits, targets, tl, ul, topo, blank))`` of a case, a topology
    of PUBLIC and an option set of OPTIONS (its boundary made for the case's lengths)."""
    fn_name, extra = PUBLIC[topo_name]
    kw = dict(OPTIONS[opt])
    *inputs, bnd = make_topo_inputs(case, topo_name, boundary=kw.pop("boundary", False))
    if bnd is not None:
        kw["boundary"] = bnd
    return fn_name, extra, kw, tuple(inputs)


def call(fn_name, logits, targets, tl, ul, blank, extra, **kw):
    fn = getattr(rnnt_lattice, fn_name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)      # the reference fallback notice
        if fn_name == "rnnt_loss":
            return fn(logits, targets, tl, ul, blank, reduction="none", **extra, **kw)
        return fn(logits, targets, tl, ul, blank=blank, reduction="none", **extra, **kw)


def rel(got, want):
    fin = torch.isfinite(want)
    assert torch.equal(torch.isinf(got), torch.isinf(want)), (got, want)
    scale = max(1.0, float(want[fin].abs().max())) if fin.any() else 1.0
    return float((got[fin] - want[fin]).abs().max()) / scale if fin.any() else 0.0


@pytest.mark.parametrize("topo_name, opt", [(t, o) for t in PUBLIC for o in OPTIONS
                                             if _applies(PUBLIC[t][0], o)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_public_losses_match_enumeration(case, topo_name, opt):
    fn_name, extra, kw, (logits, targets, tl, ul, topo, blank) = _public_case(case, topo_name, opt)
    want_loss, want_grad = topology_batch_grad(logits, targets, tl, ul, topo, blank, True, **kw)
    leaf = logits.clone().requires_grad_()
    costs = call(fn_name, leaf, targets, tl, ul, blank, extra, **kw)
    w = upstream_weights(case.B)
    (costs * w).sum().backward()
    assert rel(costs.detach(), want_loss) <= TOL
    want = want_grad * w[:, None, None, None]
    assert float((leaf.grad - want).abs().max()) <= TOL * max(1.0, float(want.abs().max()))
    assert torch.isfinite(leaf.grad).all()          # NaN padding never leaks


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("rnnt_type, paths, logv", [
    ("regular", lambda T, U: math.comb(T - 1 + U, U), lambda T, U: T + U),
    ("modified", lambda T, U: math.comb(T, U), lambda T, U: T),
    ("constrained", lambda T, U: math.comb(T, U), lambda T, U: T + U),
    ("one_sym_per_frame", lambda T, U: math.comb(T - 1, U), lambda T, U: T),
])
def test_uniform_closed_forms(rnnt_type, paths, logv, backend):
    """Zero logits (probability 1/V everywhere): log P = log(#paths) - (#arc reads) log V
    (docs/variants.md A.2 and C.2), for every (T, U) up to (6, 5) in one ragged batch; infeasible
    lengths give +inf and a zero gradient."""
    V = 5
    shapes = [(T, U) for T in range(1, 7) for U in range(0, 6)]
    B, Tm, Um = len(shapes), 6, 5
    tl = torch.tensor([s[0] for s in shapes])
    ul = torch.tensor([s[1] for s in shapes])
    logits = torch.zeros(B, Tm, Um + 1, V, dtype=torch.float64, requires_grad=True)
    targets = torch.ones(B, Um, dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        loss = rnnt_lattice.rnnt_loss(logits, targets, tl, ul, blank=0, rnnt_type=rnnt_type,
                                      reduction="none", backend=backend)
    loss.sum().backward()
    for b, (T, U) in enumerate(shapes):
        n = paths(T, U)
        if n == 0:
            assert loss[b] == math.inf and (logits.grad[b] == 0).all(), (rnnt_type, T, U)
        else:
            want = -(math.log(n) - logv(T, U) * math.log(V))
            assert abs(loss[b].item() - want) <= 1e-12 * max(1.0, abs(want)), (rnnt_type, T, U)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_nemo_tdt_vector(backend):
    """NeMo's TDT test (docs/variants.md B.2): cost 4.155739 = -log(3w^4 + 6w^3 + 2w^2) with
    w = exp(-0.05)/12, and the gradient row at (0, 0, 0) (token part, then the duration
    logits through their log_softmax); the whole gradient equals the path oracle's."""
    logits = torch.zeros(1, 3, 2, 7, dtype=torch.float64, requires_grad=True)
    args = (torch.tensor([[0]]), torch.tensor([3]), torch.tensor([1]))
    loss = rnnt_lattice.tdt_loss(logits, *args, blank=3, durations=[0, 1, 2], sigma=0.05,
                                 backend=backend)
    loss.backward()
    w = math.exp(-0.05) / 12
    assert abs(float(loss.detach()) + math.log(3 * w**4 + 6 * w**3 + 2 * w**2)) <= 1e-12
    assert abs(float(loss.detach()) - 4.155739) <= 1e-6
    want = torch.tensor([-0.649628, 0.25, 0.25, 0.149628, 0.267258, -0.167926, -0.099332],
                        dtype=torch.float64)
    torch.testing.assert_close(logits.grad[0, 0, 0], want, rtol=0, atol=1e-6)
    _, want_grad = topology_batch_grad(logits.detach(), *args, rnnt_lattice.topology.tdt([0, 1, 2]),
                                       3, True, sigma=0.05)
    torch.testing.assert_close(logits.grad, want_grad, rtol=0, atol=1e-12)


def test_infeasible_lengths_give_inf_and_zero_gradient():
    """modified needs T >= U, one_sym_per_frame T >= U + 1: otherwise +inf, zero gradient
    (or 0 with zero_infinity)."""
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    targets, tl, ul = torch.tensor([[1, 2, 3], [1, 2, 3]]), torch.tensor([2, 3]), torch.tensor([3, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for rnnt_type, finite in (("modified", [False, True]), ("one_sym_per_frame", [False, False])):
            x.grad = None
            costs = rnnt_lattice.rnnt_loss(x, targets, tl, ul, blank=0, rnnt_type=rnnt_type,
                                           reduction="none")
            assert torch.isfinite(costs).tolist() == finite
            assert (costs[~torch.isfinite(costs)] == float("inf")).all()
            costs.sum().backward() if all(finite) else costs[torch.isfinite(costs)].sum().backward()
            assert torch.isfinite(x.grad).all() and (x.grad[0] == 0).all()
            zi = rnnt_lattice.rnnt_loss(x, targets, tl, ul, blank=0, rnnt_type=rnnt_type,
                                        reduction="none", zero_infinity=True)
            assert zi[0] == 0


def test_backend_choice():
    """Every topology, per-arc term and layout has kernels: "auto" picks Numba on CPU with
    no fallback warning, and agrees with the vectorised reference."""
    x = torch.randn(1, 4, 3, 5, dtype=torch.float64)
    args = (torch.tensor([[1, 2]]), torch.tensor([4]), torch.tensor([2]))
    for kw in (dict(rnnt_type="constrained"), dict(delay_penalty=0.1),
               dict(boundary=torch.tensor([[0, 1, 2, 4]]))):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            a = rnnt_lattice.rnnt_loss(x, *args, blank=0, **kw)
            b = rnnt_lattice.rnnt_loss(x, *args, blank=0, backend="numba", **kw)
        c = rnnt_lattice.rnnt_loss(x, *args, blank=0, backend="torch", **kw)
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)


def test_regular_rnnt_type_is_the_kernel_loss():
    """rnnt_type="regular" with delay 0 is exactly the default call (Numba kernels)."""
    x = torch.randn(2, 5, 3, 6)
    args = (torch.tensor([[1, 2], [3, 0]]), torch.tensor([5, 3]), torch.tensor([2, 1]))
    a = rnnt_lattice.rnnt_loss(x, *args, blank=0, reduction="none")
    b = rnnt_lattice.rnnt_loss(x, *args, blank=0, reduction="none", rnnt_type="regular")
    assert torch.equal(a, b)


@pytest.mark.parametrize("fn_name, kw, match", [
    ("rnnt_loss", dict(rnnt_type="hat"), "rnnt_type must be one of"),
    ("rnnt_loss", dict(delay_penalty=-0.1), "delay_penalty must be >= 0"),
    ("rnnt_loss", dict(delay_penalty=float("inf")), "delay_penalty must be finite"),
    ("rnnt_loss", dict(boundary=torch.zeros(2, 3, dtype=torch.int64)), r"boundary must have shape \(B, 4\)"),
    ("rnnt_loss", dict(boundary=torch.zeros(2, 4)), "boundary must be int32 or int64"),
    ("rnnt_loss", dict(boundary=[[0, 0, 1, 4]] * 2), "boundary must be a torch.Tensor"),
    ("rnnt_loss", dict(boundary=torch.tensor([[0, 0, 2, 5], [0, 0, 1, 3]])), r"boundary\[0\].*end_frame <= logit_lengths"),
    ("rnnt_loss", dict(boundary=torch.tensor([[0, 0, 2, 4], [2, 0, 1, 3]])), r"boundary\[1\].*begin_symbol <= end_symbol"),
    ("tdt_loss", dict(blank=5, durations=[2, 1]), "durations must be strictly ascending"),
    ("tdt_loss", dict(blank=5, durations=[0]), "durations needs a duration >= 1"),
    ("tdt_loss", dict(blank=5, durations=[-1, 1]), "durations must all be >= 0"),
    ("tdt_loss", dict(blank=5, durations=[0, 1.5]), "durations must hold ints"),
    ("tdt_loss", dict(blank=0, durations=[0, 1]), "the blank must be the last token"),
    ("tdt_loss", dict(blank=5, durations=[0, 1], omega=1.5), r"omega must be <= 1 \(valid range \[0, 1\]\)"),
    ("tdt_loss", dict(blank=5, durations=[0, 1], sigma=-0.05), r"sigma must be >= 0 \(valid range \[0, 1000\]\)"),
    ("multiblank_rnnt_loss", dict(blank=7.0, big_blank_durations=[2]), "blank must be an int, got 7.0"),
    ("multiblank_rnnt_loss", dict(blank=9, big_blank_durations=[2]), r"blank=9 is outside \[-V, V\) = \[-8, 8\)"),
    ("multiblank_rnnt_loss", dict(blank=7, big_blank_durations=[2], sigma=-1.0), "sigma must be >= 0"),
    ("multiblank_rnnt_loss", dict(blank=7, big_blank_durations=[2], logits_3d=True),
     r"logits must have 4 dims \(B, T, U\+1, V\), got 3 dims with shape \(4, 3, 8\)"),
    ("tdt_loss", dict(blank=5, durations=[0, 1], sigma=float("nan")), "sigma must not be NaN"),
    ("multiblank_rnnt_loss", dict(blank=7, big_blank_durations=[1, 2]), "big_blank_durations must all be >= 2"),
    ("multiblank_rnnt_loss", dict(blank=7, big_blank_durations=[-2, 4]), r"big_blank_durations must all be >= 2, got \[-2, 4\]"),
    ("multiblank_rnnt_loss", dict(blank=7, big_blank_durations=[3, 3]), "big_blank_durations must be distinct"),
    ("multiblank_rnnt_loss", dict(blank=0, big_blank_durations=[2]), "leaves no room below it"),
    ("multiblank_rnnt_loss", dict(blank=7, big_blank_durations=[2, 3, 4, 5, 6, 7, 8]),
     r"no room for the 7 big blank\(s\) of big_blank_durations, the blank and a label"),
])
def test_bad_arguments(fn_name, kw, match):
    x = torch.randn(2, 4, 3, 8)
    kw = dict(kw)
    if kw.pop("logits_3d", False):
        x = x[0]
    args = (torch.tensor([[1, 2], [3, 1]]), torch.tensor([4, 3]), torch.tensor([2, 1]))
    fn = getattr(rnnt_lattice, fn_name)
    with pytest.raises(ValueError, match=match):
        if fn_name == "rnnt_loss":
            fn(x, *args, 0, **kw)
        else:
            fn(x, *args, **kw)


@pytest.mark.parametrize("backend", ["torch", "numba", backends.TRITON])
def test_big_blank_durations_in_any_order(backend):
    """NeMo accepts ``big_blank_durations`` in any order, the big blank of duration
    ``d_i`` being class ``blank - 1 - i``: [4, 2] on some logits is [2, 4] on the logits
    with those two classes swapped (losses and gradients). NumPy ints are ints."""
    import numpy as np
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 4, 8, generator=g, dtype=torch.float64)
    args = (torch.tensor([[1, 2, 3], [4, 1, 0]]), torch.tensor([9, 6]), torch.tensor([3, 2]))
    perm = [0, 1, 2, 3, 4, 6, 5, 7]
    a, b = x.clone().requires_grad_(), x[..., perm].clone().requires_grad_()
    la = rnnt_lattice.multiblank_rnnt_loss(a, *args, blank=7, big_blank_durations=np.array([4, 2]),
                                           reduction="none", backend=backend)
    lb = rnnt_lattice.multiblank_rnnt_loss(b, *args, blank=7, big_blank_durations=[2, 4],
                                           reduction="none", backend=backend)
    (la * torch.tensor([1.0, -2.0], dtype=la.dtype)).sum().backward()
    (lb * torch.tensor([1.0, -2.0], dtype=lb.dtype)).sum().backward()
    torch.testing.assert_close(la, lb, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.grad, b.grad[..., perm], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["torch", "numba", backends.TRITON])
def test_multiblank_blank_after_its_big_blanks(backend):
    """ESPnet's layout (its big blanks inserted at the front of the token list, before the
    blank: big blank 4, big blank 2, blank, then the labels) is NeMo's (the labels, then
    the big blanks, the blank last) with the classes permuted: the same losses, and the
    gradients permuted alike (issue 32)."""
    g = torch.Generator().manual_seed(4)
    nemo = torch.randn(2, 9, 4, 8, generator=g, dtype=torch.float64)
    perm = [5, 6, 7, 0, 1, 2, 3, 4]                 # ESPnet's class c is NeMo's perm[c]
    espnet = nemo[..., perm]
    targets = torch.tensor([[1, 2, 3], [4, 1, 0]])  # NeMo's ids; ESPnet's are 3 more
    lengths = (torch.tensor([9, 6]), torch.tensor([3, 2]))
    w = torch.tensor([1.0, -2.0], dtype=torch.float64)
    out = []
    for x, ids, blank in ((nemo, targets, 7), (espnet, targets + 3, 2)):
        x = x.clone().requires_grad_()
        loss = rnnt_lattice.multiblank_rnnt_loss(x, ids, *lengths, blank=blank,
                                                 big_blank_durations=[2, 4], sigma=0.05,
                                                 reduction="none", backend=backend)
        (loss * w).sum().backward()
        out.append((loss, x.grad))
    (l_nemo, g_nemo), (l_espnet, g_espnet) = out
    torch.testing.assert_close(l_espnet, l_nemo, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_espnet, g_nemo[..., perm], rtol=1e-12, atol=1e-12)


def test_tdt_targets_are_tokens_and_multiblank_targets_not_big_blanks():
    x = torch.randn(1, 4, 3, 8)
    tl, ul = torch.tensor([4]), torch.tensor([2])
    # 6 tokens + 2 durations: id 6 is a duration, not a token
    with pytest.raises(ValueError, match=r"targets\[0, 1\] = 6 is outside \[0, V_tok\) = \[0, 6\) "
                       r"\(TDT: the token classes before the durations\)"):
        rnnt_lattice.tdt_loss(x, torch.tensor([[1, 6]]), tl, ul, blank=5, durations=[0, 1])
    with pytest.raises(ValueError, match=r"targets\[0, 0\] = 6 is the class of the arc kind 'big_blank_2'"):
        rnnt_lattice.multiblank_rnnt_loss(x, torch.tensor([[6, 1]]), tl, ul, blank=7,
                                          big_blank_durations=[2, 3])


def test_tdt_omega_samples_the_standard_loss():
    """omega = 1: the standard RNN-T loss of the token logits, zero duration gradient;
    omega = 0: the TDT loss."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 6 + 3, generator=g, dtype=torch.float64)
    args = (torch.tensor([[1, 2], [3, 0]]), torch.tensor([5, 4]), torch.tensor([2, 1]))
    leaf = x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        one = rnnt_lattice.tdt_loss(leaf, *args, blank=5, durations=[0, 1, 2], sigma=0.1, omega=1.0)
        one.backward()
        zero = rnnt_lattice.tdt_loss(x, *args, blank=5, durations=[0, 1, 2], sigma=0.1, omega=0.0)
    std = rnnt_lattice.rnnt_loss(x[..., :6], *args, blank=5)
    assert torch.equal(one.detach(), std) and not torch.equal(zero, std)
    assert (leaf.grad[..., 6:] == 0).all() and (leaf.grad[..., :6] != 0).any()


def test_inplace_grad_on_a_generic_topology():
    x = torch.randn(2, 5, 3, 6, dtype=torch.float64)
    args = (torch.tensor([[1, 2], [3, 0]]), torch.tensor([5, 4]), torch.tensor([2, 1]))
    w = torch.tensor([1.0, -2.0], dtype=torch.float64)
    grads = []
    for inplace in (False, True):
        leaf = x.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            costs = rnnt_lattice.rnnt_loss(leaf, *args, blank=0, rnnt_type="modified",
                                           reduction="none", inplace_grad=inplace)
        (costs * w).sum().backward()
        if inplace:
            assert leaf.grad.data_ptr() == leaf.data_ptr()
        grads.append(leaf.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_modules():
    x = torch.zeros(1, 3, 2, 7, dtype=torch.float64)
    args = (torch.tensor([[0]]), torch.tensor([3]), torch.tensor([1]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        tdt = rnnt_lattice.TDTLoss(blank=3, durations=[0, 1, 2], sigma=0.05)
        assert abs(float(tdt(x, *args)) - 4.155739) <= 1e-6
        assert "durations=[0, 1, 2]" in repr(tdt)
        mb = rnnt_lattice.MultiblankRNNTLoss(blank=6, big_blank_durations=[2, 4], reduction="none")
        y = torch.randn(1, 8, 3, 7, dtype=torch.float64)
        a = mb(y, torch.tensor([[1, 2]]), torch.tensor([8]), torch.tensor([2]))
        b = rnnt_lattice.multiblank_rnnt_loss(y, torch.tensor([[1, 2]]), torch.tensor([8]),
                                              torch.tensor([2]), blank=6,
                                              big_blank_durations=[2, 4], reduction="none")
        assert torch.equal(a, b)
        crit = rnnt_lattice.RNNTLoss(blank=0, rnnt_type="constrained", delay_penalty=0.2,
                                     reduction="none")
        z = torch.randn(2, 5, 3, 6, dtype=torch.float64)
        zargs = (torch.tensor([[1, 2], [3, 0]]), torch.tensor([5, 4]), torch.tensor([2, 1]))
        assert torch.equal(crit(z, *zargs), rnnt_lattice.rnnt_loss(
            z, *zargs, blank=0, rnnt_type="constrained", delay_penalty=0.2, reduction="none"))


@pytest.mark.parametrize("which", ["modified_delay", "tdt"])
def test_torch_compile_fullgraph(which):
    """The custom op carries the topology as (name, durations): a compiled graph gives the
    eager losses and gradients."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    if which == "tdt":
        x = torch.randn(2, 5, 3, 6 + 2, generator=g, dtype=torch.float64)

        def f(z, y, tl, ul):
            return rnnt_lattice.tdt_loss(z, y, tl, ul, blank=5, durations=[1, 2], sigma=0.02,
                                         backend="torch", reduction="sum")
    else:
        x = torch.randn(2, 5, 3, 6, generator=g, dtype=torch.float64)

        def f(z, y, tl, ul):
            return rnnt_lattice.rnnt_loss(z, y, tl, ul, 0, reduction="sum", backend="torch",
                                          rnnt_type="modified", delay_penalty=0.1)
    args = (torch.tensor([[1, 2], [3, 1]]), torch.tensor([5, 4]), torch.tensor([2, 1]))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaf_c, leaf_e = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss_c = compiled(leaf_c, *args)
    loss_c.backward()
    loss_e = f(leaf_e, *args)
    loss_e.backward()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-12, atol=0)
    torch.testing.assert_close(leaf_c.grad, leaf_e.grad, rtol=1e-12, atol=1e-14)
    torch._dynamo.reset()


# --------------------------------------------------------------------------- packed logits
LAYOUT_BACKENDS = backends.CPU


@pytest.mark.parametrize("backend", LAYOUT_BACKENDS)
@pytest.mark.parametrize("topo_name, opt", [(t, o) for t in PUBLIC for o in OPTIONS
                                             if _applies(PUBLIC[t][0], o)])
def test_packed_equals_padded(topo_name, opt, backend):
    """``packed=True`` on ``pack_logits`` of a ragged batch gives the padded batch's losses
    exactly (same recursion, same arithmetic) and its gradient rows, packed."""
    case = CASES[0]
    fn_name, extra, kw, (logits, targets, tl, ul, topo, blank) = _public_case(case, topo_name, opt)
    w = upstream_weights(case.B)
    padded = logits.clone().requires_grad_()
    want = call(fn_name, padded, targets, tl, ul, blank, extra, backend=backend, **kw)
    (want * w).sum().backward()
    packed = rnnt_lattice.pack_logits(logits, tl, ul).requires_grad_()
    assert packed.shape[0] == int((tl * (ul + 1)).sum())
    got = call(fn_name, packed, targets, tl, ul, blank, extra, backend=backend, packed=True, **kw)
    (got * w).sum().backward()
    assert rel(got.detach(), want.detach()) <= 1e-12
    torch.testing.assert_close(packed.grad, rnnt_lattice.pack_logits(padded.grad, tl, ul),
                               rtol=1e-12, atol=1e-12)


def test_packed_errors_name_the_shapes():
    x = torch.randn(10, 5)
    targets, tl, ul = torch.tensor([[1, 2], [3, 0]]), torch.tensor([3, 2]), torch.tensor([2, 1])
    with pytest.raises(ValueError, match=r"sum_b T_b \(U_b\+1\) = 13 rows"):
        rnnt_lattice.rnnt_loss(x, targets, tl, ul, blank=0, packed=True)
    with pytest.raises(ValueError, match=r"packed=True: logits must be rows"):
        rnnt_lattice.rnnt_loss(torch.randn(2, 3, 3, 5), targets, tl, ul, blank=0, packed=True)
    with pytest.raises(ValueError, match=r"logits must have 4 dims"):
        rnnt_lattice.rnnt_loss(torch.randn(13, 5), targets, tl, ul, blank=0)
    with pytest.raises(ValueError, match=r"lengths must be >= 0"):
        rnnt_lattice.rnnt_loss(torch.randn(13, 5), targets, tl, torch.tensor([2, 3]), blank=0,
                               packed=True)
    with pytest.raises(ValueError, match=r"targets\[1, 0\] = 7 is outside"):
        rnnt_lattice.rnnt_loss(torch.randn(13, 5), torch.tensor([[1, 2], [7, 0]]), tl, ul, blank=0,
                               packed=True)


def test_packed_under_torch_compile():
    """The packed row map is built before the custom op (a graph break reads the lengths);
    the compiled loss and gradient equal the eager ones."""
    case = CASES[0]
    logits, targets, tl, ul, topo, blank, _ = make_topo_inputs(case, "regular")
    rows = rnnt_lattice.pack_logits(logits, tl, ul)
    a, b = rows.clone().requires_grad_(), rows.clone().requires_grad_()
    fn = torch.compile(lambda x: rnnt_lattice.rnnt_loss(x, targets, tl, ul, blank, packed=True,
                                                        backend="torch"))
    fn(a).backward()
    rnnt_lattice.rnnt_loss(b, targets, tl, ul, blank, packed=True, backend="torch").backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fn_name, extra, T, U", [
    ("tdt_loss", dict(durations=[0, 1, 2]), 3, (1100, 1030)),    # duration-0 labels: T < U
    ("multiblank_rnnt_loss", dict(big_blank_durations=[2]), 3, (1100, 1030)),
    ("rnnt_loss", dict(rnnt_type="modified"), 1040, (1030, 1026)),  # needs T_b >= U_b
])
def test_long_targets_numba_equals_reference(fn_name, extra, T, U):
    """U > 1024 (no lane cap in the generic kernels): the Numba kernels equal the float64
    reference, ragged, with signed upstream gradients."""
    V = 6
    B = len(U)
    g = torch.Generator().manual_seed(7)
    D = len(extra.get("durations", ()))
    logits = torch.randn(B, T, max(U) + 1, V + D, generator=g, dtype=torch.float64)
    n_big = len(extra.get("big_blank_durations", ()))
    targets = torch.randint(0, V - 1 - n_big, (B, max(U)), generator=g)
    tl, ul = torch.tensor([T, T - 1]), torch.tensor(U)
    w = upstream_weights(B)
    out = {}
    for backend in ("torch", "numba"):
        leaf = logits.clone().requires_grad_()
        costs = call(fn_name, leaf, targets, tl, ul, V - 1, extra, backend=backend)
        (costs * w).sum().backward()
        out[backend] = (costs.detach(), leaf.grad)
    (lt, gt), (ln, gn) = out["torch"], out["numba"]
    assert torch.isfinite(lt).all()
    assert rel(ln, lt) <= TOL
    assert float((gn - gt).abs().max()) <= TOL * max(1.0, float(gt.abs().max()))
