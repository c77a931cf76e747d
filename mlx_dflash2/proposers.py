"""Proposers: what the speculative loop asks for a draft each round.

A :class:`Proposer` is shared by requests (it holds weights); each request gets
its own :class:`ProposerSession` (its drafter context, its token history), so
requests never read each other's state. Every round the loop calls
``session.propose(anchor, n)`` and, after verification, ``session.extend``
with the newly *committed* tokens and their target tap features.

A :class:`Proposal` carries the draft tokens and the distribution ``q`` each
was drawn from: ``None`` means a point mass on the drafted token (greedy
drafts, lookup copies), otherwise ``q`` is sparse over ``cand_ids`` (the
DFlash2 selector's realised row, spec §5.7 and §6.1).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from .drafter.model import DEFAULT_CONTEXT_WINDOW, DraftContext, DraftModel, top_k_ids
from .lookup import SuffixIndex
from .tree import graft

if TYPE_CHECKING:
    from .tree import DraftTree

logger = logging.getLogger("mlx_dflash2")

__all__ = [
    "Proposal",
    "DraftCall",
    "Proposer",
    "ProposerSession",
    "DFlashProposer",
    "LookupProposer",
    "FusedProposer",
    "AdaptiveSchedule",
    "WidthPolicy",
    "confident_length",
    "check_confidence",
    "sample_top_k",
]


def check_drafter_window(value, name: str = "drafter_window") -> int:
    """Validate a drafter context window: an integer >= 0 (0 = unbounded).

    Raises:
        ValueError: anything else.
    """
    import operator

    try:
        v = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        v = None
    if v is None or v < 0:
        raise ValueError(f"{name} must be an integer >= 0 (0 = unbounded), got {value!r}")
    return v


def check_confidence(value, name: str = "draft_confidence") -> float | None:
    """Validate a dynamic-draft-length threshold: ``None`` or a number in ``[0, 1)``.

    Raises:
        ValueError: anything else (named ``name``).
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


@dataclass
class Proposal:
    """Draft tokens and their proposal distribution.

    Attributes:
        tokens: int32 ``[n]`` draft ids ``d_1..d_n`` (``n`` may be 0).
        cand_ids: int32 ``[n, K]`` ids where ``q`` is non-zero, or ``None``.
        q: float32 ``[n, K]`` probabilities over ``cand_ids``, or ``None`` for
            point masses on ``tokens``.
        source: what made it, for the statistics: ``"drafter"`` (a drafter
            forward ran), ``"lookup"`` (copied from the history) or ``""``
            (unspecified, e.g. a custom proposer: counted as ``"drafter"``).
        tree: a :class:`~.tree.DraftTree` when ``tokens`` are the nodes of a tree draft (greedy only: ``q`` is
            ``None``), or ``None`` for a chain ``d_1..d_n``.
    """

    tokens: mx.array
    cand_ids: mx.array | None = None
    q: mx.array | None = None
    source: str = ""
    tree: DraftTree | None = None

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def empty() -> "Proposal":
        return Proposal(mx.zeros((0,), dtype=mx.int32))

    def sparse(self) -> tuple[mx.array, mx.array]:
        """``(cand_ids, q)`` with point masses written as one-hot sparse rows."""
        if self.q is not None:
            return self.cand_ids, self.q
        return self.tokens[:, None], mx.ones((self.n, 1), dtype=mx.float32)


#: candidates per slot of a DFlash v1 sampled draft (:func:`sample_top_k`)
V1_TOP_K = 16


def sample_top_k(unary: mx.array, temperature: float, key: mx.array | None, k: int = V1_TOP_K) -> Proposal:
    """A DFlash v1 sampled draft: per slot, a sample of the top-``k`` truncated softmax of ``unary``
    ``[n, V]`` at ``temperature`` (a valid ``q``, spec §6.3), drawn with ``key`` (the global random state
    if ``None``).

    The candidates are in ascending id order, as the DFlash2 selector's
    (:meth:`~.drafter.model.CandidateSelector.candidates`): the draws are indexed by a candidate's
    position, and ``argpartition``'s own order moves with the last bits of scores anywhere in the row,
    so a seeded request's draft would depend on whether its drafter forward ran alone or batched."""
    cand = mx.sort(top_k_ids(unary, k), axis=-1).astype(mx.int32)
    logits = mx.take_along_axis(unary, cand, axis=-1).astype(mx.float32) / temperature
    q = mx.softmax(logits, axis=-1)
    idx = mx.random.categorical(logits, key=key)
    return Proposal(mx.take_along_axis(cand, idx[:, None], axis=-1)[:, 0], cand, q, "drafter")


@dataclass
class DraftCall:
    """A drafter forward one request's proposal needs (:meth:`ProposerSession.begin`): ``session``'s
    proposal of ``n`` tokens after ``anchor`` (draft temperature, random key), then ``finish`` of that
    proposal (the asking session's own use of it, e.g. the fused lookup rule; default: itself)."""

    session: "_DFlashSession"
    anchor: int
    n: int
    temperature: float = 0.0
    key: mx.array | None = None
    finish: object = None

    @property
    def proposer(self) -> "DFlashProposer":
        return self.session.p

    def done(self, prop: Proposal) -> Proposal:
        return prop if self.finish is None else self.finish(prop)


#: lookup tokens grafted into a tree draft (:class:`FusedProposer`; at most half the tree, rounded up): exact
#: replay on Qwen2.5-Coder-1.5B gave the same tau with 6 or 8 and less with 10 or 15 (``benchmarks/tree_sim.py``)
GRAFT_TOKENS = 8

PLAIN_RUN_AHEAD_AFTER = 2
"""Plain rounds in a row after which ``speculative_generate_step`` queues the next plain step ahead of its host read
(on a GPU, greedy verifiers): the rounds up to this one cost a synchronous step, the later ones a pipelined one
(:class:`AdaptiveSchedule`'s ``settle``)."""


