"""Numba settings for every CPU kernel, in one place, how the kernels are compiled and
launched on threads, and the order in which the row kernels visit the rows
(``frame_ranges``).

Environment overrides (read once, at first use of the CPU backend):
    RNNT_LATTICE_NUMBA_CACHE=0     do not cache compiled kernels on disk
    RNNT_LATTICE_NUMBA_PARALLEL=0  run every kernel in the calling thread (no launch on
                                   Numba's threads)
    RNNT_LATTICE_CACHE_GRAD=0      allocate every gradient buffer and workspace (the lattice's
                                   arrays, do_rnnt_pruning's rows) anew
                                   (no reuse, see cpu/__init__)
The thread count is Numba's: ``numba.set_num_threads`` or ``NUMBA_NUM_THREADS``.

Reliability (docs/api.md, "Reliability"):

- Every kernel is compiled once, without ``parallel=True`` (``ParallelKernel``: its outer
  loop runs the iterations ``[c0, c1)`` it is given), and one small parallel function,
  ``_run_chunks``, runs a kernel's iterations as chunks on Numba's threads, calling the
  kernel's build through its address. ``RNNT_LATTICE_NUMBA_PARALLEL=0`` and forked
  children call the same build in their one thread: nothing of their own to compile.
  (Compiled with ``parallel=True``, each kernel took twice as long to compile, Numba's
  parfor passes running over its whole body, and a second, serial variant had to be
  compiled for the forked children.)
- Only the kernels, ``_run_chunks`` and the helpers called from Python
  (``frame_ranges``) are cached, under names that carry a hash of this package's kernel
  modules (``SOURCES``): Numba keys a cached function on its own source file, so a kernel
  cached before a change to a helper of another module (``fastmath``...) would keep
  running the old helper. The other helpers (``@njit(**JIT)``) are compiled into each
  kernel and not cached on their own.
- Parallel launches are serialised by a lock when the threading layer Numba picked is not
  thread-safe (``workqueue``); with ``omp`` and ``tbb`` threads launch concurrently.
- A forked child process runs the kernels in its one thread, without a launch: GNU OpenMP
  (Numba's ``omp`` layer on Linux, and PyTorch's own) cannot run a parallel region in a
  child forked from a process that has used it, and the child gets one thread of its
  parent anyway.
- A specialisation's cache file is named after its key (``_KernelCacheFile``), so that
  processes compiling one kernel for different types at once cannot write one file for
  two keys, and a loaded file is used only for the signature it was built for.
- Kernels that a warm-up left in the ``__pycache__`` next to these modules (``SHIPPED``)
  are loaded from there where this process cannot write it (a container image, an install
  by another user): Numba itself reads only folders it can write to.
- When no cache directory is writable (read-only install, no writable HOME), the kernels
  are compiled without the on-disk cache (but for ``SHIPPED``'s) and one
  ``RuntimeWarning`` says so where there is no ``SHIPPED``.
- A cache file that cannot be read (truncated, damaged) or written (a full disk) does not
  fail the call: the kernel's index is emptied (``Cache.flush``, rewritten at the next
  save) or its cache turned off for the process, the call compiles it again, and one
  ``RuntimeWarning`` a kernel names the folder and the error (``_uncached``).
- The first parallel launch starts Numba's thread pool, which on the ``omp`` layer sets
  the calling thread's OpenMP thread count, the one PyTorch reports and uses: torch's count
  from before that launch is put back (``_launch``).
- A child forked after ``import rnnt_lattice`` (the package's ``_fork`` hook, which loads
  no Numba) counts as forked even where this module was first imported in the child.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import types
import warnings

import numba
import numpy as np
import torch
from numba import njit, prange
from numba import types as nb_types
from numba.core import caching, event, sigutils
from numba.extending import intrinsic

from .. import _fork
from .._validate import user_stacklevel


def _flag(name: str, default: bool) -> bool:
    return os.environ.get(name, "1" if default else "0").strip().lower() not in ("0", "false", "no", "")


def _cache_error_text():
    """None where Numba finds a writable cache location for the kernels of this package,
    else the error that says why not.

    Numba looks for one when a ``cache=True`` function is created: ``NUMBA_CACHE_DIR`` if
    set, then ``__pycache__`` next to the source, then the user cache dir
    (``~/.cache/numba`` on Linux), and raises ``RuntimeError("cannot cache function ...:
    no locator available")`` when none is writable. This probe is a function of this file,
    which lives next to the kernel modules: same directory, same answer. Nothing is compiled.
    """
    def _probe():                                   # pragma: no cover - never compiled
        return 0
    try:
        njit(cache=True)(_probe)
    except RuntimeError as err:
        return str(err)
    return None


# Compiled kernels go to NUMBA_CACHE_DIR if set, else __pycache__ next to their modules, else
# Numba's user cache dir (~/.cache/numba), so a second process does not recompile; without
# any writable place they are compiled in memory only, but for those that a warm-up left in
# the read-only ``__pycache__`` next to their modules (``SHIPPED``, below).
_WANT_CACHE = _flag("RNNT_LATTICE_NUMBA_CACHE", True)
_NO_PLACE = _cache_error_text() if _WANT_CACHE else None
CACHE = _WANT_CACHE and _NO_PLACE is None
PARALLEL = _flag("RNNT_LATTICE_NUMBA_PARALLEL", True)
CACHE_GRAD = _flag("RNNT_LATTICE_CACHE_GRAD", True)

# Fast-math flags that let LLVM vectorise the row reductions (reassociation) and fuse
# multiply-adds, but keep IEEE semantics for NaN and +-inf: -inf logits (masked classes),
# -inf log-probs of impossible arcs, and NaN propagation are part of the contract, and
# "nnan"/"ninf" would let LLVM fold the checks for them away.
FASTMATH = {"reassoc", "contract", "arcp", "nsz"}

# The helpers' settings; the kernels' add the cache and ``parallel`` (``ParallelKernel``).
JIT = dict(nogil=True, fastmath=FASTMATH)


def sources_hash(package_dir: str) -> str:
    """A short hash of every module of the package in ``package_dir`` but ``__init__``
    (here: the kernels and the helpers compiled into them), "" where they cannot be read."""
    h = hashlib.sha256()
    try:
        for name in sorted(os.listdir(package_dir)):
            if name.endswith(".py") and name != "__init__.py":
                with open(os.path.join(package_dir, name), "rb") as f:
                    h.update(name.encode() + b"\0" + f.read())
    except OSError:
        return ""
    return h.hexdigest()[:12]


SOURCES = sources_hash(os.path.dirname(os.path.abspath(__file__)))


def _shipped_dir():
    """The ``__pycache__`` next to the kernel modules where it holds kernel indexes of
    these sources (a warm-up's, ``rnnt-lattice warmup``), else None. Where this process
    cannot write it (a read-only install, a container image, an install by another user),
    Numba itself never reads it: ``_KernelCache`` loads from it."""
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__pycache__")
    tag = f"_{SOURCES}-" if SOURCES else "__"
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    return folder if any(n.endswith(".nbi") and tag in n for n in names) else None


SHIPPED = _shipped_dir() if _WANT_CACHE else None
if _NO_PLACE is not None and SHIPPED is None:
    warnings.warn(
        f"rnnt_lattice: Numba cannot write its on-disk cache for the CPU kernels "
        f"({_NO_PLACE}); compiling them without the cache (every new process compiles them "
        f"again). Set NUMBA_CACHE_DIR to a writable directory to keep them, or "
        f"RNNT_LATTICE_NUMBA_CACHE=0 to silence this warning.",
        RuntimeWarning, stacklevel=user_stacklevel())


# --------------------------------------------------------------------------- threads, fork
# Set in a forked child (os.register_at_fork below; or before this module was imported,
# by the package's own hook, which ``import rnnt_lattice`` registers): the kernels run in
# the calling thread there.
FORKED = _fork.FORKED

# Serialises parallel launches while the threading layer is unknown (before the first
# launch has started it) and for good when it is one that is not thread-safe.
_launch_lock = threading.Lock()
_launch_serialised = None          # None: not known yet; then True (workqueue) or False


def _layer_thread_safe():
    """True/False for the threading layer Numba started, None if none is started yet."""
    try:
        layer = numba.threading_layer()
    except ValueError:
        return None
    return layer in ("tbb", "omp")  # Numba's docs: workqueue is not thread-safe


def _after_fork_in_child() -> None:
    global FORKED, _launch_lock
    FORKED = True
    _launch_lock = threading.Lock()  # another thread of the parent may have held it
    _CompileNotice.said = False      # the child's own first compile (a kernel the parent
                                     # never ran)


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _launch(kernel, args):
    global _launch_serialised
    if _launch_serialised is False:
        return kernel(*args)
    with _launch_lock:
        if _launch_serialised is None:
            # The first launches: the one that starts Numba's pool sets, on the omp layer,
            # the OpenMP thread count of this thread, which is torch's intra-op count (one
            # libgomp): the user's torch.set_num_threads is put back.
            threads = torch.get_num_threads()
            try:
                out = kernel(*args)
            finally:
                if torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)
        else:
            out = kernel(*args)
        safe = _layer_thread_safe()
        if safe is not None:
            _launch_serialised = not safe
        return out


def _cache_error(err: BaseException) -> str | None:
    """``"load"`` or ``"save"`` when ``err`` was raised while Numba read or wrote its
    on-disk cache (a frame of ``numba/core/caching.py`` in its traceback), else None."""
    tb, where = err.__traceback__, None
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.replace(os.sep, "/").endswith("numba/core/caching.py"):
            where = where or ("save" if "save" in code.co_name else
                              "load" if "load" in code.co_name else None)
        tb = tb.tb_next
    return where


def _uncached(dispatcher, err: BaseException) -> bool:
    """After ``err`` from a call of ``dispatcher``: if Numba failed to read or write its
    on-disk cache, make the next call compile in memory, and say so once; True if so (the
    caller calls again), False for any other error. A file that cannot be read (truncated,
    damaged; Numba raises the unpickling error of the file, every process): the kernel's
    index is emptied (``Cache.flush``: the call compiles it and the save writes a new
    one), or, where even that cannot be written, the cache is off for this process; one
    that cannot be written (a full disk): the cache is off for this process (the compiled
    kernel is in memory)."""
    where = _cache_error(err)
    cache = getattr(dispatcher, "_cache", None)
    if where is None or cache is None or not getattr(cache, "_enabled", True):
        return False
    folder = getattr(cache, "cache_path", None)
    done = "turned off for this process"
    if where == "load":
        try:
            cache.flush()
            done = "emptied; the kernel is compiled again and its cache written anew"
        except Exception:                              # (a read-only folder, a full disk)
            cache.disable()
    else:
        cache.disable()
    warnings.warn(f"rnnt_lattice: Numba could not {'read' if where == 'load' else 'write'} "
                  f"its on-disk cache of the CPU kernel {dispatcher.py_func.__qualname__} in "
                  f"{folder} ({type(err).__name__}: {err}); that kernel's cache was {done}. "
                  f"Deleting that folder's files is always safe (RNNT_LATTICE_NUMBA_CACHE=0 "
                  f"turns the cache off).", RuntimeWarning, stacklevel=user_stacklevel())
    return True


class _KernelCacheFile(caching.IndexDataCacheFile):
    """Numba's index and data files of one kernel, each specialisation's data file named
    after its key (signature, CPU, bytecode) instead of the next number free in the index.

    Numba's own naming lets two processes that compile different specialisations of one
    kernel at once (two dtypes, an empty cache: pytest-xdist workers, ``rnnt-lattice warmup``
    beside a training run) both read the index, both take ``<kernel>.1.nbc``, and leave one
    key in the index pointing at the other one's machine code: every later process then
    loaded it for the wrong types (float32 logits raised ``TypeError: can't unbox array``
    in every call until the files were deleted; a same-size type would have been read as
    the wrong one). Here the two write different files, the data before the index entry
    that names it (a reader never finds an entry without its file), and the worst a race
    does is drop one key from the index: that specialisation is compiled again once
    (docs/api.md, "Compiled-kernel cache")."""

    def __init__(self, cache_path, filename_base, source_stamp):
        super().__init__(cache_path, filename_base, source_stamp)
        self._base = filename_base

    def save(self, key, data):
        name = f"{self._base}.{hashlib.sha256(repr(key).encode()).hexdigest()[:20]}.nbc"
        self._save_data(name, data)
        overloads = self._load_index()
        if overloads.get(key) != name:
            overloads[key] = name
            self._save_index(overloads)


_IN_TREE = getattr(caching, "InTreeCacheLocator", None) or caching._InTreeCacheLocator


class _ShippedLocator(_IN_TREE):
    """``SHIPPED``, the ``__pycache__`` next to the kernels' modules, as a place to read
    only: Numba's own in-tree locator refuses a folder it cannot write to. (Numba's in-tree
    file names and source stamp: the warm-up wrote them there.)"""

    @classmethod
    def from_function(cls, py_func, py_file):
        return cls(py_func, py_file) if SHIPPED is not None else None

    def get_cache_path(self):
        return SHIPPED

    def ensure_cache_path(self):
        pass                                        # never written


class _ShippedImpl(caching.FunctionCache._impl_class):
    _locator_classes = [_ShippedLocator]


class _KernelCache(caching.FunctionCache):
    """Numba's cache of one function, with ``_KernelCacheFile``'s files; then, where the
    place Numba writes to is not ``SHIPPED``, a specialisation that place lacks is loaded
    from ``SHIPPED`` (never written). A loaded specialisation is used only if it is the one
    asked for (else compiled again): a cache folder filled by an older version of this
    class, or merged by hand, can hold a key that names another key's file."""

    read_only = False

    def __init__(self, py_func):
        super().__init__(py_func)
        stamp, base = self._impl.locator.get_source_stamp(), self._impl.filename_base
        self._cache_file = _KernelCacheFile(self._cache_path, base, stamp)
        self._shipped = None
        if not self.read_only and SHIPPED is not None and \
                os.path.realpath(SHIPPED) != os.path.realpath(self._cache_path):
            self._shipped = _KernelCacheFile(SHIPPED, base, stamp)

    def _load_overload(self, sig, target_context):
        cres = super()._load_overload(sig, target_context)
        if cres is None and self._enabled and self._shipped is not None:
            try:
                data = self._shipped.load(self._index_key(sig, target_context.codegen()))
                if data is not None:
                    cres = self._impl.rebuild(target_context, data)
            except Exception as err:                   # noqa: BLE001  (read only: compile)
                warnings.warn(f"rnnt_lattice: Numba could not read the CPU kernel cache in "
                              f"{SHIPPED} ({type(err).__name__}: {err}); compiling the "
                              f"kernel {self._py_func.__qualname__} instead.", RuntimeWarning,
                              stacklevel=user_stacklevel())
                self._shipped = None
        if cres is not None and tuple(cres.signature.args) != \
                tuple(sigutils.normalize_signature(sig)[0]):
            return None
        return cres

    def _save_overload(self, sig, data):
        if not self.read_only:
            super()._save_overload(sig, data)


class _ShippedKernelCache(_KernelCache):
    """``_KernelCache`` where no place is writable: it reads ``SHIPPED`` and writes
    nothing (a kernel missing there is compiled in memory, in every process)."""

    _impl_class = _ShippedImpl
    read_only = True


def _variant(fn, suffix: str):
    """A copy of ``fn`` with its own qualified name: Numba names the cache files of a
    function after its module and qualname, so each build, and each version of the
    package's kernel sources (``SOURCES``), gets its own files."""
    g = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                           fn.__closure__)
    g.__kwdefaults__ = fn.__kwdefaults__
    g.__qualname__ = f"{fn.__qualname__}__{suffix}_{SOURCES}" if SOURCES else \
        f"{fn.__qualname__}__{suffix}"
    g.__doc__, g.__module__ = fn.__doc__, fn.__module__
    return g


