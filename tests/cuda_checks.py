"""Checks of the Triton backend on a CUDA device, compiled (not interpreted).

Run by ``tests/test_triton.py::test_cuda_native`` in a subprocess without
``TRITON_INTERPRET`` (that test module sets it for its own process), or by hand on a GPU
machine: ``python tests/cuda_checks.py`` (add ``--big`` for the > 2**31-element case,
about 27 GB of GPU memory). ``--smoke`` runs the exactness part on tiny lattices on the
CPU through the Triton interpreter (set ``TRITON_INTERPRET=1``), which checks this
script itself without a GPU.

1. Exactness against the float64 pure-PyTorch reference on the same (rounded) numbers, at
   the benchmark's shapes, U > 1024 and (``--big``) a lattice whose offsets pass 2**31:
   gradient error <= 1e-5 of its scale for float32 logits (the lattice is float64), and
   a few units of the dtype's rounding for float16/bfloat16; the same for TDT (durations
   0..4) and multi-blank (big blanks up to 8 frames) at two benchmark shapes.
2. No host synchronisation (``torch.cuda.set_sync_debug_mode("error")``) in forward and
   backward for every option, TDT and multi-blank included, and in ``occupancy`` /
   ``best_alignment``.
3. Forward+backward captured in a CUDA graph and replayed on new logits in the same
   buffers gives bit-identical losses and gradients to eager calls.
4. The pruned pipeline (simple/smoothed losses with occupations, the window DP, the pruned
   loss) and the lattice tools of a non-regular topology (TDT) on the Triton kernels equal
   the PyTorch reference, and the losses and tools make no host synchronisation.
"""
from __future__ import annotations

import argparse
import sys

import torch

import rnnt_lattice

OPTION_SETS = {
    "plain": dict(),
    "clamp_fastemit": dict(clamp=0.5, fastemit_lambda=0.1),
    "logprob": dict(fused_log_softmax=False),
}


