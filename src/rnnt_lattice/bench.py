"""The benchmark registry (shapes, loss variants, cases), its seeded input factory, the
clocks and the one timing routine, the floors (exp pass on CPU, copy bandwidth on CUDA), the
thread setter, and ``rnnt-lattice bench``: rnnt_lattice against the machine's own exp
throughput.

This module is the one source of the benchmark cases and measurements: ``benchmarks/run.py``
(``--device cpu|cuda --mode floor|peers``, see docs/benchmarks.md) imports it, and so do the
command line and the demo (for :func:`set_threads`).
Shapes are ``(B, T, U, V)``: logits ``(B, T, U+1, V)``, targets ``(B, U)``. A benchmark case
is ``(shape, dtype, loss variant)`` (:class:`Case`); the variants are :data:`VARIANTS`.

    >>> from rnnt_lattice.bench import SHAPES, make_inputs
    >>> x = make_inputs(SHAPES["s2"], seed=0)
    >>> tuple(x.logits.shape)
    (4, 100, 21, 128)

Command line (``rnnt-lattice bench --help``)::

    rnnt-lattice bench                      # quick: s1 s2, numba backend, 2 threads
    rnnt-lattice bench --shapes core        # s2 s3 s4 s5 ragged (the issue's target shapes)
    rnnt-lattice bench --backends numba torch --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

# Every provider is called with the same blank. 0 is the id all peers accept, and targets
# are drawn from 1..V-1 so they never hit it.
BLANK = 0


@dataclass(frozen=True)
class Shape:
    """One benchmark case. ``T_range``/``U_range`` make it ragged: per-sequence lengths
    are drawn uniformly (inclusive) and the batch is padded to the longest drawn length,
    as a real data loader would."""
    name: str
    B: int
    T: int
    U: int
    V: int
    dtype: torch.dtype = torch.float32
    T_range: Optional[Tuple[int, int]] = None
    U_range: Optional[Tuple[int, int]] = None

    @property
    def ragged(self) -> bool:
        return self.T_range is not None

    def describe(self) -> str:
        t = f"{self.T_range[0]}..{self.T_range[1]}" if self.T_range else str(self.T)
        u = f"{self.U_range[0]}..{self.U_range[1]}" if self.U_range else str(self.U)
        d = "" if self.dtype == torch.float32 else f" {str(self.dtype).replace('torch.', '')}"
        return f"B={self.B} T={t} U={u} V={self.V}{d}"

    @property
    def elements(self) -> int:
        """Logit elements of the padded ``(B, T, U+1, V)`` tensor (upper bound for ragged)."""
        return self.B * self.T * (self.U + 1) * self.V


SHAPES = {s.name: s for s in (
    Shape("s1", 1, 50, 10, 30),
    Shape("s2", 4, 100, 20, 128),
    Shape("s3", 8, 150, 40, 256),
    Shape("s4", 16, 200, 50, 512),
    Shape("s5", 8, 400, 80, 1024),
    # T and U are the padded maxima; the drawn lengths fix the actual padding.
    Shape("ragged", 8, 300, 60, 500, T_range=(150, 300), U_range=(30, 60)),
    Shape("s1_f64", 1, 50, 10, 30, dtype=torch.float64),
    # GPU-sized: a large ragged training batch, and a large vocabulary.
    Shape("big", 32, 400, 100, 1024, T_range=(200, 400), U_range=(50, 100)),
    Shape("v5000", 8, 300, 60, 5000, T_range=(150, 300), U_range=(30, 60)),
    # The pruned pipeline (run.py --mode pruned): the joiner's two halves am (B, T, V) and
    # lm (B, U+1, V), never the (B, T, U+1, V) logits except for the full-loss rows.
    # CPU-sized: 2 cores finish all three in minutes; "pv5000" has a large vocabulary.
    Shape("p1", 8, 150, 40, 500),
    Shape("p2", 16, 200, 60, 1000),
    Shape("pv5000", 4, 150, 40, 5000),
    # The GPU table.
    Shape("pg1", 32, 400, 100, 1024),
    Shape("pg2", 16, 500, 150, 2000),
    Shape("pg3", 8, 300, 60, 5000),
)}

# Named groups of shapes for the command-line tools.
GROUPS = {
    "quick": ["s1", "s2"],
    "core": ["s2", "s3", "s4", "s5", "ragged"],       # the core issue's target shapes
    "all": ["s1", "s2", "s3", "s4", "s5", "ragged", "s1_f64"],
    "gpu": ["s3", "s4", "s5", "ragged", "big", "v5000"],   # run.py --device cuda
    "pruned_cpu": ["p1", "p2", "pv5000"],                  # run.py --mode pruned
    "pruned_gpu": ["pg1", "pg2", "pg3"],                   # run.py --device cuda --mode pruned
}

# Loss topologies a case can ask for (``benchmarks/run.py --variants``). A new one is added
# here, in ``variant_loss`` (its loss call) and ``make_inputs`` (its inputs: durations,
# extra blanks), and in the ``variants`` of each provider of ``benchmarks/peers.py`` that
# implements it (the others report "unsupported" for it).
VARIANTS = {
    "regular": "standard RNN-T: one blank; a blank moves t, a label moves u",
    "modified": "k2 rnnt_type='modified': one symbol per frame, a label moves t and u",
    "constrained": "k2 rnnt_type='constrained': a label moves t and u, blank only (t, u+1)",
    "one_sym_per_frame": "optimized_transducer's one_sym_per_frame: a label moves t and u",
    "tdt": "NeMo TDT, durations 0..4: the last axis is V tokens + 5 durations, blank V-1",
    "multiblank": "NeMo multi-blank, big blanks of 2, 4, 8 frames: classes V-2..V-4, blank V-1",
}
TDT_DURATIONS = (0, 1, 2, 3, 4)
BIG_BLANK_DURATIONS = (2, 4, 8)


def variant_loss(variant: str, logits, targets, logit_lengths, target_lengths, blank, **kw):
    """Per-sequence costs of ``variant`` through the public API (``kw``: ``backend``,
    ``inplace_grad``, ...), on inputs made by :func:`make_inputs` for that variant."""
    import rnnt_lattice
    args = (logits, targets, logit_lengths, target_lengths)
    kw = dict(blank=blank, reduction="none", **kw)
    if variant == "regular":
        return rnnt_lattice.rnnt_loss(*args, **kw)
    if variant in ("modified", "constrained", "one_sym_per_frame"):
        return rnnt_lattice.rnnt_loss(*args, rnnt_type=variant, **kw)
    if variant == "tdt":
        return rnnt_lattice.tdt_loss(*args, durations=list(TDT_DURATIONS), **kw)
    if variant == "multiblank":
        return rnnt_lattice.multiblank_rnnt_loss(*args, big_blank_durations=list(BIG_BLANK_DURATIONS),
                                                 **kw)
    raise ValueError(f"unknown variant {variant!r}; known: {sorted(VARIANTS)}")


@dataclass
class Inputs:
    logits: torch.Tensor          # (B, T, U+1, V) float, contiguous
    targets: torch.Tensor         # (B, U) int32, values in 1..V-1
    logit_lengths: torch.Tensor   # (B,) int32
    target_lengths: torch.Tensor  # (B,) int32
    blank: int
    variant: str = "regular"      # the loss topology (VARIANTS); providers get it as a keyword

    def call_kwargs(self) -> dict:
        """Keywords of a provider call: none for "regular" (every peer's signature)."""
        return {} if self.variant == "regular" else {"variant": self.variant}

    @property
    def nbytes(self) -> int:
        return self.logits.numel() * self.logits.element_size()


@dataclass(frozen=True)
class Case:
    """One benchmark case: a shape, the logits' dtype and the loss variant."""
    shape: Shape
    dtype: torch.dtype
    variant: str = "regular"

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")

    @property
    def label(self) -> str:
        """The shape's name, plus the dtype where it is not the shape's own and the variant
        where it is not "regular": ``s5``, ``s5 bfloat16``, ``s1_f64``."""
        out = self.shape.name
        if self.dtype != self.shape.dtype:
            out += f" {self.dtype_name}"
        if self.variant != "regular":
            out += f" {self.variant}"
        return out


def cases(names, dtype: Optional[torch.dtype] = None, variants=("regular",)) -> list:
    """Shape or group names x variants -> list of :class:`Case`; ``dtype`` overrides the
    shapes' own."""
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"unknown variant {v!r}; known: {sorted(VARIANTS)}")
    return [Case(s, dtype or s.dtype, v) for v in variants for s in resolve(names)]


