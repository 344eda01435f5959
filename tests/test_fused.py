"""The fused joiner and loss (``fused_rnnt_loss``, ``fused_tdt_loss``,
``fused_multiblank_rnnt_loss``) against the public losses on the materialised logits
(``rnnt_loss`` & co., themselves checked against the oracle in test_variants.py): losses
and gradients w.r.t. ``enc``, ``pred`` and the joiner's parameters, with signed
per-sequence upstream weights, on every topology and backend, tiles of every kind (one
row, sizes that divide nothing, label-position tiles, byte budgets), dropout (the RNG
replay), frozen parameters, autocast, ``torch.compile``, and the argument checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import rnnt_lattice
from support import backends, cases
from support.cases import upstream_weights
from support.fused import OPTIONS, PUBLIC, assert_same, full_and_fused, quiet, run, with_option
from support.topologies import make_topo_inputs

H = 6                                     # joiner width: small, the loss is what is tested
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}

class Joiner(torch.nn.Module):
    """icefall's joiner: projections of enc and pred, tanh of their sum, a Linear to V."""

    def __init__(self, V, dropout=0.0, log_probs=False, dtype=torch.float64):
        super().__init__()
        self.enc = torch.nn.Linear(H, H, dtype=dtype)
        self.pred = torch.nn.Linear(H, H, dtype=dtype)
        self.out = torch.nn.Linear(H, V, dtype=dtype)
        self.dropout = torch.nn.Dropout(dropout)
        self.log_probs = log_probs

    def forward(self, e, p):                      # (B, t, 1, H), (B, 1, u, H)
        x = self.out(self.dropout(torch.tanh(self.enc(e) + self.pred(p))))
        return torch.log_softmax(x, -1) if self.log_probs else x


def make(case, topo_name="regular", dtype=torch.float64, seed=0, boundary=False, **joiner_kw):
    """``(joiner, enc, pred, targets, tl, ul, blank, boundary)`` of a case: the targets and
    lengths of ``make_topo_inputs`` (its logits only give V), a seeded joiner."""
    logits, targets, tl, ul, topo, blank, bnd = make_topo_inputs(case, topo_name, boundary=boundary)
    B, T, U1, V = logits.shape
    g = torch.Generator().manual_seed(seed)
    enc = torch.randn(B, T, H, generator=g, dtype=dtype).requires_grad_()
    pred = torch.randn(B, U1, H, generator=g, dtype=dtype).requires_grad_()
    torch.manual_seed(seed)
    return Joiner(V, dtype=dtype, **joiner_kw), enc, pred, targets, tl, ul, blank, bnd


# ragged lengths, U+1 = 4, B = 3: a frame has 12 nodes. Tiles: 1 row; 5 rows (label tiles
# of one frame, 5 // 3 = 1 position each); 13 (one frame per tile); 40 (3 frames: T = 5
# is not a multiple); a byte budget (1 KiB = 128 float64 entries: 16 rows at V = 8).
CASE = cases.CASES["ragged_blank0"]
TILES = [1, 5, 13, 40, "1KiB"]


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("topo_name", list(PUBLIC))
def test_every_topology_and_tile_numba(topo_name, tile):
    inputs = make(CASE, topo_name)
    assert_same(*full_and_fused(topo_name, *inputs[:7], tile=tile, backend="numba"), TOL[torch.float64])


@pytest.mark.parametrize("topo_name", ["regular", "constrained", "tdt012", "multiblank"])
def test_torch_backend(topo_name):
    inputs = make(CASE, topo_name)
    for tile in (5, 40):
        assert_same(*full_and_fused(topo_name, *inputs[:7], tile=tile, backend="torch"),
                    TOL[torch.float64])


@backends.NO_TRITON
@pytest.mark.parametrize("topo_name, tile", [("regular", 5), ("tdt13", 40)])
def test_triton_interpreted(topo_name, tile):
    inputs = make(cases.CASES["single"], topo_name)
    ctx = quiet()
    try:
        assert_same(*full_and_fused(topo_name, *inputs[:7], tile=tile, backend="triton"),
                    TOL[torch.float64])
    finally:
        ctx.__exit__(None, None, None)


