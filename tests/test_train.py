"""Drafter training on a tiny random target (CPU, fast): data, loss, resume, fine-tuning, eval."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dflash2.drafter import DraftContext, init_drafter, load_drafter, save_drafter
from mlx_dflash2.target import TargetAdapter
from mlx_dflash2.train import TrainConfig, Trainer, read_prompt_file
from mlx_dflash2.train.data import Decontaminator, load_eval_set
from mlx_dflash2.train.evaluate import check_against_loop, draft_tokens, replay
from mlx_dflash2.train.regen import read_responses
from mlx_dflash2.train.trainer import dflash_loss, make_batch

VOCAB = 64


class TinyTok:
    """Just what training needs of a tokenizer (vocab size, EOS, specials)."""

    eos_token_ids = {1}
    eos_token_id = 1
    bos_token_id = None
    pad_token_id = None
    unk_token_id = None
    chat_template = ""

    def __len__(self):
        return VOCAB

    def get_vocab(self):
        return {f"t{i}": i for i in range(VOCAB)}

    @property
    def added_tokens_decoder(self):
        class T(str):
            special = True

        return {63: T("<mask>")}


@pytest.fixture(scope="module")
def tiny():
    from mlx_lm.models import llama

    mx.random.seed(0)
    cfg = dict(model_type="llama", hidden_size=32, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
               num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB, rope_theta=10000.0, tie_word_embeddings=True,
               max_position_embeddings=512)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    return TargetAdapter(model, cfg), TinyTok()


def _patterned_data(path, n=48, seed=0):
    """Sequences with learnable structure: prompt = random tokens, response = an arithmetic progression mod 60."""
    rng = np.random.RandomState(seed)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "shard-00000.jsonl", "w") as f:
        for i in range(n):
            p = rng.randint(2, 60, size=rng.randint(3, 8)).tolist()
            start, step = rng.randint(2, 60), rng.randint(1, 4)
            r = [2 + (start + step * k) % 58 for k in range(rng.randint(20, 40))]
            f.write(json.dumps({"id": str(i), "prompt_ids": p, "response_ids": r + [1]}) + "\n")
    return path


def _cfg(tmp_path, **over):
    c = dict(data=str(tmp_path / "data"), out=str(tmp_path / "run"), num_layers=1, block_size=6, anchors=6,
             batch_size=4, steps=6, lr=3e-3, warmup=0.1, selector_rank=4, selector_top_k=4, log_every=1, save_every=3,
             seed=1)
    c.update(over)
    return TrainConfig(**c)


def test_make_batch_anchors_and_labels(tmp_path):
    _patterned_data(tmp_path / "data")
    rows = read_responses(tmp_path / "data")[:4]
    cfg = _cfg(tmp_path)
    b = make_batch(rows, 0, cfg, pad_id=1)
    b2 = make_batch(rows, 0, cfg, pad_id=1)
    assert all(np.array_equal(b[k], b2[k]) for k in ("anchors", "labels"))  # deterministic in (seed, step)
    for n, r in enumerate(rows):
        plen, L = len(r["prompt_ids"]), len(r["prompt_ids"]) + len(r["response_ids"])
        seq = r["prompt_ids"] + r["response_ids"]
        for a, labs, ok in zip(b["anchors"][n], b["labels"][n], b["label_valid"][n]):
            assert plen <= a <= L - 2  # anchors inside the response, with a next token
            for k in range(cfg.block_size - 1):
                if ok[k]:
                    assert labs[k] == seq[a + k + 1]
                else:
                    assert a + k + 1 >= L or not ok.any()


def test_pad_multiple_pads_batches_to_fewer_lengths(tiny, tmp_path):
    """``pad_multiple`` (``fit --pad-multiple``) rounds a batch's length up to its multiples (64 by default), with
    the same sequences, anchors and labels; a step's losses on the longer padding equal the default's (the padding
    is past every sequence's end, where no context or label reaches); a run may resume with another multiple."""
    target, tok = tiny
    _patterned_data(tmp_path / "data")
    rows = read_responses(tmp_path / "data")[:4]
    b64 = make_batch(rows, 0, _cfg(tmp_path), pad_id=1)
    b160 = make_batch(rows, 0, _cfg(tmp_path, pad_multiple=160), pad_id=1)
    longest = max(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
    assert longest <= 64 and b64["tokens"].shape[1] == 64 and b160["tokens"].shape[1] == 160
    assert np.array_equal(b160["tokens"][:, :64], b64["tokens"]) and (b160["tokens"][:, 64:] == 1).all()
    assert all(np.array_equal(b64[k], b160[k]) for k in ("anchors", "labels", "label_valid"))
    assert b64["n_tokens"] == b160["n_tokens"]
    m = []
    for pm in (64, 160):
        tr = Trainer(_cfg(tmp_path, out=str(tmp_path / f"pm{pm}"), pad_multiple=pm), target, tok)
        m.append(tr.train_step(make_batch(tr._batch_rows(0), 0, tr.cfg, tr.pad_id)))
    assert m[0].keys() == m[1].keys() and "loss" in m[0]
    for k in m[0]:
        np.testing.assert_allclose(np.array(m[0][k]), np.array(m[1][k]), rtol=1e-5, atol=1e-6, err_msg=k)
    with pytest.raises(ValueError, match="pad_multiple"):
        Trainer(_cfg(tmp_path, pad_multiple=0), target, tok)


def test_pad_multiple_above_max_len_pads_to_max_len(tmp_path):
    """A ``pad_multiple`` above ``max_len`` (``fit --pad-multiple 1000000000``) pads to ``max_len``, the longest a
    sequence can be: one length, no giant array (it was ``[N, pad_multiple]``: 10**9 segfaulted a fit)."""
    _patterned_data(tmp_path / "data")
    rows = read_responses(tmp_path / "data")[:4]
    ref = make_batch(rows, 0, _cfg(tmp_path, max_len=48, pad_multiple=48), pad_id=1)
    for pm in (49, 1000, 10**9):
        b = make_batch(rows, 0, _cfg(tmp_path, max_len=48, pad_multiple=pm), pad_id=1)
        assert b["tokens"].shape == (4, 48), pm
        assert all(np.array_equal(b[k], ref[k]) for k in ("tokens", "anchors", "labels", "label_valid"))


def test_loss_matches_inference_path(tiny, tmp_path):
    """The training loss uses exactly the inference drafter: its unary argmax at a
    block equals the proposal of the inference path with the same context."""
    target, tok = tiny
    d = init_drafter(target, tok, num_layers=1, block_size=6, selector_rank=4, selector_top_k=4)
    tokens = mx.array(np.random.RandomState(0).randint(2, 60, size=(1, 20)).astype(np.int32))
    feats = target.taps(tokens, tuple(d.config.target_layer_ids))
    anchors = mx.array([[9]])
    block = mx.array([[tokens[0, 9].item()] + [d.config.mask_token_id] * 5])
    h = d.forward_blocks(target.embed(block), feats, anchors)
    ctx = DraftContext(d)
    ctx.append(d, feats[0, :9])
    h2 = d(target.embed(block), ctx)
    np.testing.assert_allclose(np.array(h), np.array(h2), rtol=1e-4, atol=1e-4)
    labels = tokens[:, 10:15][:, None]
    loss, m = dflash_loss(d, target, feats, tokens, anchors, labels, mx.ones((1, 1, 5), dtype=mx.bool_),
                          mx.ones((5,)), 1.0)
    assert np.isfinite(loss.item()) and "selector" in m


def test_loss_decreases_and_resume_is_exact(tiny, tmp_path):
    target, tok = tiny
    _patterned_data(tmp_path / "data")
    # uninterrupted: 24 steps
    full = Trainer(_cfg(tmp_path, out=str(tmp_path / "full"), steps=24, lr=1e-2), target, tok)
    full.fit(progress=False)
    logs = [json.loads(l) for l in open(tmp_path / "full" / "log.jsonl")]
    first, last = np.mean([l["main"] for l in logs[:3]]), np.mean([l["main"] for l in logs[-3:]])
    assert last < first * 0.8, (first, last)
    # interrupted after 10 steps (checkpoint at 10), resumed by a fresh Trainer
    a = Trainer(_cfg(tmp_path, out=str(tmp_path / "split"), steps=24, lr=1e-2, save_every=10), target, tok)
    a.fit(progress=False, max_steps=10)
    assert a.step == 10 and not (tmp_path / "split" / "drafter").exists()
    b = Trainer(_cfg(tmp_path, out=str(tmp_path / "split"), steps=24, lr=1e-2, save_every=10), target, tok)
    b.fit(progress=False)
    assert b.step == 24
    pa = dict(tree_flatten(full.drafter.parameters()))
    pb = dict(tree_flatten(load_drafter(tmp_path / "split" / "drafter", target, tok).parameters()))
    for k in pa:
        np.testing.assert_array_equal(np.array(pa[k]), np.array(pb[k]), err_msg=k)


def test_compiled_step_equals_eager(tiny, tmp_path):
    """``compile=True`` (mx.compile over drafter + optimizer state) trains exactly as the eager step,
    DFlash2 with selector, distillation and target labels included."""
    target, tok = tiny
    _patterned_data(tmp_path / "data")
    runs = {}
    for comp in (False, True):
        tr = Trainer(_cfg(tmp_path, out=str(tmp_path / f"c{int(comp)}"), steps=8, compile=comp, labels="target",
                          kd_weight=0.5), target, tok)
        tr.fit(progress=False)
        runs[comp] = ([json.loads(line) for line in open(tmp_path / f"c{int(comp)}" / "log.jsonl")],
                      dict(tree_flatten(tr.drafter.parameters())))
    # every logged term, the selector's too (the eager step leaves it out while its weight is 0 on the ramp's first
    # steps; the compiled one computes it with weight 0 there)
    for comp_row, eager_row in zip(*(runs[c][0] for c in (True, False)), strict=True):
        for k in ("loss", "main", "kd", "selector", "recall"):
            if k in eager_row:
                np.testing.assert_allclose(comp_row[k], eager_row[k], rtol=1e-4, err_msg=k)
    assert sum("selector" in r for r in runs[False][0]) >= 4
    for k, v in runs[False][1].items():
        np.testing.assert_allclose(np.array(runs[True][1][k]), np.array(v), rtol=1e-3, atol=1e-5, err_msg=k)


def test_compiled_update_equals_the_eager_update(tiny, tmp_path, monkeypatch):
    """The eager step's update (clipping and AdamW, compiled over the drafter's and the optimizer's state) trains as
    the same update uncompiled: losses and weights equal (up to fused multiply-adds), mixed precision included."""
    target, tok = tiny
    _patterned_data(tmp_path / "data")
    runs = {}
    for comp in (True, False):
        if not comp:
            monkeypatch.setattr(mx, "compile", lambda f, **kw: f)
        for cdt in (None, "bfloat16"):
            name = f"u{int(comp)}{cdt}"
            tr = Trainer(_cfg(tmp_path, out=str(tmp_path / name), steps=6, kd_weight=0.5, compute_dtype=cdt),
                         target, tok)
            tr.fit(progress=False)
            runs[comp, cdt] = ([json.loads(line)["loss"] for line in open(tmp_path / name / "log.jsonl")],
                               dict(tree_flatten(tr.drafter.parameters())))
    for cdt in (None, "bfloat16"):
        np.testing.assert_allclose(runs[True, cdt][0], runs[False, cdt][0], rtol=1e-5)
        for k, v in runs[False, cdt][1].items():
            np.testing.assert_allclose(np.array(runs[True, cdt][1][k]), np.array(v), rtol=1e-5, atol=1e-7, err_msg=k)


def test_value_and_grad_in_a_compute_dtype_keeps_float32_masters():
    """Mixed precision: the forward sees bfloat16 weights, the gradients come back float32 for the float32
    parameters (close to the float32 ones), the model keeps its float32 parameters; None is nn.value_and_grad."""
    import mlx.nn as nn

    from mlx_dflash2.train.trainer import value_and_grad_in

    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 4))
    x = mx.random.normal((8, 16))
    seen = []

    def fn(m):
        seen.append(m.layers[0].weight.dtype)
        return (m(x.astype(m.layers[0].weight.dtype)).astype(mx.float32) ** 2).mean()

    v32, g32 = value_and_grad_in(model, fn)(model)
    v16, g16 = value_and_grad_in(model, fn, mx.bfloat16)(model)
    assert seen == [mx.float32, mx.bfloat16]
    assert all(p.dtype == mx.float32 for _, p in tree_flatten(model.parameters()))
    assert all(g.dtype == mx.float32 for _, g in tree_flatten(g16))
    np.testing.assert_allclose(v16.item(), v32.item(), rtol=3e-2)
    for (k, a), (_, b) in zip(tree_flatten(g32), tree_flatten(g16)):
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=0.1, atol=2e-2, err_msg=k)


