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
(case and punctuation ignored) and passes decontamination. Each finished batch
is appended to ``OUT.partial``, so an interrupted run resumes at the next
batch; the final file is written atomically.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import time
from pathlib import Path

import mlx.core as mx

from .data import Decontaminator
from .regen import batched_decode

__all__ = ["STARTERS", "self_instruct", "user_turn_prefix"]

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
}

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


def _norm(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.lower()))


def _plan(n_batches: int, batch_size: int, seed: int) -> list[list[tuple[str, str]]]:
    """(kind, opening) for every row of every batch, a pure function of the seed."""
    rng = random.Random(seed)
    kinds = list(STARTERS)
    weights = [STARTERS[k][0] for k in kinds]
    plan = []
    for _ in range(n_batches):
        row = []
        for _ in range(batch_size):
            k = rng.choices(kinds, weights)[0]
            row.append((k, rng.choice(STARTERS[k][1])))
        plan.append(row)
    return plan


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
    progress: bool = True,
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
        max_batches: give up after this many batches (default: enough for
            ``n`` if a quarter of the samples were kept).
        seed: seeds the openings and ``mx.random`` per batch.

    Returns:
        ``{"kept", "sampled", "batches", "dropped": {reason: count}, "by_kind", "seconds", "resumed_batches"}``.

    Raises:
        ValueError: ``n``/``batch_size``/``max_tokens`` below 1, ``out`` a
            directory, a tokenizer without a usable chat template, or a
            ``OUT.partial`` from other settings.
    """
    from tqdm import tqdm

    for flag, v in (("n", n), ("batch_size", batch_size), ("max_tokens", max_tokens)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"{out} is a directory, not a file")
    prefix = user_turn_prefix(tokenizer)
    eos = set(int(e) for e in tokenizer.eos_token_ids)
    if max_batches is None:
        max_batches = max(1, -(-4 * n // batch_size))
    plan = _plan(max_batches, batch_size, seed)
    meta = {"n": n, "temp": temp, "max_tokens": max_tokens, "batch_size": batch_size, "min_words": min_words,
            "max_chars": max_chars, "seed": seed, "prefix": prefix}
    partial = out.with_name(out.name + ".partial")
    done: list[dict] = []  # one record per finished batch
    if partial.is_file():
        lines = [json.loads(x) for x in partial.read_text().splitlines() if x.strip()]
        if not lines or lines[0].get("meta") != meta:
            raise ValueError(f"{partial} was made with other settings; delete it (or use another --out)")
        done = lines[1:]
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"meta": meta}) + "\n")
    dec = Decontaminator()
    seen: set[str] = set()
    kept: list[dict] = []
    dropped = {"unfinished": 0, "short": 0, "long": 0, "template": 0, "duplicate": 0, "contaminated": 0}
    sampled = 0
    for rec in done:
        for r in rec["rows"]:
            seen.add(_norm(r["messages"][0]["content"]))
        kept.extend(rec["rows"])
        sampled += rec["sampled"]
        for k, v in rec["dropped"].items():
            dropped[k] += v
    markers = [t for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "[INST]") if t in prefix]
    tic = time.perf_counter()
    bar = tqdm(total=n, initial=min(len(kept), n), desc="self-instruct", unit="request", disable=not progress,
               file=sys.stderr)
    b = len(done)
    while len(kept) < n and b < max_batches:
        rows = plan[b]
        prompts = [tokenizer.encode(prefix + opening, add_special_tokens=False) for _, opening in rows]
        mx.random.seed(seed * 100003 + b)
        gen = batched_decode(target.model, prompts, max_tokens, temp, sorted(eos))
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
        kept.extend(rec["rows"])
        sampled += rec["sampled"]
        for k, v in rec["dropped"].items():
            dropped[k] += v
        bar.update(min(len(kept), n) - bar.n)
        b += 1
    bar.close()
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
            "by_kind": by_kind, "seconds": time.perf_counter() - tic}
