"""Side-by-side RNN-T loss benchmark: agreement, speed (fwd+bwd and forward only), memory.

For every shape (from shapes.py) and provider (from peers.py):

1. agreement: the provider's per-sequence losses and gradient (of their sum) on the float32
   inputs against a float64 reference (rnnt_lattice backend="torch" on the same numbers in
   float64): relative loss error max|dl|/max|l| and gradient error max|dg|/max|g|, flagged
   when beyond float32 rounding (16 eps max|L|, ``--tol-factor``; see ``tolerance``);
2. speed: median wall time after warm-up of forward+backward and of forward only, with a
   time cap per provider and shape (a provider whose time, extrapolated from its previous
   shape by element count, would exceed the cap is skipped with that reason);
3. memory: peak RSS of a fresh subprocess doing one fwd+bwd minus that of a baseline
   subprocess doing everything but the call (imports, JIT warm-up, making the inputs);
4. the floor: ``torch.exp(logits, out=buf)`` and ``torch.exp(logits)`` on the same tensor in
   the same run, and each provider's fwd+bwd time as a multiple of the former.

Threads are fixed (2 by default, RNNT_BENCH_THREADS) for torch, Numba and OpenMP.
Results: benchmarks/results/<stem>.{csv,json,md}, with machine, versions and date.

    python benchmarks/run.py --quick                      # < 1 min: s1, s2, few reps
    benchmarks/.venv-peers/bin/python benchmarks/run.py   # all providers, all shapes
"""
from __future__ import annotations

import common  # first: sets the thread env vars before torch is imported

import argparse                 # noqa: E402
import datetime as _dt          # noqa: E402
import json                     # noqa: E402
import sys                      # noqa: E402
import time                     # noqa: E402
import traceback                # noqa: E402
from pathlib import Path        # noqa: E402

import torch                    # noqa: E402

import peers                    # noqa: E402
import shapes                   # noqa: E402

REFERENCE = "rnnt_lattice_torch"
MIN_PREDICT_S = 0.3


_fwd_bwd, _fwd = common.fwd_bwd, common.fwd


def reference(x: shapes.Inputs):
    """Float64 per-sequence losses and gradient of their sum, on x's numbers."""
    fn = peers.PROVIDERS[REFERENCE].get()
    lg = x.logits.detach().double().requires_grad_()
    costs = _fwd_bwd(fn, x, lg)
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


def measure(prov: peers.Provider, x: shapes.Inputs, args, ref=None, skip_reason=None) -> dict:
    """One provider at one shape: agreement (on the warm-up call), fwd+bwd and fwd timing."""
    row = {}
    if skip_reason:
        row.update(status="skipped", note=skip_reason)
        return row
    fn = prov.get()
    lg = x.logits.detach().clone().requires_grad_()
    # Process-wide thread counts are not the providers' to keep: warprnnt-numba and NeMo set
    # Numba's to 1 on every call (num_threads=0 in their functional API), which would leave
    # every Numba provider timed after them single-threaded.
    common.apply_threads()
    try:
        t0 = time.perf_counter()
        costs = _fwd_bwd(fn, x, lg)                    # warm-up call 1, and the agreement sample
        first = time.perf_counter() - t0
        if ref is not None:
            row.update(agreement(costs, lg.grad, *ref))
            unit = tolerance(ref[0], x.logits.dtype, 1.0)          # eps * max(1, max|L|)
            row["tol"] = args.tol_factor * unit
            row["grad_err_eps_L"] = row["grad_rel_err"] / unit
            bad = not (row["loss_rel_err"] <= row["tol"] and row["grad_rel_err"] <= row["tol"])
            row["agree"] = "DISAGREE" if bad else "ok"
        else:
            row["agree"] = "not checked"
        cap = max(args.cap - first, first)
        fb = common.time_calls(lambda: _fwd_bwd(fn, x, lg), warmup=args.warmup - 1,
                               reps=args.reps, cap_s=cap)
        row.update(fwd_bwd_s=fb["median"], fwd_bwd_min_s=fb["min"], fwd_bwd_reps=fb["reps"],
                   first_call_s=first)
        if not args.no_forward:
            fw = common.time_calls(lambda: _fwd(fn, x), warmup=args.warmup, reps=args.reps,
                                   cap_s=cap)
            row.update(fwd_s=fw["median"], fwd_reps=fw["reps"])
        row["status"] = "capped" if fb["capped"] else "ok"
    except Exception as err:
        row.update(status="error", note=f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}")
        if args.verbose:
            traceback.print_exc()
    return row


