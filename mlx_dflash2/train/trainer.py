"""Train or fine-tune a DFlash / DFlash2 drafter in MLX.

Recipe (DFlash2 spec §3 and §5.8; DFlash paper §3.3; SpecForge
``dflash_family_model.py``):

* frozen target, features on the fly: every step runs the target over the
  batch's sequences (prompt + target-regenerated response) with taps at
  ``target_layer_ids`` (no feature dumps; the target runs from whatever weights
  it was loaded with, e.g. 4-bit);
* random anchors: up to ``anchors`` positions per sequence inside the response
  (the anchor and its next token both supervised), re-sampled every step;
  each anchor starts a block ``[token, mask x (B-1)]``; all blocks of a batch go
  through one drafter forward with the block attention mask (a block sees the
  context strictly before its anchor and its own block);
* loss: cross-entropy of block positions k = 1..B-1 against the next tokens,
  weighted ``exp(-(k-1)/gamma)`` (gamma 7 for B=16, 5 for B=10, 4 for B=8);
  DFlash2 adds the selector loss: categorical CE over the top-K unary
  candidates of each position, with the gold previous token as predecessor,
  positions whose gold token is not among the candidates excluded;
* AdamW, linear warmup + cosine decay, gradient clipping; the embedding and LM
  head are the target's and stay frozen (they are not drafter parameters).

Options beyond the published recipe (off by default):

* ``labels="target"``: the label of block position k is the target's own
  greedy choice after the data prefix (argmax of its logits at ``anchor+k-1``)
  instead of the data token. On greedy target-generated data the two agree
  (up to near-ties between weight formats). On sampled responses it is the
  token a greedy verify accepts at position 1, and at k >= 2 the greedy choice
  after the *data's* tokens, so the block's labels are only a greedy path
  where the data follows it.
* ``kd_weight > 0``: adds soft knowledge distillation, the cross-entropy of the
  drafter's unary distribution against the target's full distribution at the
  same position, with the same position weights (DistillSpec, Zhou et al.
  2024, §3: forward KL). Both need the target's logits at the label positions,
  from the same frozen forward that gives the context features.
* ``draft_vocab``: the drafter is trained on a draft vocabulary, the ids it will
  propose from (FR-Spec, Zhao et al. 2025, arXiv 2502.14856; EAGLE-3, Li et al.
  2025, §3, trains its drafter on such a reduced vocabulary): its logits, the
  teacher's distribution (renormalized over the set) and the selector's top-K
  are computed over those rows of the LM head only (Qwen2.5's 151,936 -> 32,768:
  the vocabulary-sized part of a step about 4.6x smaller). A label outside the
  set gets no cross-entropy (the drafter cannot propose it) and counts as a miss
  in the accuracies; ``labels="target"`` takes the teacher's argmax over the whole
  vocabulary (one forward of the head, no backward). The set is written into the
  checkpoints' and the final drafter's ``draft_vocab.json``, so the product
  drafts from what the drafter was trained on.
* ``selector_fraction < 1``: the selector loss over every s-th block,
  ``s = round(1 / selector_fraction)`` (its top-K over the vocabulary is the
  costly part of a DFlash2 step).

The LM head runs in the target's dtype (bf16 on a GPU: near-ties among the
drafter's logits may then order differently than in float32), the loss in
float32. ``compute_dtype`` (``fit --compute-dtype bfloat16``, off by default):
mixed precision, the drafter's forward and backward in that dtype over a cast
of its float32 master weights, whose gradients and AdamW update stay float32
(:func:`value_and_grad_in`; Micikevicius et al. 2018, "Mixed Precision
Training", arXiv:1710.03740, without loss scaling, which bfloat16's float32
exponent range does not need).

Memory: the loss's vocabulary-sized part (the drafter's and the teacher's
logits, softmax, cross-entropy, distillation, top-1 hits, the selector's top-K
candidates and their logits) is one function of rows of block positions
(``_vocab_terms``). With ``loss_chunk`` (``fit --loss-chunk ROWS``) it runs a
chunk of rows at a time in forward and backward (a custom vjp recomputes each
chunk's logits; ``_chunked_vocab_terms`` says how MLX is made to evaluate the
chunks in turn): the same results, and a peak of a few chunks' ``[rows, V]``
arrays instead of about six ``[M, B-1, V]`` float32 arrays (Qwen2.5's V of
151,936 at 8 sequences x 64 anchors x 15 positions: 4.7 GB each). Default
(auto): chunks of 256 MiB of logits once the step's ``rows x V`` float32
logits would exceed 1 GiB, one shot below that. The teacher's logits are made
from its final states chunk by chunk too (``Trainer.teacher_states``), never
all at once. Sequences longer than ``max_len`` lose prompt tokens after the first
32 (the chat template's head stays) or, where the prompt is too short for
that, their end.

Determinism: the data order of epoch ``e`` is a permutation seeded by
``seed + e`` and the anchors of step ``s`` by ``(seed, s)``, so a run resumed
from a checkpoint (drafter, optimizer state, step) continues exactly as an
uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..drafter import DrafterConfig, DraftModel, dequantize_drafter, init_drafter, load_drafter, save_drafter
from ..drafter.model import top_k_ids

__all__ = ["TrainConfig", "Trainer", "TimeBudgetError", "DraftVocab", "dflash_loss", "make_batch", "default_gamma",
           "device_defaults", "resolve_device_defaults", "loss_chunk_rows", "value_and_grad_in", "COMPUTE_DTYPES",
           "FIELD_RANGES", "in_range", "range_text", "make_update"]


#: ranges of TrainConfig's numeric fields: name -> (int or float, low (>=), above (>), high (<=)); None: no bound.
#: The fit CLI's parser and :meth:`Trainer.__init__` check the same (a finite number in range; None where allowed).
FIELD_RANGES = {
    "num_layers": (int, 1, None, None), "num_taps": (int, 1, None, None), "block_size": (int, 2, None, None),
    "intermediate_size": (int, 1, None, None), "selector_rank": (int, 1, None, None),
    "selector_top_k": (int, 1, None, None), "anchors": (int, 1, None, None), "batch_size": (int, 1, None, None),
    "max_len": (int, 1, None, None), "steps": (int, 1, None, None), "epochs": (float, None, 0, None),
    "lr": (float, None, 0, None), "warmup": (float, 0, None, 0.5), "min_lr_ratio": (float, 0, None, 1),
    "weight_decay": (float, 0, None, None), "grad_clip": (float, None, 0, None), "gamma": (float, None, 0, None),
    "selector_alpha": (float, 0, None, None), "kd_weight": (float, 0, None, None),
    "selector_fraction": (float, None, 0, 1), "seed": (int, 0, None, 2**32 - 1), "save_every": (int, 1, None, None),
    "log_every": (int, 1, None, None), "keep_checkpoints": (int, 1, None, None),
    "time_budget": (float, None, 0, None), "loss_chunk": (int, 0, None, None), "pad_multiple": (int, 1, None, None),
}


def range_text(kind, low, above, high) -> str:
    """``"an integer >= 1"``, ``"a number > 0 and <= 1"``: a :data:`FIELD_RANGES` entry in words."""
    want = " and ".join([f">= {low}"] * (low is not None) + [f"> {above}"] * (above is not None)
                        + [f"<= {high}"] * (high is not None))
    return ("an integer" if kind is int else "a number") + (f" {want}" if want else "")


def in_range(v, kind, low, above, high) -> bool:
    """Whether ``v`` is a finite ``kind`` number within a :data:`FIELD_RANGES` entry's bounds."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        return False
    return (math.isfinite(v) and (low is None or v >= low) and (above is None or v > above)
            and (high is None or v <= high))


def make_update(model: nn.Module, optimizer: optim.Optimizer, grad_clip: float, compiled: bool = True) -> Callable:
    """The update of a training step: ``update(grads) -> norm`` clips ``grads`` (a tree like ``model``'s trainable
    parameters) to global norm ``grad_clip``, applies ``optimizer`` to ``model`` in place and returns the norm
    before clipping (a float32 scalar array, unevaluated).

    ``compiled``: an ``mx.compile``d function over ``model``'s and ``optimizer``'s state (MLX's pattern for
    training steps): one fused pass per weight instead of ~16 elementwise ones over each weight, its gradient and
    its two moments (AdamW at 105 M weights: ~17 GB of memory traffic per step unfused; 1.0-1.4 s -> 0.61-0.68 s
    on a 2-core CPU, the same values there). Initializes ``optimizer`` first (a no-op for a resumed state).
    """
    optimizer.init(model.trainable_parameters())

    def apply(grads):
        grads, norm = optim.clip_grad_norm(grads, grad_clip)
        optimizer.update(model, grads)
        return norm

    state = [model.state, optimizer.state]
    return mx.compile(apply, inputs=state, outputs=state) if compiled else apply


COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
"""Values of :attr:`TrainConfig.compute_dtype` (``None``: the weights' own dtype, float32)."""


