"""SmolLM2 on the H200: the default drafter's speedup over plain decoding on the three held-out sets.

Re-measures part A of the shared research note h200-profile.md with the kernels (``--kernels auto``:
the registry's kernels where they pass their gates), same protocol: the embedded SmolLM2-135M-Instruct GGUF
(``--model``, its native Q4_1/Q8_0 weights, ``--dtype auto`` = the file's dtypes on a GPU), the first
``--n`` prompts of HumanEval, MT-Bench (first turn) and GSM8K rendered with the chat template, greedy, at
most ``--max-tokens`` tokens, stopping at EOS like a user. Per prompt and repeat: plain (the project's
pipelined loop without a drafter), then every mode (``auto``: the shipped drafter fused with lookup under
the adaptive schedule, the default; ``lookup``; ``shipped``: the drafter every round), so drift hits all
alike. One proposer per mode for the whole run (the adaptive schedule's statistics carry over, as in a
server). Unlike part A, prompts go round-robin over the sets (prompt i of each set, then i + 1), so a run
cut by ``--budget`` still covers every set.

Per set and mode: aggregate tok/s (all tokens / all decode seconds, repeats included), the ratio to plain,
the median of per-prompt ratios (each a median over repeats), tau, rounds by draft source, and how many
prompts gave plain's exact output. Before (part A: MLX 0.32.4, no kernels, the project as shipped then; MT-Bench
7 prompts): auto 1.36x HumanEval, 1.03x MT-Bench, 1.17x GSM8K (``BEFORE``). JSON to ``--out`` after every prompt.

    python benchmarks/gpu/smollm2_sets.py --model $PAYLOAD/SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT/sets.json
    scripts/run python benchmarks/gpu/smollm2_sets.py --tiny --out benchmarks/results/sets-cpu-tiny.json     # CPU logic check
"""

from __future__ import annotations

import mlx_dflash2  # noqa: F401  (before MLX)

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from mlx_dflash2.loading import load_target, make_proposer
from mlx_dflash2.speculative import SpecStats, speculative_generate_step
from mlx_dflash2.train.data import EVAL_SETS, load_eval_set
from mlx_dflash2.verify import GreedyVerifier

