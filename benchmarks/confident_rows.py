"""The float32 error of a confident model's loss and gradient, every backend, against the
float64 result on the same (rounded) logits: docs/benchmarks.md, "Confident rows".

    python benchmarks/confident_rows.py [--margins 12 15 20] [--backends numba torch triton]
                                        [--src OTHER_CHECKOUT/src]

Each row of a (2, 12, 4, 64) batch favours its class on one path (the blank, or one label
a frame along a diagonal) by ``margin`` nats over N(0, 1) logits, so ``p_max = 1 / (1 +
rest)`` with ``rest ~ V e^-margin``. Printed per margin and backend: the losses' largest
relative error and the gradient's largest error over its largest entry (the gradient of
``sum(w * loss)``, signed weights). The Triton backend runs under the interpreter on CPU
tensors (``TRITON_INTERPRET=1`` is set here). ``--src``: the package of another checkout
(e.g. ``git worktree add /tmp/base <commit>``), to see a change.
"""
from __future__ import annotations

import argparse
import os
import sys


def batch(margin: float, torch):
    """``(logits float64 (B, T, U+1, V), targets, logit_lengths, target_lengths)``."""
    g = torch.Generator().manual_seed(0)
    B, T, U, V = 2, 12, 4, 64
    tl, ul = torch.tensor([T, T - 2]), torch.tensor([U, U - 1])
    x = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64)
    y = torch.randint(1, V, (B, U), generator=g)
    x[..., 0] += margin                                   # the blank, except ...
    for b in range(B):
        for u in range(int(ul[b])):                       # ... a label at frame 2u + 1
            t = min(T - 1, 2 * u + 1)
            x[b, t, u, 0] -= margin
            x[b, t, u, y[b, u]] += margin
    return x, y, tl, ul


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--margins", type=float, nargs="+", default=[12.0, 15.0, 20.0])
    ap.add_argument("--backends", nargs="+", default=["numba", "torch", "triton"],
                    choices=["numba", "torch", "triton"])
    ap.add_argument("--src", help="another checkout's src/ to import rnnt_lattice from")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")       # (before triton is imported)
    if args.src:
        sys.path.insert(0, args.src)
    import torch
    import rnnt_lattice

    print(f"rnnt_lattice from {os.path.dirname(rnnt_lattice.__file__)}")
    print("| margin | backend | loss (B,) | loss: rel. error | grad: error / scale |")
    print("|---|---|---|---|---|")
    for margin in args.margins:
        x, y, tl, ul = batch(margin, torch)
        x32 = x.float()
        w = torch.tensor([1.0, -0.7])
        for backend in args.backends:
            def run(z):
                z = z.detach().clone().requires_grad_()
                costs = rnnt_lattice.rnnt_loss(z, y, tl, ul, 0, reduction="none",
                                               backend=backend)
                (costs * w.to(costs.dtype)).sum().backward()
                return costs.detach().double(), z.grad.double()
            want, want_grad = run(x32.double())
            got, grad = run(x32)
            loss_err = float(((got - want).abs() / want.abs()).max())
            grad_err = float((grad - want_grad).abs().max() / want_grad.abs().max())
            print(f"| {margin:g} | {backend} | {', '.join(f'{v:.3g}' for v in want.tolist())} "
                  f"| {loss_err:.2g} | {grad_err:.2g} |")


if __name__ == "__main__":
    main()
