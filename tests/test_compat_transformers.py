"""``rnnt_lattice.compat.transformers``: transformers' Parakeet TDT and RNN-T losses against
the independent path-enumerating oracle under each of transformers' reductions (NeMo's
names: ``mean_volume``, ``mean_batch``, ``mean``, ``sum``, ``none``), the joint output read
in place, ``install()`` against a stand-in for ``transformers.loss`` injected into
``sys.modules``, and ``fuse()`` on a stand-in Parakeet model (the same encoder / decoder /
``joint(decoder_hidden_states=, encoder_hidden_states=)`` interface). The suite never needs
transformers: its own Parakeet tests are run against ``install()`` outside the suite
(docs/migrating.md), and the real models by ``benchmarks/parakeet_cpu.py``."""
from __future__ import annotations

import dataclasses
import doctest
import subprocess
import sys
import types

import pytest
import torch

import rnnt_lattice
from rnnt_lattice import topology
from rnnt_lattice.compat import transformers as ct
from support.oracle import topology_batch_grad

T_LENS, U_LENS = (5, 3, 4), (2, 1, 3)          # ragged; T = max T_b, U + 1 = max U_b + 1
REDUCTIONS = ("mean_volume", "mean_batch", "mean", "sum", "none")


def _inputs(V: int, n_extra: int = 0, seed: int = 0):
    """float64 joint output ``(B, T, U+1, V + n_extra)`` (NaN in the padding: never read),
    labels ``(B, U)`` in ``[0, V - 1)`` (``-100`` past each length: never read), lengths."""
    g = torch.Generator().manual_seed(seed)
    B, T, U = len(T_LENS), max(T_LENS), max(U_LENS)
    x = torch.randn(B, T, U + 1, V + n_extra, generator=g, dtype=torch.float64)
    T_b, U_b = torch.tensor(T_LENS), torch.tensor(U_LENS)
    pad = ((torch.arange(T)[None, :, None] >= T_b[:, None, None])
           | (torch.arange(U + 1)[None, None, :] > U_b[:, None, None]))
    x = x.masked_fill(pad[..., None], float("nan")).requires_grad_()
    labels = torch.randint(V - 1, (B, U), generator=g)
    labels = labels.masked_fill(torch.arange(U)[None, :] >= U_b[:, None], -100)
    return x, labels, T_b, U_b


def _reduce_weights(losses, U_b, reduction):
    """transformers' reduction written out: the reduced value and d value / d loss_b."""
    U = U_b.double()
    w = {"mean_volume": torch.ones_like(losses) / U.sum(),
         "mean_batch": torch.ones_like(losses) / len(losses),
         "mean": 1 / (U * len(losses)),
         "sum": torch.ones_like(losses),
         "none": torch.ones_like(losses)}[reduction]
    return (losses if reduction == "none" else (w * losses).sum()), w


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_tdt_loss_matches_the_oracle(reduction):
    durations, sigma = [0, 1, 2], 0.05
    x, labels, T_b, U_b = _inputs(5, len(durations))
    losses, grads = topology_batch_grad(x.detach(), labels, T_b, U_b, topology.tdt(durations),
                                        4, fused=True, sigma=sigma)
    want, w = _reduce_weights(losses, U_b, reduction)
    got = ct.tdt_loss(x[..., :5], x[..., 5:], labels, T_b, U_b, 4, durations, sigma=sigma,
                      reduction=reduction)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    up = torch.rand(got.shape, dtype=torch.float32, generator=torch.Generator().manual_seed(1))
    (x_grad,) = torch.autograd.grad(got, x, up)
    want_grad = (up.double() * w)[:, None, None, None] * grads
    torch.testing.assert_close(x_grad.nan_to_num(), want_grad, rtol=1e-5, atol=1e-6)
    # the model's loss: its argument names, and tdt_loss's names as aliases
    for kw in (dict(labels=labels, label_lengths=U_b), dict(targets=labels, target_lengths=U_b)):
        alias = ct.ParakeetForTDTLoss(token_logits=x[..., :5], duration_logits=x[..., 5:],
                                      logit_lengths=T_b, blank_token_id=4, durations=durations,
                                      sigma=sigma, reduction=reduction, output_attentions=None,
                                      **kw)
        torch.testing.assert_close(alias, got, rtol=0, atol=0)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_rnnt_loss_matches_the_oracle(reduction):
    x, labels, T_b, U_b = _inputs(6, seed=2)
    blank = 5
    losses, grads = topology_batch_grad(x.detach(), labels, T_b, U_b, topology.regular(), blank,
                                        fused=True)
    want, w = _reduce_weights(losses, U_b, reduction)
    got = ct.rnnt_loss(x, labels, T_b, U_b, blank_token_id=blank, reduction=reduction)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    (x_grad,) = torch.autograd.grad(got.sum(), x)
    want_grad = w[:, None, None, None] * grads
    torch.testing.assert_close(x_grad.nan_to_num(), want_grad, rtol=1e-5, atol=1e-6)
    for kw in (dict(labels=labels, label_lengths=U_b), dict(targets=labels, target_lengths=U_b)):
        alias = ct.ParakeetForRNNTLoss(logits=x, logit_lengths=T_b, blank_token_id=blank,
                                       reduction=reduction, **kw)
        torch.testing.assert_close(alias, got, rtol=0, atol=0)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_an_empty_batch_reduces_to_zero(reduction):
    """B = 0: every reduction but "none" gives 0 (the means were 0/0 = NaN; transformers
    fails on an empty batch), with a zero gradient."""
    x = torch.randn(0, 4, 3, 7, requires_grad=True)
    y, lengths = torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    for got in (ct.rnnt_loss(x[..., :6], y, lengths, lengths, 5, reduction=reduction),
                ct.tdt_loss(x[..., :4], x[..., 4:], y, lengths, lengths, 3, [0, 1, 2],
                            reduction=reduction)):
        assert got.shape == ((0,) if reduction == "none" else ())
        if reduction != "none":
            assert got.item() == 0
        (g,) = torch.autograd.grad(got.sum(), x)
        assert g.shape == x.shape


