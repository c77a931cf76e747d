"""Hybrid GatedDeltaNet targets (Qwen3-Next, Qwen3.5+) and sliding-window targets (Gemma 3/4): loaded from
checkpoints laid out as the real ones ship, speculative decoding exact on them (float32, tiny random
configs of each family: 2 GDN + 1 attention layer; 3 window-8 + 1 global layer; ...).

Exactness: speculative == plain greedy with scripted drafters whose first rejection visits every block
offset 0..B-1 (full acceptance included); after every round the recurrent and conv states equal plain
decoding's at the same position (1e-5); a stop at every offset of a block leaves exactly the consumed
state; sampled output keeps the target's law; the prompt cache's warm output equals cold at shared
lengths that are and are not snapshot-aligned.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest

import mlx_dflash2
import mlx_dflash2.speculative as spec
from mlx_dflash2.caches import RecurrentCache, WindowKVCache
from mlx_dflash2.loading import SpeculativeModel, load_target, make_proposer
from mlx_dflash2.speculative import GenerationState, SpecStats, speculative_generate_step
from scripted import ScriptedProposer
from tiny_models import HYBRID_KINDS, tiny_hybrid_dir

RECURRENT_KINDS = ("qwen3_next", "qwen3_5")
PROMPT = [(37 * i + 11) % 4000 + 100 for i in range(21)]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """kind -> (target adapter, tokenizer, checkpoint dir), loaded on first use."""
    root = tmp_path_factory.mktemp("hybrid")
    have = {}

    def get(kind):
        if kind not in have:
            path = tiny_hybrid_dir(root / kind, kind)
            target, tok, _ = load_target(str(path), dtype=mx.float32)
            have[kind] = (target, tok, path)
        return have[kind]

    return get


def plain_states(target, tokens: list[int]):
    """mlx-lm's own model and caches fed one token at a time: ``(greedy continuation of tokens[:P0]...``
    not used) -> per position P (tokens fed), the recurrent entries' [conv, state] arrays."""
    from mlx_lm.models.cache import make_prompt_cache

    c = make_prompt_cache(target.lm)
    out = {}
    for i, t in enumerate(tokens):
        target.lm(mx.array([[t]]), cache=c)
        mx.eval([x.state for x in c])
        out[i + 1] = [list(x.cache) for x in c if not hasattr(x, "keys")]
    return out


def mlx_lm_greedy(target, prompt, n):
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=n)]


def run(target, prompt, proposer, B, n, **kw):
    return [t for t, _, _ in speculative_generate_step(prompt, target, proposer, block_size=B, max_tokens=n, **kw)]


@pytest.mark.parametrize("kind", HYBRID_KINDS)
def test_loads_as_shipped_and_plain_equals_mlx_lm(targets, kind):
    target, _, _ = targets(kind)
    kinds = set(target.layer_kinds)
    assert kinds == ({"recurrent", "attention"} if kind in RECURRENT_KINDS else {"window", "attention"})
    ref = mlx_lm_greedy(target, PROMPT, 24)  # 45 positions: the window of 8 wraps several times
    assert run(target, PROMPT, None, 1, 24) == ref


class _Watch:
    """The recurrent (and conv) states of a batch of one after every round: patches ``SpeculativeBatch.step``
    (the loop of ``speculative_generate_step``) to record ``(position, [[conv, state] per recurrent layer])``
    after each round that committed tokens past the prompt, and every replay its caches made."""

    def __init__(self, monkeypatch):
        from mlx_dflash2.batch import SpeculativeBatch
        from mlx_dflash2.caches import RaggedRecurrentCache

        self.seen, self.replays = [], 0
        orig = SpeculativeBatch.step

        def step(batch):
            events = orig(batch)
            rec = [c for c in batch.cache if isinstance(c, RaggedRecurrentCache)]
            self.replays = max(self.replays, sum(c.replays for c in rec))
            if batch._rows and batch.lengths()[0] > len(PROMPT) and batch._ahead is None:
                states = [list(c.extract(0).cache) for c in rec]
                mx.eval(states)
                self.seen.append((batch.lengths()[0], states))
            return events

        monkeypatch.setattr(SpeculativeBatch, "step", step)


