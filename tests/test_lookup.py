"""Suffix-match lookup proposals."""

import mlx.core as mx

from mlx_dflash2.lookup import SuffixIndex
from mlx_dflash2.proposers import FusedProposer, LookupProposer, Proposal, Proposer, ProposerSession


def test_longest_most_recent_match():
    idx = SuffixIndex(min_n=1, max_n=8)
    idx.extend([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    # history + [7] ends with [2, 3, 7], which occurred at indices 5..7
    m, toks = idx.propose([7], 3)
    assert (m, toks) == (3, [5, 2, 3])
    # longest suffix wins over a more recent shorter one
    m, toks = idx.propose([1], 2)
    assert m == 1 and toks == [2, 3]  # "3 1": no earlier; "1": most recent earlier occurrence at index 4


def test_no_match():
    idx = SuffixIndex(min_n=2)
    idx.extend([1, 2, 3])
    assert idx.propose([4], 5) == (0, [])
    assert idx.propose([1], 0) == (0, [])


def test_periodic_overlap_continues_period():
    idx = SuffixIndex(min_n=2, max_n=16)
    idx.extend([5, 6, 7, 5, 6])
    m, toks = idx.propose([7], 7)
    assert m == 3 and toks == [5, 6, 7, 5, 6, 7, 5]


def test_match_prefers_recent_occurrence():
    idx = SuffixIndex(min_n=2, max_n=4)
    idx.extend([1, 2, 10, 1, 2, 20, 3])
    assert idx.propose([1, 2], 1)[1] == [20]


class _Fixed(Proposer):
    tap_ids = ()
    block_size = 8
    name = "fixed"

    def __init__(self, toks):
        self.toks = toks
        self.calls = 0

    def start(self, prompt):
        p = self

        class S(ProposerSession):
            def propose(self, anchor, n, temperature=0.0, key=None):
                p.calls += 1
                return Proposal(mx.array(p.toks[:n], dtype=mx.int32))

        return S()


def test_fusion_rule():
    # 8-token match (>= 8): lookup wins whatever the drafter says
    hist = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3, 4, 5, 6, 7]
    fp = FusedProposer(_Fixed([50, 51, 52, 53]), LookupProposer())
    s = fp.start([])
    s.extend(hist, None)
    assert s.propose(8, 4).tokens.tolist() == [9, 10, 11, 12]
    assert fp.drafter.calls == 0  # the match fills the block: the drafter is not run at all
    # 6-token match: lookup wins only if the drafter agrees on the first two slots
    hist = [9, 9, 1, 2, 3, 4, 5, 6, 40, 41, 42, 0, 1, 2, 3, 4, 5]
    for drafter_toks, want in [([40, 41, 77], [40, 41, 42]), ([40, 99, 77], [40, 99, 77])]:
        fp = FusedProposer(_Fixed(drafter_toks), LookupProposer())
        s = fp.start([])
        s.extend(hist, None)
        assert s.propose(6, 3).tokens.tolist() == want
    # short match: drafter only
    fp = FusedProposer(_Fixed([70, 71]), LookupProposer())
    s = fp.start([])
    s.extend([1, 2, 3, 1, 2], None)
    assert s.propose(3, 2).tokens.tolist() == [70, 71]


def test_truncate_reindexes():
    idx = SuffixIndex(min_n=2, max_n=4)
    idx.extend([1, 2, 3, 1, 2, 9])
    idx.truncate(4)
    assert idx.tokens == [1, 2, 3, 1]
    assert idx.propose([2], 2) == (2, [3, 1])


def test_fusion_keeps_sampled_drafts_on_a_short_match():
    """A sampled draft (q given) is never swapped for lookup tokens by the agree-on-two rule (it would bias
    rejection sampling); a long match still wins (decided on the host, independent of the draft)."""

    class _Sampled(_Fixed):
        def start(self, prompt):
            p = self

            class S(ProposerSession):
                def propose(self, anchor, n, temperature=0.0, key=None):
                    p.calls += 1
                    toks = mx.array(p.toks[:n], dtype=mx.int32)
                    return Proposal(toks, toks[:, None], mx.ones((n, 1)))

            return S()

    hist = [9, 9, 1, 2, 3, 4, 5, 6, 40, 41, 42, 0, 1, 2, 3, 4, 5]  # 6-token match, drafter agrees
    fp = FusedProposer(_Sampled([40, 41, 77]), LookupProposer())
    s = fp.start([])
    s.extend(hist, None)
    assert s.propose(6, 3, temperature=0.8).tokens.tolist() == [40, 41, 77]
    hist = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3, 4, 5, 6, 7]  # 8-token match
    fp = FusedProposer(_Sampled([50, 51, 52, 53]), LookupProposer())
    s = fp.start([])
    s.extend(hist, None)
    prop = s.propose(8, 4, temperature=0.8)
    assert prop.tokens.tolist() == [9, 10, 11, 12] and prop.q is None and fp.drafter.calls == 0


