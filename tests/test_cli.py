"""The rnnt-lattice command: demo, plot and warmup subcommands."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import torch

from rnnt_lattice import cli
from rnnt_lattice.demo import Config, run

pytest.importorskip("matplotlib")

DEMO_FILES = ["occupancy_init.png", "occupancy_trained.png", "loss_curve.png",
              "prune_coverage.csv", "prune_coverage.md", "metrics.json"]
# (width, height) in pixels: figure size (inches) x dpi 100 as set in demo.py / plot.py
PNG_SIZES = {"occupancy_init.png": (640, 520), "occupancy_trained.png": (640, 520),
             "loss_curve.png": (640, 360)}


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def _run_cli(*args, cwd=None):
    """The program as a user runs it (``python -m rnnt_lattice``), in a fresh process."""
    return subprocess.run([sys.executable, "-m", "rnnt_lattice", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


# --------------------------------------------------------------------------- demo
def test_demo_smoke_writes_every_file(tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli.main(["demo", "--steps", "3", "--out", str(out), "--threads", "1"]) == 0
    printed = capsys.readouterr()
    assert "held-out TER" in printed.out
    assert "TER = edit distance / reference length" in printed.out     # said in words, first
    assert "progress 3/3" in printed.err                     # not a TTY: plain progress lines
    assert sorted(os.listdir(out)) == sorted(DEMO_FILES)
    for name in DEMO_FILES:
        assert (out / name).stat().st_size > 0
    for name, size in PNG_SIZES.items():
        assert _png_size(out / name) == size
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["steps"] == 3 and metrics["config"]["threads"] == 1
    assert sorted(metrics["files"]) == sorted(DEMO_FILES)
    assert 0 < metrics["chance_ter"] <= 1
    assert [e["step"] for e in metrics["evals"]][-1] == 3
    csv = (out / "prune_coverage.csv").read_text().splitlines()
    assert csv[0] == "R,coverage_init,coverage_trained" and len(csv) == 1 + 6
    cov = [float(line.split(",")[2]) for line in csv[1:]]
    assert cov == sorted(cov) and cov[-1] <= 1.0


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps"),
    (["--threads", "0"], "--threads"),
    (["--device", "nosuchdevice"], "--device"),
])
def test_demo_bad_options_give_clear_errors(tmp_path, capsys, args, message):
    assert cli.main(["demo", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rnnt-lattice: error:") and message in err


def test_default_demo_learns(tmp_path):
    """The default configuration (what ``rnnt-lattice demo`` runs): held-out TER clearly
    below chance (random digit strings of the right length)."""
    metrics = run(Config(), str(tmp_path), log=lambda s: None, progress_stream=open(os.devnull, "w"))
    assert metrics["heldout_ter"] < 0.5 * metrics["chance_ter"]
    assert metrics["heldout_ter"] < 0.3
    assert metrics["heldout_loss_per_token"] < metrics["evals"][0]["loss_per_token"] / 3
    # The README quotes a recorded run: the same seed gives the same chance level, and a
    # final TER within a few errors of the quoted one (another CPU or torch version sums
    # in another order, which moves the last digits).
    import pathlib
    import re
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    quoted = re.search(r"^held-out TER (\S+) \(at initialisation \S+, chance (\S+)\);", readme, flags=re.M)
    assert quoted, "README.md quotes no final demo line"
    assert f"{metrics['chance_ter']:.3f}" == quoted.group(2)
    assert abs(metrics["heldout_ter"] - float(quoted.group(1))) <= 0.02


def test_demo_says_the_threads_it_runs(monkeypatch):
    """The demo's line names the threads as they are: Numba's where NUMBA_NUM_THREADS caps
    them below the asked count, and a note where more are asked than the machine has."""
    numba = pytest.importorskip("numba")
    from rnnt_lattice._cli_util import threads_said
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 2)
    assert threads_said(2) == "2 thread(s)"
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 1)
    assert threads_said(2) == "2 thread(s) (Numba's: 1, NUMBA_NUM_THREADS)"
    assert threads_said(8) == ("8 thread(s) (Numba's: 1, NUMBA_NUM_THREADS), more than the 2 "
                               "core(s) here (they take turns: slower)")


# --------------------------------------------------------------------------- plot
def _save_example(path, **over):
    g = torch.Generator().manual_seed(0)
    data = {"logits": torch.randn(2, 9, 4, 5, generator=g), "targets": torch.tensor([[1, 2, 3], [4, 4, 0]]),
            "logit_lengths": torch.tensor([9, 6]), "target_lengths": torch.tensor([3, 2]),
            "blank": 0, "labels": ["_", "a", "b", "c", "d"]}
    data.update(over)
    data = {k: v for k, v in data.items() if v is not None}
    torch.save(data, path)
    return path


def test_plot_writes_png_of_expected_size(tmp_path, capsys):
    f = _save_example(tmp_path / "lat.pt")
    assert cli.main(["plot", str(f), "--index", "1"]) == 0
    assert _png_size(tmp_path / "lat.png") == (640, 360)
    assert "wrote" in capsys.readouterr().out
    assert cli.main(["plot", str(f), "--out", str(tmp_path / "x.svg")]) == 0
    assert (tmp_path / "x.svg").read_text().lstrip().startswith("<?xml")


def test_plot_accepts_single_sequence_and_log_probs(tmp_path):
    lp = torch.log_softmax(torch.randn(7, 3, 4), -1)
    f = _save_example(tmp_path / "one.pt", logits=lp, targets=torch.tensor([1, 2]),
                      logit_lengths=None, target_lengths=None, labels=None, blank=None)
    assert cli.main(["plot", str(f), "--log-probs", "--blank", "0"]) == 0
    assert _png_size(tmp_path / "one.png") == (640, 360)


def _write(path, content):
    path.write_bytes(content) if isinstance(content, bytes) else torch.save(content, path)
    return path


@pytest.mark.parametrize("make, message", [
    ("missing", "no such file"),
    ("text", "not a file written by torch.save"),
    ("object", "holds an object (torch.nn.modules.linear.Linear) that is not a tensor"),
    ("list", "expected a dict"),
    ("no_targets", "missing key(s) 'targets'"),
    ("bad_shape", "must be (B, T, U+1, V) and (B, U)"),
    ("bad_length", "target_lengths"),
    ("bad_labels", "'labels' has 2 names"),
    ("bad_index", "--index 5 is outside the batch"),
])
def test_plot_bad_input_is_a_clear_error(tmp_path, make, message):
    f = tmp_path / "in.pt"
    if make == "text":
        f.write_text("hello, not a tensor\n")
    elif make == "list":
        torch.save([torch.zeros(2)], f)
    elif make == "object":
        torch.save({"logits": torch.zeros(1, 2, 2, 3), "targets": torch.tensor([[1]]),
                    "joiner": torch.nn.Linear(2, 2)}, f)
    elif make == "no_targets":
        torch.save({"logits": torch.zeros(1, 2, 2, 3)}, f)
    elif make == "bad_shape":
        torch.save({"logits": torch.zeros(2, 3, 3), "targets": torch.tensor([[1, 2]])}, f)
    elif make == "bad_length":
        _save_example(f, target_lengths=torch.tensor([3, 5]))
    elif make == "bad_labels":
        _save_example(f, labels=["x", "y"])
    elif make == "bad_index":
        _save_example(f)
    r = _run_cli("plot", str(f), *(["--index", "5"] if make == "bad_index" else []))
    assert r.returncode == 2
    assert r.stderr.startswith("rnnt-lattice: error:"), r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_help_and_entry_points():
    r = _run_cli("--help")
    assert r.returncode == 0 and all(c in r.stdout for c in ("demo", "plot", "warmup"))
    r = _run_cli("plot", "--help")
    assert r.returncode == 0 and "logit_lengths" in r.stdout
    r = _run_cli()                                             # no command: help, non-zero
    assert r.returncode == 2 and r.stderr.rstrip().endswith("error: give a command (demo, "
                                                            "plot, warmup or check)")


def test_an_unknown_option_shows_its_commands_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plot", "x.pt", "--bogus"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: rnnt-lattice plot")
    assert err.rstrip().endswith("rnnt-lattice plot: error: unrecognized arguments: --bogus")


def test_plot_warns_of_what_it_cannot_show(tmp_path, capsys):
    """A sequence without a path, NaN logits and --log-probs on raw scores each draw, with a
    warning line saying so; a sequence without frames is an error (nothing to draw)."""
    x = torch.randn(2, 9, 4, 5, generator=torch.Generator().manual_seed(0))
    x[1, 2, 1, 3] = float("nan")
    f = _save_example(tmp_path / "w.pt", logits=x, logit_lengths=torch.tensor([9, 6]),
                      target_lengths=torch.tensor([3, 2]))
    assert cli.main(["plot", str(f), "--index", "1"]) == 0
    assert "warning: sequence 1 has log P = NaN" in capsys.readouterr().err
    assert cli.main(["plot", str(f), "--log-probs"]) == 0
    assert "--log-probs: the rows of sequence 0 are not log-probabilities" in capsys.readouterr().err
    f = _save_example(tmp_path / "lp.pt", logits=x.log_softmax(-1))
    assert cli.main(["plot", str(f), "--log-probs"]) == 0
    assert "warning" not in capsys.readouterr().err
    # constrained: one label per frame at most, so T_b = 2 < U_b = 3 has no path
    f = _save_example(tmp_path / "short.pt", logit_lengths=torch.tensor([2, 6]))
    assert cli.main(["plot", str(f), "--rnnt-type", "constrained"]) == 0
    assert "warning: sequence 0 has no path through its lattice" in capsys.readouterr().err
    assert cli.main(["plot", str(f)]) == 0                      # regular: a path exists
    assert "warning" not in capsys.readouterr().err
    f = _save_example(tmp_path / "t0.pt", logit_lengths=torch.tensor([9, 0]))
    assert cli.main(["plot", str(f), "--index", "1"]) == 2
    assert "sequence 1 has no frames (T_b = 0): nothing to draw" in capsys.readouterr().err


def test_the_fronts_stay_out_of_the_package_import():
    """Importing the package loads neither the fronts (cli, demo) nor matplotlib; importing
    the demo, which takes the public API at its top, loads no matplotlib either (the
    optional extra "plot" is loaded when a picture is drawn)."""
    code = ("import sys, importlib; importlib.import_module(sys.argv[1]); "
            "print(sorted(m for m in ('rnnt_lattice.cli', 'rnnt_lattice.demo', 'matplotlib') "
            "if m in sys.modules))")
    for module, loaded in (("rnnt_lattice", "[]"), ("rnnt_lattice.demo", "['rnnt_lattice.demo']")):
        r = subprocess.run([sys.executable, "-c", code, module], capture_output=True, text=True,
                           check=True)
        assert r.stdout.strip() == loaded, (module, r.stdout, r.stderr)


def test_progress_bar_redraws_on_a_terminal_and_logs_lines_otherwise():
    import io

    from rnnt_lattice.demo import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, log = Tty(), io.StringIO()
    for stream in (tty, log):
        bar = Progress(50, stream)
        for i in range(1, 51):
            bar.update(i, "loss 1.0")
    assert "\r[" in tty.getvalue() and tty.getvalue().endswith("\n") and "50/50" in tty.getvalue()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) == 11 and lines[-1].startswith("progress 50/50")


# --------------------------------------------------------------------------- one-line errors
def _one_line_error(capsys, argv, message):
    """``argv`` fails with exit status 2 and exactly one line ``rnnt-lattice: error: ...``
    naming ``message`` on stderr (in process: any traceback would fail the test)."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rnnt-lattice: error:") and err.count("\n") == 1, err
    assert message in err, err


