"""``run.py --mode pruned``: the pruned RNN-T pipeline, ours against fast_rnnt's, and the
full losses for scale.

One training step of the loss, with the joiner a plain sum ``logits(t,u) = am(t) + lm(u)``
(so only the loss is timed, not a joiner network), forward and backward into ``am`` and
``lm``::

    simple, occ = rnnt_loss_smoothed(lm, am, ..., return_occupations=True)  # cheap lattice
    ranges      = prune_ranges(occ, R, method)                               # (B, T, R)
    am_p, lm_p  = do_rnnt_pruning(am, lm, ranges)                            # (B, T, R, V) each
    pruned      = rnnt_loss_pruned(am_p + lm_p, targets, ranges, ...)
    (simple + pruned).backward()

``rnnt_lattice (k2)`` / ``rnnt_lattice (exact)``: ours (``rnnt_lattice`` public API, backend
"auto") with k2's window rule or the covering-optimal one; ``fast_rnnt``: the same step with
fast_rnnt's functions (``rnnt_loss_smoothed(return_grad=True)``, ``get_rnnt_prune_ranges``,
``do_rnnt_pruning``, ``rnnt_loss_pruned``). Both use icefall's smoothing scales
(:data:`SCALES`) and ``reduction="sum"``. The full-loss rows are the providers of
``peers.py`` on the materialised ``(B, T, U+1, V)`` logits (the sum itself is not timed).

Agreement (untimed, once per shape and R; :func:`agreement`): our k2 rule on fast_rnnt's own
occupations must give fast_rnnt's ranges exactly, and our step (k2 rule) must agree with
fast_rnnt's step run on the same numbers in float64: simple and pruned losses and the
gradients w.r.t. am and lm to float32 rounding (the windows may differ at near-tied frames,
counted).

Memory on CPU: a fresh subprocess per row (this file as a script, ``--mem-child``) does
the warm-up, makes the inputs, resets its RSS high-water mark and runs one step; the row
gets ``VmHWM - VmRSS`` at the reset (the step's own peak). On CUDA:
``max_memory_allocated`` above what was allocated before the step.
"""
from __future__ import annotations

import common  # first: sets the thread env vars before torch is imported

import importlib                  # noqa: E402
import json                       # noqa: E402
import subprocess                 # noqa: E402
import warnings                   # noqa: E402
import sys                        # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path          # noqa: E402
from typing import Callable, Optional  # noqa: E402

import torch                      # noqa: E402

import shapes                     # noqa: E402
import timing                     # noqa: E402
from rnnt_lattice._cli_util import set_threads  # noqa: E402

WINDOWS = (5, 10)                                    # R, the issue's two
SCALES = dict(lm_only_scale=0.25, am_only_scale=0.0)  # icefall's pruned-transducer recipes
FULL = ("rnnt_lattice", "fast_rnnt", "torchaudio")   # full losses of peers.py, for scale
FULL_MAX_ELEMS = 4e8                                  # full logits beyond this are skipped


@dataclass
class Step:
    """What one pipeline step returns (for the agreement check)."""
    simple: torch.Tensor
    pruned: torch.Tensor
    ranges: torch.Tensor


@dataclass
class Pipeline:
    name: str
    dist: Optional[str]
    load: Callable[[], Callable]      # -> step(am, lm, x: JoinerInputs, R) -> Step
    note: str
    ours: bool = False
    module: Optional[str] = None      # the k2-API module of a k2-API pipeline


def _ours(method: str):
    def load():
        import rnnt_lattice

        def step(am, lm, x, R):
            simple, occ = rnnt_lattice.rnnt_loss_smoothed(
                lm, am, x.targets, x.logit_lengths, x.target_lengths, blank=x.blank,
                reduction="sum", return_occupations=True, **SCALES)
            win = rnnt_lattice.prune_ranges(occ, R, method=method)
            am_p, lm_p = rnnt_lattice.do_rnnt_pruning(am, lm, win.ranges)
            pruned = rnnt_lattice.rnnt_loss_pruned(am_p + lm_p, x.targets, win.ranges,
                                                   x.logit_lengths, x.target_lengths,
                                                   blank=x.blank, reduction="sum")
            (simple + pruned).backward()
            return Step(simple.detach(), pruned.detach(), win.ranges)
        return step
    return load


def _k2_api(module: str):
    """The step in k2's API, from ``module``: fast_rnnt, or our ``rnnt_lattice.compat.k2``."""
    def load():
        return _k2_step(importlib.import_module(module))
    return load