@pytest.mark.parametrize("backend", backends.CPU)
@pytest.mark.parametrize("opt", list(OPTIONS))
def test_options(opt, backend):
    topo_name, inputs, kw = with_option(opt, lambda topo_name, boundary, log_probs: make(
        CASE, topo_name, boundary=boundary, log_probs=log_probs))
    assert_same(*full_and_fused(topo_name, *inputs, tile=5, backend=backend, **kw),
                TOL[torch.float64])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_impossible_alignments_and_reductions(reduction, zero_infinity):
    # modified needs T_b >= U_b: sequence 1 has 2 frames for 3 labels, and sequence 2 none.
    case = cases.Case("impossible", (4, 2, 0), (2, 3, 1), 5, 0, T=4, U=3)
    joiner, enc, pred, targets, tl, ul, blank, _ = make(case, "modified")
    kw = dict(rnnt_type="modified", reduction="none", backend="numba")
    costs = rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul, blank=blank,
                                         tile=7, zero_infinity=zero_infinity, **kw)
    assert torch.isfinite(costs[0])
    assert (costs[1:] == 0).all() if zero_infinity else torch.isinf(costs[1:]).all()
    full, fused = [], []
    for fn, out in ((lambda: rnnt_lattice.rnnt_loss(joiner(enc[:, :, None], pred[:, None]), targets,
                                                    tl, ul, blank=blank, rnnt_type="modified",
                                                    reduction=reduction, zero_infinity=zero_infinity),
                     full),
                    (lambda: rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul,
                                                          blank=blank, tile=7, rnnt_type="modified",
                                                          reduction=reduction,
                                                          zero_infinity=zero_infinity), fused)):
        out.append(run(lambda: fn()[None], joiner, enc, pred, torch.ones(1)))
    assert_same(full[0], fused[0], TOL[torch.float64])
    # the impossible sequences add nothing: exactly zero gradient on their frames
    assert (enc.grad[1:] == 0).all() and not torch.isnan(enc.grad).any()


@pytest.mark.parametrize("backend", backends.ALL)
def test_cost_overflowing_float32_has_zero_gradient(backend):
    """A float32 cost beyond float32's range (finite in the float64 lattice) is +inf and, like
    every infinite cost, has a zero gradient (math.md 8.1) through the fused tiles too: the
    Numba and Triton backends zero it in ``tile_backward`` themselves, the torch backend's
    caller does. Sequence 0's label sits 3e38 below class 3; sequence 1 is ordinary."""
    B, T, U, V = 2, 4, 1, 5
    enc = torch.zeros(B, T, V)
    enc[0, :, 3] = 3.0e38
    pred = torch.zeros(B, U + 1, V, requires_grad=True)
    enc.requires_grad_()
    targets, tl, ul = torch.tensor([[1], [2]]), torch.tensor([4, 4]), torch.tensor([1, 1])
    ctx = quiet()
    try:
        costs = rnnt_lattice.fused_rnnt_loss(lambda e, p: e + p, enc, pred, targets, tl, ul,
                                             blank=0, tile=3, reduction="none",
                                             backend=backend)
        assert torch.isinf(costs[0]) and torch.isfinite(costs[1])
        (costs * torch.tensor([1.0, -0.5])).sum().backward()
    finally:
        ctx.__exit__(None, None, None)
    assert (enc.grad[0] == 0).all() and (pred.grad[0] == 0).all()
    assert enc.grad[1].abs().sum() > 0 and torch.isfinite(enc.grad).all()


def test_dropout_is_replayed():
    """The backward's recomputed tiles draw the forward's dropout masks: the fused
    gradients equal those of the materialised logits built by the same joiner calls (one
    per tile, same RNG stream), and the RNG is left where the forward left it."""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE, dropout=0.5)
    B, T, U1 = enc.shape[0], enc.shape[1], pred.shape[1]
    f = 2                                        # frames per tile: tile = f B (U+1) rows
    w = upstream_weights(B)

    def tiled():
        return torch.cat([joiner(enc[:, t:t + f, None], pred[:, None]) for t in range(0, T, f)], 1)

    torch.manual_seed(1)
    full = run(lambda: rnnt_lattice.rnnt_loss(tiled(), targets, tl, ul, blank=blank,
                                              reduction="none"), joiner, enc, pred, w)
    after_full = torch.rand(3)
    torch.manual_seed(1)
    fused = run(lambda: rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul,
                                                     blank=blank, tile=f * B * U1,
                                                     reduction="none"), joiner, enc, pred, w)
    assert torch.equal(torch.rand(3), after_full)
    assert_same(full, fused, TOL[torch.float64])
    torch.manual_seed(2)                         # other masks: another loss (dropout is on)
    other = rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul, blank=blank,
                                         tile=f * B * U1, reduction="none")
    assert not torch.allclose(other, fused[0])


def test_frozen_parameters_and_inputs_without_grad():
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    joiner.out.weight.requires_grad_(False)
    joiner.enc.bias.requires_grad_(False)
    enc.requires_grad_(False)
    assert_same(*full_and_fused("regular", joiner, enc, pred, targets, tl, ul, blank, tile=5,
                                backend="numba"), TOL[torch.float64])
    assert joiner.out.weight.grad is None and enc.grad is None
    # nothing requires grad: a forward only
    for p in joiner.parameters():
        p.requires_grad_(False)
    pred.requires_grad_(False)
    loss = rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul, blank=blank, tile=5)
    assert not loss.requires_grad and torch.isfinite(loss)


def test_joiner_whose_graph_saves_its_output():
    """A joiner ending with an op that saves its output (exp, here in log_softmax's place)
    gets its gradient in a spare buffer, not over the logits its backward reads."""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    base = joiner.forward
    joiner.forward = lambda e, p: torch.exp(base(e, p) / 4)
    assert_same(*full_and_fused("regular", joiner, enc, pred, targets, tl, ul, blank, tile=13,
                                backend="numba"), TOL[torch.float64])


