"""Kernel launches without ``JITFunction.run``'s per-launch work.

``kernel[grid](*args, **kw)`` costs 45-60 us of host time a launch on the H100 and H200
machines this project measures on (``benchmarks/gpu_passes.py``'s ``launch_us``), about five
PyTorch operations' worth, whatever the kernel: Triton's binder specialises every argument,
builds the cache key from the specialisation and the options, looks the compiled kernel up,
checks the kernel's global constants and fetches the device and stream, every time. At s3 a
loss's five launches then cost as much as the device's work, and the pruned pipeline's
launches keep the device waiting.

:func:`launch` does that work once per *launch class* and then calls the compiled kernel's
launcher directly (``CompiledKernel.run``, which ``JITFunction.run`` itself ends with):

- **The launch class** of a call is a key that is never coarser than Triton's: per
  positional argument, a tensor's dtype and whether its address is 16-byte aligned; an
  integer's class (equal to 1, divisible by 16, and its width: 32-bit, 64-bit or unsigned
  64-bit); a float or a bool as its type; ``None`` as itself; and the keyword arguments
  (constexprs and launch options) with their values, the device, and the debug and
  instrumentation knobs Triton reads into its options. Two calls of one class get one compiled
  kernel from Triton, whose own key is built from exactly these properties (a shape integer
  that the kernel does not specialise is finer here than there: only more classes, each
  filled once by Triton itself).
- **The first call of a class** goes through ``kernel[grid](...)`` as before (Triton compiles
  or finds the kernel, checks the globals and launches) and keeps the compiled kernel it
  returns.
- **Later calls** pass the same arguments to ``CompiledKernel.run``, in the kernel's signature
  order with its defaults, as ``JITFunction.run`` does, on the current stream of the current
  device, with Triton's launch hooks. What they skip besides the binder: Triton's check that
  the module globals a kernel reads still hold their values (the package's are constants,
  ``tests/test_device_checks.py`` checks them; Triton runs it at each class's first call).

Anything else takes Triton's own path: the Triton interpreter (CPU tensors in the tests), a
stand-in that is not a ``JITFunction`` (``benchmarks/launch_stubs.py``), a callable grid, an
argument of another type, a compile in progress, every call with a Triton whose
``JITFunction.run`` does not end with the launch repeated here (``supported``: checked on
its source once, at the first launch; Triton 3.5.1, 3.6.0, 3.7.1, 3.8.0 and 3.9.0 do), and
every call when the environment sets ``RNNT_LATTICE_FAST_LAUNCH=0`` (read at import; for
an A/B of the two paths).
"""
from __future__ import annotations

import inspect
import os

import torch
from triton.runtime.jit import JITFunction

ENABLED = os.environ.get("RNNT_LATTICE_FAST_LAUNCH", "1") != "0"

# Every launch states floating-point fusion (``a * b + c`` as one FMA) rather than taking
# Triton's default: on by default from Triton 3.5 to 3.8, as the kernels were checked and
# timed; Triton 3.9 warns at a kernel's first compile that its default goes off in 3.10.
FP_FUSION = True

# The end of ``JITFunction.run`` that the fast path repeats, as Triton 3.5.1 to 3.9.0 write it
# (``supported``): with another Triton every call takes Triton's own path.
_RUN_ENDS_WITH = ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, "
                  "kernel.packed_metadata, launch_metadata,",
                  "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, "
                  "*bound_args.values())")
_knobs = None                # triton.knobs, once ``supported`` has found it

_I32_MIN, _I32_MAX, _I64_MAX = -(1 << 31), (1 << 31) - 1, (1 << 63) - 1
_Tensor = torch.Tensor


class _Compiled:
    """One launch class's compiled kernel and what its launcher takes besides the call's
    positional arguments: the handle, the packed metadata, and the values of the kernel's
    parameters after them (keyword arguments, then defaults), in signature order."""
    __slots__ = ("jit", "kernel", "run", "function", "packed", "tail")

    def __init__(self, jit, kernel, tail: tuple):
        self.jit, self.kernel, self.tail = jit, kernel, tail
        self.run, self.function, self.packed = kernel.run, kernel.function, kernel.packed_metadata


