"""Target adapter: run an mlx-lm target with taps at ``target_layer_ids`` and exact rollback.

DFlash conditions its drafter on *context features*: the residual stream after
some target decoder layers (before the final norm; Hugging Face's
``hidden_states[id + 1]``), concatenated along the feature axis
(DFlash2 spec §1.2). mlx-lm models only return logits, so during a call the
adapter stands a small proxy in for each tapped decoder layer (in this model
object's layer list only, put back when the call returns) that keeps the layer's
output; everything up to the final norm is the text model's own ``__call__``:
its embedding scale, masks, per-layer-type caches (full attention, sliding
window, GatedDeltaNet recurrent state), for every supported mlx-lm family; the
LM head (tied or not, with the family's logit soft-capping) is applied by the
adapter, so a kernel can take it over (:meth:`TargetAdapter.route_kernels`).

The caches are :mod:`mlx_dflash2.caches`' exact-rollback versions of mlx-lm's
(``KVCache`` kept; ``RotatingKVCache`` -> ``WindowKVCache``; a GatedDeltaNet
layer's ``ArraysCache`` -> ``RecurrentCache``), so the loop rolls back rejected
drafts with :func:`trim_cache` whatever the layer type. A load-time *parity
probe* checks the forward and the head against the model's own ``__call__``
(logits within 1e-3) and refuses the model otherwise, so an mlx-lm change that
breaks an assumption is caught at load, never as wrong output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from .modelconfig import sliding_window_layers

__all__ = ["TargetAdapter", "TargetCompatibilityError", "ForwardResult", "SUPPORTED_MODEL_TYPES",
           "trim_cache", "cache_length"]

# mlx-lm families probed here (model_type of the checkpoint's config): dense full attention; GatedDeltaNet
# hybrids (Qwen3-Next, Qwen3.5 and later: vision-language checkpoints whose text model's config is nested
# under text_config); sliding-window hybrids (Gemma 3 as gemma3 or gemma3_text, Gemma 4). Others are refused.
DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + ("qwen3_next", "qwen3_5", "gemma3", "gemma3_text", "gemma4",
                                             "gemma4_text")

PARITY_TOLERANCE = 1e-3
# kernels="auto" keeps the routed kernels only if a one-token step plus a 16-row verify (what speculative rounds and
# the schedule's plain rounds run) cost at most this much more than with MLX's ops (on the H200 the routed 8B step
# measured 1.8x; the 1.5B's 16-row verify 1.1 plain steps routed and 2.5-3.0 with MLX's ops, while its routed step
# read 0.9-1.1x MLX's, so a decision on the step alone flipped between runs) ...
AUTO_STEP_LIMIT = 1.10
# ... and the routed one-token step alone at most this much more (the plain loop, `--drafter none`, must not get
# much slower than mlx-lm's)
AUTO_PLAIN_LIMIT = 1.25
#: verify rows :meth:`TargetAdapter.route_kernels` times in mode "auto" (the widest block the loop verifies)
AUTO_VERIFY_ROWS = 16


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


class _Tap:
    """Stands in for one decoder layer during a call: runs it and keeps its output (the first element
    when the layer returns a tuple, as Gemma 4's do). Attribute reads go to the layer (``is_linear``,
    ``layer_type``... that the model's ``__call__`` inspects)."""

    __slots__ = ("layer", "out")

    def __init__(self, layer):
        self.layer, self.out = layer, None

    def __call__(self, *args, **kwargs):
        r = self.layer(*args, **kwargs)
        self.out = r[0] if isinstance(r, tuple) else r
        return r

    def __getattr__(self, name):
        return getattr(self.layer, name)


class _TreeCache:
    """A layer's ``KVCache`` during a tree forward (:mod:`mlx_dflash2.tree`): its own update, offset and buffers,
    and the tree's attention mask in place of the causal one (mlx-lm's models ask the first layer's cache for
    the mask, ``create_attention_mask``)."""

    __slots__ = ("cache", "mask")

    def __init__(self, cache, mask: mx.array):
        self.cache, self.mask = cache, mask

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return self.mask

    def __getattr__(self, name):
        return getattr(self.cache, name)


class _TreeRope:
    """An attention's RoPE during a tree forward: row ``i`` of ``[1, H, L, D]`` rotated at ``positions[i]``
    (its depth past the cache), through the model's own RoPE module (any scaling) with per-example offsets: the
    rows are laid out as a batch of ``L`` one-row sequences for the call."""

    __slots__ = ("rope", "positions")

    def __init__(self, rope, positions: mx.array):
        self.rope, self.positions = rope, positions

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        return self.rope(x.swapaxes(0, 2), offset=self.positions).swapaxes(0, 2)


def text_config(config: dict) -> dict:
    """The text model's config: ``text_config`` merged over the top level (Qwen3.5 and Gemma 3/4
    vision-language checkpoints nest it there), else ``config`` itself."""
    tc = config.get("text_config")
    if not isinstance(tc, dict):
        return config
    out = {k: v for k, v in config.items() if k != "text_config"}
    out.update(tc)
    return out


def _relative_difference(ref: list[mx.array], other: list[mx.array]) -> float:
    """The route probe's measure: max |difference| over the probe's logits, over the reference's max |logit|
    (at least 1)."""
    scale = max(max(mx.abs(r).max().item() for r in ref), 1.0)
    return max(mx.abs(r - o).max().item() for r, o in zip(ref, other)) / scale


class TargetAdapter:
    """Drive an mlx-lm causal LM with tap outputs and exactly rollable caches.

    Args:
        model: an mlx-lm ``Model`` of a supported family (its text model, ``model`` or
            ``model.language_model``, has ``model.embed_tokens``, ``model.layers``, ``model.norm``).
        config: the model's config dict (``model_type`` is checked; a nested ``text_config`` is read).
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
        rollback: rows every cache can roll back exactly (a sliding-window layer keeps this many rows
            past its window; :mod:`mlx_dflash2.caches`). The loop trims at most two blocks back.

    Raises:
        TargetCompatibilityError: unsupported family, a ``sliding_window`` in the config that the
            model class would ignore on only some layers (:func:`~.modelconfig.sliding_window_layers`;
            on every layer it is honoured through window caches), caches of an unsupported kind, or
            the parity probe failed.
        ValueError: ``vocab_size < 1``.
    """

    def __init__(self, model: nn.Module, config: dict, probe: bool = True, vocab_size: int | None = None,
                 kernels: str | None = "reference", rollback: int = 64):
        self.model = model
        self.config = config
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise TargetCompatibilityError(
                f"target model_type {model_type!r} is not supported by the speculative loop "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        self.text_config = text_config(config)
        self.lm = getattr(model, "language_model", model)  # the text model (logits from token ids)
        inner = getattr(self.lm, "model", None)
        for attr in ("embed_tokens", "layers", "norm"):
            if inner is None or not hasattr(inner, attr):
                raise TargetCompatibilityError(f"target has no model.{attr}; cannot attach taps")
        self.inner = inner
        self.layers = list(inner.layers)
        self.rollback = int(rollback)
        # a window the model class ignores (mlx-lm's llama/qwen2 run a sliding_window as full attention):
        # honoured through window caches when it covers every layer (one mask serves them all), else refused
        self._window = None
        if model_type in DENSE_MODEL_TYPES:
            window, sliding = sliding_window_layers(self.text_config)
            if sliding and len(sliding) != len(self.layers):
                raise TargetCompatibilityError(
                    f"target config sets sliding_window={window} (below its context of "
                    f"{self.text_config.get('max_position_embeddings') or 'unknown'} tokens) on layers {sliding} "
                    f"only; mlx-lm's {model_type} class shares one attention mask across layers and would run "
                    "them as full attention, a different model, so it is refused"
                )
            self._window = window if sliding else None
        try:
            kinds = self.make_cache()
        except (TypeError, ValueError) as e:
            raise TargetCompatibilityError(f"target caches are not supported: {e}") from None
        from .caches import RecurrentCache, install_recording

        if any(isinstance(c, RecurrentCache) for c in kinds):
            # each GatedDeltaNet mixer of this model object records its block inputs into its cache, so a
            # rejected tail is rolled back exactly (mlx_dflash2.caches: snapshot + replay)
            install_recording(model)
        self._head = self.lm.lm_head if hasattr(self.lm, "lm_head") else inner.embed_tokens.as_linear
        softcap = getattr(self.lm, "final_logit_softcapping", None)
        self._softcap = float(softcap) if softcap else None
        rows = self.vocab_rows
        if vocab_size is not None and (isinstance(vocab_size, bool) or int(vocab_size) < 1):
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size!r}")
        self.vocab_size = rows if vocab_size is None else min(int(vocab_size), rows)
        self._padding = None  # bool [rows]: the padding rows, or None
        if self.vocab_size < rows:
            self._padding = mx.arange(rows) >= self.vocab_size
            mx.eval(self._padding)  # not lazy: the adapter may be used on another thread (server worker)
        self._routes: list = []
        self._tree_ok: bool | None = None  # tree_capable, decided at its first use
        self.kernels = "reference"
        self.kernel_choice: dict = {}  # what route_kernels measured and decided (printed by --verbose)
        if probe:
            self.check_parity()
        self.route_kernels(kernels)

    # -- geometry ---------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.text_config["hidden_size"])

    @property
    def vocab_rows(self) -> int:
        """Rows of the (shared) input embedding = width of the LM head."""
        emb = self.inner.embed_tokens
        return int(emb.weight.shape[0])

    @property
    def max_context(self) -> int | None:
        v = self.text_config.get("max_position_embeddings")
        return int(v) if v else None

    @property
    def dtype(self) -> mx.Dtype:
        w = getattr(self.inner.norm, "weight", None)
        return w.dtype if w is not None else mx.float32

    @property
    def layer_kinds(self) -> list[str]:
        """Per cache entry: ``"attention"``, ``"window"`` or ``"recurrent"`` (what :meth:`make_cache` holds)."""
        from .caches import RecurrentCache, WindowKVCache

        return ["recurrent" if isinstance(c, RecurrentCache) else "window" if isinstance(c, WindowKVCache)
                else "attention" for c in self.make_cache()]

    # -- shared modules for the drafter ----------------------------------
    def embed(self, ids: mx.array) -> mx.array:
        """Token embeddings, ``ids`` int ``[..., L]`` -> ``[..., L, D]`` (the embedding table itself;
        a family's input scale, e.g. Gemma's sqrt(D), is not applied)."""
        return self.inner.embed_tokens(ids)

    def lm_head(self, h: mx.array) -> mx.array:
        """The target LM head on final-normed states ``[..., D]`` -> ``[..., V]`` (the family's logit
        soft-capping included), padding rows included (the drafter applies it to its own states and
        masks its ids itself; the target's own logits are :meth:`logits`)."""
        out = self._head(h)
        if self._softcap is not None:
            out = mx.tanh(out / self._softcap) * self._softcap
        return out

    def head_rows(self, ids: mx.array):
        """The LM head restricted to the rows ``ids`` (int32 ``[Vd]``, ascending, each ``< vocab_rows``): a
        function ``h [..., D] -> [..., Vd]`` whose column ``j`` is :meth:`lm_head`'s column ``ids[j]``
        (soft-capping included), for a drafter whose proposals keep to a draft vocabulary
        (:class:`~.proposers.DFlashProposer` ``draft_vocab``).

        The head's rows are gathered once: a dense head ``[V, D]`` (an ``nn.Linear`` or a tied
        ``nn.Embedding``) into ``[Vd, D]``, an affine-quantized one (``nn.QuantizedLinear``, a routed
        kernel linear, a tied ``nn.QuantizedEmbedding``) into packed rows with their scales and biases, run
        by the kernel registry's ``qmm`` in this target's kernel mode. Any other head runs whole and
        its columns are taken (same values, no saving). Idea: FR-Spec (Zhao et al. 2025, arXiv
        2502.14856), a frequency-ranked draft vocabulary.

        Raises:
            ValueError: ``ids`` not a 1-D array of ids in ``[0, vocab_rows)``.
        """
        ids = mx.array(ids).astype(mx.int32)
        if ids.ndim != 1 or ids.size == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_rows:
            raise ValueError(f"a draft vocabulary is a non-empty 1-D list of ids in [0, {self.vocab_rows})")
        mod = self.lm.lm_head if hasattr(self.lm, "lm_head") else self.inner.embed_tokens
        mod = getattr(mod, "original", mod)  # a routed kernel linear holds the original layer
        softcap = self._softcap
        mode = self.kernels

        def capped(f):
            if softcap is None:
                return f

            def g(h):
                return mx.tanh(f(h) / softcap) * softcap
            return g

        if "scales" in mod and getattr(mod, "mode", "affine") == "affine" and "weight" in mod:
            w, s = mod["weight"][ids], mod["scales"][ids]
            b = mod["biases"][ids] if "biases" in mod else None
            bias = mod["bias"][ids] if "bias" in mod else None
            mx.eval(w, s, *(x for x in (b, bias) if x is not None))
            gs, bits = mod.group_size, mod.bits

            from . import kernels as K

            def head(h):
                if mode == "reference":  # what nn.QuantizedLinear runs
                    y = mx.quantized_matmul(h, w, s, b, transpose=True, group_size=gs, bits=bits)
                else:
                    y = K.qmm(h, w, s, b, gs, bits, mode=mode)
                return y + bias if bias is not None else y
            return capped(head)
        if "weight" in mod and "scales" not in mod:
            w = mod["weight"][ids]
            bias = mod["bias"][ids] if "bias" in mod else None
            mx.eval(w, *(x for x in (bias,) if x is not None))

            def head(h):
                y = h @ w.T
                return y + bias if bias is not None else y
            return capped(head)
        mx.eval(ids)
        return lambda h: mx.take(self.lm_head(h), ids, axis=-1)

    def logits(self, h: mx.array) -> mx.array:
        """The target's logits from final-normed states ``[..., D]`` -> ``[..., V]``: the LM head
        with ``-inf`` at ids ``>= vocab_size`` (what :meth:`forward` returns)."""
        return self.mask_padding(self.lm_head(h))

    def mask_padding(self, logits: mx.array) -> mx.array:
        """``logits`` ``[..., V]`` with ``-inf`` at the padding ids ``>= vocab_size`` (unchanged
        when the embedding is not padded)."""
        if self._padding is None:
            return logits
        return mx.where(self._padding, mx.array(-mx.inf, logits.dtype), logits)

    def make_cache(self) -> list:
        """A fresh per-request cache: one entry per cached decoder layer, the model's own kinds made
        exactly rollable (:func:`mlx_dflash2.caches.convert_caches`; a Mistral-style window on every
        layer: window caches)."""
        from .caches import WindowKVCache, convert_caches

        caches = convert_caches(make_prompt_cache(self.lm), slack=self.rollback)
        if self._window:
            caches = [WindowKVCache(self._window, slack=self.rollback) if type(c) is KVCache else c
                      for c in caches]
        return caches

    # -- forward ----------------------------------------------------------
    def _call(self, fn, tap_ids: Sequence[int]):
        """Run ``fn()`` (the model's own call) with :class:`_Tap` proxies at ``tap_ids``; returns
        ``(fn's result, {id: tap})``."""
        layers = self.inner.layers
        taps = {}
        for i in dict.fromkeys(tap_ids):
            taps[i] = layers[i] = _Tap(layers[i])
        try:
            out = fn()
        finally:
            for i, t in taps.items():
                layers[i] = t.layer
        missing = [i for i, t in taps.items() if t.out is None]
        if missing:
            raise TargetCompatibilityError(f"the target's call did not run tapped layers {missing}")
        return out, taps

    def forward(
        self,
        tokens: mx.array,
        cache: list,
        tap_ids: Sequence[int] = (),
        last_only: bool = False,
        tree=None,
    ) -> ForwardResult:
        """Run the target on new tokens, appending them to ``cache``.

        Args:
            tokens: int ``[L]`` new token ids (positions ``cache offset ..+L-1``).
            cache: the request's cache from :meth:`make_cache` (mutated: grows by ``L`` positions); with
                ``tree``, also a batch's cache of one full-attention row (:class:`~.batch.RaggedKVCache`).
            tap_ids: 0-based decoder layer ids whose outputs are tapped.
            last_only: compute logits for the last position only.
            tree: a :class:`~.tree.DraftTree` of ``L - 1`` nodes: ``tokens`` are the anchor and the nodes, each
                node at position ``offset + depth`` attending to the cache, the anchor and its ancestors only
                (needs :attr:`tree_capable`; the cache then holds the rows in node order until
                :func:`~.tree.compact_cache`).

        Returns:
            :class:`ForwardResult` with logits ``[L, V]`` (``[1, V]`` if
            ``last_only``) and features ``[L, len(tap_ids)*D]`` or None.

        Raises:
            ValueError: a tree whose node count is not ``L - 1``, or a tree over a batch cache of several rows.
        """
        if tree is not None:
            return self._tree_forward(tokens, cache, tap_ids, tree)
        h, taps = self._call(lambda: self.inner(tokens[None], cache=cache), tap_ids)
        features = None
        if tap_ids:
            features = mx.concatenate([taps[i].out for i in tap_ids], axis=-1)[0]
        if last_only:
            h = h[:, -1:]
        return ForwardResult(self.logits(h)[0], features)

    @property
    def tree_capable(self) -> bool:
        """Whether :meth:`forward` can verify tree drafts: a dense family whose every layer is full attention
        with mlx-lm's ``KVCache`` and has a RoPE module, no routed kernels (:meth:`route_kernels`: their row
        invariance covers chains only), and the tree probe (:meth:`check_tree`, run at the first call: a tree's
        rows against the same tokens fed as chains) passed."""
        if self._tree_ok is None:
            self._tree_ok = self._tree_layout() and self.check_tree()
        return self._tree_ok

    def _tree_layout(self) -> bool:
        if self.config.get("model_type") not in DENSE_MODEL_TYPES or self._window:
            return False
        if self._routes:
            # routed kernels make the plain step and the verify compute every row alike (greedy output equals
            # plain decoding even at near-ties); a tree's rows would take MLX's attention with an explicit mask
            # instead of verify_attention, so a tie could break otherwise: chains only (a tree mask in
            # verify_attention would lift this)
            return False
        if not all(type(c) is KVCache for c in self.make_cache()):
            return False
        for layer in self.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is None or not hasattr(attn, "rope"):
                return False
        return True

    def _swap_ropes(self, positions: mx.array):
        """Put a :class:`_TreeRope` in every attention (this model object only); returns the undo."""
        undo = []
        for layer in self.inner.layers:
            attn = layer.self_attn  # an instance attribute shadows the module's child for the call
            object.__setattr__(attn, "rope", _TreeRope(attn.rope, positions))
            undo.append(lambda attn=attn: object.__delattr__(attn, "rope"))

        def restore():
            for u in undo:
                u()

        return restore

    def _tree_forward(self, tokens, cache, tap_ids, tree) -> ForwardResult:
        if tokens.shape[0] != tree.n + 1:
            raise ValueError(f"a tree of {tree.n} nodes verifies {tree.n + 1} tokens, got {tokens.shape[0]}")
        offset = cache[0].offset
        if not isinstance(offset, int):  # a batch's cache (RaggedKVCache): one full-attention row only
            offset = cache[0].solo_length() if hasattr(cache[0], "solo_length") else None
            if offset is None:
                raise ValueError("a tree forward needs a solo cache or a batch cache of one full-attention row")
        positions = mx.array([offset] + [offset + d for d in tree.depths], dtype=mx.int32)
        views = [_TreeCache(c, tree.mask(offset)) for c in cache]
        restore = self._swap_ropes(positions)
        try:
            h, taps = self._call(lambda: self.inner(tokens[None], cache=views), tap_ids)
        finally:
            restore()
        features = None
        if tap_ids:
            features = mx.concatenate([taps[i].out for i in tap_ids], axis=-1)[0]
        return ForwardResult(self.logits(h)[0], features)

    def check_tree(self) -> bool:
        """Tree probe: after a 5-token prefix, a tree of an anchor and four nodes (two children of the anchor,
        each with one child) must give each row the logits of the same tokens fed as a chain (relative tolerance
        1e-3 in float32, 0.05 in 16-bit; a wrong position or mask is off by the logits' scale). A failure
        disables tree drafts with one warning line (chains go on as before)."""
        from .tree import DraftTree

        V = self.vocab_size
        ids = [(17 + 7919 * i) % V for i in range(10)]
        prefix, anchor, a, b, c, d = ids[:5], ids[5], ids[6], ids[7], ids[8], ids[9]
        tree = DraftTree((-1, -1, 0, 1), (1, 1, 2, 2))
        try:
            cache = self.make_cache()
            self.forward(mx.array(prefix, dtype=mx.int32), cache)
            rows = self.forward(mx.array([anchor, a, b, c, d], dtype=mx.int32), cache, tree=tree).logits
            ref = []
            for chain in ([anchor, a, c], [anchor, b, d]):
                cc = self.make_cache()
                self.forward(mx.array(prefix, dtype=mx.int32), cc)
                ref.append(self.forward(mx.array(chain, dtype=mx.int32), cc).logits)
            want = [ref[0][0], ref[0][1], ref[1][1], ref[0][2], ref[1][2]]
            got = [rows[i] for i in range(5)]
            diff = _relative_difference([w[:V].astype(mx.float32) for w in want],
                                        [g[:V].astype(mx.float32) for g in got])
        except Exception as e:  # noqa: BLE001 (any failure of the tree path disables it, never the chain)
            diff, err = float("inf"), e
        else:
            err = None
        tol = 1e-3 if self.dtype == mx.float32 else 0.05
        if not diff <= tol:
            import logging

            logging.getLogger("mlx_dflash2").warning(
                "mlx_dflash2: tree drafts disabled: the target's tree forward differs from its chain forward by "
                "%s; verifying chains", f"{diff:.3g} (relative, > {tol})" if err is None else f"an error ({err})")
            return False
        return True

    def taps(self, tokens: mx.array, tap_ids: Sequence[int], final: bool = False):
        """Context features of whole sequences, without a cache (training, replay).

        Args:
            tokens: int ``[N, T]`` (right padding is harmless: attention is causal).
            tap_ids: decoder layer ids to tap (non-empty).
            final: also return the final-normed last-layer states (the LM
                head's input: ``logits(final)`` are the target's logits).

        Returns:
            ``[N, T, len(tap_ids)*D]`` (layers after the last tap are built into the graph but never
            evaluated unless ``final``), or ``(taps, final [N, T, D])`` with ``final=True``.
        """
        h, taps = self._call(lambda: self.inner(tokens), tap_ids)
        feats = mx.concatenate([taps[i].out for i in tap_ids], axis=-1)
        return (feats, h) if final else feats

    def _probe_logits(self, own: bool) -> list[mx.array]:
        """Logits of the probe (a 6-token prefill, then a 3-token cached step; real vocabulary only)
        through the model's own ``__call__`` and caches (``own``) or :meth:`forward`, plus the head
        applied to :meth:`taps`' final states of the 6 tokens (ours)."""
        V = self.vocab_size
        # a window the model class ignores (honoured by our caches only) must not be reached by the probe
        n = min(9, self._window) if self._window else 9
        k = max(1, 2 * n // 3)
        ids = mx.array([(17 + 7919 * i) % V for i in range(n)], dtype=mx.int32)
        if own:
            c = make_prompt_cache(self.lm)
            out = [self.lm(ids[None, :k], cache=c)[0]]
            out += [self.lm(ids[None, k:], cache=c)[0], out[0]] if n > k else [out[0]]
        else:
            c = self.make_cache()
            out = [self.forward(ids[:k], c, tap_ids=(0,)).logits]
            if n > k:
                out.append(self.forward(ids[k:], c).logits)
            out.append(self.logits(self.taps(ids[None, :k], (0,), final=True)[1])[0])
        out = [o[:, :V].astype(mx.float32) for o in out]
        mx.eval(out)
        return out

    def check_parity(self, tolerance: float = PARITY_TOLERANCE) -> float:
        """Tap-parity probe: the adapter must reproduce ``model(...)``.

        Runs a 6-token prefill and a 3-token cached step through both the
        model's own ``__call__`` (with mlx-lm's caches) and :meth:`forward` (with ours and the tap
        proxies: the text model's own call, then our head, :meth:`logits`), and the LM head on
        :meth:`taps`' final states, and compares the logits of the real
        vocabulary (the padding rows are ``-inf`` in ours).

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

    def route_kernels(self, mode: str | None = None, force: bool = False, probe: bool = True) -> int:
        """Run this target's layers through the kernel registry (this model object only).

        Swaps every affine ``QuantizedLinear`` for a :class:`~.kernels.KernelQuantizedLinear`, the SwiGLU
        MLPs for a :class:`~.kernels.KernelMLP` (gate and up in one launch), the
        attention of the dense families for a :class:`~.kernels.KernelAttention`, a tied quantized
        LM head for ``kernels.qmm`` and the GatedDeltaNet mixers of hybrid targets for their stepping
        versions (:func:`~.kernels.route_gated_delta`: a verify block keeps every step's state, so a
        rollback selects instead of replaying), so the plain step (1 row) and the verify (B rows) both
        use the registry's kernels on a GPU. Then the probe runs again against the unrouted model's
        logits (relative tolerance 1e-3 in float32, 0.1 in 16-bit): a mismatch puts the original
        modules back with one warning line, never a wrong token. In mode ``"auto"`` the routes also
        have to pay: a one-token step (the plain loop's, and the schedule's plain rounds) and a verify of
        :data:`AUTO_VERIFY_ROWS` rows (a speculative round's) are timed with MLX's ops and routed
        (:meth:`time_step`), and the kernels are kept only if the routed step and verify together cost at most
        :data:`AUTO_STEP_LIMIT` times MLX's, and the routed step alone at most :data:`AUTO_PLAIN_LIMIT` times
        (``"kernel"`` keeps them regardless: greedy speculative output then equals plain decoding token for
        token). ``kernel_choice`` records the times and the decision.

        Args:
            mode: kernel mode (``None``: ``MLX_DFLASH2_KERNELS``). ``"reference"``, or a CPU backend,
                routes nothing (the references are MLX's own ops: nothing to gain) unless ``force``.
            force: route even where only the references would run (tests of the routing itself).
            probe: compare the routed model's logits with the unrouted model's (above). ``False`` keeps the
                routes without that stack-level comparison (each kernel still passes its own numerics gate
                at first use): for random-weight benchmark targets only. A random GatedDeltaNet hybrid is
                chaotic in 16 bits: the same model with bf16 and with float32 activations differs by 0.28 of
                its logit scale at 8 layers (0.05 for a dense one; ``benchmarks/gpu/probe_routes.py``), so at
                64 layers no probe can tell a kernel's legitimate rounding (fp32 accumulation where MLX
                rounds to bf16) from a fault; trained models are not like that.

        Returns:
            How many modules were routed (0: none).

        Raises:
            ValueError: an unknown mode.
        """
        from . import kernels as K
        from .kernels.block import compile_enabled, route_blocks, submit_every

        mode = K.check_mode(mode)
        compile_layers = compile_enabled(K.backend())  # a bad MLX_DFLASH2_COMPILE fails before any swap
        submit_every()  # and a bad MLX_DFLASH2_SUBMIT_EVERY
        K.qmm_fuse_enabled()  # and a bad MLX_DFLASH2_QMM_FUSE
        if self._routes or (not force and (mode == "reference" or K.backend() == "cpu")):
            return len(self._routes)
        self._tree_ok = None  # the tree probe runs again on the routed layers
        ref = self._probe_logits(own=False) if probe else None
        rows = max(1, min(AUTO_VERIFY_ROWS, self.rollback))
        t_ref = (self.time_step(), self.time_step(rows=rows)) if mode == "auto" else None
        emb = self.inner.embed_tokens
        swaps = K.route_quantized_linears(self.model, mode)
        swaps += (K.route_mlps(self.layers, mode) + K.route_attention(self.layers, mode)  # its classes only
                 + K.route_gated_delta(self.model, mode))  # hybrid: every step's state kept in a verify block
        if compile_layers:  # the routed layers' graphs built by compiled functions (host cost)
            swaps += route_blocks(self.inner.layers)  # the model's own list (self.layers is a copy)
        head = self.lm.lm_head if hasattr(self.lm, "lm_head") else emb.as_linear
        if not hasattr(self.lm, "lm_head") and isinstance(emb, nn.QuantizedEmbedding) and getattr(emb, "mode", "affine") == "affine":
            def head(h, emb=emb):
                return K.qmm(h, emb.weight, emb.scales, emb.biases, emb.group_size, emb.bits, mode=mode)
        old_head, self._head = self._head, head
        self._routes, self.kernels = swaps, mode
        diff, tol = 0.0, 0.0
        if probe:
            ours = self._probe_logits(own=False)
            diff = _relative_difference(ref, ours)
            # 16-bit: rounding grows with depth (a random-weight 64-layer bf16 target measured 0.036 on the H200
            # with every kernel passing its own gate); a wrong kernel is off by the logits' whole scale
            tol = 1e-3 if self.dtype == mx.float32 else 0.1
        self.kernel_choice = {"probe_difference": diff if probe else None}
        if not diff <= tol:
            K.undo_routes(swaps)
            self._routes, self.kernels, self._head = [], "reference", old_head
            import logging

            why = ""
            if self.dtype != mx.float32:  # how much the model itself moves with its rounding
                sens = self.rounding_sensitivity(ref)
                self.kernel_choice["bf16_vs_float32_activations"] = sens
                if sens >= tol:
                    why = (f"; the unrouted model itself moves by {sens:.3g} between 16-bit and float32 "
                           "activations, so this probe cannot tell rounding from a fault (random weights?)")
            logging.getLogger("mlx_dflash2").warning(
                "mlx_dflash2: the target's kernel path differs from its reference by %.3g (relative, > %g)%s; "
                "using the MLX reference path", diff, tol, why)
            return 0
        if t_ref is not None:
            t_k = (self.time_step(), self.time_step(rows=rows))
            keep = keep_kernels(t_ref, t_k)
            self.kernel_choice.update(step_ms_reference=t_ref[0] * 1e3, step_ms_kernel=t_k[0] * 1e3,
                                      verify_ms_reference=t_ref[1] * 1e3, verify_ms_kernel=t_k[1] * 1e3,
                                      routed=keep)
            if not keep:
                K.undo_routes(swaps)
                self._routes, self.kernels, self._head = [], "reference", old_head
                import logging

                logging.getLogger("mlx_dflash2").info(
                    "mlx_dflash2: a one-token step and a %d-row verify take %.2f and %.2f ms with the fused kernels, "
                    "%.2f and %.2f ms with MLX's ops: using MLX's ops (--kernels kernel keeps the kernels)", rows, t_k[0] * 1e3, t_k[1] * 1e3, t_ref[0] * 1e3, t_ref[1] * 1e3)
                return 0
        return len(swaps)

    def rounding_sensitivity(self, ref: list[mx.array] | None = None) -> float:
        """How far the probe's logits move when this (unrouted) model runs with float32 activations instead
        of its own 16-bit ones: max absolute difference over the 16-bit logits' max (>= 1).

        The model's floating parameters are cast to float32 for one probe (exact) and then put back (the
        same arrays); peak memory grows by the float32 copy of the non-quantized parameters (norms, scales
        and biases of quantized layers) for that probe.

        Args:
            ref: the 16-bit probe logits (:meth:`_probe_logits` with ``own=False``), or ``None`` to compute them.

        Returns:
            The relative difference (0.0 for a float32 model).
        """
        if self.dtype == mx.float32:
            return 0.0
        from mlx.utils import tree_map

        if ref is None:
            ref = self._probe_logits(own=False)
        saved = self.model.parameters()
        try:
            self.model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a,
                                       saved))
            f32 = self._probe_logits(own=False)
        finally:
            self.model.update(saved)
        return _relative_difference(ref, f32)

    def time_step(self, context: int = 32, warmup: int = 3, repeats: int = 7, rows: int = 1) -> float:
        """Median seconds of a cached forward of ``rows`` tokens after ``context`` tokens (``rows=1``: the plain
        loop's unit; more: a verify of that many rows), through :meth:`forward` with this adapter's current
        routes; ``warmup`` untimed forwards first (a GPU compiles its kernels there). Each forward is trimmed
        off again, so every timed one sees the same context.

        Raises:
            ValueError: ``context``, ``repeats`` or ``rows`` < 1, ``warmup`` < 0, or one of them not an int.
        """
        import time

        if any(not isinstance(v, int) or isinstance(v, bool) for v in (context, warmup, repeats, rows)):
            raise ValueError("context, warmup, repeats and rows must be integers; got "
                             f"{context!r}, {warmup!r}, {repeats!r}, {rows!r}")
        if context < 1 or repeats < 1 or warmup < 0 or rows < 1:
            raise ValueError("need context >= 1, repeats >= 1, warmup >= 0, rows >= 1; got "
                             f"{context}, {repeats}, {warmup}, {rows}")
        if self._window:
            context = max(1, min(context, self._window - rows))
        V = self.vocab_size
        ids = mx.array([(29 + 7919 * i) % V for i in range(context + rows)], dtype=mx.int32)
        cache = self.make_cache()
        mx.eval(self.forward(ids[:context], cache).logits)
        times = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            mx.eval(self.forward(ids[context:], cache).logits)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            trim_cache(cache, rows)
        times.sort()
        return times[len(times) // 2]


def keep_kernels(t_ref: tuple[float, float], t_kernel: tuple[float, float]) -> bool:
    """``kernels="auto"``'s decision from ``(one-token step, verify of AUTO_VERIFY_ROWS rows)`` seconds with MLX's
    ops (``t_ref``) and routed (``t_kernel``): keep the kernels if the routed step plus verify cost at most
    :data:`AUTO_STEP_LIMIT` times MLX's and the routed step alone at most :data:`AUTO_PLAIN_LIMIT` times."""
    return (t_kernel[0] + t_kernel[1] <= AUTO_STEP_LIMIT * (t_ref[0] + t_ref[1])
            and t_kernel[0] <= AUTO_PLAIN_LIMIT * t_ref[0])


def trim_cache(cache: list, n: int) -> None:
    """Roll every layer's cache back by its last ``n`` positions (exact for every cache kind of
    :mod:`mlx_dflash2.caches` within its rollback capacity; ValueError past it)."""
    if n <= 0:
        return
    for c in cache:
        c.trim(n)


def cache_length(cache: list) -> int:
    """Number of positions in the cache (all layers agree)."""
    return int(cache[0].offset)
