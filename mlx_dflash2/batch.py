"""Batched speculative rounds for every target family: dense, hybrid GatedDeltaNet, sliding-window (issue 22).

Every request kind shares a batch: greedy and sampled (each with its own verifier, logits processors
and random keys), with or without logprobs. This is **the one decoding loop**: the server's engine
(:mod:`~.server.engine`) runs its requests through it (continuous batching), and the CLI,
:func:`~.api.stream_generate` and the benchmarks run a batch of one (:func:`~.speculative.speculative_generate_step`).
This module advances **N requests by one round with one target forward**.

Layers: every attention layer's rows live in one :class:`RaggedKVCache` (per-row lengths; a
sliding-window layer's with its window: each row's front evicted past the window and a rollback slack,
row by row, so its memory stays bounded as in the solo loop's ``WindowKVCache``), every GatedDeltaNet
layer's (hybrid targets: ``qwen3_next``, ``qwen3_5``) in one
:class:`~.caches.RaggedRecurrentCache`: the conv window ``[N, K - 1, C]`` and the recurrent state
``[N, Hv, Dv, Dk]`` of each row, which mlx-lm's own mixer advances for all rows in the same forward. A
recurrent state cannot be cut back like K/V, so the steps below keep each row's exact: a prompt chunk
is masked at each row's own length (mlx-lm's ``lengths`` path), and a verify is rolled back row by row
to the row's own accepted length (the kept step selected, or a masked replay from the pre-verify
snapshot). Any other cache kind is refused (:class:`~.target.TargetCompatibilityError`; the server then
runs its requests round-robin).

Data flow of one round (:meth:`SpeculativeBatch.step`)
------------------------------------------------------
1. **join**: :meth:`SpeculativeBatch.add` sets a request up as the solo loop does
   (:func:`~.speculative.start_request`: checks, prompt-cache reuse, proposer session) and queues it as
   a row of the *join cache* (a second set of ragged caches; a reused prefix comes with its K/V and,
   hybrid, its recurrent arrays at the reused length: the solo loop's snapshots). Each
   :meth:`~SpeculativeBatch.step` first feeds every queued request its next prompt chunk (up to
   ``prefill_step_size`` tokens per row) in **one target forward** (rows right-padded: the padding's K/V
   rolled back as rejected drafts are; the GatedDeltaNet layers mask it, so each row's recurrent state
   and conv window end at its own last real token), so many joins cost one batched forward and a long
   prompt is prefilled a chunk per step, interleaved with the rounds of the requests already decoding.
   On a hybrid target the chunks of a ``keep_state`` request end at multiples of
   :data:`~.speculative.SNAPSHOT_INTERVAL`, where its recurrent arrays are kept (the solo loop's
   prompt-cache snapshots, handed over with its final state). A request whose prompt is complete gets
   its first token from its own verifier on the logits at its last prompt token (what the solo loop's
   prefill does) and its rows move to the batch cache (one concatenation per layer for all of that
   step's joins).
2. **draft**: each active request's own proposer session proposes ``d_1..d_{n_i}`` after its anchor
   (``n_i <= B_i - 1``, shrunk near its ``max_tokens``, the context limit and the
   :class:`WidthSchedule`'s cap); a sampled request's drafter gets its draft temperature and the next
   split of its own draft key (split once per round that drafts, as in the solo loop). A session
   answers :meth:`~.proposers.ProposerSession.begin` with its proposal (lookup, scripted, plain) or
   with the DFlash drafter forward it needs (a :class:`~.proposers.DraftCall`: a DFlash session, or a
   fused session without a long lookup match); **the calls of every request with the same drafter run as
   one drafter forward** (:meth:`~.proposers.DFlashProposer.propose_many`: their queued context rows
   appended in one projection, the blocks ``[anchor_i, mask...]`` through
   :meth:`~.drafter.model.DraftModel.forward_rows`, each at its own positions over its own context
   K/V, right-aligned and padded, the padding masked; one LM head, the greedy selector walks batched, a
   sampled request's walk alone with its key, every dynamic draft length read with one host
   synchronisation), and each session finishes its own proposal from its row (the fused lookup rule).
   Each row's proposal equals its solo proposal (float32: the same tokens, up to near-ties of the
   wider matmuls). A batch's only row proposes as the solo loop does (its session's ``propose``): a greedy
   request may then get a tree draft (``trees``, lookup grafts included), verified by the target's tree
   forward over the row's cache and compacted to the accepted path (:func:`~.tree.compact_cache`) before
   the trim below; rows of a batch of several propose chains.
3. **verify**: one target forward over a padded ``[N, M]`` block, ``M = max_i(n_i + 1)``: row ``i`` is
   ``[anchor_i, d_1..d_{n_i}, pad...]``. Each row's new K/V are written at that row's own offset
   (its committed length) and RoPE runs at each row's own positions; the mask lets query ``q`` of row
   ``i`` see exactly keys ``0 .. len_i + q`` of row ``i``. Padding sits after a row's real tokens, so
   causality alone keeps it (and every other row) out of the real queries' view. Each GatedDeltaNet
   layer advances every row by ``M`` (padding included: it comes after the real tokens, so the real
   rows' outputs do not see it) and keeps what the rollback needs: the state before the forward and the
   mixer's inputs (:func:`~.caches.install_recording`), and on a routed target every step's state and
   the conv input (the stepping mixer, :func:`~.kernels.gdn.route_gated_delta`).
4. **accept**: each request's own verifier (greedy by default: :class:`~.verify.GreedyVerifier`, the
   same op as the solo loop; :class:`~.verify.RejectionVerifier` for a sampled request, whose key
   splits once per round exactly as in the solo loop; either with the request's penalties / logit
   bias over its own history) on its own ``n_i + 1`` logit rows. One host synchronisation for the
   whole batch (every row's accepted length and tokens, and the logprobs of the rows that asked for
   them, are read together).
5. **commit / rollback**: row ``i`` keeps ``[anchor, d_1..d_{a_i}]`` (its length goes up by
   ``a_i + 1``; fewer when the request stops inside the round: exactly its emitted tokens but the last;
   the rest of the block, rejected drafts and padding, is dropped by a per-row length decrement, no
   copy, in the attention layers; each GatedDeltaNet layer takes every row to its state after its own
   ``a_i + 1`` tokens: ``states[i, a_i]`` and its conv window selected
   (:func:`~.kernels.gated_delta_steps.select_states`) when the steps were kept, else the row's kept
   inputs replayed from the pre-verify snapshot through the layer's own mixer, masked at ``a_i + 1``
   (the reference path: MLX's ops, what the CPU runs)); its proposer session gets those positions' tap
   features (a DFlash session queues them: its drafter context is appended at its next proposal, or,
   once any row has ``flush_rows`` rows queued, together with every other row's queue in one projection,
   so plain rounds under load cost no drafter work; the joins' prompts are appended in one projection at
   their prefill where no row is running, else queued too). Tokens are emitted up to the first EOS /
   ``max_tokens`` / the context limit; finished requests leave the batch (their row is dropped) before the
   next round.

Invariants (checked after every round)
--------------------------------------
* Row ``i`` of every layer's :class:`RaggedKVCache` holds exactly the K/V of the request's prompt and
  emitted tokens but the last (the anchor, not yet fed), at positions ``0 .. len_i - 1`` (left
  aligned, as in the request's solo cache, so a row's keys sit at the same indices as they would
  alone); what lies at or past ``len_i`` is garbage that no mask lets through.
* Row ``i`` of every :class:`~.caches.RaggedRecurrentCache` holds the recurrent state and conv window
  after exactly those ``len_i`` tokens (the solo loop's at the same position, within float rounding:
  ``tests/test_batch_hybrid.py`` checks 1e-5 after every step, joins mid-prefill included); it depends
  on row ``i``'s tokens only.
* All layers agree on the lengths; the proposer session of a request holds the same committed
  positions as its row (a DFlash session's appended context plus its queued features).
* No request reads another's tokens, cache rows, proposer state or verifier state: the only shared
  computations are the target forward and the drafter forward, whose attention is masked per row.

Lossless: each request's greedy output equals its solo output (float32 on the reference path, as
for the single-request loop; the batch's wider matmuls can differ from a solo forward only in the
last bits, i.e. at exact near-ties), and so does a seeded sampled request's: its random streams (the
verify key and the draft key, from :func:`~.api.request_sampling`) are its own and are consumed in
the solo loop's order (one verify split per round, including the prefill's first token; one draft
split per round that drafts), its widths are its own (never capped by the :class:`WidthSchedule`),
and the batch's rounds are the solo loop's non-adaptive rounds (what a seeded solo run uses). Those
last bits move nothing else: a sampled draft's top-K candidates come in token-id order
(:meth:`~.drafter.model.CandidateSelector.candidates`, :func:`~.proposers.sample_top_k`), not in the
order ``argpartition`` leaves them (which moved with the last bits of any score in the row and gave a
seeded request other draws beside other requests: issue 22). Tests: ``tests/test_batch.py``;
hybrid and sliding-window targets: ``tests/test_batch_hybrid.py``.

One sequence of operations per kind of round: MLX's CUDA backend caches its graphs by topology, so a round
that evaluates the same operations as the last one (shapes aside) reuses its graphs, and one that does not
rebuilds every graph after its first difference. So the per-row work of a round of several rows runs the same
operations for every row, whatever its length: the drafter's flush writes every row's queued features into one
zero ``[N, M, k*D]`` block (a slice update per queued piece), its attention writes every row's context K/V
right-aligned into one zero block (a slice update per row) under a mask every round, the verify block is one
gather from the anchors and the drafts (a row without drafts brings a one-token host constant, so the
concatenation's input count stays), and the LM head reads the real rows by one gather even where no row is
narrower. Where graphs run (:data:`DRAFTS_APART`), the drafter's forward is evaluated apart from the target's, so
the drafter's work (its rows, their queues, a context buffer that grows) does not move the target's graphs.
``benchmarks/round_graphs.py`` counts the distinct sequences on any backend; ``tests/test_batch.py`` checks one
per round.

Why not mlx-lm's ``BatchKVCache``: it keeps rows right-aligned (left padding) with one shared write
index, so ``trim`` cuts every row by the same amount. A per-row rollback through its public API
(``trim`` by the smallest rejection, then ``prepare(right_padding=...)`` + ``finalize()``) rolls the
whole buffer of every layer every round (a full K/V copy) and grows each row's left padding by the
spread of the accepted lengths every round (a row that accepts less than the others accumulates
masked padding without bound, attention cost and memory with it). :class:`RaggedKVCache` keeps rows
left-aligned with per-row lengths instead: a verify scatters ``N x M`` rows, a rollback is a host-side
length decrement.

Missing for the full issue 22 (later steps)
-------------------------------------------
* one drafter forward for all rows (done: :meth:`~.proposers.DFlashProposer.propose_many`; drafter
  contexts stay per request and are gathered, padded, for each drafting round: a batch-owned ragged
  drafter cache would save that copy);
* hybrid and sliding-window targets (done: :class:`~.caches.RaggedRecurrentCache`, windowed
  :class:`RaggedKVCache`; a GatedDeltaNet rollback replays on the reference path, one more mixer forward
  of the block per GatedDeltaNet layer, where the routed GPU path selects; a window layer attends over
  up to ``window + slack + step`` rows, its eviction one gather per ``step``-ish positions);
* joins and stops (done: batched, chunked prefill of joins interleaved with the rounds; prompt-cache reuse
  for joins, ``add(state=)``; stop strings, the server's through ``remove``, the generator's through
  :meth:`stop`); a lone row's plain steps queued ahead (done); round r+1 queued before r's tokens are handed
  out (not done, below);
* widths by the drafter's own confidence per row within a per-round budget (:class:`WidthSchedule`
  caps the round's width by measured throughput, the same cap for every greedy row, with bounded trial
  rounds; inside the cap a drafter with a dynamic draft length cuts each row's draft at its own
  confidence; sampled rows keep their widths);
* the single-request generator as a batch of one (done: :func:`~.speculative.speculative_generate_step` adds its
  request to a batch and yields each step's tokens; a lone row runs the single-request rounds: its adaptive
  schedule, tree drafts for a greedy row, and plain steps queued ahead of the host read, :meth:`_runs_ahead`; a
  consumer's stop cuts the row back, :meth:`stop`). Not done: round r+1 queued before round r's tokens are
  handed out (the old solo loop's pipelining: the consumer's per-token work now runs between rounds), and a
  batch of N > 1 rows runs mlx-lm's attention and, past 16 rows in all, MLX's matmuls (no per-row-length
  ``verify_attention``; ``qmm`` takes at most 16 rows).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from . import speculative
from .caches import RaggedRecurrentCache, RecurrentCache, WindowKVCache
from .kernels.registry import backend, cuda_graphs_on
from .proposers import PLAIN_RUN_AHEAD_AFTER, DraftCall, Proposal, Proposer
from .speculative import GenerationState, SpecStats, start_request
from .target import TargetAdapter, TargetCompatibilityError
from .tree import compact_cache
from .verify import GreedyVerifier, Verifier

__all__ = ["RaggedKVCache", "RaggedRecurrentCache", "BatchEvent", "SpeculativeBatch", "WidthSchedule", "warm_up_shapes"]


#: Whether a batch of several rows queues its drafter forward for evaluation apart from its target forward
#: (``mx.async_eval`` of the round's proposals before the verify is built): ``"cuda-graphs"`` (the default: where
#: MLX's CUDA backend runs CUDA graphs), ``"always"`` or ``"never"``. Why: MLX's CUDA backend cuts an evaluation
#: into graphs of ~100 kernels and caches them by topology (``CommandEncoder::commit``), so a drafter forward whose
#: kernel count changes from round to round (rows that propose from lookup instead, a longer queue, a context
#: buffer that grows) would shift every later graph of the target forward and rebuild them all; evaluated apart,
#: the target forward's graphs no longer depend on the drafter's work (they still do on the rows, the width, the
#: rows' verifiers, and the compacted drafter queues that ride at their end). The price is one more release of the
#: GIL per round whose drafts come from a drafter (nothing to gain on Metal or the CPU, which cache no graphs).
DRAFTS_APART = "cuda-graphs"


def drafts_apart() -> bool:
    """:data:`DRAFTS_APART` for the default device now."""
    if DRAFTS_APART in ("always", "never"):
        return DRAFTS_APART == "always"
    return backend() == "cuda" and cuda_graphs_on()


class RaggedKVCache:
    """One attention layer's K/V for a batch of sequences of different lengths (per-row offsets), full
    attention or a sliding window.

    Invariant: row ``i`` holds the K/V of its positions ``starts[i] .. lengths[i] - 1`` at buffer indices
    ``0 .. lengths[i] - starts[i] - 1`` of ``keys`` / ``values`` (``[N, H, capacity, D]``, left aligned;
    ``starts[i] == 0`` for full attention, so position = index there); anything past a row's held rows
    is garbage (rejected drafts, padding, zeros) that :meth:`make_mask` never lets a query see.

    It is an mlx-lm cache entry for the dense families (llama, mistral, qwen2, qwen3), the attention
    layers of hybrid GatedDeltaNet targets and the sliding-window and global layers of Gemma 3/4: their
    attention reads :attr:`offset` (here an int32 ``[N]`` array: RoPE at each row's own positions), calls
    :meth:`update_and_fetch` and gets the mask from :meth:`make_mask` (through ``create_attention_mask``).
    A forward of ``[N, M]`` tokens writes row ``i``'s ``M`` new K/V after its held rows and advances
    every length by ``M``; :meth:`trim_rows` then rolls each row back by its own amount.

    **Sliding window** (``max_size = w``; replaces :class:`~.caches.WindowKVCache` in a batch): a query at
    position ``p`` sees exactly keys ``(p - w, p]`` of its row (the mask), whatever the block sizes. The
    front of each row is evicted, so memory stays bounded: when a forward would grow the buffers, every
    row first drops what it no longer needs beyond ``w - 1 + slack`` rows (its start moves to
    ``max(start, length - (w - 1) - slack)``; one gather shifts each row by its own amount), so a row
    keeps ``slack`` rows of rollback past its window: :meth:`trim_rows` is exact for up to ``slack``
    positions (a round rolls back less than a block), and raises past what a row still holds. The
    eviction is a function of the lengths, the starts and the forward's width only, so every window layer
    of a model (each with its own cache) holds the same geometry and the mask made from one of them
    (:meth:`make_mask`, before the forward's writes) fits all.

    The lengths and starts are kept on the host (lists of ints: the round knows them anyway) and the
    lengths mirrored into :attr:`offset`.

    Args:
        max_size: the attention window ``w`` (``None``: full attention, nothing evicted).
        slack: rows kept past the window for rollback (window only; >= 0).

    Raises:
        ValueError: ``max_size < 1`` or ``slack < 0``.
    """

    step = 256  # capacity grows in multiples of this many positions (as mlx-lm's KVCache)

    def __init__(self, max_size: int | None = None, slack: int = 64):
        if (max_size is not None and int(max_size) < 1) or int(slack) < 0:
            raise ValueError(f"RaggedKVCache: need max_size >= 1 (or None) and slack >= 0, got {max_size}, {slack}")
        self.max_size = None if max_size is None else int(max_size)
        self.slack = int(slack)
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self._lengths: list[int] = []
        self._starts: list[int] = []
        self._offset: mx.array | None = None

    # -- geometry ---------------------------------------------------------------------------------
    @property
    def lengths(self) -> list[int]:
        """Per-row committed lengths (positions), a copy."""
        return list(self._lengths)

    @property
    def starts(self) -> list[int]:
        """Per-row first held position (0 unless a window evicted the front), a copy."""
        return list(self._starts)

    @property
    def rows(self) -> int:
        return len(self._lengths)

    @property
    def offset(self) -> mx.array:
        """int32 ``[N]``: each row's length, i.e. the position of its next token (RoPE offsets)."""
        if self._offset is None:
            self._offset = mx.array(self._lengths, dtype=mx.int32)
        return self._offset

    def solo_length(self) -> int | None:
        """The length of the one row of a one-row full-attention cache (what a solo ``KVCache``'s offset would be),
        else ``None``. The kernels' attention (:class:`~.kernels.attention.KernelAttention`) then treats this cache
        as the solo loop's: RoPE at that int offset, the core through ``verify_attention`` over :attr:`keys` /
        :attr:`values` (left aligned, so the row's positions are its buffer indices) with the causal mask, which
        is what :meth:`make_mask` gives one row; so a batch of one computes what the solo loop computes."""
        if len(self._lengths) == 1 and self.max_size is None and not self._starts[0]:
            return self._lengths[0]
        return None

    def _set_lengths(self, lengths: list[int], starts: list[int] | None = None) -> None:
        self._lengths = lengths
        if starts is not None:
            self._starts = starts
        self._offset = None

    def _held(self) -> list[int]:
        return [n - s for n, s in zip(self._lengths, self._starts)]

    def _capacity(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def _evictions(self, M: int) -> list[int] | None:
        """The starts after the eviction a forward of ``M`` tokens makes (None: none): a window cache whose
        buffers would grow moves every row's start to ``max(start, length - (w - 1) - slack)``, if that
        frees anything (deterministic: :meth:`make_mask` and :meth:`update_and_fetch` agree)."""
        if self.max_size is None or self.keys is None or max(self._held()) + M <= self._capacity():
            return None
        keep = self.max_size - 1 + self.slack
        new = [max(s, n - keep) for n, s in zip(self._lengths, self._starts)]
        return new if new != self._starts else None

    def _evict(self, starts: list[int], M: int) -> None:
        """Drop each row's front up to its new start: one gather shifts every row by its own amount, into
        buffers sized for what the rows then hold and ``M`` more (a capacity grown by a long prompt chunk
        shrinks back)."""
        shift = mx.array([s1 - s0 for s0, s1 in zip(self._starts, starts)], dtype=mx.int32)
        cap = self._capacity()
        held = max(n - s for n, s in zip(self._lengths, starts))
        new_cap = max(-(-(held + M) // self.step) * self.step, self.step)
        idx = mx.minimum(mx.arange(new_cap, dtype=mx.int32)[None] + shift[:, None], cap - 1)[:, None, :, None]
        self.keys = mx.take_along_axis(self.keys, idx, axis=2)
        self.values = mx.take_along_axis(self.values, idx, axis=2)
        self._starts = list(starts)

    def _grow(self, need: int) -> None:
        cap = self._capacity()
        if need <= cap:
            return
        new_cap = -(-need // self.step) * self.step
        N, H, _, Dk = self.keys.shape
        Dv = self.values.shape[3]
        self.keys = mx.concatenate([self.keys, mx.zeros((N, H, new_cap - cap, Dk), self.keys.dtype)], axis=2)
        self.values = mx.concatenate([self.values, mx.zeros((N, H, new_cap - cap, Dv), self.values.dtype)], axis=2)

    # -- the mlx-lm cache interface ---------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write ``keys`` / ``values`` (``[N, H, M, D]``) after each row's held rows (a window first
        evicts, see the class); advance every row by ``M``. Returns the buffers cut to
        ``max(held) + M`` indices (the mask hides each row's tail).

        Raises:
            ValueError: the batch size differs from the number of rows, or the cache has no rows.
        """
        N, _, M, _ = keys.shape
        if N != self.rows or N == 0:
            raise ValueError(f"RaggedKVCache: a forward of {N} rows on a cache of {self.rows} rows")
        new_starts = self._evictions(M)
        if new_starts is not None:
            self._evict(new_starts, M)
        held = self._held()
        need = max(held) + M
        if self.keys is None:  # every row is empty (joins before their first prefill chunk)
            cap = -(-need // self.step) * self.step
            self.keys = mx.zeros((N, keys.shape[1], cap, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((N, values.shape[1], cap, values.shape[3]), values.dtype)
        self._grow(need)
        at = self.offset if not any(self._starts) else mx.array(held, dtype=mx.int32)
        idx = (at[:, None] + mx.arange(M, dtype=mx.int32))[:, None, :, None]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(idx, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(idx, values.shape), values, axis=2)
        self._set_lengths([n + M for n in self._lengths])
        return self.keys[..., :need, :], self.values[..., :need, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs) -> mx.array:
        """Bool ``[rows, 1, N, max(held) + N]``: query ``q`` of row ``i`` (position ``lengths[i] + q``)
        sees the keys of its own row at positions ``<= lengths[i] + q`` (and, with a window ``w``,
        ``> lengths[i] + q - w``). Called before the forward's writes (it accounts for their eviction).

        Args:
            N: queries per row.
            window_size: the attention window (default: the cache's ``max_size``; at most that).

        Raises:
            ValueError: a window on a full-attention cache, or wider than the cache's.
        """
        w = self.max_size if window_size is None else int(window_size)
        if w is not None and (self.max_size is None or w > self.max_size):
            raise ValueError(f"RaggedKVCache: a window of {w} on a cache of window {self.max_size} "
                             "(full-attention layers have none)")
        starts = self._evictions(N) or self._starts
        S = max(n - s for n, s in zip(self._lengths, starts)) + N
        pos = self.offset[:, None] + mx.arange(N, dtype=mx.int32)  # [rows, N] query positions
        key_pos = mx.arange(S, dtype=mx.int32)[None, None, :]
        if any(starts):
            key_pos = key_pos + mx.array(starts, dtype=mx.int32)[:, None, None]
        mask = key_pos <= pos[:, :, None]
        if w is not None:
            mask = mask & (key_pos > pos[:, :, None] - w)
        return mask[:, None]

    @property
    def state(self) -> list[mx.array]:
        """The arrays to evaluate (the buffers, or nothing while empty)."""
        return [] if self.keys is None else [self.keys, self.values]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Roll every row back by ``n`` positions (at most its length); returns ``n`` applied to the
        shortest row.

        Raises:
            ValueError: past what a window row still holds (nothing changed).
        """
        n = max(0, min(int(n), min(self._lengths, default=0)))
        self.trim_rows([n] * self.rows)
        return n

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    # -- per-row operations (the batch's) ---------------------------------------------------------
    def trim_rows(self, n: Sequence[int]) -> None:
        """Roll row ``i`` back by ``n[i]`` positions (a length decrement; nothing is copied).

        Raises:
            ValueError: wrong count, a negative amount, more than a row holds, or (window) a rollback
                past the rows a row's next query needs: it keeps ``w - 1`` positions before its new
                length, or from its start (nothing changed).
        """
        n = [int(x) for x in n]
        if len(n) != self.rows:
            raise ValueError(f"RaggedKVCache.trim_rows: {len(n)} amounts for {self.rows} rows")
        if any(x < 0 or x > m - s for x, m, s in zip(n, self._lengths, self._starts)):
            raise ValueError(f"RaggedKVCache.trim_rows: amounts {n} outside 0..lengths {self._lengths} "
                             f"(held from {self._starts})")
        if self.max_size is not None and any(s > 0 and m - x - (self.max_size - 1) < s
                                             for x, m, s in zip(n, self._lengths, self._starts)):
            raise ValueError(f"RaggedKVCache.trim_rows: amounts {n} reach past the rows the window still holds "
                             f"(lengths {self._lengths}, starts {self._starts}, window {self.max_size})")
        self._set_lengths([m - x for m, x in zip(self._lengths, n)])

    def add_row(self, keys: mx.array | None, values: mx.array | None, start: int = 0) -> None:
        """Append one row: :meth:`add_rows` with a single row."""
        self.add_rows([(keys, values, start)])

    def add_rows(self, rows: Sequence[tuple]) -> None:
        """Append rows, each ``(keys, values)`` or ``(keys, values, start)``: ``keys`` / ``values``
        ``[1, H, L, D]`` holding positions ``start .. start + L - 1`` (``start`` 0 by default; e.g. a
        prefilled ``KVCache``'s ``keys[..., :offset, :]``, or the rows a window cache holds), or
        ``(None, None)`` for an empty row (length 0: a request whose prompt is still to be prefilled). One
        concatenation per call (joins of many rows at once cost one copy of the buffers, not one per
        row). While no row has K/V the buffers stay unallocated (:meth:`update_and_fetch` allocates them
        from the first keys it writes).

        Raises:
            ValueError: a shape or dtype that does not match the other rows, or a ``start > 0`` on a
                full-attention cache (nothing is added then).
        """
        rows = [(r[0], r[1], int(r[2]) if len(r) > 2 else 0) for r in rows]
        geo = None if self.keys is None else (self.keys.shape[1], self.keys.shape[3], self.values.shape[3],
                                               self.keys.dtype)
        for k, v, s in rows:
            if s and (self.max_size is None or k is None):
                raise ValueError(f"RaggedKVCache.add_row: start {s} on a full-attention cache or an empty row")
            if k is None and v is None:
                continue
            if k is None or v is None or k.ndim != 4 or k.shape[0] != 1 or v.ndim != 4 or v.shape[:3] != k.shape[:3]:
                raise ValueError(f"RaggedKVCache.add_row: keys/values must be [1, H, L, D], got "
                                 f"{None if k is None else tuple(k.shape)} / {None if v is None else tuple(v.shape)}")
            g = (k.shape[1], k.shape[3], v.shape[3], k.dtype)
            if geo is not None and g != geo:
                raise ValueError(f"RaggedKVCache.add_row: row {tuple(k.shape)} {k.dtype} does not match "
                                 f"the batch's {geo[:3]} {geo[3]}")
            geo = g
        held = [0 if k is None else int(k.shape[2]) for k, _, _ in rows]
        lens = [h + s for h, (_, _, s) in zip(held, rows)]
        starts = [s for _, _, s in rows]
        if geo is None:  # only empty rows so far: no buffers yet
            self._set_lengths(self._lengths + lens, self._starts + starts)
            return
        H, Dk, Dv, dtype = geo
        if self.keys is None:  # the rows already here are empty: zero buffers for them
            cap = max(-(-max(held) // self.step) * self.step, self.step)
            n0 = len(self._lengths)
            self.keys = mx.zeros((n0, H, cap, Dk), dtype)
            self.values = mx.zeros((n0, H, cap, Dv), dtype)
        self._grow(max(held))
        cap = self._capacity()
        ks, vs = [self.keys], [self.values]
        for (k, v, _), L in zip(rows, held):
            if k is None:
                ks.append(mx.zeros((1, H, cap, Dk), dtype))
                vs.append(mx.zeros((1, H, cap, Dv), dtype))
            else:
                pad = [(0, 0), (0, 0), (0, cap - L), (0, 0)]
                ks.append(mx.pad(k, pad))
                vs.append(mx.pad(v, pad))
        self.keys = mx.concatenate(ks, axis=0)
        self.values = mx.concatenate(vs, axis=0)
        self._set_lengths(self._lengths + lens, self._starts + starts)

    def keep_rows(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` (in that order); the capacity shrinks to what the row holding most
        needs (rounded up to :attr:`step`). ``keep`` empty: the cache becomes empty."""
        keep = [int(i) for i in keep]
        if not keep:
            self.keys = self.values = None
            self._set_lengths([], [])
            return
        lengths, starts = [self._lengths[i] for i in keep], [self._starts[i] for i in keep]
        if self.keys is None:
            self._set_lengths(lengths, starts)
            return
        cap = max(-(-max(n - s for n, s in zip(lengths, starts)) // self.step) * self.step, self.step)
        idx = mx.array(keep, dtype=mx.int32)
        self.keys, self.values = self.keys[idx, :, :cap], self.values[idx, :, :cap]
        self._set_lengths(lengths, starts)

    def row(self, i: int) -> tuple:
        """Row ``i`` as :meth:`add_rows` takes it: ``(keys [1, H, L, Dk], values [1, H, L, Dv], start)`` of
        the ``L = lengths[i] - starts[i]`` positions it holds (lazy slices), or ``(None, None, 0)`` while
        the cache holds no K/V."""
        if self.keys is None:
            return None, None, 0
        n = self._lengths[i] - self._starts[i]
        return self.keys[i : i + 1, :, :n], self.values[i : i + 1, :, :n], self._starts[i]

    def extract(self, i: int) -> KVCache | WindowKVCache:
        """Row ``i`` as a single sequence's cache (a copy: e.g. a finished request's prompt cache): an
        mlx-lm ``KVCache``, or for a window a :class:`~.caches.WindowKVCache` holding what the row needs: its
        window and rollback slack."""
        k, v, s = self.row(i)
        if self.max_size is not None and k is not None:  # what a WindowKVCache keeps: the window and its slack
            cut = max(0, self._lengths[i] - (self.max_size - 1 + self.slack) - s)
            if cut:
                k, v, s = k[..., cut:, :], v[..., cut:, :], s + cut
        if self.max_size is None:
            c = KVCache()
        else:
            c = WindowKVCache(self.max_size, slack=self.slack)
            c.start = s
        if k is not None:
            c.keys, c.values = mx.contiguous(k), mx.contiguous(v)
        c.offset = self._lengths[i]
        return c


@dataclass
class BatchEvent:
    """What one request did since the last :meth:`SpeculativeBatch.step`.

    Attributes:
        uid: the request's id (from :meth:`SpeculativeBatch.add`).
        tokens: token ids emitted (in order; the prefill's first token comes in the first event).
        finish_reason: ``None`` while running; ``"stop"`` (an EOS id was emitted, the last token),
            ``"length"`` (``max_tokens`` reached or the context is full) or ``"cancelled"``.
        stats: the request's :class:`~.speculative.SpecStats` (updated in place while it runs;
            ``None`` for a request with ``max_tokens == 0``).
        logprobs: for a request added with ``logprobs=True``: per token, the target's (processed)
            log-probabilities ``[V]`` at its position, evaluated (what the solo loop yields); else None.
        from_draft: per token, whether it was an accepted draft (as the solo loop's ``from_draft``).
        round: how the round these tokens came from was counted in ``stats``
            (:meth:`~.speculative.SpecStats.record_round`'s arguments), None for the first token's event: a
            consumer that stops inside it takes it back (:meth:`SpeculativeBatch.stop`).
    """

    uid: int
    tokens: list[int]
    finish_reason: str | None = None
    stats: SpecStats | None = None
    logprobs: list[mx.array] | None = None
    from_draft: list[bool] = field(default_factory=list)
    round: tuple | None = None


@dataclass
class _Request:
    uid: int
    max_tokens: int
    eos: frozenset
    block_size: int
    tap_ids: tuple
    session: object
    verifier: Verifier
    stats: SpecStats
    history: list[int]  # prompt + emitted tokens (the anchor last)
    proposer: object = None
    keep_state: bool = False
    draft_temperature: float = 0.0
    draft_key: mx.array | None = None  # split once per round that drafts, as the solo loop does
    want_logprobs: bool = False
    adaptive: bool = False  # the proposer's adaptive schedule chooses its rounds while it is the only row
    trees: bool = False  # it may verify tree drafts while it is the only row (greedy, no processors, a tree target)
    snapshots: dict = field(default_factory=dict)  # hybrid targets: prompt position -> recurrent arrays
    n_out: int = 0
    out: list[int] = field(default_factory=list)  # emitted, not yet reported
    out_lp: list = field(default_factory=list)  # their logprobs (want_logprobs only)
    out_draft: list = field(default_factory=list)  # their from_draft flags
    finish: str | None = None
    streak: int = 0  # plain rounds in a row, the last one included (run-ahead)
    last_round: tuple | None = None  # (drafts, accepted, record_round's arguments) of its last round

    def record(self, n: int, a: int, emitted: int, source: str, cut: bool) -> None:
        """Count a round that proposed ``n``, accepted ``a`` and emitted ``emitted`` tokens (``cut``: it stopped
        inside the round: only the drafts up to the stop count, as in the solo loop)."""
        args = (min(n, emitted), min(a, emitted), emitted, source, n + 1) if cut else (n, a, emitted, source, None)
        self.stats.record_round(*args)
        self.last_round = (n, a, args)

    def event(self, finish: str | None) -> BatchEvent:
        """The tokens not yet reported as an event (and forget them)."""
        ev = BatchEvent(self.uid, self.out, finish, self.stats,
                        self.out_lp if self.want_logprobs else None, self.out_draft,
                        self.last_round if self.out else None)  # (no round yet: the first token's event)
        self.out, self.out_lp, self.out_draft = [], [], []
        return ev


def _kept(session):
    """``session`` made fit to be kept in a state (a prompt cache's): its drafter's queued features copied out of
    the rounds' and prefills' arrays of every row into one array of its own rows, evaluated (``compact``; a queue of
    a single view held the whole array: the breaker helpers of sessions 46 and 48)."""
    d = session.drafter_session
    if d is not None:
        d.compact()
    return session


@dataclass
class _Verify:
    """A round's target forward and accepts, queued (:meth:`SpeculativeBatch._verify`); ``read``: what the host
    read waits for; ``host``: the ids it reads, packed (one transfer)."""

    props: list
    widths: list
    M: int
    tree: object
    tres: object
    taps: dict | None
    starts: list
    results: list
    best: mx.array | None
    drafts: list  # (row, int32 draft ids) of each plain row the host compares: its drafts, or a stand-in token
    read: list
    host: mx.array  # int32: best, drafts, then (num_accepted, tokens) of each row with its own verifier
    key: mx.array | None = None  # a step queued ahead: its row's verifier key before it (restored if dropped)


@dataclass
class _Join:
    """A request being prefilled (a row of the batch's join cache): ``todo`` = prompt tokens not fed yet."""

    req: _Request
    prompt_len: int
    todo: list[int]
    fed: int
    progress: object
    tic: float


class WidthSchedule:
    """The verify width of a batched round, chosen by measured throughput (issue 22: "verify width under load").

    A round over ``N`` rows verifies a padded ``[N, M]`` block, so its cost grows with ``N * M`` wherever
    the target's forward is bound by compute (MLX's CPU backend; a GPU past the rows it absorbs for the
    price of one), while what it gains is each row's accepted drafts. With many rows, verifying every
    row's full block can make speculation slower than plain batched decoding. This schedule caps the
    round's width ``M`` (each row's drafts are cut to ``M - 1``) at one of ``caps`` (``1``: a plain
    batched step, no proposer call) and learns, per batch size bucket (``N`` = 2, 3-4, 5-8, 9-16, ...),
    the cap with the most emitted tokens per second: an exponential moving average of each round's
    ``emitted / (seconds * rows)`` per (bucket, cap) (per row: a bucket's rounds have different row counts, and a
    cap measured at 8 rows must not look faster than plain measured later at 5), found by hill climbing from the
    smallest cap (a neighbour of the best cap is tried, the best kept, and its neighbours re-measured after
    ``explore_every`` rounds of the bucket, less often while they keep losing: the best cap moves as the rows'
    acceptance and lengths change), so a cap past a slower one costs no trial round. A round in a step where
    requests joined is counted, not measured (:meth:`record`). A batch of one is never capped (the solo
    behaviour: its proposer's adaptive schedule, where the request allows it, chooses its rounds instead).

    **Plain rounds are priced as what they are**: the narrowest cap's seconds per round are bounded by those of
    any wider cap (a narrower round does part of a wider one's work on the same rows, so it costs no more), and
    its first round right after a wider one is left out as settling, the next round running it again, measured
    (on the H200, plain rounds of 16 drafting rows measured 21-32 ms right after drafting ones and rounds of width
    4 whose drafts were all rejected 11 ms: width 4 looked twice as fast as plain and the batch drafted for
    nothing; session 25's trace).

    **Trial rounds are bounded**: a re-measurement of a losing cap costs what its round costs more than
    a round of the best cap (on a CPU a drafting round of 32 rows costs ~2.6 plain ones), so it waits
    until that extra time is at most ``budget`` of the rounds since its last measurement; a wider cap
    must measure ``margin`` faster than the one below it to be chosen (a noisy round alone does not
    widen the rounds), and a cap narrower than the best (a cheaper round) is re-measured after a quarter
    of the wait (one stalled round measured at it does not hold the batch at a wider cap); a round
    :attr:`outlier` times slower than its cap's average (or the best cap's, scaled by width) is left out
    once (a stall, e.g. a GPU backend building kernels); and a bucket met for the first time (rows joined
    or left) starts at the best cap
    of the nearest bucket measured, trying the narrower neighbour at once (a cheaper round) and the
    wider one once its extra cost, as that bucket measured it, fits in the budget (no fresh costly
    trial rounds at every change of the batch size).

    The idea of scheduling widths under a per-round budget is vLLM's confidence-scheduled verification
    (vLLM 0.28 with DSpark); this is its throughput-measured form, with no cost model to calibrate.

    Lossless: a greedy row's output does not depend on how many drafts it verifies (a cut draft is a
    shorter proposal; verification stays exact). Rows with a sampling verifier keep their own widths
    (a seeded sampled request's tokens then do not depend on its neighbours; capping them would keep
    the target distribution but change which random numbers meet which positions); a round without a greedy
    row is neither chosen nor measured (every cap would be the same round: a fresh user's find, all caps of two
    sampled rows measured at the same 177-193 ms and the best reported as 2).

    Args:
        caps: candidate widths (tokens verified per row, anchor included), ascending, >= 1.
        explore_every: rounds of a bucket between two re-measurements of its least recent cap.
        decay: weight of the old average in each update (0..1).
        budget: the most of a bucket's time its trial rounds may cost beyond rounds of its best cap (> 0).
        margin: how much faster (tokens/s) a cap must measure than the cap below it to be preferred
            (a wider round costs more; noise alone should not widen the batch's rounds).

    Raises:
        ValueError: empty ``caps``, a cap < 1, ``explore_every`` < 2, ``decay`` outside [0, 1) or
            ``budget`` <= 0.
    """

    max_backoff = 5  # a losing neighbour is re-measured at most every explore_every * 2**5 rounds (or budget)
    #: a round this many times slower than its cap's own average (else the best cap's, scaled by the widths) is
    #: left out once: a stall (a GPU backend building kernels for a shape met for the first time: 24 s for one
    #: round on the H200, session 24) must not price a cap out for thousands of rounds; a second one in a row
    #: counts (the cap really is that slow)
    outlier = 8.0

    def __init__(self, caps: Sequence[int] = (1, 2, 4, 8, 16), explore_every: int = 16, decay: float = 0.7,
                 budget: float = 0.03, margin: float = 0.05):
        caps = sorted({int(c) for c in caps})
        if not caps or caps[0] < 1:
            raise ValueError(f"caps must be widths >= 1, got {caps}")
        if explore_every < 2 or not 0.0 <= decay < 1.0 or not budget > 0 or not 0.0 <= margin < 1.0:
            raise ValueError("explore_every must be >= 2, decay in [0, 1), budget > 0 and margin in [0, 1)")
        self.caps, self.explore_every, self.decay, self.budget = caps, int(explore_every), float(decay), float(budget)
        self.margin = float(margin)
        self.rate: dict = {}  # (bucket, cap) -> EMA of emitted tokens / s per row (what choose compares)
        self.secs: dict = {}  # (bucket, cap) -> EMA of seconds per round
        self.last: dict = {}  # (bucket, cap) -> round number of its last measurement
        self.strikes: dict = {}  # (bucket, cap) -> re-measurements in a row that lost to the best cap
        self.rounds: dict = {}  # bucket -> rounds run
        self.seeds: dict = {}  # bucket -> (start cap, {cap: (strikes, seconds / best's)}) from its nearest bucket
        self.doubted: set = set()  # (bucket, cap) whose last round was left out as a stall (outlier)
        self.count: dict = {}  # (bucket, cap) -> rounds measured
        self.stalls: dict = {}  # (bucket, cap) -> rounds left out as stalls
        self.settling: dict = {}  # (bucket, cap) -> rounds left out as settling (the narrowest cap after a wider)
        self.joined: dict = {}  # (bucket, cap) -> rounds left out because requests joined in their step
        self.agg: dict = {}  # (bucket, cap) -> EMA of emitted tokens / s (the batch's, for summary)
        self._last_cap: int | None = None  # the cap of the last round recorded (any bucket)
        self._settle: int | None = None  # a bucket whose next round runs the narrowest cap again, measured

    @staticmethod
    def bucket(n_rows: int) -> int:
        """The batch-size bucket of ``n_rows`` (1, 2, 3-4, 5-8, ... share a bucket)."""
        return max(1, int(n_rows) - 1).bit_length()

    def _wait(self, strikes: int, cost: float, narrower: bool = False) -> float:
        """Rounds between two measurements of a cap that lost ``strikes`` times in a row and whose rounds
        cost ``cost`` times the best cap's. A cap narrower than the best is taken as no costlier (its
        measured cost can be one stalled round) and re-measured after a quarter of the wait, so one slow
        round measured at a narrow cap does not leave the batch at a wider one for long."""
        if narrower:
            return max(2, (self.explore_every << strikes) // 4)
        return max(self.explore_every << strikes, (cost - 1.0) / self.budget)

    def _seed(self, b: int):
        """The start of bucket ``b`` (first seen): the best cap of the nearest measured bucket and what it
        measured of the others (strikes, seconds per round relative to its best), or None."""
        if b not in self.seeds:
            measured = sorted({bb for bb, _ in self.rate if bb != b}, key=lambda bb: (abs(bb - b), bb))
            seed = None
            if measured:
                nb = measured[0]
                known = [c for bb, c in self.rate if bb == nb]
                best = self._best(nb, known)
                seed = (best, {c: (self.strikes.get((nb, c), 0), self.secs[(nb, c)] / self.secs[(nb, best)])
                               for c in known if c != best})
            self.seeds[b] = seed
        return self.seeds[b]

    def choose(self, n_rows: int, max_width: int, explore: bool = True) -> int | None:
        """The width cap of the next round (``None``: no cap) for ``n_rows`` rows whose widest
        block is ``max_width`` tokens; ``explore=False`` for a round that will not be measured (requests joined
        in its step, :meth:`record`): the best cap measured, no trial (an untried cap would otherwise be tried
        at every step of a long prompt's chunked prefill).

        Hill climbing over the caps in ascending order (each one costlier to try than the last on a
        compute-bound target): start at the smallest (or at the best cap of the nearest bucket measured),
        try an untried neighbour of the best cap so far (one the nearest bucket measured: once its
        re-measurement would be due), else keep the best, re-measuring a neighbour once ``explore_every``
        rounds have passed since its last measurement, doubled for each re-measurement in a row that lost
        to the best (up to ``2 ** max_backoff``), and no sooner than its extra cost over a round of the
        best fits in ``budget`` of the rounds since. A cap past a slower one is never tried unless the best
        moves next to it (a 16-row batch on a CPU never pays for a trial at width 16 when width 2 already
        measured slower than 1). The narrowest cap (plain rounds) is a neighbour of every best cap: a plain
        round has no drafter forward, so its rate is not on the slope from cap 2 up (session 52 on an H100:
        buckets of 9-32 rows started at cap 16, measured 2 slower than 4-16 and never ran a plain round); tried
        at once where untried, re-measured after the full wait of a wider cap, not a quarter."""
        if n_rows < 2 or max_width <= 1:
            return None
        b = self.bucket(n_rows)
        arms = [c for c in self.caps if c < max_width] + [max_width]
        if self._settle == b:  # the narrowest cap's round after a wider one settled: now the measured one
            return arms[0]
        known = [c for c in arms if (b, c) in self.rate]
        seed = self._seed(b) if not self.rounds.get(b) else self.seeds.get(b)
        if not known:
            if seed is None:
                return arms[0]
            return max([c for c in arms if c <= seed[0]], default=arms[0])
        i = arms.index(self._best(b, known))
        if not explore:
            return arms[i]
        near = [arms[j] for j in (i - 1, i + 1) if 0 <= j < len(arms)]
        if i > 1:  # the narrowest cap (plain rounds with the default caps: no drafter forward, not one step down
            near.insert(0, arms[0])  # from a drafting cap) is always a neighbour
        r = self.rounds.get(b, 0)
        for c in near:
            if (b, c) not in self.rate:
                prior = seed[1].get(c) if seed is not None else None
                # untried here: at once, or, where the seed bucket found its rounds costlier than its
                # best's, once that extra cost fits in the budget
                if prior is None or c < arms[i] or r >= (prior[1] - 1.0) / self.budget:
                    return c
        best = arms[i]
        # (the narrowest cap, where it is no neighbour of the best by order, waits as a wider cap would: a review's
        # count, where a wide cap wins it took ~1.6 % of the rounds for ever at a quarter of the wait)
        due = [c for c in near if (b, c) in self.rate and r - self.last[(b, c)]
               >= self._wait(self.strikes.get((b, c), 0), self.secs[(b, c)] / self.secs[(b, best)],
                             c < best and (i < 2 or c != arms[0]))]
        if due:
            return min(due, key=lambda c: self.last[(b, c)])
        return best

    def _rate(self, b: int, c: int, rate: dict | None = None, secs: dict | None = None) -> float:
        """The rate (tokens/s) of cap ``c`` in bucket ``b`` as :meth:`choose` compares it. For the narrowest cap
        (plain rounds), its seconds per round are bounded by the fewest any wider cap measured there: a plain round
        does part of a wider round's work on the same rows (no drafter forward, fewer tokens verified), so where
        its rounds measured more (a cost they do not cause: work queued before them, stalls) its tokens per round
        are priced at the wider cap's seconds. Only the narrowest cap is bounded: bounding every cap by a lucky
        round of a wider one made the comparison one of tokens per round, which favours wide caps
        (``benchmarks/schedule_sim.py``, noisy costs: 0.81 of the best fixed cap against 0.97).
        ``rate``/``secs``: copies of the moving averages (:meth:`summary`, read from another thread)."""
        rate, secs = (self.rate if rate is None else rate), (self.secs if secs is None else secs)
        own = secs[(b, c)]
        if c != self.caps[0]:
            return rate[(b, c)]
        floor = min((s for (bb, w), s in secs.items() if bb == b and w > c), default=own)
        return rate[(b, c)] * own / min(own, floor)

    def _score(self, b: int, c: int, rate: dict | None = None, secs: dict | None = None) -> float:
        """The rate of cap ``c`` in bucket ``b`` as compared (:meth:`_rate`): handicapped by ``margin`` per cap
        below it (a wider cap must measure that much faster than a narrower one to be chosen: a wider round
        costs more, and a noisy measurement alone should not move the batch to it)."""
        k = self.caps.index(c) if c in self.caps else len(self.caps)
        return self._rate(b, c, rate, secs) * (1.0 - self.margin) ** k

    def _expected(self, b: int, cap: int) -> float | None:
        """Seconds a round of ``cap`` in bucket ``b`` (none measured there) should take at most, from the
        nearest measured bucket: its cap's average (else its best cap's, scaled by width), doubled per bucket
        step (a bucket holds up to twice the rows of the one below); None if no bucket is measured."""
        measured = sorted({bb for bb, _ in self.rate if bb != b}, key=lambda bb: (abs(bb - b), bb))
        if not measured:
            return None
        nb = measured[0]
        if (nb, cap) in self.secs:
            e = self.secs[(nb, cap)]
        else:
            best = self._best(nb, [c for bb, c in self.rate if bb == nb])
            e = self.secs[(nb, best)] * max(1.0, cap / best)
        return e * 2.0 ** abs(b - nb)

    def _best(self, b: int, known) -> int:
        return max(known, key=lambda c: (self._score(b, c), -c))

    def summary(self) -> dict:
        """What the schedule has measured, per batch-size bucket (for ``GET /metrics`` and benchmarks).

        Returns:
            ``{"2 rows" | "3-4 rows" | ...: {"best_cap": int, "rounds": int, "caps": {"1": {"rounds": int,
            "stalls": int, "settling": int, "joined": int, "ms_per_round": float, "tokens_per_s": float,
            "tokens_per_row_s": float, "compared_tokens_per_row_s": float, "score": float}, ...}}}``: rounds
            measured at each cap (stalls: rounds left out as :attr:`outlier`; settling: the narrowest cap's rounds
            right after a wider one, left out; joined: rounds of steps where requests joined, left out), the moving
            averages of seconds per round (in ms), of emitted tokens per second (the batch's) and per row and second
            (what :meth:`choose` measures), the per-row rate it compares (seconds per round bounded by a wider
            cap's: :meth:`_rate`), that rate handicapped by ``margin`` per narrower cap (``score``: the cap with the
            highest is ``best_cap``), and the cap it prefers now.
        """
        rate, secs, count, stalls = dict(self.rate), dict(self.secs), dict(self.count), dict(self.stalls)
        settling, joined, agg = dict(self.settling), dict(self.joined), dict(self.agg)
        out = {}
        for b in sorted({bb for bb, _ in rate}):
            known = sorted(c for bb, c in rate if bb == b)
            lo, hi = (2, 2) if b == 1 else (2 ** (b - 1) + 1, 2 ** b)
            out[f"{lo} rows" if lo == hi else f"{lo}-{hi} rows"] = {
                "best_cap": self._best(b, known), "rounds": self.rounds.get(b, 0),
                "caps": {str(c): {"rounds": count.get((b, c), 0), "stalls": stalls.get((b, c), 0),
                                  "settling": settling.get((b, c), 0), "joined": joined.get((b, c), 0),
                                  "ms_per_round": 1e3 * secs[(b, c)], "tokens_per_s": agg[(b, c)],
                                  "tokens_per_row_s": rate[(b, c)],
                                  "compared_tokens_per_row_s": self._rate(b, c, rate, secs),
                                  "score": self._score(b, c, rate, secs)} for c in known}}
        return out

    def record(self, n_rows: int, cap: int, emitted: int, seconds: float, measured: bool = True) -> None:
        """Account one round: ``emitted`` tokens in ``seconds`` under ``cap`` with ``n_rows`` rows.

        ``measured=False``: a round whose seconds hold other work, counted but not measured (the step's
        prefill of joining requests: MLX evaluates its lazy cache writes in the round's forward, and on this
        CPU the first round of 8 rows after their joins measured 127 ms against 95, so plain looked slower
        than a drafting trial and the batch tried widths 2 and 4 for nothing; session 27). A measured plain
        round that a settling one asked for is then still due."""
        if seconds <= 0:
            return
        b = self.bucket(n_rows)
        r = self.rounds.get(b, 0)
        self.rounds[b] = r + 1
        prev, self._last_cap = self._last_cap, cap
        if not measured:
            self.joined[(b, cap)] = self.joined.get((b, cap), 0) + 1
            return
        if cap == self.caps[0] and prev is not None and prev > cap and self._settle != b:
            # the narrowest (plain) round right after a wider one: not measured, the next round runs it again and
            # is. On the H200 such rounds cost 2x the plain rounds that follow plain ones (session 25's trace of 16
            # drafting rows: 21-32 ms against 11 ms), so a lone trial priced plain out while drafting lost
            self._settle = b
            self.settling[(b, cap)] = self.settling.get((b, cap), 0) + 1
            return
        self._settle = None
        x = emitted / (seconds * max(1, n_rows))  # per row: a bucket's rounds have 5 to 8 rows, and so on
        old, a = self.agg.get((b, cap)), emitted / seconds
        self.agg[(b, cap)] = a if old is None else self.decay * old + (1.0 - self.decay) * a
        known = [c for (bb, c) in self.rate if bb == b]
        best = self._best(b, known) if known else None
        if best is not None:
            expect = self.secs.get((b, cap)) or self.secs[(b, best)] * max(1.0, cap / best)
        else:  # the bucket's first round (rows joined or left: a new shape): from the nearest measured bucket
            expect = self._expected(b, cap)
        if expect is not None and seconds > self.outlier * expect and (b, cap) not in self.doubted:
            self.doubted.add((b, cap))  # a stall: not measured (an untried cap is tried again next)
            self.stalls[(b, cap)] = self.stalls.get((b, cap), 0) + 1
            return
        self.doubted.discard((b, cap))
        self.count[(b, cap)] = self.count.get((b, cap), 0) + 1
        old = self.rate.get((b, cap))
        self.rate[(b, cap)] = x if old is None else self.decay * old + (1.0 - self.decay) * x
        old = self.secs.get((b, cap))
        self.secs[(b, cap)] = seconds if old is None else self.decay * old + (1.0 - self.decay) * seconds
        self.last[(b, cap)] = r
        if best is not None and cap != best:  # a re-measurement: back off while it keeps losing
            lost = self._score(b, cap) < self._score(b, best)
            self.strikes[(b, cap)] = min(self.strikes.get((b, cap), 0) + 1, self.max_backoff) if lost else 0


def warm_up_shapes(max_batch: int, block_size: int) -> tuple[list[int], list[int]]:
    """The row counts and verify widths a server's start-up :meth:`SpeculativeBatch.warm_up` runs: rows 2, 3,
    4, 6, 8, 12, ... up to ``max_batch`` (and it), widths the :class:`WidthSchedule`'s caps up to
    ``block_size`` (and it). Returns ``(rows, widths)`` (rows empty below 2)."""
    rows = sorted({r for r in (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if r <= max_batch}
                  | ({max_batch} if max_batch >= 2 else set()))
    widths = sorted({c for c in WidthSchedule().caps if c <= block_size} | {max(1, block_size)})
    return rows, widths


class SpeculativeBatch:
    """A batch of speculative requests (greedy or sampled) on one target (dense, hybrid GatedDeltaNet or
    sliding-window), advanced one round at a time.

    Usage::

        batch = SpeculativeBatch(target)
        uid = batch.add(prompt_ids, max_tokens=64, proposer=p, eos_token_ids={eos})
        while batch.active or batch.pending:
            for ev in batch.step():
                ...  # ev.uid, ev.tokens, ev.finish_reason

    Args:
        target: a :class:`~.target.TargetAdapter` whose layers are full attention (dense llama, mistral,
            qwen2, qwen3), sliding-window attention (Gemma 3/4's sliding layers, a Mistral-style window on
            every layer: its ``WindowKVCache`` layers) or GatedDeltaNet (the recurrent layers of
            ``qwen3_next`` / ``qwen3_5`` hybrids).
        proposer: the default proposer of :meth:`add` (``None``: plain decoding).
        block_size: the default verify width ``B`` (default: the proposer's).
        prefill_step_size: prompt chunk length of a join's prefill (tokens).
        schedule: ``"full"`` (every row verifies its whole proposal: the solo loop's rounds, so a row's
            statistics equal its solo ones) or ``"auto"`` (a :class:`WidthSchedule` caps the width of
            rounds with two rows or more by measured throughput: what the server runs), or a
            :class:`WidthSchedule`.
        trees: a request that is the batch's only row verifies tree drafts where the solo loop would
            (:func:`~.speculative.start_request`'s ``trees``: its proposer proposes them, a greedy verifier
            without logits processors, a :attr:`~.target.TargetAdapter.tree_capable` target), so a batch of
            one runs the solo loop's rounds; rows of a batch of several verify chains (``False``: chains
            always).
    Raises:
        TargetCompatibilityError: a target with a cache kind other than these (named).
        ValueError: an unknown ``schedule``.
    """

    def __init__(self, target: TargetAdapter, proposer: Proposer | None = None, *, block_size: int | None = None,
                 prefill_step_size: int = 2048, schedule: "str | WidthSchedule" = "full", trees: bool = True):
        kinds = target.make_cache()
        bad = sorted({type(c).__name__ for c in kinds
                      if type(c) is not KVCache and not isinstance(c, (RecurrentCache, WindowKVCache))})
        if bad:
            raise TargetCompatibilityError(
                "batched rounds support full-attention, sliding-window and GatedDeltaNet (recurrent) layers only; "
                f"this target has {', '.join(bad)} layers")
        if isinstance(schedule, WidthSchedule):
            self.schedule = schedule
        elif schedule == "auto":
            self.schedule = WidthSchedule()
        elif schedule == "full":
            self.schedule = None
        else:
            raise ValueError(f"schedule must be 'full', 'auto' or a WidthSchedule, got {schedule!r}")
        self.target = target
        self.proposer = proposer
        self.block_size = block_size
        self.trees = bool(trees)
        self.prefill_step_size = int(prefill_step_size)
        self._recurrent = [i for i, c in enumerate(kinds) if isinstance(c, RecurrentCache)]  # GatedDeltaNet layers
        self.cache = self._make_caches(kinds)
        self._rows: list[_Request] = []  # row i of the cache is self._rows[i]
        self._jcache = self._make_caches(kinds)  # requests being prefilled (joins)
        self._joining: list[_Join] = []  # row i of the join cache is self._joining[i]
        self._events: list[BatchEvent] = []  # finished at join, cancelled: reported by the next step
        self._states: dict[int, GenerationState] = {}  # final states of finished keep_state requests
        self._next_uid = 0
        self._ahead: _Verify | None = None  # a lone row's plain step queued before its last round's read
        self._evals: list = []  # lazy drafter work of the last round (compacted queues, flushes): run with the next
        #: the last round's geometry: rows, tokens verified (real, padding excluded), block width M,
        #: the schedule's width cap (None: none)
        self.last_round: dict = {"rows": 0, "verified": 0, "width": 0, "cap": None}
        #: the last step's prefill of joins: rows fed, prompt tokens fed (0, 0: none)
        self.last_prefill: dict = {"rows": 0, "tokens": 0}
        #: ``None`` (default), or a dict: each step then synchronises at the borders of its phases and adds
        #: their seconds to it (``prefill``, ``propose``, ``verify``: target forward and accept, ``commit``:
        #: per-row rollback, session updates, emission), for profiling (``benchmarks/profile_batch.py``)
        self.timings: dict | None = None
        #: ``None`` (default), or a callable of no arguments run where a step's host is about to wait for the
        #: device: after the round's forward is queued, before its read (and before a prefill's evaluation), or,
        #: in a round where a row proposes drafts, before the proposals (a drafter's may read its forward). The
        #: server hands out the previous step's events there, so in plain rounds its HTTP thread takes the GIL
        #: while the device works, not while the worker builds the round (session 48). It may run more than once
        #: a step and must not touch the batch.
        self.on_wait: Callable[[], None] | None = None

    @staticmethod
    def _make_caches(kinds: list) -> list:
        """The batch's cache entries for a solo cache's kinds: :class:`RaggedKVCache` per attention layer
        (windowed as its :class:`~.caches.WindowKVCache`: same window and rollback slack),
        :class:`~.caches.RaggedRecurrentCache` per GatedDeltaNet layer."""
        return [RaggedRecurrentCache(c.max_record) if isinstance(c, RecurrentCache)
                else RaggedKVCache(c.max_size, c.slack) if isinstance(c, WindowKVCache) else RaggedKVCache()
                for c in kinds]

    @staticmethod
    def _row_lengths(cache: list) -> list[int]:
        """Per-row positions of a list of batch cache entries (every layer holds the same)."""
        c = cache[0]
        return c.positions if isinstance(c, RaggedRecurrentCache) else c.lengths

    # -- membership -------------------------------------------------------------------------------
    @property
    def active(self) -> int:
        """Requests in the batch: rows of the cache and requests still being prefilled."""
        return len(self._rows) + len(self._joining)

    @property
    def pending(self) -> bool:
        """Whether the next :meth:`step` has work or something to report without a round (prefills of
        joins, finished joins, cancels)."""
        return bool(self._events) or bool(self._joining) or any(r.out for r in self._rows)

    def lengths(self) -> list[int]:
        """Per-row committed cache lengths (row order = join order of the active requests)."""
        return self._row_lengths(self.cache)

    def stats(self, uid: int) -> SpecStats:
        """The statistics of an active request.

        Raises:
            KeyError: ``uid`` is not active.
        """
        for r in self._rows + [j.req for j in self._joining]:
            if r.uid == uid:
                return r.stats
        raise KeyError(f"request {uid} is not active")

    def add(self, prompt: Sequence[int], max_tokens: int = 256, *, proposer: Proposer | None = None,
            block_size: int | None = None, verifier: Verifier | None = None,
            eos_token_ids: Sequence[int] = (), state: GenerationState | None = None, keep_state: bool = False,
            draft_temperature: float = 0.0, draft_key: mx.array | None = None, logprobs: bool = False,
            adaptive: bool = False, prompt_progress_callback=None, stats: SpecStats | None = None) -> int:
        """Queue a request: validated and set up now (as the solo loop does), prefilled by the next
        :meth:`step` calls together with the other joins (chunked, interleaved with the rounds of the
        requests already decoding), then a row of the batch.

        Its first token is reported by the step that finishes its prefill. A request that ends at its
        first token (an EOS, ``max_tokens == 1``, a full context) never becomes a row; one with
        ``max_tokens == 0`` is reported by the next step without being prefilled. A proposer's adaptive
        schedule (:class:`~.proposers.AdaptiveSchedule` of a ``FusedProposer``: drafter, lookup or plain
        round by measured tokens/s) chooses this request's rounds only with ``adaptive`` and only while it
        is the batch's one row: its timings are per request, a batch's rounds are shared (rows drafting
        together, the :class:`WidthSchedule`'s cap). A batch of one then runs the solo loop's adaptive
        rounds.

        Args:
            prompt: token ids (non-empty).
            max_tokens: tokens to generate at most (``-1``: until EOS or the context limit).
            proposer: this request's proposer (default: the batch's; ``None`` for both: plain decoding).
            block_size: its verify width B (default: the batch's, else the proposer's).
            verifier: its verifier (default :class:`~.verify.GreedyVerifier`): any
                :class:`~.verify.Verifier`, e.g. a :class:`~.verify.RejectionVerifier` with its own key
                and logits processors (penalties, logit bias), as :func:`~.api.request_sampling` builds
                it; the batch calls it once for the first token and once per round, as the solo loop
                does (its key advances alike).
            eos_token_ids: ids that end the request (emitted, then ``finish_reason == "stop"``).
            state: a prompt-cache :class:`~.speculative.GenerationState` to start from (its common prefix
                with ``prompt`` is reused, only the rest is prefilled; a hybrid target's recurrent layers
                resume from the longest snapshot at or before it, as in the solo loop); the batch takes it
                over (it must not be used elsewhere afterwards). A batch's and a solo loop's states serve
                either.
            keep_state: keep the request's final state (its row's K/V and recurrent arrays, its proposer
                session, the tokens they hold; a hybrid target's prompt snapshots, taken every
                :data:`~.speculative.SNAPSHOT_INTERVAL` prompt tokens) when it finishes, for
                :meth:`take_state` (or return it from :meth:`remove`).
            draft_temperature, draft_key: the request's drafter sampling (as the solo loop's: the key
                is split once per round that drafts; 0 / None: greedy drafts).
            logprobs: report each token's log-probabilities in :attr:`BatchEvent.logprobs`.
            adaptive: let the proposer's adaptive schedule choose this request's rounds while it is the
                batch's only row (the solo loop's ``adaptive``; what
                :func:`~.api.request_sampling` allows: not for a seeded sampled request, whose tokens
                must not depend on timings). False (default): it drafts every round, as in a batch.
            prompt_progress_callback: ``f(processed, total)`` during the prefill (from the steps).
            stats: a :class:`~.speculative.SpecStats` to fill (default: a new one, :meth:`stats`).

        Returns:
            The request id.

        Raises:
            ValueError: bad ``max_tokens`` (named), an empty prompt, a prompt at or beyond the context
                limit, a bad block size (:func:`~.speculative.start_request`'s checks); nothing is added.
        """
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < -1:
            raise ValueError(f"max_tokens must be an integer >= -1 (-1: unbounded), got {max_tokens!r}")
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        uid = self._next_uid
        if max_tokens == 0:
            self._next_uid += 1
            self._events.append(BatchEvent(uid, [], "length"))
            return uid
        proposer = proposer if proposer is not None else self.proposer
        B = block_size if block_size is not None else self.block_size
        stats = stats if stats is not None else SpecStats()
        setup = start_request(prompt, self.target, proposer, verifier=verifier, block_size=B, stats=stats,
                              state=state, adaptive=bool(adaptive), trees=self.trees)
        trees = setup.session.trees  # what the solo loop would allow this request (start_request decides)
        setup.session.adaptive = setup.session.trees = False  # set round by round (step): while it is the only row
        self._next_uid += 1
        req = _Request(uid, max_tokens, frozenset(int(e) for e in eos_token_ids), setup.block_size,
                       setup.tap_ids, setup.session, setup.verifier, stats, list(prompt),
                       proposer=setup.proposer, keep_state=keep_state, draft_temperature=draft_temperature,
                       draft_key=draft_key, want_logprobs=bool(logprobs), adaptive=bool(adaptive), trees=trees,
                       snapshots=dict(state.snapshots) if state is not None and keep_state else {})
        n = setup.reused
        for layer, c in zip(self._jcache, setup.cache):
            if isinstance(layer, RaggedRecurrentCache):  # the state after the reused prefix (or a fresh row)
                layer.add_rows([(c.cache[0], c.cache[1], n) if n else (None, None, 0)])
            elif isinstance(c, WindowKVCache) and n:  # the rows it still holds, positions start .. n - 1
                layer.add_row(*c.held(), c.start)
            else:
                layer.add_row(*((c.keys[..., :n, :], c.values[..., :n, :]) if n else (None, None)))
        progress = prompt_progress_callback or (lambda *_: None)
        self._joining.append(_Join(req, len(prompt), prompt[n:], n, progress, time.perf_counter()))
        progress(0, len(prompt))
        return uid

    def cancel(self, uid: int) -> bool:
        """Drop an active request now (its row and state, or its unfinished prefill); the next
        :meth:`step` reports it as ``"cancelled"`` with any tokens not yet reported. Returns False if
        ``uid`` is not active."""
        self._drop_ahead()
        for i, j in enumerate(self._joining):
            if j.req.uid == uid:
                self._drop_joins([i])
                self._events.append(j.req.event("cancelled"))
                return True
        for i, r in enumerate(self._rows):
            if r.uid == uid:
                self._drop([i])
                self._events.append(r.event("cancelled"))
                return True
        return False

    def remove(self, uid: int) -> GenerationState | None:
        """Drop an active request now, without an event (its consumer has stopped it, e.g. at a stop
        string); returns its final state if it was added with ``keep_state``, else None (also for a
        request still being prefilled). Tokens it emitted but were not reported yet are discarded.
        Does nothing (None) if ``uid`` is not active.
        """
        self._drop_ahead()
        for i, j in enumerate(self._joining):
            if j.req.uid == uid:
                self._drop_joins([i])
                return None
        for i, r in enumerate(self._rows):
            if r.uid == uid:
                st = self._row_state(i) if r.keep_state else None
                self._drop([i])
                return st
        return None

    def take_state(self, uid: int) -> GenerationState | None:
        """The final state of a finished ``keep_state`` request (once; None if there is none): a
        :class:`~.speculative.GenerationState` whose ``cache`` / ``session`` hold exactly ``tokens`` (the
        prompt and the emitted tokens but the last), for a prompt cache."""
        return self._states.pop(uid, None)

    def _row_state(self, i: int) -> GenerationState:
        """Row ``i`` as a standalone state (a copy of its K/V and recurrent arrays; the session and the
        prompt snapshots are handed over). The row holds exactly its tokens but the last (a request stopped
        inside a round too: its commit kept only what it emitted)."""
        r = self._rows[i]
        return GenerationState(cache=[c.extract(i) for c in self.cache], session=_kept(r.session),
                               tokens=r.history[:-1], proposer=r.proposer, snapshots=r.snapshots)

    def _drop(self, rows: list[int]) -> None:
        keep = [i for i in range(len(self._rows)) if i not in set(rows)]
        for i in rows:
            self._rows[i].session.end_run()  # (an adaptive schedule's held timings settled, as the solo loop's end)
        for c in self.cache:
            c.keep_rows(keep)
        self._rows = [self._rows[i] for i in keep]
        if self._evals and not self._rows:  # no next round to take the last one's drafter work: the batch ran dry
            mx.async_eval(self._evals)  # (a step's end, remove, cancel, stop: their graphs hold every row's features)
            self._evals = []

    def _drop_joins(self, rows: list[int]) -> None:
        keep = [i for i in range(len(self._joining)) if i not in set(rows)]
        for c in self._jcache:
            c.keep_rows(keep)
        self._joining = [self._joining[i] for i in keep]

    def _prefill(self) -> None:
        """One prefill chunk of every request being joined, in one target forward: row ``i`` feeds its
        next ``min(len(todo_i), prefill_step_size)`` prompt tokens (right-padded to the widest; the
        padding's K/V are rolled back as a verify's rejected rows are, and the GatedDeltaNet layers of a
        hybrid target mask it: each row's recurrent state and conv window end at its own last real token).
        On a hybrid target a ``keep_state`` request's chunks end at multiples of
        :data:`~.speculative.SNAPSHOT_INTERVAL`, where its recurrent arrays are kept for a later prompt
        cache (the solo loop's snapshots). A request whose prompt is then complete
        gets its first token exactly as the solo loop's prefill gives it (its verifier on the logits at
        its last prompt token, an empty proposal, the prompt as history) and moves to the batch's cache
        (or finishes there, e.g. at an EOS); the others go on at the next step."""
        J = self._joining
        n = [min(len(j.todo), self.prefill_step_size) for j in J]
        every = speculative.SNAPSHOT_INTERVAL
        if self._recurrent:  # snapshot positions end the chunks of requests whose state is kept
            n = [min(k, every - j.fed % every) if j.req.keep_state else k for j, k in zip(J, n)]
        M = max(n)
        block = mx.array([j.todo[:k] + [0] * (M - k) for j, k in zip(J, n)], dtype=mx.int32)
        tap_ids = tuple(dict.fromkeys(t for j in J for t in j.req.tap_ids))
        if min(n) < M:  # each row's recurrence stops at its own last real token (no padding: an unmasked forward,
            # whose chunks past the cache's max_record run the routed gated_delta_final on a GPU)
            for li in self._recurrent:
                self._jcache[li].prepare(n)
        h, taps = self.target._call(lambda: self.target.inner(block, cache=self._jcache), tap_ids)
        fin = [i for i, (j, k) in enumerate(zip(J, n)) if k == len(j.todo)]
        firsts = []
        if fin:
            last = h[mx.array(fin, mx.int32), mx.array([n[i] - 1 for i in fin], mx.int32)]  # [F, D]
            logits = self.target.logits(last)
            firsts = [J[i].req.verifier.verify(logits[f : f + 1], Proposal.empty(), J[i].req.history)
                      for f, i in enumerate(fin)]
        for i, (j, k) in enumerate(zip(J, n)):
            feats = None
            if j.req.tap_ids:
                feats = mx.concatenate([taps[t].out[i, :k] for t in j.req.tap_ids], axis=-1)
            j.req.session.extend(j.todo[:k], feats)
        for c in self._jcache:
            if isinstance(c, RaggedKVCache):  # the padding's K/V (the recurrent layers masked it)
                c.trim_rows([M - k for k in n])
        snaps = []
        for i, (j, k) in enumerate(zip(J, n)):
            if self._recurrent and j.req.keep_state and (j.fed + k) % every == 0:
                snap = [(li, self._jcache[li].extract(i).cache) for li in self._recurrent]
                j.req.snapshots[j.fed + k] = snap
                for p in sorted(j.req.snapshots)[:-speculative.MAX_SNAPSHOTS]:
                    del j.req.snapshots[p]
                snaps += [a for _, arrays in snap for a in arrays]
        # the joins' drafter contexts: appended now (one projection per drafter) where no row is running (a batch
        # of one: its first drafting round then costs what it did) or where a join's queue is due (a long prompt's
        # chunks); else their features wait in the queue, evaluated (they hold no forward graph), for the row's
        # next proposal or the batch's next flush (flush_rows): under load, most requests never draft (session 46,
        # an H100, 8 rows: a plain round that appended the rows' queues took 17-29 ms, the others ~8 ms)
        sessions = [j.req.session for j in J]
        now = [s for s in sessions if s.drafter_session is None or not self._rows or s.drafter_session.flush_due]
        self._flush(now)
        # the joins' first tokens in one array (one transfer after the evaluation, not a .item() each)
        first_ids = mx.concatenate([v.tokens[:1].astype(mx.int32) for v in firsts]) if firsts else None
        if self.on_wait is not None:
            self.on_wait()
        mx.eval([a for c in self._jcache for a in c.state] + [a for s in sessions for a in s.held_arrays()]
                + [x for v in firsts for x in (v.tokens, v.logprobs)] + snaps
                + ([first_ids] if first_ids is not None else []))
        self.last_prefill = {"rows": len(J), "tokens": sum(n)}
        for j, k in zip(J, n):
            j.todo, j.fed = j.todo[k:], j.fed + k
            j.progress(j.fed, j.prompt_len)
        if not fin:
            return
        moved, gone = [], []
        for i, v, first in zip(fin, firsts, first_ids.tolist()):
            r = J[i].req
            r.history.append(first)
            r.out, r.out_draft, r.n_out = [first], [False], 1
            if r.want_logprobs:
                r.out_lp = [v.logprobs[0]]
            r.stats.generated_tokens = 1
            r.stats.prefill_s = time.perf_counter() - J[i].tic
            r.finish = self._finished(r, first, J[i].prompt_len)
            if r.finish is None:
                moved.append(i)
                continue
            self._events.append(r.event(r.finish))
            if r.keep_state:
                self._states[r.uid] = GenerationState(cache=[c.extract(i) for c in self._jcache],
                                                      session=_kept(r.session), tokens=r.history[:-1],
                                                      proposer=r.proposer, snapshots=r.snapshots)
            gone.append(i)
        if moved:
            for main, c in zip(self.cache, self._jcache):
                main.add_rows([c.row(i) for i in moved])
            self._rows.extend(J[i].req for i in moved)
        self._drop_joins(moved + gone)

    def warm_up(self, rows: Sequence[int], widths: Sequence[int], *, proposer: Proposer | None = None,
                block_size: int | None = None, prompt_len: int = 16,
                stop: Callable[[], bool] | None = None) -> dict:
        """Run the batched round's shapes once, on scratch caches, before any request meets them.

        Why: MLX's CUDA backend builds some of its own kernels (NVRTC) the first time a shape class of
        an op is met; a verify block of 8 rows x 4 tokens, first met mid-serving, stalled one round for
        24 s on the H200 (session 24: a server at 16 clients ran at 39 tok/s where it runs at ~600).
        This method meets them up front: for every row count ``r`` of ``rows`` (those >= 2: one row
        runs the solo loop's path, which the width calibration warms), ``r`` scratch requests of a
        ``prompt_len``-token prompt join a scratch batch (the joins' prefill), run one round with
        ``proposer`` at ``block_size`` (the batched drafter forward and a verify), the drafter proposes
        ``M - 1`` drafts for every row for every ``M`` of ``widths`` (with ``fit_blocks`` a block per
        width, 2, 4, 8, 16 slots), then the target verifies a ``[r, M]`` block for every ``M`` (the logits
        of every row, the proposer's taps), its K/V rolled back. Nothing of this batch (``self``) changes; the scratch
        batch is dropped. Outputs do not change (a warm-up only moves compile time to here).

        Args:
            rows: batch sizes to warm (rows per round), e.g. ``2 .. max_batch``.
            widths: verify widths ``M`` (tokens per row, anchor included, >= 1), e.g. the
                :class:`WidthSchedule`'s caps up to the block size.
            proposer: the proposer of the scratch requests (default: the batch's; ``None``: plain rounds).
            block_size: their block size B (default: the batch's, else the proposer's).
            prompt_len: scratch prompt length (tokens, >= 1).
            stop: asked before each row count; True ends the warm-up there (a server stopped while it warms up).

        Returns:
            ``{"shapes": verify blocks run, "seconds": wall time}``.

        Raises:
            ValueError: a width < 1 or ``prompt_len`` < 1.
        """
        widths = sorted({int(m) for m in widths})
        if not widths or widths[0] < 1 or prompt_len < 1:
            raise ValueError(f"warm_up: widths must be >= 1 and prompt_len >= 1, got {widths}, {prompt_len}")
        proposer = proposer if proposer is not None else self.proposer
        B = block_size if block_size is not None else self.block_size
        t0, shapes = time.perf_counter(), 0
        for r in sorted({int(n) for n in rows if int(n) >= 2}):
            if stop is not None and stop():
                break
            scratch = SpeculativeBatch(self.target, proposer, block_size=B, prefill_step_size=self.prefill_step_size)
            for i in range(r):  # distinct small ids per row (any valid id will do)
                scratch.add([1 + (i + k) % 64 for k in range(prompt_len)], 1 + max(widths) + (B or 1))
            scratch.step()  # the joins' prefill, then one round at the requests' own widths
            if not scratch._rows:
                continue
            n = len(scratch._rows)
            tap_ids = tuple(dict.fromkeys(t for q in scratch._rows for t in q.tap_ids))
            for M in widths:  # the drafters' forwards of M - 1 drafts (with fit_blocks, a block per width)
                calls: dict = {}
                for q in scratch._rows:
                    prop = q.session.begin(q.history[-1], M - 1) if M > 1 else None
                    if isinstance(prop, DraftCall):
                        calls.setdefault(id(prop.proposer), (prop.proposer, []))[1].append(prop)
                for drafter, cs in calls.values():
                    mx.eval([p.tokens for p in drafter.propose_many(cs)])
            for M in widths:
                block = mx.zeros((n, M), mx.int32)
                h, taps = self.target._call(lambda: self.target.inner(block, cache=scratch.cache), tap_ids)
                logits = self.target.logits(h.reshape(n * M, -1))
                mx.eval([mx.argmax(logits, axis=-1)] + [taps[t].out for t in tap_ids])
                for c in scratch.cache:
                    c.trim_rows([M] * n)
                shapes += 1
        return {"shapes": shapes, "seconds": time.perf_counter() - t0}

    @staticmethod
    def _flush(sessions) -> list:
        """Run the queued drafter-context appends of ``sessions`` (those with a DFlash drafter) together:
        one :meth:`~.proposers.DFlashProposer.flush` per drafter. Returns the drafter sessions."""
        groups: dict = {}
        for s in sessions:
            d = s.drafter_session
            if d is not None and d.queued:
                groups.setdefault(id(d.p), (d.p, []))[1].append(d)
        for p, ds in groups.values():
            p.flush(ds)
        return [d for _, ds in groups.values() for d in ds]

    def _mark(self, phase: str, t0: float, arrays=()) -> float:
        """With :attr:`timings` on: evaluate ``arrays``, wait for the device, add the seconds since ``t0``
        to ``phase``; returns the time now."""
        if self.timings is None:
            return t0
        mx.eval(list(arrays))
        mx.synchronize()
        t = time.perf_counter()
        self.timings[phase] = self.timings.get(phase, 0.0) + (t - t0)
        return t

    def _finished(self, req: _Request, tok: int, pos: int) -> str | None:
        """Why ``req`` stops after emitting ``tok`` whose position is ``pos`` (None: it goes on)."""
        limit = self.target.max_context
        if tok in req.eos:
            return "stop"
        if (req.max_tokens >= 0 and req.n_out >= req.max_tokens) or (limit is not None and pos >= limit):
            return "length"
        return None

    # -- the round --------------------------------------------------------------------------------
    def _runs_ahead(self, r: _Request) -> bool:
        """Whether a lone row's plain rounds queue the next plain step before their host read (the solo
        loop's pipelining): plain decoding (block size 1) always, as ``mlx_lm``'s ``generate_step``; a
        speculative request's plain rounds (the adaptive schedule's, or lookup without a match) only for a
        greedy verifier on a GPU (:data:`~.speculative.RUN_AHEAD`: on the CPU the device is the host, so
        nothing overlaps and a dropped step is pure loss). Never for a verifier that reads the history
        (penalties: the queued step cannot see its anchor) or while :attr:`timings` is on."""
        if self.timings is not None or r.verifier.needs_history:
            return False
        if r.block_size == 1:
            return True
        ahead = speculative.RUN_AHEAD
        return r.verifier.greedy and (ahead == "always" or (ahead == "gpu" and mx.default_device().type == mx.gpu))

    def _drop_ahead(self) -> None:
        """Drop the plain step queued ahead (its one cache row; the recurrent layers take back its forward; its
        row's sampled verifier gets back the key it had before it, so the random stream does not depend on whether a
        step was queued ahead: the breaker helper of session 48, a seeded row's tokens changed when another joined)."""
        if self._ahead is not None:
            if self._ahead.key is not None:
                self._rows[0].verifier.key = self._ahead.key
            self._ahead = None
            for c in self.cache:
                c.trim_rows([1] + [0] * (len(self._rows) - 1))

    def _verify(self, rows: list, props: list, widths: list, anchors: mx.array | None = None) -> _Verify:
        """Build the target forward of a round (``[N, M]`` block, or a lone row's tree) and every row's accept,
        queued (``mx.async_eval``), nothing read. ``anchors``: int32 ``[1]``, the lone row's anchor not yet
        read (a plain step queued ahead); default each row's last history token."""
        M = max(widths)
        tap_ids = tuple(dict.fromkeys(t for r in rows for t in r.tap_ids))
        tree = props[0].tree  # a lone row's tree draft (else None): the solo loop's tree forward
        taps = tres = None
        if tree is not None:
            verify_in = mx.concatenate([mx.array([rows[0].history[-1]], mx.int32), props[0].tokens.astype(mx.int32)])
            tres = self.target.forward(verify_in, self.cache, tap_ids, tree=tree)
            logits = tres.logits
        else:
            if anchors is not None:
                block = anchors.astype(mx.int32).reshape(1, 1)
            elif M == 1:  # a plain round: the anchors only, known on the host
                block = mx.array([[r.history[-1]] for r in rows], mx.int32)
            else:
                # [N, M]: row i = [anchor_i, drafts_i, 0 ...], one gather from the anchors, every row's drafts and a
                # zero: the same operations whichever rows are narrower, so a batch's consecutive drafting rounds
                # evaluate one sequence of operations and MLX's CUDA graphs (cached by topology) serve them
                # (issue 22, session 54, benchmarks/round_graphs.py; a zero padding of the narrower rows only
                # made every round's sequence new)
                # (a row without drafts brings a one-token stand-in: the concatenation has 2N + 1 inputs every
                # round, and a GPU copies each input with a kernel of its own: the breaker helper of session 54)
                N, stand_in = len(rows), mx.array([0], mx.int32)  # (a host constant: no kernel of its own)
                drafts = [p.tokens.astype(mx.int32) if p.n else stand_in for p in props]
                at, idx = N, []
                for i, (p, w) in enumerate(zip(props, widths)):
                    idx.append([i] + [at + j for j in range(p.n)])
                    at += max(p.n, 1)
                idx = [x + [at] * (M - len(x)) for x in idx]
                src = mx.concatenate([mx.array([r.history[-1] for r in rows], mx.int32), *drafts,
                                      mx.array([0], mx.int32)])
                block = src[mx.array(idx, mx.int32)]
            h, taps = self.target._call(lambda: self.target.inner(block, cache=self.cache), tap_ids)
            # the LM head on the real rows only ([sum(w), V]; padding never reaches it; a drafting round of several
            # rows gathers them even where every row is as wide as the widest: one sequence of operations)
            if M == 1 or len(rows) == 1:
                logits = self.target.logits(h.reshape(len(rows) * M, -1))
            else:
                real = mx.array([i * M + j for i, w in enumerate(widths) for j in range(w)], mx.int32)
                logits = self.target.logits(h.reshape(len(rows) * M, -1)[real])
        starts = [sum(widths[:i]) for i in range(len(widths))]
        # Plain greedy rows (no logits processors, no logprobs: most requests) share one argmax over every real
        # row and are compared with their drafts on the host, the reference of kernels.greedy_accept (first
        # maximal id); the others run their own verifier (penalties, logit bias, sampling, logprobs).
        plain = [type(r.verifier) is GreedyVerifier and not r.verifier.params.processors and not r.want_logprobs
                 and p.tree is None for r, p in zip(rows, props)]
        results = [None if pl else r.verifier.verify(logits[s0 : s0 + w], p, r.history)
                   for r, p, w, s0, pl in zip(rows, props, widths, starts, plain)]
        best = mx.argmax(logits, axis=-1).astype(mx.int32) if any(plain) else None
        # (in a drafting round of several rows a plain row without drafts reads a one-token stand-in: the same
        # concatenation below every round; _round reads past it)
        pad = M > 1 and len(rows) > 1
        drafts = [(i, p.tokens.astype(mx.int32) if p.n else mx.array([0], mx.int32))  # (a host constant: no kernel)
                  for i, (p, pl) in enumerate(zip(props, plain)) if pl and (p.n or pad)]
        # every id the host reads of the round in one int32 array, read with one transfer: the argmax, the plain
        # rows' drafts, then each other row's accepted count and tokens (a slice's .tolist() or a scalar's .item()
        # per row evaluates on its own and releases the GIL: session 48, 8 sampled drafter rows read ~9.5 times a
        # round beside the server's HTTP thread)
        parts = (([best] if best is not None else []) + [d for _, d in drafts]
                 + [x.reshape(-1).astype(mx.int32) for vr in results if vr is not None
                    for x in (vr.num_accepted, vr.tokens)])
        host = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        read = [host] + [vr.logprobs for r, vr in zip(rows, results) if r.want_logprobs]
        mx.async_eval(read + self._evals)  # (with the drafter work the last round queued: _round)
        self._evals = []
        return _Verify(props, widths, M, tree, tres, taps, starts, results, best, drafts, read, host)

    # -- the round --------------------------------------------------------------------------------
    def step(self) -> list[BatchEvent]:
        """Run one round over every active request (if any) and report what each emitted.

        Returns:
            One :class:`BatchEvent` per request that emitted tokens or finished since the last call
            (joins' first tokens, cancellations, then the round's rows in row order).
        """
        self.last_prefill = {"rows": 0, "tokens": 0}
        self.last_round = {"rows": 0, "verified": 0, "width": 0, "cap": None}
        if self._joining:
            self._drop_ahead()  # the joins change the rows: a plain step queued ahead is dropped
            t0 = time.perf_counter() if self.timings is not None else 0.0
            self._prefill()
            self._mark("prefill", t0)
        events = self._events
        self._events = []
        if not self._rows:
            return events
        tic = time.perf_counter()
        limit = self.target.max_context
        rows = self._rows
        ahead, self._ahead = self._ahead, None  # a lone row's plain step queued by the last round (one row more)
        lengths = self.lengths()
        if ahead is not None:
            lengths[0] -= 1

        # 1. proposals, one per request (greedy rows cut to the schedule's width cap); the drafter
        # forwards of every request that drafts with the same DFlash drafter run as one
        cap = None
        greedy = [r for r in rows if isinstance(r.verifier, GreedyVerifier)]
        if self.schedule is not None and greedy:  # the cap cuts greedy rows only: without any, nothing to choose
            # a step that prefilled joins is not measured (record): it runs the best cap, no trial
            cap = self.schedule.choose(len(rows), max(r.block_size for r in greedy),
                                       explore=not self.last_prefill["rows"])
        lone = len(rows) == 1
        chain = lone and self._runs_ahead(rows[0])
        for r in rows:  # a lone row's rounds are the solo loop's (its adaptive schedule and trees, where allowed)
            r.session.adaptive = r.adaptive and lone
            r.session.trees = r.trees and lone
            r.session.plain_pipelined = chain  # an adaptive schedule times pipelined plain runs by their steady rounds
        try:
            props = self._propose(rows, lengths, cap, limit, lone)
        except BaseException:  # (a proposer failed: the plain step queued ahead is dropped, the row left exact)
            if ahead is not None:
                self._ahead = ahead
                self._drop_ahead()
            raise
        if len(rows) > 1 and any(p.n and p.source != "lookup" for p in props) and drafts_apart():
            mx.async_eval([a for p in props if p.n for a in (p.tokens, p.cand_ids, p.q) if a is not None])
        t_verify = self._mark("propose", tic, [p.tokens for p in props]) if self.timings is not None else 0.0
        widths = [p.n + 1 for p in props]
        for r, p in zip(rows, props):
            r.streak = r.streak + 1 if p.n == 0 else 0
        return self._round(rows, lengths, props, widths, ahead, cap, limit, chain, tic, t_verify, events)

    def _propose(self, rows: list, lengths: list, cap: int | None, limit: int | None, lone: bool) -> list:
        """Every row's proposal of this round (its width cut by ``cap``, its ``max_tokens`` and the context
        ``limit``); the DFlash drafter calls of all rows as one forward per drafter."""
        props: list[Proposal | None] = []
        calls: dict = {}  # id(drafter) -> (drafter, [(row, DraftCall)])
        ns = []
        for r, P in zip(rows, lengths):
            n = r.block_size - 1
            if cap is not None and isinstance(r.verifier, GreedyVerifier):
                n = min(n, cap - 1)
            if r.max_tokens >= 0:
                n = min(n, r.max_tokens - r.n_out - 1)
            if limit is not None:
                n = min(n, limit - P - 1)
            ns.append(n)
        if self.on_wait is not None and any(n > 0 for n in ns):
            self.on_wait()  # (a drafter's proposal may read its forward: a request's events wait for no drafter)
        for i, (r, n) in enumerate(zip(rows, ns)):
            prop = Proposal.empty()
            if n > 0:
                sub = None
                if r.draft_key is not None:  # the solo loop's order: one split per round that drafts
                    r.draft_key, sub = mx.random.split(r.draft_key)
                if r.session.trees:  # the solo loop's proposal (a tree draft, a lookup grafted into it)
                    prop = r.session.propose(r.history[-1], n, r.draft_temperature, sub)
                else:
                    prop = r.session.begin(r.history[-1], n, r.draft_temperature, sub)
                if isinstance(prop, DraftCall):
                    calls.setdefault(id(prop.proposer), (prop.proposer, []))[1].append((i, prop))
                    prop = None
            props.append(prop)
        for drafter, items in calls.values():
            for (i, call), dp in zip(items, drafter.propose_many([c for _, c in items])):
                props[i] = call.done(dp)
        for i, p in enumerate(props):
            if p.tree is not None and p.tree.is_chain:  # verified as a chain (as the solo loop's build does)
                props[i] = replace(p, tree=None)
            elif p.tree is not None and not (lone and self.trees and rows[0].verifier.trees_ok
                                             and self.target.tree_capable):
                # the solo loop's rule (a custom proposer's tree too, whatever its ``trees``): verified as a chain
                # it would emit wrong tokens
                why = ("a row of a batch of several cannot verify" if not lone else
                       "this request cannot verify (trees need a greedy request without logits processors on a "
                       "dense target, in a SpeculativeBatch with trees)")
                raise ValueError(f"request {rows[i].uid}'s proposer proposed a tree draft, which {why}")
        return props

    def _round(self, rows, lengths, props, widths, ahead, cap, limit, chain, tic, t_verify, events):
        """Steps 2-5 of :meth:`step` (target forward, accept, commit / rollback, emission) for ``props``."""
        # 2. one target forward over the padded block (padding after each row's real tokens): the plain step
        # queued ahead if this round is one (its proposal empty), else built now; 3. every row's accept
        if ahead is not None and props[0].n == 0:
            ver = replace(ahead, props=props)
        else:
            if ahead is not None:  # a drafting round: the step queued ahead is dropped (one row trimmed)
                self._ahead = ahead
                self._drop_ahead()
            ver = self._verify(rows, props, widths)
        M, tree, tres, taps, starts, results = ver.M, ver.tree, ver.tres, ver.taps, ver.starts, ver.results
        self.last_round = {"rows": len(rows), "verified": sum(widths), "width": M, "cap": cap}
        # a lone row's plain round queues the next plain step on its token before the read (run-ahead)
        nxt = None
        r0 = rows[0]
        # (not in a step that prefilled: its event also holds the first token, and a consumer stopping there
        # cuts this round whole, which a recurrent layer can do only while it is the last forward)
        if (chain and M == 1 and not self._joining and not self.last_prefill["rows"]
                and (r0.block_size == 1 or r0.streak >= PLAIN_RUN_AHEAD_AFTER)
                and (r0.max_tokens < 0 or r0.n_out + 1 < r0.max_tokens)
                and (limit is None or lengths[0] + 1 < limit)):
            tok = ver.best[:1] if results[0] is None else results[0].tokens[:1]
            key = getattr(r0.verifier, "key", None)  # (a sampled verifier draws from its key as it builds the step)
            nxt = replace(self._verify(rows, [Proposal.empty()], [1], anchors=tok), key=key)
        # one host synchronisation for the batch
        if self.on_wait is not None:
            self.on_wait()
        mx.eval(ver.read)
        ids = ver.host.tolist()  # (unpacked in _verify's order)
        pos = ver.best.size if ver.best is not None else 0
        best_ids, spans = ids[:pos], {}  # row -> the ids of its entry in ver.drafts
        for i, d in ver.drafts:
            spans[i] = ids[pos : pos + d.size]
            pos += d.size
        own: dict = {}  # row -> (accepted, its verifier's tokens)
        for i, vr in enumerate(results):
            if vr is not None:
                own[i] = (ids[pos], ids[pos + 1 : pos + 1 + vr.tokens.size])
                pos += 1 + vr.tokens.size
        t_commit = self._mark("verify", t_verify) if self.timings is not None else 0.0

        # 4. per-request commit / rollback, emission
        trims, done, total = [], [], 0
        tapped: dict = {}  # tap ids -> [N, M, k*D] features of the round
        for i, (r, p, vr, w) in enumerate(zip(rows, props, results, widths)):
            if vr is None:
                toks, a = best_ids[starts[i] : starts[i] + w], 0
                for d, t in zip(spans.get(i, [])[: p.n], toks):
                    if d != t:
                        break
                    a += 1
                toks = toks[: a + 1]
            else:
                a, toks = own[i]
                toks = toks[: a + 1]
            r.session.verified(a + 1)
            P = lengths[i]
            feats = None
            if tree is not None:  # the accepted path's K/V rows first, as if fed alone (then the usual trim)
                kept = vr.rows[: a + 1]
                compact_cache(self.cache, P, vr.rows, a + 1)
                feats = tres.features[kept] if r.tap_ids else None
            elif r.tap_ids:
                if r.tap_ids not in tapped:  # every row's features of these taps: one concatenation
                    tapped[r.tap_ids] = mx.concatenate([taps[t].out for t in r.tap_ids], axis=-1)
                feats = tapped[r.tap_ids][i, : a + 1]
            r.session.extend([r.history[-1]] + toks[:a], feats)
            emitted = 0
            for j, tok in enumerate(toks):
                r.history.append(tok)
                r.out.append(tok)
                r.out_draft.append(j < a)
                if r.want_logprobs:
                    r.out_lp.append(vr.logprobs[j])
                r.n_out += 1
                emitted += 1
                r.finish = self._finished(r, tok, P + j + 1)
                if r.finish is not None:
                    break
            r.stats.generated_tokens = r.n_out
            total += emitted
            trims.append(M - emitted)  # the row keeps [anchor, d_1..d_{emitted - 1}]: its tokens but the last
            cut = emitted < len(toks)  # stopped inside the round: only the drafts up to the stop count
            r.record(p.n, a, emitted, p.source, cut)
            if cut and r.keep_state:  # its state holds exactly the emitted tokens but the last (the cache: trims)
                r.session.truncate(P + emitted)
            if r.finish is not None:
                done.append(i)
        for c in self.cache:
            c.trim_rows(trims)
        if nxt is not None:
            self._ahead = nxt
            if done:  # it finished at this round: the step queued ahead is not needed
                self._drop_ahead()
        # drafter contexts that queued many rows (plain rounds under load: a request's rows wait for its next
        # proposal) are appended together: once any row's queue is due (flush_rows), every row's, one projection per
        # drafter for the whole batch (a queue never holds on to more than flush_rows rows of target features)
        live = [r.session for i, r in enumerate(rows) if i not in done and r.session.drafter_session is not None]
        if any(s.drafter_session.flush_due for s in live):
            self._evals += [a for d in self._flush(live) for a in d.state_arrays()]
        # the drafter queues compacted this round (and a flush) are evaluated with the next round's forward, not
        # on their own: an evaluation releases the GIL, and under a server's HTTP thread getting it back cost up to
        # the switch interval each time (issue 22, session 47: 8 drafter rows' plain rounds ran 1.6x plain ones)
        self._evals += [a for s in live for a in s.drafter_session.take_evals()]
        if self.timings is not None:
            self._mark("commit", t_commit)
        after = self._row_lengths(self.cache)
        for i, r in enumerate(rows):
            want = len(r.history) - 1 + (self._ahead is not None)
            if after[i] != want:
                raise RuntimeError(f"batch invariant broken: row {i} holds {after[i]} positions, "
                                   f"its request {want}")
        if self._recurrent and any(self._row_lengths([c]) != after for c in self.cache):
            raise RuntimeError("batch invariant broken: the layers' caches disagree on the rows' lengths")

        dt = time.perf_counter() - tic
        if cap is not None:  # a step that prefilled joins: its cache writes ran in this round (not measured)
            self.schedule.record(len(rows), cap, total, dt, measured=not self.last_prefill["rows"])
        for i, r in enumerate(rows):
            r.stats.decode_s += dt  # the rounds it took part in
            if r.out or r.finish is not None:
                events.append(r.event(r.finish))
            if r.finish is not None and r.keep_state:
                self._states[r.uid] = self._row_state(i)
        if done:
            self._drop(done)  # (a batch run dry evaluates the round's drafter work there)
        return events

    def stop(self, uid: int, taken: int) -> GenerationState | None:
        """Request ``uid``'s consumer stopped after taking ``taken`` of its tokens (counted from its first, over
        every event reported so far), inside the last event (e.g. at a stop string): the request is cut back to
        exactly those tokens, as the solo loop cuts itself at a stop (its cache row, recurrent state, proposer
        session, history and statistics: its last round is counted up to the stop, a round never handed out not
        at all; a plain step queued ahead is dropped), and leaves the batch.

        A request that has already finished (its last event reported it): :meth:`stopped_after_finish`.

        Args:
            uid: the request.
            taken: tokens its consumer took (>= 1).

        Returns:
            The request's final state if it was added with ``keep_state`` (prompt and taken tokens but the last),
            else None; None for an unknown request or one still being prefilled (dropped).

        Raises:
            ValueError: ``taken`` leaves more tokens untaken than its last round emitted (nothing changes).
        """
        self._drop_ahead()
        for i, r in enumerate(self._rows):
            if r.uid != uid:
                continue
            extra = r.n_out - int(taken)
            last = r.last_round[2][2] if r.last_round is not None else 0
            if extra < 0 or extra > last or (extra and taken < 1):
                raise ValueError(f"SpeculativeBatch.stop: {taken} tokens taken of {r.n_out} emitted, the last "
                                 f"round {last}")
            if extra:
                for c in self.cache:
                    c.trim_rows([extra if k == i else 0 for k in range(len(self._rows))])
                del r.history[len(r.history) - extra:]
                r.n_out = int(taken)
                r.session.truncate(len(r.history) - 1)
                r.stats.generated_tokens = r.n_out
            if r.last_round is not None:  # (the last event holds its tokens: the consumer stopped inside it)
                _cut_round(r.stats, r.last_round, extra)
            r.session.end_run()
            st = self._row_state(i) if r.keep_state else None
            self._drop([i])
            return st
        return self.remove(uid)  # still being prefilled (dropped), or not active

    def stopped_after_finish(self, uid: int, extra: int, stats: SpecStats, last: tuple | None,
                             stopped: bool = True) -> GenerationState | None:
        """:meth:`stop` for a request that had already finished (its last event reported it): its consumer took
        all but ``extra`` of that event's tokens (``stopped``: it stopped there; False: it took them all and the
        request ended by itself). Its statistics' last round (``last``: the event's :attr:`BatchEvent.round`) is
        counted up to the stop, and its kept state (:meth:`take_state`), if any, cut back by ``extra`` tokens and
        returned.

        Raises:
            ValueError: ``extra`` outside ``0 .. `` the last round's tokens.
        """
        n_last = last[2][2] if last is not None else 0
        if extra < 0 or extra > n_last:
            raise ValueError(f"SpeculativeBatch.stopped_after_finish: {extra} tokens untaken, the last round {n_last}")
        st = self.take_state(uid)
        if last is not None and (extra or stopped):
            _cut_round(stats, last, extra)
        if extra:
            stats.generated_tokens -= extra
            if st is not None:
                speculative.trim_cache(st.cache, extra)
                del st.tokens[len(st.tokens) - extra:]
                st.session.truncate(len(st.tokens))
        return st


def _cut_round(stats: SpecStats, last: tuple, extra: int) -> None:
    """Count a request's last round (``last``: :attr:`BatchEvent.round`) as one its consumer stopped inside,
    ``extra`` tokens before its end (0: at its last token): only the drafts at or before the stop count
    (``d_1..d_{k}`` for ``k`` tokens taken, they competed for those positions; the round's verify width stays); a
    round none of whose tokens were taken is not counted at all."""
    n, a, args = last
    stats.record_round(*args, sign=-1)
    kept = args[2] - extra
    if kept > 0:
        stats.record_round(min(n, kept), min(a, kept), kept, args[3], verified=n + 1)
