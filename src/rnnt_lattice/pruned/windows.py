"""Window choice for pruned RNN-T (math.md section 10): the windows of R label positions
per frame that the full joiner is evaluated on, chosen from the simple lattice's
occupations (:func:`prune_ranges`: k2's rule, or the exact dynamic program
:func:`best_window_starts` that maximises the covered occupancy mass, which
``analysis.prune_coverage`` uses too), and the joiner's inputs on them
(:func:`do_rnnt_pruning`)."""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field

import torch
from torch.autograd.function import once_differentiable

from .. import _backends
from .._ops import eager_under_compile
from .._validate import (check_boundary, check_occupation_lengths, check_occupations,
                         check_pruning_args, check_site, check_values_held, device_value_check,
                         tracing, user_stacklevel)
from ..reference import cumsum_last, lattice_dtype
from ..topology import K2_TYPES, by_name
from .simple import ArcOccupations

__all__ = ["prune_ranges", "PruneRanges", "do_rnnt_pruning", "best_window_starts"]

NEG_INF = float("-inf")
METHODS = ("exact", "k2")


@dataclass(frozen=True)
class PruneRanges:
    """Pruning windows.

    Attributes:
        ranges: ``(B, T, R)`` int64, ``ranges[b, t, k] = s_begin(t) + k``: the label positions
            the full joiner evaluates at frame t (k2's ``ranges``; every entry ``<= U``).
        covered: ``(B,)`` share of each sequence's occupancy mass (occ(t,u), the
            total occupation leaving a node) inside its windows, in the occupations' dtype
            (float64 from the library's); 1 for a sequence without mass, NaN for NaN
            occupations. Computed on first use (a training step that only reads ``ranges``, as
            k2's recipes do, does not pay its dozen operations).
    """

    ranges: torch.Tensor
    occupations: tuple = field(repr=False, compare=False)     # (gamma_blank, gamma_label)

    @functools.cached_property
    def covered(self) -> torch.Tensor:
        gamma_blank, gamma_label = self.occupations
        return _covered(gamma_blank + gamma_label, self.ranges)

    @property
    def window(self) -> int:
        """R, the window size used (it may differ from the one asked for)."""
        return int(self.ranges.shape[-1])

    @property
    def s_begin(self) -> torch.Tensor:
        """``(B, T)`` int64: the first label position of each frame's window."""
        return self.ranges[..., 0]




