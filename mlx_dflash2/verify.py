"""Verification: decide how much of a draft the target accepts.

The loop runs the target on ``[anchor, d_1..d_n]`` and hands the ``n + 1``
logit rows to a verifier (row ``i`` is the target's distribution for the token
after position ``i``). The verifier returns, as device arrays (no host sync):

* ``num_accepted`` = ``a`` in ``0..n``;
* ``tokens`` ``[n + 1]`` whose first ``a + 1`` entries are emitted: the
  accepted drafts ``d_1..d_a`` and then the correction (on rejection) or the
  bonus token (all accepted);
* ``logprobs`` ``[n + 1, V]``: the target's log-probabilities of each row, for
  the emitted tokens' ``logprobs``.

Greedy verification (DFlash2 spec §2.3): ``a`` is the longest prefix with
``d_i == argmax(row_{i-1})`` and the emitted tokens are exactly the target's
argmaxes ``argmax(row_0..row_a)``. A rejection-sampling verifier (spec §6.1)
implements the same interface using the proposal's ``q``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .proposers import Proposal

__all__ = ["VerifyResult", "Verifier", "GreedyVerifier"]


@dataclass
class VerifyResult:
    """See the module docstring. ``tokens``: int32 ``[n+1]``; ``num_accepted``:
    int32 scalar; ``logprobs``: float ``[n+1, V]``."""

    num_accepted: mx.array
    tokens: mx.array
    logprobs: mx.array


class Verifier:
    """Interface: ``verify(logits [n+1, V], proposal, history) -> VerifyResult``.

    ``history`` is the request's token ids so far (prompt + emitted, the anchor
    included), for verifiers whose processed distribution depends on it
    (penalties).
    """

    greedy: bool = True

    def verify(self, logits: mx.array, proposal: Proposal, history: list[int] | None = None) -> VerifyResult:
        raise NotImplementedError


class GreedyVerifier(Verifier):
    """Exact-match greedy verification (temperature 0)."""

    def verify(self, logits, proposal, history=None):
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        target = mx.argmax(logits, axis=-1).astype(mx.int32)
        if proposal.n == 0:
            return VerifyResult(mx.array(0, dtype=mx.int32), target, logprobs)
        match = (proposal.tokens.astype(mx.int32) == target[:-1]).astype(mx.int32)
        a = mx.cumprod(match).sum()
        return VerifyResult(a, target, logprobs)
