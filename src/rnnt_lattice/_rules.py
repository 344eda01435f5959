"""What every backend and loss applies to its results, below all of them (each backend,
the lattice references, the checks and the losses import it; it imports nothing of the
package but ``_memo``): the one device-side assert and its messages, the fused losses' recomputation
tolerance, the upstream gradient's exact zero, and the NaN of a sequence the device check
found bad (and the asserts of a caller's own device rules, queued after its host rules)."""
from __future__ import annotations

import torch

from ._memo import memo

# Every device-side assert's message, by rule, its arguments named by the caller (a compat
# module names them as its peer does: NeMo's ``act_lens``). CUDA refuses a message of 255
# characters or more (``torch._assert_async`` raises "Message length must be smaller than
# 255" on a CUDA tensor, where the CPU takes any length): tests/test_device_checks.py keeps
# each under it, with every compat module's names.
DEVICE_MESSAGES = {
    "lengths": "rnnt_lattice: need 0 <= {logit_lengths}[b] <= T and 0 <= {target_lengths}[b] "
               "<= U, T and U the padded sizes; that sequence's loss is NaN. "
               "RNNT_LATTICE_INPUT_CHECKS=host gives the ValueError naming b",
    "targets": "rnnt_lattice: {targets}[b, u] for u < {target_lengths}[b] must be a label in "
               "[0, V), not a blank (allow_blank_targets=True admits the blank); that "
               "sequence's loss is NaN. RNNT_LATTICE_INPUT_CHECKS=host names b, u",
    "boundary": "rnnt_lattice: boundary[b] must satisfy 0 <= begin_symbol <= end_symbol <= "
                "{target_lengths}[b] and 0 <= begin_frame <= end_frame <= {logit_lengths}[b]; "
                "that sequence's loss is NaN",
    # The windows of the pruned loss and of do_rnnt_pruning, and pack_logits' lengths under
    # torch.compile (no host read: on CUDA, or while tracing)
    "ranges": "rnnt_lattice: ranges[b, t] must be strictly increasing label positions in "
              "[0, U] (k2: [0, S]); a pruned loss of that sequence is NaN. "
              "RNNT_LATTICE_INPUT_CHECKS=host (an eager call on the host) gives the "
              "ValueError naming b, t",
    "symbols": "rnnt_lattice: k2's symbols[b, s] for s < boundary[b, 2] must be in [0, C). "
               "RNNT_LATTICE_INPUT_CHECKS=host (an eager call on the host) gives the "
               "ValueError naming b, s",
    "pruning_ranges": "rnnt_lattice: do_rnnt_pruning: ranges must lie in [0, U], lm holding U+1 "
                      "rows per sequence. RNNT_LATTICE_INPUT_CHECKS=host (an eager call on the "
                      "host) gives the ValueError",
    "pack_lengths": "rnnt_lattice: pack_logits: need 0 <= logit_lengths[b] <= T and 0 <= "
                    "target_lengths[b] <= U, T and U the padded sizes (an eager call gives the "
                    "ValueError naming b)",
    # warp-rnnt's compact backward (compat.warp_rnnt._C.rnnt_loss_compact_backward)
    "compact_loc": "rnnt_lattice: rnnt_loss_compact_backward: loc must hold class ids in "
                   "[0, V) (RNNT_LATTICE_INPUT_CHECKS=host gives the ArgumentError)",
    "compact_rows": "rnnt_lattice: rnnt_loss_compact_backward: cumSum must be the cumulative "
                    "row counts, non-decreasing and ending at the rows of grad_xs "
                    "(RNNT_LATTICE_INPUT_CHECKS=host gives the ArgumentError)",
    "recompute": "rnnt_lattice: the joiner gave other logits when the fused loss recomputed a "
                 "tile in the backward pass; it must be deterministic given its inputs and the "
                 "RNG state (dropout is replayed), as torch.utils.checkpoint requires",
}


