"""Sampling parameters and the target's processed distribution p.

Semantics are mlx-lm's (``mlx_lm.sample_utils``), so speculative and plain
sampling preserve the same distribution:

1. logits processors on the raw logits, in ``make_logits_processors``' order
   (``logit_bias``, then repetition, presence and frequency penalties over the
   last ``*_context_size`` tokens of prompt + output);
2. ``logprobs = logits - logsumexp(logits)`` (what responses report);
3. filters on the logprobs in ``make_sampler``'s order: top-p (if
   ``0 < top_p < 1``), min-p (if ``min_p != 0``), top-k (if ``top_k > 0``);
4. ``p = softmax(filtered / temp)``; ``temp == 0`` is greedy (argmax of 2.).

For speculative verification, row ``i`` of a verify forward is processed with
the history extended by the drafts ``d_1..d_i``, i.e. as if those tokens had
been emitted one by one (known-bugs row 9).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx

__all__ = ["SamplingParams", "process_rows", "target_probs", "rejection_sample"]


@dataclass
class SamplingParams:
    """Request sampling parameters (mlx-lm names; defaults = greedy, no processors).

    Raises (``validate``):
        ValueError: naming the field, for values mlx-lm would reject.
    """

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    repetition_penalty: Optional[float] = None
    repetition_context_size: int = 20
    presence_penalty: Optional[float] = None
    presence_context_size: int = 20
    frequency_penalty: Optional[float] = None
    frequency_context_size: int = 20
    logit_bias: Optional[dict] = None
    seed: Optional[int] = None
    _processors: list = field(default=None, repr=False, compare=False)

    def validate(self) -> "SamplingParams":
        def bad(name, why):
            raise ValueError(f"{name}: {why}")

        if not isinstance(self.temp, (int, float)) or self.temp < 0 or not math.isfinite(self.temp):
            bad("temp", f"must be a number >= 0, got {self.temp!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad("top_k", f"must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or not math.isfinite(v)):
                bad(name, f"must be a number, got {v!r}")
        if self.repetition_penalty is not None and self.repetition_penalty < 0:
            bad("repetition_penalty", "must be >= 0")
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(name, f"must be an integer >= 1, got {v!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "must be a mapping of token id to bias")
            for k, v in self.logit_bias.items():
                if not isinstance(int(k), int) or not isinstance(v, (int, float)):
                    bad("logit_bias", f"bad entry {k!r}: {v!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if self.seed is not None and not 0 <= self.seed <= 2**64 - 1:  # mx.random.key's range (a uint64)
            bad("seed", f"must be an integer in [0, 18446744073709551615] (2**64 - 1), got {self.seed}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    @property
    def processors(self) -> list:
        """mlx-lm logits processors ``f(tokens [T], logits [1, V]) -> logits``."""
        if self._processors is None:
            from mlx_lm.sample_utils import make_logits_processors

            bias = {int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None
            self._processors = make_logits_processors(
                bias,
                self.repetition_penalty,
                self.repetition_context_size,
                self.presence_penalty,
                self.presence_context_size,
                self.frequency_penalty,
                self.frequency_context_size,
            )
        return self._processors

    @property
    def needs_history(self) -> bool:
        """Whether the processed distribution depends on the token history (penalties)."""
        return any(
            v not in (None, 0) for v in (self.repetition_penalty, self.presence_penalty, self.frequency_penalty)
        )

    def key(self) -> mx.array:
        """The request's root PRNG key (from ``seed``; a fresh random one otherwise)."""
        return mx.random.key(self.seed if self.seed is not None else random.getrandbits(63))


def process_rows(logits: mx.array, params: SamplingParams, history: list[int] | None, drafts: mx.array | None):
    """Apply the logits processors to every verify row.

    Args:
        logits: ``[L, V]`` raw target logits (row ``i`` predicts the token after
            ``history + drafts[:i]``).
        history: token ids so far (prompt + emitted, the anchor included).
        drafts: int ``[L-1]`` draft tokens (or None when ``L == 1``).

    Returns:
        ``[L, V]`` processed logits.
    """
    procs = params.processors
    if not procs:
        return logits
    base = mx.array(history or [], dtype=mx.int32)
    rows = []
    for i in range(logits.shape[0]):
        toks = base if i == 0 else mx.concatenate([base, drafts[:i].astype(mx.int32)])
        row = logits[i : i + 1]
        for p in procs:
            row = p(toks, row)
        rows.append(row)
    return mx.concatenate(rows, axis=0)