@pytest.mark.parametrize("edit, message", [
    ({"logit_lengths": "abc"}, "'logit_lengths' must be an int tensor"),
    ({"target_lengths": [1.5, 2.0]}, "'target_lengths' must be an int tensor"),
    ({"logit_lengths": torch.tensor([9.0, 6.0])}, "'logit_lengths' must be an int tensor"),
    ({"labels": 5}, "'labels' must be a list of V = 5 names"),
    ({"blank": torch.tensor([0, 1])}, "'blank' must be an int or a one-element int tensor"),
    ({"blank": "0"}, "'blank' must be an int"),
    ({"targets": torch.tensor([[1, 2, 3], [4, 4, 0]]).bool()}, "'targets' must be an int tensor"),
], ids=["lengths_str", "lengths_floats", "lengths_float_tensor", "labels_int", "blank_tensor",
        "blank_str", "bool_targets"])
def test_plot_bad_file_contents_are_one_line_errors(tmp_path, capsys, edit, message):
    f = _save_example(tmp_path / "in.pt", **edit)
    _one_line_error(capsys, ["plot", str(f)], message)


def test_plot_accepts_lengths_as_ints_and_lists(tmp_path):
    f = _save_example(tmp_path / "in.pt", logit_lengths=[9, 6], target_lengths=(3, 2), blank=torch.tensor(0))
    assert cli.main(["plot", str(f), "--out", str(tmp_path / "ok.png")]) == 0


