"""Drafter architecture, checkpoint contract and validation."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlx_dflash2.drafter import (
    DraftContext,
    DrafterConfig,
    DrafterConfigError,
    DrafterLoadError,
    DraftModel,
    default_target_layer_ids,
    init_drafter,
    load_drafter,
    save_drafter,
)
from mlx_dflash2.drafter.model import GroupedDynamicCausalConv
from mlx_dflash2.proposers import DFlashProposer


def tiny_cfg(**over) -> dict:
    cfg = {
        "architectures": ["DFlash2DraftModel"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 100,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "is_causal": False,
        "dflash_config": {
            "block_size": 8,
            "mask_token_id": 99,
            "target_layer_ids": [0, 1],
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": 8,
            "selector_top_k": 4,
        },
    }
    for k, v in over.items():
        if k in cfg["dflash_config"]:
            cfg["dflash_config"][k] = v
        else:
            cfg[k] = v
    return cfg


def randomize(model, seed=0):
    """Random non-trivial weights (so the conv and selector are not no-ops)."""
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    model.update(tree_unflatten([(n, mx.random.normal(p.shape, key=k) * 0.2) for (n, p), k in zip(params, keys)]))
    mx.eval(model.parameters())
    return model


# ---------------------------------------------------------------------------- config


def test_config_roundtrip():
    c = DrafterConfig.from_dict(tiny_cfg())
    assert DrafterConfig.from_dict(c.to_dict()) == c
    assert c.to_dict()["dflash_config"]["selector_top_k"] == 4


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda c: c["dflash_config"].pop("target_layer_ids"), "target_layer_ids"),
        (lambda c: c["dflash_config"].pop("block_size"), "block_size"),
        (lambda c: c["dflash_config"].update(block_size=1), "block_size"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[]), "target_layer_ids"),
        (lambda c: c["dflash_config"].update(conv_group_size=7), "conv_group_size"),
        (lambda c: c["dflash_config"].pop("selector_rank"), "selector_rank"),
        (lambda c: c.update(architectures=["LlamaForCausalLM"]), "architectures"),
        (lambda c: c.pop("architectures"), "architectures"),
        (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
        (lambda c: c.update(hidden_size="64"), "hidden_size"),
        (lambda c: c.update(layer_types=["full_attention"]), "layer_types"),
    ],
)
def test_config_errors_name_the_field(mutate, field):
    cfg = tiny_cfg()
    mutate(cfg)
    with pytest.raises(DrafterConfigError) as e:
        DrafterConfig.from_dict(cfg)
    assert e.value.field == field
    assert field in str(e.value)


def test_fields_fall_back_to_top_level():
    cfg = tiny_cfg()
    cfg["block_size"] = cfg["dflash_config"].pop("block_size")
    assert DrafterConfig.from_dict(cfg).block_size == 8


def test_default_tap_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B drafter (spec §1.7)
    assert default_target_layer_ids(30, 1) == [15]


def _reference_taps(L, n):
    """The published rule (spec §1.2), which is only valid on deep enough targets."""
    return [L // 2] if n == 1 else [int(round(1 + i * (L - 4) / (n - 1))) for i in range(n)]


@pytest.mark.parametrize("L", range(1, 9))
def test_tap_rule_valid_for_every_depth_and_tap_count(L):
    """Depth 1..8, every tap count (and more taps than layers): distinct increasing ids inside the
    target, as many as asked up to L, and the reference rule unchanged wherever it is valid."""
    for n in range(1, L + 3):
        ids = default_target_layer_ids(L, n)
        assert len(ids) == min(n, L), (L, n, ids)
        assert all(0 <= a < b < L for a, b in zip(ids, ids[1:])) and 0 <= ids[0] < L, (L, n, ids)
        ref = _reference_taps(L, n)
        if n <= L and all(0 <= a < b < L for a, b in zip(ref, ref[1:])) and 0 <= ref[0] < L:
            assert ids == ref, (L, n, ids, ref)
    assert default_target_layer_ids(2, 2) == [0, 1]  # the reference gives [1, -1]
    assert default_target_layer_ids(4, 3) == [1, 2, 3]  # the reference gives [1, 1, 1]
    for L, n in ((0, 1), (4, 0)):
        with pytest.raises(ValueError):
            default_target_layer_ids(L, n)


def test_rope_parameters_accepted():
    cfg = tiny_cfg()
    cfg.pop("rope_theta")
    cfg["rope_parameters"] = {"rope_theta": 1e7, "rope_type": "default"}
    c = DrafterConfig.from_dict(cfg)
    assert c.rope_theta == 1e7 and c.rope_scaling is None


# ---------------------------------------------------------------------------- modules


def test_conv_matches_formula():
    D, K, gs, B = 32, 2, 8, 5
    conv = GroupedDynamicCausalConv(D, K, gs)
    conv.base_kernel = mx.random.normal((2, K, D))
    conv.kernel_projection.weight = mx.random.normal(conv.kernel_projection.weight.shape) * 0.1
    u = mx.random.normal((1, B, D))
    x = mx.random.normal((1, B, D))
    delta = conv.coefficients(u)
    got = np.array(conv.apply(x, 1, delta))
    base, dl, xn = np.array(conv.base_kernel), np.array(delta), np.array(x)
    want = np.zeros_like(xn)
    for t in range(B):
        for k in range(K):
            if t - k < 0:
                continue
            for c in range(D):
                want[0, t, c] += (base[1, k, c] + dl[0, t, 1, k, c // gs]) * xn[0, t - k, c]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_fresh_dflash2_equals_dflash_v1():
    """A fresh DFlash2 (identity conv, zero successor codebook) drafts exactly as DFlash v1."""
    c2 = DrafterConfig.from_dict(tiny_cfg())
    c1 = DrafterConfig.from_dict(tiny_cfg(architectures=["DFlashDraftModel"]))
    m2 = DraftModel(c2)
    m2.init_weights(seed=1)
    m1 = DraftModel(c1)
    shared = {k: v for k, v in tree_flatten(m2.parameters()) if "conv" not in k and "selector" not in k}
    m1.load_weights(list(shared.items()), strict=True)
    emb = mx.random.normal((1, 8, 64))
    feats = mx.random.normal((5, 128))
    ctx1, ctx2 = DraftContext(m1), DraftContext(m2)
    ctx1.append(m1, feats)
    ctx2.append(m2, feats)
    h1, h2 = m1(emb, ctx1), m2(emb, ctx2)
    assert mx.array_equal(h1, h2).item()
    lm = mx.random.normal((64, 100))
    u = h2[0, 1:] @ lm
    out = m2.candidate_selector.walk(u, h2[0, 1:], mx.array(3))
    assert mx.array_equal(out.tokens, mx.argmax(u, axis=-1)).item()


def test_selector_walk_matches_brute_force():
    cfg = DrafterConfig.from_dict(tiny_cfg())
    m = randomize(DraftModel(cfg), seed=2)
    sel = m.candidate_selector
    T, V = 6, 100
    u = mx.random.normal((T, V)) * 3
    h = mx.random.normal((T, 64))
    anchor = 7
    out = sel.walk(u, h, mx.array(anchor))
    A, Bc = np.array(sel.predecessor_codebook), np.array(sel.successor_codebook)
    H = np.array(sel.hidden_projection(h))
    un = np.array(u)
    prev = anchor
    want = []
    for t in range(T):
        cands = np.argsort(-un[t])[:4]
        scores = [un[t, b] + np.sum(A[prev] * H[t] * Bc[b]) for b in cands]
        prev = int(cands[int(np.argmax(scores))])
        want.append(prev)
    assert out.tokens.tolist() == want
    # sampled walk: q rows are distributions over the K candidates, drafts are among them
    s = sel.walk(u, h, mx.array(anchor), temperature=0.8, key=mx.random.key(0))
    np.testing.assert_allclose(np.array(s.q.sum(-1)), 1.0, rtol=1e-5)
    assert all(t in c for t, c in zip(s.tokens.tolist(), s.cand_ids.tolist()))


def _nudged(u: mx.array, seed: int) -> mx.array:
    """``u`` with float32-rounding-sized differences (what a batched forward of the same row gives)."""
    return u + mx.random.normal(u.shape, key=mx.random.key(10_000 + seed)) * 1e-5


def test_sampled_drafts_do_not_depend_on_argpartitions_order():
    """Issue 22: a seeded sampled draft is the same whatever order ``argpartition`` leaves the top-K
    candidates in. That order moves with the last bits of scores anywhere in the vocabulary (a drafter
    forward batched with other requests' rows vs alone), and the draws are indexed by a candidate's
    position, so an unsorted order gave a seeded request other drafts beside other requests. Here rows
    of a SmolLM2-sized vocabulary differ by 1e-5: the candidate sets and the draws' winners stay (no
    near-tie at these seeds), argpartition's order does not (checked), and neither may the drafts."""
    from mlx_dflash2.drafter import CandidateSelector
    from mlx_dflash2.proposers import sample_top_k

    V, D, T = 49152, 32, 6
    sel = CandidateSelector(V, D, rank=8, top_k=16)
    sel.successor_codebook = mx.random.normal((V, 8), key=mx.random.key(1)) * 0.2
    sel.hidden_projection.weight = mx.random.normal((8, D), key=mx.random.key(2)) * 0.2
    moved, differ, unsorted = 0, {"selector": [], "v1": []}, []
    for seed in range(12):
        u = mx.random.normal((T, V), key=mx.random.key(seed)) * 3
        u2 = _nudged(u, seed)
        h = mx.random.normal((T, D), key=mx.random.key(100 + seed))
        moved += int((mx.argpartition(-u, 15, axis=-1)[:, :16] != mx.argpartition(-u2, 15, axis=-1)[:, :16])
                     .any(axis=-1).sum().item())
        key = mx.random.key(200 + seed)
        walks = {"selector": [sel.walk(x, h, mx.array(5), 0.8, key) for x in (u, u2)],
                 "v1": [sample_top_k(x, 0.8, key) for x in (u, u2)]}  # DFlash v1's sampled drafts
        for kind, (a, b) in walks.items():
            if a.tokens.tolist() != b.tokens.tolist():
                differ[kind].append(seed)
            if not a.cand_ids.tolist() == b.cand_ids.tolist() == mx.sort(a.cand_ids, axis=-1).tolist():
                unsorted.append((kind, seed))
            np.testing.assert_allclose(np.array(a.q.sum(-1)), 1.0, rtol=1e-5)
    assert differ == {"selector": [], "v1": []}  # unsorted candidates: 8 of the 12 seeds each
    assert unsorted == []  # the candidates come in ascending id order
    assert moved >= 5  # the premise: argpartition's order did move


