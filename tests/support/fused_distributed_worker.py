"""One rank of tests/test_fused_distributed.py: ``python fused_distributed_worker.py
ENGINES OUT`` (engines separated by commas) with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (gloo, CPU).

A small transducer (encoder and prediction projections, a joiner Module) trains one step
on its share of the batch with the fused loss under each engine (``ddp``:
DistributedDataParallel over the model; ``fsdp2``: ``fully_shard`` on the joiner and on
the model), a fresh model each. Rank 0 saves, per engine, the parameters' gradients, times the number of ranks (both
engines average over the ranks; the loss is a sum), and the one-process gradients of
``rnnt_loss`` on the materialised logits of the whole batch, to ``OUT``. The torch backend
(the engines are under test, not the kernels: no Numba to import in each rank)."""
from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist

import rnnt_lattice

B, T, U, H, V = 4, 6, 3, 8, 7


class Joiner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(H, H)
        self.out = torch.nn.Linear(H, V)

    def forward(self, e, p):                          # (B, t, 1, H), (B, 1, u, H)
        return self.out(torch.tanh(self.hidden(e + p)))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Linear(H, H)
        self.pred = torch.nn.Linear(H, H)
        self.joiner = Joiner()

    def forward(self, x, y, targets, tl, ul, fused: bool):
        enc, pred = self.enc(x), self.pred(y)
        if fused:
            return rnnt_lattice.fused_rnnt_loss(self.joiner, enc, pred, targets, tl, ul, blank=0,
                                                reduction="sum", tile=5, backend="torch")
        return rnnt_lattice.rnnt_loss(self.joiner(enc[:, :, None], pred[:, None]), targets, tl,
                                      ul, blank=0, reduction="sum", backend="torch")


def step(engine: str, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Model()
    x, y = torch.randn(B, T, H), torch.randn(B, U + 1, H)
    targets = torch.randint(1, V, (B, U))
    tl, ul = torch.tensor([6, 5, 6, 4]), torch.tensor([3, 2, 1, 3])

    ref = copy.deepcopy(model)
    ref(x, y, targets, tl, ul, fused=False).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}

    if engine == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model.joiner)
        fully_shard(model)
        wrapped = model
    share = slice(rank * B // world, (rank + 1) * B // world)
    wrapped(x[share], y[share], targets[share], tl[share], ul[share], fused=True).backward()
    got = {}
    for n, p in model.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        got[n] = g * world
    return {"got": got, "want": want}


def main(engines: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    res = {}
    for engine in engines.split(","):
        try:
            res[engine] = step(engine, rank, world)
        except Exception as err:                  # noqa: BLE001  reported by the test
            res[engine] = f"{type(err).__name__}: {err}"
            break                                 # the other rank may be stuck: stop here
    if rank == 0:
        torch.save(res, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