def test_mixed_precision_step_trains_with_float32_weights(tiny, tmp_path):
    """``compute_dtype="bfloat16"`` trains (eager and compiled) with losses near float32's, the drafter's weights
    and checkpoint staying float32; an unknown dtype is refused before anything is written."""
    target, tok = tiny
    _patterned_data(tmp_path / "data")
    losses = {}
    for name, kw in (("f32", {}), ("bf16", {"compute_dtype": "bfloat16"}),
                     ("bf16c", {"compute_dtype": "bfloat16", "compile": True})):
        tr = Trainer(_cfg(tmp_path, out=str(tmp_path / name), steps=6, labels="target", kd_weight=0.5, **kw),
                     target, tok)
        tr.fit(progress=False)
        losses[name] = [json.loads(line)["loss"] for line in open(tmp_path / name / "log.jsonl")]
        assert all(p.dtype == mx.float32 for _, p in tree_flatten(tr.drafter.parameters())), name
    np.testing.assert_allclose(losses["bf16"], losses["f32"], rtol=5e-2)
    np.testing.assert_allclose(losses["bf16c"], losses["bf16"], rtol=5e-2)
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        Trainer(_cfg(tmp_path, out=str(tmp_path / "bad"), steps=1, compute_dtype="int8"), target, tok)
    assert not (tmp_path / "bad").exists()


def test_finetune_from_dflash_v1_starts_as_noop(tiny, tmp_path):
    """Fine-tuning a published-style DFlash (v1) drafter as DFlash2: conv and selector start as exact no-ops."""
    target, tok = tiny
    _patterned_data(tmp_path / "data")
    v1 = init_drafter(target, tok, architecture="DFlashDraftModel", num_layers=1, block_size=6, seed=4)
    save_drafter(v1, tmp_path / "v1")
    tr = Trainer(_cfg(tmp_path, init=str(tmp_path / "v1"), steps=2), target, tok)
    assert tr.drafter.config.is_dflash2
    feats = mx.random.normal((1, 12, len(v1.config.target_layer_ids) * 32))
    emb = mx.random.normal((1, 6, 32))
    c1, c2 = DraftContext(v1), DraftContext(tr.drafter)
    c1.append(v1, feats[0])
    c2.append(tr.drafter, feats[0])
    assert mx.array_equal(v1(emb, c1), tr.drafter(emb, c2)).item()
    tr.fit(progress=False)
    assert (tmp_path / "run" / "drafter" / "config.json").is_file()


def test_finetune_from_quantized_drafter_starts_dense(tiny, tmp_path):
    """A 4-bit drafter (as shipped) is fine-tuned from its dequantized weights: same outputs at the start,
    every linear layer trainable."""
    import mlx.nn as nn

    target, tok = tiny
    _patterned_data(tmp_path / "data")
    d = init_drafter(target, tok, num_layers=1, block_size=6, selector_rank=4, selector_top_k=4, seed=2)
    nn.quantize(d, group_size=32, bits=4, class_predicate=lambda p, m: isinstance(m, nn.Linear))
    save_drafter(d, tmp_path / "q4")
    q = load_drafter(tmp_path / "q4", target, tok)
    tr = Trainer(_cfg(tmp_path, init=str(tmp_path / "q4"), steps=2), target, tok)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in tr.drafter.named_modules())
    feats = mx.random.normal((1, 12, len(q.config.target_layer_ids) * 32))
    emb = mx.random.normal((1, 6, 32))
    c1, c2 = DraftContext(q), DraftContext(tr.drafter)
    c1.append(q, feats[0])
    c2.append(tr.drafter, feats[0])
    np.testing.assert_allclose(np.array(q(emb, c1)), np.array(tr.drafter(emb, c2)), rtol=1e-4, atol=1e-4)
    tr.fit(progress=False)
    assert load_drafter(tmp_path / "run" / "drafter", target, tok).config.is_dflash2


def test_time_budget_calibrates_steps(tiny, tmp_path):
    target, tok = tiny
    _patterned_data(tmp_path / "data")
    tr = Trainer(_cfg(tmp_path, steps=None, time_budget=2.0), target, tok)
    tr.fit(progress=False)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["steps"] == tr.total_steps >= 1
    assert tr.step == tr.total_steps or saved["extra"]["stopped_at_deadline"] == tr.step  # slower than calibrated
    assert saved["extra"]["calibrated_step_s"] > 0


def test_time_budget_is_a_hard_deadline(tiny, tmp_path):
    """More steps than the budget allows: the run stops at the deadline with the drafter saved."""
    target, tok = tiny
    _patterned_data(tmp_path / "data")
    tr = Trainer(_cfg(tmp_path, steps=100000, time_budget=1.0, save_every=100000), target, tok)
    tr.fit(progress=False)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert 1 <= tr.step < 100000 and saved["extra"]["stopped_at_deadline"] == tr.step
    assert (tmp_path / "run" / "drafter" / "config.json").is_file()
    assert Trainer(_cfg(tmp_path, steps=100000), target, tok).resume()


def test_replay_equals_real_loop(tiny, tmp_path):
    target, tok = tiny
    _patterned_data(tmp_path / "data", n=8)
    tr = Trainer(_cfg(tmp_path, steps=30), target, tok)
    tr.fit(progress=False)
    rows = []
    from mlx_lm.generate import generate_step

    for r in read_responses(tmp_path / "data")[:4]:
        toks = [t for t, _ in generate_step(mx.array(r["prompt_ids"]), target.model, max_tokens=24)]
        rows.append({"prompt_ids": r["prompt_ids"], "response_ids": toks[: toks.index(1) + 1] if 1 in toks else toks})
    for B in (3, 6):
        for loop_tau, replay_tau, same in check_against_loop(target, tok, tr.drafter, rows, B, 24):
            assert same and loop_tau == pytest.approx(replay_tau)
    st, per = replay(target, tr.drafter, rows, 6, 24, VOCAB, lookup=True)
    assert st.tau >= 1.0 and len(per) == 4


