"""The Triton backend, run on CPU tensors through the Triton interpreter.

Every kernel (row pass, alpha/beta wavefront in both semirings, occupations, fused
gradient) is compared with the float64 pure-PyTorch reference and with the Numba CPU
path. Lattices are tiny (the interpreter runs each program in Python) and the tile sizes
are lowered (``BLOCK_U = 2``, ``BLOCK_V = 4``) so that they still span several blocks.

``TRITON_INTERPRET`` is read by Triton when a kernel is *decorated*, i.e. when
``rnnt_lattice.gpu.kernels`` is first imported, so it is set here before anything imports
that module. pytest imports every test module at collection, so the variable is set for
the whole session; it only changes how ``@triton.jit`` functions are built (no other test
module uses Triton: torch.compile on CPU generates C++). On a CUDA machine the interpreter
would also run these tests (it copies CUDA tensors to the host); ``test_cuda_native``
runs the compiled kernels in a subprocess without the variable.
"""
import itertools
import math
import os

os.environ["TRITON_INTERPRET"] = "1"

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import pathlib  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.utils._python_dispatch  # noqa: E402

from support.backends import HAS_TRITON, TRITON_MISSING  # noqa: E402

if not HAS_TRITON:
    pytest.skip(f"needs the Triton backend: {TRITON_MISSING}", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import rnnt_lattice  # noqa: E402
from rnnt_lattice import _layout, gpu, reference, torch_backend  # noqa: E402
from rnnt_lattice._types import LossOptions  # noqa: E402
from support.sync import SYNCING_OPS, RecordOps as _RecordOps, syncing as _syncing  # noqa: E402
from support.determinism import deterministic_algorithms  # noqa: E402
from support.simple_parts import check_arc_terms, check_simple_rows  # noqa: E402
from support.triton_probes import skew_probe  # noqa: E402

if not gpu.INTERPRETED:                                             # pragma: no cover
    raise RuntimeError("rnnt_lattice.gpu was imported before TRITON_INTERPRET=1 was set: "
                       "its kernels are not interpreted, so they cannot run on CPU tensors")

# The interpreter evaluates with NumPy, which warns on exp/log of -inf and on -inf - -inf
# in lanes that the kernels then mask out.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

NEG_INF = float("-inf")


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(gpu, "BLOCK_U", 2)
    # 2 rows of 4 classes per program; node counts are odd
    monkeypatch.setattr(gpu, "V_PASS_TILES", {"row": (8, 4), "grad": (8, 4)})
    monkeypatch.setattr(gpu, "BLOCK_NODES", 8)


# --------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """A ragged batch: per-sequence frames ``T_b`` and labels ``U_b``, padded by ``pad``
    extra frames and label positions beyond the longest (padding is NaN-poisoned)."""
    name: str
    T_b: tuple
    U_b: tuple
    V: int
    blank: int = 0
    pad: int = 1
    masked: bool = False       # some -inf logits, and one row entirely -inf


CASES = {c.name: c for c in (
    Case("ragged", (5, 3, 2), (4, 2, 0), V=7),
    Case("u_blocks", (3,), (7,), V=5),                 # U+1 = 8: four lane blocks of 2
    Case("v_chunks", (3, 2), (2, 1), V=11),            # three chunks of 4, the last partial
    Case("v_one_chunk", (3,), (2,), V=3, pad=0),       # V < BLOCK_V, no padding at all
    Case("blank_last", (4, 3), (2, 3), V=6, blank=-1),
    Case("blank_middle", (4,), (3,), V=6, blank=3),
    Case("t1", (1, 1), (0, 2), V=4),                   # one frame: all labels, then a blank
    Case("u0", (4, 2), (0, 0), V=5, pad=0),            # targets of shape (B, 0)
    Case("no_frames", (3, 0), (2, 1), V=5),            # T_b = 0: loss +inf, gradient 0
    Case("masked", (4, 3), (3, 2), V=6, masked=True),
)}

OPTIONS = {
    "plain": dict(),
    "clamp": dict(clamp=0.05),
    "fastemit": dict(fastemit_lambda=0.3),
    "logprob": dict(fused=False),
    "logprob_clamp_fastemit": dict(fused=False, clamp=0.2, fastemit_lambda=0.5),
}


@dataclass
class Batch:
    logits: torch.Tensor          # (B, T, U+1, V) float64, padding NaN
    targets: torch.Tensor         # (B, U) int32
    logit_lengths: torch.Tensor   # (B,) int32
    target_lengths: torch.Tensor  # (B,) int32
    blank: int
    padding: torch.Tensor         # (B, T, U+1) bool
    weights: torch.Tensor         # (B,) signed upstream gradient, float64


def make_batch(case: Case, fused: bool = True, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    B, V = len(case.T_b), case.V
    T, U = max(case.T_b) + case.pad, max(case.U_b) + case.pad
    x = 2.0 * torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64)
    blank = case.blank % V
    r = torch.randint(0, V - 1, (B, U), generator=g)
    targets = (r + (r >= blank)).to(torch.int32)                     # never the blank
    if case.masked:
        classes = torch.arange(V)
        drop = (torch.rand(B, T, U + 1, V, generator=g) < 0.3) & (classes != blank)
        drop &= classes != torch.nn.functional.pad(targets, (0, 1)).long()[:, None, :, None]
        x = x.masked_fill(drop, NEG_INF)
        x[0, 1, 1, :] = NEG_INF                                        # a dead node mid-lattice
    if not fused:
        x = torch.log_softmax(x, dim=-1).nan_to_num(nan=NEG_INF)       # the dead row stays -inf
    tl = torch.tensor(case.T_b, dtype=torch.int32)
    ul = torch.tensor(case.U_b, dtype=torch.int32)
    padding = ~_layout.node_mask(tl.long(), ul.long(), T, U + 1)
    x = x.masked_fill(padding[..., None], float("nan"))
    weights = torch.tensor([1.0, -0.5, 2.0, -1.5][:B], dtype=torch.float64)
    return Batch(x, targets, tl, ul, case.blank, padding, weights)


def run(batch: Batch, dtype, backend, *, fused=True, clamp=-1.0, fastemit_lambda=0.0,
        inplace_grad=False):
    """Per-sequence costs and the gradient of ``sum_b weights[b] * costs[b]``."""
    leaf = batch.logits.to(dtype).requires_grad_()
    costs = rnnt_lattice.rnnt_loss(
        leaf, batch.targets, batch.logit_lengths, batch.target_lengths, batch.blank, clamp,
        "none", fused, fastemit_lambda=fastemit_lambda, backend=backend, inplace_grad=inplace_grad)
    (costs * batch.weights.to(costs.dtype)).sum().backward()
    return costs.detach(), leaf.grad, leaf


def reference64(batch: Batch, dtype, **opts):
    """The float64 reference on the same numbers the kernels see (``logits`` rounded to
    ``dtype`` first)."""
    b64 = Batch(batch.logits.to(dtype).double(), *(getattr(batch, f) for f in
                ("targets", "logit_lengths", "target_lengths", "blank", "padding", "weights")))
    return run(b64, torch.float64, "torch", **opts)[:2]


def tolerance(dtype, costs_ref) -> float:
    """Relative error allowed: rounding of the logits' own dtype (float32 rows, exps and
    output for every input but float64) times the loss scale; the lattice itself is float64."""
    eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    finite = costs_ref[torch.isfinite(costs_ref)]
    scale = float(finite.abs().max()) if finite.numel() else 1.0
    return 8 * eps * max(1.0, scale)


def errors(costs, grad, costs_ref, grad_ref):
    """(relative loss error, relative gradient error); +inf costs must match exactly."""
    costs, grad = costs.double(), grad.double()
    assert torch.equal(torch.isinf(costs), torch.isinf(costs_ref)), (costs, costs_ref)
    fin = torch.isfinite(costs_ref)
    loss_scale = max(float(costs_ref[fin].abs().max()) if fin.any() else 1.0, 1e-30)
    loss_err = float((costs[fin] - costs_ref[fin]).abs().max()) / loss_scale if fin.any() else 0.0
    grad_scale = max(float(grad_ref.abs().max()), 1e-30)
    return loss_err, float((grad - grad_ref).abs().max()) / grad_scale


def check_padding(batch: Batch, grad: torch.Tensor):
    """Padding nodes and impossible sequences get exactly zero gradient, never NaN."""
    assert torch.isfinite(grad).all()
    assert (grad[batch.padding] == 0).all()
    dead = batch.logit_lengths == 0
    assert (grad[dead] == 0).all()


# --------------------------------------------------------------------------- loss + gradient
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradient_float32(case, option):
    opts = OPTIONS[option]
    batch = make_batch(CASES[case], fused=opts.get("fused", True))
    costs, grad, _ = run(batch, torch.float32, "triton", **opts)
    costs_ref, grad_ref = reference64(batch, torch.float32, **opts)
    costs_cpu, grad_cpu, _ = run(batch, torch.float32, "numba", **opts)
    tol = tolerance(torch.float32, costs_ref)
    assert costs.dtype == torch.float32 and grad.dtype == torch.float32
    loss_err, grad_err = errors(costs, grad, costs_ref, grad_ref)
    assert loss_err <= tol and grad_err <= tol, (loss_err, grad_err, tol)
    loss_err, grad_err = errors(costs, grad, costs_cpu.double(), grad_cpu.double())
    assert loss_err <= tol and grad_err <= tol, ("vs numba", loss_err, grad_err, tol)
    check_padding(batch, grad)
    if opts.get("clamp", -1.0) > 0:
        # both bounds, before the upstream factor
        w = batch.weights.abs().to(grad.dtype)[:, None, None, None]
        assert (grad.abs() <= opts["clamp"] * w * (1 + 1e-6)).all()


@pytest.mark.parametrize("option", ["plain", "logprob_clamp_fastemit"])
@pytest.mark.parametrize("case", ["ragged", "u_blocks", "v_chunks", "masked"])
def test_loss_and_gradient_float64(case, option):
    """float64 logits are accumulated in float64: agreement to float64 rounding."""
    opts = OPTIONS[option]
    batch = make_batch(CASES[case], fused=opts.get("fused", True), seed=1)
    costs, grad, _ = run(batch, torch.float64, "triton", **opts)
    costs_ref, grad_ref = reference64(batch, torch.float64, **opts)
    assert costs.dtype == torch.float64 and grad.dtype == torch.float64
    loss_err, grad_err = errors(costs, grad, costs_ref, grad_ref)
    tol = tolerance(torch.float64, costs_ref)
    assert loss_err <= tol and grad_err <= tol, (loss_err, grad_err, tol)
    check_padding(batch, grad)


def test_float64_lattice_long_labels(monkeypatch):
    """The lattice is float64 whatever the logits' dtype: on a long, peaked lattice
    ((1, 12, 80, 4), logits x4) a float32 lattice gave a gradient error of 4e-5 of its
    scale; float64 brings it to float32 rounding of the rows (the Numba path gives 1e-7)."""
    monkeypatch.setattr(gpu, "BLOCK_U", 128)          # one lane block per diagonal: quick
    monkeypatch.setattr(gpu, "V_PASS_TILES", {"row": (4096, 4), "grad": (4096, 4)})
    g = torch.Generator().manual_seed(3)
    x = 4.0 * torch.randn(1, 12, 81, 4, generator=g)
    targets = torch.randint(1, 4, (1, 80), generator=g)
    lengths = (torch.tensor([12]), torch.tensor([80]))
    grads = {}
    for backend, dtype in (("triton", torch.float32), ("numba", torch.float32),
                           ("torch", torch.float64)):
        leaf = x.to(dtype).clone().requires_grad_()
        rnnt_lattice.rnnt_loss(leaf, targets, *lengths, blank=0, backend=backend).backward()
        grads[backend] = leaf.grad.double()
    scale = float(grads["torch"].abs().max())
    err = float((grads["triton"] - grads["torch"]).abs().max()) / scale
    err_numba = float((grads["numba"] - grads["torch"]).abs().max()) / scale
    assert err <= max(1e-6, 4 * err_numba), (err, err_numba)


@pytest.mark.parametrize("option", ["plain", "clamp_fastemit_sum", "logprob_none",
                                    "zero_infinity", "inplace", "bfloat16"])
def test_hot_path_never_synchronises(device_checks, option):
    """Structural check of what ``torch.cuda.set_sync_debug_mode("error")`` checks on a GPU
    (``cuda_checks.py``): every aten op of forward+backward is recorded, and none of them
    reads a value on the host or builds a tensor from Python values. The value checks run
    on the device path (``device_checks``), as on CUDA."""
    batch = make_batch(CASES["ragged"], fused=option != "logprob_none")
    kw = dict(plain=dict(), clamp_fastemit_sum=dict(clamp=0.1, fastemit_lambda=0.2, reduction="sum"),
              logprob_none=dict(fused_log_softmax=False, reduction="none"),
              zero_infinity=dict(zero_infinity=True), inplace=dict(inplace_grad=True),
              bfloat16=dict())[option]
    dtype = torch.bfloat16 if option == "bfloat16" else torch.float32
    leaf = batch.logits.nan_to_num(0.0).to(dtype).requires_grad_()
    with _RecordOps() as rec:
        loss = rnnt_lattice.rnnt_loss(leaf, batch.targets, batch.logit_lengths,
                                      batch.target_lengths, batch.blank, backend="triton", **kw)
        loss.backward(torch.ones_like(loss))
    assert leaf.grad is not None and rec.ops
    assert not _syncing(rec.ops), _syncing(rec.ops)


@pytest.mark.parametrize("topo", ["tdt", "constrained", "multiblank"])
def test_topologies_never_synchronise(topo):
    """The same structural check for the kernels of other topologies, with a k2 boundary,
    sigma, delay penalty, clamp and FastEmit, through the backend protocol (the public
    layer validates a CPU boundary on the host, which it never does on CUDA), and with the
    packed ``node_rows`` layout."""
    from rnnt_lattice import topology
    B, T, U, V = 2, 4, 2, 6
    topology_ = {"tdt": topology.tdt([0, 1, 2]), "constrained": topology.constrained(),
                 "multiblank": topology.multiblank(V - 1, [2, 3])}[topo]
    blank = 0 if topo == "constrained" else V - 1
    logits = torch.randn(B, T, U + 1, V + topology_.n_durations)
    targets = torch.randint(1, 3, (B, U), dtype=torch.int32)
    tl, ul = torch.tensor([4, 3], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32)
    boundary = torch.tensor([[0, 1, 2, 4], [0, 0, 1, 2]])
    opts = LossOptions(blank, clamp=0.5, fastemit_lambda=0.1, topology=topology_, sigma=0.05,
                       delay_penalty=0.2)
    node_rows = torch.arange(B * T * (U + 1)).view(B, T, U + 1)
    with _RecordOps() as rec:
        for kw in (dict(boundary=boundary), dict(node_rows=node_rows)):
            x = logits if "boundary" in kw else logits.view(-1, logits.shape[-1])
            costs, saved, state = gpu.loss_forward(x, targets, tl, ul, opts, True, **kw)
            grad = gpu.loss_backward(saved, state, torch.ones_like(costs).expand(B), opts)
    assert grad.shape == (B * T * (U + 1), logits.shape[-1]) and rec.ops
    assert not _syncing(rec.ops), _syncing(rec.ops)


@pytest.mark.parametrize("lattice", ["regular", "constrained_terms"])
def test_lattice_tools_never_synchronise(device_checks, lattice):
    """occupancy and best_alignment, regular and a non-regular lattice with per-arc terms:
    their tensor outputs (and ``arc_durations``) come without a host read
    (``Alignment.frame_labels``, Python lists, are built on first access only); the value
    checks on the device path, as on CUDA."""
    batch = make_batch(CASES["ragged"])
    args = (batch.logits.float(), batch.targets, batch.logit_lengths, batch.target_lengths,
            batch.blank)
    kw = dict(backend="triton")
    if lattice == "constrained_terms":
        kw.update(rnnt_type="constrained", sigma=0.1, delay_penalty=0.2)
    with _RecordOps() as rec:
        occ = rnnt_lattice.occupancy(*args, **kw)
        ali = rnnt_lattice.best_alignment(*args, **kw)
        ali.arc_durations                                             # noqa: B018
    assert occ.node.dtype == torch.float64 and ali.emit_frames.dtype == torch.int64
    assert not _syncing(rec.ops), _syncing(rec.ops)
    with _RecordOps() as rec:
        ali.frame_labels                                              # noqa: B018
    assert _syncing(rec.ops)      # the check sees host reads where there are some


def test_sync_check_catches_python_values():
    """The recorder behind the two tests above sees the patterns that synchronise."""
    x = torch.zeros(3)
    with _RecordOps() as rec:
        x += torch.tensor([0.0, 1.5, 0.0])          # a tensor of Python numbers, copied over
        float(x.sum())                              # a host read
    assert {"aten.lift_fresh.default", "aten._local_scalar_dense.default"} <= set(_syncing(rec.ops))


def reference_lowp(batch: Batch, dtype, fused=True):
    """The torch reference recursion run entirely in ``dtype`` (row pass, alpha/beta and
    gradient): the yardstick of the low-precision criterion."""
    x = batch.logits.to(dtype)
    targets, tl, ul = (batch.targets.long(), batch.logit_lengths.long(), batch.target_lengths.long())
    topo, ends = rnnt_lattice.topology.regular(), reference.Ends.of(tl, ul)
    blank = batch.blank % x.shape[-1]                      # (reference's: in [0, V))
    lse, _, lp = reference.kind_log_probs(x, targets, topo, blank, fused, ends)
    lse, lp = lse.to(dtype), lp.to(dtype)                  # (kind_log_probs gives float64)
    lat = reference.lattice(reference.arc_weights(lp, topo, ends), topo, ends)
    grad = reference.grad(x, lse, None, lat, targets, topo, blank, fused, ends)
    return -lat.log_like, grad * batch.weights.to(dtype)[:, None, None, None]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("case", ["ragged", "v_chunks", "blank_last"])
def test_low_precision(case, dtype):
    """Passes when the error against the float64 reference (on the same rounded logits) is
    at most 2x that of the reference recursion run in ``dtype`` itself."""
    batch = make_batch(CASES[case])
    costs, grad, _ = run(batch, dtype, "triton")
    assert grad.dtype == dtype and costs.dtype == torch.float32
    costs_ref, grad_ref = reference64(batch, dtype)
    costs_low, grad_low = reference_lowp(batch, dtype)
    loss_err, grad_err = errors(costs, grad, costs_ref, grad_ref)
    loss_err_low, grad_err_low = errors(costs_low, grad_low, costs_ref, grad_ref)
    assert loss_err <= 2 * loss_err_low and grad_err <= 2 * grad_err_low, \
        (loss_err, loss_err_low, grad_err, grad_err_low)
    check_padding(batch, grad)


# --------------------------------------------------------------------------- in-place gradient
@pytest.mark.parametrize("backend", ["triton", "torch", "numba"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logprob"])
def test_inplace_grad(backend, fused):
    """inplace_grad=True gives the same gradient, stored in the logits' own memory."""
    batch = make_batch(CASES["ragged"], fused=fused)
    costs, grad, _ = run(batch, torch.float32, backend, fused=fused)
    costs_ip, grad_ip, leaf = run(batch, torch.float32, backend, fused=fused, inplace_grad=True)
    assert torch.equal(costs, costs_ip)
    torch.testing.assert_close(grad_ip, grad, rtol=1e-6, atol=1e-7)
    assert grad_ip.data_ptr() == leaf.data_ptr()
    check_padding(batch, grad_ip)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_inplace_grad_refuses_second_backward(backend):
    batch = make_batch(CASES["ragged"])
    leaf = batch.logits.float().requires_grad_()
    costs = rnnt_lattice.rnnt_loss(leaf, batch.targets, batch.logit_lengths, batch.target_lengths,
                                   0, reduction="none", backend=backend, inplace_grad=True)
    costs[0].backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        costs[0].backward()


