"""The Numba backend on every topology (math.md section 9) against the generic reference
(``reference.costs_and_grad_generic``, itself checked against path enumeration in
test_topology.py): losses and gradients for every option (fused / log-prob, FastEmit,
clamp, sigma, delay penalty, k2 boundary, in place), ragged lengths with NaN-poisoned
padding, signed upstream gradients, float64 and float32; the path oracle on tiny
lattices; impossible alignments; NaN rules; the packed and pruned row layouts
(``node_rows``). The regular topology runs both the regular fast path
(``cpu.uses_regular_fast_path``) and the generic kernels ("regular_generic": the same
logits as rows with the identity ``node_rows``, which the fast path does not take), and
the two give the same bits."""
from __future__ import annotations

import math

import pytest
import torch

from rnnt_lattice import _layout, cpu, reference, topology
from rnnt_lattice._rules import scale_upstream
from rnnt_lattice._types import LossOptions
from support.cases import Case, rel_err, upstream_weights
from support.oracle import topology_batch_grad
from support.cases import TOPOLOGY as CASES
from support.topologies import OPTIONS, TOPOLOGIES, make_topo_inputs

# Relative to the largest loss / gradient entry (at least 1). float64: the rounding of a
# few hundred operations. float32 inputs (the lattice in float64 on both sides): the
# reference rounds p S - gamma in float32, the kernels in float64.
TOL = {torch.float64: 1e-10, torch.float32: 4 * 2.0**-23 * 8}


def numba_loss(logits, targets, tl, ul, topo, blank, fused=True, clamp=-1.0, fastemit_lambda=0.0,
               sigma=0.0, delay_penalty=0.0, boundary=None, inplace=False, upstream=None,
               node_rows=None, generic=False):
    """``(costs, upstream-scaled gradient)`` through the backend protocol (``_ops``).
    ``generic``: padded logits go in as rows with the identity ``node_rows`` (the generic
    kernels, whatever the topology), the gradient comes back padded."""
    opts = LossOptions(blank=blank, log_softmax=fused, clamp=clamp, fastemit_lambda=fastemit_lambda,
                       inplace_grad=inplace, topology=topo, sigma=sigma, delay_penalty=delay_penalty)
    x = logits.clone()
    if generic:
        node_rows = torch.arange(x[..., 0].numel()).reshape(x.shape[:3])
        x = x.view(-1, x.shape[-1])
    assert not (generic and cpu.uses_regular_fast_path(opts, boundary, node_rows))
    costs, saved, state = cpu.loss_forward(x, targets, tl, ul, opts, True, boundary, node_rows)
    up = torch.ones(len(tl), dtype=torch.float64) if upstream is None else upstream
    grad = cpu.loss_backward(saved, state, up, opts)
    if inplace:
        assert grad.data_ptr() == x.data_ptr()
    grad = grad.view(logits.shape)
    assert grad.dtype == logits.dtype
    return costs, grad


def reference_loss(logits, targets, tl, ul, topo, blank, fused=True, boundary=None, upstream=None,
                   **kw):
    loss, grad = reference.costs_and_grad(logits, targets, tl, ul, topo, blank, fused,
                                                  boundary=boundary, **kw)
    if upstream is not None:
        grad = scale_upstream(grad, upstream.to(grad.dtype)[:, None, None, None])
    return loss, grad


# Every topology, and the regular one through the generic kernels too.
PATHS = list(TOPOLOGIES) + ["regular_generic"]


def _path(topo_name):
    """``(topology name, generic)`` of a name of ``PATHS``."""
    return ("regular", True) if topo_name == "regular_generic" else (topo_name, False)


