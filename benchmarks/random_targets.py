"""Helpers of the large-target benchmarks (``bench_scaling.py``, ``gpu/exactness.py``, ``bench_hybrid.py``):
random-weight Qwen3-shaped targets (dense, and GatedDeltaNet hybrids through mlx-lm's ``qwen3_5`` class)
quantized like mlx-community 4-bit checkpoints, a second model object sharing
their weights (the one the kernels are routed into), a fresh DFlash2 drafter of the shipped drafter's
shape, a scripted proposer of fixed acceptance, a timestamped log and a time budget.

Not a package module: the scripts put ``benchmarks/`` on ``sys.path``. Import ``mlx_dflash2`` before
MLX (the optimized OpenBLAS on Linux; the CUDA defaults ``MLX_PTX_CACHE_DIR`` and
``MLX_CUDA_USE_CUDNN_SDPA=0``).
"""

from __future__ import annotations

import mlx_dflash2  # noqa: F401  (before MLX)

import statistics
import sys
import time

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_map_with_path

from mlx_dflash2.proposers import Proposal, Proposer, ProposerSession

__all__ = ["SHAPES", "is_hybrid", "vocab_size", "param_count", "layer_counts", "build_target", "twin", "StubTokenizer",
           "make_drafter", "ScriptedProposer", "log", "Budget", "random_ids", "nbytes", "median", "generate_timed"]

SHAPES = {
    # Qwen3-8B geometry: 8.19B parameters
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    # Qwen2.5-Coder-1.5B's geometry (issue 21's target; untied here, the head's size is the same): 1.78B
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960, num_attention_heads=12,
                         num_key_value_heads=2, head_dim=128, vocab_size=151936),
    # a 27B-class dense shape (Qwen3-32B's width and depth, intermediate 17408): 22.7B parameters
    "dense-27b": dict(hidden_size=5120, num_hidden_layers=64, intermediate_size=17408, num_attention_heads=40,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936),
    # CPU logic tests of the scripts (every dimension a multiple of 64: 4-bit g64 everywhere)
    "tiny": dict(hidden_size=128, num_hidden_layers=6, intermediate_size=256, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64, vocab_size=1024),
    # GatedDeltaNet hybrids, built through mlx-lm's qwen3_5 class (the vision-language layout: model_type
    # qwen3_5, the text model's config under text_config; layer i is full attention when (i + 1) % 4 == 0).
    # Qwen3.5/3.6-27B's text geometry (as its config.json): 64 layers = 48 GatedDeltaNet + 16 gated attention,
    # hidden 5120, MLP 17408, attention 24 heads / 4 KV heads of 256 (rotary on a quarter, theta 1e7),
    # linear attention 16 key heads / 48 value heads of 128, conv kernel 4, vocab 248320, untied: 26.90B
    "hybrid-27b": dict(model_type="qwen3_5", hidden_size=5120, num_hidden_layers=64, intermediate_size=17408,
                       num_attention_heads=24, num_key_value_heads=4, head_dim=256, vocab_size=248320,
                       linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4),
    # CPU logic tests: 8 layers = 6 GatedDeltaNet + 2 attention
    "hybrid-tiny": dict(model_type="qwen3_5", hidden_size=128, num_hidden_layers=8, intermediate_size=256,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=1024,
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                        linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=4),
}

_T0 = time.perf_counter()


def log(msg: str) -> None:
    """Print ``msg`` with the wall clock and the seconds since the process started (flushed: a run cut by
    a timeout still shows how far it got)."""
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


class Budget:
    """A wall-clock budget in seconds from construction: ``left()`` seconds remain; ``fits(est)`` says
    whether a step estimated at ``est`` seconds fits, keeping ``reserve`` seconds for what follows."""

    def __init__(self, seconds: float):
        self.deadline = time.perf_counter() + float(seconds)

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def fits(self, est: float, reserve: float = 0.0) -> bool:
        return self.left() - reserve >= est


def is_hybrid(shape) -> bool:
    """Whether a shape (name or dict) is a GatedDeltaNet hybrid (mlx-lm's ``qwen3_5`` class)."""
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    return shape.get("model_type", "qwen3") == "qwen3_5"


def vocab_size(cfg: dict) -> int:
    """The vocabulary of a config made here (a hybrid's is under ``text_config``)."""
    return int(cfg.get("text_config", cfg)["vocab_size"])


