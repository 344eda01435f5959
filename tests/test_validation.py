"""Every bad input raises a ValueError that names the argument (and the shapes or values)."""
from __future__ import annotations

import pytest
import torch

import rnnt_lattice
from support import backends

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
    # (A NumPy array has a device, the string "cpu": it reached the backend's choice.)
    ("numpy_logits", lambda a: a.update(logits=a["logits"].numpy()), ["logits", "torch.Tensor", "ndarray"]),
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
    # bool() read the string "False" as True, None and 0 as False: a silent other loss
    ("fused_str", {"fused_log_softmax": "False"}, ["fused_log_softmax must be a bool, got 'False'"]),
    ("fused_none", {"fused_log_softmax": None}, ["fused_log_softmax must be a bool, got None"]),
    ("zero_infinity_int", {"zero_infinity": 1}, ["zero_infinity must be a bool, got 1"]),
    ("inplace_grad_str", {"inplace_grad": "yes"}, ["inplace_grad must be a bool, got 'yes'"]),
    ("allow_blank_targets_str", {"allow_blank_targets": "no"},
     ["allow_blank_targets must be a bool, got 'no'"]),
    ("clamp_str_number", {"clamp": "0.5"}, ["clamp must be a number, got '0.5'"]),
    # (a RuntimeError from contiguous() before)
    ("sparse_logits", lambda a: a.update(logits=a["logits"].to_sparse()),
     ["logits must be a dense (strided) tensor, got layout torch.sparse_coo"]),
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


# pack_logits: an edit of (logits, logit_lengths, target_lengths), words the message holds
PACK_BAD = [
    ("numpy_lengths", lambda x, t, u: (x, t.numpy(), u), ["pack_logits", "logit_lengths", "torch.Tensor"]),
    ("logits_3d", lambda x, t, u: (x[0], t, u), ["pack_logits", "logits", "(4, 4, 5)"]),
    ("lengths_2d", lambda x, t, u: (x, t, u[None]), ["(B,) = (2,)", "(1, 2)"]),
    ("float_lengths", lambda x, t, u: (x, t.float(), u), ["logit_lengths", "int32 or int64", "float32"]),
    ("logit_length_too_long", lambda x, t, u: (x, torch.tensor([5, 3]), u), ["logit_lengths[0] = 5", "T = 4"]),
    ("target_length_too_long", lambda x, t, u: (x, t, torch.tensor([3, 4])), ["target_lengths[1] = 4", "U = 3"]),
    ("negative_length", lambda x, t, u: (x, t, torch.tensor([-1, 2])), ["target_lengths", ">= 0", "-1"]),
    ("meta", lambda x, t, u: (x.to("meta"), t.to("meta"), u.to("meta")), ["pack_logits", "meta"]),
]


@pytest.mark.parametrize("edit, words", [b[1:] for b in PACK_BAD], ids=[b[0] for b in PACK_BAD])
def test_pack_logits_bad_input(edit, words):
    """pack_logits checks its lengths as the losses do: a length past the padding packed
    fewer rows than it claimed and a negative one none, silently; float lengths were taken."""
    a = good()
    with pytest.raises(ValueError) as err:
        rnnt_lattice.pack_logits(*edit(a["logits"], a["logit_lengths"], a["target_lengths"]))
    for w in words:
        assert w in str(err.value), f"{w!r} not in: {err.value}"


