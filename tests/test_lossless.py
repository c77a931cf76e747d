"""Losslessness of the speculative loop on the real embedded model.

float32 (dense, dequantized) target: speculative greedy output must be
token-identical to mlx-lm's own plain greedy generation. Quantized (Q4_1)
target: a divergence is allowed only where plain decoding's top-2 logits are
within a small tolerance (batched verify vs one-row decode numerics).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from conftest import LONG_REF, PROMPTS, REF_TOKENS, STORY, chat_ids, plain_reference
from mlx_dflash2.drafter import init_drafter
from mlx_dflash2.proposers import DFlashProposer, FusedProposer, LookupProposer
from mlx_dflash2.speculative import GenerationState, SpecStats, speculative_generate_step
from mlx_dflash2.target import cache_length
from scripted import ScriptedProposer

BLOCKS = [2, 4, 8, 16]
N_REAL = 20  # tokens per (prompt, B) with the fresh DFlash2 drafter


def run(target, prompt, proposer, B, n, stats=None, state=None):
    return [
        t
        for t, _, _ in speculative_generate_step(
            prompt, target, proposer, block_size=B, max_tokens=n, stats=stats, state=state
        )
    ]


SHORT_REF = 32  # a run made for asks of up to this many tokens


class _Refs:
    """mlx-lm's plain greedy continuations of the test prompts, made on first use (``refs[name]``: 48 tokens,
    enough for most tests; ``refs.get(name, n)``: ``n``; ``refs.long(name)``: 140). A run is made
    :data:`SHORT_REF`, :data:`conftest.REF_TOKENS` or :data:`conftest.LONG_REF` tokens long and kept for the
    session (``conftest.plain_reference``), so the growing asks of the scripted cells (4, 11, 37 tokens) and
    other modules' asks of the same prompts share it (the default suite asks at most 30 tokens of the chat and
    math prompts: 32-token runs, not 64)."""

    def __init__(self, target, tok):
        self.target, self.tok = target, tok

    def get(self, name, n):
        ids = chat_ids(self.tok, {**PROMPTS, "story": STORY}[name])
        size = SHORT_REF if n <= SHORT_REF else REF_TOKENS if n <= REF_TOKENS else max(n, LONG_REF)
        return ids, plain_reference(self.target, ids, size)[0]

    def __getitem__(self, name):
        return self.get(name, 48)

    def long(self, name):
        return self.get(name, LONG_REF)


@pytest.fixture(scope="module")
def refs(smol_f32):
    return _Refs(*smol_f32)


@pytest.fixture(scope="module")
def fresh_dflash2(smol_f32):
    target, tok = smol_f32
    return init_drafter(target, tok, num_layers=2, block_size=16, seed=3)


N_QUANT = 32  # tokens of the packed target's reference of the code prompt (about 3x dearer per token than dense)


def test_plain_loop_equals_mlx_lm(smol_q):
    """Our loop without a drafter (pipelined plain path) == mlx-lm generate_step, quantized target (on the code
    prompt, whose reference test_quantized_diverges_only_at_near_ties shares)."""
    target, tok = smol_q
    ids = chat_ids(tok, PROMPTS["code"])
    ref, _ = plain_reference(target, ids, 16, at_least=N_QUANT)
    assert run(target, ids, None, 1, 16) == ref


# the narrowest block and the drafter's own (16); every block size and every prompt in `make test-all` (fresh
# drafters at B = 4 and 8 stay in the default run below: the padded-vocabulary, other-variants and prompt-cache tests)
FRESH_DEFAULT = {("chat", 2), ("code", 16)}
FRESH_CASES = [pytest.param(n, B, marks=() if (n, B) in FRESH_DEFAULT else pytest.mark.slow)
               for n in PROMPTS for B in BLOCKS]


@pytest.mark.parametrize("name,B", FRESH_CASES)
def test_fresh_dflash2_f32_identical(smol_f32, refs, fresh_dflash2, name, B):
    """Real drafter path (fresh DFlash2 + lookup fusion): token-identical in float32."""
    target, tok = smol_f32
    ids, ref = refs.get(name, N_REAL)
    prop = FusedProposer(DFlashProposer(fresh_dflash2, target, len(tok)), LookupProposer(block_size=16))
    stats = SpecStats()
    state = GenerationState()
    out = run(target, ids, prop, B, N_REAL, stats, state)
    assert out == ref[:N_REAL]
    assert stats.drafted > 0 and stats.rounds > 0
    # exact commit: cache holds prompt + emitted[:-1]; the drafter context covers the same positions
    assert cache_length(state.cache) == len(ids) + len(out) - 1
    assert state.session.d.ctx.offset == len(ids) + len(out) - 1


# every block size, each on one prompt, by default (B = 16: 137 tokens); every prompt at every B in `make test-all`
SCRIPTED_DEFAULT = {("chat", 2), ("math", 4), ("story", 8), ("code", 16)}


@pytest.mark.parametrize("name,B", [pytest.param(n, B, marks=() if (n, B) in SCRIPTED_DEFAULT else pytest.mark.slow)
                                    for n in list(PROMPTS) + ["story"] for B in BLOCKS])
def test_scripted_rejection_at_every_offset_f32(smol_f32, refs, name, B):
    """First rejection at every block offset 0..B-2, plus full acceptance (offset B-1)."""
    target, tok = smol_f32
    schedule = list(range(B))  # one cycle visits every offset
    n = B * (B + 1) // 2 + 1  # exactly one full cycle of rounds
    ids, ref = refs.get(name, n)
    prop = ScriptedProposer(len(ids), ref, schedule, B, target.vocab_rows, tap_ids=(3, 10))
    stats = SpecStats()
    out = run(target, ids, prop, B, n, stats)
    assert out == ref[:n]
    sess = prop.sessions[0]
    assert sess.offsets == [min(k, B - 1) for k in schedule][: len(sess.offsets)]
    assert sorted(set(sess.offsets)) == list(range(B))
    # every round accepted exactly its scripted offset
    assert stats.accept_hist == [1] * B
    # tap features arrived for every committed token
    assert sess.feature_rows == sess.committed


@pytest.mark.parametrize("B", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_quantized_diverges_only_at_near_ties(smol_q, B):
    """Q4_1 target: speculative == plain except possibly at a near-tie of plain's top-2 logits."""
    target, tok = smol_q
    ids = chat_ids(tok, PROMPTS["code"])
    n = N_QUANT
    ref, lps = plain_reference(target, ids, n)
    schedule = list(range(B))
    prop = ScriptedProposer(len(ids), ref, schedule, B, target.vocab_rows)
    out = []
    try:
        for t, _, _ in speculative_generate_step(ids, target, prop, block_size=B, max_tokens=n):
            out.append(t)
    except AssertionError:
        pass  # the scripted proposer noticed a divergence (checked below)
    if out == ref[: len(out)] and len(out) == n:
        return
    i = next(i for i, (a, b) in enumerate(zip(out, ref)) if a != b)
    top2 = mx.sort(lps[i])[-2:]
    gap = (top2[1] - top2[0]).item()
    assert gap < 1e-2, f"divergence at token {i} with a top-2 logit gap of {gap}"


