"""Exact-rollback caches for hybrid targets (issue 20): GatedDeltaNet and sliding-window layers.

The speculative loop runs the target on a block of ``L`` tokens (anchor + drafts)
that appends to every layer's cache, then rolls the rejected tail back with
``cache.trim(n)``; a consumer that stops mid-round may trim across the previous
forward too (round r's tail plus the queued round r+1: up to about two blocks).
mlx-lm's ``KVCache`` supports this; its other caches do not:

* ``ArraysCache`` (GatedDeltaNet layers of ``qwen3_next`` / ``qwen3_5``) holds a
  recurrent state that cannot be "un-applied";
* ``RotatingKVCache`` (sliding-window layers of ``gemma3_text`` / ``gemma4_text``)
  is trimmable only until the window first wraps (``is_trimmable()`` is
  ``offset < max_size``), and overwrites rows a rollback would need.

This module provides drop-in replacements that mlx-lm's own model classes accept
as cache entries (``model(tokens[None], cache=caches)`` runs unmodified):

* :class:`RecurrentCache` -- an ``ArraysCache(size=2)`` (``[conv_state,
  recurrent_state]``) that records, per forward, the state before it and the
  mixer's inputs, so ``trim`` restores a snapshot and replays a prefix;
* :func:`install_recording` -- makes each GatedDeltaNet mixer of one model
  object report its inputs to its :class:`RecurrentCache`;
* :class:`RaggedRecurrentCache` -- the same layer's state for a batch of rows
  of different lengths, rolled back row by row;
* :class:`WindowKVCache` -- a sliding-window K/V cache that keeps ``slack``
  extra rows and masks explicitly, so ``trim(n)`` is exact for ``n <= slack``
  however often the window has wrapped;
* :func:`convert_caches` / :func:`rollback_capacity` -- map ``model.make_cache()``
  to these classes and report how far a list of caches can be rolled back.

These are single sequences (batch size 1 is what the speculative loop uses; the
recorded replay and the masks are batch-agnostic, but left padding / per-row
lengths are refused). A batch of sequences of different lengths
(:class:`~mlx_dflash2.batch.SpeculativeBatch`) holds each GatedDeltaNet layer's rows
in one :class:`RaggedRecurrentCache`: masked forwards for right-padded prompt chunks,
per-row rollback of a verify block (the kept step's state selected, or a masked replay);
its window layers in a windowed :class:`~mlx_dflash2.batch.RaggedKVCache` (the window's
masks, per-row front eviction and rollback slack).
"""

from __future__ import annotations

import functools
from collections import deque
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, _BaseCache

__all__ = [
    "RecurrentCache",
    "RaggedRecurrentCache",
    "WindowKVCache",
    "install_recording",
    "convert_caches",
    "rollback_capacity",
]

DEFAULT_SLACK = 64
DEFAULT_MAX_RECORD = 64
DEFAULT_HISTORY = 4


# ----------------------------------------------------------------------------------------------
# GatedDeltaNet layers
# ----------------------------------------------------------------------------------------------


class _Record:
    """One recorded forward of a GatedDeltaNet layer (immutable once appended to the history).

    ``conv`` / ``state`` / ``offset`` are the cache contents *before* the forward
    (references: MLX arrays are immutable, and the mixer replaces ``cache[i]``
    rather than writing into it). ``inputs`` (``[B, length, hidden]``) and
    ``mask`` (``[B, length]`` or ``None``) are the mixer's arguments, ``None``
    when the forward was longer than ``max_record`` rows. ``replay(x, mask, cache)``
    runs the un-recorded mixer. ``after`` is ``cache[1]`` after the forward: a
    trim checks it is still the cache's state (nothing ran un-recorded since).

    ``steps``: ``(states [B, length, Hv, Dv, Dk], conv_input [B, K - 1 + length, C])`` when the mixer
    computed every step's state (:func:`mlx_dflash2.kernels.gdn.route_gated_delta`): a trim inside this
    forward then selects them instead of replaying.
    """

    __slots__ = ("conv", "state", "offset", "length", "inputs", "mask", "replay", "after", "steps")

    def __init__(self, conv, state, offset, length, inputs, mask, replay, after=None, steps=None):
        self.conv, self.state, self.offset, self.length = conv, state, offset, length
        self.inputs, self.mask, self.replay, self.after, self.steps = inputs, mask, replay, after, steps


