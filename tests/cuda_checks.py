"""Checks of the Triton backend on a CUDA device, compiled (not interpreted): the self-check
that users run, ``rnnt-lattice check`` (``rnnt_lattice/selfcheck.py``), at the benchmark
shapes (``tier="full"``).

Run by ``tests/test_triton.py::test_cuda_native`` in a subprocess without
``TRITON_INTERPRET`` (that test module sets it for its own process), or by hand on a GPU
machine: ``python tests/cuda_checks.py`` (add ``--big`` for the > 2**31-element case,
about 27 GB of GPU memory, and ``--jobs N`` for N worker processes, as ``rnnt-lattice
check --jobs``). ``--smoke`` runs the quick checks, on a smaller lattice, of
the Triton kernels on the CPU through the Triton interpreter (set ``TRITON_INTERPRET=1``),
which checks the self-check's code paths of the Triton backend without a GPU.

What runs (selfcheck.py's module docstring has the list): exactness of every kernel family
against the float64 pure-PyTorch reference on the same (rounded) numbers at the benchmark
shapes, U > 1024 and V = 5000 (every rnnt_type and option, TDT, multi-blank, packed,
pruned, simple/smoothed, fused, occupancy/alignment, the window DP; gradient error
<= 1e-5 of its scale for float32 logits, a few units of the dtype's rounding for
float16/bfloat16); no host synchronisation (``torch.cuda.set_sync_debug_mode("error")``)
in every hot call, the delay penalty included; forward+backward captured in a CUDA graph
and replayed bit-identical to eager; peak memory of the gradient; and (``--big``) a
lattice whose offsets pass 2**31.
"""
from __future__ import annotations

import argparse
import sys

import torch

from rnnt_lattice import selfcheck
from rnnt_lattice._cli_util import positive_int


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", action="store_true", help="also the > 2**31-element lattice")
    ap.add_argument("--smoke", action="store_true", help="the quick checks on the CPU through "
                    "the Triton interpreter (TRITON_INTERPRET=1)")
    ap.add_argument("--jobs", type=positive_int, default=1, help="on CUDA, the checks in this many "
                    "worker processes at once (rnnt-lattice check --jobs)")
    args = ap.parse_args()
    if args.smoke:
        from support import interpreter         # (tests/support: as the suite runs it)
        interpreter.install()
        rc = selfcheck.run("cpu", tier="smoke", backend="triton")
    else:
        if not torch.cuda.is_available():
            sys.exit("cuda_checks.py needs a CUDA device (or --smoke)")
        rc = selfcheck.run("cuda", tier="full", big=args.big, jobs=args.jobs)
    if rc:
        sys.exit(rc)
    print("OK")


if __name__ == "__main__":
    main()