def test_lookup_repeats_paragraph(smol_f32):
    """--drafter lookup on a prompt that repeats text: tau > 1.5, output identical."""
    target, tok = smol_f32
    para = (
        "The old lighthouse stood at the edge of the cliff, its white paint peeling in the salty wind. "
        "Every night the keeper climbed the spiral stairs to light the lamp for the passing ships."
    )
    ids = chat_ids(tok, f"Repeat this paragraph exactly, word for word:\n\n{para}")
    n = 48
    ref, _ = plain_reference(target, ids, n)
    stats = SpecStats()
    out = run(target, ids, LookupProposer(block_size=8), 8, n, stats)
    assert out == ref
    assert stats.tau > 1.5, stats.summary()


def _fresh_from_dict(target, tok, **over):
    from mlx_dflash2.drafter import DrafterConfig, DraftModel

    base = init_drafter(target, tok, num_layers=2, block_size=8, selector_rank=8).config.to_dict()
    base.update(over)
    m = DraftModel(DrafterConfig.from_dict(base))
    m.init_weights(seed=11)
    return m


@pytest.mark.parametrize(
    "over",
    [
        {"architectures": ["DFlashDraftModel"]},
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8, "is_causal": None},
    ],
    ids=["dflash_v1", "dflash2_sliding"],
)
def test_other_drafter_variants_f32_identical(smol_f32, refs, over):
    target, tok = smol_f32
    ids, ref = refs["code"]
    m = _fresh_from_dict(target, tok, **over)
    out = run(target, ids, DFlashProposer(m, target, len(tok)), 8, 20)  # 20 rounds (a random drafter's)
    assert out == ref[:20]


