"""The joiner's kernel path on a GPU: its step timed with several block choices, and where
the step's time goes (torch.profiler), to choose ``gpu/joint.py``'s ``TILES``.

    python benchmarks/joint_tiles.py [--shape j1] [--hidden 512] [--precision bf16] [--reps 5]
    python benchmarks/joint_tiles.py --compile [SM] [--precision bf16]     # no GPU needed
    python benchmarks/joint_tiles.py --act-grad [--shape j1] [--reps 20] [--compile [SM]]

One training step of ``fused_pipeline.py``'s model with the ``joint`` way (an
``rnnt_lattice.Joiner`` sharing the model's output layer: the kernel path, at ``--precision
fp32`` too, where a Joiner takes the tile path by default: ``joint.IEEE_FLOAT32``) is timed (CUDA
events, median of ``--reps`` after one warm-up, which compiles) with each entry of
:data:`CANDIDATES` (and for float32 operands :data:`F32_CANDIDATES`, with their own
pipeline stages) in place of ``gpu.joint.TILES``, each step's loss and gradients compared
with the default's (the same bits, or the largest relative difference), and the device
time of its row and gradient passes (one profiled step; ``TILES`` sets the two passes'
blocks apart, so the fastest of each pass is named at the end, whichever choices they come
from); then the CUDA time of the default's step by kernel (the row pass, the lattice, the
coefficients, the gradient pass, the products, the act-grad pass). Prints a table and
writes ``--json`` if given.
Without a CUDA device it exits at once with a message (status 2). ``--compile``: no
timing, each choice's passes compiled for sm_90 (or the SM given) as they would launch, with
their registers, spills, shared memory and how many programs fit a multiprocessor
(``kernel_resources.programs_per_sm``): the choices' occupancy, checked without a GPU.
``--act-grad``: the act-grad pass alone instead (``joint.act_grad`` on the shape's first
chunk, bf16 ``dh`` and ``h``), each choice of :data:`ACT_GRAD_CANDIDATES` against
``joint.ACT_GRAD``: time, bandwidth (of the bytes :func:`act_grad_bytes` counts) and
agreement; with ``--compile``, each choice's registers, spills, programs a multiprocessor
and the waves its grid takes.
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


def _blocks(n: int, v: int, h: int, warps: int, stages: int = 3,
            maxnreg: int | None = None) -> dict:
    """One pass's blocks, as ``joint.TILES`` holds them: ``n`` nodes x ``v`` classes per
    program, ``h`` of H per product step, warps, pipeline stages and, where given, the cap
    on registers a thread."""
    out = dict(BLOCK_N=n, BLOCK_V=v, BLOCK_H=h, num_warps=warps, num_stages=stages)
    if maxnreg is not None:
        out["maxnreg"] = maxnreg
    return out


def _same(*args, **kw) -> tuple:
    """The same blocks for both passes (row, gradient)."""
    return _blocks(*args, **kw), _blocks(*args, **kw)


# Block choices (row pass, gradient pass): BLOCK_N nodes x BLOCK_V classes per program,
# BLOCK_H of H per product step, warps, pipeline stages. "default" is gpu/joint.py's.
CANDIDATES = {
    "128x128x64 w16 / 128x64x32 w8": (_blocks(128, 128, 64, 16),
                                      _blocks(128, 64, 32, 8)),
    "128x128x64 w16 / 128x128x32 w16": (_blocks(128, 128, 64, 16),
                                        _blocks(128, 128, 32, 16)),
    "128x128x64 w16 / 128x128x64 w16": _same(128, 128, 64, 16),
    "128x128x64 w16 s4 / 128x128x32 w16 s4": (_blocks(128, 128, 64, 16, stages=4),
                                              _blocks(128, 128, 32, 16, stages=4)),
    # Of nine choices compiled for sm_90 (bf16, H = 512: 128 or 64 nodes, 64 to 256
    # classes, 32 or 64 of H, 4 to 16 warps), the only one that puts two programs on a
    # multiprocessor, so that one's epilogue (the log-sum-exp, the gradient's formula) can
    # overlap the other's products: 237 / 255 registers on 4 warps (the gradient pass
    # spills 32 bytes), 72 KiB of shared memory; the others hold the whole register file
    # with one program. (256x64x32 w16, 25.67 ms against the default's 21.81 in bf16, made
    # room for it.)
    "64x128x64 w4 / 64x128x64 w4": _same(64, 128, 64, 4),
    # More programs a multiprocessor by a cap on registers a thread (``maxnreg``): with one
    # program of 16 warps holding the register file, a block's epilogue (the exps and
    # reductions, the gradient's formula and its stores) cannot overlap the next block's
    # products, nor hide the latency of its barriers; with two or three programs, one's
    # epilogue runs while another's products do. Compiled with Triton 3.6 for sm_90 at H =
    # 512 (``--compile``; results/joint/sm90-triton36-occupancy.md): the default's blocks on
    # 8 warps capped at 128 registers, two programs, spill 160 bytes; 128 nodes x 64 classes
    # on 8 warps at 128, two programs, no spill; 64 x 128 on 4 warps at 168, three programs,
    # no spill (the gradient pass 16 bytes at 64 of H a step).
    "128x128x64 w8 r128 / same": _same(128, 128, 64, 8, maxnreg=128),
    "128x64x64 w8 r128 / same": _same(128, 64, 64, 8, maxnreg=128),
    "64x128x64 w4 r168 / same": _same(64, 128, 64, 4, maxnreg=168),
    # Fewer bytes from L2 (l2_reads): a program reads its rows of h once per block of classes
    # and W's block once per block of nodes, so at j1 (1.29M nodes, H = 512, V = 1024, bf16)
    # the default's 128 x 128 reads 10.6 GB of h and 10.6 GB of W a pass; 256 x 128 reads
    # 10.6 and 5.3, 128 x 256 5.3 and 10.6 (256 x 64, 21.2 and 5.3, timed slower than the
    # default: 25.67 against 21.81 ms, as its 26.5 GB against 21.2 would have it). One
    # program a multiprocessor, 128 registers, spills of 80-120 bytes (Triton 3.6, sm_90).
    "256x128x32 w16 / same": _same(256, 128, 32, 16),
    "128x256x32 w16 / same": _same(128, 256, 32, 16),
    "64x128x32 w4 s4 r168 / same": _same(64, 128, 32, 4, stages=4, maxnreg=168),
}
# Float32 operands (--precision fp32, tf32) run every choice above with F32_OVER over it
# (32 of H a step in three pipeline stages: three [128, 64] float32 blocks of h and W need
# more shared memory than sm_90 has), whatever its name says of H and stages; the default
# is ``joint.WIDE[4]``'s choice. These choices keep their own stages instead, with 32 of H
# per step: three stages take 96 KiB of shared memory, four 128 KiB, as two of 64 do.
# Compiled with Triton 3.6 for sm_90: 128 registers, no spill (the gradient pass at four
# stages spilled 8 bytes when chosen).
F32_OVER = dict(BLOCK_H=32, num_stages=3)
F32_CANDIDATES = {
    "f32 128x128x32 w16 s3 / 128x128x32 w16 s3": _same(128, 128, 32, 16),
    "f32 128x128x32 w16 s4 / 128x128x32 w16 s3": (
        _blocks(128, 128, 32, 16, stages=4),
        _blocks(128, 128, 32, 16)),
    "f32 128x128x64 w16 s2 / 128x128x32 w16 s3": (
        _blocks(128, 128, 64, 16, stages=2),
        _blocks(128, 128, 32, 16)),
}


def candidates(precision: str) -> list:
    """``[(name, (row tiles, grad tiles), WIDE[4] or None)]`` to time at ``precision``:
    every choice of :data:`CANDIDATES` (for float32 operands with :data:`F32_OVER` as
    ``WIDE[4]``), and for float32 operands those of :data:`F32_CANDIDATES` with their own
    stages (``WIDE[4]`` emptied)."""
    if precision not in ("fp32", "tf32"):
        return [(name, tiles, None) for name, tiles in CANDIDATES.items()]
    return ([(name, tiles, dict(F32_OVER)) for name, tiles in CANDIDATES.items()]
            + [(name, tiles, {}) for name, tiles in F32_CANDIDATES.items()])


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


# The kernels of the two passes whose blocks TILES sets, by the TILES entry.
PASSES = {"row": "_joint_row_kernel", "grad": "_joint_grad_kernel"}


def pass_times(events) -> dict:
    """``{"row": ms, "grad": ms}``: the device time of the two passes in one step's profiler
    events (``key_averages()``), summed over their launches (one a chunk)."""
    out = {}
    for e in events:
        for which, kernel in PASSES.items():
            if e.key == kernel:
                us = getattr(e, "self_device_time_total", None)
                us = getattr(e, "self_cuda_time_total", 0.0) if us is None else us
                out[which] = out.get(which, 0.0) + us / 1e3
    return out


def _profiled(x, prec: str):
    """One step of the joint way under torch.profiler (CUDA): its profile."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fused_pipeline.step("joint", x, None, prec)
        torch.cuda.synchronize()
    return prof


