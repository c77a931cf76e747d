"""Exact stopping inside a block: EOS, stop strings and max_tokens at every offset.

Nothing after the stop may be emitted, counted or left in the cache
(known-bugs rows 4-7). Uses the declared-EOS trick: a token the model really
produces at generated position j is declared EOS, and a scripted drafter
shifts round boundaries so that j falls at every block offset (bonus slot
included).
"""

from __future__ import annotations

import pytest

from conftest import REF_TOKENS, STORY, chat_ids, plain_reference
from mlx_dflash2.api import IncrementalDetokenizer, _StopText, stream_generate
from mlx_dflash2.loading import SpeculativeModel
from mlx_dflash2.speculative import GenerationState
from mlx_dflash2.target import cache_length
from scripted import ScriptedProposer

B = 8


@pytest.fixture(scope="module")
def story(smol_f32):
    target, tok = smol_f32
    ids = chat_ids(tok, STORY)
    ref, _ = plain_reference(target, ids, REF_TOKENS)
    return ids, ref


def _first_occurrences(ref, lo, hi):
    return [j for j in range(lo, hi) if ref[j] not in ref[:j]]


def _shift_schedule(j, offset):
    """First round accepts s drafts, then full blocks: token j lands at `offset` of its round."""
    s = (j - 2 - offset) % B
    return [s] + [B - 1] * 20


def _model(target, prop):
    return SpeculativeModel(target, prop, B, "test", target.config)


def _run_with_eos(target, tok, ids, prop, eos: int, max_tokens: int):
    """``stream_generate`` with ``eos`` declared the tokenizer's EOS (restored after): ``(responses, cache length)``."""
    saved = tok.eos_token_ids
    tok.eos_token_ids = {eos}
    state = GenerationState()
    try:
        resps = list(stream_generate(_model(target, prop), tok, ids, max_tokens=max_tokens, state=state))
    finally:
        tok.eos_token_ids = saved
    return resps, cache_length(state.cache)


@pytest.fixture(scope="module")
def eos_run(smol_f32, story):
    """``eos_run(offset)``: the story decoded with its token j (the first new one past the first block) declared
    EOS and a scripted drafter that puts j at ``offset`` of its round: ``(j, schedule, responses, cache length
    after)``. Made once per offset (deterministic) and read by the two tests below."""
    target, tok = smol_f32
    ids, ref = story
    runs = {}

    def get(offset):
        if offset not in runs:
            j = _first_occurrences(ref, B + 2, 60)[0]
            sched = _shift_schedule(j, offset)
            prop = ScriptedProposer(len(ids), ref, sched, B, target.vocab_rows)
            resps, cached = _run_with_eos(target, tok, ids, prop, ref[j], 60)
            runs[offset] = (j, sched, resps, cached)
        return runs[offset]

    return get


@pytest.mark.parametrize("offset", range(B))
def test_eos_at_every_block_offset(smol_f32, story, eos_run, offset):
    target, tok = smol_f32
    ids, ref = story
    j, sched, resps, cached = eos_run(offset)
    toks = [r.token for r in resps]
    assert toks == ref[: j + 1]
    assert resps[-1].finish_reason == "stop"
    assert resps[-1].generation_tokens == j + 1
    assert all(r.finish_reason is None for r in resps[:-1])
    text = "".join(r.text for r in resps)
    assert text == tok.decode(ref[:j])
    # nothing after the EOS in the cache: prompt + emitted[:-1]
    assert cached == len(ids) + j
    stats = resps[-1].stats
    assert stats.generated_tokens == j + 1
    assert stats.round_tokens == j  # the first token came from prefill


@pytest.mark.parametrize("offset", range(B))
def test_draft_counters_end_at_the_stop(story, eos_run, offset):
    """An EOS at every offset of an all-accepted block: drafted/accepted count only the drafts at or before
    it, and the per-position statistics agree (the drafts verified after it were counted: 14 drafted for 10
    emitted drafts, all accepted, read an acceptance rate of 0.714)."""
    ids, ref = story
    j, sched, resps, _ = eos_run(offset)  # sched: a rejection in round 1 (unless it accepts all), then full blocks
    assert [r.token for r in resps] == ref[: j + 1]
    stats = resps[-1].stats
    accepted = sum(r.from_draft for r in resps)
    rejected = B - 1 - sched[0]  # round 1 drafts B - 1 and accepts sched[0]; every later draft is right
    assert stats.accepted == accepted and stats.drafted == accepted + rejected
    assert stats.acceptance_rate == pytest.approx(accepted / (accepted + rejected))
    assert sum(stats.position_proposed) == stats.drafted and sum(stats.position_accepted) == stats.accepted
    assert sum(stats.accept_hist) == stats.rounds_by_source["drafter"] == stats.rounds
    # the stop's round counts as having drafted offset + 1 tokens (or all B - 1 on the bonus slot), all accepted
    assert stats.accept_hist[min(offset + 1, B - 1)] >= 1


