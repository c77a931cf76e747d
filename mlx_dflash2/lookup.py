"""Longest-suffix lookup over a request's own token history.

Lookup-augmented drafting (community vLLM patch ``cpuchip/qwen38-27b-rtx3090``
``patches/dflash2-lookup-drafting.patch``; DFlash2 spec §5.10): find the most
recent earlier occurrence of the longest suffix of the history and propose the
tokens that followed it. Matches may overlap the suffix, so periodic text
("abcabcabc") continues its period. Proposals are deterministic functions of
the history, hence point-mass proposals (spec §6.2).
"""

from __future__ import annotations

__all__ = ["SuffixIndex"]


class SuffixIndex:
    """Incremental n-gram index answering "where did this suffix last occur?".

    For every ``n`` in ``[min_n, max_n]`` it maps each n-gram to the end index
    of its most recent occurrence. Appending a token costs ``O(max_n)``;
    a lookup costs ``O(max_n)`` dictionary probes.

    Args:
        min_n: shortest suffix worth matching (tokens).
        max_n: longest suffix tried.
    """

    def __init__(self, min_n: int = 2, max_n: int = 16):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._last: dict[tuple, int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        """Append tokens to the history (and index their n-grams)."""
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens) - 1
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._last[tuple(self.tokens[end - n + 1 : end + 1])] = end

    def clone(self) -> "SuffixIndex":
        new = SuffixIndex(self.min_n, self.max_n)
        new.tokens, new._last = list(self.tokens), dict(self._last)
        return new

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens of the history (re-indexes them)."""
        if n >= len(self.tokens):
            return
        kept = self.tokens[:n]
        self.tokens, self._last = [], {}
        self.extend(kept)

    def propose(self, tail: list[int], k: int) -> tuple[int, list[int]]:
        """Propose up to ``k`` tokens continuing ``history + tail``.

        ``tail`` holds tokens not (yet) committed to the index (e.g. the
        anchor). Returns ``(match_length, tokens)``; ``(0, [])`` if no suffix
        of at least ``min_n`` tokens occurred before.
        """
        if k <= 0:
            return 0, []
        seq = self.tokens + [int(t) for t in tail]
        N = len(seq)
        for n in range(min(self.max_n, N - 1), self.min_n - 1, -1):
            suffix = tuple(seq[N - n :])
            end = self._last.get(suffix)
            if end is None or end >= N - 1:
                # only the suffix itself is indexed (tail empty): look for an earlier one
                end = self._earlier(suffix, N - 1)
                if end is None:
                    continue
            out = []
            period = (N - 1) - end
            for j in range(k):
                src = end + 1 + j
                out.append(seq[src] if src < N else out[j - period])
            return n, out
        return 0, []

    def _earlier(self, suffix: tuple, before_end: int) -> int | None:
        """Most recent end index < ``before_end`` of ``suffix`` (linear scan fallback)."""
        n = len(suffix)
        seq = self.tokens
        for end in range(min(before_end - 1, len(seq) - 1), n - 2, -1):
            if seq[end] == suffix[-1] and tuple(seq[end - n + 1 : end + 1]) == suffix:
                return end
        return None
