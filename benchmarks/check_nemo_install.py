"""NeMo's own ``RNNTLoss`` computing with rnnt_lattice through
``rnnt_lattice.compat.nemo.install()``, checked on CPU in the peers' environment:

1. before ``install()``: NeMo's TDT and multi-blank losses refuse CPU tensors;
2. after it, ``RNNTLoss(num_classes, loss_name=..., loss_kwargs=...)`` with NeMo's example
   loss configs (``warprnnt_numba``; ``tdt`` with durations [0,1,2,3,4], sigma 0.05,
   omega 0.1, FastEmit 0.001; ``multiblank_rnnt`` with big blanks [2,4,8], sigma 0.05)
   against NeMo's pure-PyTorch references (``RNNTLossPytorch``, ``TDTLossPytorch``,
   ``MultiblankRNNTLossPytorch``, through the same ``RNNTLoss`` wrapper: loss names
   ``pytorch``, ``tdt_pytorch``, ``multiblank_rnnt_pytorch``) and, for the standard loss, NeMo's
   own numba CPU loss: the reported loss is ``(1 + fastemit_lambda)`` times the reference's,
   and with FastEmit and omega off the gradients agree;
3. a tiny NeMo ``EncDecRNNTModel`` per config, built from those loss sections unchanged,
   trained a few steps by Lightning on CPU through NeMo's own ``training_step``;
4. NeMo's own numba CPU loss beside ours on the behaviours compat deliberately changes
   (docs/migrating.md, NeMo): its functional TDT/multi-blank, the cost without a gradient,
   a second backward, clamp under ``'mean'``, an unknown reduction.

    bash benchmarks/setup_peers.sh nemo_full        # once: NeMo's full ASR import
    PYTHONPATH=src benchmarks/.venv-peers/bin/python benchmarks/check_nemo_install.py

Exit status 1 if any check fails. NeMo's ``TDTLossPytorch`` allocates with ``.cuda()``; the
script keeps it on the CPU by making ``Tensor.cuda`` an identity while the reference runs.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import warnings

import torch

FAILED: list[str] = []


def check(name: str, ok: bool, detail: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {name}: {detail}")
    if not ok:
        FAILED.append(name)


@contextlib.contextmanager
def cuda_is_cpu():
    """NeMo's TDTLossPytorch calls ``.cuda()`` on its work tensors: keep them on the CPU."""
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = cuda


# NeMo's example loss sections (examples/asr/conf/conformer/tdt/conformer_tdt_bpe.yaml,
# .../multiblank/conformer_multiblank_transducer_bpe.yaml; the standard one as in NeMo's
# test_asr_rnnt_encdec_model.py): loss_name + "<loss_name>_kwargs".
CONFIGS = {
    "warprnnt_numba": dict(loss_name="default", warprnnt_numba_kwargs=dict(fastemit_lambda=0.001)),
    "tdt": dict(loss_name="tdt", tdt_kwargs=dict(fastemit_lambda=0.001, clamp=-1.0,
                                                 durations=[0, 1, 2, 3, 4], sigma=0.05, omega=0.1)),
    "multiblank_rnnt": dict(loss_name="multiblank_rnnt", multiblank_rnnt_kwargs=dict(
        fastemit_lambda=0.0, clamp=-1.0, big_blank_durations=[2, 4, 8], sigma=0.05)),
}
# Their decoding sections (TDT and multi-blank decoding need the durations there too).
DECODING = {
    "warprnnt_numba": dict(strategy="greedy_batch", greedy=dict(max_symbols=10)),
    "tdt": dict(strategy="greedy", model_type="tdt", durations=[0, 1, 2, 3, 4],
                greedy=dict(max_symbols=10)),
    "multiblank_rnnt": dict(strategy="greedy_batch", model_type="multiblank",
                            big_blank_durations=[2, 4, 8], greedy=dict(max_symbols=10)),
}
REFERENCE = {"warprnnt_numba": "pytorch", "tdt": "tdt_pytorch",
             "multiblank_rnnt": "multiblank_rnnt_pytorch"}
V = 6                                         # non-blank labels
T_LENS, U_LENS = [10, 8, 6], [4, 3, 2]


def loss_kwargs(config: str) -> dict:
    cfg = CONFIGS[config]
    name = "warprnnt_numba" if cfg["loss_name"] == "default" else cfg["loss_name"]
    return dict(cfg[f"{name}_kwargs"])