def _build(fn, jit, suffix: str, parallel: bool = False):
    """``fn`` as a Numba function with this package's on-disk cache (``_KernelCache``, or
    ``_ShippedKernelCache`` where no place is writable), under ``_variant``'s name."""
    d = njit(**jit, cache=CACHE, parallel=parallel)(_variant(fn, suffix))
    cache = _KernelCache if CACHE else _ShippedKernelCache if SHIPPED else None
    if cache is not None:
        d._cache = cache(d.py_func)
    return d


def cached(fn):
    """A helper that is also called from Python (``frame_ranges``): compiled with the
    kernels' settings and cached on disk like them (a plain ``@njit`` helper is compiled
    into each kernel that calls it, and from Python in every process)."""
    return _build(fn, JIT, "helper")


@intrinsic
def _call_at(typingctx, address, c0, c1, args):
    """``f(c0, c1, *args)`` for the Numba function ``f`` compiled at ``address`` (int64:
    ``_entry``) for exactly these argument types, called with Numba's own calling
    convention, as Numba calls a first-class function through its JIT address: 1 if the
    call ended in an error (an exception: the kernels raise none of their own, but an
    array they cannot allocate raises MemoryError), else 0."""
    types_ = (c0, c1) + tuple(args.types)

    def codegen(context, builder, signature, llargs):
        address_v, c0_v, c1_v, args_v = llargs
        values = [c0_v, c1_v] + [builder.extract_value(args_v, i)
                                 for i in range(len(args.types))]
        fnty = context.call_conv.get_function_type(nb_types.none, types_).as_pointer()
        status, _ = context.call_conv.call_function(
            builder, builder.inttoptr(address_v, fnty), nb_types.none, types_, values)
        return builder.zext(status.is_error, context.get_value_type(nb_types.int64))
    return nb_types.int64(address, c0, c1, args), codegen