def best_passes(passes: dict) -> dict:
    """``{"row": (choice, ms), "grad": (choice, ms)}``: each pass's fastest choice (TILES
    sets the two passes' blocks apart, so the fastest row pass and the fastest gradient
    pass may come from two choices)."""
    out = {}
    for which in PASSES:
        timed = [(ms[which], name) for name, ms in passes.items() if which in ms]
        if timed:
            ms, name = min(timed)
            out[which] = (name, ms)
    return out


def _agreement(ref: tuple, got: tuple, names=("loss", "enc", "pred", "W")) -> str:
    """``"same bits"`` when every tensor of ``got`` equals ``ref``'s, else the largest
    difference relative to each tensor's largest entry: a block choice changes the order of
    the products' sums (BLOCK_H) or nothing at all (the warps)."""
    if all(torch.equal(a, b) for a, b in zip(ref, got)):
        return "same bits"
    return "max rel diff " + ", ".join(
        f"{name} {float((b - a).abs().max() / a.abs().max().clamp(min=1e-30)):.1e}"
        for name, a, b in zip(names, ref, got))


# --compile: the operands' dtype (kernel_resources' name) and the products' precision.
OPERANDS = {"bf16": ("bf16", 2, "ieee"), "fp16": ("fp16", 2, "ieee"), "fp32": ("fp32", 4, "ieee"),
            "tf32": ("fp32", 4, "tf32")}


