"""Public functions: validate -> pick a backend -> reduce."""
from __future__ import annotations

import torch

from . import _backends, _ops
from ._layout import pack
from ._validate import (FLOAT_RANGES, OURS, Names, check_durations, check_flag, check_float,
                        check_int, check_multiblank_blank, check_pack_logits_args,
                        check_reduction, check_tdt_logits, loss_options)
from .topology import Topology, by_name, multiblank, tdt

__all__ = ["rnnt_loss", "tdt_loss", "multiblank_rnnt_loss", "pack_logits", "empty_cache"]


def rnnt_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int = -1,
    clamp: float = -1.0,
    reduction: str = "mean",
    fused_log_softmax: bool = True,
    *,
    fastemit_lambda: float = 0.0,
    zero_infinity: bool = False,
    backend: str = "auto",
    inplace_grad: bool = False,
    rnnt_type: str = "regular",
    delay_penalty: float = 0.0,
    boundary: torch.Tensor | None = None,
    packed: bool = False,
    allow_blank_targets: bool = False,
) -> torch.Tensor:
    r"""RNN-Transducer loss ``-log P(y|x)`` with its exact gradient.

    A drop-in replacement for ``torchaudio.functional.rnnt_loss``: same positional
    signature, defaults and meaning.

    Example::

        >>> import torch, rnnt_lattice
        >>> B, T, U, V = 2, 10, 4, 8
        >>> logits = torch.randn(B, T, U + 1, V, requires_grad=True)
        >>> targets = torch.randint(1, V, (B, U), dtype=torch.int32)
        >>> logit_lengths = torch.tensor([10, 7], dtype=torch.int32)
        >>> target_lengths = torch.tensor([4, 3], dtype=torch.int32)
        >>> loss = rnnt_lattice.rnnt_loss(logits, targets, logit_lengths, target_lengths, blank=0)
        >>> loss.backward()

    The lattice of sequence ``b`` has frames ``t < T_b = logit_lengths[b]`` and label
    positions ``u <= U_b = target_lengths[b]``; a blank moves ``(t,u) -> (t+1,u)``, the
    label ``y[u]`` moves ``(t,u) -> (t,u+1)``, and every path ends with a blank at
    ``(T_b-1, U_b)``. With ``b``/``e`` the blank/label log-probabilities::

        alpha(t,u) = logaddexp(alpha(t-1,u) + b(t-1,u), alpha(t,u-1) + e(t,u-1))
        loss_b     = -(alpha(T_b-1,U_b) + b(T_b-1,U_b))

    The gradient is fused (no log-softmax tensor is stored):
    ``dloss/dlogits(t,u,v) = p(t,u,v) (gamma_blank + gamma_label) - [v=blank] gamma_blank
    - [v=y_u] gamma_label`` with the arc occupations ``gamma`` (see docs/math.md).

    Args:
        logits: ``(B, T, U+1, V)`` joiner output; float32 or float64 (float16 and bfloat16
            are computed in float32; their gradient comes back in the input dtype and the
            loss in float32). Any strides.
        targets: ``(B, U)`` int32 or int64 label ids; entries past ``target_lengths`` are
            ignored.
        logit_lengths: ``(B,)`` int32 or int64, number of valid frames ``T_b``.
        target_lengths: ``(B,)`` int32 or int64, number of valid labels ``U_b``.
        blank: blank id; negative values count from the end (``-1`` is ``V-1``).
        clamp: any number but NaN. If ``> 0``, every element of the per-sequence gradient
            (w.r.t. logits, or w.r.t. log-probs when ``fused_log_softmax=False``) is clipped
            to ``[-clamp, clamp]`` before the upstream gradient is applied; ``<= 0``: no
            clipping.
        reduction: ``"none"`` -> ``(B,)``, ``"sum"``, or ``"mean"`` (sum / B, as torchaudio;
            0 with a zero gradient for an empty batch, B = 0).
        fused_log_softmax: ``True``: ``logits`` are raw scores and log-softmax is fused in.
            ``False``: ``logits`` already are log-probabilities.
        fastemit_lambda: FastEmit regularisation (Yu et al. 2021), in ``[-1, 1000]``. It changes the
            *gradient*: label arcs get their gradient scaled by ``1 + fastemit_lambda``.
            The returned loss stays the plain ``-log P`` (comparable across lambdas).
        zero_infinity: if ``True``, infinite losses (impossible alignments, e.g.
            ``T_b = 0``) and their gradients are set to 0. Otherwise they give ``+inf``
            with zero gradient. NaN and ``+inf`` logits inside a sequence's lattice make
            that sequence's loss (and gradient) NaN, ``-inf`` logits are masked classes,
            and a sequence whose upstream gradient is 0 gets an exactly zero gradient
            (docs/math.md section 8.1).
        backend: ``"auto"`` (Numba on CPU, Triton on CUDA, PyTorch elsewhere),
            ``"numba"``, ``"torch"`` (the vectorised pure-PyTorch reference) or ``"triton"``
            (CUDA tensors; CPU tensors only under the Triton interpreter, ``TRITON_INTERPRET=1``
            set before the first use).
        inplace_grad: if ``True``, the gradient is written over the logits buffer: no
            gradient-sized allocation, but *the user gives up the logits* (their values are
            gone once the gradient is computed: after the forward pass with Numba, after the
            backward pass otherwise), and ``logits.grad`` (or the gradient flowing into the
            joiner) shares their memory. ``logits`` must be contiguous and float32 or float64
            (also float16/bfloat16 with the Triton backend, which computes them natively),
            else ``ValueError``: any copy would defeat the purpose. Their version counter is
            bumped at each write (the forward's with Numba, and the backward's), so autograd
            refuses a graph node that saved them before a write and a second backward; it
            cannot see a read: nothing may read the logits after the call (with Numba they
            hold other values from the forward on). No effect when no gradient is needed
            (``torch.no_grad``, ``torch.inference_mode``: the logits are left as they are),
            nor under ``torch.compile`` (the compiled graph owns its buffers).
        rnnt_type: the lattice (docs/math.md section 9; the peers' exact semantics in
            docs/variants.md A.2 and C.2): ``"regular"`` (above); k2's ``"modified"``
            (exactly one symbol per frame, a label arc ``(t,u) -> (t+1,u+1)``, no final
            blank; needs ``T_b >= U_b``) and ``"constrained"`` (at most one label per frame:
            the label arc carries ``e(t,u) + b(t,u+1)``; needs ``T_b >= U_b``);
            optimized_transducer's ``"one_sym_per_frame"`` (label arc ``(t,u) ->
            (t+1,u+1)``, mandatory final blank; needs ``T_b >= U_b + 1``). Lengths that
            allow no path give ``+inf`` (or 0 with ``zero_infinity``), never undefined values.
        delay_penalty: k2's delay penalty ``lambda`` in ``[0, 1000]``: label arcs get
            ``lambda * ((T_b - 1)/2 - t)`` added to their log-weight (earlier labels are
            favoured); the returned loss is that of the penalised lattice, as in k2.
        boundary: k2's ``(B, 4)`` int ``[begin_symbol, begin_frame, end_symbol, end_frame]``:
            the path starts at node ``(begin_frame, begin_symbol)`` and ends at
            ``(end_frame, end_symbol)`` (``end_frame`` plays ``T_b``, also in the delay
            penalty); needs ``0 <= begin <= end <= (T_b, U_b)``.
        packed: ``logits`` are packed rows ``(sum_b T_b (U_b+1), V)``, unpadded, in the
            layout of optimized_transducer and warp-rnnt: the rows of sequence ``b`` start
            at ``offset_b = sum_{b' < b} T_b' (U_b'+1)`` and node ``(t, u)`` is row
            ``offset_b + t (U_b+1) + u``. The gradient comes back packed too. Losses and
            gradients equal those of the padded batch. Building the row map reads the
            lengths on the host (one synchronisation on CUDA: ``max T_b`` and the row count,
            which must equal ``logits.shape[0]``). See :func:`pack_logits`.
        allow_blank_targets: a target equal to ``blank`` is an ordinary label: its arc reads
            the blank's log-prob, and its gradient adds to the blank arc's (k2 and fast_rnnt
            compute such labels). By default it is a ``ValueError`` (on CUDA a device-side
            assert), since a label that is the blank is almost always padding read as a
            label.

    Every topology, per-arc term, boundary and layout runs on the same Numba (CPU) and
    Triton (GPU) kernels: one recursion driven by the topology's arc kinds.

    Example of the other topologies::

        >>> import torch, rnnt_lattice
        >>> logits = torch.randn(2, 6, 4, 5, requires_grad=True)             # (B, T, U+1, V)
        >>> targets, T_b, U_b = torch.tensor([[1, 2, 3], [4, 1, 0]]), torch.tensor([6, 4]), torch.tensor([3, 2])
        >>> loss = rnnt_lattice.rnnt_loss(logits, targets, T_b, U_b, blank=0, backend="torch",
        ...                               rnnt_type="modified", delay_penalty=0.1)
        >>> loss.backward()

    Returns:
        The reduced loss (a scalar), or ``(B,)`` per-sequence losses for ``"none"``.

    Raises:
        ValueError: on bad shapes, dtypes, devices, lengths, targets, blank, reduction,
            backend, or a float option outside its range (``_validate.FLOAT_RANGES``: inside
            it every backend gives the same numbers and the same inf/NaN pattern). Checks of
            tensor *values* (lengths, target ids) read CPU inputs on the host; on CUDA they
            are device-side asserts, which keep the path free of host synchronisation
            (docs/api.md, "Bad labels and lengths").

    Notes:
        Under ``torch.compile`` the loss is the custom op ``rnnt_lattice::rnnt_costs_and_grad``
        (``fullgraph=True`` works, on CPU too), float16/bfloat16 logits are upcast to
        float32 first, and the value checks, which have no values while tracing, run when
        the compiled op runs: every check of an eager call, with its messages.

        The Numba backend returns, as the gradient, a buffer its forward pass filled with
        ``exp(logits - max)``: one exp per logit element in total. The gradient is
        computed by kernels, not differentiable operations: a double backward
        (``create_graph=True``, e.g. a gradient penalty) is a RuntimeError.
    """
    return logits_loss(logits, targets, logit_lengths, target_lengths, blank,
                 by_name(rnnt_type), clamp=clamp, reduction=reduction, fused=fused_log_softmax,
                 fastemit_lambda=fastemit_lambda, zero_infinity=zero_infinity, backend=backend,
                 inplace_grad=inplace_grad, delay_penalty=delay_penalty, boundary=boundary,
                 packed=packed, allow_blank_targets=allow_blank_targets)


