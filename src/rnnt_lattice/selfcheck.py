"""``rnnt-lattice check``: the self-check a user runs on their own machine.

    rnnt-lattice check [--device cpu|cuda] [--quick] [--json FILE] [--jobs N]

It prints the environment (versions, device, compute capability, FP64 class), then runs
every kernel family of the device's backend (Numba on CPU, Triton on CUDA) against the
float64 pure-PyTorch backend on the same (rounded) numbers, losses and gradients:

    loss       rnnt_loss for each rnnt_type (regular, modified, constrained,
               one_sym_per_frame) and options (clamp, FastEmit, log-prob input, delay
               penalty), tdt_loss, multiblank_rnnt_loss, packed logits
    pruned     rnnt_loss_simple / rnnt_loss_smoothed (values, gradients, occupations; far
               apart logits rescued in the log domain), rnnt_loss_pruned on exact windows,
               do_rnnt_pruning's gradient (the lm rows' sums)
    fused      fused_rnnt_loss / fused_tdt_loss / fused_multiblank_rnnt_loss (gradients of
               enc, pred and the joiner's parameters) against rnnt_loss on the logits; the
               joiner's kernel path (``rnnt_lattice.Joiner``, Triton backend): the same in
               float32 and float64, two runs bit-identical, the AMP recipe; and with each
               chunk's logits by cuBLAS (``gpu.joint.CUBLAS_PRODUCTS``)
    tools      occupancy / best_alignment (regular and TDT), the window DP
               (prune_ranges method="exact", prune_coverage)
    determinism  under torch.use_deterministic_algorithms(True): rnnt_loss, occupancy,
               prune_ranges and prune_coverage run (CUDA refuses ops without a
               deterministic kernel there), and the simple and smoothed losses with a
               repeated label and rescued nodes (on CUDA where CUBLAS_WORKSPACE_CONFIG
               allows their matrix products), twice the same bits
    cuda       no host synchronisation in the hot calls (sync debug mode "error"), a CUDA
               graph of forward+backward replayed equal to eager, peak memory of the
               gradient (about 1x the logits; none extra with inplace_grad)
    timing     one standard shape, forward+backward, against the device's copy floor (a
               clone and an exp of the same logits) and torchaudio's rnnt_loss if it imports
    amp        the fused losses under PyTorch's AMP recipe (forward under autocast,
               backward outside) against backward inside the block
    bad input  out-of-range labels and lengths on the device path: the sequence's loss is
               NaN, a device-side assert names the argument and the rule (in a
               subprocess: the assert ends the CUDA context), and set_input_checks("host")
               gives the ValueError; a fused loss's joiner that recomputes other logits
               in the backward pass fails with the "recompute" message (a subprocess too)

On CPU, first: the row loops (a row's exps and their sum, where the CPU losses spend most
of their time) as this Numba's LLVM compiled them, vector widths per dtype; a scalar loop
fails (right values, several times slower).

Each check prints one ``PASS`` / ``FAIL`` / ``SKIP`` line as it finishes; the run ends with
a block to paste into a bug report and exits non-zero if any check failed. ``--jobs N``
runs the checks in N worker processes (spawned: each has its own CUDA context), a check
at a time to whichever worker is free, and says them in the same order; on a GPU most of a
first run is Triton compiling the kernels, which the workers do in parallel. A worker that
dies fails the check it ran, and another takes its place.
``tests/cuda_checks.py`` runs the same checks at the benchmark shapes (``tier="full"``).

Tolerances are tied to the logits' dtype (:func:`tolerance`): the lattice is float64 on
every backend, so float64 logits agree to ~1e-12, float32 to the rounding of the float32
log-softmax (gradient within 1e-5 of its scale), float16/bfloat16 to a few units of their
own rounding (the gradient is written in that dtype).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

import rnnt_lattice

from . import _backends, torch_backend
from ._cli_util import set_threads
from .topology import tdt as tdt_topology

__all__ = ["run", "environment", "tolerance", "CheckFailed"]


class CheckFailed(AssertionError):
    """A check's numbers are outside its tolerance (the message says which and by how much)."""


# --------------------------------------------------------------------------- tolerances
def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(loss_tol, grad_tol)``: the largest error accepted, relative to ``max(1, |loss|)``
    and to the gradient's largest entry, for logits of ``dtype`` against the float64
    reference on the same numbers. float64: the lattice's own rounding; float32: the
    float32 log-softmax (and a float32 loss); float16/bfloat16: the loss is float32, the
    gradient is written in the half dtype (a few units of its rounding)."""
    if dtype == torch.float64:
        return 1e-10, 1e-10
    if dtype == torch.float32:
        return 1e-6, 1e-5
    return 1e-6, 4 * torch.finfo(dtype).eps


def _err(got, want, floor: float = 1.0) -> float:
    """Largest error on the finite entries of ``want``, relative to ``max(floor, max|want|)``;
    inf where the two differ in their pattern of infinities (or ``got`` has a NaN)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        return math.inf
    if torch.isnan(got).any() or not torch.equal(torch.isinf(got), torch.isinf(want)):
        return math.inf
    fin = torch.isfinite(want)
    if not fin.any():
        return 0.0
    scale = max(floor, want[fin].abs().max().item())
    return (got - want)[fin].abs().max().item() / scale


def _within(what: str, errs: dict, tols: dict) -> str:
    """One line of errors and tolerances; raises :class:`CheckFailed` if one is over."""
    over = [k for k in errs if not errs[k] <= tols[k]]
    line = "  ".join(f"{k} {errs[k]:.1e}" for k in errs)
    tol = sorted(set(tols.values()))
    line += f"  (tol {'/'.join(f'{t:.0e}' for t in tol)})"
    if over:
        raise CheckFailed(f"{what}: {', '.join(over)} over tolerance: {line}")
    return line


# --------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class Plan:
    """What one run checks: shapes ``(B, T, U, V)`` and dtypes."""

    loss_shapes: tuple            # rnnt_loss, every rnnt_type and option set
    topo_shapes: tuple            # tdt_loss, multiblank_rnnt_loss
    tool_shape: tuple             # pruned pipeline, lattice tools, fused, window DP
    dtypes: tuple                 # logits dtypes of the loss checks
    timing_shape: tuple           # the standard shape timed
    timing_reps: int


def plan_for(device: str, tier: str) -> Plan:
    """``tier``: ``"quick"`` (float32, one tiny shape: seconds), ``"default"`` (every
    dtype, two small shapes), ``"full"`` (the benchmark shapes: ``tests/cuda_checks.py``),
    ``"smoke"`` (quick on a smaller shape, for the Triton interpreter)."""
    cuda = device == "cuda"
    halves = (torch.float16, torch.bfloat16)
    timing = (8, 400, 80, 1024) if cuda else (4, 150, 40, 256)
    if tier in ("quick", "smoke"):
        # "smoke": smaller still, for the Triton interpreter (tests/cuda_checks.py --smoke)
        s = (3, 10, 4, 9) if tier == "quick" else (2, 7, 3, 6)
        return Plan((s,), (s,), s, (torch.float32,), timing, 3)
    if tier == "default":
        # (2, 12, 5, 300): rows of several chunks of the V passes (their tiles hold up to
        # 128 or 256 classes a step), aligned (multi-blank's 300 classes) and starting
        # anywhere (TDT's 305).
        return Plan(((4, 24, 8, 40), (1, 6, 17, 5)), ((4, 24, 8, 40), (2, 12, 5, 300)),
                    (4, 30, 8, 40),
                    (torch.float32, torch.float64) + halves, timing, 5)
    if tier == "full":
        return Plan(((8, 150, 40, 256), (8, 400, 80, 1024), (8, 300, 60, 500),
                     (2, 40, 1500, 64), (4, 120, 30, 5000)),
                    ((8, 150, 40, 256), (8, 300, 60, 500)), (8, 200, 50, 500),
                    (torch.float32, torch.float64) + halves, timing, 10)
    raise ValueError(f"tier must be 'quick', 'default', 'full' or 'smoke', got {tier!r}")


