"""Validate -> pick a backend, shared by the lattice tools (the loss's own preparation), and
the choice of lattice: the regular topology through a backend's kernels, anything else
through the reference's generic recursion (``reference.kind_log_probs`` / ``arc_weights``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _backends
from .._types import LossOptions
from .._validate import check_boundary, check_float
from ..topology import Topology, regular

RNNT_TYPES = ("regular", "modified", "constrained", "one_sym_per_frame")


def prepare(logits, targets, logit_lengths, target_lengths, blank, backend):
    """``(chk, impl)``: the checked arguments (logits detached, in the dtype the backend
    reads, contiguous) and the backend module."""
    impl, chk = _backends.prepare(logits.detach() if hasattr(logits, "detach") else logits,
                                  targets, logit_lengths, target_lengths, blank, backend)
    return chk, impl


def resolve_topology(rnnt_type: str, topology) -> Topology | None:
    """The topology asked for: ``topology`` (a :class:`rnnt_lattice.topology.Topology`) or
    the named ``rnnt_type``; None for the regular one."""
    if rnnt_type not in RNNT_TYPES:
        raise ValueError(f"rnnt_type must be one of {RNNT_TYPES}, got {rnnt_type!r}")
    if topology is not None:
        if not isinstance(topology, Topology):
            raise ValueError(f"topology must be an rnnt_lattice.topology.Topology or None, got "
                             f"{type(topology).__name__}")
        if rnnt_type != "regular":
            raise ValueError(f"give either rnnt_type ({rnnt_type!r}) or topology "
                             f"({topology.name!r}), not both")
        return topology
    if rnnt_type == "regular":
        return None
    from .. import topology as topo_mod
    return getattr(topo_mod, rnnt_type)()


@dataclass(frozen=True)
class Request:
    """One analysis call after validation: the topology (never None), whether the regular
    kernels compute it, the checked tensors and the backend module."""

    topo: Topology
    kernel: bool
    chk: object
    impl: object
    fused: bool
    sigma: float
    delay_penalty: float
    boundary: torch.Tensor | None


def request(logits, targets, logit_lengths, target_lengths, blank, fused, backend, rnnt_type,
            topology, sigma, delay_penalty, boundary) -> Request:
    """Validate an analysis call. The plain regular lattice (no sigma, delay penalty or
    boundary) goes to the backend's kernels; any other lattice to the reference's generic
    recursion, whichever backend is named (the loss kernels compute no per-kind
    occupations or max-plus pointers yet)."""
    topo = resolve_topology(rnnt_type, topology)
    sigma = check_float("sigma", sigma, finite=True)
    delay_penalty = check_float("delay_penalty", delay_penalty, minimum=0.0, finite=True)
    opts = LossOptions(0, bool(fused), topology=topo, sigma=sigma, delay_penalty=delay_penalty)
    x = logits.detach() if hasattr(logits, "detach") else logits
    n_tokens = None
    if topo is not None and topo.n_durations and isinstance(x, torch.Tensor) and x.dim() == 4:
        n_tokens = topo.token_classes(x.shape[-1])
    kernel = opts.regular and boundary is None
    if kernel:
        impl, chk = _backends.prepare(x, targets, logit_lengths, target_lengths, blank, backend)
    else:
        impl, chk = _backends.prepare(x, targets, logit_lengths, target_lengths, blank, backend,
                                      opts=opts, boundary=boundary, n_tokens=n_tokens)
    topo = topo if topo is not None else regular()
    topo.check(chk.logits.shape[-1], chk.blank)
    boundary = check_boundary(boundary, chk.logits.shape[0], chk.logits.device, chk.logit_lengths,
                              chk.target_lengths)
    return Request(topo, kernel, chk, impl, bool(fused), sigma, delay_penalty, boundary)


def generic_weights(req: Request):
    """``(w, ends)``: the arc weights ``(B, K, T, U+1)`` in the lattice dtype (``-inf`` off
    the arcs) and the start/end nodes, exactly as the generic loss builds them."""
    from ..reference import Ends, arc_weights, kind_log_probs, lattice_dtype
    chk = req.chk
    ends = Ends.of(chk.logit_lengths, chk.target_lengths, req.boundary)
    if req.boundary is not None:
        ends.check(chk.logits.shape[1], chk.logits.shape[2])   # one device sync, as the loss
    _, _, lp = kind_log_probs(chk.logits, chk.targets, req.topo, chk.blank, req.fused, ends)
    w = arc_weights(lp.to(lattice_dtype(chk.logits.device)), req.topo, ends, req.sigma,
                    req.delay_penalty)
    return w, ends