_classes: dict = {}
_device = _stream = None     # Triton's driver's current device and stream (bound on first use)


def launch_tail(kernel, n_args: int, kw: dict) -> tuple:
    """The values of ``kernel``'s parameters after the first ``n_args``: from ``kw``, else
    their defaults (what Triton's binder fills in)."""
    params = list(kernel.signature.parameters.values())[n_args:]
    return tuple(kw[p.name] if p.name in kw else p.default for p in params)


def launch_class(kernel, args: tuple, kw: dict):
    """The launch class of ``kernel``'s call with ``args`` and ``kw`` on any one device
    (module docstring), or None where the call takes Triton's own path. One loop without a
    call per argument: it runs at every launch (about 5 us for 40 arguments on this
    project's CPU machine, against 45-60 us for ``JITFunction.run`` on a GPU machine's)."""
    out = []
    add = out.append
    for a in args:
        t = type(a)
        if t is int:        # 1; else the width (i32, i64, u64) and divisibility by 16
            add(1 if a == 1 else (2 if _I32_MIN <= a <= _I32_MAX else 3 if a <= _I64_MAX else 4)
                + (0 if a & 15 else 8))
        elif isinstance(a, _Tensor):
            add((a.dtype, not a.data_ptr() & 15))
        elif t is float or t is bool or a is None:
            add(t)
        else:
            return None
    # The kernel by identity: hashing a JITFunction hashes its source's dependencies. The
    # class's entry keeps the kernel alive (``_Compiled.jit``), so its id is not reused.
    # (Each compilation knob read where this Triton has it: 3.5 has neither of these two,
    # and reading one raised at every launch there.)
    comp = _knobs.compilation
    return (id(kernel), tuple(out), tuple(kw.items()), _knobs.runtime.debug,
            getattr(comp, "instrumentation_mode", None),
            getattr(comp, "fpsan_homomorphic_casts", None))


def supported(source: str | None = None) -> bool:
    """Whether this Triton's ``JITFunction.run`` ends with the launch the fast path makes
    (``_RUN_ENDS_WITH``, whitespace aside: the bound arguments in signature order, the
    launch hooks from ``triton.knobs``). ``source``: that function's source (default: read
    from the installed Triton; an install without sources is not supported)."""
    global _knobs
    try:
        if source is None:
            source = inspect.getsource(JITFunction.run)
        from triton import knobs
    except (ImportError, OSError, TypeError):
        return False
    flat = " ".join(source.split())
    if not all(part in flat for part in _RUN_ENDS_WITH):
        return False
    _knobs = knobs
    return True


def launch(kernel, grid, *args, **kw):
    """``kernel[grid](*args, **kw)``, through the launch class's compiled kernel once
    Triton has compiled it (module docstring), with ``enable_fp_fusion=FP_FUSION`` unless
    ``kw`` says otherwise."""
    global _device, _stream, ENABLED
    kw.setdefault("enable_fp_fusion", FP_FUSION)
    if not ENABLED or type(kernel) is not JITFunction or type(grid) is not tuple:
        return kernel[grid](*args, **kw)
    if _device is None:
        if not supported():
            ENABLED = False
            return kernel[grid](*args, **kw)
        from triton.runtime.driver import driver
        _device, _stream = driver.active.get_current_device, driver.active.get_current_stream
    cls = launch_class(kernel, args, kw)
    if cls is None:
        return kernel[grid](*args, **kw)
    device = _device()
    key = (device, cls)
    try:
        hit = _classes.get(key)
    except TypeError:           # a keyword argument's value that cannot be hashed
        return kernel[grid](*args, **kw)
    if hit is None:
        compiled = kernel[grid](*args, **kw)
        if compiled is not None and not hasattr(compiled, "result"):
            _classes[key] = _Compiled(kernel, compiled, launch_tail(kernel, len(args), kw))
        return compiled
    # What JITFunction.run ends with, on the arguments it would have bound.
    stream = _stream(device)
    full = args + hit.tail
    n = len(grid)
    hit.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, hit.function,
            hit.packed, hit.kernel.launch_metadata(grid, stream, *full),
            _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook, *full)
    return hit.kernel