# --------------------------------------------------------------------------- inputs
def inputs(B, T, U, V, dtype, device, seed=0, min_frames=None):
    """Random logits ``(B, T, U+1, V)``, targets ``(B, U)`` in ``1..V-1``, ragged lengths
    ``(B,)`` (sequence 0 full length; frames at least ``min_frames``, default ``T // 2``)
    and signed weights ``(B,)`` for the backward pass (``sum_b w_b loss_b``)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(B, T, U + 1, V, generator=g).to(dtype)
    y = torch.randint(1, V, (B, U), generator=g, dtype=torch.int32)
    lo = min(T, max(1, T // 2 if min_frames is None else min_frames))
    tl = torch.randint(lo, T + 1, (B,), generator=g, dtype=torch.int32)
    ul = torch.randint(0, U + 1, (B,), generator=g, dtype=torch.int32)
    tl[0], ul[0] = T, U
    w = torch.tensor([(-1.0) ** b * (0.5 + 0.25 * b) for b in range(B)])
    return x.to(device), y.to(device), tl.to(device), ul.to(device), w.to(device)


def _loss_and_grad(fn, x, w, **kw):
    """``fn(leaf, reduction="none", **kw)`` and the gradient of ``sum_b w_b loss_b``."""
    leaf = x.detach().clone().requires_grad_()
    costs = fn(leaf, reduction="none", **kw)
    (costs * w.to(costs.dtype)).sum().backward()
    return costs.detach(), leaf.grad


def _compare_loss(what, fn, x, w, backend, dtype, **kw) -> str:
    """``fn`` on ``backend`` with ``x`` against the torch backend on ``x.double()``."""
    costs, grad = _loss_and_grad(fn, x, w, backend=backend, **kw)
    ref_costs, ref_grad = _loss_and_grad(fn, x.double(), w.double(), backend="torch", **kw)
    lt, gt = tolerance(dtype)
    return _within(what, {"loss err": _err(costs, ref_costs), "grad err": _err(grad, ref_grad, 1e-30)},
                   {"loss err": lt, "grad err": gt})


# --------------------------------------------------------------------------- context
@dataclass
class Result:
    name: str
    status: str                   # "PASS", "FAIL", "SKIP", "INFO"
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Context:
    device: str
    backend: str                  # the device's backend: "numba" (CPU), "triton" (CUDA)
    plan: Plan
    tier: str
    results: list = field(default_factory=list)
    timing: dict = field(default_factory=dict)
    out: Callable = print

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


# --------------------------------------------------------------------------- loss checks
LOSS_OPTIONS = {
    "plain": dict(),
    "clamp+fastemit": dict(clamp=0.5, fastemit_lambda=0.1),
    "log-probs": dict(fused_log_softmax=False),
    "delay": dict(delay_penalty=0.05),
}
TOPOLOGY_LOSSES = {
    # NeMo layouts, blank the last token: TDT durations up to 4 (a wavefront diagonal reads
    # four earlier ones), multi-blank big blanks up to 8 frames.
    "tdt": dict(durations=[0, 1, 2, 3, 4], sigma=0.05, fastemit_lambda=0.01, clamp=0.5),
    "multiblank": dict(big_blank_durations=[2, 4, 8], sigma=0.05),
}


def _rnnt(x, y, tl, ul, **kw):
    return lambda leaf, **k: rnnt_lattice.rnnt_loss(leaf, y, tl, ul, blank=0, **kw, **k)


def check_loss(ctx, shape, dtype, rnnt_type, option):
    B, T, U, V = shape
    x, y, tl, ul, w = inputs(B, T, U, V, dtype, ctx.device,
                             min_frames=T // 2 if rnnt_type == "regular" else U + 1)
    opts = LOSS_OPTIONS[option]
    if not opts.get("fused_log_softmax", True):
        x = torch.log_softmax(x.double(), -1).to(dtype)         # both sides see these numbers
    return _compare_loss("loss", _rnnt(x, y, tl, ul, rnnt_type=rnnt_type, **opts), x, w,
                         ctx.backend, dtype)


def check_without_graph(ctx, shape):
    """A validation step with the training options: ``inplace_grad=True`` under
    ``torch.no_grad`` and ``torch.inference_mode`` on logits that require grad computes no
    gradient and leaves the logits as they are (the Numba backend once stored its exps over
    them), with the losses of the step with a graph."""
    B, T, U, V = shape
    x, y, tl, ul, _ = inputs(B, T, U, V, torch.float32, ctx.device)
    want = rnnt_lattice.rnnt_loss(x, y, tl, ul, blank=0, reduction="none", backend=ctx.backend)
    for mode in (torch.no_grad, torch.inference_mode):
        leaf = x.clone().requires_grad_()
        with mode():
            got = rnnt_lattice.rnnt_loss(leaf, y, tl, ul, blank=0, reduction="none",
                                         backend=ctx.backend, inplace_grad=True)
        if not torch.equal(leaf.detach(), x):
            raise CheckFailed(f"{mode.__name__}: inplace_grad wrote over the logits")
        if not torch.equal(got, want):
            raise CheckFailed(f"{mode.__name__}: losses {got.tolist()} against {want.tolist()}")
    return "logits untouched, the same losses, under no_grad and inference_mode"


def _topology_fn(kind, y, tl, ul, V_all):
    opts = TOPOLOGY_LOSSES[kind]
    if kind == "tdt":
        blank = V_all - len(opts["durations"]) - 1
        return lambda leaf, **k: rnnt_lattice.tdt_loss(leaf, y, tl, ul, blank=blank, **opts, **k)
    return lambda leaf, **k: rnnt_lattice.multiblank_rnnt_loss(leaf, y, tl, ul, blank=V_all - 1,
                                                               **opts, **k)


def _topology_inputs(kind, shape, dtype, device):
    """V token classes (TDT: plus the durations); labels avoid every blank."""
    B, T, U, V = shape
    n_dur = len(TOPOLOGY_LOSSES[kind].get("durations", ()))
    n_blanks = 1 + len(TOPOLOGY_LOSSES[kind].get("big_blank_durations", ()))
    x, y, tl, ul, w = inputs(B, T, U, V + n_dur, dtype, device)
    return x, y % (V - n_blanks), tl, ul, w


def check_topology(ctx, shape, dtype, kind):
    x, y, tl, ul, w = _topology_inputs(kind, shape, dtype, ctx.device)
    return _compare_loss(kind, _topology_fn(kind, y, tl, ul, x.shape[-1]), x, w, ctx.backend, dtype)


def check_packed(ctx, shape, dtype):
    """Packed rows ``(sum_b T_b (U_b+1), V)`` on the device against the padded logits on
    the float64 reference (the gradient unpacked back by ``pack_logits``' autograd)."""
    B, T, U, V = shape
    x, y, tl, ul, w = inputs(B, T, U, V, dtype, ctx.device)
    rows = rnnt_lattice.pack_logits(x, tl, ul)
    costs, grad = _loss_and_grad(
        lambda leaf, **k: rnnt_lattice.rnnt_loss(leaf, y, tl, ul, blank=0, packed=True, **k),
        rows, w, backend=ctx.backend)
    ref_costs, ref_grad = _loss_and_grad(_rnnt(x, y, tl, ul), x.double(), w.double(), backend="torch")
    lt, gt = tolerance(dtype)
    return _within("packed", {"loss err": _err(costs, ref_costs),
                              "grad err": _err(grad, rnnt_lattice.pack_logits(ref_grad, tl, ul), 1e-30)},
                   {"loss err": lt, "grad err": gt})


# --------------------------------------------------------------------------- pruned pipeline
def _simple_inputs(shape, dtype, device, seed=5):
    B, T, U, V = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    am = torch.randn(B, T, V, generator=g, dtype=torch.float64).to(dtype).to(device)
    lm = torch.randn(B, U + 1, V, generator=g, dtype=torch.float64).to(dtype).to(device)
    y = torch.randint(1, V, (B, U), generator=g).to(device)
    tl = torch.tensor([T] + [max(U, T - 2)] * (B - 1)).to(device)
    ul = torch.tensor([U] + [U - 1] * (B - 1)).to(device)
    w = torch.tensor([(-1.0) ** b * (0.5 + 0.25 * b) for b in range(B)], dtype=torch.float64,
                     device=device)
    return am, lm, y, tl, ul, w


def _simple_run(name, lm, am, y, tl, ul, w, backend, **kw):
    lm_, am_ = lm.clone().requires_grad_(), am.clone().requires_grad_()
    loss, occ = getattr(rnnt_lattice, name)(lm_, am_, y, tl, ul, blank=0, reduction="none",
                                            backend=backend, return_occupations=True, **kw)
    (loss * w.to(loss.dtype)).sum().backward()
    return loss, lm_.grad, am_.grad, occ.gamma_blank, occ.gamma_label


def check_simple(ctx, shape, dtype, name, rnnt_type):
    """The simple/smoothed loss (values, gradients w.r.t. lm and am, occupations) on the
    device's backend against the torch backend on the float64 copies."""
    am, lm, y, tl, ul, w = _simple_inputs(shape, dtype, ctx.device)
    got = _simple_run(name, lm, am, y, tl, ul, w, ctx.backend, rnnt_type=rnnt_type)
    want = _simple_run(name, lm.double(), am.double(), y, tl, ul, w, "torch", rnnt_type=rnnt_type)
    lt, gt = tolerance(dtype)
    errs = {"loss err": _err(got[0], want[0]), "grad lm": _err(got[1], want[1], 1e-30),
            "grad am": _err(got[2], want[2], 1e-30),
            "occupations": max(_err(got[3], want[3]), _err(got[4], want[4]))}
    return _within(name, errs, {"loss err": lt, "grad lm": gt, "grad am": gt, "occupations": gt})


def check_simple_rescue(ctx, shape):
    """Logits whose am and lm peak at classes 1000 nats apart: nodes beyond the float64
    matmul's range, rescued in the log domain; against ``rnnt_loss`` on the full logits."""
    am, lm, y, tl, ul, w = _simple_inputs(shape, torch.float64, ctx.device)
    am[..., 1] += 1000.0
    lm[..., 2] += 1000.0
    errs = {}
    for name in ("rnnt_loss_simple", "rnnt_loss_smoothed"):
        extra = dict(lm_only_scale=0.0, am_only_scale=0.0) if name == "rnnt_loss_smoothed" else {}
        lm_, am_ = lm.clone().requires_grad_(), am.clone().requires_grad_()
        loss = getattr(rnnt_lattice, name)(lm_, am_, y, tl, ul, blank=0, reduction="none",
                                           backend=ctx.backend, **extra)
        (loss * w).sum().backward()
        full = (am[:, :, None] + lm[:, None]).requires_grad_()
        want = rnnt_lattice.rnnt_loss(full, y, tl, ul, blank=0, reduction="none", backend="torch")
        (want * w).sum().backward()
        if not torch.isfinite(loss).all():
            raise CheckFailed(f"{name}: non-finite loss {loss.tolist()}")
        errs[name[10:] + " loss"] = _err(loss, want)
        errs[name[10:] + " grads"] = max(_err(lm_.grad, full.grad.sum(1), 1e-30),
                                         _err(am_.grad, full.grad.sum(2), 1e-30))
    return _within("simple rescue", errs, {k: 1e-9 for k in errs})


def _windows(shape, device, rnnt_type, R=3):
    """Exact windows from the simple loss's occupations (torch backend, float64)."""
    am, lm, y, tl, ul, _ = _simple_inputs(shape, torch.float64, device)
    with torch.no_grad():
        _, occ = rnnt_lattice.rnnt_loss_simple(lm, am, y, tl, ul, blank=0, rnnt_type=rnnt_type,
                                               return_occupations=True, backend="torch")
    return y, tl, ul, rnnt_lattice.prune_ranges(occ, R, method="exact").ranges


def check_pruned(ctx, shape, dtype, rnnt_type):
    B, T, U, V = shape
    y, tl, ul, ranges = _windows(shape, ctx.device, rnnt_type)
    g = torch.Generator(device="cpu").manual_seed(7)
    x = torch.randn(B, T, ranges.shape[-1], V, generator=g).to(dtype).to(ctx.device)
    w = torch.tensor([(-1.0) ** b * (0.5 + 0.25 * b) for b in range(B)], device=ctx.device)
    fn = lambda leaf, **k: rnnt_lattice.rnnt_loss_pruned(leaf, y, ranges, tl, ul, blank=0,  # noqa: E731
                                                         rnnt_type=rnnt_type, **k)
    return f"R = {ranges.shape[-1]}  " + _compare_loss("pruned", fn, x, w, ctx.backend, dtype)


def check_pruning_rows(ctx, shape):
    """``do_rnnt_pruning``'s gradient on the device (the lm rows' sums: the backend's
    ``rows_sum``, on CUDA a Triton sum of each row's entries in their order) against
    autograd's ``index_select`` backward (``index_add_``) on the CPU: the same bits in
    float32 and float64; where the Triton backend sums (CUDA), within one bfloat16 rounding
    of the float64 sum in bfloat16 (on the CPU ``rows_sum`` is ``index_add_``, which adds in
    bfloat16)."""
    B, T, U, V = shape
    _, _, _, ranges = _windows(shape, ctx.device, "regular")
    g = torch.Generator(device="cpu").manual_seed(17)
    errs = {}
    sums_f32 = _backends.resolve("auto", torch.device(ctx.device)).NAME == "triton"
    for dtype in (torch.float32, torch.float64) + ((torch.bfloat16,) if sums_f32 else ()):
        am = torch.randn(B, T, 24, generator=g).to(dtype)
        lm = torch.randn(B, U + 1, 24, generator=g).to(dtype)
        w = torch.randn(B, T, ranges.shape[-1], 24, generator=g).to(dtype)
        lm_ = lm.to(ctx.device, copy=True).requires_grad_()
        _, lm_p = rnnt_lattice.do_rnnt_pruning(am.to(ctx.device), lm_, ranges)
        (lm_p * w.to(ctx.device)).sum().backward()
        ref_dtype = torch.float64 if dtype == torch.bfloat16 else dtype
        lm_ref = lm.to(ref_dtype, copy=True).requires_grad_()
        rows = (ranges.cpu() + torch.arange(B)[:, None, None] * (U + 1)).reshape(-1)
        ref = lm_ref.reshape(B * (U + 1), -1).index_select(0, rows)
        (ref * w.to(ref_dtype).reshape(ref.shape)).sum().backward()
        got, want = lm_.grad.cpu(), lm_ref.grad
        if dtype == torch.bfloat16:
            err = float(((got.double() - want).abs() / want.abs().clamp(min=1e-30)).max())
            # One rounding to bfloat16 (8 significant bits): within one unit in the last
            # place, 2^-7 relative (to the nearest on a GPU: half of it; the interpreter
            # rounds towards zero).
            if err > 2 ** -7:
                raise CheckFailed(f"do_rnnt_pruning bfloat16: lm gradient off by {err:.1e} "
                                  f"(relative; one bfloat16 rounding is at most 2^-7)")
            errs["bf16"] = f"; bfloat16 rel err {err:.1e}"
        elif not torch.equal(got, want.to(dtype)):
            raise CheckFailed(f"do_rnnt_pruning {dtype}: lm gradient differs from index_add_ on "
                              f"the CPU by {float((got.double() - want).abs().max()):.1e}")
    return (f"R = {ranges.shape[-1]}  float32, float64 bit-identical to index_add_ on the CPU"
            + errs.get("bf16", ""))


# --------------------------------------------------------------------------- fused
class _Joiner(torch.nn.Module):
    def __init__(self, H, V, dtype, device, seed=3):
        super().__init__()
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.enc = torch.nn.Linear(H, H)
        self.pred = torch.nn.Linear(H, H)
        self.out = torch.nn.Linear(H, V)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(H))
        self.to(dtype=dtype, device=device)

    def forward(self, e, p):                      # (B, t, 1, H), (B, 1, u, H) -> (B, t, u, V)
        return self.out(torch.tanh(self.enc(e) + self.pred(p))) * 3.0


