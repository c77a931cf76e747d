"""What verifying a tree of drafts (several candidates per slot) instead of one chain would gain: an exact replay.

Greedy speculative decoding emits the target's greedy continuation whatever is drafted, and a DFlash2 drafter's
lattice at an anchor (the selector's candidates and edge scores of every slot) depends only on the committed
tokens before it. So the drafter's lattice is computed once at every position of each continuation, and each
verification rule is replayed on top of it in numpy:

* ``chain L``: the selector's greedy walk, ``L`` drafts (the product today; ``rows = L + 1``);
* ``tree N``: the product's tree (:func:`mlx_dflash2.tree.build_tree` on the confidences
  ``DFlashProposer`` gives it): the ``N`` lattice nodes of highest path probability, verified as one tree
  (``rows = N + 1``: a tree attention mask, positions = depth);
* ``tree N + lookup``: the product's tree with the lookup's copy (:mod:`mlx_dflash2.lookup`, the longest
  repeated suffix of the history) fused as :class:`~mlx_dflash2.proposers.FusedProposer` does: a match of 8 or
  more tokens is verified alone (a chain), a shorter one grafted into the tree (:func:`~mlx_dflash2.tree.graft`,
  its first ``min(8, (N + 1) // 2)`` tokens); ``tree N + lookup (agree)``: session 42's rule instead of the graft (the
  lookup's chain where its match is 6-7 tokens and the tree's first two levels start with its first two tokens);
* ``paths K x L``: ``K`` chains of ``L`` drafts that share a prefix (the greedy walk, then each further chain
  leaves an earlier one at the untried sibling of highest path probability and walks greedily), verified as
  ``K`` batch rows of ``L + 1`` (``rows = K (L + 1)``: no tree mask, the shared prefix recomputed).

A round accepts the longest drafted path that equals the continuation; tau = tokens per target forward (bonus
included), as :func:`mlx_dflash2.train.evaluate.replay` counts it. Path probabilities are the selector's softmax
(the draft's own confidence, EAGLE-2's rule); they only choose which nodes to verify, never the output.

    scripts/run python benchmarks/tree_sim.py --model X.gguf --cache-dir .cache/eval --limit 6 --max-tokens 160
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx_dflash2  # noqa: F401  (before MLX: the optimized OpenBLAS)
import mlx.core as mx
import numpy as np

from mlx_dflash2.kernels.selector_walk import lattice_scores
from mlx_dflash2.lookup import SuffixIndex
from mlx_dflash2.proposers import GRAFT_TOKENS
from mlx_dflash2.tree import build_tree, graft


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def lattices(target, drafter, seq: list[int], start: int, end: int, vocab, chunk: int = 8):
    """The drafter's lattice at every anchor position ``start .. end-1`` of ``seq``.

    Returns ``(cand int [A, T, K], first float [A, K], edges float [A, T-1, K, K])`` (log-probabilities)."""
    cfg = drafter.config
    toks = mx.array([seq], dtype=mx.int32)
    taps = target.taps(toks, tuple(cfg.target_layer_ids))
    ctx_kv = drafter.context_kv_all(taps)
    mx.eval(ctx_kv)
    ids, head = vocab
    out_c, out_f, out_e = [], [], []
    T = cfg.block_size - 1
    for a0 in range(start, end, chunk):
        pos = list(range(a0, min(a0 + chunk, end)))
        n = len(pos)
        anchor_tok = mx.array([seq[p] for p in pos], dtype=mx.int32)
        block = mx.concatenate([anchor_tok[:, None], mx.full((n, T), cfg.mask_token_id, dtype=mx.int32)], axis=1)
        emb = target.embed(block)
        if cfg.input_embedding_scale != 1.0:
            emb = emb * cfg.input_embedding_scale
        anchors = mx.array([pos], dtype=mx.int32)  # one sequence, n anchors
        h = drafter.forward_blocks(emb, None, anchors, ctx_kv=ctx_kv)[:, 1:]
        unary = drafter.unary_logits(h, head)
        sel = drafter.candidate_selector
        cand, u, H = sel.candidates(unary, h, ids)
        first, edges = lattice_scores(cand, u, H, sel.predecessor_codebook, sel.successor_codebook, anchor_tok)
        # the product's node confidences (DFlashProposer._tree): the selector's softmax times the unary share
        mass = mx.logsumexp(u, axis=-1) - mx.logsumexp(unary.astype(mx.float32), axis=-1)  # [n, T]
        mx.eval(cand, first, edges, mass)
        mass = np.array(mass)
        out_c.append(np.array(cand))
        out_f.append(_log_softmax(np.array(first)) + mass[:, 0, None])
        out_e.append(_log_softmax(np.array(edges)) + mass[:, 1:, None, None])
    return np.concatenate(out_c), np.concatenate(out_f), np.concatenate(out_e)


def greedy_chain(first, edges, L):
    """Candidate indices of the greedy walk, ``L`` slots."""
    k = [int(first.argmax())]
    for t in range(1, L):
        k.append(int(edges[t - 1, k[-1]].argmax()))
    return k


def chain_accept(cand, first, edges, truth, L):
    k = greedy_chain(first, edges, L)
    a = 0
    while a < L and a < len(truth) and cand[a, k[a]] == truth[a]:
        a += 1
    return a, L + 1


def best_first_tree(first, edges, N, T):
    """The product's tree (:func:`mlx_dflash2.tree.build_tree`) as ``[(slot, cand index, parent)]``."""
    tree, nodes = build_tree(first, edges, N)
    return [(t, k, p) for (t, k), p in zip(nodes, tree.parents)]