def _entries():
    """The other entry points' argument rules, each broken once: ``{id: (call, words its
    ValueError holds)}`` (the rnnt_loss table above holds the shared ones)."""
    import dataclasses
    R = rnnt_lattice
    a = good()
    x, y, tl, ul = a["logits"], a["targets"], a["logit_lengths"], a["target_lengths"]
    am, lm = torch.randn(B, T, V), torch.randn(B, U + 1, V)
    rng = torch.arange(2).expand(B, T, 2).contiguous()
    w = torch.randn(B, T, U + 1)
    rows = R.pack_logits(x, tl, ul)
    join = lambda e, p: e + p  # noqa: E731

    def occ(as_int=False):     # (built when the case runs, not at collection)
        o = R.rnnt_loss_simple(lm, am, y, tl, ul, blank=0, return_occupations=True)[1]
        return dataclasses.replace(o, gamma_blank=o.gamma_blank.long(),
                                   gamma_label=o.gamma_label.long()) if as_int else o
    return {
        "boundary_type": (lambda: R.rnnt_loss(x, y, tl, ul, blank=0, boundary=[[0, 0, 3, 4]] * 2),
                          "boundary must be a torch.Tensor or None, got list"),
        "boundary_dtype": (lambda: R.rnnt_loss(x, y, tl, ul, blank=0, boundary=torch.zeros(B, 4)),
                           "boundary must be int32 or int64, got torch.float32"),
        "packed_4d": (lambda: R.rnnt_loss(x, y, tl, ul, blank=0, packed=True),
                      "packed=True: logits must be rows (sum_b T_b (U_b+1), V), got shape (2, 4, 4, 5)"),
        "packed_lengths_2d": (lambda: R.rnnt_loss(rows, y, tl[None], ul, blank=0, packed=True),
                              "need logit_lengths (B,), target_lengths (B,) and targets (B, U), got (1, 2)"),
        "packed_lengths_float": (lambda: R.rnnt_loss(rows, y, tl.float(), ul, blank=0, packed=True),
                                 "must be int32 or int64, got torch.float32 and torch.int64"),
        "packed_negative": (lambda: R.rnnt_loss(rows, y, torch.tensor([4, -3]), ul, blank=0, packed=True),
                            "lengths must be >= 0 and target_lengths <= U = 3, got logit_lengths [4, -3]"),
        # (a RuntimeError of torch's when only the lengths were on the meta device)
        "packed_meta_lengths": (lambda: R.rnnt_loss(rows, y, tl.to("meta"), ul, blank=0, packed=True),
                                "logit_lengths is on the meta device, which holds none"),
        "packed_rows": (lambda: R.rnnt_loss(rows[:-1], y, tl, ul, blank=0, packed=True),
                        f"logits ({rows.shape[0] - 1}, 5) must have sum_b T_b (U_b+1) = {rows.shape[0]} rows"),
        "pruned_ranges_type": (lambda: R.rnnt_loss_pruned(x[:, :, :2], y, rng.tolist(), tl, ul, blank=0),
                               "ranges must be a torch.Tensor, got list"),
        "pruned_3d": (lambda: R.rnnt_loss_pruned(x[0], y, rng, tl, ul, blank=0),
                      "logits must be the window logits (B, T, R, V), got shape (4, 4, 5)"),
        "pruned_targets_1d": (lambda: R.rnnt_loss_pruned(x[:, :, :2], y[0], rng, tl, ul, blank=0),
                              "targets must have 2 dims (B, U), got shape (3,)"),
        "multiblank_blank": (lambda: R.multiblank_rnnt_loss(x, y, tl, ul, blank=9, big_blank_durations=[2]),
                             "blank=9 is outside [-V, V) = [-5, 5) for logits (2, 4, 4, 5)"),
        "multiblank_too_many": (lambda: R.multiblank_rnnt_loss(x[..., :4], y * 0 + 1, tl, ul, blank=3,
                                                               big_blank_durations=[2, 3, 4]),
                                "have no room for the 3 big blank(s) of big_blank_durations"),
        "multiblank_room": (lambda: R.multiblank_rnnt_loss(x[..., :2], y * 0, tl, ul, blank=1,
                                                           big_blank_durations=[2, 3]),
                            "blank=1 leaves no room below it for the 2 big blank(s) of big_blank_durations"),
        "simple_lm_type": (lambda: R.rnnt_loss_simple(lm.tolist(), am, y, tl, ul, blank=0),
                           "lm must be a torch.Tensor, got list"),
        "simple_lm_2d": (lambda: R.rnnt_loss_simple(lm[0], am, y, tl, ul, blank=0),
                         "lm must have 3 dims (B, U+1, V), got shape (4, 5)"),
        "simple_int": (lambda: R.rnnt_loss_simple(lm.long(), am, y, tl, ul, blank=0),
                       "lm must be float16, bfloat16, float32 or float64, got torch.int64"),
        "simple_dtypes": (lambda: R.rnnt_loss_simple(lm.double(), am, y, tl, ul, blank=0),
                          "lm and am must have one dtype, got torch.float64 and torch.float32"),
        "simple_no_positions": (lambda: R.rnnt_loss_simple(lm[:, :0], am, y[:, :0], tl, ul * 0, blank=0),
                                "lm (2, 0, 5) must have U+1 >= 1 label positions"),
        "simple_no_vocab": (lambda: R.rnnt_loss_simple(lm[..., :0], am[..., :0], y, tl, ul, blank=0),
                            "am (2, 4, 0) must have a vocabulary V >= 1"),
        "simple_lengths_2d": (lambda: R.rnnt_loss_simple(lm, am, y, tl[None], ul, blank=0),
                              "logit_lengths must have shape (B,) = (2,), got (1, 2)"),
        "simple_lengths_float": (lambda: R.rnnt_loss_simple(lm, am, y, tl.float(), ul, blank=0),
                                 "logit_lengths must be int32 or int64, got torch.float32"),
        "simple_blank": (lambda: R.rnnt_loss_simple(lm, am, y, tl, ul, blank=7),
                         "blank=7 is outside [-V, V) = [-5, 5) for am (2, 4, 5)"),
        "lattice_type": (lambda: R.lattice_loss(w.tolist(), w, tl, ul),
                         "blank_weights must be a torch.Tensor, got list"),
        "lattice_int": (lambda: R.lattice_loss(w.long(), w.long(), tl, ul),
                        "blank_weights must be float16, bfloat16, float32 or float64, got torch.int64"),
        "prune_lengths": (lambda: R.prune_ranges(occ(), 2, logit_lengths=tl[None]),
                          "logit_lengths must be an int32/int64 tensor of shape (B,) = (2,)"),
        "prune_gamma_int": (lambda: R.prune_ranges(occ(as_int=True), 2),
                            "gamma_blank and gamma_label must be floating point, got torch.int64"),
        # (torch's RuntimeError of a host read on the meta device)
        "prune_meta": (lambda: R.prune_ranges(tuple(g.to("meta") for g in (occ().gamma_blank,
                                                                           occ().gamma_label)),
                                              2, logit_lengths=tl.to("meta"),
                                              target_lengths=ul.to("meta")),
                       "prune_ranges reads the lengths' values (the window's size, the ranges' "
                       "shape): logit_lengths is on the meta device"),
        "pruning_type": (lambda: R.do_rnnt_pruning(am, lm, rng.tolist()), "ranges must be a torch.Tensor, got list"),
        "pruning_float": (lambda: R.do_rnnt_pruning(am, lm, rng.float()), "ranges must be int32 or int64, got torch.float32"),
        "pruning_shape": (lambda: R.do_rnnt_pruning(am, lm, rng[:, :2]),
                          "ranges (2, 2, 2) must be (B, T, R) with am's (B, T) and lm's B"),
        "fused_joiner": (lambda: R.fused_rnnt_loss(None, am, lm, y, tl, ul, blank=0),
                         "joiner must be callable (e.g. an nn.Module), got NoneType"),
        "fused_enc_type": (lambda: R.fused_rnnt_loss(join, am.tolist(), lm, y, tl, ul, blank=0),
                           "enc must be a torch.Tensor, got list"),
        "fused_int": (lambda: R.fused_rnnt_loss(join, am.long(), lm, y, tl, ul, blank=0),
                      "enc must be a floating tensor, got torch.int64"),
        "fused_batch": (lambda: R.fused_rnnt_loss(join, am, lm[:1], y, tl, ul, blank=0),
                        "batch sizes differ: enc (2, 4, 5) and pred (1, 4, 5)"),
        "fused_multiblank_room": (lambda: R.fused_multiblank_rnnt_loss(
            join, am, lm, y * 0 + 1, tl, ul, blank=1, big_blank_durations=[2, 3]),
            "blank=1 leaves no room below it for the 2 big blank(s) of big_blank_durations, "
            "classes blank - 1 - i, of the joiner's logits (2, 4, 4, 5)"),   # (not "logits")
        "fused_no_positions": (lambda: R.fused_rnnt_loss(join, am, lm[:, :0], y, tl, ul, blank=0),
                               "pred (2, 0, 5) must have U+1 >= 1 label positions"),
        # Flags that were read by truth value (the string "no" as True).
        "pruned_allow_blank": (lambda: R.rnnt_loss_pruned(x[:, :, :2], y, rng, tl, ul, blank=0,
                                                          allow_blank_targets="no"),
                               "allow_blank_targets must be a bool, got 'no'"),
        "fused_allow_blank": (lambda: R.fused_rnnt_loss(join, am, lm, y, tl, ul, blank=0,
                                                        allow_blank_targets="no"),
                              "allow_blank_targets must be a bool, got 'no'"),
        "simple_allow_blank": (lambda: R.rnnt_loss_simple(lm, am, y, tl, ul, blank=0,
                                                          allow_blank_targets="no"),
                               "allow_blank_targets must be a bool, got 'no'"),
        "simple_zero_infinity": (lambda: R.rnnt_loss_smoothed(lm, am, y, tl, ul, blank=0,
                                                              zero_infinity=1),
                                 "zero_infinity must be a bool, got 1"),
        "simple_return_occupations": (lambda: R.rnnt_loss_simple(lm, am, y, tl, ul, blank=0,
                                                                 return_occupations="no"),
                                      "return_occupations must be a bool, got 'no'"),
        "lattice_return_occupations": (lambda: R.lattice_loss(w, w, tl, ul,
                                                              return_occupations=None),
                                       "return_occupations must be a bool, got None"),
        "joiner_bias": (lambda: R.Joiner(3, 3, 4, V, bias="no"), "bias must be a bool, got 'no'"),
        "joiner_sharing": (lambda: R.Joiner.sharing(torch.nn.Conv1d(4, V, 1), "tanh"),
                           "out must be the joint's output layer, a torch.nn.Linear (a module "
                           "with in_features and out_features), got Conv1d"),
    }


