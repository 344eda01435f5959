"""``rnnt-lattice check``: the self-check shipped in the package (rnnt_lattice/selfcheck.py).

CI runs the CPU check as a user would (``python -m rnnt_lattice check``, a fresh process,
the default tier: every dtype and shape of the plan, which caught a gradient overflow that
the quick tier and the suite's own tests missed); a planted wrong value, gradient or crash
in the Numba backend must turn into FAIL lines, the report's failure list and a non-zero
exit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from rnnt_lattice import cli, selfcheck

REPORT_HEAD = "---- rnnt-lattice check report (paste this into a bug report) ----"
REPORT_END = "---- end of report ----"


def _run_cli(*args):
    return subprocess.run([sys.executable, "-m", "rnnt_lattice", *args], capture_output=True,
                          text=True, timeout=600)


def _check_lines(text):
    return [line for line in text.splitlines() if line.startswith("[")]


def test_cpu_check_passes_and_writes_json(tmp_path):
    """The whole CPU check, as ``rnnt-lattice check --device cpu`` runs it (the default
    tier): every check line PASS (CUDA-only ones SKIP, timing INFO), the report block last,
    exit 0; --json holds the same results and block."""
    out_json = tmp_path / "check.json"
    res = _run_cli("check", "--device", "cpu", "--json", str(out_json))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    lines = _check_lines(res.stdout)
    statuses = [line.split(": ", 1)[1].split()[0] for line in lines]
    assert len(lines) > 20 and set(statuses) <= {"PASS", "SKIP", "INFO"}, lines
    # the three CUDA-only checks, and the joiner's kernel path and its chunks by cuBLAS
    # (the Triton backend only)
    skipped = [line.split("] ", 1)[1].split(":")[0] for line in lines if ": SKIP" in line]
    assert len(skipped) == 14 and sum(n.startswith("joiner ") for n in skipped) == 11, skipped
    for family in ("rnnt_loss regular", "rnnt_loss modified", "rnnt_loss constrained",
                   "rnnt_loss one_sym_per_frame", "tdt", "multiblank", "packed",
                   "rnnt_loss_simple", "rnnt_loss_smoothed", "rnnt_loss_pruned", "fused rnnt",
                   "fused tdt", "fused multiblank", "occupancy/best_alignment", "window DP",
                   "CPU row loops vectorised"):
        assert any(line.split("] ", 1)[1].startswith(family) and ": PASS" in line
                   for line in lines), family
    block = res.stdout[res.stdout.index(REPORT_HEAD):].strip()
    assert block.endswith(REPORT_END) and "RESULT: PASS" in block
    assert "checks: " in block and " 0 failed" in block and f"torch {torch.__version__}" in block
    data = json.loads(out_json.read_text())
    assert data["ok"] is True and data["tier"] == "default" and data["backend"] == "numba"
    assert data["report"] == block
    assert [c["name"] for c in data["checks"]] == [line.split("] ", 1)[1].split(": ")[0]
                                                   for line in lines]
    assert [c["status"] for c in data["checks"]] == statuses
    assert data["environment"]["device"] == "cpu" and data["environment"]["torch"] == torch.__version__
    assert data["timing"]["rnnt_lattice_s"] > 0 and data["timing"]["exp_s"] > 0


def test_check_in_workers_says_the_same_checks(tmp_path):
    """``--jobs 2``: the checks run by two worker processes, said in the plan's order with
    the same statuses as one process gives (the quick tier on CPU), the report and the
    JSON as ever."""
    out_json = tmp_path / "check.json"
    res = _run_cli("check", "--device", "cpu", "--quick", "--jobs", "2", "--json", str(out_json))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    ctx = selfcheck.Context("cpu", "numba", selfcheck.plan_for("cpu", "quick"), "quick")
    plan = selfcheck._checks(ctx, False)
    lines = _check_lines(res.stdout)
    total = len(plan)
    assert [line.split(": ", 1)[0] for line in lines] == [
        f"[{i:>2}/{total}] {name}" for i, (name, _) in enumerate(plan, 1)]
    statuses = [line.split(": ", 1)[1].split()[0] for line in lines]
    assert statuses == ["SKIP" if fn is None else "INFO" if name == "timing" else "PASS"
                        for name, fn in plan], lines
    data = json.loads(out_json.read_text())
    assert data["ok"] is True and data["jobs"] == 2 and len(data["checks"]) == total
    assert "RESULT: PASS" in data["report"] and data["timing"]["rnnt_lattice_s"] > 0


def test_a_worker_that_dies_fails_its_check_only():
    """A check that ends its worker's process FAILs with the exit code; a new worker takes
    the checks left, a check that raises FAILs with its error, the timing runs alone in
    this process, and every check is said once, in order."""
    from support.check_workers import dying_checks
    said = []
    ctx = selfcheck.Context("cpu", "numba", selfcheck.plan_for("cpu", "quick"), "quick",
                            out=lambda line, **kw: said.append(line))
    # (in a thread: a run that waited forever on the dead worker fails here, not CI)
    run = threading.Thread(target=selfcheck._run_in_workers, args=(ctx, 2, False, dying_checks),
                           daemon=True)
    run.start()
    run.join(timeout=300)
    assert not run.is_alive(), f"the run still waits; said so far: {said}"
    got = {r.name: r for r in ctx.results}
    assert [r.name for r in ctx.results] == [name for name, _ in dying_checks(ctx, False)]
    assert [line.split("] ", 1)[1].split(":")[0] for line in said] == list(got)
    assert got["first"].status == "PASS" and got["first"].detail == "ok 1"
    assert got["dies"].status == "FAIL" and "worker process died (exit code 7)" in got["dies"].detail
    assert got["skipped"].status == "SKIP"
    assert got["raises"].status == "FAIL" and "RuntimeError: planted error" in got["raises"].detail
    assert got["after"].status == got["last"].status == "PASS"
    workers = {got[n].detail for n in ("after", "last")}
    assert f"ok in {os.getpid()}" not in workers           # run by workers
    assert got["timing"].status == "INFO" and got["timing"].detail == f"alone in {os.getpid()}"


def test_no_worker_processes_run_the_checks_here(monkeypatch, tmp_path):
    """Where worker processes cannot be made (no semaphores: a container without
    /dev/shm), ``--jobs`` says so in a line and the checks run in this process."""
    import multiprocessing.context

    def no_semaphores(self, *args, **kwargs):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(multiprocessing.context.BaseContext, "Queue", no_semaphores)
    monkeypatch.setattr(selfcheck, "_checks", lambda ctx, big: [("one", lambda: "ran here"),
                                                                ("timing", None)])
    said = []
    out_json = tmp_path / "check.json"
    assert selfcheck.run("cpu", tier="quick", jobs=2, json_path=str(out_json),
                         out=lambda line, **kw: said.append(line)) == 0
    note = [line for line in said if "--jobs 2: no worker processes here" in line]
    assert note and "OSError" in note[0] and "the checks run in this process" in note[0]
    assert [line.rsplit("  [", 1)[0] for line in said if line.startswith("[")] == [
        "[ 1/2] one: PASS  ran here", "[ 2/2] timing: SKIP  not on the Triton interpreter"]
    assert json.loads(out_json.read_text())["jobs"] == 1


def test_jobs_must_be_positive(capsys):
    with pytest.raises(ValueError, match="jobs must be an int >= 1"):
        selfcheck.run("cpu", jobs=0)
    with pytest.raises(SystemExit):
        cli.main(["check", "--device", "cpu", "--jobs", "0"])
    assert "argument --jobs: expected an integer >= 1, got 0" in capsys.readouterr().err


def test_wrong_numbers_and_crashes_fail_the_check(monkeypatch, capsys, tmp_path):
    """The Numba backend made wrong in-process: a loss off by 1e-4, and occupancy raising.
    Every check that reaches them FAILs (naming the error), the others still run, the
    report lists the failures and the exit status is 1; --json says ok = false."""
    impl = selfcheck._backends.load("numba")
    real_forward = impl.loss_forward

    def wrong_forward(*args, **kwargs):
        costs, saved, state = real_forward(*args, **kwargs)
        return costs + 1e-4, saved, state

    def crash(*args, **kwargs):
        raise RuntimeError("planted crash")

    monkeypatch.setattr(impl, "loss_forward", wrong_forward)
    monkeypatch.setattr(impl, "occupancy", crash)
    out_json = tmp_path / "check.json"
    assert cli.main(["check", "--device", "cpu", "--quick", "--json", str(out_json)]) == 1
    out = capsys.readouterr().out
    lines = {line.split("] ", 1)[1].split(": ")[0]: line for line in _check_lines(out)}
    failed = {name for name, line in lines.items() if ": FAIL" in line}
    for name in failed:
        assert name.startswith(("rnnt_loss ", "tdt", "multiblank", "packed", "rnnt_loss_pruned",
                                "occupancy/best_alignment", "window DP", "torch.compile",
                                "torch.use_deterministic_algorithms")), name
    assert any(n.startswith("rnnt_loss regular") for n in failed)
    assert all("loss err over tolerance" in lines[n] for n in failed if n.startswith("rnnt_loss "))
    assert all("RuntimeError: planted crash" in lines[n] for n in failed
               if n.startswith("occupancy/best_alignment"))
    assert any(n.startswith("occupancy/best_alignment") for n in failed)
    assert ": PASS" in lines[next(n for n in lines if n.startswith("rnnt_loss_simple"))]
    block = out[out.index(REPORT_HEAD):]
    assert "RESULT: FAIL" in block and f" {len(failed)} failed" in block
    assert all(f"FAIL {name}: " in block for name in failed)
    data = json.loads(out_json.read_text())
    assert data["ok"] is False and {c["name"] for c in data["checks"] if c["status"] == "FAIL"} == failed


def test_a_wrong_gradient_fails(monkeypatch):
    """A gradient 1e-4 off (the loss right) is caught by the loss and packed checks."""
    impl = selfcheck._backends.load("numba")
    real_backward = impl.loss_backward
    monkeypatch.setattr(impl, "loss_backward",
                        lambda *a, **k: real_backward(*a, **k) * (1 + 1e-4))
    ctx = selfcheck.Context("cpu", "numba", selfcheck.plan_for("cpu", "quick"), "quick")
    shape = (3, 10, 4, 9)
    with pytest.raises(selfcheck.CheckFailed, match="grad err"):
        selfcheck.check_loss(ctx, shape, torch.float32, "regular", "plain")
    with pytest.raises(selfcheck.CheckFailed, match="grad err"):
        selfcheck.check_packed(ctx, shape, torch.float32)
    monkeypatch.setattr(impl, "loss_backward", real_backward)
    assert "grad err" in selfcheck.check_loss(ctx, shape, torch.float32, "regular", "plain")


def test_scalar_row_loops_fail_the_check(monkeypatch):
    """The row loops' check reads the vector types of the compiled loops
    (``fastmath.row_loop_vectors``): a scalar loop, one narrower than a SIMD register of any
    x86-64 machine, or float32 lanes beside 64-bit integer ones each fail it by name, with
    the Numba and LLVM versions; the loops this Numba compiles pass, with their widths."""
    from rnnt_lattice.cpu import fastmath
    ctx = selfcheck.Context("cpu", "numba", selfcheck.plan_for("cpu", "quick"), "quick")
    passed = selfcheck.check_cpu_vectors(ctx)
    assert passed.startswith("float32 rows ") and " LLVM " in passed, passed
    vectors = {(loop, dt): {(16, "float"), (8, "double")}
               for loop in ("exp_sum", "exp_store", "exp_store_in_place")
               for dt in ("float32", "float64")}
    vectors["exp_sum", "float32"] = set()
    vectors["exp_store", "float64"] = {(1, "double")}
    vectors["exp_store_in_place", "float32"] = {(8, "float"), (8, "i64")}
    monkeypatch.setattr(fastmath, "row_loop_vectors", lambda: vectors)
    with pytest.raises(selfcheck.CheckFailed) as err:
        selfcheck.check_cpu_vectors(ctx)
    msg = str(err.value)
    assert "exp_sum on float32 rows is scalar" in msg
    assert "exp_store on float64 rows is 1 wide (at least 2 wanted)" in msg
    assert "exp_store_in_place on float32 rows holds 64-bit integer vectors" in msg
    assert f"Numba {selfcheck._version('numba')} (LLVM " in msg and "please report" in msg


def test_device_cuda_without_cuda_is_one_line_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["check", "--device", "cuda", "--quick"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rnnt-lattice: error: --device cuda: no CUDA device")


def test_json_path_checked_before_running(tmp_path, capsys):
    assert cli.main(["check", "--device", "cpu", "--quick", "--json", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--json" in captured.err and "is a directory" in captured.err


@pytest.mark.parametrize("capability, full", [((9, 0), True), ((8, 0), True), ((7, 0), True),
                                              ((8, 6), False), ((8, 9), False), ((7, 5), False),
                                              ((12, 0), False)])
def test_fp64_class(capability, full):
    assert selfcheck.fp64_class(capability).startswith("full rate" if full else "reduced")


def test_help_names_the_command():
    assert "check" in cli._build_parser().format_help()
    assert "PASS/FAIL" in cli._build_parser()._subparsers._group_actions[0].choices["check"].format_help()
