"""Transducer topologies as sets of arc kinds (docs/math.md section 9).

A topology is a description, not an algorithm: a tuple of :class:`ArcKind` (how far an arc
moves, which softmax entry it reads, which per-arc terms it carries). One recursion
per backend runs every topology (``reference.lattice``, the Numba and Triton kernels); the
brute-force oracle of the tests enumerates paths over the same description.

Lattice conventions, the one rule for all topologies (math.md section 9.1): nodes ``(t, u)``
with ``t in [0, T_b]`` and ``u in [0, U_b]``; frame ``T_b`` is the virtual end frame and
reads no logits. The start node is ``(0, 0)``, the end node ``(T_b, U_b)``, and
``log P = alpha(T_b, U_b)``. Arcs leave only nodes with ``t < T_b``; an arc of kind k from
``(t, u)`` lands on ``(t + dt, u + du)``, which must satisfy ``u + du <= U_b`` and either
``t + dt < T_b``, or ``t + dt == T_b`` with ``may_end`` (landing on the end frame is only
useful, and only counted as an arc, at ``u + du == U_b``: every other node of the end frame
is a dead end). k2's ``boundary`` moves the start to ``(begin_frame, begin_symbol)`` and the
end to ``(end_frame, end_symbol)``.

Builders, with the peers' exact semantics (docs/variants.md):

    regular()            blank (1,0) may_end ; label (0,1)
    modified()           blank (1,0) may_end ; label (1,1) may_end           (k2)
    constrained()        same, label weight e(t,u) + b(t,u+1)                 (k2)
    one_sym_per_frame()  blank (1,0) may_end ; label (1,1)                    (optimized_transducer)
    multiblank(blank, durations)  blank (1,0) ; label (0,1) ; big blank i (d_i,0) reading
                         class blank-1-i ; every blank may_end                (NeMo)
    tdt(durations)       label (d,1) for every d ; blank (d,0) for d > 0, may_end ; each arc
                         adds the log-prob of its duration index              (NeMo)
"""
from __future__ import annotations

from dataclasses import dataclass

from ._memo import memo

READS = ("blank", "label", "class")


@dataclass(frozen=True)
class ArcKind:
    """One kind of arc of a transducer lattice.

    Its weight at source node ``(t, u)`` is the log-prob it reads (``reads``: the blank,
    the label ``y[u]`` or the fixed class ``class_id`` of the token softmax group), plus
    the log-prob of duration ``duration`` (TDT's second softmax group), plus
    ``b(t, u+1)`` if ``plus_next_blank``, plus the per-call terms (``-sigma`` on every arc,
    the delay penalty on ``delay`` kinds).
    """

    name: str               # "blank", "label", "big_blank_2", "label_d1", ...
    dt: int                 # frames advanced, >= 0
    du: int                 # label positions advanced, 0 or 1; dt + du >= 1
    reads: str              # class read in the token group: "blank", "label" (y[u]) or "class"
    class_id: int = -1      # for reads == "class": a fixed token id (multi-blank big blanks), >= 0
    duration: int = -1      # TDT: index i of the duration group whose log-prob is added; -1: none
    plus_next_blank: bool = False  # constrained: weight also adds b(t, u+1) (forced blank folded in)
    fastemit: bool = False  # gradient of the class read x (1 + fastemit_lambda) (label kinds)
    delay: bool = False     # + delay_penalty * ((T_b - 1)/2 - t) on this kind (k2: label arcs)
    may_end: bool = False   # may land on the end frame T_b (only useful at u = U_b)

    def __post_init__(self):
        if self.dt < 0 or self.du not in (0, 1) or self.dt + self.du < 1:
            raise ValueError(f"arc kind {self.name!r}: need dt >= 0, du in (0, 1) and "
                             f"dt + du >= 1, got dt={self.dt}, du={self.du}")
        if self.reads not in READS:
            raise ValueError(f"arc kind {self.name!r}: reads must be one of {READS}, got {self.reads!r}")
        if (self.reads == "class") != (self.class_id >= 0):
            raise ValueError(f"arc kind {self.name!r}: class_id >= 0 exactly when reads == 'class'")
        if self.reads == "label" and self.du != 1:
            raise ValueError(f"arc kind {self.name!r}: a label arc advances one label position")
        if self.plus_next_blank and self.du != 1:
            raise ValueError(f"arc kind {self.name!r}: plus_next_blank reads b(t, u+1), needs du = 1")


