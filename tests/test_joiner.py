"""``rnnt_lattice.Joiner`` and the fused losses' kernel path (``gpu/joint.py``, docs/math.md
section 12), run by the Triton interpreter on CPU tensors with blocks of 16 (several blocks
of nodes, classes and H, chunks of every kind): losses and the gradients of enc, pred and
every parameter, with signed per-sequence upstream weights and ragged lengths, against the
float64 loss of the materialised logits (the torch backend, itself checked against the
oracle in test_variants.py) and against the tile path on the same joiner; every topology,
option and activation, T = 1, U = 0, impossible sequences, NaN inputs, float32, the AMP
recipe in bfloat16, two runs bit-identical; which joiners take the kernel path; the
module's checks and the weight mappings from icefall's joiner and NeMo's joint."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import rnnt_lattice
from support import backends, cases
from support.cases import upstream_weights
from support.fused import OPTIONS, PUBLIC, assert_same, full_and_fused, quiet, run, with_option
from support.sync import RecordOps, syncing
from support.oracle import topology_batch_grad
from support.topologies import confident, make_topo_inputs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from confident_rows import logits_grad, one_hot_joiner  # noqa: E402

pytestmark = [backends.NO_TRITON, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
# float32 logits that the products make exactly (values a bfloat16 holds): the loss's own
# float32 tolerance (test_loss.py's), without the products' rounding
EXACT32 = 4 * 2.0**-23 * 8
E, P, H = 5, 7, 20                 # encoder, prediction network and joiner widths


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of 16 (``tl.dot``'s smallest) over H = 20, V = 6..9: two blocks of H, one or
    two of classes; the act-grad pass over 2 label positions and 8 of H at a time."""
    from rnnt_lattice.gpu import joint
    tile = dict(BLOCK_N=16, BLOCK_V=16, BLOCK_H=16, num_warps=1, num_stages=1)
    monkeypatch.setitem(joint.TILES, "row", tile)
    monkeypatch.setitem(joint.TILES, "grad", tile)
    monkeypatch.setattr(joint, "WIDE", {})
    monkeypatch.setattr(joint, "ACT_GRAD", dict(joint.ACT_GRAD, BLOCK_U=2, BLOCK_H=8))
    ctx = quiet()
    yield joint
    ctx.__exit__(None, None, None)


def make(case, topo_name="regular", dtype=torch.float64, activation="tanh", seed=0,
         boundary=False, **joiner_kw):
    """``(joiner, enc, pred, targets, tl, ul, blank, boundary)`` of a case (its logits give
    V only) and a seeded Joiner."""
    logits, targets, tl, ul, topo, blank, bnd = make_topo_inputs(case, topo_name, boundary=boundary)
    B, T, U1, V = logits.shape
    g = torch.Generator().manual_seed(seed)
    enc = torch.randn(B, T, E, generator=g, dtype=dtype).requires_grad_()
    pred = torch.randn(B, U1, P, generator=g, dtype=dtype).requires_grad_()
    torch.manual_seed(seed)
    joiner = rnnt_lattice.Joiner(E, P, H, V, activation, dtype=dtype, **joiner_kw)
    with torch.no_grad():
        joiner.out.weight.mul_(3.0)                  # logits a few units apart
    return joiner, enc, pred, targets, tl, ul, blank, bnd


def kernel_and_references(topo_name, joiner, enc, pred, targets, tl, ul, blank, *, tile, **kw):
    """The kernel path (backend triton), and the same loss of the materialised logits on
    the float64 torch backend, and the tile path (Numba) on the same joiner."""
    full, kernel = full_and_fused(topo_name, joiner, enc, pred, targets, tl, ul, blank,
                                  tile=tile, backend="triton", full_backend="torch", **kw)
    _, tiles = full_and_fused(topo_name, joiner, enc, pred, targets, tl, ul, blank, tile=tile,
                              backend="numba", **kw)
    return full, kernel, tiles


CASE = cases.CASES["ragged_blank0"]           # B = 3, T = 5, U = 3 (U+1 = 4), ragged
# chunks: 5 rows (runs of one label position: 5 // 3), 13 (one frame), 40 (3 frames), bytes
TILES = [5, 13, 40, "1KiB"]


@pytest.mark.parametrize("topo_name", list(PUBLIC))
def test_every_topology_float64(topo_name):
    activation = "relu" if topo_name in ("modified", "tdt13") else "tanh"
    inputs = make(CASE, topo_name, activation=activation)
    full, kernel, tiles = kernel_and_references(topo_name, *inputs[:7], tile=13)
    assert_same(full, kernel, TOL[torch.float64])
    assert_same(tiles, kernel, TOL[torch.float64])


@pytest.mark.parametrize("tile", TILES)
def test_every_kind_of_chunk(tile):
    inputs = make(CASE, "tdt012")
    full, kernel, _ = kernel_and_references("tdt012", *inputs[:7], tile=tile)
    assert_same(full, kernel, TOL[torch.float64])


