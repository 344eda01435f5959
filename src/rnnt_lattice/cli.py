"""The ``rnnt-lattice`` command (also ``python -m rnnt_lattice``).

    rnnt-lattice demo  [--steps N] [--out DIR] [--device D] [--threads N] [--seed S]
                       [--pruned [--window R] | --fused [--tile ROWS_OR_BYTES]]
    rnnt-lattice warmup [--dtype float32 float64] [--serial] [--list] [--only CALL ...]
                        [--jobs N]
    rnnt-lattice plot FILE [--out PNG_OR_SVG] [--index B] [--blank K] [--log-probs]
                      [--rnnt-type regular|modified|constrained|one_sym_per_frame]
    rnnt-lattice check [--device cpu|cuda] [--quick] [--json FILE] [--jobs N]

Errors in the user's input print one line ``rnnt-lattice: error: ...`` and exit with
status 2, without a traceback.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from ._cli_util import check_output_file, positive_int

PLOT_FILE_HELP = """\
FILE is a torch.save'd dict with the keys:
  logits          (B, T, U+1, V) or (T, U+1, V) float tensor: joiner output
                  (raw scores; with --log-probs: log-probabilities)
  targets         (B, U) or (U,) int tensor of label ids
  logit_lengths   optional (B,) int tensor (default: all T)
  target_lengths  optional (B,) int tensor (default: all U)
  blank           optional int blank id (default -1, the last class; --blank overrides)
  labels          optional list of V strings naming the classes (tick text)
"""


class UserError(Exception):
    """A problem with the user's input: reported as one line, no traceback."""


def _build_parser() -> argparse.ArgumentParser:
    from . import __version__
    p = argparse.ArgumentParser(
        prog="rnnt-lattice",
        description="RNN-T lattice tools: a training demo, lattice pictures, kernel warm-up, "
                    "a check of the kernels on this machine.")
    p.add_argument("--version", action="version", version=f"rnnt-lattice {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    d = sub.add_parser("demo", help="train a small transducer on a synthetic task (~1 min on 2 cores) "
                                    "and write lattice pictures, coverage table, loss curve, metrics",
                       description="Train a small transducer on synthetic spoken digits with "
                                   "rnnt_lattice.rnnt_loss; write pictures and metrics to --out.")
    from .demo import add_arguments
    add_arguments(d)

    pl = sub.add_parser("plot", help="draw node occupancy and the best path of saved logits",
                        description="Draw node occupancy and the best path for logits and "
                                    "targets saved with torch.save.",
                        epilog=PLOT_FILE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    pl.add_argument("file", help="a .pt file written by torch.save (see below)")
    pl.add_argument("--out", default=None, help="output .png or .svg (default: FILE with .png)")
    pl.add_argument("--index", type=int, default=0, help="which sequence of the batch (default 0)")
    pl.add_argument("--blank", type=int, default=None, help="blank id (overrides the file's)")
    pl.add_argument("--log-probs", action="store_true",
                    help="logits are already log-probabilities (fused_log_softmax=False)")
    from .topology import RNNT_TYPES
    pl.add_argument("--rnnt-type", choices=RNNT_TYPES, default="regular",
                    help="the lattice, as rnnt_loss's rnnt_type (default regular)")

    w = sub.add_parser("warmup", help="compile every CPU kernel once (Numba), so that the first "
                                      "training step does not wait for it",
                       description="Compile (or load from Numba's disk cache) every CPU kernel "
                                   "of the public functions, with a line per kernel as it is "
                                   "done. With an empty cache this takes about 30 s on 2 "
                                   "cores; later processes load the kernels in a second or two.")
    w.add_argument("--dtype", nargs="+", choices=("float32", "float64"), default=["float32"],
                   help="logits dtypes to compile for (default float32; float16 and bfloat16 "
                        "run the float32 kernels)")
    w.add_argument("--serial", action="store_true",
                   help="no effect, kept for scripts: the runs without threads "
                        "(RNNT_LATTICE_NUMBA_PARALLEL=0, forked DataLoader workers) use the "
                        "same compiled kernels")
    w.add_argument("--only", nargs="+", choices=[c for c, _ in WARMUP_CALLS], default=None,
                   metavar="CALL", help="only these calls: " + ", ".join(c for c, _ in WARMUP_CALLS))
    w.add_argument("--list", action="store_true",
                   help="list the calls and the kernels each compiles, and compile nothing")
    w.add_argument("--jobs", type=positive_int, default=1, metavar="N",
                   help="compile in N worker processes at once, which share the disk "
                        "cache; each call's lines are printed when it is done (default: "
                        "1, this process)")

    c = sub.add_parser("check", help="check every kernel on this machine against the float64 "
                                     "reference, and print a report for bug reports",
                       description="Run every kernel family of the device's backend (Numba "
                                   "on CPU, Triton on CUDA) against the float64 PyTorch "
                                   "backend on small cases, losses and gradients; on CUDA "
                                   "also no host synchronisation, CUDA-graph replay and peak "
                                   "memory; time one standard shape. Prints PASS/FAIL per "
                                   "check and a block to paste into a bug report; exits 1 "
                                   "if any check fails.")
    c.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="device to check (default: cuda if available, else cpu)")
    c.add_argument("--quick", action="store_true",
                   help="float32 and one tiny shape only (seconds once the kernels are compiled)")
    c.add_argument("--json", default=None, metavar="FILE",
                   help="also write the results as JSON to FILE")
    c.add_argument("--jobs", type=positive_int, default=1, metavar="N",
                   help="run the checks in N worker processes at once (on a GPU a first "
                        "run is mostly compiling, which they do side by side); the same lines, in "
                        "the same order (default: 1, this process)")
    p.set_defaults(commands={"demo": d, "plot": pl, "warmup": w, "check": c})
    return p


