"""Exact-rollback caches (mlx_dflash2/caches.py) on tiny random mlx-lm hybrid models, CPU float32.

References are mlx-lm's own caches fed one token at a time (and, for sliding
windows, a full KVCache with a window mask built here in numpy).
"""

from __future__ import annotations

import functools

import mlx_dflash2  # noqa: F401  (before MLX: the optimized BLAS)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3_text, gemma4_text, qwen3_5, qwen3_next
from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, RotatingKVCache

from mlx_dflash2.caches import (
    RecurrentCache,
    WindowKVCache,
    convert_caches,
    install_recording,
    rollback_capacity,
)

TOL = 1e-5
TOL_PREFILL = 5e-5
VOCAB = 97
W = 8  # sliding window of the gemma models


# ------------------------------------------------------------------------------------------------
# tiny models
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _model(kind: str):
    mx.random.seed(0)
    if kind == "qwen3_next":
        args = qwen3_next.ModelArgs(
            model_type="qwen3_next", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
            num_attention_heads=4, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0, num_experts_per_tok=0,
            decoder_sparse_step=1, shared_expert_intermediate_size=0, mlp_only_layers=[], moe_intermediate_size=0,
            rms_norm_eps=1e-6, vocab_size=VOCAB, num_key_value_heads=2, rope_theta=10000.0,
            partial_rotary_factor=0.5, max_position_embeddings=512, head_dim=16, full_attention_interval=3,
        )  # fmt: skip
        model = qwen3_next.Model(args)
    elif kind == "qwen3_5":
        args = qwen3_5.ModelArgs.from_dict(
            dict(
                model_type="qwen3_5",
                text_config=dict(
                    model_type="qwen3_5_text", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                    full_attention_interval=3, head_dim=16,
                ),  # fmt: skip
            )
        )
        model = qwen3_5.Model(args)
    elif kind == "gemma3_text":
        args = gemma3_text.ModelArgs(
            model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
            num_attention_heads=2, head_dim=32, num_key_value_heads=1, vocab_size=VOCAB, sliding_window=W,
            sliding_window_pattern=3, query_pre_attn_scalar=32,
        )  # fmt: skip
        model = gemma3_text.Model(args)
    elif kind == "gemma4_text":
        args = gemma4_text.ModelArgs(
            hidden_size=64, num_hidden_layers=5, intermediate_size=128, num_attention_heads=2, head_dim=32,
            global_head_dim=32, num_key_value_heads=1, num_kv_shared_layers=2, vocab_size=VOCAB,
            vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, sliding_window=W,
            sliding_window_pattern=3,
        )  # fmt: skip
        model = gemma4_text.Model(args)
    else:
        raise KeyError(kind)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def recording():
    """qwen3_next / qwen3_5 models with recording installed (undone at the end of the module)."""
    undos = {k: install_recording(_model(k)) for k in ("qwen3_next", "qwen3_5")}
    yield {k: _model(k) for k in undos}
    for u in undos.values():
        u()


def _stream(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def _clone(c):
    if hasattr(c, "clone"):
        return c.clone()
    assert type(c) is KVCache
    d = KVCache()
    if c.keys is not None:
        d.keys, d.values, d.offset = mx.array(c.keys), mx.array(c.values), c.offset
    return d


def _forward(model, caches, tokens):
    out = model(mx.array(tokens)[None], cache=caches)
    mx.eval(out, [c.state for c in caches])
    return out[0]


def _maxdiff(a, b) -> float:
    return float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item())


@functools.lru_cache(maxsize=None)
def _reference_one_by_one(kind: str, tokens: tuple):
    """Feed ``tokens`` one at a time into mlx-lm's own caches (``model.make_cache()``).

    Returns ``(states, logits)``: ``states[p]`` = the caches' arrays after ``p`` tokens
    (list per layer of ``(conv, state)`` for ArraysCache, else None);
    ``logits[p]`` = logits after feeding token ``p`` (predicting ``p + 1``).
    """
    model = _model(kind)
    caches = model.make_cache()
    states, logits = [None], []
    for t in tokens:
        logits.append(_forward(model, caches, [t])[-1])
        states.append([(c[0], c[1]) if isinstance(c, ArraysCache) else None for c in caches])
    return states, logits