@pytest.mark.parametrize("tile", [13, 40], ids=["one_frame", "three_frames"])
def test_act_grad_prefetch_changes_no_bit(tile, small_blocks, monkeypatch):
    """``joint.ACT_GRAD``'s PREFETCH (the act-grad pass's next frame loaded before this
    frame's sums; off until a GPU times it) gives the same gradients bit for bit, on chunks
    of one frame (nothing to load ahead) and of three (the last one of two), over 2 label
    positions a program (U+1 = 4: two blocks) and 8 of H (H = 20: a partial block); and
    the float64 reference's."""
    joint = small_blocks
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    weights = upstream_weights(3)

    def kernel(prefetch):
        monkeypatch.setattr(joint, "ACT_GRAD", dict(joint.ACT_GRAD, PREFETCH=prefetch))
        return run(lambda: rnnt_lattice.fused_rnnt_loss(
            joiner, enc, pred, targets, tl, ul, blank=blank, reduction="none", tile=tile,
            backend="triton"), joiner, enc, pred, weights)

    plain, ahead = kernel(False), kernel(True)
    assert torch.equal(ahead[0], plain[0])
    assert all(torch.equal(a, b) for a, b in zip(ahead[1], plain[1]))
    full = run(lambda: rnnt_lattice.rnnt_loss(
        joiner(enc[:, :, None], pred[:, None]), targets, tl, ul, blank=blank, reduction="none",
        backend="torch"), joiner, enc, pred, weights)
    assert_same(full, ahead, TOL[torch.float64])


@pytest.mark.parametrize("opt", list(OPTIONS))
def test_options(opt):
    topo_name, inputs, kw = with_option(opt, lambda topo_name, boundary, log_probs: make(
        CASE, topo_name, boundary=boundary))
    full, kernel, tiles = kernel_and_references(topo_name, *inputs, tile=5, **kw)
    assert_same(full, kernel, TOL[torch.float64])
    assert_same(tiles, kernel, TOL[torch.float64])


@pytest.mark.parametrize("case", ["one_frame", "no_labels"])
def test_one_frame_and_no_labels(case):
    """T = 1 (one frame per sequence) and U = 0 (blanks only: U+1 = 1 label position)."""
    c = {"one_frame": cases.Case("t1", (1, 1), (1, 0), 6, 0, T=1, U=1),
         "no_labels": cases.Case("u0", (4, 2), (0, 0), 6, 0, T=4, U=0)}[case]
    inputs = make(c, "regular")
    full, kernel, _ = kernel_and_references("regular", *inputs[:7], tile=5)
    assert_same(full, kernel, TOL[torch.float64])


def test_impossible_sequences_and_zero_infinity():
    """modified needs T_b >= U_b: sequence 1 has 2 frames for 3 labels, sequence 2 none:
    +inf and zero gradient (0 with zero_infinity), the others exact."""
    case = cases.Case("impossible", (4, 2, 0), (2, 3, 1), 5, 0, T=4, U=3)
    joiner, enc, pred, targets, tl, ul, blank, _ = make(case, "modified")
    for zero_infinity in (False, True):
        full, kernel = full_and_fused("modified", joiner, enc, pred, targets, tl, ul, blank,
                                      tile=7, backend="triton", full_backend="torch",
                                      zero_infinity=zero_infinity)
        assert_same(full, kernel, TOL[torch.float64])
    assert (enc.grad[1:] == 0).all() and torch.isinf(full[0][1:]).sum() == 0


def test_nan_input_gives_the_materialised_losses_nan():
    """A NaN in one sequence's encoder output: that sequence's loss is NaN as with the
    materialised logits, the others' losses are theirs."""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    with torch.no_grad():
        enc[1, 0, 2] = float("nan")
    kw = dict(reduction="none")
    full = rnnt_lattice.rnnt_loss(joiner(enc[:, :, None], pred[:, None]), targets, tl, ul,
                                  blank=blank, backend="torch", **kw)
    kernel = rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul, blank=blank,
                                          tile=13, backend="triton", **kw)
    assert torch.equal(torch.isnan(kernel), torch.isnan(full)) and torch.isnan(kernel[1])
    ok = ~torch.isnan(full)
    torch.testing.assert_close(kernel[ok], full[ok], rtol=1e-10, atol=1e-10)


def test_float32_and_two_runs_bit_identical():
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE, dtype=torch.float32)
    w = upstream_weights(enc.shape[0], torch.float32)
    step = lambda: run(lambda: rnnt_lattice.fused_rnnt_loss(  # noqa: E731
        joiner, enc, pred, targets, tl, ul, blank=blank, tile=13, backend="triton",
        reduction="none"), joiner, enc, pred, w)
    first, second = step(), step()
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(a, b) for a, b in zip(first[1], second[1]))
    full = run(lambda: rnnt_lattice.rnnt_loss(joiner(enc[:, :, None], pred[:, None]), targets,
                                              tl, ul, blank=blank, reduction="none"),
               joiner, enc, pred, w)
    assert_same(full, first, TOL[torch.float32])


@pytest.mark.parametrize("topo_name", ["regular", "multiblank", "tdt012"])
def test_confident_rows_keep_their_digits(topo_name):
    """A confident model's float32 logits (the class, and TDT's duration, that each
    sequence's best path reads 20 nats ahead; ``support.topologies.confident``) on the
    kernel path: the loss and the logits' gradient (``dW``'s columns) match the oracle on
    the same values as closely as for an unsure model, whichever softmax group the path
    reads. (The row sums ``1 + rest`` in float32 rounded ``rest`` away and the read
    entries ``p S - gamma`` cancelled: losses were 35-39% off and the gradient 52-62% of
    its scale.)"""
    case = cases.Case("confident", (7, 5), (3, 2), 40, 0, T=7, U=3)
    x, y, tl, ul, topo, blank, _ = make_topo_inputs(case, topo_name, seed=23)
    x = confident(x, y, tl, ul, topo, blank, 20.0).nan_to_num(0.0).bfloat16().double()
    w = upstream_weights(case.B)
    want_loss, want_grad = topology_batch_grad(x, y, tl, ul, topo, blank, True)
    want_grad = want_grad * w[:, None, None, None]
    # (a Joiner whose logits are x exactly: benchmarks/confident_rows.py's, which the GPU
    # session's ``confident`` step runs on the device)
    joiner, enc, pred = one_hot_joiner(x.float(), torch.float32, torch)
    fused_name, _, extra = PUBLIC[topo_name]
    loss, _ = run(lambda: getattr(rnnt_lattice, fused_name)(
        joiner, enc, pred, y, tl, ul, blank=blank, tile=13, backend="triton",
        reduction="none", **extra), joiner, enc, pred, w)
    assert want_loss.max() < 1e-3                                  # confident
    assert ((loss.double() - want_loss).abs() / want_loss).max() <= EXACT32
    dz = logits_grad(joiner, x.shape).double()
    assert (dz - want_grad).abs().max() <= EXACT32 * want_grad.abs().max()


