"""Hybrid GatedDeltaNet targets (Qwen3.5, Qwen3-Next) in batched rounds (mlx_dflash2/batch.py).

Tiny random float32 checkpoints (tests/tiny_models.py: 2 GatedDeltaNet layers + 1 attention layer) with
scripted proposers whose first wrong draft visits every block offset in some rows while other rows accept
whole blocks, plain rows, requests of different prompt lengths and max_tokens joining (chunked, right-padded
beside each other) and leaving mid-way: every request's tokens equal its solo output, and after every step
every row's recurrent state and conv window (and every join's, mid-prefill) equal plain decoding's at the
row's own position (1e-5): no padding and no other row reaches a row's state. Both rollbacks: the reference
path (masked replay from the pre-verify snapshot) and the stepping route (the kept step selected per row).

Sliding-window targets (tiny Gemma 3 / Gemma 4 with windows of 8 tokens, a Mistral-style window on every
layer of a dense target) in the same scenarios, with buffers that grow by a few positions so that every
row's front is evicted, row by row, many times: every output equals its solo one; the prompt cache warm ==
cold, a prefix reused only while every window layer still holds it.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from scripted import ScriptedProposer
from test_hybrid import plain_states
from tiny_models import tiny_hybrid_dir

import mlx_dflash2.speculative as spec
from mlx_dflash2.batch import RaggedKVCache, SpeculativeBatch
from mlx_dflash2.caches import RaggedRecurrentCache, RecurrentCache, WindowKVCache
from mlx_dflash2.loading import load_target, make_proposer
from mlx_dflash2.speculative import GenerationState, SpecStats, speculative_generate_step

KINDS = ("qwen3_5", "qwen3_next")
B = 5
TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> a tiny checkpoint directory (written once)."""
    root = tmp_path_factory.mktemp("hybrid-batch")
    return {k: tiny_hybrid_dir(root / k, k) for k in KINDS}


@pytest.fixture(scope="module")
def targets(checkpoints):
    """kind -> (target, tokenizer), loaded once (the reference path: MLX's ops on the CPU)."""
    have = {}

    def get(kind):
        if kind not in have:
            target, tok, _ = load_target(str(checkpoints[kind]), dtype=mx.float32)
            have[kind] = (target, tok)
        return have[kind]

    return get


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 131 + 17 * i * i + 7 * i) % 4000 + 100 for i in range(n)]




def _assert_each_equals_solo(out, refs, spec_):
    """Every request of a :func:`_batch_run` got its solo tokens (the cancelled one a prefix of them)."""
    for k, (p, n, _, _, _) in spec_.items():
        if k == "cancelled":
            toks, reason = out[k]
            assert reason == "cancelled" and toks == refs[k][: len(toks)] and len(toks) > 1
        else:
            assert out[k] == (refs[k][:n], "length"), k

def _solo_caches(target, prompts):
    """Each prompt fed alone into a fresh cache of ``target`` (what a batch row must equal)."""
    solo = []
    for p in prompts:
        c = target.make_cache()
        target.forward(mx.array(p, mx.int32), c)
        solo.append(c)
    return solo

def _run_beside_a_neighbour(target, prop, chunk, prompt, n, state=None, keep=False):
    """One request in a batch with a neighbour joining and decoding beside it: (its tokens, its stats, its
    kept state)."""
    batch = SpeculativeBatch(target, prop, prefill_step_size=chunk)
    u = batch.add(prompt, n, state=state, keep_state=keep)
    batch.add(_prompt(11, 15), 6)
    out, stats = [], None
    while batch.active or batch.pending:
        for ev in batch.step():
            if ev.uid == u:
                out += ev.tokens
                stats = ev.stats
    return out, stats, batch.take_state(u)


def _plain(target, prompt, n):
    return [int(t) for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=n)]


def _max_diff(ours, theirs) -> float:
    return max(mx.abs(a - b).max().item() for o, t in zip(ours, theirs) for a, b in zip(o, t))


def _check_states(batch, plains, uid_key):
    """Every row's and every join's recurrent arrays equal plain decoding's at its own position."""
    lengths = batch.lengths()
    for i, r in enumerate(batch._rows):
        ours = [batch.cache[li].extract(i).cache for li in batch._recurrent]
        assert _max_diff(ours, plains[uid_key[r.uid]][lengths[i]]) <= TOL, (uid_key[r.uid], lengths[i])
    for i, j in enumerate(batch._joining):
        pos = batch._jcache[batch._recurrent[0]].positions[i]
        assert pos == j.fed
        if pos:
            ours = [batch._jcache[li].extract(i).cache for li in batch._recurrent]
            assert _max_diff(ours, plains[uid_key[j.req.uid]][pos]) <= TOL, (uid_key[j.req.uid], pos, "join")