class ProposerSession:
    """Per-request proposer state (base class: proposes nothing).

    ``adaptive``: whether a proposer's adaptive schedule may choose this
    request's rounds (set by the loop; sessions without a schedule ignore it).
    ``plain_pipelined``: whether the loop queues plain rounds ahead from the
    second in a row on (``speculative_generate_step`` on a GPU with a greedy
    verifier; set by the loop, read by an adaptive schedule's timing).
    ``trees``: whether proposals may be tree drafts (:mod:`~mlx_dflash2.tree`; set by the solo loop for a
    greedy request without logits processors on a :attr:`~.target.TargetAdapter.tree_capable` target, read by
    DFlash2 drafter sessions whose proposer has ``trees``).
    """

    adaptive: bool = True
    plain_pipelined: bool = False
    trees: bool = False

    def end_run(self) -> None:
        """The loop stopped (whatever the reason): a session that times its rounds settles its bookkeeping."""

    def extend(self, tokens: list[int], features: mx.array | None) -> None:
        """Commit tokens (positions ``offset..``) and their tap features ``[len, k*D]``."""

    def propose(self, anchor: int, n: int, temperature: float = 0.0, key: mx.array | None = None) -> Proposal:
        """Propose up to ``n`` tokens to follow ``anchor`` (not yet committed)."""
        return Proposal.empty()

    def begin(self, anchor: int, n: int, temperature: float = 0.0,
              key: mx.array | None = None) -> "Proposal | DraftCall":
        """:meth:`propose` in two halves, for a batch that runs the drafter forwards of many requests
        as one (:meth:`DFlashProposer.propose_many`): either the proposal itself, or a
        :class:`DraftCall` (the drafter forward this proposal needs; ``call.finish`` of the drafter's
        proposal is then this session's proposal, exactly what :meth:`propose` returns). Default: the
        proposal (:meth:`propose`)."""
        return self.propose(anchor, n, temperature, key)

    @property
    def drafter_session(self) -> "_DFlashSession | None":
        """The DFlash session whose queued context appends a batch may run together with other
        requests' (:meth:`DFlashProposer.flush`), or ``None``."""
        return None

    def verified(self, tokens: int) -> None:
        """The round proposed last has been verified and will emit ``tokens``
        (accepted drafts + the correction/bonus token); called right after the
        round's host synchronisation, before the tokens are handed out."""

    def state_arrays(self) -> list[mx.array]:
        """Arrays to evaluate together with the target cache (prefill)."""
        return []

    def held_arrays(self) -> list[mx.array]:
        """Every array the session holds, as it stands (a DFlash session: its drafter context and its queued
        features, the queue not appended): what a prompt cache counts, and what evaluating frees the graphs
        of. Default: :meth:`state_arrays`."""
        return self.state_arrays()

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` committed tokens (prompt-cache reuse)."""

    def clone(self) -> "ProposerSession":
        """An independent copy of the per-request state (weights shared)."""
        return type(self)()


class Proposer:
    """Base proposer: no draft (plain decoding through the same loop).

    Attributes:
        block_size: default block size B (verify width = B).
        tap_ids: target layer ids whose features the sessions need.
        name: short label for stats.
    """

    block_size: int = 1
    tap_ids: tuple[int, ...] = ()
    name: str = "none"
    min_confidence: float = 0.0  # dynamic draft length (DFlashProposer); 0 = full blocks

    def start(self, prompt: list[int]) -> ProposerSession:
        return ProposerSession()

    def check_block_size(self, block_size: int) -> str | None:
        """A note when ``block_size`` is past what this proposer was trained for (``None``: fine).

        Logged once per proposer (a ``WARNING`` of the ``mlx_dflash2`` logger) and returned, so a
        command line can print it before generating. The output stays lossless either way.
        """
        return None


def draft_block(n: int, block_size: int) -> int:
    """Slots of a fitted drafter block for ``n >= 1`` drafts: the smallest power of two above ``n``
    (2, 4, 8, 16, ...: few distinct shapes), at most ``block_size``, at least ``n + 1``.

    >>> [draft_block(n, 16) for n in (1, 2, 3, 4, 7, 8, 15, 20)]
    [2, 4, 4, 8, 8, 16, 16, 21]
    """
    return max(n + 1, min(block_size, 1 << int(n).bit_length()))


# ----------------------------------------------------------------------------
# DFlash / DFlash2 drafter
# ----------------------------------------------------------------------------


class DFlashProposer(Proposer):
    """Block drafter (DFlash v1 or DFlash2) bound to its target.

    Args:
        model: the :class:`~.drafter.model.DraftModel`.
        target: the :class:`~.target.TargetAdapter` (embedding + LM head shared).
        valid_vocab: ids ``>=`` this are never proposed (tokenizer size;
            padded embedding rows are masked before top-k/argmax), nor ids
            ``>=`` the target's ``vocab_size``.
        min_confidence: dynamic draft length. ``0`` (default) always drafts
            the ``n`` slots asked for; ``c > 0`` stops after the first slot
            at which the drafter's cumulative confidence (product of its
            softmax probabilities of the drafted tokens so far) falls below
            ``c`` (:func:`confident_length`). A verify of fewer tokens is
            cheaper where its cost grows with its width (MLX CPU:
            ``benchmarks/profile_round.py``). Lossless, greedy and sampled:
            whether a slot is verified depends only on the slots before it
            (adaptive draft length, e.g. SpecDec++, arXiv 2405.19715); it
            costs one host synchronisation per round. With a calibration in
            :attr:`verify_costs` (:class:`~.calibrate.VerifyCosts`; set by
            :func:`~.loading.make_proposer` with the adaptive schedule's), a
            cut draft is verified at the cheapest width at or past the cut
            (:func:`padded_length`): where a verify of 16 rows costs less
            than one of 5-9 (a 2-core CPU), the drafts past the cut come back.
            Only in a request whose session is ``adaptive`` (the loop's
            ``adaptive``): not a seeded sampled one, whose output must not
            depend on a measured table, nor a row of a batch of several
            (:meth:`propose_many` leaves every row's cut as it is).
        context_window: the drafter's context window ``W`` (rows of committed
            positions it attends to; :class:`~.drafter.model.DraftContext`):
            its memory per request stays ``~W`` rows per layer whatever the
            prompt length. ``0``: unbounded (every committed position).
        fit_blocks: a proposal of ``n`` drafts runs the drafter over a block of
            :func:`draft_block` ``(n, B)`` slots (``[anchor, mask x ...]``: the
            smallest power of two above ``n``, at most ``B``) instead of all ``B``:
            a narrow round (the adaptive schedule's or a batch's width cap) then
            pays for the slots it verifies, not for ``B`` (on a compute-bound CPU
            a block of 2 slots costs ~1/8 of 16). The drafter attends within its
            block both ways, so a narrower block is a different input: with the
            shipped SmolLM2 drafter the tokens per row-round at widths 2 / 4 / 8
            were 1.418 / 1.687 / 1.708 fitted vs 1.432 / 1.677 / 1.698 whole
            (``benchmarks/bench_fit_blocks.py``), but a Qwen2.5-Coder drafter's
            slot-1 acceptance read 0.08 at a block of 4 against 0.29 at its trained
            16 (session 15), so it is off by default (``False``: always ``B``
            slots, the trained geometry, which the training's replay evaluation
            also runs). Verification stays exact either way.
        draft_vocab: ``None`` (default) or the token ids the drafter may propose (ints, any order; ids in
            ``[valid_vocab, vocab_rows)`` dropped, others checked: :func:`check_vocab_ids`): its LM head then
            computes those rows only
            (:meth:`~.target.TargetAdapter.head_rows`), and a slot whose right token lies outside
            is rejected there. A frequency-ranked draft vocabulary (FR-Spec, arXiv 2502.14856) of 16K of
            SmolLM2's 49K ids held 98 % of held-out response tokens, and the head is the largest part
            of a small drafter's forward (SmolLM2, this CPU, 15 rows: 14.0 -> 3.4 ms). Lossless: only
            which tokens are drafted changes, verification does not. A drafter directory's
            ``draft_vocab.json`` (:func:`~.drafter.io.read_draft_vocab`) is the default of
            :func:`~.loading.make_proposer`.
        trees: propose tree drafts where the request's session allows them (``trees``: greedy, no logits
            processors, a tree-capable target): the same number of verify rows as the chain, filled with the
            drafter lattice's most probable nodes (:func:`~.tree.build_tree`) instead of its greedy walk; a
            DFlash2 drafter only. On the 2-core CPU a Qwen2.5-Coder-1.5B round verified 15 tree nodes for 2.38
            tokens where the chain of 15 gave 1.93 (``benchmarks/tree_sim.py``).
    """

    def __init__(self, model: DraftModel, target, valid_vocab: int, min_confidence: float = 0.0,
                 context_window: int = DEFAULT_CONTEXT_WINDOW, fit_blocks: bool = False, draft_vocab=None,
                 trees: bool = True):
        self.fit_blocks = bool(fit_blocks)
        self.trees = bool(trees) and model.config.is_dflash2  # the lattice comes from the selector
        self.min_confidence = check_confidence(min_confidence, "min_confidence") or 0.0
        self.verify_costs = None  # a calibration: the dynamic draft length verifies the cheapest width past its cut
        self.context_window = check_drafter_window(context_window)
        self.model = model
        self.target = target
        cfg = model.config
        self.block_size = cfg.block_size
        self.tap_ids = tuple(cfg.target_layer_ids)
        self.name = cfg.architecture
        limit = min(valid_vocab, target.vocab_size)
        if cfg.is_dflash2:
            limit = min(limit, cfg.vocab_size)
        self.valid_vocab = limit
        self._invalid = None
        self._warned_block = False  # one warning per drafter for a block size past the trained one
        if limit < target.vocab_rows:
            self._invalid = mx.arange(target.vocab_rows) >= limit
            # evaluated here: a lazy array is bound to this thread's stream, and a server builds the
            # proposer on its loading thread but drafts on its worker thread
            mx.eval(self._invalid)
        self._head = target.lm_head
        self.vocab_ids = self._inv = None  # the draft vocabulary (ascending ids) and id -> its position
        if draft_vocab is not None:
            ids = check_vocab_ids(draft_vocab, limit, target.vocab_rows)
            if len(ids) < limit:
                self.vocab_ids = mx.array(ids, dtype=mx.int32)
                self._head = target.head_rows(self.vocab_ids)
                self._inv = mx.full((target.vocab_rows,), -1, dtype=mx.int32)
                self._inv[self.vocab_ids] = mx.arange(len(ids), dtype=mx.int32)
                self._invalid = None  # every kept id is valid
                mx.eval(self.vocab_ids, self._inv)

    @property
    def draft_vocab_size(self) -> int:
        """How many ids the drafter may propose (the valid vocabulary without a draft vocabulary)."""
        return int(self.vocab_ids.size) if self.vocab_ids is not None else self.valid_vocab

    def unary(self, h: mx.array) -> mx.array:
        """The drafter's unary logits on its final-normed states ``h`` ``[..., D]``: ``[..., V]`` with
        ``-inf`` at ids it must not propose, or ``[..., Vd]`` over :attr:`vocab_ids` (a draft vocabulary)."""
        unary = self.model.unary_logits(h, self._head)
        if self._invalid is not None:
            unary = mx.where(self._invalid, mx.array(-mx.inf, unary.dtype), unary)
        return unary

    def to_ids(self, idx: mx.array) -> mx.array:
        """Positions of :meth:`unary`'s last axis -> token ids (the identity without a draft vocabulary)."""
        return idx if self.vocab_ids is None else self.vocab_ids[idx]

    def to_positions(self, tokens: mx.array) -> mx.array:
        """Token ids of the draft vocabulary -> positions of :meth:`unary`'s last axis (inverse of :meth:`to_ids`)."""
        return tokens if self._inv is None else self._inv[tokens]

    def _v1_sample(self, unary: mx.array, temperature: float, key) -> Proposal:
        prop = sample_top_k(unary, temperature, key, min(V1_TOP_K, unary.shape[-1]))
        if self.vocab_ids is None:
            return prop
        return Proposal(self.to_ids(prop.tokens), self.to_ids(prop.cand_ids), prop.q, prop.source)

    def start(self, prompt: list[int]) -> "_DFlashSession":
        return _DFlashSession(self)

    def block_for(self, n: int, block_size: int) -> int:
        """Slots of the drafter block that proposes ``n`` drafts for a session of block size ``block_size``:
        :func:`draft_block` with ``fit_blocks``, else ``max(block_size, n + 1)``."""
        return draft_block(n, block_size) if self.fit_blocks else max(block_size, n + 1)

    #: a session's queued feature rows (committed positions without a proposal since: a prompt, plain rounds)
    #: are appended to its drafter context at its next proposal, or by a batch's :meth:`flush` (with every other
    #: row's queue) once they reach this many: a request that never drafts again (plain batched rounds under
    #: load) never pays for a projection, and the queue holds at most this many rows of ``taps x hidden``
    #: features (at a 27B shape, 5 taps x 5120 in bf16: 13 MB). Session 46, an H100, 8 SmolLM2 rows: the plain
    #: rounds that appended every row's 16 queued rounds took 17-29 ms against ~8 ms for the others
    flush_rows = 256

    def flush(self, sessions: list["_DFlashSession"]) -> None:
        """Append every queued context row of ``sessions`` (each with this proposer) in one projection
        (:meth:`~.drafter.model.DraftModel.context_kv` over the rows of all of them, padded, each at its
        own positions): what each session's own append (:attr:`_DFlashSession.ctx`) computes, for the
        price of one call instead of one per request."""
        todo = [d for d in dict.fromkeys(sessions) if d._pending]
        if len(todo) <= 1:
            for d in todo:
                d.ctx  # noqa: B018 - appends its queue
            return
        # [N, M, k*D], row i its m_i computed rows (the last of its S_i queued ones) then zeros: each queued piece
        # written into one zero block by a slice update (in place: one copy of the features), the same operations
        # whichever rows are shorter (a pad of the short rows only made each round's sequence of operations new:
        # issue 22, session 54, benchmarks/round_graphs.py); one write per piece, so a queue of several rounds (a
        # row back from lookup) is still a write more
        S = [sum(int(f.shape[0]) for f in d._pending) for d in todo]
        m = [d._ctx.computed_rows(k) for d, k in zip(todo, S)]
        M, ref = max(m), todo[0]._pending[0]
        x = mx.zeros((len(todo), M, ref.shape[1]), ref.dtype)
        for i, (d, k, j) in enumerate(zip(todo, S, m)):
            at = j - k  # the position in x of the piece's first row (negative: rows the window drops)
            for f in d._pending:
                n = int(f.shape[0])
                if at + n > 0:
                    x[i, max(at, 0) : at + n] = f[max(-at, 0) :]
                at += n
            d._pending = []
        offs = mx.array([d._ctx.offset + k - j for d, k, j in zip(todo, S, m)], dtype=mx.int32)
        kvs = self.model.context_kv(x, offs)  # per layer ([N, KV, M, hd], ...)
        for i, (d, k, j) in enumerate(zip(todo, S, m)):
            d._ctx.append_kv([(kk[i : i + 1, :, :j], vv[i : i + 1, :, :j]) for kk, vv in kvs], k)

    def propose_many(self, calls: list["DraftCall"]) -> list[Proposal]:
        """The proposals of ``calls`` (sessions of this proposer), each exactly what its session's
        :meth:`~_DFlashSession.propose` returns (float32: the same tokens, up to exact near-ties of the
        wider matmuls), with **one** drafter forward for all of them: their queued context rows appended
        in one projection (:meth:`flush`), the blocks ``[anchor_i, mask...]`` of every request through
        :meth:`~.drafter.model.DraftModel.forward_rows` (each at its own positions over its own context,
        the others masked), the LM head on every request's slots at once, the greedy selector walks
        batched (a sampled request walks alone with its own key), and the dynamic draft length of
        every request read with one host synchronisation. Calls of different block lengths (a request
        asking for more than ``B - 1`` drafts) run one forward per length. One call: its session's own
        :meth:`~_DFlashSession.propose` (the solo path)."""
        out: list[Proposal | None] = [None] * len(calls)
        groups: dict[int, list[int]] = {}
        for i, c in enumerate(calls):
            if c.n <= 0:
                out[i] = Proposal.empty()
            else:
                groups.setdefault(self.block_for(c.n, c.session.block_size), []).append(i)
        for B, idx in groups.items():
            if len(idx) == 1:
                c = calls[idx[0]]
                out[idx[0]] = c.session.propose(c.anchor, c.n, c.temperature, c.key)
                continue
            for i, p in zip(idx, self._propose_rows([calls[i] for i in idx], B)):
                out[i] = p
        return out

    def _propose_rows(self, calls: list["DraftCall"], B: int) -> list[Proposal]:
        model, cfg = self.model, self.model.config
        self.flush([c.session for c in calls])
        ctxs = [c.session.ctx for c in calls]
        ns = [c.n for c in calls]
        n_max = max(ns)
        blocks = mx.array([[c.anchor] + [cfg.mask_token_id] * (B - 1) for c in calls], dtype=mx.int32)
        emb = self.target.embed(blocks)
        if cfg.input_embedding_scale != 1.0:
            emb = emb * cfg.input_embedding_scale
        h = model.forward_rows(emb, ctxs, n_max + 1)[:, 1:]  # [N, n_max, D] (the last layer: slots 0..n_max only)
        unary = self.unary(h)  # [N, n_max, V or Vd]
        vids = self.vocab_ids
        anchors = mx.array([c.anchor for c in calls], dtype=mx.int32)
        greedy = [i for i, c in enumerate(calls) if not c.temperature > 0]
        props: list[Proposal | None] = [None] * len(calls)
        if cfg.is_dflash2:
            if greedy:
                g = mx.array(greedy, dtype=mx.int32) if len(greedy) < len(calls) else None
                u, hh, a = (unary, h, anchors) if g is None else (unary[g], h[g], anchors[g])
                toks = model.candidate_selector.walk(u, hh, a, 0.0, None, model.kernel_mode, vids).tokens
                for j, i in enumerate(greedy):
                    props[i] = Proposal(toks[j, : ns[i]], source="drafter")
            for i, c in enumerate(calls):
                if props[i] is None:
                    o = model.candidate_selector.walk(unary[i, : ns[i]], h[i, : ns[i]], anchors[i], c.temperature,
                                                      c.key, model.kernel_mode, vids)
                    props[i] = Proposal(o.tokens, o.cand_ids if o.q is not None else None, o.q, "drafter")
        else:
            best = self.to_ids(mx.argmax(unary, axis=-1).astype(mx.int32)) if greedy else None
            for i, c in enumerate(calls):
                if not c.temperature > 0:
                    props[i] = Proposal(best[i, : ns[i]], source="drafter")
                    continue
                props[i] = self._v1_sample(unary[i, : ns[i]], c.temperature, c.key)
        cut = [i for i in range(len(calls)) if self.min_confidence > 0 and ns[i] > 1]
        if cut:  # every request's dynamic draft length, one host synchronisation (as _cut, row by row)
            u = unary.astype(mx.float32)
            lse = mx.logsumexp(u, axis=-1)  # [N, n_max]
            keeps = mx.stack([confident_length(
                mx.take_along_axis(u[i, : ns[i]], self.to_positions(props[i].tokens)[:, None], axis=-1)[:, 0]
                - lse[i, : ns[i]],
                self.min_confidence) for i in cut]).tolist()
            for i, keep in zip(cut, keeps):
                p = props[i]
                if keep < p.n:
                    props[i] = (Proposal(p.tokens[:keep], source=p.source) if p.q is None
                                else Proposal(p.tokens[:keep], p.cand_ids[:keep], p.q[:keep], p.source))
        return props

    def check_block_size(self, block_size):
        if block_size <= self.block_size:
            return None
        note = (f"block size {block_size} exceeds the drafter's trained block size {self.block_size}: output stays "
                "lossless, but slots past the trained block are rarely accepted and cost verify time")
        if not self._warned_block:
            self._warned_block = True
            logger.warning(note)
        return note


class _DFlashSession(ProposerSession):
    """A request's drafter context. Committed features are appended lazily: :meth:`extend` queues them
    and the next use of the context (a proposal, :meth:`state_arrays`, :attr:`ctx`, a batch's
    :meth:`DFlashProposer.flush`) appends everything queued in one :meth:`~.drafter.DraftContext.append` (one
    projection for many rounds' rows: a batch whose rounds run without drafts, e.g. plain batched steps under
    load, pays nothing per round for its drafter contexts); :meth:`clone` and :meth:`truncate` keep the queue.
    A queued round's features are a view of that round's features of every row (``[N, M, k*D]``): every
    :attr:`compact_after` appends the queue is copied into one array of its own rows (:meth:`compact`), so it
    holds at most that many rounds' buffers."""

    #: queued appends (rounds) after which the queue is copied into one array (:meth:`compact`)
    compact_after = 16

    def __init__(self, p: DFlashProposer):
        self.p = p
        self._ctx = DraftContext(p.model, p.context_window)
        self._pending: list[mx.array] = []
        self._evals: list[mx.array] = []  # compacted queues not yet evaluated (take_evals)
        self.block_size = p.block_size

    @property
    def ctx(self) -> DraftContext:
        """The drafter context, with every queued feature row appended."""
        if self._pending:
            f = self._pending[0] if len(self._pending) == 1 else mx.concatenate(self._pending, axis=0)
            self._pending, self._evals = [], []  # (a compaction waiting for evaluation: appended, run with it)
            self._ctx.append(self.p.model, f)
        return self._ctx

    def extend(self, tokens, features):
        if features is None:
            raise ValueError("the DFlash drafter needs target tap features for every committed token")
        self._pending.append(features)
        if len(self._pending) >= self.compact_after:
            self.compact(evaluate=False)

    def compact(self, evaluate: bool = True) -> None:
        """Copy the queue into one array of its own rows: its views of whole rounds' features (every row's,
        ``[N, M, k*D]``) are let go once it is evaluated (the breaker helper of session 46: a finished request's
        state held ~N times the bytes its queue counts). A queue of one array is left as it is (but see ``evaluate``).

        ``evaluate``: queue its evaluation now (``mx.async_eval``); False (a committed round's compaction, from
        :meth:`extend`): leave it to the owner's next forward, which takes it with :meth:`take_evals` (a batch
        evaluates every row's with its next round: an evaluation of its own releases the GIL, and getting it back
        beside a busy HTTP thread cost the server up to the 5 ms switch interval each time, session 47). With
        ``evaluate`` (a state being kept) a queue of one array is copied too: it may be a view of a round's features,
        or a compaction handed to the batch and not evaluated yet, a graph over the rounds' features of every row
        (the breaker helper of session 48: a state removed right after a compacting round held 8.6x its bytes)."""
        if len(self._pending) > 1 or (evaluate and self._pending):
            one = self._pending[0]  # (a queue of one: concatenated with an empty slice, a copy of its own)
            parts = self._pending if len(self._pending) > 1 else [one, one[:0]]
            self._pending = [mx.concatenate(parts, axis=0)]
            self._evals.append(self._pending[0])
        if evaluate and self._evals:  # (with any compaction still waiting for its owner's forward)
            mx.async_eval(self._evals)
            self._evals = []

    def take_evals(self) -> list[mx.array]:
        """The arrays this session built lazily for its owner to evaluate with its next forward (compacted
        queues, :meth:`compact`), handed over once (the list is cleared)."""
        out, self._evals = self._evals, []
        return out

    @property
    def drafter_session(self):
        return self

    @property
    def queued(self) -> int:
        """Feature appends queued (rounds committed since the context was last used)."""
        return len(self._pending)

    @property
    def queued_rows(self) -> int:
        """Feature rows (positions) queued."""
        return sum(int(f.shape[0]) for f in self._pending)

    @property
    def flush_due(self) -> bool:
        """Whether the queue has reached :attr:`DFlashProposer.flush_rows` rows (a batch then flushes every
        row's queue with it)."""
        return self.queued_rows >= self.p.flush_rows

    def held_arrays(self):
        return self._ctx.state_arrays() + list(self._pending)

    def begin(self, anchor, n, temperature=0.0, key=None):
        if n <= 0:
            return Proposal.empty()
        return DraftCall(self, anchor, n, temperature, key)

    def state_arrays(self):
        return self.ctx.state_arrays()

    def truncate(self, n):
        base = self._ctx.offset
        if n >= base:  # inside the queue: its rows past n are dropped, nothing appended
            keep, rows = n - base, []
            for f in self._pending:
                if keep <= 0:
                    break
                rows.append(f if int(f.shape[0]) <= keep else f[:keep])
                keep -= int(rows[-1].shape[0])
            self._pending = rows
        else:
            self._pending = []
            self._ctx.trim(base - n)

    def clone(self):
        new = _DFlashSession(self.p)
        new.block_size = self.block_size
        new._ctx = self._ctx.clone()  # the queue is shared (immutable arrays), not appended
        new._pending = list(self._pending)
        return new

    def propose(self, anchor, n, temperature=0.0, key=None):
        if n <= 0:
            return Proposal.empty()
        p, model = self.p, self.p.model
        cfg = model.config
        B = p.block_for(n, self.block_size)
        block = mx.array([anchor] + [cfg.mask_token_id] * (B - 1), dtype=mx.int32)
        emb = p.target.embed(block)[None]
        if cfg.input_embedding_scale != 1.0:
            emb = emb * cfg.input_embedding_scale
        h = model(emb, self.ctx, n + 1)[0, 1:]  # the last layer over slots 0..n only
        unary = p.unary(h)
        if p.trees and self.trees and temperature == 0 and n > 1:
            return self._tree(anchor, n, unary, h)
        if cfg.is_dflash2:
            out = model.candidate_selector.walk(unary, h, mx.array(anchor, dtype=mx.int32), temperature, key,
                                                model.kernel_mode, p.vocab_ids)
            prop = Proposal(out.tokens, out.cand_ids if out.q is not None else None, out.q, "drafter")
        elif temperature > 0:
            prop = p._v1_sample(unary, temperature, key)
        else:
            prop = Proposal(p.to_ids(mx.argmax(unary, axis=-1).astype(mx.int32)), source="drafter")
        if p.min_confidence > 0 and n > 1:
            pad = None
            # only where the request lets measured costs choose its rounds (adaptive): a seeded sampled request
            # (adaptive=False) must not depend on a calibration (its output would change with each measurement),
            # and a row of a batch of several verifies at the batch's width (its rows' cuts stand unpadded in
            # _propose_rows too)
            if p.verify_costs is not None and self.adaptive:
                context = self._ctx.offset
                pad = lambda keep, n_: padded_length(keep, n_, p.verify_costs, context)  # noqa: E731
            prop = _cut(prop, unary, p.min_confidence, p.to_positions, pad)
        return prop

    def _tree(self, anchor: int, n: int, unary: mx.array, h: mx.array) -> Proposal:
        """A tree draft of at most ``n`` nodes from the selector's lattice (:func:`~.tree.build_tree`), one host
        synchronisation (the lattice, ``n x 16 x 16`` scores). A node's confidence is its path probability: the
        selector's softmax over each slot's K candidates times the share of the slot's unary distribution those
        K hold; with a dynamic draft length (``min_confidence``) the tree keeps the nodes whose confidence is at
        least that (at least one) and, with a calibration, grows back to the cheapest verify width at or past
        that count (:func:`padded_length`), as a chain's cut does. A chain-shaped tree stays a tree (the loop
        verifies it as a chain)."""
        from .kernels.selector_walk import lattice_scores
        from .tree import build_tree

        p = self.p
        sel = p.model.candidate_selector
        cand, u, H = sel.candidates(unary[None], h[None], p.vocab_ids)
        first, edges = lattice_scores(cand, u, H, sel.predecessor_codebook, sel.successor_codebook,
                                      mx.array([anchor], dtype=mx.int32))
        mass = mx.logsumexp(u[0], axis=-1) - mx.logsumexp(unary.astype(mx.float32), axis=-1)  # [T] log share
        first = first[0] - mx.logsumexp(first[0], axis=-1, keepdims=True) + mass[0]
        edges = edges[0] - mx.logsumexp(edges[0], axis=-1, keepdims=True) + mass[1:, None, None]
        mx.eval(cand, first, edges)
        tree, nodes = build_tree(np.array(first), np.array(edges), n)
        keep = tree.n
        if p.min_confidence > 0:
            keep = max(1, sum(lp >= math.log(p.min_confidence) for lp in tree.logp))
            if p.verify_costs is not None and self.adaptive:
                keep = padded_length(keep, tree.n, p.verify_costs, self._ctx.offset)
        tree = tree.prefix(keep)
        c = np.array(cand[0])
        tokens = mx.array([int(c[t, k]) for t, k in nodes[:keep]], dtype=mx.int32)
        return Proposal(tokens, source="drafter", tree=tree)  # a chain-shaped tree is verified as a chain (the
        # loop's build), but stays a tree until then: a lookup graft (_FusedSession._fuse) may branch it


def check_vocab_ids(ids, valid_vocab: int, vocab_rows: int) -> list[int]:
    """A draft vocabulary's ids, ascending and distinct, without those in ``[valid_vocab, vocab_rows)``
    (embedding rows past the tokenizer, never proposed anyway).

    Raises:
        ValueError: an id below 0 or ``>= vocab_rows`` (not the target's: another tokenizer's vocabulary?),
            or fewer than 2 ids left."""
    ids = sorted({int(i) for i in (ids.tolist() if isinstance(ids, mx.array) else ids)})
    if ids and (ids[0] < 0 or ids[-1] >= vocab_rows):
        bad = ids[0] if ids[0] < 0 else ids[-1]
        raise ValueError(f"draft vocabulary id {bad} is outside the target's vocabulary [0, {vocab_rows}) "
                         "(made for another tokenizer?)")
    ids = [i for i in ids if i < valid_vocab]
    if len(ids) < 2:
        raise ValueError(f"the draft vocabulary holds {len(ids)} usable ids (< {valid_vocab}, the tokenizer's "
                         "size): at least 2 needed")
    return ids


def confident_length(logq: mx.array, min_confidence: float) -> mx.array:
    """How many drafted slots the dynamic draft length keeps.

    Slot 1 is always kept; slot ``i > 1`` is kept while the drafter's
    cumulative confidence in the slots *before* it, ``prod_{j<i} q_j(d_j)``,
    is ``>= min_confidence``. Whether slot ``i`` is verified thus depends only
    on ``d_1..d_{i-1}``, never on ``d_i`` itself, so a kept ``d_i`` is still
    distributed as ``q_i`` and rejection sampling stays exact (a rule that
    also looked at ``d_i`` would favour confident tokens and bias sampled
    output).

    Args:
        logq: float ``[..., n]`` log-confidence of each drafted token.
        min_confidence: the threshold ``c`` in ``(0, 1)``.

    Returns:
        int32 ``[...]`` kept lengths in ``1..n``.
    """
    prefix = mx.cumsum(logq, axis=-1)[..., :-1]  # log prod_{j<=i} for i = 1..n-1: gates slot i+1
    return (1 + mx.sum(prefix >= math.log(min_confidence), axis=-1)).astype(mx.int32)


def padded_length(keep: int, n: int, costs, context: int | None = None) -> int:
    """How many of ``n`` drafts a round verifies once the dynamic draft length kept ``keep`` of them: the count
    in ``keep..n`` whose verify (``count + 1`` target rows) costs least by ``costs``, the longest among equal
    costs. Where a verify's cost does not grow with its width this gives back drafts the cut dropped, for free:
    on the 2-core CPU a Qwen2.5-Coder-1.5B verify of 5-9 rows costs 1.8-1.9 plain steps and one of 16 rows 1.5
    (the BLAS kernel's native panel is 16 rows; narrower products take its slow edge path,
    ``benchmarks/README.md``, session 41), and the cut at confidence 0.05 had verified 4-9 rows in most rounds.
    Verifying more drafts never emits fewer tokens, so the cheapest width at or past the cut dominates.

    Lossless as the cut itself: the count depends on ``keep`` (the confidences of the drafts before the cut),
    the calibration and the context, never on the drafts it gives back.

    Args:
        keep: drafts the cut kept (``1..n``).
        n: drafts proposed.
        costs: a :class:`~.calibrate.VerifyCosts` (``verify(m, context)`` in seconds: measured widths, linear
            between them), or ``None``: ``keep`` unchanged.
        context: tokens in the target's cache the verify rows attend to (``None``: the calibration's own).

    Returns:
        The number of drafts to verify, ``keep..n``.
    """
    if costs is None or keep >= n:
        return keep
    best, best_t = keep, costs.verify(keep + 1, context)
    for k in sorted({n} | {m - 1 for m in costs.verify_s if keep + 1 < m <= n + 1}):
        t = costs.verify(k + 1, context)
        if t <= best_t:
            best, best_t = k, t
    return best


def _cut(prop: Proposal, unary: mx.array, min_confidence: float, positions=None, pad=None) -> Proposal:
    """``prop`` cut to :func:`confident_length` slots, the confidence of a slot
    being the unary softmax probability of its drafted token; one host
    synchronisation. ``positions``: token ids -> positions of ``unary``'s last axis (a draft vocabulary);
    ``pad``: ``(keep, n) -> count`` (:func:`padded_length`), drafts given back where a wider verify costs no more."""
    u = unary.astype(mx.float32)
    pos = prop.tokens if positions is None else positions(prop.tokens)
    logq = mx.take_along_axis(u, pos[:, None], axis=-1)[:, 0] - mx.logsumexp(u, axis=-1)
    keep = int(confident_length(logq, min_confidence).item())
    if pad is not None:
        keep = pad(keep, prop.n)
    if keep >= prop.n:
        return prop
    if prop.q is None:
        return Proposal(prop.tokens[:keep], source=prop.source)
    return Proposal(prop.tokens[:keep], prop.cand_ids[:keep], prop.q[:keep], prop.source)


# ----------------------------------------------------------------------------
# Lookup and fusion
# ----------------------------------------------------------------------------


class LookupProposer(Proposer):
    """Lookup drafting alone (``--drafter lookup``): no weights, no features.

    Args:
        block_size: default block size B.
        min_match / max_match: suffix lengths tried (tokens).
    """

    name = "lookup"

    def __init__(self, block_size: int = 8, min_match: int = 2, max_match: int = 16):
        self.block_size = block_size
        self.min_match, self.max_match = min_match, max_match

    def start(self, prompt):
        return _LookupSession(self)


class _LookupSession(ProposerSession):
    def __init__(self, p: LookupProposer):
        self.index = SuffixIndex(p.min_match, p.max_match)

    def extend(self, tokens, features):
        self.index.extend(tokens)

    def truncate(self, n):
        self.index.truncate(n)

    def clone(self):
        new = _LookupSession.__new__(_LookupSession)
        new.index = self.index.clone()
        return new

    def match(self, anchor: int, n: int) -> tuple[int, list[int]]:
        return self.index.propose([anchor], n)

    def propose(self, anchor, n, temperature=0.0, key=None):
        _, toks = self.match(anchor, n)
        return Proposal(mx.array(toks, dtype=mx.int32), source="lookup") if toks else Proposal.empty()


class WidthPolicy:
    """How many tokens a round verifies, from calibrated costs and the acceptance measured so far.

    A round that proposes ``n`` tokens emits ``1 + sum_{i<=n} c_i`` tokens on average, ``c_i`` being the
    probability that drafts ``1..i`` are all accepted, and costs ``T(n+1)`` (a target forward of ``n + 1``
    rows) plus, for a drafter round, ``D(n)`` (its proposal): ``costs``, a calibration of this machine
    (:class:`~.calibrate.VerifyCosts`). :meth:`choose` returns the ``n`` of ``0..n_max`` with the most tokens
    per second, among the measured widths (``n + 1`` measured), ``n_max`` itself and ``0`` (a plain step,
    ``1 / T(1)``: no proposal is verified, and the kind's counts are only discounted, so its estimate drifts
    back to the prior and it is tried again after a while). The cost curve need not
    be monotone (on the H200 a verify of 4 rows costs more than one of 16; on a 2-core CPU 12 more than
    16), so no width is taken for granted, and 16 is verified only where it pays. Nor is it the same at every
    context: a verify row attends to every cached key, and on MLX's CPU backend ``T(16)/T(1)`` read 1.8 after
    128 tokens but 2.9 after 1K, so a width chosen from short-context costs overpaid at 8K (the default ran at
    0.78x of plain decoding there, ``benchmarks/README.md``); the loop passes the round's ``context`` (tokens
    in the cache), and the costs are read at it (:meth:`~.calibrate.VerifyCosts.verify`).

    Each *kind* of proposal has its own acceptance: ``"drafter"`` (a drafter round, its proposal cost
    included), ``"lookup"`` (a long lookup match, which wins without a drafter forward) and
    ``"lookup-short"`` (a short match the schedule gave a round to). ``c_i`` is a product of conditional
    rates ``p_j = P(d_j accepted | d_1..d_{j-1} accepted)``, each estimated from the rounds that verified
    position ``j`` after accepting ``j - 1`` drafts: discounted counts (every round recorded for the kind
    multiplies its counts by ``decay``) plus ``prior_weight`` pseudo-rounds at the estimate of ``p_{j-1}``
    (at the kind's prior for ``j = 1``). A position not verified for a while (narrower blocks were chosen)
    thus falls back on its neighbour's rate: a geometric tail, not a stale number.

    Lossless by construction: the width depends only on rounds already verified, never on the draft.

    Args:
        costs: the calibration (``verify(m)`` and ``drafter(n)`` in seconds).
        priors: acceptance rate of position 1 before any round, per kind (in ``(0, 1)``; a kind not named
            takes ``"drafter"``'s); default :attr:`PRIORS`.
        prior_weight: pseudo-rounds of each position's prior (> 0).
        decay: discount of a kind's counts per recorded round, in ``(0, 1)``.

    Raises:
        ValueError: a prior, ``prior_weight`` or ``decay`` out of range.
    """

    PRIORS = {"drafter": 0.6, "lookup": 0.9, "lookup-short": 0.6}

    def __init__(self, costs, priors: dict | None = None, prior_weight: float = 2.0, decay: float = 0.95):
        self.priors = {**self.PRIORS, **(priors or {})}
        if not all(isinstance(v, (int, float)) and 0.0 < v < 1.0 for v in self.priors.values()) \
                or not prior_weight > 0 or not 0.0 < decay < 1.0:
            raise ValueError("0 < every prior < 1, prior_weight > 0 and 0 < decay < 1 are required")
        self.costs = costs
        self.prior_weight, self.decay = float(prior_weight), float(decay)
        # per kind: [hits, trials]; hits[j] = discounted rounds that accepted position j + 1 having verified
        # it after a full prefix, trials[j] = discounted rounds that verified position j + 1 after a full prefix
        self._counts: dict[str, tuple[list[float], list[float]]] = {}

    def acceptance(self, n: int, kind: str = "drafter") -> list[float]:
        """``[c_1..c_n]``: the estimated probability that proposals ``1..i`` of ``kind`` are all accepted."""
        hits, trials = self._counts.get(kind, ([], []))
        out, c, p = [], 1.0, self.priors.get(kind, self.priors["drafter"])
        for j in range(n):
            h = hits[j] if j < len(hits) else 0.0
            t = trials[j] if j < len(trials) else 0.0
            p = (h + self.prior_weight * p) / (t + self.prior_weight)
            c *= p
            out.append(c)
        return out

    def rate(self, n: int, kind: str = "drafter", c: list[float] | None = None, context: int | None = None) -> float:
        """Estimated tokens per second of a round proposing ``n`` tokens of ``kind`` (``n = 0``: a plain step)
        after ``context`` tokens in the cache (``None``: the calibration's own short context)."""
        if n <= 0:
            return 1.0 / self.costs.verify(1, context)
        c = self.acceptance(n, kind) if c is None else c
        cost = self.costs.verify(n + 1, context) + (self.costs.drafter(n) if kind == "drafter" else 0.0)
        return (1.0 + sum(c[:n])) / cost

    def choose(self, n_max: int, kind: str = "drafter", context: int | None = None) -> int:
        """How many of the ``n_max`` tokens a round of ``kind`` may propose to verify: ``0..n_max`` (``0``:
        none, a plain step of ``T(1)`` for one token, where no width is estimated to pay), the verify rows
        attending to ``context`` cached tokens (``None``: the calibration's short context)."""
        if n_max <= 0:
            return 0
        c = self.acceptance(n_max, kind)
        cands = sorted({0, n_max} | {m - 1 for m in self.costs.verify_s if 2 <= m <= n_max + 1})
        best, best_rate = cands[0], -1.0
        for n in cands:
            r = self.rate(n, kind, c, context)
            if r > best_rate:
                best, best_rate = n, r
        return best

    def record(self, drafted: int, accepted: int, kind: str = "drafter") -> None:
        """A verified round of ``kind`` that proposed ``drafted`` tokens accepted the first ``accepted``.
        ``drafted = 0`` (the policy chose a plain step instead) only discounts the kind's counts, so its
        estimate drifts back towards the prior and the kind is tried again after a while."""
        if drafted <= 0:
            hits, trials = self._counts.get(kind, ([], []))
            for lst in (hits, trials):
                for j in range(len(lst)):
                    lst[j] *= self.decay
            return
        accepted = max(0, min(int(accepted), int(drafted)))
        reached = min(accepted + 1, drafted)  # positions 1..reached were verified after a full prefix
        hits, trials = self._counts.setdefault(kind, ([], []))
        need = max(reached, len(trials))
        for lst in (hits, trials):
            lst.extend([0.0] * (need - len(lst)))
            for j in range(len(lst)):
                lst[j] *= self.decay
        for j in range(reached):
            trials[j] += 1.0
            if j < accepted:
                hits[j] += 1.0

    def summary(self, n: int = 8, kind: str = "drafter") -> str:
        """The estimated ``c_1..c_n`` of ``kind`` as one line."""
        return " ".join(f"{x:.2f}" for x in self.acceptance(n, kind))


class AdaptiveSchedule:
    """Per-round choice between a drafter forward and a cheaper round, by measured throughput.

    On a small target, or where a wide verify costs much more than a one-token
    step (MLX's CPU backend, quantized matmuls on CPU), a drafter round can
    emit fewer tokens per second than a lookup round or a plain step even at
    a good acceptance length; on a large memory-bound target it wins by far.
    This schedule measures instead of guessing: in each *context* (``"match"``:
    the lookup has a short match; ``"none"``: it has none) it keeps
    exponentially discounted sums of the tokens emitted and of the wall-clock
    seconds of the rounds of each *arm* (``True``: draft with the drafter;
    ``False``: the lookup's tokens, or a plain one-token step), and picks the
    arm with the higher tokens/second. Every arm is tried ``min_samples`` times
    first (after ``warmup`` discarded rounds, which carry kernel compilation);
    after that, one decision in ``explore_every * r`` takes the other arm, ``r``
    being how many times slower it measured (clamped to 1..4), so a change of
    regime is noticed at a bounded cost.

    **Pipelined plain rounds** (a request whose session says ``plain_pipelined``:
    the solo loop on a GPU with a greedy verifier): the loop queues a plain step
    ahead of the host read from the second plain round in a row on, so the first
    ``settle`` plain rounds of a run cost a synchronous step each (SmolLM2-135M on
    the H200: 10.5 ms) and the later ones a pipelined step (6.6 ms). Timed one
    exploratory round at a time, the plain arm was priced at that synchronous
    cost, so once the drafter had won, the schedule could keep drafting where plain
    decoding was faster (the likely reason for MT-Bench at 0.82x of plain on the
    H200, session 23, ``benchmarks/README.md``; reproduced with a fake clock in
    ``tests/test_lookup.py``). So there the first ``settle`` plain rounds of a run
    (as the loop counts them: rounds without drafts, whatever the arm) are not
    measured, and an exploration of the other arm while the drafter is ahead takes
    ``explore_run`` rounds in a row, once per ``explore_every * r * (explore_run -
    settle)`` decisions (the same share of measured exploratory rounds). Such
    requests have contexts of their own (``"none/pipelined"``, ``"match/pipelined"``):
    their plain rounds cost what others' do not. Elsewhere (the CPU, sampled
    requests, a batch) nothing is pipelined and every round is measured, one at a
    time. (Adaptive speculation in the spirit of
    e.g. SpecDec++, arXiv 2405.19715, and "speculation is not always worth it"
    cost models; the rule here is this package's.)

    Lossless: the choice depends only on rounds already verified, never on
    the draft it selects, so greedy output is unchanged and rejection sampling
    stays exact. Timing-dependent: the sequence of rounds (not the greedy
    output) can differ between runs, so a seeded sampled request drafts every
    round instead (``speculative_generate_step(adaptive=False)``, which
    ``stream_generate`` passes when ``seed`` is given with ``temp > 0``).

    The statistics belong to the proposer, so they carry over between requests.

    Args:
        explore_every: decisions of a context between two exploratory ones when
            both arms measure alike (>= 2).
        decay: discount per round of the sums, in ``(0, 1)``.
        min_samples: measured rounds of each arm before choosing by rate.
        warmup: first measured rounds of each (context, arm) discarded (kernel compilation).
        settle: plain rounds at the start of a run of them not measured where plain rounds are pipelined (>= 0;
            2: the loop's plain rounds are pipelined from the third in a row on).
        explore_run: rounds in a row an exploration of the other arm takes where plain rounds are pipelined
            (> ``settle``).
        clock: seconds as a float (``time.perf_counter``; tests pass a fake).
        widths: a :class:`WidthPolicy` (from a calibration of this machine, :mod:`~.calibrate`) that picks how
            many tokens a round proposes (drafter rounds and lookup rounds), or ``None``: as many as the loop
            and the lookup allow, as without a calibration.
    """

    def __init__(self, explore_every: int = 16, decay: float = 0.9, min_samples: int = 3, warmup: int = 1,
                 clock=time.perf_counter, widths: WidthPolicy | None = None, settle: int = PLAIN_RUN_AHEAD_AFTER,
                 explore_run: int = 4):
        if explore_every < 2 or not 0.0 < decay < 1.0 or min_samples < 1 or warmup < 0:
            raise ValueError("explore_every >= 2, 0 < decay < 1, min_samples >= 1 and warmup >= 0 are required")
        if settle < 0 or explore_run <= settle:
            raise ValueError(f"settle >= 0 and explore_run > settle are required, got {settle} and {explore_run}")
        self.explore_every, self.decay, self.min_samples, self.warmup = explore_every, decay, min_samples, warmup
        self.settle, self.explore_run = int(settle), int(explore_run)
        self.clock = clock
        self.widths = widths
        self._sums: dict[tuple[str, bool], list[float]] = {}  # (context, arm) -> discounted [tokens, seconds]
        self._seen: dict[tuple[str, bool], int] = {}
        self._decisions: dict[str, int] = {}
        self._exploring: dict[str, list] = {}  # context -> [arm, decisions left] of an exploration under way

    def rate(self, context: str, arm: bool) -> float | None:
        """Measured tokens per second of ``arm`` in ``context`` (``None``: not measured)."""
        e = self._sums.get((context, arm))
        return e[0] / e[1] if e and e[1] > 0 else None

    def choose(self, context: str, pipelined: bool = False) -> bool:
        """Whether the next round in ``context`` drafts with the drafter (``pipelined``: the request's plain rounds
        are pipelined, :class:`ProposerSession`'s ``plain_pipelined``; explorations then take runs of rounds)."""
        for arm in (True, False):
            if self._seen.get((context, arm), 0) < self.warmup + self.min_samples:
                return arm
        ex = self._exploring.get(context)
        if ex is not None and ex[1] > 0:
            ex[1] -= 1
            return ex[0]
        rd, ro = self.rate(context, True), self.rate(context, False)
        if rd is None or ro is None:  # not measurable (a clock that did not advance): draft
            return True
        best = rd >= ro
        # explore the other arm less often the worse it measured (at most 4x less often); plain rounds where they
        # are pipelined for a run of rounds of which the last explore_run - settle are measured
        run, measured = (self.explore_run, self.explore_run - self.settle) if pipelined and best else (1, 1)
        ratio = max(rd, ro) / max(min(rd, ro), 1e-12)
        k = self._decisions[context] = self._decisions.get(context, 0) + 1
        if k >= self.explore_every * min(ratio, 4.0) * measured:
            self._decisions[context] = 0
            self._exploring[context] = [not best, run - 1]
            return not best
        return best

    def settling(self, plain_run: int, pipelined: bool) -> bool:
        """Whether a round that is the ``plain_run``-th plain round in a row (0: it drafts) is held back: measured
        only if its run ends before it is pipelined (then its synchronous cost is what plain rounds cost there),
        dropped once the run reaches its pipelined rounds (the session, :class:`FusedProposer`, holds them)."""
        return pipelined and 0 < plain_run <= self.settle

    def record(self, context: str, arm: bool, tokens: int, seconds: float) -> None:
        """One round of ``arm`` in ``context`` emitted ``tokens`` in ``seconds``."""
        key = (context, arm)
        seconds = max(float(seconds), 1e-9)  # a coarse or faked clock may not advance
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        if seen <= self.warmup:
            return
        # discounted sums (each measured round weighs decay ** age, the first one too; their ratio is
        # the rate): an average seeded with its first round would give that one round most of the weight
        # for the first ~1 / (1 - decay) rounds, i.e. decide after the trial rounds on one of them
        e = self._sums.setdefault(key, [0.0, 0.0])
        e[0] = self.decay * e[0] + tokens
        e[1] = self.decay * e[1] + seconds

    def width(self, n_max: int, kind: str = "drafter", context: int | None = None) -> int:
        """How many tokens the next round of ``kind`` (see :class:`WidthPolicy`) proposes, at most ``n_max``
        (for the drafter the loop's ``B - 1``, capped by ``max_tokens`` and the context; for lookup the
        tokens it has; ``0``: a plain step), its verify attending to ``context`` cached tokens: the
        :class:`WidthPolicy`'s choice, or ``n_max`` without one."""
        return self.widths.choose(n_max, kind, context) if self.widths is not None else n_max

    def record_acceptance(self, drafted: int, accepted: int, kind: str = "drafter") -> None:
        """A verified round of ``kind`` proposed ``drafted`` tokens and accepted ``accepted`` (for the width
        policy; nothing without one)."""
        if self.widths is not None:
            self.widths.record(drafted, accepted, kind)

    def summary(self) -> dict:
        """``{context: {"drafter": tok/s, "other": tok/s}}`` as measured so far."""
        out = {}
        for ctx in sorted({c for c, _ in self._sums}):
            out[ctx] = {name: self.rate(ctx, arm) for name, arm in (("drafter", True), ("other", False))}
        return out


class FusedProposer(Proposer):
    """Drafter proposals fused with lookup (rule of the community patch, spec §5.10).

    The lookup wins if its match is ``>= long_match`` tokens (decided on the
    host: point-mass proposals, no drafter forward), or, for greedy chain
    drafts, ``>= short_match`` tokens and the drafter agrees on the first two
    slots (decided on the device with ``mx.where``: no host synchronisation).
    A greedy *tree* draft (:mod:`~.tree`) takes any shorter match as one more
    branch instead: the lookup's first :data:`GRAFT_TOKENS` tokens (at most
    half the tree) grafted in place of the tree's least probable leaves
    (:func:`~.tree.graft`; same verify width; exact replay on the 1.5B:
    GSM8K tau 2.92 -> 3.44, HumanEval 6.25 -> 6.59, MT-Bench 2.28 -> 2.35).
    Sampled drafts never take the short-match rule: choosing between
    proposals by the sampled tokens themselves would bias rejection sampling.

    With ``schedule`` (an :class:`AdaptiveSchedule`), each round without a
    long match first asks the schedule whether a drafter forward pays here;
    if not, the round proposes the lookup's tokens (at most the lookup's own
    block) or nothing (a plain one-token step of the target). A schedule with
    a calibrated :class:`WidthPolicy` also sets how many tokens each round
    proposes: the drafter's (at most the loop's ``n``) and the lookup's (at
    most the tokens it has), long matches included.

    Args:
        drafter: the :class:`DFlashProposer` (its block size is the fused one).
        lookup: the :class:`LookupProposer` (its block size caps lookup-only
            rounds of the schedule).
        long_match / short_match: match lengths (tokens) of the two rules above.
        schedule: an :class:`AdaptiveSchedule`, or ``None`` to draft every round.
    """

    def __init__(self, drafter: DFlashProposer, lookup: LookupProposer, long_match: int = 8, short_match: int = 6,
                 schedule: AdaptiveSchedule | None = None):
        self.drafter, self.lookup = drafter, lookup
        self.block_size = drafter.block_size
        self.tap_ids = drafter.tap_ids
        self.schedule = schedule
        self.name = f"{drafter.name}+lookup" + (" (adaptive)" if schedule is not None else "")
        self.min_confidence = drafter.min_confidence
        self.long_match, self.short_match = long_match, short_match

    @property
    def calibration(self):
        """The :class:`~.calibrate.VerifyCosts` the schedule's width policy uses, or ``None`` (full blocks)."""
        widths = self.schedule.widths if self.schedule is not None else None
        return widths.costs if widths is not None else None

    def start(self, prompt):
        return _FusedSession(self, self.drafter.start(prompt), self.lookup.start(prompt))

    def check_block_size(self, block_size):
        return self.drafter.check_block_size(block_size)


class _FusedSession(ProposerSession):
    def __init__(self, p: FusedProposer, d: _DFlashSession, l: _LookupSession):
        self.p, self.d, self.l = p, d, l
        self._round = None  # (context, arm, start time, settling) of the round being verified (adaptive schedule)
        self._width = None  # (kind, tokens proposed) of the round being verified (the schedule's width policy)
        self._plain_run = 0  # plain rounds in a row proposed, the last one included (the loop's streak)
        self._held: list = []  # (context, arm, tokens, seconds) of the settling rounds of the current plain run

    @property
    def adaptive(self) -> bool:  # the drafter session's: it pads a cut draft only where the loop allows (see there)
        return self.d.adaptive

    @adaptive.setter
    def adaptive(self, value: bool) -> None:
        self.d.adaptive = bool(value)

    @property
    def trees(self) -> bool:  # the drafter session's (it builds the trees)
        return self.d.trees

    @trees.setter
    def trees(self, value: bool) -> None:
        self.d.trees = bool(value)

    def verified(self, tokens):
        sch = self.p.schedule
        if self._round is not None:  # the round ends at its host synchronisation (consumer time excluded)
            ctx, arm, t0, settling = self._round
            self._round = None
            if settling:  # a pipelined plain run's first rounds: measured only if the run ends before its
                # pipelined ones
                self._held.append((ctx, arm, tokens, sch.clock() - t0))
            else:
                sch.record(ctx, arm, tokens, sch.clock() - t0)
        if self._width is not None:
            kind, proposed = self._width
            self._width = None
            sch.record_acceptance(proposed, tokens - 1, kind)

    def extend(self, tokens, features):
        self.d.extend(tokens, features)
        self.l.extend(tokens, features)
        if self.adaptive and self.p.schedule is not None:
            # the adaptive schedule times each round: evaluate the drafter's context append now, or the
            # next drafter round would pay (and be timed) for every round since the last one. Without
            # it (a batch's rows) the appends wait for the next proposal, or a batch's flush of them.
            mx.async_eval(self.d.state_arrays())

    def held_arrays(self):
        return self.d.held_arrays()

    @property
    def drafter_session(self):
        return self.d.drafter_session  # (a fused custom drafter's session: None, or its own)

    def state_arrays(self):
        return self.d.state_arrays()

    def truncate(self, n):
        self._round = self._width = None
        self.end_run()  # a loop goes on from here with its streak at 0
        self.d.truncate(n)
        self.l.truncate(n)

    def clone(self):
        return _FusedSession(self.p, self.d.clone(), self.l.clone())

    def _lookup(self, tokens: list[int], kind: str, scheduled: bool) -> Proposal:
        """The lookup's ``tokens`` as a proposal, cut to the width policy's choice for ``kind`` (possibly none:
        a plain step, where its measured acceptance does not pay for a wider verify)."""
        if scheduled:
            k = self.p.schedule.width(len(tokens), kind, len(self.l.index))
            tokens = tokens[:k]
            self._width = (kind, len(tokens))
        if not tokens:
            return Proposal.empty()
        return Proposal(mx.array(tokens, dtype=mx.int32), source="lookup")

    def propose(self, anchor, n, temperature=0.0, key=None):
        p = self._propose(anchor, n, temperature, key)
        # the loop's streak of plain rounds (rounds without drafts, whichever arm chose them) and whether this round's
        # time is a pipelined run's settling one (AdaptiveSchedule: not measured)
        self._plain_run = self._plain_run + 1 if p.n == 0 else 0
        sch = self.p.schedule
        if self._held and (self._plain_run == 0 or self._plain_run > sch.settle):
            self._release(measured=self._plain_run == 0)  # the run ended before its pipelined rounds, or reached them
        if self._round is not None:
            self._round = (*self._round[:3], sch.settling(self._plain_run, bool(self.plain_pipelined)))
        return p

    def end_run(self) -> None:
        if self._held:  # the run ends before its pipelined rounds: what its rounds cost
            self._release(measured=True)
        self._plain_run = 0

    def _release(self, measured: bool) -> None:
        """The held settling rounds recorded (their run ended while they were its last rounds) or dropped."""
        held, self._held = self._held, []
        if measured:
            for r in held:
                self.p.schedule.record(*r)

    def _propose(self, anchor, n, temperature, key):
        m, lt = self.l.match(anchor, n)
        sch = self.p.schedule
        scheduled = sch is not None and self.adaptive
        self._width = None
        if m >= self.p.long_match and lt:
            # the lookup wins, known on the host: point masses, and no drafter forward at all
            return self._lookup(lt[:n], "lookup", scheduled)
        if scheduled:
            ctx = ("match" if lt else "none") + ("/pipelined" if self.plain_pipelined else "")
            arm = sch.choose(ctx, bool(self.plain_pipelined))
            self._round = (ctx, arm, sch.clock())
            if not arm:
                if not lt:
                    return Proposal.empty()
                return self._lookup(lt[: min(n, self.p.lookup.block_size - 1)], "lookup-short", True)
            n = sch.width(n, "drafter", len(self.l.index))  # the calibrated width policy's choice at this
            # context (the committed tokens, all in the target's cache; n itself without a calibration)
            if n == 0:  # no width pays at the acceptance measured so far: a plain step, no drafter forward,
                # timed as a round without the drafter (the other arm: counted as the drafter's, these cheap
                # steps made the drafter look fast where a short lookup match competes with it, and it was
                # then given rounds it wasted)
                self._round = (ctx, False, self._round[2])
                self._width = ("drafter", 0)
                return Proposal.empty()
        dp = self.d.propose(anchor, n, temperature, key)
        if scheduled:
            self._width = ("drafter", dp.n)
        return self._fuse(dp, m, lt)

    def begin(self, anchor, n, temperature=0.0, key=None):
        if self.p.schedule is not None and self.adaptive:  # the schedule times its rounds one by one
            return self.propose(anchor, n, temperature, key)
        # propose()'s unscheduled path, its drafter forward left to the caller (a batch's rows: nothing pipelined)
        m, lt = self.l.match(anchor, n)
        self._width = None
        self.end_run()  # no schedule times these rounds
        if m >= self.p.long_match and lt:
            return self._lookup(lt[:n], "lookup", False)
        call = self.d.begin(anchor, n, temperature, key)
        if not isinstance(call, DraftCall):
            return self._fuse(call, m, lt)
        call.finish = lambda dp: self._fuse(dp, m, lt)
        return call

    def _fuse(self, dp: Proposal, m: int, lt: list[int]) -> Proposal:
        """The drafter's proposal ``dp`` fused with the lookup's ``lt`` (a match of ``m`` tokens)."""
        if not lt or dp.n == 0 or dp.q is not None:
            # A sampled draft keeps its own tokens: taking the lookup's tokens *because* the sampled
            # ones agree with them would make the proposal differ from the q the verifier is given
            # (emitting a lookup token d_1 = l_1 would have probability p(1 - r(1 - q(l_1))) instead
            # of p, r = P(d_2 = l_2 | d_1 = l_1)): biased sampling.
            return dp
        if dp.tree is not None:  # a tree draft takes the lookup's first tokens as one more branch (tree.graft)
            tree, toks = graft(dp.tree, dp.tokens.tolist(), lt[: min(GRAFT_TOKENS, (dp.n + 1) // 2)], dp.n)
            return Proposal(mx.array(toks, dtype=mx.int32), source="drafter", tree=tree)
        if m < self.p.short_match:
            return dp
        lt = lt[: dp.n]  # the drafter may have cut its draft short (min_confidence)
        lookup_tokens = mx.concatenate([mx.array(lt, dtype=mx.int32), dp.tokens[len(lt) :]])
        use = mx.all(dp.tokens[:2] == lookup_tokens[:2])
        return Proposal(mx.where(use, lookup_tokens, dp.tokens), source="drafter")
