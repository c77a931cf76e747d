"""What a draft vocabulary (``fit --draft-vocab``) and mixed precision (``fit --compute-dtype``) save a drafter's
training step.

One training step of a DFlash2 drafter (``dflash_loss`` forward and backward, gradient clipping, AdamW:
what ``Trainer`` runs after the target's forward) on a random-weight target of a given shape, with the
whole vocabulary and with draft vocabularies of the given sizes (each in every ``--compute-dtypes`` value: the
drafter's forward and backward in float32, or in bfloat16 over its float32 weights), timed as a dependent chain
(each step updates the drafter the next one reads), interleaved, medians. The target's own forward (the context
features and the teacher's states) is the same in every arm: it is timed once, so the table also says what
share of a whole step the change saves. Issue 21's recipe: distillation, target labels, half the blocks in
the selector loss.

    scripts/run python benchmarks/bench_train_vocab.py --shape qwen2.5-1.5b --sizes 0,32768 \\
        --out benchmarks/results/train-vocab-cpu.json
    scripts/run python benchmarks/bench_train_vocab.py --sizes 32768 --compute-dtypes float32,bfloat16 ...

Not a test: a measurement (numbers vary with the machine and its load).
"""

from __future__ import annotations

import random_targets as rt  # noqa: I001  (imports mlx_dflash2 before MLX)

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map

from mlx_dflash2.drafter.io import init_drafter
from mlx_dflash2.target import TargetAdapter
from mlx_dflash2.train.trainer import COMPUTE_DTYPES, DraftVocab, dflash_loss, make_update, value_and_grad_in


def _target(shape: str, layers: int | None, dtype) -> tuple[TargetAdapter, int]:
    cfg = dict(rt.SHAPES[shape])
    if layers:
        cfg["num_hidden_layers"] = layers
    rt.SHAPES["_bench"] = cfg
    model, full = rt.build_target("_bench", bits=0, dtype=dtype)
    return TargetAdapter(model, full, probe=False), cfg["vocab_size"]