def test_ragged_recurrent_cache_rows_match_solo_caches(checkpoints):
    """The cache alone: a right-padded masked forward (joins) leaves each row at its own last real token;
    a padded verify block then per-row trims (replay, and selection of kept steps) leave each row at its
    own kept prefix, equal to a solo RecurrentCache fed the same real tokens; rows join (fresh or from a
    solo state) and leave; extract gives a solo cache that goes on exactly."""
    target, _, _ = load_target(str(checkpoints["qwen3_5"]), dtype=mx.float32)  # its own: routed below
    rec = [i for i, k in enumerate(target.layer_kinds) if k == "recurrent"]
    prompts = [_prompt(5, 1), _prompt(2, 2), _prompt(7, 3)]
    solo = _solo_caches(target, prompts)
    caches = [RaggedRecurrentCache() if isinstance(c, RecurrentCache) else RaggedKVCache() for c in target.make_cache()]
    assert [type(c) is RaggedRecurrentCache for c in caches] == [i in rec for i in range(len(caches))]
    for c in caches:
        c.add_rows([(None, None, 0)] * 3 if isinstance(c, RaggedRecurrentCache) else [(None, None)] * 3)
        if isinstance(c, RaggedRecurrentCache):
            c.prepare([len(p) for p in prompts])
    block = mx.array([p + [0] * (7 - len(p)) for p in prompts], mx.int32)
    target._call(lambda: target.inner(block, cache=caches), ())
    for c in caches:
        if not isinstance(c, RaggedRecurrentCache):
            c.trim_rows([7 - len(p) for p in prompts])

    def same(i):
        for li in rec:
            ours, theirs = caches[li].extract(i), solo[i][li]
            assert ours.offset == theirs.offset
            assert _max_diff([ours.cache], [theirs.cache]) <= TOL, (i, li)

    assert caches[rec[0]].positions == [5, 2, 7] and caches[rec[0]].lengths is None
    for i in range(3):
        same(i)

    def verify(blocks, keep, steps):
        """A padded verify block; row i keeps keep[i] of its tokens; solo caches get the same."""
        M = max(len(b) for b in blocks)
        x = mx.array([b + [0] * (M - len(b)) for b in blocks], mx.int32)
        target._call(lambda: target.inner(x, cache=caches), ())
        for li in rec:
            assert (caches[li]._last.steps is not None) == steps
            caches[li].trim_rows([M - k for k in keep])
        for c in caches:
            if not isinstance(c, RaggedRecurrentCache):
                c.trim_rows([M - k for k in keep])
        for s, b, k in zip(solo, blocks, keep):
            target.forward(mx.array(b[:k], mx.int32), s)

    verify([[11, 12, 13], [14, 15], [16, 17, 18, 19]], [1, 2, 4], steps=False)
    for i in range(3):
        same(i)
    assert caches[rec[0]].replays == 1
    # a later trim cuts further into the same forward (a consumer stopping inside a committed round)
    for c in caches:
        c.trim_rows([0, 1, 2])
    for s, k in zip(solo, [0, 1, 2]):
        if k:
            spec.trim_cache(s, k)
    for i in range(3):
        same(i)
    with pytest.raises(ValueError, match="outside"):  # row 1 holds one more token of that forward
        caches[rec[0]].trim_rows([0, 2, 0])
    # rows leave and join: a fresh row and a solo state's row
    extra = target.make_cache()
    target.forward(mx.array(_prompt(3, 4), mx.int32), extra)
    for li, c in enumerate(caches):
        c.keep_rows([2, 0])
        if isinstance(c, RaggedRecurrentCache):
            c.add_rows([(extra[li].cache[0], extra[li].cache[1], 3)])
        else:
            c.add_rows([(extra[li].keys[..., :3, :], extra[li].values[..., :3, :])])
    solo = [solo[2], solo[0], extra]
    for i in range(3):
        same(i)
    # the stepping route (forced on the CPU: gated_delta_steps' reference) keeps every step: a selection
    assert target.route_kernels("kernel", force=True) > 0
    before = caches[rec[0]].replays
    verify([[21, 22], [23, 24, 25, 26], [27]], [2, 1, 1], steps=True)
    assert caches[rec[0]].replays == before
    for i in range(3):
        same(i)
    ex = caches[rec[0]].extract(1)
    assert isinstance(ex, RecurrentCache) and ex.offset == solo[1][rec[0]].offset
    with pytest.raises(ValueError, match="does not match"):
        caches[rec[0]].add_rows([(mx.zeros((1, 2, 3)), mx.zeros((1, 1, 1, 1)), 1)])