@pytest.mark.parametrize("kind", ["regular", "tdt012", "multiblank"])
def test_amp_recipe_bfloat16(kind):
    """Forward under ``torch.autocast`` (bfloat16), ``backward()`` outside: the gradients of
    ``backward()`` inside the block exactly (the operands keep the forward's dtype), and
    the tile path's on the same joiner to bfloat16 rounding; the loss float32, gradients
    in the leaves' dtype."""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE, kind, dtype=torch.float32)
    fused_name, _, extra = PUBLIC[kind]
    w = upstream_weights(enc.shape[0], torch.float32)

    def step(backend, inside):
        for x in (enc, pred, *joiner.parameters()):
            x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            costs = getattr(rnnt_lattice, fused_name)(joiner, enc, pred, targets, tl, ul,
                                                      blank=blank, tile=5, backend=backend,
                                                      reduction="none", **extra)
            loss = (costs * w).sum()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        return [costs.detach()] + [x.grad.clone() for x in (enc, pred, *joiner.parameters())]

    outside, inside, tiles = step("triton", False), step("triton", True), step("numba", False)
    assert outside[0].dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in outside[1:])
    for a, b in zip(outside, inside):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(outside, tiles):
        assert float((a - b).abs().max()) <= 3e-2 * max(1.0, float(b.abs().max())), (a, b)


# --------------------------------------------------------------------------- cuBLAS products
@pytest.fixture
def cublas(small_blocks, monkeypatch):
    """``joint.CUBLAS_PRODUCTS`` on (off until a GPU times it): each chunk's logits by
    ``torch.addmm`` and the backend's V passes; the hidden pass over 8 rows and 8 of H at a
    time (H = 20: three blocks, the last partial)."""
    joint = small_blocks
    monkeypatch.setattr(joint, "CUBLAS_PRODUCTS", True)
    monkeypatch.setattr(joint, "HIDDEN", dict(BLOCK_N=8, BLOCK_H=8, num_warps=1))
    return joint


# The topologies whose rows differ in what the chunks hold: the regular loss's, TDT's with
# its duration columns after the tokens (tdt13 with ReLU), multi-blank's fixed classes;
# k2's modified lattice. (The others share these rows and the V passes with them.)
@pytest.mark.parametrize("topo_name", ["regular", "modified", "multiblank", "tdt13"])
def test_cublas_products_every_topology(cublas, topo_name):
    """With the products by cuBLAS: the float64 loss of the materialised logits and the
    kernel path's, chunks of one frame (13 rows: one frame of 3 x 4)."""
    inputs = make(CASE, topo_name, activation="relu" if topo_name == "tdt13" else "tanh")
    full, fused = full_and_fused(topo_name, *inputs[:7], tile=13, backend="triton",
                                 full_backend="torch")
    assert_same(full, fused, TOL[torch.float64])


@pytest.mark.parametrize("tile", TILES)
def test_cublas_products_every_kind_of_chunk(cublas, tile):
    inputs = make(CASE, "tdt012")
    full, fused = full_and_fused("tdt012", *inputs[:7], tile=tile, backend="triton",
                                 full_backend="torch")
    assert_same(full, fused, TOL[torch.float64])


# The options that change what the chunks' own code does (the boundary: which rows of h
# are 0; log-prob inputs: no normaliser; FastEmit and clamp: the gradient pass over z);
# the others change only the V passes and the lattice, which the tile path shares.
@pytest.mark.parametrize("opt", ["delay_boundary", "logprob", "fastemit_clamp"])
def test_cublas_products_options(cublas, opt):
    topo_name, inputs, kw = with_option(opt, lambda topo_name, boundary, log_probs: make(
        CASE, topo_name, boundary=boundary))
    full, fused = full_and_fused(topo_name, *inputs, tile=5, backend="triton",
                                 full_backend="torch", **kw)
    assert_same(full, fused, TOL[torch.float64])


def test_cublas_products_take_every_dtype(cublas, monkeypatch):
    """With the products by cuBLAS, compiled joiners take the kernel path in every dtype,
    float32 with IEEE products and float64 too (the products are cuBLAS's either way);
    without, those two take the tile path."""
    saved = torch.backends.cuda.matmul.allow_tf32         # a property: no monkeypatch
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        assert all(cublas.takes(d) for d in (torch.float16, torch.bfloat16, torch.float32,
                                             torch.float64))
        monkeypatch.setattr(cublas, "CUBLAS_PRODUCTS", False)
        assert not cublas.takes(torch.float32) and not cublas.takes(torch.float64)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("products", ["kernels", "cublas"])