def test_defaults_are_transformers():
    x, labels, T_b, U_b = _inputs(6, 3, seed=3)
    tdt = ct.tdt_loss(x[..., :6], x[..., 6:], labels, T_b, U_b, 5, [0, 1, 2])
    torch.testing.assert_close(tdt, ct.tdt_loss(x[..., :6], x[..., 6:], labels, T_b, U_b, 5,
                                                [0, 1, 2], sigma=0.0, reduction="mean"))
    rnnt = ct.rnnt_loss(x[..., :6], labels, T_b, U_b, 5)
    torch.testing.assert_close(rnnt, ct.rnnt_loss(x[..., :6], labels, T_b, U_b, 5,
                                                  reduction="mean_volume"))


def test_adjacent_slices_are_read_in_place(monkeypatch):
    """The model's two slices of its joint output reach the kernel as that tensor; other
    pairs are concatenated, with the same loss and gradients."""
    seen = []
    real = ct.functional.tdt_loss_named

    def spy(names, logits, *args, **kwargs):
        seen.append(logits)
        return real(names, logits, *args, **kwargs)

    monkeypatch.setattr(ct.functional, "tdt_loss_named", spy)
    x = torch.randn(2, 4, 3, 5 + 3, requires_grad=True)
    joint = x * 1.0                                       # a non-leaf joint output, as a model's
    targets, T_b, U_b = torch.tensor([[1, 2], [3, 0]]), torch.tensor([4, 3]), torch.tensor([2, 1])
    a = ct.tdt_loss(joint[..., :5], joint[..., 5:], targets, T_b, U_b, 4, [0, 1, 2])
    assert seen[-1].data_ptr() == joint.data_ptr() and seen[-1].shape == joint.shape
    assert torch.equal(seen[-1], joint)
    (ga,) = torch.autograd.grad(a, x, retain_graph=True)
    tok, dur = joint[..., :5].clone(), joint[..., 5:].clone()   # separate tensors
    b = ct.tdt_loss(tok, dur, targets, T_b, U_b, 4, [0, 1, 2])
    assert seen[-1].data_ptr() != joint.data_ptr() and torch.equal(seen[-1], joint)
    (gb,) = torch.autograd.grad(b, x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(ga, gb, rtol=0, atol=0)
    # the halves of a wider tensor are not adjacent views of one (B, T, U+1, V + D)
    wide = torch.randn(2, 4, 3, 9)
    ct.tdt_loss(wide[..., :5], wide[..., 5:8], targets, T_b, U_b, 4, [0, 1, 2])
    assert seen[-1].data_ptr() == wide.data_ptr() and torch.equal(seen[-1], wide[..., :8])
    assert seen[-1]._base is wide                   # part of a base: its window (as_strided)
    # the joint output of a Linear on (B, T, U+1, H), a view of its 2-D result: in place too
    lin = torch.nn.Linear(4, 8)
    out = lin(torch.randn(2, 4, 1, 4) + torch.randn(2, 1, 3, 4))
    ct.tdt_loss(out[..., :5], out[..., 5:], targets, T_b, U_b, 4, [0, 1, 2]).backward()
    assert seen[-1].data_ptr() == out.data_ptr() and lin.weight.grad is not None
    # all of a contiguous base: a plain view (as_strided's backward would copy the gradient)
    assert type(seen[-1].grad_fn).__name__ == "ViewBackward0"
    # not adjacent (a gap between the halves): concatenated
    ct.tdt_loss(wide[..., :5], wide[..., 6:9], targets, T_b, U_b, 4, [0, 1, 2])
    assert seen[-1].data_ptr() != wide.data_ptr()


def test_argument_errors():
    x, labels, T_b, U_b = _inputs(6, 3)
    with pytest.raises(ValueError, match="reduction"):
        ct.tdt_loss(x[..., :6], x[..., 6:], labels, T_b, U_b, 5, [0, 1, 2], reduction="mean_v")
    with pytest.raises(ValueError, match="reduction"):
        ct.rnnt_loss(x, labels, T_b, U_b, 5, reduction=None)
    with pytest.raises(ValueError, match="labels or targets"):
        ct.ParakeetForRNNTLoss(x, labels, T_b, U_b, 5, targets=labels)
    with pytest.raises(ValueError, match="label_lengths"):
        ct.ParakeetForRNNTLoss(x, labels, T_b, blank_token_id=5)
    bad = labels.clone()
    bad[0, 0] = 5                                      # the blank, within the label length
    with pytest.raises(ValueError, match="blank"):
        ct.rnnt_loss(x, bad, T_b, U_b, 5)


def _tdt_case(edit, model=False):
    """A call of ``tdt_loss`` on good arguments (6 tokens, the blank last, 3 durations)
    edited by ``edit(args)`` (a dict of the arguments by name); ``model``: of
    ``ParakeetForTDTLoss``, under the model's names ``labels`` and ``label_lengths``."""
    def call():
        x, labels, T_b, U_b = _inputs(6, 3)
        x = x.detach().nan_to_num()
        args = dict(token_logits=x[..., :6], duration_logits=x[..., 6:], targets=labels,
                    logit_lengths=T_b, target_lengths=U_b, blank_token_id=5,
                    durations=[0, 1, 2])
        edit(args)
        if model:
            args["labels"], args["label_lengths"] = args.pop("targets"), args.pop("target_lengths")
            return ct.ParakeetForTDTLoss(**args)
        return ct.tdt_loss(**args)
    return call


def _rnnt_case(edit, model=False):
    def call():
        x, labels, T_b, U_b = _inputs(6)
        args = dict(logits=x.detach().nan_to_num(), targets=labels, logit_lengths=T_b,
                    target_lengths=U_b, blank_token_id=5)
        edit(args)
        if model:
            args["labels"], args["label_lengths"] = args.pop("targets"), args.pop("target_lengths")
            return ct.ParakeetForRNNTLoss(**args)
        return ct.rnnt_loss(**args)
    return call


# case -> (call, the words of its ValueError). The duration logits' width was unchecked: one
# column too many read the first as a token (blank_token_id=-1 then took a duration's
# logit for the blank's: a finite, wrong loss).
ARGUMENT_ERRORS = {
    "tdt_durations_wide": (_tdt_case(lambda a: a.update(
        duration_logits=torch.cat([a["duration_logits"], a["duration_logits"][..., :1]], -1),
        blank_token_id=-1)), "duration_logits (3, 5, 4, 4) must have D = len(durations) = 3"),
    "tdt_durations_narrow": (_tdt_case(lambda a: a.update(duration_logits=a["duration_logits"][..., :2])),
                             "duration_logits (3, 5, 4, 2) must have D = len(durations) = 3"),
    "tdt_batch": (_tdt_case(lambda a: a.update(duration_logits=a["duration_logits"][:1])),
                  "token_logits (3, 5, 4, 6) and duration_logits (1, 5, 4, 3) must share (B, T, U+1)"),
    "tdt_3d": (_tdt_case(lambda a: a.update(token_logits=a["token_logits"][0])),
               "token_logits must have 4 dims (B, T, U+1, V), got shape (5, 4, 6)"),
    "tdt_list": (_tdt_case(lambda a: a.update(duration_logits=a["duration_logits"].tolist())),
                 "duration_logits must be a torch.Tensor, got list"),
    "tdt_lengths_list": (_tdt_case(lambda a: a.update(logit_lengths=[5, 3, 4])),
                         "logit_lengths must be a torch.Tensor, got list"),
    "tdt_blank_not_last": (_tdt_case(lambda a: a.update(blank_token_id=0)),
                           "blank_token_id=0 must be the last token of token_logits (3, 5, 4, 6), V - 1 = 5"),
    "tdt_blank_float": (_tdt_case(lambda a: a.update(blank_token_id=5.0)),
                        "blank_token_id must be an int, got 5.0"),
    "tdt_durations": (_tdt_case(lambda a: a.update(durations=[1, 0, 2])),
                      "durations must be strictly ascending, got [1, 0, 2]"),
    "tdt_length": (_tdt_case(lambda a: a.update(logit_lengths=torch.tensor([6, 3, 4]))),
                   "logit_lengths[0] = 6 exceeds the padded size T = 5 of the joined token_logits "
                   "and duration_logits (3, 5, 4, 9)"),
    "tdt_label": (_tdt_case(lambda a: a["targets"].__setitem__((0, 0), 6)),
                  "targets[0, 0] = 6 is outside [0, V_tok) = [0, 6)"),
    "rnnt_targets_list": (_rnnt_case(lambda a: a.update(targets=a["targets"].tolist())),
                          "targets must be a torch.Tensor, got list"),
    "rnnt_3d": (_rnnt_case(lambda a: a.update(logits=a["logits"][0])),
                "logits must have 4 dims (B, T, U+1, V), got shape (5, 4, 6)"),
    "rnnt_blank": (_rnnt_case(lambda a: a.update(blank_token_id=6)),
                   "blank_token_id=6 is outside [-V, V) = [-6, 6) for logits (3, 5, 4, 6)"),
    # The model's losses name the labels and their lengths as the model does (they said
    # targets and target_lengths).
    "tdt_model_label": (_tdt_case(lambda a: a["targets"].__setitem__((0, 0), 6), model=True),
                        "labels[0, 0] = 6 is outside [0, V_tok) = [0, 6)"),
    "tdt_model_lengths": (_tdt_case(lambda a: a.update(target_lengths=a["target_lengths"].float()),
                                    model=True), "label_lengths must be int32 or int64"),
    "rnnt_model_list": (_rnnt_case(lambda a: a.update(targets=a["targets"].tolist()), model=True),
                        "labels must be a torch.Tensor, got list"),
    "rnnt_model_length": (_rnnt_case(lambda a: a.update(target_lengths=a["target_lengths"] + 9),
                                     model=True), "label_lengths[2] = 12 exceeds the padded size U = 3"),
    # Not a joint's output: transformers' .float() made bool logits numbers, a complex
    # one lost its imaginary part (a finite loss).
    "rnnt_bool": (_rnnt_case(lambda a: a.update(logits=a["logits"] > 0)),
                  "logits must be a floating tensor (the joint's output), got torch.bool"),
    "tdt_complex": (_tdt_case(lambda a: a.update(duration_logits=a["duration_logits"].to(torch.complex64))),
                    "duration_logits must be a floating tensor (the joint's output), got torch.complex64"),
}


@pytest.mark.parametrize("case", sorted(ARGUMENT_ERRORS))
def test_argument_errors_name_transformers_arguments(case):
    call, words = ARGUMENT_ERRORS[case]
    with pytest.raises(ValueError) as err:
        call()
    assert words in str(err.value), f"{words!r} not in: {err.value}"


def test_the_argument_error_cases_are_good_unedited():
    """The calls of the table above run on the arguments they edit (so each error is the
    edit's)."""
    _tdt_case(lambda a: None)()
    _rnnt_case(lambda a: None)()


# --------------------------------------------------------------------------- install()

def _theirs(name):
    """A stand-in for one of transformers' functions: returns its name."""
    def function(*args, **kwargs):
        return name
    function.__name__ = name
    return function


@pytest.fixture
def fake_transformers(monkeypatch):
    """A stand-in for ``transformers.loss``: ``loss_utils.LOSS_MAPPING`` (with an entry
    install() must leave alone), ``loss_tdt`` and ``loss_rnnt`` with their public functions."""
    mods = {}
    for name in ("transformers", "transformers.loss", "transformers.loss.loss_utils",
                 "transformers.loss.loss_tdt", "transformers.loss.loss_rnnt"):
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
    tdt, rnnt = mods["transformers.loss.loss_tdt"], mods["transformers.loss.loss_rnnt"]
    tdt.tdt_loss, tdt.ParakeetForTDTLoss = _theirs("tdt_loss"), _theirs("ParakeetForTDTLoss")
    rnnt.rnnt_loss, rnnt.ParakeetForRNNTLoss = _theirs("rnnt_loss"), _theirs("ParakeetForRNNTLoss")
    mods["transformers.loss.loss_utils"].LOSS_MAPPING = {
        "ForCTC": _theirs("ForCTC"), "ParakeetForTDT": tdt.ParakeetForTDTLoss,
        "ParakeetForRNNT": rnnt.ParakeetForRNNTLoss}
    mods["transformers"].loss = mods["transformers.loss"]
    for leaf in ("loss_utils", "loss_tdt", "loss_rnnt"):
        setattr(mods["transformers.loss"], leaf, mods[f"transformers.loss.{leaf}"])
    yield mods
    ct.uninstall()


def test_install_replaces_the_mapping_and_the_functions_and_uninstall_restores(fake_transformers):
    mapping = fake_transformers["transformers.loss.loss_utils"].LOSS_MAPPING
    tdt = fake_transformers["transformers.loss.loss_tdt"]
    before = dict(mapping), tdt.tdt_loss
    from transformers.loss.loss_tdt import tdt_loss as bound_before   # the import-order rule
    ct.install()
    ct.install()                                                        # idempotent
    assert mapping["ParakeetForTDT"] is ct.ParakeetForTDTLoss
    assert mapping["ParakeetForRNNT"] is ct.ParakeetForRNNTLoss
    assert mapping["ForCTC"] is before[0]["ForCTC"]                    # others untouched
    assert tdt.tdt_loss is ct.tdt_loss and tdt.ParakeetForTDTLoss is ct.ParakeetForTDTLoss
    rnnt = fake_transformers["transformers.loss.loss_rnnt"]
    assert rnnt.rnnt_loss is ct.rnnt_loss and rnnt.ParakeetForRNNTLoss is ct.ParakeetForRNNTLoss
    assert bound_before is before[1]                                    # bound before: theirs
    ct.uninstall()
    ct.uninstall()                                                      # a no-op
    assert mapping == before[0] and all(mapping[k] is v for k, v in before[0].items())
    assert tdt.tdt_loss is before[1] and rnnt.rnnt_loss() == "rnnt_loss"
    with ct.installed():
        assert mapping["ParakeetForTDT"] is ct.ParakeetForTDTLoss
        with ct.installed():                                            # nested: stays
            pass
        assert mapping["ParakeetForTDT"] is ct.ParakeetForTDTLoss
    assert mapping["ParakeetForTDT"] is before[0]["ParakeetForTDT"]
    ct.install()
    with ct.installed():                                                # installed before
        pass
    assert mapping["ParakeetForTDT"] is ct.ParakeetForTDTLoss


def test_install_adds_missing_entries_and_uninstall_removes_them(fake_transformers):
    mapping = fake_transformers["transformers.loss.loss_utils"].LOSS_MAPPING
    del mapping["ParakeetForRNNT"]                   # a transformers without Parakeet RNN-T
    del fake_transformers["transformers.loss.loss_rnnt"].rnnt_loss
    ct.install()
    assert mapping["ParakeetForRNNT"] is ct.ParakeetForRNNTLoss
    assert not hasattr(fake_transformers["transformers.loss.loss_rnnt"], "rnnt_loss")
    ct.uninstall()
    assert "ParakeetForRNNT" not in mapping


def test_install_without_transformers_raises_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)       # import -> ImportError
    with pytest.raises(ImportError, match="needs transformers"):
        ct.install()