# ---------------------------------------------------------------------------
# Adaptive schedule (AdaptiveSchedule + FusedProposer(schedule=...))
# ---------------------------------------------------------------------------


def test_adaptive_schedule_tries_both_arms_then_takes_the_faster_and_explores_less_the_worse_it_is():
    import pytest

    from mlx_dflash2.proposers import AdaptiveSchedule

    sch = AdaptiveSchedule(explore_every=4, decay=0.5, min_samples=1, warmup=1, settle=0, explore_run=1)
    picks = []
    for _ in range(4):  # warm-up + one measured round of each arm, drafter first
        arm = sch.choose("none")
        picks.append(arm)
        sch.record("none", arm, 4 if arm else 1, 1.0)  # drafter: 4 tok/s, the other arm 1 tok/s
    assert picks == [True, True, False, False]
    assert sch.rate("none", True) == 4.0 and sch.rate("none", False) == 1.0
    assert sch.rate("match", True) is None  # contexts are measured apart
    # the other arm measured 4x slower: one exploration in explore_every * 4 = 16 decisions (the cap)
    arms = [sch.choose("none") for _ in range(32)]
    assert arms.count(False) == 2 and arms[15] is False and arms[31] is False
    # a regime change is followed: the drafter gets slow, its rate moves, the choice flips
    for _ in range(6):
        sch.record("none", True, 4, 40.0)
    assert sch.choose("none") is False
    assert sch.summary()["none"]["other"] == 1.0
    with pytest.raises(ValueError):
        AdaptiveSchedule(explore_every=1)
    with pytest.raises(ValueError):
        AdaptiveSchedule(decay=1.0)
    with pytest.raises(ValueError):
        AdaptiveSchedule(settle=2, explore_run=2)


def _run_loop(sch, t, rounds, drafter_tokens, pipelined=True, contexts=None):
    """A fake decoding loop over a :class:`FusedProposer` session with ``sch`` (its clock reads ``t[0]``): round
    costs as on a GPU where ``pipelined``: a plain round (no drafts) costs a synchronous step (10.5 ms) first and
    second in a row and a pipelined step (6.6 ms) from the third on (``speculative_generate_step``'s run-ahead); a
    drafting round 13 ms for ``drafter_tokens(i)`` tokens. ``contexts(i)``: whether round ``i`` has a short lookup
    match (default never). Returns whether each round drafted with the drafter."""
    fp = FusedProposer(_Fixed(list(range(50, 66))), LookupProposer(block_size=4), long_match=99, short_match=99,
                       schedule=sch)
    s = fp.start([])
    s.plain_pipelined = pipelined
    fresh = iter(range(1000, 10**6))
    s.extend([next(fresh) for _ in range(4)], None)
    arms, streak = [], 0
    for i in range(rounds):
        if contexts is not None and contexts(i):
            s.extend([7, 8, 9, 7, 8], None)  # "7 8" recurs: a 2-token match for the anchor 9 below
            anchor = 9
        else:
            anchor = next(fresh)
        calls = fp.drafter.calls
        p = s.propose(anchor, 15)
        drafted = fp.drafter.calls > calls
        streak = 0 if p.n else streak + 1
        if drafted:
            dt, tokens = 0.013, drafter_tokens(i)
        elif p.n:  # a lookup round
            dt, tokens = 0.012, 1
        else:
            dt, tokens = (0.0105 if streak <= 2 or not pipelined else 0.0066), 1
        t[0] += dt
        s.verified(tokens)
        s.extend([anchor] + [next(fresh) for _ in range(tokens - 1)], None)
        arms.append(drafted)
    return arms


def test_adaptive_schedule_times_pipelined_plain_runs_by_their_steady_rounds():
    """Session 23 on the H200: measured one exploratory round at a time, the plain arm was priced at a lone
    plain round's synchronous cost (10.5 ms), not at the pipelined cost of plain rounds in a row (6.6 ms): once the
    drafter had won (good drafts early in a reply), the schedule kept drafting at ~115 tok/s where plain decoding
    ran at 150 tok/s (MT-Bench 0.82x of plain). Where plain rounds are pipelined, a plain run's first two rounds are
    held back (dropped once the run is pipelined) and explorations take four rounds in a row."""
    from mlx_dflash2.proposers import AdaptiveSchedule

    def tokens(i):  # 3 tokens per drafting round at first (230 tok/s), then 1, 2, 1, 2 (115 tok/s)
        return 3 if i < 300 else 1 + i % 2

    t = [0.0]
    arms = _run_loop(AdaptiveSchedule(clock=lambda: t[0]), t, 900, tokens)
    assert sum(arms[:300]) >= 250  # drafting while it pays
    assert sum(arms[-200:]) <= 30, sum(arms[-200:])  # then plain runs (and rare drafting explorations)
    # one round at a time (the old rule: every round measured, explorations of one round) stays with the drafter
    t = [0.0]
    old = _run_loop(AdaptiveSchedule(clock=lambda: t[0], settle=0, explore_run=1), t, 900, tokens)
    assert sum(old[-200:]) >= 150
    # where the drafter keeps paying, it keeps drafting
    t = [0.0]
    good = _run_loop(AdaptiveSchedule(clock=lambda: t[0]), t, 900, lambda i: 3)
    assert sum(good[-200:]) >= 170