def _fused_grads(joiner, enc, pred, loss_fn, w):
    joiner.zero_grad()
    e, p = enc.clone().requires_grad_(), pred.clone().requires_grad_()
    costs = loss_fn(e, p)
    (costs * w.to(costs.dtype)).sum().backward()
    return [costs.detach(), e.grad, p.grad] + [q.grad.clone() for q in joiner.parameters()]


def _fused_pair(kind, joiner, y, tl, ul, V, backend, tile):
    """``(fused(e, p), full(e, p), y)`` of a loss ``kind`` on ``joiner``: the fused loss
    (tiles of ``tile`` rows), and the float64 reference on the materialised logits (the
    targets made valid for the topology)."""
    if kind == "rnnt":
        name, kw = "rnnt_loss", dict(blank=0, clamp=0.5, fastemit_lambda=0.1)
    else:
        n_blanks = 1 + len(TOPOLOGY_LOSSES[kind].get("big_blank_durations", ()))
        y = y % (V - n_blanks)
        name = {"tdt": "tdt_loss", "multiblank": "multiblank_rnnt_loss"}[kind]
        kw = dict(blank=V - 1, **TOPOLOGY_LOSSES[kind])
    fused = lambda e, p: getattr(rnnt_lattice, "fused_" + name)(  # noqa: E731
        joiner, e, p, y, tl, ul, tile=tile, reduction="none", backend=backend, **kw)
    full = lambda e, p: getattr(rnnt_lattice, name)(  # noqa: E731
        joiner(e[:, :, None], p[:, None]).double(), y, tl, ul, reduction="none",
        backend="torch", **kw)
    return fused, full


def _check_fused_pair(ctx, shape, dtype, kind, tile, make_joiner, H, what, reruns=False):
    """The fused loss of ``make_joiner(H, V, dtype, device)`` (tiles of ``tile`` rows)
    against the loss of the materialised logits on the float64 reference: costs and the
    gradients of enc, pred and every joiner parameter (back through the same joiner in
    ``dtype``); with ``reruns``, a second backward bit-identical to the first."""
    B, T, U, V = shape
    n_dur = len(TOPOLOGY_LOSSES.get(kind, {}).get("durations", ()))
    joiner = make_joiner(H, V + n_dur, dtype, ctx.device)
    g = torch.Generator(device="cpu").manual_seed(11)
    enc = torch.randn(B, T, H, generator=g).to(dtype).to(ctx.device)
    pred = torch.randn(B, U + 1, H, generator=g).to(dtype).to(ctx.device)
    _, y, tl, ul, w = inputs(B, T, U, V, dtype, ctx.device)
    fused, full = _fused_pair(kind, joiner, y, tl, ul, V, ctx.backend, tile)
    got = _fused_grads(joiner, enc, pred, fused, w)
    head = ""
    if reruns:
        again = _fused_grads(joiner, enc, pred, fused, w)
        if not all(torch.equal(a, b) for a, b in zip(got, again)):
            raise CheckFailed(f"{what} {kind}: two runs gave different gradients")
        head = "2 runs bit-identical  "
    want = _fused_grads(joiner, enc, pred, full, w)
    lt, gt = tolerance(dtype)
    errs = {"loss err": _err(got[0], want[0]),
            "grad enc/pred": max(_err(got[1], want[1], 1e-30), _err(got[2], want[2], 1e-30)),
            "grad params": max(_err(a, b, 1e-30) for a, b in zip(got[3:], want[3:]))}
    # The parameters' gradients sum the logits' gradient over every node: their rounding
    # grows with the number of rows summed in dtype (both sides sum in their own order).
    return head + _within(f"{what} {kind}", errs, {
        "loss err": lt, "grad enc/pred": gt, "grad params": 10 * gt})


def check_fused(ctx, shape, dtype, kind, tile):
    """The fused joiner and loss (tiles of ``tile`` rows) against the loss of the
    materialised logits on the float64 reference (:func:`_check_fused_pair`)."""
    return f"tile {tile} rows  " + _check_fused_pair(ctx, shape, dtype, kind, tile, _Joiner, 16,
                                                     "fused")


def _kernel_joiner(H, V, dtype, device, seed=3) -> rnnt_lattice.Joiner:
    """The joiner the kernels know, ``out(tanh(enc_proj(e) + pred_proj(p)))``, with the
    weights of :class:`_Joiner` (its logits three times smaller)."""
    joiner = rnnt_lattice.Joiner(H, H, H, V)
    with torch.no_grad():
        for dst, src in zip(joiner.parameters(), _Joiner(H, V, torch.float32, "cpu", seed).parameters()):
            dst.copy_(src * (3.0 if dst is joiner.out.weight or dst is joiner.out.bias else 1.0))
    return joiner.to(dtype=dtype, device=device)


@contextlib.contextmanager
def _joint_switch(name: str):
    """``gpu.joint.<name>`` on for the block, put back after it: ``IEEE_FLOAT32``, the
    joiner's kernel path for float32 operands whatever TF32 says (on a GPU with TF32 off,
    PyTorch's default, a float32 ``Joiner`` takes the tile path, cuBLAS's IEEE products,
    and a check of the kernels would check the tiles); ``CUBLAS_PRODUCTS``, each chunk's
    logits by cuBLAS (off by default until a GPU times it)."""
    from .gpu import joint
    saved = getattr(joint, name)
    setattr(joint, name, True)
    try:
        yield
    finally:
        setattr(joint, name, saved)


def check_joint(ctx, shape, dtype, kind):
    """The joiner's kernel path (``rnnt_lattice.Joiner`` on the Triton backend: the
    logits in registers, never in memory; float32 with IEEE products, :func:`_joint_switch`)
    against the loss of the materialised logits on the float64 reference, and a second
    backward bit-identical to the first (the kernel path sums in a fixed order;
    :func:`_check_fused_pair`)."""
    B, T, U, V = shape
    with _joint_switch("IEEE_FLOAT32"):
        return _check_fused_pair(ctx, shape, dtype, kind, B * (U + 1) * 3, _kernel_joiner, 24,
                                 "joiner kernels", reruns=True)


def check_joint_cublas(ctx, shape, dtype, kind):
    """:func:`check_joint` with each chunk's logits made by cuBLAS and read by the backend's
    passes over V (``gpu.joint.CUBLAS_PRODUCTS``; every dtype takes it, float64 too)."""
    B, T, U, V = shape
    with _joint_switch("CUBLAS_PRODUCTS"):
        return _check_fused_pair(ctx, shape, dtype, kind, B * (U + 1) * 3, _kernel_joiner, 24,
                                 "joiner chunks by cuBLAS", reruns=True)


def _amp_grads(loss_fn, params, enc, pred, w, backward_inside, device):
    """PyTorch's AMP recipe on ``loss_fn(e, p) -> costs (B,)``: the forward under
    ``torch.autocast`` (bfloat16) on fresh leaves of ``enc`` and ``pred``, ``backward()`` of
    the ``w``-weighted sum inside the block or after it; the costs and the gradients of
    ``e``, ``p`` and ``params``."""
    for q in params:
        q.grad = None
    e, p = enc.clone().requires_grad_(), pred.clone().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        costs = loss_fn(e, p)
        loss = (costs * w.to(costs.dtype)).sum()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    return [costs.detach(), e.grad, p.grad] + [q.grad.clone() for q in params]


def check_joint_amp(ctx):
    """The joiner's kernel path under PyTorch's AMP recipe (forward under ``torch.autocast``
    in bfloat16, backward outside): the operands are bfloat16 in both passes, so the
    gradients equal those of ``backward()`` inside the block, and those of the tile path
    on the same joiner to bfloat16 rounding."""
    B, T, U, V, H = 3, 12, 4, 24, 16
    joiner = _kernel_joiner(H, V, torch.float32, ctx.device)
    g = torch.Generator(device="cpu").manual_seed(5)
    enc = torch.randn(B, T, H, generator=g).to(ctx.device)
    pred = torch.randn(B, U + 1, H, generator=g).to(ctx.device)
    _, y, tl, ul, w = inputs(B, T, U, V, torch.float32, ctx.device)

    def grads(joiner_, backward_inside):
        return _amp_grads(lambda e, p: rnnt_lattice.fused_rnnt_loss(
            joiner_, e, p, y, tl, ul, blank=0, reduction="none", backend=ctx.backend),
            list(joiner.parameters()), enc, pred, w, backward_inside, ctx.device)

    outside, inside = grads(joiner, False), grads(joiner, True)
    tiles = grads(lambda e, p: joiner(e, p), False)       # not a Joiner: the tile path
    errs = {"outside vs inside": max(_err(a, b, 1e-30) for a, b in zip(outside, inside)),
            "vs tile path": max(_err(a, b, 1e-30) for a, b in zip(outside, tiles))}
    return _within("joiner kernels AMP recipe", errs, {"outside vs inside": 1e-6,
                                                       "vs tile path": 3e-2})


