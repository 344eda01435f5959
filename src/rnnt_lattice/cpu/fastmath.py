"""Fast math of the CPU kernels: Numba helpers on scalars and on rows of logits, shared by
the generic kernels (``kernels``) and the regular fast path (``regular``).

- ``exp_nonpos``: exp(x) for x <= 0, a polynomial that LLVM vectorises for float32 rows
  (``math.exp`` is a scalar libm call in Numba without SVML, ~6x slower); ``exp64`` and
  ``log64``: float64 exp and log that vectorise too (no division by zero check).
- ``row_max``: the row max as an integer max over order-preserving keys (``max_key``),
  which vectorises without "no NaNs" assumptions and lets every NaN win.
- ``exp_sum``, ``exp_store``: the row's ``sum_v exp(x_v - m)`` (and the exps stored);
  ``scale_row``: the gradient pass's bulk multiply of stored exps.
- ``lae``, ``nan_max``, ``clip``, ``cast_like``: scalar pieces.

Every helper is ``@njit(**JIT)`` (or a Numba overload) and compiles into each kernel that
calls it (``_config``: each kernel is compiled once).
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite.binding import llvm_version_info
from numba import njit, types
from numba.extending import overload

from ._config import FASTMATH, JIT

NEG_INF = -np.inf

# --------------------------------------------------------------------------- exp
def exp_nonpos(x):
    """exp(x) for x <= 0 (NaN in -> NaN out). Python stub; see the Numba overload."""
    return math.exp(x)


# No "reassoc" here: it would fold the two-part ln 2 subtraction below into one and lose
# the exactness it exists for (~1e-14 relative error at x ~ -700 in float64). The caller's
# reduction keeps its own flags. NumPy's error model: Python's checks a division for a
# zero divisor and raises, a branch that kept every float64 row loop calling this (the
# rational approximation divides) from vectorising; its divisor q - p is > 0 here. With
# it the float64 exp loops run 8 lanes wide (AVX-512), and a float64 forward+backward
# took a third of its time (docs/benchmarks.md, "CPU row loops vectorised in full").
@overload(exp_nonpos, jit_options=dict(fastmath=FASTMATH - {"reassoc"}, error_model="numpy"))
def _exp_nonpos_impl(x):
    if x == types.float32:
        # exp(x) = 2^n * exp(r),  n = round(x / ln 2),  r = x - n ln 2 in [-ln2/2, ln2/2].
        # exp(r) by the Cephes expf minimax polynomial (relative error < 1.2e-7 over the
        # range: float32 rounding), 2^n by adding n to the exponent bits. Below -87
        # exp(x) < 2^-125 is flushed to 0 (it cannot move a row sum that is >= 1), which
        # also keeps 2^n a normal number and makes exp(-inf) exactly 0.
        def impl(x):
            n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
            r = x - n * np.float32(0.693359375)          # ln 2 split into hi + lo parts so
            r = r + n * np.float32(2.12194440e-4)        # that n * ln2_hi is exact
            p = np.float32(1.9875691500e-4)
            p = p * r + np.float32(1.3981999507e-3)
            p = p * r + np.float32(8.3334519073e-3)
            p = p * r + np.float32(4.1665795894e-2)
            p = p * r + np.float32(1.6666665459e-1)
            p = p * r + np.float32(5.0000001201e-1)
            p = p * r * r + r + np.float32(1.0)
            # NaN x: p is NaN and int32(n) is 0 or INT_MIN, whose shift by 23 is 0: stays NaN.
            bits = np.int32(np.float32(p).view(np.int32) + (np.int32(n) << np.int32(23)))
            y = np.int32(bits).view(np.float32)
            return np.float32(0.0) if x < np.float32(-87.0) else y
        return impl
    if x == types.float64:
        # The same scheme in float64 with the Cephes exp rational approximation on
        # |r| <= ln2/2: exp(r) = 1 + 2 r P(r^2) / (Q(r^2) - r P(r^2)), relative error
        # < 2.2e-16 (float64 rounding). Below -708, exp(x) < 2^-1021 is flushed to 0 (it
        # cannot move a row sum that is >= 1) and 2^n stays a normal number.
        def impl(x):
            n = np.floor(x * 1.4426950408889634 + 0.5)
            r = x - n * 6.93145751953125e-1
            r = r - n * 1.42860682030941723212e-6
            rr = r * r
            p = ((1.26177193074810590878e-4 * rr + 3.02994407707441961300e-2) * rr
                 + 9.99999999999999999910e-1) * r
            q = (((3.00198505138664455042e-6 * rr + 2.52448340349684104192e-3) * rr
                  + 2.27265548208155028766e-1) * rr + 2.00000000000000000009e0)
            e = 1.0 + 2.0 * p / (q - p)
            bits = np.int64(np.float64(e).view(np.int64) + (np.int64(n) << np.int64(52)))
            y = np.int64(bits).view(np.float64)
            return 0.0 if x < -708.0 else y
        return impl


def cast_like(arr, x):
    """x converted to the element type of ``arr``. Python stub; see the Numba overload."""
    return arr.dtype.type(x)


@overload(cast_like)
def _cast_like_impl(arr, x):
    dtype = arr.dtype
    def impl(arr, x):
        return dtype(x)
    return impl


# --------------------------------------------------------------------------- row helpers
# Two habits keep every row loop below vectorised (16 float32 lanes with AVX-512):
# - loop over a *slice* with ``range(len)`` starting at 0: Numba then knows the index is
#   non-negative and emits plain vector loads; ``range(v0, v1)`` on the whole row makes it
#   keep negative-index wraparound, which LLVM turns into gathers (7x slower);
# - reductions LLVM can vectorise under IEEE semantics (integer max, float sums with
#   ``reassoc``); a float max would need "no NaNs", which would fold our NaN checks away.

def max_key(row):
    """Order-preserving integer keys of a float row. Python stub; see the overload."""
    raise NotImplementedError


def key_to_float(row, k):
    """The float of ``row``'s dtype whose key is ``k``. Python stub; see the overload."""
    raise NotImplementedError


