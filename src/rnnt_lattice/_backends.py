"""The backend protocol, declared once, and backend selection. Backends are loaded only
when first used, so importing rnnt_lattice needs torch and numpy only.

Three modules implement :class:`Backend`, all of it: ``cpu`` (Numba), ``gpu`` (Triton) and
``torch_backend`` (PyTorch, on :mod:`rnnt_lattice.reference`). Callers use the protocol's
members and nothing else: no capability probing, no fallback written in a caller.
"""
from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from ._layout import Tile, packed_node_rows
from ._types import ArcParts, Ends, Lattice, LossOptions, Smoothing
from ._validate import OURS, Checked, Names, check_call, user_stacklevel, with_blank
from .topology import Topology

BACKENDS = ("auto", "numba", "torch", "triton")

_MODULES = {
    "torch": ".torch_backend",
    "numba": ".cpu",
    "triton": ".gpu",
}
_loaded: dict[str, Any] = {}
_warned_fallback: set[str] = set()

# ``backend="auto"``: the backend of each device type; any other type (MPS, XPU, ...) runs
# the pure-PyTorch backend.
AUTO = {"cpu": "numba", "cuda": "triton"}


class Backend(Protocol):
    """What every backend module provides. Shapes: logits ``(B, T, U+1, V)`` (or rows
    ``(N, V)`` with ``node_rows (B, T, U+1)`` int64, math.md section 9.1: ``_ops``), targets
    ``(B, U)``, lengths ``(B,)``, arc weights ``w (B, K, T, U+1)``, lattice node tensors
    ``(B, T+1, U+1)``, window masses ``(B, T, S)``; ``am (B, T, V)``, ``lm (B, U+1, V)``.
    The arguments of the loss, tile and lattice-tool members come from :func:`prepare_call`
    (``opts.blank`` resolved, the topology, lengths and boundary checked): a backend checks
    none of them again."""

    NAME: str                    # "numba", "triton", "torch"
    INPLACE_WRITES_IN: str       # "forward" | "backward": when inplace_grad overwrites the logits
    NATIVE_LOW_PRECISION: bool   # the kernels read float16/bfloat16 logits (else promoted first)
    NATIVE_INT32_IDS: bool       # the kernels read int32 ids and lengths (else converted first)
    ZEROES_INFINITE_COSTS: bool  # loss_backward and tile_backward give a zero gradient to every
                                 # sequence whose cost is infinite in the costs' dtype (else the
                                 # caller zeroes their upstream gradient first)
    CHECKS_RECOMPUTED_TILES: bool  # tile_backward in fused mode (opts.log_softmax) checks that
                                 # the recomputed rows are the forward's (the device assert
                                 # "recompute"; else the caller compares the rows' sums)

    # The loss (``_ops``): costs (B,), tensors for ctx.save_for_backward, any other state;
    # then upstream[b] * d cost_b / d logits, shaped like the logits. ``nan_rows`` (B,), the
    # device check's (``_validate.device_value_check``: NaN for a bad sequence, else 0), is
    # added to the costs (``_rules.with_bad_rows``); None: nothing to add.
    def loss_forward(self, logits: torch.Tensor, targets: torch.Tensor,
                     logit_lengths: torch.Tensor, target_lengths: torch.Tensor,
                     opts: LossOptions, need_grad: bool, boundary: torch.Tensor | None = None,
                     node_rows: torch.Tensor | None = None, nan_rows: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, tuple, Any]: ...

    def loss_backward(self, saved: tuple, state: Any, upstream: torch.Tensor,
                      opts: LossOptions) -> torch.Tensor: ...

    # The fused joiner and loss (``fused``, math.md section 11): logits that exist one tile
    # at a time, rows ``(n, V)`` of the box ``tile.t0:t1, u0:u1`` of the grid ``tile.grid
    # (B, T, U+1)`` in row-major order, or read through ``tile.node_rows (B, T, U+1)`` (the
    # tile's nodes read rows 0..n-1, every other node none; built on first use). ``tile_forward``: the row pass on one
    # tile, what the lattice and the gradient need of its nodes kept in ``state`` (None on
    # the first tile: created from it); it may overwrite ``rows`` (the caller discards
    # them). ``tile_lattice``: the lattice once over every node -> costs (B,) in the rows'
    # dtype (float32 for half rows). ``tile_backward``: ``out (n, V) = upstream[b] * d
    # cost_b / d rows`` of one tile, the rows recomputed by the caller; ``out`` may be
    # ``rows``.
    def tile_forward(self, rows: torch.Tensor, tile: Tile, targets: torch.Tensor,
                     logit_lengths: torch.Tensor, target_lengths: torch.Tensor,
                     opts: LossOptions, boundary: torch.Tensor | None, state: Any) -> Any: ...

    def tile_lattice(self, state: Any, opts: LossOptions, need_grad: bool) -> torch.Tensor: ...

    def tile_backward(self, rows: torch.Tensor, tile: Tile, state: Any, upstream: torch.Tensor,
                      opts: LossOptions, out: torch.Tensor) -> torch.Tensor: ...

    # The lattice tools (``analysis``): alpha, beta, log P and per-kind occupations; the
    # max-plus sweep ``(alpha_max, best_kind int8, log_prob (B,))``.
    def occupancy(self, logits: torch.Tensor, targets: torch.Tensor,
                  logit_lengths: torch.Tensor, target_lengths: torch.Tensor,
                  opts: LossOptions, boundary: torch.Tensor | None = None) -> Lattice: ...

    def viterbi(self, logits: torch.Tensor, targets: torch.Tensor,
                logit_lengths: torch.Tensor, target_lengths: torch.Tensor, opts: LossOptions,
                boundary: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    # The recursion of k2's lattices on given blank and label log-weights ``b, e (B, T,
    # U+1)`` float64 (the simple losses, ``lattice_loss``; ``reference.terms_weights``):
    # ``(log_like (B,), gamma (B, K, T, U+1))``.
    def lattice_of_terms(self, b: torch.Tensor, e: torch.Tensor, topo: Topology, ends: Ends,
                         delay_penalty: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]: ...

    # Window choice (math.md section 10): ``(total (B,), starts (B, T) int64)``.
    def window_dp(self, mass: torch.Tensor, max_step: int
                  ) -> tuple[torch.Tensor, torch.Tensor]: ...

    # k2's window rule (``prune_ranges(method="k2")``, docs/variants.md A.6): the starts
    # ``s_begin (B, T)`` int64 from the occupations ``(B, T, U+1)``, the end frames and
    # symbols ``(B,)``, the window ``R <= U+1`` and the largest step plus one ``R_e``.
    def k2_starts(self, gamma_blank: torch.Tensor, gamma_label: torch.Tensor,
                  t_end: torch.Tensor, u_end: torch.Tensor, R: int, R_e: int
                  ) -> torch.Tensor: ...

    # The simple losses' normaliser of the nodes beyond the float64 matmul's range:
    # ``logsumexp_v am(t,v) + lm(u,v)`` at the nodes ``need`` marks, and its backward.
    def simple_rescue(self, am: torch.Tensor, lm: torch.Tensor,
                      need: torch.Tensor) -> torch.Tensor: ...

    def simple_rescue_backward(self, am: torch.Tensor, lm: torch.Tensor, need: torch.Tensor,
                               lse: torch.Tensor, g: torch.Tensor, grad_am: torch.Tensor | None,
                               grad_lm: torch.Tensor | None) -> None: ...

    # The simple losses' rows ``x (B, N, V)`` (am, lm) with the rows kept ``(B, N)`` and the
    # classes their arcs read ``idx (B, N, J)``: ``(ok, shift, bad, ex, cols)``
    # (``torch_backend.simple_rows``: their definitions); the backward of ``ex`` and
    # ``cols`` in place on the matmul's gradient ``grad (B, N, V)``.
    def simple_rows(self, x: torch.Tensor, keep: torch.Tensor, idx: torch.Tensor) -> tuple: ...

    def simple_rows_backward(self, grad: torch.Tensor, ex: torch.Tensor, ok: torch.Tensor,
                             g_uni: torch.Tensor | None, uni: torch.Tensor | None,
                             idx: torch.Tensor, g_cols: torch.Tensor | None) -> None: ...

    # The simple losses' arc log-probs ``(b', e', saved)`` ``(B, T, U+1)`` float64 from the
    # normaliser's parts (``pruned.simple._ArcTerms``: its formulas), and their backward:
    # ``(d mass, d lse_rescued, d am_cols, d lm_cols, (d P, d Q, d R, d S) or ())``.
    def arc_terms(self, parts: ArcParts, mix: Smoothing | None
                  ) -> tuple[torch.Tensor, torch.Tensor, tuple]: ...

    def arc_terms_backward(self, saved: tuple, g_b: torch.Tensor | None,
                           g_e: torch.Tensor | None, mix: Smoothing | None,
                           dtypes: tuple) -> tuple: ...

    # ``x.index_select(0, index)`` ``(N, D)`` (``do_rnnt_pruning``'s rows of lm), in memory
    # the backend may reuse once the result is no longer referenced (the CPU's kept blocks).
    def rows_select(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor: ...

    # The backward of ``x.index_select(0, index)`` (``do_rnnt_pruning``'s rows of lm):
    # ``out (n_out, D)``, ``out[j] = sum_{i: index[i] = j} grad[i]``, in the order of i;
    # the i of group g (``groups`` equal parts of N) point into part g of the n_out rows.
    def rows_sum(self, grad: torch.Tensor, index: torch.Tensor, n_out: int,
                 groups: int = 1) -> torch.Tensor: ...

    # Release what the backend keeps between calls (``rnnt_lattice.empty_cache``).
    def empty_cache(self) -> None: ...


def load(name: str) -> Backend:
    """The backend module ``name`` (``"numba"``, ``"triton"``, ``"torch"``), imported on
    first use; ImportError where its library (Numba, Triton) is missing."""
    if name not in _loaded:
        _loaded[name] = importlib.import_module(_MODULES[name], __package__)
    return _loaded[name]


def _unavailable(name: str) -> str | None:
    """Why the backend ``name`` cannot be imported here (its ImportError), or None."""
    try:
        load(name)
    except ImportError as err:
        return str(err)
    return None


def empty_cache() -> None:
    """``empty_cache`` of every backend loaded so far."""
    for impl in list(_loaded.values()):
        impl.empty_cache()


def check_name(backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def resolve(backend: str, device) -> Backend:
    """The backend module for ``backend`` on ``device``; raises ValueError for bad choices.
    ``device`` None (the logits are no tensor, a ValueError to come): as on the CPU."""
    check_name(backend)
    kind = "cpu" if device is None else device.type
    if backend == "auto":
        preferred = AUTO.get(kind, "torch")
        why = None if preferred == "torch" else _unavailable(preferred)
        if why is not None:
            if preferred not in _warned_fallback:
                _warned_fallback.add(preferred)
                warnings.warn(
                    f"rnnt_lattice: the {preferred!r} backend is not importable on this machine "
                    f"({why}); falling back to the pure-PyTorch backend (slower). Install "
                    f"{'numba' if preferred == 'numba' else 'triton'} (or a newer one) to use it.",
                    RuntimeWarning, stacklevel=user_stacklevel())
            preferred = "torch"
        return load(preferred)
    if backend == "numba" and kind != "cpu":
        raise ValueError(f"backend='numba' runs on CPU tensors only, got logits on {device}")
    try:
        return load(backend)
    except ImportError as err:
        raise ValueError(f"backend={backend!r} is not available: {err}") from err


@dataclass(frozen=True)
class Prepared:
    """One call after :func:`prepare_call`: the plan every backend is handed, and trusts.

    No field has a default: TorchDynamo inlines this class's ``__init__`` while
    ``torch.compile`` traces a loss, and the Dynamo of torch 2.4 to 2.6 cannot hold a
    default that is an object of ours (``Unsupported: Unexpected type in sourceless
    builder``, even where the call passes the field)."""

    impl: Any                          # the backend module (None while tracing: resolved in the op)
    chk: Checked                       # the tensors the kernels read (logits promoted, ids
                                       # normalised), the boundary and the device check's NaN rows
    opts: LossOptions                  # blank in [0, V_tok), checked against the topology
    node_rows: Optional[torch.Tensor]  # (B, T, U+1) int64 node -> row map of a rows layout
                                       # (packed, pruned), None for padded logits
    # What the custom op needs to prepare the call again when it runs (impl None): the
    # rules that read values had none while tracing.
    allow_blank_targets: bool
    names: Names

    @property
    def boundary(self) -> Optional[torch.Tensor]:
        """(B, 4) int64 on the logits' device, or None."""
        return self.chk.boundary

    @property
    def nan_rows(self) -> Optional[torch.Tensor]:
        """(B,) float32, NaN for a sequence the device check found bad (add it to the
        costs); None: checked on the host. While tracing, only the caller's own (the pruned
        windows'): the op adds the rest when it runs."""
        return self.chk.nan_rows


def prepare_call(logits, targets, logit_lengths, target_lengths, blank, backend,
                 opts: LossOptions, *, boundary=None, node_rows=None, packed: bool = False,
                 traced: bool = False, allow_blank_targets: bool = False,
                 names: Names = OURS, device_rules: tuple = ()) -> Prepared:
    """The one preparation of every entry point on logits (the losses, the fused losses, the
    pruned loss, the lattice tools): pick the backend, check the call once
    (``_validate.check_call``, which also brings the logits to what the backend's kernels
    read), and build a packed layout's node -> row map. The backends trust what it returns:
    they check nothing again.

    ``traced``: TorchDynamo traces the call (the caller's ``torch.compiler.is_compiling()``;
    ``check_call`` adds fake tensors, ``_validate.tracing``): the backend is resolved when
    the custom op runs (``impl`` None; half types promoted; ``inplace_grad`` has no
    effect). ``logits``: ``(B, T, U+1, V)``; rows ``(N, V)`` with ``node_rows (B, T,
    U+1)`` (the pruned layout) or ``packed=True`` (the map built here,
    ``_layout.packed_node_rows``); or a :class:`_validate.LogitsSpec` (the fused losses:
    shapes only, ``chk.logits`` then a spec of the dtype the backend reads). ``names``: how the messages name the caller's tensors
    (:class:`_validate.Names`)."""
    if traced:
        check_name(backend)
        impl = None
    else:
        # (A NumPy array has a device too, the string "cpu": check_call names its type.)
        device = getattr(logits, "device", None)
        impl = resolve(backend, device if isinstance(device, torch.device) else None)
    chk = check_call(logits, targets, logit_lengths, target_lengths, blank, opts.topology,
                     traced=traced, int64_ids=impl is None or not impl.NATIVE_INT32_IDS,
                     native_low_precision=impl is not None and impl.NATIVE_LOW_PRECISION,
                     node_rows=node_rows, packed=packed, boundary=boundary,
                     allow_blank_targets=allow_blank_targets, names=names,
                     inplace_grad=opts.inplace_grad, device_rules=device_rules)
    if chk.traced:
        impl = None                              # fake tensors: the custom op, as while tracing
    opts = with_blank(opts, chk.blank)
    if packed:
        node_rows = packed_node_rows(chk.logit_lengths, chk.target_lengths, chk.grid)
    return Prepared(impl, chk, opts, node_rows, allow_blank_targets, names)