def _load_plot_input(path: str) -> dict:
    import torch
    if not os.path.exists(path):
        raise UserError(f"{path}: no such file")
    if os.path.isdir(path):
        raise UserError(f"{path}: is a directory, expected a file written by torch.save")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:   # torch raises several types for a non-torch file
        text = str(err)
        if "Weights only load failed" in text:
            # A torch.save file holding an object that is not plain data: torch names it in
            # its "Unsupported global: GLOBAL <name>" line.
            found = re.search(r"GLOBAL ([\w.]+)", text)
            what = f" ({found.group(1)})" if found else ""
            raise UserError(f"{path}: holds an object{what} that is not a tensor, number, "
                            f"string, list or dict, which this command does not load "
                            f"(torch.load(weights_only=True)); save only the keys that "
                            f"'rnnt-lattice plot --help' lists") from None
        raise UserError(f"{path}: not a file written by torch.save ({type(err).__name__}"
                        + (f": {text.strip().splitlines()[0]})" if text.strip() else ")")
                        ) from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a dict with keys 'logits' and 'targets', "
                        f"got a {type(data).__name__}")
    missing = [k for k in ("logits", "targets") if k not in data]
    if missing:
        raise UserError(f"{path}: missing key(s) {', '.join(repr(k) for k in missing)}; "
                        f"found {sorted(map(str, data))}. See 'rnnt-lattice plot --help'.")
    return data


def _describe(x) -> str:
    import torch
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"{type(x).__name__} {x!r}" if isinstance(x, (int, float, str)) else type(x).__name__


def _is_int_tensor(x) -> bool:
    import torch
    return (isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex()
            and x.dtype != torch.bool)


def _lengths(key: str, x, B: int, default: int):
    """The optional ``(B,)`` lengths ``key`` of the file: an int tensor, an int or a list of ints."""
    import torch
    if x is None:
        return torch.full((B,), default, dtype=torch.int64)
    if not isinstance(x, torch.Tensor):
        ok = (isinstance(x, int) and not isinstance(x, bool)) or (
            isinstance(x, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in x))
        if not ok:
            raise UserError(f"'{key}' must be an int tensor of shape ({B},) or a list of ints, "
                            f"got {_describe(x)}")
        x = torch.tensor(x, dtype=torch.int64)
    if not _is_int_tensor(x):
        raise UserError(f"'{key}' must be an int tensor of shape ({B},), got {_describe(x)}")
    return x.reshape(-1) if x.dim() == 0 else x