def test_nan_padding_reaches_no_gradient(small_blocks, monkeypatch, products):
    """NaN in ``enc`` past each sequence's frames and in ``pred`` past its labels (the
    padding of a batch), with a joiner without projections (a projection's own weight
    gradient multiplies its NaN inputs by their zero gradient, as in any model): the
    losses and every gradient are those of clean padding, with either way of making the
    logits (the padding's ``h`` is 0, so no NaN reaches ``dW`` through a zero ``dz``)."""
    monkeypatch.setattr(small_blocks, "CUBLAS_PRODUCTS", products == "cublas")
    _, _, _, targets, tl, ul, blank, _ = make(CASE)
    g = torch.Generator().manual_seed(3)
    joiner = rnnt_lattice.Joiner(None, None, H, 6, "tanh", dtype=torch.float64)
    enc = torch.randn(3, 5, H, generator=g, dtype=torch.float64).requires_grad_()
    pred = torch.randn(3, 4, H, generator=g, dtype=torch.float64).requires_grad_()
    weights = upstream_weights(3)
    clean = run(lambda: rnnt_lattice.fused_rnnt_loss(
        joiner, enc, pred, targets, tl, ul, blank=blank, tile=13, backend="torch",
        reduction="none"), joiner, enc, pred, weights)
    with torch.no_grad():
        for b in range(3):
            enc[b, int(tl[b]):] = float("nan")
            pred[b, int(ul[b]) + 1:] = float("nan")
    assert torch.isnan(enc).any() and torch.isnan(pred).any()
    poisoned = run(lambda: rnnt_lattice.fused_rnnt_loss(
        joiner, enc, pred, targets, tl, ul, blank=blank, tile=13, backend="triton",
        reduction="none"), joiner, enc, pred, weights)
    assert_same(clean, poisoned, TOL[torch.float64])


@pytest.mark.parametrize("first", [False, True], ids=["kernels_then_cublas", "cublas_then_kernels"])
def test_the_backward_takes_its_forwards_products(small_blocks, monkeypatch, first):
    """``CUBLAS_PRODUCTS`` changed between a forward and its backward: the backward takes
    the forward's path (whose workspace the forward wrote: the kernel path's read entries
    are there only for its own backward), and the step's results are those of a step that
    never changed it, to the bit."""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE, "multiblank")
    w = upstream_weights(enc.shape[0])

    def step(flip):
        monkeypatch.setattr(small_blocks, "CUBLAS_PRODUCTS", first)
        for x in (enc, pred, *joiner.parameters()):
            x.grad = None
        loss = rnnt_lattice.fused_multiblank_rnnt_loss(
            joiner, enc, pred, targets, tl, ul, blank=blank, big_blank_durations=[2, 3],
            tile=13, backend="triton", reduction="none")
        if flip:
            monkeypatch.setattr(small_blocks, "CUBLAS_PRODUCTS", not first)
        (loss * w).sum().backward()
        return loss.detach(), [x.grad.clone() for x in (enc, pred, *joiner.parameters())]
    (want, want_grads), (got, grads) = step(False), step(True)
    assert torch.equal(got, want) and all(map(torch.equal, grads, want_grads))


def test_cublas_products_float32_two_runs_and_amp(cublas):
    """float32: two runs bit-identical, the full loss's to float32's rounding; bfloat16
    under autocast (backward outside): the full loss's to bfloat16's (the logits are
    rounded to the operands' dtype, as the full pipeline's are)."""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE, dtype=torch.float32)
    w = upstream_weights(enc.shape[0], torch.float32)

    def step(fused, autocast=False):
        def call():
            if fused:
                return rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul,
                                                    blank=blank, tile=13, backend="triton",
                                                    reduction="none")
            return rnnt_lattice.rnnt_loss(joiner(enc[:, :, None], pred[:, None]), targets, tl,
                                          ul, blank=blank, reduction="none")
        if not autocast:
            return run(call, joiner, enc, pred, w)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = call()
        for x in (enc, pred, *joiner.parameters()):
            x.grad = None
        (out * w).sum().backward()
        return out.detach().float(), [x.grad.clone() for x in (enc, pred, *joiner.parameters())]

    first, second = step(True), step(True)
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(a, b) for a, b in zip(first[1], second[1]))
    assert_same(step(False), first, TOL[torch.float32])
    half, full = step(True, autocast=True), step(False, autocast=True)
    assert_same(full, half, 3e-2)


# --------------------------------------------------------------------------- which path
class Launches:
    """Counts the kernel path's row-pass launches and the programs' rows."""

    def __init__(self, monkeypatch, joint):
        self.calls, self.rows = 0, 0
        kernel = joint._joint_row_kernel

        class Wrapped:
            def __getitem__(_, grid):
                launch = kernel[grid]

                def go(*args, **kwargs):
                    self.calls += 1
                    self.rows += grid[0] * kwargs["BLOCK_N"]
                    return launch(*args, **kwargs)
                return go

        monkeypatch.setattr(joint, "_joint_row_kernel", Wrapped())


def test_the_kernel_path_builds_no_logits(monkeypatch, small_blocks):
    """A Joiner on the Triton backend takes the kernel path: its output Linear is never
    called (no logits tensor at any time), the row pass's programs cover the lattice's
    nodes about once (chunks launched over their own rows), and the loss is the
    materialised logits' loss."""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    launches = Launches(monkeypatch, small_blocks)
    want = rnnt_lattice.rnnt_loss(joiner(enc[:, :, None], pred[:, None]), targets, tl, ul,
                                  blank=blank, backend="torch")

    linear = torch.nn.functional.linear
    V = joiner.out.out_features

    def refuse(x, w, b=None):             # (a hook on the output layer takes the tile path)
        assert w.shape[0] != V, "the kernel path called the joiner's output layer"
        return linear(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", refuse)
    loss = rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul, blank=blank,
                                        tile=13, backend="triton")
    loss.backward()
    monkeypatch.undo()
    B, T, U1 = enc.shape[0], enc.shape[1], pred.shape[1]
    assert launches.calls == T and launches.rows <= 2 * B * T * U1
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-10)


