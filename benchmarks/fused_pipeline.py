"""``run.py --mode fused``: one training step of a transducer's joiner and loss three ways,
time and peak memory.

The model (:class:`JoinerModel`, icefall's joiner): ``e = enc_proj(enc)`` ``(B, T, H)``,
``p = pred_proj(pred)`` ``(B, U+1, H)`` (Linear), then ``joiner(e, p) = out(tanh(e + p))``
(tanh, Linear to V). ``enc`` and ``pred`` are random ``(B, T, H)`` and ``(B, U+1, H)``
leaves. The step is forward + loss + backward into ``enc``, ``pred`` and every parameter:

    full    logits = joiner(e[:, :, None], p[:, None])          (B, T, U+1, V)
            rnnt_loss(logits, ...)
    pruned  simple = rnnt_loss_smoothed(lm_proj(pred), am_proj(enc), ..., occupations)
            ranges = prune_ranges(occ, R=5); e_p, p_p = do_rnnt_pruning(e, p, ranges)
            simple + rnnt_loss_pruned(joiner(e_p, p_p), ...)   (B, T, R, V): icefall's recipe
    fused   fused_rnnt_loss(joiner, e, p, ...)                  tiles of the default size

(``reduction="sum"``, backend "auto": Numba on CPU, Triton on CUDA). ``full`` and
``fused`` compute the same loss and gradients: their agreement is checked on every shape
(relative differences of the loss and of the gradients of enc, pred and the output
Linear's weight). ``pruned`` is another loss (the windows' lattice plus the simple loss).

Time: the median of interleaved steps (one of each way per round, so that a load on the
machine falls on all three alike). Memory on CPU: a fresh subprocess per row (this file,
``--mem-child``) warms up on a small shape, makes the inputs, resets its RSS high-water
mark and runs one step: ``VmHWM - VmRSS`` at the reset. On CUDA: ``max_memory_allocated``
above what was allocated before the step.
"""
from __future__ import annotations

import common  # first: sets the thread env vars before torch is imported

import json                       # noqa: E402
import subprocess                 # noqa: E402
import statistics                 # noqa: E402
import sys                        # noqa: E402
from pathlib import Path          # noqa: E402

import torch                      # noqa: E402

import shapes                     # noqa: E402
import timing                     # noqa: E402
from rnnt_lattice._cli_util import set_threads  # noqa: E402

WAYS = ("full", "pruned", "fused")
HIDDEN = (512, 1024)                  # joiner widths H
R = 5                                 # the pruned way's window
SCALES = dict(lm_only_scale=0.25, am_only_scale=0.0)   # icefall's smoothing


class Joiner(torch.nn.Module):
    """``out(tanh(e + p))`` on projected inputs (an nn.Module: the fused loss finds its
    parameters)."""

    def __init__(self, H: int, V: int):
        super().__init__()
        self.out = torch.nn.Linear(H, V)

    def forward(self, e, p):
        return self.out(torch.tanh(e + p))


class JoinerModel(torch.nn.Module):
    """The projections, the joiner and the pruned recipe's simple-loss projections."""

    def __init__(self, H: int, V: int):
        super().__init__()
        self.enc_proj = torch.nn.Linear(H, H)
        self.pred_proj = torch.nn.Linear(H, H)
        self.joiner = Joiner(H, V)
        self.am_proj = torch.nn.Linear(H, V)     # pruned only: the simple loss's halves
        self.lm_proj = torch.nn.Linear(H, V)


