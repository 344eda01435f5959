"""Clocks, the one timing routine and the floors (the exp pass on CPU, copy bandwidth on
CUDA): what ``run.py``, ``pruned_pipeline.py`` and ``fused_pipeline.py`` time with. Imports neither the thread settings of
``common`` nor anything but torch and the registry (``shapes``)."""
from __future__ import annotations

import statistics
import time
from typing import Optional

import torch

from shapes import Inputs


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


def fmt_s(x) -> str:
    """Seconds for a table: us below 1 ms, ms below 0.1 s, else s."""
    if x is None or x != x:
        return "-"
    if x < 1e-3:
        return f"{x * 1e6:.0f} us"
    if x < 0.1:
        return f"{x * 1e3:.2f} ms"
    return f"{x:.3f} s"