@pytest.mark.parametrize("opt", list(OPTIONS) + ["inplace", "inplace_logprob"])
@pytest.mark.parametrize("topo_name", PATHS)
def test_matches_reference(topo_name, opt):
    """Every case (ragged, U=0, T=1, T=0, infeasible rows) in float64, signed upstream;
    "regular" runs the regular fast path where the options allow it (no sigma, delay
    penalty or boundary), "regular_generic" the generic kernels everywhere."""
    topo_name, generic = _path(topo_name)
    kw = dict(OPTIONS.get(opt, {}))
    fused = kw.pop("fused", opt != "inplace_logprob")
    use_boundary = kw.pop("boundary", False)
    for case in CASES:
        logits, targets, tl, ul, topo, blank, bnd = make_topo_inputs(
            case, topo_name, fused=fused, boundary=use_boundary)
        up = upstream_weights(case.B)
        want_loss, want_grad = reference_loss(logits, targets, tl, ul, topo, blank, fused, bnd,
                                              up, **kw)
        loss, grad = numba_loss(logits, targets, tl, ul, topo, blank, fused, boundary=bnd,
                                inplace=opt.startswith("inplace"), upstream=up,
                                generic=generic, **kw)
        assert loss.dtype == torch.float64
        assert rel_err(loss, want_loss) <= TOL[torch.float64], case.name
        assert rel_err(grad, want_grad) <= TOL[torch.float64], case.name
        assert not torch.isnan(grad).any(), "NaN padding leaked into the gradient"


def test_regular_fast_path_is_chosen():
    """The regular fast path takes the plain regular loss on padded logits, nothing else."""
    plain = LossOptions(blank=0)
    ids = torch.zeros(1, 2, 3, dtype=torch.int64)
    assert cpu.uses_regular_fast_path(plain, None, None)
    assert cpu.uses_regular_fast_path(LossOptions(blank=0, topology=topology.regular(), clamp=0.1,
                                                  fastemit_lambda=0.2, log_softmax=False,
                                                  inplace_grad=True), None, None)
    assert not cpu.uses_regular_fast_path(LossOptions(blank=0, sigma=0.1), None, None)
    assert not cpu.uses_regular_fast_path(LossOptions(blank=0, delay_penalty=0.1), None, None)
    assert not cpu.uses_regular_fast_path(LossOptions(blank=0, topology=topology.modified()),
                                          None, None)
    assert not cpu.uses_regular_fast_path(plain, torch.tensor([[0, 0, 1, 2]]), None)
    assert not cpu.uses_regular_fast_path(plain, None, ids)


def test_regular_fast_path_is_chosen_by_the_arcs_not_the_name():
    """The fast path computes the arcs of ``topology.regular()``, so it is chosen by them:
    a topology named "regular" with modified's arcs runs the generic kernels and gives
    modified's losses and gradients (every case, against the reference), and regular's arcs
    under another name run the fast path."""
    impostor = topology.Topology("regular", topology.modified().kinds)
    renamed = topology.Topology("plain", topology.regular().kinds)
    assert not cpu.uses_regular_fast_path(LossOptions(blank=0, topology=impostor), None, None)
    assert cpu.uses_regular_fast_path(LossOptions(blank=0, topology=renamed), None, None)
    for case in CASES:
        logits, targets, tl, ul, topo, blank, _ = make_topo_inputs(case, "modified")
        want_loss, want_grad = reference_loss(logits, targets, tl, ul, topo, blank)
        loss, grad = numba_loss(logits, targets, tl, ul, impostor, blank)
        assert rel_err(loss, want_loss) <= TOL[torch.float64], case.name
        assert rel_err(grad, want_grad) <= TOL[torch.float64], case.name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("opt", ["fused", "logprob", "fastemit", "clamp", "inplace",
                                 "inplace_logprob"])
