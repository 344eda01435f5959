"""The shape registry and the one input factory shared by every benchmark run.

Speed runs, memory runs, agreement checks and every provider (ours and the peers) get
their inputs from :func:`make_inputs`, so a row in any table is reproducible from
``(shape name, dtype, seed)`` alone.

Shapes are ``(B, T, U, V)``: logits are ``(B, T, U+1, V)``, targets ``(B, U)``.

    >>> from shapes import SHAPES, make_inputs
    >>> x = make_inputs(SHAPES["s2"], seed=0)
    >>> tuple(x.logits.shape)
    (4, 100, 21, 128)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

# Every provider is called with the same blank. 0 is the id all peers accept (some
# peers' CPU paths only support blank=0 well; torchaudio/ours accept any id), and targets
# are drawn from 1..V-1 so they never hit it.
BLANK = 0


@dataclass(frozen=True)
class Shape:
    """One benchmark case. ``T_range``/``U_range`` make it ragged: per-sequence lengths
    are drawn uniformly (inclusive) and the batch is padded to the longest drawn length,
    as a real data loader would."""
    name: str
    B: int
    T: int
    U: int
    V: int
    dtype: torch.dtype = torch.float32
    T_range: Optional[Tuple[int, int]] = None
    U_range: Optional[Tuple[int, int]] = None

    @property
    def ragged(self) -> bool:
        return self.T_range is not None

    def describe(self) -> str:
        t = f"{self.T_range[0]}..{self.T_range[1]}" if self.T_range else str(self.T)
        u = f"{self.U_range[0]}..{self.U_range[1]}" if self.U_range else str(self.U)
        d = "" if self.dtype == torch.float32 else f" {str(self.dtype).replace('torch.', '')}"
        return f"B={self.B} T={t} U={u} V={self.V}{d}"

    @property
    def elements(self) -> int:
        """Logit elements of the padded ``(B, T, U+1, V)`` tensor (upper bound for ragged)."""
        return self.B * self.T * (self.U + 1) * self.V


SHAPES = {s.name: s for s in (
    Shape("s1", 1, 50, 10, 30),
    Shape("s2", 4, 100, 20, 128),
    Shape("s3", 8, 150, 40, 256),
    Shape("s4", 16, 200, 50, 512),
    Shape("s5", 8, 400, 80, 1024),
    # T and U are the padded maxima; the drawn lengths fix the actual padding.
    Shape("ragged", 8, 300, 60, 500, T_range=(150, 300), U_range=(30, 60)),
    Shape("s1_f64", 1, 50, 10, 30, dtype=torch.float64),
)}

# Named groups used by the command-line tools.
GROUPS = {
    "quick": ["s1", "s2"],
    "core": ["s2", "s3", "s4", "s5", "ragged"],       # the "core" issue's shapes
    "all": ["s1", "s2", "s3", "s4", "s5", "ragged", "s1_f64"],
}


@dataclass
class Inputs:
    logits: torch.Tensor          # (B, T, U+1, V) float, contiguous
    targets: torch.Tensor         # (B, U) int32, values in 1..V-1
    logit_lengths: torch.Tensor   # (B,) int32
    target_lengths: torch.Tensor  # (B,) int32
    blank: int

    @property
    def nbytes(self) -> int:
        return self.logits.numel() * self.logits.element_size()


def resolve(names) -> list:
    """Shape names or group names -> list of :class:`Shape` (order kept, no repeats)."""
    out = []
    for n in names:
        for m in GROUPS.get(n, [n]):
            if m not in SHAPES:
                raise KeyError(f"unknown shape {m!r}; known: {sorted(SHAPES)} and groups {sorted(GROUPS)}")
            if SHAPES[m] not in out:
                out.append(SHAPES[m])
    return out


def make_inputs(shape: Shape, dtype: Optional[torch.dtype] = None, seed: int = 0) -> Inputs:
    """Seeded inputs for ``shape``. ``dtype`` overrides the shape's dtype (the agreement
    check makes float32 inputs and upcasts them itself, so both see the same numbers).

    Logits are standard normal: joiner outputs at initialisation look like this, and it is
    the hardest case for the lattice (no path dominates). The generator is local, so the
    caller's global RNG state is untouched.
    """
    dtype = dtype or shape.dtype
    g = torch.Generator().manual_seed(seed)
    B, V = shape.B, shape.V
    if shape.ragged:
        lo, hi = shape.T_range
        logit_lengths = torch.randint(lo, hi + 1, (B,), generator=g, dtype=torch.int32)
        lo, hi = shape.U_range
        target_lengths = torch.randint(lo, hi + 1, (B,), generator=g, dtype=torch.int32)
        T, U = int(logit_lengths.max()), int(target_lengths.max())
    else:
        T, U = shape.T, shape.U
        logit_lengths = torch.full((B,), T, dtype=torch.int32)
        target_lengths = torch.full((B,), U, dtype=torch.int32)
    # Labels 1..V-1 everywhere (also past target_lengths: some peers read the padding).
    targets = torch.randint(1, V, (B, U), generator=g, dtype=torch.int32)
    logits = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float32).to(dtype)
    return Inputs(logits, targets, logit_lengths, target_lengths, BLANK)