def tdt_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    *,
    blank: int,
    durations,
    sigma: float = 0.0,
    omega: float = 0.0,
    reduction: str = "mean",
    fastemit_lambda: float = 0.0,
    clamp: float = -1.0,
    zero_infinity: bool = False,
    backend: str = "auto",
    inplace_grad: bool = False,
    packed: bool = False,
) -> torch.Tensor:
    r"""Token-and-Duration Transducer loss (TDT, Xu et al. 2023; NeMo's layout and semantics,
    docs/math.md section 9, docs/variants.md B.2).

    ``logits`` is ``(B, T, U+1, V_tok + D)`` with ``D = len(durations)``: the token part
    (blank included, as the *last* token) and the duration part each get their own fused
    log-softmax. From node ``(t, u)`` a label arc of duration ``d`` (any ``d`` in
    ``durations``, 0 included) goes to ``(t+d, u+1)`` and never lands on frame ``T_b``; a
    blank arc of duration ``d > 0`` goes to ``(t+d, u)``, and the path ends with a blank
    landing exactly on ``(T_b, U_b)``. Each arc weighs its token log-prob plus its duration
    log-prob minus ``sigma``::

        alpha(t,u) = lae over arcs (t',u') -> (t,u) of alpha(t',u') + w(t',u')
        loss_b     = -alpha(T_b, U_b)

    Example::

        >>> import torch, rnnt_lattice
        >>> logits = torch.zeros(1, 3, 2, 4 + 3, requires_grad=True)   # 4 tokens, 3 durations
        >>> loss = rnnt_lattice.tdt_loss(logits, torch.tensor([[0]]), torch.tensor([3]),
        ...                              torch.tensor([1]), blank=3, durations=[0, 1, 2],
        ...                              sigma=0.05, backend="torch")
        >>> round(float(loss.detach()), 6)                              # NeMo's test vector
        4.155739
        >>> loss.backward()

    Args:
        logits, targets, logit_lengths, target_lengths: as :func:`rnnt_loss`, with the
            durations' logits after the tokens in the last axis.
        blank: the blank id, which must be the last token (``V_tok - 1``, or ``-1``).
        durations: strictly ascending frame counts, ``>= 0``, at least one ``>= 1``.
        sigma: logit under-normalisation in ``[0, 1000]``, subtracted once per arc.
        omega: in ``[0, 1]``; with probability ``omega`` per call (drawn from torch's CPU generator, so
            ``torch.manual_seed`` makes it reproducible), the loss is the standard RNN-T
            loss of the token part instead (no durations, no sigma; the durations' gradient
            is 0), as NeMo samples it.
        reduction, fastemit_lambda, clamp, zero_infinity, backend, inplace_grad, packed: as
            :func:`rnnt_loss`. ``clamp`` applies to the token part of the gradient only, and
            FastEmit to the token part of label arcs (NeMo's rules).

    The returned loss is the plain negative log-likelihood of the sigma-weighted lattice,
    also with FastEmit (NeMo reports it multiplied by ``1 + fastemit_lambda``).
    """
    return tdt_loss_named(OURS, logits, targets, logit_lengths, target_lengths, blank=blank,
                          durations=durations, sigma=sigma, omega=omega, reduction=reduction,
                          fastemit_lambda=fastemit_lambda, clamp=clamp,
                          zero_infinity=zero_infinity, backend=backend,
                          inplace_grad=inplace_grad, packed=packed)


