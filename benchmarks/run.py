"""The benchmark runner: RNN-T losses on CPU or CUDA, against the device's floor or side by side.

    python benchmarks/run.py --device cpu|cuda --mode floor|peers|pruned|fused [options]

One case list, ``(shape, dtype, loss variant)`` from the package's registry
(``shapes.py``: ``SHAPES``/``GROUPS``, ``VARIANTS``, ``make_inputs``), one provider
table (``peers.py``: ours and the peers), and for every case and provider:

1. agreement: the provider's per-sequence losses and gradient (of their sum) against a
   float64 reference (rnnt_lattice backend="torch" on the same numbers in float64, on the
   same device): relative loss error max|dl|/max|l| and gradient error max|dg|/max|g|,
   flagged when beyond rounding (16 eps max|L|, ``--tol-factor``; see ``tolerance``);
2. speed: median of fwd+bwd and of forward only after warm-up, by the device's clock (wall
   clock on CPU, CUDA events on GPU; ``rnnt_lattice.timing.time_loss``), with a time cap per
   provider and case (a provider whose time, extrapolated from its previous shape by
   element count, would exceed the cap is skipped with that reason);
3. memory: on CPU the peak RSS of a fresh subprocess doing one fwd+bwd minus that of a
   baseline subprocess doing everything but the call; on CUDA ``max_memory_allocated``
   during one fwd+bwd above what was allocated before it;
4. the floor: on CPU ``torch.exp(logits, out=buf)`` and ``torch.exp(logits)`` on the same
   tensor in the same run (``x exp`` = fwd+bwd / the former); on CUDA ``3 x nbytes(logits)``
   / the copy bandwidth measured once per run on a 1 GiB buffer (``x floor``).

``--mode floor`` runs ours only (CPU: backend='numba'; CUDA: backend='triton', also with
inplace_grad=True) and writes the floor table; ``--mode peers`` runs ours and every peer that
imports (``benchmarks/.venv-peers``, ``setup_peers.sh``) and writes the side-by-side tables.
``--mode pruned`` times the pruned RNN-T pipeline (simple loss -> windows -> pruned loss),
ours against fast_rnnt's, at each ``--windows`` R, with the full losses for scale
(``pruned_pipeline.py``; shapes: the registry's ``pruned_cpu`` / ``pruned_gpu`` groups).
``--mode fused`` times a joiner's training step (forward + loss + backward) up to four ways,
full, pruned (R=5), ``fused_rnnt_loss`` and its kernel path (``rnnt_lattice.Joiner``, CUDA),
with their peak memory, at each ``--hidden`` H (``fused_pipeline.py``; shapes: ``fused_cpu``
/ ``fused_gpu``; ``--ways``, ``--precision``, ``--loss``; ``--preset issue34``: issue 34's
table; on CPU each way's peak is the largest of ``--mem-procs`` fresh processes, 3 by default).

Threads are fixed (2 by default, RNNT_BENCH_THREADS) for torch, Numba and OpenMP.
Results: benchmarks/results/<stem>.{csv,json,md} (default stem ``<device>-<mode>-<date>``),
with machine, GPU, versions, date and the command. Without a CUDA device ``--device cuda``
exits at once with a message (status 2).

    python benchmarks/run.py --device cpu --mode floor --quick     # ours vs exp, s1 s2: seconds
    python benchmarks/run.py --device cpu --mode floor             # s2 s3 s4 s5 ragged
    benchmarks/.venv-peers/bin/python benchmarks/run.py --device cpu --mode peers
    python benchmarks/run.py --device cuda --mode peers            # "gpu" shapes + half rows
    benchmarks/.venv-peers/bin/python benchmarks/run.py --device cpu --mode pruned
    python benchmarks/run.py --device cpu --mode fused             # f1 f2, H 512 1024
    python benchmarks/run.py --device cuda --mode fused --preset issue34   # ~2 min on an H100
"""
from __future__ import annotations

import common  # first: sets the thread env vars before torch is imported

import argparse                 # noqa: E402
import datetime as _dt          # noqa: E402
import json                     # noqa: E402
import os                       # noqa: E402
import shlex                    # noqa: E402
import subprocess               # noqa: E402
import sys                      # noqa: E402
import time                     # noqa: E402
import traceback                # noqa: E402
from pathlib import Path        # noqa: E402

import torch                    # noqa: E402

import peers                    # noqa: E402
import fused_pipeline           # noqa: E402
import pruned_pipeline          # noqa: E402
import shapes                   # noqa: E402
import timing                   # noqa: E402
from rnnt_lattice._cli_util import set_threads  # noqa: E402

DEVICES = ("cpu", "cuda")
MODES = ("floor", "peers", "pruned", "fused")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
REFERENCE = "rnnt_lattice_torch"
MIN_PREDICT_S = 0.3

# Ours, per device: the floor mode's providers and the first ones of the peers mode.
OURS = {"cpu": ["rnnt_lattice"], "cuda": ["rnnt_lattice_triton", "rnnt_lattice_triton_inplace"]}
# Defaults per (device, mode); --quick replaces shapes/reps/warmup/cap/memory where not given.
DEFAULTS = {
    ("cpu", "floor"): dict(shapes=["core"], reps=7, warmup=2, cap=120.0, agree_max_elems=1.2e8),
    ("cpu", "peers"): dict(shapes=["s1", "s2", "s3", "s4", "s5", "ragged", "s1_f64"], reps=5,
                           warmup=2, cap=120.0, agree_max_elems=1.2e8),
    ("cuda", "floor"): dict(shapes=["gpu"], reps=10, warmup=3, cap=120.0, agree_max_elems=5e7),
    ("cuda", "peers"): dict(shapes=["gpu"], reps=10, warmup=3, cap=120.0, agree_max_elems=5e7),
    # pruned: agreement is ours (k2 rule) against fast_rnnt, at every shape (no reference).
    ("cpu", "pruned"): dict(shapes=["pruned_cpu"], reps=3, warmup=1, cap=60.0, agree_max_elems=0),
    ("cuda", "pruned"): dict(shapes=["pruned_gpu"], reps=10, warmup=3, cap=120.0, agree_max_elems=0),
    # fused: agreement is fused against full, at every shape (no float64 reference).
    ("cpu", "fused"): dict(shapes=["fused_cpu"], reps=5, warmup=1, cap=0.0, agree_max_elems=0),
    ("cuda", "fused"): dict(shapes=["fused_gpu"], reps=10, warmup=3, cap=0.0, agree_max_elems=0),
}
QUICK = dict(shapes=["quick"], reps=3, warmup=1, cap=10.0)
# Half-precision rows run on CUDA by default next to the float32 ones: (shape, dtype).
DEFAULT_HALF = [("s5", "bfloat16"), ("big", "float16")]

