"""The single-request generator of mlx_dflash2, its setup, statistics and prompt-cache state.

:func:`speculative_generate_step` (what the CLI, :func:`~.api.stream_generate` and the benchmarks call) is a
**batch of one** of the one decoding loop, :class:`~.batch.SpeculativeBatch` (the server runs its requests
through the same class): the request joins a batch, each :meth:`~.batch.SpeculativeBatch.step` is one round,
and its tokens are yielded one at a time (like ``mlx_lm.generate_step``). One round (DFlash2 spec §2.2, §2.4,
§5.7; :mod:`~.batch` has the details):

1. **draft**: the request's proposer session proposes ``d_1..d_n`` after the
   anchor (``n <= B - 1``, shrunk near ``max_tokens`` and the context limit,
   and by the drafter's dynamic draft length if it has one); a greedy request
   may get a tree draft;
2. **verify**: one target forward over ``[anchor, d_1..d_n]`` (appends
   ``n + 1`` rows to the target KV cache, taps on);
3. **accept**: the verifier returns ``a`` and the emitted tokens (one host
   synchronisation per round: ``a`` and the tokens are read together);
4. **commit / rollback**: the target cache keeps ``[anchor, d_1..d_a]`` (the
   other ``n - a`` rows are trimmed); the tap features of those ``a + 1``
   rows become the drafter's new context at the next round;
5. **emit** ``d_1..d_a`` and the correction/bonus token, which is the next
   anchor.

Plain rounds run ahead: the next one-token step is queued on the current round's (lazy) token before the host
reads it (plain decoding always, as mlx-lm's ``generate_step``; a speculative request's plain rounds on a GPU,
:data:`RUN_AHEAD`). A consumer that stops early (EOS, stop string) closes the generator; the request is then cut
back to exactly the consumed tokens (:meth:`~.batch.SpeculativeBatch.stop`): nothing after a stop is emitted,
counted or left in the cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterable

import mlx.core as mx

from .proposers import Proposer
from .target import TargetAdapter, cache_length, trim_cache
from .verify import GreedyVerifier, Verifier

__all__ = ["SpecStats", "speculative_generate_step", "GenerationState", "PLAIN_PROPOSER", "start_request", "RequestSetup"]


@dataclass
class SpecStats:
    """Per-request statistics (units in the field names).

    ``tau`` is the acceptance length: tokens emitted per verify forward of the
    target, bonus/correction included (the prefill's first token is not a
    round). ``accept_hist[k]`` counts rounds with a draft that accepted exactly
    ``k`` of it (rounds without a draft are in ``rounds_by_source["none"]``);
    ``position_accepted[i] / position_proposed[i]`` is the acceptance rate of
    block position ``i + 1``. ``rounds_by_source`` counts rounds by what made
    their draft (``"drafter"``, ``"lookup"``, ``"none"``: no draft).
    ``drafted``, ``accepted`` and the per-position counts end at a stop: in a
    round cut at its emitted token ``i`` (0-based) only the drafts
    ``d_1..d_{i+1}`` count, as if the round had drafted that many.
    ``verify_widths[m]`` counts rounds whose target forward verified ``m``
    rows (the anchor and ``m - 1`` drafts; a stop does not change it).
    ``verify_cost`` / ``drafter_cost``: the calibration the adaptive schedule
    chose widths from (``{M: T(M)/T(1)}``, ``{n: D(n)/T(1)}``: a forward of
    ``M`` rows, a proposal of ``n`` drafts, in plain steps, read at the
    prompt's length: a verify row's cost grows with the context), empty
    without one. ``draft_vocab``: how many ids the drafter proposes from when a
    draft vocabulary restricts it (0: the whole vocabulary, or no drafter).
    """

    drafter: str = "none"
    block_size: int = 1
    draft_confidence: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    rounds: int = 0
    round_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    accept_hist: list[int] = field(default_factory=list)
    position_proposed: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    rounds_by_source: dict[str, int] = field(default_factory=dict)
    verify_widths: dict[int, int] = field(default_factory=dict)
    verify_cost: dict[int, float] = field(default_factory=dict)
    drafter_cost: dict[int, float] = field(default_factory=dict)
    draft_vocab: int = 0

    @property
    def tau(self) -> float:
        return self.round_tokens / self.rounds if self.rounds else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Generated tokens per second after the prefill (mlx-lm's ``generation_tps``: the prefill's
        token counts, its time does not); 0 when no decode round ran (only the prefill's token)."""
        return self.generated_tokens / self.decode_s if self.decode_s > 0 and self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def record_round(self, drafted: int, accepted: int, emitted: int, source: str = "",
                     verified: int | None = None, sign: int = 1) -> None:
        """One verify forward that proposed ``drafted``, accepted ``accepted``
        of them and emitted ``emitted`` tokens (after any stop); ``source``:
        what made the draft (:attr:`~.proposers.Proposal.source`); ``verified``:
        rows of the forward (default ``drafted + 1``; more when a stop cut the
        counted drafts). ``sign=-1`` takes back a round recorded with the same
        arguments (a consumer stopped inside a request's last round after the
        batch had recorded it whole: it is then recorded cut); the statistics
        are then what they would be had it never been recorded."""
        self.rounds += sign
        width = verified if verified is not None else drafted + 1
        src = (source or "drafter") if drafted else "none"
        for d, k in ((self.verify_widths, width), (self.rounds_by_source, src)):
            d[k] = d.get(k, 0) + sign
            if not d[k]:
                del d[k]
        self.round_tokens += sign * emitted
        self.drafted += sign * drafted
        self.accepted += sign * accepted
        if not drafted:
            return
        need = max(drafted + 1, len(self.accept_hist))
        for lst in (self.accept_hist, self.position_proposed, self.position_accepted):
            lst.extend([0] * (need - len(lst)))
        self.accept_hist[accepted] += sign
        for i in range(drafted):
            self.position_proposed[i] += sign
            if i < accepted:
                self.position_accepted[i] += sign
        if sign < 0:  # the lists are as long as the longest draft recorded + 1 (position_proposed[-1] is always 0)
            longest = max((i + 1 for i, v in enumerate(self.position_proposed) if v), default=0)
            n = longest + 1 if longest else 0
            for lst in (self.accept_hist, self.position_proposed, self.position_accepted):
                del lst[n:]

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(tau=self.tau, prefill_tps=self.prefill_tps, decode_tps=self.decode_tps)
        d["acceptance_rate"] = self.acceptance_rate
        return d

    def summary(self) -> str:
        """Human-readable multi-line summary (printed by ``--verbose``), each figure with what it means."""
        if self.rounds:
            gen = f"Generation: {self.generated_tokens} tokens, {self.decode_tps:.2f} tokens-per-sec"
        else:
            gen = f"Generation: {self.generated_tokens} token (the prefill's own; no decode round ran)"
        lines = [
            f"Prompt: {self.prompt_tokens} tokens, {self.prefill_tps:.2f} tokens-per-sec",
            gen,
            f"Drafter: {self.drafter}, block size {self.block_size}"
            + (f", draft vocabulary {self.draft_vocab:,} ids" if self.draft_vocab else "")
            + (f" (dynamic draft length, confidence {self.draft_confidence:g})" if self.draft_confidence else "")
            + f"; rounds {self.rounds}, "
            + (f"acceptance length tau {self.tau:.2f} tokens/target forward" if self.rounds
               else "acceptance length tau - (no round)"),
        ]
        if self.drafted:
            rates = [
                f"{a / p:.2f}" if p else "-" for a, p in zip(self.position_accepted, self.position_proposed)
            ]
            lines.append(f"Acceptance by block position 1..: {' '.join(rates)}"
                         "  (share of the drafts at each block position that the target accepted)")
            lines.append(f"Accepted-length histogram 0..: {' '.join(map(str, self.accept_hist))}"
                         "  (rounds with a draft that accepted 0, 1, 2, ... of its tokens)")
        if self.rounds:
            widths = " ".join(f"{m}:{k}" for m, k in sorted(self.verify_widths.items()))
            lines.append(f"Verify widths: {widths}  (rounds by rows verified per target forward, anchor included)")
        if self.verify_cost:
            cost = " ".join(f"{m}:{r:.2f}" for m, r in sorted(self.verify_cost.items()))
            if self.drafter_cost:
                cost += "; drafter proposal of n drafts " + " ".join(
                    f"n={n}:{r:.2f}" for n, r in sorted(self.drafter_cost.items()))
            lines.append(f"Verify cost T(M)/T(1): {cost}  (calibrated on this machine, in plain steps; "
                         "the widths above were chosen from it)")
        if len(self.rounds_by_source) > 1:
            by = ", ".join(f"{k} {v}" for k, v in sorted(self.rounds_by_source.items()))
            lines.append(f"Rounds by draft source: {by}  (drafter: the drafter proposed; lookup: copied from "
                         "this request's own text; none: a plain one-token step)")
        return "\n".join(lines)


