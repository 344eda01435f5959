"""How many Triton kernel variants (compilations) a training epoch of varying shapes would
compile, counted without a GPU.

    python benchmarks/compile_variants.py [--batches 200] [--seed 0] [--sm 90] [--B 16]

Triton compiles one variant per distinct *key* of a launch: the constexpr values, and
for every plain argument its type plus a specialisation -- an integer equal to 1 or
divisible by 16, a pointer whose address is divisible by 16 -- unless the kernel lists
that argument in ``do_not_specialize``. This script computes that key exactly as
``JITFunction.run`` does (``triton.runtime.jit.create_function_from_signature``, the
binder behind every launch, and ``compute_cache_key``), for a CUDA target built by hand
(``GPUTarget("cuda", sm, 32)``: no driver, no device), and counts the distinct keys per
kernel. Nothing is compiled or launched: ``JITFunction.run`` is replaced by the key
computation, and the backend runs on ``meta`` tensors (shapes and addresses, no data),
whose views have the offsets a CUDA workspace's views have (the caching allocator's
blocks are 512-byte aligned, a meta tensor's base is 0).

The epoch: ``--batches`` batches of ``B`` sequences (``--vary-B``: 4..32) with T uniform
in 50..600 frames and U uniform in 5..200 labels (their padded maxima), V drawn from
``--V`` (default {500, 1000, 1025}; one vocabulary per run is the usual case), float32
logits, forward and backward of ``rnnt_loss`` (row, lattice and gradient kernels), then a
pruned loss (R = 5) on the same shapes (the ``row_nodes`` layout).

Run it on the package to measure (``PYTHONPATH=src``); ``docs/benchmarks.md`` ("Triton
compile variants") has the figures before and after ``do_not_specialize`` and the
bucketed ``BLOCK_U``.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from collections import defaultdict

os.environ.pop("TRITON_INTERPRET", None)      # compiled kernels (JITFunction), not interpreted

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime import jit as tjit  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sm", type=int, default=90)
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--vary-B", action="store_true",
                    help="B uniform in 4..32 per batch (duration-bucketed batches)")
    ap.add_argument("--V", type=int, nargs="*", default=[500, 1000, 1025])
    args = ap.parse_args(argv)

    import rnnt_lattice
    from rnnt_lattice import gpu
    from rnnt_lattice._types import LossOptions

    backend = make_backend(GPUTarget("cuda", args.sm, 32))
    keys: dict[str, set] = defaultdict(set)
    binders = {}

    def run(self, *a, grid, warmup, **kw):
        """``JITFunction.run`` up to the cache key: the variant this launch would compile."""
        kw["debug"] = kw.get("debug", self.debug)
        if self not in binders:
            binders[self] = tjit.create_function_from_signature(self.signature, self.params,
                                                                backend)
        _, specialization, options = binders[self](*a, **kw)
        keys[self.fn.__name__].add(tjit.compute_cache_key({}, specialization, options))

    tjit.JITFunction.run = run
    gpu.check_device = lambda x: None                 # meta tensors stand for CUDA ones

    rng = random.Random(args.seed)
    dev = torch.device("meta")
    for i in range(args.batches):
        T, U, V = rng.randint(50, 600), rng.randint(5, 200), rng.choice(args.V)
        B = rng.randint(4, 32) if args.vary_B else args.B
        logits = torch.empty((B, T, U + 1, V), device=dev)
        targets = torch.empty((B, U), dtype=torch.int32, device=dev)
        tl = torch.empty((B,), dtype=torch.int32, device=dev)
        ul = torch.empty((B,), dtype=torch.int32, device=dev)
        opts = LossOptions(0)
        costs, saved, state = gpu.loss_forward(logits, targets, tl, ul, opts, True)
        gpu.loss_backward(saved, state, torch.empty((B,), device=dev).expand(B), opts)
        # the pruned loss's layout: windows (B, T, R, V) as rows through a node -> row map
        R = min(5, U + 1)
        rows = torch.empty((B * T * R, V), device=dev)
        node_rows = torch.empty((B, T, U + 1), dtype=torch.int64, device=dev)
        costs, saved, state = gpu.loss_forward(rows, targets, tl, ul, opts, True,
                                               node_rows=node_rows)
        gpu.loss_backward(saved, state, torch.empty((B,), device=dev).expand(B), opts)
    total = sum(len(k) for k in keys.values())
    print(f"rnnt_lattice {rnnt_lattice.__file__}")
    B_text = "4..32" if args.vary_B else args.B
    print(f"{args.batches} batches, B = {B_text}, T 50..600, U 5..200, V in {args.V}, "
          f"sm_{args.sm}")
    print("| kernel | variants |")
    print("|---|---|")
    for name in sorted(keys):
        print(f"| {name} | {len(keys[name])} |")
    print(f"| all | {total} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