def test_bfloat16_autocast_on_cpu():
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE, dtype=torch.float32)
    w = upstream_weights(enc.shape[0], torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = run(lambda: rnnt_lattice.rnnt_loss(joiner(enc[:, :, None], pred[:, None]), targets,
                                                  tl, ul, blank=blank, reduction="none"),
                   joiner, enc, pred, w)
        fused = run(lambda: rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul,
                                                         blank=blank, tile=5, reduction="none"),
                    joiner, enc, pred, w)
    assert fused[0].dtype == torch.float32
    # the same bfloat16 joiner calls on other tiles: bfloat16 rounding, not float32's
    assert_same(full, fused, 3e-2)


def test_torch_compile_of_a_model_calling_it():
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE, dtype=torch.float32)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.joiner = joiner
            self.proj = torch.nn.Linear(H, H)

        def forward(self, enc, pred):
            return rnnt_lattice.fused_rnnt_loss(self.joiner, self.proj(enc), pred, targets, tl,
                                                ul, blank=blank, tile=13)

    model = Model()
    compiled = torch.compile(model, backend="aot_eager")   # autograd traced around the break
    w = torch.ones(1)
    comp = run(lambda: compiled(enc, pred)[None], model, enc, pred, w)   # compiled first
    eager = run(lambda: model(enc, pred)[None], model, enc, pred, w)
    assert_same(eager, comp, TOL[torch.float32])


def test_import_stays_light():
    """Importing rnnt_lattice loads neither torch._dynamo nor a backend (a fresh process)."""
    import subprocess
    import sys
    code = ("import sys, rnnt_lattice; "
            "print(sorted(m for m in ('torch._dynamo', 'numba', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("closure", [False, True], ids=["module", "closure"])
def test_empty_batch_and_no_frames(closure):
    """No tile runs (B = 0, or T = 0), and the joiner's parameters get zero gradients, as
    in the full pipeline, whose joiner runs on the empty grid (and as on the kernel path):
    not None, which would leave DDP waiting for them. A closure's tensors too."""
    module, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    joiner = (lambda e, p: module(e, p)) if closure else module
    params = list(module.parameters())
    loss = rnnt_lattice.fused_rnnt_loss(joiner, enc[:0], pred[:0], targets[:0], tl[:0], ul[:0],
                                        blank=blank, reduction="sum")
    loss.backward()
    assert loss.item() == 0 and (enc.grad == 0).all()
    assert all(w.grad is not None and w.grad.shape == w.shape and not w.grad.any()
               for w in params)
    for w in params:
        w.grad = None
    costs = rnnt_lattice.fused_rnnt_loss(joiner, enc[:, :0], pred, targets, tl * 0, ul * 0,
                                         blank=blank, reduction="none")
    assert torch.isinf(costs).all()
    loss = rnnt_lattice.fused_rnnt_loss(joiner, enc[:, :0], pred, targets, tl * 0, ul * 0,
                                        blank=blank, zero_infinity=True)
    loss.backward()
    assert loss.item() == 0 and all(w.grad is not None and not w.grad.any() for w in params)


@pytest.mark.parametrize("tile, n_tiles", [(None, 3), ("4MiB", 5), (1024, 3)])
def test_default_tile_has_at_least_min_rows(tile, n_tiles):
    """The default tile is DEFAULT_TILE's bytes and at least DEFAULT_MIN_ROWS rows: at
    V = 2048 (float32) 4 MiB is 512 rows, the default takes 1024 (frames of U+1 = 4 rows:
    256 frames a tile, 3 tiles over T = 600); an explicit byte budget is taken as given."""
    B, T, U, V = 1, 600, 3, 2048
    assert rnnt_lattice.fused.DEFAULT_MIN_ROWS == 1024
    calls = []

    def joiner(e, p):
        calls.append(e.shape[1] * p.shape[2])
        return torch.zeros(B, e.shape[1], p.shape[2], V)

    enc, pred = torch.zeros(B, T, 1), torch.zeros(B, U + 1, 1)
    rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, torch.ones(B, U, dtype=torch.long),
                                 torch.tensor([T]), torch.tensor([U]), blank=0, tile=tile,
                                 backend="torch")
    tiles = [n for n in calls if n > 1]            # a byte budget also probes one node
    assert len(tiles) == n_tiles and sum(tiles) == T * (U + 1)