@dataclass
class GenerationState:
    """A request's device state; pass it to the next request as a prompt (prefix) cache.

    After a generation, ``cache`` (target KV) and ``session`` (drafter context,
    lookup history) hold exactly ``tokens`` = the prompt plus the emitted tokens
    but the last (which was never fed to the target). A later request whose
    prompt shares a prefix with ``tokens`` reuses them: the caches are cut back
    to the common prefix and only the rest of the prompt is prefilled.

    The state is mutated in place by the generation that uses it; a server that
    shares one between requests must copy it (``copy.deepcopy``) first.

    Attributes:
        cache: the target KV cache (one ``KVCache`` per layer) or None.
        session: the proposer session or None.
        tokens: token ids whose K/V are in ``cache``.
        proposer: the proposer ``session`` belongs to (reuse requires the same one).
        reused: prompt tokens taken from the cache by the last request.
        snapshots: hybrid (GatedDeltaNet) targets: prompt position -> the recurrent layers' arrays at that
            position (every :data:`SNAPSHOT_INTERVAL` prompt tokens, the last :data:`MAX_SNAPSHOTS`): their
            state cannot be cut back, so a later request resumes from the longest snapshot at or before the
            shared prefix. Empty for other targets.
    """

    cache: list | None = None
    session: object = None
    tokens: list = field(default_factory=list)
    proposer: object = None
    reused: int = 0
    snapshots: dict = field(default_factory=dict)

    def clone(self) -> "GenerationState":
        """An independent copy (own caches and history; the proposer's weights
        and the target are shared): what a server hands to a request that must
        not mutate a cached state."""
        return GenerationState(
            cache=None if self.cache is None else [_clone_cache(c) for c in self.cache],
            session=None if self.session is None else self.session.clone(),
            tokens=list(self.tokens),
            proposer=self.proposer,
            reused=self.reused,
            snapshots=dict(self.snapshots),  # immutable arrays: sharing them is safe
        )