def _reference_attention(attn, x, ctx, P):
    """Dense numpy-free reference: explicit softmax over [ctx; block] with the masks."""
    n, B, _ = x.shape
    q = attn.q_norm(attn.q_proj(x).reshape(1, B, attn.n_heads, -1)).transpose(0, 2, 1, 3)
    q = attn.rope(q, offset=P)
    kb, vb = attn.kv(x, P)
    kc, vc = attn.kv(ctx, 0)
    S = ctx.shape[1]
    k = mx.concatenate([kc, kb], 2)
    v = mx.concatenate([vc, vb], 2)
    rep = attn.n_heads // attn.n_kv_heads
    k, v = mx.repeat(k, rep, 1), mx.repeat(v, rep, 1)
    s = (q @ k.transpose(0, 1, 3, 2)) * attn.scale
    qpos = P + mx.arange(B)[:, None]
    kpos = mx.concatenate([mx.arange(S), P + mx.arange(B)])[None]
    keep = mx.ones((B, S + B), dtype=mx.bool_)
    if attn.causal:
        keep = keep & (kpos <= qpos)
    if attn.window:
        keep = keep & (qpos - kpos < attn.window)
    s = mx.where(keep, s, -mx.inf)
    o = mx.softmax(s, axis=-1) @ v
    return attn.o_proj(o.transpose(0, 2, 1, 3).reshape(1, B, -1))


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"is_causal": True},
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6, "is_causal": None},
        {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 4, "is_causal": False},
    ],
)
def test_attention_masks_match_reference(over):
    cfg = tiny_cfg(**over)
    if cfg.get("is_causal") is None:
        cfg.pop("is_causal")
    m = randomize(DraftModel(DrafterConfig.from_dict(cfg)), seed=4)
    attn = m.layers[0].self_attn
    P = 9
    ctx = mx.random.normal((1, P, 64))
    x = mx.random.normal((1, 5, 64))
    kc, vc = attn.kv(ctx, 0)
    got = attn(x, kc, vc, P)
    want = _reference_attention(attn, x, ctx, P)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    if "layer_types" in over and over.get("is_causal", 0) is None:
        assert attn.causal  # sliding without an explicit is_causal is causal in-block (spec §1.5)


