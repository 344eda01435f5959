"""Where the pruned pipeline's step spends its time: each stage of ``run.py --mode pruned``'s
step (ours, public API) timed alone, then the kernels of whole steps under the profiler.

    python benchmarks/pruned_profile.py [--device cuda] [--shape pg1] [--window 5]
                                        [--method k2] [--reps 5] [--top 25] [--json FILE]
                                        [--deterministic]
    python benchmarks/pruned_profile.py --count-ops [--shape pg1]      # no GPU needed
    python benchmarks/pruned_profile.py --host --shape s1 [--profile 30]  # no GPU needed
    python benchmarks/pruned_profile.py --host --shape s1 --vs OTHER_CHECKOUT [--pairs 10]

The stages, in the order the step runs them (``pruned_pipeline._ours``):

    simple   rnnt_loss_smoothed(lm, am, ..., return_occupations=True)   forward
    ranges   prune_ranges(occ, R, method)
    gather   do_rnnt_pruning(am, lm, ranges)                            (B, T, R, V) twice
    join     am_p + lm_p                                                 the window logits
    pruned   rnnt_loss_pruned(...)                                       forward
    backward (simple + pruned).backward()                                every gradient

Each stage's time is the median over ``--reps`` steps of the device clock (CUDA events on
CUDA) between its start and its end; the stages add up to the step, since nothing else
runs in it. The profile's table lists the kernels (CUDA) or operators (CPU) with the most
device time over ``--reps`` steps. The step's total is what ``run.py --mode pruned`` times.

``--count-ops`` runs the GPU's code path on the CPU instead (the Triton backend under
``TRITON_INTERPRET=1``, its launches replaced by no-ops as in ``host_overhead.py``, the
value checks on the device path, as on CUDA) and counts, per stage, the PyTorch operations
that would each be a kernel launch on a GPU (views and allocations left out) and the Triton
launches, with the functions that issue the most: the step's structure, which sets a floor
on its time wherever the tensors are small (a launch costs the host microseconds and the
device at least one kernel's latency).

``--deterministic`` times the step under ``torch.use_deterministic_algorithms(True)``,
where the simple losses' backward adds in a fixed order rather than with atomics
(docs/api.md, "Reproducibility"): its ``backward`` stage against a run without it is what
the order costs.

``--host`` times that same path at a small shape: the host's own work per step, which is
what a GPU waits on when the step is host-bound (the pruned step at pg1 on an H200: 7.8 ms
a step, 3.4 ms of it device work); with ``--vs CHECKOUT``, against another checkout's
package, fresh processes in turn and the ratio pair by pair (``common.paired_ab``).
"""
from __future__ import annotations

import common  # first: sets the thread env vars before torch is imported

import argparse                   # noqa: E402
import contextlib                 # noqa: E402
import os                         # noqa: E402
import json                       # noqa: E402
import statistics                 # noqa: E402

import torch                      # noqa: E402

import shapes                     # noqa: E402
from pruned_pipeline import SCALES  # noqa: E402

STAGES = ("simple", "ranges", "gather", "join", "pruned", "backward")


