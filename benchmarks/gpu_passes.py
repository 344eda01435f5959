"""Where the GPU time of one forward+backward goes: each pass of the Triton backend timed
alone, the host's enqueue time, and the V passes under other tile configurations.

    python benchmarks/gpu_passes.py [--shapes s3 s5 big v5000] [--variants regular tdt multiblank]
                                    [--sweep s5 big] [--json FILE]

Per shape and loss variant (the registry's inputs, ``shapes.make_inputs``, float32, on
CUDA), with CUDA-event medians (``triton.testing.do_bench``, which clears the L2 cache
between calls):

- ``step``: forward+backward through the public function (what a user runs), and
  torchaudio's ``rnnt_loss`` on the same logits where it imports (regular only);
- ``floor``: ``3 x nbytes(logits)`` over the copy bandwidth measured on a 1 GiB buffer (the
  logits read twice, the gradient written once);
- ``row``, ``lattice``, ``reads``, ``grad``: each pass alone (``gpu._row_pass``,
  ``gpu._lattice``, ``gpu._reads``, ``gpu._gradient`` on the state of one forward), with the
  row and gradient passes' bandwidth: bytes of logits read (row), read and written (grad)
  over their time;
- ``host``: the host's time to enqueue one forward+backward (``time.perf_counter`` over
  many calls queued back to back, no synchronisation between them), and once per run the
  host's time per launch of a Triton kernel and of a PyTorch op (``launch_costs``);
- with ``--peers NAME ...``: each peer of ``peers.py`` that implements the variant
  (torchaudio, NeMo's numba ``nemo_numba``/``nemo_tdt``/``nemo_multiblank``), forward+backward
  on the same logits, and its peak memory above the inputs beside ours.

``--sweep SHAPE ...`` also times the row and gradient passes at those shapes under each
``(ROWS, BLOCK_V, num_warps, span[, prefetch[, lanes[, grad_span]]])`` of :data:`SWEEP` or
``--sweep-configs`` (the module's tile constants replaced for the call, ``span`` the row and
gradient passes' ``gpu.SPAN_ROWS`` and ``gpu.SPAN_GRAD``, ``prefetch`` and ``lanes`` the row
pass's ``gpu.ROW_PREFETCH`` and ``gpu.ROW_LANES``, ``grad_span`` the gradient pass's
``gpu.SPAN_GRAD`` alone), for tuning them; ``--lattice-sweep SHAPE ...`` the lattice pass under each
``(BLOCK_U_SMALL, BLOCK_U, LATTICE_LANES)`` of :data:`LATTICE_SWEEP` (the lanes of its
wavefront and their threads). ``--host-profile SHAPE`` prints where the host's time of
forward+backward goes at that shape with real launches (cProfile over 300 calls, the
functions with the most own time), beside ``host_overhead.py``'s stubbed launches. Without
a CUDA device it exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import shapes
from timing import copy_bandwidth

# Rows that start anywhere (TDT, odd V; shapes s5 with --variants tdt, and s5odd): read from
# their aligned span with vector loads (span True: the default since 2026-11-26, on the
# aligned rows' 16 rows of 128, not yet timed) against a load per element (span False: one
# row of 256 was the best of those, TDT at s5 1.35 ms).
SWEEP = [(16, 128, 4, True), (8, 128, 4, True), (4, 256, 4, True), (8, 256, 4, True),
         (16, 128, 8, True), (1, 256, 4, False), (4, 128, 4, False)]
# (BLOCK_U_SMALL, BLOCK_U, LATTICE_LANES): at U + 1 = 65..128, 128 lanes with 4 or 2 warps,
# 256 lanes with 8 or 4 warps.
LATTICE_SWEEP = [(64, 256, 1), (64, 256, 2), (32, 256, 1), (32, 256, 2)]


def _config(text: str) -> tuple:
    """``"4x128x4"`` -> ``(4, 128, 4, True, None, None, None)``; trailing letters: ``n`` span
    off (``"1x256x4n"``), ``p`` / ``q`` the row pass's prefetch on / off
    (``gpu.ROW_PREFETCH``), ``l`` / ``c`` its reductions once a row / every chunk
    (``gpu.ROW_LANES``), ``g`` / ``e`` the gradient pass over rows that start anywhere by
    their whole 16-byte groups / an entry a load (``gpu.SPAN_GRAD``, whatever ``n`` says);
    neither of a pair: the module's (for ``g`` / ``e``: as the span)."""
    flags = text.lstrip("0123456789x")
    rows, block_v, warps = (int(x) for x in text[:len(text) - len(flags)].split("x"))
    prefetch = True if "p" in flags else False if "q" in flags else None
    lanes = True if "l" in flags else False if "c" in flags else None
    grad_span = True if "g" in flags else False if "e" in flags else None
    return rows, block_v, warps, "n" not in flags, prefetch, lanes, grad_span