def _draw_eagerly(omega: float) -> bool:
    """NeMo's omega: whether this call computes the token logits' RNN-T loss (torch's CPU
    generator, per call)."""
    return float(torch.rand(())) < omega


# The draw picks the loss, per call, on the host: run eagerly inside a compiled function, a
# graph break that says why (fullgraph=True failed on a data-dependent guard; without it
# TorchDynamo printed its own warning of a graph break at Tensor.item()).
_draw = _ops.eager_under_compile(
    _draw_eagerly, "rnnt_lattice's tdt_loss with omega > 0 draws, per call, which loss to "
    "compute (NeMo's omega): a graph break; compile without fullgraph=True, or set omega=0")


def tdt_loss_named(names: Names, logits, targets, logit_lengths, target_lengths, *, blank,
                   durations, sigma, omega, reduction, fastemit_lambda, clamp, zero_infinity,
                   backend, inplace_grad, packed):
    """:func:`tdt_loss`, its messages naming the tensors by ``names`` (a compat module's
    argument names, ``_validate.Names``)."""
    durations = check_durations("durations", durations, minimum=0, ascending=True)
    omega = check_float("omega", omega)
    check_tdt_logits(logits, durations, names.logits)
    if omega > 0.0 and torch.jit.is_tracing():
        raise ValueError("tdt_loss with omega > 0 draws, per call, which loss to compute "
                         "(NeMo's omega): torch.jit.trace would keep the one draw it saw; "
                         "trace with omega=0")
    if omega > 0.0 and _draw(omega):
        # NeMo's omega: the standard RNN-T loss of the token logits for this call.
        V_tok = logits.shape[-1] - len(durations)
        return logits_loss(logits[..., :V_tok], targets, logit_lengths, target_lengths, blank,
                           by_name("regular"), clamp=clamp, reduction=reduction, fused=True,
                           fastemit_lambda=fastemit_lambda, zero_infinity=zero_infinity,
                           backend=backend, inplace_grad=False, packed=packed, names=names)
    return logits_loss(logits, targets, logit_lengths, target_lengths, blank, tdt(durations),
                       clamp=clamp, reduction=reduction, fused=True,
                       fastemit_lambda=fastemit_lambda, zero_infinity=zero_infinity,
                       backend=backend, inplace_grad=inplace_grad, sigma=sigma, packed=packed,
                       names=names)


