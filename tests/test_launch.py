"""The Triton backend's launch path (``rnnt_lattice.gpu._launch``), checked without a GPU.

The fast path calls a compiled kernel directly once a call of its *launch class* has gone
through ``JITFunction.run``. Two things make that safe, and both are checked here against
Triton's own code (its binder and cache key for a CUDA sm_90 target, built without a
driver, as ``benchmarks/compile_variants.py`` does):

- the launch class is never coarser than Triton's key: two calls of one class get one
  compiled kernel (every launch of the package's kernels below, and each argument of each
  varied in the ways Triton specialises on);
- the launcher gets what ``JITFunction.run`` would pass it: the bound arguments in signature
  order with the defaults, the grid padded to three, the current stream, the hooks.

On the GPU the same path runs in every kernel check (``rnnt-lattice check --device cuda``);
``RNNT_LATTICE_FAST_LAUNCH=0`` turns it off for an A/B of the host's time.
"""
from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest
import torch

import rnnt_lattice
from support.backends import NO_TRITON

pytestmark = [NO_TRITON, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

SRC = pathlib.Path(rnnt_lattice.__file__).resolve().parent


@pytest.fixture(autouse=True)
def _supported():
    """The installed Triton's ``JITFunction.run`` ends with the launch the fast path makes
    (``_launch.supported``, which also binds ``triton.knobs`` for the launch classes)."""
    from rnnt_lattice.gpu import _launch
    assert _launch.supported()


def _triton():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime import jit as tjit
    return tjit, make_backend(GPUTarget("cuda", 90, 32))


_TWINS: dict = {}


def _twin(kernel):
    """The ``JITFunction`` that ``@triton.jit`` makes of ``kernel`` without the interpreter
    (same function, same specialisation options), one per kernel."""
    from triton.runtime.jit import JITFunction
    if isinstance(kernel, JITFunction):
        return kernel
    if id(kernel) not in _TWINS:
        _TWINS[id(kernel)] = kernel, JITFunction(kernel.fn, **kernel.kwargs)
    return _TWINS[id(kernel)][1]


class _Keys:
    """Triton's compile key and bound arguments of a launch, for a CUDA sm_90 target."""

    def __init__(self):
        self.tjit, self.backend = _triton()
        self.binders = {}

    def _bind(self, twin, args, kw):
        if id(twin) not in self.binders:     # (hashing a JITFunction hashes its source)
            self.binders[id(twin)] = twin, self.tjit.create_function_from_signature(
                twin.signature, twin.params, self.backend)
        return self.binders[id(twin)][1](*args, **kw)

    def __call__(self, twin, args, kw):
        bound, spec, options = self._bind(twin, args, kw)
        return self.tjit.compute_cache_key({}, spec, options), tuple(bound.values())

    def options(self, twin, args, kw):
        """The options Triton compiles the launch with (its backend's parsed options)."""
        return self.backend.parse_options(self._bind(twin, args, kw)[2])


B, T, U, V, H = 2, 5, 3, 7, 4


def _calls():
    """Every launch of a forward+backward of each loss family, the lattice tools and the
    fused losses on the Triton backend (the interpreter, tiny shapes): ``[(kernel, grid,
    args, kw)]``, recorded as they run."""
    from rnnt_lattice import gpu
    from rnnt_lattice.gpu import joint
    calls = []

    def record(kernel, grid, *args, **kw):
        calls.append((kernel, grid, args, kw))
        return kernel[grid](*args, **kw)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, U + 1, V, generator=g, requires_grad=True)
    y = torch.randint(1, V - 3, (B, U), generator=g, dtype=torch.int32)
    tl, ul = torch.tensor([T, T - 1], dtype=torch.int32), torch.tensor([U, U - 1], dtype=torch.int32)
    am = torch.randn(B, T, V, generator=g, requires_grad=True)
    lm = torch.randn(B, U + 1, V, generator=g, requires_grad=True)
    joiner = rnnt_lattice.Joiner(H, H, H, V)
    enc, pred = torch.randn(B, T, H, generator=g), torch.randn(B, U + 1, H, generator=g)
    kw = dict(backend="triton")
    boundary = torch.stack([torch.zeros_like(ul), torch.zeros_like(tl), ul, tl], 1).long()
    from rnnt_lattice import _backends, _validate
    from rnnt_lattice.compat import k2
    resolve = _backends.resolve
    saved = gpu.launch, joint.launch
    gpu.launch = joint.launch = record
    # The CUDA defaults, for CPU tensors: the Triton backend where "auto" is asked for, the
    # input checks on the device.
    _backends.resolve = lambda backend, device: resolve(
        "triton" if backend == "auto" else backend, device)
    checks = _validate.set_input_checks("device")
    try:
        for costs in (
                rnnt_lattice.rnnt_loss(x, y, tl, ul, blank=0, clamp=0.5, **kw),
                rnnt_lattice.rnnt_loss(x, y, tl.long(), ul.long(), blank=0,
                                       rnnt_type="modified", **kw),
                rnnt_lattice.tdt_loss(x, y, tl, ul, blank=V - 3, durations=[0, 1], **kw),
                rnnt_lattice.multiblank_rnnt_loss(x, y, tl, ul, blank=V - 1,
                                                  big_blank_durations=[2], **kw),
                rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, y, tl, ul, blank=0, **kw)):
            costs.sum().backward()
        # the joiner's chunks with the products by cuBLAS (joint.CUBLAS_PRODUCTS)
        cublas, joint.CUBLAS_PRODUCTS = joint.CUBLAS_PRODUCTS, True
        try:
            rnnt_lattice.fused_rnnt_loss(joiner, enc, pred, y, tl, ul, blank=0, **kw).sum().backward()
        finally:
            joint.CUBLAS_PRODUCTS = cublas
        rnnt_lattice.best_alignment(x.detach(), y, tl, ul, blank=0, **kw)
        # k2's pruned recipe: the smoothed loss, k2's ranges, the pruning, the pruned loss.
        simple, (px_grad, py_grad) = k2.rnnt_loss_smoothed(
            lm, am, y.long(), 0, lm_only_scale=0.25, am_only_scale=0.0, boundary=boundary,
            return_grad=True)
        ranges = k2.get_rnnt_prune_ranges(px_grad, py_grad, boundary, 2)
        am_p, lm_p = k2.do_rnnt_pruning(am, lm, ranges)
        pruned = k2.rnnt_loss_pruned(am_p + lm_p, y.long(), ranges, 0, boundary)
        (simple + pruned).backward()
    finally:
        gpu.launch, joint.launch = saved
        _backends.resolve = resolve
        _validate.set_input_checks(checks)
    return calls