def tree_accept(cand, nodes, truth):
    """Deepest tree path equal to ``truth`` (``nodes``: ``[(slot, cand index, parent)]``)."""
    return _token_accept([int(cand[t, k]) for t, k, _ in nodes], nodes, truth)


def lookup_rule(N, T, graft_it):
    """``tree N + lookup``: ``rule(cand, first, edges, truth, hist)`` (``hist``: the tokens up to the anchor)."""
    def rule(cand, first, edges, truth, hist):
        idx = SuffixIndex(2, 16)
        idx.extend(hist[:-1])
        m, lt = idx.propose(hist[-1:], N)
        if m >= 8:  # FusedProposer.long_match: the lookup alone
            chain = [(0, 0, i - 1) for i in range(len(lt))]
            return _token_accept(lt, chain, truth), len(lt) + 1
        tree, nodes = build_tree(first, edges, N)
        toks = [int(cand[t, k]) for t, k in nodes]
        if lt and graft_it:
            tree, toks = graft(tree, toks, lt[: min(GRAFT_TOKENS, (N + 1) // 2)], N)
        elif lt and m >= 6:  # session 42's rule: the lookup's chain if the tree's first two levels agree with it
            child = next((i for i, q in enumerate(tree.parents) if q == 0), None)
            if child is not None and lt[:2] == [toks[0], toks[child]]:
                return _token_accept(lt, [(0, 0, i - 1) for i in range(len(lt))], truth), len(lt) + 1
        return _token_accept(toks, [(0, 0, q) for q in tree.parents], truth), N + 1
    return rule


def _token_accept(tokens, nodes, truth):
    """Deepest path of ``nodes`` (``(_, _, parent)``) whose ``tokens`` equal ``truth``."""
    children = {}
    for i, (_, _, parent) in enumerate(nodes):
        children.setdefault(parent, []).append(i)
    a, cur = 0, -1
    while a < len(truth):
        nxt = [i for i in children.get(cur, []) if tokens[i] == truth[a]]
        if not nxt:
            break
        cur, a = nxt[0], a + 1
    return a


def paths(first, edges, K, L):
    """``K`` chains of ``L`` candidate indices: the greedy walk, then branches at the best untried sibling."""
    def walk_from(prefix):
        k = list(prefix)
        while len(k) < L:
            row = first if not k else edges[len(k) - 1, k[-1]]
            k.append(int(row.argmax()))
        return k

    def lp(prefix):
        s = float(first[prefix[0]])
        for t in range(1, len(prefix)):
            s += float(edges[t - 1, prefix[t - 1], prefix[t]])
        return s

    chains = [walk_from([])]
    tried = {tuple(chains[0][: t + 1]) for t in range(L)}
    while len(chains) < K:
        best = None
        for ch in chains:
            for t in range(L):
                row = first if t == 0 else edges[t - 1, ch[t - 1]]
                for c in np.argsort(-row)[:4]:
                    pre = tuple(ch[:t]) + (int(c),)
                    if pre in tried:
                        continue
                    s = lp(pre)
                    if best is None or s > best[0]:
                        best = (s, pre)
                    break
        if best is None:
            break
        ch = walk_from(best[1])
        tried.update(tuple(ch[: t + 1]) for t in range(L))
        chains.append(ch)
    return chains


def paths_accept(cand, chains, truth):
    best = 0
    for ch in chains:
        a = 0
        while a < len(ch) and a < len(truth) and cand[a, ch[a]] == truth[a]:
            a += 1
        best = max(best, a)
    return best


def replay_rule(lat, seq, P, resp_len, max_tokens, rule):
    """Rounds of one continuation under ``rule(cand, first, edges, truth) -> (accepted, rows)``."""
    cand, first, edges = lat
    emitted, p = 1, P
    rounds = tokens = rows = 0
    while emitted < min(resp_len, max_tokens):
        i = p - P
        truth = seq[p + 1 : p + 1 + cand.shape[1]]
        a, r = rule(cand[i], first[i], edges[i], truth, seq[: p + 1])
        a = min(a, max_tokens - emitted - 1)
        e = int(min(a + 1, resp_len - emitted))
        rounds, tokens, rows = rounds + 1, tokens + e, rows + r
        p += a + 1
        emitted += e
    return rounds, tokens, rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--drafter", default="shipped")
    ap.add_argument("--cache-dir", default=".cache/eval")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--sets", default="humaneval,mtbench,gsm8k")
    ap.add_argument("--out", default="benchmarks/results/tree-sim.json")
    args = ap.parse_args(argv)

    from mlx_dflash2.drafter import dequantize_drafter, load_drafter
    from mlx_dflash2.drafter.io import read_draft_vocab
    from mlx_dflash2.loading import load_target, resolve_shipped
    from mlx_dflash2.train.data import load_eval_set
    from mlx_dflash2.train.evaluate import _continuation_cache, target_fingerprint
    from mlx_dflash2.train.regen import read_responses

    target, tok, name = load_target(args.model, dtype=mx.float32, dequantize=True)
    path = resolve_shipped(args.drafter, name) if args.drafter == "shipped" else args.drafter
    drafter = dequantize_drafter(load_drafter(str(path), target, tok, dtype=mx.float32))
    ids = read_draft_vocab(str(path))
    vocab = (None, target.lm_head)
    if ids is not None:
        ids = mx.array(ids, dtype=mx.int32)
        vocab = (ids, target.head_rows(ids))
    T = drafter.config.block_size - 1
    rules = {f"chain {L}": (lambda L: lambda c, f, e, t, h: chain_accept(c, f, e, t, L))(L) for L in (3, 7, 15)}
    for N in (7, 15, 23, 31, 47, 63):
        rules[f"tree {N}"] = (lambda N: lambda c, f, e, t, h: (tree_accept(c, best_first_tree(f, e, N, T), t),
                                                                N + 1))(N)
    for N in (7, 15, 31):
        rules[f"tree {N} + lookup (agree)"] = lookup_rule(N, T, False)
        rules[f"tree {N} + lookup"] = lookup_rule(N, T, True)
    for K, L in ((2, 7), (2, 15), (3, 7), (4, 3), (4, 7), (4, 15), (8, 3)):
        rules[f"paths {K}x{L}"] = (lambda K, L: lambda c, f, e, t, h: (paths_accept(c, paths(f, e, K, L), t),
                                                                       K * (L + 1)))(K, L)
    fp = target_fingerprint(target)
    report = {"model": Path(args.model).name, "drafter": str(args.drafter), "max_tokens": args.max_tokens,
              "limit": args.limit, "sets": {}}
    for s in args.sets.split(","):
        prompts = load_eval_set(s, args.limit)
        cdir = _continuation_cache(Path(args.cache_dir), f"{s}-{len(prompts)}-{fp}", args.max_tokens)
        if cdir is None:
            sys.exit(f"no continuations for {s} in {args.cache_dir}: run `mlx_dflash2.train eval` first")
        rows = read_responses(cdir)
        agg = {r: [0, 0, 0] for r in rules}
        for row in rows:
            seq = list(row["prompt_ids"]) + list(row["response_ids"])
            P, n = len(row["prompt_ids"]), min(len(row["response_ids"]), args.max_tokens)
            lat = lattices(target, drafter, seq, P, P + n, vocab)
            for r, rule in rules.items():
                out = replay_rule(lat, seq, P, len(row["response_ids"]), args.max_tokens, rule)
                agg[r] = [x + y for x, y in zip(agg[r], out)]
            print(f"{s}: {len(seq)} tokens done", file=sys.stderr, flush=True)
        report["sets"][s] = {r: {"rounds": a[0], "tokens": a[1], "rows_per_round": a[2] / max(a[0], 1),
                                 "tau": a[1] / max(a[0], 1)} for r, a in agg.items()}
        for r, v in report["sets"][s].items():
            print(f"{s:10s} {r:26s} tau {v['tau']:.3f} rows {v['rows_per_round']:.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"report: {args.out}")


if __name__ == "__main__":
    main()