def test_import_loads_no_transformers():
    code = ("import sys, rnnt_lattice.compat.transformers; "
            "sys.exit(any(m == 'transformers' or m.startswith('transformers.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_docstring_examples():
    assert doctest.testmod(ct, optionflags=doctest.ELLIPSIS).failed == 0


# --------------------------------------------------------------------------- fuse()

@dataclasses.dataclass
class ParakeetRNNTOutput:
    """Stand-in for transformers' output class (fuse() takes it from the model's module),
    its fields in transformers 5.24's order."""

    last_hidden_state: object = None
    pooler_output: object = None
    hidden_states: object = None
    attentions: object = None
    loss: object = None
    logits: object = None
    decoder_cache: object = None

    def to_tuple(self):
        values = (getattr(self, f.name) for f in dataclasses.fields(self))
        return tuple(v for v in values if v is not None)


class _Joint(torch.nn.Module):
    """Parakeet's joint: ``head(relu(enc + dec))``, keyword arguments as transformers'."""

    def __init__(self, H, V):
        super().__init__()
        self.head = torch.nn.Linear(H, V)

    def forward(self, decoder_hidden_states, encoder_hidden_states):
        return self.head(torch.relu(encoder_hidden_states + decoder_hidden_states))


class _StandInParakeet(torch.nn.Module):
    """The interface fuse() relies on (transformers' ParakeetForTDT / ParakeetForRNNT):
    ``get_audio_features`` -> ``pooler_output (B, T, H)`` and ``attention_mask (B, T)``,
    ``decoder(ids) (B, U+1, H)``, ``joint``, ``config``; its forward builds the logits and
    calls the installed loss as the models do."""

    def __init__(self, tdt: bool, F=6, H=8, V=7, durations=(0, 1, 2)):
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=V, blank_token_id=V - 1, return_dict=True,
                                            pad_token_id=2 if tdt else V - 1)
        if tdt:
            self.config.durations = list(durations)
        self.encoder = torch.nn.Linear(F, H)
        self.encoder_projector = torch.nn.Linear(H, H)
        self.embedding = torch.nn.Embedding(V, H)
        self.joint = _Joint(H, V + (len(durations) if tdt else 0))

    def decoder(self, ids):
        return torch.tanh(self.embedding(ids))

    def get_audio_features(self, input_features, attention_mask, **kwargs):
        h = torch.tanh(self.encoder(input_features))
        return types.SimpleNamespace(last_hidden_state=h, pooler_output=self.encoder_projector(h),
                                     attention_mask=attention_mask, hidden_states=None,
                                     attentions=None)

    def forward(self, input_features=None, attention_mask=None, decoder_input_ids=None,
                decoder_cache=None, use_decoder_cache=None, encoder_outputs=None, labels=None,
                **kwargs):
        enc = self.get_audio_features(input_features, attention_mask)
        logits = self.joint(decoder_hidden_states=self.decoder(decoder_input_ids)[:, None],
                            encoder_hidden_states=enc.pooler_output[:, :, None])
        loss = None
        if labels is not None:
            c = self.config
            if hasattr(c, "durations"):
                loss = ct.ParakeetForTDTLoss(
                    token_logits=logits[..., :c.vocab_size], duration_logits=logits[..., c.vocab_size:],
                    labels=labels, logit_lengths=attention_mask.sum(-1),
                    label_lengths=(labels != c.pad_token_id).sum(-1), blank_token_id=c.blank_token_id,
                    durations=c.durations, **kwargs)
            else:
                loss = ct.ParakeetForRNNTLoss(
                    logits=logits, labels=labels, logit_lengths=attention_mask.sum(-1),
                    label_lengths=(labels != c.blank_token_id).sum(-1),
                    blank_token_id=c.blank_token_id, **kwargs)
        return ParakeetRNNTOutput(loss=loss, logits=logits, last_hidden_state=enc.last_hidden_state,
                                  pooler_output=enc.pooler_output)


