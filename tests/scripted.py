"""Scripted proposers for losslessness tests (known-bugs.md "scripted drafter").

A scripted proposer knows the plain-decoding continuation and proposes it with
a deliberate error at a chosen offset each round, so tests can place the first
rejection at every block offset deterministically, independent of drafter
quality.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_dflash2.proposers import Proposal, Proposer, ProposerSession


class ScriptedProposer(Proposer):
    """Proposes ``reference`` with its first error at ``schedule[r % len]`` in round r.

    An offset ``k`` means drafts ``d_1..d_k`` are correct and ``d_{k+1}`` is
    wrong; ``k >= n`` (e.g. ``block_size - 1``) means the whole block is right
    (full acceptance, the bonus comes from the last row); ``None`` proposes
    nothing (a plain one-token round, as an adaptive schedule or a lookup
    without a match leaves it).

    Args:
        prompt_len: prompt length (to locate the anchor in ``reference``).
        reference: the plain continuation (generated tokens, first one included).
        schedule: first-error offsets per round, cycled.
        block_size: default B.
        vocab: vocabulary size (wrong token = (right + 1) % vocab).
    """

    name = "scripted"

    def __init__(self, prompt_len, reference, schedule, block_size, vocab, tap_ids=()):
        self.prompt_len, self.reference = prompt_len, list(reference)
        self.schedule, self.block_size, self.vocab = list(schedule), block_size, vocab
        self.tap_ids = tuple(tap_ids)
        self.sessions = []

    def start(self, prompt):
        s = _Session(self)
        self.sessions.append(s)
        return s


class _Session(ProposerSession):
    def __init__(self, p):
        self.p = p
        self.committed = 0
        self.rounds = 0
        self.feature_rows = 0
        self.offsets = []

    def extend(self, tokens, features):
        self.committed += len(tokens)
        if features is not None:
            assert features.shape[0] == len(tokens)
            self.feature_rows += features.shape[0]

    def propose(self, anchor, n, temperature=0.0, key=None):
        p = self.p
        g = self.committed - p.prompt_len  # index of the anchor in the generated sequence
        assert p.reference[g] == anchor, f"anchor {anchor} != reference[{g}] {p.reference[g]}"
        k = p.schedule[self.rounds % len(p.schedule)]
        self.rounds += 1
        if k is None:
            self.offsets.append(None)
            return Proposal.empty()
        right = p.reference[g + 1 : g + 1 + n]
        right += [0] * (n - len(right))
        toks = [t if i < k else ((t + 1) % p.vocab if i == k else t) for i, t in enumerate(right)]
        self.offsets.append(min(k, n))
        return Proposal(mx.array(toks, dtype=mx.int32))