def resolve(names) -> list:
    """Shape names or group names -> list of :class:`Shape` (order kept, no repeats)."""
    out = []
    for n in names:
        for m in GROUPS.get(n, [n]):
            if m not in SHAPES:
                raise ValueError(f"unknown shape {m!r}; known: {sorted(SHAPES)} and groups {sorted(GROUPS)}")
            if SHAPES[m] not in out:
                out.append(SHAPES[m])
    return out


def make_inputs(shape: Shape, dtype: Optional[torch.dtype] = None, seed: int = 0,
                variant: str = "regular") -> Inputs:
    """Seeded inputs for ``shape``. ``dtype`` overrides the shape's dtype (the agreement
    check makes float32 inputs and upcasts them itself, so both see the same numbers).
    ``variant`` (:data:`VARIANTS`): "tdt" appends the 5 duration logits to the last axis
    and "tdt"/"multiblank" use NeMo's blank ``V-1`` with labels below the blank(s).

    Logits are standard normal: joiner outputs at initialisation look like this, and it is
    the hardest case for the lattice (no path dominates). The generator is local, so the
    caller's global RNG state is untouched.
    """
    dtype = dtype or shape.dtype
    g = torch.Generator().manual_seed(seed)
    B, V = shape.B, shape.V
    if shape.ragged:
        lo, hi = shape.T_range
        logit_lengths = torch.randint(lo, hi + 1, (B,), generator=g, dtype=torch.int32)
        lo, hi = shape.U_range
        target_lengths = torch.randint(lo, hi + 1, (B,), generator=g, dtype=torch.int32)
        T, U = int(logit_lengths.max()), int(target_lengths.max())
    else:
        T, U = shape.T, shape.U
        logit_lengths = torch.full((B,), T, dtype=torch.int32)
        target_lengths = torch.full((B,), U, dtype=torch.int32)
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {sorted(VARIANTS)}")
    if variant in ("tdt", "multiblank"):
        # NeMo's layout: the blank is the last token, the big blanks just below it.
        n_blanks = 1 + (len(BIG_BLANK_DURATIONS) if variant == "multiblank" else 0)
        targets = torch.randint(0, V - n_blanks, (B, U), generator=g, dtype=torch.int32)
        V_all = V + (len(TDT_DURATIONS) if variant == "tdt" else 0)
        logits = torch.randn(B, T, U + 1, V_all, generator=g, dtype=torch.float32).to(dtype)
        return Inputs(logits, targets, logit_lengths, target_lengths, V - 1, variant)
    # Labels 1..V-1 everywhere (also past target_lengths: some peers read the padding).
    targets = torch.randint(1, V, (B, U), generator=g, dtype=torch.int32)
    logits = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float32).to(dtype)
    return Inputs(logits, targets, logit_lengths, target_lengths, BLANK, variant)