def _clone_cache(c):
    """Independent copy of one layer's cache: the cache's own ``clone()`` (:mod:`~.caches`), or for an
    mlx-lm ``KVCache`` a copy whose arrays are new objects (in-place slice updates of one copy never
    reach the other)."""
    if hasattr(c, "clone"):
        return c.clone()
    new = type(c).__new__(type(c))
    new.__dict__.update(c.__dict__)
    if getattr(c, "keys", None) is not None:
        new.keys, new.values = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
    return new


# Prefix (prompt) cache of targets with recurrent layers (GatedDeltaNet): their state cannot be cut back to an
# arbitrary length, so the prefill keeps a snapshot of every recurrent layer's state at each multiple of
# SNAPSHOT_INTERVAL prompt tokens (the chunks end there), the last MAX_SNAPSHOTS of them; a later request
# reuses the longest snapshot at or before its shared prefix and prefills only the rest.
SNAPSHOT_INTERVAL = 256
MAX_SNAPSHOTS = 8

#: When plain rounds of the speculative loop run ahead (see ``speculative_generate_step``): ``"gpu"`` (the default
#: device is a GPU, where the host's graph build overlaps the device's work), ``"always"`` or ``"never"``.
RUN_AHEAD = "gpu"


def _recurrent_entries(cache: list) -> list[int]:
    from mlx_lm.models.cache import ArraysCache

    return [i for i, c in enumerate(cache) if isinstance(c, ArraysCache)]