@pytest.mark.parametrize("topo_name", ["regular", "tdt012", "multiblank"])
def test_modules_hold_the_joiner_and_equal_the_functions(topo_name):
    """FusedRNNTLoss & co.: the joiner is a submodule (its parameters are the module's),
    and a call gives the function's loss and gradients."""
    fused_name, _, extra = PUBLIC[topo_name]
    module_cls = {"fused_rnnt_loss": rnnt_lattice.FusedRNNTLoss,
                  "fused_tdt_loss": rnnt_lattice.FusedTDTLoss,
                  "fused_multiblank_rnnt_loss": rnnt_lattice.FusedMultiblankRNNTLoss}[fused_name]
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE, topo_name)
    extra = {k: v for k, v in extra.items() if k != "rnnt_type" or v != "regular"}
    module = module_cls(joiner, blank=blank, reduction="none", tile=7, **extra)
    assert list(module.parameters()) == list(joiner.parameters())
    weights = upstream_weights(enc.shape[0], torch.float64)
    want = run(lambda: getattr(rnnt_lattice, fused_name)(
        joiner, enc, pred, targets, tl, ul, blank=blank, reduction="none", tile=7, **extra),
        joiner, enc, pred, weights)
    got = run(lambda: module(enc, pred, targets, tl, ul), joiner, enc, pred, weights)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("kw", [dict(reduction="avg"), dict(tile="12 parsecs"),
                                dict(fastemit_lambda=float("inf")), dict(backend="cuda")])
def test_modules_check_their_options_at_construction(kw):
    joiner = torch.nn.Linear(3, 4)
    with pytest.raises(ValueError, match=next(iter(kw))):
        rnnt_lattice.FusedRNNTLoss(joiner, blank=0, **kw)
    with pytest.raises(ValueError, match="durations"):
        rnnt_lattice.FusedTDTLoss(joiner, blank=0, durations=[2, 1])
    with pytest.raises(ValueError, match="joiner"):
        rnnt_lattice.FusedRNNTLoss("not a joiner", blank=0)


@pytest.mark.parametrize("tile", [0, -2, True, 2.5, "many", "0MiB", "12 parsecs"])
def test_bad_tile(tile):
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    with pytest.raises(ValueError, match="tile"):
        rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul, blank=blank, tile=tile)


def test_numpy_int_tile():
    """A NumPy int is an int, as every int option takes it (``operator.index``): the tile
    of that many rows (it was refused)."""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    call = lambda tile: rnnt_lattice.fused_rnnt_loss(    # noqa: E731
        joiner, enc, pred, targets, tl, ul, blank=blank, tile=tile, reduction="none")
    torch.testing.assert_close(call(np.int64(7)), call(7), rtol=0, atol=0)


def test_bad_joiner_and_inputs():
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    call = rnnt_lattice.fused_rnnt_loss
    with pytest.raises(ValueError, match="joiner"):
        call(lambda e, p: (e + p)[..., 0], enc, pred, targets, tl, ul, blank=blank)
    with pytest.raises(ValueError, match="enc"):
        call(joiner, enc[0], pred, targets, tl, ul, blank=blank)
    with pytest.raises(ValueError, match="targets"):
        call(joiner, enc, pred, targets[:, :1], tl, ul, blank=blank)
    with pytest.raises(ValueError, match="logit_lengths"):
        call(joiner, enc, pred, targets, tl + 9, ul, blank=blank)
    with pytest.raises(ValueError, match="blank"):
        rnnt_lattice.fused_multiblank_rnnt_loss(joiner, enc, pred, targets, tl, ul, blank=0,
                                                big_blank_durations=[2])
    with pytest.raises(TypeError, match="reduciton"):
        rnnt_lattice.FusedRNNTLoss(joiner, blank=blank, reduciton="sum")


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("calls", ["every", "tiles"])
def test_joiner_output_on_another_device_is_a_value_error(calls, backend):
    """Logits on the meta device (any device but that of enc and pred) are a ValueError
    naming the joiner, from the call of one node that learns V or from a tile's, before
    any pass reads them (issue 32: a TypeError from inside the Numba backend before)."""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)

    def elsewhere(e, p):
        x = joiner(e, p)
        return x.to("meta") if calls == "every" or e.shape[1] * p.shape[2] > 1 else x

    with pytest.raises(ValueError, match=r"joiner\(enc .* on meta: they must be on the device "
                                         r"of enc and pred, cpu"):
        rnnt_lattice.fused_rnnt_loss(elsewhere, enc, pred, targets, tl, ul, blank=blank,
                                     tile=13, backend=backend)


# --------------------------------------------------------------------------- issue 27
def test_trainable_tensors_outside_the_parameters_get_their_gradients():
    """A joiner (here a function) that reaches trainable tensors which are not the
    Function's inputs: the module's parameters and a closure's ``scale`` get the gradients
    of the materialised loss, through autograd (as reentrant checkpointing gives them)."""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    scale = torch.tensor([1.3], dtype=torch.float64, requires_grad=True)
    fn = lambda e, p: joiner(e, p) * scale                  # noqa: E731
    w = upstream_weights(enc.shape[0])
    grads = []
    for fused in (False, True):
        for x in (enc, pred, scale, *joiner.parameters()):
            x.grad = None
        if fused:
            loss = rnnt_lattice.fused_rnnt_loss(fn, enc, pred, targets, tl, ul, blank=blank,
                                                tile=5, reduction="none")
        else:
            loss = rnnt_lattice.rnnt_loss(fn(enc[:, :, None], pred[:, None]), targets, tl, ul,
                                          blank=blank, reduction="none")
        (loss * w).sum().backward()
        grads.append([loss.detach()] + [x.grad.clone() for x in (enc, pred, scale,
                                                                 *joiner.parameters())])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-10)


