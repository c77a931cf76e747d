"""Self-instruct prompts: the target writes the user turns itself (Magpie).

An instruction-tuned target, given its chat template up to the start of a user
turn, samples a plausible user request (Magpie: Xu et al. 2024,
arXiv:2406.08464, §2.1). The requests follow the target's own instruction
tuning distribution, so its greedy answers to them (:mod:`.regen`) are
on-policy training data from a source disjoint from every evaluation set (the
DFlash2 spec §3.1/§5.8 asks for regenerated, on-policy data; every request is
still passed through :class:`~.data.Decontaminator`).

A fraction of the requests is steered by opening words (``STARTERS``: generic
openings by task kind such as "Write a", "Calculate", "Pretend you are"; none
is taken from an evaluation set): the target continues the opening, so the
kinds of request are spread wider than what it writes unprompted.

Requests are sampled in batches with :func:`~.regen.batched_decode`; a request
is kept when the target ended it (EOS) within ``max_tokens``, it has at least
``min_words`` words, contains no chat-template marker, is not a duplicate
(case and punctuation ignored, also against the ``exclude`` prompt files, e.g. the output of an
earlier seed) and passes decontamination. Each finished batch is appended to
``OUT.partial``, so an interrupted run resumes at the next batch; the final
file is written atomically, and only once ``n`` requests are kept.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from pathlib import Path

import mlx.core as mx

from .data import Decontaminator
from .regen import batched_decode

__all__ = ["STARTERS", "check_kinds", "check_self_instruct_args", "parse_kinds", "self_instruct", "user_turn_prefix"]

# Opening words by task kind, with the share of requests that get one ("open": none, plain Magpie).
STARTERS: dict[str, tuple[float, tuple[str, ...]]] = {
    "open": (0.35, ("",)),
    "writing": (0.09, ("Write a", "Compose a", "Draft an email", "Write a short story about", "Write a poem about",
                       "Write a blog post about", "Rewrite the following", "Write a letter")),
    "roleplay": (0.06, ("Pretend you are", "Imagine you are", "Act as a", "You are a", "Role-play as")),
    "reasoning": (0.08, ("If", "Suppose", "Why does", "Which is", "Is it true that", "Explain why")),
    "math": (0.15, ("Calculate", "Solve", "What is", "A store sells", "A train travels", "How many",
                    "Find the", "A farmer has", "The price of", "If a")),
    "coding": (0.09, ("Write a Python function", "How do I", "Write a program", "Fix the bug in", "Write a SQL query",
                      "Implement a", "What does this code do", "Write a JavaScript function")),
    "extraction": (0.06, ("Extract", "Summarize the following", "List the", "Classify the following",
                          "Identify the")),
    "stem": (0.06, ("Explain how", "What is the difference between", "Describe the process of", "How does")),
    "humanities": (0.06, ("Discuss", "What were the causes of", "Compare", "Analyze", "What is the significance of")),
    # a function for the target to complete (a signature and docstring of its own): none unless asked for
    # (``kinds``); last, so the default plan of every seed is unchanged by it
    "completion": (0.0, ("Complete the following Python function:\n\n```python\ndef",
                         "Implement this function:\n\n```python\ndef",
                         "Finish the implementation:\n\n```python\nimport",
                         "Fill in the body of this function:\n\n```python\ndef")),
}


def parse_kinds(spec: str) -> dict[str, float]:
    """``"coding=3,completion=3,math=2"`` -> ``{kind: weight}`` for :func:`self_instruct`'s ``kinds``
    (``self-instruct --kinds``), checked by :func:`check_kinds`.

    Raises:
        ValueError: an empty entry, an entry without ``=WEIGHT`` or with a weight that is not a number, a
            repeated kind, or what :func:`check_kinds` refuses.
    """
    out: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise ValueError(f"request kinds {spec!r}: an empty entry; expected KIND=WEIGHT,..., e.g. coding=3,math=2")
        kind, eq, w = (t.strip() for t in part.partition("="))
        if kind in out:
            raise ValueError(f"request kind {kind!r} given twice in {spec!r}")
        try:
            out[kind] = float(w) if eq else math.nan
        except ValueError:
            out[kind] = math.nan
    return check_kinds(out)


def check_kinds(kinds: dict[str, float]) -> dict[str, float]:
    """``kinds`` (weights by kind of request) as :func:`self_instruct` takes them, else an error.

    Raises:
        ValueError: an unknown kind (the message lists ``STARTERS``' kinds), a weight that is not a finite
            number >= 0, or weights that sum to 0 or overflow.
    """
    for kind, weight in kinds.items():
        if kind not in STARTERS:
            raise ValueError(f"unknown request kind {kind!r}; kinds: {', '.join(STARTERS)}")
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
            raise ValueError(f"request kind {kind!r}: expected KIND=WEIGHT with a weight >= 0, e.g. coding=3 "
                             f"(got {weight!r})")
    total = sum(kinds.values())
    if not total > 0:
        raise ValueError(f"request kinds {kinds}: the weights sum to 0")
    if not math.isfinite(total):  # random.choices refuses it (after the target has loaded)
        raise ValueError(f"request kinds {kinds}: the weights must sum to a finite number")
    return dict(kinds)


_PLACEHOLDER = "\x00USER\x00"


def user_turn_prefix(tokenizer) -> str:
    """The chat template's text up to where a user turn's content starts.

    Rendered from a one-turn conversation with a placeholder content, cut at
    the placeholder (the template's default system prompt, if any, is kept).

    Raises:
        ValueError: the tokenizer has no chat template, or its template does not
            place the user content verbatim.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("self-instruct needs a chat template (the target's tokenizer has none)")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _PLACEHOLDER}], add_generation_prompt=False,
                                         tokenize=False)
    if _PLACEHOLDER not in text:
        raise ValueError("the chat template does not place the user's content verbatim; self-instruct cannot cut it")
    return text[: text.index(_PLACEHOLDER)]