def _key_types(dtype):
    # (int type, float type, sign shift, magnitude mask, key of -inf), see ``max_key``.
    if dtype == types.float32:
        return (np.int32, np.float32, np.int32(31), np.int32(0x7FFFFFFF),
                np.int32(-0x7F800000 - 1))
    return (np.int64, np.float64, np.int64(63), np.int64(0x7FFFFFFFFFFFFFFF),
            np.int64(-0x7FF0000000000000 - 1))


@overload(max_key)
def _max_key_impl(row):
    # IEEE floats compare like sign-magnitude integers: flipping the magnitude bits of the
    # negative ones gives two's-complement integers in the same order (the map is its own
    # inverse), NaNs included: -NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN. The keys
    # below the key of -inf are the negative NaNs (what inf - inf gives on x86); the
    # caller flips them bitwise (``~k``) to the top, among the positive NaNs, so that every
    # NaN wins an integer max (math.md section 8). No wrapping arithmetic: Numba's integer
    # ops are "no signed wrap" and LLVM may fold an overflowing one into anything.
    ity, _, sh, mask, kneg = _key_types(row.dtype)

    def impl(row):
        return row.view(ity), sh, mask, kneg
    return impl


@overload(key_to_float)
def _key_to_float_impl(row, k):
    ity, fty, sh, mask, _ = _key_types(row.dtype)

    def impl(row, k):
        return ity(ity(k) ^ ((ity(k) >> sh) & mask)).view(fty)
    return impl


@njit(**JIT)
def row_max(row):
    """max_v row[v] for a non-empty row, as an integer max over the keys of ``max_key``
    (vectorises without any fast-math assumption). Any NaN, of either sign, wins: the row
    max is NaN exactly when the row holds a NaN."""
    bits, sh, mask, kneg = max_key(row)
    m = bits[0] ^ ((bits[0] >> sh) & mask)
    for v in range(bits.shape[0]):
        k = bits[v] ^ ((bits[v] >> sh) & mask)
        k = ~k if k < kneg else k                     # a negative NaN: to the top
        m = k if k > m else m
    return key_to_float(row, m)


# Row sums: float32 partial sums over blocks of SUM_BLOCK elements (16-wide AVX-512
# lanes), float64 across blocks. A float64 accumulator throughout would halve the vector
# width; 256 float32 terms in [0, 1] lose < 256 * 2^-24 relative.
#
# The entries equal to the max (exp(0) = 1, exactly) are counted, not summed: s = ties +
# rest, added in float64 at the end. In a float32 partial sum the 1 would round the others
# away (a confident row, p_max = 1 / (1 + rest), rest < 2^-24: log p_max read 0, and every
# gradient entry p S - gamma that cancels near p = 1 inherited the rounding). The count
# is kept in the row's float type too (exact: at most SUM_BLOCK ones), in the lanes of
# the sum: an int64 counter took twice the vector registers, and the exp loop took 20%
# longer than without the count (docs/benchmarks.md, "CPU row loops vectorised in
# full").
SUM_BLOCK = 256