def test_regular_fast_path_equals_generic(opt, dtype):
    """The regular fast path and the generic kernels on the same lattice, through the
    identity ``node_rows`` layout and through a k2 boundary equal to the full lattice
    (``[0, 0, U_b, T_b]``), every case, signed upstream: the same losses, bit for bit, and
    the same gradients up to one rounding of the dtype (the fast path computes the blank
    entry in float64 at every node, the generic kernels only where an arc reads it)."""
    kw = dict(OPTIONS.get(opt, {}))
    fused = kw.pop("fused", opt != "inplace_logprob")
    for case in CASES:
        logits, targets, tl, ul, topo, blank, _ = make_topo_inputs(case, "regular", dtype,
                                                                  fused=fused)
        full = torch.stack([torch.zeros_like(ul), torch.zeros_like(tl), ul, tl], 1)
        up = upstream_weights(case.B)
        run = dict(inplace=opt.startswith("inplace"), upstream=up, **kw)
        fast = numba_loss(logits, targets, tl, ul, topo, blank, fused, **run)
        rows = numba_loss(logits, targets, tl, ul, topo, blank, fused, generic=True, **run)
        bound = numba_loss(logits, targets, tl, ul, topo, blank, fused, boundary=full, **run)
        for other in (rows, bound):
            assert torch.equal(fast[0], other[0]), case.name
            assert rel_err(fast[1], other[1]) <= torch.finfo(dtype).eps, case.name


@pytest.mark.parametrize("topo_name", PATHS)
@pytest.mark.parametrize("opt", ["fused", "logprob", "all_logprob", "clamp"])
def test_float32(topo_name, opt):
    topo_name, generic = _path(topo_name)
    kw = dict(OPTIONS[opt], fastemit_lambda=0.1, sigma=0.05)
    fused = kw.pop("fused", True)
    case = Case("f32", (4, 3, 5), (2, 3, 1), 6, 0, T=5, U=3)
    logits, targets, tl, ul, topo, blank, bnd = make_topo_inputs(
        case, topo_name, torch.float32, seed=3, fused=fused, boundary=kw.pop("boundary", False))
    up = upstream_weights(case.B)
    want_loss, want_grad = reference_loss(logits.double(), targets, tl, ul, topo, blank, fused,
                                          bnd, up, **kw)
    loss, grad = numba_loss(logits, targets, tl, ul, topo, blank, fused, boundary=bnd,
                            upstream=up, generic=generic, **kw)
    assert loss.dtype == torch.float32
    assert rel_err(loss, want_loss) <= TOL[torch.float32]
    assert rel_err(grad, want_grad) <= TOL[torch.float32]


@pytest.mark.parametrize("topo_name", list(TOPOLOGIES))
def test_matches_enumeration(topo_name):
    """The tiny-lattice path oracle directly (no reference in between)."""
    case = Case("oracle", (4, 2, 3), (2, 1, 0), 6, 0, T=5, U=3)
    for fused, kw in ((True, dict(fastemit_lambda=0.3, clamp=0.2, delay_penalty=0.1)),
                      (False, dict(sigma=0.05, boundary=True))):
        logits, targets, tl, ul, topo, blank, bnd = make_topo_inputs(
            case, topo_name, fused=fused, boundary=kw.pop("boundary", False))
        want_loss, want_grad = topology_batch_grad(logits, targets, tl, ul, topo, blank, fused,
                                                   boundary=bnd, **kw)
        loss, grad = numba_loss(logits, targets, tl, ul, topo, blank, fused, boundary=bnd, **kw)
        assert rel_err(loss, want_loss) <= TOL[torch.float64]
        assert rel_err(grad, want_grad) <= TOL[torch.float64]


@pytest.mark.parametrize("topo_name,T,U", [
    ("modified", 2, 3), ("constrained", 1, 2), ("one_sym", 3, 3), ("tdt13", 2, 2),
    ("regular", 0, 0), ("multiblank", 0, 2)])
def test_impossible_alignments(topo_name, T, U):
    """No path: +inf and an exactly zero gradient, next to a feasible sequence."""
    case = Case("infeasible", (T, 6), (U, 1), 6, 0)
    logits, targets, tl, ul, topo, blank, _ = make_topo_inputs(case, topo_name)
    loss, grad = numba_loss(logits, targets, tl, ul, topo, blank, fastemit_lambda=0.3)
    assert loss[0] == math.inf and (grad[0] == 0).all()
    assert torch.isfinite(loss[1]) and (grad[1] != 0).any()


