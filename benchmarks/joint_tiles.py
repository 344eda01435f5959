"""The joiner's kernel path on a GPU: its step timed with several block choices, and where
the step's time goes (torch.profiler), to choose ``gpu/joint.py``'s ``TILES``.

    python benchmarks/joint_tiles.py [--shape j1] [--hidden 512] [--precision bf16] [--reps 5]

One training step of ``fused_pipeline.py``'s model with the ``joint`` way (an
``rnnt_lattice.Joiner`` sharing the model's output layer: the kernel path, at ``--precision
fp32`` too, where a Joiner takes the tile path by default: ``joint.IEEE_FLOAT32``) is timed (CUDA
events, median of ``--reps`` after one warm-up, which compiles) with each entry of
:data:`CANDIDATES` (and for float32 operands :data:`F32_CANDIDATES`, with their own
pipeline stages) in place of ``gpu.joint.TILES``, each step's loss and gradients compared
with the default's (the same bits, or the largest relative difference); then the CUDA time
of the default's step by kernel (the row pass, the lattice, the coefficients, the gradient
pass, the products, the act-grad pass). Prints a table and writes ``--json`` if given.
Without a CUDA device it exits at once with a message (status 2).
"""
from __future__ import annotations

import common  # first: sets the thread env vars before torch is imported

import argparse                   # noqa: E402
import json                       # noqa: E402
import statistics                 # noqa: E402
import sys                        # noqa: E402

import torch                      # noqa: E402

import fused_pipeline             # noqa: E402
import shapes                     # noqa: E402

# Block choices (row pass, gradient pass): BLOCK_N nodes x BLOCK_V classes per program,
# BLOCK_H of H per product step, warps, pipeline stages. "default" is gpu/joint.py's.
CANDIDATES = {
    "128x128x64 w16 / 128x64x32 w8": (dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, num_warps=16, num_stages=3, FLATTEN=False),
                                      dict(BLOCK_N=128, BLOCK_V=64, BLOCK_H=32, num_warps=8, num_stages=3, FLATTEN=False)),
    "128x128x64 w16 / 128x128x32 w16": (dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, num_warps=16, num_stages=3, FLATTEN=False),
                                        dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=32, num_warps=16, num_stages=3, FLATTEN=False)),
    "128x128x64 w16 / 128x128x64 w16": (dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, num_warps=16, num_stages=3, FLATTEN=False),
                                        dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, num_warps=16, num_stages=3, FLATTEN=False)),
    "128x128x64 w16 s4 / 128x128x32 w16 s4": (dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, num_warps=16, num_stages=4, FLATTEN=False),
                                              dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=32, num_warps=16, num_stages=4, FLATTEN=False)),
    # The default's blocks with the loop over blocks of classes and the loop over H as one
    # (``joint.TILES``' FLATTEN): the next block's loads issue before the block's epilogue.
    "128x128x64 w16 flat / 128x128x64 w16": (
        dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, num_warps=16, num_stages=3, FLATTEN=True),
        dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, num_warps=16, num_stages=3, FLATTEN=False)),
    "128x128x64 w16 flat / 128x128x64 w16 flat": (
        dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, num_warps=16, num_stages=3, FLATTEN=True),
        dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, num_warps=16, num_stages=3, FLATTEN=True)),
    # Of nine choices compiled for sm_90 (bf16, H = 512: 128 or 64 nodes, 64 to 256
    # classes, 32 or 64 of H, 4 to 16 warps), the only one that puts two programs on a
    # multiprocessor, so that one's epilogue (the log-sum-exp, the gradient's formula) can
    # overlap the other's products: 237 / 255 registers on 4 warps (the gradient pass
    # spills 32 bytes), 72 KiB of shared memory; the others hold the whole register file
    # with one program. (256x64x32 w16, 25.67 ms against the default's 21.81 in bf16, made
    # room for it.)
    "64x128x64 w4 / 64x128x64 w4": (dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=64, num_warps=4, num_stages=3, FLATTEN=False),
                                    dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=64, num_warps=4, num_stages=3, FLATTEN=False)),
}
# Float32 operands (--precision fp32, tf32) run every choice above in two pipeline stages
# (``joint.WIDE[4]``: three [128, 64] float32 blocks of h and W need more shared memory than
# sm_90 has). These choices keep their own stages instead, with 32 of H per step: three
# stages take 96 KiB of shared memory, four 128 KiB, as two of 64 do. Compiled with Triton
# 3.6 for sm_90: 128 registers, no spill (the gradient pass at four stages spills 8 bytes).
F32_CANDIDATES = {
    "f32 128x128x32 w16 s3 / 128x128x32 w16 s3": (
        dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=32, num_warps=16, num_stages=3, FLATTEN=False),
        dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=32, num_warps=16, num_stages=3, FLATTEN=False)),
    "f32 128x128x32 w16 s4 / 128x128x32 w16 s3": (
        dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=32, num_warps=16, num_stages=4, FLATTEN=False),
        dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=32, num_warps=16, num_stages=3, FLATTEN=False)),
    "f32 128x128x64 w16 s2 / 128x128x32 w16 s3": (
        dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, num_warps=16, num_stages=2, FLATTEN=False),
        dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=32, num_warps=16, num_stages=3, FLATTEN=False)),
}