def _run_chunks(address, n, k, *args):
    """The one parallel launch of every kernel: the iterations ``[0, n)`` of a kernel's
    outer loop as ``k`` contiguous chunks, one a prange iteration (Numba's static schedule
    gives each thread one, or several in turn when ``k`` exceeds its threads), each a call
    ``f(c0, c1, *args)`` of the kernel's one build (``ParallelKernel``) at ``address``.

    The kernel is called through its address (``_call_at``): its code is not compiled
    into this function, which therefore compiles in about 0.7 s for a kernel's argument
    types, 1.2 s more for the first in a process (a kernel compiled with ``parallel=True``
    took twice its serial compile time: Numba's parfor passes and the outlined copy of its
    whole body, docs/benchmarks.md, "First use"), and an int64 is all the launch unboxes (Numba's
    first-class functions call back into Python twice a launch to unbox theirs: 5-15 us
    more at small shapes). Returns how many chunks ended in an error (``_call_at``)."""
    failed = 0
    for c in prange(k):
        failed += _call_at(address, c * n // k, (c + 1) * n // k, args)
    return failed


def _entry(dispatcher, sig) -> int:
    """The address of ``dispatcher``'s native function for the argument types ``sig``
    (Numba's calling convention; what Numba calls a first-class function's JIT address)."""
    cres = dispatcher.overloads[sig]
    return cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)