@pytest.mark.parametrize("backend", ["triton", "torch", "numba"])
def test_inplace_grad_validation(backend):
    batch = make_batch(CASES["ragged"])
    args = (batch.targets, batch.logit_lengths, batch.target_lengths, 0)
    strided = batch.logits.float().transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="contiguous"):
        rnnt_lattice.rnnt_loss(strided.requires_grad_(), *args, backend=backend, inplace_grad=True)
    half = batch.logits.half().requires_grad_()
    if backend == "triton":
        # Triton reads float16 natively: the gradient lands in the float16 logits.
        rnnt_lattice.rnnt_loss(half, *args, backend=backend, inplace_grad=True).backward()
        assert half.grad.data_ptr() == half.data_ptr()
    else:
        # The others would compute on a float32 copy.
        with pytest.raises(ValueError, match="inplace_grad=True needs logits of dtype"):
            rnnt_lattice.rnnt_loss(half, *args, backend=backend, inplace_grad=True)


def test_repeated_backward_negated():
    """A second backward through the same graph with the negated upstream gradient gives
    exactly the negated gradient (the backward pass never mutates saved state)."""
    batch = make_batch(CASES["ragged"])
    leaf = batch.logits.float().requires_grad_()
    costs = rnnt_lattice.rnnt_loss(leaf, batch.targets, batch.logit_lengths, batch.target_lengths,
                                   0, reduction="none", backend="triton")
    w = batch.weights.float()
    (g1,) = torch.autograd.grad(costs, leaf, w, retain_graph=True)
    (g2,) = torch.autograd.grad(costs, leaf, -w)
    assert torch.equal(g2, -g1)


def test_noncontiguous_inputs():
    """Any strides and int32 ids: the same numbers as contiguous inputs, gradient included."""
    batch = make_batch(CASES["ragged"])
    costs, grad, _ = run(batch, torch.float32, "triton")
    strided = batch.logits.float().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    assert not strided.is_contiguous()
    costs_s = rnnt_lattice.rnnt_loss(strided, batch.targets, batch.logit_lengths,
                                     batch.target_lengths, batch.blank, reduction="none",
                                     backend="triton")
    (costs_s * batch.weights.float()).sum().backward()
    assert torch.equal(costs_s.detach(), costs) and torch.equal(strided.grad, grad)
    lat = gpu.occupancy(strided.detach(), batch.targets, batch.logit_lengths,
                        batch.target_lengths, LossOptions(batch.blank % strided.shape[-1], True))
    assert torch.equal((-lat.log_like).to(costs.dtype), costs)


# --------------------------------------------------------------------------- lattice, viterbi
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("case", ["ragged", "u_blocks", "masked", "no_frames"])
def test_occupancy(case, dtype):
    """The lattice tools' occupancy (row pass, lattice, occupation kernel) of the regular
    topology against the PyTorch backend's, float64 whatever the logits."""
    batch = make_batch(CASES[case])
    x = batch.logits.to(dtype)
    args = (batch.targets.long(), batch.logit_lengths.long(), batch.target_lengths.long(),
            LossOptions(batch.blank % x.shape[-1], True))
    lat = gpu.occupancy(x, *args)
    ref = torch_backend.occupancy(x.double(), *args)
    tol = tolerance(dtype, -ref.log_like)
    for field in ("alpha", "beta", "log_like", "gamma"):
        assert getattr(lat, field).dtype == torch.float64, field      # a float64 lattice
        assert getattr(lat, field).is_contiguous(), field              # node order, not skewed
        got, want = getattr(lat, field), getattr(ref, field)
        assert torch.equal(torch.isneginf(got), torch.isneginf(want)), field
        fin = torch.isfinite(want)
        assert torch.isfinite(got[fin]).all(), field
        scale = max(1.0, float(want[fin].abs().max())) if fin.any() else 1.0
        err = float((got[fin] - want[fin]).abs().max()) if fin.any() else 0.0
        assert err <= tol * scale, (field, err, tol * scale)
    # Invariants of math.md section 3 on the kernels' own occupations.
    for b, (T_b, U_b) in enumerate(zip(batch.logit_lengths.tolist(), batch.target_lengths.tolist())):
        if T_b == 0:
            assert lat.log_like[b] == NEG_INF
            continue
        ones = torch.ones(T_b, dtype=torch.float64)
        torch.testing.assert_close(lat.gamma[b, 0, :T_b].double().sum(1), ones,
                                   rtol=0, atol=64 * torch.finfo(dtype).eps * (T_b + U_b))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logprob"])
@pytest.mark.parametrize("case", ["ragged", "u_blocks", "masked"])
def test_viterbi(case, fused):
    """The max-plus sweep (same kernel, MAX_SEMIRING=True) against the PyTorch backend's."""
    batch = make_batch(CASES[case], fused=fused)
    x = batch.logits.float()
    args = (batch.targets.long(), batch.logit_lengths.long(), batch.target_lengths.long(),
            LossOptions(batch.blank % x.shape[-1], fused))
    alpha_max, _, log_prob = gpu.viterbi(x, *args)
    ref_alpha, _, ref_log_prob = torch_backend.viterbi(x.double(), *args)
    assert alpha_max.dtype == log_prob.dtype == torch.float64
    assert alpha_max.is_contiguous()                                   # node order, not skewed
    for got, want in ((alpha_max, ref_alpha), (log_prob, ref_log_prob)):
        assert torch.equal(torch.isneginf(got), torch.isneginf(want))
        fin = torch.isfinite(want)
        torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5)
    # The max-plus alpha is a lower bound of the log-sum alpha, and the best path is one of
    # the paths: alpha_max <= alpha on every node.
    lat = gpu.occupancy(x, *args)
    fin = torch.isfinite(lat.alpha)
    assert (alpha_max[fin] <= lat.alpha[fin] + 1e-5).all()