def _hybrid_layer_params(shape: dict) -> tuple[int, int]:
    """(a GatedDeltaNet mixer's parameters, a gated-attention mixer's), as mlx-lm's qwen3_5 modules hold them."""
    D, H, KV, hd = (shape[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    nk, nv, dk, dv, K = (shape[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                            "linear_value_head_dim", "linear_conv_kernel_dim"))
    conv_dim, value_dim = 2 * nk * dk + nv * dv, nv * dv
    # in_proj_qkv, in_proj_z, in_proj_b + in_proj_a, out_proj, depthwise conv1d, A_log + dt_bias, gated norm
    gdn = D * conv_dim + D * value_dim + 2 * D * nv + value_dim * D + conv_dim * K + 2 * nv + dv
    # q_proj (queries and output gate), k_proj, v_proj, o_proj, q_norm + k_norm
    attn = D * 2 * H * hd + 2 * D * KV * hd + H * hd * D + 2 * hd
    return gdn, attn


def param_count(shape: dict) -> int:
    """Parameters of a shape (untied embedding and head). Dense: the linear layers only (the norms are
    ~0.00001 of it); hybrid: everything the mlx-lm modules hold, norms and the convolution included."""
    D, L, I, H, KV, hd, V = (shape[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                                "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size"))
    if not is_hybrid(shape):
        return L * (D * H * hd * 2 + D * KV * hd * 2 + 3 * D * I) + 2 * V * D
    gdn, attn = _hybrid_layer_params(shape)
    n_attn = L // shape["full_attention_interval"]
    return (L - n_attn) * gdn + n_attn * attn + L * (3 * D * I + 2 * D) + 2 * V * D + D


def layer_counts(shape) -> dict:
    """``{"gated_delta": n, "attention": n}`` decoder layers of a shape (name or dict)."""
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    L = shape["num_hidden_layers"]
    n_attn = L // shape["full_attention_interval"] if is_hybrid(shape) else L
    return {"gated_delta": L - n_attn, "attention": n_attn}


def _config(name: str, vocab: int | None = None) -> dict:
    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r} (choose from {', '.join(SHAPES)})")
    shape = dict(SHAPES[name])
    if vocab is not None:
        shape["vocab_size"] = int(vocab)
    if is_hybrid(shape):
        shape.pop("model_type")
        text = dict(model_type="qwen3_5_text", rms_norm_eps=1e-6, max_position_embeddings=262144,
                    tie_word_embeddings=False, attention_bias=False,
                    rope_parameters=dict(type="default", rope_theta=10000000.0, partial_rotary_factor=0.25), **shape)
        return dict(model_type="qwen3_5", tie_word_embeddings=False, text_config=text)
    return dict(model_type="qwen3", rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1000000.0,
                tie_word_embeddings=False, **shape)


def _skeleton(cfg: dict, bits: int, group_size: int, dtype):
    """An mlx-lm model of ``cfg`` (qwen3, or qwen3_5 for a hybrid) whose arrays are still lazy (nothing
    allocated yet), cast and quantized as mlx-lm's converter does for that class."""
    if cfg["model_type"] == "qwen3_5":
        from mlx_lm.models import qwen3_5

        model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(cfg))
        # mlx_lm.convert: floating parameters to dtype where the class's cast_predicate allows (A_log stays
        # float32); quantize every module with to_quantized whose input width is a multiple of the group (the
        # depthwise conv1d, the norms, A_log and dt_bias stay float), the class's quant_predicate on top
        cast = model.cast_predicate
        model.update(tree_map_with_path(
            lambda k, v: v.astype(dtype) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters()))
        if bits:
            qp = model.quant_predicate

            def pred(path, m):
                if not hasattr(m, "to_quantized") or m.weight.shape[-1] % group_size != 0:
                    return False
                return True if qp is None else qp(path, m)

            nn.quantize(model, group_size=group_size, bits=bits, class_predicate=pred)
        return model
    from mlx_lm.models import qwen3

    model = qwen3.Model(qwen3.ModelArgs.from_dict(cfg))
    model.set_dtype(dtype)
    if bits:
        nn.quantize(model, group_size=group_size, bits=bits)  # embedding and head too, as mlx-community's
    return model