def wide(joiner, enc, pred):
    """``enc (B, T, V)`` and ``pred (B, U+1, V)`` of the case's V, requiring grad: inputs
    that a parameterless joiner can add into logits."""
    V = joiner.out.out_features
    g = torch.Generator().manual_seed(5)
    return tuple(torch.randn(*x.shape[:2], V, generator=g, dtype=x.dtype).requires_grad_()
                 for x in (enc, pred))


@pytest.mark.parametrize("backend", backends.CPU)
def test_joiner_that_ignores_an_input_that_requires_grad(backend):
    """``e + p.detach()``: pred requires grad but the joiner does not use it (defect 1)."""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    enc, pred = wide(joiner, enc, pred)
    fn = lambda e, p: e + p.detach()                        # noqa: E731
    full = rnnt_lattice.rnnt_loss(fn(enc[:, :, None], pred[:, None]), targets, tl, ul,
                                  blank=blank, backend=backend)
    (g_full,) = torch.autograd.grad(full, enc)
    fused = rnnt_lattice.fused_rnnt_loss(fn, enc, pred, targets, tl, ul, blank=blank, tile=5,
                                         backend=backend)
    g_enc, g_pred = torch.autograd.grad(fused, (enc, pred), allow_unused=True)
    torch.testing.assert_close(fused, full)
    torch.testing.assert_close(g_enc, g_full)
    assert g_pred is None or not g_pred.any()


VIEW_JOINERS = {
    # the output is pred itself on one-frame tiles (tile = B (U+1) rows)
    "pred": (lambda e, p: p.expand(-1, e.shape[1], -1, -1), lambda B, U1: B * U1),
    # the output is enc itself on tiles of one label position (tile = B rows)
    "enc": (lambda e, p: e.expand(-1, -1, p.shape[2], -1), lambda B, U1: B),
}


@pytest.mark.parametrize("backend", backends.ALL)
@pytest.mark.parametrize("which", list(VIEW_JOINERS))
def test_joiner_whose_output_is_a_view_of_its_input(which, backend):
    """The passes write over a tile's rows (the Numba forward its exps, every backward the
    gradient): a tile that *is* ``enc`` or ``pred`` must be copied first, so the loss and
    gradients are the materialised loss's and the inputs stay untouched (defect 2)."""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    enc, pred = wide(joiner, enc, pred)
    fn, tile = VIEW_JOINERS[which]
    enc0, pred0 = enc.detach().clone(), pred.detach().clone()
    w = upstream_weights(enc.shape[0])
    ctx = quiet()
    try:
        full = rnnt_lattice.rnnt_loss(fn(enc[:, :, None], pred[:, None]), targets, tl, ul,
                                      blank=blank, reduction="none", backend=backend)
        g_full = torch.autograd.grad((full * w).sum(), (enc, pred), allow_unused=True)
        fused = rnnt_lattice.fused_rnnt_loss(fn, enc, pred, targets, tl, ul, blank=blank,
                                             tile=tile(enc.shape[0], pred.shape[1]),
                                             reduction="none", backend=backend)
        g_fused = torch.autograd.grad((fused * w).sum(), (enc, pred), allow_unused=True)
    finally:
        ctx.__exit__(None, None, None)
    assert torch.equal(enc.detach(), enc0) and torch.equal(pred.detach(), pred0)
    torch.testing.assert_close(fused, full)
    for a, b, x in zip(g_full, g_fused, (enc, pred)):
        zero = torch.zeros_like(x)
        torch.testing.assert_close(zero if b is None else b, zero if a is None else a)


class NormJoiner(torch.nn.Module):
    """A joiner with a normalisation layer between its projection and its output."""

    def __init__(self, V, norm):
        super().__init__()
        self.proj = torch.nn.Linear(H, H, dtype=torch.float64)
        self.norm = norm
        self.out = torch.nn.Linear(H, V, dtype=torch.float64)

    def forward(self, e, p):
        h = self.proj(e + p)                              # (B, t, u, H)
        if isinstance(self.norm, torch.nn.LayerNorm):
            return self.out(self.norm(h))
        shape = h.shape
        return self.out(self.norm(h.reshape(-1, shape[-1])).reshape(shape))


@pytest.mark.parametrize("norm", ["batch", "batch_eval", "layer"])
def test_joiners_with_batch_coupled_layers_are_refused(norm):
    """BatchNorm in training mode takes statistics over the nodes of a tile: refused with
    a clear error (defect 3). In eval mode (running statistics), and LayerNorm, act on
    each node: the materialised loss's gradients."""
    base, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    V = base.out.out_features
    layer = (torch.nn.LayerNorm(H, dtype=torch.float64) if norm == "layer"
             else torch.nn.BatchNorm1d(H, dtype=torch.float64))
    joiner = NormJoiner(V, layer)
    if norm == "batch_eval":
        joiner.eval()
    if norm == "batch":
        with pytest.raises(ValueError, match=r"(?s)'norm'.*BatchNorm1d.*each \(t, u\) independently"):
            rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul, blank=blank)
        return
    assert_same(*full_and_fused("regular", joiner, enc, pred, targets, tl, ul, blank, tile=5,
                                backend="numba"), TOL[torch.float64])


