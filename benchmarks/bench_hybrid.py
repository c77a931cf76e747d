"""Issue 20: a random-weight GatedDeltaNet hybrid of the Qwen3.5/3.6-27B shape against the dense 27B shape, by context.

For each shape (default ``hybrid-27b``: 64 layers = 48 GatedDeltaNet + 16 gated attention, hidden 5120, built
through mlx-lm's ``qwen3_5`` class; ``dense-27b``: Qwen3-32B's width and depth; both random, 4-bit g64) and each
context length (default 1024, 8192, 32768 tokens):

1. **prefill** a random context of P - 1 tokens once, in chunks (``--prefill-chunk``, progress lines; through the
   kernel-routed target when the kernel mode runs: ``gated_delta_final`` for the recurrence), into the
   project's cache (``TargetAdapter.make_cache``: ``KVCache`` + ``RecurrentCache``); every measurement below
   starts from a copy of it and feeds the P-th token itself (the project's loop through a ``GenerationState``
   that holds the copy: it reuses the P - 1 tokens; mlx-lm's ``generate_step`` through ``prompt_cache`` =
   mlx-lm's own caches holding the same arrays), so both sides decode after the same context.
2. **plain decoding** (``--tokens``, median of ``--runs`` after one short warm-up run): the project's loop without
   a proposer, each kernel mode (``reference``: MLX's ops and the replay rollback; ``kernel``: the registry routed
   into a second model object sharing the weights: quantized linears and the stepping GatedDeltaNet mixers, which
   keep every step's state of a verify block so a rollback selects instead of replaying), against
   ``mlx_lm.generate_step`` on a third, untouched model object. tok/s = (n - 1) / first-to-last token time,
   consumer side, the same for both. ``T_step`` = 1 / mlx-lm's tok/s (its pipelined step) is the unit below.
3. **the round** through the project's loop with a scripted proposer (the target's own greedy continuation with
   its first error at a fixed offset: ``--taus``, default 5 and 16 = whole blocks, so no rollback; B = 16; the
   verify taps the 5 layers a shipped-shape drafter would tap, so it does the same work; no drafter forward):
   ms per round and the round in mlx-lm steps (and in our plain steps), per kernel mode; the number of replayed
   GatedDeltaNet rollbacks per round is counted (``replays_per_round``: the reference path replays one per
   GatedDeltaNet layer per partial rollback, 48 on the 27B hybrid; the routed path should show 0).
   ``speedup_vs_mlxlm_free_drafter`` = tau x T_step / T_round: the gain at that tau if drafting cost nothing.
4. **memory** (``mx.get_active_memory`` / ``get_peak_memory``; the process's, weights included): after the
   build, after the prefill, the peak of the prefill and of one decode run; and the bytes of the cache arrays
   themselves (``cache_gb``: K/V buffers as allocated, recurrent + convolution states, and the rollback records
   a ``RecurrentCache`` keeps: pre-forward snapshots, block inputs, and with the routed mixers every step's state
   of the last verify blocks) after the prefill, after plain decoding and after a scripted run.

``--budget`` (seconds): contexts and sections estimated not to fit are skipped (said so in the JSON); the
prefill stops early when its own projection does not fit. Results go to ``--out`` (JSON, rewritten after
every section) and a plot beside it (``.png``: plain tok/s, the round in mlx-lm steps, and memory, against the
context, per shape). On MLX's CPU backend there are no kernels: the kernel mode runs the references, and
nothing is routed unless ``--force-route`` (on by default for the tiny shapes on the CPU, a logic check).

    python benchmarks/bench_hybrid.py --budget 370 --out $OUT/hybrid.json          # the H200 run (run.sh hybrid)
    scripts/run python benchmarks/bench_hybrid.py --shapes hybrid-tiny --contexts 256,1024   # CPU smoke (~1 min)
    python benchmarks/bench_hybrid.py --plot a.json b.json --out merged.json       # merge runs, replot
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import random_targets as rt  # noqa: E402  (imports mlx_dflash2 before MLX)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402

from mlx_dflash2.caches import RecurrentCache  # noqa: E402
from mlx_dflash2.drafter.config import default_target_layer_ids  # noqa: E402
from mlx_dflash2.kernels.registry import KernelError  # noqa: E402
from mlx_dflash2.speculative import (  # noqa: E402
    PLAIN_PROPOSER, GenerationState, SpecStats, _clone_cache, speculative_generate_step)
from mlx_dflash2.target import TargetAdapter, TargetCompatibilityError, cache_length  # noqa: E402
from mlx_dflash2.verify import GreedyVerifier  # noqa: E402

from random_targets import log  # noqa: E402

MODES = ("reference", "kernel")
GB = 1e9


def mem() -> dict:
    return {"active_gb": mx.get_active_memory() / GB, "peak_gb": mx.get_peak_memory() / GB}


def cache_gb(cache: list) -> dict:
    """Bytes (GB) of the arrays a cache list holds, each array counted once: ``kv`` (K/V buffers as allocated,
    the growth step included), ``recurrent`` (GatedDeltaNet convolution windows + recurrent states), ``records``
    (what the ``RecurrentCache`` rollback history keeps: pre-forward snapshots, block inputs, every step's state
    with the routed mixers; a slice counts its own size, not the buffer behind it)."""
    seen, out = set(), {"kv": 0, "recurrent": 0, "records": 0}

    def add(kind, a):
        if a is not None and id(a) not in seen:
            seen.add(id(a))
            out[kind] += a.nbytes

    for c in cache:
        if isinstance(c, RecurrentCache):
            for a in c.cache:
                add("recurrent", a)
            for rec in getattr(c, "_history", ()):
                for a in (rec.conv, rec.state, rec.inputs, rec.mask, *(rec.steps or ())):
                    add("records", a)
        else:
            add("kv", getattr(c, "keys", None))
            add("kv", getattr(c, "values", None))
    r = {k: v / GB for k, v in out.items()}
    r["total"] = sum(r.values())
    return r


def mlx_lm_caches(base: list) -> list:
    """mlx-lm's own cache objects holding ``base``'s arrays (immutable: nothing is shared that either side
    writes in place): ``KVCache`` copies (views up to the offset), ``ArraysCache(2)`` for the recurrent layers."""
    from mlx_lm.models.cache import ArraysCache, KVCache

    out = []
    for c in base:
        if isinstance(c, RecurrentCache):
            a = ArraysCache(size=2)
            a.cache = list(c.cache)
            out.append(a)
        elif type(c) is KVCache:
            out.append(_clone_cache(c))
        else:
            raise TypeError(f"mlx_lm_caches: unexpected cache {type(c).__name__}")
    return out


class Shape:
    """One target shape: three model objects sharing one set of weights (the reference adapter's, the
    kernel-routed adapter's, an untouched one for mlx-lm), measured at each context."""

    def __init__(self, name: str, args, budget: rt.Budget, save):
        self.name, self.a, self.budget, self.save = name, args, budget, save
        sh = rt.SHAPES[name]
        self.r = {"shape": name, "family": sh.get("model_type", "qwen3"), **{k: v for k, v in sh.items()
                                                                             if k != "model_type"},
                  "layers": rt.layer_counts(name), "params_b": rt.param_count(sh) / 1e9, "contexts": {}}

    # -- setup ----------------------------------------------------------------------------------
    def build(self):
        a, r = self.a, self.r
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        self.model, self.cfg = rt.build_target(self.name, dtype=a.dtype, seed=a.seed)
        r["build_s"] = time.perf_counter() - t0
        r["weights_gb"] = rt.nbytes(self.model) / GB
        self.V = rt.vocab_size(self.cfg)
        self.targets = {}
        try:
            self.targets["reference"] = TargetAdapter(self.model, self.cfg, probe=True, kernels="reference")
            r["parity_probe"] = "passed"
        except TargetCompatibilityError as e:  # random weights may overflow 16 bits; speed does not need it
            r["parity_probe"] = f"failed: {e}"
            self.targets["reference"] = TargetAdapter(self.model, self.cfg, probe=False, kernels="reference")
        if "kernel" in a.modes:
            tk = TargetAdapter(rt.twin(self.model, self.cfg, dtype=a.dtype), self.cfg, probe=False,
                               kernels="reference")
            # random weights: the routes' stack-level probe cannot tell a kernel's rounding from a fault on a
            # random hybrid (chaotic in 16 bits: TargetAdapter.route_kernels); each kernel still gates itself
            r["route_probe"] = a.route_probe
            r["kernel_routed_modules"] = tk.route_kernels("kernel", force=a.force_route, probe=a.route_probe)
            r["kernel_choice"] = dict(tk.kernel_choice)
            r["kernel_target_mode"] = tk.kernels  # "reference" if the routing's probe undid it
            r["kernel_gdn_mixers_routed"] = sum(
                1 for m in tk.model.modules() if type(m).__name__.startswith("Stepping"))
            self.targets["kernel"] = tk
        self.plain_model = rt.twin(self.model, self.cfg, dtype=a.dtype)  # mlx-lm's: no recording, no kernels
        self.L = self.targets["reference"].num_layers
        self.taps = tuple(default_target_layer_ids(self.L, 5))  # what a shipped-shape drafter taps
        r["taps"] = list(self.taps)
        r["memory_after_build"] = mem()
        log(f"[{self.name}] built in {r['build_s']:.1f} s: {r['params_b']:.2f}B params "
            f"({r['layers']['gated_delta']} GatedDeltaNet + {r['layers']['attention']} attention layers), "
            f"{r['weights_gb']:.2f} GB, probe {r['parity_probe']}, kernel modules routed: "
            f"{r.get('kernel_routed_modules')} (GatedDeltaNet mixers {r.get('kernel_gdn_mixers_routed')}, "
            f"target mode {r.get('kernel_target_mode')})")

    def use(self, mode: str):
        return self.targets[mode], GreedyVerifier(kernel_mode=mode)

    def state(self, proposer, prompt_len: int) -> GenerationState:
        """A request state holding a copy of the prefilled cache (P - 1 tokens): the loop reuses them and feeds
        the last prompt token."""
        return GenerationState(cache=[_clone_cache(c) for c in self.base], session=proposer.start(self.ids),
                               tokens=self.ids[:prompt_len - 1], proposer=proposer)

    # -- 1. prefill -----------------------------------------------------------------------------
    def prefill(self, P: int, c: dict, reserve: float) -> bool:
        a = self.a
        # the routed target where there is one: its GatedDeltaNet mixers run a chunk's recurrence in one
        # launch (gated_delta_final); mlx-lm's ops on MLX's CUDA backend loop per token (~36 tok/s at 27B)
        c["prefill_mode"] = "kernel" if "kernel" in self.targets else "reference"
        target, _ = self.use(c["prefill_mode"])
        self.ids = rt.random_ids(self.V, P, seed=a.seed + P)
        mx.reset_peak_memory()
        m0 = mem()
        cache = target.make_cache()
        n, t0, last_log = P - 1, time.perf_counter(), time.perf_counter()
        done = 0
        while done < n:
            k = min(a.prefill_chunk, n - done)
            target.forward(mx.array(self.ids[done:done + k], mx.int32), cache, last_only=True)
            mx.eval([x.state for x in cache])
            done += k
            el = time.perf_counter() - t0
            # attention's share grows with the context: project the rest at the current rate x 1.3
            rest = (n - done) / (done / el) * 1.3
            if done < n and not self.budget.fits(rest, reserve):
                c["skipped"] = f"prefill: stopped at {done}/{n} tokens, {rest:.0f} s more would not fit"
                log(f"[{self.name}] P={P}: {c['skipped']}")
                return False
            if time.perf_counter() - last_log > 10 or done == n:
                log(f"[{self.name}] P={P}: prefill {done}/{n} tokens, {done / el:.0f} tok/s")
                last_log = time.perf_counter()
        el = time.perf_counter() - t0
        assert cache_length(cache) == n
        self.base = cache
        c["prefill_s"], c["prefill_tps"] = el, n / el
        c["memory"] = {"before_prefill": m0, "after_prefill": mem()}
        c["cache_gb"] = {"after_prefill": cache_gb(cache)}
        self.prefill_rate = n / el
        return True

    # -- 2. plain decoding ----------------------------------------------------------------------
    def plain_project(self, mode: str, N: int):
        target, verifier = self.use(mode)
        st = self.state(PLAIN_PROPOSER, len(self.ids))
        g = rt.generate_timed(speculative_generate_step(self.ids, target, None, verifier=verifier, max_tokens=N,
                                                        state=st))
        return g, st

    def plain_mlx_lm(self, N: int):
        from mlx_lm.generate import generate_step

        return rt.generate_timed(generate_step(mx.array(self.ids[-1:], mx.int32), self.plain_model, max_tokens=N,
                                               prompt_cache=mlx_lm_caches(self.base)))

    def plain(self, P: int, c: dict, modes):
        a = self.a
        for m in modes:  # warm-up (first-use compilation at this context), not counted
            self.plain_project(m, 8)
        self.plain_mlx_lm(8)
        res = {f"project_{m}": [] for m in modes}
        res["mlx_lm"] = []
        self.tokens = {}
        for i in range(a.runs):
            for m in modes:  # interleaved: drift hits every variant alike
                mx.reset_peak_memory()
                g, st = self.plain_project(m, a.tokens)
                res[f"project_{m}"].append(g["tps"])
                self.tokens[m] = g["tokens"]
                if i == 0:
                    c["memory"][f"plain_{m}"] = mem()  # its copy of the cache still alive
                    c["cache_gb"][f"plain_{m}"] = cache_gb(st.cache)
                del st
            g = self.plain_mlx_lm(a.tokens)
            res["mlx_lm"].append(g["tps"])
            self.tokens["mlx_lm"] = g["tokens"]
        med = {k: rt.median(v) for k, v in res.items()}
        c["plain_tps"], c["plain_tps_median"] = res, med
        c["T_step_mlxlm_ms"] = 1e3 / med["mlx_lm"]
        c["T_step_project_ms"] = {m: 1e3 / med[f"project_{m}"] for m in modes}
        c["plain_over_mlxlm"] = {m: med[f"project_{m}"] / med["mlx_lm"] for m in modes}
        c["plain_tokens_match_mlxlm"] = {m: self.tokens[m] == self.tokens["mlx_lm"] for m in modes}
        self.T_step = c["T_step_mlxlm_ms"] / 1e3
        log(f"[{self.name}] P={P}: plain tok/s (median of {a.runs}): "
            + ", ".join(f"{k} {v:.2f}" for k, v in med.items())
            + f"; ours / mlx-lm: " + ", ".join(f"{m} {v:.3f}" for m, v in c["plain_over_mlxlm"].items())
            + f"; tokens == mlx-lm's: {c['plain_tokens_match_mlxlm']}")

    # -- 3. the round ---------------------------------------------------------------------------
    def spec_run(self, mode: str, proposer, max_tokens: int, keep: bool = False):
        target, verifier = self.use(mode)
        st = self.state(proposer, len(self.ids))
        stats = SpecStats()
        for _ in speculative_generate_step(self.ids, target, proposer, verifier=verifier, block_size=self.a.block,
                                           max_tokens=max_tokens, stats=stats, state=st):
            pass
        replays = sum(x.replays for x in st.cache if isinstance(x, RecurrentCache))
        out = {"decode_s": stats.decode_s, "rounds": stats.rounds, "tau": stats.tau,
               "tokens": stats.generated_tokens, "replays": replays,
               "round_ms": stats.decode_s / stats.rounds * 1e3 if stats.rounds else None}
        return (out, st) if keep else out

    def rounds(self, P: int, c: dict, modes):
        a, B = self.a, self.a.block
        need = a.rounds * max(a.taus) + 1
        out = {m: {} for m in modes}
        for m in modes:
            ref = self.tokens.get(m, [])
            if len(ref) < need:  # the reference continuation: plain greedy decoding of this mode
                ref = self.plain_project(m, need)[0]["tokens"]
            warm = rt.ScriptedProposer(P, ref, [a.taus[0] - 1], B, self.V, self.taps)
            self.spec_run(m, warm, 2 * a.taus[0] + 1)  # warm-up, not counted
            for tau in a.taus:
                prop = rt.ScriptedProposer(P, ref, [tau - 1], B, self.V, self.taps)
                runs = []
                for i in range(a.runs):
                    if i == 0:
                        mx.reset_peak_memory()
                        x, st = self.spec_run(m, prop, a.rounds * tau + 1, keep=True)
                        c["memory"][f"scripted_{m}_tau{tau}"] = mem()
                        c["cache_gb"][f"scripted_{m}_tau{tau}"] = cache_gb(st.cache)
                        del st
                    else:
                        x = self.spec_run(m, prop, a.rounds * tau + 1)
                    runs.append(x)
                T = rt.median(x["round_ms"] for x in runs)
                out[m][str(tau)] = {
                    "runs": runs, "round_ms": T, "round_mlxlm_steps": T / (self.T_step * 1e3),
                    "round_project_steps": T / c["T_step_project_ms"][m],
                    "tau_measured": rt.median(x["tau"] for x in runs),
                    "replays_per_round": rt.median(x["replays"] / max(x["rounds"], 1) for x in runs),
                    # what the loop would gain over mlx-lm at this tau with a free drafter (none runs here)
                    "speedup_vs_mlxlm_free_drafter": rt.median(x["tau"] for x in runs) * self.T_step * 1e3 / T}
            log(f"[{self.name}] P={P}: round, scripted, {m:9}: " + "; ".join(
                f"tau {t} (measured {v['tau_measured']:.2f}): {v['round_ms']:.2f} ms = {v['round_mlxlm_steps']:.2f} "
                f"mlx-lm steps ({v['round_project_steps']:.2f} ours), {v['replays_per_round']:.1f} replays/round, "
                f"{v['speedup_vs_mlxlm_free_drafter']:.2f}x with a free drafter" for t, v in out[m].items()))
        c["round_scripted"] = out
        if set(MODES) <= set(modes):
            c["round_kernel_over_reference"] = {
                t: out["kernel"][t]["round_ms"] / out["reference"][t]["round_ms"] for t in out["kernel"]}

    # -- driver ---------------------------------------------------------------------------------
    def est_step(self) -> float:
        """A decode step (s): measured at the last context, else from the parameter count (H200: ~0.75 ms per
        billion 4-bit parameters; the CPU: a 1-token forward timed now)."""
        if hasattr(self, "T_step"):
            return self.T_step
        if mx.default_device() != mx.cpu:
            return (0.75 * self.r["params_b"] + 2) / 1e3
        target, _ = self.use("reference")
        cache = target.make_cache()
        ts = []
        for i in range(3):
            t = time.perf_counter()
            mx.eval(target.forward(mx.array([i + 1], mx.int32), cache).logits)
            ts.append(time.perf_counter() - t)
        return min(ts)

    def est_prefill(self, P: int) -> float:
        rate = getattr(self, "prefill_rate", None)
        if rate is None:
            rate = 4e4 / self.r["params_b"] if mx.default_device() != mx.cpu else 1.0 / self.est_step() * 8
        return P / rate * 1.3

    def run(self, reserve: float):
        a, r, b = self.a, self.r, self.budget
        modes = [m for m in MODES if m in a.modes]
        self.build()
        self.save()
        nv = len(modes) + 1
        for P in a.contexts:
            c = r["contexts"].setdefault(str(P), {"context": P})
            T = self.est_step() * (1.0 + P / 32768)  # the attention share grows with the context
            est_plain = (a.runs * a.tokens + 8) * nv * T * 1.2
            est_round = len(modes) * (a.rounds * max(a.taus) * T + (a.runs + 1) * a.rounds * len(a.taus) * 3 * T)
            est = self.est_prefill(P) + est_plain
            if not b.fits(est, reserve):
                c["skipped"] = f"estimated {est:.0f} s (prefill + plain), {b.left() - reserve:.0f} s left"
                log(f"[{self.name}] P={P}: skipped, {c['skipped']}")
                self.save()
                continue
            log(f"[{self.name}] P={P}: estimated {est:.0f} s + {est_round:.0f} s for the rounds")
            t0 = time.perf_counter()
            try:
                if not self.prefill(P, c, reserve):
                    self.save()
                    continue
                self.save()
                self.plain(P, c, modes)
                c.setdefault("done", []).append("plain")
                self.save()
                est_round = len(modes) * (a.rounds * max(a.taus) * self.T_step
                                          + (a.runs + 1) * a.rounds * len(a.taus) * 3 * self.T_step)
                if b.fits(est_round, reserve):
                    self.rounds(P, c, modes)
                    c["done"].append("round_scripted")
                else:
                    c.setdefault("skipped_sections", []).append(
                        f"round_scripted: estimated {est_round:.0f} s, {b.left() - reserve:.0f} s left")
                    log(f"[{self.name}] P={P}: rounds skipped (estimated {est_round:.0f} s)")
            except KernelError as ex:
                c["error"] = f"KernelError: {ex}"
                log(f"[{self.name}] P={P}: KernelError: {ex}")
            finally:
                c["section_s"] = time.perf_counter() - t0
                self.base = None
                gc.collect()
                mx.clear_cache()
                self.save()

    def free(self):
        for k in ("targets", "model", "plain_model", "base"):
            if hasattr(self, k):
                delattr(self, k)
        gc.collect()
        mx.clear_cache()


def est_shape_min(name: str, a) -> float:
    """A rough lower bound (s, H200) for a shape's build and its shortest context (kept for later shapes)."""
    p = rt.param_count(rt.SHAPES[name]) / 1e9
    T = (0.75 * p + 2) / 1e3
    P = min(a.contexts)
    return 0.3 * p + 5 + P / (4e4 / p) + (a.runs * a.tokens + 8) * (len(a.modes) + 1) * T * 1.2


# -- plot ---------------------------------------------------------------------------------------
def plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot")
        return False
    shapes = [s for s in res["shapes"] if any("plain_tps_median" in c for c in s.get("contexts", {}).values())]
    if not shapes:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(19, 5.6))
    colors = ["tab:blue", "tab:red", "tab:green", "tab:purple", "tab:orange"]
    styles = {"mlx_lm": ("o-", "mlx-lm generate_step"), "project_reference": ("s--", "ours, MLX ops"),
              "project_kernel": ("^:", "ours, kernels routed")}
    for j, s in enumerate(shapes):
        col = colors[j % len(colors)]
        cs = sorted((c for c in s["contexts"].values() if "plain_tps_median" in c), key=lambda c: c["context"])
        xs = [c["context"] for c in cs]
        lab = f"{s['shape']} ({s['params_b']:.1f}B)"
        for k, (st, name) in styles.items():
            ys = [c["plain_tps_median"].get(k) for c in cs]
            if any(y is not None for y in ys):
                axes[0].plot(xs, ys, st, color=col, label=f"{lab}: {name}")
        for m, st in (("reference", "s--"), ("kernel", "^:")):
            for tau in sorted({t for c in cs for t in c.get("round_scripted", {}).get(m, {})}, key=int):
                pts = [(c["context"], c["round_scripted"][m][tau]["round_mlxlm_steps"]) for c in cs
                       if tau in c.get("round_scripted", {}).get(m, {})]
                if pts:
                    axes[1].plot(*zip(*pts), st, color=col, alpha=1.0 if tau != "16" else 0.5,
                                 label=f"{lab}: {'MLX ops, replay' if m == 'reference' else 'kernels routed'}, "
                                       f"tau {tau}")
        pts = [(c["context"], c["cache_gb"]["after_prefill"]["total"]) for c in cs if "cache_gb" in c]
        if pts:
            axes[2].plot(*zip(*pts), "o-", color=col, label=f"{lab}: cache after prefill")
        for key, st, name in (("plain_kernel", "^:", "cache after plain decode (kernels)"),
                              ("scripted_reference_tau5", "s--", "cache after tau-5 rounds (MLX ops)"),
                              ("scripted_kernel_tau5", "v-.", "cache after tau-5 rounds (kernels)")):
            pts = [(c["context"], c["cache_gb"][key]["total"]) for c in cs if key in c.get("cache_gb", {})]
            if pts:
                axes[2].plot(*zip(*pts), st, color=col, alpha=0.7, label=f"{lab}: {name}")
        pts = [(c["context"], c["memory"]["after_prefill"]["peak_gb"] - c["memory"]["before_prefill"]["active_gb"])
               for c in cs if "memory" in c]
        if pts:
            axes[2].plot(*zip(*pts), "x", color=col, ms=9, label=f"{lab}: process peak of the prefill above the "
                                                                   "weights")
    meta = res.get("meta", {})
    titles = ("plain decoding, tok/s", f"round (verify + accept + rollback), B={meta.get('block', 16)}, "
              "in mlx-lm plain steps", "memory, GB")
    for ax, t in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(t, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5)
    axes[1].axhline(1.0, color="gray", lw=0.8)
    fig.suptitle(f"issue 20: random-weight 4-bit g64 targets, {meta.get('dtype', '')}, {meta.get('device', '')}, "
                 f"MLX {meta.get('mlx', '')}, mlx-lm {meta.get('mlx_lm', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def summary(res: dict) -> None:
    print("\nshape        context  prefill tok/s  mlx-lm tok/s  ours ref  ours kern  round ms tau5 ref/kern "
          "(mlx-lm steps)       cache GB (prefill / after tau5 kern)")
    for s in res["shapes"]:
        for P, c in sorted(s.get("contexts", {}).items(), key=lambda kv: int(kv[0])):
            if "plain_tps_median" not in c:
                print(f"{s['shape']:12} {P:>7}  {c.get('skipped') or c.get('error') or 'no plain'}")
                continue
            pm = c["plain_tps_median"]
            rs = c.get("round_scripted", {})
            r5 = [rs.get(m, {}).get("5") for m in MODES]
            rtxt = " / ".join(f"{x['round_ms']:.2f} ({x['round_mlxlm_steps']:.2f})" if x else "-" for x in r5)
            cg = c.get("cache_gb", {})
            ctxt = f"{cg.get('after_prefill', {}).get('total', 0):.3f} / " \
                   f"{cg.get('scripted_kernel_tau5', {}).get('total', float('nan')):.3f}"
            print(f"{s['shape']:12} {P:>7}  {c.get('prefill_tps', 0):13.1f}  {pm.get('mlx_lm', 0):12.2f}  "
                  f"{pm.get('project_reference') or 0:8.2f}  {pm.get('project_kernel') or 0:9.2f}  {rtxt:40}  {ctxt}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="hybrid-27b,dense-27b", help=f"comma-separated, of {', '.join(rt.SHAPES)}")
    p.add_argument("--contexts", default="1024,8192,32768", help="context lengths (tokens), comma-separated")
    p.add_argument("--modes", default="reference,kernel", help="kernel modes of our loop (before, after)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per plain decode run")
    p.add_argument("--runs", type=int, default=3, help="runs per measurement (medians)")
    p.add_argument("--taus", default="5,16", help="scripted acceptance lengths (16 = whole blocks: no rollback)")
    p.add_argument("--rounds", type=int, default=6, help="rounds per scripted run")
    p.add_argument("--block", type=int, default=16, help="B, the verify width")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="prefill chunk (tokens)")
    p.add_argument("--dtype", default="auto", help="bfloat16 / float16 / float32; auto: bfloat16, float32 on the CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=1e9, help="seconds; what is estimated not to fit is skipped")
    p.add_argument("--force-route", default="auto", choices=("auto", "on", "off"),
                   help="route the kernels even on the CPU backend (the references run); auto: on for tiny shapes "
                        "on the CPU")
    p.add_argument("--route-probe", action=argparse.BooleanOptionalAction, default=False,
                   help="compare the routed target's logits with MLX's before keeping the routes (default off: a "
                        "random-weight hybrid is chaotic in 16 bits, see TargetAdapter.route_kernels)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--plot", nargs="+", metavar="JSON", help="only merge these result files and plot them (--out)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/hybrid-<cpu|gpu>.json); "
                                               "the plot beside it (.png)")
    a = p.parse_args(argv)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not a.modes or any(m not in MODES for m in a.modes):
        p.error(f"--modes: each of {', '.join(MODES)}")
    a.contexts = sorted(int(x) for x in a.contexts.split(",") if x.strip())
    if not a.contexts or min(a.contexts) < 2:
        p.error("--contexts: lengths >= 2")
    a.taus = [int(t) for t in a.taus.split(",") if t.strip()]
    if not a.taus or any(t < 1 or t > a.block for t in a.taus):
        p.error(f"--taus: each in 1..{a.block}")
    a.shape_list = [s.strip() for s in a.shapes.split(",") if s.strip()]
    for s in a.shape_list:
        if s not in rt.SHAPES:
            p.error(f"--shapes: unknown shape {s!r} (choose from {', '.join(rt.SHAPES)})")
    cpu = mx.default_device() == mx.cpu
    if a.dtype == "auto":
        a.dtype = "float32" if cpu else "bfloat16"
    if a.dtype not in ("bfloat16", "float16", "float32"):
        p.error(f"--dtype: bfloat16, float16 or float32, got {a.dtype!r}")
    a.dtype_name, a.dtype = a.dtype, getattr(mx, a.dtype)
    tiny = all(rt.param_count(rt.SHAPES[s]) < 1e8 for s in a.shape_list)
    a.force_route = a.force_route == "on" or (a.force_route == "auto" and cpu and tiny)
    if a.out is None:
        a.out = str(Path(__file__).resolve().parent / "results" / f"hybrid-{'cpu' if cpu else 'gpu'}.json")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.plot:
        res = {"meta": None, "shapes": []}
        for f in a.plot:
            r = json.loads(Path(f).read_text())
            res["meta"] = res["meta"] or r["meta"]
            res["shapes"] += r["shapes"]
        out.write_text(json.dumps(res, indent=1) + "\n")
        ok = plot(res, out.with_suffix(".png"))
        summary(res)
        return 0 if ok else 1
    budget = rt.Budget(a.budget)
    meta = rt.device_meta()
    meta.update(dtype=a.dtype_name, contexts=a.contexts, modes=a.modes, tokens=a.tokens, runs=a.runs, taus=a.taus,
                rounds=a.rounds, block=a.block, prefill_chunk=a.prefill_chunk, budget_s=a.budget,
                force_route=a.force_route, bits=4, group_size=64,
                T_step="1 / median tok/s of mlx_lm.generate_step (pipelined) on an untouched model object, "
                       "after the same prefilled context",
                plain="(n - 1) / first-to-last token time, consumer side; median of runs after a warm-up",
                round="decode_s / rounds of the project's loop with a scripted proposer (first error at tau - 1)",
                memory="mx.get_active_memory / get_peak_memory of the process (weights included); cache_gb: "
                       "bytes of the cache arrays")
    log(json.dumps(meta))
    res = {"meta": meta, "shapes": []}

    def save():
        out.write_text(json.dumps(res, indent=1) + "\n")

    cpu = mx.default_device() == mx.cpu
    for i, name in enumerate(a.shape_list):
        reserve = 0.0 if cpu else sum(est_shape_min(n, a) for n in a.shape_list[i + 1:])
        need = 0.0 if cpu else est_shape_min(name, a)
        if not budget.fits(need, reserve * 0.5):
            log(f"[{name}] skipped: estimated {need:.0f} s, {budget.left():.0f} s left")
            res["shapes"].append({"shape": name, "skipped": f"budget: estimated {need:.0f} s, "
                                                            f"{budget.left():.0f} s left"})
            save()
            continue
        s = Shape(name, a, budget, save)
        res["shapes"].append(s.r)
        try:
            s.run(reserve)
        except Exception as e:  # keep the other shapes
            import traceback

            traceback.print_exc()
            s.r["error"] = repr(e)
        finally:
            s.free()
            save()
        log(f"[{name}] done; {budget.left():.0f} s of the budget left")
    if not a.no_plot and plot(res, out.with_suffix(".png")):
        log(f"plot: {out.with_suffix('.png')}")
    summary(res)
    save()
    return 1 if any("error" in s for s in res["shapes"]) else 0


if __name__ == "__main__":
    sys.exit(main())