@pytest.mark.parametrize("B", [1, pytest.param(4, marks=pytest.mark.slow), pytest.param(16, marks=pytest.mark.slow)])
def test_streamed_text_identical_across_block_sizes(smol_f32, fresh_dflash2, B):
    """Streamed segments are whole UTF-8 and concatenate to the same text for every B (known-bugs row 7)."""
    import mlx_dflash2
    from mlx_dflash2.loading import SpeculativeModel

    target, tok = smol_f32
    prompt = "Reply with five emoji, then the Japanese word for cat in Japanese script, then the French word for coffee."
    ids = chat_ids(tok, prompt)
    prop = DFlashProposer(fresh_dflash2, target, len(tok))
    model = SpeculativeModel(target, prop, B, "t", target.config)
    resps = list(mlx_dflash2.stream_generate(model, tok, ids, max_tokens=40))
    toks = [r.token for r in resps if r.token not in tok.eos_token_ids]
    text = "".join(r.text for r in resps)
    assert text == tok.decode(toks)
    ref, _ = plain_reference(target, ids, 40)
    assert toks == [t for t in ref[: len(resps)] if t not in tok.eos_token_ids]
    if "\ufffd" not in tok.decode(toks):  # the model itself may emit invalid bytes; then decode() shows them too
        assert all("\ufffd" not in r.text for r in resps)


def test_prompt_cache_reuse_warm_equals_cold(smol_f32, fresh_dflash2):
    """A multi-turn conversation reuses the target KV and drafter context of the shared prefix."""
    target, tok = smol_f32
    prop = FusedProposer(DFlashProposer(fresh_dflash2, target, len(tok)), LookupProposer(block_size=16))
    msgs = [{"role": "user", "content": "Name a fruit."}]
    p1 = tok.apply_chat_template(msgs, add_generation_prompt=True)
    state = GenerationState()
    o1 = run(target, p1, prop, 8, 12, state=state)
    assert state.tokens == (p1 + o1)[:-1] and cache_length(state.cache) == len(state.tokens)
    msgs += [{"role": "assistant", "content": tok.decode(o1)}, {"role": "user", "content": "And a vegetable?"}]
    p2 = tok.apply_chat_template(msgs, add_generation_prompt=True)
    stats = SpecStats()
    warm = run(target, p2, prop, 8, 10, stats=stats, state=state)  # 10 tokens (16 before)
    cold = run(target, p2, prop, 8, 10)
    assert warm == cold == plain_reference(target, p2, 10)[0]
    assert state.reused == stats.cached_tokens > len(p1)
    assert state.session.d.ctx.offset == cache_length(state.cache) == len(p2) + len(warm) - 1
    # an unrelated prompt reuses (almost) nothing and is still right
    p3 = chat_ids(tok, "Count to five.")
    assert run(target, p3, prop, 8, 10, state=state) == plain_reference(target, p3, 10)[0]
    assert state.reused < 40


@pytest.fixture(scope="module")
def shipped(smol_f32):
    from mlx_dflash2.loading import make_proposer

    target, tok = smol_f32
    return make_proposer("shipped", target, tok, "smollm2-135m-instruct")