def multiblank_rnnt_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    *,
    blank: int,
    big_blank_durations,
    sigma: float = 0.0,
    reduction: str = "mean",
    fastemit_lambda: float = 0.0,
    clamp: float = -1.0,
    zero_infinity: bool = False,
    backend: str = "auto",
    inplace_grad: bool = False,
    packed: bool = False,
) -> torch.Tensor:
    r"""Multi-blank transducer loss (Xu et al. 2022; NeMo's layout and semantics).

    ``logits`` is ``(B, T, U+1, V)`` with one softmax over every class: the labels, the big
    blanks and the standard blank ``blank``; the big blank of duration
    ``big_blank_durations[i]`` is class ``blank - 1 - i``. NeMo puts the blank last
    (``blank = V - 1``); ESPnet puts it after the big blanks it inserts at the front of its
    token list (``blank = len(big_blank_durations)``, the labels above it). Besides the
    regular arcs, a big blank of duration ``d`` goes ``(t,u) -> (t+d,u)``; any blank may end
    the path by landing exactly on ``(T_b, U_b)``. Every arc weighs its log-prob minus
    ``sigma``.

    Example::

        >>> import torch, rnnt_lattice
        >>> logits = torch.randn(2, 8, 3, 7, requires_grad=True)     # 4 labels, 2 big blanks, blank
        >>> loss = rnnt_lattice.multiblank_rnnt_loss(
        ...     logits, torch.tensor([[1, 2], [3, 0]]), torch.tensor([8, 5]), torch.tensor([2, 1]),
        ...     blank=6, big_blank_durations=[2, 4], sigma=0.05, backend="torch")
        >>> loss.backward()

    Args:
        blank: the standard blank (NeMo: the last class, ``V - 1`` or ``-1``), with room
            for the big blanks below it and at least one label class besides them.
        big_blank_durations: distinct durations ``>= 2`` (1 is the standard blank), in any
            order: the big blank of ``big_blank_durations[i]`` is class ``blank - 1 - i``.
        sigma, and the rest: as :func:`tdt_loss` / :func:`rnnt_loss`. The targets must not
            use the big blanks' classes.
    """
    return multiblank_rnnt_loss_named(
        OURS, logits, targets, logit_lengths, target_lengths, blank=blank,
        big_blank_durations=big_blank_durations, sigma=sigma, reduction=reduction,
        fastemit_lambda=fastemit_lambda, clamp=clamp, zero_infinity=zero_infinity,
        backend=backend, inplace_grad=inplace_grad, packed=packed)