@dataclass
class JoinerInputs:
    """Inputs of the pruned pipeline: the joiner ``logits(t, u) = am(t) + lm(u)`` in halves."""
    am: torch.Tensor              # (B, T, V) float
    lm: torch.Tensor              # (B, U+1, V) float
    targets: torch.Tensor         # (B, U) int64, values in 1..V-1
    logit_lengths: torch.Tensor   # (B,) int64
    target_lengths: torch.Tensor  # (B,) int64
    blank: int

    @property
    def boundary(self) -> torch.Tensor:
        """k2's ``(B, 4)`` rows ``[0, 0, U_b, T_b]``."""
        zero = torch.zeros_like(self.logit_lengths)
        return torch.stack((zero, zero, self.target_lengths, self.logit_lengths), 1)

    def logits(self) -> torch.Tensor:
        """The full ``(B, T, U+1, V)`` joiner output (for the full-loss rows)."""
        return (self.am[:, :, None] + self.lm[:, None]).contiguous()


def make_joiner_inputs(shape: Shape, dtype: Optional[torch.dtype] = None, seed: int = 0,
                       device="cpu") -> JoinerInputs:
    """Seeded :class:`JoinerInputs` for ``shape`` (ragged shapes draw lengths as
    :func:`make_inputs`); standard normal am and lm, labels 1..V-1, blank 0."""
    dtype = dtype or shape.dtype
    g = torch.Generator().manual_seed(seed)
    B, V = shape.B, shape.V
    if shape.ragged:
        logit_lengths = torch.randint(shape.T_range[0], shape.T_range[1] + 1, (B,), generator=g)
        target_lengths = torch.randint(shape.U_range[0], shape.U_range[1] + 1, (B,), generator=g)
        T, U = int(logit_lengths.max()), int(target_lengths.max())
    else:
        T, U = shape.T, shape.U
        logit_lengths = torch.full((B,), T, dtype=torch.int64)
        target_lengths = torch.full((B,), U, dtype=torch.int64)
    targets = torch.randint(1, V, (B, U), generator=g)
    am = torch.randn(B, T, V, generator=g).to(dtype)
    lm = torch.randn(B, U + 1, V, generator=g).to(dtype)
    return JoinerInputs(*(x.to(device) for x in (am, lm, targets, logit_lengths, target_lengths)),
                        BLANK)