class RecurrentCache(ArraysCache):
    """``ArraysCache(size=2)`` for a GatedDeltaNet layer, with exact ``trim`` by snapshot + replay.

    Entries are mlx-lm's (``mlx_lm/models/qwen3_next.py``, ``qwen3_5.py``,
    ``GatedDeltaNet.__call__``): ``cache[0]`` the convolution state
    ``[B, conv_kernel - 1, conv_dim]`` (the inputs' dtype), ``cache[1]`` the
    recurrent state ``[B, Hv, Dv, Dk]`` (float32, ``gated_delta.py``); both ``None``
    while empty. ``lengths`` / ``left_padding`` stay ``None`` (single sequences).

    Rollback (pure MLX, exact): the mixer, wrapped by :func:`install_recording`,
    calls :meth:`record` before each forward with its inputs ``x`` and ``mask``;
    the cache keeps the pre-forward ``(conv_state, state, offset)`` (references)
    and, for forwards of at most ``max_record`` rows, ``x`` and ``mask``. The last
    ``history`` forwards are kept. ``trim(n)`` drops whole recorded forwards while
    ``n`` covers them (restoring the snapshot of the earliest dropped one); a
    forward that is only partly trimmed is replayed: its snapshot is restored and
    the layer's own mixer re-runs on ``x[:, :L - n']`` (lazily; the replay becomes
    that forward's record, so later trims still work).

    ``offset`` counts the positions fed (advanced by the mixer's ``cache.advance``).
    """

    def __init__(self, max_record: int = DEFAULT_MAX_RECORD, history: int = DEFAULT_HISTORY):
        """Args:
            max_record: forwards longer than this many rows (e.g. prefill chunks) keep no
                inputs: they can be dropped whole by a trim, never partly.
            history: number of most recent forwards kept for rollback (>= 1).

        Raises:
            ValueError: ``history < 1`` or ``max_record < 0``.
        """
        super().__init__(size=2)
        if history < 1 or max_record < 0:
            raise ValueError(f"RecurrentCache: history must be >= 1 and max_record >= 0 (got {history}, {max_record})")
        self.max_record = int(max_record)
        self.offset = 0
        self._history: deque[_Record] = deque(maxlen=int(history))
        self._pending: Optional[_Record] = None
        self._replaying = False
        self.replays = 0  # partial trims done by replay (the others selected a kept step state)

    # -- recording (called by the mixer wrapper / by mlx-lm's mixer) ---------------------------

    def record(self, x: mx.array, mask: Optional[mx.array], replay: Callable[..., Any]) -> None:
        """Note the state before a forward of the mixer and its inputs.

        Args:
            x: the mixer's input ``[B, L, hidden]``.
            mask: its ``mask`` (``[B, L]`` bool) or ``None``.
            replay: ``replay(x, mask, cache)`` runs the mixer without recording
                (used by :meth:`trim`; its output is discarded).

        Raises:
            ValueError: the cache carries ``lengths`` / ``left_padding`` (batched
                padded use is not supported by the rollback).
        """
        if self.lengths is not None or self.left_padding is not None:
            raise ValueError("RecurrentCache: rollback does not support lengths / left_padding (single sequences)")
        L = int(x.shape[1])
        keep = L <= self.max_record
        self._pending = _Record(
            self.cache[0], self.cache[1], self.offset, L, x if keep else None, mask if keep else None, replay
        )

    def record_steps(self, states: mx.array, conv_input: mx.array) -> None:
        """Attach every step's state of the pending (recorded, not yet advanced) forward.

        Args:
            states: ``[B, L, Hv, Dv, Dk]`` float32, ``states[:, t]`` the state after step ``t``.
            conv_input: ``[B, K - 1 + L, C]`` the convolution's input (previous window + the new rows).
        """
        if self._pending is not None and self._pending.inputs is not None:
            self._pending.steps = (states, conv_input)

    def advance(self, N: int) -> None:
        """Called by mlx-lm's mixer after it updated the state with ``N`` rows.

        Completes the pending record; a forward that was not recorded (model without
        :func:`install_recording`) clears the history, so a later trim into it raises
        instead of restoring a wrong snapshot.
        """
        super().advance(N)
        self.offset += int(N)
        if self._replaying:
            return
        rec, self._pending = self._pending, None
        if rec is None or rec.length != N:
            self._history.clear()
            return
        rec.after = self.cache[1]
        self._history.append(rec)
        # every step's states are kept for the two latest forwards only (a trim reaches at most one forward
        # past the latest: the loop's queued round): older ones fall back to replay, still exact. At a 27B
        # hybrid shape a 16-row block's states are ~2.4 GB (48 layers x 16 x 48 heads x 128 x 128 x 4 B).
        for old in list(self._history)[:-2]:
            old.steps = None

    # -- rollback ---------------------------------------------------------------------------

    def is_trimmable(self) -> bool:
        return True

    def rollback_capacity(self) -> int:
        """The largest ``k`` such that ``trim(n)`` succeeds for every ``0 <= n <= k``.

        Sum of the lengths of the most recent recorded forwards, stopping at the
        first one whose inputs were not kept (it can only be dropped whole).
        """
        if self._history and self._history[-1].after is not self.cache[1]:
            return 0
        cap = 0
        for rec in reversed(self._history):
            if rec.inputs is None:
                break
            cap += rec.length
        return cap

    def trim(self, n: int) -> int:
        """Roll the last ``n`` positions back exactly; returns ``n``.

        Raises:
            ValueError: ``n`` reaches past the recorded history (more than the last
                ``history`` forwards, or into a forward recorded without inputs
                because it had more than ``max_record`` rows -- unless ``n`` drops it
                whole), or the state was changed by an un-recorded forward. Nothing
                is changed then.
        """
        n = int(n)
        if n <= 0:
            return 0
        hist = self._history
        if not hist or hist[-1].after is not self.cache[1]:
            raise ValueError(
                f"RecurrentCache.trim({n}): no recorded forward to roll back (was install_recording(model) "
                "applied, and has the cache been committed or fed without recording since?)"
            )
        remaining, drop, partial = n, 0, None
        for rec in reversed(hist):
            if remaining >= rec.length:
                remaining -= rec.length
                drop += 1
                if remaining == 0:
                    break
            else:
                if rec.inputs is None:
                    raise ValueError(
                        f"RecurrentCache.trim({n}): would cut inside a recorded forward of {rec.length} rows whose "
                        f"inputs were not kept (longer than max_record={self.max_record}); rollback capacity is "
                        f"{self.rollback_capacity()}"
                    )
                partial = rec
                break
        if remaining > 0 and partial is None:
            raise ValueError(
                f"RecurrentCache.trim({n}): only {n - remaining} positions of history are recorded "
                f"(last {hist.maxlen} forwards); rollback capacity is {self.rollback_capacity()}"
            )
        first = None
        for _ in range(drop):
            first = hist.pop()
        if first is not None:
            self.cache[0], self.cache[1], self.offset = first.conv, first.state, first.offset
        if partial is not None:
            keep = partial.length - remaining
            x = partial.inputs[:, :keep]
            mask = None if partial.mask is None else partial.mask[:, :keep]
            steps = None
            if partial.steps is not None:  # every step's state was kept: select the accepted one
                states, conv_input = partial.steps
                k1 = conv_input.shape[1] - partial.length
                self.cache[0] = mx.contiguous(conv_input[:, keep : keep + k1])
                self.cache[1] = states[:, keep - 1]
                self.offset = partial.offset + keep
                steps = (states[:, :keep], conv_input[:, : k1 + keep])
            else:  # replay the kept prefix from the pre-forward snapshot
                self.cache[0], self.cache[1], self.offset = partial.conv, partial.state, partial.offset
                self._replaying = True
                self.replays += 1
                try:
                    partial.replay(x, mask, self)
                finally:
                    self._replaying = False
            hist[-1] = _Record(
                partial.conv, partial.state, partial.offset, keep, x, mask, partial.replay, self.cache[1], steps
            )
        self._pending = None
        return n

    def commit(self) -> None:
        """Forget the history (the current state can no longer be rolled back)."""
        self._history.clear()
        self._pending = None

    def clone(self) -> "RecurrentCache":
        """An independent copy (same arrays by reference -- they are never written in place -- and history)."""
        c = RecurrentCache(self.max_record, self._history.maxlen)
        c.cache = list(self.cache)
        c.offset = self.offset
        c.left_padding, c.lengths = self.left_padding, self.lengths
        c._history = deque(self._history, maxlen=self._history.maxlen)
        return c

    @property
    def state(self):
        """``(cache, left_padding, lengths)`` as mlx-lm's ``ArraysCache`` (``mx.eval(c.state)`` works)."""
        return self.cache, self.left_padding, self.lengths

    @state.setter
    def state(self, v):
        self.cache, self.left_padding, self.lengths = v
        if not hasattr(self, "_history"):  # from_state
            self.max_record, self.offset = DEFAULT_MAX_RECORD, 0
            self._history, self._pending, self._replaying = deque(maxlen=DEFAULT_HISTORY), None, False
            self.replays = 0
        self.commit()