def _plot_inputs(data: dict, blank_override):
    import torch
    logits, targets = data["logits"], data["targets"]
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise UserError("'logits' must be a float tensor of shape (B, T, U+1, V) or (T, U+1, V), "
                        f"got {_describe(logits)}")
    if not _is_int_tensor(targets):
        raise UserError(f"'targets' must be an int tensor of shape (B, U) or (U,), got {_describe(targets)}")
    if logits.dim() == 3 and targets.dim() == 1:
        logits, targets = logits[None], targets[None]
    if logits.dim() != 4 or targets.dim() != 2:
        raise UserError(f"'logits' {tuple(logits.shape)} and 'targets' {tuple(targets.shape)} must "
                        f"be (B, T, U+1, V) and (B, U), or (T, U+1, V) and (U,)")
    B, T, U1, V = logits.shape
    lengths = {key: _lengths(key, data.get(key), B, default)
               for key, default in (("logit_lengths", T), ("target_lengths", U1 - 1))}
    blank = blank_override if blank_override is not None else data.get("blank", -1)
    if isinstance(blank, torch.Tensor):
        if not _is_int_tensor(blank) or blank.numel() != 1:
            raise UserError(f"'blank' must be an int or a one-element int tensor, got {_describe(blank)}")
        blank = int(blank)
    if isinstance(blank, bool) or not isinstance(blank, int):
        raise UserError(f"'blank' must be an int, got {_describe(blank)}")
    labels = data.get("labels")
    if labels is not None and not isinstance(labels, (list, tuple)):
        raise UserError(f"'labels' must be a list of V = {V} names, got {_describe(labels)}")
    if labels is not None and len(labels) != V:
        raise UserError(f"'labels' has {len(labels)} names but logits have V = {V} classes")
    return logits, targets.to(torch.int64), lengths["logit_lengths"], lengths["target_lengths"], blank, labels


def _cmd_plot(args) -> int:
    data = _load_plot_input(args.file)
    logits, targets, tl, ul, blank, labels = _plot_inputs(data, args.blank)
    if not 0 <= args.index < logits.shape[0]:
        raise UserError(f"--index {args.index} is outside the batch of {logits.shape[0]} "
                        f"sequence(s) in {args.file}")
    out = args.out or os.path.splitext(args.file)[0] + ".png"
    if os.path.splitext(out)[1].lower() not in (".png", ".svg"):
        raise UserError(f"--out must end in .png or .svg, got {out!r}")
    check_output_file(out, "--out")
    import rnnt_lattice

    from .plot import plot_occupancy, save
    fused = not args.log_probs
    try:
        occ = rnnt_lattice.occupancy(logits, targets, tl, ul, blank, fused,
                                     rnnt_type=args.rnnt_type)
        ali = rnnt_lattice.best_alignment(logits, targets, tl, ul, blank, fused,
                                          rnnt_type=args.rnnt_type)
        names = None
        if labels is not None:
            names = [str(labels[int(k)]) for k in targets[args.index, : int(ul[args.index])]]
        ll = float(occ.log_likelihood[args.index])
        fig, _ = plot_occupancy(occ, args.index, ali, labels=names,
                                title=f"{os.path.basename(args.file)}[{args.index}]: log P = {ll:.3f}")
    except ValueError as err:
        raise UserError(f"{args.file}: {err}") from None
    b = args.index
    if ll != ll:
        _warn(f"sequence {b} has log P = NaN (a NaN or inf among its logits): the picture "
              f"shows NaN occupancies")
    elif ll == float("-inf"):
        _warn(f"sequence {b} has no path through its lattice (log P = -inf): every "
              f"occupancy is 0")
    if args.log_probs:
        rows = logits[b, : int(tl[b]), : int(ul[b]) + 1].double().logsumexp(-1)
        worst = float(rows.abs().max()) if rows.numel() else 0.0
        if worst > 1e-3:
            _warn(f"--log-probs: the rows of sequence {b} are not log-probabilities (their "
                  f"log-sum-exp reaches {worst:.3g}, not 0); drop --log-probs for raw scores")
    try:
        save(fig, out)
    except OSError as err:
        raise UserError(f"--out {out!r}: cannot write ({err.strerror or err})") from None
    print(f"wrote {out}  (log P = {ll:.4f}, best path log-prob = {float(ali.log_prob[args.index]):.4f})")
    return 0


def _warn(message: str) -> None:
    print(f"rnnt-lattice: warning: {message}", file=sys.stderr)


