"""The shape registry, the cases (shape, dtype, loss variant) and the one input factory
shared by every benchmark run: ``run.py`` (speed, memory, agreement, peers),
``pruned_pipeline.py`` and ``fused_pipeline.py``, and the providers
(ours and the peers, ``peers.py``). A row in any table is reproducible from
``(shape name, dtype, seed)`` alone.

Shapes are ``(B, T, U, V)``: logits ``(B, T, U+1, V)``, targets ``(B, U)``. A benchmark case
is ``(shape, dtype, loss variant)`` (:class:`Case`); the variants are :data:`VARIANTS`.

    >>> from shapes import SHAPES, make_inputs
    >>> x = make_inputs(SHAPES["s2"], seed=0)
    >>> tuple(x.logits.shape)
    (4, 100, 21, 128)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

# Every provider is called with the same blank. 0 is the id all peers accept, and targets
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
    # GPU-sized: a large ragged training batch, and a large vocabulary.
    Shape("big", 32, 400, 100, 1024, T_range=(200, 400), U_range=(50, 100)),
    Shape("v5000", 8, 300, 60, 5000, T_range=(150, 300), U_range=(30, 60)),
    # s5 with 1024 labels and a blank: rows that start anywhere (gpu_passes.py --sweep).
    Shape("s5odd", 8, 400, 80, 1025),
    # The pruned pipeline (run.py --mode pruned): the joiner's two halves am (B, T, V) and
    # lm (B, U+1, V), never the (B, T, U+1, V) logits except for the full-loss rows.
    # CPU-sized: 2 cores finish all three in minutes; "pv5000" has a large vocabulary.
    Shape("p1", 8, 150, 40, 500),
    Shape("p2", 16, 200, 60, 1000),
    Shape("pv5000", 4, 150, 40, 5000),
    # The GPU table.
    Shape("pg1", 32, 400, 100, 1024),
    Shape("pg2", 16, 500, 150, 2000),
    Shape("pg3", 8, 300, 60, 5000),
    # The fused joiner and loss (run.py --mode fused; the joiner's width H is the runner's):
    # CPU-sized, V >= 1000; on GPU the pruned pipeline's pg1 and pg2.
    Shape("f1", 8, 150, 40, 1000),
    Shape("f2", 4, 200, 60, 2000),
    # Issue 34's table (the joiner's kernel path, run.py --mode fused --preset issue34): j4 is
    # TDT's, V = 8193 tokens + 5 durations.
    Shape("j1", 32, 400, 100, 1024),
    Shape("j2", 16, 500, 150, 2000),
    Shape("j3", 8, 300, 60, 8192),
    Shape("j4", 8, 400, 80, 8198),
)}

# Named groups of shapes for the command-line tools.
GROUPS = {
    "quick": ["s1", "s2"],
    "core": ["s2", "s3", "s4", "s5", "ragged"],       # the core issue's target shapes
    "all": ["s1", "s2", "s3", "s4", "s5", "ragged", "s1_f64"],
    "gpu": ["s3", "s4", "s5", "ragged", "big", "v5000"],   # run.py --device cuda
    "pruned_cpu": ["p1", "p2", "pv5000"],                  # run.py --mode pruned
    "pruned_gpu": ["pg1", "pg2", "pg3"],                   # run.py --device cuda --mode pruned
    "fused_cpu": ["f1", "f2"],                             # run.py --mode fused
    "fused_gpu": ["pg1", "pg2"],                           # run.py --device cuda --mode fused
    "joint_gpu": ["j1", "j2", "j3", "j4"],                 # run.py --mode fused --preset issue34
}

# Loss topologies a case can ask for (``benchmarks/run.py --variants``). A new one is added
# here, in ``variant_loss`` (its loss call) and ``make_inputs`` (its inputs: durations,
# extra blanks), and in the ``variants`` of each provider of ``benchmarks/peers.py`` that
# implements it (the others report "unsupported" for it).
VARIANTS = {
    "regular": "standard RNN-T: one blank; a blank moves t, a label moves u",
    "modified": "k2 rnnt_type='modified': one symbol per frame, a label moves t and u",
    "constrained": "k2 rnnt_type='constrained': a label moves t and u, blank only (t, u+1)",
    "one_sym_per_frame": "optimized_transducer's one_sym_per_frame: a label moves t and u",
    "tdt": "NeMo TDT, durations 0..4: the last axis is V tokens + 5 durations, blank V-1",
    "multiblank": "NeMo multi-blank, big blanks of 2, 4, 8 frames: classes V-2..V-4, blank V-1",
}
TDT_DURATIONS = (0, 1, 2, 3, 4)
BIG_BLANK_DURATIONS = (2, 4, 8)


def variant_loss(variant: str, logits, targets, logit_lengths, target_lengths, blank, **kw):
    """Per-sequence costs of ``variant`` through the public API (``kw``: ``backend``,
    ``inplace_grad``, ...), on inputs made by :func:`make_inputs` for that variant."""
    import rnnt_lattice
    args = (logits, targets, logit_lengths, target_lengths)
    kw = dict(blank=blank, reduction="none", **kw)
    if variant == "regular":
        return rnnt_lattice.rnnt_loss(*args, **kw)
    if variant in ("modified", "constrained", "one_sym_per_frame"):
        return rnnt_lattice.rnnt_loss(*args, rnnt_type=variant, **kw)
    if variant == "tdt":
        return rnnt_lattice.tdt_loss(*args, durations=list(TDT_DURATIONS), **kw)
    if variant == "multiblank":
        return rnnt_lattice.multiblank_rnnt_loss(*args, big_blank_durations=list(BIG_BLANK_DURATIONS),
                                                 **kw)
    raise ValueError(f"unknown variant {variant!r}; known: {sorted(VARIANTS)}")


@dataclass
class Inputs:
    logits: torch.Tensor          # (B, T, U+1, V) float, contiguous
    targets: torch.Tensor         # (B, U) int32, values in 1..V-1
    logit_lengths: torch.Tensor   # (B,) int32
    target_lengths: torch.Tensor  # (B,) int32
    blank: int
    variant: str = "regular"      # the loss topology (VARIANTS); providers get it as a keyword

    def call_kwargs(self) -> dict:
        """Keywords of a provider call: none for "regular" (every peer's signature)."""
        return {} if self.variant == "regular" else {"variant": self.variant}

    @property
    def nbytes(self) -> int:
        return self.logits.numel() * self.logits.element_size()


@dataclass(frozen=True)
class Case:
    """One benchmark case: a shape, the logits' dtype and the loss variant."""
    shape: Shape
    dtype: torch.dtype
    variant: str = "regular"

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")

    @property
    def label(self) -> str:
        """The shape's name, plus the dtype where it is not the shape's own and the variant
        where it is not "regular": ``s5``, ``s5 bfloat16``, ``s1_f64``."""
        out = self.shape.name
        if self.dtype != self.shape.dtype:
            out += f" {self.dtype_name}"
        if self.variant != "regular":
            out += f" {self.variant}"
        return out


def cases(names, dtype: Optional[torch.dtype] = None, variants=("regular",)) -> list:
    """Shape or group names x variants -> list of :class:`Case`; ``dtype`` overrides the
    shapes' own."""
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"unknown variant {v!r}; known: {sorted(VARIANTS)}")
    return [Case(s, dtype or s.dtype, v) for v in variants for s in resolve(names)]


