"""warprnnt-numba's ``numba_utils``, answered for this module's losses: whether they run on
CPU and on CUDA tensors here.

warprnnt-numba's README asks its users to test, before a CUDA run, that their Numba can
compile for their CUDA (``numba_cuda_is_supported(__NUMBA_MINIMUM_VERSION__)``). This
module's losses run on rnnt_lattice's kernels (Numba on CPU, Triton on CUDA, PyTorch where
neither imports), so no Numba CUDA is involved: the questions keep their names and
arguments and get the answers that hold for them. ``min_version`` is accepted and not used,
and the strictness of warprnnt-numba's version check is kept (as its environment variable
``STRICT_NUMBA_COMPAT_CHECK`` sets it) but changes no answer: no version is checked.
"""
from __future__ import annotations

import contextlib
import os

import torch

__all__ = ["numba_cpu_is_supported", "numba_cuda_is_supported",
           "skip_numba_cuda_test_if_unsupported", "is_numba_compat_strict",
           "set_numba_compat_strictness", "with_numba_compat_strictness",
           "__NUMBA_MINIMUM_VERSION__", "NUMBA_INSTALLATION_MESSAGE", "import_class_by_path",
           "check_lib_version"]

# warprnnt-numba's names and values (NEMO_NUMBA_MINVER, as there, overrides the default).
__NUMBA_DEFAULT_MINIMUM_VERSION__ = "0.53.0"
__NUMBA_MINIMUM_VERSION__ = os.environ.get("NEMO_NUMBA_MINVER", __NUMBA_DEFAULT_MINIMUM_VERSION__)
STRICT_NUMBA_COMPAT_CHECK = os.environ.get("STRICT_NUMBA_COMPAT_CHECK", "1").lower() in (
    "yes", "true", "t", "1")


# warprnnt-numba's hint for a missing Numba; here Numba is optional (the losses run on the
# PyTorch backend without it), so the hint says that too.
NUMBA_INSTALLATION_MESSAGE = (
    "Could not import `numba`. rnnt_lattice's losses run without it (on the PyTorch "
    "backend, slower on CPU); for its CPU kernels: `pip install numba` (or `conda install "
    "numba`).")


def import_class_by_path(path: str):
    """The attribute named by a dotted path, ``"package.module.Name"`` (warprnnt-numba's
    helper): the module is imported and its attribute returned (a submodule is imported)."""
    import importlib
    module, _, name = path.rpartition(".")
    parent = importlib.import_module(module)
    try:
        return getattr(parent, name)
    except AttributeError:
        return importlib.import_module(path)


def _version(text: str):
    """A version string's leading numbers, ``"0.58.1rc1"`` -> ``(0, 58, 1)``, for ordering
    (``packaging.version.Version`` where it is installed)."""
    try:
        from packaging.version import Version
        return Version(text)
    except ImportError:
        import re
        return tuple(int(n) for n in re.findall(r"\d+", text.split("+")[0])[:3])


def check_lib_version(lib_name: str, checked_version: str, operator):
    """warprnnt-numba's check of an installed library's version: ``(ok, message)`` with
    ``ok`` the result of ``operator(lib.__version__, checked_version)`` compared as
    versions, False when the library has no ``__version__``, None when it is not
    installed (``lib_name`` may be a dotted path: :func:`import_class_by_path`)."""
    import importlib
    try:
        mod = (import_class_by_path(lib_name) if "." in lib_name
               else importlib.import_module(lib_name))
    except ImportError:
        return None, f"{lib_name} is not installed"
    have = getattr(mod, "__version__", None)
    if have is None:
        return False, f"{lib_name} has no __version__: its version cannot be checked"
    if operator(_version(str(have)), _version(checked_version)):
        return True, f"{lib_name} {have} satisfies {operator.__name__} {checked_version}"
    return False, (f"{lib_name} {have} is not {operator.__name__} {checked_version}: upgrade "
                   f"it with pip or conda")


def numba_cpu_is_supported(min_version: str) -> bool:
    """Whether the losses run on CPU tensors: always (without Numba, on the PyTorch
    backend)."""
    return True


def numba_cuda_is_supported(min_version: str) -> bool:
    """Whether the losses run on CUDA tensors here: whether PyTorch sees a CUDA device."""
    return torch.cuda.is_available()


def skip_numba_cuda_test_if_unsupported(min_version: str) -> None:
    """Skip the calling pytest test when :func:`numba_cuda_is_supported` is false."""
    if not numba_cuda_is_supported(min_version):
        import pytest

        pytest.skip("no CUDA device: the CUDA test is skipped")


def is_numba_compat_strict() -> bool:
    """The strictness :func:`set_numba_compat_strictness` set (no answer depends on it)."""
    return STRICT_NUMBA_COMPAT_CHECK


def set_numba_compat_strictness(strict: bool) -> None:
    """Set the strictness of the version check, as in warprnnt-numba; no answer here depends
    on it (no Numba CUDA version is checked)."""
    global STRICT_NUMBA_COMPAT_CHECK
    STRICT_NUMBA_COMPAT_CHECK = strict


@contextlib.contextmanager
def with_numba_compat_strictness(strict: bool):
    """:func:`set_numba_compat_strictness` for a ``with`` block, restored after it."""
    before = is_numba_compat_strict()
    set_numba_compat_strictness(strict)
    try:
        yield
    finally:
        set_numba_compat_strictness(before)
