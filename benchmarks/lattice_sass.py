"""The lattice pass's diagonal loop as sm_90 runs it, read from its SASS without a GPU.

    python benchmarks/lattice_sass.py [--sm 90] [--U1 41 81 151] [--load-latency 400] [--onchip]
    PYTHONPATH=<another checkout>/src python benchmarks/lattice_sass.py     # its kernels

``kernels._lattice_kernel`` runs one program per sequence and direction, one lane per
label position of a diagonal (one warp per scheduler at s5), and waits at a barrier after
each diagonal: its time is the latency of one diagonal's chain of instructions, times the
number of diagonals. Nothing hides that latency (no other warp on the scheduler), so the
SASS of the loop body says most of it. For each topology (regular; TDT with durations
0..4; multi-blank with big blanks 2, 4, 8), each ``BLOCK_U`` bucket and each direction
(alpha, beta), compiled as the backend launches it (``kernel_resources.variants``), the
table gives:

* ``loop``: the two directions' diagonal loops (alpha's and beta's) in code order, which
  the compiler chooses (Triton 3.9 puts alpha's first; 3.6 may not); the pass takes about
  the slower one's time (the two programs of a sequence run at the same time);
* ``loads first``: the global loads issued before the first instruction that reads a
  loaded register, of the diagonal's loads (each kind's arc weight and the alpha/beta it
  extends). A warp issues in order, so the first such instruction waits for its load: all
  of them first means one memory latency a diagonal, fewer means two or more;
* ``instructions``: those executed on the loop's common path (a forward branch whose
  skipped code holds a ``MUFU`` is the log's main path and falls through; every other
  forward branch, a slow path of a math function, is taken), of them float64 operations;
* ``modelled cycles``: one warp issuing that path in order, an instruction waiting for its
  operands (latencies: float64 8 cycles and 2 cycles to issue, integer and float32 4, wide
  multiply 5, ``MUFU`` 20, a global load ``--load-latency``, the barrier 30 after every
  outstanding result). A model, not a measurement: it ranks versions of the loop (fewer
  round trips to memory, shorter chains), and a GPU's timing (``gpu_passes.py``) decides.

Without ``--onchip``: the workspace pass's loop (the pass where the state does not fit one
block of lanes, and everywhere with ``gpu.LATTICE_ONCHIP`` off). ``--onchip``: the loop of
``gpu.LATTICE_ONCHIP`` (the default where U + 1 fits one block of lanes: the last
diagonals' alpha or beta in registers, a lane's neighbour read by a gather through shared
memory, the next diagonal's weights loaded during this one): its loads are not waited for
in the pass that issues them, and a diagonal takes at least one load latency.

Compiles with the Triton installed (the GPU machine has Triton 3.6: run it with that one
too, as ``kernel_resources.py``); needs Triton's ``nvdisasm`` (in its NVIDIA backend).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)      # compiled kernels, not interpreted

import triton  # noqa: E402

import kernel_resources as kr  # noqa: E402
from sass import branch_target, loop_spills, sass_lines  # noqa: E402

LATENCY = {"dp": 8, "alu": 4, "wide": 5, "mufu": 20, "load": 400, "bar": 30}
DP_OPS = ("DFMA", "DADD", "DMUL", "DSETP", "DMNMX", "F2F.F64", "F2I.F64", "I2F.F64",
          "FRND.F64")
_REG = re.compile(r"\b(U?R\d+|U?P\d)\b(\.64)?")


def diagonal_loops(ins) -> list[tuple[int, int]]:
    """``(first, last)`` addresses of the loops that hold a barrier: the two directions'
    diagonal loops, in code order."""
    loops = []
    for a, s in ins:
        tgt = branch_target(s)
        if tgt is not None and tgt < a and any(x.startswith("BAR") for b, x in ins
                                               if tgt <= b <= a):
            loops = [(lo, hi) for lo, hi in loops if not (tgt <= lo and hi <= a)]
            if not any(lo <= tgt and a <= hi for lo, hi in loops):
                loops.append((tgt, a))
    return loops


def common_path(ins, lo: int, hi: int) -> list[str]:
    """The instructions of ``[lo, hi)`` a diagonal executes (see the module's docstring)."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    i, out = index[lo], []
    while i < len(ins) and ins[i][0] < hi:
        a, s = ins[i]
        tgt = branch_target(s)
        if tgt is not None and tgt > a:
            skipped = [x for _, x in ins[i + 1:index[tgt]]]
            if s.startswith("@") and any("MUFU" in x for x in skipped):
                i += 1
                continue
            i = index[tgt]
            continue
        if not s.startswith(("BSSY", "BSYNC")):
            out.append(s)
        i += 1
    return out


def _parse(s: str):
    """``(opcode, kind, destinations, sources)`` of one instruction."""
    srcs = []
    m = re.match(r"@!?(U?P\w+)\s+(.*)", s)
    if m:
        srcs.append(m.group(1))
        s = m.group(2)
    op, _, rest = s.partition(" ")
    kind = ("dp" if op.startswith(DP_OPS) else "mufu" if op.startswith("MUFU")
            else "load" if op.startswith("LDG") else "bar" if op.startswith("BAR")
            else "wide" if op.startswith("IMAD.WIDE") else "alu")
    pair = op.startswith(("DFMA", "DADD", "DMUL", "DSETP"))
    parts = [p.strip() for p in rest.split(",")] if rest else []
    if op.startswith(("ST", "BRA", "BAR", "EXIT")):
        dst, src = [], parts
    elif op.startswith(("ISETP", "DSETP", "FSETP", "PLOP3")):
        dst = [p for p in parts[:2] if re.fullmatch(r"!?U?P\w", p)]
        src = parts[len(dst):]
    else:
        dst, src = parts[:1], parts[1:]

    def regs(tok):
        out = []
        for r in _REG.finditer(tok):
            out.append(r.group(1))
            if (pair or r.group(2) or ".64" in op) and r.group(1).startswith("R"):
                out.append(f"R{int(r.group(1)[1:]) + 1}")
        return out
    return op, kind, [r for d in dst for r in regs(d)], srcs + [r for p in src for r in regs(p)]


def loads_first(path: list[str]) -> tuple[int, int]:
    """``(loads issued before the first read of a loaded register, loads)``."""
    loaded, first, total = set(), None, 0
    for s in path:
        op, kind, dst, src = _parse(s)
        if kind == "load":
            loaded.update(dst)
            total += 1
        elif first is None and loaded & set(src):
            first = total
    return (total if first is None else first), total


def modelled_cycles(path: list[str], load_latency: int, ahead: bool = False) -> int:
    """One warp issuing ``path`` in order (see the module's docstring). ``ahead`` (the
    ``ONCHIP`` loop, whose loads are the next diagonal's): a load's result is not waited
    for in the pass that issues it (neither by a barrier, which does not wait for a
    register's load, nor at the end), and a diagonal takes at least one load latency."""
    latency = dict(LATENCY, load=load_latency)
    ready, t, loaded = {}, 0, set()
    for s in path:
        op, kind, dst, src = _parse(s)
        start = max([t] + [ready.get(r, 0) for r in src])
        if kind == "bar":
            start = max([start, *(v for r, v in ready.items() if r not in loaded)])
        t = start + (2 if kind == "dp" else 1)
        for r in dst:
            ready[r] = start + latency[kind]
            if ahead:
                (loaded.add if kind == "load" else loaded.discard)(r)
    if ahead:
        return max([t, load_latency, *(v for r, v in ready.items() if r not in loaded)])
    return max([t, *ready.values()])


def analyse(sm: int, U1_list, load_latency: int, onchip: bool = False):
    """Rows ``(topology, U+1, loop (1 or 2, code order), loads first, loads, instructions, float64 ops,
    modelled cycles, registers, stack, spills in loops)``: the workspace pass, or with ``onchip`` compiled
    with ``ONCHIP`` (the state in registers, where the grid's U + 1 fits one block of
    lanes), whose loads are the next diagonal's (``modelled_cycles``'s ``ahead``)."""
    from rnnt_lattice.gpu import kernels
    for label, shape, name, const, warps, stages, *_ in kr.variants([1024]):
        if name != "_lattice_kernel" or int(shape.split("=")[1]) not in U1_list:
            continue
        const = dict(const, ONCHIP=onchip)
        c = kr.compile_as_launched(kernels._lattice_kernel, const, warps, stages, sm)
        reg, stack = kr.resources(c.asm["cubin"])
        ins = sass_lines(c.asm["cubin"])
        for loop, (lo, hi) in enumerate(diagonal_loops(ins), 1):
            path = common_path(ins, lo, hi + 1)
            first, total = loads_first(path)
            dp = sum(_parse(s)[1] == "dp" for s in path)
            yield (label.split()[1], shape.split("=")[1], loop, first, total, len(path), dp,
                   modelled_cycles(path, load_latency, ahead=onchip), reg, stack,
                   loop_spills(ins))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sm", type=int, default=90)
    ap.add_argument("--U1", type=int, nargs="*", default=[41, 81, 151],
                    help="U + 1 of the BLOCK_U buckets compiled")
    ap.add_argument("--load-latency", type=int, default=LATENCY["load"],
                    help="cycles of a global load in the model")
    ap.add_argument("--onchip", action="store_true",
                    help="the state in registers (gpu.LATTICE_ONCHIP, the default where U+1 "
                         "fits a block of lanes) instead of the workspace pass")
    args = ap.parse_args(argv)
    print(f"triton {triton.__version__}, sm_{args.sm}, the lattice kernel's diagonal loop "
          f"(model: a load {args.load_latency} cycles"
          f"{'; ONCHIP: the loads are the next diagonal' + chr(39) + 's' if args.onchip else ''})")
    print("| topology | U+1 | loop | loads first / loads | instructions (float64) "
          "| modelled cycles a diagonal | registers | stack | spills in loops |")
    print("|---|---|---|---|---|---|---|---|---|")
    for topo, U1, loop, first, total, n, dp, cycles, reg, stack, spills in analyse(
            args.sm, args.U1, args.load_latency, args.onchip):
        print(f"| {topo} | {U1} | {loop} | {first} / {total} | {n} ({dp}) | {cycles} "
              f"| {reg} | {stack} | {spills} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
