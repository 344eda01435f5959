"""Reliability of the CPU (Numba) backend: threads, fork, the kernel cache (issue 11, items 1-4).

docs/api.md, "Reliability", states what these tests hold the backend to. The fork, thread
layer, cache and read-only cases run in subprocesses with timeouts; they reuse the warm
kernel cache of the package under test where they can, so each takes seconds.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

numba = pytest.importorskip("numba")

import rnnt_lattice  # noqa: E402
from rnnt_lattice import cpu  # noqa: E402
from rnnt_lattice.cpu import _config  # noqa: E402

PKG = Path(rnnt_lattice.__file__).resolve().parent       # the package under test
SRC = PKG.parent

# A small problem that runs every CPU kernel of the loss (row pass, lattice, gradient).
PROBLEM = """
import torch, rnnt_lattice
def problem(seed, V=7):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 4, V, generator=g)
    y = torch.randint(1, V, (2, 3), generator=g)
    return x, y, torch.tensor([5, 4]), torch.tensor([3, 2])
def loss_and_grad(seed, backend="numba"):
    x, y, tl, ul = problem(seed)
    x.requires_grad_()
    loss = rnnt_lattice.rnnt_loss(x, y, tl, ul, blank=0, reduction="sum", backend=backend)
    loss.backward()
    return loss.detach(), x.grad
