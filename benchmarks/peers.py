"""The provider table: ours and the peers, one adapter each, all with one signature.

    fn(logits, targets, logit_lengths, target_lengths, blank) -> costs (B,)

``logits`` is ``(B, T, U+1, V)`` float32 (float64 at shape s1_f64: a provider that
rejects it shows up as an error row),
``targets`` ``(B, U)`` int32, the lengths ``(B,)`` int32, all as made by
:func:`shapes.make_inputs`. ``costs`` are the per-sequence ``-log P(y|x)``, differentiable
w.r.t. ``logits`` (the runner calls ``costs.sum().backward()``); a provider that cannot
return them per sequence (optimized_transducer) returns their sum as a 0-d tensor. Each adapter does the
conversions its library needs (dtype of the ids, packing, boundary tensors) inside the
call, so they are timed: they are what a user of that library pays too.

Peers are optional: a provider whose import fails is reported as unavailable with the
reason, never an error. Peers live in ``benchmarks/.venv-peers`` (``setup_peers.sh``).

Each provider says where it runs (``devices``: the runner's ``--device``), which loss variants
it implements (``variants``, see ``rnnt_lattice.shapes.VARIANTS``; a case with another one is
reported "unsupported") and whether it overwrites its logits with the gradient (``inplace``:
the runner restores them before each timed call, outside the timing).

``python benchmarks/peers.py --list`` prints which providers import here.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from shapes import VARIANTS


@dataclass
class Provider:
    name: str
    dist: Optional[str]              # distribution name, for the version column
    load: Callable[[], Callable]     # -> the adapter; raises ImportError if unavailable
    note: str = ""
    devices: tuple = ("cpu", "cuda")
    variants: tuple = ("regular",)
    inplace: bool = False            # writes the gradient over the logits
    ours: bool = False
    _fn: Optional[Callable] = field(default=None, repr=False)
    _err: Optional[str] = field(default=None, repr=False)

    def get(self) -> Callable:
        """The adapter, loaded once; raises ImportError with the reason if unavailable."""
        if self._fn is None and self._err is None:
            try:
                self._fn = self.load()
            except Exception as err:      # an optional peer may fail in any way on import
                self._err = f"{type(err).__name__}: {err}"
        if self._err is not None:
            raise ImportError(self._err)
        return self._fn


# --------------------------------------------------------------------------- ours

def _ours(backend: str, inplace_grad: bool = False):
    def load():
        import rnnt_lattice

        from shapes import variant_loss

        def fn(logits, targets, logit_lengths, target_lengths, blank, variant="regular"):
            return variant_loss(variant, logits, targets, logit_lengths, target_lengths, blank,
                                backend=backend, inplace_grad=inplace_grad)
        # Fail here, not at the first call, when the backend's module does not import.
        if backend == "numba":
            importlib.import_module("rnnt_lattice.cpu")
        elif backend == "triton":
            importlib.import_module("rnnt_lattice.gpu")
        return fn
    return load


# --------------------------------------------------------------------------- peers

def _torchaudio():
    import warnings

    import torchaudio.functional as F
    # 2.9 warns on every call that rnnt_loss is deprecated (it still works).
    warnings.filterwarnings("ignore", message=r".*rnnt_loss has been deprecated", category=UserWarning)

    def fn(logits, targets, logit_lengths, target_lengths, blank):
        return F.rnnt_loss(logits, targets, logit_lengths, target_lengths, blank=blank,
                           reduction="none")
    return fn


def _numpy2_aliases():
    """NeMo's and warprnnt-numba's Numba code call ``np.row_stack``, which NumPy 2 removed
    (it was an alias of ``np.vstack``): restore the alias before importing them."""
    import numpy as np
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack


def _warprnnt_numba():
    _numpy2_aliases()
    from warprnnt_numba.rnnt_loss.rnnt_pytorch import rnnt_loss

    def fn(logits, targets, logit_lengths, target_lengths, blank):
        # CPU path: an explicit log_softmax (autograd) feeds its Numba kernel.
        return rnnt_loss(logits, targets, logit_lengths, target_lengths, blank=blank,
                         reduction="none", clamp=0.0)
    return fn


def _import_nemo_rnnt_loss():
    """Import ``nemo.collections.asr.parts.numba.rnnt_loss`` without running the parents'
    ``__init__``: ``nemo.collections.asr`` imports the whole ASR collection (hydra,
    lightning, lhotse, ...). The parents are registered as bare namespace modules over the
    installed directories, so the loss module itself is NeMo's code, unchanged."""
    name = "nemo.collections.asr.parts.numba.rnnt_loss"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec("nemo")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("nemo-toolkit is not installed")
    root = Path(list(spec.submodule_search_locations)[0])
    parts = name.split(".")
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if pkg not in sys.modules:
            mod = types.ModuleType(pkg)
            mod.__path__ = [str(root.joinpath(*parts[1:i]))]
            sys.modules[pkg] = mod
    return importlib.import_module(name)


def _nemo_numba():
    _numpy2_aliases()
    _import_nemo_rnnt_loss()
    from nemo.collections.asr.parts.numba.rnnt_loss.rnnt_pytorch import rnnt_loss

    def fn(logits, targets, logit_lengths, target_lengths, blank):
        # NeMo's CPU path checks for int64 labels and lengths.
        return rnnt_loss(logits, targets.long(), logit_lengths.long(), target_lengths.long(),
                         blank=blank, reduction="none", clamp=0.0)
    return fn


