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

from .kernels.greedy_accept import greedy_accept
from .proposers import Proposal
from .sampling import SamplingParams, process_rows, rejection_sample, sparse_to_dense, target_probs
from .tree import tree_accept

__all__ = ["VerifyResult", "Verifier", "GreedyVerifier", "RejectionVerifier", "make_verifier"]


@dataclass
class VerifyResult:
    """See the module docstring. ``tokens``: int32 ``[n+1]``; ``num_accepted``:
    int32 scalar; ``logprobs``: float ``[n+1, V]``; ``rows``: for a tree draft, int32 ``[n+1]`` the verify rows
    of the kept positions (:func:`~.tree.tree_accept`: the anchor's, then the accepted path's; ``tokens`` and
    ``logprobs`` are already in that order), ``None`` for a chain (row ``i`` is position ``i``)."""

    num_accepted: mx.array
    tokens: mx.array
    logprobs: mx.array
    rows: mx.array | None = None


class Verifier:
    """Interface: ``verify(logits [n+1, V], proposal, history) -> VerifyResult``.

    ``history`` is the request's token ids so far (prompt + emitted, the anchor
    included), for verifiers whose processed distribution depends on it
    (penalties).
    """

    greedy: bool = True
    needs_history: bool = False
    trees_ok: bool = False  # whether proposals may be tree drafts (:class:`GreedyVerifier` without processors)

    def verify(self, logits: mx.array, proposal: Proposal, history: list[int] | None = None) -> VerifyResult:
        raise NotImplementedError


class GreedyVerifier(Verifier):
    """Exact-match greedy verification (temperature 0), after the request's
    logits processors (penalties, logit bias) if any.

    The comparison runs as :data:`mlx_dflash2.kernels.greedy_accept` (a fused
    kernel on a GPU, the same outputs as its MLX reference); ``kernel_mode`` is
    its kernel mode (``None``: the process default).
    """

    def __init__(self, params: SamplingParams | None = None, kernel_mode: str | None = None):
        self.params = params or SamplingParams()
        self.needs_history = self.params.needs_history
        self.kernel_mode = kernel_mode
        # tree drafts (mlx_dflash2.tree): greedy rows without logits processors (a penalty or a bias would have
        # to be applied along each branch's own history)
        self.trees_ok = not self.params.processors

    def verify(self, logits, proposal, history=None):
        if proposal.tree is not None:  # (proposed only where trees_ok: no logits processors)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            argmax = mx.argmax(logits, axis=-1).astype(mx.int32)
            a, rows = tree_accept(argmax, proposal.tokens, proposal.tree)
            return VerifyResult(a, argmax[rows], logprobs[rows], rows)
        logits = process_rows(logits, self.params, history, proposal.tokens)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        a, target = greedy_accept(logits, proposal.tokens, mode=self.kernel_mode)
        return VerifyResult(a, target, logprobs)


class RejectionVerifier(Verifier):
    """Lossless sampled verification by rejection sampling (spec §6.1).

    ``p_i`` is the processed target distribution of row ``i``
    (:mod:`~mlx_dflash2.sampling`); ``q_i`` the distribution the draft was drawn
    from: the proposal's sparse row (DFlash2 selector, sampled v1 drafts) or a
    point mass (greedy drafts, lookup). Accept ``d_i`` with probability
    ``min(1, p_i(d_i) / q_i(d_i))``; on the first rejection emit a sample of
    ``normalize(max(0, p_i - q_i))``; if all are accepted, a bonus from the last
    row. The verifier's random stream (``key``, split per round) is independent
    of the drafter's.
    """

    greedy = False

    def __init__(self, params: SamplingParams, key: mx.array):
        self.params = params
        self.key = key
        self.needs_history = params.needs_history

    def verify(self, logits, proposal, history=None):
        self.key, sub = mx.random.split(self.key)
        logits = process_rows(logits, self.params, history, proposal.tokens)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        p = target_probs(logprobs, self.params)
        q = None
        if proposal.n and proposal.q is not None:
            q = sparse_to_dense(proposal.cand_ids, proposal.q, p.shape[-1])[None]
        a, tokens = rejection_sample(p[None], proposal.tokens[None], q, sub)
        return VerifyResult(a[0], tokens[0], logprobs)


def make_verifier(params: SamplingParams, key: mx.array | None = None, kernel_mode: str | None = None) -> Verifier:
    """The verifier for a request: greedy for ``temp == 0`` (``kernel_mode``: its fused accept's kernel
    mode, :class:`GreedyVerifier`), rejection sampling otherwise."""
    if params.greedy:
        return GreedyVerifier(params, kernel_mode)
    return RejectionVerifier(params, key if key is not None else params.key())
