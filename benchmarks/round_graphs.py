"""Do a batch's rounds repeat the same sequence of MLX operations? A CPU proxy for MLX's CUDA-graph reuse.

MLX's CUDA backend records the kernels of an evaluation into CUDA graphs of up to ~100 kernels (H100/H200) and
keeps the instantiated graphs in a cache keyed by their topology (the kinds of nodes and their dependencies, not
their shapes: ``mlx/backend/cuda/device.cpp``, ``CommandEncoder::commit``). A round that evaluates the same
operations as an earlier one (shapes aside) reuses its graphs; a round whose operations differ, even by one early
``Pad``, shifts every later graph's boundary and instantiates new ones. Session 52 measured that price on an H100
(a drafting round at 8 rows: 45-82 ms with graphs, 14 ms without), which is why ``--cuda-graphs auto`` turns graphs
off for servers that batch drafting rows.

This script counts, on any backend, how many distinct operation sequences a batch's rounds evaluate: ``N`` chat
requests (``bench_server.py``'s prompts) join one :class:`~mlx_dflash2.batch.SpeculativeBatch`, every round runs
at the width cap ``--cap`` (1: plain rounds), and each round's graphs are walked with ``mx.export_to_dot``
into their sequence of primitive names: what the round evaluates before its forward is queued (``mx.eval``,
``.tolist()``, ``.item()``: the drafter's forward where a dynamic draft length reads its confidence, at caps of 3
or more) and what it hands to ``mx.async_eval`` (its target forward, accept, and the drafter work it carries).
Reported per configuration: the rounds, the distinct sequences among them, the node counts, for consecutive
rounds that differ where the first difference lies and which primitives differ there (the places a shape-stable
round has to fix first), and the distinct sequences once the primitives MLX evaluates as views (:data:`VIEWS`: a
``Slice``, a ``Broadcast``, no kernel) are left out, the closer proxy of the kernels a GPU records.

    scripts/run python benchmarks/round_graphs.py --concurrency 8 --cap 1,2 --rounds 16
    scripts/run python benchmarks/round_graphs.py --concurrency 8 --cap 2 --rounds 16 --drafter none

The count is of MLX primitives, not CUDA kernels (a view launches none; a CUDA twin of the kernel registry, or
a fused ``mx.fast`` op that the CPU runs as several primitives (RoPE, attention), runs as one kernel), so equal
sequences here are what reusable graphs there need (not all: a copy that MLX inserts for a strided input is not
counted), while unequal ones point at where reuse breaks.
"""

from __future__ import annotations

import argparse
import difflib
import io
import json
import re
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # this checkout
import mlx_dflash2  # noqa: F401,E402  (before MLX: loads the optimized OpenBLAS)
import mlx.core as mx  # noqa: E402

from bench_server import prompts  # noqa: E402

from mlx_dflash2.batch import SpeculativeBatch, WidthSchedule  # noqa: E402
from mlx_dflash2.loading import load  # noqa: E402


class FixedCap(WidthSchedule):
    """A width schedule that runs every round at one cap (a lone row's too; no trials, no measurements)."""

    def __init__(self, cap: int):
        super().__init__()
        self.cap = cap

    def choose(self, n_rows: int, max_width: int, explore: bool = True) -> int | None:
        return self.cap


def op_sequence(arrays) -> list[str]:
    """The primitive names of the lazy graph behind ``arrays`` (nested lists allowed), in ``mx.export_to_dot``'s
    order (deterministic for one graph); evaluated arrays contribute no nodes. A ``Concatenate`` is named with its
    input count (``Concatenate/5``): a GPU copies each input with a kernel of its own, so two concatenations of
    different counts are different graphs (the breaker helper of session 54)."""
    flat, todo = [], list(arrays)
    while todo:
        a = todo.pop(0)
        if isinstance(a, (list, tuple)):
            todo[:0] = list(a)
        elif isinstance(a, mx.array):
            flat.append(a)
    if not flat:
        return []
    f = io.StringIO()
    mx.export_to_dot(f, *flat)
    dot = f.getvalue()
    nodes = re.findall(r'\{ (\w+) \[label ="?([A-Za-z_0-9]+)', dot)
    inputs = Counter(dst for _, dst in re.findall(r'"(\w+)" -> (\w+)', dot))
    return [f"{name}/{inputs[i]}" if name == "Concatenate" else name for i, name in nodes]


