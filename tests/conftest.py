"""Shared pytest options, and the Triton interpreter for the whole session.

``--slow``: the property-based fuzz tests (``test_fuzz.py``) explore many more examples,
with a fresh random seed per run, instead of the bounded, fixed-seed CI budget.
"""
from __future__ import annotations

import os

# The Triton backend runs on CPU tensors through the Triton interpreter, which Triton
# reads when a kernel is decorated: set it before any test module can import triton
# (test_triton.py and test_fuzz.py both run the Triton backend on CPU tensors). Tests that
# need the compiled kernels (test_triton.py::test_cuda_native) start a subprocess without it.
os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ["TRITON_INTERPRET"] == "1":
    # Without the interpreter's redundant work (re-patching triton.language at each call of
    # a @triton.jit helper, overflow checks it never asserts, a dtype table rebuilt at each
    # operation, broadcasts of a block to its own shape; the same values): about a third of
    # its time left, support/interpreter.py
    from support import interpreter as _interpreter
    _interpreter.install()

# Under pytest-xdist (the README's command, ``-n auto``: one worker per core), each worker's
# torch and Numba (its OpenMP layer: the same libgomp) take the cores divided among the
# workers, at least 2 (so that Numba's prange kernels still run on two threads, as users'
# do) and at most the cores; and OpenMP's idle threads sleep instead of spinning. With 2
# cores and 2 workers that is each worker's default of 2 threads, so N workers run 2N
# threads on N cores: spinning, each parallel region would wait for threads that another
# worker has preempted (the default demo's training took 297 s beside another worker,
# against 70 s alone; 107 s with passive waits). Torch, Numba and libgomp read these when
# they start, which is after this file: xdist names the worker before the worker reads any
# conftest. A value the caller set is kept.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _cores = os.cpu_count() or 1
    _threads = str(min(_cores, max(2, _cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))
    for _name, _value in (("OMP_WAIT_POLICY", "PASSIVE"), ("OMP_NUM_THREADS", _threads),
                          ("NUMBA_NUM_THREADS", _threads)):
        os.environ.setdefault(_name, _value)


import pytest  # noqa: E402


@pytest.fixture
def device_checks():
    """The value checks on the device path (``rnnt_lattice.set_input_checks("device")``),
    the CUDA default, for CPU tensors under the Triton interpreter; restored afterwards.
    Skips where that path does not run on CPU tensors (no usable Triton backend: the checks
    stay on the host)."""
    import torch

    from rnnt_lattice import _validate
    if not _validate._device_checks_run_on(torch.device("cpu")):
        pytest.skip("the device checks need the Triton backend under its interpreter")
    before = _validate.set_input_checks("device")
    yield
    _validate.set_input_checks(before)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="explore more: many more fuzz examples, random seed (see test_fuzz.py)")


def pytest_configure(config):
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:           # the fuzz tests skip themselves without hypothesis
        return
    common = dict(deadline=None, print_blob=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    # CI: a fixed seed (derandomize) and no example database, so every run is the same.
    # CI: 300 examples of each property (the loss calls run on three backends, one of them
    # the Triton interpreter: about 0.4 s an example), a fixed seed; --slow explores more.
    settings.register_profile("rnnt-ci", max_examples=300, derandomize=True, database=None, **common)
    settings.register_profile("rnnt-slow", max_examples=4000, **common)
    settings.load_profile("rnnt-slow" if config.getoption("--slow") else "rnnt-ci")
