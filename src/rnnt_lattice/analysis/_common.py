"""Validate -> pick a backend, shared by the lattice tools (the loss's own preparation)."""
from __future__ import annotations

from .. import _backends


def prepare(logits, targets, logit_lengths, target_lengths, blank, backend):
    """``(chk, impl)``: the checked arguments (logits detached, in the dtype the backend
    reads, contiguous) and the backend module."""
    impl, chk = _backends.prepare(logits.detach() if hasattr(logits, "detach") else logits,
                                  targets, logit_lengths, target_lengths, blank, backend)
    return chk, impl
