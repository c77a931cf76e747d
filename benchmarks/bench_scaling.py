"""Large-target scaling of the speculative round, MLX's ops ("before") against the kernel registry ("after").

For each random-weight Qwen3-shaped target (4-bit g64, bf16; ``qwen3-8b``, ``dense-27b``) with a
``--context``-token context (1K), in ONE process, every measurement once with ``kernels="reference"``
(MLX's own ops) and once with ``kernels="kernel"`` (the registry's kernels routed into a second model
object that shares the weights: ``TargetAdapter.route_kernels`` swaps modules of its own model only),
interleaved, so the before/after ratios come from one run on one machine:

1. **T(M)** for M = 1..16: a forward of M new tokens after the context, cache cut back after each.
   *sync*: ``mx.eval`` and wall clock per forward, median of ``--repeats`` (what the tables report);
   *pipelined*: chains of ``--pipe-steps`` forwards, each fed the previous one's argmax (as decoding does)
   and queued with ``mx.async_eval`` before the previous one finishes, time per forward (median over chains).
2. **plain decoding**, ``--tokens`` tokens after the context, ``--runs`` runs (medians): the project's loop
   without a proposer (each mode) and ``mlx_lm.generate.generate_step`` on the unrouted model object. tok/s
   = (n - 1) / time from the first to the last token, on the consumer side, the same for both.
   ``T_step`` = 1 / mlx-lm's tok/s: **mlx-lm's pipelined decode step**, the unit of the round.
3. **the round** through the project's real loop (``speculative_generate_step``, greedy, B=16):
   (a) a fresh DFlash2 drafter of the shipped drafter's shape (4 layers, 5 taps, rank 32, 4-bit g64
   linears; no lookup): random weights reject every draft, so decode_s / rounds is one round's cost
   (propose + verify + accept + one host read); (b) a scripted proposer that proposes the target's own
   greedy continuation (from a plain run of the same mode) with its first error at a fixed block offset,
   so each round accepts exactly ``tau - 1`` drafts (``--script-taus``; 16 = whole blocks): the round
   without a drafter forward, at a real acceptance. ms/round and the round in units of ``T_step``.
4. **projected speedup** over mlx-lm's pipelined decoding at tau = 3..6: ``tau * T_step / T_round(a)``
   (the drafter's cost barely depends on tau); and the scripted runs' measured tok/s over mlx-lm's.

Writes ``DIR/scaling.json`` after every section (a run cut by a timeout keeps what it measured) and
``DIR/scaling.png`` (T(M)/T(1) before/after per shape; the round in mlx-lm steps). ``--budget`` skips
what is estimated not to fit. On MLX's CPU backend there are no kernels (``kernel`` runs the references,
and nothing is routed unless ``--force-route``): use ``--tiny`` there to check the script's logic.

    python benchmarks/bench_scaling.py --out $OUT --budget 480            # the H200 run
    scripts/run python benchmarks/bench_scaling.py --tiny --out benchmarks/results/scaling-cpu-tiny    # CPU logic check (~1 min)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import random_targets as rt  # noqa: E402  (imports mlx_dflash2 before MLX)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402

from mlx_dflash2.kernels.registry import KernelError  # noqa: E402
from mlx_dflash2.proposers import DFlashProposer  # noqa: E402
from mlx_dflash2.speculative import SpecStats, speculative_generate_step  # noqa: E402
from mlx_dflash2.target import TargetAdapter, TargetCompatibilityError, cache_length, trim_cache  # noqa: E402
from mlx_dflash2.verify import GreedyVerifier  # noqa: E402

from random_targets import log  # noqa: E402

MODES = ("reference", "kernel")
TAUS = (3, 4, 5, 6)


def timed_ms(fn, repeats: int, warmup: int = 3) -> float:
    """Median wall ms of ``fn()`` (which evaluates its own work)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


