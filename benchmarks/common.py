"""What the runner (run.py) needs besides the registry (``shapes``) and the clocks
(``timing``): the thread environment, peak-RSS measurement in a
fresh subprocess, machine/version metadata, and result files.

Import this module *before* torch (it sets OMP_NUM_THREADS & co., which OpenMP reads
once at start-up). The thread count is ``RNNT_BENCH_THREADS`` (default 2: the size of
every machine of this project); ``rnnt_lattice._cli_util.set_threads(THREADS)`` applies it to
torch and Numba.
"""
from __future__ import annotations

import os

THREADS = int(os.environ.get("RNNT_BENCH_THREADS", "2"))
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[_var] = str(THREADS)

import csv                      # noqa: E402
import datetime as _dt          # noqa: E402
import importlib.metadata as _md  # noqa: E402
import json                     # noqa: E402
import platform                 # noqa: E402
import subprocess               # noqa: E402
import sys                      # noqa: E402
from pathlib import Path        # noqa: E402

import torch                    # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# Distributions whose versions go into every result file (absent ones are recorded as such).
PACKAGES = ("torch", "numpy", "numba", "llvmlite", "triton", "rnnt-lattice", "torchaudio",
            "warprnnt-numba", "nemo-toolkit", "fast_rnnt", "optimized_transducer")


from timing import fmt_s  # noqa: E402,F401


# --------------------------------------------------------------------------- memory

def peak_rss_extra(script: Path, args: list, timeout: float = 600.0) -> dict:
    """CPU memory: peak RSS of a fresh subprocess doing one fwd+bwd, minus that of a baseline subprocess
    that does everything else (imports, the provider's JIT warm-up, making the inputs).
    Both children reset their high-water mark after that common part (``reset_peak_rss``),
    so the difference is the call's own peak: its outputs, gradient and workspaces.

    ``script`` must accept ``--mem-child MODE ...args`` with MODE in {baseline, run} and print
    one JSON line with ``maxrss_kb`` last.
    """
    res = {}
    for mode in ("baseline", "run"):
        cmd = [sys.executable, str(script), "--mem-child", mode, *map(str, args)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            tail = (p.stderr.strip().splitlines() or ["?"])[-1]
            return {"error": f"{mode} child failed: {tail[:200]}"}
        res[mode] = json.loads(p.stdout.strip().splitlines()[-1])["maxrss_kb"]
    return {"baseline_mb": res["baseline"] / 1024, "run_mb": res["run"] / 1024,
            "extra_mb": (res["run"] - res["baseline"]) / 1024}


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (Linux >= 4.0: ``5 > /proc/self/clear_refs``),
    so that imports and JIT compilation before it do not mask a smaller peak after it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rss_kb() -> int:
    """This process's resident set size now, in KiB (VmRSS; 0 where unknown)."""
    for line in _read("/proc/self/status").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def maxrss_kb() -> int:
    """Peak RSS in KiB since start or since :func:`reset_peak_rss` (VmHWM), else ru_maxrss."""
    for line in _read("/proc/self/status").splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB on Linux


# --------------------------------------------------------------------------- A/B
def paired_ab(script: Path, argv: list, tree_b: Path, pairs: int, figure,
              timeout: float = 600.0) -> dict:
    """The figure of ``script argv`` with this checkout's package (A) against the package of
    another checkout ``tree_b`` (B: its ``src/``), each run a fresh process, A and B in
    turn ``pairs`` times (``A B A B ..``), the harness (``script``) this checkout's for
    both. ``figure(stdout) -> float`` reads a run's figure. The ratio A/B is taken pair by
    pair, so that the machine's drift during the runs cancels out of it (on this project's
    shared 2-core machines one process's median could differ from the next's by 1.5x).
    Returns ``{"a": [..], "b": [..], "ratios": [..], "median": r, "min": r, "max": r}``."""
    import statistics
    runs = {"a": [], "b": []}
    for _ in range(pairs):
        for side, tree in (("a", HERE.parent), ("b", Path(tree_b))):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [str(Path(tree).resolve() / "src"), os.environ.get("PYTHONPATH", "")]))
            p = subprocess.run([sys.executable, str(script), *map(str, argv)], env=env,
                               capture_output=True, text=True, timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"{side} ({tree}) failed: {p.stderr.strip()[-2000:]}")
            runs[side].append(figure(p.stdout))
    ratios = [a / b for a, b in zip(runs["a"], runs["b"])]
    return dict(runs, ratios=ratios, median=statistics.median(ratios), min=min(ratios),
                max=max(ratios))