def _batch_run(target, tok, prefill_step_size=4, watch=None):
    """The equivalence scenario on one target (after every step: the recurrent states checked, and
    ``watch(batch)``): returns (outputs, references, the scenario, the add() arguments)."""
    V = target.vocab_rows
    spec_ = {  # key: (prompt, max_tokens, schedule or None (plain), block, join round)
        "every": (_prompt(3, 3), 16, list(range(B)), B, 0),  # first rejection at every offset, then it leaves
        "accept": (_prompt(13, 2), 23, [6], 7, 0),  # whole blocks of 6 drafts, a wider block than the others
        "reject0": (_prompt(7, 1), 14, [0], B, 0),
        "plain": (_prompt(5, 4), 12, None, 1, 1),
        "late": (_prompt(23, 5), 15, [2, 0, 4, 1, 3], B, 2),  # a long prompt: chunks between the others' rounds
        "cancelled": (_prompt(9, 6), 30, [1], B, 1),
    }
    refs, adds = {}, {}
    for k, (p, n, sch, bs, _) in spec_.items():
        refs[k] = _plain(target, p, n + bs + 1)
        prop = ScriptedProposer(len(p), refs[k], sch, bs, V) if sch is not None else None
        adds[k] = dict(prompt=p, max_tokens=n, proposer=prop, block_size=bs)
    recurrent = "recurrent" in target.layer_kinds
    plains = {k: plain_states(target, spec_[k][0] + refs[k]) for k in spec_} if recurrent else None
    batch = SpeculativeBatch(target, prefill_step_size=prefill_step_size)
    joins = {}
    for k, (_, _, _, _, rnd) in spec_.items():
        joins.setdefault(rnd, []).append(k)
    uid_key, out = {}, {k: ([], None) for k in spec_}
    for rnd in range(200):
        for k in joins.pop(rnd, []):
            uid_key[batch.add(**adds[k])] = k
        if rnd == 4:
            assert batch.cancel(next(u for u, k in uid_key.items() if k == "cancelled"))
        for ev in batch.step():
            k = uid_key[ev.uid]
            assert out[k][1] is None, k
            out[k] = (out[k][0] + ev.tokens, ev.finish_reason)
        if recurrent:
            _check_states(batch, plains, uid_key)
        if watch is not None:
            watch(batch)
        if not joins and not batch.active and not batch.pending:
            return out, refs, spec_, adds
    raise AssertionError("the batch did not finish")


@pytest.mark.parametrize("route", ["reference", "stepping"])
@pytest.mark.parametrize("kind", KINDS)
def test_hybrid_batch_equals_solo_states_every_round(checkpoints, kind, route):
    """Rows rejecting at every block offset, rows accepting whole (wider) blocks, a plain row, a long prompt
    prefilled in chunks right-padded beside the others while they decode, a cancel: every request's tokens
    equal its solo output, and after every step every row's (and every join's) recurrent state and conv
    window equal plain decoding's at its own position. ``stepping``: the GPU route forced on the CPU (each
    row's accepted step selected, no replay)."""
    target, tok, _ = load_target(str(checkpoints[kind]), dtype=mx.float32)
    if route == "stepping":
        assert target.route_kernels("kernel", force=True) > 0
    out, refs, spec_, adds = _batch_run(target, tok)
    _assert_each_equals_solo(out, refs, spec_)
    # the scripted rows saw what they were scripted for
    assert set(adds["every"]["proposer"].sessions[0].offsets) == set(range(B))
    assert set(adds["accept"]["proposer"].sessions[0].offsets) == {6}