# ------------------------------------------------------------------------------------------------
# GatedDeltaNet: RecurrentCache + install_recording
# ------------------------------------------------------------------------------------------------


def _assert_states(caches, ref_states):
    for c, ref in zip(caches, ref_states):
        if ref is None:
            continue
        assert isinstance(c, RecurrentCache)
        assert _maxdiff(c[0], ref[0]) <= TOL
        assert _maxdiff(c[1], ref[1]) <= TOL


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_recurrent_trim_every_n_matches_one_by_one(recording, kind):
    model = recording[kind]
    S = _stream(40, seed=1)
    ref_states, ref_logits = _reference_one_by_one(kind, tuple(S))
    junk = _stream(16, seed=2)
    caches = convert_caches(model.make_cache())
    assert [type(c) for c in caches] == [RecurrentCache, RecurrentCache, KVCache]
    pos = 10
    _forward(model, caches, S[:pos])  # prompt
    _assert_states(caches, ref_states[pos])
    for L in (4, 8, 5):
        for n in range(L):  # every possible rejection count from the same round start
            trial = [_clone(c) for c in caches]
            keep = L - n
            _forward(model, trial, S[pos : pos + keep] + junk[:n])
            assert all(c.trim(n) == n for c in trial)
            assert [c.offset for c in trial] == [pos + keep] * 3
            _assert_states(trial, ref_states[pos + keep])
            # the next token's logits equal too (the rollback left nothing behind)
            assert _maxdiff(_forward(model, trial, [S[pos + keep]])[-1], ref_logits[pos + keep]) <= TOL
        caches = trial  # continue from the last trial (keep = 1, then the next token)
        pos += 2


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_recurrent_trim_across_forwards_and_limits(recording, kind):
    model = recording[kind]
    S = _stream(40, seed=1)
    ref_states, ref_logits = _reference_one_by_one(kind, tuple(S))
    caches = convert_caches(model.make_cache())
    _forward(model, caches, S[:10])
    # round r: 5 tokens (3 accepted), round r+1 already queued: 4 tokens -> drop 2 + 4
    _forward(model, caches, S[10:13] + [1, 2])
    _forward(model, caches, [3, 4, 5, 6])
    assert rollback_capacity(caches) == 19
    for c in caches:
        c.trim(6)
    _assert_states(caches, ref_states[13])
    assert _maxdiff(_forward(model, caches, [S[13]])[-1], ref_logits[13]) <= TOL
    # the replayed forward is a record again: trim inside it, then across it into the prompt
    for c in caches:
        c.trim(2)  # 1 (the single token) + 1 inside the replayed 3-row record
    _assert_states(caches, ref_states[12])
    for c in caches:
        c.trim(4)  # 2 left of the replayed record + 2 inside the 10-row prompt
    _assert_states(caches, ref_states[8])
    assert rollback_capacity(caches) == 8

    # history is bounded: 4 forwards
    caches = convert_caches(model.make_cache())
    _forward(model, caches, S[:10])
    for i in range(5):
        _forward(model, caches, S[10 + 2 * i : 12 + 2 * i])
    rec = [c for c in caches if isinstance(c, RecurrentCache)]
    assert rec[0].rollback_capacity() == 8
    before = (rec[0][0], rec[0][1], rec[0].offset)
    with pytest.raises(ValueError, match="only 8 positions"):
        rec[0].trim(9)
    assert rec[0][0] is before[0] and rec[0][1] is before[1] and rec[0].offset == before[2]  # nothing changed
    for c in caches:
        c.trim(8)
    _assert_states(caches, ref_states[12])

    # a prefill longer than max_record keeps no inputs: whole drop ok, partial raises
    caches = convert_caches(model.make_cache(), max_record=6)
    _forward(model, caches, S[:10])
    _forward(model, caches, S[10:14])
    assert rollback_capacity(caches) == 4
    with pytest.raises(ValueError, match="max_record=6"):
        caches[0].trim(5)
    for c in caches:
        c.trim(14)
    assert all(c.offset == 0 for c in caches) and caches[0].empty()
    _forward(model, caches, S[:3])
    _assert_states(caches, ref_states[3])

    # commit() drops the history
    caches[0].commit()
    with pytest.raises(ValueError, match="no recorded forward"):
        caches[0].trim(1)