def _overrides(items) -> dict:
    """``--set``'s ``["NAME=VALUE", ...]`` -> ``{NAME: value}``: upper-case constants of
    ``rnnt_lattice.gpu`` that exist, each value a Python literal (a ValueError otherwise)."""
    import ast
    from rnnt_lattice import gpu
    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.isupper() or not hasattr(gpu, name):
            raise ValueError(f"--set: {item!r} is not NAME=VALUE with NAME a constant of "
                             f"rnnt_lattice.gpu")
        out[name] = ast.literal_eval(text)
    return out


def _rounded(d: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


def _sweep(label: str, configs, measure) -> list:
    """``[{"config": c, **measure(c)}]`` over ``configs``, each printed as it comes; a
    config that fails (one may not fit) gets ``"error"`` instead of its timings."""
    out = []
    for config in configs:
        try:
            got = measure(config)
        except Exception as err:                        # noqa: BLE001 (a config may not fit)
            got = {"error": f"{type(err).__name__}: {str(err)[:80]}"}
        out.append({"config": config, **got})
        print(f"  {label}", config, _rounded(got), flush=True)
    return out


def _state(inp, opts):
    """The lattice state of one forward (the passes' inputs) and the tensors it read."""
    from rnnt_lattice import gpu
    logits, y, tl, ul = gpu._prepare(inp.logits, inp.targets, inp.logit_lengths,
                                     inp.target_lengths)
    rows = gpu._rows_of(logits, None)
    st, costs = gpu._forward(logits, y, tl, ul, opts, boundary=None,
                             grid=tuple(logits.shape[:3]), rows=rows, beta=True, reads=True)
    return logits, y, tl, ul, rows, st, costs


def passes(inp, opts, config=None) -> dict:
    """Median ms of each pass alone (``config``: ``(ROWS, BLOCK_V, num_warps, span[,
    prefetch[, lanes[, grad_span]]])`` of the V passes -- ``span`` both passes'
    ``gpu.SPAN_ROWS`` and ``gpu.SPAN_GRAD``, ``prefetch`` and ``lanes`` the row pass's
    ``gpu.ROW_PREFETCH`` and ``gpu.ROW_LANES`` (None: the module's), ``grad_span``
    ``gpu.SPAN_GRAD`` alone (None: as ``span``) -- or None for the backend's own)."""
    from triton.testing import do_bench
    from rnnt_lattice import gpu
    saved = (gpu.V_PASS_TILES, gpu.NARROW_TILES, gpu.NUM_WARPS_V, gpu.SPAN_ROWS, gpu.SPAN_GRAD,
             gpu.ROW_PREFETCH, gpu.ROW_LANES)
    if config is not None:                # the module's constants: part of the plans' keys
        rows, block_v, warps, span, prefetch, lanes, grad_span = (*config, None, None,
                                                                   None)[:7]
        tiles = {"row": (rows * block_v, block_v), "grad": (rows * block_v, block_v)}
        gpu.V_PASS_TILES = gpu.NARROW_TILES = tiles
        gpu.NUM_WARPS_V, gpu.SPAN_ROWS = warps, span
        gpu.SPAN_GRAD = span if grad_span is None else grad_span
        if prefetch is not None:
            gpu.ROW_PREFETCH = prefetch
        if lanes is not None:
            gpu.ROW_LANES = lanes
    try:
        logits, y, tl, ul, rows, st, costs = _state(inp, opts)
        up = torch.ones_like(costs)
        dst = torch.empty_like(logits)
        out = {
            "row": do_bench(lambda: gpu._row_pass(logits, y, tl, ul, st, opts, boundary=None,
                                                  rows=rows), return_mode="median"),
            "lattice": do_bench(lambda: gpu._lattice(st, costs, tl, ul, opts, boundary=None,
                                                     beta=True), return_mode="median"),
            "reads": do_bench(lambda: gpu._reads(st, tl, ul, opts, boundary=None),
                              return_mode="median"),
            "grad": do_bench(lambda: gpu._gradient(dst, logits, y, tl, ul, st, opts, up,
                                                   boundary=None, rows=rows),
                             return_mode="median"),
        }
    finally:
        (gpu.V_PASS_TILES, gpu.NARROW_TILES, gpu.NUM_WARPS_V, gpu.SPAN_ROWS, gpu.SPAN_GRAD,
         gpu.ROW_PREFETCH, gpu.ROW_LANES) = saved
    nbytes = logits.numel() * logits.element_size()
    out["row_GBps"] = nbytes / (out["row"] * 1e-3) / 1e9
    out["grad_GBps"] = 2 * nbytes / (out["grad"] * 1e-3) / 1e9
    return out


def lattice_ms(inp, opts, config) -> float:
    """Median ms of the lattice pass alone under ``config`` (:data:`LATTICE_SWEEP`)."""
    from triton.testing import do_bench
    from rnnt_lattice import gpu
    saved = gpu.BLOCK_U_SMALL, gpu.BLOCK_U, gpu.LATTICE_LANES
    gpu.BLOCK_U_SMALL, gpu.BLOCK_U, gpu.LATTICE_LANES = config
    try:
        logits, y, tl, ul, rows, st, costs = _state(inp, opts)
        return do_bench(lambda: gpu._lattice(st, costs, tl, ul, opts, boundary=None, beta=True),
                        return_mode="median")
    finally:
        gpu.BLOCK_U_SMALL, gpu.BLOCK_U, gpu.LATTICE_LANES = saved


def host_profile(name: str, n: int = 300, top: int = 30) -> None:
    """cProfile of ``n`` forward+backward calls of the regular loss at shape ``name`` on
    CUDA (launches queued, one synchronisation at the end): the ``top`` functions by own
    time, and the host's microseconds per call."""
    import cProfile
    import pstats
    inp = shapes.make_inputs(shapes.SHAPES[name])
    leaf = inp.logits.cuda().requires_grad_()
    y, tl, ul = (t.cuda() for t in (inp.targets, inp.logit_lengths, inp.target_lengths))

    def ours():
        costs = shapes.variant_loss("regular", leaf, y, tl, ul, inp.blank)
        costs.sum().backward()
        leaf.grad = None
    for _ in range(20):
        ours()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(n):
        ours()
    prof.disable()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    print(f"host profile {name}: {host:.0f} us a call under cProfile ({n} calls)", flush=True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def step_ms(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def peak_mib(fn) -> float:
    """MiB of device memory one call of ``fn`` allocates at its peak, above what was
    allocated before it."""
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def host_ms(fn, step: float) -> float:
    """Host milliseconds to enqueue ``fn`` (median of 5 runs of ``n`` calls, synchronised
    only between runs; ``n`` fills about 200 ms of device time at ``step`` ms a call)."""
    return _enqueue_ms(fn, max(5, min(200, int(200 / max(step, 1e-3)))), warmup=3)


def _enqueue_ms(fn, n: int, warmup: int) -> float:
    """Host milliseconds per call of ``fn``: the median of 5 runs of ``n`` calls queued back
    to back, synchronised only between runs, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e3)
        torch.cuda.synchronize()
    return statistics.median(runs)


def launch_costs() -> dict:
    """Host microseconds per launch (median of 5 runs of 500, queued back to back): a
    Triton kernel through ``JITFunction.run`` (the backend's input check: 11 arguments and
    6 constexprs), the backend's gradient pass (about 40 arguments and 20 constexprs), and
    a PyTorch op, and a PyTorch op's forward+backward (the autograd engine's floor), for the
    host's share of a step beside ``host_overhead.py``'s (launches stubbed)."""
    from rnnt_lattice import gpu
    y = torch.ones(8, 40, dtype=torch.int32, device="cuda")
    lengths = torch.full((8,), 40, dtype=torch.int32, device="cuda")
    x = torch.zeros(8, device="cuda")
    leaf = torch.zeros(8, device="cuda", requires_grad=True)
    inp = shapes.make_inputs(shapes.SHAPES["s1"])
    from rnnt_lattice._types import LossOptions
    from rnnt_lattice.topology import by_name
    opts = LossOptions(inp.blank, True, topology=by_name("regular"))
    logits, yy, tl, ul = (t.cuda() for t in (inp.logits, inp.targets, inp.logit_lengths,
                                              inp.target_lengths))
    rows = gpu._rows_of(logits, None)
    st, costs = gpu._forward(logits, yy, tl, ul, opts, boundary=None,
                             grid=tuple(logits.shape[:3]), rows=rows, beta=True, reads=True)
    up = torch.ones_like(costs)
    dst = torch.empty_like(logits)
    calls = {
        "triton input check": lambda: gpu.input_check(y, lengths, lengths, None, T=50, U=40,
                                                      V=100, blank=0),
        "triton gradient pass": lambda: gpu._gradient(dst, logits, yy, tl, ul, st, opts, up,
                                                      boundary=None, rows=rows),
        "torch add_": lambda: x.add_(1.0),
        # One autograd backward of one op: the engine's hand-off to the device's thread and
        # back, which every forward+backward pays once (the host's floor for a step).
        "torch sum+backward": lambda: leaf.sum().backward(),
    }
    return {name: _enqueue_ms(fn, 500, warmup=50) * 1e3 for name, fn in calls.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["s3", "s5", "big", "v5000"])
    ap.add_argument("--variants", nargs="+", default=["regular"])
    ap.add_argument("--sweep", nargs="*", default=[])
    ap.add_argument("--sweep-configs", nargs="*", default=None, metavar="ROWSxBLOCK_VxWARPS[n]",
                    help="the configs of --sweep instead of SWEEP, e.g. 4x128x4 (trailing letters: "
                         "n span off, p / q the row pass's prefetch on / off, l / c its "
                         "reductions once a row / every chunk, g / e the gradient pass over "
                         "unaligned rows by 16-byte groups / an entry a load)")
    ap.add_argument("--lattice-sweep", nargs="*", default=[])
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                    help="set rnnt_lattice.gpu's constants for the whole run, e.g. "
                         "SPAN_GRAD=True (a Python literal; the name must exist)")
    ap.add_argument("--host-profile", nargs="*", default=[])
    ap.add_argument("--peers", nargs="*", default=["torchaudio"])
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    sweep = SWEEP if args.sweep_configs is None else [_config(c) for c in args.sweep_configs]
    overrides = _overrides(args.set)
    if not torch.cuda.is_available():
        print("gpu_passes.py needs a CUDA device", file=sys.stderr)
        return 2
    from rnnt_lattice import gpu
    from rnnt_lattice._types import LossOptions
    from rnnt_lattice.topology import by_name, multiblank, tdt
    import peers
    for name, value in overrides.items():
        setattr(gpu, name, value)
    bw = copy_bandwidth() * 1e9                   # bytes a second, as run.py's floors
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e9:.0f} GB/s, "
          f"torch {torch.__version__}", flush=True)
    results = {"device": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9,
               "torch": torch.__version__, "rows": [], "launch_us": launch_costs(),
               "set": {k: repr(v) for k, v in overrides.items()}}
    if overrides:
        print("rnnt_lattice.gpu set:", results["set"], flush=True)
    print("host us per launch:", {k: round(v, 1) for k, v in results["launch_us"].items()},
          flush=True)
    for name in args.host_profile:
        host_profile(name)
    for name in args.shapes:
        for variant in args.variants:
            inp = shapes.make_inputs(shapes.SHAPES[name], variant=variant)
            inp = shapes.Inputs(inp.logits.cuda(), inp.targets.cuda(), inp.logit_lengths.cuda(),
                                inp.target_lengths.cuda(), inp.blank, variant)
            topo = {"regular": lambda: by_name("regular"),
                    "tdt": lambda: tdt(list(shapes.TDT_DURATIONS)),
                    "multiblank": lambda: multiblank(inp.blank, list(shapes.BIG_BLANK_DURATIONS)),
                    }[variant]()
            opts = LossOptions(inp.blank, True, topology=topo)
            leaf = inp.logits.clone().requires_grad_()

            def ours():
                costs = shapes.variant_loss(variant, leaf, inp.targets, inp.logit_lengths,
                                            inp.target_lengths, inp.blank)
                costs.sum().backward()
                leaf.grad = None

            row = {"shape": name, "variant": variant,
                   "floor": 3 * inp.logits.numel() * 4 / bw * 1e3, "step": step_ms(ours),
                   "peak_MiB": peak_mib(ours)}
            row.update(host=host_ms(ours, row["step"]), **passes(inp, opts))
            for peer in args.peers:
                prov = peers.PROVIDERS[peer]
                if "cuda" not in prov.devices or variant not in prov.variants:
                    continue
                try:
                    fn = prov.get()

                    def theirs(fn=fn):
                        costs = fn(leaf, inp.targets, inp.logit_lengths, inp.target_lengths,
                                   inp.blank)
                        costs.sum().backward()
                        leaf.grad = None
                    row[peer] = step_ms(theirs)
                    row[peer + "_peak_MiB"] = peak_mib(theirs)
                except Exception as err:                 # noqa: BLE001 (a peer may fail)
                    row[peer] = f"{type(err).__name__}: {str(err)[:80]}"
            print(json.dumps(_rounded(row)), flush=True)
            if name in args.sweep:
                row["sweep"] = _sweep("sweep", sweep, lambda c: passes(inp, opts, c))
            if name in args.lattice_sweep:
                row["lattice_sweep"] = _sweep(
                    "lattice", LATTICE_SWEEP, lambda c: {"lattice": lattice_ms(inp, opts, c)})
            results["rows"].append(row)
            del inp, leaf
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