# (memo, not functools.lru_cache: the asserts of the windows and of k2's symbols are traced
# by torch.compile, where an lru_cache draws TorchDynamo's warning.)
@memo(maxsize=64)
def device_message(rule: str, targets: str = "targets", logit_lengths: str = "logit_lengths",
                   target_lengths: str = "target_lengths") -> str:
    """:data:`DEVICE_MESSAGES` of ``rule``, the arguments named as the caller names them."""
    return DEVICE_MESSAGES[rule].format(targets=targets, logit_lengths=logit_lengths,
                                        target_lengths=target_lengths)


def device_assert(ok: torch.Tensor, rule: str, names: tuple = ()) -> None:
    """The one device-side assert: ``ok`` (one element, nonzero = holds) must hold, else
    the device raises :func:`device_message` of ``rule`` (``names``: the caller's names of
    the targets and the two lengths, if not ours) -- asynchronously on CUDA (the error
    surfaces at the next synchronisation; no host synchronisation here), at once on the
    CPU (a RuntimeError)."""
    torch._assert_async(ok, device_message(rule, *names))


# The fused losses' check that a recomputed tile is the forward's (``fused``): the largest
# deviation allowed, relative, by the joiner's output dtype. A deterministic joiner gives
# the same rows (the same kernels on the same shapes); a GPU joiner with atomics differs
# by its rounding. Beyond that the recomputed logits are not the forward's, and the
# gradient would be that of other logits.
RECOMPUTE_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4}


def recompute_rtol(dtype: torch.dtype) -> float:
    """:data:`RECOMPUTE_RTOL` of ``dtype`` (half dtypes: 1e-2): of the row sums
    (``fused._check_same``), or of a row's deviation from the forward's normalisers
    (``gpu.tile_backward``: ``(sum_v p(v) - 1) / (1 + |lse|)`` per softmax group read)."""
    return RECOMPUTE_RTOL.get(dtype, 1e-2)


def scale_upstream(grad: torch.Tensor, upstream: torch.Tensor, out=None) -> torch.Tensor:
    """``upstream * grad`` per sequence, where an upstream gradient of exactly 0 gives
    exactly 0 (a select, not a product: ``0 * NaN`` is NaN; math.md section 8.1)."""
    prod = grad * upstream
    return torch.where(upstream == 0, torch.zeros((), dtype=grad.dtype, device=grad.device),
                       prod, **({} if out is None else {"out": out}))


def nan_rows_of(bad: torch.Tensor) -> torch.Tensor:
    """``(B,)`` float32 NaN rows from a check's ``bad (B,)`` bool: NaN where a sequence broke
    a rule, 0 elsewhere (what :func:`with_bad_rows` adds to the costs)."""
    return torch.where(bad, float("nan"), 0.0).to(torch.float32)


def assert_rules(*checks) -> torch.Tensor | None:
    """The device-side asserts of the rules a call checked on the device (or in a traced
    graph), queued once every host rule of the call has passed: a queued assert fires even
    when the call then raises on the host (on CUDA at the next synchronisation, and the
    context is lost), so a call refused on the host must have queued none. ``checks``:
    ``(rule, bad)`` pairs, ``bad (B,)`` bool, True for a sequence that breaks ``rule``
    (None: checked on the host already; on the meta device: no values, no assert). Returns
    their NaN rows joined (:func:`nan_rows_of`), None if no pair has a ``bad``."""
    nan_rows = None
    for rule, bad in checks:
        if bad is None:
            continue
        if bad.device.type != "meta":
            device_assert(~bad.any(), rule)
        rows = nan_rows_of(bad)
        nan_rows = rows if nan_rows is None else nan_rows + rows
    return nan_rows


def with_bad_rows(costs: torch.Tensor, nan_rows) -> torch.Tensor:
    """``costs (B,)`` with NaN for the sequences the device check found bad (``nan_rows``
    (B,), NaN there and 0 elsewhere, ``_validate.device_value_check``; None: checked on
    the host): the loss of a bad input is NaN, never a plausible value."""
    return costs if nan_rows is None else costs + nan_rows