# The tie count as a select (+1 or +0) beside the sum's own select on the same
# comparison: the LLVM 14 and 15 of Numba 0.59-0.61 leave such a loop scalar (the CPU
# losses ran 3-4x slower there), so there the count adds the comparison converted to a
# float instead. LLVM 20 (Numba 0.62 on) vectorises both forms, the selects 8% faster on
# float64 rows (docs/benchmarks.md, "The row loops on Numba 0.59-0.61"). A constant: the
# branch on it is folded at compile time.
TIES_AS_FLOATS = llvm_version_info < (20,)


@njit(**JIT)
def exp_sum(row, m):
    """sum_v exp(row[v] - m) (the entries equal to ``m`` counted: see ``SUM_BLOCK``)."""
    return _exp_row(row, m, False)


@njit(**JIT)
def exp_store(row, m, out):
    """out[v] = exp(row[v] - m); returns the sum. ``out`` may be ``row`` itself (in-place
    mode: the exps overwrite the row)."""
    if out.ctypes.data == row.ctypes.data:
        # Two views of one row: LLVM cannot tell them apart at compile time, and at run time
        # its overlap check sends the loop to the scalar version (the in-place forward ran
        # 2.5-4x slower; docs/benchmarks.md, "CPU kernels after the restructuring").
        return _exp_row(row, m, True)
    s = 0.0
    ties = 0.0
    zero = cast_like(row, 0.0)
    one = cast_like(row, 1.0)
    for v0 in range(0, row.shape[0], SUM_BLOCK):
        seg = row[v0:v0 + SUM_BLOCK]
        oseg = out[v0:v0 + SUM_BLOCK]
        part = zero
        count = zero
        for k in range(seg.shape[0]):
            d = seg[k] - m
            e = exp_nonpos(d)
            oseg[k] = e
            tie = d == zero
            if TIES_AS_FLOATS:
                count += cast_like(row, tie)
            else:
                count += one if tie else zero
            part += zero if tie else e
        s += part
        ties += count
    return s + ties


@njit(**JIT)
def _exp_row(row, m, in_place):
    """sum_v exp(row[v] - m), the exps written over the row when ``in_place`` (a loop on
    one array: LLVM unswitches the flag and vectorises both versions)."""
    s = 0.0
    ties = 0.0
    zero = cast_like(row, 0.0)
    one = cast_like(row, 1.0)
    for v0 in range(0, row.shape[0], SUM_BLOCK):
        seg = row[v0:v0 + SUM_BLOCK]
        part = zero
        count = zero
        for k in range(seg.shape[0]):
            d = seg[k] - m
            e = exp_nonpos(d)
            if in_place:
                seg[k] = e
            tie = d == zero
            if TIES_AS_FLOATS:
                count += cast_like(row, tie)
            else:
                count += one if tie else zero
            part += zero if tie else e
        s += part
        ties += count
    return s + ties


def row_loop_vectors() -> dict:
    """The vector types in the compiled LLVM IR of the row loops, per loop and row dtype:
    ``{(loop, dtype name): {(lanes, "float" | "double" | "i64"), ...}}`` for ``exp_sum``,
    ``exp_store`` and ``exp_store`` in place (``exp_store_in_place``) on float32 and float64
    rows; an empty set is a scalar loop. Compiles three small functions with this Numba
    (about a second, not cached): for ``rnnt-lattice check`` and the tests."""
    import re

    def with_jit(fn):
        return njit(cache=False, **JIT)(fn)

    @with_jit
    def sum_(row, m):
        return exp_sum(row, m)

    @with_jit
    def store(row, m, out):
        return exp_store(row, m, out)

    @with_jit
    def in_place(row, m):
        return exp_store(row, m, row)

    vectors = re.compile(r"<(\d+) x (float|double|i64)>")
    found = {}
    for dtype, nb_type in ((np.float32, types.float32), (np.float64, types.float64)):
        row = np.zeros(300, dtype)
        for name, fn, args in (("exp_sum", sum_, (row, dtype(0))),
                               ("exp_store", store, (row, dtype(0), row.copy())),
                               ("exp_store_in_place", in_place, (row.copy(), dtype(0)))):
            fn(*args)
            sig = next(s for s in fn.signatures if s[0].dtype == nb_type)
            found[name, np.dtype(dtype).name] = {
                (int(n), t) for n, t in vectors.findall(fn.inspect_llvm(sig))}
    return found


