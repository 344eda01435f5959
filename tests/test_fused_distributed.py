"""The fused loss under data-parallel engines (issue 27, defect 10): one training step on
2 gloo ranks on CPU, DistributedDataParallel and FSDP2 (``fully_shard`` on the joiner and
the model), gives the one-process gradients of ``rnnt_loss`` on the materialised logits.
Each rank is a subprocess running ``support/fused_distributed_worker.py``."""
from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch

import rnnt_lattice

WORKER = pathlib.Path(__file__).parent / "support" / "fused_distributed_worker.py"


def _gloo() -> bool:
    try:
        import torch.distributed as dist
        return dist.is_available() and dist.is_gloo_available()
    except ImportError:
        return False


def _fsdp2() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not _gloo(), reason="needs torch.distributed with gloo")
def test_fused_loss_trains_under_ddp_and_fsdp2(tmp_path):
    """Both engines in one pair of ranks (the processes' start dominates the time); FSDP2
    where this torch has ``fully_shard``."""
    engines = ["ddp"] + (["fsdp2"] if _fsdp2() else [])
    src = str(pathlib.Path(rnnt_lattice.__file__).parents[1])
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE="2", NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([src] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    out = tmp_path / "grads.pt"
    procs = [subprocess.Popen([sys.executable, str(WORKER), ",".join(engines), str(out)],
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank did not finish in 180 s")
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    res = torch.load(out)
    for engine in engines:
        assert isinstance(res.get(engine), dict), f"{engine}: {res.get(engine)}"
        got, want = res[engine]["got"], res[engine]["want"]
        assert got.keys() == want.keys()
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{engine} {name}: {m}")
