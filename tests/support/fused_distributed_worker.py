"""One rank of tests/test_fused_distributed.py: ``python fused_distributed_worker.py OUT
CASE_ID...`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (gloo,
CPU).

For each case (:data:`CASES`, named by :attr:`Case.id`) a fresh small transducer (encoder
and prediction projections, a joiner Module) trains one step on its share of the batch
with a fused loss under DistributedDataParallel or FSDP2, and rank 0 saves, per
case, what the test checks: the parameters' types after ``backward()`` (FSDP2: resharded,
DTensors), their gradients' types (FSDP2: sharded DTensors), the gradients gathered and
times the number of ranks (both engines average over the ranks; the loss is a sum; FSDP2
on gloo in torch 2.7 and 2.8 sums them: :func:`reduce_scatter_averages`), and
the one-process gradients of ``rnnt_loss`` on the materialised logits of the whole batch.
"""
from __future__ import annotations

import copy
import itertools
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

import rnnt_lattice

B, T, U, H, V = 4, 6, 3, 8, 7
TILE = 5                       # rows per tile: many tiles (label runs of 2) on a rank's 2 sequences

# loss -> (fused function, function on the materialised logits, their options). V = 7 is
# TDT's 4 tokens (blank 3) and 3 durations, and multi-blank's big blank 5 and blank 6: the
# targets, in [1, 3), are labels of every loss.
LOSSES = {
    "rnnt": ("fused_rnnt_loss", "rnnt_loss", dict(blank=0)),
    "tdt": ("fused_tdt_loss", "tdt_loss", dict(blank=3, durations=[0, 1, 2])),
    "multiblank": ("fused_multiblank_rnnt_loss", "multiblank_rnnt_loss",
                   dict(blank=6, big_blank_durations=[2])),
}


