"""The Triton interpreter without its redundant work at each device-function call.

Under ``TRITON_INTERPRET=1`` Triton runs a kernel launch by patching ``triton.language``'s
builtins to interpreted ones for the launch (``GridExecutor.__call__``: ``_patch_lang`` of
the kernel's module globals, restored at the end), and then again at *every call of a
``@triton.jit`` helper* inside the kernel (``InterpretedFunction.__call__``), where the
same modules are already patched: ``inspect.getmembers`` over ``tl``, ``tl.tensor`` and
``tl.math`` each time, about 0.2 ms a call (Triton 3.5-3.9). Our kernels call helpers in
their loops, so that this took about 30% of the interpreter's time in the tests
(``test_triton_topologies.py``: 190 s with it, 134 without). :func:`install`
skips that patching where it would patch nothing that is not patched already in this
launch: the modules the launch patched, and those a helper's patching added (Triton never
restores those), so the same builtins run either way. The tests
install it (``conftest.py``; ``cuda_checks.py --smoke``, a subprocess); the package never
does. A Triton whose interpreter lacks these names is left as it is. Triton's own
device-function call stays at ``InterpretedFunction._rnnt_lattice_original``.
"""
from __future__ import annotations

import inspect
import threading

_state = threading.local()      # the language modules the running launch patched, per thread


def _langs(fn) -> frozenset:
    """The language modules (``triton.language``, its ``core``) that ``fn``'s module sees,
    which Triton's ``_patch_lang(fn)`` patches."""
    import triton.language as tl
    return frozenset(id(v) for v in fn.__globals__.values()
                     if inspect.ismodule(v) and (v is tl or v is tl.core))


def install() -> bool:
    """Patches Triton's interpreter once; False where it lacks the names this relies on."""
    try:
        from triton.runtime import interpreter as itp
        grid_cls, fn_cls, error = itp.GridExecutor, itp.InterpretedFunction, itp.InterpreterError
    except (ImportError, AttributeError):
        return False
    if hasattr(fn_cls, "_rnnt_lattice_original"):
        return True
    if not (hasattr(fn_cls, "rewrite") and hasattr(itp, "_patch_lang")):
        return False
    grid_call, fn_call = grid_cls.__call__, fn_cls.__call__
    langs = {}                                           # fn -> _langs(fn)

    def of(fn):
        if fn not in langs:
            langs[fn] = _langs(fn)
        return langs[fn]

    def launch(self, *args, **kwargs):
        outer = getattr(_state, "langs", None)
        _state.langs = of(self.fn)
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _state.langs = outer

    def device_call(self, *args, **kwargs):
        patched = getattr(_state, "langs", None)
        if patched is None:
            return fn_call(self, *args, **kwargs)        # outside a launch: as Triton does
        mine = of(self.fn)
        if not mine <= patched:
            # Modules the launch has not patched (Triton's own helpers, tl.max and co., see
            # triton.language.core): Triton patches them now and never restores a helper's
            # patches, so that they stay patched for the rest of the launch
            _state.langs = patched | mine
            return fn_call(self, *args, **kwargs)
        fn = self.rewrite()                              # what fn_call does after patching
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise error(repr(e)) from e

    grid_cls.__call__, fn_cls.__call__ = launch, device_call
    fn_cls._rnnt_lattice_original = fn_call
    return True