def inputs(B, T, U, V, dtype, device, seed=0, ragged=True):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(B, T, U + 1, V, generator=g).to(dtype)
    y = torch.randint(1, V, (B, U), generator=g, dtype=torch.int32)
    if ragged and B > 1:
        tl = torch.randint(max(1, T // 2), T + 1, (B,), generator=g, dtype=torch.int32)
        ul = torch.randint(0, U + 1, (B,), generator=g, dtype=torch.int32)
        tl[0], ul[0] = T, U
    else:
        tl = torch.full((B,), T, dtype=torch.int32)
        ul = torch.full((B,), U, dtype=torch.int32)
    w = torch.tensor([(-1.0) ** b * (0.5 + 0.25 * b) for b in range(B)])
    return x.to(device), y.to(device), tl.to(device), ul.to(device), w.to(device)


def losses_and_grad(x, y, tl, ul, w, backend, **opts):
    leaf = x.detach().clone().requires_grad_()
    costs = rnnt_lattice.rnnt_loss(leaf, y, tl, ul, blank=0, reduction="none", backend=backend,
                                   **opts)
    (costs * w.to(costs.dtype)).sum().backward()
    return costs.detach(), leaf.grad


def check_exact(name, B, T, U, V, dtype, device, opts):
    x, y, tl, ul, w = inputs(B, T, U, V, dtype, device)
    if not opts.get("fused_log_softmax", True):
        x = torch.log_softmax(x.double(), -1).to(dtype)      # both sides see these numbers
    costs, grad = losses_and_grad(x, y, tl, ul, w, "triton", **dict(opts))
    ref_costs, ref_grad = losses_and_grad(x.double(), y, tl, ul, w.double(), "torch", **dict(opts))
    fin = torch.isfinite(ref_costs)
    assert torch.equal(torch.isinf(costs), torch.isinf(ref_costs)), name
    loss_err = ((costs.double() - ref_costs)[fin].abs().max()
                / ref_costs[fin].abs().max().clamp_min(1.0)).item()
    grad_err = ((grad.double() - ref_grad).abs().max() / ref_grad.abs().max()).item()
    if dtype in (torch.float32, torch.float64):
        tol = 1e-5 if dtype == torch.float32 else 1e-12
    else:
        tol = 4 * torch.finfo(dtype).eps        # the gradient is written in this dtype
    print(f"{name:34s} loss err {loss_err:.1e}  grad err {grad_err:.1e}  (tol {tol:.0e})", flush=True)
    assert loss_err <= max(tol, 1e-6) and grad_err <= tol, (name, loss_err, grad_err)


def exactness(device, smoke):
    shapes = ([("tiny", 3, 6, 4, 7), ("u_blocks", 1, 5, 9, 5)] if smoke else
              [("s3", 8, 150, 40, 256), ("s5", 8, 400, 80, 1024), ("ragged", 8, 300, 60, 500),
               ("U1500", 2, 40, 1500, 64), ("v5000", 4, 120, 30, 5000)])
    for name, B, T, U, V in shapes:
        for oname, opts in OPTION_SETS.items():
            check_exact(f"{name} float32 {oname}", B, T, U, V, torch.float32, device, opts)
        for dtype in (torch.float16, torch.bfloat16, torch.float64):
            check_exact(f"{name} {str(dtype)[6:]}", B, T, U, V, dtype, device, {})


TOPOLOGY_LOSSES = {
    # NeMo layouts, blank the last token: TDT durations up to 4 (a wavefront diagonal reads
    # four earlier ones), multi-blank big blanks up to 8 frames.
    "tdt": dict(durations=[0, 1, 2, 3, 4], sigma=0.05, fastemit_lambda=0.01, clamp=0.5),
    "multiblank": dict(big_blank_durations=[2, 4, 8], sigma=0.05),
}


def topology_losses_and_grad(kind, x, y, tl, ul, w, backend):
    leaf = x.detach().clone().requires_grad_()
    opts = dict(TOPOLOGY_LOSSES[kind], reduction="none", backend=backend)
    if kind == "tdt":
        blank = x.shape[-1] - len(opts["durations"]) - 1
        costs = rnnt_lattice.tdt_loss(leaf, y, tl, ul, blank=blank, **opts)
    else:
        costs = rnnt_lattice.multiblank_rnnt_loss(leaf, y, tl, ul, blank=x.shape[-1] - 1, **opts)
    (costs * w.to(costs.dtype)).sum().backward()
    return costs.detach(), leaf.grad


def check_topology_exact(name, kind, B, T, U, V, dtype, device):
    """TDT and multi-blank through the Triton kernels against the float64 reference on the
    same numbers: V token classes (TDT: plus the durations); labels avoid every blank."""
    n_dur = len(TOPOLOGY_LOSSES[kind].get("durations", ()))
    n_blanks = 1 + len(TOPOLOGY_LOSSES[kind].get("big_blank_durations", ()))
    x, y, tl, ul, w = inputs(B, T, U, V + n_dur, dtype, device)
    y = y % (V - n_blanks)                                   # ids 0 .. V - n_blanks - 1
    costs, grad = topology_losses_and_grad(kind, x, y, tl, ul, w, "triton")
    ref_costs, ref_grad = topology_losses_and_grad(kind, x.double(), y, tl, ul, w.double(), "torch")
    fin = torch.isfinite(ref_costs)
    assert torch.equal(torch.isinf(costs), torch.isinf(ref_costs)), name
    loss_err = ((costs.double() - ref_costs)[fin].abs().max()
                / ref_costs[fin].abs().max().clamp_min(1.0)).item()
    grad_err = ((grad.double() - ref_grad).abs().max() / ref_grad.abs().max()).item()
    tol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    print(f"{name:34s} loss err {loss_err:.1e}  grad err {grad_err:.1e}  (tol {tol:.0e})", flush=True)
    assert loss_err <= max(tol, 1e-6) and grad_err <= tol, (name, loss_err, grad_err)


def topology_exactness(device, smoke):
    shapes = ([("tiny", 2, 9, 3, 9)] if smoke else
              [("s3", 8, 150, 40, 256), ("ragged", 8, 300, 60, 500)])
    for name, B, T, U, V in shapes:
        for kind in TOPOLOGY_LOSSES:
            check_topology_exact(f"{name} {kind} float32", kind, B, T, U, V, torch.float32, device)
        check_topology_exact(f"{name} tdt bfloat16", "tdt", B, T, U, V, torch.bfloat16, device)


def _err(got, want):
    """Largest error relative to max(1, max |want|) on the finite entries (same inf pattern)."""
    got, want = got.detach().double(), want.detach().double()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    if not fin.any():
        return 0.0
    return ((got - want)[fin].abs().max() / want[fin].abs().max().clamp_min(1.0)).item()


def pruned_and_tools(device, smoke):
    """Issue 10's pipeline and issue 9's lattice tools on the Triton kernels against the
    PyTorch reference on the same numbers: the simple and smoothed losses (values,
    gradients w.r.t. lm and am, occupations), the window DP (``prune_ranges`` exact: the
    same windows as the PyTorch loop), the pruned loss, and ``occupancy`` /
    ``best_alignment`` of a non-regular topology (TDT)."""
    from rnnt_lattice import torch_backend
    from rnnt_lattice.pruned import windows as coverage
    B, T, U, V = (3, 7, 4, 6) if smoke else (8, 200, 50, 500)
    g = torch.Generator(device="cpu").manual_seed(5)
    am = torch.randn(B, T, V, generator=g, dtype=torch.float64).to(device)
    lm = torch.randn(B, U + 1, V, generator=g, dtype=torch.float64).to(device)
    y = torch.randint(1, V, (B, U), generator=g).to(device)
    tl = torch.tensor([T] + [max(U, T - 2)] * (B - 1)).to(device)
    ul = torch.tensor([U] + [U - 1] * (B - 1)).to(device)
    w = torch.tensor([(-1.0) ** b * (0.5 + 0.25 * b) for b in range(B)], dtype=torch.float64,
                     device=device)
    for name in ("rnnt_loss_simple", "rnnt_loss_smoothed"):
        out = {}
        for backend in ("triton", "torch"):
            lm_, am_ = lm.clone().requires_grad_(), am.clone().requires_grad_()
            loss, occ = getattr(rnnt_lattice, name)(lm_, am_, y, tl, ul, blank=0,
                                                    reduction="none", backend=backend,
                                                    return_occupations=True)
            (loss * w).sum().backward()
            out[backend] = (loss, lm_.grad, am_.grad, occ.gamma_blank, occ.gamma_label)
        errs = [_err(a, b) for a, b in zip(out["triton"], out["torch"])]
        print(f"{name:24s} triton vs torch: loss {errs[0]:.1e} grad lm {errs[1]:.1e} "
              f"am {errs[2]:.1e} occupations {max(errs[3:]):.1e}", flush=True)
        assert max(errs) <= 1e-9, (name, errs)
    # Logits whose am and lm peak at classes 1000 nats apart: nodes beyond the float64
    # matmul's range, rescued in the log domain (on CUDA by the Triton kernel).
    far_am, far_lm = am.clone(), lm.clone()
    far_am[..., 1] += 1000.0
    far_lm[..., 2] += 1000.0
    for name in ("rnnt_loss_simple", "rnnt_loss_smoothed"):
        extra = dict(lm_only_scale=0.0, am_only_scale=0.0) if name == "rnnt_loss_smoothed" else {}
        lm_, am_ = far_lm.clone().requires_grad_(), far_am.clone().requires_grad_()
        loss = getattr(rnnt_lattice, name)(lm_, am_, y, tl, ul, blank=0, reduction="none", **extra)
        (loss * w).sum().backward()
        full = (far_am[:, :, None] + far_lm[:, None]).requires_grad_()
        want = rnnt_lattice.rnnt_loss(full, y, tl, ul, blank=0, reduction="none", backend="torch")
        (want * w).sum().backward()
        errs = [_err(loss, want), _err(lm_.grad, full.grad.sum(1)), _err(am_.grad, full.grad.sum(2))]
        print(f"{name:24s} peaks 1000 apart vs the full loss: loss {errs[0]:.1e} grad lm "
              f"{errs[1]:.1e} am {errs[2]:.1e}", flush=True)
        assert torch.isfinite(loss).all() and max(errs) <= 1e-9, (name, errs)
    occ = out["triton"][3:]
    with torch.no_grad():
        lo = rnnt_lattice.rnnt_loss_simple(lm, am, y, tl, ul, blank=0, return_occupations=True,
                                           reduction="none")[1]
    win = rnnt_lattice.prune_ranges(lo, 4)
    mass = torch.rand(B, T, U, dtype=torch.float64, generator=g).to(device)
    got = coverage.best_window_starts(mass, torch.full((B,), U, device=device), 3)
    want = torch_backend.window_dp(mass, 3)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    print(f"window DP on the kernel equals the PyTorch loop ({B}x{T}x{U})", flush=True)
    logits = torch.randn(B, T, win.window, V, generator=g, dtype=torch.float64).to(device)
    res = {}
    for backend in ("triton", "torch"):
        leaf = logits.clone().requires_grad_()
        loss = rnnt_lattice.rnnt_loss_pruned(leaf, y, win.ranges, tl, ul, blank=0,
                                             reduction="none", backend=backend)
        (loss * w).sum().backward()
        res[backend] = (loss, leaf.grad)
    e = [_err(a, b) for a, b in zip(res["triton"], res["torch"])]
    print(f"rnnt_loss_pruned (R = {win.window}) triton vs torch: loss {e[0]:.1e} grad {e[1]:.1e}",
          flush=True)
    assert max(e) <= 1e-9, e
    x = torch.randn(B, T, U + 1, V + 3, generator=g, dtype=torch.float64).to(device)
    yt = y % (V - 1)
    kw = dict(rnnt_type="regular", topology=rnnt_lattice.topology.tdt([0, 1, 2]), sigma=0.05)
    o = {b: rnnt_lattice.occupancy(x, yt, tl, ul, V - 1, backend=b, **kw) for b in ("triton", "torch")}
    a = {b: rnnt_lattice.best_alignment(x, yt, tl, ul, V - 1, backend=b, **kw)
         for b in ("triton", "torch")}
    e_occ = _err(o["triton"].gamma, o["torch"].gamma)
    e_ali = _err(a["triton"].log_prob, a["torch"].log_prob)
    print(f"TDT occupancy / best_alignment triton vs torch: gamma {e_occ:.1e} "
          f"log_prob {e_ali:.1e}", flush=True)
    assert e_occ <= 1e-9 and e_ali <= 1e-9
    assert torch.equal(a["triton"].arc_kinds, a["torch"].arc_kinds)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            lm_, am_ = lm.clone().requires_grad_(), am.clone().requires_grad_()
            loss = rnnt_lattice.rnnt_loss_smoothed(lm_, am_, y, tl, ul, blank=0)
            loss.backward()
            lm_, am_ = far_lm.clone().requires_grad_(), far_am.clone().requires_grad_()
            rnnt_lattice.rnnt_loss_simple(lm_, am_, y, tl, ul, blank=0).backward()   # rescued nodes
            leaf = logits.clone().requires_grad_()
            rnnt_lattice.rnnt_loss_pruned(leaf, y, win.ranges, tl, ul, blank=0).backward()
            _ = (rnnt_lattice.occupancy(x, yt, tl, ul, V - 1, **kw).gamma,
                 rnnt_lattice.best_alignment(x, yt, tl, ul, V - 1, **kw).arc_kinds)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        print("no host sync: smoothed loss, simple loss with rescued nodes, pruned loss, TDT "
              "occupancy / best_alignment", flush=True)


def big_offsets(device):
    """(3, 1100, 1000, 1000) float32: 3.3e9 elements; the last sequence's rows lie past
    2**31 elements. Short sequences keep the reference small: it runs on their slices."""
    B, T, U1, V = 3, 1100, 1000, 1000
    x = torch.empty(B, T, U1, V, device=device)
    x.normal_(generator=torch.Generator(device=device).manual_seed(0))
    lens = [(60, 25), (7, 3), (80, 40)]
    tl = torch.tensor([t for t, _ in lens], device=device)
    ul = torch.tensor([u for _, u in lens], device=device)
    y = torch.randint(1, V, (B, U1 - 1), device=device)
    w = torch.tensor([1.0, -0.5, 2.0], device=device)
    costs, grad = losses_and_grad(x, y, tl, ul, w, "triton")
    for b, (T_b, U_b) in enumerate(lens):
        xs = x[b:b + 1, :T_b, :U_b + 1].double()
        rc, rg = losses_and_grad(xs, y[b:b + 1, :U_b], tl[b:b + 1], ul[b:b + 1], w[b:b + 1].double(),
                                 "torch")
        err = ((grad[b, :T_b, :U_b + 1].double() - rg[0]).abs().max() / rg.abs().max()).item()
        print(f"offsets > 2**31, sequence {b}: loss {costs[b].item():.6g} vs {rc[0].item():.6g}, "
              f"grad err {err:.1e}", flush=True)
        assert abs(costs[b].item() - rc[0].item()) <= 1e-5 * abs(rc[0].item()) and err <= 1e-5
    del x, grad
    torch.cuda.empty_cache()


def sync_free(device):
    x, y, tl, ul, w = inputs(4, 30, 8, 40, torch.float32, device)
    cases = [dict(reduction=r) for r in ("none", "sum", "mean")] + [
        dict(clamp=0.5), dict(fastemit_lambda=0.2), dict(fused_log_softmax=False),
        dict(zero_infinity=True), dict(inplace_grad=True),
        dict(dtype=torch.float16), dict(dtype=torch.bfloat16, clamp=1.0, fastemit_lambda=0.1)]
    for opts in cases:
        opts = dict(opts)
        dtype = opts.pop("dtype", torch.float32)
        leaf = x.to(dtype).clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = rnnt_lattice.rnnt_loss(leaf, y, tl, ul, blank=0, **opts)
            loss.backward(torch.ones_like(loss))
            occ = rnnt_lattice.occupancy(x, y, tl, ul, blank=0)
            ali = rnnt_lattice.best_alignment(x, y, tl, ul, blank=0)
            _ = (occ.node, ali.emit_frames, ali.log_prob)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        print(f"no host sync: {opts or 'plain'} {str(dtype)[6:]}", flush=True)
    for kind in TOPOLOGY_LOSSES:
        n_dur = len(TOPOLOGY_LOSSES[kind].get("durations", ()))
        xk = torch.cat([x, x[..., :n_dur]], -1) if n_dur else x
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            topology_losses_and_grad(kind, xk, y % (x.shape[-1] - 4), tl, ul, w, "triton")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        print(f"no host sync: {kind}", flush=True)


def cuda_graph(device):
    B, T, U, V = 4, 50, 12, 64
    _, y, tl, ul, _ = inputs(B, T, U, V, torch.float32, device)
    opts = dict(blank=0, clamp=0.5, fastemit_lambda=0.1)
    static_x = torch.randn(B, T, U + 1, V, device=device, requires_grad=True)

    def step():
        static_x.grad = None
        loss = rnnt_lattice.rnnt_loss(static_x, y, tl, ul, **opts)
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                     # warm-up: compile the kernels
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    static_x.grad = None
    with torch.cuda.graph(graph):
        static_loss = rnnt_lattice.rnnt_loss(static_x, y, tl, ul, **opts)
        static_loss.backward()
    static_grad = static_x.grad
    for seed in (1, 2, 3):
        new = torch.randn(B, T, U + 1, V, device=device,
                          generator=torch.Generator(device=device).manual_seed(seed))
        with torch.no_grad():
            static_x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        eager = new.clone().requires_grad_()
        eager_loss = rnnt_lattice.rnnt_loss(eager, y, tl, ul, **opts)
        eager_loss.backward()
        assert torch.equal(static_loss, eager_loss), (static_loss, eager_loss)
        assert torch.equal(static_grad, eager.grad)
    print("CUDA graph: replays equal eager", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", action="store_true", help="also the > 2**31-element lattice")
    ap.add_argument("--smoke", action="store_true", help="tiny exactness checks on the CPU "
                    "through the Triton interpreter (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.smoke:
        exactness("cpu", smoke=True)
        topology_exactness("cpu", smoke=True)
        pruned_and_tools("cpu", smoke=True)
    else:
        if not torch.cuda.is_available():
            sys.exit("cuda_checks.py needs a CUDA device (or --smoke)")
        sync_free("cuda")
        cuda_graph("cuda")
        exactness("cuda", smoke=False)
        topology_exactness("cuda", smoke=False)
        pruned_and_tools("cuda", smoke=False)
        if args.big:
            big_offsets("cuda")
    print("OK")


if __name__ == "__main__":
    main()