def prune_ranges(
    occupations,
    R: int,
    *,
    method: str = "exact",
    logit_lengths: torch.Tensor | None = None,
    target_lengths: torch.Tensor | None = None,
    boundary: torch.Tensor | None = None,
    rnnt_type: str | None = None,
) -> PruneRanges:
    r"""Windows of R label positions per frame for the pruned loss (math.md section 10):
    ``ranges[b, t] = s_begin(t) + [0, R)``, with k2's constraints

        s_begin(0) = 0,   0 <= s_begin(t+1) - s_begin(t) <= R_e - 1,
        s_begin(t) = max(U_b - R + 1, 0) for t >= T_b - 1,

    where ``R_e = R`` for ``regular`` and 2 otherwise (one label per frame), and ``T_b``,
    ``U_b`` are the end frame and symbol (the boundary's, if any).

    ``method="exact"`` (default): among all such windows, those covering the most occupancy
    mass ``sum_t sum_{u in window(t)} occ(t,u)`` (a dynamic program over (t, s_begin), O(T U R);
    ties: the lowest starts). Never covers less than k2's choice with the same R.
    ``method="k2"``: fast_rnnt's ``get_rnnt_prune_ranges`` step for step (per-frame argmax of
    ``sum_{k<R} gamma_blank(t, s+k) - gamma_label(t, s-1)``, then the monotone repair;
    docs/variants.md A.6): the same ranges, up to ties between float scores.

    R: the window the caller asks for. For ``regular`` it is raised, with a warning, to the
    smallest R that lets every sequence reach its end, ``max_b ((U_b - 1) // T_b + 2)``
    (k2's rule; truncating division, sequences without frames left out), and to 2 (k2
    asserts it); for the others ``"exact"`` raises it to ``max_b (U_b - T_b + 2)`` where the
    end is otherwise out of reach (``"k2"`` does not: k2 does not). Then ``R > U`` becomes
    ``U + 1`` (no pruning at all): a batch whose targets are all empty gets R = 1.

    Example::

        >>> import torch, rnnt_lattice
        >>> am, lm = torch.randn(2, 8, 6), torch.randn(2, 5, 6)
        >>> targets, T_b, U_b = torch.tensor([[1, 2, 3, 4], [5, 1, 2, 0]]), torch.tensor([8, 6]), torch.tensor([4, 3])
        >>> _, occ = rnnt_lattice.rnnt_loss_simple(lm, am, targets, T_b, U_b, blank=0,
        ...                                        return_occupations=True)
        >>> win = rnnt_lattice.prune_ranges(occ, 2)
        >>> win.ranges.shape, win.covered.shape
        (torch.Size([2, 8, 2]), torch.Size([2]))
        >>> k2 = rnnt_lattice.prune_ranges(occ, 2, method="k2")
        >>> bool((win.covered >= k2.covered - 1e-12).all())
        True

    Args:
        occupations: an :class:`ArcOccupations` (from ``return_occupations=True``), an
            :class:`rnnt_lattice.Occupancy` of a regular, modified or constrained lattice
            (from :func:`rnnt_lattice.occupancy`; its ``boundary``, if any, is given here),
            or a pair ``(gamma_blank, gamma_label)`` of ``(B, T, U+1)`` tensors, for which
            ``logit_lengths`` and ``target_lengths`` are required.
        R: int >= 1.
        method: ``"exact"`` or ``"k2"``.
        logit_lengths, target_lengths, boundary, rnnt_type: of the lattice; taken from an
            :class:`ArcOccupations` (an ``Occupancy``: the lengths and the type) when not
            given (``rnnt_type`` defaults to ``"regular"``).

    Returns:
        :class:`PruneRanges` (``ranges (B, T, R')`` int64 with R' the window actually used,
        ``covered (B,)``).
    """
    if isinstance(occupations, ArcOccupations):
        logit_lengths = occupations.logit_lengths if logit_lengths is None else logit_lengths
        target_lengths = occupations.target_lengths if target_lengths is None else target_lengths
        boundary = occupations.boundary if boundary is None else boundary
        rnnt_type = occupations.rnnt_type if rnnt_type is None else rnnt_type
    elif hasattr(occupations, "gamma_label") and hasattr(occupations, "topology"):
        # rnnt_lattice.occupancy's Occupancy (known by its fields: rnnt_lattice.analysis
        # imports this module): its blank and label occupations, of a lattice of k2's types.
        name = occupations.topology.name
        if name not in K2_TYPES:
            raise ValueError(f"occupations: prune_ranges takes the occupancy of a lattice of "
                             f"k2's types {K2_TYPES}, got one of topology {name!r}")
        logit_lengths = occupations.logit_lengths if logit_lengths is None else logit_lengths
        target_lengths = occupations.target_lengths if target_lengths is None else target_lengths
        rnnt_type = name if rnnt_type is None else rnnt_type
        occupations = (occupations.gamma_blank, occupations.gamma_label)
    rnnt_type = "regular" if rnnt_type is None else rnnt_type
    gamma_blank, gamma_label, logit_lengths, target_lengths, R = check_occupations(
        occupations, logit_lengths, target_lengths, R, method, METHODS)
    by_name(rnnt_type, K2_TYPES)
    check_occupation_lengths(gamma_blank, logit_lengths, target_lengths)
    B, T, U1 = gamma_blank.shape
    boundary = check_boundary(boundary, B, gamma_blank.device, logit_lengths, target_lengths)
    check_values_held("prune_ranges reads the lengths' values (the window's size, the ranges' "
                      "shape)", ("logit_lengths", logit_lengths), ("target_lengths", target_lengths),
                      *(() if boundary is None else (("boundary", boundary),)))
    if boundary is None:
        t_end, u_end = logit_lengths, target_lengths
    else:
        t_end, u_end = boundary[:, 3], boundary[:, 2]
    S = U1 - 1
    regular = rnnt_type == "regular"

    # The window first: its warning is the last thing that may raise on the host (with
    # warnings as errors), and a device assert queued before it would fire all the same.
    R_used = _window_size(R, t_end, u_end, S, regular, method)
    if B and check_site(gamma_blank) == "device":       # no loss here: the asserts alone
        device_value_check(None, logit_lengths, target_lengths, T=T, U=U1 - 1, V=0, blank=None,
                           boundary=boundary)
    if method == "k2":
        s_begin = _backends.resolve("auto", gamma_blank.device).k2_starts(
            gamma_blank, gamma_label, t_end, u_end, R_used, R_used if regular else 2)
    else:
        s_begin = _exact_starts(gamma_blank + gamma_label, t_end, u_end, R_used, regular)
    ranges = s_begin[..., None] + torch.arange(R_used, device=s_begin.device)
    return PruneRanges(ranges, (gamma_blank, gamma_label))