class Shape:
    """One target shape with its two adapters (reference / kernel), drafter and contexts."""

    def __init__(self, name: str, args, budget: rt.Budget):
        self.name, self.args, self.budget = name, args, budget
        self.r = {"shape": name, **rt.SHAPES[name], "params_b": rt.param_count(rt.SHAPES[name]) / 1e9}

    # -- setup ----------------------------------------------------------------------------------
    def build(self):
        a, r = self.args, self.r
        t0 = time.perf_counter()
        self.model, self.cfg = rt.build_target(self.name, dtype=a.dtype, seed=a.seed)
        r["build_s"] = time.perf_counter() - t0
        V = self.V = self.cfg["vocab_size"]
        self.targets = {}
        try:
            self.targets["reference"] = TargetAdapter(self.model, self.cfg, probe=True, kernels="reference")
            r["parity_probe"] = "passed"
        except TargetCompatibilityError as e:  # random weights may overflow bf16; speed does not need the probe
            r["parity_probe"] = f"failed: {e}"
            self.targets["reference"] = TargetAdapter(self.model, self.cfg, probe=False, kernels="reference")
        if "kernel" in a.modes:
            tk = TargetAdapter(rt.twin(self.model, self.cfg, dtype=a.dtype), self.cfg, probe=False, kernels="reference")
            r["kernel_routed_modules"] = tk.route_kernels("kernel", force=a.force_route)
            r["kernel_target_mode"] = tk.kernels  # "reference" if the routing's probe undid it
            from mlx_dflash2.kernels import backend
            from mlx_dflash2.kernels.block import compile_enabled

            r["kernel_compiled_layers"] = compile_enabled(backend())  # kernels/block.py
            self.targets["kernel"] = tk
        t1 = time.perf_counter()
        self.drafter = rt.make_drafter(self.targets["reference"], V, seed=a.seed, dtype=a.dtype)
        r["drafter_build_s"] = time.perf_counter() - t1
        r["weights_gb"] = rt.nbytes(self.model) / 1e9
        r["drafter_gb"] = rt.nbytes(self.drafter) / 1e9
        self.B = self.drafter.config.block_size
        self.taps = tuple(self.drafter.config.target_layer_ids)
        self.ids = rt.random_ids(V, a.context, seed=a.seed + 1)
        log(f"[{self.name}] built in {r['build_s']:.1f} s (+ drafter {r['drafter_build_s']:.1f} s): "
            f"{r['params_b']:.2f}B params, {r['weights_gb']:.2f} GB target, {r['drafter_gb']:.3f} GB drafter, "
            f"taps {list(self.taps)}, probe {r['parity_probe']}, kernel modules routed: "
            f"{r.get('kernel_routed_modules')} (target mode {r.get('kernel_target_mode')})")

    def use(self, mode: str):
        """(target, verifier) of ``mode``; the drafter's fused ops follow ``mode`` too."""
        self.r.setdefault("drafter_routed_modules", {})[mode] = rt.drafter_mode(self.drafter, mode, self.args.force_route)
        return self.targets[mode], GreedyVerifier(kernel_mode=mode)

    def context_cache(self, mode: str):
        target, _ = self.use(mode)
        cache = target.make_cache()
        for s in range(0, len(self.ids), 512):
            target.forward(mx.array(self.ids[s:s + 512], mx.int32), cache, last_only=True)
            mx.eval([c.state for c in cache])
        return cache

    # -- 1. T(M) ------------------------------------------------------------------------------------
    def t_sync(self, modes):
        a, r = self.args, self.r
        caches = {m: self.context_cache(m) for m in modes}
        P = len(self.ids)
        x = mx.array(self.ids[:16], mx.int32)
        out = {m: {} for m in modes}
        for M in range(1, a.max_m + 1):
            for m in modes:  # interleaved: drift hits both modes alike
                target, _ = self.use(m)
                cache = caches[m]

                def f():
                    mx.eval(target.forward(x[:M], cache).logits)
                    trim_cache(cache, M)
                out[m][M] = timed_ms(f, a.repeats, a.warmup)
        for m in modes:  # the verify as the loop runs it: 16 rows with the drafter's taps
            target, _ = self.use(m)
            cache = caches[m]

            def f():
                o = target.forward(x[:self.B], cache, self.taps)
                mx.eval(o.logits, o.features)
                trim_cache(cache, self.B)
            r.setdefault("T16_taps_ms", {})[m] = timed_ms(f, a.repeats, a.warmup)
            chk = target.forward(x[:4], cache)
            r.setdefault("logits_finite", {})[m] = bool(mx.all(mx.isfinite(chk.logits)).item())
            trim_cache(cache, 4)
            assert cache_length(cache) == P
        r["T_sync_ms"] = {m: {str(k): v for k, v in out[m].items()} for m in modes}
        r["T_sync_ratio"] = {m: {str(k): v / out[m][1] for k, v in out[m].items()} for m in modes}
        for m in modes:
            t = out[m]
            log(f"[{self.name}] T(M) sync {m:9}: T(1) {t[1]:.2f} ms; T(M)/T(1) "
                + " ".join(f"{k}:{v / t[1]:.2f}" for k, v in t.items()))
        if set(MODES) <= set(modes):
            r["T_sync_after_over_before"] = {str(k): out["kernel"][k] / out["reference"][k] for k in out["kernel"]}
            log(f"[{self.name}] T(M) after/before: "
                + " ".join(f"{k}:{v:.2f}" for k, v in r["T_sync_after_over_before"].items()))
        self.T1 = out[modes[0]][1] / 1e3
        del caches
        gc.collect()

    def t_pipe(self, modes):
        a, r = self.args, self.r
        caches = {m: self.context_cache(m) for m in modes}
        base = mx.array(self.ids[:16], mx.int32)
        S = a.pipe_steps
        out = {m: {} for m in modes}
        for M in range(1, a.max_m + 1):
            for m in modes:
                target, _ = self.use(m)
                cache = caches[m]

                def chain():
                    prev = None
                    for _ in range(S):
                        if prev is None:
                            x = base[:M]
                        else:  # fed the previous forward's argmax, like decoding: a real data dependency
                            x = mx.concatenate([mx.argmax(prev[-1:], axis=-1).astype(mx.int32), base[1:M]])
                        prev = target.forward(x, cache).logits
                        mx.async_eval(prev)
                    mx.eval(prev)
                    trim_cache(cache, S * M)
                out[m][M] = timed_ms(chain, a.pipe_chains, warmup=1) / S
        r["T_pipe_ms"] = {m: {str(k): v for k, v in out[m].items()} for m in modes}
        r["T_pipe_ratio"] = {m: {str(k): v / out[m][1] for k, v in out[m].items()} for m in modes}
        for m in modes:
            t = out[m]
            log(f"[{self.name}] T(M) pipelined {m:9}: T(1) {t[1]:.2f} ms; T(M)/T(1) "
                + " ".join(f"{k}:{v / t[1]:.2f}" for k, v in t.items()))
        del caches
        gc.collect()

    # -- 2. plain decoding --------------------------------------------------------------------------
    def plain(self, modes):
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        a, r = self.args, self.r
        N = a.tokens
        res = {f"project_{m}": [] for m in modes}
        res["mlx_lm"] = []
        warm = True
        for _ in range(a.runs + 1):  # the first round of runs warms up (not counted)
            for m in modes:
                target, verifier = self.use(m)
                g = rt.generate_timed(speculative_generate_step(self.ids, target, None, verifier=verifier,
                                                                max_tokens=N))
                if not warm:
                    res[f"project_{m}"].append(g["tps"])
            g = rt.generate_timed(generate_step(mx.array(self.ids), self.model, max_tokens=N,
                                                prompt_cache=make_prompt_cache(self.model)))
            if not warm:
                res["mlx_lm"].append(g["tps"])
            warm = False
        r["plain_tps"] = res
        med = {k: rt.median(v) for k, v in res.items()}
        r["plain_tps_median"] = med
        self.T_step = 1.0 / med["mlx_lm"]
        r["T_step_mlxlm_ms"] = self.T_step * 1e3
        r["T_step_project_ms"] = {m: 1e3 / med[f"project_{m}"] for m in modes}
        log(f"[{self.name}] plain tok/s (median of {a.runs}): " + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
            + f"; mlx-lm step {self.T_step * 1e3:.2f} ms")

    def continuation(self, mode: str, n: int) -> list[int]:
        target, verifier = self.use(mode)
        return [int(t) for t, _, _ in speculative_generate_step(self.ids, target, None, verifier=verifier,
                                                                 max_tokens=n)]

    # -- 3. the round -------------------------------------------------------------------------------
    def spec_run(self, mode: str, proposer, max_tokens: int) -> dict:
        target, verifier = self.use(mode)
        st = SpecStats()
        for _ in speculative_generate_step(self.ids, target, proposer, verifier=verifier, block_size=self.B,
                                           max_tokens=max_tokens, stats=st):
            pass
        return {"decode_s": st.decode_s, "rounds": st.rounds, "tau": st.tau, "tokens": st.generated_tokens,
                "round_ms": st.decode_s / st.rounds * 1e3 if st.rounds else None,
                "tps": st.generated_tokens / st.decode_s if st.decode_s > 0 else None}

    def rounds_drafter(self, modes):
        a, r = self.args, self.r
        props = {m: DFlashProposer(self.drafter, self.targets[m], valid_vocab=self.V, min_confidence=0.0)
                 for m in modes}
        for m in modes:  # warm-up (first-use compilation: every verify width), not counted; a full block is needed
            # (session 20: an 8-token warm-up left the 16-row round's first compile, ~20 s, inside a timed run)
            self.spec_run(m, props[m], 2 * self.B + 2)
        runs = {m: [] for m in modes}
        for _ in range(a.runs):
            for m in modes:
                runs[m].append(self.spec_run(m, props[m], a.tokens))
        out = {}
        for m in modes:
            T = rt.median(x["round_ms"] for x in runs[m])
            out[m] = {"runs": runs[m], "round_ms": T, "round_mlxlm_steps": T / (self.T_step * 1e3),
                      "round_project_steps": T / r["T_step_project_ms"][m],
                      "tau": rt.median(x["tau"] for x in runs[m]),
                      "speedup_vs_mlxlm": {str(t): t * self.T_step * 1e3 / T for t in TAUS},
                      "speedup_vs_project_plain": {str(t): t * r["T_step_project_ms"][m] / T for t in TAUS},
                      "break_even_tau": T / (self.T_step * 1e3)}
            log(f"[{self.name}] round, fresh drafter, {m:9}: {T:.2f} ms/round = {out[m]['round_mlxlm_steps']:.2f} "
                f"mlx-lm steps (tau {out[m]['tau']:.2f}, {runs[m][-1]['rounds']} rounds); speedup at tau 3/4/5/6: "
                + " ".join(f"{v:.2f}x" for v in out[m]["speedup_vs_mlxlm"].values()))
        r["round_drafter"] = out
        if set(MODES) <= set(modes):
            r["round_after_over_before"] = out["kernel"]["round_ms"] / out["reference"]["round_ms"]

    def rounds_scripted(self, modes):
        a, r = self.args, self.r
        taus = a.script_taus
        need = a.script_rounds * max(taus) + 1
        out = {m: {} for m in modes}
        for m in modes:
            ref = self.continuation(m, need)
            self.spec_run(m, rt.ScriptedProposer(len(self.ids), ref, [self.B - 1], self.B, self.V, self.taps),
                          2 * self.B + 2)  # warm-up: full blocks
            for tau in taus:
                prop = rt.ScriptedProposer(len(self.ids), ref, [tau - 1], self.B, self.V, self.taps)
                # + 1: the prefill's token, so that the last round is not cut short by max_tokens
                runs = [self.spec_run(m, prop, a.script_rounds * tau + 1) for _ in range(a.runs)]
                T = rt.median(x["round_ms"] for x in runs)
                tps = rt.median(x["tps"] for x in runs)
                out[m][str(tau)] = {"runs": runs, "round_ms": T, "round_mlxlm_steps": T / (self.T_step * 1e3),
                                    "tau_measured": rt.median(x["tau"] for x in runs), "tps": tps,
                                    "speedup_vs_mlxlm_measured": tps * self.T_step}
            log(f"[{self.name}] round, scripted, {m:9}: " + "; ".join(
                f"tau {t} (measured {v['tau_measured']:.2f}): {v['round_ms']:.2f} ms = {v['round_mlxlm_steps']:.2f} "
                f"steps, {v['speedup_vs_mlxlm_measured']:.2f}x" for t, v in out[m].items()))
        r["round_scripted"] = out

    # -- driver -------------------------------------------------------------------------------------
    def run(self, save, reserve: float):
        """Every section that fits the budget (keeping ``reserve`` seconds for later shapes); ``save()``
        after each."""
        a, r, b = self.args, self.r, self.budget
        modes = [m for m in MODES if m in a.modes]
        self.build()
        save()
        T1 = self.est_T1()
        nm = len(modes)
        sections = [
            ("T_sync", lambda: nm * a.max_m * (a.repeats + 3) * T1 * 1.6 + 2 * a.context / 512 * T1 * 20,
             lambda: self.t_sync(modes)),
            ("plain", lambda: (a.runs + 1) * (nm + 1) * (a.tokens * self.T1 + 4 * self.T1 * a.context / 512 * 10),
             lambda: self.plain(modes)),
            ("round_drafter", lambda: (a.runs + 1) * nm * a.tokens * 3 * self.T1,
             lambda: self.rounds_drafter(modes)),
            ("round_scripted", lambda: nm * (a.script_rounds * max(a.script_taus) * self.T1
                                            + len(a.script_taus) * a.runs * a.script_rounds * 2.5 * self.T1),
             lambda: self.rounds_scripted(modes)),
            ("T_pipe", lambda: nm * a.max_m * (a.pipe_chains + 1) * a.pipe_steps * self.T1 * 1.5,
             lambda: self.t_pipe(modes)),
        ]
        if a.no_pipe:
            sections.pop()
        needs = {"round_drafter": "plain", "round_scripted": "plain"}
        for name, est, fn in sections:
            if name in needs and needs[name] not in r.get("done", []):
                r.setdefault("skipped", []).append(f"{name}: needs {needs[name]}")
                continue
            e = est()
            if not b.fits(e, reserve):
                r.setdefault("skipped", []).append(f"{name}: estimated {e:.0f} s, {b.left() - reserve:.0f} s left")
                log(f"[{self.name}] skip {name}: estimated {e:.0f} s > {b.left() - reserve:.0f} s left")
                continue
            log(f"[{self.name}] {name} (estimated {e:.0f} s)")
            t0 = time.perf_counter()
            try:
                fn()
                r.setdefault("done", []).append(name)
            except KernelError as ex:
                r.setdefault("errors", {})[name] = f"KernelError: {ex}"
                log(f"[{self.name}] {name}: KernelError: {ex}")
            r.setdefault("section_s", {})[name] = time.perf_counter() - t0
            save()

    def est_T1(self) -> float:
        """T(1) in seconds: measured once the sync section ran, else from the parameter count (H200 figures:
        ~1.1 ms per billion 4-bit parameters synchronous; the CPU is far slower, measured here)."""
        if hasattr(self, "T1"):
            return self.T1
        target, _ = self.use("reference")
        cache = self.context_cache("reference")
        ts = []
        for _ in range(3):  # the first call carries first-use compilation
            t = time.perf_counter()
            mx.eval(target.forward(mx.array(self.ids[:1], mx.int32), cache).logits)
            ts.append(time.perf_counter() - t)
            trim_cache(cache, 1)
        self.T1 = min(ts)
        return self.T1

    def free(self):
        for k in ("targets", "drafter", "model"):
            if hasattr(self, k):
                delattr(self, k)
        gc.collect()
        mx.clear_cache()