@pytest.mark.parametrize("entry", sorted(_entries()))
def test_other_entry_points_name_their_arguments(entry):
    call, words = _entries()[entry]
    with pytest.raises(ValueError) as err:
        call()
    assert words in str(err.value), f"{words!r} not in: {err.value}"


# --------------------------------------------------------------------------- compat names
# A compat module's messages name the tensors as its peer's signature does (a NeMo user
# passed ``act_lens``, not ``logit_lengths``). Each entry: (call on (acts, labels, act_lens,
# label_lens), the ids' dtype, the blank, the last axis V, its names for our logits,
# targets, logit_lengths, target_lengths).
def _compat_entries():
    import rnnt_lattice.compat.warp_rnnt as warp_rnnt
    import rnnt_lattice.compat.warp_rnnt._C as warp_rnnt_C
    from rnnt_lattice.compat import nemo, warp_transducer
    i32, i64 = torch.int32, torch.int64
    nemo_names = ("acts", "labels", "act_lens", "label_lens")
    warp_rnnt_names = ("log_probs", "labels", "frames_lengths", "labels_lengths")
    return {
        "nemo.rnnt_loss": (lambda *a: nemo.rnnt_loss(*a, blank=0), i32, 0, 6, nemo_names),
        "nemo.RNNTLossNumba": (lambda *a: nemo.RNNTLossNumba(blank=0)(*a), i64, 0, 6, nemo_names),
        "nemo.TDTLossNumba": (lambda *a: nemo.TDTLossNumba(blank=3, durations=[0, 1])(*a), i64,
                              3, 6, nemo_names),
        "nemo.MultiblankRNNTLossNumba": (
            lambda *a: nemo.MultiblankRNNTLossNumba(blank=5, big_blank_durations=[2])(*a), i64,
            5, 6, nemo_names),
        "warp_transducer.rnnt_loss": (lambda *a: warp_transducer.rnnt_loss(*a, blank=0), i32, 0,
                                      6, nemo_names),
        "warp_rnnt.rnnt_loss": (lambda x, *a: warp_rnnt.rnnt_loss(x.log_softmax(-1), *a, blank=0),
                                i32, 0, 6, warp_rnnt_names),
        "warp_rnnt._C.rnnt_loss": (lambda x, *a: warp_rnnt_C.rnnt_loss(
            x.log_softmax(-1), *(t.contiguous() if isinstance(t, torch.Tensor) else t for t in a)),
            i32, 0, 6, ("xs", "ys", "xn", "yn")),
    }


