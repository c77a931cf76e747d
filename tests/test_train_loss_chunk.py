"""The chunked vocabulary part of the training loss (``dflash_loss(loss_chunk=...)``, ``fit --loss-chunk``):
equal to the loss as it was before chunking (loss, every metric, the drafter's gradients) for DFlash2 with
and without distillation, target labels, strided selector rows, a padded vocabulary and chunks that do not
divide the rows; training with chunks (eager and compiled) equals training without; the chunked loss's
peak memory is a fraction of the single-shot one's."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_train import _cfg, _patterned_data, tiny  # noqa: F401  (tiny: the module's target fixture)

from mlx_dflash2.drafter import init_drafter
from mlx_dflash2.target import TargetAdapter
from mlx_dflash2.train import TrainConfig, Trainer
from mlx_dflash2.train.trainer import (LOSS_CHUNK_AUTO_BYTES, LOSS_CHUNK_BYTES, _mask_vocab, dflash_loss,
                                       loss_chunk_rows)

ROWS, PADDED, VALID = 512, 500, 490  # LM-head rows; the target's vocabulary (past it: -inf); the tokenizer's


class Tok:
    """A tokenizer of ``n`` tokens (what drafter init and validation read)."""

    eos_token_ids = {1}
    eos_token_id = 1
    bos_token_id = pad_token_id = unk_token_id = None
    chat_template = ""
    added_tokens_decoder: dict = {}

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def get_vocab(self):
        return {f"t{i}": i for i in range(self.n)}


def _target(rows: int, hidden: int = 32, vocab_size: int | None = None) -> TargetAdapter:
    from mlx_lm.models import llama

    mx.random.seed(0)
    cfg = dict(model_type="llama", hidden_size=hidden, num_hidden_layers=2, intermediate_size=2 * hidden,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=rows, rope_theta=10000.0,
               tie_word_embeddings=True, max_position_embeddings=512)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    return TargetAdapter(model, cfg, vocab_size=vocab_size, probe=False)


def _drafter(target, vocab: int, architecture: str, block_size: int, top_k: int = 8):
    """A fresh drafter whose no-op parts (conv, selector codebook) are random, so every gradient is real."""
    d = init_drafter(target, Tok(vocab), architecture=architecture, num_layers=1, block_size=block_size,
                     selector_rank=4, selector_top_k=top_k, mask_token_id=vocab - 1)
    mx.random.seed(1)
    noisy = [(k, mx.random.normal(v.shape) * 0.3) for k, v in tree_flatten(d.parameters())
             if k.endswith(("successor_codebook", "kernel_projection.weight"))]
    d.load_weights(noisy, strict=False)
    mx.eval(d.parameters())
    return d


def _batch(target, d, N: int, A: int, T: int, vocab: int, seed: int = 0) -> dict:
    """Random tokens / anchors / labels (some invalid), the taps and the teacher's states."""
    rng = np.random.RandomState(seed)
    B = d.config.block_size
    tokens = mx.array(rng.randint(0, vocab, size=(N, T)).astype(np.int32))
    anchors = mx.array(np.sort(rng.choice(np.arange(1, T - B), size=(N, A), replace=False), axis=1).astype(np.int32))
    feats, final = target.taps(tokens, tuple(d.config.target_layer_ids), final=True)
    pos = mx.minimum(anchors[..., None] + mx.arange(B - 1)[None, None, :], T - 1).reshape(N, -1)
    states = mx.take_along_axis(final, pos[..., None], axis=1).reshape(N * A, B - 1, -1)
    # half the labels are the drafter's own greedy choice, so that the hit counts are not all zero
    anchor_tok = mx.take_along_axis(tokens, anchors, axis=1)
    block = mx.concatenate([anchor_tok[..., None], mx.full((N, A, B - 1), d.config.mask_token_id, mx.int32)], -1)
    h = d.forward_blocks(target.embed(block.reshape(N * A, B)), feats, anchors)[:, 1:]
    greedy = np.array(mx.argmax(_mask_vocab(d.unary_logits(h, target.lm_head), vocab), axis=-1)).reshape(N, A, B - 1)
    labels = np.where(rng.rand(N, A, B - 1) < 0.5, greedy, rng.randint(0, vocab, size=(N, A, B - 1)))
    b = dict(tokens=tokens, anchors=anchors, features=feats, states=states, labels=mx.array(labels.astype(np.int32)),
             valid=mx.array(rng.rand(N, A, B - 1) > 0.2),
             weights=mx.array([np.exp(-(k - 1) / 4) for k in range(1, B)], dtype=mx.float32))
    mx.eval(list(b.values()))
    return b


