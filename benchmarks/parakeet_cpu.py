"""One training step of a Hugging Face transformers Parakeet TDT model on CPU, three ways:
transformers' own loss, ``rnnt_lattice.compat.transformers.install()``, and the fused
opt-in ``fuse(model)``; and the TDT loss alone (transformers' ``tdt_loss`` against
``install()``'s, on the same joint output). Time and peak memory, with the ratios taken in
the same run.

The model: Parakeet's joint and decoder (decoder hidden 640, V = 1025 tokens + 5 durations
[0, 1, 2, 3, 4]) over a small FastConformer encoder (1 layer, hidden 64), B = 8, about 200
encoder frames (1600 mel frames, 8x subsampling; ragged lengths) and U = 60 labels (ragged).
The step is ``zero_grad``, forward with ``labels``, ``backward``, an SGD step.

    pip install transformers==5.23.0          # next to torch and rnnt_lattice
    PYTHONPATH=src python benchmarks/parakeet_cpu.py            # --reps 5 --threads 2

Each way runs in its own process (peak memory: the growth of the resident set's high-water
mark over the step, ``VmHWM`` reset through ``/proc/self/clear_refs``, glibc's mmap
threshold fixed so that freed tensors leave the resident set); each repeats the step
``--reps`` times after one warm-up step and reports the min and the median of the wall
time, of the process's CPU time (less sensitive to other processes on a shared machine) and
of the peak memory; the loss-alone rounds alternate transformers' and ours. The ratios
(transformers' own / ours) are of medians measured in this one run; ``uptime`` is printed
with them.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

B, U, MEL, SUB = 8, 60, 1600, 8
V, DURATIONS, H_DEC = 1025, [0, 1, 2, 3, 4], 640


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                       # reset VmHWM to the current RSS


def _model_and_batch(torch):
    from transformers import ParakeetEncoderConfig, ParakeetForTDT, ParakeetTDTConfig

    torch.manual_seed(0)
    enc = ParakeetEncoderConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=128, subsampling_factor=SUB,
                                subsampling_conv_channels=16, num_mel_bins=80, dropout=0.0,
                                dropout_positions=0.0, layerdrop=0.0, activation_dropout=0.0,
                                attention_dropout=0.0)
    cfg = ParakeetTDTConfig(vocab_size=V, decoder_hidden_size=H_DEC, durations=DURATIONS,
                            encoder_config=enc.to_dict(), blank_token_id=V - 1, pad_token_id=2)
    model = ParakeetForTDT(cfg).train()
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(B, MEL, 80, generator=g)
    mel_lens = torch.linspace(MEL * 0.9, MEL, B).long()
    mask = (torch.arange(MEL)[None] < mel_lens[:, None]).long()
    u_lens = torch.linspace(U * 0.75, U, B).long()
    labels = torch.randint(3, V - 1, (B, U), generator=g)
    labels = labels.masked_fill(torch.arange(U)[None] >= u_lens[:, None], cfg.pad_token_id)
    ids = torch.cat([torch.full((B, 1), cfg.blank_token_id),
                     labels.masked_fill(labels == cfg.pad_token_id, cfg.blank_token_id)], 1)
    batch = dict(input_features=feats, attention_mask=mask, decoder_input_ids=ids, labels=labels)
    return model, batch


def _measure(fns: dict, reps: int) -> dict:
    """Each of ``fns`` once to warm up, then ``reps`` rounds of each in turn (interleaved:
    a change of the machine's load falls on all of them): wall time, the process's CPU
    time (less sensitive to other processes on a shared machine) and peak memory."""
    for fn in fns.values():
        fn()                                               # warm-up (compilation, caches)
    out = {name: dict(times=[], cpu=[], peaks=[]) for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            gc.collect()
            base = _rss("VmRSS")
            _reset_peak()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            out[name]["times"].append(time.perf_counter() - t0)
            out[name]["cpu"].append(time.process_time() - c0)
            out[name]["peaks"].append(_rss("VmHWM") - base)
    return out


def _child(way: str, reps: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    import rnnt_lattice.compat.transformers as ct

    model, batch = _model_and_batch(torch)
    out = {"way": way}
    if way == "loss":
        # The TDT loss alone, forward + backward, on one joint output (B, T, U+1, V + D).
        from transformers.loss.loss_tdt import tdt_loss as theirs
        with torch.no_grad():
            enc = model.get_audio_features(input_features=batch["input_features"],
                                           attention_mask=batch["attention_mask"])
            joint = model.joint(encoder_hidden_states=enc.pooler_output[:, :, None],
                                decoder_hidden_states=model.decoder(batch["decoder_input_ids"])[:, None])
        joint.requires_grad_()
        labels = batch["labels"]
        args = (labels, enc.attention_mask.sum(-1), (labels != model.config.pad_token_id).sum(-1),
                model.config.blank_token_id, DURATIONS)
        out["shape"] = list(joint.shape)

        def step(f):
            joint.grad = None
            f(joint[..., :V], joint[..., V:], *args).backward()
            joint.grad = None
        out.update(_measure({"theirs": lambda: step(theirs), "ours": lambda: step(ct.tdt_loss)},
                            reps))
        with torch.no_grad():
            out["loss_theirs"] = float(theirs(joint[..., :V], joint[..., V:], *args))
            out["loss_ours"] = float(ct.tdt_loss(joint[..., :V], joint[..., V:], *args))
        return out
    if way == "install":
        ct.install()
    elif way == "fused":
        ct.fuse(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    losses = []

    def step():
        opt.zero_grad(set_to_none=True)
        o = model(**batch)
        o.loss.backward()
        losses.append(float(o.loss.detach()))
        opt.step()
    out.update(_measure({"step": step}, reps)["step"])
    out["first_loss"] = losses[0]
    return out


def _run(way: str, reps: int, threads: int) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(threads))
    r = subprocess.run([sys.executable, __file__, "--child", way, "--reps", str(reps),
                        "--threads", str(threads)], env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{way}: failed\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _fmt(m: dict) -> str:
    t, c, p = m["times"], m["cpu"], m["peaks"]
    return (f"{min(t):8.2f} {statistics.median(t):8.2f}   {min(c):8.2f} {statistics.median(c):8.2f}"
            f"   {min(p) / 2**20:8.0f} {statistics.median(p) / 2**20:8.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="timed steps per way (after a warm-up)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the raw results to this file")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.child, a.reps, a.threads)))
        return
    try:
        import transformers
    except ImportError:
        sys.exit("needs transformers (pip install transformers==5.23.0)")
    import torch

    load_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    res = {w: _run(w, a.reps, a.threads) for w in ("loss", "theirs", "install", "fused")}
    load_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    med = lambda m, k="times": statistics.median(m[k])          # noqa: E731
    print(f"Parakeet TDT on CPU: torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{a.threads} threads, {a.reps} reps (min / median)")
    print(f"B = {B}, joint output {res['loss']['shape']} (T = encoder frames, U+1, V + D), "
          f"decoder hidden {H_DEC}, durations {DURATIONS}")
    print(f"uptime before: {load_before}\nuptime after:  {load_after}\n")
    print(f"{'':34s} {'wall time s':>17s}   {'CPU time s':>17s}   {'peak MiB':>17s}")
    print(f"{'':34s}" + f" {'min':>8s} {'median':>8s}  " * 3)
    L = res["loss"]
    print(f"{'TDT loss alone, transformers':34s} {_fmt(L['theirs'])}")
    print(f"{'TDT loss alone, install()':34s} {_fmt(L['ours'])}")
    for w, name in (("theirs", "step, transformers' own loss"), ("install", "step, install()"),
                    ("fused", "step, fuse(model)")):
        print(f"{name:34s} {_fmt(res[w])}")
    print()
    print(f"loss alone: transformers / install() wall time {med(L['theirs']) / med(L['ours']):.1f}x, "
          f"CPU time {med(L['theirs'], 'cpu') / med(L['ours'], 'cpu'):.1f}x (target >= 20x); "
          f"loss values {L['loss_theirs']:.6f} / {L['loss_ours']:.6f}")
    for w in ("install", "fused"):
        print(f"step: transformers / {w} wall time {med(res['theirs']) / med(res[w]):.2f}x, "
              f"CPU time {med(res['theirs'], 'cpu') / med(res[w], 'cpu'):.2f}x, "
              f"peak memory {med(res['theirs'], 'peaks') / med(res[w], 'peaks'):.1f}x"
              + ("  (target: fused peak <= 1/5 of transformers')" if w == "fused" else ""))
    print("first-step losses: " + ", ".join(f"{w} {res[w]['first_loss']:.6f}"
                                          for w in ("theirs", "install", "fused")))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(results=res, uptime=[load_before, load_after], threads=a.threads,
                           reps=a.reps), f, indent=1)


if __name__ == "__main__":
    main()
