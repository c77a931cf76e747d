"""Issue 22 at a memory-bound shape: batched speculative rounds with a scripted drafter of fixed acceptance against
plain batched decoding (ours, and mlx-lm's ``BatchGenerator``, what ``mlx_lm.server`` batches with), in process.

On a random-weight Qwen3-8B-shaped target (``random_targets.build_target``, 4-bit), ``N`` requests of random
``--prompt-len``-token prompts decode ``--max-tokens`` tokens each, for every ``N`` of ``--concurrency``:

1. **ours, plain**: one :class:`~mlx_dflash2.batch.SpeculativeBatch` without a proposer (the server without a
   drafter); its tokens are each request's reference;
2. **ours, scripted tau t** for every ``t`` of ``--taus``: the same batch, every request with a
   ``ScriptedProposer`` that drafts the request's reference with its first error at block offset ``t - 1`` (a
   full-width round accepts ``t - 1`` drafts and emits ``t`` tokens; no drafter forward: the round's cost is the
   verify), ``schedule="auto"`` (the width schedule the server runs: the cap is chosen by measured tokens/s);
3. **mlx-lm plain**: ``mlx_lm.generate.BatchGenerator`` over the same model and prompts.

Reported per ``N`` (medians over ``--repeats``): aggregate tokens/s (all tokens / wall time, prefill included),
the ratio to mlx-lm's, tau (tokens per row per round), the rounds at each width cap, and whether every scripted
run's tokens equal the plain run's (greedy; a near-tie can move a token in bf16). A plot of tokens/s against ``N``.
The speed-only stand-in for a trained drafter the issue asks for on the H200; ``--shape tiny`` checks it on a CPU.

    scripts/run python benchmarks/bench_batch_scripted.py --shape tiny --concurrency 1,4 --max-tokens 16
    python3 benchmarks/bench_batch_scripted.py --concurrency 1,2,4,8,16,32 --taus 3,5 --out $OUT/batch-scripted.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # this checkout
import mlx_dflash2  # noqa: F401,E402  (before MLX: loads the optimized OpenBLAS)

import mlx.core as mx  # noqa: E402
import random_targets as rt  # noqa: E402

from mlx_dflash2.batch import SpeculativeBatch  # noqa: E402
from mlx_dflash2.drafter.config import default_target_layer_ids  # noqa: E402
from mlx_dflash2.target import TargetAdapter  # noqa: E402


def run_ours(target, prompts: list[list[int]], max_tokens: int, proposers=None, block_size: int = 16) -> dict:
    """One batch of every prompt (``proposers[i]`` or none): tokens/s, each request's tokens, tau, caps."""
    batch = SpeculativeBatch(target, schedule="auto")
    uids = [batch.add(p, max_tokens, proposer=proposers[i] if proposers else None,
                      block_size=block_size if proposers else 1) for i, p in enumerate(prompts)]
    out = {u: [] for u in uids}
    caps: dict = {}
    rounds = row_rounds = 0
    t0 = time.perf_counter()
    while batch.active or batch.pending:
        for ev in batch.step():
            out[ev.uid] += ev.tokens
        r = batch.last_round
        if r["rows"]:
            rounds += 1
            row_rounds += r["rows"]
            caps[str(r["cap"])] = caps.get(str(r["cap"]), 0) + 1
    wall = time.perf_counter() - t0
    tokens = sum(len(v) for v in out.values())
    return {"tok_s": tokens / wall, "tokens": [out[u] for u in uids], "caps": caps, "rounds": rounds,
            "tau": (tokens - len(prompts)) / max(row_rounds, 1)}