def _k2_step(fast_rnnt):
    def step(am, lm, x, R):
        boundary = x.boundary
        simple, (px_grad, py_grad) = fast_rnnt.rnnt_loss_smoothed(
            lm=lm, am=am, symbols=x.targets, termination_symbol=x.blank, boundary=boundary,
            reduction="sum", return_grad=True, **SCALES)
        ranges = fast_rnnt.get_rnnt_prune_ranges(px_grad=px_grad, py_grad=py_grad,
                                                 boundary=boundary, s_range=R)
        am_p, lm_p = fast_rnnt.do_rnnt_pruning(am=am, lm=lm, ranges=ranges)
        pruned = fast_rnnt.rnnt_loss_pruned(logits=am_p + lm_p, symbols=x.targets, ranges=ranges,
                                            termination_symbol=x.blank, boundary=boundary,
                                            reduction="sum")
        (simple + pruned).backward()
        return Step(simple.detach(), pruned.detach(), ranges)
    return step


PIPELINES = {p.name: p for p in (
    Pipeline("rnnt_lattice (k2)", "rnnt-lattice", _ours("k2"),
             "rnnt_loss_smoothed -> prune_ranges(method='k2') -> rnnt_loss_pruned", ours=True),
    Pipeline("rnnt_lattice (exact)", "rnnt-lattice", _ours("exact"),
             "the same with prune_ranges(method='exact')", ours=True),
    Pipeline("fast_rnnt", "fast_rnnt", _k2_api("fast_rnnt"),
             "rnnt_loss_smoothed(return_grad) -> get_rnnt_prune_ranges -> rnnt_loss_pruned",
             module="fast_rnnt"),
    # Ours through the k2 API (the same calls as the fast_rnnt row): not run by default.
    Pipeline("rnnt_lattice.compat.k2", "rnnt-lattice", _k2_api("rnnt_lattice.compat.k2"),
             "fast_rnnt's calls on rnnt_lattice.compat.k2", ours=True,
             module="rnnt_lattice.compat.k2"),
)}
DEFAULT_PIPELINES = ("rnnt_lattice (k2)", "rnnt_lattice (exact)", "fast_rnnt")
REFERENCE_PAIR = ("rnnt_lattice (k2)", "fast_rnnt")   # the agreement check


def load(names):
    """``{name: step}`` of the pipelines that load, and ``{name: reason}`` of the others."""
    ok, missing = {}, {}
    for n in names:
        try:
            ok[n] = PIPELINES[n].load()
        except Exception as err:          # an optional peer may fail in any way on import
            missing[n] = f"{type(err).__name__}: {err}"
    return ok, missing


def leaves(x):
    return (x.am.detach().clone().requires_grad_(), x.lm.detach().clone().requires_grad_())


def run_step(step, x, R, am, lm) -> Step:
    am.grad = lm.grad = None
    return step(am, lm, x, R)