_norm = Decontaminator._norm  # the dedupe key: lower-case words, punctuation ignored


def _plan(n_batches: int, batch_size: int, seed: int, kinds: dict[str, float] | None = None
          ) -> list[list[tuple[str, str]]]:
    """(kind, opening) for every row of every batch, a pure function of the seed (and ``kinds``: weights
    by kind, in place of ``STARTERS``' shares)."""
    rng = random.Random(seed)
    names = list(STARTERS)
    weights = [STARTERS[k][0] if kinds is None else kinds.get(k, 0.0) for k in names]
    plan = []
    for _ in range(n_batches):
        row = []
        for _ in range(batch_size):
            k = rng.choices(names, weights)[0]
            row.append((k, rng.choice(STARTERS[k][1])))
        plan.append(row)
    return plan


def check_self_instruct_args(out, n: int, batch_size: int, max_tokens: int, max_batches: int | None, seed: int,
                             temp: float) -> None:
    """Validate :func:`self_instruct`'s settings before anything is loaded or written.

    Raises:
        ValueError: a count below 1, a negative seed, a temperature that is not a
            positive number, or ``out`` a directory or under a file.
    """
    for flag, v in (("n", n), ("batch_size", batch_size), ("max_tokens", max_tokens), ("max_batches", max_batches)):
        if v is not None and v < 1:
            raise ValueError(f"{flag} (--{flag.replace('_', '-')}) must be >= 1, got {v}")
    if seed < 0:
        raise ValueError(f"seed (--seed) must be >= 0, got {seed}")
    if not (math.isfinite(temp) and temp > 0):
        raise ValueError(f"temp (--temp) must be a number > 0 (greedy would write one request), got {temp}")
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"{out} is a directory, not a file")
    up = out.parent
    while not up.exists() and up != up.parent:
        up = up.parent
    if not up.is_dir():
        raise ValueError(f"{up} is a file, so {out} cannot be written")