"""


def _env(pythonpath: Path, drop_cache_dir: bool = False, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RNNT_LATTICE_") and k != "NUMBA_THREADING_LAYER"
           and not (drop_cache_dir and k == "NUMBA_CACHE_DIR")}
    env["PYTHONPATH"] = str(pythonpath)
    env.update(extra)
    return env


def _run(script: str, env: dict, timeout: float, prefix=(), first: str = ""
         ) -> subprocess.CompletedProcess:
    code = first + PROBLEM + textwrap.dedent(script)
    try:
        return subprocess.run([*prefix, sys.executable, "-c", code], env=env, timeout=timeout,
                              capture_output=True, text=True)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"subprocess did not finish in {timeout} s (hung?):\n{err.stderr}")


def _last_json(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def warm_kernels():
    """Compile (or load) the kernels in this process, with and without their launch on
    threads, so that the subprocesses below find them in the on-disk cache instead of
    compiling."""
    ns = {}
    exec(PROBLEM, ns)
    ns["loss_and_grad"](0)
    saved = _config.PARALLEL
    _config.PARALLEL = False
    try:
        ns["loss_and_grad"](0)
    finally:
        _config.PARALLEL = saved
    return ns


# --------------------------------------------------------------------------- item 1: threads
# cache -> (a new one, one buffer of at least its MIN_BYTES taken as a NumPy array, the
# functions of the check and the claim)
CACHES = {
    "gradient_buffer": (cpu._BufferCache,
                        lambda c: c.empty((c.MIN_BYTES // 4,), np.float32).numpy(),
                        (cpu._BufferCache.empty,)),
    "workspaces": (cpu._Workspaces,
                   lambda c: c.arrays([((c.MIN_BYTES // 4,), np.float32)] * 2)[1],
                   (cpu._Workspaces.arrays, cpu._Workspaces._claim)),
}


@pytest.mark.parametrize("kind", list(CACHES))
def test_buffer_check_and_claim_is_atomic(kind):
    """Thread A is stopped at each line of the cache's check and claim in turn while
    thread B takes a buffer from the same cache; the two buffers handed out must never
    share memory. (Before the fix, stopping A between the reference-count check and the
    claim handed B the gradient buffer A had.)"""
    new, take, functions = CACHES[kind]
    cache = new()
    take(cache)                               # a free buffer now sits in the cache
    codes = tuple(f.__code__ for f in functions)

    def count_lines():
        n = [0]

        def tracer(frame, event, arg):
            if frame.f_code not in codes:
                return None

            def local(frame, event, arg):
                n[0] += event == "line"
                return local
            return local
        old = sys.gettrace()
        sys.settrace(tracer)
        try:
            t = take(cache)
        finally:
            sys.settrace(old)
        del t
        return n[0]

    n_lines = count_lines()
    assert n_lines >= 3
    for stop_at in range(1, n_lines + 1):
        got = {}
        b = threading.Thread(target=lambda: got.setdefault("b", take(cache)))
        seen = [0]

        def tracer(frame, event, arg):
            if frame.f_code not in codes:
                return None

            def local(frame, event, arg):
                if event == "line":
                    seen[0] += 1
                    if seen[0] == stop_at:
                        b.start()
                        b.join(0.2)             # B blocks here if A holds a lock: fine
                return local
            return local
        old = sys.gettrace()
        sys.settrace(tracer)
        try:
            a = take(cache)
        finally:
            sys.settrace(old)
        b.join(10)
        assert not b.is_alive()
        a_np, b_np = a, got["b"]
        assert not np.shares_memory(a_np, b_np), f"same buffer handed out twice (stop at line {stop_at})"
        del a, got, a_np, b_np


def test_threads_get_their_own_gradients(monkeypatch, warm_kernels):
    """4 threads, each with its own inputs, fast thread switching, every gradient buffer
    and workspace kept: every gradient equals the one computed alone (bounded to ~3 s)."""
    monkeypatch.setattr(cpu._BufferCache, "MIN_BYTES", 0)
    monkeypatch.setattr(cpu._Workspaces, "MIN_BYTES", 0)
    rnnt_lattice.empty_cache()
    step = warm_kernels["loss_and_grad"]
    want = [step(seed) for seed in range(4)]
    errors, counts = [], [0] * 4
    deadline = time.monotonic() + 3.0

    def worker(i):
        try:
            while time.monotonic() < deadline:
                loss, grad = step(i)
                if not (torch.equal(loss, want[i][0]) and torch.equal(grad, want[i][1])):
                    errors.append((i, float((grad - want[i][1]).abs().max())))
                counts[i] += 1
        except BaseException as err:          # noqa: BLE001 - reported below
            errors.append((i, repr(err)))

    old = sys.getswitchinterval()
    sys.setswitchinterval(5e-6)
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(old)
        rnnt_lattice.empty_cache()
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[:5]
    assert min(counts) > 0


def test_concurrent_calls_under_the_workqueue_layer(warm_kernels):
    """Numba's workqueue layer is not thread-safe: concurrent parallel launches abort the
    process ("Concurrent access has been detected") unless they are serialised."""
    script = """
    import sys, threading, numba
    want = [loss_and_grad(i) for i in range(3)]
    assert numba.threading_layer() == "workqueue", numba.threading_layer()
    bad = []
    def worker(i):
        for _ in range(40):
            loss, grad = loss_and_grad(i)
            if not (torch.equal(loss, want[i][0]) and torch.equal(grad, want[i][1])):
                bad.append(i)
    sys.setswitchinterval(5e-6)
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    import json; print(json.dumps({"bad": len(bad)}))
    """
    out = _last_json(_run(script, _env(SRC, NUMBA_THREADING_LAYER="workqueue"), timeout=120))
    assert out["bad"] == 0


# --------------------------------------------------------------------------- item 2: fork
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_loss_in_forked_dataloader_worker(warm_kernels):
    """The parent runs the (parallel) loss, then a DataLoader worker started by fork runs
    it too: it must return the parent's numbers, not die (GNU OpenMP aborts a parallel
    region in a forked child) or hang."""
    script = """
    import json, numba
    from torch.utils.data import DataLoader, Dataset
    want = loss_and_grad(1)
    layer = numba.threading_layer()          # the parent has started its thread pool

    class Losses(Dataset):
        def __len__(self):
            return 2
        def __getitem__(self, i):
            return loss_and_grad(1)

    dl = DataLoader(Losses(), batch_size=None, num_workers=1, multiprocessing_context="fork",
                    timeout=60)
    # The child runs the same kernels in its one thread: the same bits.
    ok = [bool(torch.equal(l, want[0]) and torch.equal(g, want[1])) for l, g in dl]
    print(json.dumps({"ok": ok, "layer": layer}))
    """
    out = _last_json(_run(script, _env(SRC), timeout=120))
    assert out["ok"] == [True, True]


def test_fork_before_the_cpu_backend_loads_and_torch_threads(warm_kernels):
    """Two rules of processes and threads, in one fresh process:

    - A child forked after ``import rnnt_lattice`` but before the CPU backend was loaded
      (the parent ran only torch ops, whose GNU OpenMP region then hangs the child's first
      parallel kernel for good) runs the kernels in its thread: the package's fork hook is
      registered at import. (The hook was the CPU backend's: the child loaded it itself and
      ran the parallel kernels, and a DataLoader worker hung.)
    - The first parallel launch starts Numba's pool, which set this thread's OpenMP count,
      torch's intra-op count: ``torch.set_num_threads(1)`` became 2. It is put back."""
    script = """
    import json, os, sys
    a = torch.randn(300, 300); a @ a                # the parent's torch work (OpenMP)
    loaded = "rnnt_lattice.cpu" in sys.modules
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        from rnnt_lattice.cpu import _config
        os.write(w, b"1" if _config.FORKED else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    child_forked = os.read(r, 1) == b"1"
    before = torch.get_num_threads()                # (read: libgomp's count is then set)
    loss_and_grad(0)                                # the parent's first parallel launch
    print(json.dumps({"loaded_at_import": loaded, "child_forked": child_forked,
                      "torch_threads": [before, torch.get_num_threads()]}))
    """
    # (torch's count set before the package's import, as a script's first lines set it)
    out = _last_json(_run(script, _env(SRC, NUMBA_NUM_THREADS="2"), timeout=120,
                          first="import torch; torch.set_num_threads(1)\n"))
    assert out == {"loaded_at_import": False, "child_forked": True, "torch_threads": [1, 1]}