def multiblank_rnnt_loss_named(names: Names, logits, targets, logit_lengths, target_lengths, *,
                               blank, big_blank_durations, sigma, reduction, fastemit_lambda,
                               clamp, zero_infinity, backend, inplace_grad, packed):
    """:func:`multiblank_rnnt_loss`, its messages naming the tensors by ``names`` (a compat
    module's argument names, ``_validate.Names``)."""
    durations = check_durations("big_blank_durations", big_blank_durations, minimum=2,
                                ascending=False)
    blank = check_int("blank", blank)
    blank_id = check_multiblank_blank(logits, blank, durations, packed, names.logits)
    return logits_loss(logits, targets, logit_lengths, target_lengths, blank,
                       multiblank(blank_id, durations), clamp=clamp, reduction=reduction,
                       fused=True, fastemit_lambda=fastemit_lambda, zero_infinity=zero_infinity,
                       backend=backend, inplace_grad=inplace_grad, sigma=sigma, packed=packed,
                       names=names)


def rnnt_costs_named(names: Names, logits, targets, logit_lengths, target_lengths, blank, *,
                     clamp: float = -1.0, fused: bool = True, fastemit_lambda: float = 0.0,
                     packed: bool = False) -> torch.Tensor:
    """The per-sequence costs ``(B,)`` of :func:`rnnt_loss` (``reduction="none"``, the
    regular lattice, the default backend), its messages naming the tensors by ``names``: a
    compat module's call, with its peer's argument names (``_validate.Names``)."""
    return logits_loss(logits, targets, logit_lengths, target_lengths, blank, by_name("regular"),
                       clamp=clamp, reduction="none", fused=fused,
                       fastemit_lambda=fastemit_lambda, zero_infinity=False, backend="auto",
                       inplace_grad=False, packed=packed, names=names)