def _type_key(args) -> tuple:
    """What Numba's type of each argument depends on, read without Numba: an array's
    dtype, dimensions and flags (contiguity, alignment, writeable), a scalar's Python type
    (the kernels' ints, floats and bools; an ndarray subclass, its class). Two calls with
    one key have one signature: the key is never coarser than Numba's type (its flags
    hold more, OWNDATA: a second key, made once, for the same signature). (Numba's own
    fingerprints, twice as fast, see neither the alignment nor the class.)"""
    return tuple([(a.dtype, a.ndim, a.flags.num) if type(a) is np.ndarray else type(a)
                  for a in args])


class ParallelKernel:
    """A kernel whose outer loop ``for p in prange(c0, c1)`` runs iterations that do not
    depend on each other: the Numba function ``fn(c0, c1, *args)``, compiled once (as
    ``serial``: ``prange`` is ``range`` there) and cached. ``kernel(n, *args)`` runs the
    iterations ``[0, n)``: in ``row_parts()`` contiguous chunks on Numba's threads through
    ``_run_chunks`` (one launch, the chunks run by the same build), or in the calling
    thread as ``serial(0, n, *args)`` where one chunk is all there is, with
    ``RNNT_LATTICE_NUMBA_PARALLEL=0`` and in a forked child.

    One build serves both ways: the serial runs (forked DataLoader workers) load or compile
    nothing of their own, and the parallel launch compiles only ``_run_chunks`` for the
    kernel's signature."""

    def __init__(self, fn, jit=None):
        self.py_func = fn
        self.serial = _build(fn, JIT if jit is None else jit, "serial")
        self._entries: dict = {}                 # _type_key -> _entry address
        self.__name__, self.__qualname__ = fn.__name__, fn.__qualname__
        self.__doc__, self.__module__ = fn.__doc__, fn.__module__

    def __call__(self, n, *args):
        if ON_COMPILE is not None:
            return self._watched(n, args)
        return self._run(n, args)

    def _run(self, n, args):
        k = min(n, row_parts())
        if k <= 1:
            return self._call(self.serial, self.serial, 0, n, *args)
        key = _type_key(args)
        address = self._entries.get(key)
        if address is None:
            address = self._build_for(args, key)
        failed = self._call(_LAUNCHER, _launch, _LAUNCHER, (address, n, k) + args)
        if failed:
            # (Numba keeps no exception from a thread: the type is not known here.)
            raise RuntimeError(
                f"rnnt_lattice: the CPU kernel {self.__name__} failed in {failed} of the {k} "
                f"chunks it ran on threads: it raises nothing of its own, so most likely it "
                f"could not allocate its scratch arrays (out of memory); its outputs are "
                f"incomplete")

    def _build_for(self, args, key) -> int:
        """The ``_entry`` of this call's argument types: the build compiled (or loaded from
        the disk cache) for them, as a call of ``serial`` would; kept under ``key``."""
        sig = tuple(self.serial.typeof_pyval(a) for a in (0, 0) + args)
        self._call(self.serial, self.serial.compile, sig)
        address = _entry(self.serial, sig)
        self._entries[key] = address
        return address

    @staticmethod
    def _call(dispatcher, run, *args):
        """``run(*args)``: a call of ``dispatcher`` (direct, ``_launch``) or its compile;
        once more where Numba failed to read or write its disk cache (``_uncached``)."""
        try:
            return run(*args)
        except Exception as err:
            # (A call that fails before any kernel runs leaves the arguments as they were.)
            if not _uncached(dispatcher, err):
                raise
        # Once: a second failure (of the cache turned off, or emptied and failing again)
        # is raised as it is.
        return run(*args)

    def _watched(self, n, args):
        """The call, reporting to ``ON_COMPILE`` when it made a new specialisation (of the
        kernel's build or of its launch: compiled, or loaded from the disk cache)."""
        import time
        fns = (self.serial, _LAUNCHER)
        sizes = [len(f.overloads) for f in fns]
        hits = [sum(f.stats.cache_hits.values()) for f in fns]
        start = time.perf_counter()
        out = self._run(n, args)
        new = sum(len(f.overloads) - m for f, m in zip(fns, sizes))
        if new:
            loaded = sum(sum(f.stats.cache_hits.values()) - h for f, h in zip(fns, hits))
            dtype = getattr(args[0], "dtype", type(args[0]).__name__)
            ON_COMPILE(self.__name__, "serial" if not PARALLEL or FORKED else "parallel",
                       str(dtype), time.perf_counter() - start, loaded >= new)
        return out

    def __repr__(self):
        return f"<ParallelKernel {self.__module__}.{self.__qualname__}>"