@pytest.mark.parametrize("offset", range(B))
def test_stop_string_at_every_block_offset(smol_f32, story, offset):
    target, tok = smol_f32
    ids, ref = story
    # a token whose text is a word that first appears in the output at token j
    cands = []
    for j in range(B + 2, 60):
        word = tok.decode([ref[j]]).strip()
        if len(word) >= 3 and word.isalpha() and word not in tok.decode(ref[:j]) and word not in tok.decode(ref[j + 1 : j + 8]):
            cands.append((j, word))
    j, word = cands[0]
    sched = _shift_schedule(j, offset)
    prop = ScriptedProposer(len(ids), ref, sched, B, target.vocab_rows)
    resps = list(stream_generate(_model(target, prop), tok, ids, max_tokens=60, stop=[word]))
    assert [r.token for r in resps] == ref[: j + 1]
    assert resps[-1].finish_reason == "stop"
    text = "".join(r.text for r in resps)
    full = tok.decode(ref[: j + 1])
    assert text == full[: full.find(word)]
    assert word not in text


# 1 (the prefill's token only), then every offset of the first round (2..B+1) and the first and last offset of a
# later one (B+2, 2B+1); every later round is the same full block (1..40 in `make test-all`)
@pytest.mark.parametrize("max_tokens", [pytest.param(m, marks=() if m <= B + 2 or m == 2 * B + 1 else pytest.mark.slow)
                                        for m in range(1, 41)])
def test_max_tokens_exact(smol_f32, story, max_tokens):
    """max_tokens 1..2B+1 emits exactly that many tokens, with a full-acceptance drafter
    (the worst case for overshoot): a stop at every offset of a first and of a later round."""
    target, tok = smol_f32
    ids, ref = story
    prop = ScriptedProposer(len(ids), ref, [B - 1], B, target.vocab_rows)
    state = GenerationState()
    resps = list(stream_generate(_model(target, prop), tok, ids, max_tokens=max_tokens, state=state))
    assert [r.token for r in resps] == ref[:max_tokens]
    assert resps[-1].finish_reason == "length"
    assert resps[-1].generation_tokens == max_tokens
    assert resps[-1].stats.generated_tokens == max_tokens
    assert cache_length(state.cache) == len(ids) + max_tokens - 1


def test_stop_text_holdback():
    s = _StopText(["STOP", "<end>"])
    out = []
    for seg in ["Hello S", "TO", "x and <e", "nd> tail"]:
        t, stopped = s.feed(seg)
        out.append(t)
        if stopped:
            break
    assert "".join(out) == "Hello STOx and "
    assert stopped


def test_stop_string_split_across_segments():
    s = _StopText(["abc"])
    assert s.feed("xa") == ("x", False)
    assert s.feed("b") == ("", False)
    assert s.feed("cd") == ("", True)


def test_streaming_never_splits_multibyte(smol_f32):
    """Byte-level tokens of multi-byte characters fed one at a time: every
    streamed segment is whole UTF-8 and the segments concatenate to decode()."""
    target, tok = smol_f32
    text = "Café 😀 naïve — 日本語 “quoted” 🎨🤖"
    toks = tok.encode(text, add_special_tokens=False)
    assert len(toks) > len(text) // 2  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tok)
    segs = [detok.add_token(t) for t in toks] + [detok.finalize()]
    assert all("\ufffd" not in s for s in segs)
    assert "".join(segs) == text
    # a leading space is kept (mlx-lm's BPE streaming detokenizer drops it)
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode(" a canvas of stars", add_special_tokens=False)
    assert "".join(detok.add_token(t) for t in ids) + detok.finalize() == " a canvas of stars"


@pytest.mark.parametrize("B", [1, 16])
def test_context_limit_ends_cleanly(smol_f32, story, B):
    """Near the context limit the block shrinks and generation ends with 'length' (known-bugs row 15)."""
    from mlx_dflash2.target import TargetAdapter

    target, tok = smol_f32
    ids, ref = story
    limit = len(ids) + 14
    small = TargetAdapter(target.model, {**target.config, "max_position_embeddings": limit}, probe=False)
    prop = ScriptedProposer(len(ids), ref, [B - 1], B, target.vocab_rows) if B > 1 else None
    model = SpeculativeModel(small, prop, B, "t", small.config)
    state = GenerationState()
    resps = list(stream_generate(model, tok, ids, max_tokens=100, state=state))
    assert [r.token for r in resps] == ref[:15]
    assert resps[-1].finish_reason == "length"
    assert cache_length(state.cache) == limit
    with pytest.raises(ValueError, match="context"):
        list(stream_generate(SpeculativeModel(small, None, 1, "t", small.config), tok, ref[:limit] + ids, max_tokens=3))


# Plain rounds inside the speculative loop run ahead (the next one-token step queued before the current token is
# read; a drafting round drops it): schedules that mix plain rounds (None) with drafting rounds rejecting at
# several offsets, a stop at every token.
MIXED = [None, None, 3, None, B - 1, None, 0, None, None, 5]


