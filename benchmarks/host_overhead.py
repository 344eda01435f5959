"""The host's share of a GPU step, measured without a GPU: the Triton backend's Python path
(validation, the autograd Function, allocations, launch arguments) for one
forward+backward, on CPU tensors, with every kernel launch replaced by a no-op.

    python benchmarks/host_overhead.py [--shape s3] [--variant regular] [--calls 2000]
                                       [--entry public] [--profile N] [--binder]
    python benchmarks/host_overhead.py --vs OTHER_CHECKOUT [--pairs 10]   # A/B

On a GPU the launches are asynchronous: the host enqueues a step while the device runs the
previous one, and when the host's time per step exceeds the device's, the device waits
(at s3 on an H100 the device needs about 0.15 ms a step). This measures the host's own
work, the part this package controls: Triton's and PyTorch's launch costs (per launch, a
few microseconds of their own code) come on top on a real device and are not counted
here, so that the figure is the same on any machine with the same CPU. The value checks
take the device path (``set_input_checks("device")``, the CUDA default), whose kernel is
one more no-op launch and whose asserts are ``torch._assert_async`` on CPU tensors. The
step includes the caller's own ``costs.sum().backward()`` (autograd's engine), and glibc is
told to keep large blocks (see the code) so that the gradient's allocation costs what
PyTorch's CUDA caching allocator charges.

Prints the median microseconds per forward+backward over ``--calls`` calls (5 rounds,
the median round), and with ``--profile N`` the N functions with the most own time
(cProfile). ``--vs CHECKOUT`` compares this checkout's package with another's (its
``src/``, e.g. ``git worktree add /tmp/base <commit>``): fresh processes in turn, the
ratio taken pair by pair (``common.paired_ab``), the one way to see a change of a few
percent on a machine whose speed drifts more than that between processes. ``--entry``:
the function called, the public one (default) or a compat module's, as a framework calls
it (``nemo``: ``RNNTLossNumba``, ``TDTLossNumba`` or ``MultiblankRNNTLossNumba`` by the
variant; ``torchaudio`` and ``warp_transducer``: ``rnnt_loss``, regular only); their
``backend="auto"`` is made to resolve to Triton, as it does for CUDA tensors. ``--binder``: part of what the stubs leave out, Triton's own Python per launch
before the driver's call -- the argument binder (specialisation of every argument) and the
cache key of ``JITFunction.run`` -- timed on each kernel's last launch's arguments, the
binder built for sm_90 without a GPU (Triton's internals: this follows Triton 3.x and
says so where they differ).
"""
from __future__ import annotations

import os
import sys

# glibc returns a large block to the system when it is freed and maps a new one at the
# next allocation (page faults, system calls); PyTorch's CUDA caching allocator hands the
# same block out again. So that the gradient's allocation costs here what it costs on a
# GPU, glibc keeps large blocks: the process restarts itself once with its thresholds set.
_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296"}
if any(os.environ.get(k) != v for k, v in _MALLOC.items()):
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_MALLOC})

os.environ["TRITON_INTERPRET"] = "1"   # the backend accepts CPU tensors; nothing runs in it

import common  # noqa: E402,F401  (thread settings, before torch)

import argparse  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

import shapes  # noqa: E402
from launch_stubs import no_launches  # noqa: E402


ENTRIES = {"public": tuple(shapes.VARIANTS), "nemo": ("regular", "tdt", "multiblank"),
           "torchaudio": ("regular",), "warp_transducer": ("regular",)}


def entry_loss(entry: str, variant: str, blank: int):
    """``loss(logits, targets, logit_lengths, target_lengths)`` of ``entry`` (``ENTRIES``):
    per-sequence costs (or the peer's reduced loss) on the Triton backend."""
    if entry == "public":
        return lambda *a: shapes.variant_loss(variant, *a, blank, backend="triton")
    _auto_is_triton()
    if entry == "nemo":
        from rnnt_lattice.compat import nemo
        module = {"regular": lambda: nemo.RNNTLossNumba(blank, reduction="none"),
                  "tdt": lambda: nemo.TDTLossNumba(blank, list(shapes.TDT_DURATIONS),
                                                   reduction="none"),
                  "multiblank": lambda: nemo.MultiblankRNNTLossNumba(
                      blank, list(shapes.BIG_BLANK_DURATIONS), reduction="none")}[variant]()
        return module                   # (its ids int64, as NeMo's models pass them)
    if entry == "torchaudio":
        from rnnt_lattice.compat import torchaudio
        return lambda *a: torchaudio.rnnt_loss(*a, blank=blank, reduction="none")
    from rnnt_lattice.compat import warp_transducer
    return lambda *a: warp_transducer.rnnt_loss(*a, blank=blank, reduction="none")


