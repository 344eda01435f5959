"""Validate -> pick a backend, shared by the lattice tools (the loss's own preparation,
``_backends.prepare_call``), and
the one lattice of every topology: the backend protocol's ``occupancy`` / ``viterbi``
(per-kind occupations and max-plus pointers, on the loss's kernels; the torch backend
runs the reference's recursion)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .. import _backends
from .._rules import with_bad_rows
from .._types import Lattice, LossOptions
from .._validate import check_flag, check_float
from ..topology import Topology, by_name


def resolve_topology(rnnt_type: str, topology) -> Topology:
    """The topology asked for: ``topology`` (a :class:`rnnt_lattice.topology.Topology`) or
    the named ``rnnt_type``."""
    named = by_name(rnnt_type)
    if topology is not None:
        if not isinstance(topology, Topology):
            raise ValueError(f"topology must be an rnnt_lattice.topology.Topology or None, got "
                             f"{type(topology).__name__}")
        if rnnt_type != "regular":
            raise ValueError(f"give either rnnt_type ({rnnt_type!r}) or topology "
                             f"({topology.name!r}), not both")
        return topology
    return named


@dataclass(frozen=True)
class Request:
    """One analysis call after validation: the topology, the checked tensors,
    the backend module and the lattice options (``opts.blank`` resolved for the topology)."""

    topo: Topology
    chk: object
    impl: object
    opts: LossOptions
    boundary: torch.Tensor | None
    nan_rows: torch.Tensor | None     # (B,): NaN for a sequence the device check found bad


def request(logits, targets, logit_lengths, target_lengths, blank, fused, backend, rnnt_type,
            topology, sigma, delay_penalty, boundary) -> Request:
    """Validate an analysis call and pick the backend as the loss does (every backend
    computes every topology, per-arc term and boundary)."""
    topo = resolve_topology(rnnt_type, topology)
    sigma = check_float("sigma", sigma, finite=True)
    delay_penalty = check_float("delay_penalty", delay_penalty, minimum=0.0, finite=True)
    opts = LossOptions(0, check_flag("fused_log_softmax", fused), topology=topo, sigma=sigma,
                       delay_penalty=delay_penalty)
    x = logits.detach() if isinstance(logits, torch.Tensor) else logits
    prep = _backends.prepare_call(x, targets, logit_lengths, target_lengths, blank, backend, opts,
                                  boundary=boundary)
    return Request(topo, prep.chk, prep.impl, prep.opts, prep.boundary, prep.nan_rows)


def kind_field(topo: Topology, name: str, device) -> torch.Tensor:
    """``(K,)`` int64 on ``device``: field ``name`` (``"dt"``, ``"du"``) of every kind,
    written entry by entry (a fill each), not built from a Python list: that would be a
    host-to-device copy, which synchronises a CUDA device."""
    out = torch.empty(len(topo.kinds), dtype=torch.int64, device=device)
    for k, kind in enumerate(topo.kinds):
        out[k].fill_(getattr(kind, name))
    return out


def _kernel_args(req: Request):
    chk = req.chk
    return (chk.logits, chk.targets, chk.logit_lengths, chk.target_lengths, req.opts, req.boundary)


def lattice(req: Request) -> Lattice:
    """The :class:`rnnt_lattice._types.Lattice` of the request (the backend's ``occupancy``):
    alpha, beta ``(B, T+1, U+1)``, log P ``(B,)``, per-kind occupations ``gamma (B, K, T,
    U+1)``."""
    with torch.no_grad():
        lat = req.impl.occupancy(*_kernel_args(req))
    if req.nan_rows is None:
        return lat
    return replace(lat, log_like=with_bad_rows(lat.log_like, req.nan_rows))


def viterbi(req: Request):
    """The max-plus sweep of the request (the backend's ``viterbi``): ``(alpha_max,
    best_kind, log_prob)``, node tensors ``(B, T+1, U+1)`` (``best_kind`` int8: the kind of
    the best arc into each node, -1 where none), ``log_prob (B,)`` the best complete path's
    score (-inf without one, NaN for NaN logits on the lattice)."""
    with torch.no_grad():
        alpha_max, best_kind, log_prob = req.impl.viterbi(*_kernel_args(req))
    return alpha_max, best_kind, with_bad_rows(log_prob, req.nan_rows)