def _add_one(c0, c1, x):
    for i in numba.prange(c0, c1):
        x[i] += 1.0


def test_a_damaged_cache_file_is_compiled_again(monkeypatch, tmp_path):
    """A kernel's cache file that cannot be read (a truncated index, a damaged data file:
    Numba raised the unpickling error in every call of every process until the file was
    deleted by hand) is compiled again, with one RuntimeWarning naming the folder; the
    index is written anew, and the next process (here a new dispatcher) loads from it."""
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_config, "CACHE", True)
    monkeypatch.setattr(_config, "PARALLEL", False)

    def run():
        kernel = _config.ParallelKernel(_add_one)
        x = np.zeros(3)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            kernel(len(x), x)
        said = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
        assert all(w.filename == __file__ for w in seen), [w.filename for w in seen]
        return x.tolist(), said, sum(kernel.serial.stats.cache_hits.values())

    assert run() == ([1.0] * 3, [], 0)                      # compiled, cached
    assert run() == ([1.0] * 3, [], 1)                      # loaded
    index, = tmp_path.rglob("*serial*.nbi")
    for damage in (lambda: index.write_bytes(index.read_bytes()[:20]),
                   lambda: [f.write_bytes(b"garbage") for f in tmp_path.rglob("*serial*.nbc")]):
        damage()
        x, said, hits = run()
        assert x == [1.0] * 3 and hits == 0 and len(said) == 1, said
        assert "could not read its on-disk cache" in said[0] and str(tmp_path) in said[0]
        assert run() == ([1.0] * 3, [], 1)                  # written anew, loaded
    # A read that fails again after the index was emptied: raised as it is, after one retry
    # (the retry recursed until a RecursionError replaced it).
    import pickle
    from numba.core import caching
    reads = []

    def unreadable(self):
        reads.append(1)
        raise pickle.UnpicklingError("unreadable")
    monkeypatch.setattr(caching.IndexDataCacheFile, "_load_index", unreadable)
    with pytest.raises(pickle.UnpicklingError, match="unreadable"):
        run()
    assert len(reads) == 2


def _doubled(c0, c1, x, out):
    for i in numba.prange(c0, c1):
        out[i] = x[i] * 2