def build_target(name: str, bits: int = 4, group_size: int = 64, dtype=mx.bfloat16, seed: int = 0,
                 vocab: int | None = None):
    """A random-weight Qwen3-shaped mlx-lm model (a hybrid: mlx-lm's ``qwen3_5.Model``), quantized (affine
    ``bits``/``group_size``; ``bits=0``: dense ``dtype``) and evaluated layer by layer, so the float32 initial
    weights of one layer at a time exist (a 27B shape peaks near its 4-bit size, ~13-15 GB, not at 100 GB).

    ``vocab``: the vocabulary size instead of the shape's (a real tokenizer's, for a model a server can serve).

    Returns:
        ``(model, config dict)``.

    Raises:
        KeyError: an unknown shape name.
    """
    cfg = _config(name, vocab)
    mx.random.seed(seed)
    model = _skeleton(cfg, bits, group_size, dtype)
    lm = getattr(model, "language_model", model)  # the text model of a qwen3_5 (vision-language) model
    mx.eval(lm.model.embed_tokens.parameters())
    for layer in lm.model.layers:
        mx.eval(layer.parameters())
    mx.eval(lm.model.norm.parameters(), lm.lm_head.parameters())
    model.eval()
    return model, cfg


def twin(model, cfg: dict, bits: int = 4, group_size: int = 64, dtype=mx.bfloat16):
    """A second mlx-lm model object holding the same weight arrays as ``model`` (no copy): routing the
    kernels into one (``TargetAdapter.route_kernels`` swaps modules of its own model object) leaves the
    other on MLX's modules, so both can be measured in one process, interleaved."""
    other = _skeleton(cfg, bits, group_size, dtype)
    other.update(model.parameters())  # the lazy random arrays of the skeleton are dropped unevaluated
    other.eval()
    return other


