"""Greedy speculative output equals plain output, token for token, where the kernels run (the H200).

With the registry's kernels routed (``kernels="kernel"``) the plain step (1 row) and the verify (B rows)
compute every row the same way (row-count-invariant ``qmm`` and ``verify_attention``), so greedy
speculative decoding must reproduce plain decoding exactly, near-ties included. This script checks it on
the device and reports how often MLX's own ops (``kernels="reference"``: other matmul kernels at 1 and at
16 rows) diverge at near-ties:

* **smollm2**: the embedded SmolLM2-135M-Instruct GGUF (``--gguf``) in bf16 with its native 4-bit / 8-bit
  weights (``load_target(path, dtype="bfloat16", dequantize=False, kernels=mode)``), the first
  ``--per-set`` prompts of each held-out set (chat template), plain vs the shipped drafter (fused with
  lookup, drafting every round) and vs lookup alone, ``--max-tokens`` tokens or EOS;
* **random**: the random-weight Qwen3-8B shape (bf16, 4-bit g64), ``--prompts`` random-token prompts (the
  last one periodic, so that lookup finds matches), plain vs a fresh drafter of the shipped shape fused with
  lookup, and vs a scripted proposer that proposes plain's own continuation with its first error at a
  cycling block offset (so every verify row position is accepted somewhere);
* **long**: ``--long-rounds`` (600+) verify rounds of the fresh drafter at growing KV lengths (every round a
  new length) with the kernels on, ``--long-passes`` passes over the same lengths: no exception, output
  equal to plain, and the time per round by windows of 100 rounds; a per-new-length cost (the cuDNN SDPA
  graph build of h200-profile.md, 60-75 ms per round) would show as pass 1 >> pass 2.

Exit status 1 on any mismatch or error with the kernels (or kernels not routed on a GPU); the reference
mode's divergences are reported, not failures. JSON to ``--out``. On MLX's CPU backend ``kernel`` runs
the references (nothing is routed unless ``--force-route``): ``--tiny`` checks the script's logic there.

    python benchmarks/gpu/exactness.py --gguf $PAYLOAD/SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT/exactness.json
    scripts/run python benchmarks/gpu/exactness.py --tiny --out benchmarks/results/exactness-cpu-tiny.json      # CPU logic check
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import random_targets as rt  # noqa: E402  (imports mlx_dflash2 before MLX)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import mlx.core as mx  # noqa: E402

from mlx_dflash2.proposers import DFlashProposer, FusedProposer, LookupProposer  # noqa: E402
from mlx_dflash2.speculative import SpecStats, speculative_generate_step  # noqa: E402
from mlx_dflash2.target import TargetAdapter  # noqa: E402
from mlx_dflash2.verify import GreedyVerifier  # noqa: E402

from random_targets import log  # noqa: E402

MODES = ("kernel", "reference")
SCRIPT_OFFSETS = [15, 0, 3, 7, 1, 11, 5, 2, 14, 9, 4, 6, 8, 10, 12, 13]


def first_diff(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix of the other), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def generate(target, proposer, ids, mode, max_tokens, stop_ids=(), block_size=None):
    """Greedy tokens of the project's loop (stopping after a token of ``stop_ids``) and its stats."""
    st = SpecStats()
    out = []
    gen = speculative_generate_step(ids, target, proposer, verifier=GreedyVerifier(kernel_mode=mode),
                                    block_size=block_size, max_tokens=max_tokens, stats=st)
    for tok, _, _ in gen:
        out.append(int(tok))
        if tok in stop_ids:
            break
    gen.close()
    return out, st


def compare(name, plain, spec, st) -> dict:
    d = first_diff(plain, spec)
    return {"proposer": name, "equal": d is None, "first_diff": d, "n_plain": len(plain), "n_spec": len(spec),
            "tau": st.tau, "rounds": st.rounds, "by_source": dict(st.rounds_by_source),
            "accept_hist": list(st.accept_hist)}