def _chunks(c0, c1, n_chunks, seen):
    for i in numba.prange(c0, c1):
        seen[i] = c0                                # the chunk's first iteration
        if n_chunks[0] < 0:
            raise ValueError("a kernel that fails")
    n_chunks[0] += 0


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_one_build_runs_every_way_and_is_loaded_from_the_cache(monkeypatch, tmp_path, parts):
    """A kernel has one build (``serial``), cached; a call of ``n`` iterations runs them as
    ``min(n, row_parts())`` contiguous chunks on Numba's threads (``_run_chunks``, cached
    per argument types), or as one chunk in this thread where there is one (1 part,
    ``RNNT_LATTICE_NUMBA_PARALLEL=0``, a forked child). A fresh dispatcher (a new process)
    loads both from the cache and compiles nothing. A chunk that fails on a thread is a
    RuntimeError naming the kernel (the exception itself stays in the thread); in this
    thread, the kernel's own exception."""
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_config, "CACHE", True)
    # (row_parts' own rule, 1 in a forked child, is test_cpu_kernels.py's to check; here
    # ``parts`` threads, more than this machine may have)
    monkeypatch.setattr(_config, "row_parts", lambda: 1 if _config.FORKED else parts)

    def run(n, forked=False):
        monkeypatch.setattr(_config, "FORKED", forked)
        kernel = _config.ParallelKernel(_chunks)
        monkeypatch.setattr(_config, "_LAUNCHER", _config._build(
            _config._run_chunks, dict(nogil=True), "launch", parallel=True))
        seen = np.full(n, -1, dtype=np.int64)
        kernel(n, np.zeros(1, dtype=np.int64), seen)
        return seen.tolist(), kernel.serial, _config._LAUNCHER

    for n in (1, 5, 7):
        k = min(n, parts)
        want = [c * n // k for c in range(k) for _ in range(c * n // k, (c + 1) * n // k)]
        seen, build, launch = run(n)
        assert seen == want, (n, parts)
        assert len(build.overloads) == 1 and len(launch.overloads) == (k > 1)
        assert run(n, forked=True)[0] == [0] * n            # one chunk, this thread
    seen, build, launch = run(7)                             # a new process's dispatchers
    assert sum(build.stats.cache_hits.values()) == 1 and not build.stats.cache_misses
    assert sum(launch.stats.cache_hits.values()) == (parts > 1)
    assert not list(tmp_path.rglob("*_chunks__parallel*"))
    assert len(list(tmp_path.rglob("*_chunks__serial*.nbi"))) == 1
    fails = np.array([-1], dtype=np.int64)
    kernel = _config.ParallelKernel(_chunks)
    with pytest.raises(RuntimeError if parts > 1 else ValueError,
                       match="CPU kernel _chunks failed in 2 of the 2 chunks" if parts == 2
                       else "failed in 3 of the 3" if parts == 3 else "a kernel that fails"):
        kernel(7, fails, np.zeros(7, dtype=np.int64))


def test_concurrent_compiles_of_two_specialisations_keep_their_own_files(monkeypatch,
                                                                          tmp_path):
    """Two processes compile one kernel for two argument types at once on an empty cache:
    both read the kernel's index before either writes it. Here, in one process, a kernel
    for int64 saves in full; then one for float64 saves as it would have, having read the
    index before that save, and its index write lost to the int64 one's. With Numba's own
    file naming both took ``.1.nbc``, the float64 machine code was written last under the
    int64 key, and every later process read int64 arrays as float64 (the same size: no
    error; float32 logits against float64 raised ``TypeError`` in every call). Each key
    has its own file: the next process computes both right, loading int64 and compiling
    the float64 one the race dropped from the index. Then an index entry made to name the
    other key's file (a folder merged by hand) is a miss, not the other machine code."""
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_config, "CACHE", True)
    monkeypatch.setattr(_config, "PARALLEL", False)
    ints, floats = np.arange(1, 5, dtype=np.int64), np.arange(1, 5, dtype=np.float64) + 0.5

    def call(kernel, x):
        out = np.zeros(len(x))
        kernel(len(x), x, out)
        return out.tolist()

    def hits(kernel):
        return sum(kernel.serial.stats.cache_hits.values())

    assert call(_config.ParallelKernel(_doubled), ints) == [2.0, 4.0, 6.0, 8.0]
    late = _config.ParallelKernel(_doubled)
    files = late.serial._cache._cache_file
    monkeypatch.setattr(files, "_load_index", lambda: {})    # read before the int64 save
    monkeypatch.setattr(files, "_save_index", lambda overloads: None)  # written over by it
    assert call(late, floats) == [3.0, 5.0, 7.0, 9.0]
    monkeypatch.undo()
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_config, "CACHE", True)
    monkeypatch.setattr(_config, "PARALLEL", False)

    fresh = _config.ParallelKernel(_doubled)
    assert call(fresh, ints) == [2.0, 4.0, 6.0, 8.0] and hits(fresh) == 1      # loaded
    assert call(fresh, floats) == [3.0, 5.0, 7.0, 9.0] and hits(fresh) == 1    # compiled
    assert len(list(tmp_path.rglob("*_doubled__serial*.nbc"))) == 2

    files = fresh.serial._cache._cache_file
    index = files._load_index()
    assert len(index) == 2 and len(set(index.values())) == 2
    (k_int, n_int), (k_float, n_float) = sorted(index.items(), key=lambda kv: "float" in
                                                str(kv[0]))
    files._save_index({k_int: n_float, k_float: n_int})
    swapped = _config.ParallelKernel(_doubled)
    assert call(swapped, ints) == [2.0, 4.0, 6.0, 8.0]
    assert call(swapped, floats) == [3.0, 5.0, 7.0, 9.0] and hits(swapped) == 0


