"""A user's script over the public API, every result annotated with the type it has:
``tests/test_typing.py`` runs it, and type-checks it with mypy against the installed
package (its ``py.typed`` marker and annotations), as a user's type checker reads them."""
from __future__ import annotations

import torch

import rnnt_lattice
from rnnt_lattice import topology
from rnnt_lattice.compat import (k2, nemo, optimized_transducer, speechbrain, torchaudio,
                                 warp_rnnt, warp_transducer, warprnnt_numba)

B, T, U, V = 2, 5, 2, 4
logits = torch.randn(B, T, U + 1, V, requires_grad=True)
targets = torch.randint(1, V - 1, (B, U))
ll, tl = torch.tensor([5, 4]), torch.tensor([2, 1])
tdt_logits = torch.randn(B, T, U + 1, V + 2)            # V tokens (blank V - 1), 2 durations
mb_logits = torch.randn(B, T, U + 1, V + 1)             # a big blank, then the blank V

# The losses and their modules
loss: torch.Tensor = rnnt_lattice.rnnt_loss(logits, targets, ll, tl, blank=0)
loss.backward()
criterion: torch.nn.Module = rnnt_lattice.RNNTLoss(blank=0, reduction="sum")
l2: torch.Tensor = rnnt_lattice.RNNTLoss(blank=0)(logits, targets, ll, tl)
l3: torch.Tensor = rnnt_lattice.tdt_loss(tdt_logits, targets, ll, tl, blank=V - 1,
                                         durations=[0, 1])
l4: torch.Tensor = rnnt_lattice.TDTLoss(blank=V - 1, durations=[0, 1])(tdt_logits, targets,
                                                                       ll, tl)
l5: torch.Tensor = rnnt_lattice.multiblank_rnnt_loss(mb_logits, targets, ll, tl, blank=V,
                                                     big_blank_durations=[2])
l6: torch.Tensor = rnnt_lattice.MultiblankRNNTLoss(blank=V, big_blank_durations=[2])(
    mb_logits, targets, ll, tl)
rows: torch.Tensor = rnnt_lattice.pack_logits(logits, ll, tl)

# The lattice tools
occ = rnnt_lattice.occupancy(logits.detach(), targets, ll, tl, 0)
gamma: torch.Tensor = occ.gamma
node: torch.Tensor = occ.node
kinds: tuple[str, ...] = occ.kinds
best = rnnt_lattice.best_alignment(logits.detach(), targets, ll, tl, 0)
frames: torch.Tensor = best.emit_frames
arc_frames: torch.Tensor = best.arc_frames
n_arcs: torch.Tensor = best.n_arcs
first_frame: int = best.arcs[0][0].t
path: list[tuple[int, int]] = best.path(0)
covered: torch.Tensor = rnnt_lattice.prune_coverage(occ, 4).total

# Pruned RNN-T
lm = torch.randn(B, U + 1, V, requires_grad=True)
am = torch.randn(B, T, V, requires_grad=True)
simple, arc_occ = rnnt_lattice.rnnt_loss_simple(lm, am, targets, ll, tl, blank=0,
                                                return_occupations=True)
smoothed: torch.Tensor = rnnt_lattice.rnnt_loss_smoothed(lm, am, targets, ll, tl, blank=0)
ranges: torch.Tensor = rnnt_lattice.prune_ranges(arc_occ, 2).ranges
am_p, lm_p = rnnt_lattice.do_rnnt_pruning(am, lm, ranges)
pruned: torch.Tensor = rnnt_lattice.rnnt_loss_pruned(am_p + lm_p, targets, ranges, ll, tl,
                                                     blank=0)
weights: torch.Tensor = rnnt_lattice.lattice_loss(torch.randn(B, T, U + 1),
                                                  torch.randn(B, T, U + 1), ll, tl)

# The fused joiner and loss
joiner = rnnt_lattice.Joiner(4, 4, 8, V)
z: torch.Tensor = joiner(torch.randn(B, T, 1, 4), torch.randn(B, 1, U + 1, 4))
enc, pred = torch.randn(B, T, 4), torch.randn(B, U + 1, 4)
fused: torch.Tensor = rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, targets, ll, tl, blank=0)
fused2: torch.Tensor = rnnt_lattice.FusedRNNTLoss(joiner, blank=0)(enc, pred, targets, ll, tl)
before: str = rnnt_lattice.set_input_checks("host")
rnnt_lattice.set_input_checks(before)
rnnt_lattice.empty_cache()
topo: topology.Topology = topology.tdt([0, 1, 2])
version: str = rnnt_lattice.__version__

# The drop-in modules
ta: torch.Tensor = torchaudio.rnnt_loss(logits, targets.int(), ll.int(), tl.int(), blank=0)
ta2: torch.Tensor = torchaudio.RNNTLoss(blank=0)(logits, targets.int(), ll.int(), tl.int())
boundary = torch.tensor([[0, 0, 2, 5], [0, 0, 1, 4]])
k_full: torch.Tensor = k2.rnnt_loss(logits, targets, 0, boundary)
k_simple, (px_grad, py_grad) = k2.rnnt_loss_simple(lm, am, targets, 0, boundary,
                                                    return_grad=True)
k_ranges: torch.Tensor = k2.get_rnnt_prune_ranges(px_grad, py_grad, boundary, 2)
k_am, k_lm = k2.do_rnnt_pruning(am, lm, k_ranges)
k_pruned: torch.Tensor = k2.rnnt_loss_pruned(k_am + k_lm, targets, k_ranges, 0, boundary)
ne: torch.Tensor = nemo.rnnt_loss(logits, targets, ll, tl, blank=0)
wt: torch.Tensor = warp_transducer.RNNTLoss(blank=0)(logits, targets.int(), ll.int(), tl.int())
ot: torch.Tensor = optimized_transducer.transducer_loss(rows, targets.int(), ll.int(), tl.int(),
                                                        blank=0, from_log_softmax=False)
sb: torch.Tensor = speechbrain.transducer_loss(logits.log_softmax(-1), targets, ll / 5.0,
                                               tl / 2.0, 0)
wr: torch.Tensor = warp_rnnt.rnnt_loss(logits.log_softmax(-1), targets.int(), ll.int(),
                                       tl.int())
wn: torch.Tensor = warprnnt_numba.RNNTLossNumba(blank=0)(logits, targets, ll, tl)