def _edit(i, f):
    """An edit of argument ``i`` of (acts, labels, act_lens, label_lens)."""
    def edit(args, blank):
        args[i] = f(args[i], blank)
    return edit


def _set(index, value):
    def f(x, blank):
        x = x.clone()
        x[index] = blank if value == "blank" else value
        return x
    return f


# case -> (edit, which of our arguments the message must name, words it must hold, where
# "{name}" is the entry's name of that argument)
COMPAT_BAD = {
    "acts_3d": (_edit(0, lambda x, b: x[0]), 0, ["{name}"]),
    "labels_1d": (_edit(1, lambda x, b: x[0]), 1, ["{name}"]),
    "labels_list": (_edit(1, lambda x, b: x.tolist()), 1, ["{name}"]),
    "labels_batch": (_edit(1, lambda x, b: x[:1]), 1, ["{name}", "(1, 3)"]),
    "labels_width": (_edit(1, lambda x, b: x[:, :2]), 1, ["{name}", "(2, 2)"]),
    "label_lens_2d": (_edit(3, lambda x, b: x[None]), 3, ["{name}", "(1, 2)"]),
    "act_lens_too_long": (_edit(2, _set(0, 5)), 2, ["{name}[0] = 5"]),
    "act_lens_negative": (_edit(2, _set(1, -1)), 2, ["{name}", "-1"]),
    "label_lens_too_long": (_edit(3, _set(1, 4)), 3, ["{name}[1] = 4"]),
    "label_too_big": (_edit(1, _set((1, 1), 9)), 1, ["{name}[1, 1] = 9"]),
    "label_negative": (_edit(1, _set((0, 2), -2)), 1, ["{name}[0, 2] = -2"]),
    "label_is_blank": (_edit(1, _set((1, 0), "blank")), 1, ["{name}[1, 0]", "blank"]),
    "act_lens_on_meta": (_edit(2, lambda x, b: x.to("meta")), 2, ["{name} on meta"]),
}
OUR_NAMES = ("logits", "targets", "logit_lengths", "target_lengths")