@contextmanager
def recording_async_eval(sink: list):
    """Within the block, every ``mx.async_eval`` call first records its graph's :func:`op_sequence` into ``sink``,
    and so does every evaluation before the first of them (``mx.eval``, and an unevaluated array's ``.tolist()``
    or ``.item()``: a round's reads before its forward is queued, such as a dynamic draft length's confidence).
    Later evaluations read what ``mx.async_eval`` already took and are not recorded; empty graphs neither. This
    script's process only; restored on exit."""
    orig_async, orig_eval, orig_tolist, orig_item = mx.async_eval, mx.eval, mx.array.tolist, mx.array.item
    queued = [False]

    def record(arrays):
        seq = op_sequence(arrays)
        if seq:
            sink.append(seq)

    def spy_async(*arrays):
        record(arrays)
        queued[0] = True
        return orig_async(*arrays)

    def spy_eval(*arrays):
        if not queued[0]:
            record(arrays)
        return orig_eval(*arrays)

    def spy_tolist(self):
        if not queued[0]:
            record([self])
        return orig_tolist(self)

    def spy_item(self):
        if not queued[0]:
            record([self])
        return orig_item(self)

    mx.async_eval, mx.eval, mx.array.tolist, mx.array.item = spy_async, spy_eval, spy_tolist, spy_item
    try:
        yield
    finally:
        mx.async_eval, mx.eval, mx.array.tolist, mx.array.item = orig_async, orig_eval, orig_tolist, orig_item


#: primitives that MLX evaluates as views of their input (strides and an offset, no kernel launched on a GPU), so
#: they add no node to a CUDA graph: a difference only in these (say a ``Slice`` that MLX elides where it would take
#: a whole array) changes no graph
VIEWS = frozenset({"Broadcast", "ExpandDims", "Squeeze", "Slice", "Transpose", "AsStrided", "StopGradient"})


def kernels_only(seq) -> tuple:
    """``seq`` without the :data:`VIEWS` primitives: the proxy of the kernels a GPU launches."""
    return tuple(x for x in seq if x not in VIEWS)


def first_differences(a: list[str], b: list[str], limit: int = 4) -> dict:
    """Where two rounds' sequences first differ and the primitives of their first ``limit`` differing spans."""
    ops = [o for o in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes() if o[0] != "equal"]
    return {"first": ops[0][1] if ops else None, "spans": len(ops),
            "diffs": [{"kind": t, "before": dict(Counter(a[i1:i2]).most_common(5)),
                       "after": dict(Counter(b[j1:j2]).most_common(5))} for t, i1, i2, j1, j2 in ops[:limit]]}