def test_hybrid_batch_replays_or_selects(checkpoints):
    """The reference path rolls a verify back by replay; the stepping route never replays."""
    for route in ("reference", "stepping"):
        target, tok, _ = load_target(str(checkpoints["qwen3_5"]), dtype=mx.float32)
        if route == "stepping":
            target.route_kernels("kernel", force=True)
        replays = []
        orig = RaggedRecurrentCache.trim_rows

        def trim_rows(self, n, _orig=orig):
            before = self.replays
            _orig(self, n)
            replays.append(self.replays - before)

        RaggedRecurrentCache.trim_rows = trim_rows
        try:
            p = _prompt(6, 9)
            ref = _plain(target, p, 12 + B)
            batch = SpeculativeBatch(target)
            u = batch.add(p, 12, proposer=ScriptedProposer(len(p), ref, [0, 2], B, target.vocab_rows))
            batch.add(_prompt(4, 10), 8)
            got = []
            while batch.active or batch.pending:
                got += [t for ev in batch.step() if ev.uid == u for t in ev.tokens]
        finally:
            RaggedRecurrentCache.trim_rows = orig
        assert got == ref[:12]
        assert sum(replays) == 0 if route == "stepping" else sum(replays) > 0, route


@pytest.mark.parametrize("kind", KINDS)
def test_stop_inside_a_round_leaves_exactly_the_emitted_state(targets, kind):
    """An EOS inside an accepted block (a token the target really emits, declared EOS): the request stops
    right after it while its neighbour goes on; its kept state (take_state) holds exactly the emitted
    tokens but the last, its recurrent arrays equal plain decoding's there, and it goes on exactly."""
    target, _ = targets(kind)
    p, n = _prompt(8, 9), 24
    ref = _plain(target, p, n + B)
    eos = ref[6]
    k = ref.index(eos)
    batch = SpeculativeBatch(target)
    u = batch.add(p, n, proposer=ScriptedProposer(len(p), ref, [B - 1], B, target.vocab_rows), eos_token_ids=[eos],
                  keep_state=True)
    other = _prompt(4, 10)
    ref2 = _plain(target, other, 14 + B)
    u2 = batch.add(other, 14, proposer=ScriptedProposer(len(other), ref2, [0, 2], B, target.vocab_rows))
    out = {u: [], u2: []}
    while batch.active or batch.pending:
        for ev in batch.step():
            out[ev.uid] += ev.tokens
    assert out[u] == ref[: k + 1] and out[u2] == ref2[:14]
    st = batch.take_state(u)
    pos = len(p) + k
    assert st.tokens == (p + ref)[:pos] and all(c.offset == pos for c in st.cache)
    plain = plain_states(target, p + ref)
    assert _max_diff([c.cache for c in st.cache if isinstance(c, RecurrentCache)], plain[pos]) <= TOL
    nxt = target.forward(mx.array([ref[k]], mx.int32), st.cache).logits
    assert int(mx.argmax(nxt[-1]).item()) == ref[k + 1]


@pytest.mark.parametrize("kind", KINDS)
def test_seeded_sampled_hybrid_request_in_a_batch_equals_solo(targets, kind):
    """A seeded sampled request (a fresh DFlash2 drafter fused with lookup, sampled drafts verified by
    rejection sampling every round) beside greedy and other sampled rows gets exactly its solo tokens,
    logprobs and from_draft flags (its verify and draft keys advance as in the solo loop)."""
    from mlx_dflash2.api import request_sampling
    from mlx_dflash2.sampling import SamplingParams

    target, tok = targets(kind)
    prop = make_proposer("init", target, tok, "t", adaptive=False)
    p = _prompt(9, 12)
    params = SamplingParams(temp=1.0, top_k=20, seed=7)
    rs = request_sampling(params)
    solo = list(speculative_generate_step(p, target, prop, verifier=rs.verifier, max_tokens=14,
                                          draft_temperature=rs.draft_temperature, draft_key=rs.draft_key,
                                          adaptive=rs.adaptive))
    assert [t for t, _, _ in solo] != _plain(target, p, 14)  # it really sampled
    batch = SpeculativeBatch(target, prop)
    rs = request_sampling(params)
    u = batch.add(p, 14, verifier=rs.verifier, draft_temperature=rs.draft_temperature, draft_key=rs.draft_key,
                  logprobs=True)
    batch.add(_prompt(5, 13), 10)
    r2 = request_sampling(SamplingParams(temp=0.8, seed=3))
    batch.add(_prompt(12, 14), 12, verifier=r2.verifier, draft_temperature=r2.draft_temperature,
              draft_key=r2.draft_key)
    toks, lps, fd, stats = [], [], [], None
    while batch.active or batch.pending:
        for ev in batch.step():
            if ev.uid == u:
                toks += ev.tokens
                lps += ev.logprobs
                fd += ev.from_draft
                stats = ev.stats
    assert toks == [t for t, _, _ in solo]
    assert fd == [f for _, _, f in solo] and stats.drafted > 0
    for a, (_, b, _) in zip(lps, solo):
        assert mx.allclose(a, b, atol=1e-4).item()


