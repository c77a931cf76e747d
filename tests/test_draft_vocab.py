"""Draft vocabularies (FR-Spec): the drafter proposes only a subset of ids, through an LM head of those rows;
verification is unchanged, so outputs stay exact."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import CHAT, CODE, chat_ids, plain_reference

from mlx_dflash2.batch import SpeculativeBatch
from mlx_dflash2.drafter.io import DRAFT_VOCAB_FILE, DrafterLoadError, read_draft_vocab, write_draft_vocab
from mlx_dflash2.loading import load, make_proposer, shipped_drafter_path
from mlx_dflash2.speculative import SpecStats, speculative_generate_step
from mlx_dflash2.train import cli as train_cli
from mlx_dflash2.train.vocab import draft_vocab


def _vocab(tokenizer, n: int) -> list[int]:
    """A made-up draft vocabulary: the first ``n`` ids and the end-of-turn id."""
    return list(range(n)) + [tokenizer.eos_token_id]


def _drafter(target, tokenizer, **kw):
    return make_proposer(shipped_drafter_path("smollm2-135m-instruct"), target, tokenizer, lookup=False, **kw)


def _run(target, prompt, proposer, n, **kw):
    st = SpecStats()
    toks = [int(t) for t, _, _ in speculative_generate_step(prompt, target, proposer, block_size=16, max_tokens=n,
                                                            stats=st, **kw)]
    return toks, st


def test_head_rows_are_the_heads_columns(smol_q, smol_f32):
    """Dense (float32 tied embedding) and affine-quantized (the GGUF's packed tied head) targets alike."""
    ids = mx.array([0, 5, 17, 300, 4096, 49151], dtype=mx.int32)
    for target, _ in (smol_f32, smol_q):
        h = mx.random.normal((3, 4, target.hidden_size), key=mx.random.key(1)).astype(target.dtype)
        full = target.lm_head(h)
        sub = target.head_rows(ids)(h)
        assert sub.shape == (3, 4, 6)
        assert mx.allclose(sub, full[..., ids], atol=1e-4, rtol=1e-4).item()
    for bad in ([0, 49152], [-1, 3], []):
        with pytest.raises(ValueError, match="draft vocabulary"):
            smol_f32[0].head_rows(mx.array(bad, dtype=mx.int32))


def test_head_rows_of_a_quantized_linear_head(smol_f32, monkeypatch):
    """An untied ``nn.QuantizedLinear`` head (a quantized mlx-lm checkpoint): its packed rows, scales and biases
    are gathered, and the columns equal the whole head's."""
    target = smol_f32[0]
    q = nn.QuantizedLinear.from_linear(nn.Linear(target.hidden_size, target.vocab_rows, bias=False), 64, 4)
    monkeypatch.setattr(target.lm, "lm_head", q, raising=False)
    monkeypatch.setattr(target, "_head", q)
    ids = mx.array([1, 2, 3, 100, 4095, 49151], dtype=mx.int32)
    h = mx.random.normal((5, target.hidden_size), key=mx.random.key(2))
    assert mx.allclose(target.head_rows(ids)(h), q(h)[:, ids], atol=1e-4, rtol=1e-4).item()


# the code prompt by default; the chat prompt (its drafts rejected more often: 16 s) in `make test-all`
@pytest.mark.parametrize("prompt_text", [CODE, pytest.param(CHAT, marks=pytest.mark.slow)])
def test_greedy_output_is_exact_with_a_draft_vocabulary(smol_f32, prompt_text):
    """A vocabulary that leaves out most ids (so many right tokens cannot be drafted): output still equals
    mlx-lm's plain greedy decoding; every drafted token lies within the vocabulary."""
    target, tok = smol_f32
    vocab = _vocab(tok, 3000)
    p = _drafter(target, tok, draft_vocab=vocab)
    assert p.draft_vocab_size == len(set(vocab)) and p.vocab_ids is not None
    prompt = chat_ids(tok, prompt_text)
    ref, _ = plain_reference(target, prompt, 40)
    orig = type(p).unary

    def spy(self, h):
        u = orig(self, h)
        assert u.shape[-1] == len(set(vocab))
        return u
    type(p).unary = spy
    try:
        toks, st = _run(target, prompt, p, 40)
    finally:
        type(p).unary = orig
    assert toks == ref
    assert st.rounds > 0 and st.drafted > 0
    assert st.draft_vocab == len(set(vocab)) and f"draft vocabulary {len(set(vocab)):,} ids" in st.summary()
    allowed = set(vocab)
    sess = p.start([])
    sess.extend([1, 2, 3], mx.random.normal((3, 5 * target.hidden_size)))
    seen = sess.propose(5, 15).tokens.tolist()
    assert seen and all(t in allowed for t in seen)


def test_every_valid_id_is_no_draft_vocabulary(smol_f32):
    target, tok = smol_f32
    p = _drafter(target, tok, draft_vocab=range(len(tok)))
    assert p.vocab_ids is None and p.draft_vocab_size == len(tok)
    prompt = chat_ids(tok, CODE)
    assert _run(target, prompt, p, 4)[1].draft_vocab == 0  # the whole vocabulary: not shown
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        _drafter(target, tok, draft_vocab=[3, len(tok) + 5])
    with pytest.raises(ValueError, match="at least 2"):
        _drafter(target, tok, draft_vocab=[3, 3])


def test_sampled_and_confidence_cut_proposals_keep_to_the_vocabulary(smol_f32):
    """The sampled walk's candidates and the dynamic draft length's positions map through the vocabulary."""
    target, tok = smol_f32
    vocab = _vocab(tok, 5000)
    allowed = set(vocab)
    p = _drafter(target, tok, draft_vocab=vocab, min_confidence=0.3)
    s = p.start([])
    s.extend([1, 2, 3, 4], mx.random.normal((4, 5 * target.hidden_size), key=mx.random.key(3)))
    g = s.propose(7, 15)
    assert 1 <= g.n <= 15 and all(t in allowed for t in g.tokens.tolist())
    sp = s.propose(7, 15, temperature=0.8, key=mx.random.key(4))
    assert all(t in allowed for t in sp.tokens.tolist())
    assert all(t in allowed for t in sp.cand_ids.reshape(-1).tolist())
    assert mx.allclose(sp.q.sum(-1), mx.ones(sp.q.shape[0]), atol=1e-5).item()
    # a drafted token is one of its slot's candidates, by id
    assert all(t in row for t, row in zip(sp.tokens.tolist(), sp.cand_ids.tolist()))


def test_batched_proposals_equal_solo_with_a_draft_vocabulary(smol_f32):
    target, tok = smol_f32
    p = _drafter(target, tok, draft_vocab=_vocab(tok, 4000))
    prompts = [chat_ids(tok, t) for t in (CODE, CHAT)]
    solo = [_run(target, pr, p, 12)[0] for pr in prompts]  # 3 and 8 rounds (24 tokens: 20 s)
    batch = SpeculativeBatch(target)
    uids = [batch.add(pr, 12, proposer=p, block_size=16) for pr in prompts]
    out = {u: [] for u in uids}
    while batch.active or batch.pending:
        for ev in batch.step():
            out[ev.uid] += ev.tokens
    assert [out[u] for u in uids] == solo


def test_draft_vocab_file_roundtrip_and_errors(tmp_path):
    f = write_draft_vocab(tmp_path, [5, 3, 3, 9], note="x")
    assert f.name == DRAFT_VOCAB_FILE and read_draft_vocab(tmp_path) == [3, 5, 9]
    assert json.loads(f.read_text())["note"] == "x"
    assert read_draft_vocab(tmp_path / "nothing") is None
    for bad in ("{", '{"ids": []}', '{"ids": [1, -2]}', '{"ids": [1.5]}', '[1, 2]', '{"ids": [true]}',
                '{"ids": [2]}', '{"ids": [2, 2]}',  # fewer than 2 distinct ids: refused before any loading
                '{"ids": ' + "[" * 100_000 + "]" * 100_000 + "}",  # RecursionError (a fresh user's find)
                '{"ids": [' + "9" * 5000 + "]}"):  # an int past Python's digit limit
        f.write_text(bad)
        with pytest.raises(DrafterLoadError, match="draft_vocab.json"):
            read_draft_vocab(tmp_path)
    f.write_bytes(b'{"ids": [1, \xff]}')  # not UTF-8: the file is named
    with pytest.raises(DrafterLoadError, match="draft_vocab.json"):
        read_draft_vocab(tmp_path)
    f.write_bytes(b'\xef\xbb\xbf{"ids": [4, 1]}')  # a UTF-8 byte-order mark, as Windows editors write
    assert read_draft_vocab(tmp_path) == [4, 1]
    with pytest.raises(ValueError):
        write_draft_vocab(tmp_path, [])


def test_load_reads_a_drafters_draft_vocab_and_refuses_bad_values(tmp_path, smol_f32, monkeypatch):
    import shutil

    target, tok = smol_f32
    d = tmp_path / "drafter"
    shutil.copytree(shipped_drafter_path("smollm2-135m-instruct"), d)
    write_draft_vocab(d, _vocab(tok, 1000))
    p = make_proposer(str(d), target, tok, lookup=False)
    assert p.draft_vocab_size == len(set(_vocab(tok, 1000)))
    assert make_proposer(str(d), target, tok, lookup=False, draft_vocab="full").vocab_ids is None
    assert make_proposer(str(d), target, tok, lookup=False, draft_vocab=[1, 2, 3]).draft_vocab_size == 3
    for bad in ("most", [1, -1], [], [1.5], [2.0, 17.0], {2: "a", 17: "b"}, b"ab", (i for i in range(3)),
                [2, float("inf")], [True, 3], mx.array([[1, 2]]), mx.array([1.0, 2.0])):
        with pytest.raises(ValueError, match="draft_vocab"):
            load(None, str(d), draft_vocab=bad)
    for drafter in ("lookup", "none"):  # any value given with no drafter (as --drafter-window's)
        for v in ([1, 2], "full", "auto"):
            with pytest.raises(ValueError, match="draft_vocab"):
                load(None, drafter, draft_vocab=v)
    # ids outside the target's vocabulary (another tokenizer's?) are an error naming the file, once it is known
    write_draft_vocab(d, [0, 2, 17, 49152, 100000])
    with pytest.raises(DrafterLoadError, match="draft_vocab.json.*outside the target's vocabulary"):
        make_proposer(str(d), target, tok, lookup=False)
    assert make_proposer(str(d), target, tok, lookup=False, draft_vocab="full").vocab_ids is None
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        make_proposer(str(d), target, tok, lookup=False, draft_vocab=[1, 2, 10**6])
    with pytest.raises(ValueError, match="--draft-vocab"):
        load(None, "lookup", draft_vocab=[1, 2], names="cli")
    # a malformed file fails before the target loads
    (d / DRAFT_VOCAB_FILE).write_text('{"ids": "all"}')
    monkeypatch.setattr("mlx_dflash2.loading.load_target", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(DrafterLoadError, match="draft_vocab.json"):
        load(None, str(d))
    with pytest.raises(pytest.fail.Exception, match="loaded the target"):  # full: the file is not read
        load(None, str(d), draft_vocab="full")


def test_draft_vocab_from_responses():
    rows = [{"response_ids": [7, 7, 7, 1, 2], "finish": "stop"},
            {"response_ids": [7, 3, 3, 9], "finish": "length"},  # cut at its length: 9 is no end token
            {"response_ids": [3, 4, 2], "finish": "stop"}]
    ids, info = draft_vocab(rows, 2, held_out=0.0)
    assert ids == [2, 3, 7]  # 7 and 3 by frequency, 2 ends a stopped response
    assert info["ending_ids"] == [2] and info["distinct"] == 6 and info["response_tokens"] == 12
    assert info["coverage"] == pytest.approx(9 / 12)
    # 5 % of 3 rows is no row: the coverage is the counted rows' own, and the file says so
    info = draft_vocab(rows, 2)[1]
    assert info["held_out_fraction"] == 0 and info["held_out_tokens"] == 0 and "counted rows" in info["coverage_of"]
    info = draft_vocab(rows * 20, 2)[1]
    assert info["held_out_fraction"] == 3 / 60 and info["held_out_tokens"] > 0
    assert info["coverage_of"] == "held-out rows"
    for bad in ({"size": 1}, {"size": True}, {"held_out": 0.9}):
        with pytest.raises(ValueError):
            draft_vocab(rows, **{"size": 2, **bad})
    with pytest.raises(ValueError, match="no response tokens"):
        draft_vocab([{"response_ids": []}], 2, held_out=0.0)


def test_train_vocab_command(tmp_path, capsys):
    import shutil

    data = tmp_path / "responses"
    data.mkdir()
    rows = [{"response_ids": [i % 50, (i * 7) % 50, 2], "finish": "stop"} for i in range(200)]
    (data / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = tmp_path / "drafter"
    shutil.copytree(shipped_drafter_path("smollm2-135m-instruct"), d)
    assert train_cli.main(["vocab", "--data", str(data), "--drafter", str(d), "--size", "20"]) == 2
    assert "exists (--overwrite replaces it)" in capsys.readouterr().err  # the shipped drafter's own file
    assert train_cli.main(["vocab", "--data", str(data), "--drafter", str(d), "--size", "20", "--overwrite"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ids"] == len(read_draft_vocab(d)) and 2 in read_draft_vocab(d)
    for bad in ('{"response_ids": ["a", 3]}', '{"response_ids": 5}', "not json"):  # a fresh user's finds
        (data / "shard-00001.jsonl").write_text(bad + "\n")
        assert train_cli.main(["vocab", "--data", str(data), "--drafter", str(d), "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and ("shard-00001.jsonl" in err or "response row" in err), err
    (data / "shard-00001.jsonl").unlink()
    assert train_cli.main(["vocab", "--data", str(tmp_path / "none"), "--drafter", str(d)]) == 2
    assert "no such file" in capsys.readouterr().err
    assert train_cli.main(["vocab", "--data", str(data), "--drafter", str(tmp_path)]) == 2
    assert "not a drafter directory" in capsys.readouterr().err


def test_calibration_is_keyed_by_the_draft_vocabulary(smol_f32):
    """The drafter's cost (what the adaptive schedule's calibration measures) changes with its head's rows."""
    from mlx_dflash2 import calibrate as C

    target, tok = smol_f32
    fp = {v: C.fingerprint(target, "smollm2-135m-instruct", _drafter(target, tok, draft_vocab=v))
          for v in ("full", "auto")}  # auto: the shipped drafter's own draft_vocab.json
    sub = C.fingerprint(target, "smollm2-135m-instruct", _drafter(target, tok, draft_vocab=_vocab(tok, 4000)))
    assert len({C.cache_key(f) for f in (fp["full"], fp["auto"], sub)}) == 3
    assert [f["drafter"]["draft_vocab"] for f in (fp["full"], fp["auto"], sub)] == [len(tok), 16384, 4000]
