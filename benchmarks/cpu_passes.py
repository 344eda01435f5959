"""Where a CPU loss spends its time: each pass of the Numba backend timed inside real
forward+backward calls of the public losses, for the topologies side by side.

    python benchmarks/cpu_passes.py [--shapes s3 s4] [--variants regular multiblank tdt]
                                    [--threads 2] [--reps 15] [--inplace] [--json FILE]
    python benchmarks/cpu_passes.py --vs OTHER_CHECKOUT [--pairs 3] [--figure row]   # A/B
    python benchmarks/cpu_passes.py --shapes p1 p2 --variants pruned      # k2's pruned loss

The passes (``cpu/kernels.py``): ``row`` (``kernels.row_pass``, or the regular fast path's
``regular.regular_row_pass``), ``lattice`` (``kernels.lattice``) and ``grad``
(``kernels.grad_rows`` / ``regular.regular_grad_rows``); ``total`` is the whole call with
its ``backward()``, the Python around the passes included (``pruned``: the pruned
loss alone, ``rnnt_loss_pruned`` on the windows and logits of k2's recipe made once
beforehand). Each pass is timed by
wrapping the module's function, so the calls take the library's own path. The cases run
in turn, call by call (the machine's drift hits them alike), and each figure is the
minimum over ``--reps`` calls (the least disturbed one) with the median beside it.

Compare the topologies within one run, and a change with ``--vs CHECKOUT`` (another
checkout's ``src/``, e.g. ``git worktree add /tmp/base <commit>``): per case, fresh
processes of the two packages in turn, the ratio of ``--figure`` taken pair by pair
(``common.paired_ab``).
"""
from __future__ import annotations

import common  # first: sets the thread env vars before torch is imported

import argparse                   # noqa: E402
import json                       # noqa: E402
import re                         # noqa: E402
import statistics                 # noqa: E402
import time                       # noqa: E402
from pathlib import Path          # noqa: E402

import torch                      # noqa: E402

import shapes                     # noqa: E402
from rnnt_lattice._cli_util import set_threads  # noqa: E402

PASSES = ("row", "lattice", "grad")
FIGURES = PASSES + ("total",)
PRUNED = "pruned"          # the pruned loss alone (``rnnt_loss_pruned``), R = PRUNED_R
PRUNED_R = 5
VARIANTS = sorted(shapes.VARIANTS) + [PRUNED]


class _Case:
    """One case's inputs and its loss call (``loss(logits)`` -> per-sequence costs)."""

    def __init__(self, shape, variant: str):
        import rnnt_lattice
        self.name = f"{shape.name} {variant}"
        if variant != PRUNED:
            x = shapes.make_inputs(shape, variant=variant)
            self.logits = x.logits.detach().clone()
            self.loss = lambda z, **kw: shapes.variant_loss(
                variant, z, x.targets, x.logit_lengths, x.target_lengths, x.blank, **kw)
            return
        # k2's recipe up to the pruned loss (pruned_pipeline's scales), its windows and
        # logits made once: am_p + lm_p (B, T, R, V) at the windows of prune_ranges.
        x = shapes.make_joiner_inputs(shape)
        from pruned_pipeline import SCALES
        with torch.no_grad():
            _, occ = rnnt_lattice.rnnt_loss_smoothed(
                x.lm, x.am, x.targets, x.logit_lengths, x.target_lengths, blank=x.blank,
                reduction="sum", return_occupations=True, **SCALES)
            ranges = rnnt_lattice.prune_ranges(occ, PRUNED_R).ranges
            am_p, lm_p = rnnt_lattice.do_rnnt_pruning(x.am, x.lm, ranges)
            self.logits = (am_p + lm_p).contiguous()
        self.loss = lambda z, **kw: rnnt_lattice.rnnt_loss_pruned(
            z, x.targets, ranges, x.logit_lengths, x.target_lengths, blank=x.blank,
            reduction="none", **kw)


def _timed_passes(spent: dict):
    """Wrap the CPU backend's pass functions so that each call adds its seconds to
    ``spent[pass]``; returns a function that puts the originals back."""
    from rnnt_lattice.cpu import kernels, regular
    wrapped = [(kernels, "row_pass", "row"), (kernels, "lattice", "lattice"),
               (kernels, "grad_rows", "grad"), (regular, "regular_row_pass", "row"),
               (regular, "regular_grad_rows", "grad")]
    originals = [(mod, name, getattr(mod, name)) for mod, name, _ in wrapped]

    def timer(fn, key):
        def call(*args):
            t0 = time.perf_counter()
            out = fn(*args)
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0
            return out
        return call

    for (mod, name, key), (_, _, fn) in zip(wrapped, originals):
        setattr(mod, name, timer(fn, key))

    def restore():
        for mod, name, fn in originals:
            setattr(mod, name, fn)
    return restore


