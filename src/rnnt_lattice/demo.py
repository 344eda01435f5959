"""``rnnt-lattice demo``: train a small transducer on a synthetic task and look at its lattice.

Everything is made in memory (nothing is downloaded):

* **Task** — "spoken digits": an utterance is 2-6 digits; each digit is rendered as a
  spectrogram-like pattern of ``N_BINS`` frequency bins (two formant ridges whose
  positions depend on the digit, one of them gliding over the digit's 3-7 frames), with
  1-3 frames of silence between digits, random loudness and Gaussian noise.
* **Model** — a transducer: a convolutional encoder over frames, a stateless prediction
  network (embedding of the previous label, as in stateless transducers), and a joiner
  ``Linear(tanh(enc + pred))`` giving logits ``(B, T, U+1, V)`` for
  :func:`rnnt_lattice.rnnt_loss`.
* **Output folder** — occupancy pictures of the same held-out utterances at
  initialisation and after training (best path drawn), the prune coverage table
  (CSV and markdown), the loss curve, and ``metrics.json``.

Greedy decoding gives the held-out token error rate (TER = edit distance / reference
tokens); ``chance_ter`` in the metrics is the TER of random digit strings of the right
length, the score of a model that learned nothing about the audio.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from . import (__version__, best_alignment, do_rnnt_pruning, fused_rnnt_loss, occupancy,
               prune_coverage, prune_ranges, rnnt_loss, rnnt_loss_pruned, rnnt_loss_simple)
from ._cli_util import check_output_dir, set_threads, threads_said
from ._validate import check_tile
from .plot import plot_occupancy, save

N_DIGITS = 10          # labels 1..10 are the digits 0..9
BLANK = 0
VOCAB = N_DIGITS + 1
N_BINS = 24            # frequency bins per frame
DIGIT_FRAMES = (3, 7)  # frames per digit (inclusive range)
GAP_FRAMES = (1, 3)    # silence between digits: >= 1 so that "3 3" is two events
DIGITS_PER_UTT = (2, 6)
NOISE = 0.5


@dataclass
class Config:
    steps: int = 2000
    batch_size: int = 32
    lr: float = 3e-3
    hidden: int = 96
    seed: int = 0
    eval_every: int = 200
    n_heldout: int = 256
    threads: int = 2
    device: str = "cpu"
    window: int = 5          # --pruned: R
    warm_steps: int = 500    # --pruned: icefall's warm-up of the loss weights
    tile: str = "64KiB"      # --fused: one tile's logits (the demo's are ~0.5 MB a step)


# Printed before the first TER: an untrained model emits a label on almost every frame,
# so its TER is far above 1.
TER_MEANING = ("TER = edit distance / reference length (0 is perfect; above 1 when the "
               "hypothesis is longer than the reference, as an untrained model's are)")


# --------------------------------------------------------------------------- data
def _formants(g: torch.Generator):
    """Per digit: start/end bin of a gliding ridge and a fixed second ridge."""
    perm = torch.randperm(N_BINS - 4, generator=g)[:N_DIGITS].float() + 2
    glide = (torch.rand(N_DIGITS, generator=g) - 0.5) * 8
    second = (torch.randperm(N_BINS - 4, generator=g)[:N_DIGITS].float() + 2)
    return perm, perm + glide, second


def _digit_spectra(formants) -> list:
    """``spectra[d][dur]`` ``(dur, N_BINS)``: digit d's ridges over ``dur`` frames before
    its gain (what :func:`make_batch` draws only the gain, duration and noise of), made
    once per formants (:func:`_spectra_of`)."""
    return _spectra_of(*(tuple(x.tolist()) for x in formants))


@functools.lru_cache(maxsize=8)
def _spectra_of(start: tuple, end: tuple, second: tuple) -> list:
    bins = torch.arange(N_BINS).float()
    start, end, second = (torch.tensor(x) for x in (start, end, second))
    spectra = []
    for d in range(N_DIGITS):
        spectra.append({})
        for dur in range(DIGIT_FRAMES[0], DIGIT_FRAMES[1] + 1):
            pos = torch.linspace(float(start[d]), float(end[d]), dur)[:, None]
            spectra[d][dur] = torch.exp(-0.5 * (bins[None] - pos) ** 2) + 0.7 * torch.exp(
                -0.5 * ((bins[None] - second[d]) / 1.5) ** 2)
    return spectra


def make_batch(n: int, g: torch.Generator, formants):
    """``n`` utterances: features ``(n, T, N_BINS)``, lengths ``(n,)``, targets ``(n, U)``
    (labels 1..10, padded with 0), target lengths ``(n,)``. The draws from ``g`` come in a
    fixed order (per utterance: digits, leading gap, then per digit its frames, gain and
    gap, then the noise), so a seed gives the same data; the spectra are computed once a
    formants (:func:`_digit_spectra`), not once a digit."""
    spectra = _digit_spectra(formants)
    silence = torch.zeros(GAP_FRAMES[1] + 1, N_BINS)
    feats, targets = [], []
    for _ in range(n):
        k = int(torch.randint(DIGITS_PER_UTT[0], DIGITS_PER_UTT[1] + 1, (1,), generator=g))
        digits = torch.randint(0, N_DIGITS, (k,), generator=g)
        frames = [silence[:int(torch.randint(*GAP_FRAMES, (1,), generator=g)) + 1]]
        for d in digits.tolist():
            dur = int(torch.randint(DIGIT_FRAMES[0], DIGIT_FRAMES[1] + 1, (1,), generator=g))
            gain = 0.7 + 0.6 * float(torch.rand(1, generator=g))
            frames.append(gain * spectra[d][dur])
            frames.append(silence[:int(torch.randint(GAP_FRAMES[0], GAP_FRAMES[1] + 1, (1,),
                                                     generator=g))])
        x = torch.cat(frames)
        feats.append(x + NOISE * torch.randn(x.shape, generator=g))
        targets.append(digits + 1)
    T = torch.tensor([len(f) for f in feats])
    U = torch.tensor([len(y) for y in targets])
    X = torch.zeros(n, int(T.max()), N_BINS)
    Y = torch.zeros(n, int(U.max()), dtype=torch.int64)
    for i, (f, y) in enumerate(zip(feats, targets)):
        X[i, : len(f)] = f
        Y[i, : len(y)] = y
    return X, T, Y, U


# --------------------------------------------------------------------------- model
class Transducer(nn.Module):
    """Encoder ``(B, T, F) -> (B, T, H)``, prediction ``(B, U+1) -> (B, U+1, H)``,
    joiner ``-> (B, T, U+1, V)``."""

    def __init__(self, hidden: int):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv1d(N_BINS, hidden, 5, padding=2), nn.ReLU(),
            nn.Conv1d(hidden, hidden, 5, padding=2), nn.ReLU(),
            nn.Conv1d(hidden, hidden, 5, padding=2))
        self.embed = nn.Embedding(VOCAB, hidden)          # previous label (blank = start)
        self.out = nn.Linear(hidden, VOCAB)

    def encode(self, x):
        return self.encoder(x.transpose(1, 2)).transpose(1, 2)        # (B, T, H)

    def predict(self, prev):
        return self.embed(prev)                                        # (B, U+1, H)

    def join(self, enc, pred):
        return self.out(torch.tanh(enc + pred))

    def forward(self, x, y):
        prev = nn.functional.pad(y, (1, 0), value=BLANK)               # (B, U+1)
        enc, pred = self.encode(x), self.predict(prev)
        return self.join(enc[:, :, None, :], pred[:, None, :, :])      # (B, T, U+1, V)

    @torch.no_grad()
    def greedy(self, x, lengths, max_symbols: int = 3) -> list[list[int]]:
        """Greedy decoding, batched: at each frame emit up to ``max_symbols`` labels."""
        enc = self.encode(x)
        B, T, _ = enc.shape
        prev = torch.full((B,), BLANK, dtype=torch.int64, device=x.device)
        hyps: list[list[int]] = [[] for _ in range(B)]
        for t in range(T):
            active = lengths > t
            for _ in range(max_symbols):
                k = self.join(enc[:, t], self.predict(prev)).argmax(-1)
                emit = active & (k != BLANK)
                if not bool(emit.any()):
                    break
                for b in emit.nonzero().flatten().tolist():
                    hyps[b].append(int(k[b]))
                prev = torch.where(emit, k, prev)
                active = emit
        return hyps


def edit_distance(a, b) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def token_error_rate(hyps, Y, U) -> float:
    refs = [Y[i, : int(U[i])].tolist() for i in range(len(hyps))]
    return sum(edit_distance(h, r) for h, r in zip(hyps, refs)) / max(1, int(U.sum()))


# --------------------------------------------------------------------------- progress
class Progress:
    """A small progress bar on stderr: redrawn in place on a terminal, a line every 10%
    otherwise (CI logs)."""

    def __init__(self, total: int, stream=None, width: int = 30):
        self.total, self.width = max(1, total), width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self.last_draw = 0.0
        self.last_decile = -1
        self.suffix = ""

    def update(self, done: int, suffix: str = "") -> None:
        self.suffix = suffix or self.suffix
        now = time.perf_counter()
        elapsed = now - self.start
        eta = elapsed / done * (self.total - done) if done else float("nan")
        frac = done / self.total
        if self.tty:
            if now - self.last_draw < 0.1 and done < self.total:
                return
            self.last_draw = now
            bar = "#" * int(frac * self.width)
            self.stream.write(f"\r[{bar:<{self.width}}] {done}/{self.total} {elapsed:5.1f}s "
                              f"eta {eta:4.0f}s {self.suffix}\033[K")
            if done >= self.total:
                self.stream.write("\n")
        else:
            decile = int(frac * 10)
            if decile == self.last_decile:
                return
            self.last_decile = decile
            self.stream.write(f"progress {done}/{self.total} ({100 * frac:3.0f}%) "
                              f"{elapsed:.1f}s {self.suffix}\n")
        self.stream.flush()


# --------------------------------------------------------------------------- pictures
def _lattice_views(model, X, T, Y, U, blank=BLANK):
    with torch.no_grad():
        logits = model(X, Y)
    args = (logits, Y, T, U)
    return (occupancy(*args, blank=blank), best_alignment(*args, blank=blank))


def _occupancy_figure(occ, ali, Y, U, title, path):
    from matplotlib.figure import Figure   # the optional extra "plot": loaded on use only
    n = occ.node.shape[0]
    fig = Figure(figsize=(6.4, 2.6 * n), dpi=100)
    for i in range(n):
        ax = fig.add_subplot(n, 1, i + 1)
        labels = [str(int(d) - 1) for d in Y[i, : int(U[i])]]
        plot_occupancy(occ, i, ali, labels=labels, ax=ax,
                       title=f"{title}: utterance {i} ({' '.join(labels)})")
    fig.tight_layout()
    save(fig, path)


def _loss_figure(history, evals, path):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6.4, 3.6), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    steps = [h[0] for h in history]
    loss = [h[1] for h in history]
    k = max(1, len(loss) // 50)                    # running mean over ~2% of the run
    smooth = [sum(loss[max(0, i - k + 1): i + 1]) / len(loss[max(0, i - k + 1): i + 1])
              for i in range(len(loss))]
    ax.plot(steps, loss, color="0.8", linewidth=0.8, label="train loss per token")
    ax.plot(steps, smooth, color="C0", label="(running mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("RNN-T loss / token")
    ax.set_yscale("log")
    ax2 = ax.twinx()
    # An untrained model emits on every frame (TER >> 1): the axis stops at 1.
    ax2.plot([e["step"] for e in evals], [min(e["ter"], 1.0) for e in evals], "o-", color="C3",
             label="held-out TER (clipped at 1)")
    ax2.set_ylabel("held-out token error rate")
    ax2.set_ylim(0, 1.02)
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper right", fontsize="small")
    fig.tight_layout()
    save(fig, path)


# --------------------------------------------------------------------------- run
def run(cfg: Config, out: str, log=print, progress_stream=None) -> dict:
    """Train and write the outputs to ``out``; returns the metrics (also in metrics.json)."""
    t_start = time.perf_counter()
    device = torch.device(cfg.device)
    set_threads(cfg.threads)
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(cfg.seed)
    g_task = torch.Generator().manual_seed(12345)          # the task itself never changes
    formants = _formants(g_task)
    g_train = torch.Generator().manual_seed(cfg.seed)
    g_test = torch.Generator().manual_seed(10_000 + cfg.seed)
    Xh, Th, Yh, Uh = (a.to(device) for a in make_batch(cfg.n_heldout, g_test, formants))
    # The pictures show the same two held-out utterances of 4-5 digits before and after.
    show = torch.nonzero((Uh >= 4) & (Uh <= 5)).flatten()[:2]

    model = Transducer(cfg.hidden).to(device)
    init_model = copy.deepcopy(model)                      # for the coverage table
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=max(cfg.steps, 1),
                                                pct_start=0.1)

    g_rand = torch.Generator().manual_seed(cfg.seed + 1)
    rand_hyps = [torch.randint(1, VOCAB, (int(u),), generator=g_rand).tolist() for u in Uh.cpu()]
    chance_ter = token_error_rate(rand_hyps, Yh.cpu(), Uh.cpu())

    def evaluate(step):
        model.eval()
        with torch.no_grad():
            hyps = model.greedy(Xh, Th)
            loss = rnnt_loss(model(Xh, Yh), Yh, Th, Uh, blank=BLANK, reduction="sum")
        model.train()
        ter = token_error_rate(hyps, Yh.cpu(), Uh.cpu())
        return {"step": step, "ter": ter, "loss_per_token": float(loss) / float(Uh.sum())}

    try:
        import matplotlib  # noqa: F401  (the optional extra "plot")
        pictures = True
    except ImportError:
        pictures = False
        log("note: matplotlib is not installed, so no pictures will be drawn "
            "(pip install matplotlib); training, metrics and tables still run")
    occ0, ali0 = _lattice_views(model, Xh[show], Th[show], Yh[show], Uh[show])
    evals = [evaluate(0)]
    log(TER_MEANING)
    log(f"held-out TER at initialisation {evals[0]['ter']:.3f} (chance {chance_ter:.3f}); "
        f"training {cfg.steps} steps on {cfg.device} with {threads_said(cfg.threads)}")
    history = []
    bar = Progress(cfg.steps, progress_stream)
    for step in range(1, cfg.steps + 1):
        X, T, Y, U = (a.to(device) for a in make_batch(cfg.batch_size, g_train, formants))
        loss = rnnt_loss(model(X, Y), Y, T, U, blank=BLANK, reduction="sum") / U.sum()
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        opt.step()
        sched.step()
        history.append((step, loss.item()))
        bar.update(step, f"loss {history[-1][1]:.3f}")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            e = evaluate(step)
            evals.append(e)
            log(f"step {step:5d}/{cfg.steps}  train loss/token {history[-1][1]:.3f}  "
                f"held-out loss/token {e['loss_per_token']:.3f}  held-out TER {e['ter']:.3f}")
    train_seconds = time.perf_counter() - t_start

    occ1, ali1 = _lattice_views(model, Xh[show], Th[show], Yh[show], Uh[show])
    if pictures:
        _occupancy_figure(occ0, ali0, Yh[show], Uh[show], "at initialisation",
                          os.path.join(out, "occupancy_init.png"))
        _occupancy_figure(occ1, ali1, Yh[show], Uh[show], "after training",
                          os.path.join(out, "occupancy_trained.png"))
        _loss_figure(history, evals, os.path.join(out, "loss_curve.png"))

    # Prune coverage on a held-out batch, before and after training.
    sub = slice(0, min(64, cfg.n_heldout))
    max_window = 6
    covs = {}
    for name, m in (("init", init_model), ("trained", model)):
        occ, _ = _lattice_views(m, Xh[sub], Th[sub], Yh[sub], Uh[sub])
        covs[name] = prune_coverage(occ, max_window=max_window).rows()
    with open(os.path.join(out, "prune_coverage.csv"), "w") as f:
        f.write("R,coverage_init,coverage_trained\n")
        for (r, c0), (_, c1) in zip(covs["init"], covs["trained"]):
            f.write(f"{r},{c0:.6f},{c1:.6f}\n")
    with open(os.path.join(out, "prune_coverage.md"), "w") as f:
        f.write("| window R | occupancy mass covered, init | after training |\n|---:|---:|---:|\n")
        for (r, c0), (_, c1) in zip(covs["init"], covs["trained"]):
            f.write(f"| {r} | {100 * c0:.1f}% | {100 * c1:.1f}% |\n")

    metrics = {
        "config": asdict(cfg),
        "heldout_ter": evals[-1]["ter"],
        "heldout_ter_init": evals[0]["ter"],
        "chance_ter": chance_ter,
        "heldout_loss_per_token": evals[-1]["loss_per_token"],
        "evals": evals,
        "train_loss_final": history[-1][1] if history else None,
        "train_seconds": round(train_seconds, 2),
        "prune_coverage": {"window": [r for r, _ in covs["trained"]],
                           "init": [c for _, c in covs["init"]],
                           "trained": [c for _, c in covs["trained"]]},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "rnnt_lattice": __version__},
        "files": sorted(["prune_coverage.csv", "prune_coverage.md", "metrics.json"]
                        + (["occupancy_init.png", "occupancy_trained.png", "loss_curve.png"]
                           if pictures else [])),
    }
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    log(f"held-out TER {metrics['heldout_ter']:.3f} (at initialisation "
        f"{metrics['heldout_ter_init']:.3f}, chance {chance_ter:.3f}); "
        f"{train_seconds:.0f} s; wrote {out}/")
    return metrics


# --------------------------------------------------------------------------- pruned
class PrunedTransducer(Transducer):
    """The demo transducer plus the simple joiner of pruned RNN-T (icefall's
    ``simple_am_proj`` / ``simple_lm_proj``): ``am = Linear(enc) (B, T, V)`` and
    ``lm = Linear(pred) (B, U+1, V)``, whose sum is a joiner cheap enough to run on the
    full lattice without building ``(B, T, U+1, V)``."""

    def __init__(self, hidden: int):
        super().__init__(hidden)
        self.simple_am = nn.Linear(hidden, VOCAB)
        self.simple_lm = nn.Linear(hidden, VOCAB)


def _full_step(model, X, T, Y, U, step, cfg):
    """The plain recipe: the full joiner on every (t, u), ``rnnt_loss``."""
    logits = model(X, Y)                                               # (B, T, U+1, V)
    loss = rnnt_loss(logits, Y, T, U, blank=BLANK, reduction="sum")
    return loss, logits.numel() * logits.element_size(), None


def _pruned_step(model, X, T, Y, U, step, cfg):
    """icefall's pruned recipe: the simple loss, its occupations -> windows of R label
    positions per frame, the full joiner on the windows only, the pruned loss. During the
    warm-up (the first ``cfg.warm_steps``) the simple loss's weight falls from 1 to 0.5
    and the pruned loss's rises from 0.1 to 1, as in icefall."""
    prev = nn.functional.pad(Y, (1, 0), value=BLANK)                   # (B, U+1)
    enc, pred = model.encode(X), model.predict(prev)                   # (B, T, H), (B, U+1, H)
    am, lm = model.simple_am(enc), model.simple_lm(pred)               # (B, T, V), (B, U+1, V)
    simple, occ = rnnt_loss_simple(lm, am, Y, T, U, blank=BLANK, reduction="sum",
                                   return_occupations=True)
    win = prune_ranges(occ, cfg.window)                                # exact DP (math.md 10)
    enc_w, pred_w = do_rnnt_pruning(enc, pred, win.ranges)             # (B, T, R, H) each
    logits = model.out(torch.tanh(enc_w + pred_w))                     # (B, T, R, V)
    pruned = rnnt_loss_pruned(logits, Y, win.ranges, T, U, blank=BLANK, reduction="sum")
    warm = min(1.0, step / max(1, cfg.warm_steps))
    loss = (1.0 - 0.5 * warm) * simple + (0.1 + 0.9 * warm) * pruned
    joiner_bytes = (logits.numel() + am.numel() + lm.numel()) * logits.element_size()
    return loss, joiner_bytes, float(win.covered.mean())