@pytest.fixture(scope="module")
def calls():
    return _calls()


def _variants(args):
    """``args`` and, per argument, the values that Triton specialises differently: a tensor
    at an address that is not 16-byte aligned and in another dtype; an integer of each
    class (1, a multiple of 16, neither; 32-bit, 64-bit, unsigned 64-bit); a float of
    another value (1.0, beyond float32's range)."""
    yield args
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            other = {torch.float32: torch.float64, torch.int32: torch.int64}.get(a.dtype, torch.int32)
            for b in (torch.empty(a.numel() + 1, dtype=a.dtype)[1:], torch.empty(a.shape, dtype=other)):
                yield args[:i] + (b,) + args[i + 1:]
        elif type(a) is int:
            for b in (0, 1, 7, 16, 17, 1 << 31, (1 << 31) + 16, 1 << 40, 1 << 63, -16, -1):
                yield args[:i] + (b,) + args[i + 1:]
        elif type(a) is float:
            for b in (0.0, 1.0, -2.5, 1e300, float("inf")):
                yield args[:i] + (b,) + args[i + 1:]


def test_every_launch_goes_through_the_fast_path():
    """No kernel of the backend is launched with ``kernel[grid](...)`` in the package: every
    launch site goes through ``_launch.launch`` (the sites a future change adds too)."""
    direct = []
    for path in sorted((SRC / "gpu").glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"_kernel\[[^\]]*(\[[^\]]*\][^\]]*)*\]\(", line):
                direct.append(f"{path.name}:{n}: {line.strip()}")
    assert not direct, direct


