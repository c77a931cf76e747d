"""The drafter's bounded context window (DraftContext ``window``, ``--drafter-window``)."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from conftest import chat_ids, plain_reference
from mlx_dflash2.drafter import DEFAULT_CONTEXT_SLACK, DEFAULT_CONTEXT_WINDOW, DraftContext, DrafterConfig, DraftModel
from mlx_dflash2.drafter import init_drafter
from mlx_dflash2.proposers import DFlashProposer, FusedProposer, LookupProposer
from mlx_dflash2.speculative import GenerationState, SpecStats, speculative_generate_step
from mlx_dflash2.target import cache_length
from test_drafter import randomize, tiny_cfg


def reference(m, feats, P, W, emb):
    """The drafter's output at anchor position ``P`` from an unbounded context holding only the rows of
    positions ``[max(0, P - W), P)`` (what a window of ``W`` must attend to)."""
    ref = DraftContext(m)
    a = max(0, P - W)
    ref.offset = a
    ref.append(m, feats[a:P])
    return m(emb, ref)


@pytest.mark.parametrize("over", [{}, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}])
def test_window_attends_last_rows_and_stays_bounded(over):
    """Random appends (prefill chunks, verified rounds) and rollbacks of up to ``slack`` rows: the windowed
    drafter equals an unbounded one restricted to the last W rows, and holds at most W + slack rows."""
    cfg = DrafterConfig.from_dict(tiny_cfg(**over))
    m = randomize(DraftModel(cfg), seed=4)
    W, slack = 16, 6
    feats = mx.random.normal((400, 128), key=mx.random.key(1))
    emb = mx.random.normal((1, 8, 64), key=mx.random.key(2))
    ctx = DraftContext(m, window=W, slack=slack)
    rng = random.Random(0)
    P = 0
    for step in range(60):
        n = rng.choice([1, 2, 3, 5, 8]) if step else 37  # a prefill chunk past W + slack first
        ctx.append(m, feats[P : P + n])
        P += n
        if rng.random() < 0.5:  # a rollback of at most slack rows
            k = rng.randint(1, min(slack, n))
            ctx.trim(k)
            P -= k
        assert ctx.offset == P
        assert ctx.rows() <= W + slack
        assert all(c.keys.shape[2] <= W + slack + 2 * c.step + 37 for c in ctx.caches)
        if step % 6 == 0:
            np.testing.assert_allclose(np.array(m(emb, ctx)), np.array(reference(m, feats, P, W, emb)),
                                       rtol=1e-5, atol=1e-5)
    # a sliding layer keeps its smaller window
    if over:
        assert ctx.caches[0].keep == cfg.sliding_window - 1 + slack and ctx.caches[1].keep == W + slack
    # clone: independent
    c2 = ctx.clone()
    c2.append(m, feats[P : P + 3])
    assert ctx.offset == P and c2.offset == P + 3
    np.testing.assert_allclose(np.array(m(emb, ctx)), np.array(reference(m, feats, P, W, emb)), rtol=1e-5, atol=1e-5)
    # a far trim (past the held rows) keeps working: no context until new rows arrive, then those
    ctx.trim(P - 5)
    assert ctx.offset == 5 and ctx.rows() == 0
    m(emb, ctx)
    ctx.append(m, feats[5:9])
    assert ctx.rows() == 4
    np.testing.assert_allclose(np.array(m(emb, ctx)), np.array(reference(m, feats, 9, 4, emb)), rtol=1e-5, atol=1e-5)


def test_unbounded_window_keeps_everything():
    m = randomize(DraftModel(DrafterConfig.from_dict(tiny_cfg())), seed=5)
    feats = mx.random.normal((100, 128), key=mx.random.key(3))
    emb = mx.random.normal((1, 8, 64), key=mx.random.key(4))
    ctx = DraftContext(m)  # window 0
    for a in range(0, 100, 7):
        ctx.append(m, feats[a : a + 7])
    assert ctx.rows() == 100
    ctx.trim(60)  # a far trim is exact without a window
    np.testing.assert_allclose(np.array(m(emb, ctx)), np.array(reference(m, feats, 40, 40, emb)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        DraftContext(m, window=-1)


# ----------------------------------------------------------------------------------------------
# the real target: lossless past a small window, memory bound, prompt cache
# ----------------------------------------------------------------------------------------------

W_SMALL = 32


def long_text(n_chars: int) -> str:
    path = Path(__file__).parents[1] / "mlx_dflash2" / "data" / "evalsets" / "gsm8k.jsonl"
    qs = [json.loads(line)["question"] for line in path.read_text().splitlines()[:40]]
    return "\n\n".join(qs)[:n_chars]


@pytest.fixture(scope="module")
def fresh(smol_f32):
    target, tok = smol_f32
    return init_drafter(target, tok, num_layers=2, block_size=16, seed=3)


def run(target, prompt, proposer, B, n, stats=None, state=None):
    return [t for t, _, _ in speculative_generate_step(prompt, target, proposer, block_size=B, max_tokens=n,
                                                       stats=stats, state=state)]


@pytest.mark.parametrize("lookup", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_long_prompt_past_small_window_equals_plain(smol_f32, fresh, lookup):
    target, tok = smol_f32
    ids = chat_ids(tok, long_text(950) + "\n\nSummarize the questions above.")  # 283 tokens (its prefill: 2 x 4 s)
    assert len(ids) > 8 * W_SMALL
    d = DFlashProposer(fresh, target, len(tok), context_window=W_SMALL)
    prop = FusedProposer(d, LookupProposer(block_size=16)) if lookup else d
    stats, state = SpecStats(), GenerationState()
    out = run(target, ids, prop, 16, 20, stats, state)  # 20 rounds past the window's W + slack rows (40: 37 s)
    assert out == plain_reference(target, ids, 20)[0]
    assert stats.drafted > 0
    ctx = getattr(state.session, "d", state.session).ctx
    assert ctx.offset == cache_length(state.cache) == len(ids) + len(out) - 1
    assert ctx.window == W_SMALL and ctx.rows() <= W_SMALL + DEFAULT_CONTEXT_SLACK


@pytest.mark.slow  # 25 s; warm == cold also in test_lossless and test_batch_hybrid (windowed) in the default run
def test_prompt_cache_warm_equals_cold_with_window(smol_f32, fresh):
    """Warm (prompt cache, a short and a far cut back) == cold == plain with a small drafter window."""
    target, tok = smol_f32
    prop = DFlashProposer(fresh, target, len(tok), context_window=W_SMALL)
    doc = long_text(900)
    msgs = [{"role": "user", "content": doc + "\n\nWhich question is the hardest?"}]
    p1 = tok.apply_chat_template(msgs, add_generation_prompt=True)
    state = GenerationState()
    o1 = run(target, p1, prop, 8, 12, state=state)
    msgs += [{"role": "assistant", "content": tok.decode(o1)}, {"role": "user", "content": "Why?"}]
    p2 = tok.apply_chat_template(msgs, add_generation_prompt=True)
    stats = SpecStats()
    warm = run(target, p2, prop, 8, 16, stats=stats, state=state)
    assert warm == run(target, p2, prop, 8, 16) == plain_reference(target, p2, 16)[0]
    assert stats.cached_tokens > len(p1)
    # far back: half of the document, another question (the drafter's held rows are all past the cut)
    p3 = tok.apply_chat_template([{"role": "user", "content": doc[:400] + "\n\nWhich question is the easiest?"}],
                                 add_generation_prompt=True)
    stats = SpecStats()
    warm = run(target, p3, prop, 8, 16, stats=stats, state=state)
    assert len(p2) + 16 - stats.cached_tokens > W_SMALL + DEFAULT_CONTEXT_SLACK
    assert warm == plain_reference(target, p3, 16)[0]
    assert state.session.ctx.offset == cache_length(state.cache)


# ----------------------------------------------------------------------------------------------
# plumbing
# ----------------------------------------------------------------------------------------------


def test_drafter_window_flag_and_load_argument():
    from mlx_dflash2.generate import setup_arg_parser as gen_parser
    from mlx_dflash2.loading import drafter_window_arg, load, make_proposer
    from mlx_dflash2.server.cli import setup_arg_parser as srv_parser

    for parser in (gen_parser(), srv_parser()):
        assert parser.parse_args([]).drafter_window is None  # load(): DEFAULT_CONTEXT_WINDOW == 4096
        assert parser.parse_args(["--drafter-window", "0"]).drafter_window == 0
        assert parser.parse_args(["--drafter-window", "2048"]).drafter_window == 2048
    with pytest.raises(argparse.ArgumentTypeError):
        drafter_window_arg("-1")
    with pytest.raises(ValueError, match="drafter_window"):
        load(None, "init", drafter_window=-1)  # checked before the weights load
    with pytest.raises(ValueError, match="drafter_window"):
        make_proposer("init", None, None, drafter_window=1.5)


def test_make_proposer_passes_window(smol_f32):
    from mlx_dflash2.loading import make_proposer

    target, tok = smol_f32
    p = make_proposer("init", target, tok, lookup=False, drafter_window=100)
    assert p.context_window == 100 and p.start([1, 2]).ctx.window == 100
    assert make_proposer("init", target, tok, lookup=False).context_window == DEFAULT_CONTEXT_WINDOW


def test_per_request_drafter_keeps_the_loaded_window(smol_f32, monkeypatch):
    """A request that names its own drafter (`stream_generate(..., drafter=...)`, the server's per-request
    drafter) gets the loaded model's drafter window, not the default."""
    import mlx_dflash2.api as api
    from mlx_dflash2.loading import SpeculativeModel, make_proposer

    target, tok = smol_f32
    model = SpeculativeModel(target, make_proposer("init", target, tok, drafter_window=48), 8, "t", target.config)
    made = []
    real = api.make_proposer

    def spy(*a, **kw):
        made.append(real(*a, **kw))
        return made[-1]

    monkeypatch.setattr(api, "make_proposer", spy)
    list(api.stream_generate(model, tok, [1, 2, 3], max_tokens=2, drafter="init"))
    got = getattr(made[0], "drafter", made[0])
    assert got.context_window == 48