def test_adaptive_schedule_measures_short_plain_runs_and_every_round_where_nothing_is_pipelined():
    """Plain rounds held back as a run's settling ones are measured after all when the run ends before its pipelined
    rounds (contexts alternating with lookup matches: no plain run gets long), so the plain arm is never left
    unmeasured; where nothing is pipelined (the CPU, a batch) every round is measured and explorations take one
    round, as before."""
    from mlx_dflash2.proposers import AdaptiveSchedule

    t = [0.0]
    sch = AdaptiveSchedule(clock=lambda: t[0])
    _run_loop(sch, t, 400, lambda i: 1, contexts=lambda i: i % 2 == 1)
    ctx = "none/pipelined"  # a pipelined request's own contexts
    assert sch.rate(ctx, False) is not None and sch.rate(ctx, True) is not None and sch.rate("none", False) is None
    assert abs(sch.rate(ctx, False) - 1 / 0.0105) < 1e-6  # lone plain rounds: their synchronous cost
    # nothing pipelined: identical choices to the old rule
    runs = []
    for kw in ({}, {"settle": 0, "explore_run": 1}):
        t = [0.0]
        runs.append(_run_loop(AdaptiveSchedule(clock=lambda: t[0], **kw), t, 600, lambda i: 1 + (i // 50) % 2,
                              pipelined=False))
    assert runs[0] == runs[1]


def test_fused_adaptive_rounds_without_the_drafter():
    """A round the schedule does not give to the drafter proposes the lookup's tokens (at most its own
    block) or nothing, and runs no drafter forward; the round's time and tokens are recorded at its verify."""
    from mlx_dflash2.proposers import AdaptiveSchedule

    t = [0.0]
    sch = AdaptiveSchedule(explore_every=8, decay=0.8, min_samples=1, warmup=0, clock=lambda: t[0], settle=0,
                           explore_run=1)  # every round measured
    sch.record("match", True, 1, 10.0)  # the drafter measured slow in both contexts
    sch.record("match", False, 1, 1.0)
    sch.record("none", True, 1, 10.0)
    sch.record("none", False, 1, 1.0)
    fp = FusedProposer(_Fixed([50, 51, 52, 53, 54, 55, 56, 57, 58, 59]), LookupProposer(block_size=4), schedule=sch)
    assert fp.name == "fixed+lookup (adaptive)"
    s = fp.start([])
    s.extend([1, 2, 3, 4, 5, 6, 9, 1, 2], None)  # [1, 2] recurs: a 2-token match, "match" context
    p = s.propose(3, 10)
    assert p.tokens.tolist() == [4, 5, 6] and p.source == "lookup"  # capped to the lookup's B - 1 = 3
    assert fp.drafter.calls == 0
    t[0] += 2.0
    s.verified(4)  # the round's verify: 4 tokens in 2 s
    s.extend([3, 4], None)
    # discounted sums (decay 0.8) of (1 tok, 1 s) and (4 tok, 2 s): 4.8 tok / 2.8 s
    assert abs(sch.rate("match", False) - 4.8 / 2.8) < 1e-9
    p = s.propose(77, 10)  # nothing matches "77": a plain step
    assert p.n == 0 and fp.drafter.calls == 0


def test_a_truncated_session_measures_its_held_plain_rounds_and_restarts_its_run():
    """A loop that stops (``truncate``: a consumer's stop, a prompt-cache reuse) ends the plain run: the rounds held
    back are measured, and the next loop's first plain rounds are settling ones again (its streak starts at 0)."""
    from mlx_dflash2.proposers import AdaptiveSchedule

    t = [0.0]
    sch = AdaptiveSchedule(min_samples=1, warmup=0, clock=lambda: t[0])
    ctx = "none/pipelined"
    sch.record(ctx, True, 1, 1.0)  # the drafter measured: the schedule now tries plain rounds
    fp = FusedProposer(_Fixed([50, 51]), LookupProposer(block_size=4), long_match=99, short_match=99, schedule=sch)
    s = fp.start([])
    s.plain_pipelined = True
    s.extend([1000, 1001], None)
    assert s.propose(1002, 3).n == 0  # plain: held back
    t[0] += 0.5
    s.verified(1)
    assert sch.rate(ctx, False) is None
    s.truncate(2)
    assert sch.rate(ctx, False) == 2.0 and s._plain_run == 0
    # a loop that ends (max_tokens) measures them too (speculative_generate_step calls end_run)
    assert s.propose(1003, 3).n == 0
    t[0] += 0.25
    s.verified(1)
    s.end_run()
    assert abs(sch.rate(ctx, False) - (0.9 * 1 + 1) / (0.9 * 0.5 + 0.25)) < 1e-9 and not s._held