def _nemo_numba_topology(variant: str):
    """NeMo's numba CUDA TDT / multi-blank losses (``TDTLossNumba``,
    ``MultiblankRNNTLossNumba``; CUDA only: their CPU paths raise). The inputs of
    :func:`shapes.make_inputs` for these variants are already in NeMo's layout: the blank is
    the last token, TDT's duration logits follow the tokens, multi-blank's big blank of
    duration d_i sits at blank-1-i. The losses return per-sequence costs for a reduction
    other than 'sum'/'mean', multiplied by (1 + fastemit_lambda) (0 here)."""
    from shapes import BIG_BLANK_DURATIONS, TDT_DURATIONS

    def load():
        _numpy2_aliases()
        _import_nemo_rnnt_loss()
        from nemo.collections.asr.parts.numba.rnnt_loss import rnnt_pytorch
        if variant == "tdt":
            loss = rnnt_pytorch.TDTLossNumba(blank=-1, durations=list(TDT_DURATIONS),
                                             reduction="none")
        else:
            loss = rnnt_pytorch.MultiblankRNNTLossNumba(
                blank=-1, big_blank_durations=list(BIG_BLANK_DURATIONS), reduction="none")

        def fn(logits, targets, logit_lengths, target_lengths, blank, variant=variant):
            loss.blank = blank                     # the case's blank, known only at the call
            # NeMo checks for int64 labels and lengths, and contiguous acts.
            return loss(logits.contiguous(), targets.long(), logit_lengths.long(),
                        target_lengths.long())
        return fn
    return load


def _fast_rnnt():
    import fast_rnnt

    def fn(logits, targets, logit_lengths, target_lengths, blank, variant="regular"):
        B = logits.shape[0]
        boundary = torch.zeros(B, 4, dtype=torch.int64, device=logits.device)
        boundary[:, 2] = target_lengths
        boundary[:, 3] = logit_lengths
        return fast_rnnt.rnnt_loss(logits, targets.long(), termination_symbol=blank,
                                   boundary=boundary, rnnt_type=variant, reduction="none")
    return fn


def _optimized_transducer():
    import optimized_transducer

    def fn(logits, targets, logit_lengths, target_lengths, blank):
        # It takes logits packed as (sum_b T_b (U_b+1), V) and, when they need a gradient,
        # overwrites them with it: the packing copy (through autograd, so the gradient reaches
        # the padded tensor) is part of its cost here. A joiner written for it would emit
        # the packed layout directly and skip this copy.
        T_b, U_b = logit_lengths.tolist(), target_lengths.tolist()
        V = logits.shape[-1]
        packed = torch.cat([logits[b, :t, :u + 1].reshape(-1, V)
                            for b, (t, u) in enumerate(zip(T_b, U_b))])
        # Only "sum" and "mean" exist: this provider returns the batch sum (a 0-d tensor),
        # so the runner checks its summed loss (and the full gradient).
        return optimized_transducer.transducer_loss(
            packed, targets, logit_lengths, target_lengths, blank=blank,
            from_log_softmax=False, reduction="sum")
    return fn


PROVIDERS = {p.name: p for p in (
    Provider("rnnt_lattice", "rnnt-lattice", _ours("numba"), "backend='numba'",
             devices=("cpu",), variants=tuple(VARIANTS), ours=True),
    Provider("rnnt_lattice_torch", "rnnt-lattice", _ours("torch"),
             "backend='torch' (pure-PyTorch reference)", variants=tuple(VARIANTS), ours=True),
    Provider("rnnt_lattice_triton", "rnnt-lattice", _ours("triton"), "backend='triton'",
             devices=("cuda",), variants=tuple(VARIANTS), ours=True),
    Provider("rnnt_lattice_triton_inplace", "rnnt-lattice", _ours("triton", inplace_grad=True),
             "backend='triton', inplace_grad=True (gradient written over the logits)",
             devices=("cuda",), variants=tuple(VARIANTS), inplace=True, ours=True),
    Provider("torchaudio", "torchaudio", _torchaudio, "torchaudio.functional.rnnt_loss"),
    Provider("warprnnt_numba", "warprnnt-numba", _warprnnt_numba,
             "CPU: autograd log_softmax + Numba kernel"),
    Provider("nemo_numba", "nemo-toolkit", _nemo_numba,
             "nemo...numba.rnnt_loss (CPU: log_softmax + Numba kernel)"),
    Provider("nemo_tdt", "nemo-toolkit", _nemo_numba_topology("tdt"),
             "nemo...numba TDTLossNumba (CUDA only)", devices=("cuda",), variants=("tdt",)),
    Provider("nemo_multiblank", "nemo-toolkit", _nemo_numba_topology("multiblank"),
             "nemo...numba MultiblankRNNTLossNumba (CUDA only)", devices=("cuda",),
             variants=("multiblank",)),
    Provider("fast_rnnt", "fast_rnnt", _fast_rnnt, "fast_rnnt.rnnt_loss (rnnt_type = the variant)",
             variants=("regular", "modified", "constrained")),
    Provider("optimized_transducer", "optimized_transducer", _optimized_transducer,
             "transducer_loss on packed logits (packing copy included; batch sum only)"),
)}


def for_device(device: str, ours_only: bool = False) -> list:
    """Names of the providers that run on ``device`` (the runner's default set)."""
    return [n for n, p in PROVIDERS.items() if device in p.devices and (p.ours or not ours_only)]


def available(device: str = None) -> dict:
    """name -> None if importable, else the reason (on ``device`` only, if given)."""
    out = {}
    for name, p in PROVIDERS.items():
        if device is not None and device not in p.devices:
            continue
        try:
            p.get()
            out[name] = None
        except ImportError as err:
            out[name] = str(err)
    return out


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print which providers import here")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="only the providers that run there")
    args = ap.parse_args()
    for name, why in available(args.device).items():
        where = "/".join(PROVIDERS[name].devices)
        print(f"{name:28s} {where:9s} {'ok' if why is None else 'unavailable: ' + why}")
