"""Node and arc occupation probabilities of a transducer lattice (math.md sections 3 and 9),
for every topology of ``rnnt_lattice.topology``, computed by the backend's kernels (the
loss's forward-backward pass: the backend protocol's ``occupancy``; the torch backend runs
the reference's ``lattice``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._ops import eager_under_compile
from ..topology import Topology, regular
from ._common import lattice, request


@dataclass(frozen=True)
class Occupancy:
    """Occupation probabilities of a batch of lattices, in the lattice dtype (float64 on
    CPU/CUDA). Entries outside each sequence's lattice are 0, and so is everything of a
    sequence with no path (``log_likelihood = -inf``).

    Attributes:
        node: ``(B, T, U+1)`` probability that the path leaves node ``(t, u)`` (the sum of
            ``gamma`` over the kinds), in ``[0, 1]``. For the regular topology
            ``= gamma_blank + gamma_label``, the probability of visiting the node.
        gamma_blank: ``(B, T, U+1)`` the occupations of the kinds with ``du == 0`` summed
            (the blank; multi-blank: with the big blanks; TDT: every blank duration). For
            the regular topology ``sum_u gamma_blank = 1`` on every valid frame.
        gamma_label: ``(B, T, U+1)`` the kinds with ``du == 1`` summed (every label arc, of
            any duration or frame advance): for every topology and every label position
            ``u0 <= u < u1``, ``sum_t gamma_label[:, u] = 1`` (each path emits each label
            once); 0 in the last column.
        log_likelihood: ``(B,)`` ``log P(y|x)`` of the (weighted: ``sigma``,
            ``delay_penalty``) lattice, as the loss reports it; ``-inf`` when no path exists.
        logit_lengths, target_lengths: ``(B,)``, the lengths the lattice was built with (int64,
            or int32 as given).
        gamma: ``(B, K, T, U+1)`` occupation of kind k's arc leaving ``(t, u)``, kinds in
            the order of ``topology.kinds``.
        topology: the :class:`rnnt_lattice.topology.Topology` of the lattice.
        kinds: (property) the kind names, ``("blank", "label")`` for the regular topology.

    Every topology: each frame ``t0 <= f < t1`` is crossed by exactly one arc of a path
    (an arc from ``(t, u)`` of ``dt`` frames covers ``t <= f < t + dt``), so the
    occupations of the arcs covering ``f`` sum to 1.
    """

    node: torch.Tensor
    gamma_blank: torch.Tensor
    gamma_label: torch.Tensor
    log_likelihood: torch.Tensor
    logit_lengths: torch.Tensor
    target_lengths: torch.Tensor
    # None: built from the regular fields (__post_init__); a tensor for every reader
    gamma: torch.Tensor = None  # type: ignore[assignment]
    topology: Topology = field(default_factory=regular)

    def __post_init__(self):
        if self.gamma is None:     # built from the regular fields
            object.__setattr__(self, "gamma", torch.stack([self.gamma_blank, self.gamma_label], 1))

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.topology.kinds)


def occupancy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int = -1,
    fused_log_softmax: bool = True,
    *,
    backend: str = "auto",
    rnnt_type: str = "regular",
    topology: Topology | None = None,
    sigma: float = 0.0,
    delay_penalty: float = 0.0,
    boundary: torch.Tensor | None = None,
) -> Occupancy:
    r"""Occupation probabilities of every lattice node and arc (math.md sections 3, 9)::

        gamma_k(t,u) = exp(alpha(t,u) + w_k(t,u) + beta((t,u) + delta_k) - log P)
        node(t,u)    = sum_k gamma_k(t,u)

    (regular: ``gamma_blank = exp(alpha + b + beta(t+1,u) - log P)``, ``gamma_label =
    exp(alpha + e + beta(t,u+1) - log P)``), computed by the same forward-backward pass as
    the losses (no gradient work).

    The lattice: ``rnnt_type`` (``"regular"``, ``"modified"``, ``"constrained"``,
    ``"one_sym_per_frame"``) as :func:`rnnt_lattice.rnnt_loss`, or ``topology=`` any
    :class:`rnnt_lattice.topology.Topology` (``topology.tdt(durations)``: logits
    ``[tokens | durations]`` as :func:`rnnt_lattice.tdt_loss`;
    ``topology.multiblank(blank_id, big_blank_durations)`` as
    :func:`rnnt_lattice.multiblank_rnnt_loss`), not both. ``sigma`` (subtracted per arc),
    ``delay_penalty`` and ``boundary`` as the losses. Every lattice runs on ``backend``'s
    kernels: the row and lattice passes of the loss, then one pass for the per-kind
    occupations (Numba, Triton; ``"torch"``: the reference's generic recursion).

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
        >>> from rnnt_lattice import topology
        >>> x = torch.randn(2, 6, 4, 5 + 3)                        # 5 tokens (blank last), 3 durations
        >>> occ = rnnt_lattice.occupancy(x, targets % 4, torch.tensor([6, 4]), torch.tensor([3, 2]),
        ...                              blank=-1, topology=topology.tdt([0, 1, 2]), backend="torch")
        >>> occ.kinds, occ.gamma.shape                             # (B, K, T, U+1)
        (('label_d0', 'label_d1', 'label_d2', 'blank_d1', 'blank_d2'), torch.Size([2, 5, 6, 4]))

    Args:
        logits: ``(B, T, U+1, V)`` joiner output (or log-probs with
            ``fused_log_softmax=False``).
        targets: ``(B, U)``; logit_lengths, target_lengths: ``(B,)``.
        blank: blank id (negative counts from the end of the token classes).
        backend: ``"auto"``, ``"numba"``, ``"torch"`` or ``"triton"`` (as ``rnnt_loss``).
        rnnt_type, topology, sigma, delay_penalty, boundary: the lattice (above).

    Returns:
        :class:`Occupancy`.
    """
    req = request(logits, targets, logit_lengths, target_lengths, blank, fused_log_softmax,
                  backend, rnnt_type, topology, sigma, delay_penalty, boundary)
    lat = lattice(req)
    gamma = lat.gamma
    # Sums over the kinds of each group, one add per kind (K is small; a reduction over
    # the kind axis would stride through the tensor).
    gb, gl = (_sum_kinds(gamma, [k for k, kind in enumerate(req.topo.kinds) if kind.du == du])
              for du in (0, 1))
    chk = req.chk
    return Occupancy(node=gb + gl, gamma_blank=gb, gamma_label=gl,
                     log_likelihood=lat.log_like, logit_lengths=chk.logit_lengths,
                     target_lengths=chk.target_lengths, gamma=gamma, topology=req.topo)


def _sum_kinds(gamma: torch.Tensor, kinds: list) -> torch.Tensor:
    """``sum_{k in kinds} gamma[:, k]``, ``(B, T, U+1)`` (zeros for no kind)."""
    if not kinds:
        return torch.zeros_like(gamma[:, 0])
    out = gamma[:, kinds[0]].clone()
    for k in kinds[1:]:
        out += gamma[:, k]
    return out


# Under torch.compile the tool runs eagerly (a graph break): traced, its preparation leaves
# the backend to a custom op (the loss's), and it has none: every compiled call failed.
occupancy = eager_under_compile(
    occupancy, "rnnt_lattice's occupancy runs its kernels eagerly, a graph break; compile "
    "without fullgraph=True")