# The launch of every kernel's chunks (compiled, and cached, once per argument types:
# kernels with the same argument types share one).
_LAUNCHER = _build(_run_chunks, dict(nogil=True), "launch", parallel=True)


# ``on_compile(kernel, variant, dtype, seconds, from_cache)``, called after a kernel call
# that made a new specialisation (compiled, or loaded from the disk cache), or None (the
# default: no check on the hot path). ``rnnt-lattice warmup`` sets it to report progress.
ON_COMPILE = None


# --------------------------------------------------------------------------- first compile
_log = logging.getLogger(__name__.split(".")[0])
_PACKAGE = __name__.split(".")[0] + "."


class _CompileNotice(event.Listener):
    """One line when Numba starts compiling a kernel of this package for the first time in
    the process: a WARNING of the ``rnnt_lattice`` logger, which Python prints to stderr
    where logging is not configured. A first compile takes seconds to tens of seconds, and
    without a word a first call looks hung. Numba triggers ``numba:compile`` only after its
    disk cache missed, so a process that loads the kernels from the cache says nothing;
    nor does one while ``ON_COMPILE`` reports (``rnnt-lattice warmup``: a line a kernel).
    A forked child (a DataLoader worker) says its own: it runs the parent's builds, but a
    kernel the parent never ran it compiles."""

    said = False

    def on_start(self, ev):
        if _CompileNotice.said or ON_COMPILE is not None:
            return
        # (every compile in the process comes here, the user's own Numba code's and
        # numba-cuda's too: nothing here may raise)
        data = ev.data if isinstance(ev.data, dict) else {}
        fn = getattr(data.get("dispatcher"), "py_func", None)
        if not (getattr(fn, "__module__", None) or "").startswith(_PACKAGE):
            return
        _CompileNotice.said = True
        kept = ("cached on disk, so later processes load them in under a second" if CACHE
                else f"not in the read-only cache {SHIPPED} and no writable place for one, "
                     f"so every process compiles them again (NUMBA_CACHE_DIR sets one)"
                if SHIPPED else "no on-disk cache here, so every process compiles them again")
        _log.warning("rnnt_lattice: compiling the CPU kernels this call needs with Numba "
                     "(first use: seconds to tens of seconds; %s; `rnnt-lattice warmup` "
                     "compiles them all ahead of time)", kept)

    def on_end(self, ev):
        pass


