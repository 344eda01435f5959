"""The fused loss under data-parallel engines (issues 27 and 32): one training step on 2
gloo ranks on CPU, under DistributedDataParallel and FSDP2 (``fully_shard``), gives the
one-process gradients of the loss on the materialised logits, with every backend (the
default first: Numba on CPU; Triton through its interpreter), ``enc`` and ``pred`` with and
without grad, three joiners (``rnnt_lattice.Joiner`` among them: the kernel path on
Triton), the three fused losses, ``fully_shard`` on the joiner, its output
layer or the model only, and the loss computed inside or after the model's forward. Under FSDP2 every parameter is resharded after ``backward()`` and every gradient is a
sharded DTensor (issue 32: with the kernel backends the joiner's were left gathered and
unreduced). One pair of ranks runs every case (the processes' start dominates the time):
``support/fused_distributed_worker.py``."""
from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch

import rnnt_lattice
from support import backends
from support import fused_distributed_worker as worker

WORKER = pathlib.Path(worker.__file__)


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


def _skip(case: worker.Case) -> str | None:
    """Why ``case`` cannot run here (None: it runs)."""
    if not _gloo():
        return "needs torch.distributed with gloo"
    if case.engine == "fsdp2" and not _fsdp2():
        return "needs FSDP2 (torch.distributed.fsdp.fully_shard)"
    if case.backend == "triton" and "triton" not in backends.names():
        return "needs triton and its interpreter (TRITON_INTERPRET=1)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> dict:
    """Every case that can run here, in one pair of ranks: ``{case id: the worker's
    record, or its error}``."""
    ids = [c.id for c in worker.CASES if _skip(c) is None]
    if not ids:
        return {}
    worker.warm_up()
    src = str(pathlib.Path(rnnt_lattice.__file__).parents[1])
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE="2", NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([src] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    out = tmp_path_factory.mktemp("fused_distributed") / "steps.pt"
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(out), *ids],
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank did not finish in 300 s")
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return torch.load(out)


@pytest.mark.parametrize("case", [
    pytest.param(c, id=c.id, marks=pytest.mark.skipif(_skip(c) is not None, reason=str(_skip(c))))
    for c in worker.CASES])
def test_one_step_gives_the_one_process_gradients(case, steps):
    assert case.id in steps, "not run: an earlier case failed in the ranks"
    res = steps[case.id]
    assert isinstance(res, dict), res                     # the ranks' error
    assert res["want"].keys() == res["got"].keys()
    for name, want in res["want"].items():
        got = res["got"][name]
        if case.engine == "fsdp2":
            assert res["params"][name] == "DTensor", (
                f"{name} is a {res['params'][name]} after backward(): FSDP2 did not reshard it")
        if want is None:
            assert got is None, f"{name}: a gradient where the one-process step has none"
            continue
        if case.engine == "fsdp2":
            assert res["grads"][name] == "DTensor", (
                f"{name}'s gradient is a {res['grads'][name]}, not a sharded DTensor: "
                "FSDP2's post-backward (reduce-scatter) did not run for it")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
