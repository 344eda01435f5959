"""Small Triton kernels that run the backend's device helpers alone, for tests under the
interpreter. Import this module only after ``TRITON_INTERPRET=1`` is set (``@triton.jit``
reads it when a kernel is decorated), as tests/test_triton.py does."""
import triton
import triton.language as tl

from rnnt_lattice.gpu.kernels import _row_plane_at, _skew


@triton.jit
def skew_probe(out_ptr, T, U1, N: tl.constexpr, WIDE: tl.constexpr):
    """``kernels._skew``'s strides and plane, then ``_row_plane_at``'s plane and the offsets
    of sequence 3's nodes (test_triton.py's
    test_skewed_planes_keep_each_diagonal_adjacent)."""
    s_t, s_u, plane = _skew(T, U1)
    tl.store(out_ptr, s_t)
    tl.store(out_ptr + 1, s_u)
    tl.store(out_ptr + 2, plane)
    i = tl.arange(0, N)
    node = i.to(tl.int64) + 3 * T * U1
    u = node % U1
    t = (node // U1) % T
    at, plane2 = _row_plane_at(node, node // (U1 * T), t, u, T, U1, WIDE)
    tl.store(out_ptr + 3, plane2)
    tl.store(out_ptr + 4 + i, at.to(tl.int64), mask=i < T * U1)