def check_options(**options) -> None:
    """The checks of the losses' options that need no tensor (the modules run them at
    construction; each call runs them again): ``blank`` an int, ``reduction``, ``backend``,
    ``rnnt_type``, the durations, the flags bools, and every float option within its range
    (``_validate.FLOAT_RANGES``). Other names are left to the call."""
    checks = {
        "blank": lambda v: check_int("blank", v),
        "reduction": check_reduction,
        "backend": _backends.check_name,
        "rnnt_type": by_name,
        "durations": lambda v: check_durations("durations", v, minimum=0, ascending=True),
        "big_blank_durations": lambda v: check_durations("big_blank_durations", v, minimum=2,
                                                         ascending=False),
        **{flag: (lambda v, flag=flag: check_flag(flag, v))
           for flag in ("fused_log_softmax", "zero_infinity", "inplace_grad", "packed",
                        "allow_blank_targets")},
    }
    for name, value in options.items():
        if name in checks:
            checks[name](value)
        elif name in FLOAT_RANGES:
            check_float(name, value)


def logits_loss(logits, targets, logit_lengths, target_lengths, blank, topology: Topology, *, clamp,
          reduction, fused, fastemit_lambda, zero_infinity, backend, inplace_grad, sigma=0.0,
          delay_penalty=0.0, boundary=None, packed=False, node_rows=None,
          allow_blank_targets=False, names: Names = OURS, device_rules=()):
    """The loss of every entry point on logits: the float options into one
    :class:`LossOptions`, the call prepared once (``_backends.prepare_call``: the backend,
    every check, a packed layout's map), then run (``_ops.run``: the one autograd Function,
    or the custom op while compiling; zero_infinity; the reduction). ``packed``: the logits
    are packed rows; ``node_rows``: a layout's map given directly (the pruned loss), the
    logits being its rows ``(N, V)``. ``names``: how the messages name the tensors (a compat
    module's argument names, ``_validate.Names``); ``device_rules``: the ``(rule, bad (B,))``
    pairs of the caller's own check on the device (the pruned loss's windows), asserted by
    ``_validate.check_call`` after every host rule and their NaN rows added to the call's."""
    traced = torch.compiler.is_compiling()
    fused = check_flag("fused_log_softmax", fused)
    inplace_grad = check_flag("inplace_grad", inplace_grad)
    zero_infinity, packed = check_flag("zero_infinity", zero_infinity), check_flag("packed", packed)
    if packed and traced:
        return _packed_loss(logits, targets, logit_lengths, target_lengths, blank, topology,
                            clamp=clamp, reduction=reduction, fused=fused,
                            fastemit_lambda=fastemit_lambda, zero_infinity=zero_infinity,
                            backend=backend, inplace_grad=inplace_grad, sigma=sigma,
                            delay_penalty=delay_penalty, boundary=boundary, packed=packed,
                            node_rows=node_rows, allow_blank_targets=allow_blank_targets,
                            names=names, device_rules=device_rules)
    check_reduction(reduction)
    opts = loss_options(fused, inplace_grad, topology, clamp, fastemit_lambda, sigma,
                        delay_penalty)
    prep = _backends.prepare_call(logits, targets, logit_lengths, target_lengths, blank, backend,
                                  opts, boundary=boundary, node_rows=node_rows, packed=packed,
                                  traced=traced, allow_blank_targets=allow_blank_targets,
                                  names=names, device_rules=device_rules)
    loss = _ops.run(prep, backend, reduction, zero_infinity)
    if torch.jit.is_tracing() and prep.opts.blank != blank:       # a negative blank, resolved
        loss = _ops.traced_width_only(loss, logits)
    return loss


