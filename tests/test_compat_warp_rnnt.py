"""``rnnt_lattice.compat.warp_rnnt``: warp-rnnt 0.7.0's ``rnnt_loss`` (padded, ``gather``,
``compact``), its autograd Functions and its ``_C`` binding, against the brute-force float64
oracle on the same float32 log-probs. warp-rnnt's gradient is w.r.t. the log-probs:
``-gamma_blank`` at the blank, ``-(1 + lambda) gamma_label`` at the label, 0 elsewhere; the
compact layout is packed rows ``(sum_b T_b (U_b+1), V)`` with concatenated labels. Padding
is NaN-poisoned and padding labels are out of range, so nothing may read them."""
from __future__ import annotations

import doctest
import math

import numpy as np
import pytest
import torch

import rnnt_lattice.compat.warp_rnnt as warp_rnnt
from rnnt_lattice.compat.warp_rnnt import _C as core
from support.cases import TINY, Case, make_inputs, rel_err, upstream_weights
from support.oracle import batch_grad

CASES = [c for c in TINY if c.name in ("ragged_blank0", "blank_middle", "T1", "longer")]
TOL = 4 * 2.0**-23          # float32 outputs of a float64 lattice: a few float32 roundings


def inputs(case: Case, seed: int = 0):
    """float32 log-probs ``(N, T, U+1, V)`` (NaN padding), labels ``(N, U)`` int32 (out of
    range past each length), int32 lengths, and the blank as an id in ``[0, V)``."""
    logits, targets, tl, ul, blank = make_inputs(case, seed=seed)
    log_probs = torch.log_softmax(logits, -1).float()
    return (log_probs, targets.to(torch.int32), tl.to(torch.int32), ul.to(torch.int32),
            blank % case.V)


def compact(x: torch.Tensor, labels: torch.Tensor, tl, ul):
    """warp-rnnt's compact layout, built independently: rows ``(sum T_b (U_b+1), V)`` and
    the labels concatenated ``(sum U_b,)``."""
    V = x.shape[-1]
    rows = torch.cat([x[b, :T, :U + 1].reshape(-1, V) for b, (T, U) in enumerate(zip(tl.tolist(), ul.tolist()))])
    labs = torch.cat([labels[b, :U] for b, U in enumerate(ul.tolist())])
    return rows, labs


def unpack(rows: torch.Tensor, tl, ul, shape) -> torch.Tensor:
    """Compact rows back into a padded ``shape`` ``(N, T, U+1, V)`` (NaN padding)."""
    out = torch.full(shape, math.nan, dtype=rows.dtype)
    start = 0
    for b, (T, U) in enumerate(zip(tl.tolist(), ul.tolist())):
        out[b, :T, :U + 1] = rows[start:start + T * (U + 1)].view(T, U + 1, -1)
        start += T * (U + 1)
    return out


def oracle(log_probs, labels, tl, ul, blank, fastemit_lambda=0.0, weights=None):
    """Per-sequence costs ``(N,)`` and the gradient of ``sum_b w_b cost_b`` w.r.t. the log-probs."""
    costs, grad = batch_grad(log_probs.double(), labels.to(torch.int64), tl, ul, blank, False,
                             fastemit_lambda=fastemit_lambda)
    if weights is not None:
        grad = grad * weights.double()[:, None, None, None]
    return costs, grad