# ---------------------------------------------------------------------------- checkpoints with the real target


@pytest.fixture(scope="module")
def fresh(smol_q):
    target, tok = smol_q
    return init_drafter(target, tok, num_layers=1, block_size=8, selector_rank=8, seed=0)


def test_init_is_valid_for_target(smol_q, fresh):
    target, tok = smol_q
    cfg = fresh.config
    assert cfg.hidden_size == target.hidden_size
    assert cfg.mask_token_id not in tok.eos_token_ids and cfg.mask_token_id < len(tok)
    assert all(i < target.num_layers for i in cfg.target_layer_ids)


def test_checkpoint_roundtrip(tmp_path, smol_q, fresh):
    target, tok = smol_q
    randomize(fresh, seed=5)
    path = save_drafter(fresh, tmp_path / "d")
    loaded = load_drafter(path, target, tok)
    a, b = dict(tree_flatten(fresh.parameters())), dict(tree_flatten(loaded.parameters()))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert loaded.config == fresh.config
    # same proposals
    feats = mx.random.normal((7, len(fresh.config.target_layer_ids) * 576))
    props = []
    for m in (fresh, loaded):
        s = DFlashProposer(m, target, len(tok)).start([])
        s.extend(list(range(7)), feats)
        props.append(s.propose(5, 7).tokens.tolist())
    assert props[0] == props[1]
    # refuses to overwrite; leaves no temp dirs behind
    with pytest.raises(FileExistsError):
        save_drafter(fresh, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def _write(tmp_path, fresh, mutate_cfg=None, mutate_weights=None):
    d = save_drafter(fresh, tmp_path / "ck", overwrite=True, max_shard_mb=1000)
    if mutate_cfg:
        cfg = json.loads((d / "config.json").read_text())
        mutate_cfg(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if mutate_weights:
        w = dict(mx.load(str(d / "model.safetensors")))
        mutate_weights(w)
        mx.save_safetensors(str(d / "model.safetensors"), w)
    return d


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda c: c["dflash_config"].update(mask_token_id=2), "mask_token_id"),  # EOS
        (lambda c: c["dflash_config"].update(mask_token_id=49152), "mask_token_id"),  # outside vocab
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda c: c.update(hidden_size=640, head_dim=64), "hidden_size"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 30]), "target_layer_ids"),
        (lambda c: c["dflash_config"].update(num_target_layers=24), "num_target_layers"),
        (lambda c: c.update(vocab_size=1000), "vocab_size"),
    ],
)
def test_incompatible_config_refused(tmp_path, smol_q, fresh, mutate, field):
    target, tok = smol_q
    d = _write(tmp_path, fresh, mutate_cfg=mutate)
    with pytest.raises(DrafterConfigError) as e:
        load_drafter(d, target, tok)
    assert e.value.field == field