def resolve(names) -> list:
    """Shape names or group names -> list of :class:`Shape` (order kept, no repeats)."""
    out = []
    for n in names:
        for m in GROUPS.get(n, [n]):
            if m not in SHAPES:
                raise ValueError(f"unknown shape {m!r}; known: {sorted(SHAPES)} and groups {sorted(GROUPS)}")
            if SHAPES[m] not in out:
                out.append(SHAPES[m])
    return out


def make_inputs(shape: Shape, dtype: Optional[torch.dtype] = None, seed: int = 0,
                variant: str = "regular") -> Inputs:
    """Seeded inputs for ``shape``. ``dtype`` overrides the shape's dtype (the agreement
    check makes float32 inputs and upcasts them itself, so both see the same numbers).
    ``variant`` (:data:`VARIANTS`): "tdt" appends the 5 duration logits to the last axis
    and "tdt"/"multiblank" use NeMo's blank ``V-1`` with labels below the blank(s).

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
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {sorted(VARIANTS)}")
    if variant in ("tdt", "multiblank"):
        # NeMo's layout: the blank is the last token, the big blanks just below it.
        n_blanks = 1 + (len(BIG_BLANK_DURATIONS) if variant == "multiblank" else 0)
        targets = torch.randint(0, V - n_blanks, (B, U), generator=g, dtype=torch.int32)
        V_all = V + (len(TDT_DURATIONS) if variant == "tdt" else 0)
        logits = torch.randn(B, T, U + 1, V_all, generator=g, dtype=torch.float32).to(dtype)
        return Inputs(logits, targets, logit_lengths, target_lengths, V - 1, variant)
    # Labels 1..V-1 everywhere (also past target_lengths: some peers read the padding).
    targets = torch.randint(1, V, (B, U), generator=g, dtype=torch.int32)
    logits = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float32).to(dtype)
    return Inputs(logits, targets, logit_lengths, target_lengths, BLANK, variant)


@dataclass
class JoinerInputs:
    """Inputs of the pruned pipeline: the joiner ``logits(t, u) = am(t) + lm(u)`` in halves."""
    am: torch.Tensor              # (B, T, V) float
    lm: torch.Tensor              # (B, U+1, V) float
    targets: torch.Tensor         # (B, U) int64, values in 1..V-1
    logit_lengths: torch.Tensor   # (B,) int64
    target_lengths: torch.Tensor  # (B,) int64
    blank: int

    @property
    def boundary(self) -> torch.Tensor:
        """k2's ``(B, 4)`` rows ``[0, 0, U_b, T_b]``."""
        zero = torch.zeros_like(self.logit_lengths)
        return torch.stack((zero, zero, self.target_lengths, self.logit_lengths), 1)

    def logits(self) -> torch.Tensor:
        """The full ``(B, T, U+1, V)`` joiner output (for the full-loss rows)."""
        return (self.am[:, :, None] + self.lm[:, None]).contiguous()


