"""Tree drafts: several candidates per slot, verified by one target forward (greedy requests).

A DFlash2 drafter scores a *lattice*: each slot's top-K candidates and, for every candidate of slot ``t``, the
selector's scores of slot ``t + 1``'s candidates given it (:meth:`~.drafter.model.CandidateSelector.lattice`). The
product's chain is the lattice's greedy walk. A tree verifies more of the lattice in the same number of target
rows: :func:`build_tree` takes the ``n`` nodes of highest path probability, best first (EAGLE-2's rule, Li et
al. 2024, arXiv 2406.16858; each node's children are scored by the selector row of its own token, as the DFlash2
spec §6.4 notes a tree over the lattice must), and the target runs the anchor and the nodes as one forward in
which each node attends to the context, the anchor and its own ancestors, at position ``offset + depth``
(:meth:`~.target.TargetAdapter.forward` with ``tree``). Greedy acceptance (spec §6.4, "greedy trees"): the
deepest node whose every ancestor's token, and its own, equals the target's argmax at its parent
(:func:`tree_accept`); the emitted tokens are the target argmaxes along that path, exactly the tokens plain
greedy decoding emits, so the output does not change; the cache and the drafter's context keep the path's rows
(:func:`compact_cache`).

Measured by exact replay (``benchmarks/tree_sim.py``; Qwen2.5-Coder-1.5B, the shipped drafter, 6 HumanEval
prompts, 160 tokens): tau 1.93 with the chain of 15 drafts, 2.38 with a tree of 15 nodes (the same 16 verify
rows), 2.48 with 23.

Only greedy requests without history-dependent processors verify trees (a sampled tree needs recursive
rejection sampling over siblings, spec §6.4; penalties would differ per branch), and only targets whose every
layer is full attention with mlx-lm's ``KVCache`` (:attr:`~.target.TargetAdapter.tree_capable`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

__all__ = ["DraftTree", "build_tree", "graft", "tree_accept", "compact_cache"]

#: children of a node considered by :func:`build_tree` (of the lattice's K per slot): a node's fifth-best child
#: is below its four better siblings, and with at most ~16 nodes per tree it is never among the best
TREE_FAN = 4


@dataclass(frozen=True)
class DraftTree:
    """The shape of a tree draft of ``n`` nodes, in an order where a parent precedes its children.

    Attributes:
        parents: node ``i``'s parent node (``-1``: the anchor), ``len n``.
        depths: node ``i``'s depth (``1``: a child of the anchor; the slot it fills).
        logp: the drafter's log path probability of each node (host floats; what chose it).
    """

    parents: tuple[int, ...]
    depths: tuple[int, ...]
    logp: tuple[float, ...] = ()

    @property
    def n(self) -> int:
        return len(self.parents)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def prefix(self, m: int) -> "DraftTree":
        """The first ``m`` nodes (a tree: parents come first)."""
        return DraftTree(self.parents[:m], self.depths[:m], self.logp[:m])

    def mask(self, offset: int) -> mx.array:
        """Attention mask of the verify forward over ``[anchor, node_0..node_{n-1}]`` after ``offset`` cached
        tokens: bool ``[n + 1, offset + n + 1]``, True where row ``i`` may attend (every cached token, the anchor,
        and the row's own ancestors and itself)."""
        n = self.n
        anc = np.zeros((n + 1, n + 1), dtype=bool)
        anc[:, 0] = True  # every row sees the anchor
        for i, p in enumerate(self.parents):
            anc[i + 1] = anc[p + 1]
            anc[i + 1, i + 1] = True
        full = np.ones((n + 1, offset), dtype=bool)
        return mx.array(np.concatenate([full, anc], axis=1))

    def ancestors(self) -> np.ndarray:
        """int32 ``[n, n]``: ``1`` where node ``j`` is node ``i``'s ancestor or itself."""
        n = self.n
        a = np.zeros((n, n), dtype=np.int32)
        for i, p in enumerate(self.parents):
            if p >= 0:
                a[i] = a[p]
            a[i, i] = 1
        return a


def build_tree(first: np.ndarray, edges: np.ndarray, n: int, fan: int = TREE_FAN) -> tuple[DraftTree, list[tuple]]:
    """The ``n`` lattice nodes of highest path probability, best first.

    Args:
        first: float ``[K]`` log-probabilities of slot 1's candidates given the anchor.
        edges: float ``[T-1, K, K]`` log-probabilities of slot ``t+2``'s candidates (columns) given each of slot
            ``t+1``'s (rows); ``T`` slots in all.
        n: nodes wanted (``>= 1``; fewer come back only if the lattice has fewer within ``fan``).
        fan: children considered per node (the best ``fan`` of its row).

    Returns:
        ``(tree, nodes)``: the :class:`DraftTree` (pop order: parents first, log path probabilities
        non-increasing) and each node's ``(slot index t (0-based), candidate index)``.
    """
    T = 1 + edges.shape[0]
    heap = [(-float(first[k]), 0, int(k), -1) for k in np.argsort(-first, kind="stable")[:fan]]
    heapq.heapify(heap)
    parents, depths, logp, nodes = [], [], [], []
    while heap and len(nodes) < n:
        nlp, t, k, parent = heapq.heappop(heap)
        parents.append(parent)
        depths.append(t + 1)
        logp.append(-nlp)
        nodes.append((t, k))
        me = len(nodes) - 1
        if t + 1 < T:
            row = edges[t, k]
            for c in np.argsort(-row, kind="stable")[:fan]:
                heapq.heappush(heap, (nlp - float(row[c]), t + 1, int(c), me))
    return DraftTree(tuple(parents), tuple(depths), tuple(logp)), nodes


def graft(tree: DraftTree, tokens: list[int], path: list[int], budget: int) -> tuple[DraftTree, list[int]]:
    """A tree draft with a chain of proposed tokens grafted in, at most ``budget`` nodes.

    ``path`` (e.g. the lookup's copy of what followed the history's longest repeated suffix,
    :mod:`~mlx_dflash2.lookup`) is walked from the anchor: where a node of the tree already carries the path's
    next token at that depth it is followed, else the rest of the path becomes new nodes under it. Then the tree's
    least probable leaves off the path are dropped until ``budget`` nodes are left (a dropped leaf can make its
    parent a leaf). Siblings keep distinct tokens; parents still precede their children; the path's new nodes get
    ``logp`` ``+inf`` (kept before any drafter node). Measured by exact replay (``benchmarks/tree_sim.py``): a
    16-row tree with the lookup's first 8 tokens grafted verifies 18 % more tokens per round on GSM8K than the
    tree alone or the tree replaced by the lookup chain when the two agree on their first two tokens.

    Args:
        tree: the drafter's tree (:func:`build_tree`; a chain is a tree too).
        tokens: the tree's node tokens (host ints, ``tree.n``).
        path: the tokens to graft (host ints), cut to ``budget``.
        budget: most nodes kept (``>= 1``).

    Returns:
        ``(tree, tokens)``: the new tree and its node tokens.

    Raises:
        ValueError: ``budget < 1``, or ``len(tokens) != tree.n``.
    """
    if budget < 1:
        raise ValueError(f"graft needs a budget of at least 1 node, got {budget}")
    if len(tokens) != tree.n:
        raise ValueError(f"graft got {len(tokens)} tokens for a tree of {tree.n} nodes")
    parents, depths, logp, toks = list(tree.parents), list(tree.depths), list(tree.logp or [0.0] * tree.n), \
        list(tokens)
    on_path, cur = set(), -1
    for d, tok in enumerate(path[:budget]):
        nxt = next((i for i, p in enumerate(parents) if p == cur and toks[i] == tok), None)
        if nxt is None:
            parents.append(cur)
            depths.append(d + 1)
            logp.append(float("inf"))
            toks.append(int(tok))
            nxt = len(toks) - 1
        on_path.add(nxt)
        cur = nxt
    drop: set[int] = set()
    while len(toks) - len(drop) > budget:
        inner = {parents[i] for i in range(len(toks)) if i not in drop}
        leaves = [i for i in range(len(toks)) if i not in drop and i not in inner and i not in on_path]
        if not leaves:
            break
        drop.add(min(leaves, key=lambda i: (logp[i], -i)))
    keep = [i for i in range(len(toks)) if i not in drop]
    where = {old: new for new, old in enumerate(keep)}
    new = DraftTree(tuple(where.get(parents[i], -1) for i in keep), tuple(depths[i] for i in keep),
                    tuple(logp[i] for i in keep))
    return new, [toks[i] for i in keep]


def tree_accept(argmax: mx.array, tokens: mx.array, tree: DraftTree) -> tuple[mx.array, mx.array]:
    """Greedy acceptance of a tree draft, as device arrays (no host synchronisation).

    Node ``i`` matches if its token equals the target's argmax at its parent's row; it is accepted if it and
    all its ancestors match. Siblings carry distinct tokens, so at most one node per depth is accepted and the
    accepted nodes form one path from the anchor; ``a`` is its length.

    Args:
        argmax: int32 ``[n + 1]`` the target's argmax of each verify row (row 0: the anchor's; row ``i + 1``:
            node ``i``'s).
        tokens: int ``[n]`` the nodes' tokens.
        tree: the :class:`DraftTree`.

    Returns:
        ``(a, rows)``: int32 scalar ``a`` in ``0..max depth`` and int32 ``[n + 1]`` the verify rows of the kept
        positions: ``rows[0] = 0`` (the anchor), ``rows[d]`` = the row of the accepted node at depth ``d`` for
        ``d <= a`` (the rest 0). The emitted tokens are ``argmax[rows[: a + 1]]``.
    """
    n = tree.n
    parent_rows = mx.array([p + 1 for p in tree.parents], dtype=mx.int32)
    miss = tokens.astype(mx.int32) != argmax[parent_rows]  # [n]
    anc = mx.array(tree.ancestors().astype(bool))
    ok = ~mx.any(anc & miss[None, :], axis=1)  # node and all its ancestors match
    depth = mx.array(tree.depths, dtype=mx.int32)
    a = mx.max(mx.where(ok, depth, 0))
    levels = mx.arange(1, n + 1, dtype=mx.int32)  # depth d (at most n), as a column per node below
    at = ok[None, :] & (depth[None, :] == levels[:, None])  # [n depths, n nodes]
    node_rows = mx.arange(1, n + 1, dtype=mx.int32)
    rows_d = mx.max(mx.where(at, node_rows[None, :], 0), axis=1)  # row of the accepted node at depth d, or 0
    rows = mx.concatenate([mx.zeros((1,), dtype=mx.int32), rows_d])
    return a.astype(mx.int32), rows


def compact_cache(cache: list, base: int, rows: mx.array, keep: int) -> None:
    """Move the kept verify rows of a tree round to the front of the round's cache positions.

    After a tree forward the cache holds the anchor and the ``n`` nodes at positions ``base .. base + n``; the
    positions ``base .. base + keep - 1`` become the rows ``rows[:keep]`` (relative to ``base``) of that block,
    so that the cache reads as if the accepted path alone had been fed; the caller then trims the rest
    (:func:`~.target.trim_cache`).

    Args:
        cache: the target's cache (mlx-lm ``KVCache`` entries).
        base: cache length before the round.
        rows: int32 verify rows (:func:`tree_accept`), device array.
        keep: how many to keep (``a + 1``).
    """
    idx = base + rows[:keep]
    for c in cache:
        c.keys[..., base : base + keep, :] = c.keys[..., idx, :]
        c.values[..., base : base + keep, :] = c.values[..., idx, :]