def test_malformed_checkpoints(tmp_path, smol_q, fresh):
    target, tok = smol_q
    with pytest.raises(FileNotFoundError):
        load_drafter(tmp_path / "nope", target, tok)
    d = _write(tmp_path, fresh, mutate_weights=lambda w: w.pop("fc.weight"))
    with pytest.raises(DrafterLoadError, match="fc.weight"):
        load_drafter(d, target, tok)
    d = _write(tmp_path, fresh, mutate_weights=lambda w: w.update(extra=mx.zeros((2,))))
    with pytest.raises(DrafterLoadError, match="extra"):
        load_drafter(d, target, tok)
    d = _write(tmp_path, fresh, mutate_weights=lambda w: w.update({"norm.weight": mx.zeros((3,))}))
    with pytest.raises(DrafterLoadError, match="norm.weight"):
        load_drafter(d, target, tok)
    (d / "config.json").write_text("{not json")
    with pytest.raises(DrafterLoadError, match="invalid JSON"):
        load_drafter(d, target, tok)
    (d / "model.safetensors").write_bytes(b"\x00" * 10)
    (d / "config.json").write_text(json.dumps(fresh.config.to_dict()))
    with pytest.raises(DrafterLoadError, match="safetensors"):
        load_drafter(d, target, tok)