event.register("numba:compile", _CompileNotice())


def pjit(fn=None, *, strict=False):
    """Decorator of the prange kernels (see ``ParallelKernel``); ``@pjit(strict=True)``:
    without fast-math flags (IEEE order and rounding: the kernels that must reproduce a
    reference's operations one by one, with nothing to vectorise)."""
    jit = dict(JIT, fastmath=False) if strict else None
    if fn is None:
        return lambda f: ParallelKernel(f, jit)
    return ParallelKernel(fn, jit)


# --------------------------------------------------------------------------- row order
# The row kernels (the row and gradient passes) visit the frames (b, t) in memory order,
# i = b T + t, one contiguous range of frames a thread (``frame_ranges``): each thread
# then streams through its part of the logits and of the gradient from start to end. A
# visit in a spread order (row i * stride mod B T, which balanced ragged batches the same
# way) jumped to another frame's rows after each frame, and the hardware prefetcher
# restarted at every jump: the regular loss's row pass took 4.8-5.4 ms at s3 against 3.9
# in memory order, its gradient pass 1.7-2.0 against 1.0-1.6 (docs/benchmarks.md, "The
# row kernels in memory order").

# What a node the kernel only zero-fills (padding) costs, in nodes it reads in full.
PAD_COST = 0.25


def row_parts() -> int:
    """The thread count of a kernel's parallel launch (``ParallelKernel``): the most
    chunks it cuts a kernel's iterations into, and how many contiguous ranges of frames
    (``frame_ranges``) the row kernels' callers cut the frames into, one a chunk; 1 where
    the kernels run in the calling thread (``RNNT_LATTICE_NUMBA_PARALLEL=0``, a forked
    child). Before the first parallel launch the count is Numba's default: asking Numba
    would start its threads here, outside ``_launch``."""
    if not PARALLEL or FORKED:
        return 1
    if _launch_serialised is None:
        try:
            numba.threading_layer()
        except ValueError:                  # not started: it starts with the default count
            return max(1, numba.config.NUMBA_NUM_THREADS)
    return numba.get_num_threads()