def _snapshot(cache: list, rec: list[int]) -> list:
    """The recurrent entries' arrays (immutable MLX arrays: kept by reference, no copy)."""
    return [(i, list(cache[i].cache)) for i in rec]


def _rewind(cache: list, snapshots: dict, want: int) -> int:
    """Cut ``cache`` back to at most ``want`` positions, exactly; returns the length kept (0: nothing
    reusable, the caller starts fresh caches). Every layer trims if it can; otherwise the recurrent
    layers take the longest snapshot at or before ``want`` and the others trim to it."""
    from .caches import rollback_capacity

    off = cache_length(cache)
    want = min(want, off)
    if off - want <= 0 or rollback_capacity(cache) >= off - want:
        trim_cache(cache, off - want)
        return want
    rec = _recurrent_entries(cache)
    others = [c for i, c in enumerate(cache) if i not in rec]
    for p in sorted((p for p in snapshots if p <= want), reverse=True):
        if p == 0 or (others and rollback_capacity(others) < off - p):
            continue
        for i, c in enumerate(cache):
            if i not in rec:
                trim_cache([c], off - p)
        for i, arrays in snapshots[p]:
            c = cache[i]
            c.cache = list(arrays)
            c.offset = p
            if hasattr(c, "commit"):
                c.commit()  # no rollback history across a restore
        return p
    return 0


PLAIN_PROPOSER = Proposer()  # the proposer of plain decoding (one object, so its states can be reused)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class RequestSetup:
    """What :func:`start_request` prepared for one request (see there)."""

    proposer: object
    verifier: Verifier
    block_size: int
    tap_ids: tuple
    cache: list
    session: object
    reused: int


