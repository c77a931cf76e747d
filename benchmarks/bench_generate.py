"""Plain vs speculative decoding on the same target, in one run.

For every prompt and drafter it runs plain greedy decoding (the loop without a
drafter, pipelined like mlx-lm) and speculative decoding, checks that the
tokens are identical, and reports medians over ``--repeats`` of decode tokens/s,
the speedup ratio and the acceptance length tau. Results go to a JSON file and,
if matplotlib is installed, to a plot of speedup and tau per prompt.

    scripts/run python benchmarks/bench_generate.py --drafter lookup --max-tokens 96
    scripts/run python benchmarks/bench_generate.py --dequantize --dtype float32 --drafter lookup
    scripts/run python benchmarks/bench_generate.py --dequantize --dtype float32 --drafter auto --calibrate off,cached

``--calibrate`` runs each adaptive drafter with the schedule's calibrated verify widths (``cached``: the
cached calibration, measured when missing, as ``load`` does; ``rerun``: measured again) or without them
(``off``: full blocks, the behaviour before session 11); rows record the rounds by verified width.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx_dflash2  # noqa: F401,E402  (before MLX: loads the optimized OpenBLAS, mlx_dflash2/_blas.py)
import mlx.core as mx
import numpy as np

from mlx_dflash2.loading import default_min_confidence, load_target, make_proposer
from mlx_dflash2.proposers import DFlashProposer, FusedProposer, check_confidence
from mlx_dflash2.speculative import SpecStats, speculative_generate_step

PROMPTS = {
    "chat": "What is the capital of France? Describe the city in a few sentences.",
    "code": "Write a Python function that checks whether a number is prime, with a docstring.",
    "math": "A train travels 60 km in 45 minutes. What is its average speed in km/h? Explain step by step.",
    "repeat": (
        "Repeat this paragraph exactly, word for word:\n\nThe old lighthouse stood at the edge of the cliff, "
        "its white paint peeling in the salty wind. Every night the keeper climbed the spiral stairs to light "
        "the lamp for the passing ships."
    ),
}


def _confidences(text: str) -> list:
    """``--min-confidence``: comma-separated ``auto`` or numbers in ``[0, 1)``."""
    out = []
    for c in text.split(","):
        if c.strip() == "auto":
            out.append("auto")
            continue
        try:
            out.append(check_confidence(float(c), "--min-confidence"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"each value must be 'auto' or a number in [0, 1), got {c!r}") from None
    return out


CALIBRATE = {"cached": None, "rerun": True, "off": False}


def _calibrations(text: str) -> list[str]:
    """``--calibrate``: comma-separated values of :data:`CALIBRATE`."""
    out = [c.strip() for c in text.split(",")]
    bad = [c for c in out if c not in CALIBRATE]
    if bad:
        raise argparse.ArgumentTypeError(f"each value must be one of {', '.join(CALIBRATE)}, got {bad[0]!r}")
    return out


def run_once(target, ids, proposer, block_size, max_tokens):
    stats = SpecStats()
    toks = [
        t
        for t, _, _ in speculative_generate_step(
            ids, target, proposer, block_size=block_size, max_tokens=max_tokens, stats=stats
        )
    ]
    return toks, stats


def plot(rows: list[dict], path: Path, title: str) -> Path | None:
    """Speedup and tau per prompt, one bar per drafter (None without matplotlib).
    ``python benchmarks/bench_generate.py --replot results/generate-*.json`` redraws saved runs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    prompts = list(dict.fromkeys(r["prompt"] for r in rows))
    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    width = 0.8 / len(drafters)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, ylabel in ((axes[0], "speedup", "speedup vs plain (decode tok/s)"), (axes[1], "tau", "acceptance length tau")):
        for j, d in enumerate(drafters):
            vals = [next((r[key] for r in rows if r["prompt"] == p and r["drafter"] == d), 0) for p in prompts]
            ax.bar(np.arange(len(prompts)) + j * width, vals, width, label=d)
        ax.set_xticks(np.arange(len(prompts)) + width * (len(drafters) - 1) / 2, prompts)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel(ylabel)
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafter", action="append", default=None, help="repeatable; default: lookup")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", default=",".join(PROMPTS), help="comma-separated subset of " + ",".join(PROMPTS))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--dequantize", action="store_true")
    ap.add_argument("--min-confidence", default="auto", type=_confidences,
                    help="drafters: dynamic draft length (DFlashProposer min_confidence; 0 = full blocks; auto = "
                    "the product's default for this device); a comma-separated list runs each value")
    ap.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                    help="run the drafters under the adaptive schedule (default: only 'auto'); its state carries "
                         "over the repeats of a row, as in a long-running server")
    ap.add_argument("--calibrate", default="cached", type=_calibrations,
                    help="adaptive drafters: comma-separated 'cached' (the calibrated verify widths, measured when "
                         "missing), 'rerun' (measured again) and/or 'off' (full blocks); each value is run")
    ap.add_argument("--out", default="benchmarks/results/generate.json")
    ap.add_argument("--replot", default=None, metavar="JSON", help="only redraw the plot of a saved run")
    args = ap.parse_args(argv)
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        m = saved["meta"]
        print(plot(saved["rows"], Path(args.replot).with_suffix(".png"), f"{Path(m.get('target') or 'embedded model').name} on {m['device']}"))
        return

    from tqdm import tqdm

    target, tok, name = load_target(args.model, dtype=args.dtype, dequantize=args.dequantize)
    drafters = args.drafter or ["lookup"]
    prompts = {k: PROMPTS[k] for k in args.prompts.split(",")}
    meta = {
        "target": Path(str(name)).name,  # the model's name, not this machine's path
        "dtype": args.dtype,
        "dequantize": args.dequantize,
        "device": str(mx.default_device()),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "adaptive": args.adaptive,
        "calibrate": args.calibrate,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    header = (f"{'prompt':8} {'drafter':56} {'B':>3} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>8} "
              f"{'tau':>6} same")

    def line(r):
        return (f"{r['prompt']:8} {r['drafter']:56} {r['block_size']:>3} {r['plain_tps']:>11.2f} "
                f"{r['spec_tps']:>10.2f} {r['speedup']:>7.2f}x {r['tau']:>6.2f} {'yes' if r['identical'] else 'NO'}")

    rows = []
    confs = [default_min_confidence() if c == "auto" else c for c in args.min_confidence]
    jobs = [(p, d, c, cal) for p in prompts for d in drafters for c in confs for cal in args.calibrate]
    calibrations = {}
    for pname, dname, conf, cal in tqdm(jobs, desc="benchmark", file=sys.stderr):
        ids = tok.apply_chat_template([{"role": "user", "content": prompts[pname]}], add_generation_prompt=True)
        proposer = make_proposer(dname, target, tok, name, dequantize=args.dequantize, min_confidence=conf,
                                 adaptive=args.adaptive, calibrate=CALIBRATE[cal], block_size=args.block_size)
        drafts = isinstance(proposer, (DFlashProposer, FusedProposer))
        if not drafts:  # lookup / plain: the threshold does not apply, run them once
            if conf != confs[0]:
                continue
            conf = 0.0
        scheduled = isinstance(proposer, FusedProposer) and proposer.schedule is not None
        if not scheduled and cal != args.calibrate[0]:  # no schedule, no widths to calibrate: run once
            continue
        costs = getattr(proposer, "calibration", None)
        if costs is not None:
            calibrations[cal] = {"ratios": costs.ratios(), "drafter_s": costs.drafter_s, "verify_s": costs.verify_s,
                                 "meta": costs.meta}
        B = args.block_size or (proposer.block_size if proposer else 1)
        plain_tps, spec_tps, taus, widths = [], [], [], {}
        run_once(target, ids, None, 1, 8)  # warm-up
        for _ in range(args.repeats):
            ref, ps = run_once(target, ids, None, 1, args.max_tokens)
            out, ss = run_once(target, ids, proposer, B, args.max_tokens)
            if out != ref:
                i = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
                print(f"warning: {pname}/{dname}: output differs from plain at token {i}", file=sys.stderr)
            plain_tps.append(ps.decode_tps)
            spec_tps.append(ss.decode_tps)
            taus.append(ss.tau)
            for m, k in ss.verify_widths.items():
                widths[m] = widths.get(m, 0) + k
        rows.append(
            {
                "prompt": pname,
                # the drafter argument is named too: two checkpoints of one architecture, or `shipped` and
                # `auto` under --adaptive, stay apart
                "drafter": (ss.drafter if dname in ("lookup", "none")
                            else f"{ss.drafter} ({dname})" if dname in ("shipped", "init", "auto")
                            else f"{ss.drafter} ({Path(dname).name})") + (f" c={conf:g}" if conf else "")
                + ((" widths" if costs is not None else " full") if scheduled else ""),
                "min_confidence": conf,
                "calibrate": cal if scheduled else None,
                "block_size": B,
                "tokens": len(out),
                "identical": out == ref,
                "plain_tps": statistics.median(plain_tps),
                "spec_tps": statistics.median(spec_tps),
                "speedup": statistics.median(s / p for s, p in zip(spec_tps, plain_tps)),
                "tau": statistics.median(taus),
                "acceptance_by_position": [
                    a / p if p else None for a, p in zip(ss.position_accepted, ss.position_proposed)
                ],
                "verify_widths": {str(m): k for m, k in sorted(widths.items())},  # rounds by rows, all repeats
            }
        )
        meta["calibrations"] = calibrations
        # each finished row is printed and saved at once: a run cut short (a device call's time limit)
        # keeps what it measured
        tqdm.write(line(rows[-1]) + "  widths " + " ".join(f"{m}:{k}" for m, k in rows[-1]["verify_widths"].items()),
                   file=sys.stderr)
        out_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")

    print(
        f"\n{name} on {meta['device']} (dequantize={args.dequantize}, dtype={args.dtype}); "
        f"medians of {args.repeats}, {args.max_tokens} tokens"
    )
    print(header)
    for r in rows:
        print(line(r))
    png = plot(rows, out_path.with_suffix(".png"), f"{name} on {meta['device']}")
    if png:
        print(f"plot: {png}")
    print(f"results: {out_path}")


if __name__ == "__main__":
    main()