def plot(res: dict, path: str | Path) -> None:
    """Bars of each arm's median step: the drafter's part and the target's forward stacked (``res`` as written)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(res["arms"])
    names = []
    for a in arms:
        n, _, cdt = a.partition("/")
        names.append(f"{int(n) or res['vocab']:,}" + (" (whole)" if n == "0" else "") + (f"\n{cdt}" if cdt else ""))
    drafter = [res["arms"][n]["median_s"] for n in arms]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.bar(names, [res["target_forward_s"]] * len(arms), color="0.75", label="target forward (the same)")
    ax.bar(names, drafter, bottom=[res["target_forward_s"]] * len(arms), color="C0", label="drafter step")
    for i, d in enumerate(drafter):
        ax.text(i, res["target_forward_s"] + d, f"{d:.2f} s", ha="center", va="bottom")
    ax.set_ylim(0, (res["target_forward_s"] + max(drafter)) * 1.15)
    ax.set_xlabel("draft vocabulary (ids)" + (", compute dtype" if any("/" in a for a in arms) else ""))
    ax.set_ylabel("seconds per training step")
    ax.set_title(f"{res['shape']}, {res['rows']} rows, {res.get('labels', 'target')} labels", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-1.5b", help=f"target shape, of {', '.join(rt.SHAPES)}")
    p.add_argument("--target-layers", type=int, default=None, help="layers of the target (default: the shape's)")
    p.add_argument("--sizes", default="0,32768", help="draft vocabulary sizes, comma-separated (0: the whole)")
    p.add_argument("--compute-dtypes", default="float32",
                   help=f"the drafter's compute dtypes, comma-separated, of {', '.join(COMPUTE_DTYPES)} (fit "
                   "--compute-dtype: mixed precision over float32 weights); every size runs in each")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    p.add_argument("--anchors", type=int, default=16, help="blocks per sequence")
    p.add_argument("--max-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--layers", type=int, default=4, help="drafter layers")
    p.add_argument("--intermediate", type=int, default=3072, help="drafter MLP width (issue 21's c1: 3,072)")
    p.add_argument("--labels", default="target", choices=["target", "data"],
                   help="target: the teacher's argmax (issue 21's recipe; with a draft vocabulary one forward of the "
                   "whole head remains); data: the data's tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per arm (after one warm-up step each)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="target dtype (default: float32 on the CPU, bfloat16 on a GPU)")
    p.add_argument("--eager-update", action="store_true",
                   help="clip + AdamW uncompiled (before the trainer compiled its update): the update's share")
    p.add_argument("--compile", action="store_true",
                   help="each arm's whole step mx.compile'd, as `fit --compile` (the first step, reported apart, "
                   "traces and builds it)")
    p.add_argument("--out", default=None, help="write the results as JSON, and a plot beside it (.png)")
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    cdts = a.compute_dtypes.split(",")
    if not cdts or any(c not in COMPUTE_DTYPES for c in cdts) or len(set(cdts)) < len(cdts):
        p.error(f"--compute-dtypes: distinct values of {', '.join(COMPUTE_DTYPES)}, got {a.compute_dtypes!r}")
    dtype = getattr(mx, a.dtype or ("float32" if mx.default_device() == mx.cpu else "bfloat16"))
    target, V = _target(a.shape, a.target_layers, dtype)
    rt.log(f"target {a.shape} ({target.num_layers} layers, vocab {V}, {dtype})")
    d = init_drafter(target, rt.StubTokenizer(V), num_layers=a.layers, block_size=16, num_taps=5,
                     intermediate_size=a.intermediate, mask_token_id=V - 2, selector_rank=32, selector_top_k=16)
    d.update(tree_map(lambda x: x.astype(mx.float32), d.parameters()))
    mx.eval(d.parameters())
    N, A, T, Bm1 = a.batch_size, a.anchors, a.max_len, 15
    rng = np.random.RandomState(0)
    tokens = mx.array(rng.randint(100, V - 100, size=(N, T)).astype(np.int32))
    anchors = mx.array(np.sort(np.stack([rng.choice(np.arange(1, T - 16), A, replace=False) for _ in range(N)]), 1)
                       .astype(np.int32))
    times = []  # the first forward builds kernels: the median of three (session 31 reported the first alone)
    for _ in range(3):
        t0 = time.perf_counter()
        feats, final = target.taps(tokens, tuple(d.config.target_layer_ids), final=True)
        mx.eval(feats, final)
        times.append(time.perf_counter() - t0)
    target_s = sorted(times)[1]
    pos = mx.minimum(anchors[..., None] + mx.arange(Bm1)[None, None, :], T - 1).reshape(N, -1)
    states = mx.take_along_axis(final, pos[..., None], axis=1).reshape(N * A, Bm1, -1)
    labels = mx.zeros((N, A, Bm1), dtype=mx.int32)
    valid = mx.ones((N, A, Bm1), dtype=mx.bool_)
    weights = mx.array([np.exp(-(k - 1) / 7) for k in range(1, 16)], dtype=mx.float32)
    mx.eval(states)
    rt.log(f"target forward of {N} x {T} tokens: {target_s:.2f} s")
    # a frequency-ranked set is what the product uses; for the step's cost any ids of that size do
    vocabs = {}
    for n in sizes:
        vocabs[n] = None if n == 0 else DraftVocab.build(target, sorted(rng.choice(V, n, replace=False).tolist()), V)
    # arms: (size, compute dtype); keys "N" with one compute dtype (as before), "N/dtype" with several
    arms = {(str(n) if len(cdts) == 1 else f"{n}/{c}"): (n, c) for n in sizes for c in cdts}
    opt = {k: optim.AdamW(learning_rate=1e-5) for k in arms}

    def make_step(k):  # as the trainer's (Trainer._update_fn)
        n, c = arms[k]
        update = make_update(d, opt[k], 1.0, compiled=not (a.eager_update or a.compile))

        def fn(feats, tokens, anchors, labels, valid, weights, alpha, states):
            def loss_fn(model):
                return dflash_loss(model, target, feats, tokens, anchors, labels, valid, weights, alpha,
                                   valid_vocab=V, teacher_states=states, kd_weight=1.0, selector_fraction=0.5,
                                   target_labels=a.labels == "target", draft_vocab=vocabs[n])

            (loss, _), grads = value_and_grad_in(d, loss_fn, c)(d)
            return loss, update(grads)

        if a.compile:
            state = [d.state, opt[k].state]
            fn = mx.compile(fn, inputs=state, outputs=state)
        return fn

    steps = {k: make_step(k) for k in arms}
    alpha = mx.array(1.0, dtype=mx.float32) if a.compile else 1.0  # an input of a compiled step, as the trainer's

    def step(k):
        loss, _ = steps[k](feats, tokens, anchors, labels, valid, weights, alpha, states)
        mx.eval(d.parameters(), opt[k].state, loss)

    times = {k: [] for k in arms}
    first_s = {}
    for k in arms:
        t = time.perf_counter()
        step(k)  # warm-up (with --compile: the trace and the kernels' build)
        first_s[k] = time.perf_counter() - t
        rt.log(f"first step {k}: {first_s[k]:.2f} s")
    for r in range(a.repeats):
        for k in arms:
            t = time.perf_counter()
            step(k)
            times[k].append(time.perf_counter() - t)
        rt.log(f"repeat {r + 1}/{a.repeats}: " + ", ".join(f"{k} {times[k][-1]:.2f} s" for k in arms))
    rows = N * A * Bm1
    first = next(iter(arms))
    whole = rt.median(times[first])
    res = {"meta": rt.device_meta(), "shape": a.shape, "target_layers": target.num_layers, "vocab": V,
           "rows": rows, "labels": a.labels, "batch_size": N, "anchors": A, "max_len": T, "drafter_layers": a.layers,
           "intermediate": a.intermediate, "compute_dtypes": cdts, "eager_update": a.eager_update,
           "compiled_step": a.compile,
           "target_forward_s": target_s, "arms": {}}
    print(f"\n{a.shape}, {rows} rows (blocks x positions) per step, {a.labels} labels; target forward "
          f"{target_s:.2f} s" + ("; whole step compiled, first step (trace and build) "
                                 + ", ".join(f"{first_s[k]:.1f} s" for k in arms) if a.compile else ""))
    print("| draft vocabulary | compute dtype | drafter step (median) | vs first arm | step incl. target forward |")
    print("|---|---|---:|---:|---:|")
    for k, (n, c) in arms.items():
        m = rt.median(times[k])
        res["arms"][k] = {"step_s": times[k], "median_s": m, "size": n, "compute_dtype": c, "first_step_s": first_s[k]}
        print(f"| {n or V:,}{' (whole)' if n == 0 else ''} | {c} | {m:.3f} s | {whole / m:.2f}x | "
              f"{(whole + target_s) / (m + target_s):.2f}x |")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        plot(res, Path(a.out).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