def host_work_us(stdout: str) -> float:
    """The microseconds a run of ``host_overhead.py`` printed (its ``--vs``)."""
    import re
    return float(re.search(r": ([0-9.]+) us of host work per forward\+backward", stdout)[1])


def host_step_us(stdout: str) -> float:
    """The microseconds a run of ``pruned_profile.py --host`` printed (its ``--vs``)."""
    import re
    return float(re.search(r": ([0-9.]+) us of host time a step", stdout)[1])


def _fig(x: float) -> str:
    """A time with four figures down to 1 (12345.6, 152.9, 12.30, 1.234), three decimals
    below (0.235): s1's sub-millisecond passes keep their digits."""
    return f"{x:.{1 if x >= 100 else 2 if x >= 10 else 3}f}"


def print_ab(out: dict, unit: str, tree_b) -> None:
    """``paired_ab``'s result, a line a pair and the ratios' median and range."""
    for i, (a, b, r) in enumerate(zip(out["a"], out["b"], out["ratios"])):
        print(f"  pair {i + 1}: A {_fig(a)} {unit}, B {_fig(b)} {unit}, A/B {r:.3f}")
    print(f"A (this checkout) / B ({tree_b}): median {out['median']:.3f} over "
          f"{len(out['ratios'])} pairs (min {out['min']:.3f}, max {out['max']:.3f})")


# --------------------------------------------------------------------------- metadata

def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "n/a"


def cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = _md.version(name)
        except _md.PackageNotFoundError:
            out[name] = None
    return out


def git_commit() -> str:
    """The commit measured: ``RNNT_LATTICE_COMMIT`` when set (a tree carried to another
    machine, whose copy of ``.git`` may lag behind: pass the hash with the command), else
    the checkout's HEAD."""
    if os.environ.get("RNNT_LATTICE_COMMIT"):
        return os.environ["RNNT_LATTICE_COMMIT"]
    try:
        return subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or "n/a"
    except (OSError, subprocess.SubprocessError):
        return "n/a"


def machine_info() -> dict:
    mem_kb = next((int(l.split()[1]) for l in _read("/proc/meminfo").splitlines()
                   if l.startswith("MemTotal")), 0)
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu_model": cpu_model(),
        "cpus_online": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "mem_gib": round(mem_kb / 2**20, 1),
        "kernel": platform.release(),
        "loadavg_at_start": os.getloadavg(),
        "threads": THREADS,
        "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"),
        "torch_num_threads": torch.get_num_threads(),
        "python_executable": sys.executable,
        "git_commit": git_commit(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "versions": versions(),
    }


# --------------------------------------------------------------------------- output

def write_results(stem: str, meta: dict, rows: list, markdown: str, out_dir: Path = RESULTS) -> dict:
    """Write ``<stem>.csv``, ``<stem>.json`` (meta + rows) and ``<stem>.md``; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {ext: out_dir / f"{stem}.{ext}" for ext in ("csv", "json", "md")}
    cols = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt_csv(r.get(k)) for k in cols})
    with open(paths["json"], "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    gpu = (f"GPU: {meta['gpu']} ({meta['gpu_mem_gib']} GiB, sm {meta['device_capability']}), "
           f"CUDA {meta['cuda']}.  \n" if meta.get("gpu") else "")
    head = (f"Machine: {meta['cpu_model']}, {meta['cpus_usable']} cores, {meta['mem_gib']} GiB; "
            f"threads {meta['threads']}; load average at start {tuple(round(x, 2) for x in meta['loadavg_at_start'])}; "
            f"THP {meta['thp_enabled']}, THP_MEM_ALLOC_ENABLE={meta['THP_MEM_ALLOC_ENABLE']}.  \n"
            + gpu +
            f"Date (UTC): {meta['date_utc']}; commit {meta['git_commit']}; command: `{meta['command']}`.  \n"
            "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v) + "\n\n")
    paths["md"].write_text(head + markdown)
    return {k: str(v) for k, v in paths.items()}


def _fmt_csv(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def md_table(header: list, rows: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"
