"""Registers, spills and vector loads of every Triton kernel, compiled for a CUDA target
without a GPU.

    python benchmarks/kernel_resources.py [--sm 90] [--V 500 1000 1024 1025 5000]

Each kernel is compiled with the constexprs and ``num_warps`` the backend launches it with
at that vocabulary (``gpu._tiles``, ``gpu._v_align``, ``gpu._block_u``,
``gpu._window_dp_warps``), float32 logits, int32 ids, the regular topology, TDT with
durations 0..4 and multi-blank with big blanks 2, 4, 8, through ``triton.compile`` for ``GPUTarget("cuda", sm,
32)``: Triton bundles ``ptxas``, no device is needed. For each compiled kernel the table
gives

* registers per thread and the stack frame a thread needs (bytes: registers spilled to local
  memory; 0 without spills), from ``cuobjdump --dump-resource-usage`` on the cubin (Triton
  ships ``cuobjdump`` under ``triton/backends/nvidia/bin``; it reports no spill counts of
  its own);
* where a kernel with a stack spills: its local loads and stores (``LDL``, ``STL``) inside
  the loops of its SASS out of all of them (:func:`loop_spills`, ``nvdisasm``): a spill
  outside the loops costs once a program, one in a loop every turn of it;
* the global loads of the PTX by width: ``v4``/``v2`` vector loads against scalar ones
  (``ld.global`` without a vector suffix), which tells whether the rows of the logits are
  read with vector loads at that V.

The joiner's kernel path (``gpu/joint.py``) is compiled with the blocks it launches, at the
widths ``--H`` and each V, bfloat16 and float32 operands (TF32 products), with H and V
specialised as a launch specialises them (divisible by 16 where they are).

Every kernel is tried (one that does not compile gets a row saying so and a line on
stderr, and the exit status is 1), and each compiled kernel's TTIR is searched for the loop
that Triton 3.6's CUDA compiler rejects (``thread_locality_hazards``; also a failure).
Run it with the Triton of the GPU machine before a GPU session (Triton 3.6 there): a
venv with ``torch==2.13.0`` and ``triton==3.6.0`` from the registry, then
``PYTHONPATH=src <venv>/bin/python benchmarks/kernel_resources.py``.

``docs/benchmarks.md`` ("Triton kernels on sm_90: registers, spills, vector loads") has
the table and the command.
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)      # compiled kernels, not interpreted

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sass import sass_lines, spills_in_loops  # noqa: E402

# the joiner kernels' operands (gpu/joint.py) are in the input dtype too, their sums in
# the costs' (float32; float64 for float64)
INPUT_PTRS = {"logits_ptr", "grad_ptr", "am_ptr", "lm_ptr", "enc_ptr", "pred_ptr", "w_ptr",
              "bias_ptr", "h_ptr", "dz_ptr", "dh_ptr", "am_cols_ptr", "lm_cols_ptr", "g_am_ptr",
              "g_lm_ptr", "x_ptr", "cols_ptr", "uni_ptr", "g_cols_ptr", "sums_ptr"}
INT_PTRS = {"targets_ptr", "logit_lengths_ptr", "target_lengths_ptr"}
INT64_PTRS = {"row_nodes_ptr", "boundary_ptr", "starts_ptr", "t_end_ptr", "u_end_ptr",
              "idx_ptr", "order_ptr", "bounds_ptr"}
INT32_PTRS = {"arg_ptr"}
INT8_PTRS = {"best_kind_ptr", "code_ptr"}
# bool tensors, read as their bytes (a uint8 view)
UINT8_PTRS = {"resc_ptr", "am_bad_ptr", "lm_bad_ptr", "keep_ptr", "row_ok_ptr", "need_ptr",
              "row_bad_ptr"}
COST_PTRS = {"costs_ptr", "upstream_ptr", "db_ptr", "de_ptr", "dp_ptr"}
FP32_PTRS = {"ok_ptr", "nan_ptr", "nan_rows_ptr",   # the input check's flags and NaN rows,
             "check_ptr"}                          # the gradient pass's recomputation check
FLOATS = {f"{o}_{p}" for o in ("clamp", "scale", "sigma", "delay", "c", "sa", "sl")
          for p in ("hi", "mid", "lo")}


def signature(fn, const, x="fp32", idt="i32", costs="fp32"):
    """Triton's signature of kernel ``fn`` by its parameters' names: the logits, gradient
    and joiner halves in the input dtype ``x``, ids and lengths in ``idt``, the node -> row
    map, boundary and window starts int64, the max-plus pointers int8, costs and upstream
    gradient in ``costs``, every other pointer (the lattice) float64, the options' float32
    parts ``fp32``, other plain arguments int32 (also read by tests/test_triton.py's compile
    test). A parameter declared ``tl.constexpr`` must be in ``const`` (ValueError): typed as
    an argument it would compile as a runtime value, another kernel than the one launched."""
    sig = {}
    for p, param in inspect.signature(fn.fn).parameters.items():
        if p in const:
            sig[p] = "constexpr"
        elif str(param.annotation).endswith("constexpr"):
            # typed as a plain argument it would compile as a runtime value, not as launched
            raise ValueError(f"{fn.fn.__name__}: constexpr {p} missing from the constants")
        elif p in INPUT_PTRS:
            sig[p] = "*" + x
        elif p in INT_PTRS:
            sig[p] = "*" + idt
        elif p in INT64_PTRS:
            sig[p] = "*i64"
        elif p in INT8_PTRS:
            sig[p] = "*i8"
        elif p in UINT8_PTRS:
            sig[p] = "*u8"
        elif p in INT32_PTRS:
            sig[p] = "*i32"
        elif p in COST_PTRS:
            sig[p] = "*" + costs
        elif p in FP32_PTRS:
            sig[p] = "*fp32"
        elif p.endswith("_ptr"):
            sig[p] = "*fp64"
        elif p in FLOATS:
            sig[p] = "fp32"
        else:
            sig[p] = "i32"
    return sig


def compile_as_launched(fn, const, warps: int, stages: int, sm: int = 90, x: str = "fp32",
                        ints=None, maxnreg: int | None = None):
    """``fn`` compiled for ``sm`` as a launch on CUDA tensors specialises it: every pointer
    16-byte aligned (``do_not_specialize`` covers the shape integers only), and the
    specialised ints of ``ints`` (name -> value) divisible by 16 where they are; ``maxnreg``
    the launch's cap on registers a thread, if it has one; floating-point fusion as every
    launch states it (``gpu._launch.FP_FUSION``)."""
    from rnnt_lattice.gpu._launch import FP_FUSION
    sig = signature(fn, const, x)
    ints = ints or {}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (p, t) in enumerate(sig.items())
             if t.startswith("*") or ints.get(p, 1) % 16 == 0}
    options = dict(num_warps=warps, num_stages=stages, enable_fp_fusion=FP_FUSION)
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(ASTSource(fn, sig, const, attrs=attrs),
                          target=GPUTarget("cuda", sm, 32), options=options)


def compile_launch(fn, const, options: dict, sm: int = 90, x: str = "fp32", ints=None):
    """:func:`compile_as_launched` with a launch's options as a dict (``num_warps``,
    ``num_stages``, ``maxnreg``; Triton's defaults where absent)."""
    return compile_as_launched(fn, const, options.get("num_warps", 4),
                               options.get("num_stages", 3), sm, x, ints,
                               options.get("maxnreg"))


