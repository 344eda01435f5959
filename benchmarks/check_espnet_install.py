"""ESPnet's transducer models training on CPU through
``rnnt_lattice.compat.warp_transducer.install()``, without warp-transducer:

1. before ``install()``: ``import warprnnt_pytorch`` fails (ESPnet then logs
   "warp-transducer was not installed" and exits);
2. after it, two small ESPnet transducer models, built from their constructors as a
   recipe's config would build them, train a few Adam steps on CPU on one batch:
   ``espnet2.asr_transducer.espnet_transducer_model.ESPnetASRTransducerModel`` (a Conformer
   encoder, a stateless decoder) and ``espnet2.asr.espnet_model.ESPnetASRModel`` with a
   ``TransducerDecoder`` and a joint network (RNN encoder, LSTM decoder);
3. at every step the model's transducer loss equals ``rnnt_lattice.rnnt_loss`` of the same
   joint output under ESPnet's reduction (warp-transducer's ``"mean"``: the sum over the
   batch divided by B), recomputed outside the model from the joint output ESPnet built and
   ESPnet's own ``get_transducer_task_io`` targets; the loss goes down.

ESPnet is heavy and pins ``setuptools < 74`` while torch 2.13 needs ``>= 77``, so pip cannot
install both with dependencies; ESPnet itself and the few packages these models import are
enough:

    python -m venv /tmp/venv-espnet && /tmp/venv-espnet/bin/pip install torch==2.13.0
    /tmp/venv-espnet/bin/pip install --no-deps espnet==202511
    /tmp/venv-espnet/bin/pip install typeguard humanfriendly numpy scipy configargparse \\
        packaging PyYAML kaldiio torch_complex sentencepiece editdistance numba
    PYTHONPATH=src /tmp/venv-espnet/bin/python benchmarks/check_espnet_install.py

Exit status 1 if any check fails.
"""
from __future__ import annotations

import importlib
import sys
import warnings

import torch

FAILED: list[str] = []


def check(name: str, ok: bool, detail: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {name}: {detail}")
    if not ok:
        FAILED.append(name)


def _tokens(V: int) -> list:
    return ["<blank>", "<unk>"] + [chr(97 + i) for i in range(V - 3)] + ["<sos/eos>"]


def _batch(V: int, feat: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 48, feat, generator=g)
    x_lens = torch.tensor([48, 40, 36])
    y = torch.randint(2, V - 1, (3, 5), generator=g)
    y_lens = torch.tensor([5, 3, 4])
    y = y.masked_fill(torch.arange(5)[None] >= y_lens[:, None], -1)      # ESPnet's ignore_id
    return x, x_lens, y, y_lens


def transducer_model(V: int, feat: int):
    from espnet2.asr_transducer.decoder.stateless_decoder import StatelessDecoder
    from espnet2.asr_transducer.encoder.encoder import Encoder
    from espnet2.asr_transducer.espnet_transducer_model import ESPnetASRTransducerModel
    from espnet2.asr_transducer.joint_network import JointNetwork

    enc = Encoder(feat, [{"block_type": "conformer", "hidden_size": 16, "linear_size": 32,
                          "conv_mod_kernel_size": 3}],
                  input_conf={"vgg_like": False, "subsampling_factor": 4, "conv_size": 8})
    dec = StatelessDecoder(V, embed_size=16)
    joint = JointNetwork(V, enc.output_size, dec.output_size, joint_space_size=16)
    return ESPnetASRTransducerModel(V, _tokens(V), None, None, None, enc, dec, joint)


def asr_model_with_joint(V: int, feat: int):
    from espnet2.asr.ctc import CTC
    from espnet2.asr.decoder.transducer_decoder import TransducerDecoder
    from espnet2.asr.encoder.rnn_encoder import RNNEncoder
    from espnet2.asr.espnet_model import ESPnetASRModel
    from espnet2.asr_transducer.joint_network import JointNetwork

    enc = RNNEncoder(feat, num_layers=1, hidden_size=16, output_size=16, subsample=(2,))
    dec = TransducerDecoder(V, num_layers=1, hidden_size=16)
    joint = JointNetwork(V, enc.output_size(), 16, joint_space_size=16)
    return ESPnetASRModel(V, _tokens(V), None, None, None, None, enc, None, dec,
                          CTC(V, enc.output_size()), joint, ctc_weight=0.0, report_cer=False,
                          report_wer=False)


def train(name: str, model, feat: int, V: int, steps: int = 4) -> None:
    import rnnt_lattice
    from espnet2.asr_transducer.utils import get_transducer_task_io

    criterion = model.criterion_transducer
    print(f"{name}: criterion {type(criterion).__module__}.{type(criterion).__name__}"
          if criterion is not None else f"{name}: criterion built at the first loss")
    seen = {}
    model.joint_network.register_forward_hook(lambda m, i, o: seen.__setitem__("joint", o))
    x, x_lens, y, y_lens = _batch(V, feat)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss, stats, _ = model(x, x_lens, y, y_lens)
        loss.backward()
        opt.step()
        with torch.no_grad():
            _, enc_lens = model.encode(x, x_lens)
            _, target, t_len, u_len = get_transducer_task_io(y[:, :int(y_lens.max())], enc_lens,
                                                             ignore_id=-1, blank_id=0)
            want = rnnt_lattice.rnnt_loss(seen["joint"].detach().float(), target, t_len, u_len,
                                          blank=0, reduction="mean")
        got = float(stats.get("loss_transducer", loss).reshape(-1)[0])
        check(f"{name} step {step}", abs(got - float(want)) <= 1e-5 * max(1.0, abs(float(want))),
              f"loss {got:.6f}, rnnt_lattice.rnnt_loss 'mean' {float(want):.6f}")
        losses.append(got)
    crit = model.criterion_transducer
    check(f"{name} criterion", type(crit).__module__ == "rnnt_lattice.compat.warp_transducer",
          f"{type(crit).__module__}.{type(crit).__name__}")
    check(f"{name} trains", losses[-1] < losses[0], f"losses {[round(v, 4) for v in losses]}")


def main() -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    import espnet
    import rnnt_lattice.compat.warp_transducer as wt

    print(f"espnet {espnet.__version__}, torch {torch.__version__}")
    try:
        importlib.import_module("warprnnt_pytorch")
        check("no warp-transducer before install()", False, "a warprnnt_pytorch is installed")
    except ImportError as err:
        check("no warp-transducer before install()", True, f"import warprnnt_pytorch: {err}")
    check("install()", wt.install() is True, "import warprnnt_pytorch -> rnnt_lattice.compat.warp_transducer")
    V, feat = 8, 20
    torch.manual_seed(0)
    train("ESPnetASRTransducerModel", transducer_model(V, feat), feat, V)
    torch.manual_seed(0)
    train("ESPnetASRModel + joint network", asr_model_with_joint(V, feat), feat, V)
    wt.uninstall()
    print("FAILED: " + ", ".join(FAILED) if FAILED else "all checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
