"""Small containers passed between the backends and the public layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch


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

    blank: int                      # in [0, V)
    fused: bool = True              # logits are raw scores (log-softmax fused) or log-probs
    clamp: float = -1.0             # > 0: clip the per-sequence gradient to [-clamp, clamp]
    fastemit_lambda: float = 0.0    # FastEmit: label arcs' gradient x (1 + lambda)
    inplace_grad: bool = False      # write the gradient over the logits

    def without_inplace(self) -> "LossOptions":
        return LossOptions(self.blank, self.fused, self.clamp, self.fastemit_lambda, False)