def test_non_deterministic_joiner_is_an_error():
    """A joiner that reads a counter gives other logits when a tile is recomputed: the
    backward raises instead of returning the gradient of other logits (defect 4)."""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    calls = []

    def drifting(e, p):
        calls.append(1)
        return joiner(e, p) * (1.0 + 0.1 * len(calls))

    loss = rnnt_lattice.fused_rnnt_loss(drifting, enc, pred, targets, tl, ul, blank=blank, tile=5)
    with pytest.raises(RuntimeError, match="deterministic"):
        loss.backward()


# Where a recomputed tile drifts: one column of every row, a column each backend's check
# reads in its own way -- the Triton backend's gradient pass (fused mode) takes a label's
# column in its loop over V, a big blank's in its first step (before an in-place gradient
# overwrites it) and a duration's in TDT's duration group; log-prob mode compares row sums.
DRIFT = [("regular", "label", True), ("regular", "label", False),
         ("multiblank", "big_blank", True), ("tdt13", "duration", True)]


@pytest.mark.parametrize("backend", backends.ALL)
@pytest.mark.parametrize("topo_name, column, fused", DRIFT)
@pytest.mark.parametrize("delta", [0.0, 1e-13, 0.5, float("nan")])
def test_recomputed_tiles_are_checked(topo_name, column, fused, delta, backend):
    """A joiner whose recomputation adds ``delta`` to one column: an error beyond float64's
    rounding (0.5; NaN, which turns every entry of the rows NaN), and beyond it only (1e-13
    and 0: the losses and gradients of the materialised logits), on every backend and in
    the in-place gradient (multi-blank's fixed classes are written over before the pass
    reads the row's other entries)."""
    check_drift(topo_name, column, fused, delta, backend)


@backends.NO_TRITON
@pytest.mark.parametrize("topo_name, column", [d[:2] for d in DRIFT if d[2]])
@pytest.mark.parametrize("delta", [0.0, 0.5])
def test_recomputed_tiles_are_checked_from_the_span(topo_name, column, delta, monkeypatch):
    """The same with the Triton gradient pass reading float32 rows (V = 6, 8: not 16-byte
    aligned) from their aligned span (``gpu.SPAN_GRAD``): the check counts the span's
    edges (a row's first and last classes, an entry a load) as it counts its body."""
    from rnnt_lattice import gpu
    monkeypatch.setattr(gpu, "SPAN_GRAD", True)
    assert gpu._span(6, 0, torch.float32) == gpu._span(6, 2, torch.float32) == 4
    check_drift(topo_name, column, True, delta, "triton", torch.float32)


@backends.NO_TRITON
@pytest.mark.parametrize("delta, dtype", [(0.0, torch.float32), (0.5, torch.float32),
                                          (float("nan"), torch.float64)])
def test_recomputed_tiles_are_checked_durations_last(delta, dtype, monkeypatch):
    """The same for TDT's duration column with the gradient pass's duration group after
    its token group's loop (``gpu.GRAD_DURATIONS_LAST``): the check adds the group's sum
    after the tokens' instead of before them (float32 rows: after the per-entry sums)."""
    from rnnt_lattice import gpu
    monkeypatch.setattr(gpu, "GRAD_DURATIONS_LAST", True)
    check_drift("tdt13", "duration", True, delta, "triton", dtype)


@pytest.mark.parametrize("backend", backends.KERNELS)
def test_a_nan_sequence_is_no_recomputation_error(backend):
    """A sequence whose logits are NaN (its encoder frames are) has a NaN loss and NaN
    gradients, not an error of the recomputation check: the others' losses and gradients
    are those of the same call without it (upstream weight 0 on the NaN sequence)."""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE, "multiblank")
    fused_name, _, extra = PUBLIC["multiblank"]
    weights = torch.tensor([1.0, 0.0, -0.5], dtype=enc.dtype)

    def step(poison):
        e = enc.detach().clone()
        if poison:
            e[1] = float("nan")
        e.requires_grad_()
        ctx = quiet()
        try:
            costs = getattr(rnnt_lattice, fused_name)(joiner, e, pred, targets, tl, ul,
                                                      blank=blank, tile=5, backend=backend,
                                                      reduction="none", **extra)
            (costs * weights).sum().backward()
        finally:
            ctx.__exit__(None, None, None)
        return costs.detach(), e.grad

    (c0, g0), (c1, g1) = step(False), step(True)
    assert torch.isnan(c1[1]) and torch.allclose(c1[[0, 2]], c0[[0, 2]], rtol=1e-12, atol=0)
    assert torch.allclose(g1[[0, 2]], g0[[0, 2]], rtol=1e-10, atol=1e-12)


