"""Hybrid GatedDeltaNet targets (Qwen3.5, Qwen3-Next) in batched rounds: the per-row recurrent cache
(mlx_dflash2/caches.py's RaggedRecurrentCache) on a tiny random float32 checkpoint (tests/tiny_models.py:
2 GatedDeltaNet layers + 1 attention layer). Each row's recurrent state and conv window equal a solo cache's
fed the same real tokens (1e-5) after masked (right-padded) forwards and per-row rollbacks of a padded
verify block, by replay and by selection of the kept step.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from tiny_models import tiny_hybrid_dir

from mlx_dflash2.batch import RaggedKVCache
from mlx_dflash2.caches import RaggedRecurrentCache, RecurrentCache
from mlx_dflash2.loading import load_target

KINDS = ("qwen3_5", "qwen3_next")
TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> a tiny checkpoint directory (written once)."""
    root = tmp_path_factory.mktemp("hybrid-batch")
    return {k: tiny_hybrid_dir(root / k, k) for k in KINDS}


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 131 + 17 * i * i + 7 * i) % 4000 + 100 for i in range(n)]


def _max_diff(ours, theirs) -> float:
    return max(mx.abs(a - b).max().item() for o, t in zip(ours, theirs) for a, b in zip(o, t))


def test_ragged_recurrent_cache_rows_match_solo_caches(checkpoints):
    """The cache alone: a right-padded masked forward (joins) leaves each row at its own last real token;
    a padded verify block then per-row trims (replay, and selection of kept steps) leave each row at its
    own kept prefix, equal to a solo RecurrentCache fed the same real tokens; rows join (fresh or from a
    solo state) and leave; extract gives a solo cache that goes on exactly."""
    target, _, _ = load_target(str(checkpoints["qwen3_5"]), dtype=mx.float32)  # its own: routed below
    rec = [i for i, k in enumerate(target.layer_kinds) if k == "recurrent"]
    prompts = [_prompt(5, 1), _prompt(2, 2), _prompt(7, 3)]
    solo = []
    for p in prompts:
        c = target.make_cache()
        target.forward(mx.array(p, mx.int32), c)
        solo.append(c)
    caches = [RaggedRecurrentCache() if isinstance(c, RecurrentCache) else RaggedKVCache() for c in target.make_cache()]
    assert [type(c) is RaggedRecurrentCache for c in caches] == [i in rec for i in range(len(caches))]
    for c in caches:
        c.add_rows([(None, None, 0)] * 3 if isinstance(c, RaggedRecurrentCache) else [(None, None)] * 3)
        if isinstance(c, RaggedRecurrentCache):
            c.prepare([len(p) for p in prompts])
    block = mx.array([p + [0] * (7 - len(p)) for p in prompts], mx.int32)
    target._call(lambda: target.inner(block, cache=caches), ())
    for c in caches:
        if not isinstance(c, RaggedRecurrentCache):
            c.trim_rows([7 - len(p) for p in prompts])

    def same(i):
        for li in rec:
            ours, theirs = caches[li].extract(i), solo[i][li]
            assert ours.offset == theirs.offset
            assert _max_diff([ours.cache], [theirs.cache]) <= TOL, (i, li)

    assert caches[rec[0]].positions == [5, 2, 7] and caches[rec[0]].lengths is None
    for i in range(3):
        same(i)

    def verify(blocks, keep, steps):
        """A padded verify block; row i keeps keep[i] of its tokens; solo caches get the same."""
        M = max(len(b) for b in blocks)
        x = mx.array([b + [0] * (M - len(b)) for b in blocks], mx.int32)
        target._call(lambda: target.inner(x, cache=caches), ())
        for li in rec:
            assert (caches[li]._last.steps is not None) == steps
            caches[li].trim_rows([M - k for k in keep])
        for c in caches:
            if not isinstance(c, RaggedRecurrentCache):
                c.trim_rows([M - k for k in keep])
        for s, b, k in zip(solo, blocks, keep):
            target.forward(mx.array(b[:k], mx.int32), s)

    verify([[11, 12, 13], [14, 15], [16, 17, 18, 19]], [1, 2, 4], steps=False)
    for i in range(3):
        same(i)
    assert caches[rec[0]].replays == 1
    with pytest.raises(ValueError, match="no recorded forward"):
        caches[rec[0]].trim_rows([1, 0, 0])
    # rows leave and join: a fresh row and a solo state's row
    extra = target.make_cache()
    target.forward(mx.array(_prompt(3, 4), mx.int32), extra)
    for li, c in enumerate(caches):
        c.keep_rows([2, 0])
        if isinstance(c, RaggedRecurrentCache):
            c.add_rows([(extra[li].cache[0], extra[li].cache[1], 3)])
        else:
            c.add_rows([(extra[li].keys[..., :3, :], extra[li].values[..., :3, :])])
    solo = [solo[2], solo[0], extra]
    for i in range(3):
        same(i)
    # the stepping route (forced on the CPU: gated_delta_steps' reference) keeps every step: a selection
    assert target.route_kernels("kernel", force=True) > 0
    before = caches[rec[0]].replays
    verify([[21, 22], [23, 24, 25, 26], [27]], [2, 1, 1], steps=True)
    assert caches[rec[0]].replays == before
    for i in range(3):
        same(i)
    ex = caches[rec[0]].extract(1)
    assert isinstance(ex, RecurrentCache) and ex.offset == solo[1][rec[0]].offset
    with pytest.raises(ValueError, match="does not match"):
        caches[rec[0]].add_rows([(mx.zeros((1, 2, 3)), mx.zeros((1, 1, 1, 1)), 1)])