def test_kernels_a_warmup_left_are_read_and_never_written(monkeypatch, tmp_path):
    """``SHIPPED`` (the folder a warm-up filled, read-only at run time) under the place
    Numba writes to: what that place lacks is loaded from it, what neither has is compiled
    into the writable place; with no writable place (``CACHE`` off) it is still read, and
    nothing is written anywhere; a damaged file there is a warning and a compile."""
    monkeypatch.setattr(_config, "PARALLEL", False)
    ints, floats = np.arange(1, 5, dtype=np.int64), np.arange(1, 5, dtype=np.float64) + 0.5

    def call(x, cache_dir, cache, shipped):
        monkeypatch.setattr(numba.config, "CACHE_DIR", str(cache_dir))
        monkeypatch.setattr(_config, "CACHE", cache)
        monkeypatch.setattr(_config, "SHIPPED", shipped)
        kernel = _config.ParallelKernel(_doubled)
        out = np.zeros(len(x))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            kernel(len(x), x, out)
        said = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
        return out.tolist(), sum(kernel.serial.stats.cache_hits.values()), said, kernel

    def files(folder):
        return sorted(f.name for f in folder.rglob("*.nbc"))

    halves, doubled = [3.0, 5.0, 7.0, 9.0], [2.0, 4.0, 6.0, 8.0]
    _, hits, said, kernel = call(floats, tmp_path / "image", True, None)   # the warm-up
    shipped = kernel.serial._cache._cache_path
    assert hits == 0 and said == [] and len(files(tmp_path / "image")) == 1
    before = files(tmp_path / "image")
    # a writable place beside it: loaded from the image, the other type compiled there
    assert call(floats, tmp_path / "home", True, shipped)[:3] == (halves, 1, [])
    assert files(tmp_path / "home") == []
    assert call(ints, tmp_path / "home", True, shipped)[:3] == (doubled, 0, [])
    assert len(files(tmp_path / "home")) == 1
    # no writable place: read, never written
    assert call(floats, tmp_path / "none", False, shipped)[:3] == (halves, 1, [])
    assert call(ints, tmp_path / "none", False, shipped)[:3] == (doubled, 0, [])
    assert files(tmp_path / "image") == before and files(tmp_path / "none") == []
    # a damaged file in the image: one warning naming the folder, then compiled
    for f in (tmp_path / "image").rglob("*.nbc"):
        f.write_bytes(b"garbage")
    out, hits, said, _ = call(floats, tmp_path / "home2", True, shipped)
    assert out == halves and hits == 0 and len(said) == 1
    assert said[0].startswith(f"rnnt_lattice: Numba could not read the CPU kernel cache in "
                              f"{shipped}")


