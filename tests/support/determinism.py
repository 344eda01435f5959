"""``torch.use_deterministic_algorithms`` set for a block and put back after it: the
deterministic-mode tests (``test_deterministic.py``, which adds CUDA's refusals) and the
kernels' ordered variants (``test_triton.py``)."""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def deterministic_algorithms(on: bool = True):
    """``torch.use_deterministic_algorithms(on)`` inside, the mode and its ``warn_only``
    flag as they were after."""
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
