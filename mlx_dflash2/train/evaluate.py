"""Acceptance length tau of a drafter on held-out prompts, by exact greedy replay.

Greedy speculative decoding is lossless, so its output is the target's own
greedy continuation, and the round structure is a deterministic function of
that continuation and of the drafter's proposals: each round the drafter
proposes ``n`` tokens after the anchor from the context features of the
committed tokens, ``a`` = the longest prefix of the proposal that equals the
continuation, and ``a + 1`` tokens are emitted. This module replays exactly
that loop (same block shrinking near ``max_tokens``, same stop accounting as
:func:`mlx_dflash2.speculative.speculative_generate_step`), for many prompts
at once: the context features come from one target forward over
prompt + continuation, the drafter runs its packed-blocks forward on every
active sequence's current block per step. tau = tokens emitted per target
forward (bonus included).

The continuations are produced by :func:`~.regen.regenerate` (mlx-lm batched
greedy decoding); ``check_against_loop`` re-runs the real loop on a few
prompts to confirm that replay and loop agree.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..lookup import SuffixIndex
from ..speculative import SpecStats

__all__ = ["replay", "draft_tokens", "evaluate_sets", "plot_acceptance", "check_against_loop"]


def _record(stats: SpecStats, n: int, a: int, emitted: int) -> None:
    """One replayed round, counted as the loop counts it: a round cut by a stop after ``emitted``
    tokens counts only its drafts at or before the stop."""
    stats.record_round(min(n, emitted), min(a, emitted), emitted)


def draft_tokens(target, drafter, anchor_tok: mx.array, anchors: mx.array, ctx_kv: list, slots: int,
                 invalid: mx.array | None = None, vocab: tuple | None = None) -> np.ndarray:
    """Greedy drafts of ``slots`` tokens after each of ``n`` anchors, as the product's proposer makes them.

    The drafter runs on a block of ``max(trained block size, slots + 1)`` positions (the anchor, then
    mask tokens) and its first ``slots`` slots are kept, exactly as
    :meth:`~mlx_dflash2.proposers.DFlashProposer` does for a round narrower than the trained block:
    a block drafter attends over its whole block, so a shorter block of masks is a different input
    (measured, Qwen2.5-Coder-1.5B drafter ``c1``: acceptance at slot 1 was 0.08 with a 4-position
    block and 0.29 with its trained 16).

    Args:
        target: the :class:`~mlx_dflash2.target.TargetAdapter` (embeddings, LM head).
        drafter: a :class:`~mlx_dflash2.drafter.DraftModel`.
        anchor_tok: int32 ``[n]`` anchor tokens.
        anchors: int32 ``[n, 1]`` anchor positions (each block sees context positions below its own).
        ctx_kv: the drafter's context K/V of the ``n`` sequences (:meth:`~.DraftModel.context_kv_all`).
        slots: drafted tokens per anchor (``B - 1`` for a verify width ``B``), ``>= 1``.
        invalid: bool ``[vocab rows]`` ids never proposed (a padded vocabulary), or ``None``.
        vocab: ``(ids int32 [Vd], head)``: a draft vocabulary, ascending ids, and the LM head restricted to
            them (:meth:`~mlx_dflash2.target.TargetAdapter.head_rows`), as the product's proposer runs it; or ``None``.

    Returns:
        int ``[n, slots]`` drafted tokens (numpy; one host read).
    """
    cfg = drafter.config
    width = max(cfg.block_size, slots + 1)
    n = anchor_tok.shape[0]
    block = mx.concatenate([anchor_tok[:, None], mx.full((n, width - 1), cfg.mask_token_id, dtype=mx.int32)], axis=1)
    emb = target.embed(block)
    if cfg.input_embedding_scale != 1.0:
        emb = emb * cfg.input_embedding_scale
    h = drafter.forward_blocks(emb, None, anchors, ctx_kv=ctx_kv)[:, 1 : slots + 1]
    ids, head = vocab if vocab is not None else (None, target.lm_head)
    unary = drafter.unary_logits(h, head)
    if invalid is not None and ids is None:
        unary = mx.where(invalid, mx.array(-mx.inf, unary.dtype), unary)
    if cfg.is_dflash2:
        out = drafter.candidate_selector.walk(unary, h, anchor_tok, vocab_ids=ids).tokens
    else:
        out = mx.argmax(unary, axis=-1)
        out = ids[out] if ids is not None else out
    return np.array(out)


def replay(
    target,
    drafter,
    rows: list[dict],
    block_size: int,
    max_tokens: int,
    valid_vocab: int,
    batch: int = 32,
    lookup: bool = False,
    progress: bool = False,
    taps_cache: dict | None = None,
    draft_vocab: list[int] | None = None,
) -> tuple[SpecStats, list[float]]:
    """Replay greedy speculative decoding of ``rows`` with ``drafter``.

    Args:
        target: the :class:`~mlx_dflash2.target.TargetAdapter`.
        drafter: a :class:`~mlx_dflash2.drafter.DraftModel`.
        rows: ``[{"prompt_ids", "response_ids"}]`` (greedy continuations, the
            EOS included when the response stopped on it).
        block_size: B.
        max_tokens: the generation limit the continuations were made with.
        valid_vocab: ids ``>=`` this are never proposed.
        lookup: fuse lookup proposals as :class:`~mlx_dflash2.proposers.FusedProposer` does.
        taps_cache: a dict kept across calls on the same ``rows`` and ``batch``
            (e.g. other drafters, other block sizes): the target's tap features
            of each group are computed once (the target forward dominates replay
            on a CPU).
        draft_vocab: the ids the drafter may propose (a draft vocabulary, as
            :class:`~mlx_dflash2.proposers.DFlashProposer` ``draft_vocab``), or ``None``: all valid ids.

    Returns:
        ``(stats, per_prompt_tau)``: aggregate :class:`SpecStats` and tau per row.
    """
    from tqdm import tqdm

    cfg = drafter.config
    B = block_size
    total = SpecStats(drafter=cfg.architecture + ("+lookup" if lookup else ""), block_size=B)
    per_prompt = []
    invalid = None
    valid_vocab = min(valid_vocab, target.vocab_size)
    if valid_vocab < target.vocab_rows:
        invalid = mx.arange(target.vocab_rows) >= valid_vocab
    vocab = None
    if draft_vocab is not None:
        from ..proposers import check_vocab_ids

        ids = mx.array(check_vocab_ids(draft_vocab, valid_vocab, target.vocab_rows), dtype=mx.int32)
        vocab = (ids, target.head_rows(ids))
    bar = tqdm(total=len(rows), desc=f"replay B={B}", disable=not progress, file=sys.stderr)
    for g in range(0, len(rows), batch):
        group = rows[g : g + batch]
        seqs = [list(r["prompt_ids"]) + list(r["response_ids"]) for r in group]
        T = max(len(s) for s in seqs)
        toks = np.zeros((len(seqs), T), dtype=np.int32)
        for i, s in enumerate(seqs):
            toks[i, : len(s)] = s
        key = (g, tuple(cfg.target_layer_ids))
        if taps_cache is not None and key in taps_cache:
            taps = taps_cache[key]
        else:
            taps = target.taps(mx.array(toks), tuple(cfg.target_layer_ids))
            mx.eval(taps)
            if taps_cache is not None:
                taps_cache[key] = taps
        ctx_kv = drafter.context_kv_all(taps)
        mx.eval(ctx_kv)
        P = np.array([len(r["prompt_ids"]) for r in group])  # anchor positions
        resp_len = np.array([len(r["response_ids"]) for r in group])
        emitted = np.ones(len(group), dtype=np.int64)  # the first token comes from the prefill
        stats = [SpecStats() for _ in group]
        indexes = None
        if lookup:
            indexes = []
            for s, p in zip(seqs, P):
                ix = SuffixIndex(2, 16)
                ix.extend(s[:p])
                indexes.append(ix)
        while True:
            active = [i for i in range(len(group)) if emitted[i] < min(resp_len[i], max_tokens)]
            if not active:
                break
            n_i = {i: int(min(B - 1, max_tokens - emitted[i] - 1)) for i in active}
            need = [i for i in active if n_i[i] > 0]
            props = {}
            if need:
                idx = mx.array(need)
                anchors = mx.array(P[need][:, None].astype(np.int32))
                anchor_tok = mx.array(toks[need, P[need]])
                kv = [(k[idx], v[idx]) for k, v in ctx_kv]
                out = draft_tokens(target, drafter, anchor_tok, anchors, kv, B - 1, invalid, vocab)
                for k, i in enumerate(need):
                    p = out[k, : n_i[i]].tolist()
                    if lookup:
                        m, lt = indexes[i].propose([int(toks[i, P[i]])], n_i[i])
                        if m >= 6 and lt:
                            fused = lt + p[len(lt) :]
                            if m >= 8 or fused[:2] == p[:2]:
                                p = fused
                    props[i] = p
            for i in active:
                p = props.get(i, [])
                truth = toks[i, P[i] + 1 : P[i] + 1 + len(p)].tolist()
                a = 0
                while a < len(p) and a < len(truth) and p[a] == truth[a]:
                    a += 1
                e = int(min(a + 1, resp_len[i] - emitted[i]))
                _record(stats[i], len(p), a, e)
                if lookup:
                    indexes[i].extend(toks[i, P[i] : P[i] + a + 1].tolist())
                P[i] += a + 1
                emitted[i] += e
        for s in stats:
            per_prompt.append(s.tau)
            _merge(total, s)
        bar.update(len(group))
    bar.close()
    return total, per_prompt


def _merge(total: SpecStats, s: SpecStats) -> None:
    total.rounds += s.rounds
    total.round_tokens += s.round_tokens
    total.drafted += s.drafted
    total.accepted += s.accepted
    for name in ("accept_hist", "position_proposed", "position_accepted"):
        a, b = getattr(total, name), getattr(s, name)
        if len(a) < len(b):
            a.extend([0] * (len(b) - len(a)))
        for i, v in enumerate(b):
            a[i] += v


def evaluate_sets(
    target,
    tokenizer,
    drafters: dict,
    sets: list[str],
    block_sizes: list[int],
    max_tokens: int = 256,
    limit: int | None = -1,
    cache_dir: str | Path = ".cache/eval",
    gen_batch: int = 128,
    lookup: bool = False,
    progress: bool = True,
) -> dict:
    """tau of each drafter on each held-out set at each block size.

    Args:
        drafters: ``{label: DraftModel}`` or ``{label: (DraftModel, draft vocabulary ids or None)}``.
        sets: names from :data:`~.data.EVAL_SETS`.
        cache_dir: where the target's greedy continuations are kept (made once
            per target: the folder name carries :func:`target_fingerprint`, so a
            cache made by other weights, another dtype or another backend is
            never replayed as this target's output).

    Returns:
        ``{"max_tokens", "results": [{set, drafter, block_size, tau, rounds,
        tokens, acceptance_by_position, per_prompt_tau}]}``.
    """
    from .data import load_eval_set
    from .regen import read_responses, regenerate

    results = []
    valid_vocab = min(len(tokenizer), target.vocab_size)
    fp = target_fingerprint(target)
    for name in sets:
        prompts = load_eval_set(name, limit)
        cdir = _continuation_cache(Path(cache_dir), f"{name}-{len(prompts)}-{fp}", max_tokens)
        if cdir is None:
            cdir = Path(cache_dir) / f"{name}-{len(prompts)}-{fp}-{max_tokens}"
            regenerate(target, tokenizer, prompts, cdir, max_tokens=max_tokens, batch_size=gen_batch,
                       shard_size=max(len(prompts), 1), progress=progress)
        rows = read_responses(cdir)
        taps_cache = {}
        for label, model in drafters.items():
            model, vocab = model if isinstance(model, tuple) else (model, None)
            for B in block_sizes:
                st, per = replay(target, model, rows, B, max_tokens, valid_vocab, lookup=lookup, progress=progress,
                                 taps_cache=taps_cache, draft_vocab=vocab)
                results.append(
                    {
                        "set": name,
                        "drafter": label,
                        "block_size": B,
                        "tau": st.tau,
                        "rounds": st.rounds,
                        "tokens": st.round_tokens,
                        "acceptance_by_position": [
                            a / p if p else None for a, p in zip(st.position_accepted, st.position_proposed)
                        ],
                        "per_prompt_tau_median": float(np.median(per)) if per else 0.0,
                    }
                )
                if progress:
                    print(f"{name:10s} {label:10s} B={B:<3d} tau={st.tau:.3f}", file=sys.stderr)
    return {"max_tokens": max_tokens, "results": results}


def target_fingerprint(target) -> str:
    """Short hash of the target's float32 logits on a fixed 9-token probe: equal
    for the same weights, dtype and backend, different otherwise (greedy
    continuations of one target are not those of another)."""
    import hashlib

    ids = mx.array([[(17 + 7919 * i) % target.vocab_rows for i in range(9)]], dtype=mx.int32)
    logits = np.array(target.model(ids)[0].astype(mx.float32))
    return hashlib.sha1(logits.tobytes()).hexdigest()[:10]


def _continuation_cache(cache_dir: Path, prefix: str, max_tokens: int) -> Path | None:
    """A complete cache ``{prefix}-{m}`` of greedy continuations made with ``m >= max_tokens``
    (a longer continuation's prefix is the shorter one: replay stops at ``max_tokens``)."""
    best = None
    for d in cache_dir.glob(f"{prefix}-*"):
        try:
            m = int(d.name.rsplit("-", 1)[1])
        except ValueError:
            continue
        if m >= max_tokens and (d / "shard-00000.jsonl").is_file() and (best is None or m < best[0]):
            best = (m, d)
    return best[1] if best else None


def plot_acceptance(report: dict, path: str | Path) -> Path | None:
    """Plot tau by set x block size (one colour per drafter, lighter = smaller
    block) and acceptance by block position (colour = drafter, line style =
    set, at each drafter's best block size).

    Returns the PNG path, or None when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    res = report["results"]
    order = [r["set"] for r in res]
    sets = sorted(set(order), key=order.index)
    dorder = [r["drafter"] for r in res]
    drafters = sorted(set(dorder), key=dorder.index)
    blocks = sorted({r["block_size"] for r in res})
    colors = {d: plt.get_cmap("tab10")(i % 10) for i, d in enumerate(drafters)}
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(1, len(drafters) * len(blocks))
    for j, (d, B) in enumerate([(d, B) for d in drafters for B in blocks]):
        vals = [next((r["tau"] for r in res if r["set"] == s and r["drafter"] == d and r["block_size"] == B), 0)
                for s in sets]
        shade = 0.35 + 0.65 * (blocks.index(B) + 1) / len(blocks)
        axes[0].bar(np.arange(len(sets)) + j * width, vals, width, color=colors[d], alpha=shade,
                    label=d if B == blocks[-1] else None)
    axes[0].set_xticks(np.arange(len(sets)) + width * (len(drafters) * len(blocks) - 1) / 2, sets)
    axes[0].set_ylabel("acceptance length tau (tokens / target forward)")
    axes[0].set_title(f"tau; bars per drafter: B = {', '.join(map(str, blocks))} (lighter = smaller)", fontsize=9)
    axes[0].axhline(1.0, color="k", lw=0.5)
    axes[0].set_ylim(0, max(r["tau"] for r in res) * 1.15)
    axes[0].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=min(4, len(drafters)))
    for d in drafters:
        best_B = max(blocks, key=lambda B: np.mean([r["tau"] for r in res if r["drafter"] == d and r["block_size"] == B]
                                                    or [0.0]))
        for k, s in enumerate(sets):
            r = next((r for r in res if r["set"] == s and r["drafter"] == d and r["block_size"] == best_B), None)
            if r is None:
                continue
            acc = [x if x is not None else np.nan for x in r["acceptance_by_position"]]
            axes[1].plot(np.arange(1, len(acc) + 1), acc, styles[k % len(styles)], marker="o", ms=2.5,
                         color=colors[d], label=f"{d}, {s} (B={best_B})")
    axes[1].set_xlabel("block position")
    axes[1].set_ylabel("acceptance rate")
    axes[1].set_title("acceptance by block position (colour = drafter, line = set)", fontsize=9)
    axes[1].set_ylim(0, 1)
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def check_against_loop(target, tokenizer, drafter, rows: list[dict], block_size: int, max_tokens: int) -> list[tuple]:
    """Run the real loop on ``rows`` and compare with replay: ``[(loop_tau, replay_tau, same_tokens)]``. The loop
    verifies chains here, as the replay does (tree drafts, the product's default for greedy requests, accept more:
    ``benchmarks/tree_sim.py`` replays them)."""
    from ..proposers import DFlashProposer
    from ..speculative import speculative_generate_step

    out = []
    prop = DFlashProposer(drafter, target, len(tokenizer), trees=False)
    eos = set(tokenizer.eos_token_ids)
    for r in rows:
        st = SpecStats()
        toks = []
        gen = speculative_generate_step(r["prompt_ids"], target, prop, block_size=block_size, max_tokens=max_tokens,
                                        stats=st)
        for t, _, _ in gen:
            toks.append(t)
            if t in eos:
                gen.close()
                break
        rp, _ = replay(target, drafter, [r], block_size, max_tokens, min(len(tokenizer), target.vocab_size))
        out.append((st.tau, rp.tau, toks == list(r["response_ids"])))
    return out


def write_report(report: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path