def test_launch_classes_are_never_coarser_than_tritons_keys(calls):
    """Two calls of one launch class have one Triton cache key (so one compiled kernel),
    over every launch recorded and every argument varied in each way Triton specialises."""
    from rnnt_lattice.gpu import _launch
    keys = _Keys()
    seen = {}
    kernels = set()
    n = 0
    for kernel, grid, args, kw in calls:
        twin = _twin(kernel)
        kernels.add(twin.fn.__name__)
        for variant in _variants(args):
            ours = _launch.launch_class(twin, variant, kw)
            assert ours is not None, (twin.fn.__name__, [type(a) for a in variant])
            theirs, _ = keys(twin, variant, kw)
            assert seen.setdefault(ours, theirs) == theirs, (twin.fn.__name__, variant)
            n += 1
    # The launches cover the passes of every loss, the lattice tools and the joiner's.
    assert {"_row_kernel", "_lattice_kernel", "_reads_kernel", "_grad_kernel",
            "_input_check_kernel", "_simple_rows_kernel", "_simple_rows_grad_kernel",
            "_arc_terms_kernel", "_arc_terms_grad_kernel", "_k2_starts_kernel",
            "_rows_sum_kernel", "_joint_row_kernel", "_joint_grad_kernel",
            "_joint_act_grad_kernel", "_joint_hidden_kernel"} <= kernels, kernels
    assert n > 1000


def test_the_launcher_gets_what_triton_would_bind(calls):
    """For every recorded launch, the arguments the fast path passes (the call's positional
    ones, then the keyword ones and the defaults in signature order) are Triton's bound
    arguments, object for object."""
    from rnnt_lattice.gpu import _launch
    keys = _Keys()
    for kernel, grid, args, kw in calls:
        twin = _twin(kernel)
        _, bound = keys(twin, args, kw)
        ours = args + _launch.launch_tail(twin, len(args), kw)
        assert len(ours) == len(bound), twin.fn.__name__
        for a, b in zip(ours, bound):
            assert a is b or (not isinstance(a, torch.Tensor) and a == b), (twin.fn.__name__, a, b)


def test_stated_fp_fusion_compiles_what_tritons_default_compiled(calls, monkeypatch):
    """Every launch states ``enable_fp_fusion=True`` (``_launch.FP_FUSION``): for every
    recorded launch, the options Triton compiles with are those of the launch without it
    under the default the kernels were checked and timed with (fusion on: Triton 3.5 to 3.8,
    and 3.9 with ``TRITON_DEFAULT_FP_FUSION=1``), so the same code; with fusion off
    (Triton 3.10's default) they differ."""
    from rnnt_lattice.gpu import _launch
    assert _launch.FP_FUSION is True
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    compiled_with = _Keys().options
    for kernel, grid, args, kw in calls:
        twin = _twin(kernel)
        stated = compiled_with(twin, args, dict(kw, enable_fp_fusion=_launch.FP_FUSION))
        assert stated == compiled_with(twin, args, kw), twin.fn.__name__
        assert stated != compiled_with(twin, args, dict(kw, enable_fp_fusion=False))


