"""Backend selection and the one preparation of the inputs. Backends are loaded only when
first used, so importing rnnt_lattice needs torch and numpy only.

Every backend module provides the same functions (the loss protocol is ``_ops``'s):

    loss_forward(logits, targets, logit_lengths, target_lengths, opts, need_grad)
        -> (costs (B,), saved tensors, state)
    loss_backward(saved, state, upstream (B,), opts) -> gradient (B, T, U+1, V)
    INPLACE_WRITES_IN = "forward" | "backward"
    compute_lattice(logits, targets, logit_lengths, target_lengths, blank, fused) -> Lattice
    viterbi(logits, targets, logit_lengths, target_lengths, blank, fused)
        -> (alpha_max, lpb, lpl), each (B, T, U+1): max-plus alpha and the arc log-probs

The Numba and Triton backends also give the lattice tools (``rnnt_lattice.analysis``) any
topology (``opts``: topology, blank, fused, sigma, delay penalty; k2 ``boundary``):

    kind_occupancy(logits, targets, logit_lengths, target_lengths, opts, boundary)
        -> reference.GenericLattice: alpha, beta (B, T+1, U+1), log_like, gamma (B, K, T, U+1)
    kind_viterbi(logits, targets, logit_lengths, target_lengths, opts, boundary)
        -> (alpha_max, best_kind (B, T+1, U+1) int8, log_prob (B,))

(the pure-PyTorch backend's are ``reference.lattice_generic`` / ``sweep_alpha``), and
may set ``NATIVE_LOW_PRECISION`` (its kernels read float16/bfloat16 logits) and
``NATIVE_INT32_IDS`` (they read int32 ids and lengths) to skip the conversions.
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


def check_name(backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def resolve(backend: str, device: torch.device):
    """The backend module for ``backend`` on ``device``; raises ValueError for bad choices."""
    check_name(backend)
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


def prepare(logits, targets, logit_lengths, target_lengths, blank, backend, *,
            traced: bool = False, n_tokens=None, node_rows=None, allow_blank_targets=False):
    """Validate, pick the backend, and bring the logits to what its kernels read:
    ``(impl, chk)`` with ``chk.logits`` contiguous, float16/bfloat16 promoted to float32
    unless the backend reads them natively (autograd casts the gradient back), and int32
    ids kept where the backend reads them. ``traced``: under ``torch.compile`` the backend
    is resolved when the custom op runs (``impl`` is None) and half types are promoted.
    Every backend computes every topology, per-arc term and layout; ``n_tokens``: see ``check_lattice_args``; ``node_rows``: the logits
    are rows ``(N, V)`` of that node -> row map (``_ops``); ``allow_blank_targets``: see
    ``check_lattice_args``."""
    from ._validate import Checked, check_lattice_args
    if traced:
        check_name(backend)
        impl = None
    else:
        impl = resolve(backend, logits.device)
    chk = check_lattice_args(logits, targets, logit_lengths, target_lengths, blank,
                             int64_ids=not getattr(impl, "NATIVE_INT32_IDS", False),
                             n_tokens=n_tokens,
                             grid=None if node_rows is None else tuple(node_rows.shape),
                             allow_blank_targets=allow_blank_targets)
    x = chk.logits
    if x.dtype in (torch.float16, torch.bfloat16) and not getattr(impl, "NATIVE_LOW_PRECISION", False):
        x = x.float()
    if x is not chk.logits or not x.is_contiguous():
        chk = Checked(x.contiguous(), chk.targets, chk.logit_lengths, chk.target_lengths, chk.blank)
    return impl, chk