class Run:
    def __init__(self, args):
        self.a = args
        self.budget = rt.Budget(args.budget)
        self.res = {"meta": rt.device_meta(), "failures": []}
        self.res["meta"].update({k: (v if isinstance(v, (int, float, str, list, bool, type(None))) else str(v))
                                 for k, v in vars(args).items()})
        self.gpu = mx.default_device() != mx.cpu

    def save(self):
        if self.a.out:
            Path(self.a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(self.a.out).write_text(json.dumps(self.res, indent=1) + "\n")

    def fail(self, msg: str):
        log(f"FAIL: {msg}")
        self.res["failures"].append(msg)

    def check_routed(self, part, mode, n_routed):
        if mode == "kernel" and n_routed == 0:
            if self.gpu:
                self.fail(f"{part}: kernels='kernel' routed no module on {mx.default_device()} (the probe undid it?)")
            else:
                log(f"{part}: CPU backend: nothing routed (kernel = the references; --force-route to route)")

    def reserve(self, *parts) -> float:
        """Rough seconds the later parts need on the H200 (0 on the CPU, where nothing is estimated)."""
        if not self.gpu:
            return 0.0
        a, s = self.a, 0.0
        if "random" in parts and "random" in a.parts:
            s += 25 + len(a.modes) * a.prompts * 3 * a.tokens * 0.012
        if "long" in parts and "long" in a.parts:
            s += 25 + a.long_rounds * (0.012 + a.long_passes * 0.03)
        return s

    # -- smollm2 ------------------------------------------------------------------------------------
    def smollm2(self):
        from mlx_dflash2.loading import load_target, make_proposer
        from mlx_dflash2.train.data import load_eval_set

        a = self.a
        out = self.res["smollm2"] = {"gguf": str(a.gguf)}
        items = [(s, it) for s in a.sets for it in load_eval_set(s, a.per_set)]
        for mode in a.modes:
            t0 = time.perf_counter()
            target, tok, name = load_target(a.gguf, dtype=a.dtype, dequantize=a.smol_dequantize, kernels=mode)
            n = target.route_kernels(mode, force=a.force_route and mode != "reference")
            self.check_routed("smollm2", mode, n)
            props = {p: make_proposer(p, target, tok, name, kernels=mode, min_confidence=0.0)
                     for p in a.smol_proposers}
            rec = out[mode] = {"routed_modules": n, "target_mode": target.kernels, "load_s": time.perf_counter() - t0,
                               "proposers": {p: (pr.name if pr else "none") for p, pr in props.items()},
                               "prompts": []}
            stop = set(tok.eos_token_ids or ())
            log(f"smollm2 {mode}: loaded ({n} modules routed), proposers {rec['proposers']}")
            for set_name, item in items:
                if not self.budget.fits(8 * a.max_tokens / 100, self.reserve("random", "long")):
                    rec["cut_by_budget"] = True
                    log(f"smollm2 {mode}: budget reached")
                    break
                ids = tok.apply_chat_template(item["messages"], add_generation_prompt=True)
                row = {"set": set_name, "id": item["id"], "prompt_tokens": len(ids), "results": []}
                try:
                    plain, _ = generate(target, None, ids, mode, a.max_tokens, stop)
                    row["n_plain"] = len(plain)
                    for p, pr in props.items():
                        spec, st = generate(target, pr, ids, mode, a.max_tokens, stop)
                        row["results"].append(compare(p, plain, spec, st))
                except Exception as e:
                    traceback.print_exc()
                    row["error"] = repr(e)
                rec["prompts"].append(row)
                line = " | ".join(f"{x['proposer']} {'same' if x['equal'] else 'DIFF at ' + str(x['first_diff'])} "
                                  f"tau {x['tau']:.2f}" for x in row["results"])
                log(f"smollm2 {mode:9} {set_name:9} {item['id']:14} n={row.get('n_plain')} {line or row.get('error')}")
                if mode == "kernel":
                    if "error" in row:
                        self.fail(f"smollm2 kernel {item['id']}: {row['error']}")
                    for x in row["results"]:
                        if not x["equal"]:
                            self.fail(f"smollm2 kernel {item['id']} {x['proposer']}: differs from plain at token "
                                      f"{x['first_diff']}")
                self.save()
            rec["summary"] = {p: f"{sum(x['equal'] for r in rec['prompts'] for x in r['results'] if x['proposer'] == p)}"
                                 f"/{len(rec['prompts'])} equal" for p in props}
            log(f"smollm2 {mode}: {rec['summary']}")
            del target, props
            gc.collect()
            mx.clear_cache()

    # -- random 8B ----------------------------------------------------------------------------------
    def build_random(self):
        a = self.a
        if hasattr(self, "targets"):
            return
        t0 = time.perf_counter()
        model, cfg = rt.build_target(a.shape, dtype=a.rdtype, seed=a.seed)
        self.V = cfg["vocab_size"]
        self.targets = {}
        self.routed = {}
        for mode in a.modes:
            m = model if mode == "reference" else rt.twin(model, cfg, dtype=a.rdtype)
            t = TargetAdapter(m, cfg, probe=False, kernels="reference")
            self.routed[mode] = t.route_kernels(mode, force=a.force_route and mode != "reference")
            self.targets[mode] = t
        self.drafter = rt.make_drafter(next(iter(self.targets.values())), self.V, seed=a.seed, dtype=a.rdtype)
        self.res.setdefault("random_build", {}).update(shape=a.shape, build_s=time.perf_counter() - t0,
                                                       routed_modules=self.routed)
        log(f"random {a.shape}: built in {time.perf_counter() - t0:.1f} s, routed {self.routed}")

    def random(self):
        a = self.a
        self.build_random()
        V = self.V
        prompts = [rt.random_ids(V, a.prompt_len, seed=100 + i) for i in range(max(a.prompts - 1, 0))]
        if a.prompts:
            seg = rt.random_ids(V, 32, seed=99)
            prompts.append((seg * (a.prompt_len // 32 + 1))[: a.prompt_len])
        out = self.res["random"] = {"shape": a.shape}
        B = self.drafter.config.block_size
        taps = tuple(self.drafter.config.target_layer_ids)
        for mode in a.modes:
            target = self.targets[mode]
            self.check_routed("random", mode, self.routed[mode])
            rt.drafter_mode(self.drafter, mode)
            fused = FusedProposer(DFlashProposer(self.drafter, target, valid_vocab=V, min_confidence=0.0),
                                  LookupProposer(block_size=8), schedule=None)
            rec = out[mode] = {"routed_modules": self.routed[mode], "prompts": []}
            for i, ids in enumerate(prompts):
                if not self.budget.fits(a.tokens * 0.05, self.reserve("long")):
                    rec["cut_by_budget"] = True
                    log(f"random {mode}: budget reached")
                    break
                row = {"prompt": i, "periodic": i == len(prompts) - 1, "results": []}
                try:
                    plain, _ = generate(target, None, ids, mode, a.tokens)
                    row["n_plain"] = len(plain)
                    spec, st = generate(target, fused, ids, mode, a.tokens, block_size=B)
                    row["results"].append(compare("fresh drafter + lookup", plain, spec, st))
                    scripted = rt.ScriptedProposer(len(ids), plain, SCRIPT_OFFSETS, B, V, taps)
                    spec, st = generate(target, scripted, ids, mode, a.tokens, block_size=B)
                    row["results"].append(compare("scripted", plain, spec, st))
                except Exception as e:
                    traceback.print_exc()
                    row["error"] = repr(e)
                rec["prompts"].append(row)
                line = " | ".join(f"{x['proposer']} {'same' if x['equal'] else 'DIFF at ' + str(x['first_diff'])} "
                                  f"tau {x['tau']:.2f} {x['by_source']}" for x in row["results"])
                log(f"random {mode:9} prompt {i} n={row.get('n_plain')} {line or row.get('error')}")
                if mode == "kernel":
                    if "error" in row:
                        self.fail(f"random kernel prompt {i}: {row['error']}")
                    for x in row["results"]:
                        if not x["equal"]:
                            self.fail(f"random kernel prompt {i} {x['proposer']}: differs from plain at token "
                                      f"{x['first_diff']}")
                self.save()

    # -- long run -----------------------------------------------------------------------------------
    def long(self):
        a = self.a
        self.build_random()
        out = self.res["long"] = {}
        B = self.drafter.config.block_size
        ids = rt.random_ids(self.V, a.long_context, seed=7)
        for mode in a.long_modes:
            if mode not in self.targets:
                continue
            target = self.targets[mode]
            rt.drafter_mode(self.drafter, mode)
            prop = DFlashProposer(self.drafter, target, valid_vocab=self.V, min_confidence=0.0)
            rec = out[mode] = {"context": a.long_context, "passes": []}
            try:
                plain, _ = generate(target, None, ids, mode, a.long_rounds + 1)
                for p in range(a.long_passes):
                    est = a.long_rounds * (0.03 if self.gpu else 0.0)
                    if not self.budget.fits(est):
                        rec["cut_by_budget"] = f"before pass {p + 1}"
                        log(f"long {mode}: budget reached before pass {p + 1}")
                        break
                    rec["passes"].append(self.long_pass(target, prop, ids, mode, plain, B))
                    self.save()
            except Exception as e:
                traceback.print_exc()
                rec["error"] = repr(e)
            ps = rec["passes"]
            if len(ps) >= 2:
                rec["pass1_over_pass2"] = [w1["median_ms"] / w2["median_ms"] for w1, w2 in
                                           zip(ps[0]["windows"], ps[1]["windows"])]
                log(f"long {mode}: pass 1 / pass 2 per window: " + " ".join(f"{x:.2f}" for x in rec["pass1_over_pass2"]))
            if mode == "kernel":
                if "error" in rec:
                    self.fail(f"long kernel: {rec['error']}")
                for i, p in enumerate(ps):
                    if not p["equal_plain"]:
                        self.fail(f"long kernel pass {i + 1}: differs from plain at token {p['first_diff']}")
                    if p["rounds"] < a.long_rounds * 0.9:
                        log(f"long kernel pass {i + 1}: only {p['rounds']} rounds (drafts accepted)")
            self.save()

    def long_pass(self, target, prop, ids, mode, plain, B) -> dict:
        """One run of the loop; per round (ended by a non-draft token) its period and the anchor's KV length."""
        a = self.a
        st = SpecStats()
        toks, rounds = [], []
        gen = speculative_generate_step(ids, target, prop, verifier=GreedyVerifier(kernel_mode=mode), block_size=B,
                                        max_tokens=a.long_rounds + 1, stats=st)
        t_prev = None
        for tok, _, from_draft in gen:
            toks.append(int(tok))
            now = time.perf_counter()
            if t_prev is None:
                t_prev = now  # the prefill's token
                continue
            if not from_draft:  # the correction / bonus token ends a round
                rounds.append((len(ids) + len(toks) - 1, (now - t_prev) * 1e3))
                t_prev = now
        gen.close()
        W = a.window
        windows = []
        for s in range(0, len(rounds), W):
            chunk = rounds[s:s + W]
            ms = [x[1] for x in chunk]
            windows.append({"rounds": f"{s + 1}-{s + len(chunk)}", "kv_from": chunk[0][0], "kv_to": chunk[-1][0],
                            "median_ms": statistics.median(ms), "max_ms": max(ms), "mean_ms": sum(ms) / len(ms)})
        d = first_diff(plain, toks)
        res = {"rounds": st.rounds, "tau": st.tau, "decode_s": st.decode_s, "equal_plain": d is None, "first_diff": d,
               "round_ms_median": statistics.median(x[1] for x in rounds) if rounds else None, "windows": windows}
        log(f"long {mode}: {st.rounds} rounds, tau {st.tau:.2f}, {st.decode_s:.1f} s, "
            f"{'equal to plain' if d is None else 'DIFF at ' + str(d)}; ms/round by window: "
            + " ".join(f"[{w['kv_from']}..{w['kv_to']}] {w['median_ms']:.1f} (max {w['max_ms']:.0f})" for w in windows))
        return res

    def run(self) -> int:
        a = self.a
        log(json.dumps(self.res["meta"]))
        for part in ("smollm2", "random", "long"):
            if part not in a.parts:
                continue
            if part == "smollm2" and not a.gguf:
                self.fail("smollm2: no --gguf and the embedded model is not installed")
                continue
            t0 = time.perf_counter()
            try:
                getattr(self, part)()
            except Exception as e:
                traceback.print_exc()
                self.fail(f"{part}: {e!r}")
            self.res.setdefault("part_s", {})[part] = time.perf_counter() - t0
            log(f"{part}: {time.perf_counter() - t0:.0f} s; {self.budget.left():.0f} s of the budget left")
            self.save()
        ok = not self.res["failures"]
        self.res["ok"] = ok
        self.save()
        log("ALL EQUAL (kernels)" if ok else f"{len(self.res['failures'])} FAILURE(S): " + "; ".join(self.res["failures"]))
        return 0 if ok else 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", default=None, help="the SmolLM2 GGUF (default: the embedded model, if installed)")
    p.add_argument("--parts", default="smollm2,random,long")
    p.add_argument("--modes", default="kernel,reference", help="kernel modes checked (kernel: failures count)")
    p.add_argument("--dtype", default="bfloat16", help="SmolLM2's dtype (scales, activations)")
    p.add_argument("--sets", default="humaneval,mtbench,gsm8k")
    p.add_argument("--per-set", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--smol-proposers", default="shipped,lookup")
    p.add_argument("--smol-dequantize", action="store_true",
                   help="dense SmolLM2 weights (CPU logic tests: a quantized prefill is slow there)")
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--rdtype", default="bfloat16", help="the random target's dtype")
    p.add_argument("--prompts", type=int, default=4, help="random prompts (the last one periodic)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--long-rounds", type=int, default=640)
    p.add_argument("--long-context", type=int, default=1024)
    p.add_argument("--long-passes", type=int, default=2)
    p.add_argument("--long-modes", default="kernel")
    p.add_argument("--window", type=int, default=100, help="rounds per reported window of the long run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=1e9, help="seconds; later prompts / passes are cut")
    p.add_argument("--force-route", action="store_true", help="route even on the CPU backend (logic tests)")
    p.add_argument("--tiny", action="store_true", help="CPU logic check: few short prompts, the tiny shape, float32")
    p.add_argument("--out", default="exactness.json")
    a = p.parse_args(argv)
    if a.tiny:
        a.per_set, a.max_tokens, a.dtype, a.shape, a.rdtype, a.prompts = 1, 24, "float32", "tiny", "float32", 3
        a.smol_dequantize = True
        a.prompt_len, a.tokens, a.long_rounds, a.long_context, a.window, a.force_route = 48, 40, 60, 64, 20, True
    a.parts = [x for x in a.parts.split(",") if x]
    a.modes = [x for x in a.modes.split(",") if x]
    a.long_modes = [x for x in a.long_modes.split(",") if x]
    a.sets = [x for x in a.sets.split(",") if x]
    a.smol_proposers = [x for x in a.smol_proposers.split(",") if x]
    for name, vals, allowed in (("--parts", a.parts, ("smollm2", "random", "long")), ("--modes", a.modes, MODES),
                                ("--long-modes", a.long_modes, MODES)):
        bad = [v for v in vals if v not in allowed]
        if bad:
            p.error(f"{name}: unknown {bad} (choose from {', '.join(allowed)})")
    if a.shape not in rt.SHAPES:
        p.error(f"--shape: unknown {a.shape!r} (choose from {', '.join(rt.SHAPES)})")
    for name in ("dtype", "rdtype"):
        if getattr(a, name) not in ("bfloat16", "float16", "float32"):
            p.error(f"--{name}: bfloat16, float16 or float32")
    a.rdtype = getattr(mx, a.rdtype)
    if a.gguf is None and "smollm2" in a.parts:
        try:
            from mlx_dflash2.assets import embedded_model_path

            a.gguf = str(embedded_model_path())
        except Exception:
            a.gguf = None
    if a.long_rounds < 1 or a.long_passes < 1 or a.window < 1:
        p.error("--long-rounds, --long-passes, --window: >= 1")
    return a


def main(argv=None) -> int:
    return Run(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