# The window's size is read on the host (the output's shape depends on it): inside a
# compiled step TorchDynamo would break its graph at that read and log the break with its
# trace; the whole choice runs eagerly there instead, a graph break without a message.
prune_ranges = eager_under_compile(
    prune_ranges, "rnnt_lattice's prune_ranges reads its window's size on the host (the "
    "ranges' shape depends on it): it runs eagerly, a graph break; compile without "
    "fullgraph=True")


def _window_size(R: int, t_end, u_end, S: int, regular: bool, method: str) -> int:
    """The window actually used (see :func:`prune_ranges`): the output's shape depends on
    the lengths, so this is the one host read (a single one) of the window choice."""
    has_frames = t_end > 0
    R_min = 1
    if t_end.numel() and (regular or method == "exact"):
        if regular:
            # k2: the smallest R with (R - 1) T_b >= U_b, written (U_b - 1) // T_b + 2 with
            # truncating division (so U_b = 0, T_b = 1 gives 1; the R >= 2 rule follows).
            need = torch.div(u_end - 1, t_end.clamp(min=1), rounding_mode="trunc").add(2)
            counts = has_frames
        else:
            # One label per frame: from 0 to max(U_b - R + 1, 0) in T_b - 1 steps of <= 1.
            # Sequences with T_b < U_b have no path at all: no window helps them.
            need = u_end - t_end + 2
            counts = has_frames & (t_end >= u_end)
        R_min = max(1, int(torch.where(counts, need, 1).max()))
    asked = R
    if R < R_min:
        R = R_min
    if R > S:
        R = S + 1               # every position kept: nothing is pruned
    if regular and R < 2 and S >= 1:
        R = 2                   # a regular window of 1 keeps no label arc (k2 asserts R >= 2)
    if R > asked:
        warnings.warn(f"prune_ranges: R={asked} cannot reach the end of every sequence "
                      f"(rnnt_type {'regular' if regular else 'modified/constrained'}, "
                      f"U = {S}); using R={R}", RuntimeWarning, stacklevel=user_stacklevel())
    return R


def _exact_starts(node, t_end, u_end, R: int, regular: bool):
    """The DP of math.md section 10 (:func:`best_window_starts`)."""
    B, T, U1 = node.shape
    n = U1 - R + 1
    mass = torch.nan_to_num(node.to(lattice_dtype(node.device)), nan=0.0)   # float64 if it can
    cum = torch.nn.functional.pad(cumsum_last(mass), (1, 0))        # (deterministic mode)
    starts = torch.arange(n, device=node.device)
    window_mass = cum[..., starts + R] - cum[..., starts]           # (B, T, n)
    last = (u_end - R + 1).clamp(min=0)
    if not regular:
        # Reachable in T_b - 1 steps of <= 1 (only lowers it where the lattice has no path).
        last = torch.minimum(last, (t_end - 1).clamp(min=0))
    _, s_begin = best_window_starts(window_mass, last + 1, R - 1 if regular else 1,
                                    first=torch.zeros_like(last), last=last, n_frames=t_end)
    return s_begin


def _covered(node, ranges):
    """Share of each sequence's occupancy mass inside its windows (1 without mass, NaN for
    NaN occupations)."""
    inside = torch.gather(node, 2, ranges).sum((1, 2))
    total = node.sum((1, 2))
    share = torch.where(total > 0, inside / torch.where(total > 0, total, 1.0), 1.0).clamp(max=1.0)
    return torch.where(torch.isnan(total), total, share)


