"""Node and arc occupation probabilities of the RNN-T lattice (math.md section 3)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..reference import node_mask
from ._common import prepare


@dataclass(frozen=True)
class Occupancy:
    """Occupation probabilities of a batch of lattices, in the lattice dtype (float64 on
    CPU/CUDA). Entries outside ``[0, T_b) x [0, U_b]`` are 0, and so is everything of a
    sequence with no path (``log_likelihood = -inf``).

    Attributes:
        node: ``(B, T, U+1)`` probability that the path visits node ``(t, u)``
            (``= gamma_blank + gamma_label``), in ``[0, 1]``.
        gamma_blank: ``(B, T, U+1)`` probability that the path takes the blank arc
            ``(t,u) -> (t+1,u)``; for every valid frame ``sum_u gamma_blank = 1``.
        gamma_label: ``(B, T, U+1)`` probability of the label arc ``(t,u) -> (t,u+1)``
            (0 in the last valid column ``u = U_b``); for every ``u < U_b``
            ``sum_t gamma_label = 1``.
        log_likelihood: ``(B,)`` ``log P(y|x)``; ``-inf`` when no path exists.
        logit_lengths, target_lengths: ``(B,)`` int64, the lengths the lattice was built with.
    """

    node: torch.Tensor
    gamma_blank: torch.Tensor
    gamma_label: torch.Tensor
    log_likelihood: torch.Tensor
    logit_lengths: torch.Tensor
    target_lengths: torch.Tensor


def occupancy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int = -1,
    fused_log_softmax: bool = True,
    *,
    backend: str = "auto",
) -> Occupancy:
    r"""Occupation probabilities of every lattice node and arc (math.md section 3)::

        gamma_blank(t,u) = exp(alpha(t,u) + b(t,u) + beta(t+1,u) - log P)
        gamma_label(t,u) = exp(alpha(t,u) + e(t,u) + beta(t,u+1) - log P)
        node(t,u)        = gamma_blank(t,u) + gamma_label(t,u)

    computed by the same forward-backward pass as :func:`rnnt_lattice.rnnt_loss` (no
    gradient work). Arguments are those of ``rnnt_loss``.

    Example::

        >>> import torch, rnnt_lattice
        >>> logits = torch.randn(2, 6, 4, 5)                      # (B, T, U+1, V)
        >>> targets = torch.tensor([[1, 2, 3], [4, 1, 0]])         # (B, U)
        >>> occ = rnnt_lattice.occupancy(logits, targets, torch.tensor([6, 4]),
        ...                              torch.tensor([3, 2]), blank=0)
        >>> occ.node.shape                                         # (B, T, U+1)
        torch.Size([2, 6, 4])
        >>> bool(torch.allclose(occ.gamma_blank.sum(-1)[0], torch.ones(6, dtype=torch.float64)))
        True

    Args:
        logits: ``(B, T, U+1, V)`` joiner output (or log-probs with
            ``fused_log_softmax=False``).
        targets: ``(B, U)``; logit_lengths, target_lengths: ``(B,)``.
        blank: blank id (negative counts from the end).
        backend: ``"auto"``, ``"numba"``, ``"torch"`` or ``"triton"`` (as ``rnnt_loss``).

    Returns:
        :class:`Occupancy`.
    """
    chk, impl = prepare(logits, targets, logit_lengths, target_lengths, blank, backend)
    with torch.no_grad():
        lat = impl.compute_lattice(chk.logits, chk.targets, chk.logit_lengths, chk.target_lengths,
                                   chk.blank, bool(fused_log_softmax))
    # Padding is zero in every backend already; the mask makes it a contract of this layer.
    B, T, U1 = lat.gamma_blank.shape
    nodes = node_mask(chk.logit_lengths, chk.target_lengths, T, U1)
    gb = torch.where(nodes, lat.gamma_blank, 0.0)
    gl = torch.where(nodes, lat.gamma_label, 0.0)
    return Occupancy(node=gb + gl, gamma_blank=gb, gamma_label=gl, log_likelihood=lat.log_like,
                     logit_lengths=chk.logit_lengths, target_lengths=chk.target_lengths)