@pytest.mark.parametrize("case", sorted(COMPAT_BAD))
@pytest.mark.parametrize("entry", sorted(_compat_entries()))
def test_compat_messages_name_the_peers_arguments(entry, case):
    """Through a compat module, a bad argument's ValueError names it as the peer's signature
    does, and never by this library's own name for it (which the user never wrote)."""
    import re
    call, ids, blank, Vx, names = _compat_entries()[entry]
    edit, which, words = COMPAT_BAD[case]
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(B, T, U + 1, Vx, generator=g),
            torch.randint(1, 3, (B, U), generator=g).to(ids),
            torch.tensor([4, 3], dtype=ids), torch.tensor([3, 2], dtype=ids)]
    call(*args)                                     # the good call runs
    edit(args, blank)
    with pytest.raises(ValueError) as err:
        call(*args)
    msg = str(err.value)
    for w in words:
        w = w.format(name=names[which])
        assert w in msg, f"{w!r} not in: {msg}"
    for ours, theirs in zip(OUR_NAMES, names):
        if ours != theirs:
            assert not re.search(rf"\b{ours}\b", msg), f"{ours!r} (theirs: {theirs!r}) in: {msg}"


def test_compat_compact_labels_are_named_padded():
    """warp-rnnt's compact layout takes the labels concatenated, ``(sum_b U_b,)``; the
    library reads them padded to ``(N, U)``, and its message says so of the index."""
    import rnnt_lattice.compat.warp_rnnt as warp_rnnt
    x = torch.randn(B, T, U + 1, V).log_softmax(-1)
    tl, ul = torch.tensor([4, 3], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32)
    rows = rnnt_lattice.pack_logits(x, tl, ul)
    labels = torch.tensor([1, 2, 3, 4, 0], dtype=torch.int32)       # (sum_b U_b,): 3 + 2
    with pytest.raises(ValueError, match=r"^labels \(padded to \(N, U\)\)\[1, 1\] equals the blank"):
        warp_rnnt.rnnt_loss(rows, labels, tl, ul, blank=0, compact=True)


def test_padding_targets_are_not_checked():
    """Target ids past target_lengths are padding: anything goes there."""
    a = good()
    a["targets"][1, 2] = -100
    loss = rnnt_lattice.rnnt_loss(**a, blank=0)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("module, kw, words", [
    ("RNNTLoss", dict(blank=0, reduction="bogus"), ["reduction", "'bogus'"]),
    ("RNNTLoss", dict(blank=0.5), ["blank", "0.5"]),
    ("RNNTLoss", dict(blank=0, delay_penalty=-1.0), ["delay_penalty", ">= 0"]),
    ("RNNTLoss", dict(blank=0, rnnt_type="hat"), ["rnnt_type", "'hat'"]),
    ("RNNTLoss", dict(blank=0, backend="cuda"), ["backend", "'cuda'"]),
    ("TDTLoss", dict(blank=3, durations=[0, 1], sigma=float("nan")), ["sigma", "NaN"]),
    ("TDTLoss", dict(blank=3, durations=[2, 1]), ["durations", "ascending"]),
    ("TDTLoss", dict(blank=3, durations=[]), ["durations must not be empty"]),
    ("TDTLoss", dict(blank=3, durations=3), ["durations must be a sequence of ints, got 3"]),
    ("TDTLoss", dict(blank=3, durations=[0, 1.5]), ["durations must hold ints, got 1.5 in [0, 1.5]"]),
    ("TDTLoss", dict(blank=3, durations=[0, True]), ["durations must hold ints, got True"]),
    ("MultiblankRNNTLoss", dict(blank=3, big_blank_durations=torch.tensor([2, 1])), ["big_blank_durations", ">= 2", "[2, 1]"]),
    ("TDTLoss", dict(blank=3, durations=[0, 1], omega=2.0), ["omega", "[0, 1]"]),
    ("MultiblankRNNTLoss", dict(blank=3, big_blank_durations=[1]), ["big_blank_durations", ">= 2"]),
    ("MultiblankRNNTLoss", dict(blank=3, big_blank_durations=[2], sigma=-0.1), ["sigma", ">= 0"]),
    # float() would take these: a config's unparsed string, a bool
    ("RNNTLoss", dict(blank=0, clamp="0.1"), ["clamp must be a number, got '0.1'"]),
    ("RNNTLoss", dict(blank=0, fastemit_lambda=True), ["fastemit_lambda must be a number, got True"]),
    ("TDTLoss", dict(blank=3, durations=[0, 1], sigma="1e-3"), ["sigma must be a number, got '1e-3'"]),
    ("RNNTLoss", dict(blank=0, fused_log_softmax="False"), ["fused_log_softmax must be a bool, got 'False'"]),
    ("TDTLoss", dict(blank=3, durations=[0, 1], zero_infinity=0), ["zero_infinity must be a bool, got 0"]),
])
def test_modules_validate_at_construction(module, kw, words):
    """A module's options are checked when it is built, not at its first call."""
    with pytest.raises(ValueError) as err:
        getattr(rnnt_lattice, module)(**kw)
    for w in words:
        assert w in str(err.value), f"{w!r} not in: {err.value}"