def test_parametrized_weights_are_evaluated_once_a_call(monkeypatch, small_blocks):
    """Weights under ``torch.nn.utils.parametrize`` (spectral norm on ``out`` and on a
    projection: a step of power iteration at each evaluation in training) are evaluated
    once a fused call on the kernel path, as the joiner's own call evaluates them, forward
    and backward; and the loss is the materialised logits' (the weights not stepped
    between the two: eval mode)."""
    from torch.nn.utils import parametrizations
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    counts = {}
    for name, m in (("out", joiner.out), ("enc_proj", joiner.enc_proj)):
        parametrizations.spectral_norm(m)
        norm = m.parametrizations.weight[0]
        counts[name] = 0

        def counted(*a, _f=norm.forward, _name=name):
            counts[_name] += 1
            return _f(*a)
        monkeypatch.setattr(norm, "forward", counted)
    launches = Launches(monkeypatch, small_blocks)
    loss = rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul, blank=blank,
                                        tile=13, backend="triton")
    loss.backward()
    assert launches.calls > 0 and counts == {"out": 1, "enc_proj": 1}
    joiner.eval()
    want = rnnt_lattice.rnnt_loss(joiner(enc[:, :, None], pred[:, None]), targets, tl, ul,
                                  blank=blank, backend="torch")
    got = rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul, blank=blank,
                                       tile=13, backend="triton")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("why", ["dropout", "numba", "a_function"])
def test_other_joiners_and_backends_take_the_tile_path(monkeypatch, small_blocks, why):
    """Dropout at work (replayed exactly by the tile path), another backend, or any other
    joiner: the tile path, the same loss."""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE, dropout=0.5 if why == "dropout" else 0.0)
    launches = Launches(monkeypatch, small_blocks)
    fn = (lambda e, p: joiner(e, p)) if why == "a_function" else joiner
    torch.manual_seed(3)
    loss = rnnt_lattice.fused_rnnt_loss(fn, enc, pred, targets, tl, ul, blank=blank, tile=13,
                                        backend="numba" if why == "numba" else "triton")
    loss.backward()
    assert launches.calls == 0 and enc.grad is not None
    if why == "dropout":
        joiner.eval()                                   # dropout off: the kernel path
        rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul, blank=blank, tile=13,
                                     backend="triton")
        assert launches.calls > 0


class _HalfLogits(rnnt_lattice.Joiner):
    """A subclass with its own forward (a temperature on the logits)."""

    def forward(self, enc, pred, **kw):
        return super().forward(enc, pred, **kw) / 2


class _Sigmoid(rnnt_lattice.Joiner):
    """A subclass with its own activation."""

    def act(self, a):
        return torch.sigmoid(a)


class _Adapted(torch.nn.Linear):
    """An adapter around the output layer, as LoRA's: its forward adds a low-rank term that
    ``weight`` and ``bias`` do not hold."""

    def forward(self, x):
        return super().forward(x) + 0.5 * x[..., :1]


def _variant(joiner, how):
    """``joiner`` changed as users change modules; each computes other logits than the
    plain Joiner, which only its own call gives."""
    if how == "forward_hook":
        joiner.register_forward_hook(lambda m, i, o: o / 2)
    elif how == "hook_on_out":
        joiner.out.register_forward_hook(lambda m, i, o: o * 1.5)
    elif how in ("subclass_forward", "subclass_act"):
        joiner.__class__ = _HalfLogits if how == "subclass_forward" else _Sigmoid
    elif how == "adapter_on_out":
        adapted = _Adapted(joiner.out.in_features, joiner.out.out_features, dtype=torch.float64)
        adapted.load_state_dict(joiner.out.state_dict())
        joiner.out = adapted
    elif how == "instance_forward":
        plain = joiner.out.forward
        joiner.out.forward = lambda x: plain(x) - x[..., :1]
    elif how == "instance_act":
        joiner.act = torch.sigmoid
    elif how == "call_on_out":
        class Called(torch.nn.Linear):
            def __call__(self, x):
                return super().__call__(x) * 1.5
        called = Called(joiner.out.in_features, joiner.out.out_features, dtype=torch.float64)
        called.load_state_dict(joiner.out.state_dict())
        joiner.out = called
    elif how == "dropout_replaced":
        joiner.dropout = torch.nn.Softsign()
    elif how == "projection_module":                 # a projection of another kind: kernels
        joiner.enc_proj = torch.nn.Sequential(joiner.enc_proj, torch.nn.LayerNorm(H, dtype=torch.float64))
    return joiner


@pytest.mark.parametrize("how", ["forward_hook", "hook_on_out", "subclass_forward",
                                 "subclass_act", "adapter_on_out", "instance_forward",
                                 "instance_act", "call_on_out", "dropout_replaced",
                                 "projection_module"])
