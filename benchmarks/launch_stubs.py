"""The Triton backend's kernel launches replaced by no-ops, for measuring or counting what
the host does around them without a GPU (``host_overhead.py``, ``pruned_profile.py
--count-ops``). The backend accepts CPU tensors under ``TRITON_INTERPRET=1``, which must be
set before Triton is first imported; nothing runs in the kernels' place, so their outputs
hold whatever their buffers held, except where the host path goes on from them
(``WRITES``): the input check's says that every rule holds, k2's window starts are 0."""
from __future__ import annotations

import contextlib

from torch._C import _len_torch_dispatch_stack as _len_dispatch_stack
from torch.utils._python_dispatch import _disable_current_modes


def _input_check(args):
    args[4].fill_(1.0)          # every rule holds
    args[5].zero_()


def _k2_starts(args):
    args[4].zero_()             # every frame's window at the first label positions: valid


# The kernels whose outputs the host path reads back (shapes, indices): stubs write valid
# values there.
WRITES = {"_input_check_kernel": _input_check, "_k2_starts_kernel": _k2_starts}


class NoLaunch:
    """Stands for a kernel: ``kernel[grid](*args, **kwargs)`` returns at once. Keeps the
    kernel it stands for (``fn``) and, while ``record`` is set, the arguments of its last
    launch (``last``; off by default: holding them would keep the step's buffers alive)."""

    def __init__(self, name, fn=None):
        self.name, self.fn = name, fn
        self.launches = 0
        self.record, self.last = False, None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            if self.record:
                self.last = (args, kwargs)
            if self.name in WRITES:
                # What the kernel would write, outside any dispatch mode that counts the
                # step's operations (these are the kernel's, not PyTorch's); without one,
                # as it is (host_overhead.py times the package, not this stub).
                if _len_dispatch_stack():
                    with _disable_current_modes():
                        WRITES[self.name](args)
                else:
                    WRITES[self.name](args)
        return launch


@contextlib.contextmanager
def no_launches():
    """Every kernel of ``rnnt_lattice.gpu.kernels`` replaced by a :class:`NoLaunch` inside
    the block, and put back after it; yields ``{name: NoLaunch}``."""
    from rnnt_lattice.gpu import kernels
    saved = {name: fn for name, fn in vars(kernels).items()
             if name.startswith("_") and name.endswith("_kernel")}
    stubs = {name: NoLaunch(name, fn) for name, fn in saved.items()}
    for name, stub in stubs.items():
        setattr(kernels, name, stub)
    try:
        yield stubs
    finally:
        for name, fn in saved.items():
            setattr(kernels, name, fn)