# The CPU floor table: the core issue's target and, for scale, the issue's peer figures on
# this machine (not re-measured there; --mode peers measures the peers side by side).
TARGET_X_EXP = 1.5
TARGET_SHAPES = ("s3", "s4", "s5")
ISSUE_FASTEST_PEER_S = {"s3": 0.157, "s4": 0.73, "s5": 3.4}
ISSUE_TORCHAUDIO_S = {"s3": 0.87, "s4": 5.7, "s5": 22.6}


def default_providers(device: str, mode: str) -> list:
    if mode == "floor":
        return list(OURS[device])
    rest = [n for n, p in peers.PROVIDERS.items() if device in p.devices and n not in OURS[device]]
    if device == "cuda":          # the float64-hungry torch backend is the reference, not a contender
        rest = [n for n in rest if n != REFERENCE]
    return OURS[device] + rest


# --------------------------------------------------------------------------- devices
class CPU:
    """Wall clock, the exp floor, peak RSS of a subprocess."""
    name = "cpu"
    clock = timing.WALL
    min_time_s = 0.3                    # more samples until they add up to this
    floor_row = "(exp floor)"
    ratio_key = "x_exp"

    def check(self) -> None:
        pass

    def info(self) -> dict:
        return {}

    def prepare(self, args) -> None:
        pass

    def inputs(self, case, seed: int) -> shapes.Inputs:
        return shapes.make_inputs(case.shape, case.dtype, seed, case.variant)

    def joiner_inputs(self, shape, seed: int) -> shapes.JoinerInputs:
        return shapes.make_joiner_inputs(shape, seed=seed)

    def full_inputs(self, x: shapes.JoinerInputs) -> shapes.Inputs:
        return pruned_pipeline._full_inputs(x)

    def floor(self, x, args) -> dict:
        f = timing.exp_floor(x.logits, reps=max(3, args.reps))
        return {**f, "floor_s": f["exp_out_s"]}

    def memory(self, prov, case, x, leaf, setup, args) -> dict:
        m = common.peak_rss_extra(Path(__file__), [prov.name, case.shape.name, case.dtype_name,
                                                   case.variant, args.seed])
        if "error" in m:
            return {"mem_note": m["error"]}
        return {"peak_extra_mb": m["extra_mb"], "baseline_rss_mb": m["baseline_mb"]}

    def release(self) -> None:
        pass

    def mem_str(self, r) -> str:
        if "peak_extra_mb" not in r:
            return "mem       - MB"
        return f"mem {r['peak_extra_mb']:7.0f} MB"


class CUDA:
    """CUDA events, the copy-bandwidth floor, max_memory_allocated."""
    name = "cuda"
    clock = timing.CUDA_EVENTS
    min_time_s = 0.0                    # exactly --reps samples
    floor_row = "(copy floor)"
    ratio_key = "x_floor"
    copy_gbs = None

    def check(self) -> None:
        if not torch.cuda.is_available():
            print("run.py --device cuda: no CUDA device is visible to torch "
                  f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}). It "
                  "needs a GPU and a CUDA build of PyTorch (Triton ships with it); on this "
                  "machine use --device cpu.", file=sys.stderr)
            sys.exit(2)

    def info(self) -> dict:
        props = torch.cuda.get_device_properties(0)
        return {"gpu": props.name, "gpu_mem_gib": round(props.total_memory / 2**30, 1),
                "cuda": torch.version.cuda, "device_capability": f"{props.major}.{props.minor}"}

    def prepare(self, args) -> None:
        self.copy_gbs = timing.copy_bandwidth(args.warmup, args.reps)
        print(f"# copy bandwidth {self.copy_gbs:.4g} GB/s (1 GiB buffer)", flush=True)

    def inputs(self, case, seed: int) -> shapes.Inputs:
        x = shapes.make_inputs(case.shape, case.dtype, seed, case.variant)
        return shapes.Inputs(*(t.cuda() for t in (x.logits, x.targets, x.logit_lengths,
                                                  x.target_lengths)), x.blank, x.variant)

    def joiner_inputs(self, shape, seed: int) -> shapes.JoinerInputs:
        return shapes.make_joiner_inputs(shape, seed=seed, device="cuda")

    def full_inputs(self, x: shapes.JoinerInputs) -> shapes.Inputs:
        return pruned_pipeline._full_inputs(x)

    def floor(self, x, args) -> dict:
        return {"copy_GBps": self.copy_gbs, "floor_s": 3 * x.nbytes / (self.copy_gbs * 1e9)}

    def memory(self, prov, case, x, leaf, setup, args) -> dict:
        """Peak of one fwd+bwd above what exists before it (inputs, the leaf)."""
        leaf.grad = None
        if setup is not None:
            setup()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        timing.fwd_bwd(prov.get(), x, leaf)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        return {"peak_bytes": peak, "peak_x_logits": peak / x.nbytes}

    def release(self) -> None:
        torch.cuda.empty_cache()

    def mem_str(self, r) -> str:
        if "peak_bytes" not in r:
            return "peak         - MiB"
        return f"peak {r['peak_bytes'] / 2**20:9.1f} MiB ({r['peak_x_logits']:.2f} x logits)"


def get_device(name: str):
    return {"cpu": CPU, "cuda": CUDA}[name]()


# --------------------------------------------------------------------------- agreement
def reference(x: shapes.Inputs):
    """Float64 per-sequence losses and gradient of their sum, on x's numbers and device."""
    fn = peers.PROVIDERS[REFERENCE].get()
    lg = x.logits.detach().double().requires_grad_()
    costs = timing.fwd_bwd(fn, x, lg)
    return costs.detach(), lg.grad


