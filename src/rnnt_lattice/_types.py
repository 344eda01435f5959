"""Small containers passed between the backends and the public layer."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:                                    # pragma: no cover
    from .topology import Topology


@dataclass
class Lattice:
    """Forward/backward variables and arc occupations of a batch of RNN-T lattices.

    All node tensors have shape ``(B, T, U+1)``; entries outside ``[0, T_b) x [0, U_b]``
    are ``-inf`` (alpha, beta) or ``0`` (occupations). See ``docs/math.md`` sections 2-3.
    """

    alpha: torch.Tensor        # (B, T, U+1)  log-sum of paths from (0,0) to (t,u)
    beta: torch.Tensor         # (B, T, U+1)  log-sum of paths from (t,u) to the end
    log_like: torch.Tensor     # (B,)         log P(y|x) = beta(0,0); -inf when impossible
    gamma_blank: torch.Tensor  # (B, T, U+1)  occupation of the blank arc (t,u)->(t+1,u)
    gamma_label: torch.Tensor  # (B, T, U+1)  occupation of the label arc (t,u)->(t,u+1); 0 at u=U_b


@dataclass(frozen=True)
class LossOptions:
    """Everything a backend needs to know about one loss call besides its tensors.

    One object travels from the public layer through the autograd Function and the custom
    op to the backend's ``loss_forward`` / ``loss_backward``: never positional tuples.
    """

    blank: int                      # in [0, V_tok)
    fused: bool = True              # logits are raw scores (log-softmax fused) or log-probs
    clamp: float = -1.0             # > 0: clip the per-sequence gradient to [-clamp, clamp]
    fastemit_lambda: float = 0.0    # FastEmit: label arcs' gradient x (1 + lambda)
    inplace_grad: bool = False      # write the gradient over the logits
    topology: Optional["Topology"] = None   # None: the regular RNN-T lattice (math.md 1-6)
    sigma: float = 0.0              # subtracted once per arc (NeMo's logit under-normalisation)
    delay_penalty: float = 0.0      # k2's delay penalty on label arcs (math.md section 9)

    def without_inplace(self) -> "LossOptions":
        return replace(self, inplace_grad=False)

    @property
    def regular(self) -> bool:
        """The plain RNN-T lattice with no per-arc term: what every kernel computes."""
        return (self.topology is None or self.topology.name == "regular") \
            and self.sigma == 0.0 and self.delay_penalty == 0.0
