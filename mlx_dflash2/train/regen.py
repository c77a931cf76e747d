"""Regenerate training responses with the target itself (on-policy data).

Block drafters learn best from the target's own outputs (DFlash paper §4 and
SpecForge's DFlash2 recipe, spec §3.1/§5.8). Prompts are chat-templated and
answered by the target, each once per temperature in ``temps`` (0 = greedy),
with :func:`batched_decode`: left-padded static batches on mlx-lm's
``BatchKVCache``, one pipelined step per token for the whole batch, no
per-sequence host work per step. (On the H200 with the Q4_1 target both this
loop and mlx-lm's ``batch_generate`` reach only ~2k tokens/s at batch 512: the
quantized step itself is slow there; see benchmarks/README.md.) The rows
are written as token ids in shards of ``shard_size`` prompts:
``shard-00000.jsonl`` ... with rows ``{id, source, prompt_ids, response_ids,
finish, temp}``. Each shard is written atomically, so an interrupted run
resumes by skipping the shards already present. Prompts longer than
``max_prompt_tokens`` (chat-templated) are skipped, and counted in the returned
stats (``too_long_prompts``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

__all__ = ["regenerate", "read_responses", "batched_decode"]


def _shard_path(out: Path, i: int) -> Path:
    return out / f"shard-{i:05d}.jsonl"


def batched_decode(
    model,
    prompts: list[list[int]],
    max_tokens: int,
    temps: list[float] | float = 0.0,
    eos_ids=(),
    prefill_chunk: int = 256,
    check_every: int = 16,
    vocab_size: int | None = None,
) -> list[list[int]]:
    """Decode a batch of prompts together (greedy or temperature sampling per row).

    Prompts are left-padded into one ``(N, L)`` int32 batch; mlx-lm's
    ``BatchKVCache`` masks the padding and gives each row its own RoPE
    offsets, so each row's tokens equal its solo decoding up to floating-point
    reassociation. The prompt but its last column is prefilled in chunks of
    ``prefill_chunk`` columns, the last column on its own, so the LM head runs
    on one column per row (logits ``N x V``, never ``N x prefill_chunk x V``).
    Decoding is pipelined (``mx.async_eval``) and the host looks at the tokens
    every ``check_every`` steps to stop once every row has emitted an EOS.

    Args:
        model: an mlx-lm model (``model(tokens, cache=...) -> (N, T, V)`` logits).
        prompts: N token-id lists (non-empty).
        max_tokens: tokens generated per row at most.
        temps: one temperature per row (or one for all); 0 = argmax. Sampling
            draws from ``mx.random`` (seed it for reproducibility).
        eos_ids: ids that end a row (kept in the output).
        vocab_size: the real vocabulary; ids ``>=`` it (padding rows of the LM
            head, e.g. a Qwen checkpoint's) are never emitted (``None``: all
            rows are real). Pass the target adapter's ``vocab_size``.

    Returns:
        N lists of generated ids, each cut after its first EOS.

    Raises:
        ValueError: an empty prompt.
    """
    from mlx_lm.models.cache import BatchKVCache

    n = len(prompts)
    if any(len(p) == 0 for p in prompts):
        raise ValueError("batched_decode: empty prompt")
    if isinstance(temps, (int, float)):
        temps = [float(temps)] * n
    L = max(len(p) for p in prompts)
    pads = [L - len(p) for p in prompts]
    toks = np.zeros((n, L), dtype=np.int32)
    for i, p in enumerate(prompts):
        toks[i, pads[i]:] = p
    cache = [BatchKVCache(left_padding=pads) for _ in model.layers]
    t = mx.array(temps, dtype=mx.float32)[:, None]
    sampled = mx.array([x > 0 for x in temps])
    inv_t = 1.0 / mx.maximum(t, 1e-6)
    any_sampled = any(x > 0 for x in temps)

    def pick(logits):
        logits = logits.astype(mx.float32)
        if vocab_size is not None and logits.shape[-1] > vocab_size:
            logits = mx.where(mx.arange(logits.shape[-1]) >= vocab_size, -mx.inf, logits)
        y = mx.argmax(logits, axis=-1)
        if any_sampled:
            y = mx.where(sampled, mx.random.categorical(logits * inv_t), y)
        return y.astype(mx.int32)

    x = mx.array(toks)
    # every column but the last in chunks, evaluating the caches only (the LM head's lazy logits are never
    # computed), then the last column alone: a forward's (N, T, V) logits are computed whole before any slice,
    # and for the 1,024 rows x ~230 columns of a long prompt's last chunk at Qwen's 151,936 ids that is ~70 GB
    # (regen ran out of an H100's memory on later-turn prompts, session 32)
    for c in range(0, L - 1, prefill_chunk):
        model(x[:, c : min(c + prefill_chunk, L - 1)], cache=cache)
        mx.eval([c_.keys for c_ in cache])
    y = pick(model(x[:, L - 1 :], cache=cache)[:, -1])
    mx.async_eval(y)
    out = [y]
    eos = mx.array(sorted(set(int(e) for e in eos_ids)) or [-1], dtype=mx.int32)
    done = mx.zeros((n,), dtype=mx.bool_)
    for step in range(1, max_tokens):
        done = done | mx.any(y[:, None] == eos[None, :], axis=1)
        if step % check_every == 0 and bool(mx.all(done).item()):
            break
        y = pick(model(y[:, None], cache=cache)[:, -1])
        mx.async_eval(y, done)
        out.append(y)
    gen = np.array(mx.stack(out, axis=1))
    eos_set = set(int(e) for e in eos_ids)
    result = []
    for row in gen.tolist():
        for j, tok in enumerate(row):
            if tok in eos_set:
                row = row[: j + 1]
                break
        result.append(row)
    return result


def _temps_for(temps, temp_fraction: float, temp: float, idx: int, seed: int) -> list[float]:
    if temps:
        return [float(x) for x in temps]
    sampled = temp_fraction > 0 and ((idx * 2654435761 + seed) % 1000) / 1000.0 < temp_fraction
    return [temp if sampled else 0.0]


def check_regen_args(out, max_tokens: int, batch_size: int, shard_size: int, temps=None,
                     max_prompt_tokens: int = 1024, temp_fraction: float = 0.0, temp: float = 0.7, seed: int = 0,
                     time_budget: float | None = None) -> None:
    """Validate :func:`regenerate`'s settings before anything is loaded or written.

    Raises:
        ValueError: a count below 1, a negative seed, an empty ``temps``, a temperature that is not a
            number >= 0, a ``temp_fraction`` outside [0, 1], a ``time_budget`` not above 0, or ``out``
            an existing file.
    """
    for flag, v in (("max_tokens", max_tokens), ("batch_size", batch_size), ("shard_size", shard_size),
                    ("max_prompt_tokens", max_prompt_tokens)):
        if v < 1:
            raise ValueError(f"{flag} (--{flag.replace('_', '-')}) must be >= 1, got {v}")
    if seed < 0:
        raise ValueError(f"seed (--seed) must be >= 0, got {seed}")
    if temps is not None and (len(temps) == 0 or not all(math.isfinite(t) and t >= 0 for t in temps)):
        raise ValueError(f"temps (--temps) must be one or more temperatures >= 0, got {temps}")
    if not (math.isfinite(temp) and temp >= 0):
        raise ValueError(f"temp (--temp) must be a number >= 0, got {temp}")
    if not 0 <= temp_fraction <= 1:
        raise ValueError(f"temp_fraction (--temp-fraction) must be between 0 and 1, got {temp_fraction}")
    if time_budget is not None and not (math.isfinite(time_budget) and time_budget > 0):
        raise ValueError(f"time_budget (--time-budget) must be a number of seconds > 0, got {time_budget}")
    if Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"{out} is a file, not a directory")
    for parent in Path(out).parents:  # out under a file: os.makedirs would fail with a bare errno
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{out}: {parent} is a file, not a directory")
            break


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
    temps: list[float] | None = None,
) -> dict:
    """Answer ``prompts`` with the target and write the token ids.

    Args:
        target: :class:`~mlx_dflash2.target.TargetAdapter` (its ``model`` is used).
        tokenizer: the target's tokenizer (chat template).
        prompts: ``[{"id", "source", "messages"}]``.
        out: output directory (created; existing shards are kept = resume).
        max_tokens: response length limit (tokens).
        batch_size: sequences decoded together (rows are sorted by prompt
            length within a shard, so a batch has little padding).
        shard_size: prompts per shard file.
        temps: answer every prompt once per temperature in this list (0 =
            greedy), e.g. ``[0, 0.7, 1.0]``. When None: one answer per prompt,
            sampled at ``temp`` for a ``temp_fraction`` of the prompts (a
            deterministic function of ``seed`` and the prompt index), greedy
            for the rest.
        max_prompt_tokens: longer prompts (chat-templated) are skipped and
            counted (``too_long_prompts``).
        seed: seeds ``mx.random`` per batch (reproducible on one backend).
        time_budget: stop (between shards) after this many seconds; a later
            call resumes with the missing shards.

    Returns:
        ``{"shards", "written", "skipped_shards", "too_long_prompts", "tokens", "seconds", "tokens_per_s"}``
        (and ``"stopped_early": True`` when ``time_budget`` stopped it): ``written`` answers written by this
        call, ``skipped_shards`` shards found present (resumed), ``too_long_prompts`` prompts skipped for being
        longer than ``max_prompt_tokens``, in the shards written or found present (not in shards left for later).

    Raises:
        ValueError: bad settings (:func:`check_regen_args`), checked before anything is written.
    """
    from tqdm import tqdm

    check_regen_args(out, max_tokens, batch_size, shard_size, temps, max_prompt_tokens, temp_fraction, temp, seed,
                     time_budget)
    out = Path(out)
    meta = {"max_tokens": max_tokens, "temp_fraction": temp_fraction, "temp": temp, "temps": temps, "seed": seed,
            "shard_size": shard_size, "max_prompt_tokens": max_prompt_tokens, "prompts": len(prompts),
            "prompts_sha1": _prompts_digest(prompts)}
    _check_resumable(out, meta)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").write_text(json.dumps(meta) + "\n")
    eos = sorted(tokenizer.eos_token_ids)
    n_shards = (len(prompts) + shard_size - 1) // shard_size
    stats = {"shards": n_shards, "written": 0, "skipped_shards": 0, "too_long_prompts": 0, "tokens": 0,
             "seconds": 0.0}
    tic = time.perf_counter()
    per_prompt = len(temps) if temps else 1
    bar = tqdm(total=len(prompts) * per_prompt, desc="regenerate", unit="answer", disable=not progress,
               file=sys.stderr)
    try:
        for si in range(n_shards):
            if time_budget is not None and time.perf_counter() - tic > time_budget:
                stats["stopped_early"] = True
                break
            path = _shard_path(out, si)
            rows = prompts[si * shard_size : (si + 1) * shard_size]
            if path.is_file():
                stats["skipped_shards"] += 1
                with open(path) as fh:  # every prompt kept has per_prompt rows there
                    stats["too_long_prompts"] += len(rows) - sum(1 for line in fh if line.strip()) // per_prompt
                bar.update(len(rows) * per_prompt)
                continue
            jobs = []  # (prompt row, ids, temperature)
            for k, r in enumerate(rows):
                ids = tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True)
                if len(ids) > max_prompt_tokens:
                    stats["too_long_prompts"] += 1
                    bar.update(per_prompt)
                    continue
                for tt in _temps_for(temps, temp_fraction, temp, si * shard_size + k, seed):
                    jobs.append((r, ids, tt))
            order = sorted(range(len(jobs)), key=lambda j: len(jobs[j][1]))
            answers = [None] * len(jobs)
            for b in range(0, len(order), batch_size):
                chunk = order[b : b + batch_size]
                mx.random.seed(seed * 100003 + si * 101 + b)
                resp = batched_decode(target.model, [jobs[j][1] for j in chunk], max_tokens,
                                      [jobs[j][2] for j in chunk], eos, vocab_size=target.vocab_size)
                for j, toks in zip(chunk, resp):
                    answers[j] = toks
                bar.update(len(chunk))
            results = []
            for (r, ids, tt), toks in zip(jobs, answers):
                finish = "stop" if toks and toks[-1] in eos else "length"
                results.append({"id": r["id"], "source": r.get("source", ""), "prompt_ids": ids,
                                "response_ids": list(toks), "finish": finish, "temp": tt})
                stats["tokens"] += len(toks)
            tmp = path.with_suffix(".tmp")
            try:
                with open(tmp, "w") as f:
                    for row in results:
                        f.write(json.dumps(row) + "\n")
                os.replace(tmp, path)
            except BaseException:  # e.g. Ctrl-C while writing: no partial file left behind
                tmp.unlink(missing_ok=True)
                raise
            stats["written"] += len(results)
    finally:  # (interrupted too: the bar is done before the caller's message)
        bar.close()
    stats["seconds"] = time.perf_counter() - tic
    stats["tokens_per_s"] = stats["tokens"] / max(stats["seconds"], 1e-9)
    return stats


def _prompts_digest(prompts: list[dict]) -> str:
    import hashlib

    h = hashlib.sha1()
    for r in prompts:
        h.update(json.dumps([r.get("id"), r.get("messages")], sort_keys=True).encode())
    return h.hexdigest()


def _check_resumable(out: Path, meta: dict) -> None:
    """An existing ``out`` is resumed only if it was made from the same prompts and settings.

    Raises:
        ValueError: ``out/meta.json`` records other prompts or settings (the
            shards there would be skipped as done, and the new prompts never answered).
    """
    f = out / "meta.json"
    if not f.is_file():
        return
    try:
        old = json.loads(f.read_text())
    except ValueError:
        raise ValueError(f"{f}: unreadable; use another --out") from None
    diff = [k for k in old if k in meta and old[k] != meta[k]]
    if diff:
        what = ", ".join(f"{k} {old[k]!r} -> {meta[k]!r}" if k != "prompts_sha1" else "the prompts" for k in diff)
        raise ValueError(f"{out} holds answers made with other prompts or settings ({what}); "
                         "use another --out (or delete it to start over)")


def read_responses(path: str | Path) -> list[dict]:
    """All rows of a response directory (or a single shard file), in shard order.

    Raises:
        FileNotFoundError: no shards.
        ValueError: a line that is not JSON (naming the file and line).
    """
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("shard-*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no response shards (shard-*.jsonl) in {path}")
    rows = []
    for f in files:
        with open(f) as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except ValueError as e:
                        raise ValueError(f"{f}, line {n}: not a JSON row ({e})") from None
    return rows