def value_and_grad_in(model: nn.Module, fn: Callable, compute_dtype: str | mx.Dtype | None = None) -> Callable:
    """``nn.value_and_grad(model, fn)`` with the forward and backward in ``compute_dtype`` (mixed precision).

    The returned function calls ``fn(*args)`` with ``model``'s floating-point trainable parameters cast to
    ``compute_dtype`` and returns ``(fn's value, grads)``, the gradients with respect to the parameters as they
    were (float32 master weights: float32 gradients, the cast's vjp casting back), and leaves ``model`` holding
    those original parameters again. Activations follow the weights' dtype, so a float32 input meeting a
    bfloat16 weight still promotes to float32: the caller casts the inputs it wants in ``compute_dtype``
    (``dflash_loss``'s inputs are the target's embeddings and features, in its dtype: bfloat16 on a GPU).
    ``compute_dtype``: an MLX dtype or its name (:data:`COMPUTE_DTYPES`); ``None`` or float32: exactly
    ``nn.value_and_grad(model, fn)``.

    Source: mixed-precision training (Micikevicius et al. 2018, arXiv:1710.03740), without loss scaling.
    """
    if isinstance(compute_dtype, str):
        compute_dtype = getattr(mx, compute_dtype)
    if compute_dtype is None or compute_dtype == mx.float32:
        return nn.value_and_grad(model, fn)

    def cast(p):
        return p.astype(compute_dtype) if mx.issubdtype(p.dtype, mx.floating) else p

    def inner(params, *args, **kwargs):
        model.update(tree_map(cast, params))
        return fn(*args, **kwargs)

    vg = mx.value_and_grad(inner)

    def wrapped(*args, **kwargs):
        params = model.trainable_parameters()
        try:
            return vg(params, *args, **kwargs)
        finally:
            model.update(params)

    return wrapped


def default_gamma(block_size: int) -> float:
    """Loss-decay gamma of the DFlash paper: 7 (B=16), 5 (B=10), 4 (B=8); interpolated otherwise."""
    table = {16: 7.0, 10: 5.0, 8: 4.0}
    return table.get(block_size, max(1.0, 7.0 * block_size / 16))


NEW_DRAFTER = {"num_layers": 3, "selector_rank": 32, "selector_top_k": 16}
"""Shape of a new drafter where the config leaves it open (``None``)."""

GPU_DEFAULTS = {"batch_size": 16, "anchors": 64, "max_len": 768}
"""Batch shape on a GPU (Metal, CUDA) where the config leaves it open: the H200 recipe's
(``benchmarks/gpu/train_smollm2.sh``)."""

CPU_DEFAULTS = {"batch_size": 2, "anchors": 16, "max_len": 256}
"""Batch shape on MLX's CPU backend where the config leaves it open: a step of the embedded
SmolLM2-135M target (dense float32) with the shipped drafter's shape takes seconds on 2 cores
(the GPU shape takes minutes and gigabytes there)."""


def device_defaults(device: mx.Device | None = None) -> dict:
    """The batch shape (``batch_size``, ``anchors``, ``max_len``) used where a
    :class:`TrainConfig` leaves it ``None``: :data:`CPU_DEFAULTS` on MLX's CPU backend,
    :data:`GPU_DEFAULTS` otherwise. ``device``: default ``mx.default_device()``."""
    device = mx.default_device() if device is None else device
    return dict(CPU_DEFAULTS if device == mx.cpu else GPU_DEFAULTS)


def resolve_device_defaults(cfg: "TrainConfig", device: mx.Device | None = None) -> dict:
    """Fill the batch-shape fields of ``cfg`` that are ``None`` with :func:`device_defaults`.

    Returns:
        The values filled in (empty when ``cfg`` gave them all).
    """
    chosen = {k: v for k, v in device_defaults(device).items() if getattr(cfg, k) is None}
    for k, v in chosen.items():
        setattr(cfg, k, v)
    return chosen


SIZING_STEPS = 4
"""A run sized by its time budget re-sizes after each of its first steps (the first one carries
start-up costs, e.g. kernel compilation on a GPU) and on through its LR warm-up or the first
:data:`SIZING_FRACTION` of its steps, whichever is longer."""
SIZING_FRACTION = 0.25
SIZING_MARGIN = 0.97
"""Fraction of the remaining budget a sized run plans steps for (the deadline stops it anyway)."""
SAVE_RATE = 100e6
"""Bytes/s assumed for writing checkpoints until this run has measured a save."""
SAVE_OVERHEAD_S = 0.2
"""Seconds added to every save estimate (files, renames, old checkpoints removed)."""


class TimeBudgetError(ValueError):
    """The time budget ended before one training step (and its checkpoint) could be done.

    Nothing was written: a new run leaves no run directory, a resumed one leaves its
    directory as it was (still resumable)."""


@dataclass
class TrainConfig:
    """Training settings (saved as ``config.json`` in the run directory).

    ``batch_size`` (sequences per step), ``anchors`` (blocks per sequence) and
    ``max_len`` (tokens per sequence) left ``None`` take the device's defaults
    (:func:`device_defaults`: 16 / 64 / 768 on a GPU, 2 / 16 / 256 on MLX's CPU
    backend) when the :class:`Trainer` is made. ``time_budget`` is in seconds of
    wall time, counted from the Trainer's ``started`` time.
    """

    data: str = ""
    out: str = ""
    init: str | None = None
    architecture: str = "DFlash2DraftModel"
    num_layers: int | None = None  # None: NEW_DRAFTER's value for a new drafter, the --init drafter's otherwise
    num_taps: int | None = None
    target_layer_ids: list | None = None
    block_size: int = 16
    intermediate_size: int | None = None
    selector_rank: int | None = None  # (the same for these two)
    selector_top_k: int | None = None
    anchors: int | None = None  # None: device_defaults()
    batch_size: int | None = None
    max_len: int | None = None
    steps: int | None = None
    epochs: float = 3.0
    lr: float = 6e-4
    warmup: float = 0.04
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None
    selector_alpha: float = 1.0
    labels: str = "data"
    kd_weight: float = 0.0
    selector_fraction: float = 1.0
    seed: int = 0
    save_every: int = 200
    log_every: int = 10
    keep_checkpoints: int = 2
    time_budget: float | None = None
    compile: bool = False
    loss_chunk: int | None = None  # rows per chunk of the loss's vocabulary part: None auto, 0 one shot
    draft_vocab: str | None = None  # "N": the data's N most frequent ids; a path; "full"; None: init's, else full
    compute_dtype: str | None = None  # mixed precision (COMPUTE_DTYPES); None: the float32 weights' own
    pad_multiple: int = 64  # a batch's length is padded up to a multiple of this (fewer lengths: fewer traces)
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------
# Batches and loss
# ----------------------------------------------------------------------------


def make_batch(rows: list[dict], step: int, cfg: TrainConfig, pad_id: int) -> dict:
    """Token, anchor and label arrays for one step (numpy, deterministic in ``(seed, step)``).

    ``cfg.anchors`` / ``cfg.max_len`` left ``None`` mean :func:`device_defaults`. The batch's length ``T`` is its
    longest sequence rounded up to a multiple of ``cfg.pad_multiple`` (at least one multiple): every batch of a run
    has one of ``ceil(max_len / pad_multiple)`` lengths, each a new trace of a compiled step (``--compile``); a
    ``pad_multiple`` above ``max_len`` counts as ``max_len`` (one length). Padding sits after every sequence's end,
    where no block's context or label reaches.

    Returns:
        ``tokens [N, T]``, ``anchors [N, A]``, ``labels [N, A, B-1]``,
        ``label_valid [N, A, B-1]`` (bool) and ``n_tokens``.
    """
    rng = np.random.RandomState((cfg.seed * 1_000_003 + step) % (2**32))
    dd = device_defaults() if cfg.anchors is None or cfg.max_len is None else {}
    B, A = cfg.block_size, cfg.anchors or dd["anchors"]
    max_len = cfg.max_len or dd["max_len"]
    seqs, plens = [], []
    for r in rows:
        ids, plen = list(r["prompt_ids"]) + list(r["response_ids"]), len(r["prompt_ids"])
        over = len(ids) - max_len
        head = min(32, plen)
        if 0 < over <= plen - head:  # drop prompt tokens after a 32-token head (BOS, system part)
            ids, plen = ids[:head] + ids[head + over :], plen - over
        ids = ids[:max_len]  # otherwise keep the prompt and cut the end
        seqs.append(ids)
        plens.append(min(plen, len(ids)))
    pm = min(cfg.pad_multiple, max_len)  # a larger multiple: max_len, the longest a sequence is (one length)
    T = max(pm, int(math.ceil(max(len(s) for s in seqs) / pm) * pm))
    N = len(seqs)
    tokens = np.full((N, T), pad_id, dtype=np.int32)
    anchors = np.zeros((N, A), dtype=np.int32)
    anchor_ok = np.zeros((N, A), dtype=bool)
    for n, (s, p) in enumerate(zip(seqs, plens)):
        tokens[n, : len(s)] = s
        cands = np.arange(max(p, 1), len(s) - 1)  # anchor and its next token are response tokens
        if len(cands) == 0:
            anchors[n] = max(0, len(s) - 1)
            continue
        k = min(A, len(cands))
        pick = np.sort(rng.choice(cands, size=k, replace=False))
        anchors[n, :k] = pick
        anchors[n, k:] = pick[0]
        anchor_ok[n, :k] = True
    lengths = np.array([len(s) for s in seqs])
    pos = anchors[..., None] + np.arange(1, B)[None, None, :]  # [N, A, B-1]
    label_valid = anchor_ok[..., None] & (pos < lengths[:, None, None])
    labels = np.take_along_axis(tokens, np.minimum(pos, T - 1).reshape(N, -1), axis=1).reshape(N, A, B - 1)
    return {
        "tokens": tokens,
        "anchors": anchors,
        "labels": labels,
        "label_valid": label_valid,
        "n_tokens": int(lengths.sum()),
    }


