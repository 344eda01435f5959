"""``run.py --mode fused``: one training step of a transducer's joiner and loss, up to four
ways, time and peak memory.

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
    joint   fused_rnnt_loss(Joiner.sharing(joiner.out, "tanh"), e, p, ...): the same weights
            as rnnt_lattice.Joiner, the kernel path (CUDA: the logits never in memory; fp32
            with IEEE products takes the tile path, gpu.joint.takes)
    joint_cublas  the same with gpu.joint.CUBLAS_PRODUCTS on for the step (off by default
            until timed): each chunk's logits by cuBLAS, in memory a chunk at a time, and
            the backend's V passes on them

(``reduction="sum"``, backend "auto": Numba on CPU, Triton on CUDA). ``--loss tdt`` runs
``tdt_loss`` / ``fused_tdt_loss`` instead (the last 5 of V classes the durations 0..4, the
blank the last token; no pruned way). ``--precision``: ``fp32`` (IEEE float32 products),
``tf32`` (``torch.backends.cuda.matmul.allow_tf32`` for the whole step), ``bf16``/``fp16``
(the forward under ``torch.autocast``, the backward outside: PyTorch's AMP recipe). ``--preset issue34`` runs
issue 34's table instead of ``--shapes x --hidden`` (its rows, :data:`ISSUE34`, narrowed by
``--shapes``), with ``--ways full fused joint`` by default. ``full``, ``fused`` and ``joint``
compute the same loss and gradients: their agreement with ``full`` is checked on every row
(relative differences of the loss and of the gradients of enc, pred and the output Linear's
weight, within the precision's rounding). ``pruned`` is another loss (the windows' lattice
plus the simple loss).

Time: the median of interleaved steps (one of each way per round, so that a load on the
machine falls on all ways alike). Memory on CPU: a fresh subprocess per row (this file,
``--mem-child``) warms up on a small shape, makes the inputs, resets its RSS high-water
mark and runs one step: ``VmHWM - VmRSS`` at the reset; ``--mem-procs N`` such processes
a way (default 3), the table giving the largest. On CUDA: ``max_memory_allocated``
above what was allocated before the step.
"""
from __future__ import annotations

import common  # first: sets the thread env vars before torch is imported

import contextlib                 # noqa: E402
import json                       # noqa: E402
import subprocess                 # noqa: E402
import statistics                 # noqa: E402
import sys                        # noqa: E402
from pathlib import Path          # noqa: E402

import torch                      # noqa: E402

import shapes                     # noqa: E402
import timing                     # noqa: E402
import rnnt_lattice                             # noqa: E402
from rnnt_lattice._cli_util import set_threads  # noqa: E402

WAYS = ("full", "pruned", "fused", "joint", "joint_cublas")
# The ways that compute full's loss and gradients (their agreement with full is checked).
CHECKED = ("fused", "joint", "joint_cublas")
# An agreement's entries, by name, after their way's prefix (:func:`agreement`).
AGREEMENT = ("loss_rel_diff", "grad_enc_rel_diff", "grad_pred_rel_diff",
             "grad_out_weight_rel_diff", "agree")
DEFAULT_WAYS = {"cpu": ("full", "pruned", "fused"), "cuda": ("full", "pruned", "fused", "joint")}
HIDDEN = (512, 1024)                  # joiner widths H
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
LOSSES = ("rnnt", "tdt")
TDT_DURATIONS = (0, 1, 2, 3, 4)       # --loss tdt: the last len() of V classes
# Issue 34's table (H100): (shape, H, loss, precision); run.py --preset issue34.
ISSUE34 = (("j1", 512, "rnnt", "fp32"), ("j1", 512, "rnnt", "bf16"), ("j1", 512, "rnnt", "tf32"),
           ("j2", 512, "rnnt", "fp32"), ("j3", 640, "rnnt", "fp32"), ("j4", 640, "tdt", "fp32"))
