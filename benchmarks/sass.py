"""A cubin's SASS read as text, without a GPU: its instructions with branch targets as
addresses (Triton's ``nvdisasm``), and where its spills are. Shared by
``kernel_resources.py``, ``lattice_sass.py`` and ``row_sass.py``; importing it changes
nothing of the process (those scripts set the compiled kernels' environment themselves),
so that the suite can test it beside the Triton interpreter."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile


def sass_lines(cubin: bytes) -> list[tuple[int, str]]:
    """``(address, instruction)`` of a cubin's one kernel (``nvdisasm``), branch targets
    as addresses."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    ins, labels, pending = [], {}, []
    for line in text.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            addr = int(m.group(1), 16)
            labels.update({p: addr for p in pending})
            pending = []
            ins.append((addr, m.group(2).strip()))
    return [(a, re.sub(r"`\((\.L_x_\d+)\)", lambda m: hex(labels[m.group(1)]), s))
            for a, s in ins]


def branch_target(s: str) -> int | None:
    """The address a branch instruction of :func:`sass_lines` jumps to; None for any other."""
    m = re.search(r"\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)", s)
    return int(m.group(1), 16) if m else None


def _local_accesses(ins) -> dict:
    """``{op: (inside a loop, all)}`` of the local loads and stores (``LDL``, ``STL``) of the
    SASS instructions ``ins`` (``(address, text)``, branch targets as addresses:
    :func:`sass_lines`); a loop is the span between a backward branch and its target."""
    loops = [(t, a) for a, s in ins if (t := branch_target(s)) is not None and t < a]
    counts = {}
    for op in ("LDL", "STL"):
        at = [a for a, s in ins if re.search(rf"\b{op}\b", s)]
        counts[op] = (sum(any(lo <= a <= hi for lo, hi in loops) for a in at), len(at))
    return counts


def spills_in_loops(ins) -> str:
    """The local loads and stores of ``ins`` inside a loop out of all of them, as ``LDL 2/8,
    STL 0/4``. A spill outside the loops costs once a program; one in a loop, every turn of it."""
    return ", ".join(f"{op} {inside}/{every}" for op, (inside, every) in _local_accesses(ins).items())


def loop_spills(ins) -> int:
    """How many local loads and stores of ``ins`` lie inside a loop: 0 where a kernel has no
    stack frame, or one that costs once a program (a register saved across a call, a spill
    before or after the loops)."""
    return sum(inside for inside, _ in _local_accesses(ins).values())