@pytest.mark.parametrize("kind", HYBRID_KINDS)
@pytest.mark.parametrize("B", [4, 8])
def test_scripted_rejection_at_every_offset(targets, kind, B, monkeypatch):
    """First rejection at every offset 0..B-2 and full acceptance; output == plain, and after every
    round the recurrent (and conv) states equal plain decoding's at the same position."""
    target, _, _ = targets(kind)
    n = B * (B + 1) // 2 + 1
    ref = mlx_lm_greedy(target, PROMPT, n)
    state = GenerationState()
    prop = ScriptedProposer(len(PROMPT), ref, list(range(B)), B, target.vocab_rows, tap_ids=(0, 2))
    watch = _Watch(monkeypatch)
    stats = SpecStats()
    assert run(target, PROMPT, prop, B, n, stats=stats, state=state) == ref
    assert stats.accept_hist == [1] * B  # every offset visited once
    if kind in RECURRENT_KINDS:
        plain = plain_states(target, PROMPT + ref)
        assert len(watch.seen) >= B - 1
        for pos, rec in watch.seen:
            for ours, theirs in zip(rec, plain[pos]):
                for a, b in zip(ours, theirs):
                    assert mx.abs(a - b).max().item() <= 1e-5, (pos, kind)


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma3_text"])
def test_stop_at_every_offset_leaves_exactly_the_consumed_state(targets, kind):
    """max_tokens and a consumer stop (EOS / stop string: the generator is closed) at every offset of a
    block: the cache holds exactly the emitted tokens but the last, and equals plain decoding's state."""
    target, _, _ = targets(kind)
    B = 6
    ref = mlx_lm_greedy(target, PROMPT, 3 * B + 2)
    plain = plain_states(target, PROMPT + ref) if kind in RECURRENT_KINDS else None
    for stop in range(1, 2 * B + 2):
        for how in ("max_tokens", "close", "plain-close"):
            state = GenerationState()
            prop = ScriptedProposer(len(PROMPT), ref, [B - 1, 2], B, target.vocab_rows)
            if how == "max_tokens":
                out = run(target, PROMPT, prop, B, stop, state=state)
            else:  # the consumer stops (EOS, stop string); plain decoding has its next step queued
                prop, b = (None, 1) if how == "plain-close" else (prop, B)
                gen = speculative_generate_step(PROMPT, target, prop, block_size=b, max_tokens=-1, state=state)
                out = [next(gen)[0] for _ in range(stop)]
                gen.close()
            assert out == ref[:stop]
            n = spec.cache_length(state.cache)
            assert n == len(PROMPT) + stop - 1 == len(state.tokens), (stop, how)
            assert all(c.offset == n for c in state.cache)
            if plain is not None:
                rec = [list(c.cache) for c in state.cache if isinstance(c, RecurrentCache)]
                for ours, theirs in zip(rec, plain[n]):
                    for a, b in zip(ours, theirs):
                        assert mx.abs(a - b).max().item() <= 1e-5, (stop, how)
            # and the state goes on exactly: the next token from it is plain's
            nxt = target.forward(mx.array([ref[stop - 1]]), state.cache).logits
            assert int(mx.argmax(nxt[-1]).item()) == ref[stop]


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next", "gemma3", "gemma4_text"])
def test_fresh_drafter_and_lookup_identical(targets, kind):
    """A fresh (random) DFlash2 drafter fused with lookup, the default proposer: output == plain."""
    target, tok, _ = targets(kind)
    prop = make_proposer("init", target, tok, "t", adaptive=False)
    ref = mlx_lm_greedy(target, PROMPT, 40)
    assert run(target, PROMPT, prop, 8, 40) == ref
    assert run(target, PROMPT, make_proposer("lookup", target, tok, "t"), 8, 40) == ref


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma3_text"])
def test_prompt_cache_warm_equals_cold(targets, kind, monkeypatch):
    """Shared prefixes at, and between, snapshot positions (every 16 tokens here): warm == cold; a hybrid
    target reuses the longest snapshot at or before the shared prefix, a window target what every layer
    still holds (else it prefills cold)."""
    monkeypatch.setattr(spec, "SNAPSHOT_INTERVAL", 16)
    target, tok, _ = targets(kind)
    prop = make_proposer("init", target, tok, "t", adaptive=False)
    first = [(53 * i + 7) % 4000 + 100 for i in range(70)]
    for shared in (32, 40, 69, 5):
        state = GenerationState()
        run(target, first, prop, 8, 12, state=state)
        second = first[:shared] + [(shared * 13 + j) % 4000 + 100 for j in range(9)]
        stats = SpecStats()
        warm = run(target, second, prop, 8, 16, state=state, stats=stats)
        cold = run(target, second, prop, 8, 16)
        assert warm == cold, (kind, shared)
        if kind in RECURRENT_KINDS:
            assert stats.cached_tokens == shared // 16 * 16, (shared, stats.cached_tokens)
        else:  # 80+ positions back to `shared`: beyond the window caches' 64-row rollback unless shared is near
            assert stats.cached_tokens in (0, shared)
    # a continuation of the whole previous request reuses all of it (no snapshot needed)
    state = GenerationState()
    out = run(target, first, prop, 8, 12, state=state)
    stats = SpecStats()
    nxt = first + out + [200, 201, 202]
    assert run(target, nxt, prop, 8, 8, state=state, stats=stats) == run(target, nxt, prop, 8, 8)
    assert stats.cached_tokens == len(first) + len(out) - 1