def nbytes(module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


class StubTokenizer:
    """What the drafter init and validation read from a tokenizer: ``len()`` and the special ids
    (EOS = the last id; the drafter's mask token is ``vocab - 2``)."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.eos_token_id = vocab - 1
        self.eos_token_ids = {vocab - 1}

    def __len__(self):
        return self.vocab


def make_drafter(target, vocab: int, layers: int = 4, taps: int = 5, block: int = 16, rank: int = 32,
                 seed: int = 0, dtype=mx.bfloat16):
    """A freshly initialised DFlash2 drafter of the shipped drafter's shape for ``target``
    (``mlx_dflash2.drafter.io.init_drafter``: 4 layers, 5 taps, B=16, selector rank 32 / top-16,
    intermediate = the target's), ``dtype`` (bf16 as shipped) with every linear layer 4-bit g64 (as the
    shipped one)."""
    from mlx_dflash2.drafter.io import init_drafter

    d = init_drafter(target, StubTokenizer(vocab), num_layers=layers, block_size=block, num_taps=taps,
                     mask_token_id=vocab - 2, selector_rank=rank, selector_top_k=16, seed=seed)
    d.update(tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a, d.parameters()))
    nn.quantize(d, group_size=64, bits=4, class_predicate=lambda p, m: isinstance(m, nn.Linear))
    mx.eval(d.parameters())
    d.eval()
    return d


def drafter_mode(drafter, mode: str, force: bool = False) -> int:
    """Run ``drafter`` with ``mode``'s kernels, as the product does beside a target of that mode
    (``mlx_dflash2.loading``: a routed target's drafter gets its linear layers routed too): ``"kernel"``/``"auto"``
    route them (:meth:`DraftModel.route_kernels`), ``"reference"`` puts MLX's layers back. Returns the routed
    modules."""
    if mode == "reference":
        drafter.unroute_kernels()
        drafter.kernel_mode = mode
        return 0
    return drafter.route_kernels(mode, force=force)


def random_ids(vocab: int, n: int, seed: int) -> list[int]:
    """``n`` random token ids away from the special ids at both ends of the vocabulary."""
    lo, hi = min(100, vocab // 8), max(vocab - 100, vocab * 7 // 8)
    return mx.random.randint(lo, hi, (n,), key=mx.random.key(seed)).tolist()


class ScriptedProposer(Proposer):
    """Proposes the target's own greedy continuation ``reference`` (computed beforehand by plain
    decoding of the same prompt), with its first error at block offset ``offsets[r % len]`` in round r.

    An offset ``k`` makes drafts ``d_1..d_k`` right and ``d_{k+1}`` wrong, so a round accepts ``k`` and
    emits ``k + 1`` tokens: offsets ``2, 3, 4, 5`` give tau 3, 4, 5, 6; ``k >= B - 1`` accepts the whole
    block (tau B). Deterministic and free (no drafter forward): the round's cost is the verify, the
    accept and the loop's bookkeeping. Where the loop's own output leaves ``reference`` (a near-tie the
    verify rounds the other way), the proposals are whatever ``reference`` holds at that position (then
    mostly rejected): the measured tau says so.

    Args:
        prompt_len: prompt tokens (the anchor of round r sits at ``committed - prompt_len``).
        reference: the generated tokens of plain decoding, first one included.
        offsets: first-error offsets, cycled over the rounds.
        block_size: B.
        vocab: vocabulary size (a wrong token is ``(right + 1) % vocab``).
        tap_ids: target layers tapped in the verify (a drafter's, so the verify does the same work).
    """

    name = "scripted"

    def __init__(self, prompt_len: int, reference: list[int], offsets, block_size: int, vocab: int, tap_ids=()):
        self.prompt_len, self.reference = prompt_len, list(reference)
        self.offsets, self.block_size, self.vocab = list(offsets), block_size, vocab
        self.tap_ids = tuple(tap_ids)

    def start(self, prompt):
        return _ScriptedSession(self)


class _ScriptedSession(ProposerSession):
    def __init__(self, p: ScriptedProposer):
        self.p, self.committed, self.rounds = p, 0, 0

    def extend(self, tokens, features):
        self.committed += len(tokens)

    def truncate(self, n):
        self.committed = n

    def propose(self, anchor, n, temperature=0.0, key=None):
        p = self.p
        g = self.committed - p.prompt_len  # index of the anchor in the generated sequence
        k = p.offsets[self.rounds % len(p.offsets)]
        self.rounds += 1
        right = p.reference[g + 1: g + 1 + n]
        right += [0] * (n - len(right))
        toks = [(t + 1) % p.vocab if i == k else t for i, t in enumerate(right)]
        return Proposal(mx.array(toks, dtype=mx.int32), source="drafter")


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def generate_timed(gen, stop_ids=()) -> dict:
    """Consume a token generator (``speculative_generate_step`` or ``mlx_lm.generate_step``: items whose
    first element is the token), stopping after a token in ``stop_ids``; timestamps on the consumer side,
    the same way for both.

    Returns:
        ``{"tokens": [...], "tps": (n - 1) / (t_last - t_first)}``: steps per second after the first token
        (whose time is the prefill's), or ``None`` with fewer than 2 tokens.
    """
    toks, t_first, t_last = [], None, None
    for item in gen:
        tok = int(item[0])
        t_last = time.perf_counter()
        if t_first is None:
            t_first = t_last
        toks.append(tok)
        if tok in stop_ids:
            break
    if hasattr(gen, "close"):
        gen.close()
    n = len(toks)
    return {"tokens": toks, "tps": (n - 1) / (t_last - t_first) if n > 1 and t_last > t_first else None}


def device_meta() -> dict:
    """MLX / mlx-lm versions, the device, and the CUDA switches the package sets."""
    import os

    info = {"mlx": mx.__version__, "device": str(mx.default_device()), "python": sys.version.split()[0],
            "date": time.strftime("%Y-%m-%d %H:%M")}
    try:
        import mlx_lm

        info["mlx_lm"] = mlx_lm.__version__
    except Exception:  # pragma: no cover
        pass
    from mlx_dflash2.kernels import backend

    info["kernel_backend"] = backend()
    home = os.path.expanduser("~")
    for k in ("MLX_CUDA_USE_CUDNN_SDPA", "MLX_PTX_CACHE_DIR", "MLX_DFLASH2_KERNELS"):
        v = os.environ.get(k)  # no machine paths in results: the home directory as "~"
        info[k] = "~" + v[len(home):] if v and home not in ("", "/") and v.startswith(home + "/") else v
    try:
        info["device_info"] = {k: (v if isinstance(v, (int, float, str)) else str(v))
                               for k, v in mx.device_info().items()}
    except Exception:
        pass
    return info