def start_request(prompt: list[int], target: TargetAdapter, proposer: Proposer | None = None, *,
                  verifier: Verifier | None = None, block_size: int | None = None,
                  stats: SpecStats | None = None, state: GenerationState | None = None,
                  adaptive: bool = True, trees: bool = False) -> RequestSetup:
    """Validate a request and prepare its caches, before its prefill: the one setup of the solo loop
    (:func:`speculative_generate_step`) and of a batch's join (:meth:`~.batch.SpeculativeBatch.add`).

    Resolves the block size (``1``: plain decoding), checks it against the proposer and the prompt
    against the context; fills ``stats``' request fields; reuses ``state`` as a prompt cache when it
    holds caches of the same proposer (the common prefix is kept, at least one prompt token is left to
    feed; recurrent layers resume from the longest snapshot at or before it, sliding windows keep only
    what every layer holds), else starts fresh caches and a new proposer session; ``state`` is then
    filled with them (mutated in place, as the loop goes on filling it).

    Args:
        prompt: token ids (non-empty; ``int`` list).
        target, proposer, verifier, block_size, stats, state, adaptive: as
            :func:`speculative_generate_step`'s.
        trees: the caller verifies tree drafts (:mod:`~mlx_dflash2.tree`): the session may propose them where
            the verifier allows (:attr:`~.verify.Verifier.trees_ok`) and the target can run them
            (:attr:`~.target.TargetAdapter.tree_capable`); a batch's rows do not.

    Returns:
        A :class:`RequestSetup`: the effective proposer, verifier and block size, the tap layer ids,
        the target cache (one entry per layer), the proposer session, and ``reused`` (prompt tokens
        whose K/V are already in ``cache``; the caller prefills ``prompt[reused:]``).

    Raises:
        ValueError: empty prompt, a token id outside the target's vocabulary, prompt at or beyond the context
            limit, or a bad block size.
    """
    if not prompt:
        raise ValueError("the prompt must contain at least one token")
    bad = [t for t in prompt if not 0 <= t < target.vocab_rows]
    if bad:  # (an id past the embedding table reads outside it: garbage, or a crash)
        raise ValueError(f"prompt token id {bad[0]} is outside the target's vocabulary 0..{target.vocab_rows - 1}")
    proposer = proposer or PLAIN_PROPOSER
    verifier = verifier or GreedyVerifier()
    B = int(block_size if block_size is not None else (proposer.block_size or 1))
    if B < 1:
        raise ValueError(f"block size must be an integer >= 1, got {B}")
    if B == 1:
        proposer = PLAIN_PROPOSER  # nothing to draft: plain decoding
    proposer.check_block_size(B)
    limit = target.max_context
    if limit is not None and len(prompt) >= limit:
        raise ValueError(f"prompt of {len(prompt)} tokens does not fit the target's context of {limit} tokens")
    stats = stats if stats is not None else SpecStats()
    stats.drafter, stats.block_size, stats.prompt_tokens = proposer.name, B, len(prompt)
    if not adaptive:
        stats.drafter = stats.drafter.replace(" (adaptive)", "")
    stats.draft_confidence = proposer.min_confidence
    dflash = getattr(proposer, "drafter", proposer)  # a FusedProposer's drafter part
    stats.draft_vocab = int(dflash.vocab_ids.size) if getattr(dflash, "vocab_ids", None) is not None else 0
    costs = getattr(proposer, "calibration", None) if adaptive else None  # the width policy's table
    if costs is not None:
        t1 = costs.verify(1, len(prompt))
        # the widths this request can verify (a cached table may hold wider ones, measured for a larger --block-size)
        stats.verify_cost = {m: r for m, r in costs.ratios(len(prompt)).items() if m <= B}
        stats.drafter_cost = {n: t / t1 for n, t in sorted(costs.drafter_s.items()) if n < B}
    reuse = 0
    snapshots = {}
    if state is not None and state.cache is not None and state.proposer is proposer and state.tokens:
        # prompt (prefix) cache: keep the common prefix, at least one prompt token left to feed (recurrent
        # layers: the longest snapshot at or before it; sliding windows: only what every layer still holds)
        cache, session = state.cache, state.session
        reuse = _rewind(cache, state.snapshots, min(_common_prefix(state.tokens, prompt), len(prompt) - 1))
        if reuse == 0:
            cache = target.make_cache()
        session.truncate(reuse)
        snapshots = {p: v for p, v in state.snapshots.items() if p <= reuse}
    else:
        cache = target.make_cache()
        session = proposer.start(prompt)
    session.adaptive = adaptive  # read by sessions that have a schedule (FusedProposer)
    dflash = getattr(proposer, "drafter", proposer)
    session.trees = bool(trees and getattr(dflash, "trees", False) and verifier.trees_ok and target.tree_capable)
    if state is not None:
        state.cache, state.session, state.proposer, state.reused = cache, session, proposer, reuse
        state.tokens = prompt[:reuse]
        state.snapshots = snapshots
    stats.cached_tokens = reuse
    return RequestSetup(proposer, verifier, B, tuple(proposer.tap_ids), cache, session, reuse)