def test_a_register_cap_is_a_launch_option_of_its_own_class(calls):
    """The joiner's blocks may cap registers a thread (``maxnreg``, ``joint.LAUNCH_OPTIONS``):
    Triton's binder takes it as an option, not as an argument (the bound arguments are the
    same), it changes Triton's cache key, and it makes another launch class."""
    from rnnt_lattice.gpu import _launch
    keys = _Keys()
    joiner = [(k, a, kw) for k, _, a, kw in calls if _twin(k).fn.__name__.startswith("_joint_")
              and "num_warps" in kw]
    assert {_twin(k).fn.__name__ for k, _, _ in joiner} >= {"_joint_row_kernel",
                                                              "_joint_grad_kernel"}
    for kernel, args, kw in joiner:
        twin = _twin(kernel)
        capped = dict(kw, maxnreg=128)
        (key, bound), (capped_key, capped_bound) = keys(twin, args, kw), keys(twin, args, capped)
        assert capped_key != key and len(capped_bound) == len(bound), twin.fn.__name__
        assert all(a is b or a == b for a, b in zip(capped_bound, bound)), twin.fn.__name__
        assert _launch.launch_class(twin, args, capped) != _launch.launch_class(twin, args, kw)
        assert _launch.launch_tail(twin, len(args), capped) == _launch.launch_tail(twin, len(args), kw)


class _FakeCompiled:
    """Stands for a ``CompiledKernel``: records the launcher's calls."""

    def __init__(self):
        self.launches = []
        self.function, self.packed_metadata = object(), object()

    def run(self, *a):
        self.launches.append(a)

    def launch_metadata(self, grid, stream, *args):
        return ("meta", grid, stream, len(args))


@pytest.fixture
def fake_kernel(monkeypatch):
    """A ``JITFunction`` of the input check's kernel whose ``run`` (Triton's path) is
    recorded and returns a fake compiled kernel; the device and stream faked."""
    from rnnt_lattice.gpu import _launch, kernels
    twin = _twin(kernels._input_check_kernel)
    compiled = _FakeCompiled()
    slow = []

    def run(*args, grid, warmup, **kw):
        slow.append((grid, args, kw))
        return compiled
    monkeypatch.setattr(twin, "run", run, raising=False)
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(_launch, "_device", lambda: 0)
    monkeypatch.setattr(_launch, "_stream", lambda device: 1234)
    monkeypatch.setattr(_launch, "_classes", {})
    return twin, compiled, slow


def _check_args(calls):
    for kernel, grid, args, kw in calls:
        if getattr(kernel, "fn", kernel).__name__ == "_input_check_kernel":
            return grid, args, kw
    raise AssertionError("no input check recorded")


def test_a_class_compiles_once_then_launches_directly(fake_kernel, calls):
    """The first call of a launch class goes through Triton; the next ones call the
    compiled kernel's launcher with the grid padded to three, the current stream, the
    handle, the packed metadata, the launch metadata, Triton's hooks and the bound
    arguments; a call of another class (a misaligned tensor) goes through Triton again."""
    from triton import knobs
    from rnnt_lattice.gpu import _launch
    twin, compiled, slow = fake_kernel
    grid, args, kw = _check_args(calls)
    assert len(grid) == 1
    _, bound = _Keys()(twin, args, kw)
    assert _launch.launch(twin, grid, *args, **kw) is compiled
    assert len(slow) == 1 and not compiled.launches
    assert slow[0][2] == dict(kw, enable_fp_fusion=True)        # stated: _launch.FP_FUSION
    for _ in range(3):
        assert _launch.launch(twin, grid, *args, **kw) is compiled
    assert len(slow) == 1 and len(compiled.launches) == 3
    a = compiled.launches[-1]
    assert a[:6] == (grid[0], 1, 1, 1234, compiled.function, compiled.packed_metadata)
    assert a[6] == ("meta", grid, 1234, len(bound))
    assert a[7] is knobs.runtime.launch_enter_hook and a[8] is knobs.runtime.launch_exit_hook
    assert len(a[9:]) == len(bound) and all(x is y or x == y for x, y in zip(a[9:], bound))
    i = next(i for i, x in enumerate(args) if isinstance(x, torch.Tensor))
    shifted = torch.empty(args[i].numel() + 1, dtype=args[i].dtype)[1:]
    _launch.launch(twin, grid, *args[:i], shifted, *args[i + 1:], **kw)
    assert len(slow) == 2 and len(compiled.launches) == 3


