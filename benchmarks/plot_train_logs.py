"""Training curves of drafter runs side by side: accuracy at block position 1 (the drafter's greedy draft against
the label, what a round's first slot accepts) and the loss, against the sequences each run has seen.

    scripts/run python benchmarks/plot_train_logs.py c1=benchmarks/results/train/c1-log.jsonl \
        c3=benchmarks/results/train/c3-log.jsonl --out benchmarks/results/train-curves-coder15b.png

Each LOG is a ``mlx_dflash2.train fit`` ``log.jsonl`` (one JSON object per ``--log-every`` steps: ``step``,
``loss``, ``acc`` [block positions 1..B-1]); its sequences per step come from the ``*-train-config.json`` beside
it (``batch_size``; ``train_smollm2.sh`` writes ``NAME-log.jsonl`` and ``NAME-train-config.json``), else from
``LABEL=LOG:BATCH``. A run continued from another (``--init``) starts at zero here: its label should say so.
Losses of runs on a draft vocabulary (``fit --draft-vocab``) are over that set and not comparable with
whole-vocabulary losses; the accuracies are (a label outside the set counts as a miss).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_run(spec: str) -> tuple[str, list[dict], int]:
    """``LABEL=LOG[:BATCH]`` -> ``(label, log rows with a step, sequences per step)``.

    Raises:
        SystemExit: a missing file, a malformed spec or no batch size.
    """
    if "=" not in spec:
        sys.exit(f"error: {spec!r}: expected LABEL=LOG.jsonl[:BATCH]")
    label, rest = spec.split("=", 1)
    if not label or not rest:
        sys.exit(f"error: {spec!r}: expected LABEL=LOG.jsonl[:BATCH] (a label and a log)")
    path, batch = rest, ""
    head, sep, tail = rest.rpartition(":")
    if sep and not Path(rest).is_file():  # LOG:BATCH (a log whose own name holds a ':' is taken whole)
        if not (tail.isdigit() and int(tail) > 0):
            sys.exit(f"error: {spec!r}: BATCH must be a whole number of sequences per step, got {tail!r}")
        path, batch = head, tail
    p = Path(path)
    if not p.is_file():
        sys.exit(f"error: {p}: no such log")
    try:
        rows = [r for r in (json.loads(line) for line in p.read_text().splitlines() if line.strip()) if "step" in r]
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        sys.exit(f"error: {p}: not a fit log.jsonl ({e})")
    if not rows or not all(isinstance(r.get("acc"), list) and r["acc"] and "loss" in r for r in rows):
        sys.exit(f"error: {p}: no logged steps with 'acc' and 'loss' (a fit log.jsonl?)")
    if not batch:
        if not p.name.endswith("-log.jsonl"):
            sys.exit(f"error: {spec!r}: the batch size comes from NAME-train-config.json beside a NAME-log.jsonl; "
                     "give it as LABEL=LOG:BATCH")
        cfg = p.with_name(p.name.replace("-log.jsonl", "-train-config.json"))
        if not cfg.is_file():
            sys.exit(f"error: {spec!r}: no {cfg.name} beside the log; give the batch size as LABEL=LOG:BATCH")
        try:
            batch = json.loads(cfg.read_text()).get("batch_size")
        except (json.JSONDecodeError, AttributeError):
            batch = None
        if type(batch) is not int or batch < 1:
            sys.exit(f"error: {cfg}: no batch_size; give it as LABEL=LOG:BATCH")
    return label, rows, int(batch)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="LABEL=LOG[:BATCH]")
    ap.add_argument("--out", required=True, help="PNG path")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if out.suffix.lower() != ".png" or out.is_dir():
        sys.exit(f"error: --out {out}: expected a .png file path")
    runs = [read_run(s) for s in args.runs]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    # one colour per run: the default cycle repeats after 10 runs, tab20 after 20
    colours = plt.get_cmap("tab10" if len(runs) <= 10 else "tab20").colors
    for i, (label, rows, batch) in enumerate(runs):
        x = [r["step"] * batch / 1000 for r in rows]
        c = colours[i % len(colours)]
        a1.plot(x, [r["acc"][0] for r in rows], color=c, label=f"{label} ({batch}/step)")
        a2.plot(x, [r["loss"] for r in rows], color=c, label=label)
        print(f"{label}: {rows[-1]['step']} steps x {batch} = {rows[-1]['step'] * batch:,} sequences, "
              f"acc@1 {rows[-1]['acc'][0]:.3f}, loss {rows[-1]['loss']:.3f}")
    a1.set(xlabel="sequences seen (thousands)", ylabel="training accuracy at block position 1")
    a2.set(xlabel="sequences seen (thousands)", ylabel="loss")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
    except OSError as e:
        sys.exit(f"error: --out {out}: {e.strerror or e}")
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