def _act(u: int, h: int, warps: int, prefetch: bool = False, maxnreg: int | None = None) -> dict:
    """The act-grad pass's blocks, as ``joint.ACT_GRAD`` holds them."""
    out = dict(BLOCK_U=u, BLOCK_H=h, PREFETCH=prefetch, num_warps=warps)
    if maxnreg is not None:
        out["maxnreg"] = maxnreg
    return out


# The act-grad pass's choices (``--act-grad``): label positions x columns of H a program,
# warps, the next frame loaded before this frame's sums (p), a cap on registers (r). At j1 a
# chunk of 40 frames is B = 32 sequences x 101 label positions x 512 of H, and each program
# runs over its 40 frames, so the grid (B x blocks of label positions x blocks of H) should
# fit one wave of the GPU's multiprocessors (132 on an H100 or H200): the default's 1024
# programs of 64 registers take 8 a multiprocessor (1056); with PREFETCH, 72 registers
# leave room for 7 (two waves) unless capped at 64 (24 bytes of spills). Fewer label
# positions a program write more partial sums of dE (blocks x B x frames x H float32, then
# added by PyTorch); wider columns of H read longer runs of each row (1 KiB a row in bf16
# at H = 512). Compiled for sm_90 with Triton 3.6: ``--act-grad --compile``.
ACT_GRAD_CANDIDATES = {
    "32x64 w4 p r64": _act(32, 64, 4, True, 64),
    "32x64 w4 p": _act(32, 64, 4, True),
    "16x128 w4 p": _act(16, 128, 4, True),
    "32x128 w8 p r64": _act(32, 128, 8, True, 64),
    "64x64 w8 p r64": _act(64, 64, 8, True, 64),
    "32x64 w2": _act(32, 64, 2),
    "64x64 w4": _act(64, 64, 4),
    "32x128 w4": _act(32, 128, 4),
    "16x128 w4": _act(16, 128, 4),
}


def act_grad_choices() -> list:
    """``[(name, blocks)]``: ``joint.ACT_GRAD`` as "default", then :data:`ACT_GRAD_CANDIDATES`."""
    from rnnt_lattice.gpu import joint
    return [("default", joint.ACT_GRAD)] + list(ACT_GRAD_CANDIDATES.items())


