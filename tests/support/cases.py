"""Named lattice cases and input factories shared by the test files.

A case is ``(B, T, U, V)`` padded sizes plus per-sequence lengths and the blank id. The
inputs it makes have NaN-poisoned padding (logits outside each sequence's lattice) and
garbage targets past each target length, so any kernel that reads padding fails loudly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    name: str
    T_lens: tuple          # (B,) frames per sequence; max <= T
    U_lens: tuple          # (B,) labels per sequence; max <= U
    V: int
    blank: int
    T: int | None = None   # padded sizes (default: the longest sequence)
    U: int | None = None

    @property
    def B(self) -> int:
        return len(self.T_lens)

    @property
    def shape(self):
        T = self.T if self.T is not None else max(self.T_lens)
        U = self.U if self.U is not None else max(self.U_lens)
        return self.B, T, U, self.V


# Every named lattice case of the tests, each defined once: ``(T_b...), (U_b...), V, blank``
# and the padded ``T, U`` where they exceed the longest sequence. The tables below pick
# from it by name; the tests parametrise over the tables (or pick a case by name).
CASES = {c.name: c for c in [
    Case("single", (3,), (2,), 5, 0),
    Case("ragged_blank0", (4, 2, 3), (2, 1, 0), 6, 0, T=5, U=3),
    Case("ragged_blank_last", (3, 4, 1), (3, 1, 2), 5, -1),
    Case("blank_last_id", (3, 4, 1), (3, 1, 2), 5, 4),               # the blank as V - 1
    Case("blank_middle", (4, 3), (2, 3), 7, 3, T=4, U=4),
    Case("blank_middle_tight", (4, 3), (2, 3), 7, 3),                 # no padding beyond the longest
    Case("ragged_tight", (4, 2, 3), (2, 1, 0), 6, 0),
    Case("T1", (1, 1), (0, 3), 4, 0),
    Case("T1_U2", (1, 1), (0, 2), 4, 0),                              # one frame: modified has no path
    Case("T1_U0", (1, 5), (0, 0), 4, 1),
    Case("U0", (5, 2), (0, 0), 3, 1),
    Case("U0_V4", (5, 2), (0, 0), 4, 1),
    Case("T0", (0, 3), (1, 1), 4, 2),
    Case("T0_blank0", (0, 3), (1, 2), 4, 0),
    Case("V1_U0", (3,), (0,), 1, 0),
    Case("longer", (5, 6), (3, 2), 4, 2),
    Case("longer_T8", (6, 5, 7), (3, 2, 4), 7, 2, T=8, U=5),
    Case("windows_ragged", (5, 3, 4), (3, 1, 0), 6, 0, T=5, U=3),
    Case("windows_blank_middle", (4, 5), (2, 3), 7, 3, T=5, U=3),
    Case("windows_T1", (1, 3), (0, 2), 5, 1, T=3, U=2),
    Case("single_3x2", (3,), (2,), 4, 0),
    Case("ragged_batch", (5, 3, 4), (3, 1, 0), 5, 0, T=6, U=4),
    Case("blank_last", (4, 2), (2, 2), 5, -1, T=4, U=3),
    Case("blank_middle_V6", (3, 4), (3, 1), 6, 2),
    Case("U0_single", (4,), (0,), 3, 0),
]}


def pick(*names: str) -> list:
    """The cases ``names``, in that order."""
    return [CASES[n] for n in names]


# Tiny lattices: brute-force enumeration stays cheap (T_b - 1 + U_b <= 8).
TINY = pick("single", "ragged_blank0", "ragged_blank_last", "blank_middle", "T1", "U0", "V1_U0",
            "longer")
# The topology tests (TDT with duration 0 has the most paths); infeasible rows for some.
TOPOLOGY = pick("single", "ragged_blank0", "ragged_blank_last", "blank_middle", "T1", "U0_V4", "T0")
# The simple losses (indices are used: 1 ragged, 3 U0, 4 T0, 5 longer).
SIMPLE = pick("single", "ragged_blank0", "ragged_blank_last", "U0", "T0_blank0", "longer_T8")
# The pruned loss on random windows.
WINDOWS = pick("windows_ragged", "windows_blank_middle", "windows_T1")
# The public losses of every topology.
VARIANTS = pick("ragged_blank0", "blank_middle", "T1_U0")
# Packed rows (optimized_transducer).
PACKED = pick("ragged_tight", "blank_last_id", "blank_middle_tight")
# The lattice tools against their own enumeration.
TOOLS = pick("single_3x2", "ragged_batch", "blank_last", "blank_middle_V6", "T1_U2", "U0_single")


def make_inputs(case: Case, dtype=torch.float64, seed: int = 0, scale: float = 1.0,
                poison: bool = True):
    """``(logits (B, T, U+1, V), targets (B, U), logit_lengths (B,), target_lengths (B,),
    blank)`` for ``case``; padding poisoned with NaN (logits) and out-of-range ids (targets)."""
    g = torch.Generator().manual_seed(seed)
    B, T, U, V = case.shape
    blank = case.blank % V
    logits = (scale * torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64)).to(dtype)
    # Labels: any id but the blank.
    others = torch.tensor([v for v in range(V) if v != blank] or [0], dtype=torch.int64)
    targets = others[torch.randint(len(others), (B, U), generator=g)]
    logit_lengths = torch.tensor(case.T_lens, dtype=torch.int64)
    target_lengths = torch.tensor(case.U_lens, dtype=torch.int64)
    if poison:
        t = torch.arange(T)[None, :, None]
        u = torch.arange(U + 1)[None, None, :]
        pad = (t >= logit_lengths[:, None, None]) | (u > target_lengths[:, None, None])
        logits = logits.masked_fill(pad[..., None], float("nan"))
        tpad = torch.arange(U)[None, :] >= target_lengths[:, None]
        targets = targets.masked_fill(tpad, -7)
    return logits, targets, logit_lengths, target_lengths, case.blank


def upstream_weights(B: int, dtype=torch.float64) -> torch.Tensor:
    """Signed, distinct per-sequence upstream gradients."""
    return torch.tensor([(-1.0) ** b * (0.5 + 0.75 * b) for b in range(B)], dtype=dtype)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error relative to max(1, the largest finite reference value); the finite
    entries of ``got`` and ``want`` must coincide."""
    got, want = got.detach().to(torch.float64), want.to(torch.float64)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"non-finite mismatch: {got} vs {want}"
    if not finite.any():
        return 0.0
    scale = max(1.0, want[finite].abs().max().item())
    return (got[finite] - want[finite]).abs().max().item() / scale


def loss_and_grad(fn, logits, *args, weights=None, **kw):
    """``fn(logits, *args, **kw)`` on a fresh leaf copy of ``logits``: its output (detached)
    and the gradient of ``sum(weights * output)`` w.r.t. the logits (``weights``: signed
    per-sequence upstream gradients for a ``(B,)`` output; default 1)."""
    x = logits.detach().clone().requires_grad_()
    out = fn(x, *args, **kw)
    w = torch.ones(()) if weights is None else weights
    (out * w.to(out.dtype)).sum().backward()
    return out.detach(), x.grad
