"""Checks for tests/test_check.py's run in worker processes (``selfcheck._run_in_workers``,
whose workers import this module by name to list the same checks): one that ends its
worker's process, one that raises, the others pass."""
from __future__ import annotations

import os


def _raise():
    raise RuntimeError("planted error")


def dying_checks(ctx, big):
    """``(name, fn)`` as ``selfcheck._checks`` lists them; ``fn`` None: SKIP."""
    return [("first", lambda: "ok 1"),
            ("dies", lambda: os._exit(7)),
            ("skipped", None),
            ("raises", _raise),
            ("after", lambda: f"ok in {os.getpid()}"),
            ("last", lambda: f"ok in {os.getpid()}"),
            ("timing", lambda: f"alone in {os.getpid()}")]