# B = 16 (its trained block size) on the code prompt; the rest in `make test-all`
@pytest.mark.parametrize("name,B", [pytest.param(n, B, marks=() if (n, B) == ("code", 16) else pytest.mark.slow)
                                    for n in PROMPTS for B in (4, 16)])
def test_shipped_trained_drafter_f32_identical(smol_f32, refs, shipped, name, B):
    """The trained DFlash2 drafter shipped in the package (4-bit, fused with lookup): float32 greedy
    output token-identical to plain decoding, and it does accept drafts (it is trained, not noise)."""
    target, tok = smol_f32
    ids, ref = refs[name]
    stats = SpecStats()
    out = run(target, ids, shipped, B, 48, stats)
    assert out == ref[:48]
    assert stats.tau > 1.2, stats.tau


@pytest.mark.parametrize("name", ["code", pytest.param("story", marks=pytest.mark.slow)])
def test_adaptive_schedule_f32_identical_while_it_switches(smol_f32, refs, shipped, name):
    """The adaptive schedule (the default of `--drafter auto`) over the shipped drafter, with a scripted
    clock that makes drafter rounds cheap for a while and then 50x dearer: the schedule drafts, then stops
    drafting (lookup / plain rounds), and float32 greedy output stays token-identical throughout."""
    from mlx_dflash2.proposers import AdaptiveSchedule

    target, _ = smol_f32
    ids, ref = refs.long(name)  # 80 tokens used
    clock = {"t": 0.0, "drafter_cost": 0.1, "calls": 0}

    def now():  # called at the start and at the commit of each scheduled round: 1 s per round
        clock["t"] += 0.5
        clock["calls"] += 1
        if clock["calls"] == 24:  # after 12 rounds the drafter becomes 50x dearer than a round
            clock["drafter_cost"] = 50.0
        return clock["t"]

    sch = AdaptiveSchedule(explore_every=4, min_samples=1, warmup=0, clock=now)
    prop = FusedProposer(shipped.drafter, LookupProposer(block_size=8), schedule=sch)
    inner = prop.drafter.start  # charge the scripted cost whenever a drafter forward runs

    class Timed:
        def __init__(self, s):
            self.s = s

        def __getattr__(self, k):
            return getattr(self.s, k)

        def propose(self, *a, **kw):
            clock["t"] += clock["drafter_cost"]
            return self.s.propose(*a, **kw)

    prop.drafter = type("D", (), {"start": lambda self, prompt: Timed(inner(prompt)),
                                  "block_size": shipped.drafter.block_size, "tap_ids": shipped.drafter.tap_ids,
                                  "name": "shipped", "min_confidence": 0.0,
                                  "check_block_size": lambda self, b: None})()

    stats = SpecStats()
    # 80 tokens (120 before): 13 drafter rounds, then 22 of the schedule's own plain / lookup rounds here
    assert run(target, ids, prop, 16, 80, stats) == ref[:80]
    src = stats.rounds_by_source
    skipped = sch._seen.get(("none", False), 0) + sch._seen.get(("match", False), 0)  # the schedule's own
    assert src.get("drafter", 0) >= 3 and skipped >= 10, (src, sch._seen)


def test_block_past_trained_size_warns_once_and_stays_lossless(smol_f32, refs, fresh_dflash2, caplog):
    """B = 24 with a drafter trained at B = 16: one logged warning for the drafter, output still identical."""
    target, tok = smol_f32
    ids, ref = refs["code"]
    prop = DFlashProposer(fresh_dflash2, target, len(tok))
    with caplog.at_level("WARNING", logger="mlx_dflash2"):
        for n in (16, 8):  # a second run (8 tokens: the warning is about the run, not its length) warns no more
            assert run(target, ids, prop, 24, n) == ref[:n]
    msgs = [r.getMessage() for r in caplog.records if "trained block size" in r.getMessage()]
    assert len(msgs) == 1 and "block size 24" in msgs[0], msgs