def _batch(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = model.config
    x = torch.randn(3, 9, 6, generator=g)
    mask = (torch.arange(9)[None] < torch.tensor([9, 6, 7])[:, None]).long()
    labels = torch.randint(3, c.vocab_size - 1, (3, 4), generator=g)
    labels[1, 2:] = c.pad_token_id                  # TDT pads with pad_token_id, RNN-T with blank
    labels[2, 3:] = c.pad_token_id
    ids = torch.cat([torch.full((3, 1), c.blank_token_id),
                     labels.masked_fill(labels == c.pad_token_id, c.blank_token_id)], 1)
    return dict(input_features=x, attention_mask=mask, decoder_input_ids=ids, labels=labels)


@pytest.mark.parametrize("tdt,kwargs", [(True, {}), (True, dict(reduction="sum", sigma=0.05)),
                                         (False, {}), (False, dict(reduction="mean"))])
def test_fuse_gives_the_materialised_loss_and_gradients_without_logits(tdt, kwargs):
    torch.manual_seed(0)
    model = _StandInParakeet(tdt)
    batch = _batch(model)
    want = model(**batch, **kwargs)
    want_grads = torch.autograd.grad(want.loss, list(model.parameters()))
    assert ct.fuse(model, tile=5) is model and ct.is_fused(model)
    got = model(**batch, **kwargs)
    assert got.logits is None and got.loss.dtype == torch.float32 and got.loss.dim() == 0
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)
    for g, w in zip(torch.autograd.grad(got.loss, list(model.parameters())), want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.pooler_output, want.pooler_output)
    as_tuple = model(**batch, **kwargs, return_dict=False)
    # the positions of the model's own tuple, (last_hidden_state, pooler_output, loss,
    # logits) here (None fields dropped), the logits None
    assert isinstance(as_tuple, tuple) and len(as_tuple) == len(want.to_tuple()) == 4
    assert torch.equal(as_tuple[0], want.last_hidden_state)
    assert torch.equal(as_tuple[1], want.pooler_output)
    assert torch.equal(as_tuple[2], got.loss) and as_tuple[3] is None
    # without labels (inference, generate): the model's own forward, logits included
    no_labels = {k: v for k, v in batch.items() if k != "labels"}
    assert model(**no_labels).logits.shape[:3] == (3, 9, 5)
    assert ct.unfuse(model) is model and not ct.is_fused(model)
    assert model(**batch, **kwargs).logits is not None