def mem_child(argv):
    """Subprocess body for the memory measurement (see common.peak_rss_extra)."""
    mode, provider, shape_name, seed = argv[0], argv[1], argv[2], int(argv[3])
    common.apply_threads()
    fn = peers.PROVIDERS[provider].get()
    # JIT / lazy-init warm-up on the smallest shape, so compile-time memory is in both runs.
    w = shapes.make_inputs(shapes.SHAPES["s1"], seed=seed)
    _fwd_bwd(fn, w, w.logits.requires_grad_())
    del w
    common.apply_threads()                       # see measure()
    x = shapes.make_inputs(shapes.SHAPES[shape_name], seed=seed)
    lg = x.logits.requires_grad_()
    common.reset_peak_rss()
    if mode == "run":
        _fwd_bwd(fn, x, lg)
    print(json.dumps({"maxrss_kb": common.maxrss_kb()}))


def pivots(rows, shape_list) -> str:
    """Provider x shape summaries: fwd+bwd time (x exp), forward time, peak extra memory,
    gradient error in eps·L. Skipped/failed cells give the reason in one word."""
    names = list(dict.fromkeys(r["provider"] for r in rows
                               if r.get("shape") != "-" and r["provider"] != "(exp floor)"))
    cols = [s.name for s in shape_list]
    cell = {(r["provider"], r["shape"]): r for r in rows}

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

    floor = {r["shape"]: r for r in rows if r["provider"] == "(exp floor)"}
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