def check_amp(ctx, kind):
    """PyTorch's AMP recipe on a fused loss: the forward under ``torch.autocast`` (bfloat16),
    ``backward()`` outside the block, against ``backward()`` inside it. The recomputation
    in the backward replays the forward's autocast state, so both give the same gradients
    (to bfloat16 rounding). CUDA's autocast runs some ops (``sum``) in float32 where the
    CPU's does not, so only a GPU run checks the CUDA branch of the recipe."""
    B, T, U, V, H = 3, 12, 4, 24, 16
    n_dur = len(TOPOLOGY_LOSSES.get(kind, {}).get("durations", ()))
    joiner = _Joiner(H, V + n_dur, torch.float32, ctx.device)
    g = torch.Generator(device="cpu").manual_seed(5)
    enc = torch.randn(B, T, H, generator=g).to(ctx.device)
    pred = torch.randn(B, U + 1, H, generator=g).to(ctx.device)
    _, y, tl, ul, w = inputs(B, T, U, V, torch.float32, ctx.device)
    if kind == "rnnt":
        name, kw = "fused_rnnt_loss", dict(blank=0)
    else:
        n_blanks = 1 + len(TOPOLOGY_LOSSES[kind].get("big_blank_durations", ()))
        y = y % (V - n_blanks)
        name = {"tdt": "fused_tdt_loss", "multiblank": "fused_multiblank_rnnt_loss"}[kind]
        kw = dict(blank=V - 1, **TOPOLOGY_LOSSES[kind])

    def grads(backward_inside):
        return _amp_grads(lambda e, p: getattr(rnnt_lattice, name)(
            joiner, e, p, y, tl, ul, tile=2 * (U + 1), reduction="none", backend=ctx.backend,
            **kw), list(joiner.parameters()), enc, pred, w, backward_inside, ctx.device)

    outside, inside = grads(False), grads(True)
    err = max(_err(a, b, 1e-30) for a, b in zip(outside, inside))
    return _within(f"AMP recipe {kind}", {"outside vs inside": err}, {"outside vs inside": 1e-6})


# The bad inputs of the device check (``_validate.device_value_check``), each with the rule
# whose device-side message names it: (what, rule, edit of (targets, logit_lengths,
# target_lengths) on sequence 1).
BAD_INPUTS = (
    ("label >= V", "targets", lambda y, tl, ul, T, U, V: y[1].fill_(V)),
    ("label < 0", "targets", lambda y, tl, ul, T, U, V: y[1].fill_(-1)),
    ("logit_lengths > T", "lengths", lambda y, tl, ul, T, U, V: tl[1].fill_(T + 1)),
    ("target_lengths > U", "lengths", lambda y, tl, ul, T, U, V: ul[1].fill_(U + 1)),
    ("negative logit_lengths", "lengths", lambda y, tl, ul, T, U, V: tl[1].fill_(-2)),
)

_BAD_INPUT_SCRIPT = """
import sys, torch, rnnt_lattice
from rnnt_lattice import selfcheck
mode, device, backend = sys.argv[1:4]
B, T, U, V = 3, 12, 4, 10
x, y, tl, ul, _ = selfcheck.inputs(B, T, U, V, torch.float32, device)
if mode == "nan":              # asserts off: the NaN pattern of every bad input
    torch._assert_async = lambda *args: None
    for what, rule, edit in selfcheck.BAD_INPUTS:
        y2, tl2, ul2 = y.clone(), tl.clone(), ul.clone()
        edit(y2, tl2, ul2, T, U, V)
        costs = rnnt_lattice.rnnt_loss(x, y2, tl2, ul2, blank=0, reduction="none", backend=backend)
        print("NAN", what, "".join("n" if c else "f" for c in torch.isnan(costs).tolist()))
else:                          # the first bad input, with its device-side assert
    what, rule, edit = selfcheck.BAD_INPUTS[0]
    edit(y, tl, ul, T, U, V)
    costs = rnnt_lattice.rnnt_loss(x, y, tl, ul, blank=0, reduction="none", backend=backend)
    torch.cuda.synchronize() if device == "cuda" else None
    print("NO ERROR", costs.tolist())
"""


def check_bad_input(ctx):
    """Bad lengths and labels (:data:`BAD_INPUTS`) on the device path: with the device-side
    asserts off, the bad sequence's loss is NaN and the others' are not; with them on, the
    process fails with the message that names the argument and the rule (run in a
    subprocess: a device-side assert ends the process's CUDA context); and
    ``set_input_checks("host")`` gives the CPU's ValueError, in this process."""
    from ._rules import device_message
    env = dict(os.environ)
    device_path = ctx.cuda or ctx.backend == "triton"
    if not ctx.cuda:               # CPU tensors under the Triton interpreter: force the device path
        env["RNNT_LATTICE_INPUT_CHECKS"] = "device"
    if not device_path:            # the CPU's own backend: the host checks alone
        return _host_bad_inputs(ctx) + " (the device path runs on CUDA)"
    cmd = [sys.executable, "-c", _BAD_INPUT_SCRIPT]
    nan = subprocess.run(cmd + ["nan", ctx.device, ctx.backend], env=env, capture_output=True,
                         text=True, timeout=600)
    pattern = {line.split(" ", 1)[1].rsplit(" ", 1)[0]: line.rsplit(" ", 1)[1]
               for line in nan.stdout.splitlines() if line.startswith("NAN ")}
    wrong = [w for w, _, _ in BAD_INPUTS if pattern.get(w) != "fnf"]
    if nan.returncode or wrong:
        raise CheckFailed(f"bad inputs not NaN on their sequence alone: {wrong or 'crashed'} "
                          f"{nan.stdout[-300:]} {nan.stderr[-500:]}")
    what, rule, _ = BAD_INPUTS[0]
    died = subprocess.run(cmd + ["assert", ctx.device, ctx.backend], env=env,
                          capture_output=True, text=True, timeout=600)
    said = died.stdout + died.stderr
    if died.returncode == 0 or device_message(rule)[:60] not in said:
        raise CheckFailed(f"{what}: no device-side assert naming it: {said[-600:]}")
    return (f"{len(BAD_INPUTS)} bad inputs: NaN on their sequence; device-side assert "
            f"'{device_message(rule)[:40]}...'; " + _host_bad_inputs(ctx))


_RECOMPUTE_SCRIPT = """
import sys, torch, rnnt_lattice
device, backend, fused = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
torch.manual_seed(0)
B, T, U, V, H = 3, 6, 3, 11, 8
out = torch.nn.Linear(H, V).to(device)
enc = torch.randn(B, T, 1, H, device=device, requires_grad=True)
pred = torch.randn(B, 1, U + 1, H, device=device, requires_grad=True)
y = torch.randint(1, V, (B, U), device=device)
lengths = lambda n: torch.full((B,), n, device=device)


def joiner(e, p):
    x = out(torch.tanh(e + p))
    x = x if fused else x.log_softmax(-1)
    return x * 1.01 if torch.is_grad_enabled() else x     # the recomputation drifts


loss = rnnt_lattice.fused_rnnt_loss(joiner, enc[:, :, 0], pred[:, 0], y, lengths(T), lengths(U),
                                    blank=0, backend=backend, fused_log_softmax=fused, tile=7)
loss.backward()
torch.cuda.synchronize() if device == "cuda" else None
print("NO ERROR", loss.item())
"""


def check_recompute(ctx):
    """A fused loss whose joiner gives other logits when the backward recomputes a tile
    (each 1% larger): the process fails with the ``"recompute"`` message, from the device
    on CUDA (the Triton gradient pass's check in fused mode; the rows' sums in log-prob
    mode), in a subprocess (a device-side assert ends the CUDA context)."""
    from ._rules import device_message
    want = device_message("recompute")[:60]
    for fused in ("1", "0"):
        died = subprocess.run([sys.executable, "-c", _RECOMPUTE_SCRIPT, ctx.device, ctx.backend,
                               fused], capture_output=True, text=True, timeout=600)
        said = died.stdout + died.stderr
        if died.returncode == 0 or want not in said:
            mode = "fused" if fused == "1" else "log-prob"
            raise CheckFailed(f"{mode} mode: a drifting recomputation went unnoticed: "
                              f"{said[-600:]}")
    return f"fused and log-prob modes: '{want[:40]}...'"


def _host_bad_inputs(ctx) -> str:
    """``set_input_checks("host")``: each of :data:`BAD_INPUTS` is a ValueError."""
    from ._validate import set_input_checks
    before = set_input_checks("host")
    try:
        B, T, U, V = 3, 12, 4, 10
        x, y, tl, ul, _ = inputs(B, T, U, V, torch.float32, ctx.device)
        missed = []
        for what, _, edit in BAD_INPUTS:
            y2, tl2, ul2 = y.clone(), tl.clone(), ul.clone()
            edit(y2, tl2, ul2, T, U, V)
            try:
                rnnt_lattice.rnnt_loss(x, y2, tl2, ul2, blank=0, backend=ctx.backend)
                missed.append(what)
            except ValueError:
                pass
    finally:
        set_input_checks(before)
    if missed:
        raise CheckFailed(f"set_input_checks('host') gave no ValueError for {missed}")
    return "ValueError with set_input_checks('host')"


# --------------------------------------------------------------------------- torch.compile
def check_compile(ctx, shape):
    """``torch.compile(fullgraph=True)`` (AOTAutograd, the backend ``"aot_eager"``: the
    custom op ``rnnt_lattice::rnnt_costs_and_grad``, its fake implementation and registered
    backward; Inductor's code generation adds nothing of ours) of the regular and the TDT
    loss against the float64 torch backend, and a bad label in the compiled call: the op
    prepares the call again on the values when it runs, so ``set_input_checks("host")``
    gives the eager call's ValueError (the device path's assert is :func:`check_bad_input`'s)."""
    from ._validate import set_input_checks
    B, T, U, V = shape
    errs = {}
    for kind in ("regular", "tdt"):
        if kind == "tdt":
            x, y, tl, ul, w = _topology_inputs(kind, shape, torch.float32, ctx.device)
            fn = _topology_fn(kind, y, tl, ul, x.shape[-1])
        else:
            x, y, tl, ul, w = inputs(B, T, U, V, torch.float32, ctx.device)
            fn = _rnnt(x, y, tl, ul, clamp=0.5, fastemit_lambda=0.1)
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        costs, grad = _loss_and_grad(compiled, x, w, backend=ctx.backend)
        ref_costs, ref_grad = _loss_and_grad(fn, x.double(), w.double(), backend="torch")
        errs[f"{kind} loss err"] = _err(costs, ref_costs)
        errs[f"{kind} grad err"] = _err(grad, ref_grad, 1e-30)
    lt, gt = tolerance(torch.float32)
    detail = _within("compiled", errs, {k: lt if "loss" in k else gt for k in errs})
    x, y, tl, ul, _ = inputs(B, T, U, V, torch.float32, ctx.device)
    y[0, 0] = V                      # a label outside [0, V) (sequence 0 has all U labels)
    before = set_input_checks("host")
    try:
        torch.compile(_rnnt(x, y, tl, ul), backend="aot_eager", fullgraph=True)(
            x, reduction="none", backend=ctx.backend)
    except ValueError as e:
        if "targets[0, 0]" not in str(e):
            raise CheckFailed(f"compiled, a bad label's ValueError names something else: {e}")
    else:
        raise CheckFailed("compiled, a label >= V gave no ValueError (set_input_checks('host'))")
    finally:
        set_input_checks(before)
        torch._dynamo.reset()
    return detail + "; a bad label: the eager call's ValueError"