def speculative_generate_step(
    prompt: Iterable[int],
    target: TargetAdapter,
    proposer: Proposer | None = None,
    *,
    verifier: Verifier | None = None,
    block_size: int | None = None,
    max_tokens: int = 256,
    prefill_step_size: int = 2048,
    stats: SpecStats | None = None,
    state: GenerationState | None = None,
    draft_temperature: float = 0.0,
    draft_key: mx.array | None = None,
    adaptive: bool = True,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
) -> Generator[tuple[int, mx.array, bool], None, None]:
    """Generate tokens with speculative decoding.

    Args:
        prompt: prompt token ids (non-empty).
        target: the target adapter.
        proposer: drafter / lookup / fused proposer; ``None`` = plain decoding.
        verifier: defaults to :class:`~.verify.GreedyVerifier`.
        block_size: B (verify width); default the proposer's. ``1`` disables drafting.
        max_tokens: tokens to generate at most (``-1``: unbounded); never exceeded.
        prefill_step_size: prompt chunk length for prefill (tokens).
        stats: a :class:`SpecStats` to fill (created if None).
        state: a :class:`GenerationState`: reused as a prompt cache if it holds
            caches of the same proposer, and filled with this request's caches.
        draft_temperature, draft_key: drafter sampling (0 = greedy drafts).
        adaptive: let a proposer's adaptive schedule (:class:`~.proposers.AdaptiveSchedule`)
            choose the rounds; ``False`` drafts every round (what a seeded
            sampled request needs to repeat token for token).
        prompt_progress_callback: ``f(processed, total)`` during prefill.

    Yields:
        ``(token, logprobs, from_draft)``: an int token id, the target's
        log-probabilities ``[V]`` at its position, and whether it was an
        accepted draft token (False for the first token and for
        correction/bonus tokens).

    Raises:
        ValueError: empty prompt, prompt at or beyond the context limit, or a
            bad block size.
    """
    from .batch import SpeculativeBatch

    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("the prompt must contain at least one token")
    if max_tokens == 0:
        return
    stats = stats if stats is not None else SpecStats()
    # one loop: a batch of one request runs the solo rounds (its proposer's adaptive schedule, tree drafts, plain
    # steps queued ahead; batch.py)
    batch = SpeculativeBatch(target, prefill_step_size=prefill_step_size)
    uid = batch.add(prompt, int(max_tokens) if max_tokens >= 0 else -1, proposer=proposer, block_size=block_size,
                    verifier=verifier, state=state, keep_state=state is not None, draft_temperature=draft_temperature,
                    draft_key=draft_key, logprobs=True, adaptive=adaptive,
                    prompt_progress_callback=prompt_progress_callback, stats=stats)
    ev, taken, in_ev, tic, failed, stopped = None, 0, 0, None, True, False
    try:
        while ev is None or ev.finish_reason is None:
            events = batch.step()
            if not events and not (batch.active or batch.pending):  # (cannot happen: the request reports its end)
                break
            for ev in events:
                if tic is None:
                    tic = time.perf_counter()  # the prefill's end (its first token)
                in_ev = 0
                for tok, lp, fd in zip(ev.tokens, ev.logprobs, ev.from_draft):
                    taken += 1  # (counted as it is handed out: a consumer that stops at it has taken it)
                    in_ev += 1
                    yield tok, lp, fd
        failed = False
    except GeneratorExit:  # the consumer stopped at the token it took last
        failed, stopped = False, True
        raise
    finally:
        # the consumer stopped (or the request ended): nothing after the last token it took is kept or counted
        final = None
        try:
            if ev is not None and ev.finish_reason is not None:
                final = batch.stopped_after_finish(uid, len(ev.tokens) - in_ev, stats, ev.round, stopped)
            elif taken:
                final = batch.stop(uid, taken)
        except Exception:
            if not failed:  # (after a failure inside the loop, that failure is what the caller sees)
                raise
        if tic is not None:
            stats.decode_s = time.perf_counter() - tic
        if state is not None and final is not None:
            state.cache, state.session, state.tokens, state.snapshots = (final.cache, final.session, final.tokens,
                                                                         final.snapshots)
