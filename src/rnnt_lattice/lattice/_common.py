"""Validate -> pick a backend, shared by the lattice tools (the checks are the loss's)."""
from __future__ import annotations

import torch

from .. import _backends
from .._validate import Checked, check_lattice_args


def prepare(logits, targets, logit_lengths, target_lengths, blank, backend):
    """Checked arguments (float16/bfloat16 logits promoted to float32, contiguous) and the
    backend module."""
    chk = check_lattice_args(logits, targets, logit_lengths, target_lengths, blank)
    impl = _backends.resolve(backend, logits.device)
    x = chk.logits.detach()
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    chk = Checked(x.contiguous(), chk.targets, chk.logit_lengths, chk.target_lengths,
                  chk.blank, chk.input_dtype)
    return chk, impl
