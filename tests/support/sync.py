"""The structural check of host synchronisation on CPU tensors (what
``torch.cuda.set_sync_debug_mode("error")`` checks on a GPU): every aten op of a call is
recorded, and none may read a tensor value on the host or build a tensor from Python values."""
from __future__ import annotations

import torch
import torch.utils._python_dispatch

# Operations that synchronise a CUDA device with the host (a tensor value read on the host,
# a tensor built from Python values and copied over, data-dependent output sizes).
SYNCING_OPS = ("_local_scalar_dense", "lift_fresh", "nonzero", "masked_select", "_unique",
               "is_nonzero", "equal", "item")


class RecordOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the aten ops dispatched inside the block (``ops``)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def syncing(ops):
    """The recorded ops that would synchronise a CUDA device with the host."""
    return sorted({op for op in ops if any(f"aten.{name}" in op for name in SYNCING_OPS)})