def test_a_joiner_changed_by_its_user_gives_its_own_loss(monkeypatch, small_blocks, how):
    """The kernel path reads ``out``'s weights in place of calling the joiner: a joiner
    whose call computes something else (a hook on its output or on ``out``, a subclass's
    forward or activation, an adapter such as LoRA's around ``out``, another dropout
    module) takes the tile path and gives its own logits' loss; so the CPU and CUDA
    defaults agree. A projection of another kind is called on both paths: the kernels."""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    joiner = _variant(joiner, how)
    launches = Launches(monkeypatch, small_blocks)
    logits = joiner(enc[:, :, None], pred[:, None])
    want = rnnt_lattice.rnnt_loss(logits, targets, tl, ul, blank=blank, reduction="none",
                                  backend="torch")
    got = rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul, blank=blank,
                                       tile=13, backend="triton", reduction="none")
    assert (launches.calls > 0) == (how == "projection_module")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    w = upstream_weights(got.shape[0])
    g_want = torch.autograd.grad((want * w).sum(), [enc, *joiner.parameters()])
    g_got = torch.autograd.grad((got * w).sum(), [enc, *joiner.parameters()])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_fsdp_hooks_keep_the_kernel_path():
    """The joiner's own forward hooks send it to the tile path, except torch.distributed's
    (FSDP2's after its forward, which reshards and sees the costs as any output)."""
    from rnnt_lattice import fused
    joiner = make(CASE)[0]
    assert fused._as_written(joiner)
    post = lambda m, i, o: o                                # noqa: E731
    post.__module__ = "torch.distributed.fsdp._fully_shard._fsdp_state"
    handle = joiner.register_forward_hook(post)
    assert fused._as_written(joiner)
    handle.remove()
    joiner.register_forward_hook(lambda m, i, o: o)
    assert not fused._as_written(joiner)
    # a backward hook on the output layer would never fire on the kernel path
    joiner = make(CASE)[0]
    joiner.out.register_full_backward_hook(lambda m, gi, go: None)
    assert not fused._as_written(joiner)


# (operands, TF32 allowed, joint.IEEE_FLOAT32) -> the kernel path?
COMPILED_CHOICES = {"float64": (torch.float64, False, False, False),
                    "float32_ieee": (torch.float32, False, False, False),
                    "float32_tf32": (torch.float32, True, False, True),
                    "float32_ieee_forced": (torch.float32, False, True, True),
                    "bfloat16_autocast": (torch.bfloat16, False, False, True)}


@pytest.mark.parametrize("case", list(COMPILED_CHOICES))
def test_compiled_joiners_take_the_path_of_their_products(monkeypatch, small_blocks, case):
    """Compiled for a GPU (not interpreted), a Joiner takes the kernel path with half
    operands (autocast) and float32 ones whose products are TF32, and the tile path with
    float32 ones whose products are IEEE (cuBLAS's IEEE products are 4x Triton's on an
    H100: ``joint.IEEE_FLOAT32``) and float64 ones (Triton 3.6 did not compile the kernels'
    float64 ``tl.dot`` for an H100). (The launches themselves run interpreted here: only the
    choice is the GPU's.)"""
    from rnnt_lattice import gpu
    from rnnt_lattice.gpu import joint
    dtype, tf32, forced, kernels = COMPILED_CHOICES[case]
    joiner, enc, pred, targets, tl, ul, blank, _ = make(
        CASE, dtype=torch.float32 if dtype == torch.bfloat16 else dtype)
    launches = Launches(monkeypatch, small_blocks)
    monkeypatch.setattr(gpu, "INTERPRETED", False)
    for module in (gpu, joint):            # CPU tensors pass as if on the GPU
        monkeypatch.setattr(module, "check_device", lambda x: None)
    monkeypatch.setattr(joint, "IEEE_FLOAT32", forced)
    saved = torch.backends.cuda.matmul.allow_tf32         # a property: no monkeypatch
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul,
                                                blank=blank, tile=13, backend="triton")
        loss.backward()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert (launches.calls > 0) == kernels


def test_frozen_parameters_inputs_without_grad_and_no_projections():
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    joiner.out.weight.requires_grad_(False)
    joiner.enc_proj.bias.requires_grad_(False)
    enc.requires_grad_(False)
    full, kernel = full_and_fused("regular", joiner, enc, pred, targets, tl, ul, blank, tile=5,
                                  backend="triton", full_backend="torch")
    assert_same(full, kernel, TOL[torch.float64])
    assert joiner.out.weight.grad is None and enc.grad is None
    # no projections (inputs already projected, H wide), no bias on the output layer
    bare = rnnt_lattice.Joiner(None, None, H, joiner.out.out_features, "relu", bias=False,
                               dtype=torch.float64)
    enc = torch.randn(enc.shape[0], enc.shape[1], H, dtype=torch.float64, requires_grad=True)
    pred = torch.randn(pred.shape[0], pred.shape[1], H, dtype=torch.float64, requires_grad=True)
    full, kernel = full_and_fused("regular", bare, enc, pred, targets, tl, ul, blank, tile=5,
                                  backend="triton", full_backend="torch")
    assert_same(full, kernel, TOL[torch.float64])


def test_the_module_holding_the_joiner():
    """``FusedRNNTLoss(Joiner)``: the module's call is the function's, the kernel path."""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    module = rnnt_lattice.FusedRNNTLoss(joiner, blank=blank, backend="triton", reduction="none",
                                        tile=13)
    want = rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul, blank=blank,
                                        backend="triton", reduction="none", tile=13)
    assert torch.equal(module(enc, pred, targets, tl, ul), want)
    assert dict(module.named_parameters()).keys() == {
        "joiner." + n for n, _ in joiner.named_parameters()}