# 0.05 cuts the fresh drafter's blocks to 1-3 drafts, 0.5 to one every round (in `make test-all`)
@pytest.mark.parametrize("conf", [0.05, pytest.param(0.5, marks=pytest.mark.slow)])
def test_dynamic_draft_length_f32_identical(smol_f32, refs, fresh_dflash2, conf):
    """min_confidence cuts drafts short (a fresh drafter is rarely confident): still token-identical."""
    target, tok = smol_f32
    ids, ref = refs.get("math", 30)
    prop = FusedProposer(DFlashProposer(fresh_dflash2, target, len(tok), min_confidence=conf),
                         LookupProposer(block_size=16))
    stats = SpecStats()
    assert run(target, ids, prop, 16, 30, stats) == ref[:30]
    assert 0 < stats.drafted < stats.rounds * 15  # some blocks were cut


def test_dynamic_draft_length_padded_to_the_cheapest_width_f32_identical(smol_f32, refs, fresh_dflash2):
    """With a calibration where 16 rows cost less than 4-15 (the 2-core CPU's 1.5B), a draft cut to 3 is verified
    at 16 rows instead (cuts to 1-2 drafts stay: 2-3 rows are cheaper still), and the output is unchanged. The fresh
    drafter's cuts keep 1-3 drafts, so without the calibration no round verifies 16 rows. (Chains: a tree draft's
    cut counts nodes, test_tree.py.)"""
    from mlx_dflash2.calibrate import VerifyCosts

    target, tok = smol_f32
    ids, ref = refs.get("math", 30)
    widths = []
    for costs in (None, VerifyCosts({1: 0.48, 2: 0.59, 3: 0.70, 4: 0.85, 6: 0.88, 8: 0.91, 12: 1.47, 16: 0.75})):
        dp = DFlashProposer(fresh_dflash2, target, len(tok), min_confidence=0.05, trees=False)
        dp.verify_costs = costs
        stats = SpecStats()
        assert run(target, ids, dp, 16, 30, stats) == ref[:30]
        widths.append(stats.verify_widths)
    assert max(widths[0]) <= 4 and 16 in widths[1], widths
    # 4 rows only where max_tokens left fewer than 15 drafts (16 rows out of reach); nothing between 5 and 15
    assert not any(4 < m < 16 for m in widths[1]) and widths[1].get(4, 0) < widths[0][4], widths


def test_padded_draft_length_only_where_the_request_is_adaptive(smol_f32, fresh_dflash2):
    """The padding reads a measured table, so it runs only in an adaptive session: a seeded sampled request
    (``adaptive=False``) keeps its plain cut whatever the calibration (same seed, same output), as does a row of a
    batch of several (``_propose_rows`` never pads; a lone drafting row of such a batch must not either). A
    ``FusedProposer``'s session hands its ``adaptive`` to its drafter's."""
    from mlx_dflash2.calibrate import VerifyCosts

    target, tok = smol_f32
    ids = chat_ids(tok, PROMPTS["chat"])
    dp = DFlashProposer(fresh_dflash2, target, len(tok), min_confidence=0.05)
    dp.verify_costs = VerifyCosts({1: 1.0, 2: 2.0, 4: 4.0, 8: 6.0, 16: 0.5})  # 16 rows cheapest: every cut padded
    s = dp.start(ids)
    s.extend(ids, target.forward(mx.array(ids, mx.int32), target.make_cache(), dp.tap_ids).features)
    for temp in (0.0, 0.8):
        s.adaptive = False
        cut = s.propose(ids[-1], 15, temp, mx.random.key(3))
        s.adaptive = True
        padded = s.propose(ids[-1], 15, temp, mx.random.key(3))
        assert cut.n < padded.n == 15 and padded.tokens[: cut.n].tolist() == cut.tokens.tolist(), (cut.n, padded.n)
        if temp > 0:
            assert padded.q.shape[0] == padded.cand_ids.shape[0] == 15
    fused = FusedProposer(dp, LookupProposer(block_size=16)).start(ids)
    fused.adaptive = False
    assert fused.d.adaptive is False and fused.adaptive is False