def test_fuse_rejects_other_models():
    with pytest.raises(ValueError, match="ParakeetForTDT"):
        ct.fuse(torch.nn.Linear(2, 2))
    for fn in (ct.is_fused, ct.unfuse):        # (a TypeError from vars() before)
        with pytest.raises(ValueError, match="model must be a transformers Parakeet model"):
            fn(None)


class _ProjectingJoint(torch.nn.Module):
    """A joint of another form: a projection inside, before the activation."""

    def __init__(self, H, V):
        super().__init__()
        self.proj = torch.nn.Linear(H, H)
        self.head = torch.nn.Linear(H, V)

    def forward(self, decoder_hidden_states, encoder_hidden_states):
        return self.head(torch.tanh(self.proj(encoder_hidden_states + decoder_hidden_states)))


@pytest.mark.parametrize("joint", ["parakeet", "tanh", "projecting", "dropout"])
def test_fuse_takes_the_kernel_joiner_for_parakeets_joint_form(joint):
    """fuse() recognises Parakeet's joint form, head(act(enc + dec)) (checked on random
    inputs), and gives the fused loss an rnnt_lattice.Joiner sharing the head's parameters
    (on CUDA the kernel path); a joint of another form, or with dropout, keeps its own
    forward. The loss and gradients are the same either way (test above)."""
    torch.manual_seed(0)
    model = _StandInParakeet(True)
    if joint == "tanh":
        model.joint.forward = lambda decoder_hidden_states, encoder_hidden_states: model.joint.head(
            torch.tanh(encoder_hidden_states + decoder_hidden_states))
    elif joint == "projecting":
        model.joint = _ProjectingJoint(8, model.joint.head.out_features)
    elif joint == "dropout":
        head = model.joint.head
        model.joint.forward = lambda decoder_hidden_states, encoder_hidden_states: head(
            torch.nn.functional.dropout(torch.relu(encoder_hidden_states + decoder_hidden_states),
                                        0.5))
    ct.fuse(model)
    joiner = ct._joiner(model)
    if joint in ("parakeet", "tanh"):
        assert isinstance(joiner, rnnt_lattice.Joiner)
        assert joiner.out is model.joint.head
        assert joiner.activation == ("relu" if joint == "parakeet" else "tanh")
        batch = _batch(model)
        want = ct.unfuse(model)(**batch).loss
        got = ct.fuse(model)(**batch).loss
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert not isinstance(joiner, rnnt_lattice.Joiner)
