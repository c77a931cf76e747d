"""Long prompts with the drafter: plain vs speculative decoding at 1K / 4K / 8K-token prompts.

The embedded SmolLM2-135M-Instruct target (8K context) loaded as the CLI loads it on this device
(``dtype=auto``, ``dequantize=None``: dense float32 on MLX's CPU backend), the shipped DFlash2 drafter
with its default context window (``--drafter-window``, 4096 rows), greedy. The prompt is a long
document (concatenated text of the eval sets in ``mlx_dflash2/data/evalsets``) with a "summarize"
request in the chat template, cut to the requested length in tokens. Configurations:

* ``plain``: no drafter (the pipelined plain loop);
* ``auto``: the default (``--drafter auto``): shipped drafter fused with lookup under the adaptive
  schedule (calibrated widths, the cached calibration);
* ``every``: the shipped drafter alone (no lookup, no schedule): it drafts every round, so its
  acceptance by block position shows how it decays with the depth of the context;
* ``every-W0`` (``--unbounded``; lengths above the window only): the same with an unbounded drafter
  context (``drafter_window=0``), for the window's cost in acceptance.

The target prefills each prompt once (chunked, timed, with a progress bar) with the drafter's tap
features; every configuration's state after the prefill is built from it (a copy of the target cache, its
session extended chunk by chunk as the loop's own prefill does, timed as ``drafter_ctx_s``), and each
configuration decodes ``--repeats`` times from a copy of that state (the prompt cache: only the last prompt
token is fed again), the configurations interleaved so that a change of the machine's load hits them all.
Reported: the prefill seconds (target + the configuration's drafter context), decode tokens/s (median),
speedup over plain, tau, the acceptance rate by block position, whether the output equals plain's, the
target's KV cache and the drafter context's size (MB, rows held per layer) and the decode's peak memory
above what was allocated before it (``mx.get_peak_memory``). JSON and a plot (matplotlib) go to ``--out``.

    scripts/run python benchmarks/bench_long_context.py                      # 1K, 4K, ~8K
    scripts/run python benchmarks/bench_long_context.py --lengths 1024 --repeats 1 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx_dflash2  # noqa: F401  (before MLX: loads the optimized OpenBLAS, mlx_dflash2/_blas.py)
import mlx.core as mx

from mlx_dflash2.drafter.model import DEFAULT_CONTEXT_WINDOW
from mlx_dflash2.loading import drafter_dequantize, load_target, make_proposer
from mlx_dflash2.speculative import PLAIN_PROPOSER, GenerationState, SpecStats, _clone_cache, speculative_generate_step

EVALSETS = Path(mlx_dflash2.__file__).parent / "data" / "evalsets"
REQUEST = "\n\nSummarize the document above in a few sentences, then continue it with one more item in the same style."


def document() -> str:
    """The eval sets' text, concatenated (mtbench turns, gsm8k questions, humaneval prompts), interleaved
    so that any prefix mixes the three kinds."""
    parts = {}
    for name in ("mtbench", "gsm8k", "humaneval"):
        rows = [json.loads(line) for line in (EVALSETS / f"{name}.jsonl").read_text().splitlines() if line.strip()]
        texts = []
        for r in rows:
            if "turns" in r:
                texts.append("\n".join(r["turns"]))
            else:
                texts.append(r.get("question") or r.get("prompt") or "")
        parts[name] = [t for t in texts if t]
    out = []
    for i in range(max(len(v) for v in parts.values())):
        for v in parts.values():
            if i < len(v):
                out.append(v[i])
    return "\n\n".join(out)


def build_prompt(tok, doc_ids: list[int], length: int) -> list[int]:
    """Chat-template prompt of about ``length`` tokens: the first document tokens and :data:`REQUEST`."""
    empty = tok.apply_chat_template([{"role": "user", "content": REQUEST}], add_generation_prompt=True)
    n = max(1, length - len(empty))
    while True:
        text = tok.decode(doc_ids[:n])
        ids = tok.apply_chat_template([{"role": "user", "content": text + REQUEST}], add_generation_prompt=True)
        if len(ids) <= length or n <= 1:
            return ids
        n -= len(ids) - length


def run(target, ids, proposer, state, max_tokens):
    stats = SpecStats()
    mx.reset_peak_memory()
    toks = [t for t, _, _ in speculative_generate_step(ids, target, proposer, block_size=proposer.block_size if proposer
                                                       else 1, max_tokens=max_tokens, stats=stats, state=state)]
    return toks, stats, mx.get_peak_memory()


def plot(rows: list[dict], path: Path, title: str) -> Path | None:
    """Speedup and tau against the prompt length, and the acceptance by block position (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    configs = [c for c in dict.fromkeys(r["config"] for r in rows) if c != "plain"]
    for c in configs:
        rs = [r for r in rows if r["config"] == c]
        x = [r["prompt_tokens"] for r in rs]
        axes[0].plot(x, [r["speedup"] for r in rs], "o-", label=c)
        axes[1].plot(x, [r["tau"] for r in rs], "o-", label=c)
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].set_xlabel("prompt tokens")
    axes[0].set_ylabel("decode speedup vs plain")
    axes[1].set_xlabel("prompt tokens")
    axes[1].set_ylabel("acceptance length tau")
    for r in rows:
        if r["config"].startswith("every"):
            acc = [a for a in r["acceptance_by_position"] if a is not None]
            axes[2].plot(range(1, len(acc) + 1), acc, "o-", ms=3, label=f"{r['config']} {r['prompt_tokens']}")
    axes[2].set_xlabel("block position")
    axes[2].set_ylabel("acceptance rate (drafter every round)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="the target (default: the embedded SmolLM2-135M-Instruct; on a "
                    "machine without the package, its GGUF file)")
    ap.add_argument("--lengths", default="1024,4096,8000", help="prompt lengths in tokens (comma-separated)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2, help="decode repeats per configuration (median)")
    ap.add_argument("--drafter-window", type=int, default=DEFAULT_CONTEXT_WINDOW)
    ap.add_argument("--unbounded", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the drafter with an unbounded context at lengths above the window")
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--out", default="benchmarks/results/long-context-cpu.json")
    ap.add_argument("--replot", default=None, metavar="JSON", help="only redraw the plot of a saved run")
    args = ap.parse_args(argv)
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        print(plot(saved["rows"], Path(args.replot).with_suffix(".png"), saved["meta"]["title"]))
        return
    from tqdm import tqdm

    target, tok, name = load_target(args.model, dtype="auto", dequantize=None)
    deq = drafter_dequantize(None, target)
    limit = target.max_context
    W = args.drafter_window
    proposers = {
        "plain": None,
        "auto": make_proposer("auto", target, tok, name, dequantize=deq, drafter_window=W),
        "every": make_proposer("shipped", target, tok, name, dequantize=deq, lookup=False, drafter_window=W),
    }
    if args.unbounded and W > 0:
        proposers["every-W0"] = make_proposer("shipped", target, tok, name, dequantize=deq, lookup=False,
                                              drafter_window=0)
    doc_ids = tok.encode(document(), add_special_tokens=False)
    lengths = [int(x) for x in args.lengths.split(",")]
    if limit is not None:
        lengths = [min(n, limit - args.max_tokens - 1) for n in lengths]
    title = (f"{Path(str(name)).name} on {mx.default_device()} (dense={'quantization' not in target.config}), "
             f"drafter window {W}, {args.max_tokens} tokens, greedy")
    meta = {"target": Path(str(name)).name, "device": str(mx.default_device()), "max_context": limit,
            "dense": "quantization" not in target.config, "drafter_window": W, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "document_tokens": len(doc_ids), "prefill_step_size": args.prefill_step_size,
            "date": time.strftime("%Y-%m-%d %H:%M"), "title": title}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    header = (f"{'prompt':>6} {'config':9} {'prefill s':>9} {'tok/s':>7} {'speedup':>8} {'tau':>5} {'same':>4} "
              f"{'KV MB':>6} {'ctx MB':>6} {'ctx rows':>8} {'peak+ MB':>8}  acceptance by position 1..8")

    def line(r):
        acc = " ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_by_position"][:8])
        return (f"{r['prompt_tokens']:>6} {r['config']:9} {r['prefill_s']:>9.1f} {r['decode_tps']:>7.2f} "
                f"{r['speedup']:>7.2f}x {r['tau']:>5.2f} {'yes' if r['identical'] else 'NO':>4} "
                f"{r['target_cache_mb']:>6.0f} {r['drafter_ctx_mb']:>6.1f} {str(r['drafter_ctx_rows'] or '-'):>8} "
                f"{r['decode_peak_extra_mb']:>8.0f}  {acc}")

    rows = []
    tic_all = time.perf_counter()
    tap_ids = tuple(proposers["every"].tap_ids)
    warm = build_prompt(tok, doc_ids, 64)
    for prop in proposers.values():  # warm-up (first-call costs, the adaptive schedule's first samples)
        run(target, warm, prop, None, 8)
    for L in lengths:
        ids = build_prompt(tok, doc_ids, L)
        # the target's prefill once (timed, progress bar), with the drafter's tap features of every chunk
        cache, chunks = target.make_cache(), []
        bar = tqdm(total=len(ids) - 1, desc=f"prefill {len(ids)}", file=sys.stderr, unit="tok", leave=False)
        tic = time.perf_counter()
        for a in range(0, len(ids) - 1, args.prefill_step_size):
            chunk = ids[a : min(a + args.prefill_step_size, len(ids) - 1)]
            res = target.forward(mx.array(chunk, dtype=mx.int32), cache, tap_ids, last_only=True)
            mx.eval([c.state for c in cache] + [res.features])
            chunks.append((chunk, res.features))
            bar.update(len(chunk))
        bar.close()
        target_prefill_s = time.perf_counter() - tic
        # each configuration's state after the prefill: a copy of the target cache and its session, extended
        # chunk by chunk as the loop's prefill does; a run from it feeds the last prompt token only
        bases, ctx_s = {}, {}
        for cname, prop in proposers.items():
            if cname == "every-W0" and len(ids) <= W:
                continue
            tic = time.perf_counter()
            p = prop or PLAIN_PROPOSER
            session = p.start(ids)
            for chunk, feats in chunks:
                session.extend(chunk, feats if p.tap_ids else None)
                mx.eval(session.state_arrays())
            ctx_s[cname] = time.perf_counter() - tic
            bases[cname] = GenerationState(cache=[_clone_cache(c) for c in cache], session=session,
                                           tokens=list(ids[:-1]), proposer=p)
        del cache, chunks
        tps = {c: [] for c in bases}
        outs = {c: [] for c in bases}
        last = {}
        for _ in tqdm(range(args.repeats), desc=f"decode {len(ids)}", file=sys.stderr, leave=False):
            for cname in bases:  # configurations interleaved: a change of the machine's load hits them all
                st = bases[cname].clone()
                mx.eval([c.state for c in st.cache] + st.session.state_arrays())
                before = mx.get_active_memory()
                out, s, peak = run(target, ids, proposers[cname], st, args.max_tokens)
                tps[cname].append(s.decode_tps)
                outs[cname].append(out)
                last[cname] = (s, peak - before, st)
                del st
        ref = outs["plain"][0]
        for cname in bases:
            s, peak_extra, st = last[cname]
            sess = getattr(st.session, "d", st.session)
            ctx = getattr(sess, "ctx", None)
            row = {
                "prompt_tokens": len(ids),
                "config": cname,
                "drafter": s.drafter,
                "target_prefill_s": target_prefill_s,
                "drafter_ctx_s": ctx_s[cname],
                "prefill_s": target_prefill_s + ctx_s[cname],
                "decode_tps": statistics.median(tps[cname]),
                "decode_tps_all": tps[cname],
                "speedup": statistics.median(tps[cname]) / statistics.median(tps["plain"]),
                "tau": s.tau,
                "tokens": len(outs[cname][-1]),
                "identical": all(o == ref for o in outs[cname]),
                "acceptance_by_position": [a / p if p else None for a, p in
                                           zip(s.position_accepted, s.position_proposed)],
                "rounds_by_source": dict(s.rounds_by_source),
                "verify_widths": {str(m): k for m, k in sorted(s.verify_widths.items())},
                "target_cache_mb": sum(a.nbytes for c in st.cache for a in c.state if isinstance(a, mx.array)) / 2**20,
                "drafter_ctx_mb": 0.0 if ctx is None else sum(a.nbytes for a in ctx.state_arrays()) / 2**20,
                "drafter_ctx_rows": None if ctx is None else ctx.rows(),
                "decode_peak_extra_mb": peak_extra / 2**20,
            }
            rows.append(row)
            tqdm.write(line(row), file=sys.stderr)
        del bases, last
        out_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    meta["total_s"] = time.perf_counter() - tic_all
    out_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"\n{title}; decode medians of {args.repeats}; total {meta['total_s'] / 60:.1f} min")
    print(header)
    for r in rows:
        print(line(r))
    png = plot(rows, out_path.with_suffix(".png"), title)
    if png:
        print(f"plot: {png}")


if __name__ == "__main__":
    main()