class _RecordingMixer:
    """Marker base of the per-object recording subclasses made by :func:`install_recording`."""


@functools.lru_cache(maxsize=None)
def _recording_class(base: type) -> type:
    """A subclass of ``base`` whose ``__call__`` reports its inputs to a :class:`RecurrentCache` first."""

    def __call__(self, x, mask=None, cache=None):
        if isinstance(cache, (RecurrentCache, RaggedRecurrentCache)):
            cache.record(x, mask, functools.partial(base.__call__, self))
        return base.__call__(self, x, mask, cache)

    return type(f"Recording{base.__name__}", (base, _RecordingMixer), {"__call__": __call__, "__module__": __name__})


def install_recording(model: nn.Module) -> Callable[[], None]:
    """Make every GatedDeltaNet mixer (``layer.linear_attn``) of ``model`` record into its :class:`RecurrentCache`.

    Each mixer *object* of this model gets its class switched to a per-base-class
    subclass whose ``__call__(x, mask=None, cache=None)`` calls
    ``cache.record(x, mask, replay)`` when ``cache`` is a :class:`RecurrentCache`
    and then the original ``__call__``. The classes themselves are untouched
    (other model objects are unaffected), and since the mixer stays the same
    object -- no wrapper module in between -- ``model.parameters()`` key paths,
    ``load_weights``, ``nn.quantize``, ``isinstance`` checks and ``layer.is_linear``
    all keep working while recording is installed.

    Args:
        model: an mlx-lm model (e.g. ``qwen3_next.Model``, ``qwen3_5.Model``). Every
            sub-module with an ``nn.Module`` child named ``linear_attn`` is a layer
            whose mixer is switched; a model with none is left as is.

    Returns:
        ``undo()``: restores the original classes (idempotent).
    """
    swapped = []
    for module in model.modules():
        mixer = module.get("linear_attn") if isinstance(module, dict) else None
        if isinstance(mixer, nn.Module) and not isinstance(mixer, _RecordingMixer):
            base = type(mixer)
            mixer.__class__ = _recording_class(base)
            swapped.append((mixer, base))

    def undo() -> None:
        for m, base in swapped:
            if type(m) is _recording_class(base):
                m.__class__ = base
        swapped.clear()

    return undo