def test_replay_drafts_what_the_proposer_drafts_in_rounds_narrower_than_the_trained_block(tiny, tmp_path):
    """The replay's drafts equal the product proposer's for every round width: the proposer runs the
    drafter on its trained block (6 here) and keeps the first slots; the replay used to run it on a
    block of the round's width, a different input (a Qwen2.5 drafter's slot-1 acceptance read 0.08 at
    B=4 and 0.29 at its trained B=16, session 15)."""
    from mlx_dflash2.proposers import DFlashProposer

    target, tok = tiny
    _patterned_data(tmp_path / "data", n=8)
    drafter = init_drafter(target, tok, num_layers=1, block_size=6, selector_rank=4, seed=3)
    # a random drafter with sharp attention and varied outputs (init's small weights make every slot alike)
    from mlx.utils import tree_map_with_path

    key = iter(mx.random.split(mx.random.key(7), 64))
    drafter.update(tree_map_with_path(
        lambda path, a: mx.random.normal(a.shape, key=next(key)) * 0.5 if path.endswith("proj.weight") else a,
        drafter.parameters()))
    seq = read_responses(tmp_path / "data")[0]
    toks = list(seq["prompt_ids"]) + list(seq["response_ids"])
    P = len(seq["prompt_ids"])  # anchor position: context = positions 0..P-1
    taps = target.taps(mx.array([toks]), tuple(drafter.config.target_layer_ids))
    kv = drafter.context_kv_all(taps)
    prop = DFlashProposer(drafter, target, VOCAB, context_window=0)
    for slots in (1, 2, 3, 5):
        s = prop.start(toks[:P])
        s.extend(toks[:P], taps[0, :P])
        want = s.propose(toks[P], slots).tokens.tolist()
        got = draft_tokens(target, drafter, mx.array([toks[P]]), mx.array([[P]]), kv, slots)[0].tolist()
        assert got == want, slots


def test_decontamination_and_eval_sets():
    dec = Decontaminator()
    he = load_eval_set("humaneval")
    assert len(he) == 164 and len(load_eval_set("mtbench")) == 80 and len(load_eval_set("gsm8k")) == 200
    gsm = json.loads(open(__import__("mlx_dflash2").__path__[0] + "/data/evalsets/gsm8k.jsonl").readline())
    assert not dec.clean(gsm["question"])
    assert not dec.clean("Please solve: " + gsm["question"])
    assert dec.clean("Write a Python function that reverses a string.")


def test_prompt_file_formats(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"prompt": "hi"}\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    (tmp_path / "b.txt").write_text("first\n\nsecond\n")
    assert [r["messages"][0]["content"] for r in read_prompt_file(tmp_path / "a.jsonl")] == ["hi", "yo"]
    assert len(read_prompt_file(tmp_path / "b.txt")) == 2
    (tmp_path / "c.jsonl").write_text('{"nothing": 1}\n')
    with pytest.raises(ValueError, match="prompt"):
        read_prompt_file(tmp_path / "c.jsonl")