def run_mlx_lm(model, prompts: list[list[int]], max_tokens: int) -> dict:
    """mlx-lm's BatchGenerator (plain batched decoding) over the same prompts: tokens/s."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=[], completion_batch_size=max(32, len(prompts)),
                         prefill_batch_size=max(8, len(prompts)))
    gen.insert(prompts, [max_tokens] * len(prompts))
    tokens = 0
    t0 = time.perf_counter()
    while True:
        r = gen.next()
        done_prefill, generated = r if isinstance(r, tuple) else ([], r)
        if not generated and not done_prefill:
            break
        tokens += len(generated)
    wall = time.perf_counter() - t0
    gen.close()
    return {"tok_s": tokens / wall}


def plot(rows: list[dict], taus: list[int], out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    levels = sorted({r["n"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in [("mlx_lm", "mlx-lm BatchGenerator (plain)"), ("plain", "ours, plain")] + \
            [(f"tau{t}", f"ours, scripted tau {t}") for t in taus]:
        ys = [next(r[key] for r in rows if r["n"] == n) for n in levels]
        ax.plot(levels, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(n) for n in levels])
    ax.set_xlabel("requests in the batch")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("batched rounds, scripted drafter vs plain batched decoding")
    ax.legend()
    ax.grid(alpha=0.3)
    png = out.with_suffix(".png")
    fig.savefig(png, dpi=120, bbox_inches="tight")
    return png


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-8b", help="random_targets shape (tiny: a CPU check)")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--taus", default="3,5", help="scripted tau at full width (first error at offset tau - 1)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kernels", default="auto", help="TargetAdapter kernels (auto: what the product routes)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget", type=float, default=0.0, help="stop starting new concurrencies after this many s")
    ap.add_argument("--out", default=None, help="write the results as JSON (and a .png) here")
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    taus = [int(x) for x in args.taus.split(",")]
    if any(t < 1 or t > args.block_size for t in taus):
        ap.error(f"--taus must be within 1..{args.block_size}")
    t_start = time.perf_counter()
    model, cfg = rt.build_target(args.shape, dtype=getattr(mx, args.dtype))
    target = TargetAdapter(model, cfg, probe=False, kernels=args.kernels)
    V = rt.vocab_size(cfg)
    taps = tuple(default_target_layer_ids(cfg["num_hidden_layers"], 5))
    rows, runs = [], {}
    warm = [rt.random_ids(V, args.prompt_len, 10_000 + i) for i in range(2)]
    run_ours(target, warm, 4)  # first-use costs (kernel gates, builds) out of the timed runs
    run_mlx_lm(model, warm, 4)
    for n in levels:
        if args.budget and time.perf_counter() - t_start > args.budget:
            print(f"budget reached: N={n} and above skipped", flush=True)
            break
        prompts = [rt.random_ids(V, args.prompt_len, i) for i in range(n)]
        res: dict = {}
        for rep in range(args.repeats):
            plain = run_ours(target, prompts, args.max_tokens)
            res.setdefault("plain", []).append(plain)
            res.setdefault("mlx_lm", []).append(run_mlx_lm(model, prompts, args.max_tokens))
            for t in taus:
                props = [rt.ScriptedProposer(args.prompt_len, plain["tokens"][i], [t - 1], args.block_size, V, taps)
                         for i in range(n)]
                r = run_ours(target, prompts, args.max_tokens, props, args.block_size)
                r["equal_rows"] = sum(a == b for a, b in zip(r["tokens"], plain["tokens"]))
                res.setdefault(f"tau{t}", []).append(r)
        row = {"n": n}
        for k, rs in res.items():
            row[k] = statistics.median(r["tok_s"] for r in rs)
        for t in taus:
            rs = res[f"tau{t}"]
            row[f"tau{t}_measured"] = statistics.median(r["tau"] for r in rs)
            row[f"tau{t}_equal_rows"] = min(r["equal_rows"] for r in rs)
            row[f"tau{t}_caps"] = rs[-1]["caps"]
        rows.append(row)
        runs[n] = {k: [{kk: vv for kk, vv in r.items() if kk != "tokens"} for r in rs] for k, rs in res.items()}
        m = row["mlx_lm"]
        print(f"N={n:3d}: mlx-lm {m:8.1f} tok/s | ours plain {row['plain']:8.1f} ({row['plain'] / m:.2f}x) | "
              + " | ".join(f"tau {t}: {row[f'tau{t}']:8.1f} ({row[f'tau{t}'] / m:.2f}x, measured tau "
                           f"{row[f'tau{t}_measured']:.2f}, {row[f'tau{t}_equal_rows']}/{n} rows equal, caps "
                           f"{row[f'tau{t}_caps']})" for t in taus), flush=True)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": vars(args), "rows": rows, "runs": runs}, indent=1))
        png = plot(rows, taus, out) if rows else None
        print(f"results: {out}" + (f", {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