def test_recurrent_unrecorded_model_refuses_trim():
    model = _model("qwen3_next")  # other tests may have recording installed: use a fresh model object
    fresh = qwen3_next.Model(model.args)
    fresh.update(model.parameters())
    caches = convert_caches(fresh.make_cache())
    _forward(fresh, caches, [1, 2, 3, 4])
    assert caches[0].offset == 4 and caches[0].rollback_capacity() == 0
    with pytest.raises(ValueError, match="install_recording"):
        caches[0].trim(1)


def test_install_recording_keeps_parameters_and_undo():
    base = _model("qwen3_5")
    model = qwen3_5.Model(base.args)
    model.update(base.parameters())
    keys = [k for k, _ in tree_flatten(model.parameters())]
    mixer = model.layers[0].linear_attn
    cls = type(mixer)
    undo = install_recording(model)
    assert model.layers[0].linear_attn is mixer and isinstance(mixer, cls) and type(mixer) is not cls
    assert [k for k, _ in tree_flatten(model.parameters())] == keys
    assert model.layers[0].is_linear and not model.layers[2].is_linear
    model.load_weights(tree_flatten(base.parameters()))  # strict: the same key paths
    assert type(qwen3_5.Model(base.args).layers[0].linear_attn) is cls  # other model objects unaffected
    undo2 = install_recording(model)  # idempotent: nothing left to switch
    undo2()
    assert type(mixer) is not cls
    # quantizing while recording keeps the paths (the mixer is the same object) and the rollback works
    nn.quantize(model, group_size=32, bits=8)
    assert isinstance(mixer.in_proj_qkv, nn.QuantizedLinear)
    caches = convert_caches(model.make_cache())
    _forward(model, caches, [1, 2, 3, 4, 5])
    mid = caches[0][1]
    _forward(model, caches, [6, 7])
    for c in caches:
        c.trim(2)
    assert _maxdiff(caches[0][1], mid) == 0.0
    undo()
    undo()
    assert type(mixer) is cls


def test_recurrent_clone_and_state(recording):
    model = recording["qwen3_next"]
    caches = convert_caches(model.make_cache())
    _forward(model, caches, [5, 6, 7, 8, 9])
    c = caches[0]
    d = c.clone()
    conv, state, off = c[0], c[1], c.offset
    _forward(model, caches, [1, 2, 3])
    assert d[0] is conv and d[1] is state and d.offset == off == 5
    d.trim(2)  # rolling back the clone leaves the original alone
    assert c.offset == 8 and d.offset == 3
    mx.eval(c.state)
    mx.eval(d.state)
    assert _maxdiff(d[1], _reference_one_by_one("qwen3_next", (5, 6, 7))[0][3][0][1]) <= TOL


# ------------------------------------------------------------------------------------------------
# Sliding windows: WindowKVCache
# ------------------------------------------------------------------------------------------------


def _np_window_mask(N, offset, window):
    q = np.arange(offset, offset + N)[:, None]
    k = np.arange(offset + N)[None]
    m = (k <= q) if window is None else ((k <= q) & (k > q - window))
    return mx.array(m)


class _NumpyMaskKVCache(KVCache):
    """A full KVCache whose masks (causal, or window ``(p - w, p]``) are built here in numpy."""

    def make_mask(self, N, window_size=None, return_array=False):
        return _np_window_mask(N, self.offset, window_size)


def _full_with_window_mask(kind, tokens):
    model = _model(kind)
    caches = [_NumpyMaskKVCache() for _ in model.make_cache()]
    return _forward(model, caches, tokens)


