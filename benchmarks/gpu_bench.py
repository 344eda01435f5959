"""rnnt_lattice's Triton backend on a CUDA GPU, against the device's copy bandwidth and peers.

For each shape of ``shapes.py`` (same registry and ``make_inputs`` factory as the CPU runs)
and each provider (ours with ``backend="triton"``, ours with ``inplace_grad=True``, and the
peers of ``peers.py`` that import and run on CUDA: torchaudio, warprnnt_numba, nemo_numba,
fast_rnnt, optimized_transducer):

- time: median of CUDA-event timings after warm-up, fwd+bwd (``costs.sum().backward()``,
  fresh ``logits.grad``) and forward only (``torch.no_grad()``);
- memory: peak ``torch.cuda.max_memory_allocated`` during one fwd+bwd, above what was
  allocated before it (the inputs), also as a multiple of the logits' size;
- the floor: a fused loss must read the logits twice (forward, backward) and write the
  gradient once, ``3 x nbytes(logits)``; floor = that / the device's copy bandwidth, which
  is measured once per run on a large buffer (1 GiB: a small tensor's copy is launch-bound
  and says nothing about bandwidth). Each row gives ``x floor`` = fwd+bwd / floor and the
  achieved GB/s;
- agreement: per-sequence losses and gradient against the float64 pure-PyTorch reference
  on the same device (``--agree-max-elems`` bounds it: the reference is memory-hungry).

Run from the repository root, with a CUDA build of PyTorch (Triton ships with it):

    python benchmarks/gpu_bench.py                     # the "gpu" shapes in float32, plus
                                                       # s5 bfloat16 and big float16; all providers
    python benchmarks/gpu_bench.py --quick             # s1 s2, 3 reps
    python benchmarks/gpu_bench.py --shapes s5 --dtype bfloat16 --providers rnnt_lattice_triton torchaudio
    benchmarks/.venv-peers/bin/python benchmarks/gpu_bench.py   # with the peers' venv

Results go to ``benchmarks/results/gpu_bench-<date>.{csv,json,md}``. Without a CUDA device
it exits at once with a message (status 2).
"""
from __future__ import annotations

import common  # first: sets the thread env vars before torch is imported

import argparse                 # noqa: E402
import datetime as _dt          # noqa: E402
import statistics               # noqa: E402
import sys                      # noqa: E402

import torch                    # noqa: E402

import peers                    # noqa: E402
import shapes                   # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
DEFAULT_SHAPES = ["gpu"]
# Half-precision rows run by default next to the float32 ones: (shape, dtype).
DEFAULT_HALF = [("s5", "bfloat16"), ("big", "float16")]
PEERS = ["torchaudio", "warprnnt_numba", "nemo_numba", "fast_rnnt", "optimized_transducer"]


def _ours_triton(inplace_grad: bool):
    def load():
        import rnnt_lattice
        import rnnt_lattice.gpu              # noqa: F401  (fail here if Triton is missing)

        def fn(logits, targets, logit_lengths, target_lengths, blank):
            return rnnt_lattice.rnnt_loss(logits, targets, logit_lengths, target_lengths,
                                          blank=blank, reduction="none", backend="triton",
                                          inplace_grad=inplace_grad)
        return fn
    return load


# Ours on the GPU; the peers' adapters are reused from peers.py unchanged.
OURS = {
    "rnnt_lattice_triton": peers.Provider("rnnt_lattice_triton", "rnnt-lattice",
                                          _ours_triton(False), "backend='triton'"),
    "rnnt_lattice_triton_inplace": peers.Provider(
        "rnnt_lattice_triton_inplace", "rnnt-lattice", _ours_triton(True),
        "backend='triton', inplace_grad=True (gradient written over the logits)"),
}


def provider(name: str) -> peers.Provider:
    return OURS[name] if name in OURS else peers.PROVIDERS[name]