def _mask_vocab(logits: mx.array, valid_vocab: int | None) -> mx.array:
    """Logits of ids ``>= valid_vocab`` (LM-head padding rows) set to -1e9 (-6e4 in half precision)."""
    if valid_vocab is None or valid_vocab >= logits.shape[-1]:
        return logits
    neg = mx.array(-1e9 if logits.dtype == mx.float32 else -6e4, logits.dtype)
    return mx.where(mx.arange(logits.shape[-1]) < valid_vocab, logits, neg)


LOSS_CHUNK_BYTES = 1 << 30
"""``loss_chunk`` auto (``None``): the vocabulary-sized part of :func:`dflash_loss` is chunked once the
step's ``rows x V`` float32 logits would be larger than this (one shot below it, as before chunking)."""

LOSS_CHUNK_AUTO_BYTES = 1 << 28
"""``loss_chunk`` auto: the chunk's ``rows x V`` float32 logits, when chunked (441 rows of Qwen2.5's
151,936-wide head). The loss and its gradient then keep about 6 such arrays alive, and up to about 16
where the backend's encoding runs ahead of its computation (measured on the CPU, see
:func:`_chunked_vocab_terms`): ~1.5-4 GiB, against ~6 ``[rows, V]`` float32 arrays in one shot."""


def loss_chunk_rows(rows: int, vocab: int, loss_chunk: int | None = None) -> int:
    """Rows per chunk of the vocabulary-sized part of :func:`dflash_loss`.

    Args:
        rows: supervised rows of the step (blocks x (B-1)).
        vocab: width V of the LM head.
        loss_chunk: ``None`` (auto): all rows while ``rows x V`` float32 logits fit in
            :data:`LOSS_CHUNK_BYTES`, else chunks of :data:`LOSS_CHUNK_AUTO_BYTES`; ``0``: all rows;
            ``n > 0``: ``n`` rows.

    Returns:
        Rows per chunk, in ``[1, rows]`` (``rows``: the single-shot path).

    Raises:
        ValueError: ``loss_chunk < 0``.
    """
    if loss_chunk is None:
        if rows * vocab * 4 <= LOSS_CHUNK_BYTES:
            return rows
        return max(1, min(rows, LOSS_CHUNK_AUTO_BYTES // (4 * vocab)))
    if loss_chunk < 0:
        raise ValueError(f"loss_chunk must be >= 0 rows (0: no chunking), not {loss_chunk}")
    return rows if loss_chunk == 0 else max(1, min(loss_chunk, rows))


@dataclass(frozen=True)
class DraftVocab:
    """A draft vocabulary for training: the ids the drafter is trained (and will draft) on.

    Attributes:
        ids: int32 ``[Vd]``, ascending, each below the tokenizer's size.
        pos: int32 ``[vocab_rows]``: the position of an id in ``ids``, -1 for ids outside.
        head: the target's LM head on those rows (:meth:`~mlx_dflash2.target.TargetAdapter.head_rows`):
            ``[..., D] -> [..., Vd]``, the columns ``ids`` of :meth:`~mlx_dflash2.target.TargetAdapter.lm_head`.
        info: how the set was chosen (written into ``draft_vocab.json`` beside the ids).
    """

    ids: mx.array
    pos: mx.array
    head: Callable[[mx.array], mx.array]
    info: dict

    @classmethod
    def build(cls, target, ids, valid_vocab: int, info: dict | None = None) -> "DraftVocab":
        """Check ``ids`` (:func:`~mlx_dflash2.proposers.check_vocab_ids`: ids in ``[valid_vocab, vocab_rows)``
        dropped) and gather the head's rows.

        Raises:
            ValueError: an id outside the target's vocabulary, or fewer than 2 usable ids."""
        from ..proposers import check_vocab_ids

        kept = check_vocab_ids(ids, valid_vocab, target.vocab_rows)
        a = mx.array(kept, dtype=mx.int32)
        pos = mx.full((target.vocab_rows,), -1, dtype=mx.int32)
        pos[a] = mx.arange(len(kept), dtype=mx.int32)
        mx.eval(a, pos)
        return cls(a, pos, target.head_rows(a), dict(info or {}))

    @property
    def size(self) -> int:
        return int(self.ids.size)


def _teacher_argmax(target, teacher: mx.array, valid_vocab: int | None, chunk: int) -> mx.array:
    """The target's greedy ids (argmax over its whole vocabulary, ids ``>= valid_vocab`` excluded) at the
    rows ``teacher`` ``[R, D]`` (final-normed states): int32 ``[R]``, no gradient, ``chunk`` rows at a
    time in turn (:func:`_after`), so no more than a chunk's ``[rows, V]`` logits are alive."""
    out, prev = [], []
    for a in range(0, teacher.shape[0], chunk):
        (x,) = _after([teacher[a:a + chunk]], prev)
        am = mx.argmax(_mask_vocab(target.logits(x), valid_vocab), axis=-1).astype(mx.int32)
        out.append(am)
        prev = [am]
    return mx.stop_gradient(mx.concatenate(out) if len(out) > 1 else out[0])


@dataclass(frozen=True)
class _VocabSpec:
    """What the vocabulary-sized part of :func:`dflash_loss` computes, per row of the flattened block
    positions (row ``i``: block ``i // block``, position ``i % block + 1``).

    Attributes:
        logits: drafter states ``[r, D]`` float32 -> the drafter's logits ``[r, V]`` float32 (the target's
            LM head in its dtype, ``unary_logits``' multiplier / softcap, ids ``>= valid_vocab`` at -1e9).
        teacher: target final-normed states ``[r, D]`` -> the target's logits ``[r, V]`` float32 (masked
            as :meth:`Trainer.teacher_logits`), or None (no teacher).
        kd: compute the distillation cross-entropy (needs ``teacher``).
        top_k: selector candidates K per selected row (0: no candidates).
        block: rows per block (B-1).
        stride: the selector's block stride: rows of blocks ``b % stride == 0`` are selected.
    """

    logits: Callable[[mx.array], mx.array]
    teacher: Callable[[mx.array], mx.array] | None
    kd: bool
    top_k: int
    block: int
    stride: int

    def selected(self, start: int, stop: int) -> np.ndarray | None:
        """Local indices of the selector's rows among rows ``start .. stop-1`` (None: all of them)."""
        if self.stride == 1:
            return None
        rows = np.arange(start, stop)
        return (rows[(rows // self.block) % self.stride == 0] - start).astype(np.int32)


def _vocab_terms(spec: _VocabSpec, h: mx.array, teacher: mx.array | None, labels: mx.array | None, start: int,
                 cand: mx.array | None = None) -> dict:
    """The vocabulary-sized terms of rows ``start .. start+r-1``: all rows (the single-shot path) or one
    chunk of :func:`_chunked_vocab_terms`, whose vjp differentiates this same function. Only the rows'
    ``[r, V]`` arrays are made here (lazily: terms nobody uses are never computed).

    Args:
        spec: what to compute.
        h: ``[r, D]`` float32 drafter states of these rows (differentiable).
        teacher: ``[r, D]`` target final-normed states at these rows' label positions (for
            ``spec.teacher``), else None.
        labels: int ``[r]`` labels; None: the teacher's argmax (``labels="target"``).
        start: index of the first row (the selector's rows are chosen by block index).
        cand: int ``[r_s, K]`` candidates of the selected rows (the vjp passes the forward's); None: top-K
            of the logits.

    Returns:
        ``ce`` float32 ``[r]``: ``logsumexp(logits) - logits[label]``; ``top1`` uint32 ``[r]``: the
        drafter's argmax; ``labels`` int32 ``[r]``: the teacher's argmax (only when ``labels`` is None);
        ``kd`` float32 ``[r]`` (``spec.kd``): ``logsumexp(logits) - sum_v p_teacher(v) logits(v)``;
        with ``spec.top_k`` and selected rows among these: ``cand`` int ``[r_s, K]`` (no gradient) and
        ``cand_logits`` float32 ``[r_s, K]``, the selected rows' top-K ids and their logits.
    """
    logits = spec.logits(h)
    t = None if teacher is None else mx.stop_gradient(spec.teacher(teacher))
    out = {}
    if labels is None:
        labels = out["labels"] = mx.argmax(t, axis=-1).astype(mx.int32)
    lse = mx.logsumexp(logits, axis=-1)
    out["ce"] = lse - mx.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    out["top1"] = mx.argmax(logits, axis=-1)
    if spec.kd:
        out["kd"] = lse - (mx.softmax(t, axis=-1) * logits).sum(-1)  # -sum_v p_target(v) log q(v)
    sel = spec.selected(start, start + h.shape[0]) if spec.top_k else np.zeros(0)
    if sel is None or len(sel):
        ls = logits if sel is None else logits[mx.array(sel)]
        if cand is None:  # a copy: the slice of argpartition's [r, V] ids would keep all of them alive
            cand = mx.stop_gradient(mx.contiguous(top_k_ids(ls, spec.top_k)))
        out["cand"], out["cand_logits"] = cand, mx.take_along_axis(ls, cand, axis=-1)
    return out


_DIFFERENTIABLE = ("ce", "kd", "cand_logits")


def _after(arrays: list, deps: list) -> list:
    """``arrays`` (None entries kept) made to depend on ``deps`` (:func:`mx.depends`): they, and so
    everything computed from them, are evaluated only after ``deps``."""
    if not deps:
        return arrays
    real = [a for a in arrays if a is not None]
    tied = iter(mx.depends(real, deps))
    return [None if a is None else next(tied) for a in arrays]


def _chunked_vocab_terms(spec: _VocabSpec, h: mx.array, teacher: mx.array | None, labels: mx.array | None,
                         chunk: int) -> dict:
    """:func:`_vocab_terms` of all rows, ``chunk`` rows at a time in forward and backward, as one
    ``mx.custom_function`` of ``h`` whose vjp recomputes each chunk's logits and differentiates
    :func:`_vocab_terms` on that chunk alone (``mx.vjp``): no ``[rows, V]`` array, and no array the
    backward keeps from the forward, is larger than a chunk's. The LM head and the teacher are frozen:
    the only cotangent is ``h``'s.

    How MLX evaluates this (0.32.4, measured on its CPU backend; ``tests/test_train_loss_chunk.py``
    checks the ratio):

    * Chunks that are independent in one lazy graph are *not* evaluated one after another:
      ``mx.eval`` orders its tape breadth-first (``MLX_BFS_MAX_WIDTH``, default 20), so the chunks'
      matmuls run side by side and their logits are alive together. Loss + gradients over 1,920 rows
      (V = 16,384, distillation, target labels, selector) peaked at 754 MiB in one shot and, in chunks
      of 64 rows without ordering, at 373 MiB.
    * So each chunk's inputs (``h``'s and the teacher's rows) depend on the previous chunk's results
      through :func:`mx.depends` (the first backward chunk on the forward's outputs): the tape is then
      chunk after chunk, and a chunk's ``[r, V]`` arrays are freed once its reductions ran (91 MiB).
    * What remains is the backend encoding ahead of the computation: an op's output is allocated when
      the op is encoded (on the CPU up to 10 tasks of 10 ops are in flight; on a GPU, command buffers),
      so besides the ~6 ``[r, V]`` arrays of the chunk being computed those of the next one or two are
      alive: about 16 in all. With V = 151,936, hidden 64, distillation, target labels and selector,
      3,840 rows peaked at 13.2 GiB in one shot, 2.3 GiB in chunks of 256 rows, 3.9 GiB in chunks of
      441 (:data:`LOSS_CHUNK_AUTO_BYTES`; 7,680 rows: 4.1 GiB) and 11.0 GiB in 3 chunks of 1,766.
      MLX stops encoding while active memory is above ``mx.set_memory_limit``'s limit (95% of the
      device on CUDA), which this tape can honour and the one-shot graph cannot (V = 32,768, 1,920
      rows, a 50 MiB limit: chunks of 64 rows peaked at 81 MiB, one shot at 1,481 MiB).
    * Evaluating chunk by chunk with ``mx.eval`` would bound it exactly but cannot run inside
      ``mx.compile``; this graph compiles (tested: a compiled chunked step equals the eager one), and
      the ordering holds there (the 1,920 rows above, compiled: 991 MiB in one shot, 99 MiB chunked).
    * ``cand`` is copied out of the selection's ids (:func:`top_k_ids`; a slice of one ``argpartition``'s
      ``[r, V]`` ids kept all of them alive).

    Args:
        spec, teacher, labels: as :func:`_vocab_terms` (all rows).
        h: ``[R, D]`` float32 drafter states of all rows.
        chunk: rows per chunk (``1 <= chunk < R``; the last chunk may be shorter).

    Returns:
        :func:`_vocab_terms`' arrays for all rows (row order; ``cand`` / ``cand_logits`` over all
        selected rows in row order), equal to the single-shot ones.
    """
    R = h.shape[0]
    bounds = [(a, min(a + chunk, R)) for a in range(0, R, chunk)]
    # the chunks' first rows among the selector's rows (candidates are concatenated in row order)
    n_sel = [0 if not spec.top_k else b - a if spec.stride == 1 else len(spec.selected(a, b)) for a, b in bounds]
    sel_at = [0, *np.cumsum(n_sel).tolist()]
    keys = ["ce", "top1"] + (["labels"] if labels is None else []) + (["kd"] if spec.kd else [])
    keys += ["cand", "cand_logits"] if sel_at[-1] else []

    @mx.custom_function
    def terms(h):
        parts, prev = [], []
        for a, b in bounds:
            hc, tc = _after([h[a:b], None if teacher is None else teacher[a:b]], prev)
            part = _vocab_terms(spec, hc, tc, None if labels is None else labels[a:b], a)
            parts.append(part)
            prev = list(part.values())
        return tuple(mx.concatenate([p[k] for p in parts if k in p]) for k in keys)

    @terms.vjp
    def terms_vjp(primals, cotangents, outputs):
        h = primals if isinstance(primals, mx.array) else primals[0]
        cot, res = dict(zip(keys, cotangents)), dict(zip(keys, outputs))
        grads, prev = [], list(outputs)
        for i, (a, b) in enumerate(bounds):
            sa, sb = sel_at[i], sel_at[i + 1]
            ks = [k for k in _DIFFERENTIABLE if k in res and (k != "cand_logits" or sb > sa)]
            cts = [cot[k][sa:sb] if k == "cand_logits" else cot[k][a:b] for k in ks]
            hc, tc = _after([h[a:b], None if teacher is None else teacher[a:b]], prev)
            lab = res["labels"][a:b] if labels is None else labels[a:b]
            cand = res["cand"][sa:sb] if sb > sa else None

            def f(x, tc=tc, lab=lab, cand=cand, a=a, ks=ks):
                part = _vocab_terms(spec, x, tc, lab, a, cand)
                return [part[k] for k in ks]

            _, (g,) = mx.vjp(f, [hc], cts)
            grads.append(g)
            prev = [g]
        return mx.concatenate(grads)

    # the integer outputs carry no gradient (an index array that does is refused by gather's vjp)
    return {k: v if k in _DIFFERENTIABLE else mx.stop_gradient(v) for k, v in zip(keys, terms(h))}


def dflash_loss(drafter: DraftModel, target, features, tokens, anchors, labels, label_valid, weights, alpha,
                valid_vocab: int | None = None, teacher_states=None, kd_weight: float = 0.0,
                selector_fraction: float = 1.0, target_labels: bool = False, loss_chunk: int | None = None,
                draft_vocab: DraftVocab | None = None):
    """DFlash block loss (+ DFlash2 selector loss, + optional distillation / target labels / draft vocabulary).

    The part over the vocabulary (the drafter's logits, the teacher's logits and softmax, cross-entropy,
    distillation, top-1 hits, the selector's top-K candidates and their logits) is one function of
    rows (:func:`_vocab_terms`), run on all ``M*(B-1)`` rows at once or, for a large ``rows x V``, on
    chunks of rows in forward and backward (:func:`_chunked_vocab_terms`): peak memory bounded by a
    few chunks instead of several ``[M, B-1, V]`` float32 arrays, equal results.

    Args:
        drafter: the model being trained.
        target: :class:`~mlx_dflash2.target.TargetAdapter` (frozen embedding / LM head).
        features: ``[N, T, k*D]`` target taps (no gradient).
        tokens: int ``[N, T]``; anchors: int ``[N, A]``; labels: int ``[N, A, B-1]`` (with
        ``target_labels`` only their shape is used); label_valid: bool ``[N, A, B-1]``;
        weights: float ``[B-1]`` position weights; alpha: selector-loss weight (DFlash2 only).
        valid_vocab: ids ``>=`` this are excluded from the softmax.
        teacher_states: ``[N*A, B-1, D]`` the target's final-normed states at the label positions
            (:meth:`Trainer.teacher_states`; the teacher's logits are made from them chunk by chunk),
            needed for ``kd_weight > 0`` and ``target_labels``.
        kd_weight: weight of the distillation term (see the module doc).
        selector_fraction: fraction of the blocks (strided) in the selector loss.
        target_labels: the labels are the teacher's argmax (``labels="target"``).
        loss_chunk: rows per chunk of the vocabulary part (:func:`loss_chunk_rows`: None auto, 0 one shot).
        draft_vocab: train on these ids only (see the module doc): logits, teacher distribution and
            candidates over ``draft_vocab.ids``; labels outside get no cross-entropy and count as misses.

    Returns:
        ``(loss, metrics)``: scalar loss; metrics ``main``, ``selector``,
        ``acc`` ``[B-1]`` (unary top-1 accuracy by position, with its
        ``count``), ``kd`` (distillation cross-entropy, with ``kd_weight``),
        ``sel_acc``/``recall``/``sel_count`` (selector accuracy, top-K recall,
        blocks counted).
    """
    cfg = drafter.config
    N, A = anchors.shape
    Bm1 = labels.shape[-1]
    M = N * A
    if (kd_weight > 0 or target_labels) and teacher_states is None:
        raise ValueError("kd_weight > 0 and target_labels need teacher_states")
    anchor_tok = mx.take_along_axis(tokens, anchors, axis=1)  # [N, A]
    block = mx.concatenate([anchor_tok[..., None], mx.full((N, A, Bm1), cfg.mask_token_id, dtype=tokens.dtype)], -1)
    emb = mx.stop_gradient(target.embed(block.reshape(M, Bm1 + 1)))
    if cfg.input_embedding_scale != 1.0:
        emb = emb * cfg.input_embedding_scale
    wdt = drafter.fc.weight.dtype  # the drafter computes in its weights' dtype (float32; mixed precision: theirs)
    h = drafter.forward_blocks(emb.astype(wdt), mx.stop_gradient(features).astype(wdt), anchors)[:, 1:]  # [M, B-1, D]
    selector_on = cfg.is_dflash2 and (isinstance(alpha, mx.array) or alpha > 0)  # an array: a compiled step's
    stride = max(1, int(round(1.0 / selector_fraction)))
    dv = draft_vocab
    if dv is None:
        V = target.vocab_rows
        spec = _VocabSpec(
            logits=lambda x: _mask_vocab(
                drafter.unary_logits(x.astype(target.dtype), target.lm_head).astype(mx.float32), valid_vocab),
            teacher=lambda s: _mask_vocab(target.logits(s), valid_vocab).astype(mx.float32),
            kd=kd_weight > 0, top_k=min(drafter.candidate_selector.top_k, V) if selector_on else 0, block=Bm1,
            stride=stride)
    else:  # the head's rows of the draft vocabulary, for the drafter and the teacher alike
        V = dv.size
        spec = _VocabSpec(
            logits=lambda x: drafter.unary_logits(x.astype(target.dtype), dv.head).astype(mx.float32),
            teacher=lambda s: dv.head(s).astype(mx.float32),
            kd=kd_weight > 0, top_k=min(drafter.candidate_selector.top_k, V) if selector_on else 0, block=Bm1,
            stride=stride)
    R = M * Bm1
    chunk = loss_chunk_rows(R, V, loss_chunk)
    hf = h.reshape(R, -1)
    tf = None if teacher_states is None else mx.stop_gradient(teacher_states).reshape(R, -1)
    lab = None if target_labels else labels.reshape(R)
    in_vocab = None
    if dv is not None:  # labels as ids (the whole vocabulary's) and as positions in the draft vocabulary
        if lab is None:
            lab = _teacher_argmax(target, tf, valid_vocab, loss_chunk_rows(R, target.vocab_rows, loss_chunk))
        lab_pos = dv.pos[lab]
        in_vocab = (lab_pos >= 0).reshape(M, Bm1).astype(mx.float32)
        lab_in = mx.maximum(lab_pos, 0)
    else:
        lab_in = lab
    if chunk < R:
        vt = _chunked_vocab_terms(spec, hf, tf, lab_in, chunk)
    else:
        vt = _vocab_terms(spec, hf, tf, lab_in, 0)
    if dv is not None:  # back to ids
        vt["top1"] = dv.ids[vt["top1"]]
        if "cand" in vt:
            vt["cand"] = mx.stop_gradient(dv.ids[vt["cand"]])
    lab = (vt["labels"] if lab is None else lab).reshape(M, Bm1)
    valid = label_valid.reshape(M, Bm1).astype(mx.float32)
    w = weights[None, :] * valid
    w_ce = w if in_vocab is None else w * in_vocab  # a label the drafter cannot propose: no cross-entropy
    main = (vt["ce"].reshape(M, Bm1) * w_ce).sum() / mx.maximum(w_ce.sum(), 1.0)
    hit_top1 = (vt["top1"].reshape(M, Bm1) == lab).astype(mx.float32) * valid
    metrics = {"main": main, "acc_hits": hit_top1.sum(0), "acc_count": valid.sum(0)}
    loss = main
    if kd_weight > 0:
        kd = (vt["kd"].reshape(M, Bm1) * w).sum() / mx.maximum(w.sum(), 1.0)
        metrics["kd"] = kd
        loss = loss + kd_weight * kd
    if selector_on:
        sel = drafter.candidate_selector
        K = spec.top_k
        pred = mx.concatenate([anchor_tok.reshape(M, 1), lab[:, :-1]], axis=1)  # gold predecessors
        if stride > 1:
            h, lab, valid, pred = (x[::stride] for x in (h, lab, valid, pred))
        cand = vt["cand"].reshape(-1, Bm1, K)  # [M', B-1, K]
        Hs = sel.hidden_projection(h)  # [M', B-1, r]
        Ap = sel.predecessor_codebook[pred]  # [M', B-1, r]
        Bs = sel.successor_codebook[cand]  # [M', B-1, K, r]
        s = vt["cand_logits"].reshape(-1, Bm1, K) + (Bs @ (Ap * Hs)[..., None])[..., 0].astype(mx.float32)
        hit = (cand == lab[..., None]).astype(mx.float32)
        has = hit.sum(-1) * valid
        # the same array when no blocks are skipped: two equal reductions among the outputs of a
        # compiled value_and_grad trip MLX 0.32's common-subexpression pass (IndexError _Map_base::at)
        metrics["sel_count"] = metrics["acc_count"] if stride == 1 else valid.sum(0)
        ce = mx.logsumexp(s, axis=-1) - (s * hit).sum(-1)
        ws = weights[None, :] * has
        selector = (ce * ws).sum() / mx.maximum(ws.sum(), 1.0)
        chosen = mx.take_along_axis(cand, mx.argmax(s, axis=-1)[..., None], axis=-1)[..., 0]
        metrics.update(
            selector=selector,
            sel_hits=((chosen == lab).astype(mx.float32) * valid).sum(0),
            recall=has.sum() / mx.maximum(valid.sum(), 1.0),
        )
        loss = loss + alpha * selector
    return loss, metrics


# ----------------------------------------------------------------------------
# Trainer
# ----------------------------------------------------------------------------


def _read_rows(data: str) -> list[dict]:
    from .regen import read_responses

    rows = [r for r in read_responses(data) if len(r["response_ids"]) >= 2]
    if not rows:
        raise ValueError(f"{data}: no usable sequences (responses of at least 2 tokens)")
    return rows


class Trainer:
    """Runs a training job described by a :class:`TrainConfig`.

    Args:
        cfg: the settings; ``cfg.out`` is the run directory (checkpoints in
            ``ckpt/step-XXXXXXX``, the final drafter in ``drafter/``, the log in
            ``log.jsonl``). Batch-shape fields left ``None`` are filled in with
            :func:`device_defaults` (listed in ``chosen_defaults``).
        target, tokenizer: the frozen target and its tokenizer.
        started: ``time.perf_counter()`` value from which ``cfg.time_budget``
            counts (default: now, before the data is read); the CLI passes its
            own start, so that loading the target counts too.

    Raises:
        FileNotFoundError / ValueError: bad data or init checkpoint; a numeric setting out of its
            :data:`FIELD_RANGES` range (named, with its value), before anything is read or written.
    """

    def __init__(self, cfg: TrainConfig, target, tokenizer, started: float | None = None):
        self.started = time.perf_counter() if started is None else started
        for name, rng in FIELD_RANGES.items():
            v = getattr(cfg, name)
            if v is not None and not in_range(v, *rng):
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be {range_text(*rng)}, got {v!r}")
        self.chosen_defaults = resolve_device_defaults(cfg)
        if cfg.labels not in ("data", "target"):
            raise ValueError(f"labels must be 'data' or 'target', not {cfg.labels!r}")
        if cfg.compute_dtype is not None and cfg.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)} or None, "
                             f"not {cfg.compute_dtype!r}")
        self.cfg, self.target, self.tokenizer = cfg, target, tokenizer
        self.out = Path(cfg.out)
        self.rows = _read_rows(cfg.data)
        self.drafter = self._make_drafter()
        dc = self.drafter.config
        if cfg.block_size != dc.block_size:
            dc.block_size = cfg.block_size
        self.gamma = cfg.gamma or default_gamma(cfg.block_size)
        self.weights = mx.array([math.exp(-(k - 1) / self.gamma) for k in range(1, cfg.block_size)])
        self.pad_id = sorted(tokenizer.eos_token_ids)[0] if tokenizer.eos_token_ids else 0
        self.valid_vocab = min(len(tokenizer), target.vocab_size)
        self.draft_vocab = self._draft_vocab()
        self.batches_per_epoch = max(1, len(self.rows) // cfg.batch_size)
        self._build_optimizer()
        self.step = 0
        self._save_rate = None  # bytes/s of this run's saves (time-budget estimates)
        self._order_cache = {}
        self.tap_ids = tuple(dc.target_layer_ids)

    # -- setup -------------------------------------------------------------
    def _build_optimizer(self) -> None:
        """AdamW, with the LR of :meth:`_build_schedule` set before every update (:meth:`train_step`)."""
        self._build_schedule()
        self.opt = optim.AdamW(learning_rate=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self._step_fn = None  # the compiled step captures the drafter's and the optimizer's state

    def _build_schedule(self) -> None:
        """``total_steps`` and the LR schedule: linear warmup then cosine decay over it.

        The trainer sets the optimizer's LR to ``schedule(step)`` before each update
        (rather than handing AdamW the schedule), so that a run sized by its time
        budget can change the total without touching the optimizer or a compiled step.
        """
        cfg = self.cfg
        self.total_steps = cfg.steps or max(1, int(round(cfg.epochs * self.batches_per_epoch)))
        warm = self.warmup_steps = max(1, int(cfg.warmup * self.total_steps))
        decay = optim.cosine_decay(cfg.lr, max(1, self.total_steps - warm), cfg.lr * cfg.min_lr_ratio)
        self.schedule = optim.join_schedules([optim.linear_schedule(0.0, cfg.lr, warm), decay], [warm])

    def _make_drafter(self) -> DraftModel:
        """The drafter to train: ``init`` (dequantized if quantized; DFlash v1 upgraded
        to DFlash2 when asked) or a fresh one. Afterwards the config's shape fields
        hold the drafter's real shape, so ``config.json`` and resume checks are true.

        Raises:
            ValueError: a shape field given together with ``init`` that the init
                drafter does not have, or a DFlash2 init with ``architecture`` DFlash v1.
        """
        cfg = self.cfg
        if cfg.init:
            # quantized weights cannot be trained: a 4-bit drafter starts from its dequantized weights
            model = dequantize_drafter(load_drafter(cfg.init, self.target, self.tokenizer, dtype=mx.float32))
            dc = model.config
            if cfg.architecture == "DFlashDraftModel" and dc.is_dflash2:
                raise ValueError(f"--init {cfg.init} is a DFlash2 drafter; it cannot be trained as DFlashDraftModel")
            have = {"num_layers": dc.num_hidden_layers, "num_taps": len(dc.target_layer_ids),
                    "target_layer_ids": list(dc.target_layer_ids), "intermediate_size": dc.intermediate_size}
            if dc.is_dflash2:
                have.update(selector_rank=dc.selector_rank, selector_top_k=dc.selector_top_k)
            wrong = [f"--{k.replace('_', '-')} {getattr(cfg, k)} (it has {v})" for k, v in have.items()
                     if getattr(cfg, k) is not None and _plain(getattr(cfg, k)) != _plain(v)]
            if wrong:
                raise ValueError(f"--init {cfg.init} fixes the drafter's shape; drop or match: {', '.join(wrong)}")
            if cfg.architecture == "DFlash2DraftModel" and not dc.is_dflash2:
                model = _upgrade_to_dflash2(model, cfg)
        else:
            model = init_drafter(
                self.target,
                self.tokenizer,
                architecture=cfg.architecture,
                num_layers=cfg.num_layers or NEW_DRAFTER["num_layers"],
                block_size=cfg.block_size,
                num_taps=cfg.num_taps,
                target_layer_ids=cfg.target_layer_ids,
                intermediate_size=cfg.intermediate_size,
                selector_rank=cfg.selector_rank or NEW_DRAFTER["selector_rank"],
                selector_top_k=cfg.selector_top_k or NEW_DRAFTER["selector_top_k"],
                seed=cfg.seed,
            )
        dc = model.config
        cfg.architecture = dc.architecture
        cfg.num_layers, cfg.num_taps = dc.num_hidden_layers, len(dc.target_layer_ids)
        cfg.target_layer_ids, cfg.intermediate_size = list(dc.target_layer_ids), dc.intermediate_size
        if dc.is_dflash2:
            cfg.selector_rank, cfg.selector_top_k = dc.selector_rank, dc.selector_top_k
        return model

    def _draft_vocab(self) -> DraftVocab | None:
        """``cfg.draft_vocab`` as a :class:`DraftVocab`: ``"N"`` (the ``N`` most frequent response ids of the
        data plus those that ended a response, as ``mlx_dflash2.train vocab --size N`` chooses them), a
        drafter directory / ``draft_vocab.json`` file to take the set from, ``"full"`` (the whole
        vocabulary), or ``None``: the ``init`` drafter's ``draft_vocab.json`` if it has one (a fine-tuned
        drafter keeps drafting from its set), else the whole vocabulary.

        Raises:
            ValueError / FileNotFoundError: a bad value, a missing or malformed file, ids the target refuses.
        """
        from ..drafter.io import DRAFT_VOCAB_FILE, draft_vocab_file, read_draft_vocab

        spec = self.cfg.draft_vocab
        if spec is None and self.cfg.init and draft_vocab_file(self.cfg.init).exists():
            spec, flag = self.cfg.init, "--init"
        else:
            flag = "--draft-vocab"
        if spec is None or str(spec).strip() == "full":
            return None
        spec = str(spec).strip()
        try:
            if re.fullmatch(r"[+-]?[0-9]+", spec):
                from .vocab import METHOD, draft_vocab

                if int(spec) < 2:
                    raise ValueError(f"a size must be an integer >= 2, got {spec}")
                ids, info = draft_vocab(self.rows, int(spec))
                info = {"method": METHOD, "data": "/".join(Path(self.cfg.data).parts[-2:]), **info}
            else:
                p = Path(spec)
                if not p.exists():
                    raise FileNotFoundError(f"{flag} {spec}: no such file or directory (a size is an integer >= 2, "
                                            "'full' the whole vocabulary)")
                f = draft_vocab_file(p)
                if not f.exists():
                    raise FileNotFoundError(f"{flag} {spec}: a directory without a {DRAFT_VOCAB_FILE}")
                ids = read_draft_vocab(p)
                raw = json.loads(f.read_text(encoding="utf-8-sig"))
                info = {k: v for k, v in raw.items() if k not in ("ids", "size")}
            return DraftVocab.build(self.target, ids, self.valid_vocab, info)
        except FileNotFoundError:
            raise
        except ValueError as e:  # DrafterLoadError included (it names the file)
            raise ValueError(f"{flag} {spec}: {e}") from None

    def _saved_vocab(self) -> tuple[list[int], dict] | None:
        """What :func:`save_drafter` writes as the drafter's ``draft_vocab.json``."""
        dv = self.draft_vocab
        return None if dv is None else (dv.ids.tolist(), dv.info)

    def _batch_rows(self, step: int) -> list[dict]:
        epoch, b = divmod(step, self.batches_per_epoch)
        if epoch not in self._order_cache:
            self._order_cache = {epoch: np.random.RandomState(self.cfg.seed + epoch).permutation(len(self.rows))}
        order = self._order_cache[epoch]
        idx = order[b * self.cfg.batch_size : (b + 1) * self.cfg.batch_size]
        return [self.rows[i] for i in idx]

    def alpha(self, step: int) -> float:
        """Selector-loss weight: 0, then a linear ramp (SpecForge's schedule), then constant."""
        w = max(1, int(0.0005 * self.total_steps))
        return self.cfg.selector_alpha * min(1.0, max(0.0, (step - w) / w))

    # -- checkpoints ---------------------------------------------------------
    def checkpoint_dir(self) -> Path:
        return self.out / "ckpt"

    def save_checkpoint(self) -> Path:
        """Atomically write ``ckpt/step-XXXXXXX`` (drafter, optimizer state, step)."""
        root = self.checkpoint_dir()
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{self.step:07d}"
        tmp = root / f".tmp-step-{self.step:07d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_drafter(self.drafter, tmp / "drafter", draft_vocab=self._saved_vocab())
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(self.opt.state)))
        (tmp / "state.json").write_text(json.dumps({"step": self.step, "config": asdict(self.cfg)}) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        ckpts = sorted(root.glob("step-*"))
        for old in ckpts[: -self.cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def latest_checkpoint(self) -> Path | None:
        ckpts = sorted(self.checkpoint_dir().glob("step-*")) if self.checkpoint_dir().is_dir() else []
        return ckpts[-1] if ckpts else None

    def resume(self, path: Path | None = None) -> bool:
        """Load the latest (or the given) checkpoint; False if there is none."""
        path = path or self.latest_checkpoint()
        if path is None:
            return False
        state = json.loads((path / "state.json").read_text())
        self._check_same_run(state["config"])
        saved_steps = state["config"].get("steps")
        if self.cfg.steps is None and saved_steps:
            self.cfg.steps = saved_steps  # e.g. a run sized by --time-budget
            self._build_schedule()
        from ..drafter.io import DRAFT_VOCAB_FILE, read_draft_vocab

        saved_vocab = read_draft_vocab(path / "drafter")
        now = None if self.draft_vocab is None else self.draft_vocab.ids.tolist()
        if saved_vocab != now:  # e.g. the file a --draft-vocab path names changed since

            def what(v, other=""):
                return "the whole vocabulary" if v is None else f"a draft vocabulary of {len(v):,} {other}ids"
            same_size = saved_vocab is not None and now is not None and len(saved_vocab) == len(now)
            raise ValueError(f"{path} was trained on {what(saved_vocab)}, this run would train on "
                             f"{what(now, 'other ' if same_size else '')}: pass the same --draft-vocab to resume it "
                             f"(its ids are in {path / 'drafter' / DRAFT_VOCAB_FILE}), or --no-resume to start over")
        if "draft_vocab" in state["config"]:  # the same ids, maybe named otherwise: config.json keeps the run's words
            self.cfg.draft_vocab = state["config"]["draft_vocab"]
        self.drafter = load_drafter(path / "drafter", self.target, self.tokenizer, dtype=mx.float32)
        self.opt.init(self.drafter.trainable_parameters())
        saved = mx.load(str(path / "optimizer.safetensors"))
        self.opt.state = tree_unflatten(list(saved.items()))
        self._step_fn = None
        self.step = int(state["step"])
        self.tap_ids = tuple(self.drafter.config.target_layer_ids)
        self._cut_log(self.step)
        return True

    def _check_same_run(self, saved: dict) -> None:
        """Resume only the run this config describes (same drafter shape, data and optimisation).

        Raises:
            ValueError: naming the settings that differ from the checkpoint's.
        """
        cur = asdict(self.cfg)
        keys = list(RESUME_FIELDS) + (["steps"] if self.cfg.steps is not None else [])
        diff = [k for k in keys if k in saved and _plain(saved[k]) != _plain(cur[k])]
        if diff:
            what = ", ".join(f"{k} {saved[k]!r} (now {cur[k]!r})" for k in diff)
            init = f"; it was started with --init {saved['init']}" if saved.get("init") != cur.get("init") else ""
            more = (f"; to train its drafter further, start another run with --init {self.out / 'drafter'}"
                    if {"steps", "epochs"} & set(diff) else "")  # a finished run is not extended in place
            raise ValueError(f"{self.out} holds a run with other settings: {what}{init}. Pass the same settings "
                             f"to resume it (they are in its config.json), or --no-resume to start over{more}")

    def _cut_log(self, step: int) -> None:
        """Drop log lines past ``step`` (written after the checkpoint a run resumes from)."""
        f = self.out / "log.jsonl"
        if not f.is_file():
            return
        lines = f.read_text().splitlines()
        keep = [ln for ln in lines if ln.strip() and json.loads(ln).get("step", 0) <= step]
        if keep == lines:
            return  # nothing to cut: the file stays as it was
        tmp = f.with_suffix(".tmp")
        tmp.write_text("".join(ln + "\n" for ln in keep))
        os.replace(tmp, f)

    # -- training ------------------------------------------------------------
    def teacher_states(self, final: mx.array, anchors: mx.array) -> mx.array:
        """The target's final-normed states at the label positions: ``final`` ``[N, T, D]``,
        ``anchors`` ``[N, A]`` -> ``[N*A, B-1, D]`` (position ``anchor + k - 1`` predicts block
        position k). :func:`dflash_loss` makes the teacher's logits from them where it uses them,
        a chunk of rows at a time."""
        N, T, _ = final.shape
        Bm1 = self.cfg.block_size - 1
        pos = mx.minimum(anchors[..., None] + mx.arange(Bm1)[None, None, :], T - 1).reshape(N, -1)
        rows = mx.take_along_axis(final, pos[..., None], axis=1)  # [N, A*(B-1), D]
        return mx.stop_gradient(rows.reshape(N * anchors.shape[1], Bm1, -1))

    def teacher_logits(self, final: mx.array, anchors: mx.array) -> mx.array:
        """Target logits at the label positions, all at once (inspection; training makes them chunk
        by chunk inside :func:`dflash_loss`): ``[N*A, B-1, V]`` in the target's dtype, ids
        ``>= valid_vocab`` at -1e9 (-6e4 in half precision)."""
        return mx.stop_gradient(_mask_vocab(self.target.logits(self.teacher_states(final, anchors)), self.valid_vocab))

    def _update_fn(self):
        """The optimisation step: loss and gradients, clipping, AdamW update.

        With ``compile`` it is an ``mx.compile``d function over the drafter's and
        the optimizer's state (MLX's documented pattern for training steps), which
        fuses the elementwise chains over the ``[blocks, B-1, vocab]`` logits; a new
        sequence length (``tokens`` are padded to multiples of ``pad_multiple``, default 64) traces it again.
        Off by default: on the H200 (MLX 0.32.4 CUDA) the compiled DFlash2 step ran
        at 0.23 s/step but began training about 3.5 minutes after launch (an
        uncompiled DFlash v1 run of the same data: 23 s), and on the CPU it was no
        faster; the losses equal the uncompiled ones (tested). Rebuilt whenever the
        drafter or the optimizer is replaced.

        Without ``compile`` the update alone (gradient clipping and AdamW) is compiled, over the same
        state (:func:`make_update`).
        """
        if self._step_fn is not None:
            return self._step_fn
        cfg = self.cfg
        update = make_update(self.drafter, self.opt, cfg.grad_clip, compiled=not cfg.compile)  # (inside the step's)
        state = [self.drafter.state, self.opt.state]

        def step(features, tokens, anchors, labels, label_valid, weights, alpha, teacher):
            def loss_fn(model):
                return dflash_loss(model, self.target, features, tokens, anchors, labels, label_valid, weights, alpha,
                                   valid_vocab=self.valid_vocab, teacher_states=teacher, kd_weight=cfg.kd_weight,
                                   selector_fraction=cfg.selector_fraction, target_labels=cfg.labels == "target",
                                   loss_chunk=cfg.loss_chunk, draft_vocab=self.draft_vocab)

            (loss, metrics), grads = value_and_grad_in(self.drafter, loss_fn, cfg.compute_dtype)(self.drafter)
            return loss, metrics, update(grads)

        if cfg.compile:
            step = mx.compile(step, inputs=state, outputs=state)
        self._step_fn = step
        return step

    def train_step(self, batch: dict) -> dict:
        cfg = self.cfg
        tokens = mx.array(batch["tokens"])
        anchors = mx.array(batch["anchors"])
        labels = mx.array(batch["labels"])
        teacher = None  # the target's states at the label positions: its logits are made inside the loss
        if cfg.labels == "target" or cfg.kd_weight > 0:
            features, final = self.target.taps(tokens, self.tap_ids, final=True)
            teacher = self.teacher_states(final, anchors)
        else:
            features = self.target.taps(tokens, self.tap_ids)
        alpha = self.alpha(self.step)
        self.opt.learning_rate = self.schedule(self.opt.step)  # an input of the (compiled) step: no retrace
        if cfg.compile and self.drafter.config.is_dflash2 and cfg.selector_alpha > 0:
            alpha = mx.array(alpha, dtype=mx.float32)  # an input, so the ramp does not retrace the step
        loss, metrics, norm = self._update_fn()(
            mx.stop_gradient(features), tokens, anchors, labels, mx.array(batch["label_valid"]), self.weights, alpha,
            teacher,
        )
        mx.eval(self.drafter.parameters(), self.opt.state, loss, metrics, norm)
        metrics["loss"] = loss
        metrics["grad_norm"] = norm
        return metrics

    # -- time budget -----------------------------------------------------------
    def _save_bytes(self) -> tuple[int, int]:
        """Bytes written by a checkpoint (drafter + AdamW moments) and by the final ``drafter/``."""
        if getattr(self, "_save_bytes_of", (None,))[0] is not self.drafter:  # once per drafter (resume replaces it)
            params = sum(v.nbytes for _, v in tree_flatten(self.drafter.parameters()))
            trainable = sum(v.nbytes for _, v in tree_flatten(self.drafter.trainable_parameters()))
            self._save_bytes_of = (self.drafter, (params + 2 * trainable, params))
        return self._save_bytes_of[1]

    def _save_estimate(self, final: bool = True) -> float:
        """Seconds a checkpoint (``final``: plus the ``drafter/`` copy) is expected to take: from the
        write rate of this run's saves so far, else from :data:`SAVE_RATE` bytes/s (conservative)."""
        ckpt, drafter = self._save_bytes()
        rate = self._save_rate or SAVE_RATE
        return SAVE_OVERHEAD_S + (ckpt + (drafter if final else 0)) / rate

    def _timed_save(self, final: bool) -> None:
        """Checkpoint (and with ``final`` the drafter), measuring the write rate for later estimates."""
        t0 = time.perf_counter()
        self.save_checkpoint()
        if final:
            save_drafter(self.drafter, self.out / "drafter", overwrite=True, draft_vocab=self._saved_vocab())
        dt = time.perf_counter() - t0
        ckpt, drafter = self._save_bytes()
        self._save_rate = (ckpt + (drafter if final else 0)) / max(dt - SAVE_OVERHEAD_S, 1e-3)

    @staticmethod
    def _step_estimate(times: list[float]) -> float:
        """Seconds per step from this invocation's steps: the mean of the last 100, the first
        left out once there are others (it carries one-off start-up costs)."""
        rest = times[1:] or times
        return float(np.mean(rest[-100:]))

    def _size_to_budget(self, times: list[float], deadline: float) -> None:
        """Set ``total_steps`` (and the LR schedule) to the steps done plus what fits before
        ``deadline`` (after the final save). Called after each of the first :data:`SIZING_STEPS`
        steps of a run sized by its time budget and on to :meth:`_sizing_until`, so that the
        estimate averages many real batches; the optimizer state is kept. The first update has
        LR 0 and selector weight 0 whatever the total; the later ones follow the total known when
        they run (saved as ``steps``, so a resumed run continues with it)."""
        est = self._step_estimate(times)
        room = deadline - time.perf_counter() - self._save_estimate()
        steps = self.step + max(0, int(SIZING_MARGIN * room / est))
        if steps == self.total_steps:
            return
        self.cfg.steps = steps
        self._build_schedule()
        self.cfg.extra["calibrated_step_s"] = est

    def _sizing_until(self) -> int:
        """A run sized by its time budget is re-sized after every step up to this one: the LR
        warm-up or the first :data:`SIZING_FRACTION` of the steps, whichever is longer."""
        return max(self.warmup_steps, int(SIZING_FRACTION * self.total_steps))

    def _open_run(self, fresh: bool):
        """Create the run directory (once the first step fits the budget), write ``config.json``
        and open ``log.jsonl``: appended to by a resumed run; a ``fresh`` one (not resumed:
        ``resume=False`` or no checkpoint) replaces what an earlier run left there (its
        checkpoints, which would otherwise count as newer, its drafter and its log)."""
        self.out.mkdir(parents=True, exist_ok=True)
        if fresh:
            for old in (self.checkpoint_dir(), self.out / "drafter"):
                shutil.rmtree(old, ignore_errors=True)
        self._write_config()
        return open(self.out / "log.jsonl", "w" if fresh else "a")

    def _write_config(self) -> None:
        (self.out / "config.json").write_text(json.dumps(asdict(self.cfg), indent=2) + "\n")

    def fit(self, resume: bool = True, max_steps: int | None = None, progress: bool = True) -> dict:
        """Train until ``total_steps`` (or ``max_steps`` more steps); checkpoints
        every ``save_every`` steps and at the end; writes the final drafter to
        ``out/drafter``. Progress (a tqdm bar on stderr: steps, step time, ETA,
        loss) is shown from the first step.

        With ``time_budget`` (seconds from ``started``) the run ends within the
        budget: before every step, including the first, it stops if the next step
        (estimated from the steps done so far) and the final checkpoint and drafter
        would not end before the deadline, and saves them (``extra["stopped_at_deadline"]``);
        a run without ``steps`` takes as many as fit, sized from its own steps (after each of
        the first ones and on through the first quarter of the run: no probe steps are thrown away).
        The one overrun left is a step (or save) slower than the ones before it,
        e.g. the first step.

        Returns:
            The last logged metrics.

        Raises:
            TimeBudgetError: not even one step and its checkpoint fit the budget
                (or the budget ended before the first step). Nothing is written:
                no run directory for a new run, a resumed one left as it was.
        """
        from tqdm import tqdm

        cfg = self.cfg
        deadline = self.started + cfg.time_budget if cfg.time_budget else None
        resumed = self.resume() if resume else False
        size_by_time = deadline is not None and not cfg.steps and self.step == 0
        if self.step == 0:
            self.opt.init(self.drafter.trainable_parameters())
        first = self.step

        def end_step():
            return self.total_steps if max_steps is None else min(self.total_steps, first + max_steps)

        log = None  # the run directory is written once a step fits the budget
        acc = _Accumulator()
        last, times, stopped = {}, [], False
        tic = time.perf_counter()
        bar = tqdm(total=None if size_by_time else self.total_steps, initial=self.step, desc="train", unit="step",
                   disable=not progress, file=sys.stderr, dynamic_ncols=True)
        try:
            while self.step < end_step():
                if deadline is not None:
                    now = time.perf_counter()
                    periodic = (self.step + 1) % cfg.save_every == 0 and self.step + 1 < end_step()
                    need = (self._step_estimate(times) + self._save_estimate() +
                            (self._save_estimate(final=False) if periodic else 0.0)) if times else 0.0
                    if now + need > deadline:
                        if not times:
                            raise self._budget_error(None, now - self.started, resumed)
                        stopped = True
                        break
                t0 = time.perf_counter()
                if not times:
                    before = t0 - self.started  # loading (target, data, checkpoint) before the first step
                batch = make_batch(self._batch_rows(self.step), self.step, cfg, self.pad_id)
                m = self.train_step(batch)
                self.step += 1
                times.append(time.perf_counter() - t0)
                if deadline is not None and len(times) == 1 and time.perf_counter() + self._save_estimate() > deadline:
                    raise self._budget_error(times[0], before, resumed)
                if size_by_time and (len(times) <= SIZING_STEPS or self.step <= self._sizing_until()):
                    self._size_to_budget(times, deadline)
                    bar.total = self.total_steps
                if log is None:
                    log = self._open_run(fresh=not resumed)
                acc.add(m, batch["n_tokens"])
                if self.step % cfg.log_every == 0 or self.step == end_step():
                    last = acc.summary(self.step, float(self.schedule(self.step)), time.perf_counter() - tic)
                    log.write(json.dumps(last) + "\n")
                    log.flush()
                    acc = _Accumulator()
                    tic = time.perf_counter()
                post = dict(loss=f"{float(m['loss'].item()):.3f}", step_s=f"{times[-1]:.2f}")
                if last:
                    post["acc1"] = f"{last['acc'][0]:.2f}"  # position-1 accuracy over the last log interval
                bar.set_postfix(post, refresh=False)
                bar.update(1)
                if len(times) == 1:
                    bar.refresh()  # the first step always shows; later ones at tqdm's rate limit
                if self.step % cfg.save_every == 0 and self.step < end_step():
                    self._timed_save(final=False)
        finally:
            bar.close()
            if log is not None:
                log.close()
        if stopped:
            cfg.extra["stopped_at_deadline"] = self.step
            print(f"time budget: stopped after step {self.step} of {self.total_steps} (saved; rerun the same command "
                  "to continue)", file=sys.stderr)
        if times:
            self._write_config()
            self._timed_save(final=stopped or self.step >= self.total_steps)
        elif self.step >= self.total_steps and self.out.is_dir():
            # a finished run, rerun
            save_drafter(self.drafter, self.out / "drafter", overwrite=True, draft_vocab=self._saved_vocab())
        return last

    def _budget_error(self, first_step_s: float | None, before: float, resumed: bool) -> TimeBudgetError:
        """The error of a budget that does not fit one step (see :meth:`fit`): ``first_step_s``
        the first step's seconds (``None``: the budget ended before it), ``before`` the
        seconds from ``started`` to the first step."""
        budget = self.cfg.time_budget
        left = (f"{self.out} is left as it was (checkpoint {self.latest_checkpoint().name}; rerun to resume)"
                if resumed else "nothing was written")
        if first_step_s is None:
            return TimeBudgetError(f"time budget {budget:g} s ended before the first step (loading the target and the "
                                   f"data took {before:.1f} s); {left}")
        save = self._save_estimate()
        fits = before + first_step_s + save
        return TimeBudgetError(
            f"time budget {budget:g} s: not even one step fits (loading took {before:.1f} s, the first step "
            f"{first_step_s:.1f} s, saving it about {save:.1f} s); {left}. A budget of at least "
            f"{math.ceil(fits * 1.2)} s fits one step, or make steps smaller (batch_size {self.cfg.batch_size}, anchors {self.cfg.anchors}, "
            f"max_len {self.cfg.max_len})")


class _Accumulator:
    def __init__(self):
        self.n = 0
        self.sums = {}
        self.hits = None
        self.count = None
        self.sel_hits = None
        self.sel_count = None
        self.tokens = 0

    def add(self, m: dict, n_tokens: int):
        self.n += 1
        self.tokens += n_tokens
        for k in ("loss", "main", "kd", "selector", "recall", "grad_norm"):
            if k in m:
                self.sums[k] = self.sums.get(k, 0.0) + float(m[k].item())
        h, c = np.array(m["acc_hits"]), np.array(m["acc_count"])
        self.hits = h if self.hits is None else self.hits + h
        self.count = c if self.count is None else self.count + c
        if "sel_hits" in m:
            s, c = np.array(m["sel_hits"]), np.array(m["sel_count"])
            self.sel_hits = s if self.sel_hits is None else self.sel_hits + s
            self.sel_count = c if self.sel_count is None else self.sel_count + c

    def summary(self, step: int, lr: float, seconds: float) -> dict:
        out = {k: v / max(self.n, 1) for k, v in self.sums.items()}
        cnt = np.maximum(self.count, 1)
        out.update(step=step, lr=lr, acc=(self.hits / cnt).round(4).tolist(), tokens_per_s=self.tokens / max(seconds, 1e-9))
        if self.sel_hits is not None:
            out["sel_acc"] = (self.sel_hits / np.maximum(self.sel_count, 1)).round(4).tolist()
        return out


def _plain(v):
    """Tuples as lists, so that values compare equal across a JSON round trip."""
    return list(v) if isinstance(v, (list, tuple)) else v


# settings a resumed run must share with its checkpoint (the rest: output, logging, time budget, compile and
# compute_dtype, which change how a step is computed, not what the run is)
RESUME_FIELDS = ("data", "architecture", "num_layers", "num_taps", "target_layer_ids", "block_size",
                 "intermediate_size", "selector_rank", "selector_top_k", "anchors", "batch_size", "max_len", "epochs",
                 "lr", "warmup", "min_lr_ratio", "weight_decay", "grad_clip", "gamma", "selector_alpha", "labels",
                 "kd_weight", "selector_fraction", "seed")  # (a draft vocabulary: its ids are compared)


def _upgrade_to_dflash2(model: DraftModel, cfg: TrainConfig) -> DraftModel:
    """A DFlash (v1) drafter as a DFlash2 one: same weights, conv and selector as exact no-ops."""
    d = model.config.to_dict()
    d["architectures"] = ["DFlash2DraftModel"]
    d["dflash_config"].update(
        conv_kernel_size=2, conv_group_size=16, selector_rank=cfg.selector_rank or NEW_DRAFTER["selector_rank"],
        selector_top_k=cfg.selector_top_k or NEW_DRAFTER["selector_top_k"],
    )
    new = DraftModel(DrafterConfig.from_dict(d))
    new.init_weights(cfg.seed)
    new.load_weights(list(tree_flatten(model.parameters())), strict=False)
    mx.eval(new.parameters())
    return new