@pytest.mark.parametrize("kind,slack", [("gemma3_text", 6), ("gemma3_text", 64), ("gemma4_text", 6)])
def test_window_mixed_blocks_and_trims_match(kind, slack):
    """Mixed block sizes (1 to > w) and trims, many wraps; three references.

    * a twin run through full KVCaches whose window masks are built here in numpy,
      fed the same blocks and trims (same block structure: TOL);
    * mlx-lm's RotatingKVCache fed one token at a time (TOL_PREFILL: its keys are laid out otherwise, exactly the
      window, ours hold the slack too, masked, and a block's rows come from a multi-row forward, so float32 sums
      round differently: up to 1.2e-5 on an Intel Xeon host, below 1e-5 on the AMD EPYC hosts before; the twin
      above checks our caches at TOL);
    * the final sequence through the numpy-masked full KVCaches in one forward
      (TOL_PREFILL: a 44-row forward differs from one-token forwards by ~2e-5 in
      float32 here -- mlx-lm's own caches show the same, logits are ~2 in size).
    """
    model = _model(kind)
    S = _stream(48, seed=3)
    junk = _stream(16, seed=4)
    _, ref_logits = _reference_one_by_one(kind, tuple(S))  # mlx-lm RotatingKVCache, one token at a time
    caches = convert_caches(model.make_cache(), slack=slack)
    twin = [_NumpyMaskKVCache() for _ in caches]
    assert all(isinstance(c, (WindowKVCache, KVCache)) for c in caches)
    assert any(isinstance(c, WindowKVCache) for c in caches)

    def step(tokens):
        out = _forward(model, caches, tokens)
        assert _maxdiff(out, _forward(model, twin, tokens)) <= TOL
        return out

    def trim(n):
        for c in caches + twin:
            assert c.trim(n) == n

    step(S[:5])
    pos = 5
    # (block size, rejected) rounds, then one accepted "bonus" token; sizes mix 1 and > w
    rounds = [(3, 1), (1, 0), (6, 5), (9, 2), (2, 2), (5, 0), (4, 3), (1, 1), (7, 4), (3, 0), (6, 6), (2, 1)]
    for L, n in rounds:
        keep = L - n
        logits = step(S[pos : pos + keep] + junk[:n])
        trim(n)
        pos += keep
        if keep:
            assert _maxdiff(logits[keep - 1], ref_logits[pos - 1]) <= TOL_PREFILL
        logits = step([S[pos]])
        pos += 1
        assert _maxdiff(logits[-1], ref_logits[pos - 1]) <= TOL_PREFILL
    # a trim across two forwards (round r's tail + all of round r+1), within the slack
    step(S[pos : pos + 2] + junk[:2])
    step(junk[2:5])
    trim(5)
    pos += 2
    logits = step([S[pos]])
    pos += 1
    assert _maxdiff(logits[-1], ref_logits[pos - 1]) <= TOL_PREFILL
    assert pos > 4 * W  # the window wrapped several times
    full = _full_with_window_mask(kind, S[:pos])
    assert _maxdiff(full[-1], logits[-1]) <= TOL_PREFILL


def test_window_mask_matches_returned_keys_randomized():
    """Positions are written into the keys: each query must see exactly (p - w, p], however fed and trimmed."""
    rng = np.random.default_rng(5)
    for w, slack in [(8, 0), (8, 3), (8, 64), (1, 2), (5, 16)]:
        c = WindowKVCache(w, slack=slack)
        seq: list[int] = []  # the value stored at each position (a fresh id per write)
        next_id = 0
        for _ in range(120):
            if seq and rng.random() < 0.3:
                cap = c.rollback_capacity()
                if cap < len(seq):
                    with pytest.raises(ValueError, match="rollback capacity"):
                        c.trim(cap + 1)
                n = int(rng.integers(0, cap + 1))
                assert c.trim(n) == n
                del seq[len(seq) - n :]
                continue
            N = int(rng.choice([1, 1, 2, 3, 5, 9, 20]))
            ids = list(range(next_id, next_id + N))
            next_id += N
            mask = c.make_mask(N, window_size=w)
            kv = mx.array(np.array(ids, np.float32).reshape(1, 1, N, 1))
            k, v = c.update_and_fetch(kv, kv * 2)
            seq += ids
            O = len(seq) - N
            kL = k.shape[2]
            if mask is None:
                m = np.ones((1, kL), bool)
            elif isinstance(mask, str):
                m = np.arange(kL)[None] <= np.arange(kL - N, kL)[:, None]
            else:
                m = np.array(mask)
            assert m.shape == (N, kL)
            got = np.array(k[0, 0, :, 0])
            for i in range(N):
                p = O + i
                assert sorted(got[m[i]].tolist()) == seq[max(0, p - w + 1) : p + 1]
            assert np.array_equal(np.array(v[0, 0, :, 0]), 2 * got)
            assert c.offset == len(seq) and k.shape[2] == c.size()
            assert c.size() <= w - 1 + max(slack, N)  # eviction keeps the buffer bounded


