"""warprnnt-numba's ``numba_utils``, answered for this module's losses: whether they run on
CPU and on CUDA tensors here.

warprnnt-numba's README asks its users to test, before a CUDA run, that their Numba can
compile for their CUDA (``numba_cuda_is_supported(__NUMBA_MINIMUM_VERSION__)``). This
module's losses run on rnnt_lattice's kernels (Numba on CPU, Triton on CUDA, PyTorch where
neither imports), so no Numba CUDA is involved: the questions keep their names and
arguments and get the answers that hold for them. ``min_version`` is accepted and not used.
"""
from __future__ import annotations

import os

import torch

__all__ = ["numba_cpu_is_supported", "numba_cuda_is_supported",
           "skip_numba_cuda_test_if_unsupported", "__NUMBA_MINIMUM_VERSION__"]

# warprnnt-numba's names and values (NEMO_NUMBA_MINVER, as there, overrides the default).
__NUMBA_DEFAULT_MINIMUM_VERSION__ = "0.53.0"
__NUMBA_MINIMUM_VERSION__ = os.environ.get("NEMO_NUMBA_MINVER", __NUMBA_DEFAULT_MINIMUM_VERSION__)


def numba_cpu_is_supported(min_version: str) -> bool:
    """Whether the losses run on CPU tensors: always (without Numba, on the PyTorch
    backend)."""
    return True


def numba_cuda_is_supported(min_version: str) -> bool:
    """Whether the losses run on CUDA tensors here: whether PyTorch sees a CUDA device."""
    return torch.cuda.is_available()


def skip_numba_cuda_test_if_unsupported(min_version: str) -> None:
    """Skip the calling pytest test when :func:`numba_cuda_is_supported` is false."""
    if not numba_cuda_is_supported(min_version):
        import pytest

        pytest.skip("no CUDA device: the CUDA test is skipped")