def test_dynamic_draft_length_is_a_prefix(smol_f32, fresh_dflash2):
    """The cut keeps a prefix of the full proposal (same key), with its own q rows intact."""
    target, tok = smol_f32
    ids = chat_ids(tok, PROMPTS["chat"])
    full, cut = (DFlashProposer(fresh_dflash2, target, len(tok), min_confidence=c) for c in (0.0, 0.3))
    sessions = []
    for p in (full, cut):
        s = p.start(ids)
        s.extend(ids, target.forward(mx.array(ids, mx.int32), target.make_cache(), p.tap_ids).features)
        sessions.append(s)
    for temp in (0.0, 0.8):
        a = sessions[0].propose(ids[-1], 15, temp, mx.random.key(7))
        b = sessions[1].propose(ids[-1], 15, temp, mx.random.key(7))
        assert 1 <= b.n < a.n == 15
        assert b.tokens.tolist() == a.tokens[: b.n].tolist()
        if temp > 0:
            assert mx.allclose(b.q, a.q[: b.n]).item() and b.cand_ids.tolist() == a.cand_ids[: b.n].tolist()
    with pytest.raises(ValueError, match="min_confidence"):
        DFlashProposer(fresh_dflash2, target, len(tok), min_confidence=1.0)


def test_padded_vocabulary_never_emitted_and_lossless(padded_dir):
    """A Qwen-style target (embedding and head padded past the tokenizer, padding rows that win an unmasked
    argmax): plain and speculative decoding, greedy and sampled, never emit an id >= len(tokenizer), the
    padding ids' log-probabilities are -inf, the drafter never proposes them, speculative greedy output equals
    plain (a full-acceptance scripted drafter verifies every row) and regen's batched decoder keeps out of
    them too (it emitted a padding id at 40 of 40 greedy tokens here before the mask)."""
    from mlx_dflash2.api import stream_generate
    from mlx_dflash2.loading import SpeculativeModel, load_target
    from mlx_dflash2.train.regen import batched_decode

    target, tok, _ = load_target(str(padded_dir))
    V = len(tok)
    assert target.vocab_rows > V and target.vocab_size == V
    ids = chat_ids(tok, STORY)
    n = 40
    plain = [(t, lp) for t, lp, _ in speculative_generate_step(ids, target, None, max_tokens=n)]
    toks = [t for t, _ in plain]
    assert max(toks) < V
    for _, lp in plain[:3]:
        assert mx.all(lp[V:] == -mx.inf).item() and abs(mx.logsumexp(lp[:V]).item()) < 1e-4
    drafter = DFlashProposer(init_drafter(target, tok, num_layers=1, block_size=4, selector_rank=8, seed=1), target,
                             valid_vocab=10**9)  # the target's vocab_size bounds the drafts by itself
    s = drafter.start(ids)
    s.extend(ids, target.forward(mx.array(ids), target.make_cache(), drafter.tap_ids).features)
    for a in toks[:8]:
        assert max(s.propose(a, 3).tokens.tolist()) < V
        assert max(s.propose(a, 3, temperature=1.0, key=mx.random.key(a)).tokens.tolist()) < V
    assert run(target, ids, drafter, 4, n) == toks
    full = ScriptedProposer(len(ids), toks, [3], 4, V)
    stats = SpecStats()
    assert run(target, ids, full, 4, n, stats=stats) == toks
    assert stats.accepted == stats.drafted > 20
    model = SpeculativeModel(target, drafter, 4, "padded", target.config)
    for proposer, seed in ((None, 0), (drafter, 1), (None, 2), (drafter, 3)):
        sampled = [r.token for r in stream_generate(model, tok, ids, max_tokens=n, temp=1.0, seed=seed,
                                                    block_size=4 if proposer else 1)]
        assert len(sampled) == n and max(sampled) < V, (proposer, seed)
    mx.random.seed(0)
    for temp in (0.0, 1.0):
        (out,) = batched_decode(target.model, [ids], 24, temp, vocab_size=target.vocab_size)
        assert max(out) < V, temp
