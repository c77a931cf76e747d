"""Training on a draft vocabulary (``dflash_loss(draft_vocab=...)``, ``fit --draft-vocab``): the loss over a
set S of ids equals the whole-vocabulary loss with every logit outside S masked (loss, metrics, gradients;
chunked or not); a label outside S gets no cross-entropy and counts as a miss; S = every id is the loss
without a draft vocabulary; a run writes S into its checkpoints' and final drafter's ``draft_vocab.json``."""

from __future__ import annotations

import json
import types

import mlx.core as mx
import numpy as np
import pytest
from test_train import _cfg, _patterned_data, tiny  # noqa: F401  (tiny: the module's target fixture)
from test_train_loss_chunk import VALID, _batch, _drafter, _loss_and_grads, _reference_loss, padded  # noqa: F401

from mlx_dflash2.drafter.io import read_draft_vocab
from mlx_dflash2.train import Trainer
from mlx_dflash2.train.trainer import DraftVocab, _mask_vocab, dflash_loss

S = sorted({*range(0, VALID, 3), *range(1, 40)})  # 187 of the 490 ids


def _outside_masked(target, ids):
    """``target`` whose LM head gives -1e9 outside ``ids``: the whole-vocabulary loss of a drafter restricted
    to ``ids`` (the reference)."""
    keep = mx.zeros((target.vocab_rows,), dtype=mx.bool_)
    keep[mx.array(ids)] = True
    mx.eval(keep)
    return types.SimpleNamespace(embed=target.embed, dtype=target.dtype,
                                 lm_head=lambda h: mx.where(keep, target.lm_head(h), mx.array(-1e9, mx.float32)),
                                 keep=keep)


def _close(got, ref, keys=None):
    np.testing.assert_allclose(got[0].item(), ref[0].item(), rtol=1e-6, atol=1e-5)
    for k in keys or ref[1]:
        np.testing.assert_allclose(np.array(got[1][k]), np.array(ref[1][k]), rtol=1e-6, atol=1e-5, err_msg=k)
    assert sorted(got[2]) == sorted(ref[2])
    for k in ref[2]:
        np.testing.assert_allclose(np.array(got[2][k]), np.array(ref[2][k]), rtol=0, atol=1e-5, err_msg=k)
    assert max(float(mx.abs(g).max()) for g in ref[2].values()) > 1e-3  # real gradients


