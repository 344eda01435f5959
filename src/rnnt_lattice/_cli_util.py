"""What the command line, the demo and the benchmark scripts share: output-path checks made
before any work is done, and the one thread setter."""
from __future__ import annotations

import os

import torch


def check_output_file(path: str, option: str) -> None:
    """Raise ``ValueError`` (one line for the user) unless a file can be written at ``path``:
    checked before any work is done, so that a long run does not fail at its very end."""
    if os.path.isdir(path):
        raise ValueError(f"{option} {path!r} is a directory, expected a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        ancestor = parent
        while not os.path.exists(ancestor):
            ancestor = os.path.dirname(ancestor)
        if not os.path.isdir(ancestor):
            raise ValueError(f"{option} {path!r}: {ancestor!r} is a file, not a directory")
        raise ValueError(f"{option} {path!r}: the directory {parent!r} does not exist")
    if not os.path.isdir(parent):
        raise ValueError(f"{option} {path!r}: {parent!r} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path!r}: the directory {parent!r} is not writable")


def check_output_dir(path: str, option: str) -> None:
    """Raise ``ValueError`` unless ``path`` is, or can be created as, a writable folder
    (creates it)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{option} {path!r} is an existing file, expected a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{option} {path!r}: cannot create the folder ({err.strerror or err})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path!r}: the folder is not writable")


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1 (argparse says the option's name with the
    message)."""
    import argparse
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {n}")
    return n


def set_threads(n: int) -> int:
    """The one thread setter (the demo and benchmarks/): intra-op
    threads for Numba, if it is installed (capped at the pool it started with), and torch.
    Numba first: on its OpenMP threading layer (the same libgomp as torch's)
    ``numba.set_num_threads`` resets the OpenMP count torch reports and uses. Call it again
    before each provider where one may change them process-wide (warprnnt-numba and NeMo
    set Numba's to 1 on every call). Returns ``n``."""
    try:
        import numba
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass
    torch.set_num_threads(n)
    return n


def threads_said(n: int) -> str:
    """How many threads :func:`set_threads` gave, for a log line: ``"2 thread(s)"``, with
    Numba's own count where ``NUMBA_NUM_THREADS`` capped it, and a note where ``n`` is more
    than the machine's cores (the threads then take turns: slower, not faster)."""
    words = f"{n} thread(s)"
    try:
        import numba
        cap = numba.config.NUMBA_NUM_THREADS
        if cap < n:
            words += f" (Numba's: {cap}, NUMBA_NUM_THREADS)"
    except ImportError:
        pass
    cores = os.cpu_count() or 1
    if n > cores:
        words += f", more than the {cores} core(s) here (they take turns: slower)"
    return words