def layout(config: str, kwargs: dict):
    """``(num_classes, joint outputs)`` of NeMo's layout for a loss config."""
    if config == "tdt":
        return V, V + 1 + len(kwargs["durations"])
    if config == "multiblank_rnnt":
        n_big = len(kwargs["big_blank_durations"])
        return V + n_big, V + n_big + 1
    return V, V + 1


def inputs(n_out: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T, U = len(T_LENS), max(T_LENS), max(U_LENS)
    acts = torch.randn(B, T, U + 1, n_out, generator=g)
    labels = torch.randint(V, (B, U), generator=g)
    return acts, labels, torch.tensor(T_LENS), torch.tensor(U_LENS)


def run_loss(loss, acts, labels, T_b, U_b, reference=False):
    """Per-sequence losses (reduction None) and the gradient of their sum."""
    x = acts.clone().requires_grad_()
    with cuda_is_cpu() if reference else contextlib.nullcontext():
        out = loss(log_probs=x, targets=labels, input_lengths=T_b, target_lengths=U_b)
        out.sum().backward()
    return out.detach(), x.grad


def rel(a, b):
    return float(((a - b).abs() / b.abs().clamp_min(1e-30)).max())


def section_before(RNNTLoss):
    print("1. NeMo's own losses on CPU, before install()")
    for config in ("tdt", "multiblank_rnnt"):
        kw = loss_kwargs(config)
        num_classes, n_out = layout(config, kw)
        loss = RNNTLoss(num_classes, reduction=None, loss_name=config, loss_kwargs=kw)
        try:
            run_loss(loss, *inputs(n_out))
            check(f"{config} refuses CPU", False, "it ran")
        except (ValueError, NotImplementedError) as err:
            check(f"{config} refuses CPU", True, f"{type(loss._loss).__module__}."
                  f"{type(loss._loss).__name__} raised {type(err).__name__}: {err!s:.60}")


def section_losses(RNNTLoss, nemo_numba_rnnt):
    import rnnt_lattice.compat.nemo as compat

    print("2. after install(): NeMo's RNNTLoss against its pure-PyTorch references (CPU, float32)")
    for config in CONFIGS:
        kw = loss_kwargs(config)
        num_classes, n_out = layout(config, kw)
        args = inputs(n_out, seed=len(config))
        loss = RNNTLoss(num_classes, reduction=None, loss_name=config, loss_kwargs=dict(kw))
        check(f"{config} resolves to ours", type(loss._loss) is getattr(compat, type(loss._loss).__name__),
              f"RNNTLoss._loss is {type(loss._loss).__module__}.{type(loss._loss).__name__}")
        ref_kw = {k: v for k, v in kw.items() if k in ("durations", "big_blank_durations", "sigma")}
        ref = RNNTLoss(num_classes, reduction=None, loss_name=REFERENCE[config], loss_kwargs=ref_kw)
        want, want_grad = run_loss(ref, *args, reference=True)
        lam = kw.get("fastemit_lambda", 0.0)
        torch.manual_seed(0)
        got, _ = run_loss(loss, *args)
        if config == "tdt":
            # omega = 0.1: this call may have been the token RNN-T loss; retry until the TDT one.
            for seed in range(1, 20):
                if rel(got, (1 + lam) * want) < 1e-4:
                    break
                torch.manual_seed(seed)
                got, _ = run_loss(loss, *args)
        check(f"{config} loss = (1+{lam}) x {REFERENCE[config]}", rel(got, (1 + lam) * want) < 2e-5,
              f"ours {[round(v, 5) for v in got.tolist()]}, reference "
              f"{[round(v, 5) for v in want.tolist()]}, max rel err {rel(got, (1 + lam) * want):.1e}")
        # The references are float32 (their alpha buffers are): agreement to float32 rounding.
        exact = dict(kw, fastemit_lambda=0.0, **({"omega": 0.0} if config == "tdt" else {}))
        got0, grad0 = run_loss(RNNTLoss(num_classes, reduction=None, loss_name=config,
                                        loss_kwargs=exact), *args)
        err = float((grad0 - want_grad).abs().max())
        check(f"{config} gradient (FastEmit, omega off) = reference's", err < 1e-5,
              f"max |diff| {err:.1e} (max |grad| {float(want_grad.abs().max()):.2f})")
        if config == "warprnnt_numba":
            nemo_got, nemo_grad = run_loss(nemo_numba_rnnt, *args)
            _, ours_grad = run_loss(loss, *args)
            err = float((ours_grad - nemo_grad).abs().max())
            check("warprnnt_numba = NeMo's own numba CPU loss", rel(got, nemo_got) < 2e-6 and err < 1e-5,
                  f"loss max rel err {rel(got, nemo_got):.1e}, gradient max |diff| {err:.1e} "
                  f"(FastEmit {lam} in both)")
        if config == "tdt":
            tokens = RNNTLoss(num_classes, reduction=None, loss_name="pytorch")
            rnnt_want, _ = run_loss(tokens, args[0][..., :V + 1], *args[1:], reference=True)
            torch.manual_seed(1234)
            n, picks = 200, {"tdt": 0, "rnnt": 0, "?": 0}
            with torch.no_grad():
                for _ in range(n):
                    c = loss(log_probs=args[0], targets=args[1], input_lengths=args[2],
                             target_lengths=args[3])
                    picks["tdt" if rel(c, (1 + lam) * want) < 2e-5 else
                          "rnnt" if rel(c, (1 + lam) * rnnt_want) < 2e-5 else "?"] += 1
            check("tdt omega=0.1 samples the token RNN-T loss", picks["?"] == 0 and 0 < picks["rnnt"] < 0.25 * n,
                  f"{n} calls: {picks['tdt']} TDT, {picks['rnnt']} RNN-T (of the token logits, "
                  f"= (1+lambda) x NeMo's RNNTLossPytorch), {picks['?']} other")


def tiny_model(config: str):
    from omegaconf import DictConfig, OmegaConf

    from nemo.collections.asr.models import EncDecRNNTModel

    loss_cfg = CONFIGS[config]
    extra = {"tdt": len(loss_kwargs("tdt")["durations"]),
             "multiblank_rnnt": len(loss_kwargs("multiblank_rnnt")["big_blank_durations"])}.get(config, 0)
    cfg = {
        "labels": [" ", "a", "b", "c", "d", "e", "f", "g"],
        "sample_rate": 16000,
        "model_defaults": {"enc_hidden": 32, "pred_hidden": 32},
        "preprocessor": {"_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
                         "features": 16, "n_fft": 512, "dither": 0.0},
        "encoder": {"_target_": "nemo.collections.asr.modules.ConvASREncoder", "feat_in": 16,
                    "activation": "relu", "conv_mask": True,
                    "jasper": [{"filters": 32, "repeat": 1, "kernel": [3], "stride": [2],
                                "dilation": [1], "dropout": 0.0, "residual": False,
                                "separable": False, "se": False}]},
        "decoder": {"_target_": "nemo.collections.asr.modules.RNNTDecoder",
                    "prednet": {"pred_hidden": 32, "pred_rnn_layers": 1}},
        "joint": {"_target_": "nemo.collections.asr.modules.RNNTJoint", "num_extra_outputs": extra,
                  "jointnet": {"joint_hidden": 32, "activation": "relu"}},
        "decoding": DECODING[config],
        "loss": loss_cfg,                                 # NeMo's example section, unchanged
        "optim": {"name": "adam", "lr": 0.01},
    }
    model = EncDecRNNTModel(cfg=DictConfig(cfg))
    model.setup_optimization(OmegaConf.create(cfg["optim"]))
    return model


def section_training():
    import lightning.pytorch as pl

    print("3. a tiny NeMo EncDecRNNTModel per example loss config, trained by Lightning on CPU")
    g = torch.Generator().manual_seed(0)
    B = 4
    signal = 0.1 * torch.randn(B, 8000, generator=g)                      # 0.5 s at 16 kHz
    signal_len = torch.tensor([8000, 7000, 6000, 5000])
    transcript = torch.randint(1, 8, (B, 5), generator=g)
    transcript_len = torch.tensor([5, 4, 4, 3])
    data = torch.utils.data.TensorDataset(signal, signal_len, transcript, transcript_len)
    for config in CONFIGS:
        model = tiny_model(config)
        losses = []
        step = model.training_step

        def training_step(batch, batch_nb, step=step, losses=losses):
            out = step(batch, batch_nb)                   # NeMo's own training_step
            losses.append(float(out["loss"]))
            return out

        model.training_step = training_step
        loader = torch.utils.data.DataLoader(data, batch_size=B)
        with tempfile.TemporaryDirectory() as root:
            trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=20, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False, default_root_dir=root)
            trainer.fit(model, train_dataloaders=loader)
        name = f"{type(model.loss._loss).__module__}.{type(model.loss._loss).__name__}"
        check(f"{config} model trains on CPU ({name})",
              len(losses) == 20 and all(map(lambda v: v == v and v < float("inf"), losses))
              and losses[-1] < 0.5 * losses[0],
              f"loss over 20 steps {losses[0]:.3f} -> {losses[9]:.3f} -> {losses[-1]:.3f}")