class SumJoiner(torch.nn.Module):
    """``out(tanh(hidden(e + p)))``: one projection of the sum."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(H, H)
        self.out = torch.nn.Linear(H, V)

    def forward(self, e, p):                          # (B, t, 1, H), (B, 1, u, H)
        return self.out(torch.tanh(self.hidden(e + p)))


class EncJoiner(torch.nn.Module):
    """``out(tanh(enc(e) + p))``: a submodule applied to ``enc`` inside the joiner, ``pred``
    added as it comes (issue 32's joiner)."""

    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Linear(H, H)
        self.out = torch.nn.Linear(H, V)

    def forward(self, e, p):
        return self.out(torch.tanh(self.enc(e) + p))


def KernelJoiner():
    """``rnnt_lattice.Joiner``: on the Triton backend the fused losses' kernel path, which
    calls the joiner with its private ``_loss`` argument (FSDP2 gathers its parameters as
    for any forward) and reads its weights (issue 34)."""
    return rnnt_lattice.Joiner(H, H, H, V)


JOINERS = {"sum": SumJoiner, "enc": EncJoiner, "kernel": KernelJoiner}

# Where fully_shard goes (FSDP2), then on the model in every layout: the joiner
# ("joiner", issue 32's), nothing else ("model": the joiner's parameters are the root's),
# the joiner's output layer ("out"), or the joiner with the loss computed after the
# model's forward ("outside": the model returns enc and pred).
LAYOUTS = ("joiner", "model", "out", "outside")


@dataclass(frozen=True)
class Case:
    engine: str                 # "ddp" (DistributedDataParallel) or "fsdp2" (fully_shard)
    backend: str                # fused_rnnt_loss's backend ("auto": Numba on CPU)
    joiner: str = "enc"         # JOINERS
    enc_grad: bool = True       # False: the encoder's output detached
    pred_grad: bool = True      # False: the prediction network's output detached
    layout: str = "joiner"      # LAYOUTS (FSDP2)
    loss: str = "rnnt"          # LOSSES

    @property
    def id(self) -> str:
        grads = f"enc{'+-'[not self.enc_grad]}pred{'+-'[not self.pred_grad]}"
        layout = self.layout if self.engine == "fsdp2" else "model"
        return "-".join((self.engine, layout, self.backend, self.joiner, grads, self.loss))


_GRADS = list(itertools.product((True, False), repeat=2))
CASES = (
    # the default backend first, then the reference and Triton (interpreted on CPU): every
    # joiner, enc and pred with and without grad, in issue 32's layout
    [Case("fsdp2", backend, joiner, e, p) for backend in ("auto", "torch")
     for joiner in JOINERS for e, p in _GRADS]
    + [Case("fsdp2", "triton", "enc", e, p) for e, p in _GRADS]
    # the other fused losses (the same Function)
    + [Case("fsdp2", "auto", loss=loss) for loss in ("tdt", "multiblank")]
    # the other layouts
    + [Case("fsdp2", "auto", layout=layout, pred_grad=False) for layout in ("model", "out")]
    + [Case("fsdp2", backend, enc_grad=e, pred_grad=False, layout="outside")
       for backend in ("auto", "torch") for e in (True, False)]
    + [Case("ddp", backend) for backend in ("auto", "torch", "triton")]
    # the joiner the kernels know (the kernel path on Triton; the tile path otherwise)
    + [Case("fsdp2", "triton", "kernel", e, p) for e, p in _GRADS[:2]]
    + [Case("fsdp2", "triton", "kernel", loss=loss) for loss in ("tdt", "multiblank")]
    + [Case("fsdp2", "triton", "kernel", layout=layout, pred_grad=False)
       for layout in ("model", "outside", "out")]
    + [Case("ddp", backend, "kernel") for backend in ("auto", "triton")]
)


class Model(torch.nn.Module):
    def __init__(self, case: Case):
        super().__init__()
        self.case = case
        self.enc = torch.nn.Linear(H, H)
        self.pred = torch.nn.Linear(H, H)
        self.joiner = JOINERS[case.joiner]()

    def features(self, x, y):
        enc, pred = self.enc(x), self.pred(y)
        return (enc if self.case.enc_grad else enc.detach(),
                pred if self.case.pred_grad else pred.detach())

    def forward(self, x, y, targets, tl, ul):
        enc, pred = self.features(x, y)
        if self.case.layout == "outside":
            return enc, pred
        return self.loss(enc, pred, targets, tl, ul)

    def loss(self, enc, pred, targets, tl, ul):
        fused, _, kw = LOSSES[self.case.loss]
        return getattr(rnnt_lattice, fused)(self.joiner, enc, pred, targets, tl, ul,
                                            reduction="sum", tile=TILE,
                                            backend=self.case.backend, **kw)

    def full_loss(self, x, y, targets, tl, ul):
        """The one-process reference: the loss of the materialised logits."""
        enc, pred = self.features(x, y)
        _, full, kw = LOSSES[self.case.loss]
        return getattr(rnnt_lattice, full)(self.joiner(enc[:, :, None], pred[:, None]),
                                           targets, tl, ul, reduction="sum", backend="torch",
                                           **kw)


def batch():
    x, y = torch.randn(B, T, H), torch.randn(B, U + 1, H)
    targets = torch.randint(1, 3, (B, U))
    return x, y, targets, torch.tensor([6, 5, 6, 4]), torch.tensor([3, 2, 1, 3])


def wrap(model: Model) -> torch.nn.Module:
    case = model.case
    if case.engine == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard
    if case.layout in ("joiner", "outside"):
        fully_shard(model.joiner)
        if isinstance(model.joiner, rnnt_lattice.Joiner):
            # FSDP2's own hooks on the joiner keep it on the kernel path (fused._as_written)
            from rnnt_lattice import fused
            assert fused._as_written(model.joiner), "FSDP2 took a Joiner off the kernel path"
    elif case.layout == "out":
        fully_shard(model.joiner.out)
    fully_shard(model)
    return model


def reduce_scatter_averages() -> bool:
    """Whether gloo's ``reduce_scatter_tensor(op=ReduceOp.AVG)`` averages. In torch 2.7
    and 2.8 it sums, silently (pytorch/pytorch#162338), and FSDP2, which reduces float32
    gradients with AVG, then returns the ranks' sum on CPU: a torch bug, which the check
    undoes (the gradients' scale), not the loss's."""
    world = dist.get_world_size()
    out = torch.empty(1)
    dist.reduce_scatter_tensor(out, torch.ones(world), op=dist.ReduceOp.AVG)
    return out.item() == 1.0


def step(case: Case, rank: int, world: int, fsdp2_sums: bool = False) -> dict:
    torch.manual_seed(0)
    model = Model(case)
    data = batch()
    ref = copy.deepcopy(model)
    ref.full_loss(*data).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}

    wrapped = wrap(model)
    share = [t[rank * B // world:(rank + 1) * B // world] for t in data]
    out = wrapped(*share)
    loss = model.loss(*out, *share[2:]) if case.layout == "outside" else out
    loss.backward()
    got, params, grads = {}, {}, {}
    for n, p in model.named_parameters():
        g = p.grad
        params[n], grads[n] = type(p).__name__, type(g).__name__
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        got[n] = None if g is None else g * (1 if fsdp2_sums and case.engine == "fsdp2" else world)
    return {"got": got, "want": want, "params": params, "grads": grads}


def warm_up() -> None:
    """One fused step on the default backend in this process: Numba compiles the CPU
    kernels and caches them on disk, so that the ranks load them instead of compiling them
    at once on the same cores."""
    torch.manual_seed(0)
    model = Model(Case("fsdp2", "auto"))
    model(*batch()).backward()


def main(out: str, ids: list) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    fsdp2_sums = not reduce_scatter_averages()
    res, failed = {}, False
    for case in (c for c in CASES if c.id in ids):
        try:
            res[case.id] = step(case, rank, world, fsdp2_sums)
        except Exception as err:                  # noqa: BLE001  reported by the test
            res[case.id] = f"{type(err).__name__}: {err}"
            failed = True
            break                                 # the other rank may be stuck: stop here
    if rank == 0:
        torch.save(res, out)
    if not failed:
        # Both ranks reach the end before either leaves: on a loaded machine a rank that
        # left first made the other's teardown abort ("terminate called without an active
        # exception").
        dist.barrier()
    # And gloo's teardown itself can abort a rank on a loaded machine, after the barrier
    # and the results (a fresh-clone CI run, 2026-11-30): each rank leaves without it, its
    # output flushed; the system closes the sockets.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