def candidates(precision: str) -> list:
    """``[(name, (row tiles, grad tiles), WIDE[4] or None)]`` to time at ``precision``:
    every choice of :data:`CANDIDATES`, and for float32 operands those of
    :data:`F32_CANDIDATES` with their own stages (``WIDE[4]`` emptied)."""
    out = [(name, tiles, None) for name, tiles in CANDIDATES.items()]
    if precision in ("fp32", "tf32"):
        out += [(name, tiles, {}) for name, tiles in F32_CANDIDATES.items()]
    return out


def _time(x, prec: str, reps: int) -> float:
    """Median milliseconds of the joint way's step (one untimed warm-up first)."""
    fused_pipeline.step("joint", x, None, prec)
    times = []
    for _ in range(reps):
        x.zero()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fused_pipeline.step("joint", x, None, prec)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _agreement(ref: tuple, got: tuple) -> str:
    """``"same bits"`` when every tensor of ``got`` equals ``ref``'s, else the largest
    difference relative to each tensor's largest entry: a block choice changes the order of
    the products' sums (BLOCK_H) or nothing at all (FLATTEN, the warps)."""
    if all(torch.equal(a, b) for a, b in zip(ref, got)):
        return "same bits"
    return "max rel diff " + ", ".join(
        f"{name} {float((b - a).abs().max() / a.abs().max().clamp(min=1e-30)):.1e}"
        for name, a, b in zip(("loss", "enc", "pred", "W"), ref, got))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="j1", choices=list(shapes.SHAPES))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--precision", default="bf16", choices=list(fused_pipeline.PRECISIONS))
    ap.add_argument("--loss", default="rnnt", choices=list(fused_pipeline.LOSSES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("joint_tiles.py needs a CUDA device (the kernel path is Triton's on CUDA)",
              file=sys.stderr)
        return 2
    from rnnt_lattice.gpu import joint
    joint.IEEE_FLOAT32 = True          # fp32 (IEEE products) on the kernel path too: it is timed
    default = {k: dict(v) for k, v in joint.TILES.items()}
    wide4 = dict(joint.WIDE[4])
    shape = shapes.SHAPES[args.shape]
    x = fused_pipeline.Inputs(shape, args.hidden, "cuda", 0, args.loss)
    print(f"# {torch.cuda.get_device_name()}; {shape.name} ({shape.describe()}), H={args.hidden}, "
          f"{args.loss}, {args.precision}; joint way, median of {args.reps}", flush=True)
    res, agree, ref = {}, {}, None
    for name, tiles, wide in ([("default", (default["row"], default["grad"]), None)]
                              + candidates(args.precision)):
        joint.TILES.update(row=tiles[0], grad=tiles[1])
        joint.WIDE[4] = wide4 if wide is None else wide
        try:
            res[name] = _time(x, args.precision, args.reps)
            got = fused_pipeline.result("joint", x, None, args.precision)
            ref = got if ref is None else ref
            agree[name] = _agreement(ref, got)
            print(f"  {name:42s} {res[name]:8.2f} ms  {agree[name]}", flush=True)
        except Exception as err:                   # noqa: BLE001  (out of resources, ...)
            res[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            print(f"  {name:42s} {res[name]}", flush=True)
    joint.TILES.update(default)
    joint.WIDE[4] = wide4
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fused_pipeline.step("joint", x, None, args.precision)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
    print(table, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"times_ms": res, "agreement_with_default": agree, "profile": table,
                       "meta": common.machine_info()}, f, indent=2,
                      default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