def _auto_is_triton() -> None:
    """``backend="auto"`` resolved to Triton for CPU tensors, as for CUDA ones: the compat
    modules take no ``backend``, and on a GPU theirs is Triton."""
    from rnnt_lattice import _backends
    real = _backends.resolve

    def resolve(backend, device):
        return real("triton" if backend == "auto" else backend, device)
    _backends.resolve = resolve


def step_fn(shape_name: str, variant: str, entry: str = "public"):
    """One forward+backward of ``variant`` at the shape, through ``entry``'s function on
    the Triton backend, with an upstream gradient of ones (``.sum().backward()``)."""
    if variant not in ENTRIES[entry]:
        raise SystemExit(f"--entry {entry} takes --variant {' or '.join(ENTRIES[entry])}")
    inp = shapes.make_inputs(shapes.SHAPES[shape_name], variant=variant)
    leaf = inp.logits.requires_grad_()
    loss = entry_loss(entry, variant, inp.blank)
    ids = (inp.targets, inp.logit_lengths, inp.target_lengths)
    if entry == "nemo":
        ids = tuple(x.long() for x in ids)

    def step():
        costs = loss(leaf, *ids)
        costs.sum().backward()
        leaf.grad = None
    return step


def measure(step, calls: int) -> float:
    """Median over 5 rounds of the mean microseconds per call of a round."""
    for _ in range(20):
        step()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls // 5):
            step()
        rounds.append((time.perf_counter() - t0) / (calls // 5) * 1e6)
    return statistics.median(rounds)


def binder_costs(stubs, reps: int = 2000) -> dict:
    """``{kernel: microseconds}`` of Triton's binder + cache key on the kernel's last launch's
    arguments (``JITFunction.run`` does both at every launch, then the driver's launch)."""
    import timeit
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import (JITFunction, compute_cache_key,
                                        create_function_from_signature)
    except ImportError as err:
        print(f"--binder: this Triton's internals differ ({err}); nothing timed")
        return {}
    backend = make_backend(GPUTarget("cuda", 90, 32))
    out = {}
    for name, stub in stubs.items():
        if not stub.launches or stub.last is None:
            continue
        fn = JITFunction(stub.fn.fn, **stub.fn.kwargs)      # the interpreter's kernel, jitted
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        args, kwargs = stub.last
        kwargs = dict(kwargs, debug=False)
        cache = {}

        def launch_prologue():
            _, specialization, options = binder(*args, **kwargs)
            return compute_cache_key(cache, specialization, options)
        launch_prologue()
        out[name] = min(timeit.repeat(launch_prologue, number=reps, repeat=5)) / reps * 1e6
        print(f"  {name:24s} {len(args):3d} arguments + {len(kwargs) - 1:2d} constexprs/options: "
              f"binder + cache key {out[name]:5.1f} us")
    print(f"  Triton's binder + cache key, per step: {sum(out.values()):.1f} us (one launch "
          f"each; the driver's launch comes on top)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="s3")
    ap.add_argument("--variant", default="regular", choices=sorted(shapes.VARIANTS))
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--entry", default="public", choices=sorted(ENTRIES),
                    help="the public function, or a compat module's (as a framework calls it)")
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--binder", action="store_true",
                    help="also time Triton's binder and cache key per launch (sm_90, no GPU)")
    ap.add_argument("--vs", metavar="CHECKOUT",
                    help="A/B: this figure with this checkout's package against CHECKOUT's "
                         "src/, fresh processes in turn (common.paired_ab)")
    ap.add_argument("--pairs", type=int, default=10, help="pairs of runs of --vs")
    args = ap.parse_args(argv)
    if args.vs:
        from common import host_work_us, paired_ab, print_ab
        child = ["--shape", args.shape, "--variant", args.variant, "--calls", args.calls,
                 "--entry", args.entry]
        out = paired_ab(Path(__file__), child, Path(args.vs), args.pairs, host_work_us)
        print_ab(out, "us", args.vs)
        return 0
    import rnnt_lattice
    with no_launches() as stubs:
        rnnt_lattice.set_input_checks("device")
        step = step_fn(args.shape, args.variant, args.entry)
        us = measure(step, args.calls)
        launched = {name: s.launches for name, s in stubs.items() if s.launches}
        per_call = {name: n / (args.calls + 20) for name, n in launched.items()}
        entry = "" if args.entry == "public" else f" through compat.{args.entry}"
        print(f"{args.shape} {args.variant}{entry}: {us:.1f} us of host work per forward+backward "
              f"(kernel launches stubbed: {', '.join(f'{k} x{v:g}' for k, v in per_call.items())})")
        if args.binder:
            for stub in stubs.values():
                stub.record = True
            step()                                 # one more step, its arguments kept
            binder_costs(stubs)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                step()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