# --------------------------------------------------------------------------- measuring
def cuda_time(fn, warmup: int, reps: int) -> dict:
    """Median seconds of ``fn()`` timed with CUDA events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return {"median": statistics.median(samples), "min": min(samples), "reps": reps}


def copy_bandwidth(warmup: int, reps: int, nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth in GB/s, one read and one write per byte, on a ``nbytes``
    buffer (large enough that launch latency does not count)."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").normal_()
    buf = torch.empty_like(x)
    t = cuda_time(lambda: buf.copy_(x), warmup, reps)["median"]
    del x, buf
    torch.cuda.empty_cache()
    return 2 * nbytes / t / 1e9


def make_cuda_inputs(shape: shapes.Shape, dtype, seed: int) -> shapes.Inputs:
    x = shapes.make_inputs(shape, dtype=dtype, seed=seed)
    return shapes.Inputs(*(t.cuda() for t in (x.logits, x.targets, x.logit_lengths,
                                              x.target_lengths)), x.blank)


def fwd_bwd(fn, x: shapes.Inputs, leaf: torch.Tensor):
    leaf.grad = None
    costs = fn(leaf, x.targets, x.logit_lengths, x.target_lengths, x.blank)
    costs.sum().backward()
    return costs


def measure(name: str, fn, x: shapes.Inputs, args) -> dict:
    inplace = name.endswith("_inplace")
    base = x.logits.detach()
    # In-place mode destroys its logits: each call gets a fresh copy, outside the timing
    # (copy first, then start the events) for the fwd+bwd, which is what a training step
    # with a fresh joiner output does.
    leaf = base.clone().requires_grad_()

    def step():
        if inplace:
            leaf.data.copy_(base)
        fwd_bwd(fn, x, leaf)

    if inplace:
        for _ in range(args.warmup):
            step()
        samples = []
        for _ in range(args.reps):
            leaf.data.copy_(base)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fwd_bwd(fn, x, leaf)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        t_fb = statistics.median(samples)
    else:
        t_fb = cuda_time(step, args.warmup, args.reps)["median"]

    def forward():
        with torch.no_grad():
            fn(base, x.targets, x.logit_lengths, x.target_lengths, x.blank)
    t_f = cuda_time(forward, args.warmup, args.reps)["median"]

    # Peak memory of one fwd+bwd above what exists before it (inputs, the leaf).
    leaf.grad = None
    if inplace:
        leaf.data.copy_(base)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fwd_bwd(fn, x, leaf)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return {"fwd_bwd_s": t_fb, "fwd_s": t_f, "peak_bytes": peak}


def agreement(fn, x: shapes.Inputs, name: str) -> dict:
    """Relative loss and gradient errors against the float64 reference on the same numbers."""
    import rnnt_lattice
    ref_leaf = x.logits.double().requires_grad_()
    ref = rnnt_lattice.rnnt_loss(ref_leaf, x.targets, x.logit_lengths, x.target_lengths,
                                 blank=x.blank, reduction="none", backend="torch")
    ref.sum().backward()
    leaf = x.logits.detach().clone().requires_grad_()
    costs = fwd_bwd(fn, x, leaf)
    if costs.dim() == 0:                           # a provider returning only the batch sum
        ref = ref.sum()
    loss_err = ((costs.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    grad_err = ((leaf.grad.double() - ref_leaf.grad).abs().max()
                / ref_leaf.grad.abs().max().clamp_min(1e-30)).item()
    return {"loss_rel_err": loss_err, "grad_rel_err": grad_err}


# --------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES)
    ap.add_argument("--providers", nargs="+", default=list(OURS) + PEERS)
    ap.add_argument("--dtype", choices=list(DTYPES), default=None,
                    help="override the shapes' dtype (float32 unless stated in shapes.py)")
    ap.add_argument("--quick", action="store_true", help="s1 and s2, 3 reps")
    ap.add_argument("--no-half", action="store_true",
                    help=f"skip the default half-precision rows {DEFAULT_HALF}")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--agree-max-elems", type=float, default=5e7,
                    help="skip the float64 agreement check above this many logit elements")
    ap.add_argument("--stem", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        _no_cuda()
    half = [] if (args.no_half or args.quick or args.shapes != DEFAULT_SHAPES or args.dtype) \
        else DEFAULT_HALF
    if args.quick:
        if args.shapes == DEFAULT_SHAPES:
            args.shapes = ["quick"]
        args.reps, args.warmup = 3, 1
    dtype = DTYPES[args.dtype] if args.dtype else None
    cases = [(shape, dtype) for shape in shapes.resolve(args.shapes)]
    cases += [(shapes.SHAPES[name], DTYPES[dt]) for name, dt in half]

    common.apply_threads()
    meta = common.machine_info()
    props = torch.cuda.get_device_properties(0)
    meta.update({"gpu": props.name, "gpu_mem_gib": round(props.total_memory / 2**30, 1),
                 "cuda": torch.version.cuda, "device_capability": f"{props.major}.{props.minor}"})
    print(f"# {props.name}, CUDA {torch.version.cuda}, torch {torch.__version__}", flush=True)

    fns = {}
    for name in args.providers:
        try:
            fns[name] = provider(name).get()
        except ImportError as err:
            print(f"  {name}: unavailable ({err})", flush=True)
    copy_gbs = copy_bandwidth(args.warmup, args.reps)
    meta["copy_GBps"] = copy_gbs
    print(f"# copy bandwidth {copy_gbs:.4g} GB/s (1 GiB buffer)", flush=True)
    warm = make_cuda_inputs(shapes.SHAPES["s1"], dtype, args.seed)
    for name, fn in list(fns.items()):             # JIT compilation / autotuning, untimed
        try:
            fwd_bwd(fn, warm, warm.logits.clone().requires_grad_())
        except Exception as err:                   # a peer without CUDA support, say
            print(f"  {name}: fails on CUDA ({type(err).__name__}: {err})", flush=True)
            del fns[name]

    rows = []
    for shape, dt in cases:
        x = make_cuda_inputs(shape, dt, args.seed)
        nbytes = x.logits.numel() * x.logits.element_size()
        floor_s = 3 * nbytes / (copy_gbs * 1e9)
        for name, fn in fns.items():
            r = {"shape": shape.name, "shape_desc": shape.describe(), "provider": name,
                 "dtype": str(x.logits.dtype).replace("torch.", ""), "logits_bytes": nbytes,
                 "copy_GBps": copy_gbs, "floor_s": floor_s}
            try:
                r.update(measure(name, fn, x, args))
                r["v_pass_GBps"] = 3 * nbytes / r["fwd_bwd_s"] / 1e9
                r["pct_of_copy"] = 100 * r["v_pass_GBps"] / copy_gbs
                r["x_floor"] = r["fwd_bwd_s"] / floor_s
                r["peak_x_logits"] = r["peak_bytes"] / nbytes
                if x.logits.numel() <= args.agree_max_elems:
                    r.update(agreement(fn, x, name))
                r["status"] = "ok"
            except Exception as err:
                r["status"] = f"error: {type(err).__name__}: {str(err)[:160]}"
                torch.cuda.empty_cache()
            rows.append(r)
            if r["status"] == "ok":
                print(f"{shape.name:7s} {r['dtype']:8s} {name:28s} fwd+bwd "
                      f"{common.fmt_s(r['fwd_bwd_s']):>10s} = {r['x_floor']:5.2f} x floor "
                      f"{common.fmt_s(floor_s)}  fwd {common.fmt_s(r['fwd_s']):>10s}  peak "
                      f"{r['peak_bytes'] / 2**20:9.1f} MiB ({r['peak_x_logits']:.2f} x logits)  "
                      f"grad err {r.get('grad_rel_err', float('nan')):.1e}", flush=True)
            else:
                print(f"{shape.name:7s} {r['dtype']:8s} {name:28s} {r['status']}", flush=True)
        del x
        torch.cuda.empty_cache()

    hdr = ["shape", "dtype", "provider", "floor", "fwd+bwd", "x floor", "fwd", "peak memory",
           "x logits", "GB/s", "loss err", "grad err"]
    body = []
    for r in rows:
        if r["status"] != "ok":
            body.append([f"{r['shape']} ({r['shape_desc']})", r["dtype"], r["provider"],
                         r["status"]] + [""] * (len(hdr) - 4))
            continue
        body.append([f"{r['shape']} ({r['shape_desc']})", r["dtype"], r["provider"],
                     common.fmt_s(r["floor_s"]), common.fmt_s(r["fwd_bwd_s"]),
                     f"{r['x_floor']:.2f}", common.fmt_s(r["fwd_s"]),
                     f"{r['peak_bytes'] / 2**20:.1f} MiB", f"{r['peak_x_logits']:.2f}",
                     f"{r['v_pass_GBps']:.3g}",
                     f"{r['loss_rel_err']:.1e}" if "loss_rel_err" in r else "-",
                     f"{r['grad_rel_err']:.1e}" if "grad_rel_err" in r else "-"])
    md = (f"GPU: {meta['gpu']} ({meta['gpu_mem_gib']} GiB, sm {meta['device_capability']}), "
          f"CUDA {meta['cuda']}. Medians of {args.reps} CUDA-event timings after {args.warmup} "
          f"warm-up. floor = 3 x logits bytes / copy bandwidth ({copy_gbs:.4g} GB/s, measured "
          f"on a 1 GiB buffer in the same run); x floor = fwd+bwd / floor; GB/s = 3 x logits "
          f"bytes / fwd+bwd; errors against the float64 reference.\n\n" + common.md_table(hdr, body))
    stem = args.stem or ("gpu_bench-" + _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
                         + ("-quick" if args.quick else ""))
    paths = common.write_results(stem, meta, rows, md)
    print("wrote", ", ".join(paths.values()))


def _no_cuda():
    print("gpu_bench.py: no CUDA device is visible to torch "
          f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}). It needs a "
          "GPU and a CUDA build of PyTorch (Triton ships with it). ", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
