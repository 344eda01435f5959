"""Numba settings for every CPU kernel, in one place.

Environment overrides (read once, at first use of the CPU backend):
    RNNT_LATTICE_NUMBA_CACHE=0     do not cache compiled kernels on disk
    RNNT_LATTICE_NUMBA_PARALLEL=0  compile without prange threading
    RNNT_LATTICE_CACHE_GRAD=0      allocate every gradient buffer anew (no reuse, see cpu/__init__)
The thread count is Numba's: ``numba.set_num_threads`` or ``NUMBA_NUM_THREADS``.
"""
import os


def _flag(name: str, default: bool) -> bool:
    return os.environ.get(name, "1" if default else "0").strip().lower() not in ("0", "false", "no", "")


# Compiled kernels go to __pycache__ (or Numba's user cache dir when that is read-only),
# so a second process does not recompile.
CACHE = _flag("RNNT_LATTICE_NUMBA_CACHE", True)
PARALLEL = _flag("RNNT_LATTICE_NUMBA_PARALLEL", True)
CACHE_GRAD = _flag("RNNT_LATTICE_CACHE_GRAD", True)

# Fast-math flags that let LLVM vectorise the row reductions (reassociation) and fuse
# multiply-adds, but keep IEEE semantics for NaN and +-inf: -inf logits (masked classes),
# -inf log-probs of impossible arcs, and NaN propagation are part of the contract, and
# "nnan"/"ninf" would let LLVM fold the checks for them away.
FASTMATH = {"reassoc", "contract", "arcp", "nsz"}

JIT = dict(nogil=True, cache=CACHE, fastmath=FASTMATH)
PJIT = dict(JIT, parallel=PARALLEL)
