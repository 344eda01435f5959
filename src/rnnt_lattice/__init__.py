"""rnnt_lattice: exact, fast RNN-Transducer loss and lattice tools for PyTorch.

Importing this package needs torch and numpy only; Numba and Triton load on first use.
"""
from .functional import empty_cache, rnnt_loss
from .modules import RNNTLoss
from .analysis import (Alignment, Occupancy, PruneCoverage, best_alignment, occupancy,
                      prune_coverage)

__version__ = "0.1.0"

__all__ = ["rnnt_loss", "RNNTLoss", "empty_cache", "__version__",
           "occupancy", "Occupancy", "best_alignment", "Alignment", "prune_coverage", "PruneCoverage"]
