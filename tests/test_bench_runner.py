"""benchmarks/run.py (the one runner, --device cpu|cuda --mode floor|peers) and the registry
and timing primitives it runs on (benchmarks/shapes.py, timing.py). Tiny shapes only; the CUDA path is
exercised through a stand-in device on the CPU (same measurement loop and tables, wall clock)."""
import importlib.util
import json
import os
import pathlib
import re
import sys

import pytest
import torch

from rnnt_lattice._cli_util import set_threads

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "benchmarks"
RESULTS = BENCH_DIR / "results"
sys.path.insert(0, str(BENCH_DIR))            # the benchmark scripts import each other by name
import shapes  # noqa: E402
import timing  # noqa: E402
from support.backends import NO_TRITON  # noqa: E402


@pytest.fixture(scope="module")
def run():
    """benchmarks/run.py as a module; its `common` import sets thread env vars, which are
    put back afterwards so that later subprocesses of the test session do not inherit them."""
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")}
    sys.path.insert(0, str(BENCH_DIR))
    try:
        spec = importlib.util.spec_from_file_location("benchmarks_run", BENCH_DIR / "run.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(BENCH_DIR))
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _cases(run, *argv):
    _, args = run.parse(list(argv))
    return [c.label for c in run.select_cases(args)], args


# --------------------------------------------------------------------------- options and cases
def test_case_selection_per_device_and_mode(run):
    labels, args = _cases(run, "--device", "cuda")
    assert labels == ["s3", "s4", "s5", "ragged", "big", "v5000", "s5 bfloat16", "big float16"]
    assert (args.reps, args.warmup, args.agree_max_elems) == (10, 3, 5e7)
    assert _cases(run, "--device", "cuda", "--no-half")[0][-1] == "v5000"
    assert _cases(run, "--device", "cuda", "--quick")[0] == ["s1", "s2"]
    labels, _ = _cases(run, "--device", "cuda", "--shapes", "s5", "--dtype", "bfloat16")
    assert labels == ["s5 bfloat16"]                     # narrowed: no extra half rows
    labels, args = _cases(run, "--device", "cpu", "--mode", "floor")
    assert labels == ["s2", "s3", "s4", "s5", "ragged"] and (args.reps, args.warmup) == (7, 2)
    labels, args = _cases(run)                           # cpu/peers: the former run.py defaults
    assert labels == ["s1", "s2", "s3", "s4", "s5", "ragged", "s1_f64"] and args.reps == 5
    assert _cases(run, "--shapes", "s1_f64", "--dtype", "float32")[0] == ["s1_f64 float32"]
    labels, args = _cases(run, "--quick", "--reps", "4")  # explicit options win over --quick
    assert labels == ["s1", "s2"] and args.reps == 4 and args.cap == 10.0 and args.no_memory
    labels, _ = _cases(run, "--shapes", "s1", "--variants", "regular")
    assert labels == ["s1"]


def test_variants_are_the_registrys(run):
    with pytest.raises(SystemExit):
        run.parse(["--variants", "ctc"])
    with pytest.raises(ValueError, match="unknown variant"):
        shapes.cases(["s1"], variants=["ctc"])
    labels, _ = _cases(run, "--shapes", "s1", "--variants", "regular", "tdt", "multiblank")
    assert labels == ["s1", "s1 tdt", "s1 multiblank"]
    for variant in ("tdt", "multiblank"):
        assert variant in run.peers.PROVIDERS["rnnt_lattice"].variants
        assert variant not in run.peers.PROVIDERS["torchaudio"].variants
    c = shapes.Case(shapes.SHAPES["s5"], torch.float16, "regular")
    assert c.label == "s5 float16" and c.dtype_name == "float16"


def test_default_providers(run):
    assert run.default_providers("cpu", "floor") == ["rnnt_lattice"]
    assert run.default_providers("cuda", "floor") == ["rnnt_lattice_triton", "rnnt_lattice_triton_inplace"]
    cpu = run.default_providers("cpu", "peers")
    assert cpu[:2] == ["rnnt_lattice", "rnnt_lattice_torch"] and "torchaudio" in cpu
    assert not any("triton" in n for n in cpu)
    cuda = run.default_providers("cuda", "peers")
    assert cuda[:2] == run.OURS["cuda"] and "rnnt_lattice" not in cuda
    assert "rnnt_lattice_torch" not in cuda and "fast_rnnt" in cuda


def test_thp_compare_is_cpu_only(run):
    with pytest.raises(SystemExit) as e:
        run.parse(["--device", "cuda", "--thp-compare"])
    assert e.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_cuda_without_gpu_fails_fast(run, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        run.main(["--device", "cuda", "--out-dir", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--device cpu" in err
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------- timing primitives
def test_time_calls_runs_setup_outside_the_clock():
    class FakeClock:
        name = "fake"
        calls = 0

        def sync(self):
            pass

        def once(self, fn, setup=None):
            if setup:
                setup()
            fn()
            self.calls += 1
            return 0.5

    clock, log = FakeClock(), []
    r = timing.time_calls(lambda: log.append("call"), warmup=2, reps=3, min_time_s=0.0,
                         clock=clock, setup=lambda: log.append("setup"))
    assert r["reps"] == 3 and r["median"] == 0.5 and not r["capped"]
    assert log == ["setup", "call"] * 5 and clock.calls == 5
    r = timing.time_calls(lambda: None, warmup=1, reps=5, cap_s=1.2, clock=clock)
    assert r["capped"] and r["reps"] == 1


def test_one_thread_setter():
    """Numba's OpenMP layer shares libgomp with torch: setting Numba's count after torch's
    reset torch's (the order the three former copies used)."""
    import rnnt_lattice.demo as demo
    assert not hasattr(demo, "_set_threads")
    numba = pytest.importorskip("numba")
    n = torch.get_num_threads()
    try:
        for k in (1, 2, 1):
            assert set_threads(k) == k
            assert torch.get_num_threads() == k
            assert numba.get_num_threads() == min(k, numba.config.NUMBA_NUM_THREADS)
    finally:
        set_threads(n)


# --------------------------------------------------------------------------- runs and tables
def _run_rows(tmp_path, stem):
    d = json.loads((tmp_path / f"{stem}.json").read_text())
    return d["meta"], d["rows"], (tmp_path / f"{stem}.md").read_text()


@pytest.mark.parametrize("mode", ["floor", "peers"])
def test_cpu_run_end_to_end(run, tmp_path, mode):
    assert run.main(["--device", "cpu", "--mode", mode, "--shapes", "s1",
                     "--providers", "rnnt_lattice_torch", "rnnt_lattice_triton",
                     "--reps", "1", "--warmup", "1", "--cap", "5", "--no-memory",
                     "--out-dir", str(tmp_path), "--stem", "t"]) == 0
    meta, rows, md = _run_rows(tmp_path, "t")
    assert meta["args"]["device"] == "cpu" and meta["args"]["mode"] == mode
    assert meta["clock"] == "wall clock" and meta["versions"]["torch"]
    ours = next(r for r in rows if r["provider"] == "rnnt_lattice_torch")
    assert ours["status"] == "ok" and ours["agree"] == "ok" and ours["x_exp"] > 0
    assert ours["variant"] == "regular" and ours["case"] == "s1"
    triton = next(r for r in rows if r["provider"] == "rnnt_lattice_triton")
    assert triton["status"] == "unavailable" and "cuda only" in triton["note"]
    assert any(r["provider"] == "(exp floor)" for r in rows)
    if mode == "floor":
        assert "| shape | fwd+bwd | fwd | exp(out=buf) | exp() fresh | fwd+bwd / exp(out) |" in md
    else:
        assert "**fwd+bwd, median (x exp(out=buf))**" in md and "| rnnt_lattice_torch |" in md


def test_variant_inputs():
    """make_inputs per variant: TDT's durations after the tokens, NeMo's blank V-1 with the
    labels below the blank(s); the regular inputs are unchanged by the variant argument."""
    shape = shapes.SHAPES["s1"]
    reg = shapes.make_inputs(shape, seed=3)
    assert torch.equal(reg.logits, shapes.make_inputs(shape, seed=3, variant="regular").logits)
    tdt = shapes.make_inputs(shape, seed=3, variant="tdt")
    assert tdt.logits.shape[-1] == shape.V + len(shapes.TDT_DURATIONS) and tdt.blank == shape.V - 1
    assert int(tdt.targets.max()) < shape.V - 1
    mb = shapes.make_inputs(shape, seed=3, variant="multiblank")
    assert mb.logits.shape[-1] == shape.V and mb.blank == shape.V - 1
    assert int(mb.targets.max()) < shape.V - 1 - len(shapes.BIG_BLANK_DURATIONS)
    assert mb.call_kwargs() == {"variant": "multiblank"} and reg.call_kwargs() == {}


def test_cpu_run_variant(run, tmp_path):
    """A TDT case end to end: ours (Numba) agrees with the torch reference on it; a peer
    without the variant reports "unsupported"."""
    pytest.importorskip("numba")
    assert run.main(["--device", "cpu", "--mode", "peers", "--shapes", "s1", "--variants", "tdt",
                     "--providers", "rnnt_lattice", "rnnt_lattice_torch", "torchaudio",
                     "--reps", "1", "--warmup", "1", "--cap", "5", "--no-memory",
                     "--out-dir", str(tmp_path), "--stem", "v"]) == 0
    _, rows, _ = _run_rows(tmp_path, "v")
    ours = next(r for r in rows if r["provider"] == "rnnt_lattice")
    assert ours["variant"] == "tdt" and ours["status"] == "ok" and ours["agree"] == "ok"
    peer = next(r for r in rows if r["provider"] == "torchaudio")
    assert peer["status"] in ("unsupported", "unavailable")


class StandIn:
    """The CUDA device's measurement loop and tables, on CPU tensors with the wall clock."""
    def __new__(cls, run):
        class Fake(run.CUDA):
            clock = timing.WALL
            copy_gbs = 100.0

            def check(self):
                pass

            def info(self):
                return {"gpu": "Fake GPU", "gpu_mem_gib": 1.0, "cuda": "0.0", "device_capability": "0.0"}

            def prepare(self, args):
                pass

            def inputs(self, case, seed):
                return run.CPU().inputs(case, seed)

            def memory(self, prov, case, x, leaf, setup, args):
                return {"peak_bytes": x.nbytes, "peak_x_logits": 1.0}

            def release(self):
                pass
        return Fake()


def test_cuda_path_with_a_stand_in_device(run, monkeypatch):
    device = StandIn(run)
    inplace = run.peers.Provider("ours_inplace", "rnnt-lattice", run.peers._ours("torch", True),
                                 "in place", inplace=True, ours=True)
    monkeypatch.setitem(run.peers.PROVIDERS, "ours_inplace", inplace)
    _, args = run.parse(["--device", "cuda", "--shapes", "s1", "--dtype", "float32",
                         "--reps", "1", "--warmup", "1"])
    cases = run.select_cases(args)
    provs = [run.peers.PROVIDERS["rnnt_lattice_torch"], inplace]
    rows = run.run_cases(cases, provs, device, args)
    meas = [r for r in rows if r["provider"] in ("rnnt_lattice_torch", "ours_inplace")]
    assert [r["status"] for r in meas] == ["ok", "ok"]
    for r in meas:
        assert r["agree"] == "ok" and r["x_floor"] > 0 and r["v_pass_GBps"] > 0
        assert r["floor_s"] == pytest.approx(3 * r["logits_bytes"] / 100e9)
    md = run.markdown(rows, [c.label for c in cases], "cuda", "peers", vars(args),
                      {**device.info(), "copy_GBps": 100.0})
    assert "GPU: Fake GPU" in md
    assert "| s1 (B=1 T=50 U=10 V=30) | float32 | ours_inplace |" in md


def test_cuda_table_from_fake_rows(run):
    base = {"case": "s5 bfloat16", "shape": "s5", "shape_desc": "B=8 T=400 U=80 V=1024",
            "dtype": "bfloat16", "floor_s": 5.4e-4}
    rows = [
        {**base, "provider": "(copy floor)", "status": "ok"},
        {**base, "provider": "rnnt_lattice_triton", "status": "ok", "fwd_bwd_s": 1.1e-3,
         "x_floor": 2.04, "fwd_s": 6e-4, "peak_bytes": 2**30, "peak_x_logits": 1.0,
         "v_pass_GBps": 1450.0, "loss_rel_err": 1e-7, "grad_rel_err": 2e-3, "agree": "ok", "tol": 0.5},
        {**base, "provider": "torchaudio", "status": "error", "note": "RuntimeError: bf16"},
        {"provider": "fast_rnnt", "shape": "-", "status": "unavailable", "note": "not installed"},
    ]
    md = run.table_cuda(rows, ["s5 bfloat16"], {"reps": 10, "warmup": 3},
                        {"gpu": "H100", "gpu_mem_gib": 79.1, "device_capability": "9.0",
                         "cuda": "13.0", "copy_GBps": 3000.0})
    assert ("| s5 (B=8 T=400 U=80 V=1024) | bfloat16 | rnnt_lattice_triton | 540 us | 1.10 ms "
            "| 2.04 | 600 us | 1024.0 MiB | 1.00 | 1.45e+03 | 1.0e-07 | 2.0e-03 | ok (5e-01) |") in md
    assert "| torchaudio | error: RuntimeError: bf16 |" in md
    assert "Unavailable here: fast_rnnt (not installed)" in md and "(copy floor)" not in md
    assert "3000 GB/s" in md and "Medians of 10 CUDA-event timings after 3 warm-up" in md


@pytest.mark.parametrize("stem", sorted(p.stem for p in RESULTS.glob("*.json")))
def test_committed_results_render_unchanged(run, tmp_path, stem):
    """The tables of docs/benchmarks.md come from these files: the runner's table code
    (both CPU modes) rewrites each .md byte for byte from its .json."""
    src = RESULTS / f"{stem}.json"
    (tmp_path / src.name).write_text(src.read_text())
    run.render(tmp_path / src.name)
    assert (tmp_path / f"{stem}.md").read_text() == (RESULTS / f"{stem}.md").read_text()


# --------------------------------------------------------------------------- --mode pruned
def test_pruned_mode_options(run):
    _, args = run.parse(["--mode", "pruned"])
    assert [s.name for s in run.pipeline_shapes(args)] == ["p1", "p2", "pv5000"]
    assert args.windows == [5, 10] and (args.reps, args.warmup) == (3, 1)
    _, args = run.parse(["--device", "cuda", "--mode", "pruned", "--windows", "4"])
    assert [s.name for s in run.pipeline_shapes(args)] == ["pg1", "pg2", "pg3"]
    assert args.windows == [4] and args.reps == 10
    for p1 in ("p1", "pg1"):
        assert run.shapes.SHAPES[p1].U < run.shapes.SHAPES[p1].T      # R < U + 1: real pruning
    for bad in (["--variants", "tdt"], ["--dtype", "float16"], ["--windows", "0"],
                ["--providers", "warp_transducer_pruned"]):
        with pytest.raises(SystemExit):
            run.parse(["--mode", "pruned", *bad])
    _, args = run.parse(["--mode", "pruned", "--providers", "fast_rnnt", "rnnt_lattice (exact)",
                         "torchaudio"])
    assert args.providers == ["fast_rnnt", "rnnt_lattice (exact)", "torchaudio"]


def test_pruned_mode_end_to_end(run, tmp_path, monkeypatch):
    """Tiny shape, no timing assertions: our two pipelines and our full loss give rows and
    a table; with our k2-API row standing in for fast_rnnt, the agreement check finds the
    same ranges and losses (k2 rule)."""
    monkeypatch.setattr(run.pruned_pipeline, "REFERENCE_PAIR",
                        ("rnnt_lattice (k2)", "rnnt_lattice.compat.k2"))
    assert run.main(["--mode", "pruned", "--shapes", "s1", "--windows", "3",
                     "--providers", "rnnt_lattice (k2)", "rnnt_lattice (exact)",
                     "rnnt_lattice.compat.k2", "rnnt_lattice",
                     "--reps", "1", "--cap", "5", "--no-memory",
                     "--out-dir", str(tmp_path), "--stem", "p"]) == 0
    meta, rows, md = _run_rows(tmp_path, "p")
    assert meta["args"]["mode"] == "pruned" and meta["rnnt_lattice_path"]
    pipes = {r["provider"]: r for r in rows if r.get("kind") == "pipeline"}
    assert set(pipes) == {"rnnt_lattice (k2)", "rnnt_lattice (exact)", "rnnt_lattice.compat.k2"}
    k2 = pipes["rnnt_lattice (k2)"]
    assert k2["status"] == "ok" and k2["R"] == 3 and k2["R_used"] == 3
    assert k2["agree"] == "ok" and k2["ranges_equal"] and k2["frames_differ_f32"] >= 0
    assert pipes["rnnt_lattice (exact)"]["status"] == "ok"
    full = next(r for r in rows if r.get("kind") == "full")
    assert full["provider"] == "rnnt_lattice" and full["status"] == "ok"
    assert "| pipeline / loss | R | fwd+bwd | x fast_rnnt |" in md and "| rnnt_lattice | full loss |" in md
    # the tables re-render from the json
    run.render(tmp_path / "p.json")
    assert (tmp_path / "p.md").read_text() == md


def test_registry_docstring_example():
    """The registry's example (it was in the package's docstring examples before it moved)."""
    import doctest
    result = doctest.testmod(shapes, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# --------------------------------------------------------------------------- --mode fused
def test_fused_mode_end_to_end(run, tmp_path):
    """Tiny shape, no timing assertions: the three ways give rows and a table, fused agrees
    with full, and the tables re-render from the json."""
    _, args = run.parse(["--mode", "fused"])
    assert [s.name for s in run.pipeline_shapes(args)] == ["f1", "f2"] and args.hidden == [512, 1024]
    for bad in (["--variants", "tdt"], ["--dtype", "float16"], ["--providers", "rnnt_lattice"]):
        with pytest.raises(SystemExit):
            run.parse(["--mode", "fused", *bad])
    assert run.main(["--mode", "fused", "--shapes", "s1", "--hidden", "16", "--reps", "1",
                     "--no-memory", "--out-dir", str(tmp_path), "--stem", "f"]) == 0
    meta, rows, md = _run_rows(tmp_path, "f")
    assert meta["args"]["mode"] == "fused" and "fused" in meta["ways"]
    assert [r["way"] for r in rows] == ["full", "pruned", "fused"]
    assert all(r["fwd_bwd_s"] > 0 and r["H"] == 16 for r in rows)
    assert rows[2]["agree"] == "ok"
    assert "| shape | H | full | pruned | fused | fused / full time |" in md
    run.render(tmp_path / "f.json")
    assert (tmp_path / "f.md").read_text() == md



def test_fused_mode_memory_of_several_processes(run, monkeypatch):
    """--mem-procs N: each way's CPU peak measured in N fresh processes, the row holding the
    largest and all N; the table says so. It is --mode fused's and at least 1."""
    import fused_pipeline
    assert run.parse(["--mode", "fused"])[1].mem_procs is None      # 3 when run
    for bad in (["--mode", "fused", "--mem-procs", "0"], ["--mode", "floor", "--mem-procs", "2"]):
        with pytest.raises(SystemExit):
            run.parse(bad)
    peaks = iter([45.0, 380.0, 50.0])

    class Done:
        returncode = 0
        stdout = ""

    def fake_run(cmd, **kw):
        assert "--mem-child" in cmd
        d = Done()
        d.stdout = json.dumps({"extra_kb": next(peaks) * 1024}) + "\n"
        return d

    monkeypatch.setattr(fused_pipeline.subprocess, "run", fake_run)
    m = fused_pipeline.cpu_memory("fused", "s1", 16, 0, None, procs=3)
    assert m == {"peak_extra_mb": 380.0, "peak_extra_mb_procs": [45.0, 380.0, 50.0]}
    row = dict(shape="s1", shape_desc="B=1", H=16, device="cpu", way="fused", fwd_bwd_s=1.0, **m)
    md = fused_pipeline.markdown([row], "cpu", dict(reps=1, warmup=1))
    assert "the largest peak of 3 fresh processes" in md and "| 380 |" in md

@NO_TRITON
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_joint_tiles_needs_a_gpu(run, capsys):
    """benchmarks/joint_tiles.py (the kernel path's block choices, timed on a GPU) exits with
    status 2 and a message without one; its candidates are complete block choices, some
    with a cap on registers (``maxnreg``, a launch option: never passed as a constexpr)."""
    import joint_tiles
    from rnnt_lattice.gpu import joint
    assert joint_tiles.main(["--reps", "1"]) == 2
    assert "CUDA device" in capsys.readouterr().err
    keys = {"BLOCK_N", "BLOCK_V", "BLOCK_H", "num_warps", "num_stages"}
    capped = [tiles for tiles, _ in joint_tiles.CANDIDATES.values() if "maxnreg" in tiles]
    assert capped and all(set(joint.launch_options(t)) == {"num_warps", "num_stages", "maxnreg"}
                          and set(joint.block_constants(t)) == keys - {"num_warps", "num_stages"}
                          for t in capped)
    assert joint_tiles.F32_CANDIDATES
    for precision, n_f32 in (("bf16", 0), ("fp16", 0), ("tf32", len(joint_tiles.F32_CANDIDATES)),
                             ("fp32", len(joint_tiles.F32_CANDIDATES))):
        chosen = joint_tiles.candidates(precision)
        assert len(chosen) == len(joint_tiles.CANDIDATES) + n_f32
        assert all(set(t) - {"maxnreg"} == keys for _, tiles, _ in chosen for t in tiles)
        # float32's own choices keep their stages (WIDE[4] emptied); the others take
        # F32_OVER's (WIDE[4] itself is float32's default, a whole choice)
        assert [wide for *_, wide in chosen].count({}) == n_f32
        assert [wide for *_, wide in chosen].count(joint_tiles.F32_OVER) == (
            len(joint_tiles.CANDIDATES) if n_f32 else 0)
    # the act-grad pass's choices (--act-grad): complete, launched as joint.ACT_GRAD is
    assert joint_tiles.main(["--act-grad", "--reps", "1"]) == 2
    for tiles in joint_tiles.ACT_GRAD_CANDIDATES.values():
        assert set(tiles) - {"maxnreg"} == set(joint.ACT_GRAD)
        assert set(joint.launch_options(tiles)) <= {"num_warps", "maxnreg"}
    # j1's first chunk: 40 frames of 32 sequences x 101 label positions (256 MiB of bf16
    # logits at V = 1024); its bytes: dh and h read, the partial sums of dE and the rest
    B, frames, labels = joint_tiles.act_grad_chunk(shapes.SHAPES["j1"])
    assert (B, frames, labels) == (32, 256 * 2 ** 20 // (1024 * 2) // (32 * 101), 101)
    assert joint_tiles.act_grad_bytes(1, 1, 1, 1, 2, 1) == 2 * 2 + 2 * 4 + 3 * 4 + 2 * 4
    assert (joint_tiles.act_grad_bytes(B, frames, labels, 512, 2, 16)
            > joint_tiles.act_grad_bytes(B, frames, labels, 512, 2, 32))


def test_joint_tiles_times_each_pass_apart():
    """joint_tiles.py reads each choice's row and gradient passes from a profiled step's
    events (summed over the chunks' launches, whichever device-time attribute the torch
    version has) and names the fastest choice of each pass, which may be two choices."""
    import types

    import joint_tiles

    def ev(key, us, old=False):
        return types.SimpleNamespace(key=key, **{("self_cuda_time_total" if old else
                                                  "self_device_time_total"): us})
    events = [ev("_joint_row_kernel", 1500.0), ev("_joint_grad_kernel", 4000.0),
              ev("_joint_row_kernel", 500.0, old=True), ev("_lattice_kernel", 900.0)]
    assert joint_tiles.pass_times(events) == {"row": 2.0, "grad": 4.0}
    best = joint_tiles.best_passes({"a": {"row": 2.0, "grad": 4.0}, "b": {"row": 3.0, "grad": 3.5},
                                    "c": {}})
    assert best == {"row": ("a", 2.0), "grad": ("b", 3.5)}


@NO_TRITON
def test_gpu_passes_configs_and_settings(run, capsys):
    """benchmarks/gpu_passes.py without a GPU exits with status 2 (after checking its
    arguments); its sweep configs' letters and ``--set``'s constants parse as the GPU
    session's steps write them (benchmarks/gpu_session.sh), and a name that is not one of
    ``rnnt_lattice.gpu``'s constants is refused."""
    import gpu_passes
    assert gpu_passes._config("1x256x4n") == (1, 256, 4, False, None, None, None)
    assert gpu_passes._config("8x128x4g") == (8, 128, 4, True, None, None, True)
    assert gpu_passes._config("4x128x4lqe") == (4, 128, 4, True, False, True, False)
    assert gpu_passes._overrides(["SPAN_GRAD=True", "NUM_WARPS_V=8"]) == {
        "SPAN_GRAD": True, "NUM_WARPS_V": 8}
    # the row_early step's settings, as the script states them
    script = (pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_session.sh").read_text()
    on = re.search(r'row_early\) on="([^"]+)"', script).group(1).split()
    assert gpu_passes._overrides(on) == {
        "ROW_EARLY": True, "SPAN_PREFETCH": True, "GRAD_DURATIONS_LAST": True}
    for bad in (["SPAN_GRAD"], ["span_grad=True"], ["NO_SUCH_CONSTANT=1"]):
        with pytest.raises(ValueError, match="--set"):
            gpu_passes._overrides(bad)
    assert gpu_passes.main(["--set", "SPAN_GRAD=True"]) == 2
    assert "CUDA device" in capsys.readouterr().err


def test_sass_finds_the_spills_in_loops():
    """``sass.spills_in_loops`` (kernel_resources.py's column): the local loads and stores
    between a backward branch and its target (a loop, nested or not), out of all of them;
    ``sass.loop_spills`` (the SASS tests' and row_sass.py's, lattice_sass.py's): their count."""
    from sass import loop_spills, spills_in_loops   # (not kernel_resources: it sets the env)
    ins = [(0x00, "STL [R1], R2"), (0x10, "LDL R3, [R1]"), (0x20, "@!P0 LDL.64 R4, [R1+0x8]"),
           (0x30, "@P1 BRA 0x20"), (0x40, "@P0 BRA 0x10"), (0x50, "LDL R5, [R1]"),
           (0x60, "STL [R1+0x4], R6"), (0x70, "BRA 0x80"), (0x80, "EXIT")]
    assert spills_in_loops(ins) == "LDL 2/3, STL 0/2"
    assert spills_in_loops([(0x00, "LDL R3, [R1]"), (0x10, "EXIT")]) == "LDL 0/1, STL 0/0"
    assert loop_spills(ins) == 2 and loop_spills([(0x00, "LDL R3, [R1]"), (0x10, "EXIT")]) == 0


def test_check_step_of_the_gpu_session():
    """The GPU session's ``check`` step: ``rnnt-lattice check`` on CUDA in worker processes,
    its arguments as the command line parses them (the script's defaults put in)."""
    from rnnt_lattice import cli
    script = (BENCH_DIR / "gpu_session.sh").read_text()
    step = re.search(r"python3 -m rnnt_lattice check (.*?);;", script, flags=re.S).group(1)
    step = re.sub(r'"\$\{(\w+):-([^}]*)\}"', r"\2", step.replace("\\\n", " "))
    args = cli._build_parser().parse_args(["check"] + step.replace('$out/', "").replace('"', "").split())
    assert args.device == "cuda" and args.jobs == 8 and args.json == "check.json"


def test_confident_rows_step_of_the_gpu_session(capsys):
    """benchmarks/confident_rows.py as the GPU session's ``confident`` step calls it: its
    arguments parse, and without a GPU it exits with status 2 saying so."""
    import confident_rows
    script = (BENCH_DIR / "gpu_session.sh").read_text()
    args = re.search(r"confident_rows\.py \\\n\s+(--device cuda[^;]*);;", script).group(1).split()
    assert args[:2] == ["--device", "cuda"] and "tdt" in args and "smoothed" in args
    if torch.cuda.is_available():                                      # pragma: no cover
        pytest.skip("a CUDA device: the step would run")
    assert confident_rows.main(args) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_fused_mode_preset_and_ways(run):
    """--preset issue34 gives issue 34's rows (narrowed by --shapes), with full, fused and
    joint; TDT rows never run the pruned way; the fused-mode options belong to it."""
    import fused_pipeline
    _, args = run.parse(["--device", "cuda", "--mode", "fused", "--preset", "issue34"])
    rows = fused_pipeline.runs_of(run.pipeline_shapes(args), args)
    assert [(s.name, H, loss, prec) for s, H, loss, prec in rows] == list(fused_pipeline.ISSUE34)
    assert fused_pipeline.ways_of(args, "cuda", "tdt") == ("full", "fused", "joint")
    _, args = run.parse(["--device", "cuda", "--mode", "fused", "--preset", "issue34",
                         "--shapes", "j4"])
    assert [r[0].name for r in fused_pipeline.runs_of(run.pipeline_shapes(args), args)] == ["j4"]
    _, args = run.parse(["--mode", "fused", "--loss", "tdt", "--ways", "full", "pruned", "fused"])
    assert fused_pipeline.ways_of(args, "cpu", "tdt") == ("full", "fused")
    with pytest.raises(SystemExit):
        run.parse(["--mode", "floor", "--precision", "bf16"])


@NO_TRITON
def test_joint_exactness_table(monkeypatch, capsys):
    """benchmarks/joint_exactness.py (docs/benchmarks.md's exactness table of the kernel
    path), float64 under the interpreter: every relative error within 1e-12."""
    import joint_exactness
    from rnnt_lattice.gpu import joint
    monkeypatch.setattr(joint, "TILES", {k: dict(v) for k, v in joint.TILES.items()})
    monkeypatch.setattr(joint, "WIDE", {k: dict(v) for k, v in joint.WIDE.items()})
    monkeypatch.setattr(joint, "IEEE_FLOAT32", joint.IEEE_FLOAT32)     # main() sets it
    assert joint_exactness.main(["--dtype", "float64"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| float64")]
    assert len(rows) == len(joint_exactness.TOPOLOGIES)
    errs = [float(c) for line in rows for c in line.strip("| ").split(" | ")[2:]]
    assert errs and max(errs) <= 1e-12, rows


def test_pruned_profile_stages_add_up_to_the_step(capsys, tmp_path):
    """benchmarks/pruned_profile.py (gpu_session.sh's pruned_profile step) on the CPU at s1:
    one time per stage of the pruned step, which add up to the step, the profile's table,
    and the JSON."""
    import pruned_profile
    out = pruned_profile.main(["--device", "cpu", "--shape", "s1", "--reps", "1", "--top", "3",
                               "--json", str(tmp_path / "p.json")])
    assert list(out["stages_ms"]) == list(pruned_profile.STAGES)
    assert all(v > 0 for v in out["stages_ms"].values())
    assert abs(sum(out["stages_ms"].values()) - out["step_ms"]) <= 1e-6 * out["step_ms"]
    text = capsys.readouterr().out
    assert "s1 (B=1 T=50 U=10 V=30) R=5" in text and "Self CPU" in text
    assert json.loads((tmp_path / "p.json").read_text())["R"] == 5


def test_pruned_profile_deterministic_restores_the_mode(capsys, monkeypatch):
    """``pruned_profile.py --deterministic`` (gpu_session.sh's pruned_det step) on the CPU at
    s1: the step runs under ``torch.use_deterministic_algorithms(True)`` (seen from inside
    it), says so, and the mode is off again afterwards."""
    import pruned_profile
    seen = []
    step = pruned_profile.step

    def spy(*args, **kwargs):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return step(*args, **kwargs)

    monkeypatch.setattr(pruned_profile, "step", spy)
    out = pruned_profile.main(["--device", "cpu", "--shape", "s1", "--reps", "1", "--top", "1",
                               "--deterministic"])
    assert seen and all(seen) and not torch.are_deterministic_algorithms_enabled()
    assert out["step_ms"] > 0 and "deterministic mode" in capsys.readouterr().out


@NO_TRITON
def test_pruned_profile_times_the_gpu_paths_host_work(capsys):
    """``pruned_profile.py --host`` (no GPU): the host's microseconds of a pruned step on
    the GPU's code path with the kernels stubbed, printed and returned; the kernels, the
    backend choice and the input checks put back afterwards."""
    import pruned_profile
    import rnnt_lattice
    from rnnt_lattice import _backends
    from rnnt_lattice.gpu import kernels
    row_kernel, resolve = kernels._row_kernel, _backends.resolve
    checks = rnnt_lattice.set_input_checks("auto")
    rnnt_lattice.set_input_checks(checks)
    out = pruned_profile.main(["--host", "--shape", "s1", "--calls", "2"])
    assert kernels._row_kernel is row_kernel and _backends.resolve is resolve
    assert rnnt_lattice.set_input_checks(checks) == checks
    assert out["host_us"] > 0
    import common
    assert common.host_step_us(capsys.readouterr().out) > 0     # what --vs reads back


@NO_TRITON
def test_pruned_profile_counts_the_gpu_paths_operations():
    """``pruned_profile.py --count-ops`` (no GPU): the GPU's code path of the pruned step
    counted per stage, PyTorch operations and Triton launches (the loss's five passes, the
    simple loss's rescue both ways, its rows, its arc terms, k2's window rule and the lm
    rows' backward among them), and the kernels and the backend choice put back
    afterwards."""
    import pruned_profile
    from rnnt_lattice import _backends
    from rnnt_lattice.gpu import kernels
    row_kernel, resolve = kernels._row_kernel, _backends.resolve
    out = pruned_profile.main(["--count-ops", "--shape", "s1"])
    assert kernels._row_kernel is row_kernel and _backends.resolve is resolve
    # prune_ranges (no backend argument: "auto") takes the GPU's backend too: k2's rule
    assert out["triton"]["_k2_starts_kernel"] == 1
    assert list(out["stages"]) == list(pruned_profile.STAGES)
    assert out["stages"]["simple"] > 0 and out["stages"]["backward"] > 0
    assert out["triton"]["_row_kernel"] == 1 and out["triton"]["_grad_kernel"] == 1
    assert out["triton"]["_simple_rescue_kernel"] == 2
    # the simple loss's arc terms: one launch forward, two backward; its rows (am, lm) one
    # launch each way
    assert [out["triton"][k] for k in ("_arc_terms_kernel", "_arc_terms_grad_kernel",
                                       "_arc_terms_cols_kernel")] == [1, 1, 1]
    assert [out["triton"][k] for k in ("_simple_rows_kernel", "_simple_rows_grad_kernel")] == [2, 2]
    assert out["triton"]["_rows_sum_kernel"] == 1            # do_rnnt_pruning's backward
    assert all(sum(c for c, _ in out["sources"][s]) == n for s, n in out["stages"].items())


@NO_TRITON
def test_host_overhead_runs_with_stubbed_launches():
    """``host_overhead.py`` (it restarts itself with glibc's thresholds set, so it runs in
    a subprocess): the Triton backend's host path at s1, every pass and the input check
    launched once a call, the launches stubbed (``launch_stubs``)."""
    import subprocess
    out = subprocess.run([sys.executable, str(BENCH_DIR / "host_overhead.py"), "--shape", "s1",
                          "--calls", "50", "--binder"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "us of host work per forward+backward" in out.stdout
    import common
    assert common.host_work_us(out.stdout) > 0           # what --vs reads back
    for kernel in ("_row_kernel x1", "_lattice_kernel x1", "_grad_kernel x1",
                   "_input_check_kernel x1"):
        assert kernel in out.stdout, out.stdout
    # --binder: Triton's binder and cache key timed per kernel (or said why not)
    assert ("binder + cache key, per step" in out.stdout
            or "internals differ" in out.stdout), out.stdout


@NO_TRITON
@pytest.mark.parametrize("entry, variant", [("nemo", "tdt"), ("torchaudio", "regular")])
def test_host_overhead_through_a_compat_module(entry, variant):
    """``--entry``: the same step through a compat module, its ``backend="auto"`` on the
    Triton path (every pass launched, stubbed, once a call), as a framework calls it."""
    import subprocess
    out = subprocess.run([sys.executable, str(BENCH_DIR / "host_overhead.py"), "--shape", "s1",
                          "--calls", "50", "--entry", entry, "--variant", variant],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"s1 {variant} through compat.{entry}:" in out.stdout, out.stdout
    for kernel in ("_row_kernel x1", "_lattice_kernel x1", "_grad_kernel x1"):
        assert kernel in out.stdout, out.stdout
    if entry == "torchaudio":                        # its one variant
        bad = subprocess.run([sys.executable, str(BENCH_DIR / "host_overhead.py"), "--entry",
                              entry, "--variant", "tdt"], capture_output=True, text=True,
                             timeout=300)
        assert bad.returncode != 0 and "--entry torchaudio takes --variant regular" in bad.stderr


def test_paired_ab_takes_the_ratio_pair_by_pair(tmp_path):
    """``common.paired_ab`` (``host_overhead.py --vs``, ``pruned_profile.py --host --vs``):
    the script runs in fresh processes, A (this checkout's ``src/`` first on PYTHONPATH)
    and B (the other checkout's) in turn, and each pair gives one ratio A/B. (The two
    scripts' own lines are read back in their tests.)"""
    import common
    other = tmp_path / "other"
    (other / "src").mkdir(parents=True)
    script = tmp_path / "figure.py"
    script.write_text(
        "import os, sys\n"
        f"b = os.environ['PYTHONPATH'].startswith({str(other.resolve())!r})\n"
        "print(f'x: {(4.0 if b else 3.0) * float(sys.argv[1]):.1f} us of host work per "
        "forward+backward')\n")
    out = common.paired_ab(script, [2], other, 3, common.host_work_us)
    assert out["a"] == [6.0] * 3 and out["b"] == [8.0] * 3, out
    assert out["ratios"] == [0.75] * 3 and out["median"] == out["min"] == out["max"] == 0.75


@NO_TRITON
def test_lattice_traffic_counts_adjacent_diagonals(tmp_path):
    """``lattice_traffic.py`` (a subprocess: it sets ``TRITON_INTERPRET``) counts the lattice
    pass's memory requests from the addresses the kernel computes: with the skewed planes
    (``gpu._skew``) no warp instruction of the diagonal loops requests more than the
    sectors of 32 adjacent float64s (9 when unaligned) and, for an unpredicated gather's
    lanes off the lattice (``kernels._gather``), element 0's: 10. The node-order layout it
    replaced requested up to 22 at this shape (a sector a lane)."""
    import json
    import subprocess
    out = subprocess.run([sys.executable, str(BENCH_DIR / "lattice_traffic.py"), "--shape", "s2",
                          "--variants", "regular", "--json", str(tmp_path / "t.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads((tmp_path / "t.json").read_text())["results"]
    for variant, r in res.items():
        for kind in ("load", "store"):
            assert r[kind]["instructions"] > 0, (variant, r)
            assert r[kind]["most"] <= 10, (variant, kind, r)
        # T + U diagonals of the two directions, each a store of its nodes at least
        assert r["store"]["instructions"] >= 2 * (r["T"] + r["U"]) - 2, (variant, r)


def test_timeline_puts_each_idle_gap_down_to_its_cause(capsys):
    """benchmarks/timeline.py on a hand-made Kineto trace: the device's busy time is the
    union of its operations (overlapping and back-to-back ones merged), each gap goes to the
    host when the next operation's launch returned after the device ran out of work (named
    by the innermost range around that launch), to the device when it was queued in time,
    and to neither when its launch is missing; the busiest stream is the one reported.
    Without a CUDA device the script exits with status 2."""
    import timeline

    def X(cat, name, ts, dur, pid=1, tid=10, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid,
                "tid": tid, "args": args}

    def dev(name, ts, dur, corr=None, stream=7):
        return X("kernel", name, ts, dur, pid=0, tid=stream, stream=stream,
                 **({} if corr is None else {"correlation": corr}))
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}},
        X("user_annotation", "step 0", 0, 100),
        X("cpu_op", "aten::add", 5, 10), X("cuda_runtime", "cudaLaunchKernel", 6, 2, correlation=1),
        X("cpu_op", "LossFunction", 20, 40), X("cpu_op", "aten::empty", 21, 1),
        X("cuda_driver", "cuLaunchKernelEx", 25, 2, correlation=2),     # queued before A ends
        X("cuda_driver", "cuLaunchKernelEx", 50, 2, correlation=3),     # after B ended: late
        X("cpu_op", "aten::zero_", 57, 2.5), X("Runtime", "cudaMemsetAsync", 58, 1, correlation=4),
        dev("A", 10, 20, 1), dev("B", 32, 8, 2), dev("C", 55, 5, 3),
        X("Memset", "Memset", 59.2, 0.6, pid=0, tid=7, stream=7, correlation=4),  # older Kineto
        dev("D", 70, 5),                                                # no launch in the trace
        dev("other", 40, 1, stream=8),
    ]
    res = timeline.analyse(events)
    assert res["stream"] == "0/7" and set(res["streams"]) == {"0/7", "0/8"}
    s = res["streams"]["0/7"]
    assert s["ops"] == 5 and s["span_us"] == 65 and s["busy_us"] == 20 + 8 + 5 + 5
    assert (s["idle_host_us"], s["idle_device_us"], s["idle_unknown_us"]) == (15, 2, 10)
    assert res["host_gaps"] == [{"op": "LossFunction", "next": "C", "us": 15, "count": 1}]
    assert res["device_gaps"] == [{"prev": "A", "next": "B", "us": 2, "count": 1}]
    assert res["steps"] == [100]
    text = timeline.report(res, 1, event_ms=0.5)
    assert "waiting for the host 0.015" in text and "LossFunction  ->  C" in text
    assert timeline.analyse([])["stream"] is None
    assert timeline.main(["--loss", "s1"]) == 2
    assert "CUDA device" in capsys.readouterr().err
    # the GPU session's timeline step: each run's arguments as the script writes them
    script = (BENCH_DIR / "gpu_session.sh").read_text()
    specs = re.findall(r'"[\w-]+:(--(?:loss|joint)[^"]*)"', script)
    assert len(specs) == 5
    for spec in specs:
        args = timeline.parser().parse_args(spec.split() + ["--json", "x.json"])
        assert (args.loss or args.joint) in shapes.SHAPES


def test_page_faults_runs_both_ways_of_allocating(monkeypatch):
    """``page_faults.py``'s case (its child process, here in this one) on s2, whose lattice
    arrays are above the workspaces' threshold, in a ``kept`` loop: both ways of allocating
    report their figures per step, the workspaces' threshold is restored afterwards, and
    the two blocks a training loop alternates are kept (``anew`` takes none)."""
    import page_faults
    from rnnt_lattice import cpu
    default = cpu._Workspaces.MIN_BYTES
    cpu.empty_cache()
    out = page_faults.child("s2", "regular", "kept", 1, 2)
    assert set(out) == {"workspaces", "anew"}
    for got in out.values():
        assert set(got) == {"faults", "cpu_ms", "wall_ms"} and got["cpu_ms"] > 0
    assert cpu._Workspaces.MIN_BYTES == default
    assert len(cpu._workspaces.blocks) == 2
    cpu.empty_cache()


def test_page_faults_runs_the_pruned_step_both_ways():
    """``page_faults.py``'s pruned variant (k2's recipe at p1, R = 5) with ``--anew rows``:
    both ways report their figures, the CPU backend's ``rows_select`` is put back, and
    do_rnnt_pruning's rows of lm (B T R Dl float32, 12 MB) took a kept block."""
    import page_faults
    from rnnt_lattice import cpu
    rows_select = cpu.rows_select
    cpu.empty_cache()
    out = page_faults.child("p1", "pruned", "freed", 1, 1, "rows")
    assert set(out) == {"workspaces", "anew"}
    for got in out.values():
        assert set(got) == {"faults", "cpu_ms", "wall_ms"} and got["cpu_ms"] > 0
    assert cpu.rows_select is rows_select
    B, T, R, Dl = 8, 150, page_faults.PRUNED_R, 500
    assert any(b.size >= B * T * R * Dl * 4 for b in cpu._workspaces.blocks)
    cpu.empty_cache()


def test_cpu_passes_times_each_pass_of_each_topology(capsys):
    """``cpu_passes.py`` at s1: a line per case with the three passes and the total (the
    regular loss runs the fast path's row and gradient passes, TDT the generic ones: both
    sets are timed, every pass is > 0), the passes within the call's time, and the
    backend's functions put back afterwards; ``figure_of`` reads a case's figure back from
    the printed lines (what ``--vs`` compares)."""
    import cpu_passes
    from rnnt_lattice.cpu import kernels, regular
    before = (kernels.row_pass, kernels.lattice, kernels.grad_rows, regular.regular_row_pass,
              regular.regular_grad_rows)
    n = torch.get_num_threads()
    try:
        rows = cpu_passes.main(["--shapes", "s1", "--variants", "regular", "tdt", "--reps",
                                "2", "--threads", "1"])
    finally:
        set_threads(n)
    assert [r["case"] for r in rows] == ["s1 regular", "s1 tdt"]
    for r in rows:
        assert all(r["min"][p] > 0 for p in cpu_passes.PASSES)
        assert sum(r["min"][p] for p in cpu_passes.PASSES) <= r["median"]["total"]
    assert (kernels.row_pass, kernels.lattice, kernels.grad_rows, regular.regular_row_pass,
            regular.regular_grad_rows) == before
    out = capsys.readouterr().out
    got = cpu_passes.figure_of("s1 tdt", "row")(out)
    assert got == pytest.approx(rows[1]["min"]["row"], abs=0.006)
    with pytest.raises(RuntimeError, match="no grad of 's1 modified'"):
        cpu_passes.figure_of("s1 modified", "grad")(out)


def test_cpu_passes_times_the_pruned_loss_alone():
    """``cpu_passes.py``'s ``pruned`` case: ``rnnt_loss_pruned`` on the (B, T, R, V) logits
    of k2's windows (made once, before the timed calls), its three passes the generic ones
    (node_rows), each > 0."""
    import cpu_passes
    from rnnt_lattice.cpu import kernels
    calls = []
    row_pass = kernels.row_pass
    kernels.row_pass = lambda *args: calls.append(args[2].shape) or row_pass(*args)
    n = torch.get_num_threads()
    try:
        (row,) = cpu_passes.measure(["s1"], [cpu_passes.PRUNED], 1, False)
    finally:
        kernels.row_pass = row_pass
        set_threads(n)
    assert row["case"] == "s1 pruned" and all(row["min"][p] > 0 for p in cpu_passes.PASSES)
    B, T, U1 = 1, 50, 11                      # s1's lattice: node_rows (B, T, U+1)
    assert calls and set(calls) == {(B, T, U1)}
