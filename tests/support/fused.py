"""What the tests of the fused losses share (``test_fused.py``, ``test_joiner.py``): the
public pairs (fused loss, loss on the materialised logits) per topology of
``support.topologies``, the step that takes per-sequence losses and the gradients of every
leaf, and the comparison of two such steps."""
from __future__ import annotations

import warnings

import torch

import rnnt_lattice

from .cases import upstream_weights

# topology name of support.topologies -> (fused function, full function, extra arguments)
PUBLIC = {
    "regular": ("fused_rnnt_loss", "rnnt_loss", dict(rnnt_type="regular")),
    "modified": ("fused_rnnt_loss", "rnnt_loss", dict(rnnt_type="modified")),
    "constrained": ("fused_rnnt_loss", "rnnt_loss", dict(rnnt_type="constrained")),
    "one_sym": ("fused_rnnt_loss", "rnnt_loss", dict(rnnt_type="one_sym_per_frame")),
    "multiblank": ("fused_multiblank_rnnt_loss", "multiblank_rnnt_loss",
                   dict(big_blank_durations=[2, 3])),
    "tdt012": ("fused_tdt_loss", "tdt_loss", dict(durations=[0, 1, 2])),
    "tdt13": ("fused_tdt_loss", "tdt_loss", dict(durations=[1, 3])),
}


# Options every fused path is checked with: name -> (topology name, options); "boundary"
# asks for k2 boundaries (``make_topo_inputs``), "blank_targets" puts the blank among the
# targets (``allow_blank_targets``).
OPTIONS = {
    "fastemit_clamp": ("regular", dict(fastemit_lambda=0.5, clamp=0.05)),
    "delay_boundary": ("constrained", dict(delay_penalty=0.3, boundary=True)),
    "logprob": ("modified", dict(fused_log_softmax=False)),
    "sigma_tdt": ("tdt012", dict(sigma=0.05, fastemit_lambda=0.25, clamp=0.2)),
    "sigma_multiblank": ("multiblank", dict(sigma=0.05, clamp=0.1)),
    "blank_targets": ("regular", dict(allow_blank_targets=True)),
}


def with_option(opt, make):
    """``(topology name, (joiner, enc, pred, targets, tl, ul, blank), options)`` of
    :data:`OPTIONS` ``opt``, the inputs from ``make(topo_name, boundary, log_probs)``
    (``(joiner, enc, pred, targets, tl, ul, blank, boundary)``)."""
    topo_name, kw = OPTIONS[opt]
    kw = dict(kw)
    joiner, enc, pred, targets, tl, ul, blank, bnd = make(
        topo_name, kw.pop("boundary", False), not kw.get("fused_log_softmax", True))
    if bnd is not None:
        kw["boundary"] = bnd
    if opt == "blank_targets":
        targets = targets.masked_fill(torch.arange(targets.shape[1]) == 0, blank)
    return topo_name, (joiner, enc, pred, targets, tl, ul, blank), kw


def leaves(joiner, enc, pred):
    return [x for x in (enc, pred, *joiner.parameters()) if x.requires_grad]


def run(fn, joiner, enc, pred, weights):
    """``fn()`` (per-sequence losses) and the gradients of ``sum(weights * fn())`` w.r.t.
    every leaf that requires grad."""
    for x in leaves(joiner, enc, pred):
        x.grad = None
    out = fn()
    (out * weights.to(out.dtype)).sum().backward()
    return out.detach(), [x.grad.clone() for x in leaves(joiner, enc, pred)]


def full_and_fused(topo_name, joiner, enc, pred, targets, tl, ul, blank, *, tile, backend,
                   weights=None, full_backend=None, **kw):
    """The same call on the materialised logits (``full_backend``, default ``backend``)
    and fused, with signed upstream weights."""
    fused_name, full_name, extra = PUBLIC[topo_name]
    kw = dict(extra, reduction="none", **kw)
    weights = upstream_weights(enc.shape[0]) if weights is None else weights
    full = run(lambda: getattr(rnnt_lattice, full_name)(
        joiner(enc[:, :, None], pred[:, None]), targets, tl, ul, blank=blank,
        backend=full_backend or backend, **kw), joiner, enc, pred, weights)
    fused = run(lambda: getattr(rnnt_lattice, fused_name)(
        joiner, enc, pred, targets, tl, ul, blank=blank, tile=tile, backend=backend, **kw),
        joiner, enc, pred, weights)
    return full, fused


def assert_same(full, fused, tol):
    """Equal infinite losses, the finite ones within ``tol``, every gradient within ``tol``
    of its scale (``max(1, max |g|)``) and free of NaN."""
    (l0, g0), (l1, g1) = full, fused
    assert torch.equal(torch.isinf(l0), torch.isinf(l1)), (l0, l1)
    fin = torch.isfinite(l0)
    assert torch.allclose(l1[fin], l0[fin], rtol=tol, atol=tol), (l0, l1)
    assert len(g0) == len(g1)
    for a, b in zip(g0, g1):
        assert not torch.isnan(b).any()
        scale = max(1.0, float(a.abs().max()))
        assert float((a - b).abs().max()) <= tol * scale, (a, b)


def quiet():
    """The Triton interpreter's NaN notices (NumPy on masked lanes) silenced until
    ``__exit__``."""
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("ignore", RuntimeWarning)
    return ctx
