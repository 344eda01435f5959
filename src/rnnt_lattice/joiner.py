"""The joiner the fused losses' kernels know: ``out(act(enc_proj(enc) + pred_proj(pred)))``
(icefall's and NeMo's joiner; transformers' Parakeet joint without its projections).

Given one, ``fused_rnnt_loss`` (``fused_tdt_loss``, ``fused_multiblank_rnnt_loss``) on the
Triton backend computes the logits block by block in registers, never in memory, forward and
backward (``gpu.joint``, docs/math.md section 12); any other joiner, or this one with its
dropout active, on another backend, keeps the tile path (section 11).
"""
from __future__ import annotations

import numbers

import torch

from ._validate import check_flag, check_int

__all__ = ["Joiner"]

ACTIVATIONS = ("tanh", "relu")


class Joiner(torch.nn.Module):
    """``logits = out(act(enc_proj(enc) + pred_proj(pred)))``: two projections to the
    joiner's width ``hidden``, tanh or ReLU, dropout, a Linear to ``vocab`` classes.

    Example::

        >>> import torch, rnnt_lattice
        >>> joiner = rnnt_lattice.Joiner(8, 6, 16, 10, activation="tanh")
        >>> enc, pred = torch.randn(2, 5, 8), torch.randn(2, 4, 6)    # (B, T, H_enc), (B, U+1, H_pred)
        >>> joiner(enc[:, :, None], pred[:, None]).shape                # (B, T, U+1, V)
        torch.Size([2, 5, 4, 10])

    Args:
        enc_dim, pred_dim: the widths of the encoder's and the prediction network's
            outputs; None: no projection (the inputs are already projected, ``hidden``
            wide: icefall's ``project_input=False``, Parakeet's joint).
        hidden: the joiner's width H. vocab: the classes V (TDT: tokens then durations).
        activation: ``"tanh"`` (icefall) or ``"relu"`` (NeMo, Parakeet).
        dropout: dropout after the activation (NeMo's ``jointnet.dropout``); while it is
            active (training, ``dropout > 0``) the fused losses take the tile path, which
            replays it exactly.
        bias: whether the output Linear has a bias.

    Modules: ``enc_proj``, ``pred_proj`` (``nn.Linear`` or ``nn.Identity``), ``out``
    (``nn.Linear``). Loading weights: docs/api.md, "The joiner the kernels know" (icefall's
    ``encoder_proj``/``decoder_proj``/``output_linear``, NeMo's ``enc``/``pred``/
    ``joint_net``)."""

    def __init__(self, enc_dim: int | None, pred_dim: int | None, hidden: int, vocab: int,
                 activation: str = "tanh", *, dropout: float = 0.0, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        def size(name, n, optional):
            if optional and n is None:                   # no projection
                return None
            try:
                m = check_int(name, n)                   # (NumPy's ints too)
            except ValueError:
                m = 0
            if m < 1:
                raise ValueError(f"{name} must be a positive int"
                                 f"{' or None' if optional else ''}, got {n!r}")
            return m
        hidden, vocab = size("hidden", hidden, False), size("vocab", vocab, False)
        enc_dim, pred_dim = size("enc_dim", enc_dim, True), size("pred_dim", pred_dim, True)
        if (isinstance(dropout, bool) or not isinstance(dropout, numbers.Real)
                or not 0.0 <= float(dropout) < 1.0):
            raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")
        bias = check_flag("bias", bias)                  # (nn.Linear takes any truthy value)
        kw = dict(device=device, dtype=dtype)
        self.enc_proj = (torch.nn.Identity() if enc_dim is None
                         else torch.nn.Linear(enc_dim, hidden, **kw))
        self.pred_proj = (torch.nn.Identity() if pred_dim is None
                          else torch.nn.Linear(pred_dim, hidden, **kw))
        self.out = torch.nn.Linear(hidden, vocab, bias=bias, **kw)
        self.dropout = torch.nn.Dropout(float(dropout))
        self.activation = activation

    @classmethod
    def sharing(cls, out: torch.nn.Linear, activation: str) -> "Joiner":
        """A joiner without projections around an existing output Linear, whose parameters
        it shares (not copies): ``out(act(enc + pred))``, a Parakeet joint's form with its
        ``head``."""
        # (a Linear, or a module standing for one: peft's LoRA layer has its sizes too)
        sizes = (getattr(out, "in_features", None), getattr(out, "out_features", None))
        if not (isinstance(out, torch.nn.Module)
                and all(isinstance(n, numbers.Integral) for n in sizes)):
            raise ValueError(f"out must be the joint's output layer, a torch.nn.Linear (a module "
                             f"with in_features and out_features), got {type(out).__name__}")
        joiner = cls(None, None, out.in_features, out.out_features, activation,
                     bias=getattr(out, "bias", None) is not None, device="meta")
        joiner.out = out
        return joiner

    @property
    def kernel_ready(self) -> bool:
        """Whether the fused losses may take the kernel path: no dropout at work."""
        return not (self.training and self.dropout.p > 0.0)

    def act(self, a: torch.Tensor) -> torch.Tensor:
        return torch.tanh(a) if self.activation == "tanh" else torch.relu(a)

    def forward(self, enc: torch.Tensor, pred: torch.Tensor, *, _loss=None) -> torch.Tensor:
        """``(B, t, 1, H_enc)`` and ``(B, 1, u, H_pred)`` (any shapes that broadcast) ->
        logits ``(B, t, u, V)``. ``_loss``: the fused losses' kernel path (private), which
        calls the joiner itself so that the hooks on it (FSDP2's gathering of its
        parameters) act as on any forward; then the per-sequence costs ``(B,)`` of ``enc
        (B, T, H_enc)`` and ``pred (B, U+1, H_pred)``."""
        if _loss is not None:
            return _loss(self, enc, pred)
        return self.out(self.dropout(self.act(self.enc_proj(enc) + self.pred_proj(pred))))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"