def agreement(costs, grad, ref_costs, ref_grad) -> dict:
    costs, grad = costs.detach().double(), grad.double()
    if costs.dim() == 0:                  # a provider that only returns the batch sum
        ref_costs = ref_costs.sum().reshape(1)
        costs = costs.reshape(1)
    fin = torch.isfinite(ref_costs)
    loss_err = ((costs - ref_costs)[fin].abs().max() / ref_costs[fin].abs().max()).item()
    gmax = ref_grad.abs().max().item()
    grad_err = ((grad - ref_grad).abs().max().item() / gmax) if gmax > 0 else float("nan")
    return {"loss_rel_err": loss_err, "grad_rel_err": grad_err}


def tolerance(ref_costs, dtype, factor: float) -> float:
    """What float rounding allows: the lattice sums log-probabilities up to magnitude |L|
    in the input precision, so alpha, beta and L carry an absolute error of order eps*|L|;
    the loss inherits it as a relative error and the gradient's occupations
    exp(alpha + beta - L) as a relative error too. Bound = factor * eps * max(1, max|L|).

    Measured on float32 (2026-11-22): ours ~0.1-0.3 eps|L|; torchaudio, fast_rnnt,
    optimized_transducer, warprnnt/NeMo up to ~5 eps|L| (they form exp(alpha+beta-L) in
    float32). A wrong lattice gives errors of order 1, i.e. ~1e4 eps|L|: the default factor
    16 flags that with a wide margin without flagging rounding."""
    fin = ref_costs[torch.isfinite(ref_costs)]
    big = max(1.0, fin.abs().max().item()) if fin.numel() else 1.0
    return factor * torch.finfo(dtype).eps * big


# --------------------------------------------------------------------------- one provider, one case
def measure(prov: peers.Provider, x: shapes.Inputs, case, args, device, ref=None,
            skip_reason=None) -> dict:
    """One provider at one case: agreement (on the first, untimed call), fwd+bwd and fwd
    timing by the device's clock."""
    row = {}
    if skip_reason:
        row.update(status="skipped", note=skip_reason)
        return row
    if case.variant not in prov.variants:
        row.update(status="unsupported", note=f"no {case.variant!r} variant")
        return row
    fn = prov.get()
    base = x.logits.detach()
    leaf = base.clone().requires_grad_()
    # In-place providers overwrite their logits: each call gets a fresh copy, outside the
    # timing (what a training step with a fresh joiner output does).
    setup = (lambda: leaf.data.copy_(base)) if prov.inplace else None
    # Process-wide thread counts are not the providers' to keep: warprnnt-numba and NeMo set
    # Numba's to 1 on every call (num_threads=0 in their functional API), which would leave
    # every Numba provider timed after them single-threaded.
    set_threads(common.THREADS)
    try:
        t0 = time.perf_counter()
        costs = timing.fwd_bwd(fn, x, leaf)         # warm-up call 1, and the agreement sample
        device.clock.sync()
        first = time.perf_counter() - t0
        if ref is not None:
            row.update(agreement(costs, leaf.grad, *ref))
            unit = tolerance(ref[0], x.logits.dtype, 1.0)          # eps * max(1, max|L|)
            row["tol"] = args.tol_factor * unit
            row["grad_err_eps_L"] = row["grad_rel_err"] / unit
            bad = not (row["loss_rel_err"] <= row["tol"] and row["grad_rel_err"] <= row["tol"])
            row["agree"] = "DISAGREE" if bad else "ok"
        else:
            row["agree"] = "not checked"
        del costs
        t = timing.time_loss(fn, x, leaf=leaf, setup=setup, clock=device.clock,
                            warmup=args.warmup - 1, fwd_warmup=args.warmup, reps=args.reps,
                            cap_s=max(args.cap - first, first), min_time_s=device.min_time_s,
                            forward=not args.no_forward)
        capped = t.pop("fwd_bwd_capped")
        row.update(t, first_call_s=first, status="capped" if capped else "ok")
        if not args.no_memory:
            row.update(device.memory(prov, case, x, leaf, setup, args))
    except Exception as err:
        row.update(status="error", note=f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}")
        if args.verbose:
            traceback.print_exc()
        device.release()
    return row


def derive(row: dict, x: shapes.Inputs, device, mode: str) -> None:
    """Ratios to the floor and throughput, from a measured row."""
    if not isinstance(row.get("fwd_bwd_s"), float):
        return
    row[device.ratio_key] = row["fwd_bwd_s"] / row["floor_s"]
    if device.name == "cpu":
        row["x_exp_fresh"] = row["fwd_bwd_s"] / row["exp_fresh_s"]
        # The 1.5 x exp floor target and the issue's peer figures are the standard loss's.
        if mode == "floor" and row["shape"] in TARGET_SHAPES and x.variant == "regular":
            row["target_x_exp"] = TARGET_X_EXP
            row["meets_target"] = row["x_exp"] <= TARGET_X_EXP
            row["issue_fastest_peer_s"] = ISSUE_FASTEST_PEER_S.get(row["shape"])
            row["issue_torchaudio_s"] = ISSUE_TORCHAUDIO_S.get(row["shape"])
    else:
        row["v_pass_GBps"] = 3 * x.nbytes / row["fwd_bwd_s"] / 1e9
        row["pct_of_copy"] = 100 * row["v_pass_GBps"] / row["copy_GBps"]


