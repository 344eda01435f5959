"""Page faults of a CPU training loop, and what the kept lattice workspaces save
(docs/benchmarks.md, "Page faults, huge pages and the reused buffers").

    python benchmarks/page_faults.py [--shapes s3 s4] [--variants regular tdt multiblank]
                                     [--loops freed kept] [--threads 2] [--rounds 10] [--steps 5]

Each case runs in a fresh process: whether freed memory goes back to the system depends on
what the process allocated before (glibc raises its mmap threshold to the size of the blocks
it has freed, and returns the top of its heap once more than twice that is free), so a loop
after other work can fault less than the same loop in a new process. The process takes
forward+backward steps on the same logits through the public loss of the variant, the
gradient dropped after each step (the gradient buffer is reused throughout), and counts per
step the minor page faults (``getrusage``), the process's CPU time and the wall time.

Two ways of allocating the O(B*T*(U+1)) arrays of a call (row statistics, arc weights,
alpha, beta, occupations) alternate in the process, ``--rounds`` times ``--steps`` steps
each (after 2 steps not counted), so that the machine's drift falls on both alike:
``workspaces``, the kept blocks (``cpu._Workspaces``, the library's default), and ``anew``,
every array allocated in every call (the blocks' size threshold raised above any call).
Two ways of running the loop (``--loops``): ``freed``, each step's loss dropped before the
next step (a loop inside a function), and ``kept``, the previous loss still bound while
the next forward runs (a loop that rebinds ``loss``: its graph holds the previous step's
arrays). ``--threads 1`` runs the kernels in the calling thread
(``RNNT_LATTICE_NUMBA_PARALLEL=0``).
The variant ``pruned`` (on the pruned shapes: ``--shapes p1 p2 --variants pruned --loops
freed``) is k2's recipe, ``pruned_pipeline.py``'s step with R = 5 (the smoothed loss, the
windows, ``do_rnnt_pruning``, the joiner ``am + lm``, the pruned loss, one backward); it
adds ``do_rnnt_pruning``'s rows of lm to the kept blocks (``anew``: PyTorch's
``index_select``, as before they were kept). Its step runs its own backward, so its two
loops differ only by the step's detached record.
Prints the medians per step and the ratio workspaces / anew; writes
``results/page_faults/cpu-page-faults-<commit>-t<threads>.{csv,json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MODES = ("workspaces", "anew")
LOOPS = ("freed", "kept")
PRUNED_R = 5                   # the windows of the pruned variant's step


def child(shape: str, variant: str, loop: str, rounds: int, steps: int,
          anew: str = "all") -> dict:
    """One case in this process, both ways of allocating in turn: ``{mode: {"faults": per
    step, "cpu_ms": median, "wall_ms": median}}``."""
    import shapes as registry
    from rnnt_lattice import cpu, torch_backend

    held = []
    if variant == "pruned":
        import pruned_pipeline
        joint = registry.make_joiner_inputs(registry.SHAPES[shape])
        am, lm = pruned_pipeline.leaves(joint)
        pipeline = pruned_pipeline.PIPELINES["rnnt_lattice (k2)"].load()

        def step():
            out = pruned_pipeline.run_step(pipeline, joint, PRUNED_R, am, lm)
            held[:] = [out] if loop == "kept" else []
    else:
        inp = registry.make_inputs(registry.SHAPES[shape], variant=variant)
        x = inp.logits.clone().requires_grad_(True)

        def step():
            loss = registry.variant_loss(variant, x, inp.targets, inp.logit_lengths,
                                         inp.target_lengths, inp.blank)
            loss.sum().backward()
            x.grad = None
            held[:] = [loss] if loop == "kept" else []

    default, kept_rows = cpu._Workspaces.MIN_BYTES, cpu.rows_select
    samples = {m: {"faults": 0, "cpu_s": [], "wall_s": []} for m in MODES}
    try:
        for _ in range(3):
            step()
        for _ in range(rounds):
            for mode in MODES:
                off = mode == "anew"
                cpu._Workspaces.MIN_BYTES = float("inf") if off and anew == "all" else default
                cpu.rows_select = torch_backend.rows_select if off else kept_rows
                step()
                step()
                got = samples[mode]
                faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                for _ in range(steps):
                    t, p = time.perf_counter(), time.process_time()
                    step()
                    got["wall_s"].append(time.perf_counter() - t)
                    got["cpu_s"].append(time.process_time() - p)
                got["faults"] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    finally:
        cpu._Workspaces.MIN_BYTES, cpu.rows_select = default, kept_rows
    return {m: {"faults": got["faults"] / len(got["wall_s"]),
                "cpu_ms": 1e3 * statistics.median(got["cpu_s"]),
                "wall_ms": 1e3 * statistics.median(got["wall_s"])}
            for m, got in samples.items()}


def run_child(args, shape: str, variant: str, loop: str) -> dict:
    env = dict(os.environ)
    if args.threads == 1:
        env["RNNT_LATTICE_NUMBA_PARALLEL"] = "0"
    p = subprocess.run([sys.executable, __file__, "--child", shape, variant, loop,
                        str(args.rounds), str(args.steps), args.anew], env=env, capture_output=True,
                       text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{shape} {variant} {loop}: {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["s3", "s4"])
    ap.add_argument("--variants", nargs="+", default=["regular", "tdt", "multiblank"])
    ap.add_argument("--loops", nargs="+", choices=LOOPS, default=list(LOOPS))
    ap.add_argument("--threads", type=int, choices=[1, 2], default=2,
                    help="1: the kernels in the calling thread; 2: on Numba's threads (its default)")
    ap.add_argument("--rounds", type=int, default=10, help="turns of each way of allocating")
    ap.add_argument("--steps", type=int, default=5, help="steps counted per turn")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--anew", choices=["all", "rows"], default="all",
                    help="what the 'anew' mode allocates anew: every kept array, or only "
                         "do_rnnt_pruning's rows (the pruned variant's)")
    ap.add_argument("--child", nargs=6,
                    metavar=("SHAPE", "VARIANT", "LOOP", "ROUNDS", "STEPS", "ANEW"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        shape, variant, loop, rounds, steps, anew = args.child
        print(json.dumps(child(shape, variant, loop, int(rounds), int(steps), anew)))
        return 0

    import common
    rows, table = [], []
    for shape in args.shapes:
        for variant in args.variants:
            for loop in args.loops:
                med = run_child(args, shape, variant, loop)
                ws, anew = med["workspaces"], med["anew"]
                rows.append(dict(shape=shape, variant=variant, loop=loop, threads=args.threads,
                                 **{f"{m}_{k}": v for m in MODES for k, v in med[m].items()}))
                table.append([shape, variant, loop,
                              f"{anew['faults']:.0f} -> {ws['faults']:.0f}",
                              f"{anew['wall_ms']:.2f} -> {ws['wall_ms']:.2f} "
                              f"(x{ws['wall_ms'] / anew['wall_ms']:.2f})",
                              f"{anew['cpu_ms']:.2f} -> {ws['cpu_ms']:.2f} "
                              f"(x{ws['cpu_ms'] / anew['cpu_ms']:.2f})"])
                print(" | ".join(table[-1]), flush=True)
    header = ["shape", "variant", "loop", "page faults a step: anew -> workspaces",
              "wall ms a step (median)", f"CPU ms a step (median, {args.threads} thread(s))"]
    md = common.md_table(header, table)
    print(md)
    meta = dict(common.machine_info(), threads=args.threads, anew=args.anew)
    stem = f"cpu-page-faults-{meta['git_commit']}-t{args.threads}"
    if "pruned" in args.variants:
        stem += f"-pruned-anew-{args.anew}"
    paths = common.write_results(stem, meta, rows, md,
                                 out_dir=args.out_dir or common.RESULTS / "page_faults")
    print("wrote", ", ".join(paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