@pytest.mark.parametrize("fastemit_lambda", [0.0, 0.5])
@pytest.mark.parametrize("layout", ["padded", "gather", "compact"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_rnnt_loss_matches_oracle(case, layout, fastemit_lambda):
    log_probs, labels, tl, ul, blank = inputs(case)
    w = upstream_weights(case.B, torch.float32)
    want_costs, want_grad = oracle(log_probs, labels, tl, ul, blank, fastemit_lambda, w)
    if layout == "compact":
        x, labs = compact(log_probs, labels, tl, ul)
        x.requires_grad_()
        want_grad = compact(want_grad, labels, tl, ul)[0]
    else:
        x, labs = log_probs.clone().requires_grad_(), labels
    costs = warp_rnnt.rnnt_loss(x, labs, tl, ul, blank=blank, gather=layout == "gather",
                                fastemit_lambda=fastemit_lambda, compact=layout == "compact")
    (costs * w).sum().backward()
    assert costs.shape == (case.B,) and costs.dtype == torch.float32     # default: "none"
    assert rel_err(costs, want_costs) <= TOL
    assert rel_err(x.grad, want_grad) <= TOL
    assert not torch.isnan(x.grad).any(), "NaN padding leaked into the gradient"


def test_gather_is_the_plain_loss_and_reads_no_padding_label():
    """``gather=True`` needs no valid padding labels (warp-rnnt gathers them) and gives the
    same costs and gradient, bit for bit."""
    log_probs, labels, tl, ul, blank = inputs(CASES[0], seed=1)
    assert (labels < 0).any()                 # poisoned padding labels
    out = {}
    for gather in (False, True):
        x = log_probs.clone().requires_grad_()
        costs = warp_rnnt.rnnt_loss(x, labels, tl, ul, blank=blank, gather=gather)
        (costs * upstream_weights(len(costs), torch.float32)).sum().backward()
        out[gather] = costs.detach(), x.grad
    assert torch.equal(out[False][0], out[True][0]) and torch.equal(out[False][1], out[True][1])


def test_reductions_average_frames_and_shapes():
    case = CASES[0]
    log_probs, labels, tl, ul, blank = inputs(case)
    want, _ = oracle(log_probs, labels, tl, ul, blank)
    call = lambda **kw: warp_rnnt.rnnt_loss(log_probs, labels, tl, ul, blank=blank, **kw)
    for costs in (call(), call(reduction="none"), call(reduction=None)):
        assert costs.shape == (case.B,) and rel_err(costs, want) <= TOL
    per_frame = want / tl.double()
    assert rel_err(call(average_frames=True), per_frame) <= TOL
    for reduction, reduce in (("sum", torch.sum), ("mean", torch.mean)):
        got = call(reduction=reduction)
        assert got.shape == () and got.dtype == torch.float32
        assert rel_err(got, reduce(want)) <= TOL
        assert rel_err(call(reduction=reduction, average_frames=True), reduce(per_frame)) <= TOL
    empty = warp_rnnt.rnnt_loss(log_probs[:0], labels[:0], tl[:0], ul[:0], blank=blank,
                                reduction="mean")
    assert empty.shape == () and float(empty) == 0.0


def test_binding_rnnt_loss_and_its_gathered_layout():
    """``_C.rnnt_loss`` returns ``(costs, grads)`` with upstream 1; with ``blank=-1`` the
    log-probs are warp-rnnt's gathered ``(N, T, U+1, 2)`` ``[blank, label]`` per node."""
    case = CASES[2]                                     # blank in the middle of the vocabulary
    log_probs, labels, tl, ul, blank = inputs(case)
    want_costs, want_grad = oracle(log_probs, labels, tl, ul, blank, fastemit_lambda=0.25)
    costs, grads = core.rnnt_loss(log_probs, labels, tl, ul, blank, 0.25)
    assert grads.shape == log_probs.shape and costs.shape == (case.B,)
    assert rel_err(costs, want_costs) <= TOL and rel_err(grads, want_grad) <= TOL

    N, T, U1, V = log_probs.shape
    ids = torch.cat([labels.clamp(0, V - 1), torch.full((N, 1), blank, dtype=torch.int32)], 1)
    ids = ids[:, None, :].expand(N, T, U1).to(torch.int64)
    gathered = torch.stack([log_probs[..., blank], log_probs.gather(3, ids[..., None])[..., 0]], -1)
    costs_g, grads_g = core.rnnt_loss(gathered.contiguous(), labels, tl, ul, blank=-1,
                                      fastemit_lambda=0.25)
    label_grad = want_grad.gather(3, ids[..., None])[..., 0]
    label_grad[torch.arange(U1)[None, None, :].expand(N, T, U1) >= ul[:, None, None]] = 0.0
    assert rel_err(costs_g, want_costs) <= TOL
    assert rel_err(grads_g, torch.stack([want_grad[..., blank], label_grad], -1)) <= TOL


def test_binding_compact_forward_and_backward():
    """``_C.rnnt_loss_compact`` gives ``(costs, grads (STU, 2), loc (STU,))`` and
    ``_C.rnnt_loss_compact_backward`` scatters ``grads`` times the upstream into ``(STU, V)``."""
    case = CASES[0]
    log_probs, labels, tl, ul, blank = inputs(case)
    w = upstream_weights(case.B, torch.float32)
    want_costs, want_grad = oracle(log_probs, labels, tl, ul, blank, weights=w)
    rows, labs = compact(log_probs, labels, tl, ul)
    costs, grads, loc = core.rnnt_loss_compact(rows, labs, tl, ul, blank)
    assert grads.shape == (rows.shape[0], 2) and loc.dtype == torch.int64
    # loc: the label of each row, the blank on each frame's last row.
    u = torch.arange(labels.shape[1] + 1)[None, :]
    node_label = torch.where(u < ul[:, None], torch.nn.functional.pad(labels, (0, 1)), blank)
    want_loc = compact(node_label[:, None, :, None].expand(-1, log_probs.shape[1], -1, 1), labels, tl, ul)[0]
    assert torch.equal(loc, want_loc[:, 0])
    assert rel_err(costs, want_costs) <= TOL
    cumlen = torch.cumsum(tl * (ul + 1), 0, dtype=torch.int32)
    grad = core.rnnt_loss_compact_backward(w, grads, cumlen, loc, case.V, blank)
    assert rel_err(grad, compact(want_grad, labels, tl, ul)[0]) <= TOL
    costs_ng, grads_ng, _ = core.rnnt_loss_compact(rows, labs, tl, ul, blank, required_grad=False)
    assert torch.equal(costs_ng, costs) and grads_ng.numel() == 0


def test_binding_compact_backward_checks_its_arguments():
    """``V``, ``loc`` and ``cumSum`` were trusted: a ``loc`` outside ``[0, V)`` indexed out
    of bounds, a bool ``V`` was 1, and a ``cumSum`` that was not the cumulative row counts
    gave rows to the wrong sequence in silence. Each is an ArgumentError naming it."""
    case = CASES[0]
    log_probs, labels, tl, ul, blank = inputs(case)
    rows, labs = compact(log_probs, labels, tl, ul)
    _, grads, loc = core.rnnt_loss_compact(rows, labs, tl, ul, blank)
    cum = torch.cumsum(tl * (ul + 1), 0, dtype=torch.int32)
    w = torch.ones(case.B)
    for args, words in (((loc + case.V, case.V), r"loc must hold class ids in \[0, V\)"),
                        ((loc - 1, case.V), r"loc must hold class ids in \[0, V\)"),
                        ((loc, True), "V must be an int, got True"),
                        ((loc, "5"), "V must be an int, got '5'"),
                        ((loc, 0), "V must be >= 1")):
        with pytest.raises(core.ArgumentError, match=words):
            core.rnnt_loss_compact_backward(w, grads, cum, args[0], args[1], blank)
    for bad in (cum - 1, cum.flip(0)):
        with pytest.raises(core.ArgumentError, match="cumSum must be the cumulative row counts"):
            core.rnnt_loss_compact_backward(w, grads, bad, loc, case.V, blank)
    # V as a NumPy or 0-d tensor integer, as before
    for V in (np.int64(case.V), torch.tensor(case.V)):
        torch.testing.assert_close(core.rnnt_loss_compact_backward(w, grads, cum, loc, V, blank),
                                   core.rnnt_loss_compact_backward(w, grads, cum, loc, case.V, blank))


def test_binding_compact_backward_asserts_on_the_device(device_checks, monkeypatch):
    """On the device path (the CUDA default, no host read) the same two rules are
    device-side asserts naming them."""
    from rnnt_lattice import _rules
    case = CASES[0]
    log_probs, labels, tl, ul, blank = inputs(case)
    rows, labs = compact(log_probs, labels, tl, ul)
    _, grads, loc = core.rnnt_loss_compact(rows, labs, tl, ul, blank)
    cum = torch.cumsum(tl * (ul + 1), 0, dtype=torch.int32)
    failed = []
    monkeypatch.setattr(torch, "_assert_async", lambda ok, msg="": failed.append(msg) if not bool(ok) else None)
    core.rnnt_loss_compact_backward(torch.ones(case.B), grads, cum, loc, case.V, blank)
    assert failed == []
    core.rnnt_loss_compact_backward(torch.ones(case.B), grads, cum.flip(0), loc - 1, case.V, blank)
    assert failed == [_rules.device_message("compact_loc"), _rules.device_message("compact_rows")]


@pytest.mark.parametrize("layout", ["padded", "compact"])
def test_autograd_functions(layout):
    """``RNNTLoss.apply`` / ``RNNTLossCompact.apply`` with warp-rnnt's positional arguments."""
    case = CASES[3]
    log_probs, labels, tl, ul, blank = inputs(case)
    w = upstream_weights(case.B, torch.float32)
    want_costs, want_grad = oracle(log_probs, labels, tl, ul, blank, 0.5, w)
    if layout == "compact":
        rows, labs = compact(log_probs, labels, tl, ul)
        x = rows.requires_grad_()
        costs = warp_rnnt.RNNTLossCompact.apply(x, labs, tl, ul, blank, 0.5, True)
        want_grad = compact(want_grad, labels, tl, ul)[0]
    else:
        x = log_probs.clone().requires_grad_()
        costs = warp_rnnt.RNNTLoss.apply(x, labels, tl, ul, blank, 0.5)
    (costs * w).sum().backward()
    assert rel_err(costs, want_costs) <= TOL and rel_err(x.grad, want_grad) <= TOL


def test_masked_classes_and_sequences_without_a_path():
    """``-inf`` log-probs are exact (warp-rnnt's ``log_sum_exp(-inf, -inf)`` is NaN, and a
    node whose two incoming arcs are masked poisons every later node); a sequence with
    ``T_b = 0`` costs ``+inf`` with a zero gradient."""
    case = Case("masked", (4, 0, 3), (2, 1, 2), 5, 0, T=4, U=2)
    log_probs, labels, tl, ul, blank = inputs(case, seed=2)
    # Sequence 0: the label arcs out of (0, 0) and (1, 0) are masked, so alpha(1, 1) sums two
    # impossible paths; paths through (2, 0) remain.
    log_probs[0, 0, 0, labels[0, 0]] = -math.inf
    log_probs[0, 1, 0, labels[0, 0]] = -math.inf
    # Sequence 2: every label arc masked: no path at all.
    for u in range(2):
        log_probs[2, :, u, labels[2, u]] = -math.inf
    w = upstream_weights(case.B, torch.float32)
    want_costs, want_grad = oracle(log_probs, labels, tl, ul, blank, weights=w)
    assert math.isfinite(want_costs[0]) and want_costs[1:].isinf().all()
    for layout in ("padded", "compact"):
        x, labs = compact(log_probs, labels, tl, ul) if layout == "compact" else (log_probs.clone(), labels)
        x.requires_grad_()
        costs = warp_rnnt.rnnt_loss(x, labs, tl, ul, blank=blank, compact=layout == "compact")
        (costs * w).sum().backward()
        assert rel_err(costs, want_costs) <= TOL
        g = compact(want_grad, labels, tl, ul)[0] if layout == "compact" else want_grad
        assert rel_err(x.grad, g) <= TOL and torch.isfinite(x.grad).all()


def test_dtypes():
    """Padded log-probs are float32 only; compact ones may be any floating dtype, computed in
    float32 (warp-rnnt's ``log_probs.float()``); labels and lengths are int32. Any strides."""
    log_probs, labels, tl, ul, blank = inputs(CASES[0])
    for bad, name in ((dict(log_probs=log_probs.double()), "log_probs"),
                      (dict(labels=labels.long()), "labels"),
                      (dict(frames_lengths=tl.long()), "frames_lengths"),
                      (dict(labels_lengths=ul.long()), "labels_lengths")):
        args = dict(log_probs=log_probs, labels=labels, frames_lengths=tl, labels_lengths=ul) | bad
        with pytest.raises(ValueError, match=name) as err:
            warp_rnnt.rnnt_loss(**args, blank=blank)
        assert isinstance(err.value, RuntimeError)        # what warp-rnnt's TORCH_CHECK raises
    rows, labs = compact(log_probs, labels, tl, ul)
    for dtype in (torch.float64, torch.float16):
        costs = warp_rnnt.rnnt_loss(rows.to(dtype), labs, tl, ul, blank=blank, compact=True)
        assert costs.dtype == torch.float32
        rounded = unpack(rows.to(dtype).float(), tl, ul, log_probs.shape)
        want_dtype, _ = oracle(rounded, labels, tl, ul, blank)
        assert rel_err(costs, want_dtype) <= TOL
    strided = log_probs.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    assert torch.equal(warp_rnnt.rnnt_loss(strided, labels, tl, ul, blank=blank),
                       warp_rnnt.rnnt_loss(log_probs, labels, tl, ul, blank=blank))


def test_label_equal_to_blank_is_an_error():
    """warp-rnnt silently corrupts that node's gradient (the label's overwrites the blank's,
    or the compact kernel drops the label's); here it is a ValueError naming the labels."""
    log_probs, labels, tl, ul, blank = inputs(CASES[0])
    labels[0, 0] = blank
    with pytest.raises(ValueError, match=r"^labels\[0, 0\] equals the blank"):
        warp_rnnt.rnnt_loss(log_probs, labels, tl, ul, blank=blank)
    # The binding's compact loss too (it reads each row's [blank, label] pair only: a label
    # equal to the blank gave a finite loss of another lattice).
    rows, labs = compact(log_probs, labels, tl, ul)
    with pytest.raises(core.ArgumentError, match=r"^ys\[0\] equals the blank id"):
        core.rnnt_loss_compact(rows, labs, tl, ul, blank)
    labs[0] = log_probs.shape[-1]
    with pytest.raises(core.ArgumentError, match=r"^ys must hold label ids in \[0, V\)"):
        core.rnnt_loss_compact(rows, labs, tl, ul, blank)


def test_binding_runs_eagerly_under_compile():
    """The binding's functions under ``torch.compile``: eager calls inside the graph (a
    graph break, as the extension's), so their checks read the values and their gradient is
    the eager one (traced, a bad label indexed out of bounds, a bad ``loc`` went unchecked,
    and a first call that compiled the Numba kernels failed inside TorchDynamo)."""
    log_probs, labels, tl, ul, blank = inputs(CASES[0])
    rows, labs = compact(log_probs, labels, tl, ul)
    fn = torch.compile(lambda r, y: core.rnnt_loss_compact(r, y, tl, ul, blank), backend="eager")
    for got, want in zip(fn(rows, labs), core.rnnt_loss_compact(rows, labs, tl, ul, blank)):
        assert torch.equal(got, want)
    bad = labs.clone()
    bad[0] = -1
    with pytest.raises(core.ArgumentError, match="ys must hold label ids"):
        fn(rows, bad)
    _, grads, loc = core.rnnt_loss_compact(rows, labs, tl, ul, blank)
    cumlen = torch.cumsum(tl * (ul + 1), 0, dtype=torch.int32)
    back = torch.compile(lambda l: core.rnnt_loss_compact_backward(
        torch.ones(tl.shape[0]), grads, cumlen, l, log_probs.shape[-1], blank), backend="eager")
    bad_loc = loc.clone()
    bad_loc[0] = -1
    with pytest.raises(core.ArgumentError, match="loc must hold class ids"):
        back(bad_loc)
    torch._dynamo.reset()


def test_errors_name_the_argument():
    log_probs, labels, tl, ul, blank = inputs(CASES[0])
    call = lambda *a, **kw: warp_rnnt.rnnt_loss(*(a or (log_probs, labels, tl, ul)), **kw)
    for kw, pattern in ((dict(reduction="avg"), "reduction"), (dict(blank=6), r"blank=6"),
                        (dict(blank=1.0), "blank must be an int"), (dict(gather=1), "gather"),
                        (dict(average_frames="yes"), "average_frames"), (dict(compact=1), "compact"),
                        (dict(blank=-1), r"log_probs .* values only for blank and label"),
                        (dict(blank=-1, gather=True), r"blank=-1 must be in \[0, V\)")):
        with pytest.raises(ValueError, match=pattern):
            call(**kw)
    rows, labs = compact(log_probs, labels, tl, ul)
    with pytest.raises(ValueError, match=r"labels shape must be equal to \(sum\(labels_lengths\), \)"):
        call(rows, labs[:-1], tl, ul, compact=True)
    with pytest.raises(ValueError, match=r"rows"):
        call(rows[:-1], labs, tl, ul, compact=True)
    meta = [t.to("meta") for t in (rows, labs, tl, ul)]         # (torch's NotImplementedError)
    with pytest.raises(ValueError, match=r"labels_lengths is on the meta device"):
        call(*meta, compact=True)
    with pytest.raises(ValueError, match=r"log_probs must have 4 dimensions"):
        call(rows, labels, tl, ul)
    # The binding's own checks, in warp-rnnt's words.
    with pytest.raises(RuntimeError, match="xs must be contiguous"):
        core.rnnt_loss(log_probs.transpose(1, 2), labels, tl, ul)
    with pytest.raises(RuntimeError, match="ys must be a Int tensor"):
        core.rnnt_loss(log_probs, labels.long(), tl, ul)
    with pytest.raises(RuntimeError, match=r"ys shape \(N, U-1\)"):
        core.rnnt_loss(log_probs, labels[:, :-1].contiguous(), tl, ul)
    with pytest.raises(RuntimeError, match=r"xs shape mismatch"):
        core.rnnt_loss_compact(rows[:-1], labs, tl, ul)


def test_docstring_examples():
    result = doctest.testmod(warp_rnnt, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
