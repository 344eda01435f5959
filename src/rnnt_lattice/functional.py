"""Public functions: validate -> pick a backend -> reduce."""
from __future__ import annotations

from dataclasses import replace

import torch

from . import _backends, _ops
from ._types import LossOptions
from ._validate import check_boundary, check_durations, check_float, check_reduction

__all__ = ["rnnt_loss", "tdt_loss", "multiblank_rnnt_loss", "empty_cache"]


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
        clamp: if ``> 0``, every element of the per-sequence gradient (w.r.t. logits, or
            w.r.t. log-probs when ``fused_log_softmax=False``) is clipped to
            ``[-clamp, clamp]`` before the upstream gradient is applied.
        reduction: ``"none"`` -> ``(B,)``, ``"sum"``, or ``"mean"`` (sum / B, as torchaudio;
            0 with a zero gradient for an empty batch, B = 0).
        fused_log_softmax: ``True``: ``logits`` are raw scores and log-softmax is fused in.
            ``False``: ``logits`` already are log-probabilities.
        fastemit_lambda: FastEmit regularisation (Yu et al. 2021), a finite number. It changes the
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
            else ``ValueError``: any copy would defeat the purpose. Autograd refuses, rather
            than silently misusing, any other use of the overwritten logits (their version
            counter is bumped), including a second backward. No effect when no gradient is
            needed, nor under ``torch.compile`` (the compiled graph owns its buffers).
        rnnt_type: the lattice (docs/math.md section 9, exact semantics of the peers in
            variants.md): ``"regular"`` (above); k2's ``"modified"`` (exactly one symbol
            per frame, a label arc ``(t,u) -> (t+1,u+1)``, no final blank; needs
            ``T_b >= U_b``) and ``"constrained"`` (at most one label per frame: the label
            arc carries ``e(t,u) + b(t,u+1)``; needs ``T_b >= U_b``); optimized_transducer's
            ``"one_sym_per_frame"`` (label arc ``(t,u) -> (t+1,u+1)``, mandatory final
            blank; needs ``T_b >= U_b + 1``). Lengths that allow no path give ``+inf`` (or 0
            with ``zero_infinity``), never undefined values.
        delay_penalty: k2's delay penalty ``lambda >= 0``: label arcs get
            ``lambda * ((T_b - 1)/2 - t)`` added to their log-weight (earlier labels are
            favoured); the returned loss is that of the penalised lattice, as in k2.
        boundary: k2's ``(B, 4)`` int ``[begin_symbol, begin_frame, end_symbol, end_frame]``:
            the path starts at node ``(begin_frame, begin_symbol)`` and ends at
            ``(end_frame, end_symbol)`` (``end_frame`` plays ``T_b``, also in the delay
            penalty); needs ``0 <= begin <= end <= (T_b, U_b)``.

    Only the regular lattice without ``delay_penalty`` or ``boundary`` has Numba and Triton
    kernels so far; the others run on the vectorised pure-PyTorch backend (``"auto"`` picks
    it with a one-time ``RuntimeWarning``; naming ``"numba"`` or ``"triton"`` is a
    ``ValueError``).

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
        ValueError: on bad shapes, dtypes, devices, lengths, targets, blank, reduction or
            backend. Checks of tensor *values* (lengths, target ids) run for CPU inputs only,
            to keep the CUDA path free of host synchronisation.

    Notes:
        Under ``torch.compile`` the loss is the custom op ``rnnt_lattice::rnnt_costs_and_grad``
        (``fullgraph=True`` works, on CPU too), float16/bfloat16 logits are upcast to
        float32 first, and the value checks are skipped (see Raises).

        The Numba backend returns, as the gradient, a buffer its forward pass filled with
        ``exp(logits - max)``: one exp per logit element in total. The gradient is an
        ``once_differentiable`` function (no double backward).
    """
    topology = _rnnt_topology(rnnt_type)
    return _loss(logits, targets, logit_lengths, target_lengths, blank, topology,
                 clamp=clamp, reduction=reduction, fused=fused_log_softmax,
                 fastemit_lambda=fastemit_lambda, zero_infinity=zero_infinity, backend=backend,
                 inplace_grad=inplace_grad, delay_penalty=delay_penalty, boundary=boundary)


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
) -> torch.Tensor:
    r"""Token-and-Duration Transducer loss (TDT, Xu et al. 2023; NeMo's layout and semantics,
    docs/math.md section 9, ../variants.md B).

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
        sigma: logit under-normalisation, subtracted once per arc.
        omega: with probability ``omega`` per call (drawn from torch's CPU generator, so
            ``torch.manual_seed`` makes it reproducible), the loss is the standard RNN-T
            loss of the token part instead (no durations, no sigma; the durations' gradient
            is 0), as NeMo samples it.
        reduction, fastemit_lambda, clamp, zero_infinity, backend, inplace_grad: as
            :func:`rnnt_loss`. ``clamp`` applies to the token part of the gradient only, and
            FastEmit to the token part of label arcs (NeMo's rules).

    The returned loss is the plain negative log-likelihood of the sigma-weighted lattice,
    also with FastEmit (NeMo reports it multiplied by ``1 + fastemit_lambda``).
    """
    from . import topology
    durations = check_durations("durations", durations, allow_zero=True)
    omega = check_float("omega", omega, minimum=0.0)
    if omega > 1.0:
        raise ValueError(f"omega must be in [0, 1], got {omega}")
    if isinstance(logits, torch.Tensor) and logits.dim() == 4 and logits.shape[-1] <= len(durations):
        raise ValueError(f"logits {tuple(logits.shape)} must hold V_tok >= 1 token classes before "
                         f"the {len(durations)} durations in the last axis")
    if omega > 0.0 and float(torch.rand(())) < omega:
        # NeMo's omega: the standard RNN-T loss of the token logits for this call.
        V_tok = logits.shape[-1] - len(durations)
        return _loss(logits[..., :V_tok], targets, logit_lengths, target_lengths, blank, None,
                     clamp=clamp, reduction=reduction, fused=True,
                     fastemit_lambda=fastemit_lambda, zero_infinity=zero_infinity,
                     backend=backend, inplace_grad=False)
    return _loss(logits, targets, logit_lengths, target_lengths, blank, topology.tdt(durations),
                 clamp=clamp, reduction=reduction, fused=True, fastemit_lambda=fastemit_lambda,
                 zero_infinity=zero_infinity, backend=backend, inplace_grad=inplace_grad,
                 sigma=sigma)


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
) -> torch.Tensor:
    r"""Multi-blank transducer loss (Xu et al. 2022; NeMo's layout and semantics).

    ``logits`` is ``(B, T, U+1, V)`` with one softmax over every class: the labels, the big
    blanks and the standard blank, which is the last class (``blank = V - 1``); the big
    blank of duration ``big_blank_durations[i]`` is class ``blank - 1 - i``. Besides the
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
        blank: the standard blank, the last class (``V - 1`` or ``-1``).
        big_blank_durations: strictly ascending durations ``>= 2`` (1 is the standard blank).
        sigma, and the rest: as :func:`tdt_loss` / :func:`rnnt_loss`. The targets must not
            use the big blanks' classes.
    """
    from . import topology
    durations = check_durations("big_blank_durations", big_blank_durations, allow_zero=False)
    if durations[0] < 2:
        raise ValueError(f"big_blank_durations must be >= 2 (1 is the standard blank), got "
                         f"{list(durations)}")
    if isinstance(logits, torch.Tensor) and logits.dim() == 4:
        V = logits.shape[-1]
        if isinstance(blank, int) and not isinstance(blank, bool) and -V <= blank < V:
            blank_id = blank % V
            if blank_id != V - 1:
                raise ValueError(f"blank={blank} must be the last class V - 1 = {V - 1} "
                                 f"(NeMo's multi-blank layout)")
            if blank_id < len(durations) + 1:
                raise ValueError(f"logits {tuple(logits.shape)} have no room for "
                                 f"{len(durations)} big blanks and a label before the blank")
            _check_not_big_blank(targets, target_lengths, blank_id, len(durations))
        topo = topology.multiblank(blank % V if isinstance(blank, int) and -V <= blank < V else 0,
                                   durations)
    else:
        topo = topology.multiblank(0, durations)
    return _loss(logits, targets, logit_lengths, target_lengths, blank, topo,
                 clamp=clamp, reduction=reduction, fused=True, fastemit_lambda=fastemit_lambda,
                 zero_infinity=zero_infinity, backend=backend, inplace_grad=inplace_grad,
                 sigma=sigma)


def _check_not_big_blank(targets, target_lengths, blank, n_big):
    """CPU value check: no label may be one of the big blanks' classes."""
    if not (isinstance(targets, torch.Tensor) and isinstance(target_lengths, torch.Tensor)):
        return
    if targets.device.type != "cpu" or targets.dim() != 2 or torch.compiler.is_compiling():
        return
    U = targets.shape[1]
    if U == 0 or target_lengths.shape != (targets.shape[0],):
        return
    valid = torch.arange(U)[None, :] < target_lengths[:, None]
    bad = valid & (targets >= blank - n_big) & (targets < blank)
    if bool(bad.any()):
        b, u = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"targets[{b}, {u}] = {int(targets[b, u])} is a big blank's class "
                         f"({blank - n_big}..{blank - 1}): a label cannot be a blank")


RNNT_TYPES = ("regular", "modified", "constrained", "one_sym_per_frame")


def _rnnt_topology(rnnt_type):
    from . import topology
    if rnnt_type not in RNNT_TYPES:
        raise ValueError(f"rnnt_type must be one of {RNNT_TYPES}, got {rnnt_type!r}")
    return None if rnnt_type == "regular" else getattr(topology, rnnt_type)()


def _loss(logits, targets, logit_lengths, target_lengths, blank, topology, *, clamp, reduction,
          fused, fastemit_lambda, zero_infinity, backend, inplace_grad, sigma=0.0,
          delay_penalty=0.0, boundary=None):
    """validate -> pick a backend -> the one autograd Function (or the custom op while
    compiling) -> zero_infinity -> reduce; shared by every public loss."""
    check_reduction(reduction)
    clamp = check_float("clamp", clamp)
    fastemit_lambda = check_float("fastemit_lambda", fastemit_lambda, finite=True)
    sigma = check_float("sigma", sigma, finite=True)
    delay_penalty = check_float("delay_penalty", delay_penalty, minimum=0.0, finite=True)
    opts = LossOptions(0, bool(fused), clamp, fastemit_lambda, bool(inplace_grad),
                       topology=topology, sigma=sigma, delay_penalty=delay_penalty)
    compiling = torch.compiler.is_compiling()
    n_tokens = None
    if topology is not None and topology.n_durations:
        n_tokens = topology.token_classes(logits.shape[-1]) if logits.dim() == 4 else None
    impl, chk = _backends.prepare(logits, targets, logit_lengths, target_lengths, blank, backend,
                                  traced=compiling, opts=opts, boundary=boundary, n_tokens=n_tokens)
    if topology is not None:
        topology.check(chk.logits.shape[-1], chk.blank)
    boundary = check_boundary(boundary, chk.logits, chk.logit_lengths, chk.target_lengths)
    opts = replace(opts, blank=chk.blank)
    if compiling:
        # The traced path: an opaque custom op (see _ops.py); the backend is resolved when
        # the op runs, outside the trace. inplace_grad has no effect there.
        costs = _ops.rnnt_costs_traced(chk.logits, chk.targets, chk.logit_lengths,
                                       chk.target_lengths, replace(opts, inplace_grad=False),
                                       backend, boundary)
    else:
        if inplace_grad:
            # Checked on what the user passed: any copy (dtype, layout) would defeat it.
            _check_inplace(logits, getattr(impl, "NATIVE_LOW_PRECISION", False))
        costs = _ops.rnnt_costs(impl, chk.logits, chk.targets, chk.logit_lengths,
                                chk.target_lengths, opts, boundary)
    if zero_infinity:
        # torch.where's gradient is 0 for the replaced entries: no host sync, no NaN.
        costs = torch.where(torch.isinf(costs), torch.zeros_like(costs), costs)
    if reduction == "none":
        return costs
    if reduction == "sum" or costs.shape[0] == 0:
        return costs.sum()             # an empty batch: "mean" is 0, like "sum", not 0/0
    return costs.mean()


def _check_inplace(logits: torch.Tensor, native_low_precision: bool) -> None:
    """``inplace_grad=True`` writes the gradient over ``logits``: refuse inputs that would
    be copied first (the gradient would land in the copy)."""
    dtypes = (torch.float32, torch.float64)
    if native_low_precision:
        dtypes += (torch.float16, torch.bfloat16)
    if logits.dtype not in dtypes:
        raise ValueError(
            f"inplace_grad=True needs logits of dtype {' or '.join(str(d) for d in dtypes)} with "
            f"this backend (any other dtype is copied first), got {logits.dtype} logits of shape "
            f"{tuple(logits.shape)}")
    if not logits.is_contiguous():
        raise ValueError(
            f"inplace_grad=True needs contiguous logits (a non-contiguous tensor is copied first), "
            f"got logits of shape {tuple(logits.shape)} with strides {logits.stride()}")


def empty_cache() -> None:
    """Release the gradient buffer that the CPU backend keeps for reuse.

    The Numba backend hands the same large gradient buffer out again once nothing uses it
    any more, so a training loop does not pay the page faults of a fresh buffer in every
    step (like PyTorch's CUDA caching allocator). Between steps that buffer stays
    allocated: call this to return it to the system (it is freed as soon as no tensor
    uses it), or set ``RNNT_LATTICE_CACHE_GRAD=0`` before the first call to turn the reuse
    off. Safe to call at any time; a no-op when the CPU backend was never used.
    """
    import sys

    cpu = sys.modules.get(f"{__package__}.cpu")
    if cpu is not None:
        cpu.empty_cache()

