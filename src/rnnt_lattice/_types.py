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