def test_hybrid_prompt_cache_warm_equals_cold(targets, monkeypatch):
    """A batch row's kept state (recurrent snapshots every 16 prompt tokens here, its chunks ending there)
    is a prompt cache for a later join: shared prefixes at and between snapshot positions resume from the
    longest snapshot at or before them (warm == cold), a continuation of the whole request reuses all of
    it, and a batch's state serves the solo loop as well."""
    monkeypatch.setattr(spec, "SNAPSHOT_INTERVAL", 16)
    target, tok = targets("qwen3_5")
    prop = make_proposer("init", target, tok, "t", adaptive=False)
    first = [(53 * i + 7) % 4000 + 100 for i in range(70)]

    def run(prompt, n, state=None, keep=False):
        return _run_beside_a_neighbour(target, prop, 64, prompt, n, state, keep)

    cold_first, _, st = run(first, 12, keep=True)
    assert sorted(st.snapshots) == [16, 32, 48, 64]
    for shared in (32, 40, 69, 5):
        _, _, st = run(first, 12, keep=True)
        second = first[:shared] + [(shared * 13 + j) % 4000 + 100 for j in range(9)]
        warm, stats, _ = run(second, 16, state=st)
        cold, cstats, _ = run(second, 16)
        assert warm == cold, shared
        assert stats.cached_tokens == shared // 16 * 16 and cstats.cached_tokens == 0, (shared, stats.cached_tokens)
    _, _, st = run(first, 12, keep=True)
    nxt = first + cold_first + [200, 201, 202]
    warm, stats, _ = run(nxt, 8, state=st)
    assert warm == run(nxt, 8)[0] and stats.cached_tokens == len(first) + len(cold_first) - 1
    # the solo loop resumes from a batch's state (and equals its cold output)
    _, _, st = run(first, 12, keep=True)
    s2 = SpecStats()
    second = first[:40] + [7, 8, 9]
    solo_warm = [t for t, _, _ in speculative_generate_step(second, target, prop, max_tokens=10, state=st, stats=s2,
                                                             adaptive=False)]
    assert solo_warm == run(second, 10)[0] and s2.cached_tokens == 32
    # and a batch resumes from a solo state
    st = GenerationState()
    list(speculative_generate_step(first, target, prop, max_tokens=12, state=st, adaptive=False))
    warm, stats, _ = run(second, 10, state=st)
    assert warm == solo_warm and stats.cached_tokens == 32


# ---------------------------------------------------------------------------------------------------
# sliding-window targets (Gemma 3 / 4; a Mistral-style window on every layer)
# ---------------------------------------------------------------------------------------------------

WINDOW_KINDS = ("gemma3_text", "gemma4_text")


@pytest.fixture(scope="module")
def window_checkpoints(tmp_path_factory):
    """kind -> a tiny checkpoint directory with sliding layers of 8 tokens."""
    root = tmp_path_factory.mktemp("window-batch")
    return {k: tiny_hybrid_dir(root / k, k, window=8) for k in WINDOW_KINDS}


def _window_target(path, slack=8):
    """A window target whose window caches keep ``slack`` rows of rollback (the default 64 would need
    hundreds of tokens before a row's front is evicted)."""
    target, tok, _ = load_target(str(path), dtype=mx.float32)
    target.rollback = slack
    return target, tok


