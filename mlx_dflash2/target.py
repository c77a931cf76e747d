"""Target adapter: run an mlx-lm target with taps at ``target_layer_ids``.

DFlash conditions its drafter on *context features*: the residual stream after
some target decoder layers (before the final norm; Hugging Face's
``hidden_states[id + 1]``), concatenated along the feature axis
(DFlash2 spec §1.2). mlx-lm models only return logits, so the adapter runs the
model's own public sub-modules (``embed_tokens``, ``layers``, ``norm``, the LM
head) in the order the mlx-lm families it supports use, collecting the taps on
the way. A load-time *parity probe* checks that this reproduces the model's own
``__call__`` (logits within 1e-3) and refuses the model otherwise, so an mlx-lm
change that breaks the assumption is caught at load, never as wrong output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, make_prompt_cache

from .modelconfig import sliding_window_layers

__all__ = ["TargetAdapter", "TargetCompatibilityError", "ForwardResult"]

# mlx-lm families whose inner model is embed -> layers(h, mask, cache) -> norm with
# plain (trimmable) KV caches. Others may work but are refused until probed here.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

PARITY_TOLERANCE = 1e-3


class TargetCompatibilityError(ValueError):
    """The target model cannot be driven by the speculative loop."""


@dataclass
class ForwardResult:
    """Output of :meth:`TargetAdapter.forward`.

    Attributes:
        logits: ``[L, V]`` (or ``[1, V]`` with ``last_only``) float logits, the
            model's dtype (``V`` = :attr:`TargetAdapter.vocab_rows`; ``-inf``
            at ids ``>= vocab_size``).
        features: ``[L, k*D]`` concatenated taps (target dtype) or ``None``
            when no tap layer ids were asked for.
    """

    logits: mx.array
    features: mx.array | None


class TargetAdapter:
    """Drive an mlx-lm causal LM with tap outputs and trimmable KV caches.

    Args:
        model: an mlx-lm ``Model`` of a supported family (``model.model`` has
            ``embed_tokens``, ``layers``, ``norm``).
        config: the model's config dict (``model_type`` is checked).
        probe: run the parity probe (default True).
        vocab_size: the real vocabulary (the tokenizer's size). Embeddings are
            often padded past it (every Qwen2/2.5/3 checkpoint: 151,936 rows
            for 151,665 tokens); the logits of the padding rows are ``-inf`` in
            everything :meth:`forward` and :meth:`logits` return, so no
            decoding path (argmax, sampling, log-probabilities, every verify
            row) can emit a padding id. ``None``: all rows are real.
        kernels: kernel mode (:mod:`mlx_dflash2.kernels`): anything but ``"reference"`` routes the
            target's quantized linear layers, tied quantized LM head and attention through the
            registry's row-invariant kernels on a GPU backend (:meth:`route_kernels`); ``None``:
            ``MLX_DFLASH2_KERNELS``. Default ``"reference"`` (a bare adapter, as in tests).

    Raises:
        TargetCompatibilityError: unsupported family, sliding-window attention
            (rotating caches, or a ``sliding_window`` in the config that changes the
            model: :func:`~.modelconfig.sliding_window_layers`), non-trimmable
            caches, or the parity probe failed.
        ValueError: ``vocab_size < 1``.
    """

    def __init__(self, model: nn.Module, config: dict, probe: bool = True, vocab_size: int | None = None,
                 kernels: str | None = "reference"):
        self.model = model
        self.config = config
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise TargetCompatibilityError(
                f"target model_type {model_type!r} is not supported by the speculative loop "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        inner = getattr(model, "model", None)
        for attr in ("embed_tokens", "layers", "norm"):
            if inner is None or not hasattr(inner, attr):
                raise TargetCompatibilityError(f"target has no model.{attr}; cannot attach taps")
        self.inner = inner
        self.layers = list(inner.layers)
        if any(getattr(l, "use_sliding", False) for l in self.layers):
            raise TargetCompatibilityError(
                "target has sliding-window layers; their rotating KV cache cannot be rolled back "
                "exactly after it wraps, so the speculative loop refuses it"
            )
        # a window the model class ignores (mlx-lm's llama runs a Mistral-style sliding_window
        # without layer_types as full attention): refused too, never run as a different model
        window, sliding = sliding_window_layers(config)
        if sliding:
            where = f"all {len(self.layers)} layers" if len(sliding) == len(self.layers) else f"layers {sliding}"
            raise TargetCompatibilityError(
                f"target config sets sliding_window={window} (below its context of "
                f"{config.get('max_position_embeddings') or 'unknown'} tokens) on {where}; sliding-window "
                "attention is not supported by the speculative loop yet, and running it as full attention "
                "would be a different model, so it is refused"
            )
        cache = self.make_cache()
        if not all(isinstance(c, KVCache) for c in cache):
            kinds = sorted({type(c).__name__ for c in cache})
            raise TargetCompatibilityError(f"target caches {kinds} are not plain trimmable KV caches")
        self._head = model.lm_head if hasattr(model, "lm_head") else inner.embed_tokens.as_linear
        rows = self.vocab_rows
        if vocab_size is not None and (isinstance(vocab_size, bool) or int(vocab_size) < 1):
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size!r}")
        self.vocab_size = rows if vocab_size is None else min(int(vocab_size), rows)
        self._padding = None  # bool [rows]: the padding rows, or None
        if self.vocab_size < rows:
            self._padding = mx.arange(rows) >= self.vocab_size
            mx.eval(self._padding)  # not lazy: the adapter may be used on another thread (server worker)
        self._routes: list = []
        self.kernels = "reference"
        if probe:
            self.check_parity()
        self.route_kernels(kernels)

    # -- geometry ---------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def vocab_rows(self) -> int:
        """Rows of the (shared) input embedding = width of the LM head."""
        emb = self.inner.embed_tokens
        return int(emb.weight.shape[0])

    @property
    def max_context(self) -> int | None:
        v = self.config.get("max_position_embeddings")
        return int(v) if v else None

    @property
    def dtype(self) -> mx.Dtype:
        return self.inner.norm.weight.dtype

    # -- shared modules for the drafter ----------------------------------
    def embed(self, ids: mx.array) -> mx.array:
        """Token embeddings, ``ids`` int ``[..., L]`` -> ``[..., L, D]``."""
        return self.inner.embed_tokens(ids)

    def lm_head(self, h: mx.array) -> mx.array:
        """The raw target LM head on hidden states ``[..., D]`` -> ``[..., V]``, padding rows
        included (the drafter applies it to its own states and masks its ids itself;
        the target's own logits are :meth:`logits`)."""
        return self._head(h)

    def logits(self, h: mx.array) -> mx.array:
        """The target's logits from final-normed states ``[..., D]`` -> ``[..., V]``: the LM head
        with ``-inf`` at ids ``>= vocab_size`` (what :meth:`forward` returns)."""
        return self.mask_padding(self._head(h))

    def mask_padding(self, logits: mx.array) -> mx.array:
        """``logits`` ``[..., V]`` with ``-inf`` at the padding ids ``>= vocab_size`` (unchanged
        when the embedding is not padded)."""
        if self._padding is None:
            return logits
        return mx.where(self._padding, mx.array(-mx.inf, logits.dtype), logits)

    def make_cache(self) -> list:
        """A fresh per-request KV cache (one ``KVCache`` per layer)."""
        return make_prompt_cache(self.model)

    # -- forward ----------------------------------------------------------
    def forward(
        self,
        tokens: mx.array,
        cache: list,
        tap_ids: Sequence[int] = (),
        last_only: bool = False,
    ) -> ForwardResult:
        """Run the target on new tokens, appending them to ``cache``.

        Args:
            tokens: int ``[L]`` new token ids (positions ``cache offset ..+L-1``).
            cache: the request's KV cache (mutated: grows by ``L`` rows).
            tap_ids: 0-based decoder layer ids whose outputs are tapped.
            last_only: compute logits for the last position only.

        Returns:
            :class:`ForwardResult` with logits ``[L, V]`` (``[1, V]`` if
            ``last_only``) and features ``[L, len(tap_ids)*D]`` or None.
        """
        h = self.inner.embed_tokens(tokens[None])
        mask = create_attention_mask(h, cache[0])
        taps = []
        want = set(tap_ids)
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = layer(h, mask, c)
            if i in want:
                taps.append((i, h))
        features = None
        if tap_ids:
            by_id = dict(taps)
            features = mx.concatenate([by_id[i] for i in tap_ids], axis=-1)[0]
        if last_only:
            h = h[:, -1:]
        return ForwardResult(self.logits(self.inner.norm(h))[0], features)

    def taps(self, tokens: mx.array, tap_ids: Sequence[int], final: bool = False):
        """Context features of whole sequences, without a cache (training, replay).

        Args:
            tokens: int ``[N, T]`` (right padding is harmless: attention is causal).
            tap_ids: decoder layer ids to tap (non-empty).
            final: also return the final-normed last-layer states (the LM
                head's input: ``logits(final)`` are the target's logits).

        Returns:
            ``[N, T, len(tap_ids)*D]`` (layers after the last tap are not run),
            or ``(taps, final [N, T, D])`` with ``final=True``.
        """
        h = self.inner.embed_tokens(tokens)
        mask = create_attention_mask(h, None)
        want = {i: None for i in tap_ids}
        last = len(self.layers) - 1 if final else max(tap_ids)
        for i, layer in enumerate(self.layers[: last + 1]):
            h = layer(h, mask, None)
            if i in want:
                want[i] = h
        feats = mx.concatenate([want[i] for i in tap_ids], axis=-1)
        return (feats, self.inner.norm(h)) if final else feats

    def _probe_logits(self, own: bool) -> list[mx.array]:
        """Logits of the probe (a 6-token prefill, then a 3-token cached step; real vocabulary only)
        through the model's own ``__call__`` (``own``) or :meth:`forward`."""
        V = self.vocab_size
        ids = mx.array([(17 + 7919 * i) % V for i in range(9)], dtype=mx.int32)
        c = self.make_cache()
        if own:
            out = [self.model(ids[None, :6], cache=c)[0], self.model(ids[None, 6:], cache=c)[0]]
        else:
            out = [self.forward(ids[:6], c, tap_ids=(0,)).logits, self.forward(ids[6:], c).logits]
        out = [o[:, :V].astype(mx.float32) for o in out]
        mx.eval(out)
        return out

    def check_parity(self, tolerance: float = PARITY_TOLERANCE) -> float:
        """Tap-parity probe: the adapter must reproduce ``model(...)``.

        Runs a 6-token prefill and a 3-token cached step through both the
        model's own ``__call__`` and :meth:`forward` and compares the logits
        of the real vocabulary (the padding rows are ``-inf`` in ours).

        Returns:
            The max absolute logit difference.

        Raises:
            TargetCompatibilityError: difference above ``tolerance``.
        """
        ref, ours = self._probe_logits(own=True), self._probe_logits(own=False)
        diff = max(mx.abs(r - o).max().item() for r, o in zip(ref, ours))
        if not diff <= tolerance:  # also catches NaN
            raise TargetCompatibilityError(
                f"tap-parity probe failed: the adapter's logits differ from the model's own by {diff:.3g} "
                f"(> {tolerance}); this mlx-lm version or model class is not supported"
            )
        return diff

    def route_kernels(self, mode: str | None = None, force: bool = False) -> int:
        """Run this target's layers through the kernel registry (this model object only).

        Swaps every affine ``QuantizedLinear`` for a :class:`~.kernels.KernelQuantizedLinear`, the
        attention of supported families for a :class:`~.kernels.KernelAttention` and a tied quantized
        LM head for ``kernels.qmm``, so the plain step (1 row) and the verify (B rows) both use the
        row-count-invariant kernels on a GPU. Then the probe runs again against the unrouted model's
        logits (relative tolerance 1e-3 in float32, 0.1 in 16-bit): a mismatch puts the original
        modules back with one warning line, never a wrong token.

        Args:
            mode: kernel mode (``None``: ``MLX_DFLASH2_KERNELS``). ``"reference"``, or a CPU backend,
                routes nothing (the references are MLX's own ops: nothing to gain) unless ``force``.
            force: route even where only the references would run (tests of the routing itself).

        Returns:
            How many modules were routed (0: none).

        Raises:
            ValueError: an unknown mode.
        """
        from . import kernels as K

        mode = K.check_mode(mode)
        if self._routes or (not force and (mode == "reference" or K.backend() == "cpu")):
            return len(self._routes)
        ref = self._probe_logits(own=False)
        emb = self.inner.embed_tokens
        swaps = K.route_quantized_linears(self.model, mode) + K.route_attention(self.layers, mode)
        head = self.model.lm_head if hasattr(self.model, "lm_head") else emb.as_linear
        if not hasattr(self.model, "lm_head") and isinstance(emb, nn.QuantizedEmbedding) and getattr(emb, "mode", "affine") == "affine":
            def head(h, emb=emb):
                return K.qmm(h, emb.weight, emb.scales, emb.biases, emb.group_size, emb.bits, mode=mode)
        old_head, self._head = self._head, head
        self._routes, self.kernels = swaps, mode
        ours = self._probe_logits(own=False)
        scale = max(max(mx.abs(r).max().item() for r in ref), 1.0)
        diff = max(mx.abs(r - o).max().item() for r, o in zip(ref, ours)) / scale
        # 16-bit: rounding grows with depth (a random-weight 64-layer bf16 target measured 0.036 on the H200
        # with every kernel passing its own gate); a wrong kernel is off by the logits' whole scale
        tol = 1e-3 if self.dtype == mx.float32 else 0.1
        if not diff <= tol:
            K.undo_routes(swaps)
            self._routes, self.kernels, self._head = [], "reference", old_head
            import logging

            logging.getLogger("mlx_dflash2").warning(
                "mlx_dflash2: the target's kernel path differs from its reference by %.3g (relative, > %g); "
                "using the MLX reference path", diff, tol)
            return 0
        return len(swaps)


def trim_cache(cache: list, n: int) -> None:
    """Drop the last ``n`` rows of every layer's KV cache (rollback)."""
    if n <= 0:
        return
    for c in cache:
        c.trim(n)


def cache_length(cache: list) -> int:
    """Number of committed rows in the cache (all layers agree)."""
    return int(cache[0].offset)