class Clock:
    """Marks between the stages: CUDA events on CUDA (no synchronisation inside a step),
    the host's clock after a synchronisation elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            import time
            self.marks.append(time.perf_counter())

    def spans_ms(self) -> list:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def step(x, am, lm, R: int, method: str, clock=None, backend: str = "auto"):
    """One step of the pipeline, with a mark (``clock.mark()``) between its stages."""
    import rnnt_lattice
    mark = clock.mark if clock else (lambda: None)
    am.grad = lm.grad = None
    mark()
    simple, occ = rnnt_lattice.rnnt_loss_smoothed(
        lm, am, x.targets, x.logit_lengths, x.target_lengths, blank=x.blank, reduction="sum",
        return_occupations=True, backend=backend, **SCALES)
    mark()
    win = rnnt_lattice.prune_ranges(occ, R, method=method)
    mark()
    am_p, lm_p = rnnt_lattice.do_rnnt_pruning(am, lm, win.ranges)
    mark()
    logits = am_p + lm_p
    mark()
    pruned = rnnt_lattice.rnnt_loss_pruned(logits, x.targets, win.ranges, x.logit_lengths,
                                           x.target_lengths, blank=x.blank, reduction="sum",
                                           backend=backend)
    mark()
    (simple + pruned).backward()
    mark()


# Operations that launch no kernel: views, allocations, host reads of metadata.
NO_KERNEL = {"view", "as_strided", "unsqueeze", "squeeze", "expand", "select", "slice", "t",
             "transpose", "permute", "reshape", "_unsafe_view", "empty", "empty_like",
             "empty_strided", "new_empty", "alias", "detach", "lift_fresh", "_reshape_alias",
             "unbind", "split", "narrow", "split_with_sizes", "diagonal", "movedim", "flatten",
             "unflatten"}


@contextlib.contextmanager
def gpu_path():
    """The GPU's code path on CPU tensors: the Triton backend (``TRITON_INTERPRET=1`` set
    before Triton's import) with its launches replaced by no-ops (``launch_stubs``), the
    value checks on the device path, and "auto" resolved to the Triton backend for the
    functions that take no backend argument (prune_ranges' window choice, the lm rows'
    backward), as on a GPU. Yields the stubs."""
    import rnnt_lattice
    from rnnt_lattice import _backends
    from launch_stubs import no_launches

    before = rnnt_lattice.set_input_checks("device")
    resolve = _backends.resolve
    _backends.resolve = lambda backend, device: (_backends.load("triton") if backend == "auto"
                                                 else resolve(backend, device))
    try:
        with no_launches() as stubs:
            yield stubs
    finally:
        rnnt_lattice.set_input_checks(before)
        _backends.resolve = resolve


def host_us(shape: str, window: int, method: str, calls: int, profile: int = 0) -> float:
    """Host microseconds of one step on the GPU's code path (``gpu_path``: kernels stubbed)
    at a shape small enough that the CPU's own operations cost little (``--host``): the
    median of 5 rounds of ``calls`` steps; with ``profile``, the functions with the most own
    time (cProfile) over one more round. Triton's and PyTorch's launch costs on a GPU come
    on top (``gpu_passes.py``'s ``launch_us``)."""
    # The stubs leave their outputs as allocated: garbage, subnormal numbers among it, on
    # which the CPU's float64 products (the normaliser's bmm) run a hundred times slower.
    torch.set_flush_denormal(True)
    try:
        return _host_rounds(shape, window, method, calls, profile)
    finally:
        torch.set_flush_denormal(False)          # the default, for whatever runs next


def _host_rounds(shape: str, window: int, method: str, calls: int, profile: int) -> float:
    import time
    with gpu_path():
        x = shapes.make_joiner_inputs(shapes.SHAPES[shape])
        am = x.am.detach().clone().requires_grad_()
        lm = x.lm.detach().clone().requires_grad_()
        for _ in range(10):
            step(x, am, lm, window, method, backend="triton")
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                step(x, am, lm, window, method, backend="triton")
            rounds.append((time.perf_counter() - t0) / calls * 1e6)
        if profile:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                step(x, am, lm, window, method, backend="triton")
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(profile)
    return statistics.median(rounds)


def count_ops(shape: str, window: int, method: str) -> dict:
    """``{"stages": {stage: torch ops}, "triton": {kernel: launches}, "sources": {stage:
    [(ops, "file:function"), ...]}}`` of one step on the GPU's code path (``--count-ops``)."""
    import collections
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        stage = None

        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.stage and func.overloadpacket.__name__ not in NO_KERNEL:
                frames = [f for f in traceback.extract_stack(limit=40)
                          if "rnnt_lattice" in f.filename]
                where = (frames[-1].filename.split("rnnt_lattice/")[-1] + ":" + frames[-1].name
                         if frames else "autograd")
                self.ops[self.stage, where] += 1
            return func(*args, **(kwargs or {}))

    class Marks:                 # the step's marks name the stage the ops count under
        def __init__(self, mode):
            self.mode, self.i = mode, 0

        def mark(self):
            self.mode.stage = STAGES[self.i] if self.i < len(STAGES) else None
            self.i += 1

    with gpu_path() as stubs:
        x = shapes.make_joiner_inputs(shapes.SHAPES[shape])
        am = x.am.detach().clone().requires_grad_()
        lm = x.lm.detach().clone().requires_grad_()
        step(x, am, lm, window, method, backend="triton")      # first-call work
        for stub in stubs.values():
            stub.launches = 0
        mode = Count()
        with mode:
            step(x, am, lm, window, method, Marks(mode), backend="triton")
    stages = {name: sum(c for (s, _), c in mode.ops.items() if s == name) for name in STAGES}
    sources = {name: sorted(((c, w) for (s, w), c in mode.ops.items() if s == name),
                            reverse=True) for name in STAGES}
    return {"stages": stages, "sources": sources,
            "triton": {k: v.launches for k, v in stubs.items() if v.launches}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default="pg1", choices=sorted(shapes.SHAPES))
    p.add_argument("--window", type=int, default=5, help="R, the window of label positions")
    p.add_argument("--method", default="k2", help="prune_ranges' method (k2, exact)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=25, help="rows of the profile's table")
    p.add_argument("--json", help="write the stage times here")
    p.add_argument("--count-ops", action="store_true",
                   help="count the GPU path's operations per stage, on the CPU (no timing)")
    p.add_argument("--host", action="store_true",
                   help="the host's microseconds per step on the GPU's code path, on the CPU "
                        "with the kernels stubbed (use a small --shape, e.g. s1)")
    p.add_argument("--calls", type=int, default=50, help="steps per round of --host")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="with --host: the N functions with the most own time")
    p.add_argument("--vs", metavar="CHECKOUT",
                   help="with --host, an A/B: this checkout's package against CHECKOUT's src/, "
                        "fresh processes in turn (common.paired_ab)")
    p.add_argument("--pairs", type=int, default=10, help="pairs of runs of --vs")
    p.add_argument("--deterministic", action="store_true",
                   help="time the step under torch.use_deterministic_algorithms(True) (the "
                        "simple losses' sums in a fixed order; on CUDA set "
                        "CUBLAS_WORKSPACE_CONFIG=:4096:8 before the process starts)")
    args = p.parse_args(argv)
    if not args.deterministic:
        return run(args)
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    try:
        return run(args)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def run(args) -> dict:
    """What ``main``'s arguments ask for (its docstring)."""
    if args.host and args.vs:
        from pathlib import Path
        from common import host_step_us, paired_ab, print_ab
        child = ["--host", "--shape", args.shape, "--window", args.window, "--method",
                 args.method, "--calls", args.calls]
        out = paired_ab(Path(__file__), child, Path(args.vs), args.pairs, host_step_us)
        print_ab(out, "us", args.vs)
        return {"ab": out}
    if args.host:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before Triton is first imported
        us = host_us(args.shape, args.window, args.method, args.calls, args.profile)
        print(f"{args.shape} R={args.window} method={args.method}, the GPU's code path with "
              f"the kernels stubbed: {us:.0f} us of host time a step (median of 5 rounds "
              f"of {args.calls})")
        return {"host_us": us}
    if args.count_ops:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before Triton is first imported
        out = count_ops(args.shape, args.window, args.method)
        total = sum(out["stages"].values())
        print(f"{args.shape} R={args.window} method={args.method}, the GPU's code path: "
              f"{total} PyTorch operations and {sum(out['triton'].values())} Triton launches "
              f"per step ({out['triton']})")
        for name in STAGES:
            top = ", ".join(f"{w} {c}" for c, w in out["sources"][name][:5])
            print(f"  {name:9s} {out['stages'][name]:5d}  {top}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return out
    device = torch.device(args.device)
    x = shapes.make_joiner_inputs(shapes.SHAPES[args.shape], device=device)
    am = x.am.detach().clone().requires_grad_()
    lm = x.lm.detach().clone().requires_grad_()
    for _ in range(2):                                     # compile, warm the allocator
        step(x, am, lm, args.window, args.method)
    spans = []
    for _ in range(args.reps):
        clock = Clock(device)
        step(x, am, lm, args.window, args.method, clock)
        spans.append(clock.spans_ms())
    med = {name: statistics.median(s[i] for s in spans) for i, name in enumerate(STAGES)}
    total = statistics.median(sum(s) for s in spans)
    B, T, U, V = (x.am.shape[0], x.am.shape[1], x.lm.shape[1] - 1, x.am.shape[-1])
    print(f"{args.shape} (B={B} T={T} U={U} V={V}) R={args.window} method={args.method} on "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}: step "
          f"{total:.3f} ms (median of {args.reps})"
          f"{', deterministic mode' if args.deterministic else ''}")
    for name in STAGES:
        print(f"  {name:9s} {med[name]:8.3f} ms  {100 * med[name] / total:5.1f}%")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.reps):
            step(x, am, lm, args.window, args.method)
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.top))
    out = {"shape": args.shape, "R": args.window, "method": args.method,
           "device": str(device), "step_ms": total, "stages_ms": med}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