# --------------------------------------------------------------------------- item 3: parallel flag
def _copy_package(dst: Path, with_cache: bool) -> Path:
    """A copy of the package under ``dst``/src; ``copy2`` keeps the source timestamps, so
    Numba's cache index (keyed on them) stays valid for the copied ``__pycache__``."""
    ignore = None if with_cache else shutil.ignore_patterns("__pycache__")
    shutil.copytree(PKG, dst / "src" / PKG.name, ignore=ignore)
    return dst / "src"


def test_parallel_flag_is_honoured_whatever_the_cache_holds(warm_kernels, tmp_path):
    """RNNT_LATTICE_NUMBA_PARALLEL=0 then =1, one process each, sharing one on-disk kernel
    cache: the first must never start Numba's thread pool, the second must, and both give
    the same bits (one build of each kernel serves both; the second also compiles or loads
    the launch on threads)."""
    src = _copy_package(tmp_path, with_cache=True)
    script = """
    import json, numba
    from rnnt_lattice.cpu import kernels
    assert kernels.__file__.startswith(%r), kernels.__file__
    loss, grad = loss_and_grad(0)
    try:
        started = numba.threading_layer()
    except ValueError:
        started = None
    print(json.dumps({"layer": started, "loss": float(loss)}))
    """ % str(src)
    serial = _last_json(_run(script, _env(src, True, RNNT_LATTICE_NUMBA_PARALLEL="0"), 120))
    parallel = _last_json(_run(script, _env(src, True, RNNT_LATTICE_NUMBA_PARALLEL="1"), 120))
    assert serial["layer"] is None, "RNNT_LATTICE_NUMBA_PARALLEL=0 ran a parallel kernel"
    assert parallel["layer"] is not None, "RNNT_LATTICE_NUMBA_PARALLEL=1 ran on no thread"
    assert serial["loss"] == parallel["loss"]                   # one build: the same bits


NOTICE = "rnnt_lattice: compiling the CPU kernels this call needs"


def _notices(proc) -> list:
    """The lines of a subprocess's stderr that announce a compile."""
    return [line for line in proc.stderr.splitlines() if line.startswith(NOTICE)]


