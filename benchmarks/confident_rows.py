"""The float32 error of a confident model's loss and gradient, every backend, against the
float64 result on the same (rounded) logits: docs/benchmarks.md, "Confident rows".

    python benchmarks/confident_rows.py [--margins 12 15 20] [--backends numba torch triton joiner]
                                        [--topologies regular multiblank tdt simple smoothed]
                                        [--src OTHER_CHECKOUT/src] [--device cuda]

Each row of a (2, 12, 4, 64) batch favours its class on one path by ``margin`` nats over
N(0, 1) logits, so ``p_max = 1 / (1 + rest)`` with ``rest ~ V e^-margin``. The path takes
its label at frame 2u + 1 and covers the other frames with the topology's blanks:

- ``regular``: the blank, a frame at a time (``rnnt_loss``, blank 0);
- ``multiblank``: the longest big blank (durations 2 and 4) that fits before the next
  label's frame, else the blank (``multiblank_rnnt_loss``, NeMo's layout: blank last);
- ``tdt``: the blank with the longest duration of (1, 2, 4) that fits, the labels with
  duration 1; each arc's duration is favoured too (``tdt_loss``, durations 0, 1, 2, 4);
- ``simple`` and ``smoothed`` (``rnnt_loss_simple``; ``rnnt_loss_smoothed`` with both
  scales 0.1; k2's modified lattice, where a label takes its frame): am (B, T, V) favours
  the blank, and the label at its frame; lm (B, U+1, V) is N(0, 1). The gradient's error
  is the larger of am's and lm's, each over its own scale.

``joiner``: the fused losses (``fused_rnnt_loss`` & co.) with a :class:`rnnt_lattice.Joiner`
whose logits are the batch's exactly (:func:`one_hot_joiner`; the values rounded to
bfloat16's, so that every product is exact), on the Triton backend: the joiner's kernel
path, whose logits are never in memory (regular, multi-blank and TDT; the gradient of the
logits read from ``dW``).

Printed per topology, margin and backend: the losses' largest relative error and the
gradient's largest error over its largest entry (the gradient of ``sum(w * loss)``,
signed weights). The Triton backend runs under the interpreter on CPU tensors
(``TRITON_INTERPRET=1`` is set here), or with ``--device cuda`` on the GPU, where the
torch backend runs on CUDA tensors too (Numba on CPU copies). ``--src``: the package of
another checkout (e.g. ``git worktree add /tmp/base <commit>``), to see a change.
"""
from __future__ import annotations

import argparse
import os
import sys

B, T, U, V_TOK = 2, 12, 4, 64
BIG_BLANKS = [2, 4]                    # multi-blank: class blank - 1 - i has BIG_BLANKS[i]
DURATIONS = [0, 1, 2, 4]               # TDT


def batch(topology: str, margin: float, torch):
    """``(inputs, call)``: the float64 inputs (a tuple) and ``call(inputs, backend)`` ->
    per-sequence costs."""
    import rnnt_lattice
    g = torch.Generator().manual_seed(0)
    tl, ul = torch.tensor([T, T - 2]), torch.tensor([U, U - 1])
    if topology in ("simple", "smoothed"):
        return simple_batch(topology, margin, torch, g, tl, ul)
    V = V_TOK + (len(BIG_BLANKS) if topology == "multiblank" else 0)
    n_dur = len(DURATIONS) if topology == "tdt" else 0
    x = torch.randn(B, T, U + 1, V + n_dur, generator=g, dtype=torch.float64)
    blank = 0 if topology == "regular" else V - 1
    labels = [v for v in range(V) if v != blank and not (
        topology == "multiblank" and blank - len(BIG_BLANKS) <= v < blank)]
    y = y0 = torch.tensor(labels)[torch.randint(len(labels), (B, U), generator=g)]
    tl0, ul0 = tl, ul
    blanks = {1: blank}                                   # duration -> class
    if topology == "multiblank":
        blanks.update({d: blank - 1 - i for i, d in enumerate(BIG_BLANKS)})
    for b in range(B):
        t, u, T_b, U_b = 0, 0, int(tl[b]), int(ul[b])
        while t < T_b:
            if u < U_b and t == 2 * u + 1:                # the label's frame
                x[b, t, u, y[b, u]] += margin
                if topology == "tdt":
                    x[b, t, u, V + DURATIONS.index(1)] += margin
                    t += 1
                u += 1
                continue
            gap = (2 * u + 1 if u < U_b else T_b) - t     # frames before the next label
            d = max(k for k in (blanks if topology != "tdt" else (1, 2, 4)) if k <= gap)
            x[b, t, u, blanks.get(d, blank)] += margin
            if topology == "tdt":
                x[b, t, u, V + DURATIONS.index(d)] += margin
            t += d if topology != "regular" else 1

    def call(inputs, backend):
        (z,) = inputs
        y, tl, ul = (t.to(z.device) for t in (y0, tl0, ul0))
        kw = dict(reduction="none", backend=backend)
        if topology == "regular":
            return rnnt_lattice.rnnt_loss(z, y, tl, ul, blank, **kw)
        if topology == "multiblank":
            return rnnt_lattice.multiblank_rnnt_loss(z, y, tl, ul, blank=blank,
                                                     big_blank_durations=BIG_BLANKS, **kw)
        return rnnt_lattice.tdt_loss(z, y, tl, ul, blank=blank, durations=DURATIONS, **kw)
    call.targets = (y0, tl0, ul0)
    return (x,), call