def run(model, tok, n: int, cap: int, rounds: int, skip: int, use_drafter: bool) -> dict:
    """``n`` requests joined at once, ``skip`` rounds run first (joins, first appends), then ``rounds`` rounds
    recorded at ``cap``; returns the counts and the first differences of consecutive recorded rounds."""
    batch = SpeculativeBatch(model.target, schedule=FixedCap(cap))
    for p in prompts(n):
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        batch.add(ids, max_tokens=skip + rounds * 16 + 64, proposer=model.proposer if use_drafter else None)
    for _ in range(skip):
        batch.step()
    if batch.active < n:
        raise RuntimeError(f"a request finished in the {skip} rounds before recording: fewer --skip rounds")
    seqs, widths, evals = [], [], []  # evals: per round, each evaluation's kernels' proxy
    for _ in range(rounds):
        sink: list = []
        with recording_async_eval(sink):
            batch.step()
        evals.append(tuple(k for k in (kernels_only(s) for s in sink) if k))  # (views only: no graph)
        seqs.append(tuple(x for s in sink for x in s))
        widths.append(batch.last_round["width"])
        if batch.active < n:
            break  # a request finished: the rows changed
    sizes = [len(s) for s in seqs]
    kern = [kernels_only(s) for s in seqs]
    diffs = [first_differences(list(a), list(b)) for a, b in zip(seqs, seqs[1:]) if a != b]
    kdiffs = [first_differences(list(a), list(b)) for a, b in zip(kern, kern[1:]) if a != b]
    return {"rows": n, "cap": cap, "drafter": use_drafter, "rounds": len(seqs), "widths": sorted(set(widths)),
            "distinct": len(set(seqs)), "nodes_min": min(sizes, default=0), "nodes_max": max(sizes, default=0),
            "first_difference_median": (sorted(d["first"] for d in diffs)[len(diffs) // 2] if diffs else None),
            "differences": diffs[:3],
            "distinct_without_views": len(set(kern)), "kernel_differences": kdiffs[:3],
            # (MLX cuts each evaluation into its own graphs: where every round makes the same evaluations, how many
            # distinct sequences each of them had, e.g. [3, 1] for a drafter forward evaluated apart whose rows
            # change and a target forward that stays the same)
            "distinct_per_evaluation": ([len({e[k] for e in evals}) for k in range(len(evals[0]))]
                                        if evals and len({len(e) for e in evals}) == 1 else None),
            # the last evaluation of each round: its target forward (with what it carries)
            "distinct_last_evaluation": len({e[-1] for e in evals if e})}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (default: the embedded SmolLM2)")
    ap.add_argument("--drafter", default="auto", help="the model's proposer for drafting rows (none: plain rows)")
    ap.add_argument("--dtype", default="bfloat16", help="as a GPU server runs it (default bfloat16)")
    ap.add_argument("--concurrency", default="8", help="rows, comma-separated")
    ap.add_argument("--cap", default="1,2", help="width caps, comma-separated (1: plain rounds)")
    ap.add_argument("--rounds", type=int, default=12, help="rounds recorded per configuration")
    ap.add_argument("--skip", type=int, default=3, help="rounds run before recording (the joins' prefill, ...)")
    ap.add_argument("--drafts-apart", choices=["default", "always", "never"], default="default",
                    help="batch.DRAFTS_APART: the drafter forward evaluated apart from the target forward (default: "
                    "the module's, which on this CPU is never)")
    ap.add_argument("--out", default=None, help="JSON results")
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds must be at least 2")
    from mlx_dflash2 import assets, batch

    if args.drafts_apart != "default":
        batch.DRAFTS_APART = args.drafts_apart

    model, tok = load(args.model or assets.embedded_model_path(), args.drafter, dtype=args.dtype)
    use_drafter = args.drafter != "none"
    results = []
    for n in [int(x) for x in args.concurrency.split(",")]:
        for cap in [int(x) for x in args.cap.split(",")]:
            r = run(model, tok, n, cap, args.rounds, args.skip, use_drafter)
            results.append(r)
            print(f"{n} rows, cap {cap}{' (drafter)' if use_drafter else ''}: {r['distinct']} distinct operation "
                  f"sequences in {r['rounds']} rounds (widths {r['widths']}), {r['nodes_min']}-{r['nodes_max']} "
                  f"nodes, first difference at node {r['first_difference_median']} (median); without views "
                  f"(the kernels' proxy): {r['distinct_without_views']} distinct, per evaluation "
                  f"{r['distinct_per_evaluation']}, the last (the target forward) {r['distinct_last_evaluation']}",
                  flush=True)
            for d in (r["kernel_differences"] or r["differences"])[:1]:
                for x in d["diffs"]:
                    print(f"    {x['kind']}: {x['before']} -> {x['after']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
        print(f"results: {args.out}")


if __name__ == "__main__":
    main()