@pytest.mark.parametrize("cublas", [False, True], ids=["kernels", "cublas"])
def test_tdt_omega_is_the_token_logits_regular_loss(small_blocks, monkeypatch, cublas):
    """NeMo's omega: with probability omega the call is the regular loss of the token
    logits; the kernel path computes it on the token rows of the output layer (with the
    chunks' logits by cuBLAS too)."""
    monkeypatch.setattr(small_blocks, "CUBLAS_PRODUCTS", cublas)
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE, "tdt012")
    D = 3
    w = upstream_weights(enc.shape[0])
    full = run(lambda: rnnt_lattice.rnnt_loss(joiner(enc[:, :, None], pred[:, None])[..., :-D],
                                              targets, tl, ul, blank=blank, backend="torch",
                                              reduction="none"), joiner, enc, pred, w)
    kernel = run(lambda: rnnt_lattice.fused_tdt_loss(
        joiner, enc, pred, targets, tl, ul, blank=blank, durations=[0, 1, 2], omega=1.0,
        tile=13, backend="triton", reduction="none"), joiner, enc, pred, w)
    assert_same(full, kernel, TOL[torch.float64])


@pytest.mark.parametrize("kind", ["regular", "tdt012", "regular_cublas"])
def test_never_synchronises(device_checks, small_blocks, monkeypatch, kind):
    """The kernel path's forward and backward, under autocast too, through the public
    function with the value checks on the device (as on CUDA): no aten op reads a value on
    the host or builds a tensor from Python values (what ``set_sync_debug_mode("error")``
    checks on a GPU: ``rnnt-lattice check --device cuda``); also with the chunks' logits
    by cuBLAS (``joint.CUBLAS_PRODUCTS``)."""
    kind, cublas = kind.removesuffix("_cublas"), kind.endswith("_cublas")
    monkeypatch.setattr(small_blocks, "CUBLAS_PRODUCTS", cublas)
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE, kind, dtype=torch.float32)
    fused_name, _, extra = PUBLIC[kind]
    for amp in (False, True):
        with RecordOps() as rec:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = getattr(rnnt_lattice, fused_name)(
                    joiner, enc, pred, targets.to(torch.int32), tl.to(torch.int32),
                    ul.to(torch.int32), blank=blank, tile=5, backend="triton", clamp=0.5,
                    **extra)
            loss.backward()
        assert rec.ops and not syncing(rec.ops), syncing(rec.ops)


def test_empty_batch_and_no_frames():
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    loss = rnnt_lattice.fused_rnnt_loss(joiner, enc[:0], pred[:0], targets[:0], tl[:0], ul[:0],
                                        blank=blank, reduction="sum", backend="triton")
    loss.backward()
    assert loss.item() == 0 and (enc.grad == 0).all()
    assert all(w.grad is not None and not w.grad.any() for w in joiner.parameters())
    costs = rnnt_lattice.fused_rnnt_loss(joiner, enc[:, :0], pred, targets, tl * 0, ul * 0,
                                         blank=blank, reduction="none", backend="triton")
    assert torch.isinf(costs).all()


# --------------------------------------------------------------------------- the module
def test_module_checks_and_forward():
    with pytest.raises(ValueError, match="activation"):
        rnnt_lattice.Joiner(4, 4, 8, 10, activation="gelu")
    with pytest.raises(ValueError, match="vocab"):
        rnnt_lattice.Joiner(4, 4, 8, 0)
    with pytest.raises(ValueError, match="dropout"):
        rnnt_lattice.Joiner(4, 4, 8, 10, dropout=1.0)
    for dims, words in (((4.0, 4), "enc_dim must be a positive int or None, got 4.0"),
                        ((4, 0), "pred_dim must be a positive int or None, got 0")):
        with pytest.raises(ValueError, match=re.escape(words)):   # (was torch's TypeError)
            rnnt_lattice.Joiner(*dims, 8, 10)
    sized = rnnt_lattice.Joiner(np.int64(4), np.int32(4), np.int64(8), np.int64(10))
    assert (sized.out.in_features, sized.out.out_features) == (8, 10)   # (NumPy's ints refused)
    assert rnnt_lattice.Joiner(4, 4, 8, 10, bias=np.False_).out.bias is None
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    x = joiner(enc[:, :, None], pred[:, None])
    want = joiner.out(torch.tanh(joiner.enc_proj(enc)[:, :, None] + joiner.pred_proj(pred)[:, None]))
    torch.testing.assert_close(x, want)
    with pytest.raises(ValueError, match=r"enc \(3, 5, 4\) has 4 features \(its last axis\), "
                       r"the joiner takes 5, its projection enc_proj takes"):
        rnnt_lattice.fused_rnnt_loss(joiner, enc[..., :4], pred, targets, tl, ul, blank=blank,
                                     backend="triton")
    # (B, H, T) as NeMo's encoders give it, to a joiner without projections whose hidden
    # width equals T: the message says which axis it read
    bare = rnnt_lattice.Joiner(None, None, 5, joiner.out.out_features, dtype=torch.float64)
    with pytest.raises(ValueError, match=re.escape(
            "enc (3, 5, 7) has 7 features (its last axis), the joiner takes 5, its hidden "
            "width (no projection: out.in_features): enc is (B, T, H_enc)")):
        rnnt_lattice.fused_rnnt_loss(bare, torch.zeros(3, 5, 7, dtype=torch.float64),
                                     torch.zeros(3, 4, 5, dtype=torch.float64), targets, tl,
                                     ul, blank=blank, backend="triton")