# The calls ``rnnt-lattice warmup`` makes, each on a tiny problem, and the CPU kernels
# (the ``@pjit`` kernels of ``rnnt_lattice.cpu``'s modules) whose specialisations they
# compile: together every kernel that a public function runs. (``tests/test_cli.py``
# holds this list to the kernels.)
WARMUP_CALLS = [
    ("rnnt_loss", ("regular_row_pass", "lattice", "regular_grad_rows")),
    ("tdt_loss", ("row_pass", "lattice", "grad_rows")),
    ("best_alignment", ("row_pass", "viterbi")),
    ("prune_ranges", ("window_dp",)),
    ("rnnt_loss_smoothed", ("simple_rows_forward", "arc_terms_forward", "lattice",
                            "arc_terms_backward", "simple_rows_backward")),
]
# The calls whose kernels read float64 whatever the logits' dtype: warmed up once.
DTYPE_FREE_CALLS = ("prune_ranges",)


def _warmup_call(name: str, dtype):
    """Runs ``name`` (a key of ``WARMUP_CALLS``) once on a tiny problem in ``dtype``."""
    import torch

    import rnnt_lattice
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 7, generator=g, dtype=dtype, requires_grad=True)
    args = (torch.tensor([[1, 2], [2, 1]]), torch.tensor([5, 4]), torch.tensor([2, 1]))
    if name == "rnnt_loss":
        rnnt_lattice.rnnt_loss(x, *args, blank=0, backend="numba").backward()
    elif name == "tdt_loss":
        rnnt_lattice.tdt_loss(x, *args, blank=-1, durations=[0, 1, 2], backend="numba").backward()
    elif name == "best_alignment":
        rnnt_lattice.best_alignment(x.detach(), *args, blank=0, backend="numba")
    elif name == "rnnt_loss_smoothed":
        lm = torch.randn(2, 3, 7, generator=g, dtype=dtype, requires_grad=True)
        am = torch.randn(2, 5, 7, generator=g, dtype=dtype, requires_grad=True)
        rnnt_lattice.rnnt_loss_smoothed(lm, am, *args, blank=0, lm_only_scale=0.25,
                                        am_only_scale=0.0, backend="numba").backward()
    else:
        occ = torch.rand(2, 5, 3, generator=g, dtype=torch.float64)
        rnnt_lattice.prune_ranges((occ, occ), 2, logit_lengths=args[1], target_lengths=args[2])


def _warmup_units(args) -> list:
    """The warmup's work, ``(parallel, dtype, call)`` a unit, in the order one process
    runs it: each variant, each dtype, each call (a dtype-free call once)."""
    from .cpu import _config
    units = []
    for i, dtype in enumerate(args.dtype):
        units += [(_config.PARALLEL, dtype, call) for call, _ in WARMUP_CALLS
                  if (args.only is None or call in args.only)
                  and not (i and call in DTYPE_FREE_CALLS)]
    return units


def _warmup_unit(unit, say) -> None:
    """Runs one unit of ``_warmup_units``: its line, then ``say`` gets a line per kernel
    it compiled (or loaded from the disk cache)."""
    import torch

    from .cpu import _config
    parallel, dtype, call = unit
    serial = "" if parallel else ", serial"
    say(f"{call} ({'any dtype' if call in DTYPE_FREE_CALLS else dtype}{serial}) ...")

    def report(kernel, variant, _dtype, seconds, from_cache):
        # (_dtype: of the kernel's first argument, not the logits': the call's line says it)
        how = "loaded from the disk cache" if from_cache else "compiled"
        say(f"  {kernel} ({variant}): {how} in {seconds:.1f} s")

    saved = _config.ON_COMPILE, _config.PARALLEL
    _config.ON_COMPILE, _config.PARALLEL = report, parallel
    try:
        _warmup_call(call, getattr(torch, dtype))
    finally:
        _config.ON_COMPILE, _config.PARALLEL = saved


def _warmup_unit_lines(unit) -> list:
    """``_warmup_unit`` in a worker process (``--jobs``): its lines, returned."""
    lines: list = []
    _warmup_unit(unit, lines.append)
    return lines


def _warmup_next(pending: list, running: list):
    """The unit of ``pending`` to start next beside the ``running`` ones: the first that
    runs none of their kernels, else None: it waits, and loads what they made from the
    cache once it is there, instead of compiling it a second time at once. (Whatever the
    dtypes: ``lattice``, ``viterbi`` and three of the simple losses' kernels take float64
    arguments whatever the logits, so one specialisation serves both.)"""
    def keys(unit) -> set:
        return set(dict(WARMUP_CALLS)[unit[2]])

    busy = set().union(*map(keys, running))
    return next((u for u in pending if not keys(u) & busy), None)


