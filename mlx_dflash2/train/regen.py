"""Regenerate training responses with the target itself (on-policy data).

Block drafters learn best from the target's own outputs (DFlash paper §4 and
SpecForge's DFlash2 recipe, spec §3.1/§5.8). Prompts are chat-templated,
answered by the target with mlx-lm's continuous batching (``batch_generate``),
and written as token ids in shards of ``shard_size`` prompts:
``shard-00000.jsonl`` ... with rows ``{id, source, prompt_ids, response_ids,
finish, temp}``. Each shard is written atomically, so an interrupted run
resumes by skipping the shards already present.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx

__all__ = ["regenerate", "read_responses"]


def _shard_path(out: Path, i: int) -> Path:
    return out / f"shard-{i:05d}.jsonl"


def regenerate(
    target,
    tokenizer,
    prompts: list[dict],
    out: str | Path,
    max_tokens: int = 256,
    batch_size: int = 256,
    shard_size: int = 1024,
    temp_fraction: float = 0.0,
    temp: float = 0.7,
    max_prompt_tokens: int = 1024,
    seed: int = 0,
    progress: bool = True,
    time_budget: float | None = None,
) -> dict:
    """Answer ``prompts`` with the target and write the token ids.

    Args:
        target: :class:`~mlx_dflash2.target.TargetAdapter` (its ``model`` is used).
        tokenizer: the target's tokenizer (chat template).
        prompts: ``[{"id", "source", "messages"}]``.
        out: output directory (created; existing shards are kept = resume).
        max_tokens: response length limit (tokens).
        batch_size: sequences decoded together.
        shard_size: prompts per shard file.
        temp_fraction: fraction of prompts answered by sampling at ``temp``
            (the rest greedily); which ones is a deterministic function of
            ``seed`` and the prompt index.
        max_prompt_tokens: longer prompts are skipped.
        time_budget: stop (between shards) after this many seconds; a later
            call resumes with the missing shards.

    Returns:
        ``{"shards", "written", "skipped_shards", "tokens", "seconds"}``.
    """
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").write_text(
        json.dumps({"max_tokens": max_tokens, "temp_fraction": temp_fraction, "temp": temp, "seed": seed}) + "\n"
    )
    eos = sorted(tokenizer.eos_token_ids)
    n_shards = (len(prompts) + shard_size - 1) // shard_size
    stats = {"shards": n_shards, "written": 0, "skipped_shards": 0, "tokens": 0, "seconds": 0.0}
    tic = time.perf_counter()
    bar = tqdm(total=len(prompts), desc="regenerate", unit="prompt", disable=not progress, file=sys.stderr)
    for si in range(n_shards):
        if time_budget is not None and time.perf_counter() - tic > time_budget:
            stats["stopped_early"] = True
            break
        path = _shard_path(out, si)
        rows = prompts[si * shard_size : (si + 1) * shard_size]
        if path.is_file():
            stats["skipped_shards"] += 1
            bar.update(len(rows))
            continue
        encoded = []
        for k, r in enumerate(rows):
            ids = tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True)
            if len(ids) > max_prompt_tokens:
                continue
            idx = si * shard_size + k
            sampled = temp_fraction > 0 and ((idx * 2654435761 + seed) % 1000) / 1000.0 < temp_fraction
            encoded.append((r, ids, sampled))
        results = []
        for sampled in (False, True):
            group = [e for e in encoded if e[2] == sampled]
            for b in range(0, len(group), batch_size):
                chunk = group[b : b + batch_size]
                kwargs = {}
                if sampled:
                    mx.random.seed(seed * 100003 + si * 101 + b)
                    kwargs["sampler"] = make_sampler(temp=temp)
                resp = batch_generate(
                    target.model,
                    tokenizer,
                    [ids for _, ids, _ in chunk],
                    max_tokens=max_tokens,
                    return_token_ids=True,
                    completion_batch_size=batch_size,
                    prefill_batch_size=min(batch_size, 64),
                    **kwargs,
                )
                for (r, ids, s), toks in zip(chunk, resp.token_ids):
                    finish = "length" if len(toks) >= max_tokens else "stop"
                    if finish == "stop" and eos:
                        toks = list(toks) + [eos[0]]  # keep the EOS: the drafter should learn to predict it
                    results.append(
                        {
                            "id": r["id"],
                            "source": r.get("source", ""),
                            "prompt_ids": ids,
                            "response_ids": list(toks),
                            "finish": finish,
                            "temp": temp if s else 0.0,
                        }
                    )
                    stats["tokens"] += len(toks)
                bar.update(len(chunk))
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for row in results:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, path)
        stats["written"] += len(results)
    bar.close()
    stats["seconds"] = time.perf_counter() - tic
    return stats


def read_responses(path: str | Path) -> list[dict]:
    """All rows of a response directory (or a single shard file), in shard order.

    Raises:
        FileNotFoundError: no shards.
    """
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("shard-*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no response shards (shard-*.jsonl) in {path}")
    rows = []
    for f in files:
        with open(f) as fh:
            rows.extend(json.loads(line) for line in fh if line.strip())
    return rows