class _EverySecondFrame(torch.nn.Module):
    """A projection that drops every other frame: its output is (B, T/2, H)."""

    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, x):
        return self.lin(x)[:, ::2]


@pytest.mark.parametrize("how", ["out_wider", "enc_proj_wider", "projections_narrower",
                                 "enc_proj_halves_T", "stale_out_features"])
def test_kernel_path_refuses_parts_that_do_not_fit(how):
    """A Joiner whose parts were replaced so that they no longer fit (the joiner's own call
    fails, or a projection changes T, or ``out`` holds another vocabulary than its
    ``out_features`` says) is a ValueError naming the parts on the kernel path, as on the
    tile path. (The kernels took ``e``, ``p`` and ``W`` as they came: a finite, wrong loss
    from reads past rows and frames, on CUDA an illegal address.)"""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    V = joiner.out.out_features
    lin = lambda i, o: torch.nn.Linear(i, o, dtype=torch.float64)      # noqa: E731
    if how == "out_wider":
        joiner.out = lin(H + 3, V)
    elif how == "enc_proj_wider":
        joiner.enc_proj = lin(E, H + 3)
    elif how == "projections_narrower":
        joiner.enc_proj = torch.nn.Sequential(lin(E, H - 3))
        joiner.pred_proj = torch.nn.Sequential(lin(P, H - 3))
    elif how == "enc_proj_halves_T":
        joiner.enc_proj = _EverySecondFrame(lin(E, H))
    else:                                  # a new vocabulary under the old out_features
        wider = lin(H, V + 3)
        joiner.out.weight, joiner.out.bias = wider.weight, wider.bias
    with pytest.raises(ValueError, match=r"joiner: the kernel path needs enc_proj\(enc\)"):
        rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul, blank=blank,
                                     backend="triton")


def test_kernel_path_refuses_a_hidden_dtype_its_out_refuses():
    """Outside autocast a Joiner without projections on bfloat16 ``enc`` and ``pred`` (its
    weights float32) fails in its own call (its ``out`` takes float32): a ValueError on the
    kernel path too, which promoted them and gave a loss."""
    _, enc, pred, targets, tl, ul, blank, _ = make(CASE, dtype=torch.float32)
    joiner = rnnt_lattice.Joiner(None, None, H, int(targets.max()) + 3)
    e = torch.randn(*enc.shape[:2], H, dtype=torch.bfloat16)
    p = torch.randn(*pred.shape[:2], H, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        joiner(e[:, :, None], p[:, None])
    with pytest.raises(ValueError, match="act\\(enc_proj\\(enc\\) \\+ pred_proj\\(pred\\)\\) is torch.bfloat16"):
        rnnt_lattice.fused_rnnt_loss(joiner, e, p, targets, tl, ul, blank=blank, backend="triton")


class IcefallJoiner(torch.nn.Module):
    """icefall's joiner (pruned_transducer_stateless7 and later): its parameter names."""

    def __init__(self, enc_dim, dec_dim, joiner_dim, vocab):
        super().__init__()
        self.encoder_proj = torch.nn.Linear(enc_dim, joiner_dim)
        self.decoder_proj = torch.nn.Linear(dec_dim, joiner_dim)
        self.output_linear = torch.nn.Linear(joiner_dim, vocab)

    def forward(self, encoder_out, decoder_out):
        return self.output_linear(torch.tanh(self.encoder_proj(encoder_out)
                                             + self.decoder_proj(decoder_out)))


class NemoJoint(torch.nn.Module):
    """NeMo's RNNTJoint: ``enc``, ``pred`` and ``joint_net`` (activation, dropout, Linear)."""

    def __init__(self, enc_dim, pred_dim, hidden, vocab, dropout):
        super().__init__()
        self.enc = torch.nn.Linear(enc_dim, hidden)
        self.pred = torch.nn.Linear(pred_dim, hidden)
        layers = [torch.nn.ReLU()] + ([torch.nn.Dropout(dropout)] if dropout else [])
        self.joint_net = torch.nn.Sequential(*layers, torch.nn.Linear(hidden, vocab))

    def forward(self, f, g):
        return self.joint_net(self.enc(f) + self.pred(g))


@pytest.mark.parametrize("peer", ["icefall", "nemo", "nemo_dropout"])
def test_weights_load_from_icefall_and_nemo(peer):
    """docs/api.md's mappings: the peer's state dict, its keys renamed, loads into a Joiner
    that computes the peer's logits."""
    torch.manual_seed(0)
    if peer == "icefall":
        theirs = IcefallJoiner(5, 7, 12, 9)
        ours = rnnt_lattice.Joiner(5, 7, 12, 9, activation="tanh")
        names = {"encoder_proj.": "enc_proj.", "decoder_proj.": "pred_proj.",
                 "output_linear.": "out."}
    else:
        dropout = 0.2 if peer == "nemo_dropout" else 0.0
        theirs = NemoJoint(5, 7, 12, 9, dropout).eval()
        ours = rnnt_lattice.Joiner(5, 7, 12, 9, activation="relu", dropout=dropout).eval()
        last = len(theirs.joint_net) - 1
        names = {"enc.": "enc_proj.", "pred.": "pred_proj.", f"joint_net.{last}.": "out."}

    def rename(key):
        for old, new in names.items():
            if key.startswith(old):
                return new + key[len(old):]
        raise KeyError(key)

    ours.load_state_dict({rename(k): v for k, v in theirs.state_dict().items()})
    f, g = torch.randn(2, 3, 1, 5), torch.randn(2, 1, 4, 7)
    torch.testing.assert_close(ours(f, g), theirs(f, g))