class RaggedRecurrentCache(ArraysCache):
    """One GatedDeltaNet layer's state for a batch of rows (:class:`~mlx_dflash2.batch.SpeculativeBatch`):
    the per-row counterpart of :class:`RecurrentCache`, an mlx-lm cache entry its mixers accept as is.

    Entries are mlx-lm's with a batch dimension of ``N`` rows: ``cache[0]`` the convolution state
    ``[N, conv_kernel - 1, conv_dim]`` (the inputs' dtype), ``cache[1]`` the recurrent state
    ``[N, Hv, Dv, Dk]`` (float32); both ``None`` while no row has a state (mlx-lm's mixer then starts
    every row from zeros). :attr:`positions` (host ints) counts each row's tokens fed.

    Row ``i``'s arrays depend on row ``i``'s tokens only (the mixer is row-wise), and two kinds of
    forward keep them exact for rows of different lengths:

    * **masked** (a batch's join prefill, rows right-padded to the longest chunk): :meth:`prepare`
      with each row's real length first; mlx-lm's own mixer then masks the padding (its ``lengths``
      path: padded inputs zeroed, the recurrence skips them, each row's conv window taken at its own
      end), so each row ends at the state after its own real tokens. Nothing is recorded.
    * **unmasked** (a verify block ``[N, M]``: each row's real tokens, then padding): every row
      advances by ``M``; the mixer (recording, :func:`install_recording`) hands the pre-forward state
      and its inputs to :meth:`record`, and the stepping mixer of a routed target
      (:func:`~mlx_dflash2.kernels.gdn.route_gated_delta`) every step's state to :meth:`record_steps`.
      :meth:`trim_rows` then keeps each row's own prefix: the kept step's state and conv window
      selected per row (:func:`~mlx_dflash2.kernels.gated_delta_steps.select_states`) when the steps
      were kept, else a masked replay from the snapshot (row ``i``'s first ``keep_i`` inputs through the
      layer's own mixer with ``lengths = keep``: the reference path, as :class:`RecurrentCache` replays).

    Either way no padding and no other row reaches a row's state. Rows join (:meth:`add_rows`), leave
    (:meth:`keep_rows`) and are handed out as a single sequence's :class:`RecurrentCache`
    (:meth:`extract`).

    Args:
        max_record: the stepping mixer keeps every step's state of unmasked forwards up to this many
            tokens (longer ones run mlx-lm's forward and are rolled back by replay).
    """

    def __init__(self, max_record: int = DEFAULT_MAX_RECORD):
        super().__init__(size=2)
        self.max_record = int(max_record)
        self._positions: list[int] = []
        self._feed: Optional[list[int]] = None  # the next forward's real lengths (prepare)
        self._pending: Optional[_Record] = None
        self._last: Optional[_Record] = None  # the last unmasked forward (until a forward or row change)
        self._kept: Optional[list[int]] = None  # per row, the tokens of that forward it holds after trims
        self._replaying = False
        self.replays = 0  # trim_rows done by replay (the others selected kept step states)

    # -- geometry -----------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return len(self._positions)

    @property
    def positions(self) -> list[int]:
        """Per-row tokens fed (a copy)."""
        return list(self._positions)

    @property
    def state(self) -> list[mx.array]:
        """The arrays to evaluate (``[]`` while no row has a state)."""
        return [c for c in self.cache if c is not None]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache if c is not None)

    # -- the mixer's interface ----------------------------------------------------------------
    def prepare(self, lengths: Sequence[int], **kwargs) -> None:
        """Make the next forward masked: row ``i`` feeds ``lengths[i]`` real tokens, then padding.

        Raises:
            ValueError: not one length per row, or a negative one.
        """
        lengths = [int(n) for n in lengths]
        if len(lengths) != self.rows or any(n < 0 for n in lengths):
            raise ValueError(f"RaggedRecurrentCache.prepare: lengths {lengths} for {self.rows} rows")
        self._feed = lengths
        self.lengths = mx.array(lengths, dtype=mx.int32)

    def finalize(self) -> None:
        self._feed, self.lengths, self.left_padding = None, None, None

    def record(self, x: mx.array, mask: Optional[mx.array], replay: Callable[..., Any]) -> None:
        """Called by the recording mixer before a forward: keep the state before it and its inputs
        ``x`` (``[N, L, hidden]``) for :meth:`trim_rows` (masked forwards are not recorded)."""
        if self._replaying:
            return
        if self.lengths is not None or mask is not None or x.shape[1] > self.max_record:
            self._pending = None  # (a prompt chunk longer than max_record keeps no inputs: never rolled back)
            return
        self._pending = _Record(self.cache[0], self.cache[1], None, int(x.shape[1]), x, None, replay)

    def record_steps(self, states: mx.array, conv_input: mx.array) -> None:
        """Attach every step's state of the pending forward (``[N, L, Hv, Dv, Dk]``) and its convolution
        input (``[N, K - 1 + L, C]``): :meth:`trim_rows` then selects instead of replaying."""
        if self._pending is not None:
            self._pending.steps = (states, conv_input)

    def advance(self, N: int) -> None:
        """Called by mlx-lm's mixer after it updated the state: a masked forward advances each row by its
        own length, an unmasked one every row by ``N`` (and becomes the forward :meth:`trim_rows` rolls
        back)."""
        if self._replaying:
            return  # trim_rows sets the positions
        if self._feed is not None:
            self._positions = [p + f for p, f in zip(self._positions, self._feed)]
            self.finalize()
            self._pending = self._last = self._kept = None
            return
        self._positions = [p + int(N) for p in self._positions]
        rec, self._pending = self._pending, None
        if rec is not None and rec.length == int(N):
            rec.after = self.cache[1]
        self._last = rec if rec is not None and rec.length == int(N) else None
        self._kept = None

    # -- per-row rollback ---------------------------------------------------------------------
    def trim_rows(self, n: Sequence[int]) -> None:
        """Roll row ``i`` back by its last ``n[i]`` positions, all inside the last (unmasked) forward:
        each row's state becomes its state after its first ``K_i - n[i]`` tokens of that forward (``K_i``:
        what row ``i`` still holds of it, its length ``L`` until a trim). All zeros: nothing changes. Later
        trims may cut further into the same forward (a consumer that stops inside a committed round), until
        the next forward, row change or masked forward.

        Raises:
            ValueError: wrong count, an amount outside ``0 .. K_i``, or no recorded forward to roll back
                (a masked one, rows added or dropped since, or the state changed since); nothing changes.
        """
        n = [int(x) for x in n]
        if len(n) != self.rows:
            raise ValueError(f"RaggedRecurrentCache.trim_rows: {len(n)} amounts for {self.rows} rows")
        rec = self._last
        if not any(n):
            return
        if rec is None or rec.after is not self.cache[1]:
            raise ValueError("RaggedRecurrentCache.trim_rows: no recorded forward to roll back (was "
                             "install_recording(model) applied, and has a forward run since?)")
        L = rec.length
        held = self._kept if self._kept is not None else [L] * len(n)
        if any(x < 0 or x > h for x, h in zip(n, held)):
            raise ValueError(f"RaggedRecurrentCache.trim_rows: amounts {n} outside 0..{held}")
        kept = [h - x for h, x in zip(held, n)]
        keep = mx.array(kept, dtype=mx.int32)
        if rec.steps is not None:  # every step's state kept (stepping mixer): select each row's own
            from .kernels.gated_delta_steps import select_states

            states, conv_input = rec.steps
            state, conv = select_states(states, conv_input, keep - 1)
            if not all(kept):  # rows that keep nothing of the forward: their previous state
                none = keep == 0
                before_c = rec.conv if rec.conv is not None else mx.zeros_like(conv)
                before_s = rec.state if rec.state is not None else mx.zeros_like(state)
                conv = mx.where(none[:, None, None], before_c, conv)
                state = mx.where(none[:, None, None, None], before_s, state)
            self.cache[0], self.cache[1] = conv, state
        else:  # replay each row's kept inputs from the snapshot, masked at its own length
            self.cache[0], self.cache[1] = rec.conv, rec.state
            self.lengths = keep
            self._replaying = True
            self.replays += 1
            try:
                rec.replay(rec.inputs, mx.arange(L, dtype=mx.int32)[None] < keep[:, None], self)
            finally:
                self._replaying = False
                self.finalize()
        self._positions = [p - x for p, x in zip(self._positions, n)]
        rec.after, self._kept = self.cache[1], kept  # a later trim cuts further into this forward

    # -- rows -----------------------------------------------------------------------------------
    def row(self, i: int) -> tuple:
        """Row ``i`` as :meth:`add_rows` takes it: ``(conv [1, K - 1, C], state [1, Hv, Dv, Dk], position)``
        (lazy slices; ``(None, None, position)`` while no row has a state)."""
        if self.cache[0] is None:
            return None, None, self._positions[i]
        return self.cache[0][i : i + 1], self.cache[1][i : i + 1], self._positions[i]

    def add_rows(self, rows: Sequence[tuple]) -> None:
        """Append rows ``(conv, state, position)``: a single sequence's arrays (``[1, K - 1, C]``,
        ``[1, Hv, Dv, Dk]``: e.g. a :class:`RecurrentCache`'s ``cache`` after ``position`` tokens), or
        ``(None, None, 0)`` for a fresh row (zeros: a request whose prompt is still to be fed). One
        concatenation per call.

        Raises:
            ValueError: a row with one array but not the other, a shape or dtype that does not match the
                other rows (nothing is added then).
        """
        rows = [(c, s, int(p)) for c, s, p in rows]
        geo = None if self.cache[0] is None else (self.cache[0].shape[1:], self.cache[0].dtype,
                                                  self.cache[1].shape[1:], self.cache[1].dtype)
        for c, s, p in rows:
            if c is None and s is None:
                continue
            if c is None or s is None or c.ndim != 3 or s.ndim != 4 or c.shape[0] != 1 or s.shape[0] != 1:
                raise ValueError(f"RaggedRecurrentCache.add_rows: conv / state must be [1, K - 1, C] / "
                                 f"[1, Hv, Dv, Dk], got {None if c is None else tuple(c.shape)} / "
                                 f"{None if s is None else tuple(s.shape)}")
            g = (c.shape[1:], c.dtype, s.shape[1:], s.dtype)
            if geo is not None and g != geo:
                raise ValueError(f"RaggedRecurrentCache.add_rows: row {g} does not match the batch's {geo}")
            geo = g
        if geo is None:  # no state anywhere yet: mlx-lm's mixer starts every row from zeros
            self._positions += [p for _, _, p in rows]
            return
        (cs, cd, ss, sd), n0 = geo, self.rows
        convs = [self.cache[0] if self.cache[0] is not None else mx.zeros((n0, *cs), cd)]
        states = [self.cache[1] if self.cache[1] is not None else mx.zeros((n0, *ss), sd)]
        for c, s, _ in rows:
            convs.append(c if c is not None else mx.zeros((1, *cs), cd))
            states.append(s if s is not None else mx.zeros((1, *ss), sd))
        self.cache = [mx.concatenate(convs, axis=0), mx.concatenate(states, axis=0)]
        self._positions += [p for _, _, p in rows]
        self._pending = self._last = self._kept = None

    def keep_rows(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` (in that order; empty: no rows, no arrays)."""
        keep = [int(i) for i in keep]
        self._positions = [self._positions[i] for i in keep]
        if not keep:
            self.cache = [None, None]
        elif self.cache[0] is not None:
            idx = mx.array(keep, dtype=mx.int32)
            self.cache = [c[idx] for c in self.cache]
        self._pending = self._last = self._kept = None

    def extract(self, i: int) -> RecurrentCache:
        """Row ``i`` as a single sequence's :class:`RecurrentCache` (own arrays, gathered: they do not
        keep the batch's buffers alive), e.g. a finished request's prompt cache. Its rollback history is
        what the row holds of the last unmasked forward (the tokens its commit kept), so a consumer that
        stops inside a request's last round can still cut its state back (``trim``); none otherwise."""
        c = RecurrentCache(self.max_record)
        if self.cache[0] is not None:
            idx = mx.array([i], dtype=mx.int32)
            c.cache = [self.cache[0][idx], self.cache[1][idx]]
        c.offset = self._positions[i]
        rec = self._last
        if rec is not None and rec.after is self.cache[1] and c.cache[0] is not None:
            k = self._kept[i] if self._kept is not None else rec.length
            if k:
                idx = mx.array([i], dtype=mx.int32)
                steps = None
                if rec.steps is not None:
                    states, conv_input = rec.steps
                    k1 = conv_input.shape[1] - rec.length
                    steps = (states[idx, :k], conv_input[idx, : k1 + k])
                c._history.append(_Record(None if rec.conv is None else rec.conv[idx],
                                          None if rec.state is None else rec.state[idx], c.offset - k, k,
                                          rec.inputs[idx, :k], None, rec.replay, c.cache[1], steps))
        return c

    # mlx-lm's batch-editing methods of ArraysCache would change the rows without the per-row positions
    def filter(self, *args, **kwargs):
        raise NotImplementedError("RaggedRecurrentCache: use keep_rows (the rows' positions go with them)")

    def extend(self, *args, **kwargs):
        raise NotImplementedError("RaggedRecurrentCache: use add_rows (the rows' positions go with them)")

    @classmethod
    def merge(cls, *args, **kwargs):
        raise NotImplementedError("RaggedRecurrentCache: rows join with add_rows")


# ----------------------------------------------------------------------------------------------
# Sliding-window layers
# ----------------------------------------------------------------------------------------------


class WindowKVCache(_BaseCache):
    """Sliding-window K/V cache with exact rollback; replaces mlx-lm's ``RotatingKVCache(max_size=w, keep=0)``.

    Attention semantics: a query at position ``p`` sees exactly the keys at
    positions ``(p - w, p]`` (``w = max_size``), whatever the block sizes -- the
    same as feeding the tokens one by one to ``RotatingKVCache(w)``.

    Storage: ``keys`` / ``values`` ``[B, n_kv_heads, capacity, head_dim]`` (the
    dtype of the first update) hold the rows of positions ``[start, offset)`` in
    temporal order at buffer indices ``[_lo, _lo + offset - start)``; no ring.

    Invariant: after an ``update_and_fetch`` of ``L`` rows, ``start <= max(0,
    offset - (w - 1) - slack)`` provided the trims since the previous update
    removed no more rows than that update added (the normal speculative round:
    trims of up to ``slack`` rows in all, across the last one or two forwards).
    Eviction happens only in ``update_and_fetch`` and is deterministic: with
    ``O`` the offset before the update, the new start is
    ``max(start, max(0, min(O - (w - 1), O + L - (w - 1) - slack)))`` -- never a
    row a query of this update needs. :meth:`make_mask` uses the same rule, so
    the mask made before the update matches the keys the update returns: an
    explicit ``[N, kL]`` bool array whenever a held row is older than some
    query's window (also for ``N == 1``), else ``"causal"`` (``N > 1``) / ``None``
    (``N == 1``) as mlx-lm.

    ``trim(n)`` only moves ``offset`` back; it is exact (raises otherwise) while the
    rows ``[offset - n - (w - 1), offset - n)`` are still held, i.e. for
    ``n <= rollback_capacity()`` (``>= slack`` right after an update under the
    invariant, and everything while nothing has been evicted).
    """

    step = 256

    def __init__(self, max_size: int, keep: int = 0, slack: int = DEFAULT_SLACK):
        """Args:
            max_size: the window ``w`` (>= 1).
            keep: attention-sink rows; must be 0.
            slack: rows kept beyond the window for rollback (>= 0).

        Raises:
            ValueError: ``keep != 0``, ``max_size < 1`` or ``slack < 0``.
        """
        if keep != 0:
            raise ValueError(f"WindowKVCache: keep={keep} sink rows are not supported (only keep=0)")
        if max_size < 1 or slack < 0:
            raise ValueError(f"WindowKVCache: need max_size >= 1 and slack >= 0 (got {max_size}, {slack})")
        self.max_size = int(max_size)
        self.keep = 0
        self.slack = int(slack)
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.offset = 0
        self.start = 0
        self._lo = 0

    def _next_start(self, N: int) -> int:
        w, O = self.max_size, self.offset
        return max(self.start, max(0, min(O - (w - 1), O + N - (w - 1) - self.slack)))

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append ``N`` rows at positions ``[offset, offset + N)``: ``keys`` ``[B, H, N, Dk]``, ``values`` ``[B, H, N, Dv]``.

        Returns:
            ``(keys, values)`` of positions ``[start', offset + N)`` (``start'`` the
            start after this update's eviction), matching :meth:`make_mask` ``(N)``
            made before the call.
        """
        N = int(keys.shape[2])
        s = self._next_start(N)
        self._lo += s - self.start
        self.start = s
        held = self.offset - s
        if self.keys is None or self._lo + held + N > self.keys.shape[2]:
            B, H, _, Dk = keys.shape
            Dv = values.shape[3]
            cap = (held + N + self.step + self.step - 1) // self.step * self.step
            new_k = mx.zeros((B, H, cap, Dk), keys.dtype)
            new_v = mx.zeros((B, H, cap, Dv), values.dtype)
            if self.keys is not None and held > 0:
                new_k[..., :held, :] = self.keys[..., self._lo : self._lo + held, :]
                new_v[..., :held, :] = self.values[..., self._lo : self._lo + held, :]
            self.keys, self.values, self._lo = new_k, new_v, 0
        a = self._lo + held
        self.keys[..., a : a + N, :] = keys
        self.values[..., a : a + N, :] = values
        self.offset += N
        return self.keys[..., self._lo : a + N, :], self.values[..., self._lo : a + N, :]

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        """The attention mask of the next ``update_and_fetch`` of ``N`` rows.

        Args:
            N: queries (positions ``[offset, offset + N)``).
            window_size: the attention window (default ``max_size``; at most ``max_size``).
            return_array: always return an array.

        Returns:
            ``[N, kL]`` bool (``True`` = attend) with ``kL = offset + N - start'``, or
            ``"causal"`` / ``None`` when no held row is outside a query's window.

        Raises:
            ValueError: ``window_size > max_size``.
        """
        w = self.max_size if window_size is None else int(window_size)
        if w > self.max_size:
            raise ValueError(f"WindowKVCache.make_mask: window_size {w} exceeds the cache's window {self.max_size}")
        s, O = self._next_start(N), self.offset
        if s >= O + N - w and not return_array:
            return None if N == 1 else "causal"
        q = mx.arange(O, O + N)[:, None]
        k = mx.arange(s, O + N)[None]
        return (k <= q) & (k > q - w)

    def rollback_capacity(self) -> int:
        """Largest ``n`` for which :meth:`trim` is exact."""
        if self.start == 0:
            return self.offset
        return max(0, self.offset - (self.max_size - 1) - self.start)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Move ``offset`` back by ``min(n, offset)``; returns that count.

        Raises:
            ValueError: ``n > rollback_capacity()`` (rows the window would then need
                were evicted); nothing is changed.
        """
        n = min(int(n), self.offset)
        if n <= 0:
            return 0
        cap = self.rollback_capacity()
        if n > cap:
            raise ValueError(
                f"WindowKVCache.trim({n}): exceeds the rollback capacity {cap} (window {self.max_size}, "
                f"slack {self.slack}); rows the window would need were evicted"
            )
        self.offset -= n
        return n

    def commit(self) -> None:
        """No history to drop (kept for a uniform interface with :class:`RecurrentCache`)."""

    def clone(self) -> "WindowKVCache":
        """An independent copy (new array objects: a later in-place update of one does not show in the other)."""
        c = WindowKVCache(self.max_size, 0, self.slack)
        if self.keys is not None:
            c.keys, c.values = mx.array(self.keys), mx.array(self.values)
        c.offset, c.start, c._lo = self.offset, self.start, self._lo
        return c

    def size(self) -> int:
        """Rows held (positions ``[start, offset)``)."""
        return self.offset - self.start

    def held(self) -> tuple[Optional[mx.array], Optional[mx.array]]:
        """The K/V of the positions held, ``[start, offset)`` in order: ``([B, H, offset - start, Dk],
        [B, H, offset - start, Dv])`` (views of the buffers), or ``(None, None)`` while empty."""
        if self.keys is None:
            return None, None
        n = self.offset - self.start
        return self.keys[..., self._lo : self._lo + n, :], self.values[..., self._lo : self._lo + n, :]

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self):
        """``(keys, values)`` buffers (``[]`` while empty), for ``mx.eval(c.state)``."""
        if self.keys is None:
            return []
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


# ----------------------------------------------------------------------------------------------
# Lists of caches
# ----------------------------------------------------------------------------------------------


def convert_caches(caches: list, *, slack: int = DEFAULT_SLACK, max_record: int = DEFAULT_MAX_RECORD) -> list:
    """Map ``model.make_cache()`` (or ``make_prompt_cache(model)``) to exact-rollback caches.

    ``KVCache`` (and subclasses) and caches of this module are kept (same object);
    ``RotatingKVCache(max_size=w, keep=0)`` -> ``WindowKVCache(w, slack=slack)``;
    ``ArraysCache`` of size 2 (a GatedDeltaNet layer's ``[conv_state, state]``) ->
    ``RecurrentCache(max_record=max_record)``. Recording needs
    :func:`install_recording` on the model; an ``ArraysCache(2)`` of another
    architecture converts too, but a trim then raises (nothing is recorded),
    never rolls back wrongly.

    Args:
        caches: fresh caches (the converted ones must be empty).
        slack, max_record: passed to the new caches.

    Returns:
        A new list, same length and order.

    Raises:
        TypeError: any other cache type (named in the message), or an ArraysCache
            whose size is not 2.
        ValueError: a ``RotatingKVCache`` with ``keep != 0``, or a cache to convert
            that already holds state.
    """
    out = []
    for i, c in enumerate(caches):
        if isinstance(c, (WindowKVCache, RecurrentCache, KVCache)):
            out.append(c)
        elif isinstance(c, RotatingKVCache):
            if c.keep != 0:
                raise ValueError(f"convert_caches: layer {i}: RotatingKVCache with keep={c.keep} is not supported")
            if not c.empty():
                raise ValueError(f"convert_caches: layer {i}: RotatingKVCache already holds state; convert before use")
            out.append(WindowKVCache(c.max_size, slack=slack))
        elif isinstance(c, ArraysCache):
            if len(c.cache) != 2:
                raise TypeError(f"convert_caches: layer {i}: ArraysCache of size {len(c.cache)} (expected 2)")
            if not c.empty():
                raise ValueError(f"convert_caches: layer {i}: ArraysCache already holds state; convert before use")
            out.append(RecurrentCache(max_record=max_record))
        else:
            raise TypeError(f"convert_caches: layer {i}: unsupported cache type {type(c).__name__}")
    return out


def rollback_capacity(caches: list) -> int:
    """The largest ``n`` such that every cache of ``caches`` can ``trim(m)`` exactly for all ``m <= n``.

    ``KVCache``: its ``offset``; caches of this module: their ``rollback_capacity()``;
    anything else: 0. An empty list: 0.
    """
    caps = []
    for c in caches:
        if hasattr(c, "rollback_capacity"):
            caps.append(c.rollback_capacity())
        elif isinstance(c, KVCache):
            caps.append(c.offset)
        else:
            caps.append(0)
    return min(caps, default=0)