# Agreement with full: the loss within 16 float32 eps (run.py's factor), the gradients
# within the precision's rounding of the joiner's products summed in another order.
GRAD_TOL = {"fp32": 1e-4, "tf32": 1e-2, "bf16": 3e-2, "fp16": 1e-2}
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
    """A model and its leaves for one (shape, H), on ``device``, from ``seed``; ``loss``
    "rnnt" (blank 0) or "tdt" (the last :data:`TDT_DURATIONS` classes the durations, the
    blank the last token)."""

    def __init__(self, shape, H: int, device, seed: int, loss: str = "rnnt"):
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.model = JoinerModel(H, shape.V).to(device)
        self.kernel_joiner = rnnt_lattice.Joiner.sharing(self.model.joiner.out, "tanh")
        B, T, U, V = shape.B, shape.T, shape.U, shape.V
        self.loss = loss
        n_tok = V - len(TDT_DURATIONS) if loss == "tdt" else V
        self.blank = n_tok - 1 if loss == "tdt" else 0
        self.enc = torch.randn(B, T, H, generator=g).to(device).requires_grad_()
        self.pred = torch.randn(B, U + 1, H, generator=g).to(device).requires_grad_()
        self.targets = torch.randint(1, n_tok - 1, (B, U), generator=g).to(device)
        # ragged: the later sequences a little shorter
        self.logit_lengths = (T - torch.arange(B) % 3 * (T // 10)).to(device)
        self.target_lengths = (U - torch.arange(B) % 2 * (U // 10)).to(device)

    def leaves(self):
        return [self.enc, self.pred, *self.model.parameters()]

    def zero(self):
        for x in self.leaves():
            x.grad = None


@contextlib.contextmanager
def tf32(name: str):
    """TF32 matrix products for the whole step (forward and backward) when ``name`` is
    tf32, as a user turns them on: ``torch.backends.cuda.matmul.allow_tf32`` set for the
    training run, not around the forward alone (restored on exit)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@contextlib.contextmanager
def precision(name: str, device: str):
    """The forward's numerics of ``name`` (:data:`PRECISIONS`): autocast for bf16/fp16
    (the backward runs outside it, as the AMP recipe has it); tf32's products come from
    :func:`tf32` around the whole step."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name)
    with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        yield


def step(way: str, x: Inputs, tile=None, prec: str = "fp32"):
    """One forward + loss + backward of ``way`` (fused, joint: tiles of ``tile``, None: the
    library's default) in the precision ``prec`` (the backward outside autocast; TF32
    products forward and backward for tf32); returns the loss (detached)."""
    m = x.model
    args = (x.targets, x.logit_lengths, x.target_lengths)
    kw = dict(blank=x.blank, reduction="sum")
    if x.loss == "tdt":
        kw["durations"] = list(TDT_DURATIONS)
    with tf32(prec), _cublas_products(way == "joint_cublas"):
        with precision(prec, x.enc.device.type):
            e, p = m.enc_proj(x.enc), m.pred_proj(x.pred)
            if way == "full":
                loss_fn = rnnt_lattice.tdt_loss if x.loss == "tdt" else rnnt_lattice.rnnt_loss
                loss = loss_fn(m.joiner(e[:, :, None], p[:, None]), *args, **kw)
            elif way in CHECKED:
                loss_fn = rnnt_lattice.fused_tdt_loss if x.loss == "tdt" else rnnt_lattice.fused_rnnt_loss
                loss = loss_fn(m.joiner if way == "fused" else x.kernel_joiner, e, p, *args, **kw,
                               tile=tile)
            else:
                simple, occ = rnnt_lattice.rnnt_loss_smoothed(
                    m.lm_proj(x.pred), m.am_proj(x.enc), *args, blank=0, reduction="sum",
                    return_occupations=True, **SCALES)
                win = rnnt_lattice.prune_ranges(occ, R)
                e_p, p_p = rnnt_lattice.do_rnnt_pruning(e, p, win.ranges)
                loss = simple + rnnt_lattice.rnnt_loss_pruned(m.joiner(e_p, p_p), x.targets,
                                                              win.ranges, x.logit_lengths,
                                                              x.target_lengths, blank=0,
                                                              reduction="sum")
        loss.backward()
    return loss.detach()


@contextlib.contextmanager
def _cublas_products(on: bool):
    """``gpu.joint.CUBLAS_PRODUCTS`` on for the block when ``on`` (forward and backward),
    put back after it."""
    if not on:
        yield
        return
    from rnnt_lattice.gpu import joint
    saved, joint.CUBLAS_PRODUCTS = joint.CUBLAS_PRODUCTS, True
    try:
        yield
    finally:
        joint.CUBLAS_PRODUCTS = saved


def way_agreement(agree: dict, way: str) -> dict:
    """``way``'s entries of :func:`agreement`'s dict, without their prefix."""
    pre = "" if way == "fused" else f"{way}_"
    return {k: agree[pre + k] for k in AGREEMENT if pre + k in agree}


def result(way: str, x: Inputs, tile=None, prec: str = "fp32") -> tuple:
    """One :func:`step` of ``way`` from zero gradients: its loss and the gradients of enc,
    pred and the output Linear's weight."""
    x.zero()
    loss = step(way, x, tile, prec)
    return (loss, x.enc.grad.clone(), x.pred.grad.clone(), x.model.joiner.out.weight.grad.clone())


def agreement(x: Inputs, ways, tile=None, prec: str = "fp32") -> dict:
    """Each of ``ways`` (fused, joint) against full on the same inputs: relative differences
    of the loss and of the gradients of enc, pred and the output Linear's weight, per way
    (keys ``<way>_loss_rel_diff`` ..., ``<way>_agree``; fused's without the prefix, as
    before the kernel path)."""
    grads = {way: result(way, x, tile, prec) for way in ("full", *ways)}
    out = {}
    l0, *g0 = grads["full"]
    eps = torch.finfo(torch.float32).eps
    for way in ways:
        pre = "" if way == "fused" else f"{way}_"
        l1, *g1 = grads[way]
        r = {"loss_rel_diff": float((l1 - l0).abs() / l0.abs().clamp(min=1.0))}
        for name, a, b in zip(("enc", "pred", "out_weight"), g0, g1):
            r[f"grad_{name}_rel_diff"] = float((b - a).abs().max() / a.abs().max().clamp(min=1e-30))
        # float32 sums of the products in another order (tiles, the kernels): the
        # precision's rounding of the gradients' max, 16 eps of the loss (run.py's factor;
        # 1e-3 under autocast and TF32, whose logits differ by their rounding)
        ok = (r["loss_rel_diff"] <= (16 * eps if prec == "fp32" else 1e-3)
              and all(v <= GRAD_TOL[prec] for k, v in r.items() if k.startswith("grad_")))
        r["agree"] = "ok" if ok else "DISAGREE"
        out.update({pre + k: v for k, v in r.items()})
    return out


def time_ways(x: Inputs, ways, device, args, prec: str = "fp32") -> dict:
    """Median and min of interleaved steps, per way."""
    times = {w: [] for w in ways}
    for w in ways:                                        # warm-up, untimed
        for _ in range(max(1, args.warmup)):
            x.zero()
            step(w, x, args.tile, prec)
    for _ in range(args.reps):
        for w in ways:
            x.zero()
            times[w].append(device.clock.once(lambda: step(w, x, args.tile, prec)))
    return {w: (statistics.median(t), min(t)) for w, t in times.items()}


def cuda_memory(x: Inputs, way: str, tile, prec: str = "fp32") -> dict:
    x.zero()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step(way, x, tile, prec)
    torch.cuda.synchronize()
    return {"peak_bytes": torch.cuda.max_memory_allocated() - before}


def cpu_memory(way: str, shape: str, H: int, seed: int, tile, loss: str = "rnnt",
               prec: str = "fp32", procs: int = 1) -> dict:
    """Peak RSS of one step in each of ``procs`` fresh subprocesses (this file,
    ``--mem-child``), run one after the other: ``peak_extra_mb`` the largest, every one in
    ``peak_extra_mb_procs``. One process is a sample: where glibc puts the blocks a step
    frees differs from process to process, and the same fused step once read 382 MB in one
    and 44 MB in the next (docs/benchmarks.md, "The fused step's resident memory")."""
    cmd = [sys.executable, str(Path(__file__)), "--mem-child", way, shape, str(H), str(seed),
           str(tile or ""), loss, prec]
    peaks = []
    for _ in range(procs):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            return {"mem_note": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
        peaks.append(json.loads(p.stdout.strip().splitlines()[-1])["extra_kb"] / 1024)
    out = {"peak_extra_mb": max(peaks)}
    if procs > 1:
        out["peak_extra_mb_procs"] = peaks
    return out


def mem_child(way: str, shape: str, H: int, seed: int, tile, loss: str = "rnnt",
              prec: str = "fp32") -> None:
    """Subprocess body of :func:`cpu_memory`: a warm-up step on a small shape, the inputs,
    the high-water mark reset, one step; prints ``{"extra_kb": VmHWM - VmRSS at the reset}``."""
    set_threads(common.THREADS)
    step(way, Inputs(shapes.SHAPES["s1"], 64, "cpu", seed, loss), tile, prec)
    x = Inputs(shapes.SHAPES[shape], H, "cpu", seed, loss)
    rss = common.rss_kb()
    common.reset_peak_rss()
    step(way, x, tile, prec)
    print(json.dumps({"extra_kb": common.maxrss_kb() - rss}))


def runs_of(shape_list, args) -> list:
    """``(shape, H, loss, precision)`` of every row: ``--preset issue34``'s rows (those of
    ``--shapes`` if given), else ``--shapes x --hidden`` with ``--loss`` and ``--precision``."""
    if getattr(args, "preset", None) == "issue34":
        names = {s.name for s in shape_list}
        return [(shapes.SHAPES[n], H, loss, prec) for n, H, loss, prec in ISSUE34 if n in names]
    loss, prec = getattr(args, "loss", "rnnt"), getattr(args, "precision", "fp32")
    return [(shape, H, loss, prec) for shape in shape_list for H in args.hidden]


def ways_of(args, device_name: str, loss: str) -> tuple:
    """The ways of a row: ``--ways``, or the preset's (full, fused, joint), or the device's
    default; never pruned for TDT (icefall's recipe is the regular loss's)."""
    ways = getattr(args, "ways", None) or (
        ("full", "fused", "joint") if getattr(args, "preset", None) else DEFAULT_WAYS[device_name])
    return tuple(w for w in WAYS if w in ways and not (w == "pruned" and loss == "tdt"))


def run(shape_list, device, args, meta) -> list:
    """Every row (:func:`runs_of`): its ways timed, their memory, their agreement with full."""
    tile = (str(args.tile) if args.tile else
            f"{rnnt_lattice.fused.default_tile(torch.device(device.name))}, at least "
            f"{rnnt_lattice.fused.DEFAULT_MIN_ROWS} rows (the default)")
    meta["ways"] = {"full": "rnnt_loss on the materialised logits",
                    "pruned": f"icefall's pruned recipe, R={R}",
                    "fused": "fused_rnnt_loss, tile " + tile,
                    "joint": "fused_rnnt_loss with rnnt_lattice.Joiner (the kernel path on "
                             "CUDA but for fp32 with IEEE products: the tile path), chunks of "
                             + tile,
                    "joint_cublas": "joint with gpu.joint.CUBLAS_PRODUCTS (each chunk's logits "
                                    "by cuBLAS, the V passes on them), chunks of " + tile}
    meta["joiner"] = "out(tanh(enc_proj(enc) + pred_proj(pred))), Linear(H, H) x 2, Linear(H, V)"
    rows = []
    for shape, H, loss, prec in runs_of(shape_list, args):
        ways = ways_of(args, device.name, loss)
        x = Inputs(shape, H, device.name, args.seed, loss)
        base = {"shape": shape.name, "shape_desc": shape.describe(), "H": H,
                "device": device.name}
        if (loss, prec) != ("rnnt", "fp32"):
            base.update(loss=loss, precision=prec)
        print(f"\n## {shape.name} ({shape.describe()}), H={H}, {loss}, {prec}", flush=True)
        checked = [w for w in ways if w in CHECKED]
        agree = agreement(x, checked, args.tile, prec) if checked and "full" in ways else {}
        for w in checked:
            print(f"  {w} vs full: {_agree(agree, '' if w == 'fused' else w + '_')}", flush=True)
        times = time_ways(x, ways, device, args, prec)
        for w in ways:
            row = {**base, "way": w, "fwd_bwd_s": times[w][0], "fwd_bwd_min_s": times[w][1],
                   "reps": args.reps}
            if not args.no_memory:
                row.update(cuda_memory(x, w, args.tile, prec) if device.name == "cuda"
                           else cpu_memory(w, shape.name, H, args.seed, args.tile, loss, prec,
                                           args.mem_procs or 3))
            if w in checked:
                row.update(way_agreement(agree, w))
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


def _agree(r, pre: str = "") -> str:
    """A row's agreement with full (``pre``: the prefix of a way's keys in
    :func:`agreement`'s dict)."""
    if pre + "agree" not in r:
        return "-"
    return (f"{r[pre + 'agree']}: loss {r[pre + 'loss_rel_diff']:.1g}, grad enc "
            f"{r[pre + 'grad_enc_rel_diff']:.1g}, pred {r[pre + 'grad_pred_rel_diff']:.1g}, "
            f"out.weight {r[pre + 'grad_out_weight_rel_diff']:.1g}")


def markdown(rows, device_name: str, ctx: dict) -> str:
    """One line per row: each way's time and memory, the fused ways' time and memory
    against full's, and their agreement with full."""
    mem = "peak extra MB (RSS)" if device_name == "cpu" else "peak MiB"
    ways = [w for w in WAYS if any(r["way"] == w for r in rows)]
    extra = any("precision" in r for r in rows)
    procs = max((len(r.get("peak_extra_mb_procs", ())) for r in rows), default=0)
    out = [f"Medians of {ctx['reps']} interleaved steps (forward + loss + backward) after "
           f"{ctx['warmup']} warm-up ({'wall clock' if device_name == 'cpu' else 'CUDA events'}); "
           f"joiner out(tanh(enc_proj(enc) + pred_proj(pred))); reduction sum; pruned: icefall's "
           f"recipe with R={R}; fused: {ctx.get('tile') or 'the default tile'}."
           + (" joint: the same joiner as rnnt_lattice.Joiner (the kernel path on CUDA; fp32 "
              "with IEEE products: the tile path)."
              if "joint" in ways else "")
           + (" Precision: fp32 (IEEE), tf32 (TF32 products), bf16/fp16 (forward under "
              "autocast, backward outside); loss rnnt or tdt (durations 0..4)." if extra else "")
           + (" joint_cublas: the same with each chunk's logits by cuBLAS "
              "(gpu.joint.CUBLAS_PRODUCTS)." if "joint_cublas" in ways else "")
           + (f" Memory: the largest peak of {procs} fresh processes a way (glibc's heap "
              "differs from process to process)." if procs > 1 else "")
           + f" Agreement: {' and '.join(w for w in ways if w in CHECKED)} against "
           "full, relative differences of the loss and of the gradients of enc, pred and "
           "out.weight.\n"]
    checked = [w for w in ways if w in CHECKED]
    body = []
    keys = list(dict.fromkeys((r["shape"], r["H"], r.get("loss"), r.get("precision")) for r in rows))
    for shape, H, loss, prec in keys:
        rs = {r["way"]: r for r in rows if (r["shape"], r["H"], r.get("loss"), r.get("precision"))
              == (shape, H, loss, prec)}
        any_row = next(iter(rs.values()))
        f = rs.get("full")
        line = [f"{shape} ({any_row['shape_desc']})", H]
        if extra:
            line += [loss or "rnnt", prec or "fp32"]
        line += [timing.fmt_s(rs[w]["fwd_bwd_s"]) if w in rs else "-" for w in ways]
        line += [f"{rs[w]['fwd_bwd_s'] / f['fwd_bwd_s']:.2f}" if w in rs and f else "-"
                 for w in checked]
        mems = {w: _mem_mb(rs[w]) if w in rs else None for w in ways}
        line += ["-" if mems[w] is None else f"{mems[w]:.0f}" for w in ways]
        mf = mems.get("full")
        line += ["-" if not (mf and mems[w]) else f"1/{mf / max(mems[w], 1e-9):.1f}" for w in checked]
        line += [_agree(rs[w]) if w in rs else "-" for w in checked]
        body.append(line)
    head = ["shape", "H"] + (["loss", "precision"] if extra else []) + list(ways)
    head += [f"{w} / full time" for w in checked] + [f"{w} {mem}" for w in ways]
    head += [f"{w} / full memory" for w in checked] + [f"{w} vs full" for w in checked]
    out.append(common.md_table(head, body))
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) == 9 and sys.argv[1] == "--mem-child":
        tile = sys.argv[6]
        mem_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]),
                  int(tile) if tile.isdigit() else (tile or None), sys.argv[7], sys.argv[8])
    else:
        print(__doc__)