@pytest.mark.parametrize("poison", ["nan", "inf"])
@pytest.mark.parametrize("topo_name", ["constrained", "multiblank", "tdt012"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logprob"])
def test_nan_rules(topo_name, fused, poison):
    """math.md 8.1: a NaN read by an arc makes that sequence NaN (fused: every region row;
    log-prob: its arc entries), the other sequence is untouched, and a zero upstream
    gives an exactly zero gradient even for the NaN sequence. A +inf is read as a NaN
    (fused: its row's softmax is undefined; log-prob: an invalid log-prob)."""
    case = Case("nan", (4, 3), (2, 2), 6, 0)
    logits, targets, tl, ul, topo, blank, _ = make_topo_inputs(case, topo_name, seed=9, fused=fused)
    x = logits.clone()
    x[0, 1, 1, blank] = float("nan")
    want_loss, want_grad = reference_loss(x, targets, tl, ul, topo, blank, fused)
    x[0, 1, 1, blank] = float(poison)
    loss, grad = numba_loss(x, targets, tl, ul, topo, blank, fused)
    assert torch.isnan(loss[0]) and torch.isfinite(loss[1])
    assert torch.equal(torch.isnan(grad), torch.isnan(want_grad))
    assert rel_err(grad[1], want_grad[1]) <= TOL[torch.float64]
    _, grad = numba_loss(x, targets, tl, ul, topo, blank, fused,
                         upstream=torch.tensor([0.0, -2.0], dtype=torch.float64))
    assert (grad[0] == 0).all() and rel_err(grad[1], -2 * want_grad[1]) <= TOL[torch.float64]


@pytest.mark.parametrize("topo_name", ["tdt012", "regular", "regular_generic"])
def test_second_backward_is_bit_identical(topo_name):
    """Without the stored exps (retain_graph), the gradient is recomputed from the logits
    with the same code: the same bits."""
    topo_name, generic = _path(topo_name)
    case = Case("twice", (5, 3), (2, 3), 7, 0)
    logits, targets, tl, ul, topo, blank, _ = make_topo_inputs(case, topo_name, torch.float32)
    opts = LossOptions(blank=blank, topology=topo, clamp=0.1, fastemit_lambda=0.2)
    node_rows = None
    if generic:
        node_rows = torch.arange(logits[..., 0].numel()).reshape(logits.shape[:3])
        logits = logits.view(-1, logits.shape[-1])
    _, saved, state = cpu.loss_forward(logits, targets, tl, ul, opts, True, None, node_rows)
    up = upstream_weights(case.B)
    first = cpu.loss_backward(saved, state, up, opts).clone()
    second = cpu.loss_backward(saved, state, up, opts)
    assert torch.equal(first, second)


# --------------------------------------------------------------------------- layouts
def _packed(logits, tl, ul):
    """Rows of the nodes ``t < T_b, u <= U_b`` in (b, t, u) order, and their ``node_rows``."""
    B, T, U1, V = logits.shape
    t = torch.arange(T)[None, :, None]
    u = torch.arange(U1)[None, None, :]
    on = (t < tl[:, None, None]) & (u <= ul[:, None, None])
    node_rows = torch.full((B, T, U1), -1, dtype=torch.int64)
    node_rows[on] = torch.arange(int(on.sum()))
    return logits[on], node_rows, on


@pytest.mark.parametrize("topo_name", ["regular", "constrained", "tdt012", "multiblank"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logprob"])
def test_packed_rows(topo_name, fused):
    case = Case("packed", (5, 2, 4), (3, 0, 2), 7, 0, T=6, U=4)
    logits, targets, tl, ul, topo, blank, _ = make_topo_inputs(case, topo_name, fused=fused)
    up = upstream_weights(case.B)
    kw = dict(fastemit_lambda=0.2, clamp=0.3)
    want_loss, want_grad = numba_loss(logits, targets, tl, ul, topo, blank, fused, upstream=up, **kw)
    rows, node_rows, on = _packed(logits, tl, ul)
    for inplace in (False, True):
        loss, grad = numba_loss(rows, targets, tl, ul, topo, blank, fused, upstream=up,
                                node_rows=node_rows, inplace=inplace, **kw)
        assert torch.equal(loss, want_loss)
        assert rel_err(grad, want_grad[on]) <= TOL[torch.float64]


def _pruned(logits, tl, ul, R):
    """Windows of R label positions per frame (B*T*R rows), around the diagonal of each
    lattice: row ``(b*T + t)*R + k`` is node ``(t, ranges[b, t, k])``."""
    B, T, U1, V = logits.shape
    t = torch.arange(T)[None, :]
    start = (t * (ul[:, None] + 1)) // tl.clamp(min=1)[:, None] - R // 2
    start = start.clamp(0, U1 - R)                                        # (B, T)
    ranges = start[..., None] + torch.arange(R)                           # (B, T, R)
    rows = torch.gather(logits, 2, ranges[..., None].expand(B, T, R, V)).reshape(B * T * R, V)
    node_rows = torch.full((B, T, U1), -1, dtype=torch.int64)
    node_rows.scatter_(2, ranges, torch.arange(B * T * R).reshape(B, T, R))
    return rows, node_rows, ranges


@pytest.mark.parametrize("topo_name", ["regular", "constrained", "tdt012", "multiblank"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logprob"])
def test_pruned_rows(topo_name, fused):
    """A pruned window is the padded lattice whose rows outside the window are all -inf
    (their arcs are impossible): same loss, and the window rows' gradient."""
    R = 3
    case = Case("pruned", (6, 4, 5), (4, 2, 5), 7, 0, T=6, U=5)
    logits, targets, tl, ul, topo, blank, _ = make_topo_inputs(case, topo_name, seed=5, fused=fused)
    rows, node_rows, ranges = _pruned(logits, tl, ul, R)
    window = node_rows >= 0
    region = _layout.node_mask(tl, ul, *node_rows.shape[1:])
    masked = logits.masked_fill((region & ~window)[..., None], -math.inf)
    up = upstream_weights(case.B)
    want_loss, want_grad = reference_loss(masked, targets, tl, ul, topo, blank, fused, upstream=up,
                                          fastemit_lambda=0.2, clamp=0.3)
    assert torch.isfinite(want_loss).any()
    loss, grad = numba_loss(rows, targets, tl, ul, topo, blank, fused, upstream=up,
                            node_rows=node_rows, fastemit_lambda=0.2, clamp=0.3)
    assert rel_err(loss, want_loss) <= TOL[torch.float64]
    B, T = ranges.shape[:2]
    want_rows = torch.gather(want_grad, 2, ranges[..., None].expand(B, T, R, want_grad.shape[-1]))
    assert rel_err(grad, want_rows.reshape(grad.shape)) <= TOL[torch.float64]
    assert not torch.isnan(grad).any()


@pytest.mark.parametrize("topo_name", ["modified", "tdt012", "multiblank"])
def test_public_api_runs_numba(topo_name):
    """``backend="numba"`` computes every topology (no fallback, no warning) and agrees
    with ``backend="torch"``."""
    import warnings
    import rnnt_lattice
    case = Case("api", (5, 4), (2, 3), 6, 0)
    logits, targets, tl, ul, topo, blank, _ = make_topo_inputs(case, topo_name)
    out = {}
    for backend in ("numba", "torch"):
        x = logits.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            if topo_name == "modified":
                loss = rnnt_lattice.rnnt_loss(x, targets, tl, ul, blank=blank, rnnt_type="modified",
                                              reduction="none", backend=backend)
            elif topo_name == "tdt012":
                loss = rnnt_lattice.tdt_loss(x, targets, tl, ul, blank=blank, durations=[0, 1, 2],
                                             reduction="none", backend=backend)
            else:
                loss = rnnt_lattice.multiblank_rnnt_loss(x, targets, tl, ul, blank=blank,
                                                         big_blank_durations=[2, 3],
                                                         reduction="none", backend=backend)
        (loss * upstream_weights(case.B)).sum().backward()
        out[backend] = (loss.detach(), x.grad)
    assert rel_err(out["numba"][0], out["torch"][0]) <= TOL[torch.float64]
    assert rel_err(out["numba"][1], out["torch"][1]) <= TOL[torch.float64]
