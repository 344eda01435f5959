"""Drop-in modules for the peers' users: the same names and argument conventions, computed
by rnnt_lattice's kernels. ``rnnt_lattice.compat.k2``: k2 / fast_rnnt."""