# --------------------------------------------------------------------------- fused
class _Joiner(nn.Module):
    """The demo's joiner as a module over the model's output layer (so that the fused loss
    finds its parameters), recording the largest logits it returned."""

    def __init__(self, out: nn.Linear):
        super().__init__()
        self.out = out
        self.largest = 0

    def forward(self, e, p):
        x = self.out(torch.tanh(e + p))
        self.largest = max(self.largest, x.numel() * x.element_size())
        return x


def _fused_step(model, X, T, Y, U, step, cfg):
    """The full loss without its logits: the joiner and the loss fused by tiles of
    ``cfg.tile`` (``fused_rnnt_loss``); joiner outputs: the largest tile's logits."""
    prev = nn.functional.pad(Y, (1, 0), value=BLANK)                   # (B, U+1)
    enc, pred = model.encode(X), model.predict(prev)                   # (B, T, H), (B, U+1, H)
    joiner = _Joiner(model.out)
    loss = fused_rnnt_loss(joiner, enc, pred, Y, T, U, blank=BLANK, reduction="sum",
                           tile=cfg.tile)
    return loss, joiner, None


_OTHER = {"pruned": (_pruned_step, "pruned, R = {cfg.window}"),
          "fused": (_fused_step, "fused, tile {cfg.tile}")}