def test_sampled_first_two_tokens_keep_the_target_law(targets):
    """End to end on a hybrid target: the joint law of the first two sampled tokens (the second from a
    speculative round with a one-token draft of a random drafter) is the target's."""
    from test_sampling import assert_distribution

    from mlx_dflash2.sampling import SamplingParams, target_probs

    target, tok, _ = targets("qwen3_5")
    model = SpeculativeModel(target, make_proposer("init", target, tok, "t", adaptive=False), 8, "t", target.config)
    params = SamplingParams(temp=1.0, top_k=3)

    def probs(prefix):
        logits = target.lm(mx.array(prefix)[None])[0, -1:]
        return np.array(target_probs(logits - mx.logsumexp(logits, axis=-1, keepdims=True), params))[0]

    p1 = probs(PROMPT)
    joint = {(a, b): p1[a] * q for a in np.flatnonzero(p1 > 0) for b, q in enumerate(probs(PROMPT + [int(a)])) if q > 0}
    cells = sorted(joint)
    counts = np.zeros(len(cells))
    state = GenerationState()
    N = 240
    for s in range(N):
        rs = list(mlx_dflash2.stream_generate(model, tok, PROMPT, max_tokens=3, temp=1.0, top_k=3, seed=500 + s,
                                              state=state))
        counts[cells.index((rs[0].token, rs[1].token))] += 1
        assert rs[-1].stats.drafted == 1
    assert_distribution(counts, np.array([joint[c] for c in cells]), "first two tokens (hybrid)")


def test_window_caches_bounded_on_long_generation(targets):
    """A sliding-window layer's cache keeps at most window - 1 + rollback rows (+ one update) however long
    the request: memory grows only with the global layers."""
    target, _, _ = targets("gemma3_text")
    state = GenerationState()
    ref = mlx_lm_greedy(target, PROMPT, 150)
    prop = ScriptedProposer(len(PROMPT), ref, [2, 5, 7], 8, target.vocab_rows)
    assert run(target, PROMPT, prop, 8, 150, state=state) == ref
    for c in state.cache:
        if isinstance(c, WindowKVCache):
            assert c.offset - c.start <= c.max_size - 1 + c.slack + 8