def target_probs(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """The processed distribution ``p`` ``[..., V]`` (float32) from processed logprobs."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    x = logprobs
    if 0 < params.top_p < 1.0:
        x = apply_top_p(x, params.top_p)
    if params.min_p != 0.0:
        x = apply_min_p(x, params.min_p, params.min_tokens_to_keep)
    if params.top_k > 0:
        if params.top_k < x.shape[-1]:
            x = apply_top_k(x, params.top_k)
    return mx.softmax(x.astype(mx.float32) * (1.0 / params.temp), axis=-1)


def rejection_sample(p: mx.array, drafts: mx.array, q: mx.array | None, key: mx.array):
    """Speculative sampling over a chain (Leviathan et al. 2023; Chen et al. 2023;
    DFlash2 spec §6.1), batched over ``T`` independent trials.

    Args:
        p: ``[T, n+1, V]`` target distributions (row ``i`` for draft ``i+1``;
            the last row for the bonus token).
        drafts: int ``[T, n]`` draft tokens.
        q: ``[T, n, V]`` the distributions the drafts were drawn from, or None
            for point masses on ``drafts``.
        key: PRNG key (must be independent of the draft's randomness).

    Returns:
        ``(a [T], tokens [T, n+1])``: the number of accepted drafts and the
        emitted tokens (``tokens[:, :a]`` are the accepted drafts,
        ``tokens[:, a]`` the correction, sampled from ``normalize(max(0, p - q))``,
        or the bonus sampled from the last row).
    """
    T, L, V = p.shape
    n = L - 1
    k_u, k_x = mx.random.split(key)
    if n == 0:
        x = mx.random.categorical(mx.log(p), key=k_x)
        return mx.zeros((T,), dtype=mx.int32), x.astype(mx.int32)
    drafts = drafts.astype(mx.int32)
    p_d = mx.take_along_axis(p[:, :n], drafts[..., None], axis=-1)[..., 0]
    if q is None:
        q = (mx.arange(V)[None, None, :] == drafts[..., None]).astype(p.dtype)
        q_d = mx.ones(p_d.shape, dtype=p.dtype)
    else:
        q_d = mx.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = mx.random.uniform(shape=(T, n), key=k_u)
    accept = u * q_d < p_d
    a = mx.cumprod(accept.astype(mx.int32), axis=1).sum(axis=1)
    resid = mx.maximum(p[:, :n] - q, 0.0)
    z = resid.sum(axis=-1, keepdims=True)
    resid = mx.where(z > 0, resid / mx.maximum(z, 1e-30), p[:, :n])  # q == p: fall back to p
    rows = mx.concatenate([resid, p[:, n:]], axis=1)
    x = mx.random.categorical(mx.log(rows), key=k_x).astype(mx.int32)  # [T, n+1]
    xa = mx.take_along_axis(x, a[:, None], axis=1)
    pos = mx.arange(L)[None, :]
    padded = mx.concatenate([drafts, mx.zeros((T, 1), dtype=mx.int32)], axis=1)
    tokens = mx.where(pos < a[:, None], padded, xa)
    return a, tokens


def sparse_to_dense(cand_ids: mx.array, q: mx.array, vocab: int) -> mx.array:
    """``[n, K]`` sparse proposal rows -> ``[n, V]`` dense (duplicates summed)."""
    n = cand_ids.shape[0]
    dense = mx.zeros((n, vocab), dtype=mx.float32)
    rows = mx.broadcast_to(mx.arange(n)[:, None], cand_ids.shape)
    return dense.at[rows, cand_ids].add(q.astype(mx.float32))