# --------------------------------------------------------------------------- lattice tools
def check_tools(ctx, shape, dtype, kind):
    """occupancy (gamma of every arc kind, log-likelihood) and best_alignment (best path
    log-prob; the same path unless two paths tie within rounding) against the torch
    backend on the float64 copy."""
    B, T, U, V = shape
    if kind == "tdt":
        x, y, tl, ul, _ = inputs(B, T, U, V + 3, dtype, ctx.device)
        y = y % (V - 1)
        kw = dict(blank=V - 1, topology=tdt_topology([0, 1, 2]), sigma=0.05)
    else:
        x, y, tl, ul, _ = inputs(B, T, U, V, dtype, ctx.device)
        kw = dict(blank=0)
    occ = rnnt_lattice.occupancy(x, y, tl, ul, backend=ctx.backend, **kw)
    ref = rnnt_lattice.occupancy(x.double(), y, tl, ul, backend="torch", **kw)
    ali = rnnt_lattice.best_alignment(x, y, tl, ul, backend=ctx.backend, **kw)
    ref_ali = rnnt_lattice.best_alignment(x.double(), y, tl, ul, backend="torch", **kw)
    lt, gt = tolerance(dtype)
    errs = {"gamma": _err(occ.gamma, ref.gamma), "log P": _err(occ.log_likelihood, ref.log_likelihood),
            "best log-prob": _err(ali.log_prob, ref_ali.log_prob)}
    line = _within(f"tools {kind}", errs, {"gamma": gt, "log P": lt, "best log-prob": lt})
    same = torch.equal(ali.arc_kinds.cpu(), ref_ali.arc_kinds.cpu())
    if not same and dtype == torch.float64:
        raise CheckFailed(f"tools {kind}: best paths differ on the same float64 numbers")
    return line + ("" if same else "  (best paths differ at a tie within rounding)")


def check_window_dp(ctx, shape):
    """The window DP kernel against the PyTorch loop (same best total, same starts), k2's
    window rule (``k2_starts``) against the reference on occupations full of ties (the
    first start wins: the Triton interpreter breaks every tie that way, a GPU's argmax only
    when told), and the public ``prune_ranges(method="exact")`` / ``prune_coverage`` on it:
    never less mass than k2's windows, coverage non-decreasing in R and 1 once R > U."""
    B, T, U, V = shape
    g = torch.Generator(device="cpu").manual_seed(13)
    mass = torch.rand(B, T, U, dtype=torch.float64, generator=g).to(ctx.device)
    impl = _backends.load(ctx.backend)
    for step in (1, 3):
        got, want = impl.window_dp(mass, step), torch_backend.window_dp(mass, step)
        if _err(got[0], want[0]) > 1e-12 or not torch.equal(got[1].cpu(), want[1].cpu()):
            raise CheckFailed(f"window DP (max_step {step}): totals err {_err(got[0], want[0]):.1e}, "
                              f"starts equal {torch.equal(got[1].cpu(), want[1].cpu())}")
    ties = torch.randint(0, 3, (2, B, T, U + 1), generator=g).double() / 4
    ends = torch.full((B,), T), torch.full((B,), U)
    for R, R_e in ((2, 2), (3, 3), (3, 2)):
        got = impl.k2_starts(*ties.to(ctx.device), *(e.to(ctx.device) for e in ends), R, R_e)
        want = torch_backend.k2_starts(*ties, *ends, R, R_e)
        if not torch.equal(got.cpu(), want):
            raise CheckFailed(f"k2 window starts (R {R}, R_e {R_e}) differ from the reference "
                              f"at {int((got.cpu() != want).sum())} frames")
    am, lm, y, tl, ul, _ = _simple_inputs(shape, torch.float64, ctx.device)
    with torch.no_grad():
        _, occ = rnnt_lattice.rnnt_loss_simple(lm, am, y, tl, ul, blank=0, backend=ctx.backend,
                                               return_occupations=True)
    exact = rnnt_lattice.prune_ranges(occ, 3, method="exact")
    k2 = rnnt_lattice.prune_ranges(occ, 3, method="k2")
    if not (exact.covered >= k2.covered - 1e-12).all():
        raise CheckFailed(f"prune_ranges exact covers less than k2's windows: "
                          f"{exact.covered.tolist()} < {k2.covered.tolist()}")
    x, y2, tl2, ul2, _ = inputs(B, T, U, V, torch.float32, ctx.device)
    cov = rnnt_lattice.prune_coverage(
        rnnt_lattice.occupancy(x, y2, tl2, ul2, blank=0, backend=ctx.backend), U + 1)
    total = cov.total.double().cpu()
    if not ((total[1:] >= total[:-1] - 1e-12).all() and abs(total[-1].item() - 1) < 1e-9):
        raise CheckFailed(f"prune_coverage: total {total.tolist()} not non-decreasing to 1")
    return (f"DP kernel = PyTorch loop, k2 starts = reference; exact windows cover "
            f"{exact.covered.mean().item():.4f} >= k2's {k2.covered.mean().item():.4f}; coverage -> 1 at R = U+1")


def check_deterministic(ctx, shape):
    """``torch.use_deterministic_algorithms(True)``, a reproducible training script's setting:
    on CUDA torch refuses, under it, the ops that have no deterministic kernel (a floating
    ``cumsum``: ``prune_ranges(method="exact")`` and ``prune_coverage`` summed with one), so
    every call here must run under it; then the loss and its gradient, the occupations,
    windows and coverage are the same bits twice, and the values of the calls without the
    mode. The simple and smoothed losses too, with a repeated label and nodes rescued in the
    log domain (where their backward adds terms in a fixed order under the mode, atomics
    otherwise), where the mode allows their matrix products: on CUDA only with
    ``CUBLAS_WORKSPACE_CONFIG`` set to ``:4096:8`` or ``:16:8`` before the process starts
    (torch's rule for cuBLAS; without it they are left out, and the result says so)."""
    B, T, U, V = shape
    x, y, tl, ul, w = inputs(B, T, U, V, torch.float32, ctx.device)
    names = ["loss", "gradient", "occupations", "windows", "coverage"]
    simple = not ctx.cuda or os.environ.get("CUBLAS_WORKSPACE_CONFIG") in (":4096:8", ":16:8")
    simple_losses = ((rnnt_lattice.rnnt_loss_simple, rnnt_lattice.rnnt_loss_smoothed) if simple
                     else ())
    if simple:
        am, lm, ys, tls, uls, ws = _simple_inputs((B, T, max(U, 2), V), torch.float32,
                                                  ctx.device)
        ys[0, 1] = ys[0, 0]                                    # a class read twice by a row
        am[0, :, 1] += 1000.0                                  # nodes beyond float64's range:
        lm[0, :, 2] += 1000.0                                  # the rescue
        names += [f"{n} {k}" for n in ("simple", "smoothed") for k in ("loss", "grad lm",
                                                                        "grad am")]

    def run():
        xx = x.clone().requires_grad_()
        loss = rnnt_lattice.rnnt_loss(xx, y, tl, ul, blank=0, reduction="none",
                                      backend=ctx.backend)
        (loss * w).sum().backward()
        occ = rnnt_lattice.occupancy(x, y, tl, ul, blank=0, backend=ctx.backend)
        win = rnnt_lattice.prune_ranges((occ.node, occ.node), 3, logit_lengths=tl,
                                        target_lengths=ul)
        cover = rnnt_lattice.prune_coverage(occ, U + 1)
        out = [loss.detach(), xx.grad, occ.node, win.ranges, cover.total]
        for fn in simple_losses:
            lm_, am_ = lm.clone().requires_grad_(), am.clone().requires_grad_()
            cost = fn(lm_, am_, ys, tls, uls, blank=0, reduction="none", backend=ctx.backend)
            (cost * ws.to(cost.dtype)).sum().backward()
            out += [cost.detach(), lm_.grad, am_.grad]
        return out

    want = run()
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    try:
        first, second = run(), run()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    errs = []
    for name, a, b, c in zip(names, first, second, want):
        if not torch.equal(a, b):
            raise CheckFailed(f"deterministic mode: the {name} differ between two runs")
        if not c.is_floating_point():
            if not torch.equal(a, c):
                raise CheckFailed(f"deterministic mode: other {name} than without the mode")
            continue
        errs.append(_err(a, c))
        if errs[-1] > 1e-6:
            raise CheckFailed(f"deterministic mode: {name} err {errs[-1]:.1e} against the "
                              f"calls without the mode")
    losses = ("rnnt_loss, occupancy, prune_ranges exact, prune_coverage"
              + (", the simple and smoothed losses (a repeated label, rescued nodes)" if simple
                 else "; the simple losses not run (CUBLAS_WORKSPACE_CONFIG is not :4096:8 "
                      "or :16:8)"))
    return f"{losses}: twice the same bits; against the calls without the mode err {max(errs):.1e}"