def _warmup_in_workers(units: list, jobs: int, say) -> None:
    """The units run by ``jobs`` spawned processes, which share the disk cache (each
    specialisation its own file: docs/api.md, "Compiled-kernel cache"). A unit's lines are
    said together when it is done. A unit does not start beside a running one that runs
    one of its kernels (``_warmup_next``): it loads that kernel from
    the cache later instead of compiling it a second time (``lattice``, shared by
    ``rnnt_loss``, ``tdt_loss`` and the simple losses, is the longest of them).
    On 2 cores, with an empty cache, 2 processes took 21.1 s where one took 29.3, and
    32.6 s where one took 41.5 with ``--dtype float32 float64``."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    pending, running = list(units), {}
    try:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            while pending or running:
                while len(running) < jobs and \
                        (unit := _warmup_next(pending, list(running.values()))) is not None:
                    pending.remove(unit)
                    running[pool.submit(_warmup_unit_lines, unit)] = unit
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in [f for f in running if f in done]:   # (in submission order)
                    del running[future]
                    for line in future.result():
                        say(line)
    except BrokenProcessPool as err:
        raise UserError(f"--jobs: a warmup worker process died ({err}); run it again, or "
                        f"without --jobs") from None


def _cmd_warmup(args) -> int:
    import time
    if args.list:
        for call, kernels in WARMUP_CALLS:
            if args.only is None or call in args.only:
                print(f"{call}: {', '.join(kernels)}")
        return 0
    try:
        from .cpu import _config
    except ImportError as err:
        raise UserError(f"the CPU backend needs numba ({err})") from None

    def say(line: str) -> None:
        print(line, flush=True)

    units = _warmup_units(args)
    jobs = min(args.jobs, len(units))
    start = time.perf_counter()
    if jobs > 1:
        try:
            _warmup_in_workers(units, jobs, say)
        except (OSError, ImportError) as err:     # no processes or semaphores here
            say(f"--jobs {jobs}: no worker processes here ({type(err).__name__}: {err}); "
                f"compiling in this process")
            jobs = 1
    if jobs == 1:
        for unit in units:
            _warmup_unit(unit, say)
    how = f", {jobs} processes" if jobs > 1 else ""
    print(f"warmup done in {time.perf_counter() - start:.1f} s{how} (kernel cache: "
          f"{_cache_place(_config)})")
    return 0


def _cache_place(_config) -> str:
    """Where Numba keeps the compiled kernels: the folder its locator chose for them."""
    if not _config.CACHE:
        if _config.SHIPPED:
            return (f"read-only: kernels are loaded from {_config.SHIPPED}, nothing was "
                    f"kept, and the next process compiles again those it lacks; no writable "
                    f"folder (NUMBA_CACHE_DIR sets one)")
        return ("off: nothing was kept, the next process compiles again; "
                "RNNT_LATTICE_NUMBA_CACHE=0, or no writable folder for it")
    from .cpu import kernels
    try:                    # Numba's cache object of one kernel (not a public attribute)
        return kernels.row_pass.serial._cache._cache_path
    except AttributeError:
        return "on disk (NUMBA_CACHE_DIR, else next to the package, else ~/.cache/numba)"


def _cmd_check(args) -> int:
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device cuda: no CUDA device is available to this torch "
                        f"({torch.__version__}, CUDA build {torch.version.cuda}); use --device cpu")
    if args.json is not None:
        check_output_file(args.json, "--json")
    from .selfcheck import run
    return run(device, tier="quick" if args.quick else "default", json_path=args.json,
               jobs=args.jobs)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:       # refused by the command's own parser: its usage, not the top level's
            parser.get_default("commands").get(args.command, parser).error(
                f"unrecognized arguments: {' '.join(extra)}")
        if args.command == "demo":
            from .demo import main_from_args
            return main_from_args(args)
        if args.command == "plot":
            return _cmd_plot(args)
        if args.command == "warmup":
            return _cmd_warmup(args)
        if args.command == "check":
            return _cmd_check(args)
        parser.print_help(sys.stderr)
        print("rnnt-lattice: error: give a command (demo, plot, warmup or check)",
              file=sys.stderr)
        return 2
    except (UserError, ValueError) as err:
        print(f"rnnt-lattice: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rnnt-lattice: interrupted", file=sys.stderr)
        return 130
    except ImportError as err:
        print(f"rnnt-lattice: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:       # a file the user named could not be written or read
        print(f"rnnt-lattice: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":   # pragma: no cover
    sys.exit(main())