def test_published_tensor_names(fresh):
    names = set(k for k, _ in tree_flatten(fresh.parameters()))
    for n in [
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight",
        "layers.0.self_attn.q_norm.weight",
        "layers.0.attention_conv.base_kernel",
        "layers.0.mlp_conv.kernel_projection.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.0.post_attention_layernorm.weight",
    ]:
        assert n in names, n
    assert fresh["layers"][0]["attention_conv"]["kernel_projection"]["weight"].shape == (2 * 2 * 576 // 16, 576)


def test_padded_vocab_ids_never_proposed(smol_q):
    """Ids beyond the real tokenizer size are masked before the selector (known-bugs row 12)."""
    target, tok = smol_q
    m = init_drafter(target, tok, num_layers=1, block_size=8, selector_rank=4)
    p = DFlashProposer(m, target, valid_vocab=100)
    s = p.start([])
    s.extend([1, 2, 3], mx.random.normal((3, 576)))
    toks = s.propose(5, 7).tokens.tolist()
    assert all(t < 100 for t in toks)


@pytest.mark.parametrize(
    "over",
    [{}, {"is_causal": True}, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5}],
)
def test_forward_blocks_equals_incremental_inference(over):
    """The packed training path == the inference path with the context cache (same block, same context)."""
    cfg = DrafterConfig.from_dict(tiny_cfg(**over))
    m = randomize(DraftModel(cfg), seed=6)
    N, T, A, B = 2, 12, 3, 8
    feats = mx.random.normal((N, T, 128))
    anchors = mx.array([[1, 5, 11], [3, 4, 9]])
    emb = mx.random.normal((N * A, B, 64))
    got = m.forward_blocks(emb, feats, anchors)
    for n in range(N):
        for a in range(A):
            ctx = DraftContext(m)
            P = anchors[n, a].item()
            ctx.append(m, feats[n, :P])
            want = m(emb[n * A + a][None], ctx)[0]
            np.testing.assert_allclose(np.array(got[n * A + a]), np.array(want), rtol=2e-4, atol=2e-4)


