"""The shape registry, the cases (shape, dtype, loss variant) and the one input factory
shared by every benchmark run.

They live in the package (``rnnt_lattice.bench``) so that ``rnnt-lattice bench`` and these
scripts use the very same cases; this module re-exports them for the scripts here.
Speed runs, memory runs, agreement checks and every provider (ours and the peers) get
their inputs from :func:`make_inputs`, so a row in any table is reproducible from
``(shape name, dtype, seed)`` alone.

    >>> from shapes import SHAPES, make_inputs
    >>> x = make_inputs(SHAPES["s2"], seed=0)
    >>> tuple(x.logits.shape)
    (4, 100, 21, 128)
"""
from rnnt_lattice.bench import (BLANK, GROUPS, SHAPES, VARIANTS, Case, Inputs, Shape,  # noqa: F401
                                cases, make_inputs, resolve)
