"""``memo``: the cache of the per-call work that depends only on hashable values (options
checked, topologies built), on the path that ``torch.compile`` traces.

``functools.lru_cache`` alone would do in eager mode. But TorchDynamo, tracing a model that
calls a loss, does not use an ``lru_cache`` wrapper: it traces the function inside it, and
warns once per call site ("Dynamo detected a call to a ``functools.lru_cache``-wrapped
function ... Silent incorrectness is only a *potential* risk"), four to six warnings for a
user whose code is correct. A memoised function here calls the function itself while
Dynamo traces (``torch.compiler.is_compiling()``, which Dynamo reads as True): what Dynamo
would do, without the warning; the values are the same, the functions being pure. In eager
mode it is the ``lru_cache``, at the cost of one more call and one flag read (about 0.15 us).

A trace that Dynamo does not run itself, where ``is_compiling()`` is False, can still hand
the function symbolic sizes (``torch.SymInt``), which no cache can hash: an op's kernel run
on fake tensors for ``torch.compile(dynamic=True)`` on torch 2.9 (compat.torchaudio's
registered op), ``make_fx``, ``torch.export``. Those calls are computed directly too.
"""
from __future__ import annotations

import functools

import torch


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def memo(maxsize: int):
    """``functools.lru_cache(maxsize)`` for a pure function of hashable positional
    arguments, bypassed while ``torch.compile`` traces (see the module's docstring).
    The decorated function keeps ``cache_info`` and ``cache_clear``."""
    def decorate(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        compiling = torch.compiler.is_compiling

        @functools.wraps(fn)
        def call(*args):
            if compiling():
                return fn(*args)
            try:
                return cached(*args)
            except TypeError:
                if any(isinstance(a, _SYMBOLIC) for a in args):     # unhashable: traced
                    return fn(*args)
                raise

        call.cache_info, call.cache_clear = cached.cache_info, cached.cache_clear
        return call
    return decorate
