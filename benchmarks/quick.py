"""``rnnt-lattice bench`` (or ``python benchmarks/quick.py``): rnnt_lattice's forward+backward
against the machine's own exp throughput over the same logits, at the registry's shapes
(``shapes.py``). The full runner, on CPU or CUDA and side by side with other libraries, is
``run.py`` (docs/benchmarks.md).

    rnnt-lattice bench                      # quick: s1 s2, numba backend, 2 threads
    rnnt-lattice bench --shapes core        # s2 s3 s4 s5 ragged (the issue's target shapes)
    rnnt-lattice bench --backends numba torch --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

import rnnt_lattice
from rnnt_lattice._cli_util import check_output_file, set_threads
from shapes import GROUPS, SHAPES, make_inputs, resolve
from timing import fmt_s, fwd_bwd, loss_fn, measure


def _check_args(args) -> list:
    """The shapes to run; ``ValueError`` (one line from ``rnnt-lattice``) for bad options,
    before anything is timed."""
    shapes = resolve(args.shapes)
    for opt, value, low in (("--threads", args.threads, 1), ("--reps", args.reps, 1),
                            ("--warmup", args.warmup, 0)):
        if value < low:
            raise ValueError(f"{opt} must be >= {low}, got {value}")
    if not args.cap > 0:
        raise ValueError(f"--cap must be > 0 seconds, got {args.cap}")
    if args.json:
        check_output_file(args.json, "--json")
    return shapes


def main(argv=None) -> int:
    """``rnnt-lattice bench``: time our loss against the exp floor; returns an exit code."""
    ap = argparse.ArgumentParser(
        prog="rnnt-lattice bench",
        description="Time rnnt_lattice's forward+backward against torch.exp over the same "
                    "logits (the machine's floor), at the benchmark registry's shapes. The "
                    "full runner, on CPU or CUDA and side by side with other libraries, is "
                    "benchmarks/run.py in the repository (docs/benchmarks.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["quick"],
                    help=f"shape or group names; shapes {sorted(SHAPES)}, groups "
                         + ", ".join(f"{k}={'+'.join(v)}" for k, v in GROUPS.items()))
    ap.add_argument("--backends", nargs="+", default=["numba"], choices=["numba", "torch", "triton"])
    ap.add_argument("--threads", type=int, default=int(os.environ.get("RNNT_BENCH_THREADS", 2)))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--cap", type=float, default=60.0, help="seconds per shape, backend and mode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE", help="also write the rows and the machine as JSON")
    args = ap.parse_args(argv)
    shapes = _check_args(args)
    set_threads(args.threads)
    meta = {"rnnt_lattice": rnnt_lattice.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "threads": args.threads, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(f"# rnnt_lattice {meta['rnnt_lattice']}, torch {meta['torch']}, {meta['cpus']} CPUs, "
          f"{args.threads} threads", flush=True)
    rows = []
    for backend in args.backends:
        w = make_inputs(SHAPES["s1"])                      # compile / warm up, untimed
        try:
            fwd_bwd(loss_fn(backend), w, w.logits.requires_grad_())
        except (ValueError, ImportError) as err:
            print(f"{backend}: not available here ({err})", file=sys.stderr)
            continue
        for s in shapes:
            r = measure(s, backend, reps=args.reps, warmup=args.warmup, cap_s=args.cap, seed=args.seed)
            rows.append(r)
            print(f"{backend:6s} {s.name:7s} {s.describe():34s} fwd+bwd {fmt_s(r['fwd_bwd_s']):>10s}  "
                  f"fwd {fmt_s(r['fwd_s']):>10s}  exp(out=buf) {fmt_s(r['exp_out_s']):>10s}  "
                  f"exp() {fmt_s(r['exp_fresh_s']):>10s}  fwd+bwd/exp {r['x_exp']:5.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if rows else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as err:
        print(f"rnnt-lattice bench: error: {err}", file=sys.stderr)
        sys.exit(2)
