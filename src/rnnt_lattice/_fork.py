"""Whether this process is a child forked after ``import rnnt_lattice``: the CPU backend runs
its kernels in the calling thread there, without a launch on Numba's threads
(``cpu/_config.py``). GNU OpenMP, Numba's ``omp`` threading layer on
Linux and PyTorch's own, cannot run a parallel region in a child forked from a process that
has used it: the child's first parallel kernel waits for good (a DataLoader worker forked
after the model's first step, where the CPU backend had not been loaded). The hook is
registered here, at the package's import, which loads no Numba: the CPU backend may be
loaded first in the child."""
import os

FORKED = False


def _after_fork_in_child() -> None:
    global FORKED
    FORKED = True


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)