def _blas_rows_blocked(block: int, rows=(40,), dims=((64, 96),)) -> bool:
    """Whether this host's float32 matmul gives the rows of whole ``block``-row groups the same bits whatever the
    other rows, for products of each of ``rows`` rows through ``nn.Linear``-laid weights (``x @ w.T``) of each of
    ``dims`` (the OpenBLAS sgemm of the 2-core hosts before session 37 did; on session 37's 2-core AMD EPYC, AVX2
    without AVX-512, no row subset matched the whole product, not even single-threaded; on session 48's AMD EPYC a
    40-row ``x @ w`` matched, the probe then, and the drafter's ``x @ w.T`` products did not)."""
    for i, (d_in, d_out) in enumerate(dims):
        w = mx.random.normal((d_out, d_in), key=mx.random.key(2 + i)).T
        for R in rows:
            x = mx.random.normal((R, d_in), key=mx.random.key(100 + R))
            whole = x @ w
            if not all(mx.array_equal(x[: k * block] @ w, whole[: k * block]).item() for k in range(1, R // block)):
                return False
    return True


@pytest.mark.parametrize(
    "over",
    [{}, {"is_causal": True}, {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 5},
     {"architectures": ["DFlashDraftModel"]}],
)
def test_forward_of_the_drafted_slots_equals_the_whole_blocks(over, monkeypatch):
    """A forward asked for the first ``slots`` positions only (what a proposal of ``slots - 1`` drafts reads) gives
    the whole block's values there, alone and for many requests' rows at once, and its last layer's MLP runs on
    those slots only (rounded up to fill whole blocks of ``MATMUL_ROW_BLOCK`` matmul rows). Bit for bit where the
    host's BLAS keeps such row blocks invariant; elsewhere to float32 rounding (the drafts then may differ between
    slot counts at a near-tie; the output does not: the target verifies every draft)."""
    from mlx_dflash2.drafter.model import MATMUL_ROW_BLOCK, DraftMLP, last_layer_slots

    cfg = DrafterConfig.from_dict(tiny_cfg(**over))
    # (the products this forward runs: 1-5 requests' whole blocks, through every projection of the tiny drafter)
    exact = _blas_rows_blocked(MATMUL_ROW_BLOCK, rows=[n * cfg.block_size for n in (1, 2, 3, 5)],
                               dims=[(64, 96), (96, 64), (64, 64), (128, 64), (64, 128), (64, 32), (64, 16)])

    def same(a, b):
        if exact:
            return mx.array_equal(a, b).item()
        return a.shape == b.shape and np.allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)

    m = randomize(DraftModel(cfg), seed=8)
    B = cfg.block_size
    ctxs = []
    for i, S in enumerate((7, 12, 3, 10, 9)):
        ctxs.append(DraftContext(m))
        ctxs[-1].append(m, mx.random.normal((S, 128), key=mx.random.key(i)))
    emb = mx.random.normal((len(ctxs), B, 64), key=mx.random.key(9))
    seen = []
    orig = DraftMLP.__call__
    monkeypatch.setattr(DraftMLP, "__call__", lambda self, x: (seen.append((self, x.shape[:2])), orig(self, x))[1])
    for N in (1, 2, 3, 5):
        whole = m.forward_rows(emb[:N], ctxs[:N])
        for slots in range(1, B + 1):
            seen.clear()
            got = m.forward_rows(emb[:N], ctxs[:N], slots)
            assert got.shape == (N, slots, 64) and same(got, whole[:, :slots]), (N, slots)
            Q = last_layer_slots(slots, N, B)
            assert (N * Q) % MATMUL_ROW_BLOCK == 0 or Q == B
            assert [s for mlp, s in seen if mlp is m.layers[-1].mlp] == [(N, Q)]
    for i in (0, 3):
        whole = m(emb[i : i + 1], ctxs[i])
        for slots in range(1, B + 1):
            assert same(m(emb[i : i + 1], ctxs[i], slots), whole[:, :slots]), (i, slots)
    assert [last_layer_slots(s, 8, 16) for s in (1, 2, 3, 16)] == [1, 2, 3, 16]
    assert [last_layer_slots(2, n, 16) for n in (1, 2, 3, 4, 6)] == [8, 4, 8, 2, 4]
    assert last_layer_slots(2, 1, 4) == 4


def test_drafter_init_notes_fewer_taps_than_asked(tmp_path, capsys):
    """`mlx_dflash2.drafter init --num-taps 5` on a 2-layer target makes 2 distinct taps and says so."""
    from tiny_models import tiny_mlx_lm_dir

    from mlx_dflash2.drafter.cli import main

    src = tiny_mlx_lm_dir(tmp_path / "t", "qwen2", num_layers=2)
    assert main(["init", "--model", str(src), "--num-taps", "5", "--out", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "note: 5 taps asked, 2 made" in out and "[0, 1]" in out


@pytest.mark.parametrize("V", [32768, 49152 + 37, 151936, 1000])
def test_top_k_ids_is_the_argpartition_set(V):
    """top_k_ids (two-stage selection) finds the same k ids per row as one argpartition: rows of random
    scores, rows whose k largest all sit in one group or at the tail past the last whole group, rows with
    -inf entries; leading axes kept; uint32 like argpartition."""
    from mlx_dflash2.drafter.model import TOP_K_GROUP, top_k_ids

    k = 16
    rows = np.random.default_rng(V).standard_normal((6, V)).astype(np.float32)
    rows[1, 256:256 + k] = 50.0 + np.arange(k)  # all in one group
    rows[2, V - 5:] = 40.0  # in the tail past the last whole group (V % 128 columns), when there is one
    rows[3, :V // 2] = -np.inf
    rows[4, ::TOP_K_GROUP] = 30.0 + np.arange(len(rows[4, ::TOP_K_GROUP]))  # one per group, spread out
    x = mx.array(rows).reshape(2, 3, V)
    got = top_k_ids(x, k)
    assert got.shape == (2, 3, k) and got.dtype == mx.uint32
    want = mx.argpartition(-x, k - 1, axis=-1)[..., :k]
    assert np.array_equal(np.sort(np.array(got), -1), np.sort(np.array(want), -1))
    assert np.array_equal(np.array(top_k_ids(x[1:2, 1:2], k))[0, 0], np.array(got)[1, 1])  # alone == batched
    top1 = mx.take_along_axis(x, top_k_ids(x, 1).astype(mx.int32), axis=-1)[..., 0]
    assert np.array_equal(np.array(top1), np.array(x.max(axis=-1)))  # k = 1: a row's maximum (ties: any of them)
    with pytest.raises(ValueError, match="k=0"):
        top_k_ids(x, 0)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_compiled_convolutions_train_like_the_reference(dtype):
    """forward_blocks (training) runs its convolution sides compiled, forward and backward
    (dynamic_conv_compiled): the drafter's states and every parameter's gradient equal those of the
    layers run with the eager reference ops, bit for bit here (float32 and bfloat16)."""
    from mlx.utils import tree_map

    cfg = DrafterConfig.from_dict(tiny_cfg())
    m = randomize(DraftModel(cfg), seed=3)
    m.update(tree_map(lambda p: p.astype(dtype), m.parameters()))
    N, T, A, B = 2, 12, 3, 8
    feats = mx.random.normal((N, T, 128)).astype(dtype)
    anchors = mx.array([[1, 5, 11], [3, 4, 9]])
    emb = mx.random.normal((N * A, B, 64)).astype(dtype)
    cot = mx.random.normal((N * A, B, 64)).astype(dtype)

    def eager(model):
        x = emb
        for layer, (ck, cv) in zip(model.layers, model.context_kv_all(feats)):
            x = layer(x, lambda attn, v, ck=ck, cv=cv: attn.blocks(v, ck, cv, anchors), "reference")
        return model.norm(x)

    def loss(fwd):
        return lambda model: (fwd(model).astype(mx.float32) * cot.astype(mx.float32)).sum()

    want_h, got_h = eager(m), m.forward_blocks(emb, feats, anchors)
    assert mx.array_equal(want_h, got_h)
    want = nn.value_and_grad(m, loss(eager))(m)
    got = nn.value_and_grad(m, loss(lambda model: model.forward_blocks(emb, feats, anchors)))(m)
    assert want[0].item() == got[0].item()
    gw, gg = dict(tree_flatten(want[1])), dict(tree_flatten(got[1]))
    assert gw.keys() == gg.keys()
    conv_grads = [k for k in gw if "conv" in k]
    assert conv_grads and all(mx.abs(gw[k]).max().item() > 0 for k in conv_grads)
    for k in gw:
        assert mx.array_equal(gw[k], gg[k]), k