def self_instruct(
    target,
    tokenizer,
    n: int,
    out: str | Path,
    temp: float = 1.0,
    max_tokens: int = 128,
    batch_size: int = 512,
    min_words: int = 4,
    max_chars: int = 2000,
    max_batches: int | None = None,
    seed: int = 0,
    exclude: list[str | Path] = (),
    progress: bool = True,
    kinds: dict[str, float] | None = None,
) -> dict:
    """Have the target write ``n`` user requests; save them as a prompt file for ``regen``.

    Args:
        target: :class:`~mlx_dflash2.target.TargetAdapter` (an instruction-tuned model).
        tokenizer: its tokenizer (chat template, ``encode``/``decode``, ``eos_token_ids``).
        n: requests to keep (the run stops once it has them).
        out: JSONL file to write, rows ``{id, source, messages}`` with
            ``source`` = ``self-instruct:KIND`` (see ``STARTERS``).
        temp: sampling temperature of the requests (Magpie samples at 1).
        max_tokens: a request the target has not ended within this many tokens is dropped.
        batch_size: requests sampled together.
        min_words, max_chars: shorter / longer requests are dropped.
        max_batches: stop after this many batches (default: enough for
            ``n`` if a quarter of the samples were kept). A run that stops
            short of ``n`` keeps ``OUT.partial`` and raises; rerunning with a
            larger ``max_batches`` continues it.
        seed: seeds the openings and ``mx.random`` per batch (>= 0).
        exclude: prompt files (any :func:`~.data.read_prompt_file` format)
            whose requests count as already seen.
        kinds: relative weights of the kinds of request (``STARTERS``' keys; :func:`parse_kinds`), e.g.
            more code for a code model's drafter; kinds left out get none. Default: ``STARTERS``' shares.

    Returns:
        ``{"kept", "sampled", "batches", "dropped": {reason: count}, "surplus",
        "by_kind", "seconds", "resumed_batches"}``; ``sampled`` = ``kept`` +
        the dropped counts + ``surplus`` (requests of the last batch past ``n``).

    Raises:
        ValueError: ``n``/``batch_size``/``max_tokens``/``max_batches`` below 1,
            ``kinds`` refused by :func:`check_kinds`, a negative seed, a temperature that is not a positive
            number, ``out`` a directory or under a file, a tokenizer without a usable chat
            template, an ``OUT.partial`` from other settings or target (or not
            one of ours), or fewer than ``n`` requests kept after ``max_batches``.
    """
    from tqdm import tqdm

    from .data import read_prompt_file
    from .evaluate import target_fingerprint

    check_self_instruct_args(out, n, batch_size, max_tokens, max_batches, seed, temp)
    out = Path(out)
    prefix = user_turn_prefix(tokenizer)
    eos = set(int(e) for e in tokenizer.eos_token_ids)
    if max_batches is None:
        max_batches = max(1, -(-4 * n // batch_size))
    if kinds is not None:
        kinds = check_kinds(kinds)
    plan = _plan(max_batches, batch_size, seed, kinds)
    meta = {"n": n, "temp": temp, "max_tokens": max_tokens, "batch_size": batch_size, "min_words": min_words,
            "max_chars": max_chars, "seed": seed, "prefix": prefix, "target": target_fingerprint(target)}
    if kinds is not None:  # (absent by default: a partial file of an earlier version still resumes)
        meta["kinds"] = {k: w for k, w in kinds.items() if w > 0}  # a kind at 0 is a kind left out
    partial = out.with_name(out.name + ".partial")
    done = _read_partial(partial, meta)  # one record per finished batch
    if not partial.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"meta": meta}) + "\n")
    dec = Decontaminator()
    seen: set[str] = {_norm(m["content"]) for f in exclude for r in read_prompt_file(f) for m in r["messages"][:1]}
    kept: list[dict] = []
    dropped = {"unfinished": 0, "short": 0, "long": 0, "template": 0, "duplicate": 0, "contaminated": 0}
    sampled = 0

    def absorb(rec: dict) -> None:  # one finished batch (resumed or new) into the run's totals
        nonlocal sampled
        kept.extend(rec["rows"])
        sampled += rec["sampled"]
        for k, v in rec["dropped"].items():
            dropped[k] += v

    for rec in done:
        seen.update(_norm(r["messages"][0]["content"]) for r in rec["rows"])
        absorb(rec)
    markers = [t for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "[INST]") if t in prefix]
    tic = time.perf_counter()
    bar = tqdm(total=n, initial=min(len(kept), n), desc="self-instruct", unit="request", disable=not progress,
               file=sys.stderr)
    b = len(done)
    while len(kept) < n and b < max_batches:
        rows = plan[b]
        prompts = [tokenizer.encode(prefix + opening, add_special_tokens=False) for _, opening in rows]
        mx.random.seed(seed * 100003 + b)
        gen = batched_decode(target.model, prompts, max_tokens, temp, sorted(eos), vocab_size=target.vocab_size)
        rec = {"batch": b, "sampled": len(rows), "rows": [], "dropped": {k: 0 for k in dropped}}
        for (kind, opening), toks in zip(rows, gen):
            if not toks or toks[-1] not in eos:
                rec["dropped"]["unfinished"] += 1
                continue
            text = (opening + tokenizer.decode(toks[:-1])).strip()
            key = _norm(text)
            why = ("short" if len(key.split()) < min_words else "long" if len(text) > max_chars
                   else "template" if any(m in text for m in markers)
                   else "duplicate" if key in seen else "contaminated" if not dec.clean(text) else None)
            if why:
                rec["dropped"][why] += 1
                continue
            seen.add(key)
            rec["rows"].append({"id": f"self-{seed}-{b}-{len(rec['rows'])}", "source": f"self-instruct:{kind}",
                                "messages": [{"role": "user", "content": text}]})
        with open(partial, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        absorb(rec)
        bar.update(min(len(kept), n) - bar.n)
        b += 1
    bar.close()
    if len(kept) < n:
        raise ValueError(f"kept {len(kept)} of {n} requests after {b} batches (dropped: "
                         + ", ".join(f"{k} {v}" for k, v in dropped.items() if v)
                         + f"); {partial} is kept: rerun with a larger max_batches (--max-batches) to continue")
    surplus = len(kept) - n
    kept = kept[:n]
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in kept:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    partial.unlink()
    by_kind: dict[str, int] = {}
    for r in kept:
        k = r["source"].split(":", 1)[1]
        by_kind[k] = by_kind.get(k, 0) + 1
    return {"kept": len(kept), "sampled": sampled, "batches": b, "resumed_batches": len(done), "dropped": dropped,
            "surplus": surplus, "by_kind": by_kind, "seconds": time.perf_counter() - tic}


def _read_partial(partial: Path, meta: dict) -> list[dict]:
    """The finished batches of an earlier run with the same settings (a cut last line, as a killed
    run can leave, is dropped and rewritten later).

    Raises:
        ValueError: not a self-instruct partial file, or one from other settings or another target.
    """
    if not partial.is_file():
        return []
    lines = partial.read_text(encoding="utf-8").splitlines(keepends=True)
    recs = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1 and not line.endswith("\n") and i > 0:  # a cut last append
                partial.write_text("".join(lines[:-1]), encoding="utf-8")
                break
            raise ValueError(f"{partial}:{i + 1}: not valid JSON; delete the file to start over") from None
        if not isinstance(rec, dict) or (i == 0 and "meta" not in rec) or (i > 0 and "rows" not in rec):
            raise ValueError(f"{partial}:{i + 1}: not a self-instruct partial file; delete it to start over")
        recs.append(rec)
    if not recs or recs[0]["meta"] != meta:
        raise ValueError(f"{partial} was made with other settings or another target; delete it (or use another --out)")
    return recs[1:]