def thp_compare(prov, case, args) -> dict:
    """The same measurement in a subprocess started with THP_MEM_ALLOC_ENABLE=1 (CPU)."""
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"}
    cmd = [sys.executable, __file__, "--device", "cpu", "--reps", str(args.reps),
           "--warmup", str(args.warmup), "--cap", str(args.cap), "--seed", str(args.seed),
           "--thp-child", prov.name, case.shape.name, case.dtype_name, case.variant]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        return {"thp_error": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
    t = json.loads(p.stdout.strip().splitlines()[-1])
    return {f"thp_{k}": t[k] for k in ("exp_out_s", "exp_fresh_s", "fwd_bwd_s", "fwd_s", "x_exp")
            if k in t}


def _case(shape: str, dtype: str, variant: str):
    return shapes.Case(shapes.SHAPES[shape], DTYPES[dtype], variant)


def _warm_up(fn, device, seed: int, dtype=None):
    """JIT compilation / lazy init / autotuning, untimed, on the smallest shape."""
    w = device.inputs(shapes.Case(shapes.SHAPES["s1"], dtype or torch.float32), seed)
    timing.fwd_bwd(fn, w, w.logits.clone().requires_grad_())


def thp_child(argv, args):
    """Subprocess body for --thp-compare: one provider and case, JSON on stdout."""
    device = CPU()
    case = _case(*argv[1:4])
    prov = peers.PROVIDERS[argv[0]]
    set_threads(common.THREADS)
    _warm_up(prov.get(), device, args.seed)
    x = device.inputs(case, args.seed)
    args.no_memory = True
    r = {**device.floor(x, args), "shape": case.shape.name,
         **measure(prov, x, case, args, device)}
    derive(r, x, device, "floor")
    print(json.dumps(r))


def mem_child(argv):
    """Subprocess body for the CPU memory measurement (see common.peak_rss_extra)."""
    mode, provider, seed = argv[0], argv[1], int(argv[5])
    case = _case(*argv[2:5])
    device = CPU()
    set_threads(common.THREADS)
    fn = peers.PROVIDERS[provider].get()
    # JIT / lazy-init warm-up on the smallest shape, so compile-time memory is in both runs.
    _warm_up(fn, device, seed)
    set_threads(common.THREADS)            # see measure()
    x = device.inputs(case, seed)
    lg = x.logits.requires_grad_()
    common.reset_peak_rss()
    if mode == "run":
        timing.fwd_bwd(fn, x, lg)
    print(json.dumps({"maxrss_kb": common.maxrss_kb()}))


# --------------------------------------------------------------------------- tables
def _label(r) -> str:
    return r.get("case", r.get("shape"))


def _is_floor_row(r) -> bool:
    return r.get("provider", "").startswith("(")


def _by_case(rows, case_labels):
    for c in case_labels:
        yield c, [r for r in rows if _label(r) == c and not _is_floor_row(r)]


def _fmt(v, spec, missing="-"):
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else missing


def floor_table_cpu(rows, case_labels, ctx) -> str:
    """Ours against the exp floor, one line per case (and provider, if several)."""
    measured = [r for r in rows if not _is_floor_row(r) and r.get("shape") != "-"]
    provs = list(dict.fromkeys(r["provider"] for r in measured))
    thp = any("thp_fwd_bwd_s" in r or "thp_error" in r for r in measured)
    mem = any("peak_extra_mb" in r for r in measured)
    agree = any("grad_err_eps_L" in r for r in measured)
    hdr = (["provider"] if len(provs) > 1 else []) + [
        "shape", "fwd+bwd", "fwd", "exp(out=buf)", "exp() fresh", "fwd+bwd / exp(out)",
        "target", "issue: fastest peer / torchaudio"]
    if thp:
        hdr += ["THP=1 fwd+bwd", "THP=1 exp() fresh", "THP=1 fwd+bwd / exp(out)"]
    if mem:
        hdr += ["peak extra MB"]
    if agree:
        hdr += ["grad err in eps·L"]
    body = []
    for c, rs in _by_case(measured, case_labels):
        for r in rs:
            line = [r["provider"]] if len(provs) > 1 else []
            label = f"{c} ({r['shape_desc']})"
            if r.get("status", "ok" if "fwd_bwd_s" in r else "-") not in ("ok", "capped"):
                body.append(line + [label, f"{r.get('status')}: {r.get('note', '')}"]
                            + [""] * (len(hdr) - len(line) - 2))
                continue
            tgt = ""
            if "meets_target" in r:
                tgt = f"<= {TARGET_X_EXP}: {'meets' if r['meets_target'] else 'misses'}"
            peer = (f"{r['issue_fastest_peer_s']} s / {r['issue_torchaudio_s']} s"
                    if r.get("issue_fastest_peer_s") else "")
            line += [label, common.fmt_s(r.get("fwd_bwd_s")), common.fmt_s(r.get("fwd_s")),
                     common.fmt_s(r.get("exp_out_s")), common.fmt_s(r.get("exp_fresh_s")),
                     _fmt(r.get("x_exp"), ".2f"), tgt, peer]
            if thp:
                line += [common.fmt_s(r.get("thp_fwd_bwd_s")), common.fmt_s(r.get("thp_exp_fresh_s")),
                         _fmt(r.get("thp_x_exp"), ".2f")]
            if mem:
                line += [_fmt(max(r["peak_extra_mb"], 0), ".0f") if "peak_extra_mb" in r else "-"]
            if agree:
                line += [(_fmt(r.get("grad_err_eps_L"), ".2g")
                          + (" DISAGREE" if r.get("agree") == "DISAGREE" else ""))]
            body.append(line)
    notes = "; ".join(f"{p} ({peers.PROVIDERS[p].note})" if p in peers.PROVIDERS else p for p in provs)
    return (f"Provider: {notes}; medians of {ctx['reps']} after {ctx['warmup']} warm-up.\n\n"
            + common.md_table(hdr, body))


def pivots_cpu(rows, case_labels) -> str:
    """Provider x case summaries: fwd+bwd time (x exp), forward time, peak extra memory,
    gradient error in eps·L. Skipped/failed cells give the reason in one word."""
    names = list(dict.fromkeys(r["provider"] for r in rows
                               if r.get("shape") != "-" and not _is_floor_row(r)))
    cols = list(case_labels)
    cell = {(r["provider"], _label(r)): r for r in rows}

    def table(title, fmt):
        body = []
        for n in names:
            line = [n]
            for c in cols:
                r = cell.get((n, c), {})
                st = r.get("status")
                line.append(fmt(r) if st in ("ok", "capped") else (st or "-"))
            body.append(line)
        return f"**{title}**\n\n" + common.md_table(["provider", *cols], body)

    floor = {_label(r): r for r in rows if _is_floor_row(r)}
    head = ["exp(out=buf)", *[common.fmt_s(floor[c]["exp_out_s"]) if c in floor else "-" for c in cols]]
    fresh = ["exp() fresh", *[common.fmt_s(floor[c]["exp_fresh_s"]) if c in floor else "-" for c in cols]]

    def fb(r):
        x = f" (x{r['x_exp']:.1f})" if "x_exp" in r else ""
        return common.fmt_s(r.get("fwd_bwd_s")) + x + (" capped" if r.get("status") == "capped" else "")

    lines = table("fwd+bwd, median (x exp(out=buf))", fb).splitlines()
    lines[4:4] = ["| " + " | ".join(head) + " |", "| " + " | ".join(fresh) + " |"]
    out = ["\n".join(lines) + "\n",
           table("forward only, median", lambda r: common.fmt_s(r.get("fwd_s"))),
           table("peak RSS of one fwd+bwd beyond the inputs, MiB",
                 lambda r: f"{max(r['peak_extra_mb'], 0):.0f}" if "peak_extra_mb" in r else "-"),
           table("gradient error in units of eps·max|L| ('-' = not checked; DISAGREE = beyond the "
                 "run's bound, --tol-factor, given per row below)",
                 lambda r: (f"{r['grad_err_eps_L']:.2g}" + (" DISAGREE" if r.get("agree") == "DISAGREE" else ""))
                 if "grad_err_eps_L" in r else "-")]
    return "\n".join(out)


def peers_markdown_cpu(rows, case_labels) -> str:
    out = [pivots_cpu(rows, case_labels), "**All rows**\n"]
    hdr = ["shape", "provider", "fwd+bwd", "x exp", "fwd", "peak extra MB", "loss err",
           "grad err", "grad err in eps·L", "agree (bound)", "status"]
    body = []
    for c in case_labels:
        for r in (r for r in rows if _label(r) == c):
            if _is_floor_row(r):
                body.append([f"**{c}** {r['shape_desc']}", "exp(out=buf) / exp() fresh",
                             common.fmt_s(r.get("exp_out_s")), "1.00",
                             common.fmt_s(r.get("exp_fresh_s")) + " (fresh)",
                             f"{r['logits_mb']:.0f} (logits)", "", "", "", "", ""])
                continue
            e = lambda k: f"{r[k]:.1e}" if isinstance(r.get(k), float) else "-"   # noqa: E731
            ratio = f"{r['x_exp']:.2f}" if isinstance(r.get("x_exp"), float) else "-"
            mem = f"{max(r['peak_extra_mb'], 0):.0f}" if isinstance(r.get("peak_extra_mb"), float) else "-"
            st = r.get("status", "")
            if r.get("note"):
                st += f": {r['note']}"
            body.append(["", r["provider"], common.fmt_s(r.get("fwd_bwd_s")), ratio,
                         common.fmt_s(r.get("fwd_s")), mem, e("loss_rel_err"), e("grad_rel_err"),
                         f"{r['grad_err_eps_L']:.2g}" if "grad_err_eps_L" in r else "-",
                         r.get("agree", "-") + (f" ({r['tol']:.0e})" if "tol" in r else ""), st])
    out.append(common.md_table(hdr, body))
    out.append(_unavailable(rows))
    out.append("\n`x exp` = fwd+bwd time / `torch.exp(logits, out=buf)` time on the same tensor "
               "in the same run. Errors are against a float64 reference "
               "(rnnt_lattice backend='torch' in float64): max abs loss error / max loss and max abs "
               "gradient error / max abs gradient; `grad err in eps·L` is the latter in units of "
               "float32 eps times the largest loss (the rounding scale; see run.tolerance), and the "
               "agreement bound is 16 of those units.\n")
    return "\n".join(o for o in out if o)


def _unavailable(rows) -> str:
    missing = [r for r in rows if r.get("status") == "unavailable"]
    if not missing:
        return ""
    return "\nUnavailable here: " + "; ".join(f"{r['provider']} ({r['note']})" for r in missing) + ".\n"


def table_cuda(rows, case_labels, ctx, meta) -> str:
    """Both CUDA modes: one line per case and provider, against the copy-bandwidth floor."""
    hdr = ["shape", "dtype", "provider", "floor", "fwd+bwd", "x floor", "fwd", "peak memory",
           "x logits", "GB/s", "loss err", "grad err", "agree (bound)"]
    body = []
    for c, rs in _by_case([r for r in rows if r.get("shape") != "-"], case_labels):
        for r in rs:
            label = f"{r['shape']} ({r['shape_desc']})"
            if r.get("status") not in ("ok", "capped"):
                body.append([label, r["dtype"], r["provider"],
                             f"{r.get('status')}: {r.get('note', '')}"] + [""] * (len(hdr) - 4))
                continue
            body.append([label, r["dtype"], r["provider"],
                         common.fmt_s(r["floor_s"]), common.fmt_s(r["fwd_bwd_s"])
                         + (" capped" if r["status"] == "capped" else ""),
                         _fmt(r.get("x_floor"), ".2f"), common.fmt_s(r.get("fwd_s")),
                         f"{r['peak_bytes'] / 2**20:.1f} MiB" if "peak_bytes" in r else "-",
                         _fmt(r.get("peak_x_logits"), ".2f"), _fmt(r.get("v_pass_GBps"), ".3g"),
                         _fmt(r.get("loss_rel_err"), ".1e"), _fmt(r.get("grad_rel_err"), ".1e"),
                         r.get("agree", "-") + (f" ({r['tol']:.0e})" if "tol" in r else "")])
    copy = meta.get("copy_GBps") or float("nan")
    return (f"GPU: {meta.get('gpu')} ({meta.get('gpu_mem_gib')} GiB, sm {meta.get('device_capability')}), "
            f"CUDA {meta.get('cuda')}. Medians of {ctx['reps']} CUDA-event timings after "
            f"{ctx['warmup']} warm-up. floor = 3 x logits bytes / copy bandwidth ({copy:.4g} GB/s, "
            f"measured on a 1 GiB buffer in the same run); x floor = fwd+bwd / floor; GB/s = 3 x "
            f"logits bytes / fwd+bwd; errors against the float64 reference.\n\n"
            + common.md_table(hdr, body) + _unavailable(rows))


def markdown(rows, case_labels, device: str, mode: str, ctx: dict, meta: dict) -> str:
    if mode == "pruned":
        return pruned_pipeline.markdown(rows, device, ctx)
    if mode == "fused":
        return fused_pipeline.markdown(rows, device, ctx)
    if device == "cuda":
        return table_cuda(rows, case_labels, ctx, meta)
    if mode == "floor":
        return floor_table_cpu(rows, case_labels, ctx)
    return peers_markdown_cpu(rows, case_labels)


def render(path: Path, out_dir: Path = None):
    """Rewrite ``<stem>.md`` from ``<stem>.json`` (e.g. after changing the tables' layout).
    Also reads the files of the former scripts (bench_cpu.py, gpu_bench.py, run.py)."""
    d = json.loads(path.read_text())
    meta, rows = d["meta"], d["rows"]
    a = meta.get("args")
    if a is None:                         # bench_cpu.py / gpu_bench.py: re-read their command
        argv = shlex.split(meta.get("command", ""))
        a = {"device": "cuda" if "gpu_bench" in argv[0] else "cpu",
             "mode": "floor" if "bench_cpu" in argv[0] else "peers"}
        known, _ = build_parser().parse_known_args(argv[1:])
        fill_defaults(known, a["device"], a["mode"])
        a.update(reps=known.reps, warmup=known.warmup)
    device, mode = a.get("device", "cpu"), a.get("mode", "peers")
    labels = list(dict.fromkeys(_label(r) for r in rows if r.get("shape") in shapes.SHAPES))
    stem = path.with_suffix("").name
    paths = common.write_results(stem, meta, rows, markdown(rows, labels, device, mode, a, meta),
                                 out_dir=out_dir or path.parent)
    print("wrote", paths["md"], "(and rewrote csv/json from the same rows)")


# --------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="RNN-T loss benchmark: ours against the device's floor (--mode floor) or "
                    "side by side with the peers (--mode peers), on CPU or CUDA. Defaults "
                    "marked * depend on --device/--mode: " + "; ".join(
                        f"{d}/{m}: shapes {' '.join(v['shapes'])}, reps {v['reps']}, warmup "
                        f"{v['warmup']}, agree-max-elems {v['agree_max_elems']:g}"
                        for (d, m), v in DEFAULTS.items()) + ".",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", choices=DEVICES, default="cpu")
    ap.add_argument("--mode", choices=MODES, default="peers",
                    help="floor: ours only, against the exp pass (cpu) or the copy bandwidth "
                         "(cuda); peers: ours and every peer that imports; pruned: the pruned "
                         "RNN-T pipeline, ours against fast_rnnt's, and the full losses; "
                         "fused: a joiner's training step, full, pruned and fused")
    ap.add_argument("--windows", nargs="+", type=int, default=list(pruned_pipeline.WINDOWS),
                    metavar="R", help="pruned: the window sizes R (s_range)")
    ap.add_argument("--hidden", nargs="+", type=int, default=list(fused_pipeline.HIDDEN),
                    metavar="H", help="fused: the joiner widths H")
    ap.add_argument("--ways", nargs="+", choices=list(fused_pipeline.WAYS), default=None,
                    help="fused: the ways timed (default: full pruned fused, and joint on cuda; "
                         "full fused joint with --preset)")
    ap.add_argument("--precision", choices=list(fused_pipeline.PRECISIONS), default="fp32",
                    help="fused: fp32, tf32 (TF32 products) or bf16/fp16 (the forward under "
                         "autocast, the backward outside)")
    ap.add_argument("--loss", choices=list(fused_pipeline.LOSSES), default="rnnt",
                    help="fused: rnnt, or tdt (the last 5 classes of V the durations 0..4)")
    ap.add_argument("--preset", choices=["issue34"], default=None,
                    help="fused: issue 34's rows (shape, H, loss, precision) in place of "
                         "--shapes x --hidden; --shapes narrows them (j1 j2 j3 j4)")
    ap.add_argument("--tile", type=lambda v: int(v) if v.isdigit() else v, default=None,
                    help="fused: rows per tile or a byte budget such as 8MiB (default: the "
                         "library's default for the device)")
    ap.add_argument("--shapes", nargs="+", default=None,
                    help="* shape or group names: shapes " + " ".join(shapes.SHAPES)
                         + "; groups " + ", ".join(f"{k}={'+'.join(v)}" for k, v in shapes.GROUPS.items()))
    ap.add_argument("--variants", nargs="+", default=["regular"], choices=list(shapes.VARIANTS),
                    help="loss variants (topologies) to run each shape with")
    ap.add_argument("--providers", nargs="+", default=None,
                    help="default: ours (floor) or ours and every importable peer (peers) on "
                         f"--device; known: {list(peers.PROVIDERS)}; pruned: pipelines "
                         f"{list(pruned_pipeline.PIPELINES)} and full losses of those "
                         f"(default {list(pruned_pipeline.FULL)})")
    ap.add_argument("--dtype", choices=list(DTYPES), default=None,
                    help="override the shapes' dtype (float32 unless stated in the registry)")
    ap.add_argument("--no-half", action="store_true",
                    help=f"cuda: skip the default half-precision rows {DEFAULT_HALF}")
    ap.add_argument("--quick", action="store_true",
                    help="s1 and s2, 3 reps, 1 warm-up, 10 s cap, no CPU memory subprocesses "
                         "(options given explicitly win)")
    ap.add_argument("--reps", type=int, default=None, help="* timed calls (at least)")
    ap.add_argument("--warmup", type=int, default=None, help="* untimed calls (>= 1)")
    ap.add_argument("--cap", type=float, default=None, help="seconds per provider, case and mode "
                    "(default 120, 10 with --quick)")
    ap.add_argument("--tol-factor", type=float, default=16.0,
                    help="agreement bound on both relative errors = F * eps(dtype) * max(1, max|loss|)")
    ap.add_argument("--agree-max-elems", type=float, default=None,
                    help="* skip the float64 reference above this many logit elements")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--mem-procs", type=int, default=None, metavar="N",
                    help="fused, cpu: fresh processes measuring each way's peak RSS (default "
                         "3; the table gives the largest: glibc's heap differs between "
                         "processes)")
    ap.add_argument("--no-forward", action="store_true")
    ap.add_argument("--thp-compare", action="store_true",
                    help="cpu: re-measure each case in a subprocess with THP_MEM_ALLOC_ENABLE=1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stem", default=None, help="result file stem (default: <device>-<mode>-<date>)")
    ap.add_argument("--out-dir", default=str(common.RESULTS), help="folder for the result files")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--render", metavar="JSON",
                    help="only rewrite the .md of an earlier run from its .json")
    ap.add_argument("--mem-child", nargs=6, help=argparse.SUPPRESS)
    ap.add_argument("--thp-child", nargs=4, help=argparse.SUPPRESS)
    return ap