# Every float option at the edges of its valid range (``_validate.FLOAT_RANGES``), and
# just beyond them. ``fn``: which loss reads it.
RANGE_EDGES = [
    ("rnnt_loss", "fastemit_lambda", -1.0, 1e3),
    ("rnnt_loss", "delay_penalty", 0.0, 1e3),
    ("tdt_loss", "sigma", 0.0, 1e3),
    ("multiblank_rnnt_loss", "sigma", 0.0, 1e3),
    ("tdt_loss", "omega", 0.0, 1.0),
]


def _edge_call(fn, backend, x, **kw):
    args = tuple(a.to(x.device) for a in (torch.tensor([[1, 2], [2, 1]]), torch.tensor([5, 4]),
                                          torch.tensor([2, 1])))
    if fn == "tdt_loss":
        return rnnt_lattice.tdt_loss(x, *args, blank=-1, durations=[0, 1, 2], backend=backend,
                                     reduction="none", **kw)
    if fn == "multiblank_rnnt_loss":
        return rnnt_lattice.multiblank_rnnt_loss(x, *args, blank=6, big_blank_durations=[2],
                                                 backend=backend, reduction="none", **kw)
    return rnnt_lattice.rnnt_loss(x, *args, blank=0, backend=backend, reduction="none", **kw)


@pytest.mark.parametrize("fn, name, lo, hi", RANGE_EDGES, ids=[f"{f}-{n}" for f, n, *_ in RANGE_EDGES])
def test_float_options_agree_at_the_range_edges(fn, name, lo, hi):
    """Inside its documented range an option gives the same losses and gradients on every
    backend (same inf/NaN pattern, values to float32 rounding); past the range it is a
    ValueError naming the option and the range (delay_penalty=1e100 gave -inf on two
    backends and NaN on the third)."""
    x0 = torch.randn(2, 5, 3, 7, generator=torch.Generator().manual_seed(0))
    extra = dict(clamp=1e-3) if name == "fastemit_lambda" else {}     # clamp at its edge too
    for value in (lo, hi):
        results = []
        for backend in backends.names():
            x = x0.clone().requires_grad_()
            loss = _edge_call(fn, backend, x, **{name: value}, **extra)
            loss.sum().backward()
            results.append((loss.detach(), x.grad))
        for got in results[1:]:
            for g, w in zip(got, results[0]):
                assert torch.equal(torch.isfinite(g), torch.isfinite(w)) and torch.isfinite(w).any()
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * max(1.0, float(w.abs().max())))
    span = hi - lo
    for value, words in ((lo - span, [name, f">= {lo:g}"]), (hi + span, [name, f"<= {hi:g}"]),
                         (float("inf"), [name, "finite"])):
        with pytest.raises(ValueError) as err:
            _edge_call(fn, "torch", x0, **{name: value})
        for w in words + [f"[{lo:g}, {hi:g}]"]:
            assert w in str(err.value), f"{w!r} not in: {err.value}"


def test_smoothed_scales_have_a_range():
    am, lm = torch.randn(1, 5, 4), torch.randn(1, 3, 4)
    args = (torch.tensor([[1, 2]]), torch.tensor([5]), torch.tensor([2]))
    for kw in (dict(lm_only_scale=-0.1), dict(am_only_scale=1.5)):
        with pytest.raises(ValueError, match=f"{next(iter(kw))} must be .* \\(valid range \\[0, 1\\]\\)"):
            rnnt_lattice.rnnt_loss_smoothed(lm, am, *args, blank=0, **kw)


def test_integer_like_blank():
    """A NumPy integer (anything operator.index takes) is an int for blank."""
    import numpy as np
    a = good()
    want = rnnt_lattice.rnnt_loss(**a, blank=0)
    for blank in (np.int64(0), np.int32(0), torch.tensor(0)):
        assert torch.equal(rnnt_lattice.rnnt_loss(**a, blank=blank), want)


def test_sparse_window_logits():
    """rnnt_loss_pruned's window logits are checked for their layout too (a reshape
    error before)."""
    x = torch.randn(2, 5, 2, 6)
    ranges = torch.arange(2).expand(2, 5, 2).contiguous()
    with pytest.raises(ValueError, match="logits must be a dense"):
        rnnt_lattice.rnnt_loss_pruned(x.to_sparse(), torch.tensor([[1], [2]]), ranges,
                                      torch.tensor([5, 4]), torch.tensor([1, 1]), blank=0)


