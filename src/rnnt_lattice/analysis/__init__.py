"""Analysis of the lattice — where the alignments lie — built on the loss's own recursion
(no second implementation). The name keeps it apart from the loss kernels' "lattice" pass
and from the pruned *loss*: this package only looks at lattices.

* :func:`occupancy` — node and arc occupation probabilities (math.md section 3);
* :func:`best_alignment` — the Viterbi path (same recursion in the max-plus semiring);
* :func:`prune_coverage` — how much occupancy mass monotone windows of R label positions
  per frame hold (the observation behind pruned RNN-T, math.md section 7).
"""
from .alignment import Alignment, Arc, best_alignment
from .occupancy import Occupancy, occupancy
from .coverage import PruneCoverage, prune_coverage

__all__ = ["Occupancy", "occupancy", "Alignment", "Arc", "best_alignment", "PruneCoverage",
           "prune_coverage"]