def one_hot_joiner(x, dtype, torch):
    """``(joiner, enc, pred)``: a :class:`rnnt_lattice.Joiner` without projections whose
    logits are ``x (B, T, U+1, V)`` exactly (values a bfloat16 holds: every product is
    exact). ReLU over H = B T (U+1) hidden units, ``h(b,t,u) = 2`` at unit ``(b T + t)
    (U+1) + u`` and 0 elsewhere, ``W`` the logits / 2, no bias: so ``dW``'s column of a node
    is twice the gradient of its logits (:func:`logits_grad`)."""
    import rnnt_lattice
    B_, T_, U1, V = x.shape
    j = torch.arange(B_ * T_ * U1)
    enc = torch.where((j // U1)[None, None] == torch.arange(B_ * T_).view(B_, T_, 1), 1.0, -2.0)
    pred = torch.where(((j % U1)[None, None] == torch.arange(U1).view(1, U1, 1))
                       & ((j // (T_ * U1))[None, None] == torch.arange(B_).view(B_, 1, 1)),
                       1.0, -2.0)
    joiner = rnnt_lattice.Joiner(None, None, B_ * T_ * U1, V, "relu", dtype=dtype,
                                 device=x.device)
    with torch.no_grad():
        joiner.out.weight.copy_(x.reshape(-1, V).t() / 2)
        joiner.out.bias.zero_()
    return (joiner, enc.to(x.device, dtype).requires_grad_(),
            pred.to(x.device, dtype).requires_grad_())


def logits_grad(joiner, shape):
    """The gradient of the logits ``(B, T, U+1, V)`` of a :func:`one_hot_joiner`, from its
    ``dW``."""
    return joiner.out.weight.grad.t().reshape(shape) / 2


def joiner_call(topology: str, torch):
    """``fused(joiner, enc, pred, y, tl, ul)`` of :func:`batch`'s ``topology`` (its
    arguments) on the Triton backend."""
    import rnnt_lattice
    kw = dict(reduction="none", backend="triton")
    if topology == "regular":
        return lambda *a: rnnt_lattice.fused_rnnt_loss(*a, blank=0, **kw)
    if topology == "multiblank":
        return lambda *a: rnnt_lattice.fused_multiblank_rnnt_loss(
            *a, blank=V_TOK + len(BIG_BLANKS) - 1, big_blank_durations=BIG_BLANKS, **kw)
    return lambda *a: rnnt_lattice.fused_tdt_loss(*a, blank=V_TOK - 1, durations=DURATIONS, **kw)


def simple_batch(topology: str, margin: float, torch, g, tl, ul):
    """:func:`batch` of the simple losses: ``((lm, am), call)``."""
    import rnnt_lattice
    am = torch.randn(B, T, V_TOK, generator=g, dtype=torch.float64)
    lm = torch.randn(B, U + 1, V_TOK, generator=g, dtype=torch.float64)
    y = torch.randint(1, V_TOK, (B, U), generator=g)
    am[..., 0] += margin                                  # the blank, except ...
    for b in range(B):
        for u in range(int(ul[b])):                       # ... the label at frame 2u + 1
            am[b, 2 * u + 1, 0] -= margin
            am[b, 2 * u + 1, y[b, u]] += margin
    scales = dict(lm_only_scale=0.1, am_only_scale=0.1) if topology == "smoothed" else {}
    fn = getattr(rnnt_lattice, f"rnnt_loss_{topology}")

    def call(inputs, backend):
        lm, am = inputs
        y_, tl_, ul_ = (t.to(am.device) for t in (y, tl, ul))
        return fn(lm, am, y_, tl_, ul_, blank=0, rnnt_type="modified", reduction="none",
                  backend=backend, **scales)
    return (lm, am), call


def joiner_errors(topology: str, call, x32, w, dev, torch) -> str:
    """The table's last three cells for ``backend = "joiner"``: the kernel path on the
    logits ``x32`` against the float64 loss of those logits (Numba; ``call``: :func:`batch`'s,
    with its targets and lengths)."""
    y, tl, ul = (t.to(dev) for t in call.targets)
    z = x32.double().requires_grad_()
    want = call((z,), "numba")
    (want * w.to(want)).sum().backward()
    want = want.detach()
    joiner, enc, pred = one_hot_joiner(x32.to(dev), torch.float32, torch)
    got = joiner_call(topology, torch)(joiner, enc, pred, y, tl, ul)
    (got * w.to(got)).sum().backward()
    want_g, grad = z.grad, logits_grad(joiner, x32.shape).double().cpu()
    inside = ~torch.isnan(want_g)
    loss_err = float(((got.detach().double().cpu() - want).abs() / want.abs()).max())
    grad_err = float((grad - want_g)[inside].abs().max() / want_g[inside].abs().max())
    return (f"{', '.join(f'{v:.3g}' for v in want.tolist())} | {loss_err:.2g} "
            f"| {grad_err:.2g}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--margins", type=float, nargs="+", default=[12.0, 15.0, 20.0])
    ap.add_argument("--backends", nargs="+", default=["numba", "torch", "triton", "joiner"],
                    choices=["numba", "torch", "triton", "joiner"],
                    help="joiner: the fused losses with a Joiner, on the Triton backend")
    ap.add_argument("--topologies", nargs="+", default=["regular"],
                    choices=["regular", "multiblank", "tdt", "simple", "smoothed"])
    ap.add_argument("--src", help="another checkout's src/ to import rnnt_lattice from")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: the torch and Triton backends on the GPU")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")   # (before triton is imported)
    if args.src:
        sys.path.insert(0, args.src)
    import warnings

    import torch
    import rnnt_lattice

    if args.device == "cuda" and not torch.cuda.is_available():
        print("confident_rows.py --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", category=RuntimeWarning)   # (the interpreter's log(0))
    print(f"rnnt_lattice from {os.path.dirname(rnnt_lattice.__file__)}, device {args.device}")
    print("| topology | margin | backend | loss (B,) | loss: rel. error | grad: error / scale |")
    print("|---|---|---|---|---|---|")
    for topology in args.topologies:
        for margin in args.margins:
            inputs, call = batch(topology, margin, torch)
            x32 = tuple(x.float() for x in inputs)
            w = torch.tensor([1.0, -0.7])
            for backend in args.backends:
                dev = "cpu" if backend == "numba" else args.device
                if backend == "joiner":
                    if topology in ("simple", "smoothed"):
                        continue
                    row = joiner_errors(topology, call, x32[0].bfloat16().float(), w, dev,
                                        torch)
                    print(f"| {topology} | {margin:g} | joiner | {row} |")
                    continue

                def run(xs):
                    zs = tuple(x.detach().to(dev).requires_grad_() for x in xs)
                    costs = call(zs, backend)
                    (costs * w.to(costs)).sum().backward()
                    return costs.detach().double().cpu(), [z.grad.double().cpu() for z in zs]
                want, want_grads = run(tuple(x.double() for x in x32))
                got, grads = run(x32)
                loss_err = float(((got - want).abs() / want.abs()).max())
                grad_err = max(float((gr - wg).abs().max() / wg.abs().max())
                               for gr, wg in zip(grads, want_grads))
                print(f"| {topology} | {margin:g} | {backend} | "
                      f"{', '.join(f'{v:.3g}' for v in want.tolist())} "
                      f"| {loss_err:.2g} | {grad_err:.2g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
