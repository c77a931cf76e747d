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