def test_window_invariant_and_capacity():
    w, slack = 8, 4
    c = WindowKVCache(w, slack=slack)
    one = mx.zeros((1, 1, 1, 2))
    for _ in range(40):
        c.update_and_fetch(one, one)
        assert c.start == max(0, c.offset - (w - 1) - slack)
        assert c.rollback_capacity() == (c.offset if c.start == 0 else slack)
    m = c.make_mask(1, window_size=w)  # holds w - 1 + slack old rows: the oldest must be masked
    assert m.shape == (1, w - 1 + slack) and np.array(m).sum() == w and not np.array(m)[0, : slack - 1].any()
    c.trim(slack)
    with pytest.raises(ValueError, match="rollback capacity 0"):
        c.trim(1)
    assert c.offset == 40 - slack
    with pytest.raises(ValueError, match="exceeds the cache's window"):
        c.make_mask(2, window_size=w + 1)
    with pytest.raises(ValueError, match="keep=4"):
        WindowKVCache(w, keep=4)


def test_window_clone_and_state():
    c = WindowKVCache(4, slack=2)
    x = mx.arange(6, dtype=mx.float32).reshape(1, 1, 6, 1)
    c.update_and_fetch(x, x)
    mx.eval(c.state)
    d = c.clone()
    c.update_and_fetch(x[:, :, :1] + 100, x[:, :, :1] + 100)
    mx.eval(c.state)
    d.update_and_fetch(x[:, :, :1] - 100, x[:, :, :1] - 100)
    mx.eval(d.state)
    kc, _ = c.update_and_fetch(x[:, :, :1], x[:, :, :1])
    kd, _ = d.update_and_fetch(x[:, :, :1], x[:, :, :1])
    assert np.array(kc[0, 0, :, 0]).tolist()[-2:] == [100.0, 0.0]
    assert np.array(kd[0, 0, :, 0]).tolist()[-2:] == [-100.0, 0.0]
    assert WindowKVCache(4).state == [] and WindowKVCache(4).empty()


# ------------------------------------------------------------------------------------------------
# convert_caches / rollback_capacity
# ------------------------------------------------------------------------------------------------


def test_convert_caches_types_and_errors():
    conv = {
        k: [type(c).__name__ for c in convert_caches(_model(k).make_cache())]
        for k in ("qwen3_next", "qwen3_5", "gemma3_text", "gemma4_text")
    }
    assert conv == {
        "qwen3_next": ["RecurrentCache", "RecurrentCache", "KVCache"],
        "qwen3_5": ["RecurrentCache", "RecurrentCache", "KVCache"],
        "gemma3_text": ["WindowKVCache", "WindowKVCache", "KVCache", "WindowKVCache"],
        "gemma4_text": ["WindowKVCache", "WindowKVCache", "KVCache"],
    }
    cs = convert_caches(_model("gemma3_text").make_cache(), slack=12)
    assert cs[0].max_size == W and cs[0].slack == 12
    assert convert_caches(cs)[0] is cs[0]  # idempotent
    kv = KVCache()
    assert convert_caches([kv])[0] is kv
    assert convert_caches([ArraysCache(2)], max_record=7)[0].max_record == 7
    with pytest.raises(TypeError, match="ChunkedKVCache"):
        convert_caches([KVCache(), ChunkedKVCache(16)])
    with pytest.raises(TypeError, match="size 3"):
        convert_caches([ArraysCache(3)])
    with pytest.raises(ValueError, match="keep=4"):
        convert_caches([RotatingKVCache(16, keep=4)])
    used = RotatingKVCache(16)
    used.update_and_fetch(mx.zeros((1, 1, 2, 4)), mx.zeros((1, 1, 2, 4)))
    with pytest.raises(ValueError, match="already holds state"):
        convert_caches([used])
    assert rollback_capacity([]) == 0
    assert rollback_capacity([kv, used]) == 0