@pytest.mark.parametrize("where, message", [
    ("missing/x.png", "does not exist"),
    ("afile/x.png", "is a file, not a directory"),
    ("afile/deeper/x.png", "is a file, not a directory"),
    ("adir", "must end in .png"),
])
def test_plot_out_that_cannot_be_written(tmp_path, capsys, where, message):
    f = _save_example(tmp_path / "in.pt")
    (tmp_path / "afile").write_text("x")
    _one_line_error(capsys, ["plot", str(f), "--out", str(tmp_path / where)], message)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="needs POSIX permissions that bind (root writes anywhere)")
def test_plot_out_into_read_only_folder(tmp_path, capsys):
    f = _save_example(tmp_path / "in.pt")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        _one_line_error(capsys, ["plot", str(f), "--out", str(ro / "x.png")], "not writable")
    finally:
        ro.chmod(0o755)


def test_plot_write_failure_is_one_line(tmp_path, capsys, monkeypatch):
    """Whatever the file system refuses when the picture is written (read-only mounts,
    a full disk, permissions that the up-front check cannot see, as for root)."""
    import rnnt_lattice.plot

    def refuse(fig, path, dpi=None):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(rnnt_lattice.plot, "save", refuse)
    f = _save_example(tmp_path / "in.pt")
    _one_line_error(capsys, ["plot", str(f), "--out", str(tmp_path / "x.png")], "Permission denied")