# --------------------------------------------------------------------------- timing
class WallClock:
    """Seconds of one call by the wall clock (CPU: the call returns when its work is done)."""
    name = "wall clock"

    def sync(self) -> None:
        pass

    def once(self, fn, setup=None) -> float:
        if setup is not None:
            setup()                       # outside the timing
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


class CudaEventClock:
    """Seconds of one call by CUDA events recorded around it on the current stream (the
    ``setup`` work is queued before the start event, so it is not counted)."""
    name = "CUDA events"

    def sync(self) -> None:
        torch.cuda.synchronize()

    def once(self, fn, setup=None) -> float:
        if setup is not None:
            setup()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


WALL = WallClock()
CUDA_EVENTS = CudaEventClock()


def time_calls(fn, *, warmup: int = 1, reps: int = 5, cap_s: float = float("inf"),
               min_time_s: float = 0.3, max_reps: int = 200, clock=WALL, setup=None) -> dict:
    """Median time of ``fn()`` by ``clock`` after ``warmup`` untimed calls; ``setup()`` runs
    before every call, outside the timing.

    At least ``reps`` samples, and more (up to ``max_reps``) until the samples add up to
    ``min_time_s``: a median of 3 sub-millisecond calls on a shared machine is mostly
    scheduler noise (``min_time_s=0`` takes exactly ``reps``). The cap bounds the whole
    measurement: if the warm-up already shows that ``reps`` calls would overrun ``cap_s``,
    fewer are taken (at least one), and ``capped`` says so.
    """
    spent = 0.0
    first = None
    for _ in range(warmup):
        dt = clock.once(fn, setup)
        spent += dt
        first = dt if first is None else first
    n = reps
    if first is not None and first * reps > cap_s - spent:
        n = max(1, int((cap_s - spent) // max(first, 1e-9)))
    samples = []
    while len(samples) < n or (sum(samples) < min_time_s and len(samples) < max_reps
                               and spent + sum(samples) < cap_s):
        samples.append(clock.once(fn, setup))
    return {"median": statistics.median(samples), "min": min(samples), "reps": len(samples),
            "samples": samples, "capped": n < reps}


def fwd_bwd(fn, x: Inputs, logits: torch.Tensor):
    """One training step of a provider ``fn(logits, targets, logit_lengths, target_lengths,
    blank) -> (B,)`` on inputs ``x`` with ``logits`` the leaf to differentiate: forward,
    then backward of the summed per-sequence losses, into a fresh ``logits.grad`` (as in
    training)."""
    logits.grad = None
    costs = fn(logits, x.targets, x.logit_lengths, x.target_lengths, x.blank, **x.call_kwargs())
    costs.sum().backward()
    return costs


def fwd(fn, x: Inputs):
    """Forward only (no graph, logits not requiring grad)."""
    with torch.no_grad():
        return fn(x.logits, x.targets, x.logit_lengths, x.target_lengths, x.blank,
                  **x.call_kwargs())


def time_loss(fn, x: Inputs, *, leaf: Optional[torch.Tensor] = None, setup=None, clock=WALL,
              warmup: int = 1, fwd_warmup: Optional[int] = None, reps: int = 5,
              cap_s: float = float("inf"), min_time_s: float = 0.3, forward: bool = True) -> dict:
    """The one timing of a loss ``fn`` (provider signature) on ``x``: fwd+bwd into the leaf
    ``leaf`` (default: a copy of ``x.logits``; ``setup`` restores it before each call where
    the provider overwrites it) and, with ``forward``, forward only. ``cap_s`` bounds each."""
    if leaf is None:
        leaf = x.logits.detach().clone().requires_grad_()
    fb = time_calls(lambda: fwd_bwd(fn, x, leaf), warmup=warmup, reps=reps, cap_s=cap_s,
                    min_time_s=min_time_s, clock=clock, setup=setup)
    out = {"fwd_bwd_s": fb["median"], "fwd_bwd_min_s": fb["min"], "fwd_bwd_reps": fb["reps"],
           "fwd_bwd_capped": fb["capped"]}
    if forward:
        fw = time_calls(lambda: fwd(fn, x), reps=reps, cap_s=cap_s, min_time_s=min_time_s,
                        clock=clock, warmup=warmup if fwd_warmup is None else fwd_warmup)
        out.update(fwd_s=fw["median"], fwd_reps=fw["reps"])
    return out


# --------------------------------------------------------------------------- floors
def exp_floor(logits: torch.Tensor, reps: int = 5) -> dict:
    """The CPU's floor for one pass over the logits, on the same tensor in the same run:
    ``torch.exp(logits, out=buf)`` (buffer reused: pure read + exp + write) and
    ``torch.exp(logits)`` (a fresh output each time: adds the page faults of a new buffer,
    which any loss returning a new gradient tensor also pays)."""
    x = logits.detach()
    buf = torch.empty_like(x)
    out = time_calls(lambda: torch.exp(x, out=buf), warmup=1, reps=reps)
    fresh = time_calls(lambda: torch.exp(x), warmup=1, reps=reps)
    return {"exp_out_s": out["median"], "exp_fresh_s": fresh["median"]}


def copy_bandwidth(warmup: int = 3, reps: int = 10, nbytes: int = 1 << 30,
                   device: str = "cuda", clock=CUDA_EVENTS) -> float:
    """The GPU's floor: copy bandwidth in GB/s (one read and one write per byte) on an
    ``nbytes`` buffer, large enough that launch latency does not count (a small tensor's
    copy is launch-bound and says nothing about bandwidth). A fused loss reads the logits
    twice and writes the gradient once: its floor is ``3 x nbytes(logits)`` / this."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    buf = torch.empty_like(x)
    t = time_calls(lambda: buf.copy_(x), warmup=warmup, reps=reps, min_time_s=0.0,
                   clock=clock)["median"]
    del x, buf
    if device == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / t / 1e9


def loss_fn(backend: str):
    """Our loss in the providers' signature (per-sequence costs)."""
    from .functional import rnnt_loss

    def fn(logits, targets, logit_lengths, target_lengths, blank):
        return rnnt_loss(logits, targets, logit_lengths, target_lengths, blank=blank,
                         reduction="none", backend=backend)
    return fn


def measure(shape: Shape, backend: str = "numba", *, reps: int = 5, warmup: int = 1,
            cap_s: float = 60.0, seed: int = 0) -> dict:
    """fwd+bwd and forward-only medians of our loss at ``shape``, with the exp floor of
    the same tensor measured in the same run, and their ratio ``x_exp``."""
    x = make_inputs(shape, seed=seed)
    floor = exp_floor(x.logits, reps=max(3, reps))
    t = time_loss(loss_fn(backend), x, warmup=warmup, reps=reps, cap_s=cap_s)
    return {"shape": shape.name, "shape_desc": shape.describe(), "backend": backend,
            "logits_mb": x.nbytes / 2**20, **floor, **t,
            "x_exp": t["fwd_bwd_s"] / floor["exp_out_s"],
            "x_exp_fresh": t["fwd_bwd_s"] / floor["exp_fresh_s"]}


def fmt_s(x) -> str:
    """Seconds for a table: us below 1 ms, ms below 0.1 s, else s."""
    if x is None or x != x:
        return "-"
    if x < 1e-3:
        return f"{x * 1e6:.0f} us"
    if x < 0.1:
        return f"{x * 1e3:.2f} ms"
    return f"{x:.3f} s"


def set_threads(n: int) -> int:
    """The one thread setter (benchmarks/run.py, ``rnnt-lattice bench``, the demo): intra-op
    threads for Numba, if it is installed (capped at the pool it started with), and torch.
    Numba first: on its OpenMP threading layer (the same libgomp as torch's)
    ``numba.set_num_threads`` resets the OpenMP count torch reports and uses. Call it again
    before each provider where one may change them process-wide (warprnnt-numba and NeMo
    set Numba's to 1 on every call). Returns ``n``."""
    try:
        import numba
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass
    torch.set_num_threads(n)
    return n


# --------------------------------------------------------------------------- command line
def _check_args(args) -> list:
    """The shapes to run; ``ValueError`` (one line from ``rnnt-lattice``) for bad options,
    before anything is timed."""
    shapes = resolve(args.shapes)
    for opt, value, low in (("--threads", args.threads, 1), ("--reps", args.reps, 1),
                            ("--warmup", args.warmup, 0)):
        if value < low:
            raise ValueError(f"{opt} must be >= {low}, got {value}")
    if not args.cap > 0:
        raise ValueError(f"--cap must be > 0 seconds, got {args.cap}")
    if args.json:
        from .cli import check_output_file
        check_output_file(args.json, "--json")
    return shapes


def main(argv=None) -> int:
    """``rnnt-lattice bench``: time our loss against the exp floor; returns an exit code."""
    ap = argparse.ArgumentParser(
        prog="rnnt-lattice bench",
        description="Time rnnt_lattice's forward+backward against torch.exp over the same "
                    "logits (the machine's floor), at the benchmark registry's shapes. The "
                    "full runner, on CPU or CUDA and side by side with other libraries, is "
                    "benchmarks/run.py in the repository (docs/benchmarks.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["quick"],
                    help=f"shape or group names; shapes {sorted(SHAPES)}, groups "
                         + ", ".join(f"{k}={'+'.join(v)}" for k, v in GROUPS.items()))
    ap.add_argument("--backends", nargs="+", default=["numba"], choices=["numba", "torch", "triton"])
    ap.add_argument("--threads", type=int, default=int(os.environ.get("RNNT_BENCH_THREADS", 2)))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--cap", type=float, default=60.0, help="seconds per shape, backend and mode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE", help="also write the rows and the machine as JSON")
    args = ap.parse_args(argv)
    shapes = _check_args(args)
    set_threads(args.threads)
    from . import __version__
    meta = {"rnnt_lattice": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "threads": args.threads, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(f"# rnnt_lattice {meta['rnnt_lattice']}, torch {meta['torch']}, {meta['cpus']} CPUs, "
          f"{args.threads} threads", flush=True)
    rows = []
    for backend in args.backends:
        w = make_inputs(SHAPES["s1"])                      # compile / warm up, untimed
        try:
            fwd_bwd(loss_fn(backend), w, w.logits.requires_grad_())
        except (ValueError, ImportError) as err:
            print(f"{backend}: not available here ({err})", file=sys.stderr)
            continue
        for s in shapes:
            r = measure(s, backend, reps=args.reps, warmup=args.warmup, cap_s=args.cap, seed=args.seed)
            rows.append(r)
            print(f"{backend:6s} {s.name:7s} {s.describe():34s} fwd+bwd {fmt_s(r['fwd_bwd_s']):>10s}  "
                  f"fwd {fmt_s(r['fwd_s']):>10s}  exp(out=buf) {fmt_s(r['exp_out_s']):>10s}  "
                  f"exp() {fmt_s(r['exp_fresh_s']):>10s}  fwd+bwd/exp {r['x_exp']:5.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if rows else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as err:
        print(f"rnnt-lattice bench: error: {err}", file=sys.stderr)
        sys.exit(2)