@dataclass(frozen=True)
class Topology:
    """A transducer topology: its arc kinds (in a fixed order: kind k is index k of every
    per-kind tensor, e.g. the occupations ``gamma (B, K, T, U+1)``) and, for TDT, the
    size of the duration softmax group, which sits after the tokens in the last axis of
    the logits: ``(B, T, U+1, V_tok + n_durations)``."""

    name: str
    kinds: tuple[ArcKind, ...]
    n_durations: int = 0    # size of the duration softmax group (TDT); 0 otherwise
    blank: int | None = None  # the blank id its fixed classes are placed around (multi-blank); None: any

    def __hash__(self) -> int:
        # Computed once: a topology keys the backends' caches on every call, and the
        # dataclass's own hash would walk every arc kind each time.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.name, self.kinds, self.n_durations, self.blank))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        # The cached hash stays in its process (string hashes are salted per process).
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __post_init__(self):
        if not self.kinds:
            raise ValueError(f"topology {self.name!r} has no arc kinds")
        names = [k.name for k in self.kinds]
        if len(set(names)) != len(names):
            raise ValueError(f"topology {self.name!r}: arc kind names must be distinct, got {names}")
        for k in self.kinds:
            if self.n_durations == 0 and k.duration != -1:
                raise ValueError(f"topology {self.name!r}: kind {k.name!r} reads a duration "
                                 "but n_durations is 0")
            if self.n_durations > 0 and not 0 <= k.duration < self.n_durations:
                raise ValueError(f"topology {self.name!r}: kind {k.name!r} must read a duration "
                                 f"index in [0, {self.n_durations})")
        if not any(k.may_end for k in self.kinds):
            raise ValueError(f"topology {self.name!r}: no arc kind may land on the end frame")

    @property
    def K(self) -> int:
        """Number of arc kinds."""
        return len(self.kinds)

    @property
    def max_step(self) -> int:
        """Largest anti-diagonal step ``dt + du`` of any kind."""
        return max(k.dt + k.du for k in self.kinds)

    def token_classes(self, V: int) -> int:
        """Size of the token softmax group for logits whose last axis has ``V`` entries."""
        return V - self.n_durations


def regular() -> Topology:
    """Standard RNN-T (Graves 2012): a mandatory final blank from ``(T_b-1, U_b)``."""
    return Topology("regular", (
        ArcKind("blank", 1, 0, "blank", may_end=True),
        ArcKind("label", 0, 1, "label", fastemit=True, delay=True),
    ))


def modified() -> Topology:
    """k2 ``rnnt_type="modified"``: exactly one symbol per frame, no final blank
    (needs ``T_b >= U_b``)."""
    return Topology("modified", (
        ArcKind("blank", 1, 0, "blank", may_end=True),
        ArcKind("label", 1, 1, "label", fastemit=True, delay=True, may_end=True),
    ))


def constrained() -> Topology:
    """k2 ``rnnt_type="constrained"``: regular RNN-T with at most one label per frame, the
    forced blank after a label folded into the label arc: weight ``e(t,u) + b(t,u+1)``."""
    return Topology("constrained", (
        ArcKind("blank", 1, 0, "blank", may_end=True),
        ArcKind("label", 1, 1, "label", plus_next_blank=True, fastemit=True, delay=True,
                may_end=True),
    ))


def one_sym_per_frame() -> Topology:
    """optimized_transducer ``one_sym_per_frame=True``: labels advance a frame, the final
    blank from ``(T_b-1, U_b)`` is mandatory (needs ``T_b >= U_b + 1``)."""
    return Topology("one_sym_per_frame", (
        ArcKind("blank", 1, 0, "blank", may_end=True),
        ArcKind("label", 1, 1, "label", fastemit=True, delay=True),
    ))


def multiblank(blank: int, big_blank_durations) -> Topology:
    """NeMo multi-blank RNN-T. ``blank`` is the standard blank's id (NeMo: the last token,
    ``V + n_big_blanks``); big blank i, of duration ``big_blank_durations[i] >= 2``, is the
    class ``blank - 1 - i`` and moves ``(t,u) -> (t + d_i, u)``."""
    return _multiblank(blank, tuple(int(d) for d in big_blank_durations))


# The builders with parameters are cached by their (hashable) parameters: a loss builds its
# topology in every call, and one frozen object per value spares the arc kinds' checks and
# makes the backends' cache lookups, keyed by the topology, an identity hit.
@memo(maxsize=64)
def _multiblank(blank: int, durations: tuple) -> Topology:
    durations = list(durations)
    if blank < 0:
        raise ValueError(f"multiblank: give the blank as a token id >= 0, got {blank}")
    if len(set(durations)) != len(durations) or any(d < 2 for d in durations):
        raise ValueError(f"multiblank: big blank durations must be distinct and >= 2 "
                         f"(the standard blank is duration 1), got {durations}")
    if blank - len(durations) < 0:
        raise ValueError(f"multiblank: {len(durations)} big blanks need ids below blank={blank}")
    kinds = [ArcKind("blank", 1, 0, "blank", may_end=True),
             ArcKind("label", 0, 1, "label", fastemit=True, delay=True)]
    kinds += [ArcKind(f"big_blank_{d}", d, 0, "class", class_id=blank - 1 - i, may_end=True)
              for i, d in enumerate(durations)]
    return Topology("multiblank", tuple(kinds), blank=blank)


def tdt(durations) -> Topology:
    """NeMo Token-and-Duration Transducer. ``durations`` ascending, distinct, >= 0, with at
    least one > 0. Label arcs ``(t,u) -> (t+d, u+1)`` for every d (never landing on the end
    frame), blank arcs ``(t,u) -> (t+d, u)`` for d > 0 (may end); each adds the log-prob of
    its duration index. The logits' last axis is ``[tokens | durations]``, blank last token."""
    return _tdt(tuple(int(d) for d in durations))