def test_first_compile_is_said_once_and_cache_loads_say_nothing(tmp_path):
    """A process whose kernels are not in the on-disk cache logs one line when Numba starts
    compiling the first of them (a WARNING of the ``rnnt_lattice`` logger: without it a
    first call is tens of seconds of silence), whatever it compiles after it (here the
    window DP, then its launch on threads); a process that loads them from the
    cache logs nothing. The window DP alone compiles in about a second."""
    src = _copy_package(tmp_path, with_cache=False)
    script = """
    import json
    from rnnt_lattice.cpu import _config, kernels
    assert kernels.__file__.startswith(%r), kernels.__file__
    occ = torch.rand(2, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    lengths = dict(logit_lengths=torch.tensor([5, 4]), target_lengths=torch.tensor([3, 2]))
    got = [rnnt_lattice.prune_ranges((occ, occ.flip(1)), 2, **lengths).ranges.tolist()]
    _config.PARALLEL = False              # in this thread: the same build, no second line
    got.append(rnnt_lattice.prune_ranges((occ, occ.flip(1)), 2, **lengths).ranges.tolist())
    print(json.dumps({"same": got[0] == got[1]}))
    """ % str(src)
    first = _run(script, _env(src, True), 120)
    assert _last_json(first)["same"]
    # (logging not configured: Python prints the record to stderr)
    assert _notices(first) == [NOTICE + " with Numba (first use: seconds to tens of seconds; "
                               "cached on disk, so later processes load them in under a "
                               "second; `rnnt-lattice warmup` compiles them all ahead of "
                               "time)"], first.stderr
    again = _run(script, _env(src, True), 120)
    assert _last_json(again)["same"] and NOTICE not in again.stderr, again.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_forked_child_runs_its_parents_kernels_and_says_its_own_first_compile(tmp_path):
    """A child forked after its parent compiled a kernel (a DataLoader worker) runs that
    kernel in its one thread with the parent's build: nothing to compile, nothing said
    (before, the child ran serial variants of its own, compiled in each worker with
    seconds of silence). A kernel the parent never used, the child compiles and says so:
    it does not inherit the parent's "said" flag."""
    src = _copy_package(tmp_path, with_cache=False)
    script = """
    import json, os
    from rnnt_lattice.cpu import kernels
    assert kernels.__file__.startswith(%r), kernels.__file__
    occ = torch.rand(2, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    lengths = dict(logit_lengths=torch.tensor([5, 4]), target_lengths=torch.tensor([3, 2]))
    want = rnnt_lattice.prune_ranges((occ, occ.flip(1)), 2, **lengths).ranges.tolist()
    x = torch.randn(2, 5, 4, 6, generator=torch.Generator().manual_seed(1))
    args = (torch.tensor([[1, 2, 3], [4, 5, 0]]), lengths["logit_lengths"],
            lengths["target_lengths"])
    sys.stderr.flush()
    for child_runs in ("prune_ranges", "best_alignment"):
        pid = os.fork()
        if pid == 0:                                  # the child: one thread
            if child_runs == "prune_ranges":
                got = rnnt_lattice.prune_ranges((occ, occ.flip(1)), 2, **lengths)
                ok = got.ranges.tolist() == want
            else:
                ok = rnnt_lattice.best_alignment(x, *args, blank=0).log_prob.isfinite().all()
            sys.stderr.write("CHILD %%s DONE\\n" %% child_runs)
            sys.stderr.flush()
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, child_runs
    print(json.dumps({"children": "ok"}))
    """ % str(src)
    proc = _run(script, _env(src, True), 120, first="import sys\n")
    assert _last_json(proc) == {"children": "ok"}
    said = [ln for ln in proc.stderr.splitlines() if NOTICE in ln or "DONE" in ln]
    assert len(said) == 4 and NOTICE in said[0] and NOTICE in said[2], proc.stderr
    assert said[1] == "CHILD prune_ranges DONE" and said[3] == "CHILD best_alignment DONE"