def section_differences():
    import nemo.collections.asr.parts.numba.rnnt_loss.rnnt_pytorch as theirs

    import rnnt_lattice.compat.nemo as ours

    print("4. NeMo's own numba CPU loss beside compat.nemo on the deliberate differences")
    g = torch.Generator().manual_seed(0)
    acts, labels = torch.randn(2, 5, 3, 6, generator=g), torch.tensor([[1, 2], [3, 4]])
    T_b, U_b = torch.tensor([5, 5]), torch.tensor([2, 2])

    def outcome(fn):
        try:
            return fn()
        except Exception as err:                         # NeMo's failures are the point here
            return f"{type(err).__name__}: {str(err)[:70]}"

    for name in ("tdt_loss", "multiblank_rnnt_loss"):
        extra = [0, 1, 2] if name == "tdt_loss" else [2]
        n_out = 6 + 3 if name == "tdt_loss" else 7           # blank 5 (TDT) / 6 (big blank: 5)
        x = torch.randn(2, 5, 3, n_out, generator=g)
        blank = 5 if name == "tdt_loss" else 6
        print(f"  functional {name}: NeMo -> {outcome(lambda: getattr(theirs, name)(x, labels, T_b, U_b, blank, extra))}; "
              f"ours -> {outcome(lambda: [round(v, 4) for v in getattr(ours, name)(x, labels, T_b, U_b, blank, extra).tolist()])}")
    for side, mod in (("NeMo", theirs), ("ours", ours)):
        loss = mod.RNNTLossNumba(blank=0, reduction="none", fastemit_lambda=0.5)
        costs = [loss(acts.clone().requires_grad_(flag), labels, T_b, U_b).detach() for flag in (False, True)]
        print(f"  {side}: fastemit_lambda=0.5 costs without / with a gradient: "
              f"{[round(v, 4) for v in costs[0].tolist()]} / {[round(v, 4) for v in costs[1].tolist()]}")
    for side, mod in (("NeMo", theirs), ("ours", ours)):
        x = acts.clone().requires_grad_()
        out = 3.0 * mod.RNNTLossNumba(blank=0, reduction="sum")(x, labels, T_b, U_b).sum()
        first = torch.autograd.grad(out, x, retain_graph=True)[0]
        second = outcome(lambda: torch.equal(torch.autograd.grad(out, x)[0], first))
        print(f"  {side}: second backward (retain_graph) equals the first: {second}")
    for side, mod in (("NeMo", theirs), ("ours", ours)):
        x = acts.clone().requires_grad_()
        mod.RNNTLossNumba(blank=0, reduction="mean", clamp=0.1)(x, labels, T_b, U_b).sum().backward()
        print(f"  {side}: clamp=0.1, reduction='mean', B=2: max |grad| = {float(x.grad.abs().max()):.4f}")
    for side, mod in (("NeMo", theirs), ("ours", ours)):
        print(f"  {side}: reduction='mean_batch' -> "
              f"{outcome(lambda: tuple(mod.RNNTLossNumba(blank=0, reduction='mean_batch')(acts, labels, T_b, U_b).shape))}")


def main() -> int:
    warnings.filterwarnings("ignore")
    import numba
    import nemo
    from nemo.collections.asr.losses.rnnt import RNNTLoss
    from nemo.utils import logging as nemo_logging

    nemo_logging.setLevel(logging.ERROR)                 # NeMo's info/warnings: the checks only
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)

    import rnnt_lattice
    import rnnt_lattice.compat.nemo as compat

    print(f"torch {torch.__version__}, numba {numba.__version__}, nemo-toolkit {nemo.__version__}, "
          f"rnnt_lattice {rnnt_lattice.__version__} ({os.path.dirname(rnnt_lattice.__file__)})")
    section_before(RNNTLoss)
    nemo_numba_rnnt = RNNTLoss(V, reduction=None, loss_name="warprnnt_numba",
                               loss_kwargs=loss_kwargs("warprnnt_numba"))
    compat.install()
    section_losses(RNNTLoss, nemo_numba_rnnt)
    section_training()
    compat.uninstall()
    section_differences()
    print("all checks passed" if not FAILED else f"FAILED: {FAILED}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