def test_regen_skip_and_limit_are_checked(tmp_path, capsys):
    from mlx_dflash2.train.cli import main

    (tmp_path / "p.txt").write_text("first\n\nsecond\n")
    base = ["regen", "--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "out")]
    assert main(base + ["--skip", "2"]) == 2
    assert "no prompts left after --skip 2" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    (tmp_path / "empty.txt").write_text("\n")
    assert main(["regen", "--prompts", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "out")]) == 2
    assert "empty.txt: no prompts" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert main(base[:-1] + [str(tmp_path / "afile")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    # fit / eval: bad arguments are refused before any model is loaded
    assert main(["fit", "--data", str(tmp_path / "nodata"), "--out", str(tmp_path / "run")]) == 2
    assert "--data" in capsys.readouterr().err
    ev = ["eval", "--drafter", "x", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "t.json")]
    for bad, msg in [(["--sets", "nosuch"], "unknown evaluation set 'nosuch'"), (["--block-sizes", "4,x"], "--block-sizes")]:
        assert main(ev + bad) == 2
        err = capsys.readouterr().err
        assert msg in err and not err.startswith('error: "'), err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()
    # the Python API checks the same settings itself, before writing anything
    from mlx_dflash2.train.regen import regenerate

    for kw in ({"batch_size": 0}, {"shard_size": 0}, {"max_tokens": 0}, {"temps": [0.0, -1.0]}, {"temps": []},
               {"max_prompt_tokens": 0}, {"temp_fraction": 1.5}, {"temp": -0.1}, {"seed": -1}, {"time_budget": 0}):
        with pytest.raises(ValueError, match=f"{next(iter(kw))} .*must be "):
            regenerate(None, None, [{"id": "a", "messages": []}], tmp_path / "api", **kw)
    assert not (tmp_path / "api").exists()


@pytest.mark.parametrize("cmd, bad, flag, value", [
    ("regen", "--temps=", "--temps", "''"), ("regen", "--temps=0,,1", "--temps", "'0,,1'"),
    ("regen", "--temps=0,abc", "--temps", "'0,abc'"), ("regen", "--temps=0,-1", "--temps", "'0,-1'"),
    ("regen", "--temp-fraction=1.5", "--temp-fraction", "'1.5'"),
    ("regen", "--temp-fraction=-0.1", "--temp-fraction", "'-0.1'"),
    ("regen", "--temp-fraction=nan", "--temp-fraction", "'nan'"), ("regen", "--temp=-1", "--temp", "'-1'"),
    ("regen", "--batch-size=0", "--batch-size", "'0'"), ("regen", "--batch-size=-4", "--batch-size", "'-4'"),
    ("regen", "--max-tokens=0", "--max-tokens", "'0'"), ("regen", "--shard-size=0", "--shard-size", "'0'"),
    ("regen", "--max-prompt-tokens=0", "--max-prompt-tokens", "'0'"), ("regen", "--skip=-1", "--skip", "'-1'"),
    ("regen", "--limit=0", "--limit", "'0'"), ("regen", "--seed=-1", "--seed", "'-1'"),
    ("regen", "--time-budget=0", "--time-budget", "'0'"), ("regen", "--time-budget=-5", "--time-budget", "'-5'"),
    ("regen", "--time-budget=inf", "--time-budget", "'inf'"), ("regen", "--batch-size=1.5", "--batch-size", "'1.5'"),
    ("self-instruct", "--n=0", "--n", "'0'"), ("self-instruct", "--temp=0", "--temp", "'0'"),
    ("self-instruct", "--max-tokens=0", "--max-tokens", "'0'"),
    ("self-instruct", "--batch-size=0", "--batch-size", "'0'"),
    ("self-instruct", "--max-batches=0", "--max-batches", "'0'"), ("self-instruct", "--seed=-2", "--seed", "'-2'"),
    ("prompts", "--sharegpt=-1", "--sharegpt", "'-1'"), ("prompts", "--code=-2", "--code", "'-2'"),
    ("prompts", "--math=x", "--math", "'x'"), ("prompts", "--sharegpt-turns=-1", "--sharegpt-turns", "'-1'"),
    ("prompts", "--code-api=-1", "--code-api", "'-1'"), ("prompts", "--seed=-1", "--seed", "'-1'"),
    ("vocab", "--size=0", "--size", "'0'"), ("vocab", "--size=1", "--size", "'1'"),
    ("vocab", "--held-out=1.5", "--held-out", "'1.5'"), ("vocab", "--held-out=-0.1", "--held-out", "'-0.1'"),
    ("vocab", "--seed=-3", "--seed", "'-3'"),
    ("eval", "--max-tokens=0", "--max-tokens", "'0'"), ("eval", "--limit=0", "--limit", "'0'"),
    ("eval", "--limit=-2", "--limit", "'-2'"), ("eval", "--limit=abc", "--limit", "'abc'"),
    ("regen", "--temps=0,0", "--temps", "'0,0'"),
])
def test_train_commands_refuse_bad_numbers_at_parsing(cmd, bad, flag, value, tmp_path, monkeypatch, capsys):
    """A bad number is an argparse error (exit 2) naming the flag and the value, before any model is loaded, in
    regen, self-instruct, prompts, vocab and eval (a repeated --temps temperature answered every prompt twice)."""
    from mlx_dflash2.train import cli

    monkeypatch.setattr(cli, "_target", lambda *a, **k: pytest.fail("the target was loaded"))
    (tmp_path / "p.txt").write_text("first\n")
    args = {"regen": ["--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "out")],
            "self-instruct": ["--n", "5", "--out", str(tmp_path / "s.jsonl")],
            "prompts": ["--out", str(tmp_path / "out")],
            "vocab": ["--data", str(tmp_path / "r"), "--drafter", str(tmp_path / "out")],
            "eval": ["--drafter", "shipped", "--out", str(tmp_path / "out")]}[cmd]
    with pytest.raises(SystemExit) as e:
        cli.main([cmd, *args, bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and value in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "s.jsonl").exists()


@pytest.mark.parametrize("bad, flag, value", [
    ("--lr=nan", "--lr", "'nan'"), ("--lr=inf", "--lr", "'inf'"), ("--lr=-1", "--lr", "'-1'"),
    ("--gamma=nan", "--gamma", "'nan'"), ("--gamma=0", "--gamma", "'0'"), ("--grad-clip=0", "--grad-clip", "'0'"),
    ("--grad-clip=nan", "--grad-clip", "'nan'"), ("--weight-decay=nan", "--weight-decay", "'nan'"),
    ("--min-lr-ratio=nan", "--min-lr-ratio", "'nan'"), ("--min-lr-ratio=2", "--min-lr-ratio", "'2'"),
    ("--warmup=2", "--warmup", "'2'"), ("--warmup=nan", "--warmup", "'nan'"),
    ("--selector-alpha=nan", "--selector-alpha", "'nan'"), ("--kd-weight=-1", "--kd-weight", "'-1'"),
    ("--selector-fraction=0", "--selector-fraction", "'0'"), ("--time-budget=inf", "--time-budget", "'inf'"),
    ("--keep-checkpoints=0", "--keep-checkpoints", "'0'"), ("--epochs=0", "--epochs", "'0'"),
    ("--epochs=-1", "--epochs", "'-1'"), ("--num-layers=0", "--num-layers", "'0'"),
    ("--save-every=0", "--save-every", "'0'"), ("--log-every=0", "--log-every", "'0'"),
    ("--seed=-1", "--seed", "'-1'"), ("--block-size=1", "--block-size", "'1'"), ("--steps=0", "--steps", "'0'"),
    ("--max-steps=0", "--max-steps", "'0'"), ("--loss-chunk=-1", "--loss-chunk", "'-1'"),
    ("--anchors=1.5", "--anchors", "'1.5'"),
])
def test_fit_refuses_bad_numbers_at_parsing(bad, flag, value, tmp_path, monkeypatch, capsys):
    """fit's numbers (FIELD_RANGES) are checked by the parser: NaN, infinite, negative or zero where it makes no
    sense (a NaN lr trained a drafter of NaNs and exited 0; --save-every 0 crashed after a step)."""
    from mlx_dflash2.train import cli

    monkeypatch.setattr(cli, "_target", lambda *a, **k: pytest.fail("the target was loaded"))
    (tmp_path / "data").mkdir()
    with pytest.raises(SystemExit) as e:
        cli.main(["fit", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"), bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and value in err, err
    assert not (tmp_path / "run").exists()


def test_trainer_checks_the_same_ranges(tiny, tmp_path):
    """The Python API refuses what the fit parser refuses, naming the field and its flag, before writing; every
    numeric TrainConfig field has a range."""
    from dataclasses import fields

    from mlx_dflash2.train.trainer import FIELD_RANGES

    numeric = {f.name for f in fields(TrainConfig) if f.name not in ("data", "out", "init", "architecture",
                                                                       "target_layer_ids", "labels", "compile",
                                                                       "draft_vocab", "compute_dtype", "extra")}
    assert numeric == set(FIELD_RANGES)
    target, tok = tiny
    _patterned_data(tmp_path / "data")
    for kw in ({"lr": float("nan")}, {"save_every": 0}, {"epochs": 0.0}, {"seed": -1}, {"warmup": 2.0},
               {"batch_size": 0}, {"steps": True}):
        with pytest.raises(ValueError, match=f"{next(iter(kw))} \\(--{next(iter(kw)).replace('_', '-')}\\) must be"):
            Trainer(_cfg(tmp_path, out=str(tmp_path / "bad"), **kw), target, tok)
    assert not (tmp_path / "bad").exists()


def test_prompts_self_instruct_eval_refuse_bad_paths_and_lists(tmp_path, monkeypatch, capsys):
    """Checked before anything is loaded or written: prompts --out a directory (a stray .tmp was left) or under a
    file, every count 0 (an empty file was written); self-instruct --exclude broken (found after the target loaded
    and .partial was written) or a directory; eval --block-sizes / --sets repeated; fit --out a file; regen
    --prompts a directory ("not found") and --out under a file (a bare errno)."""
    from mlx_dflash2.train import cli

    monkeypatch.setattr(cli, "_target", lambda *a, **k: pytest.fail("the target was loaded"))
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{not json\n')
    cases = [
        (["prompts", "--out", str(tmp_path / "adir"), "--sharegpt", "0"], "a directory, not a file"),
        (["prompts", "--out", str(tmp_path / "afile" / "p.jsonl"), "--sharegpt", "0"], "is a file, not a directory"),
        (["prompts", "--out", str(tmp_path / "p.jsonl"), "--sharegpt", "0", "--code", "0", "--math", "0"],
         "no prompts to write"),
        (["self-instruct", "--n", "2", "--out", str(tmp_path / "s.jsonl"), "--exclude", str(tmp_path / "broken.jsonl")],
         "broken.jsonl:2: invalid JSON"),
        (["self-instruct", "--n", "2", "--out", str(tmp_path / "s.jsonl"), "--exclude", str(tmp_path / "adir")],
         "a directory, not a prompt file"),
        (["eval", "--drafter", "x", "--block-sizes", "4,4", "--out", str(tmp_path / "t.json")],
         "--block-sizes '4,4': distinct sizes >= 2"),
        (["eval", "--drafter", "x", "--block-sizes", "0", "--out", str(tmp_path / "t.json")], "--block-sizes '0'"),
        (["eval", "--drafter", "x", "--sets", "gsm8k,gsm8k", "--out", str(tmp_path / "t.json")], "a set named twice"),
        (["fit", "--data", str(tmp_path / "adir"), "--out", str(tmp_path / "afile")], "a file, not a run directory"),
        (["regen", "--prompts", str(tmp_path / "adir"), "--out", str(tmp_path / "r")], "a directory, not a prompt file"),
        (["regen", "--prompts", str(tmp_path / "broken.jsonl"), "--out", str(tmp_path / "afile" / "r")],
         "afile is a file, not a directory"),
    ]
    for argv, msg in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile", "broken.jsonl"]
    assert not list((tmp_path / "adir").iterdir())


@pytest.mark.parametrize("spec, msg", [
    ("bogus=1", "unknown request kind 'bogus'"), ("", "an empty entry"), (" ", "an empty entry"),
    ("coding=1,", "an empty entry"), ("=3", "unknown request kind ''"), ("coding=", "expected KIND=WEIGHT"),
    ("coding=-1", "weight >= 0"), ("coding=inf", "weight >= 0"), ("coding=nan", "weight >= 0"),
    ("coding=1,coding=2", "given twice"), ("coding=0", "sum to 0"),
    ("coding=1e308,math=1e308", "sum to a finite number")])
def test_self_instruct_refuses_bad_kinds_before_loading(spec, msg, tmp_path, monkeypatch, capsys):
    """--kinds is checked before the target is loaded or anything written: one `error:` line, exit status 2
    (weights whose sum overflows were found by random.choices after loading, as 'Total of weights must be finite')."""
    from mlx_dflash2.train import cli

    monkeypatch.setattr(cli, "_target", lambda *a, **k: pytest.fail("the target was loaded"))
    assert cli.main(["self-instruct", "--n", "2", "--out", str(tmp_path / "s.jsonl"), "--kinds", spec]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and msg in err and "Traceback" not in err, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("extra", [["--temp-fraction", "0.5"], ["--temp", "0.7"], ["--temp-fraction", "0"]])
def test_regen_temps_refuses_temp_and_temp_fraction(extra, tmp_path, monkeypatch, capsys):
    """--temps answers every prompt at each temperature, so a --temp-fraction or --temp beside it (silently unused
    before) is a usage error."""
    from mlx_dflash2.train import cli

    monkeypatch.setattr(cli, "_target", lambda *a, **k: pytest.fail("the target was loaded"))
    (tmp_path / "p.txt").write_text("first\n")
    with pytest.raises(SystemExit) as e:
        cli.main(["regen", "--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "out"), "--temps", "0,1",
                  *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--temps cannot be combined" in err and "usage: mlx_dflash2.train regen" in err, err
    assert not (tmp_path / "out").exists()


def test_sharded_checkpoint_roundtrip(tiny, tmp_path):
    target, tok = tiny
    d = init_drafter(target, tok, num_layers=2, block_size=6, selector_rank=4)
    save_drafter(d, tmp_path / "s", max_shard_mb=0.01)
    files = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    d2 = load_drafter(tmp_path / "s", target, tok)
    a, b = dict(tree_flatten(d.parameters())), dict(tree_flatten(d2.parameters()))
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)


def test_batched_decode_equals_solo_greedy(tiny):
    """Left-padded batched decoding (regen) gives each row its solo greedy tokens, EOS included."""
    from mlx_lm.generate import generate_step

    from mlx_dflash2.train.regen import batched_decode

    target, _ = tiny
    rng = np.random.RandomState(3)
    prompts = [rng.randint(2, 60, size=n).tolist() for n in (3, 11, 7, 1, 20)]
    got = batched_decode(target.model, prompts, 12, 0.0, eos_ids=(), prefill_chunk=8, check_every=4)
    for p, g in zip(prompts, got):
        solo = [t for t, _ in generate_step(mx.array(p), target.model, max_tokens=12)]
        assert g == solo
    # EOS cuts a row after the EOS; sampled rows are reproducible under a seed
    eos = got[1][4]
    cut = batched_decode(target.model, prompts, 12, 0.0, eos_ids=(eos,))
    assert cut[1] == got[1][: got[1].index(eos) + 1]
    mx.random.seed(5)
    a = batched_decode(target.model, prompts, 8, [1.0, 0, 1.0, 0, 1.0])
    mx.random.seed(5)
    b = batched_decode(target.model, prompts, 8, [1.0, 0, 1.0, 0, 1.0])
    assert a == b and a[1] == got[1][:8]


def test_target_labels_equal_greedy_data_and_distillation_trains(tiny, tmp_path):
    """labels="target" takes the target's greedy choice after the data prefix: on the target's own
    greedy responses it equals the data labels. Distillation and a strided selector subset train."""
    from mlx_lm.generate import generate_step

    target, tok = tiny
    rng = np.random.RandomState(7)
    (tmp_path / "greedy").mkdir()
    with open(tmp_path / "greedy" / "shard-00000.jsonl", "w") as f:
        for i in range(4):
            p = rng.randint(2, 60, size=5).tolist()
            r = [t for t, _ in generate_step(mx.array(p), target.model, max_tokens=16)]
            f.write(json.dumps({"id": str(i), "prompt_ids": p, "response_ids": r}) + "\n")
    tr = Trainer(_cfg(tmp_path, data=str(tmp_path / "greedy"), labels="target"), target, tok)
    b = make_batch(tr.rows, 0, tr.cfg, tr.pad_id)
    _, final = target.taps(mx.array(b["tokens"]), tr.tap_ids, final=True)
    teacher = tr.teacher_logits(final, mx.array(b["anchors"]))
    got = np.array(mx.argmax(teacher, axis=-1)).reshape(b["labels"].shape)
    assert np.array_equal(got[b["label_valid"]], b["labels"][b["label_valid"]])
    # full logits of the plain forward agree with the teacher rows
    full = target.lm_head(final)
    a0 = int(b["anchors"][0, 0])
    np.testing.assert_allclose(np.array(teacher[0, 0]), np.array(full[0, a0]), rtol=1e-5, atol=1e-5)
    _patterned_data(tmp_path / "data")
    kd = Trainer(_cfg(tmp_path, out=str(tmp_path / "kd"), steps=24, lr=1e-2, labels="target", kd_weight=1.0,
                      selector_fraction=0.5), target, tok)
    kd.fit(progress=False)
    logs = [json.loads(l) for l in open(tmp_path / "kd" / "log.jsonl")]
    assert all("kd" in l for l in logs) and "sel_acc" in logs[-1]  # the selector loss starts after a ramp
    assert np.mean([l["loss"] for l in logs[-3:]]) < np.mean([l["loss"] for l in logs[:3]])
    # the loss is main + kd_weight * kd + alpha * selector (the selector term must not drop kd)
    b = make_batch(kd._batch_rows(0), 0, kd.cfg, kd.pad_id)
    toks, anc = mx.array(b["tokens"]), mx.array(b["anchors"])
    feats, final = target.taps(toks, kd.tap_ids, final=True)
    loss, m = dflash_loss(kd.drafter, target, feats, toks, anc, mx.array(b["labels"]), mx.array(b["label_valid"]),
                          kd.weights, 0.5, teacher_states=kd.teacher_states(final, anc), kd_weight=2.0,
                          selector_fraction=0.5, target_labels=True)
    assert loss.item() == pytest.approx(m["main"].item() + 2.0 * m["kd"].item() + 0.5 * m["selector"].item(), rel=1e-5)
    for bad in (dict(labels="gold"), dict(kd_weight=-1.0), dict(selector_fraction=0.0)):
        with pytest.raises(ValueError):
            Trainer(_cfg(tmp_path, **bad), target, tok)


def test_long_sequences_lose_middle_of_prompt_not_response(tmp_path):
    rows = [{"prompt_ids": list(range(2, 62)), "response_ids": list(range(62, 74))},  # 60 + 12
            {"prompt_ids": list(range(2, 12)), "response_ids": list(range(12, 74))}]  # 10 + 62
    b = make_batch(rows, 0, _cfg(tmp_path, max_len=50), pad_id=1)
    seq = rows[0]["prompt_ids"] + rows[0]["response_ids"]
    assert b["tokens"][0, :50].tolist() == seq[:32] + seq[54:]  # the head and the response are kept
    assert (b["anchors"][0] >= 38).all()  # anchors stay in the response
    seq = rows[1]["prompt_ids"] + rows[1]["response_ids"]
    assert b["tokens"][1, :50].tolist() == seq[:50]  # prompt too short to cut: the end goes
    assert (b["anchors"][1] >= 10).all() and (b["anchors"][1] <= 48).all()


def test_sharegpt_later_turns_keep_their_context(tmp_path):
    """Later human turns become prompts with the conversation before them (oldest pairs dropped
    past the context limit); non-alternating conversations are skipped; the dump may be truncated."""
    from mlx_dflash2.train.data import build_prompts, sharegpt_later_turns

    convs = [
        {"id": "a", "conversations": [{"from": "human", "value": "first question here"},
                                      {"from": "gpt", "value": "first answer"},
                                      {"from": "human", "value": "second question here"},
                                      {"from": "gpt", "value": "second answer"},
                                      {"from": "human", "value": "third question here"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "q one here"}, {"from": "human", "value": "q two here"}]},
    ]
    text = "[" + ",\n".join(json.dumps(c) for c in convs) + ',\n{"id": "trunc'
    (tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json").write_text(text)
    rows = sharegpt_later_turns(tmp_path)
    assert [r["id"] for r in rows] == ["sharegpt-a_1", "sharegpt-a_2"]
    assert [m["role"] for m in rows[1]["messages"]] == ["user", "assistant"] * 2 + ["user"]
    assert rows[1]["messages"][-1]["content"] == "third question here"
    short = sharegpt_later_turns(tmp_path, max_context_chars=60)
    assert short[1]["messages"][0]["content"] == "second question here"  # the first pair was dropped
    assert sharegpt_later_turns(tmp_path, max_context_chars=10) == []  # no turn left without context
    st = build_prompts(tmp_path / "p.jsonl", 0, 0, 0, cache_dir=tmp_path, n_sharegpt_turns=5)
    assert st["kept"]["sharegpt-turns"] == 2
    assert read_prompt_file(tmp_path / "p.jsonl")[0]["messages"][-1]["role"] == "user"


def test_eval_cache_is_per_target(tiny, tmp_path):
    """Greedy continuations cached for one target are never replayed for another (other weights or dtype)."""
    from mlx_lm.models import llama

    from mlx_dflash2.train.evaluate import _continuation_cache, target_fingerprint

    target, _ = tiny
    fp = target_fingerprint(target)
    assert fp == target_fingerprint(target)
    other = llama.Model(llama.ModelArgs.from_dict(target.config))
    mx.eval(other.parameters())
    assert target_fingerprint(TargetAdapter(other, target.config)) != fp
    other.load_weights(list(tree_flatten(target.model.parameters())))
    assert target_fingerprint(TargetAdapter(other, target.config)) == fp  # same weights, same dtype
    other.set_dtype(mx.float16)
    assert target_fingerprint(TargetAdapter(other, target.config, probe=False)) != fp
    for name in (f"gsm8k-4-{fp}-64", f"gsm8k-4-{fp}-32", "gsm8k-4-0123456789-256", "gsm8k-4-256"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "shard-00000.jsonl").write_text("")
    assert _continuation_cache(tmp_path, f"gsm8k-4-{fp}", 48).name == f"gsm8k-4-{fp}-64"
    assert _continuation_cache(tmp_path, f"gsm8k-4-{fp}", 128) is None


def test_code_api_prompts_are_new_and_clean():
    """Standard-library code prompts (built in a subprocess: it imports every stdlib module)."""
    import subprocess
    import sys

    code = ("import json; from mlx_dflash2.train.data import code_api_prompts, code_prompts; "
            "a = code_api_prompts(); b = {r['prompt'] for r in code_prompts()}; "
            "print(json.dumps([len(a), sum(r['prompt'] in b for r in a), sorted({r['source'] for r in a})]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    n, overlap, sources = json.loads(out.stdout.strip().splitlines()[-1])
    assert n > 3000 and overlap < 0.01 * n and sources == ["code-api"]


def test_padding_rows_of_the_head_are_masked():
    from mlx_dflash2.train.trainer import _mask_vocab

    x = mx.zeros((2, 6))
    assert _mask_vocab(x, None) is x and _mask_vocab(x, 6) is x
    assert np.array(_mask_vocab(x, 4))[:, 4:].max() == -1e9
    h = np.array(_mask_vocab(x.astype(mx.float16), 4).astype(mx.float32))
    assert h[0, :4].max() == 0 and h[0, 4:].max() < -5e4


class ChatTinyTok(TinyTok):
    def apply_chat_template(self, messages, add_generation_prompt=True, **kw):
        return [2 + (ord(c) % 58) for c in messages[-1]["content"]][:12]


def test_regen_resumes_only_the_same_prompts_and_settings(tiny, tmp_path):
    """A regen output folder is resumed with the same prompts and settings; other prompts or settings are
    refused (their shards would be skipped as done and the new prompts never answered)."""
    from mlx_dflash2.train.regen import regenerate

    target, _ = tiny
    tok = ChatTinyTok()
    ps = [{"id": str(i), "messages": [{"role": "user", "content": f"prompt {i}"}]} for i in range(4)]
    st = regenerate(target, tok, ps, tmp_path / "r", max_tokens=6, batch_size=4, shard_size=2, progress=False)
    assert st["written"] == 4
    again = regenerate(target, tok, ps, tmp_path / "r", max_tokens=6, batch_size=4, shard_size=2, progress=False)
    assert again["skipped_shards"] == 2 and again["written"] == 0
    meta = (tmp_path / "r" / "meta.json").read_text()
    with pytest.raises(ValueError, match="max_tokens 6 -> 8"):
        regenerate(target, tok, ps, tmp_path / "r", max_tokens=8, batch_size=4, shard_size=2, progress=False)
    other = [dict(p, messages=[{"role": "user", "content": "other " + p["id"]}]) for p in ps]
    with pytest.raises(ValueError, match="the prompts"):
        regenerate(target, tok, other, tmp_path / "r", max_tokens=6, batch_size=4, shard_size=2, progress=False)
    assert (tmp_path / "r" / "meta.json").read_text() == meta  # nothing rewritten


def test_regen_counts_the_prompts_over_max_prompt_tokens(tiny, tmp_path, monkeypatch, capsys):
    """Prompts over --max-prompt-tokens are skipped, but counted (stats, a resumed run, and a line from the CLI)."""
    from mlx_dflash2.train import cli
    from mlx_dflash2.train.regen import read_responses, regenerate

    target, _ = tiny
    texts = ["ab", "abcdefghij", "abcdef", "abcdefghijklmnop", "abc"]  # 2, 10, 6, 12 (cut), 3 tokens
    ps = [{"id": str(i), "messages": [{"role": "user", "content": t}]} for i, t in enumerate(texts)]
    kw = dict(max_tokens=3, batch_size=4, shard_size=2, temps=[0.0, 0.7], max_prompt_tokens=8, progress=False)
    st = regenerate(target, ChatTinyTok(), ps, tmp_path / "r", **kw)
    assert st["too_long_prompts"] == 2 and st["written"] == 6
    assert sorted({r["id"] for r in read_responses(tmp_path / "r")}) == ["0", "2", "4"]
    again = regenerate(target, ChatTinyTok(), ps, tmp_path / "r", **kw)  # resumed: counted from the shards
    assert again["skipped_shards"] == 3 and again["written"] == 0 and again["too_long_prompts"] == 2
    # the CLI: a flag, checked before loading, and a line saying how many were skipped
    monkeypatch.setattr(cli, "_target", lambda args: (target, ChatTinyTok()))
    (tmp_path / "p.txt").write_text("\n".join(texts) + "\n")
    base = ["regen", "--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "c"), "--max-tokens", "3"]
    assert cli.main(base + ["--max-prompt-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.splitlines()[-1])["too_long_prompts"] == 2
    assert "skipped 2 of 5 prompts, longer than --max-prompt-tokens 8" in err
    assert cli.main(base[:3] + ["--out", str(tmp_path / "d"), "--max-tokens", "3"]) == 0  # default 1024: none skipped
    out, err = capsys.readouterr()
    assert json.loads(out.splitlines()[-1])["too_long_prompts"] == 0 and "skipped" not in err


def test_regen_ctrl_c_stops_cleanly_and_says_what_was_saved(tiny, tmp_path, monkeypatch, capsys):
    """Ctrl-C in regen: no traceback, a line saying which shards are saved, exit 130; a rerun resumes."""
    from mlx_dflash2.train import cli, regen

    target, _ = tiny
    monkeypatch.setattr(cli, "_target", lambda args: (target, ChatTinyTok()))
    (tmp_path / "p.txt").write_text("".join(f"prompt {i}\n" for i in range(4)))
    argv = ["regen", "--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "r"), "--max-tokens", "3",
            "--shard-size", "2"]
    real, calls = regen.batched_decode, []

    def interrupted_in_the_second_shard(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    def main(argv):
        try:
            return cli.main(argv)
        except KeyboardInterrupt:  # a failure, not pytest's own Ctrl-C (which would end the session)
            pytest.fail("Ctrl-C escaped main (a traceback)")

    monkeypatch.setattr(regen, "batched_decode", interrupted_in_the_second_shard)
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "interrupted; 1 of 2 shards saved in " in err and "(1 by this run); rerun the same command" in err, err
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["meta.json", "shard-00000.jsonl"]
    monkeypatch.setattr(cli, "_target", lambda args: (_ for _ in ()).throw(KeyboardInterrupt))  # while loading
    assert main(argv) == 130
    assert "interrupted; 1 of 2 shards saved in " in capsys.readouterr().err
    monkeypatch.setattr(cli, "_target", lambda args: (target, ChatTinyTok()))
    assert cli.main(argv) == 0  # resumed
    st = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert st["skipped_shards"] == 1 and st["written"] == 2


@pytest.mark.parametrize("cmd", ["self-instruct", "eval", "prompts", "vocab"])
def test_ctrl_c_in_other_train_commands_exits_130_without_a_traceback(cmd, tmp_path, monkeypatch, capsys):
    """Ctrl-C while self-instruct or eval loads the target, or while prompts / vocab work: one line, exit 130."""
    from mlx_dflash2.train import cli, data, vocab

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_target", interrupt)
    monkeypatch.setattr(data, "build_prompts", interrupt)
    monkeypatch.setattr(vocab, "write_vocab", interrupt)
    argv = {"self-instruct": ["--n", "2", "--out", str(tmp_path / "s.jsonl")],
            "eval": ["--drafter", "shipped", "--out", str(tmp_path / "t.json"), "--cache-dir", str(tmp_path / "c")],
            "prompts": ["--out", str(tmp_path / "p.jsonl")],
            "vocab": ["--data", str(tmp_path), "--drafter", str(tmp_path / "d")]}[cmd]
    try:
        rc = cli.main([cmd, *argv])
    except KeyboardInterrupt:  # a failure, not pytest's own Ctrl-C (which would end the session)
        pytest.fail("Ctrl-C escaped main (a traceback)")
    assert rc == 130 and f"interrupted: {cmd} stopped" in capsys.readouterr().err


def test_resume_refuses_other_settings_and_cuts_the_log(tiny, tmp_path):
    """Resuming needs the run's own settings (a named error otherwise, config.json untouched); the log
    keeps no steps past the checkpoint; --init fixes the drafter's shape (conflicting flags are refused)."""
    target, tok = tiny
    _patterned_data(tmp_path / "data")
    a = Trainer(_cfg(tmp_path, steps=12, save_every=4), target, tok)
    a.fit(progress=False, max_steps=6)  # checkpoints at 4 and 6
    with open(tmp_path / "run" / "log.jsonl", "a") as f:  # as if interrupted after logging step 7
        f.write(json.dumps({"step": 7, "loss": 0.0}) + "\n")
    saved = (tmp_path / "run" / "config.json").read_text()
    with pytest.raises(ValueError, match=r"num_layers 1 \(now 2\)"):
        Trainer(_cfg(tmp_path, steps=12, save_every=4, num_layers=2), target, tok).fit(progress=False)
    with pytest.raises(ValueError, match=r"lr 0.003 \(now 0.001\)") as e:
        Trainer(_cfg(tmp_path, steps=12, save_every=4, lr=1e-3), target, tok).fit(progress=False)
    assert "--init" not in str(e.value)
    # more steps: a run is not extended in place, and the message says how to train further
    with pytest.raises(ValueError, match=r"steps 12 \(now 20\).*start another run with --init .*run/drafter"):
        Trainer(_cfg(tmp_path, steps=20, save_every=4), target, tok).fit(progress=False)
    assert (tmp_path / "run" / "config.json").read_text() == saved
    b = Trainer(_cfg(tmp_path, steps=12, save_every=4), target, tok)
    assert b.resume() and b.step == 6
    steps = [json.loads(l)["step"] for l in open(tmp_path / "run" / "log.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]
    b.fit(progress=False)
    steps = [json.loads(l)["step"] for l in open(tmp_path / "run" / "log.jsonl")]
    assert steps == list(range(1, 13))
    # --init fixes the shape: a conflicting flag is an error, the saved config holds the real shape
    save_drafter(b.drafter, tmp_path / "d")
    with pytest.raises(ValueError, match=r"--num-layers 2 \(it has 1\)"):
        Trainer(_cfg(tmp_path, out=str(tmp_path / "ft"), init=str(tmp_path / "d"), num_layers=2), target, tok)
    ft = Trainer(_cfg(tmp_path, out=str(tmp_path / "ft"), init=str(tmp_path / "d"), num_layers=None,
                      selector_rank=None, selector_top_k=None), target, tok)
    assert (ft.cfg.num_layers, ft.cfg.selector_rank) == (1, 4)


class TemplateTinyTok(TinyTok):
    """A character-level tokenizer with a chat template (ids 2..61 <-> characters)."""

    chat_template = "tiny"
    _chars = "abcdefghijklmnopqrstuvwxyz .,?!'-<>|0123456789"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kw):
        text = "".join(f"<{m['role']}>{m['content']}|" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return text if not tokenize else self.encode(text)

    def encode(self, text, add_special_tokens=True):
        return [2 + self._chars.index(c) if c in self._chars else 2 for c in text]

    def decode(self, ids):
        return "".join(self._chars[i - 2] if 2 <= i < 2 + len(self._chars) else "" for i in ids)


def test_self_instruct_filters_dedupes_decontaminates_and_resumes(tiny, tmp_path, monkeypatch):
    """Self-instruct keeps only requests the target ended, long enough, new (case/punctuation ignored) and
    clean of the eval sets; each batch is saved before the next, so a crashed run resumes where it stopped
    and ends with the same file as an uninterrupted one; other settings are refused."""
    from mlx_dflash2.train import selfinstruct as si

    target, _ = tiny
    tok = TemplateTinyTok()
    assert si.user_turn_prefix(tok) == "<user>"
    gsm = load_eval_set("gsm8k", 1)[0]["messages"][0]["content"]  # an eval prompt: must be dropped
    valid = [f"please tell me about {w} today" for w in ("cats", "dogs", "trains", "rivers", "bread", "music",
                                                          "chess", "stars", "rain", "glass")]
    pool = [valid[0], valid[0].replace(" ", "  ") + "!", "too short", None, gsm[:200].lower(), *valid[1:4], valid[2], *valid[4:]]
    state = {"row": 0, "calls": 0, "crash_at": None}
    monkeypatch.setattr(si, "STARTERS", {"open": (0.5, ("",)), "math": (0.5, ("",))})

    def scripted(model, prompts, max_tokens, temps, eos_ids, vocab_size=None):
        if state["calls"] == state["crash_at"]:
            raise RuntimeError("crash")
        state["calls"] += 1
        out = []
        for p in prompts:
            assert tok.decode(p) == "<user>"
            t = pool[state["row"] % len(pool)]
            state["row"] += 1
            out.append(tok.encode("x" * 300) if t is None else tok.encode(t) + [1])
        return out

    monkeypatch.setattr(si, "batched_decode", scripted)
    full = si.self_instruct(target, tok, 9, tmp_path / "a.jsonl", batch_size=4, progress=False, seed=3)
    rows = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert full["kept"] == len(rows) == 9 and not (tmp_path / "a.jsonl.partial").exists()
    assert full["batches"] == 4 and full["sampled"] == 16 == 9 + sum(full["dropped"].values()) + full["surplus"]
    contents = [r["messages"][0]["content"] for r in rows]
    assert contents == valid[:9]
    assert full["dropped"] == {"unfinished": 1, "short": 1, "long": 0, "template": 0, "duplicate": 3,
                               "contaminated": 1}
    assert {r["source"] for r in rows} <= {"self-instruct:open", "self-instruct:math"}
    assert read_prompt_file(tmp_path / "a.jsonl")[0]["source"] == rows[0]["source"]

    # a run that crashes in its third batch resumes there and writes the same file
    state.update(row=0, calls=0, crash_at=2)
    with pytest.raises(RuntimeError):
        si.self_instruct(target, tok, 9, tmp_path / "b.jsonl", batch_size=4, progress=False, seed=3)
    assert not (tmp_path / "b.jsonl").exists() and (tmp_path / "b.jsonl.partial").exists()
    with pytest.raises(ValueError, match="other settings"):
        si.self_instruct(target, tok, 9, tmp_path / "b.jsonl", batch_size=4, progress=False, seed=4)
    state.update(crash_at=None)
    part = tmp_path / "b.jsonl.partial"
    part.write_text(part.read_text() + '{"batch": 2, "rows": [{"id"')  # a killed append leaves a cut line
    again = si.self_instruct(target, tok, 9, tmp_path / "b.jsonl", batch_size=4, progress=False, seed=3)
    assert again["resumed_batches"] == 2 and again["dropped"] == full["dropped"]
    assert (tmp_path / "b.jsonl").read_text() == (tmp_path / "a.jsonl").read_text()

    # requests of --exclude files count as seen; a foreign partial file is refused by name
    state.update(row=0)
    ex = si.self_instruct(target, tok, 1, tmp_path / "c.jsonl", batch_size=4, progress=False, seed=3,
                          exclude=[tmp_path / "a.jsonl"], max_batches=8)
    got = [json.loads(x)["messages"][0]["content"] for x in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert got == [valid[9]] and ex["dropped"]["duplicate"] >= 2 + 9  # the pool's own two and a.jsonl's nine
    (tmp_path / "d.jsonl.partial").write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="not a self-instruct partial"):
        si.self_instruct(target, tok, 5, tmp_path / "d.jsonl", batch_size=4, progress=False)


def test_self_instruct_kinds_weight_the_requests(tiny, tmp_path, monkeypatch):
    """``kinds`` (``--kinds``) draws only the kinds named, in their proportions, the function-completion openings
    included; without it every seed's plan is what it was before the completion kind existed (it is last, with no
    share); bad specs are refused with the kinds listed; a partial file of other kinds is not resumed."""
    from mlx_dflash2.train import selfinstruct as si

    plan = si._plan(8, 256, 5, si.parse_kinds("coding=3, completion=1"))
    kinds = [k for row in plan for k, _ in row]
    assert set(kinds) == {"coding", "completion"} and 0.2 < kinds.count("completion") / len(kinds) < 0.3
    assert all(o in si.STARTERS[k][1] for row in plan for k, o in row)
    before = {k: v for k, v in si.STARTERS.items() if k != "completion"}
    assert si.STARTERS["completion"][0] == 0 and list(si.STARTERS)[-1] == "completion"
    default = si._plan(4, 64, 7)
    monkeypatch.setattr(si, "STARTERS", before)
    assert si._plan(4, 64, 7) == default
    monkeypatch.undo()
    for bad, msg in (("coding=3,bogus=1", "unknown request kind 'bogus'.*kinds: open, .*completion"),
                     ("coding", "expected KIND=WEIGHT"), ("coding=-1", "weight >= 0"), ("math=0", "sum to 0"),
                     ("math=1,math=2", "given twice"), ("coding=nan", "weight >= 0")):
        with pytest.raises(ValueError, match=msg):
            si.parse_kinds(bad)

    target, _ = tiny
    tok = TemplateTinyTok()
    seen = []

    def scripted(model, prompts, max_tokens, temps, eos_ids, vocab_size=None):
        seen.extend(tok.decode(p) for p in prompts)
        return [tok.encode(f" request number {len(seen) - len(prompts) + i} here") + [1] for i in range(len(prompts))]

    monkeypatch.setattr(si, "batched_decode", scripted)
    st = si.self_instruct(target, tok, 6, tmp_path / "k.jsonl", batch_size=4, progress=False, seed=1,
                          kinds={"completion": 1.0})
    assert st["by_kind"] == {"completion": 6}
    texts = [json.loads(x)["messages"][0]["content"] for x in (tmp_path / "k.jsonl").read_text().splitlines()]
    assert all(any(t.startswith(o) for o in si.STARTERS["completion"][1]) for t in texts)
    with pytest.raises(ValueError, match="unknown request kind"):
        si.self_instruct(target, tok, 6, tmp_path / "k2.jsonl", batch_size=4, progress=False, kinds={"nope": 1.0})
    state = {"n": 0}

    def crash_second(model, prompts, *a, **kw):
        state["n"] += 1
        if state["n"] == 2:
            raise RuntimeError("crash")
        return scripted(model, prompts, *a, **kw)

    monkeypatch.setattr(si, "batched_decode", crash_second)
    with pytest.raises(RuntimeError):
        si.self_instruct(target, tok, 6, tmp_path / "m.jsonl", batch_size=4, progress=False, kinds={"coding": 1.0})
    with pytest.raises(ValueError, match="other settings"):
        si.self_instruct(target, tok, 6, tmp_path / "m.jsonl", batch_size=4, progress=False, kinds={"math": 1.0})
    monkeypatch.setattr(si, "batched_decode", scripted)  # the same plan with a kind at 0 resumes it
    st = si.self_instruct(target, tok, 6, tmp_path / "m.jsonl", batch_size=4, progress=False,
                          kinds={"coding": 1.0, "math": 0.0})
    assert st["resumed_batches"] == 1 and st["by_kind"] == {"coding": 6}


def test_self_instruct_runs_on_a_real_decode_and_refuses_a_short_run(tiny, tmp_path):
    """The unscripted path (batched sampling on the tiny random target) runs; a run that cannot keep --n
    requests in its batches writes no output, keeps its partial file and continues when given more
    batches; bad settings are refused before anything is loaded or written."""
    from mlx_dflash2.train.selfinstruct import check_self_instruct_args, self_instruct

    target, _ = tiny
    out = tmp_path / "p.jsonl"
    with pytest.raises(ValueError, match="kept .* of 1000 requests after 2 batches"):
        self_instruct(target, TemplateTinyTok(), 1000, out, max_tokens=6, batch_size=8, max_batches=2,
                      min_words=1, progress=False)
    assert not out.exists() and len((tmp_path / "p.jsonl.partial").read_text().splitlines()) == 3
    with pytest.raises(ValueError, match="after 3 batches"):
        self_instruct(target, TemplateTinyTok(), 1000, out, max_tokens=6, batch_size=8, max_batches=3,
                      min_words=1, progress=False)
    assert len((tmp_path / "p.jsonl.partial").read_text().splitlines()) == 4  # one more batch, not three
    with pytest.raises(ValueError, match="chat template"):
        self_instruct(target, TinyTok(), 2, tmp_path / "q.jsonl", progress=False)
    for bad, match in ((dict(seed=-1), "seed"), (dict(temp=float("nan")), "temp"), (dict(temp=0.0), "temp"),
                       (dict(n=0), "n "), (dict(max_batches=0), "max_batches")):
        args = dict(out=tmp_path / "r.jsonl", n=2, batch_size=4, max_tokens=8, max_batches=None, seed=0, temp=1.0)
        args.update(bad)
        with pytest.raises(ValueError, match=match):
            check_self_instruct_args(**args)
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        check_self_instruct_args(tmp_path / "f" / "x" / "r.jsonl", 2, 4, 8, None, 0, 1.0)
    assert not (tmp_path / "r.jsonl").exists()


def _slow_steps(monkeypatch, seconds: float) -> list:
    """Make every training step take at least ``seconds`` (a step's cost without a big model); returns the
    list that counts the steps run."""
    import time

    real = Trainer.train_step
    ran = []

    def slow(self, batch):
        ran.append(1)
        time.sleep(seconds)
        return real(self, batch)

    monkeypatch.setattr(Trainer, "train_step", slow)
    return ran


def test_time_budget_smaller_than_one_step_writes_nothing(tiny, tmp_path, monkeypatch):
    """A budget that does not fit one step ends within the budget plus that step, with a clear error,
    no run directory (a new run) or the directory as it was (a resumed run), never an empty one."""
    import os
    import time

    target, tok = tiny
    _patterned_data(tmp_path / "data")
    ran = _slow_steps(monkeypatch, 0.6)
    tr = Trainer(_cfg(tmp_path, steps=None, time_budget=0.3), target, tok)
    with pytest.raises(ValueError, match="not even one step fits .*nothing was written"):
        tr.fit(progress=False)
    assert len(ran) == 1  # the one step that measured the cost (no calibration steps); no wall-clock bound
    assert not (tmp_path / "run").exists()
    # the budget is over before the first step (e.g. loading took it): nothing runs, nothing is written
    ran.clear()
    tr = Trainer(_cfg(tmp_path, steps=None, time_budget=5.0), target, tok, started=time.perf_counter() - 10)
    with pytest.raises(ValueError, match="ended before the first step"):
        tr.fit(progress=False)
    assert not ran and not (tmp_path / "run").exists()
    # a resumed run whose next step does not fit is left as it was, still resumable
    Trainer(_cfg(tmp_path, steps=4, save_every=2), target, tok).fit(progress=False, max_steps=2)
    before = {p: os.stat(p).st_mtime_ns for p in (tmp_path / "run").rglob("*")}
    with pytest.raises(ValueError, match="not even one step fits .*left as it was"):
        Trainer(_cfg(tmp_path, steps=4, save_every=2, time_budget=0.3), target, tok).fit(progress=False)
    assert {p: os.stat(p).st_mtime_ns for p in (tmp_path / "run").rglob("*")} == before
    b = Trainer(_cfg(tmp_path, steps=4, save_every=2), target, tok)
    assert b.resume() and b.step == 2


def test_time_budget_sizes_from_the_steps_done_and_ends_in_time(tiny, tmp_path, monkeypatch):
    """No calibration steps thrown away: a budgeted run is sized from its own first steps, and ends
    (final checkpoint and drafter written) within the budget."""
    import time

    target, tok = tiny
    _patterned_data(tmp_path / "data")
    _slow_steps(monkeypatch, 0.1)
    t0 = time.perf_counter()
    tr = Trainer(_cfg(tmp_path, steps=None, time_budget=2.0, log_every=1000, save_every=1000), target, tok, started=t0)
    tr.fit(progress=False)
    took = time.perf_counter() - t0
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert took <= 2.0 + 0.5, took  # bounded by the budget (plus one step's jitter at most)
    assert 3 <= tr.step <= saved["steps"] <= 19 and (tmp_path / "run" / "drafter" / "config.json").is_file()
    # the planned steps, unless later steps ran slower than the first ones and the deadline came first
    assert tr.step == saved["steps"] or saved["extra"]["stopped_at_deadline"] == tr.step
    assert saved["extra"]["calibrated_step_s"] >= 0.1


def test_fit_reports_progress_from_the_first_step(tiny, tmp_path, capsys, monkeypatch):
    """The progress bar shows step 1 with its loss and step time as soon as it is done."""
    target, tok = tiny
    _patterned_data(tmp_path / "data")
    _slow_steps(monkeypatch, 0.15)
    Trainer(_cfg(tmp_path, steps=3, log_every=100), target, tok).fit(progress=True)
    err = capsys.readouterr().err
    shown = [s for s in err.replace("\r", "\n").splitlines() if " 1/3 " in s]
    assert shown and "loss=" in shown[0] and "step_s=" in shown[0], err


def test_cpu_backend_gets_small_default_batches(tiny, tmp_path):
    """Batch shape left open: MLX's CPU backend gets small defaults, GPUs keep the H200 recipe's."""
    from mlx_dflash2.train.trainer import CPU_DEFAULTS, device_defaults

    assert device_defaults(mx.gpu) == {"batch_size": 16, "anchors": 64, "max_len": 768}
    assert device_defaults(mx.cpu) == CPU_DEFAULTS and CPU_DEFAULTS["batch_size"] < 16
    target, tok = tiny
    _patterned_data(tmp_path / "data")
    cfg = _cfg(tmp_path, steps=1)
    cfg.batch_size = cfg.anchors = None
    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        tr = Trainer(cfg, target, tok)
    finally:
        mx.set_default_device(old)
    assert (cfg.batch_size, cfg.anchors, cfg.max_len) == tuple(CPU_DEFAULTS[k] for k in ("batch_size", "anchors",
                                                                                           "max_len"))
    assert tr.chosen_defaults == CPU_DEFAULTS
    kept = Trainer(_cfg(tmp_path, steps=1, max_len=100), target, tok)  # given values are kept
    assert (kept.cfg.batch_size, kept.cfg.anchors, kept.cfg.max_len) == (4, 6, 100) and not kept.chosen_defaults


def test_fit_cli_prints_its_defaults_and_progress(tmp_path, capsys, monkeypatch):
    """`fit` on the CPU backend names the defaults it chose and the vocabulary, and shows progress from step 1;
    a budget too small for one step exits with a clear error and no run directory. The target is loaded
    with the reference kernels (the loss differentiates through its head; the kernels have no gradient)."""
    from convert_helpers import random_weights, tiny_config, write_hf

    import mlx_dflash2.loading as loading
    from mlx_dflash2.train.cli import main

    modes, load = [], loading.load_target

    def spy(*a, **kw):
        modes.append(kw.get("kernels"))
        return load(*a, **kw)

    monkeypatch.setattr(loading, "load_target", spy)

    cfg = tiny_config()
    model = write_hf(tmp_path / "model", cfg, random_weights(cfg))
    _patterned_data(tmp_path / "data")
    base = ["fit", "--model", str(model), "--data", str(tmp_path / "data"), "--num-layers", "1", "--block-size", "6",
            "--selector-rank", "4", "--selector-top-k", "4"]
    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        assert main(base + ["--out", str(tmp_path / "run"), "--steps", "2"]) == 0
        err = capsys.readouterr().err
        assert "defaults for MLX's CPU backend: --batch-size 2 --anchors 16 --max-len 256" in err, err
        assert ", whole vocabulary, 2 steps" in err and modes == ["reference"], (err, modes)
        # --draft-vocab shipped names the shipped drafter's set, as --init shipped its weights (none for this target)
        assert main(base + ["--out", str(tmp_path / "run3"), "--steps", "1", "--draft-vocab", "shipped"]) == 2
        assert "no drafter is shipped for the target" in capsys.readouterr().err
        assert any(" 1/2 " in s and "loss=" in s for s in err.replace("\r", "\n").splitlines()), err
        assert main(base + ["--out", str(tmp_path / "run2"), "--time-budget", "0.01"]) == 2
        err = capsys.readouterr().err
        assert "error: time budget 0.01 s ended before the first step" in err, err
        assert not (tmp_path / "run2").exists()
    finally:
        mx.set_default_device(old)


def test_every_flag_has_help_and_shows_its_default():
    """Each flag of each `mlx_dflash2.train` subcommand has a help text, and the help shows its default."""
    import argparse

    from mlx_dflash2.train.cli import build_parser

    ap = build_parser()
    subs = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(subs) == {"prompts", "regen", "self-instruct", "fit", "vocab", "eval"}
    for name, p in subs.items():
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            flag = a.option_strings[0]
            assert a.help and a.help.strip(), f"{name} {flag}: no help"
            switch = a.nargs == 0  # store_true / store_false / --x/--no-x: off or on, said by the text
            if not (a.required or switch):
                shown = p.formatter_class(prog=name)._get_help_string(a)
                assert "default" in shown, f"{name} {flag}: the help does not show the default: {shown!r}"


def test_train_cli_runs_a_quantized_target_dense_on_the_cpu(tmp_path, capsys):
    """As `generate` does, the train commands expand a small quantized target to dense weights on MLX's CPU
    backend (batched quantized matmuls are many times slower there); --no-dequantize keeps it packed."""
    from convert_helpers import random_weights, tiny_config, write_hf

    from mlx_dflash2.convert import convert
    from mlx_dflash2.train.cli import main

    cfg = tiny_config()
    convert(write_hf(tmp_path / "hf", cfg, random_weights(cfg)), tmp_path / "q4", progress=False)
    assert "quantization" in json.loads((tmp_path / "q4" / "config.json").read_text())
    _patterned_data(tmp_path / "data")
    base = ["fit", "--model", str(tmp_path / "q4"), "--data", str(tmp_path / "data"), "--num-layers", "1",
            "--block-size", "6", "--selector-rank", "4", "--selector-top-k", "4", "--steps", "1"]
    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        assert main(base + ["--out", str(tmp_path / "a")]) == 0
        assert "fit: 48 sequences, dense target" in capsys.readouterr().err
        assert main(base + ["--out", str(tmp_path / "b"), "--no-dequantize"]) == 0
        assert "fit: 48 sequences, quantized target" in capsys.readouterr().err
    finally:
        mx.set_default_device(old)


def test_no_resume_replaces_the_old_run(tiny, tmp_path):
    """--no-resume starts over: once its first step is done the old checkpoints (which would count as newer
    and be resumed, or push the new ones out of keep_checkpoints) and the old log are gone."""
    target, tok = tiny
    _patterned_data(tmp_path / "data")
    Trainer(_cfg(tmp_path, steps=6, save_every=2), target, tok).fit(progress=False)
    tr = Trainer(_cfg(tmp_path, steps=2, save_every=2), target, tok)
    tr.fit(resume=False, progress=False)
    assert [p.name for p in sorted((tmp_path / "run" / "ckpt").glob("step-*"))] == ["step-0000002"]
    assert [json.loads(ln)["step"] for ln in open(tmp_path / "run" / "log.jsonl")] == [1, 2]
    again = Trainer(_cfg(tmp_path, steps=2, save_every=2), target, tok)
    assert again.resume() and again.step == 2


def test_batched_decode_runs_the_head_on_one_column(tiny):
    """Regen's prefill never asks a forward for more than one column of logits: every call but the one for the
    prompt's last column only fills the caches (their logits are never evaluated), and that one has width 1.
    (The last prefill chunk's ``(N, T, V)`` logits, sliced after the fact, ran an H100 out of memory at 1,024
    rows of long prompts, session 32.) The tokens still equal each row's solo greedy decoding."""
    from mlx_lm.generate import generate_step

    from mlx_dflash2.train.regen import batched_decode

    target, _ = tiny
    widths = []

    class Spy:
        layers = target.model.layers

        def __call__(self, x, cache=None):
            out = target.model(x, cache=cache)
            widths.append(x.shape[1])
            return out

    rng = np.random.RandomState(4)
    prompts = [rng.randint(2, 60, size=n).tolist() for n in (19, 5, 12)]
    got = batched_decode(Spy(), prompts, 6, 0.0, prefill_chunk=8, check_every=2)
    assert widths[:4] == [8, 8, 2, 1] and set(widths[4:]) == {1}  # 19 columns: 8 + 8 + 2 cached, then 1
    for p, g in zip(prompts, got):
        assert g == [t for t, _ in generate_step(mx.array(p), target.model, max_tokens=6)]