# Inlined in Numba's IR: called as a function, its loop lost the caller's vectorisation
# and the regular gradient pass took 25% longer (2.3 -> 2.9 ms at s3, 1 thread).
@njit(inline="always", **JIT)
def scale_row(row, c, w, clamp):
    """The bulk of a gradient row from its stored exps: ``row[v] = min(row[v] c, clamp) w``
    (no bound without a clamp > 0), in the row's dtype. The exps and ``c`` (occupations
    over the row sum) are >= 0, so only the upper bound of the clamp can bind here; the
    entries the arcs read, where ``- gamma`` makes them negative, are set afterwards.
    A select, not min(): Numba's min is NaN-aware and does not vectorise."""
    if clamp > 0.0:
        c32 = cast_like(row, c)
        hi = cast_like(row, clamp)
        w32 = cast_like(row, w)
        for v in range(row.shape[0]):
            g = row[v] * c32
            row[v] = (hi if g > hi else g) * w32
    else:
        cw = cast_like(row, c * w)
        for v in range(row.shape[0]):
            row[v] = row[v] * cw


# --------------------------------------------------------------------------- scalars
@njit(**JIT)
def lae(a, b):
    """log(exp(a) + exp(b)); -inf if both are -inf; NaN propagates."""
    if a == NEG_INF:
        return b
    if b == NEG_INF:
        return a
    if a > b:
        return a + math.log1p(math.exp(b - a))
    return b + math.log1p(math.exp(a - b))


@njit(**JIT)
def clip(g, clamp):
    """g clipped to [-clamp, clamp] when clamp > 0 (NaN-aware: a NaN stays NaN)."""
    if clamp > 0.0:
        return min(max(g, -clamp), clamp)
    return g


@njit(**JIT)
def nan_max(m, x):
    """max(m, x) where a NaN wins (and stays)."""
    return x if (x > m or x != x) else m


# --------------------------------------------------------------------------- float64 exp, log
# For the float64 lattice loops (``kernels.lattice``): division-free and check-free, so
# that loops over them vectorise.
@njit(**dict(JIT, fastmath=FASTMATH - {"reassoc"}))
def exp64(x):
    """exp(x) for float64 x <= 0 (NaN in -> NaN out, below -708: 0), as ``exp_nonpos``
    but with a plain polynomial for exp(r): the Taylor series to r^13 on |r| <= ln2/2
    (truncation < 5e-18, relative error ~2.2e-16 in all), no division, so that loops over
    it vectorise (``exp_nonpos``'s float64 rational form stays scalar). No "reassoc": it
    would fold the two-part ln 2."""
    n = np.floor(x * 1.4426950408889634 + 0.5)
    r = x - n * 6.93145751953125e-1
    r = r - n * 1.42860682030941723212e-6
    p = 1.0 / 6227020800.0
    p = p * r + 1.0 / 479001600.0
    p = p * r + 1.0 / 39916800.0
    p = p * r + 1.0 / 3628800.0
    p = p * r + 1.0 / 362880.0
    p = p * r + 1.0 / 40320.0
    p = p * r + 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    bits = np.int64(np.float64(p).view(np.int64) + (np.int64(n) << np.int64(52)))
    y = np.int64(bits).view(np.float64)
    y = 0.0 if x < -708.0 else y
    return y if x == x else x                         # int64(NaN) is undefined: keep NaN


@njit(**dict(JIT, error_model="numpy"))
def log64(x):
    """log(x) for float64 x >= 0 (0: -inf, NaN: NaN; subnormals are not handled: the
    callers' x is 0 or >= 1), as the exponent times ln 2 plus log f, f in [sqrt(1/2),
    sqrt(2)), by log f = 2 atanh(z), z = (f - 1) / (f + 1), |z| <= 0.172: the series to
    z^21 (truncation < 1e-18). A scalar libm call would not vectorise; NumPy's error model
    drops the zero check of the division, which would not either."""
    bits = np.float64(x).view(np.int64)
    e = (bits >> np.int64(52)) - np.int64(1023)
    mant = (bits & np.int64(0x000FFFFFFFFFFFFF)) | np.int64(0x3FF0000000000000)
    f = np.int64(mant).view(np.float64)                # x's mantissa, in [1, 2)
    big = f > 1.4142135623730951
    f = f * 0.5 if big else f
    e = e + 1 if big else e
    z = (f - 1.0) / (f + 1.0)
    zz = z * z
    p = 2.0 / 21.0
    p = p * zz + 2.0 / 19.0
    p = p * zz + 2.0 / 17.0
    p = p * zz + 2.0 / 15.0
    p = p * zz + 2.0 / 13.0
    p = p * zz + 2.0 / 11.0
    p = p * zz + 2.0 / 9.0
    p = p * zz + 2.0 / 7.0
    p = p * zz + 2.0 / 5.0
    p = p * zz + 2.0 / 3.0
    p = p * zz + 2.0
    fe = np.float64(e)
    y = fe * 6.93147180369123816490e-01 + (z * p + fe * 1.90821492927058770002e-10)
    y = NEG_INF if x == 0.0 else y
    return y if x == x else x