@pytest.mark.parametrize("args, message", [
    (["--device", "meta"], "--device meta"),
    (["--out", "{tmp}/afile"], "is an existing file"),
    (["--out", "{tmp}/afile/sub"], "cannot create the folder"),
])
def test_demo_bad_device_or_out_fail_before_training(tmp_path, capsys, monkeypatch, args, message):
    import rnnt_lattice.demo as demo
    trained = []
    monkeypatch.setattr(demo, "run", lambda *a, **k: trained.append(a))
    (tmp_path / "afile").write_text("x")
    _one_line_error(capsys, ["demo", "--steps", "1", "--out", str(tmp_path / "out"),
                             *(a.format(tmp=tmp_path) for a in args)], message)
    assert not trained, "training started before the bad option was reported"


def test_demo_pruned_smoke_writes_the_comparison(tmp_path, capsys):
    out = tmp_path / "pruned"
    assert cli.main(["demo", "--pruned", "--steps", "3", "--window", "3", "--out", str(out),
                     "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert "full:" in text and "pruned:" in text and "held-out TER" in text
    table = (out / "pruned_comparison.md").read_text()
    assert "| full |" in table and "| pruned, R = 3 |" in table
    metrics = json.loads((out / "metrics.json").read_text())
    for name in ("full", "pruned"):
        assert metrics[name]["ms_per_step"] > 0 and 0 <= metrics[name]["heldout_ter"]
    # the pruned joiner output is (B, T, R, V) + the simple joiner's, far below (B, T, U+1, V)
    assert metrics["pruned"]["joiner_output_mb_per_step"] < metrics["full"]["joiner_output_mb_per_step"]


def test_demo_fused_smoke_writes_the_comparison(tmp_path, capsys):
    out = tmp_path / "fused"
    assert cli.main(["demo", "--fused", "--steps", "3", "--tile", "500", "--out", str(out),
                     "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert "full:" in text and "fused:" in text and "held-out TER" in text
    table = (out / "fused_comparison.md").read_text()
    assert "| full |" in table and "| fused, tile 500 |" in table
    metrics = json.loads((out / "metrics.json").read_text())
    # the same model, batches and loss: the same held-out TER after 3 steps, to rounding
    assert metrics["fused"]["heldout_ter"] == pytest.approx(metrics["full"]["heldout_ter"], abs=0.02)
    # the largest joiner output is one tile of 500 rows, far below (B, T, U+1, V)
    assert metrics["fused"]["joiner_output_mb_per_step"] <= 500 * 11 * 4 / 2**20 + 1e-9
    assert metrics["fused"]["joiner_output_mb_per_step"] < metrics["full"]["joiner_output_mb_per_step"]


@pytest.mark.parametrize("args, message", [
    (["--fused", "--tile", "0"], "--tile must be a positive int"),
    (["--fused", "--tile", "12XB"], "--tile must be a positive int"),
    (["--fused", "--pruned"], "--pruned and --fused"),
    (["--pruned", "--window", "0"], "--window must be >= 1, got 0"),
    (["--window", "3"], "--window is the pruned loss's: give it with --pruned"),
    (["--tile", "500"], "--tile is the fused loss's: give it with --fused"),
    (["--device", "meta"], "--device meta holds no data"),
    (["--steps", "0"], "--steps must be >= 1"),
], ids=["tile0", "tile_unit", "both", "window0", "window_alone", "tile_alone", "meta", "steps"])
def test_demo_bad_options_are_refused_before_anything_is_written(tmp_path, capsys, args, message):
    """One line naming the option, exit 2, and the output folder not created: every option
    is checked before the folder is made."""
    out = tmp_path / "new"
    assert cli.main(["demo", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_demo_names_the_cuda_device_asked_for(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["demo", "--out", str(tmp_path / "new"), "--device", "cuda:1"]) == 2
    assert "--device 'cuda:1' was asked for but torch sees no CUDA device" in capsys.readouterr().err


# --------------------------------------------------------------------------- warmup
def test_warmup_covers_every_kernel():
    """``warmup --list`` names the calls and their kernels, which are every CPU kernel a
    public function runs; it compiles nothing."""
    pytest.importorskip("numba")
    import importlib
    import pkgutil

    from rnnt_lattice import cpu
    from rnnt_lattice.cpu import _config
    modules = [importlib.import_module(f"rnnt_lattice.cpu.{m.name}")
               for m in pkgutil.iter_modules(cpu.__path__)]
    every = {name for mod in modules for name, obj in vars(mod).items()
             if isinstance(obj, _config.ParallelKernel)}
    listed = {k for _, ks in cli.WARMUP_CALLS for k in ks}
    assert listed == every
    out = _run_cli("warmup", "--list")
    assert out.returncode == 0
    lines = out.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == [c for c, _ in cli.WARMUP_CALLS]
    assert "compiled" not in out.stdout and "loaded" not in out.stdout


def test_warmup_in_worker_processes(capsys):
    """``--jobs 2``: two calls in two spawned processes; each unit's lines together (a line
    a kernel it compiled or loaded), both units, the total naming the processes."""
    pytest.importorskip("numba")
    assert cli.main(["warmup", "--only", "best_alignment", "prune_ranges", "--jobs", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.endswith(" ...")]
    blocks = {lines[i]: lines[i + 1:j] for i, j in zip(starts, starts[1:] + [len(lines) - 1])}
    assert sorted(blocks) == ["best_alignment (float32) ...", "prune_ranges (any dtype) ..."]
    assert [b.split(" (")[0].strip() for b in blocks["best_alignment (float32) ..."]] == \
        ["row_pass", "viterbi"]
    assert [b.split(" (")[0].strip() for b in blocks["prune_ranges (any dtype) ..."]] == \
        ["window_dp"]
    assert lines[-1].startswith("warmup done in ") and ", 2 processes (" in lines[-1]
    with pytest.raises(SystemExit) as exc:
        cli.main(["warmup", "--jobs", "0"])
    assert exc.value.code == 2


def test_warmup_jobs_do_not_compile_a_kernel_twice_at_once():
    """The order units start in beside running ones: a unit waits while a running one
    runs one of its kernels (whatever the dtype), and the next free unit starts."""
    pytest.importorskip("numba")
    import argparse
    args = argparse.Namespace(serial=False, dtype=["float32", "float64"], only=None)
    units = cli._warmup_units(args)
    calls = [c for c, _ in cli.WARMUP_CALLS]
    assert [u[2] for u in units] == calls + [c for c in calls if c not in
                                             cli.DTYPE_FREE_CALLS]
    assert [u[1] for u in units] == ["float32"] * len(calls) + \
        ["float64"] * (len(calls) - len(cli.DTYPE_FREE_CALLS))
    one = [u for u in units if u[1] == "float32"]
    first = cli._warmup_next(one, [])
    assert first[2] == "rnnt_loss"
    rest = [u for u in one if u != first]
    # tdt_loss and the simple losses need rnnt_loss's lattice: best_alignment goes first
    assert cli._warmup_next(rest, [first])[2] == "best_alignment"
    left = [u for u in rest if u[2] in ("tdt_loss", "rnnt_loss_smoothed")]
    assert cli._warmup_next(left, [first]) is None
    assert cli._warmup_next(left, [])[2] == "tdt_loss"
    # another dtype: the same wait (lattice reads float64 whatever the logits: one
    # specialisation for both)
    f64 = [u for u in units if u[1] == "float64" and u[2] in ("tdt_loss", "best_alignment")]
    assert cli._warmup_next(f64, [first]) == f64[1]
    assert cli._warmup_next([], [first]) is None


def test_warmup_reports_each_kernel(capsys):
    """A fresh process (the kernel is loaded from the disk cache, or compiled): one progress
    line for the call, one per kernel made, then the total; ``--serial`` is taken and
    changes nothing (the runs without threads use the same builds)."""
    pytest.importorskip("numba")
    for extra in ((), ("--serial",)):
        out = _run_cli("warmup", "--only", "prune_ranges", *extra)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.strip().splitlines()
        assert lines[0] == "prune_ranges (any dtype) ..."
        assert lines[1].startswith("  window_dp (parallel): ")
        assert lines[-1].startswith("warmup done in ") and len(lines) == 3
    place = lines[-1].split("kernel cache: ")[1].rstrip(")")
    assert place == "off" or os.path.isdir(place), lines[-1]
    with pytest.raises(SystemExit):
        cli.main(["warmup", "--help"])
    assert "--dtype" in capsys.readouterr().out
