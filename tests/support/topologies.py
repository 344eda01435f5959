"""The topology table of the tests: every builder of ``rnnt_lattice.topology`` by a short
name, the options every backend is checked with, the tiny ragged cases of the topology
tests (``cases.TOPOLOGY``) and their input factory (NaN outside each lattice, valid targets for the topology)."""
from __future__ import annotations

import torch

from rnnt_lattice import topology

from .cases import Case, make_inputs
from .oracle import topology_best_path

TOPOLOGIES = {
    "regular": lambda V_tok, blank: (topology.regular(), blank),
    "modified": lambda V_tok, blank: (topology.modified(), blank),
    "constrained": lambda V_tok, blank: (topology.constrained(), blank),
    "one_sym": lambda V_tok, blank: (topology.one_sym_per_frame(), blank),
    # NeMo layouts: the standard blank is the last token (big blanks just below it).
    "multiblank": lambda V_tok, blank: (topology.multiblank(V_tok - 1, [2, 3]), V_tok - 1),
    "tdt012": lambda V_tok, blank: (topology.tdt([0, 1, 2]), V_tok - 1),
    "tdt13": lambda V_tok, blank: (topology.tdt([1, 3]), V_tok - 1),
}

OPTIONS = {
    "fused": dict(),
    "logprob": dict(fused=False),
    "fastemit": dict(fastemit_lambda=0.5),
    "clamp": dict(clamp=0.05),
    "sigma": dict(sigma=0.05),
    "delay": dict(delay_penalty=0.3),
    "boundary": dict(boundary=True),
    "all_logprob": dict(fused=False, fastemit_lambda=0.25, clamp=0.2, sigma=0.1, delay_penalty=0.2,
                        boundary=True),
}


def make_topo_inputs(case: Case, topo_name: str, dtype=torch.float64, seed: int = 0,
                     fused: bool = True, boundary: bool = False):
    """``(logits, targets, tl, ul, topo, blank, boundary)``: logits ``(B, T, U+1, V_tok + D)``
    NaN outside each lattice (and outside each boundary region), targets any token but the
    blank(s), garbage past each target length."""
    V_tok = case.V
    topo, blank = TOPOLOGIES[topo_name](V_tok, case.blank % V_tok)
    V = V_tok + topo.n_durations
    logits, _, tl, ul, _ = make_inputs(Case(case.name, case.T_lens, case.U_lens, V, 0, case.T, case.U),
                                       torch.float64, seed=seed)
    B, T, U1, _ = logits.shape
    blanks = {blank} | {k.class_id for k in topo.kinds if k.reads == "class"}
    others = torch.tensor([v for v in range(V_tok) if v not in blanks], dtype=torch.int64)
    g = torch.Generator().manual_seed(seed + 1)
    targets = others[torch.randint(len(others), (B, U1 - 1), generator=g)]
    targets = targets.masked_fill(torch.arange(U1 - 1)[None, :] >= ul[:, None], -7)
    bnd = None
    if boundary:
        rows = []
        for b in range(B):
            T_b, U_b = int(tl[b]), int(ul[b])
            rows.append([[0, 0, U_b, T_b],                                      # the default
                         [min(1, U_b), min(1, T_b), U_b, T_b],                  # later start
                         [0, 0, max(U_b - 1, 0), max(T_b - 1, 0)]][b % 3])      # earlier end
        bnd = torch.tensor(rows, dtype=torch.int64)
        region = torch.zeros(B, T, U1, dtype=torch.bool)
        for b, (s0, t0, s1, t1) in enumerate(rows):
            region[b, t0:t1, s0:s1 + 1] = True
        logits = logits.masked_fill(~region[..., None], float("nan"))
    if not fused:
        V_tok_ = topo.token_classes(V)
        logits = torch.cat([torch.log_softmax(logits[..., :V_tok_], -1),
                            torch.log_softmax(logits[..., V_tok_:], -1)], -1)
    return logits.to(dtype), targets, tl, ul, topo, blank, bnd


# The softmax groups a confident path can read, by topology (test_variants' spelling):
# the blank and labels (regular), the big blanks' fixed classes (multi-blank), TDT's durations.
CONFIDENT = {
    "regular": ("rnnt_loss", dict()),
    "multiblank": ("multiblank_rnnt_loss", dict(big_blank_durations=[2, 3])),
    "tdt012": ("tdt_loss", dict(durations=[0, 1, 2])),
}


def confident(x, targets, tl, ul, topo, blank, margin):
    """``x`` with every class that the oracle's best path of each sequence reads (its token,
    and on TDT its duration) raised by ``margin`` nats: a confident model, whose rows on the
    path have ``p = 1 / (1 + rest)``, ``rest`` ~ V e^-margin."""
    x = x.clone()
    V_tok = x.shape[-1] - topo.n_durations
    for b in range(x.shape[0]):
        _, arcs = topology_best_path(x[b], targets[b], topo, blank, True, (0, 0),
                                     (int(tl[b]), int(ul[b])))
        for t, u, k in arcs:
            kind = topo.kinds[k]
            cls = {"blank": blank, "class": kind.class_id}.get(kind.reads)
            x[b, t, u, int(targets[b, u]) if cls is None else cls] += margin
            if kind.duration >= 0:
                x[b, t, u, V_tok + kind.duration] += margin
    return x