def fill_defaults(args, device: str = None, mode: str = None) -> None:
    """Replace the options left at None by the (device, mode) defaults, or --quick's."""
    d = dict(DEFAULTS[(device or args.device, mode or args.mode)])
    if getattr(args, "quick", False):
        d.update(QUICK)
        if (device or args.device) == "cpu" and not args.no_memory:
            args.no_memory = True
    for k, v in d.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def select_cases(args) -> list:
    """(shape, dtype, variant) cases of the run: --shapes x --variants with --dtype, plus on
    CUDA the default half-precision rows when nothing narrowed the run."""
    default_shapes = args.shapes is None
    fill_defaults(args)
    dtype = DTYPES[args.dtype] if args.dtype else None
    out = shapes.cases(args.shapes, dtype, args.variants)
    if (args.device == "cuda" and default_shapes and not (args.no_half or args.quick or args.dtype)):
        out += [shapes.Case(shapes.SHAPES[s], DTYPES[dt], v) for v in args.variants
                for s, dt in DEFAULT_HALF]
    return out


def parse(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.thp_compare and args.device != "cpu":
        ap.error("--thp-compare applies to --device cpu only")
    if args.mode == "fused" and (args.variants != ["regular"] or args.dtype or args.thp_compare
                                 or args.providers):
        ap.error("--mode fused runs its ways on a joiner (--loss, --precision): no --variants, "
                 "--dtype, --thp-compare, --providers")
    if args.mode != "fused" and (args.ways or args.preset or args.loss != "rnnt"
                                 or args.precision != "fp32"):
        ap.error("--ways, --preset, --loss and --precision are --mode fused's")
    if args.mem_procs is not None and (args.mode != "fused" or args.mem_procs < 1):
        ap.error(f"--mem-procs is --mode fused's, at least 1, got {args.mem_procs}")
    if args.preset and args.shapes is None:
        args.shapes = ["joint_gpu"]                 # the preset's shapes, narrowed by --shapes
    if args.mode == "pruned":
        if args.variants != ["regular"] or args.dtype or args.thp_compare:
            ap.error("--mode pruned runs float32 regular lattices: no --variants, --dtype, "
                     "--thp-compare")
        if any(r < 1 for r in args.windows):
            ap.error(f"--windows must be >= 1, got {args.windows}")
        for n in args.providers or []:
            if n not in pruned_pipeline.PIPELINES and n not in peers.PROVIDERS:
                ap.error(f"unknown pipeline or provider {n!r}; pipelines: "
                         f"{list(pruned_pipeline.PIPELINES)}, providers: {list(peers.PROVIDERS)}")
    return ap, args


def main(argv=None) -> int:
    ap, args = parse(argv)
    if args.mem_child:
        return mem_child(args.mem_child)
    if args.render:
        return render(Path(args.render))
    device = get_device(args.device)
    device.check()                                 # CUDA: exit 2 at once without a GPU
    if args.mode in ("pruned", "fused"):
        return main_pipeline(ap, args, device)
    try:
        cases = select_cases(args)
    except ValueError as err:
        ap.error(str(err))
    args.warmup = max(1, args.warmup)
    if args.thp_child:
        return thp_child(args.thp_child, args)
    names = args.providers or default_providers(args.device, args.mode)
    for n in names:
        if n not in peers.PROVIDERS:
            ap.error(f"unknown provider {n!r}; known: {list(peers.PROVIDERS)}")

    set_threads(common.THREADS)
    meta = common.machine_info()
    meta.update(device.info())
    meta["args"] = {k: v for k, v in vars(args).items()
                    if k not in ("mem_child", "thp_child", "render")}
    meta["clock"] = device.clock.name
    head = f"# {meta['cpu_model']}, threads {common.THREADS}, load {meta['loadavg_at_start']}"
    if args.device == "cuda":
        head = f"# {meta['gpu']}, CUDA {meta['cuda']}, torch {torch.__version__}"
    elif args.mode == "floor":
        head += f", THP {meta['thp_enabled']}, THP_MEM_ALLOC_ENABLE={meta['THP_MEM_ALLOC_ENABLE']}"
    provs, rows = load_providers(names, explicit=bool(args.providers), device=device, args=args,
                                 meta=meta)
    print(head + f"; {args.device}/{args.mode}; providers: {', '.join(p.name for p in provs)}",
          flush=True)
    device.prepare(args)
    if args.device == "cuda":
        meta["copy_GBps"] = device.copy_gbs

    rows += run_cases(cases, provs, device, args)

    stem = args.stem or (f"{args.device}-{args.mode}-"
                         + _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
                         + ("-quick" if args.quick else ""))
    labels = [c.label for c in cases]
    paths = common.write_results(stem, meta, rows,
                                 markdown(rows, labels, args.device, args.mode, meta["args"], meta),
                                 out_dir=Path(args.out_dir))
    print("\nwrote", ", ".join(paths.values()))
    for r in rows:
        if r.get("agree") == "DISAGREE":
            print(f"DISAGREE: {r['provider']} at {_label(r)}: loss {r['loss_rel_err']:.1e} "
                  f"grad {r['grad_rel_err']:.1e}", file=sys.stderr)
    return 0


def pipeline_shapes(args) -> list:
    """The shapes of a ``--mode pruned`` or ``fused`` run (``--shapes``, default per device)."""
    fill_defaults(args)
    return shapes.resolve(args.shapes)


def main_pipeline(ap, args, device) -> int:
    """``--mode pruned`` (``pruned_pipeline.py``) and ``--mode fused`` (``fused_pipeline.py``)."""
    try:
        shape_list = pipeline_shapes(args)
    except ValueError as err:
        ap.error(str(err))
    pipeline = pruned_pipeline if args.mode == "pruned" else fused_pipeline
    args.warmup = max(1, args.warmup)
    set_threads(common.THREADS)
    meta = common.machine_info()
    meta.update(device.info())
    meta["args"] = {k: v for k, v in vars(args).items() if k not in ("mem_child", "thp_child", "render")}
    meta["clock"] = device.clock.name
    import rnnt_lattice
    meta["rnnt_lattice_path"] = str(Path(rnnt_lattice.__file__).parent)
    what = f"R {args.windows}" if args.mode == "pruned" else f"H {args.hidden}"
    print(f"# {meta.get('gpu') or meta['cpu_model']}, threads {common.THREADS}, load "
          f"{tuple(round(x, 2) for x in meta['loadavg_at_start'])}; {args.device}/{args.mode}; "
          f"{what}; rnnt_lattice from {meta['rnnt_lattice_path']}", flush=True)
    rows = pipeline.run(shape_list, device, args, meta)
    meta["loadavg_at_end"] = os.getloadavg()
    stem = args.stem or (f"{args.device}-{args.mode}-"
                         + _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ"))
    paths = common.write_results(stem, meta, rows, pipeline.markdown(rows, args.device, meta["args"]),
                                 out_dir=Path(args.out_dir))
    print("\nwrote", ", ".join(paths.values()))
    for r in rows:
        if r.get("agree") == "DISAGREE":
            where = f"R={r['R']}" if args.mode == "pruned" else f"H={r['H']}"
            print(f"DISAGREE: {r.get('provider', r.get('way'))} at {r['shape']} {where}: "
                  f"{pipeline._agree(r)}", file=sys.stderr)
    return 0


def load_providers(names, explicit: bool, device, args, meta):
    """Load and warm up each provider (untimed); the ones that fail become 'unavailable' rows."""
    provs, rows = [], []
    for n in names:
        p = peers.PROVIDERS[n]
        try:
            if device.name not in p.devices:
                raise ImportError(f"runs on {'/'.join(p.devices)} only")
            t0 = time.perf_counter()
            fn = p.get()
            _warm_up(fn, device, args.seed)    # JIT compile / lazy init / autotuning
            meta.setdefault("load_and_first_call_s", {})[n] = time.perf_counter() - t0
            provs.append(p)
        except Exception as err:
            if explicit:                  # asked for by name: say why it is missing
                print(f"{n}: unavailable: {err}", file=sys.stderr)
            why = str(err) if isinstance(err, ImportError) else f"{type(err).__name__}: {err}"
            rows.append({"provider": n, "shape": "-", "status": "unavailable", "note": why[:200]})
            device.release()
    meta["providers"] = {p.name: p.note for p in provs}
    return provs, rows


def run_cases(cases, provs, device, args) -> list:
    rows = []
    last = {}   # (provider, variant) -> (elements, fwd+bwd seconds or None if skipped, case)
    for case in cases:
        x = device.inputs(case, args.seed)
        elems = x.logits.numel()
        floor = device.floor(x, args)
        base = {"case": case.label, "shape": case.shape.name, "shape_desc": case.shape.describe(),
                "dtype": case.dtype_name, "variant": case.variant, "device": device.name,
                "logits_mb": x.nbytes / 2**20, "logits_bytes": x.nbytes, **floor}
        rows.append({**base, "provider": device.floor_row, "status": "ok"})
        if device.name == "cpu":
            print(f"\n## {case.label} ({case.shape.describe()}): exp(out=buf) "
                  f"{common.fmt_s(floor['exp_out_s'])}, exp() fresh {common.fmt_s(floor['exp_fresh_s'])}",
                  flush=True)
        else:
            print(f"\n## {case.label} ({case.shape.describe()}, {case.dtype_name}): floor "
                  f"{common.fmt_s(floor['floor_s'])}", flush=True)
        ref = None
        if elems <= args.agree_max_elems:
            try:
                ref = reference(x)
            except Exception as err:
                print(f"  reference failed: {err}", file=sys.stderr)
                device.release()
        for p in provs:
            key = (p.name, case.variant)
            skip = None
            if key in last and last[key][1] is None:
                if elems >= last[key][0]:
                    skip = f"skipped at a smaller shape ({last[key][2]})"
            elif key in last:
                # Extrapolate by element count from the provider's last case; only from a
                # call long enough (>= MIN_PREDICT_S) that fixed per-call costs do not dominate.
                e0, t0, _ = last[key]
                pred = t0 * elems / e0 if t0 >= MIN_PREDICT_S else 0.0
                if pred > args.cap / 2:
                    skip = f"predicted {pred:.0f} s per fwd+bwd (from its previous shape) > cap/2"
            row = {**base, "provider": p.name, **measure(p, x, case, args, device, ref, skip)}
            derive(row, x, device, args.mode)
            if isinstance(row.get("fwd_bwd_s"), float):
                last[key] = (elems, row["fwd_bwd_s"], case.label)
            elif row.get("status") == "skipped" and key in last and last[key][1] is not None:
                last[key] = (elems, None, case.label)    # the smallest case it was skipped at
            if args.thp_compare and row.get("status") in ("ok", "capped"):
                row.update(thp_compare(p, case, args))
            rows.append(row)
            line = (f"  {p.name:28s} fwd+bwd {common.fmt_s(row.get('fwd_bwd_s')):>9s} "
                    f"(x{row.get(device.ratio_key, float('nan')):.2f} floor)  "
                    f"fwd {common.fmt_s(row.get('fwd_s')):>9s}  {device.mem_str(row)}  "
                    f"err loss {row.get('loss_rel_err', float('nan')):.1e} "
                    f"grad {row.get('grad_rel_err', float('nan')):.1e}  {row.get('agree', '')} "
                    f"{row.get('status', '')} {row.get('note', '')}")
            if "meets_target" in row:
                line += f" ({'meets' if row['meets_target'] else 'misses'} <= {TARGET_X_EXP})"
            if "thp_fwd_bwd_s" in row:
                line += (f"  | THP=1: fwd+bwd {common.fmt_s(row['thp_fwd_bwd_s'])}, exp() "
                         f"{common.fmt_s(row.get('thp_exp_fresh_s'))}, x{row.get('thp_x_exp', float('nan')):.2f}")
            print(line, flush=True)
        del x, ref
        device.release()
    return rows


if __name__ == "__main__":
    sys.exit(main())