def _loss_and_grads(fn, d, target, b, labels, **kw):
    def f(model):
        return fn(model, target, b["features"], b["tokens"], b["anchors"], labels, b["valid"], b["weights"], 0.7,
                  valid_vocab=VALID, **kw)

    (loss, metrics), grads = nn.value_and_grad(d, f)(d)
    mx.eval(loss, metrics, grads)
    return loss, metrics, dict(tree_flatten(grads))


@pytest.fixture(scope="module")
def padded():
    """A target whose LM head has 512 rows, a vocabulary of 500 (the rest -inf) and a tokenizer of 490."""
    return _target(ROWS, vocab_size=PADDED)


CASES = {
    "plain": dict(kd_weight=0.0, target_labels=False, selector_fraction=1.0),
    "kd": dict(kd_weight=0.5, target_labels=False, selector_fraction=1.0),
    "target-labels-half": dict(kd_weight=0.0, target_labels=True, selector_fraction=0.5),
    "kd-target-labels-half": dict(kd_weight=1.0, target_labels=True, selector_fraction=0.5),
    "kd-third": dict(kd_weight=1.0, target_labels=False, selector_fraction=0.34),
    "v1-kd-target-labels": dict(kd_weight=0.5, target_labels=True, selector_fraction=1.0, v1=True),
}


