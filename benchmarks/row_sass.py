"""The row pass's chunk loop as sm_90 compiles it, read from its SASS without a GPU.

    python benchmarks/row_sass.py [--sm 90] [--V 1024 1025]
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
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)      # compiled kernels, not interpreted

import torch  # noqa: E402
import triton  # noqa: E402

import kernel_resources as kr  # noqa: E402
from lattice_sass import _target, sass_lines  # noqa: E402


def chunk_loop(ins) -> list[str]:
    """The instructions of the smallest backward-branch loop that holds a 16-byte global
    load and an exp (``MUFU.EX2``): the token group's chunk loop (TDT's duration group has a
    loop of its own, of scalar loads)."""
    best = None
    for a, s in ins:
        tgt = _target(s)
        if tgt is None or tgt >= a:
            continue
        body = [x for b, x in ins if tgt <= b <= a]
        if any("LDG.E.128" in x for x in body) and any("MUFU.EX2" in x for x in body):
            if best is None or len(body) < len(best):
                best = body
    return best or []


def analyse(sm: int, V_list, topologies=("regular", "tdt", "multiblank")):
    """Rows ``(topology, V, lanes, registers, stack, loop instructions, loop shuffles,
    loop barriers, instructions in all)``."""
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
            yield (label.split()[1], V, lanes, reg, stack, len(loop),
                   sum("SHFL" in x for x in loop), sum(x.startswith("BAR") for x in loop),
                   len(ins))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sm", type=int, default=90)
    ap.add_argument("--V", type=int, nargs="*", default=[1024, 1025])
    args = ap.parse_args(argv)
    print(f"triton {triton.__version__}, sm_{args.sm}, the row pass's chunk loop "
          "(LANES 0: reduced across the row every chunk; 4: once a row)")
    print("| topology | V | LANES | registers | stack | loop instructions | loop shuffles "
          "| loop barriers | instructions in all |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in analyse(args.sm, args.V):
        print("| " + " | ".join(str(x) for x in row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
