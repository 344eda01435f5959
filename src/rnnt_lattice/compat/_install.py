"""What every ``install()`` of the compat modules shares: its ``with`` form."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sized


@contextlib.contextmanager
def scoped(saved: Sized, install: Callable[[], object],
           uninstall: Callable[[], None]) -> Iterator[None]:
    """``install()`` for the length of a ``with`` block, then ``uninstall()``, unless it was
    already installed before the block. ``saved`` is the module's record of what its
    ``install()`` replaced: empty exactly when nothing is installed."""
    fresh = not saved
    install()
    try:
        yield
    finally:
        if fresh:
            uninstall()