# --------------------------------------------------------------------------- devices
def test_cpu_without_interpreter_is_a_value_error():
    script = textwrap.dedent("""
        import torch, rnnt_lattice
        x = torch.randn(1, 2, 2, 3)
        try:
            rnnt_lattice.rnnt_loss(x, torch.tensor([[1]]), torch.tensor([2]), torch.tensor([1]),
                                   blank=0, backend="triton")
        except ValueError as err:
            print("ValueError:", err)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=300)
    assert "ValueError:" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out.stdout + out.stderr


def _compile_env() -> dict:
    """The environment of a subprocess that compiles the kernels for a CUDA target: no
    interpreter, Triton's FP fusion default stated, benchmarks/ importable
    (``kernel_resources``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    bench = str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")
    env["PYTHONPATH"] = os.pathsep.join([bench, *filter(None, [env.get("PYTHONPATH")])])
    return env


COMPILE_SCRIPT = """
import inspect, re, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import torch
from rnnt_lattice import gpu, topology
from rnnt_lattice.gpu import joint, kernels

from kernel_resources import signature, thread_locality_hazards   # pointer types by name

INPUTS = {"fp16": "fp32", "bf16": "fp32", "fp32": "fp32", "fp64": "fp64"}   # -> costs dtype
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
          "fp64": torch.float64}
ACC = {"fp32": tl.float32, "fp64": tl.float64}


def variants(sm):
    \"\"\"(kernel name, constexprs, [(input dtype, id dtype)]): the kernels of four
    topologies: regular with every flag off (every dtype) and on, constrained, TDT with
    durations 0..4 and multi-blank with big blanks up to 8, these with the per-arc terms,
    boundary and node_rows on (float32; TDT also bfloat16); the lattice pass in both
    semirings (max-plus: the lattice tools' Viterbi sweep), the occupation kernel of
    the lattice tools, the window DP of prune_ranges, the simple losses' rescue, rows
    and arc terms, and do_rnnt_pruning's backward; each with the warps and pipeline stages
    it is launched with (``LAUNCH``: the lattice pass in one stage, the joiner's passes with
    their blocks' warps and register caps; compiled with Triton's defaults, 4 warps and 3 stages, they were other
    kernels than the launched ones, and the joiner's took 5-6x longer to compile, spilling
    kilobytes).\"\"\"
    every = [("fp16", "i64"), ("bf16", "i64"), ("fp32", "i64"), ("fp32", "i32"), ("fp64", "i64")]
    fp32 = [("fp32", "i64")]
    topologies = {"regular": topology.regular(), "constrained": topology.constrained(),
                  "tdt": topology.tdt([0, 1, 2, 3, 4]),
                  "multiblank": topology.multiblank(7, [2, 4, 8])}
    for tname, topo in topologies.items():
        kinds = lambda which: gpu._kernel_kinds(topo, which)  # noqa: E731
        n_dur = topo.n_durations
        tiles = dict(ROWS=4, BLOCK_V=1024, BLOCK_DUR=gpu._pow2(n_dur, 1 << 30),
                     V_ALIGN=gpu._v_align(1000 + n_dur, n_dur))
        for on in ((False, True) if tname == "regular" else (True,)):
            # Layouts: padded; row_nodes (regular, multi-blank); a fused tile's box
            # (constrained, TDT)
            layout = (kernels.PADDED if not on else kernels.BOX
                      if tname in ("constrained", "tdt") else kernels.ROW_NODES)
            where = dict(BOUNDARY=on, LAYOUT=layout)
            terms = dict(SIGMA=on, DELAY_ON=on)
            dtypes = every if not on else fp32 + [("bf16", "i64")] * (tname == "tdt")
            # SPAN: rows read from their aligned span where they are not aligned (TDT's; the
            # row and gradient passes)
            span = dict(SPAN=gpu._span(1000, n_dur, torch.float32))
            # The row pass's load ahead of its loop (PREFETCH: gpu.ROW_PREFETCH for aligned
            # rows, gpu.SPAN_PREFETCH for the span's), its reductions once a row (LANES, as
            # launched: the entries of a 16-byte load of the dtype, none for float64,
            # gpu._row_lanes) and its entries read before the loop (EARLY, gpu.ROW_EARLY);
            # the other way of all three on sm_90
            prefetch = gpu.SPAN_PREFETCH if span["SPAN"] else gpu.ROW_PREFETCH
            row = dict(PREFETCH=prefetch, EARLY=gpu.ROW_EARLY)
            lanes = {}
            for x in dtypes:
                lanes.setdefault(gpu._row_lanes(DTYPES[x[0]], tiles["BLOCK_V"]), []).append(x)
            for n, group in lanes.items():
                yield "_row_kernel", dict(kinds("row"), **tiles, **span, **row, LANES=n,
                                          FUSED=True, WIDE=on, **where), group
            lanes32 = gpu._row_lanes(torch.float32, tiles["BLOCK_V"])
            yield "_row_kernel", dict(kinds("row"), **tiles, **span, **row, LANES=lanes32,
                                      FUSED=False, WIDE=on, **where), fp32
            if sm == 90:
                yield "_row_kernel", dict(kinds("row"), **tiles, **span, FUSED=True, WIDE=on,
                                          PREFETCH=not prefetch, EARLY=not gpu.ROW_EARLY,
                                          LANES=4 if not lanes32 else 0, **where), fp32
            # The gradient pass over rows that start anywhere as launched (gpu.SPAN_GRAD: by
            # their whole 16-byte groups, else an entry a load); the other way on sm_90
            # TDT's duration group after the token group's loop as launched
            # (gpu.GRAD_DURATIONS_LAST); the other way on sm_90, with a fused tile's check
            grad_span = dict(SPAN=span["SPAN"] if gpu.SPAN_GRAD else 0,
                             DUR_LAST=bool(n_dur) and gpu.GRAD_DURATIONS_LAST)
            yield ("_grad_kernel", dict(kinds("grad"), **tiles, **grad_span, FUSED=True,
                                        CLAMP=True, CHECK=0.0, **where), dtypes)
            if n_dur and sm == 90:
                yield ("_grad_kernel", dict(kinds("grad"), **tiles, FUSED=True, CLAMP=True,
                                            CHECK=1e-4, **dict(where, LAYOUT=kernels.BOX),
                                            **dict(grad_span, DUR_LAST=not grad_span["DUR_LAST"])),
                       fp32)
            yield ("_grad_kernel", dict(kinds("grad"), **tiles, **grad_span, FUSED=False,
                                        CLAMP=False, CHECK=0.0, **where), fp32)
            if span["SPAN"] and sm == 90:
                yield ("_grad_kernel", dict(kinds("grad"), **tiles, FUSED=True, CLAMP=True,
                                            CHECK=0.0, SPAN=0 if grad_span["SPAN"] else span["SPAN"],
                                            DUR_LAST=grad_span["DUR_LAST"], **where), fp32)
            if on and sm == 90:
                # a fused tile's recomputation checked in the pass (gpu.tile_backward; the
                # GPU machines' architecture)
                yield ("_grad_kernel", dict(kinds("grad"), **tiles, **grad_span, FUSED=True,
                                            CLAMP=True, CHECK=1e-4,
                                            **dict(where, LAYOUT=kernels.BOX)),
                       fp32 + [("fp64", "i64")])
            for semiring in (False, True):
                # the lattice's state in registers as launched (gpu.LATTICE_ONCHIP, where
                # one block of lanes holds a diagonal); the other way on sm_90
                onchip_ = gpu.LATTICE_ONCHIP
                for onchip in ((onchip_, not onchip_) if sm == 90 and (not semiring or not on)
                               else (onchip_,)):
                    yield ("_lattice_kernel", dict(kinds("lattice"), BOUNDARY=on,
                                                   MAX_SEMIRING=semiring, NAN_ROWS=on,
                                                   BLOCK_U=256, **terms, ONCHIP=onchip,
                                                   DEPTH=gpu._onchip(256, topo)["DEPTH"]),
                           fp32)
            yield "_gamma_kernel", dict(kinds("lattice"), BOUNDARY=on, BLOCK=512, **terms), fp32
            yield "_reads_kernel", dict(kinds("reads"), BOUNDARY=on, BLOCK=512, **terms), fp32
    yield "_window_dp_kernel", dict(BLOCK_S=128), fp32        # prune_ranges' window DP
    yield "_k2_starts_kernel", dict(BLOCK_T=32, BLOCK_S=128, BLOCK_SCAN=1024), fp32   # k2's rule
    for labels, classes in ((True, ()), (True, (5, 6)), (False, ())):   # the input check
        yield ("_input_check_kernel", dict(LABELS=labels, NO_BLANK=labels, CLASSES=classes,
                                           BOUNDARY=not labels, BLOCK_B=16, BLOCK_U=128),
               [("fp32", "i32"), ("fp32", "i64")])
    for backward in (False, True):                             # the simple losses' rescue
        yield ("_simple_rescue_kernel", dict(BACKWARD=backward, BLOCK_NODES=256, BLOCK_V=1024),
               [("fp32", "i64"), ("fp64", "i64")])
    for am in (True, False):                # its backward in a fixed order, a side a launch
        yield ("_simple_rescue_rows_kernel", dict(AM=am, BLOCK_K=1024, BLOCK_V=1024),
               [("fp32", "i64"), ("fp64", "i64")])
    for mix in (False, True):                                  # the simple losses' arc terms
        tiles = dict(MIX=mix, BLOCK_T=4, BLOCK_U=128)
        simple = [("fp32", "i64"), ("fp64", "i64")]
        yield "_arc_terms_kernel", tiles, simple
        yield "_arc_terms_grad_kernel", dict(tiles, HAS_GB=True, HAS_GE=mix), simple
        yield "_arc_terms_cols_kernel", dict(MIX=mix, BLOCK_TB=32, BLOCK_U=32), simple
    yield ("_rows_sum_kernel", dict(BLOCK_D=1024, BLOCK_M=1024, CHUNK=16),         # pruning
           [("fp32", "i64"), ("fp64", "i64")])
    rows = dict(ROWS=2, BLOCK_V=1024, BLOCK_J=128)                 # the simple losses' rows
    for contig in (True, False):
        yield "_simple_rows_kernel", dict(rows, CONTIG=contig), [("fp32", "i64"), ("fp64", "i64")]
    for ordered in (False, True):           # the entries with atomics, or one at a time
        yield ("_simple_rows_grad_kernel", dict(rows, UNI=True, COLS=True, ORDERED=ordered),
               [("fp32", "i64"), ("fp64", "i64")])
    # the joiner's kernel path (gpu/joint.py), with the blocks it launches: the row and
    # gradient passes of the regular topology in every dtype it runs in on a GPU (float64
    # takes the tile path there: fused._kernel_path), float32 also with TF32 products, TDT
    # and multi-blank with the boundary, tanh and ReLU; the act-grad pass. Ampere and
    # Hopper only (the matrix products' targets).
    if sm < 80:
        return
    half = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
            "fp64": torch.float64}
    gpu_dtypes = [d for d in every if d[0] != "fp64"]
    for tname, precision, dtypes in (("regular", "ieee", gpu_dtypes), ("regular", "tf32", fp32),
                                     ("tdt", "ieee", [("bf16", "i64")]),
                                     ("multiblank", "ieee", fp32)):
        topo = topologies[tname]
        on = tname != "regular"
        for which, kinds in (("row", gpu._kernel_kinds(topo, "joint_row")),
                             ("grad", gpu._kernel_kinds(topo, "joint_grad"))):
            for x, idt in dtypes:
                tile = joint._tiles(which, half[x])
                tiles, launched = joint.block_constants(tile), joint.launch_options(tile)
                flags = dict(ACT=int(on), HAS_BIAS=True, FUSED=True, BOUNDARY=on, DOT_F32=False,
                             PRECISION=precision, BLOCK_DUR=joint._block_dur(topo.n_durations))
                if which == "grad":
                    flags["CLAMP"] = True
                else:
                    flags.update(WIDE=on, ENTRIES=True)    # (a forward for a gradient)
                yield f"_joint_{which}_kernel", dict(kinds, **flags, **tiles), [(x, idt)], launched
    # the hidden pass of the products by cuBLAS (joint.CUBLAS_PRODUCTS, off until timed),
    # as launched: tanh in bfloat16, ReLU with the boundary in float32 and float64
    for act, dtypes in ((0, [("bf16", "i64")]), (1, [("fp32", "i32"), ("fp64", "i64")])):
        yield ("_joint_hidden_kernel", dict(joint.block_constants(joint.HIDDEN), ACT=act,
                                            BOUNDARY=bool(act)),
               dtypes, joint.launch_options(joint.HIDDEN))
    # the act-grad pass as launched; on sm_90 also with its PREFETCH the other way (off by
    # default until timed)
    act = joint.block_constants(joint.ACT_GRAD)
    for prefetch in ((act["PREFETCH"], not act["PREFETCH"]) if sm == 90 else (act["PREFETCH"],)):
        yield ("_joint_act_grad_kernel", dict(act, ACT=0, PREFETCH=prefetch), [("fp32", "i64")],
               joint.launch_options(joint.ACT_GRAD))


# The warps and pipeline stages of the launches (gpu/__init__.py) at the blocks above; the
# kernels not named launch with Triton's defaults (4 warps, 3 stages), the joiner's passes
# name theirs in their variants (joint._tiles).
LAUNCH = {"_row_kernel": dict(num_warps=gpu.NUM_WARPS_V),
          "_grad_kernel": dict(num_warps=gpu.NUM_WARPS_V),
          "_lattice_kernel": dict(num_warps=gpu._lattice_warps(256), num_stages=1),
          "_window_dp_kernel": dict(num_warps=gpu._window_dp_warps(128)),
          "_arc_terms_kernel": dict(num_warps=gpu.ARC_WARPS),
          "_arc_terms_grad_kernel": dict(num_warps=gpu.ARC_WARPS)}

# The kernels whose PTX must hold atomic instructions (True) or none (False), by constexprs
ATOMICS = {"_simple_rows_grad_kernel": lambda c: not c["ORDERED"],
           "_simple_rescue_kernel": lambda c: c["BACKWARD"],
           "_simple_rescue_rows_kernel": lambda c: False}

n = 0
shard, shards = map(int, sys.argv[1].split("/"))   # this process compiles every shards-th
i = 0
seen = set()
for sm in map(int, sys.argv[2:]):
    target = GPUTarget("cuda", sm, 32)
    for name, const0, dtypes, *launched in variants(sm):
        options = launched[0] if launched else LAUNCH.get(name, {})
        fn = getattr(joint if name.startswith("_joint") else kernels, name)
        params = list(inspect.signature(fn.fn).parameters)
        for x, idt in dtypes:
            costs = INPUTS[x]
            if not {"logits_ptr", "enc_ptr"} & set(params) and x in ("fp16", "bf16"):
                continue                      # these see no logits: fp32 covers them
            # Turing and Ampere: each kernel once per input and ids dtype, its first variant
            # above (what the architecture changes in these kernels is how a dtype's
            # arithmetic and loads lower: bfloat16 emulated on Turing, loads pipelined with
            # cp.async from Ampere on; the flags change the code's paths, which Hopper
            # compiles in full); the joiner's passes once per operand dtype and precision
            # of their products (which lower to Ampere's mma, Hopper's wgmma; the
            # topology's flags and the ids' dtype change the code around them)
            if sm < 90:
                key = (sm, name, x, const0.get("PRECISION") if name.startswith("_joint") else idt)
                if key in seen:
                    continue
                seen.add(key)
            i += 1
            if i % shards != shard:
                continue
            # int32 ids and lengths are read as they are (NATIVE_INT32_IDS): float32 checks
            # them once
            const = dict(const0)
            if "ACC" in params:
                const["ACC"] = ACC[costs]
            if "COSTS32" in params:                   # as launched: float32 costs
                const["COSTS32"] = costs == "fp32"
            sig = signature(fn, const, x, idt, costs)
            compiled = triton.compile(ASTSource(fn, sig, const), target=target, options=options)
            assert compiled.asm["cubin"], (name, sm, x, const)
            # what Triton 3.6 (the H100's) would not compile
            hazards = thread_locality_hazards(compiled.asm["ttir"])
            assert not hazards, (name, sm, x, const, hazards)
            # the simple losses' sums: atomics where they add in any order, none in the
            # kernels that add in a fixed order (torch.use_deterministic_algorithms)
            if name in ATOMICS:
                atoms = [ln for ln in compiled.asm["ptx"].splitlines()
                         if re.match(r"\\s*(@!?%p\\d+\\s+)?(atom|red)\\.", ln)]
                assert bool(atoms) == ATOMICS[name](const), (name, sm, x, const, atoms[:3])
            n += 1
print("compiled", n)
"""


def test_kernels_compile_for_cuda():
    """The interpreter accepts code that the compiler rejects (e.g. a non-constexpr global
    inside a kernel): compile every kernel variant to a cubin for Hopper, and each kernel in
    each dtype for Turing and Ampere (the joiner's passes in each operand dtype and product
    precision for Ampere; Triton bundles ptxas; no GPU needed), in a subprocess without the
    interpreter; and no kernel holds the loop that Triton 3.6, the H100's, fails to compile
    (``kernel_resources.thread_locality_hazards``)."""
    env = _compile_env()
    # Two processes (the CI machine's two cores), each every other variant.
    procs = [subprocess.Popen([sys.executable, "-c", COMPILE_SCRIPT, f"{shard}/2", "75", "80",
                               "90"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for shard in range(2)]
    counts = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0 and "compiled" in stdout, stdout + stderr[-4000:]
        counts.append(int(stdout.split("compiled")[-1]))
    assert min(counts) > 0 and abs(counts[0] - counts[1]) <= 1, counts


THREAD_LOCALITY_SCRIPT = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernel_resources import thread_locality_hazards


@triton.jit
def reduce_in_loop(x_ptr, out_ptr, V, TWICE: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.arange(0, 4)
    acc = tl.zeros([4], tl.float32)
    for v0 in range(0, V, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        acc += tl.sum(tl.load(x_ptr + r[:, None] * V + v[None, :]), axis=1)
    tl.store(out_ptr + r, acc)
    if TWICE:
        tl.store(out_ptr + 4 + r, acc * 2.0)


@triton.jit
def reduce_after_loop(x_ptr, out_ptr, V, BLOCK: tl.constexpr):
    r = tl.arange(0, 4)
    acc = tl.zeros([4, BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + r[:, None] * V + v[None, :])
    s = tl.sum(acc, axis=1)
    tl.store(out_ptr + r, s)
    tl.store(out_ptr + 4 + r, s * 2.0)


sig = {"x_ptr": "*fp32", "out_ptr": "*fp32", "V": "i32"}
aligned = {(i,): [["tt.divisibility", 16]] for i in range(3)}     # as a launch on CUDA tensors
for name, fn, const in (("once", reduce_in_loop, dict(TWICE=False, BLOCK=64)),
                        ("twice", reduce_in_loop, dict(TWICE=True, BLOCK=64)),
                        ("after", reduce_after_loop, dict(BLOCK=64))):
    try:
        c = triton.compile(ASTSource(fn, dict(sig, **{k: "constexpr" for k in const}), const,
                                     attrs=aligned), target=GPUTarget("cuda", 90, 32))
    except RuntimeError:                # a Triton that has the pass's assert (3.6)
        print(name, "rejected")
        continue
    print(name, len(thread_locality_hazards(c.asm["ttir"])))
"""


def test_thread_locality_hazard_is_found(tmp_path):
    """``kernel_resources.thread_locality_hazards`` (which ``test_kernels_compile_for_cuda``
    applies to every kernel) finds the loop Triton 3.6 does not compile for CUDA -- a row
    sum of a load accumulated across iterations and read twice after the loop -- and only
    that: read once, or summed after the loop, it is no hazard. (With Triton 3.6 the
    "twice" probe fails to compile for sm_90, the other two compile: what this test sees
    when it runs under 3.6.)"""
    script = tmp_path / "probe.py"                # Triton reads a kernel's source file
    script.write_text(THREAD_LOCALITY_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], env=_compile_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    # "twice" is flagged, or (run with Triton 3.6 itself) not compiled at all
    assert out.stdout.split() in (["once", "0", "twice", "1", "after", "0"],
                                  ["once", "0", "twice", "rejected", "after", "0"]), out.stdout


# SASS_SPILLS: the SASS tests below ask for no local load or store inside a loop
# (``sass.loop_spills``), not for no stack frame: a frame whose few accesses lie before or
# after the loops costs once a program. Triton 3.7.1, which torch 2.13's CUDA build pins,
# gives the regular gradient pass at V = 1025 and multi-blank's lattice pass such a frame
# of 8 bytes; Triton 3.5, 3.6 and 3.9 none.
LATTICE_SASS_SCRIPT = """
import os, sys
import triton
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
if not os.path.exists(tool):
    print("no nvdisasm")
    sys.exit(0)
import lattice_sass
for row in lattice_sass.analyse(90, (41, 81, 151), 400):
    print(*row)
"""


ROW_LOADS_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rnnt_lattice import gpu
from rnnt_lattice.gpu import kernels
import kernel_resources as kr
from sass import loop_spills, sass_lines

print("span_tile", gpu.V_PASS_TILES["span"][0], int(gpu.ROW_PREFETCH), int(gpu.SPAN_GRAD))

for grad_span in (False, True):
    gpu.SPAN_GRAD = grad_span
    for label, V, name, const, warps, stages, *_ in kr.variants([1024, 1025]):
        if (name not in ("_row_kernel", "_grad_kernel") or (grad_span and name == "_row_kernel")
                or const.get("CHECK")):           # (the fused tiles' check: not the loss's pass)
            continue
        kernel = getattr(kernels, name)
        sig = kr.signature(kernel, const)
        attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values())
                 if t.startswith("*")}
        c = triton.compile(ASTSource(kernel, sig, const, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=warps, num_stages=stages,
                                        enable_fp_fusion=True))     # as launched
        reg, stack = kr.resources(c.asm["cubin"])
        ptx = c.asm["ptx"].splitlines()
        v4 = sum(".v4." in ln for ln in ptx if "ld.global" in ln)
        st4 = sum(".v4." in ln for ln in ptx if "st.global" in ln)
        spills = loop_spills(sass_lines(c.asm["cubin"])) if stack else 0
        print(name, label.split()[1], V, int(grad_span), const["ROWS"], const["BLOCK_V"],
              const["SPAN"], v4, st4, reg, spills)
"""


def test_unaligned_rows_are_read_with_vector_loads_on_sm90():
    """The row pass reads rows that start anywhere (TDT's V_tok + 5 entries, an odd V)
    with 16-byte vector loads from their aligned span (``gpu._span``, ``SPAN``): compiled
    for sm_90 as the backend launches it at V = 1024 and 1025, on the span's tile
    (``V_PASS_TILES["span"]``, the aligned rows' block of classes) it has as many ``v4``
    loads a row as the aligned regular row's (whose loop's loads appear twice with
    ``gpu.ROW_PREFETCH``: the first chunk's ahead of the loop). The gradient pass, compiled
    both ways: with ``gpu.SPAN_GRAD`` (tile ``"grad_span"``) the row's whole 16-byte groups,
    with as many entries a step and as many ``v4`` loads and stores as the aligned rows',
    for multi-blank's rows too (its fixed classes' chunks store an entry at a time, the
    others with vector stores, as on its aligned rows); without it, a load per element on
    NARROW_TILES, no ``v4`` load. No spill inside a loop (see ``SASS_SPILLS``)."""
    env = _compile_env()
    out = subprocess.run([sys.executable, "-c", ROW_LOADS_SCRIPT], env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    lines = [line.split() for line in out.stdout.splitlines() if line.strip()]
    span_tile = int(lines[0][1])                   # the default table's (this module's is small)
    prefetch = int(lines[0][2])
    rows = {(r[0], r[1], int(r[2]), int(r[3])): [int(v) for v in r[4:]] for r in lines[1:]}
    topos = ("regular", "tdt", "multiblank")
    assert set(rows) == ({("_row_kernel", t, V, 0) for t in topos for V in (1024, 1025)}
                         | {("_grad_kernel", t, V, g) for t in topos for V in (1024, 1025)
                            for g in (0, 1)}), out.stdout
    for kernel, topo, V, grad_span in rows:
        tile_rows, block_v, span, v4, st4, reg, spills = rows[kernel, topo, V, grad_span]
        key = (kernel, topo, V, grad_span, out.stdout)
        assert spills == 0, key
        aligned = rows[kernel, "regular", 1024, 0]
        if (topo, V) in (("regular", 1024), ("multiblank", 1024)):
            assert span == 0 and v4 > 0 and (kernel == "_row_kernel" or st4 > 0), key
        elif kernel == "_row_kernel":
            assert span == 4, key
            assert block_v == aligned[1] and tile_rows * block_v == span_tile, key
            per_chunk = aligned[3] // (2 if prefetch else 1)
            assert v4 * aligned[0] == per_chunk * tile_rows, key
        elif grad_span:
            assert span == 4, key
            assert tile_rows * block_v == aligned[0] * aligned[1], key
            assert v4 == aligned[3] and st4 == aligned[4], key
        else:
            assert span == 0 and v4 == 0 and st4 == 0, key
            assert tile_rows * block_v == gpu.NARROW_TILES["grad"][0], key


JOINT_FIT_SCRIPT = """
import kernel_resources as kr
from rnnt_lattice.gpu import joint

for sm in (80, 90):
    for label, shape, name, const, options, x, ints in kr.joint_variants([1024], [512]):
        if not label.startswith("_joint_") or " regular " not in label or (sm, x) == (80, "bf16"):
            continue
        c = kr.compile_launch(getattr(joint, name), const, options, sm, x, ints)
        regs = kr.resources(c.asm["cubin"])[0]
        print(sm, name, x, options["num_warps"], c.metadata.shared, regs,
              kr.programs_per_sm(regs, options["num_warps"], c.metadata.shared, sm))
"""
# The shared memory one block may opt into (bytes).
SHARED_MAX = {80: 166912, 90: 232448}


def test_joiner_blocks_by_operand_width():
    """The joiner's passes launch half operands with ``joint.TILES`` (timed with bf16: two
    programs a multiprocessor by a cap on registers, ``maxnreg``), float32 with
    ``joint.WIDE[4]``'s own whole choice (timed with TF32: no cap, 16 warps) and float64
    with smaller blocks, no cap; a cap of None is no launch option at all."""
    from rnnt_lattice.gpu import joint
    for which in ("row", "grad"):
        for dtype in (torch.bfloat16, torch.float16):
            tile = joint._tiles(which, dtype)
            assert tile == joint.TILES[which] and tile.get("maxnreg"), (which, dtype, tile)
            assert joint.launch_options(tile)["maxnreg"] == tile["maxnreg"]
        for dtype in (torch.float32, torch.float64):
            tile = joint._tiles(which, dtype)
            assert tile["maxnreg"] is None and "maxnreg" not in joint.launch_options(tile)
            assert {k: tile[k] for k in joint.WIDE[dtype.itemsize]} == joint.WIDE[dtype.itemsize]
            assert set(joint.launch_options(tile)) == {"num_warps", "num_stages"}
        assert joint._tiles(which, torch.float32)["num_warps"] == 16


def test_joiner_blocks_fit_a_multiprocessor():
    """The joiner's kernel path launches its passes with blocks (``joint.TILES``, ``WIDE``)
    that a block of threads can hold, checked on the sm_80 and sm_90 compiles with the
    launch's warps and pipeline stages: its shared memory within the most a block may use
    (a launch asking for more fails with OutOfResources, on a GPU only), its registers
    times threads within a multiprocessor's. float32 (the widest operands, TF32 products)
    on both, bfloat16 on sm_90."""
    out = subprocess.run([sys.executable, "-c", JOINT_FIT_SCRIPT], env=_compile_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()]
    assert {(r[0], r[1], r[2]) for r in rows} == {
        (sm, f"_joint_{w}_kernel", x) for w in ("row", "grad")
        for sm, x in (("80", "fp32"), ("90", "fp32"), ("90", "bf16"))}, out.stdout
    for sm, name, x, warps, shared, regs, programs in rows:
        assert int(shared) <= SHARED_MAX[int(sm)], (sm, name, x, shared)
        assert int(regs) * 32 * int(warps) <= 65536, (sm, name, x, regs, warps)
        assert int(programs) >= 1, (sm, name, x, regs, warps, shared)


# The row and gradient passes' switches: (gpu.SPAN_ROWS, gpu.SPAN_GRAD, gpu.ROW_LANES, V) with
# V None for the case's own (odd: V = 11, 6); "aligned" rows of V = 12.
PASS_MODES = {
    "span": (True, True, False, None),
    "row_span": (True, False, False, None),
    "narrow": (False, True, False, None),
    "lanes_span": (True, False, True, None),
    "lanes_narrow": (False, False, True, None),
    "lanes_aligned": (True, False, True, 12),
}


@pytest.mark.parametrize("mode", PASS_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64],
                         ids=["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("case", ["v_chunks", "masked"])
def test_row_and_gradient_pass_modes(case, dtype, mode, monkeypatch):
    """Rows of an odd V (every start residue mod 16 bytes in one batch) and aligned rows
    through every way the backend has of the row and gradient passes, against the float64
    reference: ``gpu.SPAN_ROWS`` (the aligned span, or a load per element on NARROW_TILES),
    ``gpu.SPAN_GRAD`` (the gradient pass from the span too), ``gpu.ROW_LANES`` (the row
    pass's reductions once a row: a running max and sum per thread's 16 bytes of entries,
    ``kernels._lse_step``; float64 logits keep the reductions every chunk). Rows of three
    chunks and a partial one (``v_chunks``), -inf entries and a dead node (``masked``)."""
    span, grad_span, lanes, V = PASS_MODES[mode]
    monkeypatch.setattr(gpu, "SPAN_ROWS", span)
    monkeypatch.setattr(gpu, "SPAN_GRAD", grad_span)
    monkeypatch.setattr(gpu, "ROW_LANES", lanes)
    batch = make_batch(replace(CASES[case], V=V or CASES[case].V))
    V = batch.logits.shape[-1]
    unaligned = math.gcd(V, 16) < 4                  # rows that start anywhere (gpu._v_align)
    assert gpu._span(V, 0, dtype) == (16 // dtype.itemsize if span and unaligned else 0)
    assert gpu._row_lanes(dtype, 4) == (4 if lanes and dtype != torch.float64 else 0)
    costs, grad, _ = run(batch, dtype, "triton")
    loss_err, grad_err = errors(costs, grad, *reference64(batch, dtype))
    tol = tolerance(dtype, costs) if dtype != torch.bfloat16 else 2.0 ** -7
    assert loss_err <= tol and grad_err <= 8 * tol, (loss_err, grad_err)
    check_padding(batch, grad)


@pytest.mark.parametrize("span", [True, False], ids=["span", "narrow"])
@pytest.mark.parametrize("V", [12, 11], ids=["aligned", "odd_V"])
def test_row_prefetch_changes_nothing(V, span, monkeypatch):
    """The row pass's prefetch (``gpu.ROW_PREFETCH``: each chunk's load issued before the
    chunk before is reduced) reduces the same chunks in the same order: costs and gradients
    bit-identical with it on and off, over rows of three chunks and a partial one (V = 12,
    aligned; V = 11: every start residue, from the aligned span or a load per element), and
    equal to the float64 reference."""
    monkeypatch.setattr(gpu, "SPAN_ROWS", span)
    case = replace(CASES["v_chunks"], V=V)
    batch = make_batch(case)
    got = {}
    for prefetch in (True, False):
        monkeypatch.setattr(gpu, "ROW_PREFETCH", prefetch)
        got[prefetch] = run(batch, torch.float32, "triton")[:2]
    assert torch.equal(got[True][0], got[False][0])
    assert torch.equal(got[True][1], got[False][1])
    loss_err, grad_err = errors(*got[True], *reference64(batch, torch.float32))
    tol = tolerance(torch.float32, got[True][0])
    assert loss_err <= tol and grad_err <= 8 * tol, (loss_err, grad_err)


@pytest.mark.parametrize("lanes", [True, False], ids=["lanes", "chunks"])
@pytest.mark.parametrize("V", [12, 11], ids=["aligned", "odd_V"])
def test_row_pass_nonfinite_entries(V, lanes, monkeypatch):
    """A row's NaN (either sign, in any chunk), +inf or all -inf entries, through the row
    pass either way (``gpu.ROW_LANES``): a NaN or +inf makes its sequence's loss and
    gradient NaN, an all -inf row (a dead node) is no path through it; the other sequences
    agree with the float64 reference, as the PyTorch backend's results on the same logits."""
    monkeypatch.setattr(gpu, "ROW_LANES", lanes)
    case = replace(CASES["v_chunks"], T_b=(3, 3, 3, 3), U_b=(2, 2, 2, 2), pad=0, V=V)
    batch = make_batch(case)
    x = batch.logits
    x[0, 1, 1, 9] = float("nan")                          # the third chunk
    x[1, 2, 0, 1] = -float("nan")                         # the first chunk, sign bit set
    x[2, 0, 1, 6] = float("inf")                          # +inf in the second chunk
    x[3, 1, 0, :] = NEG_INF                               # a dead node
    assert torch.signbit(x[1, 2, 0, 1])
    costs, grad, _ = run(batch, torch.float32, "triton")
    want, want_grad = reference64(batch, torch.float32)
    for b in range(3):
        assert torch.isnan(costs[b]) and torch.isnan(want[b]), (b, costs, want)
        assert torch.isnan(grad[b]).any()
    assert torch.isfinite(costs[3]) and torch.isfinite(grad[3]).all()
    assert abs(costs[3].item() - want[3].item()) <= tolerance(torch.float32, want[3:])
    assert (grad[3, 1, 0] == 0).all()                     # nothing flows through the dead node
    scale = want_grad[3].abs().max().item()
    assert (grad[3].double() - want_grad[3]).abs().max().item() <= 8e-6 * scale


def test_lattice_loads_issue_before_use_on_sm90():
    """The lattice pass's time is one memory latency per diagonal only if every load of a
    diagonal (each kind's arc weight and the alpha or beta it extends) issues before the
    first instruction that reads a loaded value (a warp issues in order, so that one waits):
    compiled for sm_90 at each ``BLOCK_U`` bucket with the backend's warps
    (``benchmarks/lattice_sass.py``), both directions' diagonal loops of every topology have
    all 2K loads first, and no stack frame. With predicated loads and two lanes a thread,
    TDT's nine kinds compiled to runs of at most 11 of its 36 loads (2.9 ms a pass at s5 on
    an H100); with a select after each load, 4 of 18 (ptxas consumed the first two kinds'
    values to free their predicates: two latencies a diagonal, 1.3 ms on an H200). No
    spill inside a loop (see ``SASS_SPILLS``)."""
    env = _compile_env()
    out = subprocess.run([sys.executable, "-c", LATTICE_SASS_SCRIPT], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    if "no nvdisasm" in out.stdout:
        pytest.skip("this Triton build has no nvdisasm")
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()]
    assert len(rows) == 18, out.stdout
    assert {(r[0], r[2]) for r in rows} == {(t, n) for t in ("regular", "tdt", "multiblank")
                                            for n in ("1", "2")}, out.stdout
    for topo, U1, loop, first, loads, _, _, _, reg, stack, spills in rows:
        kinds = {"regular": 2, "tdt": 9, "multiblank": 5}[topo]
        where = f"{topo} U+1={U1} loop {loop}"
        assert int(loads) == 2 * kinds, f"{where}: {loads} loads"
        assert int(first) == int(loads), f"{where}: {first} of {loads} loads first"
        assert int(spills) == 0, f"{where}: {spills} spills in loops ({stack} bytes of stack, " \
                                 f"{reg} registers)"


ROW_SASS_SCRIPT = """
import os, sys
import triton
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
if not os.path.exists(tool):
    print("no nvdisasm")
    sys.exit(0)
import row_sass
for row in row_sass.analyse(90, (1024, 1025), ("regular", "tdt")):
    print(*row)
for row in row_sass.analyse_grad(90, (1025,), ("tdt",)):
    print("grad", *row)
for tiles, topos in ((None, ("regular",)), ([(16, 128)], ("tdt",))):
    for row in row_sass.analyse_early(90, (1024,), topos, tiles):
        print("early", *row)
"""


def test_row_lanes_loop_has_no_cross_lane_reduction_on_sm90():
    """The row pass with its reductions once a row (``gpu.ROW_LANES``) compiles, for sm_90 as
    the backend launches it, to a chunk loop without a warp shuffle or a barrier (the groups'
    max and sum stay in each thread: ``tl.reshape`` of a thread's 16-byte load moves no data)
    and with fewer instructions than the loop that reduces every chunk across the row
    (``benchmarks/row_sass.py``): aligned rows (V = 1024) and rows from the span (V = 1025,
    TDT), no spill inside a loop (see ``SASS_SPILLS``). And the gradient pass over TDT's rows
    by their whole 16-byte groups (``gpu.SPAN_GRAD``): every load and store of its loop 16
    bytes wide, and fewer instructions a row, in the loop and once a program, than an entry
    a load, with TDT's duration group before the loop or after it
    (``gpu.GRAD_DURATIONS_LAST``: fewer registers after it). And the row
    pass's reads ahead of its loop (``gpu.ROW_EARLY``, either way of the span's prefetch):
    no global load after the chunk loop, where without it there are some."""
    out = subprocess.run([sys.executable, "-c", ROW_SASS_SCRIPT], env=_compile_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    if "no nvdisasm" in out.stdout:
        pytest.skip("this Triton build has no nvdisasm")
    lines = [line.split() for line in out.stdout.splitlines() if line.strip()]
    # (SPAN_GRAD, DUR_LAST) -> tile, registers, stack, spills in loops, loop, LDG, STG, all,
    # per 32, once;
    # the loss's pass (a fused tile's, with CHECK, comes after it)
    grad = {}
    for r in lines:
        if r[0] == "grad":
            grad.setdefault((int(r[3]), int(r[4])), r[5:])
    assert set(grad) == {(0, 0), (1, 0), (1, 1)}, out.stdout
    for dur_last in (0, 1):
        span = grad[1, dur_last]
        for op in (5, 6):                                  # "LDG 16-byte/all", "STG ..."
            wide, every = (int(x) for x in span[op].split("/"))
            assert wide == every > 0, out.stdout
        assert int(span[3]) == 0, out.stdout               # no spill in a loop
        for col in (-2, -1):                               # per 32 classes; once a program
            assert float(span[col]) < float(grad[0, 0][col]), out.stdout
    # TDT's duration group after the loop (gpu.GRAD_DURATIONS_LAST): fewer registers (Triton
    # 3.6: 68 against 96, 7 programs a multiprocessor against 5; 3.9: 82 against 94)
    assert int(grad[1, 1][1]) < int(grad[1, 0][1]), out.stdout
    early = [r[1:] for r in lines if r[0] == "early"]
    assert {r[0] for r in early} == {"regular", "tdt"} and len(early) == 6, out.stdout
    for topo, V, tile, prefetch, ahead, reg, stack, spills, loop, before, after in early:
        # no spill in a loop where ROW_EARLY alone would launch it: the chunks' prefetch as
        # launched (aligned rows: ROW_PREFETCH; the span's: SPAN_PREFETCH, off). With both on,
        # Triton 3.7.1 and 3.8.0 spill in TDT's loop (2 and 1 accesses; 3.6 and 3.9 do not)
        launched = gpu.ROW_PREFETCH if topo == "regular" else gpu.SPAN_PREFETCH
        assert int(loop) > 0 and (int(spills) == 0 or prefetch != str(int(launched))), \
            out.stdout
        assert (int(after) == 0) == (ahead == "1"), (topo, tile, prefetch, ahead, out.stdout)
    rows = {(r[0], int(r[1]), int(r[2])): [int(v) for v in r[3:]]
            for r in lines if r[0] not in ("grad", "early")}
    assert {(t, V) for t, V, _ in rows} == {(t, V) for t in ("regular", "tdt")
                                            for V in (1024, 1025)}, out.stdout
    for (topo, V, lanes), (reg, stack, spills, loop, shuffles, barriers, total) in rows.items():
        assert spills == 0 and loop > 0, (topo, V, lanes, out.stdout)
        if lanes:
            chunks = rows[topo, V, 0]
            assert shuffles == 0 and barriers == 0, (topo, V, out.stdout)
            assert chunks[4] > 0 and loop < chunks[3], (topo, V, out.stdout)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_native():                                               # pragma: no cover
    """The compiled kernels on CUDA, in a subprocess (this one runs the interpreter):
    ``cuda_checks.py`` — no host synchronisation for any option (sync debug mode "error"),
    forward+backward replayed from a CUDA graph equal to eager, and exactness against the
    float64 reference at the benchmark shapes and U > 1024 (gradient <= 1e-5 of scale)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "cuda_checks.py")
    out = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                         timeout=1800)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout + out.stderr[-4000:]


def test_interpreter_patches_the_language_once_a_launch(monkeypatch):
    """The suite's interpreter (``support/interpreter.py``, installed by conftest.py)
    patches ``triton.language`` once a launch, not again at each call of a ``@triton.jit``
    helper inside it (Triton's own interpreter does, to the same builtins: about 30% of its
    time in these tests); and the results are the interpreter's own: a loss and its
    gradient equal to the same call through Triton's own device-function call."""
    from triton.runtime import interpreter as itp

    from support import interpreter
    assert interpreter.install()
    calls = []
    real = itp._patch_lang
    monkeypatch.setattr(itp, "_patch_lang", lambda fn: calls.append(fn.__name__) or real(fn))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 6, generator=g)
    y, tl_, ul = torch.tensor([[1, 2], [3, 0]]), torch.tensor([5, 4]), torch.tensor([2, 1])

    def step():
        xx = x.clone().requires_grad_()
        loss = rnnt_lattice.rnnt_loss(xx, y, tl_, ul, blank=0, backend="triton")
        loss.backward()
        return loss.detach(), xx.grad

    fast = step()
    launches = sum(name.endswith("_kernel") for name in calls)
    # each launch, and at most once in it Triton's own helpers' module (tl.max and co.)
    assert launches and len(calls) <= 2 * launches, calls
    monkeypatch.setattr(itp.InterpretedFunction, "__call__",
                        itp.InterpretedFunction._rnnt_lattice_original)       # Triton's own
    calls.clear()
    slow = step()
    assert sum(name.endswith("_kernel") for name in calls) == launches
    assert len(calls) > 10 * launches, calls                                   # every helper call
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])


@triton.jit
def _wrapping_int32_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i)
    tl.store(out_ptr + i, x * x + x - 7)           # int32: wraps past 2^31


def _interpreted_work():
    """Losses and gradients through the interpreter that exercise the shortcuts: int32
    offsets, every dtype table entry the kernels read, blocks of one shape and of two."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 6 + 2, generator=g)
    y, tl_, ul = torch.tensor([[1, 2], [3, 0]]), torch.tensor([5, 4]), torch.tensor([2, 1])
    out = []
    for kind in ("regular", "tdt"):
        xx = x.clone().requires_grad_() if kind == "tdt" else x[..., :6].clone().requires_grad_()
        if kind == "tdt":
            loss = rnnt_lattice.tdt_loss(xx, y, tl_, ul, blank=5, durations=[0, 1],
                                         backend="triton", reduction="none")
        else:
            loss = rnnt_lattice.rnnt_loss(xx, y, tl_, ul, blank=0, backend="triton",
                                          reduction="none")
        (loss * torch.tensor([1.0, -0.5])).sum().backward()
        out += [loss.detach(), xx.grad]
    joiner = rnnt_lattice.Joiner(4, 4, 8, 6)
    torch.manual_seed(1)
    for p in joiner.parameters():
        torch.nn.init.normal_(p)
    enc = torch.randn(2, 5, 4, generator=g, requires_grad=True)
    pred = torch.randn(2, 3, 4, generator=g, requires_grad=True)
    loss = rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, y, tl_, ul, blank=0,
                                        backend="triton")
    loss.backward()
    out += [loss.detach(), enc.grad, pred.grad, *(p.grad for p in joiner.parameters())]
    ints = torch.tensor([2 ** 20, -(2 ** 20) - 3, 46341, 5], dtype=torch.int32)
    wrapped = torch.empty_like(ints)
    _wrapping_int32_kernel[(1,)](ints, wrapped, BLOCK=4)
    return out + [wrapped]


def test_interpreter_shortcuts_change_no_value(monkeypatch):
    """The suite's interpreter also skips what Triton's interpreter computes and drops or
    already has (``support/interpreter.py``): the integer overflow checks (``debug`` off:
    never asserted), the NumPy dtype table rebuilt at each operation, the broadcast of two
    blocks of one shape. Each is in effect, and losses, gradients (regular, TDT, the
    joiner's kernels: matrix products and broadcasts of two shapes) and an int32 product
    that wraps past 2^31 are bit for bit those of Triton's own ways."""
    import dataclasses

    from triton.runtime import interpreter as itp

    from support import interpreter
    assert interpreter.install()
    builder, semantic = itp.interpreter_builder, itp.interpreter_semantic
    assert builder.options.debug is False and builder.options.sanitize_overflow is False
    assert hasattr(itp._get_np_dtype, "_rnnt_lattice_original")
    assert "broadcast_impl_value" in vars(semantic)
    fast = _interpreted_work()
    monkeypatch.setattr(builder, "options",
                        dataclasses.replace(builder.options, sanitize_overflow=True))
    monkeypatch.setattr(itp, "_get_np_dtype", itp._get_np_dtype._rnnt_lattice_original)
    monkeypatch.delattr(semantic, "broadcast_impl_value")
    slow = _interpreted_work()
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    want = [(v * v + v - 7 + 2 ** 31) % 2 ** 32 - 2 ** 31
            for v in (2 ** 20, -(2 ** 20) - 3, 46341, 5)]
    assert fast[-1].tolist() == want


def test_cuda_checks_script_under_the_interpreter():
    """The CUDA check script itself, on tiny lattices through the interpreter: a GPU run
    must not be the first time it executes."""
    script = os.path.join(os.path.dirname(__file__), "cuda_checks.py")
    out = subprocess.run([sys.executable, script, "--smoke"], env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout + out.stderr[-4000:]


# The package's own source files, by directory: frames are matched by where their file
# lies, never by a name, so a checkout in a folder named "rnnt_lattice" (whose tests/ and
# virtual environment would match a substring) changes nothing.
PACKAGE_DIR = os.path.join(os.path.dirname(os.path.realpath(rnnt_lattice.__file__)), "")


@pytest.mark.parametrize("order", ["atomics", "ordered"])
@pytest.mark.parametrize("block", [8, None], ids=["block8", "default"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_simple_rescue_kernel(dtype, block, order, monkeypatch):
    """The simple losses' log-domain rescue on the Triton kernel (what CUDA runs) against
    logsumexp and its autograd gradient: the marked nodes only (others -inf, no gradient),
    strided am (a Conv1d head's transpose), logits 500 nats apart; programs of 8 nodes
    (two of them with no marked node, the last one partly past the nodes) or the
    default's one program. The backward with atomics, or under
    ``torch.use_deterministic_algorithms(True)`` a program per row of a side, its nodes
    in order (``_simple_rescue_rows_kernel``: rows with no marked node, a dead one, the
    marks read 2 at a time and the classes 4 at a time with the smaller block), and with
    one side not wanted (None)."""
    if block:
        monkeypatch.setattr(gpu, "RESCUE_BLOCK_NODES", block)
        monkeypatch.setattr(gpu, "RESCUE_ROWS_BLOCK_K", 2)           # marks 2 at a time
        monkeypatch.setattr(gpu, "RESCUE_BLOCK_V", 4)                # classes 4 at a time
    g = torch.Generator().manual_seed(0)
    am = (500 * torch.randn(2, 7, 6, generator=g, dtype=torch.float64)).to(dtype)
    am = am.transpose(1, 2)                                            # (B, T, V), strided
    lm = (500 * torch.randn(2, 5, 7, generator=g, dtype=torch.float64)).to(dtype)
    need = torch.rand(2, 6, 5, generator=g) < 0.5
    need.view(-1)[24:40] = False                                       # two blocks of 8
    need[0, 0, 0] = need[1, 5, 4] = True                               # the last node
    need[1, 2] = False                                                 # an am row, none
    need[0, :, 3] = False                                              # an lm row, none
    lm[0, 0] = float("-inf")                                           # a dead marked node
    up = torch.randn(2, 6, 5, generator=g, dtype=torch.float64)
    lse = gpu.simple_rescue(am, lm, need)
    x = am.double()[:, :, None] + lm.double()[:, None]                 # (B, T, U+1, V)
    want = torch.logsumexp(x, -1)
    live = need & (want > float("-inf"))
    p = torch.where(live[..., None], torch.exp(x - want[..., None]) * up[..., None], 0.0)
    assert torch.equal(lse[~need], torch.full_like(lse[~need], float("-inf")))
    assert lse[0, 0, 0] == float("-inf")
    tol = 64 * torch.finfo(torch.float64).eps * 500
    torch.testing.assert_close(lse[need], want[need], rtol=tol, atol=tol)
    base = (torch.randn(am.shape, generator=g, dtype=torch.float64),
            torch.randn(lm.shape, generator=g, dtype=torch.float64))
    for wanted in ((True, True), (True, False), (False, True)):
        grads = [b.clone() if w else None for b, w in zip(base, wanted)]
        with deterministic_algorithms(order == "ordered"):
            gpu.simple_rescue_backward(am, lm, need, lse, up, *grads)
        for grad, b, sums in zip(grads, base, (p.sum(2), p.sum(1))):
            if grad is not None:
                torch.testing.assert_close(grad, b + sums, rtol=tol, atol=tol)


class _RecordSyncSites(_RecordOps):
    """Records, for every syncing op, the innermost function of the package (a file under
    ``PACKAGE_DIR``) that ran it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(f"aten.{name}" in str(func) for name in SYNCING_OPS):
            import traceback
            frames = [f for f in traceback.extract_stack()
                      if os.path.realpath(f.filename).startswith(PACKAGE_DIR)]
            self.ops.append(frames[-1].name if frames else "?")
        return func(*args, **(kwargs or {}))


def test_pruned_pipeline_synchronises_once(device_checks):
    """The pruned pipeline on the Triton kernels, structurally (see
    ``test_hot_path_never_synchronises``), the value checks on the device path: the
    smoothed loss, its backward and the pruned loss read nothing on the host;
    ``prune_ranges`` reads once (``_window_size``: the window actually used sets the
    output's shape). The window DP's kernel is the Numba one on CPU tensors (its Triton
    twin is checked by ``cuda_checks.py``), so its conversions are set aside."""
    B, T, U, V = 3, 7, 4, 6
    g = torch.Generator().manual_seed(0)
    am = torch.randn(B, T, V, generator=g, requires_grad=True)
    lm = torch.randn(B, U + 1, V, generator=g, requires_grad=True)
    y = torch.randint(1, V, (B, U), generator=g)
    tl, ul = torch.tensor([7, 5, 5]), torch.tensor([4, 3, 3])
    sites = {}
    for step in ("smoothed", "ranges", "pruned"):
        with _RecordSyncSites() as rec:
            if step == "smoothed":
                loss, occ = rnnt_lattice.rnnt_loss_smoothed(lm, am, y, tl, ul, blank=0,
                                                            backend="triton",
                                                            return_occupations=True)
                loss.backward()
            elif step == "ranges":
                win = rnnt_lattice.prune_ranges(occ, 3)
            else:
                logits = torch.randn(B, T, win.window, V, generator=g, requires_grad=True)
                rnnt_lattice.rnnt_loss_pruned(logits, y, win.ranges, tl, ul, blank=0,
                                              backend="triton").backward()
        sites[step] = [s for s in rec.ops if s != "window_dp"]
    assert sites == {"smoothed": [], "ranges": ["_window_size"], "pruned": []}, sites


# --------------------------------------------------------------------------- launch sizes
class _CountSlots:
    """Wraps a kernel of the V passes: the row slots its launches scan (programs x ROWS),
    each program running its loop over V whether its rows are live or masked."""

    def __init__(self, kernel):
        self.kernel, self.slots = kernel, 0

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.slots += grid[0] * kwargs["ROWS"]
            return launch(*args, **kwargs)
        return run


def _count_slots(monkeypatch):
    counters = {name: _CountSlots(getattr(gpu.kernels, name))
                for name in ("_row_kernel", "_grad_kernel")}
    for name, counter in counters.items():
        monkeypatch.setattr(gpu.kernels, name, counter)
    return counters


def test_fused_passes_launch_over_the_tile(monkeypatch):
    """The fused loss's row and gradient passes run, for each tile, programs over the
    tile's rows, not over the whole lattice: a forward+backward scans about twice the
    lattice's nodes (one row pass, one gradient pass), whatever the number of tiles (here
    32 tiles of 8 rows; launched over the whole grid per tile, it was 64x the nodes)."""
    B, T, U, V = 2, 16, 7, 8
    g = torch.Generator().manual_seed(0)
    out = torch.nn.Linear(4, V, bias=False, dtype=torch.float64)
    with torch.no_grad():
        out.weight.copy_(torch.randn(V, 4, generator=g, dtype=torch.float64))
    w = out.weight
    enc = torch.randn(B, T, 4, generator=g, dtype=torch.float64, requires_grad=True)
    pred = torch.randn(B, U + 1, 4, generator=g, dtype=torch.float64)
    targets = torch.randint(1, V, (B, U), generator=g)
    tl, ul = torch.tensor([T, T - 3]), torch.tensor([U, U - 2])

    class Joiner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.out = out

        def forward(self, e, p):
            return self.out(torch.tanh(e + p))

    joiner = Joiner()
    counters = _count_slots(monkeypatch)
    loss = rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul, blank=0, tile=8,
                                        backend="triton", reduction="sum")
    loss.backward()
    nodes = B * T * (U + 1)
    assert counters["_row_kernel"].slots <= 2 * nodes, counters["_row_kernel"].slots
    assert counters["_grad_kernel"].slots <= 2 * nodes, counters["_grad_kernel"].slots
    # and the values: the same call on the materialised logits
    grads = [x.grad.clone() for x in (enc, w)]
    enc.grad = w.grad = None
    full = rnnt_lattice.rnnt_loss(joiner(enc[:, :, None], pred[:, None]), targets, tl, ul,
                                  blank=0, backend="torch", reduction="sum")
    full.backward()
    torch.testing.assert_close(loss, full, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, (enc.grad, w.grad)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_pruned_passes_launch_over_the_windows(monkeypatch):
    """The pruned loss's row and gradient passes run programs over the B*T*R window rows,
    not over the B*T*(U+1) nodes of the lattice (R = 3 of U + 1 = 21 label positions)."""
    B, T, U, V, R = 2, 6, 20, 6, 3
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(B, T, R, V, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(1, V, (B, U), generator=g)
    tl, ul = torch.tensor([T, T - 1]), torch.tensor([U, U - 4])
    starts = torch.arange(T) * (U + 1 - R) // (T - 1)                      # (T,) rising
    ranges = (starts[None, :, None] + torch.arange(R)).expand(B, T, R).contiguous()
    counters = _count_slots(monkeypatch)
    costs = rnnt_lattice.rnnt_loss_pruned(logits, targets, ranges, tl, ul, blank=0,
                                          backend="triton", reduction="none")
    costs.sum().backward()
    rows = B * T * R
    assert counters["_row_kernel"].slots <= 2 * rows, counters["_row_kernel"].slots
    assert counters["_grad_kernel"].slots <= 2 * rows, counters["_grad_kernel"].slots
    grad = logits.grad.clone()
    logits.grad = None
    want = rnnt_lattice.rnnt_loss_pruned(logits, targets, ranges, tl, ul, blank=0,
                                         backend="torch", reduction="none")
    want.sum().backward()
    torch.testing.assert_close(costs, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, logits.grad, rtol=1e-9, atol=1e-10)


# --------------------------------------------------------------------------- options
@pytest.mark.parametrize("clamp", [float("inf"), 1e39, 1e300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", ["numba", "triton"])
def test_clamp_beyond_float32_is_no_clamp(backend, dtype, clamp):
    """A clamp that no float32 can hold (``clamp=inf`` included) clips nothing: finite, and
    equal to the torch backend on the same call (``gpu._f64_parts`` once split inf into
    ``(inf, nan, nan)``: NaN gradients)."""
    batch = make_batch(CASES["ragged"])
    costs, grad, _ = run(batch, dtype, backend, clamp=clamp, fastemit_lambda=0.1)
    costs_ref, grad_ref, _ = run(batch, dtype, "torch", clamp=clamp, fastemit_lambda=0.1)
    assert torch.isfinite(grad).all()
    tol = tolerance(dtype, costs_ref)
    loss_err, grad_err = errors(costs, grad, costs_ref, grad_ref)
    assert loss_err <= tol and grad_err <= tol, (loss_err, grad_err)


@pytest.mark.parametrize("x", [0.1, -1e-30, 3.0e38, 3.4028235e38, 1e39, -1e300, float("inf"),
                               float("-inf")])
def test_f64_parts(x):
    """The three float32 parts of a float64 option sum to it within float32's range, and
    to the signed infinity beyond it; each part is a float32 value, none NaN."""
    import numpy as np
    parts = gpu._f64_parts(x)
    assert all(float(np.float32(p)) == p for p in parts) and not any(p != p for p in parts)
    total = (parts[0] + parts[1]) + parts[2]
    assert total == (x if abs(x) <= gpu.F32_MAX else x * float("inf"))


@triton.jit
def _exp_nonpos_probe(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, gpu.kernels._exp_nonpos(tl.load(x_ptr + i)))


def _exp_nonpos_of(x: torch.Tensor) -> torch.Tensor:
    """``kernels._exp_nonpos`` of a float64 vector, through a one-program kernel."""
    out = torch.empty_like(x)
    _exp_nonpos_probe[(1,)](x, out, N=x.numel())
    return out


def test_exp_nonpos():
    """The lattice's float64 exp of terms ``x - max <= 0`` (``kernels._exp_nonpos``, no
    branch): within 1.5 ulp of ``torch.exp`` in float64 over [-708, 0], ``exp(0) = 1``
    exactly (the max's own term), ``exp(-708)`` below -708 (-inf included: a term that
    vanishes beside that 1), NaN for NaN."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([-708 * torch.rand(3000, generator=g, dtype=torch.float64),
                   -torch.rand(600, generator=g, dtype=torch.float64),
                   -1e-9 * torch.rand(200, generator=g, dtype=torch.float64),
                   torch.linspace(-708, 0, 200, dtype=torch.float64),
                   torch.tensor([0.0, -0.0, -5e-324, -1e-300, -0.5 * math.log(2), -708.0,
                                 -700.5, -1.0, -2.0], dtype=torch.float64)])
    x = torch.cat([x, torch.zeros(4096 - x.numel(), dtype=torch.float64)])
    got, want = _exp_nonpos_of(x), torch.exp(x)
    up = torch.nextafter(want, torch.tensor(math.inf, dtype=torch.float64))
    ulp = (got - want).abs() / (up - want)
    assert ulp.max() <= 1.5, (ulp.max(), x[ulp.argmax()])
    assert (got[x == 0] == 1.0).all()
    special = torch.tensor([-708.5, -745.2, -1e300, -math.inf, math.nan, 0.0, 0.0, 0.0],
                           dtype=torch.float64)
    got = _exp_nonpos_of(special)
    floor = _exp_nonpos_of(torch.full((8,), -708.0, dtype=torch.float64))[0]
    assert (got[:4] == floor).all() and 0 < floor < 1e-307 and 1.0 + 9 * floor == 1.0
    assert got[4].isnan()


@triton.jit
def _lse_kinds_probe(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    xs = (tl.load(x_ptr + i), tl.load(x_ptr + N + i), tl.load(x_ptr + 2 * N + i))
    acc, _ = gpu.kernels._lse_kinds(xs, 3, False)
    tl.store(out_ptr + i, acc)


def test_lse_kinds_nan_and_no_arc():
    """The lattice's log-sum-exp over the kinds (``kernels._lse_kinds``) against
    ``torch.logsumexp`` in float64, term by term: -inf terms (no arc) add nothing, all -inf
    gives -inf, and a NaN in any position gives NaN, also beside -inf terms only."""
    inf, nan = math.inf, math.nan
    cols = [(0.0, -1.0, -2.0), (-3.0, -inf, -inf), (-inf, -inf, -inf), (-inf, -inf, -5.0),
            (nan, -1.0, -2.0), (-1.0, nan, -2.0), (-1.0, -2.0, nan), (nan, -inf, -inf),
            (-inf, nan, -inf), (-inf, -inf, nan), (-800.0, -1.0, -1500.0), (2.5, 2.5, 2.5),
            (-1e300, -inf, -1e300), (nan, nan, nan), (0.0, -inf, -0.0), (-7.0, -7.0, -inf)]
    x = torch.tensor(cols, dtype=torch.float64).T.contiguous()          # (3, 16)
    out = torch.empty(16, dtype=torch.float64)
    _lse_kinds_probe[(1,)](x, out, N=16)
    want = torch.logsumexp(x, 0)
    assert torch.equal(out.isnan(), want.isnan()), (out, want)
    ok = ~want.isnan()
    torch.testing.assert_close(out[ok], want[ok], rtol=1e-15, atol=0)


@pytest.mark.parametrize("T, U1", [(0, 1), (0, 4), (1, 1), (2, 4), (3, 9), (5, 6), (6, 6),
                                   (9, 3), (40, 81)])
def test_skewed_planes_keep_each_diagonal_adjacent(T, U1):
    """The lattice state's node arrays are skewed planes (``gpu._skew``): every node ``(t,
    u)``, ``t <= T``, has its own offset inside the plane, which is less than twice the node
    grid, and the nodes of each anti-diagonal (the lattice pass's lanes) lie at consecutive
    offsets. The device computes the host's offsets: ``kernels._skew`` and the row passes'
    ``_row_plane_at``, in both of its forms where they apply (``WIDE``, ``U+1 > T+1``)."""
    s_t, s_u, plane = gpu._skew(T, U1)
    t, u = (x.flatten() for x in torch.meshgrid(torch.arange(T + 1), torch.arange(U1),
                                                indexing="ij"))
    at = t * s_t + u * s_u
    assert int(at.min()) >= 0 and int(at.max()) < plane and at.unique().numel() == at.numel()
    assert plane < 2 * (T + 1) * U1
    for d in range(T + U1):
        assert (at[(t + u) == d].sort().values.diff() == 1).all(), d
    n = 1 << max(T * U1 - 1, 0).bit_length()
    for wide in {True, U1 > T + 1}:
        out = torch.full((4 + n,), -1, dtype=torch.int64)
        skew_probe[(1,)](out, T, U1, N=n, WIDE=wide)
        assert out[:4].tolist() == [s_t, s_u, plane, plane], (wide, out[:4])
        assert out[4:4 + T * U1].tolist() == at[t < T].tolist(), wide


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("blocks", ["one", "many"])
def test_k2_starts_kernel_is_the_reference(dtype, blocks, monkeypatch):
    """``prune_ranges(method="k2")``'s starts on the device (``gpu.k2_starts``, one program a
    sequence) are the reference's (``torch_backend.k2_starts``) exactly: occupations with a
    peak a frame and tiny edges (k2's case for its order of sums), ties broken to the first
    start, a NaN sequence, ends before the last frame, a sequence without frames, strided
    occupations (a plane of ``(B, K, T, U+1)``) and ends (a boundary's columns); with the
    frames in one tile and one scan block, and in many of each."""
    if blocks == "many":
        monkeypatch.setattr(gpu, "K2_TILE", 8)          # 1-2 frames a tile
        monkeypatch.setattr(gpu, "K2_SCAN", 4)          # the repair's scans in blocks of 4
    g = torch.Generator().manual_seed(1)
    B, T, U1 = 5, 13, 9
    planes = 10.0 ** (-9 + 3 * torch.rand(B, 2, T, U1, generator=g, dtype=torch.float64))
    peak = torch.randint(0, U1, (B, T), generator=g).sort(1).values
    planes[:, 0].scatter_(2, peak[..., None], 0.5)
    planes[1] = torch.randint(0, 3, (2, T, U1), generator=g).double() / 4      # exact ties
    planes[3, :, 5:] = float("nan")                                            # a NaN sequence
    planes = planes.to(dtype)
    gb, gl = planes[:, 0], planes[:, 1]
    bound = torch.tensor([[0, 0, 8, 13], [0, 0, 5, 9], [0, 0, 3, 13], [0, 0, 8, 0],
                          [0, 0, 0, 4]])
    t_end, u_end = bound[:, 3], bound[:, 2]                                   # stride 4
    for R, R_e in ((1, 2), (2, 2), (3, 3), (5, 5), (3, 2), (9, 9)):
        got = gpu.k2_starts(gb, gl, t_end, u_end, R, R_e)
        want = torch_backend.k2_starts(gb, gl, t_end, u_end, R, R_e)
        assert got.dtype == torch.int64 and torch.equal(got, want), (R, R_e, got, want)


def test_k2_starts_takes_the_reference_where_the_kernel_does_not_apply(monkeypatch):
    """``gpu.k2_starts``'s other branches: occupations of two dtypes (the reference promotes
    their difference; the kernel would sum in one) and more starts than ``K2_MAX_STARTS``
    run the reference, without launching the kernel, and give its starts."""
    from rnnt_lattice.gpu import kernels
    launches = []
    real = kernels._k2_starts_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(kernels, "_k2_starts_kernel", Counted())
    g = torch.Generator().manual_seed(2)
    gb, gl = torch.rand(2, 2, 7, 6, generator=g, dtype=torch.float64)
    ends = torch.tensor([7, 5]), torch.tensor([5, 3])
    want = torch_backend.k2_starts(gb, gl.float(), *ends, 3, 3)
    assert torch.equal(gpu.k2_starts(gb, gl.float(), *ends, 3, 3), want) and not launches
    monkeypatch.setattr(gpu, "K2_MAX_STARTS", 3)                       # 4 starts at R = 3
    want = torch_backend.k2_starts(gb, gl, *ends, 3, 3)
    assert torch.equal(gpu.k2_starts(gb, gl, *ends, 3, 3), want) and not launches
    monkeypatch.setattr(gpu, "K2_MAX_STARTS", 4)
    assert torch.equal(gpu.k2_starts(gb, gl, *ends, 3, 3), want) and len(launches) == 1


@pytest.mark.parametrize("over", ["frames", "labels", "both"])
def test_out_of_range_lengths_stay_in_their_block(over):
    """Lengths past the grid (not validated on CUDA: undefined behaviour there) are clamped
    to it in the kernels (``kernels._ends``): the last sequence's lattice never writes past
    its block (into the first sequence's beta, which follows alpha in the workspace), so
    the call equals the one with the lengths clamped, bit for bit."""
    B, T, U, V = 2, 4, 3, 5
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(B, T, U + 1, V, generator=g)
    targets = torch.randint(1, V, (B, U), generator=g)
    tl, ul = torch.tensor([T - 1, T]), torch.tensor([U - 1, U])
    bad_tl, bad_ul = tl.clone(), ul.clone()
    if over in ("frames", "both"):
        bad_tl[1] = T + 2
    if over in ("labels", "both"):
        bad_ul[1] = U + 1
    opts = LossOptions(0, clamp=0.5)
    out = []
    for lengths in ((tl, ul), (bad_tl, bad_ul)):
        costs, saved, state = gpu.loss_forward(logits, targets, *lengths, opts, True)
        grad = gpu.loss_backward(saved, state, torch.ones(B), opts)
        out.append((costs, grad))
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=0)


@pytest.mark.parametrize("rnnt_type", ["regular", "constrained"])
def test_delay_penalty_never_synchronises(device_checks, rnnt_type):
    """The delay penalty of the simple and smoothed losses and of ``lattice_loss`` on the
    Triton kernels, structurally (see ``test_hot_path_never_synchronises``): forward and
    backward read nothing on the host and build no tensor from Python values (the penalty
    per arc kind once came from ``torch.tensor([k.delay ...], device=...)``). The value
    checks run on the device path, as on CUDA."""
    B, T, U, V = 2, 5, 3, 6
    g = torch.Generator().manual_seed(3)
    am = torch.randn(B, T, V, generator=g, requires_grad=True)
    lm = torch.randn(B, U + 1, V, generator=g, requires_grad=True)
    y = torch.randint(1, V, (B, U), generator=g)
    tl, ul = torch.tensor([5, 4]), torch.tensor([3, 2])
    wb = torch.randn(B, T, U + 1, generator=g, requires_grad=True)
    we = torch.randn(B, T, U + 1, generator=g, requires_grad=True)
    kw = dict(rnnt_type=rnnt_type, delay_penalty=0.25, backend="triton")
    sites = {}
    for name in ("rnnt_loss_simple", "rnnt_loss_smoothed", "lattice_loss"):
        with _RecordSyncSites() as rec:
            if name == "lattice_loss":
                loss = rnnt_lattice.lattice_loss(wb, we, tl, ul, **kw).sum()
            else:
                loss = getattr(rnnt_lattice, name)(lm, am, y, tl, ul, blank=0, **kw)
            loss.backward()
        sites[name] = rec.ops
    assert sites == {"rnnt_loss_simple": [], "rnnt_loss_smoothed": [], "lattice_loss": []}, sites


@pytest.mark.parametrize("mix", [False, True], ids=["simple", "smoothed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tiles", ["one", "many"])
@pytest.mark.parametrize("U1", [7, 1])
def test_arc_terms_kernels_are_the_reference(mix, dtype, tiles, U1, monkeypatch):
    """The simple losses' arc log-probs and their backward on the Triton kernels
    (``gpu.arc_terms``, what CUDA runs) against the reference (``support.simple_parts``:
    every kind of node, NaN and strided upstream gradients, either one absent with the
    default tiles); the tiles of the default (one chunk of label positions, one step of the
    column sums) and many (2 x 4 nodes a program, the column sums 2 blocks x 4 positions at
    a time, partial chunks); U = 0."""
    if tiles == "many":
        monkeypatch.setattr(gpu, "ARC_TILE", 8)
        monkeypatch.setattr(gpu, "ARC_MAX_BLOCK_U", 4)
        monkeypatch.setattr(gpu, "ARC_COLS", (2, 4))
    check_arc_terms(gpu, dtype, U1, mix, absent=tiles == "one")


@pytest.mark.parametrize("order", ["atomics", "ordered"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tiles", ["one", "many"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "transposed"])
def test_simple_rows_kernels_are_the_reference(dtype, tiles, contiguous, order, monkeypatch):
    """The simple losses' rows and their backward on the Triton kernels (``gpu.simple_rows``)
    against the reference (``support.simple_parts.check_simple_rows``), in one step of a
    row's classes and entries, and in many (2 rows of 4 classes, entries 2 at a time); the
    entries' gradients added with atomics, or under ``torch.use_deterministic_algorithms``
    one entry of a row at a time (``ORDERED``)."""
    if tiles == "many":
        monkeypatch.setattr(gpu, "ROWS_TILE", 12)
        monkeypatch.setattr(gpu, "ROWS_MAX_BLOCK_V", 4)
        monkeypatch.setattr(gpu, "ROWS_BLOCK_J", 2)
    with deterministic_algorithms(order == "ordered"):
        check_simple_rows(gpu, dtype, contiguous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("block", [None, 4], ids=["default", "block4"])
@pytest.mark.parametrize("groups", [1, 3])
def test_rows_sum_kernel_is_the_reference(dtype, block, groups, monkeypatch):
    """``do_rnnt_pruning``'s backward on the Triton kernel (``gpu.rows_sum``: each output
    row's entries found by a scan of its group, then added in order): against ``index_add_``
    on the CPU, bit for bit in float32 and float64 (the same additions in the same order),
    and in bfloat16 the float64 sum rounded once (ours adds in float32, index_add_ in
    bfloat16); indices out of order, repeated, missing (a zero row), in one group or in
    three (each pointing into its own rows), a strided gradient; columns in blocks of 4,
    the scan 4 indices a step and the sum 2 rows a step; and through ``do_rnnt_pruning``
    with the backend a GPU takes."""
    if block:
        monkeypatch.setattr(gpu, "ROWS_SUM_BLOCK_D", block)
        monkeypatch.setattr(gpu, "ROWS_SUM_BLOCK_M", block)
        monkeypatch.setattr(gpu, "ROWS_SUM_CHUNK", 2)
    g = torch.Generator().manual_seed(5)
    N, D, n_out = 24, 10, 9
    per = n_out // groups
    index = torch.randint(0, per - 1, (N,), generator=g)                   # a group's last: none
    index += torch.arange(groups).repeat_interleave(N // groups) * per
    grad = torch.randn(D, N, generator=g, dtype=torch.float64).to(dtype).t()   # strided
    got = gpu.rows_sum(grad, index, n_out, groups)
    assert got.dtype == dtype and got.shape == (n_out, D)
    if dtype == torch.bfloat16:
        # the float32 sum rounded once: within one bfloat16 ulp of the float64 sum (the
        # interpreter rounds to bfloat16 towards zero, a GPU to the nearest)
        want = torch_backend.rows_sum(grad.double(), index, n_out)
        assert ((got.double() - want).abs() <= 2 ** -7 * want.abs()).all()
    else:
        assert torch.equal(got, torch_backend.rows_sum(grad, index, n_out))
    assert (got[-1] == 0).all()
    from rnnt_lattice import _backends
    resolve = _backends.resolve
    monkeypatch.setattr(_backends, "resolve", lambda backend, device: gpu if backend == "auto"
                        else resolve(backend, device))
    am = torch.randn(2, 6, 3, generator=g, dtype=torch.float64)
    lm = torch.randn(2, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    # k2's windows in sequence 0; starts that go back in sequence 1
    ranges = torch.tensor([[0, 0, 1, 1, 2, 2], [2, 0, 1, 2, 0, 1]])[..., None] + torch.arange(2)
    w = torch.randn(2, 6, 2, 5, generator=g, dtype=torch.float64)
    (rnnt_lattice.do_rnnt_pruning(am, lm, ranges)[1] * w).sum().backward()
    want = torch.zeros_like(lm)
    for b, t, k in itertools.product(range(2), range(6), range(2)):
        want[b, ranges[b, t, k]] += w[b, t, k]
    torch.testing.assert_close(lm.grad, want, rtol=1e-15, atol=1e-15)


def test_selfcheck_pruning_rows_on_the_gpu_backend(monkeypatch):
    """``rnnt-lattice check``'s ``do_rnnt_pruning`` check as it runs on CUDA (the Triton
    backend's ``rows_sum``, its bfloat16 branch included), here under the interpreter."""
    from rnnt_lattice import _backends, selfcheck
    resolve = _backends.resolve
    monkeypatch.setattr(_backends, "resolve", lambda backend, device: gpu if backend == "auto"
                        else resolve(backend, device))
    ctx = selfcheck.Context("cpu", "triton", selfcheck.plan_for("cpu", "smoke"), "smoke")
    line = selfcheck.check_pruning_rows(ctx, ctx.plan.tool_shape)
    assert "bit-identical" in line and "bfloat16 rel err" in line, line


def test_selfcheck_compile_on_the_gpu_backend():
    """``rnnt-lattice check``'s ``torch.compile`` check as it runs on CUDA: the custom op
    resolves the Triton backend when it runs and prepares the call again on the values (the
    regular and TDT losses against the float64 reference, a bad label's ValueError), here
    under the interpreter."""
    from rnnt_lattice import selfcheck
    ctx = selfcheck.Context("cpu", "triton", selfcheck.plan_for("cpu", "smoke"), "smoke")
    line = selfcheck.check_compile(ctx, ctx.plan.tool_shape)
    assert "tdt grad err" in line and "the eager call's ValueError" in line, line


def test_input_check_blocks_reach_the_kernel(monkeypatch):
    """``gpu.INPUT_CHECK_BLOCK_B`` / ``_U`` set after a first call are the next launch's
    blocks (its plan was cached without them: a sweep's setting never reached the kernel)."""
    seen = []
    launch = gpu.launch

    def record(kernel, grid, *args, **kw):
        if "BLOCK_B" in kw:
            seen.append((kw["BLOCK_B"], kw["BLOCK_U"]))
        return launch(kernel, grid, *args, **kw)

    monkeypatch.setattr(gpu, "launch", record)
    args = (torch.tensor([[1, 2]]), torch.tensor([3]), torch.tensor([2]), None)
    gpu.input_check(*args, T=3, U=2, V=5, blank=0)
    monkeypatch.setattr(gpu, "INPUT_CHECK_BLOCK_B", 2)
    monkeypatch.setattr(gpu, "INPUT_CHECK_BLOCK_U", 4)
    gpu.input_check(*args, T=3, U=2, V=5, blank=0)
    assert seen[-1] == (2, 4) and seen[0] != (2, 4), seen