def make_joiner_inputs(shape: Shape, dtype: Optional[torch.dtype] = None, seed: int = 0,
                       device="cpu") -> JoinerInputs:
    """Seeded :class:`JoinerInputs` for ``shape`` (ragged shapes draw lengths as
    :func:`make_inputs`); standard normal am and lm, labels 1..V-1, blank 0."""
    dtype = dtype or shape.dtype
    g = torch.Generator().manual_seed(seed)
    B, V = shape.B, shape.V
    if shape.ragged:
        logit_lengths = torch.randint(shape.T_range[0], shape.T_range[1] + 1, (B,), generator=g)
        target_lengths = torch.randint(shape.U_range[0], shape.U_range[1] + 1, (B,), generator=g)
        T, U = int(logit_lengths.max()), int(target_lengths.max())
    else:
        T, U = shape.T, shape.U
        logit_lengths = torch.full((B,), T, dtype=torch.int64)
        target_lengths = torch.full((B,), U, dtype=torch.int64)
    targets = torch.randint(1, V, (B, U), generator=g)
    am = torch.randn(B, T, V, generator=g).to(dtype)
    lm = torch.randn(B, U + 1, V, generator=g).to(dtype)
    return JoinerInputs(*(x.to(device) for x in (am, lm, targets, logit_lengths, target_lengths)),
                        BLANK)