@cached
def frame_ranges(parts, t0s, u0s, t1s, u1s, node_rows, T, U1, f0, f1):
    """``bounds`` (n + 1,) int64, n = min(parts, B W) >= 1, over the frames ``f0 <= t < f1``
    of every sequence (W = f1 - f0; a fused tile's frames, else 0 and T): range p of them in
    memory order, ``bounds[p] <= i < bounds[p + 1]`` (frame (b, t) = (i // W, f0 + i % W)),
    the ranges in order and covering every frame of the window, with about equal work. A
    frame's work: each node with a row costs 1 in the region ``t0 <= t < t1, u0 <= u <=
    u1`` and ``PAD_COST`` outside it (zero-filled); ``node_rows`` (B, T, U+1), -1 where a
    node has no row (the packed layout, the pruned loss's windows, a tile), or empty ``(0,
    0, 0)`` where every node has one (the padded layout). Which thread takes which frame
    changes no value."""
    B = t0s.shape[0]
    W = max(0, f1 - f0)
    nf = B * W
    n = max(1, min(parts, nf))
    bounds = np.empty(n + 1, dtype=np.int64)
    cost = np.empty(nf)
    total = 0.0
    rows = node_rows.shape[0] > 0
    for b in range(B):
        t0, u0, t1, u1 = t0s[b], u0s[b], t1s[b], u1s[b]
        for t in range(f0, f0 + W):
            if rows:
                c = 0.0
                fr = node_rows[b, t]
                for u in range(U1):
                    if fr[u] >= 0:
                        c += 1.0 if t >= t0 and t < t1 and u >= u0 and u <= u1 else PAD_COST
            elif t >= t0 and t < t1 and u1 >= u0:
                c = (u1 - u0 + 1) + PAD_COST * (U1 - (u1 - u0 + 1))
            else:
                c = PAD_COST * U1
            cost[b * W + t - f0] = c
            total += c
    # Range p ends after the frame where the work so far reaches p / n of the total.
    bounds[0] = 0
    p = 1
    acc = 0.0
    for i in range(nf):
        acc += cost[i]
        while p < n and acc >= total * p / n:
            bounds[p] = i + 1
            p += 1
    while p <= n:
        bounds[p] = nf
        p += 1
    return bounds


@njit(**JIT)
def frame_at(i, f0, f1):
    """The frame ``(b, t)`` at position ``i`` of the window ``f0 <= t < f1`` of every
    sequence in memory order (``frame_ranges``' ranges index these positions)."""
    W = f1 - f0
    b = i // W
    return b, f0 + i - b * W
