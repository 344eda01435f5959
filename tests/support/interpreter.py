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

Three more shortcuts skip work whose result the interpreter drops or already has (each
below): the integer overflow checks that it computes and never asserts, a table of NumPy
dtypes rebuilt at every operation, and the broadcast of two blocks to the shape they have.
Losses and gradients of the regular, modified and TDT lattices under the interpreter,
forward and backward three times, took 6.2 s of CPU with Triton's own interpreter, 4.0 s
with the first shortcut and 2.1 s with all four (the best of three runs each).
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
    _skip_discarded_overflow_checks(itp)
    _cache_numpy_dtypes(itp)
    _skip_same_shape_broadcasts(itp)
    return True


def _skip_discarded_overflow_checks(itp) -> None:
    """Triton's integer ``+``, ``-`` and ``*`` (``sanitize_overflow``, on in the interpreter's
    options) redo each int32 operation in int64, compare it with the bounds and hand the
    result to ``device_assert``, which returns without looking at it unless ``debug`` is on;
    the interpreter's options never turn it on (Triton 3.5-3.9). So with ``debug`` off the
    check's extra operations (two casts, the operation again, two comparisons and an
    ``and``) are computed and dropped: 4.0 s of CPU against 2.6 s without them on the
    module docstring's lattices. Off where ``debug`` is off: the same values, the same
    asserts (none)."""
    import dataclasses
    builder = getattr(itp, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if (dataclasses.is_dataclass(options) and getattr(options, "sanitize_overflow", False)
            and getattr(options, "debug", True) is False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def _cache_numpy_dtypes(itp) -> None:
    """``_get_np_dtype`` (a Triton dtype's NumPy dtype, asked at every operation) builds its
    table of 14 dtypes at each call (2.6 s against 2.2 s without). The same answers,
    remembered by the dtype's class and name (a pointer type's name names its element
    type); a dtype without a name is asked each time."""
    original = getattr(itp, "_get_np_dtype", None)
    if original is None or getattr(original, "_rnnt_lattice_original", None):
        return
    answers = {}

    def get_np_dtype(tt_dtype):
        name = getattr(tt_dtype, "name", None)
        if not isinstance(name, str):
            return original(tt_dtype)
        key = (type(tt_dtype), name)
        if key not in answers:
            answers[key] = original(tt_dtype)
        return answers[key]

    get_np_dtype._rnnt_lattice_original = original
    itp._get_np_dtype = get_np_dtype


def _skip_same_shape_broadcasts(itp) -> None:
    """Every binary operation broadcasts its operands (``broadcast_impl_value``), and two
    blocks of the same shape are broadcast anyway: Triton compares the shape, a tuple, with
    the broadcast shape, a list, which always differ, so each operand gets a new block type
    and a ``np.broadcast_to`` view of itself (2.2 s against 2.1 s without).
    Operands of one shape are returned as they are, on the interpreter's semantic object
    only (compiled kernels keep Triton's); other shapes take Triton's way."""
    semantic = getattr(itp, "interpreter_semantic", None)
    method = getattr(type(semantic), "broadcast_impl_value", None)
    if method is None or "broadcast_impl_value" in vars(semantic):
        return

    def broadcast_impl_value(lhs, rhs):
        lt, rt = getattr(lhs, "type", None), getattr(rhs, "type", None)
        if (lt is not None and rt is not None and lt.is_block() and rt.is_block()
                and tuple(lt.get_block_shapes()) == tuple(rt.get_block_shapes())):
            return lhs, rhs
        return method(semantic, lhs, rhs)

    semantic.broadcast_impl_value = broadcast_impl_value