@pytest.mark.parametrize("kind", WINDOW_KINDS)
def test_window_batch_equals_solo_with_evictions(window_checkpoints, kind, monkeypatch):
    """Sliding-window layers (window 8) in batched rounds: the scenario above (every block offset,
    whole blocks, plain rows, chunked joins longer than the window, a cancel), with buffers growing by 8
    positions so that every row's front is evicted many times, each by its own amount: every output equals
    its solo one; every window layer holds at most window - 1 + slack rows past a growth step, and its rows'
    starts moved."""
    monkeypatch.setattr(RaggedKVCache, "step", 8)
    target, tok = _window_target(window_checkpoints[kind])
    seen = {"evicted": 0, "held": 0}

    def watch(batch):
        for c in batch.cache:
            if c.max_size is not None and c.rows:
                held = [n - s for n, s in zip(c.lengths, c.starts)]
                seen["held"] = max(seen["held"], max(held))
                seen["evicted"] = max(seen["evicted"], max(c.starts))

    out, refs, spec_, _ = _batch_run(target, tok, watch=watch)
    _assert_each_equals_solo(out, refs, spec_)
    assert seen["evicted"] >= 10 and seen["held"] <= 8 - 1 + 8 + 2 * 8, seen


def test_ragged_window_cache_masks_and_rollback(window_checkpoints, monkeypatch):
    """The window cache alone: rows of different lengths, padded verify blocks and per-row trims, with
    evictions: each row's logits equal a solo forward's (mlx_dflash2's WindowKVCache), its extract is a
    WindowKVCache that goes on exactly, and a rollback past the rows a window still holds raises."""
    monkeypatch.setattr(RaggedKVCache, "step", 8)
    target, _ = _window_target(window_checkpoints["gemma3_text"])
    kinds = target.make_cache()
    prompts = [_prompt(5, 1), _prompt(19, 2), _prompt(2, 3)]
    solo = _solo_caches(target, prompts)
    caches = SpeculativeBatch._make_caches(kinds)
    for li, c in enumerate(caches):
        if isinstance(kinds[li], WindowKVCache):
            c.add_rows([(*s[li].held(), s[li].start) for s in solo])
        else:
            c.add_rows([(s[li].keys[..., : s[li].offset, :], s[li].values[..., : s[li].offset, :]) for s in solo])
    rng = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 2, 4, 1, 6, 3]
    for r in range(12):
        widths = [1 + (rng[(r + i) % len(rng)] % 5) for i in range(3)]
        keep = [1 + (rng[(r * 2 + i) % len(rng)] % w) for i, w in enumerate(widths)]
        M = max(widths)
        blocks = [[(97 * r + 13 * i + j) % 4000 + 100 for j in range(w)] for i, w in enumerate(widths)]
        x = mx.array([b + [0] * (M - len(b)) for b in blocks], mx.int32)
        h, _ = target._call(lambda: target.inner(x, cache=caches), ())
        logits = target.logits(h)
        for i, (b, w, k) in enumerate(zip(blocks, widths, keep)):
            ref = target.forward(mx.array(b, mx.int32), solo[i]).logits
            assert mx.allclose(logits[i, :w], ref, atol=1e-4).item(), (r, i)
            spec.trim_cache(solo[i], w - k)
        for c in caches:
            c.trim_rows([M - k for k in keep])
    win = next(c for c in caches if c.max_size is not None)
    assert min(win.starts) > 0 and win.lengths == [s[0].offset for s in solo]
    ex = win.extract(1)
    # (it keeps what a WindowKVCache keeps: the window and the rollback slack)
    assert isinstance(ex, WindowKVCache) and ex.offset == win.lengths[1]
    assert ex.start == max(win.starts[1], win.lengths[1] - (win.max_size - 1 + win.slack))
    row = [c.extract(1) for c in caches]  # a single sequence's caches that go on exactly
    for t in ([4321], [77, 78, 79]):
        a = target.forward(mx.array(t, mx.int32), row).logits
        b = target.forward(mx.array(t, mx.int32), solo[1]).logits
        assert mx.allclose(a, b, atol=1e-4).item()
    x = win.lengths[1] - win.starts[1] - (8 - 1) + 1  # its next query would need a position evicted
    with pytest.raises(ValueError, match="window still holds"):
        win.trim_rows([0, x, 0])
    win.trim_rows([0, x - 1, 0])  # what it still holds: exact