def agreement(steps, x, R) -> dict:
    """Ours (k2 rule, float32 inputs as timed) against fast_rnnt (untimed): the ranges
    against fast_rnnt's timed float32 run and against the same step on the same numbers in
    float64; losses and gradients against the float64 run.

    Why both: fast_rnnt's float32 occupations carry absolute errors ~1e-4 (``exp(alpha +
    beta - log P)`` formed in float32 with ``|log P|`` in the thousands), enough to flip the
    k2 rule's argmax between near-equal windows; ours come from a float64 lattice. So the
    comparison is against fast_rnnt in float64, where only near-ties of order 1e-7 (our
    normaliser's float32 matmul) can differ (``frames_differ_f64``); the frames where its
    float32 run chose otherwise are counted (``frames_differ_f32``). The rule itself is
    checked exactly: our ``prune_ranges(method="k2")`` (through ``compat.k2``) on fast_rnnt's
    own float32 occupations must give its ranges (``rule_exact``)."""
    a_name, b_name = REFERENCE_PAIR
    if a_name not in steps or b_name not in steps:
        return {}
    runs = {}
    for key, name, dtype in (("ours", a_name, None), ("f32", b_name, None),
                             ("f64", b_name, torch.float64)):
        am, lm = leaves(x)
        if dtype is not None:
            am, lm = (t.detach().to(dtype).requires_grad_() for t in (am, lm))
        s = run_step(steps[name], x, R, am, lm)
        runs[key] = (s, am.grad, lm.grad)
    (so, go_am, go_lm), (s32, _, _), (s64, g64_am, g64_lm) = runs["ours"], runs["f32"], runs["f64"]

    def same(a, b):
        return a.shape == b.shape and torch.equal(a.cpu(), b.cpu())

    module = importlib.import_module(PIPELINES[b_name].module)
    from rnnt_lattice.compat import k2 as compat
    _, (px_grad, py_grad) = module.rnnt_loss_smoothed(
        lm=x.lm, am=x.am, symbols=x.targets, termination_symbol=x.blank, boundary=x.boundary,
        reduction="sum", return_grad=True, **SCALES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = module.get_rnnt_prune_ranges(px_grad, py_grad, x.boundary, R)
        mine = compat.get_rnnt_prune_ranges(px_grad, py_grad, x.boundary, R)
    out = {"rule_exact": same(mine, theirs), "ranges_equal": same(so.ranges, s64.ranges)}
    if not out["ranges_equal"] and so.ranges.shape == s64.ranges.shape:
        out["frames_differ_f64"] = int((so.ranges != s64.ranges).any(-1).sum())
    out["frames_differ_f32"] = (int((so.ranges != s32.ranges).any(-1).sum())
                                if so.ranges.shape == s32.ranges.shape else -1)
    for k, a, b in (("simple", so.simple, s64.simple), ("pruned", so.pruned, s64.pruned)):
        out[f"{k}_abs_diff"] = abs(float(a) - float(b))
        out[f"{k}_rel_diff"] = out[f"{k}_abs_diff"] / max(1.0, abs(float(b)))
    out["simple_abs_diff_f32"] = abs(float(so.simple) - float(s32.simple))
    out["pruned_abs_diff_f32"] = abs(float(so.pruned) - float(s32.pruned))
    for k, a, b in (("am", go_am, g64_am), ("lm", go_lm, g64_lm)):
        b = b.to(a.dtype)
        out[f"grad_{k}_rel_diff"] = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
    # float32 rounding: 16 eps (run.py's tolerance factor) relative on the losses; the
    # gradients are float32 sums of float32 products: 1e-4 of their max.
    eps = torch.finfo(x.am.dtype).eps
    ok = (out["rule_exact"] and out["simple_rel_diff"] <= 16 * eps
          and out["pruned_rel_diff"] <= 16 * eps
          and out["grad_am_rel_diff"] <= 1e-4 and out["grad_lm_rel_diff"] <= 1e-4)
    out["agree"] = "ok" if ok else "DISAGREE"
    return out


def time_step(step, x, R, device, args) -> dict:
    am, lm = leaves(x)
    first = run_step(step, x, R, am, lm)
    t = timing.time_calls(lambda: run_step(step, x, R, am, lm), warmup=max(0, args.warmup - 1),
                         reps=args.reps, cap_s=args.cap, min_time_s=device.min_time_s,
                         clock=device.clock)
    return {"fwd_bwd_s": t["median"], "fwd_bwd_min_s": t["min"], "fwd_bwd_reps": t["reps"],
            "status": "capped" if t["capped"] else "ok",
            "simple_loss": float(first.simple), "pruned_loss": float(first.pruned),
            "R_used": int(first.ranges.shape[-1])}


def cuda_memory(fn) -> dict:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return {"peak_bytes": torch.cuda.max_memory_allocated() - before}


def cpu_memory(kind: str, name: str, shape: str, R: int, seed: int) -> dict:
    """Peak RSS of one step in a fresh subprocess (this file, ``--mem-child``)."""
    cmd = [sys.executable, str(Path(__file__)), "--mem-child", kind, name, shape, str(R), str(seed)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        return {"mem_note": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return {"peak_extra_mb": json.loads(p.stdout.strip().splitlines()[-1])["extra_kb"] / 1024}


def _full_inputs(x) -> shapes.Inputs:
    return shapes.Inputs(x.logits(), x.targets.to(torch.int32), x.logit_lengths.to(torch.int32),
                        x.target_lengths.to(torch.int32), x.blank)


def mem_child(kind: str, name: str, shape: str, R: int, seed: int) -> None:
    """Subprocess body of :func:`cpu_memory`: warm-up on a small shape, inputs, reset of
    the high-water mark, one step; prints ``{"extra_kb": VmHWM - VmRSS at the reset}``."""
    import peers
    set_threads(common.THREADS)
    small = shapes.make_joiner_inputs(shapes.SHAPES["s1"], seed=seed)
    x = shapes.make_joiner_inputs(shapes.SHAPES[shape], seed=seed)
    if kind == "pipeline":
        step = PIPELINES[name].load()
        run_step(step, small, R, *leaves(small))
        am, lm = leaves(x)
        go = lambda: run_step(step, x, R, am, lm)          # noqa: E731
    else:
        fn = peers.PROVIDERS[name].get()
        w = _full_inputs(small)
        timing.fwd_bwd(fn, w, w.logits.requires_grad_())
        f = _full_inputs(x)
        leaf = f.logits.requires_grad_()
        go = lambda: timing.fwd_bwd(fn, f, leaf)            # noqa: E731
    set_threads(common.THREADS)
    rss = common.rss_kb()
    common.reset_peak_rss()
    go()
    print(json.dumps({"extra_kb": common.maxrss_kb() - rss}))


def run(shape_list, device, args, meta) -> list:
    """Every shape x R x pipeline, then the full losses; rows for the tables."""
    import peers
    names = args.providers or list(DEFAULT_PIPELINES)
    steps, missing = load([n for n in names if n in PIPELINES])
    rows = [{"provider": n, "shape": "-", "status": "unavailable", "note": why[:200]}
            for n, why in missing.items()]
    full = [n for n in (args.providers or FULL) if n in peers.PROVIDERS]
    meta["pipelines"] = {n: PIPELINES[n].note for n in steps}
    meta["smoothing"] = SCALES
    small = device.joiner_inputs(shapes.SHAPES["s1"], args.seed)
    for n, step in steps.items():                     # JIT / lazy init, untimed
        run_step(step, small, WINDOWS[0], *leaves(small))
    for shape in shape_list:
        x = device.joiner_inputs(shape, args.seed)
        base = {"shape": shape.name, "shape_desc": shape.describe(), "device": device.name}
        print(f"\n## {shape.name} ({shape.describe()})", flush=True)
        for R in args.windows:
            agree = agreement(steps, x, R)
            if agree:
                print(f"  R={R}: agreement with fast_rnnt in float64: {_agree(agree)}", flush=True)
            for n, step in steps.items():
                row = {**base, "kind": "pipeline", "provider": n, "R": R}
                try:
                    row.update(time_step(step, x, R, device, args))
                    if not args.no_memory:
                        am, lm = leaves(x)
                        row.update(cuda_memory(lambda: run_step(step, x, R, am, lm))
                                   if device.name == "cuda"
                                   else cpu_memory("pipeline", n, shape.name, R, args.seed))
                except Exception as err:
                    row.update(status="error", note=f"{type(err).__name__}: {str(err)[:200]}")
                if n == REFERENCE_PAIR[0]:
                    row.update(agree)
                rows.append(row)
                print(f"  R={R:<3d} {n:24s} fwd+bwd {timing.fmt_s(row.get('fwd_bwd_s')):>9s}  "
                      f"{_mem(row)}  simple {row.get('simple_loss', float('nan')):.6g} pruned "
                      f"{row.get('pruned_loss', float('nan')):.6g}  {row['status']} "
                      f"{row.get('note', '')}", flush=True)
        elems = shape.B * shape.T * (shape.U + 1) * shape.V
        for n in full:
            row = {**base, "kind": "full", "provider": n, "R": None}
            if elems > FULL_MAX_ELEMS:
                row.update(status="skipped", note=f"{elems:.3g} logits > {FULL_MAX_ELEMS:g}")
            else:
                try:
                    fn = peers.PROVIDERS[n].get()
                    f = device.full_inputs(x)
                    set_threads(common.THREADS)
                    t = timing.time_loss(fn, f, clock=device.clock, warmup=args.warmup,
                                        reps=args.reps, cap_s=args.cap,
                                        min_time_s=device.min_time_s, forward=False)
                    row.update(fwd_bwd_s=t["fwd_bwd_s"], fwd_bwd_reps=t["fwd_bwd_reps"],
                               status="capped" if t["fwd_bwd_capped"] else "ok")
                    if not args.no_memory:
                        leaf = f.logits.detach().clone().requires_grad_()
                        row.update(cuda_memory(lambda: timing.fwd_bwd(fn, f, leaf))
                                   if device.name == "cuda"
                                   else cpu_memory("full", n, shape.name, 0, args.seed))
                    del f
                except ImportError as err:                   # an optional peer
                    row.update(status="unavailable", note=str(err)[:200])
                except Exception as err:
                    row.update(status="error", note=f"{type(err).__name__}: {str(err)[:200]}")
            rows.append(row)
            print(f"  full  {n:24s} fwd+bwd {timing.fmt_s(row.get('fwd_bwd_s')):>9s}  {_mem(row)}  "
                  f"{row['status']} {row.get('note', '')}", flush=True)
            device.release()
        del x
        device.release()
    return rows


def _mem(row) -> str:
    if "peak_extra_mb" in row:
        return f"peak {row['peak_extra_mb']:7.0f} MB"
    if "peak_bytes" in row:
        return f"peak {row['peak_bytes'] / 2**20:7.0f} MiB"
    return "peak       -   "


# --------------------------------------------------------------------------- tables
def markdown(rows, device_name: str, ctx: dict) -> str:
    """One table per shape: pipelines per R (time, ours / fast_rnnt, memory, losses,
    agreement), then the full losses."""
    mem_head = "peak extra MB (RSS)" if device_name == "cpu" else "peak MiB"
    out = [f"Medians of {ctx['reps']} fwd+bwd after {ctx['warmup']} warm-up "
           f"({'wall clock' if device_name == 'cpu' else 'CUDA events'}); joiner = am + lm; "
           f"smoothed simple loss with lm_only_scale={SCALES['lm_only_scale']}, "
           f"am_only_scale={SCALES['am_only_scale']}; reduction sum. "
           "x fast_rnnt = our time / fast_rnnt's at the same R (full rows: / fast_rnnt's full "
           "loss). Agreement: 'k2 rule exact' = our prune_ranges(method='k2') on fast_rnnt's own "
           "occupations gives its ranges; then ours (float32 inputs, as timed) against fast_rnnt's "
           "step on the same numbers in float64: windows (frames that differ: near-ties), "
           "relative differences of the losses and of the gradients w.r.t. am and lm; and the "
           "frames where fast_rnnt's timed float32 run chose other windows (its float32 "
           "occupations are ~1e-4 off; see docs/benchmarks.md)."
           "\n"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows if r.get("shape") != "-"))
    for s in shapes:
        rs = [r for r in rows if r.get("shape") == s]
        out.append(f"**{s}** ({rs[0]['shape_desc']})\n")
        ref = {(r["R"]): r.get("fwd_bwd_s") for r in rs
               if r["provider"] == "fast_rnnt" and r["kind"] == "pipeline"}
        body = []
        for r in rs:
            if r["kind"] != "pipeline":
                continue
            body.append(_line(r, f"R={r['R']}" + (f" (R'={r['R_used']})" if r.get("R_used", r["R"]) != r["R"] else ""),
                              ref.get(r["R"])) + [
                _fmt(r.get("simple_loss"), ".7g"), _fmt(r.get("pruned_loss"), ".7g"), _agree(r)])
        full_ref = next((r.get("fwd_bwd_s") for r in rs
                         if r["kind"] == "full" and r["provider"] == "fast_rnnt"), None)
        for r in rs:
            if r["kind"] == "full":
                body.append(_line(r, "full loss", full_ref) + ["", "", ""])
        out.append(common.md_table(["pipeline / loss", "R", "fwd+bwd", "x fast_rnnt", mem_head,
                                    "simple loss", "pruned loss", "agreement (k2 rule) with fast_rnnt"], body))
    missing = {r["provider"]: r["note"] for r in rows if r.get("status") == "unavailable"}
    if missing:
        out.append("Unavailable: " + "; ".join(f"{n} ({why})" for n, why in missing.items()) + "\n")
    return "\n".join(out)


def _line(r, what, ref) -> list:
    if r.get("status") not in ("ok", "capped"):
        return [r["provider"], what, f"{r.get('status')}: {r.get('note', '')}", "", ""]
    t = r.get("fwd_bwd_s")
    ratio = f"{t / ref:.2f}" if isinstance(t, float) and isinstance(ref, float) else "-"
    mem = ("-" if "peak_extra_mb" not in r and "peak_bytes" not in r else
           f"{max(r['peak_extra_mb'], 0):.0f}" if "peak_extra_mb" in r else f"{r['peak_bytes'] / 2**20:.0f}")
    return [r["provider"], what, timing.fmt_s(t) + (" capped" if r["status"] == "capped" else ""),
            ratio, mem]


def _agree(r) -> str:
    if "agree" not in r:
        return ""
    n = r.get("frames_differ_f64")
    ranges = "ranges equal" if r["ranges_equal"] else (
        "ranges differ" + (f" at {n} frames" if n is not None else ""))
    rule = "k2 rule exact" if r.get("rule_exact") else "k2 rule NOT exact"
    return (f"{r['agree']}: {rule}; {ranges}; rel. diff simple {r['simple_rel_diff']:.1g}, pruned "
            f"{r['pruned_rel_diff']:.1g}, grad am {r['grad_am_rel_diff']:.1g}, lm "
            f"{r['grad_lm_rel_diff']:.1g}; vs its float32 run: {r['frames_differ_f32']} frames "
            f"differ, pruned {r['pruned_abs_diff_f32']:.2g} apart")


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, float) else "-"


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--mem-child":
        mem_child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    else:
        print(__doc__)
