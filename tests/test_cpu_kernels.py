"""The Numba helpers the CPU kernels are built from (``cpu.fastmath``): the vectorised exp,
the row max, the row exps stored in place; the gradient buffer's reuse."""
from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")
from rnnt_lattice.cpu import fastmath  # noqa: E402


@numba.njit(cache=False)
def _apply_exp(x, out):
    for i in range(x.shape[0]):
        out[i] = fastmath.exp_nonpos(x[i])


@numba.njit(cache=False)
def _row_maxes(x, out):
    for i in range(x.shape[0]):
        out[i] = fastmath.row_max(x[i])


# Relative error bound of exp_nonpos per dtype (a couple of units in the last place).
EXP_TOL = {np.float32: 2 * np.finfo(np.float32).eps, np.float64: 4 * np.finfo(np.float64).eps}
# Below these, exp is flushed to 0 (it cannot move a row sum that is >= 1).
FLUSH = {np.float32: -87.0, np.float64: -708.0}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_exp_nonpos_accuracy_and_specials(dtype):
    x = np.concatenate([-np.logspace(-12, np.log10(-FLUSH[dtype]), 100_000), [0.0, -0.0]]).astype(dtype)
    out = np.empty_like(x)
    _apply_exp(x, out)
    ref = np.exp(x.astype(np.float64))
    rel = np.abs(out.astype(np.float64) - ref) / ref
    assert rel.max() <= EXP_TOL[dtype], rel.max()
    special = np.array([-np.inf, np.nan, FLUSH[dtype] - 0.5, -1e30], dtype=dtype)
    out = np.empty_like(special)
    _apply_exp(special, out)
    assert out[0] == 0 and np.isnan(out[1]) and out[2] == 0 and out[3] == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_row_max(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 37)).astype(dtype) * 100
    x[1] = -np.inf                               # a fully masked row
    x[2, 5:] = -np.inf
    x[3] = -np.abs(x[3])                         # all negative
    x[4, 7] = -0.0
    x[4, :7] = x[4, 8:] = -1.0
    x[5, 3] = np.inf
    x[6, 9] = np.nan                             # NaN wins: that sequence's loss is NaN
    out = np.empty(8, dtype=dtype)
    _row_maxes(x, out)
    want = x.max(axis=1)
    assert np.array_equal(out, want, equal_nan=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_exp_store_in_place(dtype):
    """``exp_store`` into the row itself (in-place mode, its own loop: through two views
    of one row LLVM runs the scalar loop) writes the same exps as into another buffer, and
    the same sum up to the order of its float32 partial sums."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(1000) * 5).astype(dtype)
    x[[3, 700]] = -np.inf
    m = x.max()
    out = np.empty_like(x)
    want = fastmath.exp_store(x, m, out)
    y = x.copy()
    got = fastmath.exp_store(y, m, y)
    assert np.array_equal(y, out)
    assert abs(got - want) <= fastmath.SUM_BLOCK * np.finfo(dtype).eps * want


def test_kernel_cache_follows_every_kernel_module(tmp_path):
    """Numba keys a cached kernel on its own file only: the cache names carry a hash of
    all the kernel modules, so a change to a helper's module (``fastmath``) compiles the
    kernels of the other modules anew instead of loading them with the old helper."""
    import shutil
    from pathlib import Path

    from rnnt_lattice.cpu import _config, kernels
    here = Path(_config.__file__).parent
    assert len(_config.SOURCES) == 12 and _config.SOURCES == _config.sources_hash(str(here))
    for variant in (kernels.row_pass.parallel, kernels.row_pass.serial):
        assert variant.py_func.__qualname__.endswith("_" + _config.SOURCES)
    for p in here.glob("*.py"):
        shutil.copy(p, tmp_path / p.name)
    assert _config.sources_hash(str(tmp_path)) == _config.SOURCES
    (tmp_path / "__init__.py").write_text("# kernels are not here\n")
    assert _config.sources_hash(str(tmp_path)) == _config.SOURCES
    with open(tmp_path / "fastmath.py", "a") as f:
        f.write("# a change\n")
    assert _config.sources_hash(str(tmp_path)) != _config.SOURCES


# --------------------------------------------------------------------------- buffer reuse
import torch  # noqa: E402

import rnnt_lattice  # noqa: E402
from rnnt_lattice import cpu  # noqa: E402
from support.cases import Case, make_inputs  # noqa: E402

# 2 * 64 * 33 * 256 float32 = 4.3 MB: above the cache's MIN_BYTES.
BIG = Case("big", (64, 50), (32, 20), 256, 0)


def _step(logits, targets, tl, ul, blank):
    x = logits.clone().requires_grad_()
    rnnt_lattice.rnnt_loss(x, targets, tl, ul, blank, backend="numba").backward()
    return x.grad


def test_gradient_buffer_is_reused_only_when_free():
    logits, targets, tl, ul, blank = make_inputs(BIG, torch.float32, poison=False)
    assert logits.numel() * 4 >= cpu._BufferCache.MIN_BYTES
    rnnt_lattice.empty_cache()
    g1 = _step(logits, targets, tl, ul, blank)
    want = g1.clone()
    g2 = _step(logits, targets, tl, ul, blank)          # g1 still held: a new buffer
    assert g2.data_ptr() != g1.data_ptr()
    assert torch.equal(g1, want) and torch.equal(g2, want)
    ptr = g2.data_ptr()
    del g1, g2
    g3 = _step(logits, targets, tl, ul, blank)          # the kept buffer is free again
    assert g3.data_ptr() == ptr and torch.equal(g3, want)
    del g3
    rnnt_lattice.empty_cache()
    assert cpu._buffers.array is None


def test_gradient_buffer_reused_through_a_joiner():
    """In training the gradient of the logits is consumed by the joiner's backward and
    dropped: the next step reuses the buffer with no user action."""
    logits, targets, tl, ul, blank = make_inputs(BIG, torch.float32, poison=False)
    joiner = torch.nn.Linear(256, 256)
    rnnt_lattice.empty_cache()
    ptrs, grads = [], []
    for _ in range(3):
        joiner.zero_grad()
        out = joiner(logits)
        rnnt_lattice.rnnt_loss(out, targets, tl, ul, blank, backend="numba").backward()
        ptrs.append(cpu._buffers.array.ctypes.data)
        grads.append(joiner.weight.grad.clone())
    assert ptrs[0] == ptrs[1] == ptrs[2]
    assert torch.equal(grads[0], grads[2])


def test_gradient_buffer_reuse_can_be_turned_off(monkeypatch):
    logits, targets, tl, ul, blank = make_inputs(BIG, torch.float32, poison=False)
    monkeypatch.setattr(cpu._config, "CACHE_GRAD", False)
    rnnt_lattice.empty_cache()
    g = _step(logits, targets, tl, ul, blank)
    assert cpu._buffers.array is None and torch.isfinite(g).all()


@pytest.mark.parametrize("mix", [False, True], ids=["simple", "smoothed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("U1", [7, 1])
def test_arc_terms_kernels_are_the_reference(mix, dtype, U1):
    """The simple losses' arc log-probs and their backward on the Numba kernels
    (``cpu.arc_terms``, what the CPU runs) against the reference (``torch_backend``): every
    kind of node (``support.simple_parts``), upstream gradients with NaN and a plane of a
    ``(B, K, T, U+1)`` tensor (strided), either absent; U = 0."""
    from rnnt_lattice import torch_backend
    from support.simple_parts import arc_parts, same
    parts, smooth = arc_parts(dtype, U1=U1, mix=mix)
    B, T, _ = parts.mass.shape
    got, want = cpu.arc_terms(parts, smooth), torch_backend.arc_terms(parts, smooth)
    assert got[2][1].dtype == torch.int8                       # the kernel ran, not the reference
    for name, x, y in zip(("b", "e"), got, want):
        same(x, y, name)
    g = torch.Generator().manual_seed(3)
    planes = torch.randn(B, 2, T, U1, generator=g, dtype=torch.float64)      # (B, K, T, U+1)
    planes[0, 0, 1, 0] = planes[2, 1, 5, 0] = float("nan")
    dtypes = (parts.am_cols.dtype, parts.lm_cols.dtype)
    for g_b, g_e in ((planes[:, 0], planes[:, 1]), (None, planes[:, 1]), (planes[:, 0], None)):
        out = cpu.arc_terms_backward(got[2], g_b, g_e, smooth, dtypes)
        ref = torch_backend.arc_terms_backward(want[2], g_b, g_e, smooth, dtypes)
        for name, x, y in zip(("d mass", "d lse_rescued", "d am_cols", "d lm_cols"), out, ref):
            same(x, y, name)
        assert len(out[4]) == len(ref[4]) == (4 if mix else 0)
        for k, (x, y) in enumerate(zip(out[4], ref[4])):
            same(x, y, f"d {'PQRS'[k]}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "transposed"])
def test_simple_rows_kernels_are_the_reference(dtype, contiguous):
    """The simple losses' rows on the Numba kernels (``cpu.simple_rows``: ok, shift, bad,
    the exponentials and the entries read) and their backward against the reference
    (``torch_backend``): rows with a NaN, a +inf, only -inf, some -inf entries, padding
    rows holding NaN, x contiguous and transposed (a Conv1d head's), an expanded idx with
    repeated classes; the uni term on and off, no entries' gradient; and (float64) a row
    reaching 720 and 740 nats below its maximum, whose exponentials are subnormal numbers:
    within two units of the last place of the reference's, not flushed to zero."""
    from rnnt_lattice import torch_backend
    from support.simple_parts import same
    g = torch.Generator().manual_seed(4)
    B, N, V, J = 3, 7, 11, 5
    x = (30 * torch.randn(B, V, N, generator=g, dtype=torch.float64)).to(dtype).transpose(1, 2)
    x = x.contiguous() if contiguous else x
    x[0, 1, 3] = float("nan")
    x[1, 2, 0] = float("inf")
    x[2, 3] = float("-inf")
    x[0, 4, :5] = float("-inf")
    if dtype == torch.float64:
        x[2, 5, :3] = torch.tensor([0.0, -720.0, -740.0], dtype=dtype)
        x[2, 5, 3:] = -30.0
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, 5:] = False
    x[1, 6] = float("nan")                                            # padding: never read
    cols = torch.randint(0, V, (B, J), generator=g)
    cols[:, 1] = cols[:, 2]                                           # a class read twice
    idx = cols[:, None, :].expand(B, N, J)
    got, want = cpu.simple_rows(x, keep, idx), torch_backend.simple_rows(x, keep, idx)
    for name, a, b in zip(("ok", "shift", "bad", "ex", "cols"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if a.is_floating_point():
            same(a, b, name)
        else:
            assert torch.equal(a, b), name
    if dtype == torch.float64:
        sub = want[3][2, 5, 1:3]
        assert (sub > 0).all() and (sub < 2.3e-308).all()             # subnormal numbers
        assert ((got[3][2, 5, 1:3] - sub).abs() <= 2 * 2.0 ** -1074).all()
    ok, ex = want[0], want[3]
    uni = torch.rand(V, generator=g, dtype=torch.float64).to(dtype)
    g_uni = torch.randn(B, N, generator=g, dtype=torch.float64)
    g_cols = torch.randn(B, N, J, generator=g, dtype=torch.float64).to(dtype)
    grad0 = torch.randn(B, N, V, generator=g, dtype=torch.float64)
    grad0[0, 1, 2] = g_uni[1, 2] = float("nan")                       # rows not ok: zeroed
    for g_u, u, g_c in ((g_uni, uni, g_cols), (None, None, g_cols), (g_uni, uni, None)):
        a, b = grad0.clone(), grad0.clone()
        cpu.simple_rows_backward(a, ex, ok, g_u, u, idx, g_c)
        torch_backend.simple_rows_backward(b, ex, ok, g_u, u, idx, g_c)
        same(a, b, "grad")