@pytest.mark.parametrize("chunk", [None, 0, 16, 7], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("case", list(CASES))
def test_chunked_loss_equals_the_loss_before_chunking(padded, case, chunk):
    """3 sequences x 7 anchors x 5 positions = 105 rows: one shot (auto and 0), chunks of 16 (the last one
    9 rows; selector blocks of 5 rows cut across chunks) and of 7; against the pre-chunking loss fed the
    teacher's full logits (and their argmax as labels)."""
    c = dict(CASES[case])
    v1 = c.pop("v1", False)
    d = _drafter(padded, VALID, "DFlashDraftModel" if v1 else "DFlash2DraftModel", block_size=6)
    b = _batch(padded, d, N=3, A=7, T=48, vocab=VALID)
    teacher = _mask_vocab(padded.logits(b["states"]), VALID)
    ref_labels = mx.argmax(teacher, axis=-1).astype(mx.int32) if c["target_labels"] else b["labels"]
    ref = _loss_and_grads(_reference_loss, d, padded, b, ref_labels, teacher_logits=teacher if c["kd_weight"] else None,
                          kd_weight=c["kd_weight"], selector_fraction=c["selector_fraction"])
    got = _loss_and_grads(dflash_loss, d, padded, b, b["labels"], teacher_states=b["states"], loss_chunk=chunk, **c)
    assert np.isfinite(ref[0].item())
    np.testing.assert_allclose(got[0].item(), ref[0].item(), rtol=1e-6, atol=1e-5)
    assert sorted(got[1]) == sorted(ref[1])
    assert ("selector" in ref[1]) == (not v1) and ("kd" in ref[1]) == (c["kd_weight"] > 0)
    if not c["target_labels"]:  # half the data labels are the drafter's own choice: hits and misses
        assert 0 < ref[1]["acc_hits"].sum().item() < ref[1]["acc_count"].sum().item()
    for k in ref[1]:
        np.testing.assert_allclose(np.array(got[1][k]), np.array(ref[1][k]), rtol=1e-6, atol=1e-5, err_msg=k)
    assert sorted(got[2]) == sorted(ref[2])
    for k in ref[2]:
        np.testing.assert_allclose(np.array(got[2][k]), np.array(ref[2][k]), rtol=0, atol=1e-5, err_msg=k)
    assert max(float(mx.abs(g).max()) for g in ref[2].values()) > 1e-3  # real gradients


def test_chunked_training_equals_one_shot_training(tiny, tmp_path):
    """A few steps (float32) with chunks of 7 rows (120 rows a step: the last chunk 1 row), eager and
    compiled, give the parameters and logs of one-shot training; the selector is on from step 2."""
    target, tok = tiny
    _patterned_data(tmp_path / "data")
    runs = {}
    for name, over in {"one": dict(loss_chunk=0), "chunked": dict(loss_chunk=7),
                       "compiled": dict(loss_chunk=7, compile=True)}.items():
        tr = Trainer(_cfg(tmp_path, out=str(tmp_path / name), steps=5, labels="target", kd_weight=0.5,
                          selector_fraction=0.5, **over), target, tok)
        tr.fit(progress=False)
        runs[name] = ([json.loads(ln) for ln in open(tmp_path / name / "log.jsonl")],
                      dict(tree_flatten(tr.drafter.parameters())))
    one_logs, one_params = runs["one"]
    assert all("selector" in ln and "kd" in ln for ln in one_logs[2:])
    for name, tol in (("chunked", 1e-5), ("compiled", 1e-4)):
        logs, params = runs[name]
        for a, b in zip(logs, one_logs, strict=True):
            # (the compiled step computes the selector's metrics also while its weight is still 0)
            assert set(b) <= set(a) and (name == "compiled" or set(a) == set(b)), (name, sorted(a), sorted(b))
            for k in ("loss", "main", "kd", "selector", "recall", "grad_norm", "acc", "sel_acc"):
                if k in b:
                    np.testing.assert_allclose(a[k], b[k], rtol=tol, atol=tol, err_msg=f"{name} {k}")
        for k, v in one_params.items():
            np.testing.assert_allclose(np.array(params[k]), np.array(v), rtol=tol, atol=tol, err_msg=f"{name} {k}")


@pytest.mark.skipif(not hasattr(mx, "get_peak_memory"), reason="mx.get_peak_memory is not available")
def test_chunked_loss_peak_memory_is_a_fraction_of_one_shot():
    """Loss + gradients with distillation, target labels and the selector over 960 rows of a 16k vocabulary
    (one [rows, V] float32 array: 60 MiB): chunks of 64 rows peak at a fraction of the one-shot peak (here 377
    MiB one-shot, 59 chunked; 1,920 rows: 754 and 91, in twice the time)."""
    V = 16384
    target = _target(V, hidden=32)
    d = _drafter(target, V, "DFlash2DraftModel", block_size=16, top_k=16)
    b = _batch(target, d, N=4, A=16, T=256, vocab=V)
    peaks, losses = {}, {}
    for chunk in (0, 64):
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        loss, _, _ = _loss_and_grads(dflash_loss, d, target, b, b["labels"], teacher_states=b["states"], kd_weight=1.0,
                                     target_labels=True, loss_chunk=chunk)
        peaks[chunk], losses[chunk] = mx.get_peak_memory() - base, loss.item()
    rows_v = 4 * 16 * 15 * V * 4
    assert peaks[0] > 3 * rows_v, peaks  # one shot: several [rows, V] arrays at once
    assert peaks[64] < 0.3 * peaks[0], {k: v / 2**20 for k, v in peaks.items()}
    assert losses[64] == pytest.approx(losses[0], rel=1e-6)


def test_loss_chunk_rows_and_settings(tiny, tmp_path):
    """Auto chunks only when rows x V float32 logits exceed LOSS_CHUNK_BYTES; 0 is one shot; the flag
    reaches TrainConfig; negative sizes are refused."""
    from mlx_dflash2.train.cli import build_parser

    most, per = LOSS_CHUNK_BYTES // (4 * 151936), LOSS_CHUNK_AUTO_BYTES // (4 * 151936)  # 1766, 441 rows
    assert loss_chunk_rows(most, 151936) == most and loss_chunk_rows(most + 1, 151936) == per == 441
    assert loss_chunk_rows(32 * 64 * 15, 151936) == per and loss_chunk_rows(2 * 64 * 15, 49152) == 2 * 64 * 15
    assert loss_chunk_rows(100, 151936, 0) == 100 and loss_chunk_rows(100, 64, 7) == 7
    assert loss_chunk_rows(100, 64, 1000) == 100
    with pytest.raises(ValueError):
        loss_chunk_rows(100, 64, -1)
    args = build_parser().parse_args(["fit", "--data", "d", "--out", "o"])
    assert args.loss_chunk is None and TrainConfig().loss_chunk is None
    assert build_parser().parse_args(["fit", "--data", "d", "--out", "o", "--loss-chunk", "512"]).loss_chunk == 512
    target, tok = tiny
    _patterned_data(tmp_path / "data")
    with pytest.raises(ValueError, match="loss_chunk"):
        Trainer(_cfg(tmp_path, loss_chunk=-1), target, tok)


def _reference_loss(drafter, target, features, tokens, anchors, labels, label_valid, weights, alpha,
                valid_vocab: int | None = None, teacher_logits=None, kd_weight: float = 0.0,
                selector_fraction: float = 1.0):
    """:func:`dflash_loss` as it was before the vocabulary part was chunked (commit fa925e8), verbatim:
    the teacher's ``[M, B-1, V]`` logits passed in, every ``[M, B-1, V]`` array made at once."""
    cfg = drafter.config
    N, A = anchors.shape
    Bm1 = labels.shape[-1]
    M = N * A
    anchor_tok = mx.take_along_axis(tokens, anchors, axis=1)  # [N, A]
    block = mx.concatenate([anchor_tok[..., None], mx.full((N, A, Bm1), cfg.mask_token_id, dtype=tokens.dtype)], -1)
    emb = mx.stop_gradient(target.embed(block.reshape(M, Bm1 + 1)))
    if cfg.input_embedding_scale != 1.0:
        emb = emb * cfg.input_embedding_scale
    h = drafter.forward_blocks(emb, mx.stop_gradient(features), anchors)[:, 1:]  # [M, B-1, D]
    logits = drafter.unary_logits(h.astype(target.dtype), target.lm_head).astype(mx.float32)  # [M, B-1, V]
    logits = _mask_vocab(logits, valid_vocab)
    lab = labels.reshape(M, Bm1)
    valid = label_valid.reshape(M, Bm1).astype(mx.float32)
    lse = mx.logsumexp(logits, axis=-1)
    gold = mx.take_along_axis(logits, lab[..., None], axis=-1)[..., 0]
    w = weights[None, :] * valid
    main = ((lse - gold) * w).sum() / mx.maximum(w.sum(), 1.0)
    hit_top1 = (mx.argmax(logits, axis=-1) == lab).astype(mx.float32) * valid
    metrics = {"main": main, "acc_hits": hit_top1.sum(0), "acc_count": valid.sum(0)}
    loss = main
    if kd_weight > 0:
        p_t = mx.softmax(mx.stop_gradient(teacher_logits).astype(mx.float32), axis=-1)
        kd_ce = lse - (p_t * logits).sum(-1)  # -sum_v p_target(v) log q(v)
        kd = (kd_ce * w).sum() / mx.maximum(w.sum(), 1.0)
        metrics["kd"] = kd
        loss = loss + kd_weight * kd
    if cfg.is_dflash2 and (isinstance(alpha, mx.array) or alpha > 0):  # an array: a compiled step's weight
        sel = drafter.candidate_selector
        K = min(sel.top_k, logits.shape[-1])
        stride = max(1, int(round(1.0 / selector_fraction)))
        pred = mx.concatenate([anchor_tok.reshape(M, 1), lab[:, :-1]], axis=1)  # gold predecessors
        if stride > 1:
            logits, h, lab, valid, pred = (x[::stride] for x in (logits, h, lab, valid, pred))
        cand = mx.stop_gradient(mx.argpartition(-logits, K - 1, axis=-1)[..., :K])  # [M', B-1, K]
        Hs = sel.hidden_projection(h)  # [M', B-1, r]
        Ap = sel.predecessor_codebook[pred]  # [M, B-1, r]
        Bs = sel.successor_codebook[cand]  # [M, B-1, K, r]
        s = mx.take_along_axis(logits, cand, axis=-1) + (Bs @ (Ap * Hs)[..., None])[..., 0].astype(mx.float32)
        hit = (cand == lab[..., None]).astype(mx.float32)
        has = hit.sum(-1) * valid
        # the same array when no blocks are skipped: two equal reductions among the outputs of a
        # compiled value_and_grad trip MLX 0.32's common-subexpression pass (IndexError _Map_base::at)
        metrics["sel_count"] = metrics["acc_count"] if stride == 1 else valid.sum(0)
        ce = mx.logsumexp(s, axis=-1) - (s * hit).sum(-1)
        ws = weights[None, :] * has
        selector = (ce * ws).sum() / mx.maximum(ws.sum(), 1.0)
        chosen = mx.take_along_axis(cand, mx.argmax(s, axis=-1)[..., None], axis=-1)[..., 0]
        metrics.update(
            selector=selector,
            sel_hits=((chosen == lab).astype(mx.float32) * valid).sum(0),
            recall=has.sum() / mx.maximum(valid.sum(), 1.0),
        )
        loss = loss + alpha * selector
    return loss, metrics
