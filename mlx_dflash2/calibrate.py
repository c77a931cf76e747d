"""Per-machine calibration of the verify cost: what a target forward of M new tokens costs here.

The cost of verifying a block of ``M`` rows, ``T(M)``, against a one-token step ``T(1)`` decides which block
size pays, and it is a property of the machine, the target's shape and quantization, the MLX version and the
kernels, not of the model alone: on a 2-core CPU (dense float32 SmolLM2-135M) ``T(16)/T(1)`` is about 2 and
``T(12)`` costs more than ``T(16)``; on the H200 ``T(4)`` costs more than ``T(16)`` (shared research
``h200-profile.md``); a quantized matmul on MLX's CPU backend costs about ``M`` steps. So the adaptive schedule
(:class:`~.proposers.AdaptiveSchedule`) measures instead of assuming: :func:`measure_verify_costs` times the
target's forwards at a few widths after a short and a long context (a verify row's cost grows with the
context it attends to: on that CPU ``T(16)/T(1)`` reads 1.8 after 128 tokens, 2.9 after 1K and 3.8 after 8K,
and widths chosen from the short table made the default 0.78x of plain decoding after an 8K prompt; each
round reads the cost at its own context, :meth:`VerifyCosts.verify`) and the drafter's proposal,
:func:`calibrate` caches the table in a JSON
file keyed by a :func:`fingerprint` of everything that changes it, and a :class:`~.proposers.WidthPolicy`
picks each round's verify width from it and the acceptance measured so far.

The cache: ``~/.cache/mlx_dflash2/calibration.json`` (``$MLX_DFLASH2_CALIBRATION_CACHE`` names another file),
one entry per fingerprint. ``load(..., calibrate=True)`` / ``--calibrate`` measure again and replace the entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from .target import cache_length, trim_cache

logger = logging.getLogger("mlx_dflash2")

__all__ = [
    "DEFAULT_WIDTHS",
    "CACHE_ENV",
    "VerifyCosts",
    "measure_verify_costs",
    "fingerprint",
    "cache_key",
    "cache_path",
    "load_cached",
    "store",
    "calibrate",
]

DEFAULT_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)  # verify widths M (rows of one target forward) measured by default
CACHE_ENV = "MLX_DFLASH2_CALIBRATION_CACHE"
CACHE_VERSION = 1  # of the file's layout: a file of another version is measured again (and rewritten)
# of the measurement (part of the fingerprint, so entries of either protocol live side by side in one file and
# an older package simply does not find the newer entries): 2 adds the verify costs after a long context, 3 the
# fitted drafter blocks' costs (n = 1, 3, 7, ..., B - 1)
PROTOCOL = 3
DEFAULT_LONG_CONTEXT = 1024  # the second context the verify costs are measured after (tokens)


@dataclass
class VerifyCosts:
    """A calibration: seconds of a target forward of ``M`` new tokens, and of a drafter proposal.

    The cost of a verify row grows with the context it attends to (on MLX's CPU backend steeply: dense float32
    SmolLM2-135M, 2 cores, ``T(1)`` 69 ms after 128 tokens and ``T(16)/T(1)`` 1.8, but after 8K tokens
    several times that, ``benchmarks/README.md``), so a calibration may hold a second table, ``verify_long_s``,
    measured after ``long_context`` tokens; :meth:`verify` then reads the cost at any context off the line
    through the two (per width, never decreasing with the context). Without it (a calibration of protocol 1,
    or ``long_context=0``) the cost does not depend on the context.

    Attributes:
        verify_s: ``{M: seconds}`` of a synchronous target forward over ``M`` new tokens (taps on, greedy
            argmax of every row), after ``context`` tokens; ``1`` is always present.
        drafter_s: ``{n: seconds}`` of one drafter proposal of ``n`` tokens (``{}``: no drafter measured).
        fingerprint: what the costs were measured for (:func:`fingerprint`).
        meta: how (context lengths, timed passes, whether every cost settled, seconds spent, date).
        verify_long_s: ``{M: seconds}`` as ``verify_s`` after ``long_context`` tokens, for the same widths, or
            ``{}`` (not measured).
        context: tokens of context before the ``verify_s`` forwards (>= 1; :func:`measure_verify_costs`'
            default when not known).
        long_context: tokens of context before the ``verify_long_s`` forwards (> ``context``; 0 without them).

    Raises:
        ValueError: a table without width 1, a cost that is not a positive finite number of seconds, a width
            < 1, a ``verify_long_s`` whose widths differ from ``verify_s``'s, or contexts out of range (named).
    """

    verify_s: dict[int, float]
    drafter_s: dict[int, float] = field(default_factory=dict)
    fingerprint: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    verify_long_s: dict[int, float] = field(default_factory=dict)
    context: int = 128
    long_context: int = 0

    def __post_init__(self):
        self.verify_s = {int(k): float(v) for k, v in self.verify_s.items()}
        self.drafter_s = {int(k): float(v) for k, v in self.drafter_s.items()}
        self.verify_long_s = {int(k): float(v) for k, v in (self.verify_long_s or {}).items()}
        if 1 not in self.verify_s:
            raise ValueError("verify_s must hold the cost of width 1 (a plain step)")
        for name, table in (("verify_s", self.verify_s), ("drafter_s", self.drafter_s),
                            ("verify_long_s", self.verify_long_s)):
            for k, v in table.items():
                if k < 1 or not v > 0 or v != v or v == float("inf"):
                    raise ValueError(f"{name}[{k}] must be a positive finite number of seconds at a width >= 1, "
                                     f"got {v!r}")
        for name in ("context", "long_context"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0 tokens, got {v!r}")
        if self.verify_long_s:
            if set(self.verify_long_s) != set(self.verify_s):
                raise ValueError(f"verify_long_s must measure the widths of verify_s {sorted(self.verify_s)}, "
                                 f"got {sorted(self.verify_long_s)}")
            if not self.long_context > self.context:
                raise ValueError(f"long_context ({self.long_context}) must exceed context ({self.context}) "
                                 "when verify_long_s is given")

    @property
    def max_width(self) -> int:
        """The widest measured verify width."""
        return max(self.verify_s)

    def verify(self, m: int, context: int | None = None) -> float:
        """Seconds of a forward of ``m >= 1`` rows: measured, else linear between the nearest measured
        widths, else (past the widest) extended from ``T(1)`` to ``T(max)`` linearly.

        ``context``: tokens already in the cache that the rows attend to (``None``: the short ``context`` of
        the calibration). With a long-context table the cost is linear in the context through the two
        measurements, extended past the longer one, at least the short one's (attention reads every cached
        key per row: its cost grows with the context, never shrinks); without one it is the same at every
        context."""
        short = _interp(self.verify_s, m)
        if context is None or not self.verify_long_s or context <= self.context:
            return short
        slope = max(0.0, _interp(self.verify_long_s, m) - short) / (self.long_context - self.context)
        return short + slope * (context - self.context)

    def drafter(self, n: int) -> float:
        """Seconds of a proposal of ``n >= 1`` drafts: the cost measured at the smallest ``n' >= n`` (a
        drafter block's cost is the same for every ``n`` it holds: a fitted block of 2, 4, 8, 16 slots is
        measured at ``n`` = 1, 3, 7, 15, a whole block at ``1`` and ``B - 1``), past the largest extended as
        :meth:`verify`; 0 without a drafter."""
        if not self.drafter_s:
            return 0.0
        if n < 1:
            raise ValueError(f"a draft length must be >= 1, got {n}")
        up = [k for k in self.drafter_s if k >= n]
        return self.drafter_s[min(up)] if up else _interp(self.drafter_s, n)

    def ratios(self, context: int | None = None) -> dict[int, float]:
        """``{M: T(M) / T(1)}`` over the measured widths (at ``context``, as :meth:`verify`)."""
        t1 = self.verify(1, context)
        return {m: self.verify(m, context) / t1 for m in sorted(self.verify_s)}

    def table(self) -> str:
        """One line: ``T(M)/T(1)`` per measured width and the drafter's cost in plain steps (and the same
        after the long context, when measured)."""
        t1 = self.verify_s[1]
        s = " ".join(f"{m}:{r:.2f}" for m, r in self.ratios().items())
        if self.drafter_s:
            s += "; drafter " + " ".join(f"n={n}:{t / t1:.2f}" for n, t in sorted(self.drafter_s.items()))
        s += f" (T(1) = {t1 * 1e3:.1f} ms)"
        if self.verify_long_s:
            tl = self.verify_long_s[1]
            s += (f"; after {self.long_context} tokens " + " ".join(
                f"{m}:{t / tl:.2f}" for m, t in sorted(self.verify_long_s.items())) + f" (T(1) = {tl * 1e3:.1f} ms)")
        return s

    def to_json(self) -> dict:
        d = {"verify_s": {str(k): v for k, v in sorted(self.verify_s.items())},
             "drafter_s": {str(k): v for k, v in sorted(self.drafter_s.items())},
             "fingerprint": self.fingerprint, "meta": self.meta, "context": self.context}
        if self.verify_long_s:
            d["verify_long_s"] = {str(k): v for k, v in sorted(self.verify_long_s.items())}
            d["long_context"] = self.long_context
        return d

    @classmethod
    def from_json(cls, d: dict) -> "VerifyCosts":
        """Inverse of :meth:`to_json`; an entry of protocol 1 (no ``verify_long_s``, the context in ``meta``)
        reads as a context-independent table. Raises ``ValueError``/``KeyError``/``TypeError`` on malformed
        input."""
        meta = d.get("meta") or {}
        return cls(d["verify_s"], d.get("drafter_s") or {}, d.get("fingerprint") or {}, meta,
                   d.get("verify_long_s") or {}, int(d.get("context", meta.get("context", 128))),
                   int(d.get("long_context", 0)))


def _interp(table: dict[int, float], x: int) -> float:
    if x < 1:
        raise ValueError(f"a width must be >= 1, got {x}")
    if x in table:
        return table[x]
    keys = sorted(table)
    if len(keys) == 1:
        return table[keys[0]]
    lo = max((k for k in keys if k < x), default=None)
    hi = min((k for k in keys if k > x), default=None)
    if lo is None:  # below the smallest measured (a drafter table starts at its smallest n)
        return table[keys[0]]
    if hi is None:  # past the widest: the mean slope from the narrowest to the widest
        a, b = keys[0], keys[-1]
        return table[b] + max(0.0, (table[b] - table[a]) / (b - a)) * (x - b)
    return table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)


# ----------------------------------------------------------------------------
# measurement
# ----------------------------------------------------------------------------


def measure_verify_costs(
    target,
    widths=DEFAULT_WIDTHS,
    *,
    drafter=None,
    context: int = 128,
    long_context: int = DEFAULT_LONG_CONTEXT,
    repeats: int = 3,
    max_repeats: int = 10,
    tolerance: float = 0.1,
    time_budget: float = 10.0,
    progress: bool = True,
    seed: int = 0,
) -> VerifyCosts:
    """Time target forwards of ``M`` new tokens for each width, and the drafter's proposal.

    A context of ``context`` random token ids (valid vocabulary, fixed ``seed``) is prefilled once, and in a
    second cache ``long_context`` of them (the verify cost grows with the context its rows attend to: see
    :class:`VerifyCosts`); then, in each pass, the widths are timed one after the other after each context
    (interleaved, so a slow spell of a shared host falls on all of them alike): a synchronous forward of ``M``
    tokens with the drafter's taps, evaluated with the argmax of every row (what a greedy verify reads), after
    which the cache is cut back to its context. With a drafter, one proposal of ``1`` and of ``B - 1`` drafts
    (``B`` = the widest width) is timed in each pass too (after the short context).
    A first pass is not timed (on a GPU it compiles each width's kernels; on the CPU only the narrowest and
    widest widths run in it).

    A cost is the **fastest** of its timings: other work on the machine only ever adds time, and on a busy
    2-core host medians of 3 passes swung by 2x from run to run (T(6) read 4.1 T(1) in one, 1.5 in the next),
    while the fastest agreed within ~10 %. Passes go on until at least ``repeats`` have run and every cost is
    *settled* (its two fastest timings within ``tolerance`` of each other), but never past ``max_repeats``
    passes, and no pass starts after ``time_budget`` seconds from the end of the prefills (at least one runs):
    a large target gets fewer passes, a quiet machine stops after ``repeats``.

    Args:
        target: the :class:`~.target.TargetAdapter` (its cache is a fresh one; the target is not changed).
        widths: verify widths ``M >= 1`` to time (``1`` is added if missing).
        drafter: a :class:`~.proposers.DFlashProposer` (or a proposer with a ``.drafter`` that is one, e.g. a
            :class:`~.proposers.FusedProposer`) whose proposal to time, or ``None``.
        context: tokens of context before the timed forwards (>= 1).
        long_context: tokens of context before the second set of timed forwards (``0``: none; otherwise
            > ``context``; cut to the target's limit less the widest width, and dropped if that leaves it at
            most ``context``).
        repeats: timed passes at least (when time allows; >= 1).
        max_repeats: timed passes at most (>= ``repeats``).
        tolerance: relative gap of the two fastest timings under which a cost is settled (>= 0).
        time_budget: seconds after which no further pass starts (> 0).
        progress: show a progress bar on stderr once the measurement has run for 2 seconds.
        seed: seed of the random context.

    Returns:
        :class:`VerifyCosts` (``fingerprint`` empty: :func:`calibrate` fills it; ``verify_long_s`` empty
        without a long context); ``meta`` says how many passes ran, whether every cost settled, and the
        seconds spent (prefills included).

    Raises:
        ValueError: a bad width, ``context``, ``long_context``, ``repeats``, ``max_repeats``, ``tolerance`` or
            ``time_budget`` (named).
    """
    widths = sorted({1, *(_width(w, "widths") for w in widths)})
    for name, v, lo in (("context", context, 1), ("repeats", repeats, 1), ("max_repeats", max_repeats, repeats)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    if isinstance(long_context, bool) or not isinstance(long_context, int) or not (
            long_context == 0 or long_context > context):
        raise ValueError(f"long_context must be 0 or an integer > context ({context}), got {long_context!r}")
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
    if not time_budget > 0:
        raise ValueError(f"time_budget must be > 0 seconds, got {time_budget!r}")
    limit = target.max_context
    if limit is not None and context + widths[-1] > limit:
        context = max(1, limit - widths[-1])
    if limit is not None and long_context + widths[-1] > limit:
        long_context = limit - widths[-1]
    if long_context <= context:
        long_context = 0
    dp = getattr(drafter, "drafter", drafter)
    tap_ids = tuple(dp.tap_ids) if dp is not None else ()
    start = time.perf_counter()

    key = mx.random.key(seed)
    total = max(context, long_context) + widths[-1]
    ids = mx.random.randint(0, max(1, target.vocab_size), (total,), key=key).astype(mx.int32)
    ids_list = ids.tolist()
    cache = target.make_cache()
    res = target.forward(ids[:context], cache, tap_ids)
    session = None
    if dp is not None:
        session = dp.start(ids_list[:context])
        session.adaptive = False
        session.extend(ids_list[:context], res.features)
        mx.eval([c.state for c in cache] + session.state_arrays())
    else:
        mx.eval([c.state for c in cache])
    caches = {context: (cache, cache_length(cache))}
    if long_context:
        long_cache = target.make_cache()
        for a in range(0, long_context, 512):
            target.forward(ids[a : min(a + 512, long_context)], long_cache, last_only=True)
            mx.eval([c.state for c in long_cache])
        caches[long_context] = (long_cache, cache_length(long_cache))
    start_passes = time.perf_counter()
    anchor = ids_list[context - 1]
    block = widths[-1]
    # a fitted drafter block (DFlashProposer.fit_blocks) costs the same for every n of one block size: one
    # proposal at the top of each (n = 1, 3, 7, ...: blocks of 2, 4, 8, ...), read upwards by VerifyCosts.drafter
    if dp is not None and block > 1:
        draft_ns = sorted({(1 << k) - 1 for k in range(1, block.bit_length() + 1) if (1 << k) - 1 < block}
                          | {1, block - 1}) if getattr(dp, "fit_blocks", False) else sorted({1, block - 1})
    else:
        draft_ns = []

    def forward(m: int, at: int) -> float:
        c, base = caches[at]
        t0 = time.perf_counter()
        out = target.forward(ids[at : at + m], c, tap_ids)
        arrays = [mx.argmax(out.logits, axis=-1)] + ([out.features] if tap_ids else [])
        mx.eval(arrays)
        dt = time.perf_counter() - t0
        trim_cache(c, cache_length(c) - base)
        return dt

    def propose(n: int) -> float:
        t0 = time.perf_counter()
        prop = session.propose(anchor, n)
        mx.eval([a for a in (prop.tokens, prop.q) if a is not None])
        return time.perf_counter() - t0

    jobs = [("verify", m, at) for at in caches for m in widths] + [("drafter", n, context) for n in draft_ns]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=(1 + repeats) * len(jobs), desc="calibrating verify widths (once per model and machine)",
                   unit="forward", delay=2.0, mininterval=0.5, file=sys.stderr, leave=False)

    def run(job):
        r = forward(job[1], job[2]) if job[0] == "verify" else propose(job[1])
        if bar is not None:
            bar.update(1)
        return r

    def settled(ts: list[float]) -> bool:
        if len(ts) < 2:
            return False
        a, b = sorted(ts)[:2]
        return b - a <= tolerance * a

    try:
        # untimed first pass: compiles every width's kernels on a GPU; the CPU has nothing to compile
        warm = jobs if mx.default_device() != mx.cpu else [j for j in jobs if j[1] in (1, block, block - 1)]
        for job in warm:
            run(job)
        if bar is not None:
            bar.update(len(jobs) - len(warm))
        times = {job: [] for job in jobs}
        passes = 0
        while True:
            t0 = time.perf_counter()
            for job in jobs:
                times[job].append(run(job))
            passes += 1
            stable = all(settled(ts) for ts in times.values())
            spent, per_pass = time.perf_counter() - start_passes, time.perf_counter() - t0
            if (passes >= repeats and stable) or passes >= max_repeats or spent + per_pass > time_budget:
                break
            if bar is not None and passes >= repeats:
                bar.total += len(jobs)
                bar.refresh()
    finally:
        if bar is not None:
            bar.close()
        del cache, caches
    verify_s = {m: min(times[("verify", m, context)]) for m in widths}
    verify_long_s = {m: min(times[("verify", m, long_context)]) for m in widths} if long_context else {}
    drafter_s = {n: min(times[("drafter", n, context)]) for n in draft_ns}
    meta = {"context": context, "long_context": long_context, "passes": passes, "settled": stable,
            "seconds": round(time.perf_counter() - start, 3), "date": time.strftime("%Y-%m-%d %H:%M")}
    return VerifyCosts(verify_s, drafter_s, {}, meta, verify_long_s, context, long_context)


def _width(w, name: str) -> int:
    import operator

    try:
        v = None if isinstance(w, bool) else operator.index(w)
    except TypeError:
        v = None
    if v is None or v < 1:
        raise ValueError(f"{name}: every width must be an integer >= 1, got {w!r}")
    return v


# ----------------------------------------------------------------------------
# fingerprint and cache
# ----------------------------------------------------------------------------


def _weights(module) -> list[str]:
    """The kinds of weights a model holds: ``"q4g32 affine"`` per quantized layout, a dtype per dense one."""
    import mlx.nn as nn

    kinds = set()
    for _, m in module.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) or (
                "scales" in m and hasattr(m, "bits") and hasattr(m, "group_size")):
            kinds.add(f"q{m.bits}g{m.group_size} {getattr(m, 'mode', 'affine')}")
        elif isinstance(m, (nn.Linear, nn.Embedding)) and "weight" in m:
            kinds.add(str(m.weight.dtype))
    return sorted(kinds)


def _device() -> dict:
    """What the default device is: MLX's description, and on the CPU the processor, its cores and the BLAS."""
    dev = mx.default_device()
    d = {"device": str(dev)}
    try:
        info = mx.device_info(dev) if hasattr(mx, "device_info") else {}
    except Exception:  # an older MLX, or a backend without it
        info = {}
    if not info and dev != mx.cpu and hasattr(mx, "metal") and mx.metal.is_available():
        try:
            info = mx.metal.device_info()
        except Exception:
            info = {}
    for k in ("device_name", "architecture", "memory_size"):
        if k in info:
            d[k] = info[k]
    if dev == mx.cpu:
        d["processor"] = _processor_name()
        try:
            d["cores"] = len(os.sched_getaffinity(0))
        except AttributeError:
            d["cores"] = os.cpu_count()
        from . import _blas

        path = _blas.status().get("path")
        d["blas"] = Path(path).name if path else "MLX's own"
    return d