# h200-profile.md part A (MLX 0.32.4, no kernels, 10 / 7 / 10 prompts, 128 tokens, 2 repeats)
BEFORE = {"auto": {"humaneval": 1.36, "mtbench": 1.03, "gsm8k": 1.17, "all": 1.18},
          "shipped": {"humaneval": 1.23, "mtbench": 0.87, "gsm8k": 1.15, "all": 1.06},
          "lookup": {"humaneval": 1.13, "mtbench": 1.13, "gsm8k": 1.15, "all": 1.14},
          "plain_tps": {"humaneval": 127.0, "mtbench": 118.7, "gsm8k": 141.1, "all": 129.3}}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--modes", default="auto,lookup", help="drafter modes besides plain (auto, lookup, shipped)")
    p.add_argument("--sets", default="humaneval,mtbench,gsm8k")
    p.add_argument("--n", type=int, default=10, help="prompts per set")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kernels", default="auto", choices=["auto", "reference", "kernel"])
    p.add_argument("--dtype", default="auto", help="auto (the file's dtypes on a GPU), bfloat16, float16, float32")
    p.add_argument("--dequantize", action="store_true", help="dense weights (CPU logic tests)")
    p.add_argument("--budget", type=float, default=1e9, help="seconds; no prompt is started that would not fit")
    p.add_argument("--no-eos-stop", action="store_true")
    p.add_argument("--tiny", action="store_true", help="CPU logic check: 1 prompt per set, 16 tokens, 1 repeat")
    p.add_argument("--out", default="sets.json")
    a = p.parse_args(argv)
    if a.tiny:
        a.n, a.max_tokens, a.repeats, a.dtype, a.dequantize = 1, 16, 1, "float32", True
    a.modes = [m for m in a.modes.split(",") if m and m != "plain"]
    a.sets = [s for s in a.sets.split(",") if s]
    for m in a.modes:
        if m not in ("auto", "lookup", "shipped"):
            p.error(f"--modes: auto, lookup or shipped, got {m!r}")
    for s in a.sets:
        if s not in EVAL_SETS:
            p.error(f"--sets: one of {', '.join(EVAL_SETS)}, got {s!r}")
    if a.n < 1 or a.repeats < 1 or a.max_tokens < 2:
        p.error("--n >= 1, --repeats >= 1, --max-tokens >= 2")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    t_start = time.perf_counter()
    target, tok, name = load_target(a.model, dtype=a.dtype, dequantize=a.dequantize, kernels=a.kernels)
    props = {m: make_proposer(m, target, tok, name, kernels=a.kernels) for m in a.modes}
    verifier = GreedyVerifier(kernel_mode=a.kernels)
    eos = set() if a.no_eos_stop else set(tok.eos_token_ids or ())
    meta = {"target": Path(str(name)).name, "device": str(mx.default_device()), "mlx": mx.__version__,
            "kernels": a.kernels, "target_kernels": target.kernels, "dtype": str(target.dtype),
            "max_tokens": a.max_tokens, "repeats": a.repeats, "n": a.n, "eos_stop": not a.no_eos_stop,
            "modes": {m: (p.name if p else "none") + f" B={p.block_size if p else 1}" for m, p in props.items()},
            "order": "round-robin over sets; per prompt and repeat: plain, then each mode",
            "tps": "generated tokens / decode seconds (SpecStats.decode_tps; aggregate: sums)",
            "before_h200_profile_part_A": BEFORE, "date": time.strftime("%Y-%m-%d %H:%M")}
    try:
        import mlx_lm

        meta["mlx_lm"] = mlx_lm.__version__
    except Exception:
        pass
    log(json.dumps(meta))

    def run(ids, proposer):
        st = SpecStats()
        B = proposer.block_size if proposer is not None else 1
        out = []
        gen = speculative_generate_step(ids, target, proposer, verifier=verifier, block_size=B,
                                        max_tokens=a.max_tokens, stats=st)
        for t, _, _ in gen:
            out.append(int(t))
            if t in eos:
                break
        gen.close()
        return out, st

    # warm-up: kernels of every mode and shape class (not measured)
    w = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}], add_generation_prompt=True)
    for p in [None] + list(props.values()):
        run(w, p)
        run(w, p)
    log(f"loaded and warm in {time.perf_counter() - t_start:.1f} s (target kernels: {target.kernels})")

    sets = {s: load_eval_set(s, a.n) for s in a.sets}
    order = [(s, sets[s][i]) for i in range(a.n) for s in a.sets if i < len(sets[s])]
    rows, per_prompt_s = [], []
    out_path = Path(a.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    cut = False
    for set_name, item in order:
        left = a.budget - (time.perf_counter() - t_start)
        if per_prompt_s and left < 1.3 * max(per_prompt_s[-3:]):
            log(f"budget: {left:.0f} s left, a prompt takes ~{max(per_prompt_s[-3:]):.0f} s: stopping")
            cut = True
            break
        t0 = time.perf_counter()
        ids = tok.apply_chat_template(item["messages"], add_generation_prompt=True)
        rec = {"set": set_name, "id": item["id"], "prompt_tokens": len(ids), "plain": [], **{m: [] for m in a.modes}}
        ref = None
        for _ in range(a.repeats):
            toks, st = run(ids, None)
            ref = ref or toks
            rec["plain"].append({"tokens": len(toks), "tps": st.decode_tps, "decode_s": st.decode_s,
                                 "identical": toks == ref})
            for m, p in props.items():
                toks2, st2 = run(ids, p)
                rec[m].append({"tokens": len(toks2), "tps": st2.decode_tps, "decode_s": st2.decode_s, "tau": st2.tau,
                               "rounds": st2.rounds, "round_tokens": st2.round_tokens,
                               "by_source": dict(st2.rounds_by_source), "identical": toks2 == ref})
        rows.append(rec)
        per_prompt_s.append(time.perf_counter() - t0)
        pl = statistics.median(x["tps"] for x in rec["plain"])
        line = f"{set_name:9} {item['id']:14} n={len(ref):3} plain {pl:7.1f} tok/s"
        for m in a.modes:
            s = statistics.median(x["tps"] for x in rec[m])
            line += (f" | {m} {s / pl if pl else 0:5.2f}x tau {rec[m][-1]['tau']:4.2f}"
                     + ("" if all(x["identical"] for x in rec[m]) else " DIFF"))
        log(line)
        out_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")

    summ = summarize(rows, a)
    meta["cut_by_budget"] = cut
    meta["total_s"] = time.perf_counter() - t_start
    out_path.write_text(json.dumps({"meta": meta, "rows": rows, "summary": summ}, indent=1) + "\n")
    log(f"total {meta['total_s']:.0f} s")
    return 0


def summarize(rows, a) -> dict:
    """Per set (and ``all``) and mode: aggregate tok/s, ratio to plain, median per-prompt ratio, tau, identical."""
    summ = {}
    print(f"\n{'set':9} {'mode':8} {'prompts':>7} {'tok/s':>7} {'ratio':>6} {'med ratio':>9} {'tau':>5} {'same':>7}"
          f"  before (part A)  rounds by source")
    for set_name in a.sets + ["all"]:
        rs = [r for r in rows if set_name in ("all", r["set"])]
        if not rs:
            continue

        def agg(mode):
            toks = sum(x["tokens"] for r in rs for x in r[mode])
            secs = sum(x["decode_s"] for r in rs for x in r[mode])
            return toks / secs if secs else 0.0

        plain = agg("plain")
        summ[set_name] = {"prompts": len(rs), "plain_tps": plain}
        print(f"{set_name:9} {'plain':8} {len(rs):7} {plain:7.1f} {1.0:6.2f}")
        for m in a.modes:
            tps = agg(m)
            ratios = [statistics.median(x["tps"] for x in r[m]) / statistics.median(x["tps"] for x in r["plain"])
                      for r in rs if statistics.median(x["tps"] for x in r["plain"]) > 0]
            rounds = sum(x["rounds"] for r in rs for x in r[m])
            rt_ = sum(x["round_tokens"] for r in rs for x in r[m])
            same = sum(all(x["identical"] for x in r[m]) for r in rs)
            src = {}
            for r in rs:
                for x in r[m]:
                    for k, v in x["by_source"].items():
                        src[k] = src.get(k, 0) + v
            before = BEFORE.get(m, {}).get(set_name)
            summ[set_name][m] = {"tps": tps, "ratio": tps / plain if plain else 0.0,
                                 "median_ratio": statistics.median(ratios) if ratios else None,
                                 "tau": rt_ / rounds if rounds else 0.0, "identical": f"{same}/{len(rs)}",
                                 "by_source": src, "before_ratio": before}
            med = summ[set_name][m]["median_ratio"]
            print(f"{set_name:9} {m:8} {len(rs):7} {tps:7.1f} {summ[set_name][m]['ratio']:6.2f} "
                  f"{med if med is not None else float('nan'):9.2f} {summ[set_name][m]['tau']:5.2f} {same:3}/{len(rs):<3}"
                  f"  {'' if before is None else f'{before:.2f}x':15}  {src}")
    return summ


if __name__ == "__main__":
    sys.exit(main())