# --------------------------------------------------------------------------- item 4: read-only
def _unwritable_prefix():
    """The command prefix under which permission bits apply: none for a normal user; for
    root (who ignores them) a user namespace (``unshare -U``), where the process has no
    capability over the host's files."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return ()
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-U", "true"], capture_output=True).returncode == 0:
        return (unshare, "-U")
    pytest.skip("running as root without user namespaces: no way to make a path read-only")


def _run_read_only(script: str, src: Path, home: Path, home_writable: bool, prefix):
    """``script`` in a subprocess with the package copy ``src`` (and ``home``, unless
    ``home_writable``) made read-only, HOME = ``home``, no NUMBA_CACHE_DIR, the serial
    kernels; the write bits are put back afterwards. The process and its last JSON line."""
    paths = [*([] if home_writable else [home]), *src.rglob("*"), src]
    for p in paths:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    env = _env(src, drop_cache_dir=True, HOME=str(home), RNNT_LATTICE_NUMBA_PARALLEL="0")
    env.pop("XDG_CACHE_HOME", None)
    try:
        proc = _run(script, env, timeout=150, prefix=prefix)
        return proc, _last_json(proc)
    finally:
        for p in paths:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)


def test_read_only_install_without_writable_home(tmp_path):
    """Package on a read-only path, HOME read-only, no NUMBA_CACHE_DIR: the loss works
    (``backend="auto"`` and ``"numba"``), with one RuntimeWarning about the cache.

    Nothing can be cached, so the subprocess compiles from scratch: it runs the serial
    kernels (RNNT_LATTICE_NUMBA_PARALLEL=0, several times cheaper to compile) and no
    backward pass. As root the permission bits are enforced through ``unshare -U``."""
    prefix = _unwritable_prefix()
    src = _copy_package(tmp_path, with_cache=False)
    home = tmp_path / "home"
    home.mkdir()
    script = """
    import json, os, warnings
    pkg = os.path.join(%r, "rnnt_lattice", "cpu")
    try:                                      # the condition under test must be real
        open(os.path.join(pkg, "probe"), "w").close()
        writable = True
    except OSError:
        writable = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, y, tl, ul = problem(0)
        auto = rnnt_lattice.rnnt_loss(x, y, tl, ul, blank=0, reduction="none")
        numba_ = rnnt_lattice.rnnt_loss(x, y, tl, ul, blank=0, reduction="none", backend="numba")
        ref = rnnt_lattice.rnnt_loss(x, y, tl, ul, blank=0, reduction="none", backend="torch")
    from rnnt_lattice.cpu import kernels
    print(json.dumps({
        "writable": writable, "file": kernels.__file__,
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        "auto_ok": bool(torch.allclose(auto, ref)), "numba_ok": bool(torch.allclose(numba_, ref))}))
    """ % str(src)
    proc, out = _run_read_only(script, src, home, False, prefix)
    assert not out["writable"], "could not make the package read-only"
    assert out["file"].startswith(str(src))
    assert out["auto_ok"] and out["numba_ok"]
    cache_warnings = [w for w in out["warnings"] if "cache" in w]
    assert len(cache_warnings) == 1, out["warnings"]
    assert cache_warnings[0].startswith("RuntimeWarning") and "NUMBA_CACHE_DIR" in cache_warnings[0]
    # the first compile's one line (a log record, not a warning): every process compiles
    assert _notices(proc) == [NOTICE + " with Numba (first use: seconds to tens of seconds; no "
                              "on-disk cache here, so every process compiles them again; "
                              "`rnnt-lattice warmup` compiles them all ahead of time)"], proc.stderr


@pytest.mark.parametrize("home_writable", [False, True], ids=["no_writable_home", "home"])
def test_a_read_only_install_loads_the_kernels_a_warmup_left(warm_kernels, tmp_path,
                                                              home_writable):
    """The package on a read-only path with the kernels that a warm-up compiled next to it
    (a container image built with ``rnnt-lattice warmup``, an install by another user):
    Numba reads only cache folders it can write, so each process compiled everything
    again (in memory, or into a writable HOME's cache). The kernels are loaded from the
    read-only folder: no compile, no warning, nothing written to HOME, the same values."""
    prefix = _unwritable_prefix()
    src = _copy_package(tmp_path, with_cache=True)
    # The image's build step: a warm-up into the copy's own __pycache__ (it loads what the
    # suite's process left there, warm_kernels; where that process keeps its kernels
    # elsewhere, NUMBA_CACHE_DIR, it compiles them).
    warmup = subprocess.run([sys.executable, "-m", "rnnt_lattice", "warmup", "--only",
                             "rnnt_loss"], env=_env(src, True), capture_output=True,
                            text=True, timeout=300)
    assert warmup.returncode == 0, warmup.stderr
    home = tmp_path / "home"
    home.mkdir()
    script = """
    import json, os, warnings
    pkg = os.path.join(%r, "rnnt_lattice", "cpu")
    try:                                      # the condition under test must be real
        open(os.path.join(pkg, "__pycache__", "probe"), "w").close()
        writable = True
    except OSError:
        writable = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, grad = loss_and_grad(0)
        ref, ref_grad = loss_and_grad(0, backend="torch")
    from rnnt_lattice.cpu import _config, regular
    print(json.dumps({
        "writable": writable, "cache": _config.CACHE, "shipped": _config.SHIPPED,
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        "hits": sum(regular.regular_row_pass.serial.stats.cache_hits.values()),
        "ok": bool(torch.allclose(loss, ref) and torch.allclose(grad, ref_grad, atol=1e-6))}))
    """ % str(src)
    proc, out = _run_read_only(script, src, home, home_writable, prefix)
    assert not out["writable"], "could not make the package read-only"
    assert out["shipped"] == str(src / "rnnt_lattice" / "cpu" / "__pycache__")
    assert out["cache"] is home_writable
    assert out["ok"] and out["warnings"] == [] and out["hits"] == 1
    assert _notices(proc) == [], proc.stderr                   # nothing compiled
    assert not [f for f in home.rglob("*") if f.suffix in (".nbi", ".nbc")]