@pytest.fixture
def run_ahead(monkeypatch):
    """Plain rounds run ahead here too (by default only on a GPU)."""
    import mlx_dflash2.speculative as spec

    monkeypatch.setattr(spec, "RUN_AHEAD", "always")


def _count_forwards(monkeypatch, target):
    """Counts the target's forwards (every one, batched or solo, runs through its ``_call``)."""
    n = {"forwards": 0}
    orig = target._call

    def call(*a, **k):
        n["forwards"] += 1
        return orig(*a, **k)

    monkeypatch.setattr(target, "_call", call)
    return n


# max_tokens m ends on token m - 1; MIXED emits tokens 1, 2 in plain rounds, 3-6 in a drafting round, 7 in a plain
# one, 8-15 in a full block: by default m ends on every round's first and last token and some between (1..14 before,
# 1..30 in `make test-all`)
RUN_AHEAD_DEFAULT = (1, 2, 3, 4, 6, 7, 8, 9, 12, 14)


@pytest.mark.parametrize("max_tokens", [pytest.param(m, marks=() if m in RUN_AHEAD_DEFAULT else pytest.mark.slow)
                                        for m in range(1, 31)])
def test_plain_rounds_run_ahead_max_tokens_exact(smol_f32, story, monkeypatch, run_ahead, max_tokens):
    """Every max_tokens inside a mix of plain and drafting rounds: exactly that many tokens, equal to plain
    decoding, and the cache holds prompt + emitted - 1 (a step queued ahead past the last token is dropped)."""
    target, tok = smol_f32
    ids, ref = story
    prop = ScriptedProposer(len(ids), ref, MIXED, B, target.vocab_rows)
    calls = _count_forwards(monkeypatch, target)
    state = GenerationState()
    resps = list(stream_generate(_model(target, prop), tok, ids, max_tokens=max_tokens, state=state))
    assert [r.token for r in resps] == ref[:max_tokens]
    assert resps[-1].generation_tokens == max_tokens
    assert cache_length(state.cache) == len(ids) + max_tokens - 1
    stats = resps[-1].stats
    # forwards: the prefill (one chunk: the prompt is shorter than prefill_step_size), one per round, and one more
    # for each drafting round that follows two plain ones or more (the step queued ahead of it was dropped)
    offs = prop.sessions[0].offsets
    dropped = sum(1 for i in range(2, len(offs)) if offs[i] is not None and offs[i - 1] is None and offs[i - 2] is None)
    assert max_tokens < 8 or dropped >= 1
    assert len(ids) < 2048 and calls["forwards"] == 1 + sum(stats.rounds_by_source.values()) + dropped


# token j of MIXED's rounds: a plain round's (1), a drafting round's first and third (3, 5), a full block's first and
# fifth (8, 12); 2, 4 and 9 (their neighbours' rounds) in `make test-all`
@pytest.mark.parametrize("j", [pytest.param(j, marks=pytest.mark.slow if j in (2, 4, 9) else ())
                               for j in (1, 2, 3, 4, 5, 8, 9, 12)])
def test_plain_rounds_run_ahead_eos_and_consumer_stop(smol_f32, story, run_ahead, j):
    """An EOS at generated token j inside the mixed schedule, and a consumer that stops reading after token j:
    nothing past j is emitted or left in the cache."""
    target, tok = smol_f32
    ids, ref = story
    k = next(i for i in range(j, 40) if ref[i] not in ref[:i])  # a first occurrence at or after j
    prop = ScriptedProposer(len(ids), ref, MIXED, B, target.vocab_rows)
    resps, cached = _run_with_eos(target, tok, ids, prop, ref[k], 40)
    assert [r.token for r in resps] == ref[: k + 1] and resps[-1].finish_reason == "stop"
    assert cached == len(ids) + k
    # the consumer stops after token j (no EOS): the generator is closed mid-round
    prop2 = ScriptedProposer(len(ids), ref, MIXED, B, target.vocab_rows)
    state2 = GenerationState()
    got = []
    for r in stream_generate(_model(target, prop2), tok, ids, max_tokens=40, state=state2):
        got.append(r.token)
        if len(got) == j + 1:
            break
    assert got == ref[: j + 1]
    assert cache_length(state2.cache) == len(ids) + j


def test_plain_rounds_do_not_run_ahead_on_the_cpu(smol_f32, story, monkeypatch):
    """By default plain rounds run ahead only on a GPU: on the CPU a dropped step would be pure loss."""
    import mlx.core as mx

    import mlx_dflash2.speculative as spec

    assert spec.RUN_AHEAD == "gpu" and mx.default_device().type == mx.cpu
    target, tok = smol_f32
    ids, ref = story
    prop = ScriptedProposer(len(ids), ref, MIXED, B, target.vocab_rows)
    calls = _count_forwards(monkeypatch, target)
    resps = list(stream_generate(_model(target, prop), tok, ids, max_tokens=12))
    assert [r.token for r in resps] == ref[:12]
    assert calls["forwards"] == 1 + sum(resps[-1].stats.rounds_by_source.values())
