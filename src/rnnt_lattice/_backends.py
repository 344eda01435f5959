"""Backend selection. Backends are loaded only when first used, so importing rnnt_lattice
needs torch and numpy only.

Every backend module provides the same functions:

    rnnt_costs(logits, targets, logit_lengths, target_lengths, blank, clamp, fused, fastemit_lambda,
               inplace_grad=False)
        -> (B,) per-sequence -log P, differentiable w.r.t. logits (float32/float64 logits;
           also float16/bfloat16 where the module sets NATIVE_LOW_PRECISION = True)
    costs_and_grad(logits, targets, logit_lengths, target_lengths, blank, clamp, fused,
                   fastemit_lambda, need_grad)
        -> (costs, per-sequence gradient or None), no autograd (behind the torch.compile op)
    compute_lattice(logits, targets, logit_lengths, target_lengths, blank, fused) -> Lattice
    viterbi(logits, targets, logit_lengths, target_lengths, blank, fused)
        -> (alpha_max, lpb, lpl), each (B, T, U+1): max-plus alpha and the arc log-probs
"""
from __future__ import annotations

import importlib
import warnings

import torch

BACKENDS = ("auto", "numba", "torch", "triton")

_MODULES = {
    "torch": ".reference",
    "numba": ".cpu",
    "triton": ".gpu",
}
_warned_fallback: set[str] = set()


def _load(name: str):
    return importlib.import_module(_MODULES[name], __package__)


def _available(name: str) -> bool:
    try:
        _load(name)
    except ImportError:
        return False
    return True


def resolve(backend: str, device: torch.device):
    """The backend module for ``backend`` on ``device``; raises ValueError for bad choices."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        preferred = {"cpu": "numba", "cuda": "triton"}.get(device.type, "torch")
        if preferred != "torch" and not _available(preferred):
            if preferred not in _warned_fallback:
                _warned_fallback.add(preferred)
                warnings.warn(
                    f"rnnt_lattice: the {preferred!r} backend is not importable on this machine; "
                    f"falling back to the pure-PyTorch backend (slower). Install "
                    f"{'numba' if preferred == 'numba' else 'triton'} to use it.",
                    RuntimeWarning, stacklevel=3)
            preferred = "torch"
        return _load(preferred)
    if backend == "numba" and device.type != "cpu":
        raise ValueError(f"backend='numba' runs on CPU tensors only, got logits on {device}")
    try:
        return _load(backend)
    except ImportError as err:
        raise ValueError(f"backend={backend!r} is not available: {err}") from err