@pytest.mark.parametrize("chunk", [0, 7], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("kd", [0.0, 1.0], ids=lambda k: f"kd{k:g}")
def test_loss_on_a_draft_vocabulary_is_the_masked_whole_vocabulary_loss(padded, kd, chunk):
    """Labels all inside S: the loss on S's rows of the head equals the whole-vocabulary loss with the drafter's
    and the teacher's logits outside S at -1e9 (its softmax renormalized over S), selector included."""
    d = _drafter(padded, VALID, "DFlash2DraftModel", block_size=6)
    b = _batch(padded, d, N=3, A=7, T=48, vocab=VALID)
    ref_t = _outside_masked(padded, S)
    inside = mx.where(ref_t.keep[b["labels"]], b["labels"], mx.array(S)[b["labels"] % len(S)])  # labels in S
    teacher = _mask_vocab(ref_t.lm_head(b["states"]), VALID)
    ref = _loss_and_grads(_reference_loss, d, ref_t, b, inside, teacher_logits=teacher if kd else None, kd_weight=kd,
                          selector_fraction=0.5)
    dv = DraftVocab.build(padded, S, VALID)
    got = _loss_and_grads(dflash_loss, d, padded, b, inside, teacher_states=b["states"], kd_weight=kd,
                          selector_fraction=0.5, loss_chunk=chunk, draft_vocab=dv)
    assert sorted(got[1]) == sorted(ref[1]) and ("kd" in got[1]) == (kd > 0)
    assert 0 < got[1]["acc_hits"].sum().item() < got[1]["acc_count"].sum().item()
    _close(got, ref)


@pytest.mark.parametrize("target_labels", [False, True], ids=["data-labels", "target-labels"])
def test_labels_outside_the_draft_vocabulary_get_no_cross_entropy_and_count_as_misses(padded, target_labels):
    """Data labels, or the teacher's argmax over the whole vocabulary, partly outside S: the cross-entropy,
    the hits and the selector are those of the rows whose label lies in S, while every valid row is counted
    (a label outside S is a miss, as it is when drafting)."""
    d = _drafter(padded, VALID, "DFlash2DraftModel", block_size=6)
    b = _batch(padded, d, N=3, A=7, T=48, vocab=VALID)
    full = _mask_vocab(padded.logits(b["states"]), VALID)
    labels = mx.argmax(full, axis=-1).astype(mx.int32).reshape(b["labels"].shape) if target_labels else b["labels"]
    in_s = _outside_masked(padded, S).keep[labels]
    assert 0 < in_s.astype(mx.int32).sum().item() < in_s.size  # some labels inside S, some outside
    ref_t = _outside_masked(padded, S)
    ref = _loss_and_grads(_reference_loss, d, ref_t, dict(b, valid=b["valid"] & in_s), labels, selector_fraction=1.0)
    got = _loss_and_grads(dflash_loss, d, padded, b, b["labels"], teacher_states=b["states"], selector_fraction=1.0,
                          target_labels=target_labels, loss_chunk=7, draft_vocab=DraftVocab.build(padded, S, VALID))
    _close(got, ref, keys=["main", "selector", "acc_hits", "sel_hits"])
    valid = b["valid"].astype(mx.float32).reshape(-1, 5)
    np.testing.assert_array_equal(np.array(got[1]["acc_count"]), np.array(valid.sum(0)))
    if not target_labels:  # (a random drafter never ranks the target's choice high: no recall at all there)
        assert 0 < got[1]["recall"].item() < ref[1]["recall"].item()  # a label outside S is never recalled


def test_every_id_is_the_loss_without_a_draft_vocabulary(padded):
    d = _drafter(padded, VALID, "DFlash2DraftModel", block_size=6)
    b = _batch(padded, d, N=3, A=7, T=48, vocab=VALID)
    kw = dict(teacher_states=b["states"], kd_weight=0.5, target_labels=True, selector_fraction=0.5, loss_chunk=16)
    ref = _loss_and_grads(dflash_loss, d, padded, b, b["labels"], **kw)
    dv = DraftVocab.build(padded, range(padded.vocab_rows), VALID)  # ids past the tokenizer's are dropped
    assert dv.size == VALID
    _close(_loss_and_grads(dflash_loss, d, padded, b, b["labels"], draft_vocab=dv, **kw), ref)


def test_fit_with_a_draft_vocabulary_saves_it_with_the_drafter(tiny, tmp_path):
    """``draft_vocab="20"``: the data's 20 most frequent response ids + the ending id; checkpoints and the
    final drafter carry them; resuming with another set is refused; a path takes a drafter's set; bad
    values are errors before training."""
    from mlx_dflash2.train.vocab import draft_vocab

    target, tok = tiny
    _patterned_data(tmp_path / "data")
    tr = Trainer(_cfg(tmp_path, steps=4, save_every=2, labels="target", kd_weight=0.5, draft_vocab="20"), target, tok)
    rows = [json.loads(ln) for ln in open(tmp_path / "data/shard-00000.jsonl")]
    want = draft_vocab(rows, 20)[0]
    assert tr.draft_vocab.ids.tolist() == want and 1 in want  # the end-of-sequence id that stopped every response
    tr.fit(progress=False)
    logs = [json.loads(ln) for ln in open(tmp_path / "run/log.jsonl")]
    assert len(logs) == 4 and all(np.isfinite(ln["loss"]) for ln in logs)
    assert read_draft_vocab(tmp_path / "run/drafter") == want
    assert all(read_draft_vocab(c / "drafter") == want for c in (tmp_path / "run/ckpt").glob("step-*"))
    info = json.loads((tmp_path / "run/drafter/draft_vocab.json").read_text())
    assert "FR-Spec" in info["method"] and info["kept_by_frequency"] == 20
    with pytest.raises(ValueError, match="trained on a draft vocabulary of 20 ids, this run would train on a draft "
                                         "vocabulary of 30 ids"):
        Trainer(_cfg(tmp_path, steps=4, save_every=2, labels="target", kd_weight=0.5, draft_vocab="30"), target,
                tok).fit(progress=False)
    # the same ids named differently (a size the data cannot fill, the run's own drafter): resumed
    same = Trainer(_cfg(tmp_path, steps=4, save_every=2, labels="target", kd_weight=0.5,
                        draft_vocab=str(tmp_path / "run/drafter/draft_vocab.json")), target, tok)
    assert same.resume() and same.step == 4
    assert same.cfg.draft_vocab == "20"  # config.json keeps the run's own words for the set
    other = Trainer(_cfg(tmp_path, out=str(tmp_path / "run2"), steps=1, draft_vocab=str(tmp_path / "run/drafter")),
                    target, tok)
    assert other.draft_vocab.ids.tolist() == want
    (tmp_path / "mine.json").write_text((tmp_path / "run/drafter/draft_vocab.json").read_text())  # any file name
    named = Trainer(_cfg(tmp_path, out=str(tmp_path / "run2"), steps=1, draft_vocab=str(tmp_path / "mine.json")),
                    target, tok)
    assert named.draft_vocab.ids.tolist() == want
    (tmp_path / "odd/draft_vocab.json").mkdir(parents=True)  # a directory of that name
    for bad, match in (("nowhere", "no such file or directory"), ("1", "--draft-vocab 1: a size must be an integer"),
                       ("0", "--draft-vocab 0: a size"), ("-5", "--draft-vocab -5: a size"), ("²", "no such file"),
                       (str(tmp_path / "data"), "a directory without a draft_vocab.json"),
                       (str(tmp_path / "odd"), "cannot read the draft vocabulary")):
        with pytest.raises((ValueError, FileNotFoundError), match=match):
            Trainer(_cfg(tmp_path, out=str(tmp_path / "run3"), draft_vocab=bad), target, tok)


def test_fine_tuning_keeps_the_init_drafters_draft_vocabulary(tiny, tmp_path):
    """``--init`` a drafter with a ``draft_vocab.json`` and no ``--draft-vocab``: trained on, and saved with,
    the init's set; ``"full"`` trains on every id and saves none; a checkpoint whose set differs from what
    the run would train on (the file behind a path changed) is not resumed."""
    from mlx_dflash2.drafter.io import write_draft_vocab

    target, tok = tiny
    _patterned_data(tmp_path / "data")
    Trainer(_cfg(tmp_path, out=str(tmp_path / "base"), steps=2), target, tok).fit(progress=False)
    init = tmp_path / "base/drafter"
    assert read_draft_vocab(init) is None
    write_draft_vocab(init, range(2, 40), method="test")
    tr = Trainer(_cfg(tmp_path, out=str(tmp_path / "ft"), steps=2, init=str(init)), target, tok)
    assert tr.draft_vocab.ids.tolist() == list(range(2, 40))
    tr.fit(progress=False)
    assert read_draft_vocab(tmp_path / "ft/drafter") == list(range(2, 40))
    assert json.loads((tmp_path / "ft/drafter/draft_vocab.json").read_text())["method"] == "test"
    full = Trainer(_cfg(tmp_path, out=str(tmp_path / "full"), steps=2, init=str(init), draft_vocab="full"), target, tok)
    assert full.draft_vocab is None
    full.fit(progress=False)
    assert read_draft_vocab(tmp_path / "full/drafter") is None
    write_draft_vocab(init, range(2, 30), method="changed")  # the same --init path now holds another set
    with pytest.raises(ValueError, match="trained on a draft vocabulary of 38 ids, this run would train on a draft "
                                         "vocabulary of 28 ids"):
        Trainer(_cfg(tmp_path, out=str(tmp_path / "ft"), steps=2, init=str(init)), target, tok).fit(progress=False)
    write_draft_vocab(init, range(3, 41), method="changed")  # as many ids, other ones
    with pytest.raises(ValueError, match="of 38 ids, this run would train on a draft vocabulary of 38 other ids"):
        Trainer(_cfg(tmp_path, out=str(tmp_path / "ft"), steps=2, init=str(init)), target, tok).fit(progress=False)