# the CLI on a hybrid checkpoint by default; on a window one (gemma3, decoded in-process above) in `make test-all`
@pytest.mark.parametrize("kind", ["qwen3_5", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_cli_runs_hybrid_checkpoints(targets, kind):
    import subprocess

    _, _, path = targets(kind)
    for drafter in ("init", "lookup"):
        r = subprocess.run([sys.executable, "-m", "mlx_dflash2.generate", "--model", str(path), "--drafter", drafter,
                            "--prompt", "hello there", "--max-tokens", "12", "--dtype", "float32", "--verbose"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "acceptance length tau" in r.stdout and "Traceback" not in r.stderr


@pytest.mark.parametrize("kind", RECURRENT_KINDS)
def test_stepping_mixers_select_instead_of_replaying(tmp_path, kind, monkeypatch):
    """The GPU route of hybrid targets, forced on the CPU (gated_delta_steps' reference): the verify block
    keeps every step's state, a rejected tail is rolled back by selecting the accepted step's state and
    conv window (no replay), and output and states equal plain decoding's."""
    path = tiny_hybrid_dir(tmp_path / kind, kind)
    target, _, _ = load_target(str(path), dtype=mx.float32)
    assert target.route_kernels("kernel", force=True) > 0 and target.kernels == "kernel"
    B = 6
    n = B * (B + 1) // 2 + 1
    ref = mlx_lm_greedy(target, PROMPT, n)
    state = GenerationState()
    prop = ScriptedProposer(len(PROMPT), ref, list(range(B)), B, target.vocab_rows, tap_ids=(0, 2))
    watch = _Watch(monkeypatch)
    assert run(target, PROMPT, prop, B, n, state=state) == ref
    plain = plain_states(target, PROMPT + ref)
    assert len(watch.seen) >= B - 1
    for pos, rec in watch.seen:
        for ours, theirs in zip(rec, plain[pos]):
            for a, b in zip(ours, theirs):
                assert mx.abs(a - b).max().item() <= 1e-5, (pos, kind)
    assert watch.replays == 0


def test_stepping_mixers_run_prompt_chunks_through_gated_delta_final(tmp_path, monkeypatch):
    """A prompt chunk longer than the cache's max_record (no per-step states to keep) goes through
    gated_delta_final (forced routing on the CPU: its reference, mlx-lm's own recurrence), one call per
    GatedDeltaNet layer and chunk; greedy output equals mlx-lm's, and a verify block still keeps every step."""
    from mlx_dflash2.kernels import gated_delta_final, gated_delta_steps

    path = tiny_hybrid_dir(tmp_path / "qwen3_5", "qwen3_5")
    target, _, _ = load_target(str(path), dtype=mx.float32)
    assert target.route_kernels("kernel", force=True) > 0
    calls = {"final": [], "steps": []}
    for name, op in (("final", gated_delta_final), ("steps", gated_delta_steps)):
        orig = op.reference
        monkeypatch.setattr(op, "reference", lambda *a, _o=orig, _n=name: (calls[_n].append(a[0].shape[1]), _o(*a))[1])
    prompt = [(53 * i + 7) % 4000 + 100 for i in range(150)]  # > DEFAULT_MAX_RECORD (64) rows in one chunk
    ref = mlx_lm_greedy(target, prompt, 9)
    calls["final"].clear(), calls["steps"].clear()
    prop = ScriptedProposer(len(prompt), ref, [1, 3], 4, target.vocab_rows)
    assert run(target, prompt, prop, 4, 9) == ref
    assert calls["final"] and all(t > 64 for t in calls["final"])
    assert calls["steps"] and all(t <= 4 for t in calls["steps"])


@pytest.mark.parametrize("kind", HYBRID_KINDS)
def test_plain_rounds_run_ahead_and_drop_exactly(targets, kind, monkeypatch):
    """Plain rounds (no drafts) queue the next step ahead of the read, and a drafting round drops it (a 1-row
    trim of the recurrent / window caches): output == plain, and the final state equals plain decoding's."""
    monkeypatch.setattr(spec, "RUN_AHEAD", "always")
    target, _, _ = targets(kind)
    B, n = 4, 21
    ref = mlx_lm_greedy(target, PROMPT, n)
    state = GenerationState()
    prop = ScriptedProposer(len(PROMPT), ref, [None, None, 2, None, B - 1, None, 0, None], B, target.vocab_rows,
                            tap_ids=(0, 2))
    assert run(target, PROMPT, prop, B, n, state=state) == ref
    P = len(PROMPT) + n - 1
    assert spec.cache_length(state.cache) == P
    if kind in RECURRENT_KINDS:
        plain = plain_states(target, PROMPT + ref)[P]
        ours = [list(c.cache) for c in state.cache if isinstance(c, RecurrentCache)]
        for o, t in zip(ours, plain):
            for a, b in zip(o, t):
                assert mx.abs(a - b).max().item() <= 1e-5, kind


@pytest.mark.parametrize("kind", RECURRENT_KINDS)
def test_gated_attention_is_routed_and_equals_mlx_lm(tmp_path, kind):
    """The hybrids' gated attention (Qwen3NextAttention: query and output gate per head, partial RoPE) goes through
    KernelAttention (q/k/v in one call, the core through verify_attention) when the kernels are routed, and computes
    what mlx-lm's module computes: a 1-row step and a 5-row block over a cache, float32."""
    from mlx_lm.models.cache import KVCache

    from mlx_dflash2.kernels import KernelAttention

    path = tiny_hybrid_dir(tmp_path / kind, kind)
    target, _, _ = load_target(str(path), dtype=mx.float32)
    originals = [(i, layer.self_attn) for i, layer in enumerate(target.layers) if "self_attn" in layer]
    assert originals
    assert target.route_kernels("kernel", force=True) > 0
    for i, attn in originals:
        routed = target.layers[i].self_attn
        assert isinstance(routed, KernelAttention) and routed.fixed[-1] is True
        hidden = attn.o_proj.weight.shape[0]  # o_proj's output rows (quantized or not)
        x = mx.random.normal((1, 7, hidden), key=mx.random.key(i))
        c1, c2 = KVCache(), KVCache()
        for a, b in ((0, 2), (2, 3), (3, 7)):  # a 2-row block, a 1-row step, a 4-row block: causal over the cache
            mask = "causal" if b - a > 1 else None
            want = attn(x[:, a:b], mask=mask, cache=c1)
            got = routed(x[:, a:b], mask=mask, cache=c2)
            assert mx.abs(want - got).max().item() <= 1e-5, (kind, i, a)


@pytest.mark.parametrize("kind,quantized", [("qwen3_next", True), ("qwen3_5", False)])
def test_compiled_hybrid_blocks_compute_what_the_routed_layers_compute(tmp_path, kind, quantized, monkeypatch):
    """MLX_DFLASH2_COMPILE=1 (the default on a GPU) on a hybrid: every decoder layer becomes a KernelBlock, the
    attention layers as in a dense target, the GatedDeltaNet layers with their norm and mixer eager and their tail
    compiled. Eager (first call of a shape) and compiled calls give exactly the logits of the routed layers
    without compile (float32), the early submission of a block changes nothing, and speculative decoding with
    rejections at several offsets still equals mlx-lm's greedy output."""
    from mlx_dflash2.kernels import undo_routes
    from mlx_dflash2.kernels.block import KernelBlock

    import mlx.nn as nn

    from mlx_dflash2.kernels import KernelMLP

    path = tiny_hybrid_dir(tmp_path / kind, kind)
    target, _, _ = load_target(str(path), dtype=mx.float32)
    if quantized:  # the GPU's shape of it: routed linears, the MLP's gate and up fused (KernelMLP) in the tail
        from mlx_dflash2.target import TargetAdapter

        nn.quantize(target.lm, group_size=32, bits=4,
                    class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % 32 == 0)
        mx.eval(target.lm.parameters())
        target = TargetAdapter(target.lm, target.config, vocab_size=target.vocab_size)  # as loaded quantized
    ids = mx.array(PROMPT[:14], dtype=mx.int32)
    monkeypatch.setenv("MLX_DFLASH2_COMPILE", "0")
    assert target.route_kernels("kernel", force=True) > 0
    assert not any(isinstance(b, KernelBlock) for b in target.inner.layers)
    cache = target.make_cache()
    target.forward(ids[:10], cache)
    want = target.forward(ids[10:], cache).logits
    undo_routes(list(target._routes))
    target._routes = []  # (the adapter's record of its routes: routed again below)
    monkeypatch.setenv("MLX_DFLASH2_COMPILE", "1")
    monkeypatch.setenv("MLX_DFLASH2_SUBMIT_EVERY", "1")
    assert target.route_kernels("kernel", force=True) > 0
    blocks = target.inner.layers
    assert all(isinstance(b, KernelBlock) for b in blocks)
    assert [b.linear for b in blocks] == ["linear_attn" in b.inner for b in blocks] and any(b.linear for b in blocks)
    assert not any(b.linear for b in blocks[2::3]) and all(b.linear for b in blocks[:2])  # full attention every 3rd
    if quantized:
        assert all(isinstance(b.inner.mlp, KernelMLP) for b in blocks)
    for _ in range(3):  # eager, then compiled twice
        cache = target.make_cache()
        target.forward(ids[:10], cache)
        assert mx.array_equal(target.forward(ids[10:], cache).logits, want)
    hidden = blocks[0].inner.input_layernorm.weight.shape[0]
    assert all(((1, 4, hidden), mx.float32) in b._compiled()[0] for b in blocks)  # every layer took its fast path
    B, n = 4, 17
    ref = mlx_lm_greedy(target, PROMPT, n)  # plain decoding through the compiled model's own call
    prop = ScriptedProposer(len(PROMPT), ref, [0, 3, 1, 2], B, target.vocab_rows)
    assert run(target, PROMPT, prop, B, n) == ref
