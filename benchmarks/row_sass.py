"""The chunk loops of the passes over V (the row pass, the gradient pass) as sm_90
compiles them, read from their SASS without a GPU.

    python benchmarks/row_sass.py [--sm 90] [--V 1024 1025] [--early [--tiles 4x128 ...]]
    PYTHONPATH=src <venv with triton 3.6.0>/bin/python benchmarks/row_sass.py   # the GPU's Triton

``kernels._row_kernel`` reads each row of the logits in chunks of ``BLOCK_V`` classes and
folds each chunk into the row's log-normaliser (``kernels._group_lse``). On an H200 it read
the logits at 57-60% of the copy bandwidth at s5 where the gradient pass reads and writes
them at 96% (docs/benchmarks.md), and a load issued ahead of the reductions gained 3%: the
pass is bound by the instructions it issues, not by its loads' latency. For each topology
and V, compiled as the backend launches it (``kernel_resources.variants``), with the
chunks reduced across the row at every chunk (``LANES`` = 0) and once a row
(``gpu.ROW_LANES``: a running max and sum per thread's 16 bytes), the table gives the
registers, the stack, the chunk loop's instructions (the smallest loop holding a 16-byte
load and an exp; one pass of it is one chunk: ``ROWS`` rows of ``BLOCK_V`` classes), its
warp shuffles and barriers (the cross-lane reductions), and the kernel's instructions in
all (static counts: what runs once a program plus one pass of each loop).

The second table is the gradient pass's (``kernels._grad_kernel``), compiled both ways for
rows that start anywhere (``gpu.SPAN_GRAD``: the row's whole 16-byte groups, or an entry a
load on ``NARROW_TILES``): its tile, registers, stack, the chunk loop (the smallest loop
holding a global store and an exp) with its 16-byte loads and stores against all of its
loads and stores, and two estimates a warp issues per row of 1024 classes: the loop's
instructions per 32 classes a warp, and what runs once a program, ``(all - loop) x warps /
rows`` (every warp runs it for the rows it holds; an upper bound: the static count holds the
slow paths too). TDT's rows by their 16-byte groups also with the duration group before the
token group's loop and after it (``gpu.GRAD_DURATIONS_LAST``).

``--early``: a third table instead, the row pass with its entries besides the token group's
read before the group's loop or after it (``gpu.ROW_EARLY``) and the span's chunks loaded
ahead or not (``gpu.SPAN_PREFETCH``), on 16, 8 and 4 rows of 128 for the span's rows: the
registers (how many programs a multiprocessor holds, so how many bytes are in flight) and
the global loads the compiled code issues before the chunk loop and after it (after it, a
program waits for them with none of its loads in flight).
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)      # compiled kernels, not interpreted

import torch  # noqa: E402
import triton  # noqa: E402

import kernel_resources as kr  # noqa: E402
from sass import branch_target, loop_spills, sass_lines  # noqa: E402


def smallest_loop(ins, *needles) -> list[str]:
    """The instructions of the smallest backward-branch loop that holds an instruction
    containing each of ``needles``; [] if none does."""
    best = None
    for a, s in ins:
        tgt = branch_target(s)
        if tgt is None or tgt >= a:
            continue
        body = [x for b, x in ins if tgt <= b <= a]
        if all(any(n in x for x in body) for n in needles):
            if best is None or len(body) < len(best):
                best = body
    return best or []


def chunk_loop(ins) -> list[str]:
    """The row pass's chunk loop: the smallest loop that holds a 16-byte global load and an
    exp (``MUFU.EX2``; TDT's duration group has a loop of its own, of scalar loads)."""
    return smallest_loop(ins, "LDG.E.128", "MUFU.EX2")


def analyse(sm: int, V_list, topologies=("regular", "tdt", "multiblank")):
    """Rows ``(topology, V, lanes, registers, stack, spills in loops, loop instructions,
    loop shuffles, loop barriers, instructions in all)``."""
    from rnnt_lattice.gpu import kernels
    for label, V, name, const, warps, stages, *_ in kr.variants(V_list):
        if name != "_row_kernel" or label.split()[1] not in topologies:
            continue
        for lanes in (0, min(16 // torch.float32.itemsize, const["BLOCK_V"])):
            c = kr.compile_as_launched(kernels._row_kernel, dict(const, LANES=lanes), warps,
                                       stages, sm)
            reg, stack = kr.resources(c.asm["cubin"])
            ins = sass_lines(c.asm["cubin"])
            loop = chunk_loop(ins)
            yield (label.split()[1], V, lanes, reg, stack, loop_spills(ins), len(loop),
                   sum("SHFL" in x for x in loop), sum(x.startswith("BAR") for x in loop),
                   len(ins))


def store_loop(ins) -> list[str]:
    """The gradient pass's token-group loop: the smallest loop that holds a global store
    and an exp."""
    return smallest_loop(ins, "STG", "MUFU.EX2")


def analyse_grad(sm: int, V_list, topologies=("regular", "tdt", "multiblank")):
    """Rows ``(topology, V, SPAN_GRAD, DUR_LAST, "ROWSxBLOCK_V", registers, stack, spills in
    loops, loop instructions, "LDG 16-byte/all", "STG 16-byte/all", instructions in all, loop
    instructions per 32 classes a warp, once-a-program instructions a row a warp)`` of the
    gradient pass (the topology ``NAME,CHECK``: a fused tile's, its recomputation checked in
    the pass); ``DUR_LAST`` (TDT's duration group after the token group's loop,
    ``gpu.GRAD_DURATIONS_LAST``) both ways for TDT's rows by their 16-byte groups, "-" for
    the topologies without durations."""
    from rnnt_lattice import gpu
    from rnnt_lattice.gpu import kernels
    saved = gpu.SPAN_GRAD
    try:
        for grad_span in (False, True):
            gpu.SPAN_GRAD = grad_span
            for label, V, name, const, warps, stages, *_ in kr.variants(V_list):
                if name != "_grad_kernel" or label.split()[1] not in topologies:
                    continue
                topo = label.split()[1]
                if grad_span and not const["SPAN"]:
                    continue                              # aligned rows: one way only
                ways = ((False, True) if topo == "tdt" and grad_span
                        else (const.get("DUR_LAST", False),))
                for dur_last in ways:
                    c = kr.compile_as_launched(kernels._grad_kernel,
                                               dict(const, DUR_LAST=dur_last), warps, stages, sm)
                    reg, stack = kr.resources(c.asm["cubin"])
                    ins = sass_lines(c.asm["cubin"])
                    loop = store_loop(ins)
                    rows, block_v = const["ROWS"], const["BLOCK_V"]
                    wide = (lambda op: f"{sum(op in x and '.128' in x for x in loop)}/"
                                       f"{sum(op in x for x in loop)}")
                    shown = topo + (",CHECK" if const.get("CHECK") else "")   # a fused tile's
                    yield (shown, V, int(grad_span), int(dur_last) if topo == "tdt" else "-",
                           f"{rows}x{block_v}", reg, stack, loop_spills(ins), len(loop),
                           wide("LDG"), wide("STG"),
                           len(ins), round(len(loop) * 32 * warps / (rows * block_v), 1),
                           round((len(ins) - len(loop)) * warps / rows))
    finally:
        gpu.SPAN_GRAD = saved


def analyse_early(sm: int, V_list, topologies=("regular", "tdt", "multiblank"), tiles=None):
    """Rows ``(topology, V, "ROWSxBLOCK_V", prefetch, early, registers, stack, spills in
    loops, loop instructions, global loads before the loop, after it)`` of the row pass
    with its reads ahead or not (``gpu.ROW_EARLY``: the entries besides the token group's read before its
    loop; the chunks' prefetch, ``gpu.ROW_PREFETCH`` for aligned rows and
    ``gpu.SPAN_PREFETCH`` for the span's), on ``tiles`` (``[(ROWS, BLOCK_V), ...]``; None:
    16, 8 and 4 rows of 128 for the span's rows, the launched tile for aligned rows); aligned
    rows with the prefetch on only, as launched."""
    from rnnt_lattice.gpu import kernels
    for label, V, name, const, warps, stages, *_ in kr.variants(V_list):
        topo = label.split()[1] if name == "_row_kernel" else None
        if topo not in topologies:
            continue
        swept = (tiles or (((16, 128), (8, 128), (4, 128)) if const["SPAN"]
                           else ((const["ROWS"], const["BLOCK_V"]),)))
        for rows, block_v in swept:
            for prefetch, early in ((False, False), (True, False), (False, True), (True, True)):
                if not const["SPAN"] and not prefetch:
                    continue
                c = kr.compile_as_launched(
                    kernels._row_kernel, dict(const, ROWS=rows, BLOCK_V=block_v,
                                              PREFETCH=prefetch, EARLY=early), warps, stages, sm)
                reg, stack = kr.resources(c.asm["cubin"])
                ins = sass_lines(c.asm["cubin"])
                loop = chunk_loop(ins)
                lo = next(i for i, (_, x) in enumerate(ins) if x == loop[0]) if loop else 0
                loads = [i for i, (_, x) in enumerate(ins) if "LDG" in x]
                yield (topo, V, f"{rows}x{block_v}", int(prefetch), int(early), reg, stack,
                       loop_spills(ins), len(loop), sum(i < lo for i in loads),
                       sum(i >= lo + len(loop) for i in loads))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sm", type=int, default=90)
    ap.add_argument("--V", type=int, nargs="*", default=[1024, 1025])
    ap.add_argument("--early", action="store_true",
                    help="only the third table: the row pass with its reads ahead of its loop "
                         "or not (gpu.ROW_EARLY, the span's prefetch gpu.SPAN_PREFETCH)")
    ap.add_argument("--tiles", nargs="*", default=None, metavar="ROWSxBLOCK_V",
                    help="--early's tiles for every row (default: 16, 8 and 4 rows of 128 for "
                         "rows that start anywhere, the launched tile for aligned rows)")
    args = ap.parse_args(argv)
    if args.early:
        tiles = [tuple(int(x) for x in t.split("x")) for t in args.tiles] if args.tiles else None
        print(f"triton {triton.__version__}, sm_{args.sm}, the row pass's reads ahead "
              "(prefetch: the chunks' loads ahead; early: the entries besides the token "
              "group's before its loop)")
        print("| topology | V | tile | prefetch | early | registers | stack | spills in loops "
              "| loop instructions | global loads before the loop | after it |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for row in analyse_early(args.sm, args.V, tiles=tiles):
            print("| " + " | ".join(str(x) for x in row) + " |", flush=True)
        return 0
    print(f"triton {triton.__version__}, sm_{args.sm}, the row pass's chunk loop "
          "(LANES 0: reduced across the row every chunk; 4: once a row)")
    print("| topology | V | LANES | registers | stack | spills in loops | loop instructions "
          "| loop shuffles | loop barriers | instructions in all |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in analyse(args.sm, args.V):
        print("| " + " | ".join(str(x) for x in row) + " |", flush=True)
    print(f"\ntriton {triton.__version__}, sm_{args.sm}, the gradient pass's chunk loop "
          "(SPAN_GRAD 1: the row's whole 16-byte groups; 0: an entry a load, for rows that "
          "start anywhere; DUR_LAST 1: TDT's duration group after the loop)")
    print("| topology | V | SPAN_GRAD | DUR_LAST | tile | registers | stack | spills in loops "
          "| loop instructions | loop LDG 16-byte/all | loop STG 16-byte/all "
          "| instructions in all | loop a warp per 32 classes | once a program, a row a warp |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in analyse_grad(args.sm, args.V):
        print("| " + " | ".join(str(x) for x in row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