class Inputs:
    """A model and its leaves for one (shape, H), on ``device``, from ``seed``."""

    def __init__(self, shape, H: int, device, seed: int):
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.model = JoinerModel(H, shape.V).to(device)
        B, T, U, V = shape.B, shape.T, shape.U, shape.V
        self.enc = torch.randn(B, T, H, generator=g).to(device).requires_grad_()
        self.pred = torch.randn(B, U + 1, H, generator=g).to(device).requires_grad_()
        self.targets = torch.randint(1, V, (B, U), generator=g).to(device)
        # ragged: the later sequences a little shorter
        self.logit_lengths = (T - torch.arange(B) % 3 * (T // 10)).to(device)
        self.target_lengths = (U - torch.arange(B) % 2 * (U // 10)).to(device)

    def leaves(self):
        return [self.enc, self.pred, *self.model.parameters()]

    def zero(self):
        for x in self.leaves():
            x.grad = None


def step(way: str, x: Inputs, tile=None):
    """One forward + loss + backward of ``way`` (fused: tiles of ``tile``, None: the
    library's default); returns the loss (detached)."""
    import rnnt_lattice
    m = x.model
    args = (x.targets, x.logit_lengths, x.target_lengths)
    e, p = m.enc_proj(x.enc), m.pred_proj(x.pred)
    if way == "full":
        loss = rnnt_lattice.rnnt_loss(m.joiner(e[:, :, None], p[:, None]), *args, blank=0,
                                      reduction="sum")
    elif way == "fused":
        loss = rnnt_lattice.fused_rnnt_loss(m.joiner, e, p, *args, blank=0, reduction="sum",
                                            tile=tile)
    else:
        simple, occ = rnnt_lattice.rnnt_loss_smoothed(
            m.lm_proj(x.pred), m.am_proj(x.enc), *args, blank=0, reduction="sum",
            return_occupations=True, **SCALES)
        win = rnnt_lattice.prune_ranges(occ, R)
        e_p, p_p = rnnt_lattice.do_rnnt_pruning(e, p, win.ranges)
        loss = simple + rnnt_lattice.rnnt_loss_pruned(m.joiner(e_p, p_p), x.targets, win.ranges,
                                                      x.logit_lengths, x.target_lengths,
                                                      blank=0, reduction="sum")
    loss.backward()
    return loss.detach()


def agreement(x: Inputs, tile=None) -> dict:
    """fused against full on the same inputs: relative differences of the loss and of the
    gradients of enc, pred and the output Linear's weight."""
    out = {}
    grads = {}
    for way in ("full", "fused"):
        x.zero()
        loss = step(way, x, tile)
        grads[way] = (loss, x.enc.grad.clone(), x.pred.grad.clone(), x.model.joiner.out.weight.grad.clone())
    (l0, *g0), (l1, *g1) = grads["full"], grads["fused"]
    out["loss_rel_diff"] = float((l1 - l0).abs() / l0.abs().clamp(min=1.0))
    for name, a, b in zip(("enc", "pred", "out_weight"), g0, g1):
        out[f"grad_{name}_rel_diff"] = float((b - a).abs().max() / a.abs().max().clamp(min=1e-30))
    eps = torch.finfo(torch.float32).eps
    # float32 sums of float32 products in another order (tiles): 1e-4 of the gradients' max,
    # 16 eps of the loss (run.py's tolerance factor)
    ok = out["loss_rel_diff"] <= 16 * eps and all(
        v <= 1e-4 for k, v in out.items() if k.startswith("grad_"))
    out["agree"] = "ok" if ok else "DISAGREE"
    return out


def time_ways(x: Inputs, device, args) -> dict:
    """Median and min of interleaved steps, per way."""
    times = {w: [] for w in WAYS}
    for w in WAYS:                                        # warm-up, untimed
        for _ in range(max(1, args.warmup)):
            x.zero()
            step(w, x, args.tile)
    for _ in range(args.reps):
        for w in WAYS:
            x.zero()
            times[w].append(device.clock.once(lambda: step(w, x, args.tile)))
    return {w: (statistics.median(t), min(t)) for w, t in times.items()}


def cuda_memory(x: Inputs, way: str, tile) -> dict:
    x.zero()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step(way, x, tile)
    torch.cuda.synchronize()
    return {"peak_bytes": torch.cuda.max_memory_allocated() - before}


def cpu_memory(way: str, shape: str, H: int, seed: int, tile) -> dict:
    """Peak RSS of one step in a fresh subprocess (this file, ``--mem-child``)."""
    cmd = [sys.executable, str(Path(__file__)), "--mem-child", way, shape, str(H), str(seed),
           str(tile or "")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        return {"mem_note": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return {"peak_extra_mb": json.loads(p.stdout.strip().splitlines()[-1])["extra_kb"] / 1024}


def mem_child(way: str, shape: str, H: int, seed: int, tile) -> None:
    """Subprocess body of :func:`cpu_memory`: a warm-up step on a small shape, the inputs,
    the high-water mark reset, one step; prints ``{"extra_kb": VmHWM - VmRSS at the reset}``."""
    set_threads(common.THREADS)
    step(way, Inputs(shapes.SHAPES["s1"], 64, "cpu", seed), tile)
    x = Inputs(shapes.SHAPES[shape], H, "cpu", seed)
    rss = common.rss_kb()
    common.reset_peak_rss()
    step(way, x, tile)
    print(json.dumps({"extra_kb": common.maxrss_kb() - rss}))


def run(shape_list, device, args, meta) -> list:
    """Every shape x H: the three ways timed, their memory, fused's agreement with full."""
    import rnnt_lattice
    meta["ways"] = {"full": "rnnt_loss on the materialised logits",
                    "pruned": f"icefall's pruned recipe, R={R}",
                    "fused": "fused_rnnt_loss, tile " + (
                        str(args.tile) if args.tile else
                        f"{rnnt_lattice.fused.default_tile(torch.device(device.name))}, at "
                        f"least {rnnt_lattice.fused.DEFAULT_MIN_ROWS} rows (the default)")}
    meta["joiner"] = "out(tanh(enc_proj(enc) + pred_proj(pred))), Linear(H, H) x 2, Linear(H, V)"
    rows = []
    for shape in shape_list:
        for H in args.hidden:
            x = Inputs(shape, H, device.name, args.seed)
            base = {"shape": shape.name, "shape_desc": shape.describe(), "H": H,
                    "device": device.name}
            print(f"\n## {shape.name} ({shape.describe()}), H={H}", flush=True)
            agree = agreement(x, args.tile)
            print(f"  fused vs full: {_agree(agree)}", flush=True)
            times = time_ways(x, device, args)
            for w in WAYS:
                row = {**base, "way": w, "fwd_bwd_s": times[w][0], "fwd_bwd_min_s": times[w][1],
                       "reps": args.reps}
                if not args.no_memory:
                    row.update(cuda_memory(x, w, args.tile) if device.name == "cuda"
                               else cpu_memory(w, shape.name, H, args.seed, args.tile))
                if w == "fused":
                    row.update(agree)
                rows.append(row)
                print(f"  {w:7s} {timing.fmt_s(row['fwd_bwd_s']):>9s}  {_mem(row)}", flush=True)
            del x
            device.release()
    return rows


def _mem_mb(row):
    if "peak_extra_mb" in row:
        return max(row["peak_extra_mb"], 0.0)
    if "peak_bytes" in row:
        return row["peak_bytes"] / 2**20
    return None


def _mem(row) -> str:
    m = _mem_mb(row)
    return "peak       -" if m is None else f"peak {m:7.0f} MB"


def _agree(r) -> str:
    return (f"{r['agree']}: loss {r['loss_rel_diff']:.1g}, grad enc {r['grad_enc_rel_diff']:.1g}, "
            f"pred {r['grad_pred_rel_diff']:.1g}, out.weight {r['grad_out_weight_rel_diff']:.1g}")


def markdown(rows, device_name: str, ctx: dict) -> str:
    """One line per (shape, H): the three ways' times and memory, fused / full, agreement."""
    mem = "peak extra MB (RSS)" if device_name == "cpu" else "peak MiB"
    out = [f"Medians of {ctx['reps']} interleaved steps (forward + loss + backward) after "
           f"{ctx['warmup']} warm-up ({'wall clock' if device_name == 'cpu' else 'CUDA events'}); "
           f"joiner out(tanh(enc_proj(enc) + pred_proj(pred))); reduction sum; pruned: icefall's "
           f"recipe with R={R}; fused: {ctx.get('tile') or 'the default tile'}. Agreement: fused against full, relative "
           "differences of the loss and of the gradients of enc, pred and out.weight.\n"]
    body = []
    keys = list(dict.fromkeys((r["shape"], r["H"]) for r in rows))
    for shape, H in keys:
        rs = {r["way"]: r for r in rows if r["shape"] == shape and r["H"] == H}
        f, p, z = rs.get("full"), rs.get("pruned"), rs.get("fused")
        mf, mp, mz = (_mem_mb(r) if r else None for r in (f, p, z))
        body.append([f"{shape} ({f['shape_desc']})", H] + [timing.fmt_s(r["fwd_bwd_s"]) for r in (f, p, z)]
                    + [f"{z['fwd_bwd_s'] / f['fwd_bwd_s']:.2f}"]
                    + ["-" if m is None else f"{m:.0f}" for m in (mf, mp, mz)]
                    + ["-" if not (mf and mz) else f"1/{mf / max(mz, 1e-9):.1f}", _agree(z)])
    out.append(common.md_table(["shape", "H", "full", "pruned", "fused", "fused / full time",
                                f"full {mem}", f"pruned {mem}", f"fused {mem}",
                                "fused / full memory", "fused vs full"], body))
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--mem-child":
        tile = sys.argv[6]
        mem_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]),
                  int(tile) if tile.isdigit() else (tile or None))
    else:
        print(__doc__)