def test_a_float_option_given_as_a_tensor_that_requires_grad():
    """A 1-element tensor is a number for a float option, read without PyTorch's warning
    of a tensor that requires grad made a scalar (an option gets no gradient)."""
    import warnings
    a = good()
    want = rnnt_lattice.rnnt_loss(**a, blank=0, clamp=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = rnnt_lattice.rnnt_loss(**a, blank=0, clamp=torch.tensor(0.5, requires_grad=True))
    assert torch.equal(got, want)


@pytest.mark.parametrize("fn", ["rnnt_loss", "tdt_loss", "multiblank_rnnt_loss", "simple",
                                "smoothed", "pruned"])
def test_meta_tensors(fn):
    """On the meta device (shapes only; backend="auto" picks the PyTorch one) the losses
    give a loss and gradients of the right shapes, the simple losses and the pruned one
    too (the simple losses' rescue read its nodes on the host: "Tensor.item() cannot be
    called on meta tensors"); packed logits need the lengths' values: a ValueError says
    so (below)."""
    m = lambda t: t.to("meta")  # noqa: E731
    if fn in ("simple", "smoothed"):
        am = torch.randn(2, 5, 7, device="meta", requires_grad=True)
        lm = torch.randn(2, 3, 7, device="meta", requires_grad=True)
        args = (m(torch.tensor([[1, 2], [2, 1]])), m(torch.tensor([5, 4])), m(torch.tensor([2, 1])))
        kw = dict(lm_only_scale=0.1, am_only_scale=0.1) if fn == "smoothed" else {}
        loss = getattr(rnnt_lattice, f"rnnt_loss_{fn}")(lm, am, *args, blank=0, reduction="none", **kw)
        inputs = (am, lm)
    elif fn == "pruned":
        x = torch.randn(2, 5, 2, 7, device="meta", requires_grad=True)
        ranges = m(torch.arange(2).expand(2, 5, 2))
        loss = rnnt_lattice.rnnt_loss_pruned(x, m(torch.tensor([[1, 2], [2, 1]])), ranges,
                                             m(torch.tensor([5, 4])), m(torch.tensor([2, 1])),
                                             blank=0, reduction="none")
        inputs = (x,)
    else:
        x = torch.randn(2, 5, 3, 7, device="meta", requires_grad=True)
        loss = _edge_call(fn, "auto", x, **(dict(sigma=0.05) if fn != "rnnt_loss" else {}))
        inputs = (x,)
    assert loss.shape == (2,) and loss.device.type == "meta"
    loss.sum().backward()
    for x in inputs:
        assert x.grad.shape == x.shape and x.grad.device.type == "meta"


def test_fused_meta_tensors_are_refused():
    m = lambda t: t.to("meta")  # noqa: E731
    with pytest.raises(ValueError, match="enc and pred are on the meta device"):
        rnnt_lattice.fused_rnnt_loss(lambda e, p: e + p, torch.randn(2, 5, 7, device="meta"),
                                     torch.randn(2, 3, 7, device="meta"),
                                     m(torch.tensor([[1, 2], [2, 1]])), m(torch.tensor([5, 4])),
                                     m(torch.tensor([2, 1])), blank=0)


def test_packed_meta_tensors_are_refused():
    m = lambda t: t.to("meta")  # noqa: E731
    with pytest.raises(ValueError, match="packed=True.*meta"):
        rnnt_lattice.rnnt_loss(torch.randn(20, 7, device="meta"), m(torch.tensor([[1, 2]])),
                               m(torch.tensor([5])), m(torch.tensor([2])), blank=0, packed=True)


@pytest.mark.parametrize("entry", ["tdt_loss", "occupancy"])
def test_tdt_logits_without_tokens_are_refused(entry):
    """A TDT lattice on logits whose last axis holds only the durations: one message
    naming the logits' shape and the durations, from the public check (``tdt_loss``) and
    from the call's own (``occupancy`` with ``topology=tdt(...)``, the fused losses)."""
    a = good()
    x = torch.randn(B, T, U + 1, 2)
    args = (a["targets"], a["logit_lengths"], a["target_lengths"])
    with pytest.raises(ValueError, match=rf"logits \({B}, {T}, {U + 1}, 2\) must hold V_tok >= 1 "
                       r"token classes before the 2 durations in the last axis"):
        if entry == "tdt_loss":
            rnnt_lattice.tdt_loss(x, *args, blank=-1, durations=[0, 1])
        else:
            rnnt_lattice.occupancy(x, *args, blank=-1,
                                   topology=rnnt_lattice.topology.tdt([0, 1]))


def _transformed_cases():
    """The entry points under a torch.func transform: (the call on one example's tensor,
    that tensor batched over a leading N = 2, its name)."""
    g = torch.Generator().manual_seed(0)
    a = good()
    x, y, tl, ul = a["logits"], a["targets"], a["logit_lengths"], a["target_lengths"]
    lm, am = torch.randn(B, U + 1, V, generator=g), torch.randn(B, T, V, generator=g)
    pred = torch.randn(B, U + 1, V, generator=g)
    R = rnnt_lattice
    return {
        "rnnt_loss": (lambda x: R.rnnt_loss(x, y, tl, ul, blank=0), x, "logits"),
        "targets": (lambda y: R.rnnt_loss(x, y, tl, ul, blank=0), y, "targets"),
        "tdt_loss": (lambda x: R.tdt_loss(x, y, tl, ul, blank=0, durations=[0, 1]),
                     torch.randn(B, T, U + 1, V + 2, generator=g), "logits"),
        "occupancy": (lambda x: R.occupancy(x, y, tl, ul, blank=0).node, x, "logits"),
        "simple": (lambda am: R.rnnt_loss_simple(lm, am, y, tl, ul, blank=0), am, "am"),
        "fused": (lambda e: R.fused_rnnt_loss(lambda e, p: e[:, :, None] + p[:, None], e, pred,
                                              y, tl, ul, blank=0),
                  torch.randn(B, T, V, generator=g), "enc"),
        "lattice_loss": (lambda w: R.lattice_loss(w, w, tl, ul), x[..., 0], "blank_weights"),
        "do_rnnt_pruning": (lambda am: R.do_rnnt_pruning(am, lm, torch.zeros(B, T, 2, dtype=torch.long)
                                                         + torch.arange(2))[0], am, "am"),
        "none": (lambda s: s * R.rnnt_loss(x, y, tl, ul, blank=0), torch.tensor(1.0), None),
    }


@pytest.mark.parametrize("transform", ["vmap", "grad"])
@pytest.mark.parametrize("entry", sorted(_transformed_cases()))
def test_torch_func_transforms_are_refused(entry, transform):
    """Inside torch.func's vmap or grad, every entry point raises a NotImplementedError
    that names the argument the transform wraps, if any, where the host reads of the
    checks said "Cannot access data pointer" and PyTorch refused the autograd Functions
    (they define no transform rules); "none": the loss's own tensors are plain."""
    fn, one, name = _transformed_cases()[entry]
    if transform == "grad":
        if not one.is_floating_point():
            pytest.skip("grad takes floating inputs")
        call = lambda: torch.func.grad(lambda a: fn(a).sum())(one)  # noqa: E731
    else:
        call = lambda: torch.func.vmap(fn)(torch.stack([one, one]))  # noqa: E731
    which = rf"{name} is a tensor of one, and the call" if name else "the call"
    with pytest.raises(NotImplementedError, match=rf"^rnnt_lattice does not run inside torch\.func "
                       rf"transforms \(vmap, grad, jacrev, \.\.\.\): {which} runs inside one\."):
        call()


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


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("fn", ["rnnt_loss", "tdt_loss", "multiblank_rnnt_loss"])
def test_a_call_is_checked_once(fn, packed, monkeypatch):
    """Validate once: a loss call on the default backend picks its backend once and enters
    ``_validate.check_call`` once, which checks the tensors once (``check_lattice_args``),
    looks for a ``torch.func`` transform once, applies the topology's rules once and reads
    a packed layout's lengths once; the run (the autograd Function, the backend's passes,
    the backward) checks nothing again (under torch.compile the custom op prepares the
    call once more when it runs, tests/test_compile.py)."""
    from rnnt_lattice import _backends, _validate
    calls = {}

    def counted(module, name):
        f = getattr(module, name)

        def wrapper(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return f(*a, **k)
        monkeypatch.setattr(module, name, wrapper)

    counted(_backends, "check_call")
    counted(_backends, "resolve")
    for name in ("check_lattice_args", "_packed_grid", "check_site",
                 "check_untransformed", "_check_topology"):
        counted(_validate, name)
    x = torch.randn(2, 5, 3, 7, requires_grad=True)
    T_b, U_b = torch.tensor([5, 4]), torch.tensor([2, 1])
    if packed:
        x = rnnt_lattice.pack_logits(x.detach(), T_b, U_b).requires_grad_()
    args = (torch.tensor([[1, 2], [2, 1]]), T_b, U_b)
    if fn == "tdt_loss":
        loss = rnnt_lattice.tdt_loss(x, *args, blank=-1, durations=[0, 1, 2], packed=packed)
    elif fn == "multiblank_rnnt_loss":
        loss = rnnt_lattice.multiblank_rnnt_loss(x, *args, blank=6, big_blank_durations=[2],
                                                 packed=packed)
    else:
        loss = rnnt_lattice.rnnt_loss(x, *args, blank=0, packed=packed)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    assert calls == {"check_call": 1, "resolve": 1, "check_lattice_args": 1, "check_site": 1,
                     "check_untransformed": 1, "_check_topology": 1,
                     **({"_packed_grid": 1} if packed else {})}
