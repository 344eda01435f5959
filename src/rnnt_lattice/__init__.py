"""rnnt_lattice: exact, fast RNN-Transducer loss and lattice tools for PyTorch.

Importing this package needs torch and numpy only; Numba and Triton load on first use.
"""
from . import _fork  # noqa: F401  (the fork hook, before any child is forked: cpu/_config.py)
from .functional import empty_cache, multiblank_rnnt_loss, pack_logits, rnnt_loss, tdt_loss
from .fused import fused_multiblank_rnnt_loss, fused_rnnt_loss, fused_tdt_loss
from .joiner import Joiner
from .modules import (FusedMultiblankRNNTLoss, FusedRNNTLoss, FusedTDTLoss, MultiblankRNNTLoss,
                      RNNTLoss, TDTLoss)
from .analysis import (Alignment, Arc, Occupancy, PruneCoverage, best_alignment, occupancy,
                      prune_coverage)
from .pruned import (ArcOccupations, PruneRanges, do_rnnt_pruning, lattice_loss, prune_ranges,
                     rnnt_loss_pruned, rnnt_loss_simple, rnnt_loss_smoothed)
from ._validate import set_input_checks

__version__ = "0.1.0"

__all__ = ["rnnt_loss", "RNNTLoss", "tdt_loss", "TDTLoss", "multiblank_rnnt_loss",
           "MultiblankRNNTLoss", "rnnt_loss_pruned", "pack_logits", "empty_cache", "__version__",
           "occupancy", "Occupancy", "best_alignment", "Alignment", "Arc", "prune_coverage", "PruneCoverage",
           "rnnt_loss_simple", "rnnt_loss_smoothed", "ArcOccupations", "prune_ranges", "PruneRanges",
           "do_rnnt_pruning", "lattice_loss", "fused_rnnt_loss", "fused_tdt_loss",
           "fused_multiblank_rnnt_loss", "FusedRNNTLoss", "FusedTDTLoss",
           "FusedMultiblankRNNTLoss", "Joiner", "set_input_checks"]