def do_rnnt_pruning(am: torch.Tensor, lm: torch.Tensor, ranges: torch.Tensor):
    r"""The joiner's inputs on the windows (k2's ``do_rnnt_pruning``): ``(am_pruned,
    lm_pruned)`` with ``am_pruned = am[:, :, None].expand(B, T, R, Da)`` (a view) and
    ``lm_pruned[b, t, k] = lm[b, ranges[b, t, k]]`` ``(B, T, R, Dl)``.

    Example::

        >>> import torch, rnnt_lattice
        >>> am, lm = torch.randn(2, 7, 3), torch.randn(2, 4, 5)      # (B, T, Da), (B, U+1, Dl)
        >>> ranges = torch.tensor([0, 0, 1, 1, 2, 2, 2]).expand(2, 7)[..., None] + torch.arange(2)
        >>> am_p, lm_p = rnnt_lattice.do_rnnt_pruning(am, lm, ranges)
        >>> am_p.shape, lm_p.shape
        (torch.Size([2, 7, 2, 3]), torch.Size([2, 7, 2, 5]))

    Args:
        am: ``(B, T, Da)`` encoder output; lm: ``(B, U+1, Dl)`` prediction-network output.
        ranges: ``(B, T, R)`` int32/int64 label positions in ``[0, U]`` (:func:`prune_ranges`).
    """
    ranges = check_pruning_args(am, lm, ranges)
    B, T, R = ranges.shape
    U1, Dl = lm.shape[1], lm.shape[2]
    am_pruned = am.unsqueeze(2).expand(B, T, R, am.shape[2])
    # Whole rows of lm, by index_select on (B (U+1), Dl): its backward adds rows into an
    # lm-sized buffer (``_SelectRows``). (A gather from lm expanded over T would allocate
    # (B, T, U+1, Dl) in its backward; fast_rnnt 1.3's gather along lm's label axis reads one
    # index per element: 4x slower backward, 1.3x slower forward at B=4, T=150, R=5, V=5000.)
    rows = (ranges + torch.arange(B, device=ranges.device)[:, None, None] * U1).reshape(-1)
    lm_pruned = _SelectRows.apply(lm.reshape(B * U1, Dl), rows, B)
    return am_pruned, lm_pruned.view(B, T, R, Dl)


class _SelectRows(torch.autograd.Function):
    """``x.index_select(0, index)`` ``(N, D)`` by the backend's ``rows_select`` (on CPU into
    a kept block: no page faults a step), whose backward is the backend's ``rows_sum`` (``d
    x[j] = sum_{i: index[i] = j} g[i]``, each sum in the order of i: on CUDA a Triton
    kernel where ``index_add_`` adds with contended atomics in any order; on CPU
    ``index_add_`` itself). ``groups``: the index's equal parts, part g pointing into part g
    of x's rows (a sequence's windows into its own rows of lm). While TorchDynamo traces,
    ``index_select`` itself (the compiled graph's memory is the compiler's)."""

    @staticmethod
    def forward(ctx, x, index, groups):
        ctx.save_for_backward(index)
        ctx.n, ctx.groups = x.shape[0], groups
        if tracing(x):
            return x.index_select(0, index)
        return _backends.resolve("auto", x.device).rows_select(x, index)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        sums = _backends.resolve("auto", g.device).rows_sum(g, index, ctx.n, ctx.groups)
        return sums, None, None


def best_window_starts(mass: torch.Tensor, n_starts: torch.Tensor, max_step: int, *,
                       first: torch.Tensor | None = None, last: torch.Tensor | None = None,
                       n_frames: torch.Tensor | None = None):
    """Max over non-decreasing ``s(0..T-1)`` with ``s(t+1) - s(t) <= max_step`` and
    ``0 <= s(t) < n_starts[b]`` of ``sum_t mass[b, t, s(t)]``, by dynamic programming over
    frames (exact, O(T * S * max_step); math.md section 10):

        f(0, s) = mass(0, s)
        f(t, s) = mass(t, s) + max_{s - max_step <= s' <= s} f(t-1, s')

    Optional pins, per sequence: ``first`` fixes ``s(0)``; with ``n_frames`` (``T_b``) and
    ``last``, ``s(t) = last[b]`` for every ``t >= T_b - 1`` and frames ``t >= T_b`` carry no
    mass (a sequence with ``T_b = 0`` has no pinned end). Ties: the lowest starts.

    mass: ``(B, T, S)`` window sums (``S`` starts). Returns (best ``(B,)``, starts ``(B, T)``
    int64); ``best`` is ``-inf`` where no sequence of starts satisfies the pins.
    """
    B, T, S = mass.shape
    dev = mass.device
    if T == 0:
        return torch.zeros(B, dtype=mass.dtype, device=dev), torch.zeros((B, 0), dtype=torch.int64, device=dev)
    s_idx = torch.arange(S, device=dev)
    allowed = (s_idx[None, :] < n_starts[:, None])[:, None, :].expand(B, T, S)   # (B, T, S)
    t_idx = torch.arange(T, device=dev)[None, :, None]
    if first is not None:
        allowed = allowed & ((t_idx > 0) | (s_idx[None, None, :] == first[:, None, None]))
    if n_frames is not None:
        mass = torch.where(t_idx < n_frames[:, None, None], mass, 0.0)
        if last is not None:
            pinned = (t_idx >= n_frames[:, None, None] - 1) & (n_frames[:, None, None] > 0)
            allowed = allowed & (~pinned | (s_idx[None, None, :] == last[:, None, None]))
    mass = torch.where(allowed, mass, NEG_INF)
    total, starts = _backends.resolve("auto", dev).window_dp(mass, max_step)
    return total.to(mass.dtype), starts