def est_shape_min(name: str, args) -> float:
    """A rough lower bound (s) for a shape's build + T(M) + plain + round on the H200 (used to keep time for
    later shapes)."""
    p = rt.param_count(rt.SHAPES[name]) / 1e9
    T1 = (1.1 * p + 1) / 1e3
    return 1.5 * p + 10 + len(args.modes) * (args.max_m * (args.repeats + 3) * T1 * 1.6
                                             + (args.runs + 1) * args.tokens * 4 * T1)


def plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot")
        return False
    shapes = [s for s in res["shapes"] if "T_sync_ratio" in s]
    if not shapes:
        return False
    fig, axes = plt.subplots(2, len(shapes), figsize=(6.5 * len(shapes), 9), squeeze=False)
    colors = {"reference": "tab:red", "kernel": "tab:blue"}
    label = {"reference": "before (MLX ops)", "kernel": "after (kernels)"}
    for j, s in enumerate(shapes):
        ax = axes[0][j]
        for m, ratios in s["T_sync_ratio"].items():
            Ms = sorted(int(k) for k in ratios)
            ax.plot(Ms, [ratios[str(k)] for k in Ms], "o-", color=colors[m],
                    label=f"{label[m]}, sync, T(1) {s['T_sync_ms'][m]['1']:.1f} ms")
        for m, ratios in s.get("T_pipe_ratio", {}).items():
            Ms = sorted(int(k) for k in ratios)
            ax.plot(Ms, [ratios[str(k)] for k in Ms], "s--", color=colors[m], alpha=0.6,
                    label=f"{label[m]}, pipelined, T(1) {s['T_pipe_ms'][m]['1']:.1f} ms")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"{s['shape']} ({s['params_b']:.1f}B, 4-bit g64, {res['meta']['dtype']}, "
                     f"{res['meta']['context']}-token context)")
        ax.set_xlabel("M (new tokens per forward)")
        ax.set_ylabel("T(M) / T(1)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        ax = axes[1][j]
        groups = []  # (label, {mode: mlx-lm steps})
        rd = s.get("round_drafter", {})
        if rd:
            groups.append(("fresh drafter\n(tau 1)", {m: v["round_mlxlm_steps"] for m, v in rd.items()}))
        rs = s.get("round_scripted", {})
        for t in sorted({t for v in rs.values() for t in v}, key=int):
            groups.append((f"scripted\ntau {t}", {m: v[t]["round_mlxlm_steps"] for m, v in rs.items() if t in v}))
        width = 0.38
        for k, m in enumerate(("reference", "kernel")):
            xs = [i + (k - 0.5) * width for i, (_, g) in enumerate(groups) if m in g]
            vs = [g[m] for _, g in groups if m in g]
            if xs:
                ax.bar(xs, vs, width, color=colors[m], label=label[m])
                for x, v in zip(xs, vs):
                    ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
        if groups:
            ax.set_xticks(range(len(groups)), [g for g, _ in groups], fontsize=8)
            ax.legend(fontsize=8)
        ax.set_ylabel("round cost / mlx-lm pipelined step")
        step = f"; mlx-lm step {s['T_step_mlxlm_ms']:.2f} ms" if "T_step_mlxlm_ms" in s else ""
        ax.set_title(f"round (propose + verify + accept), B=16{step}")
        ax.margins(y=0.12)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="qwen3-8b,dense-27b", help=f"comma-separated, of {', '.join(rt.SHAPES)}")
    p.add_argument("--modes", default="reference,kernel", help="kernel modes measured (before, after)")
    p.add_argument("--context", type=int, default=1024, help="context tokens before every measurement")
    p.add_argument("--tokens", type=int, default=96, help="tokens per decode run (plain and drafter rounds)")
    p.add_argument("--runs", type=int, default=3, help="decode runs per mode (medians)")
    p.add_argument("--repeats", type=int, default=10, help="synchronous forwards per T(M) (median)")
    p.add_argument("--max-m", type=int, default=16)
    p.add_argument("--pipe-steps", type=int, default=6, help="forwards per pipelined chain")
    p.add_argument("--pipe-chains", type=int, default=3, help="pipelined chains per M (median)")
    p.add_argument("--no-pipe", action="store_true", help="skip the pipelined T(M)")
    p.add_argument("--script-taus", default="3,4,5,6,16", help="taus of the scripted proposer")
    p.add_argument("--script-rounds", type=int, default=16, help="rounds per scripted run")
    p.add_argument("--warmup", type=int, default=3, help="untimed forwards before each T(M)")
    p.add_argument("--dtype", default="bfloat16", help="activations and scales (float32 for CPU logic tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=1e9, help="seconds; sections estimated not to fit are skipped")
    p.add_argument("--force-route", action="store_true",
                   help="route the kernel modules even on the CPU backend (logic tests: the references run)")
    p.add_argument("--tiny", action="store_true", help="CPU logic check: the tiny shape, small counts, --force-route")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--out", default="scaling-out", help="output directory (scaling.json, scaling.png)")
    a = p.parse_args(argv)
    if a.tiny:
        a.shapes, a.context, a.tokens, a.runs, a.repeats, a.warmup, a.dtype = "tiny", 96, 24, 2, 3, 1, "float32"
        a.pipe_steps, a.pipe_chains, a.script_rounds, a.force_route = 3, 2, 3, True
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in a.modes if m not in MODES]
    if bad or not a.modes:
        p.error(f"--modes: each of {', '.join(MODES)}, got {bad or a.modes}")
    a.script_taus = [int(t) for t in a.script_taus.split(",") if t.strip()]
    if any(t < 1 or t > 16 for t in a.script_taus):
        p.error("--script-taus: each in 1..16 (tau t = t - 1 accepted drafts + 1)")
    if not 1 <= a.max_m <= 16:
        p.error("--max-m: 1..16")
    if a.dtype not in ("bfloat16", "float16", "float32"):
        p.error(f"--dtype: bfloat16, float16 or float32, got {a.dtype!r}")
    a.dtype_name, a.dtype = a.dtype, getattr(mx, a.dtype)
    a.shape_list = [s.strip() for s in a.shapes.split(",") if s.strip()]
    for s in a.shape_list:
        if s not in rt.SHAPES:
            p.error(f"--shapes: unknown shape {s!r} (choose from {', '.join(rt.SHAPES)})")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    budget = rt.Budget(a.budget)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = rt.device_meta()
    meta.update(dtype=a.dtype_name, context=a.context, tokens=a.tokens, runs=a.runs, repeats=a.repeats, modes=a.modes,
                pipe_steps=a.pipe_steps, pipe_chains=a.pipe_chains, script_taus=a.script_taus,
                script_rounds=a.script_rounds, budget_s=a.budget, force_route=a.force_route,
                t_sync="mx.eval per forward, wall clock, median", t_pipe="chains of async_eval'd forwards, per forward",
                T_step="1 / median tok/s of mlx_lm.generate_step (pipelined) on the unrouted model object")
    log(json.dumps(meta))
    res = {"meta": meta, "shapes": []}

    def save():
        (out / "scaling.json").write_text(json.dumps(res, indent=1) + "\n")

    for i, name in enumerate(a.shape_list):
        reserve = sum(est_shape_min(n, a) for n in a.shape_list[i + 1:]) if mx.default_device() != mx.cpu else 0.0
        need = est_shape_min(name, a) if mx.default_device() != mx.cpu else 0.0
        if not budget.fits(need, reserve * 0.5):
            log(f"[{name}] skipped: estimated {need:.0f} s, {budget.left():.0f} s left")
            res["shapes"].append({"shape": name, "skipped": f"budget: estimated {need:.0f} s, {budget.left():.0f} s left"})
            save()
            continue
        s = Shape(name, a, budget)
        res["shapes"].append(s.r)
        try:
            s.run(save, reserve)
        except Exception as e:  # keep the other shapes
            import traceback

            traceback.print_exc()
            s.r["error"] = repr(e)
        finally:
            s.free()
            save()
        log(f"[{name}] done; {budget.left():.0f} s of the budget left")
    if not a.no_plot and plot(res, out / "scaling.png"):
        log(f"plot: {out / 'scaling.png'}")
    summary(res)
    save()
    return 1 if any("error" in s for s in res["shapes"]) else 0


def summary(res: dict) -> None:
    print("\nshape      mode       T(1) ms  T(2)  T(4)  T(8) T(16)/T(1)  plain tok/s  mlx-lm  round ms (steps)  "
          "speedup tau 3/4/5/6")
    for s in res["shapes"]:
        if "T_sync_ms" not in s:
            print(f"{s['shape']:10} {s.get('skipped') or s.get('error') or 'no T(M)'}")
            continue
        for m, t in s["T_sync_ms"].items():
            line = f"{s['shape']:10} {m:10} {t['1']:7.2f} " + " ".join(
                f"{t[str(k)] / t['1']:5.2f}" for k in (2, 4, 8, 16) if str(k) in t)
            pm = s.get("plain_tps_median", {})
            if pm:
                line += f"  {pm.get('project_' + m, 0):11.1f}  {pm.get('mlx_lm', 0):6.1f}"
            rd = s.get("round_drafter", {}).get(m)
            if rd:
                line += f"  {rd['round_ms']:7.2f} ({rd['round_mlxlm_steps']:.2f})  " + " ".join(
                    f"{v:.2f}" for v in rd["speedup_vs_mlxlm"].values())
            print(line)


if __name__ == "__main__":
    sys.exit(main())
