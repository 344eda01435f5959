"""Every bad input raises a ValueError that names the argument (and the shapes or values)."""
from __future__ import annotations

import pytest
import torch

import rnnt_lattice

B, T, U, V = 2, 4, 3, 5


def good():
    return dict(logits=torch.randn(B, T, U + 1, V), targets=torch.randint(1, V, (B, U)),
                logit_lengths=torch.tensor([4, 3]), target_lengths=torch.tensor([3, 2]))


def bad_targets_value(v):
    def edit(a):
        a["targets"] = a["targets"].clone()
        a["targets"][1, 1] = v
    return edit


# name, edit of the good arguments (or extra keyword arguments), words the message must hold
BAD = [
    ("logits_3d", lambda a: a.update(logits=a["logits"][0]), ["logits", "4 dims", "(4, 4, 5)"]),
    ("targets_1d", lambda a: a.update(targets=a["targets"][0]), ["targets", "2 dims", "(3,)"]),
    ("lengths_2d", lambda a: a.update(logit_lengths=a["logit_lengths"][None]), ["logit_lengths", "(1, 2)"]),
    ("batch_mismatch", lambda a: a.update(targets=a["targets"][:1]), ["batch", "targets", "(1, 3)", "B=2"]),
    ("target_width", lambda a: a.update(targets=a["targets"][:, :2]), ["targets", "(2, 2)", "(2, 4, 4, 5)"]),
    ("int_logits", lambda a: a.update(logits=a["logits"].long()), ["logits", "torch.int64"]),
    ("float_targets", lambda a: a.update(targets=a["targets"].float()), ["targets", "int32 or int64"]),
    ("float_lengths", lambda a: a.update(target_lengths=a["target_lengths"].float()), ["target_lengths", "int32"]),
    ("negative_length", lambda a: a.update(logit_lengths=torch.tensor([4, -1])), ["logit_lengths", ">= 0", "-1"]),
    ("logit_length_too_long", lambda a: a.update(logit_lengths=torch.tensor([5, 3])), ["logit_lengths[0] = 5", "T = 4"]),
    ("target_length_too_long", lambda a: a.update(target_lengths=torch.tensor([3, 4])), ["target_lengths[1] = 4", "U = 3"]),
    ("target_too_big", bad_targets_value(V), ["targets[1, 1] = 5", "[0, 5)"]),
    ("target_negative", bad_targets_value(-2), ["targets[1, 1] = -2"]),
    ("target_is_blank", bad_targets_value(0), ["targets[1, 1]", "blank"]),
    ("not_a_tensor", lambda a: a.update(targets=[[1, 2, 3]] * 2), ["targets", "torch.Tensor"]),
    ("reduction", {"reduction": "avg"}, ["reduction", "'avg'"]),
    ("blank_too_big", {"blank": 5}, ["blank=5", "[-5, 5)"]),
    ("blank_too_small", {"blank": -6}, ["blank=-6"]),
    ("blank_not_int", {"blank": 1.0}, ["blank", "1.0"]),
    ("clamp_not_number", {"clamp": "big"}, ["clamp", "'big'"]),
    ("fastemit_nan", {"fastemit_lambda": float("nan")}, ["fastemit_lambda", "NaN"]),
    ("fastemit_inf", {"fastemit_lambda": float("inf")}, ["fastemit_lambda", "finite", "inf"]),
    ("fastemit_neg_inf", {"fastemit_lambda": -float("inf")}, ["fastemit_lambda", "finite", "-inf"]),
    ("clamp_tensor", {"clamp": torch.tensor([0.1, 0.2])}, ["clamp", "(2,)"]),
    ("blank_tensor", {"blank": torch.tensor([0, 1])}, ["blank", "tensor of shape (2,)"]),
    ("bool_targets", lambda a: a.update(targets=a["targets"].bool()), ["targets", "torch.bool"]),
    ("bool_lengths", lambda a: a.update(logit_lengths=a["logit_lengths"].bool()), ["logit_lengths", "torch.bool"]),
    ("backend", {"backend": "cuda"}, ["backend", "'cuda'"]),
]


@pytest.mark.parametrize("name,edit,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_value_error(name, edit, words):
    args = good()
    kwargs = {"blank": 0}
    if callable(edit):
        edit(args)
    else:
        kwargs.update(edit)
    with pytest.raises(ValueError) as err:
        rnnt_lattice.rnnt_loss(args["logits"], args["targets"], args["logit_lengths"],
                               args["target_lengths"], **kwargs)
    for w in words:
        assert w in str(err.value), f"{w!r} not in: {err.value}"


def test_padding_targets_are_not_checked():
    """Target ids past target_lengths are padding: anything goes there."""
    a = good()
    a["targets"][1, 2] = -100
    loss = rnnt_lattice.rnnt_loss(**a, blank=0)
    assert torch.isfinite(loss)


def test_module_validates_too():
    crit = rnnt_lattice.RNNTLoss(blank=0, reduction="bogus")
    a = good()
    with pytest.raises(ValueError, match="reduction"):
        crit(a["logits"], a["targets"], a["logit_lengths"], a["target_lengths"])


def test_numba_backend_rejects_other_devices():
    a = good()
    with pytest.raises(ValueError, match="numba"):
        rnnt_lattice.rnnt_loss(a["logits"].to("meta"), a["targets"].to("meta"),
                               a["logit_lengths"].to("meta"), a["target_lengths"].to("meta"),
                               blank=0, backend="numba")


def test_importing_loads_no_optional_dependency():
    """Importing the package needs torch and numpy only."""
    import subprocess
    import sys
    code = ("import sys, rnnt_lattice; "
            "bad = [m for m in ('numba', 'triton', 'matplotlib') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_public_name_is_documented():
    """docs/api.md lists everything in rnnt_lattice.__all__ (the README links to it)."""
    import pathlib
    api = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    missing = [n for n in rnnt_lattice.__all__ if n != "__version__" and f"`{n}" not in api]
    assert not missing, f"not in docs/api.md: {missing}"


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch(backend, reduction):
    """B = 0: "mean" is 0 (not 0/0 = NaN), like "sum"; the gradient is empty, hence zero."""
    x = torch.randn(0, T, U + 1, V, requires_grad=True)
    out = rnnt_lattice.rnnt_loss(x, torch.zeros(0, U, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                 torch.zeros(0, dtype=torch.int64), blank=0, reduction=reduction,
                                 backend=backend)
    if reduction == "none":
        assert out.shape == (0,)
        out.sum().backward()
    else:
        assert out.shape == () and out.item() == 0.0
        out.backward()
    assert x.grad is not None and x.grad.shape == x.shape
