"""The joiner's kernel path against the loss of the materialised logits, every topology:
the largest difference of the loss and of each gradient (enc, pred, the projections, W,
b) relative to that tensor's largest entry.

    TRITON_INTERPRET=1 python benchmarks/joint_exactness.py [--dtype float64 float32]   # CPU
    python benchmarks/joint_exactness.py --device cuda --blocks default                  # a GPU

On CPU the Triton interpreter runs the kernels (``TRITON_INTERPRET=1``), with blocks of 16
(several blocks of nodes, classes and H at these sizes: ``--blocks small``, the default
there). The reference is ``rnnt_loss`` (``tdt_loss``, ``multiblank_rnnt_loss``) on the
joiner's materialised logits with the float64 torch backend, on the same numbers; a ragged
batch of 3 sequences (T = 5, U = 3, V = 6 tokens), signed per-sequence upstream weights,
``rnnt_lattice.Joiner(5, 7, 20, V)``. docs/benchmarks.md ("The joiner's kernel path") has
the CPU table.
"""
from __future__ import annotations

import argparse
import sys
import warnings

import torch

import rnnt_lattice

TOPOLOGIES = {
    "regular": ("rnnt_loss", dict(blank=0)),
    "modified": ("rnnt_loss", dict(blank=0, rnnt_type="modified")),
    "constrained": ("rnnt_loss", dict(blank=0, rnnt_type="constrained")),
    "one_sym_per_frame": ("rnnt_loss", dict(blank=0, rnnt_type="one_sym_per_frame")),
    "multiblank": ("multiblank_rnnt_loss", dict(blank=5, big_blank_durations=[2, 3])),
    "tdt 0,1,2": ("tdt_loss", dict(blank=5, durations=[0, 1, 2])),
    "tdt 1,3": ("tdt_loss", dict(blank=5, durations=[1, 3])),
}
NAMES = ("enc", "pred", "enc_proj.weight", "enc_proj.bias", "pred_proj.weight",
         "pred_proj.bias", "W", "b")


def errors(name, kw, dtype, device, seed=0) -> dict:
    """The relative errors of one topology (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    B, T, U, V_tok = 3, 5, 3, 6
    V = V_tok + len(kw.get("durations", ()))
    tl, ul = torch.tensor([5, 3, 4]), torch.tensor([3, 1, 2])
    if name in ("modified", "constrained", "one_sym_per_frame"):
        ul = torch.tensor([3, 1, 2])                 # T_b >= U_b (+1): every sequence has a path
    targets = torch.randint(1, 3, (B, U), generator=g)   # below every topology's blanks
    enc = torch.randn(B, T, 5, generator=g, dtype=dtype)
    pred = torch.randn(B, U + 1, 7, generator=g, dtype=dtype)
    torch.manual_seed(seed)
    joiner = rnnt_lattice.Joiner(5, 7, 20, V, dtype=dtype)
    with torch.no_grad():
        joiner.out.weight.mul_(3.0)
    joiner, enc, pred = joiner.to(device), enc.to(device), pred.to(device)
    targets, tl, ul = targets.to(device), tl.to(device), ul.to(device)
    w = torch.tensor([0.5, -1.25, 2.0], dtype=dtype, device=device)
    loss_name, kw = TOPOLOGIES[name]

    def step(fn):
        e, p = enc.clone().requires_grad_(), pred.clone().requires_grad_()
        joiner.zero_grad()
        costs = fn(e, p)
        (costs * w.to(costs.dtype)).sum().backward()
        return [costs.detach().double(), e.grad, p.grad] + [q.grad for q in joiner.parameters()]

    kernel = step(lambda e, p: getattr(rnnt_lattice, "fused_" + loss_name)(
        joiner, e, p, targets, tl, ul, reduction="none", backend="triton", tile=13, **kw))
    full = step(lambda e, p: getattr(rnnt_lattice, loss_name)(
        joiner(e[:, :, None], p[:, None]).double(), targets, tl, ul, reduction="none",
        backend="torch", **kw))
    out = {"loss": float(((kernel[0] - full[0]).abs() / full[0].abs().clamp(min=1)).max())}
    for n, a, b in zip(NAMES, kernel[1:], full[1:]):
        out[n] = float((a.double() - b.double()).abs().max() / b.double().abs().max())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", nargs="+", default=["float64", "float32"],
                    choices=["float64", "float32"])
    ap.add_argument("--blocks", default=None, choices=["small", "default"],
                    help="the kernels' blocks: 16 everywhere (the CPU default) or gpu/joint.py's")
    args = ap.parse_args(argv)
    from rnnt_lattice.gpu import INTERPRETED, joint
    if args.device == "cpu" and not INTERPRETED:
        print("on CPU the kernels run under the Triton interpreter: set TRITON_INTERPRET=1",
              file=sys.stderr)
        return 2
    if (args.blocks or ("small" if args.device == "cpu" else "default")) == "small":
        small = dict(BLOCK_N=16, BLOCK_V=16, BLOCK_H=16, num_warps=1, num_stages=1)
        joint.TILES.update(row=small, grad=dict(small))
        joint.WIDE.clear()
    # float32 with IEEE products on the kernel path too (a GPU gives it the tile path)
    joint.IEEE_FLOAT32 = True
    warnings.simplefilter("ignore", RuntimeWarning)      # the interpreter's masked lanes
    print("| operands | topology | loss | " + " | ".join(f"grad {n}" for n in NAMES) + " |")
    print("|---|---|---|" + "---|" * len(NAMES))
    for dtype in args.dtype:
        for name in TOPOLOGIES:
            e = errors(name, TOPOLOGIES[name][1], getattr(torch, dtype), args.device)
            print(f"| {dtype} | {name} | " + " | ".join(f"{v:.1e}" for v in e.values()) + " |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