def markdown(rows, shape_list) -> str:
    out = [pivots(rows, shape_list), "**All rows**\n"]
    hdr = ["shape", "provider", "fwd+bwd", "x exp", "fwd", "peak extra MB", "loss err",
           "grad err", "grad err in eps·L", "agree (bound)", "status"]
    body = []
    for s in shape_list:
        for r in (r for r in rows if r["shape"] == s.name):
            if r["provider"] == "(exp floor)":
                body.append([f"**{s.name}** {r['shape_desc']}", "exp(out=buf) / exp() fresh",
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
    missing = [r for r in rows if r.get("status") == "unavailable"]
    if missing:
        out.append("\nUnavailable here: " + "; ".join(f"{r['provider']} ({r['note']})" for r in missing) + ".\n")
    out.append("\n`x exp` = fwd+bwd time / `torch.exp(logits, out=buf)` time on the same tensor "
               "in the same run. Errors are against a float64 reference "
               "(rnnt_lattice backend='torch' in float64): max abs loss error / max loss and max abs "
               "gradient error / max abs gradient; `grad err in eps·L` is the latter in units of "
               "float32 eps times the largest loss (the rounding scale; see run.tolerance), and the "
               "agreement bound is 16 of those units.\n")
    return "\n".join(out)


def render(path: Path):
    """Rewrite ``<stem>.md`` from ``<stem>.json`` (e.g. after changing the tables' layout)."""
    d = json.loads(path.read_text())
    seen = list(dict.fromkeys(r["shape"] for r in d["rows"] if r.get("shape") in shapes.SHAPES))
    stem = path.with_suffix("").name
    paths = common.write_results(stem, d["meta"], d["rows"], markdown(d["rows"], shapes.resolve(seen)),
                                 out_dir=path.parent)
    print("wrote", paths["md"], "(and rewrote csv/json from the same rows)")


def main():
    ap = argparse.ArgumentParser(description="RNN-T loss providers side by side (CPU).",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["s1", "s2", "s3", "s4", "s5", "ragged", "s1_f64"],
                    help="shape or group names from shapes.py")
    ap.add_argument("--providers", nargs="+", default=None,
                    help=f"default: all importable ones of {list(peers.PROVIDERS)}")
    ap.add_argument("--quick", action="store_true",
                    help="s1 and s2, 3 reps, 10 s cap, no memory subprocesses: under a minute")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls (>= 1)")
    ap.add_argument("--cap", type=float, default=120.0, help="seconds per provider-shape")
    ap.add_argument("--tol-factor", type=float, default=16.0,
                    help="agreement bound on both relative errors = F * eps(dtype) * max(1, max|loss|)")
    ap.add_argument("--agree-max-elems", type=float, default=1.2e8,
                    help="skip the float64 reference above this many logit elements")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-forward", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stem", default=None, help="result file stem (default: run-<date>)")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--render", metavar="JSON",
                    help="only rewrite the .md of an earlier run from its .json")
    ap.add_argument("--mem-child", nargs=4, metavar=("MODE", "PROVIDER", "SHAPE", "SEED"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mem_child:
        return mem_child(args.mem_child)
    if args.render:
        return render(Path(args.render))
    if args.quick:
        if args.shapes == ap.get_default("shapes"):
            args.shapes = ["quick"]
        args.reps, args.warmup, args.cap, args.no_memory = 3, 1, 10.0, True
    args.warmup = max(1, args.warmup)

    common.apply_threads()
    meta = common.machine_info()
    meta["args"] = {k: v for k, v in vars(args).items() if k not in ("mem_child", "render")}
    shape_list = shapes.resolve(args.shapes)
    names = args.providers or list(peers.PROVIDERS)
    provs, rows = [], []
    for n in names:
        p = peers.PROVIDERS[n]
        try:
            t0 = time.perf_counter()
            fn = p.get()
            w = shapes.make_inputs(shapes.SHAPES["s1"], seed=args.seed)
            _fwd_bwd(fn, w, w.logits.requires_grad_())   # JIT compile / lazy init, untimed
            meta.setdefault("load_and_first_call_s", {})[n] = time.perf_counter() - t0
            provs.append(p)
        except Exception as err:
            if args.providers:            # asked for by name: say why it is missing
                print(f"{n}: unavailable: {err}", file=sys.stderr)
            why = str(err) if isinstance(err, ImportError) else f"{type(err).__name__}: {err}"
            rows.append({"provider": n, "shape": "-", "status": "unavailable", "note": why[:200]})
    meta["providers"] = {p.name: p.note for p in provs}
    print(f"# {meta['cpu_model']}, threads {common.THREADS}, load {meta['loadavg_at_start']}; "
          f"providers: {', '.join(p.name for p in provs)}", flush=True)

    last = {}   # provider -> (elements, fwd+bwd seconds or None if skipped, shape name)
    for s in shape_list:
        x = shapes.make_inputs(s, seed=args.seed)
        elems = x.logits.numel()
        floor = common.exp_floor(x.logits, reps=max(3, args.reps))
        base = {"shape": s.name, "shape_desc": s.describe(), "dtype": str(s.dtype).replace("torch.", ""),
                "logits_mb": x.nbytes / 2**20, **floor}
        rows.append({**base, "provider": "(exp floor)", "status": "ok"})
        print(f"\n## {s.name} ({s.describe()}): exp(out=buf) {common.fmt_s(floor['exp_out_s'])}, "
              f"exp() fresh {common.fmt_s(floor['exp_fresh_s'])}", flush=True)
        ref = None
        if elems <= args.agree_max_elems:
            try:
                ref = reference(x)
            except Exception as err:
                print(f"  reference failed: {err}", file=sys.stderr)
        for p in provs:
            skip = None
            if p.name in last and last[p.name][1] is None:
                if elems >= last[p.name][0]:
                    skip = f"skipped at a smaller shape ({last[p.name][2]})"
            elif p.name in last:
                # Extrapolate by element count from the provider's last shape; only from a
                # call long enough (>= MIN_PREDICT_S) that fixed per-call costs do not dominate.
                e0, t0, _ = last[p.name]
                pred = t0 * elems / e0 if t0 >= MIN_PREDICT_S else 0.0
                if pred > args.cap / 2:
                    skip = f"predicted {pred:.0f} s per fwd+bwd (from its previous shape) > cap/2"
            row = {**base, "provider": p.name, **measure(p, x, args, ref, skip)}
            if isinstance(row.get("fwd_bwd_s"), float):
                row["x_exp"] = row["fwd_bwd_s"] / floor["exp_out_s"]
                last[p.name] = (elems, row["fwd_bwd_s"], s.name)
            elif row.get("status") == "skipped" and p.name in last and last[p.name][1] is not None:
                last[p.name] = (elems, None, s.name)    # the smallest shape it was skipped at
            if not args.no_memory and row.get("status") in ("ok", "capped"):
                m = common.peak_rss_extra(Path(__file__), [p.name, s.name, args.seed])
                if "error" in m:
                    row["mem_note"] = m["error"]
                else:
                    row["peak_extra_mb"] = m["extra_mb"]
                    row["baseline_rss_mb"] = m["baseline_mb"]
            rows.append(row)
            print(f"  {p.name:22s} fwd+bwd {common.fmt_s(row.get('fwd_bwd_s')):>9s} "
                  f"(x{row.get('x_exp', float('nan')):.2f} exp)  fwd {common.fmt_s(row.get('fwd_s')):>9s}  "
                  f"mem {row.get('peak_extra_mb', float('nan')):7.0f} MB  "
                  f"err loss {row.get('loss_rel_err', float('nan')):.1e} grad {row.get('grad_rel_err', float('nan')):.1e}"
                  f"  {row.get('agree', '')} {row.get('status', '')} {row.get('note', '')}", flush=True)
        del x, ref

    stem = args.stem or ("run-" + _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
                         + ("-quick" if args.quick else ""))
    paths = common.write_results(stem, meta, rows, markdown(rows, shape_list))
    print("\nwrote", ", ".join(paths.values()))
    bad = [r for r in rows if r.get("agree") == "DISAGREE"]
    for r in bad:
        print(f"DISAGREE: {r['provider']} at {r['shape']}: loss {r['loss_rel_err']:.1e} "
              f"grad {r['grad_rel_err']:.1e}", file=sys.stderr)


if __name__ == "__main__":
    main()