def check_drift(topo_name, column, fused, delta, backend, dtype=torch.float64):
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE, topo_name, dtype=dtype,
                                                        log_probs=not fused)
    V = joiner.out.out_features
    col = {"label": int(targets[0, 0]), "big_blank": blank - 1, "duration": V - 1}[column]

    class Drifting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.joiner = joiner

        def forward(self, e, p):
            x = self.joiner(e, p)
            if torch.is_grad_enabled():           # the backward's recomputation (and the full loss)
                x = x + delta * (torch.arange(V) == col).to(x.dtype)
            return x

    drifting = Drifting()
    kw = {} if fused else dict(fused_log_softmax=False)
    ctx = quiet()
    try:
        if delta < 0.1:
            assert_same(*full_and_fused(topo_name, drifting, enc, pred, targets, tl, ul, blank,
                                        tile=5, backend=backend, **kw), TOL[dtype])
            return
        fused_name, _, extra = PUBLIC[topo_name]
        loss = getattr(rnnt_lattice, fused_name)(drifting, enc, pred, targets, tl, ul,
                                                 blank=blank, tile=5, backend=backend,
                                                 reduction="sum", **extra, **kw)
        with pytest.raises(RuntimeError, match="deterministic"):
            loss.backward()
    finally:
        ctx.__exit__(None, None, None)
    fused_name, _, extra = PUBLIC[topo_name]
    loss = getattr(rnnt_lattice, fused_name)(drifting, enc, pred, targets, tl, ul, blank=blank,
                                             tile=5, backend=backend, **extra, **kw)
    with pytest.raises(RuntimeError, match="deterministic"):
        loss.backward()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("backend", backends.CPU)
def test_double_backward_is_refused(fused, backend):
    """``create_graph=True`` (a gradient penalty) would get gradients without a graph:
    refused with a clear error, for rnnt_loss as for the fused loss (defect 5). A plain
    second-order-free use of autograd.grad still works."""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    params = list(joiner.parameters())

    def loss():
        if fused:
            return rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul, blank=blank,
                                                tile=5, backend=backend)
        return rnnt_lattice.rnnt_loss(joiner(enc[:, :, None], pred[:, None]), targets, tl, ul,
                                      blank=blank, backend=backend)

    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss(), params, create_graph=True)
    grads = torch.autograd.grad(loss(), params)
    assert all(g.grad_fn is None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("empty", ["T", "B"])
def test_arguments_are_checked_without_frames_or_sequences(empty):
    """With T = 0 (or B = 0) no tile runs, and every argument is still checked, as
    rnnt_loss checks it on the same logits (defect 6)."""
    joiner, enc, pred, targets, tl, ul, blank, bnd = make(CASE, boundary=True)
    if empty == "T":
        enc = enc[:, :0]
        ok = dict(logit_lengths=tl * 0, target_lengths=ul)
    else:
        enc, pred, targets = enc[:0], pred[:0], targets[:0]
        ok = dict(logit_lengths=tl[:0], target_lengths=ul[:0])
        bnd = bnd[:0]
    call = rnnt_lattice.fused_rnnt_loss

    def run_with(**kw):
        args = dict(ok, blank=blank)
        args.update(kw)
        return call(joiner, enc, pred, targets, args.pop("logit_lengths"),
                    args.pop("target_lengths"), **args)

    run_with()                                              # the valid call runs
    bad = {"batch sizes": dict(logit_lengths=torch.zeros(enc.shape[0] + 1, dtype=torch.long)),
           "int32 or int64": dict(logit_lengths=ok["logit_lengths"].float()),
           "blank=99": dict(blank=99),
           "boundary": dict(boundary=torch.zeros(enc.shape[0], 3, dtype=torch.long))}
    if empty == "T":
        bad["exceeds the padded size T = 0 of enc"] = dict(logit_lengths=tl)
    for match, kw in bad.items():
        with pytest.raises(ValueError, match=match):
            run_with(**kw)


def test_messages_name_the_callers_tensors():
    """Length errors name ``enc`` and ``pred`` as the caller passed them, never an internal
    tile (defect 7)."""
    import re
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    call = rnnt_lattice.fused_rnnt_loss
    with pytest.raises(ValueError, match=re.escape(f"T = {enc.shape[1]} of enc {tuple(enc.shape)}")):
        call(joiner, enc, pred, targets, tl + 9, ul, blank=blank, tile=5)
    with pytest.raises(ValueError, match=re.escape(f"U = {pred.shape[1] - 1} of pred {tuple(pred.shape)}")):
        call(joiner, enc, pred, targets, tl, ul + 9, blank=blank, tile=5)
    with pytest.raises(ValueError, match=re.escape(f"label positions of pred {tuple(pred.shape)}")):
        call(joiner, enc, pred, targets[:, :1], tl, ul, blank=blank, tile=5)
    # a label the joiner's logits have no class for: V is named by where it comes from
    B, T, U1 = enc.shape[0], enc.shape[1], pred.shape[1]
    V = joiner(enc[:1, :1, None], pred[:1, None, :1]).shape[-1]
    short = lambda e, p: joiner(e, p)[..., :V - 1]                       # noqa: E731
    y = targets.clone()
    y[0, 0] = V - 1
    with pytest.raises(ValueError, match=re.escape(
            f"targets[0, 0] = {V - 1} is outside [0, V) = [0, {V - 1}); V of the joiner's "
            f"logits (B, T, U+1, V) = ({B}, {T}, {U1}, {V - 1})")):
        call(short, enc, pred, y, tl, ul, blank=blank, tile=5)


@pytest.mark.parametrize("cls, kw", [
    ("FusedRNNTLoss", dict(inplace_grad=True)),
    ("FusedRNNTLoss", dict(reduciton="sum")),
    ("FusedTDTLoss", dict(durations=[0, 1], packed=True)),
    ("FusedMultiblankRNNTLoss", dict(big_blank_durations=[2], rnnt_type="modified")),
])
def test_modules_refuse_unknown_options_at_construction(cls, kw):
    """An option the function does not take (``inplace_grad``, a misspelling) is refused
    when the module is built, not at its first call (defect 8)."""
    with pytest.raises(TypeError, match=list(kw)[-1]):
        getattr(rnnt_lattice, cls)(torch.nn.Linear(3, 4), blank=0, **kw)


def test_at_most_one_tile_of_logits_alive():
    """Each tile's logits (the joiner's output) are released before the next tile's are
    made, in the forward as in the backward (math.md section 11: one tile of logits)."""
    import weakref
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)

    class Tracked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.joiner = joiner
            self.outputs = []

        def forward(self, e, p):
            alive = [r for r in self.outputs if r() is not None]
            assert not alive, f"{len(alive)} earlier tile(s) of logits still alive"
            x = self.joiner(e, p)
            self.outputs.append(weakref.ref(x.untyped_storage()))
            return x

    tracked = Tracked()
    loss = rnnt_lattice.fused_rnnt_loss(tracked, enc, pred, targets, tl, ul, blank=blank,
                                        tile=13)
    loss.backward()
    assert len(tracked.outputs) > 4


