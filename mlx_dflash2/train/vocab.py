"""A drafter's draft vocabulary: the token ids most frequent in the responses it was trained on.

A drafter's LM head is the target's, all ``V`` rows of it, and for a small drafter the head is the largest
part of its forward (SmolLM2-135M, MLX CPU, one block of 15 rows: 14.0 ms of the head against 3.4 ms for its
16,384 most frequent rows). Most of those rows are never drafted: FR-Spec (Zhao et al. 2025, "FR-Spec:
Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling", arXiv 2502.14856)
keeps the draft model's head to the most frequent tokens of a corpus and verifies with the full vocabulary, so
the output is unchanged and only a token outside the set costs a rejection at its slot.

``mlx_dflash2.train vocab --data RESPONSES --drafter DIR --size 16384`` counts the ``response_ids`` of
regenerated responses (:mod:`.regen`'s shards), keeps the ``size`` most frequent ids plus every end-of-sequence
id that stopped a response (end-of-turn tokens must stay draftable), measures what share of a held-out part of
the responses the set covers, and writes ``DIR/draft_vocab.json``
(:func:`~mlx_dflash2.drafter.io.write_draft_vocab`), which :func:`~mlx_dflash2.loading.load` then uses by
default (``draft_vocab="full"`` / ``--draft-vocab full`` turns it off).
"""

from __future__ import annotations

import collections
import random
from pathlib import Path

from ..drafter.io import DRAFT_VOCAB_FILE, write_draft_vocab
from .regen import read_responses

__all__ = ["count_tokens", "draft_vocab", "write_vocab", "METHOD"]

METHOD = "most frequent response ids (FR-Spec, arXiv 2502.14856) + response-ending ids"  # draft_vocab.json's "method"


def count_tokens(rows: list[dict]) -> tuple[collections.Counter, set[int]]:
    """Occurrences of each id in the rows' ``response_ids``, and the ids that end a response stopped by an
    end-of-sequence token (``finish == "stop"``, as :mod:`.regen` writes it; not one cut at its length)."""
    counts: collections.Counter = collections.Counter()
    ends: set[int] = set()
    for n, r in enumerate(rows):
        ids = r.get("response_ids") if isinstance(r, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                for i in ids):
            raise ValueError(f"response row {n}: 'response_ids' must be a list of token ids (ints >= 0)")
        counts.update(ids)
        if ids and r.get("finish") == "stop":
            ends.add(int(ids[-1]))
    return counts, ends


def draft_vocab(rows: list[dict], size: int, held_out: float = 0.05, seed: int = 0) -> tuple[list[int], dict]:
    """The ``size`` most frequent response ids of ``rows`` (ties by id) plus every id that stopped a response
    (:func:`count_tokens`), ascending, and what they cover.

    Args:
        rows: response rows ``{"response_ids": [int, ...], ...}``.
        size: ids kept by frequency (the ending ids come on top).
        held_out: fraction of the rows (shuffled with ``seed``) left out of the counting, on which the
            coverage is measured (0: measured on the counted rows themselves).

    Returns:
        ``(ids, info)``; ``info``: ``kept_by_frequency``, ``ending_ids``, ``response_tokens`` counted,
        ``distinct`` ids seen, ``coverage`` (share of the held-out response tokens whose id is in the set;
        of the counted ones when ``int(rows * held_out)`` is 0: ``coverage_of`` says which),
        ``held_out_tokens``, ``held_out_fraction`` (of the rows, as held out).

    Raises:
        ValueError: ``size < 2``, ``held_out`` outside ``[0, 0.5]``, or no response tokens.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 2:
        raise ValueError(f"size must be an integer >= 2, got {size!r}")
    if not 0.0 <= held_out <= 0.5:
        raise ValueError(f"held_out must be within [0, 0.5], got {held_out!r}")
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    n_test = int(len(rows) * held_out) if len(rows) > 1 else 0
    test, train = rows[:n_test], rows[n_test:]
    counts, ends = count_tokens(train)
    total = sum(counts.values())
    if not total:
        raise ValueError("no response tokens to count (rows need non-empty 'response_ids')")
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    ids = sorted({i for i, _ in ranked[:size]} | ends)
    keep = set(ids)
    test_ids = [t for r in (test or train) for t in (r.get("response_ids") or [])]
    cover = sum(t in keep for t in test_ids) / max(len(test_ids), 1)
    # too few rows to hold any out: the coverage is the counted rows' own (and says so)
    return ids, {"kept_by_frequency": min(size, len(ranked)), "ending_ids": sorted(ends),
                 "response_tokens": total, "distinct": len(counts), "coverage": round(cover, 5),
                 "coverage_of": "held-out rows" if test else "the counted rows (too few rows to hold any out)",
                 "held_out_tokens": len(test_ids) if test else 0, "held_out_fraction": n_test / max(len(rows), 1)}


def write_vocab(data: list[str | Path], drafter: str | Path, size: int, held_out: float = 0.05,
                seed: int = 0, overwrite: bool = False) -> dict:
    """Count the responses of every ``data`` path (regen directories or shard files), write
    ``drafter/draft_vocab.json`` and return what was written (without the ids).

    Raises:
        FileNotFoundError: a ``data`` path without shards, or ``drafter`` not a drafter directory
            (no ``config.json``).
        FileExistsError: the drafter has a ``draft_vocab.json`` already and not ``overwrite``.
        ValueError: a malformed response row (naming its file).
    """
    d = Path(drafter)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"--drafter {drafter}: not a drafter directory (no config.json)")
    for p in data:
        if not Path(p).exists():
            raise FileNotFoundError(f"--data {p}: no such file or directory")
    if (d / DRAFT_VOCAB_FILE).exists() and not overwrite:
        raise FileExistsError(f"{d / DRAFT_VOCAB_FILE} exists (--overwrite replaces it)")
    rows: list[dict] = []
    for p in data:
        try:
            got = read_responses(p)
            count_tokens(got)  # the rows' ids checked here, where the file can be named
        except ValueError as e:
            raise ValueError(f"--data {p}: {e}") from None
        rows.extend(got)
    ids, info = draft_vocab(rows, size, held_out, seed)
    info = {"method": METHOD, "data": ["/".join(Path(p).parts[-2:]) for p in data], **info}
    f = write_draft_vocab(d, ids, **info)
    return {"file": str(f), "ids": len(ids), **info}
