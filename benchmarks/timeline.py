"""Where a GPU step's device sits idle, and why: a few steps under ``torch.profiler`` (CPU
and CUDA activities), queued back to back as a training loop queues them, and every gap
between two operations of the device on a stream put down to one of two causes by the launch
of the operation after it (its CUDA runtime or driver call, found by correlation id):

- **host**: that launch returned after the device had run out of work -- the device waited
  for the host (Python, PyTorch's dispatch, Triton's launcher, the autograd engine);
- **device**: it had been queued before, and the operation still started later -- launch
  latency between dependent kernels, a wait on another stream or an event.

    python benchmarks/timeline.py --loss s3 [--variant regular] [--steps 20]
    python benchmarks/timeline.py --joint j1 [--hidden 512] [--precision bf16] [--way joint]
                                  [--loss-kind rnnt] [--steps 3]
    (either) [--top 12] [--trace FILE.json] [--json FILE]

``--loss`` times forward+backward of the registry's loss (``shapes.variant_loss`` through
the public function, ``costs.sum().backward()``, as ``gpu_passes.py``'s step); ``--joint`` one
training step of ``fused_pipeline.step`` (``--way`` full, fused, joint or joint_cublas: the
full pipeline, the tile path, the joiner's kernel path, with its chunks' logits by cuBLAS).
Prints, per step: the device's span (its first
operation's start to its last one's end), the time it was busy, its idle time by cause, the
operations it ran; the host's time per step (each step is a ``record_function`` range); the
step by CUDA events without the profiler; then the host gaps summed by the launch that came
late (the innermost profiler range around it -- an aten operation, an autograd Function's
forward or backward -- and the operation it launched), and the device gaps by the pair of
operations around them. The profiler adds its own cost to every operation on the host, so
the host gaps it shows are upper bounds; the device's own gaps are not inflated by it.
``--trace`` keeps the Chrome trace (chrome://tracing, Perfetto). Without a CUDA device it
exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict

# The trace's categories (Kineto's Chrome trace, lower-cased: older Kineto wrote "Kernel",
# "Runtime", "Memcpy"): the device's operations, and the host's calls that put them on a
# stream (the runtime API: PyTorch, cuBLAS; the driver API: Triton's launcher), which carry
# the same "correlation" id as the operation.
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver", "runtime", "driver")
RANGE_CATS = ("cpu_op", "user_annotation", "python_function", "operator")
STEP_PREFIX = "step "
# Two operations closer than this (us) are back to back: the trace's timestamps are
# rounded to a few nanoseconds and the device's own switch between kernels is no idle time.
TOUCH_US = 0.5


def _end(e) -> float:
    return float(e["ts"]) + float(e.get("dur", 0.0))


def _innermost(ranges, launch):
    """The name of the shortest range of ``ranges`` (one thread's, sorted by start) that
    holds the whole of ``launch``, or None."""
    t0, t1 = float(launch["ts"]), _end(launch)
    best = None
    for r in ranges:
        if float(r["ts"]) > t0:
            break
        if _end(r) >= t1 and (best is None or float(r.get("dur", 0.0)) < float(best.get("dur", 0.0))):
            best = r
    return None if best is None else best["name"]


def analyse(events, top: int = 12) -> dict:
    """The device's busy and idle time in a trace's ``traceEvents`` (module docstring):

    ``{"streams": {stream: {"ops", "span_us", "busy_us", "idle_host_us", "idle_device_us",
    "idle_unknown_us"}}, "stream": the busiest, "steps": [host us of each "step i" range],
    "host_gaps": [{"op", "next", "us", "count"}], "device_gaps": [{"prev", "next", "us",
    "count"}]}`` (the gaps of the busiest stream, the ``top`` largest sums first). A gap
    whose next operation has no launch in the trace is "unknown"."""
    launches, ranges, streams = {}, defaultdict(list), defaultdict(list)
    steps = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, args = str(e.get("cat", "")).lower(), e.get("args") or {}
        if cat in DEVICE_CATS:
            streams[(e.get("pid"), args.get("stream", e.get("tid")))].append(e)
        elif cat in LAUNCH_CATS and args.get("correlation") is not None:
            launches[args["correlation"]] = e
        elif cat in RANGE_CATS:
            ranges[(e.get("pid"), e.get("tid"))].append(e)
            if cat == "user_annotation" and str(e.get("name", "")).startswith(STEP_PREFIX):
                steps.append(float(e.get("dur", 0.0)))
    for rs in ranges.values():
        rs.sort(key=lambda r: float(r["ts"]))
    out = {"streams": {}, "stream": None, "steps": steps, "host_gaps": [], "device_gaps": []}
    gaps_of = {}
    for key, ops in streams.items():
        ops.sort(key=lambda e: float(e["ts"]))
        idle = {"host": 0.0, "device": 0.0, "unknown": 0.0}
        gaps = []
        busy, start, end = 0.0, float(ops[0]["ts"]), _end(ops[0])
        prev = ops[0]
        for op in ops[1:]:
            ts = float(op["ts"])
            if ts > end + TOUCH_US:                       # the device ran out of work here
                busy += end - start
                launch = launches.get((op.get("args") or {}).get("correlation"))
                if launch is None:
                    cause, launched_by = "unknown", None
                else:
                    cause = "host" if _end(launch) > end else "device"
                    launched_by = _innermost(ranges.get((launch.get("pid"), launch.get("tid")), ()),
                                             launch) or launch["name"]
                idle[cause] += ts - end
                gaps.append((cause, ts - end, launched_by, prev["name"], op["name"]))
                start = ts
            if _end(op) >= end:
                end, prev = _end(op), op
        busy += end - start
        name = f"{key[0]}/{key[1]}"
        out["streams"][name] = {"ops": len(ops), "span_us": end - float(ops[0]["ts"]),
                                "busy_us": busy, **{f"idle_{k}_us": v for k, v in idle.items()}}
        gaps_of[name] = gaps
    if not out["streams"]:
        return out
    out["stream"] = max(out["streams"], key=lambda s: out["streams"][s]["busy_us"])
    host, device = defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0.0, 0])
    for cause, us, launched_by, prev, nxt in gaps_of[out["stream"]]:
        if cause == "unknown":
            continue
        acc = host[(launched_by, nxt)] if cause == "host" else device[(prev, nxt)]
        acc[0] += us
        acc[1] += 1
    out["host_gaps"] = [{"op": k[0], "next": k[1], "us": v[0], "count": v[1]}
                        for k, v in sorted(host.items(), key=lambda kv: -kv[1][0])[:top]]
    out["device_gaps"] = [{"prev": k[0], "next": k[1], "us": v[0], "count": v[1]}
                          for k, v in sorted(device.items(), key=lambda kv: -kv[1][0])[:top]]
    return out


def report(res: dict, steps: int, event_ms=None) -> str:
    """The lines :func:`main` prints for :func:`analyse`'s result over ``steps`` steps."""
    if res["stream"] is None:
        return "no device operation in the trace"
    s = res["streams"][res["stream"]]
    idle = s["idle_host_us"] + s["idle_device_us"] + s["idle_unknown_us"]
    lines = [f"stream {res['stream']} ({len(res['streams'])} with operations), per step of {steps}:",
             f"  device span {s['span_us'] / steps / 1e3:.3f} ms, busy {s['busy_us'] / steps / 1e3:.3f}, "
             f"idle {idle / steps / 1e3:.3f} (waiting for the host {s['idle_host_us'] / steps / 1e3:.3f}, "
             f"between queued operations {s['idle_device_us'] / steps / 1e3:.3f}"
             + (f", unknown {s['idle_unknown_us'] / steps / 1e3:.3f}" if s["idle_unknown_us"] else "")
             + f"), {s['ops'] / steps:.1f} operations"]
    if res["steps"]:
        lines.append(f"  host under the profiler: median {statistics.median(res['steps']) / 1e3:.3f} ms "
                     f"a step (its ranges: {len(res['steps'])})")
    if event_ms is not None:
        lines.append(f"  step without the profiler (CUDA events over {steps} queued steps): "
                     f"{event_ms:.3f} ms")
    if res["host_gaps"]:
        lines.append("  the device waited for the host, by the launch that came late "
                     "(us a step, gaps a step):")
        lines += [f"    {g['us'] / steps:9.1f} {g['count'] / steps:6.1f}  {g['op']}  ->  {g['next'][:90]}"
                  for g in res["host_gaps"]]
    if res["device_gaps"]:
        lines.append("  gaps between queued operations, by the pair around them (us a step, gaps a step):")
        lines += [f"    {g['us'] / steps:9.1f} {g['count'] / steps:6.1f}  {g['prev'][:60]}  ->  "
                  f"{g['next'][:60]}" for g in res["device_gaps"]]
    return "\n".join(lines)


def _loss_step(shape: str, variant: str):
    import shapes
    inp = shapes.make_inputs(shapes.SHAPES[shape], variant=variant)
    leaf = inp.logits.cuda().requires_grad_()
    args = [t.cuda() for t in (inp.targets, inp.logit_lengths, inp.target_lengths)]

    def step():
        costs = shapes.variant_loss(variant, leaf, *args, inp.blank)
        costs.sum().backward()
        leaf.grad = None
    return step


def _joint_step(shape: str, hidden: int, prec: str, way: str, loss: str):
    import fused_pipeline
    import shapes
    x = fused_pipeline.Inputs(shapes.SHAPES[shape], hidden, "cuda", 0, loss)

    def step():
        x.zero()
        fused_pipeline.step(way, x, None, prec)
    return step


def record(step, steps: int, trace_path: str) -> float:
    """``steps`` calls of ``step`` under the profiler, each in a ``record_function`` range,
    written to ``trace_path``; first the same calls without it, timed by CUDA events (ms a
    step, returned)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(steps):
        step()
    t1.record()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            with record_function(f"{STEP_PREFIX}{i}"):
                step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    return t0.elapsed_time(t1) / steps


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--loss", metavar="SHAPE", help="forward+backward of the loss at SHAPE")
    what.add_argument("--joint", metavar="SHAPE", help="a joiner's training step at SHAPE")
    ap.add_argument("--variant", default="regular")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--way", default="joint", choices=["full", "fused", "joint", "joint_cublas"])
    ap.add_argument("--loss-kind", default="rnnt", choices=["rnnt", "tdt"])
    ap.add_argument("--steps", type=int, default=None, help="20 for --loss, 3 for --joint")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--trace", default=None, help="keep the Chrome trace here")
    ap.add_argument("--json", default=None)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("timeline.py needs a CUDA device", file=sys.stderr)
        return 2
    steps = args.steps or (20 if args.loss else 3)
    if args.loss:
        step = _loss_step(args.loss, args.variant)
        what = f"loss {args.variant} at {args.loss}"
    else:
        step = _joint_step(args.joint, args.hidden, args.precision, args.way, args.loss_kind)
        what = f"{args.way} step at {args.joint}, H = {args.hidden}, {args.precision}, {args.loss_kind}"
    path = args.trace or os.path.join(tempfile.mkdtemp(), "trace.json")
    event_ms = record(step, steps, path)
    with open(path) as f:
        res = analyse(json.load(f)["traceEvents"], args.top)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: {what}", flush=True)
    print(report(res, steps, event_ms), flush=True)
    if args.json:
        import common
        with open(args.json, "w") as f:
            json.dump({"what": what, "steps": steps, "event_ms": event_ms, **res,
                       "meta": common.machine_info()}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
