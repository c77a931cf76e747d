"""Tree drafts (mlx_dflash2.tree): the builder, greedy acceptance, the target's tree forward and cache compaction,
and losslessness of tree rounds in the loop (scripted trees that reject at every depth, stops inside them)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conftest import PROMPTS, chat_ids, plain_reference
from mlx_dflash2.proposers import Proposal, Proposer, ProposerSession
from mlx_dflash2.speculative import GenerationState, SpecStats, speculative_generate_step
from mlx_dflash2.target import cache_length, trim_cache
from mlx_dflash2.tree import DraftTree, build_tree, compact_cache, graft, tree_accept


def _lattice(T=5, K=6, seed=0):
    rng = np.random.default_rng(seed)
    first = rng.normal(size=K) * 2
    edges = rng.normal(size=(T - 1, K, K)) * 2
    ls = lambda x: x - np.log(np.exp(x).sum(-1, keepdims=True))  # noqa: E731
    return ls(first), ls(edges)


def test_build_tree_best_first_parents_first():
    first, edges = _lattice()
    tree, nodes = build_tree(first, edges, 12)
    assert tree.n == 12 == len(nodes)
    assert nodes[0] == (0, int(np.argmax(first)))  # the greedy walk's first slot comes first
    for i, (p, d) in enumerate(zip(tree.parents, tree.depths)):
        assert p < i
        assert d == (1 if p < 0 else tree.depths[p] + 1)
        assert d == nodes[i][0] + 1
    assert all(a >= b - 1e-12 for a, b in zip(tree.logp, tree.logp[1:]))  # path probabilities non-increasing
    for i, (t, k) in enumerate(nodes):  # each node's log path probability from its own parent's row
        p = tree.parents[i]
        want = first[k] if p < 0 else tree.logp[p] + edges[t - 1, nodes[p][1], k]
        assert tree.logp[i] == pytest.approx(want)
    # siblings are distinct candidates
    seen = set()
    for (t, k), p in zip(nodes, tree.parents):
        assert (p, k) not in seen
        seen.add((p, k))


def test_build_tree_peaked_lattice_is_the_greedy_chain():
    K, T = 5, 6
    first = np.log(np.array([0.01, 0.96, 0.01, 0.01, 0.01]))
    edges = np.full((T - 1, K, K), np.log(0.01))
    edges[:, :, 2] = np.log(0.96)
    tree, nodes = build_tree(first, edges, T)
    assert tree.is_chain
    assert nodes == [(0, 1)] + [(t, 2) for t in range(1, T)]


def _paths(tree, toks):
    """Every root-to-node token path of a tree."""
    out = []
    for i in range(tree.n):
        path, j = [], i
        while j >= 0:
            path.append(toks[j])
            j = tree.parents[j]
        out.append(tuple(reversed(path)))
    return out


def _check_tree(tree, toks):
    assert len(toks) == tree.n
    seen = set()
    for i, (p, d) in enumerate(zip(tree.parents, tree.depths)):
        assert p < i and d == (1 if p < 0 else tree.depths[p] + 1)
        assert (p, toks[i]) not in seen  # siblings carry distinct tokens
        seen.add((p, toks[i]))


def test_graft_follows_the_tree_then_branches_and_keeps_the_budget():
    # anchor -> 10 (-0.1) -> 11 (-0.5) -> 12 (-0.9); 10 -> 21 (-1.2); anchor -> 30 (-2.0)
    tree = DraftTree((-1, 0, 1, 0, -1), (1, 2, 3, 2, 1), (-0.1, -0.5, -0.9, -1.2, -2.0))
    toks = [10, 11, 12, 21, 30]
    t2, k2 = graft(tree, toks, [10, 21, 7, 8], budget=5)
    _check_tree(t2, k2)
    assert t2.n == 5
    assert (10, 21, 7, 8) in _paths(t2, k2)  # followed 10 and 21, then two new nodes
    assert (30,) not in _paths(t2, k2) and (10, 11, 12) not in _paths(t2, k2)  # the two least probable leaves
    assert (10, 11) in _paths(t2, k2)  # 11 became a leaf when 12 went, but 30 was less probable
    # budget left as it is: nothing dropped; a path longer than the budget is cut to it
    t3, k3 = graft(tree, toks, [10, 11, 12], budget=5)
    assert (t3, k3) == (tree, toks)
    t4, k4 = graft(tree, toks, [5, 6, 7, 8, 9, 4], budget=3)
    _check_tree(t4, k4)
    assert _paths(t4, k4) == [(5,), (5, 6), (5, 6, 7)]
    for bad in ({"budget": 0}, {"tokens": toks[:-1]}):  # below the documented minimum; tokens not the tree's
        args = {"tree": tree, "tokens": toks, "path": [10], "budget": 5, **bad}
        with pytest.raises(ValueError):
            graft(**args)
    # a chain grafted with its own continuation stays a chain
    chain = DraftTree((-1, 0), (1, 2), (-0.1, -0.2))
    t5, k5 = graft(chain, [1, 2], [1, 2, 3], budget=3)
    assert t5.is_chain and k5 == [1, 2, 3]


def test_graft_keeps_random_trees_valid():
    rng = np.random.default_rng(1)
    for seed in range(20):
        first, edges = _lattice(T=6, K=5, seed=seed)
        tree, nodes = build_tree(first, edges, 11)
        toks = [int(100 * t + k) for t, k in nodes]
        path = [int(x) for x in rng.integers(0, 3, size=int(rng.integers(1, 8)))]
        path = [toks[0]] + [100 * (d + 1) + x for d, x in enumerate(path)]
        t2, k2 = graft(tree, toks, path, budget=11)
        _check_tree(t2, k2)
        assert t2.n == 11
        assert tuple(path[:11]) in _paths(t2, k2)


def test_mask_and_ancestors():
    tree = DraftTree((-1, -1, 0, 2, 1), (1, 1, 2, 3, 2))
    m = np.array(tree.mask(3))
    assert m.shape == (6, 9)
    assert m[:, :3].all()  # the cached tokens
    own = m[:, 3:]
    want = np.array([[1, 0, 0, 0, 0, 0],  # anchor
                     [1, 1, 0, 0, 0, 0],  # node 0
                     [1, 0, 1, 0, 0, 0],  # node 1
                     [1, 1, 0, 1, 0, 0],  # node 2 (child of 0)
                     [1, 1, 0, 1, 1, 0],  # node 3 (child of 2)
                     [1, 0, 1, 0, 0, 1]], dtype=bool)  # node 4 (child of 1)
    assert (own == want).all()


@pytest.mark.parametrize("argmax,a,rows", [
    ([7, 0, 0, 0, 0, 0], 0, [0]),  # no child of the anchor matches
    ([10, 11, 0, 0, 0, 0], 1, [0, 1]),  # node 0 only (its child wants 12)
    ([10, 12, 0, 13, 0, 0], 3, [0, 1, 3, 4]),  # the path 0 -> 2 -> 3
    ([20, 0, 0, 0, 0, 0], 1, [0, 2]),  # node 1
    ([20, 0, 21, 0, 0, 0], 2, [0, 2, 5]),  # node 1 -> 4
])
def test_tree_accept(argmax, a, rows):
    # nodes: 0 = 10 (anchor), 1 = 20 (anchor), 2 = 12 (0), 3 = 13 (2), 4 = 21 (1)
    tree = DraftTree((-1, -1, 0, 2, 1), (1, 1, 2, 3, 2))
    tokens = mx.array([10, 20, 12, 13, 21], dtype=mx.int32)
    got_a, got_rows = tree_accept(mx.array(argmax, dtype=mx.int32), tokens, tree)
    assert int(got_a.item()) == a
    assert got_rows.tolist()[: a + 1] == rows


def test_tree_forward_rows_equal_chains_and_compaction(smol_f32):
    """Each row of a tree forward equals the same tokens fed as a chain (float32), and after compacting an
    accepted path the cache continues exactly as if the path alone had been fed."""
    target, tok = smol_f32
    assert target.tree_capable
    ids = chat_ids(tok, PROMPTS["chat"])
    V = target.vocab_size
    tree = DraftTree((-1, -1, 0, 2, 1, 0, 3), (1, 1, 2, 3, 2, 2, 4))
    tokens = [ids[-1], 100, 200, 300, 400, 500, 600, 700]  # anchor, nodes
    cache = target.make_cache()
    target.forward(mx.array(ids[:-1], dtype=mx.int32), cache)
    base = cache_length(cache)
    res = target.forward(mx.array(tokens, dtype=mx.int32), cache, tap_ids=(3, 10), tree=tree)
    for i in range(tree.n + 1):
        path, j = [], i - 1
        while j >= 0:
            path.append(tokens[j + 1])
            j = tree.parents[j]
        chain = [tokens[0]] + path[::-1]
        cc = target.make_cache()
        target.forward(mx.array(ids[:-1], dtype=mx.int32), cc)
        ref = target.forward(mx.array(chain, dtype=mx.int32), cc, tap_ids=(3, 10))
        assert mx.abs(ref.logits[-1, :V] - res.logits[i, :V]).max().item() < 1e-4, i
        assert mx.abs(ref.features[-1] - res.features[i]).max().item() < 1e-4, i
    # accept the path 0 -> 2 -> 3 -> 6 (rows 1, 3, 4, 7) and continue
    rows = mx.array([0, 1, 3, 4, 7, 0, 0, 0], dtype=mx.int32)
    compact_cache(cache, base, rows, 5)
    trim_cache(cache, tree.n - 4)
    assert cache_length(cache) == base + 5
    nxt = target.forward(mx.array([900, 901], dtype=mx.int32), cache).logits
    cc = target.make_cache()
    target.forward(mx.array(ids[:-1] + [tokens[0], 100, 300, 400, 700], dtype=mx.int32), cc)
    ref = target.forward(mx.array([900, 901], dtype=mx.int32), cc).logits
    assert mx.abs(ref[:, :V] - nxt[:, :V]).max().item() < 1e-4


class TreeScripted(Proposer):
    """Proposes trees around the plain continuation ``reference``: at every depth a wrong sibling *before* the
    right node (its own wrong child under it), the right path with its first error at ``schedule[r % len]``
    (``k``: depths ``1..k`` right, depth ``k + 1`` wrong; ``k >= depth``: all right)."""

    name = "tree-scripted"

    def __init__(self, prompt_len, reference, schedule, block_size, vocab, tap_ids=()):
        self.prompt_len, self.reference, self.schedule = prompt_len, list(reference), list(schedule)
        self.block_size, self.vocab, self.tap_ids = block_size, vocab, tuple(tap_ids)
        self.sessions = []

    def start(self, prompt):
        s = _TreeSession(self)
        self.sessions.append(s)
        return s


class _TreeSession(ProposerSession):
    def __init__(self, p):
        self.p, self.committed, self.rounds, self.feature_rows, self.offsets = p, 0, 0, 0, []

    def extend(self, tokens, features):
        self.committed += len(tokens)
        if features is not None:
            assert features.shape[0] == len(tokens)
            self.feature_rows += features.shape[0]

    def truncate(self, n):
        self.committed = n

    def propose(self, anchor, n, temperature=0.0, key=None):
        p = self.p
        g = self.committed - p.prompt_len
        assert p.reference[g] == anchor
        k = p.schedule[self.rounds % len(p.schedule)]
        self.rounds += 1
        depth = max(1, n // 3)  # 3 nodes per depth (wrong sibling, its child, the path's node)
        right = (p.reference[g + 1 : g + 1 + depth] + [0] * depth)[:depth]
        parents, depths, toks, prev = [], [], [], -1
        for d in range(depth):
            bad = (right[d] + 1 + d) % p.vocab
            parents += [prev]
            depths += [d + 1]
            toks += [bad]
            if d + 1 < depth:  # the wrong sibling's child (never accepted)
                parents += [len(toks) - 1]
                depths += [d + 2]
                toks += [right[d + 1] if d + 1 < depth else 0]
            parents += [prev]
            depths += [d + 1]
            toks += [right[d] if d < k else (right[d] + 2) % p.vocab]
            prev = len(toks) - 1
        self.offsets.append(min(k, depth))
        return Proposal(mx.array(toks, dtype=mx.int32), tree=DraftTree(tuple(parents), tuple(depths)))


@pytest.mark.parametrize("B", [4, 16])
def test_scripted_trees_reject_at_every_depth_f32_identical(smol_f32, B):
    target, tok = smol_f32
    ids = chat_ids(tok, PROMPTS["code"])
    depth = max(1, (B - 1) // 3)
    schedule = list(range(depth + 1))
    n = sum(k + 1 for k in schedule) * 2 + 1
    ref = plain_reference(target, ids, n)[0]
    prop = TreeScripted(len(ids), ref, schedule, B, target.vocab_rows, tap_ids=(3, 10))
    stats = SpecStats()
    out = [t for t, _, _ in speculative_generate_step(ids, target, prop, block_size=B, max_tokens=n, stats=stats)]
    assert out == ref[:n]
    sess = prop.sessions[0]
    assert sorted(set(sess.offsets)) == list(range(depth + 1))
    assert sess.feature_rows == sess.committed
    assert stats.tau >= 1.5


@pytest.mark.parametrize("max_tokens", range(1, 12))
def test_scripted_trees_max_tokens_and_consumer_stop_at_every_offset(smol_f32, max_tokens):
    """max_tokens ends inside a tree round at every offset; a consumer that stops there leaves the prompt cache
    holding exactly the tokens it took (a warm run of the same request then equals a cold one)."""
    target, tok = smol_f32
    ids = chat_ids(tok, PROMPTS["math"])
    ref = plain_reference(target, ids, 24)[0]
    prop = TreeScripted(len(ids), ref, [4, 1, 4, 0], 16, target.vocab_rows)
    out = [t for t, _, _ in speculative_generate_step(ids, target, prop, block_size=16, max_tokens=max_tokens)]
    assert out == ref[:max_tokens]
    state = GenerationState()
    taken = []
    for t, _, _ in speculative_generate_step(ids, target, prop, block_size=16, max_tokens=24, state=state):
        taken.append(t)
        if len(taken) == max_tokens:
            break
    assert taken == ref[:max_tokens]
    assert state.tokens == (ids + ref)[: len(ids) + max_tokens - 1]  # the last emitted token is not yet fed
    assert cache_length(state.cache) == len(state.tokens)


def test_shipped_drafter_proposes_trees_and_stays_identical(smol_f32):
    """The shipped SmolLM2 drafter with trees (the default for greedy requests) against trees off: both equal
    plain decoding in float32; trees accept more per round."""
    from mlx_dflash2.loading import make_proposer

    target, tok = smol_f32
    ids = chat_ids(tok, PROMPTS["code"])
    ref = plain_reference(target, ids, 48)[0]
    taus = {}
    for trees in (False, True):
        prop = make_proposer("shipped", target, tok, "smollm2-135m-instruct", lookup=False, adaptive=False,
                             min_confidence=0.0)
        prop.trees = trees
        stats = SpecStats()
        out = [t for t, _, _ in speculative_generate_step(ids, target, prop, max_tokens=48, stats=stats)]
        assert out == ref[:48]
        taus[trees] = stats.tau
    assert taus[True] > taus[False], taus


def test_lookup_grafted_into_trees_stays_identical(smol_f32, monkeypatch):
    """The drafter with lookup (the product's default): a tree round takes a lookup match as a grafted branch;
    output equals plain decoding in float32, whatever the graft does (a graft that branches at every node's first
    token is exercised too)."""
    import mlx_dflash2.proposers as proposers
    from mlx_dflash2.loading import make_proposer
    from mlx_dflash2.tree import graft as real_graft

    target, tok = smol_f32
    ids = chat_ids(tok, "Repeat this list three times, one line each: apple, banana, cherry, dates, elderberry.")
    ref = plain_reference(target, ids, 64)[0]
    grafts = []

    def spy(tree, toks, path, budget):
        grafts.append(len(path))
        return real_graft(tree, toks, path, budget)

    def wrong(tree, toks, path, budget):  # a graft whose every branch but the first node's misses
        return real_graft(tree, toks, [path[0]] + [t + 1 for t in path[1:]], budget)

    for g in (spy, wrong):
        monkeypatch.setattr(proposers, "graft", g)
        prop = make_proposer("shipped", target, tok, "smollm2-135m-instruct", lookup=True, adaptive=False,
                             min_confidence=0.0)
        out = [t for t, _, _ in speculative_generate_step(ids, target, prop, max_tokens=64)]
        assert out == ref[:64], g.__name__
    assert grafts and max(grafts) >= 2


def test_trees_only_for_greedy_requests_without_processors(smol_f32):
    from mlx_dflash2.loading import make_proposer
    from mlx_dflash2.sampling import SamplingParams
    from mlx_dflash2.speculative import start_request
    from mlx_dflash2.verify import make_verifier

    target, tok = smol_f32
    prop = make_proposer("shipped", target, tok, "smollm2-135m-instruct", lookup=False, adaptive=False)
    ids = chat_ids(tok, PROMPTS["chat"])
    cases = {"greedy": (SamplingParams(), True), "sampled": (SamplingParams(temp=0.7), False),
             "penalty": (SamplingParams(repetition_penalty=1.2), False)}
    for name, (params, want) in cases.items():
        v = make_verifier(params, mx.random.key(0))
        assert start_request(ids, target, prop, verifier=v, trees=True).session.trees is want, name
    # a batch's rows (start_request's default) never
    assert start_request(ids, target, prop).session.trees is False


def test_tree_cut_by_confidence_and_padded_like_a_chain(smol_f32):
    """With a dynamic draft length a tree keeps its nodes of path confidence >= min_confidence (at least one);
    a calibration where 16 rows cost least grows it back to 15 nodes; the cut tree is a prefix of the grown one
    (best-first order), and a session without ``trees`` proposes the chain."""
    from mlx_dflash2.calibrate import VerifyCosts
    from mlx_dflash2.drafter import init_drafter
    from mlx_dflash2.proposers import DFlashProposer
    import math

    target, tok = smol_f32
    drafter = init_drafter(target, tok, num_layers=2, block_size=16, seed=3)
    ids = chat_ids(tok, PROMPTS["chat"])
    dp = DFlashProposer(drafter, target, len(tok), min_confidence=0.05)
    s = dp.start(ids)
    s.extend(ids, target.forward(mx.array(ids, mx.int32), target.make_cache(), dp.tap_ids).features)
    s.trees = True
    cut = s.propose(ids[-1], 15)
    dp.verify_costs = VerifyCosts({1: 1.0, 2: 2.0, 4: 4.0, 8: 6.0, 16: 0.5})
    grown = s.propose(ids[-1], 15)
    for p in (cut, grown):
        assert p.tree is None or p.tree.n == p.n
    cut_n, grown_tree = cut.n, grown.tree
    assert grown.n == 15 and grown_tree is not None and cut_n < 15
    assert grown.tokens[:cut_n].tolist() == cut.tokens.tolist()
    kept = [lp for lp in grown_tree.logp[:cut_n]]
    assert all(lp >= math.log(0.05) for lp in kept[1:]) and (cut_n == 15 or grown_tree.logp[cut_n] < math.log(0.05))
    s.trees = False
    assert s.propose(ids[-1], 15).tree is None


def test_no_trees_with_routed_kernels_nor_on_hybrids(padded_dir, tmp_path, smol_f32):
    """Routed kernels keep greedy output equal to plain decoding even at near-ties because the plain step and the
    verify compute every row alike; a tree forward would not (MLX's attention with a mask): chains only. Hybrid
    targets (recurrent state, windows) verify chains too."""
    from mlx_dflash2.loading import load_target
    from tiny_models import tiny_hybrid_dir

    target, _, _ = load_target(str(padded_dir), dtype=mx.float32)
    assert target.tree_capable
    assert target.route_kernels("kernel", force=True) > 0
    assert not target.tree_capable
    hybrid, _, _ = load_target(str(tiny_hybrid_dir(tmp_path / "h", "qwen3_5", smol_f32[1])), dtype=mx.float32)
    assert not hybrid.tree_capable


def test_a_tree_the_request_cannot_verify_is_an_error(smol_f32):
    """A custom proposer's tree draft in a sampled request would be verified as a chain (wrong tokens): refused."""
    from mlx_dflash2.sampling import SamplingParams
    from mlx_dflash2.verify import make_verifier

    target, tok = smol_f32
    ids = chat_ids(tok, PROMPTS["math"])
    ref = plain_reference(target, ids, 24)[0]
    prop = TreeScripted(len(ids), ref, [2], 16, target.vocab_rows)
    v = make_verifier(SamplingParams(temp=0.7), mx.random.key(1))
    with pytest.raises(ValueError, match="tree draft"):
        list(speculative_generate_step(ids, target, prop, verifier=v, block_size=16, max_tokens=8))


def test_load_trees_false_carries_over_to_a_per_request_drafter(monkeypatch):
    """``load(trees=False)`` holds for a request that names its own drafter (found by a breaker helper: the
    request's proposer was built with trees on)."""
    from mlx_dflash2 import load, stream_generate
    from mlx_dflash2.target import TargetAdapter

    calls = []
    orig = TargetAdapter._tree_forward
    monkeypatch.setattr(TargetAdapter, "_tree_forward", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))
    model, tok = load(dtype="float32", trees=False, calibrate=False)
    assert model.trees is False
    p = tok.apply_chat_template([{"role": "user", "content": PROMPTS["code"]}], add_generation_prompt=True,
                                tokenize=False)
    list(stream_generate(model, tok, p, max_tokens=24, drafter="shipped"))
    assert not calls, f"{len(calls)} tree forwards with load(trees=False)"


def test_a_batch_of_one_verifies_the_solo_loops_trees(smol_f32, monkeypatch):
    """Issue 22's "a batch of one is the single-request case": a greedy request alone in a
    :class:`~mlx_dflash2.batch.SpeculativeBatch` (the server's lone request) gets the solo loop's tree rounds,
    lookup grafts included: the same tokens (plain decoding's, float32), rounds and statistics. When a second
    request joins, both verify chains (a batch's rows are padded chains) and stay exact; alone again, trees
    again. ``SpeculativeBatch(trees=False)``: chains only, the same tokens."""
    from mlx_dflash2.batch import SpeculativeBatch
    from mlx_dflash2.loading import make_proposer
    from mlx_dflash2.target import TargetAdapter

    target, tok = smol_f32
    assert target.tree_capable  # its probe (a tree forward at first use) before the count
    trees = []
    orig = TargetAdapter._tree_forward
    monkeypatch.setattr(TargetAdapter, "_tree_forward", lambda self, *a, **k: trees.append(1) or orig(self, *a, **k))

    def proposer():
        return make_proposer("shipped", target, tok, "smollm2-135m-instruct", lookup=True, adaptive=False,
                             min_confidence=0.0)

    ids = chat_ids(tok, PROMPTS["code"])
    other = chat_ids(tok, PROMPTS["math"])
    n = 40
    ref = plain_reference(target, ids, n)[0]
    ref_other = plain_reference(target, other, 12)[0]
    solo = SpecStats()
    assert [t for t, _, _ in speculative_generate_step(ids, target, proposer(), max_tokens=n, stats=solo)] == ref[:n]
    solo_trees = len(trees)
    assert solo_trees > 0

    def drain(batch):
        out = {}
        while batch.active or batch.pending:
            for ev in batch.step():
                out[ev.uid] = out.get(ev.uid, []) + ev.tokens
        return out

    trees.clear()
    batch = SpeculativeBatch(target)
    uid = batch.add(ids, n, proposer=proposer())
    stats = batch.stats(uid)
    assert drain(batch)[uid] == ref[:n]
    assert len(trees) == solo_trees
    for f in ("rounds", "drafted", "accepted", "accept_hist", "verify_widths"):
        assert getattr(stats, f) == getattr(solo, f), f

    # a second request joins after a few rounds, leaves before the first: chains while both are rows
    trees.clear()
    batch = SpeculativeBatch(target)
    a = batch.add(ids, n, proposer=proposer())
    out = {a: []}
    for _ in range(3):
        for ev in batch.step():
            out[ev.uid] += ev.tokens
    before = len(trees)
    b = batch.add(other, 12, proposer=proposer())
    out[b] = []
    while batch.active or batch.pending:
        rows = len(batch.lengths())
        k = len(trees)
        for ev in batch.step():
            out[ev.uid] += ev.tokens
        if rows == 2:
            assert len(trees) == k, "a tree forward in a round of two rows"
    assert out[a] == ref[:n] and out[b] == ref_other[:12]
    assert before > 0 and len(trees) > before  # trees before the join and after the leave

    trees.clear()
    batch = SpeculativeBatch(target, trees=False)
    uid = batch.add(ids, n, proposer=proposer())
    assert drain(batch)[uid] == ref[:n] and not trees


def test_a_batch_of_one_verifies_a_custom_proposers_trees_as_the_solo_loop_does(smol_f32):
    """A proposer without a ``trees`` attribute that proposes tree drafts anyway (:class:`TreeScripted`): the solo
    loop verifies them (a greedy request on a tree-capable target), so a batch of one does too (same tokens);
    with ``trees=False`` or a sampled request the refusal names the request's case, not "a batch of several"."""
    from mlx_dflash2.batch import SpeculativeBatch
    from mlx_dflash2.sampling import SamplingParams
    from mlx_dflash2.verify import make_verifier

    target, tok = smol_f32
    ids = chat_ids(tok, PROMPTS["math"])
    ref = plain_reference(target, ids, 24)[0]
    prop = TreeScripted(len(ids), ref, [4, 1, 4, 0], 16, target.vocab_rows)
    assert not hasattr(prop, "trees")
    assert [t for t, _, _ in speculative_generate_step(ids, target, prop, block_size=16, max_tokens=20)] == ref[:20]

    def drain(batch):
        out = []
        while batch.active or batch.pending:
            for ev in batch.step():
                out += ev.tokens
        return out

    batch = SpeculativeBatch(target)
    batch.add(ids, 20, proposer=prop, block_size=16)
    assert drain(batch) == ref[:20]
    sampled = make_verifier(SamplingParams(temp=0.7), mx.random.key(1))
    for batch, kw in ((SpeculativeBatch(target, trees=False), {}), (SpeculativeBatch(target), {"verifier": sampled})):
        batch.add(ids, 20, proposer=prop, block_size=16, **kw)
        with pytest.raises(ValueError, match="tree draft, which this request cannot verify"):
            drain(batch)