def _processor_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            import subprocess

            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip() or platform.processor()
        except Exception:
            pass
    return platform.processor() or platform.machine()


def fingerprint(target, target_name: str, drafter=None) -> dict:
    """What a calibration depends on: the target (its name or path, shape, weight kinds and dtype, kernel
    mode), the drafter whose proposal was timed (shape, weight kinds, kernel mode, dynamic draft length, fitted
    blocks, draft vocabulary size),
    the MLX and mlx-lm versions and the device (MLX's description; on the CPU the processor, the cores
    this process may use and the BLAS). A JSON-serialisable dict; :func:`cache_key` hashes it."""
    import mlx_lm

    cfg = target.text_config
    fp = {
        "target": str(target_name),
        "model_type": cfg.get("model_type"),
        "hidden_size": target.hidden_size,
        "layers": target.num_layers,
        "vocab_rows": target.vocab_rows,
        "intermediate_size": cfg.get("intermediate_size"),
        "heads": [cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")],
        "weights": _weights(target.model),
        "dtype": str(target.dtype),
        "kernels": getattr(target, "kernels", "reference"),
        "mlx": mx.__version__,
        "mlx_lm": getattr(mlx_lm, "__version__", "?"),
        "device": _device(),
        "protocol": PROTOCOL,
    }
    dp = getattr(drafter, "drafter", drafter)
    if dp is not None:
        c = dp.model.config
        fp["drafter"] = {
            "architecture": c.architecture,
            "shape": [c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.num_attention_heads,
                      c.num_key_value_heads, c.head_dim, c.vocab_size, c.block_size],
            "taps": list(c.target_layer_ids),
            "selector": [c.selector_rank, c.selector_top_k, c.conv_kernel_size, c.conv_group_size],
            "weights": _weights(dp.model),
            "kernels": getattr(dp.model, "kernel_mode", None),
            "min_confidence": dp.min_confidence,
            "fit_blocks": getattr(dp, "fit_blocks", False),
            "draft_vocab": getattr(dp, "draft_vocab_size", None),  # its LM head's rows
        }
    return fp


def cache_key(fp: dict) -> str:
    """A short stable hash of a :func:`fingerprint` (canonical JSON, sha256, 16 hex digits)."""
    return hashlib.sha256(json.dumps(fp, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_path() -> Path:
    """The calibration cache file: ``$MLX_DFLASH2_CALIBRATION_CACHE``, else
    ``~/.cache/mlx_dflash2/calibration.json``."""
    env = os.environ.get(CACHE_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "mlx_dflash2" / "calibration.json"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("calibration cache %s is unreadable (%s); measuring again", path, e)
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def load_cached(fp: dict, min_width: int = 1) -> VerifyCosts | None:
    """The cached calibration for ``fp`` if it measured widths up to at least ``min_width``, else ``None``
    (also for a missing or malformed cache file or entry)."""
    entry = _read(cache_path()).get(cache_key(fp))
    if not isinstance(entry, dict):
        return None
    try:
        costs = VerifyCosts.from_json(entry)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if costs.fingerprint != json.loads(json.dumps(fp, default=str)) or costs.max_width < min_width:
        return None
    return costs


def store(costs: VerifyCosts) -> Path:
    """Write ``costs`` into the cache file under its fingerprint's key (replacing an older entry); the file is
    replaced atomically, other entries kept. Returns the file's path. Raises ``OSError`` if it cannot be
    written."""
    path = cache_path()
    entries = _read(path)
    entries[cache_key(costs.fingerprint)] = costs.to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def calibrate(target, target_name: str, drafter=None, *, block_size: int = 16, rerun: bool = False,
              progress: bool = True, **measure_kw) -> VerifyCosts:
    """The calibration for this target, drafter and machine: the cached one, or measured and stored.

    Args:
        target, target_name: the :class:`~.target.TargetAdapter` and its name or path (part of the key).
        drafter: the drafter whose proposal cost is part of the calibration (see :func:`measure_verify_costs`).
        block_size: the widest block that will be verified: widths up to it are measured (a cached entry
            that stops short of it is measured again, wider).
        rerun: measure even if an entry is cached, and replace it.
        progress: as :func:`measure_verify_costs`; after a measurement that showed progress, one line on
            stderr gives the table and the cache file.
        measure_kw: passed to :func:`measure_verify_costs` (``context``, ``repeats``, ``time_budget``...).

    Returns:
        :class:`VerifyCosts` with its ``fingerprint`` set. A cache that cannot be written is logged (a
        warning), and the measured costs are returned all the same.
    """
    block_size = _width(block_size, "block_size")
    fp = fingerprint(target, target_name, drafter)
    if not rerun:
        cached = load_cached(fp, block_size)
        if cached is not None:
            return cached
    widths = sorted({*(w for w in measure_kw.pop("widths", DEFAULT_WIDTHS) if w <= block_size), block_size})
    costs = measure_verify_costs(target, widths, drafter=drafter, progress=progress, **measure_kw)
    costs.fingerprint = json.loads(json.dumps(fp, default=str))
    where = "not cached"
    try:
        where = f"cached in {store(costs)}"
    except OSError as e:
        logger.warning("could not write the calibration cache %s: %s", cache_path(), e)
    if progress and costs.meta["seconds"] > 2.0:
        print(f"calibrated verify cost T(M)/T(1) in {costs.meta['seconds']:.1f} s: {costs.table()}; {where} "
              "(--calibrate measures again)", file=sys.stderr)
    return costs