@pytest.mark.parametrize("tile", [1, 13, "1KiB"])
def test_row_sums_kept_for_the_backward_are_one_block(tile):
    """The forward's row sums of every tile (the recomputation check's, kept until the
    backward) are slices of one block made before the first tile, in the plan's order, not
    an allocation per tile: on the CPU, with a small block a tile outliving it, glibc's
    heap mostly stopped reusing the tiles' freed logits and grew by a tile per tile
    (fused.py, ``_fingerprints``). The slices hold each tile's row sums."""
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE)
    costs = rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, tl, ul, blank=blank,
                                         tile=tile, reduction="none")
    ctx = costs.grad_fn
    plan, prints = ctx.call.plan, ctx.prints
    assert len(plan) == len(prints) > 2
    assert len({p.untyped_storage().data_ptr() for p in prints}) == 1
    offsets = [p.storage_offset() for p in prints]
    sizes = [enc.shape[0] * (t1 - t0) * (u1 - u0) for t0, t1, u0, u1 in plan]
    assert [p.numel() for p in prints] == sizes
    assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]
    with torch.no_grad():
        for (t0, t1, u0, u1), p in zip(plan, prints):
            x = joiner(enc[:, t0:t1, None], pred[:, None, u0:u1])
            torch.testing.assert_close(p, x.reshape(p.numel(), -1).sum(-1, dtype=torch.float32))
    costs.sum().backward()                        # the check passes on these sums


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graph capture)")
def test_cuda_graph_capture_is_refused_with_a_clear_error():
    joiner, enc, pred, targets, tl, ul, blank, _ = make(CASE, dtype=torch.float32)
    joiner = joiner.cuda()
    args = [t.cuda() for t in (enc.detach(), pred.detach(), targets, tl, ul)]
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with pytest.raises(RuntimeError, match="CUDA graph"):
            with torch.cuda.graph(graph):
                rnnt_lattice.fused_rnnt_loss(joiner, *args, blank=blank, backend="torch")


def test_the_joiner_never_runs_with_autocasts_cast_cache():
    """The fused loss runs the joiner under ``no_grad`` in the forward; a weight cast that
    autocast cached there has no graph, and a recomputation inside the same autocast block
    (``backward()`` inside it) reused it and reached no parameter: with torch 2.9 the
    joiner's parameters got no gradient. Every call of the joiner (probe, tiles, the
    backward's recomputation) runs with the cache off, and the parameters get gradients."""
    seen = []
    lin = torch.nn.Linear(8, 7)

    def joiner(e, p):
        seen.append((torch.is_autocast_enabled("cpu"), torch.is_autocast_cache_enabled()))
        return lin(torch.tanh(e + p))

    g = torch.Generator().manual_seed(0)
    enc = torch.randn(2, 6, 8, generator=g, requires_grad=True)
    pred = torch.randn(2, 4, 8, generator=g)
    y = torch.randint(1, 6, (2, 3), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_cache_enabled()
        loss = rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, y, torch.tensor([6, 4]),
                                            torch.tensor([3, 2]), blank=0, tile=5)
        loss.backward()
    assert len(seen) > 3 and all(enabled and not cached for enabled, cached in seen), seen
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