# A packed layout's row map is built from the lengths read on the host (the rows' count is
# data): under torch.compile the call runs eagerly, a graph break, where TorchDynamo would
# otherwise break at the read, or fail with fullgraph=True on a guard it cannot express.
_packed_loss = _ops.eager_under_compile(
    logits_loss, "rnnt_lattice's losses with packed=True read the lengths on the host to "
    "build the row map: they run eagerly, a graph break; compile without fullgraph=True, "
    "or give padded (B, T, U+1, V) logits")


def pack_logits(logits: torch.Tensor, logit_lengths: torch.Tensor,
                target_lengths: torch.Tensor) -> torch.Tensor:
    """Padded logits ``(B, T, U+1, V)`` -> the packed rows ``(sum_b T_b (U_b+1), V)`` that
    ``packed=True`` takes (the layout of optimized_transducer and warp-rnnt): sequence
    after sequence, frame after frame, the ``U_b + 1`` label positions of each frame.

    Example::

        >>> import torch, rnnt_lattice
        >>> logits = torch.randn(2, 5, 4, 6)                              # (B, T, U+1, V)
        >>> targets = torch.tensor([[1, 2, 3], [4, 5, 0]])
        >>> T_b, U_b = torch.tensor([5, 3]), torch.tensor([3, 2])
        >>> packed = rnnt_lattice.pack_logits(logits, T_b, U_b)            # (5*4 + 3*3, V)
        >>> tuple(packed.shape)
        (29, 6)
        >>> a = rnnt_lattice.rnnt_loss(logits, targets, T_b, U_b, blank=0, reduction="none")
        >>> b = rnnt_lattice.rnnt_loss(packed, targets, T_b, U_b, blank=0, reduction="none",
        ...                            packed=True)
        >>> torch.allclose(a, b)
        True
    """
    check_pack_logits_args(logits, logit_lengths, target_lengths)
    return pack(logits, logit_lengths, target_lengths)


def empty_cache() -> None:
    """Release the gradient buffer and the workspaces that the CPU backend keeps for reuse.

    The Numba backend hands the same large gradient buffer out again once nothing uses it
    any more, so a training loop does not pay the page faults of a fresh buffer in every
    step (like PyTorch's CUDA caching allocator); so it does with a few blocks (at most
    three) for the lattice's own arrays (row statistics, arc weights, alpha, beta,
    occupations) and for ``do_rnnt_pruning``'s rows of lm. Between steps they stay
    allocated: call this to return them to the system (each is freed as soon as nothing
    uses it), or set ``RNNT_LATTICE_CACHE_GRAD=0`` before the first call to turn the reuse
    off. Safe to call at any time; a no-op when the CPU backend was never used.
    """
    _backends.empty_cache()