# A multiprocessor's registers and shared memory (bytes, the most its blocks may hold
# together; each block also reserves 1 KiB), warps and blocks, by compute capability
# (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability").
SM_LIMITS = {80: dict(registers=65536, shared=167936, warps=64, blocks=32),
             90: dict(registers=65536, shared=233472, warps=64, blocks=32)}


def programs_per_sm(registers: int, warps: int, shared: int, sm: int = 90) -> int:
    """How many programs (blocks) of ``warps`` warps, ``registers`` a thread and ``shared``
    bytes of shared memory fit on one multiprocessor at once: the least of the register
    file (allocated a warp at a time, in units of 256 registers), the shared memory, the
    warps and the blocks it holds."""
    lim = SM_LIMITS[sm]
    per_warp = -(-registers * 32 // 256) * 256
    return min(lim["registers"] // max(per_warp * warps, 1),
               lim["shared"] // (shared + 1024), lim["warps"] // warps, lim["blocks"])


def resources(cubin: bytes) -> tuple[int, int]:
    """``(registers, stack bytes)`` of a cubin's kernel (cuobjdump)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    reg = int(re.search(r"REG:(\d+)", out).group(1))
    stack = int(re.search(r"STACK:(\d+)", out).group(1)) if "STACK:" in out else 0
    return reg, stack


def loop_spills(cubin: bytes) -> str:
    """Where a kernel's spills are (``sass.spills_in_loops`` of its SASS)."""
    return spills_in_loops(sass_lines(cubin))


def loads(ptx: str) -> str:
    """Global loads of the PTX by width: ``v4 a, v2 b, scalar c``."""
    lines = [ln for ln in ptx.splitlines() if "ld.global" in ln]
    v4 = sum(".v4." in ln for ln in lines)
    v2 = sum(".v2." in ln for ln in lines)
    return f"v4 {v4}, v2 {v2}, scalar {len(lines) - v4 - v2}"


def variants(V_list):
    import torch
    from rnnt_lattice import gpu, topology
    for tname, topo in (("regular", topology.regular()), ("tdt", topology.tdt([0, 1, 2, 3, 4])),
                        ("multiblank", topology.multiblank(4095, [2, 4, 8]))):
        n_dur = topo.n_durations
        for V in V_list:
            for which, name, flags in (("row", "_row_kernel", dict(FUSED=True)),
                                       ("grad", "_grad_kernel", dict(FUSED=True, CLAMP=True,
                                                                     COSTS32=True,
                                                                     CHECK=0.0))):
                # as the backend launches them: the gradient pass reads unaligned rows by
                # their whole 16-byte groups only with gpu.SPAN_GRAD
                span = (gpu._span(V, n_dur, torch.float32)
                        if which == "row" or gpu.SPAN_GRAD else 0)
                rows, block_v, warps = gpu._tiles(V, 1 << 20, which, n_dur, span)
                const = dict(gpu._kernel_kinds(topo, which), ROWS=rows, BLOCK_V=block_v,
                             BLOCK_DUR=gpu._pow2(n_dur, 1 << 30),
                             V_ALIGN=gpu._v_align(V + n_dur, n_dur), ACC=tl.float32,
                             BOUNDARY=False, LAYOUT=0, SPAN=span, **flags,
                             **(dict(DUR_LAST=bool(n_dur) and gpu.GRAD_DURATIONS_LAST)
                                if which == "grad" else {}),
                             **(dict(WIDE=False,
                                     PREFETCH=gpu.SPAN_PREFETCH if span else gpu.ROW_PREFETCH,
                                     LANES=gpu._row_lanes(torch.float32, block_v),
                                     EARLY=gpu.ROW_EARLY)
                                if which == "row" else {}))
                yield (f"{name} {tname}", V, name, const, warps, 3)
                if which == "grad":
                    # a fused tile's gradient pass, its recomputation checked in the pass
                    yield (f"{name} {tname} tile, CHECK", V, name,
                           dict(const, CHECK=1e-4, LAYOUT=2), warps, 3)
        terms = dict(SIGMA=False, DELAY_ON=False, BOUNDARY=False)
        yield (f"_reads_kernel {tname}", "-", "_reads_kernel",
               dict(gpu._kernel_kinds(topo, "reads"), BLOCK=gpu.BLOCK_NODES, **terms), 4, 3)
        for U1 in (41, 81, 151):
            yield (f"_lattice_kernel {tname}", f"U+1={U1}", "_lattice_kernel",
                   dict(gpu._kernel_kinds(topo, "lattice"), MAX_SEMIRING=False,
                        NAN_ROWS=True, BLOCK_U=gpu._block_u(U1), **terms,
                        **gpu._onchip(U1, topo)),
                   gpu._lattice_warps(gpu._block_u(U1)), 1)
    yield ("_gamma_kernel regular", "-", "_gamma_kernel",
           dict(gpu._kernel_kinds(topology.regular(), "lattice"), SIGMA=False, DELAY_ON=False,
                BOUNDARY=False, BLOCK=gpu.BLOCK_NODES), 4, 3)
    for S in (128, 1024, 8192):
        block_s = gpu._pow2(S, 1 << 16)
        yield ("_window_dp_kernel", f"S={S}", "_window_dp_kernel", dict(BLOCK_S=block_s),
               gpu._window_dp_warps(block_s), 3)
    for S in (128, 1024):                      # prune_ranges(method="k2"): S starts
        yield ("_k2_starts_kernel", f"S={S}", "_k2_starts_kernel",
               dict(BLOCK_T=gpu.K2_TILE // S, BLOCK_S=S, BLOCK_SCAN=gpu.K2_SCAN), 4, 3)
    for V in V_list:
        for backward in (False, True):
            yield (f"_simple_rescue_kernel {'bwd' if backward else 'fwd'}", V,
                   "_simple_rescue_kernel",
                   dict(BACKWARD=backward, BLOCK_NODES=gpu.RESCUE_BLOCK_NODES,
                        BLOCK_V=gpu._pow2(V, gpu.RESCUE_BLOCK_V)), 4, 3)
        for am in (True, False):           # its backward in a fixed order (deterministic mode)
            yield (f"_simple_rescue_rows_kernel {'am' if am else 'lm'}", V,
                   "_simple_rescue_rows_kernel",
                   dict(AM=am, BLOCK_K=gpu._pow2(101 if am else 400, gpu.RESCUE_ROWS_BLOCK_K),
                        BLOCK_V=gpu._pow2(V, gpu.RESCUE_BLOCK_V)), 4, 3)
    for V in V_list:                           # the simple losses' rows
        tiles = gpu._rows_tiles(V, 101)
        # V specialised as a launch specialises it (the 7th field: the ints' values)
        yield ("_simple_rows_kernel", V, "_simple_rows_kernel", dict(tiles, CONTIG=True), 4, 3,
               {"V": V})
        for ordered in (False, True):      # the entries with atomics, or in order
            yield (f"_simple_rows_grad_kernel{' ordered' if ordered else ''}", V,
                   "_simple_rows_grad_kernel", dict(tiles, UNI=True, COLS=True, ORDERED=ordered),
                   4, 3, {"V": V})
    # do_rnnt_pruning's backward on a contiguous gradient (a launch specialises a unit
    # stride to the constant 1)
    yield ("_rows_sum_kernel", "D=1024", "_rows_sum_kernel",
           dict(ACC=tl.float32, BLOCK_D=gpu.ROWS_SUM_BLOCK_D, BLOCK_M=gpu.ROWS_SUM_BLOCK_M,
                CHUNK=gpu.ROWS_SUM_CHUNK, s_gd=1), 4, 3,
           {"D": 1024, "s_gn": 1024})
    for U1 in (41, 101):                       # the simple losses' arc terms
        block_t, block_u = gpu._arc_tiles(400, U1)
        for mix in (False, True):
            tiles = dict(MIX=mix, BLOCK_T=block_t, BLOCK_U=block_u)
            yield (f"_arc_terms_kernel mix={int(mix)}", f"U+1={U1}", "_arc_terms_kernel",
                   tiles, gpu.ARC_WARPS, 3)
            yield (f"_arc_terms_grad_kernel mix={int(mix)}", f"U+1={U1}",
                   "_arc_terms_grad_kernel", dict(tiles, HAS_GB=True, HAS_GE=True),
                   gpu.ARC_WARPS, 3)
    yield ("_arc_terms_cols_kernel", "-", "_arc_terms_cols_kernel",
           dict(MIX=True, BLOCK_TB=gpu.ARC_COLS[0], BLOCK_U=gpu.ARC_COLS[1]), 4, 3)
    yield ("_input_check_kernel", "-", "_input_check_kernel",
           dict(LABELS=True, NO_BLANK=True, CLASSES=(), BOUNDARY=False,
                BLOCK_B=gpu.INPUT_CHECK_BLOCK_B, BLOCK_U=gpu.INPUT_CHECK_BLOCK_U), 4, 3)


def joint_constants(topo, which: str, tile: dict, precision: str) -> dict:
    """The constexprs of the joiner's pass ``which`` ("row", "grad") for ``topo`` with the
    blocks of ``tile`` (``joint._tiles``: its launch options left out) and the products'
    ``precision`` ("ieee", "tf32"): tanh, a bias, the fused log-softmax, no boundary, clamp
    on, float32 sums, the row pass for a gradient, as ``gpu.joint`` launches them."""
    from rnnt_lattice import gpu
    from rnnt_lattice.gpu import joint
    kinds = gpu._kernel_kinds(topo, f"joint_{which}")
    const = dict(kinds, ACT=0, HAS_BIAS=True, FUSED=True, BOUNDARY=False, ACC=tl.float32,
                 PRECISION=precision, DOT_F32=False, BLOCK_DUR=joint._block_dur(topo.n_durations),
                 **joint.block_constants(tile))
    if which == "grad":
        const["CLAMP"] = True
    else:
        const["WIDE"] = False
        const["ENTRIES"] = True                # (a forward for a gradient)
    return const


def joint_variants(V_list, H_list):
    """The joiner's kernel path (``gpu.joint``): ``(label, shape, name, constexprs, launch
    options, operand dtype, specialised ints)`` of its row and gradient passes (regular;
    TDT with durations 0..4; multi-blank with big blanks 2, 4, 8) and its act-grad pass."""
    import torch
    from rnnt_lattice import topology
    from rnnt_lattice.gpu import joint
    for tname, topo in (("regular", topology.regular()), ("tdt", topology.tdt([0, 1, 2, 3, 4])),
                        ("multiblank", topology.multiblank(4095, [2, 4, 8]))):
        for x, dtype, precision in (("bf16", torch.bfloat16, "ieee"), ("fp32", torch.float32, "tf32")):
            for V in V_list:
                for H in H_list:
                    for which in ("row", "grad"):
                        tile = joint._tiles(which, dtype)
                        const = joint_constants(topo, which, tile, precision)
                        label = f"_joint_{which}_kernel {tname} {x}"
                        yield (label, f"{V}, H={H}", f"_joint_{which}_kernel", const,
                               joint.launch_options(tile), x,
                               dict(V_tok=V - topo.n_durations, H=H))
    for H in H_list:
        for x in ("bf16", "fp32", "fp64"):         # the products by cuBLAS: any dtype
            yield (f"_joint_hidden_kernel {x}", f"H={H}", "_joint_hidden_kernel",
                   dict(joint.block_constants(joint.HIDDEN), ACT=0, BOUNDARY=False,
                        ACC=tl.float64 if x == "fp64" else tl.float32),
                   dict(num_stages=3, **joint.launch_options(joint.HIDDEN)), x, dict(H=H))
        yield ("_joint_act_grad_kernel", f"H={H}", "_joint_act_grad_kernel",
               dict(joint.block_constants(joint.ACT_GRAD), ACT=0),
               dict(num_stages=3, **joint.launch_options(joint.ACT_GRAD)), "bf16", dict(H=H))


# Triton 3.6's ``OptimizeThreadLocality`` pass (CUDA) rewrites a loop that accumulates a
# row reduction of a load (``acc = acc + tl.sum(tl.load(...), axis=-1)``, also max, min
# and products) and asserts that the loop's result has a single use after it: a kernel
# that reads such an accumulator twice does not compile there, while the interpreter and
# newer Triton accept it. ``thread_locality_hazards`` finds the pattern in the TTIR.
_SSA = r"%[\w.$-]+"
_LOC = re.compile(r"\s+loc\(.*\)\s*$")
_FLOAT_COMBINE = {"addf", "mulf", "maxnumf", "maximumf", "minnumf", "minimumf"}


def _uses(lines, name):
    """The lines that read the SSA value ``name`` (not the one that defines it)."""
    pat = re.compile(re.escape(name) + r"(?![\w.$#-])")
    return [i for i, ln in enumerate(lines)
            if pat.search(ln) and not re.match(r"\s*" + re.escape(name) + r"\s*=", ln)]


def thread_locality_hazards(ttir: str) -> list:
    """The loop accumulators of ``ttir`` (a kernel's TTIR, ``compiled.asm["ttir"]``) that
    Triton 3.6 fails to compile for CUDA (``loopResult.hasOneUse()``): a float row
    reduction (innermost axis) of a loaded tensor, directly in an ``scf.for`` body,
    combined with a loop-carried value initialised by a constant and yielded, whose loop
    result is then read more than once. Returns one line per hazard (empty: none). The
    test is conservative: it does not model the pass's layout conditions."""
    lines = [_LOC.sub("", ln) for ln in ttir.splitlines()]
    opens = [ln.rstrip().endswith("{") for ln in lines]
    closes = [ln.lstrip().startswith("}") for ln in lines]
    defs = {}                  # name -> [(line, text)]: the printer reuses names across regions
    for i, ln in enumerate(lines):
        m = re.match(r"\s*(" + _SSA + r")(?::\d+)?\s*=\s*(.*)$", ln)
        if m:
            defs.setdefault(m.group(1), []).append((i, m.group(2)))

    def defined_by(name, at, op):
        before = [text for k, text in defs.get(name, ()) if k < at]
        return bool(before) and before[-1].startswith(op)

    hazards = []
    for i, ln in enumerate(lines):
        m = re.match(r"\s*(" + _SSA + r")(?::(\d+))?\s*=\s*scf\.for .*iter_args\((.*?)\)\s*->", ln)
        if not m:
            continue
        result, n = m.group(1), int(m.group(2) or 1)
        iters = [tuple(a.strip().split(" = ")) for a in m.group(3).split(",")]
        depth, end = 0, i
        for j in range(i, len(lines)):          # the loop's body: up to its closing brace
            depth += opens[j] - closes[j]
            if depth == 0:
                end = j
                break
        depth, scope = 0, len(lines)
        for j in range(end + 1, len(lines)):    # the rest of the region the loop is in
            depth += opens[j] - closes[j]
            if depth < 0:
                scope = j
                break
        body, d = [], 0
        for j in range(i + 1, end):             # the body's own operations (depth 0)
            if d == 0:
                body.append(j)
            d += opens[j] - closes[j]
        for j in body:
            r = re.match(r"\s*(" + _SSA + r") = \"tt\.reduce\"\((" + _SSA + r")\) <\{axis = (\d+)", lines[j])
            if not r:
                continue
            red, src, axis = r.group(1), r.group(2), int(r.group(3))
            combine = re.search(r"arith\.(\w+)", lines[j + 2])
            rank = re.search(r"\) : \(tensor<([\dx]+)x\w+>\)", " ".join(lines[j:j + 6]))
            if (not combine or combine.group(1) not in _FLOAT_COMBINE or not rank
                    or axis != rank.group(1).count("x") or not defined_by(src, j, "tt.load")):
                continue
            users = [k for k in _uses(lines, red) if i < k < end]
            if len(users) != 1:
                continue
            upd = re.match(r"\s*(" + _SSA + r") = arith\.\w+ (" + _SSA + r"), (" + _SSA + r")",
                           lines[users[0]])
            args = [a for a, _ in iters]
            if not upd or not {upd.group(2), upd.group(3)} & set(args):
                continue
            acc = upd.group(2) if upd.group(2) in args else upd.group(3)
            if not defined_by(iters[args.index(acc)][1], i, "arith.constant"):
                continue
            yields = [k for k in _uses(lines, upd.group(1)) if i < k < end]
            if len(yields) != 1 or "scf.yield" not in lines[yields[0]]:
                continue
            k = args.index(acc)
            out = f"{result}#{k}" if n > 1 else result
            reads = len(_uses(lines[end + 1:scope], out))
            if reads != 1:
                hazards.append(f"the loop result {out} (accumulator {acc} of the reduction "
                               f"{red}) is read {reads} times after the loop")
    return hazards


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sm", type=int, default=90)
    ap.add_argument("--V", type=int, nargs="*", default=[500, 1000, 1024, 1025, 5000])
    ap.add_argument("--H", type=int, nargs="*", default=[512, 640],
                    help="the joiner widths of the kernel path's rows")
    ap.add_argument("--joint-V", type=int, nargs="*", default=[1024, 8198],
                    help="the vocabularies of the kernel path's rows")
    ap.add_argument("--only", nargs="*", default=None, metavar="KERNEL",
                    help="only the rows of these kernels (names as in the table)")
    args = ap.parse_args(argv)
    from rnnt_lattice.gpu import joint, kernels
    print(f"triton {triton.__version__}, sm_{args.sm}, float32 logits (the joiner's kernel "
          f"path: the operands as stated)")
    print("| kernel | V / shape | num_warps | registers | stack (bytes: spills) "
          "| spills in loops / all "
          "| global loads in the PTX |")
    print("|---|---|---|---|---|---|---|")
    rows = ([(*v[:4], dict(num_warps=v[4], num_stages=v[5]), "fp32", v[6] if len(v) > 6 else {})
             for v in variants(args.V)]
            + list(joint_variants(args.joint_V, args.H)))
    failed = []
    for label, shape, name, const, options, x, ints in rows:
        if args.only is not None and name not in args.only:
            continue
        warps = options["num_warps"]
        fn = getattr(joint if name.startswith("_joint") else kernels, name)
        try:
            compiled = compile_launch(fn, const, options, args.sm, x, ints)
        except Exception as err:        # every kernel is tried: a GPU's Triton may fail several
            last = [line for line in str(err).splitlines() if line.strip()][-1:] or [type(err).__name__]
            failed.append(f"{label} ({shape}): {type(err).__name__}: {last[0][:160]}")
            print(f"| {label} | {shape} | {warps} | does not compile | - | - | - |", flush=True)
            continue
        for hazard in thread_locality_hazards(compiled.asm["ttir"]):
            failed.append(f"{label} ({shape}): Triton 3.6 would not compile it: {hazard}")
        reg, stack = resources(compiled.asm["cubin"])
        width = loads(compiled.asm["ptx"])
        where = loop_spills(compiled.asm["cubin"]) if stack else "-"
        print(f"| {label} | {shape} | {warps} | {reg} | {stack} | {where} | {width} |",
              flush=True)
    for line in failed:
        print(f"kernel_resources: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