def run_pruned(cfg: Config, out: str, log=print, progress_stream=None, other: str = "pruned") -> dict:
    """Train the demo transducer twice from the same initialisation and batches: with the
    full loss, and with ``other``: the pruned recipe (R = ``cfg.window``) or the fused
    joiner and loss (tiles of ``cfg.tile``). Prints and writes (``<other>_comparison.md``,
    ``metrics.json``) the time per step, the memory of the joiner's outputs per step (the
    largest tile's for fused; on CUDA also the peak memory per step) and the held-out TER
    of both."""
    device = torch.device(cfg.device)
    set_threads(cfg.threads)
    os.makedirs(out, exist_ok=True)
    formants = _formants(torch.Generator().manual_seed(12345))
    g_test = torch.Generator().manual_seed(10_000 + cfg.seed)
    Xh, Th, Yh, Uh = (a.to(device) for a in make_batch(cfg.n_heldout, g_test, formants))
    g_rand = torch.Generator().manual_seed(cfg.seed + 1)
    rand_hyps = [torch.randint(1, VOCAB, (int(u),), generator=g_rand).tolist() for u in Uh.cpu()]
    chance_ter = token_error_rate(rand_hyps, Yh.cpu(), Uh.cpu())
    torch.manual_seed(cfg.seed)
    init = PrunedTransducer(cfg.hidden).to(device)
    cuda = device.type == "cuda"

    results = {}
    log(TER_MEANING)
    for name, step_loss in (("full", _full_step), (other, _OTHER[other][0])):
        model = copy.deepcopy(init)
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr,
                                                    total_steps=max(cfg.steps, 1), pct_start=0.1)
        g_train = torch.Generator().manual_seed(cfg.seed)              # the same batches
        log(f"training {cfg.steps} steps with the {name} loss"
            + (f" (R = {cfg.window}, warm-up {cfg.warm_steps} steps)" if name == "pruned" else "")
            + (f" (tiles of {cfg.tile})" if name == "fused" else ""))
        bar = Progress(cfg.steps, progress_stream)
        seconds, joiner_bytes, peaks, covered = [], [], [], []
        for step in range(1, cfg.steps + 1):
            X, T, Y, U = (a.to(device) for a in make_batch(cfg.batch_size, g_train, formants))
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            loss, nbytes, cov = step_loss(model, X, T, Y, U, step, cfg)
            loss = loss / U.sum()
            opt.zero_grad()
            loss.backward()
            if isinstance(nbytes, _Joiner):               # its tiles ran in the backward too
                nbytes = nbytes.largest
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if cuda:
                torch.cuda.synchronize(device)
                peaks.append(torch.cuda.max_memory_allocated(device))
            seconds.append(time.perf_counter() - t0)
            joiner_bytes.append(nbytes)
            if cov is not None:
                covered.append(cov)
            bar.update(step, f"loss {loss.item():.3f}")
        model.eval()
        ter = token_error_rate(model.greedy(Xh, Th), Yh.cpu(), Uh.cpu())
        skip = min(len(seconds) - 1, 10)                              # compilation, warm caches
        results[name] = {
            "heldout_ter": ter,
            "ms_per_step": 1e3 * sum(seconds[skip:]) / len(seconds[skip:]),
            "joiner_output_mb_per_step": sum(joiner_bytes) / len(joiner_bytes) / 2**20,
            "peak_mb_per_step": (max(peaks) / 2**20) if peaks else None,
            "mean_covered_mass": (sum(covered) / len(covered)) if covered else None,
        }
        r = results[name]
        log(f"{name:>6}: {r['ms_per_step']:.1f} ms/step, joiner outputs "
            f"{r['joiner_output_mb_per_step']:.2f} MB/step"
            + (f", peak {r['peak_mb_per_step']:.1f} MB" if peaks else "")
            + (f", windows hold {100 * r['mean_covered_mass']:.1f}% of the simple lattice's mass"
               if covered else "") + f"; held-out TER {ter:.3f}")

    lines = ["| loss | ms / step | joiner outputs MB / step | peak MB / step (CUDA) | held-out TER |",
             "|---|---:|---:|---:|---:|"]
    for name, r in results.items():
        peak = f"{r['peak_mb_per_step']:.1f}" if r["peak_mb_per_step"] is not None else "n/a"
        label = name if name == "full" else _OTHER[name][1].format(cfg=cfg)
        lines.append(f"| {label} | {r['ms_per_step']:.1f} | {r['joiner_output_mb_per_step']:.2f} | "
                     f"{peak} | {r['heldout_ter']:.3f} |")
    with open(os.path.join(out, f"{other}_comparison.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    metrics = {"config": asdict(cfg), "chance_ter": chance_ter, **results,
               "versions": {"python": platform.python_version(), "torch": torch.__version__,
                            "rnnt_lattice": __version__},
               "files": ["metrics.json", f"{other}_comparison.md"]}
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    log(f"wrote {out}/ (chance TER {chance_ter:.3f})")
    return metrics


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Config()
    p.add_argument("--steps", type=int, default=d.steps, help=f"training steps (default {d.steps})")
    p.add_argument("--out", default="rnnt_lattice_demo",
                   help="output folder (default ./rnnt_lattice_demo)")
    p.add_argument("--device", default=d.device, help="torch device (default cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch and numba (default: min(2, cores))")
    p.add_argument("--seed", type=int, default=d.seed, help=f"random seed (default {d.seed})")
    p.add_argument("--pruned", action="store_true",
                   help="train twice, with the full loss and with icefall's pruned recipe "
                        "(simple loss + pruned loss on windows of --window label positions), "
                        "and compare time, memory and held-out TER")
    p.add_argument("--window", type=int, default=None,
                   help=f"--pruned: R, label positions per frame of the pruned loss (default "
                        f"{d.window})")
    p.add_argument("--fused", action="store_true",
                   help="train twice, with the full loss and with the joiner and the loss "
                        "fused by tiles (fused_rnnt_loss), and compare time, memory and "
                        "held-out TER")
    p.add_argument("--tile", default=None,
                   help=f"--fused: rows per tile or a byte budget such as 64MiB (default "
                        f"{d.tile})")


def main_from_args(args) -> int:
    """The ``demo`` command: every argument checked (``ValueError``: one line for the user)
    before the output folder is created and any work done."""
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    threads = args.threads if args.threads is not None else min(2, os.cpu_count() or 1)
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    try:
        dev = torch.device(args.device)
    except RuntimeError as err:
        raise ValueError(f"--device {args.device!r} is not a torch device: {err}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device!r} was asked for but torch sees no CUDA device")
    if dev.type == "meta":
        raise ValueError("--device meta holds no data, so nothing can be trained on it; "
                         "use cpu or an accelerator")
    try:
        torch.zeros(2, device=dev).nonzero()
    except Exception as err:   # a device type torch knows but cannot use here
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        if len(first) > 200:                     # torch's dispatcher lists every backend
            first = first[:200].rstrip() + " ..."
        raise ValueError(f"--device {args.device!r} cannot be used here: {first}") from None
    if args.pruned and args.fused:
        raise ValueError("--pruned and --fused each train a comparison: give one")
    if args.window is not None and not args.pruned:
        raise ValueError("--window is the pruned loss's: give it with --pruned")
    if args.tile is not None and not args.fused:
        raise ValueError("--tile is the fused loss's: give it with --fused")
    window = Config.window if args.window is None else args.window
    if window < 1:
        raise ValueError(f"--window must be >= 1, got {window}")
    tile = Config.tile if args.tile is None else args.tile
    tile = int(tile) if isinstance(tile, str) and tile.isdigit() else tile
    try:
        check_tile(tile)
    except ValueError as err:
        raise ValueError(f"--{err}") from None
    check_output_dir(args.out, "--out")
    cfg = Config(steps=args.steps, seed=args.seed, threads=threads, device=args.device,
                 eval_every=max(1, min(Config.eval_every, math.ceil(args.steps / 4))),
                 window=window, warm_steps=min(Config.warm_steps, max(1, args.steps // 4)),
                 tile=tile)
    log = lambda s: print(s, flush=True)                               # noqa: E731
    if args.pruned or args.fused:
        run_pruned(cfg, args.out, log=log, other="fused" if args.fused else "pruned")
    else:
        run(cfg, args.out, log=log)
    return 0