@pytest.mark.parametrize("why", ["disabled", "interpreted", "list grid", "other type"])
def test_other_calls_take_tritons_path(fake_kernel, calls, monkeypatch, why):
    """Triton's own path, every time and nothing kept: with ``RNNT_LATTICE_FAST_LAUNCH=0``,
    for the interpreter's kernels (the CPU tests), a grid that is not a tuple, an argument
    of a type the launch classes do not know."""
    from rnnt_lattice.gpu import _launch, kernels
    twin, compiled, slow = fake_kernel
    grid, args, kw = _check_args(calls)
    kernel = twin
    if why == "disabled":
        monkeypatch.setattr(_launch, "ENABLED", False)
    elif why == "interpreted":
        kernel = kernels._input_check_kernel
    elif why == "list grid":
        grid = list(grid)
    else:
        i = next(i for i, x in enumerate(args) if type(x) is int)
        args = args[:i] + (np.int64(args[i]),) + args[i + 1:]
    for _ in range(2):
        _launch.launch(kernel, grid, *args, **kw)
    if why != "interpreted":
        assert len(slow) == 2 and all(k == dict(kw, enable_fp_fusion=True) for _, _, k in slow)
    assert not compiled.launches and not _launch._classes


def test_another_triton_takes_its_own_path(fake_kernel, calls, monkeypatch):
    """A Triton whose ``JITFunction.run`` ends otherwise (here: a source without the
    launch of the bound arguments) is not supported, and then every call takes Triton's own
    path, from the first one on."""
    from rnnt_lattice.gpu import _launch
    assert not _launch.supported("def run(self, *args, grid, warmup, **kwargs):\n"
                                 "    kernel.run(grid_0, grid_1, grid_2, stream, *args)\n")
    twin, compiled, slow = fake_kernel
    monkeypatch.setattr(_launch, "_device", None)
    monkeypatch.setattr(_launch, "supported", lambda: False)
    grid, args, kw = _check_args(calls)
    for _ in range(3):
        _launch.launch(twin, grid, *args, **kw)
    assert len(slow) == 3 and not compiled.launches and not _launch.ENABLED


def test_a_class_reads_only_the_knobs_this_triton_has(monkeypatch):
    """The launch class holds the compilation knobs Triton folds into a kernel's options
    where this Triton has them: Triton 3.5 (torch 2.9) has no ``instrumentation_mode``, and
    reading it raised at every launch on a GPU. Without the knobs the class is the same as
    with them at their defaults (None), and a knob's value still tells two classes apart."""
    from types import SimpleNamespace

    from rnnt_lattice.gpu import _launch
    kernel, args = object(), (1, 17, torch.zeros(4))
    runtime = SimpleNamespace(debug=False)
    monkeypatch.setattr(_launch, "_knobs", SimpleNamespace(runtime=runtime,
                                                           compilation=SimpleNamespace()))
    bare = _launch.launch_class(kernel, args, {"BLOCK": 8})
    monkeypatch.setattr(_launch, "_knobs", SimpleNamespace(
        runtime=runtime, compilation=SimpleNamespace(instrumentation_mode=None,
                                                     fpsan_homomorphic_casts=None)))
    assert _launch.launch_class(kernel, args, {"BLOCK": 8}) == bare
    monkeypatch.setattr(_launch, "_knobs", SimpleNamespace(
        runtime=runtime, compilation=SimpleNamespace(instrumentation_mode="consan")))
    assert _launch.launch_class(kernel, args, {"BLOCK": 8}) != bare