def act_grad_chunk(shape) -> tuple:
    """``(B, frames, labels)`` of the kernel path's first chunk at ``shape`` with bf16
    operands and the GPU's default tile (``fused_rnnt_loss``'s chunk rows: the tile's bytes
    over a row of logits)."""
    from rnnt_lattice import _layout, fused
    _, nbytes = fused.check_tile(fused.default_tile(torch.device("cuda")))
    B, T, U1 = shape.B, shape.T, shape.U + 1
    t0, t1, u0, u1 = _layout.tile_plan(B, T, U1, max(1, nbytes // (shape.V * 2)), False)[0]
    return B, t1 - t0, u1 - u0


def act_grad_bytes(B: int, frames: int, labels: int, H: int, size: int, block_u: int) -> int:
    """Bytes a chunk's act-grad stage moves: ``dh`` and ``h`` read (``size`` bytes an
    entry), dE's partial sums written and read back, their sum written, ``d_enc``'s rows read
    and written, ``d_pred``'s read and written (float32)."""
    n = B * frames * labels
    blocks = -(-labels // block_u)
    return (2 * n * H * size + 2 * blocks * B * frames * H * 4 + 3 * B * frames * H * 4
            + 2 * B * labels * H * 4)


def act_grad_compile_table(H: int, sm: int = 90, shape=None) -> list:
    """Each act-grad choice compiled for ``sm`` as launched at width ``H`` (bf16 operands):
    ``[(choice, registers, stack, programs a multiprocessor, programs of the grid at
    ``shape``'s first chunk, waves on 132 multiprocessors, MB moved)]``."""
    import kernel_resources as kr
    from rnnt_lattice.gpu import joint
    B, frames, labels = act_grad_chunk(shape) if shape is not None else (1, 1, 1)
    out = []
    for name, tiles in act_grad_choices():
        options = dict(num_stages=3, **joint.launch_options(tiles))
        c = kr.compile_launch(joint._joint_act_grad_kernel,
                              dict(joint.block_constants(tiles), ACT=0), options, sm, "bf16",
                              dict(H=H))
        regs, stack = kr.resources(c.asm["cubin"])
        per_sm = kr.programs_per_sm(regs, options.get("num_warps", 4), c.metadata.shared, sm)
        grid = B * -(-labels // tiles["BLOCK_U"]) * -(-H // tiles["BLOCK_H"])
        mb = act_grad_bytes(B, frames, labels, H, 2, tiles["BLOCK_U"]) / 1e6
        out.append((name, regs, stack, per_sm, grid, f"{grid / (132 * per_sm):.2f}", f"{mb:.0f}"))
    return out


def time_act_grad(shape, H: int, reps: int, bandwidth: float) -> dict:
    """Each act-grad choice (the default first) timed alone on the first chunk of
    ``shape`` (random bf16 ``dh`` and ``h``; ``joint.act_grad``: the kernel and the sum of
    dE's partial sums): ``{choice: {"ms", "GBps", "of_copy", "agreement"}}``, CUDA events,
    the median of ``reps`` after a warm-up (which compiles); the agreement is of ``dE`` and
    ``dP`` with the default's (the blocks of label positions order dE's sums)."""
    from rnnt_lattice.gpu import joint
    B, frames, labels = act_grad_chunk(shape)
    U1 = shape.U + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    n = B * frames * labels
    dh = torch.randn(n, H, device="cuda", dtype=torch.bfloat16, generator=g)
    h = torch.rand(n, H, device="cuda", generator=g).mul_(2).sub_(1).to(torch.bfloat16)
    box = (0, frames, 0, labels)
    out, ref = {}, None
    for name, tiles in act_grad_choices():
        d_enc = torch.zeros(B, shape.T, H, device="cuda")
        d_pred = torch.zeros(B, U1, H, device="cuda")

        def once():
            d_enc.zero_()
            d_pred.zero_()
            joint.act_grad(dh, h, d_enc, d_pred, box, 0, tiles)
        try:
            once()
            got = (d_enc.clone(), d_pred.clone())
            times = []
            for _ in range(reps):
                d_enc.zero_()
                d_pred.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                joint.act_grad(dh, h, d_enc, d_pred, box, 0, tiles)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
        except Exception as err:                   # noqa: BLE001  (out of resources, ...)
            out[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
            continue
        ms = statistics.median(times)
        gbps = act_grad_bytes(B, frames, labels, H, 2, tiles["BLOCK_U"]) / ms / 1e6
        ref = got if ref is None else ref
        out[name] = {"ms": ms, "GBps": gbps, "of_copy": gbps * 1e9 / bandwidth,
                     "agreement": _agreement(ref, got, ("enc", "pred"))}
    return {"chunk": {"B": B, "frames": frames, "labels": labels, "H": H}, "choices": out}


def l2_reads(nodes: int, V: int, H: int, size: int, block_n: int, block_v: int) -> tuple:
    """``(h, W)`` bytes a pass of a ``block_n`` x ``block_v`` choice reads from L2 over
    ``nodes`` nodes: each program reads its rows of ``h`` once per block of classes, and each
    block of ``W`` once per block of nodes (operands of ``size`` bytes)."""
    return (nodes * H * size * -(-V // block_v), -(-nodes // block_n) * V * H * size)


def compile_table(precision: str, H: int, V: int, loss: str = "rnnt", sm: int = 90,
                  nodes: int = 0) -> list:
    """Each choice's two passes compiled for ``sm`` as they would launch (no GPU needed:
    ``kernel_resources``), at width ``H`` and ``V`` classes: ``[(choice, pass, warps,
    registers, stack bytes, shared KiB, programs a multiprocessor, GB of h + W read from L2
    over ``nodes`` nodes)]`` (:func:`l2_reads`); a pass that does not compile has the
    error's last line in place of its registers."""
    import kernel_resources as kr
    from rnnt_lattice import topology
    from rnnt_lattice.gpu import joint
    x, size, dot = OPERANDS[precision]
    topo = (topology.tdt(list(fused_pipeline.TDT_DURATIONS)) if loss == "tdt"
            else topology.regular())
    default = (joint.TILES["row"], joint.TILES["grad"])
    out = []
    for name, tiles, wide in [("default", default, None)] + candidates(precision):
        for which, tile in zip(("row", "grad"), tiles):
            tile = dict(tile, **(joint.WIDE.get(size, {}) if wide is None else wide))
            options = joint.launch_options(tile)
            warps = options.get("num_warps", 4)
            h, w = l2_reads(nodes, V, H, size, tile["BLOCK_N"], tile["BLOCK_V"])
            traffic = f"{h / 1e9:.1f} + {w / 1e9:.1f}"
            try:
                c = kr.compile_launch(getattr(joint, f"_joint_{which}_kernel"),
                                      kr.joint_constants(topo, which, tile, dot), options, sm, x,
                                      dict(V_tok=V - topo.n_durations, H=H))
            except Exception as err:             # noqa: BLE001  (out of resources, ...)
                last = [ln for ln in str(err).splitlines() if ln.strip()][-1:] or [type(err).__name__]
                out.append((name, which, warps, last[0][:160], "-", "-", "-", traffic))
                continue
            regs, stack = kr.resources(c.asm["cubin"])
            shared = c.metadata.shared
            out.append((name, which, warps, regs, stack, round(shared / 1024),
                        kr.programs_per_sm(regs, warps, shared, sm), traffic))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="j1", choices=list(shapes.SHAPES))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--precision", default="bf16", choices=list(fused_pipeline.PRECISIONS))
    ap.add_argument("--loss", default="rnnt", choices=list(fused_pipeline.LOSSES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--act-grad", action="store_true",
                    help="the act-grad pass alone instead: each choice of ACT_GRAD_CANDIDATES "
                         "on the shape's first chunk (bf16), timed, or with --compile its "
                         "registers, spills, programs a multiprocessor and the grid's waves")
    ap.add_argument("--compile", type=int, nargs="?", const=90, default=None, metavar="SM",
                    help="no timing: compile each choice's passes for sm_SM (default 90) "
                         "and print their registers, spills, shared memory and programs a "
                         "multiprocessor (no GPU needed)")
    args = ap.parse_args(argv)
    if args.compile is not None and args.act_grad:
        import triton
        shape = shapes.SHAPES[args.shape]
        print(f"# triton {triton.__version__}, sm_{args.compile}; the act-grad pass, bf16, "
              f"H = {args.hidden}; the grid of {args.shape}'s first chunk "
              f"(B, frames, labels = {act_grad_chunk(shape)})")
        print("| choice | registers | stack (bytes) | programs a multiprocessor | programs "
              "| waves on 132 | MB moved |")
        print("|---|---|---|---|---|---|---|")
        for row in act_grad_compile_table(args.hidden, args.compile, shape):
            print("| " + " | ".join(map(str, row)) + " |", flush=True)
        return 0
    if args.compile is not None:
        import triton
        shape = shapes.SHAPES[args.shape]
        V, nodes = shape.V, shape.B * shape.T * (shape.U + 1)
        print(f"# triton {triton.__version__}, sm_{args.compile}; {args.shape}: V = {V}, "
              f"H = {args.hidden}, {args.loss}, {args.precision}; L2 reads over its "
              f"{nodes} nodes")
        print("| choice | pass | warps | registers | stack (bytes) | shared memory (KiB) "
              "| programs a multiprocessor | L2 reads a pass, h + W (GB) |")
        print("|---|---|---|---|---|---|---|---|")
        for row in compile_table(args.precision, args.hidden, V, args.loss, args.compile,
                                 nodes):
            print("| " + " | ".join(map(str, row)) + " |", flush=True)
        return 0
    if not torch.cuda.is_available():
        print("joint_tiles.py needs a CUDA device (the kernel path is Triton's on CUDA)",
              file=sys.stderr)
        return 2
    if args.act_grad:
        from timing import copy_bandwidth
        bw = copy_bandwidth() * 1e9               # bytes a second
        res = time_act_grad(shapes.SHAPES[args.shape], args.hidden, args.reps, bw)
        print(f"# {torch.cuda.get_device_name()}; the act-grad pass alone on {args.shape}'s "
              f"first chunk {res['chunk']}, bf16; copy bandwidth {bw / 1e9:.0f} GB/s; "
              f"median of {args.reps}", flush=True)
        for name, r in res["choices"].items():
            print(f"  {name:20s} " + (r["error"] if "error" in r else
                  f"{r['ms']:7.3f} ms  {r['GBps']:6.0f} GB/s ({r['of_copy']:.0%})  {r['agreement']}"),
                  flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**res, "copy_GBps": bw / 1e9, "meta": common.machine_info()}, f,
                          indent=2, default=str)
        return 0
    from rnnt_lattice.gpu import joint
    joint.IEEE_FLOAT32 = True          # fp32 (IEEE products) on the kernel path too: it is timed
    default = {k: dict(v) for k, v in joint.TILES.items()}
    wide4 = dict(joint.WIDE[4])
    shape = shapes.SHAPES[args.shape]
    x = fused_pipeline.Inputs(shape, args.hidden, "cuda", 0, args.loss)
    print(f"# {torch.cuda.get_device_name()}; {shape.name} ({shape.describe()}), H={args.hidden}, "
          f"{args.loss}, {args.precision}; joint way, median of {args.reps}", flush=True)
    res, agree, passes, ref = {}, {}, {}, None
    for name, tiles, wide in ([("default", (default["row"], default["grad"]), None)]
                              + candidates(args.precision)):
        joint.TILES.update(row=tiles[0], grad=tiles[1])
        joint.WIDE[4] = wide4 if wide is None else wide
        try:
            res[name] = _time(x, args.precision, args.reps)
            got = fused_pipeline.result("joint", x, None, args.precision)
            ref = got if ref is None else ref
            agree[name] = _agreement(ref, got)
            passes[name] = pass_times(_profiled(x, args.precision).key_averages())
            each = ", ".join(f"{k} {v:.2f}" for k, v in passes[name].items())
            print(f"  {name:42s} {res[name]:8.2f} ms  ({each} ms)  {agree[name]}", flush=True)
        except Exception as err:                   # noqa: BLE001  (out of resources, ...)
            res[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            print(f"  {name:42s} {res[name]}", flush=True)
    joint.TILES.update(default)
    joint.WIDE[4] = wide4
    best = best_passes(passes)
    for which, (name, ms) in best.items():
        print(f"  fastest {which} pass: {name} ({ms:.2f} ms; {agree[name]})", flush=True)
    table = _profiled(x, args.precision).key_averages().table(sort_by="cuda_time_total",
                                                              row_limit=20)
    print(table, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"times_ms": res, "agreement_with_default": agree, "passes_ms": passes,
                       "fastest_passes": best, "profile": table,
                       "meta": common.machine_info()}, f, indent=2,
                      default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
