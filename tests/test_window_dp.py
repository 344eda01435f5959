"""The window dynamic program of math.md section 10 (``prune_ranges(method="exact")``,
``prune_coverage``): the Numba kernel (``cpu.window_dp``), the Triton kernel
(``gpu.window_dp``, under the interpreter) and the PyTorch loop
(``torch_backend.window_dp``) against an enumeration of every sequence of
starts on tiny problems, and against each other (totals, and the starts, ties to the
lowest) on larger ones; ``best_window_starts`` with its pins runs the device's kernel."""
from __future__ import annotations

import itertools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from rnnt_lattice import cpu, torch_backend  # noqa: E402
from rnnt_lattice.pruned import windows as coverage  # noqa: E402
from support.backends import need_triton  # noqa: E402

NEG_INF = float("-inf")


def _triton_dp():
    need_triton()
    from rnnt_lattice import gpu
    if not gpu.INTERPRETED:                                  # pragma: no cover
        pytest.skip("the Triton backend was imported without the interpreter")
    return gpu.window_dp


DPS = {
    "numba": lambda: cpu.window_dp,
    "triton": _triton_dp,
    "torch": lambda: torch_backend.window_dp,
}


def _mass(B, T, S, seed, holes=0.2, integer=True):
    """Random window masses; integers make ties frequent; ``holes`` of them -inf (starts
    not allowed)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(0, 4, (B, T, S), generator=g).to(torch.float64) if integer else \
        torch.rand(B, T, S, generator=g, dtype=torch.float64)
    return m.masked_fill(torch.rand(B, T, S, generator=g) < holes, NEG_INF)


def _enumerate(mass, max_step):
    """Best total and a best sequence of starts, by brute force."""
    T, S = mass.shape
    best, arg = NEG_INF, None
    for seq in itertools.product(range(S), repeat=T):
        if any(not 0 <= b - a <= max_step for a, b in zip(seq, seq[1:])):
            continue
        total = 0.0
        for t, s in enumerate(seq):
            total += float(mass[t, s])
        if total > best:
            best, arg = total, seq
    return best, arg


def _path_total(mass, starts):
    return sum(float(mass[t, int(s)]) for t, s in enumerate(starts))


@pytest.mark.parametrize("dp", list(DPS))
@pytest.mark.parametrize("T, S, max_step", [(1, 3, 1), (4, 3, 1), (5, 4, 2), (4, 4, 3), (3, 1, 1)])
def test_dp_equals_enumeration(dp, T, S, max_step):
    fn = DPS[dp]()
    mass = _mass(5, T, S, seed=T * 100 + S * 10 + max_step)
    total, starts = fn(mass, max_step)
    assert total.shape == (5,) and starts.shape == (5, T) and starts.dtype == torch.int64
    for b in range(5):
        want, want_seq = _enumerate(mass[b], max_step)
        assert float(total[b]) == want, (b, float(total[b]), want)
        if want == NEG_INF:
            continue
        seq = starts[b].tolist()
        assert all(0 <= s < S for s in seq)
        assert all(0 <= y - x <= max_step for x, y in zip(seq, seq[1:])), seq
        assert _path_total(mass[b], seq) == want          # an optimum (ties: any of them)


@pytest.mark.parametrize("dp", ["numba", "triton"])
@pytest.mark.parametrize("T, S, max_step, integer", [
    (40, 30, 1, True), (40, 30, 3, True), (25, 17, 6, False), (1, 9, 2, True), (30, 1, 4, True),
])
def test_kernels_equal_torch_loop(dp, T, S, max_step, integer):
    """Totals bit-identical (same additions in the same order) and the same starts, ties
    included (strictly greater replaces: the lowest start wins), also where no finite path
    exists (the lowest start in range)."""
    mass = _mass(6, T, S, seed=T + S + max_step, holes=0.1, integer=integer)
    mass[0] = NEG_INF                                       # no finite path at all
    total, starts = DPS[dp]()(mass, max_step)
    want_total, want_starts = torch_backend.window_dp(mass, max_step)
    assert torch.equal(total, want_total)
    assert torch.equal(starts, want_starts)
    assert ((starts >= 0) & (starts < S)).all()


def test_best_window_starts_pins_on_the_kernel(monkeypatch):
    """The public DP (first/last/n_frames pins) gives the PyTorch loop's answer through the
    Numba kernel, and really runs the kernel on CPU tensors."""
    B, T, S = 5, 12, 6
    mass = _mass(B, T, S, seed=3, holes=0.0)
    n_starts = torch.tensor([6, 4, 1, 6, 3])
    n_frames = torch.tensor([12, 7, 3, 0, 1])
    first = torch.zeros(B, dtype=torch.int64)
    last = torch.tensor([5, 3, 0, 2, 0])
    args = (mass, n_starts, 2)
    kw = dict(first=first, last=last, n_frames=n_frames)
    got = coverage.best_window_starts(*args, **kw)
    monkeypatch.setattr(cpu, "window_dp", torch_backend.window_dp)      # the PyTorch loop
    want = coverage.best_window_starts(*args, **kw)
    assert torch.equal(got[0], want[0])
    fin = torch.isfinite(want[0])
    assert torch.equal(got[1][fin], want[1][fin])
    calls = []
    monkeypatch.undo()
    kernel = cpu.window_dp
    monkeypatch.setattr(cpu, "window_dp", lambda m, k: calls.append(1) or kernel(m, k))
    coverage.best_window_starts(*args, **kw)
    assert calls