def test_mistral_style_window_on_every_layer_in_a_batch(monkeypatch):
    """A dense target whose config sets a window on every layer (Mistral-style; mlx-lm's class ignores it,
    the adapter's window caches honour it): batched rows equal their solo (windowed) outputs past the
    window, with evictions."""
    import importlib

    from mlx_dflash2.target import TargetAdapter

    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
           "vocab_size": 512, "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": True,
           "sliding_window": 6}
    mod = importlib.import_module("mlx_lm.models.llama")
    mx.random.seed(3)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    target = TargetAdapter(model, cfg, rollback=8)
    assert set(target.layer_kinds) == {"window"}
    monkeypatch.setattr(RaggedKVCache, "step", 8)  # fronts evicted every few tokens
    prompts = [[(7 * i + 3 * s) % 500 + 1 for i in range(n)] for s, n in ((1, 9), (2, 3), (3, 14))]
    solo = [[t for t, _, _ in speculative_generate_step(p, target, None, max_tokens=m)]
            for p, m in zip(prompts, (30, 22, 26))]
    assert solo[0] != _plain(target, prompts[0], 30)  # the window changes the output (mlx-lm's class ignores it)
    batch = SpeculativeBatch(target, prefill_step_size=4)
    uids = [batch.add(p, m) for p, m in zip(prompts, (30, 22, 26))]
    out = {u: [] for u in uids}
    while batch.active or batch.pending:
        for ev in batch.step():
            out[ev.uid] += ev.tokens
    assert [out[u] for u in uids] == solo


@pytest.mark.parametrize("evicting", [False, True])
def test_window_prompt_cache_warm_equals_cold(window_checkpoints, evicting, monkeypatch):
    """A window target's batch row kept as a prompt cache: a later join reuses what every window layer still
    holds (else it prefills cold), warm == cold, and a continuation of the whole request reuses all of it.
    ``evicting``: 8 rows of rollback slack and buffers growing by 8 (the rows' fronts evicted), so some
    prefixes are no longer held."""
    target, tok = _window_target(window_checkpoints["gemma3_text"], slack=8 if evicting else 64)
    if evicting:
        monkeypatch.setattr(RaggedKVCache, "step", 8)
    prop = make_proposer("init", target, tok, "t", adaptive=False)
    first = [(53 * i + 7) % 4000 + 100 for i in range(40)]

    def run(prompt, n, state=None, keep=False):
        return _run_beside_a_neighbour(target, prop, 16, prompt, n, state, keep)

    cold_first, _, _ = run(first, 12)
    held = first + cold_first[:-1]  # what the kept state holds
    reused = []
    for shared in (len(held) - 3, 30, 5):
        _, _, st = run(first, 12, keep=True)
        second = held[:shared] + [(shared * 13 + j) % 4000 + 100 for j in range(9)]
        warm, stats, _ = run(second, 16, state=st)
        assert warm == run(second, 16)[0], shared
        assert stats.cached_tokens in (0, shared), (shared, stats.cached_tokens)
        reused.append(stats.cached_tokens)
    if evicting:  # 3 positions back: still held; 30 or 5: evicted
        assert reused == [len(held) - 3, 0, 0], reused
    else:  # nothing evicted (64 rows of rollback slack): every prefix reusable
        assert reused == [len(held) - 3, 30, 5], reused
    _, _, st = run(first, 12, keep=True)
    nxt = first + cold_first + [200, 201, 202]
    warm, stats, _ = run(nxt, 8, state=st)
    assert warm == run(nxt, 8)[0] and stats.cached_tokens == len(first) + len(cold_first) - 1


def test_ragged_recurrent_cache_refuses_mlx_lm_row_edits():
    """mlx-lm's ArraysCache.filter / extend / merge would edit the rows without their positions (a helper's
    note): refused with the method to use instead."""
    c = RaggedRecurrentCache()
    for call in (lambda: c.filter([0]), lambda: c.extend(RaggedRecurrentCache()),
                 lambda: RaggedRecurrentCache.merge([c])):
        with pytest.raises(NotImplementedError, match="RaggedRecurrentCache"):
            call()


def test_warm_up_on_a_hybrid_target_changes_nothing(targets):
    """The server's start-up warm-up on a hybrid target: each verify block's recurrent state rolled back whole
    (the scratch rows' record), the batch's own row untouched, its output that of plain decoding."""
    target, tok = targets("qwen3_5")
    prop = make_proposer("init", target, tok, "t", adaptive=False)
    p = _prompt(8, 21)
    batch = SpeculativeBatch(target, prop)
    u = batch.add(p, 9)
    toks = []
    for ev in batch.step():
        toks += ev.tokens
    assert batch.warm_up([2, 3], [1, B], block_size=B)["shapes"] == 4
    while batch.active or batch.pending:
        for ev in batch.step():
            assert ev.uid == u
            toks += ev.tokens
    assert toks == _plain(target, p, 9)