@memo(maxsize=64)
def _tdt(durations: tuple) -> Topology:
    durations = list(durations)
    if (not durations or any(d < 0 for d in durations) or durations != sorted(set(durations))
            or durations[-1] == 0):
        raise ValueError(f"tdt: durations must be ascending, distinct, >= 0 and include one > 0, "
                         f"got {durations}")
    kinds = [ArcKind(f"label_d{d}", d, 1, "label", duration=i, fastemit=True, delay=True)
             for i, d in enumerate(durations)]
    kinds += [ArcKind(f"blank_d{d}", d, 0, "blank", duration=i, may_end=True)
              for i, d in enumerate(durations) if d > 0]
    return Topology("tdt", tuple(kinds), n_durations=len(durations))


# The topologies named by a string (``rnnt_type``), and a topology as primitives (name,
# durations) for the torch.compile custom op, whose schema cannot carry a dataclass.
_PLAIN = {"regular": regular, "modified": modified, "constrained": constrained,
          "one_sym_per_frame": one_sym_per_frame}
_NAMED = {name: build() for name, build in _PLAIN.items()}   # frozen: one object serves every call
RNNT_TYPES = tuple(_PLAIN)                        # rnnt_loss, rnnt_loss_pruned, the lattice tools
K2_TYPES = ("regular", "modified", "constrained")  # k2's: the simple losses, windows, lattice_loss


def by_name(name, allowed: tuple[str, ...] = RNNT_TYPES, option: str = "rnnt_type") -> Topology:
    """The topology ``name`` among ``allowed`` (a subset of :data:`RNNT_TYPES`); ValueError
    naming ``option`` otherwise."""
    if name not in allowed:
        raise ValueError(f"{option} must be one of {allowed}, got {name!r}")
    return _NAMED[name]


def to_spec(topo: Topology) -> tuple[str, tuple[int, ...]]:
    """``(name, durations)`` of a topology built by this module's builders. The spec is
    checked to rebuild ``topo`` arc for arc (a topology that only borrows a builder's name
    has no spec: ValueError, never another lattice)."""
    spec = None
    if topo.name in _PLAIN:
        spec = topo.name, ()
    elif topo.name == "tdt":
        spec = "tdt", tuple(k.dt for k in topo.kinds if k.reads == "label")
    elif topo.name == "multiblank" and topo.blank is not None:
        spec = "multiblank", tuple(k.dt for k in topo.kinds if k.reads == "class")
    try:
        same = spec is not None and from_spec(spec[0], topo.blank, spec[1]) == topo
    except ValueError:
        same = False
    if not same:
        raise ValueError(f"topology {topo.name!r} has no spec: it is not what the builder of "
                         "that name returns (build it with rnnt_lattice.topology)")
    return spec


def from_spec(name: str, blank: int, durations: tuple) -> Topology:
    """The inverse of :func:`to_spec` (``blank``: the multi-blank standard blank id)."""
    if name == "tdt":
        return tdt(durations)
    if name == "multiblank":
        return multiblank(blank, durations)
    return by_name(name, option="topology")


def check_topology(topology, V: int, blank: int) -> int:
    """A topology against logits with ``V`` entries in the last axis and a blank id
    (negative counts from the end of the token group): the token classes, the blank the
    topology was built for, TDT's blank the last token, the classes its kinds read.
    Returns the blank id in ``[0, V_tok)``."""
    V_tok = V - topology.n_durations              # the tokens before TDT's durations
    name = topology.name
    if V_tok < 1:
        raise ValueError(f"topology {name!r}: the last axis of the logits ({V}) must hold "
                         f"at least one token besides the {topology.n_durations} durations")
    if not -V_tok <= blank < V_tok:
        raise ValueError(f"blank={blank} is out of range for {V_tok} token classes")
    blank = blank % V_tok
    if topology.blank is not None and blank != topology.blank:
        # Its big blanks are the classes below the blank it was built for: with another
        # blank it would be another lattice.
        raise ValueError(f"topology {name!r} was built for blank={topology.blank} (its "
                         f"classes are placed around it), got blank={blank}")
    if topology.n_durations and blank != V_tok - 1:
        # NeMo's layout (docs/variants.md B.2): tokens then durations, the blank the last
        # token.
        raise ValueError(f"topology {name!r}: the blank must be the last token ({V_tok - 1}), "
                         f"got {blank}: the logits' last axis holds V_tok = {V_tok} tokens, "
                         f"then {topology.n_durations} durations ({V} in all); check the blank "
                         f"and the durations")
    for k in topology.kinds:
        if k.reads == "class" and not (k.class_id < V_tok and k.class_id != blank):
            raise ValueError(f"topology {name!r}: kind {k.name!r} reads class {k.class_id}, "
                             f"which must be a token id other than the blank {blank} "
                             f"(V_tok = {V_tok})")
    return blank