def measure(shape_names, variants, reps: int, inplace: bool) -> list:
    """``[{"case", "min": {figure: ms}, "median": {figure: ms}}]`` for each shape x
    variant, the cases run in turn call by call (2 warm-up rounds)."""
    cases = [_Case(shape, variant) for shape in shapes.resolve(shape_names)
             for variant in variants]
    for case in cases:
        case.logits.requires_grad_()
    spent: dict = {}
    runs: dict = {case.name: [] for case in cases}
    restore = _timed_passes(spent)
    try:
        for rep in range(reps + 2):
            for case in cases:
                spent.clear()
                t0 = time.perf_counter()
                case.loss(case.logits, inplace_grad=inplace).sum().backward()
                total = time.perf_counter() - t0
                case.logits.grad = None
                if rep >= 2:
                    runs[case.name].append({**{p: spent.get(p, 0.0) for p in PASSES},
                                            "total": total})
    finally:
        restore()
    return [{"case": case.name,
             "min": {f: 1e3 * min(r[f] for r in runs[case.name]) for f in FIGURES},
             "median": {f: 1e3 * statistics.median(r[f] for r in runs[case.name])
                        for f in FIGURES}}
            for case in cases]


def case_line(row: dict) -> str:
    """One case's line: each figure as ``min/median ms``."""
    return f"{row['case']:18s} " + "  ".join(
        f"{f} {row['min'][f]:7.2f}/{row['median'][f]:7.2f}" for f in FIGURES)


def figure_of(case: str, figure: str):
    """The ``figure`` (its minimum) of ``case`` in a run's printed lines (``--vs``)."""
    def read(stdout: str) -> float:
        m = re.search(rf"^{re.escape(case)}\s.*?\b{figure} +([0-9.]+)/", stdout, re.M)
        if m is None:
            raise RuntimeError(f"no {figure} of {case!r} in:\n{stdout}")
        return float(m[1])
    return read


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["s3", "s4"])
    p.add_argument("--variants", nargs="+", default=["regular", "multiblank", "tdt"],
                   choices=VARIANTS, help=f"loss topologies (shapes.VARIANTS), or {PRUNED!r}: "
                   f"rnnt_loss_pruned alone on k2's windows (R = {PRUNED_R}) of the "
                   "shape's joiner inputs (use the pruned shapes, p1 p2 pv5000)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--inplace", action="store_true", help="inplace_grad=True")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--vs", metavar="CHECKOUT",
                   help="an A/B per case: this checkout's package against CHECKOUT's src/, "
                        "fresh processes in turn (common.paired_ab)")
    p.add_argument("--pairs", type=int, default=3, help="pairs of runs of --vs, per case")
    p.add_argument("--figure", default="total", choices=FIGURES, help="what --vs compares")
    args = p.parse_args(argv)
    if args.vs:
        from common import paired_ab, print_ab
        out = []
        for shape in shapes.resolve(args.shapes):
            for variant in args.variants:
                case = f"{shape.name} {variant}"
                child = ["--shapes", shape.name, "--variants", variant, "--threads",
                         args.threads, "--reps", args.reps] + (["--inplace"] if args.inplace
                                                               else [])
                ab = paired_ab(Path(__file__), child, Path(args.vs), args.pairs,
                               figure_of(case, args.figure))
                print(f"{case}, {args.figure} (ms, minimum of {args.reps} calls a run):")
                print_ab(ab, "ms", args.vs)
                out.append({"case": case, **ab})
        return out
    set_threads(args.threads)
    meta = common.machine_info()
    v = meta["versions"]
    print(f"# {meta['cpu_model']}, load {meta['loadavg_at_start'][0]:.1f}, commit "
          f"{meta['git_commit']}, torch {v.get('torch')}, numba {v.get('numba')}; threads "
          f"{args.threads}; {'inplace_grad' if args.inplace else 'out of place'}; ms, "
          f"min/median of {args.reps} calls")
    rows = measure(args.shapes, args.variants, args.reps, args.inplace)
    for row in rows:
        print(case_line(row))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
