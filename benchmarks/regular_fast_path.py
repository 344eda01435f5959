"""The CPU backend's regular fast path against its generic kernels, on the standard loss.

``cpu.uses_regular_fast_path`` sends the plain regular loss on padded logits to the
``regular_`` row and gradient passes; every other loss runs the generic passes over the
kind table, which give the same numbers. This measures what the predicate buys: forward
and backward of ``rnnt_loss`` both ways, interleaved call by call, minimum over the
repetitions (the machine is shared; the minimum is the least disturbed call).

    python benchmarks/regular_fast_path.py                  # s3 s4, 1 thread
    python benchmarks/regular_fast_path.py --shapes s4 --threads 2 --reps 20
"""
from __future__ import annotations

import argparse
import time

import torch

import rnnt_lattice
from rnnt_lattice import cpu
from rnnt_lattice._cli_util import set_threads
from common import machine_info, md_table
from shapes import make_inputs, resolve


def _generic(*_args) -> bool:
    return False


def measure(shape, reps: int) -> dict:
    """``{"fast": (fwd_s, bwd_s), "generic": (fwd_s, bwd_s)}``, minima over ``reps``."""
    x = make_inputs(shape)
    logits = x.logits.requires_grad_()
    chosen = cpu.uses_regular_fast_path
    times = {"fast": ([], []), "generic": ([], [])}
    try:
        for rep in range(reps + 2):                       # 2 warm-up rounds
            for path in times:
                cpu.uses_regular_fast_path = chosen if path == "fast" else _generic
                logits.grad = None
                t0 = time.perf_counter()
                loss = rnnt_lattice.rnnt_loss(logits, x.targets, x.logit_lengths,
                                              x.target_lengths, blank=x.blank, backend="numba")
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                if rep >= 2:
                    times[path][0].append(t1 - t0)
                    times[path][1].append(t2 - t1)
    finally:
        cpu.uses_regular_fast_path = chosen
    return {path: (min(f), min(b)) for path, (f, b) in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["s3", "s4"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    set_threads(args.threads)
    rows = []
    for shape in resolve(args.shapes):
        r = measure(shape, args.reps)
        (ff, fb), (gf, gb) = r["fast"], r["generic"]
        rows.append([shape.name, shape.describe(), f"{ff * 1e3:.2f}", f"{gf * 1e3:.2f}",
                     f"{fb * 1e3:.2f}", f"{gb * 1e3:.2f}",
                     f"{(gf + gb) / (ff + fb):.2f}x"])
        print(f"{shape.name}: fast path {1e3 * (ff + fb):.2f} ms, generic "
              f"{1e3 * (gf + gb):.2f} ms (forward + backward)", flush=True)
    info = machine_info()
    print(f"\n{info['cpu_model']}, {args.threads} thread(s), torch {torch.__version__}, "
          f"commit {info['git_commit']}\n")
    print(md_table(["shape", "", "fwd fast (ms)", "fwd generic (ms)", "bwd fast (ms)",
                    "bwd generic (ms)", "generic / fast"], rows))


if __name__ == "__main__":
    main()
