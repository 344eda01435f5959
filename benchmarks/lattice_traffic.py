"""The lattice pass's memory requests, counted on the kernel's own addresses (no GPU).

    python benchmarks/lattice_traffic.py [--shape s5] [--variants regular tdt multiblank]
                                         [--json FILE]

The lattice pass (``kernels._lattice_kernel``) is one program per sequence and direction
walking the anti-diagonals: its time is the latency of a diagonal times their number, and
a diagonal's latency grows with the memory requests its loads make. This runs the pass of
the shape's first sequence (its T and U; V is cut to a few classes, which the lattice never
reads) under the Triton interpreter on CPU tensors, records the address of every lane of
every load and store it issues, and counts them as sm_90 serves them: the lanes of a
``BLOCK_U`` vector are threads in order (``gpu._lattice_warps``: one lane a thread), 32 to a
warp, and one warp instruction requests each distinct 32-byte sector its active lanes touch
(a lane of an unpredicated gather, ``kernels._gather``, is active): 32 lanes of adjacent
float64s need 8 sectors, 32 lanes at a stride of U+1 float64s need 32.

Printed per variant, for the alpha and beta programs together: warp instructions of the
diagonal loops (loads, stores), the sectors they request, and sectors per instruction (on
average, and the most any one requested).
Run it on two trees (``PYTHONPATH=other/src``) to compare layouts; it models no cache and
no timing, only the requests the addresses imply. The grid's other kernels are not counted.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import common  # noqa: E402,F401  (thread env before torch)

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import shapes  # noqa: E402

WARP = 32
SECTOR = 32


class Recorder:
    """Counts the warp instructions and sectors of the interpreter's loads and stores while
    ``on`` (vectors: the diagonal loops; the scalar loads of the lengths and the start node
    are left out)."""

    def __init__(self):
        self.on = False
        self.counts = {"load": [0, 0, 0], "store": [0, 0, 0]}

    def record(self, kind: str, ptrs, mask) -> None:
        if not self.on:
            return
        addr = np.asarray(ptrs).reshape(-1).astype(np.uint64)
        live = np.broadcast_to(np.asarray(mask, dtype=bool), np.asarray(ptrs).shape).reshape(-1)
        if addr.size < 2:
            return
        c = self.counts[kind]
        for w in range(0, addr.size, WARP):
            sel = addr[w:w + WARP][live[w:w + WARP]]
            if sel.size:
                n = int(np.unique(sel // SECTOR).size)
                c[0] += 1
                c[1] += n
                c[2] = max(c[2], n)


def install(rec: Recorder) -> None:
    """Wraps the interpreter's memory ops (every load and store of an interpreted kernel
    goes through these two)."""
    from triton.runtime import interpreter as itp
    cls = itp.InterpreterBuilder
    load, store = cls.create_masked_load, cls.create_masked_store

    def masked_load(self, ptrs, mask, other, *a, **k):
        rec.record("load", ptrs.data, mask.data)
        return load(self, ptrs, mask, other, *a, **k)

    def masked_store(self, ptrs, value, mask, *a, **k):
        rec.record("store", ptrs.data, mask.data)
        return store(self, ptrs, value, mask, *a, **k)

    cls.create_masked_load, cls.create_masked_store = masked_load, masked_store


def count(variant: str, T: int, U: int, rec: Recorder) -> dict:
    """The lattice pass's counts for one sequence of T frames and U labels of ``variant``."""
    from rnnt_lattice import gpu
    n_extra = {"tdt": len(shapes.TDT_DURATIONS), "multiblank": len(shapes.BIG_BLANK_DURATIONS)}
    V = 8 + n_extra.get(variant, 0)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, T, U + 1, V, generator=g).requires_grad_()   # beta too
    targets = torch.randint(1, 5, (1, U), generator=g, dtype=torch.int32)
    lengths = torch.tensor([T], dtype=torch.int32), torch.tensor([U], dtype=torch.int32)
    blank = 0 if variant == "regular" else (7 if variant == "tdt" else V - 1)
    lattice = gpu._lattice

    def recorded(*a, **k):
        rec.on = True
        try:
            return lattice(*a, **k)
        finally:
            rec.on = False

    rec.counts = {"load": [0, 0, 0], "store": [0, 0, 0]}
    gpu._lattice = recorded
    try:
        shapes.variant_loss(variant, logits, targets, *lengths, blank, backend="triton")
    finally:
        gpu._lattice = lattice
    out = {"T": T, "U": U, "block_u": gpu._block_u(U + 1),
           "warps": gpu._lattice_warps(gpu._block_u(U + 1))}
    for kind, (n, sectors, most) in rec.counts.items():
        out[kind] = {"instructions": n, "sectors": sectors, "most": most,
                     "sectors_per_instruction": round(sectors / n, 2) if n else 0.0}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="s5", choices=sorted(shapes.SHAPES))
    ap.add_argument("--variants", nargs="+", default=["regular", "tdt", "multiblank"],
                    choices=["regular", "modified", "tdt", "multiblank"])
    ap.add_argument("--json", default=None, help="also write the counts here")
    args = ap.parse_args(argv)
    sh = shapes.SHAPES[args.shape]
    rec = Recorder()
    install(rec)
    import rnnt_lattice
    print(f"lattice pass of one sequence of {args.shape} (T = {sh.T}, U = {sh.U}), "
          f"rnnt_lattice from {os.path.dirname(rnnt_lattice.__file__)}")
    print("| variant | lanes, warps | loads: warp instr. | sectors | per instr. (most) "
          "| stores: warp instr. | sectors | per instr. (most) |")
    print("|---|---|---|---|---|---|---|---|")
    results = {}
    for v in args.variants:
        r = results[v] = count(v, sh.T, sh.U, rec)
        ld, st = r["load"], r["store"]
        print(f"| {v} | {r['block_u']}, {r['warps']} | {ld['instructions']} | {ld['sectors']} "
              f"| {ld['sectors_per_instruction']} ({ld['most']}) | {st['instructions']} "
              f"| {st['sectors']} | {st['sectors_per_instruction']} ({st['most']}) |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "results": results,
                       "machine": common.machine_info()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