# --------------------------------------------------------------------------- CUDA only
@contextlib.contextmanager
def no_sync():
    """Any host synchronisation inside raises (``torch.cuda.set_sync_debug_mode``)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check_no_sync(ctx):
    """Forward and backward of every loss, option and topology, the pruned pipeline, the
    fused loss and the lattice tools, with host synchronisation made an error. Every group
    runs; the failure names each group that synchronised."""
    shape = (4, 30, 8, 40)
    x, y, tl, ul, w = inputs(*shape, torch.float32, "cuda")
    groups = []
    cases = [dict(reduction=r) for r in ("none", "sum", "mean")] + [
        dict(clamp=0.5), dict(fastemit_lambda=0.2), dict(fused_log_softmax=False),
        dict(zero_infinity=True), dict(inplace_grad=True), dict(delay_penalty=0.05),
        dict(rnnt_type="modified", delay_penalty=0.05), dict(rnnt_type="constrained"),
        dict(rnnt_type="one_sym_per_frame"),
        dict(dtype=torch.float16), dict(dtype=torch.bfloat16, clamp=1.0, fastemit_lambda=0.1)]
    for opts in cases:
        opts = dict(opts)
        dtype = opts.pop("dtype", torch.float32)
        leaf = x.to(dtype).clone().requires_grad_()

        def loss(leaf=leaf, opts=opts):
            costs = rnnt_lattice.rnnt_loss(leaf, y, tl, ul, blank=0, backend=ctx.backend, **opts)
            costs.backward(torch.ones_like(costs))
        groups.append((f"rnnt_loss {opts or 'plain'} {_dtype_name(dtype)}", loss))
    for kind in TOPOLOGY_LOSSES:
        xk, yk, tk, uk, wk = _topology_inputs(kind, shape, torch.float32, "cuda")
        groups.append((kind, lambda xk=xk, yk=yk, tk=tk, uk=uk, wk=wk, kind=kind: _loss_and_grad(
            _topology_fn(kind, yk, tk, uk, xk.shape[-1]), xk, wk, backend=ctx.backend)))
    xt = torch.cat([x, x[..., :3]], -1)
    tdt_kw = dict(topology=tdt_topology([0, 1, 2]), sigma=0.05, backend=ctx.backend)
    groups.append(("occupancy / best_alignment", lambda: (
        rnnt_lattice.occupancy(x, y, tl, ul, blank=0, backend=ctx.backend).node,
        rnnt_lattice.best_alignment(x, y, tl, ul, blank=0, backend=ctx.backend).emit_frames)))
    groups.append(("TDT occupancy / best_alignment", lambda: (
        rnnt_lattice.occupancy(xt, y % 39, tl, ul, 39, **tdt_kw).gamma,
        rnnt_lattice.best_alignment(xt, y % 39, tl, ul, 39, **tdt_kw).arc_kinds)))
    am, lm, ys, ts, us, _ = _simple_inputs(shape, torch.float32, "cuda")
    for name in ("rnnt_loss_simple", "rnnt_loss_smoothed"):
        for delay in (0.0, 0.05):
            def simple(name=name, delay=delay):
                lm_, am_ = lm.clone().requires_grad_(), am.clone().requires_grad_()
                getattr(rnnt_lattice, name)(lm_, am_, ys, ts, us, blank=0, delay_penalty=delay,
                                            backend=ctx.backend).backward()
            groups.append((f"{name} delay_penalty={delay}", simple))
    far_am, far_lm = am.double(), lm.double()
    far_am[..., 1] += 1000.0
    far_lm[..., 2] += 1000.0
    groups.append(("rnnt_loss_simple, rescued nodes", lambda: rnnt_lattice.rnnt_loss_simple(
        far_lm.clone().requires_grad_(), far_am.clone().requires_grad_(), ys, ts, us, blank=0,
        backend=ctx.backend).backward()))
    y3, t3, u3, ranges = _windows(shape, "cuda", "regular")
    xp = torch.randn(4, 30, ranges.shape[-1], 40, device="cuda", requires_grad=True)
    groups.append(("rnnt_loss_pruned", lambda: rnnt_lattice.rnnt_loss_pruned(
        xp, y3, ranges, t3, u3, blank=0, backend=ctx.backend).backward()))
    am_w, lm_w = am.clone().requires_grad_(), lm.clone().requires_grad_()
    groups.append(("do_rnnt_pruning", lambda: sum(
        x.sum() for x in rnnt_lattice.do_rnnt_pruning(am_w, lm_w, ranges)).backward()))
    joiner = _Joiner(16, 40, torch.float32, "cuda")
    enc = torch.randn(4, 30, 16, device="cuda", requires_grad=True)
    pred = torch.randn(4, 9, 16, device="cuda", requires_grad=True)
    groups.append(("fused_rnnt_loss", lambda: rnnt_lattice.fused_rnnt_loss(
        joiner, enc, pred, y, tl, ul, blank=0, tile=64, backend=ctx.backend).backward()))
    kernel_joiner = _kernel_joiner(16, 40, torch.float32, "cuda")
    for amp in (False, True):
        def joint(amp=amp):
            with _joint_switch("IEEE_FLOAT32"), torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                loss = rnnt_lattice.fused_rnnt_loss(kernel_joiner, enc, pred, y, tl, ul, blank=0,
                                                    tile=64, backend=ctx.backend)
            loss.backward()
        groups.append((f"fused_rnnt_loss, the joiner's kernels{' under autocast' if amp else ''}",
                       joint))
    failed = []
    for label, fn in groups:
        try:
            with no_sync():
                fn()
        except RuntimeError as err:
            failed.append(f"{label} ({str(err).strip().splitlines()[0][:100]})")
    if failed:
        raise CheckFailed(f"{len(failed)} of {len(groups)} groups synchronise: " + "; ".join(failed))
    return f"{len(groups)} groups: every rnnt_loss option and rnnt_type, half types, TDT, " \
           f"multi-blank, lattice tools, simple/smoothed (delay penalty too), pruned, fused, " \
           f"the joiner's kernels"


def check_cuda_graph(ctx):
    """Forward+backward captured in a CUDA graph, replayed on new logits in the same
    buffer: bit-identical losses and gradients to eager calls."""
    B, T, U, V = 4, 50, 12, 64
    _, y, tl, ul, _ = inputs(B, T, U, V, torch.float32, "cuda")
    opts = dict(blank=0, clamp=0.5, fastemit_lambda=0.1)
    static_x = torch.randn(B, T, U + 1, V, device="cuda", requires_grad=True)

    def step():
        static_x.grad = None
        rnnt_lattice.rnnt_loss(static_x, y, tl, ul, **opts).backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                     # warm-up: compile the kernels
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    static_x.grad = None
    with torch.cuda.graph(graph):
        static_loss = rnnt_lattice.rnnt_loss(static_x, y, tl, ul, **opts)
        static_loss.backward()
    static_grad = static_x.grad
    for seed in (1, 2, 3):
        new = torch.randn(B, T, U + 1, V, device="cuda",
                          generator=torch.Generator(device="cuda").manual_seed(seed))
        with torch.no_grad():
            static_x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        eager = new.clone().requires_grad_()
        eager_loss = rnnt_lattice.rnnt_loss(eager, y, tl, ul, **opts)
        eager_loss.backward()
        if not (torch.equal(static_loss, eager_loss) and torch.equal(static_grad, eager.grad)):
            raise CheckFailed(f"replay {seed}: loss {static_loss.item()} vs eager "
                              f"{eager_loss.item()}, gradients equal "
                              f"{torch.equal(static_grad, eager.grad)}")
    return "3 replays bit-identical to eager"


def check_peak_memory(ctx):
    """Memory allocated by forward+backward beyond the logits: the gradient (1x the
    logits) plus the float64 lattice (a few percent at V = 1024); with ``inplace_grad``
    the gradient is written over the logits (no gradient buffer)."""
    B, T, U, V = 4, 100, 30, 1024
    _, y, tl, ul, _ = inputs(B, T, U, 2, torch.float32, "cuda")
    x = _device_logits((B, T, U + 1, V), ctx.device)
    nbytes = x.numel() * x.element_size()
    ratios = {}
    for inplace in (False, True):
        leaf = x.clone().requires_grad_()
        for _ in range(2):                               # the second call is measured
            leaf.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            rnnt_lattice.rnnt_loss(leaf, y, tl, ul, blank=0, inplace_grad=inplace).backward()
            torch.cuda.synchronize()
        ratios[inplace] = (torch.cuda.max_memory_allocated() - base) / nbytes
        del leaf
    line = (f"extra peak / logits: gradient {ratios[False]:.3f}x, inplace_grad "
            f"{ratios[True]:.3f}x  (logits {nbytes / 2**20:.0f} MiB; limits 1.15x, 0.15x)")
    if ratios[False] > 1.15 or ratios[True] > 0.15:
        raise CheckFailed(line)
    return line


def check_big_offsets(ctx):
    """(3, 1100, 1000, 1001) float32: 3.3e9 elements; the last sequence's rows lie past
    2**31 elements. Short sequences keep the reference small: it runs on their slices. V is
    odd: the rows start anywhere, and the row pass reads them from their aligned span
    (``gpu._span``) with offsets past 2**31; the aligned rows' path, unchanged since, passed
    it with V = 1000 on an H100 (benchmarks/results/gpu/h100-cuda-checks-big.log)."""
    B, T, U1, V = 3, 1100, 1000, 1001
    x = torch.empty(B, T, U1, V, device="cuda")
    x.normal_(generator=torch.Generator(device="cuda").manual_seed(0))
    lens = [(60, 25), (7, 3), (80, 40)]
    tl = torch.tensor([t for t, _ in lens], device="cuda")
    ul = torch.tensor([u for _, u in lens], device="cuda")
    y = torch.randint(1, V, (B, U1 - 1), device="cuda")
    w = torch.tensor([1.0, -0.5, 2.0], device="cuda")
    costs, grad = _loss_and_grad(_rnnt(x, y, tl, ul), x, w, backend="triton")
    lines = []
    for b, (T_b, U_b) in enumerate(lens):
        xs = x[b:b + 1, :T_b, :U_b + 1].double()
        fn = _rnnt(xs, y[b:b + 1, :U_b], tl[b:b + 1], ul[b:b + 1])
        rc, rg = _loss_and_grad(fn, xs, w[b:b + 1].double(), backend="torch")
        lines.append(_within(f"sequence {b}", {"loss err": _err(costs[b:b + 1], rc),
                                               "grad err": _err(grad[b:b + 1, :T_b, :U_b + 1], rg, 1e-30)},
                             {"loss err": 1e-6, "grad err": 1e-5}))
    del x, grad
    torch.cuda.empty_cache()
    return f"{len(lines)} sequences, the last past 2**31 elements: {lines[-1]}"


# --------------------------------------------------------------------------- timing
def _time(fn, reps: int, cuda: bool) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _device_logits(shape, device):
    """Standard-normal float32 logits drawn on ``device`` (no host copy of a large tensor)."""
    g = torch.Generator(device=device).manual_seed(0)
    return torch.randn(shape, generator=g, device=device)


def check_timing(ctx):
    """rnnt_loss forward+backward at the standard shape against the copy floor (a clone
    and an exp of the same logits: one read and one write of them each) and torchaudio's
    rnnt_loss if it imports. Reported, not judged."""
    B, T, U, V = ctx.plan.timing_shape
    _, y, tl, ul, _ = inputs(B, T, U, 2, torch.float32, ctx.device)
    y = torch.randint(1, V, (B, U), generator=torch.Generator().manual_seed(1),
                      dtype=torch.int32).to(ctx.device)
    x = _device_logits((B, T, U + 1, V), ctx.device)
    leaf = x.clone().requires_grad_()

    def ours():
        leaf.grad = None
        rnnt_lattice.rnnt_loss(leaf, y, tl, ul, blank=0, backend=ctx.backend).backward()

    reps = ctx.plan.timing_reps
    t = {"shape": [B, T, U, V], "dtype": "float32",
         "rnnt_lattice_s": _time(ours, reps, ctx.cuda),
         "clone_s": _time(lambda: x.clone(), reps, ctx.cuda),
         "exp_s": _time(lambda: torch.exp(x), reps, ctx.cuda)}
    try:
        import torchaudio.functional as taf
    except Exception:        # not installed, or a build that does not load with this torch
        taf = None
    if taf is not None:
        leaf_ta = x.clone().requires_grad_()

        def theirs():
            leaf_ta.grad = None
            taf.rnnt_loss(leaf_ta, y, tl, ul, blank=0).backward()
        try:
            t["torchaudio_s"] = _time(theirs, reps, ctx.cuda)
        except Exception as err:        # e.g. a CPU-only torchaudio build on CUDA tensors
            t["torchaudio_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    ctx.timing = t
    floor = t["exp_s"]
    line = (f"(B, T, U, V) = {tuple(t['shape'])} float32 forward+backward "
            f"{t['rnnt_lattice_s'] * 1e3:.2f} ms = {t['rnnt_lattice_s'] / floor:.1f}x exp "
            f"({floor * 1e3:.2f} ms), clone {t['clone_s'] * 1e3:.2f} ms")
    if "torchaudio_s" in t:
        line += f"; torchaudio {t['torchaudio_s'] * 1e3:.2f} ms"
    elif "torchaudio_error" in t:
        line += f"; torchaudio failed ({t['torchaudio_error']})"
    else:
        line += "; torchaudio not installed"
    return line


def check_cpu_vectors(ctx):
    """The CPU backend's row loops (a row's exps and their sum, where the CPU losses spend
    most of their time) compiled by this Numba's LLVM into vector code, for float32 and
    float64 rows (``cpu.fastmath.row_loop_vectors``). A scalar loop gives right values
    several times slower: the LLVM of Numba 0.59-0.61 did that to an earlier form of the
    loop, so a Numba this package has not seen may too."""
    from .cpu import fastmath
    found = fastmath.row_loop_vectors()
    bad, lanes = [], {}
    for (loop, dtype), kinds in found.items():
        name, want = ("float", 4) if dtype == "float32" else ("double", 2)
        widest = max((n for n, t in kinds if t == name), default=0)
        lanes[dtype] = min(lanes.get(dtype, widest), widest)
        if widest < want:
            bad.append(f"{loop} on {dtype} rows is "
                       + (f"{widest} wide (at least {want} wanted)" if widest else "scalar"))
        elif dtype == "float32" and any(t == "i64" for _, t in kinds):
            bad.append(f"{loop} on float32 rows holds 64-bit integer vectors (half its lanes)")
    llvm = ".".join(map(str, _llvm_version()))
    if bad:
        raise CheckFailed(f"the CPU row loops compiled by Numba {_version('numba')} (LLVM {llvm}): "
                          + "; ".join(bad) + ". The CPU losses are right but run several times "
                          "slower than they should: please report it with the block below")
    return (f"float32 rows {lanes['float32']} lanes, float64 rows {lanes['float64']} lanes "
            f"(Numba {_version('numba')}, LLVM {llvm})")


def _llvm_version() -> tuple:
    from llvmlite.binding import llvm_version_info
    return tuple(llvm_version_info)


# --------------------------------------------------------------------------- environment
def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except Exception as err:          # missing, or broken against this torch
        return f"not importable ({type(err).__name__})"
    return str(getattr(mod, "__version__", "?"))


# Compute capabilities with full-rate FP64 (1/2 of FP32): the datacentre GPUs P100 (6.0),
# V100 (7.0), A100 (8.0), H100/H200 (9.0), B200 (10.0). Every other (GeForce, RTX
# workstation, L4/L40, A10, T4, Jetson, B300's 10.3) runs FP64 at 1/32-1/64 of FP32.
FULL_RATE_FP64 = {(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)}


def fp64_class(capability) -> str:
    if capability is None:
        return "CPU: FP64 at 1/2 of FP32 (SIMD width)"
    if tuple(capability) in FULL_RATE_FP64:
        return "full rate: FP64 at 1/2 of FP32 (datacentre class, from the compute capability)"
    return ("reduced: FP64 at 1/32-1/64 of FP32 (consumer/workstation class, from the compute "
            "capability); the float64 lattice costs more here")


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "?"
    except Exception:                 # no nvidia-smi on PATH, or it hangs
        return "?"


def environment(device: str, backend: str | None = None) -> dict:
    """Versions, platform and device as a dict (the report's first lines); ``backend``:
    the one checked (default: the device's, Numba on CPU, Triton on CUDA)."""
    env = {"rnnt_lattice": rnnt_lattice.__version__, "python": platform.python_version(),
           "platform": platform.platform(), "torch": torch.__version__,
           "numpy": _version("numpy"), "numba": _version("numba"),
           "llvmlite": _version("llvmlite"), "triton": _version("triton"),
           "torchaudio": _version("torchaudio"),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "torch_cuda": torch.version.cuda, "device": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        cap = (props.major, props.minor)
        env.update(gpu=props.name, compute_capability=f"{cap[0]}.{cap[1]}",
                   gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count,
                   driver=_driver_version(), fp64=fp64_class(cap))
    else:
        env.update(cpu=platform.processor() or platform.machine(), fp64=fp64_class(None))
    env["backend"] = backend or ("triton" if device == "cuda" else "numba")
    if env["backend"] == "numba":
        try:
            env["llvm"] = ".".join(map(str, _llvm_version()))
        except Exception:             # no llvmlite: the Numba backend does not load either
            env["llvm"] = "?"
    if env["backend"] == "triton":
        env["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "") or "0"
    return env


# --------------------------------------------------------------------------- the run
def _checks(ctx: Context, big: bool) -> list:
    """``(name, function)`` of every check of the run, in order."""
    p, cs = ctx.plan, []
    f32 = torch.float32
    low = [f32] + [d for d in p.dtypes[-1:] if d != f32]             # float32, the half type
    f64 = [f32] + [d for d in p.dtypes if d == torch.float64]       # float32, float64
    cs.append((f"backend {ctx.backend} loads", lambda: _load_backend(ctx)))
    cs.append(("CPU row loops vectorised", _bind(check_cpu_vectors, ctx)
               if ctx.backend == "numba" else None))
    for shape in p.loss_shapes:
        for dtype in p.dtypes:
            options = LOSS_OPTIONS if dtype == f32 else {"plain": {}}
            for option in options:
                cs.append((f"rnnt_loss regular {option} {_dtype_name(dtype)} {shape}",
                           _bind(check_loss, ctx, shape, dtype, "regular", option)))
        for rnnt_type in ("modified", "constrained", "one_sym_per_frame"):
            for dtype in p.dtypes[:1]:
                cs.append((f"rnnt_loss {rnnt_type} {_dtype_name(dtype)} {shape}",
                           _bind(check_loss, ctx, shape, dtype, rnnt_type, "plain")))
    t = p.loss_shapes[0]
    cs.append((f"inplace_grad without a graph (no_grad, inference_mode) {t}",
               _bind(check_without_graph, ctx, t)))
    for shape in p.topo_shapes:
        for kind in TOPOLOGY_LOSSES:
            for dtype in low:
                cs.append((f"{kind} {_dtype_name(dtype)} {shape}",
                           _bind(check_topology, ctx, shape, dtype, kind)))
    t = p.tool_shape
    cs.append((f"packed float32 {t}", _bind(check_packed, ctx, t, f32)))
    for name in ("rnnt_loss_simple", "rnnt_loss_smoothed"):
        for rnnt_type in ("regular", "modified"):
            for dtype in f64:
                cs.append((f"{name} {rnnt_type} {_dtype_name(dtype)} {t}",
                           _bind(check_simple, ctx, t, dtype, name, rnnt_type)))
    cs.append((f"simple losses, logits 1000 nats apart (rescue) {t}",
               _bind(check_simple_rescue, ctx, t)))
    for rnnt_type in ("regular", "modified"):
        for dtype in low:
            cs.append((f"rnnt_loss_pruned {rnnt_type} {_dtype_name(dtype)} {t}",
                       _bind(check_pruned, ctx, t, dtype, rnnt_type)))
    B, T, U, V = t
    # Tiles (fused.py: whole frames of the batch, B (U+1) rows each, or runs of label
    # positions of one frame): B (U+1) // 2 - 1 rows cut each frame into runs of about
    # (U+1) / 2 positions, B (U+1) rows are one frame, 3 B (U+1) + 1 rows three frames (the
    # last tile shorter unless 3 divides T). Under the Triton interpreter, which runs
    # programs one after another, the first two are enough.
    interpreted = not ctx.cuda and ctx.backend == "triton"
    fused = [("rnnt", max(1, B * (U + 1) // 2 - 1)), ("tdt", B * (U + 1))]
    if not interpreted:
        fused += [("rnnt", 3 * B * (U + 1) + 1), ("multiblank", B * (U + 1))]
    for kind, tile in fused:
        cs.append((f"fused {kind} float32 tile {tile} {t}", _bind(check_fused, ctx, t, f32, kind, tile)))
    for kind in ("rnnt",) if interpreted else ("rnnt", "tdt", "multiblank"):
        cs.append((f"fused {kind} AMP recipe (forward under autocast, backward outside)",
                   _bind(check_amp, ctx, kind)))
    # The joiner's kernel path runs on the Triton backend only (CUDA, or its interpreter).
    joint = ctx.backend == "triton"
    for kind in ("rnnt", "tdt", "multiblank"):
        # On a GPU a float64 joiner takes the tile path (fused._kernel_path): float32 only.
        for dtype in (f64[:1] if ctx.cuda else f64):
            cs.append((f"joiner kernels {kind} {_dtype_name(dtype)} {t}",
                       _bind(check_joint, ctx, t, dtype, kind) if joint else None))
    cs.append(("joiner kernels AMP recipe (forward under autocast, backward outside)",
               _bind(check_joint_amp, ctx) if joint else None))
    # (Off by default until a GPU times it; under the interpreter the regular loss only.)
    for kind in ("rnnt",) if interpreted else ("rnnt", "tdt"):
        for dtype in f64:
            cs.append((f"joiner chunks by cuBLAS {kind} {_dtype_name(dtype)} {t}",
                       _bind(check_joint_cublas, ctx, t, dtype, kind) if joint else None))
    cs.append(("bad input (NaN, device-side assert, host ValueError)",
               _bind(check_bad_input, ctx)))
    cs.append((f"torch.compile(fullgraph=True) regular and TDT, a bad label {t}",
               _bind(check_compile, ctx, t)))
    cs.append(("fused, a joiner that recomputes other logits (an error)",
               _bind(check_recompute, ctx)))
    for kind in ("regular", "tdt"):
        for dtype in f64:
            cs.append((f"occupancy/best_alignment {kind} {_dtype_name(dtype)} {t}",
                       _bind(check_tools, ctx, t, dtype, kind)))
    cs.append((f"window DP, prune_ranges exact, prune_coverage {t}", _bind(check_window_dp, ctx, t)))
    cs.append((f"do_rnnt_pruning's lm gradient {t}", _bind(check_pruning_rows, ctx, t)))
    cs.append((f"torch.use_deterministic_algorithms(True) {t}", _bind(check_deterministic, ctx, t)))
    cuda_checks = [("no host synchronisation", check_no_sync), ("CUDA graph replay", check_cuda_graph),
                   ("peak memory", check_peak_memory)]
    if big:
        cuda_checks.append(("offsets > 2**31 (3, 1100, 1000, 1001)", check_big_offsets))
    for name, fn in cuda_checks:
        cs.append((name, _bind(fn, ctx) if ctx.cuda else None))
    cs.append(("timing", None if interpreted else _bind(check_timing, ctx)))
    return cs


def _bind(fn, *args):
    return lambda: fn(*args)


def _load_backend(ctx):
    impl = _backends.load(ctx.backend)          # ImportError: this check fails
    return f"rnnt_lattice.{impl.__name__.rsplit('.', 1)[-1]}"


def _outcome(name: str, fn) -> Result:
    """One check run: PASS (INFO for the timing) with its line, FAIL with the error, or SKIP
    where the check does not apply (``fn`` None)."""
    if fn is None:
        return Result(name, "SKIP", "not on the Triton interpreter" if name == "timing" else
                      "the Triton backend only" if name.startswith("joiner kernels") else
                      "the Numba backend only" if name.startswith("CPU row loops") else
                      "CUDA only")
    t0 = time.perf_counter()
    try:
        detail = fn()
        res = Result(name, "INFO" if name == "timing" else "PASS", detail or "")
    except Exception as err:      # a wrong number, or a crash: either is a failure
        msg = str(err).strip().splitlines()
        detail = f"{type(err).__name__}: {msg[0] if msg else ''}"
        if not isinstance(err, CheckFailed):
            frames = traceback.extract_tb(err.__traceback__)
            if frames:
                detail += f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})"
        res = Result(name, "FAIL", detail)
    res.seconds = time.perf_counter() - t0
    return res


def _say(ctx: Context, index: int, total: int, res: Result) -> None:
    ctx.out(f"[{index:>2}/{total}] {res.name}: {res.status}  {res.detail}  "
            f"[{res.seconds:.1f} s]".rstrip(), flush=True)
    ctx.results.append(res)


def _run_one(ctx: Context, index: int, total: int, name: str, fn) -> Result:
    res = _outcome(name, fn)
    _say(ctx, index, total, res)
    return res


# --------------------------------------------------------------------------- workers
# The checks that run alone, in the calling process, after the workers' (``jobs > 1``): a
# timing, and the lattice past 2**31 elements (about 27 GB of the device's memory).
ALONE = ("timing", "offsets > 2**31")


# First to a worker, whatever their place: the checks that start processes of their own
# (their subprocesses compile what they run, the longest checks of a first run on a GPU).
FIRST = ("bad input", "fused, a joiner that recomputes")


class NoWorkers(RuntimeError):
    """Worker processes cannot be started here (``_run_in_workers``, before any check ran)."""


@dataclass(frozen=True)
class _WorkerSpec:
    """What a worker process needs to build the same list of checks as its caller."""

    device: str
    backend: str
    tier: str
    big: bool
    threads: int                  # torch's and Numba's threads in the worker
    checks: Callable              # (ctx, big) -> [(name, fn)]: _checks (a module-level function)


def _worker(spec: _WorkerSpec, todo, done, wid: int) -> None:
    """A worker process (``run(..., jobs > 1)``): builds the run's checks as its caller
    did, then runs each index it is given, until ``None``, and puts ``(wid, index, result)``
    on ``done``."""
    set_threads(spec.threads)     # the workers share the cores instead of each taking all
    ctx = Context(spec.device, spec.backend, plan_for(spec.device, spec.tier), spec.tier,
                  out=lambda *args, **kwargs: None)
    checks = spec.checks(ctx, spec.big)
    while (index := todo.get()) is not None:
        name, fn = checks[index]
        done.put((wid, index, asdict(_outcome(name, fn))))


@dataclass
class _Worker:
    process: object
    todo: object                  # its queue of indices (None: stop)
    index: int | None = None      # the check it runs now


def _run_in_workers(ctx: Context, jobs: int, big: bool, make_checks: Callable = _checks) -> None:
    """The checks run by ``jobs`` worker processes (each its own CUDA context; spawned, as
    CUDA requires), a check at a time to whichever is free, and said in their order as
    they complete; then the ``ALONE`` ones here. A worker that dies (a crash, or a
    device-side assert that ends its CUDA context) fails the check it ran, and a new one
    takes its place while checks remain. ``make_checks``: the function that lists the
    checks, here and in each worker (``_checks``)."""
    import itertools
    import multiprocessing
    import queue
    from collections import deque

    checks = make_checks(ctx, big)
    total = len(checks)
    results: dict = {}
    alone = [i for i, (name, fn) in enumerate(checks) if fn is not None and name.startswith(ALONE)]
    pending = deque(sorted((i for i, (name, fn) in enumerate(checks)
                            if fn is not None and not name.startswith(ALONE)),
                           key=lambda i: (not checks[i][0].startswith(FIRST), i)))
    for i, (name, fn) in enumerate(checks):
        if fn is None:
            results[i] = _outcome(name, None)
    spawn = multiprocessing.get_context("spawn")
    try:
        done = spawn.Queue()
    except (OSError, ImportError) as err:     # no semaphores here (e.g. no /dev/shm)
        raise NoWorkers(f"{type(err).__name__}: {err}") from err
    spec = _WorkerSpec(ctx.device, ctx.backend, ctx.tier, big,
                       max(1, (os.cpu_count() or 1) // jobs), make_checks)
    workers: dict = {}
    said = 0                                        # the checks said so far, in order
    deaths = 0
    wids = itertools.count()

    def start() -> None:
        wid = next(wids)
        todo = spawn.Queue()
        # Not daemonic: a check may start processes of its own (torch.compile's compile
        # workers); the finally below ends every worker however this returns.
        proc = spawn.Process(target=_worker, args=(spec, todo, done, wid),
                             name=f"rnnt-lattice check worker {wid}")
        proc.start()
        workers[wid] = _Worker(proc, todo)
        give(wid)

    def give(wid: int) -> None:
        w = workers[wid]
        w.index = pending.popleft() if pending else None
        w.todo.put(w.index)

    def say_ready() -> None:
        nonlocal said
        while said < total and said in results:
            _say(ctx, said + 1, total, results[said])
            said += 1

    try:
        try:
            for _ in range(min(jobs, len(pending))):
                start()
        except (OSError, ImportError) as err:
            raise NoWorkers(f"{type(err).__name__}: {err}") from err
        while any(w.index is not None for w in workers.values()):
            try:
                wid, index, res = done.get(timeout=0.5)
            except queue.Empty:
                for wid, w in list(workers.items()):
                    if w.index is None or w.process.is_alive():
                        continue
                    deaths += 1
                    results[w.index] = Result(
                        checks[w.index][0], "FAIL",
                        f"the check's worker process died (exit code {w.process.exitcode})")
                    del workers[wid]
                    if pending and deaths <= jobs:  # (workers that cannot even start: stop)
                        with contextlib.suppress(OSError):
                            start()
                say_ready()
                continue
            results[index] = Result(**res)
            if wid in workers:          # (not one that died once its result was sent)
                give(wid)
            say_ready()
        for w in workers.values():
            w.process.join(timeout=30)
    finally:
        for w in workers.values():
            if w.process.is_alive():
                w.process.terminate()
    for i in pending:                               # left when the workers kept dying
        results[i] = Result(checks[i][0], "FAIL", "not run: the worker processes died")
    for i in alone:
        results[i] = _outcome(*checks[i])
    say_ready()


def report_block(env: dict, results: list, timing: dict) -> str:
    """The block to paste into a bug report: environment, counts, every failure."""
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    lines = ["---- rnnt-lattice check report (paste this into a bug report) ----"]
    lines.append(f"rnnt_lattice {env['rnnt_lattice']} | python {env['python']} | torch "
                 f"{env['torch']} (CUDA {env['torch_cuda']}) | numba {env['numba']} | triton "
                 f"{env['triton']} | torchaudio {env['torchaudio']}")
    lines.append(f"platform: {env['platform']}, {env['cpu_count']} CPUs, {env['torch_threads']} "
                 f"torch threads")
    if env["device"] == "cuda":
        lines.append(f"device: cuda, {env['gpu']} (compute capability {env['compute_capability']}, "
                     f"{env['gpu_memory_gib']} GiB, driver {env['driver']}), backend {env['backend']}")
    else:
        lines.append(f"device: cpu, {env['cpu']}, backend {env['backend']}")
    lines.append(f"FP64: {env['fp64']}")
    lines.append(f"checks: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    for r in results:
        if r.status == "FAIL":
            lines.append(f"FAIL {r.name}: {r.detail}")
    for r in results:
        if r.name == "timing" and r.status != "SKIP":
            lines.append(f"timing: {r.detail}")
    lines.append("RESULT: " + ("PASS" if counts["FAIL"] == 0 else "FAIL"))
    lines.append("---- end of report ----")
    return "\n".join(lines)


def run(device: str, *, tier: str = "default", json_path: str | None = None,
        backend: str | None = None, big: bool = False, out: Callable = print,
        jobs: int = 1) -> int:
    """Runs every check on ``device`` (``"cpu"`` or ``"cuda"``), printing a line per check
    and the report block; writes the results as JSON to ``json_path`` if given. Returns 0
    when every check passed, 1 otherwise. ``backend``: the backend checked (default: the
    device's, Numba on CPU, Triton on CUDA; ``"triton"`` on CPU runs the Triton kernels
    under ``TRITON_INTERPRET=1``). ``big``: also the > 2**31-element lattice (CUDA, ~27 GB).
    ``jobs``: the checks run by that many worker processes at once (the kernels they use
    compile in parallel: most of a first run's time on a GPU), said in the same order, with
    the same results; the timing and the > 2**31 lattice run alone after them."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: no CUDA device is available to this torch "
                         f"({torch.__version__}, built with CUDA {torch.version.cuda}); "
                         f"run with --device cpu")
    backend = backend or ("triton" if device == "cuda" else "numba")
    t_start = time.perf_counter()
    env = environment(device, backend)
    out(f"rnnt-lattice check: device {device}, backend {backend}, {tier} checks", flush=True)
    for key, value in env.items():
        out(f"  {key:18s} {value}", flush=True)
    ctx = Context(device, backend, plan_for(device, tier), tier, out=out)
    if jobs > 1:
        try:
            _run_in_workers(ctx, jobs, big)
        except NoWorkers as err:
            out(f"  --jobs {jobs}: no worker processes here ({err}); the checks run in this "
                f"process", flush=True)
            jobs = 1
    if jobs == 1:
        checks = _checks(ctx, big)
        for i, (name, fn) in enumerate(checks, 1):
            _run_one(ctx, i, len(checks), name, fn)
    block = report_block(env, ctx.results, ctx.timing)
    out(block, flush=True)
    failed = any(r.status == "FAIL" for r in ctx.results)
    if json_path is not None:
        with open(json_path, "w") as f:
            json.dump({"ok": not failed, "tier": tier, "backend": backend, "jobs": jobs,
                       "seconds": round(time.perf_counter() - t_start, 2), "environment": env,
                       "checks": [asdict(r) for r in ctx.results], "timing": ctx.timing,
                       "report": block}, f, indent=2, default=str)
    return 1 if failed else 0

